// Prefix index on its own (metadata only: page ids and token ids, no pages, no kernels): the
// hash, chaining, longest-prefix lookup, LRU eviction through the evictor protocol, hit
// accounting; then attached to a PagePool.
#include <gtest/gtest.h>

#include <numeric>
#include <random>

#include "cache/page_pool.h"
#include "cache/prefix_index.h"
#include "core/error.h"

using namespace kvq;

namespace {

constexpr int P = 16;
const KvHashKey test_key{0x0706050403020100ull, 0x0f0e0d0c0b0a0908ull, 0x1111, 0x2222};

std::vector<int32_t> random_tokens(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(static_cast<size_t>(n));
  for (auto& x : t) x = int32_t(rng() % 32000);
  return t;
}

// Inserts the full pages of tokens as pages first_page, first_page + 1, ... (a sequence that
// computed them); returns their chain hashes.
std::vector<KvHash> insert_chain(PrefixIndex& idx, const std::vector<int32_t>& t, KvPageId first_page) {
  std::vector<KvHash> hs;
  KvHash parent = idx.root();
  for (int i = 0; (i + 1) * P <= int(t.size()); ++i) {
    KvHash h;
    EXPECT_EQ(idx.insert(parent, t.data() + i * P, first_page + i, &h), PrefixIndex::Insert::inserted);
    hs.push_back(h);
    parent = h;
  }
  return hs;
}

}  // namespace

TEST(KvHash, SipHash24MatchesThePaperTestVectors) {
  // Key 00 01 .. 0f; messages 00 01 .. (n-1) (Aumasson & Bernstein, SipHash, appendix A and
  // the reference implementation's vector table).
  uint8_t msg[64];
  for (int i = 0; i < 64; ++i) msg[i] = uint8_t(i);
  const uint64_t k0 = 0x0706050403020100ull, k1 = 0x0f0e0d0c0b0a0908ull;
  EXPECT_EQ(kv_siphash24(k0, k1, msg, 15), 0xa129ca6149be45e5ull);
  EXPECT_EQ(kv_siphash24(k0, k1, msg, 0), 0x726fdb47dd0e0e31ull);
}

TEST(KvHash, HalvesAreIndependentAndEveryByteCounts) {
  std::vector<int32_t> t = random_tokens(P, 1);
  KvHash a = kv_hash128(test_key, t.data(), t.size() * 4);
  EXPECT_NE(a.lo, a.hi);
  for (size_t byte = 0; byte < t.size() * 4; byte += 7) {
    auto u = t;
    reinterpret_cast<uint8_t*>(u.data())[byte] ^= 1;
    KvHash b = kv_hash128(test_key, u.data(), u.size() * 4);
    EXPECT_NE(a.lo, b.lo) << byte;
    EXPECT_NE(a.hi, b.hi) << byte;
  }
}

TEST(PrefixIndex, HashesChainThroughParentAndIdentity) {
  PrefixIndex idx("model=a;L0=f16/f16", P, test_key);
  std::vector<int32_t> t = random_tokens(P, 2);
  const KvHash h0 = idx.page_hash(idx.root(), t.data());
  EXPECT_EQ(idx.page_hash(idx.root(), t.data()), h0);  // deterministic
  // Same tokens after a different prefix: a different page.
  const KvHash h1 = idx.page_hash(h0, t.data());
  EXPECT_NE(h1, h0);
  // Any token changes the hash.
  auto u = t;
  u[P - 1] += 1;
  EXPECT_NE(idx.page_hash(idx.root(), u.data()), h0);
  // Another policy identity (codec, page size, calibration ...) changes root and every page.
  PrefixIndex other("model=a;L0=int8/int8", P, test_key);
  EXPECT_NE(other.root(), idx.root());
  EXPECT_NE(other.page_hash(other.root(), t.data()), h0);
  // The identity is mixed into every page, not only the root: same parent value, other identity.
  EXPECT_NE(other.page_hash(idx.root(), t.data()), h0);
  // Other keys, other hashes (indexes with random keys cannot be attacked offline).
  PrefixIndex rnd("model=a;L0=f16/f16", P);
  EXPECT_NE(rnd.page_hash(rnd.root(), t.data()), h0);
}

