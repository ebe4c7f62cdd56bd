// Mixed-precision KVQuant keys (kv/kvquant_mixed.h): each head's RoPE pairs split between two code
// widths. Checks that every channel is quantized exactly as the plain KVQuant codec of its width
// quantizes it (per-channel quantization is channel-independent without outliers), that the wide
// pairs are the heaviest ones, scores against decode on every CPU level with per-head splits,
// the sizes, the calibration weights, the gain over uniform widths at the same bits, and
// validation.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/cpu.h"
#include "core/error.h"
#include "kv/kvquant.h"
#include "kv/kvquant_mixed.h"
#include "kvq/kv_format.h"
#include "kv_test_util.h"

using namespace kvq;

namespace {

using test::gaussian;
using test::levels;

KvRope rope(int n_rot, bool neox) {
  KvRope r;
  r.n_rot = n_rot;
  r.freq_base = 10000.f;
  r.neox = neox;
  return r;
}

KvquantMixedConfig mixed(int d, int heads, const KvRope& r, int hi_pairs, int lo_bits = 3) {
  KvquantMixedConfig c;
  c.head_dim = d;
  c.n_kv_heads = heads;
  c.rope = r;
  c.bits = {lo_bits + 1, lo_bits};
  c.pairs = {hi_pairs, d / 2 - hi_pairs};
  return c;
}

// Keys (n, heads, d) whose pair j of head h has standard deviation scale[h][j] in both channels.
std::vector<float> keys_with_pair_scales(int n, int heads, int d, const KvRope& r,
                                         const std::vector<std::vector<float>>& scale, uint64_t seed) {
  auto x = gaussian(n, heads * d, seed);
  const auto pairs = kv_rope_pairs(r, d);
  for (int t = 0; t < n; ++t)
    for (int h = 0; h < heads; ++h)
      for (size_t j = 0; j < pairs.size(); ++j) {
        x[size_t(t) * heads * d + size_t(h) * d + pairs[j].a] *= scale[size_t(h)][j];
        x[size_t(t) * heads * d + size_t(h) * d + pairs[j].b] *= scale[size_t(h)][j];
      }
  return x;
}

}  // namespace

TEST(KvquantMixed, RegisteredWithTheirBits) {
  struct Want {
    const char* name;
    double bits;
    const char* v;
  };
  for (const Want& w : {Want{"kvquant2.25", 2.25, "kvquant2_v"}, Want{"kvquant2.5", 2.5, "kvquant3_v"},
                        Want{"kvquant2.75", 2.75, "kvquant3_v"}, Want{"kvquant3.25", 3.25, "kvquant3_v"},
                        Want{"kvquant3.5", 3.5, "kvquant4_v"}, Want{"kvquant3.75", 3.75, "kvquant4_v"}}) {
    const KvFormatDesc& f = kv_format_find(w.name);
    EXPECT_EQ(f.k_codec, std::string(w.name) + "_k");
    EXPECT_EQ(f.v_codec, w.v);
    for (int d : {64, 128, 256}) {
      KvCodecParams p;
      p.head_dim = d;
      p.n_kv_heads = 2;
      p.rope = rope(d, false);
      auto k = kv_codec_create(f.k_codec, p);
      EXPECT_DOUBLE_EQ(k->info().code_bits, w.bits) << w.name << " d " << d;
      EXPECT_TRUE(k->info().pre_rope);
      auto v = kv_codec_create(f.v_codec, p);
      EXPECT_EQ(k->info().group_tokens, v->info().group_tokens);
      EXPECT_EQ(k->info().residual_tokens, v->info().residual_tokens);
    }
  }
}

