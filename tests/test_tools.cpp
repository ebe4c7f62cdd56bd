// Function calling (server/tools.h): the tools' parsing and errors, the reply's grammar (random
// replies checked by an independent validator against each function's parameters), reading
// replies back, streaming a response's text, and the conversation's turns; and the functions as
// gpt-oss's template describes them (server/harmony_tools.h).
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <random>
#include <set>

#include "grammar_walk.h"
#include "core/error.h"
#include "model/json_schema.h"
#include "schema_validator.h"
#include "server/harmony_tools.h"
#include "server/qwen_tools.h"
#include "server/tools.h"

using namespace kvq;
using ojson = nlohmann::ordered_json;
using json = nlohmann::json;

namespace {

const char* kTools = R"j({"tools": [
  {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
   "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
     "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}},
  {"type": "function", "function": {"name": "add", "parameters": {"type": "object",
     "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}, "b": {"type": "number"}},
     "required": ["a", "b"], "additionalProperties": false}}},
  {"type": "function", "function": {"name": "tree", "strict": true, "parameters": {"$defs": {"node": {"type": "object",
     "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
     "required": ["v"]}}, "type": "object", "properties": {"root": {"$ref": "#/$defs/node"}, "again": {"$ref": "#"}},
     "required": ["root"]}}},
  {"type": "function", "function": {"name": "ping"}},
  {"type": "function", "function": {"name": "named_like_keywords", "parameters": {"type": "object",
     "$defs": {"const": {"type": "integer", "minimum": 5, "maximum": 6}},
     "properties": {"default": {"$ref": "#/$defs/const"}, "enum": {"anyOf": [{"type": "null"}, {"$ref": "#"}]},
       "items": {"type": "array", "items": {"$ref": "#/$defs/const"}, "maxItems": 2}},
     "required": ["default"]}}}
]})j";

ojson body_with(const std::string& extra) {
  ojson b = ojson::parse(kTools);
  const ojson e = ojson::parse(extra);
  for (auto it = e.begin(); it != e.end(); ++it) b[it.key()] = it.value();
  return b;
}

std::string tools_error(const std::string& body, std::string* param = nullptr) {
  try {
    const ToolSpec spec = parse_tools(ojson::parse(body));
    if (spec.active()) tool_reply_grammar(spec, nullptr);  // the parameters' schemas
  } catch (const ToolsError& e) {
    if (param) *param = e.param;
    return e.what();
  }
  return "";
}

// The parameters of the function a call names, or null.
const ojson* params_of(const ToolSpec& spec, const std::string& name) {
  for (const ToolFunction& f : spec.functions)
    if (f.name == name) return &f.parameters;
  return nullptr;
}

}  // namespace

TEST(Tools, ParseAndChoice) {
  ToolSpec s = parse_tools(ojson::parse(kTools));
  ASSERT_EQ(s.functions.size(), 5u);
  EXPECT_EQ(s.choice, ToolChoice::automatic);  // the default with tools
  EXPECT_TRUE(s.parallel);
  EXPECT_EQ(s.functions[0].description, "Weather for a city");
  // parameters keep their written order; no parameters: the empty object
  EXPECT_EQ(s.functions[0].parameters["properties"].begin().key(), "city");
  EXPECT_EQ(s.functions[3].parameters, ojson::parse(R"({"type": "object", "properties": {}})"));
  // parameters without a type: an object's keywords (or none) are read as an object
  s = parse_tools(ojson::parse(R"({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}},
      {"type": "function", "function": {"name": "g", "parameters": {"properties": {"x": {"type": "integer"}}}}}]})"));
  EXPECT_EQ(s.functions[0].parameters, ojson::parse(R"({"type": "object"})"));
  EXPECT_EQ(s.functions[1].parameters["type"], "object");

  EXPECT_EQ(parse_tools(body_with(R"({"tool_choice": "none"})")).choice, ToolChoice::none);
  EXPECT_EQ(parse_tools(body_with(R"({"tool_choice": "required"})")).choice, ToolChoice::required);
  s = parse_tools(body_with(R"({"tool_choice": {"type": "function", "function": {"name": "add"}}, "parallel_tool_calls": false})"));
  EXPECT_EQ(s.choice, ToolChoice::named);
  EXPECT_EQ(s.named, "add");
  EXPECT_FALSE(s.parallel);
  // no tools: nothing to call
  EXPECT_EQ(parse_tools(ojson::parse(R"({"messages": []})")).choice, ToolChoice::none);
  EXPECT_EQ(parse_tools(ojson::parse(R"({"tools": [], "tool_choice": "none"})")).choice, ToolChoice::none);
}

TEST(Tools, BadToolsNameTheField) {
  const std::vector<std::pair<std::string, std::string>> bad = {
      {R"({"tools": {}})", "tools"},
      {R"({"tools": [1]})", "tools[0]"},
      {R"({"tools": [{"type": "code_interpreter"}]})", "tools[0].type"},
      {R"({"tools": [{"type": "function"}]})", "tools[0].function"},
      {R"({"tools": [{"type": "function", "function": {"name": "a b"}}]})", "tools[0].function.name"},
      {R"({"tools": [{"type": "function", "function": {"name": ""}}]})", "tools[0].function.name"},
      {R"({"tools": [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]})",
       "tools[1].function.name"},
      {R"({"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]})", "tools[0].function.description"},
      {R"({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]})", "tools[0].function.parameters"},
      {R"({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]})",
       "tools[0].function.parameters"},
      {R"({"tools": [{"type": "function", "function": {"name": "f", "strict": true, "parameters": {"type": "object", "properties":
          {"xs": {"type": "array", "uniqueItems": true}}}}}]})",
       "tools[0].function.parameters"},
      {R"({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]})", "tools[0].function.strict"},
      {R"({"tools": [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "g", "strict": true,
          "parameters": {"type": "object", "properties": {"x": {"not": {}}}}}}]})", "tools[1].function.parameters"},
      {R"({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"anyOf": [{"type": "string"}, {"type": "null"}]}}}]})",
       "tools[0].function.parameters"},
      {R"({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/$defs/a", "$defs": {"a": {}}}}}]})",
       "tools[0].function.parameters"},
      {R"({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "sometimes"})", "tool_choice"},
      {R"({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}})",
       "tool_choice"},
      {R"({"tool_choice": "required"})", "tool_choice"},
      {R"({"tool_choice": "auto"})", "tool_choice"},
      {R"({"tools": [], "tool_choice": "auto"})", "tool_choice"},
      {R"({"tools": [{"type": "function", "function": {"name": "f"}}], "parallel_tool_calls": 1})", "parallel_tool_calls"},
      {R"({"functions": [{"name": "f"}]})", "functions"},
      {R"({"function_call": "auto"})", "function_call"},
  };
  for (const auto& [body, param] : bad) {
    SCOPED_TRACE(body);
    std::string p;
    const std::string msg = tools_error(body, &p);
    EXPECT_FALSE(msg.empty());
    EXPECT_EQ(p, param) << msg;
  }
  // The schema's error says where in the parameters and what.
  EXPECT_NE(tools_error(bad[10].first).find("uniqueItems"), std::string::npos);
  EXPECT_NE(tools_error(bad[12].first).find("'not'"), std::string::npos);
  EXPECT_NE(tools_error(bad[13].first).find("anyOf"), std::string::npos);
}

