"""Label each input of a traced step with its role and refuse steps that are not elementwise.

The trace labels each state entry ``Role.STATE``; this pass tells ``PER_ELEMENT_STATE`` (shaped like
the param) from ``SCALAR_STATE`` (e.g. the step count) and marks which nodes compute per element.
Every node that computes from a per-element value must be a pointwise aten op (or a copy back into a
per-element input): a reduction or reshape over the parameter cannot be run one block at a time, so
it is refused with the op's name, unless the step is *staged* (traced at the parameter's shape, see
``passes.stages``): then such a node is marked whole-tensor, to run as a torch op.
"""

from __future__ import annotations

import copy

import torch
from torch.fx import GraphModule, Node
from torch.utils._pytree import tree_flatten

from ..ir.contract import (
    PER_ELEMENT_ROLES,
    GraphInput,
    Role,
    input_of,
    is_per_element,
    role_of,
    set_input,
    set_per_element,
    set_whole_tensor,
)

aten = torch.ops.aten

_ALLOWED_NON_POINTWISE = frozenset({aten.copy_.default, aten.copy.default, aten.clone.default, aten.alias.default})


class NotElementwiseError(NotImplementedError):
    """The optimizer's step mixes elements of a parameter (a norm, a sum, a reshape)."""


def _val(node: Node):
    return node.meta.get("val")


def label_roles(gm: GraphModule, staged: bool = False) -> GraphModule:
    """Return a copy of ``gm`` whose state inputs are labelled per-element or scalar and whose nodes
    are marked per element or not (``kernels.contract``); raise :class:`NotElementwiseError` on a
    non-elementwise step, or with ``staged`` mark its non-elementwise nodes whole-tensor."""
    gm = copy.deepcopy(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    param_shape = next(_val(n).shape for n in placeholders if role_of(n) is Role.PARAM)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            desc = input_of(node)
            if desc.role is Role.STATE:
                shaped = tuple(_val(node).shape) == tuple(param_shape)
                desc = GraphInput(Role.PER_ELEMENT_STATE if shaped else Role.SCALAR_STATE, desc.key)
                set_input(node, desc)
            set_per_element(node, desc.role in PER_ELEMENT_ROLES)
        elif node.op == "call_function":
            args, _ = tree_flatten((node.args, node.kwargs))
            touches = any(isinstance(a, Node) and is_per_element(a) for a in args)
            set_per_element(node, touches)
            # a write into a state that is not per element (Adafactor's row factor of a column vector, of
            # the param's shape) is no kernel's: the kernels write back per-element states only
            into_scalar = node.target is aten.copy_.default and role_of(node.args[0]) is Role.SCALAR_STATE
            if touches and (into_scalar or not (_elementwise(node, param_shape)
                                                or staged and _cast(node, param_shape))):
                if not staged:
                    raise NotElementwiseError(
                        f"the optimizer's step applies {node.target} to a per-element tensor "
                        f"(node {node.name!r}); lowbit-compile only rewrites steps that are elementwise over "
                        "each parameter (no norms, sums or reshapes across it)"
                    )
                set_whole_tensor(node)
    return gm


def _cast(node: Node, param_shape: torch.Size) -> bool:
    """A dtype cast of a per-element value (Muon's ``.bfloat16()``, a 16-bit param's write-back of an
    update promoted to fp32): a staged step's elementwise stage computes it, instead of a whole-tensor
    stage (at half the bytes of the fp32 value, where it makes a temporary)."""
    return (node.target is aten._to_copy.default and set(node.kwargs) <= {"dtype", "layout"}
            and node.kwargs.get("layout", torch.strided) is torch.strided
            and tuple(_val(node).shape) == tuple(param_shape))


def _elementwise(node: Node, param_shape: torch.Size) -> bool:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        pointwise = torch.Tag.pointwise in target.tags or target in _ALLOWED_NON_POINTWISE
        if target.namespace == "lowbit":
            pointwise = True
        val = _val(node)
        same_shape = val is None or not isinstance(val, torch.Tensor) or tuple(val.shape) == tuple(param_shape)
        return pointwise and same_shape
    return False
