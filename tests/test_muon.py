"""Muon, a step that is not elementwise (Newton-Schulz matmuls over each matrix), runs in stages:
fp32 is stock bit for bit on every optim_db input torch has for it, its 8-bit momentum resumes exactly."""

from __future__ import annotations

import io

import pytest
import torch
from torch.testing._internal.common_optimizers import optim_db

from lowbit_compile import checkpoint, lowbit_compile
from lowbit_compile.state import QuantizedState

STEPS = 8


def _db_inputs():
    """optim_db's CPU float32 inputs for Muon."""
    info = next(i for i in optim_db if i.optim_cls is torch.optim.Muon)
    return [pytest.param(dict(inp.kwargs), id=inp.desc)
            for inp in info.optim_inputs_func(device="cpu", dtype=torch.float32)]


def _params():
    """Wide, tall and square matrices (the step transposes tall ones), and a non-contiguous one."""
    params = [torch.nn.Parameter(torch.randn(s)) for s in [(24, 8), (8, 24), (12, 12)]]
    params.append(torch.nn.Parameter(torch.randn(20, 12).t()))
    return params


def _twins(kwargs, split=True):
    a = _params()
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for p, q in zip(a, b):  # keep the non-contiguous layout in the twin
        if not p.is_contiguous():
            q.data = p.detach().t().clone().t()
    groups = (lambda ps: [{"params": ps[:2]}, {"params": ps[2:], "lr": 0.03, "momentum": 0.9}]) if split else list
    return a, b, torch.optim.Muon(groups(a), **kwargs), torch.optim.Muon(groups(b), **kwargs)


def _run(a, b, opt_a, opt_b, steps=STEPS):
    gen = torch.Generator().manual_seed(1)
    for step in range(steps):
        for i, (p, q) in enumerate(zip(a, b)):
            if i == 1 and step % 3 == 0:  # this param sometimes has no grad
                p.grad = q.grad = None
                continue
            g = torch.randn(p.shape, generator=gen)
            p.grad, q.grad = torch.empty_like(p).copy_(g), torch.empty_like(q).copy_(g)
        opt_a.step()
        opt_b.step()


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("kwargs", _db_inputs())
def test_fp32_is_bitwise_stock(kwargs, backend):
    a, b, opt_a, opt_b = _twins(kwargs)
    lowbit_compile(opt_a, "fp32", backend=backend)
    _run(a, b, opt_a, opt_b)
    for p, q in zip(a, b):
        assert torch.equal(p, q)
        assert torch.equal(opt_a.state[p]["momentum_buffer"], opt_b.state[q]["momentum_buffer"])


def test_fp32_is_bitwise_stock_on_triton():
    a, b, opt_a, opt_b = _twins({})
    lowbit_compile(opt_a, "fp32", backend="triton")
    _run(a, b, opt_a, opt_b, steps=3)
    for p, q in zip(a, b):
        assert torch.equal(p, q)


def _saved_and_loaded(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _train(opt, params, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()


def _matrices():
    return [torch.nn.Parameter(torch.randn(s)) for s in [(96, 48), (48, 96)]]


def test_8bit_momentum_trains_close_to_stock():
    params = _matrices()
    stock = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = lowbit_compile(torch.optim.Muon(params, lr=0.02), min_8bit_size=0)
    _train(opt, params, 5, seed=1)
    _train(torch.optim.Muon(stock, lr=0.02), stock, 5, seed=1)
    for p, q in zip(params, stock):
        assert isinstance(opt.state[p]["momentum_buffer"], QuantizedState)
        assert opt.state[p]["momentum_buffer"].fmt.name == "sqrt8"
        assert (p - q).abs().max() < 1e-3  # one step moves each element by about lr * 0.2


def test_8bit_momentum_is_the_reference_lowering_bitwise():
    params = _matrices()
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = lowbit_compile(torch.optim.Muon(params, lr=0.02), min_8bit_size=0, backend="cpu")
    opt_ref = lowbit_compile(torch.optim.Muon(ref, lr=0.02), min_8bit_size=0, backend="reference")
    _train(opt, params, 3, seed=1)
    _train(opt_ref, ref, 3, seed=1)
    for p, q in zip(params, ref):
        assert torch.equal(p, q)
        assert all(torch.equal(x, y) for x, y in zip(opt.state[p]["momentum_buffer"].storage_parts,
                                                       opt_ref.state[q]["momentum_buffer"].storage_parts))


def test_resume_continues_bitwise_like_an_uninterrupted_run():
    params = _matrices()
    opt = lowbit_compile(torch.optim.Muon(params, lr=0.02), min_8bit_size=0)
    _train(opt, params, 3, seed=1)
    saved = _saved_and_loaded({"params": [p.detach().clone() for p in params], "optim": opt.state_dict()})
    _train(opt, params, 3, seed=2)

    resumed = [torch.nn.Parameter(p) for p in saved["params"]]
    opt2 = lowbit_compile(torch.optim.Muon(resumed, lr=0.5), min_8bit_size=0)
    opt2.load_state_dict(saved["optim"])
    assert opt2.param_groups[0]["lr"] == 0.02
    _train(opt2, resumed, 3, seed=2)
    for p, q in zip(params, resumed):
        assert torch.equal(p, q)
        assert all(torch.equal(x, y) for x, y in zip(opt.state[p]["momentum_buffer"].storage_parts,
                                                       opt2.state[q]["momentum_buffer"].storage_parts))


def test_a_stock_checkpoint_loads_quantized_and_exports_back_to_stock():
    params = _matrices()
    stock = torch.optim.Muon(params, lr=0.02)
    _train(stock, params, 2, seed=1)
    opt = lowbit_compile(torch.optim.Muon(params, lr=0.02), min_8bit_size=0)
    opt.load_state_dict(_saved_and_loaded(stock.state_dict()))
    for p in params:
        value = opt.state[p]["momentum_buffer"]
        assert isinstance(value, QuantizedState)
        assert torch.equal(value.dequantize(), QuantizedState.from_dense(stock.state[p]["momentum_buffer"],
                                                                         value.fmt).dequantize())
    _train(opt, params, 1, seed=2)
    again = torch.optim.Muon(params, lr=0.02)
    again.load_state_dict(checkpoint.stock_state_dict(opt))
    _train(again, params, 1, seed=3)