TEST(PrefixIndex, LongestCachedPrefixOfFullPages) {
  PrefixIndex idx("id", P, test_key);
  const std::vector<int32_t> a = random_tokens(3 * P + 5, 3);  // 3 full pages + 5 tokens
  const auto hs = insert_chain(idx, a, 10);
  ASSERT_EQ(hs.size(), 3u);
  EXPECT_EQ(idx.n_entries(), 3u);

  // The whole sequence: 3 pages (the partial page is never cached).
  KvPrefixMatch m = idx.lookup(a.data(), int(a.size()));
  EXPECT_EQ(m.pages, (std::vector<KvPageId>{10, 11, 12}));
  EXPECT_EQ(m.hashes, hs);
  EXPECT_EQ(m.n_tokens(), 3 * P);

  // Diverges inside page 2: pages 0 and 1 match.
  auto b = a;
  b[2 * P + 3] ^= 1;
  m = idx.lookup(b.data(), int(b.size()));
  EXPECT_EQ(m.pages, (std::vector<KvPageId>{10, 11}));
  // Limit: a prompt of 2 pages + 15 tokens matches 2 pages.
  m = idx.lookup(a.data(), 3 * P - 1);
  EXPECT_EQ(m.n_tokens(), 2 * P);
  m = idx.lookup(a.data(), P - 1);
  EXPECT_EQ(m.n_tokens(), 0);
  // Page 1's tokens exist in the index, but after another page 0: no match at all.
  auto c = a;
  c[0] ^= 1;
  EXPECT_EQ(idx.lookup(c.data(), int(c.size())).n_tokens(), 0);
  // A sequence starting with page 1's tokens is not page 1.
  EXPECT_EQ(idx.lookup(a.data() + P, 2 * P).n_tokens(), 0);

  // Continuing a match: the pages after page 0 are pages 1 and 2, with the same hashes.
  m = idx.lookup_after(hs[0], a.data() + P, int(a.size()) - P);
  EXPECT_EQ(m.pages, (std::vector<KvPageId>{11, 12}));
  EXPECT_EQ(m.hashes, (std::vector<KvHash>{hs[1], hs[2]}));
  EXPECT_EQ(idx.lookup_after(idx.root(), a.data(), int(a.size())).pages, idx.lookup(a.data(), int(a.size())).pages);
  // The same tokens after another parent match nothing; limits apply as in lookup.
  EXPECT_EQ(idx.lookup_after(hs[1], a.data() + P, 2 * P).n_tokens(), 0);
  EXPECT_EQ(idx.lookup_after(hs[0], a.data() + P, P - 1).n_tokens(), 0);
}

TEST(PrefixIndex, DuplicatePrefixIsNotCachedTwice) {
  PrefixIndex idx("id", P, test_key);
  const auto a = random_tokens(2 * P, 4);
  insert_chain(idx, a, 0);
  KvHash h;
  EXPECT_EQ(idx.insert(idx.root(), a.data(), 7, &h), PrefixIndex::Insert::duplicate);
  EXPECT_EQ(h, idx.lookup(a.data(), P).hashes.at(0));
  EXPECT_FALSE(idx.contains_page(7));
  EXPECT_EQ(idx.stats().duplicate_pages, 1u);
  EXPECT_EQ(idx.stats().inserted_pages, 2u);
  // Branches share their common parent: a second continuation of page 0 is a new entry.
  auto b = a;
  b[P + 1] ^= 5;
  EXPECT_EQ(idx.insert(idx.lookup(a.data(), P).hashes[0], b.data() + P, 8, &h), PrefixIndex::Insert::inserted);
  EXPECT_EQ(idx.lookup(b.data(), 2 * P).pages, (std::vector<KvPageId>{0, 8}));
  EXPECT_EQ(idx.lookup(a.data(), 2 * P).pages, (std::vector<KvPageId>{0, 1}));
}

