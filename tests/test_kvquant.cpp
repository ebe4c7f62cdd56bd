// KVQuant-style keys: pre-RoPE per-channel nuq with dense-and-sparse outliers and an exact sink.
// Checks the properties the method rests on (pre-RoPE beats post-RoPE on outlier channels,
// outliers kept exact reduce error, fitted codebooks beat uniform levels, the sink is exact),
// RoPE-after-dequantization, kernel parity on every CPU level, sizes and validation.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "attn/attention.h"
#include "core/aligned.h"
#include "core/cpu.h"
#include "core/dtypes.h"
#include "core/error.h"
#include "kv/kivi.h"
#include "kv/kvquant.h"
#include "kvq/kv_format.h"
#include "kivi_int_dot_bound.h"
#include "kv_test_util.h"

using namespace kvq;

namespace {

using test::gaussian;

// Independent RoPE reference: angle computed directly in double per (position, pair).
void rope_ref(const KvRope& r, int pos, float* x) {
  const int half = r.n_rot / 2;
  for (int i = 0; i < half; ++i) {
    const double a = double(pos) * r.freq_scale * std::pow(double(r.freq_base), -2.0 * i / r.n_rot);
    const int ia = r.neox ? i : 2 * i, ib = r.neox ? i + half : 2 * i + 1;
    const double x0 = x[ia], x1 = x[ib];
    x[ia] = float(x0 * std::cos(a) - x1 * std::sin(a));
    x[ib] = float(x0 * std::sin(a) + x1 * std::cos(a));
  }
}

std::vector<float> encode_decode(const KvCodec& c, const std::vector<float>& x, int bt, int pos0) {
  const int d = c.head_dim();
  std::vector<uint8_t> block(c.block_bytes(bt));
  c.encode(0, x.data(), d, bt, block.data(), bt, 0, pos0);
  std::vector<float> y(x.size());
  c.decode(0, block.data(), bt, 0, bt, pos0, y.data());
  return y;
}

double mse(const std::vector<float>& a, const std::vector<float>& b, int skip_rows = 0, int d = 1) {
  double e = 0;
  for (size_t i = size_t(skip_rows) * d; i < a.size(); ++i) e += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
  return e / double(a.size() - size_t(skip_rows) * d);
}

using test::levels;

KvRope llama_rope(int n_rot, bool neox = false) {
  KvRope r;
  r.n_rot = n_rot;
  r.freq_base = 10000.f;
  r.neox = neox;
  return r;
}

}  // namespace

TEST(Kvquant, RegisteredCodecsAndFormats) {
  for (int b : {2, 3, 4}) {
    const auto& f = kv_format_find("kvquant" + std::to_string(b));
    EXPECT_EQ(f.k_codec, "kvquant" + std::to_string(b) + "_k");
    KvCodecParams p;
    p.head_dim = 128;
    p.rope = llama_rope(128);
    auto k = kv_codec_create(f.k_codec, p);
    auto v = kv_codec_create(f.v_codec, p);
    EXPECT_TRUE(k->info().pre_rope);
    EXPECT_FALSE(v->info().pre_rope);
    // K and V of a token leave the full-precision tail together.
    EXPECT_EQ(k->info().group_tokens, v->info().group_tokens);
    EXPECT_EQ(k->info().residual_tokens, v->info().residual_tokens);
    EXPECT_EQ(k->info().code_bits, b);
  }
}

// Bytes: sink rows + per group (2 f16 per channel + codes + k outliers x (f16 + u8)).
TEST(Kvquant, BlockBytesCountEverything) {
  for (int b : {2, 3, 4})
    for (int d : {64, 128, 256})
      for (int s : {0, 1, 4}) {
        KvquantKeyConfig c;
        c.bits = b;
        c.head_dim = d;
        c.sink_tokens = s;
        auto k = kvquant_key_codec_create(c);
        const int kk = int(std::ceil(0.01 * d));
        for (int bt : {32, 128, 256}) {
          const size_t expect = size_t(s) * d * 2 + size_t(bt / 32) * (size_t(d) * 4 + 32 * (size_t(b) * d / 8 + 3 * kk));
          ASSERT_EQ(k->block_bytes(bt), expect);
          std::vector<uint8_t> buf(expect + 32, 0x5a);
          auto x = gaussian(bt, d, 1);
          k->encode(0, x.data(), d, bt, buf.data(), bt, 0, 0);
          for (size_t i = expect; i < buf.size(); ++i) ASSERT_EQ(buf[i], 0x5a);
          EXPECT_DOUBLE_EQ(kv_codec_effective_bits(*k, bt, 0), 8.0 * double(expect) / (double(bt) * d));
        }
      }
  // The defaults at head_dim 128, 128-token pages: 3 + 1 (scales) + 0.375 (2 outliers) + 0.125 (sink).
  KvCodecParams p;
  p.head_dim = 128;
  auto k3 = kv_codec_create("kvquant3_k", p);
  EXPECT_DOUBLE_EQ(kv_codec_effective_bits(*k3, 128, 0), 4.5);
}

// --kv-outliers / --kv-sink-tokens reach the registered codec through KvCodecParams: its size
// follows k = ceil(fraction * head_dim) and S, and out-of-range values are refused.
TEST(Kvquant, OutlierFractionAndSinkFromParams) {
  KvCodecParams p;
  p.head_dim = 64;
  auto bytes = [&](double frac, int sink) {
    p.outlier_fraction = frac;
    p.sink_tokens = sink;
    return kv_codec_create("kvquant4_k", p)->block_bytes(64);
  };
  const size_t groups = 64 / 32;
  // default: k = ceil(0.64) = 1, S = 1
  EXPECT_EQ(bytes(-1, -1), size_t(1) * 64 * 2 + groups * (64 * 4 + 32 * (4 * 64 / 8 + 3 * 1)));
  EXPECT_EQ(bytes(0.05, -1), size_t(1) * 64 * 2 + groups * (64 * 4 + 32 * (4 * 64 / 8 + 3 * 4)));  // k = 4
  EXPECT_EQ(bytes(0, 4), size_t(4) * 64 * 2 + groups * (64 * 4 + 32 * (4 * 64 / 8)));  // k = 0, S = 4
  p.outlier_fraction = 0.2;
  p.sink_tokens = -1;
  EXPECT_THROW(kv_codec_create("kvquant4_k", p), Error);
  p.outlier_fraction = -1;
  p.sink_tokens = 2000;
  EXPECT_THROW(kv_codec_create("kvquant4_k", p), Error);
  // More outliers kept exact: smaller error on keys with many spiky channels.
  p.sink_tokens = -1;
  std::mt19937_64 rng(9);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> x(size_t(64) * 64);
  for (size_t i = 0; i < x.size(); ++i) x[i] = nd(rng) * ((i * 7 + i / 64) % 23 == 0 ? 40.f : 1.f);
  p.outlier_fraction = -1;
  auto y1 = encode_decode(*kv_codec_create("kvquant4_k", p), x, 64, 64);
  p.outlier_fraction = 0.0625;
  auto y4 = encode_decode(*kv_codec_create("kvquant4_k", p), x, 64, 64);
  EXPECT_LT(mse(x, y4), 0.7 * mse(x, y1));
}

TEST(Kvquant, SinkTokenIsExact) {
  const int d = 64, bt = 32;
  auto x = gaussian(bt, d, 2);
  for (int c = 0; c < d; ++c) x[c] = 300.f + float(c);  // a huge first token, f16-exact
  for (int n_rot : {0, 64}) {
    KvquantKeyConfig cfg;
    cfg.head_dim = d;
    cfg.rope = llama_rope(n_rot);
    auto k = kvquant_key_codec_create(cfg);
    auto y = encode_decode(*k, x, bt, 0);
    std::vector<float> want(x.begin(), x.begin() + d);
    rope_ref(cfg.rope, 0, want.data());
    for (int c = 0; c < d; ++c) ASSERT_EQ(y[c], want[c]);
    // The sink does not widen the other tokens' channel ranges.
    cfg.sink_tokens = 0;
    auto k0 = kvquant_key_codec_create(cfg);
    auto y0 = encode_decode(*k0, x, bt, 0);
    std::vector<float> xr = x;
    for (int t = 0; t < bt; ++t) rope_ref(cfg.rope, t, xr.data() + size_t(t) * d);
    EXPECT_LT(mse(xr, y, 1, d), 0.2 * mse(xr, y0, 1, d));
    // The same block further into the sequence has no sink: position, not slot, decides.
    auto y_far = encode_decode(*k, x, bt, 64);
    EXPECT_NE(y_far[0], x[0]);
  }
}

