"""Muon, a step that is not elementwise (Newton-Schulz matmuls over each matrix), runs in stages:
fp32 is stock bit for bit on every optim_db input torch has for it, its 8-bit momentum resumes exactly."""

from __future__ import annotations

import pytest
import torch
from torch.testing._internal.common_optimizers import optim_db

from lowbit_compile import checkpoint, enable, is_wrapped, lowbit_compile, memory_report, optim, stats
from lowbit_compile.state import QuantizedState
from tests.helpers import assert_same, run_command, saved_and_loaded, state_bits, step_twins, train

STEPS = 8


def _db_inputs():
    """optim_db's CPU float32 inputs for Muon."""
    info = next(i for i in optim_db if i.optim_cls is torch.optim.Muon)
    return [pytest.param(dict(inp.kwargs), id=inp.desc)
            for inp in info.optim_inputs_func(device="cpu", dtype=torch.float32)]


def _params(dtype=torch.float32):
    """Wide, tall and square matrices (the step transposes tall ones), and a non-contiguous one; of
    whole multiples of 32 elements: ATen's CPU bf16/fp16 kernels step a last (n mod 32) elements
    through a path that rounds an add with alpha differently (tests/test_cpu_lowering.py)."""
    params = [torch.nn.Parameter(torch.randn(s).to(dtype)) for s in [(24, 8), (8, 24), (16, 16)]]
    params.append(torch.nn.Parameter(torch.randn(32, 12).to(dtype).t()))
    return params


def _twins(kwargs, split=True, dtype=torch.float32):
    a = _params(dtype)
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    for p, q in zip(a, b):  # keep the non-contiguous layout in the twin
        if not p.is_contiguous():
            q.data = p.detach().t().clone().t()
    groups = (lambda ps: [{"params": ps[:2]}, {"params": ps[2:], "lr": 0.03, "momentum": 0.9}]) if split else list
    return a, b, torch.optim.Muon(groups(a), **kwargs), torch.optim.Muon(groups(b), **kwargs)


@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("kwargs", _db_inputs())
def test_fp32_is_bitwise_stock(kwargs, backend):
    a, b, opt_a, opt_b = _twins(kwargs)
    lowbit_compile(opt_a, "fp32", backend=backend)
    step_twins(a, b, opt_a, opt_b, steps=STEPS)
    for p, q in zip(a, b):
        assert torch.equal(p, q)
        assert torch.equal(opt_a.state[p]["momentum_buffer"], opt_b.state[q]["momentum_buffer"])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kwargs", _db_inputs())
def test_fp32_is_bitwise_stock_for_16bit_params(kwargs, dtype):
    """Stock Muon steps a bf16/fp16 matrix in its dtype (a momentum of that dtype, Newton-Schulz in
    bf16); the staged step with fp32 (passthrough) states does the same bit for bit on the CPU kernel,
    which rounds as ATen's loop for the layouts of the param and the update (a tall matrix's update is
    transposed: ATen steps it element by element, rounding ``alpha * update`` to bf16 first)."""
    a, b, opt_a, opt_b = _twins(kwargs, dtype=dtype)
    lowbit_compile(opt_a, "fp32", backend="cpu")
    step_twins(a, b, opt_a, opt_b, steps=STEPS)
    for p, q in zip(a, b):
        assert p.dtype == dtype and torch.equal(p, q)
        assert torch.equal(opt_a.state[p]["momentum_buffer"], opt_b.state[q]["momentum_buffer"])


