"""Beyond Adam, on real tasks: every elementwise stock optimizer (and Lion, one's own) trained with
stock fp32 states and with 8-bit states, on the digits classifier and the Zipf embedding task of
``bench/tasks.py``, over several seeds; reports the final validation loss and the paired gap.

    python bench/other_optimizers.py               # 10 optimizers x 2 tasks x 3 seeds x 3 formats
    python bench/other_optimizers.py --fmts int8 --seeds 0

Writes ``bench/results/other_optimizers.{json,md}``. Each optimizer keeps its own learning rate
(``LR``, the peak of the tasks' warmup + cosine schedule), tuned for its stock fp32 run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: find examples/

import torch

from bench.tasks import TASKS, train
from examples.lion import Lion

RESULTS = Path(__file__).resolve().parent / "results"
# Per optimizer: its constructor arguments other than lr, and its peak lr per task.
OPTIMIZERS: dict[str, tuple[type, dict, dict[str, float]]] = {
    "SGD (momentum, nesterov)": (torch.optim.SGD, {"momentum": 0.9, "nesterov": True, "weight_decay": 1e-4},
                                 {"digits": 0.1, "zipf": 1.0}),
    "RMSprop (momentum)": (torch.optim.RMSprop, {"momentum": 0.5}, {"digits": 1e-3, "zipf": 3e-3}),
    "Adagrad": (torch.optim.Adagrad, {}, {"digits": 3e-2, "zipf": 0.1}),
    "Adamax": (torch.optim.Adamax, {}, {"digits": 3e-3, "zipf": 3e-2}),
    "NAdam": (torch.optim.NAdam, {}, {"digits": 3e-3, "zipf": 3e-2}),
    "RAdam (decoupled wd)": (torch.optim.RAdam, {"decoupled_weight_decay": True, "weight_decay": 0.01},
                             {"digits": 3e-3, "zipf": 3e-2}),
    "Adadelta": (torch.optim.Adadelta, {}, {"digits": 1.0, "zipf": 10.0}),
    "ASGD": (torch.optim.ASGD, {"t0": 100}, {"digits": 0.1, "zipf": 1.0}),
    "Rprop": (torch.optim.Rprop, {}, {"digits": 1e-3, "zipf": 1e-3}),
    "Lion (examples/lion.py)": (Lion, {"weight_decay": 0.1}, {"digits": 3e-4, "zipf": 3e-3}),
}


def run(task_name: str, opt_name: str, fmt: str | None, seed: int) -> dict:
    """One training run; ``fmt`` None is the stock optimizer."""
    from lowbit_compile import lowbit_compile

    cls, kwargs, lrs = OPTIMIZERS[opt_name]
    task = TASKS[task_name]()
    task.hyper = replace(task.hyper, lr=lrs[task_name])

    def build(params, hyper):
        opt = cls(params, lr=hyper.lr, **kwargs)
        return opt if fmt is None else lowbit_compile(opt, fmt)

    hist = train(task, build, seed)
    return {"task": task_name, "optimizer": opt_name, "fmt": fmt or "fp32", "seed": seed, **hist.final,
            "seconds": hist.seconds}


def summarize(runs: list[dict]) -> list[dict]:
    """Per task, optimizer and format: mean and std of the final loss, and of the paired gap to the
    stock run of the same seed (in %)."""
    stock = {(r["task"], r["optimizer"], r["seed"]): r["loss"] for r in runs if r["fmt"] == "fp32"}
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        groups.setdefault((r["task"], r["optimizer"], r["fmt"]), []).append(r)
    rows = []
    for (task, opt_name, fmt), rs in groups.items():
        losses = [r["loss"] for r in rs]
        gaps = [(r["loss"] / stock[(task, opt_name, r["seed"])] - 1) * 100 for r in rs]
        rows.append({"task": task, "optimizer": opt_name, "fmt": fmt, "loss_mean": statistics.fmean(losses),
                     "loss_std": statistics.stdev(losses) if len(losses) > 1 else 0.0,
                     "gap_pct_mean": statistics.fmean(gaps), "gap_pct_std": statistics.stdev(gaps) if len(gaps) > 1
                     else 0.0, "acc_mean": statistics.fmean(r["acc"] for r in rs), "seeds": len(rs)})
    return rows


def markdown(rows: list[dict], fmts: list[str]) -> str:
    lines = []
    for task in sorted({r["task"] for r in rows}):
        lines += [f"### {task}", "", "| optimizer | " + " | ".join(
            ["stock fp32 val loss (acc)"] + [f"{f}: val loss, gap to stock" for f in fmts]) + " |",
            "|---|" + "---:|" * (1 + len(fmts))]
        for opt_name in OPTIMIZERS:
            cells = []
            for fmt in ["fp32", *fmts]:
                r = next((r for r in rows if (r["task"], r["optimizer"], r["fmt"]) == (task, opt_name, fmt)), None)
                if r is None:
                    cells.append("")
                elif fmt == "fp32":
                    cells.append(f"{r['loss_mean']:.4f} ± {r['loss_std']:.4f} ({100 * r['acc_mean']:.1f}%)")
                else:
                    cells.append(f"{r['loss_mean']:.4f}, {r['gap_pct_mean']:+.2f} ± {r['gap_pct_std']:.2f}%")
            lines.append(f"| {opt_name} | " + " | ".join(cells) + " |")
        lines.append("")
    lines.append("Gap: mean ± std over seeds of (loss / stock loss of the same seed - 1).")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", nargs="+", default=["digits", "zipf"], choices=list(TASKS))
    ap.add_argument("--fmts", nargs="+", default=["sqrt8", "dynamic8", "int8"])
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    runs = []
    start = time.perf_counter()
    for task in args.tasks:
        for opt_name in OPTIMIZERS:
            for seed in args.seeds:
                for fmt in [None, *args.fmts]:
                    runs.append(run(task, opt_name, fmt, seed))
                    print(f"{task} {opt_name} {runs[-1]['fmt']} seed {seed}: loss {runs[-1]['loss']:.4f}", flush=True)
    rows = summarize(runs)
    text = (f"Measured {time.strftime('%Y-%m-%d %H:%M')}, torch {torch.__version__}, 1 thread, "
            f"{time.perf_counter() - start:.0f} s; command: bench/other_optimizers.py "
            f"{' '.join(argv if argv is not None else sys.argv[1:])}\n\n" + markdown(rows, args.fmts) + "\n")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "other_optimizers.md").write_text(text)
    (args.out / "other_optimizers.json").write_text(json.dumps({"runs": runs, "summary": rows}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
