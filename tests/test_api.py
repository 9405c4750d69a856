"""The user API: same optimizer object, per-tensor format choice, restore, adoption, re-wrapping,
schedulers without retracing, memory accounting, and clear errors that leave the optimizer untouched."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from bench.shapes import transformer_params
from lowbit_compile import QuantizedState, lowbit_compile, memory_report, optim, restore, trace_count
from lowbit_compile.config import DEFAULT_FMT


def _step(opt, params, n=1, scale=1.0):
    for _ in range(n):
        for p in params:
            p.grad = torch.randn_like(p) * scale
        opt.step()


def test_returns_the_same_optimizer_with_quantized_states():
    params = transformer_params()
    opt = torch.optim.AdamW(params, lr=1e-3)
    groups = opt.param_groups
    out = lowbit_compile(opt)
    # the same object, its class now the low-bit subclass of AdamW (isinstance checks still hold)
    assert out is opt and type(out) is optim.AdamW and isinstance(out, torch.optim.AdamW)
    assert out.param_groups is groups
    _step(opt, params)
    for p in params:
        state = opt.state[p]
        big = p.numel() >= 4096
        for key in ("exp_avg", "exp_avg_sq"):
            assert isinstance(state[key], QuantizedState) == big
            assert state[key].shape == p.shape
        assert state["step"].item() == 1.0


def test_min_8bit_size_decides_on_the_full_shape():
    small, exact = torch.nn.Parameter(torch.randn(63, 65)), torch.nn.Parameter(torch.randn(64, 64))
    opt = lowbit_compile(torch.optim.Adam([small, exact]), min_8bit_size=4096)
    _step(opt, [small, exact])
    assert not isinstance(opt.state[small]["exp_avg"], QuantizedState)
    assert isinstance(opt.state[exact]["exp_avg"], QuantizedState)


def test_fmt_per_state_name():
    p = torch.nn.Parameter(torch.randn(8192))
    opt = lowbit_compile(torch.optim.Adam([p], amsgrad=True), {"exp_avg": "fp8_e4m3", "exp_avg_sq": "dynamic8"})
    _step(opt, [p])
    s = opt.state[p]
    assert s["exp_avg"].fmt.name == "fp8_e4m3" and s["exp_avg_sq"].fmt.name == "dynamic8"
    assert s["exp_avg_sq"].fmt.nonneg and not s["exp_avg"].fmt.nonneg
    assert s["max_exp_avg_sq"].fmt.name == DEFAULT_FMT  # states not named use the default format


def test_restore_returns_stock_fp32_states_and_class_step():
    params = transformer_params()
    opt = lowbit_compile(torch.optim.AdamW(params))
    _step(opt, params, 3)
    quantized = {id(p): opt.state[p]["exp_avg"].dequantize() for p in params if p.numel() >= 4096}
    assert restore(opt) is opt and type(opt) is torch.optim.AdamW
    assert "step" not in opt.__dict__ and not hasattr(opt, "_lowbit")
    for p in params:
        for value in opt.state[p].values():
            assert type(value) is torch.Tensor
        if id(p) in quantized:
            assert torch.equal(opt.state[p]["exp_avg"], quantized[id(p)])
    _step(opt, params)  # the stock step runs on the restored states
    assert opt.state[params[0]]["step"].item() == 4.0


def test_adopting_mid_training_converts_existing_state():
    params = transformer_params()
    opt = torch.optim.AdamW(params)
    _step(opt, params, 5)
    dense = {id(p): opt.state[p]["exp_avg_sq"].clone() for p in params}
    lowbit_compile(opt, "int8")
    for p in params:
        v = opt.state[p]["exp_avg_sq"]
        if p.numel() >= 4096:
            assert isinstance(v, QuantizedState)
            ref = dense[id(p)]
            # one requantization: error within a code step of the block max (plus bf16 patches)
            assert (v.dequantize() - ref).abs().max() <= ref.max() / 255 + 1e-12
        else:
            assert torch.equal(v, dense[id(p)])
    _step(opt, params)
    assert opt.state[params[0]]["step"].item() == 6.0


def test_wrapping_twice_reconfigures_without_double_quantizing():
    params = transformer_params()
    opt = lowbit_compile(torch.optim.Adam(params), "int8")
    _step(opt, params, 2)
    big = params[0]
    before = opt.state[big]["exp_avg"]
    codes = before.codes.clone()
    lowbit_compile(opt, "int8")  # same config: nothing changes
    assert opt.state[big]["exp_avg"] is before and torch.equal(before.codes, codes)
    values = before.dequantize()
    lowbit_compile(opt, "bf16")  # new format: converted from the decoded values, once
    after = opt.state[big]["exp_avg"]
    assert after.fmt.name == "bf16"
    assert torch.equal(after.dequantize(), values.to(torch.bfloat16).float())
    _step(opt, params)  # still the rewritten step, now on bf16 states
    assert opt.state[big]["exp_avg"].fmt.name == "bf16" and opt.state[big]["step"].item() == 3.0
    restore(opt)
    assert "step" not in opt.__dict__


def test_wrapping_again_warns_of_each_option_it_returns_to_its_default():
    """The later call's options replace the earlier ones: one it gives changes silently (asked for), one it
    leaves out returns to its default with a warning naming it, as the states are converted."""
    params = transformer_params(d=64, layers=1)
    opt = optim.AdamW(params, fmt="int8", block_size=256)
    _step(opt, params)
    big = params[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lowbit_compile(opt, fmt="int8", block_size=256)  # the same options: nothing to say
        lowbit_compile(opt, "dynamic8", block_size=256)  # asked for
    assert opt.state[big]["exp_avg"].fmt.name == "dynamic8"
    with pytest.warns(UserWarning, match=r"this AdamW was wrapped with fmt='dynamic8', block_size=256; wrapping it "
                                         rf"again without them, they return to the default fmt='{DEFAULT_FMT}', "
                                         r"block_size=None \(an option a call leaves out"):
        lowbit_compile(opt, min_8bit_size=1000)
    assert opt.state[big]["exp_avg"].fmt.name == DEFAULT_FMT and opt.state[big]["exp_avg"].fmt.block_size == 512
    _step(opt, params)


@pytest.mark.parametrize("tensor_lr", [False, True], ids=["float lr", "tensor lr"])
@pytest.mark.parametrize("order", ["scheduler first", "wrap first"])
def test_lr_schedule_never_retraces(order, tensor_lr):
    params = transformer_params(d=64, layers=1)
    lr = torch.tensor(0.01) if tensor_lr else 0.01
    opt = torch.optim.AdamW(params, lr=lr)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. "lr_scheduler.step() before optimizer.step()"
        if order == "scheduler first":
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.02, total_steps=20)
            lowbit_compile(opt)
        else:
            lowbit_compile(opt)
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.02, total_steps=20)
        _step(opt, params)
        sched.step()
        traces = trace_count()
        lrs = set()
        for _ in range(10):
            _step(opt, params)
            sched.step()
            lrs.add(float(opt.param_groups[0]["lr"]))
    assert len(lrs) == 10
    assert trace_count() == traces


@pytest.mark.parametrize("cls, key, values", [
    (torch.optim.AdamW, "lr", [1, 2, 3, 4, 5]),
    (torch.optim.AdamW, "weight_decay", [0, 1, 2, 3, 4]),
    (torch.optim.SGD, "weight_decay", [1, 2, 3, 4, 5]),
    (torch.optim.Adam, "betas", [(0, 0.9), (0, 0.99), (0, 0.5), (0, 0.8), (0, 0.999)]),  # an int in the tuple
])
def test_python_int_hyperparameters_are_floats_and_never_retrace(cls, key, values):
    """Five int values of a hyperparameter torch.optim declares a float (the first step's branches kept:
    a float crossing 0 retraces too): one trace, as for floats, and each step (fp32 states) bit for bit the
    stock step with that int."""
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(300)), torch.nn.Parameter(torch.randn(20, 30))]
    twin = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = lowbit_compile(cls(ours, lr=0.01), "fp32")
    stock = cls(twin, lr=0.01, foreach=False)
    traces = None
    for value in values:
        for group in (*opt.param_groups, *stock.param_groups):
            group[key] = value
        for p, q in zip(ours, twin):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        opt.step()
        stock.step()
        traces = trace_count() if traces is None else traces
        assert all(torch.equal(p, q) for p, q in zip(ours, twin))
    assert trace_count() == traces


def test_restore_in_a_step_closure_makes_that_step_stock():
    """``restore(opt)`` called by the closure of the step that runs it: the step goes on as the stock one
    (bit for bit a stock twin's, fp32 states), and the optimizer is stock and usable after."""
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(5000)), torch.nn.Parameter(torch.randn(7))]
    twin = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = lowbit_compile(torch.optim.AdamW(ours, lr=0.01), "fp32")
    stock = torch.optim.AdamW(twin, lr=0.01, foreach=False)

    def closure(restoring: bool):
        def run():
            if restoring:
                restore(opt)
            for p, q in zip(ours, twin):
                p.grad = torch.full_like(p, 0.5)
                q.grad = p.grad.clone()
            return torch.tensor(1.0)
        return run

    for restoring in (False, True, False):
        assert opt.step(closure(restoring)).item() == 1.0
        stock.step()
        assert all(torch.equal(p, q) for p, q in zip(ours, twin))
    assert type(opt) is torch.optim.AdamW and not any(isinstance(v, QuantizedState) for v in opt.state[ours[0]].values())


