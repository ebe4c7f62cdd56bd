#include "cache/kv_cache.h"

#include <algorithm>

#include "core/error.h"

namespace kvq {

KvCache::KvCache(const KvCacheConfig& cfg) : cfg_(cfg) {
  if (cfg_.n_layer <= 0 || cfg_.n_kv_heads <= 0 || cfg_.head_dim <= 0)
    fail("KV cache: invalid shape (layers {}, kv heads {}, head dim {})", cfg_.n_layer, cfg_.n_kv_heads, cfg_.head_dim);
  if (cfg_.page_tokens < 16 || cfg_.page_tokens > 256 || (cfg_.page_tokens & (cfg_.page_tokens - 1)))
    fail("KV cache: page size {} must be a power of two in 16..256", cfg_.page_tokens);
  if (int(cfg_.policy.layers.size()) != cfg_.n_layer)
    fail("KV cache: policy has {} layers, model has {}", cfg_.policy.layers.size(), cfg_.n_layer);
  layers_.resize(size_t(cfg_.n_layer));
  size_t off = 0;
  for (int il = 0; il < cfg_.n_layer; ++il) {
    Layer& L = layers_[size_t(il)];
    KvCodecParams p;
    p.head_dim = cfg_.head_dim;
    p.n_kv_heads = cfg_.n_kv_heads;
    p.layer = il;
    if (size_t(il) < cfg_.rope.size()) p.rope = cfg_.rope[size_t(il)];
    p.seed = cfg_.seed;
    p.calib = cfg_.calib;
    p.role = KvRole::key;
    L.k = kv_codec_create(cfg_.policy.layers[size_t(il)].k_codec, p);
    p.role = KvRole::value;
    L.v = kv_codec_create(cfg_.policy.layers[size_t(il)].v_codec, p);
    const auto& ki = L.k->info();
    const auto& vi = L.v->info();
    if (ki.group_tokens > 1 && vi.group_tokens > 1 &&
        (ki.group_tokens != vi.group_tokens || ki.residual_tokens != vi.residual_tokens))
      fail("layer {}: K codec {} (group {}, residual {}) and V codec {} (group {}, residual {}) must use the same token grouping",
           il, ki.name, ki.group_tokens, ki.residual_tokens, vi.name, vi.group_tokens, vi.residual_tokens);
    const auto& gi = ki.group_tokens > 1 ? ki : vi;
    L.group = std::max(1, gi.group_tokens);
    L.residual = gi.group_tokens > 1 ? gi.residual_tokens : 0;
    if (cfg_.page_tokens % L.group != 0)
      fail("layer {}: token group {} of codec {} does not divide the page size {}", il, L.group, gi.name, cfg_.page_tokens);
    if (vi.pre_rope) fail("layer {}: codec {} stores keys before RoPE and cannot hold values", il, vi.name);
    L.pre_rope = ki.pre_rope;
    L.k_block = L.k->block_bytes(cfg_.page_tokens);
    L.v_block = L.v->block_bytes(cfg_.page_tokens);
    // Keep every head block 64-byte aligned so the SIMD kernels can use aligned loads.
    auto align = [](size_t x) { return (x + 63) & ~size_t(63); };
    L.k_block = align(L.k_block);
    L.v_block = align(L.v_block);
    L.k_off = off;
    off += L.k_block * size_t(cfg_.n_kv_heads);
    L.v_off = off;
    off += L.v_block * size_t(cfg_.n_kv_heads);
    if (L.group > 1) {
      L.tail_k.resize(size_t(cfg_.n_kv_heads));
      L.tail_v.resize(size_t(cfg_.n_kv_heads));
      if (L.pre_rope) L.tail_k_pre.resize(size_t(cfg_.n_kv_heads));
    }
  }
  page_bytes_ = off;
  max_block_tokens_ = cfg_.page_tokens;
}

void KvCache::ensure_pages(int n_tokens) {
  size_t need = size_t((n_tokens + cfg_.page_tokens - 1) / cfg_.page_tokens);
  while (pages_.size() < need) pages_.emplace_back(page_bytes_);
}

void KvCache::append(int layer, int n, const float* k_pre, const float* k, const float* v) {
  Layer& L = layers_[size_t(layer)];
  KVQ_CHECK(L.pending == 0, "layer {} appended twice in one step", layer);
  const int n0 = n_tokens_;
  if (n0 + n > cfg_.max_tokens) fail("KV cache full: {} + {} tokens exceed the capacity of {}", n0, n, cfg_.max_tokens);
  ensure_pages(n0 + n);
  const int nkv = cfg_.n_kv_heads, hd = cfg_.head_dim, P = cfg_.page_tokens;
  const size_t row = size_t(nkv) * size_t(hd);
  const float* ksrc = L.pre_rope ? k_pre : k;
  KVQ_CHECK(ksrc != nullptr, "pre-RoPE keys required by codec {}", L.k->info().name);

  if (L.group > 1) {
    for (int h = 0; h < nkv; ++h) {
      for (int t = 0; t < n; ++t) {
        const size_t o = size_t(t) * row + size_t(h) * size_t(hd);
        L.tail_k[size_t(h)].insert(L.tail_k[size_t(h)].end(), k + o, k + o + hd);
        L.tail_v[size_t(h)].insert(L.tail_v[size_t(h)].end(), v + o, v + o + hd);
        if (L.pre_rope) L.tail_k_pre[size_t(h)].insert(L.tail_k_pre[size_t(h)].end(), k_pre + o, k_pre + o + hd);
      }
    }
  }
  const int q0 = quantized(L, n0), q1 = quantized(L, n0 + n);
  // Encode tokens [q0, q1) page by page.
  for (int t = q0; t < q1;) {
    const int page = t / P, slot = t % P;
    const int run = std::min(q1 - t, P - slot);
    uint8_t* pg = page_ptr(page);
    for (int h = 0; h < nkv; ++h) {
      const float *ks, *vs;
      size_t stride;
      if (L.group > 1) {
        const size_t r = size_t(t - L.tail_start) * size_t(hd);
        ks = (L.pre_rope ? L.tail_k_pre : L.tail_k)[size_t(h)].data() + r;
        vs = L.tail_v[size_t(h)].data() + r;
        stride = size_t(hd);
      } else {
        const size_t r = size_t(t - n0) * row + size_t(h) * size_t(hd);
        ks = ksrc + r;
        vs = v + r;
        stride = row;
      }
      L.k->encode(h, ks, stride, run, pg + L.k_off + size_t(h) * L.k_block, P, slot, page * P);
      L.v->encode(h, vs, stride, run, pg + L.v_off + size_t(h) * L.v_block, P, slot, page * P);
    }
    t += run;
  }
  L.pending = n;
}

size_t KvCache::attend_scratch_floats(int n_q) const {
  size_t m = 0;
  for (const auto& L : layers_) m = std::max(m, attn_scratch_floats(*L.k, *L.v, n_q, max_block_tokens_));
  return m;
}

void KvCache::attend_head(int layer, int head, int pos, const float* q, int n_q, const AttnParams& ap,
                          int window, float* out, float* scratch, std::vector<KvBlockSpan>& spans) const {
  const Layer& L = layers_[size_t(layer)];
  KVQ_CHECK(pos < n_tokens_ + L.pending, "query position {} beyond the appended tokens", pos);
  const int P = cfg_.page_tokens;
  const int end = pos + 1;
  const int start = window > 0 ? std::max(0, end - window) : 0;
  const int packed_end = quantized(L, end);
  spans.clear();
  for (int t = start; t < packed_end;) {
    const int page = t / P, slot = t % P;
    const int run = std::min(packed_end - t, P - slot);
    const uint8_t* pg = pages_[size_t(page)].data();
    KvBlockSpan s;
    s.k = pg + L.k_off + size_t(head) * L.k_block;
    s.v = pg + L.v_off + size_t(head) * L.v_block;
    s.block_tokens = P;
    s.t0 = slot;
    s.n = run;
    s.pos0 = page * P;
    spans.push_back(s);
    t += run;
  }
  const float *tk = nullptr, *tv = nullptr;
  int n_tail = 0;
  if (L.group > 1) {
    const int tail_from = std::max(start, packed_end);
    n_tail = end - tail_from;
    KVQ_CHECK(tail_from >= L.tail_start, "tail row {} already dropped (tail starts at {})", tail_from, L.tail_start);
    tk = L.tail_k[size_t(head)].data() + size_t(tail_from - L.tail_start) * size_t(cfg_.head_dim);
    tv = L.tail_v[size_t(head)].data() + size_t(tail_from - L.tail_start) * size_t(cfg_.head_dim);
  }
  attn_decode(*L.k, *L.v, head, q, n_q, spans.data(), int(spans.size()), tk, tv, size_t(cfg_.head_dim), n_tail,
              ap, out, scratch);
}

void KvCache::commit(int n) {
  const int n1 = n_tokens_ + n;
  for (auto& L : layers_) {
    KVQ_CHECK(L.pending == n, "commit({}) but layer appended {}", n, L.pending);
    L.pending = 0;
    if (L.group > 1) {
      const int q1 = quantized(L, n1);
      const size_t drop = size_t(q1 - L.tail_start) * size_t(cfg_.head_dim);
      for (auto* tails : {&L.tail_k, &L.tail_v, &L.tail_k_pre})
        for (auto& tl : *tails) tl.erase(tl.begin(), tl.begin() + std::ptrdiff_t(drop));
      L.tail_start = q1;
    }
  }
  n_tokens_ = n1;
}

void KvCache::clear() {
  pages_.clear();
  n_tokens_ = 0;
  for (auto& L : layers_) {
    L.pending = 0;
    L.tail_start = 0;
    for (auto* tails : {&L.tail_k, &L.tail_v, &L.tail_k_pre})
      for (auto& tl : *tails) tl.clear();
  }
}

size_t KvCache::bytes_tail() const {
  size_t b = 0;
  for (const auto& L : layers_)
    for (const auto* tails : {&L.tail_k, &L.tail_v, &L.tail_k_pre})
      for (const auto& tl : *tails) b += tl.capacity() * sizeof(float);
  return b;
}

}  // namespace kvq
