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
from lowbit_compile.kernels import blockquant, rounding
from lowbit_compile.kernels.cpp_printer import emit_step
from lowbit_compile.kernels.formats import StateFormat
from lowbit_compile.kernels.lowering import Target

from .graphs import body, pass_graphs
from .helpers import bf16_bound, element_bound

FORMATS = ("int8", "dynamic8", "sqrt8", "fp8_e4m3", "fp8_e5m2", "bf16")


def _values(fmt: StateFormat, n: int = 96) -> torch.Tensor:
    """Values between grid points over many decades (one block's largest sets the scale)."""
    torch.manual_seed(1)
    x = torch.logspace(-5, 0, n) * (1 + 0.37 * torch.rand(n))
    if not fmt.nonneg:
        x = torch.where(torch.arange(n) % 2 == 0, -x, x)
    return x


@pytest.mark.parametrize("nonneg", [False, True])
@pytest.mark.parametrize("name", FORMATS)
def test_the_mean_of_stochastic_codes_is_the_value_within_1_512_of_the_gap(name, nonneg):
    """Over every draw an element can make (all 256 8-bit draws of a code, all 2^16 of a bf16 value:
    each of 2^16 copies of the values gets draw k, whose low 16 bits are k and whose 8-bit draw is
    k % 256), E[decode(encode(x))] = x to within 1/512 of the gap between the two codes around x
    (``rounding.py``: the outer code with probability round(256 p) / 256; bf16's exactly), wherever x
    is above the smallest positive code of a non-negative state (below it, values round up:
    docs/numerics.md); 1e-6 of x is the normalization's fp32 rounding. An element that always drew
    the same code (p below 1/512 or above 511/512) is within the nearest code's error bound."""
    fmt = StateFormat.make(name, 32, 1, nonneg)
    x = _values(fmt)
    n, copies = x.numel(), 2**16
    k = torch.arange(copies, dtype=torch.int64).repeat_interleave(n)
    q = blockquant.empty(n * copies, fmt)
    blockquant.quantize_into(x.repeat(copies), q, fmt, k | (k & 0xFF) << 32)
    draws = blockquant.dequantize(q, fmt).double().view(copies, n)
    mean = draws.mean(0)
    nearest = blockquant.dequantize(blockquant.quantize(x, fmt), fmt).double()
    assert bool((draws.std(0) > 0).any()), "nothing was rounded stochastically"
    scale = x.abs().reshape(-1, 32).amax(1).repeat_interleave(32).double() / fmt.qmax
    floor = fmt.min_positive * scale if fmt.blockwise else torch.full_like(scale, fmt.min_positive)
    tested = x.double().abs() > 2 * floor
    err = (mean - x.double()).abs()
    if fmt.blockwise:  # the block's own scale (patches excluded), and bf16's bound for the patches
        own = q.scales[: n // 32].abs().double().repeat_interleave(32)
        bound = torch.maximum(element_bound(x.double(), own, fmt, torch.zeros_like(tested)),
                              bf16_bound(x.double(), fmt.nonneg))
    else:
        bound = bf16_bound(x.double(), fmt.nonneg)
    gap = draws.amax(0) - draws.amin(0)  # the two codes', where both were drawn
    within = torch.where(gap > 0, err <= gap / 512 + 1e-6 * x.double().abs(), err <= bound)
    assert bool(within[tested].all()), (name, nonneg, (err / gap)[tested & ~within])
    assert (mean - x.double()).abs().mean() < (nearest - x.double()).abs().mean()


def test_an_element_takes_the_outer_code_with_probability_round_256_p_over_256():
    """The rule itself, on int8 (codes 1 apart): x = c + p with 256 p on, just above and just below
    a half, and at a code; over the 256 draws the outer code c + 1 is taken round(256 p) times (an
    exact half rounds down), and a negative value mirrors it."""
    fmt = StateFormat.make("int8", 256, 0, False)
    u = torch.arange(256, dtype=torch.int64)
    for p, outer in ((100.5 / 256, 100), (100.5 / 256 + 1e-5, 101), (100.5 / 256 - 1e-5, 100), (0.0, 0),
                     (1 / 1024, 0), (255.75 / 256, 256)):
        for sign in (1.0, -1.0):
            x = torch.full((256,), sign * (3 + p))
            x[0] = sign * 127.0  # the block's largest: the multiplier 1
            q = blockquant.empty(256, fmt)
            blockquant.quantize_into(x, q, fmt, u << 32)
            taken = int((q.codes[1:].to(torch.int32).abs() == 4).sum()) + int(u[0] + 0.5 < 256 * p)
            assert taken == outer, (p, sign, taken)


def test_the_bits_come_from_the_counter_and_the_stream():
    fmt = StateFormat.make("int8", 32, 0, False)
    x = _values(fmt)

    def codes(seed, stream):
        q = blockquant.empty(x.numel(), fmt)
        blockquant.quantize_into(x, q, fmt, rounding.state_bits(seed, stream, x.numel()))
        return q.codes

    assert torch.equal(codes(7, 1), codes(7, 1))
    assert not torch.equal(codes(7, 1), codes(8, 1))
    assert not torch.equal(codes(7, 1), codes(7, 2))
    assert rounding.stream_seed(2**24 + 3, 1) == 3 | 1 << 24
    with pytest.raises(ValueError, match="stream"):
        rounding.stream_seed(0, 256)


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


def _same_states(a: dict, b: dict, steps: int = 2) -> None:
    assert a["rounding_seed"] == b["rounding_seed"] == steps
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
    """The edges of ``(u + 0.5) * |w_out - w_in| < 256 * |x - w_in|``, bit for bit: m is the gradient
    (betas 0), each block's largest is qmax (the multiplier 1), and every other element is set to its
    own draw's threshold (u + 0.5) / 256 (between codes 0 and 1, 1 apart; for sqrt8 where the root's
    square gives it back), so a ``<=`` or a wrong inner code moves it; and a root whose square
    underflows is code 0 in v (no lift from 0)."""
    n, block = 1024, 256
    qmax = StateFormat.make(fmt, block, 0, False).qmax
    u = (rounding.state_draws(0, 1, n).double() + 0.5) / 256  # m's draws at the first step's counter
    x = u.float()
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
    assert int(on_draw.sum()) > 80 and not codes[on_draw].any()  # none moved: 256 x equals u + 0.5
    if fmt == "sqrt8":
        assert not states[0]["exp_avg_sq"].storage_parts.codes[1::block].any()
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


def test_rounding_is_validated_naming_the_option_and_the_fix():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.randn(8))])
    with pytest.raises(ValueError, match=r"rounding must be one of \('nearest', 'stochastic'\), got 'random'"):
        lowbit_compile(opt, rounding="random")
    with pytest.raises(ValueError, match=r"rounding\['exp_avg'\] must be one of"):
        lowbit_compile(opt, rounding={"exp_avg": "up"})
    with pytest.raises(ValueError, match="did you mean 'exp_avg'"):
        lowbit_compile(opt, rounding={"exp_avgg": "stochastic"})
    with pytest.raises(ValueError, match="rounding must be one of"):
        enable(rounding="sr")


