"""sqrt4 states (two codes a byte) outside the kernels: checkpoints resume bit for bit and keep 4 bits, a
checkpoint's packed codes are checked before anything changes, stock export and import, mixed formats,
master weights, the monitor's figures on packed codes, and the memory report and estimate."""

from __future__ import annotations

import copy

import pytest
import torch

from bench.footprint import SETUPS, SIZES
from lowbit_compile import QuantizedState, lowbit_compile, memory_report, stats
from lowbit_compile.checkpoint import stock_state_dict
from lowbit_compile.cli import main as cli_main
from lowbit_compile.estimate import GB, estimate
from lowbit_compile.formats import StateFormat, blockquant
from lowbit_compile.state import codec
from lowbit_compile.state_stats import _round_trips, _sample, _sampled_state

from .helpers import assert_same, saved_and_loaded, train
from .test_hostile_checkpoints import assert_unchanged, snapshot

# odd widths (a row does not start on a byte), an odd 1-D count, a 0-d and a 3-D parameter, even rows
SHAPES = [(64, 33), (5001,), (128, 64), (3, 5, 7), (), (7, 1)]
OPTIONS = {"fmt": "sqrt4", "backend": "reference", "min_8bit_size": 0}
MIXED = [{"exp_avg": "sqrt4", "exp_avg_sq": "sqrt8"}, {"exp_avg": "sqrt8", "exp_avg_sq": "sqrt4"}]


def make_params(shapes=SHAPES, dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(4)
    return [torch.nn.Parameter(torch.randn(s, generator=gen).to(dtype)) for s in shapes]


def wrapped(params: list[torch.nn.Parameter], **options) -> torch.optim.Optimizer:
    return lowbit_compile(torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1), **{**OPTIONS, **options})


def quantized(opt: torch.optim.Optimizer, params: list[torch.Tensor]) -> list[QuantizedState]:
    return [v for p in params for v in opt.state[p].values() if isinstance(v, QuantizedState)]


def resumes_exactly(shapes=SHAPES, dtype: torch.dtype = torch.float32, **options) -> dict:
    """Train 2 steps, save (torch.save, weights-only load), load into a fresh optimizer, train both 3 more:
    params and every state bit for bit the same. Returns the saved state dict."""
    a = make_params(shapes, dtype)
    opt_a = wrapped(a, **options)
    train(opt_a, a, 2, seed=1)
    saved = saved_and_loaded(opt_a.state_dict())
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt_b = wrapped(b, **options)
    opt_b.load_state_dict(saved)
    train(opt_a, a, 3, seed=2)
    train(opt_b, b, 3, seed=2)
    assert_same([p.detach() for p in a], [p.detach() for p in b])
    held_a, held_b = quantized(opt_a, a), quantized(opt_b, b)
    assert len(held_a) == len(held_b) >= len(shapes)
    for x, y in zip(held_a, held_b):
        assert x.fmt == y.fmt
        assert_same(list(x.storage_parts), list(y.storage_parts))
    return saved


@pytest.mark.parametrize("fmt", ["sqrt4", *MIXED], ids=["sqrt4", "m4-v8", "m8-v4"])
def test_a_checkpoint_resumes_bit_for_bit(fmt):
    resumes_exactly(fmt=fmt)


@pytest.mark.parametrize("fmt", MIXED, ids=["m4-v8", "m8-v4"])
def test_mixed_formats_share_the_smaller_block(fmt):
    params = make_params([(300, 7)])
    opt = wrapped(params, fmt=fmt)
    train(opt, params, 1, seed=1)
    held = {k: v.fmt for k, v in opt.state[params[0]].items() if isinstance(v, QuantizedState)}
    assert {k: f.name for k, f in held.items()} == fmt
    assert {f.block_size for f in held.values()} == {128}


def m_and_v_bytes(saved: dict) -> int:
    return sum(t.numel() * t.element_size() for entry in saved["state"].values()
               for key in ("exp_avg", "exp_avg_sq") for t in entry[key].values() if isinstance(t, torch.Tensor))


