"""Stochastic rounding of quantized states (``rounding="stochastic"``): the option's names and the random
bits each state's encode draws, from the same counter-based hash as the lossy master residual
(``residual.random_bits``), so every backend draws the same bits.

A state rounded stochastically picks, per element, between the two codes adjacent to its normalized
value with probabilities proportional to proximity (``formats.encode``). Its bits are
``hash32(index ^ hash32(counter ^ stream << 24))``: ``counter`` is the parameter's ``rounding_seed``,
a scalar state that advances by one each step (modulo ``residual.SEED_PERIOD`` = 2**24, so it fills
the low 24 bits), and ``stream`` (1..255) tells the parameter's states apart, so ``exp_avg`` and
``exp_avg_sq`` draw independent bits. The master residual's counter has stream 0.
"""

from __future__ import annotations

import torch

from .residual import SEED_PERIOD, random_bits

ROUNDINGS = ("nearest", "stochastic")
SEED = "rounding_seed"  # the per-parameter step counter of the state, saved with the optimizer state
MAX_STREAMS = 255  # streams 1..255 fill the 8 bits above the counter's 24


def stream_seed(seed: float, stream: int) -> int:
    """The 32-bit key of one state's bits at counter ``seed``: the counter in the low 24 bits, the stream above."""
    if not 1 <= stream <= MAX_STREAMS:
        raise ValueError(f"a stochastically rounded state's stream must be in [1, {MAX_STREAMS}], got {stream}")
    return (int(seed) % SEED_PERIOD) | (stream << 24)


def state_bits(seed: float, stream: int, numel: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """32 random bits (int64) for each of a state's ``numel`` elements at counter ``seed``."""
    return random_bits(stream_seed(seed, stream), numel, device)
