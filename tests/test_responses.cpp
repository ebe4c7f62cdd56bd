// OpenAI's Responses API read into chat requests and written back (server/responses.h), without a
// model: input items to chat messages, the request's fields, refusals, output items, and the
// stream's events in the API's order.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <string>
#include <vector>

#include "server/responses.h"
#include "sse_events.h"

using namespace kvq;
using ojson = nlohmann::ordered_json;
using json = nlohmann::json;

namespace {

ojson translate(const std::string& body, const std::string& history = "[]") {
  return responses_chat_body(ojson::parse(body), ojson::parse(history));
}

std::string refused(const std::string& body) {
  try {
    (void)translate(body);
  } catch (const ResponsesError& e) {
    EXPECT_NE(std::string(e.what()), "") << body;
    return e.param;
  }
  ADD_FAILURE() << "accepted: " << body;
  return "";
}

// Events of an SSE text, numbered 0, 1, 2, ... by sequence_number.
std::vector<std::pair<std::string, json>> events(const std::string& text) {
  auto out = named_sse_events(text);
  for (size_t k = 0; k < out.size(); ++k) EXPECT_EQ(out[k].second["sequence_number"], k) << out[k].second;
  return out;
}

}  // namespace

TEST(Responses, InputAndFields) {
  // a string input: one user message; instructions first
  ojson c = translate(R"j({"model": "m", "input": "Hi", "instructions": "Be brief.", "max_output_tokens": 64,
    "temperature": 0.5, "top_p": 0.9, "stream": true, "parallel_tool_calls": false, "store": false,
    "metadata": {"k": "v"}, "user": "u", "truncation": "disabled", "prompt_cache_key": "x", "service_tier": "auto",
    "reasoning": {"summary": "auto"}, "text": {"format": {"type": "text"}, "verbosity": "medium"}})j");
  EXPECT_EQ(c, ojson::parse(R"j({"model": "m", "messages": [{"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"}], "max_tokens": 64, "temperature": 0.5, "top_p": 0.9, "stream": true,
    "parallel_tool_calls": false})j"))
      << c.dump(1);
  EXPECT_EQ(responses_input_items(ojson::parse(R"j({"input": "Hi"})j")),
            ojson::parse(R"j([{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}])j"));
  // items: messages (with or without "type"), reasoning given to the assistant turn after it, a
  // message and the calls after it one assistant turn, outputs as tool messages
  c = translate(R"j({"input": [
    {"role": "developer", "content": "Use tools."},
    {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather "}, {"type": "input_text", "text": "in Rome?"}]},
    {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Call it."}]},
    {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
     "content": [{"type": "output_text", "text": "Checking.", "annotations": []}]},
    {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\":\"Rome\"}"},
    {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": "{}"},
    {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
    {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "noon"}]},
    {"type": "reasoning", "summary": [{"type": "summary_text", "text": "A"}, {"type": "summary_text", "text": "B"}]},
    {"type": "function_call", "call_id": "call_3", "name": "get_time", "arguments": "{}"}]})j");
  EXPECT_EQ(c["messages"], ojson::parse(R"j([
    {"role": "developer", "content": "Use tools."},
    {"role": "user", "content": "Weather in Rome?"},
    {"role": "assistant", "content": "Checking.", "reasoning_content": "Call it.",
     "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Rome\"}"}},
                    {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
    {"role": "assistant", "content": null, "tool_calls": [{"id": "call_3", "type": "function",
      "function": {"name": "get_time", "arguments": "{}"}}], "reasoning_content": "A\nB"}])j"))
      << c["messages"].dump(1);
  // a previous response's items come first, after the instructions (which are this request's only)
  c = translate(R"j({"input": "And now?", "instructions": "New."})j",
                R"j([{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
                     {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Hello"}]}])j");
  EXPECT_EQ(c["messages"], ojson::parse(R"j([{"role": "system", "content": "New."}, {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "And now?"}])j"));
}

