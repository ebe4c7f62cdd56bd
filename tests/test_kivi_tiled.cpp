// kivi4t and kivi2t (kv/kivi_tiled.h), each test over both code widths: bytes equal to the bit-plane
// codecs' (kivi4p / kivi2p), decode bit-identical to them, key scores identical at every CPU level
// (scalar, AVX2, AVX-512 kernels) and within the derived bound of the exact dots with the decoded
// keys, value sums within int4t's / int2t's bound at every level; random and adversarial inputs
// (non-finite included), partial ranges, several n_q / head_dim / G. The query fold is shared.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/cpu.h"
#include "core/error.h"
#include "kv/int2_tiled.h"
#include "kv/int4_tiled.h"
#include "kv/kivi_tiled.h"
#include "kvq/kv_format.h"
#include "tiled_test_queries.h"
#include "int2_tiled_bound.h"
#include "kivi_tiled_bound.h"

using namespace kvq;

namespace {

using test::make;
using test::make_rows;
using test::Pat;
// every pattern of the shared list, plus non-finite input (kivi's encoder sanitizes it)
const Pat kPats[] = {Pat::random, Pat::outlier_channel, Pat::constant_rows, Pat::zeros,
                     Pat::huge,   Pat::tiny,            Pat::mixed_scale,   Pat::nonfinite};
using test::make_queries;

struct Shape {
  int hd, G;
};
const Shape kShapes[] = {{64, 32}, {128, 16}, {128, 32}, {128, 64}, {256, 32}};

std::vector<CpuLevel> levels() {
  std::vector<CpuLevel> v{CpuLevel::scalar};
#if defined(KVQ_HAVE_SIMD)
  const CpuFeatures& cf = cpu_features();
  if (cf.avx2 && cf.fma && cf.f16c) v.push_back(CpuLevel::avx2);
  if (cf.avx512f && cf.avx512bw && cf.avx512vnni) v.push_back(CpuLevel::avx512);
#endif
  return v;
}

struct LevelGuard {
  CpuLevel saved = cpu_level();
  ~LevelGuard() { cpu_set_level(saved); }
};

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// What differs between the two widths: names, the key tiles' bytes and kernels, the value layout,
// and the score bound (tests/kivi_tiled_bound.h, tests/int2_tiled_bound.h).
struct Width {
  std::string tiles, planes;  // codec name stems: "kivi4t", "kivi4p"
  size_t (*key_tile_bytes)(int hd);
  KivitScoresFn ref;
#if defined(KVQ_HAVE_SIMD)
  KivitScoresFn avx2, avx512;
#endif
  Int4TiledLayout (*value_layout)(int hd);
  int (*value_code)(const uint8_t* codes, int j, int d);
  double (*score_bound)(const float* q, const uint8_t* block, int hd, int G, int t);
};
const Width kWidths[] = {
    {"kivi4t", "kivi4p", [](int hd) { return size_t(8 * hd); }, kivit_scores_ref,
#if defined(KVQ_HAVE_SIMD)
     kivit_scores_avx2, kivit_scores_avx512,
#endif
     [](int hd) { return int4t_layout(hd, 32); }, int4t_value_code, test::kivi4t_score_bound},
    {"kivi2t", "kivi2p", int2t_code_bytes, kivi2t_scores_ref,
#if defined(KVQ_HAVE_SIMD)
     kivi2t_scores_avx2, kivi2t_scores_avx512,
#endif
     [](int hd) { return int2t_layout(hd, 32); }, int2t_value_code, test::kivi2t_score_bound},
};

}  // namespace

TEST(KiviTiled, BytesAndBitsEqualThePlanes) {
  for (const Width& w : kWidths) {
    for (const Shape& s : kShapes)
      for (KvRole role : {KvRole::key, KvRole::value}) {
        const char* r = role == KvRole::key ? "_k" : "_v";
        auto t = make(w.tiles + r, s.hd, role, s.G);
        auto k = make(w.planes + r, s.hd, role, s.G);
        EXPECT_EQ(t->info().group_tokens, s.G);
        EXPECT_EQ(t->info().residual_tokens, k->info().residual_tokens);
        EXPECT_EQ(t->info().code_bits, k->info().code_bits);
        for (int bt : {64, 128, 256}) {
          EXPECT_EQ(t->block_bytes(bt), k->block_bytes(bt)) << w.tiles << " " << s.hd << " G" << s.G << " " << bt;
          EXPECT_DOUBLE_EQ(kv_codec_effective_bits(*t, bt, 4096), kv_codec_effective_bits(*k, bt, 4096));
        }
      }
    auto d = make(w.tiles + "_k", 128, KvRole::key);
    EXPECT_EQ(d->info().group_tokens, 32);
    EXPECT_EQ(d->info().residual_tokens, 128);
    EXPECT_EQ(kv_format_find(w.tiles).k_codec, w.tiles + "_k");
  }
  EXPECT_EQ(kv_format_find("KIVI4T").v_codec, "kivi4t_v");
  EXPECT_EQ(kv_format_find("KIVI2T").v_codec, "kivi2t_v");
}

