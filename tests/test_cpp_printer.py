"""Snapshots of the C++ the CPU backend prints: the default layout's kernel in full, the stock-exact
kernel (torch's own sqrt), and per format the lines that differ, so a change in the generated kernel
shows in review."""

from __future__ import annotations

import difflib
import re

import torch
from expecttest import TestCase

from examples.lion import Lion
from lowbit_compile.config import DEFAULT_FMT
from lowbit_compile.kernels.cpp_printer import emit_step, format_constants
from lowbit_compile.kernels.lowering import Target
from lowbit_compile.passes.opmath import compute_in_fp32
from lowbit_compile.passes.split import split_prologue
from lowbit_compile.runtime.wrap import SUPPORTED

from .graphs import body, pass_graphs

FAST = Target("cpu", reciprocal_divisor=True)  # what the CPU backend builds for quantized states
EXACT = Target("cpu", torch_sqrt=True)  # and for stock (fp32) states


def _adamw(fmt=DEFAULT_FMT, dtype=torch.float32, **layout):
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.randn(64, dtype=dtype))], weight_decay=0.1)
    return body(opt, fmt, **layout)


def _kernel(source: str) -> str:
    """The per-block function (the entry point and tables are fixed text)."""
    start = source.index("static void lb_step_block")
    return source[start:source.index("\n}\n", start) + 2]


def _vector_loop(kernel: str) -> str:
    """The block function up to the end of its whole-vector loop (the tail repeats the same body)."""
    return kernel[:kernel.index("    if (i < len) {")]


def _diff(a: str, b: str) -> str:
    lines = difflib.unified_diff(a.splitlines(), b.splitlines(), n=0, lineterm="")
    return "\n".join(line for line in lines if not line.startswith(("@@", "---", "+++")))