// Random replies of each tool_choice's grammar: every complete one is a reply of the allowed
// form, whose calls name allowed functions with arguments their parameters accept.
TEST(Tools, RepliesFollowTheChoiceAndTheParameters) {
  struct Case {
    std::string extra;
    bool calls_only;
    std::string only_name;  // non-empty: the one function allowed
    bool one_call;
  };
  const std::vector<Case> cases = {
      {R"({})", false, "", false},
      {R"({"tool_choice": "required"})", true, "", false},
      {R"({"tool_choice": "required", "parallel_tool_calls": false})", true, "", true},
      {R"({"tool_choice": {"type": "function", "function": {"name": "tree"}}})", true, "tree", true},
      {R"({"tool_choice": {"type": "function", "function": {"name": "ping"}}})", true, "ping", true},
  };
  std::mt19937 rng(7);
  for (const Case& c : cases) {
    SCOPED_TRACE(c.extra);
    const ToolSpec spec = parse_tools(body_with(c.extra));
    const auto g = Grammar::from_schema(tool_reply_schema(spec, nullptr));
    int complete = 0, responses = 0, calls = 0;
    std::set<std::string> names;
    for (int i = 0; i < 300; ++i) {
      bool finished = false;
      const std::string text = random_walk(g, rng, &finished);
      if (!finished) continue;
      ++complete;
      const ojson doc = ojson::parse(text, nullptr, false);
      ASSERT_FALSE(doc.is_discarded()) << text;
      ASSERT_TRUE(doc.is_object()) << text;
      ASSERT_EQ(doc.size(), 1u) << text;
      if (doc.contains("response")) {
        EXPECT_FALSE(c.calls_only) << text;
        EXPECT_TRUE(doc["response"].is_string()) << text;
        ++responses;
        continue;
      }
      ASSERT_TRUE(doc.contains("tool_calls")) << text;
      const ojson& tc = doc["tool_calls"];
      ASSERT_TRUE(tc.is_array() && !tc.empty()) << text;
      if (c.one_call) {
        EXPECT_EQ(tc.size(), 1u) << text;
      }
      for (const ojson& call : tc) {
        ASSERT_TRUE(call.is_object() && call.size() == 2 && call.begin().key() == "name") << text;
        const std::string name = call["name"].get<std::string>();
        if (!c.only_name.empty()) {
          EXPECT_EQ(name, c.only_name);
        }
        const ojson* params = params_of(spec, name);
        ASSERT_NE(params, nullptr) << text;
        EXPECT_TRUE(kvq::test::validate(*params, *params, call["arguments"])) << name << ": " << call["arguments"].dump();
        names.insert(name);
        ++calls;
      }
      // the reply read back: the same calls, ids of OpenAI's form and distinct
      std::mt19937_64 idr(1);
      const ToolReply r = parse_tool_reply(text, true, idr);
      EXPECT_TRUE(r.complete);
      EXPECT_FALSE(r.has_content);
      ASSERT_EQ(r.calls.size(), tc.size());
      std::set<std::string> ids;
      for (size_t k = 0; k < r.calls.size(); ++k) {
        EXPECT_EQ(r.calls[k].name, tc[k]["name"]);
        EXPECT_EQ(ojson::parse(r.calls[k].arguments), tc[k]["arguments"]);
        EXPECT_EQ(r.calls[k].id.size(), 29u);
        EXPECT_EQ(r.calls[k].id.rfind("call_", 0), 0u);
        ids.insert(r.calls[k].id);
      }
      EXPECT_EQ(ids.size(), r.calls.size());
    }
    EXPECT_GT(complete, 150);
    EXPECT_GT(calls, 0);
    if (!c.calls_only) {
      EXPECT_GT(responses, 0);
    }
    if (c.only_name.empty()) {
      EXPECT_GE(names.size(), 3u);
    }
  }
}

TEST(Tools, ResponseSchemaAndRefsRebased) {
  // response_format's schema for the response, with $refs of its own
  const ojson resp = ojson::parse(R"({"$defs": {"p": {"type": "integer", "minimum": 1, "maximum": 9}},
      "type": "object", "properties": {"n": {"$ref": "#/$defs/p"}}, "required": ["n"]})");
  const ToolSpec spec = parse_tools(ojson::parse(kTools));
  const ojson schema = tool_reply_schema(spec, resp);
  // the functions' refs now point into the reply's schema, and resolve there
  const ojson& tree = schema["anyOf"][0]["properties"]["tool_calls"]["items"]["anyOf"][2]["properties"]["arguments"];
  EXPECT_EQ(tree["properties"]["root"]["$ref"], "#/anyOf/0/properties/tool_calls/items/anyOf/2/properties/arguments/$defs/node");
  EXPECT_EQ(tree["properties"]["again"]["$ref"], "#/anyOf/0/properties/tool_calls/items/anyOf/2/properties/arguments");
  // a function's properties and definitions named like keywords keep their refs right
  const ojson& kw = schema["anyOf"][0]["properties"]["tool_calls"]["items"]["anyOf"][4]["properties"]["arguments"];
  const std::string kw_at = "#/anyOf/0/properties/tool_calls/items/anyOf/4/properties/arguments";
  EXPECT_EQ(kw["properties"]["default"]["$ref"], kw_at + "/$defs/const");
  EXPECT_EQ(kw["properties"]["enum"]["anyOf"][1]["$ref"], kw_at);
  EXPECT_EQ(kw["properties"]["items"]["items"]["$ref"], kw_at + "/$defs/const");
  const auto g = Grammar::from_schema(schema);
  auto call = [&](const std::string& args) {
    GrammarState st(g);
    return st.feed(R"({"tool_calls": [{"name": "named_like_keywords", "arguments": )" + args + "}]}") && st.accepting();
  };
  EXPECT_TRUE(call(R"({"default": 5, "enum": {"default": 6, "enum": null}, "items": [6, 5]})"));
  EXPECT_FALSE(call(R"({"default": 7})"));
  EXPECT_FALSE(call(R"({"default": 5, "enum": {"tool_calls": []}})"));  // "#" is the function's arguments
  EXPECT_FALSE(call(R"({"default": 5, "items": [4]})"));
  // ... and a response schema's too
  const ojson resp2 = ojson::parse(R"({"$defs": {"d": {"type": "boolean"}}, "type": "object",
      "properties": {"examples": {"$ref": "#/$defs/d"}}, "required": ["examples"]})");
  const auto g2 = Grammar::from_schema(tool_reply_schema(spec, resp2));
  GrammarState r2(g2);
  EXPECT_TRUE(r2.feed(R"({"response": {"examples": true}})") && r2.accepting());
  GrammarState s(g);
  EXPECT_TRUE(s.feed(R"({"response": {"n": 7}})") && s.accepting());
  GrammarState t(g);
  EXPECT_FALSE(t.feed(R"({"response": {"n": 17}})") && t.accepting());
  GrammarState u(g);
  EXPECT_TRUE(u.feed(R"({"tool_calls": [{"name": "tree", "arguments": {"root": {"v": 1, "kids": [{"v": 2}]}, "again": {"root": {"v": 3}}}}]})") &&
              u.accepting());
  std::mt19937_64 idr(3);
  const ToolReply r = parse_tool_reply(R"({"response": {"n": 7}})", false, idr);
  EXPECT_TRUE(r.complete && r.has_content);
  EXPECT_EQ(r.content, R"({"n":7})");
  EXPECT_TRUE(r.calls.empty());
}

