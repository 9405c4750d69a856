"""Split a staged step graph (one with whole-tensor nodes: Muon's Newton-Schulz matmuls) into stages
that alternate between elementwise ones, lowered to fused kernels like any step (state reads and
write-backs, quantized or not, stay in them), and whole-tensor ones, run as torch ops.

A value one stage gives a later one is a *temporary*: a tensor that exists while one parameter steps,
never across steps. An elementwise stage writes each temporary it gives with ``copy_`` into an input
of its own (a per-element state input keyed :class:`Temporary`, allocated by the top graph), so the
kernels need nothing new; a whole-tensor stage returns them. Elementwise work stays in the kernels, so
a temporary is what the whole-tensor ops take (Muon's bf16 nesterov update), not an fp32 intermediate.

The result is a GraphModule whose children ``stage_0``, ``stage_1``, ... (even: elementwise, odd:
whole-tensor) are wired by its own graph from the original inputs; it runs stage by stage.
"""

from __future__ import annotations

import copy
import operator
from collections.abc import Callable

import torch
from torch.fx import Graph, GraphModule, Node

from ..ir.contract import (
    GraphInput,
    Role,
    Temporary,
    input_of,
    is_per_element,
    is_view,
    is_whole_tensor,
    role_of,
    set_input,
    set_per_element,
    state_access,
)
from .trace import check_branch

aten = torch.ops.aten

# inputs a step writes in place: a stage after the one that writes them must not read them
_MUTABLE = frozenset({Role.PARAM, Role.PER_ELEMENT_STATE, Role.STATE_PART, Role.MASTER_PART})


def split_stages(gm: GraphModule) -> GraphModule:
    """Return ``top(inputs)`` running ``gm``'s stages in order, built from the role-labelled ``gm``."""
    gm = copy.deepcopy(gm)
    graph = gm.graph
    _copy_storage_reads(graph)
    ops = [n for n in graph.nodes if n.op == "call_function"]
    eager = eager_nodes(ops)
    stage = _stage_numbers(ops, eager)
    _check_order(graph, stage)

    members: list[list[Node]] = [[] for _ in range(max(stage.values(), default=0) + 1)]
    for node in ops:
        if node in stage:
            members[stage[node]].append(node)
    # branch checks run first, before anything is written; scalar write-backs (a step count) last, so
    # every stage computes from the value the step started with
    checks = [n for n in ops if n not in stage and _has_side_effect(n) and n.target is not aten.copy_.default]
    writes = [n for n in ops if n not in stage and n.target is aten.copy_.default]

    temporaries: dict[Node, int] = {}  # a value crossing stages -> its temporary's index
    for node in ops:
        for arg in node.all_input_nodes:
            if arg in stage and node in stage and stage[arg] != stage[node] and arg not in temporaries:
                temporaries[arg] = len(temporaries)

    top = Graph()
    env: dict[Node, Node] = {}
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    for node in placeholders:
        env[node] = top.placeholder(node.name)
        env[node].meta = dict(node.meta)
    param = next(n for n in placeholders if role_of(n) is Role.PARAM)
    root = torch.nn.Module()
    for k, nodes in enumerate(members):
        extra = (checks if k == 0 else []) + (writes if k == len(members) - 1 else [])
        if not nodes and not extra:  # nothing elementwise before the first whole-tensor op
            continue
        if k % 2 == 0:
            child, args = _elementwise_stage(nodes + extra, stage, temporaries, param, top, env)
        else:
            child, args = _whole_tensor_stage(nodes + extra, temporaries, top, env)
        name = f"stage_{k}"
        setattr(root, name, child)
        call = top.call_module(name, tuple(args))
        if k % 2:
            outputs = [n for n in nodes if n in temporaries]
            for i, node in enumerate(outputs):
                env[node] = top.call_function(operator.getitem, (call, i))
                env[node].name = f"tmp_{temporaries[node]}"
                env[node].meta.update(val=node.meta.get("val"))
    top.output(None)
    return GraphModule(root, top, "StagedStep")


def elementwise_stage(name: str) -> bool:
    """Whether the child ``name`` of a split staged step is an elementwise stage (lowered to a kernel)."""
    return int(name.rsplit("_", 1)[1]) % 2 == 0


