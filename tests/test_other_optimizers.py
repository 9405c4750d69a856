"""Beyond Adam: every stock optimizer whose step is elementwise, and one's own (Lion), goes through the
same trace -> passes -> lower pipeline with no per-optimizer code.

fmt="fp32" is the stock ``foreach=False`` step bit for bit on every CPU float32 input of PyTorch's
``optim_db`` for these optimizers (branches on the step count included: RAdam's rectification,
ASGD's averaging); quantized states keep the progress of a small regression; one's own optimizers
with a norm or a shape-dependent update run in stages; the stock ones that cannot run are refused
with the reason.
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch

from bench.other_optimizers import OPTIMIZERS as OTHER_OPTIMIZERS
from bench.other_optimizers import run as run_other
from examples.lion import Lion
from lowbit_compile import QuantizedState, lowbit_compile, restore, trace_count
from lowbit_compile.config import DEFAULT_FMT
from lowbit_compile.passes import trace_cache
from lowbit_compile.runtime import compile
from lowbit_compile.state import schema as state_schema

from .helpers import each_param, optim_db_params, slow_but, step_twins, twin_optimizers

OPTIMIZERS = (torch.optim.SGD, torch.optim.RMSprop, torch.optim.Adagrad, torch.optim.Adamax, torch.optim.NAdam,
              torch.optim.RAdam, torch.optim.Adadelta, torch.optim.ASGD, torch.optim.Rprop)
STEPS = 12  # RAdam's rectification turns on at step 6: both sides of its branch run


EXTRA = [
    pytest.param(torch.optim.ASGD, {"t0": 3.0, "lambd": 0.1}, id="ASGD-averaging starts at step 4"),
    pytest.param(torch.optim.RAdam, {"lr": torch.tensor(0.01)}, id="RAdam-tensor lr"),
    pytest.param(Lion, {"lr": 1e-3, "weight_decay": 0.1}, id="Lion"),
]


def _twins(cls, kwargs):
    """Two copies of helpers.model_params (seven params) in three groups, under two instances of ``cls``
    (the stock ones in their single-tensor implementation)."""
    impl = {"foreach": False} if cls in OPTIMIZERS else {}
    return twin_optimizers(cls, kwargs, impl, impl)


def _reset_caches(monkeypatch):
    """Forget every schema, trace and compiled step of this process for the test's duration."""
    for module, cache in ((trace_cache, "_traces"), (compile, "_compiled"), (state_schema, "_schemas")):
        monkeypatch.setattr(module, cache, type(getattr(module, cache))())


def _assert_same(a, b, opt_a, opt_b):
    for p, q in zip(a, b):
        assert torch.equal(p, q)
        sa, sb = opt_a.state[p], opt_b.state[q]
        assert sa.keys() == sb.keys()
        for key in sa:
            assert torch.equal(sa[key], sb[key]), key


@pytest.mark.parametrize(("cls", "kwargs"), slow_but(optim_db_params(OPTIMIZERS) + EXTRA, "SGD-nesterov", "RAdam-default",
                                                     "Adagrad-Tensor lr", "Lion"))
def test_fp32_is_bitwise_stock(cls, kwargs):
    """Seven params of three groups (differing lr, eps, weight decay), one without a grad every third
    step, a non-contiguous one and a 0-d one; the reference lowering, which runs the traced ops."""
    a, b, opt_a, opt_b = _twins(cls, kwargs)
    lowbit_compile(opt_a, "fp32", backend="reference")
    step_twins(a, b, opt_a, opt_b, steps=STEPS)
    _assert_same(a, b, opt_a, opt_b)


@pytest.mark.parametrize("cls", [*OPTIMIZERS, Lion], ids=lambda c: c.__name__)
def test_fp32_default_backend_is_bitwise_stock(cls):
    """The default backend (on CPU the fused C++ kernel, or the reference where the kernel lacks an
    op, with a warning) keeps fmt="fp32" stock too, both sides of RAdam's branch included."""
    a, b, opt_a, opt_b = _twins(cls, {"lr": 1e-2})
    lowbit_compile(opt_a, "fp32")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "lowbit-compile: the CPU kernel does not cover")
        step_twins(a, b, opt_a, opt_b, steps=8)
    _assert_same(a, b, opt_a, opt_b)


