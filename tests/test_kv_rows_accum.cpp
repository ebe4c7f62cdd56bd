// Weighted sum of the 4-bit / 2-bit row formats (int4g, int2g): the AVX-512 integer kernel
// (int16 weights p * scale per query, group and run of 32 tokens, kv_rows_i8_avx512.cpp) against
// the scalar reference, within the bound derived in kv_int_dot_bound.h (kv_int_accum_bound), on
// random and adversarial rows and probabilities. The float table-lookup kernel (q4_0, head_dim not
// a multiple of 64) and the AVX2 kernel are checked against the reference at f32 rounding.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "core/cpu.h"
#include "kv/kv_rows.h"
#include "kv_int_dot_bound.h"

using namespace kvq;

namespace {

struct Fmt {
  KvElem e;
  int group;
  const char* name;
};
const Fmt kIntFmts[] = {{KvElem::int4g, 32, "int4g32"}, {KvElem::int4g, 64, "int4g64"},
                     {KvElem::int4g, 128, "int4g128"}, {KvElem::int2g, 32, "int2g32"}, {KvElem::int2g, 64, "int2g64"},
                     {KvElem::int2g, 128, "int2g128"}};
const Fmt kAllFmts[] = {{KvElem::q4_0, 0, "q4_0"},       {KvElem::int4g, 32, "int4g32"}, {KvElem::int4g, 64, "int4g64"},
                        {KvElem::int4g, 128, "int4g128"}, {KvElem::int2g, 32, "int2g32"}, {KvElem::int2g, 64, "int2g64"},
                        {KvElem::int2g, 128, "int2g128"}};

enum class Rows { random, outlier_channel, constant, zeros, huge, tiny, mixed_scale };
enum class Probs { random, one_dominant, tiny, zeros, uniform, sparse, subnormal };

float row_value(Rows r, int t, int d, int hd, std::mt19937& rng) {
  std::normal_distribution<float> nd;
  switch (r) {
    case Rows::random: return nd(rng);
    case Rows::outlier_channel: return nd(rng) * (d == 5 || d == hd - 3 ? 300.f : 1.f);
    case Rows::constant: return 0.75f * float(t % 3 - 1);
    case Rows::zeros: return 0.f;
    case Rows::huge: return nd(rng) * 1e4f;  // f16 scales up to ~1.3e3 (int4) / ~1e4 (int2)
    case Rows::tiny: return nd(rng) * 1e-6f;  // f16 subnormal scales
    case Rows::mixed_scale: return nd(rng) * std::ldexp(1.f, (t % 20) - 10);
  }
  return 0.f;
}

float prob(Probs pr, int t, int n, int i, std::mt19937& rng) {
  std::normal_distribution<float> nd;
  switch (pr) {
    case Probs::random: return std::fabs(nd(rng));
    case Probs::one_dominant: return t == (7 * i + 3) % n ? 1.f : 1e-7f * std::fabs(nd(rng));
    case Probs::tiny: return 1e-30f * std::fabs(nd(rng));
    case Probs::zeros: return 0.f;
    case Probs::uniform: return 1.f / float(n);
    case Probs::sparse: return t % 5 == i % 5 ? std::fabs(nd(rng)) : 0.f;
    case Probs::subnormal: return 1e-40f * float(1 + t % 7);
  }
  return 0.f;
}

}  // namespace

