"""The first optimizer step of a fresh process, and where its time goes: AdamW over 25M params in 15
tensors, the default format, the CPU kernel, with a cold and then a warm kernel cache.

    python bench/first_step.py                 # one cold and one warm fresh process per repeat
    python bench/first_step.py --repeats 3     # medians of 3

Each measurement is a fresh interpreter (``--child``) with ``$LOWBIT_COMPILE_CACHE_DIR`` pointed at a
temporary directory: empty for the cold run, filled by it for the warm one. The child times
``import lowbit_compile``, the first ``step()`` and the second, and splits the first step by wrapping
the library's stages (exclusive times: a stage nested in another counts once): the state-layout
probe, tracing (make_fx), the graph passes, C++ emission, starting the C++ builds and waiting for
them (a step's kernels compile at once, in the background; the compilers' summed run time is
reported too), creating the states, and the rest (the kernel's first run, lazy imports,
bookkeeping), in wall and CPU seconds (CPU includes the compiler's, and is what to read on a loaded
machine). Results go to bench/results/first_step.json and .md.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
# 25.2M params in 15 tensors: an embedding, 4 MLP matrices, 3 square ones and 7 vectors
SHAPES = [(9216, 1024), (1024, 3072), (1024, 3072), (3072, 1024), (3072, 1024), (1024, 1024), (1024, 1024),
          (1024, 1024)] + [(1024,)] * 7
# (module, attribute, stage): the functions a first step goes through, wrapped where they are looked up
STAGES = [
    ("lowbit_compile.runtime.wrap", "probe_schema", "probe"),
    ("lowbit_compile.runtime.rewritten_step", "probe_schema", "probe"),
    ("lowbit_compile.passes.trace_cache", "trace_step", "trace"),
    ("lowbit_compile.state.schema", "label_roles", "passes"),
    ("lowbit_compile.state.schema", "prove_nonneg", "passes"),
    ("lowbit_compile.runtime.compile", "label_roles", "passes"),
    ("lowbit_compile.runtime.compile", "prove_nonneg", "passes"),
    ("lowbit_compile.runtime.compile", "quantize_states", "passes"),
    ("lowbit_compile.runtime.compile", "compute_in_fp32", "passes"),
    ("lowbit_compile.runtime.compile", "split_prologue", "passes"),
    ("lowbit_compile.kernels.cpu", "emit_step", "emit C++"),
    ("lowbit_compile.kernels.cpu_build", "load_async", "start C++ builds"),
    ("lowbit_compile.runtime.rewritten_step", "init_state", "create states"),
]
ORDER = ["import torch", "import lowbit_compile", "probe", "trace", "passes", "emit C++", "start C++ builds",
         "wait for C++ builds", "create states", "rest (first run, lazy imports)", "first step", "second step",
         "C++ compiler runs (sum, in the background)"]


def clocks() -> tuple[float, float]:
    """(wall, CPU) seconds; CPU counts this process and its finished children (the C++ compiler), so a
    stage's CPU time stays meaningful on a loaded machine where its wall time is not."""
    t = os.times()
    return time.perf_counter(), t.user + t.system + t.children_user + t.children_system


class StageTimer:
    """Exclusive wall and CPU time per stage: entering a stage pauses the one it was called from."""

    def __init__(self) -> None:
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.stack: list[list] = []  # [stage, wall and CPU clock at the start of its running interval]

    def _charge(self, stage: str, since: tuple[float, float], now: tuple[float, float]) -> None:
        self.wall[stage] = self.wall.get(stage, 0.0) + now[0] - since[0]
        self.cpu[stage] = self.cpu.get(stage, 0.0) + now[1] - since[1]

    def wrap(self, fn, stage: str):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            now = clocks()
            if self.stack:
                self._charge(*self.stack[-1], now)
            self.stack.append([stage, now])
            try:
                return fn(*args, **kwargs)
            finally:
                end = clocks()
                self._charge(*self.stack.pop(), end)
                if self.stack:
                    self.stack[-1][1] = end

        return timed

    def wrap_future(self, fn, stage: str):
        """``fn`` returns a future (a background build): its ``result()`` is timed as ``stage``."""
        timer = self

        class Timed:
            def __init__(self, future) -> None:
                self.result = timer.wrap(future.result, stage)

        @functools.wraps(fn)
        def started(*args, **kwargs):
            return Timed(fn(*args, **kwargs))

        return started


