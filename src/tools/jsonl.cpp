#include "tools/jsonl.h"

#include <fstream>

#include "core/error.h"
#include "tools/files.h"

namespace kvq {

size_t jsonl_for_each(const std::string& path, const char* flag,
                      const std::function<void(const nlohmann::json& value, int line)>& fn) {
  check_input_file(path, flag);
  std::ifstream in(path);
  if (!in) fail("{}: cannot read '{}'", flag, path);
  std::string line;
  int ln = 0;
  size_t n = 0;
  while (std::getline(in, line)) {
    ++ln;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      fail("{} {}:{}: malformed JSON: {}", flag, path, ln, e.what());
    }
    fn(j, ln);
    ++n;
  }
  return n;
}

}  // namespace kvq
