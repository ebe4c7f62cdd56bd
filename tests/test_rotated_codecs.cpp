// Hadamard-rotated formats (q8_0h, q4_0h) and K/V-split format names ("tq4/f16").
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "kv/policy.h"
#include "kvq/kv_format.h"
#include "int4_tiled_bound.h"
#include "int8_tiled_bound.h"
#include "kv/int4_tiled.h"
#include "kv_score_error.h"

using namespace kvq;

namespace {

// Orthonormal Walsh-Hadamard of a power-of-two block, written out as a matrix product so the
// test does not share code with the library's fast transform.
std::vector<float> hadamard_blocks(const std::vector<float>& x, int block) {
  std::vector<float> y(x.size());
  const float s = 1.f / std::sqrt(float(block));
  for (size_t b = 0; b < x.size(); b += size_t(block))
    for (int i = 0; i < block; ++i) {
      double acc = 0;
      for (int j = 0; j < block; ++j) acc += ((__builtin_popcount(unsigned(i & j)) & 1) ? -1.0 : 1.0) * x[b + size_t(j)];
      y[b + size_t(i)] = float(acc * s);
    }
  return y;
}

std::unique_ptr<KvCodec> make(const char* name, KvRole role, int head_dim) {
  KvCodecParams p;
  p.role = role;
  p.head_dim = head_dim;
  return kv_codec_create(name, p);
}

// Keys with a few outlier channels, as real models have (DESIGN: keys per channel or rotate).
std::vector<float> outlier_keys(int n, int d, std::mt19937& rng) {
  std::normal_distribution<float> g(0.f, 1.f);
  std::vector<float> k(size_t(n) * size_t(d));
  for (int t = 0; t < n; ++t)
    for (int c = 0; c < d; ++c) k[size_t(t) * size_t(d) + size_t(c)] = g(rng) * ((c % 29 == 3) ? 25.f : 1.f);
  return k;
}

}  // namespace

// The packed bytes of q4_0h are exactly q4_0t's bytes of the rotated vector (q4_0's quantization
// in int4t's tiles; only the basis changes), and decode rotates back.
TEST(Rotated, PayloadIsInnerCodecOfRotatedVector) {
  for (int d : {64, 128, 256}) {
    for (KvRole role : {KvRole::key, KvRole::value}) {
      const int block = role == KvRole::key ? d : 64;
      SCOPED_TRACE(testing::Message() << "d " << d << " role " << int(role));
      std::mt19937 rng(d);
      const int n = 16;
      const auto x = outlier_keys(n, d, rng);
      auto rot = make("q4_0h", role, d);
      auto plain = make("q4_0t", role, d);
      ASSERT_EQ(rot->block_bytes(n), plain->block_bytes(n));
      std::vector<uint8_t> a(rot->block_bytes(n)), b(plain->block_bytes(n));
      rot->encode(0, x.data(), size_t(d), n, a.data(), n, 0, 0);
      std::vector<float> hx(x.size());
      for (int t = 0; t < n; ++t) {
        std::vector<float> row(x.begin() + t * d, x.begin() + (t + 1) * d);
        const auto r = hadamard_blocks(row, block);
        std::copy(r.begin(), r.end(), hx.begin() + t * d);
      }
      plain->encode(0, hx.data(), size_t(d), n, b.data(), n, 0, 0);
      EXPECT_EQ(a, b);
      std::vector<float> dr(x.size()), dp(x.size());
      rot->decode(0, a.data(), n, 0, n, 0, dr.data());
      plain->decode(0, b.data(), n, 0, n, 0, dp.data());
      for (int t = 0; t < n; ++t) {
        std::vector<float> row(dp.begin() + t * d, dp.begin() + (t + 1) * d);
        const auto back = hadamard_blocks(row, block);
        for (int c = 0; c < d; ++c) EXPECT_NEAR(dr[size_t(t * d + c)], back[size_t(c)], 1e-4f * (1.f + std::fabs(back[size_t(c)])));
      }
      EXPECT_EQ(rot->info().transforms_query, role == KvRole::key);
      EXPECT_EQ(rot->info().transforms_output, role == KvRole::value);
    }
  }
}

