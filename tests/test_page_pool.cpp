// Page pool: budget arithmetic, allocation, reference counts, the free list, and the evictor
// protocol (idle pages kept, evicted when the free list is empty), with a scripted evictor so
// the pool is tested without the prefix index.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <deque>
#include <set>

#include "cache/page_pool.h"
#include "core/error.h"

using namespace kvq;

namespace {

// Keeps the pages it was told to keep; evicts them first in, first out.
struct ScriptedEvictor : KvPageEvictor {
  std::set<KvPageId> keep;
  std::deque<KvPageId> idle;
  std::vector<KvPageId> reused;
  bool kv_page_unused(KvPageId p) override {
    if (!keep.count(p)) return false;
    idle.push_back(p);
    return true;
  }
  void kv_page_reused(KvPageId p) override {
    reused.push_back(p);
    idle.erase(std::find(idle.begin(), idle.end(), p));
  }
  KvPageId kv_page_evict() override {
    if (idle.empty()) return kv_page_none;
    KvPageId p = idle.front();
    idle.pop_front();
    keep.erase(p);
    return p;
  }
};

void expect_consistent(const PagePool& pool) {
  EXPECT_EQ(pool.n_free() + pool.n_idle() + pool.n_used(), pool.n_pages());
  EXPECT_EQ(pool.n_available(), pool.n_free() + pool.n_idle());
}

}  // namespace

TEST(PagePool, BudgetFromBytesAndTokens) {
  // 1000-byte pages occupy 1024 bytes (64-byte aligned starts).
  auto a = PagePool::from_bytes(10 * 1024 + 1023, 1000, 32);
  EXPECT_EQ(a->n_pages(), 10u);
  EXPECT_EQ(a->page_bytes(), 1000u);
  EXPECT_EQ(a->page_stride(), 1024u);
  EXPECT_EQ(a->arena_bytes(), 10u * 1024u);
  EXPECT_EQ(a->tokens_capacity(), 10u * 32u);
  EXPECT_EQ(a->n_free(), 10u);
  EXPECT_EQ(a->usage(), 0.0);

  auto b = PagePool::from_tokens(100, 4096, 16);  // 100 tokens -> 7 pages of 16
  EXPECT_EQ(b->n_pages(), 7u);
  EXPECT_EQ(b->tokens_capacity(), 112u);
  auto c = PagePool::from_tokens(96, 4096, 16);
  EXPECT_EQ(c->n_pages(), 6u);

  // A budget with 4x smaller pages holds 4x the tokens.
  auto f16 = PagePool::from_bytes(size_t(1) << 20, 4096, 64);
  auto q4 = PagePool::from_bytes(size_t(1) << 20, 1024, 64);
  EXPECT_EQ(q4->tokens_capacity(), 4 * f16->tokens_capacity());
}

TEST(PagePool, BadBudgetsAreErrors) {
  EXPECT_THROW(PagePool::from_bytes(1000, 1000, 16), Error);  // one page needs 1024 bytes
  EXPECT_THROW(PagePool::from_bytes(1 << 20, 0, 16), Error);
  EXPECT_THROW(PagePool::from_tokens(0, 1024, 16), Error);
  EXPECT_THROW(PagePool(4, 1024, 24), Error);   // not a power of two
  EXPECT_THROW(PagePool(4, 1024, 512), Error);  // above 256
  EXPECT_THROW(PagePool(0, 1024, 16), Error);
}

TEST(PagePool, AllocUntilExhaustedThenFreeAll) {
  PagePool pool(5, 200, 16);
  std::set<KvPageId> ids;
  for (int i = 0; i < 5; ++i) {
    KvPageId p = pool.alloc();
    ASSERT_NE(p, kv_page_none);
    EXPECT_TRUE(ids.insert(p).second) << "page " << p << " handed out twice";
    EXPECT_EQ(pool.refcount(p), 1);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(pool.data(p)) % 64, 0u);
    EXPECT_EQ(pool.n_used(), size_t(i + 1));
    expect_consistent(pool);
  }
  EXPECT_EQ(pool.alloc(), kv_page_none);
  EXPECT_EQ(pool.usage(), 1.0);
  // Distinct pages do not overlap.
  for (KvPageId p : ids) std::memset(pool.data(p), p + 1, pool.page_bytes());
  for (KvPageId p : ids)
    for (size_t i = 0; i < pool.page_bytes(); ++i) ASSERT_EQ(pool.data(p)[i], uint8_t(p + 1));
  for (KvPageId p : ids) pool.unref(p);
  EXPECT_EQ(pool.n_free(), 5u);
  EXPECT_EQ(pool.n_used(), 0u);
  expect_consistent(pool);
}

