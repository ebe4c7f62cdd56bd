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

// The real vocabularies the token-mask tests run over: stories260K's (SentencePiece with byte
// tokens, from ../shared) and SmolLM2's (byte-level BPE, 49152 tokens, from scripts/get-models.sh).
// A test skips the one that is absent.
inline std::vector<std::string> kvq_vocab_test_models() {
  return {std::string(KVQ_SOURCE_DIR) + "/../shared/models/stories260K.gguf",
          std::string(KVQ_SOURCE_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf"};
}
