"""The zero-point check: after 20 AdamW steps with random gradients on a transformer-shaped parameter
set, no format stores a second moment as 0 where fp32 AdamW's is positive, and the parameters stay
near fp32 AdamW's.

The set is the 0.5M-param GPT of ``helpers.transformer_params`` (embeddings, attention and MLP
matrices, norms, biases: the kinds of tensors and block layouts of the 12.6M set of the issue, 25x
smaller to keep the test near 30 s; the largest drift grows with the number of parameters, from
0.5M to 12.6M 0.74 -> 0.79 lr for dynamic8 and 0.70 -> 0.96 for sqrt8). ``bench/zero_point.py`` runs the 12.6M set and the
peers.

The goal is at most 1 lr of drift for every format. Measured here at the default layout (blocks of
512, no patches): int8 2.16, sqrt8 0.70, dynamic8 0.74, fp8_e4m3 1.34, fp8_e5m2 3.17, bf16 0.09 lr. Linear INT8 misses it because elements whose first
gradients are tiny next to their block's largest get m and v on the coarse bottom of a linear grid
(v rounded up to the smallest code, m to 0 or one code), which shrinks or skews their next
updates; FP8 misses it by its 3 (e4m3) and 2 (e5m2) mantissa bits: a relative error of up to 6% or
12% on m and v that rounds the same way for several steps. Those three carry the measured bound
(~1.4x margin) as a regression guard, and the goal as a strict xfail that flips when it is met.
"""

from __future__ import annotations

import pytest
import torch

from bench.zero_point import OURS, SMALL, zero_point_check

pytestmark = pytest.mark.slow  # a training run per format (the module's fixture)

MISSES_GOAL = {"int8": 3.0, "fp8_e4m3": 2.0, "fp8_e5m2": 4.5}  # measured max drift x ~1.4


@pytest.fixture(scope="module")
def results():
    # One thread: on a busy 2-core machine two threads make these small ops ~30x slower. The
    # reference lowering needs no compiler; every fused lowering stores the same codes.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return zero_point_check(list(OURS), SMALL, backend="reference")
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("fmt", OURS)
def test_no_second_moment_is_stored_as_zero_at_any_step(results, fmt):
    assert results[fmt].zeros_ppm == 0


@pytest.mark.parametrize("fmt", [
    pytest.param(f, marks=pytest.mark.xfail(strict=True, reason="resolution of small m and v; see module docstring"))
    if f in MISSES_GOAL else f for f in OURS])
def test_no_parameter_drifts_more_than_one_lr_from_fp32(results, fmt):
    assert results[fmt].max_off_lr <= 1.0, results[fmt]


@pytest.mark.parametrize("fmt", sorted(MISSES_GOAL))
def test_drift_of_the_coarser_formats_stays_at_its_measured_level(results, fmt):
    assert results[fmt].max_off_lr <= MISSES_GOAL[fmt], results[fmt]
