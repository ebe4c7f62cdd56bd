// Error bound of the integer-dot score kernels (kv_rows.h) against the float-query reference,
// derived from their arithmetic, for tests.
//
// A 4-bit (or int2g) row decodes as x_j = s * c_j + m (q4_0: s = d, m = -8 d; int4g / int2g: the
// group's scale and minimum). The kernels compute <q, x> as sum_j qhat_j * s * c_j + sum_j q_j * m, where qhat_j =
// dq_b * round(q_j / dq_b) with dq_b = absmax(q over block b) / 127, so the only approximation is
// |qhat_j - q_j| <= dq_b / 2 (plus a relative 2^-22 of dq_b for the f32 product q_j * (1 / dq_b)
// before rounding), multiplying |s * c_j|. On top come f32 rounding differences between the two
// summations: bounded by a relative 1e-5 (> 64 ulp) of the sum of the magnitudes of every product
// either side adds up (|q_j| |s c_j|, |q_j| |m|, |q_j x_j|, and the query error term itself).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/dtypes.h"
#include "kv/kv_rows.h"

namespace kvq::test {

// q: (head_dim) the query the kernel quantizes; row: one stored row of format f.
inline double int_dot_bound(const KvRowFmt& f, const float* q, const uint8_t* row) {
  const int hd = f.head_dim;
  double quant = 0, mag = 0;
  for (int b = 0; b < hd / 32; ++b) {
    double amax = 0;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, double(std::fabs(q[32 * b + j])));
    const double half_step = amax / 127 * (0.5 + std::ldexp(1.0, -22));
    for (int j = 32 * b; j < 32 * b + 32; ++j) {
      double s, m;
      int c;
      if (f.elem == KvElem::q4_0) {
        kv_block_q4_0 blk;
        std::memcpy(&blk, row + size_t(b) * sizeof blk, sizeof blk);
        s = f16_to_f32(blk.d);
        m = -8 * s;
        c = (blk.qs[j % 16] >> ((j % 32) / 16 * 4)) & 15;
      } else {
        KvGroupParams p;
        std::memcpy(&p, row + sizeof(KvGroupParams) * size_t(j / f.group), sizeof p);
        s = f16_to_f32(p.scale);
        m = f16_to_f32(p.min);
        const uint8_t* codes = row + sizeof(KvGroupParams) * size_t(hd / f.group);
        if (f.elem == KvElem::int2g) c = (codes[(j / 32) * kv_unit_int2_bytes + j % 8] >> ((j % 32) / 8 * 2)) & 3;
        else c = (codes[(j / 32) * kv_unit_int4_bytes + j % 16] >> ((j % 32) / 16 * 4)) & 15;
      }
      const double sc = std::fabs(s * c), aq = std::fabs(double(q[j]));
      quant += half_step * sc;
      mag += aq * (sc + std::fabs(m) + std::fabs(s * c + m)) + half_step * sc;
    }
  }
  return quant + 1e-5 * mag + 1e-30;
}

