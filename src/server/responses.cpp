#include "server/responses.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <ctime>
#include <set>

namespace kvq {

using ojson = nlohmann::ordered_json;
using json = nlohmann::json;

namespace {

bool is_set(const ojson& o, const char* key) { return o.contains(key) && !o[key].is_null(); }

// kvq's reasoning items' encrypted_content: the reasoning text after this mark (not encrypted: an
// opaque token to clients, which send it back)
constexpr const char* kReasoningToken = "kvq-reasoning:";

// The text of a message's content (a string, or parts of the given text types).
std::string parts_text(const ojson& c, const std::string& at, std::initializer_list<const char*> text_types) {
  if (c.is_string()) return c.get<std::string>();
  if (!c.is_array()) throw ResponsesError("'content' must be a string or an array of content parts", at);
  std::string s;
  for (size_t k = 0; k < c.size(); ++k) {
    const std::string kat = fmt::format("{}[{}]", at, k);
    const ojson& p = c[k];
    if (!p.is_object() || !p.contains("type") || !p["type"].is_string())
      throw ResponsesError("each content part needs a string 'type'", kat);
    const std::string type = p["type"].get<std::string>();
    bool text = false;
    for (const char* t : text_types) text = text || type == t;
    if (!text) {
      if (type == "input_image" || type == "input_file" || type == "input_audio")
        throw ResponsesError(fmt::format("'{}' content is not supported: kvq serves text models", type), kat);
      throw ResponsesError(fmt::format("content parts of type '{}' are not supported here (supported: {})", type,
                                       fmt::join(text_types, ", ")),
                           kat);
    }
    const char* field = type == "refusal" ? "refusal" : "text";
    if (!p.contains(field) || !p[field].is_string()) throw ResponsesError(fmt::format("a '{}' part needs a string '{}'", type, field), kat);
    s += p[field].get<std::string>();
  }
  return s;
}

std::string string_field(const ojson& it, const char* key, const std::string& at) {
  if (!it.contains(key) || !it[key].is_string()) throw ResponsesError(fmt::format("'{}' must be a string", key), at + "." + key);
  return it[key].get<std::string>();
}

// Items as chat messages, appended to msgs. A reasoning item's text goes with the assistant
// message or calls after it; consecutive calls (and a message before them) make one assistant turn.
void items_to_messages(const ojson& items, ojson& msgs, const char* where) {
  std::string reasoning;
  bool assistant_open = false;  // the last message is the assistant's, and calls may join it
  for (size_t i = 0; i < items.size(); ++i) {
    const ojson& it = items[i];
    const std::string at = fmt::format("{}[{}]", where, i);
    const std::string type = is_set(it, "type") ? it["type"].get<std::string>() : "message";
    if (type == "message") {
      const std::string role = it["role"].get<std::string>();
      ojson m = ojson::object();
      m["role"] = role;
      m["content"] = parts_text(it["content"], at + ".content", {"input_text", "output_text", "refusal"});
      if (role == "assistant" && !reasoning.empty()) m["reasoning_content"] = reasoning;
      reasoning.clear();  // (before another role's turn: an interrupted turn's, not given)
      msgs.push_back(m);
      assistant_open = role == "assistant";
    } else if (type == "function_call" || type == "custom_tool_call") {
      ojson call = ojson::object();
      call["id"] = it["call_id"];
      call["type"] = "function";
      ojson fn = ojson::object();
      fn["name"] = it["name"];
      if (type == "function_call") {
        fn["arguments"] = it["arguments"];
      } else {  // a custom tool's input, as the function kvq gives it ({"input": TEXT})
        ojson args = ojson::object();
        args["input"] = it["input"];
        fn["arguments"] = args.dump();
      }
      call["function"] = fn;
      if (!assistant_open) {
        ojson m = ojson::object();
        m["role"] = "assistant";
        m["content"] = nullptr;
        msgs.push_back(m);
        assistant_open = true;
      }
      ojson& m = msgs.back();
      if (!m.contains("tool_calls")) m["tool_calls"] = ojson::array();
      m["tool_calls"].push_back(call);
      if (!reasoning.empty()) {
        m["reasoning_content"] = m.value("reasoning_content", "") + reasoning;
        reasoning.clear();
      }
    } else if (type == "function_call_output" || type == "custom_tool_call_output") {
      reasoning.clear();  // (reasoning no assistant turn followed: an interrupted turn's)
      ojson m = ojson::object();
      m["role"] = "tool";
      m["tool_call_id"] = it["call_id"];
      m["content"] = parts_text(it["output"], at + ".output", {"input_text", "output_text"});
      msgs.push_back(m);
      assistant_open = false;
    } else if (type == "reasoning") {
      // its text (reasoning_text content, as kvq returns it; else the summaries); encrypted
      // content from another server is nothing kvq can read
      std::string text;
      if (is_set(it, "content"))
        for (const ojson& c : it["content"]) text += c.value("text", "");
      if (text.empty() && is_set(it, "summary"))
        for (const ojson& s : it["summary"]) {
          if (!text.empty()) text += '\n';
          text += s.value("text", "");
        }
      // kvq's own encrypted_content (the reasoning itself, kReasoningToken + text), for clients
      // that send back only that
      if (text.empty() && is_set(it, "encrypted_content") && it["encrypted_content"].is_string()) {
        const std::string e = it["encrypted_content"].get<std::string>();
        if (e.rfind(kReasoningToken, 0) == 0) text = e.substr(std::string_view(kReasoningToken).size());
      }
      reasoning += text;
    }
  }
}

// A regex without the anchors at its ends (^ or \A, $ or \z): kvq anchors it whole itself.
std::string unanchored(std::string re) {
  if (re.rfind("\\A", 0) == 0) re.erase(0, 2);
  else if (!re.empty() && re[0] == '^') re.erase(0, 1);
  // (a final $ or \z that is not itself escaped: an even run of backslashes before it)
  auto escaped = [&](size_t at) {
    size_t n = 0;
    while (at > n && re[at - n - 1] == '\\') ++n;
    return n % 2 == 1;
  };
  if (re.size() >= 2 && re.compare(re.size() - 2, 2, "\\z") == 0 && !escaped(re.size() - 2)) re.erase(re.size() - 2);
  else if (!re.empty() && re.back() == '$' && !escaped(re.size() - 1)) re.pop_back();
  return re;
}

// A message item's checks.
void check_message(const ojson& it, const std::string& at) {
  if (!it.contains("role") || !it["role"].is_string()) throw ResponsesError("a message needs a string 'role'", at + ".role");
  const std::string role = it["role"].get<std::string>();
  if (role != "user" && role != "assistant" && role != "system" && role != "developer")
    throw ResponsesError(fmt::format("unknown role '{}' (valid: user, assistant, system, developer)", role), at + ".role");
  if (!it.contains("content")) throw ResponsesError("a message needs 'content'", at + ".content");
  (void)parts_text(it["content"], at + ".content", {"input_text", "output_text", "refusal"});
}

}  // namespace

bool responses_is_reference(const ojson& item) {
  if (!item.is_object() || !item.contains("id") || !item["id"].is_string()) return false;
  if (is_set(item, "type")) return item["type"] == "item_reference";
  return !item.contains("role") && !item.contains("content");
}

ojson responses_item_form(const ojson& item, std::mt19937_64& rng) {
  ojson it = item;
  const std::string type = is_set(it, "type") && it["type"].is_string() ? it["type"].get<std::string>() : "message";
  if (type == "message") {
    ojson m = ojson::object();
    m["type"] = "message";
    m["id"] = is_set(it, "id") ? it["id"] : ojson(responses_id("msg", rng));
    m["role"] = it["role"];
    if (it["content"].is_string()) {
      ojson part = ojson::object();
      part["type"] = it["role"] == "assistant" ? "output_text" : "input_text";
      part["text"] = it["content"];
      if (it["role"] == "assistant") part["annotations"] = ojson::array();
      m["content"] = ojson::array({part});
    } else {
      m["content"] = it["content"];
    }
    m["status"] = is_set(it, "status") ? it["status"] : ojson("completed");
    return m;
  }
  if (!is_set(it, "id"))
    it["id"] = responses_id(type == "reasoning" ? "rs" : type == "function_call" ? "fc" : type == "custom_tool_call" ? "ctc" : "item", rng);
  return it;
}

std::string responses_names(const ojson& body, const std::string& text) {
  std::vector<size_t> index;  // chat tool k -> the request's tool
  std::vector<bool> custom;
  if (is_set(body, "tools") && body["tools"].is_array())
    for (size_t i = 0; i < body["tools"].size(); ++i) {
      const ojson& t = body["tools"][i];
      if (t.is_object() && (t.value("type", ojson()) == "function" || t.value("type", ojson()) == "custom")) {
        index.push_back(i);
        custom.push_back(t["type"] == "custom");
      }
    }
  std::string s = rename_tool_fields(text, [&](size_t k, const std::string& field) {
    if (k >= index.size()) return fmt::format("tools[{}].{}", k, field);
    if (custom[k] && field == "parameters") return fmt::format("tools[{}].format.definition", index[k]);
    return fmt::format("tools[{}].{}", index[k], field);
  });
  return rename_fields(std::move(s), {{"max_tokens", "max_output_tokens"},
                                      {"response_format", "text.format"},
                                      {"reasoning_effort", "reasoning.effort"}});
}

ojson responses_input_items(const ojson& body) {
  if (!is_set(body, "input")) throw ResponsesError("'input' is required", "input");
  const ojson& in = body["input"];
  if (in.is_array() && in.empty()) throw ResponsesError("'input' must not be empty", "input");
  ojson items = ojson::array();
  if (in.is_string()) {
    ojson part = ojson::object();
    part["type"] = "input_text";
    part["text"] = in;
    ojson m = ojson::object();
    m["type"] = "message";
    m["role"] = "user";
    m["content"] = ojson::array({part});
    items.push_back(m);
    return items;
  }
  if (!in.is_array()) throw ResponsesError("'input' must be a string or an array of input items", "input");
  for (size_t i = 0; i < in.size(); ++i) {
    const std::string at = fmt::format("input[{}]", i);
    const ojson& it = in[i];
    if (!it.is_object()) throw ResponsesError("each input item must be an object", at);
    if (is_set(it, "type") && !it["type"].is_string()) throw ResponsesError("an item's 'type' must be a string", at + ".type");
    const std::string type = responses_is_reference(it) ? "item_reference"
                             : is_set(it, "type")          ? it["type"].get<std::string>()
                                                           : "message";
    if (type == "message") {
      check_message(it, at);
    } else if (type == "function_call") {
      (void)string_field(it, "call_id", at);
      (void)string_field(it, "name", at);
      const std::string args = string_field(it, "arguments", at);
      if (!json::accept(args)) throw ResponsesError("a function call's 'arguments' must be JSON text", at + ".arguments");
    } else if (type == "custom_tool_call") {
      (void)string_field(it, "call_id", at);
      (void)string_field(it, "name", at);
      (void)string_field(it, "input", at);
    } else if (type == "function_call_output" || type == "custom_tool_call_output") {
      (void)string_field(it, "call_id", at);
      if (!it.contains("output")) throw ResponsesError("a call's output needs 'output'", at + ".output");
      (void)parts_text(it["output"], at + ".output", {"input_text", "output_text"});
    } else if (type == "reasoning") {
      for (const char* key : {"summary", "content"}) {
        if (!is_set(it, key)) continue;
        if (!it[key].is_array()) throw ResponsesError(fmt::format("a reasoning item's '{}' must be an array", key), at + "." + key);
        for (const ojson& c : it[key])
          if (!c.is_object() || !c.contains("text") || !c["text"].is_string())
            throw ResponsesError(fmt::format("each of a reasoning item's '{}' needs a string 'text'", key), at + "." + key);
      }
    } else if (type == "item_reference") {  // (the server replaces those it keeps)
      throw ResponsesError(fmt::format("no item with id '{}' is kept (items of responses kept with store)",
                                       it.contains("id") && it["id"].is_string() ? it["id"].get<std::string>() : ""),
                           at + ".id");
    } else {
      throw ResponsesError(fmt::format("input items of type '{}' are not supported (supported: message, function_call, "
                                       "function_call_output, custom_tool_call, custom_tool_call_output, reasoning, "
                                       "item_reference)",
                                       type),
                           at + ".type");
    }
    items.push_back(it);
  }
  return items;
}

ojson responses_chat_body(const ojson& body, const ojson& history) {
  if (!body.is_object()) throw ResponsesError("the request body must be a JSON object", "");
  static const std::set<std::string> fields = {
      "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "tools", "tool_choice",
      "parallel_tool_calls", "text", "reasoning", "top_logprobs", "include", "store", "previous_response_id",
      "metadata", "user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "service_tier",
      "truncation", "stream_options", "background"};
  for (const auto& [key, v] : body.items()) {
    if (fields.count(key)) continue;
    // set to what turns them off, nothing to refuse
    if (v.is_null() || (key == "context_management" && v.is_array() && v.empty())) continue;
    if (key == "conversation" || key == "prompt" || key == "max_tool_calls" || key == "context_management")
      throw ResponsesError(fmt::format("'{}' is not supported", key), key);
    throw ResponsesError(fmt::format("unknown parameter '{}'", key), key);
  }
  // (background is the server's: the response runs on after the reply, read back by GET)
  if (is_set(body, "background") && !body["background"].is_boolean())
    throw ResponsesError("'background' must be a boolean", "background");
  ojson out = ojson::object();
  if (is_set(body, "model")) {
    if (!body["model"].is_string()) throw ResponsesError("'model' must be a string", "model");
    out["model"] = body["model"];
  }
  ojson msgs = ojson::array();
  if (is_set(body, "instructions")) {
    if (!body["instructions"].is_string()) throw ResponsesError("'instructions' must be a string", "instructions");
    ojson m = ojson::object();
    m["role"] = "system";
    m["content"] = body["instructions"];
    if (!body["instructions"].get<std::string>().empty()) msgs.push_back(m);
  }
  items_to_messages(history, msgs, "previous_response_id");
  items_to_messages(responses_input_items(body), msgs, "input");
  out["messages"] = msgs;
  if (is_set(body, "max_output_tokens")) {
    const ojson& m = body["max_output_tokens"];
    if (!m.is_number_integer() || m.get<int64_t>() < 1 || m.get<int64_t>() > (int64_t(1) << 30))
      throw ResponsesError("'max_output_tokens' must be an integer >= 1", "max_output_tokens");
    out["max_tokens"] = m;
  }
  for (const char* key : {"temperature", "top_p"}) {
    if (!is_set(body, key)) continue;
    const ojson& v = body[key];
    const double hi = std::string_view(key) == "temperature" ? 2 : 1;
    if (!v.is_number() || !(v.get<double>() >= 0 && v.get<double>() <= hi))
      throw ResponsesError(fmt::format("'{}' must be a number in [0, {}]", key, hi), key);
    out[key] = v;
  }
  for (const char* key : {"stream", "parallel_tool_calls", "store"}) {
    if (is_set(body, key) && !body[key].is_boolean()) throw ResponsesError(fmt::format("'{}' must be a boolean", key), key);
    if (is_set(body, key) && std::string_view(key) != "store") out[key] = body[key];
  }
  for (const char* key : {"previous_response_id", "user", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
                          "service_tier", "truncation"})
    if (is_set(body, key) && !body[key].is_string()) throw ResponsesError(fmt::format("'{}' must be a string", key), key);
  for (const char* key : {"metadata", "stream_options"})
    if (is_set(body, key) && !body[key].is_object()) throw ResponsesError(fmt::format("'{}' must be an object", key), key);
  if (is_set(body, "truncation") && body["truncation"] != "disabled")
    throw ResponsesError("'truncation' \"auto\" is not supported: a conversation longer than the context is refused "
                         "(\"disabled\")",
                         "truncation");
  // tools: functions
  if (is_set(body, "tools")) {
    const ojson& ts = body["tools"];
    if (!ts.is_array()) throw ResponsesError("'tools' must be an array", "tools");
    ojson tools = ojson::array();
    for (size_t i = 0; i < ts.size(); ++i) {
      const std::string at = fmt::format("tools[{}]", i);
      const ojson& t = ts[i];
      if (!t.is_object() || !t.contains("type") || !t["type"].is_string())
        throw ResponsesError("each tool must be an object with a string 'type'", at);
      const std::string type = t["type"].get<std::string>();
      // Hosted tools (OpenAI runs them: web search, file search, code interpreter, ...): kvq runs
      // none, so the model is not offered them (a tool_choice naming one is refused)
      if (type != "function" && type != "custom") continue;
      for (const auto& [key, v] : t.items()) {
        static const std::set<std::string> known = {"type", "name", "description", "parameters", "strict", "format"};
        if (!known.count(key) && !v.is_null())
          throw ResponsesError(fmt::format("unknown {} tool field '{}'", type, key), at + "." + key);
      }
      ojson fn = ojson::object();
      fn["name"] = is_set(t, "name") ? t["name"] : ojson();
      if (is_set(t, "description")) fn["description"] = t["description"];
      if (type == "custom") {
        // a custom tool's input is text: the function {"input": TEXT}, TEXT matching the tool's
        // regex format whole when it has one
        ojson input = ojson::object();
        input["type"] = "string";
        if (is_set(t, "format")) {
          const ojson& f = t["format"];
          const std::string ftype = f.is_object() && is_set(f, "type") && f["type"].is_string() ? f["type"].get<std::string>() : "";
          if (ftype == "grammar") {
            if (!is_set(f, "definition") || !f["definition"].is_string())
              throw ResponsesError("a grammar format needs a string 'definition'", at + ".format.definition");
            if (f.value("syntax", ojson("")) != "regex")
              throw ResponsesError("custom tool grammars in Lark syntax are not supported (regex ones are)", at + ".format.syntax");
            input["pattern"] = "^(?:" + unanchored(f["definition"].get<std::string>()) + ")$";
          } else if (ftype != "text") {
            throw ResponsesError("a custom tool's 'format' must be {\"type\": \"text\"} or a grammar", at + ".format");
          }
        }
        ojson params = ojson::object();
        params["type"] = "object";
        params["properties"] = ojson::object();
        params["properties"]["input"] = input;
        params["required"] = ojson::array({"input"});
        params["additionalProperties"] = false;
        fn["parameters"] = params;
        fn["strict"] = true;  // (its format is a constraint, not a hint)
      } else {
        if (is_set(t, "format")) throw ResponsesError("unknown function tool field 'format'", at + ".format");
        if (is_set(t, "parameters")) fn["parameters"] = t["parameters"];
        if (is_set(t, "strict")) fn["strict"] = t["strict"];
      }
      tools.push_back(function_tool(std::move(fn)));
    }
    out["tools"] = tools;
  }
  if (is_set(body, "tool_choice")) {
    const ojson& tc = body["tool_choice"];
    if (tc == "auto" || tc == "none" || tc == "required") {
      out["tool_choice"] = tc;
    } else if (tc.is_object() && tc.contains("type") && (tc["type"] == "function" || tc["type"] == "custom") &&
               tc.contains("name") && tc["name"].is_string()) {
      out["tool_choice"] = function_choice(tc["name"]);
    } else {
      throw ResponsesError("'tool_choice' must be \"auto\", \"none\", \"required\" or {\"type\": \"function\" (or \"custom\"), "
                           "\"name\": ...} (hosted tools and allowed_tools are not supported)",
                           "tool_choice");
    }
  }
  // text.format: the reply's form
  if (is_set(body, "text")) {
    const ojson& t = body["text"];
    if (!t.is_object()) throw ResponsesError("'text' must be an object", "text");
    for (const auto& [key, v] : t.items()) {
      if (v.is_null()) continue;
      if (key == "verbosity") {
        if (v != "medium") throw ResponsesError("'text.verbosity' other than \"medium\" is not supported", "text.verbosity");
      } else if (key != "format") {
        throw ResponsesError(fmt::format("unknown parameter 'text.{}'", key), "text." + key);
      }
    }
    if (is_set(t, "format")) {
      const ojson& f = t["format"];
      const std::string type = f.is_object() && is_set(f, "type") && f["type"].is_string() ? f["type"].get<std::string>() : "";
      if (type == "json_object") {
        ojson rf = ojson::object();
        rf["type"] = "json_object";
        out["response_format"] = rf;
      } else if (type == "json_schema") {
        if (!f.contains("schema") || !f["schema"].is_object())
          throw ResponsesError("'text.format' json_schema needs an object 'schema'", "text.format.schema");
        ojson js = ojson::object();
        js["name"] = is_set(f, "name") ? f["name"] : ojson("response");
        js["schema"] = f["schema"];
        ojson rf = ojson::object();
        rf["type"] = "json_schema";
        rf["json_schema"] = js;
        out["response_format"] = rf;
      } else if (type != "text") {
        throw ResponsesError("'text.format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or {\"type\": "
                             "\"json_schema\", \"name\": ..., \"schema\": {...}}",
                             "text.format");
      }
    }
  }
  if (is_set(body, "reasoning")) {
    const ojson& r = body["reasoning"];
    if (!r.is_object()) throw ResponsesError("'reasoning' must be an object", "reasoning");
    for (const auto& [key, v] : r.items()) {
      if (v.is_null()) continue;
      if (key == "effort") {
        if (v != "low" && v != "medium" && v != "high")
          throw ResponsesError("'reasoning.effort' must be \"low\", \"medium\" or \"high\" (gpt-oss's reasoning efforts)",
                               "reasoning.effort");
        out["reasoning_effort"] = v;
      } else if (key == "summary" || key == "generate_summary") {
        // kvq returns the reasoning itself (reasoning_text), not a summary of it
        if (v != "auto" && v != "concise" && v != "detailed")
          throw ResponsesError(fmt::format("'reasoning.{}' must be \"auto\", \"concise\" or \"detailed\"", key), "reasoning." + key);
      } else {
        throw ResponsesError(fmt::format("unknown parameter 'reasoning.{}'", key), "reasoning." + key);
      }
    }
  }
  bool logprobs = false;
  if (is_set(body, "include")) {
    const ojson& inc = body["include"];
    if (!inc.is_array()) throw ResponsesError("'include' must be an array of strings", "include");
    for (const ojson& x : inc) {
      if (!x.is_string()) throw ResponsesError("'include' must be an array of strings", "include");
      logprobs = logprobs || x == "message.output_text.logprobs";
    }
  }
  if (is_set(body, "top_logprobs")) {
    const ojson& v = body["top_logprobs"];
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > 20)
      throw ResponsesError("'top_logprobs' must be an integer in [0, 20]", "top_logprobs");
    out["top_logprobs"] = v;  // (the log-probabilities themselves only with include, as OpenAI's)
  }
  if (logprobs) {
    if (out.contains("stream") && out["stream"] == true)
      throw ResponsesError("log-probabilities are not streamed by kvq's Responses API: ask without 'stream'", "include");
    out["logprobs"] = true;
  } else {
    out.erase("top_logprobs");
  }
  return out;
}

