"""Master weights: a bf16/fp16 param plus a residual state steps like an fp32 master copy.

``"exact"`` is the fp32 master recipe bit for bit (an fp32 copy stepped by the optimizer, the 16-bit
param refreshed from it each step) for every stock optimizer and state format, on the CPU kernel, the
Triton kernel (interpreted) and the eager reference; ``"8bit"`` keeps the master within its stated
bound, unbiased. The residual is a state like the others: created, converted, checkpointed, counted,
and given back by ``restore``; the fp32 masters go in and out for checkpoints of the recipe.
"""

from __future__ import annotations

import copy
import io
import logging
import os
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from expecttest import TestCase
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.tasks import FP32MasterCopy as Recipe
from lowbit_compile import (
    enable,
    load_master_params,
    lowbit_compile,
    master_params,
    memory_report,
    restore,
)
from lowbit_compile.checkpoint import stock_state_dict
from lowbit_compile.cli import main
from lowbit_compile.config import Config
from lowbit_compile.estimate import estimate
from lowbit_compile.formats import residual
from lowbit_compile.kernels import cpp_printer, triton_printer
from lowbit_compile.kernels.lowering import Target, unsupported
from lowbit_compile.options import Options
from lowbit_compile.passes.pipeline import Rewrite, rewrite
from lowbit_compile.state.schema import init_state, probe_schema, trace_for

from .helpers import bits, slow_but

BF16, FP16 = torch.bfloat16, torch.float16
STEPS = 6


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit (NaN equal to NaN, whatever its payload)."""
    return bool(((bits(a) == bits(b)) | (a.isnan() & b.isnan())).all())


def from_bits(u: torch.Tensor) -> torch.Tensor:
    """fp32 values of bit patterns held in int64 [0, 2**32)."""
    return torch.where(u >= 2**31, u - 2**32, u).to(torch.int32).view(torch.float32)


def every_low_half(high: list[int]) -> torch.Tensor:
    """All 65536 fp32 values under each of these upper 16-bit halves (and their negatives)."""
    hi = torch.tensor(high + [h | 0x8000 for h in high], dtype=torch.int64)
    return from_bits(((hi[:, None] << 16) | torch.arange(65536)[None, :]).reshape(-1))


SPECIAL_HIGH = [0x0000, 0x0001, 0x007F, 0x0080, 0x0081, 0x3F80, 0x3F81, 0x4049, 0x7F7E, 0x7F7F, 0x7F80, 0x7FC0]


# the residual, in plain torch ------------------------------------------------------------------------
def test_an_even_bf16_value_has_65537_fp32_masters_an_odd_one_65535():
    """Why 16 bits cannot hold the exact bf16 residual: round to nearest even gives an even value both
    of its ties, so one more bit (``master_ties``) is kept for the tie cases."""
    x = every_low_half([0x3F7F, 0x3F80, 0x3F81])
    counts = torch.bincount(x.to(BF16).view(torch.int16).to(torch.int64) & 0xFFFF)
    assert counts[0x3F80].item() == 65537 and counts[0x3F81].item() == 65535


@pytest.mark.slow
def test_exact_bf16_residual_gives_back_every_fp32_value():
    high = SPECIAL_HIGH + torch.randint(0, 0x7F80, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    x = every_low_half(high)  # zeros, subnormals, the largest finite values, values rounding to inf, inf, NaN
    fmt = residual.MasterFormat("exact", BF16)
    param, code, ties = residual.encode(x, fmt)
    assert same_bits(param, x.to(BF16))  # the param is what param.copy_(master) stores
    words = residual.pack_ties(ties)
    assert torch.equal(residual.unpack_ties(words, x.numel()), ties)
    assert same_bits(residual.decode(param, code, ties, fmt), x)
    assert ties.sum() > 0  # ties rounded up were among them


@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True), min_size=1,
                max_size=64))
def test_exact_bf16_residual_round_trips_any_floats(values):
    x = torch.tensor(values, dtype=torch.float32)
    fmt = residual.MasterFormat("exact", BF16)
    param, code, ties = residual.encode(x, fmt)
    assert same_bits(residual.decode(param, code, ties, fmt), x)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True), min_size=1,
                max_size=64), st.integers(0, 2**24 - 1))
def test_every_residual_keeps_its_promise_on_any_floats(values, seed):
    """fp16 exact: exact from 2**-15 up to what rounds to a finite fp16, within 2**-39 below; 8bit (bf16
    and fp16): the param is the master's round to nearest even, the stored master still rounds to it,
    and it is within one residual step of the master (256 fp32 bit patterns for bf16)."""
    x = torch.tensor(values, dtype=torch.float32)
    fmt = residual.MasterFormat("exact", FP16)
    param, code, _ = residual.encode(x, fmt)
    y = residual.decode(param, code, None, fmt)
    finite = x.abs() < 65520
    normal = finite & (x.abs() >= 2**-15)
    assert same_bits(y[normal], x[normal])
    assert ((y - x).abs()[finite & ~normal] <= 2**-39).all()
    for dtype in (BF16, FP16):
        fmt = residual.MasterFormat("8bit", dtype)
        param, code, _ = residual.encode(x, fmt, seed=seed)
        y = residual.decode(param, code, None, fmt)
        assert same_bits(param, x.to(dtype)) and same_bits(y.to(dtype), param)
        if dtype == BF16:
            gap = (bits(y).to(torch.int64) - bits(x).to(torch.int64)).abs()
            assert (gap[x.isfinite()] <= 256).all()


@pytest.mark.slow
def test_exact_fp16_residual_is_exact_from_2_to_the_minus_15_up_to_fp16_overflow():
    x = every_low_half([0x3800 + k for k in range(0, 0x1000, 97)] + [0x3F80, 0x4049, 0x477F, 0x4780, 0x3700, 0x3800,
                                                                     0x0000, 0x0001, 0x3400, 0x7F80, 0x7FC0])
    fmt = residual.MasterFormat("exact", FP16)
    param, code, ties = residual.encode(x, fmt)
    assert ties is None and same_bits(param, x.to(FP16))
    y = residual.decode(param, code, None, fmt)
    finite = x.abs() < 65520  # what rounds to a finite fp16
    normal = finite & (x.abs() >= 2**-15)
    assert same_bits(y[normal], x[normal])
    small = finite & ~normal
    assert small.any() and (y[small].double() - x[small].double()).abs().max() <= 2**-39  # 2**-38 resolution
    over = ~finite & ~x.isnan()
    assert over.any() and torch.equal(y[over], x[over].sign() * float("inf"))  # the master is lost with the param
    assert y[x.isnan()].isnan().all()


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [BF16, FP16])
def test_8bit_residual_is_within_one_step_of_the_master_and_unbiased(dtype):
    """|stored - master| <= 2**shift units of the exact residual (bf16: fp32 bit patterns, 1/256 of the
    bf16 spacing; fp16: units 2**(e - 24), 1/256 of the fp16 spacing), the param is the master's round
    to nearest even, and the mean over seeds is the master (stochastic rounding)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4096, generator=gen) * torch.logspace(-3, 3, 4096)
    fmt = residual.MasterFormat("8bit", dtype)
    exact = residual.MasterFormat("exact", dtype)
    _, d, ties = residual.encode(x, exact)
    d = d.to(torch.int64)
    if dtype == BF16:
        d = torch.where(d == residual.TIE, torch.where(ties, residual.TIE, -residual.TIE), d)
    seeds = range(200)
    stored = []
    for seed in seeds:
        param, code, _ = residual.encode(x, fmt, seed=seed)
        assert same_bits(param, x.to(dtype))
        stored.append(code.to(torch.int64) << fmt.shift)
        y = residual.decode(param, code, None, fmt)
        assert torch.equal(y.to(dtype), param)  # the stored master still rounds to the param
    stored = torch.stack(stored)
    assert (stored - d).abs().max() <= 1 << fmt.shift
    inside = d.abs() < 127 << fmt.shift  # away from the clamp at +-127 steps
    bias = (stored.double().mean(0) - d)[inside]
    # the mean of 200 draws, each within one step: 4 standard errors of a uniform error
    assert bias.abs().max() <= 4 * (1 << fmt.shift) / 200**0.5


