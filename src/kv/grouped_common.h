// Helpers shared by the grouped KV codecs (KIVI, KVQuant): parameter validation with clear
// messages, f16 fields inside head blocks, and decode-based fallbacks for the role a codec is not
// built for (a key codec used for values still works, just without a fused kernel).
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "core/dtypes.h"
#include "kvq/kv_format.h"

namespace kvq {

// Stack buffers in the kernels are sized by this; codecs reject larger heads.
constexpr int kvg_max_head_dim = 512;

// f(std::integral_constant<int, D>) with D = head_dim for the head sizes that have constant-shape
// kernel instances (64, 128, 256: loops unrolled whole), else D = 0 (the instance that reads the
// shape at run time). The one list of those sizes for the kvquant and kivi kernels.
template <class F>
inline decltype(auto) kvg_with_head_dim(int head_dim, F&& f) {
  switch (head_dim) {
    case 64: return f(std::integral_constant<int, 64>{});
    case 128: return f(std::integral_constant<int, 128>{});
    case 256: return f(std::integral_constant<int, 256>{});
    default: return f(std::integral_constant<int, 0>{});
  }
}

// Head-block fields are not aligned for 16-bit access (groups follow odd-sized code areas).
inline f16_t kvg_load_f16(const uint8_t* base, size_t i) {
  f16_t h;
  std::memcpy(&h, base + 2 * i, 2);
  return h;
}
inline void kvg_store_f16(uint8_t* base, size_t i, f16_t h) { std::memcpy(base + 2 * i, &h, 2); }

// The formats store scales in f16, so inputs are clamped to its finite range (what an fp16
// model can produce); NaN is stored as 0 so that one bad element cannot poison a whole group's
// scale.
inline float kv_sanitize(float x) {
  if (!(x == x)) return 0.f;
  return x > 65504.f ? 65504.f : (x < -65504.f ? -65504.f : x);
}

// G >= 1, R >= 0, R % G == 0, head_dim % 16 == 0 and <= kvg_max_head_dim.
void kv_check_grouped_params(const char* name, int head_dim, int group_tokens, int residual_tokens);
// The argument checks of every codec's entry points (kvq::Error: a caller's mistake, never an
// abort): a block of 1 .. kv_max_block_tokens tokens, and [t0, t0 + n) inside it.
constexpr int kv_max_block_tokens = 1 << 20;
void kv_check_block(const std::string& name, int block_tokens);
void kv_check_token_range(const std::string& name, int block_tokens, int t0, int n);
// block_tokens > 0 and a multiple of G.
void kv_check_block_tokens(const std::string& name, int block_tokens, int group_tokens);
// t0 and n multiples of G, [t0, t0 + n) inside the block.
void kv_check_encode_range(const std::string& name, int block_tokens, int group_tokens, int t0,
                           int n);
// KvCodecParams::group_tokens / residual_tokens with their "codec default" markers resolved.
void kv_resolve_grouped(const char* name, const KvCodecParams& p, int default_g, int default_r,
                        int* g, int* r);

// Per-thread scratch of at least n floats, grown on first use, so that kernels do not allocate in
// steady state. One buffer per Tag: a codec that wraps another (rotated, centered, mixed-precision
// codecs) uses its own tag, so the inner codec's scratch never aliases the outer one's.
template <class Tag>
float* kv_thread_scratch(size_t n) {
  thread_local std::vector<float> buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

// Requests [p, p + bytes) ahead of a fused kernel's reads (into L2): a head block spans a few
// 4 KiB pages, where the hardware prefetchers stop, so the kernel would otherwise wait on a
// demand miss at each page start; issued at once, the block's lines arrive in parallel.
inline void kvg_prefetch(const uint8_t* p, size_t bytes) {
  for (size_t b = 0; b < bytes; b += 64) __builtin_prefetch(p + b, 0, 2);
}

void kv_scores_via_decode(const KvCodec& c, int head, const float* qp, int n_q,
                          const uint8_t* block, int block_tokens, int t0, int n, int pos0,
                          float* out, int out_stride);
void kv_accumulate_via_decode(const KvCodec& c, int head, const float* p, int p_stride, int n_q,
                              const uint8_t* block, int block_tokens, int t0, int n, int pos0,
                              float* acc);

}  // namespace kvq