// Fused scores with the prepared (rotated) query equal <q, decode(k)>: attention sees the key in
// the model's basis although the cache holds it rotated.
TEST(Rotated, FusedScoresAndOutputInModelBasis) {
  const int d = 128, n = 64, n_q = 4;
  std::mt19937 rng(7);
  const auto k = outlier_keys(n, d, rng);
  std::normal_distribution<float> g(0.f, 1.f);
  std::vector<float> q(size_t(n_q) * d);
  for (auto& v : q) v = g(rng);
  for (const char* name : {"q4_0h", "q8_0h"}) {
    SCOPED_TRACE(name);
    auto kc = make(name, KvRole::key, d);
    std::vector<uint8_t> blk(kc->block_bytes(n));
    kc->encode(0, k.data(), d, n, blk.data(), n, 0, 0);
    std::vector<float> kd(k.size()), qp(size_t(n_q) * size_t(kc->prepared_query_dim())), sc(size_t(n_q) * n);
    kc->decode(0, blk.data(), n, 0, n, 0, kd.data());
    kc->prepare_query(0, q.data(), n_q, qp.data());
    kc->scores(0, qp.data(), n_q, blk.data(), n, 0, n, 0, sc.data(), n);
    for (int i = 0; i < n_q; ++i)
      for (int t = 0; t < n; ++t) {
        double ref = 0, mag = 0;
        for (int c = 0; c < d; ++c) {
          ref += double(q[size_t(i * d + c)]) * kd[size_t(t * d + c)];
          mag += std::fabs(double(q[size_t(i * d + c)]) * kd[size_t(t * d + c)]);
        }
        // The fused kernels may round the (rotated) query to int8 per 32-channel block: each
        // element moves by at most max|q'_block| / 254, so the score moves by at most
        // sum_b max|q'_b| / 254 * sum_{c in b} |k'_c| (k' = H k_hat), plus float rounding.
        const auto qr = hadamard_blocks(std::vector<float>(q.begin() + i * d, q.begin() + (i + 1) * d), d);
        const auto kr = hadamard_blocks(std::vector<float>(kd.begin() + t * d, kd.begin() + (t + 1) * d), d);
        double bound = 1e-4 * (1.0 + mag);
        for (int b = 0; b < d; b += 32) {
          double qmax = 0, ksum = 0;
          for (int c = b; c < b + 32; ++c) {
            qmax = std::max(qmax, std::fabs(double(qr[size_t(c)])));
            ksum += std::fabs(double(kr[size_t(c)]));
          }
          bound += qmax / 254.0 * ksum * 1.001;
        }
        EXPECT_NEAR(sc[size_t(i * n + t)], ref, bound);
      }
    // values: accumulate probabilities in the rotated basis, finish_output rotates back
    auto vc = make(name, KvRole::value, d);
    std::vector<uint8_t> vb(vc->block_bytes(n));
    vc->encode(0, k.data(), d, n, vb.data(), n, 0, 0);
    std::vector<float> vd(k.size());
    vc->decode(0, vb.data(), n, 0, n, 0, vd.data());
    std::vector<float> p(size_t(n_q) * n), acc(size_t(n_q) * d, 0.f);
    std::uniform_real_distribution<float> u(0.f, 1.f);
    for (auto& v : p) v = u(rng) / n;
    vc->accumulate(0, p.data(), n, n_q, vb.data(), n, 0, n, acc.data());
    vc->finish_output(0, acc.data(), n_q);
    for (int i = 0; i < n_q; ++i) {
      // q4_0h / q8_0h sum q4_0t / q8_0t's tiles with quantized weights per (row, block, tile): the
      // derived bounds of tests/int4_tiled_bound.h / int8_tiled_bound.h in the rotated basis, where each output channel is a combination
      // of 64 rotated ones with weights +-1/8 (at most 8x a rotated channel's bound).
      double wsum = 0;
      std::vector<double> pi(p.begin() + i * n, p.begin() + (i + 1) * n);
      if (std::string(name) == "q4_0h") wsum = 8 * test::int4t_value_bound(q4_0t_layout(d), vb.data(), 0, n, pi.data(), 1.0);
      else wsum = 8 * test::int8t_value_bound(q8_0t_layout(d), vb.data(), 0, n, pi.data(), 1.0);  // q8_0h: q8_0t
      for (int c = 0; c < d; ++c) {
        double ref = 0;
        for (int t = 0; t < n; ++t) ref += double(p[size_t(i * n + t)]) * vd[size_t(t * d + c)];
        EXPECT_NEAR(acc[size_t(i * d + c)], ref, 2e-3 * (1.0 + std::fabs(ref)) + wsum);
      }
    }
  }
}

