"""What ``lowbit_compile.monitor`` costs and what it sees, per task of ``bench/tasks.py``.

Cost: each task trains the same seed plain and with a monitor sampling every ``--every`` steps
(default layout), alternately in one process, on one thread. Times are CPU time of that thread
(``time.thread_time``): on a shared machine wall time also counts the time other processes held
the core. Two figures: the CPU time of the samples over the monitored run's, and the ratio of the
monitored to the plain run's CPU time (the first, measured independently).

What it sees: one run per format with a sample every ``--see-every`` steps; the worst zero-flush
share and round-trip error of any state in any sample, next to the thresholds it warns at.

    python bench/monitor.py                        # zipf, digits, char_gpt; every=100
    python bench/monitor.py --tasks zipf --formats int8 dynamic8

Writes ``bench/results/monitor.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: find bench/

import torch

import lowbit_compile
from bench.tasks import TASKS, Hyper, OptimizerSpec, train
from lowbit_compile.config import DEFAULT_FMT
from lowbit_compile.health import MAX_REL_ERROR, MAX_ZERO_FLUSH, LowbitHealthWarning

RESULTS = Path(__file__).resolve().parent / "results"


def timed_run(task, steps: int, every: int | None) -> tuple[float, float, int]:
    """(CPU seconds of the run, CPU seconds spent in monitor samples, samples taken)."""
    spent: list[float] = []

    def make(params: list, hyper: Hyper) -> torch.optim.Optimizer:
        opt = OptimizerSpec(DEFAULT_FMT).build(params, hyper)
        if every is not None:
            mon = lowbit_compile.monitor(opt, every)
            check = mon.check

            def timed_check() -> dict:
                start = time.thread_time()
                try:
                    return check()
                finally:
                    spent.append(time.thread_time() - start)

            mon.check = timed_check
        return opt

    start = time.thread_time()
    train(task, make, seed=0, steps=steps)
    return time.thread_time() - start, sum(spent), len(spent)


def worst_seen(task, spec: str, every: int) -> dict[str, float]:
    """The worst zero-flush share and round-trip error over all samples of one run of ``spec``, and
    whether the monitor (its default thresholds, averaged over recent samples) warned in that run."""
    monitors = []

    def make(params: list, hyper: Hyper) -> torch.optim.Optimizer:
        opt = OptimizerSpec(spec).build(params, hyper)
        monitors.append(lowbit_compile.monitor(opt, every))
        return opt

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", LowbitHealthWarning)  # counted from the monitor's alerts
        history = train(task, make, seed=0)
    samples = monitors[0].history
    flush = sorted(h.get("lowbit/zero_flush", 0.0) for h in samples)
    return {"format": spec, "samples": len(samples), "worst_zero_flush": flush[-1],
            "median_zero_flush": flush[len(flush) // 2],
            "worst_rel_error": max(h.get("lowbit/rel_error", 0.0) for h in samples),
            "val_loss": history.final["loss"],
            "warned": [f"{a.stats.param}.{a.stats.state}" for a in monitors[0].alerts]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", nargs="+", default=["zipf", "digits", "char_gpt"], choices=sorted(TASKS))
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=2, help="plain/monitored pairs per task")
    parser.add_argument("--formats", nargs="+", default=["dynamic8", "fp8_e4m3", "int8", "int8-b2048-k0"])
    parser.add_argument("--see-every", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(1)

    rows = []
    for name in args.tasks:
        task = TASKS[name]()
        n_params = sum(p.numel() for p in task.model(0).parameters())
        timed_run(task, 2 * args.every, args.every)  # warm: traces, kernels, the monitor's first samples
        plain, monitored, sampled, samples = [], [], [], 0
        for _ in range(args.repeats):
            plain.append(timed_run(task, args.steps, None)[0])
            seconds, in_samples, n = timed_run(task, args.steps, args.every)
            monitored.append(seconds)
            sampled.append(in_samples)
            samples += n
        step_ms = 1e3 * min(plain) / args.steps
        row = {"task": name, "params": n_params, "steps": args.steps, "every": args.every,
               "step_ms": step_ms, "sample_ms": 1e3 * sum(sampled) / samples,
               "share_of_run": sum(sampled) / sum(monitored), "run_time_ratio": min(monitored) / min(plain)}
        rows.append(row)
        print(f"{name:<10} {n_params:>9,} params  step {step_ms:7.2f} ms  sample {row['sample_ms']:7.2f} ms  "
              f"samples {row['share_of_run']:.3%} of the run  monitored/plain run time {row['run_time_ratio']:.3f}")

    seen = []
    for name in args.tasks:
        task = TASKS[name]()
        for spec in args.formats:
            row = {"task": name, **worst_seen(task, spec, args.see_every)}
            seen.append(row)
            print(f"{name:<10} {spec:<16} worst zero flush {row['worst_zero_flush']:.2%} (median "
                  f"{row['median_zero_flush']:.2%}), worst round-trip error {row['worst_rel_error']:.2%}")

    stamp = time.strftime("%Y-%m-%d %H:%M")
    header = (f"Measured {stamp}, torch {torch.__version__}, 1 thread on {os.cpu_count()} CPUs shared with other "
              f"work, CPU time of the training thread; {DEFAULT_FMT} (the default layout); command: bench/monitor.py "
              f"{' '.join(sys.argv[1:])}".rstrip())
    lines = [header, "", "| task | params | step ms (CPU) | sample ms (CPU) | every | samples' share of the run | "
             "monitored / plain run |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['task']} | {r['params']:,} | {r['step_ms']:.2f} | {r['sample_ms']:.2f} | {r['every']} | "
                     f"{r['share_of_run']:.2%} | {r['run_time_ratio']:.3f} |")
    lines += ["", f"What a sample every {args.see_every} steps saw over a whole run (seed 0); the monitor warns when a "
              f"state's average over its recent samples is above {MAX_ZERO_FLUSH:.0%} zero flush or "
              f"{MAX_REL_ERROR:.0%} round-trip error (a single sample above it does not); (warned): it did in "
              "this run:", "",
              "| task | format | samples | worst zero flush | median | worst round-trip error | val loss |",
              "|---|---|---:|---:|---:|---:|---:|"]
    for r in seen:
        lines.append(f"| {r['task']} | {r['format']}{' (warned)' if r['warned'] else ''} | {r['samples']} | "
                     f"{r['worst_zero_flush']:.2%} | {r['median_zero_flush']:.2%} | {r['worst_rel_error']:.2%} | "
                     f"{r['val_loss']:.4f} |")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "monitor.md").write_text("\n".join(lines) + "\n")
    (RESULTS / "monitor.json").write_text(json.dumps({"measured": stamp, "cost": rows, "seen": seen}, indent=1)
                                          + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
