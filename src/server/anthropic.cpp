#include "server/anthropic.h"

#include "server/tools.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <set>

namespace kvq {

using ojson = nlohmann::ordered_json;
using json = nlohmann::json;

namespace {

bool is_set(const ojson& o, const char* key) { return o.contains(key) && !o[key].is_null(); }

// A text block's text (cache_control and citations have no effect).
std::string text_of(const ojson& block, const std::string& at) {
  if (!block.contains("text") || !block["text"].is_string()) throw AnthropicError("a text block needs a string 'text'", at + ".text");
  return block["text"].get<std::string>();
}

ojson text_part(std::string text) {
  ojson p = ojson::object();
  p["type"] = "text";
  p["text"] = std::move(text);
  return p;
}

[[noreturn]] void refuse_block(const std::string& type, const std::string& at) {
  if (type == "image" || type == "document" || type == "search_result" || type == "container_upload")
    throw AnthropicError(fmt::format("'{}' content blocks are not supported: kvq serves text models (text, tool_use, "
                                     "tool_result and thinking blocks are)",
                                     type),
                         at);
  throw AnthropicError(fmt::format("'{}' content blocks are not supported (supported: text, tool_use, tool_result, "
                                   "thinking, redacted_thinking)",
                                   type),
                       at);
}

// A tool_result's content: a string or text blocks.
std::string tool_result_text(const ojson& b, const std::string& at) {
  if (!is_set(b, "content")) return "";
  const ojson& c = b["content"];
  if (c.is_string()) return c.get<std::string>();
  if (!c.is_array()) throw AnthropicError("a tool_result's 'content' must be a string or an array of text blocks", at + ".content");
  std::string s;
  for (size_t k = 0; k < c.size(); ++k) {
    const std::string kat = fmt::format("{}.content[{}]", at, k);
    if (!c[k].is_object() || !c[k].contains("type") || !c[k]["type"].is_string())
      throw AnthropicError("each content block needs a string 'type'", kat);
    const std::string type = c[k]["type"].get<std::string>();
    if (type != "text") refuse_block(type, kat);
    s += text_of(c[k], kat);
  }
  return s;
}

// The messages as chat completions messages (system first). Returns whether the last message is
// the assistant's start of the reply (continued).
bool read_messages(const ojson& body, ojson& out) {
  ojson msgs = ojson::array();
  if (is_set(body, "system")) {
    const ojson& s = body["system"];
    ojson m = ojson::object();
    m["role"] = "system";
    if (s.is_string()) {
      m["content"] = s;
    } else if (s.is_array()) {
      ojson parts = ojson::array();
      for (size_t k = 0; k < s.size(); ++k) {
        const std::string at = fmt::format("system[{}]", k);
        if (!s[k].is_object() || s[k].value("type", ojson()) != "text")
          throw AnthropicError("'system' must be a string or an array of text blocks", at);
        std::string text = text_of(s[k], at);
        // Claude Code's attribution block: metadata for Anthropic's billing, with a hash that
        // changes every request; left in, it would make every prompt new to the prefix cache
        if (text.rfind("x-anthropic-billing-header:", 0) == 0) continue;
        parts.push_back(text_part(std::move(text)));
      }
      m["content"] = parts;
    } else {
      throw AnthropicError("'system' must be a string or an array of text blocks", "system");
    }
    // (an empty system prompt is none: the template's default system text stays)
    if (!(m["content"].is_string() ? m["content"].get<std::string>().empty() : m["content"].empty())) msgs.push_back(m);
  }
  if (!body.contains("messages")) throw AnthropicError("'messages' is required", "messages");
  const ojson& ms = body["messages"];
  if (!ms.is_array() || ms.empty()) throw AnthropicError("'messages' must be a non-empty array", "messages");
  bool prefill = false;
  for (size_t i = 0; i < ms.size(); ++i) {
    const ojson& m = ms[i];
    const std::string at = fmt::format("messages[{}]", i);
    if (!m.is_object()) throw AnthropicError("each message must be an object", at);
    if (!m.contains("role") || !m["role"].is_string()) throw AnthropicError("each message needs a string 'role'", at + ".role");
    const std::string role = m["role"].get<std::string>();
    if (role != "user" && role != "assistant")
      throw AnthropicError(fmt::format("unknown role '{}' (valid: user, assistant; the system prompt is the top-level "
                                       "'system')",
                                       role),
                           at + ".role");
    if (!m.contains("content")) throw AnthropicError("each message needs 'content'", at + ".content");
    const ojson& c = m["content"];
    const bool last = i + 1 == ms.size();
    if (c.is_string()) {
      ojson o = ojson::object();
      o["role"] = role;
      o["content"] = c;
      // a last assistant message with text is the reply's start (an empty one: none)
      if (last && role == "assistant") {
        if (c.get<std::string>().empty()) break;
        prefill = true;
      }
      msgs.push_back(o);
      continue;
    }
    if (!c.is_array()) throw AnthropicError("a message's 'content' must be a string or an array of content blocks", at + ".content");
    if (c.empty()) throw AnthropicError("a message's 'content' must not be empty", at + ".content");
    ojson parts = ojson::array();   // text since the last tool result (user) / the message's text (assistant)
    ojson calls = ojson::array();   // assistant: its tool_use blocks
    std::string reasoning;          // assistant: its thinking blocks
    auto flush_user_text = [&] {
      if (parts.empty()) return;
      ojson o = ojson::object();
      o["role"] = "user";
      o["content"] = parts;
      msgs.push_back(o);
      parts = ojson::array();
    };
    for (size_t k = 0; k < c.size(); ++k) {
      const std::string bat = fmt::format("{}.content[{}]", at, k);
      const ojson& b = c[k];
      if (!b.is_object() || !b.contains("type") || !b["type"].is_string())
        throw AnthropicError("each content block needs a string 'type'", bat);
      const std::string type = b["type"].get<std::string>();
      if (type == "text") {
        parts.push_back(text_part(text_of(b, bat)));
      } else if (type == "tool_use" && role == "assistant") {
        if (!b.contains("id") || !b["id"].is_string()) throw AnthropicError("a tool_use block needs a string 'id'", bat + ".id");
        if (!b.contains("name") || !b["name"].is_string())
          throw AnthropicError("a tool_use block needs a string 'name'", bat + ".name");
        if (!b.contains("input") || !b["input"].is_object())
          throw AnthropicError("a tool_use block needs an object 'input'", bat + ".input");
        ojson call = ojson::object();
        call["id"] = b["id"];
        call["type"] = "function";
        ojson fn = ojson::object();
        fn["name"] = b["name"];
        fn["arguments"] = b["input"].dump();
        call["function"] = fn;
        calls.push_back(call);
      } else if (type == "tool_result" && role == "user") {
        if (!b.contains("tool_use_id") || !b["tool_use_id"].is_string())
          throw AnthropicError("a tool_result block needs a string 'tool_use_id'", bat + ".tool_use_id");
        if (is_set(b, "is_error") && !b["is_error"].is_boolean())
          throw AnthropicError("a tool_result's 'is_error' must be a boolean", bat + ".is_error");
        std::string text = tool_result_text(b, bat);
        // the model is told a result is an error (the content alone may not say so)
        if (is_set(b, "is_error") && b["is_error"].get<bool>()) text = "Error: " + text;
        flush_user_text();
        ojson o = ojson::object();
        o["role"] = "tool";
        o["tool_call_id"] = b["tool_use_id"];
        o["content"] = text;
        msgs.push_back(o);
      } else if (type == "thinking" && role == "assistant") {
        if (!b.contains("thinking") || !b["thinking"].is_string())
          throw AnthropicError("a thinking block needs a string 'thinking'", bat + ".thinking");
        reasoning += b["thinking"].get<std::string>();
      } else if (type == "redacted_thinking" && role == "assistant") {
        continue;  // encrypted by another server: nothing kvq can give the model
      } else if (type == "tool_use" || type == "tool_result" || type == "thinking" || type == "redacted_thinking") {
        throw AnthropicError(fmt::format("'{}' blocks belong in {} messages", type, role == "user" ? "assistant" : "user"), bat);
      } else {
        refuse_block(type, bat);
      }
    }
    if (role == "user") {
      flush_user_text();
      continue;
    }
    if (last && !calls.empty())
      throw AnthropicError("the last message calls tools (tool_use): their tool_result blocks must follow in a user message",
                           at + ".content");
    if (last && calls.empty()) {
      if (parts.empty()) break;  // (only thinking: no reply start to continue)
      prefill = true;
    }
    if (parts.empty() && calls.empty() && reasoning.empty()) continue;  // (only redacted thinking: nothing to give)
    ojson o = ojson::object();
    o["role"] = "assistant";
    o["content"] = parts.empty() ? ojson(nullptr) : parts;
    if (!calls.empty()) o["tool_calls"] = calls;
    if (!reasoning.empty()) o["reasoning_content"] = reasoning;
    msgs.push_back(o);
  }
  out["messages"] = msgs;
  return prefill;
}

void read_tools(const ojson& body, ojson& out) {
  if (is_set(body, "tools")) {
    const ojson& ts = body["tools"];
    if (!ts.is_array()) throw AnthropicError("'tools' must be an array of tools ({\"name\", \"description\", \"input_schema\"})", "tools");
    ojson tools = ojson::array();
    for (size_t i = 0; i < ts.size(); ++i) {
      const std::string at = fmt::format("tools[{}]", i);
      const ojson& t = ts[i];
      if (!t.is_object()) throw AnthropicError("each tool must be an object", at);
      if (is_set(t, "type") && t["type"] != "custom") {
        const std::string type = t["type"].is_string() ? t["type"].get<std::string>() : t["type"].dump();
        throw AnthropicError(fmt::format("tools of type '{}' are not supported: kvq runs no server or Anthropic-defined "
                                         "tools (define it as a custom tool with a name and an input_schema)",
                                         type),
                             at + ".type");
      }
      if (!t.contains("name") || !t["name"].is_string()) throw AnthropicError("each tool needs a string 'name'", at + ".name");
      if (!t.contains("input_schema") || !t["input_schema"].is_object())
        throw AnthropicError("each tool needs an object 'input_schema' (the JSON Schema of its input)", at + ".input_schema");
      if (is_set(t, "description") && !t["description"].is_string())
        throw AnthropicError("a tool's 'description' must be a string", at + ".description");
      for (const auto& [key, v] : t.items()) {
        // strict: a schema kvq cannot generate is refused rather than loosened (tools.h);
        // eager_input_streaming: a call's input is streamed in one piece when it is whole
        static const std::set<std::string> known = {"type", "name", "description", "input_schema", "cache_control",
                                                    "strict", "eager_input_streaming", "input_examples",
                                                    "allowed_callers", "defer_loading"};
        if (!known.count(key)) throw AnthropicError(fmt::format("unknown tool field '{}'", key), at + "." + key);
      }
      // callers other than the model itself and tools loaded on demand need Anthropic's server tools
      if (is_set(t, "allowed_callers") && t["allowed_callers"] != ojson::array({"direct"}))
        throw AnthropicError("'allowed_callers' other than [\"direct\"] is not supported (kvq runs no code execution tool)",
                             at + ".allowed_callers");
      if (is_set(t, "defer_loading") && t["defer_loading"] != false)
        throw AnthropicError("'defer_loading' is not supported (kvq has no tool search tool): every tool is described up front",
                             at + ".defer_loading");
      std::string description = is_set(t, "description") ? t["description"].get<std::string>() : "";
      // input_examples: shown to the model after the description
      if (is_set(t, "input_examples")) {
        if (!t["input_examples"].is_array()) throw AnthropicError("'input_examples' must be an array of objects", at + ".input_examples");
        for (const ojson& ex : t["input_examples"]) {
          if (!ex.is_object()) throw AnthropicError("'input_examples' must be an array of objects", at + ".input_examples");
          description += (description.empty() ? "" : "\n") + std::string("Example input: ") + ex.dump();
        }
      }
      ojson fn = ojson::object();
      fn["name"] = t["name"];
      if (!description.empty()) fn["description"] = description;
      fn["parameters"] = t["input_schema"];
      if (is_set(t, "strict")) fn["strict"] = t["strict"];
      tools.push_back(function_tool(std::move(fn)));
    }
    out["tools"] = tools;
  }
  if (is_set(body, "tool_choice")) {
    const ojson& tc = body["tool_choice"];
    if (!tc.is_object() || !tc.contains("type") || !tc["type"].is_string())
      throw AnthropicError("'tool_choice' must be an object with a 'type' (auto, any, tool, none)", "tool_choice");
    const std::string type = tc["type"].get<std::string>();
    if (type == "auto") {
      out["tool_choice"] = "auto";
    } else if (type == "any") {
      out["tool_choice"] = "required";
    } else if (type == "none") {
      out["tool_choice"] = "none";
    } else if (type == "tool") {
      if (!tc.contains("name") || !tc["name"].is_string())
        throw AnthropicError("'tool_choice' of type 'tool' needs the tool's 'name'", "tool_choice.name");
      out["tool_choice"] = function_choice(tc["name"]);
    } else {
      throw AnthropicError(fmt::format("'tool_choice' type '{}' is unknown (valid: auto, any, tool, none)", type), "tool_choice.type");
    }
    if (is_set(tc, "disable_parallel_tool_use")) {
      if (!tc["disable_parallel_tool_use"].is_boolean())
        throw AnthropicError("'disable_parallel_tool_use' must be a boolean", "tool_choice.disable_parallel_tool_use");
      if (type != "none") out["parallel_tool_calls"] = !tc["disable_parallel_tool_use"].get<bool>();
    }
  }
}

// output_format (structured outputs) or output_config.format: {"type": "json_schema", "schema": {...}}.
void read_output_format(const ojson& body, ojson& out) {
  const ojson* f = nullptr;
  std::string at;
  if (is_set(body, "output_format")) {
    f = &body["output_format"];
    at = "output_format";
  }
  if (is_set(body, "output_config")) {
    const ojson& oc = body["output_config"];
    if (!oc.is_object()) throw AnthropicError("'output_config' must be an object", "output_config");
    for (const auto& [key, v] : oc.items()) {
      if (key == "format" && !v.is_null()) {
        if (f) throw AnthropicError("give one of 'output_format' and 'output_config.format'", "output_config.format");
        f = &oc["format"];
        at = "output_config.format";
      } else if (key == "effort" && !v.is_null()) {
        // a reasoning model's effort (gpt-oss's: low, medium, high; xhigh and max are its high, its
        // most); refused for other models by the server
        if (v != "low" && v != "medium" && v != "high" && v != "xhigh" && v != "max")
          throw AnthropicError("'output_config.effort' must be \"low\", \"medium\", \"high\", \"xhigh\" or \"max\"",
                               "output_config.effort");
        out["reasoning_effort"] = v == "xhigh" || v == "max" ? ojson("high") : v;
      } else if (key != "format" && !v.is_null()) {
        throw AnthropicError(fmt::format("'output_config.{}' is not supported", key), "output_config." + key);
      }
    }
  }
  if (!f) return;
  if (!f->is_object() || f->value("type", "") != "json_schema" || !f->contains("schema") || !(*f)["schema"].is_object())
    throw AnthropicError(fmt::format("'{}' must be {{\"type\": \"json_schema\", \"schema\": {{...}}}}", at), at);
  ojson js = ojson::object();
  js["name"] = "output";
  js["schema"] = (*f)["schema"];
  ojson rf = ojson::object();
  rf["type"] = "json_schema";
  rf["json_schema"] = js;
  out["response_format"] = rf;
}

// thinking: disabled turns a reasoning template's block off (chat_template_kwargs.enable_thinking
// false, Qwen3's switch), enabled / adaptive on; absent leaves the server's default. enabled's
// budget_tokens bounds the reasoning (thinking_token_budget; max_tokens bounds the whole reply, so
// a budget beyond it, as interleaved thinking allows, leaves max_tokens the bound).
void read_thinking(const ojson& body, ojson& out) {
  if (!is_set(body, "thinking")) return;
  const ojson& t = body["thinking"];
  if (!t.is_object() || !t.contains("type") || !t["type"].is_string())
    throw AnthropicError("'thinking' must be an object with a 'type' (enabled, disabled, adaptive)", "thinking");
  const std::string type = t["type"].get<std::string>();
  if (is_set(t, "display") && t["display"] != "summarized" && t["display"] != "omitted")
    throw AnthropicError("'thinking.display' must be \"summarized\" or \"omitted\"", "thinking.display");
  if (type == "enabled") {
    if (!t.contains("budget_tokens") || !t["budget_tokens"].is_number_integer() || t["budget_tokens"].get<int64_t>() < 1024)
      throw AnthropicError("'thinking.budget_tokens' must be an integer >= 1024", "thinking.budget_tokens");
    out["thinking_token_budget"] = t["budget_tokens"];
  } else if (type != "disabled" && type != "adaptive" && type != "between_tools") {
    throw AnthropicError(fmt::format("'thinking' type '{}' is unknown (valid: enabled, disabled, adaptive, between_tools)", type),
                         "thinking.type");
  }
  out["chat_template_kwargs"] = {{"enable_thinking", type != "disabled"}};
}

}  // namespace

ojson anthropic_chat_body(const ojson& body, bool count_tokens) {
  if (!body.is_object()) throw AnthropicError("the request body must be a JSON object", "");
  // (cache_control, inference_geo, speed, diagnostics, user_profile_id, workspace_id, metadata and
  // service_tier change nothing kvq generates: prefixes are cached whatever is marked, and there is
  // one machine and one speed)
  static const std::set<std::string> fields = {"model", "max_tokens", "messages", "system", "stop_sequences", "temperature",
                                               "top_p", "top_k", "stream", "tools", "tool_choice", "metadata",
                                               "service_tier", "thinking", "output_format", "output_config",
                                               "cache_control", "inference_geo", "speed", "diagnostics",
                                               "user_profile_id", "workspace_id"};
  static const std::set<std::string> counted = {"model", "messages", "system", "tools", "tool_choice", "thinking",
                                                "output_format", "output_config", "cache_control"};
  for (const auto& [key, v] : body.items()) {
    if ((count_tokens ? counted : fields).count(key)) continue;
    if (key == "mcp_servers" || key == "container" || key == "context_management") {
      if (v.is_null() || (v.is_array() && v.empty())) continue;
      throw AnthropicError(fmt::format("'{}' is not supported", key), key);
    }
    throw AnthropicError(fmt::format("unknown field '{}' (the Messages API's fields: {})", key,
                                     fmt::join(count_tokens ? counted : fields, ", ")),
                         key);
  }
  ojson out = ojson::object();
  if (is_set(body, "model")) {
    if (!body["model"].is_string()) throw AnthropicError("'model' must be a string", "model");
    out["model"] = body["model"];
  }
  if (!count_tokens) {
    if (!is_set(body, "max_tokens")) throw AnthropicError("'max_tokens' is required", "max_tokens");
    const ojson& m = body["max_tokens"];
    if (!m.is_number_integer() || m.get<int64_t>() < 1 || m.get<int64_t>() > (int64_t(1) << 30))
      throw AnthropicError("'max_tokens' must be an integer >= 1", "max_tokens");
    out["max_tokens"] = m;
  }
  const bool prefill = read_messages(body, out);
  if (is_set(body, "stop_sequences")) {
    const ojson& s = body["stop_sequences"];
    if (!s.is_array() || s.size() > 16) throw AnthropicError("'stop_sequences' must be an array of at most 16 strings", "stop_sequences");
    for (const ojson& x : s)
      if (!x.is_string()) throw AnthropicError("'stop_sequences' must be an array of strings", "stop_sequences");
    out["stop"] = s;
  }
  auto number = [&](const char* key, const char* range, auto ok) {
    if (!is_set(body, key)) return;
    const ojson& v = body[key];
    if (!v.is_number() || !ok(v.get<double>())) throw AnthropicError(fmt::format("'{}' must be a number in {}", key, range), key);
    out[key] = v;
  };
  number("temperature", "[0, 1]", [](double x) { return x >= 0 && x <= 1; });
  number("top_p", "(0, 1]", [](double x) { return x > 0 && x <= 1; });
  if (is_set(body, "top_k")) {
    const ojson& v = body["top_k"];
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > INT32_MAX)
      throw AnthropicError("'top_k' must be an integer >= 0", "top_k");
    out["top_k"] = v;
  }
  if (is_set(body, "stream")) {
    if (!body["stream"].is_boolean()) throw AnthropicError("'stream' must be a boolean", "stream");
    out["stream"] = body["stream"];
  }
  for (const char* key : {"metadata", "cache_control", "diagnostics"})
    if (is_set(body, key) && !body[key].is_object()) throw AnthropicError(fmt::format("'{}' must be an object", key), key);
  for (const char* key : {"service_tier", "inference_geo", "speed", "user_profile_id", "workspace_id"})
    if (is_set(body, key) && !body[key].is_string()) throw AnthropicError(fmt::format("'{}' must be a string", key), key);
  read_tools(body, out);
  read_output_format(body, out);
  read_thinking(body, out);
  if (prefill) {
    const bool tools_on = out.contains("tools") && !out["tools"].empty() && out.value("tool_choice", ojson("auto")) != "none";
    if (tools_on || out.contains("response_format"))
      throw AnthropicError(fmt::format("a last assistant message (the reply's start) cannot be combined with '{}': "
                                       "its grammar starts at the reply's first byte",
                                       tools_on ? "tools" : "output_format"),
                           "messages");
    out["add_generation_prompt"] = false;
    out["continue_final_message"] = true;
  }
  return out;
}

