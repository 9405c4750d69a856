"""Long run: drift that 150-300 steps cannot show. The 1.8M-param character GPT of ``bench/tasks.py``
(``char_gpt_2m``) trained for 2,000 steps instead of 250 (same lr, warmup 100, cosine to 10%), or the
0.36M-param ``char_gpt`` for 10,000 steps (``--model small``: 5x the steps, the text read 12 times),
with stock fp32 AdamW, its rerun (``fp32+perturbed``: the noise floor), our default (sqrt8), dynamic8,
INT8, FP8 E4M3 and the peers, over several seeds with the same weights and batches per seed; the paired
gap to fp32 at an eighth, half and all of the run.

    python bench/long_run.py                         # 5 optimizers x 3 seeds: 8-10 minutes a run on one core
    python bench/long_run.py --steps 60 --seeds 0 --out /tmp/long   # a smoke run
    python bench/long_run.py --variants fp32 bnb-AdamW8bit ao-AdamW8bit --seeds 0 1 2 --resume   # torchao: 17 min
    python bench/long_run.py --data docstrings --variants fp32 sqrt8 --out /tmp/fresh   # text read once, not 10x
    python bench/long_run.py --model small --steps 10000 --variants fp32 sqrt8 --out /tmp/small   # 2.5 min a run

Writes ``bench/results/long_run.{json,md,png}``; names of optimizers as in ``bench/rounding.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: find bench/

import torch

from bench.quality import state_bytes
from bench.rounding import check_name, make_optimizer
from bench.runs import load_runs, mean_std, results_header, run_meta, run_pool, summarize
from bench.state_drift import ShadowProbe
from bench.state_drift import plot as plot_drift
from bench.state_drift import summary as drift_summary
from bench.tasks import CharGPT, char_gpt_2m, docstring_text, train

RESULTS = Path(__file__).resolve().parent / "results"
DATA = ("pydoc", "docstrings")
MODELS = ("2m", "small")
GRID = ["fp32", "sqrt8", "dynamic8", "int8", "fp8_e4m3"]
SEEDS = (0, 1, 2)
RERUN = "fp32+perturbed"  # fp32's noise floor (bench/rounding.py)


def task_name(data: str = "pydoc", model: str = "2m") -> str:
    return f"char_gpt_{model}{'_fresh' if data == 'docstrings' else ''}_long"


def checkpoints(steps: int) -> tuple[int, ...]:
    """Where the table reads the gaps: an eighth, half and all of the run (250, 1,000, 2,000 of 2,000)."""
    return tuple(sorted({max(steps // 8, 1), max(steps // 2, 1), steps}))


def train_window(steps: int) -> int:
    """The last steps whose training loss the train gap averages: 100 of 2,000, a twentieth of longer runs."""
    return max(100, steps // 20)


def long_task(steps: int, data: str = "pydoc", model: str = "2m") -> CharGPT:
    """The ``model`` for ``steps`` steps on ``data``: the pydoc topics (418k training characters, each read
    about 10 times in 2,000 steps of ``2m``, 12 times in 10,000 of ``small``) or ``docstrings``
    (``tasks.docstring_text``: 6.1M, about once in 2,000 steps of ``2m``). ``2m`` is ``char_gpt_2m``
    (4 layers of width 192, 16 x 128 characters a step); ``small`` is ``char_gpt`` (3 layers of width 96,
    8 x 64 characters a step) at the same lr, weight decay and clipping."""
    text = docstring_text() if data == "docstrings" else None
    task = char_gpt_2m(text) if model == "2m" else CharGPT(text=text, val_windows=256)
    task.name = task_name(data, model)
    task.hyper = replace(task.hyper, steps=steps, warmup=min(100, steps // 10),
                         eval_every=max(125, steps // 16) if steps >= 500 else 10)
    return task


def run_one(job: tuple[str, int, int, int, bool, str, str]) -> dict:
    variant, seed, steps, threads, diagnose, data, model = job
    torch.set_num_threads(threads)
    task = long_task(steps, data, model)
    make = make_optimizer(variant, seed=seed)
    built: list[torch.optim.Optimizer] = []
    probes: list[ShadowProbe] = []

    def build(params, hyper):
        built.append(make(params, hyper))
        if diagnose:
            probes.append(ShadowProbe(built[-1], every=hyper.eval_every))
        return built[-1]

    hist = train(task, build, seed, on_step=(lambda step, loss: probes[0].after_step()) if diagnose else None)
    n_params = sum(p.numel() for g in built[0].param_groups for p in g["params"])
    return {"task": task.name, "variant": variant, "seed": seed, "steps": steps, "train_loss": hist.train_loss,
            "batch": [task.batch_size, task.ctx],
            "val_steps": hist.val_steps, "val": hist.val, "seconds": hist.seconds,
            "params": n_params, "state_bytes_per_param": state_bytes(built[0]) / n_params,
            **({"drift": probes[0].records} if diagnose else {})}


def summary_at(runs: list[dict], step: int) -> dict:
    """``bench/quality.summarize`` of the runs' validation loss at ``step`` (the runs cut there)."""
    cut = [{**r, "val": r["val"][: r["val_steps"].index(step) + 1]} for r in runs if step in r["val_steps"]]
    return summarize(cut)[runs[0]["task"]] if cut else {}