TEST(Tools, ReplyReadBack) {
  std::mt19937_64 idr(5);
  ToolReply r = parse_tool_reply(R"({"response": "Hi \"there\"\n\u00e9\ud83d\ude00"})", true, idr);
  EXPECT_TRUE(r.complete);
  EXPECT_EQ(r.content, "Hi \"there\"\n\xc3\xa9\xf0\x9f\x98\x80");
  // cut short: the response's text so far, escapes left whole
  for (const auto& [text, want] : std::vector<std::pair<std::string, std::string>>{
           {R"({"response": "Hi \"th)", "Hi \"th"},
           {R"({"response": "ab\)", "ab"},
           {R"({"response": "ab\u00)", "ab"},
           {R"({"response": "ab\ud83d)", "ab"},
           {R"({"response": "ab\ud83d\ude0)", "ab"},
           {R"({"response": "ab\ud83d\ude00)", "ab\xf0\x9f\x98\x80"},
           {R"({"response": "done")", "done"},
           {" {\n  \"response\" :\"x", "x"},
           {R"({"respo)", R"({"respo)"},  // not yet a response: the raw text
           {R"({"tool_calls": [{"name": "f", "argu)", R"({"tool_calls": [{"name": "f", "argu)"},
       }) {
    SCOPED_TRACE(text);
    r = parse_tool_reply(text, true, idr);
    EXPECT_FALSE(r.complete);
    EXPECT_TRUE(r.has_content);
    EXPECT_EQ(r.content, want);
    EXPECT_TRUE(r.calls.empty());
  }
  // a response of another schema, cut: its document so far
  EXPECT_EQ(parse_tool_reply(R"({"response": {"n": 1)", false, idr).content, R"({"n": 1)");
  EXPECT_EQ(parse_tool_reply(R"({"response":)", false, idr).content, R"({"response":)");
}

// Streamed in any pieces, the response's text comes out in order, a prefix of the whole reply's
// content at every point, and all of it once the reply is complete.
TEST(Tools, StreamedResponseIsAPrefixOfTheReply) {
  const std::vector<std::string> texts = {
      R"({"response": "Hi \"there\"\n\u00e9\ud83d\ude00 and \\ more"})",
      "{ \"response\":\n \"caf\xc3\xa9 \xf0\x9f\x98\x80\\t\\/\"}",
      R"({"tool_calls": [{"name": "f", "arguments": {"response": "x"}}]})",
      R"({"response": "cut \u12)",
  };
  std::mt19937 rng(11);
  for (const std::string& text : texts) {
    SCOPED_TRACE(text);
    std::mt19937_64 idr(1);
    const ToolReply whole = parse_tool_reply(text, true, idr);
    for (int round = 0; round < 50; ++round) {
      ToolReplyStream st(true);
      std::string out;
      size_t at = 0;
      while (at < text.size()) {
        size_t n = round == 0 ? 1 : std::uniform_int_distribution<size_t>(1, 6)(rng);
        // pieces end on whole UTF-8 characters, as the engine's text does
        while (at + n < text.size() && (static_cast<unsigned char>(text[at + n]) & 0xC0) == 0x80) ++n;
        n = std::min(n, text.size() - at);
        out += st.feed(text.substr(at, n));
        at += n;
        EXPECT_EQ(out, st.streamed());
        EXPECT_EQ(whole.content.compare(0, out.size(), out), 0) << out;
      }
      if (whole.calls.empty()) {
        EXPECT_EQ(out, whole.content);
      } else {
        EXPECT_EQ(out, "");
      }
      // against the JSON parser's reading of the whole reply, or the expected text of a cut one
      const json doc = json::parse(text, nullptr, false);
      if (!doc.is_discarded() && doc.contains("response")) {
        EXPECT_EQ(out, doc["response"].get<std::string>());
      } else if (whole.calls.empty()) {
        EXPECT_EQ(out, "cut ");
      }
    }
  }
  ToolReplyStream off(false);  // a response of another schema is not streamed
  EXPECT_EQ(off.feed(R"({"response": "abc")"), "");
}

TEST(Tools, ConversationTurns) {
  const json ms = json::parse(R"j([
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": null, "tool_calls": [
      {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
      {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Rome\"}"}}]},
    {"role": "tool", "tool_call_id": "call_2", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "rain"}]},
    {"role": "assistant", "content": "Paris: rain, Rome: sunny."},
    {"role": "tool", "tool_call_id": "unknown", "name": "add", "content": "3"}
  ])j");
  ChatTemplate tpl;
  tpl.family = ChatFamily::chatml;
  tpl.default_system = "You are SmolLM.";
  std::vector<ChatMessage> out = tool_chat_messages(ms, "TOOLS", tpl);
  ASSERT_EQ(out.size(), 6u);
  EXPECT_EQ(out[0].role, "system");
  EXPECT_EQ(out[0].content, "You are SmolLM.\n\nTOOLS");
  EXPECT_EQ(out[2].role, "assistant");
  EXPECT_EQ(out[2].content,
            R"({"tool_calls":[{"name":"get_weather","arguments":{"city":"Paris"}},{"name":"get_weather","arguments":{"city":"Rome"}}]})");
  EXPECT_EQ(out[3].role, "user");  // both results in one turn, named by their calls
  EXPECT_EQ(out[3].content,
            "{\"tool_response\":{\"name\":\"get_weather\",\"content\":\"sunny\"}}\n"
            "{\"tool_response\":{\"name\":\"get_weather\",\"content\":\"rain\"}}");
  EXPECT_EQ(out[4].content, "Paris: rain, Rome: sunny.");
  EXPECT_EQ(out[5].content, R"({"tool_response":{"name":"add","content":"3"}})");
  // a system turn of the request's own takes the tools' text; without tools nothing is added
  const json with_system = json::parse(R"([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}])");
  out = tool_chat_messages(with_system, "TOOLS", tpl);
  ASSERT_EQ(out.size(), 2u);
  EXPECT_EQ(out[0].role, "system");
  EXPECT_EQ(out[0].content, "Be brief.\n\nTOOLS");
  out = tool_chat_messages(with_system, "", tpl);
  EXPECT_EQ(out[0].content, "Be brief.");
  // the rendered prompt (ChatML)
  EXPECT_EQ(chat_render(tpl, tool_chat_messages(json::parse(R"([{"role": "user", "content": "hi"}])"), "T", tpl)),
            "<|im_start|>system\nYou are SmolLM.\n\nT<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");

  for (const auto& [bad, param] : std::vector<std::pair<std::string, std::string>>{
           {R"([])", "messages"},
           {R"([{"role": "robot", "content": "x"}])", "messages[0].role"},
           {R"([{"role": "assistant", "tool_calls": {}}])", "messages[0].tool_calls"},
           {R"([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{x"}}]}])",
            "messages[0].tool_calls[0].function.arguments"},
           {R"([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]}])",
            "messages[0].tool_calls[0].function.arguments"},
           {R"([{"role": "assistant", "tool_calls": [{"type": "function"}]}])", "messages[0].tool_calls[0]"},
           {R"([{"role": "tool", "tool_call_id": 5, "content": "x"}])", "messages[0].tool_call_id"},
           {R"([{"role": "user", "content": [{"type": "image_url"}]}])", "messages[0].content"},
       }) {
    SCOPED_TRACE(bad);
    try {
      tool_chat_messages(json::parse(bad), "", tpl);
      ADD_FAILURE() << "accepted";
    } catch (const ToolsError& e) {
      EXPECT_EQ(e.param, param) << e.what();
    }
  }
}

