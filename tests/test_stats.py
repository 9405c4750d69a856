"""``lowbit_compile.stats(opt)``: what it measures matches the real next step, it changes nothing, and
known block layouts give the known flush and patch numbers."""

from __future__ import annotations

import importlib

import pytest
import torch

import lowbit_compile as lc
from bench.shapes import transformer_params
from lowbit_compile import lowbit_compile, stats

BACKEND = "reference"  # what stats measures does not depend on the lowering; this one needs no compiler


def _grads(params, gen):
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)


def _snapshot(opt, params):
    parts = []
    for p in params:
        parts.append(p.detach().clone())
        for v in opt.state[p].values():
            if isinstance(v, lc.QuantizedState):
                parts += [t.clone() for t in v.storage_parts]
            elif isinstance(v, torch.Tensor):
                parts.append(v.clone())
    return parts


@pytest.mark.parametrize("fmt", ["int8", "fp8_e4m3"])
def test_stats_measure_what_the_next_step_does_and_change_nothing(fmt):
    params = transformer_params(d=32, layers=1, vocab=256)
    # to nearest: a stochastic state is measured with draws of its own, the step rounds with others
    opt = lowbit_compile(torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1), fmt, block_size=256,
                         backend=BACKEND, rounding="nearest")
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        _grads(params, gen)
        opt.step()
    _grads(params, gen)
    # an fp32 twin starting from the dequantized states: its next states are the x of StateStats
    twin_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    twin = torch.optim.AdamW(twin_params, lr=1e-2, weight_decay=0.1)
    for p, q in zip(params, twin_params):
        q.grad = p.grad.clone()
        twin.state[q] = {k: (v.dequantize() if isinstance(v, lc.QuantizedState) else v.clone())
                         for k, v in opt.state[p].items()}

    before = _snapshot(opt, params)
    rows = stats(opt)
    assert all(torch.equal(a, b) for a, b in zip(before, _snapshot(opt, params)))

    start = [p.detach().clone() for p in params]
    opt.step()
    twin.step()
    by_param = {id(p): i for i, p in enumerate(params)}
    quantized = [(p, k) for p in params for k, v in opt.state[p].items() if isinstance(v, lc.QuantizedState)]
    assert len(rows) == len(quantized) > 0
    for row, (p, key) in zip(rows, quantized):
        i = by_param[id(p)]
        assert row.param == f"group0.{i}" and row.state == key and row.numel == p.numel()
        x = twin.state[twin_params[i]][key]
        stored = opt.state[p][key].dequantize()
        # the real step stores Q(x) for the same x (same stock arithmetic), so the two errors agree
        # to fp32 rounding of the norms
        assert row.rel_error == pytest.approx(((stored - x).norm() / x.norm()).item(), rel=1e-5)
        assert row.zero_flush == ((x != 0) & (stored == 0)).sum().item() / (x != 0).sum().item()
        ratio = ((p.detach() - start[i]).norm() / start[i].norm()).item()
        assert row.update_ratio == pytest.approx(ratio, rel=1e-5)


def _spiky_optimizer(outliers):
    """One 4096-element param, blocks of 256; every block holds one gradient 1000x the others."""
    p = torch.nn.Parameter(torch.zeros(4096))
    opt = lowbit_compile(torch.optim.Adam([p], lr=1e-3), "int8", block_size=256, outliers=outliers,
                         backend=BACKEND)
    g = torch.ones(4096)
    g[::256] = 1000.0
    p.grad = g
    opt.step()
    return opt


def test_linear_int8_without_patches_flushes_the_small_moments():
    # exp_avg next = 0.9 * 0 (flushed) + 0.1 * 1 beside 190 in the same block: code step 190/127 > 2 * 0.1
    rows = {r.state: r for r in stats(_spiky_optimizer(outliers=0))}
    assert rows["exp_avg"].zero_flush == 255 / 256
    assert rows["exp_avg"].patched_blocks is None
    # the second moment never stores a positive value as 0
    assert rows["exp_avg_sq"].zero_flush == 0.0


