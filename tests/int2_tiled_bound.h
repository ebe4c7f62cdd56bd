// Error bounds of the tiled int2 kernels (kv/int2_tiled.h) read off a head block, for tests:
// int4t's bounds (tests/int4_tiled_bound.h) with int2t's code layout and codes 0..3.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "core/dtypes.h"
#include "kv/int2_tiled.h"
#include "kvq/kv_format.h"

namespace kvq::test {

inline bool int2t_codec(const KvCodec& c) { return c.info().name.rfind("int2t_g", 0) == 0; }
inline Int4TiledLayout int2t_layout_of(const KvCodec& c) {
  return int2t_layout(c.head_dim(), std::stoi(c.info().name.substr(7)));
}

// Scale, minimum and code of element d of token t (block slot) in a key or value tile block.
inline void int2t_scm(const Int4TiledLayout& L, KvRole role, const uint8_t* block, int t, int d, double* s,
                      double* m, int* c) {
  const int j = t % 16, g = d / L.group;
  const uint8_t* tp = block + size_t(t / 16) * L.tile_bytes;
  f16_t hs, hm;
  std::memcpy(&hs, tp + 2 * size_t(g * 16 + j), 2);
  std::memcpy(&hm, tp + L.min_off + 2 * size_t(g * 16 + j), 2);
  *s = f16_to_f32(hs);
  *m = f16_to_f32(hm);
  const uint8_t* codes = tp + L.code_off;
  *c = role == KvRole::key ? int2t_key_code(codes, j, d) : int2t_value_code(codes, j, d);
}

// |score - <q, decode(k_t)>| bound of the integer-dot scores: half a query step (per 32-dim block,
// + 2^-22 relative for the f32 product before rounding) times |s c|, plus f32 rounding (relative
// 1e-5 of the magnitudes summed). q: (head_dim) the plain query.
inline double int2t_score_bound(const Int4TiledLayout& L, const float* q, const uint8_t* block, int t) {
  double quant = 0, mag = 0;
  for (int b = 0; b < L.hd / 32; ++b) {
    double amax = 0;
    for (int j = 32 * b; j < 32 * b + 32; ++j) amax = std::max(amax, double(std::fabs(q[j])));
    for (int j = 32 * b; j < 32 * b + 32; ++j) {
      double s, m;
      int c;
      int2t_scm(L, KvRole::key, block, t, j, &s, &m, &c);
      const double sc = std::fabs(s * c), aq = std::fabs(double(q[j]));
      quant += amax / 127 * 0.5 * (1 + std::ldexp(1.0, -21)) * sc;
      mag += aq * (sc + std::fabs(m) + std::fabs(s * c + m));
    }
  }
  return quant + 1e-5 * mag + 1e-30;
}

// Inside decode attention: one weighted-sum call over tokens [t0, t0 + n) of a value block moves
// output channel d (acc / l) by at most sum over its tiles of half a weight step
// dw / l = max_t (pi_t s_t) / 255 times sum_t c_t[d] (as int4t_value_bound). pi: the normalized
// probabilities of those tokens; pi_scale: how far the kernel's may exceed them (e^(2 Delta)).
inline double int2t_value_bound(const Int4TiledLayout& L, const uint8_t* block, int t0, int n, const double* pi,
                                double pi_scale) {
  double worst = 0;
  for (int d = 0; d < L.hd; ++d) {
    double e = 0;
    for (int tile = t0 / 16; tile < (t0 + n + 15) / 16; ++tile) {
      double wmax = 0, csum = 0;
      for (int t = std::max(t0, tile * 16); t < std::min(t0 + n, tile * 16 + 16); ++t) {
        double s, m;
        int c;
        int2t_scm(L, KvRole::value, block, t, d, &s, &m, &c);
        wmax = std::max(wmax, pi[t - t0] * s);
        csum += c;
      }
      e += wmax / kv_int4t_u8_levels * 0.5 * csum;
    }
    worst = std::max(worst, e);
  }
  return worst * pi_scale * 1.001;
}

}  // namespace kvq::test
