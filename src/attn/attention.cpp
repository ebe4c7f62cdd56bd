#include "attn/attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "attn/softmax.h"
#include "core/error.h"
#include "kv/kv_rows.h"

namespace kvq {

namespace {
// The f32 tail is scored in chunks of this many tokens (the scores buffer holds at least this).
constexpr int kTailChunk = 64;

size_t round16(size_t n) { return (n + 15) & ~size_t(15); }

struct Scratch {
  float* qp;   // (n_q, prepared_query_dim)
  float* s;    // (n_q, s_stride): scores, then probabilities, of one block
  float* acc;  // (n_q, v head_dim)
  float* m;    // (n_q) running max
  float* l;    // (n_q) running sum of exp
  int s_stride;
};

Scratch carve(const KvCodec& kc, const KvCodec& vc, int n_q, int max_block_tokens, float* base) {
  Scratch sc;
  sc.s_stride = int(round16(size_t(std::max(max_block_tokens, kTailChunk))));
  float* p = base;
  sc.qp = p; p += round16(size_t(n_q) * size_t(kc.prepared_query_dim()));
  sc.s = p; p += size_t(n_q) * size_t(sc.s_stride);
  sc.acc = p; p += round16(size_t(n_q) * size_t(vc.head_dim()));
  sc.m = p; p += round16(size_t(n_q));
  sc.l = p;
  return sc;
}

// Scores of n tokens (already in sc.s) -> probabilities relative to the updated running max;
// rescales acc and l to that max. After this sc.s holds exp(score - m_new).
void softmax_update(Scratch& sc, int n_q, int n, int v_dim, const AttnParams& ap) {
  for (int i = 0; i < n_q; ++i) {
    float* s = sc.s + size_t(i) * size_t(sc.s_stride);
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
    const float corr = std::exp(sc.m[i] - m_new);  // 0 on the first block (m = -inf)
    if (corr != 1.f) {
      float* a = sc.acc + size_t(i) * size_t(v_dim);
      for (int d = 0; d < v_dim; ++d) a[d] *= corr;
      sc.l[i] *= corr;
    }
    sc.m[i] = m_new;
    sc.l[i] += attn_exp_sub(s, n, m_new);
  }
}

// Spans are pages scattered in memory, and the hardware prefetchers stop at 4 KiB boundaries. The
// row kernels prefetch kv_prefetch_bytes ahead within a span (kv_rows_simd.h); the start of the
// next span is requested here, K before the current scores and V before the current weighted sum,
// so its first rows are on their way while the current span is computed. (Requesting the whole
// next block at once measured no better for f16 and worse for the small 4-bit blocks.)
constexpr size_t kNextSpanBytes = 4096;
inline void prefetch_span_start(const uint8_t* p) {
  for (size_t o = 0; o < kNextSpanBytes; o += 64) __builtin_prefetch(p + o, 0, 2);
}

}  // namespace

size_t attn_scratch_floats(const KvCodec& kc, const KvCodec& vc, int n_q, int max_block_tokens) {
  const size_t s_stride = round16(size_t(std::max(max_block_tokens, kTailChunk)));
  return round16(size_t(n_q) * size_t(kc.prepared_query_dim())) + size_t(n_q) * s_stride +
         round16(size_t(n_q) * size_t(vc.head_dim())) + 2 * round16(size_t(n_q));
}

void attn_decode(const KvCodec& kc, const KvCodec& vc, int head, const float* q, int n_q,
                 const KvBlockSpan* spans, int n_spans, const float* tail_k, const float* tail_v,
                 size_t tail_stride, int n_tail, const AttnParams& ap, float* out, float* scratch) {
  const int hd = kc.head_dim(), vd = vc.head_dim();
  int max_bt = 0;
  for (int b = 0; b < n_spans; ++b) max_bt = std::max(max_bt, spans[b].n);
  Scratch sc = carve(kc, vc, n_q, max_bt, scratch);
  std::fill(sc.acc, sc.acc + size_t(n_q) * size_t(vd), 0.f);
  std::fill(sc.m, sc.m + n_q, -std::numeric_limits<float>::infinity());
  std::fill(sc.l, sc.l + n_q, 0.f);

  if (n_spans > 0) {
    kc.prepare_query(head, q, n_q, sc.qp);
    // One pass over the blocks; each codec call serves all n_q query heads of the group, so the
    // packed K and V bytes of a block are read once per group.
    for (int b = 0; b < n_spans; ++b) {
      const KvBlockSpan& sp = spans[b];
      if (sp.n <= 0) continue;
      if (b + 1 < n_spans) prefetch_span_start(spans[b + 1].k);
      kc.scores(head, sc.qp, n_q, sp.k, sp.block_tokens, sp.t0, sp.n, sp.pos0, sc.s, sc.s_stride);
      softmax_update(sc, n_q, sp.n, vd, ap);
      if (b + 1 < n_spans) prefetch_span_start(spans[b + 1].v);
      vc.accumulate(head, sc.s, sc.s_stride, n_q, sp.v, sp.block_tokens, sp.t0, sp.n, sc.acc);
    }
    // The accumulator is in V's storage basis; the tail is in the model's. finish_output is linear
    // (a rotation), so applying it before the remaining rescales is exact.
    vc.finish_output(head, sc.acc, n_q);
  }

  if (n_tail > 0) {
    const KvRowFmt kf = kv_row_fmt(KvElem::f32, hd), vf = kv_row_fmt(KvElem::f32, vd);
    const auto* tk = reinterpret_cast<const uint8_t*>(tail_k);
    const auto* tv = reinterpret_cast<const uint8_t*>(tail_v);
    const size_t stride_bytes = tail_stride * sizeof(float);
    for (int t0 = 0; t0 < n_tail; t0 += kTailChunk) {
      const int n = std::min(kTailChunk, n_tail - t0);
      kv_rows_scores(kf, 1.f, q, n_q, tk + size_t(t0) * stride_bytes, stride_bytes, n, sc.s, sc.s_stride);
      softmax_update(sc, n_q, n, vd, ap);
      kv_rows_accum(vf, 1.f, sc.s, sc.s_stride, n_q, tv + size_t(t0) * stride_bytes, stride_bytes, n, sc.acc);
    }
  }

  for (int i = 0; i < n_q; ++i) {
    const float inv = sc.l[i] > 0 ? 1.f / sc.l[i] : 0.f;
    for (int d = 0; d < vd; ++d) out[size_t(i) * size_t(vd) + size_t(d)] = sc.acc[size_t(i) * size_t(vd) + size_t(d)] * inv;
  }
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
    }
    for (int j = 0; j < vd; ++j) out[size_t(i) * size_t(vd) + size_t(j)] = l > 0 ? float(o[size_t(j)] / l) : 0.f;
  }
}

}  // namespace kvq
