// TurboQuant's tiles (kv/tq_tiled.h), every rate: bytes per token and decode equal the record
// codec's bit for bit; the SIMD kernels equal the scalar reference (scores bit-identical, weighted
// sums up to f32 order); the reference stays within the derived bounds of exact dots with the
// decoded rotated vectors; random and adversarial inputs, partial tiles, several n_q and head sizes.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/cpu.h"
#include "core/error.h"
#include "kv/tq_tiled.h"
#include "kvq/kv_format.h"
#include "tiled_test_queries.h"
#include "tq_tiled_bound.h"

using namespace kvq;
using test::make;
using test::make_queries;
using test::make_rows;
using test::Pat;

namespace {

// 96: not a power of two (the dense rotation).
const int kDims[] = {64, 96, 128, 256};
struct Kind {
  const char* tiled;
  const char* rows;
  double bits;
};
const Kind kKinds[] = {{"tq4t", "tq4_rows", 4},     {"tq3.5t", "tq3.5_rows", 3.5}, {"tq3t", "tq3_rows", 3},
                       {"tq2.5t", "tq2.5_rows", 2.5}, {"tq2.25t", "tq2.25_rows", 2.25}, {"tq2t", "tq2_rows", 2}};
const int kRanges[][2] = {{0, 64}, {7, 50}, {16, 16}, {3, 9}, {0, 1}, {63, 1}, {17, 30}};
const Pat kPats[] = {Pat::random, Pat::outlier_channel, Pat::constant_rows, Pat::zeros,
                     Pat::huge,   Pat::tiny,            Pat::mixed_scale};

// The tiled tests' rows; Pat::huge at 1e3 instead of 1e4: the norm of a 1e4-sized vector overflows
// TurboQuant's fp16 norm (the records' as well), 1e3 keeps it below 65504 up to head_dim 256.
std::vector<float> rows(Pat pat, int n, int hd, std::mt19937& rng) {
  auto x = make_rows(pat, n, hd, rng);
  if (pat == Pat::huge)
    for (float& v : x) v *= 0.1f;
  return x;
}

// Block of 64 tokens of pattern `pat`, encoded by `c`.
std::vector<uint8_t> encoded(const KvCodec& c, Pat pat, int hd, std::mt19937& rng) {
  auto x = rows(pat, 64, hd, rng);
  std::vector<uint8_t> blk(c.block_bytes(64), 0xFF);
  c.encode(0, x.data(), size_t(hd), 64, blk.data(), 64, 0, 0);
  return blk;
}

}  // namespace

