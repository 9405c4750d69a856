"""Train one of the quality tasks with stock fp32 AdamW and low-bit states side by side.

    python examples/train.py --task char_gpt --opt fp32 int8 dynamic8
    python examples/train.py --task zipf --opt fp32 int8-b2048-k0 int8-b256-k0 bnb-AdamW8bit --steps 300

Optimizer names: ``fp32``; one of ours, a format (sqrt8, dynamic8, int8, fp8_e4m3, fp8_e5m2, bf16) optionally
followed by ``-b<block_size>`` and ``-k<outliers>``; or a peer (bnb-AdamW8bit, ao-AdamW8bit,
ao-AdamWFp8, ao-AdamW4bit). Each optimizer starts from the same weights and sees the same batches.
The tasks are defined in ``bench/tasks.py``; ``bench/quality.py`` runs the full comparison.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: find examples/

import torch
from tqdm import tqdm

from bench.tasks import TASKS, OptimizerSpec, train


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", choices=list(TASKS), default="char_gpt")
    ap.add_argument("--opt", nargs="+", default=["fp32", "int8", "sqrt8"], help="optimizers to compare")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, help="override the task's step count")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest for these sizes)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    task = TASKS[args.task]()
    n = sum(p.numel() for p in task.model(args.seed).parameters())
    print(f"{task.name}: {n:,} params, {args.steps or task.hyper.steps} steps")
    results = {}
    for name in args.opt:
        spec = OptimizerSpec(name)
        with tqdm(total=args.steps or task.hyper.steps, desc=name, unit="step") as bar:
            def on_step(step: int, loss: float) -> None:
                bar.update()
                if step % 10 == 0:
                    bar.set_postfix(loss=f"{loss:.3f}")

            hist = train(task, spec.build, args.seed, steps=args.steps, on_step=on_step)
        results[name] = hist.final
    base = results.get("fp32")
    for name, final in results.items():
        gap = f"  ({(final['loss'] / base['loss'] - 1) * 100:+.2f}% vs fp32)" if base and name != "fp32" else ""
        extra = "".join(f"  val {k} {v:.4f}" for k, v in final.items() if k != "loss")
        print(f"{name:<24} val loss {final['loss']:.4f}{extra}{gap}")


if __name__ == "__main__":
    main()
