"""Training with bf16 params: ours (default format, the update in fp32 rounded once per store) against
stock AdamW on the same bf16 params (``fused=True``: fp32 math rounded once; ``foreach=False``: every
op rounded to bf16) and against fp32 training, on a quality task of ``bench/tasks.py``.

    nice -n 19 python bench/bf16_params.py                    # char_gpt, seeds 0 1 2
    nice -n 19 python bench/bf16_params.py --step-scale 0.5   # half the steps

``ours single-tensor`` is ours with the fp32-update pass turned off (what the step did before it):
each intermediate rounded to bf16 as ATen's single-tensor path does. Results: bench/results/bf16_params.json/.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.tasks import TASKS, train  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def _bf16(params: list[torch.nn.Parameter]) -> None:
    for p in params:
        p.data = p.data.bfloat16()


def _adamw(params, hyper, **impl):
    return torch.optim.AdamW(params, lr=hyper.lr, betas=hyper.betas, eps=hyper.eps, weight_decay=hyper.weight_decay,
                             **impl)


def make(variant: str):
    def build(params, hyper):
        if variant == "fp32 (fp32 params, stock AdamW)":
            return _adamw(params, hyper)
        _bf16(params)
        if variant == "torch AdamW fused=True":
            return _adamw(params, hyper, fused=True)
        if variant == "torch AdamW foreach=False":
            return _adamw(params, hyper, foreach=False)
        from lowbit_compile import lowbit_compile
        from lowbit_compile.config import DEFAULT_FMT
        from lowbit_compile.runtime import compile as compile_module

        if not hasattr(compile_module, "_stock_fp32_opmath"):
            compile_module._stock_fp32_opmath = compile_module.fp32_opmath
        off = variant.startswith("ours single-tensor")
        compile_module.fp32_opmath = (lambda group, dtype, formats: False) if off else compile_module._stock_fp32_opmath
        return lowbit_compile(_adamw(params, hyper), DEFAULT_FMT)

    return build


VARIANTS = ["fp32 (fp32 params, stock AdamW)", "torch AdamW fused=True", "torch AdamW foreach=False",
            "ours (default format)", "ours single-tensor (pass off)"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default="char_gpt", choices=["char_gpt", "char_gpt_2m"])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--step-scale", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--variants", nargs="+", default=VARIANTS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    task = TASKS[args.task]()
    task.hyper = replace(task.hyper, steps=int(task.hyper.steps * args.step_scale),
                         warmup=max(1, int(task.hyper.warmup * args.step_scale)),
                         eval_every=max(1, int(task.hyper.eval_every * args.step_scale)))
    runs: dict[str, list[dict]] = {}
    for variant in args.variants:
        for seed in args.seeds:
            hist = train(task, make(variant), seed)
            runs.setdefault(variant, []).append({"seed": seed, "final": hist.final, "seconds": hist.seconds})
            print(f"{variant} seed {seed}: val loss {hist.final['loss']:.4f} ({hist.seconds:.0f} s)", flush=True)
    fp32 = statistics.mean(r["final"]["loss"] for r in runs[VARIANTS[0]]) if VARIANTS[0] in runs else None
    lines = [f"# bf16 params: {args.task}, {task.hyper.steps} steps, seeds {args.seeds}", "",
             f"{time.strftime('%Y-%m-%d %H:%M:%S')}; final validation loss, mean and spread (max - min) over seeds.",
             "", "| optimizer | val loss mean | spread | vs fp32 |", "|---|---:|---:|---:|"]
    for variant, rs in runs.items():
        losses = [r["final"]["loss"] for r in rs]
        mean = statistics.mean(losses)
        rel = f"{100 * (mean / fp32 - 1):+.2f}%" if fp32 else ""
        lines.append(f"| {variant} | {mean:.4f} | {max(losses) - min(losses):.4f} | {rel} |")
    text = "\n".join(lines) + "\n"
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "bf16_params.json").write_text(json.dumps({"task": args.task, "steps": task.hyper.steps,
                                                          "seeds": args.seeds, "runs": runs}, indent=1))
    (RESULTS / "bf16_params.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