def test_signature_is_traced_once_across_params_and_optimizers():
    lowbit_compile(torch.optim.Adam([torch.nn.Parameter(torch.randn(5000))], lr=0.5))  # warm
    params = transformer_params()
    opt = lowbit_compile(torch.optim.Adam(params, lr=0.1))
    before = trace_count()
    _step(opt, params, 3)
    opt2 = lowbit_compile(torch.optim.Adam(params, lr=0.2))
    _step(opt2, params)
    # one trace per distinct signature: quantized (>= 4096) and fp32 (< 4096) tensors
    assert trace_count() - before <= 2


def test_memory_report_int8_is_about_two_bytes_per_param():
    params = transformer_params(d=256, layers=4, vocab=4096)
    opt = lowbit_compile(torch.optim.AdamW(params), "int8", min_8bit_size=4096)
    _step(opt, params)
    report = memory_report(opt)
    n = sum(p.numel() for p in params)
    assert report.total.params == n
    mv = report.per_state["exp_avg"].bytes + report.per_state["exp_avg_sq"].bytes
    assert mv / n <= 2.05, report
    stock = torch.optim.AdamW(params)
    _step(stock, params)
    stock_report = memory_report(stock)
    assert (stock_report.per_state["exp_avg"].bytes + stock_report.per_state["exp_avg_sq"].bytes) / n == 8.0
    assert "exp_avg" in str(report)


