"""Prove which per-element states of a step graph are never negative, by interval arithmetic.

A state stored non-negative gets unsigned codes (twice the resolution) and a quantizer that never
turns a positive value into 0 (see ``StateFormat``); that is only sound if the state cannot go
negative. Instead of a table of state names, this pass proves it from the traced update: it takes
every value's range (an interval over all its elements; NaN, which is never negative, is ignored)
through the graph, assuming the states in question are >= 0 on entry, and keeps the states whose
write-back is still >= 0 -- a greatest fixpoint, so ``v = beta2 * v + (1 - beta2) * g * g`` proves
itself. The rules are the ones an elementwise update needs: sums and products of signs, squares
(``g * g``, ``addcmul(v, g, g)``), ``sqrt``/``abs``/``exp``, ``maximum`` with a non-negative value,
``clamp`` with a non-negative minimum, ``where``/``lerp`` (weight in [0, 1]) between non-negative
values. Each rule only concludes ``>= 0`` where IEEE rounding cannot produce a negative result.

Float hyperparameters (and one-element tensor ones) enter with the natural range their value lies
in (``[0, 1]`` for betas, eps, decays; ``[1, inf)`` above 1; the mirror images below 0). The proof
returns the ranges it needed, which the caller checks on every step: a schedule that leaves one
(``alpha`` pushed above 1) is visible, never silently unsound.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.fx import GraphModule, Node

from ..ir.contract import Role, input_of, role_of

if TYPE_CHECKING:
    from .trace import HyperSlot

aten = torch.ops.aten
INF = math.inf


@dataclass(frozen=True)
class Interval:
    """Every element of a value lies in ``[lo, hi]`` (or is NaN)."""

    lo: float
    hi: float

    @property
    def nonneg(self) -> bool:
        return self.lo >= 0

    def __contains__(self, value: float) -> bool:
        return self.lo <= value <= self.hi


ANY = Interval(-INF, INF)
NONNEG = Interval(0.0, INF)


@dataclass(frozen=True)
class NonnegProof:
    """The states proven never negative, and the hyperparameter ranges the proof assumed.

    ``fragile_roots``: each square root of a value computed from per-element states that is not
    >= 0 even when the scalar states (step counts) are taken >= 0 and tensor hyperparameters in the
    range of their value, with those states. The stock
    fp32 step keeps such a value >= 0 by cancellation (centered RMSprop's
    ``sqrt(square_avg - grad_avg**2)``), which the rounding of quantized states does not respect:
    there a quantized state can make the step NaN.
    """

    states: frozenset[str]
    assumptions: tuple[tuple[HyperSlot, Interval], ...]
    fragile_roots: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def holds(self, values: Mapping[HyperSlot, float | torch.Tensor]) -> bool:
        """Whether these hyperparameter values (by slot) are inside every assumed range."""
        return all(float(values[slot]) in interval for slot, interval in self.assumptions)


def natural_range(value: float) -> Interval:
    """The range a hyperparameter's value is assumed to stay in while a proof that uses it holds."""
    if math.isnan(value):
        return ANY
    if 0 <= value <= 1:
        return Interval(0.0, 1.0)
    if value > 1:
        return Interval(1.0, INF)
    if value >= -1:
        return Interval(-1.0, 0.0)
    return Interval(-INF, -1.0)


def prove_nonneg(gm: GraphModule, hyper_values: Mapping[HyperSlot, float]) -> NonnegProof:
    """The per-element states of the role-labelled step graph ``gm`` that stay >= 0 whenever they
    start >= 0, given float hyperparameters (by slot) in their natural ranges; the ranges
    the proof needs are returned with it."""
    written = _written_states(gm)
    ranges = {slot: natural_range(float(v)) for slot, v in hyper_values.items()
              if isinstance(v, float) or (isinstance(v, torch.Tensor) and v.numel() == 1)}
    proven = _fixpoint(gm, written, ranges)
    # square roots are judged optimistically, with step counts >= 0 (not a proof: what decides a warning)
    hopeful = _fixpoint(gm, written, ranges, scalar_states=NONNEG)
    env = _ranges(gm, set(hopeful), ranges, scalar_states=NONNEG)
    for slot in list(ranges):  # drop every range the proof does not need
        trial = {k: v for k, v in ranges.items() if k != slot}
        if _fixpoint(gm, written, trial) == proven:
            ranges = trial
    return NonnegProof(proven, tuple(sorted(ranges.items(), key=lambda item: str(item[0].name))),
                       _fragile_roots(gm, env))