class TestPrintedKernels(TestCase):
    def test_default_layout_adamw(self):
        """The default, sqrt8 in blocks of 512, no patches: per block, scalars and lerp's weight tests once,
        the lane loop compiled for each kind of block (lb_versions: codes pending or not, lerp's weight
        small or not), then per vector the previous block's codes of that vector (from the block buffers, before they are
        overwritten), a prefetch of the next block's inputs, decode m and v (the code squared, times scale), the
        update in fp32 with ATen's fmas and a multiply by 1/bias_correction, the param store, m and v into block
        buffers with lane maxima; then each buffer's scale, its codes left to the next block (or lb_finish: a
        block of another length, or the last, in loops of their own)."""
        source = emit_step(_adamw(), FAST).source
        kernel = _kernel(source)
        job = source[source.index("typedef lb_pending"):source.index("static void lb_step_block")]
        after_tail = kernel.index("\n  }", kernel.index("    if (i < len) {")) + 1  # the lane loop's end
        self.assertExpectedInline(job + _vector_loop(kernel) + kernel[after_tail:], """\
typedef lb_pending<2> lb_job;
static void lb_finish(lb_job& job, const float* scratch) {
  if (!job.len) return;
  const int64_t len = job.len;
  job.len = 0;
  const float* buf_exp_avg = scratch + 0 * LB_BLOCK;
  uint8_t* p_exp_avg_codes = job.codes[0];
  const float mult_exp_avg = job.mult[0];
  const bool enc_exp_avg = job.enc[0];
  const float* buf_exp_avg_sq = scratch + 1 * LB_BLOCK;
  const float* root_exp_avg_sq = scratch + 2 * LB_BLOCK;
  uint8_t* p_exp_avg_sq_codes = job.codes[1];
  const float mult_exp_avg_sq = job.mult[1];
  const bool enc_exp_avg_sq = job.enc[1];
  if (enc_exp_avg && enc_exp_avg_sq) {
    lb_encode_pair<LB_SQRT8, LB_SIGNED, LB_PLAIN, LB_SQRT8, LB_UNSIGNED, LB_STOCHASTIC | LB_ROOT>(buf_exp_avg, nullptr, mult_exp_avg, p_exp_avg_codes, {}, buf_exp_avg_sq, root_exp_avg_sq, mult_exp_avg_sq, p_exp_avg_sq_codes, job.rnd[1], len);
  } else {
    if (enc_exp_avg) lb_encode_block<LB_SQRT8, LB_SIGNED, LB_PLAIN>(buf_exp_avg, nullptr, len, mult_exp_avg, p_exp_avg_codes, {});
    if (enc_exp_avg_sq) lb_encode_block<LB_SQRT8, LB_UNSIGNED, LB_STOCHASTIC>(buf_exp_avg_sq, root_exp_avg_sq, len, mult_exp_avg_sq, p_exp_avg_sq_codes, job.rnd[1]);
  }
}

static void lb_step_block(const int64_t* ptr, const float* s, int64_t start, int64_t len, int64_t blk,
                          float* scratch, lb_job& job) {
  float* __restrict p_param = (float*)ptr[0] + start;
  const float* __restrict p_grad = (const float*)ptr[1] + start;
  uint8_t* __restrict p_exp_avg_codes = (uint8_t*)ptr[2] + start;
  float* __restrict p_exp_avg_scales = (float*)ptr[3] + blk;
  uint16_t* __restrict p_exp_avg_patch_values = (uint16_t*)ptr[4] + blk * 0;
  int16_t* __restrict p_exp_avg_patch_index = (int16_t*)ptr[5] + blk * 0;
  uint8_t* __restrict p_exp_avg_sq_codes = (uint8_t*)ptr[6] + start;
  float* __restrict p_exp_avg_sq_scales = (float*)ptr[7] + blk;
  uint16_t* __restrict p_exp_avg_sq_patch_values = (uint16_t*)ptr[8] + blk * 0;
  int16_t* __restrict p_exp_avg_sq_patch_index = (int16_t*)ptr[9] + blk * 0;
  const float c_sub = s[0];
  const float c_sub_1 = s[1];
  const float c_hp_betas_1 = s[2];
  const float c_sub_2 = s[3];
  const float c_pow_3 = s[4];
  const float c_hp_eps = s[5];
  const float c_neg = s[6];
  const float c_clone_default = s[7];
  const bool c_lerp_small = __builtin_fabsf(c_sub_1) < (float)0x1.0000000000000p-1;
  const float c_t9 = c_lerp_small ? c_sub_1 : (c_sub_1 - (float)0x1.0000000000000p+0);
  const float c_t10 = (float)0x1.0000000000000p+0 / c_pow_3;
  const lb_rand h_exp_avg_sq_rand = {lb_hash32_s((uint32_t)c_clone_default ^ (2u << 24)), start};
  float* __restrict buf_exp_avg = scratch + 0 * LB_BLOCK;
  const vf SC_exp_avg = lb_splat(__builtin_fabsf(*p_exp_avg_scales));
  const bool FL_exp_avg = __builtin_signbit(*p_exp_avg_scales);  // a flagged block
  vi acc_exp_avg = lb_splat_i(-1);
  float* __restrict buf_exp_avg_sq = scratch + 1 * LB_BLOCK;
  const vf SC_exp_avg_sq = lb_splat(__builtin_fabsf(*p_exp_avg_sq_scales));
  const bool FL_exp_avg_sq = __builtin_signbit(*p_exp_avg_sq_scales);  // a flagged block
  vi acc_exp_avg_sq = lb_splat_i(-1);
  float* __restrict root_exp_avg_sq = scratch + 2 * LB_BLOCK;
  const auto fuse = lb_fuse_if(job.len == len && len % (4 * LB_W) == 0 && lb_fusable<LB_SQRT8, LB_SIGNED, LB_PLAIN>(job.enc[0], job.mult[0]) && lb_fusable<LB_SQRT8, LB_UNSIGNED, LB_ROOT>(job.enc[1], job.mult[1]));
  if (!fuse) lb_finish(job, scratch);
  uint8_t* __restrict q_codes_exp_avg = job.codes[0];
  const vf q_mult_exp_avg = lb_splat(job.mult[0]);
  uint8_t* __restrict q_codes_exp_avg_sq = job.codes[1];
  const vf q_mult_exp_avg_sq = lb_splat(job.mult[1]);
  const lb_rand q_rand_exp_avg_sq = job.rnd[1];
  const auto lanes0 = [&](auto fuse, auto c_lerp_small) LB_INLINE_LAMBDA {
    int64_t i = 0;
    int64_t prev_i = -1;  // the lane vector whose late part is pending
    vf prev_v_param = {};
    vf prev_v_lerp = {};
    vf prev_v_sqrt = {};
    for (; i + LB_W <= len; i += LB_W) {
      const bool full = true;
      const int64_t r = LB_W;
      lb_prefetch(p_param + i, LB_BLOCK);
      lb_prefetch(p_grad + i, LB_BLOCK);
      lb_prefetch(p_exp_avg_codes + i, LB_BLOCK);
      lb_prefetch(p_exp_avg_sq_codes + i, LB_BLOCK);
      if (fuse && (i & (4 * LB_W - 1)) == 0) {
        lb_encode_x4<LB_SQRT8, LB_SIGNED, LB_PLAIN>(buf_exp_avg, nullptr, i, q_mult_exp_avg, {}, q_codes_exp_avg);
        lb_encode_x4<LB_SQRT8, LB_UNSIGNED, LB_STOCHASTIC | LB_ROOT>(buf_exp_avg_sq, root_exp_avg_sq, i, q_mult_exp_avg_sq, q_rand_exp_avg_sq, q_codes_exp_avg_sq);
      }
      const vf v_param = full ? lb_ld(p_param + i) : lb_ld_n(p_param + i, r);
      const vf v_grad = full ? lb_ld(p_grad + i) : lb_ld_n(p_grad + i, r);
      vf v_dequantize_default_decoded = lb_decode_scaled<LB_SQRT8, LB_SIGNED>(full ? lb_ld_codes<LB_SQRT8, LB_SIGNED>(p_exp_avg_codes + i) : lb_ld_codes_n<LB_SQRT8, LB_SIGNED>(p_exp_avg_codes + i, r), SC_exp_avg, FL_exp_avg);
      vf v_dequantize_default_1_decoded = lb_decode_scaled<LB_SQRT8, LB_UNSIGNED>(full ? lb_ld_codes<LB_SQRT8, LB_UNSIGNED>(p_exp_avg_sq_codes + i) : lb_ld_codes_n<LB_SQRT8, LB_UNSIGNED>(p_exp_avg_sq_codes + i, r), SC_exp_avg_sq, FL_exp_avg_sq);
      const vf v_lerp_diff = v_grad - v_dequantize_default_decoded;
      const vf v_lerp = lb_fma(lb_splat(c_t9), v_lerp_diff, (c_lerp_small ? v_dequantize_default_decoded : v_grad));
      const vf v_mul_2 = v_dequantize_default_1_decoded * lb_splat(c_hp_betas_1);
      const vf v_addcmul = lb_fma((lb_splat(c_sub_2) * v_grad), v_grad, v_mul_2);
      const vf v_sqrt = lb_sqrt(v_addcmul);
      if (full) lb_st(buf_exp_avg + i, v_lerp); else lb_st_n(buf_exp_avg + i, v_lerp, r);
      acc_exp_avg = lb_vmax(acc_exp_avg, lb_key_masked(v_lerp, r));
      if (full) lb_st(buf_exp_avg_sq + i, v_addcmul); else lb_st_n(buf_exp_avg_sq + i, v_addcmul, r);
      acc_exp_avg_sq = lb_vmax(acc_exp_avg_sq, lb_key_masked(v_addcmul, r));
      if (full) lb_st(root_exp_avg_sq + i, v_sqrt); else lb_st_n(root_exp_avg_sq + i, v_sqrt, r);
      if (prev_i >= 0) {
        const int64_t i = prev_i;
        const vf v_param = prev_v_param;
        const vf v_lerp = prev_v_lerp;
        const vf v_sqrt = prev_v_sqrt;
        const vf v_mul_1 = v_param * lb_splat(c_sub);
        const vf v_div = v_sqrt * lb_splat(c_t10);
        const vf v_add_1 = v_div + lb_splat(c_hp_eps);
        const vf v_addcdiv = v_mul_1 + ((lb_splat(c_neg) * v_lerp) / v_add_1);
        if (full) lb_st(p_param + i, v_addcdiv); else lb_st_n(p_param + i, v_addcdiv, r);
      }
      prev_v_param = v_param;
      prev_v_lerp = v_lerp;
      prev_v_sqrt = v_sqrt;
      prev_i = i;
    }
    if (prev_i >= 0) {
      const bool full = true;
      const int64_t r = LB_W;
      const int64_t i = prev_i;
      const vf v_param = prev_v_param;
      const vf v_lerp = prev_v_lerp;
      const vf v_sqrt = prev_v_sqrt;
      const vf v_mul_1 = v_param * lb_splat(c_sub);
      const vf v_div = v_sqrt * lb_splat(c_t10);
      const vf v_add_1 = v_div + lb_splat(c_hp_eps);
      const vf v_addcdiv = v_mul_1 + ((lb_splat(c_neg) * v_lerp) / v_add_1);
      if (full) lb_st(p_param + i, v_addcdiv); else lb_st_n(p_param + i, v_addcdiv, r);
    }
  };
  lb_versions(lanes0, fuse, c_lerp_small);
  job.len = len;
  job.codes[0] = p_exp_avg_codes;
  job.enc[0] = lb_quantize_scale<LB_SQRT8, LB_SIGNED, 0>(acc_exp_avg, buf_exp_avg, len, LB_BLOCK, p_exp_avg_codes, p_exp_avg_scales, p_exp_avg_patch_values, p_exp_avg_patch_index, &job.mult[0]);
  job.codes[1] = p_exp_avg_sq_codes;
  job.rnd[1] = h_exp_avg_sq_rand;
  job.enc[1] = lb_quantize_scale<LB_SQRT8, LB_UNSIGNED, 0, LB_STOCHASTIC>(acc_exp_avg_sq, buf_exp_avg_sq, len, LB_BLOCK, p_exp_avg_sq_codes, p_exp_avg_sq_scales, p_exp_avg_sq_patch_values, p_exp_avg_sq_patch_index, &job.mult[1], h_exp_avg_sq_rand, root_exp_avg_sq);
}""")

    def test_fp32_states_take_torch_sqrt(self):
        """Stock states: a first pass writes v to a buffer for torch's own square root, the second runs
        the update reading it back; true division everywhere."""
        kernel = _kernel(emit_step(_adamw("fp32"), EXACT).source)
        self.assertExpectedInline(kernel, """\
static void lb_step_block(const int64_t* ptr, const float* s, int64_t start, int64_t len, int64_t blk,
                          float* scratch) {
  float* __restrict p_param = (float*)ptr[0] + start;
  const float* __restrict p_grad = (const float*)ptr[1] + start;
  float* __restrict p_state_exp_avg = (float*)ptr[2] + start;
  float* __restrict p_state_exp_avg_sq = (float*)ptr[3] + start;
  const float c_sub = s[0];
  const float c_sub_1 = s[1];
  const float c_hp_betas_1 = s[2];
  const float c_sub_2 = s[3];
  const float c_pow_3 = s[4];
  const float c_hp_eps = s[5];
  const float c_neg = s[6];
  const bool c_lerp_small = __builtin_fabsf(c_sub_1) < (float)0x1.0000000000000p-1;
  const float c_t8 = c_lerp_small ? c_sub_1 : (c_sub_1 - (float)0x1.0000000000000p+0);
  float* __restrict sq0 = scratch + 0 * LB_BLOCK;
  {
    int64_t i = 0;
    for (; i + LB_W <= len; i += LB_W) {
      const bool full = true;
      const int64_t r = LB_W;
      lb_prefetch(p_param + i, LB_BLOCK);
      lb_prefetch(p_grad + i, LB_BLOCK);
      lb_prefetch(p_state_exp_avg + i, LB_BLOCK);
      lb_prefetch(p_state_exp_avg_sq + i, LB_BLOCK);
      const vf v_grad = full ? lb_ld(p_grad + i) : lb_ld_n(p_grad + i, r);
      const vf v_state_exp_avg_sq = full ? lb_ld(p_state_exp_avg_sq + i) : lb_ld_n(p_state_exp_avg_sq + i, r);
      const vf v_mul_2 = v_state_exp_avg_sq * lb_splat(c_hp_betas_1);
      const vf v_addcmul = lb_fma((lb_splat(c_sub_2) * v_grad), v_grad, v_mul_2);
      if (full) lb_st(sq0 + i, v_addcmul); else lb_st_n(sq0 + i, v_addcmul, r);
    }
    if (i < len) {
      const bool full = false;
      const int64_t r = len - i;
      const vf v_grad = full ? lb_ld(p_grad + i) : lb_ld_n(p_grad + i, r);
      const vf v_state_exp_avg_sq = full ? lb_ld(p_state_exp_avg_sq + i) : lb_ld_n(p_state_exp_avg_sq + i, r);
      const vf v_mul_2 = v_state_exp_avg_sq * lb_splat(c_hp_betas_1);
      const vf v_addcmul = lb_fma((lb_splat(c_sub_2) * v_grad), v_grad, v_mul_2);
      if (full) lb_st(sq0 + i, v_addcmul); else lb_st_n(sq0 + i, v_addcmul, r);
    }
  }
  lb_vsqrt(len, sq0);
  const auto lanes1 = [&](auto c_lerp_small) LB_INLINE_LAMBDA {
    int64_t i = 0;
    int64_t prev_i = -1;  // the lane vector whose late part is pending
    vf prev_v_param = {};
    vf prev_v_lerp = {};
    vf prev_v_sqrt0 = {};
    for (; i + LB_W <= len; i += LB_W) {
      const bool full = true;
      const int64_t r = LB_W;
      const vf v_param = full ? lb_ld(p_param + i) : lb_ld_n(p_param + i, r);
      const vf v_grad = full ? lb_ld(p_grad + i) : lb_ld_n(p_grad + i, r);
      const vf v_state_exp_avg = full ? lb_ld(p_state_exp_avg + i) : lb_ld_n(p_state_exp_avg + i, r);
      const vf v_state_exp_avg_sq = full ? lb_ld(p_state_exp_avg_sq + i) : lb_ld_n(p_state_exp_avg_sq + i, r);
      const vf v_lerp_diff = v_grad - v_state_exp_avg;
      const vf v_lerp = lb_fma(lb_splat(c_t8), v_lerp_diff, (c_lerp_small ? v_state_exp_avg : v_grad));
      const vf v_mul_2 = v_state_exp_avg_sq * lb_splat(c_hp_betas_1);
      const vf v_addcmul = lb_fma((lb_splat(c_sub_2) * v_grad), v_grad, v_mul_2);
      const vf v_sqrt0 = full ? lb_ld(sq0 + i) : lb_ld_n(sq0 + i, r);
      if (full) lb_st(p_state_exp_avg + i, v_lerp); else lb_st_n(p_state_exp_avg + i, v_lerp, r);
      if (full) lb_st(p_state_exp_avg_sq + i, v_addcmul); else lb_st_n(p_state_exp_avg_sq + i, v_addcmul, r);
      if (prev_i >= 0) {
        const int64_t i = prev_i;
        const vf v_param = prev_v_param;
        const vf v_lerp = prev_v_lerp;
        const vf v_sqrt0 = prev_v_sqrt0;
        const vf v_mul_1 = v_param * lb_splat(c_sub);
        const vf v_div = v_sqrt0 / lb_splat(c_pow_3);
        const vf v_add_1 = v_div + lb_splat(c_hp_eps);
        const vf v_addcdiv = v_mul_1 + ((lb_splat(c_neg) * v_lerp) / v_add_1);
        if (full) lb_st(p_param + i, v_addcdiv); else lb_st_n(p_param + i, v_addcdiv, r);
      }
      prev_v_param = v_param;
      prev_v_lerp = v_lerp;
      prev_v_sqrt0 = v_sqrt0;
      prev_i = i;
    }
    if (prev_i >= 0) {
      const bool full = true;
      const int64_t r = LB_W;
      const int64_t i = prev_i;
      const vf v_param = prev_v_param;
      const vf v_lerp = prev_v_lerp;
      const vf v_sqrt0 = prev_v_sqrt0;
      const vf v_mul_1 = v_param * lb_splat(c_sub);
      const vf v_div = v_sqrt0 / lb_splat(c_pow_3);
      const vf v_add_1 = v_div + lb_splat(c_hp_eps);
      const vf v_addcdiv = v_mul_1 + ((lb_splat(c_neg) * v_lerp) / v_add_1);
      if (full) lb_st(p_param + i, v_addcdiv); else lb_st_n(p_param + i, v_addcdiv, r);
    }
    if (i < len) {
      const bool full = false;
      const int64_t r = len - i;
      const vf v_param = full ? lb_ld(p_param + i) : lb_ld_n(p_param + i, r);
      const vf v_grad = full ? lb_ld(p_grad + i) : lb_ld_n(p_grad + i, r);
      const vf v_state_exp_avg = full ? lb_ld(p_state_exp_avg + i) : lb_ld_n(p_state_exp_avg + i, r);
      const vf v_state_exp_avg_sq = full ? lb_ld(p_state_exp_avg_sq + i) : lb_ld_n(p_state_exp_avg_sq + i, r);
      const vf v_lerp_diff = v_grad - v_state_exp_avg;
      const vf v_lerp = lb_fma(lb_splat(c_t8), v_lerp_diff, (c_lerp_small ? v_state_exp_avg : v_grad));
      const vf v_mul_2 = v_state_exp_avg_sq * lb_splat(c_hp_betas_1);
      const vf v_addcmul = lb_fma((lb_splat(c_sub_2) * v_grad), v_grad, v_mul_2);
      const vf v_sqrt0 = full ? lb_ld(sq0 + i) : lb_ld_n(sq0 + i, r);
      if (full) lb_st(p_state_exp_avg + i, v_lerp); else lb_st_n(p_state_exp_avg + i, v_lerp, r);
      if (full) lb_st(p_state_exp_avg_sq + i, v_addcmul); else lb_st_n(p_state_exp_avg_sq + i, v_addcmul, r);
      const vf v_mul_1 = v_param * lb_splat(c_sub);
      const vf v_div = v_sqrt0 / lb_splat(c_pow_3);
      const vf v_add_1 = v_div + lb_splat(c_hp_eps);
      const vf v_addcdiv = v_mul_1 + ((lb_splat(c_neg) * v_lerp) / v_add_1);
      if (full) lb_st(p_param + i, v_addcdiv); else lb_st_n(p_param + i, v_addcdiv, r);
    }
  };
  lb_versions(lanes1, c_lerp_small);
}""")

    def test_each_format_changes_only_its_decode_and_encode(self):
        default = _kernel(emit_step(_adamw(), FAST).source)
        out = []
        for fmt, layout in (("int8", {}), ("dynamic8", {}), ("fp8_e4m3", {}), ("fp8_e5m2", {}), ("bf16", {}),
                            ("int8", {"block_size": 2048, "outliers": 2}), ("sqrt4", {"block_size": 512})):
            kernel = _kernel(emit_step(_adamw(fmt, **layout), FAST).source)
            out.append(f"== {fmt} {layout}\n" + _diff(_vector_loop(default), _vector_loop(kernel)))
        self.assertExpectedInline("\n".join(out), """\
== int8 {}
-  float* __restrict root_exp_avg_sq = scratch + 2 * LB_BLOCK;
-  const auto fuse = lb_fuse_if(job.len == len && len % (4 * LB_W) == 0 && lb_fusable<LB_SQRT8, LB_SIGNED, LB_PLAIN>(job.enc[0], job.mult[0]) && lb_fusable<LB_SQRT8, LB_UNSIGNED, LB_ROOT>(job.enc[1], job.mult[1]));
+  const auto fuse = lb_fuse_if(job.len == len && len % (4 * LB_W) == 0 && lb_fusable<LB_INT8, LB_SIGNED, LB_PLAIN>(job.enc[0], job.mult[0]) && lb_fusable<LB_INT8, LB_UNSIGNED, LB_PLAIN>(job.enc[1], job.mult[1]));
-    vf prev_v_sqrt = {};
+    vf prev_v_addcmul = {};
-        lb_encode_x4<LB_SQRT8, LB_SIGNED, LB_PLAIN>(buf_exp_avg, nullptr, i, q_mult_exp_avg, {}, q_codes_exp_avg);
-        lb_encode_x4<LB_SQRT8, LB_UNSIGNED, LB_STOCHASTIC | LB_ROOT>(buf_exp_avg_sq, root_exp_avg_sq, i, q_mult_exp_avg_sq, q_rand_exp_avg_sq, q_codes_exp_avg_sq);
+        lb_encode_x4<LB_INT8, LB_SIGNED, LB_PLAIN>(buf_exp_avg, nullptr, i, q_mult_exp_avg, {}, q_codes_exp_avg);
+        lb_encode_x4<LB_INT8, LB_UNSIGNED, LB_STOCHASTIC>(buf_exp_avg_sq, nullptr, i, q_mult_exp_avg_sq, q_rand_exp_avg_sq, q_codes_exp_avg_sq);
-      vf v_dequantize_default_decoded = lb_decode_scaled<LB_SQRT8, LB_SIGNED>(full ? lb_ld_codes<LB_SQRT8, LB_SIGNED>(p_exp_avg_codes + i) : lb_ld_codes_n<LB_SQRT8, LB_SIGNED>(p_exp_avg_codes + i, r), SC_exp_avg, FL_exp_avg);
-      vf v_dequantize_default_1_decoded = lb_decode_scaled<LB_SQRT8, LB_UNSIGNED>(full ? lb_ld_codes<LB_SQRT8, LB_UNSIGNED>(p_exp_avg_sq_codes + i) : lb_ld_codes_n<LB_SQRT8, LB_UNSIGNED>(p_exp_avg_sq_codes + i, r), SC_exp_avg_sq, FL_exp_avg_sq);
+      vf v_dequantize_default_decoded = lb_decode_scaled<LB_INT8, LB_SIGNED>(full ? lb_ld_codes<LB_INT8, LB_SIGNED>(p_exp_avg_codes + i) : lb_ld_codes_n<LB_INT8, LB_SIGNED>(p_exp_avg_codes + i, r), SC_exp_avg, FL_exp_avg);
+      vf v_dequantize_default_1_decoded = lb_decode_scaled<LB_INT8, LB_UNSIGNED>(full ? lb_ld_codes<LB_INT8, LB_UNSIGNED>(p_exp_avg_sq_codes + i) : lb_ld_codes_n<LB_INT8, LB_UNSIGNED>(p_exp_avg_sq_codes + i, r), SC_exp_avg_sq, FL_exp_avg_sq);
-      const vf v_sqrt = lb_sqrt(v_addcmul);
-      if (full) lb_st(root_exp_avg_sq + i, v_sqrt); else lb_st_n(root_exp_avg_sq + i, v_sqrt, r);
-        const vf v_sqrt = prev_v_sqrt;
+        const vf v_addcmul = prev_v_addcmul;
+        const vf v_sqrt = lb_sqrt(v_addcmul);
-      prev_v_sqrt = v_sqrt;
+      prev_v_addcmul = v_addcmul;
-      const vf v_sqrt = prev_v_sqrt;
+      const vf v_addcmul = prev_v_addcmul;
+      const vf v_sqrt = lb_sqrt(v_addcmul);
== dynamic8 {}
-  float* __restrict root_exp_avg_sq = scratch + 2 * LB_BLOCK;
-  const auto fuse = lb_fuse_if(job.len == len && len % (4 * LB_W) == 0 && lb_fusable<LB_SQRT8, LB_SIGNED, LB_PLAIN>(job.enc[0], job.mult[0]) && lb_fusable<LB_SQRT8, LB_UNSIGNED, LB_ROOT>(job.enc[1], job.mult[1]));
-  if (!fuse) lb_finish(job, scratch);
-  uint8_t* __restrict q_codes_exp_avg = job.codes[0];
-  const vf q_mult_exp_avg = lb_splat(job.mult[0]);
-  uint8_t* __restrict q_codes_exp_avg_sq = job.codes[1];
-  const vf q_mult_exp_avg_sq = lb_splat(job.mult[1]);
-  const lb_rand q_rand_exp_avg_sq = job.rnd[1];
-  const auto lanes0 = [&](auto fuse, auto c_lerp_small) LB_INLINE_LAMBDA {
+  const auto lanes0 = [&](auto c_lerp_small) LB_INLINE_LAMBDA {
-    vf prev_v_sqrt = {};
+    vf prev_v_addcmul = {};
-      if (fuse && (i & (4 * LB_W - 1)) == 0) {
-        lb_encode_x4<LB_SQRT8, LB_SIGNED, LB_PLAIN>(buf_exp_avg, nullptr, i, q_mult_exp_avg, {}, q_codes_exp_avg);
-        lb_encode_x4<LB_SQRT8, LB_UNSIGNED, LB_STOCHASTIC | LB_ROOT>(buf_exp_avg_sq, root_exp_avg_sq, i, q_mult_exp_avg_sq, q_rand_exp_avg_sq, q_codes_exp_avg_sq);
-      }
-      vf v_dequantize_default_decoded = lb_decode_scaled<LB_SQRT8, LB_SIGNED>(full ? lb_ld_codes<LB_SQRT8, LB_SIGNED>(p_exp_avg_codes + i) : lb_ld_codes_n<LB_SQRT8, LB_SIGNED>(p_exp_avg_codes + i, r), SC_exp_avg, FL_exp_avg);
-      vf v_dequantize_default_1_decoded = lb_decode_scaled<LB_SQRT8, LB_UNSIGNED>(full ? lb_ld_codes<LB_SQRT8, LB_UNSIGNED>(p_exp_avg_sq_codes + i) : lb_ld_codes_n<LB_SQRT8, LB_UNSIGNED>(p_exp_avg_sq_codes + i, r), SC_exp_avg_sq, FL_exp_avg_sq);
+      vf v_dequantize_default_decoded = lb_decode_scaled<LB_DYNAMIC8, LB_SIGNED>(full ? lb_ld_codes<LB_DYNAMIC8, LB_SIGNED>(p_exp_avg_codes + i) : lb_ld_codes_n<LB_DYNAMIC8, LB_SIGNED>(p_exp_avg_codes + i, r), SC_exp_avg, FL_exp_avg);
+      vf v_dequantize_default_1_decoded = lb_decode_scaled<LB_DYNAMIC8, LB_UNSIGNED>(full ? lb_ld_codes<LB_DYNAMIC8, LB_UNSIGNED>(p_exp_avg_sq_codes + i) : lb_ld_codes_n<LB_DYNAMIC8, LB_UNSIGNED>(p_exp_avg_sq_codes + i, r), SC_exp_avg_sq, FL_exp_avg_sq);
-      const vf v_sqrt = lb_sqrt(v_addcmul);
-      if (full) lb_st(root_exp_avg_sq + i, v_sqrt); else lb_st_n(root_exp_avg_sq + i, v_sqrt, r);
-        const vf v_sqrt = prev_v_sqrt;
+        const vf v_addcmul = prev_v_addcmul;
+        const vf v_sqrt = lb_sqrt(v_addcmul);
-      prev_v_sqrt = v_sqrt;
+      prev_v_addcmul = v_addcmul;
-      const vf v_sqrt = prev_v_sqrt;
+      const vf v_addcmul = prev_v_addcmul;
+      const vf v_sqrt = lb_sqrt(v_addcmul);
== fp8_e4m3 {}
-  float* __restrict root_exp_avg_sq = scratch + 2 * LB_BLOCK;
-  const auto fuse = lb_fuse_if(job.len == len && len % (4 * LB_W) == 0 && lb_fusable<LB_SQRT8, LB_SIGNED, LB_PLAIN>(job.enc[0], job.mult[0]) && lb_fusable<LB_SQRT8, LB_UNSIGNED, LB_ROOT>(job.enc[1], job.mult[1]));
+  const auto fuse = lb_fuse_if(job.len == len && len % (4 * LB_W) == 0 && lb_fusable<LB_E4M3, LB_SIGNED, LB_PLAIN>(job.enc[0], job.mult[0]) && lb_fusable<LB_E4M3, LB_UNSIGNED, LB_PLAIN>(job.enc[1], job.mult[1]));
-    vf prev_v_sqrt = {};
+    vf prev_v_addcmul = {};
-        lb_encode_x4<LB_SQRT8, LB_SIGNED, LB_PLAIN>(buf_exp_avg, nullptr, i, q_mult_exp_avg, {}, q_codes_exp_avg);
-        lb_encode_x4<LB_SQRT8, LB_UNSIGNED, LB_STOCHASTIC | LB_ROOT>(buf_exp_avg_sq, root_exp_avg_sq, i, q_mult_exp_avg_sq, q_rand_exp_avg_sq, q_codes_exp_avg_sq);
+        lb_encode_x4<LB_E4M3, LB_SIGNED, LB_PLAIN>(buf_exp_avg, nullptr, i, q_mult_exp_avg, {}, q_codes_exp_avg);
+        lb_encode_x4<LB_E4M3, LB_UNSIGNED, LB_STOCHASTIC>(buf_exp_avg_sq, nullptr, i, q_mult_exp_avg_sq, q_rand_exp_avg_sq, q_codes_exp_avg_sq);
-      vf v_dequantize_default_decoded = lb_decode_scaled<LB_SQRT8, LB_SIGNED>(full ? lb_ld_codes<LB_SQRT8, LB_SIGNED>(p_exp_avg_codes + i) : lb_ld_codes_n<LB_SQRT8, LB_SIGNED>(p_exp_avg_codes + i, r), SC_exp_avg, FL_exp_avg);
-      vf v_dequantize_default_1_decoded = lb_decode_scaled<LB_SQRT8, LB_UNSIGNED>(full ? lb_ld_codes<LB_SQRT8, LB_UNSIGNED>(p_exp_avg_sq_codes + i) : lb_ld_codes_n<LB_SQRT8, LB_UNSIGNED>(p_exp_avg_sq_codes + i, r), SC_exp_avg_sq, FL_exp_avg_sq);
+      vf v_dequantize_default_decoded = lb_decode_scaled<LB_E4M3, LB_SIGNED>(full ? lb_ld_codes<LB_E4M3, LB_SIGNED>(p_exp_avg_codes + i) : lb_ld_codes_n<LB_E4M3, LB_SIGNED>(p_exp_avg_codes + i, r), SC_exp_avg, FL_exp_avg);
+      vf v_dequantize_default_1_decoded = lb_decode_scaled<LB_E4M3, LB_UNSIGNED>(full ? lb_ld_codes<LB_E4M3, LB_UNSIGNED>(p_exp_avg_sq_codes + i) : lb_ld_codes_n<LB_E4M3, LB_UNSIGNED>(p_exp_avg_sq_codes + i, r), SC_exp_avg_sq, FL_exp_avg_sq);
-      const vf v_sqrt = lb_sqrt(v_addcmul);
-      if (full) lb_st(root_exp_avg_sq + i, v_sqrt); else lb_st_n(root_exp_avg_sq + i, v_sqrt, r);
-        const vf v_sqrt = prev_v_sqrt;
+        const vf v_addcmul = prev_v_addcmul;
+        const vf v_sqrt = lb_sqrt(v_addcmul);
-      prev_v_sqrt = v_sqrt;
+      prev_v_addcmul = v_addcmul;
-      const vf v_sqrt = prev_v_sqrt;
+      const vf v_addcmul = prev_v_addcmul;
+      const vf v_sqrt = lb_sqrt(v_addcmul);
== fp8_e5m2 {}
-  float* __restrict root_exp_avg_sq = scratch + 2 * LB_BLOCK;
-  const auto fuse = lb_fuse_if(job.len == len && len % (4 * LB_W) == 0 && lb_fusable<LB_SQRT8, LB_SIGNED, LB_PLAIN>(job.enc[0], job.mult[0]) && lb_fusable<LB_SQRT8, LB_UNSIGNED, LB_ROOT>(job.enc[1], job.mult[1]));
+  const auto fuse = lb_fuse_if(job.len == len && len % (4 * LB_W) == 0 && lb_fusable<LB_E5M2, LB_SIGNED, LB_PLAIN>(job.enc[0], job.mult[0]) && lb_fusable<LB_E5M2, LB_UNSIGNED, LB_PLAIN>(job.enc[1], job.mult[1]));
-    vf prev_v_sqrt = {};
+    vf prev_v_addcmul = {};
-        lb_encode_x4<LB_SQRT8, LB_SIGNED, LB_PLAIN>(buf_exp_avg, nullptr, i, q_mult_exp_avg, {}, q_codes_exp_avg);
-        lb_encode_x4<LB_SQRT8, LB_UNSIGNED, LB_STOCHASTIC | LB_ROOT>(buf_exp_avg_sq, root_exp_avg_sq, i, q_mult_exp_avg_sq, q_rand_exp_avg_sq, q_codes_exp_avg_sq);
+        lb_encode_x4<LB_E5M2, LB_SIGNED, LB_PLAIN>(buf_exp_avg, nullptr, i, q_mult_exp_avg, {}, q_codes_exp_avg);
+        lb_encode_x4<LB_E5M2, LB_UNSIGNED, LB_STOCHASTIC>(buf_exp_avg_sq, nullptr, i, q_mult_exp_avg_sq, q_rand_exp_avg_sq, q_codes_exp_avg_sq);
-      vf v_dequantize_default_decoded = lb_decode_scaled<LB_SQRT8, LB_SIGNED>(full ? lb_ld_codes<LB_SQRT8, LB_SIGNED>(p_exp_avg_codes + i) : lb_ld_codes_n<LB_SQRT8, LB_SIGNED>(p_exp_avg_codes + i, r), SC_exp_avg, FL_exp_avg);
-      vf v_dequantize_default_1_decoded = lb_decode_scaled<LB_SQRT8, LB_UNSIGNED>(full ? lb_ld_codes<LB_SQRT8, LB_UNSIGNED>(p_exp_avg_sq_codes + i) : lb_ld_codes_n<LB_SQRT8, LB_UNSIGNED>(p_exp_avg_sq_codes + i, r), SC_exp_avg_sq, FL_exp_avg_sq);
+      vf v_dequantize_default_decoded = lb_decode_scaled<LB_E5M2, LB_SIGNED>(full ? lb_ld_codes<LB_E5M2, LB_SIGNED>(p_exp_avg_codes + i) : lb_ld_codes_n<LB_E5M2, LB_SIGNED>(p_exp_avg_codes + i, r), SC_exp_avg, FL_exp_avg);
+      vf v_dequantize_default_1_decoded = lb_decode_scaled<LB_E5M2, LB_UNSIGNED>(full ? lb_ld_codes<LB_E5M2, LB_UNSIGNED>(p_exp_avg_sq_codes + i) : lb_ld_codes_n<LB_E5M2, LB_UNSIGNED>(p_exp_avg_sq_codes + i, r), SC_exp_avg_sq, FL_exp_avg_sq);
-      const vf v_sqrt = lb_sqrt(v_addcmul);
-      if (full) lb_st(root_exp_avg_sq + i, v_sqrt); else lb_st_n(root_exp_avg_sq + i, v_sqrt, r);
-        const vf v_sqrt = prev_v_sqrt;
+        const vf v_addcmul = prev_v_addcmul;
+        const vf v_sqrt = lb_sqrt(v_addcmul);
-      prev_v_sqrt = v_sqrt;
+      prev_v_addcmul = v_addcmul;
-      const vf v_sqrt = prev_v_sqrt;
+      const vf v_addcmul = prev_v_addcmul;
+      const vf v_sqrt = lb_sqrt(v_addcmul);
== bf16 {}
-                          float* scratch, lb_job& job) {
+                          float* scratch) {
-  uint8_t* __restrict p_exp_avg_codes = (uint8_t*)ptr[2] + start;
-  float* __restrict p_exp_avg_scales = (float*)ptr[3] + blk;
-  uint16_t* __restrict p_exp_avg_patch_values = (uint16_t*)ptr[4] + blk * 0;
-  int16_t* __restrict p_exp_avg_patch_index = (int16_t*)ptr[5] + blk * 0;
-  uint8_t* __restrict p_exp_avg_sq_codes = (uint8_t*)ptr[6] + start;
-  float* __restrict p_exp_avg_sq_scales = (float*)ptr[7] + blk;
-  uint16_t* __restrict p_exp_avg_sq_patch_values = (uint16_t*)ptr[8] + blk * 0;
-  int16_t* __restrict p_exp_avg_sq_patch_index = (int16_t*)ptr[9] + blk * 0;
+  uint16_t* __restrict p_exp_avg_codes = (uint16_t*)ptr[2] + start;
+  float* __restrict p_exp_avg_scales = (float*)ptr[3] + 0;
+  uint16_t* __restrict p_exp_avg_patch_values = (uint16_t*)ptr[4] + 0;
+  int16_t* __restrict p_exp_avg_patch_index = (int16_t*)ptr[5] + 0;
+  uint16_t* __restrict p_exp_avg_sq_codes = (uint16_t*)ptr[6] + start;
+  float* __restrict p_exp_avg_sq_scales = (float*)ptr[7] + 0;
+  uint16_t* __restrict p_exp_avg_sq_patch_values = (uint16_t*)ptr[8] + 0;
+  int16_t* __restrict p_exp_avg_sq_patch_index = (int16_t*)ptr[9] + 0;
-  const float c_clone_default = s[7];
-  const float c_t9 = c_lerp_small ? c_sub_1 : (c_sub_1 - (float)0x1.0000000000000p+0);
-  const float c_t10 = (float)0x1.0000000000000p+0 / c_pow_3;
-  const lb_rand h_exp_avg_sq_rand = {lb_hash32_s((uint32_t)c_clone_default ^ (2u << 24)), start};
-  float* __restrict buf_exp_avg = scratch + 0 * LB_BLOCK;
-  const vf SC_exp_avg = lb_splat(__builtin_fabsf(*p_exp_avg_scales));
-  const bool FL_exp_avg = __builtin_signbit(*p_exp_avg_scales);  // a flagged block
-  vi acc_exp_avg = lb_splat_i(-1);
-  float* __restrict buf_exp_avg_sq = scratch + 1 * LB_BLOCK;
-  const vf SC_exp_avg_sq = lb_splat(__builtin_fabsf(*p_exp_avg_sq_scales));
-  const bool FL_exp_avg_sq = __builtin_signbit(*p_exp_avg_sq_scales);  // a flagged block
-  vi acc_exp_avg_sq = lb_splat_i(-1);
-  float* __restrict root_exp_avg_sq = scratch + 2 * LB_BLOCK;
-  const auto fuse = lb_fuse_if(job.len == len && len % (4 * LB_W) == 0 && lb_fusable<LB_SQRT8, LB_SIGNED, LB_PLAIN>(job.enc[0], job.mult[0]) && lb_fusable<LB_SQRT8, LB_UNSIGNED, LB_ROOT>(job.enc[1], job.mult[1]));
-  if (!fuse) lb_finish(job, scratch);
-  uint8_t* __restrict q_codes_exp_avg = job.codes[0];
-  const vf q_mult_exp_avg = lb_splat(job.mult[0]);
-  uint8_t* __restrict q_codes_exp_avg_sq = job.codes[1];
-  const vf q_mult_exp_avg_sq = lb_splat(job.mult[1]);
-  const lb_rand q_rand_exp_avg_sq = job.rnd[1];
-  const auto lanes0 = [&](auto fuse, auto c_lerp_small) LB_INLINE_LAMBDA {
+  const float c_t8 = c_lerp_small ? c_sub_1 : (c_sub_1 - (float)0x1.0000000000000p+0);
+  const float c_t9 = (float)0x1.0000000000000p+0 / c_pow_3;
+  const auto lanes0 = [&](auto c_lerp_small) LB_INLINE_LAMBDA {
-    vf prev_v_sqrt = {};
+    vf prev_v_addcmul = {};
-      if (fuse && (i & (4 * LB_W - 1)) == 0) {
-        lb_encode_x4<LB_SQRT8, LB_SIGNED, LB_PLAIN>(buf_exp_avg, nullptr, i, q_mult_exp_avg, {}, q_codes_exp_avg);
-        lb_encode_x4<LB_SQRT8, LB_UNSIGNED, LB_STOCHASTIC | LB_ROOT>(buf_exp_avg_sq, root_exp_avg_sq, i, q_mult_exp_avg_sq, q_rand_exp_avg_sq, q_codes_exp_avg_sq);
-      }
-      vf v_dequantize_default_decoded = lb_decode_scaled<LB_SQRT8, LB_SIGNED>(full ? lb_ld_codes<LB_SQRT8, LB_SIGNED>(p_exp_avg_codes + i) : lb_ld_codes_n<LB_SQRT8, LB_SIGNED>(p_exp_avg_codes + i, r), SC_exp_avg, FL_exp_avg);
-      vf v_dequantize_default_1_decoded = lb_decode_scaled<LB_SQRT8, LB_UNSIGNED>(full ? lb_ld_codes<LB_SQRT8, LB_UNSIGNED>(p_exp_avg_sq_codes + i) : lb_ld_codes_n<LB_SQRT8, LB_UNSIGNED>(p_exp_avg_sq_codes + i, r), SC_exp_avg_sq, FL_exp_avg_sq);
+      vf v_dequantize_default_decoded = full ? lb_ld_bf16(p_exp_avg_codes + i) : lb_ld_bf16_n(p_exp_avg_codes + i, r);
+      vf v_dequantize_default_1_decoded = full ? lb_ld_bf16(p_exp_avg_sq_codes + i) : lb_ld_bf16_n(p_exp_avg_sq_codes + i, r);
-      const vf v_lerp = lb_fma(lb_splat(c_t9), v_lerp_diff, (c_lerp_small ? v_dequantize_default_decoded : v_grad));
+      const vf v_lerp = lb_fma(lb_splat(c_t8), v_lerp_diff, (c_lerp_small ? v_dequantize_default_decoded : v_grad));
-      const vf v_sqrt = lb_sqrt(v_addcmul);
-      if (full) lb_st(buf_exp_avg + i, v_lerp); else lb_st_n(buf_exp_avg + i, v_lerp, r);
-      acc_exp_avg = lb_vmax(acc_exp_avg, lb_key_masked(v_lerp, r));
-      if (full) lb_st(buf_exp_avg_sq + i, v_addcmul); else lb_st_n(buf_exp_avg_sq + i, v_addcmul, r);
-      acc_exp_avg_sq = lb_vmax(acc_exp_avg_sq, lb_key_masked(v_addcmul, r));
-      if (full) lb_st(root_exp_avg_sq + i, v_sqrt); else lb_st_n(root_exp_avg_sq + i, v_sqrt, r);
+      if (full) lb_st_bf16(p_exp_avg_codes + i, lb_bf16_state_clamp<LB_SIGNED>(v_lerp)); else lb_st_bf16_n(p_exp_avg_codes + i, lb_bf16_state_clamp<LB_SIGNED>(v_lerp), r);
+      if (full) lb_st_bf16(p_exp_avg_sq_codes + i, lb_bf16_state_clamp<LB_UNSIGNED>(v_addcmul)); else lb_st_bf16_n(p_exp_avg_sq_codes + i, lb_bf16_state_clamp<LB_UNSIGNED>(v_addcmul), r);
-        const vf v_sqrt = prev_v_sqrt;
+        const vf v_addcmul = prev_v_addcmul;
-        const vf v_div = v_sqrt * lb_splat(c_t10);
+        const vf v_sqrt = lb_sqrt(v_addcmul);
+        const vf v_div = v_sqrt * lb_splat(c_t9);
-      prev_v_sqrt = v_sqrt;
+      prev_v_addcmul = v_addcmul;
-      const vf v_sqrt = prev_v_sqrt;
+      const vf v_addcmul = prev_v_addcmul;
-      const vf v_div = v_sqrt * lb_splat(c_t10);
+      const vf v_sqrt = lb_sqrt(v_addcmul);
+      const vf v_div = v_sqrt * lb_splat(c_t9);
== int8 {'block_size': 2048, 'outliers': 2}
-  uint16_t* __restrict p_exp_avg_patch_values = (uint16_t*)ptr[4] + blk * 0;
-  int16_t* __restrict p_exp_avg_patch_index = (int16_t*)ptr[5] + blk * 0;
+  uint16_t* __restrict p_exp_avg_patch_values = (uint16_t*)ptr[4] + blk * 2;
+  int16_t* __restrict p_exp_avg_patch_index = (int16_t*)ptr[5] + blk * 2;
-  uint16_t* __restrict p_exp_avg_sq_patch_values = (uint16_t*)ptr[8] + blk * 0;
-  int16_t* __restrict p_exp_avg_sq_patch_index = (int16_t*)ptr[9] + blk * 0;
+  uint16_t* __restrict p_exp_avg_sq_patch_values = (uint16_t*)ptr[8] + blk * 2;
+  int16_t* __restrict p_exp_avg_sq_patch_index = (int16_t*)ptr[9] + blk * 2;
+  int64_t PI_exp_avg[2];
+  float PV_exp_avg[2];
+  const int PC_exp_avg = lb_sorted_patches<2>(p_exp_avg_patch_index, p_exp_avg_patch_values, len, PI_exp_avg, PV_exp_avg);
+  int PA_exp_avg = 0;
+  int64_t PN_exp_avg = PC_exp_avg ? PI_exp_avg[0] : LB_NO_PATCH;
+  int64_t PI_exp_avg_sq[2];
+  float PV_exp_avg_sq[2];
+  const int PC_exp_avg_sq = lb_sorted_patches<2>(p_exp_avg_sq_patch_index, p_exp_avg_sq_patch_values, len, PI_exp_avg_sq, PV_exp_avg_sq);
+  int PA_exp_avg_sq = 0;
+  int64_t PN_exp_avg_sq = PC_exp_avg_sq ? PI_exp_avg_sq[0] : LB_NO_PATCH;
-  float* __restrict root_exp_avg_sq = scratch + 2 * LB_BLOCK;
-  const auto fuse = lb_fuse_if(job.len == len && len % (4 * LB_W) == 0 && lb_fusable<LB_SQRT8, LB_SIGNED, LB_PLAIN>(job.enc[0], job.mult[0]) && lb_fusable<LB_SQRT8, LB_UNSIGNED, LB_ROOT>(job.enc[1], job.mult[1]));
+  const auto fuse = lb_fuse_if(job.len == len && len % (4 * LB_W) == 0 && lb_fusable<LB_INT8, LB_SIGNED, LB_PLAIN>(job.enc[0], job.mult[0]) && lb_fusable<LB_INT8, LB_UNSIGNED, LB_PLAIN>(job.enc[1], job.mult[1]));
-    vf prev_v_sqrt = {};
+    vf prev_v_addcmul = {};
-        lb_encode_x4<LB_SQRT8, LB_SIGNED, LB_PLAIN>(buf_exp_avg, nullptr, i, q_mult_exp_avg, {}, q_codes_exp_avg);
-        lb_encode_x4<LB_SQRT8, LB_UNSIGNED, LB_STOCHASTIC | LB_ROOT>(buf_exp_avg_sq, root_exp_avg_sq, i, q_mult_exp_avg_sq, q_rand_exp_avg_sq, q_codes_exp_avg_sq);
+        lb_encode_x4<LB_INT8, LB_SIGNED, LB_PLAIN>(buf_exp_avg, nullptr, i, q_mult_exp_avg, {}, q_codes_exp_avg);
+        lb_encode_x4<LB_INT8, LB_UNSIGNED, LB_STOCHASTIC>(buf_exp_avg_sq, nullptr, i, q_mult_exp_avg_sq, q_rand_exp_avg_sq, q_codes_exp_avg_sq);
-      vf v_dequantize_default_decoded = lb_decode_scaled<LB_SQRT8, LB_SIGNED>(full ? lb_ld_codes<LB_SQRT8, LB_SIGNED>(p_exp_avg_codes + i) : lb_ld_codes_n<LB_SQRT8, LB_SIGNED>(p_exp_avg_codes + i, r), SC_exp_avg, FL_exp_avg);
-      vf v_dequantize_default_1_decoded = lb_decode_scaled<LB_SQRT8, LB_UNSIGNED>(full ? lb_ld_codes<LB_SQRT8, LB_UNSIGNED>(p_exp_avg_sq_codes + i) : lb_ld_codes_n<LB_SQRT8, LB_UNSIGNED>(p_exp_avg_sq_codes + i, r), SC_exp_avg_sq, FL_exp_avg_sq);
+      vf v_dequantize_default_decoded = lb_decode_scaled<LB_INT8, LB_SIGNED>(full ? lb_ld_codes<LB_INT8, LB_SIGNED>(p_exp_avg_codes + i) : lb_ld_codes_n<LB_INT8, LB_SIGNED>(p_exp_avg_codes + i, r), SC_exp_avg, FL_exp_avg);
+      while (PN_exp_avg < i + LB_W) {  // a patch falls in this vector
+        v_dequantize_default_decoded[PN_exp_avg - i] = PV_exp_avg[PA_exp_avg];
+        PN_exp_avg = ++PA_exp_avg < PC_exp_avg ? PI_exp_avg[PA_exp_avg] : LB_NO_PATCH;
+      }
+      vf v_dequantize_default_1_decoded = lb_decode_scaled<LB_INT8, LB_UNSIGNED>(full ? lb_ld_codes<LB_INT8, LB_UNSIGNED>(p_exp_avg_sq_codes + i) : lb_ld_codes_n<LB_INT8, LB_UNSIGNED>(p_exp_avg_sq_codes + i, r), SC_exp_avg_sq, FL_exp_avg_sq);
+      while (PN_exp_avg_sq < i + LB_W) {  // a patch falls in this vector
+        v_dequantize_default_1_decoded[PN_exp_avg_sq - i] = PV_exp_avg_sq[PA_exp_avg_sq];
+        PN_exp_avg_sq = ++PA_exp_avg_sq < PC_exp_avg_sq ? PI_exp_avg_sq[PA_exp_avg_sq] : LB_NO_PATCH;
+      }
-      const vf v_sqrt = lb_sqrt(v_addcmul);
-      if (full) lb_st(root_exp_avg_sq + i, v_sqrt); else lb_st_n(root_exp_avg_sq + i, v_sqrt, r);
-        const vf v_sqrt = prev_v_sqrt;
+        const vf v_addcmul = prev_v_addcmul;
+        const vf v_sqrt = lb_sqrt(v_addcmul);
-      prev_v_sqrt = v_sqrt;
+      prev_v_addcmul = v_addcmul;
-      const vf v_sqrt = prev_v_sqrt;
+      const vf v_addcmul = prev_v_addcmul;
+      const vf v_sqrt = lb_sqrt(v_addcmul);
== sqrt4 {'block_size': 512}
-  uint8_t* __restrict p_exp_avg_codes = (uint8_t*)ptr[2] + start;
+  uint8_t* __restrict p_exp_avg_codes = (uint8_t*)ptr[2] + start / 2;
-  uint8_t* __restrict p_exp_avg_sq_codes = (uint8_t*)ptr[6] + start;
+  uint8_t* __restrict p_exp_avg_sq_codes = (uint8_t*)ptr[6] + start / 2;
-  const auto fuse = lb_fuse_if(job.len == len && len % (4 * LB_W) == 0 && lb_fusable<LB_SQRT8, LB_SIGNED, LB_PLAIN>(job.enc[0], job.mult[0]) && lb_fusable<LB_SQRT8, LB_UNSIGNED, LB_ROOT>(job.enc[1], job.mult[1]));
-  if (!fuse) lb_finish(job, scratch);
-  uint8_t* __restrict q_codes_exp_avg = job.codes[0];
-  const vf q_mult_exp_avg = lb_splat(job.mult[0]);
-  uint8_t* __restrict q_codes_exp_avg_sq = job.codes[1];
-  const vf q_mult_exp_avg_sq = lb_splat(job.mult[1]);
-  const lb_rand q_rand_exp_avg_sq = job.rnd[1];
-  const auto lanes0 = [&](auto fuse, auto c_lerp_small) LB_INLINE_LAMBDA {
+  const auto lanes0 = [&](auto c_lerp_small) LB_INLINE_LAMBDA {
-      lb_prefetch(p_exp_avg_codes + i, LB_BLOCK);
-      lb_prefetch(p_exp_avg_sq_codes + i, LB_BLOCK);
-      if (fuse && (i & (4 * LB_W - 1)) == 0) {
-        lb_encode_x4<LB_SQRT8, LB_SIGNED, LB_PLAIN>(buf_exp_avg, nullptr, i, q_mult_exp_avg, {}, q_codes_exp_avg);
-        lb_encode_x4<LB_SQRT8, LB_UNSIGNED, LB_STOCHASTIC | LB_ROOT>(buf_exp_avg_sq, root_exp_avg_sq, i, q_mult_exp_avg_sq, q_rand_exp_avg_sq, q_codes_exp_avg_sq);
-      }
+      lb_prefetch(p_exp_avg_codes + i / 2, LB_BLOCK / 2);
+      lb_prefetch(p_exp_avg_sq_codes + i / 2, LB_BLOCK / 2);
-      vf v_dequantize_default_decoded = lb_decode_scaled<LB_SQRT8, LB_SIGNED>(full ? lb_ld_codes<LB_SQRT8, LB_SIGNED>(p_exp_avg_codes + i) : lb_ld_codes_n<LB_SQRT8, LB_SIGNED>(p_exp_avg_codes + i, r), SC_exp_avg, FL_exp_avg);
-      vf v_dequantize_default_1_decoded = lb_decode_scaled<LB_SQRT8, LB_UNSIGNED>(full ? lb_ld_codes<LB_SQRT8, LB_UNSIGNED>(p_exp_avg_sq_codes + i) : lb_ld_codes_n<LB_SQRT8, LB_UNSIGNED>(p_exp_avg_sq_codes + i, r), SC_exp_avg_sq, FL_exp_avg_sq);
+      vf v_dequantize_default_decoded = lb_decode_scaled<LB_SQRT4, LB_SIGNED>(full ? lb_ld_codes<LB_SQRT4, LB_SIGNED>(p_exp_avg_codes + i / 2) : lb_ld_codes_n<LB_SQRT4, LB_SIGNED>(p_exp_avg_codes + i / 2, r), SC_exp_avg, FL_exp_avg);
+      vf v_dequantize_default_1_decoded = lb_decode_scaled<LB_SQRT4, LB_UNSIGNED>(full ? lb_ld_codes<LB_SQRT4, LB_UNSIGNED>(p_exp_avg_sq_codes + i / 2) : lb_ld_codes_n<LB_SQRT4, LB_UNSIGNED>(p_exp_avg_sq_codes + i / 2, r), SC_exp_avg_sq, FL_exp_avg_sq);""")

    def test_bf16_params_with_fp32_opmath_round_once_in_the_store(self):
        """The kernel bf16 params get with low-bit states: fp32 math, bf16 widened on load, the param
        rounded by its store (passes/opmath.py)."""
        p = torch.nn.Parameter(torch.randn(64, dtype=torch.bfloat16))
        opt = torch.optim.AdamW([p], weight_decay=0.1)
        bf16 = split_prologue(compute_in_fp32(pass_graphs(opt)["quantized"])).body
        loop = _vector_loop(_kernel(emit_step(bf16, FAST).source))
        self.assertExpectedInline(_diff(_vector_loop(_kernel(emit_step(_adamw(), FAST).source)), loop), """\
-  float* __restrict p_param = (float*)ptr[0] + start;
-  const float* __restrict p_grad = (const float*)ptr[1] + start;
+  uint16_t* __restrict p_param = (uint16_t*)ptr[0] + start;
+  const uint16_t* __restrict p_grad = (const uint16_t*)ptr[1] + start;
-      const vf v_param = full ? lb_ld(p_param + i) : lb_ld_n(p_param + i, r);
-      const vf v_grad = full ? lb_ld(p_grad + i) : lb_ld_n(p_grad + i, r);
+      const vf v_param = full ? lb_ld_bf16(p_param + i) : lb_ld_bf16_n(p_param + i, r);
+      const vf v_grad = full ? lb_ld_bf16(p_grad + i) : lb_ld_bf16_n(p_grad + i, r);
-        if (full) lb_st(p_param + i, v_addcdiv); else lb_st_n(p_param + i, v_addcdiv, r);
+        if (full) lb_st_bf16(p_param + i, v_addcdiv); else lb_st_bf16_n(p_param + i, v_addcdiv, r);
-      if (full) lb_st(p_param + i, v_addcdiv); else lb_st_n(p_param + i, v_addcdiv, r);
+      if (full) lb_st_bf16(p_param + i, v_addcdiv); else lb_st_bf16_n(p_param + i, v_addcdiv, r);""")

    def test_bf16_and_fp16_params_round_every_op(self):
        f32 = _vector_loop(_kernel(emit_step(_adamw(), FAST).source))
        bf16 = _vector_loop(_kernel(emit_step(_adamw(dtype=torch.bfloat16), FAST).source))
        f16 = _vector_loop(_kernel(emit_step(_adamw(dtype=torch.float16), FAST).source))
        self.assertExpectedInline(_diff(f32, bf16) + "\n== fp16\n" + _diff(bf16, f16), """\
-  float* __restrict p_param = (float*)ptr[0] + start;
-  const float* __restrict p_grad = (const float*)ptr[1] + start;
+  uint16_t* __restrict p_param = (uint16_t*)ptr[0] + start;
+  const uint16_t* __restrict p_grad = (const uint16_t*)ptr[1] + start;
-  float* __restrict root_exp_avg_sq = scratch + 2 * LB_BLOCK;
-  const auto fuse = lb_fuse_if(job.len == len && len % (4 * LB_W) == 0 && lb_fusable<LB_SQRT8, LB_SIGNED, LB_PLAIN>(job.enc[0], job.mult[0]) && lb_fusable<LB_SQRT8, LB_UNSIGNED, LB_ROOT>(job.enc[1], job.mult[1]));
+  const auto fuse = lb_fuse_if(job.len == len && len % (4 * LB_W) == 0 && lb_fusable<LB_SQRT8, LB_SIGNED, LB_PLAIN>(job.enc[0], job.mult[0]) && lb_fusable<LB_SQRT8, LB_UNSIGNED, LB_PLAIN>(job.enc[1], job.mult[1]));
-    vf prev_v_sqrt = {};
+    vf prev_v_addcmul = {};
-        lb_encode_x4<LB_SQRT8, LB_UNSIGNED, LB_STOCHASTIC | LB_ROOT>(buf_exp_avg_sq, root_exp_avg_sq, i, q_mult_exp_avg_sq, q_rand_exp_avg_sq, q_codes_exp_avg_sq);
+        lb_encode_x4<LB_SQRT8, LB_UNSIGNED, LB_STOCHASTIC>(buf_exp_avg_sq, nullptr, i, q_mult_exp_avg_sq, q_rand_exp_avg_sq, q_codes_exp_avg_sq);
-      const vf v_param = full ? lb_ld(p_param + i) : lb_ld_n(p_param + i, r);
-      const vf v_grad = full ? lb_ld(p_grad + i) : lb_ld_n(p_grad + i, r);
+      const vf v_param = full ? lb_ld_bf16(p_param + i) : lb_ld_bf16_n(p_param + i, r);
+      const vf v_grad = full ? lb_ld_bf16(p_grad + i) : lb_ld_bf16_n(p_grad + i, r);
+      const vf v_dequantize_default = lb_round_bf16(v_dequantize_default_decoded);
-      const vf v_lerp_diff = v_grad - v_dequantize_default_decoded;
-      const vf v_lerp = lb_fma(lb_splat(c_t9), v_lerp_diff, (c_lerp_small ? v_dequantize_default_decoded : v_grad));
-      const vf v_mul_2 = v_dequantize_default_1_decoded * lb_splat(c_hp_betas_1);
-      const vf v_addcmul = lb_fma((lb_splat(c_sub_2) * v_grad), v_grad, v_mul_2);
-      const vf v_sqrt = lb_sqrt(v_addcmul);
+      const vf v_dequantize_default_1 = lb_round_bf16(v_dequantize_default_1_decoded);
+      const vf v_lerp_diff = v_grad - v_dequantize_default;
+      const vf v_lerp = lb_round_bf16(lb_fma(lb_splat(c_t9), v_lerp_diff, (c_lerp_small ? v_dequantize_default : v_grad)));
+      const vf v_mul_2 = lb_round_bf16((v_dequantize_default_1 * lb_splat(c_hp_betas_1)));
+      const vf v_addcmul = lb_round_bf16(lb_fma((lb_splat(c_sub_2) * v_grad), v_grad, v_mul_2));
-      if (full) lb_st(root_exp_avg_sq + i, v_sqrt); else lb_st_n(root_exp_avg_sq + i, v_sqrt, r);
-        const vf v_sqrt = prev_v_sqrt;
-        const vf v_mul_1 = v_param * lb_splat(c_sub);
-        const vf v_div = v_sqrt * lb_splat(c_t10);
-        const vf v_add_1 = v_div + lb_splat(c_hp_eps);
-        const vf v_addcdiv = v_mul_1 + ((lb_splat(c_neg) * v_lerp) / v_add_1);
-        if (full) lb_st(p_param + i, v_addcdiv); else lb_st_n(p_param + i, v_addcdiv, r);
+        const vf v_addcmul = prev_v_addcmul;
+        const vf v_mul_1 = lb_round_bf16((v_param * lb_splat(c_sub)));
+        const vf v_sqrt = lb_round_bf16(lb_sqrt(v_addcmul));
+        const vf v_div = lb_round_bf16((v_sqrt * lb_splat(c_t10)));
+        const vf v_add_1 = lb_round_bf16((v_div + lb_splat(lb_round_bf16_s(c_hp_eps))));
+        const vf v_addcdiv = lb_round_bf16((v_mul_1 + ((lb_splat(c_neg) * v_lerp) / v_add_1)));
+        if (full) lb_st_bf16_exact(p_param + i, v_addcdiv); else lb_st_bf16_exact_n(p_param + i, v_addcdiv, r);
-      prev_v_sqrt = v_sqrt;
+      prev_v_addcmul = v_addcmul;
-      const vf v_sqrt = prev_v_sqrt;
-      const vf v_mul_1 = v_param * lb_splat(c_sub);
-      const vf v_div = v_sqrt * lb_splat(c_t10);
-      const vf v_add_1 = v_div + lb_splat(c_hp_eps);
-      const vf v_addcdiv = v_mul_1 + ((lb_splat(c_neg) * v_lerp) / v_add_1);
-      if (full) lb_st(p_param + i, v_addcdiv); else lb_st_n(p_param + i, v_addcdiv, r);
+      const vf v_addcmul = prev_v_addcmul;
+      const vf v_mul_1 = lb_round_bf16((v_param * lb_splat(c_sub)));
+      const vf v_sqrt = lb_round_bf16(lb_sqrt(v_addcmul));
+      const vf v_div = lb_round_bf16((v_sqrt * lb_splat(c_t10)));
+      const vf v_add_1 = lb_round_bf16((v_div + lb_splat(lb_round_bf16_s(c_hp_eps))));
+      const vf v_addcdiv = lb_round_bf16((v_mul_1 + ((lb_splat(c_neg) * v_lerp) / v_add_1)));
+      if (full) lb_st_bf16_exact(p_param + i, v_addcdiv); else lb_st_bf16_exact_n(p_param + i, v_addcdiv, r);
== fp16
-      const vf v_param = full ? lb_ld_bf16(p_param + i) : lb_ld_bf16_n(p_param + i, r);
-      const vf v_grad = full ? lb_ld_bf16(p_grad + i) : lb_ld_bf16_n(p_grad + i, r);
+      const vf v_param = full ? lb_ld_f16(p_param + i) : lb_ld_f16_n(p_param + i, r);
+      const vf v_grad = full ? lb_ld_f16(p_grad + i) : lb_ld_f16_n(p_grad + i, r);
-      const vf v_dequantize_default = lb_round_bf16(v_dequantize_default_decoded);
+      const vf v_dequantize_default = lb_round_f16(v_dequantize_default_decoded);
-      const vf v_dequantize_default_1 = lb_round_bf16(v_dequantize_default_1_decoded);
+      const vf v_dequantize_default_1 = lb_round_f16(v_dequantize_default_1_decoded);
-      const vf v_lerp = lb_round_bf16(lb_fma(lb_splat(c_t9), v_lerp_diff, (c_lerp_small ? v_dequantize_default : v_grad)));
-      const vf v_mul_2 = lb_round_bf16((v_dequantize_default_1 * lb_splat(c_hp_betas_1)));
-      const vf v_addcmul = lb_round_bf16(lb_fma((lb_splat(c_sub_2) * v_grad), v_grad, v_mul_2));
+      const vf v_lerp = lb_round_f16(lb_fma(lb_splat(c_t9), v_lerp_diff, (c_lerp_small ? v_dequantize_default : v_grad)));
+      const vf v_mul_2 = lb_round_f16((v_dequantize_default_1 * lb_splat(c_hp_betas_1)));
+      const vf v_addcmul = lb_round_f16(lb_fma((lb_splat(c_sub_2) * v_grad), v_grad, v_mul_2));
-        const vf v_mul_1 = lb_round_bf16((v_param * lb_splat(c_sub)));
-        const vf v_sqrt = lb_round_bf16(lb_sqrt(v_addcmul));
-        const vf v_div = lb_round_bf16((v_sqrt * lb_splat(c_t10)));
-        const vf v_add_1 = lb_round_bf16((v_div + lb_splat(lb_round_bf16_s(c_hp_eps))));
-        const vf v_addcdiv = lb_round_bf16((v_mul_1 + ((lb_splat(c_neg) * v_lerp) / v_add_1)));
-        if (full) lb_st_bf16_exact(p_param + i, v_addcdiv); else lb_st_bf16_exact_n(p_param + i, v_addcdiv, r);
+        const vf v_mul_1 = lb_round_f16((v_param * lb_splat(c_sub)));
+        const vf v_sqrt = lb_round_f16(lb_sqrt(v_addcmul));
+        const vf v_div = lb_round_f16((v_sqrt * lb_splat(c_t10)));
+        const vf v_add_1 = lb_round_f16((v_div + lb_splat(lb_round_f16_s(c_hp_eps))));
+        const vf v_addcdiv = lb_round_f16((v_mul_1 + ((lb_splat(c_neg) * v_lerp) / v_add_1)));
+        if (full) lb_st_f16(p_param + i, v_addcdiv); else lb_st_f16_n(p_param + i, v_addcdiv, r);
-      const vf v_mul_1 = lb_round_bf16((v_param * lb_splat(c_sub)));
-      const vf v_sqrt = lb_round_bf16(lb_sqrt(v_addcmul));
-      const vf v_div = lb_round_bf16((v_sqrt * lb_splat(c_t10)));
-      const vf v_add_1 = lb_round_bf16((v_div + lb_splat(lb_round_bf16_s(c_hp_eps))));
-      const vf v_addcdiv = lb_round_bf16((v_mul_1 + ((lb_splat(c_neg) * v_lerp) / v_add_1)));
-      if (full) lb_st_bf16_exact(p_param + i, v_addcdiv); else lb_st_bf16_exact_n(p_param + i, v_addcdiv, r);
+      const vf v_mul_1 = lb_round_f16((v_param * lb_splat(c_sub)));
+      const vf v_sqrt = lb_round_f16(lb_sqrt(v_addcmul));
+      const vf v_div = lb_round_f16((v_sqrt * lb_splat(c_t10)));
+      const vf v_add_1 = lb_round_f16((v_div + lb_splat(lb_round_f16_s(c_hp_eps))));
+      const vf v_addcdiv = lb_round_f16((v_mul_1 + ((lb_splat(c_neg) * v_lerp) / v_add_1)));
+      if (full) lb_st_f16(p_param + i, v_addcdiv); else lb_st_f16_n(p_param + i, v_addcdiv, r);""")

    def test_the_param_write_back_runs_one_vector_late_behind_a_divide_or_square_root(self):
        """Per supported optimizer (default format, fp32 params): the lane values computed one vector
        late, after the next vector's loads and decodes, and those carried over to them; none where no
        divide or square root would move."""
        lines = []
        for cls in [*SUPPORTED, Lion]:
            kernel = _kernel(emit_step(body(cls([torch.nn.Parameter(torch.randn(64))], lr=1e-3)), FAST).source)
            late = kernel.split("      if (prev_i >= 0) {\n", 1)[1].split("\n      }\n", 1)[0] if "prev_i" in kernel else ""
            carried = re.findall(r"const v[fi] (v_\w+) = prev_", late)
            computed = [name for name in re.findall(r"const v[fi] (v_\w+) = ", late) if name not in carried]
            lines.append(f"{cls.__name__}: {' '.join(computed) or '-'} | from {' '.join(carried) or '-'}")
        self.assertExpectedInline("\n".join(lines), """\
Adam: v_div v_add_1 v_addcdiv | from v_param v_lerp v_sqrt
AdamW: v_mul_1 v_div v_add_1 v_addcdiv | from v_param v_lerp v_sqrt
SGD: - | from -
RMSprop: v_add_1 v_addcdiv | from v_param v_grad v_sqrt
Adagrad: v_add_2 v_addcdiv | from v_param v_grad v_sqrt
Adamax: v_addcdiv | from v_param v_lerp v_maximum
NAdam: v_div v_sqrt v_add_2 v_addcdiv v_addcdiv_1 | from v_param v_grad v_lerp v_addcmul
RAdam: - | from -
Adadelta: - | from -
ASGD: - | from -
Rprop: - | from -
Lion: - | from -""")

    def test_format_constants_come_from_formats_py(self):
        self.assertExpectedInline(format_constants(), """\
enum { LB_INT8 = 0, LB_DYNAMIC8 = 1, LB_E4M3 = 2, LB_E5M2 = 3, LB_BF16_CODES = 4, LB_SQRT8 = 6, LB_SQRT4 = 7 };
template <int F> constexpr bool lb_root_domain = F == LB_SQRT8 || F == LB_SQRT4;  // encodes from the square root
template <int F> constexpr bool lb_packed = F == LB_SQRT4;  // two 4-bit codes a byte
template <int F, bool U> struct lb_format {};  // qmax, min_positive (blockwise: neg_qmax, flagged_qmax, the two in encode's input domain, the +inf, -inf and NaN codes of a flagged block; fp8: mantissa, min_exponent)
template <> struct lb_format<LB_INT8, false> { static constexpr float qmax = (float)0x1.fc00000000000p+6, min_positive = (float)0x1.0000000000000p+0; static constexpr float neg_qmax = (float)0x1.fc00000000000p+6, flagged_qmax = (float)0x1.f800000000000p+6, enc_qmax = (float)0x1.fc00000000000p+6, enc_flagged_qmax = (float)0x1.f800000000000p+6; static constexpr int pos_inf_code = 127, neg_inf_code = 129, nan_code = 128; };
template <> struct lb_format<LB_INT8, true> { static constexpr float qmax = (float)0x1.fe00000000000p+7, min_positive = (float)0x1.0000000000000p+0; static constexpr float neg_qmax = (float)0x1.fe00000000000p+7, flagged_qmax = (float)0x1.f800000000000p+7, enc_qmax = (float)0x1.fe00000000000p+7, enc_flagged_qmax = (float)0x1.f800000000000p+7; static constexpr int pos_inf_code = 255, neg_inf_code = 253, nan_code = 254; };
template <> struct lb_format<LB_DYNAMIC8, false> { static constexpr float qmax = (float)0x1.0000000000000p+0, min_positive = (float)0x1.0c00000000000p-20; static constexpr float neg_qmax = (float)0x1.0000000000000p+0, flagged_qmax = (float)0x1.f8cd000000000p-1, enc_qmax = (float)0x1.0000000000000p+0, enc_flagged_qmax = (float)0x1.f8cd000000000p-1; static constexpr int pos_inf_code = 255, neg_inf_code = 0, nan_code = 254; };
template <> struct lb_format<LB_DYNAMIC8, true> { static constexpr float qmax = (float)0x1.0000000000000p+0, min_positive = (float)0x1.ad00000000000p-24; static constexpr float neg_qmax = (float)0x1.0000000000000p+0, flagged_qmax = (float)0x1.f533800000000p-1, enc_qmax = (float)0x1.0000000000000p+0, enc_flagged_qmax = (float)0x1.f533800000000p-1; static constexpr int pos_inf_code = 255, neg_inf_code = 253, nan_code = 254; };
template <> struct lb_format<LB_E4M3, false> { static constexpr float qmax = (float)0x1.c000000000000p+8, min_positive = (float)0x1.0000000000000p-9; static constexpr float neg_qmax = (float)0x1.c000000000000p+8, flagged_qmax = (float)0x1.a000000000000p+8, enc_qmax = (float)0x1.c000000000000p+8, enc_flagged_qmax = (float)0x1.a000000000000p+8; static constexpr int pos_inf_code = 126, neg_inf_code = 254, nan_code = 127; static constexpr int mantissa = 3, min_exponent = -6; };
template <> struct lb_format<LB_E4M3, true> { static constexpr float qmax = (float)0x1.c000000000000p+8, min_positive = (float)0x1.0000000000000p-9; static constexpr float neg_qmax = (float)0x1.c000000000000p+8, flagged_qmax = (float)0x1.a000000000000p+8, enc_qmax = (float)0x1.c000000000000p+8, enc_flagged_qmax = (float)0x1.a000000000000p+8; static constexpr int pos_inf_code = 126, neg_inf_code = 254, nan_code = 127; static constexpr int mantissa = 3, min_exponent = -6; };
template <> struct lb_format<LB_E5M2, false> { static constexpr float qmax = (float)0x1.c000000000000p+15, min_positive = (float)0x1.0000000000000p-16; static constexpr float neg_qmax = (float)0x1.c000000000000p+15, flagged_qmax = (float)0x1.c000000000000p+15, enc_qmax = (float)0x1.c000000000000p+15, enc_flagged_qmax = (float)0x1.c000000000000p+15; static constexpr int pos_inf_code = 124, neg_inf_code = 252, nan_code = 127; static constexpr int mantissa = 2, min_exponent = -14; };
template <> struct lb_format<LB_E5M2, true> { static constexpr float qmax = (float)0x1.c000000000000p+15, min_positive = (float)0x1.0000000000000p-16; static constexpr float neg_qmax = (float)0x1.c000000000000p+15, flagged_qmax = (float)0x1.c000000000000p+15, enc_qmax = (float)0x1.c000000000000p+15, enc_flagged_qmax = (float)0x1.c000000000000p+15; static constexpr int pos_inf_code = 124, neg_inf_code = 252, nan_code = 127; static constexpr int mantissa = 2, min_exponent = -14; };
template <> struct lb_format<LB_BF16_CODES, false> { static constexpr float qmax = (float)0x1.0000000000000p+0, min_positive = (float)0x1.0000000000000p-133; };
template <> struct lb_format<LB_BF16_CODES, true> { static constexpr float qmax = (float)0x1.0000000000000p+0, min_positive = (float)0x1.0000000000000p-133; };
template <> struct lb_format<LB_SQRT8, false> { static constexpr float qmax = (float)0x1.f808000000000p+13, min_positive = (float)0x1.0000000000000p+0; static constexpr float neg_qmax = (float)0x1.f808000000000p+13, flagged_qmax = (float)0x1.f020000000000p+13, enc_qmax = (float)0x1.fc00000000000p+6, enc_flagged_qmax = (float)0x1.f800000000000p+6; static constexpr int pos_inf_code = 127, neg_inf_code = 129, nan_code = 128; };
template <> struct lb_format<LB_SQRT8, true> { static constexpr float qmax = (float)0x1.fc02000000000p+15, min_positive = (float)0x1.0000000000000p+0; static constexpr float neg_qmax = (float)0x1.fc02000000000p+15, flagged_qmax = (float)0x1.f020000000000p+15, enc_qmax = (float)0x1.fe00000000000p+7, enc_flagged_qmax = (float)0x1.f800000000000p+7; static constexpr int pos_inf_code = 255, neg_inf_code = 253, nan_code = 254; };
template <> struct lb_format<LB_SQRT4, false> { static constexpr float qmax = (float)0x1.8800000000000p+5, min_positive = (float)0x1.0000000000000p+0; static constexpr float neg_qmax = (float)0x1.8800000000000p+5, flagged_qmax = (float)0x1.2000000000000p+5, enc_qmax = (float)0x1.c000000000000p+2, enc_flagged_qmax = (float)0x1.8000000000000p+2; static constexpr int pos_inf_code = 7, neg_inf_code = 249, nan_code = 248; };
template <> struct lb_format<LB_SQRT4, true> { static constexpr float qmax = (float)0x1.c200000000000p+7, min_positive = (float)0x1.0000000000000p+0; static constexpr float neg_qmax = (float)0x1.c200000000000p+7, flagged_qmax = (float)0x1.2000000000000p+7, enc_qmax = (float)0x1.e000000000000p+3, enc_flagged_qmax = (float)0x1.8000000000000p+3; static constexpr int pos_inf_code = 15, neg_inf_code = 13, nan_code = 14; };
template <bool U> struct lb_dyn {};  // formats.dynamic_level_table
template <> struct lb_dyn<false> {
  static constexpr int levels = 7;
  static constexpr float lower[8] = {(float)0x1.0c00000000000p-21, (float)0x1.b380000000000p-19, (float)0x1.6410000000000p-16, (float)0x1.4768000000000p-13, (float)0x1.4fd0000000000p-10, (float)0x1.7620000000000p-7, (float)0x1.b6cc000000000p-4, LB_NAN};
  static constexpr float recip[8] = {(float)0x1.b2b9f40000000p+17, (float)0x1.5b8cf00000000p+15, (float)0x1.15e9560000000p+13, (float)0x1.bbedca0000000p+10, (float)0x1.6334080000000p+8, (float)0x1.1c78920000000p+6, (float)0x0.0p+0, (float)0x1.e911320000000p+19};
  static constexpr float bias[8] = {(float)0x1.471d2a0000000p+0, (float)0x1.8726920000000p+1, (float)0x1.a724820000000p+2, (float)0x1.b735640000000p+3, (float)0x1.bf1cb20000000p+4, (float)0x1.c30ce00000000p+5, (float)0x0.0p+0, (float)0x1.0001000000000p-1};
  static constexpr float spacing[8] = {(float)0x1.2d80000000000p-18, (float)0x1.7920000000000p-16, (float)0x1.d7a0000000000p-14, (float)0x1.2740000000000p-11, (float)0x1.7100000000000p-9, (float)0x1.ccc0000000000p-7, (float)0x0.0p+0, (float)0x1.0c00000000000p-20};
  static constexpr float offset[8] = {(float)-0x1.d500000000000p-19, (float)-0x1.e1f0000000000p-15, (float)-0x1.684c000000000p-11, (float)-0x1.e818000000000p-8, (float)-0x1.3c78000000000p-4, (float)-0x1.924d000000000p-1, (float)0x1.0000000000000p+0, (float)0x0.0p+0};
  static constexpr float step[8] = {(float)-0x1.4f00000000000p-20, (float)-0x1.83a8000000000p-15, (float)-0x1.4ad2000000000p-11, (float)-0x1.d5a4000000000p-8, (float)-0x1.36b4000000000p-4, (float)-0x1.8eb3800000000p-1, (float)0x0.0p+0, (float)0x1.0c00000000000p-21};
  static constexpr float last[8] = {(float)0x1.8000000000000p+1, (float)0x1.c000000000000p+2, (float)0x1.e000000000000p+3, (float)0x1.f000000000000p+4, (float)0x1.f800000000000p+5, (float)0x1.fc00000000000p+6, (float)0x1.0000000000000p+7, (float)0x1.0000000000000p+0};
};
template <> struct lb_dyn<true> {
  static constexpr int levels = 8;
  static constexpr float lower[8] = {(float)0x1.ad00000000000p-25, (float)0x1.5c70000000000p-22, (float)0x1.1cc0000000000p-19, (float)0x1.05c8000000000p-16, (float)0x1.0c74000000000p-13, (float)0x1.2ae8000000000p-10, (float)0x1.5f10000000000p-7, (float)0x1.a866000000000p-4};
  static constexpr float recip[8] = {(float)0x1.0fb7d20000000p+21, (float)0x1.b2b9f40000000p+18, (float)0x1.5b8cf00000000p+16, (float)0x1.15e9560000000p+14, (float)0x1.bbedca0000000p+11, (float)0x1.6334080000000p+9, (float)0x1.1c78920000000p+7, (float)0x1.3186440000000p+23};
  static constexpr float bias[8] = {(float)0x1.47159e0000000p+0, (float)0x1.871cea0000000p+1, (float)0x1.a726720000000p+2, (float)0x1.b724720000000p+3, (float)0x1.bf355c0000000p+4, (float)0x1.c31cae0000000p+5, (float)0x1.c50cde0000000p+6, (float)0x1.0001000000000p-1};
  static constexpr float spacing[8] = {(float)0x1.e260000000000p-22, (float)0x1.2d80000000000p-19, (float)0x1.7920000000000p-17, (float)0x1.d7a0000000000p-15, (float)0x1.2740000000000p-12, (float)0x1.7100000000000p-10, (float)0x1.ccc0000000000p-8, (float)0x1.ad00000000000p-24};
  static constexpr float offset[8] = {(float)-0x1.7720000000000p-22, (float)-0x1.8140000000000p-18, (float)-0x1.201c000000000p-14, (float)-0x1.85c6000000000p-11, (float)-0x1.fa8c000000000p-8, (float)-0x1.423c000000000p-4, (float)-0x1.95e6800000000p-1, (float)0x0.0p+0};
  static constexpr float step[8] = {(float)-0x1.0be0000000000p-23, (float)-0x1.35e0000000000p-18, (float)-0x1.088a000000000p-14, (float)-0x1.7709000000000p-11, (float)-0x1.f152000000000p-8, (float)-0x1.3f5a000000000p-4, (float)-0x1.9419c00000000p-1, (float)0x1.ad00000000000p-25};
  static constexpr float last[8] = {(float)0x1.8000000000000p+1, (float)0x1.c000000000000p+2, (float)0x1.e000000000000p+3, (float)0x1.f000000000000p+4, (float)0x1.f800000000000p+5, (float)0x1.fc00000000000p+6, (float)0x1.fe00000000000p+7, (float)0x1.0000000000000p+0};
};""")