def paired_gaps(runs: list[dict], variant: str, loss: Callable[[dict], float]) -> list[float]:
    """Per seed, the gap (%) of ``loss(run)`` to that of the fp32 run of the same seed; seeds without
    an fp32 run, or runs ``loss`` has no value for (None), are left out."""
    base = {r["seed"]: r for r in runs if r["variant"] == "fp32"}
    pairs = [(loss(r), loss(base[r["seed"]])) for r in runs if r["variant"] == variant and r["seed"] in base]
    return [(a / b - 1) * 100 for a, b in pairs if a is not None and b is not None]


def train_gaps(runs: list[dict], variant: str) -> list[float]:
    """Per seed, the paired gap (%) of the mean training loss over the run's last ``train_window`` steps
    (the same batches in both runs of a seed)."""
    return paired_gaps(runs, variant, lambda r: statistics.fmean(r["train_loss"][-train_window(r["steps"]):]))


def val_gaps(runs: list[dict], variant: str, step: int) -> list[float]:
    """Per seed, the paired gap (%) of the validation loss at ``step``."""
    return paired_gaps(runs, variant, lambda r: r["val"][r["val_steps"].index(step)]["loss"]
                       if step in r["val_steps"] else None)


def beyond(gaps: list[float], rerun_gaps: list[float]) -> tuple[float, float] | None:
    """The mean of ``gaps`` minus that of fp32's reruns, and the standard error of the difference
    (Welch); None without two of each."""
    if min(len(gaps), len(rerun_gaps)) < 2:
        return None
    (m_v, s_v), (m_r, s_r) = mean_std(gaps), mean_std(rerun_gaps)
    return m_v - m_r, (s_v**2 / len(gaps) + s_r**2 / len(rerun_gaps)) ** 0.5


def _pm(value: tuple[float, float] | None) -> str:
    return "–" if value is None else f"{value[0]:+.2f} ± {value[1]:.2f}%"


def _order(variant: str) -> tuple:
    return (GRID.index(variant) if variant in GRID else len(GRID), variant)