TEST(Responses, ToolsFormatsEffortLogprobs) {
  ojson c = translate(R"j({"input": "x", "tools": [{"type": "function", "name": "f", "description": "F",
    "parameters": {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}, "strict": true}],
    "tool_choice": {"type": "function", "name": "f"}})j");
  EXPECT_EQ(c["tools"], ojson::parse(R"j([{"type": "function", "function": {"name": "f", "description": "F",
    "parameters": {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}}, "strict": true}}])j"));
  EXPECT_EQ(c["tools"][0]["function"]["parameters"]["properties"].begin().key(), "b");  // written order kept
  EXPECT_EQ(c["tool_choice"], ojson::parse(R"j({"type": "function", "function": {"name": "f"}})j"));
  for (const char* tc : {"auto", "none", "required"})
    EXPECT_EQ(translate(std::string(R"j({"input": "x", "tool_choice": ")j") + tc + "\"}")["tool_choice"], tc);
  c = translate(R"j({"input": "x", "text": {"format": {"type": "json_schema", "name": "city", "strict": true,
    "schema": {"type": "object", "properties": {"name": {"type": "string"}}}}}})j");
  EXPECT_EQ(c["response_format"], ojson::parse(R"j({"type": "json_schema", "json_schema": {"name": "city",
    "schema": {"type": "object", "properties": {"name": {"type": "string"}}}}})j"));
  EXPECT_EQ(translate(R"j({"input": "x", "text": {"format": {"type": "json_object"}}})j")["response_format"],
            ojson::parse(R"j({"type": "json_object"})j"));
  EXPECT_EQ(translate(R"j({"input": "x", "reasoning": {"effort": "high", "summary": "detailed"}})j")["reasoning_effort"], "high");
  c = translate(R"j({"input": "x", "top_logprobs": 3, "include": ["message.output_text.logprobs"]})j");
  EXPECT_EQ(c["logprobs"], true);
  EXPECT_EQ(c["top_logprobs"], 3);
  EXPECT_EQ(translate(R"j({"input": "x", "include": ["message.output_text.logprobs"]})j")["logprobs"], true);
  EXPECT_FALSE(translate(R"j({"input": "x", "include": ["reasoning.encrypted_content"]})j").contains("logprobs"));
  // (top_logprobs alone returns none, as OpenAI's: the log-probabilities come with include)
  c = translate(R"j({"input": "x", "top_logprobs": 3})j");
  EXPECT_FALSE(c.contains("logprobs"));
  EXPECT_FALSE(c.contains("top_logprobs"));
  // hosted tools are not offered (kvq runs none); a tool_choice naming one is refused
  c = translate(R"j({"input": "x", "tools": [{"type": "web_search", "external_web_access": false},
    {"type": "function", "name": "f"}, {"type": "file_search", "vector_store_ids": []}]})j");
  EXPECT_EQ(c["tools"], ojson::parse(R"j([{"type": "function", "function": {"name": "f"}}])j"));
  // custom tools: the function {"input": TEXT}, a regex format matched whole, strict
  c = translate(R"j({"input": "x", "tools": [{"type": "custom", "name": "apply_patch", "description": "Patch"},
    {"type": "custom", "name": "code", "format": {"type": "grammar", "syntax": "regex", "definition": "[0-9]+"}}],
    "tool_choice": {"type": "custom", "name": "code"}})j");
  EXPECT_EQ(c["tools"], ojson::parse(R"j([
    {"type": "function", "function": {"name": "apply_patch", "description": "Patch", "parameters": {"type": "object",
      "properties": {"input": {"type": "string"}}, "required": ["input"], "additionalProperties": false}, "strict": true}},
    {"type": "function", "function": {"name": "code", "parameters": {"type": "object",
      "properties": {"input": {"type": "string", "pattern": "^(?:[0-9]+)$"}}, "required": ["input"],
      "additionalProperties": false}, "strict": true}}])j"))
      << c["tools"].dump(1);
  EXPECT_EQ(c["tool_choice"], ojson::parse(R"j({"type": "function", "function": {"name": "code"}})j"));
  const ResponsesForm form = responses_form(ojson::parse(R"j({"tools": [{"type": "custom", "name": "apply_patch"},
    {"type": "function", "name": "f"}], "include": ["reasoning.encrypted_content"]})j"));
  EXPECT_EQ(form.custom_tools, std::set<std::string>{"apply_patch"});
  EXPECT_TRUE(form.encrypted_reasoning);
}