def test_closure_hooks_and_params_without_grad():
    p, q = torch.nn.Parameter(torch.randn(5000)), torch.nn.Parameter(torch.randn(10))
    opt = lowbit_compile(torch.optim.Adam([p, q]))
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))

    def closure():
        p.grad = torch.ones_like(p)
        return torch.tensor(3.0)

    assert opt.step(closure).item() == 3.0
    assert calls == ["pre", "post"]
    assert q not in opt.state and opt.state[p]["step"].item() == 1.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_params_keep_stock_state_dtype(dtype):
    """bf16/fp16 params keep their dtype (and report it for their states) and, with low-bit states,
    step as torch's fused optimizers do: the update in fp32, the param rounded once per step. The
    reference is that: stock fp32 AdamW on an fp32 copy rounded to ``dtype`` after every step."""
    p = torch.nn.Parameter(torch.randn(6000, dtype=dtype))
    q = torch.nn.Parameter(p.detach().float())
    eps = 1e-4 if dtype == torch.float16 else 1e-8
    opt = lowbit_compile(torch.optim.AdamW([p], lr=1e-2, eps=eps), "dynamic8")
    ref = torch.optim.AdamW([q], lr=1e-2, eps=eps, foreach=False)
    for _ in range(5):
        g = torch.randn(6000).to(dtype)
        p.grad, q.grad = g.clone(), g.float()
        opt.step()
        ref.step()
        with torch.no_grad():
            q.copy_(q.to(dtype).float())
    assert p.dtype == dtype and opt.state[p]["exp_avg"].dtype == dtype
    assert torch.isfinite(p).all()
    # within one low-precision rounding of the param plus a fraction of one lr step (8-bit m and v)
    assert (p.float() - q).abs().max() <= 2 * torch.finfo(dtype).eps * q.abs().max() + 5e-3


