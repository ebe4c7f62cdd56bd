// The KV cache of one sequence: for every layer, K and V in that layer's codecs, stored in pages
// of `page_tokens` tokens (a page holds every layer's K and V head blocks), plus a full-precision
// tail for grouped codecs (KIVI/KVQuant keys) and their residual window.
//
// A step appends n tokens to every layer (append), runs attention for queries at the new
// positions (attend_head), then commit()s. Which tokens are read packed and which from the tail
// depends only on the query position (kv_quantized_tokens), so a prompt gives the same result
// whether it is processed in one chunk or many, or token by token.
#pragma once
#include <cstdint>
#include <memory>
#include <vector>

#include "attn/attention.h"
#include "core/aligned.h"
#include "kv/policy.h"
#include "kvq/kv_format.h"

namespace kvq {

struct KvCacheConfig {
  int n_layer = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int page_tokens = 64;
  int max_tokens = 0;                 // capacity (the model's context)
  KvPolicy policy;                    // per-layer codecs
  std::vector<KvRope> rope;           // per layer (for pre-RoPE key codecs)
  uint64_t seed = 0x6b7671;
  const nlohmann::json* calib = nullptr;
};

class KvCache {
 public:
  explicit KvCache(const KvCacheConfig& cfg);  // throws kvq::Error on invalid codecs/params

  int n_tokens() const { return n_tokens_; }
  int capacity() const { return cfg_.max_tokens; }
  const KvCacheConfig& config() const { return cfg_; }
  const KvCodec& k_codec(int layer) const { return *layers_[size_t(layer)].k; }
  const KvCodec& v_codec(int layer) const { return *layers_[size_t(layer)].v; }

  // Appends n new tokens (positions n_tokens() .. n_tokens()+n-1) of layer `layer`.
  // k_pre: (n, n_kv_heads, head_dim) keys before RoPE (only read by pre-RoPE codecs; may be null
  // otherwise); k: keys after RoPE; v: values. Rows are contiguous.
  void append(int layer, int n, const float* k_pre, const float* k, const float* v);
  // Attention for one query position `pos` (n_tokens() <= pos < n_tokens() + n appended) and KV
  // head `head`: q (n_q, head_dim) -> out (n_q, head_dim). window > 0: sees the last `window`
  // positions only. scratch: attend_scratch_floats() floats, private to the calling thread.
  void attend_head(int layer, int head, int pos, const float* q, int n_q, const AttnParams& ap,
                   int window, float* out, float* scratch, std::vector<KvBlockSpan>& spans) const;
  size_t attend_scratch_floats(int n_q) const;
  // Ends the step: the n appended tokens become part of the sequence.
  void commit(int n);
  // Drops everything (new sequence).
  void clear();

  // Bytes held: pages (codes, scales, norms) and the full-precision tail.
  size_t page_bytes() const { return page_bytes_; }
  size_t bytes_pages() const { return pages_.size() * page_bytes_; }
  size_t bytes_tail() const;
  // Bytes per token of the packed part, all layers, K and V (from the codecs' block sizes).
  double bytes_per_token() const { return double(page_bytes_) / cfg_.page_tokens; }

 private:
  struct Layer {
    std::unique_ptr<KvCodec> k, v;
    size_t k_off = 0, v_off = 0;      // offsets of the layer's K and V head blocks in a page
    size_t k_block = 0, v_block = 0;  // bytes of one head block
    int group = 1, residual = 0;      // the layer's rule for which tokens are packed
    bool pre_rope = false;
    int tail_start = 0;               // absolute position of tail row 0
    // full-precision tail per head: (rows, head_dim); k_pre only for pre-RoPE key codecs
    std::vector<std::vector<float>> tail_k, tail_v, tail_k_pre;
    int pending = 0;                  // tokens appended in the current step
  };
  int quantized(const Layer& L, int n) const { return kv_quantized_tokens(n, L.group, L.residual); }
  uint8_t* page_ptr(int page) { return pages_[size_t(page)].data(); }
  void ensure_pages(int n_tokens);

  KvCacheConfig cfg_;
  std::vector<Layer> layers_;
  size_t page_bytes_ = 0;
  std::vector<AlignedBuf<uint8_t>> pages_;
  int n_tokens_ = 0;
  int max_block_tokens_ = 0;
};

}  // namespace kvq
