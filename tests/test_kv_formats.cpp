// The basic KV formats: fp8 conversions, round-trip error bounds, ggml-exact q8_0/q4_0, the scale
// reuse trap, bytes claimed == bytes allocated, rejected inputs, and fused-kernel parity
// (scalar reference vs AVX2 vs AVX-512) on random and adversarial rows.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/cpu.h"
#include "core/error.h"
#include "kv/fp8.h"
#include "kv/kv_rows.h"
#include "kv/row_codec.h"
#include "kvq/kv_format.h"
#include "kv_int_dot_bound.h"
#include "kv/kvquant.h"

using namespace kvq;

namespace {

std::unique_ptr<KvCodec> make(const std::string& name, int hd = 128, int heads = 1,
                              const nlohmann::json* calib = nullptr, KvRole role = KvRole::key) {
  KvCodecParams p;
  p.head_dim = hd;
  p.n_kv_heads = heads;
  p.calib = calib;
  p.role = role;
  return kv_codec_create(name, p);
}

// Encodes one row with codec c and decodes it back.
// One token through a 16-token block (the smallest block the tiled codecs take), slot 5.
std::vector<float> roundtrip(const KvCodec& c, const std::vector<float>& x) {
  std::vector<uint8_t> blk(c.block_bytes(16));
  c.encode(0, x.data(), x.size(), 1, blk.data(), 16, 5, 0);
  std::vector<float> y(x.size());
  c.decode(0, blk.data(), 16, 5, 1, 0, y.data());
  return y;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// FP8

TEST(Fp8, AllCodesRoundTrip) {
  for (int c = 0; c < 256; ++c) {
    const float a = fp8_e4m3_to_f32(uint8_t(c));
    if ((c & 0x7f) == 0x7f) {
      EXPECT_TRUE(std::isnan(a)) << c;
      EXPECT_EQ(fp8_e4m3_from_f32(a) & 0x7f, 0x7f) << c;
    } else {
      EXPECT_TRUE(std::isfinite(a)) << c;
      EXPECT_EQ(fp8_e4m3_from_f32(a), c) << c << " " << a;
    }
    const float b = fp8_e5m2_to_f32(uint8_t(c));
    if ((c & 0x7f) > 0x7c) {
      EXPECT_TRUE(std::isnan(b)) << c;
      EXPECT_GT(fp8_e5m2_from_f32(b) & 0x7f, 0x7c) << c;
    } else {
      EXPECT_EQ(fp8_e5m2_from_f32(b), c) << c << " " << b;
    }
  }
  EXPECT_EQ(fp8_e4m3_to_f32(0x7e), 448.f);
  EXPECT_EQ(fp8_e4m3_to_f32(0x01), std::ldexp(1.f, -9));  // smallest subnormal
  EXPECT_EQ(fp8_e5m2_to_f32(0x7b), 57344.f);
  EXPECT_TRUE(std::isinf(fp8_e5m2_to_f32(0x7c)));
  EXPECT_EQ(fp8_e5m2_to_f32(0x01), std::ldexp(1.f, -16));
}

TEST(Fp8, TiesRoundToEven) {
  // E4M3 around 1: spacing 1/8. 1 + 1/16 is a tie between 1 (even mantissa) and 1.125 (odd).
  EXPECT_EQ(fp8_e4m3_to_f32(fp8_e4m3_from_f32(1.0625f)), 1.0f);
  EXPECT_EQ(fp8_e4m3_to_f32(fp8_e4m3_from_f32(1.1875f)), 1.25f);  // tie between 1.125 (odd) and 1.25
  EXPECT_EQ(fp8_e4m3_to_f32(fp8_e4m3_from_f32(1.0626f)), 1.125f);
  // Subnormal tie: half of the smallest subnormal rounds to 0, 1.5 of it to 2 of it.
  EXPECT_EQ(fp8_e4m3_from_f32(std::ldexp(1.f, -10)), 0x00);
  EXPECT_EQ(fp8_e4m3_from_f32(std::ldexp(3.f, -10)), 0x02);
  EXPECT_EQ(fp8_e4m3_from_f32(-std::ldexp(3.f, -10)), 0x82);
  // E5M2 around 1: spacing 1/4.
  EXPECT_EQ(fp8_e5m2_to_f32(fp8_e5m2_from_f32(1.125f)), 1.0f);
  EXPECT_EQ(fp8_e5m2_to_f32(fp8_e5m2_from_f32(1.375f)), 1.5f);
  // Rounding up across a binade: 1.9375 is a tie between 1.875 (odd) and 2.0 (even).
  EXPECT_EQ(fp8_e4m3_to_f32(fp8_e4m3_from_f32(1.9375f)), 2.0f);
  // -0 keeps its sign.
  EXPECT_EQ(fp8_e4m3_from_f32(-0.f), 0x80);
}

TEST(Fp8, SaturationNanInf) {
  for (float v : {449.f, 463.f, 464.f, 480.f, 1e6f, 3e38f, INFINITY}) {
    EXPECT_EQ(fp8_e4m3_from_f32(v), 0x7e) << v;
    EXPECT_EQ(fp8_e4m3_from_f32(-v), 0xfe) << v;
  }
  EXPECT_EQ(fp8_e4m3_from_f32(440.f), 0x7e);  // rounds to 448 (nearest)
  EXPECT_EQ(fp8_e5m2_from_f32(61440.f), 0x7b);  // would round to 65536 = inf: saturates
  EXPECT_EQ(fp8_e5m2_from_f32(1e9f), 0x7b);
  EXPECT_EQ(fp8_e5m2_from_f32(INFINITY), 0x7c);
  EXPECT_EQ(fp8_e5m2_from_f32(-INFINITY), 0xfc);
  EXPECT_TRUE(std::isnan(fp8_e4m3_to_f32(fp8_e4m3_from_f32(NAN))));
  EXPECT_TRUE(std::isnan(fp8_e5m2_to_f32(fp8_e5m2_from_f32(NAN))));
}

TEST(Fp8, CodecScaleModes) {
  std::vector<float> x(64);
  for (size_t i = 0; i < x.size(); ++i) x[i] = 0.01f * float(i) - 0.3f;
  // Fixed scale 1.0: relative error <= 2^-4 for normals (3 mantissa bits, RNE).
  auto c = make("fp8_e4m3", 64);
  auto y = roundtrip(*c, x);
  for (size_t i = 0; i < x.size(); ++i)
    EXPECT_LE(std::fabs(y[i] - x[i]), std::max(std::fabs(x[i]) / 16, std::ldexp(1.f, -10))) << i;
  // Dynamic: the largest element maps to 448 exactly (up to the f32 scale rounding).
  auto d = make("fp8_e4m3_dyn", 64);
  std::vector<float> big(64, 0.f);
  big[5] = 1000.f;
  big[9] = -3.f;
  auto z = roundtrip(*d, big);
  EXPECT_NEAR(z[5], 1000.f, 1e-3f);
  EXPECT_NEAR(z[9], -3.f, 3.f / 16);
  auto fixed = roundtrip(*c, big);
  EXPECT_EQ(fixed[5], 448.f);  // the fixed-scale codec saturates what the dynamic one keeps
  // Static: per-head scales from calibration JSON.
  nlohmann::json calib = {{"layers", {{{"k_scale", {0.5, 4.0}}, {"v_scale", 2.0}}}}};
  auto s = make("fp8_e4m3_static", 64, 2, &calib);
  std::vector<uint8_t> blk(s->block_bytes(16));
  std::vector<float> one(64, 1000.f), out(64);
  s->encode(1, one.data(), 64, 1, blk.data(), 16, 0, 0);  // head 1: scale 4 -> 250 -> representable 256 or 240
  s->decode(1, blk.data(), 16, 0, 1, 0, out.data());
  EXPECT_NEAR(out[0], 1000.f, 1000.f / 16);
  s->encode(0, one.data(), 64, 1, blk.data(), 16, 0, 0);  // head 0: scale 0.5 -> saturates at 448 * 0.5
  s->decode(0, blk.data(), 16, 0, 1, 0, out.data());
  EXPECT_EQ(out[0], 224.f);
}

// The AVX-512 encoder gives the scalar conversion's code for every input: each code's value,
// the midpoints between neighbours (ties) and the floats just beside them, the saturation
// boundaries, subnormals of both formats and of f32, signed zeros, inf, NaN, and random bit
// patterns; with a scale that divides first (as the codecs do).
TEST(Fp8, VectorEncodeMatchesScalarExactly) {
#if !defined(KVQ_HAVE_SIMD)
  GTEST_SKIP() << "built without SIMD kernels";
#else
  if (cpu_level() != CpuLevel::avx512) GTEST_SKIP() << "no AVX-512 on this machine";
  std::vector<float> xs = {0.f, -0.f, INFINITY, -INFINITY, std::nanf(""), -std::nanf(""), 1e-45f, -1e-45f,
                           1e-40f, 3.4e38f, -3.4e38f, 448.f, 449.f, 463.99f, 464.f, 464.01f, 480.f, 57344.f,
                           61439.f, 61440.f, 61441.f, 65504.f, 1e6f};
  for (const float* tbl : {fp8_e4m3_table(), fp8_e5m2_table()}) {
    std::vector<float> pos;
    for (int c = 0; c < 128; ++c)
      if (std::isfinite(tbl[c])) pos.push_back(tbl[c]);
    std::sort(pos.begin(), pos.end());
    for (size_t i = 0; i < pos.size(); ++i) {
      std::vector<float> pts = {pos[i]};
      if (i + 1 < pos.size()) pts.push_back(0.5f * (pos[i] + pos[i + 1]));
      for (float p : pts)
        for (float v : {p, std::nextafter(p, 0.f), std::nextafter(p, INFINITY)}) {
          xs.push_back(v);
          xs.push_back(-v);
        }
    }
  }
  std::mt19937 rng(99);
  for (int i = 0; i < 200000; ++i) {
    uint32_t u = rng();
    float v;
    std::memcpy(&v, &u, 4);
    xs.push_back(v);
  }
  for (float scale : {1.f, 0.37f, 3e-3f}) {
    std::vector<float> in(xs.size());
    for (size_t i = 0; i < xs.size(); ++i) in[i] = xs[i] * scale;  // x / scale then lands near xs[i]
    std::vector<uint8_t> e4(xs.size()), e5(xs.size());
    fp8_e4m3_encode_avx512(in.data(), int(in.size()), scale, e4.data());
    fp8_e5m2_encode_avx512(in.data(), int(in.size()), scale, e5.data());
    for (size_t i = 0; i < xs.size(); ++i) {
      ASSERT_EQ(int(e4[i]), int(fp8_e4m3_from_f32(in[i] / scale))) << "e4m3 x " << in[i] << " scale " << scale;
      ASSERT_EQ(int(e5[i]), int(fp8_e5m2_from_f32(in[i] / scale))) << "e5m2 x " << in[i] << " scale " << scale;
    }
  }
  // Scale 1 exactly at the listed points (no multiply in between).
  std::vector<uint8_t> e4(xs.size()), e5(xs.size());
  fp8_e4m3_encode_avx512(xs.data(), int(xs.size()), 1.f, e4.data());
  fp8_e5m2_encode_avx512(xs.data(), int(xs.size()), 1.f, e5.data());
  for (size_t i = 0; i < xs.size(); ++i) {
    ASSERT_EQ(int(e4[i]), int(fp8_e4m3_from_f32(xs[i]))) << "e4m3 " << xs[i];
    ASSERT_EQ(int(e5[i]), int(fp8_e5m2_from_f32(xs[i]))) << "e5m2 " << xs[i];
  }
#endif
}

// ---------------------------------------------------------------------------------------------
// Round-trip error bounds

TEST(RoundTrip, Int8WithinHalfStepOfAbsmax) {
  std::mt19937 rng(1);
  std::normal_distribution<float> nd;
  auto c = make("int8_rows", 128);  // one token a block; "int8" at this head_dim is int8t's tiles
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<float> x(128);
    const float mag = std::ldexp(1.f, trial % 60 - 30);  // 2^-30 .. 2^29
    for (auto& v : x) v = nd(rng) * mag;
    const float amax = std::fabs(*std::max_element(x.begin(), x.end(), [](float a, float b) { return std::fabs(a) < std::fabs(b); }));
    auto y = roundtrip(*c, x);
    for (size_t i = 0; i < x.size(); ++i)
      EXPECT_LE(std::fabs(y[i] - x[i]), amax / 254 * (1 + 1e-5f)) << trial << " " << i;
  }
}

TEST(RoundTrip, GroupedIntWithinHalfStep) {
  std::mt19937 rng(2);
  std::normal_distribution<float> nd;
  for (const char* name : {"int4_g32", "int4_g64", "int4_g128", "int2_g32", "int2_g64", "int2_g128"}) {
    auto c = make(name, 128);
    const int bits = name[3] - '0';
    const int g = std::atoi(name + 6);
    for (int trial = 0; trial < 50; ++trial) {
      std::vector<float> x(128);
      for (auto& v : x) v = nd(rng) * (trial % 2 ? 100.f : 0.01f);
      if (trial % 5 == 0) x[7] = 50 * x[7];  // an outlier
      auto y = roundtrip(*c, x);
      for (int g0 = 0; g0 < 128; g0 += g) {
        const float mn = *std::min_element(x.begin() + g0, x.begin() + g0 + g);
        const float mx = *std::max_element(x.begin() + g0, x.begin() + g0 + g);
        const float step = (mx - mn) / float((1 << bits) - 1);
        // half a step, plus the f16 rounding of scale (relative 2^-11, times up to 15 steps) and min.
        const float tol = step / 2 + step * float((1 << bits) - 1) * std::ldexp(1.f, -11) +
                          std::max(std::fabs(mn), std::fabs(mx)) * std::ldexp(1.f, -10);
        for (int i = g0; i < g0 + g; ++i) EXPECT_LE(std::fabs(y[size_t(i)] - x[size_t(i)]), tol) << name << " " << i;
      }
    }
  }
}

TEST(RoundTrip, FloatFormats) {
  std::vector<float> x = {1.f, -2.5f, 1e-3f, 65504.f, 1.0009765625f, 3.14159f, -0.f, 1e-8f};
  x.resize(16, 0.25f);
  auto f32 = roundtrip(*make("f32", 16), x);
  auto f16 = roundtrip(*make("f16", 16), x);
  auto bf = roundtrip(*make("bf16", 16), x);
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(f32[i], x[i]);
    EXPECT_EQ(f16[i], f16_to_f32(f32_to_f16(x[i])));
    EXPECT_EQ(bf[i], bf16_to_f32(f32_to_bf16(x[i])));
  }
}

