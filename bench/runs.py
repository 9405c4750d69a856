"""The quality benchmarks' shared bookkeeping: a grid of runs in a pool of fresh processes, saved after
each run so a stopped grid resumes, the results file's meta and header line, and the paired summary of
final losses against fp32 (``bench/quality.py``, ``diffusion.py``, ``long_run.py``, ``rounding.py``)."""

from __future__ import annotations

import json
import math
import multiprocessing
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch


def mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def summarize(runs: list[dict], key: str = "loss") -> dict:
    """Per task and optimizer: final validation loss (and metric) over seeds, and the gap to fp32.

    ``paired_gap_pct`` is the mean and std over seeds of (loss / fp32 loss of the same seed - 1);
    ``key`` names the validation loss it is computed on (a task may report several).
    ``matches_fp32`` holds when that mean is within one fp32 seed standard deviation (the spread a
    rerun of fp32 itself shows, in % of its mean) and within 0.5%."""
    out: dict = {}
    for task in sorted({r["task"] for r in runs}):
        rows = [r for r in runs if r["task"] == task]
        by_variant: dict[str, dict[int, dict]] = {}
        for r in rows:
            by_variant.setdefault(r["variant"], {})[r["seed"]] = r
        base = by_variant.get("fp32", {})
        base_mean, base_std = mean_std([r["val"][-1][key] for r in base.values()]) if base else (math.nan, 0)
        noise_pct = base_std / base_mean * 100
        out[task] = {}
        for variant, seeds in by_variant.items():
            losses = [r["val"][-1][key] for r in seeds.values()]
            mean, std = mean_std(losses)
            paired = [(seeds[s]["val"][-1][key] - base[s]["val"][-1][key]) / base[s]["val"][-1][key] * 100
                      for s in seeds if s in base]
            gap = mean_std(paired) if paired else (math.nan, math.nan)
            entry = {
                "seeds": sorted(seeds), "loss_mean": mean, "loss_std": std,
                "paired_gap_pct": gap, "fp32_noise_pct": noise_pct,
                "matches_fp32": abs(gap[0]) <= min(noise_pct, 0.5),
                "seconds": statistics.fmean(r["seconds"] for r in seeds.values()),
                "state_bytes_per_param": statistics.fmean(r["state_bytes_per_param"] for r in seeds.values()),
            }
            metric = [k for k in next(iter(seeds.values()))["val"][-1] if k != key]
            for m in metric:
                entry[f"{m}_mean"], entry[f"{m}_std"] = mean_std([r["val"][-1][m] for r in seeds.values()])
            out[task][variant] = entry
    return out


def load_runs(path: Path) -> tuple[list[dict], dict]:
    """The runs and the meta of a results JSON; each run names the command that ran it (runs saved
    before runs named it get the file's command)."""
    data = json.loads(path.read_text())
    for r in data["runs"]:
        r.setdefault("command", " ".join(data["meta"]["argv"]))
    return data["runs"], data["meta"]


def git_commits() -> dict:
    """The commit the bench runs at and the commit of main it contains (the library's code under test)."""
    def rev(*args: str) -> str | None:
        out = subprocess.run(["git", *args], cwd=Path(__file__).resolve().parent, capture_output=True, text=True)
        return out.stdout.strip()[:7] if out.returncode == 0 and out.stdout.strip() else None

    return {"commit": rev("rev-parse", "HEAD"), "main_commit": rev("merge-base", "HEAD", "main")}


def run_meta(jobs: int, threads: int, compile_peers: bool, **extra) -> dict:
    """What a results file records about how it was measured."""
    return {"argv": sys.argv, "torch": torch.__version__, "torchao_compiled": compile_peers,
            "python": platform.python_version(), "machine": platform.machine(),
            "cpus": multiprocessing.cpu_count(), "jobs": jobs, "threads": threads,
            "date": time.strftime("%Y-%m-%d %H:%M"), **git_commits(), **extra}


def run_pool(run: Callable[[tuple], dict], jobs: list[tuple], n_jobs: int, runs: list[dict], meta: dict,
             save: Callable[[], None], **tags) -> None:
    """Run every job in a pool of ``n_jobs`` fresh processes, appending each record (with ``tags``) to
    ``runs`` and saving after each, so a stopped grid resumes where it was; records the wall time."""
    from tqdm import tqdm

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so the pool below takes its workers down
    ctx = multiprocessing.get_context("spawn")
    start = time.perf_counter()
    with ctx.Pool(n_jobs) as pool, tqdm(total=len(jobs), desc="runs", unit="run") as bar:
        for record in pool.imap_unordered(run, jobs):
            record.update(tags, command=" ".join(sys.argv), commit=meta.get("commit"),
                          main_commit=meta.get("main_commit"))
            runs.append(record)
            bar.set_postfix_str(f"{record['task']} {record['variant']} s{record['seed']}: "
                                f"{record['val'][-1]['loss']:.4f}")
            bar.update()
            save()
    meta["wall_seconds"] = time.perf_counter() - start
    save()


def results_header(meta: dict, runs: list[dict] = ()) -> str:
    """The line above a results table: when, with what, by which command(s) (a resumed grid's runs name
    the command that ran each)."""
    commands = list(dict.fromkeys(r["command"] for r in runs if "command" in r)) or [" ".join(meta["argv"])]
    mains = list(dict.fromkeys(r.get("main_commit") or "unrecorded" for r in runs)) or [meta.get("main_commit")]
    return (f"Measured {meta['date']} at main {', '.join(map(str, mains))}, torch {meta['torch']}, "
            f"{meta['jobs']} runs in parallel with "
            f"{meta['threads']} thread(s) each on {meta['cpus']} CPUs; torchao "
            f"{'compiled' if meta['torchao_compiled'] else 'run eagerly'}; "
            f"command{'s' if len(commands) > 1 else ''}: {'; '.join(f'`{c}`' for c in commands)}\n\n")
