"""Does it train like fp32? Trains every task of ``examples/tasks.py`` with stock fp32 AdamW, with each
of our state formats (with and without outlier patches, at two block sizes) and with the peer 8-bit
optimizers (bitsandbytes, torchao), over several seeds, and reports the final validation numbers.

    python bench/quality.py                 # the full grid; about 40 minutes on 2 busy cores
    python bench/quality.py --quick         # a smoke run of a few minutes: fewer steps, seeds, variants
    python bench/quality.py --tasks zipf --variants 'int8*' fp32 --seeds 0 1 2

Writes ``bench/results/quality.json`` (every run's curves), ``quality.md`` (the tables) and
``quality_<task>.png`` (validation-loss curves). Runs already in the JSON are reused with
``--resume``. Every run of a task and seed sees the same initial weights and batches, so the
gap to fp32 is a paired difference.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import multiprocessing
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: find examples/ and bench/

import torch

from examples.tasks import PEERS, TASKS, Hyper, OptimizerSpec, Task, train

RESULTS = Path(__file__).resolve().parent / "results"
FORMATS = ("int8", "dynamic8", "fp8_e4m3", "fp8_e5m2")
LAYOUTS = ((2048, 2), (2048, 0), (256, 0))  # (block_size, outliers); 256 without patches is the peers' layout
SEEDS = (0, 1, 2)


def full_grid(task: str | None = None) -> list[str]:
    """Every optimizer of the comparison; the GPT, 5x costlier per step, runs the default layout of
    each format, linear INT8 without patches and the peers' layout of dynamic8."""
    layouts = LAYOUTS[:1] if task == "char_gpt" else LAYOUTS
    ours = [f"{f}-b{b}-k{k}" for f in FORMATS for b, k in layouts]
    if task == "char_gpt":
        ours += ["int8-b2048-k0", "dynamic8-b256-k0"]
    return ["fp32", *ours, "bf16", *PEERS]


QUICK_GRID = ["fp32", "int8-b2048-k2", "int8-b2048-k0", "dynamic8-b2048-k2", "fp8_e4m3-b2048-k2", "bf16",
              "bnb-AdamW8bit", "ao-AdamW8bit"]


# one run -------------------------------------------------------------------------------------------
_tasks: dict[tuple[str, float], Task] = {}


