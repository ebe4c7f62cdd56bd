// Prefix cache metadata: which resident KV pages hold which token prefixes. Pure bookkeeping
// over page ids and token ids (no kernel code, no page bytes), testable without a pool or model.
//
// Identity of a page. Only FULL pages are cached. Page i of a sequence (tokens
// [i*P, (i+1)*P), P = page_tokens) is named by a chained hash
//     h_i = H(h_{i-1}, root, tokens of page i),   h_{-1} = root = H(identity)
// so a page's hash names its whole prefix (the same tokens after a different prefix hash
// differently) and the policy identity: every page hash includes `root`, the hash of a string
// that names everything that changes the page bytes (model, per-layer K/V codec names,
// page_tokens, head shapes, seed, RoPE, grouped-codec parameters, calibration file hash; see
// KvCache::prefix_identity()). Two caches share pages only if their identity strings are equal.
//
// H is 128 bits: two SipHash-2-4 (Aumasson & Bernstein, 2012) with independent keys. The keys
// are drawn per index at random by default, so nobody can craft prompts whose hashes collide.
// A lookup also compares the page's stored token ids and its stored parent hash with the query:
// a different page content can never match; a wrong match would need two different prefixes
// whose 128-bit keyed chain hashes are equal (probability ~2^-128 per pair).
//
// Life of a cached page (with a PagePool as the page owner, through KvPageEvictor):
//   insert()            - a sequence filled page i (all layers packed): the entry points at that
//                         sequence's page, which stays referenced by it;
//   lookup()            - longest chain of cached pages matching a prompt (read only);
//   kv_page_reused()    - a sequence adopted the page (PagePool::ref of an idle page): it leaves
//                         the LRU list;
//   kv_page_unused()    - its last reference went away: it joins the LRU list (most recently
//                         used end) and stays resident;
//   kv_page_evict()     - the pool ran out of free pages: the least recently used idle page's
//                         entry is dropped and the page returned to the pool.
// A sequence releases its pages last to first, so the deepest pages of a chain become the
// least recently used and are evicted before their parents (a parent evicted first would make
// its cached descendants unreachable until they age out).
//
// Page groups. A KvCache in a pool keeps sliding-window layers in page groups of their own
// (kv_cache.h): a chain position then holds one page per group. Group 0 holds the full-attention
// layers and names the chain: a position is matched only while its group-0 page is cached. Group
// g >= 1 holds layers that see the last windows[g] positions; its pages are needed only for the
// positions the next query still sees, so a prefix of k pages is adoptable when, for every such
// group, the pages from kv_window_first_page(k * P, windows[g], P) to k - 1 are cached too (the
// longest adoptable prefix may be shorter than the longest matched chain). A sliding group's page
// is released by its sequences as soon as they are past it and then ages on the LRU list like any
// idle page; since every sequence that references it also references the same position's group-0
// page, it always becomes idle before that page and is evicted first. An entry whose group-0 page
// was evicted no longer matches and goes when its last page does; inserting the same prefix again
// fills it.
//
// Hit accounting in tokens (count_query): queries = prompt tokens looked up, hits = prompt
// tokens served from cache; re-admissions after a preemption in counters of their own.
//
// Threading: not synchronized; one thread (the scheduler's) owns the index, like the pool.
// Lifetime: the pool keeps a raw pointer to its evictor. Destroy the pool first, or empty the
// cache (pool.evict_idle()) and detach (pool.set_evictor(nullptr)) before destroying the index.
#pragma once
#include <cstddef>
#include <algorithm>
#include <cstdint>
#include <list>
#include <string>
#include <unordered_map>
#include <vector>

#include "cache/page_pool.h"

