"""fp32 master weights held as a 16-bit param plus a residual, in plain torch: the reference every kernel
matches (``cpu_prelude.h``'s ``lb_master_*``, ``triton_lib``'s ``master_*``).

A step writes its new fp32 master ``x`` as the param ``p = round_to_nearest_even(x)`` (what
``param.copy_(master)`` stores) and a residual: what ``p`` lost.

bf16, ``"exact"``: ``d = |x| - |p|`` counted in fp32 bit patterns (sign and magnitude: ``p`` has
``x``'s sign). ``d`` lies in ``[-2**15, 2**15]``; ``+2**15`` and ``-2**15`` are the two ties an even
``p`` keeps (``x`` halfway to the next value up, rounded down, and halfway to the next value down,
rounded up), so an even ``p`` has 65537 masters and no 16 bits can tell them all apart. ``d`` is
stored in an int16 with ``-2**15`` standing for either tie, and which tie it is in one bit per
element (``master_ties``, 32 elements per int32 word), read and written only where the code is a
tie. 2.125 bytes per element give back every fp32 value bit for bit: infinities, values that round
to infinity, signed zeros, subnormals; a NaN stays a NaN.

fp16, ``"exact"``: ``d = (x - p) / u`` with ``u = 2**(e - 24)`` and ``e`` the exponent of ``p``
(-14 for fp16 subnormals and zero): an integer in ``[-2**13, 2**13]`` in an int16, exact for every
``|x| >= 2**-15``. Below that ``d`` is rounded to the nearest integer (the master keeps an absolute
``2**-38`` resolution, error <= ``2**-39``), and a master beyond fp16's range rounds ``p`` to inf and
is lost with it (the master becomes inf; no 16 bits hold a value beyond 65504 next to an inf).

``"8bit"``: the exact ``d`` stochastically rounded to a multiple of ``s`` (256 for bf16, 64 for
fp16: 1/256 of the 16-bit grid's spacing at ``p``) and stored as ``d / s`` in an int8, clamped to
[-127, 127]. The stored master is within ``s`` bit units of the exact one (``s`` units of ``u`` for
fp16) after every step, and unbiased: an update far below that resolution still moves the master
in expectation, where deterministic rounding would drop it every step. The random bits are a hash
of the element's index and a per-tensor step counter (``master_seed``), the same in every backend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MODES = ("exact", "8bit")
PARAM_DTYPES = (torch.bfloat16, torch.float16)

# the state keys of a parameter's master: residual codes, tie bits (exact bf16), step counter (8bit)
RESIDUAL, TIES, SEED = "master_residual", "master_ties", "master_seed"
KEYS = (RESIDUAL, TIES, SEED)
SEED_PERIOD = 2**24  # the counter wraps here: every value stays an exact fp32 integer
_SPREAD = 0x9E3779B1  # odd (2**32 over the golden ratio): positions map to distinct, well-spread starts
TIE = -(2**15)  # the exact bf16 code of either tie


def first_counter(position: int) -> float:
    """Where the stochastic-rounding counter of the parameter at ``position`` (in ``param_groups`` order)
    starts: an element's bits depend only on its index, the counter and its stream, so parameters whose
    counters ran in step would round their same-index elements with the same draws (every layer of a
    stack alike)."""
    return float(position * _SPREAD % SEED_PERIOD)


@dataclass(frozen=True)
class MasterFormat:
    """How one parameter's fp32 master is held: ``mode`` ("exact" or "8bit") next to a param of
    ``param_dtype`` (bf16 or fp16)."""

    mode: str
    param_dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"master weights mode must be one of {MODES}, got {self.mode!r}")
        if self.param_dtype not in PARAM_DTYPES:
            raise ValueError(f"master weights are for bfloat16 and float16 params, not {self.param_dtype}")

    @property
    def exact(self) -> bool:
        return self.mode == "exact"

    @property
    def bf16(self) -> bool:
        return self.param_dtype == torch.bfloat16

    @property
    def residual_dtype(self) -> torch.dtype:
        return torch.int16 if self.exact else torch.int8

    @property
    def has_ties(self) -> bool:
        """Whether the residual needs the tie bits (exact bf16: 65537 masters per even param)."""
        return self.exact and self.bf16

    @property
    def seeded(self) -> bool:
        """Whether writes round stochastically (and so need the step counter)."""
        return not self.exact

    @property
    def shift(self) -> int:
        """log2 of the lossy residual's step, in units of the exact residual (bf16: 8, fp16: 6)."""
        return 8 if self.bf16 else 6

    def tag(self) -> str:
        return f"{self.mode}:{str(self.param_dtype).removeprefix('torch.')}"

    @staticmethod
    def from_tag(tag: str) -> MasterFormat:
        mode, dtype = tag.split(":")
        return MasterFormat(mode, getattr(torch, dtype))

    def keys(self) -> tuple[str, ...]:
        """The state entries this master keeps, besides the param itself."""
        return (RESIDUAL,) + ((TIES,) if self.has_ties else ()) + ((SEED,) if self.seeded else ())

    def bytes_per_element(self) -> float:
        """Residual bytes per parameter element (tie bits included)."""
        return self.residual_dtype.itemsize + (1 / 8 if self.has_ties else 0.0)


