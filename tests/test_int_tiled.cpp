// int4t_g* and int2t_g* (kv/int4_tiled.h, kv/int2_tiled.h) and llama.cpp's types in int4t's
// tiles (q4_0t, q4_1t, q5_0t, q5_1t, iq4_nlt), each test over every width: decode bit-identical to
// the rows whose quantization the tiles hold, bytes equal to theirs, SIMD kernels against the
// scalar reference (scores bit-identical, weighted sums up to f32 order), and the reference against
// exact dots of the decoded values within the derived bounds (the same for every width: codes
// 0..15, 0..31, 0..3 or iq4_nl's grid values); random and adversarial inputs, partial tiles,
// several n_q / head_dim / group sizes, every CPU level.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstring>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "core/cpu.h"
#include "core/error.h"
#include "kv/int2_tiled.h"
#include "kv/int4_tiled.h"
#include "kv/kv_rows.h"
#include "kv/tiles_ref.h"
#include "kvq/kv_format.h"
#include "tiled_test_queries.h"
#include "kv_int_dot_bound.h"

using namespace kvq;

namespace {

using test::make;
using test::make_rows;
using test::Pat;
using test::kPats;
using test::make_queries;

struct Shape {
  int hd, group;
};
// 96 / 32: a head that is not a multiple of 64 (int2t's K blocks of 16 dims, V chunks of 32).
const Shape kShapes[] = {{64, 32}, {64, 64}, {96, 32}, {128, 32}, {128, 64}, {128, 128}, {256, 64}, {256, 128}};

// What differs between the widths: names, the row format whose quantization the tiles hold, the
// layout and the kernels.
struct Width {
  int bits;
  std::string tiled, rows;  // codec name stems: "int4t_g", "int4_g"
  KvElem elem;
  Int4TiledLayout (*layout)(int hd, int group);
  Int4tScoresFn scores_ref;
  Int4tAccumFn accum_ref;
#if defined(KVQ_HAVE_SIMD)
  Int4tScoresFn scores_avx2, scores_avx512;
  Int4tAccumFn accum_avx2, accum_avx512;
#endif
  bool fixed32 = false;  // q4_0t: one layout (q4_0's blocks of 32), names without a group
  std::string codec(int group) const { return fixed32 ? tiled : tiled + std::to_string(group); }
  std::string row_codec(int group) const { return fixed32 ? rows : rows + std::to_string(group); }
  bool has(int group) const { return !fixed32 || group == 32; }
  double eff_bits(int group) const {
    return fixed32 ? double(kv_row_bytes(elem, 32, 0)) * 8 / 32 : bits + 32.0 / group;
  }
};
const Width kWidths[] = {
    {4, "int4t_g", "int4_g", KvElem::int4g, int4t_layout, int4t_scores_ref, int4t_accum_ref,
#if defined(KVQ_HAVE_SIMD)
     int4t_scores_avx2, int4t_scores_avx512, int4t_accum_avx2, int4t_accum_avx512,
#endif
    },
    {2, "int2t_g", "int2_g", KvElem::int2g, int2t_layout, int2t_scores_ref, int2t_accum_ref,
#if defined(KVQ_HAVE_SIMD)
     int2t_scores_avx2, int2t_scores_avx512, int2t_accum_avx2, int2t_accum_avx512,
#endif
    },
    // q4_0 in int4t's tiles: no min table (m = -8 d), signed scales (the s8 weight path).
    {4, "q4_0t", "q4_0", KvElem::q4_0, [](int hd, int) { return q4_0t_layout(hd); }, int4t_scores_ref,
     int4t_accum_ref,
#if defined(KVQ_HAVE_SIMD)
     int4t_scores_avx2, int4t_scores_avx512, int4t_accum_avx2, int4t_accum_avx512,
#endif
     true},
    // q4_1 in int4t_g32's tiles: scale and minimum per 32, q4_1's quantizer.
    {4, "q4_1t", "q4_1", KvElem::q4_1, [](int hd, int) { return int4t_layout(hd, 32); }, int4t_scores_ref,
     int4t_accum_ref,
#if defined(KVQ_HAVE_SIMD)
     int4t_scores_avx2, int4t_scores_avx512, int4t_accum_avx2, int4t_accum_avx512,
#endif
     true},
    // q5_0 / q5_1: 5-bit codes (fifth bits beside the nibbles); q5_0 as q4_0t (m = -16 d, signed
    // scales), q5_1 as q4_1t.
    {5, "q5_0t", "q5_0", KvElem::q5_0, [](int hd, int) { return q5t_layout(hd, false); }, int4t_scores_ref,
     int4t_accum_ref,
#if defined(KVQ_HAVE_SIMD)
     int4t_scores_avx2, int4t_scores_avx512, int4t_accum_avx2, int4t_accum_avx512,
#endif
     true},
    {5, "q5_1t", "q5_1", KvElem::q5_1, [](int hd, int) { return q5t_layout(hd, true); }, int4t_scores_ref,
     int4t_accum_ref,
#if defined(KVQ_HAVE_SIMD)
     int4t_scores_avx2, int4t_scores_avx512, int4t_accum_avx2, int4t_accum_avx512,
#endif
     true},
    // iq4_nl: q4_0t's tables, codes standing for the grid's int8 values (no min term).
    {4, "iq4_nlt", "iq4_nl", KvElem::iq4_nl, [](int hd, int) { return iq4nlt_layout(hd); }, int4t_scores_ref,
     int4t_accum_ref,
#if defined(KVQ_HAVE_SIMD)
     int4t_scores_avx2, int4t_scores_avx512, int4t_accum_avx2, int4t_accum_avx512,
#endif
     true},
};

// The int4_gN / int2_gN rows of the same tokens: scale, minimum and code of every element (the
// tiled codec's quantization is theirs, which DecodeMatchesTheRowsBitForBit checks).
struct Rows {
  KvRowFmt f;
  std::vector<uint8_t> rows;
  void scm(int t, int d, double* s, double* m, int* c) const {
    test::kv_row_scm(f, rows.data() + size_t(t) * f.row_bytes, d, s, m, c);
  }
};
Rows grouped_rows(const Width& w, const std::vector<float>& x, int n, int hd, int group) {
  Rows r;
  r.f = kv_row_fmt(w.elem, hd, group);
  r.rows.resize(size_t(n) * r.f.row_bytes);
  for (int t = 0; t < n; ++t)
    kv_row_encode(r.f, 1.f, x.data() + size_t(t) * hd, r.rows.data() + size_t(t) * r.f.row_bytes);
  return r;
}

}  // namespace

