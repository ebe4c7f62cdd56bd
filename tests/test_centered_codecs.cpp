// Centered formats (*_c): the inner codec applied to x - mu (mu from calibration), exact in
// attention (scores and outputs equal those of the decoded cache), and what they are for.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include <nlohmann/json.hpp>

#include "attn/attention.h"
#include "core/error.h"
#include "kvq/kv_format.h"
#include "kv_score_error.h"

using namespace kvq;

namespace {

constexpr int kHeads = 2;

// Per-head channel means with a few large channels, as post-RoPE keys have.
std::vector<std::vector<float>> make_means(int d, uint32_t seed, float big) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.f, 1.f);
  std::vector<std::vector<float>> m(kHeads, std::vector<float>(size_t(d)));
  for (auto& h : m)
    for (int c = 0; c < d; ++c) h[size_t(c)] = g(rng) * ((c % 13 == 5) ? big : 0.5f);
  return m;
}

nlohmann::json make_calib(const std::vector<std::vector<float>>& km, const std::vector<std::vector<float>>& vm) {
  return {{"layers", {{{"k_mean", km}, {"v_mean", vm}}}}};
}

std::unique_ptr<KvCodec> make(const std::string& name, KvRole role, int d, const nlohmann::json* calib) {
  KvCodecParams p;
  p.role = role;
  p.head_dim = d;
  p.n_kv_heads = kHeads;
  p.calib = calib;
  return kv_codec_create(name, p);
}

// Rows = mu + per-token variation of standard deviation 1.
std::vector<float> rows_around(const std::vector<float>& mu, int n, std::mt19937& rng) {
  std::normal_distribution<float> g(0.f, 1.f);
  const size_t d = mu.size();
  std::vector<float> x(size_t(n) * d);
  for (int t = 0; t < n; ++t)
    for (size_t c = 0; c < d; ++c) x[size_t(t) * d + c] = mu[c] + g(rng);
  return x;
}

}  // namespace

// The payload is the inner codec's bytes of x - mu, and decode adds mu back, per head.
TEST(Centered, PayloadIsInnerCodecOfCenteredVector) {
  const int d = 128, n = 16;
  const auto km = make_means(d, 1, 30.f), vm = make_means(d, 2, 10.f);
  const auto calib = make_calib(km, vm);
  for (const char* inner : {"q4_0h", "tq3", "int4_g64", "q8_0"}) {
    for (KvRole role : {KvRole::key, KvRole::value}) {
      for (int head = 0; head < kHeads; ++head) {
        SCOPED_TRACE(testing::Message() << inner << " role " << int(role) << " head " << head);
        const auto& mu = (role == KvRole::key ? km : vm)[size_t(head)];
        std::mt19937 rng(uint32_t(7 + head));
        const auto x = rows_around(mu, n, rng);
        auto c = make(std::string(inner) + "_c", role, d, &calib);
        auto p = make(inner, role, d, nullptr);
        ASSERT_EQ(c->block_bytes(n), p->block_bytes(n));
        std::vector<uint8_t> a(c->block_bytes(n)), b(p->block_bytes(n));
        c->encode(head, x.data(), size_t(d), n, a.data(), n, 0, 0);
        std::vector<float> xc(x);
        for (int t = 0; t < n; ++t)
          for (int k = 0; k < d; ++k) xc[size_t(t * d + k)] -= mu[size_t(k)];
        p->encode(head, xc.data(), size_t(d), n, b.data(), n, 0, 0);
        EXPECT_EQ(a, b);
        std::vector<float> dc(x.size()), dp(x.size());
        c->decode(head, a.data(), n, 0, n, 0, dc.data());
        p->decode(head, b.data(), n, 0, n, 0, dp.data());
        for (int t = 0; t < n; ++t)
          for (int k = 0; k < d; ++k)
            EXPECT_FLOAT_EQ(dc[size_t(t * d + k)], dp[size_t(t * d + k)] + mu[size_t(k)]);
      }
    }
  }
}

