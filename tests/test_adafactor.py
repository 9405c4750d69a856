"""Adafactor runs in stages like Muon: its row and column factors are states reduced over the
parameter (the pass tells them from per-element ones by their shape) and keep their stock storage; a
vector's per-element ``variance`` is low-bit like any per-element state. fp32 is stock bit for bit on
every optim_db input torch has for it."""

from __future__ import annotations

import pytest
import torch
from expecttest import TestCase

from lowbit_compile import checkpoint, enable, is_wrapped, lowbit_compile, memory_report, optim
from lowbit_compile.config import Config
from lowbit_compile.options import Options
from lowbit_compile.passes.pipeline import Rewrite, rewrite
from lowbit_compile.state import QuantizedState
from lowbit_compile.state.schema import init_state, probe_schema, trace_for
from tests.helpers import assert_same, optim_db_params, saved_and_loaded, state_bits, step_twins, train

STEPS = 6


def _params(dtype=torch.float32):
    """Wide, tall and 3-D tensors (factored over their last two dimensions), a non-contiguous matrix
    and a vector (a per-element variance); of whole multiples of 32 elements (as tests/test_muon.py)."""
    params = [torch.nn.Parameter(torch.randn(s).to(dtype)) for s in [(24, 8), (8, 24), (2, 4, 32), (64,)]]
    params.append(torch.nn.Parameter(torch.randn(32, 12).to(dtype).t()))
    return params


def _twins(kwargs, dtype=torch.float32):
    a = _params(dtype)
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for p, q in zip(a, b):  # keep the non-contiguous layout in the twin
        if not p.is_contiguous():
            q.data = p.detach().t().clone().t()
    groups = lambda ps: [{"params": ps[:2]}, {"params": ps[2:], "lr": 0.03}]  # noqa: E731
    return a, b, torch.optim.Adafactor(groups(a), **kwargs), torch.optim.Adafactor(groups(b), **kwargs)


def _assert_stock(a, b, opt_a, opt_b):
    for p, q in zip(a, b):
        assert torch.equal(p, q)
        assert opt_a.state[p].keys() == opt_b.state[q].keys()
        for key, value in opt_b.state[q].items():
            ours = opt_a.state[p][key]
            assert type(ours) is torch.Tensor and ours.dtype == value.dtype and torch.equal(ours, value), key


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize(("cls", "kwargs"), optim_db_params([torch.optim.Adafactor]))
def test_fp32_is_bitwise_stock(cls, kwargs, backend):
    a, b, opt_a, opt_b = _twins(kwargs)
    lowbit_compile(opt_a, "fp32", backend=backend)
    step_twins(a, b, opt_a, opt_b, steps=STEPS)
    _assert_stock(a, b, opt_a, opt_b)


@pytest.mark.parametrize("kwargs", [{"eps": (1e-30, 1e-3), "weight_decay": 0.1}, {"maximize": True}],
                         ids=["eps1", "maximize"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_fp32_is_bitwise_stock_for_16bit_params(kwargs, dtype):
    """Stock Adafactor keeps a 16-bit parameter's factors and variance in its dtype (and its default
    eps1 is that dtype's epsilon); the staged step with passthrough states does the same."""
    a, b, opt_a, opt_b = _twins(kwargs, dtype)
    lowbit_compile(opt_a, "fp32", backend="cpu")
    step_twins(a, b, opt_a, opt_b, steps=STEPS)
    _assert_stock(a, b, opt_a, opt_b)


def test_reduced_states_are_told_from_per_element_ones_by_the_pass():
    """No list per optimizer: a state of a matrix's shape reduced over a dimension (row and column
    factors) keeps its stock storage; a vector's variance is per element, not proven never negative:
    its lerp weight ``step ** beta2_decay`` is in [0, 1] only for step counts >= 1, which the proof
    does not assume of a scalar state."""
    opt = torch.optim.Adafactor([torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4))])
    matrix, vector = (probe_schema(opt, opt.param_groups[0], p) for p in opt.param_groups[0]["params"])
    assert matrix.shaped and matrix.per_element == ()
    assert {k: v[0] for k, v in matrix.init} == {"row_var": "reduced", "col_var": "reduced", "step": "tensor"}
    assert dict(matrix.init)["row_var"][1] == (True, False) and dict(matrix.init)["col_var"][1] == (False, True)
    assert vector.per_element == ("variance",) and vector.nonneg == frozenset()