TEST(Tools, SystemPromptSaysTheForm) {
  ToolSpec s = parse_tools(ojson::parse(kTools));
  std::string p = tool_system_prompt(s, true);
  EXPECT_NE(p.find(R"("name":"get_weather","description":"Weather for a city","parameters":{"type":"object")"), std::string::npos) << p;
  EXPECT_NE(p.find("{\"response\": YOUR REPLY}"), std::string::npos);
  s = parse_tools(body_with(R"({"tool_choice": "required"})"));
  p = tool_system_prompt(s, true);
  EXPECT_EQ(p.find("response"), std::string::npos);
  s = parse_tools(body_with(R"({"tool_choice": {"type": "function", "function": {"name": "add"}}})"));
  EXPECT_NE(tool_system_prompt(s, true).find("calling the function add."), std::string::npos);
}

// Text no grammar lets through (the engine's replies are valid JSON strings) still never takes back
// what was streamed: decoding stops before what the JSON parser refuses.
TEST(Tools, InvalidStringTextStopsTheResponse) {
  for (const auto& [text, want] : std::vector<std::pair<std::string, std::string>>{
           {"{\"response\": \"abc\xC3(defghijklmnopqrstuvwxyz", "abc"},
           {R"({"response": "abc\xdefghijklmnopqrstuvwxyz)", "abc"},
           {R"({"response": "abc\ud83d\u0041defghijklmnopqrstuvwxyz)", "abc"},
           {"{\"response\": \"ab\ncdefghijklmnopqrstuvwxyz", "ab"},
       }) {
    SCOPED_TRACE(text);
    std::mt19937_64 idr(1);
    const ToolReply r = parse_tool_reply(text, true, idr);
    EXPECT_EQ(r.content, want);
    ToolReplyStream st(true);
    std::string out;
    for (char c : text) out += st.feed(std::string(1, c));
    EXPECT_EQ(out, want);
  }
}

// harmony_functions_namespace against gpt-oss's chat template: each expected text below is the
// template's own rendering of the same tools (Jinja2 as Hugging Face transformers runs it:
// trim_blocks, lstrip_blocks, tojson as json.dumps), the part its render_tool_namespace writes.

namespace {

// A request's tools, read as kvq serve reads them, in the template's words.
std::string harmony_namespace_of(const char* tools) {
  return harmony_functions_namespace(parse_tools(ojson{{"tools", ojson::parse(tools)}}).functions);
}

}  // namespace

TEST(HarmonyTools, FunctionWithScalarParameters) {
  const char* tools = R"j([{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city", "parameters": {"type": "object", "properties": {
  "city": {"type": "string", "description": "The city's name"},
  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"},
  "days": {"type": "integer", "description": "How many days ahead", "default": 3},
  "precise": {"type": "boolean", "default": false},
  "lat": {"type": "number", "minimum": -90},
  "label": {"type": "string", "default": "home \"base\", café"},
  "scale": {"type": "number", "default": 0.5}},
 "required": ["city", "lat"]}}}])j";
  EXPECT_EQ(harmony_namespace_of(tools), R"g(## functions

namespace functions {

// Weather for a city
type get_weather = (_: {
// The city's name
city: string,
unit?: "celsius" | "fahrenheit", // default: celsius,
// How many days ahead
days?: number, // default: 3,
precise?: boolean, // default: false,
lat: number,
label?: string, // default: "home \"base\", café",
scale?: number, // default: 0.5,
}) => any;

} // namespace functions)g");
}

TEST(HarmonyTools, FunctionsWithoutParameters) {
  const char* tools = R"j([{"type": "function", "function": {"name": "get_time", "description": "The current time"}},
 {"type": "function", "function": {"name": "ping", "description": "", "parameters": {"type": "object", "properties": {}}}},
 {"type": "function", "function": {"name": "echo", "description": "Says it back", "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}])j";
  EXPECT_EQ(harmony_namespace_of(tools), R"g(## functions

namespace functions {

// The current time
type get_time = () => any;

// 
type ping = () => any;

// Says it back
type echo = (_: {
text: string,
}) => any;

} // namespace functions)g");
}

TEST(HarmonyTools, NestedObjects) {
  const char* tools = R"j([{"type": "function", "function": {"name": "ship", "description": "Sends a parcel", "parameters": {"type": "object", "properties": {
  "to": {"type": "object", "description": "Where it goes", "properties": {
     "street": {"type": "string"}, "zip": {"type": "integer"},
     "geo": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}}, "required": ["lat", "lon"]}},
   "required": ["street"]},
  "meta": {"type": "object"},
  "options": {"type": "object", "properties": {"fast": {"type": "boolean"}}, "default": {"fast": true, "tries": [1, 2]}}},
 "required": ["to"]}}}])j";
  EXPECT_EQ(harmony_namespace_of(tools), R"g(## functions

namespace functions {

// Sends a parcel
type ship = (_: {
// Where it goes
to: {
street: 
                string, zip?: 
                number, geo?: 
                {
lat: 
                number, lon: 
                number}},
meta?: object,
options?: {
fast?: 
                boolean}, // default: {"fast": true, "tries": [1, 2]},
}) => any;

} // namespace functions)g");
}

TEST(HarmonyTools, Arrays) {
  const char* tools = R"j([{"type": "function", "function": {"name": "store", "description": "Stores lists", "parameters": {"type": "object", "properties": {
  "tags": {"type": "array", "items": {"type": "string"}, "description": "Labels"},
  "scores": {"type": "array", "items": {"type": "number"}},
  "ids": {"type": "array", "items": {"type": "integer"}, "default": [1, 2]},
  "flags": {"type": "array", "items": {"type": "boolean"}},
  "colors": {"type": "array", "items": {"type": "string", "enum": ["red", "green"]}},
  "points": {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}},
  "rows": {"type": "array", "items": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}},
  "blobs": {"type": "array", "items": {"type": "object"}},
  "anything": {"type": "array"},
  "matrix": {"type": "array", "items": {"type": "array", "items": {"type": "number"}}},
  "pairs": {"type": "array", "items": {"type": ["object", "object"]}},
  "maybe": {"type": "array", "items": {"type": "string"}, "nullable": true},
  "loose": {"type": "array", "items": {}}},
 "required": ["tags"]}}}])j";
  EXPECT_EQ(harmony_namespace_of(tools), R"g(## functions

namespace functions {

// Stores lists
type store = (_: {
// Labels
tags: string[],
scores?: number[],
ids?: number[], // default: [1, 2],
flags?: boolean[],
colors?: string[],
points?: {
x: 
                number}[],
rows?: any[],
blobs?: object[],
anything?: any[],
matrix?: number[][],
pairs?: any[],
maybe?: string[] | null,
loose?: any[],
}) => any;

} // namespace functions)g");
}

