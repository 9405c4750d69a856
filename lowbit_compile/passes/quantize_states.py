"""Rewrite per-element state inputs of a step graph to block-quantized storage.

Each per-element state input ``s`` whose format is not fp32 becomes four inputs (codes, scales,
patch values, patch indices) and one ``lowbit::dequantize`` node feeding every former use of ``s``;
the final write-back ``copy_(s, new)`` becomes ``lowbit::quantize_(new, codes, scales, ...)``, or for a
state rounded stochastically ``lowbit::quantize_stochastic_(new, codes, ..., seed, stream)``: ``seed`` is
the parameter's step counter (a scalar state, ``rounding.SEED``, advanced each step) and ``stream`` 1 +
the state's position among the step's per-element states, so each state draws its own bits.
Nothing else in the graph changes, so the update math stays the traced stock math.
"""

from __future__ import annotations

import copy
from collections.abc import Collection, Mapping

import torch
from torch.fx import GraphModule, Node

from ..formats import StateFormat
from ..formats.rounding import MAX_STREAMS, SEED
from ..ir.contract import (
    Role,
    add_dequantize,
    add_quantize,
    add_step_counter,
    input_of,
    role_of,
    set_per_element,
    state_part_inputs,
)


def quantize_states(gm: GraphModule, formats: Mapping[str, StateFormat],
                    stochastic: Collection[str] = ()) -> GraphModule:
    """Return a copy of the role-labelled ``gm`` with the states named in ``formats`` quantized, those in
    ``stochastic`` rounding stochastically."""
    gm = copy.deepcopy(gm)
    graph = gm.graph
    first_op = next(n for n in graph.nodes if n.op != "placeholder")
    per_element = [n for n in graph.nodes if n.op == "placeholder" and role_of(n) is Role.PER_ELEMENT_STATE]
    states = [n for n in per_element if not formats[input_of(n).key].passthrough]
    if len(per_element) > MAX_STREAMS and stochastic:
        raise ValueError(f"stochastic rounding tells at most {MAX_STREAMS} states of a parameter apart, this step "
                         f"keeps {len(per_element)}")
    rounded = [ph for ph in states if input_of(ph).key in stochastic]
    seed = None
    if rounded:  # one counter, advanced before the first stochastic write-back
        first_write = next(n for n in graph.nodes if any(_is_write_back(n, ph) for ph in rounded))
        seed = add_step_counter(graph, SEED, per_element[-1], first_write)
    param = next((n for n in graph.nodes if n.op == "placeholder" and role_of(n) is Role.PARAM), None)
    for ph in states:
        key = input_of(ph).key
        fmt = formats[key]
        parts = state_part_inputs(graph, key, after=ph)
        dq = None
        if any(not _is_write_back(user, ph) for user in ph.users):  # not a state the step only creates
            with graph.inserting_before(first_op):
                dq = add_dequantize(graph, parts, fmt, ph.meta["val"].dtype, param)
            dq.meta.update(val=ph.meta["val"])
            set_per_element(dq, True)
        for user in list(ph.users):
            if _is_write_back(user, ph):
                with graph.inserting_before(user):
                    stream = 1 + per_element.index(ph) if key in stochastic else 0
                    q = add_quantize(graph, user.args[1], parts, fmt, seed if stream else None, stream)
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
