// Adversarial inputs shared by the tiled-codec tests (test_int_tiled, test_int8_tiled,
// test_kivi_tiled): codecs by name, key/value rows by pattern, queries.
#pragma once
#include <cmath>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

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

}  // namespace kvq::test