TEST(IntTiled, BytesAndBitsEqualTheRows) {
  for (const Width& w : kWidths) {
    SCOPED_TRACE(w.tiled);
    for (const Shape& s : kShapes) {
      if (!w.has(s.group)) continue;
      for (KvRole role : {KvRole::key, KvRole::value}) {
        auto t = make(w.codec(s.group), s.hd, role);
        auto g = make(w.row_codec(s.group), s.hd, role);
        for (int bt : {16, 32, 64, 128, 256}) {
          EXPECT_EQ(t->block_bytes(bt), g->block_bytes(bt)) << s.hd << " " << s.group << " " << bt;
          EXPECT_DOUBLE_EQ(kv_codec_effective_bits(*t, bt, 4096), kv_codec_effective_bits(*g, bt, 4096));
        }
        EXPECT_DOUBLE_EQ(kv_codec_effective_bits(*t, 64, 4096), w.eff_bits(s.group));
      }
    }
    EXPECT_EQ(kv_format_find(w.codec(64)).k_codec, w.codec(64));
  }
  EXPECT_EQ(kv_format_find("INT4T_G128").v_codec, "int4t_g128");
  EXPECT_EQ(kv_format_find("INT2T_G128").v_codec, "int2t_g128");
}

TEST(IntTiled, RejectsBadShapes) {
  for (const Width& w : kWidths) {
    SCOPED_TRACE(w.tiled);
    if (!w.fixed32) {
      EXPECT_THROW(make(w.codec(128), 96, KvRole::key), Error);
    }
    EXPECT_THROW(make(w.codec(32), 80, KvRole::value), Error);
    EXPECT_THROW(make(w.codec(32), 2 * kv_max_head_dim, KvRole::key), Error);
    auto c = make(w.codec(64), 128, KvRole::key);
    try {
      c->block_bytes(8);
      FAIL() << "block of 8 tokens accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("multiple of 16"), std::string::npos) << e.what();
    }
  }
}

// Decode equals int4_gN's / int2_gN's decode bit for bit, whatever the range encoded (partial tiles, tokens
// written one at a time or in runs).
TEST(IntTiled, DecodeMatchesTheRowsBitForBit) {
  for (const Width& w : kWidths) {
    SCOPED_TRACE(w.tiled);
    std::mt19937 rng(3);
    for (const Shape& s : kShapes)
      for (KvRole role : {KvRole::key, KvRole::value})
        for (Pat pat : kPats) {
          if (!w.has(s.group)) continue;
          const int bt = 64;
          auto t = make(w.codec(s.group), s.hd, role);
          auto g = make(w.row_codec(s.group), s.hd, role);
          auto x = make_rows(pat, bt, s.hd, rng);
          std::vector<uint8_t> bt_blk(t->block_bytes(bt), 0xFF), bg_blk(g->block_bytes(bt));
          // tokens 0..4 one by one, 5..40 as one run, 41..63 as one run
          t->encode(1, x.data(), size_t(s.hd), 5, bt_blk.data(), bt, 0, 0);
          t->encode(1, x.data() + 5 * size_t(s.hd), size_t(s.hd), 36, bt_blk.data(), bt, 5, 0);
          t->encode(1, x.data() + 41 * size_t(s.hd), size_t(s.hd), 23, bt_blk.data(), bt, 41, 0);
          g->encode(1, x.data(), size_t(s.hd), bt, bg_blk.data(), bt, 0, 0);
          std::vector<float> dt(size_t(bt) * size_t(s.hd)), dg(dt.size());
          t->decode(1, bt_blk.data(), bt, 0, bt, 0, dt.data());
          g->decode(1, bg_blk.data(), bt, 0, bt, 0, dg.data());
          ASSERT_EQ(std::memcmp(dt.data(), dg.data(), sizeof(float) * dt.size()), 0)
              << s.hd << " g" << s.group << " role " << int(role) << " pattern " << int(pat);
          std::vector<float> part(size_t(13) * size_t(s.hd));
          t->decode(1, bt_blk.data(), bt, 19, 13, 0, part.data());
          ASSERT_EQ(std::memcmp(part.data(), dg.data() + 19 * size_t(s.hd), sizeof(float) * part.size()), 0);
        }
  }
}