// Bytes: per part, sink rows + per group (2 f16 per channel + codes + outliers); the outliers
// (k = ceil(1% of head_dim)) only in the narrow part. What encode writes stays inside.
TEST(KvquantMixed, BlockBytesCountEverything) {
  for (int d : {64, 128, 256})
    for (int q : {1, 2, 3}) {
      const int hp = d / 8 * q, lp = d / 2 - hp;
      KvquantMixedConfig c = mixed(d, 1, rope(d, false), hp);
      c.sink_tokens = 1;
      auto k = kvquant_mixed_key_codec_create(c);
      const int kk = int(std::ceil(0.01 * d));
      for (int bt : {32, 128}) {
        const size_t hi = size_t(2 * hp) * 2 + size_t(bt / 32) * (size_t(2 * hp) * 4 + 32 * (4 * size_t(2 * hp) / 8));
        const size_t lo = size_t(2 * lp) * 2 + size_t(bt / 32) * (size_t(2 * lp) * 4 + 32 * (3 * size_t(2 * lp) / 8 + 3 * kk));
        ASSERT_EQ(k->block_bytes(bt), hi + lo);
        std::vector<uint8_t> buf(hi + lo + 32, 0x5a);
        auto x = gaussian(bt, d, 1);
        k->encode(0, x.data(), d, bt, buf.data(), bt, 0, 0);
        for (size_t i = hi + lo; i < buf.size(); ++i) ASSERT_EQ(buf[i], 0x5a);
        EXPECT_DOUBLE_EQ(kv_codec_effective_bits(*k, bt, 0), 8.0 * double(hi + lo) / (double(bt) * d));
      }
    }
}

// The heaviest pairs of each head get the wide codes; without weights, the lowest rates (the
// unrotated channels' pairs first).
TEST(KvquantMixed, WidePairsAreTheHeaviest) {
  const int d = 64;
  KvquantMixedConfig c = mixed(d, 2, rope(48, true), 8);
  c.pair_weight.assign(2, std::vector<float>(32, 1.f));
  const int heavy0[8] = {0, 3, 5, 9, 17, 20, 30, 31}, heavy1[8] = {1, 2, 4, 6, 8, 10, 12, 14};
  for (int j : heavy0) c.pair_weight[0][size_t(j)] = 5.f + j;
  for (int j : heavy1) c.pair_weight[1][size_t(j)] = 2.f;
  auto part = kvquant_mixed_assign(c);
  for (int j = 0; j < 32; ++j) {
    EXPECT_EQ(part[0][size_t(j)], std::count(heavy0, heavy0 + 8, j) ? 0 : 1) << j;
    EXPECT_EQ(part[1][size_t(j)], std::count(heavy1, heavy1 + 8, j) ? 0 : 1) << j;
  }
  c.pair_weight.clear();
  part = kvquant_mixed_assign(c);
  // 24 rotated pairs (rates falling with the index), then 8 unrotated pairs (rate 0).
  for (int j = 0; j < 32; ++j) EXPECT_EQ(part[0][size_t(j)], j >= 24 ? 0 : 1) << j;
  c.pairs = {16, 16};
  part = kvquant_mixed_assign(c);
  for (int j = 0; j < 32; ++j) EXPECT_EQ(part[1][size_t(j)], j >= 16 ? 0 : 1) << j;
}

