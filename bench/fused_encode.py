"""CPU kernel layouts for writing a block's codes: in loops of their own after the block's update
(``lb_encode_pair``), or in the next block's lane loop, a vector per iteration (the encode of formats
in ``cpp_printer._FUSED_ENCODES``). One process, the same parameters, every contender stepping once
per round in a shuffled order; ratios are paired per round.

    python bench/fused_encode.py                      # 100M params, fp32, 1 thread, every blockwise format
    python bench/fused_encode.py --size 25M --formats sqrt8,int8 --threads 2
    python bench/fused_encode.py --size 25M --formats sqrt4,sqrt8 --rounds 15 --name cpu_fused_encode_sqrt4_avx2

Before timing, both layouts step copies of a small parameter set and must leave the same bytes in
every param and state (the layout changes when codes are written, not what they are). Writes
bench/results/cpu_fused_encode.{json,md,png} (``--name``: another name).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.step_bench import LR, PARAM_SETS, WEIGHT_DECAY, load_average, make_params  # noqa: E402
from lowbit_compile import lowbit_compile  # noqa: E402
from lowbit_compile.kernels import cpp_printer  # noqa: E402
from lowbit_compile.kernels import cpu as cpu_kernels  # noqa: E402
from lowbit_compile.runtime import compile as compile_module

RESULTS = Path(__file__).parent / "results"
FORMATS = ("sqrt8", "int8", "dynamic8", "fp8_e4m3")
FUSE_FLAG = "-DLB_FUSE_ENCODES=1"  # the fused layout at any vector width (cpu_prelude.h's lb_fuse_if)


@contextlib.contextmanager
def encodes_fused(formats: frozenset[str]):
    """Steps built inside fuse the encode of ``formats`` only, whatever the machine's vector width
    (``LB_FUSE_ENCODES``, which the prelude otherwise sets for 16 lanes only): the layout is chosen when
    a kernel is emitted, on an optimizer's first step, and inside, no step built outside is reused."""
    native = cpu_kernels.cpu_build.load_async
    saved = cpp_printer._FUSED_ENCODES, compile_module._compiled, native
    cpp_printer._FUSED_ENCODES, compile_module._compiled = formats, {}
    cpu_kernels.cpu_build.load_async = lambda source, extra_flags=(): native(source, (*extra_flags, FUSE_FLAG))
    try:
        yield
    finally:
        cpp_printer._FUSED_ENCODES, compile_module._compiled, cpu_kernels.cpu_build.load_async = saved


def lowbit(params: list[torch.nn.Parameter], fmt: str, fused: bool) -> torch.optim.Optimizer:
    """Our AdamW in ``fmt`` with its codes written by the next block's loop (``fused``) or not; it has
    stepped once, so its kernel is built."""
    opt = lowbit_compile(torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY), fmt)
    with encodes_fused(frozenset({fmt}) if fused else frozenset()):
        opt.step()
        sources = [c.kernel.emitted.source for steps in compile_module._compiled.values() for c in steps
                   if "lb_job" in c.kernel.emitted.source]  # the steps with quantized states
    if not sources or any(("lb_fuse_if(" in src) != fused for src in sources):
        raise RuntimeError(f"{fmt}: the kernels built do not have the layout asked for (fused={fused})")
    return opt


def same_bytes(fmt: str) -> bool:
    """Both layouts, three steps on copies of one parameter set (whole blocks, a tail, a tensor of one
    block), leave identical params and states."""
    shapes = [(3000, 64), (4097,), (512,)]
    results = []
    for fused in (False, True):
        params = make_params(shapes, torch.float32, seed=1)
        opt = lowbit(params, fmt, fused)
        for _ in range(2):
            opt.step()
        results.append([p.detach().clone() for p in params] + [t.clone() for p in params
                                                                for t in _tensors(opt.state[p])])
    return all(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
               for a, b in zip(*results))


def _tensors(state: dict) -> list[torch.Tensor]:
    out = []
    for value in state.values():
        if torch.is_tensor(value):
            out.append(value)
        else:
            out += [t for t in vars(value).values() if torch.is_tensor(t)] if hasattr(value, "__dict__") else []
    return out


