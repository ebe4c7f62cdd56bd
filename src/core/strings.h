// Small string helpers shared by the command-line tools.
#pragma once
#include <cctype>
#include <string>
#include <string_view>
#include <vector>

namespace kvq {

// s without leading and trailing white space.
inline std::string trim(std::string_view s) {
  size_t a = 0, b = s.size();
  while (a < b && std::isspace(static_cast<unsigned char>(s[a]))) ++a;
  while (b > a && std::isspace(static_cast<unsigned char>(s[b - 1]))) --b;
  return std::string(s.substr(a, b - a));
}

// "a, b,,c" -> {"a", "b", "", "c"}: every comma-separated item, trimmed (empty items kept).
inline std::vector<std::string> split_list(std::string_view s) {
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    const size_t comma = s.find(',', start);
    out.push_back(trim(s.substr(start, comma == std::string_view::npos ? s.npos : comma - start)));
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  return out;
}

// A string read from a file (GGUF metadata), made safe to print in an error message: control
// bytes (a NUL that would cut the message, terminal escapes) as \xNN, at most max_bytes shown.
inline std::string printable(std::string_view s, size_t max_bytes = 120) {
  static const char* hex = "0123456789abcdef";
  std::string o;
  for (size_t i = 0; i < s.size() && i < max_bytes; ++i) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c < 0x20 || c == 0x7f) {
      o += "\\x";
      o += hex[c >> 4];
      o += hex[c & 15];
    } else {
      o += char(c);
    }
  }
  if (s.size() > max_bytes) o += "...";
  return o;
}

}  // namespace kvq