def test_patches_take_the_spike_and_nothing_is_flushed():
    rows = {r.state: r for r in stats(_spiky_optimizer(outliers=2))}
    assert rows["exp_avg"].zero_flush == 0.0 and rows["exp_avg_sq"].zero_flush == 0.0
    assert rows["exp_avg"].patched_blocks == 1.0 and rows["exp_avg_sq"].patched_blocks == 1.0
    assert rows["exp_avg"].rel_error < 1e-2


def test_rows_are_named_and_print_as_a_table():
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 8))
    opt = lowbit_compile(torch.optim.AdamW(model.parameters()), "dynamic8", outliers=2, backend=BACKEND)
    model(torch.randn(4, 64)).sum().backward()
    opt.step()
    opt.zero_grad()
    rows = lowbit_compile.stats(opt, model.named_parameters())
    assert [(r.param, r.state) for r in rows] == [("0.weight", "exp_avg"), ("0.weight", "exp_avg_sq")]
    # without gradients only what the stored state shows is measured
    assert rows[0].rel_error is None and rows[0].update_ratio is None and rows[0].patched_blocks is not None
    text = str(rows)
    assert text.splitlines()[0].split()[:3] == ["param", "state", "format"] and "0.weight" in text


def test_stepping_never_calls_stats(monkeypatch):
    stats_module = importlib.import_module("lowbit_compile.state_stats")  # the name alone is the function

    def fail(*args, **kwargs):
        raise AssertionError("stats code ran during step()")

    for name in ("_next_step", "_round_trips", "_patched_blocks", "stats"):
        monkeypatch.setattr(stats_module, name, fail)
    params = transformer_params(d=32, layers=1, vocab=256)
    opt = lowbit_compile(torch.optim.AdamW(params), backend=BACKEND)
    _grads(params, torch.Generator().manual_seed(0))
    opt.step()
    assert all(set(opt.state[p]) <= {"step", "exp_avg", "exp_avg_sq", "rounding_seed"} for p in params)


