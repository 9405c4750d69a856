"""Block quantization with 16-bit outlier patches, in plain torch: the reference every kernel matches.

One state of ``n`` elements is stored as
  * ``codes``          (n,)            one code per element, in the format's code dtype;
  * ``scales``         (n_blocks,)     fp32: the absmax of the block's non-patch values / qmax;
  * ``patch_values``   (n_blocks, K)   bf16: the K largest-magnitude values of the block;
  * ``patch_index``    (n_blocks, K)   int16: their offsets inside the block.
Patches are taken out before the absmax, so one giant value in a block no longer flattens every
other value of that block to code 0. Ties in magnitude go to the lowest offset. A partial last
block is padded with zeros for the computation only; a patch there may point into the padding,
and decoding ignores it.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .formats import StateFormat, decode, encode

PATCH_VALUE_DTYPE = torch.bfloat16
PATCH_INDEX_DTYPE = torch.int16


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
        torch.empty(numel, dtype=fmt.code_dtype, device=device),
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


def quantize_into(x: torch.Tensor, out: Quantized, fmt: StateFormat) -> None:
    """Quantize the flat values ``x`` into the preallocated storage ``out``."""
    if not fmt.blockwise:
        out.codes.copy_(encode(x.reshape(-1).float(), fmt))
        return
    n = x.numel()
    blocks = _blocks(x, fmt)
    mag = blocks.abs()
    idx = []
    for _ in range(fmt.patches):
        j = torch.argmax(mag, dim=1, keepdim=True)  # first maximal value: lowest offset wins ties
        idx.append(j)
        mag.scatter_(1, j, -1.0)
    if idx:
        index = torch.cat(idx, dim=1)
        out.patch_values.copy_(blocks.gather(1, index).to(PATCH_VALUE_DTYPE))
        out.patch_index.copy_(index.to(PATCH_INDEX_DTYPE))
        blocks = blocks.scatter(1, index, 0.0)
    absmax = blocks.abs().amax(dim=1)
    inv = torch.where(absmax > 0, fmt.qmax / absmax, 0.0)
    out.scales.copy_(absmax / fmt.qmax)
    codes = encode(blocks * inv[:, None], fmt).reshape(-1)
    out.codes.copy_(codes[:n])


def dequantize(q: Quantized, fmt: StateFormat, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The flat values held by ``q``, as a new tensor of ``dtype``."""
    n = q.codes.numel()
    if not fmt.blockwise:
        return decode(q.codes, fmt).to(dtype)
    nb, b = q.scales.numel(), fmt.block_size
    codes = q.codes
    if nb * b != n:
        codes = torch.nn.functional.pad(codes.view(torch.uint8), (0, nb * b - n)).view(codes.dtype)
    values = decode(codes.view(nb, b), fmt) * q.scales[:, None]
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
    codes = torch.empty(numel, dtype=one.codes.dtype, device=device)
    whole = numel // max(one.codes.numel(), 1)
    codes[: whole * one.codes.numel()].view(whole, -1).copy_(one.codes)  # one pass, no repeat-then-clone
    codes[whole * one.codes.numel():].copy_(one.codes[: numel - whole * one.codes.numel()])
    return Quantized(
        codes,
        one.scales.repeat(nb),
        one.patch_values.repeat(nb, 1),
        one.patch_index.repeat(nb, 1),
    )
