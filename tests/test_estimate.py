"""The memory estimator against figures computed by hand, and against a real wrapped optimizer."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from lowbit_compile import lowbit_compile, memory_report
from lowbit_compile.cli import main, parse_count
from lowbit_compile.config import DEFAULT_BLOCK_SIZE, DEFAULT_OUTLIERS
from lowbit_compile.estimate import estimate

N7B = 7_000_000_000


def _side_bytes(n: int, block: int = DEFAULT_BLOCK_SIZE, outliers: int = DEFAULT_OUTLIERS) -> int:
    """Scales (fp32) and patches (bf16 value + int16 index) of one state, by hand."""
    return math.ceil(n / block) * (4 + outliers * (2 + 2))


def test_7b_fp16_with_master_weights_is_112_gb_stock():
    est = estimate(N7B, param_dtype="fp16", master_weights=True)
    assert [(r.component, r.stock) for r in est.rows] == [
        ("params (fp16)", 14 * 10**9),
        ("grads (fp16)", 14 * 10**9),
        ("master weights (fp32)", 28 * 10**9),
        ("exp_avg (m, fp32)", 28 * 10**9),
        ("exp_avg_sq (v, fp32)", 28 * 10**9),
        ("scales + patches", 0),
    ]
    assert est.stock_total == 112 * 10**9
    # the default dynamic8: 1 byte per element per state; 13,671,875 blocks of 512 per state, a 4-byte scale each
    assert est.row("exp_avg (m, fp32)").lowbit == 7 * 10**9
    assert est.row("exp_avg_sq (v, fp32)").lowbit == 7 * 10**9
    assert est.row("scales + patches").lowbit == 2 * 13_671_875 * 4 == 109_375_000
    assert est.lowbit_total == 70_109_375_000


def test_stock_states_take_the_dtype_of_what_the_optimizer_steps():
    bf16 = estimate(10**9, param_dtype="bf16", fmt="int8")
    assert bf16.row("exp_avg (m, bf16)").stock == 2 * 10**9  # torch creates states like the param
    assert bf16.stock_total == 10**9 * (2 + 2 + 2 + 2)
    fp32 = estimate(10**9, param_dtype="fp32", fmt="int8")
    assert fp32.stock_total == 10**9 * 16


@pytest.mark.parametrize("fmt,code_bytes,blockwise", [
    ("int8", 1, True), ("dynamic8", 1, True), ("sqrt8", 1, True), ("fp8_e4m3", 1, True), ("fp8_e5m2", 1, True),
    ("bf16", 2, False), ("fp32", 4, False),
])
def test_each_format_costs_its_code_bytes_plus_blocks(fmt, code_bytes, blockwise):
    n = 10**8
    est = estimate(n, fmt=fmt)
    assert est.row("exp_avg (m, fp32)").lowbit == n * code_bytes
    assert est.row("scales + patches").lowbit == (2 * _side_bytes(n) if blockwise else 0)


def test_block_size_outliers_and_per_state_formats():
    n = 10**6
    est = estimate(n, fmt={"exp_avg": "fp8_e4m3", "exp_avg_sq": "bf16"}, block_size=256, outliers=0)
    assert est.row("exp_avg (m, fp32)").lowbit == n
    assert est.row("exp_avg_sq (v, fp32)").lowbit == 2 * n
    assert est.row("scales + patches").lowbit == math.ceil(n / 256) * 4  # m only; no patches


def test_amsgrad_adds_a_third_state():
    est = estimate(10**6, amsgrad=True)
    assert est.row("max_exp_avg_sq (max v, fp32)").stock == 4 * 10**6
    assert est.row("scales + patches").lowbit == 3 * _side_bytes(10**6)


@pytest.mark.parametrize("stage,sharded", [
    (1, {"master", "states"}), (2, {"master", "states", "grads"}), (3, {"master", "states", "grads", "params"}),
])
def test_shards_divide_what_the_zero_stage_shards(stage, sharded):
    n, shards = 1_000_000_001, 8
    local = math.ceil(n / shards)  # 125,000,001 per device, rounded up
    est = estimate(n, param_dtype="bf16", master_weights=True, shards=shards, zero_stage=stage)
    expect = {
        "params (bf16)": 2 * (local if "params" in sharded else n),
        "grads (bf16)": 2 * (local if "grads" in sharded else n),
        "master weights (fp32)": 4 * local,
        "exp_avg (m, fp32)": 4 * local,
        "exp_avg_sq (v, fp32)": 4 * local,
    }
    assert {r.component: r.stock for r in est.rows if r.component in expect} == expect
    assert est.row("scales + patches").lowbit == 2 * _side_bytes(local)


@pytest.mark.slow
def test_matches_the_bytes_a_wrapped_optimizer_really_holds():
    n = 3 * 2048 + 5  # a partial last block
    p = torch.nn.Parameter(torch.randn(n))
    opt = lowbit_compile(torch.optim.Adam([p]), fmt="int8", min_8bit_size=0)
    p.grad = torch.randn(n)
    opt.step()
    held = memory_report(opt).per_state
    est = estimate(n, fmt="int8")
    assert held["exp_avg"].bytes + held["exp_avg_sq"].bytes == (
        est.row("exp_avg (m, fp32)").lowbit + est.row("exp_avg_sq (v, fp32)").lowbit
        + est.row("scales + patches").lowbit)


@pytest.mark.parametrize("text,count", [
    ("7e9", N7B), ("7000000000", N7B), ("7B", N7B), ("1.3b", 1_300_000_000), ("125M", 125_000_000), ("350k", 350_000),
])
def test_parse_count(text, count):
    assert parse_count(text) == count


@pytest.mark.parametrize("text", ["", "seven", "7 GB", "-5", "0"])
def test_parse_count_refuses_non_counts(text):
    with pytest.raises(argparse.ArgumentTypeError, match="parameter count"):
        parse_count(text)


def test_bad_combinations_are_refused():
    with pytest.raises(ValueError, match="master weights"):
        estimate(10, param_dtype="fp32", master_weights=True)
    with pytest.raises(ValueError, match="shards"):
        estimate(10, shards=0)
    with pytest.raises(ValueError, match="fmt"):
        estimate(10, fmt="int4")


def test_cli_prints_the_table(capsys):
    assert main(["estimate", "--params", "7e9", "--param-dtype", "fp16", "--master-weights", "fp32", "--fmt", "int8",
                 "--block-size", "2048", "--outliers", "2"]) == 0
    out = capsys.readouterr().out
    assert "112,000,000,000  112.000" in out
    assert "70,082,031,256   70.082" in out  # 3,417,969 blocks of 2048 per state, 4 + 2 * 4 bytes each
    assert "saved 41,917,968,744 bytes = 41.918 GB (37.4% of the total)" in out


def test_cli_rejects_a_bad_format(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["estimate", "--params", "7B", "--fmt", "int4"])
    assert exit_info.value.code == 2
    assert "fmt must be one of" in capsys.readouterr().err


def test_a_muon_and_adamw_mix_counts_one_momentum_for_the_muon_params():
    n, muon = 10**9, 9 * 10**8
    est = estimate(n, muon_params=muon)
    assert est.row("exp_avg (m, fp32)").stock == est.row("exp_avg_sq (v, fp32)").stock == (n - muon) * 4
    assert est.row("Muon momentum (fp32)").stock == muon * 4
    assert est.row("Muon momentum (fp32)").lowbit == muon  # one byte per element
    assert est.row("scales + patches").lowbit == (_side_bytes(n - muon) * 2 + _side_bytes(muon))
    assert est.stock_total == n * 4 * 2 + (n - muon) * 8 + muon * 4
    assert est.title.startswith("Muon (900,000,000 of them) + AdamW memory")
    with pytest.raises(ValueError, match="muon_params"):
        estimate(n, muon_params=n + 1)
