"""The prepared GPU check of the fused Triton step (issue 3): correctness against the reference lowering
on the GPU (fp8 states on both FP8 paths where the GPU has fp8 conversions: float8 and integer bits),
then the step time of AdamW at 1e9 and 1e8 params against torch's fused AdamW, bitsandbytes AdamW8bit
and torchao AdamW8bit/AdamWFp8, with fp32 and bf16 params (our fp8 formats on both paths).

    python bench/gpu_check.py --out gpu_check.json      # one H200: under 8 minutes
    python bench/gpu_check.py --device cpu --dry-run    # here: same code paths, tiny sizes, Triton interpreter

On a fresh machine install the checkout first (offline is fine): ``pip install --no-deps
--no-build-isolation -e .``; bitsandbytes and torchao are timed where they import.

Times are medians over CUDA events around ``opt.step()`` (warm-up steps first, which compile). Each
method is judged by the bytes a step must move at the least (param read+write, grad read, states
read+write, per-block scales and patches), as GB/s and as % of the measured device-to-device copy
bandwidth (bytes read + written). A peer that does not import is skipped with a message; a budget
stops the timing before the time runs out and says what it skipped. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1:][:1] == ["cpu"] \
        and os.environ.get("TRITON_INTERPRET") != "1":
    # CPU tensors run Triton kernels only in the interpreter, which must be on before triton is imported
    os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "TRITON_INTERPRET": "1"})

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file from a checkout

import torch  # noqa: E402

from bench.quantized_contract import assert_codes_within_one_step  # noqa: E402
from lowbit_compile import lowbit_compile  # noqa: E402
from lowbit_compile.config import DEFAULT_BLOCK_SIZE, DEFAULT_FMT, DEFAULT_OUTLIERS, own_block_size  # noqa: E402
from lowbit_compile.formats import StateFormat, blockquant  # noqa: E402
from lowbit_compile.kernels import triton_backend  # noqa: E402

FORMATS = ("int8", "dynamic8", "sqrt8", "fp8_e4m3", "fp8_e5m2", "bf16", "sqrt4")
LR, WEIGHT_DECAY = 1e-3, 0.1


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    started = time.perf_counter()
    device = torch.device(args.device)
    report: dict = {"env": environment(device), "args": vars(args), "skipped": []}
    print(f"# {report['env']['device_name']}, torch {torch.__version__}, triton {report['env']['triton']}")

    report["copy_GBps"] = copy_bandwidth(device, args.copy_bytes)
    print(f"copy bandwidth: {report['copy_GBps']:.4g} GB/s (read + written)")

    report["correctness"] = check_correctness(device, args)
    report["correct"] = all(c["ok"] for c in report["correctness"])
    print(f"correctness: {'all ok' if report['correct'] else 'MISMATCHES (see JSON)'}")

    deadline = started + args.budget
    report["timing"] = []
    for size in args.sizes:
        for dtype in (torch.float32, torch.bfloat16):
            for name, make in methods(args, device):
                if time.perf_counter() > deadline:
                    report["skipped"].append(f"{name} {size:.0e} {dtype}: time budget spent")
                    continue
                row = time_method(name, make, int(size), dtype, device, args, report["copy_GBps"])
                if "skipped" in row:
                    report["skipped"].append(row["skipped"])
                    print(row["skipped"])
                else:
                    report["timing"].append(row)
                    print(f"{name:24s} {int(size):.0e} {str(dtype)[6:]:9s} {row['median_ms']:9.3f} ms "
                          f"{row['GBps']:7.0f} GB/s {row['pct_of_copy']:5.1f}%")
    add_speedups(report["timing"])
    report["model"] = time_model(device, args, deadline)
    report["launch_sweep"] = sweep_launches(device, args, report["copy_GBps"], deadline)
    report["seconds"] = time.perf_counter() - started
    print(table(report))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1, default=str))
        print(f"wrote {args.out}")
    return report


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--dry-run", action="store_true", help="tiny sizes and few steps: check the script runs")
    p.add_argument("--sizes", type=float, nargs="+", help="params per step (default 1e9 1e8; dry run 4396)")
    p.add_argument("--tensors", type=int, default=2, help="the params are split into this many equal tensors")
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS, help="our formats to time")
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES), help="correctness cases")
    p.add_argument("--steps", type=int, help="timed steps per method (default 15; dry run 2)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (compiles happen here)")
    p.add_argument("--skip-peers", action="store_true", help="time only torch's fused AdamW and ours")
    p.add_argument("--budget", type=float, default=420.0, help="seconds after which timing stops")
    p.add_argument("--model-steps", type=int, help="timed training steps of the Llama (default 10; dry run 2)")
    p.add_argument("--out", help="write the JSON report here")
    args = p.parse_args(argv)
    if args.sizes is None:
        args.sizes = [4396] if args.dry_run else [1e9, 1e8]
    if args.steps is None:
        args.steps = 2 if args.dry_run else 15
    if args.model_steps is None:
        args.model_steps = 2 if args.dry_run else 10
    if args.dry_run:
        args.warmup = min(args.warmup, 1)
    args.copy_bytes = 2**20 if args.dry_run else 2**32
    # a partial last block; on CPU a multiple of 64, where eager ATen's reduced-precision vector loop has no
    # scalar tail that rounds differently (see tests/test_triton_step.py)
    args.check_numel = 256 * 3 + 64 if args.dry_run else 2**20 + 12345
    return args


def environment(device: torch.device) -> dict:
    import triton

    env = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
           "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
           "interpreter": triton_backend.interpreting(), "fp8_paths": [_path_name(n) for n in fp8_paths(device)]}
    if device.type == "cuda":
        env["capability"] = ".".join(map(str, torch.cuda.get_device_capability(device)))
    for peer in ("bitsandbytes", "torchao"):
        try:
            env[peer] = __import__(peer).__version__
        except Exception as e:  # a missing or broken peer is skipped, not fatal
            env[peer] = f"unavailable: {type(e).__name__}: {e}"
    return env


# timing --------------------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], steps: int, device: torch.device) -> list[float]:
    """Milliseconds of each call: CUDA events on a GPU, the wall clock elsewhere."""
    sync(device)
    if device.type != "cuda":
        out = []
        for _ in range(steps):
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1e3)
        return out
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    sync(device)
    return [start.elapsed_time(end) for start, end in events]


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    ms = statistics.median(timed(lambda: dst.copy_(src), 20, device))
    return 2 * nbytes / (ms * 1e-3) / 1e9


def methods(args: argparse.Namespace, device: torch.device) -> list[tuple[str, Callable]]:
    """(name, build optimizer from params) for every method to time, in order."""
    out: list[tuple[str, Callable]] = [
        ("torch_adamw_fused", lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)),
    ]
    if not args.skip_peers:
        out += [("bnb_adamw8bit", _bnb), ("torchao_adamw8bit", _torchao("AdamW8bit")),
                ("torchao_adamw_fp8", _torchao("AdamWFp8"))]
    for fmt in args.formats:
        out.append((f"lowbit_{fmt}", _ours(fmt)))
        if fmt.startswith("fp8") and len(fp8_paths(device)) > 1:  # what a GPU without fp8 conversions runs
            out.append((f"lowbit_{fmt}{INT_FP8}", _ours(fmt, fp8_native=False)))
    return out


INT_FP8 = "_int-fp8"  # suffix of a method or check run on the integer FP8 path


def fp8_paths(device: torch.device) -> list[bool]:
    """The FP8 paths this device runs: the integer one always, float8 where its conversions exist."""
    return [True, False] if triton_backend.fp8_native_for(device) else [False]


def _path_name(native: bool) -> str:
    return "float8" if native else "int-fp8"


@contextlib.contextmanager
def fp8_path(native: bool | None):
    """Kernels built and stepped inside take this FP8 path (None: the device's own)."""
    before = triton_backend.FP8_PATH["native"]
    triton_backend.FP8_PATH["native"] = native
    try:
        yield
    finally:
        triton_backend.FP8_PATH["native"] = before


class _OnFp8Path:
    """An optimizer whose every step runs on one FP8 path (the path is picked at each launch)."""

    def __init__(self, opt: torch.optim.Optimizer, native: bool) -> None:
        self.opt, self.native = opt, native

    def step(self) -> None:
        with fp8_path(self.native):
            self.opt.step()


def _bnb(params):
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit(params, lr=LR, weight_decay=WEIGHT_DECAY)


def _torchao(name: str) -> Callable:
    def make(params):
        import torchao.optim

        return getattr(torchao.optim, name)(params, lr=LR, weight_decay=WEIGHT_DECAY)
    return make


def _ours(fmt: str, block_size: int | None = None, fp8_native: bool | None = None) -> Callable:
    """Our AdamW in ``fmt`` on Triton, in blocks of ``block_size`` (None: the format's own)."""
    def make(params):
        opt = torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)
        opt = lowbit_compile(opt, fmt=fmt, block_size=block_size, backend="triton")
        return opt if fp8_native is None else _OnFp8Path(opt, fp8_native)
    return make


