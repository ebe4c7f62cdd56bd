#include "cache/kv_offload.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "core/error.h"
#include "core/timer.h"

namespace kvq {

namespace {

// The whole of n bytes at offset off through io(done, count, offset) (a pwrite or pread of the
// rest): false on an error or an early end of file.
template <typename Io>
bool whole(Io io, size_t n, off_t off) {
  size_t done = 0;
  while (done < n) {
    const ssize_t r = io(done, n - done, off + off_t(done));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    done += size_t(r);
  }
  return true;
}

bool write_all(int fd, const uint8_t* p, size_t n, off_t off) {
  return whole([&](size_t d, size_t m, off_t o) { return ::pwrite(fd, p + d, m, o); }, n, off);
}

bool read_all(int fd, uint8_t* p, size_t n, off_t off) {
  return whole([&](size_t d, size_t m, off_t o) { return ::pread(fd, p + d, m, o); }, n, off);
}

// Persistent files. Little-endian fixed-width fields, as written by this machine type.
constexpr char kMagic[8] = {'K', 'V', 'Q', 'O', 'F', 'F', 'L', '\n'};
constexpr uint32_t kFileVersion = 1;  // bump when the file layout changes
constexpr size_t kBlock = 4096;
const KvHashKey kCheckKey{0x6b76716f66666c31ull, 0x6865616465722121ull, 0, 0};  // header checksums

struct FileHeader {
  char magic[8];
  uint32_t version;
  uint32_t clean;  // 1: written by save(): the slots' index after them is valid
  uint64_t page_bytes, slot_bytes, page_tokens;
  uint64_t identity_bytes;  // the identity string, at kBlock
  uint64_t data_offset;     // slot 0
  uint64_t capacity;        // slots before the index
  uint64_t table_entries;   // index entries, least recently used first
  uint64_t table_check;     // SipHash of the index under the file's key
  uint64_t key[4];          // the prefix index's hash key
  uint64_t check;           // SipHash of the fields above under kCheckKey
};
static_assert(sizeof(FileHeader) <= kBlock);

struct EntryHead {  // then page_tokens int32 token ids
  uint64_t hash[2], parent[2];
  uint32_t group, slot;
  uint32_t crc;  // CRC-32 of the page's bytes, checked when the next run first reads the slot
  uint32_t pad;
};
static_assert(sizeof(EntryHead) == 48);

uint64_t header_check(const FileHeader& h) {
  return kv_siphash24(kCheckKey.k0, kCheckKey.k1, &h, offsetof(FileHeader, check));
}

size_t round_block(size_t n) { return (n + kBlock - 1) / kBlock * kBlock; }

constexpr uint64_t kMaxFileBytes = uint64_t(1) << 50;  // keeps every offset computation in range

uint32_t page_crc(const uint8_t* p, size_t n) {
  uLong c = ::crc32(0L, Z_NULL, 0);
  while (n > 0) {  // crc32 takes a uInt length
    const uInt m = uInt(std::min<size_t>(n, size_t(1) << 30));
    c = ::crc32(c, p, m);
    p += m;
    n -= m;
  }
  return uint32_t(c);
}

}  // namespace

KvOffload::KvOffload(const std::string& dir, size_t capacity_bytes, PagePool& pool, bool direct)
    : KvOffload(KvOffloadOptions{dir, capacity_bytes, direct, false, {}}, pool) {}

KvOffload::KvOffload(const KvOffloadOptions& o, PagePool& pool) : pool_(pool), persist_(o.persist), direct_(o.direct) {
  const std::string& dir = o.dir;
  const size_t page = pool.page_bytes();
  slot_bytes_ = round_block(page);
  const size_t n = o.capacity_bytes / slot_bytes_;
  if (n < 1)
    fail("--kv-offload-size {} bytes holds no KV page (a page is {} bytes on disk)", o.capacity_bytes, slot_bytes_);
  if (double(n) * double(slot_bytes_) > double(kMaxFileBytes)) fail("--kv-offload-size above 1 PiB is not supported");
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) fail("--kv-offload-dir '{}' is not a directory", dir);
  capacity_ = n;  // slots' records are made as they are first used (a large tier of small pages)
  stats_.page_bytes = page;
  stats_.persistent = persist_;
  // Closes what is open when the constructor throws.
  struct Guard {
    KvOffload* t;
    ~Guard() {
      if (!t) return;
      if (t->fd_ >= 0) ::close(t->fd_);
      if (t->meta_fd_ >= 0) ::close(t->meta_fd_);
      t->fd_ = t->meta_fd_ = -1;
    }
  } guard{this};
  if (persist_) {
    open_persistent(o);
  } else {
    std::string path = (std::filesystem::path(dir) / "kvq-offload-XXXXXX").string();
    std::vector<char> name(path.begin(), path.end());
    name.push_back('\0');
    fd_ = ::mkstemp(name.data());
    if (fd_ < 0) fail("--kv-offload-dir '{}': cannot create a file there: {}", dir, std::strerror(errno));
    // The file is reached by its descriptor only: nothing stays on disk after the process.
    ::unlink(name.data());
  }
  if (direct_) {
    const int fl = ::fcntl(fd_, F_GETFL);
    if (fl < 0 || ::fcntl(fd_, F_SETFL, fl | O_DIRECT) != 0)
      fail("--kv-offload-direct: the file system of '{}' does not take O_DIRECT: {}", dir, std::strerror(errno));
    bounce_.reset(static_cast<uint8_t*>(std::aligned_alloc(kBlock, slot_bytes_)));
    if (!bounce_) fail("--kv-offload-direct: out of memory");
    std::memset(bounce_.get(), 0, slot_bytes_);
  }
  struct statvfs vfs{};
  if (::fstatvfs(fd_, &vfs) == 0) {
    const double free_bytes = double(vfs.f_bavail) * double(vfs.f_frsize);
    if (free_bytes < double(n) * double(slot_bytes_))
      std::fprintf(stderr,
                   "[kvq] warning: --kv-offload-size %.1f MiB is more than the %.1f MiB free in '%s': pages that do "
                   "not fit are recomputed\n",
                   double(n) * double(slot_bytes_) / 1048576.0, free_bytes / 1048576.0, dir.c_str());
  }
  stats_.capacity_pages = capacity_;
  guard.t = nullptr;
}

