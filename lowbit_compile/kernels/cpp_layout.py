"""The C++ block kernel as data (the layout half of the C++ backend; ``cpp_printer`` prints primitives into it).

A :class:`BlockKernel` holds one signature's block function: its inputs, per-block statements, quantized
states and a :class:`LaneBody`, the lane loop's statements as records with the names they define and
read. The loop's scheduling (a first pass for torch's square roots, the param's write-back one lane
vector late, the loop's versions) works on those records; nothing here reads the C++ text of a
statement, so renaming or respacing the printed code changes no schedule.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.fx import Node

from ..formats import StateFormat
from ..ir.contract import PARTS, Part


@dataclass(frozen=True)
class Stmt:
    """One statement of the lane loop: its C++ (printed once, never re-read), the lane value it
    defines (None for a write-back) and every name it reads (lane values, per-block scalars)."""

    text: str
    defines: str | None = None
    uses: frozenset[str] = frozenset()
    ctype: str = ""  # the defined lane value's vector type, "vf" or "vi"
    indexed: bool = False  # reads memory at the lane vector's index (i, r, full): stays in its iteration
    slow: bool = False  # holds a divide or a vector square root (long latency)
    root_of: str | None = None  # the lane operand it is exactly the square root of


@dataclass(frozen=True)
class Pipelined:
    """A lane body whose late part runs one lane vector behind its early part (:meth:`LaneBody.pipelined`)."""

    early: list[Stmt]
    late: list[Stmt]
    carried: list[tuple[str, str]]  # (vector type, lane value): computed early, used late


@dataclass
class LaneBody:
    """The statements of one lane-loop iteration, in the order the lowering produced them."""

    values: list[Stmt] = field(default_factory=list)  # each defines a lane value
    stores: list[Stmt] = field(default_factory=list)  # write-backs at the end of each iteration
    late: list[Stmt] = field(default_factory=list)  # the param's write-backs (may run one lane vector late)

    def defs(self) -> dict[str, Stmt]:
        return {s.defines: s for s in self.values if s.defines}

    def closure(self, names: set[str] | frozenset[str]) -> set[str]:
        """The lane values ``names`` are computed from (themselves included)."""
        defs = self.defs()
        seen: set[str] = set()
        todo = list(names)
        while todo:
            name = todo.pop()
            if name in seen or name not in defs:
                continue
            seen.add(name)
            todo += [m for m in defs[name].uses if m != name]
        return seen

    def first_pass(self, roots: set[str], stores: list[Stmt]) -> list[Stmt] | None:
        """The lane values that ``stores`` (square-root inputs to their buffers) need, then those stores;
        None where one of the ``roots`` read back from the buffers is itself needed (a root of a root)."""
        needed = self.closure(names_used(stores))
        if needed & roots:
            return None
        return [s for s in self.values if s.defines in needed] + stores

    def in_order(self) -> list[Stmt]:
        return self.values + self.stores + self.late

    def pipelined(self) -> Pipelined | None:
        """The body split so that the param's write-backs, and the values only they need, run one lane
        vector behind the rest: a divide or square root there (Adam's denominator) then overlaps the
        next vector's loads and decodes instead of stalling the in-order dispatch behind it. None where
        nothing long-latency would move."""
        defs = self.defs()
        early_roots = frozenset().union(*(s.uses for s in self.stores))
        late_roots = frozenset().union(*(s.uses for s in self.late))
        late = self.closure(late_roots) - self.closure(early_roots)
        late -= {name for name in late if defs[name].indexed}  # loads stay where their index is
        while True:  # whatever an early statement uses is early too
            used = {m for s in self.values if s.defines not in late for m in s.uses if m != s.defines}
            if not used & late:
                break
            late -= used
        if not any(defs[name].slow for name in late):
            return None
        uses = {m for name in late for m in defs[name].uses} | late_roots
        carried = [(s.ctype, s.defines) for s in self.values if s.defines in uses and s.defines not in late]
        return Pipelined([s for s in self.values if s.defines not in late] + self.stores,
                         [s for s in self.values if s.defines in late] + self.late, carried)


LanePass = list[Stmt] | Pipelined  # one loop over the block's lane vectors


def names_used(statements: list[Stmt]) -> frozenset[str]:
    return frozenset().union(*(s.uses for s in statements))


def statements_of(lanes: LanePass) -> list[Stmt]:
    return lanes.early + lanes.late if isinstance(lanes, Pipelined) else lanes


def indent(statements: list[Stmt | str], ind: str) -> list[str]:
    """Each line of each statement, indented by ``ind``."""
    texts = (s.text if isinstance(s, Stmt) else s for s in statements)
    return [f"{ind}{line}" for text in texts for line in text.split("\n")]


def lane_loop(lanes: LanePass, k: int, versions: list[str], head: list[str]) -> list[str]:
    """Pass ``k`` over the block's lane vectors as C++ lines (unindented): the whole vectors, each
    starting with ``head``, then the tail. The body appears twice, inline (where it has ``versions``,
    per-block bools, in a lambda that ``lb_versions`` forces inline into each combination): values that
    live across iterations (scalars, top-K accumulators) stay in registers."""
    body = statements_of(lanes)
    params = ", ".join(f"auto {name}" for name in versions)
    out = [f"const auto lanes{k} = [&]({params}) LB_INLINE_LAMBDA {{" if versions else "{", "  int64_t i = 0;"]
    if isinstance(lanes, Pipelined):
        out.append("  int64_t prev_i = -1;  // the lane vector whose late part is pending")
        out += [f"  {t} prev_{name} = {{}};" for t, name in lanes.carried]
    out += ["  for (; i + LB_W <= len; i += LB_W) {", "    const bool full = true;", "    const int64_t r = LB_W;"]
    out += _pipelined_vectors(lanes, head) if isinstance(lanes, Pipelined) else [*indent(head + body, "    "), "  }"]
    out += ["  if (i < len) {", "    const bool full = false;", "    const int64_t r = len - i;",
            *indent(body, "    "), "  }"]
    if not versions:
        return [*out, "}"]
    return [*out, "};", f"lb_versions(lanes{k}, {', '.join(versions)});"]


def _pipelined_vectors(lanes: Pipelined, head: list[str]) -> list[str]:
    """The whole-vector loop's body and close when the late part runs one vector behind: each iteration
    runs its early part then the previous vector's late part; the last vector's late part follows."""
    late = ["const int64_t i = prev_i;", *(f"const {t} {name} = prev_{name};" for t, name in lanes.carried),
            *lanes.late]
    return [*indent(head + lanes.early, "    "),
            "    if (prev_i >= 0) {", *indent(late, "      "), "    }",
            *(f"    prev_{name} = {name};" for _, name in lanes.carried),
            "    prev_i = i;",
            "  }",
            "  if (prev_i >= 0) {", "    const bool full = true;", "    const int64_t r = LB_W;",
            *indent(late, "    "), "  }"]


# ---- the block function -------------------------------------------------------------------------------
_CTYPES = {torch.float32: "float", torch.bfloat16: "uint16_t", torch.float16: "uint16_t", torch.uint8: "uint8_t",
           torch.int16: "int16_t", torch.int8: "int8_t", torch.int32: "int32_t"}
# Per-block bools (a fused encode pending, lerp's weight test) the lane loop is compiled for each
# combination of (lb_versions): without their tests inside, GCC schedules the loop as one block. At most
# this many, 2^n copies of the loop.
_MAX_SWITCHES = 3


@dataclass(frozen=True)
class PointerInput:
    """One per-element input of the body as the kernel sees it: a contiguous buffer."""

    index: int  # position among the body's inputs
    name: str
    dtype: torch.dtype
    length: str  # "n" (one per element), "pairs" (one per two elements: 4-bit codes), "blocks" (one per block),
    # "patches" (K per block), "words" (one per 32 elements: a master's tie bits) or "empty"
    written: bool


@dataclass
class KernelState:
    """A quantized state of the body: its name in the C++ (``contract.identifier`` of its key, never
    the key), its storage inputs and format."""

    ident: str
    fmt: StateFormat
    parts: dict[Part, Node]
    reads: bool = False
    writes: bool = False
    rand: str | None = None  # the name of its random-bits key when it rounds stochastically
    value: str | None = None  # the lane value it stores
    root: str | None = None  # the lane value that is that value's square root (sqrt8, when the step has it)

    def ptr(self, part: Part) -> str:
        return f"p_{self.parts[part].name}"

    @property
    def template(self) -> str:
        """Its format's template arguments in the prelude (``lb_format<F, U>``'s)."""
        return f"{self.fmt.spec.cpp_name}, {sign_name(self.fmt)}"


def sign_name(fmt: StateFormat) -> str:
    """A state's sign as the prelude names it (the ``U`` of ``lb_format<F, U>``)."""
    return "LB_UNSIGNED" if fmt.nonneg else "LB_SIGNED"