TEST(TqTiled, BytesBitsAndDecodeEqualTheRecords) {
  std::mt19937 rng(1);
  int fitted = 0;
  for (const Kind& k : kKinds)
    for (int hd : kDims) {
      const test::TqtShape s = test::tqt_shape(k.bits, hd);
      if (!s.ok) {  // the split is not whole 32-channel blocks (2.25 at 64, 3.5 at 96, ...)
        EXPECT_THROW(make(k.tiled, hd, KvRole::key), Error) << k.tiled << " " << hd;
        continue;
      }
      ++fitted;
      for (KvRole role : {KvRole::key, KvRole::value}) {
        SCOPED_TRACE(std::string(k.tiled) + " hd " + std::to_string(hd) + " role " + std::to_string(int(role)));
        auto t = make(k.tiled, hd, role);
        auto r = make(k.rows, hd, role);
        for (int bt : {16, 32, 64, 256}) {
          EXPECT_EQ(t->block_bytes(bt), r->block_bytes(bt)) << bt;
          EXPECT_DOUBLE_EQ(kv_codec_effective_bits(*t, bt, 4096), kv_codec_effective_bits(*r, bt, 4096));
        }
        // The split's own rate (the nominal one where whole 16-channel steps allow it: tq2.25 at 96 is 2.33).
        double code_bits = 0;
        for (int g = 0; g < s.L.nseg; ++g) code_bits += double(s.L.seg[g].nch * s.L.seg[g].bits) / hd;
        EXPECT_NEAR(kv_codec_effective_bits(*t, 64, 4096), code_bits + 16.0 / hd, 1e-12);
        if (hd == 128) {
          EXPECT_DOUBLE_EQ(code_bits, k.bits);
        }
        EXPECT_TRUE(t->info().transforms_query && t->info().transforms_output);
        for (Pat pat : kPats) {
          const int bt = 64;
          auto x = rows(pat, bt, hd, rng);
          std::vector<uint8_t> tb(t->block_bytes(bt), 0xFF), rb(r->block_bytes(bt));
          // tokens 0..4 one by one, 5..40 and 41..63 as runs; then tokens 9..12 and 30 rewritten
          // (3-bit and 2-bit value bytes hold several tokens' codes)
          for (int i = 0; i < 5; ++i) t->encode(1, x.data() + size_t(i) * size_t(hd), size_t(hd), 1, tb.data(), bt, i, 0);
          t->encode(1, x.data() + 5 * size_t(hd), size_t(hd), 36, tb.data(), bt, 5, 0);
          t->encode(1, x.data() + 41 * size_t(hd), size_t(hd), 23, tb.data(), bt, 41, 0);
          auto y = make_rows(Pat::outlier_channel, bt, hd, rng);
          for (auto [t0, n] : {std::pair{9, 4}, std::pair{30, 1}}) {
            std::copy(y.begin() + std::ptrdiff_t(t0) * hd, y.begin() + std::ptrdiff_t(t0 + n) * hd,
                      x.begin() + std::ptrdiff_t(t0) * hd);
            t->encode(1, x.data() + size_t(t0) * size_t(hd), size_t(hd), n, tb.data(), bt, t0, 0);
          }
          r->encode(1, x.data(), size_t(hd), bt, rb.data(), bt, 0, 0);
          std::vector<float> dt(size_t(bt) * size_t(hd)), dr(dt.size());
          t->decode(1, tb.data(), bt, 0, bt, 0, dt.data());
          r->decode(1, rb.data(), bt, 0, bt, 0, dr.data());
          ASSERT_EQ(std::memcmp(dt.data(), dr.data(), sizeof(float) * dt.size()), 0) << "pattern " << int(pat);
          std::vector<float> part(size_t(13) * size_t(hd));
          t->decode(1, tb.data(), bt, 19, 13, 0, part.data());
          ASSERT_EQ(std::memcmp(part.data(), dr.data() + 19 * size_t(hd), sizeof(float) * part.size()), 0);
        }
      }
    }
  EXPECT_GE(fitted, 20);
  // The formats store the tiles where they fit, the records elsewhere and under *_rows.
  KvCodecParams p;
  p.head_dim = 128;
  EXPECT_EQ(kv_codec_create(kv_format_find("tq3.5").k_codec, p)->info().name, "tq3.5t");
  EXPECT_EQ(kv_codec_create(kv_format_find("TQ2.5_ROWS").v_codec, p)->info().name, "tq2.5_rows");
  p.head_dim = 80;
  EXPECT_EQ(kv_codec_create("tq4", p)->info().name, "tq4");
  // The channel-scaled wrapper of a tiled format keeps the tiles (the inner codec's prepared rows).
  p.head_dim = 128;
  p.n_kv_heads = 1;
  const std::vector<std::vector<float>> ones(1, std::vector<float>(128, 1.f));
  const nlohmann::json calib = {{"layers", {{{"k_rms", ones}, {"q_rms", ones}, {"v_rms", ones}}}}};
  p.calib = &calib;
  for (KvRole role : {KvRole::key, KvRole::value}) {
    p.role = role;
    EXPECT_TRUE(test::tqt_codec(*kv_codec_create(kv_format_find("tq4_s").v_codec, p))) << int(role);
  }
}