def test_factors_of_the_params_shape_stay_stock():
    """A column vector's row factor has the param's shape, yet it is a reduced state (the probe tells it
    at a shape where they differ): it stays stock, and 8-bit formats leave such params stock bit for bit."""
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(64, 1), (1, 64), (1, 1), (3, 1, 5)]]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = lowbit_compile(torch.optim.Adafactor(params, lr=0.01), "int8", min_8bit_size=0, backend="cpu")
    stock = torch.optim.Adafactor(twins, lr=0.01)
    step_twins(params, twins, opt, stock, steps=3)
    _assert_stock(params, twins, opt, stock)


def test_the_adafactor_class_and_enable_step_like_the_explicit_wrap():
    params = _matrices_and_vector()
    by_class, in_scope = ([torch.nn.Parameter(p.detach().clone()) for p in params] for _ in range(2))
    explicit = lowbit_compile(torch.optim.Adafactor(params, lr=0.01))
    train(explicit, params, 3, seed=1)
    train(optim.Adafactor(by_class, lr=0.01), by_class, 3, seed=1)
    with enable():
        scoped = torch.optim.Adafactor(in_scope, lr=0.01)
        train(scoped, in_scope, 3, seed=1)
    assert is_wrapped(scoped) and isinstance(scoped.state[in_scope[1]]["variance"], QuantizedState)
    for p, q, r in zip(params, by_class, in_scope):
        assert torch.equal(p, q) and torch.equal(p, r)


@torch.no_grad()
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_8bit_variance_steps_as_stock_from_its_state_and_factors_stay_stock(backend):
    """By default the vector's variance is 8-bit: each step is stock fp32's from the stored variance,
    within the format's error; every factored tensor steps exactly as stock, its factors fp32 tensors
    of stock's shapes and values."""
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(96, 48), (2, 16, 24), (4096,)]]
    shadow = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = lowbit_compile(torch.optim.Adafactor(params, lr=0.01), backend=backend)
    stock = torch.optim.Adafactor(shadow, lr=0.01)
    gen = torch.Generator().manual_seed(1)
    vector, twin = params[2], shadow[2]
    for _ in range(4):
        twin.data.copy_(vector)
        if vector in opt.state:
            stock.state[twin]["variance"] = opt.state[vector]["variance"].dequantize(torch.float32)
        for p, s in zip(params, shadow):
            p.grad = torch.randn(p.shape, generator=gen)
            s.grad = p.grad.clone()
        opt.step()
        stock.step()
        for p, s in zip(params[:2], shadow[:2]):
            assert torch.equal(p, s)
            for key in ("row_var", "col_var"):
                ours, ref = opt.state[p][key], stock.state[s][key]
                assert type(ours) is torch.Tensor and ours.shape == ref.shape and torch.equal(ours, ref)
        ours, ref = opt.state[vector]["variance"], stock.state[twin]["variance"]
        assert isinstance(ours, QuantizedState) and ours.codes.dtype.itemsize == 1
        assert 0 < (ours.dequantize(torch.float32) - ref).abs().max() < 0.05 * ref.abs().max()
        assert (vector - twin).abs().max() < 1e-4


def _matrices_and_vector():
    return [torch.nn.Parameter(torch.randn(s)) for s in [(96, 48), (4096,)]]


def test_resume_continues_bitwise_like_an_uninterrupted_run():
    params = _matrices_and_vector()
    opt = lowbit_compile(torch.optim.Adafactor(params, lr=0.01))
    train(opt, params, 3, seed=1)
    assert isinstance(opt.state[params[1]]["variance"], QuantizedState)
    saved = saved_and_loaded({"params": [p.detach().clone() for p in params], "optim": opt.state_dict()})
    train(opt, params, 3, seed=2)

    resumed = [torch.nn.Parameter(p) for p in saved["params"]]
    opt2 = lowbit_compile(torch.optim.Adafactor(resumed, lr=0.5))
    opt2.load_state_dict(saved["optim"])
    assert opt2.param_groups[0]["lr"] == 0.01
    train(opt2, resumed, 3, seed=2)
    assert_same([p.detach() for p in params], [q.detach() for q in resumed])
    assert_same(state_bits(opt, params), state_bits(opt2, resumed))
    for key in ("row_var", "col_var"):
        assert torch.equal(opt.state[params[0]][key], opt2.state[resumed[0]][key])