TEST(KiviTiled, RejectsBadShapes) {
  for (const Width& w : kWidths) {
    EXPECT_THROW(make(w.tiles + "_k", 80, KvRole::key), Error);  // head_dim not a multiple of 32
    EXPECT_THROW(make(w.tiles + "_v", 48, KvRole::value), Error);
    EXPECT_THROW(make(w.tiles + "_k", 128, KvRole::key, 8, 128), Error);    // G not a multiple of 16
    EXPECT_THROW(make(w.tiles + "_v", 128, KvRole::value, 32, 40), Error);  // R % G != 0
    auto c = make(w.tiles + "_k", 128, KvRole::key);
    EXPECT_THROW(c->block_bytes(48), Error);  // not a multiple of G = 32
  }
}

// Decode equals the bit-plane codecs' (kivi4p_* / kivi2p_*) bit for bit, over the whole block and partial ranges.
TEST(KiviTiled, DecodeMatchesThePlanesBitForBit) {
  for (const Width& w : kWidths) {
    std::mt19937 rng(3);
    for (const Shape& s : kShapes)
      for (KvRole role : {KvRole::key, KvRole::value})
        for (Pat pat : kPats) {
          const char* r = role == KvRole::key ? "_k" : "_v";
          auto t = make(w.tiles + r, s.hd, role, s.G);
          auto k = make(w.planes + r, s.hd, role, s.G);
          const int bt = 128, hd = s.hd;
          auto x = make_rows(pat, bt, hd, rng);
          std::vector<uint8_t> bt_blk(t->block_bytes(bt), 0xFF), bk_blk(k->block_bytes(bt), 0xFF);
          // Tiled block written in two runs of whole groups, kivi's in one.
          t->encode(0, x.data(), size_t(hd), s.G, bt_blk.data(), bt, 0, 0);
          t->encode(0, x.data() + size_t(s.G) * size_t(hd), size_t(hd), bt - s.G, bt_blk.data(), bt, s.G, s.G);
          k->encode(0, x.data(), size_t(hd), bt, bk_blk.data(), bt, 0, 0);
          for (auto [t0, n] : {std::pair{0, bt}, std::pair{5, 37}, std::pair{bt - 3, 3}}) {
            std::vector<float> a(size_t(n) * size_t(hd)), b(a.size());
            t->decode(0, bt_blk.data(), bt, t0, n, 0, a.data());
            k->decode(0, bk_blk.data(), bt, t0, n, 0, b.data());
            for (size_t e = 0; e < a.size(); ++e)
              ASSERT_TRUE(same_bits(a[e], b[e]))
                  << w.tiles << r << " hd " << hd << " G" << s.G << " pattern " << int(pat) << " t0 " << t0
                  << " element " << e << ": " << a[e] << " vs " << b[e];
          }
        }
  }
}

