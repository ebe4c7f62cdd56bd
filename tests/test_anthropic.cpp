// Anthropic's Messages API read into chat requests and written back (server/anthropic.h), without
// a model: the body's translation field by field, the refusals, stop reasons, usage, and the
// stream's events in Anthropic's order.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "server/anthropic.h"
#include "sse_events.h"

using namespace kvq;
using ojson = nlohmann::ordered_json;
using json = nlohmann::json;

namespace {

ojson translate(const std::string& body, bool count_tokens = false) {
  return anthropic_chat_body(ojson::parse(body), count_tokens);
}

// The field a refused body names.
std::string refused(const std::string& body, bool count_tokens = false) {
  try {
    (void)translate(body, count_tokens);
  } catch (const AnthropicError& e) {
    EXPECT_NE(std::string(e.what()), "") << body;
    return e.param;
  }
  ADD_FAILURE() << "accepted: " << body;
  return "";
}

// Events of an SSE text: (name, data) pairs.
std::vector<std::pair<std::string, json>> events(const std::string& text) { return named_sse_events(text); }

}  // namespace

TEST(Anthropic, PlainRequest) {
  const ojson c = translate(R"j({"model": "m", "max_tokens": 64, "system": "Be brief.", "stop_sequences": ["\n\n", "END"],
    "temperature": 0.5, "top_p": 0.9, "top_k": 40, "stream": true, "metadata": {"user_id": "u"},
    "service_tier": "auto", "cache_control": {"type": "ephemeral"}, "speed": "standard", "inference_geo": "us",
    "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                 {"role": "user", "content": [{"type": "text", "text": "Tell "}, {"type": "text", "text": "a story",
                   "cache_control": {"type": "ephemeral"}}]}]})j");
  const ojson want = ojson::parse(R"j({"model": "m", "max_tokens": 64,
    "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                 {"role": "assistant", "content": "Hello."},
                 {"role": "user", "content": [{"type": "text", "text": "Tell "}, {"type": "text", "text": "a story"}]}],
    "stop": ["\n\n", "END"], "temperature": 0.5, "top_p": 0.9, "top_k": 40, "stream": true})j");
  EXPECT_EQ(c, want) << c.dump(1);
  // system as text blocks; count_tokens' body has no max_tokens
  const ojson t = translate(R"j({"model": "m", "system": [{"type": "text", "text": "A"}, {"type": "text", "text": "B"}],
    "messages": [{"role": "user", "content": "Hi"}]})j", true);
  EXPECT_FALSE(t.contains("max_tokens"));
  EXPECT_EQ(t["messages"][0], ojson::parse(R"j({"role": "system", "content": [{"type": "text", "text": "A"},
    {"type": "text", "text": "B"}]})j"));
  // an empty system prompt is none (the template's default stays); Claude Code's attribution block,
  // whose hash changes every request, is left out (the prefix cache keeps the rest)
  for (const char* sys : {R"j("")j", "[]", R"j([{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1; cch=ab12;"}])j"})
    EXPECT_EQ(translate(std::string(R"j({"system": )j") + sys + R"j(, "messages": [{"role": "user", "content": "Hi"}]})j", true)["messages"],
              ojson::parse(R"j([{"role": "user", "content": "Hi"}])j"))
        << sys;
  EXPECT_EQ(translate(R"j({"system": [{"type": "text", "text": "x-anthropic-billing-header: cch=1;"}, {"type": "text", "text": "Be brief."}],
    "messages": [{"role": "user", "content": "Hi"}]})j", true)["messages"][0],
            ojson::parse(R"j({"role": "system", "content": [{"type": "text", "text": "Be brief."}]})j"));
  // an assistant turn of redacted thinking only gives the model nothing: left out
  EXPECT_EQ(translate(R"j({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [{"type":
    "redacted_thinking", "data": "xx"}]}, {"role": "user", "content": "Go on"}]})j", true)["messages"],
            ojson::parse(R"j([{"role": "user", "content": "Hi"}, {"role": "user", "content": "Go on"}])j"));
}