TEST(HarmonyTools, TypeListsAndNullable) {
  const char* tools = R"j([{"type": "function", "function": {"name": "find", "description": "Finds a record", "parameters": {"type": "object", "properties": {
  "name": {"type": ["string", "null"], "description": "Its name, or null"},
  "id": {"type": ["integer"]},
  "note": {"type": "string", "nullable": true},
  "count": {"type": "integer", "nullable": true},
  "mode": {"enum": ["a", "b"], "default": "a"},
  "extra": {},
  "when": {"type": "string", "format": "date-time", "default": null}},
 "required": ["name"]}}}])j";
  EXPECT_EQ(harmony_namespace_of(tools), R"g(## functions

namespace functions {

// Finds a record
type find = (_: {
// Its name, or null
name: string | null,
id?: integer,
note?: string | null,
count?: number,
mode?: any, // default: a,
extra?: any,
when?: string, // default: null,
}) => any;

} // namespace functions)g");
}

TEST(HarmonyTools, OneOf) {
  const char* tools = R"j([{"type": "function", "function": {"name": "set_value", "description": "Sets a value", "parameters": {"type": "object", "properties": {
  "value": {"oneOf": [{"type": "string"}, {"type": "number"}], "description": "Text or a number"},
  "size": {"oneOf": [{"type": "integer", "description": "Bytes"}, {"type": "string", "enum": ["small", "large"], "default": "small"}], "default": "small"},
  "target": {"oneOf": [{"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}, {"type": "object"}, {"type": "null"}]},
  "single": {"oneOf": [{"type": "boolean"}]}},
 "required": ["value"]}}}])j";
  EXPECT_EQ(harmony_namespace_of(tools), R"g(## functions

namespace functions {

// Sets a value
type set_value = (_: {
// Text or a number
value: string | 
number,
size?: number// Bytes | 
"small" | "large"                    // default: "small"// default: small,
target?: {
path: 
                string} | 
object | 
any,
single?: boolean,
}) => any;

} // namespace functions)g");
}

// Where the template fails (Jinja: a missing description, a string and a number joined by +) or
// prints Python's words (None, True), kvq writes the empty description and JSON text.
TEST(HarmonyTools, WhereTheTemplateFails) {
  const char* tools = R"j([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {
    "level": {"type": "integer", "enum": [1, 2], "default": 1},
    "size": {"oneOf": [{"type": "integer"}, {"type": "string"}], "default": 2},
    "kind": {"type": "string", "enum": ["a", null, true]},
    "n": {"type": "number", "description": 7},
    "t": {"type": ["string", null]}}}}}])j";
  EXPECT_EQ(harmony_namespace_of(tools), R"g(## functions

namespace functions {

// 
type f = (_: {
level?: number, // default: 1,
size?: number | 
string// default: 2,
kind?: "a" | "null" | "true",
// 7
n?: number,
t?: string | null,
}) => any;

} // namespace functions)g");
}

// A whole conversation with functions, a call and its result, rendered as gpt-oss's template
// renders it (the goldens are the template's rendering, by Jinja, with the arguments given as an
// object and the reasoning as `thinking`, the forms the template reads; kvq serve reads the API's:
// arguments as JSON text, the reasoning as reasoning_content): the functions in the developer
// message, the reasoning before a call kept while no final reply follows it, the call in the
// recipient's header, the result as the function's message (its content as a JSON string).
TEST(HarmonyTools, ConversationRendersAsTheTemplate) {
  const ojson tools = ojson::parse(R"j([
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "The city's name"},
       "unit": {"type": "string", "enum": ["celsius", "fahrenheit"], "default": "celsius"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "The current time"}}])j");
  ChatTemplate tpl;
  tpl.family = ChatFamily::harmony;
  tpl.date = "2026-12-07";
  ChatRenderOptions ro;
  ro.tools = harmony_functions_namespace(parse_tools(ojson{{"tools", tools}}).functions);
  nlohmann::json msgs = nlohmann::json::parse(R"j([
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": null, "reasoning_content": "I need the weather.",
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\",\"unit\":\"celsius\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 20}"}])j");
  // (the system and developer messages, and the user's question: the same in both)
  const std::string head = R"g(<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.
Knowledge cutoff: 2024-06
Current date: 2026-12-07

Reasoning: medium

# Valid channels: analysis, commentary, final. Channel must be included for every message.
Calls to these tools must go to the commentary channel: 'functions'.<|end|><|start|>developer<|message|># Instructions

You are a helpful assistant.

# Tools

## functions

namespace functions {

// Weather for a city
type get_weather = (_: {
// The city's name
city: string,
unit?: "celsius" | "fahrenheit", // default: celsius,
}) => any;

// The current time
type get_time = () => any;

} // namespace functions<|end|><|start|>user<|message|>What is the weather in Paris?<|end|>)g";
  const std::string call_and_result = head + R"g(<|start|>assistant<|channel|>analysis<|message|>I need the weather.<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris", "unit": "celsius"}<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"{\"temp\": 20}"<|end|><|start|>assistant)g";
  EXPECT_EQ(chat_render(tpl, tool_chat_messages(msgs, "", tpl), ro), call_and_result);
  msgs.push_back({{"role", "assistant"}, {"content", "It is 20 degrees in Paris."}});
  msgs.push_back({{"role", "user"}, {"content", "And in London?"}});
  const std::string then_final = head + R"g(<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris", "unit": "celsius"}<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"{\"temp\": 20}"<|end|><|start|>assistant<|channel|>final<|message|>It is 20 degrees in Paris.<|end|><|start|>user<|message|>And in London?<|end|><|start|>assistant)g";
  EXPECT_EQ(chat_render(tpl, tool_chat_messages(msgs, "", tpl), ro), then_final);

  // A result without a tool_call_id is the last call's; one with no call before it is refused
  msgs[3].erase("tool_call_id");
  EXPECT_EQ(chat_render(tpl, tool_chat_messages(msgs, "", tpl), ro), then_final);
  nlohmann::json orphan = nlohmann::json::parse(R"j([{"role": "user", "content": "Hi"}, {"role": "tool", "content": "20"}])j");
  EXPECT_THROW(tool_chat_messages(orphan, "", tpl), ToolsError);
  // A reply kvq returned whole (a preamble as content beside its reasoning and call), given back:
  // the reasoning, then the preamble in the commentary channel, then the call
  nlohmann::json back = nlohmann::json::parse(R"j([{"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Looking it up.", "reasoning_content": "Need weather.",
     "tool_calls": [{"id": "c", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}])j");
  EXPECT_NE(chat_render(tpl, tool_chat_messages(back, "", tpl), ro)
                .find("<|start|>user<|message|>Hi<|end|><|start|>assistant<|channel|>analysis<|message|>Need weather.<|end|>"
                      "<|start|>assistant<|channel|>commentary<|message|>Looking it up.<|end|><|start|>assistant "
                      "to=functions.get_time<|channel|>commentary json<|message|>{}<|call|><|start|>assistant"),
            std::string::npos);
  // The other families have no syntax of their own for these
  ChatTemplate chatml;
  chatml.family = ChatFamily::chatml;
  EXPECT_THROW(chat_render(chatml, {{"user", "Hi"}}, ro), Error);
}

// Two functions of one integer argument each ("add": a, "neg": b), as a request's "tools" member
const std::string kAddNegTools = R"j("tools": [
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object",
      "properties": {"a": {"type": "integer"}}, "required": ["a"]}}},
    {"type": "function", "function": {"name": "neg", "parameters": {"type": "object",
      "properties": {"b": {"type": "integer"}}, "required": ["b"]}}}])j";