namespace kvq {

// SipHash-2-4 of n bytes under the 128-bit key (k0, k1): a keyed 64-bit PRF.
uint64_t kv_siphash24(uint64_t k0, uint64_t k1, const void* data, size_t n);

struct KvHash {
  uint64_t lo = 0, hi = 0;
  bool operator==(const KvHash&) const = default;
};

struct KvHashKey {  // 128-bit hash: two SipHash-2-4 keys
  uint64_t k0 = 0, k1 = 0, k2 = 0, k3 = 0;
};
KvHash kv_hash128(const KvHashKey& key, const void* data, size_t n);
// A key drawn from std::random_device.
KvHashKey kv_random_key();

// The first page (of page_tokens tokens) a sliding-window layer of `window` positions still reads
// once a sequence holds n_tokens tokens: its next query, at position n_tokens, sees positions
// n_tokens + 1 - window and later.
inline int kv_window_first_page(int n_tokens, int window, int page_tokens) {
  return window > 0 ? std::max(0, n_tokens + 1 - window) / page_tokens : 0;
}

// The longest cached prefix of a token sequence: pages[i] (group 0) holds tokens [i*P, (i+1)*P).
struct KvPrefixMatch {
  std::vector<KvPageId> pages;
  // Per sliding group g >= 1 (window_pages[g - 1]): (pages.size(),) its pages, kv_page_none for the
  // positions its window no longer reads. Empty when the index has one group.
  std::vector<std::vector<KvPageId>> window_pages;
  std::vector<KvHash> hashes;  // chain hash of each matched page
  int page_tokens = 0;
  int n_tokens() const { return int(pages.size()) * page_tokens; }
  // Pages of every group that adopting the match references.
  size_t n_pages_total() const {
    size_t n = pages.size();
    for (const auto& w : window_pages)
      for (KvPageId p : w) n += p != kv_page_none ? 1 : 0;
    return n;
  }
};

struct KvPrefixStats {
  uint64_t query_tokens = 0;   // prompt tokens looked up (count_query)
  uint64_t hit_tokens = 0;     // of those, served from cached pages
  // Sequences admitted again after a preemption, counted apart (as vLLM does): re-finding their own
  // published pages is not prefix reuse, and would make the hit rate grow with preemptions.
  uint64_t readmit_query_tokens = 0;
  uint64_t readmit_hit_tokens = 0;
  uint64_t inserted_pages = 0;
  uint64_t duplicate_pages = 0;  // insert of a page whose prefix was already cached (kept private)
  uint64_t collisions = 0;       // same hash, different content (page not cached)
  uint64_t evicted_pages = 0;
  size_t entries = 0;          // cached pages (referenced or idle)
  size_t idle = 0;             // of those, unreferenced (on the LRU list, evictable)
  double hit_rate() const { return query_tokens ? double(hit_tokens) / double(query_tokens) : 0.0; }
};

// Where evicted pages go instead of being dropped (KvOffload). Called by kv_page_evict while the
// page's bytes are still intact in the pool.
class KvPageSpill {
 public:
  virtual ~KvPageSpill() = default;
  // Page `page` of page group `group`, cached as the page named `hash` (tokens (page_tokens,)
  // after the prefix named `parent`), is being evicted.
  virtual void kv_page_spill(const KvHash& hash, const KvHash& parent, const int32_t* tokens, int group,
                             KvPageId page) = 0;
};

class PrefixIndex : public KvPageEvictor {
 public:
  // identity: see the header comment; page_tokens: tokens per page (power of two 16..256).
  // Keys are drawn from std::random_device.
  PrefixIndex(std::string identity, int page_tokens);
  // Fixed keys (tests; an index whose hashes must be reproducible across processes).
  PrefixIndex(std::string identity, int page_tokens, const KvHashKey& key);
  // Page groups (see the header comment): group_windows[g] is group g's window, 0 for group 0.
  // key == null: random keys.
  PrefixIndex(std::string identity, int page_tokens, std::vector<int> group_windows, const KvHashKey* key = nullptr);
  PrefixIndex(const PrefixIndex&) = delete;
  PrefixIndex& operator=(const PrefixIndex&) = delete;

  const std::string& identity() const { return identity_; }
  int page_tokens() const { return page_tokens_; }
  int n_groups() const { return int(windows_.size()); }
  const std::vector<int>& group_windows() const { return windows_; }
  // Parent hash of page 0: H(identity).
  const KvHash& root() const { return root_; }
  // Chain hash of a page: tokens (page_tokens,) following the prefix named by parent.
  KvHash page_hash(const KvHash& parent, const int32_t* tokens) const;

