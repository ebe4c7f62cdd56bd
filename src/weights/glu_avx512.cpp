#include <immintrin.h>

#include "weights/glu.h"

namespace kvq {
namespace {

// e^z for z clamped to [-87, 88] (beyond it 1 / (1 + e^z) is 0 or 1 to float precision anyway):
// z = k ln2 + r, |r| <= ln2/2, ln2 in two parts so r is exact to ~1 ulp; e^r by its Taylor
// polynomial to degree 7 (truncation < 1e-8 relative); 2^k built in the exponent field.
inline __m512 exp16(__m512 z) {
  z = _mm512_min_ps(_mm512_max_ps(z, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(z, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693359375f), z);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(k), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(e));
}

template <GluAct A>
inline __m512 act16(__m512 x) {
  __m512 z;  // act(x) = x / (1 + e^z)
  if constexpr (A == GluAct::silu) {
    z = _mm512_sub_ps(_mm512_setzero_ps(), x);
  } else if constexpr (A == GluAct::swiglu_oai) {  // x already min(gate, limit)
    z = _mm512_mul_ps(_mm512_set1_ps(-kSwigluOaiAlpha), x);
  } else {
    const __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
    const __m512 u = _mm512_mul_ps(_mm512_set1_ps(0.7978845608028654f), _mm512_fmadd_ps(_mm512_set1_ps(0.044715f), x3, x));
    z = _mm512_mul_ps(_mm512_set1_ps(-2.0f), u);
  }
  return _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), exp16(z)));
}

// act(gate) * up; swiglu_oai: act(min(gate, limit)) * (clamp(up, -limit, limit) + 1)
template <GluAct A>
inline __m512 glu_one(__m512 g, __m512 u) {
  if constexpr (A == GluAct::swiglu_oai) {
    const __m512 lim = _mm512_set1_ps(kSwigluOaiLimit);
    g = _mm512_min_ps(g, lim);
    u = _mm512_add_ps(_mm512_min_ps(_mm512_max_ps(u, _mm512_sub_ps(_mm512_setzero_ps(), lim)), lim), _mm512_set1_ps(1.0f));
  }
  return _mm512_mul_ps(act16<A>(g), u);
}

template <GluAct A>
void glu16(const float* gate, const float* up, float* out, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(out + i, glu_one<A>(_mm512_loadu_ps(gate + i), _mm512_loadu_ps(up + i)));
  if (i < n) {  // the tail through the same vector math, so results never depend on where a split falls
    const __mmask16 m = __mmask16((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(out + i, m, glu_one<A>(_mm512_maskz_loadu_ps(m, gate + i), _mm512_maskz_loadu_ps(m, up + i)));
  }
}

}  // namespace

void glu_avx512(GluAct act, const float* gate, const float* up, float* out, size_t n) {
  if (act == GluAct::gelu_tanh) glu16<GluAct::gelu_tanh>(gate, up, out, n);
  else if (act == GluAct::swiglu_oai) glu16<GluAct::swiglu_oai>(gate, up, out, n);
  else glu16<GluAct::silu>(gate, up, out, n);
}

}  // namespace kvq