std::string anthropic_names(const std::string& text) {
  std::string s = rename_tool_fields(text, [](size_t k, const std::string& field) {
    return fmt::format("tools[{}].{}", k, field == "parameters" ? "input_schema" : field);
  });
  return rename_fields(std::move(s), {{"response_format", "output_format"}, {"reasoning_effort", "output_config.effort"}});
}

bool anthropic_omits_thinking(const ojson& body) {
  return body.is_object() && is_set(body, "thinking") && body["thinking"].is_object() &&
         body["thinking"].value("display", ojson()) == "omitted";
}

json anthropic_error_body(const std::string& message, int status) {
  const char* type = status == 401   ? "authentication_error"
                     : status == 403 ? "permission_error"
                     : status == 404 ? "not_found_error"
                     : status == 413 ? "request_too_large"
                     : status == 429 ? "rate_limit_error"
                     : status == 503 || status == 529 ? "overloaded_error"
                     : status >= 500 ? "api_error"
                                     : "invalid_request_error";
  return json{{"type", "error"}, {"error", {{"type", type}, {"message", message}}}};
}

std::string anthropic_tool_id(const std::string& call_id) {
  return "toolu_" + (call_id.rfind("call_", 0) == 0 ? call_id.substr(5) : call_id);
}

AnthropicStop anthropic_stop(const std::string& finish, const std::string& stop_string, bool called) {
  if (called) return {"tool_use", nullptr};
  if (finish == "length") return {"max_tokens", nullptr};
  if (!stop_string.empty()) return {"stop_sequence", stop_string};
  return {"end_turn", nullptr};
}

