#include "weights/kernels.h"
namespace kvq {
MatmulTileFn matmul_kernel_avx512(GgmlType) { return nullptr; }
}
