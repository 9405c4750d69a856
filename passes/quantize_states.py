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

from ..kernels.contract import (
    Role,
    add_dequantize,
    add_quantize,
    input_of,
    role_of,
    set_per_element,
    state_part_inputs,
)
from ..kernels.formats import StateFormat


def quantize_states(gm: GraphModule, formats: Mapping[str, StateFormat]) -> GraphModule:
    """Return a copy of the role-labelled ``gm`` with the states named in ``formats`` quantized."""
    gm = copy.deepcopy(gm)
    graph = gm.graph
    first_op = next(n for n in graph.nodes if n.op != "placeholder")
    states = [n for n in graph.nodes if n.op == "placeholder" and role_of(n) is Role.PER_ELEMENT_STATE
              and not formats[input_of(n).key].passthrough]
    for ph in states:
        key = input_of(ph).key
        fmt = formats[key]
        parts = state_part_inputs(graph, key, after=ph)
        dq = None
        if any(not _is_write_back(user, ph) for user in ph.users):  # not a state the step only creates
            with graph.inserting_before(first_op):
                dq = add_dequantize(graph, parts, fmt, ph.meta["val"].dtype)
            dq.meta.update(val=ph.meta["val"])
            set_per_element(dq, True)
        for user in list(ph.users):
            if _is_write_back(user, ph):
                with graph.inserting_before(user):
                    q = add_quantize(graph, user.args[1], parts, fmt)
                set_per_element(q, True)
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