// Without outliers KVQuant's per-channel quantization treats every channel alone, so each
// channel of the mixed codec decodes exactly as the plain codec of its width decodes it, RoPE
// included (pairs keep their rates after the reordering).
TEST(KvquantMixed, EachChannelIsThePlainCodecOfItsWidth) {
  const int d = 64, bt = 64, H = 2;
  for (bool neox : {false, true})
    for (int n_rot : {64, 48, -48}) {  // -48: 48 with per-pair frequency factors (Llama 3.1, LongRoPE)
      KvRope r = rope(std::abs(n_rot), neox);
      if (n_rot < 0)
        for (int i = 0; i < -n_rot / 2; ++i) r.freq_factors.push_back(1.f + 3.f * float(i) / float(-n_rot / 2 - 1));
      KvquantMixedConfig c = mixed(d, H, r, 16);
      c.outliers_per_token = 0;
      c.sink_tokens = 1;
      std::vector<std::vector<float>> w(H, std::vector<float>(32));
      std::mt19937 rng(7);
      for (auto& hw : w)
        for (float& x : hw) x = float(rng() % 1000);
      c.pair_weight = w;
      auto mk = kvquant_mixed_key_codec_create(c);
      const auto part = kvquant_mixed_assign(c);
      const auto pairs = kv_rope_pairs(r, d);
      std::unique_ptr<KvCodec> plain[2];
      for (int s = 0; s < 2; ++s) {
        KvquantKeyConfig pc;
        pc.bits = c.bits[size_t(s)];
        pc.head_dim = d;
        pc.rope = r;
        pc.outliers_per_token = 0;
        pc.sink_tokens = 1;
        plain[s] = kvquant_key_codec_create(pc);
      }
      for (int h = 0; h < H; ++h)
        for (int pos0 : {0, 5000}) {
          auto x = gaussian(bt, d, 11 + h);
          for (int t = 0; t < bt; ++t) x[size_t(t) * d + 7] += 30.f;  // an outlier channel
          std::vector<uint8_t> mb(mk->block_bytes(bt));
          mk->encode(h, x.data(), d, bt, mb.data(), bt, 0, pos0);
          std::vector<float> got(size_t(bt) * d), want[2];
          mk->decode(h, mb.data(), bt, 0, bt, pos0, got.data());
          for (int s = 0; s < 2; ++s) {
            std::vector<uint8_t> pb(plain[s]->block_bytes(bt));
            plain[s]->encode(0, x.data(), d, bt, pb.data(), bt, 0, pos0);
            want[s].resize(size_t(bt) * d);
            plain[s]->decode(0, pb.data(), bt, 0, bt, pos0, want[s].data());
          }
          for (size_t j = 0; j < pairs.size(); ++j) {
            const int s = part[size_t(h)][j];
            for (int t = 0; t < bt; ++t)
              for (int ch : {pairs[j].a, pairs[j].b})
                ASSERT_EQ(got[size_t(t) * d + ch], want[s][size_t(t) * d + ch])
                    << "neox " << neox << " n_rot " << n_rot << " head " << h << " pair " << j << " t " << t;
          }
        }
    }
}

// The shapes shipped at head_dim 64 (parts of 8 and 24 pairs, the AVX2 kernel's 16-channel paths)
// and 128, partial and full rotation, query groups of up to 4 rows (keys turned in registers) and
// more (turned in place).
TEST(KvquantMixed, ScoresMatchDecodeAllLevels) {
  const int bt = 128;
  for (int d : {64, 128})
    for (int hi : {d / 8, d / 4})
      for (int n_rot : {d - 16, d})
        for (bool neox : {false, true})
          for (int n_q : {3, 5}) {
            const int H = 2;
            const KvRope r = rope(n_rot, neox);
            KvquantMixedConfig c = mixed(d, H, r, hi, 2);
            c.group_tokens = 64;
            c.sink_tokens = 2;
            c.outliers_per_token = 1;
            c.pair_weight.assign(H, std::vector<float>(size_t(d / 2)));
            std::mt19937 rng(3);
            for (auto& hw : c.pair_weight)
              for (float& x : hw) x = float(rng() % 97);
            auto k = kvquant_mixed_key_codec_create(c);
            for (int h = 0; h < H; ++h)
              for (int pos0 : {0, 70000}) {
                auto x = gaussian(bt, d, 20 + h);
                for (int t = 0; t < bt; ++t) x[size_t(t) * d + 3] *= 300.f;
                std::vector<uint8_t> block(k->block_bytes(bt));
                k->encode(h, x.data(), d, bt, block.data(), bt, 0, pos0);
                std::vector<float> dec(size_t(bt) * d);
                k->decode(h, block.data(), bt, 0, bt, pos0, dec.data());
                auto q = gaussian(n_q, d, 30);
                std::vector<float> qp(size_t(n_q) * size_t(k->prepared_query_dim()));
                k->prepare_query(h, q.data(), n_q, qp.data());
                const int t0 = 1, n = 120;
                for (CpuLevel l : levels()) {
                  const CpuLevel prev = cpu_set_level(l);
                  std::vector<float> s(size_t(n_q) * 130, -1.f);
                  k->scores(h, qp.data(), n_q, block.data(), bt, t0, n, pos0, s.data(), 130);
                  cpu_set_level(prev);
                  for (int i = 0; i < n_q; ++i) {
                    for (int t = 0; t < n; ++t) {
                      double ref = 0, ra = 0;
                      for (int ch = 0; ch < d; ++ch) {
                        ref += double(q[size_t(i) * d + ch]) * dec[size_t(t0 + t) * d + ch];
                        ra += std::fabs(double(q[size_t(i) * d + ch]) * dec[size_t(t0 + t) * d + ch]);
                      }
                      ASSERT_NEAR(s[size_t(i) * 130 + t], ref, 2e-5 * ra + 1e-30)
                          << cpu_level_name(l) << " d " << d << " head " << h;
                    }
                    for (int t = n; t < 130; ++t) ASSERT_EQ(s[size_t(i) * 130 + t], -1.f);  // untouched
                  }
                }
              }
          }
}

