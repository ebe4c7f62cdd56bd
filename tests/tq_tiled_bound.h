// Error bounds of the kernels of TurboQuant's tiles (kv/tq_tiled.h) read off a head block, for
// tests: scores against exact dots of the rotated query with the decoded rotated keys, and the
// weighted sum per rotated channel.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "kv/int4_tiled.h"
#include "kv/tiles_ref.h"
#include "kv/tq_tiled.h"
#include "kv/turboquant.h"
#include "kvq/kv_format.h"

namespace kvq::test {

// The layout of TurboQuant at `bits` on head_dim hd, and each segment's centroids; ok = false when
// the tiles do not fit.
struct TqtShape {
  bool ok = false;
  TqTiledLayout L;
  std::vector<float> cb[2];
  float c(int d, int code) const { return cb[L.block_seg[d / 32]][size_t(code)]; }
  float cs(int d) const { return L.seg[L.block_seg[d / 32]].cs; }
};
inline TqtShape tqt_shape(double bits, int hd) {
  TqtShape s;
  int n_hi = 0, bh = 0, bl = 0;
  tq_split_bits("test", TqConfig{bits, false, TqRotationKind::hadamard}, hd, &n_hi, &bh, &bl);
  if (!tq_tiled_fits(hd, n_hi, bh, bl)) return s;
  s.cb[0] = tq_lloyd_max(bh, hd).centroids;
  s.cb[1] = n_hi < hd ? tq_lloyd_max(bl, hd).centroids : s.cb[0];
  s.L = tq_tiled_layout(hd, n_hi, bh, bl, s.cb[0].data(), s.cb[1].data());
  s.ok = true;
  return s;
}

// The bits of a TurboQuant codec from its name ("tq3.5t", "tq4", "tq2.5_s": 3.5, 4, 2.5), 0 for others.
inline double tq_name_bits(const std::string& n) {
  if (n.rfind("tq", 0) != 0 || n.size() < 3 || !(n[2] >= '0' && n[2] <= '9')) return 0;
  return std::strtod(n.c_str() + 2, nullptr);
}

// A codec that stores TurboQuant's tiles: a tiled codec, a format codec where the tiles fit, and
// their centered / scaled wrappers (which keep the inner codec's prepared query), told apart from
// the record codecs by the prepared row's length. *shape receives the layout.
inline bool tqt_codec(const KvCodec& c, TqtShape* shape = nullptr) {
  const double bits = tq_name_bits(c.info().name);
  if (bits < 2) return false;
  TqtShape s = tqt_shape(bits, c.head_dim());
  if (!s.ok || c.prepared_query_dim() != s.L.qdim) return false;
  if (shape) *shape = s;
  return true;
}

inline double tqt_norm(const TqtShape& s, const uint8_t* block, int t) {
  return tile_f16(block + size_t(t / 16) * s.L.tile_bytes, size_t(t % 16));
}
inline int tqt_code(const TqtShape& s, KvRole role, const uint8_t* block, int t, int d) {
  return tq_tiled_code(s.L, role, block + size_t(t / 16) * s.L.tile_bytes, t % 16, d);
}

// |score - ||x|| <rq, c>| for rotated query rq (hd) against key slot t: half a query step times |c|,
// the codebook image's half step cs / 2 times |rq| + dq / 2, plus f32 rounding (1e-5 relative of
// the magnitudes).
inline double tqt_score_bound(const TqtShape& s, const float* rq, const uint8_t* block, int t) {
  const int hd = s.L.hd;
  const double norm = tqt_norm(s, block, t);
  double quant = 0, mag = 0;
  for (int b = 0; b < hd / 32; ++b) {
    double amax = 0;
    for (int j = 32 * b; j < 32 * b + 32; ++j) amax = std::max(amax, double(std::fabs(rq[j])));
    const double dq = amax / 127;
    for (int j = 32 * b; j < 32 * b + 32; ++j) {
      const double c = std::fabs(s.c(j, tqt_code(s, KvRole::key, block, t, j))), aq = std::fabs(rq[j]);
      quant += dq / 2 * (1 + std::ldexp(1.0, -21)) * c + (aq + dq / 2) * s.cs(j) / 2;
      mag += aq * (c + s.cs(j));
    }
  }
  return norm * (quant + 1e-5 * mag) + 1e-30;
}

// Per rotated channel, in model units (times cs), the weighted sum's error over tokens [t0, t0 + n)
// with weights p[t - t0] >= 0: half a u8 weight step per tile times the image's |C|, the image's
// half step per unit of weight, plus f32 rounding (1e-5 relative).
inline std::vector<double> tqt_value_bound(const TqtShape& s, const uint8_t* block, int t0, int n, const double* p) {
  const int hd = s.L.hd;
  std::vector<double> e(size_t(hd), 0.0);
  for (int tile = t0 / 16; tile < (t0 + n + 15) / 16; ++tile) {
    const int ta = std::max(t0, tile * 16), tb = std::min(t0 + n, tile * 16 + 16);
    double wmax = 0;
    for (int t = ta; t < tb; ++t) wmax = std::max(wmax, std::fabs(p[t - t0] * tqt_norm(s, block, t)));
    for (int d = 0; d < hd; ++d) {
      const int8_t* lut = s.L.seg[s.L.block_seg[d / 32]].lut8;
      double csum = 0, wsum = 0;
      for (int t = ta; t < tb; ++t) {
        const double c = std::abs(int(lut[tqt_code(s, KvRole::value, block, t, d)]));
        csum += c;
        wsum += std::fabs(p[t - t0] * tqt_norm(s, block, t)) * (0.5 + 1e-5 * c);
      }
      e[size_t(d)] += (wmax / kv_int4t_u8_levels * 0.5 * int4t_weight_step_slack(kv_int4t_u8_levels) * csum + wsum) * s.cs(d);
    }
  }
  return e;
}

}  // namespace kvq::test