def markdown(runs: list[dict]) -> str:
    steps = max(r["steps"] for r in runs)
    marks = [c for c in checkpoints(steps) if any(c in r["val_steps"] for r in runs)] or [steps]
    at = {c: summary_at(runs, c) for c in marks}
    last = at[marks[-1]]
    fp32 = last.get("fp32", {})
    seeds_all = fp32.get("seeds") or sorted({r["seed"] for r in runs})  # a run without fp32: every seed run
    task = runs[0]["task"]
    # runs saved before params were recorded are char_gpt_2m's
    n_params = runs[0].get("params") or sum(p.numel() for p in long_task(steps).model(0).parameters())
    rows, chars = runs[0].get("batch", (16, 128))
    header = (f"| optimizer | state B/param | {' | '.join(f'gap to fp32 at {c}' for c in marks)} "
              f"| train gap, last {train_window(steps)} steps | val loss at {marks[-1]} | ≈ fp32 at {marks[-1]} "
              f"| beyond fp32's reruns: val at {marks[-1]} / train | s/run |")
    lines = [f"### {task}: {n_params:,} params, {steps} steps of {rows} x {chars} characters, "
             f"seeds {seeds_all}", "", header, "|---|---:|" + "---:|" * len(marks) + "---:|---:|:-:|---:|---:|"]
    rerun_val, rerun_train = val_gaps(runs, RERUN, marks[-1]), train_gaps(runs, RERUN)
    for variant in sorted(last, key=_order):
        e = last[variant]
        gaps = " | ".join(_pm(at[c][variant]["paired_gap_pct"]) if variant in at[c] else "–" for c in marks)
        tg = train_gaps(runs, variant)
        versus = [] if variant in ("fp32", RERUN) else [beyond(val_gaps(runs, variant, marks[-1]), rerun_val),
                                                        beyond(tg, rerun_train)]
        vs_cell = " / ".join(map(_pm, versus)) if any(versus) else "–"
        seeds = "" if e.get("seeds") == seeds_all else f" (seeds {', '.join(map(str, e.get('seeds', [])))})"
        lines.append(f"| {variant}{seeds} | {e['state_bytes_per_param']:.3f} | {gaps} | "
                     f"{_pm(mean_std(tg)) if tg else '–'} | {e['loss_mean']:.4f} ± {e['loss_std']:.4f} | "
                     f"{'yes' if e['matches_fp32'] else '**no**'} | {vs_cell} | {e['seconds']:.0f} |")
    spread = " | ".join(f"{at[c]['fp32']['fp32_noise_pct']:.2f}%" if "fp32" in at[c] else "–" for c in marks)
    lines += [f"| (fp32 seed spread) | | {spread} | | | | | |", "",
              "Gap: mean ± std over seeds of the paired gap of the validation loss (loss / fp32 loss of the same "
              f"seed - 1) at that step of the {steps:,}-step schedule; the train gap is that of the mean training "
              f"loss over the last {train_window(steps)} steps (the same batches); ≈ fp32 as in `quality.md`. "
              "`fp32+perturbed` is stock AdamW with beta2 one float32 step larger: its gaps are what a rerun of "
              "fp32 itself shows, the noise floor of every paired gap. Beyond fp32's reruns: the mean gap minus "
              "fp32+perturbed's, ± the standard error of that difference (Welch), for the validation loss and the "
              "training loss."]
    diagnosed = [r for r in runs if r.get("drift") and r["variant"] != "fp32"]
    for r in sorted(diagnosed, key=lambda r: (_order(r["variant"]), r["seed"])):
        lines += ["", f"#### {r['variant']}, seed {r['seed']}: stored moments against fp32 moments of the same "
                  "gradients (bench/state_drift.py)", "", *drift_summary(r["drift"])]
    return "\n".join(lines)


