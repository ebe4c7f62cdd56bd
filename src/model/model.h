// A GGUF model ready to run: config, weights viewed in place in the mapping, and the forward
// pass (prefill a batch of tokens with matrix-matrix products, or decode one token).
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cache/kv_cache.h"
#include "core/aligned.h"
#include "core/thread_pool.h"
#include "gguf/gguf.h"
#include "model/config.h"
#include "weights/weights.h"

namespace kvq {

struct LayerWeights {
  WeightView attn_norm, wq, wk, wv, wo, attn_q_norm, attn_k_norm, attn_post_norm;
  WeightView bq, bk, bv;  // F32 biases of q, k, v (config().qkv_bias)
  WeightView bo;          // F32 bias of the attention output (config().attn_out_bias)
  WeightView attn_sinks;  // F32 (n_head): the attention sinks' logits (config().attn_sinks)
  WeightView ffn_norm, ffn_gate, ffn_up, ffn_down, ffn_post_norm;
  // Mixture of experts (config().n_expert > 0; ffn_gate / ffn_up / ffn_down unset): the router
  // (n_embd -> n_expert), expert e's matrices as row views of the file's 3-D tensors, and the
  // shared expert with its gate (n_embd -> 1) where the model has them.
  WeightView ffn_gate_inp;
  std::vector<WeightView> ffn_gate_exps, ffn_up_exps, ffn_down_exps;
  // config().moe_bias: the router's bias (n_expert) and the experts' biases, F32 (n_ff_exp or n_embd
  // per expert, expert after expert)
  WeightView ffn_gate_inp_b, ffn_gate_exps_b, ffn_up_exps_b, ffn_down_exps_b;
  WeightView ffn_gate_shexp, ffn_up_shexp, ffn_down_shexp, ffn_gate_inp_shexp;
};

// Expert routing of one token, as llama.cpp's softmax gating: probabilities softmax(logits) over
// the n experts, the k most probable chosen in decreasing order (by their logits; ties to the lower
// index), and their weights: the probabilities, divided by their sum when `normalize` (the sum held
// at >= 2^-14, as llama.cpp clamps it). softmax_chosen (gpt-oss, llama.cpp's softmax_weight
// gating): the same choice, weighted by the softmax over the k chosen logits alone.
// experts, weights: (k).
void moe_route(const float* logits, int n, int k, bool normalize, int* experts, float* weights,
               bool softmax_chosen = false);

class Model {
 public:
  // Opens and validates the file (architecture, tensor shapes and types); throws kvq::Error.
  // RoPE as at the trained context: set_context for another; `rope`: the command line's RoPE
  // scaling in place of the file's.
  static std::unique_ptr<Model> load(const std::string& path, const RopeOverrides& rope = {});
  // Reference precision: every weight matrix dequantized to f32 once at load, so matmuls run in
  // f32 without quantizing activations. For checking the graph against an f32 reference (and
  // for measuring what activation quantization costs); ~4 bytes per parameter of memory.
  static std::unique_ptr<Model> load_f32(const std::string& path, const RopeOverrides& rope = {});

  const ModelConfig& config() const { return cfg_; }
  const gguf::File& file() const { return *file_; }
  size_t weights_bytes() const { return file_->tensor_bytes(); }
  // Weight bytes one decode step reads: everything but the embedding table, which is only
  // gathered one row at a time (unless it doubles as the output projection), and, with experts,
  // but those the step's tokens run: at most n_seqs x n_expert_used of each layer's (the bound:
  // distinct tokens often share experts).
  size_t decode_weight_bytes(int n_seqs = 1) const;

  // Picks the RoPE factors for a context of `ctx` tokens, the one a tool runs at (0: the trained
  // context; LongRoPE's two sets, no effect on other models). Caches made before keep the old RoPE:
  // make new ones. True when the set changed.
  bool set_context(int ctx);

  // Cache configuration for this model (shapes and per-layer RoPE filled in).
  KvCacheConfig kv_cache_config(const KvPolicy& policy, int max_tokens, int page_tokens = 64) const;

  // Layer il's weights as viewed in the file (norms F32; attn_q_norm / attn_k_norm set only when
  // config().qk_norm, attn_norm / ffn_norm only when config().pre_norms).
  const LayerWeights& layer(int il) const { return layers_.at(size_t(il)); }