def _copy_storage_reads(graph: Graph) -> None:
    """A whole-tensor node reading a state in place (an fp32 state) reads a copy an elementwise stage
    makes: the stage that writes the state back may run before it."""
    for node in list(graph.nodes):
        if not is_whole_tensor(node):
            continue
        for arg in node.all_input_nodes:
            if arg.op == "placeholder" and role_of(arg) in _MUTABLE:
                with graph.inserting_before(node):
                    clone = graph.call_function(aten.clone.default, (arg,))
                clone.meta.update(val=arg.meta.get("val"))
                set_per_element(clone, True)
                node.replace_input_with(arg, clone)


def eager_nodes(ops: list[Node]) -> set[Node]:
    """The nodes that run as torch ops: the whole-tensor ones and the elementwise ones between two of
    them (Muon's division by the norm, between the norm and the matmuls)."""
    whole = {n for n in ops if is_whole_tensor(n)}
    after: set[Node] = set()
    for node in ops:
        if any(a in whole or a in after for a in node.all_input_nodes):
            after.add(node)
    before: set[Node] = set()
    for node in reversed(ops):
        if any(u in whole or u in before for u in node.users):
            before.add(node)
    return whole | {n for n in ops if is_per_element(n) and n in after and n in before}


def _stage_numbers(ops: list[Node], eager: set[Node]) -> dict[Node, int]:
    """Each per-element node's stage (elementwise even, whole-tensor odd): the first one after its
    inputs' of its kind; an elementwise node then as late as its uses allow (Muon's ``param * (1 - lr *
    wd)`` with the update it is added to, not in a temporary), but never past a write-back of what it
    reads."""
    stage: dict[Node, int] = {}
    for node in ops:
        if not is_per_element(node):
            continue
        kind = node in eager
        s = int(kind)
        for arg in node.all_input_nodes:
            if arg in stage:
                s = max(s, stage[arg] + ((arg in eager) != kind))
        stage[node] = s + (s % 2 != kind)
    written = _written_at(ops, stage)
    for node in reversed(ops):
        uses = [u for u in node.users if u in stage]
        if node not in stage or node in eager or not uses:
            continue
        latest = min(stage[u] - (u in eager) for u in uses)
        for arg in node.all_input_nodes:
            if arg in written:
                latest = min(latest, written[arg])
        stage[node] = max(stage[node], latest)
    return stage


def _written_at(ops: list[Node], stage: dict[Node, int]) -> dict[Node, int]:
    """The stage of each input's last in-place write (its write-back, or a quantize into its parts); a
    scalar state's is the last stage."""
    last = max(stage.values(), default=0)
    written: dict[Node, int] = {}
    for node in ops:
        access = state_access(node)
        targets = list(access.parts) if access is not None and not access.reads else []
        if node.target is aten.copy_.default:
            targets.append(node.args[0])
        for t in targets:
            if t.op == "placeholder":
                written[t] = max(written.get(t, -1), stage.get(node, last))
    return written


def _check_order(graph: Graph, stage: dict[Node, int]) -> None:
    """Refuse a step whose stages read an input after an earlier stage wrote it in place."""
    ops = [n for n in graph.nodes if n.op == "call_function"]
    for ph, at in _written_at(ops, stage).items():
        if any(stage.get(u, 0) > at for u in ph.users):
            raise NotImplementedError(
                f"the optimizer's step reads {input_of(ph).key or ph.name!r} after a matmul or norm that "
                "follows its write-back; lowbit-compile runs such steps in stages and cannot order that")


def _has_side_effect(node: Node) -> bool:
    """A scalar node the step runs for its effect (a scalar state's write-back, a branch check)."""
    return node.target is aten.copy_.default or node.target is check_branch


def _scalar_closure(nodes: list[Node]) -> list[Node]:
    """The scalar (not per-element) computed nodes ``nodes`` depend on, in graph order."""
    seen: set[Node] = set()
    stack = [a for n in nodes for a in n.all_input_nodes]
    while stack:
        node = stack.pop()
        if node in seen or node.op != "call_function" or is_per_element(node):
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return [n for n in (nodes[0].graph.nodes if nodes else ()) if n in seen]