// What kvq does not do is refused with the field named, never ignored.
TEST(Responses, RefusedWithTheFieldNamed) {
  EXPECT_EQ(refused(R"j({"model": "m"})j"), "input");
  EXPECT_EQ(refused(R"j({"input": 5})j"), "input");
  EXPECT_EQ(refused(R"j({"input": [{"role": "tool", "content": "x"}]})j"), "input[0].role");
  EXPECT_EQ(refused(R"j({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]})j"),
            "input[0].content[0]");
  EXPECT_EQ(refused(R"j({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]})j"),
            "input[0].content[0]");
  EXPECT_EQ(refused(R"j({"input": [{"type": "item_reference", "id": "msg_1"}]})j"), "input[0].id");  // (none kept)
  EXPECT_EQ(refused(R"j({"input": [{"type": "web_search_call", "id": "ws_1"}]})j"), "input[0].type");
  EXPECT_EQ(refused(R"j({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{bad"}]})j"),
            "input[0].arguments");
  EXPECT_EQ(refused(R"j({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]})j"), "input[0].call_id");
  EXPECT_EQ(refused(R"j({"input": [{"type": "function_call_output", "call_id": "c"}]})j"), "input[0].output");
  EXPECT_EQ(refused(R"j({"input": [{"type": "reasoning", "summary": "x"}]})j"), "input[0].summary");
  EXPECT_EQ(refused(R"j({"input": "x", "tools": [{"type": "web_search"}], "tool_choice": {"type": "web_search"}})j"), "tool_choice");
  EXPECT_EQ(refused(R"j({"input": "x", "tools": [{"type": "custom", "name": "c", "format": {"type": "grammar", "syntax": "lark",
    "definition": "start: /a/"}}]})j"), "tools[0].format.syntax");
  EXPECT_EQ(refused(R"j({"input": "x", "tools": [{"type": "function", "name": "f", "defer_loading": true}]})j"),
            "tools[0].defer_loading");
  EXPECT_EQ(refused(R"j({"input": "x", "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": []}})j"), "tool_choice");
  EXPECT_EQ(refused(R"j({"input": "x", "text": {"format": {"type": "xml"}}})j"), "text.format");
  EXPECT_EQ(refused(R"j({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}})j"), "text.format.schema");
  EXPECT_EQ(refused(R"j({"input": "x", "text": {"verbosity": "low"}})j"), "text.verbosity");
  EXPECT_EQ(refused(R"j({"input": "x", "reasoning": {"effort": "minimal"}})j"), "reasoning.effort");
  EXPECT_EQ(refused(R"j({"input": "x", "reasoning": {"summary": "short"}})j"), "reasoning.summary");
  EXPECT_EQ(refused(R"j({"input": "x", "truncation": "auto"})j"), "truncation");
  EXPECT_EQ(refused(R"j({"input": "x", "background": "yes"})j"), "background");
  EXPECT_EQ(refused(R"j({"input": "x", "conversation": "conv_1"})j"), "conversation");
  EXPECT_EQ(refused(R"j({"input": "x", "prompt": {"id": "pmpt_1"}})j"), "prompt");
  EXPECT_EQ(refused(R"j({"input": "x", "max_tool_calls": 3})j"), "max_tool_calls");
  EXPECT_EQ(refused(R"j({"input": "x", "stop": ["a"]})j"), "stop");  // not the Responses API's
  EXPECT_EQ(refused(R"j({"input": "x", "max_output_tokens": 0})j"), "max_output_tokens");
  EXPECT_EQ(refused(R"j({"input": "x", "temperature": 3})j"), "temperature");
  EXPECT_EQ(refused(R"j({"input": "x", "store": "yes"})j"), "store");
  EXPECT_EQ(refused(R"j({"input": "x", "top_logprobs": 21})j"), "top_logprobs");
  EXPECT_EQ(refused(R"j({"input": "x", "include": ["message.output_text.logprobs"], "stream": true})j"), "include");
  EXPECT_NO_THROW(translate(R"j({"input": "x", "background": false, "conversation": null, "context_management": []})j"));
  EXPECT_NO_THROW(translate(R"j({"input": "x", "background": true})j"));  // (the server's to run)
}