TEST(PrefixIndex, UnreferencedPagesAreEvictedLeastRecentlyUsedFirst) {
  PrefixIndex idx("id", P, test_key);
  const auto a = random_tokens(3 * P, 5);
  const auto b = random_tokens(2 * P, 6);
  insert_chain(idx, a, 0);   // pages 0 1 2
  insert_chain(idx, b, 10);  // pages 10 11
  EXPECT_EQ(idx.n_idle(), 0u);
  EXPECT_EQ(idx.kv_page_evict(), kv_page_none);  // all referenced: nothing evictable

  // Sequence a ends: its pages are released last to first.
  EXPECT_TRUE(idx.kv_page_unused(2));
  EXPECT_TRUE(idx.kv_page_unused(1));
  EXPECT_TRUE(idx.kv_page_unused(0));
  // Then b.
  EXPECT_TRUE(idx.kv_page_unused(11));
  EXPECT_TRUE(idx.kv_page_unused(10));
  EXPECT_FALSE(idx.kv_page_unused(99));  // not cached: the pool frees it
  EXPECT_EQ(idx.lru_pages(), (std::vector<KvPageId>{2, 1, 0, 11, 10}));
  EXPECT_EQ(idx.n_idle(), 5u);

  // A new request adopts a's first page: it leaves the LRU list, and when released again it is
  // the most recently used.
  idx.kv_page_reused(0);
  EXPECT_EQ(idx.lru_pages(), (std::vector<KvPageId>{2, 1, 11, 10}));
  EXPECT_TRUE(idx.kv_page_unused(0));
  EXPECT_EQ(idx.lru_pages(), (std::vector<KvPageId>{2, 1, 11, 10, 0}));

  // Pool pressure: the deepest, oldest pages go first, and their entries with them.
  EXPECT_EQ(idx.kv_page_evict(), 2);
  EXPECT_FALSE(idx.contains_page(2));
  EXPECT_EQ(idx.lookup(a.data(), 3 * P).n_tokens(), 2 * P);
  EXPECT_EQ(idx.kv_page_evict(), 1);
  EXPECT_EQ(idx.lookup(a.data(), 3 * P).n_tokens(), P);
  EXPECT_EQ(idx.kv_page_evict(), 11);
  EXPECT_EQ(idx.kv_page_evict(), 10);
  EXPECT_EQ(idx.kv_page_evict(), 0);
  EXPECT_EQ(idx.kv_page_evict(), kv_page_none);
  EXPECT_EQ(idx.n_entries(), 0u);
  EXPECT_EQ(idx.stats().evicted_pages, 5u);
  // An evicted page id can be cached again with new content.
  KvHash h;
  EXPECT_EQ(idx.insert(idx.root(), b.data(), 2, &h), PrefixIndex::Insert::inserted);
}

TEST(PrefixIndex, HitRateCountsPromptTokens) {
  PrefixIndex idx("id", P, test_key);
  EXPECT_EQ(idx.stats().hit_rate(), 0.0);
  idx.count_query(100, 0);
  idx.count_query(100, 64);
  idx.count_query(56, 48);
  const KvPrefixStats s = idx.stats();
  EXPECT_EQ(s.query_tokens, 256u);
  EXPECT_EQ(s.hit_tokens, 112u);
  EXPECT_DOUBLE_EQ(s.hit_rate(), 112.0 / 256.0);
  // A prefix extended after admission adds hits to its query, never beyond the queried tokens.
  idx.count_extra_hits(16);
  EXPECT_EQ(idx.stats().hit_tokens, 128u);
  EXPECT_EQ(idx.stats().query_tokens, 256u);
}

