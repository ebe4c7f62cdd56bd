// Decode attention over packed KV head blocks plus a full-precision tail, for one KV head and the
// GQA group of query heads that share it. Online softmax: one pass over the blocks, scores of one
// block at a time, no buffer proportional to the context.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "kvq/kv_format.h"

namespace kvq {

class ThreadPool;

// Tokens [t0, t0 + n) of one head block, whose slot 0 sits at absolute position pos0.
struct KvBlockSpan {
  const uint8_t* k = nullptr;  // K head block
  const uint8_t* v = nullptr;  // V head block
  int block_tokens = 0;
  int t0 = 0;
  int n = 0;
  int pos0 = 0;
};

struct AttnParams {
  float scale = 1.f;     // applied to q.k before softmax (1/sqrt(head_dim) or the model's)
  float softcap = 0.f;   // > 0: scores = softcap * tanh(scores / softcap)
  // Request each head block's leading bytes one kernel call early (KvCodec::prefetch_range): for
  // blocks read once per call sequence from DRAM (decode). Prefill rows re-read the same blocks,
  // which are then cached, and there the requests only cost instructions (pp4096 ~5% slower).
  bool prefetch_blocks = true;
  // Attention sinks (gpt-oss): one learned logit per query head that joins each softmax's
  // denominator without a value, so a query can attend to "nothing": out = sum_t e^(s_t - m) v_t /
  // (sum_t e^(s_t - m) + e^(sink - m)). The call's n_q values, in query order (the same for every
  // row of attn_prefill); unscaled and not soft-capped, as llama.cpp's soft_max / flash attention
  // take them. nullptr: none.
  const float* sinks = nullptr;
};

// q: (n_q, head_dim) raw query rows (after RoPE) of the query heads sharing KV head `head`.
// spans: the quantized part of the sequence, in position order. tail_k / tail_v: (n_tail,
// head_dim) f32 rows, tail_stride floats apart (the newest tokens, after all spans).
// out: (n_q, head_dim). scratch: at least attn_scratch_floats(...) floats.
void attn_decode(const KvCodec& kc, const KvCodec& vc, int head, const float* q, int n_q,
                 const KvBlockSpan* spans, int n_spans, const float* tail_k, const float* tail_v,
                 size_t tail_stride, int n_tail, const AttnParams& ap, float* out, float* scratch);
size_t attn_scratch_floats(const KvCodec& kc, const KvCodec& vc, int n_q, int max_block_tokens);

// Prefill: n_rows query rows of one sequence (each with its n_q query heads) against the same
// spans + tail, row r seeing only the first row_limit[r] tokens of the spans-then-tail sequence
// (the causal mask of rows appended in one step). q: (n_rows * n_q, head_dim), row by row; out
// likewise. Each block is read and decoded once for all rows instead of once per row. Row r's
// result is attn_decode's over its own first row_limit[r] tokens, bit for bit: the kernels' scores
// do not depend on how many queries share a call, and masked tokens add exact zeros (tested for
// every format and CPU level).
// scratch: attn_scratch_floats(kc, vc, n_rows * n_q, ...) floats.
void attn_prefill(const KvCodec& kc, const KvCodec& vc, int head, const float* q, int n_q, int n_rows,
                  const int* row_limit, const KvBlockSpan* spans, int n_spans, const float* tail_k,
                  const float* tail_v, size_t tail_stride, int n_tail, const AttnParams& ap, float* out,
                  float* scratch);

// Split-K (flash-decoding) for a long context when there are fewer (sequence, KV head) items than
// threads: the spans are cut into up to n_parts contiguous ranges of about equal token counts
// (at least 1024 tokens each, else fewer parts), each runs the online softmax on a pool thread and
// keeps its (max, sum, accumulator), and the parts are merged exactly on the calling thread. The
// tail goes with the last part. Same arguments and result as attn_decode; scratch: at least
// attn_split_scratch_floats(...) floats. Must not be called from inside a job of `pool`.
void attn_decode_split(const KvCodec& kc, const KvCodec& vc, int head, const float* q, int n_q,
                       const KvBlockSpan* spans, int n_spans, const float* tail_k, const float* tail_v,
                       size_t tail_stride, int n_tail, const AttnParams& ap, float* out, float* scratch,
                       ThreadPool& pool, int n_parts);
size_t attn_split_scratch_floats(const KvCodec& kc, const KvCodec& vc, int n_q, int max_block_tokens, int n_parts);

// One part of a context (split-K over the caller's own threads): the online-softmax state of n_q
// query rows over some of the context's spans and, in the part that ends the context, its tail.
// The state, attn_part_floats(vc, n_q) floats: running max m (n_q), sum of exp(s - m) l (n_q),
// unnormalized output acc (n_q, v head_dim), in that order, each region padded to a multiple of 16
// floats. Parts that together hold every span and the tail once, merged by attn_merge_parts in
// position order, give attn_decode's result up to float rounding (attn_decode_split is this with
// the parts on a pool). scratch: attn_scratch_floats(...) floats.
size_t attn_part_floats(const KvCodec& vc, int n_q);
void attn_decode_part(const KvCodec& kc, const KvCodec& vc, int head, const float* q, int n_q,
                      const KvBlockSpan* spans, int n_spans, const float* tail_k, const float* tail_v,
                      size_t tail_stride, int n_tail, const AttnParams& ap, float* part, float* scratch);
// out (n_q, vd) from the states of n_parts parts (parts[p]: attn_part_floats floats each). Exact
// in the sense of flash-decoding: with M = max m_p, l = sum exp(m_p - M) l_p and out = sum exp(m_p
// - M) acc_p / l; a part with nothing attendable (m = -inf) adds nothing.
// sinks: n_q sink logits (AttnParams::sinks), added to the merged denominator; nullptr: none.
void attn_merge_parts(const float* const* parts, int n_parts, int n_q, int vd, float* out,
                      const float* sinks = nullptr);

// Balancing decode attention over threads: n_items items (query row x KV head), item w reading
// tokens[w] tokens, as contiguous pieces of the items' tokens laid end to end, thread k taking
// about a 1 / n_threads share from k / n_threads of the total on. A cut falls inside an item only
// where the pieces on both sides keep at least min_piece tokens; otherwise it moves to the nearer
// end of its piece (the item's end, or the previous cut). Pieces come in item order (an item's
// pieces in token order, on increasing threads); an item in one piece has from = 0, to = tokens[w].
struct AttnPiece {
  int item, from, to, thread;
};
std::vector<AttnPiece> attn_balance_pieces(const int* tokens, int n_items, int n_threads, int min_piece);

// Reference: decodes every token to f32 (codec.decode) and computes softmax(q.K^T) V in double.
void attn_decode_ref(const KvCodec& kc, const KvCodec& vc, int head, const float* q, int n_q,
                     const KvBlockSpan* spans, int n_spans, const float* tail_k, const float* tail_v,
                     size_t tail_stride, int n_tail, const AttnParams& ap, float* out);

}  // namespace kvq