// The int8 image of each segment's codebook: cs = max|c| / 127, every centroid within half a step
// of its image (what the kernels' bounds assume), the extremes at +-127, the order kept.
TEST(TqTiled, CodebookImage) {
  for (const Kind& k : kKinds)
    for (int hd : kDims) {
      const test::TqtShape s = test::tqt_shape(k.bits, hd);
      if (!s.ok) continue;
      for (int g = 0; g < s.L.nseg; ++g) {
        const TqTileSeg& seg = s.L.seg[g];
        const std::vector<float>& cb = s.cb[g];
        const int nc = 1 << seg.bits;
        ASSERT_EQ(int(cb.size()), nc);
        EXPECT_FLOAT_EQ(seg.cs, std::max(std::fabs(cb.front()), std::fabs(cb.back())) / 127.f);
        EXPECT_EQ(int(seg.lut8[0]), -127);
        EXPECT_EQ(int(seg.lut8[nc - 1]), 127);
        for (int i = 0; i < nc; ++i) {
          EXPECT_LE(std::fabs(double(cb[size_t(i)]) - double(seg.cs) * seg.lut8[i]), 0.5 * seg.cs * (1 + 1e-6))
              << k.tiled << " " << hd << " " << i;
          if (i > 0) {
            EXPECT_LT(seg.lut8[i - 1], seg.lut8[i]);
          }
        }
      }
    }
}

TEST(TqTiled, RejectsBadShapes) {
  try {
    make("tq4t", 80, KvRole::key);
    FAIL() << "head_dim 80 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("multiple of 32"), std::string::npos) << e.what();
  }
  auto c = make("tq3.5t", 128, KvRole::value);
  try {
    c->block_bytes(8);
    FAIL() << "block of 8 tokens accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("multiple of 16"), std::string::npos) << e.what();
  }
}

// Scores: AVX2 and AVX-512 bit-identical to the reference; the reference within tqt_score_bound of
// ||x|| <R q, c> from the tile's own norm and centroids; the codec's scores are the kernel's.
TEST(TqTiled, ScoresParityAndBound) {
  std::mt19937 rng(5);
  [[maybe_unused]] const CpuFeatures& cf = cpu_features();
  for (const Kind& k : kKinds)
    for (int hd : kDims) {
      const test::TqtShape s = test::tqt_shape(k.bits, hd);
      if (!s.ok) continue;
      auto c = make(k.tiled, hd, KvRole::key);
      ASSERT_EQ(c->prepared_query_dim(), s.L.qdim);
      for (Pat pat : kPats) {
        const auto blk = encoded(*c, pat, hd, rng);
        for (int nq : {1, 2, 3, 4, 6}) {
          auto q = make_queries(nq + int(pat), nq, hd, rng);
          std::vector<float> qp(size_t(nq) * size_t(s.L.qdim));
          c->prepare_query(0, q.data(), nq, qp.data());
          for (const auto& rg : kRanges) {
            const int t0 = rg[0], n = rg[1], os = n + 3;
            std::vector<float> ref(size_t(nq) * size_t(os), -7.f), viac(ref.size(), -7.f);
            tq_tiled_scores_ref(s.L, qp.data(), nq, blk.data(), t0, n, ref.data(), os);
            c->scores(0, qp.data(), nq, blk.data(), 64, t0, n, 0, viac.data(), os);
            for (int i = 0; i < nq; ++i) {
              const float* rq = qp.data() + size_t(i) * size_t(s.L.qdim);  // the rotated query
              for (int t = n; t < os; ++t) ASSERT_EQ(ref[size_t(i) * size_t(os) + size_t(t)], -7.f) << "wrote past n";
              for (int t = 0; t < n; ++t) {
                const double norm = test::tqt_norm(s, blk.data(), t0 + t);
                double exact = 0;
                for (int d = 0; d < hd; ++d) exact += double(rq[d]) * norm * s.c(d, test::tqt_code(s, KvRole::key, blk.data(), t0 + t, d));
                const float got = ref[size_t(i) * size_t(os) + size_t(t)];
                ASSERT_NEAR(got, exact, test::tqt_score_bound(s, rq, blk.data(), t0 + t))
                    << k.tiled << " " << hd << " pattern " << int(pat) << " nq " << nq << " t0 " << t0 << " t " << t;
                // The codec dispatches to one of the variants, all bit-identical to the reference.
                ASSERT_EQ(viac[size_t(i) * size_t(os) + size_t(t)], got);
              }
            }
#if defined(KVQ_HAVE_SIMD)
            for (int v = 0; v < 2; ++v) {
              if (v == 0 && !(cf.avx2 && cf.fma && cf.f16c)) continue;
              if (v == 1 && !(cf.avx512f && cf.avx512bw && cf.avx512vnni)) continue;
              std::vector<float> out(size_t(nq) * size_t(os), -7.f);
              (v == 0 ? tq_tiled_scores_avx2 : tq_tiled_scores_avx512)(s.L, qp.data(), nq, blk.data(), t0, n,
                                                                       out.data(), os);
              ASSERT_EQ(std::memcmp(out.data(), ref.data(), sizeof(float) * out.size()), 0)
                  << (v ? "avx512 " : "avx2 ") << k.tiled << " hd " << hd << " pattern " << int(pat) << " nq " << nq
                  << " t0 " << t0;
            }
#endif
          }
        }
      }
    }
}