@pytest.mark.parametrize("shape", [(1024, 1024), (1_000_000,), (1000, 333)])
def test_a_checkpoint_keeps_4_bits(shape):
    """m + v in the saved tensors: 2 x (half a byte + 4 bytes per block of 128) = 1.0625 B/param."""
    params = make_params([shape])
    opt = wrapped(params)
    train(opt, params, 1, seed=1)
    saved = opt.state_dict()
    per_param = m_and_v_bytes(saved) / params[0].numel()
    assert per_param <= 1.07, per_param
    assert per_param <= m_and_v_bytes(saved_and_loaded(saved)) / params[0].numel() <= 1.07
    state = opt.state[params[0]]["exp_avg"]  # a plain param's codes are saved as a view of the live state
    assert saved["state"][0]["exp_avg"]["codes"].data_ptr() == state.codes.data_ptr()


def test_the_spare_nibble_of_an_odd_count_is_saved_as_0():
    params = make_params([(3, 5)])
    opt = wrapped(params)
    train(opt, params, 1, seed=1)
    codes = opt.state_dict()["state"][0]["exp_avg"]["codes"]
    assert codes.shape == (8,) and int(codes[-1]) >> 4 == 0


# -- hostile packed codes: refused naming the parameter, nothing changed --------------------------------------
def _codes_changed(change):
    def mutate(packed: dict) -> dict:
        return {**packed, "codes": change(packed["codes"].clone())}
    return mutate


