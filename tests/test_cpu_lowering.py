"""The CPU lowering (backend="cpu") against the eager reference: formats code by code, whole steps
for every format, flag and dtype, partial blocks, thread counts, the 16-lane and no-AVX code paths;
and the AVX-512 build."""

from __future__ import annotations

import ctypes
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from lowbit_compile import QuantizedState, lowbit_compile
from lowbit_compile.config import DEFAULT_FMT
from lowbit_compile.formats import StateFormat, blockquant, decode, encode
from lowbit_compile.formats.blockquant import decode_scaled
from lowbit_compile.formats.packing import pack4
from lowbit_compile.kernels import cpp_printer, cpu, cpu_build
from lowbit_compile.kernels.backends import resolve
from lowbit_compile.kernels.lowering import Target
from lowbit_compile.passes.opmath import compute_in_fp32
from lowbit_compile.passes.split import split_prologue
from lowbit_compile.runtime import compile

from .graphs import pass_graphs
from .helpers import (
    BLOCKWISE,
    CPU_BUILDS,
    FORMATS,
    FORMATS_HARNESS,
    KERNEL_FORMATS,
    dynamic8_probes,
    prelude_harness,
    probe_values,
)

# Every code byte: each code of a format of one-byte codes, each pair of codes of a 4-bit one (two a byte)
EVERY_BYTE = torch.arange(256, dtype=torch.int32).to(torch.uint8)


def _codes_of_every_byte(fmt: StateFormat) -> torch.Tensor:
    """The codes EVERY_BYTE holds, one a code dtype element."""
    return blockquant.unpacked_codes(EVERY_BYTE, 512 if fmt.packed else 256, fmt).view(fmt.code_dtype)


@pytest.mark.parametrize("build", list(CPU_BUILDS))
def test_prelude_formats_match_torch_code_for_code(build):
    """Every code decodes, and every probe value (ties included) encodes, exactly as formats.py (a 4-bit
    format's codes packed two a byte, as blockquant stores them)."""
    lib = prelude_harness(build)
    for index, name in enumerate(BLOCKWISE):
        for nonneg in (False, True):
            fmt = StateFormat(name, 2048, 2, nonneg)
            codes = _codes_of_every_byte(fmt)
            out = torch.empty(codes.numel())
            lib.convert(index, int(nonneg), 0, ctypes.c_float(1.0), ctypes.c_void_p(EVERY_BYTE.data_ptr()),
                        ctypes.c_void_p(out.data_ptr()), ctypes.c_int64(codes.numel()))
            torch.testing.assert_close(out, decode(codes, fmt), rtol=0, atol=0, equal_nan=True)
            x = probe_values(fmt)
            want = encode(x, fmt).view(torch.uint8)
            want = pack4(want) if fmt.packed else want
            got = torch.empty_like(want)
            lib.convert(index, int(nonneg), 1, ctypes.c_float(1.0), ctypes.c_void_p(got.data_ptr()),
                        ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(len(x)))
            assert torch.equal(got, want), (name, nonneg)


@pytest.mark.parametrize("build", list(CPU_BUILDS))
def test_prelude_decodes_every_code_under_block_scales_as_blockquant(build):
    """Every code under plain and flagged block scales, from a subnormal one to the largest blockquant
    makes (FLT_MAX / qmax), bit for bit as blockquant.decode_scaled, NaN codes included (e4m3 decodes
    in units of 256 and moves the 256 into the scale)."""
    lib = prelude_harness(build)
    for index, name in enumerate(BLOCKWISE):
        for nonneg in (False, True):
            fmt = StateFormat(name, 2048, 2, nonneg)
            codes = _codes_of_every_byte(fmt)
            top = float(torch.tensor(torch.finfo(torch.float32).max) / fmt.qmax)
            for scale in (1.0, 2.0**-149, 3e-39, 1.7e-3, 0.75, top, -1.0, -(2.0**-149), -1.7e-3, -top):
                out = torch.empty(codes.numel())
                lib.convert(index, int(nonneg), 2, ctypes.c_float(scale), ctypes.c_void_p(EVERY_BYTE.data_ptr()),
                            ctypes.c_void_p(out.data_ptr()), ctypes.c_int64(codes.numel()))
                want = decode_scaled(codes, torch.tensor(scale), fmt)
                assert torch.equal(out.view(torch.int32), want.view(torch.int32)), (name, nonneg, scale)