// An int2t V tile's code byte holds crumbs of 8 tokens (int4t's: nibbles of one token): rewriting
// some tokens (unaligned, inside one octet and across tiles) leaves the others' codes alone, in
// both roles.
TEST(IntTiled, RewriteKeepsOtherTokens) {
  for (const Width& w : kWidths) {
    SCOPED_TRACE(w.tiled);
    std::mt19937 rng(21);
    for (KvRole role : {KvRole::key, KvRole::value}) {
      const int bt = 64, hd = 128;
      auto t = make(w.codec(32), hd, role);
      auto g = make(w.row_codec(32), hd, role);
      auto x = make_rows(Pat::random, bt, hd, rng);
      auto y = make_rows(Pat::outlier_channel, bt, hd, rng);
      std::vector<uint8_t> tb(t->block_bytes(bt), 0xFF), gb(g->block_bytes(bt));
      t->encode(0, x.data(), size_t(hd), bt, tb.data(), bt, 0, 0);
      g->encode(0, x.data(), size_t(hd), bt, gb.data(), bt, 0, 0);
      for (auto [t0, n] : {std::pair{5, 2}, std::pair{13, 9}, std::pair{40, 1}}) {
        t->encode(0, y.data() + size_t(t0) * size_t(hd), size_t(hd), n, tb.data(), bt, t0, 0);
        g->encode(0, y.data() + size_t(t0) * size_t(hd), size_t(hd), n, gb.data(), bt, t0, 0);
      }
      std::vector<float> dt(size_t(bt) * size_t(hd)), dg(dt.size());
      t->decode(0, tb.data(), bt, 0, bt, 0, dt.data());
      g->decode(0, gb.data(), bt, 0, bt, 0, dg.data());
      ASSERT_EQ(std::memcmp(dt.data(), dg.data(), sizeof(float) * dt.size()), 0) << "role " << int(role);
    }
  }
}

namespace {

// Ranges (t0, n) inside a 64-token block: whole block, unaligned starts and ends, inside one tile,
// one token.
const int kRanges[][2] = {{0, 64}, {7, 50}, {16, 16}, {3, 9}, {0, 1}, {63, 1}, {17, 30}};

}  // namespace

