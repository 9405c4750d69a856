"""The graph-level ops of the rewrite passes: ``lowbit::dequantize``, ``lowbit::quantize_`` and
``lowbit::quantize_stochastic_`` (quantize-states),
``lowbit::master_read`` and ``lowbit::master_write_`` (master weights).

They are registered with ``torch.library`` (with fake implementations), so a rewritten graph runs
eagerly, traces under ``make_fx``/``torch.compile`` and shows up by name in the profiler. Their
eager implementations are the references in ``blockquant.py`` and ``residual.py``.
"""

from __future__ import annotations

import torch

from ..formats import StateFormat, blockquant, rounding
from ..formats import residual as residual_ref

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@torch.library.custom_op("lowbit::dequantize", mutates_args=())
def dequantize(
    codes: torch.Tensor,
    scales: torch.Tensor,
    patch_values: torch.Tensor,
    patch_index: torch.Tensor,
    fmt: str,
    dtype: str,
    like: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode one flat state to ``dtype`` (the dtype the stock optimizer keeps that state in); a 4-bit
    format's codes, two a byte, do not say the count: ``like`` (the param) has it."""
    q = blockquant.Quantized(codes, scales, patch_values, patch_index)
    return blockquant.dequantize(q, StateFormat.from_tag(fmt), DTYPES[dtype], None if like is None else like.numel())


@dequantize.register_fake
def _(codes, scales, patch_values, patch_index, fmt, dtype, like=None):
    return codes.new_empty(codes.shape if like is None else (like.numel(),), dtype=DTYPES[dtype])


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


@torch.library.custom_op(
    "lowbit::quantize_stochastic_", mutates_args=("codes", "scales", "patch_values", "patch_index")
)
def quantize_stochastic_(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    patch_values: torch.Tensor,
    patch_index: torch.Tensor,
    seed: torch.Tensor,
    stream: int,
    fmt: str,
) -> None:
    """``quantize_`` rounding stochastically, with the draws of counter ``seed`` in ``stream``
    (``formats/rounding.py``)."""
    draws = rounding.state_draws(float(seed), stream, x.numel(), x.device)
    blockquant.quantize_into(
        x, blockquant.Quantized(codes, scales, patch_values, patch_index), StateFormat.from_tag(fmt), draws
    )


@quantize_stochastic_.register_fake
def _(x, codes, scales, patch_values, patch_index, seed, stream, fmt):
    return None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# The param's own write-back, for 16-bit params with fp32 master weights (passes/master_weights.py);
# the eager implementations are the reference in residual.py.
@torch.library.custom_op("lowbit::master_read", mutates_args=())
def master_read(param: torch.Tensor, residual: torch.Tensor, ties: torch.Tensor | None, fmt: str) -> torch.Tensor:
    """The flat fp32 master of a flat 16-bit param and its residual."""
    return residual_ref.read(param, residual, ties, residual_ref.MasterFormat.from_tag(fmt))


@master_read.register_fake
def _(param, residual, ties, fmt):
    return param.new_empty(param.shape, dtype=torch.float32)


@torch.library.custom_op("lowbit::master_write_", mutates_args=("param", "residual", "ties"))
def master_write_(x: torch.Tensor, param: torch.Tensor, residual: torch.Tensor, ties: torch.Tensor | None,
                  seed: torch.Tensor | None, fmt: str) -> None:
    """Store the new fp32 master ``x`` as the param's round to nearest even and the residual it loses."""
    residual_ref.write(x, param, residual, ties, seed, residual_ref.MasterFormat.from_tag(fmt))


@master_write_.register_fake
def _(x, param, residual, ties, seed, fmt):
    return None
