// Centered and scaled formats (*_c, *_s, *_cs): the inner codec applied to (x - mu) / s (mu and
// the channel scales s from calibration), exact in attention (scores and outputs equal those of
// the decoded cache), and what they are for.
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

std::unique_ptr<KvCodec> make(const std::string& name, KvRole role, int d, const nlohmann::json* calib,
                              KvRope rope = {}) {
  KvCodecParams p;
  p.role = role;
  p.head_dim = d;
  p.n_kv_heads = kHeads;
  p.calib = calib;
  p.rope = rope;
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


struct ScaledCalib {
  std::vector<std::vector<float>> km, vm, kr, qr, vr;
  nlohmann::json json() const {
    return {{"layers", {{{"k_mean", km}, {"v_mean", vm}, {"k_rms", kr}, {"q_rms", qr}, {"v_rms", vr}}}}};
  }
};

// Keys with a few outlier channels (large in k, small in q), values mildly uneven.
ScaledCalib make_scaled_calib(int d, uint32_t seed) {
  ScaledCalib c;
  c.km = make_means(d, seed, 3.f);
  c.vm = make_means(d, seed + 1, 0.5f);
  std::mt19937 rng(seed + 2);
  std::uniform_real_distribution<float> u(0.5f, 2.f);
  c.kr = c.qr = c.vr = std::vector<std::vector<float>>(kHeads, std::vector<float>(size_t(d)));
  for (int h = 0; h < kHeads; ++h)
    for (int k = 0; k < d; ++k) {
      const bool outlier = k % 16 == 3 + h;
      c.kr[size_t(h)][size_t(k)] = std::fabs(c.km[size_t(h)][size_t(k)]) + (outlier ? 12.f : u(rng));
      c.qr[size_t(h)][size_t(k)] = outlier ? 0.1f : u(rng);
      c.vr[size_t(h)][size_t(k)] = std::fabs(c.vm[size_t(h)][size_t(k)]) + u(rng);
    }
  return c;
}

// n zero-mean keys of head 0 whose channel c has the calibration's RMS sc.kr[0][c].
std::vector<float> keys_like(const ScaledCalib& sc, int n, std::mt19937& rng) {
  std::normal_distribution<float> g(0.f, 1.f);
  const size_t d = sc.kr[0].size();
  std::vector<float> k(size_t(n) * d);
  for (int t = 0; t < n; ++t)
    for (size_t c = 0; c < d; ++c) k[size_t(t) * d + c] = g(rng) * sc.kr[0][c];
  return k;
}

// The scales as the header comment of kv/centered_codecs.cpp defines them, computed here apart.
std::vector<double> expected_scales(const ScaledCalib& c, KvRole role, int head, bool centered) {
  const auto& x = (role == KvRole::key ? c.kr : c.vr)[size_t(head)];
  const auto& mu = (role == KvRole::key ? c.km : c.vm)[size_t(head)];
  std::vector<double> s(x.size());
  double lg = 0;
  for (size_t k = 0; k < x.size(); ++k) {
    double sd = centered ? std::sqrt(double(x[k]) * x[k] - double(mu[k]) * mu[k]) : double(x[k]);
    if (role == KvRole::key) sd /= c.qr[size_t(head)][k];
    s[k] = std::sqrt(sd);
    lg += std::log(s[k]);
  }
  for (auto& v : s) v /= std::exp(lg / double(s.size()));
  return s;
}


// The payload of a centered / scaled codec (suffix _c, _s or _cs) is the inner codec's bytes of
// (x - mu) / s, and decode maps the inner decode back (s * y + mu), per role and head. Unscaled:
// exactly. Scaled: the codec computes (x - mu) / s in float from float scales, so a code can flip
// where a value sits on a decision boundary; bytes agree to 99% and decoded values within 2%.
void check_payload(const char* inner, const char* suffix, const ScaledCalib& sc, uint32_t seed) {
  const int d = 128, n = 16;
  const std::string sfx = suffix;
  const bool centered = sfx == "_c" || sfx == "_cs", scaled = sfx != "_c";
  const nlohmann::json calib = sc.json();
  const std::vector<double> ones(size_t(d), 1.0);
  for (KvRole role : {KvRole::key, KvRole::value})
    for (int head = 0; head < kHeads; ++head) {
      SCOPED_TRACE(testing::Message() << inner << suffix << " role " << int(role) << " head " << head);
      const auto& mu = (role == KvRole::key ? sc.km : sc.vm)[size_t(head)];
      const std::vector<double> s = scaled ? expected_scales(sc, role, head, centered) : ones;
      std::mt19937 rng(seed + uint32_t(head));
      const auto x = rows_around(mu, n, rng);
      auto c = make(inner + sfx, role, d, &calib);
      auto p = make(inner, role, d, nullptr);
      ASSERT_EQ(c->block_bytes(n), p->block_bytes(n));
      std::vector<uint8_t> a(c->block_bytes(n)), b(p->block_bytes(n));
      c->encode(head, x.data(), size_t(d), n, a.data(), n, 0, 0);
      std::vector<float> xs(x);
      for (int t = 0; t < n; ++t)
        for (int k = 0; k < d; ++k) {
          float& v = xs[size_t(t * d + k)];
          if (centered) v -= mu[size_t(k)];
          if (scaled) v = float(v / s[size_t(k)]);
        }
      p->encode(head, xs.data(), size_t(d), n, b.data(), n, 0, 0);
      std::vector<float> dc(x.size()), dp(x.size());
      c->decode(head, a.data(), n, 0, n, 0, dc.data());
      p->decode(head, b.data(), n, 0, n, 0, dp.data());
      if (!scaled) {
        EXPECT_EQ(a, b);
        for (int t = 0; t < n; ++t)
          for (int k = 0; k < d; ++k)
            EXPECT_FLOAT_EQ(dc[size_t(t * d + k)], dp[size_t(t * d + k)] + mu[size_t(k)]);
        continue;
      }
      size_t same = 0;
      for (size_t i = 0; i < a.size(); ++i) same += a[i] == b[i];
      EXPECT_GE(double(same), 0.99 * double(a.size()));
      double err = 0, ref = 0;
      for (int t = 0; t < n; ++t)
        for (int k = 0; k < d; ++k) {
          const double want = dp[size_t(t * d + k)] * s[size_t(k)] + (centered ? mu[size_t(k)] : 0.f);
          err += std::pow(dc[size_t(t * d + k)] - want, 2);
          ref += std::pow(want, 2);
        }
      EXPECT_LT(std::sqrt(err / ref), 0.02);
    }
}

// Fused attention over centered / scaled K and V (suffix _c, _s or _cs) is attention over the
// inner codec's cache of the transformed rows (x - mu) / s, with the query multiplied by the key
// scales, every score shifted by the same <q, mu_k> (softmax-invariant), and the output mapped
// back (s_v * out + mu_v); the full-precision tail stays raw. Checked against the inner codec run
// on transformed inputs (tight: the same kernels, so float rounding only; scaled rows may flip a
// code where (x - mu) / s lands on a decision boundary, so those compare per element with a
// 2% allowance) and loosely against the double-precision reference on the decoded cache.
void check_fused_attention(const char* inner, const char* suffix, const ScaledCalib& scal, uint32_t seed) {
  const int d = 128, bt = 64, n_q = 4, n_tail = 5, n_blocks = 3;
  const std::string sfx = suffix;
  const bool centered = sfx == "_c" || sfx == "_cs", scaled = sfx != "_c";
  const nlohmann::json calib = scal.json();
  for (int head = 0; head < kHeads; ++head) {
    SCOPED_TRACE(testing::Message() << inner << suffix << " head " << head);
    const auto& mk = scal.km[size_t(head)];
    const auto& mv = scal.vm[size_t(head)];
    const std::vector<double> ones(size_t(d), 1.0);
    const auto sk = scaled ? expected_scales(scal, KvRole::key, head, centered) : ones;
    const auto sv = scaled ? expected_scales(scal, KvRole::value, head, centered) : ones;
    auto kc = make(inner + sfx, KvRole::key, d, &calib);
    auto vc = make(inner + sfx, KvRole::value, d, &calib);
    auto ki = make(inner, KvRole::key, d, nullptr);
    auto vi = make(inner, KvRole::value, d, nullptr);
    std::mt19937 rng(seed + uint32_t(head));
    auto transform = [&](std::vector<float> x, const std::vector<float>& mu, const std::vector<double>& s) {
      for (size_t i = 0; i < x.size(); ++i) {
        const size_t k = i % size_t(d);
        x[i] = centered ? x[i] - mu[k] : x[i];
        if (scaled) x[i] = float(x[i] / s[k]);
      }
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
        const auto src = which == 0 ? k : which == 1 ? v : which == 2 ? transform(k, mk, sk) : transform(v, mv, sv);
        c.encode(head, src.data(), size_t(d), n, bufs.back().data(), bt, 0, b * bt);
        (which == 0 ? s.k : which == 1 ? s.v : which == 2 ? si.k : si.v) = bufs.back().data();
      }
      spans_c.push_back(s);
      spans_i.push_back(si);
    }
    const auto tk = rows_around(mk, n_tail, rng), tv = rows_around(mv, n_tail, rng);
    std::normal_distribution<float> g(0.f, 0.05f);
    std::vector<float> q(size_t(n_q) * d), qs(q.size());
    for (auto& x : q) x = g(rng);
    for (size_t i = 0; i < q.size(); ++i) qs[i] = float(q[i] * sk[i % size_t(d)]);
    // The inner run's tail: keys as the wrapper scores them against the raw query (up to the
    // common shift), values so that s_v * (inner output) + mu_v is the wrapper's output.
    const auto tail_k = transform(tk, mk, sk), tail_v = transform(tv, mv, sv);
    AttnParams ap;
    std::vector<float> out(size_t(n_q) * d), out_i(size_t(n_q) * d), ref(size_t(n_q) * d);
    std::vector<float> scratch(std::max(attn_scratch_floats(*kc, *vc, n_q, bt), attn_scratch_floats(*ki, *vi, n_q, bt)));
    attn_decode(*kc, *vc, head, q.data(), n_q, spans_c.data(), n_blocks, tk.data(), tv.data(), size_t(d), n_tail, ap,
                out.data(), scratch.data());
    attn_decode(*ki, *vi, head, qs.data(), n_q, spans_i.data(), n_blocks, tail_k.data(), tail_v.data(), size_t(d),
                n_tail, ap, out_i.data(), scratch.data());
    attn_decode_ref(*kc, *vc, head, q.data(), n_q, spans_c.data(), n_blocks, tk.data(), tv.data(), size_t(d), n_tail,
                    ap, ref.data());
    size_t agree = 0;
    for (size_t i = 0; i < out.size(); ++i) {
      const size_t k = i % size_t(d);
      const double want = double(out_i[i]) * sv[k] + (centered ? mv[k] : 0.f);
      if (scaled) {
        agree += std::fabs(out[i] - want) <= 1e-3 * (1.0 + std::fabs(want));
      } else {
        EXPECT_NEAR(out[i], want, 1e-4 * (1.0 + std::fabs(want))) << "at " << i;
      }
      EXPECT_NEAR(out[i], ref[i], 2e-2 * (1.0 + std::fabs(ref[i]))) << "at " << i;
    }
    if (scaled) {
      EXPECT_GE(double(agree), 0.98 * double(out.size()));
    }
  }
}

}  // namespace