  // Longest adoptable run of cached full pages that starts at token 0 of tokens (n,), at most
  // floor(n / page_tokens) pages. Does not change LRU order or statistics.
  KvPrefixMatch lookup(const int32_t* tokens, int n) const;
  // The same, continuing a prefix already matched: cached pages that follow the prefix named by
  // `parent` (root() for none), tokens (n,) being the tokens after that prefix and first_page the
  // position of the first of them (the pages before it, those the windows need included, are the
  // caller's). A scheduler uses it to extend a sequence's adopted prefix with pages published
  // since it was admitted.
  KvPrefixMatch lookup_after(const KvHash& parent, const int32_t* tokens, int n, int first_page = 0) const;

  enum class Insert { inserted, duplicate, collision };
  // Caches page `page` as the page after the prefix `parent` holding tokens (page_tokens,).
  // The page must be referenced by its sequence now (it is not put on the LRU list until
  // kv_page_unused) and must not already be cached. *hash receives the chain hash (whatever the
  // result, so the caller can keep chaining). duplicate: the same prefix is already cached in
  // another page (this one stays uncached); collision: another content has this hash.
  Insert insert(const KvHash& parent, const int32_t* tokens, KvPageId page, KvHash* hash);
  // With page groups: pages (n_groups(),), one per group, kv_page_none for a sliding group's page
  // its sequence no longer holds; pages[0] is required.
  Insert insert(const KvHash& parent, const int32_t* tokens, const std::vector<KvPageId>& pages, KvHash* hash);

  // The page group `group` holds for the page named `hash`, or kv_page_none.
  KvPageId page_of(const KvHash& hash, int group) const;
  // A page read back from an offload tier: caches `page` (referenced by the caller, who releases
  // it later like any adopted page) as group `group`'s page of the page named by (parent,
  // tokens). Group 0 creates the entry if needed; a sliding group's page needs the entry's group-0
  // page cached. False (nothing cached) when that place is taken, the hash collides or, for a
  // sliding group, group 0 is not cached.
  bool restore(const KvHash& parent, const int32_t* tokens, int group, KvPageId page);
  // Evicted pages go to `spill` (null: dropped). The spill must outlive the index or be detached.
  void set_spill(KvPageSpill* spill) { spill_ = spill; }

  // Hit accounting: prompt_tokens looked up, hit_tokens of them served from the cache.
  void count_query(int prompt_tokens, int hit_tokens, bool readmission = false);
  // More hit tokens for a query already counted (a prefix extended after admission): the caller
  // guarantees the total hits of that query stay <= its prompt tokens.
  void count_extra_hits(int hit_tokens, bool readmission = false);
  KvPrefixStats stats() const;
  size_t n_entries() const { return entries_.size(); }
  size_t n_idle() const { return lru_.size(); }
  bool contains_page(KvPageId page) const { return by_page_.count(page) != 0; }
  // Idle pages, least recently used first (tests, diagnostics).
  std::vector<KvPageId> lru_pages() const { return {lru_.begin(), lru_.end()}; }

  // KvPageEvictor (called by the PagePool this index is attached to).
  bool kv_page_unused(KvPageId page) override;
  void kv_page_reused(KvPageId page) override;
  KvPageId kv_page_evict() override;

 private:
  struct HashOf {
    size_t operator()(const KvHash& h) const { return size_t(h.lo ^ (h.hi * 0x9e3779b97f4a7c15ull)); }
  };
  struct Entry {
    KvHash parent;
    std::vector<int32_t> tokens;  // (page_tokens,) compared on every match
    std::vector<KvPageId> pages;  // per group; kv_page_none: not cached
    std::vector<char> idle;       // per group
    std::vector<std::list<KvPageId>::iterator> lru;  // per group, valid when idle
  };
  struct PageRef {
    KvHash entry;
    int group = 0;
  };
  Entry& entry_of(KvPageId page, int* group);
  Entry new_entry(const KvHash& parent, const int32_t* tokens) const;  // no page cached yet

  std::string identity_;
  int page_tokens_ = 0;
  std::vector<int> windows_;  // per group
  KvHashKey key_;
  KvHash root_;
  std::unordered_map<KvHash, Entry, HashOf> entries_;
  std::unordered_map<KvPageId, PageRef> by_page_;
  std::list<KvPageId> lru_;  // idle cached pages, least recently used at the front
  KvPrefixStats stats_;
  KvPageSpill* spill_ = nullptr;
};

}  // namespace kvq
