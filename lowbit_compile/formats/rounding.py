"""Stochastic rounding of quantized states: the option's names, which states round stochastically by
default, and the 16-bit draw each element rounds with, from the same counter-based hash as the lossy
master residual (``residual.hash32``), so every backend draws the same bits.

A state rounded stochastically picks, per element, between the two codes around its normalized value
``y``: the one of larger magnitude (the outer, value ``w_out``) where ``fl(t * gap) < d``, ``gap =
|w_out - w_in|`` the distance between the two codes, ``d = |y - w_in|`` the value's distance from the
inner one (both exact in fp32) and ``t = (u + 0.5) / 2**16`` from the element's 16-bit draw ``u``
(``formats.round_stochastic``). So the outer code is taken with probability ``round(2**16 p) / 2**16``,
``p = d / gap`` (a tie of ``2**16 p`` rounds down; where ``gap`` is not a power of two the product's one
fp32 rounding moves the threshold by at most 2**-24 of itself): ``E[decode] = y`` to within 2**-17 of
the gap, an error of mean zero over ``p``. A bf16 value (a bf16 state, a patch) adds ``u`` below its 16
bits and truncates: exactly unbiased.

The draws come from ``hash32(word ^ key)`` (``residual.hash32``, lowbias32) with the state's key ``key =
hash32(counter ^ stream << 24)``: ``counter`` is the parameter's ``rounding_seed``, a scalar state that
advances by one each step (modulo ``residual.SEED_PERIOD`` = 2**24, so it fills the low 24 bits), and
``stream`` (1..255) tells the parameter's states apart, so ``exp_avg`` and ``exp_avg_sq`` draw
independent bits. The master residual's counter has stream 0. One hash serves two elements: element ``i``
(its index in the tensor) draws the low 16 bits of ``hash32((i // 2) ^ key)`` where ``i`` is even, the high
16 bits where it is odd.
"""

from __future__ import annotations

import torch

from .residual import MASK32, SEED_PERIOD, hash32

ROUNDINGS = ("auto", "nearest", "stochastic")
DEFAULT_ROUNDING = "auto"  # stochastic for the non-negative states of the 8-bit formats, to nearest for the rest
SEED = "rounding_seed"  # the per-parameter step counter of the state, saved with the optimizer state
MAX_STREAMS = 255  # streams 1..255 fill the 8 bits above the counter's 24
DRAW_BITS = 16  # random bits per rounding: two draws per 32-bit hash


def stream_seed(seed: float, stream: int) -> int:
    """The 32-bit input of one state's key at counter ``seed``: the counter in the low 24 bits, the stream above."""
    if not 1 <= stream <= MAX_STREAMS:
        raise ValueError(f"a stochastically rounded state's stream must be in [1, {MAX_STREAMS}], got {stream}")
    return (int(seed) % SEED_PERIOD) | (stream << 24)


def state_draws(seed: float, stream: int, numel: int, device: torch.device | str = "cpu",
                first: int = 0) -> torch.Tensor:
    """The 16-bit draw (int64 in ``[0, 2**16)``) of each of a state's elements ``first .. first + numel - 1``
    at counter ``seed``."""
    key = hash32(torch.tensor(stream_seed(seed, stream), dtype=torch.int64)).to(device)
    words = torch.arange(first // 2, (first + numel + 1) // 2, dtype=torch.int64, device=device)
    words = hash32((words ^ key) & MASK32)
    halves = torch.stack([words & 0xFFFF, words >> 16], dim=1)  # per word: the even element's, the odd one's
    return halves.reshape(-1)[first % 2:first % 2 + numel]


def threshold(draws: torch.Tensor) -> torch.Tensor:
    """``t = (u + 0.5) / 2**16`` of 16-bit draws ``u``, exact in fp32: the fraction of a code gap below which
    an element's distance from its inner code keeps the inner code."""
    return (draws.to(torch.float32) + 0.5) * 2.0**-DRAW_BITS
