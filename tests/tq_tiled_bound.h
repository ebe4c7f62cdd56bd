// Error bounds of tq4t's kernels (kv/tq_tiled.h) read off a head block, for tests: scores against
// exact dots of the rotated query with the decoded rotated keys, and the weighted sum per rotated
// channel.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "kv/int4_tiled.h"
#include "kv/tiles_ref.h"
#include "kv/tq_tiled.h"
#include "kv/turboquant.h"
#include "kvq/kv_format.h"

namespace kvq::test {

// tq4t, codec "tq4" where it stores tq4t's tiles, and their centered / scaled wrappers (which keep
// the inner codec's prepared query): told apart from tq4's rows by the prepared row's length.
inline bool tq4t_codec(const KvCodec& c) {
  const int hd = c.head_dim();
  if (c.info().name.rfind("tq", 0) != 0 || !tq4t_fits(hd)) return false;
  float cs;
  const float* cb = tq_lloyd_max(4, hd).centroids.data();
  return c.prepared_query_dim() == tq4t_layout(hd, cb, &cs).qdim;
}

struct Tq4tShape {
  Int4TiledLayout L;
  float cs = 0;
  std::vector<float> cb;  // the 16 centroids
};
inline Tq4tShape tq4t_shape(int hd) {
  Tq4tShape s;
  s.cb = tq_lloyd_max(4, hd).centroids;
  s.L = tq4t_layout(hd, s.cb.data(), &s.cs);
  return s;
}

// Norm of block slot t, and the code of its element d.
inline double tq4t_norm(const Int4TiledLayout& L, const uint8_t* block, int t) {
  return tile_f16(block + size_t(t / 16) * L.tile_bytes, size_t(t % 16));
}
inline int tq4t_code(const Int4TiledLayout& L, KvRole role, const uint8_t* block, int t, int d) {
  const uint8_t* codes = block + size_t(t / 16) * L.tile_bytes + L.code_off;
  return role == KvRole::key ? int4t_key_code(codes, t % 16, d) : int4t_value_code(codes, t % 16, d);
}

// |score - ||x|| <rq, c>| for rotated query rq (hd) against key slot t: half a query step times |c|,
// the codebook image's half step cs / 2 times |rq| + dq / 2, plus f32 rounding (1e-5 relative of
// the magnitudes).
inline double tq4t_score_bound(const Tq4tShape& s, const float* rq, const uint8_t* block, int t) {
  const int hd = s.L.hd;
  const double norm = tq4t_norm(s.L, block, t);
  double quant = 0, mag = 0;
  for (int b = 0; b < hd / 32; ++b) {
    double amax = 0;
    for (int j = 32 * b; j < 32 * b + 32; ++j) amax = std::max(amax, double(std::fabs(rq[j])));
    const double dq = amax / 127;
    for (int j = 32 * b; j < 32 * b + 32; ++j) {
      const double c = std::fabs(s.cb[size_t(tq4t_code(s.L, KvRole::key, block, t, j))]), aq = std::fabs(rq[j]);
      quant += dq / 2 * (1 + std::ldexp(1.0, -21)) * c + (aq + dq / 2) * s.cs / 2;
      mag += aq * (c + s.cs);
    }
  }
  return norm * (quant + 1e-5 * mag) + 1e-30;
}

// Per rotated channel, in model units (times cs), the weighted sum's error over tokens [t0, t0 + n)
// with weights w_t = p[t - t0] >= 0: half a u8 weight step per tile times the image's |C|, the
// image's half step per unit of weight, plus f32 rounding (1e-5 relative).
inline std::vector<double> tq4t_value_bound(const Tq4tShape& s, const uint8_t* block, int t0, int n, const double* p) {
  const int hd = s.L.hd;
  std::vector<double> e(size_t(hd), 0.0);
  for (int tile = t0 / 16; tile < (t0 + n + 15) / 16; ++tile) {
    double wmax = 0;
    for (int t = std::max(t0, tile * 16); t < std::min(t0 + n, tile * 16 + 16); ++t) {
      const double norm = tq4t_norm(s.L, block, t);
      wmax = std::max(wmax, std::fabs(p[t - t0] * norm));
    }
    for (int d = 0; d < hd; ++d) {
      double csum = 0, wsum = 0;
      for (int t = std::max(t0, tile * 16); t < std::min(t0 + n, tile * 16 + 16); ++t) {
        const double norm = tq4t_norm(s.L, block, t);
        const double c = std::abs(int(s.L.lut8[tq4t_code(s.L, KvRole::value, block, t, d)]));
        csum += c;
        wsum += std::fabs(p[t - t0] * norm) * (0.5 + 1e-5 * c);
      }
      e[size_t(d)] += (wmax / kv_int4t_u8_levels * 0.5 * int4t_weight_step_slack(kv_int4t_u8_levels) * csum + wsum) * s.cs;
    }
  }
  return e;
}

}  // namespace kvq::test