TEST(Kvquant, RopeAfterDequantEqualsRopeOfDequantized) {
  const int d = 128, bt = 64;
  auto x = gaussian(bt, d, 3);
  for (bool neox : {false, true})
    for (int n_rot : {128, 64}) {
      for (int pos0 : {0, 4096, 1000000}) {
        KvquantKeyConfig plain;
        plain.head_dim = d;
        plain.rope.n_rot = 0;
        KvquantKeyConfig roped = plain;
        roped.rope = llama_rope(n_rot, neox);
        roped.rope.freq_scale = 0.5f;
        auto a = encode_decode(*kvquant_key_codec_create(plain), x, bt, pos0);
        auto b = encode_decode(*kvquant_key_codec_create(roped), x, bt, pos0);
        for (int t = 0; t < bt; ++t) {
          float* row = a.data() + size_t(t) * d;
          rope_ref(roped.rope, pos0 + t, row);
          for (int c = 0; c < d; ++c) ASSERT_NEAR(b[size_t(t) * d + c], row[c], 2e-5f * (1 + std::fabs(row[c])));
          for (int c = n_rot; c < d; ++c) ASSERT_EQ(b[size_t(t) * d + c], row[c]);  // unrotated dims
        }
        // kv_rope_apply (what the engine uses for q and the tail) agrees with the reference.
        std::vector<float> r1(x.begin(), x.begin() + d), r2 = r1;
        kv_rope_apply(roped.rope, pos0 + 7, r1.data(), d);
        rope_ref(roped.rope, pos0 + 7, r2.data());
        for (int c = 0; c < d; ++c) ASSERT_NEAR(r1[c], r2[c], 1e-5f);
      }
    }
}

// Keys whose outlier channels carry a large, slowly varying magnitude: before RoPE a channel's
// range over a group is narrow; RoPE rotates the outlier into its pair partner with a
// position-dependent angle, so after RoPE both channels of the pair swing over the full range.
TEST(Kvquant, PreRopeBeatsPostRopeOnOutlierChannels) {
  const int d = 128, bt = 128;
  auto x = gaussian(bt, d, 4);
  for (int t = 0; t < bt; ++t)
    for (int c : {2, 10, 30, 31, 50})  // pairs (2,3), (10,11), (30,31), (50,51): fast-turning
      x[size_t(t) * d + c] = 25.f + 2.f * x[size_t(t) * d + c];
  const KvRope rope = llama_rope(d);
  std::vector<float> post = x;
  for (int t = 0; t < bt; ++t) rope_ref(rope, 100 + t, post.data() + size_t(t) * d);
  for (int bits : {2, 3, 4}) {
    KvquantKeyConfig pre_cfg;
    pre_cfg.bits = bits;
    pre_cfg.head_dim = d;
    pre_cfg.rope = rope;
    pre_cfg.sink_tokens = 0;
    KvquantKeyConfig post_cfg = pre_cfg;
    post_cfg.rope.n_rot = 0;  // plain per-channel quantization of the rotated keys
    const double e_pre = mse(post, encode_decode(*kvquant_key_codec_create(pre_cfg), x, bt, 100));
    const double e_post = mse(post, encode_decode(*kvquant_key_codec_create(post_cfg), post, bt, 100));
    std::printf("bits %d: key mse pre-RoPE %.4g, post-RoPE %.4g\n", bits, e_pre, e_post);
    EXPECT_LT(e_pre, 0.6 * e_post) << bits;
  }
}

TEST(Kvquant, DenseAndSparseReducesErrorOnOutliers) {
  const int d = 128, bt = 128;
  auto x = gaussian(bt, d, 5);
  std::mt19937_64 rng(6);
  std::uniform_int_distribution<int> ch(0, d - 1);
  for (int t = 0; t < bt; ++t) x[size_t(t) * d + ch(rng)] *= 40.f;  // one spike per token
  for (int bits : {2, 3, 4}) {
    KvquantKeyConfig dense;
    dense.bits = bits;
    dense.head_dim = d;
    dense.sink_tokens = 0;
    dense.outliers_per_token = 0;
    KvquantKeyConfig sparse = dense;
    sparse.outliers_per_token = -1;  // default: ceil(1% of 128) = 2
    const double e_dense = mse(x, encode_decode(*kvquant_key_codec_create(dense), x, bt, 0));
    const double e_sparse = mse(x, encode_decode(*kvquant_key_codec_create(sparse), x, bt, 0));
    std::printf("bits %d: mse dense-only %.4g, dense-and-sparse %.4g\n", bits, e_dense, e_sparse);
    EXPECT_LT(e_sparse, 0.5 * e_dense) << bits;
  }
}

TEST(Kvquant, FittedCodebookBeatsUniformLevels) {
  const int d = 128, n = 512;
  auto x = gaussian(n, d, 8);
  for (int bits : {2, 3, 4}) {
    const auto art = kvquant_fit(x.data(), n / 2, 2, d, bits);  // the same data as (256, 2 heads)
    const auto& a = art.at("kvquant_k" + std::to_string(bits));
    auto cb = a.at("codebook").get<std::vector<float>>();
    ASSERT_EQ(cb.size(), size_t(1) << bits);
    for (size_t i = 1; i < cb.size(); ++i) ASSERT_GT(cb[i], cb[i - 1]);
    EXPECT_GT(a.at("n_samples").get<size_t>(), size_t(n) * d * 9 / 10);
    KvquantKeyConfig fitted;
    fitted.bits = bits;
    fitted.head_dim = d;
    fitted.codebook = cb;
    fitted.sink_tokens = 0;
    KvquantKeyConfig uniform = fitted;
    uniform.codebook.clear();
    for (int j = 0; j < (1 << bits); ++j) uniform.codebook.push_back(-1.f + 2.f * j / float((1 << bits) - 1));
    auto test = gaussian(256, d, 9);
    const double e_fit = mse(test, encode_decode(*kvquant_key_codec_create(fitted), test, 256, 0));
    const double e_uni = mse(test, encode_decode(*kvquant_key_codec_create(uniform), test, 256, 0));
    std::printf("bits %d: codebook mse %.4g (normalized %.4g), uniform levels %.4g\n", bits, e_fit,
                a.at("mse").get<double>(), e_uni);
    EXPECT_LT(e_fit, e_uni) << bits;
  }
}

TEST(Kvquant, CalibrationCodebookReachesTheCodec) {
  const int d = 64, bt = 64;
  std::vector<float> cb{-0.9f, -0.5f, -0.2f, -0.05f, 0.05f, 0.2f, 0.5f, 0.9f};
  nlohmann::json calib;
  calib["layers"] = nlohmann::json::array();
  calib["layers"].push_back({{"layer", 0}, {"kvquant_k3", {{"codebook", std::vector<float>(8, 0.f)}}}});
  calib["layers"].push_back({{"layer", 5}, {"kvquant_k3", {{"codebook", cb}}}});
  KvCodecParams p;
  p.head_dim = d;
  p.layer = 5;
  p.calib = &calib;
  auto via_registry = kv_codec_create("kvquant3_k", p);
  KvquantKeyConfig c;
  c.head_dim = d;
  c.codebook = cb;
  auto direct = kvquant_key_codec_create(c);
  auto x = gaussian(bt, d, 10);
  EXPECT_EQ(encode_decode(*via_registry, x, bt, 0), encode_decode(*direct, x, bt, 0));
  // Layer 0's codebook is malformed (not ascending): a clear error, not a crash.
  p.layer = 0;
  EXPECT_THROW(kv_codec_create("kvquant3_k", p), Error);
  // Without a calibration, the default codebook.
  p.layer = 3;
  p.calib = nullptr;
  c.codebook.clear();
  EXPECT_EQ(encode_decode(*kv_codec_create("kvquant3_k", p), x, bt, 0),
            encode_decode(*kvquant_key_codec_create(c), x, bt, 0));
  nlohmann::json bad = {{"layers", {{{"layer", 5}, {"kvquant_k3", {{"codebook", {0.1, 0.2}}}}}}}};
  p.calib = &bad;
  p.layer = 5;
  EXPECT_THROW(kv_codec_create("kvquant3_k", p), Error);
}

