#include "core/thread_pool.h"

#include <immintrin.h>

#include "core/error.h"

namespace kvq {

ThreadPool::ThreadPool(int n_threads) : n_threads_(n_threads < 1 ? 1 : n_threads) {
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
    (*job_)(idx, n_threads_);
    pending_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

void ThreadPool::run(const std::function<void(int, int)>& fn) {
  if (n_threads_ == 1) {
    fn(0, 1);
    return;
  }
  job_ = &fn;
  pending_.store(n_threads_ - 1, std::memory_order_release);
  {
    std::lock_guard<std::mutex> lk(mu_);
    generation_.fetch_add(1, std::memory_order_acq_rel);
  }
  cv_.notify_all();
  fn(0, n_threads_);
  // Spin briefly (the common case: workers finish within microseconds), then yield so that a
  // descheduled worker on an oversubscribed machine gets the core instead of us burning it.
  for (int spins = 0; pending_.load(std::memory_order_acquire) != 0; ++spins) {
    if (spins < 4000) _mm_pause();
    else std::this_thread::yield();
  }
}

void ThreadPool::parallel_for(size_t n, size_t grain, const std::function<void(size_t, size_t)>& fn) {
  if (n == 0) return;
  if (grain == 0) grain = 1;
  size_t chunks = (n + grain - 1) / grain;
  if (n_threads_ == 1 || chunks == 1) {
    fn(0, n);
    return;
  }
  run([&](int t, int nt) {
    size_t c0 = chunks * size_t(t) / size_t(nt), c1 = chunks * size_t(t + 1) / size_t(nt);
    size_t b = c0 * grain, e = c1 * grain < n ? c1 * grain : n;
    if (b < e) fn(b, e);
  });
}

}  // namespace kvq