def test_per_state_rounding_keeps_the_other_state_to_nearest():
    p = torch.nn.Parameter(torch.randn(64))
    opt = lowbit_compile(torch.optim.AdamW([p]), "int8", rounding={"exp_avg": "stochastic"}, backend="reference",
                         min_8bit_size=0)
    p.grad = torch.randn(64)
    opt.step()
    assert "rounding_seed" in opt.state[p]
    graph = pass_graphs(torch.optim.AdamW([p]), "int8", rounding={"exp_avg": "stochastic"})["quantized"]
    targets = {n.args[1].name: n.target for n in graph.graph.nodes if n.target in (
        torch.ops.lowbit.quantize_.default, torch.ops.lowbit.quantize_stochastic_.default)}
    assert targets == {"exp_avg_codes": torch.ops.lowbit.quantize_stochastic_.default,
                       "exp_avg_sq_codes": torch.ops.lowbit.quantize_.default}


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
-static const int LB_N_SCALARS = 7;
+static const int LB_N_SCALARS = 8;
-    lb_encode_pair<LB_INT8, LB_SIGNED, LB_PLAIN, LB_INT8, LB_UNSIGNED, LB_PLAIN>(buf_exp_avg, nullptr, mult_exp_avg, p_exp_avg_codes, buf_exp_avg_sq, nullptr, mult_exp_avg_sq, p_exp_avg_sq_codes, len);
+    lb_encode_pair<LB_INT8, LB_SIGNED, LB_STOCHASTIC, LB_INT8, LB_UNSIGNED, LB_STOCHASTIC>(buf_exp_avg, nullptr, mult_exp_avg, p_exp_avg_codes, buf_exp_avg_sq, nullptr, mult_exp_avg_sq, p_exp_avg_sq_codes, len);
-    if (enc_exp_avg) lb_encode_block<LB_INT8, LB_SIGNED, LB_PLAIN>(buf_exp_avg, nullptr, len, mult_exp_avg, p_exp_avg_codes);
-    if (enc_exp_avg_sq) lb_encode_block<LB_INT8, LB_UNSIGNED, LB_PLAIN>(buf_exp_avg_sq, nullptr, len, mult_exp_avg_sq, p_exp_avg_sq_codes);
+    if (enc_exp_avg) lb_encode_block<LB_INT8, LB_SIGNED, LB_STOCHASTIC>(buf_exp_avg, nullptr, len, mult_exp_avg, p_exp_avg_codes);
+    if (enc_exp_avg_sq) lb_encode_block<LB_INT8, LB_UNSIGNED, LB_STOCHASTIC>(buf_exp_avg_sq, nullptr, len, mult_exp_avg_sq, p_exp_avg_sq_codes);
+  const float c_clone_default = s[7];
-  const float c_t8 = c_lerp_small ? c_sub_1 : (c_sub_1 - (float)0x1.0000000000000p+0);
-  const float c_t9 = (float)0x1.0000000000000p+0 / c_pow_3;
+  const float c_t9 = c_lerp_small ? c_sub_1 : (c_sub_1 - (float)0x1.0000000000000p+0);
+  const float c_t10 = (float)0x1.0000000000000p+0 / c_pow_3;
+  const lb_rand h_exp_avg_rand = {lb_hash32_s((uint32_t)c_clone_default ^ (1u << 24)), start};
+  const lb_rand h_exp_avg_sq_rand = {lb_hash32_s((uint32_t)c_clone_default ^ (2u << 24)), start};
-        lb_st_codes(q_codes_exp_avg + i, lb_encode_at<LB_INT8, LB_SIGNED, LB_PLAIN>(buf_exp_avg, nullptr, i, q_mult_exp_avg, q_codes_exp_avg));
-        lb_st_codes(q_codes_exp_avg_sq + i, lb_encode_at<LB_INT8, LB_UNSIGNED, LB_PLAIN>(buf_exp_avg_sq, nullptr, i, q_mult_exp_avg_sq, q_codes_exp_avg_sq));
+        lb_st_codes(q_codes_exp_avg + i, lb_encode_at<LB_INT8, LB_SIGNED, LB_STOCHASTIC>(buf_exp_avg, nullptr, i, q_mult_exp_avg, q_codes_exp_avg));
+        lb_st_codes(q_codes_exp_avg_sq + i, lb_encode_at<LB_INT8, LB_UNSIGNED, LB_STOCHASTIC>(buf_exp_avg_sq, nullptr, i, q_mult_exp_avg_sq, q_codes_exp_avg_sq));
-      const vf v_lerp = lb_fma(lb_splat(c_t8), v_lerp_diff, (c_lerp_small ? v_dequantize_default_decoded : v_grad));
+      const vf v_lerp = lb_fma(lb_splat(c_t9), v_lerp_diff, (c_lerp_small ? v_dequantize_default_decoded : v_grad));
-        const vf v_div = v_sqrt * lb_splat(c_t9);
+        const vf v_div = v_sqrt * lb_splat(c_t10);
-      const vf v_div = v_sqrt * lb_splat(c_t9);
+      const vf v_div = v_sqrt * lb_splat(c_t10);
-      const vf v_lerp = lb_fma(lb_splat(c_t8), v_lerp_diff, (c_lerp_small ? v_dequantize_default_decoded : v_grad));
+      const vf v_lerp = lb_fma(lb_splat(c_t9), v_lerp_diff, (c_lerp_small ? v_dequantize_default_decoded : v_grad));
-      const vf v_div = v_sqrt * lb_splat(c_t9);
+      const vf v_div = v_sqrt * lb_splat(c_t10);
-  job.enc[0] = lb_quantize_scale<LB_INT8, LB_SIGNED, 0>(acc_exp_avg, buf_exp_avg, len, LB_BLOCK, p_exp_avg_codes, p_exp_avg_scales, p_exp_avg_patch_values, p_exp_avg_patch_index, &job.mult[0]);
+  job.enc[0] = lb_quantize_scale<LB_INT8, LB_SIGNED, 0, LB_STOCHASTIC>(acc_exp_avg, buf_exp_avg, len, LB_BLOCK, p_exp_avg_codes, p_exp_avg_scales, p_exp_avg_patch_values, p_exp_avg_patch_index, &job.mult[0], h_exp_avg_rand);
-  job.enc[1] = lb_quantize_scale<LB_INT8, LB_UNSIGNED, 0>(acc_exp_avg_sq, buf_exp_avg_sq, len, LB_BLOCK, p_exp_avg_sq_codes, p_exp_avg_sq_scales, p_exp_avg_sq_patch_values, p_exp_avg_sq_patch_index, &job.mult[1]);
+  job.enc[1] = lb_quantize_scale<LB_INT8, LB_UNSIGNED, 0, LB_STOCHASTIC>(acc_exp_avg_sq, buf_exp_avg_sq, len, LB_BLOCK, p_exp_avg_sq_codes, p_exp_avg_sq_scales, p_exp_avg_sq_patch_values, p_exp_avg_sq_patch_index, &job.mult[1], h_exp_avg_sq_rand);""")

    def test_the_triton_kernel_passes_the_counter_and_the_stream(self):
        printer = pytest.importorskip("lowbit_compile.kernels.triton_printer")
        out = []
        for label, target in (("float8", Target("cuda")), ("integer fp8", Target("cuda", fp8_native=False))):
            nearest = printer.emit_kernel(body(_adamw(), "fp8_e4m3"), "step", target).source
            stochastic = printer.emit_kernel(body(_adamw(), "fp8_e4m3", rounding="stochastic"), "step", target).source
            out += [f"== {label}", _diff(nearest, stochastic)]
        self.assertExpectedInline("\n".join(out), """\