// Scores: AVX2 and AVX-512 bit-identical to the reference (same integer dots, same f32 FMA
// sequence per lane); the reference within the query-rounding bound of exact <q, decode(k)>.
TEST(IntTiled, ScoresParityAndBound) {
  for (const Width& w : kWidths) {
    SCOPED_TRACE(w.tiled);
    std::mt19937 rng(5);
    [[maybe_unused]] const CpuFeatures& cf = cpu_features();  // SIMD builds only
    for (const Shape& s : kShapes)
      for (Pat pat : kPats) {
        if (!w.has(s.group)) continue;
        const int bt = 64, hd = s.hd;
        auto c = make(w.codec(s.group), hd, KvRole::key);
        auto x = make_rows(pat, bt, hd, rng);
        std::vector<uint8_t> blk(c->block_bytes(bt));
        c->encode(0, x.data(), size_t(hd), bt, blk.data(), bt, 0, 0);
        const Rows r = grouped_rows(w, x, bt, hd, s.group);
        std::vector<float> dec(size_t(bt) * size_t(hd));
        c->decode(0, blk.data(), bt, 0, bt, 0, dec.data());
        const Int4TiledLayout L = w.layout(hd, s.group);
        for (int nq = 1; nq <= 9; ++nq) {
          auto q = make_queries(nq + int(pat), nq, hd, rng);
          std::vector<float> qp(size_t(nq) * size_t(c->prepared_query_dim()));
          ASSERT_EQ(c->prepared_query_dim(), L.qdim);
          c->prepare_query(0, q.data(), nq, qp.data());
          for (const auto& rg : kRanges) {
            const int t0 = rg[0], n = rg[1], os = n + 3;
            std::vector<float> ref(size_t(nq) * size_t(os), -7.f);
            w.scores_ref(L, qp.data(), nq, blk.data(), t0, n, ref.data(), os);
            for (int i = 0; i < nq; ++i) {
              for (int t = n; t < os; ++t) ASSERT_EQ(ref[size_t(i) * size_t(os) + size_t(t)], -7.f) << "wrote past n";
              const float* qi = q.data() + size_t(i) * size_t(hd);
              for (int t = 0; t < n; ++t) {
                double exact = 0, quant = 0, mag = 0;
                for (int b = 0; b < hd / 32; ++b) {
                  double amax = 0;
                  for (int j = 32 * b; j < 32 * b + 32; ++j) amax = std::max(amax, double(std::fabs(qi[j])));
                  for (int j = 32 * b; j < 32 * b + 32; ++j) {
                    double sc, m;
                    int code;
                    r.scm(t0 + t, j, &sc, &m, &code);
                    const double xv = dec[size_t(t0 + t) * size_t(hd) + size_t(j)];
                    exact += double(qi[j]) * xv;
                    quant += amax / 127 * 0.5 * (1 + std::ldexp(1.0, -21)) * std::fabs(sc * code);
                    mag += std::fabs(qi[j]) * (std::fabs(sc * code) + std::fabs(m) + std::fabs(xv));
                  }
                }
                ASSERT_NEAR(ref[size_t(i) * size_t(os) + size_t(t)], exact, quant + 1e-5 * mag + 1e-30)
                    << hd << " g" << s.group << " pattern " << int(pat) << " nq " << nq << " t0 " << t0 << " n " << n;
              }
            }
#if defined(KVQ_HAVE_SIMD)
            for (int v = 0; v < 2; ++v) {
              if (v == 0 && !(cf.avx2 && cf.fma && cf.f16c)) continue;
              if (v == 1 && !(cf.avx512f && cf.avx512bw && cf.avx512vnni)) continue;
              std::vector<float> out(size_t(nq) * size_t(os), -7.f);
              (v == 0 ? w.scores_avx2 : w.scores_avx512)(L, qp.data(), nq, blk.data(), t0, n, out.data(), os);
              ASSERT_EQ(std::memcmp(out.data(), ref.data(), sizeof(float) * out.size()), 0)
                  << (v ? "avx512" : "avx2") << " hd " << hd << " g" << s.group << " pattern " << int(pat) << " nq "
                  << nq << " t0 " << t0 << " n " << n;
            }
#endif
          }
        }
      }
  }
}

namespace {

// Bound of the weighted sum of query row i (p: n weights) over tokens [t0, t0 + n) against the
// exact sum of the decoded values (kv/int4_tiled.h, kv/int2_tiled.h): per tile and group, half a weight step times
// the codes, plus f32 rounding (relative 1e-5 of the magnitudes).
std::vector<double> accum_bound(const Rows& r, int group, const float* p, int t0, int n, double acc0, float levels) {
  const int hd = r.f.head_dim;
  std::vector<double> b(size_t(hd), 1e-5 * acc0 + 1e-30);  // acc0: the accumulator's start value
  for (int tile = t0 / 16; tile < (t0 + n + 15) / 16; ++tile)
    for (int g = 0; g < hd / group; ++g) {
      float wmax = 0;
      for (int j = 0; j < 16; ++j) {
        const int t = tile * 16 + j;
        if (t < t0 || t >= t0 + n) continue;
        double s, m;
        int c;
        r.scm(t, g * group, &s, &m, &c);
        wmax = std::max(wmax, std::fabs(p[t - t0] * float(s)));
      }
      float dw, inv;
      int4t_weight_step(wmax, levels, &dw, &inv);
      for (int d = g * group; d < (g + 1) * group; ++d)
        for (int j = 0; j < 16; ++j) {
          const int t = tile * 16 + j;
          if (t < t0 || t >= t0 + n) continue;
          double s, m;
          int c;
          r.scm(t, d, &s, &m, &c);
          const double ap = std::fabs(p[t - t0]);
          b[size_t(d)] += double(dw) * 0.5 * int4t_weight_step_slack(levels) * std::abs(c) +
                          1e-5 * ap * (std::fabs(s * c) + std::fabs(m) + std::fabs(s * c + m));
        }
    }
  return b;
}

}  // namespace