 private:
  friend class Forward;
  std::unique_ptr<gguf::File> file_;
  ModelConfig cfg_;
  WeightView tok_embd_, output_norm_, output_;
  std::vector<LayerWeights> layers_;
  std::vector<KvRope> layer_rope_;  // each layer's RoPE, as the model and its KV cache rotate
  std::vector<float> layer_rope_mscale_;  // model_layer_rope_mscale per layer
  std::vector<AlignedBuf<float>> f32_weights_;  // owned copies when loaded with load_f32
  size_t expert_bytes_ = 0;  // the expert tensors' bytes in the file
  void dequantize_all_f32();
  void build_layer_rope();
};

// One sequence's share of a batched forward step: n tokens appended to `cache`.
struct ForwardSeq {
  enum Logits { none, last, all };
  const int32_t* tokens = nullptr;
  int n = 0;
  KvCache* cache = nullptr;
  Logits logits = last;
  // The cache's step is left open: the caller ends it with cache->commit(n, keep) once it has
  // read the logits (speculative verification keeps the drafted tokens that were right).
  bool hold = false;
};

// Per-sequence activations and the forward pass. Scratch is sized for up to max_batch tokens
// per call; longer prompts are processed in chunks of max_batch.
class Forward {
 public:
  Forward(const Model& m, ThreadPool& pool, int max_batch = 256);

  // Runs tokens at positions cache.n_tokens() .. +n-1, appending them to the cache. Logits
  // (n_vocab floats per row) are written for the last token, or for every token when
  // all_logits (rows in order). Returns a pointer to the first logits row (valid until the next call).
  const float* eval(const int32_t* tokens, int n, KvCache& cache, bool all_logits = false);
  // Speculative verification: runs n <= max_batch() tokens (the last accepted one, then drafted
  // ones) with logits for every row, and leaves the cache's step open: the caller ends it with
  // cache.commit(n, keep), keeping the first keep tokens (cache.step_keeps_any(n) must hold).
  const float* eval_held(const int32_t* tokens, int n, KvCache& cache);
  // Continuous batching: several sequences (distinct caches) in one step, their tokens sharing
  // every weight matmul. Total tokens <= max_batch. Logits rows are returned in sequence order
  // (n rows for `all`, one for `last`, none for `none`).
  const float* eval_batch(const ForwardSeq* seqs, int n_seqs);
  int max_batch() const { return max_batch_; }
  size_t scratch_bytes() const;

  // Optional taps for calibration and analysis (kvq calibrate, eval's per-layer task); called
  // from the evaluating thread, never on the hot path when unset.
  // (n, n_kv * head_dim) keys before RoPE, keys after RoPE, values of layer `layer`.
  std::function<void(int layer, int n, const float* k_pre, const float* k, const float* v)> on_kv;
  // (n, n_head * head_dim) queries after RoPE (and after the q norm where the model has one).
  std::function<void(int layer, int n, const float* q)> on_q;
  // (n, n_head * head_dim) attention output of layer `layer` (before the output projection).
  std::function<void(int layer, int n, const float* attn_out)> on_attn;

 private:
  void eval_rows(const ForwardSeq* seqs, int n_seqs, float* logits_out);
  std::vector<int> row_seq_, row_pos_;  // (rows) sequence index and position of each row
  const Model& m_;
  ThreadPool& pool_;
  int max_batch_;
  // (max_batch, n_embd) residual stream and normalized copy
  AlignedBuf<float> x_, xn_;
  // (max_batch, n_head * head_dim) queries; (max_batch, n_kv * head_dim) keys (pre/post RoPE), values
  AlignedBuf<float> q_, k_pre_, k_, v_, attn_out_;
  // (max_batch, ffn_active_channels) FFN gate and up: a row's n_ff, or its chosen experts' and the
  // shared expert's channels
  AlignedBuf<float> gate_, up_;
  // Mixture of experts: (max_batch, n_expert) router logits, (max_batch, n_expert_used) chosen
  // experts and weights, (max_batch x n_expert_used (+ 1), n_embd) the experts' gathered inputs and
  // outputs (and the shared expert's), (max_batch)
  // the shared expert's gate, and the step's (row, choice) pairs grouped by expert (offsets per expert).
  AlignedBuf<float> router_, moe_w_, moe_x_, moe_y_, shexp_gate_;
  std::vector<int> moe_sel_, moe_rows_, moe_off_, moe_fill_;
  std::vector<MatmulJob> moe_jobs_;  // one step's expert products, run together
  void ffn_moe(const LayerWeights& L, int n);
  void pre_norm(const WeightView& w, int n);
  AlignedBuf<float> tmp_;          // (max_batch, n_embd)
  AlignedBuf<float> logits_;       // (rows, n_vocab)
  std::vector<AlignedBuf<float>> attn_scratch_;  // one per thread
  std::vector<std::vector<KvBlockSpan>> spans_;  // one per thread
  struct RowBlock {
    int seq, r0, n;  // rows r0 .. r0 + n - 1, all of sequence seq
  };
  std::vector<RowBlock> blocks_;  // prefill attention items
  // Decode attention's pieces (attn_balance_pieces) over the items' visible token counts, and the
  // online-softmax states of the pieces of cut items (parts_[j] into part_states_, else null).
  std::vector<int> item_tokens_;
  std::vector<AttnPiece> pieces_;
  std::vector<float*> parts_;
  AlignedBuf<float> part_states_;
};

}  // namespace kvq
