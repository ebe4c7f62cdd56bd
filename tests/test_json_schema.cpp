// Structured output: the JSON Schema compiler, the grammar automaton and the vocabulary mask
// (model/json_schema.h).
// GCC 12 warns of maybe-uninitialized members inside std::regex's own code at -O2 with the
// sanitizers (a false positive in the library's instantiations, which this file's format checks
// make).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <fstream>
#include <nlohmann/json.hpp>
#include <map>
#include <random>
#include <regex>
#include <set>

#include "gguf/gguf.h"
#include "model/json_constraint.h"
#include "model/json_schema.h"
#include "model/tokenizer.h"
#include "grammar_walk.h"
#include "schema_validator.h"
#include "test_models.h"
#include "model/unicode.h"

using namespace kvq;
using ojson = nlohmann::ordered_json;
using kvq::test::validate;

namespace {

std::shared_ptr<const Grammar> compile(const std::string& schema) { return Grammar::from_schema_text(schema); }

// The whole text is a document of the schema.
bool accepts(const std::shared_ptr<const Grammar>& g, const std::string& text) {
  GrammarState s(g);
  return s.feed(text) && s.accepting();
}
// The text is a prefix of some document (every byte fed).
bool prefix(const std::shared_ptr<const Grammar>& g, const std::string& text) {
  GrammarState s(g);
  return s.feed(text);
}

std::string compile_error(const std::string& schema) {
  try {
    compile(schema);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

// Schemas covering every supported keyword, used by the random-walk and mask tests.
const std::vector<std::string>& schemas() {
  static const std::vector<std::string> s = {
      R"({"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
          "email": {"type": "string", "maxLength": 12}}, "required": ["name", "age"]})",
      R"({"type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 4})",
      R"({"type": "object", "properties": {"kind": {"enum": ["cat", "dog", 3, null, {"a": [1]}]},
          "ok": {"type": "boolean"}, "tag": {"const": "x\"y"}}, "required": ["kind", "ok", "tag"]})",
      R"({"$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"},
          "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 3}}, "required": ["v"]}},
          "$ref": "#/$defs/node"})",
      R"({"anyOf": [{"type": "string", "minLength": 2, "maxLength": 3}, {"type": "null"}, {"type": "array",
          "prefixItems": [{"type": "boolean"}, {"type": "string"}], "items": false}]})",
      R"({"type": "object", "properties": {"id": {"type": "integer"}}, "additionalProperties": {"type": "string"}})",
      R"({"type": "object"})",
      R"({"type": ["object", "null"], "properties": {"a": {"type": ["string", "integer"]}, "b": {}}})",
      R"({"type": "object", "properties": {"z": {"type": "string"}, "a": {"type": "string"}, "m": {"type": "number"}},
          "required": ["z", "a", "m"], "title": "ordered", "description": "properties in the written order"})",
      R"({"type": "array", "items": {"type": "array", "items": {"enum": ["a", "b"]}}})",
      R"({"type": "object", "properties": {"n": {"type": "integer", "minimum": -15, "maximum": 230},
          "p": {"type": "integer", "exclusiveMinimum": 0}, "q": {"type": "integer", "minimum": 1000, "maximum": 1004},
          "r": {"type": ["integer", "null"], "exclusiveMaximum": -3}, "m": {"type": "integer", "multipleOf": 7, "minimum": -30,
          "maximum": 100}, "k": {"type": "integer", "multipleOf": 1000}}, "required": ["n", "p", "q", "r", "m", "k"]})",
      R"({"properties": {"name": {"type": "string"}, "na": {"type": "integer"}}, "additionalProperties": {"type": "integer"}})",
      R"({"type": "array", "prefixItems": [{"type": "string", "format": "date"}, {"format": "time"},
          {"type": "string", "format": "date-time"}, {"type": "string", "format": "uuid"},
          {"type": "string", "format": "ipv4"}], "items": false, "minItems": 5})",
      R"({"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-\\d{3,5}$"},
          "note": {"pattern": "a(b|c)*d", "maxLength": 9}, "q": {"type": "string", "pattern": "^[^\"\\\\]*[\"\\\\]\\n?$"},
          "pick": {"enum": ["ab", "cd", "ax", 5], "pattern": "^a"}, "any": {"type": "string", "pattern": "^x"}},
          "required": ["code", "note", "q", "pick", "any"]})",
      R"({"type": "object", "properties": {"p": {"type": "number", "minimum": 0, "maximum": 1},
          "t": {"type": "number", "exclusiveMinimum": -2.5, "maximum": 3.75}, "u": {"type": ["number", "null"],
          "exclusiveMaximum": -0.25}, "v": {"type": "number", "minimum": 1e-3, "exclusiveMaximum": 2e-3}},
          "required": ["p", "t", "u", "v"]})",
      R"({"type": "object", "properties": {"price": {"type": "number", "multipleOf": 0.01, "minimum": 0, "maximum": 1000},
          "step": {"type": "number", "multipleOf": 0.1, "exclusiveMinimum": -1.25}, "five": {"type": "number", "multipleOf": 5,
          "maximum": 12.5}, "milli": {"type": "number", "multipleOf": 0.001}}, "required": ["price", "step", "five", "milli"]})",
      R"({"$defs": {"Tag": {"enum": ["a", "b", "c", "d", "e", "f"]}}, "type": "object", "properties": {
          "tags": {"type": "array", "items": {"$ref": "#/$defs/Tag"}, "uniqueItems": true},
          "two": {"type": "array", "items": {"$ref": "#/$defs/Tag"}, "uniqueItems": true, "minItems": 2, "maxItems": 3},
          "flags": {"type": "array", "items": {"type": "boolean"}, "uniqueItems": true}}, "required": ["tags", "two"]})",
      R"({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string", "maxLength": 3},
          "c": {"type": "boolean"}, "d": {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 1,
          "maxProperties": 2}}, "minProperties": 2, "maxProperties": 3})",
      R"({"type": "object", "patternProperties": {"^x_[a-z]+$": {"type": "integer"}, "^y": {"type": "boolean"}},
          "additionalProperties": false})",
      R"({"properties": {"name": {"type": "string"}}, "patternProperties": {"^n[0-9]$": {"type": "integer"},
          "^[a-z][0-9]": {"type": "null"}, "q\"": {"const": 1}}, "additionalProperties": {"type": "boolean"}})",
      R"({"type": "object", "properties": {"ab": {"type": "string"}, "Bad": {"type": "string"}},
          "propertyNames": {"pattern": "^[a-z]{1,3}$"}, "additionalProperties": {"type": "integer"}})",
      R"({"$defs": {"Color": {"enum": ["red", "green", "blue"], "type": "string"}}, "type": "object",
          "additionalProperties": {"type": "integer"}, "propertyNames": {"$ref": "#/$defs/Color"}})",
      R"({"type": "object", "propertyNames": {"maxLength": 2, "minLength": 1}})",
      R"({"type": "object", "patternProperties": {"^k": {"type": "integer"}}, "minProperties": 1, "maxProperties": 3})",
      R"({"$defs": {"Base": {"type": "object", "properties": {"id": {"type": "integer"}}, "required": ["id"]}},
          "allOf": [{"$ref": "#/$defs/Base"}, {"type": "object", "properties": {"name": {"type": "string", "maxLength": 5}},
          "required": ["name"]}]})",
      R"({"type": "object", "properties": {"kind": {"enum": ["a", "b"]}}, "required": ["kind"], "allOf": [{"anyOf": [
          {"properties": {"kind": {"const": "a"}, "x": {"type": "integer"}}, "required": ["x"]},
          {"properties": {"kind": {"const": "b"}, "y": {"type": "boolean"}}}]}]})",
      R"({"allOf": [{"type": "number", "minimum": 0}, {"type": "integer", "maximum": 50, "multipleOf": 5}, {"multipleOf": 3}]})",
      R"({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
          "additionalProperties": false}, {"properties": {"b": {"maxLength": 2}, "c": {"type": "null"}}}]})",
      R"({"$defs": {"N": {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {"type": "array",
          "items": {"$ref": "#/$defs/N"}, "maxItems": 2}}, "required": ["v"]}},
          "allOf": [{"$ref": "#/$defs/N"}, {"properties": {"v": {"minimum": 0, "maximum": 9}}}]})",
  };
  return s;
}

}  // namespace