== float8
-    sub_1, hp_betas_1, sub_2, pow_3, hp_eps, neg, n_elements, first_block, BLOCK: tl.constexpr, ROWS: tl.constexpr,
+    sub_1, hp_betas_1, sub_2, pow_3, hp_eps, neg, clone_default_ptr, n_elements, first_block, BLOCK: tl.constexpr,
+    ROWS: tl.constexpr,
+    clone_default = lb.load_scalar(clone_default_ptr, lb.F32)
-                POS_INF_CODE=126, NEG_INF_CODE=254, NAN_CODE=127, APPROXIMATE=True)
+                POS_INF_CODE=126, NEG_INF_CODE=254, NAN_CODE=127, APPROXIMATE=True, seed=clone_default, STREAM=1)
-                POS_INF_CODE=126, NEG_INF_CODE=254, NAN_CODE=127, APPROXIMATE=True)
+                POS_INF_CODE=126, NEG_INF_CODE=254, NAN_CODE=127, APPROXIMATE=True, seed=clone_default, STREAM=2)
== integer fp8
-    sub_1, hp_betas_1, sub_2, pow_3, hp_eps, neg, n_elements, first_block, BLOCK: tl.constexpr, ROWS: tl.constexpr,
+    sub_1, hp_betas_1, sub_2, pow_3, hp_eps, neg, clone_default_ptr, n_elements, first_block, BLOCK: tl.constexpr,
+    ROWS: tl.constexpr,
+    clone_default = lb.load_scalar(clone_default_ptr, lb.F32)
-                APPROXIMATE=True)
+                APPROXIMATE=True, seed=clone_default, STREAM=1)
-                APPROXIMATE=True)
+                APPROXIMATE=True, seed=clone_default, STREAM=2)""")