def test_odd_shapes_and_non_contiguous_params():
    shapes = [torch.randn(()), torch.randn(1), torch.randn(90, 70).t(), torch.randn(4097)]
    params = [torch.nn.Parameter(t) for t in shapes]
    twins = [torch.nn.Parameter(t.detach().clone()) for t in shapes]
    opt = lowbit_compile(torch.optim.Adam(params, lr=1e-2), "int8", min_8bit_size=0, block_size=256)
    ref = torch.optim.Adam(twins, lr=1e-2)
    for _ in range(5):
        for p, q in zip(params, twins):
            g = torch.randn(p.shape)
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
    for p, q in zip(params, twins):
        assert p.shape == q.shape and p.stride() == q.stride()
        assert (p - q).abs().max() <= 2e-2  # at most ~2 lr of drift after 5 steps


# bad input ---------------------------------------------------------------------------------------
def _untouched(opt, params, states):
    assert "step" not in opt.__dict__ and not hasattr(opt, "_lowbit")
    for p in params:
        for k, v in states[id(p)].items():
            assert type(opt.state[p][k]) is torch.Tensor and torch.equal(opt.state[p][k], v)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"fmt": "int4"}, ValueError, "fmt must be one of"),
        ({"fmt": "fp8"}, ValueError, r"got 'fp8' \(did you mean 'fp8_e4m3' or 'fp8_e5m2'\?\)"),
        ({"fmt": "dynamic"}, ValueError, r"\(did you mean 'dynamic8'\?\)"),
        ({"rounding": "stochastc"}, ValueError, r"\(did you mean 'stochastic'\?\)"),
        ({"fmt": {"exp_avg": "fp4"}}, ValueError, r"fmt\['exp_avg'\]"),
        ({"fmt": {"exp_avg": "FP8"}}, ValueError, r"fmt\['exp_avg'\] .*did you mean 'fp8_e4m3' or 'fp8_e5m2'"),
        ({"block_size": 100}, ValueError, "block_size must be a positive power of two"),
        ({"block_size": 0}, ValueError, "block_size"),
        ({"block_size": True}, ValueError, "block_size"),
        ({"outliers": -1}, ValueError, "outliers"),
        ({"min_8bit_size": -5}, ValueError, "min_8bit_size"),
        ({"backend": "cuda"}, ValueError, "backend must be one of"),
        ({"fmt": "8bit"}, ValueError, r"got '8bit': did you mean 'sqrt8' \(the default\)\? The 8-bit formats are"),
        ({"fmt": "4bit"}, ValueError, r"got '4bit': did you mean 'sqrt4'\? The 4-bit formats are \['sqrt4'\]"),
        ({"fmt": {"exp_avg_sq": "nf4"}}, ValueError, r"fmt\['exp_avg_sq'\] .*got 'nf4': did you mean 'sqrt4'"),
        ({"fmt": "int2"}, ValueError, r"got 'int2': 2-bit formats are not available yet; the smallest states here are "
                                      r"4-bit: \['sqrt4'\]"),
        ({"fmt": "sqrt4", "block_size": 1}, ValueError, "block_size must be at least 2 for a 4-bit format"),
        ({"fmt": "16-bit"}, ValueError, r"did you mean 'bf16'\?"),
        ({"overrides": {"": "fp32"}}, ValueError, "an override pattern is empty"),
        ({"overrides": {"re:(": "fp32"}}, ValueError, "'re:\\(' is not a valid regular expression"),
    ],
)
def test_bad_options_fail_early_and_leave_the_optimizer_untouched(kwargs, error, match):
    params = transformer_params(d=64, layers=1)
    opt = torch.optim.AdamW(params)
    _step(opt, params)
    states = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in params}
    with pytest.raises(error, match=match):
        lowbit_compile(opt, **kwargs)
    _untouched(opt, params, states)