def _lowbias32(x: int) -> int:
    """Chris Wellons' lowbias32 in Python integers: the definition the torch version must match."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_random_bits_are_lowbias32_of_the_index_and_the_seed():
    values = [0, 1, 2, 12345, 2**31 - 1, 2**31, 0xFFFFFFFF]
    assert residual.hash32(torch.tensor(values)).tolist() == [_lowbias32(v) for v in values]
    assert residual.random_bits(7, 40).tolist() == [_lowbias32(i ^ _lowbias32(7)) for i in range(40)]


# the pass ----------------------------------------------------------------------------------------------
def master_graphs(opt: torch.optim.Optimizer, fmt: str, mode: str) -> dict[str, torch.fx.GraphModule]:
    group = opt.param_groups[0]
    param = group["params"][0]
    stand_in = torch.empty(1, dtype=torch.float32)
    schema = probe_schema(opt, group, stand_in)
    config = Config.of(Options(fmt, block_size=512, outliers=0, min_8bit_size=0, backend="reference"))
    formats = dict(config.formats_for(param, schema.per_element, nonneg=schema.nonneg))
    traced = trace_for(opt, group, stand_in, init_state(stand_in, schema, formats), schema.per_element).graph
    graphs = rewrite(traced, Rewrite(formats, master=residual.MasterFormat(mode, param.dtype)))
    return {"master": graphs["master"], "split": graphs["split"]}


class TestMasterGraphs(TestCase):
    def test_adamw_exact_bf16_dynamic8(self):
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.randn(64, dtype=BF16))], weight_decay=0.1)
        g = master_graphs(opt, "dynamic8", "exact")
        self.assertExpectedInline(g["master"].code.strip(), """\
def forward(self, param, grad, master_residual, master_ties, state_step, exp_avg_codes, exp_avg_scales, exp_avg_patch_values, exp_avg_patch_index, exp_avg_sq_codes, exp_avg_sq_scales, exp_avg_sq_patch_values, exp_avg_sq_patch_index, hp_lr, hp_betas_0, hp_betas_1, hp_eps, hp_weight_decay):
    _to_copy_default = torch.ops.aten._to_copy.default(grad, dtype = torch.float32);  grad = None
    master_read_default = torch.ops.lowbit.master_read.default(param, master_residual, master_ties, 'exact:bfloat16')
    dequantize_default = torch.ops.lowbit.dequantize.default(exp_avg_codes, exp_avg_scales, exp_avg_patch_values, exp_avg_patch_index, 'dynamic8:512:0:s', 'float32')
    dequantize_default_1 = torch.ops.lowbit.dequantize.default(exp_avg_sq_codes, exp_avg_sq_scales, exp_avg_sq_patch_values, exp_avg_sq_patch_index, 'dynamic8:512:0:u', 'float32')
    add = torch.ops.aten.add.Tensor(state_step, 1)
    mul = hp_lr * hp_weight_decay;  hp_weight_decay = None
    sub = 1.0 - mul;  mul = None
    mul_1 = torch.ops.aten.mul.Tensor(master_read_default, sub);  master_read_default = sub = None
    sub_1 = 1.0 - hp_betas_0
    lerp = torch.ops.aten.lerp.Scalar(dequantize_default, _to_copy_default, sub_1);  dequantize_default = sub_1 = None
    mul_2 = torch.ops.aten.mul.Tensor(dequantize_default_1, hp_betas_1);  dequantize_default_1 = None
    sub_2 = 1.0 - hp_betas_1
    addcmul = torch.ops.aten.addcmul.default(mul_2, _to_copy_default, _to_copy_default, value = sub_2);  mul_2 = _to_copy_default = sub_2 = None
    _local_scalar_dense = torch.ops.aten._local_scalar_dense.default(add)
    pow_1 = hp_betas_0 ** _local_scalar_dense;  hp_betas_0 = None
    sub_3 = 1.0 - pow_1;  pow_1 = None
    pow_2 = hp_betas_1 ** _local_scalar_dense;  hp_betas_1 = _local_scalar_dense = None
    sub_4 = 1.0 - pow_2;  pow_2 = None
    truediv = hp_lr / sub_3;  hp_lr = sub_3 = None
    pow_3 = sub_4 ** 0.5;  sub_4 = None
    sqrt = torch.ops.aten.sqrt.default(addcmul)
    div = torch.ops.aten.div.Tensor(sqrt, pow_3);  sqrt = pow_3 = None
    add_1 = torch.ops.aten.add.Tensor(div, hp_eps);  div = hp_eps = None
    neg = -truediv;  truediv = None
    addcdiv = torch.ops.aten.addcdiv.default(mul_1, lerp, add_1, value = neg);  mul_1 = add_1 = neg = None
    master_write__default = torch.ops.lowbit.master_write_.default(addcdiv, param, master_residual, master_ties, None, 'exact:bfloat16');  addcdiv = param = master_residual = master_ties = master_write__default = None
    copy__1 = torch.ops.aten.copy_.default(state_step, add);  state_step = add = copy__1 = None
    quantize__default = torch.ops.lowbit.quantize_.default(lerp, exp_avg_codes, exp_avg_scales, exp_avg_patch_values, exp_avg_patch_index, 'dynamic8:512:0:s');  lerp = exp_avg_codes = exp_avg_scales = exp_avg_patch_values = exp_avg_patch_index = quantize__default = None
    quantize__default_1 = torch.ops.lowbit.quantize_.default(addcmul, exp_avg_sq_codes, exp_avg_sq_scales, exp_avg_sq_patch_values, exp_avg_sq_patch_index, 'dynamic8:512:0:u');  addcmul = exp_avg_sq_codes = exp_avg_sq_scales = exp_avg_sq_patch_values = exp_avg_sq_patch_index = quantize__default_1 = None
    return None""")

    def test_sgd_8bit_fp16_advances_its_step_counter_in_the_prologue(self):
        opt = torch.optim.SGD([torch.nn.Parameter(torch.randn(64, dtype=FP16))], lr=0.1, momentum=0.9)
        g = master_graphs(opt, "fp32", "8bit")
        self.assertExpectedInline(g["split"].prologue.code.strip(), """\