TEST(PrefixIndex, AttachedToAPoolIdlePagesStayResidentUntilNeeded) {
  PagePool pool(4, 256, P);
  PrefixIndex idx("id", P, test_key);
  pool.set_evictor(&idx);
  const auto a = random_tokens(2 * P, 7);
  // A sequence fills two pages and caches them, plus one uncached partial page.
  std::vector<KvPageId> seq;
  ASSERT_TRUE(pool.alloc_n(3, seq));
  KvHash h0, h1;
  idx.insert(idx.root(), a.data(), seq[0], &h0);
  idx.insert(h0, a.data() + P, seq[1], &h1);
  for (size_t i = seq.size(); i-- > 0;) pool.unref(seq[i]);
  EXPECT_EQ(pool.n_idle(), 2u);
  EXPECT_EQ(pool.n_free(), 2u);
  EXPECT_EQ(idx.n_idle(), 2u);

  // Another sequence adopts the prefix: the idle pages become used again.
  KvPrefixMatch m = idx.lookup(a.data(), 2 * P);
  ASSERT_EQ(m.pages.size(), 2u);
  for (KvPageId p : m.pages) pool.ref(p);
  EXPECT_EQ(pool.n_idle(), 0u);
  EXPECT_EQ(idx.n_idle(), 0u);
  EXPECT_EQ(pool.n_used(), 2u);
  for (size_t i = m.pages.size(); i-- > 0;) pool.unref(m.pages[i]);

  // Pressure: a sequence needing 3 pages takes the 2 free ones, then evicts the LRU idle page
  // (page 1 of the chain: released first).
  std::vector<KvPageId> big;
  ASSERT_TRUE(pool.alloc_n(3, big));
  EXPECT_EQ(big[2], seq[1]);
  EXPECT_EQ(idx.lookup(a.data(), 2 * P).n_tokens(), P);
  EXPECT_EQ(idx.stats().evicted_pages, 1u);
  EXPECT_EQ(pool.n_available(), 1u);
  for (KvPageId p : big) pool.unref(p);
  EXPECT_EQ(pool.n_free() + pool.n_idle(), pool.n_pages());
  EXPECT_EQ(pool.evict_idle(), 1u);
  EXPECT_EQ(pool.n_free(), pool.n_pages());
  EXPECT_EQ(idx.n_entries(), 0u);
  pool.set_evictor(nullptr);
}