json anthropic_usage(int prompt_tokens, int cached_tokens, int output_tokens) {
  return json{{"input_tokens", prompt_tokens - cached_tokens},
              {"cache_creation_input_tokens", 0},
              {"cache_read_input_tokens", cached_tokens},
              {"output_tokens", output_tokens}};
}

json anthropic_tool_use(const std::string& call_id, const std::string& name, const std::string& arguments) {
  json input = json::parse(arguments, nullptr, false);
  if (input.is_discarded() || !input.is_object()) input = json::object();
  return json{{"type", "tool_use"}, {"id", anthropic_tool_id(call_id)}, {"name", name}, {"input", input}};
}

namespace {
std::string event(const char* name, const json& data) {
  return fmt::format("event: {}\ndata: {}\n\n", name, data.dump(-1, ' ', false, json::error_handler_t::replace));
}
}  // namespace

std::string AnthropicStream::start(int prompt_tokens) const {
  const json message = {{"id", id_},
                        {"type", "message"},
                        {"role", "assistant"},
                        {"model", model_},
                        {"content", json::array()},
                        {"stop_reason", nullptr},
                        {"stop_sequence", nullptr},
                        {"usage", anthropic_usage(prompt_tokens, 0, 0)}};
  return event("message_start", {{"type", "message_start"}, {"message", message}}) + event("ping", {{"type", "ping"}});
}