TEST(JsonSchema, RefusesWhatItCannotGenerate) {
  EXPECT_NE(compile_error(R"j({"type": "string", "pattern": "(?=a)"})j").find("#': pattern \"(?=a)\": lookahead"), std::string::npos);
  EXPECT_NE(compile_error(R"({"properties": {"p": {"pattern": 3}}})").find("#/properties/p': 'pattern' must be a string"),
            std::string::npos);
  EXPECT_NE(compile_error(R"({"type": "string", "format": "date", "pattern": "^2"})").find("minLength/maxLength/pattern"),
            std::string::npos);
  EXPECT_NE(compile_error(R"({"enum": ["ab", "cd"], "pattern": "^x"})").find("no value of 'enum'"), std::string::npos);
  EXPECT_NE(compile_error(R"({"type": "string", "pattern": "^abc$", "maxLength": 2})").find("within the length bounds"),
            std::string::npos);
  EXPECT_EQ(compile_error(R"({"type": "string", "format": "email"})"), "");  // an annotation: a plain string
  EXPECT_EQ(compile_error(R"({"type": "number", "minimum": 0})"), "");
  EXPECT_NE(compile_error(R"({"type": "number", "minimum": 2, "maximum": 1.5})").find("no number lies within"), std::string::npos);
  EXPECT_NE(compile_error(R"({"type": "number", "minimum": 1, "exclusiveMaximum": 1})").find("no number lies within"),
            std::string::npos);
  EXPECT_NE(compile_error(R"({"minimum": 0})").find("without \"type\": \"integer\""), std::string::npos);
  EXPECT_NE(compile_error(R"({"type": "integer", "minimum": 3, "exclusiveMaximum": 4.0, "maximum": 2})").find("lies within"),
            std::string::npos);
  EXPECT_NE(compile_error(R"({"type": "integer", "multipleOf": 0.5})").find("#': 'multipleOf' other than an integer"), std::string::npos);
  EXPECT_NE(compile_error(R"({"type": "number", "multipleOf": 0.25})").find("a power of ten below 1"), std::string::npos);
  EXPECT_NE(compile_error(R"({"type": "number", "multipleOf": 1.5})").find("a power of ten below 1"), std::string::npos);
  EXPECT_NE(compile_error(R"({"type": "number", "multipleOf": 1e-17})").find("a power of ten below 1"), std::string::npos);
  EXPECT_NE(compile_error(R"({"type": "number", "multipleOf": -0.1})").find("must be a number > 0"), std::string::npos);
  EXPECT_NE(compile_error(R"({"type": "integer", "multipleOf": 0})").find("must be a number > 0"), std::string::npos);
  EXPECT_NE(compile_error(R"({"type": "integer", "multipleOf": 7, "minimum": 8, "maximum": 13})").find("no multiple"),
            std::string::npos);
  EXPECT_EQ(compile_error(R"({"type": "number", "exclusiveMinimum": 0, "maximum": 1})"), "");
  EXPECT_NE(compile_error(R"({"properties": {"a": {"not": {}}}})").find("#/properties/a': 'not'"), std::string::npos);
  EXPECT_NE(compile_error(R"({"$ref": "#/$defs/missing"})").find("points at nothing"), std::string::npos);
  EXPECT_NE(compile_error(R"({"$ref": "https://example.com/s.json"})").find("only references into this schema"), std::string::npos);
  EXPECT_NE(compile_error(R"({"$ref": "#"})").find("no finite document"), std::string::npos);
  EXPECT_NE(compile_error(R"({"properties": {"c": {"$ref": "#"}}, "required": ["c"]})").find("no finite document"),
            std::string::npos);
  EXPECT_EQ(compile_error(R"({"properties": {"c": {"$ref": "#"}}})"), "");  // optional: ends
  EXPECT_EQ(compile_error(R"({"type": "array", "uniqueItems": false, "minItems": 0})"), "");
  EXPECT_NE(compile_error(R"({"type": "array", "uniqueItems": true})").find("'uniqueItems' is supported on arrays whose"), std::string::npos);
  EXPECT_NE(compile_error(R"({"type": "array", "items": {"type": "string"}, "uniqueItems": true})").find("not a grammar"),
            std::string::npos);
  EXPECT_NE(compile_error(R"({"type": "array", "items": {"enum": ["a", "b"]}, "uniqueItems": true, "minItems": 3})").find("distinct values"),
            std::string::npos);
  EXPECT_NE(compile_error(R"({"enum": [1], "properties": {}})").find("beside 'properties'"), std::string::npos);
  {
    ojson deep = 1;
    for (int k = 0; k < 100; ++k) deep = ojson::array({deep});
    EXPECT_NE(compile_error(ojson{{"const", deep}}.dump()).find("nested deeper than 64"), std::string::npos);
  }
  {
    ojson any_of = {{"anyOf", ojson::array()}};
    for (int k = 0; k < 1100; ++k) any_of["anyOf"].push_back({{"type", "string"}, {"maxLength", k + 1}});
    EXPECT_NE(compile_error(any_of.dump()).find("more than kvq tracks"), std::string::npos);
  }
  EXPECT_NE(compile_error(R"({"anyOf": [{"$ref": "#"}, {"type": "null"}]})").find("refers to itself"), std::string::npos);
  EXPECT_NE(compile_error("false").find("accepts no value"), std::string::npos);
  EXPECT_NE(compile_error(R"({"type": "strng"})").find("unknown type 'strng'"), std::string::npos);
  EXPECT_NE(compile_error(R"({"type": "string", "minLength": 5, "maxLength": 2})").find("larger than"), std::string::npos);
  EXPECT_NE(compile_error(R"({"type": "array", "minItems": -1})").find("non-negative integer"), std::string::npos);
  EXPECT_NE(compile_error(R"({"properties": {"a": {}}, "required": ["b"]})").find("'b' is not in 'properties'"), std::string::npos);
  EXPECT_EQ(compile_error(R"({"allOf": [{"type": "string"}, {"maxLength": 3}]})"), "");  // merged
  EXPECT_NE(compile_error(R"({"anyOf": [{"type": "string"}], "maxLength": 3})").find("beside"), std::string::npos);
  EXPECT_NE(compile_error(R"({"type": "integer", "enum": ["a"]})").find("no value of 'enum'"), std::string::npos);
  EXPECT_NE(compile_error(R"({"type": "array", "prefixItems": [{}], "items": false, "minItems": 2})").find("no array fits"),
            std::string::npos);
  EXPECT_NE(compile_error("{\"type\": ").find("not JSON"), std::string::npos);
  EXPECT_NE(compile_error("[1]").find("must be an object or a boolean"), std::string::npos);
  EXPECT_NE(compile_error(R"({"type": "array", "maxItems": 100000})").find("above 10000"), std::string::npos);
  // Annotations are no constraint: ignored.
  EXPECT_EQ(compile_error(R"({"title": "T", "description": "d", "default": 1, "examples": [1], "$schema": "x",
                             "type": "integer"})"),
            "");
}

// Numbers within bounds, exact in decimal: every number of a grid of integer parts and fractions
// (trailing zeros, just above and below each bound) is accepted exactly when it lies within.
TEST(JsonSchema, NumberBoundsExactInDecimal) {
  // multipleOf on numbers: by a power of ten below 1, the numbers of at most that many fraction
  // digits (trailing zeros included), within the bounds beside it; by an integer, its integer
  // multiples, written as integers.
  struct Case {
    const char* schema;
    double lo, hi;
    bool lo_ex, hi_ex;
    int digits = 16;  // fraction digits at most; -1: integer multiples of `step`
    double step = 0;
  };
  const std::vector<Case> cases = {
      {R"({"type": "number", "minimum": 0, "maximum": 1})", 0, 1, false, false},
      {R"({"type": "number", "minimum": -2.5, "maximum": 3.75})", -2.5, 3.75, false, false},
      {R"({"type": "number", "exclusiveMinimum": 0.1, "maximum": 0.2})", 0.1, 0.2, true, false},
      {R"({"type": "number", "minimum": -1, "exclusiveMaximum": -0.25})", -1, -0.25, false, true},
      {R"({"type": "number", "exclusiveMinimum": 0})", 0, 1e300, true, false},
      {R"({"type": "number", "maximum": -7, "minimum": -8.09})", -8.09, -7, false, false},
      {R"({"type": "number", "minimum": 2.5, "maximum": 2.75, "exclusiveMaximum": true})", 2.5, 2.75, false, true},
      {R"({"type": "number", "multipleOf": 0.01})", -1e300, 1e300, false, false, 2},
      {R"({"type": "number", "multipleOf": 0.1, "minimum": -2.5, "maximum": 3.75})", -2.5, 3.75, false, false, 1},
      {R"({"type": "number", "multipleOf": 0.001, "exclusiveMinimum": 0.2, "maximum": 1})", 0.2, 1, true, false, 3},
      {R"({"type": "number", "multipleOf": 0.01, "exclusiveMinimum": 0, "exclusiveMaximum": 0.25})", 0, 0.25, true, true, 2},
      {R"({"type": "number", "multipleOf": 5, "minimum": -7.5, "maximum": 12.5})", -7.5, 12.5, false, false, -1, 5},
      {R"({"type": "number", "multipleOf": 1.0})", -1e300, 1e300, false, false, -1, 1},
  };
  std::vector<std::string> texts;
  for (const char* i : {"0", "1", "2", "3", "4", "5", "7", "8", "10", "15", "-1", "-2", "-3", "-5", "-7", "-8", "-10"})
    for (const char* f : {"", ".0", ".00", ".000", ".1", ".09", ".1000", ".10001", ".2", ".20", ".200", ".2000", ".2001", ".20001",
                          ".25", ".250", ".251", ".24999", ".2501", ".5", ".75", ".7500", ".75001", ".05", ".001", ".009", ".9",
                          ".99", ".990", ".9901", ".00001"})
      texts.push_back(std::string(i) + f);
  int yes = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.schema);
    const auto g = compile(c.schema);
    for (const std::string& t : texts) {
      const double v = std::strtod(t.c_str(), nullptr);
      const size_t point = t.find('.');
      const int frac = point == std::string::npos ? 0 : int(t.size() - point - 1);
      const bool in = (c.lo_ex ? v > c.lo : v >= c.lo) && (c.hi_ex ? v < c.hi : v <= c.hi);
      const bool step = c.digits >= 0 ? frac <= c.digits : frac == 0 && std::fmod(v, c.step) == 0;
      ASSERT_EQ(accepts(g, t), in && step) << t;
      yes += in && step;
    }
    EXPECT_FALSE(accepts(g, "1e0"));  // no exponent
  }
  EXPECT_GT(yes, 500);
}

// uniqueItems over finitely many values: the items are a subsequence of the values in their written
// order (each at most once), within minItems / maxItems; enums reached through $ref (pydantic's
// sets of an Enum), booleans, duplicates in the enum and values its type leaves out.
TEST(JsonSchema, UniqueItemsOverFiniteValues) {
  const auto g = compile(R"({"$defs": {"Color": {"type": "string", "enum": ["red", "green", "blue", "green", 7]}},
      "type": "array", "items": {"$ref": "#/$defs/Color"}, "uniqueItems": true, "maxItems": 2})");
  // every array of at most 2 items over red, green, blue, 7: accepted exactly when in order, distinct
  const std::vector<std::string> vals = {"\"red\"", "\"green\"", "\"blue\"", "7"};
  int yes = 0;
  for (size_t a = 0; a <= vals.size(); ++a)
    for (size_t b = 0; b <= vals.size(); ++b) {
      std::string t = "[";
      if (a < vals.size()) t += vals[a];
      if (a < vals.size() && b < vals.size()) t += ", " + vals[b];
      t += "]";
      if (a == vals.size() && b < vals.size()) continue;
      const bool want = (a == vals.size()) || (a < 3 && (b == vals.size() || (b < 3 && b > a)));
      EXPECT_EQ(accepts(g, t), want) << t;
      yes += want;
    }
  EXPECT_EQ(yes, 1 + 3 + 3);
  EXPECT_FALSE(prefix(g, R"(["red", "green", )"));  // maxItems
  const auto b = compile(R"({"type": "array", "items": {"type": "boolean"}, "uniqueItems": true, "minItems": 1})");
  EXPECT_TRUE(accepts(b, "[false, true]"));
  EXPECT_TRUE(accepts(b, "[true]"));
  EXPECT_FALSE(accepts(b, "[]"));
  EXPECT_FALSE(prefix(b, "[true, true"));
  EXPECT_FALSE(prefix(b, "[true, false"));
  const auto o = compile(R"({"type": "array", "items": {"enum": [{"a": 1}, [1, 2], null]}, "uniqueItems": true})");
  EXPECT_TRUE(accepts(o, R"([{"a": 1}, [1, 2], null])"));
  EXPECT_FALSE(prefix(o, R"([null, {)"));
}

// minProperties / maxProperties: every object over the listed properties (in order) and extra
// ones, accepted exactly when its count is within the bounds and its required properties are there.
// patternProperties and propertyNames: a name takes the schema of the patterns it matches, or
// additionalProperties' when it matches none; a name two patterns of different schemas match is
// not written; propertyNames rules every name (the listed ones too); finitely many names (an enum)
// are optional properties, each written once, in the enum's order.
TEST(JsonSchema, PatternPropertiesAndPropertyNames) {
  const auto pp = compile(R"({"type": "object", "patternProperties": {"^x_[a-z]+$": {"type": "integer"},
      "^y": {"type": "boolean"}}})");
  EXPECT_TRUE(accepts(pp, R"({"x_ab": 1, "yes": true, "y": false})"));
  EXPECT_TRUE(accepts(pp, R"({})"));
  EXPECT_FALSE(accepts(pp, R"({"x_ab": true})"));
  EXPECT_FALSE(accepts(pp, R"({"x_1": 1})"));
  EXPECT_FALSE(accepts(pp, R"({"z": 1})"));  // additionalProperties absent: none (kvq's reading)
  EXPECT_FALSE(accepts(pp, R"({"y": 1})"));
  const auto mixed = compile(R"({"properties": {"name": {"type": "string"}}, "patternProperties": {"^n[0-9]$": {"type":
      "integer"}, "^.[0-9]": {"type": "null"}}, "additionalProperties": {"type": "boolean"}, "required": ["name"]})");
  EXPECT_TRUE(accepts(mixed, R"({"name": "a", "m5": null, "zz": true, "n": false})"));
  EXPECT_FALSE(accepts(mixed, R"({"name": "a", "n5": 3})"));     // both patterns: not written
  EXPECT_FALSE(accepts(mixed, R"({"name": "a", "n5": null})"));
  EXPECT_FALSE(accepts(mixed, R"({"name": "a", "m5": true})"));  // matches a pattern: not additionalProperties'
  EXPECT_FALSE(accepts(mixed, R"({"name": "a", "zz": null})"));
  EXPECT_FALSE(accepts(mixed, R"({"name": "a", "name": true})"));  // a listed name is not an extra one
  EXPECT_FALSE(accepts(mixed, R"({"name": "a", "name": true})"));  // one encoding per character
  const auto same = compile(R"({"type": "object", "patternProperties": {"^a": {"type": "integer"}, "b$": {"type": "integer"}}})");
  EXPECT_TRUE(accepts(same, R"({"ab": 1, "a": 2, "b": 3})"));  // patterns of one schema may overlap

  const auto names = compile(R"({"type": "object", "properties": {"ab": {"type": "string"}, "Bad": {"type": "string"}},
      "propertyNames": {"pattern": "^[a-z]{1,3}$"}, "additionalProperties": {"type": "integer"}})");
  EXPECT_TRUE(accepts(names, R"({"ab": "x", "c": 1, "xyz": 2})"));
  EXPECT_FALSE(accepts(names, R"({"Bad": "x"})"));  // an optional property propertyNames rules out
  EXPECT_FALSE(accepts(names, R"({"abcd": 1})"));
  EXPECT_FALSE(accepts(names, R"({"C": 1})"));
  EXPECT_FALSE(accepts(names, R"({"ab": 1})"));
  const auto len = compile(R"({"type": "object", "propertyNames": {"maxLength": 2, "minLength": 1}})");
  EXPECT_TRUE(accepts(len, R"({"é": [1], "ab": {"x": null}})"));
  EXPECT_FALSE(accepts(len, R"({"": 1})"));
  EXPECT_FALSE(accepts(len, R"({"abc": 1})"));

  const auto keyed = compile(R"({"$defs": {"Color": {"enum": ["red", "green", "blue", 7], "type": "string"}},
      "type": "object", "additionalProperties": {"type": "integer"}, "propertyNames": {"$ref": "#/$defs/Color"}})");
  EXPECT_TRUE(accepts(keyed, R"({"red": 1, "blue": 2})"));
  EXPECT_TRUE(accepts(keyed, R"({})"));
  EXPECT_FALSE(accepts(keyed, R"({"red": 1, "red": 2})"));  // each name once
  EXPECT_FALSE(accepts(keyed, R"({"blue": 1, "red": 2})"));  // in the enum's order
  EXPECT_FALSE(accepts(keyed, R"({"pink": 1})"));
  EXPECT_FALSE(accepts(keyed, R"({"red": "x"})"));
  const auto keyed_pp = compile(R"({"type": "object", "propertyNames": {"enum": ["a1", "b", "c2"]},
      "patternProperties": {"[0-9]$": {"type": "null"}}})");
  EXPECT_TRUE(accepts(keyed_pp, R"({"a1": null, "c2": null})"));
  EXPECT_FALSE(accepts(keyed_pp, R"({"b": null})"));  // no pattern, no additionalProperties
  const auto none = compile(R"({"type": "object", "properties": {"a": {}}, "propertyNames": false})");
  EXPECT_TRUE(accepts(none, "{}"));
  EXPECT_FALSE(accepts(none, R"({"a": 1})"));

  EXPECT_NE(compile_error(R"({"properties": {"Ab": {}}, "required": ["Ab"], "propertyNames": {"pattern": "^[a-z]+$"}})")
                .find("required property 'Ab' is not allowed by 'propertyNames'"),
            std::string::npos);
  EXPECT_NE(compile_error(R"({"properties": {"ab": {"type": "string"}}, "patternProperties": {"^a": {"type": "integer"}}})")
                .find("property 'ab' is in 'properties' and matches 'patternProperties' '^a'"),
            std::string::npos);
  EXPECT_EQ(compile_error(R"({"properties": {"ab": {"type": "string"}}, "patternProperties": {"^a": {"description": "x"}}})"), "");
  EXPECT_NE(compile_error(R"({"type": "object", "propertyNames": {"type": "string", "not": {"const": "x"}}})")
                .find("#/propertyNames': 'not' in 'propertyNames' is not supported"),
            std::string::npos);
  EXPECT_NE(compile_error(R"({"type": "object", "propertyNames": {"format": "uuid"}})").find("give a 'pattern'"), std::string::npos);
  // A propertyNames no name meets leaves no property (JSON Schema: {} validates).
  for (const char* no_names : {R"({"type": "object", "propertyNames": {"type": "integer"}})",
                               R"({"type": "object", "propertyNames": {"pattern": "^a$", "maxLength": 0}})",
                               R"({"type": "object", "propertyNames": {"minLength": 3, "maxLength": 2}})"}) {
    const auto g = compile(no_names);
    EXPECT_TRUE(accepts(g, "{}")) << no_names;
    EXPECT_FALSE(prefix(g, R"({")")) << no_names;
  }
  EXPECT_NE(compile_error(R"({"type": "object", "propertyNames": {"enum": []}})").find("'enum' must be a non-empty list"),
            std::string::npos);
  EXPECT_NE(compile_error(R"({"type": "object", "propertyNames": {"enum": ["a"], "const": "b"}})").find("'const' is not one of"),
            std::string::npos);
  EXPECT_NE(compile_error(R"({"type": "object", "propertyNames": {"allOf": [{"$ref": "#/$defs/nope"}]}})")
                .find("$ref '#/$defs/nope' points at nothing"),
            std::string::npos);
  EXPECT_NE(compile_error(R"({"type": "object", "propertyNames": {"maxLength": 100001}})").find("#/propertyNames': length bounds"),
            std::string::npos);
  EXPECT_EQ(compile_error(R"({"$defs": {"K": {"enum": ["a"]}}, "type": "object", "propertyNames": {"$ref": "#/$defs/K",
      "description": "keys"}})"),
            "");
  EXPECT_NE(compile_error(R"({"$defs": {"K": {"$ref": "#/$defs/K"}}, "type": "object", "propertyNames": {"$ref": "#/$defs/K"}})")
                .find("more than 64 $refs"),
            std::string::npos);

  // Names a pattern decides by what it does not match are printable ASCII, where ECMA-262's
  // reading (kvq's) and Python's agree: Python's `$` also matches before a final newline, its `.`
  // takes \r, its \w non-ASCII letters.
  const auto rest = compile(R"({"patternProperties": {"^a$": {"type": "integer"}, "^\\w+$": {"type": "boolean"}},
      "additionalProperties": {"type": "string"}})");
  EXPECT_TRUE(accepts(rest, R"({"b": true, "-": "x"})"));
  EXPECT_FALSE(accepts(rest, R"({"a": 1})"));  // both patterns: integer and boolean at once
  EXPECT_FALSE(accepts(rest, R"({"a\n": "x"})"));
  EXPECT_FALSE(accepts(rest, R"({"é": "x"})"));
  EXPECT_FALSE(accepts(rest, R"({"é": true})"));
  EXPECT_NE(compile_error(R"({"properties": {"é": {"type": "integer"}}, "patternProperties": {"^\\w$": {"type": "string"}}})")
                .find("has characters outside printable ASCII beside 'patternProperties'"),
            std::string::npos);
  const auto enum_nl = compile(R"({"propertyNames": {"enum": ["a\n", "b"]}, "patternProperties": {"^a$": {"type": "integer"}},
      "additionalProperties": {"type": "boolean"}})");
  EXPECT_FALSE(accepts(enum_nl, R"({"a\n": false})"));
  EXPECT_TRUE(accepts(enum_nl, R"({"b": false})"));
  // A pattern whose schema is false: names it matches are not written.
  const auto forbid = compile(R"({"type": "object", "properties": {"x1": {}, "a": {}}, "patternProperties": {"^x": false},
      "additionalProperties": {"type": "integer"}})");
  EXPECT_TRUE(accepts(forbid, R"({"a": 1, "b": 2})"));
  EXPECT_FALSE(accepts(forbid, R"({"x1": 1})"));
  EXPECT_FALSE(accepts(forbid, R"({"xa": 1})"));
  EXPECT_NE(compile_error(R"({"properties": {"x1": {}}, "required": ["x1"], "patternProperties": {"^x": false}})")
                .find("whose schema is false"),
            std::string::npos);
  // Other properties' names may repeat: they count once toward minProperties.
  EXPECT_NE(compile_error(R"({"type": "object", "patternProperties": {"^(a|b)$": {"type": "integer"}}, "minProperties": 3})")
                .find("'minProperties' beyond the listed properties and one other"),
            std::string::npos);
  const auto one_more = compile(R"({"properties": {"a": {}}, "additionalProperties": true, "minProperties": 2})");
  EXPECT_TRUE(accepts(one_more, R"({"a": 1, "x": 2})"));
  EXPECT_TRUE(accepts(one_more, R"({"a": 1, "x": 2, "y": 3})"));
  EXPECT_FALSE(accepts(one_more, R"({"x": 1, "y": 2})"));
  EXPECT_FALSE(accepts(one_more, R"({"a": 1})"));
  std::string many = R"({"type": "object", "patternProperties": {)";
  for (int i = 0; i < 65; ++i) many += (i ? ", " : "") + std::string("\"^k") + std::to_string(i) + "$\": {}";
  EXPECT_NE(compile_error(many + "}}").find("more than 64 patterns"), std::string::npos);
  EXPECT_NE(compile_error(R"j({"type": "object", "patternProperties": {"(?=x)": {}}})j").find("#/patternProperties/(?=x)': pattern"),
            std::string::npos);
  EXPECT_NE(compile_error(R"({"type": "object", "patternProperties": []})").find("'patternProperties' must be an object"),
            std::string::npos);
}

