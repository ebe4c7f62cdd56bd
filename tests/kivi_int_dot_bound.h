// Error bounds of the KIVI key scores and value sums on AVX-512 (kivi_avx512.cpp) against the
// float reference, derived from their arithmetic, for tests.
//
// Per key group the kernel folds qs_c = q_c * scale_c (f32, as kivi_fold_query) and rounds each
// query row to int16 steps dq = max_c |qs_c| / 32767; the integer dot of the codes is exact, so
// the only approximation is |qs_c - dq * round(qs_c / dq)| <= dq / 2 (plus a relative 2^-20 of dq
// for the f32 product qs_c * (1 / dq) before rounding) times code_c. Head dims that are not a
// multiple of 64 keep the float kernel (bound 0).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "core/cpu.h"
#include "core/dtypes.h"
#include "kv/kivi.h"
#include "kvq/kv_format.h"

namespace kvq::test {

inline bool kivi_tiled_name(const std::string& n) { return n.rfind("kivi4t", 0) == 0 || n.rfind("kivi2t", 0) == 0; }

inline bool kivi_int_keys(const KvCodec& kc) {
  const std::string& n = kc.info().name;
  // kivi4t_* / kivi2t_* (kv/kivi_tiled.h) have their own kernels and bounds (kivi_tiled_bound.h,
  // int2_tiled_bound.h).
  return cpu_level() == CpuLevel::avx512 && n.rfind("kivi", 0) == 0 && !kivi_tiled_name(n) && n.size() > 2 &&
         n.compare(n.size() - 2, 2, "_k") == 0 && kc.head_dim() % 64 == 0;
}

// Largest |score error| over tokens [0, bt) of one head block and query rows q (n_q, head_dim).
inline double kivi_int_dot_bound(const KvCodec& kc, const float* q, int n_q, const uint8_t* block, int bt) {
  const int d = kc.head_dim(), g = kc.info().group_tokens, bits = kc.info().code_bits;
  const size_t rb = bitplane_row_bytes(bits, d), gb = size_t(d) * 4 + size_t(g) * rb;
  double worst = 0;
  for (int g0 = 0; g0 < bt; g0 += g) {
    const uint8_t* grp = block + size_t(g0 / g) * gb;
    for (int i = 0; i < n_q; ++i) {
      double amax = 0;
      for (int c = 0; c < d; ++c) {
        f16_t h;
        std::memcpy(&h, grp + 2 * c, 2);
        amax = std::max(amax, double(std::fabs(q[size_t(i) * d + c] * f16_to_f32(h))));
      }
      const double half_step = amax / 32767 * (0.5 + std::ldexp(1.0, -20));
      for (int t = 0; t < g; ++t) {
        double csum = 0;
        for (int c = 0; c < d; ++c) csum += bitplane_code(grp + size_t(d) * 4 + size_t(t) * rb, bits, d, c);
        worst = std::max(worst, half_step * csum);
      }
    }
  }
  return worst;
}

// Values (KIVI / KVQuant value codecs): per run of up to 64 tokens the kernel rounds
// w_t = p_t * scale_t (per query and group) to int16 steps dw = max_t |w_t| / 32767, so each
// accumulated element moves by at most sum_t dw (0.5 + 2^-20) code_t. Inside decode attention
// p <= 1 (scores minus the running max) and scale * (2^b - 1) <= the token's group range <=
// 2 max|v|, so an output (acc / l, l >= 1) moves by at most n_tokens * 2 max|v| / 65534 (* 1.001
// for the f16 rounding of the scale).
inline bool kivi_int_values(const KvCodec& vc) {
  const std::string& n = vc.info().name;
  return cpu_level() == CpuLevel::avx512 && ((n.rfind("kivi", 0) == 0 && !kivi_tiled_name(n)) || n.rfind("kvquant", 0) == 0) &&
         n.size() > 2 && n.compare(n.size() - 2, 2, "_v") == 0 && vc.head_dim() % 64 == 0;
}
inline double kivi_int_values_attn_bound(int n_tokens, double v_max) {
  return double(n_tokens) * 2 * v_max / 65534 * 1.001;
}

}  // namespace kvq::test
