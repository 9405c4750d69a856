"""The demo: a small character-level GPT trained with stock fp32 AdamW and with low-bit states, paired.

Every optimizer trains from the same initial weights on the same batches for a given seed, so the
gap to fp32 is measured per seed and reported with its spread over seeds, next to fp32's own spread
between seeds (what "the same" can mean at this size); the gap is shown at several points of the
run, to see it settle. Prints the bytes each state holds and writes a PNG of the loss curves.
Run: ``make demo`` (or ``python examples/demo.py --steps 300 --seeds 0 1 2 --fmt sqrt8 dynamic8 int8``).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: find bench/

import torch

from bench.tasks import CharGPT, Hyper, train
from lowbit_compile import lowbit_compile, memory_report

STOCK = "fp32"
# outside the tracked tree (results/ is git-ignored); the README's figure is bench/results/demo.png,
# rewritten only when asked: --png bench/results/demo.png
PNG = Path(__file__).resolve().parents[1] / "results" / "demo.png"


def make_task(steps: int) -> CharGPT:
    """0.1M params: two layers of width 64 over 64 characters, batches of 8 windows."""
    hyper = Hyper(steps=steps, lr=3e-3, weight_decay=0.1, warmup=steps // 10, eval_every=max(steps // 6, 1), clip=1.0)
    return CharGPT(d=64, layers=2, heads=4, ctx=64, batch=8, hyper=hyper)


@dataclass(frozen=True)
class Run:
    fmt: str
    seed: int
    train_loss: list[float]
    val_steps: list[int]
    val_loss: list[float]
    state_bytes: dict[str, int]  # per state key, bytes held
    params: int
    seconds: float


def run_one(fmt: str, seed: int, steps: int) -> Run:
    """One training run (in a worker process, on one thread)."""
    torch.set_num_threads(1)
    task = make_task(steps)
    holder: dict[str, torch.optim.Optimizer] = {}

    def make(params, h):
        opt = torch.optim.AdamW(params, lr=h.lr, betas=h.betas, weight_decay=h.weight_decay)
        holder["opt"] = opt if fmt == STOCK else lowbit_compile(opt, fmt)
        return holder["opt"]

    history = train(task, make, seed=seed)
    report = memory_report(holder["opt"])
    return Run(fmt, seed, history.train_loss, history.val_steps, [v["loss"] for v in history.val],
               {k: m.bytes for k, m in report.per_state.items() if k != "step"}, report.total.params, history.seconds)


def spread(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def paired_gaps(runs: dict[tuple[str, int], Run], fmt: str, seeds: list[int], at: int) -> list[float]:
    """Per seed, (val loss - fp32's val loss) / fp32's, at the ``at``-th evaluation."""
    return [(runs[fmt, s].val_loss[at] - runs[STOCK, s].val_loss[at]) / runs[STOCK, s].val_loss[at] for s in seeds]


def report(runs: dict[tuple[str, int], Run], fmts: list[str], seeds: list[int]) -> str:
    first = runs[STOCK, seeds[0]]
    keys = sorted(first.state_bytes)
    stock_final = [runs[STOCK, s].val_loss[-1] for s in seeds]
    lines = [f"{'AdamW states':<14}" + "".join(f"{k + ' B/param':>20}" for k in keys)
             + f"{'val loss (mean ± sd)':>24}{'gap to fp32 (paired)':>24}"]
    for fmt in fmts:
        r = runs[fmt, seeds[0]]
        finals = [runs[fmt, s].val_loss[-1] for s in seeds]
        gaps = paired_gaps(runs, fmt, seeds, -1)
        gap = "" if fmt == STOCK else f"{statistics.mean(gaps):+.2%} ± {spread(gaps):.2%}"
        lines.append(f"{fmt + (' (stock)' if fmt == STOCK else ''):<14}"
                     + "".join(f"{r.state_bytes[k] / r.params:>20.3f}" for k in keys)
                     + f"{statistics.mean(finals):>15.4f} ± {spread(finals):.4f}{gap:>24}")
    own = spread(stock_final) / statistics.mean(stock_final)
    lines.append(f"\nfp32's own spread between seeds: ± {own:.2%} of its val loss; a gap inside its paired ± is no "
                 "difference this run can see.")
    lines.append("\npaired gap to fp32 over the run (mean ± sd over seeds), by step:")
    steps = first.val_steps
    lines.append(f"{'':<14}" + "".join(f"{s:>18}" for s in steps))
    for fmt in fmts[1:]:
        cells = []
        for i in range(len(steps)):
            gaps = paired_gaps(runs, fmt, seeds, i)
            cells.append(f"{statistics.mean(gaps):+.2%} ± {spread(gaps):.2%}")
        lines.append(f"{fmt:<14}" + "".join(f"{c:>18}" for c in cells))
    lines.append("\nB/param: the bytes each state actually holds (codes, scales, patches) over the parameters; "
                 "tensors under 4096 elements keep fp32 states.")
    return "\n".join(lines)


def plot(runs: dict[tuple[str, int], Run], fmts: list[str], seeds: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_gap) = plt.subplots(1, 2, figsize=(11, 4.2))
    for fmt in fmts:
        curves = torch.tensor([runs[fmt, s].train_loss for s in seeds])
        smooth = torch.tensor([_ema(c.tolist(), 0.05) for c in curves]).mean(0)
        line, = ax_loss.plot(range(1, len(smooth) + 1), smooth, lw=1.2, label=f"{fmt} train (EMA)")
        val = torch.tensor([runs[fmt, s].val_loss for s in seeds]).mean(0)
        ax_loss.plot(runs[fmt, seeds[0]].val_steps, val, "o--", color=line.get_color(), ms=4, label=f"{fmt} val")
        if fmt != STOCK:
            steps = runs[fmt, seeds[0]].val_steps
            gaps = [paired_gaps(runs, fmt, seeds, i) for i in range(len(steps))]
            mean = [100 * statistics.mean(g) for g in gaps]
            sd = [100 * spread(g) for g in gaps]
            ax_gap.errorbar(steps, mean, yerr=sd, capsize=3, marker="o", color=line.get_color(), label=fmt)
    stock = [[runs[STOCK, s].val_loss[i] for s in seeds] for i in range(len(runs[STOCK, seeds[0]].val_steps))]
    band = [100 * spread(v) / statistics.mean(v) for v in stock]
    ax_gap.fill_between(runs[STOCK, seeds[0]].val_steps, [-b for b in band], band, color="grey", alpha=0.2,
                        label="fp32 seed spread")
    ax_gap.axhline(0, color="black", lw=0.8)
    ax_loss.set(xlabel="step", ylabel="loss", title=f"loss, mean of {len(seeds)} seeds")
    ax_gap.set(xlabel="step", ylabel="val loss gap to fp32 (%)", title="paired gap to fp32 (mean ± sd over seeds)")
    ax_loss.legend(fontsize=7)
    ax_gap.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def _ema(xs: list[float], alpha: float) -> list[float]:
    out, value = [], xs[0]
    for x in xs:
        value += alpha * (x - value)
        out.append(value)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--fmt", nargs="+", default=["sqrt8", "dynamic8", "int8"],
                        help="low-bit formats to compare (sqrt8 is the library default)")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="runs at a time, 1 thread each")
    parser.add_argument("--png", type=Path, default=PNG, help=f"where the plot goes (default {PNG})")
    args = parser.parse_args()
    fmts = [STOCK, *args.fmt]
    n_params = sum(p.numel() for p in make_task(args.steps).model(0).parameters())
    task = make_task(args.steps)
    print(f"char-level GPT on Python's pydoc text: {n_params / 1e6:.2f}M params, {args.steps} steps of "
          f"{task.batch_size}x{task.ctx} characters, seeds {' '.join(map(str, args.seeds))}; every optimizer "
          f"starts from the same weights and sees the same batches per seed ({args.jobs} runs at a time)\n")
    start = time.perf_counter()
    runs: dict[tuple[str, int], Run] = {}
    jobs = [(fmt, seed) for seed in args.seeds for fmt in fmts]
    with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(run_one, fmt, seed, args.steps): (fmt, seed) for fmt, seed in jobs}
        for future, key in futures.items():
            runs[key] = future.result()
            print(f"  {key[0]:<10} seed {key[1]}: val loss {runs[key].val_loss[-1]:.4f} ({runs[key].seconds:.0f} s)",
                  flush=True)
    print()
    print(report(runs, fmts, args.seeds))
    args.png.parent.mkdir(parents=True, exist_ok=True)
    plot(runs, fmts, args.seeds, args.png)
    print(f"\nloss curves: {args.png}   ({time.perf_counter() - start:.0f} s in all)")


if __name__ == "__main__":
    main()
