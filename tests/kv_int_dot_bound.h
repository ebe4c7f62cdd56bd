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

}  // namespace kvq::test
