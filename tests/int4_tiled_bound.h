// Error bounds of the tiled int4 kernels (kv/int4_tiled.h) read off a head block, for tests:
// scores (int8 query rounding) and, inside decode attention, the weighted sum (int8 weights per
// (query row, group, tile)).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "core/dtypes.h"
#include "kv/int4_tiled.h"
#include "kv/kv_rows.h"
#include "kvq/kv_format.h"

namespace kvq::test {

// int4t_gN, and llama.cpp's types in the same tiles: q4_0t, q4_1t, q5_0t, q5_1t, iq4_nlt
// (kv/int4_tiled.h). q4_0h rotates q4_0t (q4_1h .. iq4_nlh theirs); q4_0h_c / _s / _cs center and / or scale that.
inline bool int4t_codec(const KvCodec& c) {
  const std::string& n = c.info().name;
  for (const char* t : {"q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl"})
    if (n == std::string(t) + "t" || n.rfind(std::string(t) + "h", 0) == 0) return true;
  return n.rfind("int4t_g", 0) == 0;
}
inline Int4TiledLayout int4t_layout_of(const KvCodec& c) {
  if (c.info().name.rfind("q4_0", 0) == 0) return q4_0t_layout(c.head_dim());
  if (c.info().name.rfind("q4_1", 0) == 0) return int4t_layout(c.head_dim(), 32);  // q4_1t
  if (c.info().name.rfind("q5_0", 0) == 0) return q5t_layout(c.head_dim(), false);
  if (c.info().name.rfind("q5_1", 0) == 0) return q5t_layout(c.head_dim(), true);
  if (c.info().name.rfind("iq4_nl", 0) == 0) return iq4nlt_layout(c.head_dim());
  return int4t_layout(c.head_dim(), std::stoi(c.info().name.substr(7)));
}

// The code readers of a tiled layout (int4t's nibbles, int2t's crumbs): code of dim d of token
// slot j within a tile's code bytes.
using TileCodeFn = int (*)(const uint8_t* codes, int j, int d);
struct TileCodes {
  TileCodeFn key, value;
};
inline constexpr TileCodes kInt4tCodes{int4t_key_code, int4t_value_code};
inline constexpr TileCodes kInt5tCodes{int5t_key_code, int5t_value_code};  // q5_0t / q5_1t
// iq4_nlt: the grid value a code stands for (x = s * grid[c]; min 0).
inline int iq4nlt_key_value(const uint8_t* codes, int j, int d) { return kv_iq4nl_grid[int4t_key_code(codes, j, d)]; }
inline int iq4nlt_value_value(const uint8_t* codes, int j, int d) {
  return kv_iq4nl_grid[int4t_value_code(codes, j, d)];
}
inline constexpr TileCodes kIq4nltCodes{iq4nlt_key_value, iq4nlt_value_value};
inline const TileCodes& int4t_codes_of(const Int4TiledLayout& L) {
  return L.lut ? kIq4nltCodes : L.code_bits == 5 ? kInt5tCodes : kInt4tCodes;
}

// Scale, minimum and code of element d of token t (block slot) in a key or value tile block.
inline void tile_scm(const Int4TiledLayout& L, const TileCodes& tc, KvRole role, const uint8_t* block, int t, int d,
                     double* s, double* m, int* c) {
  const int j = t % 16, g = d / L.group;
  const uint8_t* tp = block + size_t(t / 16) * L.tile_bytes;
  f16_t hs, hm;
  std::memcpy(&hs, tp + 2 * size_t(g * 16 + j), 2);
  std::memcpy(&hm, tp + L.min_off + 2 * size_t(g * 16 + j), 2);
  *s = f16_to_f32(hs);
  *m = double(L.min_mul) * f16_to_f32(hm);  // q4_0t: its scale table read as the min table, times -8
  const uint8_t* codes = tp + L.code_off;
  *c = role == KvRole::key ? tc.key(codes, j, d) : tc.value(codes, j, d);
}
inline void int4t_scm(const Int4TiledLayout& L, KvRole role, const uint8_t* block, int t, int d, double* s, double* m,
                      int* c) {
  tile_scm(L, int4t_codes_of(L), role, block, t, d, s, m, c);
}

// |score - <q, decode(k_t)>| bound of the integer-dot scores: half a query step (per 32-dim block,
// + 2^-22 relative for the f32 product before rounding) times |s c|, plus f32 rounding (relative
// 1e-5 of the magnitudes summed). q: (head_dim) the plain query.
inline double tile_score_bound(const Int4TiledLayout& L, const TileCodes& tc, const float* q, const uint8_t* block,
                               int t) {
  double quant = 0, mag = 0;
  for (int b = 0; b < L.hd / 32; ++b) {
    double amax = 0;
    for (int j = 32 * b; j < 32 * b + 32; ++j) amax = std::max(amax, double(std::fabs(q[j])));
    for (int j = 32 * b; j < 32 * b + 32; ++j) {
      double s, m;
      int c;
      tile_scm(L, tc, KvRole::key, block, t, j, &s, &m, &c);
      const double sc = std::fabs(s * c), aq = std::fabs(double(q[j]));
      quant += amax / 127 * 0.5 * (1 + std::ldexp(1.0, -21)) * sc;
      mag += aq * (sc + std::fabs(m) + std::fabs(s * c + m));
    }
  }
  return quant + 1e-5 * mag + 1e-30;
}
inline double int4t_score_bound(const Int4TiledLayout& L, const float* q, const uint8_t* block, int t) {
  return tile_score_bound(L, int4t_codes_of(L), q, block, t);
}

// Inside decode attention: the weighted sum of the tokens [t0, t0 + n) of a value block, one
// call, moves output channel d (acc / l) by at most sum over its tiles of half a weight step,
// dw / l = max_t |pi_t s_t| / levels (255: u8 weights for probabilities >= 0; 127, s8, for
// q4_0t's signed scales), times sum_t c_t[d] (and the step's rounding slack, within the final
// 1.001); pi: the probabilities of those tokens (normalized
// over the whole attention), pi_scale: how far the kernel's probabilities may exceed them
// (e^(2 Delta) for a score error Delta). Returns the largest channel bound.
inline double tile_value_bound(const Int4TiledLayout& L, const TileCodes& tc, const uint8_t* block, int t0, int n,
                               const double* pi, double pi_scale) {
  double worst = 0;
  for (int d = 0; d < L.hd; ++d) {
    double e = 0;
    for (int tile = t0 / 16; tile < (t0 + n + 15) / 16; ++tile) {
      double wmax = 0, csum = 0;
      for (int t = std::max(t0, tile * 16); t < std::min(t0 + n, tile * 16 + 16); ++t) {
        double s, m;
        int c;
        tile_scm(L, tc, KvRole::value, block, t, d, &s, &m, &c);
        wmax = std::max(wmax, std::fabs(pi[t - t0] * s));
        csum += std::abs(c);  // iq4_nlt: a signed grid value
      }
      e += wmax / (L.signed_scales ? kv_int4t_s8_levels : kv_int4t_u8_levels) * 0.5 * csum;
    }
    worst = std::max(worst, e);
  }
  return worst * pi_scale * 1.001;
}
inline double int4t_value_bound(const Int4TiledLayout& L, const uint8_t* block, int t0, int n, const double* pi,
                                double pi_scale) {
  return tile_value_bound(L, int4t_codes_of(L), block, t0, n, pi, pi_scale);
}

}  // namespace kvq::test