// Encodes the 32 values x with the one-block codec `name` (head_dim 32, one token) and returns the
// block as llama.cpp's struct B; *y (when given) gets the decoded values.
template <class B>
B encode_ggml_block(const char* name, const std::vector<float>& x, std::vector<float>* y = nullptr) {
  auto c = make(name, 32);
  std::vector<uint8_t> blk(c->block_bytes(1));
  EXPECT_EQ(blk.size(), sizeof(B)) << name;
  c->encode(0, x.data(), 32, 1, blk.data(), 1, 0, 0);
  B b;
  std::memcpy(&b, blk.data(), sizeof b);
  if (y) {
    y->resize(32);
    c->decode(0, blk.data(), 1, 0, 1, 0, y->data());
  }
  return b;
}

// ggml's formulas, checked on values whose codes can be worked out by hand.
TEST(RoundTrip, Q8_0MatchesGgmlRounding) {
  std::vector<float> x(32, 0.f);
  x[0] = 127.f;   // absmax -> d = 1
  x[1] = -64.5f;  // roundf: half away from zero -> -65 (RNE would give -64)
  x[2] = 0.5f;    // -> 1
  x[3] = -0.5f;   // -> -1
  x[4] = 2.49f;   // -> 2
  const auto b = encode_ggml_block<kv_block_q8_0>("q8_0", x);
  EXPECT_EQ(b.d, f32_to_f16(1.f));
  EXPECT_EQ(b.qs[0], 127);
  EXPECT_EQ(b.qs[1], -65);
  EXPECT_EQ(b.qs[2], 1);
  EXPECT_EQ(b.qs[3], -1);
  EXPECT_EQ(b.qs[4], 2);
  EXPECT_EQ(b.qs[5], 0);
}