// Key scores: the same bits at every CPU level (the kernels share the fold and the per-lane
// operation order), and within the width's score bound (kivi4t_score_bound / kivi2t_score_bound) of
// the exact dot with the decoded key.
TEST(KiviTiled, ScoresParityAndBound) {
  LevelGuard guard;
  std::mt19937 rng(5);
  const auto lv = levels();
  const int ranges[][2] = {{0, 128}, {0, 16}, {3, 1}, {5, 27}, {17, 60}, {31, 2}, {100, 28}, {127, 1}};
  for (const Width& w : kWidths) {
    for (const Shape& s : kShapes)
      for (Pat pat : kPats) {
        const int bt = 128, hd = s.hd;
        auto c = make(w.tiles + "_k", hd, KvRole::key, s.G);
        auto x = make_rows(pat, bt, hd, rng);
        std::vector<uint8_t> blk(c->block_bytes(bt), 0xFF);
        c->encode(0, x.data(), size_t(hd), bt, blk.data(), bt, 0, 0);
        std::vector<float> dec(size_t(bt) * size_t(hd));
        c->decode(0, blk.data(), bt, 0, bt, 0, dec.data());
        for (int nq : {1, 3, 4, 9}) {
          const auto q = make_queries(nq + int(pat), nq, hd, rng);
          std::vector<float> qp(size_t(nq) * size_t(c->prepared_query_dim()));
          c->prepare_query(0, q.data(), nq, qp.data());
          for (const auto& rg : ranges) {
            const int t0 = rg[0], n = rg[1], os = n + 3;
            std::vector<float> ref;
            for (CpuLevel l : lv) {
              cpu_set_level(l);
              std::vector<float> out(size_t(nq) * size_t(os), -7.f);
              c->scores(0, qp.data(), nq, blk.data(), bt, t0, n, 0, out.data(), os);
              for (int i = 0; i < nq; ++i)  // nothing written outside [0, n)
                for (int t = n; t < os; ++t) ASSERT_EQ(out[size_t(i) * size_t(os) + size_t(t)], -7.f);
              if (ref.empty()) {
                ref = out;
                for (int i = 0; i < nq; ++i)
                  for (int t = 0; t < n; ++t) {
                    double exact = 0;
                    for (int d = 0; d < hd; ++d)
                      exact += double(q[size_t(i) * size_t(hd) + size_t(d)]) *
                               dec[size_t(t0 + t) * size_t(hd) + size_t(d)];
                    const double bound =
                        w.score_bound(q.data() + size_t(i) * size_t(hd), blk.data(), hd, s.G, t0 + t);
                    ASSERT_NEAR(out[size_t(i) * size_t(os) + size_t(t)], exact, bound)
                        << w.tiles << " hd " << hd << " G" << s.G << " pattern " << int(pat) << " nq " << nq
                        << " t " << t0 + t;
                  }
              } else {
                for (size_t e = 0; e < out.size(); ++e)
                  ASSERT_TRUE(same_bits(out[e], ref[e]))
                      << w.tiles << " " << cpu_level_name(l) << " hd " << hd << " G" << s.G << " pattern " << int(pat)
                      << " nq " << nq << " t0 " << t0 << " n " << n << " at " << e << ": " << out[e] << " vs "
                      << ref[e];
              }
            }
          }
        }
      }
  }
}

// The kernels called directly (each variant, not through the dispatch) on a folded query:
// bit-identical to the reference, including the widest head kivi allows.
TEST(KiviTiled, KernelParityDirect) {
#if defined(KVQ_HAVE_SIMD)
  std::mt19937 rng(11);
  std::uniform_int_distribution<int> cd(0, 255), qd(-127, 127);
  const CpuFeatures& cf = cpu_features();
  for (const Width& w : kWidths)
    for (int hd : {32, 128, 512}) {
      const int G = 64, nq = 7;
      std::vector<uint8_t> tiles(size_t(G / 16) * w.key_tile_bytes(hd));
      for (auto& b : tiles) b = uint8_t(cd(rng));
      std::vector<int8_t> q8(size_t(nq) * size_t(hd));
      for (auto& v : q8) v = int8_t(qd(rng));
      std::vector<float> dq(size_t(nq) * size_t(hd / 32)), cz(nq);
      std::normal_distribution<float> nd;
      for (auto& v : dq) v = std::fabs(nd(rng)) * 1e-2f;
      for (auto& v : cz) v = nd(rng);
      for (auto [t0, n] : {std::pair{0, G}, std::pair{7, 50}, std::pair{63, 1}}) {
        std::vector<float> ref(size_t(nq) * size_t(n)), out(ref.size());
        w.ref(q8.data(), dq.data(), cz.data(), nq, hd, tiles.data(), t0, n, ref.data(), n);
        for (int v = 0; v < 2; ++v) {
          if (v == 0 && !(cf.avx2 && cf.fma && cf.f16c)) continue;
          if (v == 1 && !(cf.avx512f && cf.avx512bw && cf.avx512vnni)) continue;
          (v == 0 ? w.avx2 : w.avx512)(q8.data(), dq.data(), cz.data(), nq, hd, tiles.data(), t0, n, out.data(), n);
          for (size_t e = 0; e < out.size(); ++e)
            ASSERT_TRUE(same_bits(out[e], ref[e]))
                << w.tiles << (v ? " avx512" : " avx2") << " hd " << hd << " at " << e;
        }
      }
    }
#else
  GTEST_SKIP() << "built without SIMD kernels";
#endif
}

