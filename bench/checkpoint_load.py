"""Time of ``load_state_dict`` and of one step of a wrapped AdamW (int8, 2 outlier patches per block) on
a small GPT's parameter shapes, for comparing the checkpoint validation of two trees: run it with each
tree first on ``PYTHONPATH``, interleaved, on one machine. Prints a table, writes JSON.

    PYTHONPATH=. python bench/checkpoint_load.py --label new
    PYTHONPATH=/path/to/old/tree python bench/checkpoint_load.py --label old
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import time
from pathlib import Path

import torch

from lowbit_compile import lowbit_compile


def shapes(d: int, layers: int, vocab: int) -> list[tuple[int, ...]]:
    out = [(vocab, d)]
    for _ in range(layers):
        out += [(d,), (3 * d, d), (d, d), (d,), (4 * d, d), (d, 4 * d)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--label", default="this tree")
    parser.add_argument("--d", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default="bench/results/checkpoint_load.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in shapes(args.d, args.layers, 8192)]
    opt = lowbit_compile(torch.optim.AdamW(params), "int8", outliers=2)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    loads, steps = [], []
    for _ in range(args.rounds):
        buffer.seek(0)
        saved = torch.load(buffer, weights_only=True)
        start = time.perf_counter()
        opt.load_state_dict(saved)
        loads.append(time.perf_counter() - start)
        start = time.perf_counter()
        opt.step()
        steps.append(time.perf_counter() - start)
    n = sum(p.numel() for p in params)
    row = {"label": args.label, "params": n, "load_s": statistics.median(loads), "step_s": statistics.median(steps),
           "loadavg": os.getloadavg()[0]}
    print(f"{'tree':<12}{'params':>12}{'load (median)':>16}{'step (median)':>16}{'load avg':>10}")
    print(f"{row['label']:<12}{n:>12,}{row['load_s'] * 1e3:>13.1f} ms{row['step_s'] * 1e3:>13.1f} ms"
          f"{row['loadavg']:>10.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = json.loads(out.read_text()) if out.exists() else []
    out.write_text(json.dumps([r for r in rows if r["label"] != args.label] + [row], indent=2) + "\n")


if __name__ == "__main__":
    main()
