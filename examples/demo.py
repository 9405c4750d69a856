"""The demo: train a small character-level GPT with stock fp32 AdamW and with low-bit states.

Prints, per optimizer, the optimizer-state memory actually held and the validation loss, so the
two promises (4x less state, same training) can be checked in a couple of minutes on a CPU.
Run: ``make demo`` (or ``python examples/demo.py --steps 300 --fmt dynamic8``).
"""

from __future__ import annotations

import argparse

import torch
from tasks import CharGPT, Hyper, train
from tqdm import tqdm

from lowbit_compile import lowbit_compile, memory_report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--fmt", nargs="+", default=["dynamic8", "int8"],
                        help="low-bit formats to compare (dynamic8 is the library default)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))

    hyper = Hyper(steps=args.steps, lr=3e-3, weight_decay=0.1, warmup=20, eval_every=max(args.steps // 4, 1))
    task = CharGPT(d=96, layers=3, heads=4, ctx=64, batch=16, hyper=hyper)
    n_params = sum(p.numel() for p in task.model(0).parameters())
    print(f"char-level GPT on Python's pydoc text: {n_params / 1e6:.2f}M params, {args.steps} steps, "
          f"batch {task.batch_size}x{task.ctx}\n")

    rows = []
    for fmt in ["fp32 (stock)", *args.fmt]:
        holder: dict[str, torch.optim.Optimizer] = {}

        def make(params, h, fmt=fmt, holder=holder):
            opt = torch.optim.AdamW(params, lr=h.lr, betas=h.betas, weight_decay=h.weight_decay)
            if fmt != "fp32 (stock)":
                lowbit_compile(opt, fmt)
            holder["opt"] = opt
            return opt

        with tqdm(total=args.steps, desc=f"AdamW {fmt:>12}", leave=False) as bar:
            def progress(step: int, loss: float, bar=bar) -> None:
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.3f}")

            history = train(task, make, seed=args.seed, on_step=progress)
        report = memory_report(holder["opt"])
        mv = sum(report.per_state[k].bytes for k in ("exp_avg", "exp_avg_sq"))
        rows.append((fmt, mv, mv / report.total.params, history.final["loss"], history.seconds))

    print(f"{'AdamW states':<16}{'m+v bytes':>12}{'B/param':>9}{'val loss':>10}{'gap':>8}{'time s':>8}")
    base = rows[0][3]
    for fmt, mv, per, loss, secs in rows:
        print(f"{fmt:<16}{mv:>12,}{per:>9.3f}{loss:>10.4f}{(loss - base) / base:>+8.2%}{secs:>8.1f}")
    print("\nm+v: the bytes of exp_avg and exp_avg_sq actually held (codes, scales, patches); tensors under "
          "4096 elements keep fp32 states.")


if __name__ == "__main__":
    main()
