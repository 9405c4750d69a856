"""Optimizer step benchmark: stock torch AdamW, bitsandbytes and torchao low-bit AdamW, and lowbit-compile
in each state format, interleaved in one process on transformer-shaped parameter sets (CPU).

    python bench/step_bench.py           # 25M and 100M params, fp32 and bf16, 1 and 2 threads
    python bench/step_bench.py --quick   # 6M params, fp32, 1 thread, no torchao: a few minutes
    python bench/step_bench.py --master  # bf16 params: master weights against fused fp32 and bf16 AdamW
    python bench/step_bench.py --optimizers all   # every stock optimizer against its fused/foreach twin
    python bench/step_bench.py --sizes 25M --formats dynamic8+nearest,dynamic8+sr   # nearest vs stochastic
    python bench/step_bench.py --sizes 25M --threads 1 --formats sqrt8+nearest,sqrt8,sqrt8+sr   # v's, both

Per contender: state bytes/param counted from the tensors its optimizer holds; step time (median and
interquartile range over rounds in which every contender steps once, in rotating order, on grad
tensors that are new each round as in training, with the same values); the ratio
to torch's fused fp32 AdamW on the same parameters; GB/s of the minimal bytes a step moves (read and
write p, read g, read and write every state) and that as % of the stream bandwidth measured in the
same section; the first step in a fresh process with a cold and then a warm compile cache; the peak
extra resident memory of a steady step. Results go to bench/results/step_bench[_<mode>]_<isa>_<sizes>.{json,md,png,log}
(``_result_base``: our kernels' ISA, the sizes run; ``--optimizers`` and ``--master`` name their mode), JSON
after every round, each run replacing the last one of its configuration (older runs are in git), with the
machine's load averages, since a shared machine slows a compute-bound step as much as a memory-bound one.

The peers are an optional extra: pip install -e ".[peers]" torch==<your torch>.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"
SMALL_SET = ("torch AdamW for-loop", "torch AdamW foreach", "torch AdamW fused", "lowbit int8 +patches")
LR, WEIGHT_DECAY = 1e-3, 0.01
FORMATS = ("sqrt8", "int8", "dynamic8", "fp8_e4m3", "fp8_e5m2", "bf16", "fp32")


# ---- parameter sets ---------------------------------------------------------------------------------
def transformer_shapes(d: int, layers: int, vocab: int, context: int = 1024) -> list[tuple[int, ...]]:
    """A GPT-style block stack: embeddings, per layer qkv/proj/fc1/fc2 weights and biases and two
    LayerNorms, a final LayerNorm (12 tensors per layer plus 4)."""
    shapes: list[tuple[int, ...]] = [(vocab, d), (context, d)]
    for _ in range(layers):
        shapes += [(3 * d, d), (3 * d,), (d, d), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,), (d,), (d,), (d,), (d,)]
    return shapes + [(d,), (d,)]


def small_shapes(count: int = 500) -> list[tuple[int, ...]]:
    """Many tensors under 4096 elements (norm weights, biases), sizes spread over 64..4095."""
    gen = torch.Generator().manual_seed(0)
    return [(int(n),) for n in torch.randint(64, 4096, (count,), generator=gen)]


PARAM_SETS: dict[str, Callable[[], list[tuple[int, ...]]]] = {
    "6M": lambda: transformer_shapes(256, 6, 4096),
    "25M": lambda: transformer_shapes(512, 8, 4096),  # 100 tensors: also the first-step model
    "12M": lambda: transformer_shapes(320, 8, 8192),  # the every-optimizer comparison
    "100M": lambda: transformer_shapes(768, 12, 16384),
    "small500": small_shapes,
    # the 100M model's 148 tensors at 64 elements each: the step is its per-tensor host work
    "host148": lambda: [(64,)] * len(transformer_shapes(768, 12, 16384)),
}


def make_params(shapes: list[tuple[int, ...]], dtype: torch.dtype, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.randn(shape, generator=gen).mul_(0.02).to(dtype))
        p.grad = torch.randn(shape, generator=gen).mul_(1e-3).to(dtype)
        params.append(p)
    return params


# ---- contenders -----------------------------------------------------------------------------------
@dataclass
class Contender:
    name: str
    make: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]
    family: str  # torch, bitsandbytes, torchao, lowbit, floor, copies (fp32 copies of the params)
    cache_env: str | None = None  # the compile cache a fresh process reads
    flags: dict = field(default_factory=dict)  # group flags set before each step (shared torch optimizer)


def _torch(flags: dict) -> Callable:
    return lambda params: torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY, **flags)


# ``rounding=`` of our names' suffixes, here and in bench/rounding.py's names: none, the library's default
# (v stochastically, m to nearest); +nearest, the default before it
ROUNDINGS = {"": "auto", "+nearest": "nearest", "+sr": "stochastic",
             "+sr-v": {"exp_avg_sq": "stochastic", "max_exp_avg_sq": "stochastic"}}


def _lowbit(fmt: str, outliers: int) -> Callable:
    """Our AdamW in ``fmt`` with the default rounding (v stochastically); ``<fmt>+nearest`` rounds every
    state to nearest, ``<fmt>+sr`` every state stochastically, ``<fmt>+sr-v`` the second moments
    (``exp_avg_sq``, ``max_exp_avg_sq``) only, as the default does for AdamW."""
    base, sep, suffix = fmt.partition("+")
    if sep + suffix not in ROUNDINGS:
        raise ValueError(f"unknown rounding suffix in {fmt!r}: one of {', '.join(k for k in ROUNDINGS if k)}")

    def make(params):
        from lowbit_compile import lowbit_compile

        return lowbit_compile(torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY), base, outliers=outliers,
                              rounding=ROUNDINGS[sep + suffix])

    return make


def _bnb(params):
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit(params, lr=LR, weight_decay=WEIGHT_DECAY)


def _torchao(cls_name: str) -> Callable:
    def make(params):
        import torchao.optim

        return getattr(torchao.optim, cls_name)(params, lr=LR, weight_decay=WEIGHT_DECAY)

    return make


# The access pattern of an 8-bit step with no math (read p, g and two 1-byte code arrays, write p and
# the codes, one pass, p = p * a + g * b): the floor any 8-bit-state step can reach on this machine.
_FLOOR_SOURCE = r"""
#include <stdint.h>
extern "C" void lowbit_floor(int64_t rows, const int64_t* table, float a, float b, int threads) {
  for (int64_t t = 0; t < rows; ++t) {
    const int64_t* row = table + 5 * t;
    const int64_t n = row[0];
    float* __restrict p = (float*)row[1];
    const float* __restrict g = (const float*)row[2];
    uint8_t* __restrict m = (uint8_t*)row[3];
    uint8_t* __restrict v = (uint8_t*)row[4];
#pragma omp parallel for num_threads(threads) if (threads > 1 && n >= 65536)
    for (int64_t i = 0; i < n; ++i) {
      p[i] = p[i] * a + g[i] * b;
      m[i] = (uint8_t)(m[i] + 1);
      v[i] = (uint8_t)(v[i] * 3);
    }
  }
}
"""


class MemoryFloor:
    """Not an optimizer: one pass of the bytes an 8-bit step must move (fp32 params only), so the
    table shows how close each contender comes to what the memory allows."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        from array import array

        from lowbit_compile.kernels import cpu_build

        self.fn = cpu_build.load(_FLOOR_SOURCE).lowbit_floor
        self.fn.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_float, ctypes.c_int]
        self.param_groups: list[dict] = []
        self.state = {p: {"m": torch.zeros(p.numel(), dtype=torch.uint8),
                          "v": torch.zeros(p.numel(), dtype=torch.uint8)} for p in params}
        self.table = array("q", [x for p, st in self.state.items() for x in (
            p.numel(), p.data_ptr(), p.grad.data_ptr(), st["m"].data_ptr(), st["v"].data_ptr())])

    def step(self) -> None:
        self.fn(len(self.state), self.table.buffer_info()[0], 1.0 - LR * WEIGHT_DECAY, -LR, torch.get_num_threads())


