#include "cache/prefix_index.h"

#include <algorithm>
#include <cstring>
#include <random>

#include "core/error.h"

namespace kvq {

namespace {

inline uint64_t rotl(uint64_t x, int b) { return (x << b) | (x >> (64 - b)); }

inline void sip_round(uint64_t& v0, uint64_t& v1, uint64_t& v2, uint64_t& v3) {
  v0 += v1; v1 = rotl(v1, 13); v1 ^= v0; v0 = rotl(v0, 32);
  v2 += v3; v3 = rotl(v3, 16); v3 ^= v2;
  v0 += v3; v3 = rotl(v3, 21); v3 ^= v0;
  v2 += v1; v1 = rotl(v1, 17); v1 ^= v2; v2 = rotl(v2, 32);
}

inline uint64_t load_le64(const uint8_t* p) {
  uint64_t x = 0;
  for (int i = 0; i < 8; ++i) x |= uint64_t(p[i]) << (8 * i);
  return x;
}

inline void store_le64(uint8_t* p, uint64_t x) {
  for (int i = 0; i < 8; ++i) p[i] = uint8_t(x >> (8 * i));
}

}  // namespace

KvHashKey kv_random_key() {
  std::random_device rd;
  auto r64 = [&] { return (uint64_t(rd()) << 32) ^ uint64_t(rd()); };
  KvHashKey k;
  k.k0 = r64();
  k.k1 = r64();
  k.k2 = r64();
  k.k3 = r64();
  return k;
}

uint64_t kv_siphash24(uint64_t k0, uint64_t k1, const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  uint64_t v0 = k0 ^ 0x736f6d6570736575ull;
  uint64_t v1 = k1 ^ 0x646f72616e646f6dull;
  uint64_t v2 = k0 ^ 0x6c7967656e657261ull;
  uint64_t v3 = k1 ^ 0x7465646279746573ull;
  const size_t full = n & ~size_t(7);
  for (size_t i = 0; i < full; i += 8) {
    const uint64_t m = load_le64(p + i);
    v3 ^= m;
    sip_round(v0, v1, v2, v3);
    sip_round(v0, v1, v2, v3);
    v0 ^= m;
  }
  // Last word: the remaining bytes, and the message length mod 256 in the top byte.
  uint64_t b = uint64_t(n & 0xff) << 56;
  for (size_t i = 0; i < n - full; ++i) b |= uint64_t(p[full + i]) << (8 * i);
  v3 ^= b;
  sip_round(v0, v1, v2, v3);
  sip_round(v0, v1, v2, v3);
  v0 ^= b;
  v2 ^= 0xff;
  for (int i = 0; i < 4; ++i) sip_round(v0, v1, v2, v3);
  return v0 ^ v1 ^ v2 ^ v3;
}

KvHash kv_hash128(const KvHashKey& key, const void* data, size_t n) {
  return {kv_siphash24(key.k0, key.k1, data, n), kv_siphash24(key.k2, key.k3, data, n)};
}

PrefixIndex::PrefixIndex(std::string identity, int page_tokens)
    : PrefixIndex(std::move(identity), page_tokens, std::vector<int>{0}, nullptr) {}

PrefixIndex::PrefixIndex(std::string identity, int page_tokens, const KvHashKey& key)
    : PrefixIndex(std::move(identity), page_tokens, std::vector<int>{0}, &key) {}

PrefixIndex::PrefixIndex(std::string identity, int page_tokens, std::vector<int> group_windows, const KvHashKey* key)
    : identity_(std::move(identity)), page_tokens_(page_tokens), windows_(std::move(group_windows)),
      key_(key ? *key : kv_random_key()) {
  if (page_tokens < 16 || page_tokens > 256 || (page_tokens & (page_tokens - 1)))
    fail("prefix index: page size {} tokens must be a power of two in 16..256", page_tokens);
  if (windows_.empty() || windows_[0] != 0) fail("prefix index: page group 0 must hold full-attention layers");
  for (size_t g = 1; g < windows_.size(); ++g)
    if (windows_[g] <= 0) fail("prefix index: page group {} has window {}", g, windows_[g]);
  root_ = kv_hash128(key_, identity_.data(), identity_.size());
}

KvHash PrefixIndex::page_hash(const KvHash& parent, const int32_t* tokens) const {
  // parent (16 bytes) | root (16 bytes) | token ids as little-endian int32: a fixed byte
  // serialization, so the hash does not depend on the host's struct layout.
  uint8_t buf[32 + 4 * 256];
  store_le64(buf, parent.lo);
  store_le64(buf + 8, parent.hi);
  store_le64(buf + 16, root_.lo);
  store_le64(buf + 24, root_.hi);
  for (int i = 0; i < page_tokens_; ++i) {
    const uint32_t t = uint32_t(tokens[i]);
    uint8_t* q = buf + 32 + 4 * i;
    q[0] = uint8_t(t);
    q[1] = uint8_t(t >> 8);
    q[2] = uint8_t(t >> 16);
    q[3] = uint8_t(t >> 24);
  }
  return kv_hash128(key_, buf, 32 + 4 * size_t(page_tokens_));
}

KvPrefixMatch PrefixIndex::lookup(const int32_t* tokens, int n) const { return lookup_after(root_, tokens, n, 0); }

KvPrefixMatch PrefixIndex::lookup_after(const KvHash& parent_of_first, const int32_t* tokens, int n, int first_page) const {
  KvPrefixMatch m;
  m.page_tokens = page_tokens_;
  const int P = page_tokens_;
  const size_t G = windows_.size();
  m.window_pages.resize(G - 1);
  KvHash parent = parent_of_first;
  for (int i = 0; (i + 1) * P <= n; ++i) {
    const int32_t* t = tokens + size_t(i) * size_t(P);
    const KvHash h = page_hash(parent, t);
    auto it = entries_.find(h);
    if (it == entries_.end()) break;
    const Entry& e = it->second;
    if (e.pages[0] == kv_page_none || !(e.parent == parent) ||
        std::memcmp(e.tokens.data(), t, sizeof(int32_t) * size_t(P)) != 0)
      break;
    m.pages.push_back(e.pages[0]);
    for (size_t g = 1; g < G; ++g) m.window_pages[g - 1].push_back(e.pages[g]);
    m.hashes.push_back(h);
    parent = h;
  }
  // The longest prefix whose sliding groups hold every page their windows still read.
  size_t k = m.pages.size();
  const auto adoptable = [&](size_t k) {
    for (size_t g = 1; g < G; ++g) {
      const int f = kv_window_first_page((first_page + int(k)) * P, windows_[g], P) - first_page;
      for (size_t i = size_t(std::max(0, f)); i < k; ++i)
        if (m.window_pages[g - 1][i] == kv_page_none) return false;
    }
    return true;
  };
  while (k > 0 && !adoptable(k)) --k;
  m.pages.resize(k);
  m.hashes.resize(k);
  for (size_t g = 1; g < G; ++g) {
    auto& w = m.window_pages[g - 1];
    w.resize(k);
    const int f = kv_window_first_page((first_page + int(k)) * P, windows_[g], P) - first_page;
    for (int i = 0; i < std::min(f, int(k)); ++i) w[size_t(i)] = kv_page_none;
  }
  return m;
}

PrefixIndex::Entry PrefixIndex::new_entry(const KvHash& parent, const int32_t* tokens) const {
  Entry e;
  e.parent = parent;
  e.tokens.assign(tokens, tokens + page_tokens_);
  e.pages.assign(windows_.size(), kv_page_none);
  e.idle.assign(windows_.size(), 0);
  e.lru.resize(windows_.size());
  return e;
}

PrefixIndex::Insert PrefixIndex::insert(const KvHash& parent, const int32_t* tokens, KvPageId page, KvHash* hash) {
  KVQ_CHECK(windows_.size() == 1, "insert of one page into an index of {} page groups", windows_.size());
  return insert(parent, tokens, std::vector<KvPageId>{page}, hash);
}

PrefixIndex::Insert PrefixIndex::insert(const KvHash& parent, const int32_t* tokens, const std::vector<KvPageId>& pages,
                                        KvHash* hash) {
  KVQ_CHECK(pages.size() == windows_.size(), "insert of {} pages into an index of {} page groups", pages.size(),
            windows_.size());
  KVQ_CHECK(pages[0] != kv_page_none, "caching an invalid page");
  for (KvPageId p : pages) KVQ_CHECK(p == kv_page_none || !contains_page(p), "page {} is already cached", p);
  const KvHash h = page_hash(parent, tokens);
  if (hash) *hash = h;
  auto it = entries_.find(h);
  Entry* e = nullptr;
  if (it != entries_.end()) {
    e = &it->second;
    const bool same = e->parent == parent && std::memcmp(e->tokens.data(), tokens, sizeof(int32_t) * size_t(page_tokens_)) == 0;
    if (!same) {
      ++stats_.collisions;
      return Insert::collision;
    }
    if (e->pages[0] != kv_page_none) {
      // Already cached. Sliding groups' places that were evicted (they go first) are filled with
      // this sequence's pages: the same tokens after the same prefix, so the same bytes.
      for (size_t g = 1; g < pages.size(); ++g)
        if (pages[g] != kv_page_none && e->pages[g] == kv_page_none) {
          e->pages[g] = pages[g];
          by_page_.emplace(pages[g], PageRef{h, int(g)});
        }
      ++stats_.duplicate_pages;
      return Insert::duplicate;
    }
    // Its group-0 page was evicted while sliding groups' pages stayed: fill the empty places.
  } else {
    e = &entries_.emplace(h, new_entry(parent, tokens)).first->second;
  }
  for (size_t g = 0; g < pages.size(); ++g) {
    if (pages[g] == kv_page_none || e->pages[g] != kv_page_none) continue;
    e->pages[g] = pages[g];
    by_page_.emplace(pages[g], PageRef{h, int(g)});
  }
  ++stats_.inserted_pages;
  return Insert::inserted;
}

KvPageId PrefixIndex::page_of(const KvHash& hash, int group) const {
  auto it = entries_.find(hash);
  if (it == entries_.end() || group < 0 || size_t(group) >= windows_.size()) return kv_page_none;
  return it->second.pages[size_t(group)];
}

bool PrefixIndex::restore(const KvHash& parent, const int32_t* tokens, int group, KvPageId page) {
  KVQ_CHECK(group >= 0 && size_t(group) < windows_.size(), "page group {} of {}", group, windows_.size());
  KVQ_CHECK(page != kv_page_none && !contains_page(page), "restoring page {} that is cached or invalid", page);
  const KvHash h = page_hash(parent, tokens);
  auto it = entries_.find(h);
  if (it == entries_.end()) {
    if (group != 0) return false;
    it = entries_.emplace(h, new_entry(parent, tokens)).first;
  } else {
    const Entry& e = it->second;
    if (!(e.parent == parent) || std::memcmp(e.tokens.data(), tokens, sizeof(int32_t) * size_t(page_tokens_)) != 0) {
      ++stats_.collisions;
      return false;
    }
    if (e.pages[size_t(group)] != kv_page_none || (group != 0 && e.pages[0] == kv_page_none)) return false;
  }
  it->second.pages[size_t(group)] = page;
  by_page_.emplace(page, PageRef{h, group});
  return true;
}

void PrefixIndex::count_query(int prompt_tokens, int hit_tokens, bool readmission) {
  KVQ_CHECK(prompt_tokens >= 0 && hit_tokens >= 0 && hit_tokens <= prompt_tokens, "query of {} tokens with {} hits",
            prompt_tokens, hit_tokens);
  if (readmission) {
    stats_.readmit_query_tokens += uint64_t(prompt_tokens);
    stats_.readmit_hit_tokens += uint64_t(hit_tokens);
    return;
  }
  stats_.query_tokens += uint64_t(prompt_tokens);
  stats_.hit_tokens += uint64_t(hit_tokens);
}

void PrefixIndex::count_extra_hits(int hit_tokens, bool readmission) {
  KVQ_CHECK(hit_tokens >= 0, "{} extra hit tokens", hit_tokens);
  if (readmission) {
    stats_.readmit_hit_tokens += uint64_t(hit_tokens);
    KVQ_CHECK(stats_.readmit_hit_tokens <= stats_.readmit_query_tokens, "{} re-admission hit tokens of {} queried",
              stats_.readmit_hit_tokens, stats_.readmit_query_tokens);
    return;
  }
  stats_.hit_tokens += uint64_t(hit_tokens);
  KVQ_CHECK(stats_.hit_tokens <= stats_.query_tokens, "{} hit tokens of {} queried", stats_.hit_tokens, stats_.query_tokens);
}

KvPrefixStats PrefixIndex::stats() const {
  KvPrefixStats s = stats_;
  s.entries = entries_.size();
  s.idle = lru_.size();
  return s;
}

PrefixIndex::Entry& PrefixIndex::entry_of(KvPageId page, int* group) {
  auto bp = by_page_.find(page);
  KVQ_CHECK(bp != by_page_.end(), "page {} is not in the prefix index", page);
  *group = bp->second.group;
  return entries_.at(bp->second.entry);
}

bool PrefixIndex::kv_page_unused(KvPageId page) {
  if (!contains_page(page)) return false;
  int g = 0;
  Entry& e = entry_of(page, &g);
  KVQ_CHECK(!e.idle[size_t(g)], "cached page {} released twice", page);
  e.idle[size_t(g)] = 1;
  e.lru[size_t(g)] = lru_.insert(lru_.end(), page);
  return true;
}

void PrefixIndex::kv_page_reused(KvPageId page) {
  int g = 0;
  Entry& e = entry_of(page, &g);
  KVQ_CHECK(e.idle[size_t(g)], "reuse of cached page {} that is not idle", page);
  lru_.erase(e.lru[size_t(g)]);
  e.idle[size_t(g)] = 0;
}

KvPageId PrefixIndex::kv_page_evict() {
  if (lru_.empty()) return kv_page_none;
  const KvPageId page = lru_.front();
  lru_.pop_front();
  auto bp = by_page_.find(page);
  KVQ_CHECK(bp != by_page_.end(), "idle page {} without an entry", page);
  const KvHash h = bp->second.entry;
  Entry& e = entries_.at(h);
  const size_t g = size_t(bp->second.group);
  if (spill_) spill_->kv_page_spill(h, e.parent, e.tokens.data(), int(g), page);
  e.pages[g] = kv_page_none;
  e.idle[g] = 0;
  by_page_.erase(bp);
  if (std::all_of(e.pages.begin(), e.pages.end(), [](KvPageId p) { return p == kv_page_none; })) entries_.erase(h);
  ++stats_.evicted_pages;
  return page;
}

}  // namespace kvq
