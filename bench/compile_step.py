"""The wrapped step called eagerly and from a ``torch.compile``d function (``fullgraph=True``, one
``lowbit::optimizer_step`` op in the graph), and stock AdamW's eager steps beside them.

    python bench/compile_step.py                 # 25M params in 15 tensors, 1 thread, 15 rounds
    python bench/compile_step.py --rounds 5 --backend aot_eager

Every contender steps its own copy of the same params with the same grads; the rounds interleave the
contenders, each round timing a few steps of each, so a busy machine slows all of them alike; the
table gives the medians and each one's ratio to the eager wrapped step. Results go to
bench/results/compile_step.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.first_step import SHAPES
from lowbit_compile import lowbit_compile

RESULTS = Path(__file__).parent / "results"


def contenders(backend: str) -> dict[str, Callable[[], object]]:
    """name -> the call that steps its optimizer once."""
    made = {}
    for name in ("stock AdamW (foreach)", "stock AdamW (fused)", "lowbit eager", "lowbit compiled (fullgraph)"):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in SHAPES]
        for p in params:
            p.grad = torch.randn_like(p) * 1e-3
        kwargs = {"fused": True} if "fused" in name else {"foreach": True} if "foreach" in name else {}
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, **kwargs)
        if name.startswith("lowbit"):
            opt = lowbit_compile(opt)
        step = opt.step
        if "compiled" in name:
            step = torch.compile(lambda opt=opt: opt.step(), backend=backend, fullgraph=True)
        made[name] = step
    return made


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=3, help="steps per contender per round")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS / "compile_step.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()[0]
    made = contenders(args.backend)
    for step in made.values():  # warm up: kernels built, graphs compiled (twice: before and after states)
        for _ in range(3):
            step()
    times: dict[str, list[float]] = {name: [] for name in made}
    for _ in range(args.rounds):
        for name, step in made.items():
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            times[name].append((time.perf_counter() - start) / args.steps)
    base = statistics.median(times["lowbit eager"])
    n = sum(torch.Size(s).numel() for s in SHAPES)
    lines = [f"| step ({n / 1e6:.1f}M params, {len(SHAPES)} tensors, {args.threads} thread) | median | range | "
             "x lowbit eager |", "|---|---:|---:|---:|"]
    for name, ts in times.items():
        med = statistics.median(ts)
        lines.append(f"| {name} | {med * 1e3:.1f} ms | {min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f} ms | "
                     f"{med / base:.2f}x |")
    table = "\n".join(lines)
    print(table)
    load = f"{load_before:.1f} -> {os.getloadavg()[0]:.1f}"
    meta = {"params": n, "tensors": len(SHAPES), "threads": args.threads, "rounds": args.rounds,
            "steps": args.steps, "backend": args.backend, "torch": torch.__version__, "load_1min": load}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "seconds": times}, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(
        f"# The wrapped step under torch.compile\n\n`python bench/compile_step.py` (backend {args.backend}, "
        f"{args.rounds} interleaved rounds of {args.steps} steps, torch {torch.__version__}, 1-minute load average "
        f"{load}); the default format, the CPU kernel.\n\n{table}\n")
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
