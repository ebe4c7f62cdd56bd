// The KV-cache flags (tools/kv_flags.h) resolved against a real model: -ctk / -ctv on top of a
// K/V split or a token group, --kv-layer's errors, --kv-scales files that cannot be read, empty
// format names. Every bad value is a kvq::Error naming the flag, never another exception.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "model/model.h"
#include "tools/kv_flags.h"

namespace fs = std::filesystem;
using namespace kvq;

namespace {

// stories260K: 5 layers, head_dim 8.
const Model* stories() {
  static std::unique_ptr<Model> m = [] {
    const std::string path = std::string(KVQ_SOURCE_DIR) + "/../shared/models/stories260K.gguf";
    return fs::exists(path) ? Model::load(path) : nullptr;
  }();
  return m.get();
}

#define REQUIRE_STORIES()                                                      \
  const Model* model = stories();                                              \
  if (!model) GTEST_SKIP() << "stories260K.gguf not found in ../shared/models"

// The error kv_flags_resolve throws for f ("no error" when it throws none); any other exception
// fails the test.
std::string resolve_error(const KvFlags& f, const Model& m) {
  try {
    kv_flags_resolve(f, m);
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

// --kv-scales that names a directory, or a file that fails while it is read, is a kvq::Error
// (the CLI's one-line message), not an uncaught stream exception.
TEST(KvFlags, UnreadableScalesFileRejected) {
  REQUIRE_STORIES();
  const fs::path dir = fs::temp_directory_path() / ("kvq_kv_flags_dir_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  KvFlags f;
  f.kv_cache_dtype = "int8_static";
  f.scales_file = dir.string();
  const std::string e = resolve_error(f, *model);
  fs::remove_all(dir);
  EXPECT_NE(e.find("is a directory"), std::string::npos) << e;
  EXPECT_NE(e.find("--kv-scales"), std::string::npos) << e;
  f.scales_file = (dir / "missing.json").string();
  EXPECT_NE(resolve_error(f, *model).find("cannot read"), std::string::npos);
  // A file that opens but fails on read (EIO at address 0 of the process's memory).
  if (fs::exists("/proc/self/mem")) {
    f.scales_file = "/proc/self/mem";
    EXPECT_NE(resolve_error(f, *model).find("--kv-scales"), std::string::npos);
  }
}