class FP32Copy:
    """Fused fp32 AdamW on fp32 copies of a bf16 section's params and grads: fp32 training, in the same run."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = [torch.nn.Parameter(p.detach().float()) for p in params]
        for p, q in zip(self.params, params):
            p.grad = q.grad.float()
        self.opt = torch.optim.AdamW(self.params, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
        self.param_groups, self.state = self.opt.param_groups, self.opt.state

    def step(self) -> None:
        self.opt.step()


class MasterRecipe:
    """The fp32 master recipe around fused AdamW: the bf16 grads cast into the fp32 copies' grads, a fused
    step of the copies, the bf16 params refreshed from them (what mixed precision runs without us)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.masters = [torch.nn.Parameter(p.detach().float()) for p in params]
        for m in self.masters:
            m.grad = torch.empty_like(m)
        self.opt = torch.optim.AdamW(self.masters, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)
        self.param_groups = self.opt.param_groups

    @property
    def state(self) -> dict:
        return {m: {**self.opt.state.get(m, {}), "master": m} for m in self.masters}

    @torch.no_grad()
    def step(self) -> None:
        torch._foreach_copy_([m.grad for m in self.masters], [p.grad for p in self.params])
        self.opt.step()
        torch._foreach_copy_(self.params, self.masters)


def _lowbit_master(fmt: str, mode: str | None) -> Callable:
    def make(params):
        from lowbit_compile import lowbit_compile

        return lowbit_compile(torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY), fmt, master_weights=mode)

    return make


