#include "attn/softmax.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "core/cpu.h"

namespace kvq {

float attn_exp_sub_ref(float* x, int n, float m) {
  float s = 0;
  for (int i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - m);
    s += x[i];
  }
  return s;
}

float attn_exp_sub(float* x, int n, float m) {
#if defined(KVQ_HAVE_SIMD)
  switch (cpu_level()) {
    case CpuLevel::avx512: return attn_exp_sub_avx512(x, n, m);
    case CpuLevel::avx2: return attn_exp_sub_avx2(x, n, m);
    case CpuLevel::scalar: break;
  }
#endif
  return attn_exp_sub_ref(x, n, m);
}

float attn_scale_max_ref(float* x, int n, float scale) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int i = 0; i < n; ++i) {
    x[i] *= scale;
    mx = std::max(mx, x[i]);
  }
  return mx;
}

float attn_scale_max(float* x, int n, float scale) {
#if defined(KVQ_HAVE_SIMD)
  switch (cpu_level()) {
    case CpuLevel::avx512: return attn_scale_max_avx512(x, n, scale);
    case CpuLevel::avx2: return attn_scale_max_avx2(x, n, scale);
    case CpuLevel::scalar: break;
  }
#endif
  return attn_scale_max_ref(x, n, scale);
}

}  // namespace kvq
