// kvq bench's percentile (linear interpolation between order statistics), on hand-computed cases.
#include <gtest/gtest.h>

#include <cmath>

#include "tools/bench.h"

using kvq::bench_percentile;

TEST(BenchTool, PercentileInterpolates) {
  std::vector<double> v{5, 1, 4, 2, 3};  // unsorted on purpose
  EXPECT_DOUBLE_EQ(bench_percentile(v, 0.5), 3.0);
  EXPECT_DOUBLE_EQ(bench_percentile(v, 0.95), 4.8);  // 0.95 * 4 = 3.8: 4 + 0.8 * (5 - 4)
  EXPECT_DOUBLE_EQ(bench_percentile(v, 0.0), 1.0);
  EXPECT_DOUBLE_EQ(bench_percentile(v, 1.0), 5.0);
  std::vector<double> two{10, 20};
  EXPECT_DOUBLE_EQ(bench_percentile(two, 0.5), 15.0);
  std::vector<double> one{7};
  EXPECT_DOUBLE_EQ(bench_percentile(one, 0.95), 7.0);
  std::vector<double> none;
  EXPECT_TRUE(std::isnan(bench_percentile(none, 0.5)));
}