// allOf: its schemas merged (types intersected, bounds tightened, enum values intersected, object
// properties united as JSON Schema reads them, anyOf distributed); what no value fits is an error,
// or a branch / optional property left out.
TEST(JsonSchema, AllOfMerges) {
  const auto nums = compile(R"({"allOf": [{"type": "number", "minimum": 0}, {"type": "integer", "maximum": 50,
      "multipleOf": 5}, {"multipleOf": 3}]})");
  for (const char* ok : {"0", "15", "30", "45"}) EXPECT_TRUE(accepts(nums, ok)) << ok;
  for (const char* bad : {"5", "60", "-15", "1.5", "\"a\""}) EXPECT_FALSE(accepts(nums, bad)) << bad;
  const auto obj = compile(R"({"$defs": {"Base": {"type": "object", "properties": {"id": {"type": "integer"}},
      "required": ["id"]}}, "allOf": [{"$ref": "#/$defs/Base"}, {"properties": {"name": {"type": "string"}},
      "required": ["name"]}]})");
  EXPECT_TRUE(accepts(obj, R"({"id": 1, "name": "x"})"));
  EXPECT_FALSE(accepts(obj, R"({"id": 1})"));
  EXPECT_FALSE(accepts(obj, R"({"name": "x"})"));
  const auto closed = compile(R"({"allOf": [{"properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
      "additionalProperties": false}, {"properties": {"b": {"maxLength": 2}, "c": {"type": "null"}}}]})");
  EXPECT_TRUE(accepts(closed, R"({"a": 1, "b": "xy"})"));
  EXPECT_FALSE(accepts(closed, R"({"b": "xyz"})"));
  EXPECT_FALSE(accepts(closed, R"({"c": null})"));  // ruled out by the first schema's additionalProperties
  const auto extra = compile(R"({"allOf": [{"properties": {"a": {}}, "additionalProperties": {"type": "integer"}},
      {"properties": {"b": {"type": "number"}}, "additionalProperties": {"type": "number", "minimum": 5}}]})");
  EXPECT_TRUE(accepts(extra, R"({"a": 7, "b": 6, "z": 9})"));
  EXPECT_TRUE(accepts(extra, R"({"a": 5.5})"));
  EXPECT_FALSE(accepts(extra, R"({"a": 3})"));  // the second's additionalProperties: a number >= 5
  EXPECT_FALSE(accepts(extra, R"({"b": 5.5})"));  // the first's: an integer
  EXPECT_FALSE(accepts(extra, R"({"z": 4})"));
  const auto tagged = compile(R"({"type": "object", "properties": {"kind": {"enum": ["a", "b"]}}, "required": ["kind"],
      "allOf": [{"oneOf": [{"properties": {"kind": {"const": "a"}, "x": {"type": "integer"}}, "required": ["x"]},
      {"properties": {"kind": {"const": "b"}, "y": {"type": "boolean"}}}]}]})");
  EXPECT_TRUE(accepts(tagged, R"({"kind": "a", "x": 1})"));
  EXPECT_TRUE(accepts(tagged, R"({"kind": "b", "y": true})"));
  EXPECT_TRUE(accepts(tagged, R"({"kind": "b"})"));
  EXPECT_FALSE(accepts(tagged, R"({"kind": "a"})"));
  EXPECT_FALSE(accepts(tagged, R"({"kind": "b", "x": 1})"));
  const auto branch = compile(R"({"allOf": [{"type": "string"}, {"anyOf": [{"type": "null"}, {"maxLength": 2}]}]})");
  EXPECT_TRUE(accepts(branch, R"("ab")"));
  EXPECT_FALSE(accepts(branch, "null"));
  EXPECT_FALSE(accepts(branch, R"("abc")"));
  const auto optional = compile(R"({"allOf": [{"properties": {"a": {"type": "string"}, "b": {}}},
      {"properties": {"a": {"type": "integer"}}}]})");
  EXPECT_TRUE(accepts(optional, R"({"b": 1})"));
  EXPECT_FALSE(accepts(optional, R"({"a": 1})"));
  EXPECT_FALSE(accepts(optional, R"({"a": "x"})"));
  const auto recursive = compile(R"({"$defs": {"T": {"allOf": [{"type": "object", "properties": {"k": {"type": "array",
      "items": {"$ref": "#/$defs/T"}, "maxItems": 2}}}, {"required": ["k"]}]}}, "$ref": "#/$defs/T"})");
  EXPECT_TRUE(accepts(recursive, R"({"k": [{"k": []}, {"k": [{"k": []}]}]})"));
  EXPECT_FALSE(accepts(recursive, R"({"k": [{}]})"));

  // Bounds and enum values compared exactly (2^53 + 1 is no double).
  const auto big = compile(R"({"allOf": [{"type": "integer", "minimum": 9007199254740992, "maximum": 9007199254740999},
      {"minimum": 9007199254740993}]})");
  EXPECT_FALSE(accepts(big, "9007199254740992"));
  EXPECT_TRUE(accepts(big, "9007199254740993"));
  EXPECT_NE(compile_error(R"({"allOf": [{"enum": [9007199254740993]}, {"enum": [9007199254740992.0]}]})").find("none in common"),
            std::string::npos);
  // A recursive property both schemas list closes (OpenAPI's subclass that redeclares it).
  const auto derived = compile(R"({"$defs": {"Base": {"type": "object", "properties": {"next": {"$ref": "#/$defs/Derived"},
      "id": {"type": "integer"}}}, "Derived": {"allOf": [{"$ref": "#/$defs/Base"}, {"type": "object", "properties": {
      "next": {"$ref": "#/$defs/Derived"}, "name": {"type": "string"}}}]}}, "$ref": "#/$defs/Derived"})");
  EXPECT_TRUE(accepts(derived, R"({"next": {"next": {"name": "x"}, "id": 1}, "id": 2})"));
  EXPECT_FALSE(accepts(derived, R"({"next": {"id": "x"}})"));
  const auto twice = compile(R"({"type": "object", "properties": {"x": {"allOf": [{"$ref": "#"}, {"$ref": "#"}]}}})");
  EXPECT_TRUE(accepts(twice, R"({"x": {"x": {}}})"));
  // Branches, and optional properties, that no value fits are left out, whatever the conflict.
  const auto range = compile(R"({"allOf": [{"type": "integer", "minimum": 5}, {"anyOf": [{"maximum": 3}, {"maximum": 10}]}]})");
  EXPECT_TRUE(accepts(range, "7"));
  EXPECT_FALSE(accepts(range, "3"));
  EXPECT_FALSE(accepts(range, "11"));
  const auto consts = compile(R"({"allOf": [{"type": "string"}, {"anyOf": [{"const": 1}, {"const": "x"}]}]})");
  EXPECT_TRUE(accepts(consts, R"("x")"));
  EXPECT_FALSE(accepts(consts, "1"));
  const auto dropped = compile(R"({"properties": {"p": {"allOf": [{"type": "string"}, {"oneOf": [{"type": "integer"},
      {"type": "null"}]}]}, "q": {"type": "integer"}}})");
  EXPECT_TRUE(accepts(dropped, R"({"q": 1})"));
  EXPECT_FALSE(accepts(dropped, R"({"p": "x"})"));
  EXPECT_FALSE(accepts(dropped, R"({"p": null})"));
  EXPECT_NE(compile_error(R"({"allOf": [{"const": 1, "enum": [2, 3]}, {"type": "integer"}]})").find("const is not one of its enum"),
            std::string::npos);
  const auto draft4 = compile(R"({"allOf": [{"type": "integer", "minimum": 3, "exclusiveMinimum": true}, {"maximum": 5}]})");
  EXPECT_FALSE(accepts(draft4, "3"));
  EXPECT_TRUE(accepts(draft4, "4"));
  EXPECT_FALSE(accepts(draft4, "6"));
  // A oneOf distributed over an allOf is generated as anyOf: only branches told apart (types,
  // values, a required property's const) are; a document that could match two is refused.
  EXPECT_NE(compile_error(R"({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
      {"oneOf": [{"required": ["a"]}, {"required": ["b"]}]}]})")
                .find("branches 0 and 1 a document could both match"),
            std::string::npos);
  EXPECT_EQ(compile_error(R"({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
      {"anyOf": [{"required": ["a"]}, {"required": ["b"]}]}]})"),
            "");  // anyOf: overlapping branches are fine
  // ... or by a property the other requires that one's objects never have
  const auto shapes = compile(R"({"$defs": {"Cat": {"type": "object", "properties": {"meow": {"type": "boolean"}},
      "required": ["meow"]}, "Dog": {"type": "object", "properties": {"bark": {"type": "integer"}}, "required": ["bark"]}},
      "allOf": [{"type": "object"}, {"oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}]}]})");
  EXPECT_TRUE(accepts(shapes, R"({"meow": true})"));
  EXPECT_TRUE(accepts(shapes, R"({"bark": 2})"));
  EXPECT_FALSE(accepts(shapes, R"({"meow": true, "bark": 2})"));
  const auto typed = compile(R"({"allOf": [{"minLength": 2, "minimum": 3, "type": ["string", "integer"]},
      {"oneOf": [{"type": "string"}, {"type": "integer"}]}]})");
  EXPECT_TRUE(accepts(typed, R"("ab")"));
  EXPECT_TRUE(accepts(typed, "4"));
  EXPECT_FALSE(accepts(typed, "2"));
  // prefixItems beside another schema's items: refused (its positions would need both).
  EXPECT_NE(compile_error(R"({"allOf": [{"type": "array", "prefixItems": [{"type": "string"}]}, {"items": {"type": "integer"}}]})")
                .find("'prefixItems' in one schema and 'items'"),
            std::string::npos);
  const auto items = compile(R"({"allOf": [{"type": "array", "items": {"type": "integer"}}, {"items": {"minimum": 0,
      "type": "number"}, "maxItems": 2}]})");
  EXPECT_TRUE(accepts(items, "[1, 2]"));
  EXPECT_FALSE(accepts(items, "[-1]"));
  EXPECT_FALSE(accepts(items, "[1.5]"));
  EXPECT_FALSE(accepts(items, "[1, 2, 3]"));
  // anyOfs distributed over one another multiply: past 256 alternatives, refused.
  std::string three = R"({"allOf": [)";
  for (int a = 0; a < 3; ++a) {
    three += a ? ", {\"anyOf\": [" : "{\"anyOf\": [";
    for (int b = 0; b < 6; ++b)
      three += std::string(b ? ", " : "") + "{\"type\": \"object\", \"properties\": {\"k" + std::to_string(a) +
               std::to_string(b) + "\": {\"type\": \"integer\"}}}";
    three += "]}";
  }
  EXPECT_NE(compile_error(three + "]}").find("more than 256 alternatives"), std::string::npos);

  EXPECT_NE(compile_error(R"({"allOf": [{"type": "string"}, {"type": "integer"}]})").find("no value fits 'allOf'"), std::string::npos);
  EXPECT_NE(compile_error(R"({"allOf": [{"enum": [1, 2]}, {"enum": [3]}]})").find("enum / const values have none"), std::string::npos);
  EXPECT_NE(compile_error(R"({"allOf": [{"properties": {"a": {"type": "string"}}, "required": ["a"]},
      {"properties": {"a": {"type": "integer"}}}]})").find("no value fits 'allOf'"), std::string::npos);
  EXPECT_NE(compile_error(R"({"allOf": [{"properties": {"a": {}}, "additionalProperties": false}, {"required": ["b"]}]})")
                .find("property 'b' is required by one schema and ruled out"),
            std::string::npos);
  EXPECT_NE(compile_error(R"({"allOf": [{"type": "string", "pattern": "^a"}, {"pattern": "b$"}]})").find("set 'pattern' differently"),
            std::string::npos);
  EXPECT_NE(compile_error(R"({"$defs": {"A": {"allOf": [{"$ref": "#/$defs/A"}, {"type": "object"}]}}, "$ref": "#/$defs/A"})")
                .find("comes back to the same schema"),
            std::string::npos);
  EXPECT_NE(compile_error(R"({"allOf": []})").find("'allOf' must be a non-empty list"), std::string::npos);
  EXPECT_NE(compile_error(R"({"allOf": [{"type": "number", "multipleOf": 0.5}, {"multipleOf": 0.25}]})")
                .find("'multipleOf' steps other than integers"),
            std::string::npos);
  EXPECT_NE(compile_error(R"({"anyOf": [{"allOf": [{"type": "string"}, {"type": "null"}]}]})").find("no schema of 'anyOf' accepts"),
            std::string::npos);
}

