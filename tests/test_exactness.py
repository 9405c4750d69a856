"""fmt="fp32" is stock torch.optim bit for bit: every CPU float32 Adam/AdamW input of PyTorch's own
optimizer test database, plus tensor hyperparameters, several param groups and params without grads."""

from __future__ import annotations

import pytest
import torch

from bench.shapes import model_params
from lowbit_compile import lowbit_compile

from .helpers import optim_db_params, slow_but, step_twins, twin_optimizers, twin_params

STEPS = 30
ADAMS = (torch.optim.Adam, torch.optim.AdamW)


EXTRA = [
    pytest.param(torch.optim.Adam, {"lr": torch.tensor(0.01)}, id="Adam-tensor lr"),
    pytest.param(torch.optim.AdamW, {"lr": torch.tensor(0.01), "weight_decay": 0.1, "amsgrad": True},
                 id="AdamW-tensor lr, amsgrad"),
    pytest.param(torch.optim.AdamW, {"lr": torch.tensor(0.01), "betas": (torch.tensor(0.8), torch.tensor(0.99))},
                 id="AdamW-tensor lr and betas"),
    pytest.param(torch.optim.Adam, {"betas": (0.0, 0.5), "eps": 1e-3, "lr": 0.1}, id="Adam-beta1 zero"),
]


@pytest.mark.parametrize(("cls", "kwargs"), slow_but(optim_db_params(ADAMS) + EXTRA, "AdamW-default", "Adam-amsgrad",
                                                     "AdamW-tensor lr and betas"))
def test_fp32_is_bitwise_stock(cls, kwargs):
    a, b, opt_a, opt_b = twin_optimizers(cls, kwargs, {"foreach": False}, {"foreach": False})
    lowbit_compile(opt_a, "fp32")
    step_twins(a, b, opt_a, opt_b, STEPS)
    for p, q in zip(a, b):
        assert torch.equal(p, q)
    for p, q in zip(a, b):
        sa, sb = opt_a.state[p], opt_b.state[q]
        assert sa.keys() == sb.keys()
        for key in sa:
            assert torch.equal(sa[key], sb[key]), key


@pytest.mark.parametrize("impl", [{"foreach": True}, {"fused": True}], ids=["foreach", "fused"])
@pytest.mark.parametrize(("cls", "kwargs"), slow_but(optim_db_params(ADAMS), "AdamW-default"))
def test_fp32_matches_foreach_and_fused_to_rounding(cls, kwargs, impl):
    """foreach/fused reorder the float math; 30 steps stay within a few fp32 ulps of the param
    (relative 1e-6 ~ 8 ulps), far below one lr step (1e-3)."""
    a, b, opt_a, opt_b = twin_optimizers(cls, kwargs, {"foreach": False}, impl)
    lowbit_compile(opt_a, "fp32")
    step_twins(a, b, opt_a, opt_b, STEPS)
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_wrapped_group_keeps_its_fused_flag():
    """A fused=True optimizer is stepped by the traced single-tensor update, and stays fused=True."""
    p = torch.nn.Parameter(torch.randn(10))
    opt = lowbit_compile(torch.optim.AdamW([p], fused=True), "fp32")
    p.grad = torch.ones_like(p)
    opt.step()
    assert opt.param_groups[0]["fused"] is True


BRANCHING = [
    pytest.param(torch.optim.RAdam, {}, id="RAdam (rectification at step 6)"),
    pytest.param(torch.optim.RAdam, {"decoupled_weight_decay": True, "weight_decay": 0.1}, id="RAdam-decoupled"),
    pytest.param(torch.optim.ASGD, {"t0": 4.0}, id="ASGD (averaging from step 4)"),
    pytest.param(torch.optim.Rprop, {}, id="Rprop"),
    pytest.param(torch.optim.NAdam, {}, id="NAdam"),
    pytest.param(torch.optim.Adam, {"amsgrad": True}, id="Adam-amsgrad"),
]


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize(("cls", "kwargs"), slow_but(BRANCHING, "RAdam (rectification at step 6)"))
def test_fp32_is_bitwise_stock_when_params_skip_steps(cls, kwargs, backend):
    """Params whose grads are None on some steps have their own step counts, so a branch on the step
    count (RAdam's rho_t > 5, ASGD's averaging) goes different ways for params of one group in the
    same step: each param takes its own branch, and none is stepped twice."""
    ours = model_params()
    stock = twin_params(ours)
    opt = lowbit_compile(cls(ours, **kwargs), "fp32", min_8bit_size=0, backend=backend)
    ref = cls(stock, **kwargs, foreach=False)
    gen = torch.Generator().manual_seed(3)
    for step in range(STEPS):
        for i, (p, q) in enumerate(zip(ours, stock)):
            if (step + i) % (i + 2) == 0:  # param i skips every (i + 2)-th step, each with its own phase
                p.grad = q.grad = None
                continue
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        opt.step()
        ref.step()
        for p, q in zip(ours, stock):
            assert torch.equal(p, q), (step, tuple(p.shape))
    counts = {opt.state[p]["step"].item() for p in ours}
    assert len(counts) > 3  # the params did go through different numbers of steps


@pytest.mark.slow
@pytest.mark.parametrize("cls", [torch.optim.Adam, torch.optim.AdamW])
def test_fp32_is_bitwise_stock_with_tensor_hyperparameters_changing_in_place(cls):
    """Tensor ``lr``/``betas`` changed in place every step (beta1 through 0, beta2 through 1 - 2**-24):
    stock bit for bit for 40 steps, params at their first step beside params far past it, without a
    trace per step. Torch <= 2.11 decides ``step == 1.0`` inside ``beta ** step``'s fake kernel; taken
    as a guard, it made the read-back step a constant of the graph (wrong from the second step on)."""
    from lowbit_compile import trace_count

    kwargs = {"lr": torch.tensor(0.01), "betas": (torch.tensor(0.9), torch.tensor(0.999)), "weight_decay": 0.1}
    a, b, opt_a, opt_b = twin_optimizers(cls, kwargs, {"foreach": False}, {"foreach": False})
    lowbit_compile(opt_a, "fp32")
    beta1s, beta2s, lrs = [0.9, 0.0, 0.5, 0.99], [0.999, 0.5, 1 - 2**-24], [0.01, 0.003, 0.02]
    before = trace_count()
    for step in range(40):
        for opt in (opt_a, opt_b):
            for group in opt.param_groups:
                if isinstance(group["lr"], torch.Tensor):
                    group["lr"].fill_(lrs[step % 3])
                group["betas"][0].fill_(beta1s[step % 4])
                group["betas"][1].fill_(beta2s[step % 3])
        gen = torch.Generator().manual_seed(step)
        for i, (p, q) in enumerate(zip(a, b)):
            if i == 1 and step < 20:  # this param's first step is step 20
                continue
            p.grad = torch.empty_like(p).copy_(torch.randn(p.shape, generator=gen))
            q.grad = torch.empty_like(q).copy_(p.grad)
        opt_a.step()
        opt_b.step()
        for p, q in zip(a, b):
            assert torch.equal(p, q), step
    assert trace_count() - before <= 6  # per signature (param dtype, layouts, groups), not per step
