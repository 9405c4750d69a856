"""Two 4-bit codes a byte: element ``2i`` in the low nibble of byte ``i``, ``2i + 1`` in the high one, so a
block of an even number of elements starts on a byte (every block size is a power of two >= 2 for a 4-bit
format) and an odd count leaves the last high nibble 0. Unpacked, a code is the integer its format's
``code_dtype`` names: a signed state's two's complement -8..7 (int8), a non-negative one's 0..15 (uint8).
"""

from __future__ import annotations

import torch


def packed_numel(numel: int) -> int:
    """Bytes holding ``numel`` 4-bit codes."""
    return (numel + 1) // 2


def pack4(codes: torch.Tensor) -> torch.Tensor:
    """Flat 4-bit codes (int8 -8..7 or uint8 0..15, one a byte) packed two a byte, as uint8."""
    flat = codes.reshape(-1).view(torch.uint8) & 0xF
    if flat.numel() % 2:
        flat = torch.nn.functional.pad(flat, (0, 1))
    pairs = flat.view(-1, 2)
    return pairs[:, 0] | (pairs[:, 1] << 4)


def unpack4(packed: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The first ``numel`` codes held by ``packed`` (uint8), one a byte, as ``dtype``: int8 sign-extends
    each nibble, uint8 keeps it."""
    nibbles = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(-1)[:numel]
    if dtype == torch.int8:
        return ((nibbles ^ 8).to(torch.int8) - 8).to(torch.int8)
    return nibbles