// A last assistant message is the reply's start, continued; an empty one (or only thinking) is none.
TEST(Anthropic, PrefillContinuesTheLastMessage) {
  ojson c = translate(R"j({"max_tokens": 8, "messages": [{"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Once upon"}]})j");
  EXPECT_EQ(c["continue_final_message"], true);
  EXPECT_EQ(c["add_generation_prompt"], false);
  EXPECT_EQ(c["messages"].back(), ojson::parse(R"j({"role": "assistant", "content": "Once upon"})j"));
  c = translate(R"j({"max_tokens": 8, "messages": [{"role": "user", "content": "Hi"},
    {"role": "assistant", "content": [{"type": "text", "text": "Once"}]}]})j");
  EXPECT_EQ(c["continue_final_message"], true);
  for (const char* last : {R"j("")j", R"j([{"type": "thinking", "thinking": "hm", "signature": ""}])j"}) {
    c = translate(std::string(R"j({"max_tokens": 8, "messages": [{"role": "user", "content": "Hi"},
      {"role": "assistant", "content": )j") + last + "}]}");
    EXPECT_FALSE(c.contains("continue_final_message")) << last;
    EXPECT_EQ(c["messages"].size(), 1u) << c.dump();
  }
  // (a grammar starts at the reply's first byte: not after a given start)
  EXPECT_EQ(refused(R"j({"max_tokens": 8, "tools": [{"name": "f", "input_schema": {"type": "object"}}],
    "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Once"}]})j"), "messages");
  EXPECT_EQ(refused(R"j({"max_tokens": 8, "output_format": {"type": "json_schema", "schema": {"type": "object"}},
    "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Once"}]})j"), "messages");
  // with tool_choice none the tools are off: a start is fine
  c = translate(R"j({"max_tokens": 8, "tools": [{"name": "f", "input_schema": {"type": "object"}}],
    "tool_choice": {"type": "none"}, "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Once"}]})j");
  EXPECT_EQ(c["tool_choice"], "none");
  EXPECT_EQ(c["continue_final_message"], true);
}