// Whether a grammar takes the whole text
static bool grammar_accepts(const std::shared_ptr<const Grammar>& g, const std::string& text) {
  GrammarState st(g);
  return st.feed(text) && st.accepting();
}

// The call's grammar: a function's name, the header's rest in the forms gpt-oss writes, and
// arguments of that function's parameters, nothing after them.
TEST(HarmonyTools, CallGrammar) {
  const ToolSpec spec = parse_tools(ojson::parse(R"j({"tools": [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
      "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object",
      "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]})j"));
  const std::shared_ptr<const Grammar> g = harmony_call_grammar(spec.functions);
  auto accepts = [&](const std::string& text) {
    GrammarState st(g);
    return st.feed(text) && st.accepting();
  };
  EXPECT_TRUE(accepts(R"(get_weather <|constrain|>json<|message|>{"city": "Paris"})"));
  EXPECT_TRUE(accepts(R"(get_weather<|channel|>commentary json<|message|>{"city":"Paris"})"));
  EXPECT_TRUE(accepts(R"(add<|message|>{"a": 1})"));
  EXPECT_FALSE(accepts(R"(add<|message|>{"city": "Paris"})"));       // the other function's arguments
  EXPECT_FALSE(accepts(R"(get_time<|message|>{})"));                 // no such function
  EXPECT_FALSE(accepts(R"(add <|constrain|>json<|message|>{"a": 1)")); // not closed
  EXPECT_FALSE(accepts(R"(add<|message|>{"a": 1} and more)"));
  GrammarState done(g);
  ASSERT_TRUE(done.feed(R"(add<|message|>{"a": 7})"));
  EXPECT_TRUE(done.done());
  // A strict function whose parameters kvq cannot generate is named; a non-strict one takes any
  // JSON object as its arguments
  const ToolSpec bad = parse_tools(ojson::parse(R"j({"tools": [{"type": "function", "function": {"name": "f"}},
    {"type": "function", "function": {"name": "g", "strict": true, "parameters": {"type": "object", "not": {}}}}]})j"));
  try {
    (void)harmony_call_grammar(bad.functions);
    ADD_FAILURE() << "no error";
  } catch (const ToolsError& e) {
    EXPECT_EQ(e.param, "tools[1].function.parameters");
  }
  const ToolSpec loose = parse_tools(ojson::parse(R"j({"tools": [{"type": "function", "function": {"name": "f",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}},
    {"type": "function", "function": {"name": "g", "parameters": {"type": "object", "not": {}}}}]})j"));
  const auto lg = harmony_call_grammar(loose.functions);
  auto loose_accepts = [&](const std::string& text) {
    GrammarState st(lg);
    return st.feed(text) && st.done();
  };
  EXPECT_TRUE(loose_accepts(R"(g<|message|>{"anything": [1, {"b": null}]})"));
  EXPECT_TRUE(loose_accepts(R"(g<|message|>{})"));
  EXPECT_FALSE(loose_accepts(R"(g<|message|>[1])"));       // still an object
  EXPECT_FALSE(loose_accepts(R"(f<|message|>{"a": "x"})"));  // the other function keeps its parameters
  EXPECT_TRUE(loose_accepts(R"(f<|message|>{"a": 3})"));
}

// The reply's constraint per tool_choice: auto leaves the reply free until the call's trigger, and
// a response form moves to the final channel's opening; required and named constrain the whole
// reply after the prompt's opening, named to its function alone.
TEST(HarmonyTools, ConstraintPerToolChoice) {
  const std::string& tools = kAddNegTools;
  const auto accepts = grammar_accepts;
  GenParams p;
  p.json_object = true;  // response_format json_object
  EXPECT_EQ(harmony_tool_constraint(parse_tools(ojson::parse("{" + tools + "}")), p), "");
  EXPECT_FALSE(p.json_object);
  EXPECT_EQ(p.grammar, nullptr);
  ASSERT_EQ(p.lazy_grammars.size(), 2u);
  EXPECT_EQ(p.lazy_grammars[0].trigger, kHarmonyCallTrigger);
  EXPECT_TRUE(accepts(p.lazy_grammars[0].grammar, R"(neg <|constrain|>json<|message|>{"b": 2})"));
  EXPECT_EQ(p.lazy_grammars[1].trigger, HarmonyReplyStream::kOpenFinal);
  EXPECT_TRUE(accepts(p.lazy_grammars[1].grammar, R"({"any": "object"})"));
  EXPECT_FALSE(accepts(p.lazy_grammars[1].grammar, R"("a string")"));
  GenParams free;
  EXPECT_EQ(harmony_tool_constraint(parse_tools(ojson::parse("{" + tools + "}")), free), "");
  EXPECT_EQ(free.lazy_grammars.size(), 1u);  // an answer in free text

  GenParams req;
  req.json_object = true;  // a call is forced: the response's form does not apply
  EXPECT_EQ(harmony_tool_constraint(parse_tools(ojson::parse("{" + tools + R"(, "tool_choice": "required"})")), req),
            kHarmonyCallTrigger);
  EXPECT_FALSE(req.json_object);
  EXPECT_TRUE(req.lazy_grammars.empty());
  ASSERT_NE(req.grammar, nullptr);
  EXPECT_TRUE(accepts(req.grammar, R"(add<|channel|>commentary json<|message|>{"a": 1})"));
  EXPECT_TRUE(accepts(req.grammar, R"(neg<|channel|>commentary json<|message|>{"b": 1})"));

  GenParams named;
  EXPECT_EQ(harmony_tool_constraint(
                parse_tools(ojson::parse("{" + tools + R"(, "tool_choice": {"type": "function", "function": {"name": "neg"}}})")),
                named),
            kHarmonyCallTrigger);
  EXPECT_TRUE(accepts(named.grammar, R"(neg<|message|>{"b": 1})"));
  EXPECT_FALSE(accepts(named.grammar, R"(add<|message|>{"a": 1})"));
}

