"""Stochastic rounding of quantized states (``rounding="stochastic"``): the option's names and the random
bits each state's encode draws, from the same counter-based hash as the lossy master residual
(``residual.random_bits``), so every backend draws the same bits.

A state rounded stochastically picks, per element, between the two codes around its normalized value:
the one of larger magnitude (the outer) where ``(u + 0.5) / 256 < p``, ``p`` the value's fractional
position from the inner code to the outer one and ``u`` the element's 8-bit draw (``formats.round_stochastic``).
So the outer code is taken with probability ``round(256 p) / 256`` (an exact tie of ``256 p`` rounds
down): unbiased to within 1/512 of the gap between the two codes, and zero-mean over ``p``.

The draws come from ``hash32(x ^ key)`` (``residual.hash32``, lowbias32) with the state's key ``key =
hash32(counter ^ stream << 24)``: ``counter`` is the parameter's ``rounding_seed``, a scalar state that
advances by one each step (modulo ``residual.SEED_PERIOD`` = 2**24, so it fills the low 24 bits), and
``stream`` (1..255) tells the parameter's states apart, so ``exp_avg`` and ``exp_avg_sq`` draw
independent bits. The master residual's counter has stream 0. An 8-bit code's element ``i`` draws byte
``i % 4`` (little-endian) of the word ``hash32((i // 4) ^ 2**31 ^ key)``: one hash serves four elements
(the 2**31 keeps these words apart from the per-element ones). A bf16 value (a bf16 state, or a patch)
needs more than 8 bits: it draws the low 16 bits of ``hash32(i ^ key)``, the element's own word.
"""

from __future__ import annotations

import torch

from .residual import MASK32, SEED_PERIOD, hash32, random_bits

ROUNDINGS = ("nearest", "stochastic")
SEED = "rounding_seed"  # the per-parameter step counter of the state, saved with the optimizer state
MAX_STREAMS = 255  # streams 1..255 fill the 8 bits above the counter's 24
WORDS = 1 << 31  # xor-ed into the word index of the 8-bit draws (apart from the elements' own words)


def stream_seed(seed: float, stream: int) -> int:
    """The 32-bit key of one state's bits at counter ``seed``: the counter in the low 24 bits, the stream above."""
    if not 1 <= stream <= MAX_STREAMS:
        raise ValueError(f"a stochastically rounded state's stream must be in [1, {MAX_STREAMS}], got {stream}")
    return (int(seed) % SEED_PERIOD) | (stream << 24)


def state_draws(seed: float, stream: int, numel: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The 8-bit draw (int64 in [0, 256)) of each of a state's ``numel`` codes at counter ``seed``."""
    key = hash32(torch.tensor(stream_seed(seed, stream), dtype=torch.int64)).to(device)
    words = hash32((torch.arange((numel + 3) // 4, dtype=torch.int64, device=device) ^ WORDS ^ key) & MASK32)
    shifts = torch.tensor([0, 8, 16, 24], dtype=torch.int64, device=device)
    return ((words[:, None] >> shifts) & 0xFF).reshape(-1)[:numel]


def state_bits(seed: float, stream: int, numel: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """The random bits of each of a state's ``numel`` elements at counter ``seed`` (int64): the low 32
    the element's own word ``hash32(i ^ key)`` (a bf16 value draws its low 16), bits 32..39 its 8-bit
    draw (:func:`state_draws`; an 8-bit code draws these)."""
    return random_bits(stream_seed(seed, stream), numel, device) | (state_draws(seed, stream, numel, device) << 32)