@pytest.mark.parametrize("build", list(CPU_BUILDS))
def test_prelude_dynamic8_encode_matches_reference_near_every_threshold(build):
    """The arithmetic encode (level, estimate, one exact compare) against formats.encode on every
    fp32 within 64 ulps of each threshold and map value, log-uniform magnitudes, both signs."""
    lib = prelude_harness(build)
    for nonneg in (False, True):
        fmt = StateFormat("dynamic8", 2048, 2, nonneg)
        x = dynamic8_probes(nonneg, seed=1)
        x = torch.nn.functional.pad(x, (0, -len(x) % 16)).contiguous()
        got = torch.empty(len(x), dtype=torch.uint8)
        lib.convert(1, int(nonneg), 1, ctypes.c_float(1.0), ctypes.c_void_p(got.data_ptr()),
                    ctypes.c_void_p(x.data_ptr()), ctypes.c_int64(len(x)))
        assert torch.equal(got, encode(x, fmt)), nonneg


# The prelude's bf16 loads and stores on whole arrays (a short last vector through the _n variants).
_BF16_HARNESS = r"""
extern "C" void bf16(int op, const void* in, void* out, int64_t n) {
  for (int64_t i = 0; i < n; i += LB_W) {
    const int64_t r = n - i < LB_W ? n - i : LB_W;
    const float* x = (const float*)in + i;
    const uint16_t* h = (const uint16_t*)in + i;
    uint16_t* o = (uint16_t*)out + i;
    if (op == 0) {  // load
      if (r == LB_W) lb_st((float*)out + i, lb_ld_bf16(h)); else lb_st_n((float*)out + i, lb_ld_bf16_n(h, r), r);
    } else if (op == 1) {  // round while storing
      if (r == LB_W) lb_st_bf16(o, lb_ld(x)); else lb_st_bf16_n(o, lb_ld_n(x, r), r);
    } else {  // round, then store the rounded value as it is
      if (r == LB_W) lb_st_bf16_exact(o, lb_round_bf16(lb_ld(x)));
      else lb_st_bf16_exact_n(o, lb_round_bf16(lb_ld_n(x, r)), r);
    }
  }
}
"""


@pytest.mark.parametrize("build", list(CPU_BUILDS))
def test_prelude_bf16_loads_and_stores_match_torch(build):
    """Every bf16 widens to its fp32 bits; fp32 values with every bf16 high half and the low halves
    that decide rounding (0, 1, ties, either side of them, all ones) round as torch's round to
    nearest even (NaN: the quiet NaN 0x7FC0), both when the store rounds and when it stores a value
    lb_round_bf16 rounded. Odd lengths send a tail through the partial loads and stores."""
    lib = prelude_harness(build, _BF16_HARNESS)
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)[:-5]
    widened = torch.empty(len(every))
    lib.bf16(0, ctypes.c_void_p(every.data_ptr()), ctypes.c_void_p(widened.data_ptr()), ctypes.c_int64(len(every)))
    assert torch.equal(widened.view(torch.int32), every.to(torch.int32) << 16)

    low = torch.tensor([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int32)
    bits = (every.to(torch.int32)[:, None] << 16 | low).flatten()
    x = torch.cat([bits.view(torch.float32), torch.randn(1001) * 10.0 ** torch.randint(-40, 39, (1001,))])
    nan = x.isnan()
    want = x.to(torch.bfloat16).view(torch.int16)
    want[nan] = 0x7FC0
    for op in (1, 2):
        got = torch.empty(len(x), dtype=torch.int16)
        lib.bf16(op, ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(got.data_ptr()), ctypes.c_int64(len(x)))
        assert torch.equal(got, want), op


def _twins(fmt, cls, kwargs, dtype, sizes, steps=3, block_size=64, outliers=2, threads=None, rounding="nearest"):
    """The same training run under the reference and the CPU lowering; grads carry 1% outliers so
    every block has patches to take."""
    results = []
    for backend in ("reference", "cpu"):
        gen = torch.Generator().manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(n, generator=gen).to(dtype)) for n in sizes]
        kw = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
        opt = lowbit_compile(cls(params, **kw), fmt, block_size=block_size, outliers=outliers, min_8bit_size=0,
                             backend=backend, rounding=rounding)
        for _ in range(steps):
            for p in params:
                g = torch.randn(p.shape, generator=gen) * (1 + 30 * (torch.rand(p.shape, generator=gen) < 0.01))
                p.grad = g.to(dtype)
            if threads is not None and backend == "cpu":
                before = torch.get_num_threads()
                torch.set_num_threads(threads)
                try:
                    opt.step()
                finally:
                    torch.set_num_threads(before)
            else:
                opt.step()
        results.append((params, opt))
    return results