TEST(Responses, OutputItemsAndUsage) {
  std::mt19937_64 rng(7);
  ResponsesReply r;
  r.reasoning = "Think.";
  r.content = "Hello.";
  r.calls = {{"call_a", "f", R"({"x":1})"}};
  const json out = responses_output(r, ResponsesForm{}, rng);
  ASSERT_EQ(out.size(), 3u);
  EXPECT_EQ(out[0]["type"], "reasoning");
  EXPECT_EQ(out[0]["content"], json::parse(R"j([{"type": "reasoning_text", "text": "Think."}])j"));
  EXPECT_EQ(out[0]["summary"], json::array());
  EXPECT_TRUE(std::regex_match(out[0]["id"].get<std::string>(), std::regex("rs_[A-Za-z0-9]{24}")));
  EXPECT_EQ(out[1]["type"], "message");
  EXPECT_EQ(out[1]["role"], "assistant");
  EXPECT_EQ(out[1]["status"], "completed");
  EXPECT_EQ(out[1]["content"], json::parse(R"j([{"type": "output_text", "text": "Hello.", "annotations": [], "logprobs": []}])j"));
  EXPECT_TRUE(std::regex_match(out[1]["id"].get<std::string>(), std::regex("msg_[A-Za-z0-9]{24}")));
  EXPECT_EQ(out[2]["type"], "function_call");
  EXPECT_EQ(out[2]["call_id"], "call_a");
  EXPECT_EQ(out[2]["arguments"], R"({"x":1})");
  EXPECT_TRUE(std::regex_match(out[2]["id"].get<std::string>(), std::regex("fc_[A-Za-z0-9]{24}")));
  // calls only: no message; cut short: the last item incomplete; nothing at all: an empty message
  r = ResponsesReply{};
  r.calls = {{"call_b", "g", "{}"}};
  EXPECT_EQ(responses_output(r, ResponsesForm{}, rng).size(), 1u);
  r = ResponsesReply{};
  r.content = "Hel";
  r.complete = false;
  EXPECT_EQ(responses_output(r, ResponsesForm{}, rng)[0]["status"], "incomplete");
  r = ResponsesReply{};
  r.content = "";
  EXPECT_EQ(responses_output(r, ResponsesForm{}, rng), json::array());  // (an empty answer: no item, as streamed)
  // a custom tool's call: its input as text; reasoning with kvq's encrypted_content, read back
  ResponsesForm form;
  form.custom_tools = {"apply_patch"};
  form.encrypted_reasoning = true;
  r = ResponsesReply{};
  r.reasoning = "Patch it.";
  r.calls = {{"call_c", "apply_patch", R"({"input":"*** Begin Patch"})"}};
  const json co = responses_output(r, form, rng);
  ASSERT_EQ(co.size(), 2u);
  EXPECT_EQ(co[1]["type"], "custom_tool_call");
  EXPECT_EQ(co[1]["input"], "*** Begin Patch");
  EXPECT_EQ(co[1]["call_id"], "call_c");
  EXPECT_TRUE(std::regex_match(co[1]["id"].get<std::string>(), std::regex("ctc_[A-Za-z0-9]{24}")));
  ASSERT_TRUE(co[0]["encrypted_content"].is_string());
  // sent back with only its encrypted_content (store false clients), with the call and its output
  ojson back = ojson::array();
  ojson rs = ojson::parse(co[0].dump());
  rs.erase("content");
  back.push_back(rs);
  back.push_back(ojson::parse(co[1].dump()));
  back.push_back(ojson::parse(R"j({"type": "custom_tool_call_output", "call_id": "call_c", "output": "Done"})j"));
  ojson req = ojson::object();
  req["input"] = back;
  EXPECT_EQ(responses_chat_body(req, ojson::array())["messages"], ojson::parse(R"j([
    {"role": "assistant", "content": null, "tool_calls": [{"id": "call_c", "type": "function", "function":
      {"name": "apply_patch", "arguments": "{\"input\":\"*** Begin Patch\"}"}}], "reasoning_content": "Patch it."},
    {"role": "tool", "tool_call_id": "call_c", "content": "Done"}])j"));
  // reasoning that no assistant turn followed (an interrupted turn) is not given to a later one
  req["input"] = ojson::parse(R"j([{"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Hm."}]},
    {"role": "user", "content": "Stop."}, {"role": "assistant", "content": "Ok."}])j");
  EXPECT_FALSE(responses_chat_body(req, ojson::array())["messages"][1].contains("reasoning_content"));
  EXPECT_EQ(responses_usage(100, 48, 7, 3), json::parse(R"j({"input_tokens": 100, "input_tokens_details": {"cached_tokens": 48},
    "output_tokens": 7, "output_tokens_details": {"reasoning_tokens": 3}, "total_tokens": 107})j"));
  const json echo = responses_echo(ojson::parse(R"j({"input": "x", "temperature": 0, "store": false})j"));
  EXPECT_EQ(echo["temperature"], 0);
  EXPECT_EQ(echo["top_p"], 1.0);
  EXPECT_EQ(echo["store"], false);
  EXPECT_EQ(echo["tool_choice"], "auto");
  EXPECT_EQ(echo["text"], json::parse(R"j({"format": {"type": "text"}})j"));
}