HOSTILE = {
    "flat codes one byte short": (0, _codes_changed(lambda c: c[:-1]), "'codes' has shape"),
    "flat codes one byte long": (0, _codes_changed(lambda c: torch.cat([c, c[:1]])), "'codes' has shape"),
    "odd rows saved one byte each": (0, _codes_changed(lambda c: torch.zeros(64, 33, dtype=torch.uint8)),
                                     "'codes' has shape"),
    "8-bit codes for a 4-bit format": (2, _codes_changed(lambda c: torch.zeros(128, 64, dtype=torch.uint8)),
                                       "'codes' has shape"),
    "rows one byte short": (2, _codes_changed(lambda c: c[:, :-1]), "'codes' has shape"),
    "flat codes of even rows": (2, _codes_changed(lambda c: c.reshape(-1)), "'codes' has shape"),
    "a code past the end of the last row": (1, _codes_changed(lambda c: c.index_fill_(0, torch.tensor([2500]), 0xF3)),
                                            "past the end of a row"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_packed_codes_of_the_wrong_length_are_refused_before_anything_changes(case):
    index, mutate, match = HOSTILE[case]
    params = make_params()
    opt = wrapped(params)
    train(opt, params, 2, seed=1)
    saved = saved_and_loaded(opt.state_dict())
    entry = saved["state"][index]
    saved["state"][index] = {**entry, "exp_avg_sq": mutate(entry["exp_avg_sq"])}
    before = snapshot(opt, params)
    with pytest.raises(ValueError, match=rf"param_groups\[0\]\['params'\]\[{index}\].*exp_avg_sq.*{match}"):
        opt.load_state_dict(saved)
    assert_unchanged(opt, params, before)
    train(opt, params, 1, seed=5)


def test_a_row_of_a_sharded_checkpoint_with_a_nonzero_spare_nibble_is_refused():
    """Odd rows saved per row (as a DTensor parameter's are) load into a plain parameter; a row whose spare
    high nibble is set is refused."""
    params = make_params([(6, 5)])
    opt = wrapped(params)
    train(opt, params, 2, seed=1)
    held = opt.state[params[0]]["exp_avg_sq"]
    packed = codec.pack(held, params[0])
    rows = codec._code_table(held.codes, held.fmt, 6, 5, per_row=True)
    assert rows.shape == (6, 3)
    assert torch.equal(codec.unpack({**packed, "codes": rows}, params[0]).dequantize(), held.dequantize())
    rows = rows.clone()
    rows[4, 2] |= 0x50
    with pytest.raises(ValueError, match="past the end of a row"):
        codec.unpack({**packed, "codes": rows}, params[0])


# -- stock export and import ----------------------------------------------------------------------------------
def test_the_stock_export_loads_into_stock_adamw_and_a_stock_checkpoint_quantizes_on_load():
    params = make_params()
    opt = wrapped(params)
    train(opt, params, 2, seed=1)
    exported = saved_and_loaded(stock_state_dict(opt))
    for p, entry in zip(params, exported["state"].values()):
        for key in ("exp_avg", "exp_avg_sq"):
            assert type(entry[key]) is torch.Tensor and entry[key].dtype == torch.float32
            assert torch.equal(entry[key], opt.state[p][key].dequantize())
    stock_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    stock = torch.optim.AdamW(stock_params, lr=1e-2, weight_decay=0.1)
    stock.load_state_dict(copy.deepcopy(exported))  # its step writes into the tensors it loaded
    train(stock, stock_params, 1, seed=2)

    again = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt_again = wrapped(again)
    opt_again.load_state_dict(exported)  # a stock fp32 checkpoint: quantized to sqrt4 on load
    for p, q in zip(params, again):
        for key in ("exp_avg", "exp_avg_sq"):
            loaded, held = opt_again.state[q][key], opt.state[p][key]
            assert isinstance(loaded, QuantizedState) and loaded.fmt == held.fmt
            assert torch.equal(loaded.dequantize(), held.dequantize())  # sqrt4 values re-quantize to themselves
    train(opt_again, again, 1, seed=2)


# -- master weights -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["exact", "8bit"])
def test_bf16_params_with_master_weights_resume_bit_for_bit(mode):
    saved = resumes_exactly(dtype=torch.bfloat16, master_weights=mode)
    entries = list(saved["state"].values())
    assert all(any(codec.is_packed_residual(v) for v in entry.values()) for entry in entries)
    assert all(codec.saved_format(entry[k]).name == "sqrt4" for entry in entries for k in ("exp_avg", "exp_avg_sq"))


# -- the monitor ----------------------------------------------------------------------------------------------
def test_a_sampled_read_of_packed_codes_is_the_state_at_those_elements():
    params = make_params([(33, 129), (5001,)])
    opt = wrapped(params)
    train(opt, params, 3, seed=1)
    for p in params:
        for value in quantized(opt, [p]):
            index = _sample(p.numel(), [value], 5, 7)  # 5001 elements: blocks 7, 15, ..., 39 (its last, partial)
            assert index is not None and index.numel() < p.numel()
            assert torch.equal(_sampled_state(value, index), value.dequantize().reshape(-1)[index])
    assert index[-1] == 5000


def test_zero_flush_and_rounding_bias_of_sqrt4_are_its_round_trips():
    """Values below a block's smallest code flush to 0 in a signed state; a non-negative one never flushes."""
    block = torch.full((128,), 1e-6)
    block[0] = 1.0  # sqrt4's smallest non-zero code is 1/49 of the block's absmax: 1e-6 flushes
    signed = StateFormat.make("sqrt4", 128, 0, False)
    nonneg = StateFormat.make("sqrt4", 128, 0, True)
    [(_, flush, bias)] = _round_trips([block], signed)
    assert flush == pytest.approx(127 / 128) and bias is None
    [(_, flush, bias)] = _round_trips([block], nonneg)
    assert flush == 0.0 and bias > 0  # the zero-point rule keeps them at the smallest code: rounded up


def test_stats_and_its_sample_measure_sqrt4_states():
    params = make_params([(33, 129)])
    opt = wrapped(params)
    train(opt, params, 3, seed=1)
    params[0].grad = torch.randn(params[0].shape, generator=torch.Generator().manual_seed(9))
    whole, sampled = stats(opt), stats(opt, max_blocks=8)
    assert [s.fmt for s in whole] == ["sqrt4:128:0:s", "sqrt4:128:0:u"]
    for a, b in zip(whole, sampled):
        assert b.sampled < 1.0 and a.rel_error > 0 and b.rel_error > 0 and a.zero_flush is not None
    assert whole[1].rounding_bias is not None and sampled[1].rounding_bias is not None


# -- memory ---------------------------------------------------------------------------------------------------
def test_memory_report_counts_half_a_byte_a_code():
    params = make_params([(1024, 1024)])
    opt = wrapped(params)
    train(opt, params, 1, seed=1)
    report = memory_report(opt)
    for key in ("exp_avg", "exp_avg_sq"):
        assert report.per_state[key].bytes_per_param == pytest.approx(0.5 + 4 / 128)


def test_estimate_takes_a_4_bit_formats_own_block():
    n = 7 * 10**9
    est = estimate(n, fmt="sqrt4")
    assert est.row("exp_avg (m, fp32)").lowbit == n // 2
    assert est.row("scales + patches").lowbit == 2 * 4 * -(-n // 128)
    assert "block_size=128" in est.title
    mixed = estimate(n, fmt=MIXED[0])
    assert mixed.row("exp_avg (m, fp32)").lowbit == n // 2 and mixed.row("exp_avg_sq (v, fp32)").lowbit == n
    assert mixed.row("scales + patches").lowbit == 2 * 4 * -(-n // 128)
    assert estimate(n, fmt="sqrt8").row("scales + patches").lowbit == 2 * 4 * -(-n // 512)
    assert estimate(n, fmt="sqrt4", block_size=256).row("scales + patches").lowbit == 2 * 4 * -(-n // 256)


def test_the_estimate_command_prints_the_4_bit_figures(capsys):
    assert cli_main(["estimate", "--params", "7B", "--param-dtype", "bf16", "--master-weights", "exact",
                     "--fmt", "sqrt4", "--release-grads"]) == 0
    out = capsys.readouterr().out
    expected = estimate(7 * 10**9, param_dtype="bf16", master_weights="exact", fmt="sqrt4", release_grads=True)
    assert "block_size=128" in out and f"{expected.lowbit_total:,}" in out
    assert f"{expected.lowbit_total / 7e9:.3f} B low-bit" in out


@pytest.mark.parametrize("release", [False, True])
@pytest.mark.parametrize("setup", SETUPS, ids=[f"{s.label}-{s.param_dtype}" for s in SETUPS])
def test_the_footprint_tables_totals_are_what_the_estimate_command_prints(setup, release, capsys):
    for size in SIZES:
        assert cli_main(["estimate", *setup.flags(size, release).split()]) == 0
        total = setup.estimate(size, release).lowbit_total
        [line] = [x for x in capsys.readouterr().out.splitlines() if x.startswith("total ")]
        assert line.endswith(f"{total:>19,}{total / GB:>9.3f}"), line


@pytest.mark.parametrize("per_row", [False, True], ids=["flat", "per row"])
def test_a_shards_rows_of_saved_codes_are_its_codes(per_row):
    """What a shard of rows [3, 6) of a 7x5 parameter reads from a full checkpoint (an unsharded one, flat, or a
    gathered FSDP2 one, per row): its own codes, whichever nibble its first element is in."""
    params = make_params([(7, 5)])
    opt = wrapped(params)
    train(opt, params, 1, seed=1)
    held = opt.state[params[0]]["exp_avg"]
    packed = codec.pack(held, params[0])
    if per_row:
        packed["codes"] = codec._code_table(held.codes, held.fmt, 7, 5, per_row=True)
    every = blockquant.unpacked_codes(held.codes, 35, held.fmt)
    assert torch.equal(codec._codes(packed, held.fmt, 3, 6, 7, 5), every[15:30])
    assert torch.equal(codec._codes(packed, held.fmt, 0, 7, 7, 5), every)
