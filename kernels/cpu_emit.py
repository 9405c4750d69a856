"""Emit one fused C++ kernel (the CPU lowering) from the body of a split, rewritten step graph.

The kernel walks each parameter block by block (``block_size`` elements, the quantization block).
Per block it runs the traced update lane by lane on SIMD vectors, decoding each quantized state as
it goes (codes times the block's scale, the block's patches put in their lanes), writes the param,
and writes each new state value into an L1-resident block buffer while gathering each lane's
largest magnitudes; it then re-quantizes each buffer into codes, scale and patches
(``cpu_prelude.h``). Every byte of p, g and the codes is read
once and written once; no state ever exists in fp32 outside the per-thread block buffers.

The update math comes from the graph node by node, so the kernel computes what torch computes:
fp32 (or, for bf16 tensors, fp32 rounded to bf16 after every op, as aten does) with the FMA
contractions of aten's own CPU kernels (see ``_OPS``). An op or dtype this emitter does not know
raises :class:`UnsupportedStep`; the lowering then falls back to the reference.

One kernel serves every parameter of its signature, any size, and any number of parameters per
call: the exported function takes a table with one row per tensor (its element count and the data
pointers of its inputs) and the step's scalar inputs, and splits all blocks of all rows over threads.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.fx import GraphModule, Node

from .formats import StateFormat, dynamic_map, dynamic_midpoints

aten = torch.ops.aten
PRELUDE = (Path(__file__).parent / "cpu_prelude.h").read_text()
ENTRY = "lowbit_step"
DEFAULT_CHUNK = 2048  # block length when no state is blockwise (only the unit of work)

_FMT_ENUM = {"int8": "LB_INT8", "dynamic8": "LB_DYNAMIC8", "fp8_e4m3": "LB_E4M3", "fp8_e5m2": "LB_E5M2"}
_FLOAT_DTYPES = {torch.float32: "float", torch.bfloat16: "uint16_t"}
_PARTS = ("codes", "scales", "patch_values", "patch_index")


class UnsupportedStep(NotImplementedError):
    """The body uses an op or dtype the CPU emitter does not cover."""


@dataclass(frozen=True)
class PointerInput:
    """One per-element input of the body as the kernel sees it: a contiguous buffer."""

    index: int  # position among the body's inputs
    name: str
    dtype: torch.dtype
    length: str  # "n" (one per element), "blocks" (one per block), "patches" (K per block) or "empty"
    written: bool


@dataclass(frozen=True)
class EmittedStep:
    """The C++ of one signature's fused step and how to call it."""

    source: str  # the generated part; ``full_source`` prepends the prelude
    pointers: tuple[PointerInput, ...]
    scalars: tuple[int, ...]  # positions among the body's inputs, passed as doubles in this order
    block: int
    patches: int
    mkl_sqrt: bool  # calls the square root set by lowbit_set_vsqrt

    @property
    def full_source(self) -> str:
        return PRELUDE + "\n// ---- generated from the rewritten step body ----\n" + self.source


@dataclass
class _State:
    """A quantized state of the body: its four storage inputs and format."""

    key: str
    fmt: StateFormat
    parts: dict[str, Node]
    dequantized: Node | None = None
    new_value: Node | None = None


def _p(state: _State, part: str) -> str:
    """The C name of the pointer to one storage part of a quantized state."""
    return f"p_{state.parts[part].name}"


def _cfloat(x: float) -> str:
    if math.isnan(x):
        return "NAN"
    if math.isinf(x):
        return "INFINITY" if x > 0 else "-INFINITY"
    return f"(float){float(x).hex()}"


def emit_step(body: GraphModule, exact: bool) -> EmittedStep:
    """Generate the kernel for ``body`` (the ``body`` child of a split, rewritten step).

    ``exact`` rounds every float32 value as torch does: square roots through MKL's vsSqrt (set with
    ``lowbit_set_vsqrt``; torch's own float32 sqrt, not correctly rounded) in one more pass over the
    block, and true division by scalars. That makes a step without quantized states bit-for-bit
    stock. Otherwise the SIMD square root and a multiply by the scalar's reciprocal, each within one
    float32 rounding of torch's result; states (which take neither) stay bit-exact either way.
    """
    return _Emitter(body, exact).emit()