// The score kernel against an independent evaluation (decode the key, RoPE it by the table's
// angle in double, dot in double) and the SIMD variants against the scalar one, on random and
// adversarial codes / scales / outliers / queries: every bit pattern, outlier channels in both
// pair elements and past n_rot, zero and huge scales, odd n, n = 1, n_q 1..9, partial rotation.
TEST(Kvquant, ScoreKernelParityRandomAndAdversarial) {
  std::mt19937_64 rng(12);
  std::uniform_int_distribution<int> byte(0, 255);
  std::normal_distribution<float> nd;
  struct Shape {
    int d, n_rot;
    bool neox;
  };
  const Shape shapes[] = {{128, 128, false}, {128, 128, true}, {128, 96, false}, {128, 64, true}, {64, 64, false},
                          {256, 256, false}, {256, 128, true}, {128, 0, false},  {16, 16, false}, {48, 16, true},
                          {80, 32, false}};
  int case_no = 0;
  for (const Shape& sh : shapes)
    for (bool allow_lanes : {true, false})
    for (int bits : {2, 3, 4})
      for (int n : {1, 7, 16, 33})
        for (int n_q : {1, 3, 4, 9}) {
          ++case_no;
          const int d = sh.d, half = sh.n_rot / 2, k = 2 + case_no % 3;
          const size_t rb = bitplane_row_bytes(bits, d) + (case_no % 2) * 3;  // rows need not be packed
          std::vector<uint8_t> rows(rb * size_t(n));
          for (auto& b : rows) b = uint8_t(case_no % 5 == 0 ? 0xff : byte(rng));  // all-ones codes too
          float cb[16] = {};
          for (int j = 0; j < (1 << bits); ++j) cb[j] = -1.f + 2.f * j / float((1 << bits) - 1);
          std::vector<uint8_t> params(size_t(d) * 4);
          for (int c = 0; c < d; ++c) {
            const float sc = c % 9 == 0 ? 1e4f : (c % 5 == 0 ? 0.f : std::fabs(nd(rng)) * (c % 7 == 0 ? 1e-4f : 1.f));
            const float md = std::clamp(nd(rng) * (c % 11 == 0 ? 3e4f : 1.f), -6e4f, 6e4f);
            const f16_t h0 = f32_to_f16(sc), h1 = f32_to_f16(md);
            std::memcpy(params.data() + 2 * c, &h0, 2);
            std::memcpy(params.data() + 2 * (d + c), &h1, 2);
          }
          std::vector<uint8_t> ovals(size_t(n) * k * 2), oidx(size_t(n) * k);
          for (int t = 0; t < n; ++t)
            for (int j = 0; j < k; ++j) {
              // distinct channels per token: even, odd, beyond n_rot, the last one
              const int c = j == 0 ? (2 * t) % d : (j == 1 ? (2 * t + 3) % d : (j == 2 ? d - 1 : (5 * t + 7) % d));
              bool dup = false;
              for (int i = 0; i < j; ++i) dup |= oidx[size_t(t) * k + i] == c;
              oidx[size_t(t) * k + j] = uint8_t(dup ? (c + 1) % d : c);
              const f16_t h = f32_to_f16(j == 1 ? 6e4f : nd(rng) * 50);
              std::memcpy(ovals.data() + 2 * (size_t(t) * k + j), &h, 2);
            }
          std::vector<double> theta(static_cast<size_t>(half));
          for (int j = 0; j < half; ++j) theta[size_t(j)] = std::pow(10000.0, -2.0 * j / sh.n_rot);
          const KvquantScoreLayout lay = kvquant_layout(d, sh.n_rot, sh.neox, allow_lanes);
          ASSERT_EQ(lay.pair_j.size(), size_t(half));
          std::vector<float> rc(size_t(n) * std::max(half, 1)), rs(rc.size());
          for (int t = 0; t < n; ++t)
            for (int p = 0; p < half; ++p) {
              rc[size_t(t) * half + p] = float(std::cos(double(t) * theta[lay.pair_j[size_t(p)]]));
              rs[size_t(t) * half + p] = float(std::sin(double(t) * theta[lay.pair_j[size_t(p)]]));
            }
          auto q = gaussian(n_q, d, 13 + case_no);
          if (case_no % 4 == 0)
            for (auto& v : q) v *= 1e-6f;
          KvquantScoreArgs a{};
          a.rows = rows.data();
          a.row_bytes = rb;
          a.n = n;
          a.bits = bits;
          a.head_dim = d;
          a.codebook = cb;
          a.params = params.data();
          a.ovals = ovals.data();
          a.oidx = oidx.data();
          a.k = k;
          a.rot_c = rc.data();
          a.rot_s = rs.data();
          a.rot_stride = half;
          a.n_rot = sh.n_rot;
          a.layout = &lay;
          a.q = q.data();
          a.n_q = n_q;
          const int os = n + 3;
          std::vector<float> ref(size_t(n_q) * os, -7.f);
          kvquant_scores_scalar(a, ref.data(), os);
          // Independent evaluation in double from the format definition.
          std::vector<double> bound(size_t(n_q) * n);
          for (int t = 0; t < n; ++t) {
            std::vector<float> sc(d), md(d), key(d);
            for (int c = 0; c < d; ++c) {
              f16_t h0, h1;
              std::memcpy(&h0, params.data() + 2 * c, 2);
              std::memcpy(&h1, params.data() + 2 * (d + c), 2);
              sc[c] = f16_to_f32(h0);
              md[c] = f16_to_f32(h1);
            }
            for (int c = 0; c < d; ++c) key[c] = sc[c] * cb[bitplane_code(rows.data() + size_t(t) * rb, bits, d, c)] + md[c];
            for (int j = 0; j < k; ++j) {
              f16_t h;
              std::memcpy(&h, ovals.data() + 2 * (size_t(t) * k + j), 2);
              key[oidx[size_t(t) * k + j]] = f16_to_f32(h);
            }
            // RoPE in channel order, angles t * theta_j in double; the query read through slot.
            std::vector<double> kr(key.begin(), key.end());
            for (int j = 0; j < half; ++j) {
              const int ia = sh.neox ? j : 2 * j, ib = sh.neox ? j + half : 2 * j + 1;
              const double x0 = key[size_t(ia)], x1 = key[size_t(ib)];
              const double ang = double(t) * theta[size_t(j)];
              kr[size_t(ia)] = x0 * std::cos(ang) - x1 * std::sin(ang);
              kr[size_t(ib)] = x0 * std::sin(ang) + x1 * std::cos(ang);
            }
            for (int i = 0; i < n_q; ++i) {
              double r = 0, ra = 0;
              for (int c = 0; c < d; ++c) {
                const double qc = q[size_t(i) * d + lay.slot[size_t(c)]];
                r += qc * kr[size_t(c)];
                const int partner = c >= 2 * half ? -1 : (sh.neox ? (c < half ? c + half : c - half) : (c ^ 1));
                ra += std::fabs(qc) * (std::fabs(key[size_t(c)]) + (partner >= 0 ? std::fabs(key[size_t(partner)]) : 0));
              }
              bound[size_t(i) * n + t] = 8e-6 * ra + 1e-30;
              ASSERT_NEAR(ref[size_t(i) * os + t], r, bound[size_t(i) * n + t])
                  << "scalar d " << d << " n_rot " << sh.n_rot << " bits " << bits << " t " << t << " i " << i;
            }
          }
#if defined(KVQ_HAVE_SIMD)
          for (CpuLevel l : levels()) {
            if (l == CpuLevel::scalar) continue;
            std::vector<float> got(ref.size(), -7.f);
            (l == CpuLevel::avx2 ? kvquant_scores_avx2 : kvquant_scores_avx512)(a, got.data(), os);
            for (int i = 0; i < n_q; ++i)
              for (int t = 0; t < os; ++t) {
                if (t >= n) {  // past n: untouched
                  ASSERT_EQ(got[size_t(i) * os + t], -7.f);
                  continue;
                }
                ASSERT_NEAR(got[size_t(i) * os + t], ref[size_t(i) * os + t], 2 * bound[size_t(i) * n + t])
                    << cpu_level_name(l) << " d " << d << " n_rot " << sh.n_rot << " neox " << sh.neox << " bits "
                    << bits << " n " << n << " n_q " << n_q << " t " << t << " i " << i;
              }
          }
#endif
        }
}