TEST(IntTiled, AccumulateParityAndBound) {
  for (const Width& w : kWidths) {
    SCOPED_TRACE(w.tiled);
    std::mt19937 rng(9);
    std::normal_distribution<float> nd;
    [[maybe_unused]] const CpuFeatures& cf = cpu_features();  // SIMD builds only
    for (const Shape& s : kShapes)
      for (Pat pat : kPats) {
        if (!w.has(s.group)) continue;
        const int bt = 64, hd = s.hd;
        auto c = make(w.codec(s.group), hd, KvRole::value);
        auto x = make_rows(pat, bt, hd, rng);
        // Slots never written hold NaN bytes (0xFF): the kernels must not read them into results.
        std::vector<uint8_t> blk(c->block_bytes(bt), 0xFF);
        c->encode(0, x.data(), size_t(hd), bt, blk.data(), bt, 0, 0);
        const Rows r = grouped_rows(w, x, bt, hd, s.group);
        std::vector<float> dec(size_t(bt) * size_t(hd));
        c->decode(0, blk.data(), bt, 0, bt, 0, dec.data());
        const Int4TiledLayout L = w.layout(hd, s.group);
        for (int nq = 1; nq <= 9; ++nq) {
          for (int ri = 0; ri < int(std::size(kRanges)); ++ri) {
            const int t0 = kRanges[ri][0], n = kRanges[ri][1], ps = n + 5;
            // probabilities-like weights (one dominant token per row), and for every other (nq,
            // range) signed weights in row 1 (row 0 when nq is 1): the s8 path. Both paths then
            // see every pass width (1..4 rows) of the SIMD kernels.
            const bool sgn = (nq + ri) % 2 == 0;
            const int srow = nq >= 2 ? 1 : 0;
            std::vector<float> p(size_t(nq) * size_t(ps), std::nanf(""));
            for (int i = 0; i < nq; ++i)
              for (int t = 0; t < n; ++t) {
                float v = std::exp(-std::fabs(nd(rng)) * 3.f);
                if (t == (i * 7) % n) v = 1.f;
                if (sgn && i == srow) v = t == 0 ? -0.5f : nd(rng);
                p[size_t(i) * size_t(ps) + size_t(t)] = v;
              }
            // q4_0t's scales may be negative: always the s8 path.
            const float levels = sgn || L.signed_scales ? kv_int4t_s8_levels : kv_int4t_u8_levels;
            ASSERT_EQ(int4t_weights_nonneg(p.data(), ps, nq, n), !sgn);
            std::vector<float> ref(size_t(nq) * size_t(hd), 0.25f);
            w.accum_ref(L, p.data(), ps, nq, blk.data(), t0, n, ref.data());
            std::vector<std::vector<double>> bounds;
            for (int i = 0; i < nq; ++i) {
              const float* pi = p.data() + size_t(i) * size_t(ps);
              bounds.push_back(accum_bound(r, s.group, pi, t0, n, 0.25, levels));
              for (int d = 0; d < hd; ++d) {
                double exact = 0.25;
                for (int t = 0; t < n; ++t) exact += double(pi[t]) * dec[size_t(t0 + t) * size_t(hd) + size_t(d)];
                ASSERT_NEAR(ref[size_t(i) * size_t(hd) + size_t(d)], exact, bounds.back()[size_t(d)])
                    << hd << " g" << s.group << " pattern " << int(pat) << " nq " << nq << " t0 " << t0 << " n " << n;
              }
            }
#if defined(KVQ_HAVE_SIMD)
            for (int v = 0; v < 2; ++v) {
              if (v == 0 && !(cf.avx2 && cf.fma && cf.f16c)) continue;
              if (v == 1 && !(cf.avx512f && cf.avx512bw && cf.avx512vnni)) continue;
              std::vector<float> out(size_t(nq) * size_t(hd), 0.25f);
              (v == 0 ? w.accum_avx2 : w.accum_avx512)(L, p.data(), ps, nq, blk.data(), t0, n, out.data());
              for (int i = 0; i < nq; ++i)
                for (int d = 0; d < hd; ++d) {
                  // Same quantized weights and integer dots as the reference: f32 order only,
                  // relative to the magnitudes summed (|p| (|s c| + |m| + |x|)).
                  double mag = 0.25;
                  for (int t = 0; t < n; ++t) {
                    double sm, m;
                    int cd;
                    r.scm(t0 + t, d, &sm, &m, &cd);
                    mag += std::fabs(double(p[size_t(i) * size_t(ps) + size_t(t)])) *
                           (std::fabs(sm * cd) + std::fabs(m) +
                            std::fabs(dec[size_t(t0 + t) * size_t(hd) + size_t(d)]));
                  }
                  ASSERT_NEAR(out[size_t(i) * size_t(hd) + size_t(d)], ref[size_t(i) * size_t(hd) + size_t(d)],
                              1e-5 * mag + 1e-30)
                      << (v ? "avx512" : "avx2") << " hd " << hd << " g" << s.group << " pattern " << int(pat)
                      << " nq " << nq << " t0 " << t0 << " n " << n;
                }
            }
#endif
          }
        }
      }
  }
}