def _encoding(stochastic: object = False, root: object = False) -> str:
    """The prelude's ``lb_encoding`` flags of a state's encode, by name."""
    flags = [name for name, on in (("LB_STOCHASTIC", stochastic), ("LB_ROOT", root)) if on]
    return " | ".join(flags) or "LB_PLAIN"


@dataclass
class BlockKernel:
    """One signature's block function as data: its inputs, per-block statements, quantized states and
    lane body, which the printer fills while the lowering walks; :meth:`render` prints it."""

    block: int
    patches: int
    pointers: tuple[PointerInput, ...]
    n_scalars: int
    states: list[KernelState]
    pre: list[str] = field(default_factory=list)  # once per block, before the lane loop
    body: LaneBody = field(default_factory=LaneBody)  # each lane iteration's statements
    staged: list[tuple[str, str, Stmt]] = field(default_factory=list)  # (buffer, its sqrt read back, the store
    # of its input): torch's square roots, taken between two passes
    switches: list[str] = field(default_factory=list)  # per-block bools that pick a lane operand: the lane
    # loop's versions

    def render(self, passes: list[LanePass], fused_encodes: frozenset[str]) -> str:
        """The block function, its constants and, with quantized states, ``lb_job`` and ``lb_finish``;
        the lane loop as ``passes`` schedule it, writing the previous block's codes in the first where
        every written state's format is in ``fused_encodes``."""
        blockwise = [s for s in self.states if s.fmt.blockwise]
        rooted = [s for s in blockwise if s.root]
        written = [s for s in blockwise if s.writes]
        out = [
            f"static const int64_t LB_BLOCK = {self.block};",
            f"static const int64_t LB_ROW = {len(self.pointers) + 1};  // element count, then one pointer per input",
            f"static const int LB_N_SCALARS = {self.n_scalars};",
            f"static const int LB_N_BUFS = {len(blockwise) + len(rooted) + len(self.staged)};",
            "",
        ]
        slot = {s.ident: b for b, s in enumerate(blockwise)}  # a state's buffer, then its root's, in scratch
        slot.update({f"root_{s.ident}": len(blockwise) + b for b, s in enumerate(rooted)})
        if written:
            out += self._job(written, slot)
        fused = bool(written) and all(w.fmt.name in fused_encodes for w in written)
        block = self._block_setup(blockwise, rooted, slot) + (self._fuse_setup(written) if fused else [])
        for k, lanes in enumerate(passes):
            block += self._lane_loop(k, lanes, written if k == 0 and fused else [])
            if k == 0 and len(passes) > 1:
                block += [f"lb_vsqrt(len, {buf});" for buf, _, _ in self.staged]
        block += self._scales(written, fused)
        out += [
            "static void lb_step_block(const int64_t* ptr, const float* s, int64_t start, int64_t len, int64_t blk,",
            f"                          float* scratch{', lb_job& job' if written else ''}) {{",
            *(f"  {line}" for line in block),
            "}",
        ]
        return "\n".join(out)

    def _block_setup(self, blockwise: list[KernelState], rooted: list[KernelState], slot: dict[str, int]) -> list[str]:
        """The block's pointers into each input, its per-block values, and each quantized state's scale,
        patches (sorted by offset), block buffer and lane maxima."""
        out = []
        for j, p in enumerate(self.pointers):
            const = "" if p.written else "const "
            offset = {"n": "start", "pairs": "start / 2", "blocks": "blk", "empty": "0", "words": "0",
                      "patches": f"blk * {self.patches}"}[p.length]
            out.append(f"{const}{_CTYPES[p.dtype]}* __restrict p_{p.name} = ({const}{_CTYPES[p.dtype]}*)ptr[{j}]"
                       f" + {offset};")
        out += self.pre
        for s in blockwise:
            out.append(f"float* __restrict buf_{s.ident} = scratch + {slot[s.ident]} * LB_BLOCK;")
            if s.reads:
                out += self._decode_setup(s)
            if s.writes:
                out.append(f"vi acc_{s.ident} = lb_splat_i(-1);")
        out += [f"float* __restrict root_{s.ident} = scratch + {slot['root_' + s.ident]} * LB_BLOCK;" for s in rooted]
        first = len(blockwise) + len(rooted)
        out += [f"float* __restrict {buf} = scratch + {first + b} * LB_BLOCK;"
                for b, (buf, _, _) in enumerate(self.staged)]
        return out

    @staticmethod
    def _decode_setup(s: KernelState) -> list[str]:
        k, scales = s.ident, s.ptr(Part.SCALES)
        out = [f"const vf SC_{k} = lb_splat(__builtin_fabsf(*{scales}));",
               f"const bool FL_{k} = __builtin_signbit(*{scales});  // a flagged block"]
        if s.fmt.patches:
            out += [f"int64_t PI_{k}[{s.fmt.patches}];",
                    f"float PV_{k}[{s.fmt.patches}];",
                    f"const int PC_{k} = lb_sorted_patches<{s.fmt.patches}>({s.ptr(Part.PATCH_INDEX)}, "
                    f"{s.ptr(Part.PATCH_VALUES)}, len, PI_{k}, PV_{k});",
                    f"int PA_{k} = 0;",
                    f"int64_t PN_{k} = PC_{k} ? PI_{k}[0] : LB_NO_PATCH;"]
        return out

    def _fuse_setup(self, written: list[KernelState]) -> list[str]:
        """Whether this block's lane loop writes the previous block's codes (``fuse``: from the block
        buffers it overwrites), and what it needs for that."""
        fusable = " && ".join(f"lb_fusable<{w.template}, {_encoding(root=w.root)}>(job.enc[{j}], job.mult[{j}])"
                              for j, w in enumerate(written))
        out = [f"const auto fuse = lb_fuse_if(job.len == len && len % (4 * LB_W) == 0 && {fusable});",
               "if (!fuse) lb_finish(job, scratch);"]
        for j, w in enumerate(written):
            out.append(f"uint8_t* __restrict q_codes_{w.ident} = job.codes[{j}];")
            out.append(f"const vf q_mult_{w.ident} = lb_splat(job.mult[{j}]);")
            if w.rand:
                out.append(f"const lb_rand q_rand_{w.ident} = job.rnd[{j}];")
        return out

    def _lane_loop(self, k: int, lanes: LanePass, fused: list[KernelState]) -> list[str]:
        """Pass ``k``; the first prefetches the next block's inputs while this one's arrive (a second pass
        rereads them from cache) and, with ``fused`` states, writes their previous block's codes."""
        used = names_used(statements_of(lanes))
        versions = (["fuse"] if fused else []) + [name for name in self.switches if name in used]
        ahead = {"n": "i, LB_BLOCK", "pairs": "i / 2, LB_BLOCK / 2"} if k == 0 else {}  # (element, next block's)
        head = [f"lb_prefetch(p_{p.name} + {ahead[p.length]});" for p in self.pointers if p.length in ahead]
        if fused:
            head += self._encode_prev(fused)
        return lane_loop(lanes, k, versions[:_MAX_SWITCHES], head)

    def _scales(self, written: list[KernelState], fused: bool) -> list[str]:
        """Each written state's scale and patches; its codes are left to the next block's loop (``lb_job``)."""
        out = ["job.len = len;"] if written else []
        for j, w in enumerate(written):
            parts = ", ".join(w.ptr(part) for part in PARTS)
            extra = [w.rand or "{}", f"root_{w.ident}"] if w.root else [w.rand] if w.rand else []
            out.append(f"job.codes[{j}] = {w.ptr(Part.CODES)};")
            if w.rand:
                out.append(f"job.rnd[{j}] = {w.rand};")
            out.append(f"job.enc[{j}] = lb_quantize_scale<{w.template}, {w.fmt.patches}"
                       f"{', LB_STOCHASTIC' if w.rand else ''}>(acc_{w.ident}, buf_{w.ident}, len, LB_BLOCK, "
                       f"{', '.join([parts, f'&job.mult[{j}]', *extra])});")
        if written and not fused:
            out.append("lb_finish(job, scratch);")
        return out

    def _job(self, written: list[KernelState], slot: dict[str, int]) -> list[str]:
        """``lb_job``, a quantized block whose codes are still to be written, and ``lb_finish``, which
        writes them in loops of their own (two states' in one: ``lb_encode_pair``)."""
        ind = "  "
        out = [f"typedef lb_pending<{len(written)}> lb_job;",
               "static void lb_finish(lb_job& job, const float* scratch) {",
               f"{ind}if (!job.len) return;",
               f"{ind}const int64_t len = job.len;",
               f"{ind}job.len = 0;"]
        for j, w in enumerate(written):
            k = w.ident
            out.append(f"{ind}const float* buf_{k} = scratch + {slot[k]} * LB_BLOCK;")
            if w.root:
                out.append(f"{ind}const float* root_{k} = scratch + {slot['root_' + k]} * LB_BLOCK;")
            out.append(f"{ind}uint8_t* {w.ptr(Part.CODES)} = job.codes[{j}];")
            out.append(f"{ind}const float mult_{k} = job.mult[{j}];")
            out.append(f"{ind}const bool enc_{k} = job.enc[{j}];")

        rnd = {w.ident: f"job.rnd[{j}]" if w.rand else "{}" for j, w in enumerate(written)}

        def args(s: KernelState) -> list[str]:
            return [f"buf_{s.ident}", f"root_{s.ident}" if s.root else "nullptr", f"mult_{s.ident}", s.ptr(Part.CODES),
                    rnd[s.ident]]

        def single(s: KernelState) -> str:
            buf, root, mult, codes, draws = args(s)
            return (f"if (enc_{s.ident}) lb_encode_block<{s.template}, {_encoding(s.rand)}>({buf}, {root}, "
                    f"len, {mult}, {codes}, {draws});")

        for a, b in zip(written[::2], written[1::2]):
            out.append(f"{ind}if (enc_{a.ident} && enc_{b.ident}) {{")
            out.append(f"{ind}  lb_encode_pair<{self._lane_encode(a)}, {self._lane_encode(b)}>"
                       f"({', '.join(args(a) + args(b))}, len);")
            out.append(f"{ind}}} else {{")
            out += [f"{ind}  {single(a)}", f"{ind}  {single(b)}", f"{ind}}}"]
        if len(written) % 2:
            out.append(f"{ind}{single(written[-1])}")
        return out + ["}", ""]

    def _encode_prev(self, written: list[KernelState]) -> list[str]:
        """The previous block's codes of the four lane vectors from i, every fourth iteration, read from the
        block buffers before this and the next three iterations overwrite them (``fuse``): their square
        roots and conversions then share the loop with this block's arithmetic instead of running in a
        loop of their own, and four vectors of codes pack into one store."""
        lines = []
        for w in written:
            k = w.ident
            root = f"root_{k}" if w.root else "nullptr"
            draws = f"q_rand_{k}" if w.rand else "{}"
            lines.append(f"  lb_encode_x4<{self._lane_encode(w)}>(buf_{k}, {root}, i, q_mult_{k}, {draws}, "
                         f"q_codes_{k});")
        return ["if (fuse && (i & (4 * LB_W - 1)) == 0) {", *lines, "}"]

    def _lane_encode(self, s: KernelState) -> str:
        """A state's template arguments for an unflagged block's encode, lane vector by lane vector."""
        return f"{s.template}, {_encoding(s.rand, s.root)}"
