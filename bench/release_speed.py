"""Time of a training iteration with and without ``release_grads=True``: the Llama of
``bench/train_memory.py`` (27.4M params, 4 x 256 tokens, bf16 autocast; CPU by default, at 1 and 2
threads), our default states on fp32 params and bf16 params with ``master_weights="exact"``, each with
and without release.

All four runs live in one process, from the same weights on the same batches; after a warm-up, rounds
interleave them (the order rotates each round), each run timing a few whole iterations (forward,
backward, ``opt.step()``, ``zero_grad``). Printed per thread count: the median time per iteration of
each run and the median over rounds of the ratio release / without release (the pair timed in the same
round, so a load that comes and goes moves both). The machine's load average is recorded beside the
figures: rerun on a quiet machine for numbers to quote.

    python bench/release_speed.py                        # bench/results/release_speed.json
    python bench/release_speed.py --rounds 9 --threads 1,2,4
    python bench/release_speed.py --device cuda --threads 1 --hidden 2048 --layers 16 --batch 8 --seq 512 --out ...
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: find bench/
from bench.train_memory import RESULTS, add_model_args, build_model, write_results  # noqa: E402

RUNS = {  # name -> (param dtype, options of lowbit_compile)
    "ours": (torch.float32, {}),
    "ours, release_grads": (torch.float32, {"release_grads": True}),
    'ours, bf16, master_weights="exact"': (torch.bfloat16, {"master_weights": "exact"}),
    'ours, bf16, master_weights="exact", release_grads': (torch.bfloat16, {"master_weights": "exact",
                                                                          "release_grads": True}),
}
PAIRS = [("ours", "ours, release_grads"),
         ('ours, bf16, master_weights="exact"', 'ours, bf16, master_weights="exact", release_grads')]


def main() -> None:
    from lowbit_compile import lowbit_compile

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (timed between synchronizations)")
    ap.add_argument("--threads", default="1,2", help="comma-separated CPU thread counts")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=2, help="iterations timed per run and round")
    ap.add_argument("--warmup", type=int, default=2, help="iterations per run before timing (kernels, plans)")
    add_model_args(ap)
    ap.add_argument("--out", default=str(RESULTS / "release_speed.json"))
    args = ap.parse_args()
    cuda = args.device == "cuda"
    gen = torch.Generator().manual_seed(1)
    data = [torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(args.device) for _ in range(8)]
    runs = {}
    for name, (dtype, options) in RUNS.items():
        model = build_model(args, dtype)
        runs[name] = (model, lowbit_compile(torch.optim.AdamW(model.parameters(), lr=1e-4), **options))
    turn = [0]

    def iterate(name: str) -> None:
        model, opt = runs[name]
        x = data[turn[0] % len(data)]
        turn[0] += 1
        with torch.autocast(args.device, dtype=torch.bfloat16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    results = []
    for threads in [int(t) for t in args.threads.split(",")]:
        torch.set_num_threads(threads)
        for name in runs:
            for _ in range(args.warmup):
                iterate(name)
        times: dict[str, list[float]] = {name: [] for name in runs}
        load = [os.getloadavg()]
        names = list(runs)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                if cuda:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(args.iters):
                    iterate(name)
                if cuda:
                    torch.cuda.synchronize()
                times[name].append((time.perf_counter() - start) / args.iters)
            load.append(os.getloadavg())
        row = {"threads": threads, "median_s": {n: statistics.median(t) for n, t in times.items()}, "times_s": times,
               "ratios": {b: statistics.median(x / y for x, y in zip(times[b], times[a])) for a, b in PAIRS},
               "load_avg_1min": [round(x[0], 2) for x in load]}
        results.append(row)
        print(f"{threads} thread(s), load average {min(row['load_avg_1min']):.1f}-{max(row['load_avg_1min']):.1f}:",
              flush=True)
        for a, b in PAIRS:
            print(f"  {a}: {row['median_s'][a] * 1e3:.0f} ms/iter; with release_grads "
                  f"{row['median_s'][b] * 1e3:.0f} ms/iter; release / without {row['ratios'][b]:.3f}", flush=True)
    head = "| threads | run | ms per iteration (without) | ms (release_grads) | release / without | load avg |"
    lines = [head, "|---:|---|---:|---:|---:|---|"]
    for row in results:
        load = f"{min(row['load_avg_1min']):.1f}-{max(row['load_avg_1min']):.1f}"
        for a, b in PAIRS:
            lines.append(f"| {row['threads']} | {a} | {row['median_s'][a] * 1e3:.0f} | {row['median_s'][b] * 1e3:.0f} "
                         f"| {row['ratios'][b]:.3f} | {load} |")
    n = sum(p.numel() for p in runs["ours"][0].parameters())
    print(f"\nLlama {n / 1e6:.1f}M params, batch {args.batch} x {args.seq} tokens, bf16 autocast, {args.device}; "
          f"medians of {args.rounds} interleaved rounds of {args.iters} iterations")
    print("\n".join(lines))
    write_results(args, results, lines, cores=os.cpu_count())


if __name__ == "__main__":
    main()