def forward(self, state_master_seed, hp_lr, hp_momentum, hp_dampening, hp_weight_decay):
    clone_default = torch.ops.aten.clone.default(state_master_seed)
    neg = -hp_lr;  hp_lr = None
    add_tensor = torch.ops.aten.add.Tensor(state_master_seed, 1.0)
    remainder_scalar = torch.ops.aten.remainder.Scalar(add_tensor, 16777216.0);  add_tensor = None
    copy__default = torch.ops.aten.copy_.default(state_master_seed, remainder_scalar);  state_master_seed = remainder_scalar = copy__default = None
    return (neg, clone_default)""")
        self.assertExpectedInline(g["split"].body.code.strip(), """\
def forward(self, param, grad, master_residual, state_momentum_buffer, neg, clone_default):
    _to_copy_default = torch.ops.aten._to_copy.default(grad, dtype = torch.float32);  grad = None
    master_read_default = torch.ops.lowbit.master_read.default(param, master_residual, None, '8bit:float16')
    clone = torch.ops.aten.clone.default(_to_copy_default);  _to_copy_default = None
    add = torch.ops.aten.add.Tensor(master_read_default, clone, alpha = neg);  master_read_default = neg = None
    master_write__default = torch.ops.lowbit.master_write_.default(add, param, master_residual, None, clone_default, '8bit:float16');  add = param = master_residual = clone_default = master_write__default = None
    copy__1 = torch.ops.aten.copy_.default(state_momentum_buffer, clone);  state_momentum_buffer = clone = copy__1 = None
    return None""")


# bit for bit the fp32 master recipe -------------------------------------------------------------------
OPTIMIZERS = {
    "AdamW": (torch.optim.AdamW, {"weight_decay": 0.1}),
    "Adam-amsgrad": (torch.optim.Adam, {"amsgrad": True, "weight_decay": 0.01}),
    "SGD-nesterov": (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    "RMSprop-centered": (torch.optim.RMSprop, {"momentum": 0.5, "centered": True}),
    "Adagrad": (torch.optim.Adagrad, {"lr_decay": 0.01}),
    "Adamax": (torch.optim.Adamax, {}),
    "NAdam-decoupled": (torch.optim.NAdam, {"decoupled_weight_decay": True, "weight_decay": 0.1}),
    "RAdam": (torch.optim.RAdam, {}),
    "Adadelta": (torch.optim.Adadelta, {"lr": 0.5}),
    "ASGD": (torch.optim.ASGD, {"t0": 3}),
    "Rprop": (torch.optim.Rprop, {}),
}
FORMATS = ("fp32", "dynamic8", "int8", "fp8_e4m3", "fp8_e5m2", "bf16", "sqrt8")
# a staged step (passes/stages.py): Newton-Schulz on the fp32 master's update; matrices only
STAGED = {"Muon": (torch.optim.Muon, {"lr": 0.02})}


def model_params(dtype: torch.dtype, seed: int = 0) -> list[torch.nn.Parameter]:
    """Matrices, a vector, a scalar and a non-contiguous weight at several magnitudes (updates above
    and below half the param's spacing). fp16 weights stay away from fp16's subnormal range (from
    2**-14 down), where the exact residual keeps an absolute 2**-38 resolution, not fp32's."""
    gen = torch.Generator().manual_seed(seed)
    shapes_scales = [((33, 40), 0.05), ((300,), 1.0), ((), 0.5), ((24, 20), 0.02)]
    values = [torch.randn(s, generator=gen) * c for s, c in shapes_scales]
    if dtype == FP16:
        values = [v.sign() * (v.abs() + 0.25) for v in values]
    params = [torch.nn.Parameter(v.to(dtype)) for v in values]
    params[-1] = torch.nn.Parameter(params[-1].detach().t().contiguous().t())  # non-contiguous
    return params


def twin(params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
    out = []
    for p in params:
        q = torch.nn.Parameter(p.detach().clone())
        if not p.is_contiguous():
            q.data = p.detach().t().clone().t()
        out.append(q)
    return out


def set_grads(groups: list[list[torch.nn.Parameter]], step: int, gen: torch.Generator) -> None:
    for i, params in enumerate(zip(*groups)):
        if i == 1 and step % 3 == 1:  # this param sometimes has no grad
            for p in params:
                p.grad = None
            continue
        g = (torch.randn(params[0].shape, generator=gen) * 0.1).to(params[0].dtype)
        for p in params:
            p.grad = torch.empty_like(p).copy_(g)


def check_exact(name: str, fmt: str, dtype: torch.dtype, backend: str, steps: int = STEPS) -> None:
    """``"exact"`` against the recipe (``bench/tasks.py``), every step: the 16-bit params and, at the
    end, every master bit. The recipe steps its fp32 copies with the stock optimizer for fp32 states on
    the CPU kernel and the reference (both are stock bit for bit), else with lowbit_compile on the same
    backend and format."""
    cls, kwargs = {**OPTIMIZERS, **STAGED}[name]
    ours = [p for p in model_params(dtype) if name not in STAGED or p.dim() == 2]
    theirs = twin(ours)
    opt = lowbit_compile(cls(ours, **kwargs), fmt, master_weights="exact", backend=backend, min_8bit_size=0,
                         block_size=256)
    if fmt == "fp32" and backend != "triton":
        single = {} if name in STAGED else {"foreach": False}  # Muon has one implementation
        recipe = Recipe(theirs, lambda ms: cls(ms, **kwargs, **single))
    else:
        recipe = Recipe(theirs, lambda ms: lowbit_compile(cls(ms, **kwargs), fmt, backend=backend, min_8bit_size=0,
                                                          block_size=256))
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        set_grads([ours, theirs], step, gen)
        opt.step()
        recipe.step()
        for p, q in zip(ours, theirs):
            assert same_bits(p.detach(), q.detach()), (name, fmt, step)
    for m, r in zip(master_params(opt), recipe.masters):
        assert m.dtype == torch.float32 and same_bits(m, r.detach()), (name, fmt)


# every optimizer with fp32 states and with two of the quantized formats, in rotation (each format with
# three or four optimizers): the master pass rewrites the param and grad only, the formats the states only
REFERENCE_GRID = [(name, fmt) for i, name in enumerate(OPTIMIZERS)
                  for fmt in ("fp32", FORMATS[1 + (2 * i) % 6], FORMATS[1 + (2 * i + 1) % 6])]


@pytest.mark.parametrize(("name", "fmt"), slow_but([pytest.param(n, f, id=f"{n}-{f}") for n, f in REFERENCE_GRID],
                                                  "AdamW-dynamic8", "SGD-nesterov-bf16"))
def test_exact_is_the_fp32_master_recipe_bit_for_bit_on_the_reference(name, fmt):
    check_exact(name, fmt, BF16, "reference")


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_exact_with_fp32_states_is_stock_on_an_fp32_copy_bit_for_bit_on_the_cpu_kernel(name):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing falls back to the reference
        check_exact(name, "fp32", BF16, "cpu")


# (SGD's first step, which creates its state, with dynamic8: on the reference grid, and on this kernel with fp32)
@pytest.mark.parametrize(("name", "fmt"), [("AdamW", "dynamic8"), ("AdamW", "int8"), ("RMSprop-centered", "fp8_e4m3")])
def test_exact_with_quantized_states_is_the_recipe_on_the_cpu_kernel(name, fmt):
    check_exact(name, fmt, BF16, "cpu")


@pytest.mark.parametrize(("fmt", "dtype", "backend"), [("fp32", BF16, "cpu"), ("sqrt8", BF16, "cpu"),
                                                    ("fp32", FP16, "cpu"), ("int8", BF16, "reference")])
def test_exact_muon_is_the_recipe_bit_for_bit(fmt, dtype, backend):
    """Muon's staged step through the master: the fused stages read and write the 16-bit param and its
    residual, Newton-Schulz takes the bf16 update of the fp32 master's momentum, as the recipe's."""
    check_exact("Muon", fmt, dtype, backend)


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize(("name", "fmt"), [("AdamW", "fp32"), ("AdamW", "dynamic8"), ("SGD-nesterov", "fp32")])
def test_exact_fp16_params_are_the_recipe_bit_for_bit(name, fmt, backend):
    check_exact(name, fmt, FP16, backend)


@pytest.mark.slow
@pytest.mark.parametrize(("name", "fmt", "dtype"), [("AdamW", "dynamic8", BF16), ("SGD-nesterov", "fp32", FP16),
                                                    ("RAdam", "int8", BF16)])
def test_exact_is_the_recipe_on_the_triton_kernel(name, fmt, dtype):
    pytest.importorskip("lowbit_compile.kernels.triton_backend")
    check_exact(name, fmt, dtype, "triton", steps=3)


@torch.no_grad()
@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_both_ties_of_an_even_bf16_value_survive_steps_and_a_checkpoint(backend):
    """Masters exactly halfway between two bf16 values: 1 + 2**-8 (kept at 1.0) and 1 + 3 * 2**-8
    (rounded up to 1 + 2**-6), both stored at even params; the tie bit tells them apart."""
    p = torch.nn.Parameter(torch.tensor([1.0, 1.0 + 2**-7, 3.0, -1.0 - 2**-7] * 20, dtype=BF16))
    opt = lowbit_compile(torch.optim.SGD([p], lr=1.0), "fp32", master_weights="exact", backend=backend)
    p.grad = torch.tensor([-(2**-8), -(2**-8), 0.0, 2**-8] * 20, dtype=BF16)
    opt.step()
    expected = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, 3.0, -1 - 3 * 2**-8] * 20)
    assert torch.equal(p, expected.to(BF16)) and torch.equal(master_params(opt)[0], expected)
    assert torch.equal(opt.state[p]["master_residual"][:4], torch.tensor([-(2**15), -(2**15), 0, -(2**15)],
                                                                         dtype=torch.int16))
    saved = io.BytesIO()
    torch.save(opt.state_dict(), saved)
    q = torch.nn.Parameter(p.detach().clone())
    again = lowbit_compile(torch.optim.SGD([q], lr=1.0), "fp32", master_weights="exact", backend=backend)
    saved.seek(0)
    again.load_state_dict(torch.load(saved, weights_only=True))
    assert torch.equal(master_params(again)[0], expected)
    p.grad = q.grad = torch.full_like(p, 2**-9)
    opt.step()
    again.step()
    assert torch.equal(master_params(opt)[0], expected - 2**-9)
    assert torch.equal(master_params(again)[0], expected - 2**-9) and torch.equal(p, q)


