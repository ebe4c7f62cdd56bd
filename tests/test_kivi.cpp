// KIVI codecs: layout and sizes, fused kernels against the decode reference on every CPU level,
// the key/value asymmetry the paper reports, and parameter validation.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "core/cpu.h"
#include "core/error.h"
#include "kv/kivi.h"
#include "kvq/kv_format.h"
#include "kv_test_util.h"

using namespace kvq;

namespace {

std::unique_ptr<KvCodec> make(const char* name, int head_dim = 128, int g = 0, int r = -1) {
  KvCodecParams p;
  p.head_dim = head_dim;
  p.group_tokens = g;
  p.residual_tokens = r;
  return kv_codec_create(name, p);
}

// n rows of head_dim: gaussian, optionally with a few large outlier channels.
using test::gaussian;

// Mean squared error; with `relative`, the mean over tokens of ||x_t - y_t||^2 / ||x_t||^2.
double mse_of(const KvCodec& c, const std::vector<float>& x, int block_tokens, bool relative = false) {
  const int d = c.head_dim();
  std::vector<uint8_t> block(c.block_bytes(block_tokens));
  c.encode(0, x.data(), d, block_tokens, block.data(), block_tokens, 0, 0);
  std::vector<float> y(x.size());
  c.decode(0, block.data(), block_tokens, 0, block_tokens, 0, y.data());
  double tot = 0;
  for (int t = 0; t < block_tokens; ++t) {
    double e = 0, n2 = 0;
    for (int k = 0; k < d; ++k) {
      const double a = x[size_t(t) * d + k], b = y[size_t(t) * d + k];
      e += (a - b) * (a - b);
      n2 += a * a;
    }
    tot += relative ? e / std::max(n2, 1e-30) : e / d;
  }
  return tot / block_tokens;
}

// Inputs that stress the quantizers: outlier channels, constant rows, zeros, tiny and huge values.
std::vector<std::vector<float>> adversarial(int n, int d) {
  std::vector<std::vector<float>> out;
  auto base = gaussian(n, d, 7);
  auto outl = base;
  for (int t = 0; t < n; ++t)
    for (int c : {3, 17, d - 5}) outl[size_t(t) * d + c] = 80.f + 5.f * base[size_t(t) * d + c];
  out.push_back(outl);
  std::vector<float> constant(size_t(n) * d);
  for (int t = 0; t < n; ++t)
    for (int c = 0; c < d; ++c) constant[size_t(t) * d + c] = 0.37f * float(c % 5) - 1.f;
  out.push_back(constant);
  out.push_back(std::vector<float>(size_t(n) * d, 0.f));
  auto tiny = base;
  for (float& v : tiny) v *= 1e-6f;
  out.push_back(tiny);
  auto huge = base;
  for (float& v : huge) v = std::clamp(v * 3e4f, -65504.f, 65504.f);
  out.push_back(huge);
  auto mixed = base;  // one token 1000x the others
  for (int c = 0; c < d; ++c) mixed[size_t(n / 2) * d + c] *= 1000.f;
  out.push_back(mixed);
  return out;
}

using test::levels;

}  // namespace

TEST(Kivi, RegisteredFormatsAndDefaults) {
  EXPECT_EQ(kv_format_find("kivi2").k_codec, "kivi2_k");
  EXPECT_EQ(kv_format_find("KIVI-4").v_codec, "kivi4_v");
  for (const char* n : {"kivi2p_k", "kivi4p_k", "kivi2p_v", "kivi4p_v"}) {
    auto c = make(n);
    EXPECT_EQ(c->info().name, n);
    EXPECT_EQ(c->info().group_tokens, 32);
    EXPECT_EQ(c->info().residual_tokens, 128);
    EXPECT_FALSE(c->info().pre_rope);
  }
  auto c = make("kivi2_k", 64, 64, 256);
  EXPECT_EQ(c->info().group_tokens, 64);
  EXPECT_EQ(c->info().residual_tokens, 256);
  // The cache's rule: tokens leave the full-precision window in whole groups, after R.
  EXPECT_EQ(kv_quantized_tokens(159, 32, 128), 0);
  EXPECT_EQ(kv_quantized_tokens(160, 32, 128), 32);
}

