"""Element formats of one quantized state: how a normalized value becomes an 8-bit code and back.

A format only maps numbers; grouping into blocks, scales and outlier patches lives in
``blockquant.py``. Every backend (eager reference, Triton, inductor) encodes and decodes with the
definitions here, so they agree on every code. In a block that holds +inf, -inf or NaN (a *flagged*
block, see ``blockquant.py``) three codes of each format mean those values, and the block's finite
values keep off them (``StateFormat.flagged_qmax``, ``special_codes``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

FORMAT_NAMES = ("int8", "dynamic8", "fp8_e4m3", "fp8_e5m2", "bf16", "fp32")
# The number of each format in the kernels (the C++ prelude's enum, triton_lib's constexprs).
FORMAT_IDS = {name: i for i, name in enumerate(FORMAT_NAMES)}


@dataclass(frozen=True)
class StateFormat:
    """The storage of one per-element state: element format, block size, patches per block, sign.

    ``nonneg`` marks a state that is never negative (a second moment): its codes spend all 256
    values on [0, max], and a positive value never encodes to zero (the zero-point problem of
    Li et al. 2023, "Memory Efficient Optimizers with 4-bit States", Sec. 4.1), because
    ``m / (sqrt(v) + eps)`` turns a v that decodes to 0 into a step of ``m / eps``.
    """

    name: str
    block_size: int = 2048
    outliers: int = 2
    nonneg: bool = False

    def __post_init__(self) -> None:
        if self.name not in FORMAT_NAMES:
            raise ValueError(f"unknown format {self.name!r}; expected one of {FORMAT_NAMES}")

    @property
    def passthrough(self) -> bool:
        """fp32 keeps the stock tensor: no codes, no scales, bit-for-bit stock behaviour."""
        return self.name == "fp32"

    @property
    def blockwise(self) -> bool:
        """Whether codes are relative to a per-block scale (and so can carry outlier patches)."""
        return self.name not in ("bf16", "fp32")

    @property
    def patches(self) -> int:
        return self.outliers if self.blockwise else 0

    @property
    def code_dtype(self) -> torch.dtype:
        return {
            "int8": torch.uint8 if self.nonneg else torch.int8,
            "dynamic8": torch.uint8,
            "fp8_e4m3": torch.float8_e4m3fn,
            "fp8_e5m2": torch.float8_e5m2,
            "bf16": torch.bfloat16,
            "fp32": torch.float32,
        }[self.name]

    @property
    def qmax(self) -> float:
        """The largest code magnitude: a block's absmax maps onto it.

        For the signed dynamic map it is 0.99297, the largest magnitude both signs hold (the map has
        +1 but not -1): with 1.0 a block whose absmax is negative shrank by 0.7% at every
        re-quantization, since its largest element came back as -0.99297 of the old absmax.
        """
        return {
            "int8": 255.0 if self.nonneg else 127.0,
            "dynamic8": 1.0 if self.nonneg else -float(dynamic_map(False)[0]),
            "fp8_e4m3": 448.0,
            "fp8_e5m2": 57344.0,
            "bf16": 1.0,
            "fp32": 1.0,
        }[self.name]

    @property
    def mantissa_bits(self) -> int:
        """Of an fp8 format: its mantissa bits (the exponent has ``7 - mantissa_bits``)."""
        return {"fp8_e4m3": 3, "fp8_e5m2": 2}[self.name]

    @property
    def min_exponent(self) -> int:
        """Of an fp8 format: the exponent of its smallest normal value."""
        return 2 - 2 ** (6 - self.mantissa_bits)

    @property
    def flagged_qmax(self) -> float:
        """The largest code magnitude of a flagged block's finite values: the codes past it are the
        block's +inf, -inf and NaN (``special_codes``). fp8_e5m2 has those codes natively."""
        return {
            "int8": 252.0 if self.nonneg else 126.0,
            "dynamic8": float(dynamic_map(self.nonneg)[252 if self.nonneg else 253]),
            "fp8_e4m3": 416.0,
        }.get(self.name, self.qmax)

    @property
    def min_positive(self) -> float:
        """The smallest positive normalized value this format can hold (what a tiny v rounds up to)."""
        return {
            "int8": 1.0,
            "dynamic8": float(dynamic_map(self.nonneg)[1 if self.nonneg else 128]),
            "fp8_e4m3": 2.0**-9,
            "fp8_e5m2": 2.0**-16,
            "bf16": float(torch.finfo(torch.bfloat16).smallest_normal) * 2.0**-7,
            "fp32": 0.0,
        }[self.name]

    @staticmethod
    def make(name: str, block_size: int, outliers: int, nonneg: bool) -> StateFormat:
        """The canonical format: block size and patches only where the format is blockwise."""
        if name in ("bf16", "fp32"):
            return StateFormat(name, 0, 0, nonneg)
        return StateFormat(name, block_size, outliers, nonneg)

    def tag(self) -> str:
        """A short stable name, used in op arguments, state dicts and cache keys."""
        return f"{self.name}:{self.block_size}:{self.outliers}:{'u' if self.nonneg else 's'}"

    @staticmethod
    def from_tag(tag: str) -> StateFormat:
        name, block, k, sign = tag.split(":")
        return StateFormat(name, int(block), int(k), sign == "u")