def test_dynamic8_level_tables_are_generated_from_formats(monkeypatch):
    """lb_dyn<U> holds formats.dynamic_level_table field by field (``lower`` by level, the rest at
    permute slot (127 + L) & 7): a change in formats.py reaches the kernels, no copy to forget."""
    from lowbit_compile.formats.dynamic import DYNAMIC_LEVEL_FIELDS, dynamic_level_table
    from lowbit_compile.kernels import cpp_printer

    def rendered(text: str, nonneg: bool, name: str) -> list[float]:
        block = text.split(f"struct lb_dyn<{'true' if nonneg else 'false'}> {{")[1].split("\n};")[0]
        line = block.split(f"float {name}[8] = {{")[1].split("}")[0]
        return [float.fromhex(v.removeprefix("(float)")) if v != "LB_NAN" else float("nan") for v in line.split(", ")]

    text = format_constants()
    for nonneg in (False, True):
        table = dict(zip(DYNAMIC_LEVEL_FIELDS, dynamic_level_table(nonneg).tolist()))
        assert f"static constexpr int levels = {8 if nonneg else 7};" in text
        assert rendered(text, nonneg, "lower")[:7] == table["lower"][:7]
        for name in DYNAMIC_LEVEL_FIELDS[1:-1]:
            assert rendered(text, nonneg, name) == [table[name][(slot - 127) % 8] for slot in range(8)], name
    changed = dynamic_level_table(False).clone()
    changed[3, 2] = 0.5  # level 2's spacing
    monkeypatch.setattr(cpp_printer, "dynamic_level_table", lambda nonneg: changed if not nonneg else
                        dynamic_level_table(True))
    assert rendered(format_constants(), False, "spacing")[(127 + 2) % 8] == 0.5
