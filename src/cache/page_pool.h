// KV page pool: every KV page of every sequence, under one fixed memory budget.
//
// A page holds page_tokens tokens of one sequence for the layers of one page group (K and V head
// blocks in each layer's codec; see KvCache: every layer when the model has no sliding-window
// layer). Its size in bytes comes from the codecs (KvCache::pool_page_bytes()), so the same budget
// holds ~4x the pages (and tokens) with a 4-bit format as with f16.
//
// The pool is one 64-byte-aligned arena allocated once; a page is named by its id (its index in
// the arena). Each page is in exactly one of three states:
//   free  - on the free list, content meaningless;
//   used  - referenced by >= 1 sequences (refcount > 0); shared pages (prefix cache, forks) have
//           refcount > 1 and are never written (writers copy first: KvCache copy-on-write);
//   idle  - refcount 0 but kept resident by the evictor (the prefix cache, PrefixIndex) because a
//           later request may reuse its content; reclaimed (evicted, least recently used first)
//           only when alloc() finds the free list empty.
//   n_free() + n_idle() + n_used() == n_pages() at all times.
//
// For a scheduler:
//   - admission: a sequence that needs p more pages fits when p <= n_available() (free + idle);
//     KvCache::pages_needed(n) says how many pages appending n tokens takes (new pages plus
//     copy-on-write copies);
//   - preemption: when a sequence's append throws KvPoolFull, release() it (or another one) and
//     recompute it later;
//   - metrics: usage() (referenced pages / all pages, the "KV usage ratio"), tokens_capacity(),
//     n_used()/n_idle()/n_free().
//
// Threading: not synchronized. Allocation, ref/unref and the evictor run on one thread (the
// scheduler's); data() is a pure address computation and may be called from any thread while
// the set of pages does not change (attention reads pages from worker threads).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "core/aligned.h"
#include "core/error.h"

namespace kvq {

using KvPageId = int32_t;
inline constexpr KvPageId kv_page_none = -1;

// Thrown by KvCache::append (and anything else that must allocate pages) when the pool cannot
// supply them even after evicting every idle cached page. The sequence is left exactly as it was
// before the call (same tokens, same pages), so the scheduler can preempt: release this or
// another sequence and retry, or recompute later.
struct KvPoolFull : Error {
  KvPoolFull(size_t needed, size_t available);
  size_t pages_needed;
  size_t pages_available;
};

// The pool's hook into a page cache (PrefixIndex implements it). The pool calls it, on the
// pool's thread, when the reference state of a page changes.
class KvPageEvictor {
 public:
  virtual ~KvPageEvictor() = default;
  // The last reference to `page` went away. Return true to keep the page resident (it becomes
  // idle and the evictor must later hand it back through kv_page_evict), false to free it.
  virtual bool kv_page_unused(KvPageId page) = 0;
  // An idle page got a reference again (a sequence adopted it): it is no longer evictable.
  virtual void kv_page_reused(KvPageId page) = 0;
  // The pool needs a page: forget the least recently used idle page and return it, or
  // kv_page_none when no page is idle.
  virtual KvPageId kv_page_evict() = 0;
};

class PagePool {
 public:
  // n_pages pages of page_bytes bytes (rounded up to 64 so every page starts on a cache line).
  // Throws kvq::Error when n_pages < 1, page_bytes == 0 or the arena cannot be allocated.
  PagePool(size_t n_pages, size_t page_bytes, int page_tokens);
  // --kv-mem: as many pages as fit in budget_bytes (at least one, else kvq::Error).
  static std::unique_ptr<PagePool> from_bytes(size_t budget_bytes, size_t page_bytes, int page_tokens);
  // Enough pages for `tokens` tokens (rounded up to whole pages) when a page holds every layer.
  static std::unique_ptr<PagePool> from_tokens(size_t tokens, size_t page_bytes, int page_tokens);
  PagePool(const PagePool&) = delete;
  PagePool& operator=(const PagePool&) = delete;

  size_t page_bytes() const { return page_bytes_; }    // bytes one page holds (what KvCache asked for)
  size_t page_stride() const { return page_stride_; }  // distance between pages in the arena
  int page_tokens() const { return page_tokens_; }
  size_t n_pages() const { return n_pages_; }
  size_t n_free() const { return free_.size(); }
  size_t n_idle() const { return n_idle_; }
  size_t n_used() const { return n_pages_ - free_.size() - n_idle_; }
  // Pages alloc() can still hand out: free ones plus idle cached ones it would evict.
  size_t n_available() const { return free_.size() + n_idle_; }
  // Positions the pages hold (a sequence's tokens when a page holds every layer; with page groups,
  // KvCache::tokens_in_pages).
  size_t tokens_capacity() const { return n_pages_ * size_t(page_tokens_); }
  size_t arena_bytes() const { return n_pages_ * page_stride_; }
  // Referenced pages / all pages: idle cached pages count as available, as a scheduler sees them.
  double usage() const { return double(n_used()) / double(n_pages_); }

  // A zeroed page with refcount 1 (codecs may assume a fresh head block is zero, as a private
  // cache's pages are), evicting the least recently used idle page when the free list is empty;
  // kv_page_none when no page is available.
  KvPageId alloc();
  // n pages or none: false (and nothing allocated) when fewer than n are available.
  bool alloc_n(size_t n, std::vector<KvPageId>& out);
  // One more reference. A used page stays used; an idle page becomes used again (the evictor is
  // told). Referencing a free page is an invariant violation.
  void ref(KvPageId page);
  // One reference fewer. At zero the page goes idle if the evictor keeps it, else free.
  void unref(KvPageId page);
  int refcount(KvPageId page) const { return state(page).refs; }
  bool is_free(KvPageId page) const { return state(page).where == Where::free; }
  bool is_idle(KvPageId page) const { return state(page).where == Where::idle; }

  // Start of the page's bytes: (page_bytes,) 64-byte aligned.
  uint8_t* data(KvPageId page) { return arena_.get() + size_t(check_id(page)) * page_stride_; }
  const uint8_t* data(KvPageId page) const { return arena_.get() + size_t(check_id(page)) * page_stride_; }

  // The page cache that keeps unreferenced pages (or null). Detaching requires no idle pages.
  void set_evictor(KvPageEvictor* e);
  KvPageEvictor* evictor() const { return evictor_; }
  // Moves up to max_pages idle pages (least recently used first) to the free list, e.g. to drop
  // the prefix cache; returns how many.
  size_t evict_idle(size_t max_pages = SIZE_MAX);

 private:
  enum class Where : uint8_t { free, used, idle };
  struct PageState {
    int32_t refs = 0;
    Where where = Where::free;
  };
  KvPageId check_id(KvPageId page) const {
    KVQ_CHECK(page >= 0 && size_t(page) < n_pages_, "page id {} out of range [0, {})", page, n_pages_);
    return page;
  }
  const PageState& state(KvPageId page) const { return states_[size_t(check_id(page))]; }
  KvPageId take(KvPageId page);  // free/idle -> used with one reference, zeroed

  size_t n_pages_ = 0, page_bytes_ = 0, page_stride_ = 0;
  int page_tokens_ = 0;
  std::unique_ptr<uint8_t[], AlignedFree> arena_;  // (n_pages, page_stride)
  std::vector<PageState> states_;  // (n_pages,)
  std::vector<KvPageId> free_;     // stack: the most recently freed page is reused first (warm)
  size_t n_idle_ = 0;
  KvPageEvictor* evictor_ = nullptr;
};

}  // namespace kvq