def master_contenders() -> list[Contender]:
    """For bf16 params: fused fp32 AdamW on fp32 copies (fp32 training), fused bf16 AdamW (no master), the
    fp32 master recipe around fused AdamW, and ours with the default states, without and with master
    weights."""
    torch_fused = Contender("torch AdamW fused", _torch({"fused": True}), "torch", flags={"foreach": False,
                                                                                           "fused": True})
    return [torch_fused,
            Contender("torch AdamW fused, fp32 params", FP32Copy, "copies"),  # own optimizers, not the shared one
            Contender("fp32 master recipe (fused AdamW on fp32 copies)", MasterRecipe, "copies"),
            Contender("lowbit dynamic8, no master", _lowbit_master("dynamic8", None), "lowbit"),
            Contender("lowbit dynamic8 + exact master", _lowbit_master("dynamic8", "exact"), "lowbit"),
            Contender("lowbit dynamic8 + 8bit master", _lowbit_master("dynamic8", "8bit"), "lowbit"),
            Contender("lowbit fp32 states + exact master", _lowbit_master("fp32", "exact"), "lowbit")]


def contenders(peers: set[str], formats: tuple[str, ...]) -> list[Contender]:
    out = [Contender(f"torch AdamW {impl}", _torch({"fused": True}), "torch",
                     flags={"foreach": impl == "foreach", "fused": impl == "fused"})
           for impl in ("for-loop", "foreach", "fused")]
    if "bitsandbytes" in peers:
        out.append(Contender("bitsandbytes AdamW8bit", _bnb, "bitsandbytes"))
    if "torchao" in peers:
        for cls_name in ("AdamW8bit", "AdamWFp8", "AdamW4bit"):
            out.append(Contender(f"torchao {cls_name}", _torchao(cls_name), "torchao", "TORCHINDUCTOR_CACHE_DIR"))
    for fmt in formats:
        patched = fmt.partition("+")[0] not in ("bf16", "fp32")  # formats without blocks have no patches
        out.append(Contender(f"lowbit {fmt}" + (" +patches" if patched else ""), _lowbit(fmt, 2), "lowbit",
                             "LOWBIT_COMPILE_CACHE_DIR"))
        if patched:
            out.append(Contender(f"lowbit {fmt} no patches", _lowbit(fmt, 0), "lowbit", "LOWBIT_COMPILE_CACHE_DIR"))
    out.append(Contender("memory floor (8-bit bytes, no math)", MemoryFloor, "floor"))
    return out