// The widest head the layout allows (kv_max_head_dim, 32 groups of 32: the SIMD kernels' per-group
// tables at their bound) and a wide group: SIMD against the reference, both weight paths, a pass
// of 4 rows and one of 1.
TEST(IntTiled, WideHeadParity) {
#if defined(KVQ_HAVE_SIMD)
  for (const Width& w : kWidths) {
    SCOPED_TRACE(w.tiled);
    std::mt19937 rng(17);
    std::normal_distribution<float> nd;
    const CpuFeatures& cf = cpu_features();
    const int hd = kv_max_head_dim, bt = 64, nq = 5;
    for (int group : {32, 128}) {
      if (!w.has(group)) continue;
      const Int4TiledLayout L = w.layout(hd, group);
      auto kc = make(w.codec(group), hd, KvRole::key);
      auto vc = make(w.codec(group), hd, KvRole::value);
      auto x = make_rows(Pat::outlier_channel, bt, hd, rng);
      std::vector<uint8_t> kb(kc->block_bytes(bt), 0xFF), vb(vc->block_bytes(bt), 0xFF);
      kc->encode(0, x.data(), size_t(hd), bt, kb.data(), bt, 0, 0);
      vc->encode(0, x.data(), size_t(hd), bt, vb.data(), bt, 0, 0);
      auto q = make_queries(1, nq, hd, rng);
      std::vector<float> qp(size_t(nq) * size_t(L.qdim));
      int4t_prepare_query(L, q.data(), nq, qp.data());
      for (const auto& rg : {std::array<int, 2>{0, 64}, std::array<int, 2>{7, 50}})
        for (bool sgn : {false, true}) {
          const int t0 = rg[0], n = rg[1];
          std::vector<float> p(size_t(nq) * size_t(n));
          for (size_t e = 0; e < p.size(); ++e) p[e] = std::exp(-std::fabs(nd(rng)) * 3.f);
          if (sgn) p[size_t(n) + 3] = -0.75f;  // row 1: the s8 path
          std::vector<float> sref(size_t(nq) * size_t(n)), aref(size_t(nq) * size_t(hd), 0.5f);
          w.scores_ref(L, qp.data(), nq, kb.data(), t0, n, sref.data(), n);
          w.accum_ref(L, p.data(), n, nq, vb.data(), t0, n, aref.data());
          for (int v = 0; v < 2; ++v) {
            if (v == 0 && !(cf.avx2 && cf.fma && cf.f16c)) continue;
            if (v == 1 && !(cf.avx512f && cf.avx512bw && cf.avx512vnni)) continue;
            std::vector<float> s(sref.size()), a(aref.size(), 0.5f);
            (v == 0 ? w.scores_avx2 : w.scores_avx512)(L, qp.data(), nq, kb.data(), t0, n, s.data(), n);
            (v == 0 ? w.accum_avx2 : w.accum_avx512)(L, p.data(), n, nq, vb.data(), t0, n, a.data());
            ASSERT_EQ(std::memcmp(s.data(), sref.data(), sizeof(float) * s.size()), 0)
                << (v ? "avx512" : "avx2") << " g" << group << " t0 " << t0;
            for (int i = 0; i < nq; ++i)
              for (int d = 0; d < hd; ++d) {
                // f32 order only: relative to sum_t |p_t| * (the token's largest |value| in d's group) * 5
                double mag = 0.5;
                for (int t = 0; t < n; ++t) {
                  double vmax = 0;
                  for (int e = d / group * group; e < (d / group + 1) * group; ++e)
                    vmax = std::max(vmax, double(std::fabs(x[size_t(t0 + t) * size_t(hd) + size_t(e)])));
                  mag += std::fabs(p[size_t(i) * size_t(n) + size_t(t)]) * 5 * vmax;
                }
                ASSERT_NEAR(a[size_t(i) * size_t(hd) + size_t(d)], aref[size_t(i) * size_t(hd) + size_t(d)], 1e-5 * mag)
                    << (v ? "avx512" : "avx2") << " g" << group << " t0 " << t0 << " sgn " << sgn << " row " << i
                    << " d " << d;
              }
          }
        }
    }
  }
#else
  GTEST_SKIP() << "built without SIMD kernels";
#endif
}

