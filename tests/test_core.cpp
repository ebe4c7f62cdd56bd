#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

#include "core/dtypes.h"
#include "core/thread_pool.h"

using namespace kvq;

TEST(Dtypes, F16RoundTripAllCodes) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    float f = f16_to_f32(uint16_t(h));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(f16_to_f32(f32_to_f16(f))));
      continue;
    }
    EXPECT_EQ(f32_to_f16(f), h) << "code " << h;
  }
}

TEST(Dtypes, F16RoundsToNearestEven) {
  // 1 + 2^-11 is exactly halfway between 1 and 1 + 2^-10: ties to even (1.0).
  EXPECT_EQ(f32_to_f16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
  // 1 + 3*2^-11 is halfway between 1+2^-10 (odd) and 1+2^-9 (even): rounds up.
  EXPECT_EQ(f32_to_f16(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);
  EXPECT_EQ(f32_to_f16(65504.f), 0x7bff);
  EXPECT_EQ(f32_to_f16(65520.f), 0x7c00);  // overflow to inf
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -25)), 0x0000);  // half of the smallest subnormal: to even 0
  EXPECT_EQ(f32_to_f16(std::ldexp(3.0f, -25)), 0x0002);  // 1.5 ulp: to even 2
}

TEST(Dtypes, Bf16RoundTrip) {
  for (uint32_t h = 0; h < 0x10000; ++h) {
    float f = bf16_to_f32(uint16_t(h));
    if (std::isnan(f)) continue;
    EXPECT_EQ(f32_to_bf16(f), h);
  }
  EXPECT_EQ(f32_to_bf16(f32_from_bits(0x3f808000u)), 0x3f80);  // tie to even
  EXPECT_EQ(f32_to_bf16(f32_from_bits(0x3f818000u)), 0x3f82);
}

TEST(ThreadPool, ParallelForCoversRangeOnce) {
  for (int nt : {1, 2, 3, 4}) {
    ThreadPool pool(nt);
    for (size_t n : {size_t(1), size_t(7), size_t(1000), size_t(4097)}) {
      std::vector<int> hits(n, 0);
      pool.parallel_for(n, 16, [&](size_t b, size_t e) {
        for (size_t i = b; i < e; ++i) hits[i]++;
      });
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(hits[i], 1) << "n=" << n << " i=" << i;
    }
  }
}

TEST(ThreadPool, RunCallsEveryIndexOnce) {
  for (int nt : {1, 2, 3, 5}) {
    ThreadPool pool(nt);
    for (int rep = 0; rep < 50; ++rep) {
      std::vector<std::atomic<int>> calls(static_cast<size_t>(nt));
      pool.run([&](int t, int n) {
        ASSERT_EQ(n, nt);
        calls[size_t(t)].fetch_add(1);
      });
      for (int t = 0; t < nt; ++t) ASSERT_EQ(calls[size_t(t)].load(), 1) << "nt=" << nt << " t=" << t;
    }
  }
}

// Interleaved run / parallel_for jobs, many short ones: a worker that wakes late for a
// parallel_for must neither run it after the caller returned nor run a later job twice.
TEST(ThreadPool, InterleavedJobsStayExact) {
  for (int nt : {2, 3}) {
    ThreadPool pool(nt);
    for (int rep = 0; rep < 600; ++rep) {
      const size_t n = 1 + size_t(rep % 97);
      std::vector<int> hits(n, 0);
      pool.parallel_for(n, 1 + size_t(rep % 5), [&](size_t b, size_t e) {
        for (size_t i = b; i < e; ++i) hits[i]++;
      });
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(hits[i], 1) << "rep=" << rep << " i=" << i;
      if (rep % 3 == 0) {
        std::atomic<int> sum{0};
        pool.run([&](int t, int) { sum.fetch_add(1 << t); });
        ASSERT_EQ(sum.load(), (1 << nt) - 1);
      }
    }
  }
}

// Chunks are claimed dynamically: while one thread is stuck on its first claim, the other takes
// every remaining chunk instead of waiting with its static half.
TEST(ThreadPool, StalledThreadDoesNotHoldItsShare) {
  ThreadPool pool(2);
  const size_t n = 64 * 16;
  std::mutex mu;
  std::map<std::thread::id, size_t> done;
  pool.parallel_for(n, 16, [&](size_t b, size_t e) {
    if (b == 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));
    std::lock_guard<std::mutex> lk(mu);
    done[std::this_thread::get_id()] += e - b;
  });
  size_t total = 0;
  for (auto& [id, c] : done) total += c;
  EXPECT_EQ(total, n);
  ASSERT_EQ(done.size(), 2u) << "both threads should have taken chunks";
  // the thread that slept (it ran element 0) should have done only its first claim
  size_t least = n;
  for (auto& [id, c] : done) least = std::min(least, c);
  EXPECT_LT(least, n / 4) << "the stalled thread kept a static share";
}