// A stream: created, in_progress; items opened by their first delta, each ended by
// output_item.done with what it holds; completed with the output and usage; numbered in order.
TEST(Responses, StreamEventsInOrder) {
  const json base = {{"id", "resp_1"}, {"object", "response"}, {"status", "in_progress"}, {"output", json::array()}};
  ResponsesStream st(base, ResponsesForm{});
  std::string all = st.start();
  all += st.reasoning("Let me ");
  all += st.reasoning("see.");
  all += st.text("");
  all += st.text("It is ");
  all += st.text("sunny.");
  all += st.call({"call_a", "get_weather", R"({"city":"Paris"})"});
  json final;
  all += st.finish(responses_usage(10, 0, 20, 3), true, &final);
  const auto evs = events(all);
  std::vector<std::string> names;
  for (const auto& [n, d] : evs) names.push_back(n);
  const std::vector<std::string> want = {
      "response.created", "response.in_progress",
      "response.output_item.added", "response.reasoning_text.delta", "response.reasoning_text.delta",
      "response.reasoning_text.done", "response.output_item.done",
      "response.output_item.added", "response.content_part.added", "response.output_text.delta",
      "response.output_text.delta", "response.output_text.done", "response.content_part.done", "response.output_item.done",
      "response.output_item.added", "response.function_call_arguments.delta", "response.function_call_arguments.done",
      "response.output_item.done", "response.completed"};
  ASSERT_EQ(names, want);
  EXPECT_EQ(evs[0].second["response"], base);
  EXPECT_EQ(evs[5].second["text"], "Let me see.");
  EXPECT_EQ(evs[6].second["item"]["content"], json::parse(R"j([{"type": "reasoning_text", "text": "Let me see."}])j"));
  EXPECT_EQ(evs[11].second["text"], "It is sunny.");
  EXPECT_EQ(evs[13].second["item"]["content"][0]["text"], "It is sunny.");
  EXPECT_EQ(evs[15].second["delta"], R"({"city":"Paris"})");
  EXPECT_EQ(evs[14].second["item"]["arguments"], "");
  EXPECT_EQ(evs[17].second["item"]["arguments"], R"({"city":"Paris"})");
  // each item's events name its index and id, the same from added to done
  for (const auto& [n, d] : evs) {
    if (!d.contains("output_index")) continue;
    const int index = d["output_index"];
    ASSERT_LT(index, 3) << d;
    const std::string id = d.contains("item") ? d["item"]["id"] : d["item_id"];
    EXPECT_EQ(id, final["output"][size_t(index)]["id"].get<std::string>()) << d;
  }
  const json& done = evs.back().second["response"];
  EXPECT_EQ(done, final);
  EXPECT_EQ(done["status"], "completed");
  EXPECT_EQ(done["id"], "resp_1");
  EXPECT_EQ(done["output"].size(), 3u);
  EXPECT_EQ(done["usage"]["output_tokens"], 20);
  // cut short: response.incomplete, the open item incomplete
  ResponsesStream cut(base, ResponsesForm{});
  std::string ct = cut.start();
  ct += cut.text("Hel");
  ct += cut.finish(responses_usage(1, 0, 1, 0), false, &final);
  const auto ce = events(ct);
  EXPECT_EQ(ce.back().first, "response.incomplete");
  EXPECT_EQ(final["status"], "incomplete");
  EXPECT_EQ(final["incomplete_details"], json::parse(R"j({"reason": "max_output_tokens"})j"));
  EXPECT_EQ(final["output"][0]["status"], "incomplete");
  ResponsesStream failed(base, ResponsesForm{});
  std::string ft = failed.start();
  ft += failed.text("Par");
  ft += failed.error("boom");
  const auto fe = events(ft);
  EXPECT_EQ(fe.back().first, "response.failed");
  EXPECT_EQ(fe.back().second["response"]["error"]["message"], "boom");
  // the items so far, the open one cut
  ASSERT_EQ(fe.back().second["response"]["output"].size(), 1u);
  EXPECT_EQ(fe.back().second["response"]["output"][0]["status"], "incomplete");
  EXPECT_EQ(fe.back().second["response"]["output"][0]["content"][0]["text"], "Par");
  // a custom tool's call streamed: custom_tool_call_input delta and done
  ResponsesForm cf;
  cf.custom_tools = {"apply_patch"};
  ResponsesStream cs(base, cf);
  std::string ctext = cs.start();
  ctext += cs.call({"call_p", "apply_patch", R"({"input":"patch"})"});
  ctext += cs.finish(responses_usage(1, 0, 1, 0), true, &final);
  const auto cev = events(ctext);
  ASSERT_EQ(cev.size(), 7u);
  EXPECT_EQ(cev[2].second["item"]["input"], "");
  EXPECT_EQ(cev[3].first, "response.custom_tool_call_input.delta");
  EXPECT_EQ(cev[3].second["delta"], "patch");
  EXPECT_EQ(cev[4].first, "response.custom_tool_call_input.done");
  EXPECT_EQ(final["output"][0]["input"], "patch");
}

