"""What stochastic rounding costs the CPU step: AdamW on 8.4M params (five matrices), one thread, each
format with rounding to nearest, stochastic rounding of the second moments only (``rounding=
{"exp_avg_sq": "stochastic"}``, what the long run's drift asks for) and of both moments, stepped in
turn in one process with the same gradients; the median step time over rounds and its ratio to
nearest of the same format.

    python bench/rounding_cost.py               # sqrt8, int8, dynamic8, fp8_e4m3
    python bench/rounding_cost.py --fmts sqrt8 --rounds 30

Writes ``bench/results/rounding_cost.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: find bench/

import torch

from bench.quality import results_header, run_meta
from lowbit_compile import lowbit_compile

RESULTS = Path(__file__).resolve().parent / "results"
SHAPES = [(1024, 1024)] * 4 + [(4096, 1024)]
ROUNDINGS = {"nearest": "nearest", "stochastic v": {"exp_avg_sq": "stochastic"}, "stochastic m and v": "stochastic"}


def measure(fmt: str, rounds: int) -> dict[str, float]:
    """Median seconds per step of each rounding of ``fmt``, the optimizers stepped in turn each round."""
    grads = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(SHAPES)]
    built = {}
    for name, rounding in ROUNDINGS.items():
        params = [torch.nn.Parameter(torch.randn(s, generator=torch.Generator().manual_seed(100 + i)))
                  for i, s in enumerate(SHAPES)]
        built[name] = (params, lowbit_compile(torch.optim.AdamW(params, lr=1e-3), fmt=fmt, rounding=rounding))
    times: dict[str, list[float]] = {name: [] for name in ROUNDINGS}
    for r in range(rounds + 2):
        for name, (params, opt) in built.items():
            for p, g in zip(params, grads):
                p.grad = g.clone()
            start = time.perf_counter()
            opt.step()
            if r >= 2:  # the first two build and warm the kernels
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fmts", nargs="+", default=["sqrt8", "int8", "dynamic8", "fp8_e4m3"])
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    meta = run_meta(1, 1, False)
    rows = {fmt: measure(fmt, args.rounds) for fmt in args.fmts}
    n = sum(a * b for a, b in SHAPES)
    lines = [f"AdamW on {n / 1e6:.1f}M params, 1 thread, median of {args.rounds} steps; ratio to nearest of the "
             "same format", "", "| format | " + " | ".join(ROUNDINGS) + " |", "|---|" + "---:|" * len(ROUNDINGS)]
    for fmt, t in rows.items():
        cells = [f"{t[name] * 1e3:.1f} ms ({t[name] / t['nearest']:.2f}x)" for name in ROUNDINGS]
        lines.append(f"| {fmt} | " + " | ".join(cells) + " |")
    text = results_header(meta) + "\n".join(lines)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "rounding_cost.json").write_text(json.dumps({"meta": meta, "seconds": rows}))
    (args.out / "rounding_cost.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
