"""The one table of lowerings: each aten op a traced step body may hold, written once in the
primitives of ``primitives.py``, for every printer.

An op's lowering reproduces the eager ATen kernel of the device the kernel is built for; where CPU
and CUDA ATen compute differently, the lowering reads the difference off :class:`Target`, never a
printer. The rules (each checked against eager torch where a device was at hand):

* every value is rounded to its node's dtype after every op, as eager ATen stores each intermediate;
* scalar operands (numbers, 0-d tensors): CPU casts them to the op's dtype for add, sub, the
  comparisons and ``where``, reads a scalar *second* operand of mul and div in fp32 (a first one is
  cast), and takes ``alpha`` cast to the dtype; CUDA reads host scalars (numbers, 0-d CPU tensors)
  in fp32 everywhere and divides by one as a multiply by its fp32 reciprocal (BinaryDivTrueKernel.cu);
* fmas where ATen's kernels have them: add/sub with alpha (ufunc add: ``fma(other, alpha, self)``;
  on CPU, a bf16/fp16 one whose operands' layouts differ, which TensorIterator steps element by
  element, rounds ``alpha * other`` to the dtype first: c10::BFloat16 arithmetic, Muon's transposed update),
  lerp (Lerp.h / lerp_vec: one fma from the nearer end point), addcmul (CPU contracts
  ``fma(value * t1, t2, self)``; CUDA DeviceAddCmulCdiv.cuh checks ``value == 1`` at run time:
  ``fma(t1, t2, self)`` else ``fma(value, t1 * t2, self)``), addcdiv (CPU ``self + value * t1 / t2``;
  CUDA ``self + t1 / t2`` or ``fma(value, t1 / t2, self)``).

Coverage is declared: each entry has a checker that says which nodes and targets it covers, so
:func:`unsupported` tells before any emission what a body needs that a target lacks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.fx import GraphModule, Node

from ..ir.contract import Role, input_of, master_access, state_access
from .primitives import Kind, Primitives, Value

aten = torch.ops.aten
lowbit = torch.ops.lowbit

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


class LoweringError(NotImplementedError):
    """The step body holds an op, an argument or a dtype the target's kernels cannot lower."""


@dataclass(frozen=True)
class Target:
    """Whose arithmetic a kernel reproduces, and the liberties its backend may take.

    ``device``: "cuda" or "cpu", the eager ATen formulas to reproduce. ``torch_sqrt``: fp32 square
    roots as torch's own CPU kernel takes them (MKL's, not correctly rounded), for bit-for-bit stock
    steps; otherwise correctly rounded. ``reciprocal_divisor``: a division by a scalar becomes a
    multiply by its fp32 reciprocal (one rounding off torch's result, faster); CUDA does that for
    host scalars whatever this says. ``fp8_native``: fp8 codes are held as float8 and converted with
    the GPU's instructions (sm_89 and later), else as uint8 bits with integer operations (same codes).
    """

    device: str
    torch_sqrt: bool = False
    reciprocal_divisor: bool = False
    fp8_native: bool = True

    def __post_init__(self) -> None:
        if self.device not in ("cuda", "cpu"):
            raise ValueError(f"Target.device must be 'cuda' or 'cpu', got {self.device!r}")

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"


Lowering = Callable[["Lowerer", Node], "Value | None"]
Checker = Callable[[Node, Target], "str | None"]


@dataclass(frozen=True)
class Entry:
    lower: Lowering
    checker: Checker | None = None


LOWERINGS: dict[object, Entry] = {}


def lowers(*ops: object, checker: Checker | None = None) -> Callable[[Lowering], Lowering]:
    """Register the decorated function as the lowering of ``ops``; ``checker(node, target)`` returns
    why a node is not covered (None when it is)."""

    def register(fn: Lowering) -> Lowering:
        for op in ops:
            LOWERINGS[op] = Entry(fn, checker)
        return fn

    return register


def unsupported(body: GraphModule, target: Target) -> list[str]:
    """What of ``body`` the lowering cannot do for ``target`` (empty when it covers all of it)."""
    problems = []
    for node in body.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op != "call_function":
            problems.append(f"node {node.name!r} is a {node.op}, not an op call")
            continue
        entry = LOWERINGS.get(node.target)
        if entry is None:
            problems.append(f"no lowering for {node.target} (node {node.name!r})")
        elif entry.checker is not None and (why := entry.checker(node, target)) is not None:
            problems.append(f"{node.target} (node {node.name!r}): {why}")
    return problems


