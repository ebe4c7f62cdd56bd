// Aligned heap buffers for kernel inputs/outputs (64-byte: one cache line, one AVX-512 vector).
#pragma once
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <utility>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace kvq {

struct AlignedFree {
  void operator()(void* p) const { std::free(p); }
};

// A 2 MiB-aligned block of at least `bytes` (rounded up to 2 MiB), marked for transparent huge
// pages where the OS has them (the advice is ignored elsewhere); nullptr when out of memory; not
// zeroed; freed with std::free. For buffers walked at the memory bus's rate (the KV page pool,
// the read-bandwidth reference), where 4 KiB mappings cost TLB misses.
inline constexpr size_t kHugePageBytes = size_t(2) << 20;
inline void* aligned_alloc_huge(size_t bytes) {
  const size_t alloc_bytes = (bytes + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
  if (alloc_bytes < bytes) return nullptr;
  void* p = std::aligned_alloc(kHugePageBytes, alloc_bytes == 0 ? kHugePageBytes : alloc_bytes);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  if (p) (void)madvise(p, alloc_bytes, MADV_HUGEPAGE);
#endif
  return p;
}

template <typename T>
class AlignedBuf {
 public:
  AlignedBuf() = default;
  explicit AlignedBuf(size_t n) { resize(n); }
  // A moved-from buffer is empty (size 0), not a size without storage.
  AlignedBuf(AlignedBuf&& o) noexcept : ptr_(std::move(o.ptr_)), n_(std::exchange(o.n_, 0)) {}
  AlignedBuf& operator=(AlignedBuf&& o) noexcept {
    ptr_ = std::move(o.ptr_);
    n_ = std::exchange(o.n_, 0);
    return *this;
  }
  void resize(size_t n) {
    if (n == n_) return;
    size_t bytes = (n * sizeof(T) + 63) & ~size_t(63);
    void* p = bytes ? std::aligned_alloc(64, bytes) : nullptr;
    if (bytes && !p) throw std::bad_alloc();
    if (bytes) std::memset(p, 0, bytes);
    ptr_.reset(static_cast<T*>(p));
    n_ = n;
  }
  T* data() { return ptr_.get(); }
  const T* data() const { return ptr_.get(); }
  size_t size() const { return n_; }
  size_t bytes() const { return n_ * sizeof(T); }
  T& operator[](size_t i) { return ptr_.get()[i]; }
  const T& operator[](size_t i) const { return ptr_.get()[i]; }

 private:
  std::unique_ptr<T, AlignedFree> ptr_;
  size_t n_ = 0;
};

}  // namespace kvq