// The AVX2 and AVX-512 folds against the reference: the same int8 image, steps and constant bit for bit,
// on real key groups (outliers, zeros, huge) and queries with zero / huge / tiny blocks.
TEST(KiviTiled, FoldParityDirect) {
#if defined(KVQ_HAVE_SIMD)
  const CpuFeatures& cf = cpu_features();
  if (!(cf.avx2 && cf.fma && cf.f16c)) GTEST_SKIP() << "no AVX2";
  const bool has512 = cf.avx512f && cf.avx512bw && cf.avx512vnni;
  std::mt19937 rng(13);
  for (int hd : {32, 64, 128, 256, 512})  // 64, 128, 256: the AVX-512 fold's constant-shape instances
    for (Pat pat : kPats) {
      auto c = make("kivi4t_k", hd, KvRole::key);
      auto x = make_rows(pat, 32, hd, rng);
      std::vector<uint8_t> blk(c->block_bytes(32));
      c->encode(0, x.data(), size_t(hd), 32, blk.data(), 32, 0, 0);
      for (int variant = 0; variant < 6; ++variant) {
        const int nq = 5;
        auto q = make_queries(variant % 4, nq, hd, rng);
        if (variant == 4) {  // non-finite query entries: no int8 image for their block, C non-finite
          q[3] = std::numeric_limits<float>::infinity();
          q[size_t(hd) + size_t(hd) - 1] = std::numeric_limits<float>::quiet_NaN();
        }
        if (variant == 5)  // a block so small that 1 / step overflows to inf: its products are +-inf
          for (int d = 0; d < 32; ++d) q[size_t(hd) + size_t(d)] *= 1e-37f;
        std::vector<int8_t> a8(size_t(nq) * size_t(hd)), b8(a8.size());
        std::vector<float> ad(size_t(nq) * size_t(hd / 32)), bd(ad.size()), ac(nq), bc(nq);
        kivit_fold_query_ref(blk.data(), q.data(), nq, hd, a8.data(), ad.data(), ac.data());
        for (int v = 0; v < (has512 ? 2 : 1); ++v) {
          (v == 0 ? kivit_fold_query_avx2 : kivit_fold_query_avx512)(blk.data(), q.data(), nq, hd, b8.data(),
                                                                     bd.data(), bc.data());
          ASSERT_EQ(a8, b8) << (v ? "avx512 " : "avx2 ") << hd << " pattern " << int(pat) << " variant " << variant;
          for (size_t e = 0; e < ad.size(); ++e) ASSERT_TRUE(same_bits(ad[e], bd[e])) << e;
          for (int i = 0; i < nq; ++i)
            ASSERT_TRUE(same_bits(ac[size_t(i)], bc[size_t(i)]) || (std::isnan(ac[size_t(i)]) && std::isnan(bc[size_t(i)])))
                << ac[size_t(i)] << " " << bc[size_t(i)];
        }
      }
    }
#else
  GTEST_SKIP() << "built without SIMD kernels";
#endif
}

