// int8t and q8_0t (kv/int8_tiled.h), each test over both: decode bit-identical to int8 / q8_0,
// bytes equal to theirs, the AVX2 and
// AVX-512 kernels against the scalar reference (scores bit-identical, weighted sums up to f32 order), and
// the reference against exact dots of the decoded values within the derived bounds; random and
// adversarial inputs, partial tiles, n_q 1..9, head_dim 64/128/256, every CPU level.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "core/cpu.h"
#include "core/dtypes.h"
#include "core/error.h"
#include "kv/int4_tiled.h"
#include "kv/int8_tiled.h"
#include "kv/kv_rows.h"
#include "kvq/kv_format.h"
#include "tiled_test_queries.h"

using namespace kvq;

namespace {

using test::make;
using test::make_rows;
using test::Pat;
using test::kPats;
using test::make_queries;

const int kHds[] = {64, 128, 256};

// What differs between int8t and q8_0t: names, the row format whose quantization the tiles hold,
// the layout and the bits per element.
struct Kind {
  const char* tiled;
  const char* rows;
  KvElem elem;
  Int8TiledLayout (*layout)(int hd);
  double bits(int hd) const { return elem == KvElem::q8_0 ? 8.5 : 8 + 32.0 / hd; }
};
const Kind kKinds[] = {{"int8t", "int8_rows", KvElem::int8, int8t_layout},
                       {"q8_0t", "q8_0", KvElem::q8_0, q8_0t_layout}};

// int8 / q8_0 rows of the same tokens: scale and code of every element.
struct Rows {
  KvRowFmt f;
  std::vector<uint8_t> rows;
  void sc(int t, int d, double* s, int* c) const {
    const uint8_t* r = rows.data() + size_t(t) * f.row_bytes;
    if (f.elem == KvElem::q8_0) {
      kv_block_q8_0 blk;
      std::memcpy(&blk, r + sizeof(blk) * size_t(d / 32), sizeof blk);
      *s = f16_to_f32(blk.d);
      *c = blk.qs[d % 32];
      return;
    }
    float sf;
    std::memcpy(&sf, r, 4);
    *s = sf;
    *c = int8_t(r[4 + d]);
  }
};
Rows int8_rows(const Kind& k, const std::vector<float>& x, int n, int hd) {
  Rows r;
  r.f = kv_row_fmt(k.elem, hd);
  r.rows.resize(size_t(n) * r.f.row_bytes);
  for (int t = 0; t < n; ++t) kv_row_encode(r.f, 1.f, x.data() + size_t(t) * hd, r.rows.data() + size_t(t) * r.f.row_bytes);
  return r;
}

bool have_avx2() {
#if defined(KVQ_HAVE_SIMD)
  const CpuFeatures& cf = cpu_features();
  return cf.avx2 && cf.fma;
#else
  return false;
#endif
}
bool have_avx512() {
#if defined(KVQ_HAVE_SIMD)
  const CpuFeatures& cf = cpu_features();
  return cf.avx512f && cf.avx512bw && cf.avx512vnni;
#else
  return false;
#endif
}

const int kRanges[][2] = {{0, 64}, {7, 50}, {16, 16}, {3, 9}, {0, 1}, {63, 1}, {17, 30}};

}  // namespace

TEST(Int8Tiled, BytesAndBitsEqualInt8) {
  for (const Kind& k : kKinds) {
  SCOPED_TRACE(k.tiled);
  for (int hd : kHds)
    for (KvRole role : {KvRole::key, KvRole::value}) {
      auto t = make(k.tiled, hd, role);
      auto g = make(k.rows, hd, role);
      for (int bt : {16, 32, 64, 128, 256}) {
        EXPECT_EQ(t->block_bytes(bt), g->block_bytes(bt)) << hd << " " << bt;
        EXPECT_DOUBLE_EQ(kv_codec_effective_bits(*t, bt, 4096), kv_codec_effective_bits(*g, bt, 4096));
      }
      EXPECT_DOUBLE_EQ(kv_codec_effective_bits(*t, 64, 4096), k.bits(hd));
    }
  EXPECT_EQ(kv_format_find(k.tiled).v_codec, k.tiled);
  }
}

