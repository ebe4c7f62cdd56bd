// CPU feature detection and the one place that decides which kernel variant runs.
// KVQ_CPU=scalar|avx2|avx512 in the environment caps the level (for parity tests and benchmarks).
// avx512: AVX-512 F/BW/VL/DQ, VNNI, BF16, VBMI and GFNI (Zen 4 and later, Sapphire Rapids and
// later); avx2: AVX2 and FMA (with F16C); else scalar.
#pragma once

#include <atomic>

namespace kvq {

enum class CpuLevel { scalar = 0, avx2 = 1, avx512 = 2 };

struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
  bool avx512bf16 = false, avx512vnni = false, avx512vbmi = false, gfni = false;
};

const CpuFeatures& cpu_features();
namespace detail {
// cpu_level()'s value, -1 until its first use; every kernel dispatch reads it, so it is inline.
inline std::atomic<int> cpu_level_now{-1};
int cpu_level_init();
}  // namespace detail

// Highest level both compiled in and supported by this CPU, capped by KVQ_CPU / cpu_set_level.
inline CpuLevel cpu_level() {
  const int l = detail::cpu_level_now.load(std::memory_order_relaxed);
  return CpuLevel(l >= 0 ? l : detail::cpu_level_init());
}
// Caps the level for this process (tests use it to run every variant); returns the previous cap.
CpuLevel cpu_set_level(CpuLevel cap);
const char* cpu_level_name(CpuLevel l);

// The variant of a kernel for cpu_level(), for a family whose variants are name_ref, name_avx2 and
// name_avx512 with one signature: a family's dispatch point is `KVQ_CPU_PICK(name)(args...)`.
template <class Fn>
Fn cpu_pick(Fn ref, [[maybe_unused]] Fn avx2, [[maybe_unused]] Fn avx512) {
  switch (cpu_level()) {
    case CpuLevel::avx512: return avx512;
    case CpuLevel::avx2: return avx2;
    case CpuLevel::scalar: break;
  }
  return ref;
}

}  // namespace kvq

// The SIMD variants exist only in SIMD builds (cpu_level() is then always scalar anyway).
#if defined(KVQ_HAVE_SIMD)
#define KVQ_CPU_PICK(name) ::kvq::cpu_pick(name##_ref, name##_avx2, name##_avx512)
#else
#define KVQ_CPU_PICK(name) (name##_ref)
#endif