// The query side of a run (turn by R(P)^T, permute into score order): AVX-512 equals the scalar
// reference for every layout (the halves layout takes the reference), with adversarial rows.
TEST(Kvquant, PrepQueryParity) {
#if !defined(KVQ_HAVE_SIMD)
  GTEST_SKIP() << "built without SIMD kernels";
#else
  const CpuLevel prev = cpu_set_level(CpuLevel::avx512);
  const CpuLevel top = cpu_level();
  cpu_set_level(prev);
  if (top < CpuLevel::avx2) GTEST_SKIP() << "no AVX2 on this machine";
  struct Shape {
    int d, n_rot;
    bool neox;
  };
  for (const Shape sh : {Shape{128, 128, false}, Shape{128, 128, true}, Shape{64, 64, false}, Shape{256, 128, true},
                         Shape{256, 192, false}, Shape{128, 0, false}, Shape{128, 96, false}, Shape{80, 32, true},
                         Shape{16, 16, true}, Shape{48, 32, false}})
    for (CpuLevel lev : {CpuLevel::avx2, CpuLevel::avx512}) {
      if (lev > top) continue;
      // Each level's kernel with the layout the codec picks for it (lanes on AVX-512 where it fits).
      const KvquantScoreLayout l = kvquant_layout(sh.d, sh.n_rot, sh.neox, lev == CpuLevel::avx512);
      const int half = sh.n_rot / 2, n_q = 5;
      auto q = gaussian(n_q, sh.d, 60 + sh.d + sh.n_rot);
      q[3] = 6e4f;
      for (int c = 0; c < sh.d; ++c) q[size_t(2 * sh.d + c)] *= 1e-30f;
      std::vector<float> c(static_cast<size_t>(std::max(half, 1))), s(c.size());
      for (int p = 0; p < half; ++p) {
        c[size_t(p)] = float(std::cos(0.37 * p + 1));
        s[size_t(p)] = float(std::sin(0.37 * p + 1));
      }
      std::vector<float> ref(q.size(), -1.f), got(q.size(), -2.f);
      kvquant_prep_scalar(q.data(), n_q, sh.d, sh.n_rot, l, c.data(), s.data(), ref.data());
      if (lev == CpuLevel::avx512)
        kvquant_prep_avx512(q.data(), n_q, sh.d, sh.n_rot, l, c.data(), s.data(), got.data());
      else
        kvquant_prep_avx2(q.data(), n_q, sh.d, sh.n_rot, l, c.data(), s.data(), got.data());
      for (size_t i = 0; i < q.size(); ++i)
        ASSERT_NEAR(got[i], ref[i], 1e-6f * (std::fabs(ref[i]) + std::fabs(q[i])) + 1e-38f)
            << cpu_level_name(lev) << " d " << sh.d << " n_rot " << sh.n_rot << " neox " << sh.neox << " i " << i;
    }
#endif
}

// cos/sin of the query's turn: the AVX-512 and AVX2 evaluations equal libm's rounded to f32 (at most one
// f32 ulp apart where libm's double lands next to a rounding boundary) at positions up to 2^27,
// for every frequency of a 128-dim head and odd pair counts.
TEST(Kvquant, SincosMatchesLibm) {
#if !defined(KVQ_HAVE_SIMD)
  GTEST_SKIP() << "built without SIMD kernels";
#else
  const CpuLevel prev = cpu_set_level(CpuLevel::avx512);
  const CpuLevel top = cpu_level();
  cpu_set_level(prev);
  if (top < CpuLevel::avx2) GTEST_SKIP() << "no AVX2 on this machine";
  for (int half : {1, 7, 8, 64, 128}) {
    std::vector<double> theta(static_cast<size_t>(half));
    for (int j = 0; j < half; ++j) theta[size_t(j)] = 0.5 * std::pow(500000.0, -2.0 * j / (2 * half)) * (j == 0 ? 2 : 1);
    for (long pos : {0L, 1L, 2L, 3L, 63L, 64L, 1000L, 100000L, 123456L, 1048575L, 33554432L, 134217727L}) {
      std::vector<float> c(static_cast<size_t>(half)), s(c), c2(c), s2(c);
      kvquant_sincos_scalar(pos, theta.data(), half, c.data(), s.data());
      for (CpuLevel lev : {CpuLevel::avx2, CpuLevel::avx512}) {
        if (lev > top) continue;
        (lev == CpuLevel::avx512 ? kvquant_sincos_avx512 : kvquant_sincos_avx2)(pos, theta.data(), half, c2.data(),
                                                                              s2.data());
        for (int j = 0; j < half; ++j) {
          ASSERT_NEAR(c2[size_t(j)], c[size_t(j)], 6e-8f) << cpu_level_name(lev) << " pos " << pos << " j " << j;
          ASSERT_NEAR(s2[size_t(j)], s[size_t(j)], 6e-8f) << cpu_level_name(lev) << " pos " << pos << " j " << j;
        }
      }
    }
  }
#endif
}

// Fused scores on every CPU level equal <q, decode(k)> (RoPE walked by recurrence vs computed
// directly), on random and adversarial keys, for spans that straddle groups and the sink.
TEST(Kvquant, ScoresMatchDecodeAllLevels) {
  const int d = 128, bt = 128, n_q = 4;
  std::vector<std::vector<float>> cases;
  cases.push_back(gaussian(bt, d, 14));
  auto outl = gaussian(bt, d, 15);
  for (int t = 0; t < bt; ++t) {
    outl[size_t(t) * d + 6] = 60.f;     // constant outlier channel
    outl[size_t(t) * d + 77] *= 500.f;  // huge channel
  }
  cases.push_back(outl);
  cases.push_back(std::vector<float>(size_t(bt) * d, 0.f));
  auto tiny = gaussian(bt, d, 16, 1e-5f);
  cases.push_back(tiny);
  auto huge = gaussian(bt, d, 17, 2e4f);
  for (float& v : huge) v = std::clamp(v, -65504.f, 65504.f);
  cases.push_back(huge);
  for (int bits : {2, 3, 4})
    for (bool neox : {false, true}) {
      KvquantKeyConfig cfg;
      cfg.bits = bits;
      cfg.head_dim = d;
      cfg.rope = llama_rope(96, neox);
      cfg.sink_tokens = 2;
      auto k = kvquant_key_codec_create(cfg);
      for (const auto& x : cases) {
        for (int pos0 : {0, 123456}) {
          std::vector<uint8_t> block(k->block_bytes(bt));
          k->encode(0, x.data(), d, bt, block.data(), bt, 0, pos0);
          std::vector<float> dec(size_t(bt) * d);
          k->decode(0, block.data(), bt, 0, bt, pos0, dec.data());
          auto q = gaussian(n_q, d, 18);
          const int t0 = 1, n = 100;
          for (CpuLevel l : levels()) {
            const CpuLevel prev = cpu_set_level(l);
            std::vector<float> s(size_t(n_q) * n);
            k->scores(0, q.data(), n_q, block.data(), bt, t0, n, pos0, s.data(), n);
            cpu_set_level(prev);
            for (int i = 0; i < n_q; ++i)
              for (int t = 0; t < n; ++t) {
                double r = 0, ra = 0;
                for (int c = 0; c < d; ++c) {
                  r += double(q[i * d + c]) * dec[size_t(t0 + t) * d + c];
                  ra += std::fabs(double(q[i * d + c]) * dec[size_t(t0 + t) * d + c]);
                }
                ASSERT_NEAR(s[i * n + t], r, 2e-5 * ra + 1e-30) << cpu_level_name(l) << " bits " << bits;
              }
          }
        }
      }
    }
}