json responses_echo(const ojson& body) {
  auto get = [&](const char* key, json dflt) { return is_set(body, key) ? json(body[key]) : dflt; };
  return json{{"instructions", get("instructions", nullptr)},
              {"max_output_tokens", get("max_output_tokens", nullptr)},
              {"temperature", get("temperature", 1.0)},
              {"top_p", get("top_p", 1.0)},
              {"tools", get("tools", json::array())},
              {"tool_choice", get("tool_choice", "auto")},
              {"parallel_tool_calls", get("parallel_tool_calls", true)},
              {"text", get("text", json{{"format", {{"type", "text"}}}})},
              {"reasoning", get("reasoning", json{{"effort", nullptr}, {"summary", nullptr}})},
              {"store", get("store", true)},
              {"metadata", get("metadata", json::object())},
              {"previous_response_id", get("previous_response_id", nullptr)},
              {"user", get("user", nullptr)},
              {"truncation", get("truncation", "disabled")},
              {"top_logprobs", get("top_logprobs", nullptr)},
              {"background", get("background", false)},
              {"error", nullptr},
              {"incomplete_details", nullptr}};
}

std::mt19937_64 responses_rng() {
  std::random_device rd;
  std::seed_seq seq{rd(), rd(), rd(), rd(), rd(), rd(), rd(), rd()};
  return std::mt19937_64(seq);
}

