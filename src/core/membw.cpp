#include "core/membw.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <new>
#include <vector>

#include "core/aligned.h"
#include "core/thread_pool.h"
#include "core/timer.h"

namespace kvq {

double measure_read_bandwidth_gbs(ThreadPool& pool, size_t bytes, int reps) {
  const size_t n = bytes / sizeof(uint64_t);
  // In huge pages, as the KV page pool and attn_bench's buffers: with 4 KiB mappings this loop
  // read about 5% slower on the AVX2 Zen 3, which would flatter every kernel's share of it.
  std::unique_ptr<uint64_t, AlignedFree> mem(static_cast<uint64_t*>(aligned_alloc_huge(n * sizeof(uint64_t))));
  if (!mem) throw std::bad_alloc();
  uint64_t* buf = mem.get();
  for (size_t i = 0; i < n; ++i) buf[i] = i;  // every page touched before timing
  std::vector<double> gbs;
  std::atomic<uint64_t> sink{0};  // keeps the sums alive; one relaxed add per chunk
  for (int r = 0; r < reps + 1; ++r) {
    double t0 = now_seconds();
    pool.parallel_for(n, 4096, [&](size_t b, size_t e) {
      // 8 independent accumulators so the loop is bound by loads, not by the add chain
      uint64_t a[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      const uint64_t* p = buf;
      for (size_t i = b; i + 8 <= e; i += 8)
        for (int j = 0; j < 8; ++j) a[j] += p[i + j];
      uint64_t s = 0;
      for (int j = 0; j < 8; ++j) s += a[j];
      sink.fetch_add(s, std::memory_order_relaxed);
    });
    double dt = now_seconds() - t0;
    if (r > 0) gbs.push_back(double(n * sizeof(uint64_t)) / dt / 1e9);  // first pass warms up
  }
  volatile uint64_t keep = sink.load();
  (void)keep;
  std::sort(gbs.begin(), gbs.end());
  return gbs[gbs.size() / 2];
}

}  // namespace kvq
