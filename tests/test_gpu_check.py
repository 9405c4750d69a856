"""bench/gpu_check.py, which needs a GPU to mean anything, at least runs here: its dry run takes the same
code paths (correctness against the reference, state kernels, timing, table, JSON) on tiny CPU sizes."""

from __future__ import annotations

import json

import pytest

from lowbit_compile.config import DEFAULT_BLOCK_SIZE, DEFAULT_FMT, DEFAULT_OUTLIERS

pytestmark = pytest.mark.slow  # the GPU check's dry run

pytest.importorskip("triton")
gpu_check = pytest.importorskip("bench.gpu_check")


def test_dry_run_checks_times_and_writes_json(tmp_path, monkeypatch):
    # a smaller Llama than the dry run's (each of its optimizer's blocks is a program the Triton interpreter
    # runs): the embeddings, head and MLP weights (4096 elements) still take 8-bit states, attention's
    # (1024) fp32 ones under min_8bit_size
    monkeypatch.setattr(gpu_check, "LLAMA_TINY", {
        "vocab_size": 128, "hidden_size": 32, "intermediate_size": 128, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 32})
    out = tmp_path / "gpu_check.json"
    report = gpu_check.main(["--device", "cpu", "--dry-run", "--formats", "int8", "--cases", "adam-bf16-params-wd",
                             "--skip-peers", "--model-steps", "1", "--out", str(out)])
    assert report["correct"], report["correctness"]
    # the case's fp8 states ran on both FP8 paths: the interpreter runs the float8 one too
    assert {c["check"] for c in report["correctness"]} >= {"adam-bf16-params-wd", "adam-bf16-params-wd_int-fp8"}
    assert json.loads(out.read_text())["correct"]
    timed = {(r["method"], r["param_dtype"]) for r in report["timing"]}
    assert timed == {(m, d) for m in ("torch_adamw_fused", "lowbit_int8") for d in ("float32", "bfloat16")}
    # the Llama's training steps: stock fused and ours (default format), fp32 and bf16 params
    model = {(r["method"], r["param_dtype"]): r for r in report["model"]}
    assert model.keys() == {(m, d) for m in ("torch_adamw_fused", f"lowbit_{DEFAULT_FMT}") for d in ("float32", "bfloat16")}
    assert all("skipped" not in r and r["step_ms"] > 0 and r["last_loss"] < r["first_loss"] for r in model.values())
    ours = next(r for r in report["timing"] if r["method"] == "lowbit_int8" and r["param_dtype"] == "float32")
    # p, g, codes of m and v read and written, and per block of each state a scale and its patches
    assert ours["bytes_per_param"] == pytest.approx(16 + 2 * 2 * (4 + 4 * DEFAULT_OUTLIERS) / DEFAULT_BLOCK_SIZE)


def test_correctness_part_holds_for_every_case():
    """Every correctness check the GPU run makes (each case on each FP8 path, every state kernel, a long
    param's tail blocks against the tail alone), at the dry run's sizes: the GPU check cannot rot unseen."""
    import torch

    results = gpu_check.check_correctness(torch.device("cpu"), gpu_check.parse(["--device", "cpu", "--dry-run"]))
    assert all(r["ok"] for r in results), [r for r in results if not r["ok"]]
    checks = {r["check"] for r in results}
    assert checks >= set(gpu_check.CASES) | {f"{c}{gpu_check.INT_FP8}" for c in gpu_check.CASES if "fp8" in c}
    assert sum(c.startswith("state kernels") for c in checks) == 18
    assert any(c.startswith("step of") for c in checks)