TEST(RoundTrip, Q4_0MatchesGgmlFormula) {
  // Values -16..15: the largest magnitude is -16, so d = -16 / -8 = 2 and q = trunc(x/2 + 8.5).
  std::vector<float> x(32);
  for (int j = 0; j < 32; ++j) x[size_t(j)] = float(j - 16);
  std::vector<float> y;
  auto b = encode_ggml_block<kv_block_q4_0>("q4_0", x, &y);
  EXPECT_EQ(f16_to_f32(b.d), 2.f);
  auto code = [&](int j) { return j < 16 ? b.qs[j] & 15 : b.qs[j - 16] >> 4; };
  EXPECT_EQ(code(0), 0);    // -16 -> -8 + 8.5 = 0.5 -> 0
  EXPECT_EQ(code(1), 1);    // -15 -> 1.0
  EXPECT_EQ(code(13), 7);   // -3 -> -1.5 + 8.5 = 7.0 (half rounds up)
  EXPECT_EQ(code(15), 8);   // -1 -> 8.0
  EXPECT_EQ(code(16), 8);   // 0 -> 8.5 -> 8
  EXPECT_EQ(code(17), 9);   // 1 -> 9.0
  EXPECT_EQ(code(31), 15);  // 15 -> 16.0, clamped to 15
  for (int j = 0; j < 32; ++j) EXPECT_EQ(y[size_t(j)], float(code(j) - 8) * 2.f) << j;
  // A positive extreme gives a negative d: 7.9 is the largest magnitude -> d = -0.9875.
  x.assign(32, 0.f);
  x[3] = 7.9f;
  x[4] = -7.f;
  b = encode_ggml_block<kv_block_q4_0>("q4_0", x);
  EXPECT_EQ(b.d, f32_to_f16(7.9f / -8.f));
  EXPECT_EQ(code(3), 0);   // 7.9 / d = -8 -> 0.5 -> 0
  EXPECT_EQ(code(4), 15);  // -7 / d = 7.09 -> 15.59 -> 15
}

// llama.cpp's other cache types, on values whose codes follow from ggml's formulas by hand.
TEST(RoundTrip, Q4_1AndQ5MatchGgmlFormulas) {
  auto code4 = [](const uint8_t* qs, int j) { return j < 16 ? qs[j] & 15 : qs[j - 16] >> 4; };
  auto code5 = [&](const uint8_t* qh, const uint8_t* qs, int j) {
    uint32_t h;
    std::memcpy(&h, qh, 4);
    return code4(qs, j) | int((h >> j) & 1) << 4;
  };
  std::vector<float> y;
  {  // q4_1: min 0, max 15 -> d = 1, m = 0, q = trunc(x + 0.5) clamped to 15
    std::vector<float> x(32);
    for (int j = 0; j < 32; ++j) x[size_t(j)] = float(j % 16);
    x[5] = 7.5f;    // half rounds up -> 8
    x[6] = 2.49f;   // -> 2
    x[7] = 14.6f;   // -> 15
    // (q4_1t's tiles hold these rows' codes: test_int_tiled, DecodeMatchesTheRowsBitForBit)
    const auto b = encode_ggml_block<kv_block_q4_1>("q4_1", x, &y);
    EXPECT_EQ(f16_to_f32(b.d), 1.f);
    EXPECT_EQ(f16_to_f32(b.m), 0.f);
    EXPECT_EQ(code4(b.qs, 5), 8);
    EXPECT_EQ(code4(b.qs, 6), 2);
    EXPECT_EQ(code4(b.qs, 7), 15);
    EXPECT_EQ(code4(b.qs, 15), 15);
    EXPECT_EQ(code4(b.qs, 20), 4);
    for (int j = 0; j < 32; ++j) EXPECT_EQ(y[size_t(j)], float(code4(b.qs, j))) << j;
  }
  {  // q5_0: values -16..15, largest magnitude -16 -> d = 1, q = trunc(x + 16.5) = x + 16
    std::vector<float> x(32);
    for (int j = 0; j < 32; ++j) x[size_t(j)] = float(j - 16);
    auto b = encode_ggml_block<kv_block_q5_0>("q5_0", x, &y);
    EXPECT_EQ(f16_to_f32(b.d), 1.f);
    uint32_t h;
    std::memcpy(&h, b.qh, 4);
    EXPECT_EQ(h, 0xffff0000u);  // codes 16..31 (x >= 0) are elements 16..31
    for (int j = 0; j < 32; ++j) EXPECT_EQ(code5(b.qh, b.qs, j), j) << j;
    for (int j = 0; j < 32; ++j) EXPECT_EQ(y[size_t(j)], x[size_t(j)]) << j;
    // A positive extreme: 15.5 is the largest magnitude -> d = -0.96875; 15.5 -> code 0.
    x.assign(32, 0.f);
    x[2] = 15.5f;
    x[3] = -3.f;  // -3 / d = 3.097 -> trunc(19.6) = 19
    b = encode_ggml_block<kv_block_q5_0>("q5_0", x);
    EXPECT_EQ(b.d, f32_to_f16(15.5f / -16.f));
    EXPECT_EQ(code5(b.qh, b.qs, 2), 0);
    EXPECT_EQ(code5(b.qh, b.qs, 3), 19);
    EXPECT_EQ(code5(b.qh, b.qs, 0), 16);  // 0 -> 16.5 -> 16
  }
  {  // q5_1: min 0, max 31 -> d = 1, q = x
    std::vector<float> x(32);
    for (int j = 0; j < 32; ++j) x[size_t(j)] = float((j * 7) % 32);
    const auto b = encode_ggml_block<kv_block_q5_1>("q5_1", x, &y);
    EXPECT_EQ(f16_to_f32(b.d), 1.f);
    EXPECT_EQ(f16_to_f32(b.m), 0.f);
    for (int j = 0; j < 32; ++j) EXPECT_EQ(code5(b.qh, b.qs, j), (j * 7) % 32) << j;
    for (int j = 0; j < 32; ++j) EXPECT_EQ(y[size_t(j)], x[size_t(j)]) << j;
  }
}

// iq4_nl: values on the grid (times 1/64) come back as their own indices, the least-squares
// scale is then the grid step, and the rounding picks the nearest grid point.
TEST(RoundTrip, Iq4NlPicksGridPoints) {
  std::vector<float> x(32), y;
  for (int j = 0; j < 32; ++j) x[size_t(j)] = float(kv_iq4nl_grid[(j * 5) % 16]) / 64.f;
  auto b = encode_ggml_block<kv_block_iq4_nl>("iq4_nl", x, &y);
  auto idx = [&](int j) { return j < 16 ? b.qs[j] & 15 : b.qs[j - 16] >> 4; };
  EXPECT_EQ(f16_to_f32(b.d), 1.f / 64.f);
  for (int j = 0; j < 32; ++j) EXPECT_EQ(idx(j), (j * 5) % 16) << j;
  for (int j = 0; j < 32; ++j) EXPECT_EQ(y[size_t(j)], x[size_t(j)]) << j;
  // Off the grid: the largest magnitude -127/64 fixes the step 1/64; 0.3 = 19.2 steps lies
  // between 13 and 25, nearer 25 (index 10); -0.6 = -38.4 steps between -49 and -35 -> -35.
  x.assign(32, 0.f);
  x[0] = -127.f / 64.f;
  x[1] = 0.3f;
  x[2] = -0.6f;
  b = encode_ggml_block<kv_block_iq4_nl>("iq4_nl", x);
  EXPECT_EQ(idx(0), 0);
  EXPECT_EQ(idx(1), 10);
  EXPECT_EQ(idx(2), 5);
  EXPECT_EQ(idx(3), 8);  // 0 -> nearest grid point 1
}

