"""Does Muon train like fp32 with an 8-bit momentum? Trains tasks of ``bench/tasks.py`` with Muon on
the hidden matrices and AdamW on the rest (embeddings, head, norms, biases), once with stock fp32 states
and once with both optimizers wrapped by ``lowbit_compile`` at the default format, over paired seeds.

    python bench/muon_quality.py                              # char_gpt, 3 seeds: a few minutes
    python bench/muon_quality.py --tasks char_gpt char_gpt_2m --step-scale 1 0.4

Muon uses ``adjust_lr_fn="match_rms_adamw"`` (Moonshot's scaling), so both optimizers follow the
task's AdamW learning rate and schedule. Writes ``bench/results/muon_quality.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: find examples/ and bench/

import torch

from bench.quality import scale_steps
from bench.tasks import TASKS, Hyper, train
from lowbit_compile import lowbit_compile, memory_report, stats

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = ("fp32", "ours")


class MuonAdamW(torch.optim.Optimizer):
    """Muon on the hidden matrices and AdamW on the rest, stepped together (one object for the loop)."""

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer) -> None:
        self.parts = (muon, adamw)  # no Optimizer.__init__: the parts hold the groups and states
        self.defaults = {}
        self.state = {}

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.parts for g in opt.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.parts:
            opt.zero_grad(set_to_none)

    def step(self, closure=None) -> None:
        for opt in self.parts:
            opt.step()


def hidden_matrix(name: str, param: torch.Tensor) -> bool:
    """What Muon steps: 2-D weights inside the blocks (not the embeddings, the head, norms or biases)."""
    return param.dim() == 2 and not any(k in name for k in ("tok.", "pos.", "head", "emb"))


def build(task_name: str, seed: int, variant: str):
    names = [n for n, _ in TASKS[task_name]().model(seed).named_parameters()]

    def make(params: list[torch.nn.Parameter], hyper: Hyper) -> MuonAdamW:
        matrices = [p for n, p in zip(names, params) if hidden_matrix(n, p)]
        rest = [p for n, p in zip(names, params) if not hidden_matrix(n, p)]
        muon = torch.optim.Muon(matrices, lr=hyper.lr, weight_decay=hyper.weight_decay,
                                adjust_lr_fn="match_rms_adamw")
        adamw = torch.optim.AdamW(rest, lr=hyper.lr, weight_decay=hyper.weight_decay, betas=hyper.betas,
                                  eps=hyper.eps)
        if variant == "ours":
            muon, adamw = lowbit_compile(muon), lowbit_compile(adamw)
        return MuonAdamW(muon, adamw)

    return make


def run(task_name: str, variant: str, seed: int, step_scale: float) -> dict:
    task = scale_steps(TASKS[task_name](), step_scale)
    made: list[MuonAdamW] = []
    make = build(task_name, seed, variant)

    def keep(params, hyper):
        made.append(make(params, hyper))
        return made[-1]

    start = time.perf_counter()
    hist = train(task, keep, seed)
    muon = made[0].parts[0]
    report = memory_report(muon) if variant == "ours" else None
    # the momentum's share of non-zero values stored as 0, on the last batch's grads (the monitor's figure)
    flush = max(s.zero_flush for s in stats(muon) if s.state == "momentum_buffer") if report else None
    return {"task": task_name, "variant": variant, "seed": seed, "steps": task.hyper.steps,
            "val_loss": hist.final["loss"], "seconds": time.perf_counter() - start,
            "muon_params": sum(p.numel() for g in muon.param_groups for p in g["params"]),
            "momentum_bytes_per_param": (report.per_state["momentum_buffer"].bytes_per_param if report else 4.0),
            "muon_transient_bytes": report.transient if report else None, "momentum_zero_flush": flush}


def markdown(runs: list[dict]) -> str:
    lines = ["| task | steps | seed | fp32 val loss | ours val loss | gap | momentum zero flush |",
             "|---|---|---|---|---|---|---|"]
    gaps: dict[str, list[float]] = {}
    for r in runs:
        if r["variant"] != "ours":
            continue
        ref = next(x for x in runs if x["variant"] == "fp32" and x["task"] == r["task"] and x["seed"] == r["seed"])
        gap = 100 * (r["val_loss"] - ref["val_loss"]) / ref["val_loss"]
        gaps.setdefault(r["task"], []).append(gap)
        lines.append(f"| {r['task']} | {r['steps']} | {r['seed']} | {ref['val_loss']:.4f} | {r['val_loss']:.4f} | "
                     f"{gap:+.2f}% | {r['momentum_zero_flush']:.1e} |")
    for task, g in gaps.items():
        spread = statistics.stdev(g) if len(g) > 1 else 0.0
        lines.append(f"| {task} | | mean | | | {statistics.mean(g):+.2f}% (sd {spread:.2f}) | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", nargs="+", default=["char_gpt"], choices=list(TASKS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--step-scale", type=float, nargs="+", default=[1.0], help="per task (one: every task)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    runs = []
    scales = args.step_scale * len(args.tasks) if len(args.step_scale) == 1 else args.step_scale
    for task, scale in zip(args.tasks, scales, strict=True):
        for seed in args.seeds:
            for variant in VARIANTS:
                runs.append(run(task, variant, seed, scale))
                print(json.dumps(runs[-1]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "muon_quality.json").write_text(json.dumps({"step_scale": args.step_scale, "runs": runs}, indent=1))
    table = markdown(runs)
    (args.out / "muon_quality.md").write_text(f"# Muon (hidden matrices) + AdamW: fp32 states vs ours\n\n"
                                              f"`python bench/muon_quality.py {' '.join(argv or sys.argv[1:])}`"
                                              f"\n\n{table}\n")
    print(table)


if __name__ == "__main__":
    main()
