#include "tools/files.h"

#include <filesystem>
#include <fstream>
#include <system_error>

#include "core/error.h"
#include "model/chat.h"

namespace kvq {

void check_input_file(const std::string& path, const char* flag) {
  std::error_code ec;
  const auto st = std::filesystem::status(path, ec);
  if (ec || !std::filesystem::exists(st)) fail("{}: cannot read '{}': no such file", flag, path);
  if (std::filesystem::is_directory(st)) fail("{} '{}' is a directory, not a file", flag, path);
}

std::string read_text_file(const std::string& path, const char* flag) {
  check_input_file(path, flag);
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("{}: cannot read '{}'", flag, path);
  // A read error (EIO) sets badbit here; a stream insertion of rdbuf() would only look empty.
  std::string text;
  char buf[1 << 16];
  while (in.read(buf, sizeof buf) || in.gcount() > 0) text.append(buf, size_t(in.gcount()));
  if (in.bad()) fail("{}: reading '{}' failed", flag, path);
  return text;
}

std::optional<std::string> read_chat_template_file(const std::string& path) {
  if (path.empty()) return std::nullopt;
  std::string text = read_text_file(path, "--chat-template-file");
  if (!chat_template_from_text(text).known())
    fail("--chat-template-file '{}': not a chat template kvq renders (supported: {}; a family is recognized by its "
         "markers, e.g. <|im_start|> for ChatML)",
         path, chat_supported_families());
  return text;
}

}  // namespace kvq
