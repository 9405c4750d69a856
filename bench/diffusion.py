"""Diffusion quality: the DiT of ``bench/tasks.py`` (``dit_digits``: DDPM on sklearn's 8x8 digits, one
noise level per step, as in batch-size-1 fine-tuning) trained with stock fp32 AdamW, each of our state
formats at the default layout, and bitsandbytes' and torchao's 8-bit AdamW, over several seeds with
the same weights and batches per seed (paired, as in ``bench/quality.py``).

    python bench/diffusion.py                # 9 optimizers x 3 seeds, and the gradient-range runs
    python bench/diffusion.py --quick        # a smoke run of a few minutes
    python bench/diffusion.py --report       # only rebuild the tables and plots from the JSON

Reports per optimizer the final validation denoising loss (averaged over timesteps, and per noise
band), the steps it needs to reach the loss fp32 reaches at mid-run, and the accuracy of a digits
classifier on its class-conditional samples; and, for the fp32 runs, each quantized state's gradient
RMS per step and at fixed weights across timesteps (the property the reports of INT8 states stalling
diffusion training blame), next to the same per-step record of two non-diffusion tasks. Writes
``bench/results/diffusion.{json,md}``, ``diffusion.png`` (curves, gaps, gradient ranges) and
``diffusion_samples.png`` (seed 0's samples, one grid per optimizer).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: find bench/

import torch
from torch import nn

from bench.quality import scale_steps, state_bytes
from bench.rounding import check_name, make_optimizer
from bench.runs import load_runs, mean_std, results_header, run_meta, run_pool, summarize
from bench.tasks import TASKS, DiffusionDigits, Task, train

RESULTS = Path(__file__).resolve().parent / "results"
TASK = "dit_digits"
GRID = ["fp32", "int8", "sqrt8", "dynamic8", "fp8_e4m3", "fp8_e5m2", "bf16", "bnb-AdamW8bit", "ao-AdamW8bit",
        "ao-AdamWFp8"]
QUICK_GRID = ["fp32", "int8", "sqrt8", "dynamic8", "fp8_e4m3", "bnb-AdamW8bit"]
SEEDS = (0, 1, 2)
BANDS = tuple(DiffusionDigits.BANDS)
MIN_QUANTIZED = 4096  # lowbit_compile's min_8bit_size: the tensors whose states every 8-bit optimizer quantizes
SWEEP_T = (0, 3, 10, 30, 100, 300, 500, 700, 900, 999)  # timesteps of the fixed-weight gradient sweep
SAMPLES_PER_CLASS = 20  # judged by the classifier; the first SHOWN_PER_CLASS of each are kept and drawn
SHOWN_PER_CLASS = 10
# fp32 runs that only record gradients: the diffusion task with DDPM's per-image timesteps, and two
# tasks without timesteps, for scale
GRAD_ONLY = {
    "dit_digits, per-image t": lambda: DiffusionDigits(timesteps_per_batch=16),
    "char_gpt": TASKS["char_gpt"],
    "digits": TASKS["digits"],
}


def make_task(name: str, step_scale: float) -> Task:
    return scale_steps((GRAD_ONLY.get(name) or TASKS[name])(), step_scale)


# gradient records ----------------------------------------------------------------------------------
class TimestepLog:
    """A task whose batches also log their timesteps (``train`` draws the batches itself)."""

    def __init__(self, task: Task) -> None:
        self._task, self.timesteps = task, []

    def __getattr__(self, name: str):
        return getattr(self._task, name)

    def batch(self, gen: torch.Generator):
        b = self._task.batch(gen)
        if isinstance(self._task, DiffusionDigits):
            self.timesteps.append(int(b[2][0]))
        return b


def _rms(t: torch.Tensor) -> float:
    return float(f"{t.double().pow(2).mean().sqrt().item():.4g}")


def timestep_sweep(task: DiffusionDigits, model: nn.Module, names: list[str]) -> dict[str, list[float]]:
    """Gradient RMS of each named parameter at each of ``SWEEP_T``, at the model's current weights, on
    one fixed batch (the same images and noise at every timestep)."""
    gen = torch.Generator().manual_seed(777)
    x0, y, _, noise = task.batch(gen)
    params = dict(model.named_parameters())
    out: dict[str, list[float]] = {n: [] for n in names}
    for t in SWEEP_T:
        model.zero_grad(set_to_none=True)
        task.loss(model, (x0, y, torch.full_like(y, t), noise)).backward()
        for n in names:
            out[n].append(_rms(params[n].grad))
    model.zero_grad(set_to_none=True)
    return out


def decades(xs: list[float]) -> float:
    """log10(max / min) of the positive values."""
    pos = [x for x in xs if x > 0]
    return math.log10(max(pos) / min(pos)) if len(pos) > 1 else 0.0


def swing_decades(xs: list[float], window: int = 51) -> float:
    """How far a per-step series swings from step to step, its trend taken out: the 95th minus the 5th
    percentile of log10(value) less its mean over the ``window`` steps around it; nan for a series
    shorter than the window."""
    logs = torch.tensor(xs, dtype=torch.float64).clamp(min=1e-30).log10()
    if logs.numel() < window:
        return math.nan
    trend = logs.unfold(0, window, 1).mean(dim=1)
    dev = logs[window // 2: window // 2 + trend.numel()] - trend
    return (dev.quantile(0.95) - dev.quantile(0.05)).item()


# samples -------------------------------------------------------------------------------------------
@functools.cache
def digit_classifier() -> tuple[nn.Module, float]:
    """An MLP that tells the digits apart, trained on the diffusion task's training images, that judges
    the samples; and its accuracy on the held-out images."""
    task = DiffusionDigits()
    gen = torch.Generator().manual_seed(99)
    torch.manual_seed(99)
    net = nn.Sequential(nn.Flatten(), nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 10))
    opt = torch.optim.AdamW(net.parameters(), lr=3e-3, weight_decay=0.01)
    for _ in range(800):
        idx = torch.randint(0, len(task.train_y), (128,), generator=gen)
        x = task.train_x[idx] + 0.05 * torch.randn(task.train_x[idx].shape, generator=gen)  # samples are not clean
        loss = nn.functional.cross_entropy(net(x), task.train_y[idx])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        acc = (net(task.val_images).argmax(1) == task.val_labels).float().mean().item()
    return net.eval(), acc


def samples_and_accuracy(task: DiffusionDigits, model: nn.Module, seed: int) -> tuple[torch.Tensor, float]:
    """``SAMPLES_PER_CLASS`` samples of each digit (the same starting noise for every optimizer of a
    seed), and the share the classifier labels as the digit they were conditioned on."""
    labels = torch.arange(10).repeat_interleave(SAMPLES_PER_CLASS)
    images = task.sample(model, labels, torch.Generator().manual_seed(20_000 + seed), steps=25)
    net, _ = digit_classifier()
    with torch.no_grad():
        acc = (net(images).argmax(1) == labels).float().mean().item()
    return images, acc


# one run -------------------------------------------------------------------------------------------
def run_one(job: tuple[str, str, int, float, int, bool]) -> dict:
    """Train one (task, optimizer, seed); fp32 runs also record gradients, diffusion runs sample."""
    task_name, variant, seed, step_scale, threads, compile_peers = job
    torch.set_num_threads(threads)
    task = make_task(task_name, step_scale)
    diffusion = isinstance(task, DiffusionDigits)
    record_grads = variant == "fp32"
    logged = TimestepLog(task)
    names = [n for n, p in task.model(seed).named_parameters() if p.numel() >= MIN_QUANTIZED]
    make = make_optimizer(variant, compile_peers=compile_peers, seed=seed)
    built: list[torch.optim.Optimizer] = []
    params: list[nn.Parameter] = []
    per_step: dict[str, list[float]] = {n: [] for n in names}
    sweeps: dict[int, dict[str, list[float]]] = {}
    steps = task.hyper.steps
    sweep_at = sorted({min(task.hyper.warmup, steps), steps // 4, steps // 2, steps}) if diffusion else []
    scratch = task.model(seed)
    order = [n for n, _ in scratch.named_parameters()]

    def trained_model() -> nn.Module:
        with torch.no_grad():
            for q, p in zip(scratch.parameters(), params):
                q.copy_(p)
        return scratch

    def build(ps, hyper):
        params.extend(ps)
        built.append(make(ps, hyper))
        return built[-1]

    def on_step(step: int, loss: float) -> None:
        if not record_grads:
            return
        by_name = dict(zip(order, params))
        for n in names:
            per_step[n].append(_rms(by_name[n].grad))
        if step + 1 in sweep_at:
            sweeps[step + 1] = timestep_sweep(task, trained_model(), names)

    hist = train(logged, build, seed, on_step=on_step)
    n_params = sum(p.numel() for p in params)
    record = {
        "task": task_name, "variant": variant, "seed": seed, "steps": steps,
        "train_loss": hist.train_loss, "val_steps": hist.val_steps, "val": hist.val,
        "seconds": hist.seconds, "state_bytes_per_param": state_bytes(built[0]) / n_params,
    }
    if record_grads:
        record["grads"] = {"names": names, "per_step": per_step, "timesteps": logged.timesteps,
                           "sweep_t": list(SWEEP_T), "sweeps": {str(k): v for k, v in sweeps.items()}}
    if diffusion:
        images, acc = samples_and_accuracy(task, trained_model(), seed)
        record["sample_acc"] = acc
        shown = images.view(10, SAMPLES_PER_CLASS, 8, 8)[:, :SHOWN_PER_CLASS]
        record["samples"] = ((shown + 1) * 127.5).round().to(torch.uint8).tolist()
    return record


# summary -------------------------------------------------------------------------------------------
def steps_to(val_steps: list[int], losses: list[float], target: float) -> float:
    """The first step at which the validation loss reaches ``target`` (linear between evaluations);
    inf if it never does."""
    prev_s, prev_l = 0, math.inf
    for s, loss in zip(val_steps, losses):
        if loss <= target:
            if math.isinf(prev_l):
                return float(s)
            return prev_s + (s - prev_s) * (prev_l - target) / (prev_l - loss)
        prev_s, prev_l = s, loss
    return math.inf


def summarize_diffusion(runs: list[dict]) -> dict:
    """Per optimizer: ``bench/quality.summarize``'s entry (final loss, paired gap) for the overall loss and
    each band, the sample accuracy, and the steps to fp32's mid-run loss relative to fp32's own."""
    runs = [r for r in runs if r["task"] == TASK]
    if not runs:
        return {}
    overall = summarize(runs)[TASK]
    bands = {b: summarize(runs, key=b)[TASK] for b in BANDS}
    base = {r["seed"]: r for r in runs if r["variant"] == "fp32"}
    out = {}
    for variant, entry in overall.items():
        rs = [r for r in runs if r["variant"] == variant]
        ratios = []
        for r in rs:
            b = base.get(r["seed"])
            if b is None:
                continue
            mid = min(range(len(b["val_steps"])), key=lambda i: abs(b["val_steps"][i] - b["steps"] / 2))
            target = b["val"][mid]["loss"]
            own = steps_to(b["val_steps"], [v["loss"] for v in b["val"]], target)
            ratios.append(steps_to(r["val_steps"], [v["loss"] for v in r["val"]], target) / own)
        out[variant] = {
            **entry,
            "bands": {b: {k: bands[b][variant][k] for k in ("loss_mean", "paired_gap_pct", "matches_fp32")}
                      for b in BANDS},
            "sample_acc": mean_std([r["sample_acc"] for r in rs]),
            "steps_to_fp32_mid_ratio": (math.nan, math.nan) if not ratios else
            (math.inf, math.nan) if not all(map(math.isfinite, ratios)) else mean_std(ratios),
        }
    return out


def grad_summary(runs: list[dict]) -> dict:
    """Per task with recorded gradients: over its quantized tensors, the median and max of the per-step
    gradient RMS's swing after warmup (``swing_decades``) and, for the diffusion task, of the
    fixed-weight sweep's range across timesteps at each checkpoint."""
    out = {}
    for task in sorted({r["task"] for r in runs if "grads" in r}):
        rs = [r for r in runs if r["task"] == task and "grads" in r]
        warm = make_task(task, rs[0].get("step_scale", 1.0)).hyper.warmup
        swings = [x for r in rs for n in r["grads"]["names"]
                  if math.isfinite(x := swing_decades(r["grads"]["per_step"][n][warm:]))]
        entry = {"seeds": sorted(r["seed"] for r in rs), "tensors": len(rs[0]["grads"]["names"]),
                 "per_step_swing_decades": {"median": statistics.median(swings) if swings else math.nan,
                                            "max": max(swings, default=math.nan)}}
        if rs[0]["grads"]["sweeps"]:
            entry["sweep_decades"] = {}
            for step in rs[0]["grads"]["sweeps"]:
                ranges = [(decades(r["grads"]["sweeps"][step][n]), n) for r in rs for n in r["grads"]["names"]]
                top = max(ranges)
                entry["sweep_decades"][step] = {"median": statistics.median(x for x, _ in ranges), "max": top[0],
                                                "max_tensor": top[1]}
            # how the gradient's size depends on the timestep at the end: RMS at each t over the median t's
            last = rs[0]["grads"]["sweeps"][str(max(map(int, rs[0]["grads"]["sweeps"])))]
            entry["end_sweep_rms_median_over_tensors"] = [
                statistics.median(last[n][i] for n in last) for i in range(len(SWEEP_T))]
        out[task] = entry
    return out