def lower_body(body: GraphModule, printer: Primitives, target: Target) -> None:
    """Print the elementwise ``body`` of a split, rewritten step through ``printer``."""
    problems = unsupported(body, target)
    if problems:
        raise LoweringError("; ".join(problems))
    Lowerer(printer, target).run(body)


class Lowerer:
    """Walks a body graph, holding each node's :class:`Value`; the helpers lowerings share."""

    def __init__(self, printer: Primitives, target: Target) -> None:
        self.p = printer
        self.target = target
        self.env: dict[Node, Value] = {}

    def run(self, body: GraphModule) -> None:
        for node in body.graph.nodes:
            if node.op == "placeholder":
                self._input(node)
            elif node.op == "call_function":
                out = LOWERINGS[node.target].lower(self, node)
                if out is not None:
                    self.env[node] = out

    def _input(self, node: Node) -> None:
        desc = input_of(node)
        if desc is not None and desc.role in (Role.STATE_PART, Role.MASTER_PART):
            return  # read and written through the state and master nodes
        if not node.users:
            return
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and val.dim() > 0:
            if any(not _is_write_back(user, node) and master_access(user) is None for user in node.users):
                self.env[node] = self.p.load(node, _float_dtype(val.dtype, node))
        elif isinstance(val, torch.Tensor):
            self.env[node] = self.p.scalar_input(node, _checked_dtype(val.dtype, node))
        else:
            self.env[node] = self.p.scalar_input(node, None)

    # values --------------------------------------------------------------------------------------
    def value(self, arg: object) -> Value:
        if isinstance(arg, Node):
            return self.env[arg]
        if isinstance(arg, bool):
            return self.p.constant(float(arg), torch.bool)
        if isinstance(arg, (int, float)):
            return self.p.constant(float(arg))
        raise LoweringError(f"cannot use the argument {arg!r} as a value")

    def cast(self, v: Value, dtype: torch.dtype) -> Value:
        """``v`` as an operand of an op computing in ``dtype`` (what TensorIterator's cast does)."""
        if v.dtype == torch.bool and dtype != torch.bool:
            v = self.p.to_float(v)
        if v.dtype == dtype or dtype == torch.float32 or dtype == torch.bool:
            return v
        if v.literal is not None:
            return self.p.constant(float(torch.tensor(v.literal).to(dtype)), dtype)
        return self.p.round_to(v, dtype)

    def result(self, node: Node, v: Value) -> Value:
        """``v`` rounded to the node's dtype and bound to the node's name."""
        dtype = node_dtype(node)
        if dtype not in (torch.float32, torch.bool) and v.dtype != dtype:
            v = self.p.round_to(v, dtype)
        return self.p.bind(v, node.name)

    def operand(self, arg: object, dtype: torch.dtype, opmath: bool = False) -> Value:
        """An op's input: cast to ``dtype`` unless ``opmath`` (ATen reads it in fp32 as it is)."""
        v = self.value(arg)
        return v if opmath else self.cast(v, dtype)

    def host(self, arg: object) -> bool:
        return not isinstance(arg, Node) or self.env[arg].host

    def scalar(self, arg: object) -> bool:
        return not isinstance(arg, Node) or self.env[arg].kind is Kind.SCALAR

    def is_one(self, arg: object) -> bool:
        return not isinstance(arg, Node) and arg == 1


def node_dtype(node: Node) -> torch.dtype:
    val = node.meta.get("val")
    if not isinstance(val, torch.Tensor):
        raise LoweringError(f"node {node.name!r} ({node.target}) has no tensor value to lower")
    return _checked_dtype(val.dtype, node)


def _checked_dtype(dtype: torch.dtype, node: Node) -> torch.dtype:
    if dtype not in (*FLOAT_DTYPES, torch.bool):
        raise LoweringError(f"node {node.name!r} holds {dtype}; the fused kernels compute in float32, "
                            "bfloat16 and float16 (params, grads and stock-format states of those dtypes)")
    return dtype


def _float_dtype(dtype: torch.dtype, node: Node) -> torch.dtype:
    if dtype not in FLOAT_DTYPES:
        raise LoweringError(f"input {node.name!r} holds {dtype}; the fused kernels support float32, bfloat16 "
                            "and float16 params, grads and states")
    return dtype


def _is_write_back(user: Node, node: Node) -> bool:
    return user.target is aten.copy_.default and user.args[0] is node


def _common_dtype(node: Node, args: tuple) -> torch.dtype:
    """The dtype ATen computes a comparison or selection in (scalars do not promote tensors)."""
    vals = [a.meta["val"] if isinstance(a, Node) else a for a in args]
    return _checked_dtype(torch.result_type(*vals) if len(vals) == 2 else vals[0].dtype, node)