TEST(Kvquant, BadParametersRejected) {
  KvquantKeyConfig c;
  c.bits = 1;
  EXPECT_THROW(kvquant_key_codec_create(c), Error);
  c.bits = 3;
  c.head_dim = 512;  // outlier channels are one byte
  EXPECT_THROW(kvquant_key_codec_create(c), Error);
  c.head_dim = 120;
  EXPECT_THROW(kvquant_key_codec_create(c), Error);
  c.head_dim = 128;
  c.rope.n_rot = 63;
  EXPECT_THROW(kvquant_key_codec_create(c), Error);
  c.rope.n_rot = 256;
  EXPECT_THROW(kvquant_key_codec_create(c), Error);
  c.rope.n_rot = 128;
  c.rope.freq_base = 0.f;
  EXPECT_THROW(kvquant_key_codec_create(c), Error);
  c.rope.freq_base = 10000.f;
  // RoPE frequency factors: one per rotated pair, finite and > 0 (a short list would be read past)
  c.rope.freq_factors = {1.0f};
  EXPECT_THROW(kvquant_key_codec_create(c), Error);
  c.rope.freq_factors.assign(64, 0.0f);
  EXPECT_THROW(kvquant_key_codec_create(c), Error);
  c.rope.freq_factors.assign(64, 2.0f);
  EXPECT_NO_THROW(kvquant_key_codec_create(c));
  c.rope.freq_factors.clear();
  c.outliers_per_token = 17;
  EXPECT_THROW(kvquant_key_codec_create(c), Error);
  c.outliers_per_token = -1;
  c.sink_tokens = -1;
  EXPECT_THROW(kvquant_key_codec_create(c), Error);
  c.sink_tokens = 1;
  c.codebook = {0.5f, -0.5f, 0.f, 1.f, 0.1f, 0.2f, 0.3f, 0.4f};
  EXPECT_THROW(kvquant_key_codec_create(c), Error);
  c.codebook = {-2.f, -0.5f, 0.f, 0.1f, 0.2f, 0.3f, 0.4f, 1.f};
  EXPECT_THROW(kvquant_key_codec_create(c), Error);
  c.codebook.clear();
  c.residual_tokens = 7;
  EXPECT_THROW(kvquant_key_codec_create(c), Error);
  c.residual_tokens = 0;
  auto k = kvquant_key_codec_create(c);
  EXPECT_THROW(k->block_bytes(48), Error);
  std::vector<float> x(64 * 128, 0.f);
  x[5] = NAN;
  EXPECT_THROW(kvquant_fit(x.data(), 64, 1, 128, 3), Error);
  EXPECT_THROW(kvquant_fit(x.data(), 16, 1, 128, 3), Error);  // fewer tokens than a group
  EXPECT_THROW(kvquant_fit(x.data(), 64, 1, 100, 3), Error);
  x[5] = 0.f;
  EXPECT_THROW(kvquant_fit(x.data(), 64, 1, 128, 3), Error);  // all-constant: nothing to fit
}

