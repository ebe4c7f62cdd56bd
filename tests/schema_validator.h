// An independent JSON Schema validator for the keywords the structured-output compiler supports
// (model/json_schema.h), for the tests that check generated documents.
// GCC 12 warns of maybe-uninitialized members inside std::regex's own code at -O2 with the
// sanitizers (a false positive in the library's instantiations).
#pragma once
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>
#include <vector>

namespace kvq::test {

using ojson = nlohmann::ordered_json;

// An independent validator for the keywords the compiler supports, on the parsed document: what
// the generated text must satisfy. Properties must also come in the schema's order (checked on
// the ordered document).
inline size_t code_points(const std::string& s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}
// open: absent additionalProperties allows any other property, as JSON Schema reads it (inside
// allOf, whose schemas kvq merges); otherwise kvq's reading (none where properties are listed).
inline bool validate(const ojson& root, const ojson& s, const ojson& v, bool open = false);
// The fraction digits of a number as written shortest (what a document's text parses back to).
inline int decimal_places(const ojson& v) {
  if (v.is_number_integer()) return 0;
  std::string t = v.dump();
  int exp = 0;
  if (const size_t e = t.find_first_of("eE"); e != std::string::npos) {
    exp = std::stoi(t.substr(e + 1));
    t.resize(e);
  }
  const size_t p = t.find('.');
  const int frac = p == std::string::npos ? 0 : int(t.size() - p - 1);
  return std::max(0, frac - exp);
}
inline bool validate_type(const ojson& root, const ojson& s, const std::string& t, const ojson& v, bool open) {
  if (t == "null") return v.is_null();
  if (t == "boolean") return v.is_boolean();
  if (t == "integer" || t == "number") {
    if (t == "integer" ? !v.is_number_integer() : !v.is_number()) return false;
    const double x = v.get<double>();
    if (s.contains("minimum") && x < s["minimum"].get<double>()) return false;
    if (s.contains("maximum") && x > s["maximum"].get<double>()) return false;
    if (s.contains("exclusiveMinimum") && x <= s["exclusiveMinimum"].get<double>()) return false;
    if (s.contains("exclusiveMaximum") && x >= s["exclusiveMaximum"].get<double>()) return false;
    if (s.contains("multipleOf")) {
      const double m = s["multipleOf"].get<double>();
      if (m == std::floor(m)) {  // an integer: integer multiples
        if (x != std::floor(x) || int64_t(x) % int64_t(m) != 0) return false;
      } else if (decimal_places(v) > decimal_places(s["multipleOf"])) {  // a power of ten below 1: exact in decimal
        return false;
      }
    }
    return true;
  }
  if (t == "string") {
    if (!v.is_string()) return false;
    const size_t n = code_points(v.get<std::string>());
    if (s.contains("minLength") && n < s["minLength"].get<size_t>()) return false;
    if (s.contains("maxLength") && n > s["maxLength"].get<size_t>()) return false;
    if (s.contains("pattern") && !std::regex_search(v.get<std::string>(), std::regex(s["pattern"].get<std::string>())))
      return false;
    if (s.contains("format")) {
      static const std::map<std::string, std::regex> formats = {
          {"date", std::regex(R"(\d{4}-((0[13578]|1[02])-(0[1-9]|[12]\d|3[01])|(0[469]|11)-(0[1-9]|[12]\d|30)|02-(0[1-9]|1\d|2[0-8])))")},
          {"time", std::regex(R"(([01]\d|2[0-3]):[0-5]\d:[0-5]\d(\.\d+)?(Z|[+-]([01]\d|2[0-3]):[0-5]\d))")},
          {"date-time", std::regex(R"(\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])T([01]\d|2[0-3]):[0-5]\d:[0-5]\d(\.\d+)?(Z|[+-]([01]\d|2[0-3]):[0-5]\d))")},
          {"uuid", std::regex(R"([0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12})")},
          {"ipv4", std::regex(R"(((25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d))")}};
      if (!std::regex_match(v.get<std::string>(), formats.at(s["format"].get<std::string>()))) return false;
    }
    return true;
  }
  if (t == "array") {
    if (!v.is_array()) return false;
    if (s.contains("minItems") && v.size() < s["minItems"].get<size_t>()) return false;
    if (s.contains("maxItems") && v.size() > s["maxItems"].get<size_t>()) return false;
    if (s.value("uniqueItems", false))
      for (size_t i = 0; i < v.size(); ++i)
        for (size_t j = i + 1; j < v.size(); ++j)
          if (v[i] == v[j]) return false;
    const ojson* tuple = s.contains("prefixItems") ? &s["prefixItems"]
                         : (s.contains("items") && s["items"].is_array()) ? &s["items"] : nullptr;
    for (size_t i = 0; i < v.size(); ++i) {
      if (tuple && i < tuple->size()) {
        if (!validate(root, (*tuple)[i], v[i])) return false;
      } else if (s.contains("items") && !s["items"].is_array()) {
        if (!validate(root, s["items"], v[i])) return false;
      } else if (tuple && s.contains("items")) {
        return false;  // a draft-7 tuple: nothing past it
      }
    }
    return true;
  }
  // object
  if (!v.is_object()) return false;
  const ojson props = s.value("properties", ojson::object());
  size_t last = 0;
  for (auto it = v.begin(); it != v.end(); ++it) {
    if (s.contains("propertyNames") && !validate(root, s["propertyNames"], ojson(it.key()))) return false;
    bool matched = false;  // by properties or patternProperties
    if (props.contains(it.key())) {
      size_t idx = 0;
      for (auto p = props.begin(); p != props.end(); ++p, ++idx)
        if (p.key() == it.key()) break;
      if (idx < last && !open) return false;  // out of the schema's order (allOf's merged order is the first schema's)
      last = idx;
      if (!validate(root, props[it.key()], it.value())) return false;
      matched = true;
    }
    const ojson patterns = s.value("patternProperties", ojson::object());
    for (const auto& [pattern, sub] : patterns.items())
      if (std::regex_search(it.key(), std::regex(pattern))) {
        if (!validate(root, sub, it.value())) return false;
        matched = true;
      }
    if (!matched) {
      const ojson ap = s.contains("additionalProperties")                                       ? s["additionalProperties"]
                       : !open && (s.contains("properties") || s.contains("patternProperties")) ? ojson(false)
                                                                                                : ojson(true);
      if (ap.is_boolean() ? !ap.get<bool>() : !validate(root, ap, it.value())) return false;
    }
  }
  for (const ojson& r : s.value("required", ojson::array()))
    if (!v.contains(r.get<std::string>())) return false;
  if (s.contains("minProperties") && v.size() < s["minProperties"].get<size_t>()) return false;
  if (s.contains("maxProperties") && v.size() > s["maxProperties"].get<size_t>()) return false;
  return true;
}
inline bool validate(const ojson& root, const ojson& s, const ojson& v, bool open) {
  if (s.is_boolean()) return s.get<bool>();
  if (s.contains("$ref")) return validate(root, root.at(ojson::json_pointer(s["$ref"].get<std::string>().substr(1))), v, open);
  if (s.contains("const")) return v == s["const"];
  if (s.contains("enum")) {
    if (s.contains("pattern") && v.is_string() && !std::regex_search(v.get<std::string>(), std::regex(s["pattern"].get<std::string>())))
      return false;
    for (const ojson& e : s["enum"])
      if (v == e) return true;
    return false;
  }
  for (const char* k : {"anyOf", "oneOf"})
    if (s.contains(k)) {
      for (const ojson& sub : s[k])
        if (validate(root, sub, v, open)) return true;
      return false;
    }
  if (s.contains("allOf")) {
    ojson rest = s;
    rest.erase("allOf");
    for (const ojson& sub : s["allOf"])
      if (!validate(root, sub, v, true)) return false;
    return validate(root, rest, v, true);
  }
  std::vector<std::string> types;
  if (s.contains("type")) {
    if (s["type"].is_string()) types.push_back(s["type"].get<std::string>());
    else
      for (const ojson& t : s["type"]) types.push_back(t.get<std::string>());
  } else if (s.contains("properties") || s.contains("required") || s.contains("additionalProperties") ||
             s.contains("patternProperties") || s.contains("propertyNames")) {
    types = {"object"};
  } else if (s.contains("items") || s.contains("prefixItems") || s.contains("minItems") || s.contains("maxItems")) {
    types = {"array"};
  } else if (s.contains("minLength") || s.contains("maxLength") || s.contains("pattern")) {
    types = {"string"};
  } else {
    return true;
  }
  for (const std::string& t : types)
    if (validate_type(root, s, t, v, open)) return true;
  return false;
}

}  // namespace kvq::test