def child() -> None:
    t0 = clocks()
    import torch

    t1 = clocks()
    import lowbit_compile

    t2 = clocks()
    torch.set_num_threads(1)
    timer = StageTimer()
    for module, attr, stage in STAGES:
        mod = importlib.import_module(module)
        if hasattr(mod, attr):
            setattr(mod, attr, timer.wrap(getattr(mod, attr), stage))
    build = importlib.import_module("lowbit_compile.kernels.cpu_build")
    build.load_async = timer.wrap_future(build.load_async, "wait for C++ builds")
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=gen) * 0.02) for s in SHAPES]
    opt = lowbit_compile.lowbit_compile(torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01))
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-3
    start = clocks()
    opt.step()
    mid = clocks()
    opt.step()
    end = clocks()
    from lowbit_compile.kernels import cpu_build

    out = {}
    for i, totals in enumerate((timer.wall, timer.cpu)):
        stages = dict(totals)
        first = mid[i] - start[i]
        stages["rest (first run, lazy imports)"] = first - sum(stages.values())
        stages.update({"import torch": t1[i] - t0[i], "import lowbit_compile": t2[i] - t1[i], "first step": first,
                       "second step": end[i] - mid[i]})
        if i == 0:
            stages["C++ compiler runs (sum, in the background)"] = cpu_build.compile_seconds
        out["stages" if i == 0 else "cpu"] = stages
    backends = {prepared.compiled.kernel.backend for prepared in opt._lowbit.prepared.values()}
    print(json.dumps({**out, "compiles": cpu_build.compile_count, "backends": sorted(backends),
                      "params": sum(p.numel() for p in params), "tensors": len(params)}))


def fresh(cache: str) -> dict:
    env = {**os.environ, "LOWBIT_COMPILE_CACHE_DIR": cache, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True,
                          timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"the fresh process failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def markdown(result: dict) -> str:
    lines = [f"# First step of a fresh process ({result['params'] / 1e6:.1f}M params in {result['tensors']} "
             "tensors, AdamW, default format, CPU kernel, 1 thread)", "",
             f"{result['date']}; medians of {result['repeats']} fresh processes each; load averages "
             f"{result['load_start']} -> {result['load_end']}; C++ compilations: cold {result['cold_compiles']}, "
             f"warm {result['warm_compiles']}.", "",
             "| stage | cold wall s | cold CPU s | warm wall s | warm CPU s |", "|---|---:|---:|---:|---:|"]
    for stage in ORDER:
        lines.append(f"| {stage} | " + " | ".join(f"{result[t][k].get(stage, 0.0):.3f}" for t in ("cold", "warm")
                                                   for k in ("wall", "cpu")) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=1, help="cold/warm pairs of fresh processes (medians)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="first_step", help="base name of the result files in bench/results/")
    args = parser.parse_args()
    if args.child:
        child()
        return
    load_start = Path("/proc/loadavg").read_text().split()[:3]
    runs: dict[str, list[dict]] = {"cold": [], "warm": []}
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as cache:
            for temperature in ("cold", "warm"):
                runs[temperature].append(fresh(cache))
                print(temperature, json.dumps(runs[temperature][-1]["stages"]), flush=True)
    result = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "repeats": args.repeats, "load_start": load_start,
              "load_end": Path("/proc/loadavg").read_text().split()[:3],
              "params": runs["cold"][0]["params"], "tensors": runs["cold"][0]["tensors"],
              "cold_compiles": runs["cold"][0]["compiles"], "warm_compiles": runs["warm"][0]["compiles"],
              "backends": runs["cold"][0]["backends"], "runs": runs}
    for temperature, rs in runs.items():
        result[temperature] = {k: {stage: statistics.median(r[field].get(stage, 0.0) for r in rs) for stage in ORDER}
                               for k, field in (("wall", "stages"), ("cpu", "cpu"))}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.out}.json").write_text(json.dumps(result, indent=1))
    text = markdown(result)
    (RESULTS / f"{args.out}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