@torch.no_grad()
@pytest.mark.parametrize("mode", ["exact", "8bit"])
def test_a_steady_step_replays_its_launches_with_the_master(mode):
    """Contiguous bf16 params on the CPU kernel: steps after the first replay the prepared launches,
    the residual and step counter bound once; new masters loaded from outside (new residual tensors)
    are prepared again; a counter reset from outside is seen. "exact" stays the recipe bit for bit;
    "8bit"'s counter counts every step."""
    shapes = [(300,), (40, 20), (5000,)]
    gen = torch.Generator().manual_seed(3)
    ours = [torch.nn.Parameter(torch.randn(s, generator=gen).to(BF16)) for s in shapes]
    opt = lowbit_compile(torch.optim.AdamW(ours, weight_decay=0.1), "fp32", master_weights=mode, backend="cpu")
    recipe = Recipe(twin(ours), lambda ms: torch.optim.AdamW(ms, weight_decay=0.1, foreach=False))
    plans = []
    for step in range(7):
        for p, q in zip(ours, recipe.params):
            p.grad = (torch.randn(p.shape, generator=gen) * 0.1).to(BF16)
            q.grad = p.grad.clone()
        if step == 4:
            load_master_params(opt, [m.detach() for m in recipe.masters] if mode == "exact" else master_params(opt))
        if step == 5 and mode == "8bit":
            opt.state[ours[0]][residual.SEED].fill_(0.0)
        opt.step()
        recipe.step()
        plans.append(opt._lowbit.plan)
        if mode == "exact":
            assert all(same_bits(p.detach(), q.detach()) for p, q in zip(ours, recipe.params)), step
    assert plans[1] is not None and plans[1] is plans[2] is plans[3]
    assert plans[4] is not plans[3]  # new residual tensors: prepared again
    if mode == "exact":
        assert all(same_bits(m, r.detach()) for m, r in zip(master_params(opt), recipe.masters))
    else:
        assert [float(opt.state[p][residual.SEED]) for p in ours] == [
            2.0, residual.first_counter(1) + 7, residual.first_counter(2) + 7]


@torch.no_grad()
def test_equal_parameters_round_their_8bit_masters_with_different_draws():
    """Each parameter's counter starts apart (``first_counter`` of its position): two equal layers with
    equal grads keep different residuals, as independent stochastic roundings do (counters in step
    would round same-index elements alike, every layer of a stack the same way)."""
    gen = torch.Generator().manual_seed(0)
    value = torch.randn(4096, generator=gen).to(BF16)
    params = [torch.nn.Parameter(value.clone()) for _ in range(2)]
    opt = lowbit_compile(torch.optim.AdamW(params, lr=1e-3), master_weights="8bit")
    for _ in range(3):
        grad = (torch.randn(4096, generator=gen) * 0.1).to(BF16)
        for p in params:
            p.grad = grad.clone()
        opt.step()
    a, b = (opt.state[p][residual.RESIDUAL] for p in params)
    assert (a != b).float().mean() > 0.3
    masters = master_params(opt)
    assert (masters[0] - masters[1]).abs().max() < 2 * 2**-7 * value.float().abs().max()


