// AVX2 variant of the gated FFN activation: the AVX-512 kernel's arithmetic (glu_avx512.cpp) on 8
// lanes, so both levels give the same value per element.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "weights/glu.h"

namespace kvq {
namespace {

// e^z for z clamped to [-87, 88], as exp16 in glu_avx512.cpp.
inline __m256 exp8(__m256 z) {
  z = _mm256_min_ps(_mm256_max_ps(z, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(z, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), z);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

template <GluAct A>
inline __m256 act8(__m256 x) {
  __m256 z;  // act(x) = x / (1 + e^z)
  if constexpr (A == GluAct::silu) {
    z = _mm256_sub_ps(_mm256_setzero_ps(), x);
  } else if constexpr (A == GluAct::swiglu_oai) {  // x already min(gate, limit)
    z = _mm256_mul_ps(_mm256_set1_ps(-kSwigluOaiAlpha), x);
  } else {
    const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
    const __m256 u = _mm256_mul_ps(_mm256_set1_ps(0.7978845608028654f), _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), x3, x));
    z = _mm256_mul_ps(_mm256_set1_ps(-2.0f), u);
  }
  return _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(z)));
}

// act(gate) * up; swiglu_oai: act(min(gate, limit)) * (clamp(up, -limit, limit) + 1)
template <GluAct A>
inline __m256 glu_one(__m256 g, __m256 u) {
  if constexpr (A == GluAct::swiglu_oai) {
    const __m256 lim = _mm256_set1_ps(kSwigluOaiLimit);
    g = _mm256_min_ps(g, lim);
    u = _mm256_add_ps(_mm256_min_ps(_mm256_max_ps(u, _mm256_sub_ps(_mm256_setzero_ps(), lim)), lim), _mm256_set1_ps(1.0f));
  }
  return _mm256_mul_ps(act8<A>(g), u);
}

template <GluAct A>
void glu8(const float* gate, const float* up, float* out, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, glu_one<A>(_mm256_loadu_ps(gate + i), _mm256_loadu_ps(up + i)));
  if (i < n) {  // the tail through the same vector math, so results never depend on where a split falls
    alignas(32) float g[8] = {}, u[8] = {}, o[8];
    const size_t m = n - i;
    std::memcpy(g, gate + i, m * sizeof(float));
    std::memcpy(u, up + i, m * sizeof(float));
    _mm256_store_ps(o, glu_one<A>(_mm256_load_ps(g), _mm256_load_ps(u)));
    std::memcpy(out + i, o, m * sizeof(float));
  }
}

}  // namespace

void glu_avx2(GluAct act, const float* gate, const float* up, float* out, size_t n) {
  if (act == GluAct::gelu_tanh) glu8<GluAct::gelu_tanh>(gate, up, out, n);
  else if (act == GluAct::swiglu_oai) glu8<GluAct::swiglu_oai>(gate, up, out, n);
  else glu8<GluAct::silu>(gate, up, out, n);
}

}  // namespace kvq
