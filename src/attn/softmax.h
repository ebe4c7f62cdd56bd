// The exponential pass of online softmax: x[i] = exp(x[i] - m), returning the sum. Scalar
// reference (std::exp) and AVX2 / AVX-512 variants (range reduction + degree-6 polynomial,
// relative error < 2e-7 on the range softmax uses) with one signature; attn_exp_sub dispatches.
#pragma once

namespace kvq {

float attn_exp_sub_ref(float* x, int n, float m);
#if defined(KVQ_HAVE_SIMD)
float attn_exp_sub_avx2(float* x, int n, float m);
float attn_exp_sub_avx512(float* x, int n, float m);
#endif
float attn_exp_sub(float* x, int n, float m);

// The scaling pass before it: x[i] *= scale, returning max_i x[i] (-inf for n = 0; NaN entries are
// skipped by the max, as std::max(m, NaN) = m does).
float attn_scale_max_ref(float* x, int n, float scale);
#if defined(KVQ_HAVE_SIMD)
float attn_scale_max_avx2(float* x, int n, float scale);
float attn_scale_max_avx512(float* x, int n, float scale);
#endif
float attn_scale_max(float* x, int n, float scale);

}  // namespace kvq