// Codec "int8" (format "int8", the K half of k8v4 / k8v2, the inner codec of int8_c) stores
// int8t's tiles where they apply and the rows elsewhere: same bytes, same decode either way.
TEST(Int8Tiled, Int8CodecIsTheTilesWhereTheyApply) {
  std::mt19937 rng(11);
  for (int hd : {8, 64, 80, 128, 256})
    for (KvRole role : {KvRole::key, KvRole::value}) {
      SCOPED_TRACE(hd);
      auto c = make("int8", hd, role);
      auto r = make("int8_rows", hd, role);
      EXPECT_EQ(c->info().name, hd % 32 == 0 ? "int8t" : "int8");
      const int bt = 32;
      EXPECT_EQ(c->block_bytes(bt), r->block_bytes(bt));
      auto x = make_rows(Pat::random, bt, hd, rng);
      std::vector<uint8_t> bc(c->block_bytes(bt)), br(r->block_bytes(bt));
      c->encode(0, x.data(), size_t(hd), bt, bc.data(), bt, 0, 0);
      r->encode(0, x.data(), size_t(hd), bt, br.data(), bt, 0, 0);
      std::vector<float> yc(size_t(bt) * size_t(hd)), yr(yc.size());
      c->decode(0, bc.data(), bt, 0, bt, 0, yc.data());
      r->decode(0, br.data(), bt, 0, bt, 0, yr.data());
      EXPECT_EQ(std::memcmp(yc.data(), yr.data(), yc.size() * sizeof(float)), 0);
    }
  EXPECT_EQ(kv_format_find("int8").k_codec, "int8");
  EXPECT_EQ(kv_format_find("int8_rows").v_codec, "int8_rows");
}

TEST(Int8Tiled, RejectsBadShapes) {
  for (const Kind& k : kKinds) {
  SCOPED_TRACE(k.tiled);
  EXPECT_THROW(make(k.tiled, 80, KvRole::key), Error);
  auto c = make(k.tiled, 128, KvRole::key);
  try {
    c->block_bytes(8);
    FAIL() << "block of 8 tokens accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("multiple of 16"), std::string::npos) << e.what();
  }
  }
}

TEST(Int8Tiled, DecodeMatchesInt8BitForBit) {
  for (const Kind& k : kKinds) {
  SCOPED_TRACE(k.tiled);
  std::mt19937 rng(3);
  for (int hd : kHds)
    for (KvRole role : {KvRole::key, KvRole::value})
      for (Pat pat : kPats) {
        const int bt = 64;
        auto t = make(k.tiled, hd, role);
        auto g = make(k.rows, hd, role);
        auto x = make_rows(pat, bt, hd, rng);
        std::vector<uint8_t> bt_blk(t->block_bytes(bt), 0xFF), bg_blk(g->block_bytes(bt));
        t->encode(1, x.data(), size_t(hd), 5, bt_blk.data(), bt, 0, 0);
        t->encode(1, x.data() + 5 * size_t(hd), size_t(hd), 36, bt_blk.data(), bt, 5, 0);
        t->encode(1, x.data() + 41 * size_t(hd), size_t(hd), 23, bt_blk.data(), bt, 41, 0);
        g->encode(1, x.data(), size_t(hd), bt, bg_blk.data(), bt, 0, 0);
        std::vector<float> dt(size_t(bt) * size_t(hd)), dg(dt.size());
        t->decode(1, bt_blk.data(), bt, 0, bt, 0, dt.data());
        g->decode(1, bg_blk.data(), bt, 0, bt, 0, dg.data());
        ASSERT_EQ(std::memcmp(dt.data(), dg.data(), sizeof(float) * dt.size()), 0)
            << hd << " role " << int(role) << " pattern " << int(pat);
        std::vector<float> part(size_t(13) * size_t(hd));
        t->decode(1, bt_blk.data(), bt, 19, 13, 0, part.data());
        ASSERT_EQ(std::memcmp(part.data(), dg.data() + 19 * size_t(hd), sizeof(float) * part.size()), 0);
      }
  }
}