std::string KvOffload::persistent_path(const std::string& dir, const std::string& identity) {
  const KvHash h = kv_hash128(kCheckKey, identity.data(), identity.size());
  return (std::filesystem::path(dir) / fmt::format("kvq-offload-{:016x}.kvq", h.lo)).string();
}

void KvOffload::open_persistent(const KvOffloadOptions& o) {
  if (o.identity.empty()) fail("KV offload: a persistent tier needs the cache identity");
  path_ = persistent_path(o.dir, o.identity);
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0600);
  if (fd_ < 0) fail("--kv-offload-dir '{}': cannot open '{}': {}", o.dir, path_, std::strerror(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    if (errno == EWOULDBLOCK)
      fail("--kv-offload-persist: '{}' is in use by another process (one persistent tier per file)", path_);
    fail("--kv-offload-persist: cannot lock '{}': {}", path_, std::strerror(errno));
  }
  meta_fd_ = ::open(path_.c_str(), O_RDWR | O_CLOEXEC);
  if (meta_fd_ < 0) fail("--kv-offload-dir '{}': cannot open '{}': {}", o.dir, path_, std::strerror(errno));
  identity_ = o.identity;
  data_offset_ = kBlock + round_block(identity_.size());
  std::string why;
  if (load_persistent(o, &why)) {
    in_use_marked_ = false;  // the file on disk is as it was saved until the first write
    std::fprintf(stderr, "[kvq] KV offload tier: %zu page%s kept from the last run in %s\n", stats_.pages_at_start,
                 stats_.pages_at_start == 1 ? "" : "s",
                 path_.c_str());
  } else {
    key_ = kv_random_key();
    if (!why.empty())
      std::fprintf(stderr, "[kvq] KV offload tier: %s starts empty (%s)\n", path_.c_str(), why.c_str());
    // Nothing of the old file is valid: the header says so before anything else is written.
    if (!mark_in_use()) fail("--kv-offload-persist: cannot write '{}': {}", path_, std::strerror(errno));
  }
  // Slots inside the file already: a failed write there is not the disk filling up.
  struct stat st{};
  if (::fstat(fd_, &st) == 0 && uint64_t(st.st_size) > data_offset_)
    file_slots_ = size_t((uint64_t(st.st_size) - data_offset_) / slot_bytes_);
}