# ---- what a contender holds and moves -----------------------------------------------------------------
def _leaf_tensors(value: object):
    """Plain tensors inside ``value`` (tensor subclasses opened through __tensor_flatten__)."""
    if isinstance(value, torch.Tensor):
        if type(value) is not torch.Tensor and type(value) is not torch.nn.Parameter and hasattr(
                value, "__tensor_flatten__"):
            names, _ = value.__tensor_flatten__()
            for name in names:
                yield from _leaf_tensors(getattr(value, name))
        else:
            yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _leaf_tensors(v)


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of every tensor the optimizer's state holds, each storage counted once (bitsandbytes
    shares its quantization maps between parameters)."""
    seen: dict[tuple[int, int], int] = {}
    for st in opt.state.values():
        for t in _leaf_tensors(st):
            seen[(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())] = t.untyped_storage().nbytes()
    return sum(seen.values())


def stream_bandwidth(threads: int) -> dict[str, float]:
    """GB/s of two streams over 128 MB buffers with this many threads: a copy (8 B/element counted)
    and an in-place scale (8 B/element: the read-modify-write pattern of an optimizer step)."""
    n = 32 * 2**20
    a, b = torch.randn(n), torch.empty(n)
    with torch_threads(threads):
        copy = _best(lambda: b.copy_(a), 5)
        scale = _best(lambda: a.mul_(1.0), 5)
    return {"copy_GBps": 8 * n / copy / 1e9, "inplace_GBps": 8 * n / scale / 1e9}


def _best(fn: Callable, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


@contextlib.contextmanager
def torch_threads(n: int):
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def load_average() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


# ---- one section: a parameter set and dtype, every contender interleaved ----------------------------------
def _median_iqr(values: list[float]) -> tuple[float, float, float]:
    """The median and the first and third quartiles (a single value: itself three times)."""
    med = statistics.median(values)
    if len(values) < 2:
        return med, med, med
    q = statistics.quantiles(values, n=4)
    return med, q[0], q[2]


def run_section(size: str, dtype: torch.dtype, threads_list: list[int], cands: list[Contender], rounds: int,
                log: Callable[[str], None]) -> list[dict]:
    shapes = PARAM_SETS[size]()
    params = make_params(shapes, dtype)
    n = sum(p.numel() for p in params)
    log(f"section {size} ({n / 1e6:.1f}M params in {len(shapes)} tensors) {str(dtype)[6:]}: building optimizers")
    built: list[tuple[Contender, torch.optim.Optimizer]] = []
    shared_torch = None
    for c in cands:
        if c.family == "torch":  # one state for the three torch implementations: they read the same layout
            shared_torch = shared_torch or c.make(params)
            built.append((c, shared_torch))
        else:
            built.append((c, c.make(params)))
    for c, opt in built:  # the first steps: state creation, tracing and compilation
        start = time.perf_counter()
        _step(c, opt)
        _step(c, opt)
        log(f"  warm-up {c.name}: {time.perf_counter() - start:.1f} s")
    # every round hands the optimizers new grad tensors (same values), as zero_grad(set_to_none=True) and a
    # backward do in training: a step that caches anything about a grad pays for finding it changed
    grad_sets = [[p.grad for p in params], [p.grad.clone() for p in params]]
    sections = []
    for threads in threads_list:
        bandwidth = stream_bandwidth(threads)
        load_before = load_average()
        times: dict[str, list[float]] = {c.name: [] for c, _ in built}
        with torch_threads(threads):
            for r in range(rounds):
                for p, g in zip(params, grad_sets[r % 2]):
                    p.grad = g
                order = built[r % len(built):] + built[:r % len(built)]
                for c, opt in order:
                    start = time.perf_counter()
                    _step(c, opt)
                    times[c.name].append(time.perf_counter() - start)
        bandwidth_after = stream_bandwidth(threads)
        stream = max(*bandwidth.values(), *bandwidth_after.values())
        rows = []
        for c, opt in built:
            med, q1, q3 = _median_iqr(times[c.name])
            sbytes = state_bytes(opt)
            minimal = 3 * n * params[0].element_size() + 2 * sbytes
            rows.append({"contender": c.name, "family": c.family, "state_bytes_per_param": sbytes / n,
                         "step_ms_median": med * 1e3, "step_ms_q1": q1 * 1e3, "step_ms_q3": q3 * 1e3,
                         "step_ms_all": [x * 1e3 for x in times[c.name]],
                         "minimal_bytes_per_step": minimal, "GBps": minimal / med / 1e9,
                         "pct_stream": 100 * minimal / med / 1e9 / stream})
        fused = next(r["step_ms_median"] for r in rows if r["contender"] == "torch AdamW fused")
        for row in rows:
            row["x_fused"] = row["step_ms_median"] / fused
            # per round, over the fused step of the same round: what the machine's drift between rounds
            # (frequency, neighbours' memory traffic) moves alike cancels
            paired = [a / b for a, b in zip(times[row["contender"]], times["torch AdamW fused"])]
            row["x_fused_paired"], row["x_fused_paired_q1"], row["x_fused_paired_q3"] = _median_iqr(paired)
        sections.append({"size": size, "params": n, "tensors": len(shapes), "dtype": str(dtype)[6:],
                         "threads": threads, "rounds": rounds, "stream_GBps": stream,
                         "stream_before": bandwidth, "stream_after": bandwidth_after,
                         "load_before": load_before, "load_after": load_average(), "rows": rows})
        log(f"  {threads} thread(s): fused fp32 {fused:.1f} ms, stream {stream:.1f} GB/s, load {load_before}")
    return sections


def _step(c: Contender, opt: torch.optim.Optimizer) -> None:
    for group in opt.param_groups:
        group.update(c.flags)
    opt.step()


# ---- every stock optimizer against its stock twin ------------------------------------------------------
# hyperparameters beyond lr: SGD with momentum (plain SGD has no state to quantize)
OPTIMIZERS = {"Adam": {}, "AdamW": {"weight_decay": WEIGHT_DECAY}, "SGD": {"momentum": 0.9}, "Adagrad": {},
              "Adamax": {}, "NAdam": {}, "RAdam": {}, "RMSprop": {}, "Adadelta": {}, "ASGD": {}, "Rprop": {},
              "Muon": {}}
MATRICES_ONLY = {"Muon"}  # steps 2-D params only: it gets the set's matrices


def stock_twin(cls: type) -> str:
    """``"fused"`` where torch has a fused CPU implementation of ``cls``, else ``"foreach"``, else (Muon)
    ``"for-loop"``."""
    p = torch.nn.Parameter(torch.zeros(8, 8))
    p.grad = torch.ones(8, 8)
    for impl in ("fused", "foreach"):
        try:
            cls([p], lr=LR, **{impl: True}).step()
        except (RuntimeError, ValueError, TypeError):
            continue
        return impl
    return "for-loop"


def kernel_backends(opt: torch.optim.Optimizer) -> set[str]:
    """The backends that stepped each parameter of a wrapped optimizer (``"cpu"``: the fused C++ kernel)."""
    return {prepared.compiled.kernel.backend for prepared in opt._lowbit.prepared.values()}


def run_optimizers(size: str, names: list[str], threads: int, rounds: int, formats: tuple[str, ...],
                   log: Callable[[str], None]) -> dict:
    """Each optimizer's step: its stock twin and ours in ``formats``, interleaved in rounds on one set of
    params; raises if a parameter of ours ran anywhere but the fused CPU kernel."""
    from lowbit_compile import lowbit_compile

    shapes = PARAM_SETS[size]()
    params = make_params(shapes, torch.float32)
    n = sum(p.numel() for p in params)
    log(f"every optimizer, {size} ({n / 1e6:.1f}M fp32 params in {len(shapes)} tensors), {threads} thread(s)")
    rows = []
    with torch_threads(threads):
        for name in names:
            cls, kwargs = getattr(torch.optim, name), OPTIMIZERS[name]
            impl = stock_twin(cls)
            ps = [p for p in params if p.dim() == 2] if name in MATRICES_ONLY else params
            n_stepped = sum(p.numel() for p in ps)
            built = [(f"torch {impl}", cls(ps, lr=LR, **kwargs, **({impl: True} if impl != "for-loop" else {})))]
            built += [(f"lowbit {fmt}", lowbit_compile(cls(ps, lr=LR, **kwargs), fmt)) for fmt in formats]
            for _, opt in built:
                opt.step()
                opt.step()
            for label, opt in built[1:]:
                backends = kernel_backends(opt)
                if backends != {"cpu"}:
                    raise RuntimeError(f"{name} {label} ran on {sorted(backends)}, not only the fused CPU kernel")
            times: dict[str, list[float]] = {label: [] for label, _ in built}
            for r in range(rounds):
                for label, opt in built[r % len(built):] + built[:r % len(built)]:
                    start = time.perf_counter()
                    opt.step()
                    times[label].append(time.perf_counter() - start)
            med = {label: statistics.median(t) * 1e3 for label, t in times.items()}
            twin = med[f"torch {impl}"]
            row = {"optimizer": name, "kwargs": dict(kwargs), "twin": impl, "twin_ms": twin,
                   "formats": {fmt: {"ms": med[f"lowbit {fmt}"], "x_twin": med[f"lowbit {fmt}"] / twin,
                                     "state_bytes_per_param": state_bytes(o) / n_stepped, "backends": ["cpu"]}
                               for fmt, (_, o) in zip(formats, built[1:])},
                   "twin_state_bytes_per_param": state_bytes(built[0][1]) / n_stepped,
                   "step_ms_all": {label: [x * 1e3 for x in t] for label, t in times.items()}}
            row["params"] = n_stepped
            rows.append(row)
            log(f"  {name}: torch {impl} {twin:.1f} ms; " + ", ".join(
                f"{fmt} {f['ms']:.1f} ms ({f['x_twin']:.2f}x)" for fmt, f in row["formats"].items()))
            del built
    return {"size": size, "params": n, "tensors": len(shapes), "threads": threads, "rounds": rounds,
            "formats": list(formats), "rows": rows}


def optimizers_markdown(result: dict) -> str:
    s = result["optimizers"]
    meta = result["machine"]
    fmts = s["formats"]
    lines = [f"# Every stock optimizer: our CPU kernel against its stock twin ({s['size']}: {s['params'] / 1e6:.1f}M "
             f"fp32 params in {s['tensors']} tensors, {s['threads']} thread(s))", "",
             f"{meta['cpu']}, {meta['cores']} cores, torch {meta['torch']}; {result['date']}; load averages "
             f"{meta['load_start']} -> {meta.get('load_end')}. Medians of {s['rounds']} interleaved rounds; every "
             "parameter of ours ran in the fused CPU kernel (checked).", "",
             "| optimizer | stock twin | twin ms | " + " | ".join(f"ours {f} ms | x twin" for f in fmts) + " |",
             "|---|---|---:|" + "---:|---:|" * len(fmts)]
    for r in s["rows"]:
        lines.append(f"| {r['optimizer']} | {r['twin']} | {r['twin_ms']:.1f} | " + " | ".join(
            f"{r['formats'][f]['ms']:.1f} | {r['formats'][f]['x_twin']:.2f}" for f in fmts) + " |")
    return "\n".join(lines) + "\n"


# ---- first step and peak memory, in a fresh process ---------------------------------------------------
def child(args: argparse.Namespace) -> None:
    """One contender in this fresh process: time its first step, then the peak extra resident memory
    of a steady step (the kernel's high-water mark, reset just before it)."""
    torch.set_num_threads(args.threads)
    formats = tuple(args.formats.split(",")) if args.formats else FORMATS  # the parent's
    cand = next(c for c in contenders({"bitsandbytes", "torchao"}, formats) if c.name == args.child)
    params = make_params(PARAM_SETS[args.size](), getattr(torch, args.dtype))
    opt = cand.make(params)
    start = time.perf_counter()
    _step(cand, opt)
    first = time.perf_counter() - start
    for _ in range(2):
        _step(cand, opt)
    rss = _status("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak resident set size
    _step(cand, opt)
    peak = _status("VmHWM") - rss
    n = sum(p.numel() for p in params)
    print(json.dumps({"first_step_s": first, "peak_extra_bytes": peak, "fp32_state_bytes": 8 * n}))


def _status(field_name: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field_name)


def first_steps(cands: list[Contender], size: str, dtype: str, log: Callable[[str], None],
                formats: tuple[str, ...] = FORMATS) -> dict[str, dict]:
    out = {}
    for c in cands:
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ)
            if c.cache_env:
                env[c.cache_env] = cache
            runs = []
            for temperature in ("cold", "warm"):
                cmd = [sys.executable, __file__, "--child", c.name, "--size", size, "--dtype", dtype, "--threads", "1",
                       "--formats", ",".join(formats)]
                done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
                if done.returncode != 0:
                    raise RuntimeError(f"{c.name} failed in a fresh process:\n{done.stderr[-3000:]}")
                runs.append((temperature, json.loads(done.stdout.strip().splitlines()[-1])))
            (_, cold), (_, warm) = runs
            out[c.name] = r = {"first_step_cold_s": cold["first_step_s"], "first_step_warm_s": warm["first_step_s"],
                               "peak_extra_bytes": warm["peak_extra_bytes"],
                               "peak_extra_pct_fp32_state": 100 * warm["peak_extra_bytes"] / warm["fp32_state_bytes"]}
            log(f"  first step {c.name}: cold {r['first_step_cold_s']:.2f} s, warm {r['first_step_warm_s']:.2f} s, "
                f"peak extra {r['peak_extra_bytes'] / 2**20:.1f} MB")
    return out


# ---- report -----------------------------------------------------------------------------------------
def _paired(row: dict) -> str:
    """The median per-round ratio to fused fp32 with its IQR (results from before it was recorded: blank)."""
    if "x_fused_paired" not in row:
        return ""
    return f"{row['x_fused_paired']:.2f} ({row['x_fused_paired_q1']:.2f}-{row['x_fused_paired_q3']:.2f})"


def markdown(result: dict) -> str:
    meta = result["machine"]
    lines = [f"# Optimizer step benchmark ({result['mode']})", "",
             f"{meta['cpu']}, {meta['cores']} cores, torch {meta['torch']}, "
             f"{', '.join(f'{k} {v}' for k, v in meta['versions'].items())}; {result['date']}.",
             f"Load averages (1/5/15 min) at start {meta['load_start']}, at end {meta['load_end']}.", ""]
    firsts = result.get("first_steps", {})

    def holds_first_steps(s: dict) -> bool:  # the section whose rows the first-step columns belong to
        return s["size"] == result.get("first_step_size") and s["dtype"] == "float32" and s["threads"] == 1

    for s in result["sections"]:
        lines += [f"## {s['size']}: {s['params'] / 1e6:.1f}M {s['dtype']} params in {s['tensors']} tensors, "
                  f"{s['threads']} thread(s)", "",
                  f"Stream bandwidth in this section {s['stream_GBps']:.1f} GB/s; load {s['load_before']} -> "
                  f"{s['load_after']}; {s['rounds']} interleaved rounds.", "",
                  "| contender | state B/param | step ms (median) | IQR ms | x torch fused | x fused, paired (IQR) "
                  "| GB/s | % stream | first step cold s | warm s | peak extra MB (% fp32 state) |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in s["rows"]:
            f = firsts.get(r["contender"]) if holds_first_steps(s) else None
            fs = (f"{f['first_step_cold_s']:.2f} | {f['first_step_warm_s']:.2f} | "
                  f"{f['peak_extra_bytes'] / 2**20:.1f} ({f['peak_extra_pct_fp32_state']:.2f}%)") if f else " | | "
            lines.append(f"| {r['contender']} | {r['state_bytes_per_param']:.3f} | {r['step_ms_median']:.1f} | "
                         f"{r['step_ms_q1']:.1f}-{r['step_ms_q3']:.1f} | {r['x_fused']:.2f} | {_paired(r)} | "
                         f"{r['GBps']:.1f} | "
                         f"{r['pct_stream']:.0f} | {fs} |")
        lines.append("")
    if firsts and not any(holds_first_steps(s) for s in result["sections"]):  # a table of their own
        lines += [f"## First step: {result['first_step_size']} float32 params, 1 thread, fresh processes", "",
                  "| contender | first step cold s | warm s | peak extra MB (% fp32 state) |", "|---|---:|---:|---:|"]
        lines += [f"| {name} | {f['first_step_cold_s']:.2f} | {f['first_step_warm_s']:.2f} | "
                  f"{f['peak_extra_bytes'] / 2**20:.1f} ({f['peak_extra_pct_fp32_state']:.2f}%) |"
                  for name, f in firsts.items()]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="6M params, fp32, 1 thread, 3 rounds, no torchao")
    parser.add_argument("--sizes", default=None, help="comma list of " + ",".join(PARAM_SETS))
    parser.add_argument("--dtypes", default=None, help="comma list of float32,bfloat16")
    parser.add_argument("--threads", default=None, help="comma list of thread counts")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--formats", default=None, help="lowbit formats, comma list (<fmt>: the default rounding, v "
                        "stochastic; <fmt>+nearest: every state to nearest; <fmt>+sr: every state stochastic)")
    parser.add_argument("--peers", default=None,
                        help="comma list of bitsandbytes,torchao, or none (default: those installed)")
    parser.add_argument("--no-first-step", action="store_true", help="skip the fresh-process measurements")
    parser.add_argument("--master", action="store_true",
                        help="bf16 params (25M, 1 and 2 threads): master weights against fused fp32 and bf16 AdamW")
    parser.add_argument("--optimizers", default="AdamW",
                        help="AdamW (the default: the full AdamW comparison), or 'all' or a comma list of "
                             f"{','.join(OPTIMIZERS)}: each against its stock fused/foreach twin")
    parser.add_argument("--isa", choices=("native", "avx2"), default="native",
                        help="avx2: build our kernels without AVX-512 (-mno-avx512f), the AVX2 column on an "
                             "AVX-512 machine")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--size", help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.isa == "avx2":
        force_avx2()
    if args.child:
        args.threads = int(args.threads)
        child(args)
        return

    if args.optimizers != "AdamW":
        optimizers_main(args)
        return
    quick = args.quick
    if args.master:
        return master_main(args)
    sizes = (args.sizes or ("6M" if quick else "25M,100M,small500")).split(",")
    dtypes = (args.dtypes or ("float32" if quick else "float32,bfloat16")).split(",")
    threads = [int(t) for t in (args.threads or ("1" if quick else "1,2")).split(",")]
    rounds = args.rounds or (3 if quick else 10)
    formats = tuple((args.formats or ("int8,fp8_e4m3,fp32" if quick else ",".join(FORMATS))).split(","))
    installed = {name for name in ("bitsandbytes", "torchao") if _importable(name)}
    peers = set(args.peers.split(",")) - {"none"} if args.peers else (installed - ({"torchao"} if quick else set()))
    if unknown := sorted(peers - {"bitsandbytes", "torchao"}):
        parser.error(f"--peers: unknown {unknown}; choose bitsandbytes, torchao or none")
    cands = contenders(peers, formats)
    RESULTS.mkdir(exist_ok=True)
    base = _result_base("", sizes)
    log = _logger(base.with_suffix(".log"))

    result = {"mode": "quick" if quick else "full", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": {
        "cpu": _cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__, "load_start": load_average(),
        "versions": {name: _version(name) for name in sorted(peers | {"lowbit_compile"})}}, "sections": []}
    for size in sizes:
        for dtype in dtypes:
            if size == "small500" and dtype != "float32":
                continue
            # tensors under 4096 elements keep fp32 states in every 8-bit optimizer: the stock ones and ours
            section_cands = [c for c in cands if (size != "small500" or c.name in SMALL_SET)
                             and (c.family != "floor" or dtype == "float32")]
            result["sections"] += run_section(size, getattr(torch, dtype), threads if size != "small500" else [1],
                                              section_cands, rounds, log)
            _write(result, base)
    if not args.no_first_step:
        first_size = "6M" if quick else "25M"
        result["first_step_size"] = first_size
        log(f"first steps in fresh processes ({first_size}, float32, 1 thread)")
        pick = [c for c in cands if c.family != "floor"
                and (not quick or c.name in ("torch AdamW fused", "lowbit int8 +patches"))]
        result["first_steps"] = first_steps(pick, first_size, "float32", log, formats)
    result["machine"]["load_end"] = load_average()
    _write(result, base)
    print(markdown(result))


