// A fixed pool of worker threads for data-parallel kernels: parallel_for splits [0, n) into
// contiguous chunks, one per thread, and the calling thread takes part. Workers spin briefly
// before sleeping, because decode issues hundreds of short parallel regions per token.
#pragma once
#include <atomic>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace kvq {

class ThreadPool {
 public:
  explicit ThreadPool(int n_threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }
  // fn(thread_index, n_threads): each thread decides its share. Blocks until all are done.
  void run(const std::function<void(int, int)>& fn);
  // fn(begin, end) over contiguous chunks of [0, n), chunk boundaries multiples of `grain`.
  void parallel_for(size_t n, size_t grain, const std::function<void(size_t, size_t)>& fn);

 private:
  void worker(int idx);
  int n_threads_;
  std::vector<std::thread> threads_;
  const std::function<void(int, int)>* job_ = nullptr;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
  std::mutex mu_;
  std::condition_variable cv_;
};

}  // namespace kvq