// Weighted sums: the SIMD variants equal the reference up to f32 order; the reference, times cs,
// within tqt_value_bound of sum_t p_t ||x_t|| c_t per rotated channel; weights with a negative
// entry take the f32 path in every variant.
TEST(TqTiled, AccumParityAndBound) {
  std::mt19937 rng(9);
  std::uniform_real_distribution<float> ud(0.f, 1.f);
  [[maybe_unused]] const CpuFeatures& cf = cpu_features();
  for (const Kind& k : kKinds)
    for (int hd : kDims) {
      const test::TqtShape s = test::tqt_shape(k.bits, hd);
      if (!s.ok) continue;
      auto c = make(k.tiled, hd, KvRole::value);
      for (Pat pat : kPats) {
        const auto blk = encoded(*c, pat, hd, rng);
        for (int nq : {1, 3, 4, 6})
          for (const auto& rg : kRanges)
            for (int wk = 0; wk < 3; ++wk) {  // probabilities, one dominant weight, weights with negatives
              const int t0 = rg[0], n = rg[1];
              std::vector<float> p(size_t(nq) * size_t(n));
              for (size_t q = 0; q < p.size(); ++q) {
                p[q] = wk == 1 ? (q % size_t(n) == size_t(n) / 2 ? 1.f : 1e-4f * ud(rng)) : ud(rng) / float(n);
                if (wk == 2 && q % 5 == 1) p[q] = -p[q];
              }
              std::vector<float> ref(size_t(nq) * size_t(hd), 0.25f);
              tq_tiled_accum_ref(s.L, p.data(), n, nq, blk.data(), t0, n, ref.data());
              std::vector<double> mag(static_cast<size_t>(nq), 0.25);  // the f32 sums' magnitude, image units
              for (int i = 0; i < nq; ++i) {
                std::vector<double> pi(static_cast<size_t>(n));
                for (int t = 0; t < n; ++t) {
                  pi[size_t(t)] = p[size_t(i) * size_t(n) + size_t(t)];
                  mag[size_t(i)] += std::fabs(pi[size_t(t)]) * test::tqt_norm(s, blk.data(), t0 + t) * 127;
                }
                const std::vector<double> bound = test::tqt_value_bound(s, blk.data(), t0, n, pi.data());
                for (int d = 0; d < hd; ++d) {
                  double exact = 0;
                  for (int t = 0; t < n; ++t)
                    exact += pi[size_t(t)] * test::tqt_norm(s, blk.data(), t0 + t) *
                             s.c(d, test::tqt_code(s, KvRole::value, blk.data(), t0 + t, d));
                  const double got = (double(ref[size_t(i) * size_t(hd) + size_t(d)]) - 0.25) * s.cs(d);
                  ASSERT_NEAR(got, exact, bound[size_t(d)] + 1e-6 * s.cs(d) * mag[size_t(i)])
                      << k.tiled << " " << hd << " pattern " << int(pat) << " nq " << nq << " t0 " << t0 << " n " << n
                      << " wk " << wk;
                }
              }
#if defined(KVQ_HAVE_SIMD)
              for (int v = 0; v < 2; ++v) {
                if (v == 0 && !(cf.avx2 && cf.fma && cf.f16c)) continue;
                if (v == 1 && !(cf.avx512f && cf.avx512bw && cf.avx512vnni)) continue;
                std::vector<float> out(size_t(nq) * size_t(hd), 0.25f);
                (v == 0 ? tq_tiled_accum_avx2 : tq_tiled_accum_avx512)(s.L, p.data(), n, nq, blk.data(), t0, n,
                                                                       out.data());
                for (size_t q = 0; q < out.size(); ++q)
                  ASSERT_NEAR(out[q], ref[q], 1e-5 * mag[q / size_t(hd)])
                      << (v ? "avx512 " : "avx2 ") << k.tiled << " hd " << hd << " pattern " << int(pat) << " wk " << wk;
                if (!int4t_weights_nonneg(p.data(), n, nq, n)) {  // the f32 path: one function in every variant
                  ASSERT_EQ(std::memcmp(out.data(), ref.data(), sizeof(float) * out.size()), 0);
                }
              }
#endif
            }
      }
    }
}