# arithmetic -----------------------------------------------------------------------------------------
def _alpha_checker(node: Node, target: Target) -> str | None:
    if len(node.args) != 2:
        return f"{len(node.args)} positional arguments"
    return None


@lowers(aten.add.Tensor, aten.sub.Tensor, checker=_alpha_checker)
def _add(L: Lowerer, node: Node) -> Value:
    a, b = node.args
    dtype = node_dtype(node)
    cuda = L.target.cuda
    x = L.operand(a, dtype, opmath=cuda and L.host(a))
    y = L.operand(b, dtype, opmath=cuda and L.host(b))
    alpha = node.kwargs.get("alpha", 1)
    subtract = node.target is aten.sub.Tensor
    if L.is_one(alpha):
        return L.result(node, L.p.sub(x, y) if subtract else L.p.add(x, y))
    scale = L.operand(alpha, dtype, opmath=cuda)
    if subtract:
        scale = L.p.neg(scale)
    if not cuda and dtype in (torch.bfloat16, torch.float16) and not _vectorized_on_cpu(node):
        return L.result(node, L.p.add(x, L.p.round_to(L.p.mul(y, scale), dtype)))
    return L.result(node, L.p.fma(y, scale, x))


def _vectorized_on_cpu(node: Node) -> bool:
    """Whether ATen's CPU TensorIterator runs ``node`` vectorized: every tensor operand steps by one
    element along the output's fastest dimension (its traced strides; a 1-D trace always does)."""
    out = node.meta["val"]
    dims = [d for d in range(out.dim()) if out.shape[d] > 1]
    if not dims:
        return True
    fastest = min(dims, key=lambda d: out.stride(d))
    vals = [a.meta.get("val") for a in node.args if isinstance(a, Node)]
    return all(v.stride(fastest) == 1 for v in vals if isinstance(v, torch.Tensor) and v.dim() == out.dim())


@lowers(aten.mul.Tensor)
def _mul(L: Lowerer, node: Node) -> Value:
    a, b = node.args
    dtype = node_dtype(node)
    if L.target.cuda:
        x, y = L.operand(a, dtype, opmath=L.host(a)), L.operand(b, dtype, opmath=L.host(b))
    else:
        x, y = L.operand(a, dtype), L.operand(b, dtype, opmath=L.scalar(b))
    return L.result(node, L.p.mul(x, y))


@lowers(aten.div.Tensor)
def _div(L: Lowerer, node: Node) -> Value:
    a, b = node.args
    dtype = node_dtype(node)
    if L.target.cuda:
        x = L.operand(a, dtype, opmath=L.host(a))
        if L.host(b):  # BinaryDivTrueKernel.cu: a CPU-scalar divisor becomes a multiply by its reciprocal
            return L.result(node, L.p.mul(x, L.p.div(L.p.constant(1.0), L.operand(b, dtype, opmath=True))))
        y = L.operand(b, dtype)
    else:
        x, y = L.operand(a, dtype), L.operand(b, dtype, opmath=L.scalar(b))
    if L.target.reciprocal_divisor and L.scalar(b):
        return L.result(node, L.p.mul(x, L.p.div(L.p.constant(1.0), y)))
    return L.result(node, L.p.div(x, y))


@lowers(aten.neg.default)
def _neg(L: Lowerer, node: Node) -> Value:
    return L.result(node, L.p.neg(L.operand(node.args[0], node_dtype(node))))


@lowers(aten.abs.default)
def _abs(L: Lowerer, node: Node) -> Value:
    return L.result(node, L.p.abs(L.operand(node.args[0], node_dtype(node))))


@lowers(aten.sign.default)
def _sign(L: Lowerer, node: Node) -> Value:
    """``(0 < x) - (x < 0)``: 0 for zeros of either sign and for NaN, as both devices' kernels compute."""
    x = L.operand(node.args[0], node_dtype(node))
    zero = L.p.constant(0.0)
    return L.result(node, L.p.sub(L.p.to_float(L.p.gt(x, zero)), L.p.to_float(L.p.lt(x, zero))))


@lowers(aten.sqrt.default)
def _sqrt(L: Lowerer, node: Node) -> Value:
    return L.result(node, L.p.sqrt(L.operand(node.args[0], node_dtype(node))))


def _cpu_only(node: Node, target: Target) -> str | None:
    return None if target.device == "cpu" else "CUDA computes it with an approximate instruction no kernel reproduces"


@lowers(aten.rsqrt.default, checker=_cpu_only)
def _rsqrt(L: Lowerer, node: Node) -> Value:
    """CPU: ``1 / sqrt(x)`` with the correctly rounded root, as the vectorized kernel computes it."""
    root = L.p.sqrt(L.operand(node.args[0], node_dtype(node)), correctly_rounded=True)
    return L.result(node, L.p.div(L.p.constant(1.0), root))


