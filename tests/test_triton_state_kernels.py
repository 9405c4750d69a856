"""The standalone Triton quantize/dequantize kernels against the reference (``blockquant``), bit for bit,
run on CPU tensors under the Triton interpreter, on data built to hit every rounding corner."""

from __future__ import annotations

import os

import pytest
import torch

from lowbit_compile.kernels import blockquant
from lowbit_compile.kernels.formats import FORMAT_NAMES, StateFormat, dynamic_midpoints

triton_backend = pytest.importorskip("lowbit_compile.kernels.triton_backend")
# conftest.py sets TRITON_INTERPRET=1 before triton is imported; without it CPU tensors cannot run
assert os.environ.get("TRITON_INTERPRET") == "1"

BLOCK = 64
N = BLOCK * 6 + 13  # a partial last block


def bits(t: torch.Tensor) -> torch.Tensor:
    """The bit patterns of ``t``, so -0.0 vs 0.0 and NaN payloads count as differences."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def corner_values(fmt: StateFormat, dtype: torch.dtype) -> torch.Tensor:
    """Random values over many binades, then one block per rounding corner of ``fmt``."""
    x = torch.randn(N, dtype=torch.float64) * torch.exp(torch.randn(N, dtype=torch.float64) * 3)
    b = [slice(i * BLOCK, (i + 1) * BLOCK) for i in range(6)]
    x[b[1]] = 0.0  # an all-zero block: scale 0, patches at offsets 0 and 1
    x[b[2]] = torch.linspace(-1, 1, BLOCK, dtype=torch.float64)
    x[2 * BLOCK + 5] = x[2 * BLOCK + 9] = x[2 * BLOCK + 30] = -7.0  # tied magnitudes: lowest offsets patched
    x[2 * BLOCK + 40] = 7.0
    # block 3: the non-patch absmax equals qmax, so inverse == 1 and codes see the values themselves
    qmax = fmt.qmax if fmt.blockwise else 1.0
    grid = _ties(fmt)
    x[b[3]] = grid[torch.arange(BLOCK) % grid.numel()]
    x[3 * BLOCK + 1] = x[3 * BLOCK + 2] = 1e6  # two patches
    x[3 * BLOCK + 3] = qmax
    # block 4: a huge patch over tiny values (the zero-point rule for nonneg states)
    x[b[4]] = torch.rand(BLOCK, dtype=torch.float64) * 1e-6
    x[4 * BLOCK] = 1e3
    if fmt.nonneg:
        x = x.abs()
    else:
        x[3 * BLOCK + 4: 4 * BLOCK: 3] *= -1
        x[3 * BLOCK + 6] = -0.0
    return x.to(dtype)


def _ties(fmt: StateFormat) -> torch.Tensor:
    """Values (at inverse scale 1) exactly halfway between two codes, and ones just past a binade."""
    if fmt.name == "int8":
        return torch.arange(0, 60, dtype=torch.float64) + 0.5
    if fmt.name == "dynamic8":
        return dynamic_midpoints(fmt.nonneg).double()[::4]
    if fmt.name.startswith("fp8"):
        m = 3 if fmt.name == "fp8_e4m3" else 2
        e = torch.arange(-8, 8, dtype=torch.float64)
        halfway = (1 + 2.0**-(m + 1)) * 2.0**e  # ties to even (down)
        carry = (2 - 2.0**-(m + 2)) * 2.0**e  # rounds up into the next binade
        sub = 2.0 ** (-9 if m == 3 else -16) * torch.tensor([0.5, 1.5, 2.5], dtype=torch.float64)
        return torch.cat([halfway, carry, sub])
    return torch.tensor([1 + 2.0**-8, 1 + 3 * 2.0**-8, 1e-40, 3e-39, 2.0**-133], dtype=torch.float64)


FORMATS = [(name, nonneg) for name in FORMAT_NAMES if name != "fp32" for nonneg in (False, True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("name", "nonneg"), FORMATS)
def test_quantize_and_dequantize_kernels_match_reference_bit_for_bit(name, nonneg, dtype):
    fmt = StateFormat.make(name, BLOCK, 2, nonneg)
    x = corner_values(fmt, dtype)
    exact = torch.tensor(fmt.qmax).to(dtype).item() == fmt.qmax  # signed dynamic8's 0.99297 is no bf16
    if fmt.blockwise and exact:  # the tie block really is at inverse scale 1
        assert blockquant.quantize(x[3 * BLOCK: 4 * BLOCK], fmt).scales.item() * fmt.qmax == fmt.qmax
    ref = blockquant.quantize(x, fmt)
    ours = blockquant.empty(N, fmt)
    triton_backend.quantize_into(x, ours, fmt)
    for part, a, b in zip(blockquant.Quantized._fields, ref, ours):
        assert torch.equal(bits(a), bits(b)), part
    for out_dtype in (torch.float32, dtype):
        expected = blockquant.dequantize(ref, fmt, out_dtype)
        assert torch.equal(bits(triton_backend.dequantize(ref, fmt, out_dtype)), bits(expected))


@pytest.mark.parametrize("outliers", [0, 3])
def test_patch_count_is_a_parameter_of_the_kernel(outliers):
    fmt = StateFormat.make("int8", BLOCK, outliers, False)
    x = corner_values(fmt, torch.float32)
    ref = blockquant.quantize(x, fmt)
    ours = blockquant.empty(N, fmt)
    triton_backend.quantize_into(x, ours, fmt)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(ref, ours))
    assert torch.equal(triton_backend.dequantize(ref, fmt), blockquant.dequantize(ref, fmt))