// Error of llama.cpp's other types against its q4_0 on Gaussian rows (the same data): the 5-bit
// codes halve it, a per-block minimum helps, and iq4_nl's grid (denser near 0) beats q4_0's even
// steps at the same 4.5 bits. Each within its step bound.
TEST(RoundTrip, LlamaCppTypesOrderAndBounds) {
  const int hd = 128, n = 256;
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  std::vector<float> x(size_t(n) * hd);
  for (auto& v : x) v = nd(rng);
  auto rms_err = [&](const char* name) {
    auto c = make(name, hd);
    std::vector<uint8_t> blk(c->block_bytes(n));
    c->encode(0, x.data(), size_t(hd), n, blk.data(), n, 0, 0);
    std::vector<float> y(x.size());
    c->decode(0, blk.data(), n, 0, n, 0, y.data());
    double e = 0, s = 0, worst = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      e += std::pow(double(y[i]) - x[i], 2);
      s += double(x[i]) * x[i];
      // Per 32-block: the error is at most half a step plus the f16 rounding of scale and min
      // (relative 2^-11 each, times the code); steps from the block's range. q4_0 / q5_0 put the
      // largest magnitude on the lowest code, so the other sign clamps one code short: a full step.
      const size_t b0 = i / 32 * 32;
      float mn = x[b0], mx = x[b0], am = 0;
      for (size_t k = b0; k < b0 + 32; ++k) {
        mn = std::min(mn, x[k]);
        mx = std::max(mx, x[k]);
        am = std::max(am, std::fabs(x[k]));
      }
      const std::string nm = name;
      const double step = nm == "q4_1" ? (mx - mn) / 15 : nm == "q5_1" ? (mx - mn) / 31 : nm == "q5_0" ? am / 16 : am / 8;
      const double half = nm == "q4_0" || nm == "q5_0" ? step : step / 2;
      const double bound = nm == "iq4_nl" ? 0.0 : half + 32 * step * 0x1p-11 + std::fabs(mn) * 0x1p-11;
      if (bound > 0) {
        EXPECT_LE(std::fabs(double(y[i]) - x[i]), bound * (1 + 1e-6)) << name << " at " << i;
      }
      worst = std::max(worst, std::fabs(double(y[i]) - x[i]) / am);
    }
    if (std::string(name) == "iq4_nl") {
      EXPECT_LT(worst, 0.12) << "iq4_nl: error relative to the block's absmax";
    }
    return std::sqrt(e / s);
  };
  const double q40 = rms_err("q4_0"), q41 = rms_err("q4_1"), q50 = rms_err("q5_0"), q51 = rms_err("q5_1"),
               iq4 = rms_err("iq4_nl");
  EXPECT_LT(q41, q40);
  EXPECT_LT(iq4, q40);
  EXPECT_LT(q50, 0.6 * q40);
  EXPECT_LT(q51, 0.6 * q41);
  EXPECT_LT(q51, q50);
}

// ---------------------------------------------------------------------------------------------
// The scale reuse trap: a scale fixed from the first tokens (int8_static, calibrated on them)
// against the per-token dynamic scale, on a sequence whose range grows 100x.

TEST(ScaleReuseTrap, FixedScaleBlowsUpDynamicDoesNot) {
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  const int hd = 128, n = 256;
  std::vector<float> x(size_t(n) * hd);
  for (int t = 0; t < n; ++t) {
    const float range = 1.f + 99.f * float(t) / float(n - 1);  // grows from 1x to 100x
    for (int d = 0; d < hd; ++d) x[size_t(t) * hd + size_t(d)] = nd(rng) * range;
  }
  float amax16 = 0;  // calibration on the first 4 tokens
  for (int i = 0; i < 4 * hd; ++i) amax16 = std::max(amax16, std::fabs(x[size_t(i)]));
  nlohmann::json calib = {{"layers", {{{"k_scale", amax16 / 127}, {"v_scale", amax16 / 127}}}}};
  auto fixed = make("int8_static", hd, 1, &calib);
  auto dyn = make("int8_rows", hd);  // per-token blocks; "int8" at this head_dim stores int8t's tiles
  auto rel_err = [&](const KvCodec& c, int t) {
    std::vector<uint8_t> blk(c.block_bytes(1));
    std::vector<float> y(hd);
    c.encode(0, x.data() + size_t(t) * hd, hd, 1, blk.data(), 1, 0, 0);
    c.decode(0, blk.data(), 1, 0, 1, 0, y.data());
    double e = 0, s = 0;
    for (int d = 0; d < hd; ++d) {
      e += std::pow(y[size_t(d)] - x[size_t(t) * hd + size_t(d)], 2);
      s += std::pow(x[size_t(t) * hd + size_t(d)], 2);
    }
    return std::sqrt(e / s);
  };
  // Early tokens: both fine.
  EXPECT_LT(rel_err(*fixed, 0), 0.03);
  EXPECT_LT(rel_err(*dyn, 0), 0.02);
  // Late tokens: the fixed scale clips everything beyond its range; the dynamic one does not care.
  const double late_fixed = rel_err(*fixed, n - 1), late_dyn = rel_err(*dyn, n - 1);
  EXPECT_GT(late_fixed, 0.5);
  EXPECT_LT(late_dyn, 0.02);
  EXPECT_GT(late_fixed, 50 * late_dyn);
}

// ---------------------------------------------------------------------------------------------
// Bytes: for every registered codec, what it claims (effective bits) is what it allocates
// (block_bytes), and encode writes inside block_bytes only.

TEST(Bytes, ClaimedEqualsAllocatedForEveryCodec) {
  for (const std::string& name : kv_codec_names()) {
    for (int hd : {128, 256}) {
      // scales for the static codecs, channel means (one head) for the centered ones
      // and channel RMS for the scaled ones
      const std::vector<std::vector<float>> mean(1, std::vector<float>(size_t(hd), 0.5f));
      const std::vector<std::vector<float>> rms(1, std::vector<float>(size_t(hd), 1.f));
      nlohmann::json calib = {{"layers", {{{"k_scale", 1.0}, {"v_scale", 1.0}, {"k_mean", mean}, {"v_mean", mean},
                                           {"k_rms", rms}, {"q_rms", rms}, {"v_rms", rms}}}}};
      for (int b : {2, 3, 4}) {
        calib["layers"][0]["kvquant_k" + std::to_string(b)] = {{"codebook", kvquant_default_codebook(b)}};
        calib["layers"][0]["kvquant_cal_k" + std::to_string(b)] = kvquant_cal_artifact(mean, rms, b);
      }
      std::unique_ptr<KvCodec> c;
      for (KvRole role : {KvRole::key, KvRole::value}) {
        try {
          c = make(name, hd, 1, &calib, role);
        } catch (const Error& e) {
          ADD_FAILURE() << name << " hd " << hd << ": " << e.what();
          continue;
        }
        const int G = std::max(1, c->info().group_tokens);
        const int bt = std::max(64, G);
        const size_t bytes = c->block_bytes(bt);
        // With no tail (ctx = whole blocks past the residual window), effective bits == block bytes.
        const int R = std::max(0, c->info().residual_tokens);
        const int ctx = R + 4 * bt;
        const double eff = kv_codec_effective_bits(*c, bt, ctx);
        const double q = kv_quantized_tokens(ctx, c->info().group_tokens, c->info().residual_tokens);
        const double expect = (8.0 * double(bytes) / bt * q + 32.0 * hd * (ctx - q)) / (double(ctx) * hd);
        EXPECT_NEAR(eff, expect, 1e-9) << name;
        EXPECT_GE(8.0 * double(bytes) / (double(bt) * hd), c->info().code_bits - 1e-9) << name;
        // Encode a full block into exactly block_bytes with canaries on both sides.
        std::vector<uint8_t> buf(bytes + 128, 0xA5);
        std::vector<float> x(size_t(bt) * size_t(hd));
        std::mt19937 rng(5);
        std::normal_distribution<float> nd;
        for (auto& v : x) v = nd(rng);
        c->encode(0, x.data(), size_t(hd), bt, buf.data() + 64, bt, 0, 0);
        for (int i = 0; i < 64; ++i) {
          EXPECT_EQ(buf[size_t(i)], 0xA5) << name << " wrote before the block";
          EXPECT_EQ(buf[bytes + 64 + size_t(i)], 0xA5) << name << " wrote past block_bytes";
        }
      }
    }
  }
}