// Scores: AVX-512 bit-identical to the reference; the reference within the query-rounding bound
// of exact <q, decode(k)>.
TEST(Int8Tiled, ScoresParityAndBound) {
  for (const Kind& k : kKinds) {
  SCOPED_TRACE(k.tiled);
  std::mt19937 rng(5);
  for (int hd : kHds)
    for (Pat pat : kPats) {
      const int bt = 64;
      auto c = make(k.tiled, hd, KvRole::key);
      auto x = make_rows(pat, bt, hd, rng);
      std::vector<uint8_t> blk(c->block_bytes(bt));
      c->encode(0, x.data(), size_t(hd), bt, blk.data(), bt, 0, 0);
      const Rows r = int8_rows(k, x, bt, hd);
      std::vector<float> dec(size_t(bt) * size_t(hd));
      c->decode(0, blk.data(), bt, 0, bt, 0, dec.data());
      const Int8TiledLayout L = k.layout(hd);
      for (int nq = 1; nq <= 9; ++nq) {
        auto q = make_queries(nq + int(pat), nq, hd, rng);
        ASSERT_EQ(c->prepared_query_dim(), L.qdim);
        std::vector<float> qp(size_t(nq) * size_t(L.qdim));
        c->prepare_query(0, q.data(), nq, qp.data());
        for (const auto& rg : kRanges) {
          const int t0 = rg[0], n = rg[1], os = n + 3;
          std::vector<float> ref(size_t(nq) * size_t(os), -7.f);
          int8t_scores_ref(L, qp.data(), nq, blk.data(), t0, n, ref.data(), os);
          for (int i = 0; i < nq; ++i) {
            for (int t = n; t < os; ++t) ASSERT_EQ(ref[size_t(i) * size_t(os) + size_t(t)], -7.f) << "wrote past n";
            const float* qi = q.data() + size_t(i) * size_t(hd);
            for (int t = 0; t < n; ++t) {
              double exact = 0, quant = 0, mag = 0;
              for (int b = 0; b < hd / 32; ++b) {
                double amax = 0;
                for (int j = 32 * b; j < 32 * b + 32; ++j) amax = std::max(amax, double(std::fabs(qi[j])));
                for (int j = 32 * b; j < 32 * b + 32; ++j) {
                  double s;
                  int code;
                  r.sc(t0 + t, j, &s, &code);
                  const double xv = dec[size_t(t0 + t) * size_t(hd) + size_t(j)];
                  ASSERT_EQ(xv, double(float(code) * float(s)));  // int8 decode, f32 product
                  exact += double(qi[j]) * xv;
                  quant += (amax / 127 / 508 * (1 + std::ldexp(1.0, -20)) + std::ldexp(std::fabs(qi[j]), -22)) * std::fabs(xv);
                  mag += std::fabs(qi[j]) * std::fabs(xv);
                }
              }
              ASSERT_NEAR(ref[size_t(i) * size_t(os) + size_t(t)], exact, quant + 1e-5 * mag + 1e-30)
                  << hd << " pattern " << int(pat) << " nq " << nq << " t0 " << t0 << " n " << n;
            }
          }
#if defined(KVQ_HAVE_SIMD)
          for (int v = 0; v < 2; ++v) {
            if (!(v ? have_avx512() : have_avx2())) continue;
            std::vector<float> out(size_t(nq) * size_t(os), -7.f);
            (v ? int8t_scores_avx512 : int8t_scores_avx2)(L, qp.data(), nq, blk.data(), t0, n, out.data(), os);
            ASSERT_EQ(std::memcmp(out.data(), ref.data(), sizeof(float) * out.size()), 0)
                << (v ? "avx512" : "avx2") << " hd " << hd << " pattern " << int(pat) << " nq " << nq << " t0 " << t0 << " n " << n;
          }
#endif
        }
      }
    }
  }
}