TEST(KvRowsAccum, IntegerWeightsWithinDerivedBound) {
#if !defined(KVQ_HAVE_SIMD)
  GTEST_SKIP() << "built without SIMD kernels";
#else
  const CpuFeatures& cf = cpu_features();
  if (!(cf.avx512f && cf.avx512bw && cf.avx512vl && cf.avx512vnni && cf.avx512vbmi))
    GTEST_SKIP() << "no AVX-512 VNNI / VBMI on this machine";
  std::mt19937 rng(5);
  int checked = 0;
  for (const Fmt& fm : kIntFmts) {
    for (int hd : {64, 128, 256}) {
      if (fm.group > hd) continue;
      const KvRowFmt f = kv_row_fmt(fm.e, hd, fm.group);
      ASSERT_TRUE(test::kv_int_accum_active(f));
      for (Rows rp : {Rows::random, Rows::outlier_channel, Rows::constant, Rows::zeros, Rows::huge, Rows::tiny,
                      Rows::mixed_scale}) {
        for (Probs pp : {Probs::random, Probs::one_dominant, Probs::tiny, Probs::zeros, Probs::uniform, Probs::sparse,
                         Probs::subnormal}) {
          // Only the random rows see every n and n_q; the adversarial ones a few (time).
          for (int n : {1, 2, 3, 37, 63, 64, 65, 130}) {
            if (rp != Rows::random && pp != Probs::random && n != 37 && n != 64) continue;
            for (int nq : {1, 2, 3, 4, 5, 8}) {
              if ((rp != Rows::random || pp != Probs::random) && nq != 3 && nq != 4) continue;
              std::vector<float> x(static_cast<size_t>(hd));
              std::vector<uint8_t> rows(size_t(n) * f.row_bytes);
              for (int t = 0; t < n; ++t) {
                for (int d = 0; d < hd; ++d) x[size_t(d)] = row_value(rp, t, d, hd, rng);
                kv_row_encode(f, 1.f, x.data(), rows.data() + size_t(t) * f.row_bytes);
              }
              const int ps = n + 3;  // p rows wider than n: the kernel must honour p_stride
              std::vector<float> p(size_t(nq) * size_t(ps), -1e30f);
              for (int i = 0; i < nq; ++i)
                for (int t = 0; t < n; ++t) p[size_t(i) * size_t(ps) + size_t(t)] = prob(pp, t, n, i, rng);
              std::vector<float> ref(size_t(nq) * size_t(hd), 0.5f), got = ref;
              kv_rows_accum_ref(f, 1.f, p.data(), ps, nq, rows.data(), f.row_bytes, n, ref.data());
              kv_rows_accum_avx512(f, 1.f, p.data(), ps, nq, rows.data(), f.row_bytes, n, got.data());
              const std::vector<double> bound = test::kv_int_accum_bound(f, p.data(), ps, nq, rows.data(), f.row_bytes, n);
              // The reference itself rounds once per token to f32 on top of the initial 0.5:
              // up to (n + 1) * 2^-24 of the running |acc| <= 0.5 + sum_t |p_t x_t|.
              std::vector<double> run(got.size(), 0.5);
              for (int t = 0; t < n; ++t) {
                kv_row_decode(f, 1.f, rows.data() + size_t(t) * f.row_bytes, x.data());
                for (int i = 0; i < nq; ++i)
                  for (int d = 0; d < hd; ++d)
                    run[size_t(i) * size_t(hd) + size_t(d)] += std::fabs(double(p[size_t(i) * size_t(ps) + size_t(t)]) * x[size_t(d)]);
              }
              for (size_t k = 0; k < got.size(); ++k) {
                const double tol = bound[k] + double(n + 1) * 0x1p-24 * run[k];
                ASSERT_NEAR(got[k], ref[k], tol) << fm.name << " hd " << hd << " rows " << int(rp) << " probs "
                                                 << int(pp) << " n " << n << " nq " << nq << " elem " << k;
                ++checked;
              }
              // The bound is informative: on random rows and probabilities it stays within
              // 1e-3 of sum_t p_t (|s_t| c_max + |m_t|), the scale of the sum.
              if (rp == Rows::random && pp == Probs::random) {
                for (int i = 0; i < nq; ++i)
                  for (int d = 0; d < hd; ++d) {
                    double mag = 0;
                    for (int t = 0; t < n; ++t) {
                      double s, m;
                      int c;
                      test::kv_row_scm(f, rows.data() + size_t(t) * f.row_bytes, d, &s, &m, &c);
                      mag += std::fabs(double(p[size_t(i) * size_t(ps) + size_t(t)])) * (std::fabs(s) * (fm.e == KvElem::int2g ? 3 : 15) + std::fabs(m));
                    }
                    ASSERT_LT(bound[size_t(i) * size_t(hd) + size_t(d)], 1e-3 * mag) << fm.name << " n " << n;
                  }
              }
            }
          }
        }
      }
    }
  }
  EXPECT_GT(checked, 0);
#endif
}

