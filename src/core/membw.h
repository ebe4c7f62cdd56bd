// Measured memory read bandwidth of this machine: the reference that kernel benchmarks report
// their GB/s against (a kernel is "at 80%" of what this loop achieves, same binary, same run).
#pragma once
#include <cstddef>

namespace kvq {
class ThreadPool;
// Streams a buffer of `bytes` (default 1 GiB: well beyond the caches) `reps` times with
// `pool`'s threads, summing it with wide loads; returns the median GB/s (1e9 bytes/s).
double measure_read_bandwidth_gbs(ThreadPool& pool, size_t bytes = size_t(1) << 30, int reps = 5);
}  // namespace kvq