// A 256-token block: ranges over several of the SIMD weighted sums' segments of tiles (and a
// partial tile at both ends), SIMD against the reference, both weight paths.
TEST(IntTiled, LongRangeParity) {
#if defined(KVQ_HAVE_SIMD)
  for (const Width& w : kWidths) {
    SCOPED_TRACE(w.tiled);
    std::mt19937 rng(19);
    std::normal_distribution<float> nd;
    const CpuFeatures& cf = cpu_features();
    const int hd = 128, bt = 256, nq = 5, group = 32;
    const Int4TiledLayout L = w.layout(hd, group);
    auto kc = make(w.codec(32), hd, KvRole::key);
    auto vc = make(w.codec(32), hd, KvRole::value);
    auto x = make_rows(Pat::mixed_scale, bt, hd, rng);
    std::vector<uint8_t> kb(kc->block_bytes(bt), 0xFF), vb(vc->block_bytes(bt), 0xFF);
    kc->encode(0, x.data(), size_t(hd), bt, kb.data(), bt, 0, 0);
    vc->encode(0, x.data(), size_t(hd), bt, vb.data(), bt, 0, 0);
    const Rows r = grouped_rows(w, x, bt, hd, group);
    auto q = make_queries(0, nq, hd, rng);
    std::vector<float> qp(size_t(nq) * size_t(L.qdim));
    int4t_prepare_query(L, q.data(), nq, qp.data());
    for (const auto& rg : {std::array<int, 2>{0, 256}, std::array<int, 2>{9, 230}, std::array<int, 2>{70, 100}})
      for (bool sgn : {false, true}) {
        const int t0 = rg[0], n = rg[1];
        std::vector<float> p(size_t(nq) * size_t(n));
        for (size_t e = 0; e < p.size(); ++e) p[e] = std::exp(-std::fabs(nd(rng)) * 3.f);
        if (sgn) p[size_t(2 * n) + 5] = -0.5f;  // row 2: the s8 path
        std::vector<float> sref(size_t(nq) * size_t(n)), aref(size_t(nq) * size_t(hd), 0.f);
        w.scores_ref(L, qp.data(), nq, kb.data(), t0, n, sref.data(), n);
        w.accum_ref(L, p.data(), n, nq, vb.data(), t0, n, aref.data());
        for (int v = 0; v < 2; ++v) {
          if (v == 0 && !(cf.avx2 && cf.fma && cf.f16c)) continue;
          if (v == 1 && !(cf.avx512f && cf.avx512bw && cf.avx512vnni)) continue;
          std::vector<float> s(sref.size()), a(aref.size(), 0.f);
          (v == 0 ? w.scores_avx2 : w.scores_avx512)(L, qp.data(), nq, kb.data(), t0, n, s.data(), n);
          (v == 0 ? w.accum_avx2 : w.accum_avx512)(L, p.data(), n, nq, vb.data(), t0, n, a.data());
          ASSERT_EQ(std::memcmp(s.data(), sref.data(), sizeof(float) * s.size()), 0)
              << (v ? "avx512" : "avx2") << " t0 " << t0;
          for (int i = 0; i < nq; ++i)
            for (int d = 0; d < hd; ++d) {
              double mag = 0;  // f32 order only: relative to the magnitudes summed
              for (int t = 0; t < n; ++t) {
                double sc, m;
                int c;
                r.scm(t0 + t, d, &sc, &m, &c);
                mag += std::fabs(double(p[size_t(i) * size_t(n) + size_t(t)])) *
                       (std::fabs(sc * c) + 2 * std::fabs(m));
              }
              ASSERT_NEAR(a[size_t(i) * size_t(hd) + size_t(d)], aref[size_t(i) * size_t(hd) + size_t(d)],
                          1e-5 * mag + 1e-30)
                  << (v ? "avx512" : "avx2") << " t0 " << t0 << " sgn " << sgn << " row " << i << " d " << d;
            }
        }
      }
  }
#else
  GTEST_SKIP() << "built without SIMD kernels";
#endif
}

// Through the codec API at every CPU level, as attention calls it.
TEST(IntTiled, CodecApiEveryLevel) {
  for (const Width& w : kWidths) {
    SCOPED_TRACE(w.tiled);
    // f32 summation order only (same quantized weights): relative to sum_t |p_t| |x_t| with x
    // bounded by the group's range (outlier channels make the min term cancel).
    test::codec_api_every_level(w.codec(64), 0, [](const std::vector<float>& dec, const std::vector<float>& p, int i,
                                                   int d) {
      double mag = 0;
      for (int t = 0; t < test::kApiN; ++t) {
        double vmax = 0;  // the largest |value| of the token's group: bounds |s c| and |m|
        for (int e = d / 64 * 64; e < d / 64 * 64 + 64; ++e)
          vmax = std::max(vmax, double(std::fabs(dec[size_t(test::kApiT0 + t) * test::kApiHd + size_t(e)])));
        mag += std::fabs(p[size_t(i) * test::kApiN + size_t(t)]) * 5 * vmax;
      }
      return mag;
    });
  }
}

// The prefetch hint covers the first tile of the range, stays inside the block and within the
// lead attention requests.
TEST(IntTiled, PrefetchRangeInsideBlock) {
  for (const Width& w : kWidths) {
    SCOPED_TRACE(w.tiled);
    for (KvRole role : {KvRole::key, KvRole::value}) {
      auto c = make(w.codec(64), 128, role);
      const size_t tile = c->block_bytes(16);
      for (int bt : {16, 64, 256})
        for (int t0 = 0; t0 < bt; t0 += 7) {
          const auto r = c->prefetch_range(bt, t0, bt - t0);
          EXPECT_EQ(r.offset, size_t(t0 / 16) * tile);
          EXPECT_GT(r.bytes, 0u);
          EXPECT_LE(r.bytes, KvCodec::prefetch_lead_bytes);
          EXPECT_LE(r.offset + r.bytes, c->block_bytes(bt));
        }
      EXPECT_EQ(c->prefetch_range(64, 5, 0).bytes, 0u);
    }
  }
}

