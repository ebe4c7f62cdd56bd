// Error bound of kivi4t's / kivi2t's integer-dot key scores (kv/kivi_tiled.h) read off a key head
// block, for tests: the int8 rounding of q'_d = q_d s_d per 32-dim block plus f32 rounding.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/dtypes.h"
#include "kv/int2_tiled.h"
#include "kv/int4_tiled.h"
#include "kvq/kv_format.h"

namespace kvq::test {

inline bool kivi4t_key_codec(const KvCodec& c) { return c.info().name == "kivi4t_k"; }
inline bool kivi4t_value_codec(const KvCodec& c) { return c.info().name == "kivi4t_v"; }
inline bool kivi2t_key_codec(const KvCodec& c) { return c.info().name == "kivi2t_k"; }
inline bool kivi2t_value_codec(const KvCodec& c) { return c.info().name == "kivi2t_v"; }

// |score - <q, decode(k_t)>| bound for token t (block slot) of a kivi{4,2}t_k block of group G
// whose tiles hold tile_bytes of codes read by key_code (int4t_key_code / int2t_key_code):
//   sum_d (dq_b(d) / 2)(1 + 2^-21) c_td + (hd + 4) 2^-24 sum_d |q_d| (s_d c_td + |m_d| + |decode_td|),
// with dq_b = max_{d in b} |fl(q_d s_d)| / 127 as the fold computes it. q: (hd) the plain query.
inline double kivi_tiled_score_bound(const float* q, const uint8_t* block, int hd, int G, int t, size_t tile_bytes,
                                     int (*key_code)(const uint8_t*, int, int)) {
  const size_t group_bytes = size_t(hd) * 4 + size_t(G / 16) * tile_bytes;
  const uint8_t* grp = block + size_t(t / G) * group_bytes;
  const int tg = t % G, j = tg % 16;
  const uint8_t* codes = grp + size_t(hd) * 4 + size_t(tg / 16) * tile_bytes;
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
      const int c = key_code(codes, j, d);
      const double s = f16at(d), m = f16at(hd + d);
      quant += amax / 127 * 0.5 * (1 + std::ldexp(1.0, -21)) * c;
      mag += std::fabs(double(q[d])) * (s * c + std::fabs(m) + std::fabs(s * c + m));
    }
  }
  return quant + double(hd + 4) * std::ldexp(1.0, -24) * mag + 1e-30;
}
inline double kivi4t_score_bound(const float* q, const uint8_t* block, int hd, int G, int t) {
  return kivi_tiled_score_bound(q, block, hd, G, t, size_t(8 * hd), int4t_key_code);
}
inline double kivi2t_score_bound(const float* q, const uint8_t* block, int hd, int G, int t) {
  return kivi_tiled_score_bound(q, block, hd, G, t, int2t_code_bytes(hd), int2t_key_code);
}

}  // namespace kvq::test
