"""Rewrite per-element state inputs of a step graph to block-quantized storage.

Each per-element state input ``s`` whose format is not fp32 becomes four inputs (codes, scales,
patch values, patch indices) and one ``lowbit::dequantize`` node feeding every former use of ``s``;
the final write-back ``copy_(s, new)`` becomes ``lowbit::quantize_(new, codes, scales, ...)``.
Nothing else in the graph changes, so the update math stays the traced stock math.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch
from torch.fx import GraphModule, Node

from ..kernels import ops  # noqa: F401  (registers torch.ops.lowbit)
from ..kernels.formats import StateFormat

STATE_PARTS = ("codes", "scales", "patch_values", "patch_index")


def quantize_states(gm: GraphModule, formats: Mapping[str, StateFormat]) -> GraphModule:
    """Return a copy of the role-labelled ``gm`` with the states named in ``formats`` quantized."""
    gm = copy.deepcopy(gm)
    graph = gm.graph
    first_op = next(n for n in graph.nodes if n.op != "placeholder")
    states = [
        n
        for n in graph.nodes
        if n.op == "placeholder"
        and n.meta.get("role") == "per_element_state"
        and not formats[n.meta["lowbit_input"][1]].passthrough
    ]
    for ph in states:
        key = ph.meta["lowbit_input"][1]
        fmt = formats[key]
        parts = []
        anchor = ph
        for part in STATE_PARTS:
            with graph.inserting_after(anchor):
                node = graph.placeholder(f"{key}_{part}")
            node.meta.update(lowbit_input=("state_part", key, part), role="state_part", per_element=True)
            parts.append(node)
            anchor = node
        dq = None
        if any(not _is_write_back(user, ph) for user in ph.users):  # not a state the step only creates
            with graph.inserting_before(first_op):
                dq = graph.call_function(
                    torch.ops.lowbit.dequantize.default,
                    (*parts, fmt.tag(), ops.dtype_name(ph.meta["val"].dtype)),
                )
            dq.meta.update(val=ph.meta["val"], per_element=True)
        for user in list(ph.users):
            if _is_write_back(user, ph):
                with graph.inserting_before(user):
                    q = graph.call_function(torch.ops.lowbit.quantize_.default, (user.args[1], *parts, fmt.tag()))
                q.meta.update(per_element=True)
                graph.erase_node(user)
            else:
                user.replace_input_with(ph, dq)
        _check_unused(ph)
        graph.erase_node(ph)
    graph.lint()
    gm.recompile()
    return gm


def _is_write_back(user: Node, state: Node) -> bool:
    return user.target is torch.ops.aten.copy_.default and user.args[0] is state


def _check_unused(node: Node) -> None:
    if node.users:
        raise AssertionError(f"state input {node.name} still used by {list(node.users)}")
