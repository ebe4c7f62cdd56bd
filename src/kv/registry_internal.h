// Registration hooks for KV codecs and formats (library-internal). Each format family defines a
// `kv_register_<family>()` function that calls kv_register_codec / kv_register_format; registry.cpp
// calls every family's hook once, on first use (explicit calls, because a static library drops
// object files that nothing references).
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "kvq/kv_format.h"

namespace kvq {

struct KvCodecEntry {
  std::string name;         // e.g. "int4_g32", "tq3.5", "kivi2_k"
  std::string description;  // one line
  // Throws kvq::Error on invalid parameters (message lists what is valid).
  std::function<std::unique_ptr<KvCodec>(const KvCodecParams&)> make;
};

void kv_register_codec(KvCodecEntry e);
void kv_register_format(KvFormatDesc d);

// The per-group codecs' (int4_gN, int2_gN, int4t_gN, int2t_gN) parameter check: unless group
// divides head_dim, throws kvq::Error naming codec `name` and listing the group sizes (32, 64, 128)
// that do. (head_dim itself is checked by kv_codec_create: at most kv_max_head_dim.)
void kv_check_group_size(const std::string& name, int group, int head_dim);

// Base of the codecs that transform vectors around an inner codec (the centered / scaled codecs,
// the Hadamard-rotated ones): the packed layout, the weighted sums and the memory hints are the
// inner codec's, forwarded here; info_ starts as the inner codec's info. The wrappers add what
// they change (encode, decode, the query, scores, the output's transform).
class KvWrappedCodec : public KvCodec {
 public:
  explicit KvWrappedCodec(std::unique_ptr<KvCodec> inner) : inner_(std::move(inner)), info_(inner_->info()) {}
  const KvCodecInfo& info() const override { return info_; }
  int head_dim() const override { return inner_->head_dim(); }
  size_t block_bytes(int block_tokens) const override { return inner_->block_bytes(block_tokens); }
  void accumulate(int head, const float* p, int p_stride, int n_q, const uint8_t* block, int block_tokens, int t0,
                  int n, float* acc) const override {
    inner_->accumulate(head, p, p_stride, n_q, block, block_tokens, t0, n, acc);
  }
  void accumulate_spans(int head, const float* p, int p_stride, int n_q, const KvSpan* spans, int n_spans,
                        float* acc) const override {
    inner_->accumulate_spans(head, p, p_stride, n_q, spans, n_spans, acc);
  }
  PrefetchRange prefetch_range(int block_tokens, int t0, int n) const override {
    return inner_->prefetch_range(block_tokens, t0, n);
  }
  bool prefetches_along() const override { return inner_->prefetches_along(); }
  bool fuses_spans() const override { return inner_->fuses_spans(); }
  PrefetchRange prefetch_along_range(int block_tokens, int t0, int n) const override {
    return inner_->prefetch_along_range(block_tokens, t0, n);
  }

 protected:
  std::unique_ptr<KvCodec> inner_;
  KvCodecInfo info_;
};

}  // namespace kvq
