"""Does it train like fp32? Trains every task of ``bench/tasks.py`` with stock fp32 AdamW, with each
of our state formats (with and without outlier patches, at two block sizes) and with the peer 8-bit
optimizers (bitsandbytes, torchao), over several seeds, and reports the final validation numbers.

    python bench/quality.py                 # the full grid; about 50 minutes on 2 busy cores
    python bench/quality.py --quick         # a smoke run of a few minutes: fewer steps, seeds, variants
    python bench/quality.py --tasks zipf --variants 'int8*' fp32 --seeds 0 1 2

Writes ``bench/results/quality.json`` (every run's curves), ``quality.md`` (the tables) and
``quality_<task>.png`` (validation-loss curves). Optimizer names as in ``bench/rounding.py``: one of
ours rounds v stochastically and m to nearest (the library's default); ``<ours>+nearest`` rounds every
state to nearest, as every run of ours did before that default. Runs already in the JSON are reused with
``--resume``. Every run of a task and seed sees the same initial weights and batches, so the
gap to fp32 is a paired difference.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: find bench/

import torch

from bench.rounding import check_name, make_optimizer, split_name
from bench.runs import load_runs, results_header, run_meta, run_pool, summarize
from bench.tasks import PEERS, TASKS, OptimizerSpec, Task, train

RESULTS = Path(__file__).resolve().parent / "results"
FORMATS = ("int8", "dynamic8", "sqrt8", "fp8_e4m3", "fp8_e5m2")
FOUR_BIT = ("sqrt4",)  # at its own layout (blocks of 128), beside torchao's AdamW4bit
# (block_size, outliers). Scales and patches of m + v must stay under 0.02 B/param for the 2.02 B/param
# budget: 2048 with 2 patches adds 0.0117, 1024 without 0.0078, 512 without (the default) 0.0156;
# 256 without patches (0.031, over) is the layout of bitsandbytes and torchao.
LAYOUTS = ((2048, 2), (2048, 0), (1024, 0), (512, 0), (256, 0))
SEEDS = (0, 1, 2)
OWN_BENCH = ("dit_digits",)  # tasks with a bench of their own, run here only when named


def full_grid(task: str | None = None) -> list[str]:
    """Every optimizer of the comparison. The GPT, 5x costlier per step, runs each format at block
    2048 with patches and at the default 512 without, plus linear INT8 at 2048 without patches and
    dynamic8 at 1024 and 256."""
    if task == "char_gpt":
        ours = [f"{f}-b{b}-k{k}" for f in FORMATS for b, k in ((2048, 2), (512, 0))] + [
            "int8-b2048-k0", "dynamic8-b1024-k0", "dynamic8-b256-k0"]
    elif task == "char_gpt_2m":  # ~2 minutes a run: the default layout of each format, and the peers
        return ["fp32", *(f"{f}-b512-k0" for f in FORMATS[:4]), *FOUR_BIT, *PEERS]
    else:
        ours = [f"{f}-b{b}-k{k}" for f in FORMATS for b, k in LAYOUTS]
    return ["fp32", *ours, *FOUR_BIT, "bf16", *PEERS]


# Master weights: bf16 params with stock AdamW (no fp32 master), the fp32 master recipe (stock AdamW, and
# our default states, on fp32 copies), ours with master weights at the default states and with fp32
# states, the lossy residual, and fp32 params. Each (ours, recipe) pair of MASTER_PAIRS must train
# identically, every loss of every step (tasks.py's master_spec names them).
MASTER_GRID = ["fp32", "bf16p-adamw", "bf16p-master", "bf16p-master-dynamic8-b512-k0", "bf16p-exact",
               "bf16p-exact-fp32", "bf16p-8bit"]
MASTER_PAIRS = (("bf16p-exact", "bf16p-master-dynamic8-b512-k0"), ("bf16p-exact-fp32", "bf16p-master"))
MASTER_TASKS = ("char_gpt", "digits", "zipf", "digits_ft")

QUICK_GRID = ["fp32", "int8-b2048-k2", "int8-b2048-k0", "dynamic8-b2048-k2", "fp8_e4m3-b2048-k2", "bf16",
              "bnb-AdamW8bit", "ao-AdamW8bit"]


# one run -------------------------------------------------------------------------------------------
_tasks: dict[tuple[str, float], Task] = {}


def scale_steps(task: Task, step_scale: float) -> Task:
    """``task`` with its steps, warmup and evaluation cadence multiplied by ``step_scale`` (in place)."""
    if step_scale != 1.0:
        h = task.hyper
        task.hyper = replace(h, steps=max(10, int(h.steps * step_scale)), warmup=max(1, int(h.warmup * step_scale)),
                             eval_every=max(1, int(h.eval_every * step_scale)))
    return task


def _task(name: str, step_scale: float) -> Task:
    key = (name, step_scale)
    if key not in _tasks:
        _tasks[key] = scale_steps(TASKS[name](), step_scale)
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


def run_one(job: tuple[str, str, int, float, int, bool]) -> dict:
    """Train one (task, optimizer, seed); returns the JSON record of the run."""
    task_name, variant, seed, step_scale, threads, compile_peers = job
    torch.set_num_threads(threads)
    task = _task(task_name, step_scale)
    base, rounding = split_name(variant)
    spec = OptimizerSpec(base, compile_peers)
    make = make_optimizer(variant, compile_peers=compile_peers, seed=seed) if rounding else spec.build
    built: list[torch.optim.Optimizer] = []

    def build(params, hyper):
        built.append(make(params, hyper))
        return built[-1]

    hist = train(task, build, seed, param_dtype=spec.param_dtype)
    n_params = sum(p.numel() for g in built[0].param_groups for p in g["params"])
    return {
        "task": task_name, "variant": variant, "seed": seed, "steps": task.hyper.steps,
        "train_loss": hist.train_loss, "val_steps": hist.val_steps, "val": hist.val,
        "seconds": hist.seconds, "state_bytes_per_param": state_bytes(built[0]) / n_params,
    }


def _order(variant: str) -> tuple:
    """Grid order; a rounding-suffixed name (``sqrt8-b512-k0+nearest``) right after its plain one."""
    grid = full_grid()
    base, rounding = split_name(variant)
    return (grid.index(base) if base in grid else len(grid), rounding, variant)


def markdown(summary: dict, tasks: dict[str, Task]) -> str:
    lines = []
    for task, rows in summary.items():
        hyper = tasks[task].hyper
        n_params = sum(p.numel() for p in tasks[task].model(0).parameters())
        any_row = next(iter(rows.values()))
        lines += [f"### {task}: {n_params:,} params, {hyper.steps} steps, lr {hyper.lr}, weight decay "
                  f"{hyper.weight_decay}, seeds {any_row['seeds']}; fp32 seed spread "
                  f"±{any_row['fp32_noise_pct']:.2f}%", ""]
        metric = tasks[task].metric  # a task may report more (the diffusion task: a loss per noise band)
        head = "| optimizer | state B/param | val loss | gap to fp32 | ≈ fp32 |"
        sep = "|---|---:|---:|---:|:-:|"
        if metric:
            head += f" val {metric} |"
            sep += "---:|"
        lines += [head + " s/run |", sep + "---:|"]
        for variant in sorted(rows, key=_order):
            e = rows[variant]
            gap, gap_std = e["paired_gap_pct"]
            row = (f"| {variant} | {e['state_bytes_per_param']:.3f} | {e['loss_mean']:.4f} ± {e['loss_std']:.4f} "
                   f"| {gap:+.2f} ± {gap_std:.2f}% | {'yes' if e['matches_fp32'] else '**no**'} |")
            if metric:
                row += f" {e[metric + '_mean'] * 100:.2f} ± {e[metric + '_std'] * 100:.2f}% |"
            lines.append(row + f" {e['seconds']:.0f} |")
        lines.append("")
    lines.append("Gap to fp32: mean ± std over seeds of the paired gap (loss / fp32 loss of the same seed - 1). "
                 "≈ fp32: that mean is within the fp32 seed spread and within 0.5%. State B/param: bytes of "
                 "all optimizer state over all parameters (small tensors keep fp32 states in every 8-bit "
                 "optimizer).")
    return "\n".join(lines)


def master_report(runs: list[dict]) -> str:
    """For each (ours, recipe) pair of MASTER_PAIRS, the (task, seed) runs in which every training
    loss and every validation number are the same float: ours with master weights steps the bf16
    params exactly as an fp32 master copy does. Empty when the runs hold no pair."""
    by_key = {(r["task"], r["variant"], r["seed"]): r for r in runs}
    lines = []
    for ours, recipe in MASTER_PAIRS:
        keys = sorted((t, s) for t, v, s in by_key if v == ours and (t, recipe, s) in by_key)
        if not keys:
            continue
        same = [(t, s) for t, s in keys if by_key[(t, ours, s)]["train_loss"] == by_key[(t, recipe, s)]["train_loss"]
                and by_key[(t, ours, s)]["val"] == by_key[(t, recipe, s)]["val"]]
        differ = sorted(set(keys) - set(same))
        lines.append(f"- {ours} vs {recipe}: identical in {len(same)} of {len(keys)} (task, seed) runs"
                     + (f"; differ: {differ}" if differ else " (every loss of every step, every evaluation)"))
    return ("\n\nBit for bit against the fp32 master recipe:\n" + "\n".join(lines)) if lines else ""


def plot(runs: list[dict], summary: dict, task: str, path: Path) -> None:
    """fp32's validation loss; every optimizer's gap to fp32 along training (mean over seeds of the
    paired gap) in four panels; the final gaps with their seed spread."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves: dict[str, dict[int, list[float]]] = {}
    steps: dict[str, list[int]] = {}
    for r in runs:
        if r["task"] == task:
            curves.setdefault(r["variant"], {})[r["seed"]] = [v["loss"] for v in r["val"]]
            steps[r["variant"]] = r["val_steps"]
    if "fp32" not in curves:
        return
    base = curves["fp32"]

    def gap_curve(variant: str) -> list[float]:
        seeds = [s for s in curves[variant] if s in base]
        return [statistics.fmean((curves[variant][s][i] / base[s][i] - 1) * 100 for s in seeds)
                for i in range(len(steps[variant]))]

    spread = [statistics.stdev(c[i] for c in base.values()) / statistics.fmean(c[i] for c in base.values()) * 100
              if len(base) > 1 else 0.0 for i in range(len(steps["fp32"]))]
    panels = [("ours, block 2048, 2 patches; bf16", lambda v: v.endswith("-b2048-k2") or v == "bf16"),
              ("ours, block 2048, no patches", lambda v: v.endswith("-b2048-k0")),
              ("ours, block 1024 and 512 (dashed), no patches", lambda v: v.endswith(("-b1024-k0", "-b512-k0"))),
              ("ours, block 256, no patches (the peers' layout)", lambda v: v.endswith("-b256-k0")),
              ("bitsandbytes and torchao", lambda v: v in PEERS),
              ("4 bits: ours (blocks of 128), torchao AdamW4bit", lambda v: v in (*FOUR_BIT, "ao-AdamW4bit")),
              ("bf16 params: stock AdamW, the fp32 master recipe, master weights", lambda v: v.startswith("bf16p-"))]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]

    def color(variant: str) -> str:
        fmt = variant.split("-")[0]
        order = [*FORMATS, *FOUR_BIT, "bf16", *PEERS, *MASTER_GRID]
        return colors[order.index(fmt if fmt in order else variant) % len(colors)]

    fig, axes = plt.subplots(2, 4, figsize=(21, 8.5))
    ax = axes[0][0]
    for seed, curve in sorted(base.items()):
        ax.plot(steps["fp32"], curve, color="black", lw=0.8, alpha=0.6, label=f"fp32 AdamW, seed {seed}")
    ax.set(title=f"{task}: validation loss of fp32 AdamW", xlabel="step", ylabel="val loss")
    ax.legend(fontsize=7)
    panels = [(title, pick) for title, pick in panels if any(pick(v) for v in curves)]  # a task's grid
    slots = [axes[0][1], axes[0][2], axes[0][3], axes[1][0], axes[1][1], axes[1][2]]
    for ax in slots[len(panels):]:
        ax.remove()
    for ax, (title, pick) in zip(slots, panels):
        gaps = {v: gap_curve(v) for v in sorted((v for v in curves if pick(split_name(v)[0])), key=_order)}
        ax.fill_between(steps["fp32"], [-s for s in spread], spread, color="0.88", label="fp32 seed std")
        ax.axhline(0, color="black", lw=0.8)
        for variant, gap in gaps.items():
            style = ":" if split_name(variant)[1] else "--" if "-b512-" in variant else "-"
            ax.plot(steps[variant], gap, style, color=color(variant), label=variant)
        # scale to the curves (after the first evaluation, where every run is still near init)
        shown = [g for gap in gaps.values() for g in gap[1:]] or [0.0]
        pad = max(0.1, (max(shown) - min(shown)) * 0.15)
        ax.set_ylim(min(min(shown), 0) - pad, max(max(shown), 0) + pad)
        ax.set(title=title, xlabel="step", ylabel="val loss gap to fp32 (%)")
        ax.legend(fontsize=7)
    ax = axes[1][3]
    rows = sorted((v for v in summary[task] if v != "fp32"), key=_order)
    means = [summary[task][v]["paired_gap_pct"][0] for v in rows]
    errs = [summary[task][v]["paired_gap_pct"][1] for v in rows]
    ax.barh(range(len(rows)), means, xerr=errs, color=[color(v) for v in rows], alpha=0.8)
    ax.axvspan(-spread[-1], spread[-1], color="0.88", zorder=0)
    ax.axvline(0, color="black", lw=0.8)
    ax.set_yticks(range(len(rows)), rows, fontsize=7)
    ax.invert_yaxis()
    ax.set(title="final val loss gap to fp32 (mean and std over seeds)", xlabel="%")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# driver --------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1/5 of the steps, 2 seeds, a few optimizers")
    ap.add_argument("--tasks", nargs="+", default=[t for t in TASKS if t not in OWN_BENCH], choices=list(TASKS),
                    help="default: all but the diffusion task (bench/diffusion.py runs its grid)")
    ap.add_argument("--variants", nargs="+", help="optimizer names or globs (default: the full grid)")
    ap.add_argument("--seeds", nargs="+", type=int)
    ap.add_argument("--step-scale", type=float, help="multiply every task's steps (and warmup, eval cadence)")
    ap.add_argument("--jobs", type=int, default=2, help="runs in parallel, one process each")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--resume", action="store_true", help="reuse runs already in OUT/quality.json")
    ap.add_argument("--report", action="store_true", help="only rebuild the tables and plots from OUT's JSON")
    ap.add_argument("--master", action="store_true",
                    help="the master-weights grid (bf16 params) on MASTER_TASKS, into OUT/quality_master.*")
    ap.add_argument("--compile-peers", action="store_true",
                    help="let torchao torch.compile its step (minutes of compiling per shape on a small CPU)")
    args = ap.parse_args(argv)


    if args.master and args.tasks == list(TASKS):
        args.tasks = list(MASTER_TASKS)

    def variants(task: str) -> list[str]:
        if args.master and not args.variants:
            return MASTER_GRID
        if args.variants:
            return [v for v in dict.fromkeys(full_grid() + args.variants)
                    if any(fnmatch.fnmatchcase(v, pat) for pat in args.variants)]
        return QUICK_GRID if args.quick else full_grid(task)

    for task in args.tasks:
        for v in variants(task):  # a bad name fails now, not an hour in
            check_name(v)
            if OptimizerSpec(split_name(v)[0]).kind == "bf16 params":
                OptimizerSpec(v).lowbit_options()
    seeds = args.seeds or (SEEDS[:2] if args.quick else SEEDS)
    scale = args.step_scale or (0.2 if args.quick else 1.0)
    name = ("quality_master" if args.master else "quality") + ("_quick" if args.quick else "")
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / f"{name}.json"

    runs: list[dict] = []
    if args.report:
        runs, meta = load_runs(json_path)
        report(runs, meta, args.out, name)
        return
    if args.resume and json_path.exists():
        runs = [r for r in load_runs(json_path)[0] if r.get("step_scale", 1.0) == scale]
    done = {(r["task"], r["variant"], r["seed"]) for r in runs}
    jobs = [(t, v, s, scale, args.threads, args.compile_peers) for t in args.tasks for v in variants(t) for s in seeds
            if (t, v, s) not in done]
    # the most expensive task first, so the parallel tail is short
    jobs.sort(key=lambda j: -1 if j[0].startswith("char_gpt") else list(TASKS).index(j[0]))
    meta = run_meta(args.jobs, args.threads, args.compile_peers)

    def save() -> None:
        json_path.write_text(json.dumps({"meta": meta, "summary": summarize(runs), "runs": runs}))

    run_pool(run_one, jobs, args.jobs, runs, meta, save, step_scale=scale)
    report(runs, meta, args.out, name)


def report(runs: list[dict], meta: dict, out: Path, name: str) -> None:
    """Write ``name.md`` and one ``name_<task>.png`` per task from the runs; print the tables."""
    summary = summarize(runs)
    tasks = {t: _task(t, runs[[r["task"] for r in runs].index(t)].get("step_scale", 1.0)) for t in summary}
    text = markdown(summary, tasks) + master_report(runs)
    head = results_header(meta, runs)
    (out / f"{name}.md").write_text(head + text + "\n")
    for task in summary:
        plot(runs, summary, task, out / f"{name}_{task}.png")
    print(head + text)


if __name__ == "__main__":
    main()
