// Errors: kvq::Error for everything a user supplies (files, flags, HTTP bodies), thrown at the
// edge and caught by the CLI/server; KVQ_CHECK for internal invariants (abort with location).
#pragma once
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include <fmt/format.h>

#include "kvq/error.h"

namespace kvq {

template <typename... Args>
[[noreturn]] inline void fail(fmt::format_string<Args...> f, Args&&... args) {
  throw Error(fmt::format(f, std::forward<Args>(args)...));
}

[[noreturn]] inline void check_failed(const char* file, int line, const char* cond, const std::string& msg) {
  std::fprintf(stderr, "kvq: internal error at %s:%d: check failed: %s %s\n", file, line, cond, msg.c_str());
  std::abort();
}

}  // namespace kvq

#define KVQ_CHECK(cond, ...)                                                                   \
  do {                                                                                         \
    if (!(cond)) [[unlikely]]                                                                  \
      ::kvq::check_failed(__FILE__, __LINE__, #cond, ::fmt::format("" __VA_ARGS__));           \
  } while (0)
