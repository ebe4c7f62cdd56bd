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

}  // namespace kvq