@functools.cache
def dynamic_map(nonneg: bool) -> torch.Tensor:
    """The 256 sorted values of the dynamic tree map (Dettmers et al. 2022, "8-bit Optimizers via
    Block-wise Quantization", Sec. 2.2): a decimal exponent 1e-6..1e0 and a linear fraction whose
    resolution grows with the exponent, so small magnitudes keep relative precision.

    The signed map holds 0, 1 and 127 magnitudes of each sign (so -1 itself is not representable,
    as in bitsandbytes); the unsigned map holds 0, 1 and 254 positive values.
    """
    exponent_bits = 7
    values: list[float] = []
    for i in range(exponent_bits):
        n_frac = 2 ** (i + (0 if not nonneg else 1)) + 1
        bounds = torch.linspace(0.1, 1.0, n_frac, dtype=torch.float64)
        means = ((bounds[:-1] + bounds[1:]) / 2.0) * 10.0 ** (-(exponent_bits - 1) + i)
        values += means.tolist()
        if not nonneg:
            values += (-means).tolist()
    values = sorted(set(values + [0.0, 1.0]))
    table = torch.tensor(values, dtype=torch.float32)
    assert table.numel() == 256 and torch.all(table[1:] > table[:-1])
    return table


@functools.cache
def dynamic_midpoints(nonneg: bool) -> torch.Tensor:
    """Decision boundaries between neighbouring map values: encode is a search over these."""
    table = dynamic_map(nonneg).double()
    return ((table[:-1] + table[1:]) / 2).float()


def encode(x: torch.Tensor, fmt: StateFormat, flagged: torch.Tensor | None = None) -> torch.Tensor:
    """Encode values already divided by their block scale (|x| <= qmax) into codes.

    Rounding is to nearest, ties to even; for a non-negative state a positive value never becomes
    code 0. Where ``flagged`` (a bool tensor broadcasting against ``x``: the element's block is
    flagged) finite values are clamped to ``flagged_qmax`` and +inf, -inf and NaN get their
    special codes; elsewhere a non-finite value saturates like any value out of range.
    """
    if flagged is not None and fmt.blockwise:
        inner = torch.where(flagged, x.clamp(-fmt.flagged_qmax, fmt.flagged_qmax), x)
        codes = encode(inner, fmt).view(torch.uint8)
        pos_inf, neg_inf, nan = special_codes(fmt)
        special = torch.where(torch.isnan(x), nan, torch.where(x > 0, pos_inf, neg_inf)).to(torch.uint8)
        return torch.where(flagged & ~torch.isfinite(x), special, codes).view(fmt.code_dtype)
    name = fmt.name
    if name == "int8":
        lo = 0.0 if fmt.nonneg else -fmt.qmax
        q = torch.round(x).clamp_(lo, fmt.qmax)
        if fmt.nonneg:
            q = torch.where((x > 0) & (q == 0), 1.0, q)
        return q.to(fmt.code_dtype)
    if name == "dynamic8":
        mids = dynamic_midpoints(fmt.nonneg).to(x.device)
        # right=True puts an exact tie on the upper value, matching searchsorted in the kernels
        idx = torch.bucketize(x.contiguous(), mids, right=True)
        if fmt.nonneg:
            idx = torch.where((x > 0) & (idx == 0), 1, idx)
        return idx.to(torch.uint8)
    if name in ("fp8_e4m3", "fp8_e5m2", "bf16"):
        y = x.clamp(-fmt.qmax, fmt.qmax) if name != "bf16" else x
        if fmt.nonneg:
            y = torch.where(y > 0, y.clamp(min=fmt.min_positive), y)
        return round_bf16(y) if name == "bf16" else y.to(fmt.code_dtype)
    if name == "fp32":
        return x.float()
    raise AssertionError(name)