// A non-finite query block gives a NaN score, never a silently finite one.
TEST(Int8Tiled, NonFiniteQueryIsNaN) {
  for (const Kind& k : kKinds) {
  SCOPED_TRACE(k.tiled);
  const int hd = 64, bt = 16;
  auto c = make(k.tiled, hd, KvRole::key);
  std::vector<float> x(size_t(bt) * hd, 0.5f), q(hd, 1.f);
  q[40] = std::numeric_limits<float>::infinity();
  std::vector<uint8_t> blk(c->block_bytes(bt));
  c->encode(0, x.data(), size_t(hd), bt, blk.data(), bt, 0, 0);
  std::vector<float> qp(size_t(c->prepared_query_dim())), s(bt);
  c->prepare_query(0, q.data(), 1, qp.data());
  c->scores(0, qp.data(), 1, blk.data(), bt, 0, bt, 0, s.data(), bt);
  for (float v : s) EXPECT_TRUE(std::isnan(v)) << v;
  }
}

namespace {

// Bound of one query row's weighted sum over [t0, t0 + n) against the exact sum of the decoded
// values (kv/int8_tiled.h): per tile half a weight step times sum |c|, plus f32 rounding.
std::vector<double> accum_bound(const Rows& r, const float* p, int t0, int n, double acc0, float levels) {
  const int hd = r.f.head_dim;
  std::vector<double> b(size_t(hd), 1e-5 * acc0 + 1e-30);
  for (int tile = t0 / 16; tile < (t0 + n + 15) / 16; ++tile)
    for (int d = 0; d < hd; ++d) {
      // The weights' step: over the tile's tokens with the scale of d (int8t: the token's;
      // q8_0t: the token's for d's 32-channel block).
      float wmax = 0;
      for (int t = std::max(t0, tile * 16); t < std::min(t0 + n, tile * 16 + 16); ++t) {
        double s;
        int c;
        r.sc(t, d, &s, &c);
        wmax = std::max(wmax, std::fabs(p[t - t0] * float(s)));
      }
      float dw, inv;
      int4t_weight_step(wmax, levels, &dw, &inv);
      for (int t = std::max(t0, tile * 16); t < std::min(t0 + n, tile * 16 + 16); ++t) {
        double s;
        int c;
        r.sc(t, d, &s, &c);
        b[size_t(d)] += double(dw) * 0.5 * int4t_weight_step_slack(levels) * std::abs(c) +
                        1e-5 * std::fabs(p[t - t0]) * std::fabs(s * c);
      }
    }
  return b;
}

}  // namespace