// Value sums (int4t's / int2t's weighted sum on int4t_g32's / int2t_g32's layout): within int4t's
// bound (codes 0..15 / 0..3) of the exact sum of the decoded values, levels equal up to f32
// summation order; non-negative and signed weights.
TEST(KiviTiled, AccumulateBoundEveryLevel) {
  LevelGuard guard;
  std::mt19937 rng(9);
  std::normal_distribution<float> nd;
  const auto lv = levels();
  for (const Width& w : kWidths) {
    for (const Shape& s : kShapes)
      for (Pat pat : kPats) {
        const int bt = 128, hd = s.hd;
        auto c = make(w.tiles + "_v", hd, KvRole::value, s.G);
        auto x = make_rows(pat, bt, hd, rng);
        std::vector<uint8_t> blk(c->block_bytes(bt), 0xFF);
        c->encode(0, x.data(), size_t(hd), bt, blk.data(), bt, 0, 0);
        std::vector<float> dec(size_t(bt) * size_t(hd));
        c->decode(0, blk.data(), bt, 0, bt, 0, dec.data());
        const Int4TiledLayout L = w.value_layout(hd);
        for (auto [t0, n] : {std::pair{0, bt}, std::pair{5, 40}, std::pair{64, 1}}) {
          for (bool sgn : {false, true}) {
            const int nq = 5, ps = n + 2;
            std::vector<float> p(size_t(nq) * size_t(ps));
            for (int i = 0; i < nq; ++i)
              for (int t = 0; t < n; ++t)
                p[size_t(i) * size_t(ps) + size_t(t)] = sgn && i == 1 ? nd(rng) : std::exp(-std::fabs(nd(rng)) * 3.f);
            const double levels_w = sgn ? kv_int4t_s8_levels : kv_int4t_u8_levels;
            std::vector<float> first;
            std::vector<double> mags(size_t(nq) * size_t(hd));
            for (CpuLevel l : lv) {
              cpu_set_level(l);
              std::vector<float> acc(size_t(nq) * size_t(hd), 0.5f);
              c->accumulate(0, p.data(), ps, nq, blk.data(), bt, t0, n, acc.data());
              for (int i = 0; i < nq; ++i) {
                const float* pi = p.data() + size_t(i) * size_t(ps);
                for (int d = 0; d < hd; ++d) {
                  // Per tile: half a weight step, max_t |p_t s_t| / levels, times the codes summed;
                  // plus f32 rounding relative to the magnitudes summed.
                  double exact = 0.5, bound = 0, mag = 0.5;
                  for (int tile = t0 / 16; tile < (t0 + n + 15) / 16; ++tile) {
                    double wmax = 0, csum = 0;
                    for (int t = std::max(t0, tile * 16); t < std::min(t0 + n, tile * 16 + 16); ++t) {
                      const uint8_t* tp = blk.data() + size_t(t / 16) * L.tile_bytes;
                      f16_t hs, hm;
                      std::memcpy(&hs, tp + 2 * size_t((d / 32) * 16 + t % 16), 2);
                      std::memcpy(&hm, tp + L.min_off + 2 * size_t((d / 32) * 16 + t % 16), 2);
                      const double sc = f16_to_f32(hs), mn = f16_to_f32(hm);
                      const double v = dec[size_t(t) * size_t(hd) + size_t(d)];
                      const uint8_t* codes = tp + L.code_off;
                      const int j = t % 16;
                      const double code = w.value_code(codes, j, d);
                      const double pt = pi[t - t0];
                      wmax = std::max(wmax, std::fabs(pt * sc));
                      csum += code;
                      exact += pt * v;
                      mag += std::fabs(pt) * (sc * code + std::fabs(mn) + std::fabs(v));
                    }
                    bound += wmax / levels_w * 0.5 * int4t_weight_step_slack(float(levels_w)) * csum;
                  }
                  mags[size_t(i) * size_t(hd) + size_t(d)] = mag;
                  const float got = acc[size_t(i) * size_t(hd) + size_t(d)];
                  ASSERT_NEAR(got, exact, bound + 1e-5 * mag + 1e-30)
                      << w.tiles << " " << cpu_level_name(l) << " hd " << hd << " G" << s.G << " pattern " << int(pat)
                      << " t0 " << t0 << " sgn " << sgn << " row " << i << " d " << d;
                }
              }
              if (first.empty()) {
                first = acc;
              } else {
                for (size_t e = 0; e < acc.size(); ++e)
                  ASSERT_NEAR(acc[e], first[e], 1e-5 * mags[e] + 1e-30) << cpu_level_name(l) << " at " << e;
              }
            }
          }
        }
      }
  }
}

// Through the codec API with the prefetch range inside the block.
TEST(KiviTiled, PrefetchRangeInsideBlock) {
  for (const Width& w : kWidths)
    for (KvRole role : {KvRole::key, KvRole::value}) {
      auto c = make(w.tiles + (role == KvRole::key ? "_k" : "_v"), 128, role);
      for (auto [t0, n] : {std::pair{0, 256}, std::pair{37, 100}, std::pair{255, 1}}) {
        const auto r = c->prefetch_range(256, t0, n);
        EXPECT_LE(r.offset + r.bytes, c->block_bytes(256));
        EXPECT_GT(r.bytes, 0u);
      }
    }
}