# the lossy residual --------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [BF16, FP16])
@pytest.mark.parametrize(("name", "fmt", "backends"), [
    ("AdamW", "fp32", ("cpu", "reference")),
    # square roots and divisions round alike on these two for SGD only (the interpreted Triton kernel
    # takes correctly rounded ones, torch its own): there the masters agree, and so must their rounding
    ("SGD-nesterov", "fp32", ("reference", "triton")),
    ("SGD-nesterov", "dynamic8", ("reference", "triton")),
])
def test_8bit_is_the_same_on_every_backend(name, fmt, backends, dtype):
    """One random-bit hash, one rounding: the lossy residuals of the kernels and the reference agree
    wherever the fp32 steps before them do."""
    if "triton" in backends:
        pytest.importorskip("lowbit_compile.kernels.triton_backend")
    cls, kwargs = OPTIMIZERS[name]
    runs = []
    for backend in backends:
        params = model_params(dtype)
        opt = lowbit_compile(cls(params, **kwargs), fmt, master_weights="8bit", backend=backend, min_8bit_size=0,
                             block_size=256)
        gen = torch.Generator().manual_seed(1)
        for step in range(3):
            set_grads([params], step, gen)
            opt.step()
        runs.append([(p.detach().clone(), opt.state[p]["master_residual"].clone()) for p in params])
    for (p, r), (q, s) in zip(*runs):
        assert same_bits(p, q) and torch.equal(r, s)


@torch.no_grad()
@pytest.mark.parametrize("name", ["AdamW", "Muon"])
def test_8bit_master_stays_within_one_residual_step_of_each_fp32_step(name):
    """Each step: the stock fp32 step from the stored master gives x; afterwards the param is x rounded
    to nearest even and the stored master is within 256 fp32 bit patterns of x (1/256 of bf16's
    spacing there)."""
    cls, kwargs = {**OPTIMIZERS, **STAGED}[name]
    params = [p for p in model_params(BF16) if name not in STAGED or p.dim() == 2]
    opt = lowbit_compile(cls(params, **kwargs), "fp32", master_weights="8bit", backend="cpu", min_8bit_size=0)
    gen = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        set_grads([params], step, gen)
        before = master_params(opt)
        shadow = [torch.nn.Parameter(m.clone()) for m in before]
        stock = cls(shadow, **kwargs)
        for p, s in zip(params, shadow):
            s.grad = None if p.grad is None else p.grad.float()
            if p in opt.state:
                stock.state[s] = {k: v.clone() for k, v in opt.state[p].items() if k not in residual.KEYS}
        stock.step()
        opt.step()
        for p, s, m in zip(params, shadow, master_params(opt)):
            x = s.detach().reshape(-1)
            assert same_bits(p.detach().reshape(-1), x.to(BF16))
            gap = (bits(m.reshape(-1)).to(torch.int64) - bits(x).to(torch.int64)).abs()
            assert gap.max() <= 256


@pytest.mark.slow
@torch.no_grad()
def test_updates_far_below_the_bf16_spacing_move_the_master():
    """lr 1e-5 on weights near 1 (bf16 spacing 2**-7, so each update is 1/780 of it): stock AdamW on bf16
    params never moves them; "exact" moves with the recipe bit for bit; "8bit" moves as far on average
    (stochastic rounding), where rounding to nearest would drop every update."""
    n, steps, lr = 4096, 100, 1e-5
    start = (1 + torch.rand(n, generator=torch.Generator().manual_seed(0)) * 0.5).to(BF16)

    def run(make):
        p = torch.nn.Parameter(start.clone())
        opt = make([p])
        for _ in range(steps):
            p.grad = torch.ones_like(p)  # a constant gradient: every step moves each weight by ~lr
            opt.step()
        return p, opt

    stock, _ = run(lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=0.0))
    assert torch.equal(stock, start)  # every update rounded away
    recipe = Recipe([torch.nn.Parameter(start.clone())], lambda ms: torch.optim.AdamW(ms, lr=lr, weight_decay=0.0))
    for _ in range(steps):
        recipe.params[0].grad = torch.ones_like(recipe.params[0])
        recipe.step()
    moved = start.float() - recipe.masters[0].detach()
    assert moved.mean() > 0.9 * steps * lr
    exact, exact_opt = run(lambda ps: lowbit_compile(torch.optim.AdamW(ps, lr=lr, weight_decay=0.0), "fp32",
                                                     master_weights="exact"))
    assert torch.equal(exact, recipe.params[0]) and torch.equal(master_params(exact_opt)[0], recipe.masters[0])
    _, lossy_opt = run(lambda ps: lowbit_compile(torch.optim.AdamW(ps, lr=lr, weight_decay=0.0), "fp32",
                                                 master_weights="8bit"))
    lossy_moved = start.float() - master_params(lossy_opt)[0]
    assert abs(lossy_moved.mean() / moved.mean() - 1) < 0.02


# the option on every parameter ------------------------------------------------------------------------------
def test_fp32_params_are_their_own_master():
    """fp32 params with the option step exactly as without it; a model of fp32 params only warns."""
    a, b = model_params(torch.float32), model_params(torch.float32)
    with pytest.warns(UserWarning, match="has no effect"):
        opt_a = lowbit_compile(torch.optim.AdamW(a), master_weights="exact", min_8bit_size=0)
    opt_b = lowbit_compile(torch.optim.AdamW(b), min_8bit_size=0)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        set_grads([a, b], step, gen)
        opt_a.step()
        opt_b.step()
    assert all(torch.equal(p, q) for p, q in zip(a, b))
    assert not any(k in residual.KEYS for s in opt_a.state.values() for k in s)
    mixed = model_params(BF16)[:2] + model_params(torch.float32)[2:]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = lowbit_compile(torch.optim.AdamW(mixed), master_weights="exact")
    set_grads([mixed], 0, gen)
    opt.step()
    assert [residual.RESIDUAL in opt.state[p] for p in mixed] == [True, True, False, False]


def test_a_bad_option_is_refused_naming_it():
    with pytest.raises(ValueError, match="master_weights must be one of"):
        lowbit_compile(torch.optim.AdamW(model_params(BF16)), master_weights="16bit")


def test_memory_report_counts_the_residual():
    params = [torch.nn.Parameter(torch.randn(4096 * 3, dtype=BF16))]
    for mode, per_param in (("exact", 2.125), ("8bit", 1.0)):
        opt = lowbit_compile(torch.optim.AdamW(params), master_weights=mode)
        params[0].grad = torch.randn_like(params[0])
        opt.step()
        report = memory_report(opt)
        held = sum(m.bytes for k, m in report.per_state.items() if k in residual.KEYS and k != residual.SEED)
        assert held == per_param * params[0].numel()
        assert residual.RESIDUAL in str(report)
        restore(opt)


