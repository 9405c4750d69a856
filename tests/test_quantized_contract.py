"""The contract of quantized formats on the Triton kernels (docs/numerics.md, "The GPU kernels"), over the whole float
range: zeros, subnormals, the largest finite values, infinities and NaN, with hypothesis; and which
kernels may take it (8-bit states) and which stay bit for bit (fp32 and bf16 states)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from bench.quantized_contract import assert_codes_within_one_step, assert_params_within_bound, code_rank
from lowbit_compile import lowbit_compile
from lowbit_compile.formats import StateFormat, blockquant

from .graphs import body
from .helpers import BLOCKWISE

triton_backend = pytest.importorskip("lowbit_compile.kernels.triton_backend")
assert os.environ.get("TRITON_INTERPRET") == "1"  # set by conftest.py before triton is imported

from lowbit_compile.kernels.lowering import Target  # noqa: E402
from lowbit_compile.kernels.triton_printer import emit_kernel, quantize_graph  # noqa: E402

EIGHT_BIT = BLOCKWISE
BLOCK = 64
# no shrinking: each example runs interpreted kernels, and the failing example is printed as found
SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow],
                    phases=[Phase.explicit, Phase.reuse, Phase.generate])

# any float32 (NaN, infinities, subnormals, zeros, the extremes), or a typical value: blocks mix them
floats = st.one_of(st.floats(width=32), st.floats(-4.0, 4.0, width=32), st.sampled_from([0.0, -0.0, 1e-45, 3e38]))


def values(n: int) -> st.SearchStrategy[torch.Tensor]:
    return st.lists(floats, min_size=n, max_size=n).map(lambda xs: torch.tensor(xs, dtype=torch.float32))


@pytest.mark.slow
@SETTINGS
@given(x=values(2 * BLOCK + 5), name=st.sampled_from(EIGHT_BIT), nonneg=st.booleans(),
       patches=st.sampled_from([0, 2]))
def test_the_quantize_kernel_keeps_the_contract_over_the_whole_float_range(x, name, nonneg, patches):
    """Codes within one step of ``blockquant.quantize``'s, the same flagged blocks, scales and patches,
    every inf and NaN in its element; twice the same bits (deterministic)."""
    if nonneg:
        x = x.abs()
    fmt = StateFormat.make(name, BLOCK, patches, nonneg)
    ref = blockquant.quantize(x, fmt)
    runs = []
    for _ in range(2):
        ours = blockquant.empty(x.numel(), fmt)
        triton_backend.quantize_into(x, ours, fmt)
        runs.append(ours)
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(*runs) if a.dtype != torch.int16)
    assert_codes_within_one_step(ref, runs[0], fmt, what=(name, nonneg, patches))
    decoded, expected = (blockquant.dequantize(q, fmt, numel=x.numel()) for q in (runs[0], ref))
    assert torch.equal(decoded.isnan(), expected.isnan())
    assert torch.equal(decoded[decoded.isinf()], expected[decoded.isinf()])


@pytest.mark.slow
@settings(SETTINGS, max_examples=12)
@given(param=values(BLOCK + 3), grad=values(BLOCK + 3), name=st.sampled_from(EIGHT_BIT),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), rounding=st.sampled_from(["nearest", "stochastic"]))
def test_a_fused_step_keeps_the_contract_over_the_whole_float_range(param, grad, name, dtype, rounding):
    """One AdamW step from the same params and states, grads and params anywhere in float32 (NaN and
    inf stay in their element: in the param, and as the special codes of a flagged block)."""
    runs = {}
    for backend in ("reference", "triton"):
        p = torch.nn.Parameter(param.clone().to(dtype))
        opt = lowbit_compile(torch.optim.AdamW([p], weight_decay=0.1), fmt=name, block_size=BLOCK, outliers=2,
                             min_8bit_size=0, backend=backend, rounding=rounding)
        p.grad = grad.to(dtype)
        opt.step()
        runs[backend] = p, opt
    (p_ref, opt_ref), (p_tri, opt_tri) = runs["reference"], runs["triton"]
    for key, ref in opt_ref.state[p_ref].items():
        ours = opt_tri.state[p_tri][key]
        if hasattr(ref, "storage_parts"):
            assert_codes_within_one_step(ref.storage_parts, ours.storage_parts, ref.fmt, scale_ulps=8, what=key)
        else:
            assert torch.equal(ref, ours), key
    assert_params_within_bound(p_tri, p_ref, param.to(dtype))


def test_the_contract_fails_a_code_two_steps_off_and_a_moved_special_code():
    """The checker itself can fail: one code two steps away, or an inf's code moved to its neighbour."""
    fmt = StateFormat.make("sqrt8", BLOCK, 0, False)
    x = torch.linspace(-3, 3, 2 * BLOCK)
    x[BLOCK + 3] = float("inf")
    ref = blockquant.quantize(x, fmt)
    near = ref._replace(codes=ref.codes.clone())
    near.codes[5] += 1
    assert_codes_within_one_step(ref, near, fmt)
    far = ref._replace(codes=ref.codes.clone())
    far.codes[5] += 2
    with pytest.raises(AssertionError):
        assert_codes_within_one_step(ref, far, fmt)
    moved = ref._replace(codes=ref.codes.clone())
    moved.codes[BLOCK + 3], moved.codes[BLOCK + 4] = ref.codes[BLOCK + 4], ref.codes[BLOCK + 3]
    with pytest.raises(AssertionError):
        assert_codes_within_one_step(ref, moved, fmt)


def test_fp8_code_rank_orders_codes_by_value():
    fmt = StateFormat.make("fp8_e4m3", BLOCK, 0, False)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    finite = (codes & 0x7F) != 0x7F
    value = codes.view(torch.float8_e4m3fn).float()[finite]
    rank = code_rank(codes, fmt)[finite]
    order = torch.argsort(value, stable=True)
    assert torch.all(rank[order].diff() >= 0)


@pytest.mark.parametrize("fmt", ["sqrt8", "int8", "dynamic8", "fp8_e4m3", "sqrt4", "bf16", "fp32"])
def test_only_kernels_of_8bit_states_take_approximate_arithmetic(fmt):
    """8-bit (and 4-bit) states: approximate roots and division, fp contraction, tiles of one block of
    512 or two of sqrt4's 128, 8 elements a thread; fp32 and bf16 states: correctly rounded operations and
    no contraction (fp32 stays bit for bit stock)."""
    param = torch.nn.Parameter(torch.randn(64))
    emitted = emit_kernel(body(torch.optim.AdamW([param]), fmt, block_size=None), "k", Target("cuda"))
    options = triton_backend.launch_options(emitted)
    approximate = fmt not in ("bf16", "fp32")
    assert emitted.approximate == approximate == options["enable_fp_fusion"]
    assert ("tl.sqrt_rn(addcmul)" in emitted.source) != approximate
    assert ("tl.math.div_rn(lerp, add_1)" in emitted.source) != approximate
    if approximate:
        assert emitted.rows == (2 if fmt == "sqrt4" else 1)
        assert options["num_warps"] * 32 * 8 == emitted.block * emitted.rows
    state = emit_kernel(quantize_graph(StateFormat.make("sqrt8", 512, 0, True), torch.float32), "q", Target("cuda"))
    assert state.approximate and "APPROXIMATE=True" in state.source