TEST(JsonSchema, PropertyCounts) {
  struct Case {
    const char* schema;
    size_t lo, hi;
    bool extras;
  };
  const std::vector<Case> cases = {
      {R"({"properties": {"a": {}, "b": {}, "c": {}}, "minProperties": 1, "maxProperties": 2})", 1, 2, false},
      {R"({"properties": {"a": {}, "b": {}, "c": {}}, "required": ["b"], "minProperties": 2})", 2, 99, false},
      {R"({"type": "object", "properties": {"a": {}, "b": {}}, "additionalProperties": true, "minProperties": 2,
          "maxProperties": 3})", 2, 3, true},
      {R"({"type": "object", "maxProperties": 1})", 0, 1, true},
      {R"({"type": "object", "minProperties": 1})", 1, 99, true},
      {R"({"type": "object", "properties": {"a": {}}, "additionalProperties": true, "minProperties": 2})", 2, 99, true},
      {R"({"properties": {"a": {}, "b": {}}, "minProperties": 0, "maxProperties": 5})", 0, 5, false},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.schema);
    const auto g = compile(c.schema);
    const ojson sch = ojson::parse(c.schema);
    const ojson listed = sch.value("properties", ojson::object());
    std::vector<std::string> names;
    for (auto it = listed.begin(); it != listed.end(); ++it) names.push_back(it.key());
    const size_t extra_max = c.extras ? 3 : 0;
    int yes = 0;
    for (unsigned mask = 0; mask < (1u << names.size()); ++mask)
      for (size_t extra = 0; extra <= extra_max; ++extra) {
        std::string t = "{";
        size_t count = 0;
        bool has_required = true;
        for (size_t i = 0; i < names.size(); ++i) {
          const bool in = mask >> i & 1;
          for (const ojson& r : sch.value("required", ojson::array()))
            if (r == names[i] && !in) has_required = false;
          if (!in) continue;
          t += std::string(count ? ", " : "") + "\"" + names[i] + "\": 1";
          ++count;
        }
        for (size_t e = 0; e < extra; ++e) {
          t += std::string(count ? ", " : "") + "\"x" + std::to_string(e) + "\": 1";
          ++count;
        }
        t += "}";
        // toward minProperties the other properties count once (their names could repeat)
        const size_t sure = count - extra + std::min<size_t>(extra, 1);
        const bool want = has_required && sure >= c.lo && count <= c.hi;
        EXPECT_EQ(accepts(g, t), want) << t;
        yes += want;
      }
    EXPECT_GT(yes, 0);
  }
  EXPECT_NE(compile_error(R"({"properties": {"a": {}, "b": {}}, "required": ["a", "b"], "maxProperties": 1})").find("maxProperties"),
            std::string::npos);
  EXPECT_NE(compile_error(R"({"properties": {"a": {}}, "minProperties": 2})").find("minProperties"), std::string::npos);
  EXPECT_NE(compile_error(R"({"type": "object", "maxProperties": -1})").find("non-negative integer"), std::string::npos);
  EXPECT_NE(compile_error(R"({"type": "object", "minProperties": 3, "maxProperties": 2})").find("no object fits"), std::string::npos);
}