def _stage_graph(nodes: list[Node], temporaries: dict[Node, int], extra_inputs: list[Node],
                 tmp_input: Callable[[Graph, Node], Node], given: list[Node] = ()
                 ) -> tuple[Graph, dict[Node, Node], list[Node], list[Node]]:
    """Copy ``nodes`` (and the scalar nodes they need) into a new graph whose placeholders are the
    original inputs they read (and ``extra_inputs``), then the temporaries they read, then those of
    ``given`` (the temporaries the stage writes); with the nodes those inputs are of, in order, and the
    placeholders of ``given``."""
    body = _scalar_closure(nodes) + nodes
    body_set = set(body)
    reads = [a for n in body for a in n.all_input_nodes if a not in body_set]
    originals = [n for n in nodes[0].graph.nodes if n.op == "placeholder"
                 and (n in reads or n in extra_inputs)] if nodes else list(extra_inputs)
    crossing = list(dict.fromkeys(a for a in reads if a in temporaries))
    graph = Graph()
    env: dict[Node, Node] = {}
    for node in originals:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
    for node in crossing:
        env[node] = tmp_input(graph, node)
    written = [tmp_input(graph, node) for node in given]
    for node in sorted(body, key=_position(nodes)):
        env[node] = graph.node_copy(node, lambda n: env[n])
        env[node].meta = dict(node.meta)
    return graph, env, originals + crossing, written


def _position(nodes: list[Node]):
    order = {n: i for i, n in enumerate(nodes[0].graph.nodes)} if nodes else {}
    return lambda n: order[n]


def _temporary_input(graph: Graph, node: Node, index: int, param: Node) -> Node:
    """A temporary as an elementwise stage's input: per-element when shaped like the param, else a
    scalar one (a norm: 0-d), which the stage's prologue passes to its body like a scalar state, or a
    number read back on the host (Adafactor's step size from the param's norm), which it reads like a
    hyperparameter."""
    ph = graph.placeholder(f"tmp_{index}")
    val = node.meta.get("val")
    ph.meta.update(val=val)
    shaped = isinstance(val, torch.Tensor) and tuple(val.shape) == tuple(param.meta["val"].shape)
    role = Role.PER_ELEMENT_STATE if shaped else Role.SCALAR_STATE if isinstance(val, torch.Tensor) else \
        Role.HYPERPARAMETER
    set_input(ph, GraphInput(role, Temporary(index)))
    set_per_element(ph, shaped)
    return ph


def _elementwise_stage(nodes: list[Node], stage: dict[Node, int], temporaries: dict[Node, int], param: Node,
                       top: Graph, env: dict[Node, Node]) -> tuple[GraphModule, list[Node]]:
    """A stage lowered like a whole elementwise step: it writes the temporaries it gives in place."""
    outputs = [n for n in nodes if n in temporaries]
    graph, local, inputs, written = _stage_graph(nodes, temporaries, [param],
                                                 lambda g, n: _temporary_input(g, n, temporaries[n], param), outputs)
    args = [env[n] for n in inputs]
    for node, ph in zip(outputs, written):
        buffer = top.call_function(aten.empty_like.default, (env[param],),
                                   {"dtype": node.meta["val"].dtype, "memory_format": torch.contiguous_format})
        buffer.name = f"tmp_{temporaries[node]}"
        buffer.meta.update(val=node.meta.get("val"))
        env[node] = buffer
        args.append(buffer)
        write = graph.call_function(aten.copy_.default, (ph, local[node]))
        write.meta.update(val=node.meta.get("val"))
        set_per_element(write, True)
    graph.output(None)
    graph.eliminate_dead_code()
    return GraphModule(torch.nn.Module(), graph, "Elementwise"), args


