// The tiled fp8 codecs (kv/fp8_tiled.h), every kind (E4M3 / E5M2; fixed, calibrated per head,
// per-token scale): decode bit-identical to the fp8 rows', bytes equal to theirs, the scalar
// reference within the bf16 bound of exact dots of the decoded values, the AVX2 and AVX-512
// kernels within f32 summation error of the reference; random and adversarial inputs, partial
// tiles, never-written slots holding NaN bytes, n_q 1..9, head_dim 32..256, every CPU level.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/cpu.h"
#include "core/error.h"
#include "kv/fp8_tiled.h"
#include "kv/kv_rows.h"
#include "kvq/kv_format.h"
#include "tiled_test_queries.h"

using namespace kvq;

namespace {

using test::make_queries;
using test::make_rows;
using test::Pat;
using test::kPats;

struct Kind {
  const char* tiled;
  const char* rows;
  bool e4m3, token_scales;
};
const Kind kKinds[] = {{"fp8_e4m3t", "fp8_e4m3", true, false},          {"fp8_e5m2t", "fp8_e5m2", false, false},
                       {"fp8_e4m3t_static", "fp8_e4m3_static", true, false}, {"fp8_e5m2t_static", "fp8_e5m2_static", false, false},
                       {"fp8_e4m3t_dyn", "fp8_e4m3_dyn", true, true},   {"fp8_e5m2t_dyn", "fp8_e5m2_dyn", false, true}};
const int kHds[] = {32, 64, 96, 128, 256};
const int kRanges[][2] = {{0, 64}, {7, 50}, {16, 16}, {3, 9}, {0, 1}, {63, 1}, {17, 30}};

// Per-head scales for the calibrated kinds: head 1's differs from head 0's, so a kernel reading
// the wrong head's scale is wrong.
const nlohmann::json& calib() {
  static const nlohmann::json j = {{"layers", {{{"k_scale", {0.5, 0.03}}, {"v_scale", {2.0, 0.07}}}}}};
  return j;
}
std::unique_ptr<KvCodec> make(const std::string& name, int hd, KvRole role) {
  KvCodecParams p;
  p.head_dim = hd;
  p.n_kv_heads = 2;
  p.role = role;
  p.calib = &calib();
  return kv_codec_create(name, p);
}
float head_scale(const Kind& k, KvRole role, int head) {
  if (std::string(k.tiled).find("_static") == std::string::npos) return 1.f;
  return role == KvRole::key ? (head ? 0.03f : 0.5f) : (head ? 0.07f : 2.f);
}

bool have(CpuLevel l) {
#if defined(KVQ_HAVE_SIMD)
  const CpuFeatures& cf = cpu_features();
  if (l == CpuLevel::avx2) return cf.avx2 && cf.fma && cf.f16c;
  return cf.avx512f && cf.avx512bw && cf.avx512bf16 && cf.avx512vbmi;
#else
  (void)l;
  return false;
#endif
}

}  // namespace

TEST(Fp8Tiled, DecodeAndBytesEqualTheRows) {
  std::mt19937 rng(3);
  for (const Kind& k : kKinds) {
    SCOPED_TRACE(k.tiled);
    for (int hd : kHds)
      for (KvRole role : {KvRole::key, KvRole::value})
        for (Pat pat : kPats) {
          const int bt = 64, head = 1;
          auto t = make(k.tiled, hd, role);
          auto g = make(k.rows, hd, role);
          ASSERT_EQ(t->block_bytes(bt), g->block_bytes(bt)) << hd;
          auto x = make_rows(pat, bt, hd, rng);
          std::vector<uint8_t> tb(t->block_bytes(bt), 0xFF), gb(g->block_bytes(bt));
          t->encode(head, x.data(), size_t(hd), 5, tb.data(), bt, 0, 0);
          t->encode(head, x.data() + 5 * size_t(hd), size_t(hd), 36, tb.data(), bt, 5, 0);
          t->encode(head, x.data() + 41 * size_t(hd), size_t(hd), 23, tb.data(), bt, 41, 0);
          g->encode(head, x.data(), size_t(hd), bt, gb.data(), bt, 0, 0);
          std::vector<float> dt(size_t(bt) * size_t(hd)), dg(dt.size());
          t->decode(head, tb.data(), bt, 0, bt, 0, dt.data());
          g->decode(head, gb.data(), bt, 0, bt, 0, dg.data());
          ASSERT_EQ(std::memcmp(dt.data(), dg.data(), sizeof(float) * dt.size()), 0)
              << hd << " role " << int(role) << " pattern " << int(pat);
          std::vector<float> part(size_t(13) * size_t(hd));
          t->decode(head, tb.data(), bt, 19, 13, 0, part.data());
          ASSERT_EQ(std::memcmp(part.data(), dg.data() + 19 * size_t(hd), sizeof(float) * part.size()), 0);
          // Every byte of the block is some token's: encoded over zeros it is the same block.
          std::vector<uint8_t> again(t->block_bytes(bt), 0x00);
          t->encode(head, x.data(), size_t(hd), bt, again.data(), bt, 0, 0);
          ASSERT_EQ(std::memcmp(again.data(), tb.data(), tb.size()), 0) << "a byte not written by its token";
        }
  }
}