def test_a_stock_checkpoint_loads_and_exports_back_to_stock():
    params = _matrices_and_vector()
    stock = torch.optim.Adafactor(params, lr=0.01)
    train(stock, params, 2, seed=1)
    opt = lowbit_compile(torch.optim.Adafactor(params, lr=0.01))
    opt.load_state_dict(saved_and_loaded(stock.state_dict()))
    assert isinstance(opt.state[params[1]]["variance"], QuantizedState)
    assert torch.equal(opt.state[params[0]]["row_var"], stock.state[params[0]]["row_var"])
    train(opt, params, 1, seed=2)
    again = torch.optim.Adafactor(params, lr=0.01)
    again.load_state_dict(checkpoint.stock_state_dict(opt))
    assert again.state[params[1]]["variance"].dtype == torch.float32
    train(again, params, 1, seed=3)


def test_memory_report_counts_the_factors_in_their_stock_storage():
    params = _matrices_and_vector()
    opt = lowbit_compile(torch.optim.Adafactor(params, lr=0.01))
    train(opt, params, 1, seed=1)
    report = memory_report(opt)
    assert report.per_state["row_var"].bytes == 96 * 4 and report.per_state["col_var"].bytes == 48 * 4
    assert report.per_state["variance"].bytes < 4096 * 1.1


@pytest.mark.parametrize("where", ["param", "grad"])
def test_a_nan_stays_in_its_element_as_in_stock(where):
    """A NaN in the param (its norm) or the grad (the update's norm) is NaN only where stock has it:
    the step takes ``max(eps2, nan)`` and ``max(1.0, nan)`` in stock's argument order (a matrix's NaN
    grad reaches its whole row and column factors, and every element, in stock too)."""
    a, b, opt_a, opt_b = _twins({})
    lowbit_compile(opt_a, "fp32", backend="cpu")
    for p, q in zip(a, b):
        p.grad = torch.randn_like(p)
        q.grad = p.grad.clone()
        for t in (p, q) if where == "param" else (p.grad, q.grad):
            t.data[(1,) * t.dim()] = float("nan")
    opt_a.step()
    opt_b.step()
    for p, q in zip(a, b):
        assert torch.equal(p.isnan(), q.isnan())
        assert p.isnan().sum() == 1 or where == "grad" and p.dim() > 1
        assert torch.equal(p.nan_to_num(), q.nan_to_num())


def test_a_tensor_lr_is_refused_when_wrapped_with_the_fix():
    """Adafactor's ``min(lr, 1 / step ** 0.5)`` compares a tensor lr with a number: refused before anything
    changes, naming the option."""
    opt = torch.optim.Adafactor([torch.nn.Parameter(torch.randn(8, 4))], lr=torch.tensor(0.01))
    with pytest.raises(NotImplementedError, match=r"lr=torch.tensor.*Python float"):
        lowbit_compile(opt)
    assert "step" not in opt.__dict__ and not opt.state


def _staged(shape, fmt="sqrt8"):
    param = torch.nn.Parameter(torch.randn(shape))
    opt = torch.optim.Adafactor([param])
    group = opt.param_groups[0]
    schema = probe_schema(opt, group, param)
    formats = dict(Config.of(Options(fmt, 512, 0, min_8bit_size=0, backend="reference"))
                   .formats_for(param, schema.per_element, nonneg=schema.nonneg))
    traced = trace_for(opt, group, param, init_state(param, schema, formats), schema.per_element,
                       shape=schema.trace_shape(param)).graph
    return rewrite(traced, Rewrite(formats, staged=True))["split"]