// kivi4 / kivi2 store kivi4t's / kivi2t's tiles when head_dim % 32 == 0 and G % 16 == 0 (same bytes
// and decode), the bit planes otherwise; kivi4p / kivi2p always the planes.
TEST(Kivi, KiviUsesTilesWhenTheShapeAllows) {
  struct Case {
    int hd, g, r;
    bool tiles;
  } cases[] = {{128, 32, 128, true}, {64, 16, 0, true}, {256, 64, 128, true},
               {48, 32, 128, false}, {64, 24, 48, false}, {16, 32, 0, false}};  // hd 48, 16: keys only
  for (const char* bits : {"2", "4"}) {
    const std::string base = std::string("kivi") + bits;
    for (const Case& c : cases) {
      for (const char* role : {"_k", "_v"}) {
        if (role[1] == 'v' && c.hd % 32 != 0) continue;  // kivi's value groups are 32 channels
        auto a = make((base + role).c_str(), c.hd, c.g, c.r);
        auto p = make((base + "p" + role).c_str(), c.hd, c.g, c.r);
        const std::string want = base + (c.tiles ? "t" : "") + role;
        EXPECT_EQ(a->info().name, want) << c.hd << " " << c.g;
        EXPECT_EQ(a->info().group_tokens, c.g);
        EXPECT_EQ(a->info().residual_tokens, c.r);
        EXPECT_EQ(a->info().code_bits, p->info().code_bits) << want;
        const int bt = 2 * c.g * (c.g % 16 == 0 ? 1 : 2);
        ASSERT_EQ(a->block_bytes(bt), p->block_bytes(bt)) << want;
        auto x = gaussian(bt, c.hd, 5);
        std::vector<uint8_t> ba(a->block_bytes(bt)), bp(p->block_bytes(bt));
        a->encode(0, x.data(), size_t(c.hd), bt, ba.data(), bt, 0, 0);
        p->encode(0, x.data(), size_t(c.hd), bt, bp.data(), bt, 0, 0);
        std::vector<float> ya(x.size()), yp(x.size());
        a->decode(0, ba.data(), bt, 0, bt, 0, ya.data());
        p->decode(0, bp.data(), bt, 0, bt, 0, yp.data());
        for (size_t i = 0; i < x.size(); ++i) ASSERT_EQ(ya[i], yp[i]) << want << " element " << i;
      }
    }
  }
}

TEST(Kivi, BlockBytesAndEffectiveBits) {
  // K: per group of 32 tokens, 2 x f16 per channel: b + 32/32 bits. V: per token, 2 x f16 per 32
  // channels: b + 32/32 bits.
  for (int bits : {2, 4}) {
    for (const char* role : {"_k", "_v"}) {
      const std::string name = "kivi" + std::to_string(bits) + "p" + role;
      auto c = make(name.c_str());
      for (int bt : {32, 64, 128, 256}) {
        EXPECT_EQ(c->block_bytes(bt), size_t(bt) * 128 * (bits + 1) / 8) << name << " " << bt;
        EXPECT_DOUBLE_EQ(kv_codec_effective_bits(*c, bt, 0), bits + 1.0);
      }
      // 1000 tokens: 864 quantized (27 groups after R=128), 136 in the f32 tail.
      EXPECT_NEAR(kv_codec_effective_bits(*c, 128, 1000), ((bits + 1.0) * 864 + 32.0 * 136) / 1000, 1e-12);
    }
  }
}

TEST(Kivi, EncodeStaysInsideItsBlockAndGroups) {
  for (const char* name : {"kivi2p_k", "kivi4p_v"}) {
    auto c = make(name, 64);
    const int bt = 64;
    const size_t bytes = c->block_bytes(bt);
    std::vector<uint8_t> buf(bytes + 64, 0xA5);
    auto x = gaussian(bt, 64, 3);
    c->encode(0, x.data(), 64, 32, buf.data(), bt, 32, 0);  // second group only
    for (size_t i = bytes; i < buf.size(); ++i) ASSERT_EQ(buf[i], 0xA5) << name;
    c->encode(0, x.data(), 64, 32, buf.data(), bt, 0, 0);
    std::vector<float> y(size_t(bt) * 64);
    c->decode(0, buf.data(), bt, 0, bt, 0, y.data());
    // Both groups came from x[0:32): they must decode identically.
    for (int i = 0; i < 32 * 64; ++i) ASSERT_EQ(y[i], y[32 * 64 + i]);
  }
}

