"""Compute a bf16/fp16 step's elementwise update in fp32 and round once per stored value.

The traced step is ATen's single-tensor one, which rounds every intermediate to the param's dtype;
torch's ``fused=True`` optimizers instead load bf16/fp16 values into fp32 ("opmath"), compute the
whole update there and round once on each store. This pass rewrites a role-labelled, state-quantized
step graph to that arithmetic: each low-precision per-element input is upcast once where it is
read, quantized states decode straight to fp32, every per-element intermediate is fp32, and only
the write-backs round (``copy_`` into the param or a stock-format state casts to its dtype; a
quantized state's ``quantize_`` takes the fp32 value). The scalar prologue is unchanged.

In a staged step (``passes.stages``) the nodes that run as torch ops (Muon's Newton-Schulz) keep the
stock dtypes: a value the fused part gives them is rounded once to the dtype stock gives them.
"""

from __future__ import annotations

import copy

import torch
from torch.fx import GraphModule, Node
from torch.fx.passes.shape_prop import _extract_tensor_metadata

from ..ir import ops
from ..ir.contract import Role, is_per_element, role_of, set_per_element
from .stages import eager_nodes

aten = torch.ops.aten
lowbit = torch.ops.lowbit

LOW_PRECISION = frozenset({torch.bfloat16, torch.float16})


def compute_in_fp32(gm: GraphModule) -> GraphModule:
    """Return a copy of ``gm`` (after ``quantize_states``) whose per-element math runs in fp32."""
    gm = copy.deepcopy(gm)
    graph = gm.graph
    first_op = next(n for n in graph.nodes if n.op != "placeholder")
    eager = eager_nodes([n for n in graph.nodes if n.op == "call_function"])
    for node in list(graph.nodes):
        if not is_per_element(node) or node.op == "output" or node in eager:
            continue
        stock = node.meta["val"].dtype if _low(node) else None
        if node.op == "placeholder":
            if role_of(node) is not Role.STATE_PART and stock is not None:
                _upcast_reads(graph, node, first_op, eager)
            continue
        if node.target is lowbit.dequantize.default:
            node.args = (*node.args[:5], ops.dtype_name(torch.float32), *node.args[6:])  # (parts, fmt, dtype[, like])
            _widen(node)
        elif node.target is aten._to_copy.default and stock is not None and _float(node.args[0]):
            if not any(u in eager for u in node.users):  # a rounding for the torch ops stays
                node.replace_all_uses_with(node.args[0])  # an intermediate rounding fp32 opmath does not do
                graph.erase_node(node)
            continue
        elif node.target is not aten.copy_.default:
            if node.kwargs.get("dtype") in LOW_PRECISION:
                node.kwargs = {**node.kwargs, "dtype": torch.float32}
            _widen(node)
        if stock is not None:
            _round_for(graph, node, stock, eager)
    graph.lint()
    gm.recompile()
    return gm


def _upcast_reads(graph: torch.fx.Graph, node: Node, first_op: Node, eager: set[Node]) -> None:
    """Every read of the low-precision input ``node`` by the fused part goes through one fp32 copy of
    it; its write-back (``copy_(node, new)``) keeps writing the input itself, rounding once, and the
    torch ops (``eager``) read it as it is."""
    reads = [u for u in node.users
             if not (u.target is aten.copy_.default and u.args[0] is node) and u not in eager]
    if not reads:
        return
    with graph.inserting_before(first_op):
        up = graph.call_function(aten._to_copy.default, (node,), {"dtype": torch.float32})
    _set_val(up, node.meta["val"].to(torch.float32))
    set_per_element(up, True)
    for user in reads:
        user.replace_input_with(node, up)


def _round_for(graph: torch.fx.Graph, node: Node, dtype: torch.dtype, eager: set[Node]) -> None:
    """The torch ops (``eager``) that read the widened ``node`` read it rounded once to ``dtype``, the
    dtype stock computes them in."""
    users = [u for u in node.users if u in eager]
    if not users:
        return
    with graph.inserting_after(node):
        rounded = graph.call_function(aten._to_copy.default, (node,), {"dtype": dtype})
    _set_val(rounded, node.meta["val"].to(dtype))
    set_per_element(rounded, True)
    for user in users:
        user.replace_input_with(node, rounded)


def _low(node: Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dtype in LOW_PRECISION


def _float(arg: object) -> bool:
    val = arg.meta.get("val") if isinstance(arg, Node) else None
    return isinstance(val, torch.Tensor) and val.is_floating_point()


def _widen(node: Node) -> None:
    if _low(node):
        _set_val(node, node.meta["val"].to(torch.float32))


def _set_val(node: Node, val: torch.Tensor) -> None:
    node.meta["val"] = val
    if "tensor_meta" in node.meta:
        node.meta["tensor_meta"] = _extract_tensor_metadata(val)