@lowers(aten.reciprocal.default)
def _reciprocal(L: Lowerer, node: Node) -> Value:
    return L.result(node, L.p.div(L.p.constant(1.0), L.operand(node.args[0], node_dtype(node))))


@lowers(aten.maximum.default, aten.minimum.default)
def _extremum(L: Lowerer, node: Node) -> Value:
    dtype = node_dtype(node)
    a, b = (L.operand(x, dtype) for x in node.args)
    return L.result(node, L.p.maximum(a, b) if node.target is aten.maximum.default else L.p.minimum(a, b))


@lowers(aten.clamp.default)
def _clamp(L: Lowerer, node: Node) -> Value:
    """``min(max(x, lo), hi)`` with the bounds in fp32 (both devices' kernels); NaN stays NaN."""
    x, *bounds = node.args
    lo = bounds[0] if len(bounds) > 0 else node.kwargs.get("min")
    hi = bounds[1] if len(bounds) > 1 else node.kwargs.get("max")
    v = L.operand(x, node_dtype(node))
    if lo is not None:
        v = L.p.maximum(v, L.value(lo))
    if hi is not None:
        v = L.p.minimum(v, L.value(hi))
    return L.result(node, v)


@lowers(aten.lerp.Scalar, aten.lerp.Tensor)
def _lerp(L: Lowerer, node: Node) -> Value:
    """``fma(small ? w : w - 1, end - start, small ? start : end)`` with ``small = |w| < 0.5``."""
    start, end, weight = node.args
    dtype = node_dtype(node)
    s, e = L.operand(start, dtype), L.operand(end, dtype)
    w = L.operand(weight, dtype, opmath=node.target is aten.lerp.Scalar)
    small = L.p.bind(L.p.lt(L.p.abs(w), L.p.constant(0.5)), f"{node.name}_small")
    diff = L.p.bind(L.p.sub(e, s), f"{node.name}_diff")
    factor = L.p.where(small, w, L.p.sub(w, L.p.constant(1.0)))
    return L.result(node, L.p.fma(factor, diff, L.p.where(small, s, e)))


def _value_operand(L: Lowerer, node: Node) -> Value | None:
    """addcmul/addcdiv's ``value`` in fp32, or None for a literal 1 (the unscaled formula)."""
    value = node.kwargs.get("value", 1)
    return None if L.is_one(value) else L.operand(value, torch.float32, opmath=True)


@lowers(aten.addcmul.default)
def _addcmul(L: Lowerer, node: Node) -> Value:
    dtype = node_dtype(node)
    s, t1, t2 = (L.operand(a, dtype) for a in node.args[:3])
    v = _value_operand(L, node)
    if v is None:
        return L.result(node, L.p.fma(t1, t2, s))
    if not L.target.cuda:
        return L.result(node, L.p.fma(L.p.mul(v, t1), t2, s))
    scaled = L.p.fma(v, L.p.mul(t1, t2), s)
    return L.result(node, L.p.where(L.p.eq(v, L.p.constant(1.0)), L.p.fma(t1, t2, s), scaled))


@lowers(aten.addcdiv.default)
def _addcdiv(L: Lowerer, node: Node) -> Value:
    dtype = node_dtype(node)
    s, t1, t2 = (L.operand(a, dtype) for a in node.args[:3])
    v = _value_operand(L, node)
    if v is None:
        return L.result(node, L.p.add(s, L.p.div(t1, t2)))
    if not L.target.cuda:
        return L.result(node, L.p.add(s, L.p.div(L.p.mul(v, t1), t2)))
    q = L.p.bind(L.p.div(t1, t2), f"{node.name}_q")
    return L.result(node, L.p.where(L.p.eq(v, L.p.constant(1.0)), L.p.add(s, q), L.p.fma(v, q, s)))


# comparisons and selection -----------------------------------------------------------------------------
_COMPARISONS = {
    "lt": (aten.lt.Scalar, aten.lt.Tensor), "le": (aten.le.Scalar, aten.le.Tensor),
    "gt": (aten.gt.Scalar, aten.gt.Tensor), "ge": (aten.ge.Scalar, aten.ge.Tensor),
    "eq": (aten.eq.Scalar, aten.eq.Tensor), "ne": (aten.ne.Scalar, aten.ne.Tensor),
}