def _whole_tensor_stage(nodes: list[Node], temporaries: dict[Node, int], top: Graph,
                        env: dict[Node, Node]) -> tuple[GraphModule, list[Node]]:
    """A stage run as torch ops, views as views (the functional trace copies them), returning the
    temporaries it gives."""
    graph, local, inputs, _ = _stage_graph(nodes, temporaries, [], lambda g, n: _plain_input(g, n, temporaries[n]))
    _stock_layouts(graph)
    for node in graph.nodes:
        view = _view_of(node.target)
        if view is not None:
            node.target = view
    _run_strides(graph)
    for node in nodes:
        if node in temporaries:  # what the next stage reads: its lowering follows ATen's loop for these strides
            node.meta["val"] = local[node].meta["val"]
    graph.output(tuple(local[n] for n in nodes if n in temporaries))
    graph.eliminate_dead_code()
    return GraphModule(torch.nn.Module(), graph, "WholeTensor"), [env[n] for n in inputs]


def _stock_layouts(graph: Graph) -> None:
    """A temporary an elementwise stage gives (contiguous, as its kernel writes it) is copied into the
    dense layout it has in the stock step, where that differs (the negated grad of a transposed
    matrix under ``maximize``): a reduction over it then adds in stock's order."""
    for ph in [n for n in graph.nodes if n.op == "placeholder"]:
        val = ph.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dim() < 2 or val.is_contiguous():
            continue
        order = sorted(range(val.dim()), key=lambda d: -val.stride()[d])  # outermost dimension first
        inverse = sorted(range(val.dim()), key=lambda d: order[d])
        users = list(ph.users)
        with graph.inserting_after(ph):
            permuted = graph.call_function(aten.permute.default, (ph, order))
        with graph.inserting_after(permuted):
            dense = graph.call_function(aten.clone.default, (permuted,), {"memory_format": torch.contiguous_format})
        with graph.inserting_after(dense):
            back = graph.call_function(aten.permute.default, (dense, inverse))
        with val.fake_mode:
            flat = torch.empty(val.shape, dtype=val.dtype, device=val.device)
            permuted.meta["val"] = flat.permute(order)
            dense.meta["val"] = permuted.meta["val"].contiguous()
            back.meta["val"] = dense.meta["val"].permute(inverse)
        ph.meta["val"] = flat
        for user in users:
            user.replace_input_with(ph, back)


def _run_strides(graph: Graph) -> None:
    """Give each tensor of a whole-tensor stage the strides it has when the stage runs (the functional
    trace copied every view into a dense tensor): a view (views run as views) those of that view of
    its input; a pointwise op's result dense in the dim order of its first input of its shape, as
    TensorIterator lays it out; an input (a temporary) and any other result contiguous."""
    strided: dict[Node, torch.Tensor] = {}
    for node in graph.nodes:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            continue
        source = node.args[0] if node.op == "call_function" and is_view(node.target) else None
        like = [strided[a] for a in node.all_input_nodes if a in strided and strided[a].shape == val.shape]
        if node.target is aten.copy_.default:  # a write-back into a state input (Adafactor's row factor)
            strided[node] = strided.get(source, torch.empty(val.shape, device="meta"))
        elif node.target is aten.clone.default and "memory_format" in node.kwargs:
            strided[node] = torch.empty(val.shape, device="meta", memory_format=node.kwargs["memory_format"])
        elif isinstance(source, Node) and source in strided:
            strided[node] = node.target(strided[source], *node.args[1:], **node.kwargs)
        elif like and torch.Tag.pointwise in getattr(node.target, "tags", ()):
            strided[node] = torch.empty_like(like[0])
        else:
            strided[node] = torch.empty(val.shape, device="meta")
        if strided[node].stride() != val.stride():
            with val.fake_mode:
                node.meta["val"] = torch.empty_strided(val.shape, strided[node].stride(), dtype=val.dtype,
                                                       device=val.device)


def _plain_input(graph: Graph, node: Node, index: int) -> Node:
    ph = graph.placeholder(f"tmp_{index}")
    ph.meta.update(val=node.meta.get("val"))
    return ph


def _view_of(target: object) -> object | None:
    """The view op a functionalized ``*_copy`` op copies (``permute_copy`` -> ``permute``), or None."""
    if not isinstance(target, torch._ops.OpOverload) or not target._schema.name.endswith("_copy"):
        return None
    packet = getattr(aten, target._schema.name.split("::")[1][:-len("_copy")], None)
    view = getattr(packet, target._overloadname, None) if packet is not None else None
    return view if is_view(view) else None
