#include "kv/row_codec.h"

#include <algorithm>

#include "core/cpu.h"
#include "core/error.h"
#include "kv/grouped_common.h"

namespace kvq {

KvRowCodec::KvRowCodec(std::string name, const KvRowFmt& fmt, int n_kv_heads,
                       std::vector<float> head_scales)
    : fmt_(fmt), scales_(std::move(head_scales)) {
  info_.name = std::move(name);
  info_.code_bits = kv_elem_code_bits(fmt.elem);
  if (scales_.empty()) scales_.assign(size_t(n_kv_heads), 1.f);
  KVQ_CHECK(int(scales_.size()) == n_kv_heads, "{} scales for {} heads", scales_.size(), n_kv_heads);
}

size_t KvRowCodec::block_bytes(int block_tokens) const {
  kv_check_block(info_.name, block_tokens);
  return size_t(block_tokens) * fmt_.row_bytes;
}

float KvRowCodec::scale(int head) const {
  if (head < 0 || size_t(head) >= scales_.size())
    fail("{}: KV head {} is outside the codec's {} heads (KvCodecParams::n_kv_heads)", info_.name, head, scales_.size());
  return scales_[size_t(head)];
}

void KvRowCodec::encode(int head, const float* src, size_t src_stride, int n, uint8_t* block,
                        int block_tokens, int t0, int) const {
  kv_check_token_range(info().name, block_tokens, t0, n);
  for (int t = 0; t < n; ++t)
    kv_row_encode(fmt_, scale(head), src + size_t(t) * src_stride,
                  block + size_t(t0 + t) * fmt_.row_bytes);
}

void KvRowCodec::decode(int head, const uint8_t* block, int block_tokens, int t0, int n, int,
                        float* dst) const {
  kv_check_token_range(info().name, block_tokens, t0, n);
  for (int t = 0; t < n; ++t)
    kv_row_decode(fmt_, scale(head), block + size_t(t0 + t) * fmt_.row_bytes,
                  dst + size_t(t) * size_t(fmt_.head_dim));
}

void KvRowCodec::prepare_query(int, const float* q, int n_q, float* qp) const {
  kv_rows_prepare_query(fmt_, q, n_q, qp);
}

void KvRowCodec::scores(int head, const float* qp, int n_q, const uint8_t* block, int block_tokens,
                        int t0, int n, int, float* out, int out_stride) const {
  kv_check_token_range(info().name, block_tokens, t0, n);
  kv_rows_scores_prepared(fmt_, scale(head), qp, n_q, block + size_t(t0) * fmt_.row_bytes,
                          fmt_.row_bytes, n, out, out_stride);
}

void KvRowCodec::accumulate(int head, const float* p, int p_stride, int n_q, const uint8_t* block,
                            int block_tokens, int t0, int n, float* acc) const {
  kv_check_token_range(info().name, block_tokens, t0, n);
  kv_rows_accum(fmt_, scale(head), p, p_stride, n_q, block + size_t(t0) * fmt_.row_bytes,
                fmt_.row_bytes, n, acc);
}

KvCodec::PrefetchRange KvRowCodec::prefetch_range(int block_tokens, int t0, int n) const {
  // Measured at 32K tokens, 4 query rows (attn_bench decode/): requesting the leading rows one
  // call early made f32 / f16 / bf16 13-19% and int4g / int2g 1-10% faster, but fp8, int8, q8_0
  // and q4_0 0-4% slower: their kernels are compute-bound there (cold within ~10% of hot) and
  // already keep enough lines in flight with their own prefetch.
  switch (fmt_.elem) {
    case KvElem::f32:
    case KvElem::f16:
    case KvElem::bf16:
    case KvElem::int4g:
    case KvElem::int2g:
      break;
    default:
      return {};
  }
  return lead_of(prefetch_along_range(block_tokens, t0, n));
}

bool KvRowCodec::prefetches_along() const {
  return cpu_level() != CpuLevel::scalar;
}

KvCodec::PrefetchRange KvRowCodec::prefetch_along_range(int block_tokens, int t0, int n) const {
  if (t0 < 0 || n <= 0 || t0 >= block_tokens) return {};
  return {size_t(t0) * fmt_.row_bytes, size_t(std::min(n, block_tokens - t0)) * fmt_.row_bytes};
}

}  // namespace kvq