std::string AnthropicStream::close() {
  if (open_ == Block::none) return "";
  open_ = Block::none;
  return event("content_block_stop", {{"type", "content_block_stop"}, {"index", index_}});
}

std::string AnthropicStream::open(Block kind, json block) {
  std::string s = close();
  open_ = kind;
  ++index_;
  return s + event("content_block_start", {{"type", "content_block_start"}, {"index", index_}, {"content_block", std::move(block)}});
}

std::string AnthropicStream::text(const std::string& delta) {
  if (delta.empty()) return "";
  std::string s = open_ == Block::text ? "" : open(Block::text, {{"type", "text"}, {"text", ""}});
  return s + event("content_block_delta",
                   {{"type", "content_block_delta"}, {"index", index_}, {"delta", {{"type", "text_delta"}, {"text", delta}}}});
}

std::string AnthropicStream::thinking(const std::string& delta) {
  if (delta.empty()) return "";
  std::string s = open_ == Block::thinking ? "" : open(Block::thinking, {{"type", "thinking"}, {"thinking", ""}, {"signature", ""}});
  return s + event("content_block_delta", {{"type", "content_block_delta"},
                                           {"index", index_},
                                           {"delta", {{"type", "thinking_delta"}, {"thinking", delta}}}});
}

std::string AnthropicStream::tool_use(const std::string& call_id, const std::string& name, const std::string& arguments) {
  json block = anthropic_tool_use(call_id, name, arguments);
  const std::string input = block["input"].dump(-1, ' ', false, json::error_handler_t::replace);
  block["input"] = json::object();
  std::string s = open(Block::none, block);
  s += event("content_block_delta", {{"type", "content_block_delta"},
                                     {"index", index_},
                                     {"delta", {{"type", "input_json_delta"}, {"partial_json", input}}}});
  return s + event("content_block_stop", {{"type", "content_block_stop"}, {"index", index_}});
}

std::string AnthropicStream::finish(const AnthropicStop& stop, const json& usage) {
  std::string s = close();
  s += event("message_delta", {{"type", "message_delta"},
                               {"delta", {{"stop_reason", stop.reason}, {"stop_sequence", stop.sequence}}},
                               {"usage", usage}});
  return s + event("message_stop", {{"type", "message_stop"}});
}

std::string AnthropicStream::error(const std::string& message, int status) {
  return event("error", anthropic_error_body(message, status));
}

}  // namespace kvq
