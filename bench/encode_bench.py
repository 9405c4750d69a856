"""Element encode + decode microbenchmark of the CPU kernels' formats: ns per element for a round
trip (fp32 values -> codes -> fp32 values) over an L2-resident buffer, every contender in the same
process, interleaved over rounds (min and median reported, with ratios to int8).

    python bench/encode_bench.py [--n 32768] [--reps 200] [--rounds 15]

Contenders: int8, dynamic8 (arithmetic, ``cpu_prelude.h``), fp8_e4m3, and as the baseline the
dynamic8 of map version 1: a 256-entry map decoded by a gather and encoded by one gather from a
bucket table keyed by the exponent and top mantissa bits (the kernel before map version 2, kept here
only to measure against). Signed (first moments) and unsigned (second moments) maps alike.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from lowbit_compile.formats import StateFormat, encode
from lowbit_compile.formats.dynamic import legacy_dynamic_map
from lowbit_compile.kernels import cpp_printer, cpu_build

RESULTS = Path(__file__).parent / "results"

# The version-1 dynamic8 element functions (the baseline), over the legacy map's midpoints.
_LEGACY = r"""
static const int V1_MIN_EXP = -30, V1_KEYS = (1 - V1_MIN_EXP) * 128;
struct v1_keys { int32_t e[2 * V1_KEYS]; };
static v1_keys v1_build(const float* mids) {
  v1_keys t;
  for (int neg = 0; neg < 2; ++neg)
    for (int k = 0; k < V1_KEYS; ++k) {
      const uint32_t lo_bits = (uint32_t)(k + ((127 + V1_MIN_EXP) << 7)) << 16, hi_bits = lo_bits + (1u << 16);
      float lo, hi;
      memcpy(&lo, &lo_bits, 4);
      memcpy(&hi, &hi_bits, 4);
      if (k == 0) lo = 0.0f;
      int32_t count = 0, threshold = 1 << 17;
      for (int j = 0; j < 255; ++j) {
        const float m = mids[j], a = __builtin_fabsf(m);
        uint32_t bits;
        memcpy(&bits, &a, 4);
        if (!neg) {
          if (m <= lo) ++count;
          else if (m < hi) threshold = (int32_t)(bits & 0xFFFF);
        } else {
          if (m <= -lo) ++count;
          if (m < 0 && a >= lo && a < hi) threshold = (int32_t)(bits & 0xFFFF) + 1;
        }
      }
      t.e[neg * V1_KEYS + k] = count | threshold << 8;
    }
  return t;
}
LB_INLINE vf v1_gather(const float* base, vi idx) {
  vf r;
  for (int l = 0; l < LB_W; ++l) r[l] = base[idx[l]];
  return r;
}
#if defined(__AVX2__) && LB_W == 8
#include <immintrin.h>
#define V1_GATHER(b, i) ((vf)_mm256_i32gather_ps((b), (__m256i)(i), 4))
#else
#define V1_GATHER(b, i) v1_gather((b), (i))
#endif
LB_INLINE vi v1_encode(vf y, const int32_t* keys, bool u) {
  const vi bits = lb_bits_i(y), neg = bits < 0, ab = bits & 0x7FFFFFFF;
  vi key = (ab >> 16) - ((127 + V1_MIN_EXP) << 7);
  key = key < 0 ? lb_splat_i(0) : key;
  key = key > V1_KEYS - 1 ? lb_splat_i(V1_KEYS - 1) : key;
  const vi e = lb_bits_i(V1_GATHER((const float*)keys, key + (neg & V1_KEYS)));
  const vi past = ((ab & 0xFFFF) >= (e >> 8)) & 1;
  vi idx = (e & 0xFF) + ((past ^ neg) - neg);
  idx = y != y ? lb_splat_i(255) : idx;
  if (u) idx = (y > 0) & (idx == 0) ? lb_splat_i(1) : idx;
  return idx;
}
static float v1_map[2][256], v1_mids[2][255];
static v1_keys v1_k[2];
extern "C" void v1_init(const float* map_s, const float* map_u) {
  for (int u = 0; u < 2; ++u) {
    memcpy(v1_map[u], u ? map_u : map_s, sizeof v1_map[u]);
    for (int j = 0; j < 255; ++j) v1_mids[u][j] = (float)(((double)v1_map[u][j] + v1_map[u][j + 1]) / 2);
    v1_k[u] = v1_build(v1_mids[u]);
  }
}
template <int F, bool U> static void trip(const float* x, uint8_t* c, float* y, int64_t n, int reps) {
  for (int r = 0; r < reps; ++r) {
    for (int64_t i = 0; i < n; i += LB_W) lb_st_codes(c + i, lb_encode<F, U>(lb_ld(x + i)));
    for (int64_t i = 0; i < n; i += LB_W) lb_st(y + i, lb_decode<F, U>(lb_ld_codes<F, U>(c + i)));
  }
}
template <bool U> static void trip_v1(const float* x, uint8_t* c, float* y, int64_t n, int reps) {
  for (int r = 0; r < reps; ++r) {
    for (int64_t i = 0; i < n; i += LB_W) lb_st_codes(c + i, v1_encode(lb_ld(x + i), v1_k[U].e, U));
    for (int64_t i = 0; i < n; i += LB_W) lb_st(y + i, V1_GATHER(v1_map[U], lb_ld_u8(c + i)));
  }
}
extern "C" void run(int which, const float* x, uint8_t* c, float* y, int64_t n, int reps) {
  switch (which) {
    case 0: trip<LB_INT8, false>(x, c, y, n, reps); break;
    case 1: trip<LB_INT8, true>(x, c, y, n, reps); break;
    case 2: trip<LB_DYNAMIC8, false>(x, c, y, n, reps); break;
    case 3: trip<LB_DYNAMIC8, true>(x, c, y, n, reps); break;
    case 4: trip_v1<false>(x, c, y, n, reps); break;
    case 5: trip_v1<true>(x, c, y, n, reps); break;
    case 6: trip<LB_E4M3, false>(x, c, y, n, reps); break;
    case 7: trip<LB_E4M3, true>(x, c, y, n, reps); break;
  }
}
"""

CONTENDERS = {  # name: (harness case, format, nonneg)
    "int8 signed": (0, "int8", False), "int8 unsigned": (1, "int8", True),
    "dynamic8 signed": (2, "dynamic8", False), "dynamic8 unsigned": (3, "dynamic8", True),
    "dynamic8 v1 (gathers) signed": (4, None, False), "dynamic8 v1 (gathers) unsigned": (5, None, True),
    "fp8_e4m3 signed": (6, "fp8_e4m3", False), "fp8_e4m3 unsigned": (7, "fp8_e4m3", True),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=32768, help="elements per buffer (fp32 in + out + codes stay in L2)")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    lib = cpu_build.load(cpp_printer.PRELUDE + _LEGACY)
    maps = [legacy_dynamic_map(False).contiguous(), legacy_dynamic_map(True).contiguous()]
    lib.v1_init(ctypes.c_void_p(maps[0].data_ptr()), ctypes.c_void_p(maps[1].data_ptr()))
    gen = torch.Generator().manual_seed(0)
    # values as a block's normalized state sees them: a spread of magnitudes, |x| <= qmax
    base = torch.randn(args.n, generator=gen) * torch.exp(torch.randn(args.n, generator=gen) * 2)
    base = base / base.abs().max()
    inputs, outputs, codes = {}, {}, {}
    for name, (_, fmt, nonneg) in CONTENDERS.items():
        x = base.abs() if nonneg else base.clone()
        qmax = StateFormat(fmt, nonneg=nonneg).qmax if fmt else 1.0
        inputs[name] = (x * qmax).contiguous()
        outputs[name], codes[name] = torch.empty(args.n), torch.empty(args.n, dtype=torch.uint8)
    # correctness first: the new dynamic8 round trip equals formats.encode
    for name in ("dynamic8 signed", "dynamic8 unsigned"):
        case, fmt, nonneg = CONTENDERS[name]
        lib.run(case, *(ctypes.c_void_p(t.data_ptr()) for t in (inputs[name], codes[name], outputs[name])),
                ctypes.c_int64(args.n), 1)
        assert torch.equal(codes[name], encode(inputs[name], StateFormat(fmt, nonneg=nonneg)).view(torch.uint8))
    times: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    names = list(CONTENDERS)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:  # rotating order
            ptrs = (ctypes.c_void_p(t.data_ptr()) for t in (inputs[name], codes[name], outputs[name]))
            t0 = time.perf_counter()
            lib.run(CONTENDERS[name][0], *ptrs, ctypes.c_int64(args.n), args.reps)
            times[name].append((time.perf_counter() - t0) / (args.n * args.reps) * 1e9)
    rows = {name: (min(t), statistics.median(t)) for name, t in times.items()}
    command = f"bench/encode_bench.py --n {args.n} --reps {args.reps} --rounds {args.rounds}"
    lines = [f"Measured {time.strftime('%Y-%m-%d %H:%M')}, torch {torch.__version__}, {platform.machine()}, "
             f"load averages {os.getloadavg()}; command: {command}",
             "", "| encode + decode | ns/elem min | ns/elem median | min / int8 of its sign |", "|---|---:|---:|---:|"]
    for name, (lo, med) in rows.items():
        ref = rows["int8 unsigned" if "unsigned" in name else "int8 signed"][0]
        lines.append(f"| {name} | {lo:.3f} | {med:.3f} | {lo / ref:.2f}x |")
    text = "\n".join(lines)
    print(text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "encode_bench.md").write_text(text + "\n")
    (RESULTS / "encode_bench.json").write_text(json.dumps({"args": vars(args), "ns_per_elem": times}, indent=1))


if __name__ == "__main__":
    main()