// Item references (with or without their type), input items in the API's form, the request's own
// names in errors, custom tools' regexes anchored once, an empty input.
TEST(Responses, ReferencesFormsAndNames) {
  EXPECT_TRUE(responses_is_reference(ojson::parse(R"j({"type": "item_reference", "id": "msg_1"})j")));
  EXPECT_TRUE(responses_is_reference(ojson::parse(R"j({"id": "msg_1"})j")));
  EXPECT_FALSE(responses_is_reference(ojson::parse(R"j({"id": "msg_1", "role": "user", "content": "x"})j")));
  EXPECT_FALSE(responses_is_reference(ojson::parse(R"j({"type": "message", "id": "msg_1"})j")));
  EXPECT_EQ(refused(R"j({"input": [{"id": "msg_gone"}]})j"), "input[0].id");
  std::mt19937_64 rng(3);
  ojson m = responses_item_form(ojson::parse(R"j({"role": "user", "content": "hi"})j"), rng);
  EXPECT_EQ(m["type"], "message");
  EXPECT_EQ(m["status"], "completed");
  EXPECT_EQ(m["content"], ojson::parse(R"j([{"type": "input_text", "text": "hi"}])j"));
  EXPECT_TRUE(std::regex_match(m["id"].get<std::string>(), std::regex("msg_[A-Za-z0-9]{24}")));
  m = responses_item_form(ojson::parse(R"j({"role": "assistant", "content": "yo", "id": "msg_x"})j"), rng);
  EXPECT_EQ(m["id"], "msg_x");
  EXPECT_EQ(m["content"], ojson::parse(R"j([{"type": "output_text", "text": "yo", "annotations": []}])j"));
  m = responses_item_form(ojson::parse(R"j({"type": "function_call_output", "call_id": "c", "output": "1"})j"), rng);
  EXPECT_EQ(m["output"], "1");
  EXPECT_EQ(m["id"].get<std::string>().rfind("item_", 0), 0u);
  // the chat request's tool k is the request's k-th function or custom tool
  const ojson body = ojson::parse(R"j({"tools": [{"type": "web_search"}, {"type": "function", "name": "f"},
    {"type": "custom", "name": "c"}]})j");
  EXPECT_EQ(responses_names(body, "'tools[0].function.parameters': bad; tools[1].function.parameters; tools[0].function.name"),
            "'tools[1].parameters': bad; tools[2].format.definition; tools[1].name");
  EXPECT_EQ(responses_names(body, "messages[0].content"), "messages[0].content");
  EXPECT_EQ(responses_names(body, "max_tokens 900 + prompt 9 tokens; 'reasoning_effort'; 'response_format': x; max_tokens_x"),
            "max_output_tokens 900 + prompt 9 tokens; 'reasoning.effort'; 'text.format': x; max_tokens_x");
  // a custom tool's regex anchored at its ends is anchored once (an escaped $ is the character)
  for (const auto& [def, want] : std::vector<std::pair<std::string, std::string>>{
           {"^[0-9]+$", "^(?:[0-9]+)$"}, {"\\\\A[a-z]\\\\z", "^(?:[a-z])$"}, {"a\\\\$", "^(?:a\\$)$"}, {"a|b", "^(?:a|b)$"}}) {
    const ojson c = translate(R"j({"input": "x", "tools": [{"type": "custom", "name": "c", "format": {"type": "grammar",
      "syntax": "regex", "definition": ")j" + def + R"j("}}]})j");
    EXPECT_EQ(c["tools"][0]["function"]["parameters"]["properties"]["input"]["pattern"], want) << def;
  }
  EXPECT_EQ(refused(R"j({"input": []})j"), "input");
}