// Integer weighted sum of the int4g / int2g rows on AVX-512 (kv_rows_i8_avx512.cpp, accum_i16;
// head_dim % 64 == 0, groups of 32 / 64 / 128): per query row, group and run of 32 tokens the
// kernel rounds w_t = p_t * s_t to int16 steps dw = max_t |w_t| / 32767; the integer dot of the
// codes is exact, so channel c of query row i moves by at most sum_runs dw * 0.51 * sum_t c_t
// (half a step, plus 4 * 2^-24 * 32767 < 0.008 steps for the f32 products p s, w / dw and dw),
// plus f32 rounding differences: relative 1e-5 of sum_t |p_t| (|s c_t| + |m| + |x_t|).
// p: (n_q, p_stride); rows: n rows row_stride apart; returns (n_q, head_dim) per-element bounds.
inline bool kv_int_accum_active(const KvRowFmt& f) {
  if (f.head_dim % 64 != 0) return false;  // q4_0 keeps the float kernel
  return (f.elem == KvElem::int4g || f.elem == KvElem::int2g) && (f.group == 32 || f.group == 64 || f.group == 128);
}
inline constexpr int kv_int_accum_run = 32;  // kRun of the kernel
// Scale s, minimum m and code of channel j of a row.
inline void kv_row_scm(const KvRowFmt& f, const uint8_t* row, int j, double* s, double* m, int* c) {
  // llama.cpp's 4- / 5-bit blocks (kv_rows.h): f16 d, f16 m (q4_1 / q5_1), the fifth bits (q5_*:
  // bit i of qh), the nibbles (element i low, 16 + i high). x = s c + m with m = -8 s (q4_0),
  // -16 s (q5_0); iq4_nl's "code" is the grid value (signed), m 0.
  const KvElem e = f.elem;
  if (e == KvElem::q4_0 || e == KvElem::q4_1 || e == KvElem::q5_0 || e == KvElem::q5_1 || e == KvElem::iq4_nl) {
    const bool has_m = e == KvElem::q4_1 || e == KvElem::q5_1, five = e == KvElem::q5_0 || e == KvElem::q5_1;
    const uint8_t* blk = row + size_t(j / 32) * kv_row_bytes(e, 32, 0);
    f16_t d, mh;
    std::memcpy(&d, blk, 2);
    *s = f16_to_f32(d);
    if (has_m) std::memcpy(&mh, blk + 2, 2);
    const uint8_t* qs = blk + (has_m ? 4 : 2) + (five ? 4 : 0);
    uint32_t qh = 0;
    if (five) std::memcpy(&qh, qs - 4, 4);
    const int code = ((qs[j % 16] >> ((j % 32) / 16 * 4)) & 15) | int((qh >> (j % 32)) & 1) << 4;
    *c = e == KvElem::iq4_nl ? kv_iq4nl_grid[code] : code;
    *m = has_m ? double(f16_to_f32(mh)) : e == KvElem::q4_0 ? -8 * *s : e == KvElem::q5_0 ? -16 * *s : 0.0;
    return;
  }
  KvGroupParams p;
  std::memcpy(&p, row + sizeof(KvGroupParams) * size_t(j / f.group), sizeof p);
  *s = f16_to_f32(p.scale);
  *m = f16_to_f32(p.min);
  const uint8_t* codes = row + sizeof(KvGroupParams) * size_t(f.head_dim / f.group);
  if (f.elem == KvElem::int2g) *c = (codes[(j / 32) * kv_unit_int2_bytes + j % 8] >> ((j % 32) / 8 * 2)) & 3;
  else *c = (codes[(j / 32) * kv_unit_int4_bytes + j % 16] >> ((j % 32) / 16 * 4)) & 15;
}
inline std::vector<double> kv_int_accum_bound(const KvRowFmt& f, const float* p, int p_stride, int n_q,
                                              const uint8_t* rows, size_t row_stride, int n) {
  const int hd = f.head_dim;
  std::vector<double> b(size_t(n_q) * size_t(hd), 1e-30);
  for (int i = 0; i < n_q; ++i)
    for (int j = 0; j < hd; ++j) {
      double quant = 0, mag = 0;
      for (int r0 = 0; r0 < n; r0 += kv_int_accum_run) {
        const int r1 = std::min(n, r0 + kv_int_accum_run);
        double wmax = 0, csum = 0;
        for (int t = r0; t < r1; ++t) {
          double s, m;
          int c;
          const double pt = p[size_t(i) * size_t(p_stride) + size_t(t)];
          // wmax over the group of channel j: every channel of the group shares s
          kv_row_scm(f, rows + size_t(t) * row_stride, j, &s, &m, &c);
          wmax = std::max(wmax, std::fabs(pt * s));
          csum += std::abs(c);
          mag += std::fabs(pt) * (std::fabs(s * c) + std::fabs(m) + std::fabs(s * c + m));
        }
        quant += wmax / 32767 * 0.51 * csum;
      }
      b[size_t(i) * size_t(hd) + size_t(j)] += quant + 1e-5 * mag;
    }
  return b;
}
// Inside decode attention p <= 1 and s * c_max <= the token's group range <= 2 max|v|, so an
// output (acc / l, l >= 1) moves by at most
// n_tokens * 2 max|v| * 0.51 / 32767 (* 1.001 for the f16 rounding of the scale); v_max: the
// largest |decoded value| of the rows the kernel reads.
inline double kv_int_accum_attn_bound(int n_tokens, double v_max) {
  return double(n_tokens) * 2 * v_max * 0.51 / 32767 * 1.001;
}

}  // namespace kvq::test