// Centered: the payload is the inner codec's bytes of x - mu, exactly, and decode adds mu back.
TEST(Centered, PayloadIsInnerCodecOfCenteredVector) {
  ScaledCalib sc = make_scaled_calib(128, 1);
  sc.km = make_means(128, 1, 30.f);
  sc.vm = make_means(128, 2, 10.f);
  for (const char* inner : {"q4_0h", "tq3", "int4_g64", "q8_0"}) check_payload(inner, "_c", sc, 7);
}

// Centered: the tight check of check_fused_attention, with the inner codecs of several families
// (rotated ones accumulate in another basis, which the output's mu_v term must not enter).
TEST(Centered, FusedAttentionIsExactShiftOfInnerCodec) {
  ScaledCalib sc = make_scaled_calib(128, 3);
  sc.km = make_means(128, 3, 40.f);
  sc.vm = make_means(128, 4, 8.f);
  for (const char* inner : {"q4_0h", "tq3", "int2_g32", "tq2.5", "q8_0"}) check_fused_attention(inner, "_c", sc, 11);
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

// ---------------------------------------------------------------------------------------------
// Scaled formats (*_s, *_cs): the inner codec applied to (x - mu) / s, with s from the
// calibration's channel RMS: keys s^2 = sd(k) / rms(q), values s^2 = sd(v) (sd = the RMS, or the
// standard deviation when centered), normalized to a geometric mean of 1.


// Scaled: check_payload with channel scales (and means for _cs).
TEST(Scaled, PayloadIsInnerCodecOfScaledVector) {
  const ScaledCalib sc = make_scaled_calib(128, 31);
  for (const char* inner : {"q4_0h", "tq3", "int4t_g64h", "tq2.5"})
    for (const char* suffix : {"_s", "_cs"}) check_payload(inner, suffix, sc, 17);
}

// Scaled: check_fused_attention with channel scales (and means for _cs).
TEST(Scaled, FusedAttentionIsExactTransformOfInnerCodec) {
  const ScaledCalib sc = make_scaled_calib(128, 41);
  for (const char* inner : {"q4_0h", "tq3", "int4t_g64h", "q8_0h"})
    for (const char* suffix : {"_s", "_cs"}) check_fused_attention(inner, suffix, sc, 19);
}

// What scaling is for: keys with outlier channels that the queries hardly read. A rotated
// quantizer spreads their energy over every coordinate, so its error on the channels the query
// does read scales with the outliers; scaled by sqrt(rms(k) / rms(q)) it does not.
TEST(Scaled, ScalingShrinksScoreErrorOnOutlierChannels) {
  const int d = 128, n = 256;
  const ScaledCalib sc = make_scaled_calib(d, 51);
  const nlohmann::json calib = sc.json();
  std::mt19937 rng(53);
  std::normal_distribution<float> g(0.f, 1.f);
  std::vector<float> k(size_t(n) * d), q(d);
  for (int t = 0; t < n; ++t)
    for (int c = 0; c < d; ++c) k[size_t(t * d + c)] = sc.km[0][size_t(c)] + g(rng) * std::sqrt(std::max(0.f,
        sc.kr[0][size_t(c)] * sc.kr[0][size_t(c)] - sc.km[0][size_t(c)] * sc.km[0][size_t(c)]));
  for (int c = 0; c < d; ++c) q[size_t(c)] = g(rng) * sc.qr[0][size_t(c)];
  auto err = [&](const std::string& name) { return test::score_rms_error(*make(name, KvRole::key, d, &calib), k, q, n); };
  for (const char* inner : {"tq3", "q4_0h", "int4t_g64h"}) {
    const double plain = err(inner), scaled = err(std::string(inner) + "_s"), both = err(std::string(inner) + "_cs");
    std::printf("[scaled] %s score rms error %.4f, scaled %.4f, centered and scaled %.4f\n", inner, plain, scaled, both);
    EXPECT_LT(scaled * 1.5, plain) << inner;
    EXPECT_LT(both * 1.5, plain) << inner;
  }
}

TEST(Scaled, BadCalibrationIsRejectedClearly) {
  const int d = 64;
  const ScaledCalib sc = make_scaled_calib(d, 61);
  auto expect_error = [&](const nlohmann::json& calib, const char* name, KvRole role, const char* needle) {
    try {
      make(name, role, d, &calib);
      ADD_FAILURE() << name << " accepted: " << calib.dump().substr(0, 80);
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  for (const char* key : {"k_rms", "q_rms"}) {
    nlohmann::json c = sc.json();
    c["layers"][0].erase(key);
    expect_error(c, "tq3_s", KvRole::key, key);
  }
  nlohmann::json no_v = sc.json();
  no_v["layers"][0].erase("v_rms");
  expect_error(no_v, "q4_0h_cs", KvRole::value, "v_rms");
  nlohmann::json no_mean = sc.json();
  no_mean["layers"][0].erase("k_mean");
  expect_error(no_mean, "tq3_cs", KvRole::key, "k_mean");
  make("tq3_s", KvRole::key, d, &no_mean);  // scaling alone does not read the means
  nlohmann::json bad = sc.json();
  bad["layers"][0]["q_rms"][1][5] = "x";
  expect_error(bad, "tq3_s", KvRole::key, "non-numeric");
}

// `--kv-scales qk-norm` (tools/kv_flags.h): key and query channel RMS only, source "qk-norm". The
// *_s formats' keys are scaled exactly as with a full calibration holding the same RMS vectors;
// their values are the inner codec's, byte for byte (there are no value statistics to scale by);
// what needs more than the RMS is refused with a message that says where it comes from.
TEST(Scaled, QkNormCalibrationScalesKeysOnly) {
  const int d = 128, n = 32;
  const ScaledCalib sc = make_scaled_calib(d, 71);
  const nlohmann::json full = sc.json();
  const nlohmann::json qkn = {{"source", "qk-norm"}, {"layers", {{{"layer", 0}, {"k_rms", sc.kr}, {"q_rms", sc.qr}}}}};
  std::mt19937 rng(73);
  for (const char* inner : {"tq3", "q4_0h", "int4t_g64h"})
    for (int head = 0; head < kHeads; ++head) {
      SCOPED_TRACE(testing::Message() << inner << " head " << head);
      const auto x = rows_around(sc.km[size_t(head)], n, rng);
      auto encode = [&](const std::string& name, KvRole role, const nlohmann::json* calib) {
        auto c = make(name, role, d, calib);
        std::vector<uint8_t> b(c->block_bytes(n));
        c->encode(head, x.data(), size_t(d), n, b.data(), n, 0, 0);
        return b;
      };
      const std::string scaled = std::string(inner) + "_s";
      EXPECT_EQ(encode(scaled, KvRole::key, &qkn), encode(scaled, KvRole::key, &full));
      EXPECT_NE(encode(scaled, KvRole::key, &qkn), encode(inner, KvRole::key, nullptr));  // the keys are scaled
      EXPECT_EQ(encode(scaled, KvRole::value, &qkn), encode(inner, KvRole::value, nullptr));
      EXPECT_NE(encode(scaled, KvRole::value, &full), encode(inner, KvRole::value, nullptr));
      EXPECT_EQ(make(scaled, KvRole::value, d, &qkn)->info().transforms_output,
                make(inner, KvRole::value, d, nullptr)->info().transforms_output);
    }
  auto expect_error = [&](const char* name, KvRole role, const nlohmann::json* calib, const char* needle) {
    try {
      make(name, role, d, calib);
      ADD_FAILURE() << name << " accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error("tq3_cs", KvRole::key, &qkn, "--kv-scales qk-norm holds only");
  expect_error("q4_0h_c", KvRole::value, &qkn, "kvq calibrate");
  expect_error("int8_static", KvRole::key, &qkn, "--kv-scales qk-norm holds only");
  expect_error("tq3_s", KvRole::key, nullptr, "--kv-scales qk-norm");  // named as the other way to get key scales
}

// RoPE moves energy between the two channels of a rotated pair with position, so key scales
// measured per channel at one range of positions would be wrong at another. With the layer's
// RoPE known, one scale per pair makes the score error the same at every rotation angle; the
// per-channel scales (a codec told of no RoPE) are shown to need it.
TEST(Scaled, KeyScalesHoldAtEveryRopePosition) {
  const int d = 128, n = 256;
  for (bool neox : {false, true}) {
    // Calibration measured where low-frequency pairs have not turned: the first channel of
    // every fourth pair carries a large key, its partner little; the query is flat.
    auto pair_of = [&](int i) {
      return neox ? std::pair<int, int>{i, i + d / 2} : std::pair<int, int>{2 * i, 2 * i + 1};
    };
    ScaledCalib sc;
    sc.km = sc.vm = std::vector<std::vector<float>>(kHeads, std::vector<float>(size_t(d), 0.f));
    sc.kr = sc.qr = sc.vr = std::vector<std::vector<float>>(kHeads, std::vector<float>(size_t(d), 1.f));
    for (int h = 0; h < kHeads; ++h)
      for (int i = 0; i < d / 2; i += 4) {
        sc.kr[size_t(h)][size_t(pair_of(i).first)] = 20.f;
        sc.kr[size_t(h)][size_t(pair_of(i).second)] = 0.2f;
      }
    const nlohmann::json calib = sc.json();
    std::mt19937 rng(71);
    std::normal_distribution<float> g(0.f, 1.f);
    const std::vector<float> k = keys_like(sc, n, rng);
    std::vector<float> q(d);
    for (auto& x : q) x = g(rng);
    // The same keys and query a quarter turn later: every pair rotated by 90 degrees.
    auto turn = [&](std::vector<float> x) {
      for (size_t r = 0; r < x.size() / size_t(d); ++r)
        for (int i = 0; i < d / 2; ++i) {
          const auto [a, b] = pair_of(i);
          float& xa = x[r * size_t(d) + size_t(a)];
          float& xb = x[r * size_t(d) + size_t(b)];
          const float t = xa;
          xa = -xb;
          xb = t;
        }
      return x;
    };
    const auto k90 = turn(k), q90 = turn(q);
    auto codec = [&](int n_rot) {
      KvRope rope;
      rope.n_rot = n_rot;
      rope.neox = neox;
      return make("tq3_s", KvRole::key, d, &calib, rope);
    };
    for (int n_rot : {d, 0}) {
      auto c = codec(n_rot);
      const double e0 = test::score_rms_error(*c, k, q, n), e90 = test::score_rms_error(*c, k90, q90, n);
      std::printf("[scaled] %s RoPE, n_rot %d: score rms error %.3f at 0 degrees, %.3f at 90\n", neox ? "neox" : "norm",
                  n_rot, e0, e90);
      if (n_rot > 0) {
        EXPECT_LT(e90, 1.25 * e0) << "neox " << neox;
        EXPECT_LT(e0, 1.25 * e90) << "neox " << neox;
      } else {
        EXPECT_GT(e90, 2 * e0) << "neox " << neox;  // per-channel scales: right at 0 degrees only
      }
    }
  }
}

// A key channel that queries never read (rms(q) = 0: a dead channel) gets the largest scale, so
// its keys shrink: dividing by a tiny scale instead would blow it up and swamp the others.
TEST(Scaled, KeyChannelsQueriesNeverReadShrink) {
  const int d = 128, n = 256;
  ScaledCalib sc = make_scaled_calib(d, 81);
  for (int h = 0; h < kHeads; ++h)
    for (int c : {6, 7, 40, 41}) {  // two whole pairs of adjacent-pair RoPE: unread per channel and per pair
      sc.qr[size_t(h)][size_t(c)] = 0.f;
      sc.kr[size_t(h)][size_t(c)] = std::fabs(sc.km[size_t(h)][size_t(c)]) + 8.f;
    }
  const nlohmann::json calib = sc.json();
  std::mt19937 rng(83);
  std::normal_distribution<float> g(0.f, 1.f);
  const std::vector<float> k = keys_like(sc, n, rng);
  std::vector<float> q(d);
  for (int c = 0; c < d; ++c) q[size_t(c)] = g(rng) * sc.qr[0][size_t(c)];
  for (int n_rot : {0, d}) {
    KvRope rope;
    rope.n_rot = n_rot;
    const double plain = test::score_rms_error(*make("q4_0h", KvRole::key, d, nullptr), k, q, n);
    const double scaled = test::score_rms_error(*make("q4_0h_s", KvRole::key, d, &calib, rope), k, q, n);
    std::printf("[scaled] unread channels, n_rot %d: score rms error %.4f, scaled %.4f\n", n_rot, plain, scaled);
    EXPECT_LT(scaled, plain) << "n_rot " << n_rot;
  }
}
