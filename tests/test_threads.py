"""First steps of several optimizers in several threads at once: tracing and kernel builds are
serialized (one lock around a signature's trace-rewrite-build), so every thread gets the result a
sequential run gets, and each signature is traced once."""

from __future__ import annotations

import threading

import pytest
import torch

from lowbit_compile import lowbit_compile, trace_count
from lowbit_compile.passes import trace_cache
from lowbit_compile.runtime import compile
from lowbit_compile.state import schema as state_schema

CASES = [(torch.optim.AdamW, {"weight_decay": 0.1}), (torch.optim.Adam, {"amsgrad": True}),
         (torch.optim.RAdam, {}), (torch.optim.NAdam, {}), (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
         (torch.optim.Adagrad, {})]


def _run(cls, kwargs, seed, backend):
    gen = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(5000, generator=gen)), torch.nn.Parameter(torch.randn(64, 70, generator=gen))]
    opt = lowbit_compile(cls(params, **kwargs), "int8", backend=backend)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return [p.detach().clone() for p in params]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_first_steps_in_many_threads_match_a_sequential_run(monkeypatch, backend):
    for module, cache in ((trace_cache, "_traces"), (compile, "_compiled"), (state_schema, "_schemas")):
        monkeypatch.setattr(module, cache, type(getattr(module, cache))())
    jobs = [(cls, kwargs, seed) for seed in range(2) for cls, kwargs in CASES]
    results: dict[int, list] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(jobs))

    def work(k, cls, kwargs, seed):
        try:
            barrier.wait()
            results[k] = _run(cls, kwargs, seed, backend)
        except BaseException as err:  # noqa: B036 - reported below
            errors.append(err)

    traced_before = trace_count()
    threads = [threading.Thread(target=work, args=(k, *job)) for k, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    traces = trace_count() - traced_before
    for k, (cls, kwargs, seed) in enumerate(jobs):
        for a, b in zip(results[k], _run(cls, kwargs, seed, backend)):
            assert torch.equal(a, b), (cls.__name__, seed)
    assert trace_count() - traced_before == traces  # the sequential reruns found every trace cached


def test_one_optimizer_stepped_from_two_threads_loses_no_step():
    """Two threads stepping one wrapped optimizer take turns: every step counts (the step counts and
    params are those of 2 x 40 sequential steps with the same constant grads)."""
    params = [torch.nn.Parameter(torch.zeros(n)) for n in range(60, 300, 8)]
    twin = [torch.nn.Parameter(torch.zeros(n)) for n in range(60, 300, 8)]
    for p, q in zip(params, twin):
        p.grad, q.grad = torch.ones(p.shape), torch.ones(p.shape)
    opt = lowbit_compile(torch.optim.Adam(params, lr=0.01), "fp32")
    stock = torch.optim.Adam(twin, lr=0.01, foreach=False)
    opt.step()
    barrier = threading.Barrier(2)

    def work():
        barrier.wait()
        for _ in range(40):
            opt.step()

    threads = [threading.Thread(target=work) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for _ in range(81):
        stock.step()
    assert [float(opt.state[p]["step"]) for p in params] == [81.0] * len(params)
    assert all(torch.equal(p, q) for p, q in zip(params, twin))