// Page groups: group 0 names the chain; a sliding group (window 40 here) adds the pages its window
// still reads. A prefix is adoptable only as deep as those are cached; an entry whose group-0 page
// was evicted no longer matches, stays while a sliding page of it does, and is filled again by the
// next insert of the same prefix; bad group layouts are refused.
TEST(PrefixIndex, PageGroupsMatchOnlyWhatTheWindowsStillRead) {
  EXPECT_THROW(PrefixIndex("x", P, std::vector<int>{40}, &test_key), Error);     // group 0 must be full
  EXPECT_THROW(PrefixIndex("x", P, std::vector<int>{0, 0}, &test_key), Error);   // a sliding group needs a window
  PrefixIndex idx("groups", P, std::vector<int>{0, 40}, &test_key);
  EXPECT_EQ(idx.n_groups(), 2);
  EXPECT_EQ(kv_window_first_page(8 * P, 40, P), 5);  // the query at 128 sees 89..128
  EXPECT_EQ(kv_window_first_page(30, 40, P), 0);
  const auto t = random_tokens(8 * P, 7);
  // Pages 0..7 in group 0 as 100..107; group 1 holds 205..207 only (the others were freed).
  KvHash parent = idx.root();
  for (int i = 0; i < 8; ++i) {
    KvHash h;
    const std::vector<KvPageId> pages = {KvPageId(100 + i), i >= 5 ? KvPageId(200 + i) : kv_page_none};
    ASSERT_EQ(idx.insert(parent, t.data() + i * P, pages, &h), PrefixIndex::Insert::inserted);
    parent = h;
  }
  EXPECT_DEATH(idx.insert(idx.root(), t.data(), KvPageId(300), nullptr), "one page into an index of 2");
  KvPrefixMatch m = idx.lookup(t.data(), 8 * P);
  ASSERT_EQ(m.pages.size(), 8u);
  ASSERT_EQ(m.window_pages.size(), 1u);
  EXPECT_EQ(m.window_pages[0], (std::vector<KvPageId>{kv_page_none, kv_page_none, kv_page_none, kv_page_none,
                                                      kv_page_none, 205, 206, 207}));
  EXPECT_EQ(m.n_pages_total(), 11u);
  // 7 pages would need group 1's pages 4..6: 204 is missing, and so on down to 0.
  EXPECT_EQ(idx.lookup(t.data(), 8 * P - 1).pages.size(), 0u);
  // Continuing after page 6 (a sequence holding pages 0..6 and the window's pages before 7):
  // only page 7 and its window page are new.
  m = idx.lookup_after(m.hashes[6], t.data() + 7 * P, P, 7);
  ASSERT_EQ(m.pages.size(), 1u);
  EXPECT_EQ(m.window_pages[0], std::vector<KvPageId>{207});
  // Idle pages: group 1's 207 and group 0's 107 go idle, 207 first; eviction takes 207, and the
  // prefix is then adoptable nowhere deep (page 7's window page is gone).
  EXPECT_TRUE(idx.kv_page_unused(207));
  EXPECT_TRUE(idx.kv_page_unused(107));
  EXPECT_EQ(idx.kv_page_evict(), 207);
  EXPECT_EQ(idx.lookup(t.data(), 8 * P).pages.size(), 0u);
  // Evicting 107 leaves page 7's entry with no page at all: it goes.
  const size_t entries = idx.n_entries();
  EXPECT_EQ(idx.kv_page_evict(), 107);
  EXPECT_EQ(idx.n_entries(), entries - 1);
  // Page 6's group-0 page evicted while its window page stays: the entry no longer matches...
  EXPECT_TRUE(idx.kv_page_unused(106));
  EXPECT_EQ(idx.kv_page_evict(), 106);
  EXPECT_EQ(idx.n_entries(), entries - 1);  // 206 keeps it
  // ...until the same prefix is inserted again: its group-0 page fills the place, 206 stays.
  KvHash h5 = idx.root();
  for (int i = 0; i < 6; ++i) h5 = idx.page_hash(h5, t.data() + i * P);
  KvHash h6;
  EXPECT_EQ(idx.insert(h5, t.data() + 6 * P, std::vector<KvPageId>{306, 406}, &h6), PrefixIndex::Insert::inserted);
  EXPECT_TRUE(idx.contains_page(306));
  EXPECT_TRUE(idx.contains_page(206));
  EXPECT_FALSE(idx.contains_page(406));  // the place was taken: that page stays its sequence's
  m = idx.lookup_after(h5, t.data() + 6 * P, P, 6);
  ASSERT_EQ(m.pages.size(), 1u);
  EXPECT_EQ(m.pages[0], 306);
  EXPECT_EQ(m.window_pages[0], std::vector<KvPageId>{206});
  // A sliding place evicted while its position's group-0 page stayed (page 5: 105 stays, 205 goes)
  // is filled by the next sequence that computes the same page, although its group-0 page is a
  // duplicate.
  EXPECT_TRUE(idx.kv_page_unused(205));
  EXPECT_EQ(idx.kv_page_evict(), 205);
  KvHash h4 = idx.root();
  for (int i = 0; i < 5; ++i) h4 = idx.page_hash(h4, t.data() + i * P);
  EXPECT_EQ(idx.insert(h4, t.data() + 5 * P, std::vector<KvPageId>{505, 605}, nullptr), PrefixIndex::Insert::duplicate);
  EXPECT_FALSE(idx.contains_page(505));
  EXPECT_TRUE(idx.contains_page(605));
  EXPECT_EQ(idx.lookup_after(h4, t.data() + 5 * P, P, 5).window_pages[0], std::vector<KvPageId>{605});
}