// A calibration that does not hold the codebook for the layer (fitted for other bit widths, or for
// another model: fewer layers, other heads or head_dim) is an error saying how to refit it, not a
// silent fallback to the default codebook; --kv-scales qk-norm's holds no codebooks and leaves the
// default.
TEST(Kvquant, CalibrationWithoutTheLayersCodebookRejected) {
  const int d = 64, H = 2;
  const std::vector<std::vector<float>> rms(size_t(H), std::vector<float>(size_t(d), 1.f));
  auto entry = [&](int layer, int bits) {
    return nlohmann::json{{"layer", layer},
                          {"k_rms", rms},
                          {"kvquant_k" + std::to_string(bits), {{"codebook", kvquant_default_codebook(bits)}}}};
  };
  KvCodecParams p;
  p.head_dim = d;
  p.n_kv_heads = H;
  p.rope = llama_rope(d);
  auto err = [&](const std::string& codec, const nlohmann::json& calib, int layer) {
    p.calib = &calib;
    p.layer = layer;
    try {
      kv_codec_create(codec, p);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const nlohmann::json two_layers = {{"layers", {entry(0, 4), entry(1, 4)}}};
  EXPECT_EQ(err("kvquant4_k", two_layers, 1), "no error");
  // fitted with --kvquant-bits 2 only
  const nlohmann::json bits2 = {{"layers", {entry(0, 2), entry(1, 2)}}};
  const std::string e4 = err("kvquant4_k", bits2, 0);
  EXPECT_NE(e4.find("kvquant_k4"), std::string::npos) << e4;
  EXPECT_NE(e4.find("kvq calibrate"), std::string::npos) << e4;
  EXPECT_NE(e4.find("--kvquant-bits 4"), std::string::npos) << e4;
  EXPECT_EQ(err("kvquant2_k", bits2, 1), "no error");
  // fewer layers than the model
  const std::string el = err("kvquant4_k", two_layers, 5);
  EXPECT_NE(el.find("has 2 layers, layer 5"), std::string::npos) << el;
  EXPECT_NE(el.find("kvq calibrate"), std::string::npos) << el;
  // another model's heads or head_dim
  p.n_kv_heads = 3;
  const std::string eh = err("kvquant4_k", two_layers, 0);
  EXPECT_NE(eh.find("another model"), std::string::npos) << eh;
  p.n_kv_heads = H;
  p.head_dim = 128;
  p.rope = llama_rope(128);
  EXPECT_NE(err("kvquant4_k", two_layers, 0).find("another model"), std::string::npos);
  p.head_dim = d;
  p.rope = llama_rope(d);
  // not a calibration at all
  EXPECT_NE(err("kvquant4_k", nlohmann::json::object(), 0).find("\"layers\""), std::string::npos);
  // qk-norm's statistics: no codebook to read, the default one
  const nlohmann::json qk = {{"source", "qk-norm"}, {"layers", {{{"layer", 0}, {"k_rms", rms}, {"q_rms", rms}}}}};
  EXPECT_EQ(err("kvquant4_k", qk, 0), "no error");
}

// ---------------------------------------------------------------- calibrated ranges (kvquant*_cal)

namespace {

// Per-head ranges that differ between heads and channels (a few wide, offset outlier channels).
void cal_ranges(int H, int d, std::vector<std::vector<float>>& mid, std::vector<std::vector<float>>& scale) {
  mid.assign(size_t(H), std::vector<float>(size_t(d)));
  scale = mid;
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < d; ++c) {
      mid[size_t(h)][size_t(c)] = (c % 13 == 5) ? 12.f * float(h + 1) : 0.1f * float((c + h) % 7) - 0.3f;
      scale[size_t(h)][size_t(c)] = (c % 13 == 5) ? 6.f : 1.f + 0.25f * float((3 * c + h) % 5);
    }
}

nlohmann::json cal_calib(int bits, const std::vector<std::vector<float>>& mid,
                         const std::vector<std::vector<float>>& scale) {
  return {{"layers", {{{"layer", 0}, {"kvquant_cal_k" + std::to_string(bits), kvquant_cal_artifact(mid, scale, bits)}}}}};
}

// Codec parameters of the calibrated codecs' tests: H heads of head_dim d, layer 0 of calib.
KvCodecParams cal_params(int d, int H, const KvRope& rope, const nlohmann::json& calib) {
  KvCodecParams p;
  p.head_dim = d;
  p.n_kv_heads = H;
  p.rope = rope;
  p.calib = &calib;
  return p;
}

// Keys drawn about the calibrated ranges: x = mid + 0.6 scale N(0, 1), with spikes.
std::vector<float> cal_keys(int n, int d, const std::vector<float>& mid, const std::vector<float>& scale, uint64_t seed) {
  auto x = gaussian(n, d, seed, 0.6f);
  for (int t = 0; t < n; ++t)
    for (int c = 0; c < d; ++c) {
      float& v = x[size_t(t) * d + c];
      v = mid[size_t(c)] + scale[size_t(c)] * v * ((t * 31 + c * 7) % 97 == 0 ? 20.f : 1.f);
    }
  return x;
}

}  // namespace

// Per-token codec: sink rows + codes + k outliers x (f16 + u8) per token, no group parameters;
// the bytes claimed are the bytes allocated and written.
TEST(KvquantCal, PerTokenBlocksHoldNoGroupParameters) {
  for (int b : {2, 3, 4})
    for (int d : {64, 128, 256}) {
      std::vector<std::vector<float>> mid, scale;
      cal_ranges(2, d, mid, scale);
      const nlohmann::json calib = cal_calib(b, mid, scale);
      const KvCodecParams p = cal_params(d, 2, llama_rope(d), calib);
      auto k = kv_codec_create("kvquant" + std::to_string(b) + "_cal_k", p);
      EXPECT_EQ(k->info().group_tokens, 1);
      EXPECT_EQ(k->info().residual_tokens, 0);
      EXPECT_TRUE(k->info().pre_rope);
      const int kk = int(std::ceil(0.01 * d - 1e-9));
      for (int bt : {16, 64, 256}) {
        const size_t expect = size_t(d) * 2 + size_t(bt) * (size_t(b) * d / 8 + 3 * kk);
        ASSERT_EQ(k->block_bytes(bt), expect);
        std::vector<uint8_t> buf(expect + 32, 0x5a);
        auto x = cal_keys(bt, d, mid[1], scale[1], 3);
        for (int t = 0; t < bt; ++t) k->encode(1, x.data() + size_t(t) * d, d, 1, buf.data(), bt, t, 0);
        for (size_t i = expect; i < buf.size(); ++i) ASSERT_EQ(buf[i], 0x5a);
        EXPECT_DOUBLE_EQ(kv_codec_effective_bits(*k, bt, 0), 8.0 * double(expect) / (double(bt) * d));
      }
    }
  // head_dim 64: 3 bits + 0.375 (one outlier) + the sink row amortized over a 256-token page.
  std::vector<std::vector<float>> mid, scale;
  cal_ranges(1, 64, mid, scale);
  const nlohmann::json calib = cal_calib(3, mid, scale);
  KvCodecParams p;
  p.head_dim = 64;
  p.calib = &calib;
  EXPECT_DOUBLE_EQ(kv_codec_effective_bits(*kv_codec_create("kvquant3_cal_k", p), 256, 0), 3.375 + 0.0625);
  EXPECT_EQ(kv_format_find("kvquant3_cal").k_codec, "kvquant3_cal_k");
  EXPECT_EQ(kv_format_find("kvquant3_cal").v_codec, "kvquant3_v");
}

// Decode is the calibrated range's level for every channel but the token's k farthest outside
// the range (relative to its width), which are exact to f16; then RoPE at the token's position.
// Tokens encoded one at a time, out of order, equal one call over the block.
TEST(KvquantCal, DecodeIsTheCalibratedLevelOrTheExactOutlier) {
  const int d = 128, H = 2, bt = 64;
  std::vector<std::vector<float>> mid, scale;
  cal_ranges(H, d, mid, scale);
  for (int b : {2, 3, 4}) {
    const nlohmann::json calib = cal_calib(b, mid, scale);
    for (int n_rot : {0, 128}) {
      const KvCodecParams p = cal_params(d, H, llama_rope(n_rot, true), calib);
      auto k = kv_codec_create("kvquant" + std::to_string(b) + "_cal_k", p);
      const std::vector<float>& cb = kvquant_default_codebook(b);
      for (int h = 0; h < H; ++h) {
        auto x = cal_keys(bt, d, mid[size_t(h)], scale[size_t(h)], 10 + h);
        const int pos0 = 100;
        std::vector<uint8_t> whole(k->block_bytes(bt)), single(k->block_bytes(bt));
        k->encode(h, x.data(), d, bt, whole.data(), bt, 0, pos0);
        for (int t = bt - 1; t >= 0; t -= 2) k->encode(h, x.data() + size_t(t) * d, d, 1, single.data(), bt, t, pos0);
        for (int t = 0; t < bt; t += 2) k->encode(h, x.data() + size_t(t) * d, d, 1, single.data(), bt, t, pos0);
        ASSERT_EQ(whole, single);
        std::vector<float> y(size_t(bt) * d);
        k->decode(h, whole.data(), bt, 0, bt, pos0, y.data());
        for (int t = 0; t < bt; ++t) {
          const float* xr = x.data() + size_t(t) * d;
          std::vector<float> want(static_cast<size_t>(d));
          std::vector<std::pair<float, int>> far;
          for (int c = 0; c < d; ++c) {
            const float s = f16_to_f32(f32_to_f16(scale[size_t(h)][size_t(c)]));
            const float m = f16_to_f32(f32_to_f16(mid[size_t(h)][size_t(c)]));
            const float u = (xr[c] - m) * (1.f / s);
            int best = 0;
            for (int j = 1; j < int(cb.size()); ++j)
              if (std::fabs(u - cb[size_t(j)]) < std::fabs(u - cb[size_t(best)])) best = j;
            want[size_t(c)] = s * cb[size_t(best)] + m;
            far.push_back({std::fabs(u), c});
          }
          std::sort(far.begin(), far.end(), [](auto& a, auto& b2) { return a.first > b2.first; });
          const int kk = int(std::ceil(0.01 * d - 1e-9));
          for (int j = 0; j < kk; ++j) want[size_t(far[size_t(j)].second)] = f16_to_f32(f32_to_f16(xr[far[size_t(j)].second]));
          rope_ref(p.rope, pos0 + t, want.data());
          for (int c = 0; c < d; ++c)
            ASSERT_NEAR(y[size_t(t) * d + c], want[size_t(c)], 2e-5f * (1 + std::fabs(want[size_t(c)])))
                << "bits " << b << " head " << h << " t " << t << " c " << c;
        }
      }
      // A head beyond the calibration is refused, not read out of bounds.
      std::vector<uint8_t> blk(k->block_bytes(bt));
      std::vector<float> x(size_t(d), 0.f);
      EXPECT_THROW(k->encode(H, x.data(), d, 1, blk.data(), bt, 0, 0), Error);
    }
  }
}

// The fused score kernel on the calibrated ranges, every CPU level, against decode-then-dot:
// sink inside the span, partial spans, GQA groups past the query chunk.
TEST(KvquantCal, ScoresMatchDecodeAllLevels) {
  const int d = 128, H = 2, bt = 128;
  std::vector<std::vector<float>> mid, scale;
  cal_ranges(H, d, mid, scale);
  for (int b : {2, 3, 4}) {
    const nlohmann::json calib = cal_calib(b, mid, scale);
    for (bool neox : {false, true}) {
      KvCodecParams p = cal_params(d, H, llama_rope(96, neox), calib);
      p.sink_tokens = 2;
      auto k = kv_codec_create("kvquant" + std::to_string(b) + "_cal_k", p);
      for (int pos0 : {0, 70000}) {
        const int h = 1;
        auto x = cal_keys(bt, d, mid[h], scale[h], 20 + b);
        std::vector<uint8_t> block(k->block_bytes(bt));
        k->encode(h, x.data(), d, bt, block.data(), bt, 0, pos0);
        std::vector<float> dec(size_t(bt) * d);
        k->decode(h, block.data(), bt, 0, bt, pos0, dec.data());
        for (int n_q : {1, 9}) {
          auto q = gaussian(n_q, d, 21);
          const int t0 = 1, n = 120;
          for (CpuLevel l : levels()) {
            const CpuLevel prev = cpu_set_level(l);
            auto kl = kv_codec_create("kvquant" + std::to_string(b) + "_cal_k", p);  // layout per level
            std::vector<float> s(size_t(n_q) * n);
            kl->scores(h, q.data(), n_q, block.data(), bt, t0, n, pos0, s.data(), n);
            cpu_set_level(prev);
            for (int i = 0; i < n_q; ++i)
              for (int t = 0; t < n; ++t) {
                double r = 0, ra = 0;
                for (int c = 0; c < d; ++c) {
                  r += double(q[size_t(i) * d + c]) * dec[size_t(t0 + t) * d + c];
                  ra += std::fabs(double(q[size_t(i) * d + c]) * dec[size_t(t0 + t) * d + c]);
                }
                ASSERT_NEAR(s[size_t(i) * n + t], r, 2e-5 * ra + 1e-30) << cpu_level_name(l) << " bits " << b;
              }
          }
        }
      }
    }
  }
}

// kvquant_fit_static on keys whose channels have their own offsets and widths: the fitted mids
// and half-widths follow each channel, the codebook is a proper one, and the codec built from the
// artifact (through the registry, as the engine builds it) quantizes held-out keys from the same
// distribution. Per-group ranges (kvquant<b>_k, G = 32) spend 1 bit per element at head_dim 64 on
// f16 scales and mids: at the same bytes the calibrated ranges get one more code bit, and a
// smaller error than the per-group ranges (what they are for on keys whose channel statistics
// hold, as pre-RoPE keys' do).
TEST(KvquantCal, FittedRangesFollowTheChannels) {
  const int d = 64, H = 2, n = 2048;
  std::vector<std::vector<float>> mid, scale;
  cal_ranges(H, d, mid, scale);
  auto draw = [&](uint64_t seed) {
    std::vector<float> x(size_t(n) * H * d);
    std::mt19937_64 rng(seed);
    std::normal_distribution<float> nd(0.f, 1.f);
    for (int t = 0; t < n; ++t)
      for (int h = 0; h < H; ++h)
        for (int c = 0; c < d; ++c)
          x[(size_t(t) * H + h) * d + c] = mid[size_t(h)][size_t(c)] + 0.3f * scale[size_t(h)][size_t(c)] * nd(rng);
    return x;
  };
  const auto train = draw(31), test = draw(32);
  double err_cal[5] = {}, err_dyn[5] = {};
  size_t bytes_cal[5] = {}, bytes_dyn[5] = {};
  for (int b : {2, 3, 4}) {
    const auto art = kvquant_fit_static(train.data(), n, H, d, b);
    const std::string key = "kvquant_cal_k" + std::to_string(b);
    ASSERT_TRUE(art.contains(key));
    const auto& a = art[key];
    const auto fm = a.at("mid").get<std::vector<std::vector<float>>>();
    const auto fs = a.at("scale").get<std::vector<std::vector<float>>>();
    ASSERT_EQ(fm.size(), size_t(H));
    for (int h = 0; h < H; ++h)
      for (int c = 0; c < d; ++c) {
        const float sd = 0.3f * scale[size_t(h)][size_t(c)];
        EXPECT_NEAR(fm[size_t(h)][size_t(c)], mid[size_t(h)][size_t(c)], sd) << h << " " << c;
        EXPECT_GT(fs[size_t(h)][size_t(c)], 2.0f * sd);  // the inliers span the bulk
        EXPECT_LT(fs[size_t(h)][size_t(c)], 4.5f * sd);  // 2048 Gaussian draws: about 3.5 sd
      }
    const auto cb = a.at("codebook").get<std::vector<float>>();
    ASSERT_EQ(cb.size(), size_t(1) << b);
    for (size_t i = 1; i < cb.size(); ++i) EXPECT_GT(cb[i], cb[i - 1]);
    // Relative error near the Lloyd-Max distortion of a Gaussian (0.1175, 0.03454, 0.009497).
    const double lm[] = {0, 0, 0.1175, 0.03454, 0.009497};
    const double rel = a.at("rel_mse").get<double>();
    EXPECT_GT(rel, 0.8 * lm[b]);
    EXPECT_LT(rel, 1.5 * lm[b]);

    nlohmann::json calib = {{"layers", {{{"layer", 0}, {key, a}}}}};
    KvCodecParams p;
    p.head_dim = d;
    p.n_kv_heads = H;
    p.calib = &calib;
    auto cal = kv_codec_create("kvquant" + std::to_string(b) + "_cal_k", p);
    p.calib = nullptr;  // the per-group codec with its default codebook
    auto dyn = kv_codec_create("kvquant" + std::to_string(b) + "_k", p);
    const int bt = 256;
    double e_cal = 0, e_dyn = 0, energy = 0;
    for (int h = 0; h < H; ++h) {
      std::vector<float> x(size_t(bt) * d);
      for (int t = 0; t < bt; ++t)
        std::memcpy(x.data() + size_t(t) * d, test.data() + (size_t(t) * H + h) * d, sizeof(float) * d);
      std::vector<uint8_t> bc(cal->block_bytes(bt)), bd(dyn->block_bytes(bt));
      cal->encode(h, x.data(), d, bt, bc.data(), bt, 0, 1);
      dyn->encode(h, x.data(), d, bt, bd.data(), bt, 0, 1);
      std::vector<float> yc(x.size()), yd(x.size());
      cal->decode(h, bc.data(), bt, 0, bt, 1, yc.data());
      dyn->decode(h, bd.data(), bt, 0, bt, 1, yd.data());
      for (size_t i = 0; i < x.size(); ++i) {
        const float m = mid[size_t(h)][i % d];
        e_cal += (double(x[i]) - yc[i]) * (double(x[i]) - yc[i]);
        e_dyn += (double(x[i]) - yd[i]) * (double(x[i]) - yd[i]);
        energy += (double(x[i]) - m) * (double(x[i]) - m);
      }
    }
    std::printf("bits %d: rel mse calibrated %.4g (fit %.4g), per-group %.4g; bytes %zu vs %zu\n", b,
                e_cal / energy, rel, e_dyn / energy, cal->block_bytes(bt), dyn->block_bytes(bt));
    err_cal[b] = e_cal / energy;
    err_dyn[b] = e_dyn / energy;
    bytes_cal[b] = cal->block_bytes(bt);
    bytes_dyn[b] = dyn->block_bytes(bt);
    EXPECT_LT(e_cal, 2.0 * e_dyn) << b;  // one code bit fewer than the group's side information
    EXPECT_LT(bytes_cal[b], bytes_dyn[b]);
  }
  for (int b : {2, 3}) {
    EXPECT_EQ(bytes_cal[b + 1], bytes_dyn[b]);
    EXPECT_LT(err_cal[b + 1], 0.6 * err_dyn[b]) << b;
  }
}

// Calibration text is cut into windows that each start at position 0, where the codec keeps the
// sink exact: those keys (often the most extreme of a sequence) are left out of the ranges.
TEST(KvquantCal, EachWindowsSinkIsLeftOutOfTheRanges) {
  const int d = 64, n = 1024, win = 256;
  auto x = gaussian(n, d, 41);
  for (int t = 0; t < n; t += win)
    for (int c = 0; c < d; ++c) x[size_t(t) * d + c] = 80.f;  // every window's first token
  auto width = [&](int window) {
    const auto a = kvquant_fit_static(x.data(), n, 1, d, 3, 1, -1, window).at("kvquant_cal_k3");
    const auto s = a.at("scale").get<std::vector<std::vector<float>>>()[0];
    return *std::max_element(s.begin(), s.end());
  };
  EXPECT_LT(width(win), 6.f);   // about 3.5 standard deviations
  EXPECT_GT(width(0), 30.f);    // one sequence: positions 256, 512, 768 are ordinary tokens
  EXPECT_THROW(kvquant_fit_static(x.data(), n, 1, d, 3, 1, -1, -5), Error);
  // The per-group codebook fit leaves the same positions out of its groups' statistics.
  auto samples = [&](int window) {
    return kvquant_fit(x.data(), n, 1, d, 3, 32, 1, -1, window).at("kvquant_k3").at("n_samples").get<size_t>();
  };
  const size_t k = size_t(std::ceil(0.01 * d - 1e-9));
  EXPECT_EQ(samples(0) - samples(win), size_t(n / win - 1) * (d - k));
  EXPECT_THROW(kvquant_fit(x.data(), n, 1, d, 3, 32, 1, -1, -1), Error);
}

// A channel that was constant in calibration (scale 0: e.g. dead channels whose keys are 0) is
// the first outlier of any token where it is not: kept exact, not flattened to the mid.
TEST(KvquantCal, ChannelConstantInCalibrationBecomesTheOutlier) {
  const int d = 64;
  std::vector<std::vector<float>> mid, scale;
  cal_ranges(1, d, mid, scale);
  scale[0][9] = 0.f;
  mid[0][9] = 0.f;
  const nlohmann::json calib = cal_calib(3, mid, scale);
  KvCodecParams p;
  p.head_dim = d;
  p.calib = &calib;
  auto k = kv_codec_create("kvquant3_cal_k", p);
  auto x = cal_keys(4, d, mid[0], scale[0], 50);
  for (int t = 0; t < 4; ++t) x[size_t(t) * d + 9] = 0.5f + float(t);
  auto y = encode_decode(*k, x, 4, 8);
  for (int t = 0; t < 4; ++t) EXPECT_EQ(y[size_t(t) * d + 9], x[size_t(t) * d + 9]) << t;
}

// Missing or malformed calibration is a clear error naming what is wrong.
TEST(KvquantCal, BadCalibrationRejected) {
  const int d = 64;
  std::vector<std::vector<float>> mid, scale;
  cal_ranges(2, d, mid, scale);
  KvCodecParams p;
  p.head_dim = d;
  p.n_kv_heads = 2;
  auto err = [&](const nlohmann::json* calib) {
    p.calib = calib;
    try {
      kv_codec_create("kvquant3_cal_k", p);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(err(nullptr).find("kvq calibrate"), std::string::npos);
  nlohmann::json no_entry = {{"layers", {{{"layer", 0}, {"k_scale", 1.0}}}}};
  EXPECT_NE(err(&no_entry).find("kvquant_cal_k3"), std::string::npos);
  nlohmann::json good = cal_calib(3, mid, scale);
  EXPECT_EQ(err(&good), "no error");
  p.n_kv_heads = 3;  // the model has more KV heads than the calibration
  EXPECT_NE(err(&good).find("3 heads"), std::string::npos);
  p.n_kv_heads = 2;
  p.head_dim = 128;
  EXPECT_NE(err(&good).find("128 numbers"), std::string::npos);
  p.head_dim = d;
  nlohmann::json bad = good;
  bad["layers"][0]["kvquant_cal_k3"]["scale"][1][4] = -1.0;
  EXPECT_NE(err(&bad).find("negative"), std::string::npos);
  // A head with no positive scale has no range at all (a channel constant in calibration, scale 0
  // alone, is fine: ChannelConstantInCalibrationBecomesTheOutlier).
  bad = good;
  bad["layers"][0]["kvquant_cal_k3"]["scale"][1] = std::vector<float>(size_t(d), 0.f);
  EXPECT_NE(err(&bad).find("must be positive and finite"), std::string::npos) << err(&bad);
  bad = good;
  bad["layers"][0]["kvquant_cal_k3"]["scale"] = std::vector<std::vector<float>>(2, std::vector<float>(size_t(d), 0.f));
  EXPECT_NE(err(&bad).find("head 0 is 0 in every channel"), std::string::npos) << err(&bad);
  // another model's layers
  p.layer = 1;
  EXPECT_NE(err(&good).find("has 1 layers, layer 1"), std::string::npos) << err(&good);
  p.layer = 0;
  bad = good;
  bad["layers"][0]["kvquant_cal_k3"]["mid"][0][0] = "x";
  EXPECT_NE(err(&bad).find("non-numeric"), std::string::npos);
  bad = good;
  bad["layers"][0]["kvquant_cal_k3"]["codebook"] = {0.5, 0.1};
  EXPECT_NE(err(&bad).find("codebook"), std::string::npos);
  std::vector<float> x(64 * 128, 0.f);
  x[3] = NAN;
  EXPECT_THROW(kvquant_fit_static(x.data(), 64, 1, 128, 3), Error);
  x[3] = 0.f;
  EXPECT_THROW(kvquant_fit_static(x.data(), 64, 1, 128, 3), Error);  // constant: nothing to fit
  EXPECT_THROW(kvquant_fit_static(x.data(), 8, 1, 128, 3), Error);   // too few tokens
  EXPECT_THROW(kvquant_fit_static(x.data(), 64, 1, 128, 5), Error);
}

// The grouped formats inside decode attention: fused attn_decode over several blocks (RoPE applied
// by the KVQuant keys at each block's positions) equals attn_decode_ref on every CPU level, with
// GQA groups larger than the KIVI score kernel's query chunk.
TEST(GroupedFormats, AttentionFusedMatchesReference) {
  const int d = 128, bt = 64, n_blocks = 3, n_tail = 9;
  // kivi2p / kivi4p: the planes kernels this bound is about (kivi2 / kivi4 store kivi2t's / kivi4t's
  // tiles at this shape, whose bounds test_attention checks).
  for (const char* fmt_name : {"kivi2p", "kivi4p", "kvquant2", "kvquant3", "kvquant4", "kvquant3.5", "kvquant2.25"}) {
    const KvFormatDesc& f = kv_format_find(fmt_name);
    KvCodecParams pk, pv;
    pk.head_dim = pv.head_dim = d;
    pk.rope = llama_rope(d, true);
    pv.role = KvRole::value;
    // The KVQuant formats' 2- and 4-bit values are kivi's value tiles at this shape, whose bound
    // test_attention checks (FusedMatchesReferenceForEveryFormatAndCpuLevel); here they are the
    // same quantization in bit planes (kivi2p_v / kivi4p_v, G = 32, R = 0), the bound below.
    std::string vname = f.v_codec;
    if (vname == "kvquant2_v" || vname == "kvquant4_v") {
      vname = vname == "kvquant2_v" ? "kivi2p_v" : "kivi4p_v";
      pv.group_tokens = 32;
      pv.residual_tokens = 0;
    }
    auto kc = kv_codec_create(f.k_codec, pk);
    auto vc = kv_codec_create(vname, pv);
    std::vector<std::vector<uint8_t>> kb(n_blocks), vb(n_blocks);
    std::vector<KvBlockSpan> spans;
    const bool int_keys = std::string(fmt_name).rfind("kivi", 0) == 0;
    std::vector<float> k_range;  // (n_blocks * bt / G, d): per-channel range of each key group
    float v_max = 0;
    for (int b = 0; b < n_blocks; ++b) {
      auto k = gaussian(bt, d, 30 + b);
      for (int t = 0; t < bt; ++t) k[size_t(t) * d + 5] += 15.f;
      auto v = gaussian(bt, d, 40 + b);
      for (float x : v) v_max = std::max(v_max, std::fabs(x));
      const int G = kc->info().group_tokens;
      for (int g0 = 0; g0 < bt; g0 += G)
        for (int c = 0; c < d; ++c) {
          float mn = INFINITY, mx = -INFINITY;
          for (int t = g0; t < g0 + G; ++t) {
            mn = std::min(mn, k[size_t(t) * d + c]);
            mx = std::max(mx, k[size_t(t) * d + c]);
          }
          k_range.push_back(mx - mn);
        }
      kb[b].resize(kc->block_bytes(bt));
      vb[b].resize(vc->block_bytes(bt));
      kc->encode(0, k.data(), d, bt, kb[b].data(), bt, 0, b * bt);
      vc->encode(0, v.data(), d, bt, vb[b].data(), bt, 0, b * bt);
      KvBlockSpan s;
      s.k = kb[b].data();
      s.v = vb[b].data();
      s.block_tokens = bt;
      s.pos0 = b * bt;
      s.n = bt;
      spans.push_back(s);
    }
    auto tk = gaussian(n_tail, d, 50), tv = gaussian(n_tail, d, 51);
    for (float x : tv) v_max = std::max(v_max, std::fabs(x));
    for (int n_q : {1, 12}) {
      auto q = gaussian(n_q, d, 52);
      AttnParams ap;
      ap.scale = 1.f / std::sqrt(float(d));
      std::vector<float> ref(size_t(n_q) * d);
      attn_decode_ref(*kc, *vc, 0, q.data(), n_q, spans.data(), n_blocks, tk.data(), tv.data(), d, n_tail, ap,
                      ref.data());
      for (CpuLevel l : levels()) {
        const CpuLevel prev = cpu_set_level(l);
        std::vector<float> out(ref.size());
        AlignedBuf<float> scratch(attn_scratch_floats(*kc, *vc, n_q, bt));
        attn_decode(*kc, *vc, 0, q.data(), n_q, spans.data(), n_blocks, tk.data(), tv.data(), d, n_tail, ap,
                    out.data(), scratch.data());
        cpu_set_level(prev);
        for (int i = 0; i < n_q; ++i) {
          // KIVI keys on AVX-512 round each group's folded query q * scale to int16 steps of
          // max|q * scale| / 32767 (kivi_avx512.cpp): a score moves by at most half a step per
          // channel times the code, delta <= max_c |q_c| scale_c (2^b - 1) d / 65534 with
          // scale_c (2^b - 1) <= the channel's range over the group (f16-rounded up: * 1.001).
          // Softmax weights then change by factors within exp(+-scale delta), so the output moves
          // by at most (exp(2 scale delta) - 1) * max |v - out| <= (exp(2 scale delta) - 1) 2 max|v|.
          double delta = 0;
          if (int_keys && l == CpuLevel::avx512)
            for (size_t g = 0; g < k_range.size() / d; ++g)
              for (int c = 0; c < d; ++c)
                delta = std::max(delta, std::fabs(double(q[size_t(i) * d + c])) * k_range[g * d + c] * 1.001 *
                                            d / 65534.0);
          double tol = 2e-5 + std::expm1(2 * double(ap.scale) * delta) * 2 * (v_max + 1);
          if (l == CpuLevel::avx512) tol += test::kivi_int_values_attn_bound(n_blocks * bt, v_max + 1);
          for (int c = 0; c < d; ++c)
            ASSERT_NEAR(out[size_t(i) * d + c], ref[size_t(i) * d + c], tol)
                << fmt_name << " n_q " << n_q << " " << cpu_level_name(l);
        }
      }
    }
  }
}