def _fragile_roots(gm: GraphModule, env: dict[Node, Interval]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    states: dict[Node, frozenset[str]] = {}
    out = []
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            desc = input_of(node)
            states[node] = frozenset({desc.key}) if desc.role is Role.PER_ELEMENT_STATE else frozenset()
            continue
        states[node] = frozenset().union(*(states.get(a, frozenset()) for a in node.all_input_nodes))
        root = node.target in (aten.sqrt.default, aten.rsqrt.default)
        if root and states[node] and not env[node.args[0]].nonneg:
            out.append((node.name, tuple(sorted(states[node]))))
    return tuple(out)


def _written_states(gm: GraphModule) -> dict[str, Node]:
    """State key -> the value the step writes back into that per-element state."""
    out = {}
    for node in gm.graph.nodes:
        if node.target is aten.copy_.default:
            dst = node.args[0]
            if dst.op == "placeholder" and role_of(dst) is Role.PER_ELEMENT_STATE:
                out[input_of(dst).key] = node.args[1]
    return out


def _fixpoint(gm: GraphModule, written: dict[str, Node], ranges: Mapping[HyperSlot, Interval],
              scalar_states: Interval = ANY) -> frozenset[str]:
    assumed = set(written)
    while True:
        env = _ranges(gm, assumed, ranges, scalar_states)
        keep = {k for k in assumed if env[written[k]].nonneg}
        if keep == assumed:
            return frozenset(keep)
        assumed = keep


def _ranges(gm: GraphModule, assumed: set[str], ranges: Mapping[HyperSlot, Interval],
            scalar_states: Interval = ANY) -> dict[Node, Interval]:
    env: dict[Node, Interval] = {}

    def of(arg: object) -> Interval:
        if isinstance(arg, Node):
            return env.get(arg, ANY)
        if isinstance(arg, (bool, int, float)):
            return Interval(float(arg), float(arg))
        return ANY

    for node in gm.graph.nodes:
        if node.op == "placeholder":
            desc = input_of(node)
            if desc.role is Role.PER_ELEMENT_STATE and desc.key in assumed:
                env[node] = NONNEG
            elif desc.role is Role.HYPERPARAMETER:
                env[node] = ranges.get(desc.key, ANY)
            elif desc.role is Role.SCALAR_STATE:
                env[node] = scalar_states
            else:
                env[node] = ANY
        elif node.op == "call_function":
            rule = SIGN_RULES.get(node.target)
            env[node] = rule(node, of) if rule is not None else ANY
    return env


# interval arithmetic -------------------------------------------------------------------------
def _mul_bound(a: float, b: float) -> float:
    return 0.0 if a == 0 or b == 0 else a * b  # 0 * inf is 0 here: a zero factor gives a zero


def _mul(a: Interval, b: Interval) -> Interval:
    products = [_mul_bound(x, y) for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
    return Interval(min(products), max(products))


def _add(a: Interval, b: Interval) -> Interval:
    lo, hi = a.lo + b.lo, a.hi + b.hi
    return Interval(-INF if math.isnan(lo) else lo, INF if math.isnan(hi) else hi)


def _neg(a: Interval) -> Interval:
    return Interval(-a.hi, -a.lo)


def _div(a: Interval, b: Interval) -> Interval:
    if b.lo > 0 or b.hi < 0:  # a divisor that is never 0: multiply by the range of its reciprocal
        return _mul(a, Interval(1 / b.hi, 1 / b.lo))
    sign_a = 1 if a.lo >= 0 else (-1 if a.hi <= 0 else 0)
    sign_b = 1 if b.lo >= 0 else (-1 if b.hi <= 0 else 0)
    if sign_a == 0 or sign_b == 0:
        return ANY
    return NONNEG if sign_a == sign_b else _neg(NONNEG)


def _abs(a: Interval) -> Interval:
    if a.lo >= 0:
        return a
    if a.hi <= 0:
        return _neg(a)
    return Interval(0.0, max(-a.lo, a.hi))


def _square(a: Interval) -> Interval:
    if a.lo >= 0:
        return Interval(a.lo * a.lo, a.hi * a.hi)
    if a.hi <= 0:
        return Interval(a.hi * a.hi, a.lo * a.lo)
    return Interval(0.0, max(a.lo * a.lo, a.hi * a.hi))


def _hull(a: Interval, b: Interval) -> Interval:
    return Interval(min(a.lo, b.lo), max(a.hi, b.hi))


def _product(x: Node | object, y: Node | object, of: Callable) -> Interval:
    """``x * y``, taken apart into its factors through nested products, so a factor that appears an
    even number of times counts as a square (``(1 - beta) * g * g``). Rounding never changes the
    sign of a product, so this is sound for signs."""
    factors: list[object] = []

    def walk(a: object) -> None:
        if isinstance(a, Node) and a.target in _PRODUCTS:
            walk(a.args[0])
            walk(a.args[1])
        else:
            factors.append(a)

    walk(x)
    walk(y)
    counts: dict[int, list] = {}
    for a in factors:
        counts.setdefault(id(a) if isinstance(a, Node) else id(object()), [a, 0])[1] += 1
    result = Interval(1.0, 1.0)
    for a, k in counts.values():
        r = of(a)
        for _ in range(k // 2):
            result = _mul(result, _square(r))
        if k % 2:
            result = _mul(result, r)
    return result


def _alpha(node: Node, of: Callable, index: int = 2) -> Interval:
    alpha = node.args[index] if len(node.args) > index else node.kwargs.get("alpha", 1)
    return of(alpha)


def _value(node: Node, of: Callable) -> Interval:
    return of(node.args[3] if len(node.args) > 3 else node.kwargs.get("value", 1))


def _addcmul(node: Node, of: Callable) -> Interval:
    s, t1, t2 = node.args[:3]
    return _add(of(s), _mul(_value(node, of), _product(t1, t2, of)))


def _addcdiv(node: Node, of: Callable) -> Interval:
    s, t1, t2 = node.args[:3]
    return _add(of(s), _mul(_value(node, of), _div(of(t1), of(t2))))


def _lerp(node: Node, of: Callable) -> Interval:
    start, end, weight = (of(a) for a in node.args[:3])
    if weight.lo >= 0 and weight.hi <= 1:  # ATen's two-sided formula stays between the ends
        return _hull(start, end)
    return ANY


def _clamp(node: Node, of: Callable) -> Interval:
    x = of(node.args[0])
    low = node.args[1] if len(node.args) > 1 else node.kwargs.get("min")
    high = node.args[2] if len(node.args) > 2 else node.kwargs.get("max")
    lo, hi = x.lo, x.hi
    if low is not None:
        lo, hi = max(lo, of(low).lo), max(hi, of(low).lo)
    if high is not None:
        lo, hi = min(lo, of(high).hi), min(hi, of(high).hi)
    return Interval(lo, hi)


def _pow(node: Node, of: Callable) -> Interval:
    base, exponent = node.args[:2]
    if isinstance(exponent, (int, float)) and exponent == int(exponent) and int(exponent) % 2 == 0:
        return NONNEG
    b, e = of(base), of(exponent)
    if not b.nonneg:
        return ANY
    if e.nonneg and b.hi <= 1:  # beta ** step
        return Interval(0.0, 1.0)
    if e.nonneg and b.lo >= 1:
        return Interval(1.0, INF)
    return NONNEG


def _same(node: Node, of: Callable) -> Interval:
    return of(node.args[0])


def _unary(fn: Callable[[Interval], Interval]) -> Callable:
    return lambda node, of: fn(of(node.args[0]))


def _binary(fn: Callable[[Interval, Interval], Interval]) -> Callable:
    return lambda node, of: fn(of(node.args[0]), of(node.args[1]))


def _const(interval: Interval) -> Callable:
    return lambda node, of: interval


def _maximum(a: Interval, b: Interval) -> Interval:
    return Interval(max(a.lo, b.lo), max(a.hi, b.hi))


def _minimum(a: Interval, b: Interval) -> Interval:
    return Interval(min(a.lo, b.lo), min(a.hi, b.hi))


_PRODUCTS = (aten.mul.Tensor, aten.mul.Scalar, operator.mul)

# Each op's range from its arguments'; an op without a rule gives any value (ANY). Every op the lowering
# table covers has a rule here or is in SIGN_NEUTRAL (tests/test_lowering.py).
SIGN_RULES: dict[object, Callable[[Node, Callable], Interval]] = {
    aten.add.Tensor: lambda n, of: _add(of(n.args[0]), _mul(_alpha(n, of), of(n.args[1]))),
    aten.add.Scalar: lambda n, of: _add(of(n.args[0]), _mul(_alpha(n, of), of(n.args[1]))),
    aten.sub.Tensor: lambda n, of: _add(of(n.args[0]), _neg(_mul(_alpha(n, of), of(n.args[1])))),
    aten.sub.Scalar: lambda n, of: _add(of(n.args[0]), _neg(_mul(_alpha(n, of), of(n.args[1])))),
    aten.rsub.Scalar: lambda n, of: _add(of(n.args[1]), _neg(_mul(_alpha(n, of), of(n.args[0])))),
    aten.rsub.Tensor: lambda n, of: _add(of(n.args[1]), _neg(_mul(_alpha(n, of), of(n.args[0])))),
    aten.mul.Tensor: lambda n, of: _product(n.args[0], n.args[1], of),
    aten.mul.Scalar: lambda n, of: _product(n.args[0], n.args[1], of),
    aten.div.Tensor: _binary(_div),
    aten.div.Scalar: _binary(_div),
    aten.neg.default: _unary(_neg),
    aten.addcmul.default: _addcmul,
    aten.addcdiv.default: _addcdiv,
    aten.lerp.Scalar: _lerp,
    aten.lerp.Tensor: _lerp,
    aten.sqrt.default: _const(NONNEG),
    aten.rsqrt.default: _const(NONNEG),  # 1 / sqrt(x), NaN below 0
    aten.reciprocal.default: lambda n, of: _div(Interval(1.0, 1.0), of(n.args[0])),
    aten.abs.default: _unary(_abs),
    aten.exp.default: _const(NONNEG),
    aten.pow.Tensor_Scalar: _pow,
    aten.pow.Scalar: lambda n, of: NONNEG if of(n.args[0]).nonneg else ANY,
    aten.maximum.default: _binary(_maximum),
    aten.minimum.default: _binary(_minimum),
    aten.clamp.default: _clamp,
    aten.clamp.Tensor: _clamp,
    aten.clamp_min.default: lambda n, of: _maximum(of(n.args[0]), of(n.args[1])),
    aten.clamp_max.default: lambda n, of: _minimum(of(n.args[0]), of(n.args[1])),
    aten.where.self: lambda n, of: _hull(of(n.args[1]), of(n.args[2])),
    aten.sign.default: _unary(lambda a: Interval(-1.0 if a.lo < 0 else 0.0, 1.0 if a.hi > 0 else 0.0)),
    aten.clone.default: _same,
    aten.alias.default: _same,
    aten._to_copy.default: _same,
    aten.copy.default: lambda n, of: of(n.args[1]),
    aten.copy_.default: lambda n, of: of(n.args[1]),
    aten.scalar_tensor.default: _same,
    aten._local_scalar_dense.default: _same,
    aten.full.default: lambda n, of: of(n.args[1]),
    aten.full_like.default: lambda n, of: of(n.args[1]),
    aten.zeros_like.default: _const(Interval(0.0, 0.0)),
    aten.ones_like.default: _const(Interval(1.0, 1.0)),
    operator.add: _binary(_add),
    operator.sub: _binary(lambda a, b: _add(a, _neg(b))),
    operator.mul: lambda n, of: _product(n.args[0], n.args[1], of),
    operator.truediv: _binary(_div),
    operator.neg: _unary(_neg),
    operator.pow: _pow,
    math.sqrt: _const(NONNEG),
    torch.sym_sqrt: _const(NONNEG),
    max: _binary(_maximum),  # of two numbers (passes/trace.py records a read-back's max so)
    min: _binary(_minimum),
}

for _op in (aten.gt.Scalar, aten.lt.Scalar, aten.ge.Scalar, aten.le.Scalar, aten.eq.Scalar, aten.ne.Scalar,
            aten.gt.Tensor, aten.lt.Tensor, aten.ge.Tensor, aten.le.Tensor, aten.eq.Tensor, aten.ne.Tensor,
            aten.logical_and.default, aten.logical_or.default, aten.logical_not.default):
    SIGN_RULES[_op] = _const(Interval(0.0, 1.0))

# Lowered ops the proof never meets: the quantize rewrite adds the state and master ops after it (it runs on
# the traced step, passes/roles.py's labels).
SIGN_NEUTRAL = frozenset({torch.ops.lowbit.dequantize.default, torch.ops.lowbit.quantize_.default,
                          torch.ops.lowbit.quantize_stochastic_.default, torch.ops.lowbit.master_read.default,
                          torch.ops.lowbit.master_write_.default})

