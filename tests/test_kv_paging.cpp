// KvCache over a shared PagePool: block tables, pool exhaustion, copy-on-write for forks,
// adopting cached prefixes, exact page accounting. Synthetic K/V (a function of token id and
// position, so any two sequences with the same tokens hold the same rows) drive the cache
// directly; then the real stories260K model checks that a sequence adopting a prefix computed
// by another sequence gives exactly the logits of the same sequence computed from scratch.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>

#include "cache/kv_cache.h"
#include "cache/page_pool.h"
#include "cache/prefix_index.h"
#include "core/error.h"
#include "kv/policy.h"
#include "model/model.h"
#include "model/tokenizer.h"

using namespace kvq;
namespace fs = std::filesystem;

namespace {

constexpr int P = 16;
constexpr int n_q = 2;  // queries per KV head (GQA group)

KvCacheConfig synth_cfg(const std::string& format, int residual = -1) {
  KvCacheConfig c;
  c.n_layer = 2;
  c.n_kv_heads = 2;
  c.head_dim = 64;
  c.page_tokens = P;
  c.max_tokens = 512;
  c.policy = kv_policy_uniform(format, c.n_layer);
  c.rope.assign(2, KvRope{64, 10000.f, 1.f, false});
  c.group_tokens = P;  // grouped codecs: one group per page (KIVI default 32 does not divide P = 16)
  c.residual_tokens = residual;
  c.model_id = "synthetic";
  return c;
}

// K/V rows of a token at a position, per layer: (n_kv_heads, head_dim), with an outlier channel.
void kv_row(int32_t token, int pos, int layer, int width, float* k, float* v) {
  std::mt19937 rng(uint32_t(token) * 2654435761u ^ uint32_t(pos) * 40503u ^ uint32_t(layer) * 97u);
  std::normal_distribution<float> nd(0.f, 1.f);
  for (int i = 0; i < width; ++i) {
    k[i] = nd(rng) * (i % 64 == 5 ? 20.f : 1.f);
    v[i] = nd(rng);
  }
}

// One step: appends tokens (n,) at the cache's current length to every layer, runs attention
// for every new position and head with queries derived from the position, commits. Returns
// the attention outputs (layer, token, head, n_q, head_dim) in order.
std::vector<float> step(KvCache& c, const int32_t* tokens, int n, const std::vector<int>& windows = {}) {
  const KvCacheConfig& cfg = c.config();
  const int w = cfg.n_kv_heads * cfg.head_dim, hd = cfg.head_dim;
  const int pos0 = c.n_tokens();
  std::vector<float> k(size_t(n) * size_t(w)), v(k.size()), q(size_t(n_q) * size_t(hd));
  std::vector<float> out_all, out(q.size()), scratch(c.attend_scratch_floats(n_q));
  std::vector<KvBlockSpan> spans;
  AttnParams ap;
  ap.scale = 1.0f / 8.0f;
  for (int il = 0; il < cfg.n_layer; ++il) {
    for (int t = 0; t < n; ++t)
      kv_row(tokens[t], pos0 + t, il, w, k.data() + size_t(t) * size_t(w), v.data() + size_t(t) * size_t(w));
    c.append(il, n, k.data(), k.data(), v.data());
    for (int t = 0; t < n; ++t)
      for (int h = 0; h < cfg.n_kv_heads; ++h) {
        std::mt19937 rng(uint32_t(pos0 + t) * 31u + uint32_t(h) * 7u + uint32_t(il));
        std::normal_distribution<float> nd(0.f, 1.f);
        for (auto& x : q) x = nd(rng);
        const int window = size_t(il) < windows.size() ? windows[size_t(il)] : 0;
        c.attend_head(il, h, pos0 + t, q.data(), n_q, ap, window, out.data(), scratch.data(), spans);
        out_all.insert(out_all.end(), out.begin(), out.end());
      }
  }
  c.commit(n);
  return out_all;
}

// Feeds tokens in the given chunk sizes; returns all attention outputs.
std::vector<float> feed(KvCache& c, const std::vector<int32_t>& tokens, int from, const std::vector<int>& chunks,
                        const std::vector<int>& windows = {}) {
  std::vector<float> all;
  int at = from;
  for (int n : chunks) {
    auto o = step(c, tokens.data() + at, n, windows);
    all.insert(all.end(), o.begin(), o.end());
    at += n;
  }
  return all;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

std::vector<int32_t> tokens(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = int32_t(rng() % 1000);
  return t;
}

void expect_pool_consistent(const PagePool& pool) {
  EXPECT_EQ(pool.n_free() + pool.n_idle() + pool.n_used(), pool.n_pages());
}

const KvHashKey test_key{1, 2, 3, 4};

}  // namespace

// ------------------------------------------------------------------ synthetic

class PagedFormat : public ::testing::TestWithParam<std::string> {};

TEST_P(PagedFormat, PoolBackedCacheEqualsPrivateCache) {
  const KvCacheConfig cfg = synth_cfg(GetParam());
  PagePool pool(64, kv_cache_page_bytes(cfg), P);
  const auto t = tokens(90, 1);
  const std::vector<int> chunks = {20, 1, 30, 13, 1, 25};
  KvCache priv(cfg), paged(cfg, &pool);
  const auto a = feed(priv, t, 0, chunks);
  const auto b = feed(paged, t, 0, chunks);
  EXPECT_TRUE(same_bits(a, b));
  EXPECT_EQ(paged.n_pages(), 6);  // 90 tokens in pages of 16
  EXPECT_EQ(pool.n_used(), 6u);
  EXPECT_EQ(paged.bytes_pages(), priv.bytes_pages());
  // A page is handed out zeroed even when recycled: fill every free page with garbage, then
  // run again; private pages start zeroed, pool pages must behave the same.
  paged.release();
  EXPECT_EQ(pool.n_free(), pool.n_pages());
  for (int i = 0; i < int(pool.n_pages()); ++i) {
    KvPageId p = pool.alloc();
    std::memset(pool.data(p), 0xcd, pool.page_bytes());
  }
  for (int i = 0; i < int(pool.n_pages()); ++i) pool.unref(i);
  EXPECT_TRUE(same_bits(feed(paged, t, 0, chunks), a));
}

INSTANTIATE_TEST_SUITE_P(Formats, PagedFormat, ::testing::Values("f16", "int8", "q4_0", "kivi2", "kvquant4", "tq3"));

TEST(KvPaging, SameBudgetHoldsMoreTokensWithSmallerPages) {
  const size_t budget = size_t(8) << 20;
  const size_t b16 = kv_cache_page_bytes(synth_cfg("f16"));
  const size_t b4 = kv_cache_page_bytes(synth_cfg("q4_0"));
  auto p16 = PagePool::from_bytes(budget, b16, P);
  auto p4 = PagePool::from_bytes(budget, b4, P);
  EXPECT_EQ(p16->n_pages(), budget / ((b16 + 63) / 64 * 64));
  EXPECT_EQ(p4->tokens_capacity(), p4->n_pages() * size_t(P));
  // q4_0: 4.5 bits per element against 16.
  const double ratio = double(p4->tokens_capacity()) / double(p16->tokens_capacity());
  EXPECT_GT(ratio, 3.4);
  EXPECT_LT(ratio, 3.7);
}

TEST(KvPaging, PoolMustMatchTheCachePages) {
  const KvCacheConfig cfg = synth_cfg("f16");
  PagePool wrong_bytes(4, kv_cache_page_bytes(cfg) / 2, P);
  EXPECT_THROW(KvCache(cfg, &wrong_bytes), Error);
  PagePool wrong_tokens(4, kv_cache_page_bytes(cfg), 32);
  EXPECT_THROW(KvCache(cfg, &wrong_tokens), Error);
}

TEST(KvPaging, PoolFullLeavesTheSequenceUnchanged) {
  const KvCacheConfig cfg = synth_cfg("int8");
  PagePool pool(3, kv_cache_page_bytes(cfg), P);
  const auto t = tokens(64, 2);
  KvCache a(cfg, &pool), b(cfg, &pool), ref(cfg);
  std::vector<float> out_a = feed(a, t, 0, {40});
  EXPECT_EQ(pool.n_used(), 3u);
  EXPECT_EQ(a.pages_needed(8), 0);
  EXPECT_EQ(a.pages_needed(9), 1);
  EXPECT_EQ(b.pages_needed(1), 1);

  const auto table = a.block_table();
  try {
    step(a, t.data() + 40, 10);
    FAIL() << "expected KvPoolFull";
  } catch (const KvPoolFull& e) {
    EXPECT_EQ(e.pages_needed, 1u);
    EXPECT_EQ(e.pages_available, 0u);
  }
  EXPECT_EQ(a.n_tokens(), 40);
  EXPECT_EQ(a.block_table(), table);
  EXPECT_EQ(pool.n_used(), 3u);
  EXPECT_THROW(step(b, t.data(), 1), KvPoolFull);
  EXPECT_EQ(b.n_tokens(), 0);
  EXPECT_EQ(b.n_pages(), 0);
  expect_pool_consistent(pool);

  // The failed step left a consistent sequence: it continues as if nothing happened.
  auto more = feed(a, t, 40, {8});
  out_a.insert(out_a.end(), more.begin(), more.end());
  EXPECT_TRUE(same_bits(out_a, feed(ref, t, 0, {40, 8})));

  // Preemption: release a, and b fits.
  a.release();
  EXPECT_EQ(pool.n_free(), 3u);
  EXPECT_NO_THROW(feed(b, t, 0, {33}));
  EXPECT_EQ(pool.n_used(), 3u);
  b.release();
  EXPECT_EQ(pool.n_free(), 3u);
}

TEST(KvPaging, ForkSharesPagesAndCopiesOnWrite) {
  for (bool use_pool : {true, false}) {
    SCOPED_TRACE(use_pool ? "pool" : "private");
    const KvCacheConfig cfg = synth_cfg("int8");
    PagePool pool(16, kv_cache_page_bytes(cfg), P);
    PagePool* pp = use_pool ? &pool : nullptr;
    const auto common = tokens(20, 3);  // page 0 full, page 1 holds 4 tokens
    auto x = common, y = common;
    const auto tx = tokens(12, 4), ty = tokens(12, 5);
    x.insert(x.end(), tx.begin(), tx.end());
    y.insert(y.end(), ty.begin(), ty.end());

    KvCache a(cfg, pp), b(cfg, pp);
    std::vector<float> oa = feed(a, x, 0, {20});
    std::vector<float> ob;
    b.fork_from(a);
    EXPECT_EQ(b.n_tokens(), 20);
    if (use_pool) {
      EXPECT_EQ(b.block_table(), a.block_table());
      EXPECT_EQ(pool.n_used(), 2u);
      EXPECT_EQ(pool.refcount(a.block_table()[1]), 2);
      EXPECT_EQ(a.pages_needed(1), 1);  // the shared partial page must be copied
    }
    // Interleaved steps: without copy-on-write, b's rows would land in a's page 1 (and the
    // other way round) and the second steps would read the other sequence's tokens.
    auto s = feed(a, x, 20, {5});
    oa.insert(oa.end(), s.begin(), s.end());
    s = feed(b, y, 20, {5});
    ob.insert(ob.end(), s.begin(), s.end());
    s = feed(a, x, 25, {7});
    oa.insert(oa.end(), s.begin(), s.end());
    s = feed(b, y, 25, {7});
    ob.insert(ob.end(), s.begin(), s.end());
    if (use_pool) {
      EXPECT_EQ(a.block_table()[0], b.block_table()[0]);  // full page still shared
      EXPECT_NE(a.block_table()[1], b.block_table()[1]);
      EXPECT_EQ(pool.refcount(a.block_table()[0]), 2);
      EXPECT_EQ(pool.refcount(a.block_table()[1]), 1);
      EXPECT_EQ(pool.n_used(), 3u);
    }
    KvCache ra(cfg), rb(cfg);
    // The fork's own steps produced only the tokens after the fork: compare those.
    auto ref_a = feed(ra, x, 0, {20, 5, 7});
    auto ref_b = feed(rb, y, 0, {20});
    auto ref_b_tail = feed(rb, y, 20, {5, 7});
    EXPECT_TRUE(same_bits(oa, ref_a));
    EXPECT_TRUE(same_bits(ob, ref_b_tail));
    a.release();
    b.release();
    EXPECT_EQ(pool.n_free(), pool.n_pages());
  }
}

class AdoptFormat : public ::testing::TestWithParam<std::pair<std::string, int>> {};

TEST_P(AdoptFormat, AdoptedPrefixEqualsComputingItAgain) {
  const auto& [format, residual] = GetParam();
  const KvCacheConfig cfg = synth_cfg(format, residual);
  PagePool pool(12, kv_cache_page_bytes(cfg), P);
  KvCache a(cfg, &pool), b(cfg, &pool), c(cfg, &pool), ref(cfg);
  ASSERT_TRUE(a.prefix_shareable());
  PrefixIndex index(a.prefix_identity(), P, test_key);
  pool.set_evictor(&index);

  const auto ta = tokens(45, 6);
  auto tb = std::vector<int32_t>(ta.begin(), ta.begin() + 37);
  const auto extra = tokens(13, 7);
  tb.insert(tb.end(), extra.begin(), extra.end());  // 50 tokens, 37 shared with a

  feed(a, ta, 0, {32, 13});
  EXPECT_EQ(a.publish_pages(index, ta.data(), a.n_tokens()), 2);
  EXPECT_EQ(a.publish_pages(index, ta.data(), a.n_tokens()), 0);  // nothing new
  EXPECT_EQ(index.n_entries(), 2u);

  // b adopts a's two full pages (the shared third page is partial in a: not cached). Admission
  // arithmetic: b's prompt takes exactly admit_pages out of the available pages.
  const size_t avail0 = pool.n_available();
  const size_t admit_b = b.admit_pages(index.lookup(tb.data(), int(tb.size()) - 1), int(tb.size()));
  EXPECT_EQ(admit_b, 2u);  // pages 2 and 3 of 50 tokens; pages 0 and 1 are a's, in use
  EXPECT_EQ(b.adopt_prefix(index, tb.data(), int(tb.size()), int(tb.size()) - 1), 32);
  EXPECT_EQ(b.n_tokens(), 32);
  EXPECT_EQ(b.block_table(), std::vector<KvPageId>(a.block_table().begin(), a.block_table().begin() + 2));
  EXPECT_EQ(pool.refcount(a.block_table()[0]), 2);
  EXPECT_EQ(pool.n_used(), 3u);  // a's 3 pages; b holds no page of its own yet
  const auto ob = feed(b, tb, 32, {18});
  EXPECT_EQ(pool.n_used(), 5u);  // + b's pages 2 and 3
  EXPECT_EQ(avail0 - pool.n_available(), admit_b);
  feed(ref, tb, 0, {32});
  EXPECT_TRUE(same_bits(ob, feed(ref, tb, 32, {18})));
  EXPECT_EQ(b.publish_pages(index, tb.data(), b.n_tokens()), 1);  // its page 2 (tokens 32..47)

  KvPrefixStats st = index.stats();
  EXPECT_EQ(st.query_tokens, 50u);
  EXPECT_EQ(st.hit_tokens, 32u);

  // Both end: cached pages stay resident (idle), the rest is free; nothing leaks.
  a.release();
  b.release();
  EXPECT_EQ(pool.n_used(), 0u);
  EXPECT_EQ(pool.n_idle(), 3u);
  EXPECT_EQ(index.n_idle(), 3u);
  EXPECT_EQ(pool.n_free(), pool.n_pages() - 3);
  expect_pool_consistent(pool);

  // The same prompt again: all three cached pages (48 of 50 tokens), idle now: admitting the
  // prompt takes them and one new page out of the available set.
  const size_t avail1 = pool.n_available();
  const size_t admit_c = c.admit_pages(index.lookup(tb.data(), int(tb.size()) - 1), int(tb.size()));
  EXPECT_EQ(admit_c, 4u);
  EXPECT_EQ(c.adopt_prefix(index, tb.data(), int(tb.size()), int(tb.size()) - 1), 48);
  EXPECT_EQ(pool.n_idle(), 0u);
  EXPECT_EQ(pool.n_used(), 3u);
  KvCache ref2(cfg);
  feed(ref2, tb, 0, {32, 16});
  EXPECT_TRUE(same_bits(feed(c, tb, 48, {2}), feed(ref2, tb, 48, {2})));
  EXPECT_EQ(avail1 - pool.n_available(), admit_c);
  EXPECT_EQ(index.stats().hit_tokens, 32u + 48u);

  // Pool pressure evicts idle cached pages; a full pool of referenced pages throws.
  c.release();
  KvCache big(cfg, &pool);
  const auto tbig = tokens(12 * P, 8);
  feed(big, tbig, 0, {12 * P});
  EXPECT_EQ(index.n_entries(), 0u);
  EXPECT_EQ(index.stats().evicted_pages, 3u);
  EXPECT_EQ(pool.n_used(), 12u);
  KvCache d(cfg, &pool);
  EXPECT_THROW(step(d, tb.data(), 1), KvPoolFull);
  big.release();
  d.release();
  EXPECT_EQ(pool.n_free(), pool.n_pages());
  pool.set_evictor(nullptr);
}

// A sequence admitted while another one is still prefilling the same prefix adopts that prefix's
// pages as they are published (extend_prefix), and ends up with the bits of a full computation.
TEST_P(AdoptFormat, PrefixExtendedAsItIsPublishedEqualsComputingItAgain) {
  const auto& [format, residual] = GetParam();
  const KvCacheConfig cfg = synth_cfg(format, residual);
  PagePool pool(16, kv_cache_page_bytes(cfg), P);
  KvCache a(cfg, &pool), b(cfg, &pool), ref(cfg);
  PrefixIndex index(a.prefix_identity(), P, test_key);
  pool.set_evictor(&index);
  const auto ta = tokens(5 * P + 3, 11);
  auto tb = std::vector<int32_t>(ta.begin(), ta.begin() + 4 * P + 5);  // 4 full shared pages
  const auto extra = tokens(9, 12);
  tb.insert(tb.end(), extra.begin(), extra.end());
  const int nb = int(tb.size());

  // b is admitted when nothing is cached: it holds nothing, and may extend.
  EXPECT_EQ(b.adopt_prefix(index, tb.data(), nb, nb - 1), 0);
  EXPECT_TRUE(b.prefix_extendable());
  EXPECT_EQ(b.extend_prefix(index, tb.data(), nb, nb - 1), 0);
  // a's first chunk fills one page and a half: page 0 is published.
  feed(a, ta, 0, {P + P / 2});
  EXPECT_EQ(a.publish_pages(index, ta.data(), a.n_tokens()), 1);
  EXPECT_EQ(b.extend_prefix(index, tb.data(), nb, nb - 1), P);
  // a's next chunk: pages 1..3 and part of 4 published; b adopts pages 1..3 (page 4 differs).
  feed(a, ta, P + P / 2, {3 * P + P / 2 + 3});
  EXPECT_EQ(a.publish_pages(index, ta.data(), a.n_tokens()), 4);
  EXPECT_EQ(b.extend_prefix(index, tb.data(), nb, nb - 1), 3 * P);
  EXPECT_EQ(b.n_tokens(), 4 * P);
  EXPECT_EQ(b.block_table(), std::vector<KvPageId>(a.block_table().begin(), a.block_table().begin() + 4));
  EXPECT_EQ(b.extend_prefix(index, tb.data(), nb, nb - 1), 0);  // page 4 of b is not a's page 4
  const auto ob = feed(b, tb, 4 * P, {nb - 4 * P});
  feed(ref, tb, 0, {4 * P});
  EXPECT_TRUE(same_bits(ob, feed(ref, tb, 4 * P, {nb - 4 * P})));
  // Once b holds private tokens it cannot extend any more.
  EXPECT_FALSE(b.prefix_extendable());
  EXPECT_EQ(b.extend_prefix(index, tb.data(), nb, nb - 1), 0);
  // Hits: one query of nb tokens, 4 pages served from the cache.
  EXPECT_EQ(index.stats().query_tokens, uint64_t(nb));
  EXPECT_EQ(index.stats().hit_tokens, uint64_t(4 * P));
  a.release();
  b.release();
  EXPECT_EQ(pool.n_used(), 0u);
  expect_pool_consistent(pool);
  pool.evict_idle();
  pool.set_evictor(nullptr);
}

// kivi2 with R = 0: grouped keys, but page boundaries leave no full-precision tail.
INSTANTIATE_TEST_SUITE_P(Formats, AdoptFormat,
                         ::testing::Values(std::make_pair(std::string("f16"), -1), std::make_pair(std::string("int8"), -1),
                                           std::make_pair(std::string("kivi2"), 0),
                                           std::make_pair(std::string("kvquant4"), -1)));

// A private cache told its sliding layers' windows keeps their blocks only about a window deep
// (window pages freed behind it and reused) and attends exactly as a cache that keeps everything;
// a query reaching behind the window is a checked error. Per-token and grouped codecs, prefill
// chunks larger and smaller than the window, decode steps.
TEST(KvPaging, PrivateCacheFreesSlidingLayersBehindTheWindow) {
  const std::vector<int> windows = {0, 40};  // layer 0 full, layer 1 sees the last 40 positions
  for (const std::string format : {"f16", "int4", "kivi4", "kvquant4"}) {
    SCOPED_TRACE(format);
    KvCacheConfig full = synth_cfg(format, format == "kivi4" ? 32 : -1);
    KvCacheConfig win = full;
    win.window = windows;
    KvCache a(full), b(win);
    ASSERT_EQ(a.page_bytes(), b.page_bytes());  // every layer's blocks of a page, wherever they live
    const std::vector<int32_t> toks = tokens(300, 11);
    std::vector<int> chunks = {70, 5, 33, 64};
    while (std::accumulate(chunks.begin(), chunks.end(), 0) < 300) chunks.push_back(1);
    int at = 0;
    size_t most = 0;
    for (int n : chunks) {
      const auto oa = step(a, toks.data() + at, n, windows);
      const auto ob = step(b, toks.data() + at, n, windows);
      ASSERT_TRUE(same_bits(oa, ob)) << "step at " << at;
      at += n;
      most = std::max(most, b.bytes_pages());
    }
    // Layer 0 in full; layer 1 about window + one step (70 tokens) deep, in whole pages.
    const size_t layer1 = b.layer_page_bytes(1), layer0 = b.layer_page_bytes(0);
    EXPECT_EQ(a.bytes_pages(), size_t(a.n_pages()) * (layer0 + layer1));
    EXPECT_LE(most, size_t(a.n_pages()) * layer0 + size_t((40 + 70) / P + 3) * layer1);
    EXPECT_LT(b.bytes_pages(), a.bytes_pages() - size_t(a.n_pages() / 3) * layer1);  // a third of layer 1's pages saved at least
    // Behind the window: the freed pages are not read.
    std::vector<float> q(size_t(n_q) * 64, 0.1f), out(q.size()), scratch(b.attend_scratch_floats(n_q));
    std::vector<KvBlockSpan> spans;
    AttnParams ap;
    ap.scale = 0.125f;
    std::vector<float> k(2 * 64, 0.f);
    b.append(0, 1, k.data(), k.data(), k.data());
    b.append(1, 1, k.data(), k.data(), k.data());
    EXPECT_DEATH(b.attend_head(1, 0, b.n_tokens(), q.data(), n_q, ap, 0, out.data(), scratch.data(), spans), "was freed");
    b.attend_head(1, 0, b.n_tokens(), q.data(), n_q, ap, 40, out.data(), scratch.data(), spans);
    b.commit(1);
    // A fork copies what is held (between caches of the same windows only), and a cleared cache
    // starts over.
    KvCache e(full);
    EXPECT_DEATH(e.fork_from(b), "different configurations");  // another page layout
    KvCache c(win);
    c.fork_from(b);
    const auto oc = step(c, toks.data(), 3, windows);
    const auto ob = step(b, toks.data(), 3, windows);
    EXPECT_TRUE(same_bits(oc, ob));
    b.clear();
    EXPECT_EQ(b.bytes_pages(), 0u);
    const auto o1 = step(b, toks.data(), 50, windows);
    KvCache d(full);
    EXPECT_TRUE(same_bits(o1, step(d, toks.data(), 50, windows)));
  }
}

// In a pool, sliding-window layers keep their blocks in a page group of their own: its pages go
// back to the pool behind the window, pages_at bounds what the sequence references, and
// attention equals a private cache that keeps everything. Per-token and grouped codecs (kivi2 with
// R = 0 packs a page late), prefill chunks larger and smaller than the window, decode steps.
TEST(KvPaging, PoolCacheFreesSlidingGroupsBehindTheWindow) {
  const std::vector<int> windows = {0, 40};  // layer 0 full, layer 1 sees the last 40 positions
  for (const std::string format : {"f16", "int4", "kivi2", "kvquant4"}) {
    SCOPED_TRACE(format);
    const KvCacheConfig full = synth_cfg(format, format == "kivi2" ? 0 : -1);
    KvCacheConfig win = full;
    win.window = windows;
    PagePool pool(64, kv_cache_page_bytes(win), P);
    KvCache a(win, &pool), ref(full);
    ASSERT_EQ(a.n_groups(), 2);
    EXPECT_EQ(a.group_window(0), 0);
    EXPECT_EQ(a.group_window(1), 40);
    EXPECT_EQ(a.layer_group(1), 1);
    EXPECT_EQ(kv_cache_page_bytes(win), a.layer_page_bytes(0));  // a pool page holds one layer here
    EXPECT_NE(a.prefix_identity(), KvCache(full).prefix_identity());
    const std::vector<int32_t> toks = tokens(300, 21);
    std::vector<int> chunks = {70, 5, 33, 64};
    while (std::accumulate(chunks.begin(), chunks.end(), 0) < 300) chunks.push_back(1);
    int at = 0;
    for (int n : chunks) {
      // The step's peak (pages held + pages it takes) within pages_at's bound.
      ASSERT_LE(size_t(a.n_pages() + a.pages_needed(n)), a.pages_at(at + n, n)) << "step at " << at;
      const auto oa = step(a, toks.data() + at, n, windows);
      ASSERT_TRUE(same_bits(oa, step(ref, toks.data() + at, n, windows))) << "step at " << at;
      at += n;
      ASSERT_LE(size_t(a.n_pages()), a.pages_at(at)) << "at " << at;
      ASSERT_GE(a.n_pages(), a.pages_for(at) + (at > 40 ? 3 : a.pages_for(at)) - 1) << "at " << at;
      ASSERT_EQ(pool.n_used(), size_t(a.n_pages()));
    }
    // Group 0: every position; group 1: the window (40 positions: 3 or 4 pages), no more.
    EXPECT_LE(a.n_pages(), a.pages_for(300) + 4);
    EXPECT_EQ(a.block_table(1)[0], kv_page_none);
    EXPECT_EQ(a.tokens_in_pages(size_t(a.pages_for(300) + 4)), a.pages_for(300) * P);
    a.release();
    EXPECT_EQ(pool.n_free(), pool.n_pages());
  }
}

// Page groups under a pool: every layer in exactly one group, group 0 the full-attention layers,
// sliding groups of one window each, no group's page above the pool's; layers of different sizes
// (here two f16 layers among q4_0 ones) are packed so that the largest page is the full group's
// or one layer's. A private cache keeps one group per window; a model whose layers all slide keeps
// one group in a pool (nothing names the prefix chain otherwise).
TEST(KvPaging, PageGroupsCoverEveryLayerOnce) {
  KvCacheConfig c = synth_cfg("q4_0");
  c.n_layer = 8;
  c.policy = kv_policy_uniform("q4_0", 8);
  kv_policy_skip_layers(c.policy, {0, 1});  // f16
  c.rope.assign(8, KvRope{64, 10000.f, 1.f, false});
  c.window = {40, 40, 0, 40, 40, 24, 0, 40};
  PagePool pool(8, kv_cache_page_bytes(c), P);
  const KvCache a(c, &pool);
  ASSERT_GE(a.n_groups(), 3);
  EXPECT_EQ(a.group_window(0), 0);
  std::vector<int> seen(8, 0);
  std::vector<size_t> bytes(size_t(a.n_groups()), 0);
  for (int il = 0; il < 8; ++il) {
    const int g = a.layer_group(il);
    ++seen[size_t(il)];
    EXPECT_EQ(a.group_window(g), c.window[size_t(il)]) << "layer " << il;
    bytes[size_t(g)] += a.layer_page_bytes(il);
  }
  EXPECT_EQ(seen, std::vector<int>(8, 1));
  const size_t biggest = std::max(a.layer_page_bytes(0), a.layer_page_bytes(2) + a.layer_page_bytes(6));
  EXPECT_EQ(a.pool_page_bytes(), biggest);
  for (size_t g = 0; g < bytes.size(); ++g) EXPECT_LE(bytes[g], a.pool_page_bytes()) << "group " << g;
  EXPECT_EQ(a.layer_group(2), 0);
  EXPECT_EQ(a.layer_group(6), 0);
  // Private: full layers, window 40, window 24.
  EXPECT_EQ(KvCache(c).n_groups(), 3);
  // Every layer sliding: one group in a pool, one per window privately.
  KvCacheConfig all = c;
  all.window = std::vector<int>(8, 40);
  PagePool pool_all(8, kv_cache_page_bytes(all), P);
  EXPECT_EQ(KvCache(all, &pool_all).n_groups(), 1);
  EXPECT_EQ(KvCache(all, &pool_all).group_window(0), 0);
  EXPECT_EQ(KvCache(all).n_groups(), 1);
  EXPECT_EQ(KvCache(all).group_window(0), 40);
}

// pages_at on a Gemma-like layout (18 layers, 3 full, window 512, 64-token pages) for steps of
// any alignment: never below what any schedule of steps of up to `step` tokens references (its
// peak), non-decreasing in n, and tokens_in_pages its inverse.
TEST(KvPaging, PagesAtBoundsEveryScheduleAndGrows) {
  KvCacheConfig c = synth_cfg("q4_0");
  c.n_layer = 18;
  c.n_kv_heads = 1;
  c.page_tokens = 64;
  c.max_tokens = 4096;
  c.policy = kv_policy_uniform("q4_0", 18);
  c.rope.assign(18, KvRope{64, 10000.f, 1.f, false});
  c.window.assign(18, 512);
  for (int il : {5, 11, 17}) c.window[size_t(il)] = 0;
  PagePool one(1, kv_cache_page_bytes(c), 64);
  const KvCache k(c, &one);
  ASSERT_EQ(k.n_groups(), 6);
  for (int s : {0, 1, 100, 255, 256}) {
    size_t prev = 0;
    for (int n = 0; n <= 3000; ++n) {
      const size_t p = k.pages_at(n, s);
      ASSERT_GE(p, prev) << "n " << n << " step " << s;
      prev = p;
    }
    for (size_t pages : {size_t(40), size_t(76), size_t(81), size_t(120)}) {
      const int t = k.tokens_in_pages(pages, s);
      EXPECT_LE(k.pages_at(t, std::min(s, t)), pages);
      EXPECT_GT(k.pages_at(t + 1, std::min(s, t + 1)), pages);
    }
  }
  // Real schedules: a 1024-token prompt in chunks of 255 (decodes share the budget), and one of 803
  // in chunks of 100; the peak of every step is within the bound for the step size.
  for (const auto& [n_prompt, chunk] : {std::pair{1024, 255}, std::pair{803, 100}, std::pair{2000, 256}}) {
    PagePool pool(400, kv_cache_page_bytes(c), 64);
    KvCache a(c, &pool);
    const auto t = tokens(n_prompt, 5);
    std::vector<float> kv(size_t(chunk) * 64, 0.5f);
    for (int at = 0; at < n_prompt;) {
      const int n = std::min(chunk, n_prompt - at);
      ASSERT_LE(size_t(a.n_pages() + a.pages_needed(n)), a.pages_at(at + n, chunk)) << "step at " << at;
      ASSERT_LE(size_t(a.n_pages() + a.pages_needed(n)), a.pages_at(n_prompt, chunk));
      for (int il = 0; il < 18; ++il) a.append(il, n, kv.data(), kv.data(), kv.data());
      a.commit(n);
      at += n;
    }
    a.release();
  }
}

// A cached prefix carries the sliding group's pages that its window still reads: a sequence that
// adopts it references those and the full group's pages, and computes the rest exactly as from
// scratch. The sliding pages a sequence leaves behind stay cached (idle); evicted, they make the
// same prefix unadoptable that deep, while a prefix whose window pages are still held stays so.
TEST(KvPaging, WindowedPrefixCarriesItsWindowPages) {
  for (const std::string format : {"f16", "kvquant4"}) {
    SCOPED_TRACE(format);
    const KvCacheConfig full = synth_cfg(format);
    KvCacheConfig win = full;
    win.window = {0, 40};
    PagePool pool(64, kv_cache_page_bytes(win), P);
    KvCache a(win, &pool), b(win, &pool), c(win, &pool);
    auto index = kv_cache_prefix_index(a, &test_key);
    ASSERT_EQ(index->n_groups(), 2);
    pool.set_evictor(index.get());
    const auto ta = tokens(12 * P + 5, 31);
    auto tb = std::vector<int32_t>(ta.begin(), ta.begin() + 8 * P + 3);
    const auto extra = tokens(20, 32);
    tb.insert(tb.end(), extra.begin(), extra.end());
    const int na = int(ta.size()), nb = int(tb.size());

    // One chunk longer than the window: the sliding pages behind it are kept until published.
    EXPECT_EQ(a.adopt_prefix(*index, ta.data(), na, na - 1), 0);
    feed(a, ta, 0, {na}, win.window);
    EXPECT_EQ(a.publish_pages(*index, ta.data(), na), 12);
    EXPECT_LE(size_t(a.n_pages()), a.pages_at(na));
    EXPECT_EQ(a.n_pages(), 13 + 4);  // group 0: 13; group 1: pages 9..12 (its next query sees 158..197)
    EXPECT_EQ(pool.n_idle(), 9u);  // group 1's pages 0..8: behind a's window, cached

    // b adopts 8 pages: group 0's pages 0..7 and group 1's 5..7 (its next query sees 89..128).
    const KvPrefixMatch m = index->lookup(tb.data(), nb - 1);
    ASSERT_EQ(m.pages.size(), 8u);
    EXPECT_EQ(m.n_pages_total(), 8u + 3u);
    EXPECT_EQ(m.window_pages[0][4], kv_page_none);
    EXPECT_TRUE(pool.is_idle(m.window_pages[0][5]));  // a freed it: cached, idle
    const size_t avail0 = pool.n_available(), admit = b.admit_pages(m, nb);
    EXPECT_EQ(b.adopt_prefix(*index, tb.data(), nb, nb - 1), 8 * P);
    EXPECT_EQ(b.n_pages(), 8 + 3);
    KvCache ref(full);
    feed(ref, tb, 0, {8 * P}, win.window);
    EXPECT_TRUE(same_bits(feed(b, tb, 8 * P, {nb - 8 * P}, win.window), feed(ref, tb, 8 * P, {nb - 8 * P}, win.window)));
    EXPECT_LE(avail0 - pool.n_available(), admit);  // an upper bound with sliding groups
    b.release();

    // Every idle page goes: group 1's pages 0..8 of a's chain among them.
    pool.evict_idle();
    EXPECT_EQ(index->lookup(tb.data(), nb - 1).pages.size(), 0u);  // its window pages are gone
    const KvPrefixMatch ma = index->lookup(ta.data(), na - 1);
    EXPECT_EQ(ma.pages.size(), 12u);  // a still holds group 1's pages 9..12
    EXPECT_EQ(c.adopt_prefix(*index, ta.data(), na, na - 1), 12 * P);
    KvCache ref2(full);
    feed(ref2, ta, 0, {12 * P}, win.window);
    EXPECT_TRUE(same_bits(feed(c, ta, 12 * P, {na - 12 * P}, win.window), feed(ref2, ta, 12 * P, {na - 12 * P}, win.window)));
    a.release();
    c.release();
    EXPECT_EQ(pool.n_used(), 0u);
    expect_pool_consistent(pool);
    pool.evict_idle();
    EXPECT_EQ(index->n_entries(), 0u);
    pool.set_evictor(nullptr);
  }
}

// Random serving traffic on a small pool with a sliding group: sequences drawn from three shared
// prefixes adopt cached pages, extend them as others publish, prefill in random chunks (some
// longer than the window), get preempted when the pool runs out, and finish. Every step's
// attention equals a private cache's fed the same chunks, every sequence references at most
// pages_at(its length) pages, and the pool and the index agree on what is idle.
TEST(KvPaging, WindowedPoolUnderRandomTraffic) {
  for (uint32_t seed : {1u, 2u, 3u}) {
    SCOPED_TRACE(seed);
    std::mt19937 rng(seed);
    const KvCacheConfig full = synth_cfg("int8");
    KvCacheConfig win = full;
    win.window = {0, 40};
    PagePool pool(26, kv_cache_page_bytes(win), P);  // a sequence alone peaks at 22 pages
    auto index = kv_cache_prefix_index(KvCache(win, &pool), &test_key);
    pool.set_evictor(index.get());
    std::vector<std::vector<int32_t>> prefixes;
    for (uint32_t k = 0; k < 3; ++k) prefixes.push_back(tokens(120, 100 + k));
    struct Seq {
      std::vector<int32_t> t;
      std::unique_ptr<KvCache> c, ref;
      bool admitted = false;
    };
    std::vector<Seq> live;
    int finished = 0, preempted = 0, adopted = 0;
    for (int round = 0; round < 4000 && finished < 24; ++round) {
      if (live.size() < 4 && (live.empty() || rng() % 4 == 0)) {
        Seq s;
        const auto& pre = prefixes[rng() % 3];
        s.t.assign(pre.begin(), pre.begin() + 20 + rng() % 100);
        const auto tail = tokens(10 + int(rng() % 60), rng());
        s.t.insert(s.t.end(), tail.begin(), tail.end());
        s.c = std::make_unique<KvCache>(win, &pool);
        s.ref = std::make_unique<KvCache>(full);
        live.push_back(std::move(s));
      }
      const size_t i = rng() % live.size();
      Seq& s = live[i];
      const int n = int(s.t.size());
      if (!s.admitted) {
        const int got = s.c->adopt_prefix(*index, s.t.data(), n, n - 1);
        if (got > 0) feed(*s.ref, s.t, 0, {got}, win.window);
        adopted += got;
        s.admitted = true;
      } else if (s.c->prefix_extendable()) {
        const int at = s.c->n_tokens(), got = s.c->extend_prefix(*index, s.t.data(), n, n - 1);
        if (got > 0) feed(*s.ref, s.t, at, {got}, win.window);
        adopted += got;
      }
      const int at = s.c->n_tokens();
      if (at == n) {
        s.c->release();
        live.erase(live.begin() + std::ptrdiff_t(i));
        ++finished;
        continue;
      }
      const int chunk = std::min(n - at, 1 + int(rng() % 64));
      std::vector<float> out;
      try {
        out = feed(*s.c, s.t, at, {chunk}, win.window);
      } catch (const KvPoolFull&) {
        ASSERT_EQ(s.c->n_tokens(), at);
        s.c->release();  // preempted: recomputed from the start
        s.ref = std::make_unique<KvCache>(full);
        s.admitted = false;
        ++preempted;
        continue;
      }
      ASSERT_TRUE(same_bits(out, feed(*s.ref, s.t, at, {chunk}, win.window))) << "round " << round;
      s.c->publish_pages(*index, s.t.data(), s.c->n_tokens());
      ASSERT_LE(size_t(s.c->n_pages()), s.c->pages_at(s.c->n_tokens()));
      ASSERT_EQ(pool.n_free() + pool.n_idle() + pool.n_used(), pool.n_pages());
      ASSERT_EQ(pool.n_idle(), index->n_idle());
    }
    EXPECT_EQ(finished, 24);
    EXPECT_GT(preempted, 0);
    EXPECT_GT(adopted, 0);
    for (Seq& s : live) s.c->release();
    EXPECT_EQ(pool.n_used(), 0u);
    pool.evict_idle();
    EXPECT_EQ(index->n_entries(), 0u);
    pool.set_evictor(nullptr);
  }
}

// What a decode query reads: every layer's visible tokens packed (a sliding layer's window), and
// a grouped codec's f32 tail rows.
TEST(KvPaging, DecodeReadBytesCountWindowsAndTails) {
  KvCacheConfig c = synth_cfg("int8");
  const KvCache full(c);
  const double per_layer = double(full.layer_page_bytes(0)) / P;  // both layers alike
  EXPECT_DOUBLE_EQ(full.decode_read_bytes(99), full.bytes_per_token() * 100);
  c.window = {0, 40};
  const KvCache win(c);
  EXPECT_DOUBLE_EQ(win.decode_read_bytes(99), per_layer * (100 + 40));
  EXPECT_DOUBLE_EQ(win.decode_read_bytes(9), per_layer * (10 + 10));
  KvCacheConfig g = synth_cfg("kivi4", 32);  // G = 16, R = 32: the newest 32..47 tokens in f32
  const KvCache grouped(g);
  const double row = 2.0 * 64 * 2 * sizeof(float), gl = double(grouped.layer_page_bytes(0)) / P;
  const int packed = kv_quantized_tokens(100, 16, 32);
  EXPECT_DOUBLE_EQ(grouped.decode_read_bytes(99), 2 * (gl * packed + row * (100 - packed)));
}

TEST(KvPaging, GroupedCodecWithResidualWindowIsNotShared) {
  const KvCacheConfig cfg = synth_cfg("kivi2");  // R = 128 by default
  PagePool pool(16, kv_cache_page_bytes(cfg), P);
  KvCache a(cfg, &pool), b(cfg, &pool);
  EXPECT_FALSE(a.prefix_shareable());
  PrefixIndex index(a.prefix_identity(), P, test_key);
  pool.set_evictor(&index);
  const auto t = tokens(200, 9);
  feed(a, t, 0, {200});
  EXPECT_EQ(a.publish_pages(index, t.data(), 200), 0);
  EXPECT_EQ(index.n_entries(), 0u);
  EXPECT_EQ(b.adopt_prefix(index, t.data(), 200, 199), 0);
  EXPECT_EQ(b.n_tokens(), 0);
  EXPECT_EQ(index.stats().query_tokens, 200u);
  EXPECT_EQ(index.stats().hit_tokens, 0u);
  a.release();
  EXPECT_EQ(pool.n_free(), pool.n_pages());
  pool.set_evictor(nullptr);
}

TEST(KvPaging, PrefixIdentityNamesEverythingThatChangesPageBytes) {
  const std::string base = KvCache(synth_cfg("f16")).prefix_identity();
  EXPECT_EQ(KvCache(synth_cfg("f16")).prefix_identity(), base);
  EXPECT_NE(KvCache(synth_cfg("int8")).prefix_identity(), base);
  KvCacheConfig c = synth_cfg("f16");
  c.model_id = "other";
  EXPECT_NE(KvCache(c).prefix_identity(), base);
  c = synth_cfg("f16");
  c.page_tokens = 32;
  EXPECT_NE(KvCache(c).prefix_identity(), base);
  c = synth_cfg("f16");
  c.seed += 1;
  EXPECT_NE(KvCache(c).prefix_identity(), base);
  c = synth_cfg("f16");
  c.rope[1].freq_base = 500000.f;
  EXPECT_NE(KvCache(c).prefix_identity(), base);
  // Dense-and-sparse keys' outlier share and exact sink tokens (same codec names).
  c = synth_cfg("kvquant4");
  const std::string kvq4 = KvCache(c).prefix_identity();
  c.outlier_fraction = 0.02;
  EXPECT_NE(KvCache(c).prefix_identity(), kvq4);
  c = synth_cfg("kvquant4");
  c.sink_tokens = 4;
  EXPECT_NE(KvCache(c).prefix_identity(), kvq4);
  // One layer kept at another format.
  c = synth_cfg("int8");
  kv_policy_skip_layers(c.policy, {1});
  EXPECT_NE(KvCache(c).prefix_identity(), KvCache(synth_cfg("int8")).prefix_identity());
  // Calibration content, not its address.
  const nlohmann::json j1 = {{"scales", {1, 2, 3}}}, j2 = {{"scales", {1, 2, 4}}}, j1b = j1;
  KvCacheConfig c1 = synth_cfg("f16"), c2 = synth_cfg("f16"), c1b = synth_cfg("f16");
  c1.calib = &j1;
  c2.calib = &j2;
  c1b.calib = &j1b;
  EXPECT_NE(KvCache(c1).prefix_identity(), base);
  EXPECT_NE(KvCache(c1).prefix_identity(), KvCache(c2).prefix_identity());
  EXPECT_EQ(KvCache(c1).prefix_identity(), KvCache(c1b).prefix_identity());
}

// Token groups by format name: "kvquant3@g128/tq2.5_s" puts the suffix on the K codec only,
// "kivi4@g32" on both; the cache builds them (and keeps the groups in the prefix identity), and a
// group that does not divide the page is refused as any other.
TEST(KvPaging, GroupSuffixInTheFormatName) {
  KvPolicy p = kv_policy_uniform("kvquant3@g128/tq2.5_s", 2);
  EXPECT_EQ(p.name, "kvquant3@g128/tq2.5_s");
  EXPECT_EQ(p.layers[0].k_codec, kv_format_find("kvquant3").k_codec + "@g128");
  EXPECT_EQ(p.layers[1].v_codec, kv_format_find("tq2.5_s").v_codec);
  p = kv_policy_uniform("KIVI4@g32", 2);  // names are case-insensitive, the suffix as given
  EXPECT_EQ(p.name, "kivi4@g32");
  EXPECT_EQ(p.layers[0].k_codec, kv_format_find("kivi4").k_codec + "@g32");
  EXPECT_EQ(p.layers[0].v_codec, kv_format_find("kivi4").v_codec + "@g32");
  EXPECT_THROW(kv_policy_uniform("kivi4@g", 2), Error);
  EXPECT_THROW(kv_policy_uniform("kivi4@q32", 2), Error);
  kv_policy_override_layer(p, "1=kivi2@g16");
  EXPECT_EQ(p.layers[1].k_codec, kv_format_find("kivi2").k_codec + "@g16");

  KvCacheConfig c = synth_cfg("kivi4@g32");
  c.page_tokens = 32;
  c.group_tokens = 16;  // the global flag; the name's group wins for this format
  const std::string g32 = KvCache(c).prefix_identity();
  c.policy = kv_policy_uniform("kivi4@g16", 2);
  EXPECT_NE(KvCache(c).prefix_identity(), g32);
  c.policy = kv_policy_uniform("kivi4@g64", 2);
  try {
    KvCache bad(c);
    ADD_FAILURE() << "a 64-token group in 32-token pages was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("does not divide the page size"), std::string::npos) << e.what();
  }
}

// ------------------------------------------------------------------ stories260K

namespace {

std::string shared_path(const std::string& rel) { return std::string(KVQ_SOURCE_DIR) + "/../shared/" + rel; }

}  // namespace

class PagedModel : public ::testing::TestWithParam<std::string> {};

TEST_P(PagedModel, AdoptedPrefixGivesTheLogitsOfAFullComputation) {
  const std::string path = shared_path("models/stories260K.gguf");
  if (!fs::exists(path)) GTEST_SKIP() << "stories260K.gguf not found at " << path;
  auto m = Model::load(path);
  Tokenizer tok = Tokenizer::from_gguf(m->file());
  const int nv = m->config().n_vocab;
  KvCacheConfig cfg = m->kv_cache_config(kv_policy_uniform(GetParam(), m->config().n_layer), 256, P);
  cfg.model_id = path;

  std::vector<int32_t> ta = tok.encode("Once upon a time, there was a little girl named Lily. She loved to play outside "
                                       "in the park with her friends. One day, she saw a big red ball.", true);
  std::vector<int32_t> tb = tok.encode("Once upon a time, there was a little girl named Lily. She loved to play outside "
                                       "in the park with her friends. One day, her mom said they would bake a cake.", true);
  size_t common = 0;
  while (common < std::min(ta.size(), tb.size()) && ta[common] == tb[common]) ++common;
  ASSERT_GE(common, size_t(2 * P)) << "prompts share too little for two pages";
  ASSERT_GT(tb.size(), common + 4);
  const int shared = int(common) / P * P;  // full pages b can adopt

  auto pool = PagePool::from_tokens(512, kv_cache_page_bytes(cfg), P);
  PrefixIndex index(KvCache(cfg).prefix_identity(), P);
  pool->set_evictor(&index);
  ThreadPool threads(2);
  Forward fwd(*m, threads);

  // Sequence a: prefill in two chunks, the first ending at the page boundary b will adopt.
  KvCache a(cfg, pool.get());
  fwd.eval(ta.data(), shared, a);
  fwd.eval(ta.data() + shared, int(ta.size()) - shared, a);
  a.publish_pages(index, ta.data(), a.n_tokens());
  EXPECT_EQ(index.n_entries(), ta.size() / P);

  // Sequence b adopts a's pages, computes only the rest.
  KvCache b(cfg, pool.get());
  ASSERT_EQ(b.adopt_prefix(index, tb.data(), int(tb.size()), int(tb.size()) - 1), shared);
  const int rest = int(tb.size()) - shared;
  const float* lb = fwd.eval(tb.data() + shared, rest, b, /*all_logits=*/true);
  const std::vector<float> logits_b(lb, lb + size_t(rest) * size_t(nv));
  const size_t pages_a = (ta.size() + P - 1) / P, pages_b = (tb.size() + P - 1) / P;
  EXPECT_EQ(pool->n_used(), pages_a + pages_b - size_t(shared / P));  // shared pages counted once

  // The same sequence from scratch, private pages, same chunks.
  KvCache ref(cfg);
  fwd.eval(tb.data(), shared, ref);
  const float* lr = fwd.eval(tb.data() + shared, rest, ref, true);
  ASSERT_EQ(std::memcmp(logits_b.data(), lr, logits_b.size() * sizeof(float)), 0)
      << "adopted-prefix logits differ from a full computation";
  // Decoding continues identically.
  const int32_t next = tb.back();
  const float* d = fwd.eval(&next, 1, b);
  const std::vector<float> decode_b(d, d + nv);
  d = fwd.eval(&next, 1, ref);
  EXPECT_EQ(std::memcmp(decode_b.data(), d, size_t(nv) * sizeof(float)), 0);

  // Both end: a's full pages stay cached (idle), everything else is back on the free list.
  EXPECT_EQ(index.stats().hit_tokens, uint64_t(shared));
  EXPECT_EQ(index.stats().query_tokens, uint64_t(tb.size()));
  a.release();
  b.release();
  EXPECT_EQ(pool->n_used(), 0u);
  EXPECT_EQ(pool->n_idle(), index.n_entries());
  EXPECT_EQ(pool->n_free() + pool->n_idle(), pool->n_pages());
  pool->evict_idle();
  EXPECT_EQ(pool->n_free(), pool->n_pages());
  pool->set_evictor(nullptr);
}

INSTANTIATE_TEST_SUITE_P(Formats, PagedModel, ::testing::Values("f16", "int8"));

// What a sequence of n tokens costs per token: packed formats their packed bytes at every n; a
// format with a full-precision window (kivi4, G = 16 here, R = 32) f32 rows while n is inside the
// window and an unfilled group, then the packed bytes for what was packed.
TEST(KvCacheBytes, PerTokenAtALengthCountsTheFullPrecisionWindow) {
  const double f32_row = 2.0 * 2 * 2 * 64 * 4;  // layers x (K, V) x heads x head_dim x 4 bytes
  {
    KvCache c(synth_cfg("int8"));
    for (int n : {1, 16, 100, 512}) EXPECT_DOUBLE_EQ(c.bytes_per_token_at(n), c.bytes_per_token()) << n;
  }
  KvCache c(synth_cfg("kivi4", 32));
  for (int n : {1, 20, 47}) EXPECT_DOUBLE_EQ(c.bytes_per_token_at(n), f32_row) << n;  // nothing packed below R + G
  // 48 tokens: 16 packed (one group after the 32-token window)
  EXPECT_DOUBLE_EQ(c.bytes_per_token_at(48), (16 * c.bytes_per_token() + 32 * f32_row) / 48);
  EXPECT_LT(c.bytes_per_token_at(512), 1.2 * c.bytes_per_token() + 48 * f32_row / 512);
  EXPECT_GT(c.bytes_per_token_at(512), c.bytes_per_token());
  // the most a sequence holds outside the pages: the window and an unfilled group, f32 K and V
  EXPECT_EQ(double(c.max_tail_bytes()), f32_row * (32 + 16 - 1));
  EXPECT_EQ(KvCache(synth_cfg("int8")).max_tail_bytes(), 0u);
}

// Speculative verification: a step of drafted tokens that keeps only the first few (commit(n,
// keep)) leaves the cache as if only those had been appended, for every format that runs without
// calibration, private and pool-backed, with a sliding-window layer: what follows attends bit for
// bit as in a cache that never saw the dropped tokens, and the pages the step added for them are
// given back. A step that packs a group of a grouped codec cannot keep fewer.
TEST(KvPaging, HeldStepKeepingFewerEqualsAppendingOnlyThose) {
  int ran = 0;
  for (const auto& f : kv_formats()) {
    KvCacheConfig cfg = synth_cfg(f.name, 40);  // grouped codecs: G = 16, R = 40 (groups pack at 56, 72, ..)
    const std::vector<int> windows = {0, 24};
    try {
      KvCache probe(cfg);
    } catch (const Error&) {
      continue;  // needs calibration
    }
    ++ran;
    for (bool paged : {false, true}) {
      PagePool pool(64, kv_cache_page_bytes(cfg), P);
      KvCache a(cfg, paged ? &pool : nullptr), b(cfg, paged ? &pool : nullptr);
      auto t = tokens(120, 3);
      // 44 tokens, then a held step of 6 (over the page boundary at 48) whose last 4 are wrong
      // drafts (other token ids)
      const auto a0 = feed(a, t, 0, {20, 24}, windows), b0 = feed(b, t, 0, {20, 24}, windows);
      ASSERT_TRUE(same_bits(a0, b0)) << f.name;
      std::vector<int32_t> held(t.begin() + 44, t.begin() + 50);
      for (size_t i = 2; i < held.size(); ++i) held[i] = held[i] + 500;
      ASSERT_TRUE(a.step_keeps_any(6)) << f.name;
      {
        // step() commits; run its appends by hand and commit keeping 2
        const int w = cfg.n_kv_heads * cfg.head_dim;
        std::vector<float> k(size_t(6) * size_t(w)), v(k.size());
        for (int il = 0; il < cfg.n_layer; ++il) {
          for (int r = 0; r < 6; ++r) kv_row(held[size_t(r)], 44 + r, il, w, k.data() + size_t(r) * size_t(w), v.data() + size_t(r) * size_t(w));
          a.append(il, 6, k.data(), k.data(), v.data());
        }
        a.commit(6, 2);
      }
      feed(b, t, 44, {2}, windows);
      EXPECT_EQ(a.n_tokens(), 46) << f.name;
      EXPECT_EQ(a.bytes_pages(), b.bytes_pages()) << f.name << (paged ? " paged" : "");
      if (paged) {
        EXPECT_EQ(a.n_pages(), b.n_pages()) << f.name;
      }
      // the same continuation, over page and group boundaries
      const std::vector<int> more = {1, 5, 1, 30, 1, 9};
      EXPECT_TRUE(same_bits(feed(a, t, 46, more, windows), feed(b, t, 46, more, windows))) << f.name << (paged ? " paged" : "");
      expect_pool_consistent(pool);
    }
  }
  EXPECT_GT(ran, 20);
  // a grouped codec's step that packs a group cannot keep fewer
  KvCache g(synth_cfg("kivi2", 32));
  const auto t = tokens(64, 4);
  feed(g, t, 0, {40});
  EXPECT_TRUE(g.step_keeps_any(7));   // 47 tokens: 15 past the window R = 32, no whole group of 16
  EXPECT_FALSE(g.step_keeps_any(8));  // 48 tokens: the group [0, 16) packs
  EXPECT_TRUE(KvCache(synth_cfg("int8")).step_keeps_any(500));  // per-token formats always may
}