// Scores: the reference within the bf16 bound of exact <q, decode(k)>, the SIMD kernels within
// f32 summation error of the reference.
TEST(Fp8Tiled, ScoresParityAndBound) {
  std::mt19937 rng(5);
  for (const Kind& k : kKinds) {
    SCOPED_TRACE(k.tiled);
    for (int hd : kHds)
      for (Pat pat : kPats) {
        const int bt = 64, head = 1;
        auto c = make(k.tiled, hd, KvRole::key);
        auto x = make_rows(pat, bt, hd, rng);
        std::vector<uint8_t> blk(c->block_bytes(bt), 0xFF);
        c->encode(head, x.data(), size_t(hd), bt, blk.data(), bt, 0, 0);
        std::vector<float> dec(size_t(bt) * size_t(hd));
        c->decode(head, blk.data(), bt, 0, bt, 0, dec.data());
        Fp8TiledLayout L = fp8t_layout(hd, k.e4m3, k.token_scales);
        L.scale = head_scale(k, KvRole::key, head);
        for (int nq : {1, 2, 3, 4, 5, 8, 9}) {
          auto q = make_queries(nq + int(pat), nq, hd, rng);
          ASSERT_EQ(c->prepared_query_dim(), L.qdim);
          std::vector<float> qp(size_t(nq) * size_t(L.qdim));
          c->prepare_query(head, q.data(), nq, qp.data());
          for (const auto& rg : kRanges) {
            const int t0 = rg[0], n = rg[1], os = n + 3;
            std::vector<float> ref(size_t(nq) * size_t(os), -7.f);
            fp8t_scores_ref(L, qp.data(), nq, blk.data(), t0, n, ref.data(), os);
            std::vector<double> mag(size_t(nq) * size_t(n));
            for (int i = 0; i < nq; ++i) {
              for (int t = n; t < os; ++t) ASSERT_EQ(ref[size_t(i) * size_t(os) + size_t(t)], -7.f) << "wrote past n";
              const float* qi = q.data() + size_t(i) * size_t(hd);
              for (int t = 0; t < n; ++t) {
                double exact = 0, m = 0, small = 0;
                for (int d = 0; d < hd; ++d) {
                  const double kv = dec[size_t(t0 + t) * size_t(hd) + size_t(d)];
                  exact += double(qi[d]) * kv;
                  m += std::fabs(double(qi[d]) * kv);
                  small += std::fabs(qi[d]) + std::fabs(kv);
                }
                mag[size_t(i) * size_t(n) + size_t(t)] = m;
                const double bound = kv_rows_bf16_rel * m + kv_rows_bf16_flush * small * 1e3 + 1e-6 * m + 1e-30;
                ASSERT_NEAR(ref[size_t(i) * size_t(os) + size_t(t)], exact, bound)
                    << hd << " pattern " << int(pat) << " nq " << nq << " t0 " << t0 << " n " << n;
              }
            }
#if defined(KVQ_HAVE_SIMD)
            for (CpuLevel lvl : {CpuLevel::avx2, CpuLevel::avx512}) {
              if (!have(lvl)) continue;
              std::vector<float> out(size_t(nq) * size_t(os), -7.f);
              (lvl == CpuLevel::avx512 ? fp8t_scores_avx512 : fp8t_scores_avx2)(L, qp.data(), nq, blk.data(), t0, n,
                                                                                out.data(), os);
              for (int i = 0; i < nq; ++i) {
                for (int t = n; t < os; ++t) ASSERT_EQ(out[size_t(i) * size_t(os) + size_t(t)], -7.f) << "wrote past n";
                for (int t = 0; t < n; ++t)
                  ASSERT_NEAR(out[size_t(i) * size_t(os) + size_t(t)], ref[size_t(i) * size_t(os) + size_t(t)],
                              2e-6 * mag[size_t(i) * size_t(n) + size_t(t)] + 1e-30)
                      << cpu_level_name(lvl) << " hd " << hd << " pattern " << int(pat) << " nq " << nq << " t0 "
                      << t0 << " n " << n;
              }
            }
#endif
          }
        }
      }
  }
}