// Keys whose pairs differ widely in range (a few heavy pairs, as real keys have), queries of
// equal magnitude per channel: with the weights, 3.5 bits leave a clearly smaller score error than
// 3 bits everywhere, and not much more than 4 bits everywhere; the split by weight also beats
// the same split made blindly (pairs in the opposite order).
TEST(KvquantMixed, HeavyPairsWideBeatsUniformBits) {
  const int d = 128, bt = 256, np = 64, n_q = 16;
  const KvRope r = rope(d, false);
  std::vector<std::vector<float>> sc(1, std::vector<float>(np));
  for (int j = 0; j < np; ++j) sc[0][size_t(j)] = j % 8 == 0 ? 8.f : (j % 3 == 0 ? 2.f : 0.5f);
  const auto x = keys_with_pair_scales(bt, 1, d, r, sc, 5);
  const auto q = gaussian(n_q, d, 6);
  auto score_mse = [&](const KvCodec& k) {
    std::vector<uint8_t> block(k.block_bytes(bt));
    k.encode(0, x.data(), d, bt, block.data(), bt, 0, 100);
    std::vector<float> dec(size_t(bt) * d), ref = x;
    k.decode(0, block.data(), bt, 0, bt, 100, dec.data());
    for (int t = 0; t < bt; ++t) kv_rope_apply(r, 100 + t, ref.data() + size_t(t) * d, d);
    double e = 0;
    for (int i = 0; i < n_q; ++i)
      for (int t = 1; t < bt; ++t) {  // slot 0 is the exact sink
        double s = 0;
        for (int c = 0; c < d; ++c)
          s += double(q[size_t(i) * d + c]) * (dec[size_t(t) * d + c] - ref[size_t(t) * d + c]);
        e += s * s;
      }
    return e;
  };
  KvquantKeyConfig u;
  u.head_dim = d;
  u.rope = r;
  u.outliers_per_token = 0;
  u.bits = 3;
  const double e3 = score_mse(*kvquant_key_codec_create(u));
  u.bits = 4;
  const double e4 = score_mse(*kvquant_key_codec_create(u));
  KvquantMixedConfig m = mixed(d, 1, r, np / 2);
  m.outliers_per_token = 0;
  m.pair_weight.assign(1, std::vector<float>(np));
  for (int j = 0; j < np; ++j) m.pair_weight[0][size_t(j)] = sc[0][size_t(j)] * sc[0][size_t(j)];
  const double e35 = score_mse(*kvquant_mixed_key_codec_create(m));
  for (int j = 0; j < np; ++j) m.pair_weight[0][size_t(j)] = 1.f / (sc[0][size_t(j)] * sc[0][size_t(j)]);
  const double blind = score_mse(*kvquant_mixed_key_codec_create(m));
  EXPECT_LT(e4, e3 / 2);  // the widths themselves differ
  EXPECT_LT(e35, e3 / 2.5) << "3.5 " << e35 << " 3 " << e3 << " 4 " << e4;
  EXPECT_LT(e35, 1.5 * e4) << "3.5 " << e35 << " 4 " << e4;
  EXPECT_GT(blind, 2 * e35) << "blind " << blind << " weighted " << e35;
}