# report --------------------------------------------------------------------------------------------
def _gap(g: tuple[float, float]) -> str:
    return f"{g[0]:+.2f} ± {g[1]:.2f}%"


def markdown(summary: dict, grads: dict, meta: dict) -> str:
    lines = []
    if summary:
        task = make_task(TASK, meta.get("step_scale", 1.0))
        h = task.hyper
        n_params = sum(p.numel() for p in task.model(0).parameters())
        fp32 = summary.get("fp32")
        noise = fp32["fp32_noise_pct"] if fp32 else math.nan
        lines += [f"### {TASK}: {n_params:,} params, {h.steps} steps of {task.batch_size} images at "
                  f"{task.timesteps_per_batch} timestep(s) each, lr {h.lr}, weight decay {h.weight_decay}, "
                  f"seeds {fp32['seeds'] if fp32 else '?'}; fp32 seed spread ±{noise:.2f}%", "",
                  "| optimizer | state B/param | val loss | gap to fp32 | ≈ fp32 | gap, low noise | gap, mid | "
                  "gap, high noise | steps to fp32's mid-run loss (× fp32) | sample accuracy | s/run |",
                  "|---|---:|---:|---:|:-:|---:|---:|---:|---:|---:|---:|"]
        for variant in sorted(summary, key=lambda v: GRID.index(v) if v in GRID else len(GRID)):
            e = summary[variant]
            ratio = e["steps_to_fp32_mid_ratio"]
            ratio_s = "not reached" if math.isinf(ratio[0]) else f"{ratio[0]:.2f} ± {ratio[1]:.2f}"
            bands = " | ".join(_gap(e["bands"][b]["paired_gap_pct"]) + ("" if e["bands"][b]["matches_fp32"] else " ✗")
                               for b in BANDS)
            lines.append(f"| {variant} | {e['state_bytes_per_param']:.3f} | {e['loss_mean']:.4f} ± {e['loss_std']:.4f} "
                         f"| {_gap(e['paired_gap_pct'])} | {'yes' if e['matches_fp32'] else '**no**'} | {bands} "
                         f"| {ratio_s} | {e['sample_acc'][0] * 100:.1f} ± {e['sample_acc'][1] * 100:.1f}% "
                         f"| {e['seconds']:.0f} |")
        lines += ["", "Gaps: mean ± std over seeds of the paired gap of the final validation denoising loss "
                  "(loss / fp32 loss of the same seed - 1), overall and per third of the timesteps; ≈ fp32 and ✗ "
                  "as in `quality.md` (within the fp32 seed spread and 0.5%). Steps to fp32's mid-run loss: the "
                  "step at which the run's validation loss first reaches the loss its fp32 twin has at mid-run "
                  "(linear between evaluations), over fp32's own. Sample accuracy: a digits MLP "
                  f"({meta.get('classifier_acc', math.nan) * 100:.1f}% on held-out images) on "
                  f"{SAMPLES_PER_CLASS * 10} class-conditional samples (25 DDIM steps).", ""]
    if grads:
        lines += ["### Gradient range (fp32 runs)", "",
                  "| task | seeds | quantized tensors | step-to-step swing of the RMS (decades): median / max "
                  "| across timesteps at fixed weights (decades): median / max, per checkpoint step |",
                  "|---|---|---:|---:|---|"]
        for task, g in grads.items():
            sweep = "; ".join(f"step {s}: {v['median']:.2f} / {v['max']:.2f} ({v['max_tensor']})"
                              for s, v in g.get("sweep_decades", {}).items()) or "–"
            p = g["per_step_swing_decades"]
            swing = f"{p['median']:.2f} / {p['max']:.2f}" if math.isfinite(p["max"]) else "– (run under 51 steps)"
            lines.append(f"| {task} | {g['seeds']} | {g['tensors']} | {swing} | {sweep} |")
        end = next((g["end_sweep_rms_median_over_tensors"] for g in grads.values()
                    if "end_sweep_rms_median_over_tensors" in g), None)
        lines += ["", "Step-to-step swing: log10 of the 95th over the 5th percentile, over the steps after warmup, "
                  "of each quantized tensor's gradient RMS over its running geometric mean (51 steps): what the "
                  "optimizer's states see beyond the trend. Across timesteps: log10 of the "
                  "largest over the smallest gradient RMS of a tensor over the timesteps "
                  f"{list(SWEEP_T)} on one fixed batch, at the fp32 run's weights of that step."]
        if end:
            lines += ["", "Median gradient RMS at the end of training, by timestep: " + ", ".join(
                f"t={t}: {v:.3g}" for t, v in zip(SWEEP_T, end))]
    return "\n".join(lines)