def _task(name: str, step_scale: float) -> Task:
    key = (name, step_scale)
    if key not in _tasks:
        task = TASKS[name]()
        if step_scale != 1.0:
            h = task.hyper
            steps = max(10, int(h.steps * step_scale))
            task.hyper = Hyper(steps, h.lr, h.weight_decay, max(1, int(h.warmup * step_scale)),
                               max(1, int(h.eval_every * step_scale)), h.betas, h.eps)
        _tasks[key] = task
    return _tasks[key]


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of every tensor in ``opt.state``, looking inside tensor subclasses (ours, torchao's) and
    counting a tensor shared by several states (bitsandbytes' code maps) once."""
    seen: dict[tuple[int, int], int] = {}

    def visit(t: torch.Tensor) -> None:
        if hasattr(t, "__tensor_flatten__"):
            for name in t.__tensor_flatten__()[0]:
                visit(getattr(t, name))
        elif t.numel():
            seen[(t.data_ptr(), t.numel())] = t.numel() * t.element_size()

    for s in opt.state.values():
        for v in s.values():
            if isinstance(v, torch.Tensor):
                visit(v)
    return sum(seen.values())


def run_one(job: tuple[str, str, int, float, int]) -> dict:
    """Train one (task, optimizer, seed); returns the JSON record of the run."""
    task_name, variant, seed, step_scale, threads = job
    torch.set_num_threads(threads)
    task = _task(task_name, step_scale)
    spec = OptimizerSpec(variant)
    built: list[torch.optim.Optimizer] = []

    def build(params, hyper):
        built.append(spec.build(params, hyper))
        return built[-1]

    hist = train(task, build, seed)
    n_params = sum(p.numel() for g in built[0].param_groups for p in g["params"])
    return {
        "task": task_name, "variant": variant, "seed": seed, "steps": task.hyper.steps,
        "train_loss": hist.train_loss, "val_steps": hist.val_steps, "val": hist.val,
        "seconds": hist.seconds, "state_bytes_per_param": state_bytes(built[0]) / n_params,
    }


# summary -------------------------------------------------------------------------------------------
def _mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def summarize(runs: list[dict]) -> dict:
    """Per task and optimizer: final validation loss (and metric) over seeds, and the gap to fp32.

    ``within_noise`` holds when the mean final loss is within one fp32 seed standard deviation of
    fp32's mean (the spread a rerun of fp32 itself shows)."""
    out: dict = {}
    for task in sorted({r["task"] for r in runs}):
        rows = [r for r in runs if r["task"] == task]
        by_variant: dict[str, dict[int, dict]] = {}
        for r in rows:
            by_variant.setdefault(r["variant"], {})[r["seed"]] = r
        base = by_variant.get("fp32", {})
        base_mean, base_std = _mean_std([r["val"][-1]["loss"] for r in base.values()]) if base else (math.nan, 0)
        out[task] = {}
        for variant, seeds in by_variant.items():
            losses = [r["val"][-1]["loss"] for r in seeds.values()]
            mean, std = _mean_std(losses)
            paired = [(seeds[s]["val"][-1]["loss"] - base[s]["val"][-1]["loss"]) / base[s]["val"][-1]["loss"] * 100
                      for s in seeds if s in base]
            entry = {
                "seeds": sorted(seeds), "loss_mean": mean, "loss_std": std,
                "gap_pct": (mean - base_mean) / base_mean * 100,
                "paired_gap_pct": _mean_std(paired) if paired else None,
                "within_noise": abs(mean - base_mean) <= base_std,
                "seconds": statistics.fmean(r["seconds"] for r in seeds.values()),
                "state_bytes_per_param": statistics.fmean(r["state_bytes_per_param"] for r in seeds.values()),
            }
            metric = [k for k in next(iter(seeds.values()))["val"][-1] if k != "loss"]
            for m in metric:
                entry[f"{m}_mean"], entry[f"{m}_std"] = _mean_std([r["val"][-1][m] for r in seeds.values()])
            out[task][variant] = entry
    return out


def _order(variant: str) -> tuple:
    grid = full_grid()
    return (grid.index(variant) if variant in grid else len(grid), variant)


def markdown(summary: dict, tasks: dict[str, Task]) -> str:
    lines = []
    for task, rows in summary.items():
        hyper = tasks[task].hyper
        n_params = sum(p.numel() for p in tasks[task].model(0).parameters())
        lines += [f"### {task} ({n_params:,} params, {hyper.steps} steps, lr {hyper.lr}, "
                  f"weight decay {hyper.weight_decay})", ""]
        metric = next((k[:-5] for k in next(iter(rows.values())) if k.endswith("_mean") and k != "loss_mean"), None)
        head = "| optimizer | state B/param | val loss | gap to fp32 | paired gap | ≈ fp32 |"
        sep = "|---|---:|---:|---:|---:|:-:|"
        if metric:
            head += f" val {metric} |"
            sep += "---:|"
        lines += [head + " s/run |", sep + "---:|"]
        for variant in sorted(rows, key=_order):
            e = rows[variant]
            paired = e["paired_gap_pct"]
            row = (f"| {variant} | {e['state_bytes_per_param']:.3f} | {e['loss_mean']:.4f} ± {e['loss_std']:.4f} "
                   f"| {e['gap_pct']:+.2f}% | "
                   + (f"{paired[0]:+.2f} ± {paired[1]:.2f}%" if paired else "–")
                   + f" | {'yes' if e['within_noise'] else '**no**'} |")
            if metric:
                row += f" {e[metric + '_mean'] * 100:.2f} ± {e[metric + '_std'] * 100:.2f}% |"
            lines.append(row + f" {e['seconds']:.0f} |")
        lines.append("")
    return "\n".join(lines)


def plot(runs: list[dict], task: str, path: Path) -> None:
    """Validation loss of fp32, and every optimizer's gap to fp32 along training, means over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in runs if r["task"] == task]
    curves: dict[str, dict[int, list[float]]] = {}
    steps: dict[str, list[int]] = {}
    for r in rows:
        curves.setdefault(r["variant"], {})[r["seed"]] = [v["loss"] for v in r["val"]]
        steps[r["variant"]] = r["val_steps"]
    if "fp32" not in curves:
        return
    base = curves["fp32"]

    def mean_curve(variant: str) -> list[float]:
        return [statistics.fmean(c[i] for c in curves[variant].values()) for i in range(len(steps[variant]))]

    def gap_curve(variant: str) -> list[float]:
        seeds = [s for s in curves[variant] if s in base]
        return [statistics.fmean((curves[variant][s][i] / base[s][i] - 1) * 100 for s in seeds)
                for i in range(len(steps[variant]))]

    spread = [statistics.stdev(c[i] for c in base.values()) / statistics.fmean(c[i] for c in base.values()) * 100
              if len(base) > 1 else 0.0 for i in range(len(steps["fp32"]))]
    panels = [("without patches (k0), block 2048", lambda v: v.endswith("-b2048-k0")),
              ("with 2 patches (k2), block 2048", lambda v: v.endswith("-b2048-k2") or v == "bf16"),
              ("block 256, no patches (the peers' layout)", lambda v: "-b256-" in v),
              ("bitsandbytes and torchao", lambda v: v in PEERS)]
    fig, axes = plt.subplots(1, 1 + len(panels), figsize=(5 * (1 + len(panels)), 4.2))
    ax = axes[0]
    ax.plot(steps["fp32"], mean_curve("fp32"), color="black", label="fp32 AdamW")
    ax.set(title=f"{task}: validation loss (fp32)", xlabel="step", ylabel="val loss")
    ax.legend()
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (title, pick) in zip(axes[1:], panels):
        ax.fill_between(steps["fp32"], [-s for s in spread], spread, color="0.85", label="fp32 seed std")
        ax.axhline(0, color="black", lw=0.8)
        for i, variant in enumerate(sorted((v for v in curves if pick(v)), key=_order)):
            style = "-"
            color = colors[(FORMATS.index(variant.split("-")[0]) if variant.split("-")[0] in FORMATS else i)
                           % len(colors)] if variant not in PEERS else colors[(4 + i) % len(colors)]
            ax.plot(steps[variant], gap_curve(variant), style, color=color, label=variant)
        ax.set(title=title, xlabel="step", ylabel="val loss gap to fp32 (%)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# driver --------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1/5 of the steps, 2 seeds, a few optimizers")
    ap.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    ap.add_argument("--variants", nargs="+", help="optimizer names or globs (default: the full grid)")
    ap.add_argument("--seeds", nargs="+", type=int)
    ap.add_argument("--step-scale", type=float, help="multiply every task's steps (and warmup, eval cadence)")
    ap.add_argument("--jobs", type=int, default=2, help="runs in parallel, one process each")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--resume", action="store_true", help="reuse runs already in OUT/quality.json")
    args = ap.parse_args(argv)

    from tqdm import tqdm

    def variants(task: str) -> list[str]:
        if args.variants:
            return [v for v in dict.fromkeys(full_grid() + args.variants)
                    if any(fnmatch.fnmatchcase(v, pat) for pat in args.variants)]
        return QUICK_GRID if args.quick else full_grid(task)

    for task in args.tasks:
        for v in variants(task):
            if OptimizerSpec(v).kind == "ours":
                OptimizerSpec(v).lowbit_options()  # a bad name fails now, not an hour in
    seeds = args.seeds or (SEEDS[:2] if args.quick else SEEDS)
    scale = args.step_scale or (0.2 if args.quick else 1.0)
    name = "quality_quick" if args.quick else "quality"
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / f"{name}.json"

    runs: list[dict] = []
    if args.resume and json_path.exists():
        runs = [r for r in json.loads(json_path.read_text())["runs"] if r.get("step_scale", 1.0) == scale]
    done = {(r["task"], r["variant"], r["seed"]) for r in runs}
    jobs = [(t, v, s, scale, args.threads) for t in args.tasks for v in variants(t) for s in seeds
            if (t, v, s) not in done]
    # the most expensive task first, so the parallel tail is short
    jobs.sort(key=lambda j: (list(TASKS).index(j[0]) if j[0] != "char_gpt" else -1))
    meta = {"argv": sys.argv, "torch": torch.__version__, "python": platform.python_version(),
            "machine": platform.machine(), "cpus": multiprocessing.cpu_count(), "jobs": args.jobs,
            "threads": args.threads, "date": time.strftime("%Y-%m-%d %H:%M")}

    def save() -> None:
        tasks = {t: _task(t, scale) for t in {r["task"] for r in runs}}
        summary = summarize(runs)
        json_path.write_text(json.dumps({"meta": meta, "summary": summary, "runs": runs}))
        (args.out / f"{name}.md").write_text(markdown(summary, tasks))

    ctx = multiprocessing.get_context("spawn")
    start = time.perf_counter()
    with ctx.Pool(args.jobs) as pool, tqdm(total=len(jobs), desc="runs", unit="run") as bar:
        for record in pool.imap_unordered(run_one, jobs):
            record["step_scale"] = scale
            runs.append(record)
            bar.set_postfix_str(f"{record['task']} {record['variant']} s{record['seed']}: "
                                f"{record['val'][-1]['loss']:.4f}")
            bar.update()
            save()
    meta["wall_seconds"] = time.perf_counter() - start
    save()
    for task in args.tasks:
        plot(runs, task, args.out / f"{name}_{task}.png")
    print((args.out / f"{name}.md").read_text())


if __name__ == "__main__":
    main()