def _comparison(name: str) -> Lowering:
    def lower(L: Lowerer, node: Node) -> Value:
        """Both operands in their common dtype (CPU casts a scalar to it; CUDA reads host scalars in fp32)."""
        a, b = node.args
        dtype = _common_dtype(node, (a, b))
        x = L.operand(a, dtype, opmath=L.target.cuda and L.host(a))
        y = L.operand(b, dtype, opmath=L.target.cuda and L.host(b))
        return L.result(node, getattr(L.p, name)(x, y))

    return lower


for _name, _ops in _COMPARISONS.items():
    lowers(*_ops)(_comparison(_name))


@lowers(aten.logical_and.default, aten.logical_or.default)
def _logical(L: Lowerer, node: Node) -> Value:
    a, b = (_truth(L, x) for x in node.args)
    return L.result(node, L.p.logical_and(a, b) if node.target is aten.logical_and.default else L.p.logical_or(a, b))


@lowers(aten.logical_not.default)
def _logical_not(L: Lowerer, node: Node) -> Value:
    return L.result(node, L.p.logical_not(_truth(L, node.args[0])))


def _truth(L: Lowerer, arg: object) -> Value:
    v = L.value(arg)
    return v if v.dtype == torch.bool else L.p.ne(v, L.p.constant(0.0))


@lowers(aten.where.self)
def _where(L: Lowerer, node: Node) -> Value:
    cond, a, b = node.args
    dtype = node_dtype(node)
    return L.result(node, L.p.where(_truth(L, cond), L.operand(a, dtype), L.operand(b, dtype)))


# data movement -------------------------------------------------------------------------------------------
@lowers(aten.clone.default, aten.alias.default)
def _alias(L: Lowerer, node: Node) -> Value:
    return L.value(node.args[0])


def _to_copy_checker(node: Node, target: Target) -> str | None:
    extra = set(node.kwargs) - {"dtype", "layout", "device", "memory_format"}
    return f"arguments {sorted(extra)}" if extra else None


@lowers(aten._to_copy.default, checker=_to_copy_checker)
def _to_copy(L: Lowerer, node: Node) -> Value:
    dtype = node_dtype(node)
    v = L.value(node.args[0])
    if dtype == torch.bool:
        return L.result(node, _truth(L, node.args[0]))
    return L.result(node, L.cast(v, dtype))


def _copy_checker(node: Node, target: Target) -> str | None:
    dst = node.args[0]
    desc = input_of(dst) if isinstance(dst, Node) else None
    if desc is None or desc.role not in (Role.PARAM, Role.PER_ELEMENT_STATE):
        return "the fused kernel writes back only into the param and stock-format per-element states"
    return None


@lowers(aten.copy_.default, checker=_copy_checker)
def _copy(L: Lowerer, node: Node) -> Value:
    dst, src = node.args[:2]
    value = _elementwise(L, L.cast(L.value(src), _float_dtype(dst.meta["val"].dtype, dst)))
    L.p.store(dst, value)
    return value


def _state_checker(node: Node, target: Target) -> str | None:
    access = state_access(node)
    if access.fmt.passthrough:
        return "fp32 states stay stock tensors and never reach a state node"
    return None


@lowers(lowbit.dequantize.default, checker=_state_checker)
def _dequantize(L: Lowerer, node: Node) -> Value:
    access = state_access(node)
    _float_dtype(access.dtype, node)
    return L.result(node, L.p.dequantize(access))


@lowers(lowbit.quantize_.default, lowbit.quantize_stochastic_.default, checker=_state_checker)
def _quantize(L: Lowerer, node: Node) -> None:
    access = state_access(node)
    seed = L.value(access.seed) if access.seed is not None else None
    L.p.quantize(access, _elementwise(L, L.cast(L.value(access.value), access.dtype)), seed)


@lowers(lowbit.master_read.default)
def _master_read(L: Lowerer, node: Node) -> Value:
    return L.result(node, L.p.master_read(master_access(node)))


@lowers(lowbit.master_write_.default)
def _master_write(L: Lowerer, node: Node) -> None:
    access = master_access(node)
    seed = L.value(access.seed) if access.seed is not None else None
    L.p.master_write(access, _elementwise(L, L.cast(L.value(access.value), torch.float32)), seed)


def _elementwise(L: Lowerer, v: Value) -> Value:
    """A value stored per element: a scalar one is broadcast (``0 * grad + v``, exact for finite v)."""
    if v.kind is Kind.ELEMENT:
        return v
    raise LoweringError(f"a write-back of the uniform value {v.text!r}: the step stores a constant into a "
                        "per-element tensor, which the fused kernels do not broadcast")


def covered_ops() -> tuple[str, ...]:
    """Names of the ops the table lowers (for error messages and docs)."""
    return tuple(sorted(str(op) for op in LOWERINGS))