class _Emitter:
    def __init__(self, body: GraphModule, exact: bool) -> None:
        self.exact = exact
        self.graph = body.graph
        self.placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        self.states: dict[str, _State] = {}
        self.ptr_of: dict[Node, PointerInput] = {}
        self.scalar_of: dict[Node, int] = {}
        self.lines: list[str] = []
        self.pre: list[str] = []  # per-block setup before the lane loop
        self.consts: dict[str, str] = {}

    # ---- inputs ---------------------------------------------------------------------------------
    def _classify_inputs(self) -> tuple[tuple[PointerInput, ...], tuple[int, ...]]:
        written = {n.args[0] for n in self.graph.nodes if n.target is aten.copy_.default}
        for node in self.graph.nodes:
            if node.target is torch.ops.lowbit.dequantize.default or node.target is torch.ops.lowbit.quantize_.default:
                parts = node.args[:4] if node.target is torch.ops.lowbit.dequantize.default else node.args[1:5]
                key = parts[0].meta["lowbit_input"][1]
                fmt = StateFormat.from_tag(node.args[4] if node.target is torch.ops.lowbit.dequantize.default
                                           else node.args[5])
                state = self.states.setdefault(key, _State(key, fmt, dict(zip(_PARTS, parts))))
                if node.target is torch.ops.lowbit.dequantize.default:
                    state.dequantized = node
                else:
                    state.new_value = node.args[0]
        part_dtype = {}
        for state in self.states.values():
            codes_dtype = torch.bfloat16 if state.fmt.name == "bf16" else torch.uint8
            lengths = ("n", "blocks", "patches", "patches") if state.fmt.blockwise else ("n", "empty", "empty", "empty")
            for part, dtype, length in zip(_PARTS, (codes_dtype, torch.float32, torch.bfloat16, torch.int16), lengths):
                part_dtype[state.parts[part]] = (dtype, length, state.new_value is not None)
        pointers, scalars = [], []
        for index, node in enumerate(self.placeholders):
            if node in part_dtype:
                dtype, length, is_written = part_dtype[node]
                ptr = PointerInput(index, node.name, dtype, length, is_written)
            elif node.meta.get("per_element"):
                dtype = node.meta["val"].dtype
                if dtype not in _FLOAT_DTYPES:
                    raise UnsupportedStep(f"per-element input {node.name!r} has dtype {dtype}; the CPU kernel "
                                          "handles float32 and bfloat16 tensors")
                ptr = PointerInput(index, node.name, dtype, "n", node in written)
            else:
                self.scalar_of[node] = len(scalars)
                scalars.append(index)
                continue
            self.ptr_of[node] = ptr
            pointers.append(ptr)
        return tuple(pointers), tuple(scalars)

    def _block_and_patches(self) -> tuple[int, int]:
        blockwise = {(s.fmt.block_size, s.fmt.patches) for s in self.states.values() if s.fmt.blockwise}
        if len(blockwise) > 1:
            raise UnsupportedStep(f"states with different block sizes or patch counts in one step: {blockwise}")
        return next(iter(blockwise)) if blockwise else (DEFAULT_CHUNK, 0)

    # ---- values ---------------------------------------------------------------------------------
    def _var(self, node: Node) -> str:
        return f"v_{node.name}"

    def _arg(self, a: object) -> str:
        """A vector expression for an op argument: a per-element value, a scalar input or a constant."""
        if isinstance(a, Node):
            if a in self.scalar_of:
                return f"S{self.scalar_of[a]}"
            return self._var(a)
        if isinstance(a, (int, float)) and not isinstance(a, bool):
            return f"lb_splat({_cfloat(a)})"
        raise UnsupportedStep(f"argument {a!r} of type {type(a).__name__}")

    def _scalar_float(self, a: object) -> str:
        """A scalar (C float) expression, for arguments that must be scalars (lerp's weight)."""
        if isinstance(a, Node) and a in self.scalar_of:
            return f"s[{self.scalar_of[a]}]"
        if isinstance(a, (int, float)) and not isinstance(a, bool):
            return _cfloat(a)
        raise UnsupportedStep(f"expected a scalar, got {a!r}")

    def _dtype(self, node: Node) -> torch.dtype:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise UnsupportedStep(f"node {node.name!r} has no tensor metadata")
        if val.dtype not in _FLOAT_DTYPES:
            raise UnsupportedStep(f"node {node.name!r} computes in {val.dtype}; the CPU kernel handles "
                                  "float32 and bfloat16")
        return val.dtype

    def _load(self, ptr: PointerInput) -> str:
        if ptr.dtype == torch.float32:
            return f"full ? lb_ld(p_{ptr.name} + i) : lb_ld_n(p_{ptr.name} + i, r)"
        return f"full ? lb_ld_bf16(p_{ptr.name} + i) : lb_ld_bf16_n(p_{ptr.name} + i, r)"

    def _store(self, ptr: PointerInput, value: str) -> str:
        if ptr.dtype == torch.float32:
            return f"if (full) lb_st(p_{ptr.name} + i, {value}); else lb_st_n(p_{ptr.name} + i, {value}, r);"
        return f"if (full) lb_st_bf16(p_{ptr.name} + i, {value}); else lb_st_bf16_n(p_{ptr.name} + i, {value}, r);"

    def _lerp_weight(self, w: object) -> tuple[str, str, str]:
        """Per-call constants of a scalar lerp weight: (small?, w, w - 1), as aten's lerp_vec uses."""
        expr = self._scalar_float(w)
        name = f"L{len(self.consts)}"
        self.consts[name] = expr
        self.pre.append(f"const bool {name}_small = fabsf({expr}) < 0.5f;")
        self.pre.append(f"const vf {name}_w = lb_splat({expr}), {name}_wm1 = lb_splat({expr} - 1.0f);")
        return f"{name}_small", f"{name}_w", f"{name}_wm1"

    def _op(self, node: Node) -> str:
        """The vector expression of one aten op, mirroring the formula (and FMA use) of aten's CPU kernel."""
        t, args, kw = node.target, node.args, node.kwargs
        a = [self._arg(x) for x in args]
        if t in (aten.add.Tensor, aten.sub.Tensor):
            if len(args) != 2:
                raise UnsupportedStep(f"{t} with {len(args)} positional arguments")
            alpha = kw.get("alpha")
            if alpha is None:
                return f"{a[0]} {'+' if t is aten.add.Tensor else '-'} {a[1]}"
            alpha_expr = self._arg(alpha) if t is aten.add.Tensor else f"(-{self._arg(alpha)})"
            if self._dtype(node) == torch.bfloat16:
                alpha_expr = f"lb_round_bf16({alpha_expr})"  # aten casts alpha to the tensor's dtype
            return f"lb_fma({a[1]}, {alpha_expr}, {a[0]})"  # ufunc::add: fmadd(other, alpha, self)
        if t is aten.mul.Tensor:
            return f"{a[0]} * {a[1]}"
        if t is aten.div.Tensor:
            if not self.exact and not (isinstance(args[1], Node) and args[1] not in self.scalar_of):
                name = f"R{len(self.consts)}"
                self.consts[name] = self._scalar_float(args[1])
                self.pre.append(f"const vf {name} = lb_splat(1.0f / {self.consts[name]});")
                return f"{a[0]} * {name}"
            return f"{a[0]} / {a[1]}"
        if t is aten.neg.default:
            return f"-{a[0]}"
        if t is aten.sqrt.default:
            return f"lb_sqrt({a[0]})"
        if t is aten.rsqrt.default:
            return f"lb_splat(1.0f) / lb_sqrt({a[0]})"
        if t is aten.maximum.default:
            return f"lb_maximum({a[0]}, {a[1]})"
        if t is aten.minimum.default:
            return f"lb_minimum({a[0]}, {a[1]})"
        if t is aten.lerp.Scalar:
            small, w, wm1 = self._lerp_weight(args[2])
            # lerp_vec: fmadd(small ? w : w - 1, end - self, small ? self : end)
            return (f"{small} ? lb_fma({w}, {a[1]} - {a[0]}, {a[0]}) "
                    f": lb_fma({wm1}, {a[1]} - {a[0]}, {a[1]})")
        if t is aten.addcmul.default:
            value = self._arg(kw.get("value", 1.0))
            return f"lb_fma({value} * {a[1]}, {a[2]}, {a[0]})"  # self + value * t1 * t2, contracted
        if t is aten.addcdiv.default:
            value = self._arg(kw.get("value", 1.0))
            return f"{a[0]} + {value} * {a[1]} / {a[2]}"
        if t in (aten.clone.default, aten.alias.default):
            return a[0]
        if t is aten._to_copy.default:
            return a[0]  # the rounding to the new dtype follows from the node's dtype
        raise UnsupportedStep(f"the CPU kernel does not implement {t} (node {node.name!r})")

    _EXACT = (aten.neg.default, aten.maximum.default, aten.minimum.default, aten.clone.default, aten.alias.default)

    # ---- the kernel -----------------------------------------------------------------------------
    def emit(self) -> EmittedStep:
        pointers, scalars = self._classify_inputs()
        self.block, patches = self._block_and_patches()
        values: dict[Node, str] = {}  # node -> the statement defining its vector value
        stores: list[str] = []
        for node in self.graph.nodes:
            if node.op in ("placeholder", "output"):
                if node.op == "placeholder" and node.meta.get("role") in ("param", "grad", "per_element_state"):
                    values[node] = f"const vf {self._var(node)} = {self._load(self.ptr_of[node])};"
                continue
            if node.op != "call_function":
                raise UnsupportedStep(f"node {node.name!r} is a {node.op}")
            if node.target is torch.ops.lowbit.dequantize.default:
                values[node] = self._dequantized(node)
            elif node.target is torch.ops.lowbit.quantize_.default:
                stores.extend(self._quantized(node))
            elif node.target is aten.copy_.default:
                dst, src = node.args
                if dst not in self.ptr_of:
                    raise UnsupportedStep(f"copy_ into {dst.name!r}, which is not a per-element input")
                stores.append(self._store(self.ptr_of[dst], self._var(src)))  # a bf16 store rounds
            elif node.target is operator.getitem:
                raise UnsupportedStep(f"multi-output node feeding {node.name!r}")
            else:
                expr = self._op(node)
                if self._dtype(node) == torch.bfloat16 and node.target not in self._EXACT:
                    expr = f"lb_round_bf16({expr})"
                values[node] = f"const vf {self._var(node)} = {expr};"
        self.staged = [n for n in values if self.exact and n.target is aten.sqrt.default
                       and self._dtype(n) == torch.float32]
        passes = []
        if self.staged:
            assert not self.states, "exact square roots are for steps without quantized states"
            # torch's float32 sqrt is MKL's vsSqrt (not correctly rounded): the first pass writes
            # every sqrt input of the block to a buffer, MKL takes the square roots in place, and
            # the second pass runs the whole update reading them back.
            cone = self._ancestors(self.staged)
            if any(n in cone for n in self.staged):
                raise UnsupportedStep("a square root of a square root")
            first = [values[n] for n in values if n in cone and n not in self.staged]
            first += [f"if (full) lb_st(sq_{n.name} + i, {self._var(n.args[0])}); "
                      f"else lb_st_n(sq_{n.name} + i, {self._var(n.args[0])}, r);" for n in self.staged]
            passes.append(first)
            for n in self.staged:
                values[n] = f"const vf {self._var(n)} = full ? lb_ld(sq_{n.name} + i) : lb_ld_n(sq_{n.name} + i, r);"
        passes.append(list(values.values()) + stores)
        return EmittedStep(self._render(pointers, scalars, passes), pointers, scalars, self.block, patches,
                           bool(self.staged))

    @staticmethod
    def _ancestors(nodes: list[Node]) -> set[Node]:
        seen: set[Node] = set()
        todo = [a for n in nodes for a in n.all_input_nodes]
        while todo:
            n = todo.pop()
            if n not in seen:
                seen.add(n)
                todo.extend(n.all_input_nodes)
        return seen

    def _dequantized(self, node: Node) -> str:
        """Statements decoding one vector of a state: codes times the block's scale, with the
        block's patches (sorted by offset before the loop) put in the lanes they fall on."""
        state = self.states[node.args[0].meta["lowbit_input"][1]]
        v, k, codes = self._var(node), state.key, _p(state, "codes")
        if state.fmt.name == "bf16":
            code = [f"vf {v} = full ? lb_ld_bf16({codes} + i) : lb_ld_bf16_n({codes} + i, r);"]
        else:
            code = [f"vf {v} = lb_decode<{_FMT_ENUM[state.fmt.name]}, {'true' if state.fmt.nonneg else 'false'}>("
                    f"full ? lb_ld_codes({codes} + i) : lb_ld_codes_n({codes} + i, r), {self._map(state, 'map')}) "
                    f"* SC_{k};"]
            if state.fmt.patches:
                code += [f"while (PN_{k} < i + LB_W) {{  // a patch falls in this vector",
                         f"  {v}[PN_{k} - i] = PV_{k}[PA_{k}];",
                         f"  PN_{k} = ++PA_{k} < PC_{k} ? PI_{k}[PA_{k}] : LB_NO_PATCH;",
                         "}"]
        if self._dtype(node) == torch.bfloat16:
            code.append(f"{v} = lb_round_bf16({v});")
        return "\n".join(code)

    def _quantized(self, node: Node) -> list[str]:
        key = node.args[1].meta["lowbit_input"][1]
        state = self.states[key]
        x = self._var(node.args[0])
        if state.fmt.name == "bf16":
            u = "true" if state.fmt.nonneg else "false"
            v, codes = f"lb_bf16_state_clamp<{u}>({x})", _p(state, "codes")
            return [f"if (full) lb_st_bf16({codes} + i, {v}); else lb_st_bf16_n({codes} + i, {v}, r);"]
        return [f"if (full) lb_st(buf_{key} + i, {x}); else lb_st_n(buf_{key} + i, {x}, r);",
                f"acc_{key} = lb_vmax(acc_{key}, lb_key_masked({x}, r));"]

    def _render(self, pointers: tuple[PointerInput, ...], scalars: tuple[int, ...], passes: list[list[str]]) -> str:
        blockwise = [s for s in self.states.values() if s.fmt.blockwise]
        out: list[str] = []
        for nonneg in sorted({s.fmt.nonneg for s in blockwise if s.fmt.name == "dynamic8"}):
            sign = "u" if nonneg else "s"
            self._table(out, f"lb_dyn_map_{sign}", dynamic_map(nonneg).tolist())
            self._table(out, f"lb_dyn_mids_{sign}", dynamic_midpoints(nonneg).tolist())
            out.append(f"static const lb_dyn_keys lb_dyn_keys_{sign} = lb_dyn_build(lb_dyn_mids_{sign});")
        row = len(pointers) + 1
        out += [
            f"static const int64_t LB_BLOCK = {self.block};",
            f"static const int64_t LB_ROW = {row};  // element count, then one pointer per input",
            f"static const int LB_N_SCALARS = {len(scalars)};",
            f"static const int LB_N_BUFS = {len(blockwise) + len(self.staged)};",
            "",
            "static void lb_step_block(const int64_t* ptr, const float* s, int64_t start, int64_t len, int64_t blk,",
            "                          float* scratch) {",
        ]
        ind = "  "
        patches = {s.parts[part].name: s.fmt.patches for s in blockwise for part in _PARTS[2:]}
        for j, p in enumerate(pointers):
            ctype = {torch.float32: "float", torch.bfloat16: "uint16_t", torch.uint8: "uint8_t",
                     torch.int16: "int16_t"}[p.dtype]
            const = "" if p.written else "const "
            offset = {"n": "start", "blocks": "blk", "empty": "0", "patches": f"blk * {patches.get(p.name)}"}[p.length]
            out.append(f"{ind}{const}{ctype}* __restrict p_{p.name} = ({const}{ctype}*)ptr[{j}] + {offset};")
        for j in range(len(scalars)):
            out.append(f"{ind}const vf S{j} = lb_splat(s[{j}]);")
        out += [f"{ind}{line}" for line in self.pre]
        for b, s in enumerate(blockwise):
            out.append(f"{ind}float* __restrict buf_{s.key} = scratch + {b} * LB_BLOCK;")
            if s.dequantized is not None:
                k, scales, pv, pi = s.key, _p(s, "scales"), _p(s, "patch_values"), _p(s, "patch_index")
                out.append(f"{ind}const vf SC_{k} = lb_splat(*{scales});")
                if s.fmt.patches:
                    out.append(f"{ind}int64_t PI_{k}[{s.fmt.patches}];")
                    out.append(f"{ind}float PV_{k}[{s.fmt.patches}];")
                    out.append(f"{ind}const int PC_{k} = lb_sorted_patches<{s.fmt.patches}>({pi}, {pv}, len, PI_{k}, "
                               f"PV_{k});")
                    out.append(f"{ind}int PA_{k} = 0;")
                    out.append(f"{ind}int64_t PN_{k} = PC_{k} ? PI_{k}[0] : LB_NO_PATCH;")
            if s.new_value is not None:
                out.append(f"{ind}vi acc_{s.key} = lb_splat_i(-1);")
        for b, n in enumerate(self.staged):
            out.append(f"{ind}float* __restrict sq_{n.name} = scratch + {len(blockwise) + b} * LB_BLOCK;")
        for k, lane_body in enumerate(passes):
            # The lane body appears twice, for whole vectors and for the tail, with no closure: values
            # that live across iterations (scalars, top-K accumulators) stay in registers.
            out.append(f"{ind}{{")
            out.append(f"{ind}  int64_t i = 0;")
            out.append(f"{ind}  for (; i + LB_W <= len; i += LB_W) {{")
            out.append(f"{ind}    const bool full = true;")
            out.append(f"{ind}    const int64_t r = LB_W;")
            body = [f"{ind}    {line}" for statement in lane_body for line in statement.split("\n")]
            out += body
            out.append(f"{ind}  }}")
            out.append(f"{ind}  if (i < len) {{")
            out.append(f"{ind}    const bool full = false;")
            out.append(f"{ind}    const int64_t r = len - i;")
            out += body
            out.append(f"{ind}  }}")
            out.append(f"{ind}}}")
            if k == 0 and len(passes) > 1:
                out += [f"{ind}lb_vsqrt(len, sq_{n.name});" for n in self.staged]
        for s in blockwise:
            if s.new_value is not None:
                codes, scales, pv, pi = (_p(s, part) for part in _PARTS)
                out.append(f"{ind}{self._block_call('lb_quantize_block', s)}(acc_{s.key}, buf_{s.key}, len, LB_BLOCK, "
                           f"{_cfloat(s.fmt.qmax)}, {codes}, {scales}, {pv}, {pi}, {self._map(s, 'keys')});")
        out.append("}")
        out.append(_ENTRY_FN)
        return "\n".join(out) + "\n"

    @staticmethod
    def _block_call(fn: str, s: _State) -> str:
        return f"{fn}<{_FMT_ENUM[s.fmt.name]}, {'true' if s.fmt.nonneg else 'false'}, {s.fmt.patches}>"

    @staticmethod
    def _map(s: _State, which: str) -> str:
        if s.fmt.name != "dynamic8":
            return "nullptr"
        return f"lb_dyn_{which}_{'u' if s.fmt.nonneg else 's'}" + (".e" if which == "keys" else "")

    @staticmethod
    def _table(out: list[str], name: str, values: list[float]) -> None:
        body = ", ".join(f"{float(v).hex()}f" for v in values)
        out.append(f"static const float {name}[{len(values)}] = {{{body}}};")