@pytest.mark.parametrize("fmt,outliers", [("int8", 2), ("dynamic8", 0)])
def test_sampled_stats_are_exact_on_the_blocks_they_measure(fmt, outliers):
    """``max_blocks``: the next step on a few whole blocks, quantized as the real step would quantize
    those blocks (blocks are independent), so the figures are the full computation's on them."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(20, 250))  # 5000 elements: 19 blocks of 256 and a partial one
    opt = lowbit_compile(torch.optim.AdamW([p], lr=1e-2), fmt, block_size=256, outliers=outliers, min_8bit_size=0,
                         backend=BACKEND, rounding="nearest")  # as above: the figures are the step's own
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        _grads([p], gen)
        opt.step()
    _grads([p], gen)
    twin_p = torch.nn.Parameter(p.detach().clone())
    twin_p.grad = p.grad.clone()
    twin = torch.optim.AdamW([twin_p], lr=1e-2)
    twin.state[twin_p] = {k: (v.dequantize() if isinstance(v, lc.QuantizedState) else v.clone())
                          for k, v in opt.state[p].items()}
    twin.step()
    # 20 blocks: 3 at a time are 6 apart, 4 at a time 5 apart (the last, partial block included)
    for max_blocks, offset, blocks in ((3, 1, [1, 7, 13]), (3, 5, [5, 11, 17]), (3, 6, [0, 6, 12]),
                                       (4, 4, [4, 9, 14, 19])):
        rows = stats(opt, max_blocks=max_blocks, offset=offset)
        index = torch.cat([torch.arange(b * 256, min(b * 256 + 256, 5000)) for b in blocks])
        for row in rows:
            fmt_ = opt.state[p][row.state].fmt
            x = twin.state[twin_p][row.state].reshape(-1)[index]
            back = lc.formats.blockquant.dequantize(lc.formats.blockquant.quantize(x, fmt_), fmt_)
            assert row.sampled == index.numel() / 5000
            assert row.rel_error == pytest.approx(((back - x).norm() / x.norm()).item(), rel=1e-5)
            assert row.zero_flush == ((x != 0) & (back == 0)).sum().item() / (x != 0).sum().item()
            start = p.detach().reshape(-1)[index]
            moved = twin_p.detach().reshape(-1)[index]
            assert row.update_ratio == pytest.approx(((moved - start).norm() / start.norm()).item(), rel=1e-5)
    # enough blocks allowed: the full computation
    full, capped = stats(opt), stats(opt, max_blocks=20)
    assert [(r.rel_error, r.zero_flush, r.sampled) for r in full] == [(r.rel_error, r.zero_flush, 1.0) for r in capped]


def _decaying_v(rounding: str) -> float:
    """exp_avg_sq's rounding bias on a step that decays v by beta2 everywhere but at each block's
    largest entry, which stays put (so the blocks keep their scales)."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.zeros(8192))
    opt = lowbit_compile(torch.optim.Adam([p], lr=1e-3), block_size=512, rounding={"exp_avg_sq": rounding},
                         backend=BACKEND)
    g = torch.randn(8192)
    p.grad = g.clone()
    opt.step()
    v = opt.state[p]["exp_avg_sq"].dequantize()
    top = v.view(-1, 512).argmax(dim=1) + torch.arange(0, 8192, 512)
    p.grad = torch.zeros(8192)
    p.grad[top] = v[top].sqrt()  # beta2 * v + (1 - beta2) * v: the largest stay at v
    rows = {r.state: r for r in stats(opt)}
    assert rows["exp_avg"].rounding_bias is None  # signed: entries near 0 would swamp a relative mean
    return rows["exp_avg_sq"].rounding_bias


def test_rounding_bias_sees_v_held_by_nearest_rounding_and_not_by_stochastic():
    # a 0.1% decay moves sqrt8's root by 0.05%, under half a code anywhere: to nearest every entry keeps
    # its code, each (1/beta2 - 1) above its exact value; 16 of 8192 (the largest) are exact
    assert _decaying_v("nearest") == pytest.approx((1 / 0.999 - 1) * (1 - 1 / 512), rel=1e-3)
    # unbiased rounding: an entry drops a code (gap g) with probability 0.001 v / g, so its relative
    # error has variance ~0.001 g / v (g / v ~ 2 / code ~ 3% here): the mean of 8192 has a standard
    # error of ~6e-5, and the bound is 4 of them (nearest: 1e-3)
    assert abs(_decaying_v("stochastic")) < 2.5e-4


@pytest.mark.parametrize("key", ["exp_avg", "exp_avg_sq"])
def test_the_share_of_patched_blocks_of_gaussian_moments_is_counted_block_by_block(key):
    """On ordinary (Gaussian) moments some blocks and not others have a patch twice the rest: the share
    ``stats`` reports is the one found by decoding every block and comparing its largest magnitude with
    the largest after the patches, a figure that is neither 0 nor 1 here."""
    params = [torch.nn.Parameter(torch.randn(4096 * 4))]
    opt = lowbit_compile(torch.optim.AdamW(params), "int8", block_size=16, outliers=2, min_8bit_size=0,
                         backend=BACKEND)
    _grads(params, torch.Generator().manual_seed(4))
    opt.step()
    state = opt.state[params[0]][key]
    magnitudes = state.dequantize().abs().view(-1, 16).sort(dim=1, descending=True).values
    expected = (magnitudes[:, 0] >= 2 * magnitudes[:, 2]).float().mean().item()
    assert 0.02 < expected < 0.98
    assert {r.state: r for r in stats(opt)}[key].patched_blocks == pytest.approx(expected, abs=1e-9)