class TestAdafactorStages(TestCase):
    def test_a_vectors_8bit_variance_is_read_and_written_in_the_first_fused_stage(self):
        """The update (``rsqrt`` of the variance times the grad) leaves the fused stage as a temporary
        for its norm; the step size from the param's norm enters the last stage as a host number."""
        self.assertExpectedInline(_staged((8,)).code.strip(), """\
def forward(self, param, grad, state_step, variance_codes, variance_scales, variance_patch_values, variance_patch_index, hp_lr, hp_beta2_decay, hp_d, hp_weight_decay):
    tmp_0 = torch.ops.aten.empty_like.default(param, dtype = torch.float32, memory_format = torch.contiguous_format)
    tmp_1 = torch.ops.aten.empty_like.default(param, dtype = torch.float32, memory_format = torch.contiguous_format)
    stage_0 = self.stage_0(param, grad, state_step, variance_codes, variance_scales, variance_patch_values, variance_patch_index, hp_beta2_decay, tmp_0, tmp_1);  grad = variance_codes = variance_scales = variance_patch_values = variance_patch_index = hp_beta2_decay = stage_0 = None
    stage_1 = self.stage_1(state_step, hp_lr, hp_d, tmp_0, tmp_1);  hp_lr = hp_d = tmp_0 = None
    tmp_2 = stage_1[0];  stage_1 = None
    stage_2 = self.stage_2(param, state_step, tmp_1, tmp_2);  param = state_step = tmp_1 = tmp_2 = stage_2 = None
    return None""")

    def test_a_matrixs_factors_are_written_by_torch_ops(self):
        self.assertExpectedInline(_staged((6, 4)).stage_1.code.strip(), """\
def forward(self, grad, state_step, state_row_var, state_col_var, hp_lr, hp_beta2_decay, hp_d, tmp_0):
    add = torch.ops.aten.add.Tensor(state_step, 1);  state_step = None
    _local_scalar_dense = torch.ops.aten._local_scalar_dense.default(add);  add = None
    pow_1 = _local_scalar_dense ** hp_beta2_decay;  hp_beta2_decay = None
    pow_2 = _local_scalar_dense ** 0.5;  _local_scalar_dense = None
    truediv = 1.0 / pow_2;  pow_2 = None
    sym_min = min(hp_lr, truediv);  hp_lr = truediv = None
    linalg_vector_norm = torch.ops.aten.linalg_vector_norm.default(tmp_0);  tmp_0 = None
    _local_scalar_dense_1 = torch.ops.aten._local_scalar_dense.default(linalg_vector_norm);  linalg_vector_norm = None
    truediv_1 = _local_scalar_dense_1 / 4.898979485566356;  _local_scalar_dense_1 = None
    sym_max = max(0.001, truediv_1);  truediv_1 = None
    mul = sym_max * sym_min;  sym_max = sym_min = None
    linalg_vector_norm_1 = torch.ops.aten.linalg_vector_norm.default(grad, 2, [-1], True)
    pow_3 = torch.ops.aten.pow.Tensor_Scalar(linalg_vector_norm_1, 2);  linalg_vector_norm_1 = None
    div = torch.ops.aten.div.Tensor(pow_3, 4);  pow_3 = None
    lerp = torch.ops.aten.lerp.Scalar(state_row_var, div, pow_1);  div = None
    linalg_vector_norm_2 = torch.ops.aten.linalg_vector_norm.default(grad, 2, [-2], True)
    pow_4 = torch.ops.aten.pow.Tensor_Scalar(linalg_vector_norm_2, 2);  linalg_vector_norm_2 = None
    div_1 = torch.ops.aten.div.Tensor(pow_4, 6);  pow_4 = None
    lerp_1 = torch.ops.aten.lerp.Scalar(state_col_var, div_1, pow_1);  div_1 = pow_1 = None
    mm = torch.ops.aten.mm.default(lerp, lerp_1)
    mean = torch.ops.aten.mean.dim(lerp, [-2], True)
    clamp = torch.ops.aten.clamp.default(mean, 1.1920928955078125e-07);  mean = None
    div_2 = torch.ops.aten.div.Tensor(mm, clamp);  mm = clamp = None
    clamp_1 = torch.ops.aten.clamp.default(div_2, 1.4210854715202004e-14);  div_2 = None
    rsqrt = torch.ops.aten.rsqrt.default(clamp_1);  clamp_1 = None
    mul_1 = torch.ops.aten.mul.Tensor(rsqrt, grad);  rsqrt = grad = None
    linalg_vector_norm_3 = torch.ops.aten.linalg_vector_norm.default(mul_1)
    _local_scalar_dense_2 = torch.ops.aten._local_scalar_dense.default(linalg_vector_norm_3);  linalg_vector_norm_3 = None
    mul_2 = 4.898979485566356 * hp_d;  hp_d = None
    truediv_2 = _local_scalar_dense_2 / mul_2;  _local_scalar_dense_2 = mul_2 = None
    sym_max_1 = max(1.0, truediv_2);  truediv_2 = None
    neg = -mul;  mul = None
    truediv_3 = neg / sym_max_1;  neg = sym_max_1 = None
    copy__2 = torch.ops.aten.copy_.default(state_row_var, lerp);  state_row_var = lerp = copy__2 = None
    copy__3 = torch.ops.aten.copy_.default(state_col_var, lerp_1);  state_col_var = lerp_1 = copy__3 = None
    return (mul_1, truediv_3)""")
