"""The Triton printer: one fused Triton kernel from the body of a split, rewritten step graph.

One program instance handles ``ROWS`` quantization blocks, one per row of a ``[ROWS, BLOCK]`` tile:
it loads the param, the grad and each state's codes, decodes them (``triton_lib.dequantize``: scale
and 16-bit patches included), runs the body's ops as ``lowering.py`` lowers them, printed here as
Triton expressions on fp32 tiles, re-encodes the new states (``triton_lib.quantize``) and stores
everything. No fp32 copy of a state ever reaches memory.

The standalone quantize and dequantize kernels are printed from one-op graphs through the same code
(:func:`quantize_graph`, :func:`dequantize_graph`).
"""

from __future__ import annotations

import keyword
import math
from dataclasses import dataclass

import torch
from torch.fx import Graph, GraphModule, Node

from ..formats import StateFormat, special_codes
from ..formats.blockquant import PATCH_INDEX_DTYPE, PATCH_VALUE_DTYPE
from ..ir.contract import (
    GraphInput,
    MasterAccess,
    Role,
    StateAccess,
    add_dequantize,
    add_quantize,
    input_of,
    set_input,
    state_access,
    state_part_inputs,
)
from .lowering import LoweringError, Target, lower_body
from .primitives import Kind, Value

aten = torch.ops.aten

DEFAULT_TILE = 2048  # elements per program instance when blocks are smaller (and when no state has blocks)
WARP_TILE = 8 * 32  # the elements a warp of a kernel of quantized states holds: 8 a thread

_DTYPE_IDS = {torch.float32: "lb.F32", torch.bfloat16: "lb.BF16", torch.float16: "lb.F16"}
_RESERVED = frozenset({"pid", "rows", "cols", "offsets", "mask", "row_mask", "n_elements", "first_block",
                       "BLOCK", "ROWS", "lb", "tl", "triton", "entry", "n_total", "row_table_ptr", "program_rows_ptr",
                       "MASKED"})
_POINTEE = {torch.float32: "tl.float32", torch.bfloat16: "tl.bfloat16", torch.float16: "tl.float16",
            torch.int8: "tl.int8", torch.uint8: "tl.uint8", torch.int16: "tl.int16", torch.int32: "tl.int32",
            torch.int64: "tl.int64", torch.bool: "tl.int8", torch.float8_e4m3fn: "tl.float8e4nv",
            torch.float8_e5m2: "tl.float8e5"}


@dataclass(frozen=True)
class KernelParam:
    """One runtime argument of an emitted kernel, in order.

    ``kind`` is ``"input"`` (the body input at ``index``: a pointer when ``tensor``, else a number)
    or ``"table"`` (the launcher supplies the ``lookup_table`` of the format ``table`` names).
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
    A ``batched`` kernel steps many tensors in one launch: its tensor params are not arguments but
    read per program from a row table (:func:`emit_kernel`); its arguments are the number and table
    params, then ``row_table_ptr, program_rows_ptr`` and the constexpr ``MASKED`` (which tiles a launch runs).
    ``numel_input`` is the body input whose numel is the element count; ``written`` the body inputs
    the kernel stores into. ``approximate``: the kernel stores 8-bit states, so it takes the contract of
    quantized formats (docs/numerics.md, "The GPU kernels") instead of bit-identity: approximate division and square
    roots, fp contraction on."""

    name: str
    source: str
    params: tuple[KernelParam, ...]
    numel_input: int
    written: frozenset[int]
    block: int
    rows: int
    approximate: bool = False
    batched: bool = False

    def constexprs(self, masked: bool = False) -> dict[str, int | bool]:
        """The constexpr arguments of a launch: a batched kernel's also say which of its two compiled
        variants runs (``masked``: the tensors' partial last tiles, else their full tiles)."""
        if masked and not self.batched:
            raise ValueError(f"{self.name} is a per-tensor kernel: only a batched kernel has a masked variant")
        return {"BLOCK": self.block, "ROWS": self.rows, **({"MASKED": masked} if self.batched else {})}

    @property
    def tensor_params(self) -> tuple[KernelParam, ...]:
        """The tensor inputs, in the order of a batched kernel's row-table entries (after the entry's
        first program and element count)."""
        return tuple(p for p in self.params if p.kind == "input" and p.tensor)