@pytest.mark.filterwarnings("ignore:lowbit-compile. the step of RMSprop takes a square root")
@pytest.mark.parametrize(("cls", "kwargs", "other"), [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, {"momentum": 0.0}),
    (torch.optim.RMSprop, {"momentum": 0.5}, {"momentum": 0.0, "centered": True}),
], ids=["SGD", "RMSprop"])
def test_groups_that_keep_different_states(cls, kwargs, other):
    """Which states a group keeps can hang on a hyperparameter's value (``momentum != 0``): each group
    gets its own layout, and SGD's momentum buffer, a copy of the first gradient, is created quantized."""
    def make(fmt=None):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(64, 80)) for _ in range(2)]
        opt = cls([{"params": params[:1]}, {"params": params[1:], **other}], **kwargs, foreach=False)
        return params, (opt if fmt is None else lowbit_compile(opt, fmt, backend="reference"))

    (a, opt_a), (b, opt_b), (c, opt_c) = make("fp32"), make(), make("int8")
    step_twins(a, b, opt_a, opt_b, steps=4)
    _assert_same(a, b, opt_a, opt_b)
    for p in c:
        p.grad = torch.randn_like(p)
    opt_c.step()
    assert [sorted(set(opt_c.state[p]) - {"rounding_seed"}) for p in c] == [sorted(opt_b.state[q]) for q in b]
    assert all(isinstance(v, QuantizedState) for p in c for v in opt_c.state[p].values() if v.dim())


@pytest.mark.parametrize(("cls", "kwargs"), [
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),  # a state the first step creates
    (torch.optim.ASGD, {"t0": 2.0}),  # scalar states (eta, mu) next to the per-element one
    (Lion, {}),
], ids=["SGD", "ASGD", "Lion"])
def test_checkpoint_resumes_bit_for_bit(cls, kwargs):
    """int8 states through state_dict, torch.save/load(weights_only=True) and load_state_dict into a
    fresh wrapped optimizer: both continue identically."""
    a = [torch.nn.Parameter(torch.randn(64, 80)), torch.nn.Parameter(torch.randn(80))]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt = lowbit_compile(cls(a, **kwargs), "int8", backend="reference")
    for _ in range(3):
        for p in a:
            p.grad = torch.randn_like(p)
        opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    buffer.seek(0)
    for p, q in zip(a, b):
        q.data.copy_(p)
    resumed = lowbit_compile(cls(b, **kwargs), "int8", backend="reference")
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    for _ in range(4):
        for p, q in zip(a, b):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        opt.step()
        resumed.step()
    assert all(torch.equal(p, q) for p, q in zip(a, b))


@pytest.mark.parametrize(("cls", "kwargs", "traces"), [
    # the first step's trace; rho_t > 5 from step 6 on
    (torch.optim.RAdam, {}, [1, 0, 0, 0, 0, 1] + [0] * 10),
    # the first step's trace; mu != 1 from step 6 on (mu = 1 / max(1, step - t0) is written at step 5;
    # the max itself is traced as torch.sym_max, no branch)
    (torch.optim.ASGD, {"t0": 3.0}, [1, 0, 0, 0, 0, 1] + [0] * 10),
], ids=["RAdam", "ASGD"])
def test_a_branch_on_the_step_count_is_traced_once_per_outcome(monkeypatch, cls, kwargs, traces):
    """The traced step checks a branch on a value it computes (``rho_t > 5``) on every step; when it
    goes the other way, that side is traced once (then kept), and the step stays stock bit for bit."""
    _reset_caches(monkeypatch)
    p = torch.nn.Parameter(torch.randn(64, 80))
    q = torch.nn.Parameter(p.detach().clone())
    opt = lowbit_compile(cls([p], **kwargs, foreach=False), "fp32", backend="reference")
    ref = cls([q], **kwargs, foreach=False)
    gen = torch.Generator().manual_seed(0)
    seen = []
    for _ in range(len(traces)):
        g = torch.randn(p.shape, generator=gen)
        p.grad, q.grad = g.clone(), g.clone()
        before = trace_count()
        opt.step()
        ref.step()
        seen.append(trace_count() - before)
    assert seen == traces
    _assert_same([p], [q], opt, ref)


