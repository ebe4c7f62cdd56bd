#include "core/thread_pool.h"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdio>

#include "core/error.h"

namespace kvq {

namespace {

constexpr uint64_t kInside = 1;            // bits 0-15
constexpr uint64_t kEntered = 1ull << 16;  // bits 16-30
constexpr uint64_t kClosed = 1ull << 31;
inline uint32_t entry_tag(uint64_t s) { return uint32_t(s >> 32); }
inline uint64_t entry_inside(uint64_t s) { return s & 0xFFFF; }
inline uint64_t entry_entered(uint64_t s) { return (s >> 16) & 0x7FFF; }

// Spin briefly (the common case: workers finish within microseconds), then yield so that a
// descheduled thread on an oversubscribed machine gets the core instead of us burning it.
template <class Done>
void wait_until(Done done) {
  for (int spins = 0; !done(); ++spins) {
    if (spins < 4000) _mm_pause();
    else std::this_thread::yield();
  }
}

}  // namespace

int resolve_threads(int requested) {
  const int hw = int(std::max(1u, std::thread::hardware_concurrency()));
  if (requested <= 0) return hw;
  static std::atomic<bool> warned{false};
  if (requested > hw && !warned.exchange(true))
    std::fprintf(stderr,
                 "[kvq] warning: %d threads on a machine with %d hardware threads: the extra threads slow every step "
                 "(-t %d or less)\n",
                 requested, hw, hw);
  return requested;
}

ThreadPool::ThreadPool(int n_threads) : n_threads_(n_threads < 1 ? 1 : n_threads) {
  KVQ_CHECK(n_threads_ < 0x7FFF);
  for (int i = 1; i < n_threads_; ++i) threads_.emplace_back([this, i] { worker(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_.store(true);
    generation_.fetch_add(1);
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

void ThreadPool::worker(int idx) {
  uint64_t seen = 0;
  for (;;) {
    // spin, then sleep
    int spins = 0;
    while (generation_.load(std::memory_order_acquire) == seen && spins < 20000) {
      _mm_pause();
      ++spins;
    }
    if (generation_.load(std::memory_order_acquire) == seen) {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return generation_.load(std::memory_order_acquire) != seen; });
    }
    seen = generation_.load(std::memory_order_acquire);
    if (stop_.load()) return;
    uint64_t s = entry_.load(std::memory_order_acquire);
    bool entered = false;
    while (entry_tag(s) == uint32_t(seen) && !(s & kClosed)) {
      if (entry_.compare_exchange_weak(s, s + kEntered + kInside, std::memory_order_acq_rel)) {
        entered = true;
        break;
      }
    }
    // Not entered: the caller closed this job (all chunks done) or has already moved on to a
    // newer one, which the next loop iteration sees.
    if (!entered) continue;
    (*job_)(idx, n_threads_);
    entry_.fetch_sub(kInside, std::memory_order_acq_rel);
  }
}

void ThreadPool::dispatch(const std::function<void(int, int)>& fn, bool all) {
  // No worker is inside the previous job (we waited), and a late one can only enter a job whose
  // tag matches the generation it read, so job_ and entry_ are ours to set.
  job_ = &fn;
  const uint64_t gen = generation_.load(std::memory_order_relaxed) + 1;
  entry_.store(uint64_t(uint32_t(gen)) << 32, std::memory_order_release);
  {
    std::lock_guard<std::mutex> lk(mu_);
    generation_.store(gen, std::memory_order_release);
  }
  cv_.notify_all();
  fn(0, n_threads_);
  if (all) {
    const uint64_t need = uint64_t(n_threads_ - 1);
    wait_until([&] {
      const uint64_t s = entry_.load(std::memory_order_acquire);
      return entry_entered(s) == need && entry_inside(s) == 0;
    });
  } else {
    entry_.fetch_or(kClosed, std::memory_order_acq_rel);
    wait_until([&] { return entry_inside(entry_.load(std::memory_order_acquire)) == 0; });
  }
}

void ThreadPool::run(const std::function<void(int, int)>& fn) {
  if (n_threads_ == 1) {
    fn(0, 1);
    return;
  }
  dispatch(fn, true);
}

void ThreadPool::parallel_for(size_t n, size_t grain, const std::function<void(size_t, size_t)>& fn) {
  if (n == 0) return;
  if (grain == 0) grain = 1;
  const size_t chunks = (n + grain - 1) / grain;
  if (n_threads_ == 1 || chunks == 1) {
    fn(0, n);
    return;
  }
  // Claims of several chunks: few enough atomic operations, small enough that the threads finish
  // together (about 4 claims per thread when all run at the same speed).
  const size_t step = std::max<size_t>(1, chunks / (size_t(n_threads_) * 4));
  std::atomic<size_t> next{0};
  dispatch(
      [&](int, int) {
        for (;;) {
          const size_t c0 = next.fetch_add(step, std::memory_order_relaxed);
          if (c0 >= chunks) return;
          const size_t c1 = std::min(chunks, c0 + step);
          fn(c0 * grain, std::min(c1 * grain, n));
        }
      },
      false);
}

}  // namespace kvq
