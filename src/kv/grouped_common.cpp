#include "kv/grouped_common.h"

#include <algorithm>

#include "core/error.h"

namespace kvq {

void kv_check_grouped_params(const char* name, int head_dim, int group_tokens,
                             int residual_tokens) {
  if (head_dim <= 0 || head_dim % 16 != 0 || head_dim > kvg_max_head_dim)
    fail("{}: head_dim {} is not supported (needs a multiple of 16, at most {})", name, head_dim,
         kvg_max_head_dim);
  if (group_tokens < 1)
    fail("{}: group_tokens must be >= 1 (got {})", name, group_tokens);
  if (residual_tokens < 0 || residual_tokens % group_tokens != 0)
    fail("{}: the full-precision window (residual_tokens, --kv-residual-tokens) must be a non-negative multiple "
         "of the token group ({}: --kv-group-tokens or @gN); got {}",
         name, group_tokens, residual_tokens);
}

void kv_check_block(const std::string& name, int block_tokens) {
  if (block_tokens <= 0 || block_tokens > kv_max_block_tokens)
    fail("{}: a block of {} tokens; blocks hold 1 to {} tokens (the engine's pages: a power of two, 16 to 256)",
         name, block_tokens, kv_max_block_tokens);
}

void kv_check_token_range(const std::string& name, int block_tokens, int t0, int n) {
  kv_check_block(name, block_tokens);
  if (t0 < 0 || n < 0 || t0 > block_tokens - n)
    fail("{}: tokens [{}, {} + {}) are not inside a block of {} tokens", name, t0, t0, n, block_tokens);
}

void kv_check_block_tokens(const std::string& name, int block_tokens, int group_tokens) {
  if (block_tokens <= 0 || block_tokens % group_tokens != 0)
    fail("{}: the block size ({} tokens) must be a positive multiple of the token group G = {}; "
         "choose a page size divisible by G or a smaller group_tokens",
         name, block_tokens, group_tokens);
}

void kv_check_encode_range(const std::string& name, int block_tokens, int group_tokens, int t0,
                           int n) {
  if (t0 < 0 || n < 0 || t0 % group_tokens != 0 || n % group_tokens != 0 || t0 + n > block_tokens)
    fail("{}: encode of tokens [{}, {}) in a block of {}: grouped codecs encode whole groups of "
         "{} tokens inside the block",
         name, t0, t0 + n, block_tokens, group_tokens);
}

void kv_resolve_grouped(const char* name, const KvCodecParams& p, int default_g, int default_r,
                        int* g, int* r) {
  if (p.group_tokens < 0) fail("{}: group_tokens must be > 0 (0 = default {})", name, default_g);
  if (p.residual_tokens < -1)
    fail("{}: residual_tokens must be >= 0 (-1 = default {})", name, default_r);
  *g = p.group_tokens > 0 ? p.group_tokens : default_g;
  *r = p.residual_tokens >= 0 ? p.residual_tokens : default_r;
}

void kv_scores_via_decode(const KvCodec& c, int head, const float* qp, int n_q,
                          const uint8_t* block, int block_tokens, int t0, int n, int pos0,
                          float* out, int out_stride) {
  kv_check_token_range(c.info().name, block_tokens, t0, n);
  const int D = c.head_dim();
  float k[kvg_max_head_dim];
  for (int t = 0; t < n; ++t) {
    c.decode(head, block, block_tokens, t0 + t, 1, pos0, k);
    for (int i = 0; i < n_q; ++i) {
      float s = 0;
      for (int d = 0; d < D; ++d) s += qp[size_t(i) * D + d] * k[d];
      out[size_t(i) * out_stride + t] = s;
    }
  }
}

void kv_accumulate_via_decode(const KvCodec& c, int head, const float* p, int p_stride, int n_q,
                              const uint8_t* block, int block_tokens, int t0, int n, int pos0,
                              float* acc) {
  kv_check_token_range(c.info().name, block_tokens, t0, n);
  const int D = c.head_dim();
  float v[kvg_max_head_dim];
  for (int t = 0; t < n; ++t) {
    c.decode(head, block, block_tokens, t0 + t, 1, pos0, v);
    for (int i = 0; i < n_q; ++i) {
      const float w = p[size_t(i) * p_stride + t];
      for (int d = 0; d < D; ++d) acc[size_t(i) * D + d] += w * v[d];
    }
  }
}

}  // namespace kvq