def master_main(args: argparse.Namespace) -> None:
    """The ``--master`` sections: bf16 params, every contender of ``master_contenders`` interleaved."""
    sizes = (args.sizes or "25M").split(",")
    threads = [int(t) for t in (args.threads or "1,2").split(",")]
    rounds = args.rounds or 10
    RESULTS.mkdir(exist_ok=True)
    base = _result_base("master", sizes)
    log = _logger(base.with_suffix(".log"))

    result = {"mode": "master weights", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": {
        "cpu": _cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__, "load_start": load_average(),
        "versions": {"lowbit_compile": _version("lowbit_compile")}}, "sections": []}
    for size in sizes:
        result["sections"] += run_section(size, torch.bfloat16, threads, master_contenders(), rounds, log)
    result["machine"]["load_end"] = load_average()
    for section in result["sections"]:  # the ratio to fp32 training, next to the one to fused bf16 AdamW
        fp32 = next(r["step_ms_median"] for r in section["rows"] if r["contender"] == "torch AdamW fused, fp32 params")
        for row in section["rows"]:
            row["x_fused_fp32"] = row["step_ms_median"] / fp32
    base.with_suffix(".json").write_text(json.dumps(result, indent=1))
    text = markdown(result) + "\n" + "\n".join(
        f"- {s['size']}, {s['threads']} thread(s): " + "; ".join(
            f"{r['contender']} {r['x_fused_fp32']:.2f}x" for r in s["rows"]) for s in result["sections"])
    text += ("\n\n(x fused fp32 AdamW on fp32 copies of the same values; 'x torch fused' in the tables is fused "
             "AdamW on the bf16 params. State B/param counts the recipe's fp32 copies; GB/s assumes 2-byte p "
             "and g for every row.)\n")
    base.with_suffix(".md").write_text(text)
    print(text)