def _assert_same_states(ref, ours):
    (pr, opt_r), (pc, opt_c) = ref, ours
    for a, b in zip(pr, pc):
        for key, va in opt_r.state[a].items():
            vb = opt_c.state[b][key]
            if isinstance(va, QuantizedState):
                for part in ("codes", "scales", "patch_values", "patch_index"):
                    x, y = getattr(va, part), getattr(vb, part)
                    if x.element_size() == 1:
                        x, y = x.view(torch.uint8), y.view(torch.uint8)
                    assert torch.equal(x, y), (key, part, a.numel())
            else:
                assert torch.equal(va, vb), (key, a.numel())


ADAMW = (torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.1})
ADAM_FLAGS = (torch.optim.Adam, {"lr": torch.tensor(1e-2), "amsgrad": True, "maximize": True, "weight_decay": 0.01})
# partial last blocks, a 1-element param, sizes below one SIMD vector, several whole blocks, a last
# block of a whole vector and a partial one (the late param write-back drains before the tail)
SIZES = [1000, 64, 1, 7, 131, 77]


# Every format with Adam's flags; AdamW's decoupled weight decay once quantized, once stock.
FP32_CASES = [pytest.param(fmt, *ADAM_FLAGS, id=f"{fmt}-Adam-amsgrad-maximize-tensor-lr") for fmt in FORMATS] + [
    pytest.param(fmt, *ADAMW, id=f"{fmt}-AdamW-wd") for fmt in ("int8", "fp32")]
BF16_CASES = [pytest.param(fmt, *ADAMW, id=f"{fmt}-AdamW-wd") for fmt in FORMATS] + [
    pytest.param("int8", *ADAM_FLAGS, id="int8-Adam-amsgrad-maximize-tensor-lr")]


@pytest.mark.parametrize(("fmt", "cls", "kwargs"), FP32_CASES)
def test_fp32_params_match_reference(fmt, cls, kwargs):
    """States are bit-identical (their update has no sqrt or division, and the kernel rounds every
    op, FMA included, as aten does; codes then cannot differ, ties included). Params with quantized
    states use the SIMD sqrt and a multiply by 1/bias_correction, each within one rounding of
    torch's (MKL sqrt, true division): after 3 steps a param is within 4 ulps of the reference
    (rtol 4.8e-7) plus 4 ulps of one update, whose size is about lr <= 1e-2 (ulp 9.3e-10, so atol
    4e-9). With fp32 states (stock) the kernel takes torch's own sqrt: bit for bit."""
    ref, ours = _twins(fmt, cls, kwargs, torch.float32, SIZES)
    _assert_same_states(ref, ours)
    for a, b in zip(ref[0], ours[0]):
        if fmt == "fp32":
            assert torch.equal(a, b)
        else:
            torch.testing.assert_close(a, b, rtol=4.8e-7, atol=4e-9)


