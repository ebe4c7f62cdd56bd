#include "core/cpu.h"

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace kvq {

const CpuFeatures& cpu_features() {
  static const CpuFeatures f = [] {
    CpuFeatures c;
#if defined(__x86_64__)
    __builtin_cpu_init();
    c.avx2 = __builtin_cpu_supports("avx2");
    c.fma = __builtin_cpu_supports("fma");
    c.f16c = true;  // every AVX2 CPU kvq targets has F16C; checked together with avx2 below
    c.avx512f = __builtin_cpu_supports("avx512f");
    c.avx512bw = __builtin_cpu_supports("avx512bw");
    c.avx512vl = __builtin_cpu_supports("avx512vl");
    c.avx512dq = __builtin_cpu_supports("avx512dq");
    c.avx512vnni = __builtin_cpu_supports("avx512vnni");
    c.avx512vbmi = __builtin_cpu_supports("avx512vbmi");
    c.gfni = __builtin_cpu_supports("gfni");
#if defined(__clang__) || __GNUC__ >= 12
    c.avx512bf16 = __builtin_cpu_supports("avx512bf16");
#endif
#endif
    return c;
  }();
  return f;
}

static CpuLevel detected_level() {
#if defined(KVQ_HAVE_SIMD)
  const auto& f = cpu_features();
  if (f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq && f.avx512vnni && f.avx512bf16 && f.avx512vbmi &&
      f.gfni)
    return CpuLevel::avx512;
  if (f.avx2 && f.fma) return CpuLevel::avx2;
#endif
  return CpuLevel::scalar;
}

static int env_cap() {
  const char* e = std::getenv("KVQ_CPU");
  if (!e) return 2;
  if (!std::strcmp(e, "scalar")) return 0;
  if (!std::strcmp(e, "avx2")) return 1;
  return 2;
}

static std::atomic<int> g_cap{-1};  // -1: KVQ_CPU's, read at first use

static int cap_now() {
  int c = g_cap.load(std::memory_order_relaxed);
  if (c < 0) {
    int unset = -1;
    const int e = env_cap();
    c = g_cap.compare_exchange_strong(unset, e) ? e : g_cap.load();
  }
  return c;
}

int detail::cpu_level_init() {
  const int d = int(detected_level()), c = cap_now(), l = d < c ? d : c;
  cpu_level_now.store(l, std::memory_order_relaxed);
  return l;
}

CpuLevel cpu_set_level(CpuLevel cap) {
  const int prev = cap_now();
  g_cap.store(int(cap));
  const int d = int(detected_level());
  detail::cpu_level_now.store(d < int(cap) ? d : int(cap), std::memory_order_relaxed);
  return CpuLevel(prev);
}

const char* cpu_level_name(CpuLevel l) {
  switch (l) {
    case CpuLevel::scalar: return "scalar";
    case CpuLevel::avx2: return "avx2";
    case CpuLevel::avx512: return "avx512";
  }
  return "?";
}

}  // namespace kvq
