#include "tools/files.h"

#include <filesystem>
#include <fstream>
#include <sstream>
#include <system_error>

#include "core/error.h"

namespace kvq {

void check_input_file(const std::string& path, const char* flag) {
  std::error_code ec;
  const auto st = std::filesystem::status(path, ec);
  if (ec || !std::filesystem::exists(st)) fail("{}: cannot read '{}': no such file", flag, path);
  if (std::filesystem::is_directory(st)) fail("{}: cannot read '{}': it is a directory, not a file", flag, path);
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{}: cannot read '{}'", flag, path);
}

std::string read_text_file(const std::string& path, const char* flag) {
  check_input_file(path, flag);
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{}: cannot read '{}'", flag, path);
  std::stringstream ss;
  ss << in.rdbuf();
  if (in.bad()) fail("{}: reading '{}' failed", flag, path);
  return ss.str();
}

}  // namespace kvq
