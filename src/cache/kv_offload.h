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
// lives in memory. When the tier is full the least recently stored or loaded slot is reused.
//
// Two lifetimes:
// - by default the tier lasts as long as the process: its file is unlinked as soon as it is
//   created, so nothing is left on disk, and the prefix index draws its hash keys per process;
// - persistent (KvOffloadOptions::persist): the file is DIR/kvq-offload-<id>.kvq, <id> a hash of
//   the cache identity (everything the page bytes depend on: the model's content fingerprint, the
//   codecs, the page layout; KvCache::prefix_identity), locked against a second process, and kept
//   when the tier closes (save(): the slots' index, least recently used first, after the slots,
//   and a header marked clean). The next tier opened with the same identity starts from it: it
//   takes the file's hash key (key(), for the prefix index, so the pages' chain hashes are the
//   same as in the run that wrote them) and its slots. A file not closed cleanly (the process
//   was killed), or written by another layout version, starts empty; so does a damaged one (its
//   header and index are checksummed). Each slot's CRC-32 is kept in the index, and a slot from
//   another run is checked the first time it is read: a mismatch is a failed read (a miss).
//   File layout: a 4 KiB header; the identity string, padded to 4 KiB; the slots (slot_bytes
//   each, 4 KiB-aligned, as O_DIRECT needs); after a clean close, the index.
//
// Failures lose nothing: a write that fails leaves the page uncached, as without the tier. When it
// was a slot past the file's end (a full disk, a file size limit) the tier shrinks to the slots it
// has written and goes on reusing them; after kMaxWriteErrors failures in a row on those it stops
// writing. A read that fails or returns short is a miss, and the prefix is recomputed.
//
// Threading: not synchronized; the pool's thread (the scheduler's) owns it, as it owns the pool
// and the index. A persistent tier's file is also locked (flock) against other processes.
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
  size_t pages_at_start = 0;   // persistent tier: pages kept from the run that saved its file
  bool persistent = false;
  bool writing = true;         // false once kMaxWriteErrors writes in a row failed, or no slot is left
};

struct KvOffloadOptions {
  std::string dir;            // where the tier's file goes
  size_t capacity_bytes = 0;  // whole pages of the pool's page_bytes (each padded to 4 KiB)
  // The file is read and written with O_DIRECT, past the OS page cache (so the tier takes no
  // memory beyond the pool, and every load comes from the device).
  bool direct = false;
  // Keep the file across runs (see above); identity is then required: the cache identity the
  // pages' bytes depend on (KvCache::prefix_identity with a model fingerprint, not a path).
  bool persist = false;
  std::string identity;
};

class KvOffload : public KvPageSpill {
 public:
  // Throws kvq::Error when the directory cannot hold the tier's file, the capacity is below one
  // page, or (persistent) another process holds the file.
  KvOffload(const KvOffloadOptions& o, PagePool& pool);
  // A tier of capacity_bytes in an unlinked file created in directory `dir`.
  KvOffload(const std::string& dir, size_t capacity_bytes, PagePool& pool, bool direct = false);
  // A persistent tier that was not saved is saved.
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

  // The prefix index's hash key: the file's when a persistent tier started from one, else drawn
  // at random. Persistent tiers only (the default tier leaves the index its own key).
  const KvHashKey& key() const { return key_; }
  bool persistent() const { return persist_; }
  const std::string& path() const { return path_; }  // persistent: the file
  // Persistent tier: makes the slots durable and writes their index and a clean header, so that
  // the next tier with the same identity starts from them. The tier stays usable (its header is
  // marked in use again at the next write). False (with a warning) when the file could not be
  // written: the next run then starts empty. No-op for the default tier.
  bool save();
  // A persistent file's name in `dir` for a cache identity.
  static std::string persistent_path(const std::string& dir, const std::string& identity);

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
    uint32_t crc = 0;     // persistent: CRC-32 of the page's bytes
    bool verify = false;  // persistent: from another run, not read since (the CRC is checked)
  };
  void drop(size_t slot);
  void open_persistent(const KvOffloadOptions& o);
  bool load_persistent(const KvOffloadOptions& o, std::string* why);  // the saved slots, if the file has them
  bool write_header(bool clean, uint64_t table_entries, uint64_t table_check);
  bool mark_in_use();  // before the first write after a save (or after opening); false: not marked

  bool write_slot(size_t slot, const uint8_t* page);
  bool read_slot(size_t slot, uint8_t* page);

  PagePool& pool_;
  int fd_ = -1;
  int meta_fd_ = -1;  // persistent: the same file, buffered (header, identity, index)
  bool persist_ = false;
  bool in_use_marked_ = false;  // persistent: the header says "in use" (not clean) on disk
  std::string path_;
  std::string identity_;  // persistent: written after the header
  size_t file_slots_ = 0;  // persistent: slots the file held when opened (writes there do not extend it)
  KvHashKey key_{};
  uint64_t data_offset_ = 0;  // where slot 0 starts
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