TEST(Kivi, KeyErrorWithinHalfAStepPerChannel) {
  const int d = 128, bt = 64;
  for (int bits : {2, 4}) {
    auto c = make(bits == 2 ? "kivi2p_k" : "kivi4p_k", d);
    auto x = gaussian(bt, d, 11);
    std::vector<uint8_t> block(c->block_bytes(bt));
    c->encode(0, x.data(), d, bt, block.data(), bt, 0, 0);
    std::vector<float> y(x.size());
    c->decode(0, block.data(), bt, 0, bt, 0, y.data());
    for (int g = 0; g < bt / 32; ++g)
      for (int ch = 0; ch < d; ++ch) {
        float mn = 1e30f, mx = -1e30f;
        for (int t = g * 32; t < g * 32 + 32; ++t) {
          mn = std::min(mn, x[size_t(t) * d + ch]);
          mx = std::max(mx, x[size_t(t) * d + ch]);
        }
        const float step = (mx - mn) / float((1 << bits) - 1);
        for (int t = g * 32; t < g * 32 + 32; ++t)
          ASSERT_LE(std::fabs(x[size_t(t) * d + ch] - y[size_t(t) * d + ch]), 0.5f * step * 1.01f + 2e-3f * std::fabs(mn) + 1e-6f);
      }
  }
}

// The paper's asymmetry, measured with the same bits and the same scale overhead (G = g = 32):
// keys with outlier channels quantize better per channel; per-token-scaled, channel-flat values
// quantize better per token.
TEST(Kivi, KeysPerChannelValuesPerToken) {
  const int d = 128, bt = 128;
  std::mt19937_64 rng(5);
  std::normal_distribution<float> nd;
  std::vector<float> keys(size_t(bt) * d), values(size_t(bt) * d);
  for (int t = 0; t < bt; ++t) {
    const float a = std::exp(2.f * (float(t % 17) / 16.f - 0.5f) * 2.3f);  // 0.1 .. 10
    for (int ch = 0; ch < d; ++ch) {
      // Keys: channels with fixed offsets/magnitudes, 4 outlier channels 20x larger.
      const bool outlier = ch % 32 == 7;
      keys[size_t(t) * d + ch] = (outlier ? 20.f : 1.f) * (nd(rng) + (ch % 3 == 0 ? 2.f : 0.f));
      // Values: flat across channels, magnitude varying per token.
      values[size_t(t) * d + ch] = a * nd(rng);
    }
  }
  for (int bits : {2, 4}) {
    auto kc = make(bits == 2 ? "kivi2p_k" : "kivi4p_k", d);  // per channel
    auto vc = make(bits == 2 ? "kivi2p_v" : "kivi4p_v", d);  // per token
    const double k_pc = mse_of(*kc, keys, bt), k_pt = mse_of(*vc, keys, bt);
    const double v_pc = mse_of(*kc, values, bt), v_pt = mse_of(*vc, values, bt);
    const double vr_pc = mse_of(*kc, values, bt, true), vr_pt = mse_of(*vc, values, bt, true);
    std::printf("bits %d: keys mse per-channel %.4g per-token %.4g | values mse per-channel %.4g "
                "per-token %.4g, relative per-channel %.4g per-token %.4g\n",
                bits, k_pc, k_pt, v_pc, v_pt, vr_pc, vr_pt);
    EXPECT_LT(k_pc, 0.5 * k_pt) << bits;
    // Absolute error is dominated by the largest tokens (both schemes scale with them); the
    // small tokens are where per-channel scaling fails: their relative error explodes.
    EXPECT_LT(v_pt, 0.65 * v_pc) << bits;
    EXPECT_LT(vr_pt, 0.2 * vr_pc) << bits;
  }
}

