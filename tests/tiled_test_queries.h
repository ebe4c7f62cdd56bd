// Adversarial queries shared by the tiled-codec tests (test_int4_tiled, test_kivi_tiled).
#pragma once
#include <random>
#include <vector>

namespace kvq::test {

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