// Cases that once compiled wrong: an integer range below 0 (no '-' could start it), a step of 0.1
// beside a bound whose fraction needs more digits, uniqueItems without items or beside keywords
// its items cannot take, and uniqueItems over many values.
TEST(JsonSchema, EdgesOfBoundsStepsAndUniqueness) {
  // each schema: documents it accepts, texts it does not accept whole, texts it refuses from the start
  struct Lang {
    const char* schema;
    std::vector<std::string> yes, no, dead;
  };
  const Lang langs[] = {
      {R"({"type": "integer", "maximum": -1})", {"-1", "-1234"}, {}, {"0"}},
      {R"({"type": "integer", "minimum": -5, "maximum": -2})", {"-3"}, {}, {"-6", "-1"}},
      {R"({"type": "number", "multipleOf": 0.1, "exclusiveMinimum": 0.9})", {"1", "1.1", "2.0"}, {"0.95", "0.9"}, {}},
      {R"({"type": "number", "multipleOf": 0.01, "minimum": 3.999, "maximum": 5})", {"4", "4.01"}, {"3.99"}, {}},
      {R"({"type": "number", "multipleOf": 0.01, "maximum": -3.999})", {"-4", "-4.01"}, {"-3.99"}, {}},
  };
  for (const Lang& l : langs) {
    const auto g = compile(l.schema);
    for (const auto& t : l.yes) EXPECT_TRUE(accepts(g, t)) << l.schema << " " << t;
    for (const auto& t : l.no) EXPECT_FALSE(accepts(g, t)) << l.schema << " " << t;
    for (const auto& t : l.dead) EXPECT_FALSE(prefix(g, t)) << l.schema << " " << t;
  }
  EXPECT_TRUE(accepts(compile(R"({"type": "number", "multipleOf": 1, "exclusiveMaximum": 0})"), "-7"));
  std::mt19937 rng(3);
  const auto in_object = compile(R"({"type": "object", "properties": {"n": {"type": "integer", "maximum": -1}}, "required": ["n"]})");
  for (int i = 0; i < 20; ++i) {
    bool finished = false;
    const std::string t = random_walk(in_object, rng, &finished);  // fails on a dead end
    if (finished) {
      EXPECT_LE(ojson::parse(t)["n"].get<int64_t>(), -1) << t;
    }
  }

  EXPECT_NE(compile_error(R"({"type": "number", "exclusiveMinimum": 1e-300})").find("more than 16 fraction digits"),
            std::string::npos);
  EXPECT_EQ(compile_error(R"({"type": "number", "exclusiveMinimum": 0.9999999999999999, "maximum": 2})"), "");

  EXPECT_NE(compile_error(R"({"uniqueItems": true})").find("uniqueItems"), std::string::npos);
  EXPECT_NE(compile_error(R"({"uniqueItems": true, "description": "x"})").find("uniqueItems"), std::string::npos);
  EXPECT_NE(compile_error(R"({"type": "object", "additionalProperties": {"uniqueItems": true}})").find("uniqueItems"),
            std::string::npos);
  EXPECT_NE(compile_error(R"({"type": "array", "items": {"enum": [1, 2, 3, 4], "multipleOf": 2}, "uniqueItems": true})"), "");
  EXPECT_NE(compile_error(R"({"type": "array", "items": {"const": "x", "enum": ["a"]}, "uniqueItems": true})"), "");
  EXPECT_NE(compile_error(R"({"$defs": {"e": {"enum": ["a"]}}, "type": "array", "items": {"$ref": "#/$defs/e", "not": {}},
      "uniqueItems": true})"), "");
  EXPECT_NE(compile_error(R"({"type": "array", "items": {"enum": ["2020-01-01", "x"], "format": "date"}, "uniqueItems": true})"), "");
  std::string deep = "1";
  deep = std::string(100, '[') + deep + std::string(100, ']');
  EXPECT_NE(compile_error(R"({"type": "array", "items": {"enum": [)" + deep + R"(]}, "uniqueItems": true})").find("nested deeper"),
            std::string::npos);
  ojson many = ojson::parse(R"({"type": "array", "items": {"enum": []}, "uniqueItems": true})");
  for (int i = 0; i < 200; ++i) many["items"]["enum"].push_back(std::string("v") += std::to_string(i));
  const auto g = compile(many.dump());
  EXPECT_TRUE(accepts(g, R"(["v0", "v17", "v199"])"));
  EXPECT_FALSE(prefix(g, R"(["v17", "v0")"));
  EXPECT_FALSE(prefix(g, R"(["v3", "v3")"));
}

