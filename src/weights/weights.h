// Weight tensors in their GGUF types, used as they are: dequantization happens inside the kernels.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/thread_pool.h"
#include "gguf/ggml_types.h"

namespace kvq {

// A 2-D weight view: n_out rows of n_in elements in `type`, row r at data + r * row_bytes.
struct WeightView {
  GgmlType type = GgmlType::F32;
  const void* data = nullptr;
  int64_t n_in = 0;    // ne[0]
  int64_t n_out = 0;   // ne[1]
  size_t row_bytes = 0;
};

// True if kvq computes with this type (F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K,
// Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS, MXFP4).
bool weight_type_supported(GgmlType t);

// Reference dequantization of n elements (n a multiple of the type's block size).
void dequantize_row_ref(GgmlType t, const void* src, float* dst, int64_t n);
// Fast dequantization (SIMD where available); same results as the reference.
void dequantize_row(GgmlType t, const void* src, float* dst, int64_t n);

// y (n_tok, n_out) = x (n_tok, n_in) . W^T. Multi-threaded over the pool; SIMD kernels chosen by
// cpu_level(). n_tok == 1 is the decode matrix-vector product.
void matmul(const WeightView& w, const float* x, int64_t n_tok, float* y, ThreadPool& pool);
// Several independent products in one pass over the pool (the experts a step runs): job j is
// matmul(*w, x, n_tok, y). Each row's result is the one matmul gives; threads share out the rows
// of all jobs at once instead of meeting after each.
struct MatmulJob {
  const WeightView* w;
  const float* x;
  int64_t n_tok;
  float* y;
};
void matmul_many(const MatmulJob* jobs, int n_jobs, ThreadPool& pool);
// Batch-invariant matmuls (off by default; process-wide): every call runs the kernels of a
// one-token call, so a token's result does not depend on how many tokens share the call. On
// AVX-512 the calls of 12 or more tokens otherwise run prefill kernels that round their sums
// differently (and about 2.5x faster); the AVX2 and scalar kernels are batch-invariant already.
void matmul_set_batch_invariant(bool on);
bool matmul_batch_invariant();
// Scalar reference of the same product (dequantize rows, f32 dot products in double).
void matmul_ref(const WeightView& w, const float* x, int64_t n_tok, float* y);

// Row r of W dequantized (embedding lookup).
void weight_row(const WeightView& w, int64_t r, float* dst);

}  // namespace kvq