def test_estimate_for_7b_bf16_with_the_8bit_residual_fits_7_1_bytes_per_param():
    est = estimate(7 * 10**9, param_dtype="bf16", master_weights="8bit")
    assert est.row("master (8bit residual)").lowbit == 7 * 10**9
    assert est.lowbit_total / 7e9 <= 7.1 and est.lowbit_total <= 50 * 10**9
    assert est.stock_total == 112 * 10**9  # the fp32 master recipe: 16 B/param
    exact = estimate(7 * 10**9, param_dtype="bf16", master_weights="exact")
    assert exact.row("master (exact residual)").lowbit == 14 * 10**9 + 4 * -(-7 * 10**9 // 32)


def test_enable_passes_the_option_on():
    params = model_params(BF16)
    opt = torch.optim.AdamW(params)
    with enable(master_weights="exact", min_8bit_size=0):
        set_grads([params], 0, torch.Generator().manual_seed(0))
        opt.step()
    assert residual.TIES in opt.state[params[0]]


def test_the_optimizer_classes_take_the_option_and_copies_keep_it():
    """``lowbit_compile.optim.AdamW(..., master_weights="exact")`` is the recipe; a deep copy stays wrapped
    with the option and its own copy of the residual, and steps on like the original."""
    import lowbit_compile.optim

    params = model_params(BF16)
    opt = lowbit_compile.optim.AdamW(params, weight_decay=0.1, fmt="fp32", master_weights="exact")
    assert "master_weights='exact'" in repr(opt)
    recipe = Recipe(twin(params), lambda ms: torch.optim.AdamW(ms, weight_decay=0.1, foreach=False))
    train(params, opt, 2, seed=1)
    train(recipe.params, recipe, 2, seed=1)
    model, dup = copy.deepcopy((params, opt))
    assert dup._lowbit.config.master_weights == "exact"
    assert dup.state[model[0]][residual.RESIDUAL] is not opt.state[params[0]][residual.RESIDUAL]
    for p, o in ((params, opt), (model, dup), (recipe.params, recipe)):
        train(p, o, 2, seed=2)
    assert all(same_bits(p.detach(), q.detach()) and same_bits(p.detach(), r.detach())
               for p, q, r in zip(params, model, recipe.params))


# state: conversions, checkpoints, restore -------------------------------------------------------------------
def train(params, opt, steps, seed):
    """``steps`` steps of ``opt`` (ours or a recipe) on the grads of ``set_grads`` from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        set_grads([params], step, gen)
        opt.step()


@pytest.mark.parametrize("mode", ["exact", "8bit"])
def test_state_dict_round_trip_resumes_bit_for_bit(mode):
    params = model_params(BF16)
    opt = lowbit_compile(torch.optim.AdamW(params, weight_decay=0.1), master_weights=mode, min_8bit_size=0)
    train(params, opt, 3, seed=1)
    saved = io.BytesIO()
    torch.save({"model": [p.detach().clone() for p in params], "optim": opt.state_dict()}, saved)
    train(params, opt, 3, seed=2)
    saved.seek(0)
    loaded = torch.load(saved, weights_only=True)
    again = twin(model_params(BF16))
    with torch.no_grad():
        for q, v in zip(again, loaded["model"]):
            q.copy_(v)
    again_opt = lowbit_compile(torch.optim.AdamW(again, weight_decay=0.1), master_weights=mode, min_8bit_size=0)
    again_opt.load_state_dict(loaded["optim"])
    assert again_opt.state[again[0]]["exp_avg"].dtype == torch.float32  # not cast to the param's bf16
    train(again, again_opt, 3, seed=2)
    assert all(same_bits(p.detach(), q.detach()) for p, q in zip(params, again))
    assert all(torch.equal(opt.state[p][residual.RESIDUAL], again_opt.state[q][residual.RESIDUAL])
               for p, q in zip(params, again))


def _leaves(tree: object, path: str = "") -> list[tuple[str, object]]:
    """Every (path, leaf) of a nested state dict, tensors as clones (a state dict holds live tensors)."""
    if isinstance(tree, dict):
        return [leaf for k, v in tree.items() for leaf in _leaves(v, f"{path}/{k}")]
    if isinstance(tree, (list, tuple)):
        return [leaf for i, v in enumerate(tree) for leaf in _leaves(v, f"{path}/{i}")]
    return [(path, tree.clone() if isinstance(tree, torch.Tensor) else tree)]


def _same_leaves(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        pa == pb and (same_bits(va, vb) if isinstance(va, torch.Tensor) and va.is_floating_point() else
                      torch.equal(va, vb) if isinstance(va, torch.Tensor) else va == vb)
        for (pa, va), (pb, vb) in zip(a, b))


def _damage(key: str, part: str, how) -> Callable[[dict], None]:
    """Replace the ``part`` table of the saved ``key`` by ``how(table)``."""
    return lambda entry: entry[key].update({part: how(entry[key][part])})


CORRUPTIONS = {  # (mode, how the saved entry is damaged (params[0]'s for exact, params[1]'s for 8bit), the error)
    "truncated residual": ("exact", _damage(residual.RESIDUAL, "bytes", lambda t: t[:-1]), "rows"),
    "residual of another width": ("exact", _damage(residual.RESIDUAL, "bytes", lambda t: t[:, :-2]), "do not fit"),
    "residual bytes that are not bytes": ("8bit", _damage(residual.RESIDUAL, "bytes", lambda t: t.float() + 0.5),
                                          "not bytes"),
    "float residual": ("exact", lambda e: e.update({residual.RESIDUAL: torch.zeros(33, 40)}),
                       "not int16 .exact. or int8"),
    "residual not a tensor": ("8bit", lambda e: e.update({residual.RESIDUAL: [1, 2]}), "not a tensor"),
    "no tie bits": ("exact", lambda e: e.pop(residual.TIES), "no 'master_ties'"),
    "tie table of another shape": ("exact", _damage(residual.TIES, "bits", lambda t: t[:, :1]), "do not fit"),
    "tie table missing": ("exact", lambda e: e[residual.TIES].pop("bits"), "no table of bits"),
    "tie bits that are not bytes": ("exact", _damage(residual.TIES, "bits", lambda t: t.float() + 0.5), "not bytes"),
    "no residual next to its ties": ("exact", lambda e: e.pop(residual.RESIDUAL), "no 'master_residual'"),
    "counter truncated": ("8bit", _damage(residual.SEED, "bytes", lambda t: t[:3]), "four bytes"),
    "counter not a number": ("8bit", lambda e: e.update({residual.SEED: torch.tensor([1.0, float("nan")])}),
                             "not one number"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_a_corrupt_master_checkpoint_is_refused_and_changes_nothing(case):
    """A residual, tie table or step counter that does not fit its parameter fails ``load_state_dict``
    naming the parameter, before anything of the optimizer changes (its states, masters and the states
    of the params whose entries are fine stay as they were)."""
    mode, damage, message = CORRUPTIONS[case]
    params = model_params(BF16)
    opt = lowbit_compile(torch.optim.AdamW(params, weight_decay=0.1), master_weights=mode, min_8bit_size=0)
    train(params, opt, 2, seed=1)
    saved = io.BytesIO()
    torch.save(opt.state_dict(), saved)
    saved.seek(0)
    bad = torch.load(saved, weights_only=True)
    damage(bad["state"][1 if mode == "8bit" else 0])
    target = twin(params)
    target_opt = lowbit_compile(torch.optim.AdamW(target, weight_decay=0.1), master_weights=mode, min_8bit_size=0)
    train(target, target_opt, 1, seed=2)
    before, masters = _leaves(target_opt.state_dict()), master_params(target_opt)
    index = 1 if mode == "8bit" else 0
    with pytest.raises(ValueError, match=rf"param_groups\[0\]\['params'\]\[{index}\].*{message}"):
        target_opt.load_state_dict(bad)
    assert _same_leaves(_leaves(target_opt.state_dict()), before)
    assert all(same_bits(m, n) for m, n in zip(master_params(target_opt), masters))
    train(target, target_opt, 1, seed=3)  # and it still steps


@pytest.mark.parametrize("mode", ["exact", "8bit"])
def test_a_checkpoint_a_stock_loader_stored_resumes_under_enable(mode):
    """``enable()`` wraps at the first step, after a stock ``load_state_dict`` in scope stored the checkpoint (the
    residual, its tie table and counter as saved, the counter cast to bf16): that step reads them back
    and steps on as the run that saved it does."""
    params = model_params(BF16)
    opt = lowbit_compile(torch.optim.AdamW(params), master_weights=mode, min_8bit_size=0)
    train(params, opt, 2, seed=1)
    saved = io.BytesIO()
    torch.save(opt.state_dict(), saved)
    again = twin(params)
    stock = torch.optim.AdamW(again)
    saved.seek(0)
    train(params, opt, 2, seed=2)
    with enable(master_weights=mode, min_8bit_size=0):  # in scope, where a framework's resume loads
        stock.load_state_dict(torch.load(saved, weights_only=True))
        train(again, stock, 2, seed=2)
    assert all(same_bits(p.detach(), q.detach()) for p, q in zip(params, again))
    assert all(same_bits(m, n) for m, n in zip(master_params(opt), master_params(stock)))


def test_the_fp32_master_recipe_checkpoint_goes_out_and_comes_back_in():
    """Out: stock_state_dict + master_params is the recipe's checkpoint; the recipe resumes from it and
    steps on as we do. In: a recipe's checkpoint (its optimizer over fp32 copies, and the copies) loads
    into a bf16 model with exact master weights, which steps on as the recipe does."""
    params = model_params(BF16)
    opt = lowbit_compile(torch.optim.AdamW(params, weight_decay=0.1), "fp32", master_weights="exact", backend="cpu")
    train(params, opt, 3, seed=1)
    saved = io.BytesIO()  # what goes to disk (a state dict holds the live state tensors)
    torch.save({"optim": stock_state_dict(opt), "masters": master_params(opt)}, saved)
    saved.seek(0)
    out = torch.load(saved, weights_only=True)
    out_state, out_masters = out["optim"], out["masters"]
    assert not any(k in residual.KEYS for s in out_state["state"].values() for k in s)
    recipe = Recipe(twin(params), lambda ms: torch.optim.AdamW(ms, weight_decay=0.1, foreach=False))
    with torch.no_grad():
        for m, v in zip(recipe.masters, out_masters):
            m.copy_(v)
    recipe.inner.load_state_dict(out_state)
    train(params, opt, 3, seed=2)
    train(recipe.params, recipe, 3, seed=2)
    assert all(same_bits(p.detach(), q.detach()) for p, q in zip(params, recipe.params))

    fresh = twin(model_params(BF16, seed=5))
    fresh_opt = lowbit_compile(torch.optim.AdamW(fresh, weight_decay=0.1), "fp32", master_weights="exact",
                               backend="cpu")
    saved = io.BytesIO()
    torch.save({"optim": recipe.inner.state_dict(), "masters": [m.detach() for m in recipe.masters]}, saved)
    saved.seek(0)
    checkpoint = torch.load(saved, weights_only=True)
    fresh_opt.load_state_dict(checkpoint["optim"])
    load_master_params(fresh_opt, checkpoint["masters"])
    assert all(same_bits(p.detach(), q.detach()) for p, q in zip(fresh, recipe.params))
    train(fresh, fresh_opt, 3, seed=3)
    train(recipe.params, recipe, 3, seed=3)
    assert all(same_bits(p.detach(), q.detach()) for p, q in zip(fresh, recipe.params))
    assert all(same_bits(m, r.detach()) for m, r in zip(master_params(fresh_opt), recipe.masters))


def test_load_master_params_checks_every_shape_before_changing_anything():
    params = model_params(BF16)
    opt = lowbit_compile(torch.optim.AdamW(params), master_weights="exact")
    before = [p.detach().clone() for p in params]
    bad = [torch.zeros(p.shape) for p in params]
    bad[-1] = torch.zeros(3)
    with pytest.raises(ValueError, match="master 3 has shape"):
        load_master_params(opt, bad)
    assert all(torch.equal(p, b) for p, b in zip(params, before))


def test_switching_modes_converts_the_residual_through_its_master():
    params = model_params(BF16)
    opt = lowbit_compile(torch.optim.AdamW(params), master_weights="exact", min_8bit_size=0)
    train(params, opt, 3, seed=1)
    exact = master_params(opt)
    lowbit_compile(opt, master_weights="8bit", min_8bit_size=0)
    assert opt.state[params[0]][residual.RESIDUAL].dtype == torch.int8 and residual.TIES not in opt.state[params[0]]
    for m, e in zip(master_params(opt), exact):
        assert (bits(m).to(torch.int64) - bits(e).to(torch.int64)).abs().max() <= 256
    lossy = master_params(opt)
    lowbit_compile(opt, master_weights="exact", min_8bit_size=0)
    assert all(torch.equal(m, v) for m, v in zip(master_params(opt), lossy))  # exact holds any master
    train(params, opt, 1, seed=2)


def test_wrapping_again_without_the_option_drops_the_master():
    params = model_params(BF16)
    opt = lowbit_compile(torch.optim.AdamW(params), master_weights="exact", min_8bit_size=0)
    train(params, opt, 2, seed=1)
    with pytest.warns(UserWarning, match="wrapped with master_weights='exact'; wrapping it again without it"):
        lowbit_compile(opt, min_8bit_size=0)  # re-configures: no master weights
    state = opt.state[params[0]]
    assert not any(k in residual.KEYS for k in state) and state["exp_avg"].dtype == BF16
    train(params, opt, 1, seed=2)


def test_a_stock_bf16_checkpoint_loads_into_master_weights():
    """Stock AdamW over bf16 params keeps bf16 states: they become fp32 (exactly), the residual zero."""
    params = model_params(BF16)
    stock = torch.optim.AdamW(params)
    train(params, stock, 2, seed=1)
    again = twin(params)
    opt = lowbit_compile(torch.optim.AdamW(again), "fp32", master_weights="exact")
    opt.load_state_dict(copy.deepcopy(stock.state_dict()))
    state = opt.state[again[0]]
    assert state["exp_avg"].dtype == torch.float32 and torch.equal(state["exp_avg"], stock.state[params[0]]["exp_avg"])
    assert not state[residual.RESIDUAL].any()
    train(again, opt, 2, seed=2)


@torch.no_grad()
def test_restore_gives_back_stock_adamw_over_the_same_bf16_params():
    params = model_params(BF16)
    opt = lowbit_compile(torch.optim.AdamW(params), master_weights="exact")
    train(params, opt, 2, seed=1)
    before = [p.detach().clone() for p in params]
    restore(opt)
    assert all(torch.equal(p, b) for p, b in zip(params, before))  # the master rounded, as the recipe leaves it
    for p in params:
        state = opt.state[p]
        assert not any(k in residual.KEYS for k in state)
        assert state["exp_avg"].dtype == BF16 and type(state["exp_avg"]) is torch.Tensor
    train(params, opt, 2, seed=2)  # the stock step runs on them


@torch.no_grad()
def test_a_param_changed_outside_the_step_keeps_a_finite_master_near_it():
    """A stale residual (the params were loaded from elsewhere) moves the master by at most half the
    param's spacing, and never makes a finite param's master NaN or inf."""
    params = model_params(BF16)
    opt = lowbit_compile(torch.optim.AdamW(params), "fp32", master_weights="exact")
    train(params, opt, 2, seed=1)
    for p in params:
        p.copy_(torch.where(torch.rand(p.shape) < 0.5, 0.0, 3.0))
    for p, m in zip(params, master_params(opt)):
        assert m.isfinite().all() and ((m - p.float()).abs() <= 3.0 * 2**-8).all()
    train(params, opt, 1, seed=2)


@torch.no_grad()
def test_an_fp16_master_beyond_65504_is_lost_with_its_param():
    p = torch.nn.Parameter(torch.tensor([65000.0, 1.0], dtype=FP16))
    opt = lowbit_compile(torch.optim.SGD([p], lr=1.0), "fp32", master_weights="exact", backend="cpu")
    p.grad = torch.tensor([-1000.0, 0.0], dtype=FP16)
    opt.step()
    assert p[0].isinf() and master_params(opt)[0][0].isinf() and master_params(opt)[0][1] == 1.0


# lowering coverage ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", slow_but([pytest.param(n, id=n) for n in OPTIMIZERS], "AdamW", "RMSprop-centered"))
def test_every_optimizer_lowers_with_master_weights_on_both_printers(name):
    cls, kwargs = OPTIMIZERS[name]
    for dtype in (BF16, FP16):
        for mode in residual.MODES:
            for fmt in ("fp32", "dynamic8"):
                opt = cls([torch.nn.Parameter(torch.randn(64, dtype=dtype))], **kwargs)
                body = master_graphs(opt, fmt, mode)["split"].body
                for target in (Target("cuda"), Target("cpu"), Target("cpu", reciprocal_divisor=True)):
                    assert unsupported(body, target) == []
                    compile(triton_printer.emit_kernel(body, "step", target).source, "<printed>", "exec")
                    if target.device == "cpu":
                        cpp_printer.emit_step(body, target)


@pytest.mark.slow
def test_master_kernels_compile_for_sm70_and_sm90_without_a_gpu():
    """The CUDA flavor of master-weights kernels (int32 tie-word atomics, uint32 hashes) through
    Triton's real compiler and ptxas, in a fresh interpreter (this one runs Triton interpreted)."""
    code = textwrap.dedent("""
        import torch
        from lowbit_compile.kernels import triton_backend as tb
        from tests.test_master_weights import master_graphs

        # each residual (exact and 8bit, bf16 and fp16) once, on the oldest and newest archs
        cases = [(torch.optim.AdamW, torch.bfloat16, "dynamic8", "exact", (70,)),
                 (torch.optim.SGD, torch.float16, "fp32", "8bit", (90,)),
                 (torch.optim.Adam, torch.bfloat16, "int8", "8bit", (70,)),
                 (torch.optim.RMSprop, torch.float16, "fp32", "exact", (90,))]
        n = 0
        for cls, dtype, fmt, mode, archs in cases:
            opt = cls([torch.nn.Parameter(torch.randn(64, dtype=dtype))], lr=0.01)
            body = master_graphs(opt, fmt, mode)["split"].body
            for arch in archs:
                tb.compile_for_target(body, arch=arch)
                n += 1
        print("compiled", n)
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900,
                          cwd=Path(__file__).resolve().parents[1])
    assert "compiled 4" in done.stdout, done.stderr[-3000:]


def test_the_cli_takes_the_option(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the runner sets the script's argv and path
    monkeypatch.setattr(sys, "path", list(sys.path))
    log = logging.getLogger("lowbit_compile")
    monkeypatch.setattr(log, "handlers", list(log.handlers))
    monkeypatch.setattr(log, "level", log.level)
    assert main(["estimate", "--params", "7B", "--param-dtype", "bf16", "--master-weights", "8bit"]) == 0
    out = capsys.readouterr().out
    assert "master (8bit residual)" in out and "per parameter: 16.000 B stock, 7.016 B low-bit" in out
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
        import torch
        p = torch.nn.Parameter(torch.randn(5000, dtype=torch.bfloat16))
        opt = torch.optim.AdamW([p])
        p.grad = torch.randn_like(p)
        opt.step()
        print("residual:", opt.state[p]["master_residual"].dtype)
    """))
    assert main(["run", "--master-weights", "8bit", "--no-summary", str(script)]) == 0
    assert "residual: torch.int8" in capsys.readouterr().out


