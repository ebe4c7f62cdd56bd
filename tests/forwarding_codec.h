// A KvCodec that forwards every call to another codec: the base of the tests' wrappers that
// record what attention asks of a codec.
#pragma once
#include <memory>
#include <utility>

#include "kvq/kv_format.h"

namespace kvq {

class ForwardingCodec : public KvCodec {
 public:
  explicit ForwardingCodec(std::unique_ptr<KvCodec> inner) : inner_(std::move(inner)) {}
  const KvCodecInfo& info() const override { return inner_->info(); }
  int head_dim() const override { return inner_->head_dim(); }
  size_t block_bytes(int bt) const override { return inner_->block_bytes(bt); }
  PrefetchRange prefetch_range(int bt, int t0, int n) const override { return inner_->prefetch_range(bt, t0, n); }
  bool prefetches_along() const override { return inner_->prefetches_along(); }
  PrefetchRange prefetch_along_range(int bt, int t0, int n) const override {
    return inner_->prefetch_along_range(bt, t0, n);
  }
  void encode(int head, const float* src, size_t stride, int n, uint8_t* block, int bt, int t0, int pos0) const override {
    inner_->encode(head, src, stride, n, block, bt, t0, pos0);
  }
  void decode(int head, const uint8_t* block, int bt, int t0, int n, int pos0, float* dst) const override {
    inner_->decode(head, block, bt, t0, n, pos0, dst);
  }
  int prepared_query_dim() const override { return inner_->prepared_query_dim(); }
  void prepare_query(int head, const float* q, int n_q, float* qp) const override {
    inner_->prepare_query(head, q, n_q, qp);
  }
  void scores(int head, const float* qp, int n_q, const uint8_t* block, int bt, int t0, int n, int pos0, float* out,
              int out_stride) const override {
    inner_->scores(head, qp, n_q, block, bt, t0, n, pos0, out, out_stride);
  }
  void accumulate(int head, const float* p, int p_stride, int n_q, const uint8_t* block, int bt, int t0, int n,
                  float* acc) const override {
    inner_->accumulate(head, p, p_stride, n_q, block, bt, t0, n, acc);
  }
  bool fuses_spans() const override { return inner_->fuses_spans(); }
  void scores_spans(int head, const float* qp, int n_q, const KvSpan* spans, int n_spans, float* out,
                    int out_stride) const override {
    inner_->scores_spans(head, qp, n_q, spans, n_spans, out, out_stride);
  }
  void accumulate_spans(int head, const float* p, int p_stride, int n_q, const KvSpan* spans, int n_spans,
                        float* acc) const override {
    inner_->accumulate_spans(head, p, p_stride, n_q, spans, n_spans, acc);
  }
  void finish_output(int head, float* acc, int n_q) const override { inner_->finish_output(head, acc, n_q); }
  void finish_output_mass(int head, float* acc, int n_q, const float* mass) const override {
    inner_->finish_output_mass(head, acc, n_q, mass);
  }

 protected:
  std::unique_ptr<KvCodec> inner_;
};

}  // namespace kvq