TEST(Bytes, DocumentedBitsOfBasicFormats) {
  auto bits = [](const char* n, int hd) { return kv_codec_effective_bits(*make(n, hd), 64, 4096); };
  EXPECT_DOUBLE_EQ(bits("f16", 128), 16);
  EXPECT_DOUBLE_EQ(bits("fp8_e4m3", 128), 8);
  EXPECT_DOUBLE_EQ(bits("fp8_e4m3_dyn", 128), 8 + 32.0 / 128);
  EXPECT_DOUBLE_EQ(bits("int8", 128), 8 + 32.0 / 128);
  EXPECT_DOUBLE_EQ(bits("q8_0", 128), 8.5);
  EXPECT_DOUBLE_EQ(bits("q4_0", 128), 4.5);
  EXPECT_DOUBLE_EQ(bits("int4_g32", 128), 5);
  EXPECT_DOUBLE_EQ(bits("int4_g64", 128), 4.5);
  EXPECT_DOUBLE_EQ(bits("int4_g128", 128), 4.25);
  EXPECT_DOUBLE_EQ(bits("int2_g32", 128), 3);
  EXPECT_DOUBLE_EQ(bits("int2_g128", 128), 2.25);
}

// ---------------------------------------------------------------------------------------------
// Registry and rejected inputs

TEST(Registry, NamesAliasesCaseInsensitive) {
  EXPECT_EQ(kv_format_find("auto").name, "f16");
  EXPECT_EQ(kv_format_find("FP16").name, "f16");
  EXPECT_EQ(kv_format_find("Half").name, "f16");
  EXPECT_EQ(kv_format_find("fp8").name, "fp8_e4m3");
  EXPECT_EQ(kv_format_find("FP8_E4M3FN").name, "fp8_e4m3");
  EXPECT_EQ(kv_format_find("Q8_0").name, "q8_0");
  EXPECT_EQ(kv_format_find("int4").name, "int4t_g64");  // int4_g64 quantization, tiled kernels
  EXPECT_EQ(kv_format_find("int2").name, "int2t_g32");  // int2_g32 quantization, tiled kernels
  EXPECT_EQ(kv_format_find("k8v4").k_codec, "int8");
  EXPECT_EQ(kv_format_find("k8v4").v_codec, "int4t_g64");  // int4_g64 quantization, tiled kernels
  EXPECT_EQ(kv_format_find("q4_0").k_codec, "q4_0t");       // q4_0 quantization, tiled kernels
  EXPECT_EQ(kv_format_find("q4_0_rows").v_codec, "q4_0");
  for (const auto& f : kv_formats()) EXPECT_EQ(&kv_format_find(f.name), &f);
}

TEST(Registry, RejectsBadInput) {
  std::string e = error_of([] { kv_format_find("int3"); });
  EXPECT_NE(e.find("unknown KV format 'int3'"), std::string::npos) << e;
  EXPECT_NE(e.find("q4_0"), std::string::npos) << e;
  EXPECT_NE(e.find("fp8_e4m3 (fp8"), std::string::npos) << e;
  e = error_of([] { make("nope"); });
  EXPECT_NE(e.find("valid codecs: f32"), std::string::npos) << e;
  e = error_of([] { make("int4_g128", 96); });
  EXPECT_NE(e.find("valid group sizes for this head_dim: 32"), std::string::npos) << e;
  e = error_of([] { make("int4_g32", 80); });
  EXPECT_NE(e.find("multiple of 32"), std::string::npos) << e;
  e = error_of([] { make("q4_0", 48); });
  EXPECT_NE(e.find("multiple of 32"), std::string::npos) << e;
  e = error_of([] { make("f16", 0); });
  EXPECT_NE(e.find("head_dim"), std::string::npos) << e;
}

TEST(Registry, RejectsMalformedCalibration) {
  auto err = [](const nlohmann::json& j, int heads = 2) {
    return error_of([&] { make("fp8_e4m3_static", 64, heads, &j); });
  };
  EXPECT_NE(error_of([] { make("fp8_e4m3_static", 64); }).find("needs calibration"), std::string::npos);
  EXPECT_NE(err(nlohmann::json::array()).find("\"layers\""), std::string::npos);
  EXPECT_NE(err({{"layers", 3}}).find("\"layers\""), std::string::npos);
  EXPECT_NE(err({{"layers", nlohmann::json::array()}}).find("0 layers"), std::string::npos);
  EXPECT_NE(err({{"layers", {{{"v_scale", 1}}}}}).find("no \"k_scale\""), std::string::npos);
  EXPECT_NE(err({{"layers", {{{"k_scale", "big"}}}}}).find("expected a number"), std::string::npos);
  EXPECT_NE(err({{"layers", {{{"k_scale", -1.0}}}}}).find("positive"), std::string::npos);
  EXPECT_NE(err({{"layers", {{{"k_scale", 0}}}}}).find("positive"), std::string::npos);
  EXPECT_NE(err({{"layers", {{{"k_scale", {1.0, 2.0, 3.0}}}}}}).find("one per KV head"), std::string::npos);
  EXPECT_NE(err({{"layers", {{{"k_scale", {1.0, nullptr}}}}}}).find("expected a number"), std::string::npos);
  EXPECT_EQ(err({{"layers", {{{"k_scale", {1.0, 2.0}}}}}}), "");
  EXPECT_EQ(err({{"layers", {{{"k_scale", 0.25}}}}}, 1), "");
}

// ---------------------------------------------------------------------------------------------
// Kernel parity: AVX2 and AVX-512 against the scalar reference, every row format, random and
// adversarial rows, every n_q 1..9 (covers the batching of query rows by 8).

namespace {

struct ElemCase {
  KvElem e;
  int group;
  const char* name;
};
const ElemCase kElems[] = {
    {KvElem::f32, 0, "f32"},        {KvElem::f16, 0, "f16"},           {KvElem::bf16, 0, "bf16"},
    {KvElem::e4m3, 0, "e4m3"},      {KvElem::e5m2, 0, "e5m2"},         {KvElem::e4m3_dyn, 0, "e4m3_dyn"},
    {KvElem::e5m2_dyn, 0, "e5m2_dyn"}, {KvElem::int8, 0, "int8"},      {KvElem::int8_static, 0, "int8_static"},
    {KvElem::int4g, 32, "int4g32"}, {KvElem::int4g, 64, "int4g64"},    {KvElem::int4g, 128, "int4g128"},
    {KvElem::int2g, 32, "int2g32"}, {KvElem::int2g, 128, "int2g128"},  {KvElem::q8_0, 0, "q8_0"},
    {KvElem::q4_0, 0, "q4_0"},      {KvElem::q4_1, 0, "q4_1"},         {KvElem::q5_0, 0, "q5_0"},
    {KvElem::q5_1, 0, "q5_1"},      {KvElem::iq4_nl, 0, "iq4_nl"},
};

enum class Pattern { random, outlier_channel, constant_rows, zeros, huge, tiny, mixed_scale, beyond_f16 };

std::vector<float> make_rows(Pattern p, int n, int hd, std::mt19937& rng) {
  std::normal_distribution<float> nd;
  std::vector<float> x(size_t(n) * size_t(hd));
  for (int t = 0; t < n; ++t) {
    for (int d = 0; d < hd; ++d) {
      float& v = x[size_t(t) * size_t(hd) + size_t(d)];
      switch (p) {
        case Pattern::random: v = nd(rng); break;
        case Pattern::outlier_channel: v = nd(rng) * (d == 5 || d == hd - 3 ? 300.f : 1.f); break;
        case Pattern::constant_rows: v = 0.75f * float(t % 3 - 1); break;
        case Pattern::zeros: v = 0; break;
        case Pattern::huge: v = nd(rng) * 1e4f; break;  // within f16 range: the f16-scaled formats' domain
        case Pattern::beyond_f16: v = nd(rng) * 1e30f; break;  // formats with f32 scales only
        case Pattern::tiny: v = nd(rng) * 1e-6f; break;  // f16 subnormals
        case Pattern::mixed_scale: v = nd(rng) * std::ldexp(1.f, (t % 20) - 10); break;
      }
    }
  }
  return x;
}

}  // namespace