def decode(codes: torch.Tensor, fmt: StateFormat, flagged: torch.Tensor | None = None) -> torch.Tensor:
    """Codes back to fp32 values relative to the block scale; where ``flagged``, the special codes
    decode to +inf, -inf and NaN (which the caller must not multiply by the scale)."""
    if fmt.name == "dynamic8":
        values = dynamic_map(fmt.nonneg).to(codes.device)[codes.long()]
    else:
        values = codes.float()
    if flagged is None or not fmt.blockwise:
        return values
    is_special, special_values = _special_table(fmt.name, fmt.nonneg)
    byte = codes.view(torch.uint8).long()
    return torch.where(flagged & is_special.to(codes.device)[byte], special_values.to(codes.device)[byte], values)


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 to bf16, to nearest even, a finite value saturating at bf16's largest instead of becoming
    inf (fp32 values above 3.3961e38 round to bf16 inf); inf and NaN stay."""
    top = torch.finfo(torch.bfloat16).max
    return torch.where(torch.isfinite(x), x.clamp(-top, top), x).to(torch.bfloat16)


# ---- non-finite values in flagged blocks ------------------------------------------------------------
# Per format and sign: the code bytes (as uint8) of +inf, -inf and NaN in a flagged block. They are
# codes a finite value of an unflagged block may take (the largest magnitudes, and int8's spare
# -128), so every finite block keeps the full resolution; fp8_e5m2 uses its own inf and NaN codes and
# fp8_e4m3 (no inf) its largest finite codes, +-448, with NaN its own 0x7F.
_SPECIAL_CODES = {
    ("int8", False): (0x7F, 0x81, 0x80),  # 127, -127, -128; finite codes -126..126
    ("int8", True): (255, 253, 254),  # finite codes 0..252
    ("dynamic8", False): (255, 0, 254),  # the map's two ends and 0.993; finite codes 1..253 (+-0.979)
    ("dynamic8", True): (255, 253, 254),  # finite codes 0..252 (up to 0.982)
    ("fp8_e4m3", False): (0x7E, 0xFE, 0x7F),  # finite values up to +-416
    ("fp8_e5m2", False): (0x7C, 0xFC, 0x7F),  # IEEE inf and torch's NaN; finite values up to +-57344
}


def special_codes(fmt: StateFormat) -> tuple[int, int, int]:
    """The code bytes of +inf, -inf and NaN in a flagged block of ``fmt``."""
    fp8 = fmt.name.startswith("fp8")
    return _SPECIAL_CODES[(fmt.name, fmt.nonneg and not fp8)]


@functools.cache
def _special_table(name: str, nonneg: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per code byte: whether it is special in a flagged block, and its value there."""
    is_special = torch.zeros(256, dtype=torch.bool)
    values = torch.zeros(256)
    for code, value in zip(special_codes(StateFormat(name, nonneg=nonneg)), (math.inf, -math.inf, math.nan)):
        is_special[code], values[code] = True, value
    return is_special, values