TEST(Int8Tiled, AccumulateParityAndBound) {
  for (const Kind& k : kKinds) {
  SCOPED_TRACE(k.tiled);
  std::mt19937 rng(9);
  std::normal_distribution<float> nd;
  for (int hd : kHds)
    for (Pat pat : kPats) {
      const int bt = 64;
      auto c = make(k.tiled, hd, KvRole::value);
      auto x = make_rows(pat, bt, hd, rng);
      // Slots never written hold NaN bytes (0xFF): the kernels must not read them into results.
      std::vector<uint8_t> blk(c->block_bytes(bt), 0xFF);
      c->encode(0, x.data(), size_t(hd), bt, blk.data(), bt, 0, 0);
      const Rows r = int8_rows(k, x, bt, hd);
      std::vector<float> dec(size_t(bt) * size_t(hd));
      c->decode(0, blk.data(), bt, 0, bt, 0, dec.data());
      const Int8TiledLayout L = k.layout(hd);
      for (int nq = 1; nq <= 9; ++nq)
        for (int ri = 0; ri < int(std::size(kRanges)); ++ri) {
          const int t0 = kRanges[ri][0], n = kRanges[ri][1], ps = n + 5;
          // probabilities-like weights, and for every other (nq, range) signed weights in one row:
          // the s8 path.
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
          const float levels = sgn ? kv_int4t_s8_levels : kv_int4t_u8_levels;
          std::vector<float> ref(size_t(nq) * size_t(hd), 0.25f);
          int8t_accum_ref(L, p.data(), ps, nq, blk.data(), t0, n, ref.data());
          for (int i = 0; i < nq; ++i) {
            const float* pi = p.data() + size_t(i) * size_t(ps);
            const auto bound = accum_bound(r, pi, t0, n, 0.25, levels);
            for (int d = 0; d < hd; ++d) {
              double exact = 0.25;
              for (int t = 0; t < n; ++t) exact += double(pi[t]) * dec[size_t(t0 + t) * size_t(hd) + size_t(d)];
              ASSERT_NEAR(ref[size_t(i) * size_t(hd) + size_t(d)], exact, bound[size_t(d)])
                  << hd << " pattern " << int(pat) << " nq " << nq << " t0 " << t0 << " n " << n;
            }
          }
#if defined(KVQ_HAVE_SIMD)
          for (int v = 0; v < 2; ++v) {
            if (!(v ? have_avx512() : have_avx2())) continue;
            std::vector<float> out(size_t(nq) * size_t(hd), 0.25f);
            (v ? int8t_accum_avx512 : int8t_accum_avx2)(L, p.data(), ps, nq, blk.data(), t0, n, out.data());
            for (int i = 0; i < nq; ++i)
              for (int d = 0; d < hd; ++d) {
                double mag = 0.25;  // same quantized weights and integer dots: f32 order only
                for (int t = 0; t < n; ++t)
                  mag += std::fabs(double(p[size_t(i) * size_t(ps) + size_t(t)])) *
                         std::fabs(dec[size_t(t0 + t) * size_t(hd) + size_t(d)]) * 2;
                ASSERT_NEAR(out[size_t(i) * size_t(hd) + size_t(d)], ref[size_t(i) * size_t(hd) + size_t(d)],
                            1e-5 * mag + 1e-30)
                    << (v ? "avx512" : "avx2") << " hd " << hd << " pattern " << int(pat) << " nq " << nq << " t0 " << t0
                    << " n " << n;
              }
          }
#endif
        }
    }
  }
}

// Through the codec API at every CPU level, as attention calls it.
TEST(Int8Tiled, CodecApiEveryLevel) {
  for (const Kind& k : kKinds) {
    SCOPED_TRACE(k.tiled);
    // f32 summation order only: relative to sum_t |p_t| 2 |x_t|.
    test::codec_api_every_level(k.tiled, 1, [](const std::vector<float>& dec, const std::vector<float>& p, int i,
                                               int d) {
      double mag = 0;
      for (int t = 0; t < test::kApiN; ++t)
        mag += std::fabs(p[size_t(i) * test::kApiN + size_t(t)]) * 2 *
               std::fabs(dec[size_t(test::kApiT0 + t) * test::kApiHd + size_t(d)]);
      return mag;
    });
  }
}

TEST(Int8Tiled, PrefetchRangeInsideBlock) {
  for (const Kind& k : kKinds) {
  SCOPED_TRACE(k.tiled);
  auto c = make(k.tiled, 128, KvRole::key);
  const Int8TiledLayout L = k.layout(128);
  const KvCodec::PrefetchRange r = c->prefetch_range(64, 17, 30);
  EXPECT_EQ(r.offset, L.tile_bytes);
  EXPECT_GT(r.bytes, 0u);
  EXPECT_LE(r.offset + r.bytes, c->block_bytes(64));
  }
}