TEST(KernelParity, SimdMatchesReferenceOnAllRowFormats) {
#if !defined(KVQ_HAVE_SIMD)
  GTEST_SKIP() << "built without SIMD kernels";
#else
  const CpuFeatures& cf = cpu_features();
  std::mt19937 rng(11);
  std::normal_distribution<float> nd;
  for (const ElemCase& ec : kElems) {
    for (int hd : {64, 128, 256}) {
      if (ec.group > hd) continue;
      const KvRowFmt f = kv_row_fmt(ec.e, hd, ec.group);
      for (Pattern pat : {Pattern::random, Pattern::outlier_channel, Pattern::constant_rows, Pattern::zeros,
                          Pattern::huge, Pattern::tiny, Pattern::mixed_scale, Pattern::beyond_f16}) {
        if (pat == Pattern::beyond_f16 && !(ec.e == KvElem::f32 || ec.e == KvElem::bf16 || ec.e == KvElem::int8 ||
                                            ec.e == KvElem::e4m3_dyn || ec.e == KvElem::e5m2_dyn))
          continue;
        // n: one token, a count that leaves a remainder after every token-group width (1..16)
        // of the score kernels, and a full 64-token block.
        for (int n : {1, 37, 64}) {
        const float scale = (ec.e == KvElem::e4m3 || ec.e == KvElem::e5m2 || ec.e == KvElem::int8_static) ? 0.37f : 1.f;
        auto x = make_rows(pat, n, hd, rng);
        std::vector<uint8_t> rows(size_t(n) * f.row_bytes);
        for (int t = 0; t < n; ++t) kv_row_encode(f, scale, x.data() + size_t(t) * hd, rows.data() + size_t(t) * f.row_bytes);
        std::vector<float> dec(size_t(n) * hd);
        for (int t = 0; t < n; ++t) kv_row_decode(f, scale, rows.data() + size_t(t) * f.row_bytes, dec.data() + size_t(t) * hd);
        for (int nq = 1; nq <= 9; ++nq) {
          std::vector<float> q(size_t(nq) * hd), p(size_t(nq) * n);
          for (auto& v : q) v = nd(rng);
          for (auto& v : p) v = std::fabs(nd(rng));
          // Tolerance: f32 reassociation over hd terms, relative to sum |q||x|.
          std::vector<float> mag(size_t(nq) * n, 0.f);
          for (int i = 0; i < nq; ++i)
            for (int t = 0; t < n; ++t)
              for (int d = 0; d < hd; ++d)
                mag[size_t(i) * n + size_t(t)] += std::fabs(q[size_t(i) * hd + size_t(d)] * dec[size_t(t) * hd + size_t(d)]);
          std::vector<float> s_ref(size_t(nq) * n), a_ref(size_t(nq) * hd, 0.5f);
          kv_rows_scores_ref(f, scale, q.data(), nq, rows.data(), f.row_bytes, n, s_ref.data(), n);
          kv_rows_accum_ref(f, scale, p.data(), n, nq, rows.data(), f.row_bytes, n, a_ref.data());
          std::vector<float> amag(size_t(nq) * hd, 0.5f);
          for (int i = 0; i < nq; ++i)
            for (int t = 0; t < n; ++t)
              for (int d = 0; d < hd; ++d)
                amag[size_t(i) * hd + size_t(d)] += std::fabs(p[size_t(i) * n + size_t(t)] * dec[size_t(t) * hd + size_t(d)]);
          for (int variant = 0; variant < 2; ++variant) {
            if (variant == 0 && !(cf.avx2 && cf.fma)) continue;
            if (variant == 1 && !(cf.avx512f && cf.avx512bw && cf.avx512vl)) continue;
            std::vector<float> s(size_t(nq) * n), a(size_t(nq) * hd, 0.5f);
            if (variant == 0) {
              kv_rows_scores_avx2(f, scale, q.data(), nq, rows.data(), f.row_bytes, n, s.data(), n);
              kv_rows_accum_avx2(f, scale, p.data(), n, nq, rows.data(), f.row_bytes, n, a.data());
            } else {
              kv_rows_scores_avx512(f, scale, q.data(), nq, rows.data(), f.row_bytes, n, s.data(), n);
              kv_rows_accum_avx512(f, scale, p.data(), n, nq, rows.data(), f.row_bytes, n, a.data());
            }
            // bf16 rows on AVX-512 round the query / the weights to bf16 (kv_rows.h, kv_rows_bf16_rel).
            const bool bf = variant == 1 && kv_rows_bf16_dot_active(f);
            for (size_t i = 0; i < s.size(); ++i) {
              double bb = 0;
              if (bf) {
                const int qi = int(i) / n, t = int(i) % n;
                double flush = 0;
                for (int d = 0; d < hd; ++d)
                  flush += std::fabs(q[size_t(qi) * hd + size_t(d)]) + std::fabs(dec[size_t(t) * hd + size_t(d)]);
                bb = kv_rows_bf16_rel * mag[i] + kv_rows_bf16_flush * flush;
              }
              ASSERT_NEAR(s[i], s_ref[i], 1e-5f * mag[i] + 1e-37f + bb)
                  << ec.name << " n " << n << " hd " << hd << " pattern " << int(pat) << " nq " << nq << " variant " << variant;
            }
            // AVX-512 sums the 4-bit / 2-bit rows with int16 weights (head_dim % 64 == 0): the
            // derived bound of kv_int_dot_bound.h (test_kv_rows_accum.cpp tests it in depth).
            std::vector<double> ibound;
            if (variant == 1 && test::kv_int_accum_active(f))
              ibound = test::kv_int_accum_bound(f, p.data(), n, nq, rows.data(), f.row_bytes, n);
            for (size_t i = 0; i < a.size(); ++i) {
              double bb = 0;
              if (bf) {
                const int qi = int(i) / hd, d = int(i) % hd;
                double flush = 0;
                for (int t = 0; t < n; ++t)
                  flush += std::fabs(p[size_t(qi) * n + size_t(t)]) + std::fabs(dec[size_t(t) * hd + size_t(d)]);
                bb = kv_rows_bf16_rel * amag[i] + kv_rows_bf16_flush * flush;
              }
              ASSERT_NEAR(a[i], a_ref[i], 1e-5f * amag[i] + (ibound.empty() ? 0.0 : ibound[i]) + bb)
                  << ec.name << " n " << n << " hd " << hd << " pattern " << int(pat) << " nq " << nq << " variant " << variant;
            }
          }
        }
        }
      }
    }
  }
#endif
}

