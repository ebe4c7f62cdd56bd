// libFuzzer target for function calling (server/tools.h): arbitrary bytes as a chat request body
// (tools, tool_choice, parallel_tool_calls, messages), then, after a 0xFF separator, a reply.
// Reading the body and compiling an active spec's reply grammar must succeed or throw ToolsError
// (never another exception); reading any reply must not
// throw, and its response text streamed in pieces must always be a prefix of the whole reply's
// content (and all of it when the reply has no calls and is a response whose string was closed).
#include <cstdint>
#include <random>
#include <stdexcept>
#include <string>
#include <string_view>

#include "model/json_schema.h"
#include "server/tools.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view all(reinterpret_cast<const char*>(data), size);
  const size_t cut = all.find('\xFF');
  const std::string_view body_text = all.substr(0, cut);
  const std::string reply(cut == std::string_view::npos ? std::string_view() : all.substr(cut + 1));

  const nlohmann::ordered_json body = nlohmann::ordered_json::parse(body_text, nullptr, false);
  if (!body.is_discarded() && body.is_object()) {
    try {
      const kvq::ToolSpec spec = kvq::parse_tools(body);
      (void)kvq::tool_system_prompt(spec, true);
      if (spec.active()) (void)kvq::tool_reply_grammar(spec, nullptr);
    } catch (const kvq::ToolsError&) {
    }
    if (body.contains("messages")) {
      try {
        kvq::ChatTemplate tpl;
        tpl.family = kvq::ChatFamily::chatml;
        (void)kvq::tool_chat_messages(nlohmann::json::parse(body["messages"].dump()), "T", tpl);
      } catch (const kvq::ToolsError&) {
      }
    }
  }

  std::mt19937_64 rng(size);
  for (bool string_response : {true, false}) {
    const kvq::ToolReply whole = kvq::parse_tool_reply(reply, string_response, rng);
    kvq::ToolReplyStream st(string_response);
    std::string out;
    for (size_t at = 0, k = 0; at < reply.size(); ++k) {
      const size_t n = std::min(reply.size() - at, size_t(1 + (k * 7 + size) % 5));
      out += st.feed(reply.substr(at, n));
      at += n;
      if (out != st.streamed()) __builtin_trap();
    }
    if (!string_response && !out.empty()) __builtin_trap();
    // Streamed text is the response's: a prefix of the reply's content, unless the reply turned
    // out to be calls (a response cannot: its lead decides the form).
    if (whole.calls.empty() && whole.content.compare(0, out.size(), out) != 0) __builtin_trap();
    if (!whole.calls.empty() && !out.empty()) __builtin_trap();
  }
  return 0;
}
