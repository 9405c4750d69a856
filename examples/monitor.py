"""``lowbit_compile.monitor`` over a whole run: the Zipf embedding task of ``bench/tasks.py`` trained with
the default layout and with linear int8 in blocks of 2048, sampled every 10 steps; the figures go to
a plain callable (a TensorBoard ``SummaryWriter`` or ``wandb.log`` would do the same) and a PNG.

Linear int8 flushes the small first moments of the rarely used embedding rows to 0 and the monitor
warns, naming ``emb.weight`` and the fix; the default layout stays quiet.

    python examples/monitor.py            # writes bench/results/monitor_zipf.png
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: find bench/

import torch

import lowbit_compile
from bench.tasks import OptimizerSpec, ZipfEmbedding, train
from lowbit_compile.health import AVERAGE_WEIGHT, MAX_ZERO_FLUSH, Alert

PNG = Path(__file__).resolve().parents[1] / "bench" / "results" / "monitor_zipf.png"
LAYOUTS = {"sqrt8 (default)": "sqrt8", "int8, blocks of 2048": "int8-b2048-k0"}


def monitored_run(spec: str, every: int) -> tuple[list[int], dict[str, list[float]], list[Alert]]:
    """Train the Zipf task with ``spec``; the monitor's figures by step, and its alerts."""
    task = ZipfEmbedding()
    names = [name for name, _ in task.model(0).named_parameters()]
    steps: list[int] = []
    figures: dict[str, list[float]] = {}
    monitors = []

    def log(metrics: dict[str, float], step: int) -> None:
        steps.append(step)
        for key in ("lowbit/zero_flush/exp_avg", "lowbit/rel_error/exp_avg", "lowbit/rel_error/exp_avg_sq",
                    "lowbit/update_ratio"):
            figures.setdefault(key, []).append(metrics[key])

    def make(params, hyper):
        opt = OptimizerSpec(spec).build(params, hyper)
        monitors.append(lowbit_compile.monitor(opt, every, log=log, model=list(zip(names, params))))
        return opt

    history = train(task, make, seed=0)
    print(f"  {spec}: val loss {history.final['loss']:.4f}, {len(monitors[0].alerts)} alert(s)")
    return steps, figures, monitors[0].alerts


def _average(xs: list[float]) -> list[float]:
    out, value = [], xs[0]
    for x in xs:
        value += AVERAGE_WEIGHT * (x - value)
        out.append(value)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--png", type=Path, default=PNG)
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for label, spec in LAYOUTS.items():
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", lowbit_compile.LowbitHealthWarning)
            steps, figures, alerts = monitored_run(spec, args.every)
        for w in caught:
            print(f"    warning: {w.message}")
        raw = [100 * x for x in figures["lowbit/zero_flush/exp_avg"]]
        line, = axes[0].plot(steps, raw, lw=0.8, alpha=0.5)
        axes[0].plot(steps, _average(raw), color=line.get_color(), lw=2, label=f"{label}, averaged as the monitor does")
        for alert in alerts:
            axes[0].axvline(alert.step, color=line.get_color(), ls=":", lw=1)
        axes[1].plot(steps, figures["lowbit/rel_error/exp_avg"], color=line.get_color(), label=f"{label}: exp_avg")
        axes[1].plot(steps, figures["lowbit/rel_error/exp_avg_sq"], color=line.get_color(), ls="--",
                     label=f"{label}: exp_avg_sq")
        axes[2].plot(steps, figures["lowbit/update_ratio"], color=line.get_color(), label=label)
    axes[0].axhline(100 * MAX_ZERO_FLUSH, color="black", lw=0.8, ls="--", label="warning threshold (average)")
    axes[0].set(title="exp_avg values stored as 0 (worst parameter; thin: each sample)", xlabel="step",
                ylabel="% of non-zero values")
    axes[1].set(title="round-trip error ||Q(x) - x|| / ||x||", xlabel="step", yscale="log")
    axes[2].set(title="update / param norm (largest)", xlabel="step", yscale="log")
    for ax in axes:
        ax.legend(fontsize=7)
    fig.suptitle(f"lowbit_compile.monitor on the Zipf embedding task, a sample every {args.every} steps "
                 "(dotted: the step it warned)", fontsize=9)
    fig.tight_layout()
    args.png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.png, dpi=110)
    print(f"figures: {args.png}")


if __name__ == "__main__":
    main()
