// OpenAI's chat and completions streams: "data: JSON\n\n" events, then "data: [DONE]\n\n" (*done);
// an event after [DONE], or a malformed one, fails the test.
inline std::vector<nlohmann::json> data_sse_events(const std::string& raw, bool* done) {
  std::vector<nlohmann::json> evs;
  *done = false;
  size_t pos = 0;
  while (pos < raw.size()) {
    const size_t end = raw.find("\n\n", pos);
    EXPECT_NE(end, std::string::npos) << "unterminated event";
    if (end == std::string::npos) break;
    const std::string ev = raw.substr(pos, end - pos);
    pos = end + 2;
    EXPECT_EQ(ev.rfind("data: ", 0), 0u) << ev;
    EXPECT_FALSE(*done) << "event after [DONE]";
    const std::string data = ev.substr(6);
    if (data == "[DONE]") {
      *done = true;
      continue;
    }
    evs.push_back(nlohmann::json::parse(data));
  }
  return evs;
}

// Server-sent events with names, "event: NAME\ndata: JSON\n\n" each, as Anthropic's Messages API and
// OpenAI's Responses API stream them: (name, data) pairs; a malformed event fails the test.
#pragma once
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

inline std::vector<std::pair<std::string, nlohmann::json>> named_sse_events(const std::string& raw) {
  std::vector<std::pair<std::string, nlohmann::json>> out;
  size_t pos = 0;
  while (pos < raw.size()) {
    const size_t end = raw.find("\n\n", pos);
    EXPECT_NE(end, std::string::npos) << "unterminated event";
    if (end == std::string::npos) break;
    const std::string ev = raw.substr(pos, end - pos);
    pos = end + 2;
    const size_t nl = ev.find('\n');
    EXPECT_EQ(ev.rfind("event: ", 0), 0u) << ev;
    EXPECT_TRUE(nl != std::string::npos && ev.compare(nl + 1, 6, "data: ") == 0) << ev;
    if (nl == std::string::npos) break;
    nlohmann::json data = nlohmann::json::parse(ev.substr(nl + 7));
    EXPECT_EQ(data["type"], ev.substr(7, nl - 7)) << ev;  // each event repeats its name as the data's type
    out.emplace_back(ev.substr(7, nl - 7), std::move(data));
  }
  return out;
}