bool KvOffload::load_persistent(const KvOffloadOptions& o, std::string* why) {
  struct stat st{};
  if (::fstat(meta_fd_, &st) != 0 || st.st_size == 0) return false;  // a new file
  FileHeader h{};
  if (!read_all(meta_fd_, reinterpret_cast<uint8_t*>(&h), sizeof h, 0) || std::memcmp(h.magic, kMagic, 8) != 0 ||
      h.check != header_check(h)) {
    *why = "not a kvq offload file, or a damaged header";
    return false;
  }
  if (h.version != kFileVersion) {
    *why = fmt::format("file layout version {}, this kvq writes {}", h.version, kFileVersion);
    return false;
  }
  if (!h.clean) {
    *why = "not closed cleanly by the run that wrote it";
    return false;
  }
  const size_t P = size_t(pool_.page_tokens());
  if (h.page_bytes != pool_.page_bytes() || h.slot_bytes != slot_bytes_ || h.page_tokens != P ||
      h.identity_bytes != o.identity.size() || h.data_offset != data_offset_) {
    *why = "written for another KV page layout";
    return false;
  }
  std::string id(o.identity.size(), '\0');
  if (!read_all(meta_fd_, reinterpret_cast<uint8_t*>(id.data()), id.size(), off_t(kBlock)) || id != o.identity) {
    *why = "written for another model or KV configuration";
    return false;
  }
  const size_t entry = sizeof(EntryHead) + 4 * P;
  const uint64_t table_at = h.data_offset + h.capacity * h.slot_bytes;
  if (h.table_entries > h.capacity || h.capacity > kMaxFileBytes / slot_bytes_ ||
      table_at + h.table_entries * entry > uint64_t(st.st_size)) {
    *why = "a damaged or truncated index";
    return false;
  }
  std::vector<uint8_t> table;
  try {
    table.resize(size_t(h.table_entries) * entry);
  } catch (const std::bad_alloc&) {
    *why = "an index too large to read";
    return false;
  }
  const KvHashKey key{h.key[0], h.key[1], h.key[2], h.key[3]};
  if (!read_all(meta_fd_, table.data(), table.size(), off_t(table_at)) ||
      kv_siphash24(key.k0, key.k1, table.data(), table.size()) != h.table_check) {
    *why = "a damaged or truncated index";
    return false;
  }
  key_ = key;
  // The slots, least recently used first; those past this tier's capacity are left out.
  std::vector<char> seen(capacity_, 0);
  for (size_t e = 0; e < size_t(h.table_entries); ++e) {
    const uint8_t* p = table.data() + e * entry;
    EntryHead eh;
    std::memcpy(&eh, p, sizeof eh);
    if (eh.slot >= capacity_ || eh.slot >= h.capacity || seen[eh.slot]) continue;
    seen[eh.slot] = 1;
    const Key k{KvHash{eh.hash[0], eh.hash[1]}, int(eh.group)};
    if (slots_.count(k)) continue;
    if (slot_meta_.size() <= eh.slot) slot_meta_.resize(size_t(eh.slot) + 1);
    Slot& s = slot_meta_[eh.slot];
    s.key = k;
    s.parent = KvHash{eh.parent[0], eh.parent[1]};
    s.tokens.resize(P);
    std::memcpy(s.tokens.data(), p + sizeof eh, 4 * P);
    s.lru = lru_.insert(lru_.end(), size_t(eh.slot));
    s.used = true;
    s.crc = eh.crc;
    s.verify = true;  // its bytes come from another run: checked when first read
    slots_.emplace(k, size_t(eh.slot));
  }
  ever_written_.assign(slot_meta_.size(), 1);
  for (size_t i = slot_meta_.size(); i-- > 0;)
    if (!slot_meta_[i].used) free_.push_back(i);
  stats_.pages_at_start = slots_.size();
  return true;
}

bool KvOffload::write_header(bool clean, uint64_t table_entries, uint64_t table_check) {
  FileHeader h{};
  std::memcpy(h.magic, kMagic, 8);
  h.version = kFileVersion;
  h.clean = clean ? 1 : 0;
  h.page_bytes = pool_.page_bytes();
  h.slot_bytes = slot_bytes_;
  h.page_tokens = uint64_t(pool_.page_tokens());
  h.data_offset = data_offset_;
  h.capacity = capacity_;
  h.table_entries = table_entries;
  h.table_check = table_check;
  h.key[0] = key_.k0;
  h.key[1] = key_.k1;
  h.key[2] = key_.k2;
  h.key[3] = key_.k3;
  h.identity_bytes = identity_.size();
  h.check = header_check(h);
  return write_all(meta_fd_, reinterpret_cast<const uint8_t*>(&h), sizeof h, 0) && ::fdatasync(meta_fd_) == 0;
}