_ENTRY_FN = """
// table: one row of LB_ROW int64 per tensor (element count, then its input pointers);
// scalars: the step's scalar inputs (rounded to float, as aten rounds a Python scalar).
extern "C" int lowbit_step(int64_t n_tensors, const int64_t* table, const double* scalars, int n_threads) {
  float s[LB_N_SCALARS > 0 ? LB_N_SCALARS : 1];
  for (int k = 0; k < LB_N_SCALARS; ++k) s[k] = (float)scalars[k];
  if (lb_dyn_bad) return 3;
  int64_t* first = (int64_t*)malloc((n_tensors + 1) * sizeof(int64_t));
  if (!first) return 1;
  first[0] = 0;
  for (int64_t t = 0; t < n_tensors; ++t) first[t + 1] = first[t] + (table[t * LB_ROW] + LB_BLOCK - 1) / LB_BLOCK;
  const int64_t total = first[n_tensors];
  int64_t nt = n_threads < 1 ? 1 : n_threads;
  if (nt > total) nt = total > 0 ? total : 1;
  int failed = 0;
#pragma omp parallel num_threads(nt) if (nt > 1)
  {
    const int64_t tid = omp_get_thread_num(), nth = omp_get_num_threads();
    const int64_t lo = total * tid / nth, hi = total * (tid + 1) / nth;
    float* scratch = lb_scratch(LB_N_BUFS * LB_BLOCK + 1);
    if (!scratch) {
#pragma omp atomic write
      failed = 1;
    } else {
      int64_t t = 0;
      for (int64_t g = lo; g < hi; ++g) {
        while (first[t + 1] <= g) ++t;
        const int64_t* row = table + t * LB_ROW;
        const int64_t blk = g - first[t], start = blk * LB_BLOCK;
        const int64_t len = row[0] - start < LB_BLOCK ? row[0] - start : LB_BLOCK;
        lb_step_block(row + 1, s, start, len, blk, scratch);
      }
    }
  }
  free(first);
  return failed ? 2 : 0;
}"""
