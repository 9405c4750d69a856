"""Block quantization with 16-bit outlier patches, in plain torch: the reference every kernel matches.

One state of ``n`` elements is stored as
  * ``codes``          (n,)            one code per element, in the format's code dtype (a 4-bit format:
                       (ceil(n/2),)    uint8, two codes a byte, ``packing.py``);
  * ``scales``         (n_blocks,)     fp32: the absmax of the block's finite non-patch values / qmax
                                       (signed dynamic8: per side, see below),
                                       negative (sign bit set) where the block is *flagged*;
  * ``patch_values``   (n_blocks, K)   bf16: the K largest-magnitude finite values of the block;
  * ``patch_index``    (n_blocks, K)   int16: their offsets inside the block.
Patches are taken out before the absmax, so one giant value in a block no longer flattens every
other value of that block to code 0. Ties in magnitude go to the lowest offset. A partial last
block is padded with zeros for the computation only; a patch there may point into the padding,
and decoding ignores it.

Every float survives (``StateFormat`` names the formats; bounds: docs/numerics.md):

* *Non-finite values stay in their element.* A block holding +inf, -inf or NaN among its non-patch
  values is flagged by the sign bit of its scale (scales are otherwise >= 0). Its scale comes from
  its finite values only, over ``flagged_qmax``; the non-finite values take the format's three
  special codes (``formats.special_codes``), which decode exactly. A block without one is stored as
  if flagging did not exist, so finite blocks keep every code. Patches are chosen among finite
  values first (a non-finite value ranks below every finite one); a block with fewer finite values
  than K patches the non-finite ones too, as they are (bf16 holds inf and NaN).
* *Every scale is usable.* A block with nonzero absmax below ``qmax * MIN_SCALE`` (down to the
  smallest subnormal) gets the scale ``MIN_SCALE`` and is encoded with the exact multiplier
  ``1 / MIN_SCALE``: ``qmax / absmax`` would overflow to inf, and ``0 * inf`` is NaN. So every
  scale is 0 or at least ``MIN_SCALE``, and the smallest positive code times the scale is still
  positive (the zero-point rule holds for every block). At the top binade a scale whose largest
  code would decode to inf (``qmax * scale`` rounding past the largest float) is lowered by one ulp;
  where qmax < 1 (flagged dynamic8 blocks: 0.986 signed, 0.979 unsigned) the
  scale stops at the largest float, and a value past its sign's largest usable map value times that
  saturates there.
* *The extreme element keeps its code, whatever its sign.* A format whose most negative code is
  smaller in magnitude than its largest (``StateFormat.neg_qmax`` < ``qmax``) takes the larger of
  the block's largest positive value over ``qmax`` and its most negative magnitude over
  ``neg_qmax``. Since map version 2 every format is symmetric (``neg_qmax == qmax``), so this is
  the plain ``absmax / qmax``.
* Patches are encoded like a ``bf16`` state of the same sign: a finite value saturates at bf16's
  largest instead of rounding to inf, and a positive value of a non-negative state never becomes 0.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .builtin import PATCHES
from .element import StateFormat, decode, encode, normalize
from .packing import pack4, unpack4

PATCH_VALUE_DTYPE = PATCHES.code_dtype[0]
PATCH_INDEX_DTYPE = torch.int16
# The smallest scale of a block with a nonzero value: the smallest normal float, so its reciprocal
# (2^126) is finite and exact, and every format's smallest positive code times it is > 0.
MIN_SCALE = 2.0**-126
_SMALLEST_SUBNORMAL = 2.0**-149


class Quantized(NamedTuple):
    codes: torch.Tensor
    scales: torch.Tensor
    patch_values: torch.Tensor
    patch_index: torch.Tensor


def n_blocks(numel: int, fmt: StateFormat) -> int:
    return math.ceil(numel / fmt.block_size) if fmt.blockwise else 0


def empty(numel: int, fmt: StateFormat, device: torch.device | str = "cpu") -> Quantized:
    """Uninitialized storage for one state of ``numel`` elements."""
    nb, k = n_blocks(numel, fmt), fmt.patches
    return Quantized(
        torch.empty(fmt.storage_numel(numel), dtype=fmt.storage_dtype, device=device),
        torch.empty(nb, dtype=torch.float32, device=device),
        torch.empty(nb, k, dtype=PATCH_VALUE_DTYPE, device=device),
        torch.empty(nb, k, dtype=PATCH_INDEX_DTYPE, device=device),
    )


def _blocks(x: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    n, b = x.numel(), fmt.block_size
    nb = n_blocks(n, fmt)
    flat = x.reshape(-1).float()
    if nb * b != n:
        flat = torch.nn.functional.pad(flat, (0, nb * b - n))
    return flat.view(nb, b)


def _scale_and_inverse(absmax: torch.Tensor, qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block: the scale (a code decodes to ``code * scale``) and the multiplier that takes the
    block's values to codes (``qmax / absmax``), neither of them 0 for a nonzero block nor inf."""
    scale = absmax / qmax
    nonzero = absmax > 0
    inverse = torch.where(nonzero, qmax / absmax, 0.0)
    tiny = nonzero & (scale < MIN_SCALE)
    if not bool((tiny | torch.isinf(scale * qmax)).any()):  # the usual case
        return scale, inverse
    scale = torch.where(tiny, MIN_SCALE, scale)
    inverse = torch.where(tiny, 1.0 / MIN_SCALE, inverse)
    top = torch.isinf(scale * qmax)
    # only a qmax < 1 (signed or flagged dynamic8) overflows the scale itself: it stops at the largest
    # float, and values past the largest usable map value times it saturate there
    inverse = torch.where(torch.isinf(scale), 1.0 / torch.finfo(torch.float32).max, inverse)
    return torch.where(top, torch.nextafter(scale, torch.zeros_like(scale)), scale), inverse


