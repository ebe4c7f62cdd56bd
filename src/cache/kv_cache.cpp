#include "cache/kv_cache.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "core/thread_pool.h"

namespace kvq {

KvCache::KvCache(const KvCacheConfig& cfg, PagePool* pool) : cfg_(cfg), pool_(pool) {
  if (cfg_.n_layer <= 0 || cfg_.n_kv_heads <= 0 || cfg_.head_dim <= 0)
    fail("KV cache: invalid shape (layers {}, kv heads {}, head dim {})", cfg_.n_layer, cfg_.n_kv_heads, cfg_.head_dim);
  if (cfg_.page_tokens < 16 || cfg_.page_tokens > 256 || (cfg_.page_tokens & (cfg_.page_tokens - 1)))
    fail("KV cache: page size {} must be a power of two in 16..256", cfg_.page_tokens);
  if (int(cfg_.policy.layers.size()) != cfg_.n_layer)
    fail("KV cache: policy has {} layers, model has {}", cfg_.policy.layers.size(), cfg_.n_layer);
  layers_.resize(size_t(cfg_.n_layer));
  auto window_of = [this](int il) { return size_t(il) < cfg_.window.size() ? std::max(0, cfg_.window[size_t(il)]) : 0; };
  std::vector<size_t> layer_bytes(size_t(cfg_.n_layer));
  for (int il = 0; il < cfg_.n_layer; ++il) {
    Layer& L = layers_[size_t(il)];
    KvCodecParams p = kv_cache_codec_params(cfg_, il);
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
    layer_bytes[size_t(il)] = layer_page_bytes(il);
    page_bytes_ += layer_bytes[size_t(il)];
    if (L.group > 1) {
      L.tail_k.resize(size_t(cfg_.n_kv_heads));
      L.tail_v.resize(size_t(cfg_.n_kv_heads));
      if (L.pre_rope) L.tail_k_pre.resize(size_t(cfg_.n_kv_heads));
    }
  }
  // Page groups (see the header comment).
  const auto plan = [&](bool pooled) {
    std::vector<Group> gs;
    std::vector<int> full, windows;
    for (int il = 0; il < cfg_.n_layer; ++il) {
      const int w = window_of(il);
      if (w == 0) full.push_back(il);
      else if (std::find(windows.begin(), windows.end(), w) == windows.end()) windows.push_back(w);
    }
    if (pooled && (full.empty() || windows.empty())) {
      gs.emplace_back();
      for (int il = 0; il < cfg_.n_layer; ++il) gs.back().layers.push_back(il);
    } else {
      if (!full.empty()) {
        gs.emplace_back();
        gs.back().layers = full;
      }
      size_t cap = SIZE_MAX;  // pooled: no sliding group's page above the full group's or one layer's
      if (pooled) {
        cap = 0;
        for (int il = 0; il < cfg_.n_layer; ++il) cap = std::max(cap, layer_bytes[size_t(il)]);
        size_t f = 0;
        for (int il : full) f += layer_bytes[size_t(il)];
        cap = std::max(cap, f);
      }
      for (int w : windows) {
        bool open = false;
        size_t bytes = 0;
        for (int il = 0; il < cfg_.n_layer; ++il) {
          if (window_of(il) != w) continue;
          if (!open || bytes + layer_bytes[size_t(il)] > cap) {
            gs.emplace_back();
            gs.back().window = w;
            bytes = 0;
            open = true;
          }
          gs.back().layers.push_back(il);
          bytes += layer_bytes[size_t(il)];
        }
      }
    }
    for (Group& G : gs)
      for (int il : G.layers) G.bytes += layer_bytes[size_t(il)];
    return gs;
  };
  std::vector<Group> pooled = plan(true);
  for (const Group& G : pooled) pool_page_bytes_ = std::max(pool_page_bytes_, G.bytes);
  groups_ = pool_ ? std::move(pooled) : plan(false);
  for (size_t g = 0; g < groups_.size(); ++g) {
    size_t off = 0;
    for (int il : groups_[g].layers) {
      Layer& L = layers_[size_t(il)];
      L.pgroup = int(g);
      L.k_off = off;
      off += L.k_block * size_t(cfg_.n_kv_heads);
      L.v_off = off;
      off += L.v_block * size_t(cfg_.n_kv_heads);
    }
  }
  max_block_tokens_ = cfg_.page_tokens;
  // With R = 0 and G | P every page boundary leaves an empty tail (see the header comment).
  shareable_ = std::all_of(layers_.begin(), layers_.end(), [](const Layer& L) { return L.residual == 0; });
  identity_ = build_identity();
  if (pool_ && (pool_->page_tokens() != cfg_.page_tokens || pool_->page_bytes() != pool_page_bytes_))
    fail("KV cache: the page pool holds pages of {} tokens / {} bytes, this cache needs {} tokens / {} bytes",
         pool_->page_tokens(), pool_->page_bytes(), cfg_.page_tokens, pool_page_bytes_);
}

KvCache::~KvCache() {
  if (pool_) release();
}

KvCodecParams kv_cache_codec_params(const KvCacheConfig& cfg, int layer) {
  KvCodecParams p;
  p.head_dim = cfg.head_dim;
  p.n_kv_heads = cfg.n_kv_heads;
  p.layer = layer;
  if (size_t(layer) < cfg.rope.size()) p.rope = cfg.rope[size_t(layer)];
  p.seed = cfg.seed;
  p.calib = cfg.calib;
  p.group_tokens = cfg.group_tokens;
  p.residual_tokens = cfg.residual_tokens;
  p.outlier_fraction = cfg.outlier_fraction;
  p.sink_tokens = cfg.sink_tokens;
  return p;
}

size_t kv_cache_page_bytes(const KvCacheConfig& cfg) { return KvCache(cfg).pool_page_bytes(); }

std::unique_ptr<PrefixIndex> kv_cache_prefix_index(const KvCache& c, const KvHashKey* key) {
  KVQ_CHECK(c.n_groups() >= 1 && c.group_window(0) == 0, "a prefix index needs page group 0 to be full attention");
  std::vector<int> windows;
  for (int g = 0; g < c.n_groups(); ++g) windows.push_back(c.group_window(g));
  return std::make_unique<PrefixIndex>(c.prefix_identity(), c.config().page_tokens, std::move(windows), key);
}

std::string KvCache::build_identity() const {
  // Everything a page's bytes depend on besides the token ids: the weights, the shapes, and for
  // each layer the codecs with every parameter they are built from. Floats print exactly
  // (shortest round-trip form).
  // The build: what a page's bytes are under a given codec name is kvq's to change between
  // versions (a persistent offload tier outlives the process).
  std::string s = fmt::format("kvq-kv-pages/1;build={};model={};layers={};kv_heads={};head_dim={};page_tokens={};"
                              "seed={:#x};group={};residual={};outliers={};sink={}",
                              KVQ_BUILD_ID, cfg_.model_id, cfg_.n_layer, cfg_.n_kv_heads, cfg_.head_dim,
                              cfg_.page_tokens, cfg_.seed, cfg_.group_tokens, cfg_.residual_tokens,
                              cfg_.outlier_fraction, cfg_.sink_tokens);
  if (cfg_.calib) {
    const std::string dump = cfg_.calib->dump();
    const KvHash h = kv_hash128(KvHashKey{1, 2, 3, 4}, dump.data(), dump.size());
    s += fmt::format(";calib={:016x}{:016x}", h.hi, h.lo);
  }
  if (groups_.size() > 1) {  // the page layout
    s += ";groups=";
    for (const Group& G : groups_) {
      s += fmt::format("w{}:", G.window);
      for (int il : G.layers) s += fmt::format("{}.", il);
    }
  }
  for (int il = 0; il < cfg_.n_layer; ++il) {
    const Layer& L = layers_[size_t(il)];
    const KvCodecInfo &ki = L.k->info(), &vi = L.v->info();
    // The token grouping each codec was built with (a codec name may carry its own, "@gN").
    s += fmt::format(";L{}={}/{},g={}:{}/{}:{}", il, ki.name, vi.name, ki.group_tokens, ki.residual_tokens,
                     vi.group_tokens, vi.residual_tokens);
    if (size_t(il) < cfg_.rope.size()) {
      const KvRope& r = cfg_.rope[size_t(il)];
      s += fmt::format(",rope={}:{}:{}:{}", r.n_rot, r.freq_base, r.freq_scale, r.neox ? 1 : 0);
      if (!r.freq_factors.empty()) s += fmt::format(":f{}", fmt::join(r.freq_factors, ","));
    }
  }
  return s;
}

std::string KvCache::prefix_identity() const { return identity_; }

int KvCache::group_first_page(const Group& G, int n) const {
  if (G.window == 0) return 0;
  // Past the window of every layer's next query, and packed by every layer (grouped codecs pack late).
  int bound = n + 1 - G.window;
  for (int il : G.layers) bound = std::min(bound, quantized(layers_[size_t(il)], n));
  return std::max(0, bound) / cfg_.page_tokens;
}

void KvCache::written_pages(const Group& G, int n, int* first, int* last) const {
  int w0 = n_tokens_ + n, w1 = 0;
  for (int il : G.layers) {
    const Layer& L = layers_[size_t(il)];
    w0 = std::min(w0, quantized(L, n_tokens_));
    w1 = std::max(w1, quantized(L, n_tokens_ + n));
  }
  const int P = cfg_.page_tokens;
  *first = w0 / P;
  *last = w1 > w0 ? (w1 + P - 1) / P : *first;
}

int KvCache::n_pages() const {
  int n = 0;
  for (const Group& G : groups_) {
    if (pool_) {
      for (KvPageId p : G.table) n += p != kv_page_none ? 1 : 0;
    } else {
      for (const auto& b : G.pages) n += b.size() ? 1 : 0;
    }
  }
  return n;
}

int KvCache::group_keep_tokens(const Group& G) const {
  // Tokens before a step's first that the group still holds: what its window reads, or what its
  // grouped codecs have not packed yet (their residual window and an unfilled token group).
  int keep = G.window - 1;
  for (int il : G.layers) {
    const Layer& L = layers_[size_t(il)];
    if (L.group > 1) keep = std::max(keep, L.residual + L.group - 1);
  }
  return keep;
}

size_t KvCache::pages_at(int n, int step) const {
  const int P = cfg_.page_tokens, end = pages_for(n);
  size_t total = 0;
  for (const Group& G : groups_) {
    if (G.window == 0) {
      total += size_t(end);
      continue;
    }
    // A run of `span` tokens, wherever it starts, touches at most ceil((span - 1) / P) + 1 pages:
    // an upper bound for any alignment of the steps, and one that grows with n.
    const int span = std::min(n, std::max(0, step) + group_keep_tokens(G));
    const int pages = span <= 0 ? 0 : (span - 1 + P - 1) / P + 1;
    total += size_t(std::min(end, pages));
  }
  return total;
}

size_t KvCache::prefix_pages_kept(int k, int n_prompt, int step) const {
  // Group 0 keeps every adopted page; a sliding group adopted pages [first(k * P), k) and keeps
  // those its window still reads when the prompt's last step starts.
  const int P = cfg_.page_tokens, last_start = std::max(0, n_prompt - std::max(0, step));
  size_t kept = 0;
  for (const Group& G : groups_) {
    if (G.window == 0) {
      kept += size_t(k);
      continue;
    }
    const int from = std::max(kv_window_first_page(k * P, G.window, P), group_first_page(G, last_start));
    kept += size_t(std::max(0, k - from));
  }
  return kept;
}

int KvCache::tokens_in_pages(size_t pages, int step) const {
  // pages_at grows with n, and is at least the positions' pages.
  int lo = 0, hi = int(std::min<size_t>(pages * size_t(cfg_.page_tokens), size_t(INT32_MAX) / 2));
  while (lo < hi) {
    const int mid = lo + (hi - lo + 1) / 2;
    if (pages_at(mid, std::min(step, mid)) <= pages) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

int KvCache::pages_needed(int n) const {
  if (!pool_) return 0;
  const int want = pages_for(n_tokens_ + n);
  int need = 0;
  for (const Group& G : groups_) {
    int first, last;
    written_pages(G, n, &first, &last);
    need += std::max(0, want - int(G.table.size()));
    for (int i = first; i < std::min(last, int(G.table.size())); ++i)
      if (G.table[size_t(i)] != kv_page_none && pool_->refcount(G.table[size_t(i)]) > 1) ++need;
  }
  return need;
}

size_t KvCache::admit_pages(const KvPrefixMatch& m, int n_prompt, int step) const {
  KVQ_CHECK(pool_, "admission needs a page pool");
  const int n = std::max(0, n_prompt), k = int(m.pages.size());
  const size_t total = pages_at(n, std::min(step, n - m.n_tokens()));
  const size_t kept = prefix_pages_kept(k, n, step);
  size_t need = total > kept ? total - kept : 0;
  // Adopting an idle page makes it used: it leaves the available count (until its sequence
  // drops it again behind the window).
  for (KvPageId p : m.pages)
    if (pool_->is_idle(p)) ++need;
  for (const auto& w : m.window_pages)
    for (KvPageId p : w)
      if (p != kv_page_none && pool_->is_idle(p)) ++need;
  return need;
}

const uint8_t* KvCache::layer_page(const Layer& L, int page) const {
  const Group& G = groups_[size_t(L.pgroup)];
  KVQ_CHECK(page >= G.freed, "page {} of a sliding-window group was freed (pages below {} are)", page, G.freed);
  if (pool_) return pool_->data(G.table[size_t(page)]);
  return G.pages[size_t(page)].data();
}

void KvCache::free_window_pages() {
  // A sequence that publishes to a prefix index keeps its full pages until they are published, so
  // that the cached prefix has the sliding pages too (a step longer than the window would free
  // them before publish_pages sees them).
  const int published = pool_ && shareable_ && hashed_by_ ? int(hashes_.size()) : INT32_MAX;
  for (Group& G : groups_) {
    if (G.window == 0) continue;
    const int size = pool_ ? int(G.table.size()) : int(G.pages.size());
    const int below = std::min({size, group_first_page(G, n_tokens_), published});
    for (; G.freed < below; ++G.freed) {
      if (pool_) {
        const KvPageId p = std::exchange(G.table[size_t(G.freed)], kv_page_none);
        if (p != kv_page_none) pool_->unref(p);  // none: a place an adopted prefix left empty
      } else {
        G.spare.push_back(std::exchange(G.pages[size_t(G.freed)], AlignedBuf<uint8_t>()));
      }
    }
  }
}

size_t KvCache::bytes_pages() const {
  if (pool_) return size_t(n_pages()) * pool_->page_bytes();
  size_t b = 0;
  for (const Group& G : groups_) {
    size_t held = G.spare.size();
    for (const auto& pg : G.pages) held += pg.size() ? 1 : 0;
    b += held * G.bytes;
  }
  return b;
}

void KvCache::prepare_step(int n) {
  const size_t want = size_t(pages_for(n_tokens_ + n));
  if (!pool_) {
    for (Group& G : groups_) {
      while (G.pages.size() < want) {
        if (G.spare.empty()) {
          G.pages.emplace_back(G.bytes);  // zeroed
        } else {
          G.pages.push_back(std::exchange(G.spare.back(), AlignedBuf<uint8_t>()));
          G.spare.pop_back();
          std::memset(G.pages.back().data(), 0, G.bytes);  // as a new page
        }
      }
    }
    return;
  }
  const int need = pages_needed(n);
  if (size_t(need) > pool_->n_available()) throw KvPoolFull(size_t(need), pool_->n_available());
  const size_t pb = pool_->page_bytes();
  for (Group& G : groups_) {
    int first, last;
    written_pages(G, n, &first, &last);
    // Cached pages are full and final: a step never writes below the published prefix.
    KVQ_CHECK(first >= int(hashes_.size()) || first >= last, "step writes page {} of a cached prefix of {} pages", first,
              hashes_.size());
    for (int i = first; i < std::min(last, int(G.table.size())); ++i) {
      const KvPageId old = G.table[size_t(i)];
      KVQ_CHECK(old != kv_page_none, "step writes page {} freed behind the window", i);
      if (pool_->refcount(old) <= 1) continue;
      // Copy-on-write: another sequence (a fork) holds this partial page; its tokens stay as
      // they are, ours continue in a private copy.
      const KvPageId cp = pool_->alloc();
      KVQ_CHECK(cp != kv_page_none, "pool ran out after reporting {} available pages", need);
      std::memcpy(pool_->data(cp), pool_->data(old), pb);
      pool_->unref(old);
      G.table[size_t(i)] = cp;
    }
    while (G.table.size() < want) {
      const KvPageId p = pool_->alloc();
      KVQ_CHECK(p != kv_page_none, "pool ran out after reporting {} available pages", need);
      G.table.push_back(p);
    }
  }
}

void KvCache::append(int layer, int n, const float* k_pre, const float* k, const float* v) {
  Layer& L = layers_[size_t(layer)];
  KVQ_CHECK(L.pending == 0, "layer {} appended twice in one step", layer);
  const int n0 = n_tokens_;
  if (n0 + n > cfg_.max_tokens) fail("KV cache full: {} + {} tokens exceed the capacity of {}", n0, n, cfg_.max_tokens);
  if (!step_open_) {
    // The first layer of a step gets every page the whole step needs (all layers share the
    // pages), so running out of pool pages happens here, before any layer changed.
    prepare_step(n);
    step_open_ = true;
    step_n_ = n;
  }
  KVQ_CHECK(n == step_n_, "layer {} appends {} tokens in a step of {}", layer, n, step_n_);
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
    uint8_t* pg = layer_page(L, page);
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

size_t KvCache::attend_part_floats(int n_q) const {
  size_t m = 0;
  for (const auto& L : layers_) m = std::max(m, attn_part_floats(*L.v, n_q));
  return m;
}

// What attention reads for positions [start, end): the packed part [start, packed_end) as spans
// of head `head`'s blocks, and (grouped codecs) the tail from max(start, packed_end) on.
KvCache::Reads KvCache::reads(const Layer& L, int head, int start, int end, std::vector<KvBlockSpan>& spans) const {
  const int P = cfg_.page_tokens;
  const int packed_end = quantized(L, end);
  spans.clear();
  for (int t = start; t < packed_end;) {
    const int page = t / P, slot = t % P;
    const int run = std::min(packed_end - t, P - slot);
    const uint8_t* pg = layer_page(L, page);
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
  Reads r;
  if (L.group > 1) {
    const int tail_from = std::max(start, packed_end);
    r.n_tail = end - tail_from;
    KVQ_CHECK(tail_from >= L.tail_start, "tail row {} already dropped (tail starts at {})", tail_from, L.tail_start);
    r.tk = L.tail_k[size_t(head)].data() + size_t(tail_from - L.tail_start) * size_t(cfg_.head_dim);
    r.tv = L.tail_v[size_t(head)].data() + size_t(tail_from - L.tail_start) * size_t(cfg_.head_dim);
  }
  return r;
}

namespace {
// The attention parameters of KV head `head`'s n_q query heads: its share of the layer's sinks.
AttnParams head_params(const AttnParams& ap, int head, int n_q) {
  AttnParams a = ap;
  if (a.sinks) a.sinks += size_t(head) * size_t(n_q);
  return a;
}
}  // namespace

void KvCache::attend_head(int layer, int head, int pos, const float* q, int n_q, const AttnParams& ap,
                          int window, float* out, float* scratch, std::vector<KvBlockSpan>& spans) const {
  const Layer& L = layers_[size_t(layer)];
  KVQ_CHECK(pos < n_tokens_ + L.pending, "query position {} beyond the appended tokens", pos);
  const int end = pos + 1;
  const Reads rd = reads(L, head, end - visible_tokens(pos, window), end, spans);
  attn_decode(*L.k, *L.v, head, q, n_q, spans.data(), int(spans.size()), rd.tk, rd.tv, size_t(cfg_.head_dim),
              rd.n_tail, head_params(ap, head, n_q), out, scratch);
}

void KvCache::attend_head_part(int layer, int head, int pos, const float* q, int n_q, const AttnParams& ap,
                               int window, int from, int to, float* part, float* scratch,
                               std::vector<KvBlockSpan>& spans) const {
  const Layer& L = layers_[size_t(layer)];
  KVQ_CHECK(pos < n_tokens_ + L.pending, "query position {} beyond the appended tokens", pos);
  const int end = pos + 1;
  KVQ_CHECK(0 <= from && from <= to && to <= visible_tokens(pos, window), "part [{}, {}) outside the {} tokens seen",
            from, to, visible_tokens(pos, window));
  const Reads rd = reads(L, head, end - visible_tokens(pos, window), end, spans);
  // Spans [i0, i1): those whose first token's offset lies in [from, to); the tail's first offset
  // is visible - n_tail.
  size_t i0 = 0, i1 = 0;
  int off = 0;
  for (; i0 < spans.size() && off < from; ++i0) off += spans[i0].n;
  for (i1 = i0; i1 < spans.size() && off < to; ++i1) off += spans[i1].n;
  const int tail_off = visible_tokens(pos, window) - rd.n_tail;
  const bool tail = rd.n_tail > 0 && from <= tail_off && tail_off < to;
  attn_decode_part(*L.k, *L.v, head, q, n_q, spans.data() + i0, int(i1 - i0), tail ? rd.tk : nullptr,
                   tail ? rd.tv : nullptr, size_t(cfg_.head_dim), tail ? rd.n_tail : 0, ap, part, scratch);
}

void KvCache::attend_rows(int layer, int head, int pos, int n_rows, const float* q, int n_q, const AttnParams& ap,
                          int window, float* out, float* scratch, std::vector<KvBlockSpan>& spans) const {
  const Layer& L = layers_[size_t(layer)];
  KVQ_CHECK(pos + n_rows <= n_tokens_ + L.pending, "query rows {}..{} beyond the appended tokens", pos, pos + n_rows - 1);
  const int hd = cfg_.head_dim;
  const size_t row_floats = size_t(n_q) * size_t(hd);
  auto first_visible = [&](int end) { return window > 0 ? std::max(0, end - window) : 0; };
  std::vector<int> limit;
  for (int r = 0; r < n_rows;) {
    // Rows r..r1-1 see the same blocks: the same first position, and (grouped codecs) the same
    // packed end, so that no token is packed for one row and in the tail for another.
    const int start = first_visible(pos + r + 1), pe0 = quantized(L, pos + r + 1);
    int r1 = r + 1;
    while (r1 < n_rows && first_visible(pos + r1 + 1) == start && (L.group == 1 || quantized(L, pos + r1 + 1) == pe0)) ++r1;
    const int end = pos + r1;
    const Reads rd = reads(L, head, start, end, spans);
    limit.clear();
    for (int x = r; x < r1; ++x) {
      const int e = pos + x + 1, pe = quantized(L, e);  // row x: packed [start, pe), tail [max(start, pe), e)
      limit.push_back(std::max(0, pe - start) + (e - std::max(start, pe)));
    }
    attn_prefill(*L.k, *L.v, head, q + size_t(r) * row_floats, n_q, r1 - r, limit.data(), spans.data(),
                 int(spans.size()), rd.tk, rd.tv, size_t(hd), rd.n_tail, head_params(ap, head, n_q),
                 out + size_t(r) * row_floats, scratch);
    r = r1;
  }
}

bool KvCache::step_keeps_any(int n) const {
  for (const auto& L : layers_)
    if (L.group > 1 && quantized(L, n_tokens_ + n) != quantized(L, n_tokens_)) return false;
  return true;
}

void KvCache::commit(int n, int keep) {
  if (keep < 0) keep = n;
  KVQ_CHECK(keep <= n, "commit({}) keeps {}", n, keep);
  const int n1 = n_tokens_ + keep;
  for (auto& L : layers_) {
    KVQ_CHECK(L.pending == n, "commit({}) but layer appended {}", n, L.pending);
    L.pending = 0;
    if (L.group > 1) {
      if (keep < n) {
        // the dropped tokens are the tails' last rows; nothing of theirs was packed
        KVQ_CHECK(quantized(L, n_tokens_ + n) == quantized(L, n1), "commit({}) keeping {}: the step packed a group", n, keep);
        const size_t cut = size_t(n - keep) * size_t(cfg_.head_dim);
        for (auto* tails : {&L.tail_k, &L.tail_v, &L.tail_k_pre})
          for (auto& tl : *tails)
            if (!tl.empty()) tl.resize(tl.size() - cut);
      }
      const int q1 = quantized(L, n1);
      const size_t drop = size_t(q1 - L.tail_start) * size_t(cfg_.head_dim);
      for (auto* tails : {&L.tail_k, &L.tail_v, &L.tail_k_pre})
        for (auto& tl : *tails) tl.erase(tl.begin(), tl.begin() + std::ptrdiff_t(drop));
      L.tail_start = q1;
    }
  }
  n_tokens_ = n1;
  step_open_ = false;
  step_n_ = 0;
  if (keep < n) {  // pages the step added for dropped tokens only
    const size_t want = size_t(pages_for(n1));
    for (Group& G : groups_) {
      if (pool_) {
        while (G.table.size() > want && G.table.size() > size_t(G.freed)) {
          if (G.table.back() != kv_page_none) pool_->unref(G.table.back());
          G.table.pop_back();
        }
      } else {
        while (G.pages.size() > want && G.pages.size() > size_t(G.freed)) G.pages.pop_back();  // freed
      }
    }
  }
  free_window_pages();
}

void KvCache::clear() { release(); }

void KvCache::unref_pages() {
  // Last position first and, at each position, sliding groups before group 0: a cached chain's
  // deepest pages become the least recently used, and a sliding group's page goes idle before the
  // group-0 page of its position (PrefixIndex evicts in that order).
  int n = 0;
  for (const Group& G : groups_) n = std::max(n, int(G.table.size()));
  for (int i = n; i-- > 0;)
    for (size_t g = groups_.size(); g-- > 0;) {
      const std::vector<KvPageId>& t = groups_[g].table;
      if (i < int(t.size()) && t[size_t(i)] != kv_page_none) pool_->unref(t[size_t(i)]);
    }
  for (Group& G : groups_) {
    G.table.clear();
    G.freed = 0;
  }
}

void KvCache::release() {
  if (pool_) {
    unref_pages();
  } else {
    for (Group& G : groups_) {
      G.pages.clear();
      G.spare.clear();
      G.freed = 0;
    }
  }
  reset_tokens();
}

void KvCache::reset_tokens() {
  n_tokens_ = 0;
  step_open_ = false;
  step_n_ = 0;
  hashes_.clear();
  hashed_by_ = nullptr;
  for (auto& L : layers_) {
    L.pending = 0;
    L.tail_start = 0;
    for (auto* tails : {&L.tail_k, &L.tail_v, &L.tail_k_pre})
      for (auto& tl : *tails) tl.clear();
  }
}

void KvCache::fork_from(const KvCache& src) {
  KVQ_CHECK(&src != this, "fork of a cache into itself");
  KVQ_CHECK(n_tokens_ == 0 && n_pages() == 0 && !step_open_, "fork into a cache that holds {} tokens", n_tokens_);
  KVQ_CHECK(!src.step_open_, "fork of a cache in the middle of a step");
  KVQ_CHECK(src.pool_ == pool_, "fork between caches of different page pools");
  KVQ_CHECK(src.identity_ == identity_, "fork between caches of different configurations");
  KVQ_CHECK(src.cfg_.window == cfg_.window, "fork between caches of different sliding windows");
  for (size_t g = 0; g < groups_.size(); ++g) {
    Group& G = groups_[g];
    const Group& S = src.groups_[g];
    if (pool_) {
      for (KvPageId p : S.table)
        if (p != kv_page_none) pool_->ref(p);
      G.table = S.table;
    } else {
      G.pages.clear();
      for (const auto& pg : S.pages) {  // freed ones stay empty
        G.pages.emplace_back(pg.size());
        if (pg.size()) std::memcpy(G.pages.back().data(), pg.data(), pg.size());
      }
    }
    G.freed = S.freed;
  }
  for (size_t il = 0; il < layers_.size(); ++il) {
    Layer& L = layers_[il];
    const Layer& S = src.layers_[il];
    L.tail_k = S.tail_k;
    L.tail_v = S.tail_v;
    L.tail_k_pre = S.tail_k_pre;
    L.tail_start = S.tail_start;
  }
  n_tokens_ = src.n_tokens_;
  hashes_ = src.hashes_;
  hashed_by_ = src.hashed_by_;
}

void KvCache::take_match(const KvPrefixMatch& m) {
  KVQ_CHECK(m.window_pages.size() + 1 == groups_.size(), "prefix match of {} page groups for a cache of {}",
            m.window_pages.size() + 1, groups_.size());
  for (size_t g = 0; g < groups_.size(); ++g) {
    Group& G = groups_[g];
    const std::vector<KvPageId>& pages = g == 0 ? m.pages : m.window_pages[g - 1];
    KVQ_CHECK(pages.size() == m.pages.size(), "prefix match with {} pages in group {}, {} in group 0", pages.size(), g,
              m.pages.size());
    for (KvPageId p : pages)
      if (p != kv_page_none) pool_->ref(p);
    G.table.insert(G.table.end(), pages.begin(), pages.end());
  }
  hashes_.insert(hashes_.end(), m.hashes.begin(), m.hashes.end());
  n_tokens_ += m.n_tokens();
  for (auto& L : layers_) {
    KVQ_CHECK(quantized(L, n_tokens_) == n_tokens_, "adopted prefix of {} tokens leaves a tail", n_tokens_);
    L.tail_start = n_tokens_;
  }
  // The places the windows no longer read: none in the match, or our own pages before it.
  free_window_pages();
}

int KvCache::adopt_prefix(PrefixIndex& index, const int32_t* tokens, int n_prompt, int max_tokens, bool readmission) {
  KVQ_CHECK(pool_, "adopting a cached prefix needs a page pool");
  KVQ_CHECK(n_tokens_ == 0 && n_pages() == 0 && !step_open_, "adopting a prefix into a cache that holds {} tokens", n_tokens_);
  KVQ_CHECK(index.identity() == identity_, "prefix index of another configuration");
  KVQ_CHECK(index.page_tokens() == cfg_.page_tokens, "prefix index pages of {} tokens, cache pages of {}",
            index.page_tokens(), cfg_.page_tokens);
  KVQ_CHECK(index.n_groups() == n_groups(), "prefix index of {} page groups, cache of {}", index.n_groups(), n_groups());
  const int cap = std::min({max_tokens, n_prompt, cfg_.max_tokens});
  readmission_ = readmission;
  if (shareable_) publish_to(index);
  if (!shareable_ || cap < cfg_.page_tokens) {
    index.count_query(n_prompt, 0, readmission);
    return 0;
  }
  const KvPrefixMatch m = index.lookup(tokens, cap);
  take_match(m);
  index.count_query(n_prompt, n_tokens_, readmission);
  return n_tokens_;
}

void KvCache::publish_to(const PrefixIndex& index) {
  if (hashed_by_ == &index) return;
  hashes_.clear();  // chain hashes are per index (its keys)
  hashed_by_ = &index;
}

bool KvCache::prefix_extendable() const {
  return pool_ && shareable_ && !step_open_ && n_tokens_ == int(hashes_.size()) * cfg_.page_tokens &&
         groups_[0].table.size() == hashes_.size();
}

int KvCache::extend_prefix(PrefixIndex& index, const int32_t* tokens, int n_prompt, int max_tokens) {
  KVQ_CHECK(pool_, "extending a cached prefix needs a page pool");
  KVQ_CHECK(index.identity() == identity_, "prefix index of another configuration");
  if (!prefix_extendable() || (hashed_by_ != nullptr && hashed_by_ != &index)) return 0;
  const int P = cfg_.page_tokens;
  const int cap = std::min({max_tokens, n_prompt, cfg_.max_tokens});
  if (cap - n_tokens_ < P) return 0;
  const KvHash parent = hashes_.empty() ? index.root() : hashes_.back();
  const int have = n_tokens_ / P;
  for (const Group& G : groups_)  // every group's places up to the prefix (freed or held)
    KVQ_CHECK(int(G.table.size()) == have, "page group holds {} places for a prefix of {} pages", G.table.size(), have);
  const KvPrefixMatch m = index.lookup_after(parent, tokens + n_tokens_, cap - n_tokens_, have);
  if (m.pages.empty()) return 0;
  hashed_by_ = &index;
  take_match(m);
  index.count_extra_hits(m.n_tokens(), readmission_);
  return m.n_tokens();
}

int KvCache::publish_pages(PrefixIndex& index, const int32_t* tokens, int n) {
  KVQ_CHECK(pool_, "publishing pages needs a page pool");
  KVQ_CHECK(n == n_tokens_ && !step_open_, "publish of {} tokens, the cache holds {}", n, n_tokens_);
  KVQ_CHECK(index.identity() == identity_, "prefix index of another configuration");
  KVQ_CHECK(index.n_groups() == n_groups(), "prefix index of {} page groups, cache of {}", index.n_groups(), n_groups());
  if (!shareable_) return 0;
  publish_to(index);
  int packed = n_tokens_;
  for (const auto& L : layers_) packed = std::min(packed, quantized(L, n_tokens_));
  const int full = packed / cfg_.page_tokens;
  int inserted = 0;
  std::vector<KvPageId> pages(groups_.size());
  for (int i = int(hashes_.size()); i < full; ++i) {
    const KvHash parent = i > 0 ? hashes_[size_t(i - 1)] : index.root();
    const int32_t* t = tokens + size_t(i) * size_t(cfg_.page_tokens);
    KvHash h;
    for (size_t g = 0; g < groups_.size(); ++g) {
      const auto& tb = groups_[g].table;
      pages[g] = i < int(tb.size()) ? tb[size_t(i)] : kv_page_none;
      // A page already cached (shared with a fork that published it, or adopted) is not offered.
      if (g > 0 && pages[g] != kv_page_none && index.contains_page(pages[g])) pages[g] = kv_page_none;
    }
    if (index.contains_page(pages[0])) {
      // Shared with a fork that published it already.
      h = index.page_hash(parent, t);
    } else if (index.insert(parent, t, pages, &h) == PrefixIndex::Insert::inserted) {
      ++inserted;
    }
    hashes_.push_back(h);
  }
  free_window_pages();  // what the windows left behind, now cached
  return inserted;
}

size_t KvCache::tail_row_bytes(const Layer& L) const {
  return size_t(cfg_.n_kv_heads) * size_t(cfg_.head_dim) * sizeof(float) * (L.pre_rope ? 3 : 2);
}

double KvCache::bytes_per_token_at(int n) const {
  KVQ_CHECK(n > 0, "{} tokens", n);
  double b = 0;
  for (int il = 0; il < int(layers_.size()); ++il) {
    const Layer& L = layers_[size_t(il)];
    const int packed = quantized(L, n);
    b += double(layer_page_bytes(il)) / cfg_.page_tokens * packed + double(tail_row_bytes(L)) * (n - packed);
  }
  return b / n;
}

double KvCache::decode_read_bytes(int pos) const {
  double b = 0;
  for (int il = 0; il < int(layers_.size()); ++il) {
    const Layer& L = layers_[size_t(il)];
    const int w = size_t(il) < cfg_.window.size() ? cfg_.window[size_t(il)] : 0;
    const int end = pos + 1, start = w > 0 ? std::max(0, end - w) : 0, packed_end = quantized(L, end);
    const int packed = std::max(0, packed_end - start), tail = end - std::max(start, packed_end);
    b += double(layer_page_bytes(il)) / cfg_.page_tokens * packed +
         double(tail) * double(cfg_.n_kv_heads) * double(cfg_.head_dim) * 2.0 * sizeof(float);
  }
  return b;
}

size_t KvCache::max_tail_bytes() const {
  size_t b = 0;
  for (const auto& L : layers_)
    if (L.group > 1 || L.residual > 0) b += tail_row_bytes(L) * size_t(L.residual + L.group - 1);
  return b;
}

size_t KvCache::bytes_tail() const {
  size_t b = 0;
  for (const auto& L : layers_)
    for (const auto* tails : {&L.tail_k, &L.tail_v, &L.tail_k_pre})
      for (const auto& tl : *tails) b += tl.capacity() * sizeof(float);
  return b;
}

}  // namespace kvq