TEST(Anthropic, ToolsChoicesAndAConversationWithResults) {
  const ojson c = translate(R"j({"max_tokens": 100,
    "tools": [{"name": "get_weather", "description": "Weather", "input_schema": {"type": "object",
      "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]},
      "cache_control": {"type": "ephemeral"}, "strict": true, "input_examples": [{"city": "Paris"}]},
      {"type": "custom", "name": "add", "input_schema": {"type": "object"}}],
    "tool_choice": {"type": "any", "disable_parallel_tool_use": true},
    "messages": [{"role": "user", "content": "Weather in Paris?"},
      {"role": "assistant", "content": [{"type": "thinking", "thinking": "Need ", "signature": "s"},
        {"type": "thinking", "thinking": "the tool.", "signature": "s"}, {"type": "redacted_thinking", "data": "xx"},
        {"type": "text", "text": "Checking."},
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "days": 2}},
        {"type": "tool_use", "id": "toolu_2", "name": "add", "input": {}}]},
      {"role": "user", "content": [{"type": "text", "text": "before"},
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"},
        {"type": "tool_result", "tool_use_id": "toolu_2", "content": [{"type": "text", "text": "4"}], "is_error": true},
        {"type": "text", "text": "Thanks"}]}]})j");
  const ojson want_tools = ojson::parse(R"j([
    {"type": "function", "function": {"name": "get_weather", "description": "Weather\nExample input: {\"city\":\"Paris\"}",
      "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                     "required": ["city"]}, "strict": true}},
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}])j");
  EXPECT_EQ(c["tools"], want_tools) << c["tools"].dump(1);
  EXPECT_EQ(c["tool_choice"], "required");
  EXPECT_EQ(c["parallel_tool_calls"], false);
  const ojson want_msgs = ojson::parse(R"j([
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": [{"type": "text", "text": "Checking."}],
     "tool_calls": [{"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\",\"days\":2}"}},
                    {"id": "toolu_2", "type": "function", "function": {"name": "add", "arguments": "{}"}}],
     "reasoning_content": "Need the tool."},
    {"role": "user", "content": [{"type": "text", "text": "before"}]},
    {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny"},
    {"role": "tool", "tool_call_id": "toolu_2", "content": "Error: 4"},
    {"role": "user", "content": [{"type": "text", "text": "Thanks"}]}])j");
  EXPECT_EQ(c["messages"], want_msgs) << c["messages"].dump(1);
  // the schemas keep their properties' written order (the order they are generated in)
  EXPECT_EQ(c["tools"][0]["function"]["parameters"]["properties"].begin().key(), "city");

  // each tool_choice
  auto choice = [](const std::string& tc) {
    return translate(R"j({"max_tokens": 8, "tools": [{"name": "f", "input_schema": {"type": "object"}}], "tool_choice": )j" + tc +
                     R"j(, "messages": [{"role": "user", "content": "Hi"}]})j");
  };
  EXPECT_EQ(choice(R"j({"type": "auto"})j")["tool_choice"], "auto");
  EXPECT_FALSE(choice(R"j({"type": "auto"})j").contains("parallel_tool_calls"));
  EXPECT_EQ(choice(R"j({"type": "none"})j")["tool_choice"], "none");
  EXPECT_EQ(choice(R"j({"type": "tool", "name": "f"})j")["tool_choice"],
            ojson::parse(R"j({"type": "function", "function": {"name": "f"}})j"));
  EXPECT_EQ(choice(R"j({"type": "auto", "disable_parallel_tool_use": false})j")["parallel_tool_calls"], true);
}