TEST(JsonSchema, ObjectsFollowTheSchemasOrderAndRequiredProperties) {
  const auto g = compile(schemas()[0]);
  EXPECT_TRUE(accepts(g, R"({"name": "Ann", "age": 31})"));
  EXPECT_TRUE(accepts(g, R"({"name":"Ann","age":31,"email":"a@b.c"})"));
  EXPECT_TRUE(accepts(g, "{\n  \"name\": \"Ann\",\n  \"age\": -7\n}"));
  EXPECT_FALSE(accepts(g, R"({"name": "Ann"})"));                      // age is required
  EXPECT_FALSE(prefix(g, R"({"age": 31, "name": "Ann"})"));            // out of order
  EXPECT_FALSE(prefix(g, R"({"name": "Ann", "age": 31, "x": 1})"));    // no other property
  EXPECT_FALSE(prefix(g, R"({"name": 5)"));                            // wrong type
  EXPECT_FALSE(prefix(g, R"({"name": "Ann", "age": 3.5)"));            // an integer
  EXPECT_FALSE(prefix(g, R"({"name": "Ann", "age": 31, "email": "0123456789abc")"));  // maxLength 12
  EXPECT_FALSE(prefix(g, R"({"name": "Ann",, )"));
  EXPECT_FALSE(prefix(g, R"({"name": "Ann"  ,)"));                     // two blanks in a gap
  EXPECT_FALSE(prefix(g, R"({"name": "Ann", "age": 1} )"));  // nothing after the object
  GrammarState s(g);
  ASSERT_TRUE(s.feed(R"({"name": "Ann", "age": 31)"));
  EXPECT_FALSE(s.accepting());
  ASSERT_TRUE(s.feed("}"));
  EXPECT_TRUE(s.done());  // nothing can follow the closed object

  // The written order, not nlohmann's sorted one.
  const auto o = compile(schemas()[8]);
  EXPECT_TRUE(accepts(o, R"({"z": "", "a": "", "m": 1})"));
  EXPECT_FALSE(prefix(o, R"({"a")"));

  // Extra properties: their schema.
  const auto x = compile(schemas()[5]);
  EXPECT_TRUE(accepts(x, R"({"id": 1, "p": "q", "r": "s"})"));
  EXPECT_TRUE(accepts(x, R"({"p": "q"})"));
  EXPECT_TRUE(accepts(x, R"({})"));
  EXPECT_FALSE(prefix(x, R"({"p": 1)"));
  // Names that JSON escapes, or writes in several bytes: a key leaves them only between characters.
  const auto esc = compile(R"({"properties": {"\"": {"type": "integer"}, "\u00e9t\u00e9": {"type": "integer"}, "": {"type": "integer"}},
                               "additionalProperties": {"type": "string"}})");
  EXPECT_TRUE(accepts(esc, R"({"\"": 1, "\u00e9t\u00e9": 2, "": 3, "a": "b"})") ||
              accepts(esc, "{\"\\\"\": 1, \"\xC3\xA9t\xC3\xA9\": 2, \"\": 3, \"a\": \"b\"}"));
  EXPECT_FALSE(prefix(esc, R"({"\u0022")"));        // the listed name '"', escaped otherwise
  EXPECT_TRUE(prefix(esc, "{\"\\\"\": 1"));        // the listed '"' takes an integer
  EXPECT_FALSE(prefix(esc, "{\"\\\"\": \"s"));
  EXPECT_FALSE(prefix(esc, "{\"\\x"));              // no leaving inside an escape
  EXPECT_FALSE(prefix(esc, "{\"\xC3x"));             // nor inside a UTF-8 character
  EXPECT_FALSE(prefix(esc, "{\"\xC3\""));
  EXPECT_TRUE(prefix(esc, "{\"\xC3\xA9x\": \"s\""));  // leaving after a whole character
  EXPECT_FALSE(prefix(esc, "{\"\": \"s\""));        // "" is listed, an integer
  // Integer bounds past a double's precision are exact.
  const auto exact = compile(R"({"type": "integer", "minimum": 9007199254740993, "maximum": 9007199254740995})");
  EXPECT_FALSE(accepts(exact, "9007199254740992"));
  EXPECT_TRUE(accepts(exact, "9007199254740993"));
  EXPECT_TRUE(accepts(exact, "9007199254740995"));
  EXPECT_FALSE(accepts(exact, "9007199254740996"));
  const auto exact_enum = compile(R"({"type": "integer", "exclusiveMinimum": 9007199254740992, "enum": [9007199254740992, 9007199254740993]})");
  EXPECT_FALSE(accepts(exact_enum, "9007199254740992"));
  EXPECT_TRUE(accepts(exact_enum, "9007199254740993"));

  // An extra property is none of the listed ones, however its name is written.
  const auto xn = compile(schemas()[11]);
  EXPECT_TRUE(accepts(xn, R"({"name": "a", "nam": 1, "names": 2, "x\u0061": 3})"));
  EXPECT_TRUE(accepts(xn, R"({"na": 4, "n": 5})"));
  EXPECT_FALSE(prefix(xn, R"({"name": 5)"));   // the listed name takes a string
  EXPECT_FALSE(prefix(xn, R"({"na": "x")"));   // and "na" an integer
  EXPECT_FALSE(prefix(xn, R"({"n\u0061)"));    // no escape before the name is left
  EXPECT_FALSE(prefix(xn, R"({"name": "a", "name")"));
  // Many optional properties: all open after '{' at once.
  ojson many = {{"type", "object"}, {"properties", ojson::object()}};
  for (int k = 0; k < 600; ++k) {
    std::string name = std::to_string(k);
    name.insert(name.begin(), 'p');
    many["properties"][name] = {{"type", "integer"}};
  }
  const auto mg = Grammar::from_schema(many);
  EXPECT_TRUE(accepts(mg, R"({"p599": 1})"));
  EXPECT_TRUE(accepts(mg, R"({"p3": 1, "p599": 2})"));
  EXPECT_FALSE(prefix(mg, R"({"p599": 1, "p3")"));
  // Any object.
  const auto any = compile(schemas()[6]);
  EXPECT_TRUE(accepts(any, R"({"a": [1, {"b": null}], "c": "d\u00e9"})"));
  EXPECT_FALSE(prefix(any, R"([)"));
}