// Also adversarial query rows for the integer-dot keys: all zeros, one dominant channel, tiny
// values; head dims with (64, 128) and without (80) whole 64-channel blocks.
TEST(Kivi, KernelParityRandomCodes) {
  const int n = 37, n_q = 5;
  std::mt19937_64 rng(9);
  std::uniform_int_distribution<int> byte(0, 255);
  std::normal_distribution<float> nd;
  for (int d : {128, 64, 80})
  for (int bits : {2, 3, 4}) {
    for (int group : {16, 32, 128}) {
      if (d % group != 0) continue;
      const size_t krow = bitplane_row_bytes(bits, d) + 3;  // odd stride: unaligned rows
      const size_t vrow = kivi_v_row_bytes(bits, d, group) + 1;
      std::vector<uint8_t> kb(krow * n), vb(vrow * n);
      for (auto& b : kb) b = uint8_t(byte(rng));
      for (auto& b : vb) b = uint8_t(byte(rng));
      // Value rows: finite f16 scales/zeros in front of the random planes.
      for (int t = 0; t < n; ++t)
        for (int gi = 0; gi < 2 * d / group; ++gi) {
          const f16_t h = f32_to_f16(nd(rng) * (t % 7 == 0 ? 1000.f : 1.f));
          std::memcpy(&vb[t * vrow + 2 * gi], &h, 2);
        }
      std::vector<float> qs(size_t(n_q) * d), qz(n_q), p(size_t(n_q) * n);
      for (auto& v : qs) v = nd(rng);
      for (int c = 0; c < d; ++c) {
        qs[size_t(c)] = 0.f;                                   // row 0: zeros
        qs[size_t(2 * d + c)] *= 1e-6f;                        // row 2: tiny
      }
      qs[size_t(d + 7)] = 3e4f;                                // row 1: one dominant channel
      for (auto& v : qz) v = nd(rng);
      for (auto& v : p) v = std::fabs(nd(rng));
      std::vector<float> ref(size_t(n_q) * (n + 2)), acc_ref(size_t(n_q) * d, 0.5f);
      kivi_k_scores_scalar(kb.data(), krow, n, bits, d, qs.data(), qz.data(), n_q, ref.data(), n + 2);
      kivi_v_accum_scalar(vb.data(), vrow, n, bits, d, group, p.data(), n, n_q, acc_ref.data());
      // Float sums in a different order differ by a few ulps of the sum of |terms|.
      std::vector<float> qs_abs(qs.size()), vb_abs_acc(acc_ref.size(), 0.5f), ref_abs(ref.size());
      for (size_t i = 0; i < qs.size(); ++i) qs_abs[i] = std::fabs(qs[i]) * 15.f;
      std::vector<float> qz_abs(n_q);
      for (int i = 0; i < n_q; ++i) qz_abs[i] = std::fabs(qz[i]);
      kivi_k_scores_scalar(kb.data(), krow, n, bits, d, qs_abs.data(), qz_abs.data(), n_q, ref_abs.data(), n + 2);
      std::vector<uint8_t> vb_abs = vb;
      for (int t = 0; t < n; ++t)
        for (int gi = 0; gi < 2 * d / group; ++gi) vb_abs[t * vrow + 2 * gi + 1] &= 0x7f;  // |f16|
      kivi_v_accum_scalar(vb_abs.data(), vrow, n, bits, d, group, p.data(), n, n_q, vb_abs_acc.data());
#if defined(KVQ_HAVE_SIMD)
      for (CpuLevel l : levels()) {
        if (l == CpuLevel::scalar) continue;
        const KiviKernels kk = l == CpuLevel::avx2 ? KiviKernels{kivi_k_scores_avx2, kivi_v_accum_avx2}
                                                   : KiviKernels{kivi_k_scores_avx512, kivi_v_accum_avx512};
        std::vector<float> out(ref.size()), acc(acc_ref.size(), 0.5f);
        kk.k_scores(kb.data(), krow, n, bits, d, qs.data(), qz.data(), n_q, out.data(), n + 2);
        kk.v_accum(vb.data(), vrow, n, bits, d, group, p.data(), n, n_q, acc.data());
        for (int i = 0; i < n_q; ++i)
          for (int t = 0; t < n; ++t) {
            // AVX-512 rounds each folded query row to int16 steps of amax / 32767 (kivi_avx512.cpp):
            // at most half a step per channel, times the code.
            double quant = 0;
            if (l == CpuLevel::avx512 && d % 64 == 0) {
              double amax = 0, csum = 0;
              for (int c = 0; c < d; ++c) {
                amax = std::max(amax, double(std::fabs(qs[size_t(i) * d + c])));
                csum += bitplane_code(kb.data() + size_t(t) * krow, bits, d, c);
              }
              quant = amax / 32767 * (0.5 + std::ldexp(1.0, -20)) * csum;
            }
            ASSERT_NEAR(out[i * (n + 2) + t], ref[i * (n + 2) + t], 1e-5f * ref_abs[i * (n + 2) + t] + quant)
                << cpu_level_name(l) << " bits " << bits;
          }
        for (int i = 0; i < n_q; ++i)
          for (int c = 0; c < d; ++c) {
            // AVX-512 (d % 64 == 0, groups of >= 32) rounds w = p * scale per query, group and
            // run of 64 tokens to int16 steps of max|w| / 32767: half a step per token times its code.
            double quant = 0;
            if (l == CpuLevel::avx512 && d % 64 == 0 && group % 32 == 0) {
              const int ng = d / group, g = c / group;
              for (int r0 = 0; r0 < n; r0 += 64) {
                double wmax = 0, csum = 0;
                for (int t = r0; t < std::min(n, r0 + 64); ++t) {
                  f16_t h;
                  std::memcpy(&h, &vb[t * vrow + 2 * g], 2);
                  wmax = std::max(wmax, double(std::fabs(p[size_t(i) * n + t] * f16_to_f32(h))));
                  csum += bitplane_code(vb.data() + t * vrow + size_t(ng) * 4, bits, d, c);
                }
                quant += wmax / 32767 * (0.5 + std::ldexp(1.0, -20)) * csum;
              }
            }
            const size_t e = size_t(i) * d + c;
            ASSERT_NEAR(acc[e], acc_ref[e], 1e-5f * vb_abs_acc[e] + quant) << cpu_level_name(l);
          }
      }
#endif
    }
  }
}