// Weights from calibration data: a pair's weight follows its channels' range (squared) times the
// query energy on the pair; the sink positions of each window are left out.
TEST(KvquantMixed, PairWeightsFollowRangesAndQueries) {
  const int d = 32, H = 2, n = 256, win = 128;
  const KvRope r = rope(d, true);
  std::vector<std::vector<float>> sc(H, std::vector<float>(16, 1.f));
  sc[0][3] = 4.f;
  sc[1][10] = 3.f;
  auto x = keys_with_pair_scales(n, H, d, r, sc, 9);
  for (int w = 0; w < n / win; ++w)
    for (int c = 0; c < H * d; ++c) x[size_t(w) * win * H * d + size_t(c)] = 1e4f;  // sink rows: huge, left out
  std::vector<double> q_ms(size_t(H) * d, 1.0);
  q_ms[size_t(1) * d + 5] = 25.0;  // head 1, pair 5's a-channel (NeoX: channels 5 and 21)
  const auto art = kvquant_pair_weights(x.data(), n, H, d, r, q_ms, 32, 1, win);
  const auto w = art["kvquant_pair_weight"].get<std::vector<std::vector<float>>>();
  ASSERT_EQ(w.size(), size_t(H));
  ASSERT_EQ(w[0].size(), size_t(16));
  const auto arg = [](const std::vector<float>& v) { return int(std::max_element(v.begin(), v.end()) - v.begin()); };
  EXPECT_EQ(arg(w[0]), 3);
  EXPECT_NEAR(w[0][3] / w[0][0], 16.0, 16.0 * 0.35);  // range^2 ratio, sampling noise aside
  EXPECT_EQ(arg(w[1]), 5);                            // query energy 26 / 2 = 13x beats range^2 9x
  std::vector<float> rest = w[1];
  rest[5] = 0;
  EXPECT_EQ(arg(rest), 10);
  for (const auto& hw : w)
    for (float v : hw) EXPECT_LT(v, 1e4f);  // no sink row in any range
  EXPECT_THROW(kvquant_pair_weights(x.data(), n, H, d, r, std::vector<double>(5, 1.0), 32, 1, win), Error);
  x[17] = NAN;
  EXPECT_THROW(kvquant_pair_weights(x.data(), n, H, d, r, q_ms, 32, 1, win), Error);
}

// The calibration's weights reach the registered codec (and its split follows them).
TEST(KvquantMixed, CalibrationWeightsReachTheCodec) {
  const int d = 64;
  KvCodecParams p;
  p.head_dim = d;
  p.n_kv_heads = 1;
  p.rope = rope(d, false);
  std::vector<float> w(32, 1.f);
  for (int j = 0; j < 8; ++j) w[size_t(j)] = 10.f;  // the highest-rate pairs: never wide by default
  nlohmann::json calib = {{"layers",
                           {{{"layer", 0},
                             {"kvquant_pair_weight", {w}},
                             {"kvquant_k4", {{"codebook", kvquant_default_codebook(4)}}},
                             {"kvquant_k3", {{"codebook", kvquant_default_codebook(3)}}}}}}};
  p.calib = &calib;
  auto with = kv_codec_create("kvquant3.25_k", p);
  p.calib = nullptr;
  auto without = kv_codec_create("kvquant3.25_k", p);
  // Keys whose first 8 pairs carry all the range: with the weights their codes are 4-bit.
  std::vector<std::vector<float>> sc(1, std::vector<float>(32, 0.01f));
  for (int j = 0; j < 8; ++j) sc[0][size_t(j)] = 1.f;
  const auto x = keys_with_pair_scales(64, 1, d, p.rope, sc, 3);
  auto err = [&](const KvCodec& k) {
    std::vector<uint8_t> b(k.block_bytes(64));
    k.encode(0, x.data(), d, 64, b.data(), 64, 0, 0);
    std::vector<float> y(x.size()), ref = x;
    k.decode(0, b.data(), 64, 0, 64, 0, y.data());
    double e = 0;
    for (int t = 1; t < 64; ++t) {
      kv_rope_apply(p.rope, t, ref.data() + size_t(t) * d, d);
      for (int c = 0; c < d; ++c) e += std::pow(double(y[size_t(t) * d + c]) - ref[size_t(t) * d + c], 2);
    }
    return e;
  };
  EXPECT_LT(err(*with), 0.5 * err(*without));
  nlohmann::json bad = calib;
  bad["layers"][0]["kvquant_pair_weight"] = {std::vector<float>(31, 1.f)};
  p.calib = &bad;
  EXPECT_THROW(kv_codec_create("kvquant3.25_k", p), Error);
}