// Integer-dot scores (query quantized to int8 per 32-block, kv_rows.h) against the float-query
// reference: within the bound derived from the query rounding (kv_int_dot_bound.h), on the same
// adversarial rows, and on adversarial queries (an outlier channel that coarsens its block's
// step, an all-zero block, tiny and huge magnitudes). At the scalar level the prepared path is the
// reference itself.
TEST(KernelParity, IntDotScoresWithinQueryQuantizationBound) {
#if !defined(KVQ_HAVE_SIMD)
  GTEST_SKIP() << "built without SIMD kernels";
#else
  const CpuFeatures& cf = cpu_features();
  std::mt19937 rng(17);
  std::normal_distribution<float> nd;
  const ElemCase cases[] = {{KvElem::q4_0, 0, "q4_0"}, {KvElem::int4g, 32, "int4g32"},
                            {KvElem::int4g, 64, "int4g64"}, {KvElem::int4g, 128, "int4g128"},
                            {KvElem::int2g, 32, "int2g32"}, {KvElem::int2g, 64, "int2g64"},
                            {KvElem::int2g, 128, "int2g128"}};
  double worst_ratio = 0;
  for (const ElemCase& ec : cases) {
    for (int hd : {64, 128, 192, 256}) {
      if (ec.group > hd || (ec.group && hd % ec.group)) continue;
      const KvRowFmt f = kv_row_fmt(ec.e, hd, ec.group);
      ASSERT_EQ(kv_rows_int_dot_ok(f), ec.e != KvElem::int2g || hd % 128 == 0) << ec.name << " " << hd;
      if (!kv_rows_int_dot_ok(f)) continue;
      const int extra = kv_rows_query_extra_floats(f);
      ASSERT_EQ(extra, hd / 2);
      for (Pattern pat : {Pattern::random, Pattern::outlier_channel, Pattern::constant_rows, Pattern::zeros,
                          Pattern::huge, Pattern::tiny, Pattern::mixed_scale}) {
        // n = 1: remainder paths only; 37: every token-group width leaves a remainder (head_dim
        // 64 pairs tokens); 64: a full block.
        for (int n : {1, 37, 64}) {
        auto x = make_rows(pat, n, hd, rng);
        std::vector<uint8_t> rows(size_t(n) * f.row_bytes);
        for (int t = 0; t < n; ++t) kv_row_encode(f, 1.f, x.data() + size_t(t) * hd, rows.data() + size_t(t) * f.row_bytes);
        for (int nq = 1; nq <= 9; ++nq) {
          std::vector<float> q(size_t(nq) * hd);
          for (int i = 0; i < nq; ++i)
            for (int d = 0; d < hd; ++d) {
              float v = nd(rng);
              switch (i % 4) {
                case 1: v *= (d == 7 ? 500.f : 1.f); break;          // outlier channel
                case 2: v = d < 32 ? 0.f : v * 1e-5f; break;         // a zero block, tiny rest
                case 3: v *= 3e3f; break;                            // large
                default: break;
              }
              q[size_t(i) * hd + size_t(d)] = v;
            }
          std::vector<float> qp(size_t(nq) * size_t(hd + extra));
          kv_rows_prepare_query(f, q.data(), nq, qp.data());
          std::vector<float> s_ref(size_t(nq) * n);
          kv_rows_scores_ref(f, 1.f, q.data(), nq, rows.data(), f.row_bytes, n, s_ref.data(), n);
          for (int variant = 0; variant < 3; ++variant) {
            if (variant == 0 && !(cf.avx2 && cf.fma && cf.f16c)) continue;
            if (variant == 1 && cpu_level() != CpuLevel::avx512) continue;
            std::vector<float> s(size_t(nq) * n, -1.f);
            if (variant == 0) kv_rows_scores_i8_avx2(f, qp.data(), nq, rows.data(), f.row_bytes, n, s.data(), n);
            if (variant == 1) kv_rows_scores_i8_avx512(f, qp.data(), nq, rows.data(), f.row_bytes, n, s.data(), n);
            if (variant == 2) {
              const CpuLevel saved = cpu_set_level(CpuLevel::scalar);
              kv_rows_scores_prepared(f, 1.f, qp.data(), nq, rows.data(), f.row_bytes, n, s.data(), n);
              cpu_set_level(saved);
            }
            for (int i = 0; i < nq; ++i)
              for (int t = 0; t < n; ++t) {
                const size_t k = size_t(i) * n + size_t(t);
                if (variant == 2) {
                  ASSERT_EQ(s[k], s_ref[k]) << ec.name << " scalar level must be the reference";
                  continue;
                }
                const double b = test::int_dot_bound(f, q.data() + size_t(i) * hd, rows.data() + size_t(t) * f.row_bytes);
                ASSERT_LE(std::fabs(double(s[k]) - double(s_ref[k])), b)
                    << ec.name << " n " << n << " hd " << hd << " pattern " << int(pat) << " nq " << nq << " i " << i << " t " << t
                    << " variant " << variant;
                worst_ratio = std::max(worst_ratio, std::fabs(double(s[k]) - double(s_ref[k])) / b);
              }
          }
        }
        }
      }
    }
  }
  // The bound is a worst case; typical errors sit well inside it (a sign the bound is not vacuous
  // is that the quantization error is visible at all).
  EXPECT_GT(worst_ratio, 1e-4);
#endif
}

// Special codes the encoder never produces from finite input: E4M3 NaN and E5M2 inf/NaN must
// decode the same way in every variant.
TEST(KernelParity, Fp8SpecialCodes) {
#if !defined(KVQ_HAVE_SIMD)
  GTEST_SKIP() << "built without SIMD kernels";
#else
  const CpuFeatures& cf = cpu_features();
  for (KvElem e : {KvElem::e4m3, KvElem::e5m2}) {
    const KvRowFmt f = kv_row_fmt(e, 16);
    std::vector<uint8_t> row(16);
    for (int c0 = 0; c0 < 256; c0 += 16) {
      for (int j = 0; j < 16; ++j) row[size_t(j)] = uint8_t(c0 + j);
      std::vector<float> ref(16);
      kv_row_decode(f, 1.f, row.data(), ref.data());
      for (int j = 0; j < 16; ++j) {
        // one-hot query picks element j: score = decoded value (inf * 0 terms avoided by the
        // accumulate path: p one-hot on a single row gives acc = value)
        // Each SIMD level this CPU runs (an AVX2-only machine skips the AVX-512 kernels).
        std::vector<float> p(1, 1.f);
        for (int variant = 0; variant < 2; ++variant) {
          if (variant == 0 && !(cf.avx2 && cf.fma && cf.f16c)) continue;
          if (variant == 1 && !(cf.avx512f && cf.avx512bw && cf.avx512vl)) continue;
          std::vector<float> a(16, 0.f);
          (variant == 0 ? kv_rows_accum_avx2 : kv_rows_accum_avx512)(f, 1.f, p.data(), 1, 1, row.data(), 16, 1, a.data());
          const float v = a[size_t(j)];
          if (std::isnan(ref[size_t(j)])) EXPECT_TRUE(std::isnan(v)) << c0 + j << " variant " << variant;
          else EXPECT_EQ(v, ref[size_t(j)]) << c0 + j << " variant " << variant;
        }
      }
    }
  }
#endif
}

