// Error bounds of the tiled int2 kernels (kv/int2_tiled.h) and of kivi2t's key scores
// (kv/kivi_tiled.h) read off a head block, for tests: int4t's and kivi4t's bounds
// (tests/int4_tiled_bound.h, tests/kivi_tiled_bound.h) with int2t's code layout and codes 0..3.
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

inline bool kivi2t_key_codec(const KvCodec& c) { return c.info().name == "kivi2t_k"; }
inline bool kivi2t_value_codec(const KvCodec& c) { return c.info().name == "kivi2t_v"; }

// |score - <q, decode(k_t)>| bound for token t (block slot) of a kivi2t_k block of group G:
//   sum_d (dq_b(d) / 2)(1 + 2^-21) c_td + (hd + 4) 2^-24 sum_d |q_d| (s_d c_td + |m_d| + |decode_td|),
// with dq_b = max_{d in b} |fl(q_d s_d)| / 127 as the fold computes it. q: (hd) the plain query.
inline double kivi2t_score_bound(const float* q, const uint8_t* block, int hd, int G, int t) {
  const size_t group_bytes = size_t(hd) * 4 + size_t(G / 16) * int2t_code_bytes(hd);
  const uint8_t* grp = block + size_t(t / G) * group_bytes;
  const int tg = t % G, j = tg % 16;
  const uint8_t* codes = grp + size_t(hd) * 4 + size_t(tg / 16) * int2t_code_bytes(hd);
  auto f16at = [&](int i) {
    f16_t h;
    std::memcpy(&h, grp + 2 * size_t(i), 2);
    return f16_to_f32(h);
  };
  double quant = 0, mag = 0;
  for (int b = 0; b < hd / 32; ++b) {
    double amax = 0;
    for (int d = 32 * b; d < 32 * b + 32; ++d) amax = std::max(amax, double(std::fabs(q[d] * f16at(d))));
    for (int d = 32 * b; d < 32 * b + 32; ++d) {
      const int c = int2t_key_code(codes, j, d);
      const double s = f16at(d), m = f16at(hd + d);
      quant += amax / 127 * 0.5 * (1 + std::ldexp(1.0, -21)) * c;
      mag += std::fabs(double(q[d])) * (s * c + std::fabs(m) + std::fabs(s * c + m));
    }
  }
  return quant + double(hd + 4) * std::ldexp(1.0, -24) * mag + 1e-30;
}

}  // namespace kvq::test
