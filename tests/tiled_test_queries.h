// Adversarial inputs shared by the tiled-codec tests (test_int_tiled, test_int8_tiled,
// test_kivi_tiled): codecs by name, key/value rows by pattern, queries; and the check of a codec's
// kernels through the codec API at every CPU level.
#pragma once
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/cpu.h"
#include "kvq/kv_format.h"

namespace kvq::test {

// G, R: grouped codecs' token group and full-precision window (0 / -1: the codec's default).
inline std::unique_ptr<KvCodec> make(const std::string& name, int hd, KvRole role, int G = 0, int R = -1) {
  KvCodecParams p;
  p.head_dim = hd;
  p.n_kv_heads = 2;
  p.role = role;
  p.group_tokens = G;
  p.residual_tokens = R;
  return kv_codec_create(name, p);
}

// nonfinite (NaN, inf, beyond f16) only for codecs whose encoder sanitizes its input (kivi).
enum class Pat { random, outlier_channel, constant_rows, zeros, huge, tiny, mixed_scale, nonfinite };
inline const Pat kPats[] = {Pat::random, Pat::outlier_channel, Pat::constant_rows, Pat::zeros,
                            Pat::huge,   Pat::tiny,            Pat::mixed_scale};

inline std::vector<float> make_rows(Pat p, int n, int hd, std::mt19937& rng) {
  std::normal_distribution<float> nd;
  std::vector<float> x(size_t(n) * size_t(hd));
  for (int t = 0; t < n; ++t)
    for (int d = 0; d < hd; ++d) {
      float& v = x[size_t(t) * size_t(hd) + size_t(d)];
      switch (p) {
        case Pat::random: v = nd(rng); break;
        case Pat::outlier_channel: v = nd(rng) * (d == 5 || d == hd - 3 ? 300.f : 1.f); break;
        case Pat::constant_rows: v = 0.75f * float(t % 3 - 1); break;
        case Pat::zeros: v = 0; break;
        case Pat::huge: v = nd(rng) * 1e4f; break;
        case Pat::tiny: v = nd(rng) * 1e-6f; break;
        case Pat::mixed_scale: v = nd(rng) * std::ldexp(1.f, (t % 20) - 10); break;
        case Pat::nonfinite: {  // kivi's encoder: NaN -> 0, +-inf / 1e6 -> +-65504
          const int k = (t * 7 + d) % 13;
          v = k == 0 ? std::numeric_limits<float>::quiet_NaN()
                     : k == 1 ? std::numeric_limits<float>::infinity() : k == 2 ? -1e6f : nd(rng);
          break;
        }
      }
    }
  return x;
}

// Queries: random, an outlier channel, an all-zero 32-block, tiny and huge magnitudes.
inline std::vector<float> make_queries(int variant, int nq, int hd, std::mt19937& rng) {
  std::normal_distribution<float> nd;
  std::vector<float> q(size_t(nq) * size_t(hd));
  for (int i = 0; i < nq; ++i)
    for (int d = 0; d < hd; ++d) {
      float v = nd(rng);
      switch (variant % 4) {
        case 1: v *= (d == 7 ? 100.f : 1.f); break;
        case 2: v = d < 32 ? 0.f : v; break;
        case 3: v *= (i % 2 ? 1e-5f : 1e3f); break;
        default: break;
      }
      q[size_t(i) * size_t(hd) + size_t(d)] = v;
    }
  return q;
}

// Codec `name`'s key scores and value sums through the codec API at every CPU level, as attention
// calls them (head 1, tokens kApiT0 .. kApiT0 + kApiN - 1 of a 64-token block of outlier-channel
// rows, head_dim kApiHd, 4 query rows): scores bit-identical to the scalar level's, sums within
// 1e-5 * mag(dec, p, i, d) + 1e-30 of them (f32 summation order), dec the decoded value block
// (64, kApiHd) and p the weights (4, kApiN).
inline constexpr int kApiHd = 128, kApiT0 = 9, kApiN = 40;
inline void codec_api_every_level(
    const std::string& name, int query_variant,
    const std::function<double(const std::vector<float>& dec, const std::vector<float>& p, int i, int d)>& mag) {
  std::mt19937 rng(13);
  std::normal_distribution<float> nd;
  const CpuLevel saved = cpu_set_level(CpuLevel::avx512);
  const int hd = kApiHd, bt = 64, nq = 4, t0 = kApiT0, n = kApiN;
  auto kc = make(name, hd, KvRole::key);
  auto vc = make(name, hd, KvRole::value);
  auto x = make_rows(Pat::outlier_channel, bt, hd, rng);
  std::vector<uint8_t> kb(kc->block_bytes(bt)), vb(vc->block_bytes(bt));
  kc->encode(1, x.data(), size_t(hd), bt, kb.data(), bt, 0, 0);
  vc->encode(1, x.data(), size_t(hd), bt, vb.data(), bt, 0, 0);
  auto q = make_queries(query_variant, nq, hd, rng);
  std::vector<float> p(size_t(nq) * n);
  for (auto& v : p) v = std::fabs(nd(rng));
  std::vector<float> dec(size_t(bt) * size_t(hd));
  vc->decode(1, vb.data(), bt, 0, bt, 0, dec.data());
  std::vector<float> s_ref, a_ref;
  for (CpuLevel lvl : {CpuLevel::scalar, CpuLevel::avx2, CpuLevel::avx512}) {
    cpu_set_level(lvl);
    std::vector<float> qp(size_t(nq) * size_t(kc->prepared_query_dim())), s(size_t(nq) * n), a(size_t(nq) * hd, 0.f);
    kc->prepare_query(1, q.data(), nq, qp.data());
    kc->scores(1, qp.data(), nq, kb.data(), bt, t0, n, 0, s.data(), n);
    vc->accumulate(1, p.data(), n, nq, vb.data(), bt, t0, n, a.data());
    if (lvl == CpuLevel::scalar) {
      s_ref = s;
      a_ref = a;
      continue;
    }
    EXPECT_EQ(std::memcmp(s.data(), s_ref.data(), sizeof(float) * s.size()), 0) << cpu_level_name(lvl);
    for (int i = 0; i < nq; ++i)
      for (int d = 0; d < hd; ++d)
        EXPECT_NEAR(a[size_t(i) * size_t(hd) + size_t(d)], a_ref[size_t(i) * size_t(hd) + size_t(d)],
                    1e-5 * mag(dec, p, i, d) + 1e-30)
            << cpu_level_name(lvl) << " row " << i << " d " << d;
  }
  cpu_set_level(saved);
}

}  // namespace kvq::test