_MALFORMED = [
    ("no params", lambda groups: groups.append({"lr": 0.1}), r"param_groups\[1\] has no 'params'"),
    ("lr a string", lambda groups: groups[0].update(lr="0.01"),
     r"param_groups\[0\]\['lr'\] must be a number .*got '0.01' \(a string: use 0.01\)"),
    ("lr None", lambda groups: groups[0].update(lr=None), r"\['lr'\] must be a number or a one-element tensor"),
    ("lr a vector", lambda groups: groups[0].update(lr=torch.tensor([0.1, 0.2])), r"\['lr'\] must be a number"),
    ("betas of one", lambda groups: groups[0].update(betas=(0.9,)),
     r"param_groups\[0\]\['betas'\] must be a tuple of 2 numbers, as the default \(0.9, 0.999\), got \(0.9,\)"),
    ("a beta a string", lambda groups: groups[0].update(betas=(0.9, "x")), r"\['betas'\]\[1\] must be a number"),
    ("no eps", lambda groups: groups[0].pop("eps"), r"param_groups\[0\] has no 'eps' .*add_param_group"),
]


@pytest.mark.parametrize("when", ["wrap", "step"])
@pytest.mark.parametrize("name, damage, match", _MALFORMED, ids=[m[0] for m in _MALFORMED])
def test_a_malformed_param_group_is_named_and_changes_nothing(name, damage, match, when):
    """A group without params, a hyperparameter that is not a number (a config value left a string), a
    tuple of the wrong length, a missing entry: at the wrap or at the next step, an error naming the entry
    and the fix, and every param and state as it was; mended, the optimizer steps on."""
    params = transformer_params(d=64, layers=1)
    opt = torch.optim.AdamW(params, lr=0.01)
    if when == "step":
        lowbit_compile(opt)
    _step(opt, params)
    before = [p.detach().clone() for p in params]
    states = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in params}
    groups = copy.deepcopy([{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups])
    damage(opt.param_groups)
    with pytest.raises(ValueError, match=match):
        lowbit_compile(opt) if when == "wrap" else _step(opt, params)
    assert all(torch.equal(p, b) for p, b in zip(params, before))
    if when == "wrap":
        _untouched(opt, params, states)
    for p in params:
        assert opt.state[p].keys() == states[id(p)].keys()
        assert all(torch.equal(v, states[id(p)][k]) for k, v in opt.state[p].items())
    del opt.param_groups[1:]
    opt.param_groups[0].update(groups[0])
    _step(opt, params)


def test_a_new_param_group_without_params_is_named():
    opt = lowbit_compile(torch.optim.AdamW(transformer_params(d=64, layers=1)))
    with pytest.raises(ValueError, match=r"the new param group \(param_groups\[1\]\) has no 'params'"):
        opt.add_param_group({"lr": 0.1})
    assert len(opt.param_groups) == 1


def test_format_and_rounding_names_are_case_insensitive():
    params = [torch.nn.Parameter(torch.randn(64, 64))]
    opt = lowbit_compile(torch.optim.AdamW(params), fmt={"exp_avg": "INT8", "exp_avg_sq": " Sqrt8"},
                         rounding="Stochastic", min_8bit_size=0)
    _step(opt, params)
    assert opt.state[params[0]]["exp_avg"].fmt.name == "int8"
    assert opt.state[params[0]]["exp_avg_sq"].fmt.name == "sqrt8"
    assert lowbit_compile(opt, fmt="FP8_E4M3", min_8bit_size=0).state[params[0]]["exp_avg"].fmt.name == "fp8_e4m3"


def test_unsupported_optimizer_is_named():
    with pytest.raises(TypeError, match="LBFGS: its step re-evaluates the closure"):
        lowbit_compile(torch.optim.LBFGS([torch.nn.Parameter(torch.randn(3))], lr=0.1))


def test_differentiable_is_refused():
    opt = torch.optim.Adam([torch.nn.Parameter(torch.randn(3))], differentiable=True)
    with pytest.raises(ValueError, match="differentiable=True"):
        lowbit_compile(opt)
    assert "step" not in opt.__dict__


def test_sparse_grad_is_refused_with_the_fix():
    p = torch.nn.Parameter(torch.randn(10, 3))
    opt = lowbit_compile(torch.optim.Adam([p]))
    p.grad = torch.sparse_coo_tensor([[0, 2]], torch.ones(2, 3), (10, 3))
    with pytest.raises(RuntimeError, match="SparseAdam"):
        opt.step()
    assert not opt.state[p]


def test_complex_and_integer_params_are_refused():
    with pytest.raises(TypeError, match="complex"):
        lowbit_compile(torch.optim.Adam([torch.nn.Parameter(torch.randn(3, dtype=torch.complex64))]))
