// Server-sent events as the tests read them: OpenAI's chat and completions streams ("data: JSON"
// events, then "data: [DONE]"), and named ones ("event: NAME\ndata: JSON", as Anthropic's Messages
// API and OpenAI's Responses API stream them). A malformed event fails the test.
#pragma once
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

// The stream's events, each the text before its "\n\n".
inline std::vector<std::string> sse_blocks(const std::string& raw) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos < raw.size()) {
    const size_t end = raw.find("\n\n", pos);
    EXPECT_NE(end, std::string::npos) << "unterminated event";
    if (end == std::string::npos) break;
    out.push_back(raw.substr(pos, end - pos));
    pos = end + 2;
  }
  return out;
}

// OpenAI's streams: the events' data, then [DONE] (*done); an event after [DONE] fails the test.
inline std::vector<nlohmann::json> data_sse_events(const std::string& raw, bool* done) {
  std::vector<nlohmann::json> evs;
  *done = false;
  for (const std::string& ev : sse_blocks(raw)) {
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

// Named events: (name, data) pairs; each event's data repeats its name as its type.
inline std::vector<std::pair<std::string, nlohmann::json>> named_sse_events(const std::string& raw) {
  std::vector<std::pair<std::string, nlohmann::json>> out;
  for (const std::string& ev : sse_blocks(raw)) {
    const size_t nl = ev.find('\n');
    EXPECT_EQ(ev.rfind("event: ", 0), 0u) << ev;
    EXPECT_TRUE(nl != std::string::npos && ev.compare(nl + 1, 6, "data: ") == 0) << ev;
    if (nl == std::string::npos) break;
    nlohmann::json data = nlohmann::json::parse(ev.substr(nl + 7));
    EXPECT_EQ(data["type"], ev.substr(7, nl - 7)) << ev;
    out.emplace_back(ev.substr(7, nl - 7), std::move(data));
  }
  return out;
}