// Weighted sums: the reference within the bf16 bound of exact sums of the decoded values, the
// SIMD kernels within f32 summation error of it; slots never written hold NaN bytes (0xFF) and
// the weights past n are NaN: neither may reach a result. Every other case has a signed row.
TEST(Fp8Tiled, AccumulateParityAndBound) {
  std::mt19937 rng(9);
  std::normal_distribution<float> nd;
  for (const Kind& k : kKinds) {
    SCOPED_TRACE(k.tiled);
    for (int hd : kHds)
      for (Pat pat : kPats) {
        const int bt = 64, head = 1;
        auto c = make(k.tiled, hd, KvRole::value);
        auto x = make_rows(pat, bt, hd, rng);
        std::vector<uint8_t> blk(c->block_bytes(bt), 0xFF);
        // tokens 2..60 only: the edges of the ranges below cross unwritten slots
        c->encode(head, x.data() + 2 * size_t(hd), size_t(hd), 59, blk.data(), bt, 2, 0);
        std::vector<float> dec(size_t(bt) * size_t(hd), 0.f);
        c->decode(head, blk.data(), bt, 2, 59, 0, dec.data() + 2 * size_t(hd));
        Fp8TiledLayout L = fp8t_layout(hd, k.e4m3, k.token_scales);
        L.scale = head_scale(k, KvRole::value, head);
        const int ranges[][2] = {{2, 59}, {7, 50}, {16, 16}, {3, 9}, {2, 1}, {60, 1}, {17, 30}};
        for (int nq : {1, 2, 3, 4, 5, 8, 9})
          for (int ri = 0; ri < int(std::size(ranges)); ++ri) {
            const int t0 = ranges[ri][0], n = ranges[ri][1], ps = n + 5;
            const bool sgn = (nq + ri) % 2 == 0;
            std::vector<float> p(size_t(nq) * size_t(ps), std::nanf(""));
            for (int i = 0; i < nq; ++i)
              for (int t = 0; t < n; ++t) {
                float v = std::exp(-std::fabs(nd(rng)) * 3.f);
                if (sgn && i == nq / 2) v = nd(rng);
                p[size_t(i) * size_t(ps) + size_t(t)] = v;
              }
            std::vector<float> ref(size_t(nq) * size_t(hd), 0.25f);
            fp8t_accum_ref(L, p.data(), ps, nq, blk.data(), t0, n, ref.data());
            std::vector<double> mag(size_t(nq) * size_t(hd), 0.25);
            for (int i = 0; i < nq; ++i)
              for (int d = 0; d < hd; ++d) {
                double exact = 0.25, m = 0.25, small = 0;
                for (int t = 0; t < n; ++t) {
                  const double pv = p[size_t(i) * size_t(ps) + size_t(t)], v = dec[size_t(t0 + t) * size_t(hd) + size_t(d)];
                  exact += pv * v;
                  m += std::fabs(pv * v);
                  small += std::fabs(pv) + std::fabs(v);
                }
                mag[size_t(i) * size_t(hd) + size_t(d)] = m;
                const double bound = kv_rows_bf16_rel * m + kv_rows_bf16_flush * small * 1e3 + 1e-6 * m + 1e-30;
                ASSERT_NEAR(ref[size_t(i) * size_t(hd) + size_t(d)], exact, bound)
                    << hd << " pattern " << int(pat) << " nq " << nq << " t0 " << t0 << " n " << n;
              }
#if defined(KVQ_HAVE_SIMD)
            for (CpuLevel lvl : {CpuLevel::avx2, CpuLevel::avx512}) {
              if (!have(lvl)) continue;
              std::vector<float> out(size_t(nq) * size_t(hd), 0.25f);
              (lvl == CpuLevel::avx512 ? fp8t_accum_avx512 : fp8t_accum_avx2)(L, p.data(), ps, nq, blk.data(), t0, n,
                                                                              out.data());
              for (size_t e = 0; e < out.size(); ++e)
                ASSERT_NEAR(out[e], ref[e], 2e-6 * mag[e] + 1e-30)
                    << cpu_level_name(lvl) << " hd " << hd << " pattern " << int(pat) << " nq " << nq << " t0 " << t0
                    << " n " << n << " element " << e;
            }
#endif
          }
      }
  }
}

