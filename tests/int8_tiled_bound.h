// Error bounds of the tiled int8 kernels (kv/int8_tiled.h) read off a head block, for tests:
// scores (int8 query rounding) and, inside decode attention, the weighted sum (u8 weights per
// (query row, tile)).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "kv/int4_tiled.h"
#include "kv/int8_tiled.h"
#include "kvq/kv_format.h"

namespace kvq::test {

// Exactly "int8t" or "q8_0t" (q8_0 in int8t's tiles): the names are prefixes of none of the other
// codecs' tests (int8, int8_c, q8_0, q8_0h, ...).
// q8_0h rotates q8_0t; q8_0h_c / _s / _cs center and / or scale that.
inline bool int8t_codec(const KvCodec& c) {
  const std::string& n = c.info().name;
  // "int8_c" centers codec "int8", which is int8t's tiles when head_dim % 32 == 0 (else rows).
  return n == "int8t" || n == "q8_0t" || n == "q8_0h" || n == "q8_0h_c" || n == "q8_0h_s" || n == "q8_0h_cs" ||
         (n == "int8_c" && c.head_dim() % 32 == 0);
}
inline Int8TiledLayout int8t_layout_of(const KvCodec& c) {
  return c.info().name.rfind("q8_0", 0) == 0 ? q8_0t_layout(c.head_dim()) : int8t_layout(c.head_dim());
}

// Scale and signed code of element d of token t (block slot) in a key or value tile block.
inline void int8t_sc(const Int8TiledLayout& L, KvRole role, const uint8_t* block, int t, int d, double* s, int* c) {
  const int j = t % 16;
  const uint8_t* tp = block + size_t(t / 16) * L.tile_bytes;
  *s = int8t_tile_scale(L, tp, j, d / 32);  // int8t: the token's; q8_0t: its block's
  const uint8_t* codes = tp + L.code_off;
  if (role == KvRole::key) *c = int(codes[64 * (d / 4) + 4 * j + d % 4]) - 128;
  else *c = int(int8_t(codes[64 * (4 * (d / 16) + j / 4) + 4 * (d % 16) + j % 4]));
}

// |score - <q, decode(k_t)>|: half the second query digit's step, dq_b / 508 per 32-dim block
// (+ 2^-20 relative, + 2^-22 |q|), times |s c|,
// plus f32 rounding (relative 1e-5 of the magnitudes). q: (head_dim) the plain query.
inline double int8t_score_bound(const Int8TiledLayout& L, const float* q, const uint8_t* block, int t) {
  double quant = 0, mag = 0;
  for (int b = 0; b < L.hd / 32; ++b) {
    double amax = 0;
    for (int j = 32 * b; j < 32 * b + 32; ++j) amax = std::max(amax, double(std::fabs(q[j])));
    for (int j = 32 * b; j < 32 * b + 32; ++j) {
      double s;
      int c;
      int8t_sc(L, KvRole::key, block, t, j, &s, &c);
      const double sc = std::fabs(s * c);
      quant += (amax / 127 / 508 * (1 + std::ldexp(1.0, -20)) + std::ldexp(std::fabs(double(q[j])), -22)) * sc;
      mag += std::fabs(double(q[j])) * sc;
    }
  }
  return quant + 1e-5 * mag + 1e-30;
}

// Inside decode attention: the weighted sum of the tokens [t0, t0 + n) of a value block moves
// output channel d (acc / l) by at most sum over its tiles of half a step max_t (pi_t s_t) / 255
// (s_t: the token's scale, or for q8_0t its scale for d's block) times sum_t |c_t[d]| (the step's
// rounding slack is within the final 1.001); pi: those tokens' normalized probabilities, pi_scale:
// how far the kernel's may exceed them. Returns the largest channel bound.
inline double int8t_value_bound(const Int8TiledLayout& L, const uint8_t* block, int t0, int n, const double* pi,
                                double pi_scale) {
  double worst = 0;
  for (int d = 0; d < L.hd; ++d) {
    double e = 0;
    for (int tile = t0 / 16; tile < (t0 + n + 15) / 16; ++tile) {
      double wmax = 0, csum = 0;
      for (int t = std::max(t0, tile * 16); t < std::min(t0 + n, tile * 16 + 16); ++t) {
        double s;
        int c;
        int8t_sc(L, KvRole::value, block, t, d, &s, &c);
        wmax = std::max(wmax, pi[t - t0] * s);
        csum += std::abs(c);
      }
      e += wmax / kv_int4t_u8_levels * 0.5 * csum;
    }
    worst = std::max(worst, e);
  }
  return worst * pi_scale * 1.001;
}

}  // namespace kvq::test
