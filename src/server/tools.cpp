#include "server/tools.h"

#include <cctype>

#include <fmt/format.h>

#include <map>
#include <set>

#include "model/json_schema.h"

namespace kvq {

using ojson = nlohmann::ordered_json;
using json = nlohmann::json;

namespace {

bool is_set(const ojson& body, const char* key) { return body.contains(key) && !body[key].is_null(); }

// OpenAI's rule for function names.
bool valid_function_name(const std::string& n) {
  if (n.empty() || n.size() > 64) return false;
  for (char c : n)
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-')) return false;
  return true;
}

// Points every "$ref" of a schema that `schema` was the whole document of ("#", "#/$defs/x") at
// the same place under `at` (a JSON pointer) of the document it is now part of. Only schemas are
// walked (by the keywords that hold them), so that a property or definition named like a keyword,
// and data (const, enum, default, examples), are left as they are.
void rebase_refs(ojson& schema, const std::string& at) {
  if (!schema.is_object()) return;
  for (auto it = schema.begin(); it != schema.end(); ++it) {
    const std::string& k = it.key();
    ojson& v = it.value();
    if (k == "$ref") {
      if (v.is_string() && !v.get<std::string>().empty() && v.get<std::string>()[0] == '#')
        v = "#" + at + v.get<std::string>().substr(1);
    } else if (k == "properties" || k == "patternProperties" || k == "$defs" || k == "definitions" ||
               k == "dependentSchemas") {
      if (v.is_object())
        for (auto p = v.begin(); p != v.end(); ++p) rebase_refs(p.value(), at);
    } else if (k == "anyOf" || k == "oneOf" || k == "allOf" || k == "prefixItems" || k == "items") {
      if (v.is_array()) {
        for (ojson& x : v) rebase_refs(x, at);
      } else {
        rebase_refs(v, at);  // items: one schema
      }
    } else if (k == "additionalProperties" || k == "additionalItems" || k == "not" || k == "if" || k == "then" ||
               k == "else" || k == "contains" || k == "propertyNames" || k == "unevaluatedItems" ||
               k == "unevaluatedProperties") {
      rebase_refs(v, at);
    }
  }
}

// {"type": "object", "properties": {name: value}, "required": [name]} and nothing else.
ojson one_property(const char* name, ojson value) {
  ojson s = ojson::object();
  s["type"] = "object";
  s["properties"] = ojson::object();
  s["properties"][name] = std::move(value);
  s["required"] = ojson::array({name});
  s["additionalProperties"] = false;
  return s;
}

ojson call_schema(const ToolFunction& f, const std::string& at) {
  ojson params = f.parameters;
  rebase_refs(params, at + "/properties/arguments");
  ojson name = ojson::object();
  name["const"] = f.name;
  ojson props = ojson::object();
  props["name"] = name;
  props["arguments"] = params;
  ojson s = ojson::object();
  s["type"] = "object";
  s["properties"] = props;
  s["required"] = ojson::array({"name", "arguments"});
  s["additionalProperties"] = false;
  return s;
}

// The reply starts as {"response": ...: where the response starts (string: the text after its
// opening quote). undecided: the text so far could still become one.
enum class Lead { undecided, response, other };
Lead response_lead(const std::string& t, size_t* body_at, bool string) {
  size_t i = 0;
  auto ws = [&] {
    while (i < t.size() && (t[i] == ' ' || t[i] == '\t' || t[i] == '\n' || t[i] == '\r')) ++i;
  };
  auto expect = [&](std::string_view lit) -> Lead {
    for (char c : lit) {
      if (i == t.size()) return Lead::undecided;
      if (t[i] != c) return Lead::other;
      ++i;
    }
    return Lead::response;
  };
  for (std::string_view lit : {"{", "\"response\"", ":"}) {
    ws();
    if (const Lead l = expect(lit); l != Lead::response) return l;
  }
  ws();
  if (i == t.size()) return Lead::undecided;
  if (string) {
    if (const Lead l = expect("\""); l != Lead::response) return l;
  }
  *body_at = i;
  return Lead::response;
}

// Where a JSON string whose text (after the opening quote) starts `body` ends: its closing quote,
// or npos while it is open.
size_t string_end(std::string_view body) {
  bool escaped = false;
  for (size_t i = 0; i < body.size(); ++i) {
    if (escaped) escaped = false;
    else if (body[i] == '\\') escaped = true;
    else if (body[i] == '"') return i;
  }
  return std::string_view::npos;
}

// Decodes the longest start of a JSON string's text (no quotes) that holds only whole characters
// (an escape or a surrogate pair cut short is left out, and so is everything from a character the
// JSON parser refuses); *used: its bytes. Decoded by the JSON parser.
std::string decode_whole(std::string_view text, size_t* used) {
  size_t end = text.size();
  while (true) {
    // The longest escape is a surrogate pair, \uD83D\uDE00: 12 bytes.
    size_t error_at = end;  // where the parser stopped, in text
    for (size_t drop = 0; drop <= std::min<size_t>(12, end); ++drop) {
      std::string quoted = "\"";
      quoted += text.substr(0, end - drop);
      quoted += '"';
      json s = json::parse(quoted, nullptr, false);
      if (!s.is_discarded() && s.is_string()) {
        *used = end - drop;
        return s.get<std::string>();
      }
      if (drop == 0) {
        try {
          const json unused = json::parse(quoted);
        } catch (const json::parse_error& e) {
          error_at = e.byte >= 2 ? std::min(end, size_t(e.byte) - 2) : 0;  // e.byte: 1-based, after the quote
        }
      }
    }
    // Something inside that no more text can mend (not valid in a JSON string): decode up to it
    // (the character the parser stopped at, and the escape it may be part of, dropped above).
    if (error_at + 1 >= end) break;
    end = error_at + 1;
  }
  *used = 0;
  return "";
}

// The text of a JSON string whose body starts `body`: up to its closing quote, or, while it is
// open, its whole characters.
std::string decoded_prefix(std::string_view body) {
  size_t used = 0;
  return decode_whole(body.substr(0, std::min(body.size(), string_end(body))), &used);
}

std::string call_id(std::mt19937_64& rng) {
  static const char kAlnum[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
  std::uniform_int_distribution<int> d(0, int(sizeof kAlnum) - 2);
  std::string id = "call_";
  for (int i = 0; i < 24; ++i) id += kAlnum[d(rng)];
  return id;
}

std::string message_text(const json& m, size_t i) {
  const std::string param = fmt::format("messages[{}].content", i);
  if (!m.contains("content") || m["content"].is_null()) return "";
  const json& c = m["content"];
  if (c.is_string()) return c.get<std::string>();
  if (c.is_array()) {  // [{"type": "text", "text": "..."}]
    std::string s;
    for (const auto& part : c) {
      if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") || !part["text"].is_string())
        throw ToolsError("only text content parts are supported", param);
      s += part["text"].get<std::string>();
    }
    return s;
  }
  throw ToolsError("message content must be a string or an array of text parts", param);
}

}  // namespace

std::string rename_tool_fields(const std::string& text, const std::function<std::string(size_t, const std::string&)>& rename) {
  static constexpr std::string_view kOpen = "tools[";
  std::string out;
  size_t pos = 0;
  while (true) {
    const size_t at = text.find(kOpen, pos);
    if (at == std::string::npos) break;
    size_t k = at + kOpen.size(), digits = k;
    while (digits < text.size() && std::isdigit(static_cast<unsigned char>(text[digits]))) ++digits;
    static constexpr std::string_view kFn = "].function.";
    if (digits == k || text.compare(digits, kFn.size(), kFn) != 0) {
      out.append(text, pos, digits - pos);
      pos = digits;
      continue;
    }
    size_t end = digits + kFn.size();
    while (end < text.size() && (std::isalnum(static_cast<unsigned char>(text[end])) || text[end] == '_')) ++end;
    out.append(text, pos, at - pos);
    out += rename(size_t(std::stoul(text.substr(k, digits - k))), text.substr(digits + kFn.size(), end - digits - kFn.size()));
    pos = end;
  }
  return out + text.substr(pos);
}

std::string rename_fields(std::string text, std::initializer_list<std::pair<std::string_view, std::string_view>> renames) {
  auto word = [](char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; };
  for (const auto& [from, to] : renames)
    for (size_t at = text.find(from); at != std::string::npos; at = text.find(from, at)) {
      const size_t end = at + from.size();
      if ((at > 0 && word(text[at - 1])) || (end < text.size() && word(text[end]))) {
        at = end;
        continue;
      }
      text.replace(at, from.size(), to);
      at += to.size();
    }
  return text;
}

ojson function_tool(ojson fn) {
  ojson o = ojson::object();
  o["type"] = "function";
  o["function"] = std::move(fn);
  return o;
}

ojson function_choice(const ojson& name) {
  ojson fn = ojson::object();
  fn["name"] = name;
  return function_tool(std::move(fn));
}

ToolSpec parse_tools(const ojson& body) {
  ToolSpec spec;
  if (is_set(body, "functions") || is_set(body, "function_call"))
    throw ToolsError("'functions' and 'function_call' (deprecated by OpenAI) are not supported: use 'tools' and 'tool_choice'",
                     is_set(body, "functions") ? "functions" : "function_call");
  if (is_set(body, "tools")) {
    const ojson& tools = body["tools"];
    if (!tools.is_array()) throw ToolsError("'tools' must be an array of {\"type\": \"function\", \"function\": {...}}", "tools");
    if (tools.size() > 128) throw ToolsError("'tools' holds at most 128 functions", "tools");
    std::set<std::string> names;
    for (size_t i = 0; i < tools.size(); ++i) {
      const std::string at = fmt::format("tools[{}]", i);
      const ojson& t = tools[i];
      if (!t.is_object() || !t.contains("type") || !t["type"].is_string())
        throw ToolsError("each tool must be an object with a string 'type'", at);
      if (t["type"] != "function")
        throw ToolsError(fmt::format("tool type '{}' is not supported (supported: \"function\")", t["type"].get<std::string>()),
                         at + ".type");
      if (!t.contains("function") || !t["function"].is_object())
        throw ToolsError("a function tool needs a 'function' object", at + ".function");
      const ojson& f = t["function"];
      if (!f.contains("name") || !f["name"].is_string() || !valid_function_name(f["name"].get<std::string>()))
        throw ToolsError("a function's 'name' must be 1 to 64 letters, digits, '_' or '-'", at + ".function.name");
      ToolFunction fn;
      fn.name = f["name"].get<std::string>();
      if (!names.insert(fn.name).second)
        throw ToolsError(fmt::format("two tools are named '{}'", fn.name), at + ".function.name");
      if (is_set(f, "description")) {
        if (!f["description"].is_string()) throw ToolsError("'description' must be a string", at + ".function.description");
        fn.description = f["description"].get<std::string>();
      }
      if (is_set(f, "strict") && !f["strict"].is_boolean())
        throw ToolsError("'strict' must be a boolean", at + ".function.strict");
      fn.strict = is_set(f, "strict") && f["strict"].get<bool>();
      const std::string pparam = at + ".function.parameters";
      if (is_set(f, "parameters")) {
        fn.parameters = f["parameters"];
        if (!fn.parameters.is_object()) throw ToolsError("'parameters' must be a JSON Schema object", pparam);
        // The arguments are an object (OpenAI's rule): a schema that allows anything else cannot
        // be. Without a type, a schema of only an object's keywords (or none: {}) is read as one.
        if (fn.parameters.contains("type") && fn.parameters["type"] != "object")
          throw ToolsError("'parameters' must describe an object (\"type\": \"object\")", pparam);
        if (!fn.parameters.contains("type")) {
          for (const char* k : {"$ref", "anyOf", "oneOf", "allOf", "enum", "const", "not", "if"})
            if (fn.parameters.contains(k))
              throw ToolsError(fmt::format("'parameters' must say \"type\": \"object\" beside '{}'", k), pparam);
          fn.parameters["type"] = "object";
        }
      } else {
        fn.parameters = ojson::object();  // no parameters: the empty object
        fn.parameters["type"] = "object";
        fn.parameters["properties"] = ojson::object();
      }
      fn.index = i;
      spec.functions.push_back(std::move(fn));
    }
  }
  if (!spec.functions.empty()) spec.choice = ToolChoice::automatic;
  if (is_set(body, "tool_choice")) {
    const ojson& c = body["tool_choice"];
    if (c == "none") {
      spec.choice = ToolChoice::none;
    } else if (c == "auto") {
      spec.choice = ToolChoice::automatic;
    } else if (c == "required") {
      spec.choice = ToolChoice::required;
    } else if (c.is_object() && c.value("type", ojson()) == "function" && c.contains("function") &&
               c["function"].is_object() && c["function"].contains("name") && c["function"]["name"].is_string()) {
      spec.choice = ToolChoice::named;
      spec.named = c["function"]["name"].get<std::string>();
      bool found = false;
      for (const ToolFunction& f : spec.functions) found = found || f.name == spec.named;
      if (!found) throw ToolsError(fmt::format("'tool_choice' names '{}', which is not among 'tools'", spec.named), "tool_choice");
    } else {
      throw ToolsError("'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": "
                       "{\"name\": ...}}",
                       "tool_choice");
    }
    if (spec.choice != ToolChoice::none && spec.functions.empty())
      throw ToolsError("'tool_choice' other than \"none\" needs 'tools'", "tool_choice");
  }
  if (is_set(body, "parallel_tool_calls")) {
    if (!body["parallel_tool_calls"].is_boolean()) throw ToolsError("'parallel_tool_calls' must be a boolean", "parallel_tool_calls");
    spec.parallel = body["parallel_tool_calls"].get<bool>();
  }
  return spec;
}

ojson tool_reply_schema(const ToolSpec& spec, const ojson& response_schema) {
  const bool with_response = spec.choice == ToolChoice::automatic;
  const std::string calls_at = with_response ? "/anyOf/0" : "";
  std::vector<const ToolFunction*> fns;
  for (const ToolFunction& f : spec.functions)
    if (spec.choice != ToolChoice::named || f.name == spec.named) fns.push_back(&f);
  const std::string items_at = calls_at + "/properties/tool_calls/items";
  ojson items;
  if (fns.size() == 1) {
    items = call_schema(*fns[0], items_at);
  } else {
    ojson any = ojson::array();
    for (size_t i = 0; i < fns.size(); ++i) any.push_back(call_schema(*fns[i], fmt::format("{}/anyOf/{}", items_at, i)));
    items = ojson::object();
    items["anyOf"] = any;
  }
  ojson arr = ojson::object();
  arr["type"] = "array";
  arr["items"] = items;
  arr["minItems"] = 1;
  if (!spec.parallel || spec.choice == ToolChoice::named) arr["maxItems"] = 1;
  ojson calls = one_property("tool_calls", std::move(arr));
  if (!with_response) return calls;
  ojson resp = response_schema.is_null() ? ojson::object({{"type", "string"}}) : response_schema;
  rebase_refs(resp, "/anyOf/1/properties/response");
  ojson s = ojson::object();
  s["anyOf"] = ojson::array({std::move(calls), one_property("response", std::move(resp))});
  return s;
}

std::vector<ToolFunction> ToolSpec::callable() const {
  std::vector<ToolFunction> out = functions;
  if (choice == ToolChoice::named) std::erase_if(out, [&](const ToolFunction& f) { return f.name != named; });
  return out;
}

std::shared_ptr<const Grammar> calls_grammar(
    const std::vector<ToolFunction>& fns,
    const std::function<std::shared_ptr<const Grammar>(const std::vector<ToolFunction>&)>& compile) {
  try {
    return compile(fns);
  } catch (const std::invalid_argument&) {
    const std::vector<ToolFunction> loose = loosened_functions(fns);
    try {
      return compile(loose);
    } catch (const std::invalid_argument& e) {
      throw ToolsError(fmt::format("the functions' calls: {}", e.what()), "tools");
    }
  }
}

std::vector<ToolFunction> loosened_functions(const std::vector<ToolFunction>& fns) {
  std::vector<ToolFunction> out = fns;
  for (ToolFunction& f : out) {
    try {
      (void)Grammar::from_schema(f.parameters);
    } catch (const std::invalid_argument& fe) {
      const std::string param = fmt::format("tools[{}].function.parameters", f.index);
      if (f.strict)
        throw ToolsError(fmt::format("'{}': {} (a strict function's arguments must follow its parameters)", param, fe.what()),
                         param);
      f.parameters = ojson::object();
      f.parameters["type"] = "object";
    }
  }
  return out;
}

std::shared_ptr<const Grammar> tool_reply_grammar(const ToolSpec& spec, const ojson& response_schema) {
  try {
    return Grammar::from_schema(tool_reply_schema(spec, response_schema));
  } catch (const std::invalid_argument& e) {
    // Only when it fails is each function's schema compiled alone: a strict one kvq cannot
    // generate is named, the others loosened.
    ToolSpec loose = spec;
    loose.functions = loosened_functions(spec.functions);
    try {
      return Grammar::from_schema(tool_reply_schema(loose, response_schema));
    } catch (const std::invalid_argument& e2) {
      throw ToolsError(fmt::format("the reply's schema: {}", e2.what()), response_schema.is_null() ? "tools" : "response_format");
    }
  }
}

std::string tool_system_prompt(const ToolSpec& spec, bool response_is_string) {
  std::string p = "You can call functions. Each is given as JSON with its name, what it does, and the JSON Schema of its "
                  "arguments:\n";
  for (const ToolFunction& f : spec.functions) {
    ojson d = ojson::object();
    d["name"] = f.name;
    if (!f.description.empty()) d["description"] = f.description;
    d["parameters"] = f.parameters;
    p += d.dump() + "\n";
  }
  const std::string call = "{\"tool_calls\": [{\"name\": FUNCTION NAME, \"arguments\": ARGUMENTS OBJECT}";
  const std::string calls = spec.parallel ? call + ", ...]}" : call + "]}";
  switch (spec.choice) {
    case ToolChoice::automatic:
      p += "\nReply with one JSON object: " + calls + " to call " +
           (spec.parallel ? "one or more of the functions" : "one of the functions") + ", or {\"response\": " +
           (response_is_string ? "YOUR REPLY" : "YOUR REPLY AS JSON") + "} to answer directly.";
      break;
    case ToolChoice::required:
      p += "\nReply with one JSON object " + calls + ", calling " +
           (spec.parallel ? "one or more of the functions." : "one of the functions.");
      break;
    case ToolChoice::named:
      p += "\nReply with one JSON object {\"tool_calls\": [{\"name\": \"" + spec.named +
           "\", \"arguments\": ARGUMENTS OBJECT}]}, calling the function " + spec.named + ".";
      break;
    case ToolChoice::none:
      break;
  }
  return p;
}

std::vector<ChatMessage> tool_chat_messages(const json& ms, const std::string& system_extra, const ChatTemplate& tpl) {
  if (!ms.is_array() || ms.empty()) throw ToolsError("'messages' must be a non-empty array", "messages");
  std::vector<ChatMessage> out;
  std::map<std::string, std::string> call_names;  // tool_call_id -> function name
  bool in_tool_turn = false;                      // the last turn holds tool results
  const bool harmony = tpl.family == ChatFamily::harmony;
  // Qwen's templates write calls and results in their own syntax too (chat_render), named by nothing
  const bool qwen = tpl.family == ChatFamily::chatml && tpl.qwen_tools;
  std::string last_call;                          // the last assistant message's last call
  for (size_t i = 0; i < ms.size(); ++i) {
    const json& m = ms[i];
    const std::string at = fmt::format("messages[{}]", i);
    if (!m.is_object()) throw ToolsError("each message must be an object", at);
    if (!m.contains("role") || !m["role"].is_string()) throw ToolsError("each message needs a string 'role'", at + ".role");
    const std::string role = m["role"].get<std::string>();
    if (role != "system" && role != "user" && role != "assistant" && role != "developer" && role != "tool")
      throw ToolsError(fmt::format("unknown role '{}' (valid: system, developer, user, assistant, tool)", role), at + ".role");
    std::string content = message_text(m, i);
    if (role == "tool") {
      ojson r = ojson::object();
      std::string name;
      if (m.contains("tool_call_id") && !m["tool_call_id"].is_null()) {
        if (!m["tool_call_id"].is_string()) throw ToolsError("'tool_call_id' must be a string", at + ".tool_call_id");
        auto it = call_names.find(m["tool_call_id"].get<std::string>());
        if (it != call_names.end()) name = it->second;
      }
      if (name.empty() && m.contains("name") && m["name"].is_string()) name = m["name"].get<std::string>();
      if (qwen) {
        out.push_back({"tool", content});
        continue;
      }
      if (harmony) {  // the function's own message (named by the last call when nothing names it)
        if (name.empty() && last_call.empty())
          throw ToolsError("a 'tool' message needs an earlier assistant message with 'tool_calls'", at);
        out.push_back({"tool", content});
        out.back().name = name.empty() ? last_call : name;
        continue;
      }
      if (!name.empty()) r["name"] = name;
      r["content"] = content;
      ojson line = ojson::object();
      line["tool_response"] = r;
      if (in_tool_turn) {
        out.back().content += '\n';
        out.back().content += line.dump();
      } else {
        out.push_back({"user", line.dump()});
        out.back().tool_result = true;
        in_tool_turn = true;
      }
      continue;
    }
    in_tool_turn = false;
    std::vector<ChatToolCall> native;  // harmony: the calls in its own syntax
    if (role == "assistant") last_call.clear();
    if (role == "assistant" && m.contains("tool_calls") && !m["tool_calls"].is_null()) {
      const json& tc = m["tool_calls"];
      if (!tc.is_array()) throw ToolsError("'tool_calls' must be an array", at + ".tool_calls");
      ojson calls = ojson::array();
      for (size_t j = 0; j < tc.size(); ++j) {
        const std::string cat = fmt::format("{}.tool_calls[{}]", at, j);
        const json& c = tc[j];
        if (!c.is_object() || !c.contains("function") || !c["function"].is_object())
          throw ToolsError("each tool call needs a 'function' object", cat);
        const json& f = c["function"];
        if (!f.contains("name") || !f["name"].is_string()) throw ToolsError("a tool call needs a string 'name'", cat + ".function.name");
        ojson args = ojson::object();
        if (f.contains("arguments") && !f["arguments"].is_null()) {
          if (!f["arguments"].is_string())
            throw ToolsError("a tool call's 'arguments' must be a string of JSON", cat + ".function.arguments");
          args = ojson::parse(f["arguments"].get<std::string>(), nullptr, false);
          if (args.is_discarded()) throw ToolsError("a tool call's 'arguments' is not valid JSON", cat + ".function.arguments");
        }
        ojson one = ojson::object();
        one["name"] = f["name"];
        one["arguments"] = args;
        calls.push_back(one);
        native.push_back({f["name"].get<std::string>(), args.dump()});
        last_call = f["name"].get<std::string>();
        if (c.contains("id") && c["id"].is_string()) call_names[c["id"].get<std::string>()] = f["name"].get<std::string>();
      }
      if (!calls.empty() && !harmony && !qwen) {
        ojson env = ojson::object();
        env["tool_calls"] = calls;
        if (!content.empty()) content += '\n';
        content += env.dump();
      }
    }
    out.push_back({role == "developer" ? "system" : role, content});
    if ((harmony || qwen) && role == "assistant") out.back().tool_calls = std::move(native);
    if ((harmony || tpl.think != ChatTemplate::Think::none) && role == "assistant") {
      // the reasoning kvq returned beside the content, given back (harmony's template shows it
      // before a call that no final reply follows yet; Qwen3's in the replies after the last query)
      // (reasoning_content, or vLLM's newer name for it, reasoning: a string there; other servers'
      // reasoning objects are not kvq's to read)
      if (m.contains("reasoning_content") && !m["reasoning_content"].is_null()) {
        if (!m["reasoning_content"].is_string()) throw ToolsError("'reasoning_content' must be a string", at + ".reasoning_content");
        out.back().reasoning = m["reasoning_content"].get<std::string>();
        out.back().reasoning_given = true;
      } else if (m.contains("reasoning") && m["reasoning"].is_string()) {
        out.back().reasoning = m["reasoning"].get<std::string>();
        out.back().reasoning_given = true;
      }
    }
  }
  if (!system_extra.empty()) {
    if (out[0].role == "system") {
      out[0].content += (out[0].content.empty() ? "" : "\n\n") + system_extra;
    } else {
      std::string s = tpl.default_system;
      if (!s.empty()) s += "\n\n";
      out.insert(out.begin(), ChatMessage{"system", s + system_extra});
    }
  }
  return out;
}

std::string tool_call_id(std::mt19937_64& rng) { return call_id(rng); }

ToolReply parse_tool_reply(const std::string& text, bool response_is_string, std::mt19937_64& rng) {
  ToolReply r;
  const ojson doc = ojson::parse(text, nullptr, false);
  // The reply's form is its first key's (as the stream reads it).
  if (!doc.is_discarded() && doc.is_object() && !doc.empty()) {
    if (doc.begin().key() == "tool_calls" && doc["tool_calls"].is_array()) {
      for (const ojson& c : doc["tool_calls"]) {
        if (!c.is_object() || !c.contains("name") || !c["name"].is_string() || !c.contains("arguments")) continue;
        r.calls.push_back({call_id(rng), c["name"].get<std::string>(), c["arguments"].dump()});
      }
      if (!r.calls.empty()) {
        r.complete = true;
        return r;
      }
    } else if (doc.begin().key() == "response") {
      r.complete = true;
      r.has_content = true;
      const ojson& v = doc["response"];
      r.content = response_is_string && v.is_string() ? v.get<std::string>() : v.dump();
      return r;
    }
  }
  r.has_content = true;
  size_t body = 0;
  if (response_lead(text, &body, response_is_string) != Lead::response) {
    r.content = text;
    r.raw = true;
  } else if (response_is_string) r.content = decoded_prefix(std::string_view(text).substr(body));
  else r.content = text.substr(body);  // the response's document so far
  return r;
}

std::string ToolReplyStream::feed(const std::string& piece) {
  text_ += piece;
  if (!on_ || closed_) return "";
  if (body_ == std::string::npos) {
    size_t at = 0;
    const Lead l = response_lead(text_, &at, true);
    if (l == Lead::other) on_ = false;  // tool calls, read whole at the end
    if (l != Lead::response) return "";
    body_ = done_ = at;
  }
  // Only the bytes after those already decoded, which end on a whole character.
  std::string_view rest = std::string_view(text_).substr(done_);
  if (const size_t end = string_end(rest); end != std::string_view::npos) {
    rest = rest.substr(0, end);
    closed_ = true;
  }
  size_t used = 0;
  std::string delta = decode_whole(rest, &used);
  done_ += used;
  out_ += delta;
  return delta;
}

}  // namespace kvq