// Fused attention over centered K and V is attention over the inner codec's cache of x - mu,
// shifted back: every score moves by the same <q, mu> (the full-precision tail, stored raw,
// included), so the softmax is unchanged, and the output gains mu_v. Checked tightly against the
// inner codec run on centered rows and tail (same kernels, so the only differences are float
// rounding), and loosely against the double-precision reference on the decoded cache. Rotated
// inner codecs accumulate in another basis, which the mu_v term must be mapped into.
TEST(Centered, FusedAttentionIsExactShiftOfInnerCodec) {
  const int d = 128, bt = 64, n_q = 4, n_tail = 5, n_blocks = 3;
  const auto km = make_means(d, 3, 40.f), vm = make_means(d, 4, 8.f);
  const auto calib = make_calib(km, vm);
  for (const char* inner : {"q4_0h", "tq3", "int2_g32", "tq2.5", "q8_0"}) {
    for (int head = 0; head < kHeads; ++head) {
      SCOPED_TRACE(testing::Message() << inner << " head " << head);
      const auto& mk = km[size_t(head)];
      const auto& mv = vm[size_t(head)];
      auto kc = make(std::string(inner) + "_c", KvRole::key, d, &calib);
      auto vc = make(std::string(inner) + "_c", KvRole::value, d, &calib);
      auto ki = make(inner, KvRole::key, d, nullptr);
      auto vi = make(inner, KvRole::value, d, nullptr);
      std::mt19937 rng(uint32_t(11 + head));
      auto minus = [&](std::vector<float> x, const std::vector<float>& mu) {
        for (size_t i = 0; i < x.size(); ++i) x[i] -= mu[i % size_t(d)];
        return x;
      };
      std::vector<std::vector<uint8_t>> bufs;
      std::vector<KvBlockSpan> spans_c, spans_i;
      for (int b = 0; b < n_blocks; ++b) {
        const int n = b == n_blocks - 1 ? 37 : bt;  // a partial last block
        const auto k = rows_around(mk, n, rng), v = rows_around(mv, n, rng);
        KvBlockSpan s;
        s.block_tokens = bt;
        s.n = n;
        s.pos0 = b * bt;
        KvBlockSpan si = s;
        for (int which = 0; which < 4; ++which) {
          const KvCodec& c = which == 0 ? *kc : which == 1 ? *vc : which == 2 ? *ki : *vi;
          bufs.emplace_back(c.block_bytes(bt));
          const auto src = which == 0 ? k : which == 1 ? v : which == 2 ? minus(k, mk) : minus(v, mv);
          c.encode(head, src.data(), size_t(d), n, bufs.back().data(), bt, 0, b * bt);
          (which == 0 ? s.k : which == 1 ? s.v : which == 2 ? si.k : si.v) = bufs.back().data();
        }
        spans_c.push_back(s);
        spans_i.push_back(si);
      }
      const auto tk = rows_around(mk, n_tail, rng), tv = rows_around(mv, n_tail, rng);
      const auto tkc = minus(tk, mk), tvc = minus(tv, mv);
      std::normal_distribution<float> g(0.f, 0.05f);
      std::vector<float> q(size_t(n_q) * d);
      for (auto& x : q) x = g(rng);
      AttnParams ap;
      std::vector<float> out(size_t(n_q) * d), out_i(size_t(n_q) * d), ref(size_t(n_q) * d);
      std::vector<float> scratch(std::max(attn_scratch_floats(*kc, *vc, n_q, bt), attn_scratch_floats(*ki, *vi, n_q, bt)));
      attn_decode(*kc, *vc, head, q.data(), n_q, spans_c.data(), n_blocks, tk.data(), tv.data(), size_t(d), n_tail,
                  ap, out.data(), scratch.data());
      attn_decode(*ki, *vi, head, q.data(), n_q, spans_i.data(), n_blocks, tkc.data(), tvc.data(), size_t(d), n_tail,
                  ap, out_i.data(), scratch.data());
      attn_decode_ref(*kc, *vc, head, q.data(), n_q, spans_c.data(), n_blocks, tk.data(), tv.data(), size_t(d),
                      n_tail, ap, ref.data());
      for (size_t i = 0; i < out.size(); ++i) {
        const double shifted = double(out_i[i]) + mv[i % size_t(d)];
        EXPECT_NEAR(out[i], shifted, 1e-4 * (1.0 + std::fabs(shifted))) << "at " << i;
        EXPECT_NEAR(out[i], ref[i], 2e-2 * (1.0 + std::fabs(ref[i]))) << "at " << i;
      }
    }
  }
}

// What centering is for: keys = a large common mean + a small per-token part. A per-token
// quantizer of k spends its range (TurboQuant: its norm) on the mean; on k - mu the error
// scales with the per-token part only. Same bytes, several times smaller score error.
TEST(Centered, CenteringShrinksScoreErrorOnOffsetKeys) {
  const int d = 128, n = 256;
  const auto km = make_means(d, 5, 20.f), vm = make_means(d, 6, 1.f);
  const auto calib = make_calib(km, vm);
  std::mt19937 rng(13);
  const auto k = rows_around(km[0], n, rng);
  std::normal_distribution<float> g(0.f, 1.f);
  std::vector<float> q(d);
  for (auto& v : q) v = g(rng);
  auto err = [&](const std::string& name) { return test::score_rms_error(*make(name, KvRole::key, d, &calib), k, q, n); };
  for (const char* inner : {"tq3", "q4_0h"}) {
    const double plain = err(inner), centered = err(std::string(inner) + "_c");
    std::printf("[centered] %s score rms error %.4f, centered %.4f\n", inner, plain, centered);
    EXPECT_LT(centered * 3, plain) << inner;
  }
}

TEST(Centered, BadCalibrationIsRejectedClearly) {
  const int d = 64;
  const auto km = make_means(d, 1, 1.f), vm = make_means(d, 2, 1.f);
  auto expect_error = [&](const nlohmann::json* calib, KvRole role, const char* needle) {
    try {
      make("tq3_c", role, d, calib);
      ADD_FAILURE() << "accepted: " << (calib ? calib->dump().substr(0, 80) : "no calibration");
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error(nullptr, KvRole::key, "kvq calibrate");
  const nlohmann::json no_mean = {{"layers", {{{"k_scale", 1.0}}}}};
  expect_error(&no_mean, KvRole::key, "k_mean");
  expect_error(&no_mean, KvRole::value, "v_mean");
  nlohmann::json one_head = make_calib({km[0]}, {vm[0]});
  expect_error(&one_head, KvRole::key, "2 heads of 64");
  nlohmann::json short_row = make_calib(km, vm);
  short_row["layers"][0]["k_mean"][1].erase(0);
  expect_error(&short_row, KvRole::key, "2 heads of 64");
  nlohmann::json text = make_calib(km, vm);
  text["layers"][0]["v_mean"][0][3] = "x";
  expect_error(&text, KvRole::value, "non-numeric");
  const nlohmann::json no_layers = {{"k_mean", 1}};
  expect_error(&no_layers, KvRole::key, "\"layers\"");
}
