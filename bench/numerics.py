"""Numerics of each format against stock fp32 Adam, in two cases (issue 13):

* **drift**: 30 steps on PyTorch's own optim_db Adam/AdamW inputs (every CPU fp32 kwargs variant,
  the parameter shapes of ``bench/shapes.py``'s ``model_params``) with gradients scaled by 1, 0.1, 0.01,
  0.001 in turn: the relative L2 distance of the params to stock's, over stock's movement
  (``||p - p_fp32|| / ||p_fp32 - p_0||``) and over stock's params (``||p - p_fp32|| / ||p_fp32||``);
* **idle**: an embedding-like table whose rows are updated once (gradients N(0, 1), and 1e-20 for
  the second row) and then idle (gradients exactly 0) for 5,000 Adam steps, default betas: whether
  every param stays finite, how far it ends from stock, and the bound ``bench/bounds.py`` states
  (``tests/test_numerics.py`` asserts it), both over stock's movement during the idle steps.

    python bench/numerics.py                 # both cases, default layout (blocks of 512, no patches)
    python bench/numerics.py --idle-steps 1000

Runs the eager reference lowering (the semantics every kernel matches). Writes
``bench/results/numerics.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: find bench/ and tests/

import torch
from torch.testing._internal.common_optimizers import optim_db

from bench.bounds import idle_row_run
from bench.shapes import model_params
from lowbit_compile import lowbit_compile

RESULTS = Path(__file__).resolve().parent / "results"
FORMATS = ("int8", "dynamic8", "sqrt8", "fp8_e4m3", "fp8_e5m2", "bf16")
GRAD_SCALES = (1.0, 0.1, 0.01, 0.001)
DRIFT_STEPS = 30


def db_inputs() -> list[tuple[type, dict, str]]:
    """optim_db's CPU float32 inputs for Adam and AdamW (not capturable or differentiable ones)."""
    cases = []
    for info in optim_db:
        if info.optim_cls not in (torch.optim.Adam, torch.optim.AdamW):
            continue
        for inp in info.optim_inputs_func(device="cpu", dtype=torch.float32):
            kwargs = dict(inp.kwargs)
            if not kwargs.get("capturable") and not kwargs.get("differentiable"):
                cases.append((info.optim_cls, kwargs, f"{info.optim_cls.__name__}-{inp.desc}"))
    return cases


def drift(fmt: str, cls: type, kwargs: dict, block_size: int, outliers: int) -> tuple[float, float]:
    """(||p - p_fp32|| / ||p_fp32 - p_0||, ||p - p_fp32|| / ||p_fp32||) after DRIFT_STEPS steps."""
    torch.manual_seed(0)
    init = [p.detach().clone() for p in model_params()]
    finals = []
    for quantized in (False, True):
        params = [torch.nn.Parameter(p.clone()) for p in init]
        kw = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
        opt = cls(params, **kw)
        if quantized:
            opt = lowbit_compile(opt, fmt, block_size=block_size, outliers=outliers, min_8bit_size=0,
                                 backend="reference")
        gen = torch.Generator().manual_seed(1)
        for step in range(DRIFT_STEPS):
            for p in params:
                p.grad = torch.randn(p.shape, generator=gen) * GRAD_SCALES[step % len(GRAD_SCALES)]
            opt.step()
        finals.append(torch.cat([p.detach().reshape(-1) for p in params]))
    ref, ours = finals
    start = torch.cat([p.reshape(-1) for p in init])
    gap = (ours - ref).norm().item()
    return gap / (ref - start).norm().item(), gap / ref.norm().item()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--idle-steps", type=int, default=5000)
    ap.add_argument("--block-size", type=int, default=512)
    ap.add_argument("--outliers", type=int, default=0)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    cases = db_inputs()
    results: dict[str, dict] = {}
    for fmt in FORMATS:
        start = time.perf_counter()
        ratios = [drift(fmt, cls, kw, args.block_size, args.outliers) for cls, kw, _ in cases]
        moved, held = zip(*ratios)
        row = {"drift_over_movement": {"mean": sum(moved) / len(moved), "max": max(moved)},
               "drift_over_params": {"mean": sum(held) / len(held), "max": max(held)},
               "drift_seconds": time.perf_counter() - start}
        start = time.perf_counter()
        idle = idle_row_run(fmt, args.idle_steps, args.block_size)
        row["idle"] = {"finite": idle.finite, "max_off": idle.max_off, "off_over_movement": idle.off_over_movement,
                       "bound_over_movement": idle.bound_over_movement, "within_bound": idle.within_bound,
                       "seconds": time.perf_counter() - start}
        results[fmt] = row
        print(fmt, json.dumps(row), flush=True)
    lines = [f"Numerics against stock fp32 Adam (reference lowering, blocks of {args.block_size}, "
             f"{args.outliers} patches)", "",
             f"Drift: {DRIFT_STEPS} steps on optim_db's {len(cases)} CPU fp32 Adam/AdamW inputs, gradients scaled "
             f"{', '.join(map(str, GRAD_SCALES))} in turn. Idle: rows updated once, then {args.idle_steps} "
             "steps with zero gradients (Adam, default betas).", "",
             "| format | drift / stock's movement (mean, max) | drift / stock's params (mean, max) "
             "| idle: all finite | idle: max \\|p - p_fp32\\| | idle: off / movement | idle: bound / movement |",
             "|---|---:|---:|:---:|---:|---:|---:|"]
    for fmt, r in results.items():
        d, h, i = r["drift_over_movement"], r["drift_over_params"], r["idle"]
        lines.append(f"| {fmt} | {d['mean']:.4f}, {d['max']:.4f} | {h['mean']:.2e}, {h['max']:.2e} "
                     f"| {'yes' if i['finite'] else 'NO'} | {i['max_off']:.2e} | {i['off_over_movement']:.4f} "
                     f"| {i['bound_over_movement']:.4f}{'' if i['within_bound'] else ' (EXCEEDED)'} |")
    text = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "numerics.md").write_text(text)
    (args.out / "numerics.json").write_text(json.dumps(
        {"block_size": args.block_size, "outliers": args.outliers, "drift_steps": DRIFT_STEPS,
         "grad_scales": GRAD_SCALES, "idle_steps": args.idle_steps, "inputs": [c[2] for c in cases],
         "results": results}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