@pytest.mark.parametrize(("cls", "kwargs", "reason"), [
    (torch.optim.LBFGS, {}, "line search"),
    (torch.optim.SparseAdam, {}, "sparse gradients only"),
])
def test_stock_optimizers_that_are_not_elementwise_are_refused_with_the_reason(cls, kwargs, reason):
    opt = cls([torch.nn.Parameter(torch.randn(8, 4))], **kwargs)
    with pytest.raises(TypeError, match=f"cannot rewrite {cls.__name__}: .*{reason}.*not elementwise"):
        lowbit_compile(opt)
    assert "step" not in opt.__dict__


class NormalizedSGD(torch.optim.Optimizer):
    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @each_param
    def step(self, group, p, state):
        p.add_(p.grad / p.grad.norm(), alpha=-group["lr"])


class MatrixDamped(torch.optim.Optimizer):
    """Elementwise on each tensor, but not the same update for a matrix as for its values laid out flat."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @each_param
    def step(self, group, p, state):
        p.add_(p.grad, alpha=-group["lr"] * (0.5 if p.dim() > 1 else 1.0))


class PythonStepCount(torch.optim.Optimizer):
    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @each_param
    def step(self, group, p, state):
        state["t"] = state.get("t", 0) + 1
        p.add_(p.grad, alpha=-group["lr"] / state["t"])


@pytest.mark.parametrize(("cls", "error", "match"), [
    (PythonStepCount, NotImplementedError, "changes state 't', a Python int"),
])
def test_own_optimizers_that_cannot_be_rewritten_are_refused_when_wrapped(cls, error, match):
    """One's own optimizer is traced when it is wrapped, so a refusal comes before any state changes."""
    params = [torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4))]
    opt = cls(params)
    with pytest.raises(error, match=match):
        lowbit_compile(opt)
    assert "step" not in opt.__dict__ and not opt.state


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("cls", [NormalizedSGD, MatrixDamped])
def test_own_optimizers_that_are_not_elementwise_over_the_flat_values_run_in_stages(cls, backend):
    """A norm over the parameter, or an update that depends on its shape: traced at each parameter's
    shape and run in stages (passes/stages.py), stock bit for bit in fp32."""
    params = [torch.nn.Parameter(torch.randn(8, 4)), torch.nn.Parameter(torch.randn(4))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt, stock = lowbit_compile(cls(params), "fp32", backend=backend), cls(twins)
    for _ in range(3):
        for p, q in zip(params, twins):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        opt.step()
        stock.step()
    for p, q in zip(params, twins):
        assert torch.equal(p, q)


def test_own_elementwise_optimizer_holds_8_bit_states_and_restores():
    """Lion (examples/lion.py): its one state in int8 (1 byte/element plus scales and patches)."""
    params = [torch.nn.Parameter(torch.randn(128, 64)), torch.nn.Parameter(torch.randn(64))]
    opt = lowbit_compile(Lion(params, lr=1e-3), "int8", min_8bit_size=4096, backend="reference")
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
    big, small = (opt.state[p]["exp_avg"] for p in params)
    assert isinstance(big, QuantizedState) and big.codes.dtype == torch.int8 and big.codes.numel() == 128 * 64
    assert not isinstance(small, QuantizedState)
    restore(opt)
    assert opt.state[params[0]]["exp_avg"].dtype == torch.float32 and "step" not in opt.__dict__


def test_signs_of_states_are_inferred_from_the_update():
    """Second moments and accumulators get unsigned codes; momenta and averages signed ones."""
    expected = {
        torch.optim.RMSprop: ({"square_avg"}, {"momentum_buffer"}),
        torch.optim.Adagrad: ({"sum"}, set()),
        torch.optim.Adamax: ({"exp_inf"}, {"exp_avg"}),
        torch.optim.Adadelta: ({"square_avg", "acc_delta"}, set()),
        torch.optim.ASGD: (set(), {"ax"}),
        torch.optim.Rprop: ({"step_size"}, {"prev"}),
    }
    for cls, (unsigned, signed) in expected.items():
        p = torch.nn.Parameter(torch.randn(64, 80))
        kwargs = {"momentum": 0.9} if cls is torch.optim.RMSprop else {}
        opt = lowbit_compile(cls([p], **kwargs), "int8", backend="reference")
        p.grad = torch.randn_like(p)
        opt.step()
        nonneg = {k for k, v in opt.state[p].items() if isinstance(v, QuantizedState) and v.fmt.nonneg}
        quantized = {k for k, v in opt.state[p].items() if isinstance(v, QuantizedState)}
        assert (nonneg, quantized - nonneg) == (unsigned, signed), cls.__name__


class SquareEMA(torch.optim.Optimizer):
    """Scales the gradient by an average of its squares; stays finite for any decay."""

    def __init__(self, params, lr=1e-2, decay=0.9):
        super().__init__(params, {"lr": lr, "decay": decay})

    @each_param
    def step(self, group, p, state):
        if not state:
            state["v"] = torch.zeros_like(p)
        v, b = state["v"], group["decay"]
        v.mul_(b).addcmul_(p.grad, p.grad, value=1 - b)
        p.addcdiv_(p.grad, v.abs().add_(1), value=-group["lr"])


def test_a_hyperparameter_leaving_the_range_a_sign_proof_assumed_makes_the_state_signed():
    """``v = b * v + (1 - b) * g * g`` is proven >= 0 for ``b`` in [0, 1]; the proof's range is checked
    on every step, so ``b`` set to 1.5 (v may now go negative) is seen on the next step, which stores
    v signed from then on."""
    p = torch.nn.Parameter(torch.randn(64, 80))
    q = torch.nn.Parameter(p.detach().clone())
    opt, ref = lowbit_compile(SquareEMA([p]), "bf16", backend="reference"), SquareEMA([q])
    gen = torch.Generator().manual_seed(0)
    for step in range(5):
        if step == 2:
            opt.param_groups[0]["decay"] = ref.param_groups[0]["decay"] = 1.5
        g = torch.randn(p.shape, generator=gen)
        p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        ref.step()
        assert opt.state[p]["v"].fmt.nonneg == (step < 2)
    assert (ref.state[q]["v"] < 0).any()
    # bf16 keeps 8 significant bits of v: each step's scale 1 / (|v| + 1) is off by < 2**-8 relative,
    # so after 5 steps of at most lr * |g| (|g| < 5 here) the params differ by < 5 * 5 * lr * 2**-8
    torch.testing.assert_close(p, q, rtol=0, atol=5 * 5 * 1e-2 * 2**-8)


def test_centered_rmsprop_warns_that_quantized_states_can_make_its_step_nan(monkeypatch):
    """sqrt(square_avg - grad_avg**2) stays >= 0 in fp32 only by cancellation: quantizing the two
    states breaks it (a full-batch fit goes NaN with int8 states); the warning names them and the fix."""
    _reset_caches(monkeypatch)
    p = torch.nn.Parameter(torch.randn(64, 80))
    opt = lowbit_compile(torch.optim.RMSprop([p], centered=True), "int8", backend="reference")
    p.grad = torch.randn_like(p)
    with pytest.warns(UserWarning, match=r"\['grad_avg', 'square_avg'\].*'grad_avg': 'fp32', 'square_avg': 'fp32'"):
        opt.step()
    q = torch.nn.Parameter(torch.randn(64, 80))
    opt = lowbit_compile(torch.optim.RMSprop([q], centered=True),
                         {"grad_avg": "fp32", "square_avg": "fp32", "momentum_buffer": "int8"}, backend="reference")
    q.grad = torch.randn_like(q)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()


# Learning with quantized states ----------------------------------------------------------------
QUALITY = {
    torch.optim.SGD: {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-4},
    torch.optim.RMSprop: {"lr": 1e-3, "momentum": 0.5},
    torch.optim.Adagrad: {"lr": 3e-2},
    torch.optim.Adamax: {"lr": 1e-2},
    torch.optim.NAdam: {"lr": 3e-3},
    torch.optim.RAdam: {"lr": 1e-2, "decoupled_weight_decay": True, "weight_decay": 0.01},
    torch.optim.Adadelta: {"lr": 1.0},
    torch.optim.ASGD: {"lr": 0.1, "t0": 50},
    torch.optim.Rprop: {"lr": 1e-3},
    Lion: {"lr": 1e-3, "weight_decay": 0.1},
}


def _fit(cls, kwargs, fmt, steps=60):
    """A teacher-student regression (16 -> 64 -> 1 MLP, 512 samples, full batch): validation loss
    before and after ``steps`` steps."""
    g = torch.Generator().manual_seed(0)
    w1, w2 = torch.randn(16, 32, generator=g) / 4, torch.randn(32, 1, generator=g) / 4
    x = torch.randn(1024, 16, generator=g)
    y = torch.tanh(x @ w1) @ w2 + 0.05 * torch.randn(1024, 1, generator=g)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    opt = cls(model.parameters(), **kwargs)
    if fmt is not None:
        lowbit_compile(opt, fmt, min_8bit_size=0, block_size=256, backend="reference")

    def val():
        with torch.no_grad():
            return torch.nn.functional.mse_loss(model(x[512:]), y[512:]).item()

    start = val()
    for _ in range(steps):
        loss = torch.nn.functional.mse_loss(model(x[:512]), y[:512])
        opt.zero_grad()
        loss.backward()
        opt.step()
    return start, val()


@pytest.mark.slow
@pytest.mark.parametrize("cls", list(QUALITY), ids=lambda c: c.__name__)
def test_int8_states_keep_the_progress_of_fp32(cls):
    """int8 states (256-element blocks, 2 patches) keep at least 98% of the validation-loss drop of
    the stock fp32 optimizer. Measured at this seed (fraction kept): SGD 1.000, RMSprop 0.998,
    Adagrad 0.999, Adamax 1.000, NAdam 0.997, RAdam 1.005, Adadelta 1.001, ASGD 1.000, Rprop 1.000,
    Lion 1.002; the bound leaves ~7x the worst gap."""
    start, stock = _fit(cls, QUALITY[cls], None)
    _, ours = _fit(cls, QUALITY[cls], "int8")
    assert stock < 0.5 * start  # the task is learned at all
    assert (start - ours) >= 0.98 * (start - stock), (start, stock, ours)


# On a real task: the digits classifier of bench/tasks.py (bench/other_optimizers.py runs 3 seeds
# and the Zipf task too). Worse than stock by at most this fraction of the final validation loss,
# seed 0, default format. Measured (bench/other_optimizers.py, 3 seeds, % gap): SGD -0.13 ± 0.03,
# RMSprop -0.13 ± 0.13, Adagrad -0.12 ± 0.34, Adamax +0.00 ± 0.01, NAdam -0.01 ± 0.44, RAdam -1.12 ±
# 0.11, Adadelta -0.04 ± 0.04, ASGD 0 (its quantized state, the average, does not feed the update),
# Lion +3.80 ± 0.50 (dynamic8 map version 2, seeds 0, 1, 2: +4.12, +4.06, +3.21; int8 +2.47): its
# beta2 = 0.99 momentum moves 1% a step, under one code gap of the 8-bit map near the block maximum,
# so nearest rounding makes it lag (the +2.08 measured before issue 13 came from a bias, a negative
# block extreme shrinking 0.7% per re-quantization). bench/rounding.py's stochastic-rounding
# prototype removes the lag (-0.39 ± 0.13), and so does rounding="stochastic" in the kernels (-0.23 ±
# 0.07; tested here with rounding to nearest, the default). Rprop -4.6 ± 16 (sign-driven steps on minibatches: two stock runs
# with different seeds differ by 15%).
WORSE_AT_MOST = {name: 0.01 for name in OTHER_OPTIMIZERS} | {"Lion (examples/lion.py)": 0.05, "Rprop": 0.10}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(OTHER_OPTIMIZERS))
def test_default_states_train_the_digits_classifier_like_stock(name):
    stock = run_other("digits", name, None, seed=0)
    ours = run_other("digits", name, DEFAULT_FMT, seed=0)
    assert stock["acc"] > 0.9  # the task is learned at all
    assert ours["loss"] <= stock["loss"] * (1 + WORSE_AT_MOST[name]), (stock, ours)
