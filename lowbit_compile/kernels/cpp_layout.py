"""The lane loop of the C++ block kernel as data: statements held as records with the names they define
and read, and the loop's scheduling (a first pass for torch's square roots, the param's write-back one
lane vector late) worked out on those records. The printer fills a :class:`LaneBody`; nothing here
reads the C++ text of a statement, so renaming or respacing the printed code changes no schedule."""

from __future__ import annotations

from dataclasses import dataclass, field


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
