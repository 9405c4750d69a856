"""Emit one fused Triton kernel from the rewritten, split step graph (its ``body`` child).

One program instance handles ``ROWS`` quantization blocks, one per row of a ``[ROWS, BLOCK]`` tile:
it loads the param, the grad and each state's codes, decodes them (scale and 16-bit patches
included), evaluates every aten op of the body in fp32 registers, re-encodes the new states and
stores everything. No fp32 copy of a state ever reaches memory.

Values are held in fp32 and rounded to their node's dtype after every op, the way eager ATen stores
each intermediate; each op is written with the formula ATen uses on the device the kernel is built
for (``flavor``), fmas included, so a step agrees with the eager reference lowering bit for bit
where the reference itself is deterministic (see ``_OPS``). An op without a lowering here is an
:class:`UnsupportedOpError` naming it, never a fallback.

The standalone quantize and dequantize kernels are emitted from one-op graphs through the same code
(:func:`quantize_graph`, :func:`dequantize_graph`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.fx import Graph, GraphModule, Node

from . import ops
from .blockquant import PATCH_INDEX_DTYPE, PATCH_VALUE_DTYPE
from .formats import StateFormat

aten = torch.ops.aten
lowbit = torch.ops.lowbit

FLAVORS = ("cuda", "cpu")
DEFAULT_TILE = 2048  # elements per program instance when blocks are smaller (and when no state has blocks)

_FORMAT_IDS = {"int8": "lb.INT8", "dynamic8": "lb.DYNAMIC8", "fp8_e4m3": "lb.FP8_E4M3",
               "fp8_e5m2": "lb.FP8_E5M2", "bf16": "lb.BF16_CODES"}
_DTYPE_IDS = {torch.float32: "lb.F32", torch.bfloat16: "lb.BF16", torch.float16: "lb.F16"}
_RESERVED = frozenset({"pid", "rows", "cols", "offsets", "mask", "row_mask", "n_elements", "first_block",
                       "BLOCK", "ROWS", "lb", "tl", "triton"})


class UnsupportedOpError(NotImplementedError):
    """The step graph holds an op (or a dtype) the Triton emitter has no lowering for."""


@dataclass(frozen=True)
class KernelParam:
    """One runtime argument of an emitted kernel, in order.

    ``kind`` is ``"input"`` (the body input at ``index``: a pointer when ``tensor``, else a number)
    or ``"table"`` (the launcher supplies ``formats.dynamic_map`` / ``dynamic_midpoints``).
    ``dtype`` is what a pointer points to (None for a number).
    """

    name: str
    kind: str
    index: int = -1
    tensor: bool = False
    table: str = ""
    nonneg: bool = False
    dtype: torch.dtype | None = None


@dataclass(frozen=True)
class EmittedKernel:
    """Generated Triton source and how to call it: ``params`` then ``n_elements, first_block`` and the
    constexprs ``BLOCK`` (elements per row: the quantization block) and ``ROWS`` (rows per program).
    ``numel_input`` is the body input whose numel is the element count; ``written`` the body inputs
    the kernel stores into."""

    name: str
    source: str
    params: tuple[KernelParam, ...]
    numel_input: int
    written: frozenset[int]
    block: int
    rows: int


@dataclass(frozen=True)
class _Value:
    """How the kernel holds a node's value: an fp32 expression, rounded to ``dtype``.

    ``kind`` is ``"tile"`` (per element), ``"tensor0d"`` or ``"number"`` (a Python scalar; dtype None).
    ``host_scalar``: ATen reads it on the host (a number or a 0-d CPU tensor), which changes some
    formulas on CUDA.
    """

    expr: str
    kind: str
    dtype: torch.dtype | None
    host_scalar: bool


def emit_kernel(body: GraphModule, name: str, flavor: str, *, fp8_native: bool = True) -> EmittedKernel:
    """Triton source for the elementwise ``body`` of a split, quantize-rewritten step.

    ``flavor`` ("cuda" or "cpu") selects the ATen formulas to reproduce (they differ in where fmas
    and reciprocals are used). ``fp8_native`` holds fp8 codes as float8 (conversions need sm_89+);
    otherwise as uint8 bits, encoded and decoded with integer operations (any GPU; same codes).
    """
    if flavor not in FLAVORS:
        raise ValueError(f"flavor must be one of {FLAVORS}, got {flavor!r}")
    return _Emitter(body.graph, name, flavor, fp8_native).emit()


def quantize_graph(fmt: StateFormat, dtype: torch.dtype) -> GraphModule:
    """The one-op graph ``quantize_(x, codes, scales, patch_values, patch_index)`` of a ``dtype`` x."""
    graph = Graph()
    x = graph.placeholder("x")
    x.meta.update(val=torch.empty(1, dtype=dtype, device="meta"))
    parts = _state_parts(graph, "x")
    graph.call_function(lowbit.quantize_.default, (x, *parts, fmt.tag()))
    graph.output(None)
    return GraphModule(torch.nn.Module(), graph, "QuantizeState")


def dequantize_graph(fmt: StateFormat, dtype: torch.dtype) -> GraphModule:
    """The graph ``out.copy_(dequantize(codes, scales, patch_values, patch_index))`` into a ``dtype`` out."""
    graph = Graph()
    parts = _state_parts(graph, "state")
    out = graph.placeholder("out")
    out.meta.update(val=torch.empty(1, dtype=dtype, device="meta"))
    dq = graph.call_function(lowbit.dequantize.default, (*parts, fmt.tag(), ops.dtype_name(dtype)))
    dq.meta.update(val=out.meta["val"])
    copy = graph.call_function(aten.copy_.default, (out, dq))
    copy.meta.update(val=out.meta["val"])
    graph.output(None)
    return GraphModule(torch.nn.Module(), graph, "DequantizeState")


def _state_parts(graph: Graph, key: str) -> list[Node]:
    parts = []
    for part in ("codes", "scales", "patch_values", "patch_index"):
        node = graph.placeholder(f"{key}_{part}")
        node.meta.update(lowbit_input=("state_part", key, part))
        parts.append(node)
    return parts


class _Emitter:
    def __init__(self, graph: Graph, name: str, flavor: str, fp8_native: bool) -> None:
        self.graph = graph
        self.name = name
        self.flavor = flavor
        self.fp8_native = fp8_native
        self.placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        self.names = {n: (f"v_{n.name}" if n.name in _RESERVED else n.name) for n in graph.nodes}
        self.values: dict[Node, _Value] = {}
        self.lines: list[str] = []
        self.used_inputs: dict[Node, torch.dtype | None] = {}
        self.written: set[Node] = set()
        self.tables: list[KernelParam] = []
        self.block, self.rows = self._tiling()

    # layout ------------------------------------------------------------------------------------
    def _formats(self) -> list[StateFormat]:
        fmts = []
        for node in self.graph.nodes:
            if node.target is lowbit.dequantize.default:
                fmts.append(StateFormat.from_tag(node.args[4]))
            elif node.target is lowbit.quantize_.default:
                fmts.append(StateFormat.from_tag(node.args[5]))
        return fmts

    def _tiling(self) -> tuple[int, int]:
        sizes = {f.block_size for f in self._formats() if f.blockwise}
        if len(sizes) > 1:
            raise UnsupportedOpError(
                f"states of one parameter use different block sizes {sorted(sizes)}; the fused kernel "
                "tiles by one quantization block, so give every state of a parameter the same block_size"
            )
        block = sizes.pop() if sizes else DEFAULT_TILE
        return block, max(1, DEFAULT_TILE // block)

    # emission ----------------------------------------------------------------------------------
    def emit(self) -> EmittedKernel:
        for node in self.placeholders:
            self._placeholder(node)
        for node in self.graph.nodes:
            if node.op == "call_function":
                self._call(node)
            elif node.op not in ("placeholder", "output"):
                raise UnsupportedOpError(f"the Triton emitter lowers only call_function nodes, got {node.op} "
                                         f"({node.name!r})")
        params = self._params()
        numel_input = next((i for i, n in enumerate(self.placeholders) if _is_tile(n)), None)
        if numel_input is None:
            raise UnsupportedOpError("the step graph has no per-element tensor input to size the kernel by")
        written = frozenset(i for i, n in enumerate(self.placeholders) if n in self.written)
        return EmittedKernel(self.name, self._source(params), params, numel_input, written, self.block, self.rows)

    def _params(self) -> tuple[KernelParam, ...]:
        params = [KernelParam(self._param_name(n), "input", index=i, tensor=_is_tensor_input(n),
                              dtype=self.used_inputs[n])
                  for i, n in enumerate(self.placeholders) if n in self.used_inputs]
        return tuple(params + self.tables)

    def _param_name(self, node: Node) -> str:
        return f"{self.names[node]}_ptr" if _is_tensor_input(node) else self.names[node]

    def _source(self, params: tuple[KernelParam, ...]) -> str:
        signature = [p.name for p in params] + ["n_elements", "first_block", "BLOCK: tl.constexpr",
                                                "ROWS: tl.constexpr"]
        head = [
            "import triton",
            "import triton.language as tl",
            "",
            "from lowbit_compile.kernels import triton_lib as lb",
            "",
            "",
            "@triton.jit",
            f"def {self.name}(",
            *_wrap(signature, "    "),
            "):",
            "    rows = first_block + tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)",
            "    cols = tl.arange(0, BLOCK)",
            "    offsets = rows[:, None] * BLOCK + cols[None, :]",
            "    mask = offsets < n_elements",
            "    row_mask = rows * BLOCK < n_elements",
        ]
        return "\n".join(head + ["    " + line for line in self.lines]) + "\n"

    def param(self, node: Node, dtype: torch.dtype | None = None) -> str:
        """The kernel parameter of input ``node`` (pointing to ``dtype``, or to its value's dtype)."""
        val = node.meta.get("val")
        self.used_inputs[node] = dtype or (val.dtype if isinstance(val, torch.Tensor) else None)
        return self._param_name(node)

    def _placeholder(self, node: Node) -> None:
        if node.meta.get("lowbit_input", ("",))[0] == "state_part":
            return  # read through the dequantize/quantize_ nodes
        val = node.meta.get("val")
        name = self.names[node]
        if isinstance(val, torch.Tensor):
            dtype = _value_dtype(val.dtype, node)
            if val.dim() == 0:
                self.lines.append(f"{name} = lb.load_scalar({self.param(node)}, {_DTYPE_IDS[dtype]})")
                self.values[node] = _Value(name, "tensor0d", dtype, val.device.type == "cpu")
            elif any(not _is_copy_destination(node, user) for user in node.users):
                self.lines.append(f"{name} = lb.load_elements({self.param(node)}, offsets, mask, {_DTYPE_IDS[dtype]})")
                self.values[node] = _Value(name, "tile", dtype, False)
        elif node.users:
            # an fp32 scalar, also under the interpreter (which passes Python floats through as is)
            self.lines.append(f"{name} = tl.cast({self.param(node)}, tl.float32)")
            self.values[node] = _Value(name, "number", None, True)

    def _call(self, node: Node) -> None:
        handler = _OPS.get(node.target)
        if handler is None:
            raise UnsupportedOpError(
                f"the Triton emitter has no lowering for {node.target} (node {node.name!r}); "
                "use backend='reference' for this optimizer, or add the op to kernels/triton_emitter.py"
            )
        handler(self, node)

    # values ------------------------------------------------------------------------------------
    def value(self, arg: object) -> _Value:
        if isinstance(arg, Node):
            return self.values[arg]
        if isinstance(arg, (bool, int, float)):
            return _Value(repr(float(arg)), "number", None, True)
        raise UnsupportedOpError(f"the Triton emitter cannot use the argument {arg!r} as a value")

    def operand(self, arg: object, dtype: torch.dtype, as_opmath: bool = False) -> str:
        """``arg`` as an input of an op computing in ``dtype``: cast to ``dtype`` (what TensorIterator
        does), unless ``as_opmath`` (ATen reads that scalar straight into fp32)."""
        v = self.value(arg)
        if as_opmath or v.dtype == dtype or dtype == torch.float32:
            return v.expr
        return f"lb.round_to({v.expr}, {_DTYPE_IDS[dtype]})"

    def define(self, node: Node, expr: str) -> None:
        """``node = expr`` rounded to the node's dtype."""
        dtype = self.dtype(node)
        name = self.names[node]
        rhs = expr if dtype == torch.float32 else f"lb.round_to({expr}, {_DTYPE_IDS[dtype]})"
        self.lines.append(f"{name} = {rhs}")
        self.values[node] = _Value(name, "tile", dtype, False)

    def dtype(self, node: Node) -> torch.dtype:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise UnsupportedOpError(f"node {node.name!r} ({node.target}) has no tensor value to lower")
        return _value_dtype(val.dtype, node)

    def host_scalar(self, arg: object) -> bool:
        return self.value(arg).host_scalar

    def is_scalar(self, arg: object) -> bool:
        return self.value(arg).kind != "tile"

    def table(self, kind: str, fmt: StateFormat) -> str:
        name = f"dynamic8_{'unsigned' if fmt.nonneg else 'signed'}_{kind}_ptr"
        if all(t.name != name for t in self.tables):
            self.tables.append(KernelParam(name, "table", table=kind, nonneg=fmt.nonneg, dtype=torch.float32))
        return name


# The ops --------------------------------------------------------------------------------------------
# Each reproduces the eager ATen kernel of the flavor's device: PointwiseOpsKernel (CPU: AVX2/AVX512
# builds contract addcmul into one fma), DeviceAddCmulCdiv.cuh (CUDA: explicit fmas),
# BinaryDivTrueKernel.cu (CUDA: a host-scalar divisor becomes a multiply by its fp32 reciprocal),
# Lerp.h / LerpKernel.cpp (both: one fma from the nearer end point), ufunc add (fma with alpha).
# Scalars: CPU reduced-precision mul/div read a scalar second operand in fp32, add/sub cast it and
# alpha to the op's dtype; CUDA reads host scalars in fp32.

def _emit_add(em: _Emitter, node: Node, sign: str = "+") -> None:
    a, b = node.args[:2]
    dtype = em.dtype(node)
    cuda = em.flavor == "cuda"
    x = em.operand(a, dtype, as_opmath=cuda and em.host_scalar(a))
    y = em.operand(b, dtype, as_opmath=cuda and em.host_scalar(b))
    alpha = node.kwargs.get("alpha", 1)
    if alpha == 1:
        em.define(node, f"{x} {sign} {y}")
        return
    alpha_expr = em.operand(alpha, dtype, as_opmath=cuda)
    em.define(node, f"tl.fma({y}, {'-' if sign == '-' else ''}{alpha_expr}, {x})")


def _emit_sub(em: _Emitter, node: Node) -> None:
    _emit_add(em, node, "-")


def _emit_mul(em: _Emitter, node: Node) -> None:
    a, b = node.args
    dtype = em.dtype(node)
    if em.flavor == "cuda":
        x = em.operand(a, dtype, as_opmath=em.host_scalar(a))
        y = em.operand(b, dtype, as_opmath=em.host_scalar(b))
    else:
        x, y = em.operand(a, dtype), em.operand(b, dtype, as_opmath=em.is_scalar(b))
    em.define(node, f"{x} * {y}")


def _emit_div(em: _Emitter, node: Node) -> None:
    a, b = node.args
    dtype = em.dtype(node)
    if em.flavor == "cuda" and em.host_scalar(b):
        x = em.operand(a, dtype, as_opmath=em.host_scalar(a))
        em.define(node, f"{x} * tl.math.div_rn(1.0, {em.operand(b, dtype, as_opmath=True)})")
        return
    cuda = em.flavor == "cuda"
    x = em.operand(a, dtype, as_opmath=cuda and em.host_scalar(a))
    y = em.operand(b, dtype, as_opmath=not cuda and em.is_scalar(b))
    em.define(node, f"tl.math.div_rn({x}, {y})")


def _emit_lerp(em: _Emitter, node: Node) -> None:
    start, end, weight = node.args
    dtype = em.dtype(node)
    scalar_weight = node.target is aten.lerp.Scalar
    w = em.operand(weight, dtype, as_opmath=scalar_weight)
    em.define(node, f"lb.lerp({em.operand(start, dtype)}, {em.operand(end, dtype)}, {w})")


def _emit_addc(unit: str, scaled_cuda: str, scaled_cpu: str, shared: str = "") -> Callable[[_Emitter, Node], None]:
    """addcmul/addcdiv, ``s + value * op(t1, t2)``: ``unit`` is the formula at value 1 (which CUDA
    checks at run time), ``scaled_*`` the one for any other value. Templates over s, t1, t2, v, and q:
    the ``shared`` subexpression, computed once."""
    def emit(em: _Emitter, node: Node) -> None:
        dtype = em.dtype(node)
        s, t1, t2 = (em.operand(a, dtype) for a in node.args[:3])
        value = node.kwargs.get("value", 1)
        if value == 1:
            em.define(node, unit.format(s=s, t1=t1, t2=t2, q=shared.format(t1=t1, t2=t2)))
            return
        v = em.operand(value, dtype, as_opmath=True)
        if em.flavor == "cpu":
            em.define(node, scaled_cpu.format(s=s, t1=t1, t2=t2, v=v))
            return
        q = shared.format(t1=t1, t2=t2)
        if shared:
            q = f"{em.names[node]}_q"
            em.lines.append(f"{q} = {shared.format(t1=t1, t2=t2)}")
        terms = {"s": s, "t1": t1, "t2": t2, "v": v, "q": q}
        em.define(node, f"tl.where({v} == 1.0, {unit.format(**terms)}, {scaled_cuda.format(**terms)})")
    return emit


def _emit_unary(template: str) -> Callable[[_Emitter, Node], None]:
    def emit(em: _Emitter, node: Node) -> None:
        em.define(node, template.format(em.operand(node.args[0], em.dtype(node))))
    return emit


def _emit_maximum(em: _Emitter, node: Node) -> None:
    a, b = (em.operand(x, em.dtype(node)) for x in node.args)
    em.define(node, f"tl.maximum({a}, {b}, propagate_nan=tl.PropagateNan.ALL)")


def _emit_alias(em: _Emitter, node: Node) -> None:
    em.values[node] = em.value(node.args[0])


def _emit_copy(em: _Emitter, node: Node) -> None:
    dst, src = node.args[:2]
    if not (isinstance(dst, Node) and dst.op == "placeholder" and _is_tile(dst)):
        raise UnsupportedOpError(f"copy_ into {dst} (node {node.name!r}): the fused kernel writes back only "
                                 "into per-element inputs (the param and stock-format states)")
    dtype = _value_dtype(dst.meta["val"].dtype, dst)
    value = em.operand(src, dtype)
    em.written.add(dst)
    em.lines.append(f"lb.store_elements({em.param(dst)}, offsets, {value}, mask, {_DTYPE_IDS[dtype]})")
    em.values[node] = _Value(value, "tile", dtype, False)


def _state_args(em: _Emitter, parts: tuple, fmt: StateFormat) -> list[str]:
    codes, scales, patch_values, patch_index = parts
    if not fmt.blockwise:
        return [em.param(codes, fmt.code_dtype), "None", "None", "None"]
    codes_dtype = torch.uint8 if _is_fp8(fmt) and not em.fp8_native else fmt.code_dtype  # launched as a uint8 view
    pointers = [em.param(codes, codes_dtype), em.param(scales, torch.float32)]
    if not fmt.patches:
        return pointers + ["None", "None"]
    return pointers + [em.param(patch_values, PATCH_VALUE_DTYPE), em.param(patch_index, PATCH_INDEX_DTYPE)]


def _emit_dequantize(em: _Emitter, node: Node) -> None:
    *parts, tag, dtype_name = node.args
    fmt = StateFormat.from_tag(tag)
    _check_format(fmt, node)
    dtype = _value_dtype(ops._DTYPES[dtype_name], node)
    table = em.table("map", fmt) if fmt.name == "dynamic8" else "None"
    name = em.names[node]
    em.lines.append(f"# {fmt.tag()}")
    em.lines += _call_lines(f"{name} = lb.dequantize", _state_args(em, tuple(parts), fmt) + [
        table, "rows", "cols", "offsets", "mask", "row_mask",
        f"FMT={_FORMAT_IDS[fmt.name]}", f"K={fmt.patches}", f"DTYPE={_DTYPE_IDS[dtype]}", *_fp8_path(em, fmt)])
    em.values[node] = _Value(name, "tile", dtype, False)


def _emit_quantize(em: _Emitter, node: Node) -> None:
    x, *parts, tag = node.args
    fmt = StateFormat.from_tag(tag)
    _check_format(fmt, node)
    em.written.update(parts)
    table = em.table("bounds", fmt) if fmt.name == "dynamic8" else "None"
    inv_qmax = _fp32_reciprocal(fmt.qmax) if em.flavor == "cuda" else 0.0
    em.lines.append(f"# {fmt.tag()}")
    em.lines += _call_lines("lb.quantize", [em.value(x).expr] + _state_args(em, tuple(parts), fmt) + [
        table, "rows", "cols", "offsets", "mask", "row_mask", f"FMT={_FORMAT_IDS[fmt.name]}",
        f"NONNEG={fmt.nonneg}", f"K={fmt.patches}", f"QMAX={fmt.qmax!r}", f"MIN_POSITIVE={fmt.min_positive!r}",
        f"INV_QMAX={inv_qmax!r}", *_fp8_path(em, fmt)])


_OPS: dict[object, Callable[[_Emitter, Node], None]] = {
    aten.add.Tensor: _emit_add,
    aten.sub.Tensor: _emit_sub,
    aten.mul.Tensor: _emit_mul,
    aten.div.Tensor: _emit_div,
    aten.lerp.Scalar: _emit_lerp,
    aten.lerp.Tensor: _emit_lerp,
    aten.addcmul.default: _emit_addc("tl.fma({t1}, {t2}, {s})", "tl.fma({v}, {t1} * {t2}, {s})",
                                     "tl.fma({v} * {t1}, {t2}, {s})"),
    aten.addcdiv.default: _emit_addc("{s} + {q}", "tl.fma({v}, {q}, {s})", "{s} + tl.math.div_rn({v} * {t1}, {t2})",
                                     shared="tl.math.div_rn({t1}, {t2})"),
    aten.sqrt.default: _emit_unary("tl.sqrt_rn({})"),
    aten.neg.default: _emit_unary("-{}"),
    aten.maximum.default: _emit_maximum,
    aten.clone.default: _emit_alias,
    aten.alias.default: _emit_alias,
    aten.copy_.default: _emit_copy,
    lowbit.dequantize.default: _emit_dequantize,
    lowbit.quantize_.default: _emit_quantize,
}


def supported_ops() -> tuple[str, ...]:
    """Names of the ops the emitter lowers (for error messages and docs)."""
    return tuple(sorted(str(op) for op in _OPS))


# helpers ----------------------------------------------------------------------------------------------
def _is_tensor_input(node: Node) -> bool:
    return node.meta.get("lowbit_input", ("",))[0] == "state_part" or isinstance(node.meta.get("val"), torch.Tensor)


def _is_tile(node: Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() > 0


def _is_copy_destination(node: Node, user: Node) -> bool:
    return user.target is aten.copy_.default and user.args[0] is node


def _value_dtype(dtype: torch.dtype, node: Node) -> torch.dtype:
    if dtype not in _DTYPE_IDS:
        raise UnsupportedOpError(f"node {node.name!r} holds {dtype}; the Triton kernels support float32, "
                                 "bfloat16 and float16 params and states")
    return dtype


def _check_format(fmt: StateFormat, node: Node) -> None:
    if fmt.name not in _FORMAT_IDS:
        raise UnsupportedOpError(f"node {node.name!r} uses format {fmt.name!r}, which never reaches a kernel")


def _is_fp8(fmt: StateFormat) -> bool:
    return fmt.name in ("fp8_e4m3", "fp8_e5m2")


def _fp8_path(em: _Emitter, fmt: StateFormat) -> list[str]:
    """The FP8_NATIVE argument of an fp8 state's lb.quantize/lb.dequantize (no other format reads it)."""
    return [f"FP8_NATIVE={em.fp8_native}"] if _is_fp8(fmt) else []


def _fp32_reciprocal(x: float) -> float:
    one = torch.tensor(1.0, dtype=torch.float32)
    return float(one / torch.tensor(x, dtype=torch.float32))


def _call_lines(callee: str, args: list[str]) -> list[str]:
    """``callee(args...)`` as source lines of the kernel body, wrapped under the opening parenthesis."""
    one = f"{callee}({', '.join(args)})"
    if len(one) <= 112:
        return [one]
    lines = _wrap(args, " " * (len(callee) + 1), width=112)
    lines[0] = callee + "(" + lines[0].lstrip()
    lines[-1] = lines[-1].rstrip(",") + ")"
    return lines


def _wrap(items: list[str], indent: str, width: int = 116) -> list[str]:
    lines, line = [], indent
    for item in items:
        piece = item + ","
        if len(line) + len(piece) + 1 > width and line.strip():
            lines.append(line.rstrip())
            line = indent
        line += piece + " "
    lines.append(line.rstrip())
    return lines
