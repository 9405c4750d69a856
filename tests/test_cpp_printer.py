"""Snapshots of the C++ the CPU backend prints: the default layout's kernel in full, the stock-exact
kernel (torch's own sqrt), and per format the lines that differ, so a change in the generated kernel
shows in review."""

from __future__ import annotations

import difflib

import torch
from expecttest import TestCase

from lowbit_compile.kernels.cpp_printer import emit_step, format_constants
from lowbit_compile.kernels.lowering import Target

from .graphs import body

FAST = Target("cpu", reciprocal_divisor=True)  # what the CPU backend builds for quantized states
EXACT = Target("cpu", torch_sqrt=True)  # and for stock (fp32) states


def _adamw(fmt="dynamic8", dtype=torch.float32, **layout):
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
        """dynamic8 in blocks of 512, no patches: per block, scalars and lerp's weight tests once, then
        per vector decode m and v (map gather times scale), the update in fp32 with ATen's fmas and a
        multiply by 1/bias_correction, the param store, m and v into block buffers with lane maxima;
        then re-quantize each buffer."""
        kernel = _kernel(emit_step(_adamw(), FAST).source)
        self.assertExpectedInline(_vector_loop(kernel) + kernel[kernel.rindex("  }\n  lb_quantize"):], """\
static void lb_step_block(const int64_t* ptr, const float* s, int64_t start, int64_t len, int64_t blk,
                          float* scratch) {
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
  const bool c_lerp_small = fabsf(c_sub_1) < (float)0x1.0000000000000p-1;
  const float c_t8 = c_lerp_small ? c_sub_1 : (c_sub_1 - (float)0x1.0000000000000p+0);
  const float c_t9 = (float)0x1.0000000000000p+0 / c_pow_3;
  float* __restrict buf_exp_avg = scratch + 0 * LB_BLOCK;
  const vf SC_exp_avg = lb_splat(*p_exp_avg_scales);
  vi acc_exp_avg = lb_splat_i(-1);
  float* __restrict buf_exp_avg_sq = scratch + 1 * LB_BLOCK;
  const vf SC_exp_avg_sq = lb_splat(*p_exp_avg_sq_scales);
  vi acc_exp_avg_sq = lb_splat_i(-1);
  {
    int64_t i = 0;
    for (; i + LB_W <= len; i += LB_W) {
      const bool full = true;
      const int64_t r = LB_W;
      const vf v_param = full ? lb_ld(p_param + i) : lb_ld_n(p_param + i, r);
      const vf v_grad = full ? lb_ld(p_grad + i) : lb_ld_n(p_grad + i, r);
      vf v_dequantize_default_decoded = lb_decode<LB_DYNAMIC8, false>(full ? lb_ld_codes(p_exp_avg_codes + i) : lb_ld_codes_n(p_exp_avg_codes + i, r), lb_dyn_map_s) * SC_exp_avg;
      vf v_dequantize_default_1_decoded = lb_decode<LB_DYNAMIC8, true>(full ? lb_ld_codes(p_exp_avg_sq_codes + i) : lb_ld_codes_n(p_exp_avg_sq_codes + i, r), lb_dyn_map_u) * SC_exp_avg_sq;
      const vf v_mul_1 = v_param * lb_splat(c_sub);
      const vf v_lerp_diff = v_grad - v_dequantize_default_decoded;
      const vf v_lerp = lb_fma(lb_splat(c_t8), v_lerp_diff, (c_lerp_small ? v_dequantize_default_decoded : v_grad));
      const vf v_mul_2 = v_dequantize_default_1_decoded * lb_splat(c_hp_betas_1);
      const vf v_addcmul = lb_fma((lb_splat(c_sub_2) * v_grad), v_grad, v_mul_2);
      const vf v_sqrt = lb_sqrt(v_addcmul);
      const vf v_div = v_sqrt * lb_splat(c_t9);
      const vf v_add_1 = v_div + lb_splat(c_hp_eps);
      const vf v_addcdiv = v_mul_1 + ((lb_splat(c_neg) * v_lerp) / v_add_1);
      if (full) lb_st(p_param + i, v_addcdiv); else lb_st_n(p_param + i, v_addcdiv, r);
      if (full) lb_st(buf_exp_avg + i, v_lerp); else lb_st_n(buf_exp_avg + i, v_lerp, r);
      acc_exp_avg = lb_vmax(acc_exp_avg, lb_key_masked(v_lerp, r));
      if (full) lb_st(buf_exp_avg_sq + i, v_addcmul); else lb_st_n(buf_exp_avg_sq + i, v_addcmul, r);
      acc_exp_avg_sq = lb_vmax(acc_exp_avg_sq, lb_key_masked(v_addcmul, r));
    }
  }
  lb_quantize_block<LB_DYNAMIC8, false, 0>(acc_exp_avg, buf_exp_avg, len, LB_BLOCK, (float)0x1.fc66660000000p-1, p_exp_avg_codes, p_exp_avg_scales, p_exp_avg_patch_values, p_exp_avg_patch_index, lb_dyn_keys_s.e);
  lb_quantize_block<LB_DYNAMIC8, true, 0>(acc_exp_avg_sq, buf_exp_avg_sq, len, LB_BLOCK, (float)0x1.0000000000000p+0, p_exp_avg_sq_codes, p_exp_avg_sq_scales, p_exp_avg_sq_patch_values, p_exp_avg_sq_patch_index, lb_dyn_keys_u.e);
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
  const bool c_lerp_small = fabsf(c_sub_1) < (float)0x1.0000000000000p-1;
  const float c_t8 = c_lerp_small ? c_sub_1 : (c_sub_1 - (float)0x1.0000000000000p+0);
  float* __restrict sq0 = scratch + 0 * LB_BLOCK;
  {
    int64_t i = 0;
    for (; i + LB_W <= len; i += LB_W) {
      const bool full = true;
      const int64_t r = LB_W;
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
  {
    int64_t i = 0;
    for (; i + LB_W <= len; i += LB_W) {
      const bool full = true;
      const int64_t r = LB_W;
      const vf v_param = full ? lb_ld(p_param + i) : lb_ld_n(p_param + i, r);
      const vf v_grad = full ? lb_ld(p_grad + i) : lb_ld_n(p_grad + i, r);
      const vf v_state_exp_avg = full ? lb_ld(p_state_exp_avg + i) : lb_ld_n(p_state_exp_avg + i, r);
      const vf v_state_exp_avg_sq = full ? lb_ld(p_state_exp_avg_sq + i) : lb_ld_n(p_state_exp_avg_sq + i, r);
      const vf v_mul_1 = v_param * lb_splat(c_sub);
      const vf v_lerp_diff = v_grad - v_state_exp_avg;
      const vf v_lerp = lb_fma(lb_splat(c_t8), v_lerp_diff, (c_lerp_small ? v_state_exp_avg : v_grad));
      const vf v_mul_2 = v_state_exp_avg_sq * lb_splat(c_hp_betas_1);
      const vf v_addcmul = lb_fma((lb_splat(c_sub_2) * v_grad), v_grad, v_mul_2);
      const vf v_sqrt0 = full ? lb_ld(sq0 + i) : lb_ld_n(sq0 + i, r);
      const vf v_div = v_sqrt0 / lb_splat(c_pow_3);
      const vf v_add_1 = v_div + lb_splat(c_hp_eps);
      const vf v_addcdiv = v_mul_1 + ((lb_splat(c_neg) * v_lerp) / v_add_1);
      if (full) lb_st(p_param + i, v_addcdiv); else lb_st_n(p_param + i, v_addcdiv, r);
      if (full) lb_st(p_state_exp_avg + i, v_lerp); else lb_st_n(p_state_exp_avg + i, v_lerp, r);
      if (full) lb_st(p_state_exp_avg_sq + i, v_addcmul); else lb_st_n(p_state_exp_avg_sq + i, v_addcmul, r);
    }
    if (i < len) {
      const bool full = false;
      const int64_t r = len - i;
      const vf v_param = full ? lb_ld(p_param + i) : lb_ld_n(p_param + i, r);
      const vf v_grad = full ? lb_ld(p_grad + i) : lb_ld_n(p_grad + i, r);
      const vf v_state_exp_avg = full ? lb_ld(p_state_exp_avg + i) : lb_ld_n(p_state_exp_avg + i, r);
      const vf v_state_exp_avg_sq = full ? lb_ld(p_state_exp_avg_sq + i) : lb_ld_n(p_state_exp_avg_sq + i, r);
      const vf v_mul_1 = v_param * lb_splat(c_sub);
      const vf v_lerp_diff = v_grad - v_state_exp_avg;
      const vf v_lerp = lb_fma(lb_splat(c_t8), v_lerp_diff, (c_lerp_small ? v_state_exp_avg : v_grad));
      const vf v_mul_2 = v_state_exp_avg_sq * lb_splat(c_hp_betas_1);
      const vf v_addcmul = lb_fma((lb_splat(c_sub_2) * v_grad), v_grad, v_mul_2);
      const vf v_sqrt0 = full ? lb_ld(sq0 + i) : lb_ld_n(sq0 + i, r);
      const vf v_div = v_sqrt0 / lb_splat(c_pow_3);
      const vf v_add_1 = v_div + lb_splat(c_hp_eps);
      const vf v_addcdiv = v_mul_1 + ((lb_splat(c_neg) * v_lerp) / v_add_1);
      if (full) lb_st(p_param + i, v_addcdiv); else lb_st_n(p_param + i, v_addcdiv, r);
      if (full) lb_st(p_state_exp_avg + i, v_lerp); else lb_st_n(p_state_exp_avg + i, v_lerp, r);
      if (full) lb_st(p_state_exp_avg_sq + i, v_addcmul); else lb_st_n(p_state_exp_avg_sq + i, v_addcmul, r);
    }
  }
}""")

    def test_each_format_changes_only_its_decode_and_encode(self):
        default = _kernel(emit_step(_adamw(), FAST).source)
        out = []
        for fmt, layout in (("int8", {}), ("fp8_e4m3", {}), ("fp8_e5m2", {}), ("bf16", {}),
                            ("int8", {"block_size": 2048, "outliers": 2})):
            kernel = _kernel(emit_step(_adamw(fmt, **layout), FAST).source)
            out.append(f"== {fmt} {layout}\n" + _diff(_vector_loop(default), _vector_loop(kernel)))
        self.assertExpectedInline("\n".join(out), """\
== int8 {}
-      vf v_dequantize_default_decoded = lb_decode<LB_DYNAMIC8, false>(full ? lb_ld_codes(p_exp_avg_codes + i) : lb_ld_codes_n(p_exp_avg_codes + i, r), lb_dyn_map_s) * SC_exp_avg;
-      vf v_dequantize_default_1_decoded = lb_decode<LB_DYNAMIC8, true>(full ? lb_ld_codes(p_exp_avg_sq_codes + i) : lb_ld_codes_n(p_exp_avg_sq_codes + i, r), lb_dyn_map_u) * SC_exp_avg_sq;
+      vf v_dequantize_default_decoded = lb_decode<LB_INT8, false>(full ? lb_ld_codes(p_exp_avg_codes + i) : lb_ld_codes_n(p_exp_avg_codes + i, r), nullptr) * SC_exp_avg;
+      vf v_dequantize_default_1_decoded = lb_decode<LB_INT8, true>(full ? lb_ld_codes(p_exp_avg_sq_codes + i) : lb_ld_codes_n(p_exp_avg_sq_codes + i, r), nullptr) * SC_exp_avg_sq;
== fp8_e4m3 {}
-      vf v_dequantize_default_decoded = lb_decode<LB_DYNAMIC8, false>(full ? lb_ld_codes(p_exp_avg_codes + i) : lb_ld_codes_n(p_exp_avg_codes + i, r), lb_dyn_map_s) * SC_exp_avg;
-      vf v_dequantize_default_1_decoded = lb_decode<LB_DYNAMIC8, true>(full ? lb_ld_codes(p_exp_avg_sq_codes + i) : lb_ld_codes_n(p_exp_avg_sq_codes + i, r), lb_dyn_map_u) * SC_exp_avg_sq;
+      vf v_dequantize_default_decoded = lb_decode<LB_E4M3, false>(full ? lb_ld_codes(p_exp_avg_codes + i) : lb_ld_codes_n(p_exp_avg_codes + i, r), nullptr) * SC_exp_avg;
+      vf v_dequantize_default_1_decoded = lb_decode<LB_E4M3, true>(full ? lb_ld_codes(p_exp_avg_sq_codes + i) : lb_ld_codes_n(p_exp_avg_sq_codes + i, r), nullptr) * SC_exp_avg_sq;
== fp8_e5m2 {}
-      vf v_dequantize_default_decoded = lb_decode<LB_DYNAMIC8, false>(full ? lb_ld_codes(p_exp_avg_codes + i) : lb_ld_codes_n(p_exp_avg_codes + i, r), lb_dyn_map_s) * SC_exp_avg;
-      vf v_dequantize_default_1_decoded = lb_decode<LB_DYNAMIC8, true>(full ? lb_ld_codes(p_exp_avg_sq_codes + i) : lb_ld_codes_n(p_exp_avg_sq_codes + i, r), lb_dyn_map_u) * SC_exp_avg_sq;
+      vf v_dequantize_default_decoded = lb_decode<LB_E5M2, false>(full ? lb_ld_codes(p_exp_avg_codes + i) : lb_ld_codes_n(p_exp_avg_codes + i, r), nullptr) * SC_exp_avg;
+      vf v_dequantize_default_1_decoded = lb_decode<LB_E5M2, true>(full ? lb_ld_codes(p_exp_avg_sq_codes + i) : lb_ld_codes_n(p_exp_avg_sq_codes + i, r), nullptr) * SC_exp_avg_sq;
== bf16 {}
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
-  float* __restrict buf_exp_avg = scratch + 0 * LB_BLOCK;
-  const vf SC_exp_avg = lb_splat(*p_exp_avg_scales);
-  vi acc_exp_avg = lb_splat_i(-1);
-  float* __restrict buf_exp_avg_sq = scratch + 1 * LB_BLOCK;
-  const vf SC_exp_avg_sq = lb_splat(*p_exp_avg_sq_scales);
-  vi acc_exp_avg_sq = lb_splat_i(-1);
-      vf v_dequantize_default_decoded = lb_decode<LB_DYNAMIC8, false>(full ? lb_ld_codes(p_exp_avg_codes + i) : lb_ld_codes_n(p_exp_avg_codes + i, r), lb_dyn_map_s) * SC_exp_avg;
-      vf v_dequantize_default_1_decoded = lb_decode<LB_DYNAMIC8, true>(full ? lb_ld_codes(p_exp_avg_sq_codes + i) : lb_ld_codes_n(p_exp_avg_sq_codes + i, r), lb_dyn_map_u) * SC_exp_avg_sq;
+      vf v_dequantize_default_decoded = full ? lb_ld_bf16(p_exp_avg_codes + i) : lb_ld_bf16_n(p_exp_avg_codes + i, r);
+      vf v_dequantize_default_1_decoded = full ? lb_ld_bf16(p_exp_avg_sq_codes + i) : lb_ld_bf16_n(p_exp_avg_sq_codes + i, r);
-      if (full) lb_st(buf_exp_avg + i, v_lerp); else lb_st_n(buf_exp_avg + i, v_lerp, r);
-      acc_exp_avg = lb_vmax(acc_exp_avg, lb_key_masked(v_lerp, r));
-      if (full) lb_st(buf_exp_avg_sq + i, v_addcmul); else lb_st_n(buf_exp_avg_sq + i, v_addcmul, r);
-      acc_exp_avg_sq = lb_vmax(acc_exp_avg_sq, lb_key_masked(v_addcmul, r));
+      if (full) lb_st_bf16(p_exp_avg_codes + i, lb_bf16_state_clamp<false>(v_lerp)); else lb_st_bf16_n(p_exp_avg_codes + i, lb_bf16_state_clamp<false>(v_lerp), r);
+      if (full) lb_st_bf16(p_exp_avg_sq_codes + i, lb_bf16_state_clamp<true>(v_addcmul)); else lb_st_bf16_n(p_exp_avg_sq_codes + i, lb_bf16_state_clamp<true>(v_addcmul), r);
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
-      vf v_dequantize_default_decoded = lb_decode<LB_DYNAMIC8, false>(full ? lb_ld_codes(p_exp_avg_codes + i) : lb_ld_codes_n(p_exp_avg_codes + i, r), lb_dyn_map_s) * SC_exp_avg;
-      vf v_dequantize_default_1_decoded = lb_decode<LB_DYNAMIC8, true>(full ? lb_ld_codes(p_exp_avg_sq_codes + i) : lb_ld_codes_n(p_exp_avg_sq_codes + i, r), lb_dyn_map_u) * SC_exp_avg_sq;
+      vf v_dequantize_default_decoded = lb_decode<LB_INT8, false>(full ? lb_ld_codes(p_exp_avg_codes + i) : lb_ld_codes_n(p_exp_avg_codes + i, r), nullptr) * SC_exp_avg;
+      while (PN_exp_avg < i + LB_W) {  // a patch falls in this vector
+        v_dequantize_default_decoded[PN_exp_avg - i] = PV_exp_avg[PA_exp_avg];
+        PN_exp_avg = ++PA_exp_avg < PC_exp_avg ? PI_exp_avg[PA_exp_avg] : LB_NO_PATCH;
+      }
+      vf v_dequantize_default_1_decoded = lb_decode<LB_INT8, true>(full ? lb_ld_codes(p_exp_avg_sq_codes + i) : lb_ld_codes_n(p_exp_avg_sq_codes + i, r), nullptr) * SC_exp_avg_sq;
+      while (PN_exp_avg_sq < i + LB_W) {  // a patch falls in this vector
+        v_dequantize_default_1_decoded[PN_exp_avg_sq - i] = PV_exp_avg_sq[PA_exp_avg_sq];
+        PN_exp_avg_sq = ++PA_exp_avg_sq < PC_exp_avg_sq ? PI_exp_avg_sq[PA_exp_avg_sq] : LB_NO_PATCH;
+      }""")

    def test_bf16_and_fp16_params_round_every_op(self):
        f32 = _vector_loop(_kernel(emit_step(_adamw(), FAST).source))
        bf16 = _vector_loop(_kernel(emit_step(_adamw(dtype=torch.bfloat16), FAST).source))
        f16 = _vector_loop(_kernel(emit_step(_adamw(dtype=torch.float16), FAST).source))
        self.assertExpectedInline(_diff(f32, bf16) + "\n== fp16\n" + _diff(bf16, f16), """\
-  float* __restrict p_param = (float*)ptr[0] + start;
-  const float* __restrict p_grad = (const float*)ptr[1] + start;
+  uint16_t* __restrict p_param = (uint16_t*)ptr[0] + start;
+  const uint16_t* __restrict p_grad = (const uint16_t*)ptr[1] + start;
-      const vf v_param = full ? lb_ld(p_param + i) : lb_ld_n(p_param + i, r);
-      const vf v_grad = full ? lb_ld(p_grad + i) : lb_ld_n(p_grad + i, r);
+      const vf v_param = full ? lb_ld_bf16(p_param + i) : lb_ld_bf16_n(p_param + i, r);
+      const vf v_grad = full ? lb_ld_bf16(p_grad + i) : lb_ld_bf16_n(p_grad + i, r);
+      const vf v_dequantize_default = lb_round_bf16(v_dequantize_default_decoded);
-      const vf v_mul_1 = v_param * lb_splat(c_sub);
-      const vf v_lerp_diff = v_grad - v_dequantize_default_decoded;
-      const vf v_lerp = lb_fma(lb_splat(c_t8), v_lerp_diff, (c_lerp_small ? v_dequantize_default_decoded : v_grad));
-      const vf v_mul_2 = v_dequantize_default_1_decoded * lb_splat(c_hp_betas_1);
-      const vf v_addcmul = lb_fma((lb_splat(c_sub_2) * v_grad), v_grad, v_mul_2);
-      const vf v_sqrt = lb_sqrt(v_addcmul);
-      const vf v_div = v_sqrt * lb_splat(c_t9);
-      const vf v_add_1 = v_div + lb_splat(c_hp_eps);
-      const vf v_addcdiv = v_mul_1 + ((lb_splat(c_neg) * v_lerp) / v_add_1);
-      if (full) lb_st(p_param + i, v_addcdiv); else lb_st_n(p_param + i, v_addcdiv, r);
+      const vf v_dequantize_default_1 = lb_round_bf16(v_dequantize_default_1_decoded);
+      const vf v_mul_1 = lb_round_bf16((v_param * lb_splat(c_sub)));
+      const vf v_lerp_diff = v_grad - v_dequantize_default;
+      const vf v_lerp = lb_round_bf16(lb_fma(lb_splat(c_t8), v_lerp_diff, (c_lerp_small ? v_dequantize_default : v_grad)));
+      const vf v_mul_2 = lb_round_bf16((v_dequantize_default_1 * lb_splat(c_hp_betas_1)));
+      const vf v_addcmul = lb_round_bf16(lb_fma((lb_splat(c_sub_2) * v_grad), v_grad, v_mul_2));
+      const vf v_sqrt = lb_round_bf16(lb_sqrt(v_addcmul));
+      const vf v_div = lb_round_bf16((v_sqrt * lb_splat(c_t9)));
+      const vf v_add_1 = lb_round_bf16((v_div + lb_splat(lb_round_bf16_s(c_hp_eps))));
+      const vf v_addcdiv = lb_round_bf16((v_mul_1 + ((lb_splat(c_neg) * v_lerp) / v_add_1)));
+      if (full) lb_st_bf16(p_param + i, v_addcdiv); else lb_st_bf16_n(p_param + i, v_addcdiv, r);
== fp16
-      const vf v_param = full ? lb_ld_bf16(p_param + i) : lb_ld_bf16_n(p_param + i, r);
-      const vf v_grad = full ? lb_ld_bf16(p_grad + i) : lb_ld_bf16_n(p_grad + i, r);
+      const vf v_param = full ? lb_ld_f16(p_param + i) : lb_ld_f16_n(p_param + i, r);
+      const vf v_grad = full ? lb_ld_f16(p_grad + i) : lb_ld_f16_n(p_grad + i, r);
-      const vf v_dequantize_default = lb_round_bf16(v_dequantize_default_decoded);
+      const vf v_dequantize_default = lb_round_f16(v_dequantize_default_decoded);
-      const vf v_dequantize_default_1 = lb_round_bf16(v_dequantize_default_1_decoded);
-      const vf v_mul_1 = lb_round_bf16((v_param * lb_splat(c_sub)));
+      const vf v_dequantize_default_1 = lb_round_f16(v_dequantize_default_1_decoded);
+      const vf v_mul_1 = lb_round_f16((v_param * lb_splat(c_sub)));
-      const vf v_lerp = lb_round_bf16(lb_fma(lb_splat(c_t8), v_lerp_diff, (c_lerp_small ? v_dequantize_default : v_grad)));
-      const vf v_mul_2 = lb_round_bf16((v_dequantize_default_1 * lb_splat(c_hp_betas_1)));
-      const vf v_addcmul = lb_round_bf16(lb_fma((lb_splat(c_sub_2) * v_grad), v_grad, v_mul_2));
-      const vf v_sqrt = lb_round_bf16(lb_sqrt(v_addcmul));
-      const vf v_div = lb_round_bf16((v_sqrt * lb_splat(c_t9)));
-      const vf v_add_1 = lb_round_bf16((v_div + lb_splat(lb_round_bf16_s(c_hp_eps))));
-      const vf v_addcdiv = lb_round_bf16((v_mul_1 + ((lb_splat(c_neg) * v_lerp) / v_add_1)));
-      if (full) lb_st_bf16(p_param + i, v_addcdiv); else lb_st_bf16_n(p_param + i, v_addcdiv, r);
+      const vf v_lerp = lb_round_f16(lb_fma(lb_splat(c_t8), v_lerp_diff, (c_lerp_small ? v_dequantize_default : v_grad)));
+      const vf v_mul_2 = lb_round_f16((v_dequantize_default_1 * lb_splat(c_hp_betas_1)));
+      const vf v_addcmul = lb_round_f16(lb_fma((lb_splat(c_sub_2) * v_grad), v_grad, v_mul_2));
+      const vf v_sqrt = lb_round_f16(lb_sqrt(v_addcmul));
+      const vf v_div = lb_round_f16((v_sqrt * lb_splat(c_t9)));
+      const vf v_add_1 = lb_round_f16((v_div + lb_splat(lb_round_f16_s(c_hp_eps))));
+      const vf v_addcdiv = lb_round_f16((v_mul_1 + ((lb_splat(c_neg) * v_lerp) / v_add_1)));
+      if (full) lb_st_f16(p_param + i, v_addcdiv); else lb_st_f16_n(p_param + i, v_addcdiv, r);""")

    def test_format_constants_come_from_formats_py(self):
        self.assertExpectedInline(format_constants(), """\
enum { LB_INT8 = 0, LB_DYNAMIC8 = 1, LB_E4M3 = 2, LB_E5M2 = 3, LB_BF16_CODES = 4 };
template <int F, bool U> struct lb_format {};  // qmax, min_positive (and fp8's mantissa, min_exponent)
template <> struct lb_format<LB_INT8, false> { static constexpr float qmax = (float)0x1.fc00000000000p+6, min_positive = (float)0x1.0000000000000p+0; };
template <> struct lb_format<LB_INT8, true> { static constexpr float qmax = (float)0x1.fe00000000000p+7, min_positive = (float)0x1.0000000000000p+0; };
template <> struct lb_format<LB_DYNAMIC8, false> { static constexpr float qmax = (float)0x1.fc66660000000p-1, min_positive = (float)0x1.27476c0000000p-21; };
template <> struct lb_format<LB_DYNAMIC8, true> { static constexpr float qmax = (float)0x1.0000000000000p+0, min_positive = (float)0x1.5cf7520000000p-22; };
template <> struct lb_format<LB_E4M3, false> { static constexpr float qmax = (float)0x1.c000000000000p+8, min_positive = (float)0x1.0000000000000p-9; static constexpr int mantissa = 3, min_exponent = -6; };
template <> struct lb_format<LB_E4M3, true> { static constexpr float qmax = (float)0x1.c000000000000p+8, min_positive = (float)0x1.0000000000000p-9; static constexpr int mantissa = 3, min_exponent = -6; };
template <> struct lb_format<LB_E5M2, false> { static constexpr float qmax = (float)0x1.c000000000000p+15, min_positive = (float)0x1.0000000000000p-16; static constexpr int mantissa = 2, min_exponent = -14; };
template <> struct lb_format<LB_E5M2, true> { static constexpr float qmax = (float)0x1.c000000000000p+15, min_positive = (float)0x1.0000000000000p-16; static constexpr int mantissa = 2, min_exponent = -14; };
template <> struct lb_format<LB_BF16_CODES, false> { static constexpr float qmax = (float)0x1.0000000000000p+0, min_positive = (float)0x1.0000000000000p-133; };
template <> struct lb_format<LB_BF16_CODES, true> { static constexpr float qmax = (float)0x1.0000000000000p+0, min_positive = (float)0x1.0000000000000p-133; };""")
