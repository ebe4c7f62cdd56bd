#include "core/avx512.h"

#include <cmath>

#include "attn/softmax.h"

namespace kvq {

namespace {
// exp(x) = 2^k * exp(r), k = round(x / ln2), r = x - k ln2 in [-ln2/2, ln2/2] (ln2 split in two
// parts so that r is exact enough); exp(r) by its Taylor polynomial to degree 6 (error < 2e-7
// relative). x below ~-87.3 flushes to 0 (softmax weights that small do not matter); NaN stays NaN.
inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.3f);
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(k, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(k, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  __m512 y = _mm512_scalef_ps(p, k);
  const __mmask16 small = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  return _mm512_mask_blend_ps(small, y, _mm512_setzero_ps());
}
}  // namespace

float attn_exp_sub_avx512(float* x, int n, float m) {
  const __m512 vm = _mm512_set1_ps(m);
  __m512 acc = _mm512_setzero_ps();
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 y = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), vm));
    _mm512_storeu_ps(x + i, y);
    acc = _mm512_add_ps(acc, y);
  }
  if (i < n) {
    const __mmask16 k = __mmask16((1u << (n - i)) - 1);
    const __m512 y = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, x + i), vm));
    _mm512_mask_storeu_ps(x + i, k, y);
    acc = _mm512_add_ps(acc, _mm512_maskz_mov_ps(k, y));
  }
  return _mm512_reduce_add_ps(acc);
}

// max_ps(v, acc) returns acc when v is NaN: NaN scores are skipped, as in the reference.
float attn_scale_max_avx512(float* x, int n, float scale) {
  const __m512 vs = _mm512_set1_ps(scale);
  __m512 acc = _mm512_set1_ps(-INFINITY);
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 y = _mm512_mul_ps(_mm512_loadu_ps(x + i), vs);
    _mm512_storeu_ps(x + i, y);
    acc = _mm512_max_ps(y, acc);
  }
  if (i < n) {
    const __mmask16 k = __mmask16((1u << (n - i)) - 1);
    const __m512 y = _mm512_mul_ps(_mm512_maskz_loadu_ps(k, x + i), vs);
    _mm512_mask_storeu_ps(x + i, k, y);
    acc = _mm512_mask_max_ps(acc, k, y, acc);
  }
  return _mm512_reduce_max_ps(acc);
}

}  // namespace kvq
