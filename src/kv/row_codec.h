// KvRowCodec: a per-token codec whose head block is block_tokens rows of one KvRowFmt (kv_rows.h),
// token t at byte t * row_bytes. All the basic families (float, fp8, int8, grouped int4/int2,
// q8_0, q4_0) are instances of it; they differ in row format and per-head scales only.
#pragma once
#include <vector>

#include "kv/kv_rows.h"
#include "kvq/kv_format.h"

namespace kvq {

class KvRowCodec : public KvCodec {
 public:
  // head_scales: per-head multiplier of the fixed/static formats (n_kv_heads entries), empty = 1.
  KvRowCodec(std::string name, const KvRowFmt& fmt, int n_kv_heads, std::vector<float> head_scales = {});

  const KvCodecInfo& info() const override { return info_; }
  int head_dim() const override { return fmt_.head_dim; }
  size_t block_bytes(int block_tokens) const override;
  void encode(int head, const float* src, size_t src_stride, int n, uint8_t* block, int block_tokens,
              int t0, int pos0) const override;
  void decode(int head, const uint8_t* block, int block_tokens, int t0, int n, int pos0,
              float* dst) const override;
  // The 4-bit formats append an int8 image of the query (kv_rows_prepare_query) for the
  // integer-dot kernels; the others use the plain query.
  int prepared_query_dim() const override { return fmt_.head_dim + kv_rows_query_extra_floats(fmt_); }
  void prepare_query(int head, const float* q, int n_q, float* qp) const override;
  void scores(int head, const float* qp, int n_q, const uint8_t* block, int block_tokens, int t0,
              int n, int pos0, float* out, int out_stride) const override;
  void accumulate(int head, const float* p, int p_stride, int n_q, const uint8_t* block,
                  int block_tokens, int t0, int n, float* acc) const override;
  // The float and grouped int4 / int2 rows only (see row_codec.cpp).
  PrefetchRange prefetch_range(int block_tokens, int t0, int n) const override;
  // At SIMD levels (kv_rows_simd.h's kv_prefetch_ahead and the bf16 / fp8 kernels call it).
  bool prefetches_along() const override;
  PrefetchRange prefetch_along_range(int block_tokens, int t0, int n) const override;

  const KvRowFmt& fmt() const { return fmt_; }
  // Head `head`'s scale; kvq::Error for a head outside [0, n_kv_heads).
  float scale(int head) const;

 private:
  KvCodecInfo info_;
  KvRowFmt fmt_;
  std::vector<float> scales_;  // (n_kv_heads)
};

}  // namespace kvq
