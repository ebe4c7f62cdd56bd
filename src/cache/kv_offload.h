// KV offload tier: cached prefix pages that the pool evicts, kept in a file instead of dropped.
//
// Without it, a prefix page evicted from the pool (PrefixIndex::kv_page_evict, least recently
// used first) is gone, and the next request with that prefix recomputes it: on a CPU, whose
// prefill runs at hundreds of tokens per second, that is what makes the time to first token of a
// recurring document explode once the documents outgrow the KV budget. With an offload tier the
// evicted page's bytes (the packed KV of every layer of its page group, in the cache's format: a
// 4-bit cache keeps ~4x the prefixes of f16 in the same file) are written to a slot of one file,
// and a request whose prefix is found there reads the pages back into the pool instead of
// recomputing them (KvOffload::load; the engine does it before admission).
//
// Slots are named by the page's chain hash and page group, as the prefix index names pages, and
// a load checks the slot's stored parent hash and token ids against the query, so only the same
// tokens after the same prefix, under the same cache identity, ever match. The index of slots
// lives in memory: the tier lasts as long as the process (the hashes' keys are drawn per
// process), and its file is unlinked as soon as it is created, so nothing is left on disk.
// When the tier is full the least recently stored or loaded slot is reused.
//
// Failures lose nothing: a write that fails leaves the page uncached, as without the tier. When it
// was a slot past the file's end (a full disk, a file size limit) the tier shrinks to the slots it
// has written and goes on reusing them; after kMaxWriteErrors failures in a row on those it stops
// writing. A read that fails or returns short is a miss, and the prefix is recomputed.
//
// Threading: not synchronized; the pool's thread (the scheduler's) owns it, as it owns the pool
// and the index.
#pragma once
#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "cache/page_pool.h"
#include "cache/prefix_index.h"
#include "core/aligned.h"

namespace kvq {

struct KvOffloadStats {
  size_t capacity_pages = 0;   // slots in the file
  size_t resident_pages = 0;   // slots holding a page
  size_t page_bytes = 0;       // bytes per page (the pool's)
  uint64_t stored_pages = 0;   // pages written (evicted from the pool, not already in the tier)
  uint64_t kept_pages = 0;     // evicted pages the tier already held (no write)
  uint64_t dropped_pages = 0;  // slots reused for newer pages (least recently used first)
  uint64_t loaded_pages = 0;   // pages read back into the pool
  uint64_t write_errors = 0;    // failed writes (capacity_pages shrinks when one was past the file's end)
  uint64_t read_errors = 0;    // reads that failed or came back short (treated as misses)
  double write_seconds = 0;
  double read_seconds = 0;
  bool writing = true;         // false once kMaxWriteErrors writes in a row failed, or no slot is left
};

class KvOffload : public KvPageSpill {
 public:
  // A tier of capacity_bytes (whole pages of the pool's page_bytes) in an unlinked file created in
  // directory `dir`. direct: the file is read and written with O_DIRECT, past the OS page cache
  // (so the tier takes no memory beyond the pool, and every load comes from the device). Throws
  // kvq::Error when the directory cannot hold such a file or the capacity is below one page.
  KvOffload(const std::string& dir, size_t capacity_bytes, PagePool& pool, bool direct = false);
  ~KvOffload() override;
  KvOffload(const KvOffload&) = delete;
  KvOffload& operator=(const KvOffload&) = delete;

  // KvPageSpill: the page's bytes go to a slot (or the slot holding them becomes the most recent).
  void kv_page_spill(const KvHash& hash, const KvHash& parent, const int32_t* tokens, int group, KvPageId page) override;

  bool contains(const KvHash& hash, int group) const { return slots_.count(Key{hash, group}) != 0; }
  // The slot holding (hash, group), if any, becomes the most recently used: a caller about to
  // load several pages touches them first, so that what its own allocations evict into the tier
  // does not take their slots.
  void touch(const KvHash& hash, int group);
  // Reads the page (hash, group) into pool page `page` when the tier holds it for exactly this
  // parent and these tokens (page_tokens of them); false otherwise (and on a failed read, which
  // also drops the slot).
  bool load(const KvHash& hash, int group, const KvHash& parent, const int32_t* tokens, KvPageId page);

  KvOffloadStats stats() const;
  size_t capacity_pages() const { return capacity_; }
  static constexpr int kMaxWriteErrors = 8;

 private:
  struct Key {
    KvHash hash;
    int group = 0;
    bool operator==(const Key&) const = default;
  };
  struct KeyHash {
    size_t operator()(const Key& k) const {
      return size_t(k.hash.lo ^ (k.hash.hi * 0x9e3779b97f4a7c15ull) ^ (uint64_t(k.group) * 0xff51afd7ed558ccdull));
    }
  };
  struct Slot {
    Key key;
    KvHash parent;
    std::vector<int32_t> tokens;
    std::list<size_t>::iterator lru;  // valid while the slot holds a page
    bool used = false;
  };
  void drop(size_t slot);

  bool write_slot(size_t slot, const uint8_t* page);
  bool read_slot(size_t slot, uint8_t* page);

  PagePool& pool_;
  int fd_ = -1;
  bool direct_ = false;
  std::unique_ptr<uint8_t[], AlignedFree> bounce_;  // (slot_bytes_,) 4 KiB-aligned, for O_DIRECT
  size_t slot_bytes_ = 0;  // page_bytes rounded up to 4 KiB
  size_t capacity_ = 0;    // slots
  std::vector<Slot> slot_meta_;  // the slots used so far
  std::vector<size_t> free_;     // of those, the ones free again (a failed write, a failed read)
  std::vector<char> ever_written_;  // per slot: it held a page once (its place in the file exists)
  int consecutive_errors_ = 0;      // failed writes to slots the file already has, in a row
  std::list<size_t> lru_;  // slots in use, least recently used at the front
  std::unordered_map<Key, size_t, KeyHash> slots_;
  KvOffloadStats stats_;
};

}  // namespace kvq
