"""The two graph-level ops the quantize-states pass inserts: ``lowbit::dequantize`` and ``lowbit::quantize_``.

They are registered with ``torch.library`` (with fake implementations), so a rewritten graph runs
eagerly, traces under ``make_fx``/``torch.compile`` and shows up by name in the profiler. Their
eager implementations are the reference in ``blockquant.py``.
"""

from __future__ import annotations

import torch

from . import blockquant
from .formats import StateFormat

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@torch.library.custom_op("lowbit::dequantize", mutates_args=())
def dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    patch_values: torch.Tensor,
    patch_index: torch.Tensor,
    fmt: str,
    dtype: str,
) -> torch.Tensor:
    """Decode one flat state to ``dtype`` (the dtype the stock optimizer keeps that state in)."""
    q = blockquant.Quantized(codes, scales, patch_values, patch_index)
    return blockquant.dequantize(q, StateFormat.from_tag(fmt), DTYPES[dtype])


@dequantize.register_fake
def _(codes, scales, patch_values, patch_index, fmt, dtype):
    return codes.new_empty(codes.shape, dtype=DTYPES[dtype])


@torch.library.custom_op(
    "lowbit::quantize_", mutates_args=("codes", "scales", "patch_values", "patch_index")
)
def quantize_(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    patch_values: torch.Tensor,
    patch_index: torch.Tensor,
    fmt: str,
) -> None:
    """Encode the new value ``x`` of one flat state into its storage, in place."""
    blockquant.quantize_into(
        x, blockquant.Quantized(codes, scales, patch_values, patch_index), StateFormat.from_tag(fmt)
    )


@quantize_.register_fake
def _(x, codes, scales, patch_values, patch_index, fmt):
    return None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