// Every codec of the row families, through the codec API (partial spans, head > 0): fused
// scores/accumulate agree with decode-then-dot at every CPU level. (The TurboQuant / KIVI /
// KVQuant families test their own kernels: some of their scores are estimators, not decode-dot.)
TEST(KernelParity, EveryCodecFusedMatchesDecode) {
  // static scales, and channel means (2 heads, head_dim 128) for the centered codecs
  std::vector<std::vector<float>> mean(2, std::vector<float>(128));
  for (int c = 0; c < 128; ++c) mean[0][size_t(c)] = mean[1][size_t(127 - c)] = (c % 9 == 4) ? 3.f : 0.1f * float(c % 5);
  // channel RMS for the scaled codecs: uneven, so their scales differ per channel and head
  std::vector<std::vector<float>> rms(2, std::vector<float>(128)), qrms = rms;
  for (int c = 0; c < 128; ++c) {
    rms[0][size_t(c)] = rms[1][size_t(127 - c)] = 4.f + float(c % 7);
    qrms[0][size_t(c)] = qrms[1][size_t(c)] = 0.5f + 0.25f * float(c % 3);
  }
  nlohmann::json calib = {{"layers", {{{"k_scale", 0.05}, {"v_scale", 0.05}, {"k_mean", mean}, {"v_mean", mean},
                                       {"k_rms", rms}, {"q_rms", qrms}, {"v_rms", rms}}}}};
  for (int b : {2, 3, 4}) {
    calib["layers"][0]["kvquant_k" + std::to_string(b)] = {{"codebook", kvquant_default_codebook(b)}};
    calib["layers"][0]["kvquant_cal_k" + std::to_string(b)] = kvquant_cal_artifact(mean, rms, b);
  }
  std::mt19937 rng(21);
  std::normal_distribution<float> nd;
  const CpuLevel saved = cpu_set_level(CpuLevel::avx512);
  for (const std::string& name : kv_codec_names()) {
    for (KvRole role : {KvRole::key, KvRole::value}) {
      auto c = make(name, 128, 2, &calib, role);
      if (!dynamic_cast<const KvRowCodec*>(c.get())) continue;
      const int G = std::max(1, c->info().group_tokens);
      const int bt = std::max(64, G);
      std::vector<uint8_t> blk(c->block_bytes(bt));
      std::vector<float> x(size_t(bt) * 128);
      for (size_t i = 0; i < x.size(); ++i) x[i] = nd(rng) * ((i % 128) == 9 ? 20.f : 1.f);
      c->encode(1, x.data(), 128, bt, blk.data(), bt, 0, 0);
      const int t0 = G > 1 ? 0 : 3, n = G > 1 ? bt : bt - 5;
      std::vector<float> dec(size_t(n) * 128);
      c->decode(1, blk.data(), bt, t0, n, 0, dec.data());
      const int nq = 4;
      std::vector<float> q(size_t(nq) * 128), qp(size_t(nq) * size_t(c->prepared_query_dim()));
      for (auto& v : q) v = nd(rng);
      std::vector<float> p(size_t(nq) * size_t(n));
      for (auto& v : p) v = std::fabs(nd(rng)) / float(n);
      for (CpuLevel lvl : {CpuLevel::scalar, CpuLevel::avx2, CpuLevel::avx512}) {
        cpu_set_level(lvl);
        c->prepare_query(1, q.data(), nq, qp.data());
        std::vector<float> s(size_t(nq) * size_t(n)), acc(size_t(nq) * 128, 0.f);
        c->scores(1, qp.data(), nq, blk.data(), bt, t0, n, 0, s.data(), n);
        c->accumulate(1, p.data(), n, nq, blk.data(), bt, t0, n, acc.data());
        c->finish_output(1, acc.data(), nq);
        for (int i = 0; i < nq; ++i) {
          for (int t = 0; t < n; ++t) {
            double ref = 0, mag = 0;
            for (int d = 0; d < 128; ++d) {
              ref += double(q[size_t(i) * 128 + size_t(d)]) * dec[size_t(t) * 128 + size_t(d)];
              mag += std::fabs(double(q[size_t(i) * 128 + size_t(d)]) * dec[size_t(t) * 128 + size_t(d)]);
            }
            // The 4-bit formats score with an int8 image of the query above the scalar level.
            const auto* rc = dynamic_cast<const KvRowCodec*>(c.get());
            const double qbound = lvl != CpuLevel::scalar && kv_rows_int_dot_ok(rc->fmt())
                                      ? test::int_dot_bound(rc->fmt(), q.data() + size_t(i) * 128,
                                                            blk.data() + size_t(t0 + t) * rc->fmt().row_bytes)
                                      : 0.0;
            // bf16 rows on AVX-512: the query rounded to bf16 (kv_rows.h, kv_rows_bf16_rel).
            const bool bf = lvl == CpuLevel::avx512 && kv_rows_bf16_dot_active(rc->fmt());
            ASSERT_NEAR(s[size_t(i) * size_t(n) + size_t(t)], ref, qbound + 1e-4 * mag + 1e-6 + (bf ? kv_rows_bf16_rel * mag : 0.0))
                << name << " " << cpu_level_name(lvl);
          }
          // AVX-512 sums the 4-bit / 2-bit rows with int16 weights: the derived bound.
          const auto* rcv = dynamic_cast<const KvRowCodec*>(c.get());
          std::vector<double> ibound;
          if (lvl == CpuLevel::avx512 && test::kv_int_accum_active(rcv->fmt()))
            ibound = test::kv_int_accum_bound(rcv->fmt(), p.data() + size_t(i) * size_t(n), n, 1,
                                              blk.data() + size_t(t0) * rcv->fmt().row_bytes, rcv->fmt().row_bytes, n);
          for (int d = 0; d < 128; ++d) {
            double ref = 0, mag = 0;
            for (int t = 0; t < n; ++t) {
              ref += double(p[size_t(i) * size_t(n) + size_t(t)]) * dec[size_t(t) * 128 + size_t(d)];
              mag += std::fabs(double(p[size_t(i) * size_t(n) + size_t(t)]) * dec[size_t(t) * 128 + size_t(d)]);
            }
            const double bfb = lvl == CpuLevel::avx512 && kv_rows_bf16_dot_active(rcv->fmt()) ? kv_rows_bf16_rel * mag : 0.0;
            ASSERT_NEAR(acc[size_t(i) * 128 + size_t(d)], ref, 1e-4 * mag + 1e-6 + bfb + (ibound.empty() ? 0.0 : ibound[size_t(d)]))
                << name << " " << cpu_level_name(lvl);
          }
        }
      }
    }
  }
  cpu_set_level(saved);
}

// ---------------------------------------------------------------------------------------------
// "@gN": a grouped codec's token group set by its name, so that one run (kvq eval --kv, a
// per-layer policy) can hold several group lengths: the same codec as KvCodecParams::group_tokens
// = N, bit for bit; per-token codecs and malformed suffixes are refused by name.

TEST(GroupSuffix, SameCodecAsTheGroupParameter) {
  for (const char* name : {"kivi4_k", "kivi2_v", "kvquant3_k", "kvquant4_v"}) {
    for (int g : {16, 64, 128}) {
      KvCodecParams p;
      p.head_dim = 128;
      p.role = std::string(name).find("_v") != std::string::npos ? KvRole::value : KvRole::key;
      p.group_tokens = 32;  // the suffix wins over the parameter
      auto by_name = kv_codec_create(std::string(name) + "@g" + std::to_string(g), p);
      p.group_tokens = g;
      auto by_param = kv_codec_create(name, p);
      EXPECT_EQ(by_name->info().group_tokens, g) << name;
      const int bt = 256;
      ASSERT_EQ(by_name->block_bytes(bt), by_param->block_bytes(bt)) << name << " g " << g;
      std::mt19937 rng{uint32_t(g)};
      std::normal_distribution<float> nd;
      std::vector<float> x(size_t(bt) * 128);
      for (float& v : x) v = nd(rng) * 3.f;
      std::vector<uint8_t> a(by_name->block_bytes(bt)), b(a.size());
      by_name->encode(0, x.data(), 128, bt, a.data(), bt, 0, 0);
      by_param->encode(0, x.data(), 128, bt, b.data(), bt, 0, 0);
      EXPECT_EQ(a, b) << name << " g " << g;
    }
  }
}

TEST(GroupSuffix, PerTokenCodecsAndMalformedSuffixesRefused) {
  auto error_of = [](const std::string& name) {
    try {
      make(name);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(error_of("q4_0t@g64").find("stores each token on its own"), std::string::npos);
  EXPECT_NE(error_of("f16@g32").find("stores each token on its own"), std::string::npos);
  for (const char* bad : {"kivi4_k@g0", "kivi4_k@g", "kivi4_k@gx", "kivi4_k@g2000", "kivi4_k@32", "kivi4_k@g32x"})
    EXPECT_NE(error_of(bad).find("token-group suffix"), std::string::npos) << bad;
  EXPECT_NE(error_of("nope@g32").find("unknown KV codec"), std::string::npos);
}
