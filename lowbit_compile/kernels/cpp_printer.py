"""The C++ printer: one fused CPU kernel from the body of a split, rewritten step graph.

The kernel walks each parameter block by block (``block_size`` elements, the quantization block).
Per block it runs the body's ops, as ``lowering.py`` lowers them, lane by lane on SIMD vectors,
decoding each quantized state as it goes (codes times the block's scale, the block's patches put in
their lanes), writes the param, and writes each new state value into an L1-resident block buffer
while gathering each lane's largest magnitudes; it then takes each buffer's scale and patches
(``cpu_prelude.h``), and the buffer's codes are written by the next block's lane loop, a vector per
iteration just before that vector of the buffer is overwritten (int8 and sqrt8, whose encodes are a
few instructions), or in loops of their own after the block (``lb_finish``: the longer encodes, a
block of another length, a thread's last block). Every byte of p, g and the codes is read once and
written once; no state ever exists in fp32 outside the per-thread block buffers. Values uniform over
the kernel (hyperparameters, bias corrections, lerp's weight tests) are computed once per block,
before the lane loop.

One kernel serves every parameter of its signature, any size, and any number of parameters per
call: the exported function takes a table with one row per tensor (its element count and the data
pointers of its inputs) and the step's scalar inputs, and splits all blocks of all rows over threads.

Three parts: this module prints the primitives (``primitives.py``) as C++ statements into a
``cpp_layout.BlockKernel``, which holds them as records, schedules the lane loop and lays the block
function out; the fixed C++ (vector helpers, formats, block quantization, the exported step's loop
over tensors, threads and blocks) is ``cpu_prelude.h``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.fx import GraphModule, Node

from ..formats import StateFormat, domain_bound, registered, special_codes
from ..formats.dynamic import DYNAMIC_LEVEL_FIELDS, dynamic_level_table
from ..ir.contract import (
    PARTS,
    MasterAccess,
    Part,
    Role,
    StateAccess,
    identifier,
    input_of,
    master_access,
    state_access,
)
from .cpp_layout import BlockKernel, KernelState, LanePass, PointerInput, Stmt, sign_name
from .lowering import LoweringError, Target, lower_body
from .primitives import Kind, Value

ENTRY = "lowbit_step"
DEFAULT_CHUNK = 2048  # block length when no state is blockwise (only the unit of work)

_LOAD = {torch.float32: "lb_ld", torch.bfloat16: "lb_ld_bf16", torch.float16: "lb_ld_f16"}
_STORE = {torch.float32: "lb_st", torch.bfloat16: "lb_st_bf16", torch.float16: "lb_st_f16"}
_ROUND = {torch.bfloat16: "lb_round_bf16", torch.float16: "lb_round_f16"}
# Formats whose encode is a few vector instructions (ElementFormat.fused_cpu_encode): the next block's lane
# loop writes a block's codes, its square roots and conversions overlapping that block's arithmetic.
# dynamic8's longer encode (seven permutes, two fmas and a floor per vector) runs slower that way than in a
# loop of its own (bench/results/cpu_fused_encode.md). Only a 16-lane build fuses (the prelude's lb_fuse_if):
# with AVX2's 16 registers sqrt8's, int8's and fp8's ran 1.1-1.2x faster in loops of their own at the default
# rounding, level to nearest (docs/performance.md).
_FUSED_ENCODES = frozenset(f.name for f in registered() if f.fused_cpu_encode)


@dataclass(frozen=True)
class _Expr(Value):
    """A :class:`Value` with what the lane loop's scheduling needs, kept as the expression is built
    (never read back from its text): the names it reads, whether it holds a divide or vector square
    root, and the operand it is the square root of."""

    uses: frozenset[str] = frozenset()
    slow: bool = False
    root_of: str | None = None


def _named(name: str, dtype: torch.dtype, kind: Kind, host: bool = False) -> _Expr:
    return _Expr(name, dtype, kind, host, uses=frozenset({name}))


def _is_name(v: Value) -> bool:
    return isinstance(v, _Expr) and v.uses == {v.text}


def _reads(*values: Value) -> frozenset[str]:
    return frozenset().union(*(v.uses for v in values if isinstance(v, _Expr)))


def _slow(*values: Value) -> bool:
    return any(isinstance(v, _Expr) and v.slow for v in values)


def _cbool(x: object) -> str:
    return "true" if x else "false"


def _cfloat(x: float) -> str:
    if math.isnan(x):
        return "LB_NAN"
    if math.isinf(x):
        return "LB_INF" if x > 0 else "-LB_INF"
    return f"(float){float(x).hex()}"


def format_constants() -> str:
    """The prelude's format enum and per-format constants, from the registry (every format a kernel reads:
    those with a ``cpp_name``)."""
    kernel_formats = [f for f in registered() if f.cpp_name is not None]
    enum = ", ".join(f"{f.cpp_name} = {f.id}" for f in kernel_formats)

    def those(names: list[str]) -> str:
        return " || ".join(f"F == {name}" for name in names) or "false"

    lines = ["enum { " + enum + " };",
             "template <int F> constexpr bool lb_root_domain = "
             f"{those([f.cpp_name for f in kernel_formats if f.root_domain])};  // encodes from the square root",
             "template <int F> constexpr bool lb_packed = "
             f"{those([f.cpp_name for f in kernel_formats if f.bits == 4])};  // two 4-bit codes a byte",
             "template <int F, bool U> struct lb_format {};  // qmax, min_positive (blockwise: neg_qmax, flagged_qmax, "
             "the two in encode's input domain, the +inf, -inf and NaN codes of a flagged block; fp8: mantissa, "
             "min_exponent)"]
    for spec in kernel_formats:
        for nonneg in (False, True):
            fmt = StateFormat(spec.name, nonneg=nonneg)
            fields = f"static constexpr float qmax = {_cfloat(fmt.qmax)}, min_positive = {_cfloat(fmt.min_positive)};"
            if fmt.blockwise:
                pos_inf, neg_inf, nan = special_codes(fmt)
                fields += (f" static constexpr float neg_qmax = {_cfloat(fmt.neg_qmax)}, "
                           f"flagged_qmax = {_cfloat(fmt.flagged_qmax)}, "
                           f"enc_qmax = {_cfloat(domain_bound(fmt, fmt.qmax))}, "
                           f"enc_flagged_qmax = {_cfloat(domain_bound(fmt, fmt.flagged_qmax))}; static constexpr int "
                           f"pos_inf_code = {pos_inf}, neg_inf_code = {neg_inf}, nan_code = {nan};")
            if spec.fp8_mantissa is not None:
                fields += f" static constexpr int mantissa = {fmt.mantissa_bits}, min_exponent = {fmt.min_exponent};"
            lines.append(f"template <> struct lb_format<{spec.cpp_name}, {_cbool(nonneg)}> {{ {fields} }};")
    return "\n".join(lines + _dynamic_levels())


def _dynamic_levels() -> list[str]:
    """``lb_dyn<U>``: the dynamic map's levels (``formats.dynamic_level_table``); ``lower`` by level,
    the other fields by permute slot, level L at ``(127 + L) & 7`` (the low bits of the fp32
    exponent of a code magnitude of level L)."""
    lines = ["template <bool U> struct lb_dyn {};  // formats.dynamic_level_table"]
    for nonneg in (False, True):
        table = dict(zip(DYNAMIC_LEVEL_FIELDS, dynamic_level_table(nonneg).tolist()))
        fields = [f"static constexpr int levels = {8 if nonneg else 7};"]
        for name in DYNAMIC_LEVEL_FIELDS[:-1]:
            values = table[name] if name == "lower" else [table[name][(slot + 1) % 8] for slot in range(8)]
            fields.append(f"static constexpr float {name}[8] = {{{', '.join(map(_cfloat, values))}}};")
        body = "\n  ".join(fields)
        lines.append(f"template <> struct lb_dyn<{_cbool(nonneg)}> {{\n  {body}\n}};")
    return lines


PRELUDE = (Path(__file__).parent / "cpu_prelude.h").read_text().replace("// @formats@", format_constants())


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


def emit_step(body: GraphModule, target: Target) -> EmittedStep:
    """The kernel for ``body`` (the ``body`` child of a split, rewritten step), reproducing eager
    CPU arithmetic; ``target.torch_sqrt`` takes fp32 square roots through MKL's vsSqrt (set with
    ``lowbit_set_vsqrt``) in one more pass over the block, as torch does."""
    if target.device != "cpu":
        raise ValueError(f"the C++ printer builds CPU kernels, not {target.device} ones")
    printer = CppPrinter(body, target)
    lower_body(body, printer, target)
    return printer.emitted()


def _operand(v: Value) -> str:
    return v.text if v.atomic else f"({v.text})"


def _kind(*values: Value) -> Kind:
    return Kind.ELEMENT if any(v.kind is Kind.ELEMENT for v in values) else Kind.SCALAR


class CppPrinter:
    """The primitives of ``primitives.py`` as C++ on GCC vector extensions; collects the kernel's
    statements (per block, per lane, after the lane loop) while ``lowering.lower_body`` walks."""

    def __init__(self, body: GraphModule, target: Target) -> None:
        self.target = target
        self.graph = body.graph
        self.placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        self.states: dict[str, KernelState] = {}
        for access in map(state_access, self.graph.nodes):
            if access is None:
                continue
            state = self.states.setdefault(access.key, KernelState(identifier(access.key), access.fmt,
                                                                     dict(zip(PARTS, access.parts))))
            state.reads |= access.reads
            state.writes |= not access.reads
        self.pointers, self.scalars = self._classify_inputs()
        self.ptr_of = {self.placeholders[p.index]: p for p in self.pointers}
        self.scalar_of = {self.placeholders[i]: j for j, i in enumerate(self.scalars)}
        self.block, self.patches = self._block_and_patches()
        self.kernel = BlockKernel(self.block, self.patches, self.pointers, len(self.scalars),
                                  list(self.states.values()))
        self.bf16_of: dict[str, _Expr] = {}  # a lane vector rounded to bf16 -> the fp32 operand it rounds
        self.names: set[str] = set()

    # ---- inputs ---------------------------------------------------------------------------------
    def _classify_inputs(self) -> tuple[tuple[PointerInput, ...], tuple[int, ...]]:
        written = {n.args[0] for n in self.graph.nodes if n.target is torch.ops.aten.copy_.default}
        for access in map(master_access, self.graph.nodes):
            if access is not None and not access.reads:
                written |= {access.param, access.residual, access.ties}
        part_spec: dict[Node, tuple[torch.dtype, str, bool]] = {}
        for state in self.states.values():
            codes_dtype = torch.uint8 if state.fmt.blockwise else state.fmt.code_dtype  # bytes, or bf16 values
            codes_length = "pairs" if state.fmt.packed else "n"  # a 4-bit format's: two codes a byte
            lengths = ((codes_length, "blocks", "patches", "patches") if state.fmt.blockwise
                       else ("n", "empty", "empty", "empty"))
            for part, dtype, length in zip(PARTS, (codes_dtype, torch.float32, torch.bfloat16, torch.int16), lengths):
                part_spec[state.parts[part]] = (dtype, length, state.writes)
        pointers, scalars = [], []
        for index, node in enumerate(self.placeholders):
            desc = input_of(node)
            if node in part_spec:
                dtype, length, is_written = part_spec[node]
                pointers.append(PointerInput(index, node.name, dtype, length, is_written))
            elif desc is not None and desc.role is Role.MASTER_PART:
                dtype = node.meta["val"].dtype
                length = "n" if dtype != torch.int32 else "words"
                pointers.append(PointerInput(index, node.name, dtype, length, node in written))
            elif desc is not None and desc.role in (Role.PARAM, Role.GRAD, Role.PER_ELEMENT_STATE):
                dtype = node.meta["val"].dtype
                if dtype not in _LOAD:
                    raise LoweringError(f"per-element input {node.name!r} has dtype {dtype}; the CPU kernel "
                                        "handles float32, bfloat16 and float16 tensors")
                pointers.append(PointerInput(index, node.name, dtype, "n", node in written))
            else:
                scalars.append(index)
        return tuple(pointers), tuple(scalars)

    def _block_and_patches(self) -> tuple[int, int]:
        missing = sorted({s.fmt.name for s in self.states.values()
                          if not s.fmt.passthrough and s.fmt.spec.cpp_name is None})
        if missing:
            raise LoweringError(f"the CPU kernel has no code for format(s) {missing} yet")
        blockwise = {(s.fmt.block_size, s.fmt.patches) for s in self.states.values() if s.fmt.blockwise}
        if len(blockwise) > 1:
            raise LoweringError(f"states with different block sizes or patch counts in one step: {sorted(blockwise)}; "
                                "give every state of a parameter the same block_size and outliers")
        return next(iter(blockwise)) if blockwise else (DEFAULT_CHUNK, 0)

    def _name(self, prefix: str, name: str) -> str:
        ident = f"{prefix}_{name}"
        while ident in self.names:
            ident += "_"
        self.names.add(ident)
        return ident

    def _lane(self, name: str, statement: str, ctype: str = "vf", value: Value | None = None) -> None:
        """A lane value: bound from ``value``, or (without one) read at the lane vector's index."""
        if value is None:
            self.kernel.body.values.append(Stmt(statement, name, ctype=ctype, indexed=True))
            return
        assert isinstance(value, _Expr)
        self.kernel.body.values.append(Stmt(statement, name, value.uses, ctype, slow=value.slow, root_of=value.root_of))

    @staticmethod
    def _write(statement: str, *values: Value) -> Stmt:
        return Stmt(statement, uses=_reads(*values))

    def _vec(self, v: Value) -> _Expr:
        """``v`` as a vector operand: a scalar is splat across the lanes (computed once per block first)."""
        if v.kind is Kind.ELEMENT:
            return _Expr(_operand(v), v.dtype, v.kind, uses=_reads(v), slow=_slow(v))
        if not v.atomic:
            v = self.bind(v, f"t{len(self.kernel.pre)}")
        text = f"lb_mask({v.text})" if v.dtype == torch.bool else f"lb_splat({v.text})"
        return _Expr(text, v.dtype, Kind.ELEMENT, uses=_reads(v), slow=_slow(v))

    # ---- inputs, outputs, state -----------------------------------------------------------------------
    def load(self, node: Node, dtype: torch.dtype) -> Value:
        name = self._name("v", node.name)
        p = f"p_{node.name} + i"
        self._lane(name, f"const vf {name} = full ? {_LOAD[dtype]}({p}) : {_LOAD[dtype]}_n({p}, r);")
        return _named(name, dtype, Kind.ELEMENT)

    def scalar_input(self, node: Node, dtype: torch.dtype | None) -> Value:
        name = self._name("c", node.name)
        j = self.scalar_of[node]
        if dtype == torch.bool:
            self.kernel.pre.append(f"const bool {name} = s[{j}] != 0.0f;")
            return _named(name, torch.bool, Kind.SCALAR, host=True)
        self.kernel.pre.append(f"const float {name} = s[{j}];")
        return _named(name, dtype or torch.float32, Kind.SCALAR, host=True)

    def constant(self, value: float, dtype: torch.dtype = torch.float32) -> Value:
        if dtype == torch.bool:
            return _Expr(_cbool(value), dtype, Kind.SCALAR, host=True, literal=value)
        return _Expr(_cfloat(value), dtype, Kind.SCALAR, host=True, literal=value)

    def store(self, node: Node, value: Value) -> None:
        dtype = self.ptr_of[node].dtype
        p, v = f"p_{node.name} + i", self._vec(value)
        # A bf16 value is stored as its top half, not rounded again; one rounded just for this store
        # (fp32 opmath's write-back) is rounded by the store itself.
        fn = _STORE[dtype]
        if dtype == value.dtype == torch.bfloat16:
            fn, v = ("lb_st_bf16", self.bf16_of[v.text]) if v.text in self.bf16_of else ("lb_st_bf16_exact", v)
        desc = input_of(node)
        param = desc is not None and desc.role is Role.PARAM
        (self.kernel.body.late if param else self.kernel.body.stores).append(
            self._write(f"if (full) {fn}({p}, {v.text}); else {fn}_n({p}, {v.text}, r);", v))

    def dequantize(self, access: StateAccess) -> Value:
        """Codes times the block's scale, with the block's patches (sorted by offset before the loop)
        put in the lanes they fall on."""
        state = self.states[access.key]
        name = self._name("v", f"{access.node.name}_decoded")
        k, codes = state.ident, state.ptr(Part.CODES)
        if not state.fmt.blockwise:  # bf16 values
            self._lane(name, f"vf {name} = full ? lb_ld_bf16({codes} + i) : lb_ld_bf16_n({codes} + i, r);")
            return _named(name, torch.float32, Kind.ELEMENT)
        t, at = state.template, f"{codes} + i / 2" if state.fmt.packed else f"{codes} + i"  # lb_codes_at
        code = [f"vf {name} = lb_decode_scaled<{t}>(full ? lb_ld_codes<{t}>({at}) : "
                f"lb_ld_codes_n<{t}>({at}, r), SC_{k}, FL_{k});"]
        if state.fmt.patches:
            code += [f"while (PN_{k} < i + LB_W) {{  // a patch falls in this vector",
                     f"  {name}[PN_{k} - i] = PV_{k}[PA_{k}];",
                     f"  PN_{k} = ++PA_{k} < PC_{k} ? PI_{k}[PA_{k}] : LB_NO_PATCH;",
                     "}"]
        self._lane(name, "\n".join(code))
        return _named(name, torch.float32, Kind.ELEMENT)

    def quantize(self, access: StateAccess, value: Value, seed: Value | None) -> None:
        state = self.states[access.key]
        x = self._vec(value)
        if seed is not None:
            state.rand = self._name("h", f"{state.ident}_rand")
            self.kernel.pre.append(f"const lb_rand {state.rand} = {{lb_hash32_s((uint32_t){_operand(seed)} ^ "
                            f"({access.stream}u << 24)), start}};")
        if not state.fmt.blockwise:  # bf16 values
            v, codes = f"lb_bf16_state_clamp<{sign_name(state.fmt)}>({x.text})", state.ptr(Part.CODES)
            if seed is not None:
                bits = f"lb_bf16_bits_stochastic({v}, lb_draws({state.rand}.key, {state.rand}.first + i))"
                self.kernel.body.stores.append(self._write(f"if (full) lb_st_u16({codes} + i, {bits}); "
                                                    f"else lb_st_u16_n({codes} + i, {bits}, r);", x))
                return
            self.kernel.body.stores.append(self._write(
                f"if (full) lb_st_bf16({codes} + i, {v}); else lb_st_bf16_n({codes} + i, {v}, r);", x))
            return
        state.value = x.text
        buf, acc = f"buf_{state.ident}", f"acc_{state.ident}"
        self.kernel.body.stores += [
            self._write(f"if (full) lb_st({buf} + i, {x.text}); else lb_st_n({buf} + i, {x.text}, r);", x),
            self._write(f"{acc} = lb_vmax({acc}, lb_key_masked({x.text}, r));", x)]

    def master_read(self, master: MasterAccess) -> Value:
        fmt = master.fmt
        name = self._name("v", master.node.name)
        p, res = f"p_{master.param.name} + i", f"p_{master.residual.name} + i"
        load, load_code = _LOAD[fmt.param_dtype], "lb_ld_i16" if fmt.exact else "lb_ld_i8"
        d = f"full ? {load_code}({res}) : {load_code}_n({res}, r)"
        if fmt.has_ties:
            d = f"lb_master_d_exact({d}, p_{master.ties.name}, start + i)"
        elif not fmt.exact:
            d = f"({d}) * {1 << fmt.shift}"
        join = "lb_master_join_bf16" if fmt.bf16 else "lb_master_join_f16"
        self._lane(name, f"const vf {name} = {join}(full ? {load}({p}) : {load}_n({p}, r), {d});")
        return _named(name, torch.float32, Kind.ELEMENT)

    def master_write(self, master: MasterAccess, value: Value, seed: Value | None) -> None:
        """The param's bits and the residual code computed once per lane vector, then stored; exact bf16
        ties set their side bits as the code is made."""
        fmt = master.fmt
        vec, p, res = self._vec(value), f"p_{master.param.name} + i", f"p_{master.residual.name} + i"
        x = vec.text
        if fmt.bf16:
            lines = [f"const vi P = lb_f32_to_bf16_bits({x});", f"const vi d = lb_master_d_bf16({x}, P);"]
            store_p = (f"lb_st_u16({p}, P)", f"lb_st_u16_n({p}, P, r)")
        else:
            lines = [f"const vf P = lb_round_f16({x});", f"const vi d = lb_master_d_f16({x}, P);"]
            store_p = (f"lb_st_f16({p}, P)", f"lb_st_f16_n({p}, P, r)")
        if fmt.has_ties:
            lines.append(f"const vi c = lb_master_code_exact(d, p_{master.ties.name}, start + i, r);")
        elif fmt.exact:
            lines.append("const vi c = d;")
        else:
            h = self._name("h", "seed")
            self.kernel.pre.append(f"const uint32_t {h} = lb_hash32_s((uint32_t){_operand(seed)});")
            lines.append(f"const vi c = lb_master_code_8bit<{fmt.shift}>(d, {h}, start + i);")
        code = "i16" if fmt.exact else "i8"
        lines.append(f"if (full) {{ {store_p[0]}; lb_st_{code}({res}, c); }} "
                     f"else {{ {store_p[1]}; lb_st_{code}_n({res}, c, r); }}")
        self.kernel.body.late.append(self._write("{\n" + "\n".join(f"  {line}" for line in lines) + "\n}", vec))

    def bind(self, value: Value, name: str) -> Value:
        if value.atomic and (value.literal is not None or _is_name(value)):
            return value
        ctype = ("bool" if value.kind is Kind.SCALAR else "vi") if value.dtype == torch.bool else (
            "float" if value.kind is Kind.SCALAR else "vf")
        if value.kind is Kind.SCALAR:
            ident = self._name("c", name)
            self.kernel.pre.append(f"const {ctype} {ident} = {value.text};")
        else:
            ident = self._name("v", name)
            self._lane(ident, f"const {ctype} {ident} = {value.text};", ctype, value)
        return _named(ident, value.dtype, value.kind, value.host)

    # ---- arithmetic -----------------------------------------------------------------------------
    def _binary(self, a: Value, b: Value, op: str, dtype: torch.dtype = torch.float32) -> Value:
        kind = _kind(a, b)
        if kind is Kind.ELEMENT:
            a, b = self._vec(a), self._vec(b)
        x, y = (_operand(v) if kind is Kind.SCALAR else v.text for v in (a, b))
        return _Expr(f"{x} {op} {y}", dtype, kind, atomic=False, uses=_reads(a, b), slow=op == "/" or _slow(a, b))

    def _call(self, vector: str, scalar: str, *args: Value, dtype: torch.dtype = torch.float32) -> Value:
        kind = _kind(*args)
        if kind is Kind.SCALAR:
            return _Expr(f"{scalar}({', '.join(a.text for a in args)})", dtype, kind, uses=_reads(*args),
                         slow=_slow(*args))
        vecs = [self._vec(a) for a in args]
        root = vector == "lb_sqrt"
        return _Expr(f"{vector}({', '.join(v.text for v in vecs)})", dtype, kind, uses=_reads(*vecs),
                     slow=root or _slow(*vecs), root_of=vecs[0].text if root else None)

    def add(self, a: Value, b: Value) -> Value:
        return self._binary(a, b, "+")

    def sub(self, a: Value, b: Value) -> Value:
        return self._binary(a, b, "-")

    def mul(self, a: Value, b: Value) -> Value:
        return self._binary(a, b, "*")

    def div(self, a: Value, b: Value) -> Value:
        return self._binary(a, b, "/")

    def fma(self, a: Value, b: Value, c: Value) -> Value:
        return self._call("lb_fma", "__builtin_fmaf", a, b, c)

    def sqrt(self, a: Value, correctly_rounded: bool = False) -> Value:
        if correctly_rounded or not (self.target.torch_sqrt and a.kind is Kind.ELEMENT and a.dtype == torch.float32):
            return self._call("lb_sqrt", "__builtin_sqrtf", a)
        # torch's float32 sqrt is MKL's vsSqrt (not correctly rounded): a first pass writes every sqrt
        # input of the block to a buffer, MKL takes the square roots in place, and the second pass
        # runs the whole update reading them back.
        arg = self.bind(a, f"sqrt_in{len(self.kernel.staged)}")
        buffer = f"sq{len(self.kernel.staged)}"
        name = self._name("v", f"sqrt{len(self.kernel.staged)}")
        self.kernel.staged.append((buffer, name, self._write(
            f"if (full) lb_st({buffer} + i, {arg.text}); else lb_st_n({buffer} + i, {arg.text}, r);", arg)))
        self._lane(name, f"const vf {name} = full ? lb_ld({buffer} + i) : lb_ld_n({buffer} + i, r);")
        return _named(name, torch.float32, Kind.ELEMENT)

    def neg(self, a: Value) -> Value:
        if a.literal is not None:
            return self.constant(-a.literal, a.dtype)
        return _Expr(f"-{_operand(a)}", a.dtype, a.kind, atomic=False, uses=_reads(a), slow=_slow(a))

    def abs(self, a: Value) -> Value:
        return self._call("lb_abs", "__builtin_fabsf", a, dtype=a.dtype)

    def maximum(self, a: Value, b: Value) -> Value:
        return self._call("lb_maximum", "lb_maximum_s", a, b, dtype=a.dtype if a.dtype == b.dtype else torch.float32)

    def minimum(self, a: Value, b: Value) -> Value:
        return self._call("lb_minimum", "lb_minimum_s", a, b, dtype=a.dtype if a.dtype == b.dtype else torch.float32)

    def round_to(self, a: Value, dtype: torch.dtype) -> Value:
        rounded = self._call(_ROUND[dtype], f"{_ROUND[dtype]}_s", a, dtype=dtype)
        if dtype == torch.bfloat16 and rounded.kind is Kind.ELEMENT:
            self.bf16_of[rounded.text] = self._vec(a)
        return rounded

    # ---- comparisons and selection ----------------------------------------------------------------------
    def lt(self, a: Value, b: Value) -> Value:
        return self._binary(a, b, "<", torch.bool)

    def le(self, a: Value, b: Value) -> Value:
        return self._binary(a, b, "<=", torch.bool)

    def gt(self, a: Value, b: Value) -> Value:
        return self._binary(a, b, ">", torch.bool)

    def ge(self, a: Value, b: Value) -> Value:
        return self._binary(a, b, ">=", torch.bool)

    def eq(self, a: Value, b: Value) -> Value:
        return self._binary(a, b, "==", torch.bool)

    def ne(self, a: Value, b: Value) -> Value:
        return self._binary(a, b, "!=", torch.bool)

    def logical_and(self, a: Value, b: Value) -> Value:
        return self._binary(a, b, "&&" if _kind(a, b) is Kind.SCALAR else "&", torch.bool)

    def logical_or(self, a: Value, b: Value) -> Value:
        return self._binary(a, b, "||" if _kind(a, b) is Kind.SCALAR else "|", torch.bool)

    def logical_not(self, a: Value) -> Value:
        return _Expr(f"{'!' if a.kind is Kind.SCALAR else '~'}{_operand(a)}", torch.bool, a.kind, atomic=False,
                     uses=_reads(a), slow=_slow(a))

    def where(self, cond: Value, a: Value, b: Value) -> Value:
        dtype = a.dtype if a.dtype == b.dtype else torch.float32
        if _kind(cond, a, b) is Kind.SCALAR:
            return _Expr(f"{_operand(cond)} ? {_operand(a)} : {_operand(b)}", dtype, Kind.SCALAR, atomic=False,
                         uses=_reads(cond, a, b), slow=_slow(cond, a, b))
        x, y = self._vec(a), self._vec(b)
        uses, slow = _reads(cond, x, y), _slow(cond, x, y)
        # a lane mask selects lane by lane; a scalar condition picks one operand, and a named one is a
        # parameter of the lane loop's versions (lb_versions, at most cpp_layout._MAX_SWITCHES: no test inside the loop)
        if cond.kind is Kind.SCALAR:
            if _is_name(cond) and cond.text not in self.kernel.switches:
                self.kernel.switches.append(cond.text)
            return _Expr(f"({_operand(cond)} ? {x.text} : {y.text})", dtype, Kind.ELEMENT, uses=uses, slow=slow)
        return _Expr(f"{_operand(cond)} ? {x.text} : {y.text}", dtype, Kind.ELEMENT, atomic=False, uses=uses,
                     slow=slow)

    def to_float(self, cond: Value) -> Value:
        return self.where(cond, self.constant(1.0), self.constant(0.0))

    # ---- the kernel ---------------------------------------------------------------------------------------
    def _share_roots(self) -> None:
        """A non-negative sqrt8 state whose stored value's square root the step takes anyway (Adam's
        denominator) keeps that root in a second block buffer, and its encode takes no square root."""
        for s in self.states.values():
            if s.writes and s.root is None and s.fmt.spec.root_domain and s.fmt.nonneg:
                s.root = next((v.defines for v in self.kernel.body.values if v.root_of == s.value), None)
                if s.root is not None:
                    self.kernel.body.stores.append(Stmt(f"if (full) lb_st(root_{s.ident} + i, {s.root}); "
                                                 f"else lb_st_n(root_{s.ident} + i, {s.root}, r);",
                                                 uses=frozenset({s.root})))

    def emitted(self) -> EmittedStep:
        self._share_roots()
        passes: list[LanePass] = []
        if self.kernel.staged:
            if self.states:
                raise LoweringError("torch's own square root is for steps without quantized states")
            staged = self.kernel.staged
            first = self.kernel.body.first_pass({root for _, root, _ in staged}, [store for _, _, store in staged])
            if first is None:
                raise LoweringError("a square root of a square root, with torch's own square roots")
            passes.append(first)
        passes.append(self.kernel.body.pipelined() or self.kernel.body.in_order())
        jobs = any(s.writes and s.fmt.blockwise for s in self.states.values())
        source = self.kernel.render(passes, _FUSED_ENCODES) + "\n" + _entry(jobs) + "\n"
        return EmittedStep(source, self.pointers, self.scalars, self.block, self.patches, bool(self.kernel.staged))

def _entry(jobs: bool) -> str:
    """The exported function: ``lb_run`` (``cpu_prelude.h``) over this kernel's blocks."""
    run = f"lb_run<LB_ROW, LB_BLOCK, LB_N_SCALARS, LB_N_BUFS, {'lb_job' if jobs else 'lb_no_job'}, lb_step_block>"
    return "\n".join([
        "",
        f'extern "C" int {ENTRY}(int64_t n_tensors, const int64_t* table, const double* scalars, int n_threads) {{',
        f"  return {run}(n_tensors, table, scalars, n_threads);",
        "}",
    ])