def plot(runs: list[dict], summary: dict, path: Path) -> None:
    """fp32's validation losses; every optimizer's gap to fp32 along training; the final gaps per band;
    gradient RMS across timesteps (fixed weights) and along training (the steps the optimizer saw)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dit = [r for r in runs if r["task"] == TASK]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    extra = sorted({r["variant"] for r in dit} - set(GRID))  # e.g. the rounding prototypes
    color = {v: colors[i % len(colors)] for i, v in enumerate(GRID + extra)}
    fig, axes = plt.subplots(2, 3, figsize=(19, 10))
    base = {r["seed"]: r for r in dit if r["variant"] == "fp32"}
    ax = axes[0][0]
    for seed, r in sorted(base.items()):
        for key, style in zip(("loss", *BANDS), ("-", ":", "--", "-.")):
            ax.plot(r["val_steps"], [v[key] for v in r["val"]], style, color=colors[seed % len(colors)], lw=1,
                    label=f"seed {seed}: {key}" if seed == min(base) or key == "loss" else None)
    ax.set(title=f"{TASK}: fp32 AdamW validation denoising loss", xlabel="step", ylabel="MSE of the noise",
           yscale="log")
    ax.legend(fontsize=7)
    ax = axes[0][1]
    for variant in [v for v in GRID + extra if v != "fp32"]:
        rs = [r for r in dit if r["variant"] == variant and r["seed"] in base]
        if not rs:
            continue
        gap = [statistics.fmean((r["val"][i]["loss"] / base[r["seed"]]["val"][i]["loss"] - 1) * 100 for r in rs)
               for i in range(len(rs[0]["val_steps"]))]
        ax.plot(rs[0]["val_steps"], gap, ":" if "+" in variant else "-", color=color[variant], label=variant)
    ax.axhline(0, color="black", lw=0.8)
    ax.set(title="validation loss gap to fp32 along training (mean over seeds)", xlabel="step", ylabel="%")
    ax.legend(fontsize=7)
    ax = axes[0][2]
    rows = [v for v in GRID + extra if v in summary and v != "fp32"]
    width = 0.2
    for j, key in enumerate(("loss", *BANDS)):
        vals = [summary[v]["paired_gap_pct"] if key == "loss" else summary[v]["bands"][key]["paired_gap_pct"]
                for v in rows]
        ax.barh([i + (j - 1.5) * width for i in range(len(rows))], [m for m, _ in vals], height=width,
                xerr=[s for _, s in vals], label=key, color=colors[j])
    ax.axvline(0, color="black", lw=0.8)
    ax.set_yticks(range(len(rows)), rows, fontsize=8)
    ax.invert_yaxis()
    ax.set(title="final gap to fp32, overall and per noise band", xlabel="%")
    ax.legend(fontsize=7)
    fp32_0 = next((r for r in dit if r["variant"] == "fp32" and "grads" in r), None)
    ax = axes[1][0]
    if fp32_0 and fp32_0["grads"]["sweeps"]:
        g = fp32_0["grads"]
        last = g["sweeps"][str(max(map(int, g["sweeps"])))]
        for rms in last.values():
            ax.plot([t + 1 for t in g["sweep_t"]], rms, lw=0.8, alpha=0.7)
        ax.set(title=f"gradient RMS by timestep, each quantized tensor (end, seed {fp32_0['seed']})",
               xlabel="timestep + 1", ylabel="gradient RMS", xscale="log", yscale="log")
    ax = axes[1][1]
    if fp32_0:
        g = fp32_0["grads"]
        swing = {n: swing_decades(g["per_step"][n]) for n in g["names"]}
        n = max(g["names"], key=lambda n: swing[n] if math.isfinite(swing[n]) else -1.0)  # swings most
        sc = ax.scatter(range(len(g["per_step"][n])), g["per_step"][n], c=g["timesteps"], s=3, cmap="viridis")
        fig.colorbar(sc, ax=ax, label="timestep of the step's batch")
        ax.set(title=f"gradient RMS of every step: {n}", xlabel="step", ylabel="gradient RMS", yscale="log")
    ax = axes[1][2]
    grads = grad_summary(runs)
    tasks = list(grads)
    ax.bar(range(len(tasks)), [grads[t]["per_step_swing_decades"]["median"] for t in tasks], color=colors[0],
           label="median over tensors")
    ax.scatter(range(len(tasks)), [grads[t]["per_step_swing_decades"]["max"] for t in tasks], color="black",
               zorder=3, label="max over tensors")
    ax.set_xticks(range(len(tasks)), tasks, fontsize=8)
    ax.set(title="step-to-step swing of the gradient RMS (p5..p95 around its running mean)", ylabel="decades")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_samples(runs: list[dict], path: Path, seed: int = 0) -> None:
    """One grid per optimizer of seed ``seed``'s samples: a row per digit, same starting noise in every grid."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_variant = {r["variant"]: r for r in runs if r["task"] == TASK and r["seed"] == seed and "samples" in r}
    variants = [v for v in GRID if v in by_variant] + [v for v in by_variant if v not in GRID]
    if not variants:
        return
    cols, rows = 3, math.ceil(len(variants) / 3)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 4.5 * rows), squeeze=False)
    for ax in axes.flat[len(variants):]:
        ax.remove()
    for ax, variant in zip(axes.flat, variants):
        images = torch.tensor(by_variant[variant]["samples"], dtype=torch.float32)
        grid = images.permute(0, 2, 1, 3).reshape(10 * 8, SHOWN_PER_CLASS * 8)
        ax.imshow(grid, cmap="gray_r", vmin=0, vmax=255)
        ax.set_title(f"{variant}: sample acc {by_variant[variant]['sample_acc'] * 100:.0f}%", fontsize=9)
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(runs: list[dict], meta: dict, out: Path, name: str) -> None:
    summary = summarize_diffusion(runs)
    grads = grad_summary(runs)
    head = results_header(meta, runs)
    text = markdown(summary, grads, meta)
    (out / f"{name}.md").write_text(head + text + "\n")
    plot(runs, summary, out / f"{name}.png")
    plot_samples(runs, out / f"{name}_samples.png")
    print(head + text)