def run(size: str, formats: list[str], threads: int, rounds: int) -> dict:
    params = make_params(PARAM_SETS[size](), torch.float32)
    n = sum(p.numel() for p in params)
    contenders = {"torch AdamW fused": torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)}
    for fmt in formats:
        contenders[f"{fmt} separate"] = lowbit(params, fmt, fused=False)
        contenders[f"{fmt} fused"] = lowbit(params, fmt, fused=True)
    for opt in contenders.values():
        opt.step()
    times: dict[str, list[float]] = {name: [] for name in contenders}
    rng = random.Random(0)
    load_before = load_average()
    torch.set_num_threads(threads)
    for _ in range(rounds):
        order = list(contenders.items())
        rng.shuffle(order)
        for name, opt in order:
            start = time.perf_counter()
            opt.step()
            times[name].append(time.perf_counter() - start)
    fused_ref = times["torch AdamW fused"]
    rows = []
    for name, t in times.items():
        q = statistics.quantiles(t, n=4)
        rows.append({"contender": name, "step_ms_median": statistics.median(t) * 1e3, "step_ms_q1": q[0] * 1e3,
                     "step_ms_q3": q[2] * 1e3, "x_fused": statistics.median(a / b for a, b in zip(t, fused_ref)),
                     "step_ms_all": [x * 1e3 for x in t]})
    pairs = []
    for fmt in formats:
        ratio = [a / b for a, b in zip(times[f"{fmt} fused"], times[f"{fmt} separate"])]
        q = statistics.quantiles(ratio, n=4)
        pairs.append({"format": fmt, "fused_over_separate": statistics.median(ratio), "q1": q[0], "q3": q[2],
                      "same_bytes": same_bytes(fmt)})
    return {"size": size, "params": n, "tensors": len(params), "threads": threads, "rounds": rounds,
            "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
            "load_before": load_before, "load_after": load_average(), "rows": rows, "pairs": pairs}


def markdown(result: dict) -> str:
    lines = [f"# Fused encode: {result['size']} ({result['params'] / 1e6:.1f}M fp32 params in {result['tensors']} "
             f"tensors), {result['threads']} thread(s), {result['rounds']} rounds",
             "", f"torch {result['torch']}; load {result['load_before']} -> {result['load_after']}.", "",
             "| contender | step ms (median) | IQR ms | x torch fused (paired median) |", "|---|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['contender']} | {r['step_ms_median']:.1f} | {r['step_ms_q1']:.1f}-{r['step_ms_q3']:.1f} "
                     f"| {r['x_fused']:.3f} |")
    lines += ["", "| format | fused / separate (paired median) | IQR | same bytes |", "|---|---:|---:|---|"]
    for p in result["pairs"]:
        lines.append(f"| {p['format']} | {p['fused_over_separate']:.3f} | {p['q1']:.3f}-{p['q3']:.3f} | "
                     f"{'yes' if p['same_bytes'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    pairs = result["pairs"]
    ax.bar(range(len(pairs)), [p["fused_over_separate"] for p in pairs], color="tab:blue")
    ax.errorbar(range(len(pairs)), [p["fused_over_separate"] for p in pairs],
                yerr=[[p["fused_over_separate"] - p["q1"] for p in pairs],
                      [p["q3"] - p["fused_over_separate"] for p in pairs]], fmt="none", color="black")
    ax.axhline(1.0, color="gray", lw=1)
    ax.set_xticks(range(len(pairs)), [p["format"] for p in pairs])
    ax.set(ylabel="step time, fused / separate (paired median, IQR)",
           title=f"codes written by the next block's loop: {result['size']}, {result['threads']} thread(s)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="100M", choices=sorted(PARAM_SETS))
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--name", default="cpu_fused_encode", help="the results' file name in bench/results")
    args = parser.parse_args()
    result = run(args.size, args.formats.split(","), args.threads, args.rounds)
    text = markdown(result)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.name}.json").write_text(json.dumps(result, indent=1))
    (RESULTS / f"{args.name}.md").write_text(text)
    plot(result, RESULTS / f"{args.name}.png")


if __name__ == "__main__":
    main()