TEST(PagePool, RecycledPagesComeBackZeroed) {
  PagePool pool(1, 4096, 16);
  KvPageId p = pool.alloc();
  std::memset(pool.data(p), 0xa5, pool.page_bytes());
  pool.unref(p);
  KvPageId q = pool.alloc();
  ASSERT_EQ(q, p);
  for (size_t i = 0; i < pool.page_bytes(); ++i) ASSERT_EQ(pool.data(q)[i], 0) << i;
}

TEST(PagePool, ReferenceCountsKeepSharedPagesUsed) {
  PagePool pool(3, 64, 16);
  KvPageId p = pool.alloc();
  pool.ref(p);
  pool.ref(p);
  EXPECT_EQ(pool.refcount(p), 3);
  pool.unref(p);
  pool.unref(p);
  EXPECT_EQ(pool.refcount(p), 1);
  EXPECT_FALSE(pool.is_free(p));
  EXPECT_EQ(pool.n_used(), 1u);
  pool.unref(p);
  EXPECT_TRUE(pool.is_free(p));
  EXPECT_EQ(pool.n_free(), 3u);
}

TEST(PagePool, AllocNIsAllOrNothing) {
  PagePool pool(4, 64, 16);
  std::vector<KvPageId> got;
  EXPECT_FALSE(pool.alloc_n(5, got));
  EXPECT_TRUE(got.empty());
  EXPECT_EQ(pool.n_free(), 4u);
  EXPECT_TRUE(pool.alloc_n(3, got));
  EXPECT_EQ(got.size(), 3u);
  EXPECT_FALSE(pool.alloc_n(2, got));
  EXPECT_EQ(got.size(), 3u);
  EXPECT_EQ(pool.n_free(), 1u);
}

TEST(PagePool, EvictorKeepsIdlePagesUntilThePoolNeedsThem) {
  PagePool pool(4, 64, 16);
  ScriptedEvictor ev;
  pool.set_evictor(&ev);
  std::vector<KvPageId> p(4);
  for (auto& x : p) x = pool.alloc();
  ev.keep = {p[0], p[2]};
  for (auto x : p) pool.unref(x);
  // Kept pages are idle (resident, evictable), the others free.
  EXPECT_TRUE(pool.is_idle(p[0]));
  EXPECT_TRUE(pool.is_idle(p[2]));
  EXPECT_TRUE(pool.is_free(p[1]));
  EXPECT_EQ(pool.n_idle(), 2u);
  EXPECT_EQ(pool.n_free(), 2u);
  EXPECT_EQ(pool.n_available(), 4u);
  EXPECT_EQ(pool.usage(), 0.0);
  expect_consistent(pool);

  // Re-referencing an idle page makes it used and tells the evictor.
  pool.ref(p[2]);
  EXPECT_EQ(pool.refcount(p[2]), 1);
  EXPECT_EQ(ev.reused, std::vector<KvPageId>{p[2]});
  EXPECT_EQ(pool.n_idle(), 1u);

  // Free pages are used before idle ones; then the idle page is evicted.
  KvPageId a = pool.alloc(), b = pool.alloc();
  EXPECT_TRUE((a == p[1] && b == p[3]) || (a == p[3] && b == p[1]));
  EXPECT_EQ(pool.n_idle(), 1u);
  KvPageId c = pool.alloc();
  EXPECT_EQ(c, p[0]);
  EXPECT_EQ(pool.n_idle(), 0u);
  EXPECT_EQ(pool.alloc(), kv_page_none);
  expect_consistent(pool);

  // evict_idle drops the cache without waiting for pressure.
  ev.keep = {a, b};
  pool.unref(a);
  pool.unref(b);
  EXPECT_EQ(pool.n_idle(), 2u);
  EXPECT_EQ(pool.evict_idle(1), 1u);
  EXPECT_EQ(pool.n_idle(), 1u);
  EXPECT_EQ(pool.evict_idle(), 1u);
  EXPECT_EQ(pool.n_idle(), 0u);
  EXPECT_EQ(pool.n_free(), 2u);
  pool.unref(c);
  pool.unref(p[2]);
  EXPECT_EQ(pool.n_free(), 4u);
  pool.set_evictor(nullptr);
}

TEST(PagePoolDeathTest, ReferencingAFreePageIsAnInvariantViolation) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  PagePool pool(2, 64, 16);
  EXPECT_DEATH(pool.ref(0), "free page");
  KvPageId p = pool.alloc();
  pool.unref(p);
  EXPECT_DEATH(pool.unref(p), "holds no reference");
  EXPECT_DEATH(pool.data(7), "out of range");
}

TEST(KvPoolFull, IsAKvqErrorCarryingTheCounts) {
  try {
    throw KvPoolFull(5, 2);
  } catch (const Error& e) {
    const auto* full = dynamic_cast<const KvPoolFull*>(&e);
    ASSERT_NE(full, nullptr);
    EXPECT_EQ(full->pages_needed, 5u);
    EXPECT_EQ(full->pages_available, 2u);
    EXPECT_NE(std::string(e.what()).find("5 pages needed"), std::string::npos);
  }
}