# driver --------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1/10 of the steps, one seed, a few optimizers")
    ap.add_argument("--variants", nargs="+", help="optimizer names (default: the grid)")
    ap.add_argument("--seeds", nargs="+", type=int)
    ap.add_argument("--step-scale", type=float, help="multiply the steps (and warmup, eval cadence); default 1")
    ap.add_argument("--no-grad-only", action="store_true", help="skip the gradient-record runs of other tasks")
    ap.add_argument("--jobs", type=int, default=2, help="runs in parallel, one process each")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--resume", action="store_true", help="reuse runs already in OUT's JSON")
    ap.add_argument("--report", action="store_true", help="only rebuild the tables and plots from OUT's JSON")
    ap.add_argument("--compile-peers", action="store_true", help="let torchao torch.compile its step")
    args = ap.parse_args(argv)

    variants = args.variants or (QUICK_GRID if args.quick else GRID)
    for v in variants:
        check_name(v)  # a bad name fails now, not an hour in
    seeds = args.seeds or (SEEDS[:1] if args.quick else SEEDS)
    scale = args.step_scale or (0.1 if args.quick else 1.0)
    name = "diffusion_quick" if args.quick else "diffusion"
    args.out.mkdir(parents=True, exist_ok=True)
    json_path = args.out / f"{name}.json"
    if args.report:
        report(*load_runs(json_path), args.out, name)
        return
    runs: list[dict] = []
    if args.resume and json_path.exists():
        runs = [r for r in load_runs(json_path)[0] if r.get("step_scale", 1.0) == scale]
    done = {(r["task"], r["variant"], r["seed"]) for r in runs}
    jobs = [(TASK, v, s, scale, args.threads, args.compile_peers) for v in variants for s in seeds]
    if not args.no_grad_only:
        jobs += [(t, "fp32", seeds[0], scale, args.threads, False) for t in GRAD_ONLY]
    jobs = [j for j in jobs if j[:3] not in done]
    meta = run_meta(args.jobs, args.threads, args.compile_peers, step_scale=scale,
                    classifier_acc=digit_classifier()[1])

    def save() -> None:
        json_path.write_text(json.dumps({"meta": meta, "summary": summarize_diffusion(runs),
                                         "grads": grad_summary(runs), "runs": runs}))

    run_pool(run_one, jobs, args.jobs, runs, meta, save, step_scale=scale)
    report(runs, meta, args.out, name)


if __name__ == "__main__":
    main()