def emit_kernel(body: GraphModule, name: str, target: Target, batched: bool = False) -> EmittedKernel:
    """Triton source for the elementwise ``body`` of a split, quantize-rewritten step, reproducing
    the eager arithmetic of ``target``'s device.

    ``batched``: one launch steps many parameters (small tensors cost one launch, not one each).
    Program ``pid`` reads its row ``r = program_rows[pid]``, and row ``r``'s entry of the int64 row
    table: its first program, its element count, then one pointer per tensor input (16-byte aligned,
    which the launcher checks). The constexpr ``MASKED`` makes two compiled kernels of one source, each
    with one path: ``MASKED=False`` runs tiles wholly inside their tensor with a bound the compiler knows
    is a multiple of the tile (vector loads and stores, and the registers of the per-tensor kernel),
    ``MASKED=True`` each tensor's partial last tile with its exact size (its program table lists one
    program per tensor that has one)."""
    printer = TritonPrinter(body.graph, name, target)
    lower_body(body, printer, target)
    return printer.kernel(batched)


def quantize_graph(fmt: StateFormat, dtype: torch.dtype) -> GraphModule:
    """The one-op graph ``quantize_(x, codes, scales, patch_values, patch_index)`` of a ``dtype`` x."""
    graph = Graph()
    x = graph.placeholder("x")
    x.meta.update(val=torch.empty(1, dtype=dtype, device="meta"))
    set_input(x, GraphInput(Role.PER_ELEMENT_STATE, "x"))
    add_quantize(graph, x, state_part_inputs(graph, "x"), fmt)
    graph.output(None)
    return GraphModule(torch.nn.Module(), graph, "QuantizeState")


def dequantize_graph(fmt: StateFormat, dtype: torch.dtype) -> GraphModule:
    """The graph ``out.copy_(dequantize(codes, scales, patch_values, patch_index))`` into a ``dtype`` out."""
    graph = Graph()
    parts = state_part_inputs(graph, "state")
    out = graph.placeholder("out")
    out.meta.update(val=torch.empty(1, dtype=dtype, device="meta"))
    set_input(out, GraphInput(Role.PER_ELEMENT_STATE, "out"))
    dq = add_dequantize(graph, parts, fmt, dtype, out)
    dq.meta.update(val=out.meta["val"])
    copy = graph.call_function(aten.copy_.default, (out, dq))
    copy.meta.update(val=out.meta["val"])
    graph.output(None)
    return GraphModule(torch.nn.Module(), graph, "DequantizeState")


def _infix(a: Value, op: str, b: Value, dtype: torch.dtype = torch.float32) -> Value:
    return Value(f"{_operand(a)} {op} {_operand(b)}", dtype, _kind(a, b), atomic=False)


def _operand(v: Value) -> str:
    return v.text if v.atomic else f"({v.text})"


def _kind(*values: Value) -> Kind:
    return Kind.ELEMENT if any(v.kind is Kind.ELEMENT for v in values) else Kind.SCALAR


def _call(fn: str, *args: Value, dtype: torch.dtype = torch.float32) -> Value:
    return Value(f"{fn}({', '.join(a.text for a in args)})", dtype, _kind(*args))