TEST(Anthropic, OutputFormatEffortAndThinking) {
  const std::string msgs = R"j("messages": [{"role": "user", "content": "Hi"}])j";
  ojson c = translate(R"j({"max_tokens": 8, "output_format": {"type": "json_schema", "schema": {"type": "object",
    "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}}, )j" + msgs + "}");
  EXPECT_EQ(c["response_format"]["type"], "json_schema");
  EXPECT_EQ(c["response_format"]["json_schema"]["schema"]["properties"].begin().key(), "b");
  c = translate(R"j({"max_tokens": 8, "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}},
    "effort": "low"}, )j" + msgs + "}");
  EXPECT_EQ(c["response_format"]["json_schema"]["schema"], ojson::parse(R"j({"type": "object"})j"));
  EXPECT_EQ(c["reasoning_effort"], "low");
  // xhigh and max: gpt-oss's most, high
  for (const char* e : {"xhigh", "max"})
    EXPECT_EQ(translate(R"j({"max_tokens": 8, "output_config": {"effort": ")j" + std::string(e) + "\"}, " + msgs + "}")["reasoning_effort"],
              "high")
        << e;
  EXPECT_EQ(refused(R"j({"max_tokens": 8, "output_config": {"effort": "extreme"}, )j" + msgs + "}"), "output_config.effort");
  EXPECT_EQ(refused(R"j({"max_tokens": 8, "output_format": {"type": "json_schema", "schema": {}},
    "output_config": {"format": {"type": "json_schema", "schema": {}}}, )j" + msgs + "}"), "output_config.format");
  EXPECT_EQ(refused(R"j({"max_tokens": 8, "output_format": {"type": "text"}, )j" + msgs + "}"), "output_format");
  // thinking: accepted, checked as Anthropic checks it
  for (const char* t : {R"j({"type": "enabled", "budget_tokens": 1024})j", R"j({"type": "disabled"})j",
                        R"j({"type": "adaptive", "display": "omitted"})j"})
    EXPECT_NO_THROW(translate(R"j({"max_tokens": 2048, "thinking": )j" + std::string(t) + ", " + msgs + "}")) << t;
  // and it switches a reasoning template's block (Qwen3's enable_thinking); absent, the server's default
  EXPECT_EQ(translate(R"j({"max_tokens": 8, "thinking": {"type": "disabled"}, )j" + msgs + "}")["chat_template_kwargs"],
            ojson::parse(R"j({"enable_thinking": false})j"));
  EXPECT_EQ(translate(R"j({"max_tokens": 2048, "thinking": {"type": "enabled", "budget_tokens": 1024}, )j" + msgs + "}")
                ["chat_template_kwargs"],
            ojson::parse(R"j({"enable_thinking": true})j"));
  EXPECT_FALSE(translate(R"j({"max_tokens": 8, )j" + msgs + "}").contains("chat_template_kwargs"));
  // enabled's budget bounds the reasoning (the chat endpoint's thinking_token_budget)
  EXPECT_EQ(translate(R"j({"max_tokens": 4096, "thinking": {"type": "enabled", "budget_tokens": 1500}, )j" + msgs + "}")
                ["thinking_token_budget"],
            1500);
  for (const char* t : {R"j({"type": "disabled"})j", R"j({"type": "adaptive"})j"})
    EXPECT_FALSE(translate(R"j({"max_tokens": 8, "thinking": )j" + std::string(t) + ", " + msgs + "}").contains("thinking_token_budget")) << t;
  EXPECT_EQ(refused(R"j({"max_tokens": 2048, "thinking": {"type": "enabled", "budget_tokens": 100}, )j" + msgs + "}"),
            "thinking.budget_tokens");
  // (a budget of max_tokens or more is Anthropic's with interleaved thinking; kvq bounds by max_tokens)
  EXPECT_NO_THROW(translate(R"j({"max_tokens": 1024, "thinking": {"type": "enabled", "budget_tokens": 4096}, )j" + msgs + "}"));
  EXPECT_NO_THROW(translate(R"j({"max_tokens": 1024, "thinking": {"type": "between_tools"}, )j" + msgs + "}"));
  EXPECT_EQ(refused(R"j({"max_tokens": 8, "thinking": {"type": "on"}, )j" + msgs + "}"), "thinking.type");
  EXPECT_EQ(refused(R"j({"max_tokens": 8, "thinking": {"type": "adaptive", "display": "full"}, )j" + msgs + "}"),
            "thinking.display");
  EXPECT_TRUE(anthropic_omits_thinking(ojson::parse(R"j({"thinking": {"type": "adaptive", "display": "omitted"}})j")));
  EXPECT_FALSE(anthropic_omits_thinking(ojson::parse(R"j({"thinking": {"type": "adaptive", "display": "summarized"}})j")));
  EXPECT_FALSE(anthropic_omits_thinking(ojson::parse(R"j({"max_tokens": 1})j")));
}

