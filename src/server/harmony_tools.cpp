#include "server/harmony_tools.h"

#include "model/json_schema.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

// The template's macros, render_tool_namespace and render_typescript_type, written out. Its
// expressions are Jinja's, run by Python: a schema keyword's test is Python's truthiness (an empty
// string, list or object, 0, false and null are false), "x in required" a list's membership, a
// string's substring or an object's key, and {{ value }} / "..." + value / join write a string as
// it is. Where the template would fail or print a Python value, kvq writes this instead:
//  - a function without a description: "// " and the newline (the template's text for an empty
//    one; Jinja fails on the missing field);
//  - a value that is not a string where the template writes one raw (a description, a
//    "// default:" after an enum or a oneOf, an enum's or a type list's members): its JSON text
//    (Python would fail on + or write its repr, e.g. None, True);
//  - "properties" that is not an object: no properties ("object", or "() => any;" for the
//    function); "oneOf", "enum" that is not a list: one variant that is not a schema ("any"), or
//    its JSON text between the quotes (Jinja would iterate it, or fail).
// tojson is Python's json.dumps as Hugging Face's templates call it: ", " and ": " between
// items, no ASCII escaping.

namespace kvq {

namespace {

using ojson = nlohmann::ordered_json;

// A schema's keyword (Jinja's spec.key): nullptr when absent or when the schema is no object.
const ojson* field(const ojson& schema, const char* key) {
  if (!schema.is_object()) return nullptr;
  auto it = schema.find(key);
  return it == schema.end() ? nullptr : &*it;
}

// Python's truthiness of a JSON value (nullptr: undefined, false).
bool truthy(const ojson* v) {
  if (v == nullptr) return false;
  switch (v->type()) {
    case ojson::value_t::null: return false;
    case ojson::value_t::boolean: return v->get<bool>();
    case ojson::value_t::number_integer: return v->get<int64_t>() != 0;
    case ojson::value_t::number_unsigned: return v->get<uint64_t>() != 0;
    case ojson::value_t::number_float: return v->get<double>() != 0.0;
    case ojson::value_t::string: return !v->get_ref<const std::string&>().empty();
    case ojson::value_t::array:
    case ojson::value_t::object: return !v->empty();
    default: return true;
  }
}

bool is(const ojson* v, const char* s) { return v != nullptr && v->is_string() && v->get_ref<const std::string&>() == s; }

// What the template writes for a value it prints or concatenates: a string as it is, else its
// JSON text (json_dumps).
std::string text(const ojson& v) { return v.is_string() ? v.get<std::string>() : json_dumps(v); }

// Python's `name in (required or [])`.
bool listed(const ojson* required, const std::string& name) {
  if (!truthy(required)) return false;
  if (required->is_array()) {
    for (const auto& e : *required)
      if (e.is_string() && e.get_ref<const std::string&>() == name) return true;
    return false;
  }
  if (required->is_object()) return required->contains(name);
  if (required->is_string()) return required->get_ref<const std::string&>().find(name) != std::string::npos;
  return false;
}

// Jinja's |length of a string: its characters (code points), not bytes.
size_t characters(const std::string& s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

std::string join(const ojson& list, const char* sep) {
  std::string out;
  bool first = true;
  for (const auto& e : list) {
    if (!first) out += sep;
    first = false;
    out += text(e);
  }
  return out;
}

// render_typescript_type(spec).
std::string typescript_type(const ojson& spec) {
  const ojson* type = field(spec, "type");
  if (is(type, "array")) {
    std::string out;
    if (const ojson* items = field(spec, "items")) {
      const ojson* item_type = field(*items, "type");
      if (is(item_type, "string")) {
        out = "string[]";
      } else if (is(item_type, "number") || is(item_type, "integer")) {
        out = "number[]";
      } else if (is(item_type, "boolean")) {
        out = "boolean[]";
      } else {
        std::string inner = typescript_type(*items);
        out = inner == "object | object" || characters(inner) > 50 ? "any[]" : inner + "[]";
      }
    } else {
      out = "any[]";
    }
    if (truthy(field(spec, "nullable"))) out += " | null";
    return out;
  }
  if (type != nullptr && type->is_array() && !type->empty()) return join(*type, " | ");

  if (const ojson* one_of = field(spec, "oneOf"); truthy(one_of)) {
    // The template would write "any" for a oneOf with object variants, but the flag it sets
    // inside its loop is gone after it (Jinja's loop scope), so every oneOf is written branch by
    // branch: each one's type, "// " and its description right after it, its default (as JSON)
    // after 20 spaces, and " | " and a line break between branches.
    static const ojson not_a_schema;
    std::vector<const ojson*> variants;
    if (one_of->is_array()) {
      for (const auto& v : *one_of) variants.push_back(&v);
    } else {
      variants.push_back(&not_a_schema);
    }
    std::string out;
    for (size_t i = 0; i < variants.size(); ++i) {
      const ojson& v = *variants[i];
      out += typescript_type(v);
      if (const ojson* d = field(v, "description"); truthy(d)) out += "// " + text(*d);
      if (const ojson* d = field(v, "default")) out += std::string(20, ' ') + "// default: " + json_dumps(*d);
      if (i + 1 < variants.size()) out += " | \n";
    }
    return out;
  }

  if (is(type, "string")) {
    if (const ojson* e = field(spec, "enum"); truthy(e))
      return '"' + (e->is_array() ? join(*e, "\" | \"") : json_dumps(*e)) + '"';
    return truthy(field(spec, "nullable")) ? "string | null" : "string";
  }
  if (is(type, "number") || is(type, "integer")) return "number";
  if (is(type, "boolean")) return "boolean";
  if (is(type, "object")) {
    const ojson* props = field(spec, "properties");
    if (!truthy(props) || !props->is_object()) return "object";
    // Each property's type follows a line break and 16 spaces: the indentation of the template's
    // line that writes it, which leaves them in.
    const ojson* required = field(spec, "required");
    std::string out = "{\n";
    bool first = true;
    for (auto it = props->begin(); it != props->end(); ++it) {
      if (!first) out += ", ";
      first = false;
      out += it.key();
      if (!listed(required, it.key())) out += '?';
      out += ": \n" + std::string(16, ' ') + typescript_type(it.value());
    }
    return out + "}";
  }
  return "any";
}

}  // namespace

std::string harmony_functions_namespace(const std::vector<ToolFunction>& fns) {
  std::string out = "## functions\n\nnamespace functions {\n\n";
  for (const ToolFunction& f : fns) {
    out += "// " + f.description + "\n";
    out += "type " + f.name + " = ";
    const ojson* props = field(f.parameters, "properties");
    if (!truthy(&f.parameters) || !truthy(props) || !props->is_object()) {
      out += "() => any;\n\n";
      continue;
    }
    out += "(_: {\n";
    const ojson* required = field(f.parameters, "required");
    for (auto it = props->begin(); it != props->end(); ++it) {
      const ojson& spec = it.value();
      if (const ojson* d = field(spec, "description"); truthy(d)) out += "// " + text(*d) + "\n";
      out += it.key();
      if (!listed(required, it.key())) out += '?';
      out += ": " + typescript_type(spec);
      if (const ojson* d = field(spec, "default")) {
        // After an enum or a oneOf the default is written as it is (a string without quotes),
        // after a oneOf without the comma; elsewhere as JSON.
        if (truthy(field(spec, "enum")))
          out += ", // default: " + text(*d);
        else if (truthy(field(spec, "oneOf")))
          out += "// default: " + text(*d);
        else
          out += ", // default: " + json_dumps(*d);
      }
      out += ",\n";
    }
    out += "}) => any;\n\n";
  }
  return out + "} // namespace functions";
}

namespace {
std::shared_ptr<const Grammar> call_grammar(const std::vector<ToolFunction>& fns) {
  std::string text = "root ::= ";
  std::vector<std::pair<std::string, nlohmann::ordered_json>> args;
  for (size_t k = 0; k < fns.size(); ++k) {
    // (names are letters, digits, '_' and '-': a GBNF literal as they are)
    text += fmt::format("{}(\"{}\" head args-{})", k ? " | " : "", fns[k].name, k);
    args.emplace_back(fmt::format("args-{}", k), fns[k].parameters);
  }
  text += "\nhead ::= \"<|channel|>commentary\"? (\" \" \"<|constrain|>\"? \"json\")? \"<|message|>\"\n";
  return Grammar::from_gbnf(text, args);
}
}  // namespace

std::shared_ptr<const Grammar> harmony_call_grammar(const std::vector<ToolFunction>& fns) {
  return calls_grammar(fns, call_grammar);
}

std::string harmony_tool_constraint(const ToolSpec& spec, GenParams& params) {
  const std::shared_ptr<const Grammar> call = harmony_call_grammar(spec.callable());
  if (spec.choice != ToolChoice::automatic) {
    params.grammar = call;
    params.json_object = false;
    return kHarmonyCallTrigger;
  }
  params.lazy_grammars.push_back({kHarmonyCallTrigger, call});
  if (params.json_object || params.grammar)
    params.lazy_grammars.push_back({HarmonyReplyStream::kOpenFinal, params.json_object ? Grammar::json_object() : params.grammar});
  params.grammar = nullptr;
  params.json_object = false;
  return "";
}

}  // namespace kvq