def plot(runs: list[dict], path: Path) -> None:
    """Validation loss per optimizer; its paired gap to fp32 along training; the paired gap of the
    training loss, averaged over windows of 100 steps (a fortieth of longer runs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    variants = sorted({r["variant"] for r in runs}, key=_order)
    base = {r["seed"]: r for r in runs if r["variant"] == "fp32"}
    run_steps = max(r["steps"] for r in runs)
    window = max(100, run_steps // 40)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig, axes = plt.subplots(1, 3, figsize=(19, 5.5))
    for i, variant in enumerate(variants):
        rs = [r for r in runs if r["variant"] == variant]
        steps = rs[0]["val_steps"]
        mean = [statistics.fmean(r["val"][j]["loss"] for r in rs) for j in range(len(steps))]
        style = dict(color="black" if variant == "fp32" else colors[i % len(colors)], label=variant,
                     ls=":" if "+" in variant else "-")
        axes[0].plot(steps, mean, **style)
        paired = [r for r in rs if r["seed"] in base]
        if variant == "fp32" or not paired:
            continue
        gap = [statistics.fmean((r["val"][j]["loss"] / base[r["seed"]]["val"][j]["loss"] - 1) * 100 for r in paired)
               for j in range(len(steps))]
        axes[1].plot(steps, gap, **style)
        train_gap = [statistics.fmean((statistics.fmean(r["train_loss"][k:k + window])
                                       / statistics.fmean(base[r["seed"]]["train_loss"][k:k + window]) - 1) * 100
                                      for r in paired) for k in range(0, len(rs[0]["train_loss"]) - window + 1, window)]
        axes[2].plot([k + window for k in range(0, len(rs[0]["train_loss"]) - window + 1, window)], train_gap, **style)
    if len(base) > 1:
        steps = next(iter(base.values()))["val_steps"]
        spread = [statistics.stdev(r["val"][j]["loss"] for r in base.values())
                  / statistics.fmean(r["val"][j]["loss"] for r in base.values()) * 100 for j in range(len(steps))]
        axes[1].fill_between(steps, [-s for s in spread], spread, color="0.88", label="fp32 seed std")
    axes[0].set(title=f"{runs[0]['task']}: validation loss (mean over seeds)", xlabel="step", ylabel="val loss",
                yscale="log")
    axes[1].set(title="validation loss gap to fp32 (paired, mean over seeds)", xlabel="step", ylabel="%")
    axes[2].set(title=f"training loss gap to fp32 (paired, {window}-step windows)", xlabel="step", ylabel="%")
    for ax in axes[1:]:
        ax.axhline(0, color="black", lw=0.8)
        for c in checkpoints(run_steps):
            ax.axvline(c, color="0.6", lw=0.6, ls="--")
    for ax in axes:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", nargs="+", default=GRID)
    ap.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--jobs", type=int, default=2, help="runs in parallel, one process each")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--resume", action="store_true", help="reuse runs already in OUT/long_run.json")
    ap.add_argument("--report", action="store_true", help="only rebuild the table and plot from the JSON")
    ap.add_argument("--data", choices=DATA, default="pydoc",
                    help="the training text: pydoc (read ~10 times in 2,000 steps) or docstrings (~once)")
    ap.add_argument("--model", choices=MODELS, default="2m",
                    help="2m: char_gpt_2m (1.8M params); small: char_gpt (0.36M params, for 10,000 steps)")
    ap.add_argument("--diagnose", action="store_true",
                    help="also record how far the stored moments drift from fp32 ones (bench/state_drift.py)")
    args = ap.parse_args(argv)
    json_path = args.out / "long_run.json"
    runs: list[dict] = []
    meta = run_meta(args.jobs, args.threads, False)
    if (args.resume or args.report) and json_path.exists():
        runs, saved_meta = load_runs(json_path)
        kept = [r for r in runs if r["steps"] == args.steps and r["task"] == task_name(args.data, args.model)]
        if args.report and not kept:
            found = sorted({(r["task"], r["steps"]) for r in runs})
            ap.error(f"{json_path} has no run of {task_name(args.data, args.model)} for {args.steps} steps (runs "
                     f"there: {found}); pass the --steps, --data and --model they were run with")
        runs, meta = kept, saved_meta if args.report else meta
    if not args.report:
        for v in args.variants:
            check_name(v)
        done = {(r["variant"], r["seed"]) for r in runs}
        jobs = [(v, s, args.steps, args.threads, args.diagnose, args.data, args.model)
                for s in args.seeds for v in args.variants if (v, s) not in done]
        args.out.mkdir(parents=True, exist_ok=True)

        def save() -> None:
            json_path.write_text(json.dumps({"meta": meta, "runs": runs}))

        run_pool(run_one, jobs, args.jobs, runs, meta, save)
    text = results_header(meta, runs) + markdown(runs)
    (args.out / "long_run.md").write_text(text + "\n")
    plot(runs, args.out / "long_run.png")
    if any(r.get("drift") for r in runs):
        plot_drift(runs, args.out / "long_run_drift.png")
    print(text)


if __name__ == "__main__":
    main()
