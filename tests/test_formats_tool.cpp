// `kvq formats` (src/tools/formats.*): listing, JSON, distortion numbers against known values.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "kvq/kv_format.h"
#include "tools/formats.h"

using namespace kvq;

namespace {
std::string run(const FormatsOptions& o) {
  char* buf = nullptr;
  size_t len = 0;
  std::FILE* f = open_memstream(&buf, &len);
  EXPECT_EQ(formats_command(o, f), 0);
  std::fclose(f);
  std::string s(buf, len);
  std::free(buf);
  return s;
}
}  // namespace

TEST(FormatsTool, ListsEveryFormat) {
  const std::string s = run({});
  for (const auto& f : kv_formats()) EXPECT_NE(s.find(f.name), std::string::npos) << f.name;
  EXPECT_NE(s.find("auto,fp16,half"), std::string::npos);
}

TEST(FormatsTool, JsonWithDistortion) {
  FormatsOptions o;
  o.json = true;
  o.distortion = true;
  o.trials = 300;
  const auto j = nlohmann::json::parse(run(o));
  ASSERT_EQ(j["formats"].size(), kv_formats().size());
  for (const auto& f : j["formats"]) {
    if (f["name"] == "f32") {
      EXPECT_EQ(f["k"]["mse"].get<double>(), 0.0);
      EXPECT_EQ(f["bits"].get<double>(), 32.0);
    }
    if (f["name"] == "int8") {
      // Unit vectors in d = 128: absmax ~ 0.25, step ~ 0.002, MSE ~ 128 * step^2 / 12 ~ 5e-5.
      const double mse = f["k"]["mse"].get<double>();
      EXPECT_GT(mse, 1e-5);
      EXPECT_LT(mse, 2e-4);
      EXPECT_DOUBLE_EQ(f["bits"].get<double>(), 8.25);
    }
    if (f["name"] == "int4_g32") {
      // Finer than int2, coarser than int8.
      EXPECT_GT(f["k"]["mse"].get<double>(), 1e-3);
      EXPECT_LT(f["k"]["mse"].get<double>(), 2e-2);
      EXPECT_LT(std::fabs(f["k"]["ip_bias"].get<double>()), 3 * f["k"]["ip_rmse"].get<double>() / std::sqrt(300.0) + 1e-4);
    }
    if (f["name"] == "fp8_e4m3_static") {
      EXPECT_TRUE(f["k"]["needs_calibration"].get<bool>());
    }
  }
}

TEST(FormatsTool, RejectsBadOptions) {
  FormatsOptions o;
  o.dim = 0;
  EXPECT_THROW(formats_command(o, stdout), Error);
  o = {};
  o.block_tokens = 48;
  EXPECT_THROW(formats_command(o, stdout), Error);
}

// 16-token pages: every format is still listed; a codec whose token group does not fit the page
// (KIVI's G = 32) is a row of n/a instead of an error that ends the listing.
TEST(FormatsTool, SmallPagesListEveryFormat) {
  FormatsOptions o;
  o.block_tokens = 16;
  const std::string s = run(o);
  for (const auto& f : kv_formats()) EXPECT_NE(s.find(f.name), std::string::npos) << f.name;
  EXPECT_NE(s.find("n/a"), std::string::npos);
  o.json = true;
  EXPECT_EQ(nlohmann::json::parse(run(o))["formats"].size(), kv_formats().size());
}