def _logger(path: Path) -> Callable[[str], None]:
    """Print a line and append it to ``path`` (emptied first: the log of this run only)."""
    path.write_text("")
    def log(msg: str) -> None:
        print(msg, flush=True)
        with path.open("a") as f:
            f.write(msg + "\n")

    return log


def optimizers_main(args: argparse.Namespace) -> None:
    names = list(OPTIMIZERS) if args.optimizers == "all" else args.optimizers.split(",")
    unknown = [n for n in names if n not in OPTIMIZERS]
    if unknown:
        raise SystemExit(f"--optimizers: unknown {unknown}; pick from {','.join(OPTIMIZERS)} or 'all'")
    from lowbit_compile.config import DEFAULT_FMT

    formats = tuple((args.formats or f"{DEFAULT_FMT},int8").split(","))
    size = (args.sizes or "12M").split(",")[0]
    threads = int((args.threads or "1").split(",")[0])
    RESULTS.mkdir(exist_ok=True)
    result = {"mode": "optimizers", "date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": {
        "cpu": _cpu_name(), "cores": os.cpu_count(), "torch": torch.__version__, "load_start": load_average()}}
    result["optimizers"] = run_optimizers(size, names, threads, args.rounds or 7, formats, print)
    result["machine"]["load_end"] = load_average()
    base = _result_base("optimizers", [size])
    base.with_suffix(".json").write_text(json.dumps(result, indent=1))
    text = optimizers_markdown(result)
    base.with_suffix(".md").write_text(text)
    print(text)


