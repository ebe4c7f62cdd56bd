#include "cache/kv_offload.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
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

}  // namespace

KvOffload::KvOffload(const std::string& dir, size_t capacity_bytes, PagePool& pool, bool direct)
    : pool_(pool), direct_(direct) {
  const size_t page = pool.page_bytes();
  slot_bytes_ = (page + 4095) / 4096 * 4096;
  const size_t n = capacity_bytes / slot_bytes_;
  if (n < 1)
    fail("--kv-offload-size {} bytes holds no KV page (a page is {} bytes on disk)", capacity_bytes, slot_bytes_);
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) fail("--kv-offload-dir '{}' is not a directory", dir);
  std::string path = (std::filesystem::path(dir) / "kvq-offload-XXXXXX").string();
  std::vector<char> name(path.begin(), path.end());
  name.push_back('\0');
  fd_ = ::mkstemp(name.data());
  if (fd_ < 0) fail("--kv-offload-dir '{}': cannot create a file there: {}", dir, std::strerror(errno));
  // The file is reached by its descriptor only: nothing stays on disk after the process.
  ::unlink(name.data());
  if (direct_) {
    const int fl = ::fcntl(fd_, F_GETFL);
    if (fl < 0 || ::fcntl(fd_, F_SETFL, fl | O_DIRECT) != 0) {
      const int err = errno;
      ::close(fd_);
      fd_ = -1;
      fail("--kv-offload-direct: the file system of '{}' does not take O_DIRECT: {}", dir, std::strerror(err));
    }
    bounce_.reset(static_cast<uint8_t*>(std::aligned_alloc(4096, slot_bytes_)));
    if (!bounce_) {
      ::close(fd_);
      fd_ = -1;
      fail("--kv-offload-direct: out of memory");
    }
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
  capacity_ = n;  // slots' records are made as they are first used (a large tier of small pages)
  stats_.capacity_pages = n;
  stats_.page_bytes = page;
}

KvOffload::~KvOffload() {
  if (fd_ >= 0) ::close(fd_);
}

bool KvOffload::write_slot(size_t slot, const uint8_t* page) {
  const off_t off = off_t(slot) * off_t(slot_bytes_);
  if (!direct_) return write_all(fd_, page, pool_.page_bytes(), off);
  // O_DIRECT: whole 4 KiB blocks from an aligned buffer.
  std::memcpy(bounce_.get(), page, pool_.page_bytes());
  return write_all(fd_, bounce_.get(), slot_bytes_, off);
}

bool KvOffload::read_slot(size_t slot, uint8_t* page) {
  const off_t off = off_t(slot) * off_t(slot_bytes_);
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
    ever_written_.push_back(0);
  }
  if (free_.empty()) {
    drop(lru_.front());
    ++stats_.dropped_pages;
  }
  const size_t slot = free_.back();
  const bool fresh = slot + 1 == slot_meta_.size() && !ever_written_[slot];
  const double t0 = now_seconds();
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
  const bool ok = read_slot(slot, pool_.data(page));
  stats_.read_seconds += now_seconds() - t0;
  if (!ok) {
    if (++stats_.read_errors == 1)
      std::fprintf(stderr, "[kvq] warning: KV offload read failed (%s): the prefix is recomputed\n",
                   errno ? std::strerror(errno) : "short read");
    drop(slot);
    return false;
  }
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
