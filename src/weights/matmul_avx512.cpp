// AVX-512 level of the weight kernels: VNNI (vpdpbusd) integer dots, masks for 5-bit codes, and
// 32 vector registers for larger register tiles (4 rows x 4 tokens share each unpacked block).
#define KVQ_X86_NS x86_avx512
#define KVQ_X86_VNNI 1
#define KVQ_NR_32 4
#define KVQ_NT_32 4
#define KVQ_NR_K 4
#define KVQ_NT_K 2
#define KVQ_NR_F 4
#define KVQ_NT_F 4
#include "weights/matmul_x86.inl"

namespace kvq {

MatmulTileFn matmul_kernel_avx512(GgmlType t) { return x86_avx512::kernel_for(t); }

}  // namespace kvq