@torch.no_grad()
@pytest.mark.parametrize("backend", ["cpu", "reference"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_8bit_momentum_of_16bit_params_steps_as_stock_fp32_from_its_state(dtype, backend):
    """With an 8-bit momentum a 16-bit matrix steps in fp32 and rounds once (as for every optimizer):
    each step is stock fp32 Muon's, from the param and the stored momentum, rounded to the param's
    dtype bit for bit (Newton-Schulz still takes the bf16 update); the new momentum is stored within
    the format's error."""
    params = [torch.nn.Parameter(p.detach().to(dtype)) for p in _matrices()]
    opt = lowbit_compile(torch.optim.Muon(params, lr=0.02), min_8bit_size=0, backend=backend)
    gen = torch.Generator().manual_seed(1)
    for _ in range(4):
        shadow = [torch.nn.Parameter(p.detach().float()) for p in params]
        stock = torch.optim.Muon(shadow, lr=0.02)
        for p, s in zip(params, shadow):
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
            s.grad = p.grad.float()
            if p in opt.state:
                stock.state[s] = {"momentum_buffer": opt.state[p]["momentum_buffer"].dequantize(torch.float32)}
        stock.step()
        opt.step()
        for p, s in zip(params, shadow):
            assert p.dtype == dtype and torch.equal(p, s.detach().to(dtype))
            buf, ours = stock.state[s]["momentum_buffer"], opt.state[p]["momentum_buffer"]
            assert isinstance(ours, QuantizedState) and ours.dtype == dtype
            assert 0 < (ours.dequantize(torch.float32) - buf).abs().max() < 0.02 * buf.abs().max()


def test_fp32_is_bitwise_stock_on_triton():
    a, b, opt_a, opt_b = _twins({})
    lowbit_compile(opt_a, "fp32", backend="triton")
    step_twins(a, b, opt_a, opt_b, steps=3)
    for p, q in zip(a, b):
        assert torch.equal(p, q)


def _matrices():
    return [torch.nn.Parameter(torch.randn(s)) for s in [(96, 48), (48, 96)]]


def test_8bit_momentum_trains_close_to_stock():
    params = _matrices()
    stock = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = lowbit_compile(torch.optim.Muon(params, lr=0.02), min_8bit_size=0)
    train(opt, params, 5, seed=1)
    train(torch.optim.Muon(stock, lr=0.02), stock, 5, seed=1)
    for p, q in zip(params, stock):
        assert isinstance(opt.state[p]["momentum_buffer"], QuantizedState)
        assert opt.state[p]["momentum_buffer"].fmt.name == "sqrt8"
        assert (p - q).abs().max() < 1e-3  # one step moves each element by about lr * 0.2


def test_8bit_momentum_is_the_reference_lowering_bitwise():
    params = _matrices()
    ref = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = lowbit_compile(torch.optim.Muon(params, lr=0.02), min_8bit_size=0, backend="cpu")
    opt_ref = lowbit_compile(torch.optim.Muon(ref, lr=0.02), min_8bit_size=0, backend="reference")
    train(opt, params, 3, seed=1)
    train(opt_ref, ref, 3, seed=1)
    assert_same([p.detach() for p in params], [q.detach() for q in ref])
    assert_same(state_bits(opt, params), state_bits(opt_ref, ref))


def test_resume_continues_bitwise_like_an_uninterrupted_run():
    params = _matrices()
    opt = lowbit_compile(torch.optim.Muon(params, lr=0.02), min_8bit_size=0)
    train(opt, params, 3, seed=1)
    saved = saved_and_loaded({"params": [p.detach().clone() for p in params], "optim": opt.state_dict()})
    train(opt, params, 3, seed=2)

    resumed = [torch.nn.Parameter(p) for p in saved["params"]]
    opt2 = lowbit_compile(torch.optim.Muon(resumed, lr=0.5), min_8bit_size=0)
    opt2.load_state_dict(saved["optim"])
    assert opt2.param_groups[0]["lr"] == 0.02
    train(opt2, resumed, 3, seed=2)
    assert_same([p.detach() for p in params], [q.detach() for q in resumed])
    assert_same(state_bits(opt, params), state_bits(opt2, resumed))


def test_a_stock_checkpoint_loads_quantized_and_exports_back_to_stock():
    params = _matrices()
    stock = torch.optim.Muon(params, lr=0.02)
    train(stock, params, 2, seed=1)
    opt = lowbit_compile(torch.optim.Muon(params, lr=0.02), min_8bit_size=0)
    opt.load_state_dict(saved_and_loaded(stock.state_dict()))
    for p in params:
        value = opt.state[p]["momentum_buffer"]
        assert isinstance(value, QuantizedState)
        assert torch.equal(value.dequantize(), QuantizedState.from_dense(stock.state[p]["momentum_buffer"],
                                                                         value.fmt).dequantize())
    train(opt, params, 1, seed=2)
    again = torch.optim.Muon(params, lr=0.02)
    again.load_state_dict(checkpoint.stock_state_dict(opt))
    train(again, params, 1, seed=3)


def test_the_muon_class_steps_like_the_explicit_wrap():
    params = _matrices()
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    by_class = optim.Muon(params, lr=0.02, min_8bit_size=0)
    explicit = lowbit_compile(torch.optim.Muon(twins, lr=0.02), min_8bit_size=0)
    assert isinstance(by_class, torch.optim.Muon) and is_wrapped(by_class)
    train(by_class, params, 3, seed=1)
    train(explicit, twins, 3, seed=1)
    for p, q in zip(params, twins):
        assert torch.equal(p, q)


def test_enable_rewrites_muon_and_adamw_beside_it():
    matrices = _matrices()
    vector = torch.nn.Parameter(torch.randn(96))
    with enable(min_8bit_size=0):
        muon, adamw = torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW([vector], lr=1e-3)
        train(muon, matrices, 2, seed=1)
        train(adamw, [vector], 2, seed=1)
    assert is_wrapped(muon) and is_wrapped(adamw)
    assert isinstance(muon.state[matrices[0]]["momentum_buffer"], QuantizedState)


def test_memory_report_gives_the_transient_of_the_largest_matrix():
    params = _matrices()
    opt = lowbit_compile(torch.optim.Muon(params, lr=0.02), min_8bit_size=0)
    train(opt, params, 1, seed=1)
    report = memory_report(opt)
    assert report.per_state["momentum_buffer"].bytes_per_param < 1.1
    n = params[0].numel()
    # the bf16 update and the Newton-Schulz iterates, at most the fp32 update's bytes twice over
    assert 2 * n < report.transient <= 8 * n
    assert "transient" in str(report)
    adamw = lowbit_compile(torch.optim.AdamW(params), min_8bit_size=0)
    train(adamw, params, 1, seed=1)
    assert memory_report(adamw).transient == 0


def test_16bit_params_hand_newton_schulz_the_bf16_update_of_fp32_ones():
    """With an 8-bit momentum a 16-bit matrix's fused stages compute in fp32, yet the update they hand
    Newton-Schulz is the bf16 one stock gives it: the same temporaries as an fp32 matrix's."""
    transients = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        params = [torch.nn.Parameter(p.detach().to(dtype)) for p in _matrices()]
        opt = lowbit_compile(torch.optim.Muon(params, lr=0.02), min_8bit_size=0)
        train(opt, params, 1, seed=1)
        transients.append(memory_report(opt).transient)
    assert transients[0] > 0 and transients == [transients[0]] * 3


RUN_SCRIPT = '''
import sys, torch
model = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.Linear(96, 64))
matrices = [p for p in model.parameters() if p.dim() == 2]
rest = [p for p in model.parameters() if p.dim() != 2]
muon, adamw = torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(rest, lr=1e-3)
for _ in range(2):
    model(torch.randn(4, 64)).square().mean().backward()
    muon.step(); adamw.step(); muon.zero_grad(); adamw.zero_grad()
print("muon", type(muon.state[matrices[0]]["momentum_buffer"]).__name__)
'''


def test_run_rewrites_an_unmodified_muon_script(tmp_path, monkeypatch, capsys):
    (tmp_path / "train.py").write_text(RUN_SCRIPT)
    monkeypatch.chdir(tmp_path)
    code = run_command(monkeypatch, "--min-8bit-size", "0", "train.py")
    out = capsys.readouterr()
    assert code in (0, None), out.err
    assert "muon QuantizedState" in out.out
    assert "2 optimizer(s) rewritten" in out.err


def test_stats_measure_the_whole_matrix():
    """Muon's step is not elementwise, so stats (and the monitor) measure its momentum on the whole
    matrix, never on sampled blocks."""
    params = _matrices()
    opt = lowbit_compile(torch.optim.Muon(params, lr=0.02), min_8bit_size=0)
    train(opt, params, 2, seed=1)
    sampled, whole = stats(opt, max_blocks=2), stats(opt)
    assert [(s.rel_error, s.zero_flush) for s in sampled] == [(s.rel_error, s.zero_flush) for s in whole]
    assert all(0 < s.rel_error < 0.05 and s.sampled == 1.0 for s in sampled)