// Through the codec API as attention calls it, at every CPU level the machine runs: head 1 (a
// calibrated kind's second scale), scores and sums against the scalar level's.
TEST(Fp8Tiled, CodecApiEveryLevel) {
  std::mt19937 rng(13);
  std::normal_distribution<float> nd;
  const CpuLevel saved = cpu_set_level(CpuLevel::avx512);
  for (const Kind& k : kKinds) {
    SCOPED_TRACE(k.tiled);
    const int hd = 128, bt = 64, nq = 4, t0 = 9, n = 40, head = 1;
    auto kc = make(k.tiled, hd, KvRole::key);
    auto vc = make(k.tiled, hd, KvRole::value);
    auto x = make_rows(Pat::outlier_channel, bt, hd, rng);
    std::vector<uint8_t> kb(kc->block_bytes(bt)), vb(vc->block_bytes(bt));
    kc->encode(head, x.data(), size_t(hd), bt, kb.data(), bt, 0, 0);
    vc->encode(head, x.data(), size_t(hd), bt, vb.data(), bt, 0, 0);
    auto q = make_queries(1, nq, hd, rng);
    std::vector<float> p(size_t(nq) * n);
    for (auto& v : p) v = std::fabs(nd(rng));
    std::vector<float> s_ref, a_ref;
    for (CpuLevel lvl : {CpuLevel::scalar, CpuLevel::avx2, CpuLevel::avx512}) {
      if (lvl != CpuLevel::scalar && !have(lvl)) continue;
      cpu_set_level(lvl);
      std::vector<float> qp(size_t(nq) * size_t(kc->prepared_query_dim())), s(size_t(nq) * n), a(size_t(nq) * hd, 0.f);
      kc->prepare_query(head, q.data(), nq, qp.data());
      kc->scores(head, qp.data(), nq, kb.data(), bt, t0, n, 0, s.data(), n);
      vc->accumulate(head, p.data(), n, nq, vb.data(), bt, t0, n, a.data());
      if (lvl == CpuLevel::scalar) {
        s_ref = s;
        a_ref = a;
        continue;
      }
      for (size_t e = 0; e < s.size(); ++e)
        EXPECT_NEAR(s[e], s_ref[e], 1e-5 * (std::fabs(s_ref[e]) + 100)) << cpu_level_name(lvl) << " score " << e;
      for (size_t e = 0; e < a.size(); ++e)
        EXPECT_NEAR(a[e], a_ref[e], 1e-5 * (std::fabs(a_ref[e]) + 100)) << cpu_level_name(lvl) << " sum " << e;
    }
    // The kernels' results are the codec's arithmetic, not another head's scale: head 0 differs
    // for the calibrated kinds.
    if (std::string(k.tiled).find("_static") != std::string::npos) {
      cpu_set_level(CpuLevel::scalar);
      std::vector<float> qp(size_t(nq) * size_t(kc->prepared_query_dim())), s0(size_t(nq) * n);
      kc->prepare_query(0, q.data(), nq, qp.data());
      kc->scores(0, qp.data(), nq, kb.data(), bt, t0, n, 0, s0.data(), n);
      EXPECT_NEAR(s0[3] / s_ref[3], 0.5 / 0.03, 1e-3);
    }
  }
  cpu_set_level(saved);
}

TEST(Fp8Tiled, RejectsBadShapesAndMissingCalibration) {
  auto error_of = [](auto f) -> std::string {
    try {
      f();
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  std::string e = error_of([] { make("fp8_e4m3t", 48, KvRole::key); });
  EXPECT_NE(e.find("multiple of 32"), std::string::npos) << e;
  EXPECT_NE(e.find("'fp8_e4m3_rows'"), std::string::npos) << e;
  // The format's codec falls back to the rows there.
  auto rows48 = make("fp8_e4m3", 48, KvRole::key);
  EXPECT_EQ(rows48->info().name, "fp8_e4m3_rows");
  // The tiles at the AVX-512 level, the rows below it (where the rows' kernels are faster).
  const CpuLevel saved = cpu_set_level(CpuLevel::avx2);
  EXPECT_EQ(make("fp8_e4m3_dyn", 64, KvRole::value)->info().name, "fp8_e4m3_dyn_rows");
  cpu_set_level(CpuLevel::avx512);
  if (cpu_level() == CpuLevel::avx512) {
    EXPECT_EQ(make("fp8_e4m3_dyn", 64, KvRole::value)->info().name, "fp8_e4m3t_dyn");
  }
  cpu_set_level(saved);
  KvCodecParams p;
  p.head_dim = 64;
  e = error_of([&] { kv_codec_create("fp8_e5m2_static", p); });
  EXPECT_NE(e.find("needs calibration"), std::string::npos) << e;
  EXPECT_NE(e.find("'fp8_e5m2_static'"), std::string::npos) << e;
  auto c = make("fp8_e4m3t", 64, KvRole::key);
  e = error_of([&] { (void)c->block_bytes(40); });
  EXPECT_NE(e.find("multiple of 16"), std::string::npos) << e;
  std::vector<float> x(64, 1.f);
  std::vector<uint8_t> blk(c->block_bytes(16));
  e = error_of([&] { c->encode(2, x.data(), 64, 1, blk.data(), 16, 0, 0); });
  EXPECT_NE(e.find("outside"), std::string::npos) << e;
}