// vLLM's guided_choice: exactly one of the strings, raw.
TEST(JsonSchema, Choices) {
  const auto g = Grammar::from_choices({"yes", "no", "yes!", "caf\xC3\xA9", "no"});
  EXPECT_TRUE(accepts(g, "no"));
  EXPECT_TRUE(accepts(g, "caf\xC3\xA9"));
  EXPECT_FALSE(prefix(g, "\"no"));
  EXPECT_FALSE(prefix(g, " yes"));
  EXPECT_FALSE(prefix(g, "nope"));
  GrammarState s(g);
  ASSERT_TRUE(s.feed("yes"));
  EXPECT_TRUE(s.accepting());
  EXPECT_FALSE(s.done());  // "yes!" may go on
  ASSERT_TRUE(s.feed("!"));
  EXPECT_TRUE(s.done());
  GrammarState n(g);
  ASSERT_TRUE(n.feed("no"));
  EXPECT_TRUE(n.done());
  EXPECT_THROW(Grammar::from_choices({}), std::invalid_argument);
  EXPECT_THROW(Grammar::from_choices({std::string(5000, 'a')}), std::invalid_argument);
  GrammarState e(Grammar::from_choices({"", "a"}));
  EXPECT_TRUE(e.accepting());  // the empty choice: the end may come at once
}

