"""Which group changes make a new step signature: a schedule of any real numbers is traced once, and
the process-wide caches of signatures stay bounded however many a run goes through."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from lowbit_compile import lowbit_compile, trace_count
from lowbit_compile.passes import trace_cache
from lowbit_compile.passes.trace_cache import LruCache
from lowbit_compile.runtime import compile, run

from .helpers import each_param


def _pair(lr):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in [(64, 80), (80,)]]
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = lowbit_compile(torch.optim.AdamW(params, lr=lr, weight_decay=0.1), "fp32")
    stock = torch.optim.AdamW(twin, lr=lr, weight_decay=0.1, foreach=False)
    return params, twin, opt, stock


def _step(params, twin, opt, stock, gen):
    for p, q in zip(params, twin):
        p.grad = torch.randn(p.shape, generator=gen)
        q.grad = p.grad.clone()
    opt.step()
    stock.step()


@pytest.mark.parametrize("kind", [np.float64, np.float32, Fraction])
def test_a_schedule_of_real_numbers_is_traced_once(kind):
    """An lr a numpy schedule writes (np.float64, np.float32) or a Fraction is a hyperparameter like a
    float: a new value each step, one trace. fp32 stays stock bit for bit where stock computes with
    the value as a Python float does (np.float32 arithmetic rounds in float32 in stock's own step)."""
    values = [kind(1, 1000 + 10 * k) if kind is Fraction else kind(1e-3 * (1 - k / 10)) for k in range(6)]
    params, twin, opt, stock = _pair(values[0])
    gen = torch.Generator().manual_seed(1)
    _step(params, twin, opt, stock, gen)
    traced = trace_count()
    for lr in values[1:]:
        for o in (opt, stock):
            o.param_groups[0]["lr"] = lr
        _step(params, twin, opt, stock, gen)
        if kind is not np.float32:
            assert all(torch.equal(p, q) for p, q in zip(params, twin)), lr
    assert trace_count() == traced


def test_a_thousand_group_signatures_keep_the_caches_bounded(monkeypatch):
    """A group entry that is new each step (a string tag) is a new signature each step: the caches of
    signatures, traces and compiled steps keep their most recent ones only, and steps stay right."""
    for i in range(1000):
        run.group_signature({"params": [], "lr": 1e-3, "tag": f"run {i}"})
    assert 0 < len(run._signatures) <= run._signatures.limit < 1000
    monkeypatch.setattr(trace_cache, "_traces", LruCache(3))
    monkeypatch.setattr(compile, "_compiled", LruCache(3))
    params, twin, opt, stock = _pair(1e-3)
    gen = torch.Generator().manual_seed(2)
    for i in range(6):
        opt.param_groups[0]["tag"] = stock.param_groups[0]["tag"] = f"step {i}"
        _step(params, twin, opt, stock, gen)
        assert all(torch.equal(p, q) for p, q in zip(params, twin)), i
    assert len(trace_cache._traces) <= 3 and len(compile._compiled) <= 3


def test_an_int_entry_the_step_never_reads_is_traced_once():
    """A user's own group entry written every step (an epoch count) is no part of the step: 300 steps,
    one trace at most (none if AdamW was traced before), fp32 stock bit for bit."""
    params, twin, opt, stock = _pair(1e-3)
    gen = torch.Generator().manual_seed(3)
    opt.param_groups[0]["epoch"] = stock.param_groups[0]["epoch"] = 0
    _step(params, twin, opt, stock, gen)
    traced = trace_count()
    for n in range(1, 300):
        opt.param_groups[0]["epoch"] = stock.param_groups[0]["epoch"] = n
        _step(params, twin, opt, stock, gen)
    assert trace_count() == traced
    assert all(torch.equal(p, q) for p, q in zip(params, twin))


class _Repeated(torch.optim.Optimizer):
    """Momentum SGD whose int entry ``repeat`` says how many times the update is applied: an int the
    step reads as a Python int (a loop count), baked into its trace."""

    def __init__(self, params, lr=0.01, repeat=1):
        super().__init__(params, {"lr": lr, "repeat": repeat})

    @each_param
    def step(self, group, p, state):
        if not state:
            state["buf"] = torch.zeros_like(p)
        state["buf"].mul_(0.9).add_(p.grad)
        for _ in range(group["repeat"]):
            p.sub_(state["buf"], alpha=group["lr"])


def test_an_int_entry_the_step_reads_keeps_its_meaning():
    """Changing an int the step reads gives the step it reads (a new trace), stock bit for bit, and
    an unread entry beside it changes nothing."""
    gen = torch.Generator().manual_seed(4)
    params = [torch.nn.Parameter(torch.randn(64, 80, generator=gen))]
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = lowbit_compile(_Repeated(params), "fp32")
    stock = _Repeated(twin)
    for k, repeat in enumerate([1, 1, 3, 3, 2, 1]):
        for o in (opt, stock):
            o.param_groups[0]["repeat"] = repeat
            o.param_groups[0]["epoch"] = k
        _step(params, twin, opt, stock, gen)
        assert all(torch.equal(p, q) for p, q in zip(params, twin)), (k, repeat)



class _Optional(torch.optim.Optimizer):
    """Momentum SGD that reads its int ``extra`` (a loop count) only at a large lr: a branch on a
    hyperparameter, so a trace at a small lr never reads it."""

    def __init__(self, params, lr=0.01):
        super().__init__(params, {"lr": lr, "extra": 1})

    @each_param
    def step(self, group, p, state):
        if not state:
            state["buf"] = torch.zeros_like(p)
        state["buf"].mul_(0.9).add_(p.grad)
        for _ in range(group["extra"] if group["lr"] > 0.05 else 1):
            p.sub_(state["buf"], alpha=group["lr"])


def test_an_entry_first_read_by_a_later_trace_separates_groups_prepared_together():
    """Traced first at a small lr, where it does not read ``extra``, the step keys its signatures
    without it; two groups that then take a large lr with different ``extra`` in the same step get
    their own steps (the preparation sees a trace read more and prepares again), stock bit for bit."""
    gen = torch.Generator().manual_seed(5)
    params = [torch.nn.Parameter(torch.randn(64, 80, generator=gen)) for _ in range(2)]
    twin = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = lowbit_compile(_Optional([{"params": [p], "extra": e} for p, e in zip(params, (1, 3))]), "fp32")
    stock = _Optional([{"params": [p], "extra": e} for p, e in zip(twin, (1, 3))])
    _step(params, twin, opt, stock, gen)
    for o in (opt, stock):
        for group in o.param_groups:
            group["lr"] = 0.1
    for k in range(3):
        _step(params, twin, opt, stock, gen)
        assert all(torch.equal(p, q) for p, q in zip(params, twin)), k