// What kvq does not do is refused with the field named, never ignored.
TEST(Anthropic, RefusedWithTheFieldNamed) {
  const std::string user = R"j({"role": "user", "content": "Hi"})j";
  auto with = [&](const std::string& extra) { return R"j({"max_tokens": 8, "messages": [)j" + user + "], " + extra + "}"; };
  EXPECT_EQ(refused(R"j({"messages": [{"role": "user", "content": "Hi"}]})j"), "max_tokens");
  EXPECT_EQ(refused(R"j({"max_tokens": 0, "messages": [{"role": "user", "content": "Hi"}]})j"), "max_tokens");
  EXPECT_EQ(refused(R"j({"max_tokens": 8})j"), "messages");
  EXPECT_EQ(refused(R"j({"max_tokens": 8, "messages": []})j"), "messages");
  EXPECT_EQ(refused(R"j({"max_tokens": 8, "messages": [{"role": "system", "content": "x"}]})j"), "messages[0].role");
  EXPECT_EQ(refused(R"j({"max_tokens": 8, "messages": [{"role": "user"}]})j"), "messages[0].content");
  EXPECT_EQ(refused(R"j({"max_tokens": 8, "messages": [{"role": "user", "content": []}]})j"), "messages[0].content");
  EXPECT_EQ(refused(R"j({"max_tokens": 8, "messages": [{"role": "user", "content": 5}]})j"), "messages[0].content");
  EXPECT_EQ(refused(R"j({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "image",
    "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}]}]})j"), "messages[0].content[0]");
  EXPECT_EQ(refused(R"j({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "document"}]}]})j"),
            "messages[0].content[0]");
  EXPECT_EQ(refused(R"j({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "tool_use", "id": "a",
    "name": "f", "input": {}}]}]})j"), "messages[0].content[0]");
  EXPECT_EQ(refused(R"j({"max_tokens": 8, "messages": [{"role": "user", "content": "x"}, {"role": "assistant",
    "content": [{"type": "tool_result", "tool_use_id": "a"}]}, {"role": "user", "content": "y"}]})j"), "messages[1].content[0]");
  EXPECT_EQ(refused(R"j({"max_tokens": 8, "messages": [{"role": "user", "content": "x"}, {"role": "assistant",
    "content": [{"type": "tool_use", "id": "a", "name": "f", "input": "{}"}]}, {"role": "user", "content": "y"}]})j"),
            "messages[1].content[0].input");
  // a last message that calls tools, with no results after it
  EXPECT_EQ(refused(R"j({"max_tokens": 8, "messages": [{"role": "user", "content": "x"}, {"role": "assistant",
    "content": [{"type": "tool_use", "id": "a", "name": "f", "input": {}}]}]})j"), "messages[1].content");
  EXPECT_EQ(refused(R"j({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "tool_result",
    "tool_use_id": "a", "content": [{"type": "image"}]}]}]})j"), "messages[0].content[0].content[0]");
  EXPECT_EQ(refused(R"j({"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "tool_result",
    "tool_use_id": "a", "is_error": "yes"}]}]})j"), "messages[0].content[0].is_error");
  EXPECT_EQ(refused(with(R"j("system": [{"type": "image"}])j")), "system[0]");
  EXPECT_EQ(refused(with(R"j("system": [{"type": null, "text": "x"}])j")), "system[0]");
  EXPECT_EQ(refused(with(R"j("temperature": 1.5)j")), "temperature");
  EXPECT_EQ(refused(with(R"j("top_p": 0)j")), "top_p");
  EXPECT_EQ(refused(with(R"j("top_k": -1)j")), "top_k");
  EXPECT_EQ(refused(with(R"j("stop_sequences": "x")j")), "stop_sequences");
  EXPECT_EQ(refused(with(R"j("stream": "yes")j")), "stream");
  EXPECT_EQ(refused(with(R"j("metadata": "u")j")), "metadata");
  EXPECT_EQ(refused(with(R"j("speed": 2)j")), "speed");
  EXPECT_EQ(refused(with(R"j("mcp_servers": [{"type": "url", "url": "http://x"}])j")), "mcp_servers");
  EXPECT_EQ(refused(with(R"j("container": "c")j")), "container");
  EXPECT_EQ(refused(with(R"j("seed": 1)j")), "seed");  // not Anthropic's
  EXPECT_EQ(refused(with(R"j("tools": [{"type": "web_search_20250305", "name": "web_search"}])j")), "tools[0].type");
  EXPECT_EQ(refused(with(R"j("tools": [{"type": "bash_20250124", "name": "bash"}])j")), "tools[0].type");
  EXPECT_EQ(refused(with(R"j("tools": [{"name": "f"}])j")), "tools[0].input_schema");
  EXPECT_EQ(refused(with(R"j("tools": [{"name": "f", "input_schema": {}, "defer_loading": true}])j")), "tools[0].defer_loading");
  EXPECT_EQ(refused(with(R"j("tools": [{"name": "f", "input_schema": {}, "allowed_callers": ["code_execution_20250825"]}])j")),
            "tools[0].allowed_callers");
  EXPECT_EQ(refused(with(R"j("tools": [{"name": "f", "input_schema": {}, "colour": 1}])j")), "tools[0].colour");
  EXPECT_EQ(refused(with(R"j("tool_choice": "auto")j")), "tool_choice");
  EXPECT_EQ(refused(with(R"j("tool_choice": {"type": "tool"})j")), "tool_choice.name");
  EXPECT_EQ(refused(with(R"j("tool_choice": {"type": "some"})j")), "tool_choice.type");
  // count_tokens takes no sampling fields
  EXPECT_EQ(refused(R"j({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5})j", true), "max_tokens");
  // (empty or null server fields are nothing to refuse)
  EXPECT_NO_THROW(translate(with(R"j("mcp_servers": [], "container": null)j")));
}

TEST(Anthropic, StopReasonsUsageAndErrors) {
  EXPECT_EQ(anthropic_stop("stop", "", false).reason, "end_turn");
  EXPECT_TRUE(anthropic_stop("stop", "", false).sequence.is_null());
  EXPECT_EQ(anthropic_stop("length", "", false).reason, "max_tokens");
  const AnthropicStop s = anthropic_stop("stop", "END", false);
  EXPECT_EQ(s.reason, "stop_sequence");
  EXPECT_EQ(s.sequence, "END");
  EXPECT_EQ(anthropic_stop("stop", "", true).reason, "tool_use");
  EXPECT_EQ(anthropic_usage(100, 64, 7),
            json::parse(R"j({"input_tokens": 36, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 64,
                             "output_tokens": 7})j"));
  EXPECT_EQ(anthropic_tool_id("call_abc"), "toolu_abc");
  EXPECT_EQ(anthropic_tool_use("call_x", "f", R"({"a": 1})"),
            json::parse(R"j({"type": "tool_use", "id": "toolu_x", "name": "f", "input": {"a": 1}})j"));
  // a call cut short (no JSON object) has an empty input
  EXPECT_EQ(anthropic_tool_use("call_x", "f", R"({"a": )")["input"], json::object());
  for (const auto& [status, type] : std::vector<std::pair<int, std::string>>{{400, "invalid_request_error"},
                                                                             {401, "authentication_error"},
                                                                             {403, "permission_error"},
                                                                             {404, "not_found_error"},
                                                                             {405, "invalid_request_error"},
                                                                             {413, "request_too_large"},
                                                                             {500, "api_error"},
                                                                             {503, "overloaded_error"}}) {
    const json e = anthropic_error_body("m", status);
    EXPECT_EQ(e["type"], "error");
    EXPECT_EQ(e["error"]["type"], type) << status;
    EXPECT_EQ(e["error"]["message"], "m");
  }
}

// A stream's events: message_start and ping; a block opened by its first delta, closed when
// another kind starts; tool_use blocks whole; message_delta and message_stop last.
TEST(Anthropic, StreamEventsInOrder) {
  AnthropicStream st("msg_1", "m");
  std::string all = st.start(12);
  all += st.thinking("Let me ");
  all += st.thinking("see.");
  all += st.text("");  // nothing: no empty block
  all += st.text("It is ");
  all += st.text("sunny.");
  all += st.tool_use("call_a", "get_weather", R"({"city": "Paris"})");
  all += st.tool_use("call_b", "add", "{}");
  all += st.text("Done.");
  all += st.finish(anthropic_stop("stop", "", true), anthropic_usage(12, 4, 30));
  const auto evs = events(all);
  std::vector<std::string> names;
  for (const auto& [n, d] : evs) names.push_back(n);
  const std::vector<std::string> want = {
      "message_start",       "ping",
      "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",   // thinking
      "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",   // text
      "content_block_start", "content_block_delta", "content_block_stop",                         // tool_use
      "content_block_start", "content_block_delta", "content_block_stop",                         // tool_use
      "content_block_start", "content_block_delta", "content_block_stop",                         // text
      "message_delta",       "message_stop"};
  ASSERT_EQ(names, want);
  const json& m = evs[0].second["message"];
  EXPECT_EQ(m["id"], "msg_1");
  EXPECT_EQ(m["model"], "m");
  EXPECT_EQ(m["role"], "assistant");
  EXPECT_EQ(m["content"], json::array());
  EXPECT_TRUE(m["stop_reason"].is_null());
  EXPECT_EQ(m["usage"]["input_tokens"], 12);
  EXPECT_EQ(evs[2].second["content_block"], json::parse(R"j({"type": "thinking", "thinking": "", "signature": ""})j"));
  EXPECT_EQ(evs[3].second["delta"], json::parse(R"j({"type": "thinking_delta", "thinking": "Let me "})j"));
  EXPECT_EQ(evs[6].second["content_block"], json::parse(R"j({"type": "text", "text": ""})j"));
  EXPECT_EQ(evs[8].second["delta"], json::parse(R"j({"type": "text_delta", "text": "sunny."})j"));
  EXPECT_EQ(evs[10].second["content_block"],
            json::parse(R"j({"type": "tool_use", "id": "toolu_a", "name": "get_weather", "input": {}})j"));
  EXPECT_EQ(evs[11].second["delta"]["type"], "input_json_delta");
  EXPECT_EQ(json::parse(evs[11].second["delta"]["partial_json"].get<std::string>()), json::parse(R"({"city": "Paris"})"));
  // each block's events carry its index, 0, 1, 2, ... in order
  int index = -1;
  for (const auto& [n, d] : evs) {
    if (n == "content_block_start") {
      EXPECT_EQ(d["index"], ++index);
    } else if (n == "content_block_delta" || n == "content_block_stop") {
      EXPECT_EQ(d["index"], index) << d;
    }
  }
  EXPECT_EQ(index, 4);
  const json& md = evs[evs.size() - 2].second;
  EXPECT_EQ(md["delta"], json::parse(R"j({"stop_reason": "tool_use", "stop_sequence": null})j"));
  EXPECT_EQ(md["usage"]["output_tokens"], 30);
  EXPECT_EQ(md["usage"]["cache_read_input_tokens"], 4);
  // a reply without content: no blocks
  AnthropicStream empty("msg_2", "m");
  const auto e2 = events(empty.start(3) + empty.finish(anthropic_stop("stop", "\n", false), anthropic_usage(3, 0, 1)));
  ASSERT_EQ(e2.size(), 4u);
  EXPECT_EQ(e2[2].first, "message_delta");
  EXPECT_EQ(e2[2].second["delta"]["stop_sequence"], "\n");
  const auto err = events(AnthropicStream::error("gone", 503));
  ASSERT_EQ(err.size(), 1u);
  EXPECT_EQ(err[0].second["error"]["type"], "overloaded_error");
}

// The chat request's field names in errors, as the Messages API names them.
TEST(Anthropic, ErrorsNameItsFields) {
  EXPECT_EQ(anthropic_names("'tools[2].function.parameters': 'not' is not supported"), "'tools[2].input_schema': 'not' is not supported");
  EXPECT_EQ(anthropic_names("tools[0].function.name"), "tools[0].name");
  EXPECT_EQ(anthropic_names("'response_format': bad"), "'output_format': bad");
  EXPECT_EQ(anthropic_names("tools[x] and tools[3].type"), "tools[x] and tools[3].type");
  EXPECT_EQ(anthropic_names("'reasoning_effort' is not supported"), "'output_config.effort' is not supported");
  EXPECT_EQ(anthropic_names("my_response_format_x"), "my_response_format_x");  // (whole names only)
}