// int4t_g*h: the same tiles after a Hadamard rotation. Same bytes; on keys with an outlier channel
// the rotation spreads its energy, so the other channels keep their resolution (what q4_0h does
// for q4_0). Fused attention against the reference: test_attention (every registered format).
TEST(IntTiled, Int4RotatedVariants) {
  const int hd = 128, bt = 64;
  std::mt19937_64 rng(77);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> x(size_t(bt) * hd);
  for (int t = 0; t < bt; ++t)
    for (int d = 0; d < hd; ++d) x[size_t(t) * hd + d] = nd(rng) * (d == 5 ? 30.f : 1.f);
  for (const char* g : {"32", "64", "128"}) {
    KvCodecParams p;
    p.head_dim = hd;
    const std::string plain = std::string("int4t_g") + g;
    auto c0 = kv_codec_create(plain, p);
    auto c1 = kv_codec_create(plain + "h", p);
    EXPECT_EQ(c1->block_bytes(bt), c0->block_bytes(bt));
    EXPECT_TRUE(c1->info().transforms_query);
    auto err = [&](const KvCodec& c) {
      std::vector<uint8_t> blk(c.block_bytes(bt));
      std::vector<float> y(x.size());
      c.encode(0, x.data(), hd, bt, blk.data(), bt, 0, 0);
      c.decode(0, blk.data(), bt, 0, bt, 0, y.data());
      double e = 0;  // error on the ordinary channels
      for (int t = 0; t < bt; ++t)
        for (int d = 0; d < hd; ++d)
          if (d != 5) e += std::pow(double(y[size_t(t) * hd + d]) - x[size_t(t) * hd + d], 2);
      return e;
    };
    EXPECT_LT(err(*c1), 0.5 * err(*c0)) << plain;
  }
  KvCodecParams p;
  p.head_dim = 64;
  EXPECT_NO_THROW(kv_codec_create("int4t_g64h", p));
  p.head_dim = 48;  // no power-of-two block >= 32
  EXPECT_THROW(kv_codec_create("int4t_g32h", p), Error);
}

// The weight step on its own (int4t_weight_step, kv/int4_tiled.h): every weight within half a step
// (times the derived rounding slack) of w_t, inside [0, 255] / [-127, 127], on typical, peaked, tiny
// (underflowed probabilities, near-zero scales), huge and signed tiles; a tile whose largest weight
// is below the flush threshold gets zero weights (and so loses at most |w_t| < 2^-100).
TEST(IntTiled, WeightStepBound) {
  std::mt19937 rng(11);
  std::normal_distribution<float> nd;
  std::uniform_real_distribution<float> ud(0.f, 1.f);
  for (int trial = 0; trial < 4000; ++trial) {
    const int kind = trial % 8;
    const bool u8 = trial % 2 == 0;
    float w[16];
    for (int j = 0; j < 16; ++j) {
      float p = std::exp(-std::fabs(nd(rng)) * 4.f);                // softmax-like
      if (kind == 1) p = j == 5 ? 1.f : std::exp(-20.f - 10 * ud(rng));  // one token dominates
      if (kind == 2) p = std::ldexp(ud(rng), -135);                  // underflowed (subnormal) probabilities
      if (kind == 3 && j % 3 == 0) p = 0.f;                          // tokens outside the range
      float sc = 0.01f + ud(rng);
      if (kind == 4) sc = j == 0 ? 40.f : 0.01f * ud(rng);           // one outlier scale
      if (kind == 5) sc = std::ldexp(ud(rng), -110);                 // near-zero scales
      if (kind == 6) sc = std::ldexp(0.5f + ud(rng), 60);            // huge scales
      if (kind == 7 && j % 4 == 0) sc = 0.f;
      if (!u8) {
        if (rng() % 2) p = -p;
        if (rng() % 2) sc = -sc;
      }
      w[j] = p * sc;
    }
    int32_t wq[16];
    const float dw = tile_quantize_weights_ref(w, u8, wq);
    const float levels = u8 ? kv_int4t_u8_levels : kv_int4t_s8_levels;
    const bool flushed = tile_abs_max(w) < kv_tile_wmin;
    for (int j = 0; j < 16; ++j) {
      SCOPED_TRACE(::testing::Message() << "trial " << trial << " kind " << kind << " u8 " << u8 << " token " << j);
      ASSERT_LE(wq[j], int(levels));
      ASSERT_GE(wq[j], u8 ? 0 : -int(levels));
      const double err = std::fabs(double(wq[j]) * double(dw) - double(w[j]));
      if (flushed) {
        ASSERT_EQ(wq[j], 0);
      } else {
        ASSERT_LE(err, double(dw) / 2 * int4t_weight_step_slack(levels) + 1e-300);
      }
    }
  }
}
