#include "weights/glu.h"

#include <algorithm>
#include <cmath>

#include "core/cpu.h"

namespace kvq {

void glu_ref(GluAct act, const float* gate, const float* up, float* out, size_t n) {
  if (act == GluAct::gelu_tanh) {
    for (size_t i = 0; i < n; ++i) {
      const float x = gate[i];
      out[i] = 0.5f * x * (1.0f + std::tanh(0.7978845608028654f * (x + 0.044715f * x * x * x))) * up[i];
    }
  } else if (act == GluAct::swiglu_oai) {
    for (size_t i = 0; i < n; ++i) {
      const float g = std::min(gate[i], kSwigluOaiLimit);
      const float u = std::clamp(up[i], -kSwigluOaiLimit, kSwigluOaiLimit);
      out[i] = g / (1.0f + std::exp(-kSwigluOaiAlpha * g)) * (u + 1.0f);
    }
  } else {
    for (size_t i = 0; i < n; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
  }
}

#if !defined(KVQ_HAVE_SIMD)
void glu_avx512(GluAct act, const float* gate, const float* up, float* out, size_t n) { glu_ref(act, gate, up, out, n); }
void glu_avx2(GluAct act, const float* gate, const float* up, float* out, size_t n) { glu_ref(act, gate, up, out, n); }
#endif

void glu(GluAct act, const float* gate, const float* up, float* out, size_t n, ThreadPool& pool) {
  const CpuLevel lvl = cpu_level();
  auto fn = lvl >= CpuLevel::avx512 ? glu_avx512 : lvl >= CpuLevel::avx2 ? glu_avx2 : glu_ref;
  // below ~16K elements (decode) a parallel region costs more than it saves
  constexpr size_t kGrain = 8192;
  if (n < 2 * kGrain || pool.size() == 1) {
    fn(act, gate, up, out, n);
    return;
  }
  pool.parallel_for(n, kGrain, [&](size_t b, size_t e) { fn(act, gate + b, up + b, out + b, e - b); });
}

}  // namespace kvq