@pytest.mark.parametrize("shape", [(33, 40), (300,), (7, 130), (3, 1000), ()])
def test_tie_bits_are_saved_per_row_and_read_back(shape, monkeypatch):
    """Rows of whole bytes save the words' own bytes; other widths are repacked in chunks (forced small
    here): either way row r's bits are the flags of its elements, and loading gives the words back."""
    from lowbit_compile.state import codec

    monkeypatch.setattr(codec, "_CHUNK", 64)
    n = torch.Size(shape).numel()
    flags = torch.rand(n, generator=torch.Generator().manual_seed(0)) < 0.3
    param = torch.empty(shape)
    packed = codec.pack_ties(residual.pack_ties(flags), param)
    rows, width = (shape[0], n // shape[0]) if shape else (1, 1)
    per_row = ((packed["bits"].to(torch.int32)[:, :, None] >> torch.arange(8)) & 1).reshape(rows, -1)
    assert torch.equal(per_row[:, :width].reshape(-1).bool(), flags)
    assert torch.equal(residual.unpack_ties(codec.unpack_ties(packed, param), n), flags)


@pytest.mark.parametrize("mode", ["exact", "8bit"])
def test_the_stock_export_of_a_16_bit_param_keeps_its_fp32_moments(mode):
    """``stock_state_dict`` of a bf16 param with master weights gives its moments in the dtype the
    state holds them in (fp32, what the master's fp32 step keeps), every value as held, never rounded
    to the param's bf16; and the export of a saved checkpoint is the same."""
    params = model_params(BF16)
    opt = lowbit_compile(torch.optim.AdamW(params, weight_decay=0.1), "int8", master_weights=mode, min_8bit_size=0,
                         backend="reference")
    train(params, opt, 2, seed=1)
    for exported in (stock_state_dict(opt), stock_state_dict(torch.load(io.BytesIO(_saved(opt)), weights_only=True))):
        for i, p in enumerate(params):
            for key in ("exp_avg", "exp_avg_sq"):
                value, held = exported["state"][i][key], opt.state[p][key].dequantize()
                assert value.dtype == held.dtype == torch.float32
                assert same_bits(value, held)
    moments = stock_state_dict(opt)["state"][0]["exp_avg"]
    assert not torch.equal(moments, moments.to(BF16).float())  # bf16 would have rounded these


def _saved(opt: torch.optim.Optimizer) -> bytes:
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    return buffer.getvalue()