ResponsesForm responses_form(const ojson& body) {
  ResponsesForm f;
  if (is_set(body, "tools") && body["tools"].is_array())
    for (const ojson& t : body["tools"])
      if (t.is_object() && t.value("type", ojson()) == "custom" && t.contains("name") && t["name"].is_string())
        f.custom_tools.insert(t["name"].get<std::string>());
  if (is_set(body, "include") && body["include"].is_array())
    for (const ojson& x : body["include"]) f.encrypted_reasoning = f.encrypted_reasoning || x == "reasoning.encrypted_content";
  return f;
}

std::string responses_id(const char* prefix, std::mt19937_64& rng) {
  static constexpr char kChars[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
  std::string s = std::string(prefix) + "_";
  for (int i = 0; i < 24; ++i) s += kChars[rng() % 62];
  return s;
}

namespace {
json reasoning_item(const std::string& id, const std::string& text, const char* status, bool encrypted) {
  json it = {{"type", "reasoning"}, {"id", id}, {"summary", json::array()},
             {"content", json::array({{{"type", "reasoning_text"}, {"text", text}}})}, {"status", status}};
  if (encrypted) it["encrypted_content"] = kReasoningToken + text;
  return it;
}
json text_part(const std::string& text, const json& logprobs) {
  return json{{"type", "output_text"}, {"text", text}, {"annotations", json::array()},
              {"logprobs", logprobs.is_null() ? json::array() : logprobs}};
}
json message_item(const std::string& id, const json& part, const char* status) {
  return json{{"type", "message"}, {"id", id}, {"status", status}, {"role", "assistant"}, {"content", json::array({part})}};
}
// A call's item: a function's, or a custom tool's (its input: the arguments' "input" text).
json call_item(const ToolCall& c, const ResponsesForm& form, std::mt19937_64& rng) {
  if (form.custom_tools.count(c.name)) {
    const json args = json::parse(c.arguments, nullptr, false);
    const std::string input = args.is_object() && args.contains("input") && args["input"].is_string() ? args["input"].get<std::string>() : "";
    return json{{"type", "custom_tool_call"}, {"id", responses_id("ctc", rng)}, {"call_id", c.id}, {"name", c.name},
                {"input", input}, {"status", "completed"}};
  }
  return json{{"type", "function_call"}, {"id", responses_id("fc", rng)}, {"call_id", c.id}, {"name", c.name},
              {"arguments", c.arguments}, {"status", "completed"}};
}
}  // namespace

json responses_output(const ResponsesReply& r, const ResponsesForm& form, std::mt19937_64& rng) {
  const char* status = "completed";
  json out = json::array();
  if (!r.reasoning.empty()) out.push_back(reasoning_item(responses_id("rs", rng), r.reasoning, status, form.encrypted_reasoning));
  // (an empty answer is no item, as a stream writes none)
  if (r.content.is_string() && !r.content.get<std::string>().empty())
    out.push_back(message_item(responses_id("msg", rng), text_part(r.content.get<std::string>(), r.logprobs), status));
  for (const ToolCall& c : r.calls) out.push_back(call_item(c, form, rng));
  if (!r.complete && !out.empty()) out.back()["status"] = "incomplete";  // the item max_output_tokens cut
  return out;
}

json responses_usage(int prompt_tokens, int cached_tokens, int output_tokens, int reasoning_tokens) {
  return json{{"input_tokens", prompt_tokens},
              {"input_tokens_details", {{"cached_tokens", cached_tokens}}},
              {"output_tokens", output_tokens},
              {"output_tokens_details", {{"reasoning_tokens", reasoning_tokens}}},
              {"total_tokens", prompt_tokens + output_tokens}};
}

std::string ResponsesStream::event(const char* type, json data) {
  data["type"] = type;
  data["sequence_number"] = seq_++;
  return fmt::format("event: {}\ndata: {}\n\n", type, data.dump(-1, ' ', false, json::error_handler_t::replace));
}

std::string ResponsesStream::start() {
  std::string s = event("response.created", {{"response", response_}});  // (numbered in this order)
  return s + event("response.in_progress", {{"response", response_}});
}

std::string ResponsesStream::open(Item kind) {
  std::string s = close();
  open_ = kind;
  text_.clear();
  const int index = int(output_.size());
  if (kind == Item::message) {
    item_ = message_item(responses_id("msg", rng_), nullptr, "in_progress");
    item_["content"] = json::array();
    s += event("response.output_item.added", {{"output_index", index}, {"item", item_}});
    s += event("response.content_part.added",
               {{"item_id", item_["id"]}, {"output_index", index}, {"content_index", 0}, {"part", text_part("", nullptr)}});
  } else {
    item_ = reasoning_item(responses_id("rs", rng_), "", "in_progress", false);
    item_["content"] = json::array();
    s += event("response.output_item.added", {{"output_index", index}, {"item", item_}});
  }
  return s;
}

std::string ResponsesStream::close(const char* status) {
  if (open_ == Item::none) return "";
  const int index = int(output_.size());
  std::string s;
  if (open_ == Item::message) {
    const json part = text_part(text_, nullptr);
    s += event("response.output_text.done", {{"item_id", item_["id"]}, {"output_index", index}, {"content_index", 0},
                                             {"text", text_}, {"logprobs", json::array()}});
    s += event("response.content_part.done", {{"item_id", item_["id"]}, {"output_index", index}, {"content_index", 0}, {"part", part}});
    item_["content"] = json::array({part});
  } else {
    s += event("response.reasoning_text.done",
               {{"item_id", item_["id"]}, {"output_index", index}, {"content_index", 0}, {"text", text_}});
    item_["content"] = json::array({{{"type", "reasoning_text"}, {"text", text_}}});
    if (form_.encrypted_reasoning) item_["encrypted_content"] = kReasoningToken + text_;
  }
  item_["status"] = status;
  s += event("response.output_item.done", {{"output_index", index}, {"item", item_}});
  output_.push_back(item_);
  open_ = Item::none;
  return s;
}

std::string ResponsesStream::text(const std::string& delta) {
  if (delta.empty()) return "";
  std::string s = open_ == Item::message ? "" : open(Item::message);
  text_ += delta;
  return s + event("response.output_text.delta", {{"item_id", item_["id"]}, {"output_index", int(output_.size())},
                                                  {"content_index", 0}, {"delta", delta}, {"logprobs", json::array()}});
}

std::string ResponsesStream::reasoning(const std::string& delta) {
  if (delta.empty()) return "";
  std::string s = open_ == Item::reasoning ? "" : open(Item::reasoning);
  text_ += delta;
  return s + event("response.reasoning_text.delta",
                   {{"item_id", item_["id"]}, {"output_index", int(output_.size())}, {"content_index", 0}, {"delta", delta}});
}

std::string ResponsesStream::call(const ToolCall& c) {
  std::string s = close();
  const int index = int(output_.size());
  json item = call_item(c, form_, rng_);
  const bool custom = item["type"] == "custom_tool_call";
  const char* field = custom ? "input" : "arguments";
  json added = item;
  added[field] = "";
  added["status"] = "in_progress";
  s += event("response.output_item.added", {{"output_index", index}, {"item", added}});
  if (custom) {
    s += event("response.custom_tool_call_input.delta", {{"item_id", item["id"]}, {"output_index", index}, {"delta", item["input"]}});
    s += event("response.custom_tool_call_input.done", {{"item_id", item["id"]}, {"output_index", index}, {"input", item["input"]}});
  } else {
    s += event("response.function_call_arguments.delta", {{"item_id", item["id"]}, {"output_index", index}, {"delta", c.arguments}});
    s += event("response.function_call_arguments.done",
               {{"item_id", item["id"]}, {"output_index", index}, {"name", c.name}, {"arguments", c.arguments}});
  }
  s += event("response.output_item.done", {{"output_index", index}, {"item", item}});
  output_.push_back(item);
  return s;
}

std::string ResponsesStream::finish(const json& usage, bool complete, json* final) {
  // (the item open at the end is what max_output_tokens cut; those before it ended)
  std::string s = close(complete ? "completed" : "incomplete");
  json r = response_;
  r["status"] = complete ? "completed" : "incomplete";
  r["output"] = output_;
  r["usage"] = usage;
  r["completed_at"] = complete ? json(int64_t(std::time(nullptr))) : json(nullptr);
  if (!complete) r["incomplete_details"] = {{"reason", "max_output_tokens"}};
  if (final) *final = r;
  return s + event(complete ? "response.completed" : "response.incomplete", {{"response", r}});
}

std::string ResponsesStream::error(const std::string& message) {
  std::string s = close("incomplete");  // (the items so far, the open one cut)
  json r = response_;
  r["status"] = "failed";
  r["output"] = output_;
  r["error"] = {{"code", "server_error"}, {"message", message}};
  return s + event("response.failed", {{"response", r}});
}

}  // namespace kvq