// Nesting past the parse stacks' depth: the byte that would go deeper cannot come, and the
// document can still be closed (no dead end).
TEST(JsonSchema, NestingLimitLeavesNoDeadEnd) {
  for (const std::string& text : {std::string(R"({"type": "object"})"), std::string(R"({"type": "object", "properties": {"a": {"$ref": "#"}}})"),
                                 std::string(R"({"$defs": {"n": {"type": "object", "properties": {"a": {"$ref": "#/$defs/n"}}}},
                                                 "$ref": "#/$defs/n"})")}) {
    SCOPED_TRACE(text);
    const auto g = compile(text);
    GrammarState s(g);
    int depth = 0;
    while (depth < 1000 && s.feed("{\"a\": ")) ++depth;
    EXPECT_GT(depth, 50);
    EXPECT_LT(depth, 1000);
    // Something still comes next, and the whole can be closed.
    bool any = false;
    for (int c = 0; c < 256 && !any; ++c) {
      GrammarState t(nullptr);
      any = s.step(static_cast<unsigned char>(c), t);
    }
    EXPECT_TRUE(any);
    // The any-object takes 1 as the last value; the others' "a" an object: an empty one.
    std::string close = text == R"({"type": "object"})" ? "1" : "{}";
    for (int k = 0; k < depth; ++k) close += "}";
    EXPECT_TRUE(s.feed(close));
    EXPECT_TRUE(s.accepting());
  }
}

TEST(JsonSchema, StringsNumbersArraysAndAlternatives) {
  // Lengths in code points: a multi-byte character and an escape are one each, a surrogate pair one.
  const auto s = compile(R"({"type": "string", "minLength": 2, "maxLength": 3})");
  EXPECT_FALSE(accepts(s, "\"a\""));
  EXPECT_TRUE(accepts(s, "\"ab\""));
  EXPECT_TRUE(accepts(s, "\"\xC3\xA9\xE2\x82\xAC\\n\""));
  EXPECT_TRUE(accepts(s, "\"a\\uD83D\\uDE00\""));
  EXPECT_FALSE(prefix(s, "\"abcd"));
  EXPECT_FALSE(prefix(s, "\"a\\uDE00"));        // a low half alone
  EXPECT_FALSE(prefix(s, "\"a\\uD83Dx"));       // a high half alone
  EXPECT_FALSE(prefix(s, "\"\xC0\xAF"));        // overlong
  EXPECT_FALSE(prefix(s, "\"a\tb"));            // a raw control character
  const auto z = compile(R"({"type": "string", "maxLength": 0})");
  EXPECT_TRUE(accepts(z, "\"\""));
  EXPECT_FALSE(prefix(z, "\"a"));

  const auto i = compile(R"({"type": "integer"})");
  EXPECT_TRUE(accepts(i, "0"));
  EXPECT_TRUE(accepts(i, "-120"));
  EXPECT_TRUE(accepts(i, "1234567890123456"));    // 16 digits
  EXPECT_FALSE(prefix(i, "12345678901234567"));   // 17
  EXPECT_FALSE(prefix(i, "01"));
  EXPECT_FALSE(prefix(i, "1."));
  GrammarState n(i);
  ASSERT_TRUE(n.feed("12"));
  EXPECT_TRUE(n.accepting());
  EXPECT_FALSE(n.done());  // more digits may come
  // Bounded integers: a digit only while some number it starts is in range.
  const auto r = compile(R"({"type": "integer", "minimum": -15, "maximum": 230})");
  for (const char* ok : {"-15", "-9", "0", "7", "23", "199", "230"}) EXPECT_TRUE(accepts(r, ok)) << ok;
  for (const char* no : {"-16", "-150", "231", "300", "1000", "01"}) EXPECT_FALSE(accepts(r, no)) << no;
  EXPECT_TRUE(accepts(r, "-0"));    // JSON's -0, which is 0
  EXPECT_FALSE(prefix(r, "240"));   // no number starting so is in range
  EXPECT_FALSE(prefix(r, "-20"));
  EXPECT_FALSE(prefix(r, "2300"));
  const auto pos = compile(R"({"type": "integer", "exclusiveMinimum": 0, "maximum": 9})");
  EXPECT_FALSE(prefix(pos, "0"));
  EXPECT_FALSE(prefix(pos, "-"));
  EXPECT_TRUE(accepts(pos, "9"));
  GrammarState ps(pos);
  ASSERT_TRUE(ps.feed("9"));
  EXPECT_TRUE(ps.done());  // no digit can follow
  // Formats.
  const auto dt = compile(R"({"type": "string", "format": "date-time"})");
  EXPECT_TRUE(accepts(dt, "\"2026-12-06T15:30:00Z\""));
  EXPECT_TRUE(accepts(dt, "\"2026-02-28T23:59:59.123+01:00\""));
  EXPECT_FALSE(prefix(dt, "\"2026-13"));
  EXPECT_FALSE(prefix(dt, "\"2026-12-06 "));
  EXPECT_FALSE(prefix(dt, "\"2026-12-06T24"));
  EXPECT_FALSE(prefix(dt, "\"2026-02-29"));
  EXPECT_FALSE(prefix(dt, "\"2026-04-31"));
  EXPECT_FALSE(prefix(dt, "\"0000"));
  EXPECT_TRUE(prefix(dt, "\"2026-01-31T"));
  const auto ip = compile(R"({"format": "ipv4"})");
  EXPECT_TRUE(accepts(ip, "\"192.168.0.255\""));
  EXPECT_FALSE(prefix(ip, "\"256"));
  EXPECT_FALSE(prefix(ip, "\"01"));

  const auto f = compile(R"({"type": "number"})");
  EXPECT_TRUE(accepts(f, "-0.5e+10"));
  EXPECT_TRUE(accepts(f, "3E7"));
  EXPECT_FALSE(accepts(f, "1."));
  EXPECT_FALSE(prefix(f, ".5"));

  const auto a = compile(schemas()[1]);
  EXPECT_FALSE(accepts(a, "[1]"));
  EXPECT_TRUE(accepts(a, "[1, 2.5]"));
  EXPECT_TRUE(accepts(a, "[1,2,3,4]"));
  EXPECT_FALSE(prefix(a, "[1,2,3,4,"));
  EXPECT_FALSE(prefix(a, "[1,]"));
  EXPECT_FALSE(prefix(a, "[\"a\""));

  const auto alt = compile(schemas()[4]);
  EXPECT_TRUE(accepts(alt, "\"ab\""));
  EXPECT_TRUE(accepts(alt, "null"));
  EXPECT_TRUE(accepts(alt, "[true, \"x\"]"));
  EXPECT_TRUE(accepts(alt, "[true]"));  // prefixItems do not require their items
  EXPECT_FALSE(prefix(alt, "[true, \"x\", 1"));
  EXPECT_FALSE(prefix(alt, "[\"x\""));

  const auto e = compile(schemas()[2]);
  EXPECT_TRUE(accepts(e, R"({"kind": "cat", "ok": true, "tag": "x\"y"})"));
  EXPECT_TRUE(accepts(e, R"({"kind": {"a":[1]}, "ok": false, "tag": "x\"y"})"));
  EXPECT_TRUE(accepts(e, R"({"kind": null, "ok": false, "tag": "x\"y"})"));
  EXPECT_FALSE(prefix(e, R"({"kind": "cow")"));
  EXPECT_FALSE(prefix(e, R"({"kind": 3, "ok": true, "tag": "xy")"));

  // enum values filtered by the bounds beside them.
  const auto eb = compile(R"({"type": "string", "maxLength": 2, "enum": ["abc", "ab", 3]})");
  EXPECT_TRUE(accepts(eb, "\"ab\""));
  EXPECT_FALSE(prefix(eb, "\"abc"));
  EXPECT_FALSE(prefix(eb, "3"));
  const auto ei = compile(R"({"type": "integer", "minimum": 2, "enum": [1, 2, 3]})");
  EXPECT_FALSE(prefix(ei, "1"));
  EXPECT_TRUE(accepts(ei, "3"));

  // A long enum: its values share parse stacks by prefix.
  ojson big = {{"enum", ojson::array()}};
  for (int k = 0; k < 5000; ++k) big["enum"].push_back("city-" + std::to_string(k));
  big["enum"].push_back(7);
  big["enum"].push_back("city-1");  // twice
  const auto b = Grammar::from_schema(big);
  EXPECT_TRUE(accepts(b, "\"city-4321\""));
  EXPECT_TRUE(accepts(b, "\"city-1\""));
  EXPECT_TRUE(accepts(b, "7"));
  EXPECT_FALSE(prefix(b, "\"city-5000"));
  EXPECT_FALSE(accepts(b, "\"city-"));
  GrammarState bs(b);
  ASSERT_TRUE(bs.feed("\"city-1"));
  EXPECT_LE(bs.n_stacks(), 12u);

  // Recursion through $ref.
  const auto t = compile(schemas()[3]);
  EXPECT_TRUE(accepts(t, R"({"v": 1, "kids": [{"v": 2}, {"v": 3, "kids": [{"v": 4, "kids": []}]}]})"));
  EXPECT_FALSE(prefix(t, R"({"v": 1, "kids": [{"kids": [])"));
}

// Random documents of every test schema: each parses, validates against the schema by an
// independent validator, and none of the states on the way is a dead end.
TEST(JsonSchema, RandomDocumentsValidate) {
  std::mt19937 rng(7);
  for (const std::string& text : schemas()) {
    SCOPED_TRACE(text);
    const auto g = compile(text);
    const ojson schema = ojson::parse(text);
    int finished = 0;
    for (int k = 0; k < 150; ++k) {
      bool done = false;
      const std::string doc = random_walk(g, rng, &done);
      if (!done) {
        ADD_FAILURE() << "unfinished: " << doc;
        continue;
      }
      ++finished;
      ojson v;
      ASSERT_NO_THROW(v = ojson::parse(doc)) << doc;
      ASSERT_TRUE(validate(schema, schema, v)) << doc;
    }
    EXPECT_GE(finished, 100);
  }
}

// Documents written by nlohmann (compact and indented by 2) from values that validate are
// accepted, and mutations of them are accepted only when they still validate.
TEST(JsonSchema, AcceptsWrittenDocumentsAndMutationsOnlyWhenValid) {
  std::mt19937 rng(11);
  for (const std::string& text : schemas()) {
    SCOPED_TRACE(text);
    const auto g = compile(text);
    const ojson schema = ojson::parse(text);
    for (int k = 0; k < 120; ++k) {
      bool done = false;
      const std::string doc = random_walk(g, rng, &done);
      if (!done) continue;
      const ojson v = ojson::parse(doc);
      // nlohmann writes floats its own way (17 digits, 3-digit exponents): documents with one are
      // not rewritten.
      const std::function<bool(const ojson&)> has_float = [&](const ojson& x) {
        if (x.is_number_float()) return true;
        for (const ojson& c : x)
          if ((x.is_object() || x.is_array()) && has_float(c)) return true;
        return false;
      };
      if (!has_float(v)) {
        for (const std::string& w : {v.dump(), v.dump(2)}) EXPECT_TRUE(accepts(g, w)) << w;
      }
      std::string m = doc;
      const size_t at = std::uniform_int_distribution<size_t>(0, m.size() - 1)(rng);
      const std::string alphabet = "{}[]\",:0123456789-.eEtrufalsn \n\\ab";
      switch (std::uniform_int_distribution<int>(0, 2)(rng)) {
        case 0: m.erase(at, 1); break;
        case 1: m.insert(at, 1, alphabet[std::uniform_int_distribution<size_t>(0, alphabet.size() - 1)(rng)]); break;
        default: m[at] = alphabet[std::uniform_int_distribution<size_t>(0, alphabet.size() - 1)(rng)]; break;
      }
      if (!accepts(g, m)) continue;
      ojson mv;
      ASSERT_NO_THROW(mv = ojson::parse(m)) << m;
      EXPECT_TRUE(validate(schema, schema, mv)) << m;
    }
  }
}

// grammar_mask over real vocabularies, against feeding each token's bytes, at states reached by
// random walks (inside strings, numbers, keys, between tokens).
class GrammarMask : public ::testing::TestWithParam<std::string> {};

INSTANTIATE_TEST_SUITE_P(Vocabularies, GrammarMask, ::testing::ValuesIn(kvq_vocab_test_models()));

TEST_P(GrammarMask, LeavesExactlyTheContinuations) {
  const std::string path = GetParam();
  if (!std::filesystem::exists(path)) GTEST_SKIP() << path << " not found (scripts/get-models.sh installs SmolLM2)";
  const auto f = gguf::File::open(path);
  const Tokenizer tok = Tokenizer::from_gguf(*f);
  const JsonVocab jv(tok);
  const GrammarVocab vocab(jv);
  const int n = tok.n_vocab();
  std::mt19937 rng(3);
  int states = 0, free_strings = 0;
  for (const std::string& text : schemas()) {
    const auto g = compile(text);
    for (int k = 0; k < 4; ++k) {
      bool done = false;
      const std::string doc = random_walk(g, rng, &done);
      // Prefixes at a few cut points of the document.
      for (size_t cut : {size_t(0), doc.size() / 3, doc.size() / 2, doc.size() - std::min<size_t>(doc.size(), 2), doc.size()}) {
        GrammarState s(g);
        ASSERT_TRUE(s.feed(std::string_view(doc).substr(0, cut)));
        SCOPED_TRACE(text + " after '" + doc.substr(0, cut) + "'");
        free_strings += s.in_free_string();
        ++states;
        const std::vector<int32_t> stop = {5};
        std::vector<float> logits(size_t(n), 1.0f);
        const int count = grammar_mask(s, vocab, stop, logits.data(), n);
        int expect_count = 0;
        for (int32_t id = 0; id < n; ++id) {
          const std::string piece = tok.token_piece(id);
          const bool control = tok.token_type(id) == TokenType::control;
          bool expect;
          if (tok.is_eog(id) || id == 5) {
            expect = s.accepting();
          } else {
            GrammarState t = s;
            expect = !control && !piece.empty() && t.feed(piece);
          }
          expect_count += expect;
          ASSERT_EQ(logits[size_t(id)] == 1.0f, expect) << "token " << id << " '" << piece << "'";
        }
        if (expect_count > 0) {
          EXPECT_EQ(count, expect_count);
        }
      }
    }
  }
  EXPECT_GT(free_strings, 3);  // the plain-string-text path was exercised
  EXPECT_GT(states, 100);
}