// Through the codec: the weighted sum of a value block and finish_output give the sum of the
// decoded values (model basis) within the bound, and a key-layout block asked for the same (a role
// it does not serve in attention) gives the f32 sum of its own decoded keys.
TEST(TqTiled, CodecOutputIsTheDecodedSum) {
  std::mt19937 rng(13);
  for (const Kind& k : kKinds)
    for (int hd : {64, 128}) {
      const test::TqtShape s = test::tqt_shape(k.bits, hd);
      if (!s.ok) continue;
      auto vc = make(k.tiled, hd, KvRole::value);
      auto kc = make(k.tiled, hd, KvRole::key);
      auto x = make_rows(Pat::random, 64, hd, rng);
      std::vector<uint8_t> vb(vc->block_bytes(64)), kb(kc->block_bytes(64));
      vc->encode(0, x.data(), size_t(hd), 64, vb.data(), 64, 0, 0);
      kc->encode(0, x.data(), size_t(hd), 64, kb.data(), 64, 0, 0);
      const int nq = 3;
      std::vector<float> p(size_t(nq) * 64);
      for (auto& w : p) w = std::uniform_real_distribution<float>(0.f, 1.f / 64)(rng);
      std::vector<float> dec(size_t(64) * size_t(hd)), deck(dec.size());  // each role has its own rotation
      vc->decode(0, vb.data(), 64, 0, 64, 0, dec.data());
      kc->decode(0, kb.data(), 64, 0, 64, 0, deck.data());
      std::vector<float> av(size_t(nq) * size_t(hd), 0.f), ak(av.size(), 0.f);
      vc->accumulate(0, p.data(), 64, nq, vb.data(), 64, 0, 64, av.data());
      kc->accumulate(0, p.data(), 64, nq, kb.data(), 64, 0, 64, ak.data());
      vc->finish_output(0, av.data(), nq);
      kc->finish_output(0, ak.data(), nq);
      for (int i = 0; i < nq; ++i) {
        std::vector<double> pi(64);
        for (int t = 0; t < 64; ++t) pi[size_t(t)] = p[size_t(i) * 64 + size_t(t)];
        // Per-channel bound in the rotated basis -> its L2 norm bounds every channel after R^T.
        double l2 = 0;
        for (double e : test::tqt_value_bound(s, vb.data(), 0, 64, pi.data())) l2 += e * e;
        const double tol = std::sqrt(l2) + 1e-4;
        for (int d = 0; d < hd; ++d) {
          double exact = 0, exact_k = 0;
          for (int t = 0; t < 64; ++t) {
            exact += pi[size_t(t)] * dec[size_t(t) * size_t(hd) + size_t(d)];
            exact_k += pi[size_t(t)] * deck[size_t(t) * size_t(hd) + size_t(d)];
          }
          EXPECT_NEAR(av[size_t(i) * size_t(hd) + size_t(d)], exact, tol) << k.tiled << " " << hd << " row " << i << " d " << d;
          EXPECT_NEAR(ak[size_t(i) * size_t(hd) + size_t(d)], exact_k, 1e-4) << "key-layout block (f32 sums)";
        }
      }
    }
}
