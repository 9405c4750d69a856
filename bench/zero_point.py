"""The zero-point check: 20 AdamW steps with random gradients on a transformer-shaped parameter set;
per optimizer, (a) how many second-moment entries are stored as exactly 0 where fp32 AdamW's are
positive (ppm of entries, over all steps), and (b) how far any parameter ends from fp32 AdamW's, in
units of lr.

A v stored as 0 turns ``m / (sqrt(v) + eps)`` into a step of ``m / eps`` (the zero-point problem of
Li et al. 2023, "Memory Efficient Optimizers with 4-bit States", Sec. 4.1).

    python bench/zero_point.py             # 12.6M params (d=384, 6 layers): ours, bitsandbytes, torchao
    python bench/zero_point.py --small     # the 0.5M-param set of tests/test_zero_point.py

Writes ``bench/results/zero_point.{json,md}``. torchao runs eagerly (``bench.tasks.torchao_eager``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: find bench/ and tests/

import torch

from bench.shapes import transformer_params
from bench.state_drift import stored_moment
from bench.tasks import PEERS, Hyper, OptimizerSpec

RESULTS = Path(__file__).resolve().parent / "results"
FULL = {"d": 384, "layers": 6, "vocab": 4864}  # 12,613,632 params
SMALL = {"d": 128, "layers": 2, "vocab": 512}  # 495,104 params, the same kinds of tensors
STEPS = 20
HYPER = Hyper(steps=STEPS, lr=1e-3, weight_decay=0.01, warmup=0, eval_every=STEPS)
OURS = ("int8", "dynamic8", "sqrt8", "fp8_e4m3", "fp8_e5m2", "bf16")


@dataclass(frozen=True)
class ZeroPoint:
    zeros_ppm: float  # v stored as exactly 0 where fp32 v > 0, per million (entry, step) pairs
    worst_step_ppm: float  # the same at the step with the most
    max_off_lr: float  # after the last step: max |param - fp32 param| / lr
    mean_off_lr: float
    seconds: float


def _steps(params0: list[torch.Tensor], spec: OptimizerSpec, steps: int, seed: int):
    """Step a fresh copy of ``params0`` with ``spec``'s optimizer; yields (params, opt) after each step."""
    params = [torch.nn.Parameter(p.clone()) for p in params0]
    opt = spec.build(params, HYPER)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
        yield params, opt


def zero_point_check(names: list[str | OptimizerSpec], size: dict, steps: int = STEPS, seed: int = 1,
                     backend: str = "auto", progress: Callable[[str, ZeroPoint], None] | None = None
                     ) -> dict[str | OptimizerSpec, ZeroPoint]:
    """Run fp32 AdamW and each optimizer of ``names`` (``OptimizerSpec`` names, ours lowered by
    ``backend``, or specs as they are) for ``steps`` steps with the same random gradients from the same
    ``transformer_params(**size)``. After every step, count the second-moment entries stored as 0
    where fp32's are positive (a v flushed for one step already makes that step's update too
    large); after the last, compare the parameters."""
    torch.manual_seed(0)
    params0 = [p.detach() for p in transformer_params(**size)]
    positive = []  # per step, where fp32's v > 0
    for ref, ref_opt in _steps(params0, OptimizerSpec("fp32"), steps, seed):
        positive.append([ref_opt.state[p]["exp_avg_sq"] > 0 for p in ref])
    out = {}
    for name in names:
        start = time.perf_counter()
        zeros = []
        spec = name if isinstance(name, OptimizerSpec) else OptimizerSpec(name, backend=backend)
        for params, opt in _steps(params0, spec, steps, seed):
            mask = positive[len(zeros)]
            zeros.append(sum(int(((stored_moment(opt, p, "exp_avg_sq") == 0) & m).sum()) for p, m in zip(params, mask)))
        seconds = time.perf_counter() - start
        n_pos = [sum(int(m.sum()) for m in mask) for mask in positive]
        off = torch.cat([(p.detach() - r.detach()).abs().flatten() for p, r in zip(params, ref)]) / HYPER.lr
        out[name] = ZeroPoint(sum(zeros) / sum(n_pos) * 1e6, max(z / n * 1e6 for z, n in zip(zeros, n_pos)),
                              off.max().item(), off.mean().item(), seconds)
        if progress:
            progress(name, out[name])
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--small", action="store_true", help="the 0.5M-param set of the test")
    ap.add_argument("--no-peers", action="store_true", help="ours only")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    from tqdm import tqdm

    torch.set_num_threads(1)
    size = SMALL if args.small else FULL
    names = list(OURS) + ([] if args.no_peers else list(PEERS))
    n = sum(p.numel() for p in transformer_params(**size))
    with tqdm(total=len(names), desc="optimizers") as bar:
        results = zero_point_check(names, size, progress=lambda name, r: (
            bar.set_postfix_str(f"{name}: {r.zeros_ppm:.0f} ppm, {r.max_off_lr:.2f} lr"), bar.update()))
    lines = [f"Zero-point check: {n:,} params ({size}), {STEPS} AdamW steps, lr {HYPER.lr}, weight decay "
             f"{HYPER.weight_decay}, N(0, 1) gradients; torchao run eagerly", "",
             "| optimizer | v stored as 0 where fp32 v > 0 (all steps) | worst step "
             "| max \\|p - p_fp32\\| / lr | mean / lr | s |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r.zeros_ppm:.1f} ppm | {r.worst_step_ppm:.1f} ppm | {r.max_off_lr:.3f} "
                     f"| {r.mean_off_lr:.4f} | {r.seconds:.0f} |")
    text = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "zero_point_small" if args.small else "zero_point"
    (args.out / f"{stem}.md").write_text(text)
    (args.out / f"{stem}.json").write_text(json.dumps(
        {"size": size, "params": n, "steps": STEPS, "lr": HYPER.lr, "weight_decay": HYPER.weight_decay,
         "results": {k: asdict(v) for k, v in results.items()}}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
