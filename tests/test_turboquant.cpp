// TurboQuant: the theory (Lloyd-Max distortion, bounds, QJL unbiasedness and variance), the
// rotations, the record layout, and parity of the SIMD kernels with the scalar reference.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <numbers>
#include <random>
#include <string>
#include <vector>

#include "attn/attention.h"
#include "core/aligned.h"
#include "core/cpu.h"
#include "core/dtypes.h"
#include "core/error.h"
#include "kv/turboquant.h"
#include "kvq/kv_format.h"

using namespace kvq;

namespace {

struct Named {
  const char* name;
  TqConfig cfg;
};

const std::vector<Named>& all_configs() {
  using R = TqRotationKind;
  static const std::vector<Named> v = {
      {"tq1", {1, false, R::hadamard}},      {"tq2", {2, false, R::hadamard}},
      {"tq3", {3, false, R::hadamard}},      {"tq4", {4, false, R::hadamard}},
      {"tq2.25", {2.25, false, R::hadamard}}, {"tq2.5", {2.5, false, R::hadamard}},
      {"tq3.5", {3.5, false, R::hadamard}},  {"tq2_qjl", {2, true, R::hadamard}},
      {"tq3_qjl", {3, true, R::hadamard}},   {"tq4_qjl", {4, true, R::hadamard}},
      {"tq4_dense", {4, false, R::dense}},
  };
  return v;
}

KvCodecParams params(int dim, uint64_t seed = 0x6b7671, int layer = 0, KvRole role = KvRole::key) {
  KvCodecParams p;
  p.head_dim = dim;
  p.seed = seed;
  p.layer = layer;
  p.role = role;
  return p;
}

std::vector<float> random_unit(std::mt19937_64& rng, int d) {
  std::normal_distribution<float> nd;
  std::vector<float> x(static_cast<size_t>(d));
  double s = 0;
  for (auto& v : x) {
    v = nd(rng);
    s += double(v) * v;
  }
  for (auto& v : x) v = float(v / std::sqrt(s));
  return x;
}

// Mean ||x - decode(encode(x))||^2 over n random unit vectors.
double measure_distortion(const KvCodec& c, int n, uint64_t seed) {
  const int d = c.head_dim();
  std::mt19937_64 rng(seed);
  std::vector<uint8_t> block(c.block_bytes(1));
  std::vector<float> y(static_cast<size_t>(d));
  double sum = 0;
  for (int i = 0; i < n; ++i) {
    auto x = random_unit(rng, d);
    c.encode(0, x.data(), size_t(d), 1, block.data(), 1, 0, 0);
    c.decode(0, block.data(), 1, 0, 1, 0, y.data());
    double e = 0;
    for (int j = 0; j < d; ++j) e += double(x[size_t(j)] - y[size_t(j)]) * (x[size_t(j)] - y[size_t(j)]);
    sum += e;
  }
  return sum / n;
}

double dot(const float* a, const float* b, int n) {
  double s = 0;
  for (int i = 0; i < n; ++i) s += double(a[i]) * b[i];
  return s;
}

// Largest |centroid| of a configuration's codebooks (both segments of a fractional split).
double cb_max_of(const TqConfig& cfg, int dim) {
  std::vector<int> bits;
  if (cfg.qjl) {
    bits = {int(cfg.bits) - 1};
  } else {
    const int bl = int(std::floor(cfg.bits));
    bits = {bl};
    if (cfg.bits != bl) bits.push_back(bl + 1);
  }
  double m = 0;
  for (int b : bits)
    for (float c : tq_codebook(b, dim)) m = std::max(m, double(std::fabs(c)));
  return m;
}

// The documented bound of the AVX-512 int8 score path for one score (0 when another variant
// runs): rotated query qp (dim), key norm x_norm.
double int8_bound(const TqConfig& cfg, int dim, const float* qp, double x_norm) {
  if (std::string(tq_kernels_for(cpu_level()).name) != "avx512" || cfg.qjl) return 0;  // QJL: floats
  double l1 = 0, mx = 0;
  for (int c = 0; c < dim; ++c) {
    l1 += std::fabs(qp[c]);
    mx = std::max(mx, double(std::fabs(qp[c])));
  }
  // 1% over the derivation: the float scaling of q and the final float sums add a few ulps.
  return 1.01 * tq_score_error_bound(x_norm, l1, mx, cb_max_of(cfg, dim), dim);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Lloyd-Max

TEST(TqLloydMax, CodebookIsSymmetricSortedWithMidpointBounds) {
  for (int dim : {16, 64, 128, 256}) {
    for (int b = 1; b <= 4; ++b) {
      const TqCodebook& cb = tq_lloyd_max(b, dim);
      ASSERT_EQ(cb.centroids.size(), size_t(1) << b);
      ASSERT_EQ(cb.bounds.size(), (size_t(1) << b) - 1);
      for (size_t i = 0; i < cb.centroids.size(); ++i) {
        EXPECT_NEAR(cb.centroids[i], -cb.centroids[cb.centroids.size() - 1 - i], 1e-7);
        if (i) {
          EXPECT_LT(cb.centroids[i - 1], cb.centroids[i]);
        }
      }
      for (size_t i = 0; i < cb.bounds.size(); ++i)
        EXPECT_NEAR(cb.bounds[i], 0.5f * (cb.centroids[i] + cb.centroids[i + 1]), 1e-7);
      EXPECT_EQ(tq_codebook(b, dim), cb.centroids);
    }
  }
}

TEST(TqLloydMax, DistortionMatchesPublishedValues) {
  // Lloyd-Max distortion of the rotated-coordinate density at d = 128 (kv-formats.md / paper).
  const double expect[4] = {0.360, 0.116, 0.034, 0.0094};
  for (int b = 1; b <= 4; ++b) {
    const double m = tq_lloyd_max_mse(b, 128);
    std::printf("lloyd-max d=128 b=%d: %.5f (%d iterations)\n", b, m, tq_lloyd_max(b, 128).iterations);
    EXPECT_NEAR(m, expect[b - 1], 0.02 * expect[b - 1]) << "bits " << b;
    // Theorem 1 of the paper: 4^-b <= D_mse <= sqrt(3) pi / 2 * 4^-b.
    EXPECT_LT(m, std::sqrt(3.0) * std::numbers::pi / 2 * std::pow(4.0, -b));
    EXPECT_GT(m, std::pow(4.0, -b));
  }
  // As d grows the density tends to N(0, 1/d): the Gaussian Lloyd-Max distortions
  // (Max 1960: 0.3634, 0.1175, 0.03454, 0.009497) are the limit.
  const double gauss[4] = {0.3634, 0.1175, 0.03454, 0.009497};
  for (int b = 1; b <= 4; ++b) EXPECT_NEAR(tq_lloyd_max_mse(b, 4096), gauss[b - 1], 0.003 * gauss[b - 1]);
  // and the finite-d density (lighter tails) is slightly easier.
  for (int b = 1; b <= 4; ++b) EXPECT_LT(tq_lloyd_max_mse(b, 64), tq_lloyd_max_mse(b, 256));
}

TEST(TqLloydMax, RejectsBadArguments) {
  EXPECT_THROW(tq_lloyd_max(0, 128), Error);
  EXPECT_THROW(tq_lloyd_max(9, 128), Error);
  EXPECT_THROW(tq_lloyd_max(2, 4), Error);
}

// ---------------------------------------------------------------------------------------------
// Rotations

TEST(TqRotation, OrthogonalAndExactlyInvertible) {
  std::mt19937_64 rng(7);
  std::normal_distribution<float> nd;
  struct Case {
    TqRotationKind kind;
    int dim;
  };
  for (Case cs : {Case{TqRotationKind::hadamard, 64}, Case{TqRotationKind::hadamard, 128},
                  Case{TqRotationKind::hadamard, 256}, Case{TqRotationKind::dense, 64},
                  Case{TqRotationKind::dense, 96}, Case{TqRotationKind::dense, 128}}) {
    TqRotation r(cs.kind, cs.dim, 1234);
    const int d = cs.dim;
    for (int trial = 0; trial < 20; ++trial) {
      std::vector<float> x(static_cast<size_t>(d)), y(static_cast<size_t>(d)), z(static_cast<size_t>(d));
      for (auto& v : x) v = nd(rng);
      if (trial == 0) std::fill(x.begin(), x.end(), 0.f), x[3] = 1.f;  // basis vector
      if (trial == 1) std::fill(x.begin(), x.end(), 1.f);              // constant row
      r.forward(x.data(), y.data());
      r.inverse(y.data(), z.data());
      const double nx = std::sqrt(dot(x.data(), x.data(), d)), ny = std::sqrt(dot(y.data(), y.data(), d));
      EXPECT_NEAR(ny, nx, 1e-5 * nx) << "dim " << d;
      for (int i = 0; i < d; ++i) EXPECT_NEAR(z[size_t(i)], x[size_t(i)], 1e-5 * nx) << "dim " << d;
      // in place
      std::vector<float> w = x;
      r.forward(w.data(), w.data());
      for (int i = 0; i < d; ++i) EXPECT_EQ(w[size_t(i)], y[size_t(i)]);
    }
    // Columns orthonormal: <R e_i, R e_j> = delta_ij.
    std::vector<float> cols(size_t(d) * size_t(d));
    for (int i = 0; i < d; ++i) {
      std::vector<float> e(size_t(d), 0.f);
      e[size_t(i)] = 1.f;
      r.forward(e.data(), &cols[size_t(i) * size_t(d)]);
    }
    double worst = 0;
    for (int i = 0; i < d; ++i)
      for (int j = 0; j <= i; ++j)
        worst = std::max(worst, std::fabs(dot(&cols[size_t(i) * size_t(d)], &cols[size_t(j) * size_t(d)], d) - (i == j)));
    EXPECT_LT(worst, 1e-5) << "dim " << d;
  }
}

TEST(TqRotation, HadamardNeedsPowerOfTwoCodecsFallBackToDense) {
  EXPECT_THROW(TqRotation(TqRotationKind::hadamard, 96, 1), Error);
  EXPECT_NO_THROW(TqRotation(TqRotationKind::dense, 96, 1));
  try {
    TqRotation(TqRotationKind::hadamard, 80, 1);
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("power-of-two"), std::string::npos) << e.what();
  }
  // Codecs fall back to the dense rotation on such head sizes, with the same distortion.
  for (int dim : {80, 96}) {
    auto c = tq_codec_create("tq3", {3, false, TqRotationKind::hadamard}, params(dim));
    const double m = measure_distortion(*c, 1000, 3);
    EXPECT_NEAR(m, tq_lloyd_max_mse(3, dim), 0.03 * tq_lloyd_max_mse(3, dim)) << "dim " << dim;
  }
}

// ---------------------------------------------------------------------------------------------
// Codecs: distortion

TEST(TqCodec, MseDistortionMatchesLloydMax) {
  for (int dim : {64, 128, 256}) {
    for (int b = 1; b <= 4; ++b) {
      auto c = tq_codec_create("tq", {double(b), false, TqRotationKind::hadamard}, params(dim, 99 + uint64_t(b)));
      const double m = measure_distortion(*c, 1500, uint64_t(dim * 10 + b));
      const double lm = tq_lloyd_max_mse(b, dim);
      std::printf("distortion d=%d b=%d: measured %.5f  lloyd-max %.5f  bound %.5f\n", dim, b, m, lm,
                  std::sqrt(3.0) * std::numbers::pi / 2 * std::pow(4.0, -b));
      EXPECT_NEAR(m, lm, 0.03 * lm) << "dim " << dim << " bits " << b;
      EXPECT_LT(m, std::sqrt(3.0) * std::numbers::pi / 2 * std::pow(4.0, -b));
    }
  }
}

TEST(TqCodec, DenseRotationDistortionMatchesLloydMax) {
  for (int dim : {96, 128}) {
    auto c = tq_codec_create("tq4_dense", {4, false, TqRotationKind::dense}, params(dim));
    const double m = measure_distortion(*c, 1500, 5);
    EXPECT_NEAR(m, tq_lloyd_max_mse(4, dim), 0.03 * tq_lloyd_max_mse(4, dim)) << "dim " << dim;
  }
}

TEST(TqCodec, FractionalBitsLieBetweenNeighbours) {
  for (int dim : {64, 128, 256}) {
    struct Case {
      double bits;
      int lo, hi;
      double frac_hi;  // share of channels at hi bits
    };
    for (Case cs : {Case{2.25, 2, 3, 0.25}, Case{2.5, 2, 3, 0.5}, Case{3.5, 3, 4, 0.5}}) {
      auto c = tq_codec_create("tqf", {cs.bits, false, TqRotationKind::hadamard}, params(dim));
      EXPECT_DOUBLE_EQ(c->info().code_bits, cs.bits);
      const double m = measure_distortion(*c, 1500, 11);
      const double expect = cs.frac_hi * tq_lloyd_max_mse(cs.hi, dim) + (1 - cs.frac_hi) * tq_lloyd_max_mse(cs.lo, dim);
      std::printf("distortion d=%d b=%.2f: measured %.5f  expected %.5f\n", dim, cs.bits, m, expect);
      EXPECT_NEAR(m, expect, 0.03 * expect);
      EXPECT_LT(m, tq_lloyd_max_mse(cs.lo, dim));
      EXPECT_GT(m, tq_lloyd_max_mse(cs.hi, dim));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// QJL (prod): unbiased inner products, variance within the paper's bound

TEST(TqQjl, InnerProductUnbiasedWithBoundedVariance) {
  const int d = 128;
  std::mt19937_64 rng(3);
  auto x = random_unit(rng, d);
  // y correlated with x so that the MSE quantizer's shrinkage bias is large and visible.
  auto noise = random_unit(rng, d);
  std::vector<float> y(static_cast<size_t>(d));
  for (int i = 0; i < d; ++i) y[size_t(i)] = 2.f * (0.8f * x[size_t(i)] + 0.6f * noise[size_t(i)]);
  const double yy = dot(y.data(), y.data(), d), xy = dot(x.data(), y.data(), d);
  const int trials = 1200;
  for (int b = 2; b <= 4; ++b) {
    double se = 0, se2 = 0, pred = 0, gam2 = 0, mse_err = 0;
    std::vector<float> qp(static_cast<size_t>(2 * d)), xm(static_cast<size_t>(d));
    for (int s = 0; s < trials; ++s) {
      const uint64_t seed = 1000 + uint64_t(s);
      auto prod = tq_codec_create("qjl", {double(b), true, TqRotationKind::hadamard}, params(d, seed));
      auto mse = tq_codec_create("mse", {double(b - 1), false, TqRotationKind::hadamard}, params(d, seed));
      std::vector<uint8_t> kb(prod->block_bytes(1)), mb(mse->block_bytes(1));
      prod->encode(0, x.data(), size_t(d), 1, kb.data(), 1, 0, 0);
      mse->encode(0, x.data(), size_t(d), 1, mb.data(), 1, 0, 0);
      prod->prepare_query(0, y.data(), 1, qp.data());
      float est;
      prod->scores(0, qp.data(), 1, kb.data(), 1, 0, 1, 0, &est, 1);
      const double e = est - xy;
      se += e;
      se2 += e * e;
      // The prod codec's MSE part is the (b-1)-bit codec with the same rotation: its residual
      // r gives the exact conditional variance ((pi/2) |r|^2 |y|^2 - <y, r>^2) / d.
      mse->decode(0, mb.data(), 1, 0, 1, 0, xm.data());
      double rr = 0, yr = 0;
      for (int i = 0; i < d; ++i) {
        const double r = double(x[size_t(i)]) - xm[size_t(i)];
        rr += r * r;
        yr += double(y[size_t(i)]) * r;
      }
      pred += (std::numbers::pi / 2 * rr * yy - yr * yr) / d;
      gam2 += rr;
      mse_err += dot(y.data(), xm.data(), d) - xy;
    }
    const double mean = se / trials, var = se2 / trials - mean * mean;
    const double stderr_mean = std::sqrt(var / trials);
    pred /= trials;
    gam2 /= trials;
    mse_err /= trials;
    const double bound = std::numbers::pi / (2.0 * d) * yy * gam2;  // Lemma 4 given |r|^2
    const double thm2 = std::sqrt(3.0) * std::numbers::pi * std::numbers::pi / d * yy * std::pow(4.0, -b);
    std::printf("qjl b=%d d=%d: mean err %.2e (se %.2e)  var %.4e  predicted %.4e  bound %.4e  thm2 %.4e  "
                "d*var/|y|^2 %.4f  mse-only bias %.4f\n",
                b, d, mean, stderr_mean, var, pred, bound, thm2, d * var / yy, mse_err);
    EXPECT_LT(std::fabs(mean), 3 * stderr_mean) << "bits " << b;
    // The (b-1)-bit MSE estimator alone is visibly biased (it shrinks inner products).
    EXPECT_GT(std::fabs(mse_err), 10 * stderr_mean) << "bits " << b;
    // Variance: agrees with the exact conditional formula, and within the paper's bounds.
    // Relative standard error of a variance estimate from n samples ~ sqrt(2 / n) = 4%.
    EXPECT_NEAR(var, pred, 0.15 * pred) << "bits " << b;
    EXPECT_LT(var, bound * 1.15) << "bits " << b;
    EXPECT_LT(var, thm2) << "bits " << b;
  }
}

// ---------------------------------------------------------------------------------------------
// Layout, determinism, effective bits

TEST(TqCodec, PackUnpackRoundTrip) {
  std::mt19937_64 rng(1);
  for (int bits = 1; bits <= 4; ++bits) {
    std::vector<uint8_t> codes(128), back(128), packed(static_cast<size_t>(128 * bits / 8));
    for (auto& c : codes) c = uint8_t(rng() & ((1u << bits) - 1));
    tq_pack_codes(codes.data(), 128, bits, packed.data());
    tq_unpack_codes(packed.data(), 128, bits, back.data());
    EXPECT_EQ(codes, back);
  }
}

// The bit stream is the documented layout: code of channel c at bits [b c, b c + b), LSB first.
TEST(TqCodec, PackedLayoutIsLsbFirstBitStream) {
  std::vector<uint8_t> codes(32), packed(16);
  for (int c = 0; c < 32; ++c) codes[size_t(c)] = uint8_t(c & 15);
  tq_pack_codes(codes.data(), 32, 4, packed.data());
  EXPECT_EQ(packed[0], 0x10);  // channel 0 low nibble, channel 1 high nibble
  EXPECT_EQ(packed[7], 0xfe);
  std::fill(codes.begin(), codes.end(), 0);
  codes[2] = 7;  // 3-bit code at bits 6..8: straddles bytes 0 and 1
  tq_pack_codes(codes.data(), 16, 3, packed.data());
  EXPECT_EQ(packed[0], 0xc0);
  EXPECT_EQ(packed[1], 0x01);
  for (int b = 2; b < 6; ++b) EXPECT_EQ(packed[size_t(b)], 0) << b;
}

TEST(TqCodec, EffectiveBitsEqualBlockBytes) {
  for (int dim : {64, 128, 256}) {
    for (const auto& nc : all_configs()) {
      auto c = tq_codec_create(nc.name, nc.cfg, params(dim));
      const double overhead = (nc.cfg.qjl ? 32.0 : 16.0) / dim;  // fp16 norm (+ fp16 |r|)
      EXPECT_DOUBLE_EQ(c->info().code_bits, nc.cfg.bits) << nc.name;
      for (int bt : {16, 64, 256}) {
        const double eff = 8.0 * double(c->block_bytes(bt)) / (double(bt) * dim);
        EXPECT_DOUBLE_EQ(eff, nc.cfg.bits + overhead) << nc.name << " dim " << dim;
      }
    }
  }
  // Concrete sizes at head_dim 128: tq4 = 2 + 64 bytes; tq3_qjl = 2 + 32 + 2 + 16 bytes.
  EXPECT_EQ(tq_codec_create("tq4", {4, false, TqRotationKind::hadamard}, params(128))->block_bytes(1), 66u);
  EXPECT_EQ(tq_codec_create("tq3_qjl", {3, true, TqRotationKind::hadamard}, params(128))->block_bytes(1), 52u);
}

TEST(TqCodec, DeterministicGivenSeedLayerRole) {
  const int d = 128;
  std::mt19937_64 rng(5);
  std::vector<float> x(size_t(d) * 8);
  for (int t = 0; t < 8; ++t) {
    auto u = random_unit(rng, d);
    std::copy(u.begin(), u.end(), x.begin() + t * d);
  }
  for (const auto& nc : all_configs()) {
    auto enc = [&](const KvCodecParams& p) {
      auto c = tq_codec_create(nc.name, nc.cfg, p);
      std::vector<uint8_t> b(c->block_bytes(8));
      c->encode(0, x.data(), size_t(d), 8, b.data(), 8, 0, 0);
      return b;
    };
    const auto a = enc(params(d, 42, 3, KvRole::key));
    EXPECT_EQ(a, enc(params(d, 42, 3, KvRole::key))) << nc.name;
    EXPECT_NE(a, enc(params(d, 43, 3, KvRole::key))) << nc.name;
    EXPECT_NE(a, enc(params(d, 42, 4, KvRole::key))) << nc.name;
    EXPECT_NE(a, enc(params(d, 42, 3, KvRole::value))) << nc.name;
  }
}

TEST(TqCodec, RejectsInvalidParameters) {
  using R = TqRotationKind;
  EXPECT_THROW(tq_codec_create("x", {4, false, R::dense}, params(72)), Error);   // not a multiple of 16
  EXPECT_THROW(tq_codec_create("x", {1, true, R::hadamard}, params(128)), Error);  // prod needs >= 2 bits
  EXPECT_THROW(tq_codec_create("x", {2.5, true, R::hadamard}, params(128)), Error);
  EXPECT_THROW(tq_codec_create("x", {5, false, R::hadamard}, params(128)), Error);
  EXPECT_THROW(tq_codec_create("x", {0.5, false, R::hadamard}, params(128)), Error);
  EXPECT_THROW(tq_codec_create("x", {2.01, false, R::hadamard}, params(128)), Error);  // no 16-channel split
}

// ---------------------------------------------------------------------------------------------
// Edge inputs

TEST(TqCodec, ZeroHugeTinyAndNonFiniteRows) {
  const int d = 128;
  auto c = tq_codec_create("tq4", {4, false, TqRotationKind::hadamard}, params(d));
  std::vector<uint8_t> b(c->block_bytes(1));
  std::vector<float> x(size_t(d), 0.f), y(static_cast<size_t>(d));
  c->encode(0, x.data(), size_t(d), 1, b.data(), 1, 0, 0);
  c->decode(0, b.data(), 1, 0, 1, 0, y.data());
  for (float v : y) EXPECT_EQ(v, 0.f);

  std::mt19937_64 rng(9);
  for (double scale : {1e-3, 1e3, 5e3}) {  // norms ~ 1e-3 .. 5e3: fp16 normal range
    auto u = random_unit(rng, d);
    for (int i = 0; i < d; ++i) x[size_t(i)] = float(u[size_t(i)] * scale);
    c->encode(0, x.data(), size_t(d), 1, b.data(), 1, 0, 0);
    c->decode(0, b.data(), 1, 0, 1, 0, y.data());
    double e = 0;
    for (int i = 0; i < d; ++i) e += double(x[size_t(i)] - y[size_t(i)]) * (x[size_t(i)] - y[size_t(i)]);
    EXPECT_LT(e / (scale * scale), 4 * tq_lloyd_max_mse(4, d)) << "scale " << scale;
  }
  // Below float's squared range the norm is still right (computed in double).
  for (int i = 0; i < d; ++i) x[size_t(i)] = 1e-24f * ((i % 3) - 1.f);
  c->encode(0, x.data(), size_t(d), 1, b.data(), 1, 0, 0);
  c->decode(0, b.data(), 1, 0, 1, 0, y.data());
  for (float v : y) EXPECT_TRUE(std::isfinite(v));
  // Norms past fp16 saturate at 65504 rather than becoming inf.
  std::fill(x.begin(), x.end(), 1e4f);
  c->encode(0, x.data(), size_t(d), 1, b.data(), 1, 0, 0);
  c->decode(0, b.data(), 1, 0, 1, 0, y.data());
  EXPECT_NEAR(std::sqrt(dot(y.data(), y.data(), d)), 65504.0, 0.05 * 65504.0);
  // NaN input stays visible.
  x[5] = std::nanf("");
  c->encode(0, x.data(), size_t(d), 1, b.data(), 1, 0, 0);
  c->decode(0, b.data(), 1, 0, 1, 0, y.data());
  EXPECT_TRUE(std::isnan(y[0]));
}

// ---------------------------------------------------------------------------------------------
// Kernels: scores/accumulate against decode, and SIMD variants against the scalar reference

namespace {

// Rows of kind: 0 random, 1 zeros, 2 constant, 3 outlier channel, 4 tiny, 5 huge, 6 one spike.
std::vector<float> adversarial_rows(int n, int d, std::mt19937_64& rng) {
  std::normal_distribution<float> nd;
  std::vector<float> x(size_t(n) * size_t(d));
  for (int t = 0; t < n; ++t) {
    float* r = &x[size_t(t) * size_t(d)];
    const int kind = t % 7;
    for (int i = 0; i < d; ++i) r[i] = nd(rng);
    if (kind == 1) std::fill(r, r + d, 0.f);
    if (kind == 2) std::fill(r, r + d, 0.75f);
    if (kind == 3) r[d / 3] *= 1000.f, r[d - 1] = -800.f;
    if (kind == 4) for (int i = 0; i < d; ++i) r[i] *= 1e-5f;
    if (kind == 5) for (int i = 0; i < d; ++i) r[i] *= 300.f;
    if (kind == 6) std::fill(r, r + d, 0.f), r[t % d] = 5.f;
  }
  return x;
}

}  // namespace

TEST(TqKernels, ScoresAndAccumulateMatchDecode) {
  for (int dim : {64, 128}) {
    for (const auto& nc : all_configs()) {
      for (KvRole role : {KvRole::key, KvRole::value}) {
        auto c = tq_codec_create(nc.name, nc.cfg, params(dim, 77, 1, role));
        const int bt = 32, n = 29, t0 = 3, n_q = 3;
        std::mt19937_64 rng(21);
        auto x = adversarial_rows(n, dim, rng);
        std::vector<uint8_t> block(c->block_bytes(bt));
        c->encode(0, x.data(), size_t(dim), n, block.data(), bt, t0, 0);
        std::vector<float> dec(size_t(n) * size_t(dim));
        c->decode(0, block.data(), bt, t0, n, 0, dec.data());
        auto q = adversarial_rows(n_q, dim, rng);
        std::vector<float> qp(size_t(n_q) * size_t(c->prepared_query_dim()));
        c->prepare_query(0, q.data(), n_q, qp.data());
        std::vector<float> s(size_t(n_q) * 40);
        c->scores(0, qp.data(), n_q, block.data(), bt, t0, n, 0, s.data(), 40);
        std::vector<float> p(size_t(n_q) * 32);
        for (auto& v : p) v = float(rng() % 1000) / 1000.f;
        std::vector<float> acc(size_t(n_q) * size_t(dim), 0.f);
        c->accumulate(0, p.data(), 32, n_q, block.data(), bt, t0, n, acc.data());
        c->finish_output(0, acc.data(), n_q);
        for (int i = 0; i < n_q; ++i) {
          const float* qi = &q[size_t(i) * size_t(dim)];
          const double qn = std::sqrt(dot(qi, qi, dim));
          for (int t = 0; t < n; ++t) {
            const float* k = &dec[size_t(t) * size_t(dim)];
            const double ref = dot(qi, k, dim), kn = std::sqrt(dot(k, k, dim));
            const double b8 = int8_bound(nc.cfg, dim, &qp[size_t(i) * size_t(c->prepared_query_dim())], kn);
            EXPECT_NEAR(s[size_t(i) * 40 + size_t(t)], ref, 1e-4 * qn * kn + b8 + 1e-30) << nc.name << " t " << t;
          }
          for (int j = 0; j < dim; ++j) {
            double ref = 0, mag = 0;
            for (int t = 0; t < n; ++t) {
              ref += double(p[size_t(i) * 32 + size_t(t)]) * dec[size_t(t) * size_t(dim) + size_t(j)];
              mag += std::fabs(p[size_t(i) * 32 + size_t(t)]) *
                     std::sqrt(dot(&dec[size_t(t) * size_t(dim)], &dec[size_t(t) * size_t(dim)], dim));
            }
            const bool bf16 = std::string(tq_kernels_for(cpu_level()).name) == "avx512";
            EXPECT_NEAR(acc[size_t(i) * size_t(dim) + size_t(j)], ref, (1e-5 + (bf16 ? kTqAccumBf16Rel : 0)) * mag)
                << nc.name << " ch " << j;
          }
        }
      }
    }
  }
}

TEST(TqKernels, SimdMatchesScalar) {
  std::vector<const TqKernels*> variants;
#if defined(KVQ_HAVE_SIMD)
  if (cpu_level() >= CpuLevel::avx2) variants.push_back(&tq_kernels_avx2());
  if (cpu_level() >= CpuLevel::avx512) variants.push_back(&tq_kernels_avx512());
#endif
  if (variants.empty()) GTEST_SKIP() << "no SIMD kernels on this CPU/build";
  const TqKernels& ref = tq_kernels_scalar();
  for (int dim : {64, 80, 96, 128, 256}) {  // 80, 96: odd group counts per segment
    for (const auto& nc : all_configs()) {
      auto c = tq_codec_create(nc.name, nc.cfg, params(dim, 5));
      // Kernel arguments as the codec builds them: layout and padded codebooks.
      int n_hi = dim, bh = 0, bl = 0;
      if (nc.cfg.qjl) {
        bh = int(nc.cfg.bits) - 1;
      } else {
        bl = int(std::floor(nc.cfg.bits));
        bh = nc.cfg.bits == bl ? bl : bl + 1;
        if (bh != bl) n_hi = int(std::lround((nc.cfg.bits - bl) * dim / 16)) * 16;
      }
      const TqLayout l = tq_layout_make(dim, n_hi, bh, bl, nc.cfg.qjl);
      ASSERT_EQ(size_t(l.record_bytes), c->block_bytes(1));
      float cbh[16] = {}, cbl[16] = {};
      auto ch = tq_codebook(bh, dim);
      std::copy(ch.begin(), ch.end(), cbh);
      if (n_hi < dim) {
        auto cl = tq_codebook(bl, dim);
        std::copy(cl.begin(), cl.end(), cbl);
      }
      TqKernelArgs a{&l, cbh, cbl, float(std::sqrt(std::numbers::pi / 2) / dim)};
      const int n = 45, pd = c->prepared_query_dim();
      std::mt19937_64 rng(uint64_t(dim) * 31 + 7);
      auto x = adversarial_rows(n, dim, rng);
      std::vector<uint8_t> recs(c->block_bytes(n));
      c->encode(0, x.data(), size_t(dim), n, recs.data(), n, 0, 0);
      for (int n_q : {1, 2, 3, 4, 5, 8}) {
        auto q = adversarial_rows(n_q, dim, rng);
        std::vector<float> qp(size_t(n_q) * size_t(pd));
        c->prepare_query(0, q.data(), n_q, qp.data());
        std::vector<float> p(size_t(n_q) * size_t(n));
        for (size_t i = 0; i < p.size(); ++i) p[i] = (i % 11 == 0) ? 0.f : float(rng() % 997) / 997.f;
        for (int t0 : {0, 13, 44}) {  // 45, 32 and 1 tokens
          const int nn = n - t0;
          const uint8_t* rp = recs.data() + size_t(t0) * size_t(l.record_bytes);
          std::vector<float> s_ref(size_t(n_q) * size_t(n), -1.f), acc_ref(size_t(n_q) * size_t(dim), 0.5f);
          ref.scores(a, qp.data(), pd, n_q, rp, nn, s_ref.data(), n);
          ref.accumulate(a, p.data(), n, n_q, rp, nn, acc_ref.data());
          // Tolerances scale with the magnitudes summed (|q| |k| per score).
          for (const TqKernels* v : variants) {
            std::vector<float> s(size_t(n_q) * size_t(n), -1.f), acc(size_t(n_q) * size_t(dim), 0.5f);
            v->scores(a, qp.data(), pd, n_q, rp, nn, s.data(), n);
            v->accumulate(a, p.data(), n, n_q, rp, nn, acc.data());
            for (int i = 0; i < n_q; ++i) {
              double qmag = 0;
              for (int j = 0; j < pd; ++j) qmag += std::fabs(qp[size_t(i) * size_t(pd) + size_t(j)]);
              for (int t = 0; t < nn; ++t) {
                const uint8_t* r = rp + size_t(t) * size_t(l.record_bytes);
                const double norm = f16_to_f32(uint16_t(r[0] | (r[1] << 8)));
                double tol = 2e-6 * qmag * norm * (1 + (l.qjl ? 1.0 : 0.0)) + 1e-30;
                if (std::string(v->name) == "avx512" && !l.qjl) {  // the int8 path: its derived bound
                  double l1 = 0, mx = 0;
                  for (int j = 0; j < dim; ++j) {
                    const double qv = std::fabs(qp[size_t(i) * size_t(pd) + size_t(j)]);
                    l1 += qv;
                    mx = std::max(mx, qv);
                  }
                  double cmx = 0;
                  for (int k = 0; k < 16; ++k) cmx = std::max({cmx, double(std::fabs(cbh[k])), double(std::fabs(cbl[k]))});
                  tol += 1.01 * tq_score_error_bound(norm, l1, mx, cmx, dim);
                }
                EXPECT_NEAR(s[size_t(i) * size_t(n) + size_t(t)], s_ref[size_t(i) * size_t(n) + size_t(t)], tol)
                    << v->name << " " << nc.name << " dim " << dim << " n_q " << n_q << " t " << t;
              }
              for (int t = nn; t < n; ++t) EXPECT_EQ(s[size_t(i) * size_t(n) + size_t(t)], -1.f);  // untouched
              double amag = 0;
              for (int t = 0; t < nn; ++t) {
                const uint8_t* r = rp + size_t(t) * size_t(l.record_bytes);
                amag += std::fabs(p[size_t(i) * size_t(n) + size_t(t)]) * f16_to_f32(uint16_t(r[0] | (r[1] << 8)));
              }
              double acc_tol = 1e-6 * amag + 1e-6;
              if (std::string(v->name) == "avx512") {  // bf16 accumulate of 4-bit segments: its bound
                double cmx = 0;
                for (int k = 0; k < 16; ++k) cmx = std::max({cmx, double(std::fabs(cbh[k])), double(std::fabs(cbl[k]))});
                acc_tol += kTqAccumBf16Rel * amag * cmx;
              }
              for (int j = 0; j < dim; ++j)
                EXPECT_NEAR(acc[size_t(i) * size_t(dim) + size_t(j)], acc_ref[size_t(i) * size_t(dim) + size_t(j)],
                            acc_tol)
                    << v->name << " " << nc.name << " dim " << dim;
            }
          }
        }
      }
    }
  }
}

// Encode: every variant writes the same bytes as the scalar reference (same float operations,
// double sums in tq_dot_ref's fixed order), for every format, adversarial rows included.
TEST(TqKernels, SimdEncodeMatchesScalarBytes) {
  std::vector<const TqKernels*> variants;
#if defined(KVQ_HAVE_SIMD)
  if (cpu_level() >= CpuLevel::avx2) variants.push_back(&tq_kernels_avx2());
  if (cpu_level() >= CpuLevel::avx512) variants.push_back(&tq_kernels_avx512());
#endif
  if (variants.empty()) GTEST_SKIP() << "no SIMD kernels on this CPU/build";
  for (int dim : {16, 64, 96, 128, 256}) {
    for (const auto& nc : all_configs()) {
      if (dim == 16 && nc.cfg.bits != std::floor(nc.cfg.bits)) continue;  // no 16-channel split
      const CpuLevel prev = cpu_set_level(CpuLevel::scalar);
      auto c = tq_codec_create(nc.name, nc.cfg, params(dim, 11));
      const int n = 50;
      std::mt19937_64 rng(uint64_t(dim) + 3);
      auto x = adversarial_rows(n, dim, rng);
      // Beyond the shared adversarial rows: inf, nan, float-max and denormal inputs.
      x[size_t(7 * dim + 1)] = std::numeric_limits<float>::infinity();
      x[size_t(8 * dim + 2)] = std::nanf("");
      for (int i = 0; i < dim; ++i) x[size_t(9 * dim + i)] = (i % 2 ? 1 : -1) * 3e38f;
      for (int i = 0; i < dim; ++i) x[size_t(10 * dim + i)] = float(i + 1) * 1e-42f;
      std::vector<uint8_t> ref(c->block_bytes(n));
      c->encode(0, x.data(), size_t(dim), n, ref.data(), n, 0, 0);
      for (const TqKernels* v : variants) {
        cpu_set_level(std::string(v->name) == "avx2" ? CpuLevel::avx2 : CpuLevel::avx512);
        std::vector<uint8_t> got(ref.size(), 0xab);
        c->encode(0, x.data(), size_t(dim), n, got.data(), n, 0, 0);
        const size_t rb = c->block_bytes(1);
        for (size_t i = 0; i < ref.size(); ++i)
          ASSERT_EQ(int(got[i]), int(ref[i])) << v->name << " " << nc.name << " dim " << dim << " token " << i / rb
                                              << " byte " << i % rb;
      }
      cpu_set_level(prev);
    }
  }
}

TEST(TqKernels, DotRefOrder) {
  // Lanes first, then the fixed tree: 1e16 + 1 - 1e16 cancels only when grouped this way.
  std::vector<float> a(16, 0.f), b(16, 1.f);
  a[0] = 1e16f;
  a[4] = -1e16f;
  a[1] = 1.f;
  EXPECT_EQ(tq_dot_ref(a.data(), b.data(), 16), 1.0);
  std::mt19937_64 rng(4);
  std::normal_distribution<float> nd;
  for (auto& v : a) v = nd(rng);
  double plain = 0;
  for (int i = 0; i < 16; ++i) plain += double(a[size_t(i)]) * b[size_t(i)];
  EXPECT_NEAR(tq_dot_ref(a.data(), b.data(), 16), plain, 1e-12);
}

TEST(TqKernels, DispatchFollowsCpuLevel) {
  const CpuLevel prev = cpu_set_level(CpuLevel::scalar);
  EXPECT_STREQ(tq_kernels_for(cpu_level()).name, "scalar");
  cpu_set_level(prev);
#if defined(KVQ_HAVE_SIMD)
  if (cpu_level() >= CpuLevel::avx512) {
    EXPECT_STREQ(tq_kernels_for(cpu_level()).name, "avx512");
  } else if (cpu_level() >= CpuLevel::avx2) {
    EXPECT_STREQ(tq_kernels_for(cpu_level()).name, "avx2");
  }
#endif
}

// ---------------------------------------------------------------------------------------------
// Registry

namespace {
// The rates whose codecs store kv/tq_tiled.h's tiles where the head allows (at 128: all of them).
bool tiled_rate(const std::string& n) {
  for (const char* r : {"tq2", "tq3", "tq4", "tq2.25", "tq2.5", "tq3.5"})
    if (n == r) return true;
  return false;
}
}  // namespace

TEST(TqRegistry, CodecsAndFormatsByName) {
  for (const char* name : {"tq1", "tq2", "tq3", "tq4", "tq2_rows", "tq4_rows", "tq3.5_rows", "tq2.25", "tq2.5",
                           "tq3.5", "tq2_qjl", "tq3_qjl", "tq4_qjl", "tq4_dense"}) {
    auto c = kv_codec_create(name, params(128));
    // tq2 .. tq4 store their tiles where the head allows (kv/tq_tiled.h; tested in test_tq_tiled).
    EXPECT_EQ(c->info().name, tiled_rate(name) ? std::string(name) + "t" : std::string(name));
    EXPECT_TRUE(c->info().transforms_query && c->info().transforms_output);
    EXPECT_DOUBLE_EQ(kv_codec_effective_bits(*c, 64, 1000), 8.0 * double(c->block_bytes(64)) / (64.0 * 128)) << name;
  }
  EXPECT_EQ(kv_format_find("tq3_qjl").k_codec, "tq3_qjl");
  EXPECT_EQ(kv_format_find("tq3_qjl").v_codec, "tq3");  // values use the MSE variant
  EXPECT_EQ(kv_format_find("k3v4").name, "tq_k3v4");
  EXPECT_EQ(kv_format_find("k4v3").name, "tq_k4v3");
  EXPECT_EQ(kv_format_find("tq_k4v3").k_codec, "tq4");
  EXPECT_EQ(kv_format_find("tq_k4v3").v_codec, "tq3");
  EXPECT_EQ(kv_format_find("tq_k8v4").k_codec, "int8");
  EXPECT_EQ(kv_format_find("tq_k8v4").v_codec, "tq4");
  EXPECT_EQ(kv_format_find("TQ3.5").k_codec, "tq3.5");
  EXPECT_NO_THROW(kv_codec_create("tq4", params(96)));  // dense rotation on non-powers of two
  EXPECT_EQ(kv_codec_create("tq4", params(80))->info().name, "tq4");  // not a multiple of 32: the rows
  EXPECT_EQ(kv_codec_create("tq4", params(80))->block_bytes(1), 2u + 40u);
  EXPECT_NO_THROW(kv_codec_create("tq4_dense", params(96)));
  EXPECT_THROW(kv_codec_create("tq4", params(72)), Error);  // not a multiple of 16
}

// The attention path uses prepare_query / scores / accumulate / finish_output; the reference
// decodes every token. Same decoded K/V on both sides: only summation order differs.
TEST(TqRegistry, FusedAttentionMatchesDecodeReference) {
  const CpuLevel saved = cpu_set_level(CpuLevel::avx512);
  for (CpuLevel lvl : {CpuLevel::scalar, CpuLevel::avx2, CpuLevel::avx512}) {
    cpu_set_level(lvl);
    for (const char* fmt : {"tq1", "tq2.5", "tq3.5", "tq4", "tq3_qjl", "tq4_dense", "tq_k8v4", "tq_k3v4", "tq_k4v3"}) {
      const KvFormatDesc& f = kv_format_find(fmt);
      const int d = 128, bt = 32, n_blocks = 3, n_q = 5, n_tail = 4, head = 1;
      // The record kernels: the formats' codecs store tiles at this head_dim (kernels checked by
      // test_tq_tiled and test_attention); here their records stand in.
      const auto rows = [](const std::string& c) { return tiled_rate(c) ? c + "_rows" : c; };
      auto kc = kv_codec_create(rows(f.k_codec), params(d, 1, 2, KvRole::key));
      auto vc = kv_codec_create(rows(f.v_codec), params(d, 1, 2, KvRole::value));
      std::mt19937_64 rng(17);
      std::vector<std::vector<uint8_t>> kb(n_blocks), vb(n_blocks);
      std::vector<KvBlockSpan> spans;
      for (int b = 0; b < n_blocks; ++b) {
        auto k = adversarial_rows(bt, d, rng), v = adversarial_rows(bt, d, rng);
        for (auto& x : k) x *= 0.2f;  // keep softmax from collapsing onto one token
        kb[size_t(b)].resize(kc->block_bytes(bt));
        vb[size_t(b)].resize(vc->block_bytes(bt));
        kc->encode(head, k.data(), size_t(d), bt, kb[size_t(b)].data(), bt, 0, b * bt);
        vc->encode(head, v.data(), size_t(d), bt, vb[size_t(b)].data(), bt, 0, b * bt);
        KvBlockSpan s;
        s.k = kb[size_t(b)].data();
        s.v = vb[size_t(b)].data();
        s.block_tokens = bt;
        s.pos0 = b * bt;
        s.t0 = b == 0 ? 5 : 0;
        s.n = b == n_blocks - 1 ? 11 : bt - s.t0;
        spans.push_back(s);
      }
      auto tk = adversarial_rows(n_tail, d, rng), tv = adversarial_rows(n_tail, d, rng);
      for (auto& x : tk) x *= 0.01f;
      for (auto& x : tv) x *= 0.01f;
      std::normal_distribution<float> nd;
      std::vector<float> q(size_t(n_q) * size_t(d));
      for (auto& x : q) x = nd(rng);
      AttnParams ap;
      ap.scale = 1.f / std::sqrt(float(d));
      std::vector<float> out(q.size()), ref(q.size());
      AlignedBuf<float> scratch(attn_scratch_floats(*kc, *vc, n_q, bt));
      attn_decode(*kc, *vc, head, q.data(), n_q, spans.data(), int(spans.size()), tk.data(), tv.data(),
                  size_t(d), n_tail, ap, out.data(), scratch.data());
      attn_decode_ref(*kc, *vc, head, q.data(), n_q, spans.data(), int(spans.size()), tk.data(), tv.data(),
                      size_t(d), n_tail, ap, ref.data());
      double scale = 0;
      for (float x : ref) scale = std::max(scale, double(std::fabs(x)));
      // Int8 scores move each logit by at most dl = ap.scale * (their bound); softmax weights then
      // change by a factor within e^(+-2 dl), so the output by at most (e^(2 dl) - 1) * max|v|.
      double extra = 0;
      for (const auto& nc : all_configs()) {
        if (f.k_codec != nc.name) continue;
        std::vector<float> qp(size_t(n_q) * size_t(kc->prepared_query_dim()));
        kc->prepare_query(head, q.data(), n_q, qp.data());
        double dl = 0, vmax = 0;
        std::vector<float> kd(size_t(bt) * size_t(d)), vd(size_t(bt) * size_t(d));
        for (const auto& sp : spans) {
          kc->decode(head, sp.k, bt, sp.t0, sp.n, sp.pos0, kd.data());
          vc->decode(head, sp.v, bt, sp.t0, sp.n, sp.pos0, vd.data());
          for (int t = 0; t < sp.n; ++t) {
            const float* kt = &kd[size_t(t) * size_t(d)];
            for (int i = 0; i < n_q; ++i)
              dl = std::max(dl, ap.scale * int8_bound(nc.cfg, d, &qp[size_t(i) * size_t(kc->prepared_query_dim())],
                                                      std::sqrt(dot(kt, kt, d))));
          }
          for (int j = 0; j < sp.n * d; ++j) vmax = std::max(vmax, double(std::fabs(vd[size_t(j)])));
        }
        for (float x : tv) vmax = std::max(vmax, double(std::fabs(x)));
        extra = std::expm1(2 * dl) * vmax;
      }
      // Bf16 accumulate (tq values, AVX-512): each output moves by at most kTqAccumBf16Rel * max|v|.
      for (const auto& nc : all_configs()) {
        if (f.v_codec != nc.name || std::string(tq_kernels_for(cpu_level()).name) != "avx512") continue;
        double vmax = 0;
        std::vector<float> vd(size_t(bt) * size_t(d));
        for (const auto& sp : spans) {
          vc->decode(head, sp.v, bt, sp.t0, sp.n, sp.pos0, vd.data());
          for (int j = 0; j < sp.n * d; ++j) vmax = std::max(vmax, double(std::fabs(vd[size_t(j)])));
        }
        extra += kTqAccumBf16Rel * vmax;
      }
      for (size_t i = 0; i < out.size(); ++i)
        ASSERT_NEAR(out[i], ref[i], 2e-5 * (1 + scale) + extra) << fmt << " cpu " << cpu_level_name(lvl) << " i " << i;
    }
  }
  cpu_set_level(saved);
}
