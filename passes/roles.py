"""Label each input of a traced step with its role and refuse steps that are not elementwise.

Roles: ``param``, ``grad``, ``per_element_state`` (shaped like the param), ``scalar_state`` (e.g. the
step count), ``hyperparameter``. Every node that computes from a per-element value must be a
pointwise aten op (or a copy back into a per-element input): a reduction or reshape over the
parameter cannot be run one block at a time, so it is refused with the op's name.
"""

from __future__ import annotations

import copy

import torch
from torch.fx import GraphModule, Node
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten

PER_ELEMENT_ROLES = frozenset({"param", "grad", "per_element_state", "state_part"})
_ALLOWED_NON_POINTWISE = frozenset({aten.copy_.default, aten.copy.default, aten.clone.default, aten.alias.default})


class NotElementwiseError(NotImplementedError):
    """The optimizer's step mixes elements of a parameter (a norm, a sum, a reshape)."""


def _val(node: Node):
    return node.meta.get("val")


def input_role(node: Node, param_shape: torch.Size) -> str:
    kind = node.meta["lowbit_input"][0]
    if kind == "state":
        val = _val(node)
        return "per_element_state" if tuple(val.shape) == tuple(param_shape) else "scalar_state"
    return {"param": "param", "grad": "grad", "hyper": "hyperparameter", "state_part": "state_part"}[kind]


def is_per_element(node: Node) -> bool:
    return node.meta.get("per_element", False)


def label_roles(gm: GraphModule) -> GraphModule:
    """Return a copy of ``gm`` whose placeholders carry ``meta['role']`` and whose nodes carry
    ``meta['per_element']``; raise :class:`NotElementwiseError` on a non-elementwise step."""
    gm = copy.deepcopy(gm)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    param_shape = next(_val(n).shape for n in placeholders if n.meta["lowbit_input"][0] == "param")
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            node.meta["role"] = input_role(node, param_shape)
            node.meta["per_element"] = node.meta["role"] in PER_ELEMENT_ROLES
        elif node.op == "call_function":
            args, _ = tree_flatten((node.args, node.kwargs))
            touches = any(isinstance(a, Node) and is_per_element(a) for a in args)
            node.meta["per_element"] = touches
            if touches:
                _check_elementwise(node, param_shape)
    return gm


def _check_elementwise(node: Node, param_shape: torch.Size) -> None:
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        pointwise = torch.Tag.pointwise in target.tags or target in _ALLOWED_NON_POINTWISE
        if target.namespace == "lowbit":
            pointwise = True
        val = _val(node)
        same_shape = val is None or not isinstance(val, torch.Tensor) or tuple(val.shape) == tuple(param_shape)
        if pointwise and same_shape:
            return
    raise NotElementwiseError(
        f"the optimizer's step applies {target} to a per-element tensor "
        f"(node {node.name!r}); lowbit-compile only rewrites steps that are elementwise over each "
        "parameter (no norms, sums or reshapes across it)"
    )
