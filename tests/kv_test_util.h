// Helpers shared by the KV codec tests: seeded Gaussian data and the CPU levels this machine runs.
#pragma once
#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

#include "core/cpu.h"

namespace kvq::test {

// (n, d) values from N(0, sd^2), reproducible from the seed.
inline std::vector<float> gaussian(int n, int d, uint64_t seed, float sd = 1.f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, sd);
  std::vector<float> x(size_t(n) * size_t(d));
  for (float& v : x) v = nd(rng);
  return x;
}

// Every kernel level this CPU can run, scalar first.
inline std::vector<CpuLevel> levels() {
  std::vector<CpuLevel> v{CpuLevel::scalar};
  const CpuLevel prev = cpu_set_level(CpuLevel::avx512);
  const CpuLevel top = cpu_level();
  cpu_set_level(prev);
  if (top >= CpuLevel::avx2) v.push_back(CpuLevel::avx2);
  if (top >= CpuLevel::avx512) v.push_back(CpuLevel::avx512);
  return v;
}

}  // namespace kvq::test