// Qwen's function calling: the tools listed as its template lists them, calls and results written
// in its syntax (the strings below are what jinja2 renders from Qwen3's template for the same
// conversations), the calls' grammar per tool_choice, and replies read back as calls.
TEST(QwenTools, ConversationRendersAsTheTemplate) {
  ChatTemplate t = chat_template_from_text(
      "{{- \"# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\" }}"
      "{{- '<tool_call>\\n{\"name\": \"' }}{{- '<|im_start|>' + message.role + '\\n' }}");
  ASSERT_EQ(t.family, ChatFamily::chatml);
  EXPECT_TRUE(t.qwen_tools);
  EXPECT_FALSE(chat_template_from_text("{{- '<|im_start|>' + message.role + '\\n' }}{{- '<tool_call>' }}").qwen_tools);
  // Qwen3-Coder's and Qwen3.5's XML calls are another syntax
  EXPECT_FALSE(chat_template_from_text(
                   "{{- \"You may call one or more functions to assist with the user query.\" }}{{- '<|im_start|>' }}"
                   "{{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}")
                   .qwen_tools);
  const ojson body = ojson::parse(R"j({"tools": [{"type": "function", "function": {"name": "get", "description": "Weather",
    "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}}]})j");
  ChatRenderOptions ro;
  ro.tools = qwen_tools_json(body);
  EXPECT_EQ(ro.tools, R"({"type": "function", "function": {"name": "get", "description": "Weather", "parameters": {"type": "object", "properties": {"x": {"type": "string"}}}}})");
  const std::string head =
      "<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
      "with function signatures within <tools></tools> XML tags:\n<tools>\n" + ro.tools +
      "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
      "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
      "</tool_call><|im_end|>\n";
  EXPECT_EQ(chat_render(t, {{"user", "W?"}}, ro), head + "<|im_start|>user\nW?<|im_end|>\n<|im_start|>assistant\n");
  // a system message first, then the tools
  std::string with_system = head;
  with_system.insert(std::string("<|im_start|>system\n").size(), "Be brief.\n\n");
  EXPECT_EQ(chat_render(t, {{"system", "Be brief."}, {"user", "W?"}}, ro),
            with_system + "<|im_start|>user\nW?<|im_end|>\n<|im_start|>assistant\n");
  // calls a line apart from the content and each other, results merged into one user turn
  ChatMessage a{"assistant", "Let me check."};
  a.tool_calls = {{"get", R"({"x":"Paris"})"}, {"get", R"({"x": "Rome"})"}};
  ChatMessage bare{"assistant", ""};
  bare.tool_calls = {{"get", "{}"}};
  EXPECT_EQ(chat_render(t, {{"user", "W?"}, a, {"tool", "20 C"}, {"tool", "25 C"}, bare, {"tool", "x"}}, ro),
            head + "<|im_start|>user\nW?<|im_end|>\n<|im_start|>assistant\nLet me check.\n<tool_call>\n{\"name\": \"get\", "
                   "\"arguments\": {\"x\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get\", \"arguments\": {\"x\": "
                   "\"Rome\"}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n20 C\n</tool_response>\n"
                   "<tool_response>\n25 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n<tool_call>\n{\"name\": "
                   "\"get\", \"arguments\": {}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\nx\n"
                   "</tool_response><|im_end|>\n<|im_start|>assistant\n");
  // Qwen2.5's and QwQ's tools section always follows the system text (QwQ's default, empty) and a
  // blank line; QwQ's first call follows a newline when the message's own content is not empty
  ChatTemplate qwq = chat_template_from_text(
      "{{- '<|im_start|>system\\n' }}{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}"
      "{{- '' }}{%- endif %}{{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\" }}"
      "{{- '\\n<tool_call>\\n{\"name\": \"' }}{%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}"
      "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}");
  EXPECT_TRUE(qwq.qwen_tools);
  EXPECT_TRUE(qwq.qwen_tools_after_system);
  EXPECT_FALSE(t.qwen_tools_after_system);
  EXPECT_EQ(qwq.think, ChatTemplate::Think::prompt_opens);
  ChatMessage only_thought{"assistant", "<think>r</think>"};
  only_thought.tool_calls = {{"get", "{}"}};
  const std::string qp = chat_render(qwq, {{"user", "W?"}, only_thought, {"tool", "1"}}, ro);
  EXPECT_TRUE(qp.starts_with("<|im_start|>system\n\n\n# Tools\n")) << qp;
  EXPECT_NE(qp.find("<|im_start|>assistant\n\n<tool_call>\n{\"name\": \"get\""), std::string::npos) << qp;
  // Qwen3: the reasoning before a call is shown again while its results come back (the tool
  // turns are no user query)
  t.think = ChatTemplate::Think::model_opens;
  t.think_after_query = true;
  ChatMessage r{"assistant", ""};
  r.reasoning = "Need it.";
  r.reasoning_given = true;
  r.tool_calls = {{"get", "{}"}};
  EXPECT_EQ(chat_render(t, {{"user", "W?"}, r, {"tool", "1"}}),
            "<|im_start|>user\nW?<|im_end|>\n<|im_start|>assistant\n<think>\nNeed it.\n</think>\n\n<tool_call>\n{\"name\": "
            "\"get\", \"arguments\": {}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n1\n</tool_response>"
            "<|im_end|>\n<|im_start|>assistant\n");
  // kvq's own tool prompt (a template without Qwen's syntax): its result turns are no query either
  ChatTemplate plain;
  plain.family = ChatFamily::chatml;
  plain.think = ChatTemplate::Think::model_opens;
  plain.think_after_query = true;
  ChatMessage said{"assistant", "{\"tool_calls\": []}"};
  said.reasoning = "Need it.";
  ChatMessage result{"user", "{\"tool_response\": {}}"};
  result.tool_result = true;
  EXPECT_NE(chat_render(plain, {{"user", "W?"}, said, result}).find("<think>\nNeed it.\n</think>"), std::string::npos);
  result.tool_result = false;
  EXPECT_EQ(chat_render(plain, {{"user", "W?"}, said, result}).find("Need it."), std::string::npos);
}

// Floats in the tools' JSON and the calls' arguments as Python's json.dumps writes them
TEST(QwenTools, FloatsAsPythonWritesThem) {
  EXPECT_EQ(json_dumps(ojson::parse("[1e15, 1234567890123456.7, -1e15, 2e15, 0.1, 1e-5, 1.5e16, 100.0, -0.0, 1e22, 0.0001, "
                                    "123456.789e-10, 3.0e-4, 7, -3]")),
            "[1000000000000000.0, 1234567890123456.8, -1000000000000000.0, 2000000000000000.0, 0.1, 1e-05, 1.5e+16, 100.0, "
            "-0.0, 1e+22, 0.0001, 1.23456789e-05, 0.0003, 7, -3]");
}

TEST(QwenTools, CallGrammarPerToolChoice) {
  const std::string& tools = kAddNegTools;
  const auto accepts = grammar_accepts;
  const std::string add = "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1}}\n</tool_call>";
  const std::string neg = "<tool_call>\n{\"name\": \"neg\", \"arguments\": {\"b\": 2}}\n</tool_call>";
  // auto: free until '<tool_call>', then calls a line apart
  GenParams a;
  qwen_tool_constraint(parse_tools(ojson::parse("{" + tools + "}")), nullptr, a);
  EXPECT_EQ(a.grammar, nullptr);
  ASSERT_EQ(a.lazy_grammars.size(), 1u);
  EXPECT_EQ(a.lazy_grammars[0].trigger, "<tool_call>");
  const auto& lazy = a.lazy_grammars[0].grammar;
  EXPECT_TRUE(accepts(lazy, add.substr(11)));
  EXPECT_TRUE(accepts(lazy, add.substr(11) + "\n" + neg));
  EXPECT_FALSE(accepts(lazy, "\n{\"name\": \"add\", \"arguments\": {\"b\": 1}}\n</tool_call>"));  // neg's arguments
  EXPECT_FALSE(accepts(lazy, "\n{\"name\": \"mul\", \"arguments\": {}}\n</tool_call>"));
  EXPECT_FALSE(accepts(lazy, add.substr(11) + " and text"));
  // with a response form: from the reply's first byte, calls or the response's document
  GenParams f;
  qwen_tool_constraint(parse_tools(ojson::parse("{" + tools + "}")), ojson::parse(R"({"type": "object", "properties":
    {"n": {"type": "integer"}}, "required": ["n"]})"), f);
  ASSERT_NE(f.grammar, nullptr);
  EXPECT_TRUE(f.lazy_grammars.empty());
  EXPECT_TRUE(accepts(f.grammar, add));
  EXPECT_TRUE(accepts(f.grammar, R"({"n": 3})"));
  EXPECT_FALSE(accepts(f.grammar, "free text"));
  // required, one call (parallel_tool_calls false): the call, then nothing
  GenParams r;
  r.json_object = true;
  qwen_tool_constraint(parse_tools(ojson::parse("{" + tools + R"(, "tool_choice": "required", "parallel_tool_calls": false})")),
                       nullptr, r);
  EXPECT_FALSE(r.json_object);
  ASSERT_NE(r.grammar, nullptr);
  EXPECT_TRUE(accepts(r.grammar, neg));
  GrammarState one(r.grammar);
  ASSERT_TRUE(one.feed(add));
  EXPECT_TRUE(one.done());
  EXPECT_FALSE(accepts(r.grammar, add + "\n" + neg));
  EXPECT_FALSE(accepts(r.grammar, "Sure. " + add));
  // named: that function only
  GenParams n;
  qwen_tool_constraint(
      parse_tools(ojson::parse("{" + tools + R"(, "tool_choice": {"type": "function", "function": {"name": "neg"}}})")), nullptr, n);
  EXPECT_TRUE(accepts(n.grammar, neg));
  EXPECT_FALSE(accepts(n.grammar, add));
}

