// What the tiled per-token codecs (int4t, int8t) share around their own encode/decode: a head
// block of 16-token tiles tile_bytes apart, the fused kernels of the role the layout was built
// for (keys: prepare_query + scores; values: accumulate), the other role served through decode,
// and the prefetch range of the tiles a call reads.
#pragma once
#include <algorithm>
#include <string>
#include <type_traits>

#include "core/cpu.h"
#include "core/error.h"
#include "kv/grouped_common.h"
#include "kv/int4_tiled.h"
#include "kvq/kv_format.h"

namespace kvq {

// A family's three dispatch points as the Ops of TiledCodecBase.
template <class Layout, void (*Prep)(const Layout&, const float*, int, float*),
          void (*Scores)(const Layout&, const float*, int, const uint8_t*, int, int, float*, int),
          void (*Accum)(const Layout&, const float*, int, int, const uint8_t*, int, int, float*), bool Along = false,
          class Spans = void>
struct TiledOps {
  // The SIMD kernels request kv_prefetch_along (kv/prefetch_along.h); the scalar ones do not.
  static constexpr bool along = Along;
  // Spans: the family's multi-block kernels (TiledSpansAvx512: static fused(), scores(L, qp, n_q,
  // spans, n_spans, out, out_stride), accum(L, p, p_stride, n_q, spans, n_spans, acc)), or void.
  using SpanKernels = Spans;
  static void prepare_query(const Layout& L, const float* q, int n_q, float* qp) { Prep(L, q, n_q, qp); }
  static void scores(const Layout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n, float* out,
                     int out_stride) {
    Scores(L, qp, n_q, block, t0, n, out, out_stride);
  }
  static void accum(const Layout& L, const float* p, int p_stride, int n_q, const uint8_t* block, int t0, int n,
                    float* acc) {
    Accum(L, p, p_stride, n_q, block, t0, n, acc);
  }
};

// A family's multi-block AVX-512 kernels (several head blocks per call, KvCodec::scores_spans /
// accumulate_spans) as TiledOps' Spans: the codec fuses spans at that level and calls them there;
// below it, one call per block. Instantiate only where KVQ_HAVE_SIMD is defined.
template <class Layout, void (*Scores)(const Layout&, const float*, int, const KvSpan*, int, float*, int),
          void (*Accum)(const Layout&, const float*, int, int, const KvSpan*, int, float*)>
struct TiledSpansAvx512 {
  static bool fused() { return cpu_level() == CpuLevel::avx512; }
  static void scores(const Layout& L, const float* qp, int n_q, const KvSpan* spans, int n_spans, float* out,
                     int out_stride) {
    Scores(L, qp, n_q, spans, n_spans, out, out_stride);
  }
  static void accum(const Layout& L, const float* p, int p_stride, int n_q, const KvSpan* spans, int n_spans,
                    float* acc) {
    Accum(L, p, p_stride, n_q, spans, n_spans, acc);
  }
};

// Layout: hd, tile_bytes, qdim. Ops: static prepare_query(L, q, n_q, qp), scores(L, qp, n_q,
// block, t0, n, out, out_stride), accum(L, p, p_stride, n_q, block, t0, n, acc).
template <class Layout, class Ops>
class TiledCodecBase : public KvCodec {
 public:
  TiledCodecBase(std::string name, double code_bits, KvRole role, const Layout& L) : role_(role), L_(L) {
    info_.name = std::move(name);
    info_.code_bits = code_bits;
  }
  const KvCodecInfo& info() const override { return info_; }
  int head_dim() const override { return L_.hd; }
  size_t block_bytes(int block_tokens) const override {
    check_block(block_tokens);
    return size_t(block_tokens / kv_tile_tokens) * L_.tile_bytes;
  }
  // The tiles holding [t0, t0 + n), which attention requests one kernel call early.
  PrefetchRange prefetch_range(int block_tokens, int t0, int n) const override {
    return lead_of(prefetch_along_range(block_tokens, t0, n));
  }
  bool prefetches_along() const override { return Ops::along && cpu_level() != CpuLevel::scalar; }
  PrefetchRange prefetch_along_range(int block_tokens, int t0, int n) const override {
    check_block(block_tokens);
    PrefetchRange r;
    kv_unit_range(L_.tile_bytes, kv_tile_tokens, t0, n, &r.offset, &r.bytes);
    return r;
  }
  int prepared_query_dim() const override { return role_ == KvRole::key ? L_.qdim : L_.hd; }
  void prepare_query(int head, const float* q, int n_q, float* qp) const override {
    if (role_ != KvRole::key) return KvCodec::prepare_query(head, q, n_q, qp);
    Ops::prepare_query(head_layout(head), q, n_q, qp);
  }
  void scores(int head, const float* qp, int n_q, const uint8_t* block, int block_tokens, int t0, int n, int pos0,
              float* out, int out_stride) const override {
    check_range(block_tokens, t0, n);
    // A value-layout block has no fused score kernel (a V codec is not asked to score).
    if (role_ != KvRole::key)
      return kv_scores_via_decode(*this, head, qp, n_q, block, block_tokens, t0, n, pos0, out, out_stride);
    Ops::scores(head_layout(head), qp, n_q, block, t0, n, out, out_stride);
  }
  void accumulate(int head, const float* p, int p_stride, int n_q, const uint8_t* block, int block_tokens, int t0,
                  int n, float* acc) const override {
    check_range(block_tokens, t0, n);
    if (role_ != KvRole::value)
      return kv_accumulate_via_decode(*this, head, p, p_stride, n_q, block, block_tokens, t0, n, 0, acc);
    Ops::accum(head_layout(head), p, p_stride, n_q, block, t0, n, acc);
  }
  bool fuses_spans() const override {
    if constexpr (std::is_void_v<typename Ops::SpanKernels>) return false;
    else return Ops::SpanKernels::fused();
  }
  void scores_spans(int head, const float* qp, int n_q, const KvSpan* spans, int n_spans, float* out,
                    int out_stride) const override {
    if constexpr (!std::is_void_v<typename Ops::SpanKernels>) {
      if (role_ == KvRole::key && Ops::SpanKernels::fused()) {
        for (int s = 0; s < n_spans; ++s) check_range(spans[s].block_tokens, spans[s].t0, std::max(0, spans[s].n));
        return Ops::SpanKernels::scores(head_layout(head), qp, n_q, spans, n_spans, out, out_stride);
      }
    }
    KvCodec::scores_spans(head, qp, n_q, spans, n_spans, out, out_stride);
  }
  void accumulate_spans(int head, const float* p, int p_stride, int n_q, const KvSpan* spans, int n_spans,
                        float* acc) const override {
    if constexpr (!std::is_void_v<typename Ops::SpanKernels>) {
      if (role_ == KvRole::value && Ops::SpanKernels::fused()) {
        for (int s = 0; s < n_spans; ++s) check_range(spans[s].block_tokens, spans[s].t0, std::max(0, spans[s].n));
        return Ops::SpanKernels::accum(head_layout(head), p, p_stride, n_q, spans, n_spans, acc);
      }
    }
    KvCodec::accumulate_spans(head, p, p_stride, n_q, spans, n_spans, acc);
  }

 protected:
  // The layout the kernels of head `head` get: L_, or a per-head copy (fp8t's calibrated scales).
  virtual const Layout& head_layout(int) const { return L_; }
  void check_block(int block_tokens) const {
    if (block_tokens <= 0 || block_tokens % kv_tile_tokens != 0)
      fail("KV codec '{}': block of {} tokens; this codec stores 16-token tiles, so the block (page) size must be a "
           "positive multiple of 16",
           info_.name, block_tokens);
  }
  void check_range(int block_tokens, int t0, int n) const {
    check_block(block_tokens);
    kv_check_token_range(info().name, block_tokens, t0, n);
  }

  KvCodecInfo info_;
  KvRole role_;
  Layout L_;
};

}  // namespace kvq
