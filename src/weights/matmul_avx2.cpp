#include "weights/kernels.h"
#include "weights/weights.h"
namespace kvq {
MatmulTileFn matmul_kernel_avx2(GgmlType) { return nullptr; }
void dequantize_row_f16_avx2(GgmlType t, const void* src, float* dst, int64_t n) { dequantize_row_ref(t, src, dst, n); }
}