// A reply read back as it streams, in pieces of every size: content up to '<tool_call>', each call
// when it closes (its arguments as Python's json.dumps writes them), a call cut short or not JSON
// as its text; after a reasoning template's block.
TEST(QwenTools, ReplyReadBack) {
  auto run = [](const std::string& text, size_t piece, bool think) {
    QwenToolReplyStream qs(think ? std::make_unique<ThinkReplyStream>(QwenToolReplyStream::kOpen) : nullptr);  // (as chat_reply_splitter)
    ChatReplyDelta all;
    auto add = [&](const ChatReplyDelta& d) {
      all.reasoning += d.reasoning;
      all.content += d.content;
      all.calls.insert(all.calls.end(), d.calls.begin(), d.calls.end());
      all.cut_call += d.cut_call;
    };
    for (size_t i = 0; i < text.size(); i += piece) add(qs.feed(text.substr(i, piece)));
    add(qs.finish());
    return all;
  };
  const std::string two = "Checking.\n<tool_call>\n{\"name\": \"get\", \"arguments\": {\"x\":\"Paris\",\"n\":[1,2]}}\n</tool_call>\n"
                          "<tool_call>\n{\"name\": \"add\", \"arguments\": \"{\\\"a\\\": 1}\"}\n</tool_call>";
  for (size_t piece : {two.size(), size_t(1), size_t(3), size_t(11)}) {
    SCOPED_TRACE(piece);
    const ChatReplyDelta d = run(two, piece, false);
    EXPECT_EQ(d.content, "Checking.");
    ASSERT_EQ(d.calls.size(), 2u);
    EXPECT_EQ(d.calls[0].name, "get");
    EXPECT_EQ(d.calls[0].arguments, R"({"x": "Paris", "n": [1, 2]})");
    EXPECT_EQ(d.calls[1].name, "add");
    EXPECT_EQ(d.calls[1].arguments, R"({"a": 1})");  // (arguments written as a string: as they are)
    EXPECT_EQ(d.cut_call, "");
    const ChatReplyDelta t = run("<think>\nWeather.\n</think>\n\n" + two, piece, true);
    EXPECT_EQ(t.reasoning, "Weather.");
    EXPECT_EQ(t.content, "Checking.");
    EXPECT_EQ(t.calls.size(), 2u);
    // cut short, and a call that is not one
    const ChatReplyDelta c = run("Hi\n\n<tool_call>\n{\"name\": \"get\", \"argu", piece, false);
    EXPECT_EQ(c.content, "Hi");
    EXPECT_TRUE(c.calls.empty());
    EXPECT_EQ(c.cut_call, "\n\n<tool_call>\n{\"name\": \"get\", \"argu");  // (as generated, from the newlines)
    // a call written while reasoning ends the reasoning (its grammar lets no '</think>' come)
    const ChatReplyDelta r = run("<think>\nhm\n<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}}\n</tool_call>", piece, true);
    EXPECT_EQ(r.reasoning, "hm");
    EXPECT_EQ(r.content, "");
    ASSERT_EQ(r.calls.size(), 1u);
    EXPECT_EQ(r.calls[0].arguments, R"({"a": 1})");
    const ChatReplyDelta n = run("<tool_call>[1]</tool_call>tail", piece, false);
    EXPECT_EQ(n.cut_call, "<tool_call>[1]</tool_call>");
    EXPECT_EQ(n.content, "tail");
    // no calls: all content; a marker's start at the end is a call cut short, a lone '<' text
    const ChatReplyDelta p = run("Plain\n\ntext <", piece, false);
    EXPECT_EQ(p.content, "Plain\n\ntext <");
    EXPECT_TRUE(p.calls.empty());
    const ChatReplyDelta q = run("Plain\n<tool_c", piece, false);
    EXPECT_EQ(q.content, "Plain");
    EXPECT_EQ(q.cut_call, "\n<tool_c");
  }
  ChatTemplate q;
  q.family = ChatFamily::chatml;
  q.qwen_tools = true;
  EXPECT_EQ(chat_reply_splitter(q, false), nullptr);  // no functions offered: a call is content
  EXPECT_EQ(chat_reply_splitter(q, true)->split_after("", "<tool_call>\n{\"name\": \"f\"}\n</tool_call>").calls.size(), 1u);
}

// Parameters kvq cannot generate: a strict function is refused by name; a non-strict one (the API
// promises no schema then) takes any JSON object as its arguments, the other functions keeping theirs.
TEST(Tools, NonStrictParametersKvqCannotGenerateAreLoosened) {
  const std::string fns = R"j([{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
      "properties": {"a": {"type": "integer", "maximum": 9}}, "required": ["a"]}}},
    {"type": "function", "function": {"name": "g", "parameters": {"type": "object", "properties": {"x": {"not": {}}}}}}])j";
  const ToolSpec loose = parse_tools(ojson::parse(R"j({"tools": )j" + fns + "}"));
  ASSERT_FALSE(loose.functions[1].strict);
  const auto g = tool_reply_grammar(loose, nullptr);
  auto accepts = [&](const std::string& text) {
    GrammarState st(g);
    return st.feed(text) && st.accepting();
  };
  EXPECT_TRUE(accepts(R"({"tool_calls": [{"name": "g", "arguments": {"x": [1, "two"], "y": null}}]})"));
  EXPECT_FALSE(accepts(R"({"tool_calls": [{"name": "g", "arguments": "x"}]})"));  // an object still
  EXPECT_TRUE(accepts(R"({"tool_calls": [{"name": "f", "arguments": {"a": 3}}]})"));
  EXPECT_FALSE(accepts(R"({"tool_calls": [{"name": "f", "arguments": {"a": 12}}]})"));  // f keeps its parameters
  // the model is still shown g's parameters as written
  EXPECT_NE(tool_system_prompt(loose, true).find(R"("not":{})"), std::string::npos);
  // strict: refused, named
  ojson strict = ojson::parse(R"j({"tools": )j" + fns + "}");
  strict["tools"][1]["function"]["strict"] = true;
  try {
    (void)tool_reply_grammar(parse_tools(strict), nullptr);
    ADD_FAILURE() << "a strict function kvq cannot generate was taken";
  } catch (const ToolsError& e) {
    EXPECT_EQ(e.param, "tools[1].function.parameters");
  }
}
