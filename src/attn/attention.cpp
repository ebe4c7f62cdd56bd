#include "attn/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "attn/softmax.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "kv/kv_rows.h"
#include "kv/prefetch_along.h"

namespace kvq {

namespace {
// The f32 tail is scored in chunks of this many tokens (the scores buffer holds at least this).
constexpr int kTailChunk = 64;
// attn_decode_split: the fewest tokens per part.
constexpr int kSplitMinPartTokens = 1024;
// Attention reads the blocks in batches (run_blocks) of at most kBatchTokens tokens, kBatchSpans
// blocks and kBatchBytes of K and V blocks. Measured at 32K tokens on Zen 5 (bench/BENCHMARKS.md):
// batches of 128 and 256 tokens gain alike, 512 no more; batches of 40-48 KiB (int4t_g32 / q4_1 /
// q5_1 at 256 tokens) were 5-10% slower than one block at a time when the blocks come from DRAM,
// at 128 tokens (20-25 KiB) faster.
constexpr int kBatchTokens = 256;
constexpr int kBatchSpans = 16;
constexpr size_t kBatchBytes = 36 << 10;
// Blocks whose K and V bytes exceed this are read one at a time: at head_dim 256 (int4t_g128's
// 64-token pair 17 KiB) batches of two were 5-17% slower from DRAM than one block at a time.
constexpr size_t kBatchPairBytes = 12 << 10;

size_t round16(size_t n) { return (n + 15) & ~size_t(15); }
// Scores of a batch of blocks (run_blocks) or of a tail chunk.
size_t batch_stride(int max_block_tokens) { return round16(size_t(std::max({max_block_tokens, kTailChunk, kBatchTokens}))); }

struct Scratch {
  const float* qp;     // (n_q, prepared_query_dim)
  const float* q_raw;  // (n_q, head_dim): the tail is scored against the raw query
  float* s;    // (n_q, s_stride): scores, then probabilities, of one block
  float* acc;  // (n_q, v head_dim)
  float* m;    // (n_q) running max
  float* l;    // (n_q) running sum of exp
  int s_stride;
};

// A part's running state (attn_part_floats): m, l, acc, each padded to 16 floats.
size_t state_floats(int n_q, int vd) { return 2 * round16(size_t(n_q)) + round16(size_t(n_q) * size_t(vd)); }
void point_state(Scratch& sc, int n_q, float* state) {
  sc.m = state;
  sc.l = state + round16(size_t(n_q));
  sc.acc = state + 2 * round16(size_t(n_q));
}

// One part's scores, probabilities and running state; qp (the prepared query) may be shared.
size_t part_floats(const KvCodec& vc, int n_q, int max_block_tokens) {
  return size_t(n_q) * batch_stride(max_block_tokens) + state_floats(n_q, vc.head_dim());
}
size_t query_floats(const KvCodec& kc, int n_q) { return round16(size_t(n_q) * size_t(kc.prepared_query_dim())); }

// [scores (n_q, s_stride)][state]
Scratch carve_part(int n_q, int max_block_tokens, float* base, float* qp) {
  Scratch sc;
  sc.s_stride = int(batch_stride(max_block_tokens));
  sc.qp = qp;
  sc.s = base;
  point_state(sc, n_q, base + size_t(n_q) * size_t(sc.s_stride));
  return sc;
}

// Scores of n tokens (already in sc.s) -> probabilities relative to the updated running max;
// rescales acc and l to that max. After this sc.s holds exp(score - m_new).
// The causal mask of attn_prefill: query i belongs to row i / per_row, which sees only the first
// row_limit[i / per_row] tokens of the call. Null row_limit: no mask.
struct RowMask {
  const int* row_limit = nullptr;
  int per_row = 1;
};

// mask: query i sees only the first limit - done of these n_all tokens (done: tokens of the call
// before them); the rest get probability 0.
void softmax_update(Scratch& sc, int n_q, int n_all, int v_dim, const AttnParams& ap, RowMask mask = {}, int done = 0) {
  for (int i = 0; i < n_q; ++i) {
    float* s = sc.s + size_t(i) * size_t(sc.s_stride);
    const int n = mask.row_limit ? std::clamp(mask.row_limit[i / mask.per_row] - done, 0, n_all) : n_all;
    std::fill(s + n, s + n_all, 0.f);
    float mx = -std::numeric_limits<float>::infinity();
    if (ap.softcap > 0) {
      for (int t = 0; t < n; ++t) {
        const float v = ap.softcap * std::tanh(s[t] * ap.scale / ap.softcap);
        s[t] = v;
        mx = std::max(mx, v);
      }
    } else {
      mx = attn_scale_max(s, n, ap.scale);
    }
    const float m_new = std::max(sc.m[i], mx);
    if (m_new == -std::numeric_limits<float>::infinity()) {  // nothing attendable yet
      std::fill(s, s + n, 0.f);
      continue;
    }
    // 0 on the first block (m = -inf); no exp call while the maximum holds (most blocks)
    const float corr = m_new == sc.m[i] ? 1.f : std::exp(sc.m[i] - m_new);
    if (corr != 1.f) {
      float* a = sc.acc + size_t(i) * size_t(v_dim);
      for (int d = 0; d < v_dim; ++d) a[d] *= corr;
      sc.l[i] *= corr;
    }
    sc.m[i] = m_new;
    sc.l[i] += attn_exp_sub(s, n, m_new);
  }
}

// Batches: when K's and V's codecs both fuse spans (KvCodec::fuses_spans), attention reads
// consecutive spans (within kBatchTokens, kBatchSpans, kBatchBytes and kBatchPairBytes) with one
// multi-block kernel call each for K and V and one softmax update: a call's fixed work and the
// latency chain scores -> softmax -> weight quantization -> weighted sum are paid once per batch,
// not once per page (at 64-token pages int4t_g128's decode at 32K 11% faster, bench/BENCHMARKS.md).
// Otherwise a batch is one span. The batches depend on the spans and codecs only, never on n_q or
// the prefetch flag, so attn_prefill's rows get attn_decode's results bit for bit.

// The end of the batch that starts at span `first` (< n_spans): the spans after it while their
// tokens fit `cap` (>= any span's n), their K and V blocks kBatchBytes, each block pair
// kBatchPairBytes (the first span always fits) and at most max_spans of them are not empty.
int batch_end(const KvCodec& kc, const KvCodec& vc, const KvBlockSpan* spans, int n_spans, int first, int cap,
              int max_spans) {
  int tokens = 0, count = 0, e = first;
  size_t bytes = 0;
  for (; e < n_spans; ++e) {
    const int n = std::max(0, spans[e].n);
    if (n <= 0) continue;
    if (count == max_spans) break;
    // (one-span batches, codecs that do not fuse spans, need no byte counts)
    const size_t b = max_spans > 1 ? kc.block_bytes(spans[e].block_tokens) + vc.block_bytes(spans[e].block_tokens) : 0;
    if (count > 0 && (tokens + n > cap || bytes + b > kBatchBytes || b > kBatchPairBytes)) break;
    tokens += n;
    bytes += b;
    ++count;
  }
  return e;
}

// How far ahead kernels prefetching along request, in batches: the fewest whose K and V bytes
// reach kAlongAheadBytes, at most kAlongMaxBatches (from the first batch's bytes). Measured per
// 64-token block (batches of one block) at 32K tokens on Zen 4 (bench/BENCHMARKS.md), us at 1 / 2
// / 3 blocks: int4t_g64 at head_dim 64 (2.3 KiB blocks) 168 / 151 / 154, at 128 (4.6 KiB) about
// equal at 1 and 2, at 256 (9.2 KiB) 470 / 645 / 717; q4_0 at 128 better at 1, int2t_g64 and
// int4t_g128 at 2; f16 the same at 1-3.
constexpr size_t kAlongAheadBytes = 8192;
constexpr int kAlongMaxBatches = 3;

int along_batches(const KvCodec& kc, const KvCodec& vc, const KvBlockSpan* spans, int first, int end) {
  size_t pair = 0;
  for (int b = first; b < end; ++b)
    if (spans[b].n > 0) pair += kc.block_bytes(spans[b].block_tokens) + vc.block_bytes(spans[b].block_tokens);
  int d = 1;
  while (d < kAlongMaxBatches && size_t(d) * pair < kAlongAheadBytes) ++d;
  return d;
}

// prefetcht1: 8 KiB into L1 would evict rows the running kernel still reads (t0 and nta measured
// 15-20% slower than t1 for f16).
inline void prefetch_lead(const KvCodec& c, const uint8_t* block, const KvBlockSpan& sp) {
  const KvCodec::PrefetchRange r = c.prefetch_range(sp.block_tokens, sp.t0, sp.n);
  for (size_t x = 0; x < r.bytes; x += 64) __builtin_prefetch(block + r.offset + x, 0, 2);
}

// The online softmax over the batches (batch_end; one span each unless both codecs fuse spans):
// per batch one scores_spans call, one softmax update, one accumulate_spans call.
// Requests ahead of the kernels, two ways:
//  - K's and V's kernels prefetch along (KvCodec::prefetches_along, kv/prefetch_along.h): each
//    span's reads are paired with a later block (KvSpan::along), requested in slices along the
//    kernel's loop: span x of batch i's scores request span x of batch i + D - 1's V, its weighted
//    sum span x of batch i + D's K (x counting non-empty spans), D = along_batches. The first
//    batches' leads are requested before the loop.
//  - else each block's leading bytes (KvCodec::prefetch_range) in one burst one kernel call early:
//    the batch's V blocks' before its scores, the next batch's K blocks' before its weighted sum.
// Measured at 32K tokens: f16 ~19%, f32 ~13%, tq4 ~20%, kivi / kvquant 5-10% faster than leaving
// each block's start to demand misses (memory then overlaps the compute). ap.prefetch_blocks
// false: no requests (prefill steps re-read cached blocks); the arithmetic is the same either way.
void run_blocks(const KvCodec& kc, const KvCodec& vc, int head, int n_q, const KvBlockSpan* spans, int n_spans,
                const AttnParams& ap, Scratch& sc, RowMask mask) {
  const bool pf = ap.prefetch_blocks, along = pf && kc.prefetches_along() && vc.prefetches_along();
  const int max_spans = kc.fuses_spans() && vc.fuses_spans() ? kBatchSpans : 1;
  const int cap = sc.s_stride;
  auto next = [&](int f) { return f < n_spans ? batch_end(kc, vc, spans, n_spans, f, cap, max_spans) : n_spans; };
  // first[k]: the first span of batch i + k, k <= D + 1 (n_spans past the last batch).
  int first[kAlongMaxBatches + 2];
  first[0] = 0;
  first[1] = next(0);
  const int D = along ? along_batches(kc, vc, spans, first[0], first[1]) : 1;
  for (int k = 2; k <= D + 1; ++k) first[k] = next(first[k - 1]);
  for (int j = 0; along && j < first[D]; ++j) {
    if (spans[j].n <= 0) continue;
    prefetch_lead(kc, spans[j].k, spans[j]);
    if (j < first[D - 1]) prefetch_lead(vc, spans[j].v, spans[j]);
  }
  // Sets sp's along range to that of the x-th non-empty span of batch [tb, te), if it has one.
  auto target = [&](const KvCodec& c, int tb, int te, int x, bool key, KvSpan* sp) {
    for (int j = tb; j < te; ++j) {
      if (spans[j].n <= 0 || x-- > 0) continue;
      const KvCodec::PrefetchRange r = c.prefetch_along_range(spans[j].block_tokens, spans[j].t0, spans[j].n);
      sp->along = (key ? spans[j].k : spans[j].v) + r.offset;
      sp->along_bytes = r.bytes;
      return;
    }
  };
  auto leads = [&](const KvCodec& c, int tb, int te, bool key) {
    for (int j = tb; j < te; ++j)
      if (spans[j].n > 0) prefetch_lead(c, key ? spans[j].k : spans[j].v, spans[j]);
  };
  KvSpan ks[kBatchSpans], vs[kBatchSpans];
  bool k_ahead = false;  // burst requests: the batch's K leads were requested in the previous iteration
  for (int done = 0; first[0] < n_spans;) {
    int m = 0, tokens = 0;
    for (int j = first[0]; j < first[1]; ++j) {
      const KvBlockSpan& sp = spans[j];
      if (sp.n <= 0) continue;
      ks[m] = {sp.k, sp.block_tokens, sp.t0, sp.n, sp.pos0, nullptr, 0};
      vs[m] = {sp.v, sp.block_tokens, sp.t0, sp.n, sp.pos0, nullptr, 0};
      if (along) {
        target(vc, first[D - 1], first[D], m, false, &ks[m]);
        target(kc, first[D], first[D + 1], m, true, &vs[m]);
      }
      tokens += sp.n;
      ++m;
    }
    if (m > 0) {
      if (pf && !along) {
        if (!k_ahead) leads(kc, first[0], first[1], true);
        leads(vc, first[0], first[1], false);
      }
      // One block (codecs that do not fuse spans): the per-block calls, without the multi-block
      // defaults' extra indirection (measured: q8_0 4% slower through them at 32K, hot).
      if (m == 1) {
        KvPrefetchAlongScope a(ks[0].along, ks[0].along_bytes);
        kc.scores(head, sc.qp, n_q, ks[0].block, ks[0].block_tokens, ks[0].t0, ks[0].n, ks[0].pos0, sc.s, sc.s_stride);
      } else {
        kc.scores_spans(head, sc.qp, n_q, ks, m, sc.s, sc.s_stride);
      }
      softmax_update(sc, n_q, tokens, vc.head_dim(), ap, mask, done);
      k_ahead = pf && !along && first[1] < n_spans;
      if (k_ahead) leads(kc, first[1], first[2], true);
      if (m == 1) {
        KvPrefetchAlongScope a(vs[0].along, vs[0].along_bytes);
        vc.accumulate(head, sc.s, sc.s_stride, n_q, vs[0].block, vs[0].block_tokens, vs[0].t0, vs[0].n, sc.acc);
      } else {
        vc.accumulate_spans(head, sc.s, sc.s_stride, n_q, vs, m, sc.acc);
      }
    }
    done += tokens;
    for (int k = 0; k <= D; ++k) first[k] = first[k + 1];
    first[D + 1] = next(first[D]);
  }
}

// The online softmax over spans and then the tail, into sc.m / sc.l / sc.acc (unnormalized, in
// the model's basis). sc.qp holds the prepared query when n_spans > 0. mask: each query sees its
// row's first tokens of the spans-then-tail sequence only (attn_prefill).
void run_part(const KvCodec& kc, const KvCodec& vc, int head, int n_q, const KvBlockSpan* spans, int n_spans,
              const float* tail_k, const float* tail_v, size_t tail_stride, int n_tail, const AttnParams& ap,
              Scratch& sc, RowMask mask = {}) {
  const int hd = kc.head_dim(), vd = vc.head_dim();
  std::fill(sc.acc, sc.acc + size_t(n_q) * size_t(vd), 0.f);
  std::fill(sc.m, sc.m + n_q, -std::numeric_limits<float>::infinity());
  std::fill(sc.l, sc.l + n_q, 0.f);

  if (n_spans > 0) {
    // One pass over the blocks; each codec call serves all n_q query heads of the group, so the
    // packed K and V bytes of a block are read once per group.
    run_blocks(kc, vc, head, n_q, spans, n_spans, ap, sc, mask);
    // The accumulator is in V's storage basis; the tail is in the model's. finish_output is linear
    // (a rotation), so applying it before the remaining rescales is exact; sc.l is the mass of
    // the spans' weights in acc's scale (a centered codec's mean term).
    vc.finish_output_mass(head, sc.acc, n_q, sc.l);
  }

  if (n_tail > 0) {
    const KvRowFmt kf = kv_row_fmt(KvElem::f32, hd), vf = kv_row_fmt(KvElem::f32, vd);
    const auto* tk = reinterpret_cast<const uint8_t*>(tail_k);
    const auto* tv = reinterpret_cast<const uint8_t*>(tail_v);
    const size_t stride_bytes = tail_stride * sizeof(float);
    // The tail reads the raw query: the first hd floats of each row of q (see attn_decode).
    int packed = 0;
    for (int b = 0; b < n_spans; ++b) packed += std::max(0, spans[b].n);
    for (int t0 = 0; t0 < n_tail; t0 += kTailChunk) {
      const int n = std::min(kTailChunk, n_tail - t0);
      kv_rows_scores(kf, 1.f, sc.q_raw, n_q, tk + size_t(t0) * stride_bytes, stride_bytes, n, sc.s, sc.s_stride);
      softmax_update(sc, n_q, n, vd, ap, mask, packed + t0);
      kv_rows_accum(vf, 1.f, sc.s, sc.s_stride, n_q, tv + size_t(t0) * stride_bytes, stride_bytes, n, sc.acc);
    }
  }
}

// out = acc / l per query row, with the row's sink logit (sinks[i % period]) added to l: a row
// that attends to nothing (m = -inf, acc = 0) gives 0, as does one whose sink outweighs every score
// past float range (e^(sink - m) = inf).
void normalize_rows(const float* m, const float* l, const float* acc, int nq, int vd, const float* sinks, int period,
                    float* out) {
  for (int i = 0; i < nq; ++i) {
    float li = l[i];
    if (sinks && m[i] != -std::numeric_limits<float>::infinity()) li += std::exp(sinks[i % period] - m[i]);
    const float inv = li > 0 ? 1.f / li : 0.f;
    for (int d = 0; d < vd; ++d) out[size_t(i) * size_t(vd) + size_t(d)] = acc[size_t(i) * size_t(vd) + size_t(d)] * inv;
  }
}

int max_span_tokens(const KvBlockSpan* spans, int n_spans) {
  int max_bt = 0;
  for (int b = 0; b < n_spans; ++b) max_bt = std::max(max_bt, spans[b].n);
  return max_bt;
}

}  // namespace

size_t attn_scratch_floats(const KvCodec& kc, const KvCodec& vc, int n_q, int max_block_tokens) {
  return query_floats(kc, n_q) + part_floats(vc, n_q, max_block_tokens);
}

void attn_decode(const KvCodec& kc, const KvCodec& vc, int head, const float* q, int n_q,
                 const KvBlockSpan* spans, int n_spans, const float* tail_k, const float* tail_v,
                 size_t tail_stride, int n_tail, const AttnParams& ap, float* out, float* scratch) {
  const int vd = vc.head_dim();
  float* qp = scratch;
  Scratch sc = carve_part(n_q, max_span_tokens(spans, n_spans), scratch + query_floats(kc, n_q), qp);
  sc.q_raw = q;
  if (n_spans > 0) kc.prepare_query(head, q, n_q, qp);
  run_part(kc, vc, head, n_q, spans, n_spans, tail_k, tail_v, tail_stride, n_tail, ap, sc);
  normalize_rows(sc.m, sc.l, sc.acc, n_q, vd, ap.sinks, n_q, out);
}

void attn_prefill(const KvCodec& kc, const KvCodec& vc, int head, const float* q, int n_q, int n_rows,
                  const int* row_limit, const KvBlockSpan* spans, int n_spans, const float* tail_k,
                  const float* tail_v, size_t tail_stride, int n_tail, const AttnParams& ap, float* out,
                  float* scratch) {
  const int vd = vc.head_dim(), nq = n_q * n_rows;
  float* qp = scratch;
  Scratch sc = carve_part(nq, max_span_tokens(spans, n_spans), scratch + query_floats(kc, nq), qp);
  sc.q_raw = q;
  if (n_spans > 0) kc.prepare_query(head, q, nq, qp);
  run_part(kc, vc, head, nq, spans, n_spans, tail_k, tail_v, tail_stride, n_tail, ap, sc, RowMask{row_limit, n_q});
  normalize_rows(sc.m, sc.l, sc.acc, nq, vd, ap.sinks, n_q, out);
}

size_t attn_split_scratch_floats(const KvCodec& kc, const KvCodec& vc, int n_q, int max_block_tokens, int n_parts) {
  return query_floats(kc, n_q) + size_t(std::max(1, n_parts)) * round16(part_floats(vc, n_q, max_block_tokens));
}

void attn_decode_split(const KvCodec& kc, const KvCodec& vc, int head, const float* q, int n_q,
                       const KvBlockSpan* spans, int n_spans, const float* tail_k, const float* tail_v,
                       size_t tail_stride, int n_tail, const AttnParams& ap, float* out, float* scratch,
                       ThreadPool& pool, int n_parts) {
  const int vd = vc.head_dim();
  int total = 0;
  for (int b = 0; b < n_spans; ++b) total += std::max(0, spans[b].n);
  // Parts of fewer tokens than this cost more in wake-ups and merging than they save.
  n_parts = std::max(1, std::min(n_parts, total / kSplitMinPartTokens));
  if (n_parts <= 1)
    return attn_decode(kc, vc, head, q, n_q, spans, n_spans, tail_k, tail_v, tail_stride, n_tail, ap, out, scratch);

  // Contiguous span ranges of about total / n_parts tokens; the tail goes with the last part.
  std::vector<int> first(size_t(n_parts) + 1, n_spans);
  first[0] = 0;
  for (int b = 0, p = 1, cum = 0; b < n_spans && p < n_parts; ++b) {
    cum += std::max(0, spans[b].n);
    while (p < n_parts && int64_t(cum) * n_parts >= int64_t(p) * total) first[size_t(p++)] = b + 1;
  }
  const int max_bt = max_span_tokens(spans, n_spans);
  float* qp = scratch;
  kc.prepare_query(head, q, n_q, qp);
  const size_t part_stride = round16(part_floats(vc, n_q, max_bt));
  float* parts = scratch + query_floats(kc, n_q);
  pool.parallel_for(size_t(n_parts), 1, [&](size_t pb, size_t pe) {
    for (size_t p = pb; p < pe; ++p) {
      Scratch sc = carve_part(n_q, max_bt, parts + p * part_stride, qp);
      sc.q_raw = q;
      const bool last = p + 1 == size_t(n_parts);
      run_part(kc, vc, head, n_q, spans + first[p], first[p + 1] - first[p], last ? tail_k : nullptr,
               last ? tail_v : nullptr, tail_stride, last ? n_tail : 0, ap, sc);
    }
  });
  std::vector<const float*> states(static_cast<size_t>(n_parts));
  for (int p = 0; p < n_parts; ++p) states[size_t(p)] = carve_part(n_q, max_bt, parts + size_t(p) * part_stride, qp).m;
  attn_merge_parts(states.data(), n_parts, n_q, vd, out, ap.sinks);
}

size_t attn_part_floats(const KvCodec& vc, int n_q) { return state_floats(n_q, vc.head_dim()); }

void attn_decode_part(const KvCodec& kc, const KvCodec& vc, int head, const float* q, int n_q,
                      const KvBlockSpan* spans, int n_spans, const float* tail_k, const float* tail_v,
                      size_t tail_stride, int n_tail, const AttnParams& ap, float* part, float* scratch) {
  float* qp = scratch;
  Scratch sc = carve_part(n_q, max_span_tokens(spans, n_spans), scratch + query_floats(kc, n_q), qp);
  point_state(sc, n_q, part);
  sc.q_raw = q;
  if (n_spans > 0) kc.prepare_query(head, q, n_q, qp);
  run_part(kc, vc, head, n_q, spans, n_spans, tail_k, tail_v, tail_stride, n_tail, ap, sc);
}

void attn_merge_parts(const float* const* parts, int n_parts, int n_q, int vd, float* out, const float* sinks) {
  const size_t l_off = round16(size_t(n_q)), acc_off = 2 * round16(size_t(n_q));
  for (int i = 0; i < n_q; ++i) {
    float M = -std::numeric_limits<float>::infinity();
    for (int p = 0; p < n_parts; ++p) M = std::max(M, parts[p][i]);
    float* o = out + size_t(i) * size_t(vd);
    std::fill(o, o + vd, 0.f);
    float l = 0;
    if (M != -std::numeric_limits<float>::infinity()) {
      for (int p = 0; p < n_parts; ++p) {
        const float m = parts[p][i];
        if (m == -std::numeric_limits<float>::infinity()) continue;  // nothing attendable in it
        const float w = std::exp(m - M);
        l += w * parts[p][l_off + size_t(i)];
        const float* a = parts[p] + acc_off + size_t(i) * size_t(vd);
        for (int d = 0; d < vd; ++d) o[d] += w * a[d];
      }
      if (sinks) l += std::exp(sinks[i] - M);
    }
    const float inv = l > 0 ? 1.f / l : 0.f;
    for (int d = 0; d < vd; ++d) o[d] *= inv;
  }
}

std::vector<AttnPiece> attn_balance_pieces(const int* tokens, int n_items, int n_threads, int min_piece) {
  std::vector<AttnPiece> pieces;
  if (n_items <= 0) return pieces;
  n_threads = std::max(1, n_threads);
  std::vector<int64_t> base(size_t(n_items) + 1, 0);  // item w's tokens: [base[w], base[w + 1])
  for (int w = 0; w < n_items; ++w) base[size_t(w) + 1] = base[size_t(w)] + std::max(0, tokens[w]);
  const int64_t total = base[size_t(n_items)];
  // cut[k]: where thread k's share begins; non-decreasing, cut[0] = 0, cut[n_threads] = total.
  std::vector<int64_t> cut(size_t(n_threads) + 1, total);
  cut[0] = 0;
  for (int k = 1, w = 0; k < n_threads; ++k) {
    int64_t c = (total * k + n_threads / 2) / n_threads;
    while (w < n_items && base[size_t(w) + 1] <= c) ++w;  // c lies in item w (or at the end)
    // The piece before c starts at the item's start or at the previous cut, whichever is later.
    const int64_t lo = w < n_items ? std::max(base[size_t(w)], cut[size_t(k) - 1]) : total;
    if (w < n_items && c > lo) {
      const int64_t a = c - lo, b = base[size_t(w) + 1] - c;
      if (a < min_piece || b < min_piece) c = a <= b ? lo : base[size_t(w) + 1];
    }
    cut[size_t(k)] = std::max(c, cut[size_t(k) - 1]);
  }
  for (int w = 0, k = 0; w < n_items; ++w) {
    const int64_t lo = base[size_t(w)], hi = base[size_t(w) + 1];
    while (k + 1 < n_threads && cut[size_t(k) + 1] <= lo) ++k;  // the thread whose share holds lo
    if (hi == lo) {  // an empty item: one empty piece, so that every item has its output
      pieces.push_back({w, 0, 0, k});
      continue;
    }
    for (int64_t t = lo; t < hi;) {
      while (k + 1 < n_threads && cut[size_t(k) + 1] <= t) ++k;
      const int64_t e = std::min(hi, cut[size_t(k) + 1]);
      pieces.push_back({w, int(t - lo), int(e - lo), k});
      t = e;
    }
  }
  return pieces;
}

void attn_decode_ref(const KvCodec& kc, const KvCodec& vc, int head, const float* q, int n_q,
                     const KvBlockSpan* spans, int n_spans, const float* tail_k, const float* tail_v,
                     size_t tail_stride, int n_tail, const AttnParams& ap, float* out) {
  const int hd = kc.head_dim(), vd = vc.head_dim();
  int total = n_tail;
  for (int b = 0; b < n_spans; ++b) total += std::max(0, spans[b].n);
  std::vector<float> K(size_t(total) * size_t(hd)), V(size_t(total) * size_t(vd));  // (total, dim)
  size_t row = 0;
  for (int b = 0; b < n_spans; ++b) {
    const KvBlockSpan& sp = spans[b];
    if (sp.n <= 0) continue;
    kc.decode(head, sp.k, sp.block_tokens, sp.t0, sp.n, sp.pos0, K.data() + row * size_t(hd));
    vc.decode(head, sp.v, sp.block_tokens, sp.t0, sp.n, sp.pos0, V.data() + row * size_t(vd));
    row += size_t(sp.n);
  }
  for (int t = 0; t < n_tail; ++t, ++row) {
    std::copy(tail_k + size_t(t) * tail_stride, tail_k + size_t(t) * tail_stride + size_t(hd), K.data() + row * size_t(hd));
    std::copy(tail_v + size_t(t) * tail_stride, tail_v + size_t(t) * tail_stride + size_t(vd), V.data() + row * size_t(vd));
  }
  std::vector<double> s(static_cast<size_t>(total));
  for (int i = 0; i < n_q; ++i) {
    const float* qi = q + size_t(i) * size_t(hd);
    double mx = -std::numeric_limits<double>::infinity();
    for (int t = 0; t < total; ++t) {
      double d = 0;
      for (int j = 0; j < hd; ++j) d += double(qi[j]) * double(K[size_t(t) * size_t(hd) + size_t(j)]);
      d *= double(ap.scale);
      if (ap.softcap > 0) d = double(ap.softcap) * std::tanh(d / double(ap.softcap));
      s[size_t(t)] = d;
      mx = std::max(mx, d);
    }
    double l = 0;
    std::vector<double> o(static_cast<size_t>(vd), 0.0);
    if (total > 0 && mx != -std::numeric_limits<double>::infinity()) {
      for (int t = 0; t < total; ++t) {
        const double p = std::exp(s[size_t(t)] - mx);
        l += p;
        for (int j = 0; j < vd; ++j) o[size_t(j)] += p * double(V[size_t(t) * size_t(vd) + size_t(j)]);
      }
      if (ap.sinks) l += std::exp(double(ap.sinks[i]) - mx);
    }
    for (int j = 0; j < vd; ++j) out[size_t(i) * size_t(vd) + size_t(j)] = l > 0 ? float(o[size_t(j)] / l) : 0.f;
  }
}

}  // namespace kvq
