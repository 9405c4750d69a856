"""Rewrite the few non-pointwise aten forms a traced step uses for elementwise work into pointwise ones.

- A tensor constant the step made (Rprop's ``sign[...] = 1``, ASGD's ``torch.as_tensor(1.0)``) is a
  ``get_attr`` of the traced module plus ``lift_fresh_copy``; it becomes ``aten.scalar_tensor`` of
  its value, so the graph is self-contained and splits like any other scalar computation.
- ``detach`` (``detach_copy`` once functionalized; SGD's ``grad.detach().clone()``) is its input:
  the step runs without autograd, so there is nothing to detach from.
- ``copy(dst, src)`` (a functionalized ``dst.copy_(src)``, ASGD's ``ax.copy_(param)``) with
  ``src`` already of ``dst``'s shape and dtype is ``src``.
- ``x[mask] = v`` with a boolean ``mask`` shaped like ``x`` and a single value ``v`` (Rprop) is an
  ``index_put``, which is not tagged pointwise; it is ``where(mask, v, x)``, value for value (``v``
  is cast to ``x``'s dtype either way).

Anything else is left for ``roles`` to accept or refuse.
"""

from __future__ import annotations

import copy

import torch
from torch.fx import GraphModule, Node

aten = torch.ops.aten


def elementwise_forms(gm: GraphModule) -> GraphModule:
    """Return a copy of ``gm`` with scalar tensor constants, detaches, copies and masked fills in
    pointwise form."""
    gm = copy.deepcopy(gm)
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op == "get_attr":
            _constant_to_scalar_tensor(gm, node)
        elif node.target in (aten.detach_copy.default, aten.detach.default):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
        elif node.target is aten.copy.default and _same_meta(*node.args[:2]):
            node.replace_all_uses_with(node.args[1])
            graph.erase_node(node)
        elif node.target is aten.index_put.default and _is_masked_fill(node):
            self_, (mask,), value = node.args[:3]
            with graph.inserting_before(node):
                where = graph.call_function(aten.where.self, (mask, value, self_))
            where.meta = dict(node.meta)
            node.replace_all_uses_with(where)
            graph.erase_node(node)
    graph.lint()
    gm.recompile()
    return gm


def _constant_to_scalar_tensor(gm: GraphModule, node: Node) -> None:
    graph = gm.graph
    value = getattr(gm, node.target)
    if not isinstance(value, torch.Tensor) or value.dim() != 0:
        raise NotImplementedError(
            f"the optimizer's step uses a constant {type(value).__name__} {node.target!r} "
            f"(shape {tuple(getattr(value, 'shape', ()))}); lowbit-compile supports 0-d tensor constants only"
        )
    with graph.inserting_before(node):
        scalar = graph.call_function(
            aten.scalar_tensor.default, (value.item(),), {"dtype": value.dtype, "device": value.device}
        )
    scalar.meta = dict(node.meta)
    for user in list(node.users):
        if user.target is aten.lift_fresh_copy.default:  # a fresh copy of a fresh tensor: the tensor
            user.replace_all_uses_with(scalar)
            graph.erase_node(user)
    node.replace_all_uses_with(scalar)
    graph.erase_node(node)
    if hasattr(gm, node.target):
        delattr(gm, node.target)


def _same_meta(a: object, b: object) -> bool:
    x, y = (n.meta.get("val") if isinstance(n, Node) else None for n in (a, b))
    return isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape and x.dtype == y.dtype


def _is_masked_fill(node: Node) -> bool:
    """``index_put(x, [mask], v, accumulate=False)`` with ``mask`` a bool tensor shaped like ``x``
    and ``v`` a single value."""
    self_, indices, value = node.args[:3]
    accumulate = node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)
    if accumulate or len(indices) != 1 or not isinstance(indices[0], Node) or not isinstance(value, Node):
        return False
    x, mask, v = (n.meta.get("val") for n in (self_, indices[0], value))
    if not all(isinstance(t, torch.Tensor) for t in (x, mask, v)):
        return False
    return mask.dtype == torch.bool and mask.shape == x.shape and v.dim() == 0
