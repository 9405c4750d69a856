"""The elementwise vocabulary every kernel printer implements (the shape of inductor's ``OpsHandler``).

``lowering.py`` writes each aten op a step may contain once, in these primitives; a printer (the
Triton one, the C++ one) turns each primitive into its language and knows nothing of aten. A
:class:`Value` is what a printer hands back: its text in the kernel, the dtype it is rounded to,
and whether it is uniform over the kernel (a scalar) or varies per element.

Arithmetic is IEEE fp32 unless a primitive says otherwise: values of bf16 and fp16 dtype are held
in fp32, exactly representable in their dtype, and only :meth:`Primitives.round_to` rounds to them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

import torch
from torch.fx import Node

from ..ir.contract import MasterAccess, StateAccess


class Kind(enum.Enum):
    ELEMENT = "element"  # one value per element of the param
    SCALAR = "scalar"  # one value for the whole kernel


@dataclass(frozen=True)
class Value:
    """One value of a kernel.

    ``text`` is the printer's expression (``atomic`` when it needs no parentheses as an operand);
    ``dtype`` is float32, bfloat16 or float16 (held in fp32, already rounded to it) or bool; ``host``
    marks a number or 0-d CPU tensor that ATen reads on the host, which changes some CUDA formulas;
    ``literal`` is a constant's value, so the lowering can fold it.
    """

    text: str
    dtype: torch.dtype
    kind: Kind
    host: bool = False
    atomic: bool = True
    literal: float | None = None

    @property
    def scalar(self) -> bool:
        return self.kind is Kind.SCALAR


class Primitives(Protocol):
    """Every primitive a lowering may use. Binary primitives broadcast a scalar against elements."""

    # inputs and outputs -------------------------------------------------------------------------
    def load(self, node: Node, dtype: torch.dtype) -> Value:
        """The elements of the per-element input ``node`` (param, grad, a stock-format state)."""

    def scalar_input(self, node: Node, dtype: torch.dtype | None) -> Value:
        """The scalar input ``node``: a number (``dtype`` None) or a 0-d tensor of ``dtype``."""

    def constant(self, value: float, dtype: torch.dtype = torch.float32) -> Value:
        """A literal (a Python number of the graph, or one a lowering needs)."""

    def store(self, node: Node, value: Value) -> None:
        """Write ``value`` (already rounded to the input's dtype) into the per-element input ``node``."""

    def dequantize(self, state: StateAccess) -> Value:
        """The elements of a quantized state: codes decoded, times the block's scale, patches applied."""

    def quantize(self, state: StateAccess, value: Value, seed: Value | None) -> None:
        """Encode ``value`` as the state's new codes, block scales and patches: to nearest, or with the step
        counter ``seed`` stochastically (the random bits of ``seed``, the state's stream and the element's
        index: ``formats/rounding.py``)."""

    def master_read(self, master: MasterAccess) -> Value:
        """The fp32 master of the param's elements: each 16-bit value joined with its residual."""

    def master_write(self, master: MasterAccess, value: Value, seed: Value | None) -> None:
        """Store the new fp32 master ``value``: the param its round to nearest even, the residual what that
        loses (stochastically rounded with the random bits of ``seed`` and the element's index when lossy)."""

    def bind(self, value: Value, name: str) -> Value:
        """``value`` computed once, under a name (a statement of the kernel)."""

    # arithmetic (fp32, correctly rounded) -------------------------------------------------------------
    def add(self, a: Value, b: Value) -> Value: ...

    def sub(self, a: Value, b: Value) -> Value: ...

    def mul(self, a: Value, b: Value) -> Value: ...

    def div(self, a: Value, b: Value) -> Value:
        """True division, correctly rounded."""

    def fma(self, a: Value, b: Value, c: Value) -> Value:
        """``a * b + c`` with one rounding."""

    def sqrt(self, a: Value, correctly_rounded: bool = False) -> Value:
        """The target's fp32 square root: correctly rounded, or torch's own where the target says so
        (unless ``correctly_rounded``: ATen's CPU ``rsqrt`` takes the vector unit's, not MKL's)."""

    def neg(self, a: Value) -> Value: ...

    def abs(self, a: Value) -> Value: ...

    def maximum(self, a: Value, b: Value) -> Value:
        """The larger of ``a`` and ``b``; NaN if either is NaN (``torch.maximum``)."""

    def minimum(self, a: Value, b: Value) -> Value:
        """The smaller of ``a`` and ``b``; NaN if either is NaN (``torch.minimum``)."""

    def round_to(self, a: Value, dtype: torch.dtype) -> Value:
        """``a`` rounded to bf16 or fp16 (to nearest, ties to even; overflow to inf), held in fp32."""

    # comparisons and selection (exact) --------------------------------------------------------------
    def lt(self, a: Value, b: Value) -> Value: ...

    def le(self, a: Value, b: Value) -> Value: ...

    def gt(self, a: Value, b: Value) -> Value: ...

    def ge(self, a: Value, b: Value) -> Value: ...

    def eq(self, a: Value, b: Value) -> Value: ...

    def ne(self, a: Value, b: Value) -> Value: ...

    def logical_and(self, a: Value, b: Value) -> Value: ...

    def logical_or(self, a: Value, b: Value) -> Value: ...

    def logical_not(self, a: Value) -> Value: ...

    def where(self, cond: Value, a: Value, b: Value) -> Value:
        """``a`` where the bool ``cond`` holds, else ``b``."""

    def to_float(self, cond: Value) -> Value:
        """A bool as 1.0 or 0.0."""


PRIMITIVES = tuple(name for name, member in vars(Primitives).items() if callable(member) and not name.startswith("_"))
