// A fixed pool of worker threads for data-parallel kernels. The calling thread takes part.
// Workers spin briefly before sleeping, because decode issues hundreds of short parallel regions
// per token.
//
// parallel_for hands out chunks dynamically (an atomic counter), and a worker that wakes up after
// the caller has finished every chunk skips the job instead of being waited for: on a machine
// shared with other processes a descheduled thread no longer stalls the whole step, the others
// just take its chunks.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kvq {

// The thread count for a -t value: n when n > 0, else every hardware thread. More threads than
// the machine has are allowed, with a warning on stderr (once per process): workers spin while
// they wait, so threads beyond the cores slow every parallel region instead of helping.
int resolve_threads(int requested);

class ThreadPool {
 public:
  explicit ThreadPool(int n_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }
  // fn(thread_index, n_threads): each thread decides its share, every index runs exactly once.
  // Blocks until all are done.
  void run(const std::function<void(int, int)>& fn);
  // fn(begin, end) over contiguous chunks of [0, n), chunk boundaries multiples of `grain`; every
  // element is covered exactly once, by whichever thread claims its chunk. Blocks until done.
  void parallel_for(size_t n, size_t grain, const std::function<void(size_t, size_t)>& fn);

 private:
  void worker(int idx);
  // Publishes fn to the workers; `all` = every worker must take part (run), else late workers
  // may skip it (parallel_for). Returns after the caller's own fn(0, n) and the wait.
  void dispatch(const std::function<void(int, int)>& fn, bool all);
  int n_threads_;
  std::vector<std::thread> threads_;
  const std::function<void(int, int)>* job_ = nullptr;
  std::atomic<uint64_t> generation_{0};
  // The current job's admission word: [generation tag:32][closed:1][entered:15][inside:16].
  // A worker enters only while the tag is its generation and the job is open, so a worker that
  // wakes up late can never run a job twice or run one the caller has already returned from.
  std::atomic<uint64_t> entry_{0};
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::condition_variable cv_;
};

}  // namespace kvq