def _write(result: dict, base: Path) -> None:
    """The run's JSON, markdown and plot (``base`` + suffix), replacing the last run's of the same configuration
    (:func:`_result_base`)."""
    result["machine"].setdefault("load_end", load_average())
    base.with_suffix(".json").write_text(json.dumps(result, indent=1))
    base.with_suffix(".md").write_text(markdown(result))
    plot(result, base.with_suffix(".png"))


def plot(result: dict, path: Path) -> None:
    """One panel per section: each contender's step over torch's fused fp32 AdamW (the paired median
    with its IQR, log scale), fused at 1 and the memory floor dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sections = result["sections"]
    names = [r["contender"] for r in max(sections, key=lambda s: len(s["rows"]))["rows"]]
    fig, axes = plt.subplots(1, len(sections), figsize=(4.2 * len(sections) + 2.5, 0.28 * len(names) + 1.4),
                             sharey=True, squeeze=False)
    colors = {"torch": "tab:gray", "bitsandbytes": "tab:orange", "torchao": "tab:red", "lowbit": "tab:blue",
              "floor": "black"}
    for ax, s in zip(axes[0], sections):
        by_name = {r["contender"]: r for r in s["rows"]}
        for y, name in enumerate(names):
            r = by_name.get(name)
            if r is None:
                continue
            x = r.get("x_fused_paired", r["x_fused"])
            lo, hi = r.get("x_fused_paired_q1", x), r.get("x_fused_paired_q3", x)
            ax.barh(y, x, color=colors.get(r["family"], "tab:green"), alpha=0.8)
            ax.errorbar(x, y, xerr=[[x - lo], [hi - x]], fmt="none", color="black", lw=0.8)
        floor = next((r for r in s["rows"] if r["family"] == "floor"), None)
        if floor:
            ax.axvline(floor.get("x_fused_paired", floor["x_fused"]), color="black", ls="--", lw=1)
        ax.axvline(1.0, color="gray", lw=1)
        ax.set_xscale("log")
        ax.set_title(f"{s['size']} {s['dtype']}, {s['threads']} thread(s)", fontsize=9)
        ax.set_xlabel("x torch fused AdamW (paired median, IQR)", fontsize=8)
    axes[0][0].set_yticks(range(len(names)), names, fontsize=7)
    axes[0][0].invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _importable(name: str) -> bool:
    try:
        __import__(name)
    except Exception:
        return False
    return True


def _version(name: str) -> str:
    try:
        from importlib.metadata import version

        return version(name.replace("_", "-"))
    except Exception:
        return "?"


_KERNEL_ISA = ""  # "AVX2" where --isa avx2 built our kernels without AVX-512


def force_avx2() -> None:
    """Build every kernel of ours in this process without AVX-512 (as an AVX2-only machine would), whatever
    the CPU has; the cache keys include the flags, so native builds are not reused."""
    global _KERNEL_ISA
    from lowbit_compile.kernels import cpu_build

    native = cpu_build.load_async
    cpu_build.load_async = lambda source, extra_flags=(): native(source, (*extra_flags, "-mno-avx512f"))
    _KERNEL_ISA = "AVX2"


def _result_base(mode: str, sizes: list[str]) -> Path:
    """Where a run's files go, named by its configuration: the mode (the main table, ``optimizers``, ``master``),
    what our kernels are built for (``avx2`` under ``--isa avx2``, else the CPU's: ``avx512``, ``avx2``,
    ``default``) and the sizes: ``step_bench_avx512_100M``. One current result per configuration; a run
    replaces the last one's (older runs are in git)."""
    isa = (_KERNEL_ISA or torch.backends.cpu.get_cpu_capability()).lower()
    return RESULTS / "_".join(["step_bench", *([mode] if mode else []), isa, "-".join(sizes)])


def _cpu_name() -> str:
    kernels = f", our kernels built for {_KERNEL_ISA}" if _KERNEL_ISA else ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() + f" ({torch.backends.cpu.get_cpu_capability()}{kernels})"
    return platform.processor()


if __name__ == "__main__":
    main()