def _block_scale(blocks: torch.Tensor, fmt: StateFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Per block of finite values: scale and multiplier (``_scale_and_inverse``) of the absmax over
    ``qmax``; where the format's most negative code is smaller than its largest (signed dynamic8),
    of whichever side needs the larger scale, the positive side over ``qmax`` or the negative side
    over ``neg_qmax`` (a tie takes the positive side)."""
    if fmt.neg_qmax == fmt.qmax:
        return _scale_and_inverse(blocks.abs().amax(dim=1), fmt.qmax)
    pos, neg = blocks.amax(dim=1), (-blocks).amax(dim=1)
    scale_p, inverse_p = _scale_and_inverse(torch.where(pos > 0, pos, 0.0), fmt.qmax)
    scale_n, inverse_n = _scale_and_inverse(torch.where(neg > 0, neg, 0.0), fmt.neg_qmax)
    negative = scale_n > scale_p
    return torch.where(negative, scale_n, scale_p), torch.where(negative, inverse_n, inverse_p)


def quantize_into(x: torch.Tensor, out: Quantized, fmt: StateFormat, draws: torch.Tensor | None = None) -> None:
    """Quantize the flat values ``x`` into the preallocated storage ``out``; with ``draws`` (the 16-bit
    draw of each element, int64: ``rounding.state_draws``) codes and patches round stochastically
    (``formats.round_stochastic``; a patch with the draw of the element it holds)."""
    if not fmt.blockwise:
        out.codes.copy_(encode(x.reshape(-1).float(), fmt, draws=draws))
        return
    n = x.numel()
    blocks = _blocks(x, fmt)
    if draws is not None:
        draws = torch.nn.functional.pad(draws.reshape(-1), (0, blocks.numel() - n)).view(blocks.shape)
    finite = torch.isfinite(blocks)
    all_finite = bool(finite.all())  # the usual case skips the non-finite handling below
    idx = []
    if fmt.patches:  # non-finite values rank below every finite magnitude, patches taken below those
        mag = blocks.abs() if all_finite else torch.where(finite, blocks.abs(), -1.0)
    for _ in range(fmt.patches):
        j = torch.argmax(mag, dim=1, keepdim=True)  # first maximal value: lowest offset wins ties
        idx.append(j)
        mag.scatter_(1, j, -2.0)
    if idx:
        index = torch.cat(idx, dim=1)
        # encoded like a bf16 state of the same sign: saturating, and a positive v never 0
        out.patch_values.copy_(encode(blocks.gather(1, index), StateFormat.make(PATCHES.name, 0, 0, fmt.nonneg),
                                      draws=draws.gather(1, index) if draws is not None else None))
        out.patch_index.copy_(index.to(PATCH_INDEX_DTYPE))
        blocks = blocks.scatter(1, index, 0.0)
    if all_finite:
        scale, inverse = _block_scale(blocks, fmt)
        normalized, flagged = normalize(blocks, inverse[:, None], fmt), None
    else:
        finite = torch.isfinite(blocks)
        flagged = ~finite.all(dim=1)
        rest = torch.where(finite, blocks, 0.0)
        scale, inverse = _block_scale(rest, fmt)
        scale_f, inverse_f = _scale_and_inverse(rest.abs().amax(dim=1), fmt.flagged_qmax)
        scale = torch.where(flagged, -scale_f, scale)  # the sign bit marks the block (-0.0 included)
        inverse = torch.where(flagged, inverse_f, inverse)
        normalized = torch.where(finite, normalize(blocks, inverse[:, None], fmt), blocks)
        flagged = flagged[:, None]
    out.scales.copy_(scale)
    if fmt.nonneg:  # x * inverse may underflow to 0; the zero-point rule needs it positive
        normalized = torch.where(blocks > 0, normalized.clamp(min=_SMALLEST_SUBNORMAL), normalized)
    out.codes.copy_(stored_codes(encode(normalized, fmt, flagged, draws).reshape(-1)[:n], fmt))


def stored_codes(codes: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    """Codes one an element as ``fmt`` stores them (a 4-bit format's packed two a byte, any other's as
    they are): the inverse of :func:`unpacked_codes`."""
    return pack4(codes) if fmt.packed else codes


def unpacked_codes(codes: torch.Tensor, numel: int, fmt: StateFormat) -> torch.Tensor:
    """The stored ``codes`` of ``numel`` elements one a ``fmt.code_dtype`` element (a 4-bit format's
    unpacked, any other's as they are)."""
    return unpack4(codes, numel, fmt.code_dtype) if fmt.packed else codes


def invalid_records(scales: torch.Tensor, patch_index: torch.Tensor, fmt: StateFormat) -> str | None:
    """Why per-block records read from outside (a checkpoint) are not ones :func:`quantize_into` writes
    for ``fmt``, or None: a scale that is not finite (its sign bit is the block's flag, either sign is
    one), a patch offset outside ``[0, block_size)`` or twice in one block. Kernels put each patch
    where its offset points, so no record reaches one before this holds; vectorized, one pass each."""
    finite = torch.isfinite(scales)
    if not bool(finite.all()):
        block = int((~finite).nonzero()[0, 0])
        return f"scale of block {block} is {scales[block].item()}, not a finite number"
    if patch_index.numel() == 0:
        return None
    index = patch_index.to(torch.int32)
    outside = (index < 0) | (index >= fmt.block_size)
    if bool(outside.any()):
        block, k = (int(i) for i in outside.nonzero()[0])
        return (f"patch offset {int(index[block, k])} in block {block} is outside the block's "
                f"[0, {fmt.block_size})")
    ordered = index.sort(dim=1).values
    repeated = ordered[:, 1:] == ordered[:, :-1]
    if bool(repeated.any()):
        block, k = (int(i) for i in repeated.nonzero()[0])
        return f"patch offset {int(ordered[block, k])} is in block {block} twice"
    return None


def decode_scaled(codes: torch.Tensor, scales: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    """fp32 values of ``codes`` under their blocks' ``scales`` (broadcasting against ``codes``):
    decode times the scale's magnitude, and in a flagged block (scale sign bit set) the special codes
    as +inf, -inf or NaN."""
    flagged = torch.signbit(scales)
    if not bool(flagged.any()):
        return decode(codes, fmt) * scales
    values = decode(codes, fmt, flagged)
    return torch.where(torch.isfinite(values), values * scales.abs(), values)


def dequantize(q: Quantized, fmt: StateFormat, dtype: torch.dtype = torch.float32,
               numel: int | None = None) -> torch.Tensor:
    """The flat values held by ``q``, as a new tensor of ``dtype``; ``numel``: their count, which a 4-bit
    format's codes (two a byte) do not say."""
    if not fmt.blockwise:
        return decode(q.codes, fmt).to(dtype)
    if fmt.packed and numel is None:
        raise ValueError(f"dequantize of a {fmt.name} state needs numel: its codes, two a byte, do not say the count")
    n = q.codes.numel() if numel is None else numel
    nb, b = q.scales.numel(), fmt.block_size
    codes = unpacked_codes(q.codes, n, fmt)
    if nb * b != n:
        codes = torch.nn.functional.pad(codes.view(torch.uint8), (0, nb * b - n)).view(codes.dtype)
    values = decode_scaled(codes.view(nb, b), q.scales[:, None], fmt)
    if fmt.patches:
        values.scatter_(1, q.patch_index.long(), q.patch_values.float())
    return values.reshape(-1)[:n].to(dtype)


def quantize(x: torch.Tensor, fmt: StateFormat) -> Quantized:
    """Quantize ``x`` into new storage."""
    out = empty(x.numel(), fmt, x.device)
    quantize_into(x, out, fmt)
    return out


def full(numel: int, value: float, fmt: StateFormat, device: torch.device | str = "cpu") -> Quantized:
    """Storage holding ``value`` everywhere, built from one block so no full-size fp32 tensor exists."""
    if not fmt.blockwise:
        return Quantized(
            encode(torch.full((numel,), value, device=device), fmt),
            *empty(0, fmt, device)[1:],
        )
    one = quantize(torch.full((min(numel, fmt.block_size),), value, device=device), fmt)
    nb = n_blocks(numel, fmt)
    size, width = fmt.storage_numel(numel), one.codes.numel()  # a block of a 4-bit format: whole bytes
    codes = torch.empty(size, dtype=one.codes.dtype, device=device)
    whole = size // max(width, 1)
    codes[: whole * width].view(whole, -1).copy_(one.codes)  # one pass, no repeat-then-clone
    codes[whole * width:].copy_(one.codes[: size - whole * width])
    if fmt.packed and numel % 2:
        codes[-1:] &= 0xF  # the unused last nibble is 0, as quantize leaves it
    return Quantized(
        codes,
        one.scales.repeat(nb),
        one.patch_values.repeat(nb, 1),
        one.patch_index.repeat(nb, 1),
    )
