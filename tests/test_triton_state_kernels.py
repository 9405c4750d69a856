"""The standalone Triton quantize/dequantize kernels against the reference (``blockquant``), bit for bit,
run on CPU tensors under the Triton interpreter, on data built to hit every rounding corner."""

from __future__ import annotations

import os

import pytest
import torch

from lowbit_compile.formats import StateFormat, blockquant, rounding

from .helpers import CORNER_BLOCK, CORNER_N, KERNEL_FORMATS, bits, corner_values, dynamic8_probes

triton_backend = pytest.importorskip("lowbit_compile.kernels.triton_backend")
import triton  # noqa: E402  (after the importorskip: triton comes with the test extra)
import triton.language as tl  # noqa: E402

from lowbit_compile.kernels import triton_lib as lb  # noqa: E402

# conftest.py sets TRITON_INTERPRET=1 before triton is imported; without it CPU tensors cannot run
assert os.environ.get("TRITON_INTERPRET") == "1"

BLOCK, N = CORNER_BLOCK, CORNER_N  # the layout corner_values builds


FORMATS = [(name, nonneg) for name in KERNEL_FORMATS for nonneg in (False, True)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("name", "nonneg"), FORMATS)
def test_quantize_and_dequantize_kernels_match_reference_bit_for_bit(name, nonneg, dtype):
    fmt = StateFormat.make(name, BLOCK, 2, nonneg)
    x = corner_values(fmt, dtype)
    exact = torch.tensor(fmt.qmax).to(dtype).item() == fmt.qmax  # a qmax that is no bf16 (none now)
    if fmt.blockwise and exact:  # the tie block really is at inverse scale 1
        assert blockquant.quantize(x[3 * BLOCK: 4 * BLOCK], fmt).scales.item() * fmt.qmax == fmt.qmax
    ref = blockquant.quantize(x, fmt)
    ours = blockquant.empty(N, fmt)
    triton_backend.quantize_into(x, ours, fmt)
    for part, a, b in zip(blockquant.Quantized._fields, ref, ours):
        assert torch.equal(bits(a), bits(b)), part
    for out_dtype in (torch.float32, dtype):
        expected = blockquant.dequantize(ref, fmt, out_dtype, N)
        assert torch.equal(bits(triton_backend.dequantize(ref, fmt, out_dtype, N)), bits(expected))


@pytest.mark.slow
@pytest.mark.parametrize("nonneg", [False, True])
def test_dynamic8_kernel_encode_matches_reference_near_every_threshold(nonneg):
    """The Triton arithmetic encode on every fp32 within 64 ulps of each threshold and map value:
    blocks of 32767 such values and a 1 (absmax 1, so the kernel encodes the values themselves). The
    encode is elementwise; the largest block keeps the interpreter's programs few (one per block)."""
    block = 32768
    fmt = StateFormat.make("dynamic8", block, 0, nonneg)
    x = dynamic8_probes(nonneg, seed=2)
    x = x[torch.isfinite(x) & (x.abs() <= 1)]
    x = torch.nn.functional.pad(x, (0, -len(x) % (block - 1))).view(-1, block - 1)
    x = torch.cat([torch.ones(len(x), 1), x], dim=1).reshape(-1)
    ref = blockquant.quantize(x, fmt)
    assert torch.all(ref.scales == 1.0)
    ours = blockquant.empty(len(x), fmt)
    triton_backend.quantize_into(x, ours, fmt)
    assert torch.equal(ours.codes, ref.codes)
    assert torch.equal(triton_backend.dequantize(ref, fmt), blockquant.dequantize(ref, fmt))


@pytest.mark.parametrize("outliers", [0, 3])
def test_patch_count_is_a_parameter_of_the_kernel(outliers):
    fmt = StateFormat.make("int8", BLOCK, outliers, False)
    x = corner_values(fmt, torch.float32)
    ref = blockquant.quantize(x, fmt)
    ours = blockquant.empty(N, fmt)
    triton_backend.quantize_into(x, ours, fmt)
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(ref, ours))
    assert torch.equal(triton_backend.dequantize(ref, fmt), blockquant.dequantize(ref, fmt))



@triton.jit
def _draws(out_ptr, seed_ptr, first, STREAM: tl.constexpr, N: tl.constexpr):
    offsets = first + tl.arange(0, N).to(tl.int64)
    tl.store(out_ptr + tl.arange(0, N), lb.state_draws(lb.load_scalar(seed_ptr, lb.F32), offsets, STREAM))


def test_the_triton_kernel_draws_the_reference_draws_at_any_index():
    """``triton_lib.state_draws`` at element indices past 2^31 and 2^32 as at 0 (``rounding.state_draws``)."""
    for first in (0, 2**31 - 8, 2**32 + 40, 2**35 + 3):
        out = torch.zeros(64, dtype=torch.int32)
        _draws[(1,)](out, torch.tensor(9.0), first, STREAM=2, N=64)
        assert torch.equal(out.long(), rounding.state_draws(9, 2, 64, first=first)), first