// Fused scores / accumulate through the codec on every CPU level equal decode-then-dot in double,
// on random and adversarial inputs, for partial spans that straddle groups.
TEST(Kivi, FusedMatchesDecodeAllLevels) {
  const int d = 64, bt = 128, n_q = 3;
  auto cases = adversarial(bt, d);
  cases.push_back(gaussian(bt, d, 21));
  for (const char* name : {"kivi2p_k", "kivi4p_k", "kivi2p_v", "kivi4p_v"}) {
    auto c = make(name, d, 32, 0);
    for (const auto& x : cases) {
      std::vector<uint8_t> block(c->block_bytes(bt));
      c->encode(0, x.data(), d, bt, block.data(), bt, 0, 0);
      std::vector<float> dec(size_t(bt) * d);
      c->decode(0, block.data(), bt, 0, bt, 0, dec.data());
      auto q = gaussian(n_q, d, 4);
      std::vector<float> p(size_t(n_q) * bt);
      for (size_t i = 0; i < p.size(); ++i) p[i] = float(i % 13) / 13.f;
      const int t0 = 20, n = 90;
      double scale = 1;
      for (float v : dec) scale = std::max(scale, double(std::fabs(v)));
      for (CpuLevel l : levels()) {
        const CpuLevel prev = cpu_set_level(l);
        std::vector<float> s(size_t(n_q) * n), acc(size_t(n_q) * d, 0.f);
        c->scores(0, q.data(), n_q, block.data(), bt, t0, n, 0, s.data(), n);
        c->accumulate(0, p.data(), bt, n_q, block.data(), bt, t0, n, acc.data());
        cpu_set_level(prev);
        for (int i = 0; i < n_q; ++i) {
          for (int t = 0; t < n; ++t) {
            double r = 0;
            for (int k = 0; k < d; ++k) r += double(q[i * d + k]) * dec[size_t(t0 + t) * d + k];
            ASSERT_NEAR(s[i * n + t], r, 2e-5 * scale * d) << name << " " << cpu_level_name(l);
          }
          for (int k = 0; k < d; ++k) {
            double r = 0;
            for (int t = 0; t < n; ++t) r += double(p[i * bt + t]) * dec[size_t(t0 + t) * d + k];
            ASSERT_NEAR(acc[i * d + k], r, 2e-5 * scale * n) << name << " " << cpu_level_name(l);
          }
        }
      }
    }
  }
}

TEST(Kivi, ConstantAndZeroRowsDecodeExactly) {
  const int d = 32, bt = 32;
  for (const char* name : {"kivi2p_k", "kivi2p_v"}) {
    auto c = make(name, d, 32, 0);
    std::vector<float> x(size_t(bt) * d, 0.f), y(x.size());
    std::vector<uint8_t> block(c->block_bytes(bt));
    c->encode(0, x.data(), d, bt, block.data(), bt, 0, 0);
    c->decode(0, block.data(), bt, 0, bt, 0, y.data());
    for (float v : y) ASSERT_EQ(v, 0.f);
    std::fill(x.begin(), x.end(), 1.5f);  // f16-representable constant
    c->encode(0, x.data(), d, bt, block.data(), bt, 0, 0);
    c->decode(0, block.data(), bt, 0, bt, 0, y.data());
    for (float v : y) ASSERT_EQ(v, 1.5f);
  }
}

