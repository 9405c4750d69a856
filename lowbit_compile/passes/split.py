"""Split a role-labelled step graph into a scalar prologue and a per-element body.

The prologue holds everything that does not touch a per-element value: the step-count update and
the host math on hyperparameters (bias corrections, step sizes). The body holds the elementwise
update and is what a backend lowers to one fused kernel. The result is a GraphModule with two
children, ``prologue`` and ``body``, whose own graph wires them together with the original inputs.
"""

from __future__ import annotations

import copy
import operator

import torch
from torch.fx import Graph, GraphModule, Node

from ..ir.contract import is_per_element, set_per_element


def split_prologue(gm: GraphModule) -> GraphModule:
    """Return ``top(inputs) = body(per-element inputs, *prologue(scalar inputs))`` built from ``gm``."""
    gm = copy.deepcopy(gm)
    _keep_old_scalar_states(gm.graph)
    nodes = [n for n in gm.graph.nodes if n.op in ("placeholder", "call_function")]
    prologue_nodes = [n for n in nodes if not is_per_element(n)]
    body_nodes = [n for n in nodes if is_per_element(n)]

    # Values crossing from the prologue into the body, in graph order.
    crossing: list[Node] = []
    for node in body_nodes:
        for arg in node.all_input_nodes:
            if not is_per_element(arg) and arg not in crossing:
                crossing.append(arg)
    computed = [n for n in crossing if n.op != "placeholder"]

    prologue = _extract(prologue_nodes, outputs=computed)
    body_inputs = [n for n in body_nodes if n.op == "placeholder"] + crossing
    body = _extract([n for n in body_nodes if n.op != "placeholder"], inputs=body_inputs)

    top = Graph()
    env: dict[Node, Node] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = top.placeholder(node.name)
            env[node].meta = dict(node.meta)
    pro_inputs = [n for n in prologue_nodes if n.op == "placeholder"]
    call = top.call_module("prologue", tuple(env[n] for n in pro_inputs))
    for i, node in enumerate(computed):
        env[node] = top.call_function(operator.getitem, (call, i))
        env[node].name = node.name
    top.call_module("body", tuple(env[n] for n in body_inputs))
    top.output(None)

    root = torch.nn.Module()
    root.prologue = GraphModule(torch.nn.Module(), prologue, "Prologue")
    root.body = GraphModule(torch.nn.Module(), body, "Body")
    return GraphModule(root, top, "SplitStep")


def _keep_old_scalar_states(graph: Graph) -> None:
    """The prologue writes the new scalar states (``copy_(state, new)``) before the body runs; a body
    that reads a scalar state (ASGD's ``(param - ax) * mu``) gets a copy of its value from before."""
    # in graph order (a set of nodes iterates by address: the clones' names, and so the kernel's source, varied)
    written = dict.fromkeys(n.args[0] for n in graph.nodes
                            if n.target is torch.ops.aten.copy_.default and not is_per_element(n))
    first_op = next(n for n in graph.nodes if n.op != "placeholder")
    for state in written:
        readers = [u for u in state.users if is_per_element(u)]
        if state.op != "placeholder" or not readers:
            continue
        with graph.inserting_before(first_op):
            old = graph.call_function(torch.ops.aten.clone.default, (state,))
        old.meta.update(val=state.meta.get("val"))
        set_per_element(old, False)
        for reader in readers:
            reader.replace_input_with(state, old)


def _extract(nodes: list[Node], outputs: list[Node] | None = None, inputs: list[Node] | None = None) -> Graph:
    """Copy ``nodes`` into a new graph; ``inputs`` (or the placeholders among ``nodes``) become its
    placeholders, ``outputs`` its returned tuple (nothing when absent)."""
    graph = Graph()
    env: dict[Node, Node] = {}
    if inputs is not None:
        for node in inputs:
            env[node] = graph.placeholder(node.name)
            env[node].meta = dict(node.meta)
    for node in nodes:
        if node in env:
            continue
        if node.op == "placeholder":
            env[node] = graph.placeholder(node.name)
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
        env[node].meta = dict(node.meta)
    graph.output(tuple(env[n] for n in outputs) if outputs else None)
    graph.eliminate_dead_code()
    return graph