// A calibration without both codebooks of the layer (fitted for other bit widths, or for a model
// with fewer layers) is an error saying how to refit it, not the default codebooks in silence.
TEST(KvquantMixed, CalibrationWithoutTheLayersCodebooksRejected) {
  const int d = 64;
  KvCodecParams p;
  p.head_dim = d;
  p.n_kv_heads = 1;
  p.rope = rope(d, false);
  auto err = [&](const nlohmann::json& calib) {
    p.calib = &calib;
    try {
      kv_codec_create("kvquant3.25_k", p);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  nlohmann::json both = {{"layers",
                          {{{"layer", 0},
                            {"kvquant_k4", {{"codebook", kvquant_default_codebook(4)}}},
                            {"kvquant_k3", {{"codebook", kvquant_default_codebook(3)}}}}}}};
  EXPECT_EQ(err(both), "no error");
  nlohmann::json only2 = {{"layers", {{{"layer", 0}, {"kvquant_k2", {{"codebook", kvquant_default_codebook(2)}}}}}}};
  const std::string e = err(only2);
  EXPECT_NE(e.find("kvquant_k4"), std::string::npos) << e;
  EXPECT_NE(e.find("kvq calibrate"), std::string::npos) << e;
  p.layer = 1;
  EXPECT_NE(err(both).find("has 1 layers, layer 1"), std::string::npos) << err(both);
}

TEST(KvquantMixed, BadParametersRejected) {
  auto msg = [](auto&& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  KvCodecParams p;
  p.head_dim = 48;  // 24 pairs: half is 12, not a multiple of 8
  p.rope = rope(48, false);
  EXPECT_NE(msg([&] { kv_codec_create("kvquant3.5_k", p); }).find("multiples of 8 pairs"), std::string::npos);
  KvquantMixedConfig c = mixed(64, 1, rope(64, false), 16);
  c.pairs = {16, 8};
  EXPECT_NE(msg([&] { kvquant_mixed_key_codec_create(c); }).find("pairs"), std::string::npos);
  c = mixed(64, 1, rope(64, false), 16);
  c.bits = {3, 4};
  EXPECT_NE(msg([&] { kvquant_mixed_key_codec_create(c); }).find("widest first"), std::string::npos);
  c = mixed(64, 1, rope(64, false), 16);
  c.bits = {5, 3};
  EXPECT_NE(msg([&] { kvquant_mixed_key_codec_create(c); }).find("2, 3 or 4"), std::string::npos);
  c = mixed(64, 2, rope(64, false), 16);
  c.pair_weight.assign(1, std::vector<float>(32, 1.f));
  EXPECT_NE(msg([&] { kvquant_mixed_key_codec_create(c); }).find("heads"), std::string::npos);
  c.pair_weight.assign(2, std::vector<float>(32, 1.f));
  c.pair_weight[1][4] = -1.f;
  EXPECT_NE(msg([&] { kvquant_mixed_key_codec_create(c); }).find("not finite"), std::string::npos);
  c = mixed(64, 1, rope(63, false), 16);
  EXPECT_NE(msg([&] { kvquant_mixed_key_codec_create(c); }).find("n_rot"), std::string::npos);
  c = mixed(64, 1, rope(80, false), 16);
  EXPECT_NE(msg([&] { kvquant_mixed_key_codec_create(c); }).find("n_rot"), std::string::npos);
  c = mixed(128, 1, rope(128, false), 48);
  c.outliers_per_token = 16;  // the narrow part has 32 channels: at most 4
  EXPECT_NE(msg([&] { kvquant_mixed_key_codec_create(c); }).find("outliers per token"), std::string::npos);
  c = mixed(64, 2, rope(64, false), 16);
  auto k = kvquant_mixed_key_codec_create(c);
  std::vector<uint8_t> b(k->block_bytes(32));
  auto x = gaussian(32, 64, 1);
  EXPECT_THROW(k->encode(2, x.data(), 64, 32, b.data(), 32, 0, 0), Error);
}