def sweep_launches(device: torch.device, args: argparse.Namespace, copy_gbps: float, deadline: float) -> list[dict]:
    """Our int8 step with fp32 params at the smallest size, over block sizes and warps per program:
    what to tune next (the default is the library's block size with the warps ``triton_backend`` picks)."""
    rows = []
    size = int(min(args.sizes))
    configs = [(512, 4)] if args.dry_run else [(512, 4), (512, 8), (2048, 4), (2048, 8), (256, 4), (256, 8)]
    for block, warps in configs:
        if time.perf_counter() > deadline:
            rows.append({"block_size": block, "num_warps": warps, "skipped": "time budget spent"})
            continue
        triton_backend.LAUNCH_OPTIONS["num_warps"] = warps
        try:
            row = time_method("lowbit_int8", _ours("int8", block), size, torch.float32, device, args, copy_gbps,
                              block)
        finally:
            triton_backend.LAUNCH_OPTIONS["num_warps"] = None
        rows.append({"block_size": block, "num_warps": warps, **row})
        if "median_ms" in row:
            print(f"sweep block {block:5d} warps {warps:2d}: {row['median_ms']:.3f} ms, "
                  f"{row['pct_of_copy']:.1f}% of copy")
    return rows


def bytes_per_param(name: str, dtype: torch.dtype, block_size: int | None = None) -> float:
    """The least a step can move per param: param read + write, grad read, states read + write (a 4-bit
    code half a byte), and the per-block scales (fp32) and patches (bf16 value + int16 offset) read +
    written; blocks of ``block_size`` (None: the format's own)."""
    p = torch.finfo(dtype).bits // 8
    base = 3 * p
    if name == "torch_adamw_fused":
        return base + 2 * 2 * p  # stock states keep the param dtype
    if name.startswith(("bnb", "torchao")):
        return base + 2 * 2 * 1 + 2 * 2 * 4 / 256  # 8-bit codes, an fp32 absmax per 256
    fmt_name = name.removeprefix("lowbit_").removesuffix(INT_FP8)
    fmt = StateFormat.make(fmt_name, block_size or own_block_size(fmt_name), DEFAULT_OUTLIERS, False)
    codes = fmt.bits / 8
    per_block = 2 * (4 + fmt.patches * 4) / fmt.block_size if fmt.blockwise else 0.0
    return base + 2 * (2 * codes + per_block)