class TritonPrinter:
    """The primitives of ``primitives.py`` as Triton expressions; collects the kernel's lines and
    parameters while ``lowering.lower_body`` walks the graph."""

    def __init__(self, graph: Graph, name: str, target: Target) -> None:
        self.graph = graph
        self.name = name
        self.target = target
        self.placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        self.index = {n: i for i, n in enumerate(self.placeholders)}
        self.names: dict[str, str] = {}
        self.lines: list[str] = []
        self.used_inputs: dict[Node, torch.dtype | None] = {}
        self.written: set[Node] = set()
        self.tables: list[KernelParam] = []
        # 8-bit states round to a code anyway: such kernels need not reproduce eager arithmetic's bits
        self.approximate = any(a.fmt.blockwise for a in map(state_access, graph.nodes) if a is not None)
        self.block, self.rows = self._tiling()

    # layout ------------------------------------------------------------------------------------
    def _tiling(self) -> tuple[int, int]:
        accesses = [a for a in map(state_access, self.graph.nodes) if a is not None]
        missing = sorted({a.fmt.name for a in accesses if not a.fmt.passthrough and a.fmt.spec.triton_name is None})
        if missing:
            raise LoweringError(f"the Triton kernel has no code for format(s) {missing} yet")
        sizes = {a.fmt.block_size for a in accesses if a.fmt.blockwise}
        if len(sizes) > 1:
            raise LoweringError(
                f"states of one parameter use different block sizes {sorted(sizes)}; the fused kernel "
                "tiles by one quantization block, so give every state of a parameter the same block_size"
            )
        block = sizes.pop() if sizes else DEFAULT_TILE
        if any(a.fmt.blockwise for a in accesses):
            # a block per row, rows enough for a warp's tile (WARP_TILE): a block of 512 alone, so each thread's
            # per-block work (reductions, scale, inverse) is not repeated per row of a taller tile
            # (bench/gpu_cost.py: 235 -> 177 SASS instructions per element for the default step on sm_90);
            # sqrt4's blocks of 128 two to a tile, so a thread's share of the fixed work is over 8 elements
            # instead of 4 (bench/gpu_cost.py --only sqrt4)
            return block, max(1, WARP_TILE // block)
        return block, max(1, DEFAULT_TILE // block)

    def kernel(self, batched: bool = False) -> EmittedKernel:
        params = tuple([KernelParam(self._param_name(n), "input", index=self.index[n], tensor=_is_tensor_input(n),
                                    dtype=self.used_inputs[n])
                        for n in self.placeholders if n in self.used_inputs] + self.tables)
        numel_input = next((i for i, n in enumerate(self.placeholders) if _is_tile(n)), None)
        if numel_input is None:
            raise LoweringError("the step graph has no per-element tensor input to size the kernel by")
        written = frozenset(self.index[n] for n in self.written)
        source = self._batched_source(params) if batched else self._source(params)
        return EmittedKernel(self.name, source, params, numel_input, written, self.block, self.rows,
                             self.approximate, batched)

    def _header(self, signature: list[str]) -> list[str]:
        """The module's imports and the kernel's decorated signature, shared by both launch layouts."""
        return ["import triton", "import triton.language as tl", "",
                "from lowbit_compile.kernels import triton_lib as lb", "", "", "@triton.jit",
                f"def {self.name}(", *_wrap(signature, "    "), "):"]

    def _source(self, params: tuple[KernelParam, ...]) -> str:
        signature = [p.name for p in params] + ["n_elements", "first_block", "BLOCK: tl.constexpr",
                                                "ROWS: tl.constexpr"]
        head = [
            *self._header(signature),
            "    rows = first_block + tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)",
            "    cols = tl.arange(0, BLOCK)",
            "    offsets = rows[:, None] * BLOCK + cols[None, :]",
            "    mask = offsets < n_elements",
            "    row_mask = rows * BLOCK < n_elements",
        ]
        return "\n".join(head + ["    " + line for line in self.lines]) + "\n"

    def _batched_source(self, params: tuple[KernelParam, ...]) -> str:
        tensors = [p for p in params if p.kind == "input" and p.tensor]
        signature = [p.name for p in params if not (p.kind == "input" and p.tensor)] + [
            "row_table_ptr", "program_rows_ptr", "BLOCK: tl.constexpr", "ROWS: tl.constexpr", "MASKED: tl.constexpr"]
        head = [
            *self._header(signature),
            "    pid = tl.program_id(0).to(tl.int64)",
            f"    entry = row_table_ptr + tl.load(program_rows_ptr + pid).to(tl.int64) * {2 + len(tensors)}",
            "    n_total = tl.load(entry + 1)",
            "    if MASKED:  # the tensor's last tile, partial: bounded by the tensor's size",
            "        first_block = n_total // (ROWS * BLOCK) * ROWS",
            "        n_elements = n_total",
            "    else:  # a tile wholly inside its tensor: a bound the compiler knows is a multiple of the tile",
            "        first_block = (pid - tl.load(entry)) * ROWS",
            "        n_elements = (first_block + ROWS) * BLOCK",
            *(f"    {p.name} = tl.multiple_of(tl.load(entry + {2 + k}).to(tl.pointer_type({_POINTEE[p.dtype]}), "
              "bitcast=True), 16)" for k, p in enumerate(tensors)),
            "    rows = first_block + tl.arange(0, ROWS).to(tl.int64)",
            "    cols = tl.arange(0, BLOCK)",
            "    offsets = rows[:, None] * BLOCK + cols[None, :]",
            "    mask = offsets < n_elements",
            "    row_mask = rows * BLOCK < n_elements",
        ]
        return "\n".join(head + ["    " + line for line in self.lines]) + "\n"

    def _ident(self, name: str) -> str:
        if name not in self.names:
            ident = f"v_{name}" if name in _RESERVED or keyword.iskeyword(name) else name
            self.names[name] = ident
        return self.names[name]

    def _param_name(self, node: Node) -> str:
        return f"{self._ident(node.name)}_ptr" if _is_tensor_input(node) else self._ident(node.name)

    def param(self, node: Node, dtype: torch.dtype | None = None) -> str:
        """The kernel parameter of input ``node`` (pointing to ``dtype``, or to its value's dtype)."""
        val = node.meta.get("val")
        self.used_inputs[node] = dtype or (val.dtype if isinstance(val, torch.Tensor) else None)
        return self._param_name(node)

    # inputs, outputs, state -------------------------------------------------------------------------
    def load(self, node: Node, dtype: torch.dtype) -> Value:
        name = self._ident(node.name)
        self.lines.append(f"{name} = lb.load_elements({self.param(node)}, offsets, mask, {_DTYPE_IDS[dtype]})")
        return Value(name, dtype, Kind.ELEMENT)

    def scalar_input(self, node: Node, dtype: torch.dtype | None) -> Value:
        name = self._ident(node.name)
        if dtype is None:  # an fp32 scalar, also under the interpreter (which passes Python floats as they are)
            self.lines.append(f"{name} = tl.cast({self.param(node)}, tl.float32)")
            return Value(name, torch.float32, Kind.SCALAR, host=True)
        if dtype == torch.bool:
            self.lines.append(f"{name} = tl.load({self.param(node)}) != 0")
        else:
            self.lines.append(f"{name} = lb.load_scalar({self.param(node)}, {_DTYPE_IDS[dtype]})")
        return Value(name, dtype, Kind.SCALAR, host=node.meta["val"].device.type == "cpu")

    def constant(self, value: float, dtype: torch.dtype = torch.float32) -> Value:
        if dtype == torch.bool:
            return Value("True" if value else "False", dtype, Kind.SCALAR, host=True, literal=value)
        text = repr(float(value)) if math.isfinite(value) else f"float('{value}')"
        return Value(text, dtype, Kind.SCALAR, host=True, atomic=math.isfinite(value) and value >= 0, literal=value)

    def store(self, node: Node, value: Value) -> None:
        dtype = node.meta["val"].dtype
        self.written.add(node)
        rounded = ", ROUNDED=True" if dtype == torch.bfloat16 and value.dtype == dtype else ""  # held as bf16
        self.lines.append(f"lb.store_elements({self.param(node)}, offsets, {value.text}, mask, {_DTYPE_IDS[dtype]}"
                          f"{rounded})")

    def _state_args(self, access: StateAccess) -> list[str]:
        codes, scales, patch_values, patch_index = access.parts
        fmt = access.fmt
        if not fmt.blockwise:
            return [self.param(codes, fmt.code_dtype), "None", "None", "None"]
        # a uint8 view of fp8 codes on the integer path; a 4-bit format's packed bytes
        codes_dtype = torch.uint8 if _is_fp8(fmt) and not self.target.fp8_native else fmt.storage_dtype
        pointers = [self.param(codes, codes_dtype), self.param(scales, torch.float32)]
        if not fmt.patches:
            return pointers + ["None", "None"]
        return pointers + [self.param(patch_values, PATCH_VALUE_DTYPE), self.param(patch_index, PATCH_INDEX_DTYPE)]

    def dequantize(self, state: StateAccess) -> Value:
        fmt = state.fmt
        table = self._table("lookup", fmt) if fmt.spec.lookup_table is not None else "None"
        name = self._ident(state.node.name)
        self.lines.append(f"# {fmt.tag()}")
        self.lines += _call_lines(f"{name} = lb.dequantize", self._state_args(state) + [
            table, "rows", "cols", "offsets", "mask", "row_mask", f"FMT={_format_id(fmt)}", f"K={fmt.patches}",
            *self._fp8_path(fmt), *_special_codes(fmt), *([f"NONNEG={fmt.nonneg}"] if fmt.packed else [])])
        return Value(name, torch.float32, Kind.ELEMENT)

    def quantize(self, state: StateAccess, value: Value, seed: Value | None) -> None:
        fmt = state.fmt
        self.written.update(state.parts)
        table = self._table("lookup", fmt) if fmt.spec.lookup_table is not None else "None"

        def inv(divisor: float) -> float:
            return _fp32_reciprocal(divisor) if self.target.cuda else 0.0

        flags = []
        if fmt.blockwise:
            if fmt.neg_qmax != fmt.qmax:  # an asymmetric signed map: a scale per side
                flags = [f"NEG_QMAX={fmt.neg_qmax!r}", f"INV_NEG_QMAX={inv(fmt.neg_qmax)!r}"]
            flags += [f"FLAGGED_QMAX={fmt.flagged_qmax!r}", f"INV_FLAGGED_QMAX={inv(fmt.flagged_qmax)!r}",
                      *_special_codes(fmt)]
        self.lines.append(f"# {fmt.tag()}")
        self.lines += _call_lines("lb.quantize", [value.text] + self._state_args(state) + [
            table, "rows", "cols", "offsets", "mask", "row_mask", f"FMT={_format_id(fmt)}",
            f"NONNEG={fmt.nonneg}", f"K={fmt.patches}", f"QMAX={fmt.qmax!r}", f"MIN_POSITIVE={fmt.min_positive!r}",
            f"INV_QMAX={inv(fmt.qmax)!r}", *self._fp8_path(fmt), *flags,
            *(["APPROXIMATE=True"] if self.approximate and fmt.blockwise else []),
            *([f"seed={seed.text}", f"STREAM={state.stream}"] if seed is not None else [])])

    def _fp8_path(self, fmt: StateFormat) -> list[str]:
        """The FP8 path of an fp8 state's calls (named only where it is the integer one)."""
        return ["FP8_NATIVE=False"] if _is_fp8(fmt) and not self.target.fp8_native else []

    def _master_args(self, master: MasterAccess) -> list[str]:
        ties = self.param(master.ties) if master.ties is not None else "None"
        return [self.param(master.param), self.param(master.residual), ties]

    def _master_flags(self, master: MasterAccess) -> list[str]:
        fmt = master.fmt
        return ["offsets", "mask", f"PARAM={_DTYPE_IDS[fmt.param_dtype]}", f"EXACT={fmt.exact}", f"SHIFT={fmt.shift}"]

    def master_read(self, master: MasterAccess) -> Value:
        name = self._ident(master.node.name)
        self.lines.append(f"# master weights {master.fmt.tag()}")
        self.lines += _call_lines(f"{name} = lb.master_read", self._master_args(master) + self._master_flags(master))
        return Value(name, torch.float32, Kind.ELEMENT)

    def master_write(self, master: MasterAccess, value: Value, seed: Value | None) -> None:
        self.written.update(n for n in (master.param, master.residual, master.ties) if n is not None)
        args = [value.text, *self._master_args(master), seed.text if seed is not None else "0.0"]
        self.lines.append(f"# master weights {master.fmt.tag()}")
        self.lines += _call_lines("lb.master_write", args + self._master_flags(master))

    def _table(self, kind: str, fmt: StateFormat) -> str:
        """The kernel parameter of ``fmt``'s table (``ElementFormat.lookup_table``, the only ``kind``)."""
        name = f"{fmt.name}_{'unsigned' if fmt.nonneg else 'signed'}_{kind}_ptr"
        if all(t.name != name for t in self.tables):
            self.tables.append(KernelParam(name, "table", table=fmt.name, nonneg=fmt.nonneg, dtype=torch.float32))
        return name

    def bind(self, value: Value, name: str) -> Value:
        if value.atomic and (value.literal is not None or value.text.isidentifier()):
            return value
        ident = self._ident(name)
        self.lines.append(f"{ident} = {value.text}")
        return Value(ident, value.dtype, value.kind, value.host)

    # arithmetic -----------------------------------------------------------------------------------
    def add(self, a: Value, b: Value) -> Value:
        return _infix(a, "+", b)

    def sub(self, a: Value, b: Value) -> Value:
        return _infix(a, "-", b)

    def mul(self, a: Value, b: Value) -> Value:
        return _infix(a, "*", b)

    def div(self, a: Value, b: Value) -> Value:
        if self.approximate:  # div.full.f32: 2 ulp, a fraction of div.rn's instructions
            return _infix(a, "/", b)
        return _call("tl.math.div_rn", a, b)

    def fma(self, a: Value, b: Value, c: Value) -> Value:
        return _call("tl.fma", a, b, c)

    def sqrt(self, a: Value, correctly_rounded: bool = False) -> Value:
        return _call("tl.sqrt" if self.approximate else "tl.sqrt_rn", a)

    def neg(self, a: Value) -> Value:
        if a.literal is not None:
            return self.constant(-a.literal, a.dtype)
        return Value(f"lb.neg({a.text})", a.dtype, a.kind, a.host)  # not -x: the sign of zero (triton_lib.neg)

    def abs(self, a: Value) -> Value:
        return _call("tl.abs", a, dtype=a.dtype)

    def maximum(self, a: Value, b: Value) -> Value:
        return Value(f"tl.maximum({a.text}, {b.text}, propagate_nan=tl.PropagateNan.ALL)", torch.float32,
                     _kind(a, b))

    def minimum(self, a: Value, b: Value) -> Value:
        return Value(f"tl.minimum({a.text}, {b.text}, propagate_nan=tl.PropagateNan.ALL)", torch.float32,
                     _kind(a, b))

    def round_to(self, a: Value, dtype: torch.dtype) -> Value:
        return Value(f"lb.round_to({a.text}, {_DTYPE_IDS[dtype]})", dtype, a.kind)

    # comparisons and selection ---------------------------------------------------------------------------
    def lt(self, a: Value, b: Value) -> Value:
        return _infix(a, "<", b, torch.bool)

    def le(self, a: Value, b: Value) -> Value:
        return _infix(a, "<=", b, torch.bool)

    def gt(self, a: Value, b: Value) -> Value:
        return _infix(a, ">", b, torch.bool)

    def ge(self, a: Value, b: Value) -> Value:
        return _infix(a, ">=", b, torch.bool)

    def eq(self, a: Value, b: Value) -> Value:
        return _infix(a, "==", b, torch.bool)

    def ne(self, a: Value, b: Value) -> Value:
        return _infix(a, "!=", b, torch.bool)

    def logical_and(self, a: Value, b: Value) -> Value:
        return _infix(a, "&", b, torch.bool)

    def logical_or(self, a: Value, b: Value) -> Value:
        return _infix(a, "|", b, torch.bool)

    def logical_not(self, a: Value) -> Value:
        return _infix(a, "==", self.constant(False, torch.bool), torch.bool)

    def where(self, cond: Value, a: Value, b: Value) -> Value:
        dtype = a.dtype if a.dtype == b.dtype else torch.float32
        return Value(f"tl.where({cond.text}, {a.text}, {b.text})", dtype, _kind(cond, a, b))

    def to_float(self, cond: Value) -> Value:
        return Value(f"tl.where({cond.text}, 1.0, 0.0)", torch.float32, cond.kind)


# helpers ----------------------------------------------------------------------------------------------
def _is_fp8(fmt: StateFormat) -> bool:
    return fmt.spec.fp8_mantissa is not None


def _format_id(fmt: StateFormat) -> str:
    """The triton_lib constant of a format (``ElementFormat.triton_name``, whose value is its id)."""
    return f"lb.{fmt.spec.triton_name}"


def _special_codes(fmt: StateFormat) -> list[str]:
    """The +inf, -inf and NaN codes of a flagged block of a blockwise ``fmt``, as call arguments."""
    if not fmt.blockwise:
        return []
    return [f"{name}={code}" for name, code in zip(("POS_INF_CODE", "NEG_INF_CODE", "NAN_CODE"), special_codes(fmt))]


def _is_tensor_input(node: Node) -> bool:
    desc = input_of(node)
    return (desc is not None and desc.role is Role.STATE_PART) or isinstance(node.meta.get("val"), torch.Tensor)


def _is_tile(node: Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dim() > 0


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