TEST(Kivi, BadParametersRejected) {
  KiviConfig c;
  c.bits = 5;
  EXPECT_THROW(kivi_codec_create(c), Error);
  c.bits = 2;
  c.head_dim = 100;
  EXPECT_THROW(kivi_codec_create(c), Error);
  c.head_dim = 128;
  c.role = KvRole::value;
  c.value_group = 24;
  EXPECT_THROW(kivi_codec_create(c), Error);
  c.value_group = 256;
  EXPECT_THROW(kivi_codec_create(c), Error);
  try {  // R not a multiple of G: the message names the flags that set them
    make("kivi2_k", 128, 32, 40);
    FAIL() << "R = 40 accepted with G = 32";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("--kv-residual-tokens"), std::string::npos) << m;
    EXPECT_NE(m.find("--kv-group-tokens"), std::string::npos) << m;
  }
  EXPECT_THROW(make("kivi2_k", 128, -3, 128), Error);
  EXPECT_THROW(make("kivi2_v", 128, 32, -5), Error);
  auto k = make("kivi2_k", 128, 32, 128);
  try {
    k->block_bytes(16);  // page smaller than the group
    FAIL() << "block of 16 tokens accepted with G = 32";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("multiple of the token group"), std::string::npos) << e.what();
  }
  std::vector<uint8_t> block(k->block_bytes(64));
  std::vector<float> x(64 * 128);
  EXPECT_THROW(k->encode(0, x.data(), 128, 16, block.data(), 64, 0, 0), Error);   // partial group
  EXPECT_THROW(k->encode(0, x.data(), 128, 32, block.data(), 64, 48, 0), Error);  // misaligned
  EXPECT_THROW(k->encode(0, x.data(), 128, 64, block.data(), 64, 32, 0), Error);  // past the end
}

// The per-group query fold (q * scale, q . zero): the AVX-512 variant against the scalar one on
// random and adversarial parameters (large, tiny/subnormal f16, zero scales).
TEST(Kivi, FoldQueryParity) {
#if !defined(KVQ_HAVE_SIMD)
  GTEST_SKIP() << "built without SIMD kernels";
#else
  if (cpu_level() != CpuLevel::avx512) GTEST_SKIP() << "no AVX-512 on this machine";
  std::mt19937_64 rng(4);
  std::normal_distribution<float> nd;
  for (int d : {16, 64, 128, 256}) {
    for (int pattern = 0; pattern < 3; ++pattern) {
      const int n_q = 5;
      std::vector<uint8_t> params(size_t(4) * size_t(d));
      for (int c = 0; c < 2 * d; ++c) {
        float v = nd(rng);
        if (pattern == 1) v *= (c % 17 == 0 ? 3e4f : 1e-6f);  // outliers and f16 subnormals
        if (pattern == 2 && c < d && c % 3 == 0) v = 0;       // zero scales
        const f16_t h = f32_to_f16(v);
        std::memcpy(&params[size_t(2 * c)], &h, 2);
      }
      std::vector<float> q(size_t(n_q) * size_t(d));
      for (auto& v : q) v = nd(rng);
      std::vector<float> qs_ref(q.size()), qs(q.size()), qz_ref(n_q), qz(n_q);
      kivi_fold_query_scalar(params.data(), q.data(), n_q, d, qs_ref.data(), qz_ref.data());
      kivi_fold_query_avx512(params.data(), q.data(), n_q, d, qs.data(), qz.data());
      for (size_t i = 0; i < qs.size(); ++i) ASSERT_EQ(qs[i], qs_ref[i]) << d << " " << i;
      for (int i = 0; i < n_q; ++i) {
        double mag = 0;
        for (int c = 0; c < d; ++c) {
          f16_t h;
          std::memcpy(&h, &params[size_t(2 * (d + c))], 2);
          mag += std::fabs(double(q[size_t(i) * d + size_t(c)]) * f16_to_f32(h));
        }
        ASSERT_NEAR(qz[size_t(i)], qz_ref[size_t(i)], 1e-5 * mag + 1e-30) << d << " pattern " << pattern;
      }
    }
  }
#endif
}