// What the rotation is for: with outlier channels, q4_0's per-32 block scale is set by the
// outlier and rounds the other 31 channels to zero (error ~ their own magnitude, rms 1 here:
// score error ~ sqrt(123) ~ 11); after the rotation every coordinate has sigma ~ |k|/sqrt(d) ~ 5,
// the step is ~ 2.4 sigma / 8 and the error rms ~ 0.43 per coordinate (score error ~ 4.9): about
// half, at the same 4.5 bits.
TEST(Rotated, RotationShrinksScoreErrorOnOutlierKeys) {
  const int d = 128, n = 256;
  std::mt19937 rng(11);
  const auto k = outlier_keys(n, d, rng);
  std::normal_distribution<float> g(0.f, 1.f);
  std::vector<float> q(d);
  for (auto& v : q) v = g(rng);
  auto err = [&](const char* name) { return test::score_rms_error(*make(name, KvRole::key, d), k, q, n); };
  const double plain = err("q4_0"), rotated = err("q4_0h");
  std::printf("[rot] score rms error q4_0 %.4f q4_0h %.4f\n", plain, rotated);
  EXPECT_LT(rotated * 1.6, plain);
}

TEST(Rotated, KvSplitFormatNames) {
  const KvPolicy p = kv_policy_uniform("tq4/f16", 3);
  ASSERT_EQ(p.layers.size(), 3u);
  EXPECT_EQ(p.layers[1].k_codec, kv_format_find("tq4").k_codec);
  EXPECT_EQ(p.layers[1].v_codec, kv_format_find("f16").v_codec);
  EXPECT_EQ(p.name, "tq4/f16");
  const KvPolicy q = kv_policy_uniform("F16/q4_0H", 2);  // names are case-insensitive
  EXPECT_EQ(q.layers[0].v_codec, "q4_0h");
  EXPECT_THROW(kv_policy_uniform("tq4/", 2), Error);
  EXPECT_THROW(kv_policy_uniform("/f16", 2), Error);
  EXPECT_THROW(kv_policy_uniform("tq4/f16/f16", 2), Error);
  EXPECT_THROW(kv_policy_uniform("tq4/nope", 2), Error);
  // --kv-layer uses the same FMT / KFMT/VFMT syntax for one layer
  KvPolicy o = kv_policy_uniform("q4_0", 3);
  kv_policy_override_layer(o, "1=int8/f16");
  EXPECT_EQ(o.layers[1].k_codec, kv_format_find("int8").k_codec);
  EXPECT_EQ(o.layers[1].v_codec, kv_format_find("f16").v_codec);
  EXPECT_EQ(o.layers[0].k_codec, "q4_0t");  // format q4_0: q4_0 in tiles
  kv_policy_override_layer(o, "2=kivi4");
  EXPECT_EQ(o.layers[2].k_codec, kv_format_find("kivi4").k_codec);
  EXPECT_EQ(o.layers[2].v_codec, kv_format_find("kivi4").v_codec);
  for (const char* bad : {"1=int8/", "1=", "1=/f16", "1=a/b/c", "5=int8", "x=int8", "1int8"})
    EXPECT_THROW(kv_policy_override_layer(o, bad), Error) << bad;
}

// Rotation blocks must be a power of two >= 32: head_dim 80 (16 x 5) is refused clearly.
TEST(Rotated, RejectsHeadDimWithoutPowerOfTwoBlock) {
  EXPECT_THROW(make("q4_0h", KvRole::key, 80), Error);
  EXPECT_NO_THROW(make("q4_0h", KvRole::key, 96));  // 96 = 3 x 32: blocks of 32
}