// One dominant token among many tiny ones: the int16 step is set by the dominant weight, so the
// tiny tokens round to zero weight; the error stays within half a step per token times its code,
// and the dominant token's value comes through to ~1e-4 relative.
TEST(KvRowsAccum, DominantTokenKeepsItsValue) {
#if !defined(KVQ_HAVE_SIMD)
  GTEST_SKIP() << "built without SIMD kernels";
#else
  const CpuFeatures& cf = cpu_features();
  if (!(cf.avx512f && cf.avx512bw && cf.avx512vl && cf.avx512vnni && cf.avx512vbmi))
    GTEST_SKIP() << "no AVX-512 VNNI / VBMI on this machine";
  std::mt19937 rng(9);
  std::normal_distribution<float> nd;
  for (const Fmt& fm : kIntFmts) {
    const int hd = 128, n = 64;
    const KvRowFmt f = kv_row_fmt(fm.e, hd, fm.group);
    std::vector<uint8_t> rows(size_t(n) * f.row_bytes);
    std::vector<float> x(static_cast<size_t>(hd)), dec(size_t(n) * size_t(hd));
    for (int t = 0; t < n; ++t) {
      for (auto& v : x) v = nd(rng);
      kv_row_encode(f, 1.f, x.data(), rows.data() + size_t(t) * f.row_bytes);
      kv_row_decode(f, 1.f, rows.data() + size_t(t) * f.row_bytes, dec.data() + size_t(t) * size_t(hd));
    }
    std::vector<float> p(size_t(n), 1e-9f);
    p[17] = 1.f;
    std::vector<float> got(size_t(hd), 0.f);
    kv_rows_accum_avx512(f, 1.f, p.data(), n, 1, rows.data(), f.row_bytes, n, got.data());
    double vmax = 0;
    for (float v : dec) vmax = std::max(vmax, double(std::fabs(v)));
    for (int d = 0; d < hd; ++d)
      ASSERT_NEAR(got[size_t(d)], dec[size_t(17) * size_t(hd) + size_t(d)], 1e-4 * vmax) << fm.name << " d " << d;
  }
#endif
}

// q4_0 and head_dim not a multiple of 64 (the float table-lookup kernel) and the AVX2 kernel: f32
// rounding only.
TEST(KvRowsAccum, FloatKernelsMatchReference) {
#if !defined(KVQ_HAVE_SIMD)
  GTEST_SKIP() << "built without SIMD kernels";
#else
  const CpuFeatures& cf = cpu_features();
  std::mt19937 rng(13);
  std::normal_distribution<float> nd;
  for (const Fmt& fm : kAllFmts) {
    for (int hd : {32, 64, 96, 128, 160, 256}) {
      if (fm.group > hd || hd % std::max(32, fm.group) != 0) continue;
      const KvRowFmt f = kv_row_fmt(fm.e, hd, fm.group);
      if (test::kv_int_accum_active(f)) continue;  // the tests above
      for (int n : {1, 37, 64}) {
        const int nq = 4;
        std::vector<uint8_t> rows(size_t(n) * f.row_bytes);
        std::vector<float> x(static_cast<size_t>(hd)), dec(size_t(n) * size_t(hd));
        for (int t = 0; t < n; ++t) {
          for (auto& v : x) v = nd(rng);
          kv_row_encode(f, 1.f, x.data(), rows.data() + size_t(t) * f.row_bytes);
          kv_row_decode(f, 1.f, rows.data() + size_t(t) * f.row_bytes, dec.data() + size_t(t) * size_t(hd));
        }
        std::vector<float> p(size_t(nq) * size_t(n));
        for (auto& v : p) v = std::fabs(nd(rng));
        std::vector<float> ref(size_t(nq) * size_t(hd), 0.f);
        kv_rows_accum_ref(f, 1.f, p.data(), n, nq, rows.data(), f.row_bytes, n, ref.data());
        for (int variant = 0; variant < 2; ++variant) {
          if (variant == 0 && !(cf.avx2 && cf.fma)) continue;
          if (variant == 1 && !(cf.avx512f && cf.avx512bw && cf.avx512vl)) continue;
          std::vector<float> got(ref.size(), 0.f);
          if (variant == 0) kv_rows_accum_avx2(f, 1.f, p.data(), n, nq, rows.data(), f.row_bytes, n, got.data());
          else kv_rows_accum_avx512(f, 1.f, p.data(), n, nq, rows.data(), f.row_bytes, n, got.data());
          for (int i = 0; i < nq; ++i)
            for (int d = 0; d < hd; ++d) {
              double mag = 0;
              for (int t = 0; t < n; ++t)
                mag += std::fabs(double(p[size_t(i) * size_t(n) + size_t(t)]) * dec[size_t(t) * size_t(hd) + size_t(d)]);
              const size_t k = size_t(i) * size_t(hd) + size_t(d);
              ASSERT_NEAR(got[k], ref[k], 1e-5 * mag + 1e-30) << fm.name << " hd " << hd << " variant " << variant;
            }
        }
      }
    }
  }
#endif
}