bool KvOffload::mark_in_use() {
  if (!persist_ || in_use_marked_) return true;
  // The identity first, then a header that says the slots are changing: a run that stops
  // without save() leaves a file the next run does not trust. No slot is written until the
  // header says so.
  if (!write_all(meta_fd_, reinterpret_cast<const uint8_t*>(identity_.data()), identity_.size(), off_t(kBlock)) ||
      !write_header(false, 0, 0)) {
    std::fprintf(stderr, "[kvq] warning: KV offload: cannot write the header of %s: %s\n", path_.c_str(),
                 std::strerror(errno));
    return false;
  }
  in_use_marked_ = true;
  return true;
}

bool KvOffload::save() {
  if (!persist_ || fd_ < 0) return true;
  // Not clean while the index is rewritten: the new one may land where the old one's slots were
  // (a smaller tier than the file's), so a save cut short must not leave the old index trusted.
  if (!mark_in_use()) return false;
  const size_t P = size_t(pool_.page_tokens());
  const size_t entry = sizeof(EntryHead) + 4 * P;
  std::vector<uint8_t> table(lru_.size() * entry);
  size_t e = 0;
  for (size_t slot : lru_) {
    const Slot& s = slot_meta_[slot];
    EntryHead eh{{s.key.hash.lo, s.key.hash.hi}, {s.parent.lo, s.parent.hi}, uint32_t(s.key.group), uint32_t(slot), s.crc, 0};
    uint8_t* p = table.data() + e++ * entry;
    std::memcpy(p, &eh, sizeof eh);
    std::memcpy(p + sizeof eh, s.tokens.data(), 4 * P);
  }
  const uint64_t check = kv_siphash24(key_.k0, key_.k1, table.data(), table.size());
  const off_t at = off_t(data_offset_ + uint64_t(capacity_) * slot_bytes_);
  // The slots durable first, then the index, then the header that points at it.
  const bool ok = ::fdatasync(fd_) == 0 && write_all(meta_fd_, table.data(), table.size(), at) &&
                  ::ftruncate(meta_fd_, at + off_t(table.size())) == 0 && ::fdatasync(meta_fd_) == 0 &&
                  write_header(true, lru_.size(), check);
  if (!ok) {
    std::fprintf(stderr, "[kvq] warning: KV offload: cannot save %s (%s): the next run starts empty\n", path_.c_str(),
                 std::strerror(errno));
    return false;
  }
  in_use_marked_ = false;
  file_slots_ = capacity_;
  return true;
}

KvOffload::~KvOffload() {
  if (persist_ && fd_ >= 0 && in_use_marked_) {
    try {
      save();
    } catch (const std::exception& e) {  // the index's buffer: the next run starts empty
      std::fprintf(stderr, "[kvq] warning: KV offload: cannot save %s: %s\n", path_.c_str(), e.what());
    }
  }
  if (meta_fd_ >= 0) ::close(meta_fd_);
  if (fd_ >= 0) ::close(fd_);  // releases the lock
}

bool KvOffload::write_slot(size_t slot, const uint8_t* page) {
  if (!mark_in_use()) return false;
  const off_t off = off_t(data_offset_ + uint64_t(slot) * slot_bytes_);
  if (!direct_) return write_all(fd_, page, pool_.page_bytes(), off);
  // O_DIRECT: whole 4 KiB blocks from an aligned buffer.
  std::memcpy(bounce_.get(), page, pool_.page_bytes());
  return write_all(fd_, bounce_.get(), slot_bytes_, off);
}

bool KvOffload::read_slot(size_t slot, uint8_t* page) {
  const off_t off = off_t(data_offset_ + uint64_t(slot) * slot_bytes_);
  if (!direct_) return read_all(fd_, page, pool_.page_bytes(), off);
  if (!read_all(fd_, bounce_.get(), slot_bytes_, off)) return false;
  std::memcpy(page, bounce_.get(), pool_.page_bytes());
  return true;
}

void KvOffload::drop(size_t slot) {
  Slot& s = slot_meta_[slot];
  if (!s.used) return;
  slots_.erase(s.key);
  lru_.erase(s.lru);
  s.used = false;
  s.tokens.clear();
  free_.push_back(slot);
}

