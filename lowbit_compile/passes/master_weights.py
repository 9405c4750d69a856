"""Rewrite a step traced as the fp32-master recipe runs it into one that keeps the master in the 16-bit
param plus a residual state, so a bf16/fp16 model trains as if an fp32 copy of it were stepped.

The step is traced on an fp32 param, an fp32 grad and fp32-dtype states (which ``quantize_states``
then rewrites to their formats like any other step's): what stepping an fp32 master copy runs. This
pass gives the graph the 16-bit param and grad and the residual inputs (``formats/residual.py``):

* every read of the param reads ``lowbit::master_read(param, residual)``, the fp32 master;
* every read of the grad reads it cast to fp32 (exact: what ``master.grad = param.grad.float()`` gives);
* the write-back ``copy_(param, new)`` becomes ``lowbit::master_write_(new, param, residual)``: the param
  gets the round to nearest even of ``new`` (what ``param.copy_(master)`` stores), the residual what
  that lost.

A lossy residual rounds stochastically, so it also gets a step counter (a scalar state the prologue
advances) that gives each step new random bits. Nothing else of the traced update changes.
"""

from __future__ import annotations

import copy

import torch
from torch.fx import Graph, GraphModule, Node

from ..formats.residual import RESIDUAL, SEED, TIES, MasterFormat, tie_words
from ..ir.contract import (
    GraphInput,
    Role,
    add_master_read,
    add_master_write,
    add_step_counter,
    role_of,
    set_input,
    set_per_element,
)

aten = torch.ops.aten


def master_weights(gm: GraphModule, fmt: MasterFormat) -> GraphModule:
    """Return a copy of the role-labelled (and state-quantized) ``gm``, traced with an fp32 param,
    that steps a ``fmt.param_dtype`` param through its fp32 master."""
    gm = copy.deepcopy(gm)
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    param = next(n for n in placeholders if role_of(n) is Role.PARAM)
    grad = next(n for n in placeholders if role_of(n) is Role.GRAD)
    master_val, grad_val = param.meta["val"], grad.meta["val"]
    if master_val.dtype != torch.float32 or grad_val.dtype != torch.float32:
        raise ValueError(f"master_weights rewrites a step traced with an fp32 param and grad (the fp32 master "
                         f"recipe), not {master_val.dtype} and {grad_val.dtype}")
    param.meta["val"] = _like(master_val, fmt.param_dtype)
    grad.meta["val"] = _like(grad_val, fmt.param_dtype)
    writes = [u for u in param.users if u.target is aten.copy_.default and u.args[0] is param]
    if len(writes) > 1:
        raise AssertionError(f"a functional step graph writes its param once, this one {len(writes)} times")

    residual = _input(graph, grad, RESIDUAL, _like(master_val, fmt.residual_dtype))
    ties = None
    if fmt.has_ties:
        words = torch.empty(tie_words(master_val.shape[0]), dtype=torch.int32, device="meta")
        ties = _input(graph, residual, TIES, words)
    first_op = next(n for n in graph.nodes if n.op != "placeholder")
    with graph.inserting_before(first_op):
        grad32 = graph.call_function(aten._to_copy.default, (grad,), {"dtype": torch.float32})
        master = add_master_read(graph, param, residual, ties, fmt)
    for node, val in ((grad32, grad_val), (master, master_val)):
        node.meta["val"] = val
        set_per_element(node, True)
    grad.replace_all_uses_with(grad32, delete_user_cb=lambda user: user is not grad32)
    param.replace_all_uses_with(master, delete_user_cb=lambda user: user is not master and user not in writes)

    for write in writes:
        seed = add_step_counter(graph, SEED, ties or residual, write) if fmt.seeded else None
        with graph.inserting_before(write):
            node = add_master_write(graph, write.args[1], param, residual, ties, seed, fmt)
        set_per_element(node, True)
        graph.erase_node(write)
    graph.lint()
    gm.recompile()
    return gm


def _like(val: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(val.shape, dtype=dtype, device="meta")


def _input(graph: Graph, after: Node, key: str, val: torch.Tensor) -> Node:
    """A new per-element placeholder for the master's storage ``key``, right after ``after``."""
    with graph.inserting_after(after):
        node = graph.placeholder(key)
    node.meta["val"] = val
    set_input(node, GraphInput(Role.MASTER_PART, key))
    set_per_element(node, True)
    return node