def tie_words(numel: int) -> int:
    """int32 words of tie bits for ``numel`` elements."""
    return -(-numel // 32)


# --- the random bits of stochastic rounding ----------------------------------------------------------
MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2**32`` for int64 ``x`` in [0, 2**32): two 16-bit halves of ``c``, so no product overflows."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & MASK32


def hash32(x: torch.Tensor) -> torch.Tensor:
    """Chris Wellons' ``lowbias32`` integer hash of int64 values in [0, 2**32), as int64."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def random_bits(seed: float, numel: int, device: torch.device | str = "cpu", offset: int = 0) -> torch.Tensor:
    """32 random bits per element (int64): ``hash32(index ^ hash32(seed))`` for the elements at
    ``offset, offset + 1, ...`` of a tensor."""
    key = hash32(torch.tensor(int(seed) & MASK32, dtype=torch.int64))
    index = torch.arange(offset, offset + numel, dtype=torch.int64, device=device) & MASK32
    return hash32(index ^ key.to(device))


# --- the exact residual -----------------------------------------------------------------------------
def _bf16_bits(param: torch.Tensor) -> torch.Tensor:
    """The fp32 bit pattern (as int64 in [0, 2**32)) of each bf16 element."""
    return (param.view(torch.int16).to(torch.int64) << 16) & MASK32


def _exact_d(master: torch.Tensor, param: torch.Tensor, fmt: MasterFormat) -> torch.Tensor:
    """``d`` of every element (int64; 0 where it has no meaning: NaN masters, fp16 overflow), exact for
    bf16, rounded to the nearest integer in fp16's subnormal range."""
    if fmt.bf16:
        mag = master.view(torch.int32).to(torch.int64) & 0x7FFFFFFF
        d = mag - (_bf16_bits(param) & 0x7FFFFFFF)
        return torch.where(master.isnan(), 0, d)
    p = param.float()
    d = torch.round((master - p) * _f16_inverse_unit(p))
    return torch.where(p.isfinite(), d, 0.0).to(torch.int64)


def _f16_exponent(p: torch.Tensor) -> torch.Tensor:
    """The biased fp32 exponent of the fp16 value ``p``, at least that of 2**-14 (subnormals, zero)."""
    return ((p.view(torch.int32) >> 23) & 0xFF).clamp(min=127 - 14)


def _f16_unit(p: torch.Tensor) -> torch.Tensor:
    """``u = 2**(e - 24)``: the fp32 spacing of masters that round to ``p``, from its lower binade."""
    return ((_f16_exponent(p) - 24) << 23).view(torch.float32)


def _f16_inverse_unit(p: torch.Tensor) -> torch.Tensor:
    """``1 / u``, a power of two (2**9 to 2**38), so multiplying by it is exact."""
    return ((127 + 127 + 24 - _f16_exponent(p)) << 23).view(torch.float32)


def encode(master: torch.Tensor, fmt: MasterFormat, seed: float = 0.0,
           offset: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The param, residual codes and tie flags (bool per element, exact bf16 only) holding the flat
    fp32 ``master``; ``seed`` (the step counter) picks the stochastic rounding of ``"8bit"``, for
    elements from ``offset`` of their tensor."""
    master = master.reshape(-1).float()
    param = master.to(fmt.param_dtype)
    d = _exact_d(master, param, fmt)
    if fmt.exact:
        ties = (d == TIE) if fmt.has_ties else None
        code = torch.where(d.abs() == -TIE, TIE, d)
        return param, code.to(fmt.residual_dtype), ties
    step = 1 << fmt.shift
    q = torch.div(d + (random_bits(seed, d.numel(), d.device, offset) & (step - 1)), step, rounding_mode="floor")
    return param, q.clamp(-127, 127).to(torch.int8), None


def decode(param: torch.Tensor, residual: torch.Tensor, ties: torch.Tensor | None, fmt: MasterFormat) -> torch.Tensor:
    """The flat fp32 master that the flat ``param`` and its residual (``ties``: bool per element) hold."""
    param, code = param.reshape(-1), residual.reshape(-1).to(torch.int64)
    if fmt.exact:
        d = torch.where(code == TIE, torch.where(ties, TIE, -TIE), code) if fmt.has_ties else code
    else:
        d = code << fmt.shift
    if fmt.bf16:
        bits = _bf16_bits(param)
        sign, mag = bits & 0x80000000, bits & 0x7FFFFFFF
        joined = (mag + d).clamp(0, 0x7F800000)  # a residual a changed param no longer fits stays in range
        joined = torch.where(mag > 0x7F800000, mag, joined)  # NaN stays NaN
        out = sign | joined
        return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32).view(torch.float32)
    p = param.float()
    return torch.where(d == 0, p, p + d.to(torch.float32) * _f16_unit(p))


# --- the storage in optimizer state ---------------------------------------------------------------------
def pack_ties(flags: torch.Tensor) -> torch.Tensor:
    """Bool flags -> int32 words, element ``i`` in bit ``i % 32`` of word ``i // 32``."""
    n = flags.numel()
    bits = torch.zeros(tie_words(n) * 32, dtype=torch.int64, device=flags.device)
    bits[:n] = flags.reshape(-1).to(torch.int64)
    words = (bits.view(-1, 32) << torch.arange(32, device=flags.device)).sum(1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_ties(words: torch.Tensor, numel: int) -> torch.Tensor:
    """int32 words -> ``numel`` bool flags (the inverse of :func:`pack_ties`)."""
    bits = (words.to(torch.int64)[:, None] >> torch.arange(32, device=words.device)) & 1
    return bits.reshape(-1)[:numel].bool()


def write(master: torch.Tensor, param: torch.Tensor, residual: torch.Tensor, ties: torch.Tensor | None,
          seed: torch.Tensor | float | None, fmt: MasterFormat) -> None:
    """Store the flat fp32 ``master`` into the flat ``param``, ``residual`` and ``ties`` words, in place.
    Tie bits change only where the new code is a tie (elsewhere they are never read)."""
    new_param, code, flags = encode(master, fmt, float(seed) if seed is not None else 0.0)
    param.copy_(new_param)
    residual.copy_(code)
    if flags is not None:
        old = unpack_ties(ties, code.numel())
        ties.copy_(pack_ties(torch.where(code == TIE, flags, old)))


def read(param: torch.Tensor, residual: torch.Tensor, ties: torch.Tensor | None, fmt: MasterFormat) -> torch.Tensor:
    """The flat fp32 master of the flat ``param``, ``residual`` and ``ties`` words."""
    flags = unpack_ties(ties, residual.numel()) if fmt.has_ties else None
    return decode(param, residual, flags, fmt)
