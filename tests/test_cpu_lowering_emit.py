"""Snapshots of the C++ the CPU lowering emits: a change in the generated kernel shows in review."""

from __future__ import annotations

import torch
from expecttest import TestCase

from lowbit_compile.kernels.cpu_emit import emit_step

from .graphs import pass_graphs


def _body(fmt: str, **kw) -> torch.fx.GraphModule:
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.randn(64))], **kw)
    return pass_graphs(opt, fmt)["split"].body


def _kernel(source: str) -> str:
    """The per-block function (the entry point and tables are fixed text)."""
    start = source.index("static void lb_step_block")
    return source[start:source.index("\n}\n", start) + 2]


class TestEmittedKernels(TestCase):
    def test_adamw_int8(self):
        """One pass of the traced update (fp32, FMA where aten fuses, SIMD sqrt, reciprocal of the
        bias correction) decoding m and v as it goes (codes times scale, patches into their lanes),
        writing new m and v to block buffers and each lane's largest |m|, |v|; then re-quantize."""
        emitted = emit_step(_body("int8", weight_decay=0.1), exact=False)
        self.assertExpectedInline(_kernel(emitted.source), """\
static void lb_step_block(const int64_t* ptr, const float* s, int64_t start, int64_t len, int64_t blk,
                          float* scratch) {
  float* __restrict p_param = (float*)ptr[0] + start;
  const float* __restrict p_grad = (const float*)ptr[1] + start;
  uint8_t* __restrict p_exp_avg_codes = (uint8_t*)ptr[2] + start;
  float* __restrict p_exp_avg_scales = (float*)ptr[3] + blk;
  uint16_t* __restrict p_exp_avg_patch_values = (uint16_t*)ptr[4] + blk * 2;
  int16_t* __restrict p_exp_avg_patch_index = (int16_t*)ptr[5] + blk * 2;
  uint8_t* __restrict p_exp_avg_sq_codes = (uint8_t*)ptr[6] + start;
  float* __restrict p_exp_avg_sq_scales = (float*)ptr[7] + blk;
  uint16_t* __restrict p_exp_avg_sq_patch_values = (uint16_t*)ptr[8] + blk * 2;
  int16_t* __restrict p_exp_avg_sq_patch_index = (int16_t*)ptr[9] + blk * 2;
  const vf S0 = lb_splat(s[0]);
  const vf S1 = lb_splat(s[1]);
  const vf S2 = lb_splat(s[2]);
  const vf S3 = lb_splat(s[3]);
  const vf S4 = lb_splat(s[4]);
  const vf S5 = lb_splat(s[5]);
  const vf S6 = lb_splat(s[6]);
  const bool L0_small = fabsf(s[1]) < 0.5f;
  const vf L0_w = lb_splat(s[1]), L0_wm1 = lb_splat(s[1] - 1.0f);
  const vf R1 = lb_splat(1.0f / s[4]);
  float* __restrict buf_exp_avg = scratch + 0 * LB_BLOCK;
  const vf SC_exp_avg = lb_splat(*p_exp_avg_scales);
  int64_t PI_exp_avg[2];
  float PV_exp_avg[2];
  const int PC_exp_avg = lb_sorted_patches<2>(p_exp_avg_patch_index, p_exp_avg_patch_values, len, PI_exp_avg, PV_exp_avg);
  int PA_exp_avg = 0;
  int64_t PN_exp_avg = PC_exp_avg ? PI_exp_avg[0] : LB_NO_PATCH;
  vi acc_exp_avg = lb_splat_i(-1);
  float* __restrict buf_exp_avg_sq = scratch + 1 * LB_BLOCK;
  const vf SC_exp_avg_sq = lb_splat(*p_exp_avg_sq_scales);
  int64_t PI_exp_avg_sq[2];
  float PV_exp_avg_sq[2];
  const int PC_exp_avg_sq = lb_sorted_patches<2>(p_exp_avg_sq_patch_index, p_exp_avg_sq_patch_values, len, PI_exp_avg_sq, PV_exp_avg_sq);
  int PA_exp_avg_sq = 0;
  int64_t PN_exp_avg_sq = PC_exp_avg_sq ? PI_exp_avg_sq[0] : LB_NO_PATCH;
  vi acc_exp_avg_sq = lb_splat_i(-1);
  {
    int64_t i = 0;
    for (; i + LB_W <= len; i += LB_W) {
      const bool full = true;
      const int64_t r = LB_W;
      const vf v_param = full ? lb_ld(p_param + i) : lb_ld_n(p_param + i, r);
      const vf v_grad = full ? lb_ld(p_grad + i) : lb_ld_n(p_grad + i, r);
      vf v_dequantize_default = lb_decode<LB_INT8, false>(full ? lb_ld_codes(p_exp_avg_codes + i) : lb_ld_codes_n(p_exp_avg_codes + i, r), nullptr) * SC_exp_avg;
      while (PN_exp_avg < i + LB_W) {  // a patch falls in this vector
        v_dequantize_default[PN_exp_avg - i] = PV_exp_avg[PA_exp_avg];
        PN_exp_avg = ++PA_exp_avg < PC_exp_avg ? PI_exp_avg[PA_exp_avg] : LB_NO_PATCH;
      }
      vf v_dequantize_default_1 = lb_decode<LB_INT8, true>(full ? lb_ld_codes(p_exp_avg_sq_codes + i) : lb_ld_codes_n(p_exp_avg_sq_codes + i, r), nullptr) * SC_exp_avg_sq;
      while (PN_exp_avg_sq < i + LB_W) {  // a patch falls in this vector
        v_dequantize_default_1[PN_exp_avg_sq - i] = PV_exp_avg_sq[PA_exp_avg_sq];
        PN_exp_avg_sq = ++PA_exp_avg_sq < PC_exp_avg_sq ? PI_exp_avg_sq[PA_exp_avg_sq] : LB_NO_PATCH;
      }
      const vf v_mul_1 = v_param * S0;
      const vf v_lerp = L0_small ? lb_fma(L0_w, v_grad - v_dequantize_default, v_dequantize_default) : lb_fma(L0_wm1, v_grad - v_dequantize_default, v_grad);
      const vf v_mul_2 = v_dequantize_default_1 * S2;
      const vf v_addcmul = lb_fma(S3 * v_grad, v_grad, v_mul_2);
      const vf v_sqrt = lb_sqrt(v_addcmul);
      const vf v_div = v_sqrt * R1;
      const vf v_add_1 = v_div + S5;
      const vf v_addcdiv = v_mul_1 + S6 * v_lerp / v_add_1;
      if (full) lb_st(p_param + i, v_addcdiv); else lb_st_n(p_param + i, v_addcdiv, r);
      if (full) lb_st(buf_exp_avg + i, v_lerp); else lb_st_n(buf_exp_avg + i, v_lerp, r);
      acc_exp_avg = lb_vmax(acc_exp_avg, lb_key_masked(v_lerp, r));
      if (full) lb_st(buf_exp_avg_sq + i, v_addcmul); else lb_st_n(buf_exp_avg_sq + i, v_addcmul, r);
      acc_exp_avg_sq = lb_vmax(acc_exp_avg_sq, lb_key_masked(v_addcmul, r));
    }
    if (i < len) {
      const bool full = false;
      const int64_t r = len - i;
      const vf v_param = full ? lb_ld(p_param + i) : lb_ld_n(p_param + i, r);
      const vf v_grad = full ? lb_ld(p_grad + i) : lb_ld_n(p_grad + i, r);
      vf v_dequantize_default = lb_decode<LB_INT8, false>(full ? lb_ld_codes(p_exp_avg_codes + i) : lb_ld_codes_n(p_exp_avg_codes + i, r), nullptr) * SC_exp_avg;
      while (PN_exp_avg < i + LB_W) {  // a patch falls in this vector
        v_dequantize_default[PN_exp_avg - i] = PV_exp_avg[PA_exp_avg];
        PN_exp_avg = ++PA_exp_avg < PC_exp_avg ? PI_exp_avg[PA_exp_avg] : LB_NO_PATCH;
      }
      vf v_dequantize_default_1 = lb_decode<LB_INT8, true>(full ? lb_ld_codes(p_exp_avg_sq_codes + i) : lb_ld_codes_n(p_exp_avg_sq_codes + i, r), nullptr) * SC_exp_avg_sq;
      while (PN_exp_avg_sq < i + LB_W) {  // a patch falls in this vector
        v_dequantize_default_1[PN_exp_avg_sq - i] = PV_exp_avg_sq[PA_exp_avg_sq];
        PN_exp_avg_sq = ++PA_exp_avg_sq < PC_exp_avg_sq ? PI_exp_avg_sq[PA_exp_avg_sq] : LB_NO_PATCH;
      }
      const vf v_mul_1 = v_param * S0;
      const vf v_lerp = L0_small ? lb_fma(L0_w, v_grad - v_dequantize_default, v_dequantize_default) : lb_fma(L0_wm1, v_grad - v_dequantize_default, v_grad);
      const vf v_mul_2 = v_dequantize_default_1 * S2;
      const vf v_addcmul = lb_fma(S3 * v_grad, v_grad, v_mul_2);
      const vf v_sqrt = lb_sqrt(v_addcmul);
      const vf v_div = v_sqrt * R1;
      const vf v_add_1 = v_div + S5;
      const vf v_addcdiv = v_mul_1 + S6 * v_lerp / v_add_1;
      if (full) lb_st(p_param + i, v_addcdiv); else lb_st_n(p_param + i, v_addcdiv, r);
      if (full) lb_st(buf_exp_avg + i, v_lerp); else lb_st_n(buf_exp_avg + i, v_lerp, r);
      acc_exp_avg = lb_vmax(acc_exp_avg, lb_key_masked(v_lerp, r));
      if (full) lb_st(buf_exp_avg_sq + i, v_addcmul); else lb_st_n(buf_exp_avg_sq + i, v_addcmul, r);
      acc_exp_avg_sq = lb_vmax(acc_exp_avg_sq, lb_key_masked(v_addcmul, r));
    }
  }
  lb_quantize_block<LB_INT8, false, 2>(acc_exp_avg, buf_exp_avg, len, LB_BLOCK, (float)0x1.fc00000000000p+6, p_exp_avg_codes, p_exp_avg_scales, p_exp_avg_patch_values, p_exp_avg_patch_index, nullptr);
  lb_quantize_block<LB_INT8, true, 2>(acc_exp_avg_sq, buf_exp_avg_sq, len, LB_BLOCK, (float)0x1.fe00000000000p+7, p_exp_avg_sq_codes, p_exp_avg_sq_scales, p_exp_avg_sq_patch_values, p_exp_avg_sq_patch_index, nullptr);
}""")

    def test_adamw_fp32_states_take_torch_sqrt(self):
        """Stock states: a first pass writes v to a buffer for torch's own square root, the second
        runs the update reading it back; true division everywhere."""
        emitted = emit_step(_body("fp32", weight_decay=0.1), exact=True)
        self.assertExpectedInline(_kernel(emitted.source), """\
static void lb_step_block(const int64_t* ptr, const float* s, int64_t start, int64_t len, int64_t blk,
                          float* scratch) {
  float* __restrict p_param = (float*)ptr[0] + start;
  const float* __restrict p_grad = (const float*)ptr[1] + start;
  float* __restrict p_state_exp_avg = (float*)ptr[2] + start;
  float* __restrict p_state_exp_avg_sq = (float*)ptr[3] + start;
  const vf S0 = lb_splat(s[0]);
  const vf S1 = lb_splat(s[1]);
  const vf S2 = lb_splat(s[2]);
  const vf S3 = lb_splat(s[3]);
  const vf S4 = lb_splat(s[4]);
  const vf S5 = lb_splat(s[5]);
  const vf S6 = lb_splat(s[6]);
  const bool L0_small = fabsf(s[1]) < 0.5f;
  const vf L0_w = lb_splat(s[1]), L0_wm1 = lb_splat(s[1] - 1.0f);
  float* __restrict sq_sqrt = scratch + 0 * LB_BLOCK;
  {
    int64_t i = 0;
    for (; i + LB_W <= len; i += LB_W) {
      const bool full = true;
      const int64_t r = LB_W;
      const vf v_grad = full ? lb_ld(p_grad + i) : lb_ld_n(p_grad + i, r);
      const vf v_state_exp_avg_sq = full ? lb_ld(p_state_exp_avg_sq + i) : lb_ld_n(p_state_exp_avg_sq + i, r);
      const vf v_mul_2 = v_state_exp_avg_sq * S2;
      const vf v_addcmul = lb_fma(S3 * v_grad, v_grad, v_mul_2);
      if (full) lb_st(sq_sqrt + i, v_addcmul); else lb_st_n(sq_sqrt + i, v_addcmul, r);
    }
    if (i < len) {
      const bool full = false;
      const int64_t r = len - i;
      const vf v_grad = full ? lb_ld(p_grad + i) : lb_ld_n(p_grad + i, r);
      const vf v_state_exp_avg_sq = full ? lb_ld(p_state_exp_avg_sq + i) : lb_ld_n(p_state_exp_avg_sq + i, r);
      const vf v_mul_2 = v_state_exp_avg_sq * S2;
      const vf v_addcmul = lb_fma(S3 * v_grad, v_grad, v_mul_2);
      if (full) lb_st(sq_sqrt + i, v_addcmul); else lb_st_n(sq_sqrt + i, v_addcmul, r);
    }
  }
  lb_vsqrt(len, sq_sqrt);
  {
    int64_t i = 0;
    for (; i + LB_W <= len; i += LB_W) {
      const bool full = true;
      const int64_t r = LB_W;
      const vf v_param = full ? lb_ld(p_param + i) : lb_ld_n(p_param + i, r);
      const vf v_grad = full ? lb_ld(p_grad + i) : lb_ld_n(p_grad + i, r);
      const vf v_state_exp_avg = full ? lb_ld(p_state_exp_avg + i) : lb_ld_n(p_state_exp_avg + i, r);
      const vf v_state_exp_avg_sq = full ? lb_ld(p_state_exp_avg_sq + i) : lb_ld_n(p_state_exp_avg_sq + i, r);
      const vf v_mul_1 = v_param * S0;
      const vf v_lerp = L0_small ? lb_fma(L0_w, v_grad - v_state_exp_avg, v_state_exp_avg) : lb_fma(L0_wm1, v_grad - v_state_exp_avg, v_grad);
      const vf v_mul_2 = v_state_exp_avg_sq * S2;
      const vf v_addcmul = lb_fma(S3 * v_grad, v_grad, v_mul_2);
      const vf v_sqrt = full ? lb_ld(sq_sqrt + i) : lb_ld_n(sq_sqrt + i, r);
      const vf v_div = v_sqrt / S4;
      const vf v_add_1 = v_div + S5;
      const vf v_addcdiv = v_mul_1 + S6 * v_lerp / v_add_1;
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
      const vf v_mul_1 = v_param * S0;
      const vf v_lerp = L0_small ? lb_fma(L0_w, v_grad - v_state_exp_avg, v_state_exp_avg) : lb_fma(L0_wm1, v_grad - v_state_exp_avg, v_grad);
      const vf v_mul_2 = v_state_exp_avg_sq * S2;
      const vf v_addcmul = lb_fma(S3 * v_grad, v_grad, v_mul_2);
      const vf v_sqrt = full ? lb_ld(sq_sqrt + i) : lb_ld_n(sq_sqrt + i, r);
      const vf v_div = v_sqrt / S4;
      const vf v_add_1 = v_div + S5;
      const vf v_addcdiv = v_mul_1 + S6 * v_lerp / v_add_1;
      if (full) lb_st(p_param + i, v_addcdiv); else lb_st_n(p_param + i, v_addcdiv, r);
      if (full) lb_st(p_state_exp_avg + i, v_lerp); else lb_st_n(p_state_exp_avg + i, v_lerp, r);
      if (full) lb_st(p_state_exp_avg_sq + i, v_addcmul); else lb_st_n(p_state_exp_avg_sq + i, v_addcmul, r);
    }
  }
}""")
