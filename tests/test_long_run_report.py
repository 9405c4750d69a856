"""bench/long_run.py's table: the paired gaps it reports, from synthetic runs."""

import pytest

from bench.long_run import markdown, train_gaps


def _run(variant: str, seed: int, val: float, train: float) -> dict:
    return {"task": "char_gpt_2m_long", "variant": variant, "seed": seed, "steps": 2000, "params": 10,
            "train_loss": [9.0] * 1900 + [train] * 100, "val_steps": [250, 1000, 2000],
            "val": [{"loss": val}] * 3, "seconds": 1.0, "state_bytes_per_param": 2.0}


def test_train_gap_pairs_each_run_with_the_fp32_run_of_its_seed_over_the_last_steps():
    runs = [_run("fp32", 0, 1.0, 2.0), _run("fp32", 1, 1.0, 4.0),
            _run("sqrt8", 0, 1.0, 2.02), _run("sqrt8", 1, 1.0, 4.04), _run("sqrt8", 2, 1.0, 9.0)]
    assert train_gaps(runs, "sqrt8") == pytest.approx([1.0, 1.0])  # seed 2 has no fp32 run
    assert train_gaps(runs, "int8") == []


def test_table_has_the_train_gap_and_names_the_perturbed_noise_floor():
    runs = [_run("fp32", 0, 1.0, 2.0), _run("fp32+perturbed", 0, 1.01, 2.0)]
    text = markdown(runs)
    row = next(line for line in text.splitlines() if line.startswith("| fp32+perturbed |"))
    assert "+1.00 ± 0.00%" in row and "+0.00 ± 0.00%" in row
    assert "noise floor" in text


def test_gap_beyond_reruns_is_the_difference_of_mean_gaps_with_its_standard_error():
    runs = [_run("fp32", s, 1.0, 2.0) for s in range(3)]
    runs += [_run("fp32+perturbed", s, 1.0 + g, 2.0) for s, g in enumerate((0.01, -0.01, 0.0))]
    runs += [_run("sqrt8", s, 1.0 + g, 2.0 + t) for s, (g, t) in enumerate(((0.02, 0.0), (0.03, 0.02), (0.04, 0.04)))]
    row = next(line for line in markdown(runs).splitlines() if line.startswith("| sqrt8 |"))
    assert "+3.00 ± 0.82% / +1.00 ± 0.58%" in row  # val (3 - 0) ± sqrt(1/3 + 1/3); train (1 - 0) ± sqrt(1/3)


def test_a_longer_run_reads_its_gaps_at_an_eighth_half_and_end_and_its_train_gap_over_a_twentieth():
    def run(variant: str, seed: int, val: float, train: float) -> dict:
        return {"task": "char_gpt_small_long", "variant": variant, "seed": seed, "steps": 10000, "params": 10,
                "batch": [8, 64], "train_loss": [9.0] * 9500 + [train] * 400 + [2.0] * 100,
                "val_steps": [625 * k for k in range(1, 17)], "val": [{"loss": val}] * 16, "seconds": 1.0,
                "state_bytes_per_param": 2.0}

    text = markdown([run("fp32", 0, 1.0, 2.0), run("sqrt8", 0, 1.01, 2.04)])
    assert "10000 steps of 8 x 64 characters" in text
    assert "gap to fp32 at 1250 | gap to fp32 at 5000 | gap to fp32 at 10000 | train gap, last 500 steps" in text
    row = next(line for line in text.splitlines() if line.startswith("| sqrt8 |"))
    assert "| +1.60 ± 0.00% |" in row  # over the last 500 steps (400 at 2.04, 100 at 2.0), not the last 100


def test_the_small_model_is_char_gpt_at_the_long_schedule():
    from bench.long_run import long_task

    task = long_task(10000, model="small")
    assert (task.name, task.d, task.layers, task.batch_size, task.ctx) == ("char_gpt_small_long", 96, 3, 8, 64)
    assert (task.hyper.steps, task.hyper.warmup, task.hyper.eval_every, task.hyper.lr) == (10000, 100, 625, 2e-3)
    assert 5000 % task.hyper.eval_every == 0 and 1250 % task.hyper.eval_every == 0


def test_a_row_over_fewer_seeds_than_fp32_names_them():
    runs = [_run("fp32", s, 1.0, 2.0) for s in range(3)] + [_run("sqrt8", s, 1.0, 2.0) for s in range(3)]
    runs += [_run("ao-AdamW8bit", s, 1.0, 2.0) for s in (0, 1)]
    lines = markdown(runs).splitlines()
    assert any(line.startswith("| ao-AdamW8bit (seeds 0, 1) |") for line in lines)
    assert any(line.startswith("| sqrt8 |") for line in lines)


def test_a_table_without_fp32_runs_names_the_seeds_run():
    text = markdown([_run("sqrt8", 0, 1.0, 2.0), _run("sqrt8", 1, 1.0, 2.0)])
    assert "seeds [0, 1]" in text.splitlines()[0]
    assert next(line for line in text.splitlines() if line.startswith("| sqrt8")).startswith("| sqrt8 |")


def test_a_diagnosed_run_records_the_monitor_figures_of_v_and_m():
    from bench.long_run import run_one

    run = run_one(("sqrt8", 0, 10, 1, True, "pydoc", "small"))
    record = run["drift"][-1]
    assert {"rel_error/exp_avg", "rel_error/exp_avg_sq", "rounding_bias/exp_avg_sq"} <= set(record)
    assert "rounding_bias/exp_avg" not in record  # m is signed: no bias
