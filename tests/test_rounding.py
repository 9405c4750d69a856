"""Stochastic rounding of quantized states (``rounding="stochastic"``): unbiased on every format,
reproducible from the counter, the same codes from the reference, the CPU kernel and the Triton kernel,
resumed bit for bit from a checkpoint, and accepted (or refused early) by every entry point."""

from __future__ import annotations

import copy
import difflib
import io

import pytest
import torch
from expecttest import TestCase

from lowbit_compile import enable, lowbit_compile
from lowbit_compile.cli import main
from lowbit_compile.formats import StateFormat, blockquant, decode, encode, residual, rounding
from lowbit_compile.formats.residual import first_counter
from lowbit_compile.kernels.cpp_printer import emit_step
from lowbit_compile.kernels.lowering import Target

from .graphs import body, pass_graphs
from .helpers import BLOCKWISE, KERNEL_FORMATS, assert_same, saved_and_loaded, state_bits

FORMATS = KERNEL_FORMATS


INCREMENTS = (1e-2, 1e-3, 1e-4)  # of a code gap (issue 49)
BIAS = 2.0**-17 + 2.0**-23  # |E[code] - y| / gap: the 16-bit draws' 2^-17, and the product's fp32 rounding


def _neighbours(fmt: StateFormat, pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """About ``pairs`` pairs of adjacent finite code values (inner, outer: the outer of larger magnitude)
    spread over the format's range, both signs for a signed state; none where the zero-point rule acts
    (a non-negative state's positive values below its smallest code all round up to it). bf16: adjacent
    bf16 values over many binades."""
    if fmt.name == "bf16":
        k = torch.linspace(-120, 120, pairs // 2).round().to(torch.int32) * 2**23 + 0x3F812345
        lo = k.view(torch.float32).to(torch.bfloat16).float()
        hi = (lo.view(torch.int32) + 0x10000).view(torch.float32)
        lo, hi = lo.double(), hi.double()
        return (lo, hi) if fmt.nonneg else (torch.cat([lo, -lo]), torch.cat([hi, -hi]))
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fmt.code_dtype)
    values = decode(codes, fmt).double()
    values = values[torch.isfinite(values) & (values.abs() <= fmt.qmax)].unique()  # sorted
    lo, hi = values[:-1], values[1:]
    inner = torch.where(hi <= 0, hi, lo)
    outer = torch.where(hi <= 0, lo, hi)
    keep = ~((inner == 0) & fmt.nonneg)
    inner, outer = inner[keep], outer[keep]
    pick = torch.linspace(0, inner.numel() - 1, pairs).round().long().unique()
    return inner[pick], outer[pick]


def _between(fmt: StateFormat, inner: torch.Tensor, outer: torch.Tensor,
             p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The encoder's inputs at fraction ``p`` of the gap from ``inner`` toward ``outer`` (sqrt8's in the
    root domain), and the exact fraction of the value the rule sees (float64): fp32 rounds the inputs,
    and sqrt8's rule sees the square of the root (``formats.encode``)."""
    target = inner + p * (outer - inner)
    if fmt.spec.root_domain:
        x = (target.abs().sqrt() * target.sign()).float()
        seen = (x * x.abs()).double()
    else:
        x = target.float()
        seen = x.double()
    return x, (seen - inner) / (outer - inner)


def _decoded(codes: torch.Tensor, fmt: StateFormat) -> torch.Tensor:
    return (codes.float() if fmt.name == "bf16" else decode(codes, fmt)).double()


@pytest.mark.parametrize("nonneg", [False, True])
@pytest.mark.parametrize("name", FORMATS)
def test_over_every_draw_the_mean_code_is_the_value_within_2_17_of_the_gap(name, nonneg):
    """Over all 2^16 draws an element can make (each copy of the values draws u = its copy's number),
    the outer of its two codes is taken with the value's fraction p of the gap between them to within
    2^-17 (``rounding.py``: round(2^16 p) times; bf16 exactly), at random places between code pairs over
    the whole range and at increments of 1e-2, 1e-3 and 1e-4 of a gap above the inner code, so the mean
    decoded value is the value to within 2^-17 of the gap. The 8-bit draws before it (1/512 of the gap)
    fail this at every increment."""
    fmt = StateFormat.make(name, 0, 0, nonneg)
    inner, outer = _neighbours(fmt, 24)
    torch.manual_seed(1)
    p = torch.cat([torch.rand(inner.numel(), dtype=torch.float64),
                   *(torch.full((inner.numel(),), d, dtype=torch.float64) for d in INCREMENTS)])
    inner, outer = inner.repeat(len(INCREMENTS) + 1), outer.repeat(len(INCREMENTS) + 1)
    x, seen = _between(fmt, inner, outer, p)
    n, copies = x.numel(), 2**16
    u = torch.arange(copies, dtype=torch.int64).repeat_interleave(n)
    values = _decoded(encode(x.repeat(copies), fmt, draws=u), fmt).view(copies, n)
    assert bool(((values == inner) | (values == outer)).all()), "a draw left the two codes around its value"
    taken = (values == outer).double().mean(0)
    assert float((taken - seen).abs().max()) <= (0.0 if name == "bf16" else BIAS), (taken - seen).abs().max()
    assert bool((taken[p < 0.5] > 0).all()), "an increment was never rounded up"


def test_an_element_takes_the_outer_code_with_probability_round_2_16_p_over_2_16():
    """The rule itself, on int8 (codes 1 apart): x = c + p with 2^16 p on, just above and just below
    a half, and at a code; over the 2^16 draws the outer code c + 1 is taken round(2^16 p) times (an
    exact half rounds down), and a negative value mirrors it."""
    fmt = StateFormat.make("int8", 256, 0, False)
    u = torch.arange(2**16, dtype=torch.int64)
    for p, outer in ((100.5 / 2**16, 100), (100.5 / 2**16 + 2**-21, 101), (100.5 / 2**16 - 2**-21, 100), (0.0, 0),
                     (2.0**-18, 0), (65535.75 / 2**16, 2**16)):
        for sign in (1.0, -1.0):
            x = torch.full((2**16,), sign * (3 + p))
            taken = int((encode(x, fmt, draws=u).to(torch.int32).abs() == 4).sum())
            assert taken == outer, (p, sign, taken)


def _statistical(name: str, nonneg: bool, increments: tuple[float, ...], draws_each: int) -> None:
    """At each increment of a code gap above the inner code (over code pairs across the format's range),
    ``draws_each`` encodes with the library's own draws (consecutive elements of one counter: distinct
    hashes) take the outer code as often as the increment says: ``|taken - expected| <= BIAS * n + 5
    sigma`` (a binomial's sigma: a 5-sigma check fails by chance with probability 6e-7). The increments'
    values are encoded side by side, a chunk of the counter's elements at a time."""
    fmt = StateFormat.make(name, 0, 0, nonneg)
    inner, outer = _neighbours(fmt, 64)
    x, seen = (torch.cat(t) for t in zip(*(_between(fmt, inner, outer, torch.full_like(inner, d))
                                           for d in increments)))
    outer = outer.repeat(len(increments))
    reps, per_chunk = -(-draws_each // inner.numel()), max(1, 2**22 // x.numel())
    taken = torch.zeros(x.numel(), dtype=torch.float64)
    for first in range(0, reps, per_chunk):
        k = min(per_chunk, reps - first)
        draws = rounding.state_draws(7, 3, k * x.numel(), first=first * x.numel())
        taken += (_decoded(encode(x.repeat(k), fmt, draws=draws), fmt).view(k, -1) == outer).sum(0)
    for delta, taken_at, seen_at in zip(increments, taken.chunk(len(increments)), seen.chunk(len(increments))):
        n, expected = reps * inner.numel(), reps * float(seen_at.sum())
        variance = reps * float((seen_at * (1 - seen_at)).sum())
        taken_at = float(taken_at.sum())
        assert abs(taken_at - expected) <= BIAS * n + 5 * variance**0.5, (delta, taken_at / n, expected / n)


@pytest.mark.parametrize("nonneg", [False, True])
@pytest.mark.parametrize("name", FORMATS)
def test_the_library_draws_round_up_increments_of_1e_2_of_a_gap_as_often_as_they_say(name, nonneg):
    """2^19 draws: 5 sigma is 3% of the increment."""
    _statistical(name, nonneg, (1e-2,), 2**19)


@pytest.mark.slow
@pytest.mark.parametrize("nonneg", [False, True])
@pytest.mark.parametrize("name", FORMATS)
def test_the_library_draws_round_up_increments_down_to_1e_4_of_a_gap_as_often_as_they_say(name, nonneg):
    """2^24 draws an increment: at 1e-4 of a gap 5 sigma is 12% of the increment, 2^-17 of the gap 8%."""
    _statistical(name, nonneg, INCREMENTS, 2**24)


def test_a_slow_momentum_moves_its_small_elements_as_far_as_stock():
    """SGD with momentum 0.99 on int8 blocks whose one element is 1000x the others: the small elements'
    buffers lie near 0.13 of a code and move under 1% of a code a step. Rounded to nearest they never
    leave code 0 (the params do not move); stochastically their 300-step movement is stock's within 5%
    (the 8-bit draws before gave 1.14x here: increments are rounded to 1/256 of a code)."""
    torch.manual_seed(0)
    blocks, block = 16, 256
    start = torch.randn(blocks * block)
    grad = torch.rand(blocks * block) * 1e-3 + 1e-3
    grad[::block] = 1.0
    moved = {}
    for how in ("fp32", "nearest", "stochastic"):
        p = torch.nn.Parameter(start.clone())
        opt = torch.optim.SGD([p], lr=0.1, momentum=0.99)
        if how != "fp32":
            opt = lowbit_compile(opt, "int8", rounding=how, backend="cpu", min_8bit_size=0, block_size=block)
        for _ in range(300):
            p.grad = grad.clone()
            opt.step()
        small = torch.arange(p.numel()) % block != 0
        moved[how] = float((start - p.detach())[small].sum())
    assert moved["nearest"] / moved["fp32"] < 0.05, moved
    assert abs(moved["stochastic"] / moved["fp32"] - 1) < 0.05, moved


def test_the_bits_come_from_the_counter_and_the_stream():
    fmt = StateFormat.make("int8", 32, 0, False)
    x = torch.logspace(-5, 0, 96)

    def codes(seed, stream):
        q = blockquant.empty(x.numel(), fmt)
        blockquant.quantize_into(x, q, fmt, rounding.state_draws(seed, stream, x.numel()))
        return q.codes

    assert torch.equal(codes(7, 1), codes(7, 1))
    assert not torch.equal(codes(7, 1), codes(8, 1))
    assert not torch.equal(codes(7, 1), codes(7, 2))
    assert rounding.stream_seed(2**24 + 3, 1) == 3 | 1 << 24
    with pytest.raises(ValueError, match="stream"):
        rounding.stream_seed(0, 256)


_DRAWS_HARNESS = r"""
extern "C" void draws(uint32_t key, int64_t first, int64_t n, uint32_t* scalar, uint32_t* lanes, float* thresholds) {
  for (int64_t j = 0; j < n; ++j) scalar[j] = lb_draw_s(key, first + j);
  for (int64_t j = 0; j + LB_W <= n; j += LB_W) {
    const vu u = lb_draws(key, first + j);
    memcpy(lanes + j, &u, sizeof u);
  }
  for (int64_t j = 0; j + 4 * LB_W <= n; j += 4 * LB_W) {
    const lb_vf4 t = lb_thresholds_x4<true>({key, first}, j);
    memcpy(thresholds + j, t.v, sizeof t.v);
  }
}
"""


@pytest.mark.parametrize("build", ["native", "16-lanes"])
def test_the_cpu_kernel_draws_the_reference_draws_at_any_index(build):
    """Element by element, a lane vector at a time (a hash per element, any start) and four at a time (a
    hash per two elements, odd starts included), at indices past 2^31 and 2^32 as at 0."""
    import ctypes

    from .helpers import prelude_harness

    lib = prelude_harness(build, _DRAWS_HARNESS)
    key = int(residual.hash32(torch.tensor(rounding.stream_seed(9, 2))))
    n = 160
    for first in (0, 16, 2**31 - 16, 2**31 + 32, 2**32 + 48, 2**35 + 16):
        want = rounding.state_draws(9, 2, n, first=first)
        for shift in (0, 1, 8, 13):  # the element and lane-vector paths, from inside a run
            scalar, lanes = torch.zeros(n, dtype=torch.int32), torch.zeros(n, dtype=torch.int32)
            thresholds = torch.zeros(n)
            lib.draws(ctypes.c_uint32(key), ctypes.c_int64(first + shift), ctypes.c_int64(n - 16),
                      *(ctypes.c_void_p(t.data_ptr()) for t in (scalar, lanes, thresholds)))
            got = want[shift:shift + n - 16]
            assert torch.equal(scalar[:n - 16].long(), got), (first, shift)
            assert torch.equal(lanes[:n - 16].long(), got), (first, shift)
            whole = (n - 16) // (4 * 16) * (4 * 16) if build == "16-lanes" else (n - 16) // 32 * 32
            assert whole and torch.equal(thresholds[:whole], rounding.threshold(got[:whole])), (first, shift)


@pytest.mark.parametrize("backend", ["reference", "cpu", pytest.param("triton", marks=pytest.mark.slow)])
def test_equal_parameters_stepped_together_draw_different_bits(backend):
    """An element's bits depend on its index, the counter and the stream only, so every parameter's
    counter starts apart (by its position in param_groups): two parameters holding the same values and
    gradients round differently, in one launch or two; the first starts at 0."""
    torch.manual_seed(0)
    init, grad = torch.randn(4096), torch.randn(4096)
    params = [torch.nn.Parameter(init.clone()) for _ in range(3)]
    opt = lowbit_compile(torch.optim.AdamW([{"params": params[:2]}, {"params": params[2:], "lr": 1e-3}], lr=1e-3),
                         "int8", rounding="stochastic", backend=backend, min_8bit_size=0)
    for p in params:
        p.grad = grad.clone()
    opt.step()
    counters = [float(opt.state[p]["rounding_seed"]) for p in params]
    assert counters[0] == 1.0 and len(set(counters)) == 3
    codes = [opt.state[p]["exp_avg"].storage_parts.codes for p in params]
    assert not torch.equal(codes[0], codes[1]) and not torch.equal(codes[1], codes[2])


def test_parameters_with_counters_apart_share_one_cpu_kernel_call_and_store_the_reference_bits():
    """Each parameter's counter starts apart, yet the parameters of a group step in one CPU kernel call
    (each row passes its own counter in its scalars, and advances it as the step does) and store the
    reference's bits."""
    import gc

    from lowbit_compile.kernels import cpu

    torch.manual_seed(0)
    sizes = [4096, 600, 5000, 1]
    init = [torch.randn(n) for n in sizes]
    grads = [[torch.randn(n) for n in sizes] for _ in range(3)]
    states = []
    for backend in ("reference", "cpu"):
        params = [torch.nn.Parameter(x.clone()) for x in init]
        opt = lowbit_compile(torch.optim.AdamW(params, lr=1e-2), "sqrt8", block_size=256, min_8bit_size=0,
                             backend=backend)
        for step in grads:
            for p, g in zip(params, step):
                p.grad = g.clone()
            opt.step()
        states.append((params, opt))
    (ref_params, ref), (params, ours) = states
    for p, q in zip(ref_params, params):
        _same_states(ref.state[p], ours.state[q], steps=None)
    assert len({float(ours.state[q]["rounding_seed"]) for q in params}) == len(params)
    launches = [o for o in gc.get_objects() if type(o) is cpu.CpuLaunch and o.sizes == sizes]
    assert launches and all(len(launch.calls) == 1 for launch in launches)


def _run(backend: str, fmt: str, outliers: int, nonfinite: bool) -> dict:
    torch.manual_seed(0)
    n = 600
    p = torch.nn.Parameter(torch.randn(n) * torch.logspace(-6, 2, n)[torch.randperm(n)])
    opt = lowbit_compile(torch.optim.AdamW([p], lr=1e-2), fmt, rounding="stochastic", backend=backend,
                         min_8bit_size=0, block_size=256, outliers=outliers)
    for k in range(2):
        g = torch.sin(p.detach() * 3 + k) * torch.logspace(-9, 1, n)
        if nonfinite and k == 1:
            g[7] = float("inf")
        p.grad = g
        opt.step()
    return opt.state[p]


def _same_states(a: dict, b: dict, steps: int | None = 2) -> None:
    assert a["rounding_seed"] == b["rounding_seed"] and (steps is None or a["rounding_seed"] == steps)
    for key in ("exp_avg", "exp_avg_sq"):
        for part, (x, y) in enumerate(zip(a[key].storage_parts, b[key].storage_parts)):
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), (key, part)


@pytest.mark.parametrize("outliers", [0, pytest.param(2, marks=pytest.mark.slow)])
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_cpu_kernel_rounds_as_the_reference(fmt, outliers):
    """Bit for bit, signed (m) and non-negative (v) states, patches and a flagged block (an inf)."""
    nonfinite = fmt != "bf16"  # a bf16 state keeps inf as it is; its NaN's payload is not compared
    _same_states(_run("reference", fmt, outliers, nonfinite), _run("cpu", fmt, outliers, nonfinite))


@pytest.mark.parametrize("fmt", ["int8", "sqrt8"])
def test_the_cpu_kernel_rounds_where_the_draw_meets_the_distance_as_the_reference(fmt):
    """The edges of ``t * |w_out - w_in| < |x - w_in|``, bit for bit: m is the gradient (betas 0), each
    block's largest is qmax (the multiplier 1), and every other element is set to its own draw's
    threshold t = (u + 0.5) / 2^16 (between codes 0 and 1, 1 apart; for sqrt8 where the root's square
    gives it back), so a ``<=`` or a wrong inner code moves it; and a positive v whose root's square
    underflows still lifts to code 1 (the zero-point rule reads the root, not its square)."""
    n, block = 1024, 256
    qmax = StateFormat.make(fmt, block, 0, False).qmax
    x = rounding.threshold(rounding.state_draws(0, 1, n))  # m's thresholds at the first step's counter
    on_draw = torch.ones(n, dtype=torch.bool)
    if fmt == "sqrt8":
        on_draw &= x.sqrt() * x.sqrt() == x
    on_draw[::block] = on_draw[1::block] = False
    grad = torch.where(on_draw, x, 0.0) * torch.where(torch.arange(n) % 2 == 0, 1.0, -1.0)
    grad[::block], grad[1::block] = qmax, 1e-21  # v = 1e-42: its root's square underflows
    states = []
    for backend in ("reference", "cpu"):
        p = torch.nn.Parameter(torch.zeros(n))
        opt = lowbit_compile(torch.optim.AdamW([p], lr=1e-2, betas=(0.0, 0.0)), fmt, rounding="stochastic",
                             backend=backend, min_8bit_size=0, block_size=block, outliers=0)
        p.grad = grad
        opt.step()
        states.append(opt.state[p])
    codes = states[0]["exp_avg"].storage_parts.codes
    assert int(on_draw.sum()) > 80 and not codes[on_draw].any()  # none moved: x equals t
    if fmt == "sqrt8":
        assert (states[0]["exp_avg_sq"].storage_parts.codes[1::block] == 1).all()
    _same_states(*states, steps=1)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
def test_the_triton_kernel_rounds_as_the_reference(fmt):
    pytest.importorskip("triton")
    nonfinite = fmt != "bf16"
    _same_states(_run("reference", fmt, 2, nonfinite), _run("triton", fmt, 2, nonfinite))


def test_a_resumed_run_is_bit_for_bit_the_uninterrupted_one():
    """The counter is saved (as bytes, so a bf16 param's loader cast keeps it) and restored."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(2000, dtype=torch.bfloat16))
    opt = lowbit_compile(torch.optim.AdamW([p], lr=1e-2), "int8", rounding="stochastic", backend="reference",
                         min_8bit_size=0)

    def step(k):
        p.grad = torch.sin(p.detach().float() * 3 + k).bfloat16()
        opt.step()

    for k in range(3):
        step(k)
    opt.state[p]["rounding_seed"].fill_(301.0)  # past 256, which a counter cast to bf16 would round
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    start = p.detach().clone()
    for k in range(3):
        step(k)
    uninterrupted = p.detach().clone()
    p.data.copy_(start)
    buffer.seek(0)
    opt.load_state_dict(torch.load(buffer, weights_only=False))
    for k in range(3):
        step(k)
    assert torch.equal(p.detach(), uninterrupted)
    assert float(opt.state[p]["rounding_seed"]) == 304.0


def _adamw_run(rounding_: str, params: list[torch.nn.Parameter], steps: range, backend: str = "cpu",
               state: dict | None = None) -> torch.optim.Optimizer:
    opt = lowbit_compile(torch.optim.AdamW(params, lr=1e-2), "sqrt8", block_size=256, min_8bit_size=0,
                         rounding=rounding_, backend=backend)
    if state is not None:
        opt.load_state_dict(state)
    for k in steps:
        for p in params:
            p.grad = torch.sin(p.detach() * 3 + k)
        opt.step()
    return opt


def _twins(n: int = 2) -> list[list[torch.nn.Parameter]]:
    torch.manual_seed(0)
    init = [torch.randn(1000), torch.randn(300)]
    return [[torch.nn.Parameter(x.clone()) for x in init] for _ in range(n)]


def test_a_checkpoint_saved_rounding_to_nearest_resumes_under_the_default():
    """A checkpoint of a run that rounded every state to nearest (the default before ``"auto"``: it holds no
    rounding counter) loads under the default: each parameter's counter starts on load where a fresh one
    would, v rounds stochastically from the next step, m as before, and two resumes are the same bits."""
    (a, b) = _twins()
    saved = saved_and_loaded(_adamw_run("nearest", a, range(3)).state_dict())
    assert not any("rounding_seed" in entry for entry in saved["state"].values())
    runs, start = [], [p.detach().clone() for p in a]
    for params in (a, b):
        with torch.no_grad():
            for p, x in zip(params, start):
                p.copy_(x)
        opt = _adamw_run("auto", params, range(0), state=copy.deepcopy(saved))
        assert [float(opt.state[p]["rounding_seed"]) for p in params] == [first_counter(i) for i in range(2)]
        runs.append((_adamw_run("auto", params, range(3, 6), state=copy.deepcopy(saved)), params))
    (opt_a, pa), (opt_b, pb) = runs
    assert_same(state_bits(opt_a, pa), state_bits(opt_b, pb))
    assert all(float(opt_a.state[p]["rounding_seed"]) == first_counter(i) + 3 for i, p in enumerate(pa))


def test_a_checkpoint_saved_under_the_default_resumes_rounding_to_nearest():
    """The other way round: a checkpoint holding the counter loads with ``rounding="nearest"``, which drops
    the counter and continues exactly as a nearest run loaded from the same states without it."""
    (a, b) = _twins()
    saved = saved_and_loaded(_adamw_run("auto", a, range(3)).state_dict())
    assert all("rounding_seed" in entry for entry in saved["state"].values())
    start = [p.detach().clone() for p in a]
    stripped = copy.deepcopy(saved)
    for entry in stripped["state"].values():
        del entry["rounding_seed"]
    results = []
    for params, state in ((a, saved), (b, stripped)):
        with torch.no_grad():
            for p, x in zip(params, start):
                p.copy_(x)
        opt = _adamw_run("nearest", params, range(3, 6), state=copy.deepcopy(state))
        assert not any("rounding_seed" in opt.state[p] for p in params)
        results.append((opt, params))
    (opt_a, pa), (opt_b, pb) = results
    assert_same([p.detach() for p in pa], [p.detach() for p in pb])
    assert_same(state_bits(opt_a, pa), state_bits(opt_b, pb))


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_two_runs_of_the_default_are_the_same_bits_at_any_thread_count(backend):
    """Determinism: the draws depend on the counter, the stream and the element's index only, so the same
    run gives the same params and states, with 1 thread or 2 (the blocks split over threads)."""
    (a, b) = _twins()
    results = []
    for params, threads in ((a, 1), (b, 2)):
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            results.append((_adamw_run("auto", params, range(4), backend=backend), params))
        finally:
            torch.set_num_threads(previous)
    (opt_a, pa), (opt_b, pb) = results
    assert_same([p.detach() for p in pa], [p.detach() for p in pb])
    assert_same(state_bits(opt_a, pa), state_bits(opt_b, pb))


def test_rounding_is_validated_naming_the_option_and_the_fix():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.randn(8))])
    with pytest.raises(ValueError, match=r"rounding must be one of \('auto', 'nearest', 'stochastic'\), got 'random'"):
        lowbit_compile(opt, rounding="random")
    with pytest.raises(ValueError, match=r"rounding\['exp_avg'\] must be one of"):
        lowbit_compile(opt, rounding={"exp_avg": "up"})
    with pytest.raises(ValueError, match="did you mean 'exp_avg'"):
        lowbit_compile(opt, rounding={"exp_avgg": "stochastic"})
    with pytest.raises(ValueError, match="rounding must be one of"):
        enable(rounding="sr")


def _stochastic_states(opt: torch.optim.Optimizer, fmt: str | dict = "int8", **options) -> set[str]:
    """The states whose write-back rounds stochastically in ``opt``'s rewritten step graph."""
    graph = pass_graphs(opt, fmt, **options)["quantized"]
    return {n.args[1].name.removesuffix("_codes") for n in graph.graph.nodes
            if n.target is torch.ops.lowbit.quantize_stochastic_.default}


def test_the_default_rounds_the_non_negative_states_of_8_bit_formats_stochastically():
    """``"auto"``: the second moments (the non-negative states the sign pass proves: Adam's v and its
    amsgrad max, RMSprop's square_avg, Adagrad's sum, Adamax's exp_inf, Adadelta's two) round
    stochastically in every 8-bit format, momenta (signed) and bf16 states to nearest; ``"nearest"``
    rounds every state to nearest, as before."""
    p = torch.nn.Parameter(torch.randn(64))
    for fmt in BLOCKWISE:
        assert _stochastic_states(torch.optim.AdamW([p], amsgrad=True), fmt) == {"exp_avg_sq", "max_exp_avg_sq"}
    assert _stochastic_states(torch.optim.AdamW([p]), "bf16") == set()
    assert _stochastic_states(torch.optim.AdamW([p]), {"exp_avg": "int8", "exp_avg_sq": "bf16"}) == set()
    assert _stochastic_states(torch.optim.RMSprop([p], momentum=0.9)) == {"square_avg"}
    assert _stochastic_states(torch.optim.Adagrad([p])) == {"sum"}
    assert _stochastic_states(torch.optim.Adamax([p])) == {"exp_inf"}
    assert _stochastic_states(torch.optim.Adadelta([p])) == {"square_avg", "acc_delta"}
    assert _stochastic_states(torch.optim.SGD([p], momentum=0.9)) == set()
    assert _stochastic_states(torch.optim.AdamW([p]), rounding="nearest") == set()
    assert _stochastic_states(torch.optim.AdamW([p]), rounding="stochastic") == {"exp_avg", "exp_avg_sq"}


def test_a_per_state_rounding_dict_leaves_the_other_states_to_the_default():
    p = torch.nn.Parameter(torch.randn(64))
    assert _stochastic_states(torch.optim.AdamW([p]), rounding={"exp_avg": "stochastic"}) == {"exp_avg", "exp_avg_sq"}
    assert _stochastic_states(torch.optim.AdamW([p]), rounding={"exp_avg_sq": "nearest"}) == set()
    opt = lowbit_compile(torch.optim.AdamW([p]), "int8", rounding={"exp_avg_sq": "nearest"}, backend="reference",
                         min_8bit_size=0)
    p.grad = torch.randn(64)
    opt.step()
    assert "rounding_seed" not in opt.state[p]


def test_enable_the_classes_and_the_cli_take_rounding(tmp_path):
    from lowbit_compile.optim import AdamW

    p = torch.nn.Parameter(torch.randn(64))
    opt = AdamW([p], fmt="int8", rounding="stochastic", min_8bit_size=0, backend="reference")
    p.grad = torch.randn(64)
    opt.step()
    assert float(opt.state[p]["rounding_seed"]) == 1.0
    assert "rounding='stochastic'" in repr(opt)
    twin = copy.deepcopy(opt)
    assert float(twin.state[twin.param_groups[0]["params"][0]]["rounding_seed"]) == 1.0

    q = torch.nn.Parameter(torch.randn(64))
    with enable(fmt="int8", rounding="stochastic", min_8bit_size=0, backend="reference"):
        inner = torch.optim.AdamW([q])
        q.grad = torch.randn(64)
        inner.step()
    assert "rounding_seed" in inner.state[q]

    script = tmp_path / "train.py"
    script.write_text("import torch\np = torch.nn.Parameter(torch.randn(64))\nopt = torch.optim.AdamW([p])\n"
                      "p.grad = torch.randn(64)\nopt.step()\nassert 'rounding_seed' in opt.state[p]\n")
    assert main(["run", "--rounding", "stochastic", "--fmt", "int8", "--min-8bit-size", "0", "--backend",
                 "reference", "--no-summary", str(script)]) == 0
    with pytest.raises(SystemExit):
        main(["run", "--rounding", "sometimes", str(script)])


def _diff(a: str, b: str) -> str:
    lines = difflib.unified_diff(a.splitlines(), b.splitlines(), n=0, lineterm="")
    return "\n".join(line for line in lines if not line.startswith(("@@", "---", "+++")))


def _adamw() -> torch.optim.Optimizer:
    return torch.optim.AdamW([torch.nn.Parameter(torch.randn(64))], weight_decay=0.1)


class TestPrintedStochasticKernels(TestCase):
    def test_the_cpu_kernel_draws_a_key_per_state_and_rounds_in_the_block_encode(self):
        target = Target("cpu", reciprocal_divisor=True)
        nearest = emit_step(body(_adamw(), "int8"), target).source
        stochastic = emit_step(body(_adamw(), "int8", rounding="stochastic"), target).source
        self.assertExpectedInline(_diff(nearest, stochastic), """\
-    lb_encode_pair<LB_INT8, LB_SIGNED, LB_PLAIN, LB_INT8, LB_UNSIGNED, LB_STOCHASTIC>(buf_exp_avg, nullptr, mult_exp_avg, p_exp_avg_codes, {}, buf_exp_avg_sq, nullptr, mult_exp_avg_sq, p_exp_avg_sq_codes, job.rnd[1], len);
+    lb_encode_pair<LB_INT8, LB_SIGNED, LB_STOCHASTIC, LB_INT8, LB_UNSIGNED, LB_STOCHASTIC>(buf_exp_avg, nullptr, mult_exp_avg, p_exp_avg_codes, job.rnd[0], buf_exp_avg_sq, nullptr, mult_exp_avg_sq, p_exp_avg_sq_codes, job.rnd[1], len);
-    if (enc_exp_avg) lb_encode_block<LB_INT8, LB_SIGNED, LB_PLAIN>(buf_exp_avg, nullptr, len, mult_exp_avg, p_exp_avg_codes, {});
+    if (enc_exp_avg) lb_encode_block<LB_INT8, LB_SIGNED, LB_STOCHASTIC>(buf_exp_avg, nullptr, len, mult_exp_avg, p_exp_avg_codes, job.rnd[0]);
+  const lb_rand h_exp_avg_rand = {lb_hash32_s((uint32_t)c_clone_default ^ (1u << 24)), start};
+  const lb_rand q_rand_exp_avg = job.rnd[0];
-        lb_encode_x4<LB_INT8, LB_SIGNED, LB_PLAIN>(buf_exp_avg, nullptr, i, q_mult_exp_avg, {}, q_codes_exp_avg);
+        lb_encode_x4<LB_INT8, LB_SIGNED, LB_STOCHASTIC>(buf_exp_avg, nullptr, i, q_mult_exp_avg, q_rand_exp_avg, q_codes_exp_avg);
-  job.enc[0] = lb_quantize_scale<LB_INT8, LB_SIGNED, 0>(acc_exp_avg, buf_exp_avg, len, LB_BLOCK, p_exp_avg_codes, p_exp_avg_scales, p_exp_avg_patch_values, p_exp_avg_patch_index, &job.mult[0]);
+  job.rnd[0] = h_exp_avg_rand;
+  job.enc[0] = lb_quantize_scale<LB_INT8, LB_SIGNED, 0, LB_STOCHASTIC>(acc_exp_avg, buf_exp_avg, len, LB_BLOCK, p_exp_avg_codes, p_exp_avg_scales, p_exp_avg_patch_values, p_exp_avg_patch_index, &job.mult[0], h_exp_avg_rand);""")

    def test_the_triton_kernel_passes_the_counter_and_the_stream(self):
        printer = pytest.importorskip("lowbit_compile.kernels.triton_printer")
        out = []
        for label, target in (("float8", Target("cuda")), ("integer fp8", Target("cuda", fp8_native=False))):
            nearest = printer.emit_kernel(body(_adamw(), "fp8_e4m3"), "step", target).source
            stochastic = printer.emit_kernel(body(_adamw(), "fp8_e4m3", rounding="stochastic"), "step", target).source
            out += [f"== {label}", _diff(nearest, stochastic)]
        self.assertExpectedInline("\n".join(out), """\
== float8
-                POS_INF_CODE=126, NEG_INF_CODE=254, NAN_CODE=127, APPROXIMATE=True)
+                POS_INF_CODE=126, NEG_INF_CODE=254, NAN_CODE=127, APPROXIMATE=True, seed=clone_default, STREAM=1)
== integer fp8
-                APPROXIMATE=True)
+                APPROXIMATE=True, seed=clone_default, STREAM=1)""")


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
@pytest.mark.parametrize("fmt", ["sqrt8", "int8", "dynamic8", "fp8_e4m3"])
def test_a_positive_v_far_below_its_block_never_rounds_stochastically_to_code_0(backend, fmt):
    """v of 1e-30 beside 4e29 in one block: sqrt8's root of it is below 2^-75, whose square is 0 in fp32,
    and the stochastic encode read the zero-point rule from that square (code 0 on the reference and
    C++); every backend keeps a positive v at a positive code."""
    if backend == "triton":
        pytest.importorskip("triton")
    p = torch.nn.Parameter(torch.zeros(64))
    opt = lowbit_compile(torch.optim.AdamW([p]), fmt, block_size=32, min_8bit_size=0, backend=backend,
                         rounding="stochastic")
    p.grad = torch.ones(64)
    opt.step()
    state = opt.state[p]
    state["exp_avg_sq"].copy_(torch.full((64,), 1e-30))
    state["exp_avg"].copy_(torch.zeros(64))
    p.grad = torch.zeros(64)
    p.grad[0] = 2e16  # v[0] = 0.001 * 4e32 = 4e29: the block's scale
    opt.step()
    v = state["exp_avg_sq"].dequantize()
    assert bool((v > 0).all()), v
