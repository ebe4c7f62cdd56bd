#include "cache/page_pool.h"

#include <cstdlib>
#include <cstring>

namespace kvq {

KvPoolFull::KvPoolFull(size_t needed, size_t available)
    : Error(fmt::format("KV page pool full: {} pages needed, {} available", needed, available)),
      pages_needed(needed),
      pages_available(available) {}

PagePool::PagePool(size_t n_pages, size_t page_bytes, int page_tokens)
    : n_pages_(n_pages), page_bytes_(page_bytes), page_tokens_(page_tokens) {
  if (page_tokens < 16 || page_tokens > 256 || (page_tokens & (page_tokens - 1)))
    fail("KV page pool: page size {} tokens must be a power of two in 16..256", page_tokens);
  if (page_bytes == 0) fail("KV page pool: page size of 0 bytes");
  if (n_pages < 1) fail("KV page pool: a pool needs at least one page");
  // Page ids are int32; more pages than that would not fit any real budget anyway.
  if (n_pages > size_t(INT32_MAX)) fail("KV page pool: {} pages exceed the limit of {}", n_pages, INT32_MAX);
  page_stride_ = (page_bytes + 63) & ~size_t(63);
  if (page_stride_ > SIZE_MAX / n_pages) fail("KV page pool: {} pages of {} bytes overflow", n_pages, page_bytes);
  // One allocation for the whole budget: the OS maps it lazily, and pages never move, so a
  // page id is a stable address for the pool's lifetime. Not zeroed here: alloc() zeroes.
  // Pools of 2 MiB or more are aligned to 2 MiB and marked for transparent huge pages: decode
  // attention walks pages scattered over the whole pool, and with 4 KiB mappings the TLB misses
  // cost ~20% of an f16 decode step at 32K tokens (bench/attn_bench KVQ_ATTN_BENCH_HUGEPAGES=1).
  // Where THP is off or unsupported the advice is ignored.
  const size_t bytes = n_pages * page_stride_;
  void* p = bytes >= kHugePageBytes ? aligned_alloc_huge(bytes) : std::aligned_alloc(64, bytes);
  if (!p) fail("KV page pool: cannot allocate {} bytes ({} pages of {} bytes)", n_pages * page_stride_, n_pages, page_stride_);
  arena_.reset(static_cast<uint8_t*>(p));
  states_.resize(n_pages);
  free_.reserve(n_pages);
  // Stack order: page 0 is handed out first.
  for (size_t i = n_pages; i-- > 0;) free_.push_back(KvPageId(i));
}

std::unique_ptr<PagePool> PagePool::from_bytes(size_t budget_bytes, size_t page_bytes, int page_tokens) {
  if (page_bytes == 0) fail("KV page pool: page size of 0 bytes");
  const size_t stride = (page_bytes + 63) & ~size_t(63);
  const size_t n = budget_bytes / stride;
  if (n < 1) fail("KV memory budget of {} bytes is smaller than one page ({} bytes, {} tokens)", budget_bytes, stride, page_tokens);
  return std::make_unique<PagePool>(n, page_bytes, page_tokens);
}

std::unique_ptr<PagePool> PagePool::from_tokens(size_t tokens, size_t page_bytes, int page_tokens) {
  if (tokens < 1) fail("KV token budget must be at least one token");
  if (page_tokens <= 0) fail("KV page pool: page size {} tokens is invalid", page_tokens);
  return std::make_unique<PagePool>((tokens + size_t(page_tokens) - 1) / size_t(page_tokens), page_bytes, page_tokens);
}

KvPageId PagePool::take(KvPageId page) {
  PageState& s = states_[size_t(page)];
  s.refs = 1;
  s.where = Where::used;
  std::memset(data(page), 0, page_stride_);
  return page;
}

KvPageId PagePool::alloc() {
  if (!free_.empty()) {
    const KvPageId p = free_.back();
    free_.pop_back();
    KVQ_CHECK(states_[size_t(p)].where == Where::free, "page {} on the free list is not free", p);
    return take(p);
  }
  if (!evictor_ || n_idle_ == 0) return kv_page_none;
  const KvPageId p = evictor_->kv_page_evict();
  if (p == kv_page_none) return kv_page_none;
  KVQ_CHECK(state(p).where == Where::idle, "evictor returned page {} which is not idle", p);
  --n_idle_;
  return take(p);
}

bool PagePool::alloc_n(size_t n, std::vector<KvPageId>& out) {
  if (n > n_available()) return false;
  for (size_t i = 0; i < n; ++i) {
    const KvPageId p = alloc();
    KVQ_CHECK(p != kv_page_none, "pool reported {} available pages but ran out after {}", n_available() + i, i);
    out.push_back(p);
  }
  return true;
}

void PagePool::ref(KvPageId page) {
  PageState& s = states_[size_t(check_id(page))];
  KVQ_CHECK(s.where != Where::free, "reference to free page {}", page);
  if (s.where == Where::idle) {
    KVQ_CHECK(s.refs == 0, "idle page {} has {} references", page, s.refs);
    s.where = Where::used;
    --n_idle_;
    if (evictor_) evictor_->kv_page_reused(page);
  }
  ++s.refs;
}

void PagePool::unref(KvPageId page) {
  PageState& s = states_[size_t(check_id(page))];
  KVQ_CHECK(s.where == Where::used && s.refs > 0, "unreference of page {} that holds no reference", page);
  if (--s.refs > 0) return;
  if (evictor_ && evictor_->kv_page_unused(page)) {
    s.where = Where::idle;
    ++n_idle_;
  } else {
    s.where = Where::free;
    free_.push_back(page);
  }
}

void PagePool::set_evictor(KvPageEvictor* e) {
  KVQ_CHECK(n_idle_ == 0 || e == evictor_, "changing the evictor while it holds {} idle pages", n_idle_);
  evictor_ = e;
}

size_t PagePool::evict_idle(size_t max_pages) {
  size_t n = 0;
  while (n < max_pages && evictor_ && n_idle_ > 0) {
    const KvPageId p = evictor_->kv_page_evict();
    if (p == kv_page_none) break;
    KVQ_CHECK(state(p).where == Where::idle, "evictor returned page {} which is not idle", p);
    states_[size_t(p)].where = Where::free;
    --n_idle_;
    free_.push_back(p);
    ++n;
  }
  return n;
}

}  // namespace kvq
