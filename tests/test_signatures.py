"""Which group changes make a new step signature: a schedule of any real numbers is traced once, and
the process-wide caches of signatures stay bounded however many a run goes through."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from lowbit_compile import compile, lowbit_compile, run, trace_cache, trace_count
from lowbit_compile.trace_cache import LruCache


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
