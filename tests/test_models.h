// Where the tests find the models scripts/get-models.sh installs: $KVQ_MODELS_DIR, then models/
// in the source tree. "" when absent (the test skips and says how to install them).
#pragma once
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

inline std::string kvq_test_model(const std::string& file) {
  std::vector<std::string> dirs;
  if (const char* d = std::getenv("KVQ_MODELS_DIR")) dirs.push_back(d);
  dirs.push_back(std::string(KVQ_SOURCE_DIR) + "/models");
  for (const auto& d : dirs)
    if (!d.empty() && std::filesystem::exists(d + "/" + file)) return d + "/" + file;
  return "";
}
