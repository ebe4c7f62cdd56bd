// Error bounds of the tiled int2 kernels (kv/int2_tiled.h) and of kivi2t's key scores
// (kv/kivi_tiled.h) read off a head block, for tests: int4t's and kivi4t's bounds
// (tests/int4_tiled_bound.h, tests/kivi_tiled_bound.h) with int2t's code layout and codes 0..3.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "core/dtypes.h"
#include "int4_tiled_bound.h"
#include "kv/int2_tiled.h"
#include "kvq/kv_format.h"

namespace kvq::test {

inline bool int2t_codec(const KvCodec& c) { return c.info().name.rfind("int2t_g", 0) == 0; }
inline Int4TiledLayout int2t_layout_of(const KvCodec& c) {
  return int2t_layout(c.head_dim(), std::stoi(c.info().name.substr(7)));
}

// int4t's bounds (tests/int4_tiled_bound.h) with int2t's crumb readers.
inline constexpr TileCodes kInt2tCodes{int2t_key_code, int2t_value_code};
inline void int2t_scm(const Int4TiledLayout& L, KvRole role, const uint8_t* block, int t, int d, double* s,
                      double* m, int* c) {
  tile_scm(L, kInt2tCodes, role, block, t, d, s, m, c);
}
inline double int2t_score_bound(const Int4TiledLayout& L, const float* q, const uint8_t* block, int t) {
  return tile_score_bound(L, kInt2tCodes, q, block, t);
}
inline double int2t_value_bound(const Int4TiledLayout& L, const uint8_t* block, int t0, int n, const double* pi,
                                double pi_scale) {
  return tile_value_bound(L, kInt2tCodes, block, t0, n, pi, pi_scale);
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