void KvOffload::kv_page_spill(const KvHash& hash, const KvHash& parent, const int32_t* tokens, int group, KvPageId page) {
  const Key key{hash, group};
  if (auto it = slots_.find(key); it != slots_.end()) {
    // The same tokens after the same prefix: the bytes the tier holds already.
    Slot& s = slot_meta_[it->second];
    lru_.splice(lru_.end(), lru_, s.lru);
    ++stats_.kept_pages;
    return;
  }
  if (!stats_.writing) return;
  if (free_.empty() && slot_meta_.size() < capacity_) {
    free_.push_back(slot_meta_.size());
    slot_meta_.emplace_back();
    ever_written_.push_back(slot_meta_.size() - 1 < file_slots_ ? 1 : 0);
  }
  if (free_.empty()) {
    drop(lru_.front());
    ++stats_.dropped_pages;
  }
  const size_t slot = free_.back();
  const bool fresh = slot + 1 == slot_meta_.size() && !ever_written_[slot];
  const double t0 = now_seconds();
  const uint32_t crc = persist_ ? page_crc(pool_.data(page), pool_.page_bytes()) : 0;
  errno = 0;  // a write of 0 bytes sets none
  const bool ok = write_slot(slot, pool_.data(page));
  stats_.write_seconds += now_seconds() - t0;
  if (!ok) {
    const int err = errno;
    ++stats_.write_errors;
    if (fresh) {
      // A slot past the file's end could not be written (a full disk, a file size limit): the
      // tier keeps the slots it has and reuses them, least recently used first.
      free_.pop_back();
      slot_meta_.pop_back();
      ever_written_.pop_back();
      capacity_ = slot_meta_.size();
      stats_.capacity_pages = capacity_;
      std::fprintf(stderr,
                   "[kvq] warning: KV offload write failed (%s): the tier keeps the %zu pages it holds and reuses "
                   "them\n",
                   err ? std::strerror(err) : "nothing written", capacity_);
      if (capacity_ == 0) stats_.writing = false;
      return;
    }
    if (++consecutive_errors_ == 1)
      std::fprintf(stderr, "[kvq] warning: KV offload write failed (%s): the page is dropped, as without the tier\n",
                   err ? std::strerror(err) : "nothing written");
    if (consecutive_errors_ >= kMaxWriteErrors) {
      stats_.writing = false;
      std::fprintf(stderr, "[kvq] warning: %d KV offload writes in a row failed: the tier stops storing pages\n",
                   kMaxWriteErrors);
    }
    return;
  }
  consecutive_errors_ = 0;
  ever_written_[slot] = 1;
  free_.pop_back();
  Slot& s = slot_meta_[slot];
  s.key = key;
  s.parent = parent;
  s.tokens.assign(tokens, tokens + pool_.page_tokens());
  s.lru = lru_.insert(lru_.end(), slot);
  s.used = true;
  s.crc = crc;
  s.verify = false;
  slots_.emplace(key, slot);
  ++stats_.stored_pages;
}

void KvOffload::touch(const KvHash& hash, int group) {
  if (auto it = slots_.find(Key{hash, group}); it != slots_.end()) {
    Slot& s = slot_meta_[it->second];
    lru_.splice(lru_.end(), lru_, s.lru);
  }
}

bool KvOffload::load(const KvHash& hash, int group, const KvHash& parent, const int32_t* tokens, KvPageId page) {
  auto it = slots_.find(Key{hash, group});
  if (it == slots_.end()) return false;
  const size_t slot = it->second;
  Slot& s = slot_meta_[slot];
  if (!(s.parent == parent) ||
      std::memcmp(s.tokens.data(), tokens, sizeof(int32_t) * size_t(pool_.page_tokens())) != 0)
    return false;
  const double t0 = now_seconds();
  errno = 0;  // a short read sets none
  bool ok = read_slot(slot, pool_.data(page));
  const bool bad = ok && s.verify && page_crc(pool_.data(page), pool_.page_bytes()) != s.crc;
  stats_.read_seconds += now_seconds() - t0;
  if (!ok || bad) {
    if (++stats_.read_errors == 1)
      std::fprintf(stderr, "[kvq] warning: KV offload read failed (%s): the prefix is recomputed\n",
                   bad ? "the page's bytes do not match their checksum" : errno ? std::strerror(errno) : "short read");
    drop(slot);
    return false;
  }
  s.verify = false;
  lru_.splice(lru_.end(), lru_, s.lru);
  ++stats_.loaded_pages;
  return true;
}

KvOffloadStats KvOffload::stats() const {
  KvOffloadStats s = stats_;
  s.resident_pages = slots_.size();
  return s;
}

}  // namespace kvq