# aten's bf16 kernels run their last (n mod 32) elements through a scalar path that, for an add with
# alpha (Adam's weight decay), rounds alpha * other to bf16 first; the vector path (and this kernel)
# does not. Sizes that are multiples of 32 keep every element on aten's vector path.
BF16_SIZES = [1024, 64, 96, 32]


@pytest.mark.parametrize(("fmt", "cls", "kwargs"), BF16_CASES)
def test_bf16_params_match_reference_bit_for_bit(fmt, cls, kwargs):
    """bf16 params: with fp32 states every op rounds to bf16 as aten's does; with low-bit states both
    compute in fp32 and round once per store (passes/opmath.py), where the kernel's sqrt and reciprocal
    multiply are within one fp32 rounding of torch's, which moves a bf16 result only within ~2**-16 of
    a rounding boundary (no element here). Params and states are identical."""
    ref, ours = _twins(fmt, cls, kwargs, torch.bfloat16, BF16_SIZES)
    _assert_same_states(ref, ours)
    for a, b in zip(ref[0], ours[0]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("block_size", [1, 2, 8, 16, 32])
def test_stochastic_draws_of_blocks_that_split_a_hash_match_the_reference(block_size):
    """Two elements draw from one hash (rounding.py): blocks of 1 element start inside one, blocks of fewer
    than 16 take lb_thresholds' scalar path, larger ones its 16 at a time; sizes whose last block ends
    inside a hash."""
    ref, ours = _twins("sqrt8", *ADAMW, torch.float32, [1, 3, 6, 37, 130], block_size=block_size,
                       outliers=1 if block_size > 1 else 0, rounding="stochastic")
    _assert_same_states(ref, ours)


@pytest.mark.parametrize(("fmt", "outliers"), [("int8", 4), ("fp8_e4m3", 0), ("dynamic8", 1)])
def test_tiny_blocks_and_patches_into_the_padding(fmt, outliers):
    """Block 16 with 0-4 patches, params of 1-33 elements: a last block shorter than its patch count
    places patches in the padding, exactly as the reference does."""
    ref, ours = _twins(fmt, *ADAMW, torch.float32, [1, 2, 3, 5, 15, 16, 17, 33], block_size=16, outliers=outliers)
    _assert_same_states(ref, ours)


def test_default_block_and_two_threads():
    """Block 2048 over several blocks, stepped with 2 threads: the split of blocks over threads does
    not change any result."""
    ref, ours = _twins("int8", *ADAMW, torch.float32, [3 * 2048 + 100, 2048], block_size=2048, threads=2)
    _assert_same_states(ref, ours)


def _build_kernels_with(monkeypatch, tmp_path, flag: str) -> None:
    """This test's kernels are lowered and compiled again, with ``flag`` added, into a cache of their own."""
    monkeypatch.setenv("LOWBIT_COMPILE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_build, "FLAGS", (*cpu_build.FLAGS, flag))
    monkeypatch.setattr(compile, "_compiled", {})


@pytest.mark.slow
def test_sixteen_lane_kernel_matches(monkeypatch, tmp_path):
    """The whole step compiled with 16 lanes (the AVX-512 width, here through the generic path)."""
    _build_kernels_with(monkeypatch, tmp_path, "-DLB_W=16")
    ref, ours = _twins("fp8_e4m3", *ADAM_FLAGS, torch.float32, SIZES)
    _assert_same_states(ref, ours)


@pytest.mark.slow
def test_kernel_without_avx_matches(monkeypatch, tmp_path):
    """The whole step compiled for x86-64 without AVX (8 lanes through the generic path, the code other
    architectures compile), here with the default format and stochastic rounding."""
    _build_kernels_with(monkeypatch, tmp_path, "-march=x86-64-v2")
    ref, ours = _twins(DEFAULT_FMT, *ADAMW, torch.float32, SIZES, rounding="stochastic")
    _assert_same_states(ref, ours)


@pytest.mark.slow
def test_avx2_kernel_matches(monkeypatch, tmp_path):
    """The AVX2 intrinsics run whatever the machine: built with AVX-512 off (a no-op where the native build
    is the AVX2 one), fp32 params with Adam's flags and bf16 params, the default format."""
    _build_kernels_with(monkeypatch, tmp_path, "-mno-avx512f")
    _assert_same_states(*_twins(DEFAULT_FMT, *ADAM_FLAGS, torch.float32, SIZES))
    ref, ours = _twins(DEFAULT_FMT, *ADAMW, torch.bfloat16, BF16_SIZES)
    _assert_same_states(ref, ours)
    for a, b in zip(ref[0], ours[0]):
        assert torch.equal(a, b)


@pytest.mark.slow
@pytest.mark.parametrize("build", ["16-lanes", "avx2", "x86-64-v2"])
def test_packed_kernel_matches_in_every_build(monkeypatch, tmp_path, build):
    """sqrt4's whole step (codes two a byte: nibble loads, packing stores, odd element counts)
    under each build's code for them, stochastic rounding and patches included."""
    for flag in CPU_BUILDS[build]:
        _build_kernels_with(monkeypatch, tmp_path, flag)
    _assert_same_states(*_twins("sqrt4", *ADAM_FLAGS, torch.float32, SIZES, rounding="stochastic"))


@pytest.mark.slow
def test_kernels_build_for_avx512(tmp_path):
    """The 16-lane intrinsics compile on any machine (the native build runs them only where the CPU has
    AVX-512): the element formats, bf16 conversions and every format's step (patches, stochastic
    rounding; bf16 params), built for x86-64-v4, use 512-bit registers."""
    sources = {"formats": cpp_printer.PRELUDE + FORMATS_HARNESS, "bf16": cpp_printer.PRELUDE + _BF16_HARNESS}
    for fmt in KERNEL_FORMATS:
        for dtype in (torch.float32, torch.bfloat16):
            opt = torch.optim.AdamW([torch.nn.Parameter(torch.randn(64, dtype=dtype))], weight_decay=0.1)
            graphs = pass_graphs(opt, fmt, block_size=64, outliers=2, rounding="stochastic")
            quantized = compute_in_fp32(graphs["quantized"]) if dtype == torch.bfloat16 else graphs["quantized"]
            body = split_prologue(quantized).body
            sources[f"{fmt}-{dtype}"] = cpp_printer.emit_step(body, Target("cpu", reciprocal_divisor=True)).full_source

    def build(item):
        name, source = item
        src, asm = tmp_path / f"{name}.cpp", tmp_path / f"{name}.s"
        src.write_text(source)
        flags = [f for f in cpu_build.FLAGS if f not in ("-shared", "-march=native")]
        done = subprocess.run([cpu_build.compiler(), *flags, "-march=x86-64-v4", "-S", str(src), "-o", str(asm)],
                              capture_output=True, text=True)
        assert done.returncode == 0, (name, done.stderr[-3000:])
        assert "%zmm" in asm.read_text(), name

    with ThreadPoolExecutor(max_workers=os.cpu_count()) as pool:
        list(pool.map(build, sources.items()))


def test_auto_picks_the_cpu_kernel():
    assert resolve("auto", "cpu") == "cpu"


def test_auto_on_cuda_without_triton_says_it_runs_the_reference_and_how_to_fix_it(monkeypatch):
    """triton is an extra (lowbit-compile[gpu]): a CUDA torch installed without it still steps, and is told why
    the step is not fused."""
    from lowbit_compile.kernels import backends

    monkeypatch.setattr(backends, "triton_available", lambda: False)
    with pytest.warns(UserWarning, match=r"pip install 'lowbit-compile\[gpu\]'"):
        assert resolve("auto", "cuda") == "reference"


def test_fp16_params_match_reference_bit_for_bit():
    """fp16 params and states: every op rounds to fp16 as aten's does (the same rules as bf16)."""
    ref, ours = _twins("dynamic8", *ADAMW, torch.float16, BF16_SIZES)
    _assert_same_states(ref, ours)
    for a, b in zip(ref[0], ours[0]):
        assert torch.equal(a, b)


def _step_all(opt, params, gen):
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()


_FRESH_PROCESS = """
import time, torch
from lowbit_compile import lowbit_compile
from lowbit_compile.kernels import cpu_build
params = [torch.nn.Parameter(torch.randn(s)) for s in [(96, 64), (64, 96), (5000,), (70, 70), (10,), (3, 5)]]
opt = lowbit_compile(torch.optim.AdamW(params, weight_decay=0.1), "int8")
start = time.perf_counter()
for _ in range(2):
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
print(cpu_build.compile_count, time.perf_counter() - start)
"""


@pytest.mark.slow
def test_one_kernel_per_signature_and_a_warm_cache_serves_a_fresh_process(tmp_path):
    """Params of six shapes, quantized and small (stock): two signatures, so two kernels compiled in a
    fresh process (a fresh interpreter keeps other tests' caches out); a second process compiles
    nothing, the kernels live on disk."""
    import subprocess
    import sys

    env = {**__import__("os").environ, "LOWBIT_COMPILE_CACHE_DIR": str(tmp_path)}
    runs = [subprocess.run([sys.executable, "-c", _FRESH_PROCESS], env=env, capture_output=True, text=True,
                           timeout=300) for _ in range(2)]
    counts = [int(r.stdout.split()[0]) for r in runs]
    assert counts == [2, 0], [r.stderr[-2000:] for r in runs]
    assert len(list(tmp_path.glob("*.so"))) == 2


def test_a_source_asked_for_while_it_builds_is_built_once(monkeypatch, tmp_path):
    """``load_async`` of a source already building gives the build under way, and a later one the
    loaded library: one compiler run, one library, however many ask."""
    monkeypatch.setenv("LOWBIT_COMPILE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_build, "_loaded", {})
    source = 'extern "C" int lowbit_answer(void) { return 42; }\n'
    before = cpu_build.compile_count
    first, second = cpu_build.load_async(source), cpu_build.load_async(source)
    libs = [first.result(), second.result(), cpu_build.load(source)]
    assert cpu_build.compile_count == before + 1
    assert libs[0] is libs[1] is libs[2] and libs[0].lowbit_answer() == 42
    assert len(list(tmp_path.glob("*.so"))) == 1


def test_many_small_tensors_take_one_launch_and_stay_stock(monkeypatch):
    """300 tensors under min_8bit_size keep stock fp32 states and are stepped by one kernel call per
    step, bit for bit like a foreach=False twin (their shared step count)."""
    shapes = [(int(n),) for n in torch.randint(1, 4096, (300,), generator=torch.Generator().manual_seed(0))]
    ours = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    twin = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = lowbit_compile(torch.optim.AdamW(ours, weight_decay=0.1), "int8")
    stock = torch.optim.AdamW(twin, weight_decay=0.1, foreach=False)
    launches = []
    run = cpu.CpuLaunch.run
    monkeypatch.setattr(cpu.CpuLaunch, "run", lambda self: (launches.extend(len(m) for m, _ in self.calls), run(self)))
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        for p, q in zip(ours, twin):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        opt.step()
        stock.step()
    assert launches == [300, 300, 300]
    for p, q in zip(ours, twin):
        assert torch.equal(p, q)
        assert torch.equal(opt.state[p]["exp_avg_sq"], stock.state[q]["exp_avg_sq"])


def test_a_reused_preparation_follows_every_change():
    """Steady steps reuse each parameter's preparation; a new weight_decay (another guard), a
    reassigned p.data, a loaded state dict and a param that got a grad later are each seen."""
    shapes = [(300,), (40, 20), (5,)]
    ours = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    twin = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = lowbit_compile(torch.optim.Adam(ours, weight_decay=0.0), "fp32")
    stock = torch.optim.Adam(twin, weight_decay=0.0, foreach=False)
    gen = torch.Generator().manual_seed(2)
    for step in range(8):
        for i, (p, q) in enumerate(zip(ours, twin)):
            if i == 2 and step < 3:
                p.grad = q.grad = None
                continue
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        if step == 4:
            for o in (opt, stock):
                o.param_groups[0]["weight_decay"] = 0.1
        if step == 5:
            fresh = torch.randn(40, 20)
            ours[1].data, twin[1].data = fresh.clone(), fresh.clone()
        if step == 6:
            stock.load_state_dict(stock.state_dict())
            opt.load_state_dict(opt.state_dict())
        opt.step()
        stock.step()
        for p, q in zip(ours, twin):
            assert torch.equal(p, q), step


def test_a_steady_step_reuses_its_launches_and_sees_every_change():
    """Steps after the first reuse the prepared launches (no new preparation) while only grads and
    hyperparameters change; a strided grad, a replaced state entry, an lr change and a step count
    reset from outside each still step like the stock twin."""
    shapes = [(300,), (40, 20), (64,), (5000,)]
    ours = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    twin = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    opt = lowbit_compile(torch.optim.Adam(ours, weight_decay=0.01), "fp32")
    stock = torch.optim.Adam(twin, weight_decay=0.01, foreach=False)
    gen = torch.Generator().manual_seed(5)
    plans = []
    for step in range(9):
        for p, q in zip(ours, twin):
            g = torch.randn(p.shape, generator=gen)
            if step == 3 and p.dim() == 2:
                g = torch.randn(tuple(reversed(p.shape)), generator=gen).t()  # a strided grad
            p.grad, q.grad = g, g.clone()
        if step == 4:
            for o in (opt, stock):
                o.param_groups[0]["lr"] = 3e-3
        if step == 5:
            for o, p in ((opt, ours[0]), (stock, twin[0])):
                o.state[p]["exp_avg"] = o.state[p]["exp_avg"].clone()
        if step == 6:
            for o, p in ((opt, ours[2]), (stock, twin[2])):
                o.state[p]["step"].fill_(1.0)
        opt.step()
        stock.step()
        plans.append(opt._lowbit.plan)
        for p, q in zip(ours, twin):
            assert torch.equal(p, q), step
    assert plans[1] is plans[2] is plans[3] is plans[4]  # new grads (one strided) and a new lr: same plan
    assert plans[5] is not plans[4]  # a replaced state entry: prepared again


@pytest.mark.parametrize("fmt", ["fp32", "int8"])
def test_the_step_after_one_that_creates_states_is_prepared_again(fmt):
    """SGD's first step creates momentum_buffer (= grad); the next steps are another trace, so the
    first step's launches are not replayed: the buffer keeps accumulating like stock's (int8: within
    a few quantization steps of the block's absmax after 4 steps)."""
    ours = torch.nn.Parameter(torch.randn(4096))
    twin = torch.nn.Parameter(ours.detach().clone())
    opt = lowbit_compile(torch.optim.SGD([ours], lr=0.1, momentum=0.9), fmt, min_8bit_size=0)
    stock = torch.optim.SGD([twin], lr=0.1, momentum=0.9, foreach=False)
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        g = torch.randn(4096, generator=gen)
        ours.grad, twin.grad = g, g.clone()
        opt.step()
        stock.step()
    buf, want = opt.state[ours]["momentum_buffer"], stock.state[twin]["momentum_buffer"]
    if fmt == "fp32":
        assert torch.equal(buf, want) and torch.equal(ours, twin)
    else:
        err = (buf.dequantize() - want).abs().max()
        assert err <= 4 * want.abs().max() / 127


# Block quantization with K patches, as the kernels call it: each block written to a buffer while
# its lanes' largest keys are kept, then lb_quantize_scale and lb_encode_block (int8, signed).
_PATCH_COUNTS = (1, 7, 8, 9, 15, 16, 17, 32, 64)
_PATCHES_HARNESS = r"""
template <int K> static void quant(float* x, int64_t n, int64_t block, uint8_t* codes, float* scales,
                                   uint16_t* values, int16_t* index) {
  for (int64_t b = 0; b * block < n; ++b) {
    const int64_t len = n - b * block < block ? n - b * block : block;
    float* buf = x + b * block;
    vi acc = lb_splat_i(-1);
    for (int64_t i = 0; i < len; i += LB_W) {
      const int64_t r = len - i < LB_W ? len - i : LB_W;
      acc = lb_vmax(acc, lb_key_masked(r == LB_W ? lb_ld(buf + i) : lb_ld_n(buf + i, r), r));
    }
    float mult;
    if (lb_quantize_scale<LB_INT8, false, K>(acc, buf, len, block, codes + b * block, scales + b, values + b * K,
                                             index + b * K, &mult))
      lb_encode_block<LB_INT8, false, LB_PLAIN>(buf, nullptr, len, mult, codes + b * block, {});
  }
}
extern "C" void quant_k(int k, float* x, int64_t n, int64_t block, uint8_t* codes, float* scales,
                        uint16_t* values, int16_t* index) {
  switch (k) {
""" + "".join(f"    case {k}: quant<{k}>(x, n, block, codes, scales, values, index); break;\n" for k in _PATCH_COUNTS) + """
  }
}
"""


@pytest.mark.parametrize("build", ["native", "avx2", "x86-64-v2"])
def test_patches_at_and_above_the_vector_width_quantize_as_the_reference(build):
    """Patch counts around the vector width (8 or 16 lanes) and up to the config's 64, in blocks of 64
    and 512 with a partial last block and a block holding inf, give the reference's codes, scales and
    patches exactly (K >= the lane count has no lane bound: every element is a candidate)."""
    lib = cpu_build.load(cpp_printer.PRELUDE + _PATCHES_HARNESS, CPU_BUILDS[build])
    gen = torch.Generator().manual_seed(5)
    for block in (64, 512):
        n = 3 * block + 37
        x = torch.randn(n, generator=gen) * (1 + 50 * (torch.rand(n, generator=gen) < 0.05))
        x[block + 3] = float("inf")
        for k in _PATCH_COUNTS:
            if k > block:
                continue
            fmt = StateFormat("int8", block, k, False)
            want = blockquant.quantize(x, fmt)
            blocks = -(-n // block)
            codes, scales = torch.empty(n, dtype=torch.uint8), torch.empty(blocks)
            values, index = torch.empty(blocks * k, dtype=torch.int16), torch.empty(blocks * k, dtype=torch.int16)
            buf = x.clone()
            lib.quant_k(k, *(ctypes.c_void_p(t.data_ptr()) for t in (buf,)), ctypes.c_int64(n), ctypes.c_int64(block),
                        *(ctypes.c_void_p(t.data_ptr()) for t in (codes, scales, values, index)))
            assert torch.equal(codes, want.codes.view(torch.uint8)), (block, k)
            assert torch.equal(scales.view(torch.int32), want.scales.view(torch.int32)), (block, k)
            assert torch.equal(values, want.patch_values.view(torch.int16).reshape(-1)), (block, k)
            assert torch.equal(index, want.patch_index.reshape(-1)), (block, k)


@pytest.mark.parametrize("block_size, outliers", [(64, 64), (512, 32)])
def test_whole_step_with_patches_above_the_vector_width_matches(block_size, outliers):
    """The whole step with as many patches as the config accepts (once crashed, once wrote NaN)."""
    ref, ours = _twins(DEFAULT_FMT, *ADAMW, torch.float32, [2 * block_size + 100, 64, 7], block_size=block_size,
                       outliers=outliers)
    _assert_same_states(ref, ours)
    for a, b in zip(ref[0], ours[0]):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(a, b, rtol=0, atol=2e-6)
