"""User options of ``lowbit_compile``, validated once, and the per-parameter choice of state formats."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from .kernels.backends import resolve
from .kernels.formats import FORMAT_NAMES, StateFormat

BACKENDS = ("auto", "triton", "inductor", "reference")

# States known never to be negative. They get unsigned codes and a quantizer that never stores a
# positive value as zero (see StateFormat). A state missing here is treated as signed, which is
# always correct, only coarser.
NONNEG_STATES = frozenset({"exp_avg_sq", "max_exp_avg_sq"})

DEFAULT_FMT = "int8"
DEFAULT_BLOCK_SIZE = 2048
DEFAULT_OUTLIERS = 2
DEFAULT_MIN_8BIT_SIZE = 4096


@dataclass(frozen=True)
class Config:
    """What ``lowbit_compile(opt, ...)`` was asked for."""

    fmt: str | tuple[tuple[str, str], ...]
    block_size: int
    outliers: int
    min_8bit_size: int
    backend: str

    @staticmethod
    def make(fmt: str | Mapping[str, str], block_size: int, outliers: int, min_8bit_size: int,
             backend: str) -> Config:
        """Validate every option up front, naming the bad one and the fix."""
        if isinstance(fmt, Mapping):
            for key, value in fmt.items():
                _check_fmt(value, f"fmt[{key!r}]")
            fmt_key: str | tuple = tuple(sorted(fmt.items()))
        else:
            _check_fmt(fmt, "fmt")
            fmt_key = fmt
        if not _is_int(block_size) or block_size < 1 or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a positive power of two (e.g. 256 or 2048), got {block_size!r}")
        if block_size > 32768:
            raise ValueError(f"block_size must be at most 32768 (patch offsets are int16), got {block_size}")
        if not _is_int(outliers) or not 0 <= outliers <= min(block_size, 64):
            raise ValueError(f"outliers must be an int in [0, min(block_size, 64)], got {outliers!r}")
        if not _is_int(min_8bit_size) or min_8bit_size < 0:
            raise ValueError(f"min_8bit_size must be a non-negative int, got {min_8bit_size!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        resolve(backend, "cpu")  # an unavailable backend fails here, before anything is converted
        return Config(fmt_key, block_size, outliers, min_8bit_size, backend)

    def format_name(self, state_key: str) -> str:
        if isinstance(self.fmt, str):
            return self.fmt
        return dict(self.fmt).get(state_key, DEFAULT_FMT)

    def formats_for(self, param: torch.Tensor, per_element: tuple[str, ...]) -> tuple[tuple[str, StateFormat], ...]:
        """The format of each per-element state of ``param``; tensors under ``min_8bit_size``
        elements (counted on the full, unsharded shape) keep the stock fp32 state."""
        small = param.numel() < self.min_8bit_size
        out = []
        for key in per_element:
            name = "fp32" if small else self.format_name(key)
            out.append((key, StateFormat.make(name, self.block_size, self.outliers, key in NONNEG_STATES)))
        return tuple(out)


def _check_fmt(value: object, what: str) -> None:
    if value not in FORMAT_NAMES:
        raise ValueError(f"{what} must be one of {FORMAT_NAMES}, got {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
