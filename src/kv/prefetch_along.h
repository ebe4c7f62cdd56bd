// Prefetch along a kernel call: the head block that attention reads a few kernel calls later,
// requested into L2 by the running fused kernel in slices, one per step of its own loop (a tile
// or segment of the tiled kernels, a token step of the row kernels, a key group of KIVI's).
//
// Attention's blocks are scattered over the page pool, so the hardware prefetchers restart at
// each one. Requesting a whole block's lines at a call's start (KvCodec::prefetch_range) fills
// the load queue with prefetches that wait for miss buffers, and the call's own loads wait behind
// them; one call ahead is also too short for the packed formats, whose calls take about as long
// as one DRAM round trip. Spread over the tile loop, the requests overlap the integer dots and
// can be issued further ahead (attn/attention.cpp: run_part).
#pragma once
#include <cstddef>
#include <cstdint>

#include "kvq/kv_format.h"

namespace kvq {

struct KvPrefetchAlong {
  const uint8_t* p = nullptr;
  size_t bytes = 0;
};

// This thread's range for the next fused kernel call; empty outside attention's block loop.
inline thread_local KvPrefetchAlong kv_prefetch_along;

// Sets the range for the calls in its scope and clears it after (a stale range would only waste
// requests, prefetches do not fault, but other callers of the kernels should not pay for them).
class KvPrefetchAlongScope {
 public:
  KvPrefetchAlongScope(const uint8_t* p, size_t bytes) { kv_prefetch_along = {p, bytes}; }
  ~KvPrefetchAlongScope() { kv_prefetch_along = {}; }
  KvPrefetchAlongScope(const KvPrefetchAlongScope&) = delete;
  KvPrefetchAlongScope& operator=(const KvPrefetchAlongScope&) = delete;
};

// f(span, o) for each span of a multi-block call with n > 0 (o: its first column, the n of the
// spans before it summed), each with its span's along range set: the default of
// KvCodec::scores_spans / accumulate_spans and of kernels without a multi-block form.
template <class F>
inline void kv_for_spans(const KvSpan* spans, int n_spans, F&& f) {
  for (int s = 0, o = 0; s < n_spans; ++s) {
    if (spans[s].n <= 0) continue;
    {
      KvPrefetchAlongScope scope(spans[s].along, spans[s].along_bytes);
      f(spans[s], o);
    }
    o += spans[s].n;
  }
}

// The 64-byte lines [first, end) of a bytes-long range that step i of a loop of n steps requests:
// consecutive shares that cover every line once.
struct KvLineSpan {
  size_t first = 0, end = 0;
};
inline KvLineSpan kv_prefetch_along_lines(size_t bytes, int i, int n) {
  const size_t lines = (bytes + 63) / 64, per = (lines + size_t(n) - 1) / size_t(n);
  const size_t first = per * size_t(i) < lines ? per * size_t(i) : lines;
  const size_t end = per * size_t(i + 1) < lines ? per * size_t(i + 1) : lines;
  return {first, end};
}

// One line requested into L2 (prefetcht1) as a volatile asm statement: GCC 12 deletes loops of
// __builtin_prefetch whose range it reads through a lambda's captures (the kernels pass their
// request steps as lambdas), leaving a kernel that requests nothing.
[[gnu::always_inline]] inline void kv_prefetch_l2(const void* p) {
#if defined(__x86_64__) || defined(__i386__)
  __asm__ volatile("prefetcht1 %0" : : "m"(*static_cast<const char*>(p)));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

// Step i of a loop of n steps requests its share of a's lines (prefetcht1: into L2).
[[gnu::always_inline]] inline void kv_prefetch_along_step(const KvPrefetchAlong& a, int i, int n) {
  if (!a.p) return;
  const KvLineSpan s = kv_prefetch_along_lines(a.bytes, i, n);
  for (size_t l = s.first; l < s.end; ++l) kv_prefetch_l2(a.p + 64 * l);
}

// A call's along range requested a few lines per step of a kernel's inner loop (steps: how many
// times step() will be called) instead of all at the call's start. In the fp8 and int8 tiles'
// kernels (a 4-tile fp8 step at head_dim 256 would ask for a whole 16 KiB block at once) the
// spread requests ran 8-28% faster from DRAM at head_dim 128-256 and within 4% at 64
// (bench/BENCHMARKS.md, "FP8 in 16-token tiles").
struct KvAlongSpread {
  const uint8_t* p = nullptr;
  size_t next = 0, end = 0, per = 0;
  KvAlongSpread(const KvPrefetchAlong& a, int steps) {
    if (!a.p || steps <= 0) return;
    p = a.p;
    end = (a.bytes + 63) / 64;
    per = (end + size_t(steps) - 1) / size_t(steps);
  }
  [[gnu::always_inline]] void step() {
    for (size_t k = 0; k < per && next < end; ++k, ++next) kv_prefetch_l2(p + 64 * next);
  }
};

// Tokens [t, t + cnt) of a call over n tokens: their share of a bytes-long range's lines, for
// kernels that walk a block token by token (the float rows: kv/kv_rows_simd.h's kv_prefetch_ahead).
inline KvLineSpan kv_prefetch_along_token_lines(size_t bytes, int t, int cnt, int n) {
  const size_t lines = (bytes + 63) / 64;
  const size_t first = lines * size_t(t) / size_t(n), end = lines * size_t(t + cnt) / size_t(n);
  return {first < lines ? first : lines, end < lines ? end : lines};
}
[[gnu::always_inline]] inline void kv_prefetch_along_tokens(const KvPrefetchAlong& a, int t, int cnt, int n) {
  if (!a.p || n <= 0) return;
  const KvLineSpan s = kv_prefetch_along_token_lines(a.bytes, t, cnt, n);
  for (size_t l = s.first; l < s.end; ++l) kv_prefetch_l2(a.p + 64 * l);
}

}  // namespace kvq