def time_method(name: str, make: Callable, size: int, dtype: torch.dtype, device: torch.device,
                args: argparse.Namespace, copy_gbps: float, block_size: int | None = None) -> dict:
    label = f"{name} {size:.0e} {str(dtype)[6:]}"
    if device.type != "cuda" and not (name.startswith("lowbit") or name == "torch_adamw_fused"):
        return {"skipped": f"{label}: peers are timed on CUDA only"}
    params = []
    try:
        per = -(-size // args.tensors)
        params = [torch.nn.Parameter(torch.empty(min(per, size - i), dtype=dtype, device=device).normal_(0, 0.02))
                  for i in range(0, size, per)]
        for p in params:
            p.grad = torch.empty_like(p).normal_(0, 1e-3)
        opt = make(params)
        for _ in range(args.warmup):
            opt.step()
        ms = timed(opt.step, args.steps, device)
    except Exception as e:  # a peer that is missing or fails is reported, the run goes on
        return {"skipped": f"{label}: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
    finally:
        del params
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    median = statistics.median(ms)
    per_param = bytes_per_param(name, dtype, block_size)
    gbps = per_param * size / (median * 1e-3) / 1e9
    return {"method": name, "size": size, "param_dtype": str(dtype)[6:], "median_ms": median,
            "min_ms": min(ms), "max_ms": max(ms), "bytes_per_param": per_param, "GBps": gbps,
            "pct_of_copy": 100 * gbps / copy_gbps}


# a real model --------------------------------------------------------------------------------------
# a 0.95B-parameter Llama (untied 32k embeddings, 16 layers of width 2048), or a tiny one for the dry run
LLAMA = {"vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 16,
         "num_attention_heads": 16, "num_key_value_heads": 16, "max_position_embeddings": 1024}
LLAMA_TINY = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 64}


def model_methods(args: argparse.Namespace) -> list[tuple[str, Callable]]:
    """Stock fused AdamW, ours with the default format, and the peers (where they import)."""
    out: list[tuple[str, Callable]] = [
        ("torch_adamw_fused", lambda ps: torch.optim.AdamW(ps, lr=LR, weight_decay=WEIGHT_DECAY, fused=True)),
        (f"lowbit_{DEFAULT_FMT}", _ours(DEFAULT_FMT)),
    ]
    if not args.skip_peers:
        out += [("bnb_adamw8bit", _bnb), ("torchao_adamw8bit", _torchao("AdamW8bit")),
                ("torchao_adamw_fp8", _torchao("AdamWFp8"))]
    return out


def time_model(device: torch.device, args: argparse.Namespace, deadline: float) -> list[dict]:
    """Training steps of a transformers Llama built from its config (no download) under bf16 autocast,
    with fp32 and with bf16 params: the optimizer step's median ms (after warm-up steps) and the peak
    memory allocated over a whole training step (forward, backward, step; CUDA only), per method."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**(LLAMA_TINY if args.dry_run else LLAMA))
    batch, seq = (2, 16) if args.dry_run else (4, 512)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        for name, make in model_methods(args):
            label = f"llama {name} {str(dtype)[6:]}"
            if time.perf_counter() > deadline:
                rows.append({"method": name, "param_dtype": str(dtype)[6:], "skipped": "time budget spent"})
                continue
            if device.type != "cuda" and not (name.startswith("lowbit") or name == "torch_adamw_fused"):
                rows.append({"method": name, "param_dtype": str(dtype)[6:], "skipped": "peers run on CUDA only"})
                continue
            model = opt = None
            try:
                torch.manual_seed(0)
                model = LlamaForCausalLM(config).to(device=device, dtype=dtype)
                opt = make(list(model.parameters()))
                tokens = torch.randint(0, config.vocab_size, (batch, seq), device=device)
                step_ms, losses = [], []
                for i in range(args.warmup + args.model_steps):
                    if device.type == "cuda" and i == args.warmup:
                        torch.cuda.reset_peak_memory_stats(device)
                    with torch.autocast(device.type, dtype=torch.bfloat16):
                        loss = model(input_ids=tokens, labels=tokens).loss
                    loss.backward()
                    ms = timed(opt.step, 1, device)[0]
                    model.zero_grad(set_to_none=True)
                    losses.append(float(loss.detach()))
                    if i >= args.warmup:
                        step_ms.append(ms)
                row = {"method": name, "param_dtype": str(dtype)[6:],
                       "params": sum(p.numel() for p in model.parameters()), "step_ms": statistics.median(step_ms),
                       "peak_GiB": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
                       "first_loss": losses[0], "last_loss": losses[-1]}
                peak = f"{row['peak_GiB']:.2f} GiB" if row["peak_GiB"] is not None else "-"
                print(f"{label:40s} step {row['step_ms']:8.3f} ms, peak {peak}, "
                      f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
            except Exception as e:  # a peer that is missing or fails is reported, the run goes on
                row = {"method": name, "param_dtype": str(dtype)[6:],
                       "skipped": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
                print(f"{label}: skipped: {row['skipped']}")
            finally:
                model = opt = None
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            rows.append(row)
    return rows


def add_speedups(rows: list[dict]) -> None:
    """Each row's speedup over torch's fused AdamW with fp32 params at the same size."""
    base = {r["size"]: r["median_ms"] for r in rows
            if r["method"] == "torch_adamw_fused" and r["param_dtype"] == "float32"}
    for r in rows:
        if r["size"] in base:
            r["speedup_vs_torch_fused_fp32"] = base[r["size"]] / r["median_ms"]


def table(report: dict) -> str:
    lines = ["| method | params | param dtype | ms/step | B/param | GB/s | % copy | x fused fp32 |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in report["timing"]:
        lines.append(f"| {r['method']} | {r['size']:.0e} | {r['param_dtype']} | {r['median_ms']:.3f} | "
                     f"{r['bytes_per_param']:.2f} | {r['GBps']:.0f} | {r['pct_of_copy']:.1f} | "
                     f"{r.get('speedup_vs_torch_fused_fp32', float('nan')):.2f} |")
    lines += [f"skipped: {s}" for s in report["skipped"]]
    lines += ["", "| Llama step | params | param dtype | optimizer step ms | peak GiB | loss first -> last |",
              "| --- | --- | --- | --- | --- | --- |"]
    for r in report.get("model", []):
        if "skipped" in r:
            lines.append(f"| {r['method']} | | {r['param_dtype']} | skipped: {r['skipped']} | | |")
            continue
        peak = f"{r['peak_GiB']:.2f}" if r["peak_GiB"] is not None else "-"
        lines.append(f"| {r['method']} | {r['params']:.3g} | {r['param_dtype']} | {r['step_ms']:.3f} | {peak} | "
                     f"{r['first_loss']:.3f} -> {r['last_loss']:.3f} |")
    return "\n".join(lines)


# correctness ----------------------------------------------------------------------------------------
def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


CASES = {  # (optimizer, fmt, param dtype, block, kwargs)
    "adamw-int8": (torch.optim.AdamW, "int8", torch.float32, 256, {}),
    "adamw-dynamic8": (torch.optim.AdamW, "dynamic8", torch.float32, 2048, {}),
    "adamw-fp8_e4m3": (torch.optim.AdamW, "fp8_e4m3", torch.float32, 256, {}),
    "adamw-fp8_e5m2": (torch.optim.AdamW, "fp8_e5m2", torch.float32, 2048, {}),
    "adamw-bf16": (torch.optim.AdamW, "bf16", torch.float32, 2048, {}),
    "adam-amsgrad-maximize-wd": (torch.optim.Adam, "int8", torch.float32, 2048,
                                 {"amsgrad": True, "maximize": True, "weight_decay": 0.1}),
    "adamw-bf16-params": (torch.optim.AdamW, "int8", torch.bfloat16, 2048, {}),
    "adam-bf16-params-wd": (torch.optim.Adam, "fp8_e4m3", torch.bfloat16, 256, {"weight_decay": 0.1}),
    "adamw-tensor-hypers-bf16": (torch.optim.AdamW, "dynamic8", torch.bfloat16, 256,
                                 {"lr": "tensor", "betas": "tensor"}),
    "adamw-sqrt4": (torch.optim.AdamW, "sqrt4", torch.float32, 128, {}),
    "adamw-sqrt4-bf16-params": (torch.optim.AdamW, "sqrt4", torch.bfloat16, 128, {}),
}


def _kwargs(kwargs: dict, device: torch.device) -> dict:
    out = dict(kwargs)
    if out.get("lr") == "tensor":
        out["lr"] = torch.tensor(0.01, device=device)
    if out.get("betas") == "tensor":
        out["betas"] = (torch.tensor(0.9, device=device), torch.tensor(0.99, device=device))
    return out


def check_correctness(device: torch.device, args: argparse.Namespace) -> list[dict]:
    """Each case: three steps of the fused kernel and of the reference lowering from the same param,
    grads and states; states must be bit-identical, params within the bound of tests/test_triton_step.py.
    Then the standalone state kernels against blockquant, and a long param's last blocks (past 2**31
    elements on a GPU)."""
    results = []
    n = args.check_numel
    for case in args.cases:
        cls, fmt, dtype, block, kwargs = CASES[case]
        for native in fp8_paths(device) if fmt.startswith("fp8") else [None]:
            label = case + ("" if native in (None, True) else INT_FP8)
            try:
                with fp8_path(native):
                    results.append(check_case(label, cls, fmt, dtype, block, kwargs, device, n))
            except Exception as e:  # reported, and the check goes on
                results.append({"check": label, "ok": False, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                print(f"  {label:28s} ERROR {results[-1]['error']}")
    results += check_state_kernels(device, n)
    numel = 2**31 + 4396 if device.type == "cuda" else 4 * DEFAULT_BLOCK_SIZE + 4396
    results.append(check_tail_blocks(device, numel))
    return results


def check_case(case: str, cls: type, fmt: str, dtype: torch.dtype, block: int, kwargs: dict, device: torch.device,
               n: int) -> dict:
    runs = []
    for backend in ("reference", "triton"):
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(n, dtype=dtype, device=device))
        opt = lowbit_compile(cls([p], **_kwargs(kwargs, device)), fmt=fmt, block_size=block, outliers=2,
                             min_8bit_size=0, backend=backend)
        runs.append((p, opt))
    (p_ref, opt_ref), (p_tri, opt_tri) = runs
    eps = torch.finfo(dtype).eps
    state_mismatches, param_over, param_neq = 0, 0.0, 0
    for step in range(3):
        g = torch.randn(n, device=device) * (step + 1)
        before = p_ref.detach().float().clone()
        p_ref.grad, p_tri.grad = g.to(dtype), g.to(dtype)
        opt_ref.step()
        opt_tri.step()
        for key, ref in opt_ref.state[p_ref].items():
            ours = opt_tri.state[p_tri][key]
            if hasattr(ref, "storage_parts"):
                if ours.fmt.name == "bf16":  # exact on every backend: the same bits
                    state_mismatches += sum(int((bits(a) != bits(b)).sum())
                                            for a, b in zip(ref.storage_parts, ours.storage_parts))
                else:  # an 8-bit format: the contract, codes within one step
                    try:
                        assert_codes_within_one_step(ref.storage_parts, ours.storage_parts, ours.fmt, scale_ulps=4)
                    except AssertionError:
                        state_mismatches += 1
                with torch.no_grad():  # the next step starts from the same inputs
                    for a, b in zip(ref.storage_parts, ours.storage_parts):
                        b.copy_(a)
            elif isinstance(ref, torch.Tensor):
                state_mismatches += int((bits(ref) != bits(ours)).sum())
        new = p_ref.detach().float()
        err = (p_tri.detach().float() - new).abs()
        bound = 2 * eps * new.abs() + 8 * eps * (new - before).abs()  # tests/quantized_contract.py's bound
        param_over = max(param_over, float((err / bound.clamp_min(1e-30)).max()))
        param_neq += int((err > 0).sum())
        with torch.no_grad():
            p_tri.copy_(p_ref)
    print(f"  {case:28s} state mismatches {state_mismatches}, params differing {param_neq}, "
          f"max err/bound {param_over:.3g}")
    return {"check": case, "state_mismatches": state_mismatches, "param_elements_differing": param_neq,
            "param_max_err_over_bound": param_over, "ok": state_mismatches == 0 and param_over <= 1}


def check_state_kernels(device: torch.device, n: int) -> list[dict]:
    results = []
    for name in FORMATS:
        for nonneg in (False, True):
            for native in fp8_paths(device) if name.startswith("fp8") else [None]:
                fmt = StateFormat.make(name, 256, 2, nonneg)
                x = torch.randn(n, device=device) * torch.exp(torch.randn(n, device=device) * 3)
                x = x.abs() if nonneg else x
                ref = blockquant.quantize(x, fmt)
                ours = blockquant.empty(n, fmt, device)
                with fp8_path(native):
                    triton_backend.quantize_into(x, ours, fmt)
                    dense = triton_backend.dequantize(ref, fmt, numel=n)
                mismatches = sum(int((bits(a) != bits(b)).sum()) for a, b in zip(ref, ours))
                mismatches += int((bits(dense) != bits(blockquant.dequantize(ref, fmt, numel=n))).sum())
                label = f"state kernels {fmt.tag()}" + ("" if native in (None, True) else INT_FP8)
                results.append({"check": label, "mismatches": mismatches, "ok": mismatches == 0})
    bad = [r["check"] for r in results if not r["ok"]]
    print(f"  state kernels: {len(results) - len(bad)}/{len(results)} bit-identical {bad or ''}")
    return results


def check_tail_blocks(device: torch.device, numel: int, tail: int = 4396) -> dict:
    """One fused step of a ``numel``-element param (2**31 + 4396 on a GPU: about 22 GB with grads and
    states; the dry run's is small) against the same kernel on its last blocks alone (the step is
    blockwise and the tail block-aligned), so only the index arithmetic differs between the two."""
    label = f"step of {numel} elements, tail alone"
    if (numel - tail) % DEFAULT_BLOCK_SIZE:
        raise ValueError(f"the tail must start at a block boundary: numel - tail = {numel - tail}")
    big = small = opt_big = opt_small = None
    try:
        torch.manual_seed(0)
        big = torch.nn.Parameter(torch.empty(numel, device=device).normal_())
        big.grad = torch.empty_like(big).normal_()
        small = torch.nn.Parameter(big.detach()[-tail:].clone())
        small.grad = big.grad[-tail:].clone()
        # to nearest: a stochastic rounding's draws follow the element's index, which the tail alone renumbers
        # (the draws past 2**31 are checked against the reference by tests/test_rounding.py)
        options = dict(fmt="int8", min_8bit_size=0, backend="triton", rounding="nearest")
        opt_big = lowbit_compile(torch.optim.AdamW([big]), **options)
        opt_small = lowbit_compile(torch.optim.AdamW([small]), **options)
        opt_big.step()
        opt_small.step()
        blocks = -(-tail // DEFAULT_BLOCK_SIZE)  # the format's block size, as both optimizers use
        mismatches = int((big.detach()[-tail:] != small.detach()).sum())
        for key in ("exp_avg", "exp_avg_sq"):
            a, b = opt_big.state[big][key], opt_small.state[small][key]
            if b.scales.numel() != blocks:
                raise AssertionError(f"{key}: {b.scales.numel()} scales for the tail, expected {blocks}")
            mismatches += int((bits(a.codes[-tail:]) != bits(b.codes)).sum())
            mismatches += int((bits(a.scales[-blocks:]) != bits(b.scales)).sum())
            mismatches += int((bits(a.patch_index[-blocks:]) != bits(b.patch_index)).sum())
        result = {"check": label, "mismatches": mismatches, "ok": mismatches == 0}
    except torch.OutOfMemoryError as e:
        result = {"check": label, "ok": False, "error": str(e)[:200]}
    finally:
        big = small = opt_big = opt_small = None
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print(f"  {label}: {result}")
    return result


if __name__ == "__main__":
    main()
