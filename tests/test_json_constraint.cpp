// JSON mode: the reference automaton (tests/json_reference.h) accepts exactly the JSON objects
// (checked against nlohmann::json's parser on valid, invalid and randomly mutated documents), every
// prefix of one and nothing else; the grammar JSON mode generates with (Grammar::json_object,
// model/json_schema.h) takes the same bytes on those documents; its mask on a real vocabulary
// leaves exactly the tokens whose bytes the automaton takes, and end-of-generation only after the
// object.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <algorithm>
#include <cctype>
#include <filesystem>
#include <random>
#include <string>

#include "gguf/gguf.h"
#include "json_reference.h"
#include "model/json_constraint.h"
#include "model/json_schema.h"
#include "model/tokenizer.h"
#include "test_models.h"

using namespace kvq;

namespace {

// Whole document: accepted and complete.
bool accepts(const std::string& doc) {
  JsonState s;
  return s.feed(doc) && s.done();
}

// The length of the longest prefix the automaton takes.
size_t taken(const std::string& doc) {
  JsonState s;
  for (size_t i = 0; i < doc.size(); ++i)
    if (!s.feed(static_cast<unsigned char>(doc[i]))) return i;
  return doc.size();
}

// A run of 17 digits, or 3 after an exponent's e: a number longer than JSON mode's grammar writes.
bool long_number(const std::string& d) {
  auto digit = [&](size_t i) { return i < d.size() && d[i] >= '0' && d[i] <= '9'; };
  for (size_t i = 0; i < d.size(); ++i) {
    size_t run = 0;
    while (digit(i + run)) ++run;
    if (run >= 17) return true;
    if (d[i] == 'e' || d[i] == 'E') {
      size_t j = i + 1;
      if (j < d.size() && (d[j] == '+' || d[j] == '-')) ++j;
      if (digit(j) && digit(j + 1) && digit(j + 2)) return true;
    }
  }
  return false;
}

// What kvq's JSON mode promises: RFC 8259 (nlohmann's parser) with an object at the top, no
// trailing whitespace, and every gap between tokens one space or tab, or a newline and at most
// kMaxIndent spaces or tabs (no '\r').
// A number beyond double's range is still JSON's grammar, which nlohmann's parser refuses (406):
// exponents' digits become one digit for the reference, outside strings.
std::string small_exponents(const std::string& doc) {
  std::string out;
  bool in_string = false, escaped = false;
  for (size_t i = 0; i < doc.size(); ++i) {
    const char c = doc[i];
    out += c;
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '"') in_string = true;
    if ((c == 'e' || c == 'E') && i > 0 && std::isdigit(static_cast<unsigned char>(doc[i - 1]))) {
      size_t j = i + 1;
      if (j < doc.size() && (doc[j] == '+' || doc[j] == '-')) out += doc[j++];
      size_t k = j;
      while (k < doc.size() && std::isdigit(static_cast<unsigned char>(doc[k]))) ++k;
      if (k > j) out += '1';
      i = k - 1;
    }
  }
  return out;
}

bool json_object_text(const std::string& doc) {
  if (!nlohmann::json::accept(small_exponents(doc))) return false;
  const size_t first = doc.find_first_not_of(" \t\r\n");
  if (first == std::string::npos || doc[first] != '{') return false;
  if (std::string(" \t\r\n").find(doc.back()) != std::string::npos) return false;
  std::string gap;
  const auto gap_ok = [&] {
    if (gap.find('\r') != std::string::npos) return false;
    if (gap.empty() || gap == " " || gap == "\t") return true;
    return gap[0] == '\n' && gap.size() <= size_t(JsonState::kMaxIndent) + 1 &&
           gap.find('\n', 1) == std::string::npos;
  };
  bool in_string = false, escaped = false;
  for (char c : doc) {
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == ' ' || c == '\t' || c == '\r' || c == '\n') {
      gap += c;
      continue;
    }
    if (!gap_ok()) return false;
    gap.clear();
    if (c == '"') in_string = true;
  }
  return true;
}

const char* const kValid[] = {
    "{}",
    "\n{ }",
    R"({"a":1})",
    R"({"a": -0.5e+10, "b": [1, 2.25, -3E-2, 0, 10], "c": {"d": null, "e": true, "f": false}})",
    R"({"s": "tab\tnew\nquote\" slash\\ \/ \b\f\r \u00e9\u20AC"})",
    "{\"utf8\": \"caf\xC3\xA9 \xE2\x82\xAC \xF0\x9F\x98\x80\"}",
    R"({"nested": [[[], {}], [{"x": [1, {"y": []}]}]]})",
    "{\n  \"name\": \"Felix\",\n  \"age\": 12\n}",
    R"({"":""})",
    R"({"a":0.0,"b":0e5,"c":1E+2})",
    R"({"pair": "\uD83D\uDE00", "max": "\uFFFF", "low": "\u0000"})",
    "{\"edges\": \"\xED\x9F\xBF \xF4\x8F\xBF\xBF \xEE\x80\x80 \xF0\x90\x80\x80\"}",  // U+D7FF, U+10FFFF, U+E000, U+10000
};

const char* const kInvalid[] = {
    "",           // nothing yet: not complete
    "[1, 2]",     // the top level is an object
    "\"text\"",
    "{\"a\":01}",  // leading zero
    "{\"a\":.5}",
    "{\"a\":1.}",
    "{\"a\":1e}",
    "{\"a\":-}",
    "{\"a\":+1}",
    "{\"a\":tru}",
    "{\"a\":nul}",
    "{\"a\" 1}",
    "{,}",
    "{\"a\":1,}",
    "{\"a\":[1,]}",
    "{\"a\":[1 2]}",
    "{a:1}",
    "{'a':1}",
    "{\"a\":\"\x01\"}",  // control character in a string
    "{\"a\":\"\\q\"}",
    "{\"a\":\"\\u12G4\"}",
    "{\"a\":\"\xC0\xAF\"}",  // an invalid UTF-8 lead byte
    "{\"a\":\"\xE2\x82\"}",  // a character cut short
    "{\"a\":1}}",
    "{\"a\":1} ",  // trailing whitespace
    "{\"a\":1}{}",
    "{\"a\":[}",
    "{\"a\":{]}",
    "{\"a\":1",  // not closed
    "{\"a\":\"\xE0\x80\x80\"}",      // overlong
    "{\"a\":\"\xF0\x80\x80\x80\"}",  // overlong
    "{\"a\":\"\xED\xA0\x80\"}",      // a surrogate in UTF-8
    "{\"a\":\"\xF4\x90\x80\x80\"}",  // past U+10FFFF
    "{\"a\":\"\\uD800\"}",            // a lone high surrogate
    "{\"a\":\"\\uDC00\"}",            // a lone low one
    "{\"a\":\"\\uD800\\u0041\"}",    // a high one, then no low one
    "{\"a\":\"\\uD800x\"}",
    "{\"a\":\"\\uD800\\n\"}",
};

}  // namespace

TEST(JsonConstraint, AcceptsJsonObjects) {
  for (const char* d : kValid) {
    SCOPED_TRACE(d);
    EXPECT_TRUE(json_object_text(d));  // the reference agrees these are valid
    EXPECT_TRUE(accepts(d));
    // Every proper prefix is taken and incomplete.
    const std::string doc = d;
    for (size_t n = 0; n < doc.size(); ++n) {
      JsonState s;
      EXPECT_TRUE(s.feed(std::string_view(doc).substr(0, n)));
      EXPECT_FALSE(s.done());
    }
  }
}

TEST(JsonConstraint, RejectsWhatIsNoJsonObject) {
  for (const char* d : kInvalid) {
    SCOPED_TRACE(d);
    EXPECT_FALSE(json_object_text(d));
    EXPECT_FALSE(accepts(d));
  }
  // Where: at the byte that makes it invalid.
  EXPECT_EQ(taken("{\"a\":01}"), 6u);
  EXPECT_EQ(taken("{\"a\":1,}"), 7u);
  EXPECT_EQ(taken("[1]"), 0u);
  EXPECT_EQ(taken("{\"a\":1} "), 7u);
  EXPECT_EQ(taken("{  \"a\":1}"), 2u);
}

TEST(JsonConstraint, LimitsWhitespaceAndDepth) {
  const std::string ws(JsonState::kMaxIndent, ' ');
  EXPECT_TRUE(accepts("{\n" + ws + "\"a\": 1,\t\"b\":\n" + ws + "2\n}"));
  EXPECT_TRUE(accepts("\n{\"a\":1}"));
  EXPECT_FALSE(accepts("{\n" + ws + " \"a\":1}"));  // one more than the indent allowed
  EXPECT_FALSE(accepts("{  \"a\":1}"));               // two spaces
  EXPECT_FALSE(accepts("{\n\n\"a\":1}"));           // two newlines
  EXPECT_FALSE(accepts("{ \n\"a\":1}"));             // a space, then a newline
  EXPECT_FALSE(accepts("{\r\n\"a\":1}"));
  EXPECT_FALSE(accepts("{\"s\":\"" + ws + "\n\"}"));  // a raw newline in a string
  EXPECT_TRUE(accepts("{\"s\":\"" + ws + ws + "\"}"));  // inside strings, spaces are text
  std::string deep = "{\"a\":";
  for (int i = 1; i < JsonState::kMaxDepth; ++i) deep += "[";
  std::string closed = deep;
  for (int i = 1; i < JsonState::kMaxDepth; ++i) closed += "]";
  EXPECT_TRUE(accepts(closed + "}"));
  EXPECT_EQ(taken(deep + "["), deep.size());
}

// Random edits of valid documents, with structural characters, whitespace, escapes, hex digits
// and bytes of UTF-8 characters (leads, continuations, the bounds of the well-formed ranges): the
// automaton takes a whole document exactly when the reference parser does.
TEST(JsonConstraint, AgreesWithTheReferenceParserOnMutatedDocuments) {
  std::mt19937 rng(12345);
  const std::string alphabet =
      "{}[]\":,0123456789-+.eEtrufalsn \n\t\\abcuDdF\xC3\xA9\xE2\x82\xAC\xED\xA0\x9F\xF4\x90\x8F\xC0\xE0\xF0\xBF";
  const char* const bases[] = {
      R"({"a": -0.5e+10, "b": [1, 2.25, -3E-2, 0, 10], "c": {"d": null, "e": true, "f": false}})",
      R"({"nested": [[[], {}], [{"x": [1, {"y": []}]}]], "s": "a\"b\\c\n"})",
      R"({"k1":"v","k2":[true,false,null],"k3":{"x":12.5}})",
      "{\"u\": \"\\uD83D\\uDE00 \\u00e9 caf\xC3\xA9 \xE2\x82\xAC\", \"t\":\t1}",
  };
  int agree_valid = 0, agree_invalid = 0, long_numbers = 0;
  for (int trial = 0; trial < 20000; ++trial) {
    std::string d = bases[trial % 4];
    const int edits = 1 + int(rng() % 3);
    for (int e = 0; e < edits && !d.empty(); ++e) {
      const size_t at = rng() % d.size();
      const char c = alphabet[rng() % alphabet.size()];
      switch (rng() % 3) {
        case 0: d.erase(at, 1); break;
        case 1: d.insert(d.begin() + long(at), c); break;
        default: d[at] = c; break;
      }
    }
    const bool ref = json_object_text(d);
    ASSERT_EQ(accepts(d), ref) << d;
    // The generation grammar takes the same bytes: the same prefix, and the same whole documents;
    // but its numbers have at most 16 digits before and after the point, and 2 in the exponent
    // (the reference's are unbounded): past them it takes less.
    GrammarState g(Grammar::json_object());
    size_t k = 0;
    while (k < d.size() && g.feed(static_cast<unsigned char>(d[k]))) ++k;
    if (long_number(d)) {
      ASSERT_LE(k, taken(d)) << d;
      ASSERT_TRUE(!(k == d.size() && g.accepting()) || ref) << d;
      ++long_numbers;
    } else {
      ASSERT_EQ(k, taken(d)) << d;
      ASSERT_EQ(k == d.size() && g.accepting(), ref) << d;
    }
    (ref ? agree_valid : agree_invalid)++;
  }
  // Both kinds were exercised.
  EXPECT_GT(agree_valid, 1000);
  EXPECT_GT(agree_invalid, 1000);
  EXPECT_LT(long_numbers, 2000);  // most documents compare exactly
}

// JSON mode's mask (grammar_mask on Grammar::json_object) over real vocabularies: stories260K's
// (SentencePiece with byte tokens) and, where installed, SmolLM2's (byte-level BPE, 49152 tokens),
// against feeding each token's bytes to the reference automaton.
class JsonMask : public ::testing::TestWithParam<std::string> {};

INSTANTIATE_TEST_SUITE_P(Vocabularies, JsonMask, ::testing::ValuesIn(kvq_vocab_test_models()));

TEST_P(JsonMask, LeavesExactlyTheContinuations) {
  const std::string path = GetParam();
  if (!std::filesystem::exists(path)) GTEST_SKIP() << path << " not found (scripts/get-models.sh installs SmolLM2)";
  const auto f = gguf::File::open(path);
  const Tokenizer tok = Tokenizer::from_gguf(*f);
  const JsonVocab vocab(tok);
  const GrammarVocab gvocab(vocab);
  const int n = tok.n_vocab();
  const auto allowed = [&](const std::string& text, const std::vector<int32_t>& stop_ids = {}) {
    GrammarState s(Grammar::json_object());
    EXPECT_TRUE(s.feed(text));
    std::vector<float> logits(size_t(n), 1.0f);
    const int count = grammar_mask(s, gvocab, stop_ids, logits.data(), n);
    std::vector<int32_t> ids;
    for (int32_t id = 0; id < n; ++id)
      if (logits[size_t(id)] == 1.0f) ids.push_back(id);
    EXPECT_EQ(int(ids.size()), count);
    return ids;
  };
  // At the start: tokens made of whitespace and at most one '{' at their end... every allowed
  // token's text, and no other token's, keeps the text a JSON object's start.
  for (const std::string text : {"", "{", "{\"na", "{\"a\": 1", "{\"a\": [tr", "{\"a\": \"x\\", "{\"a\": \"caf\xC3",
                                 "{\"a\": [1,\n  ", "{\"a\": -0.5e"}) {
    SCOPED_TRACE(text);
    const std::vector<int32_t> ids = allowed(text);
    EXPECT_FALSE(ids.empty());
    std::vector<char> is(size_t(n), 0);
    for (int32_t id : ids) is[size_t(id)] = 1;
    for (int32_t id = 0; id < n; ++id) {
      const std::string piece = tok.token_piece(id);
      const bool control = tok.token_type(id) == TokenType::control;
      const bool expect = !control && !piece.empty() && [&] {
        JsonState s;
        return s.feed(text) && s.feed(piece);
      }();
      ASSERT_EQ(bool(is[size_t(id)]), expect) << "token " << id << " '" << piece << "'";
    }
  }
  // A complete object: only the end-of-generation tokens (and the request's stop ids).
  const std::vector<int32_t> end = allowed("{\"a\": 1}");
  EXPECT_EQ(end, tok.eog_ids());
  // A stop id is a token that ends generation: "}" as one is masked where it would close the
  // object (it would end it unclosed) and allowed, with its own logit, once the object is closed.
  int32_t brace = -1;
  for (int32_t id = 0; id < n && brace < 0; ++id)
    if (vocab.bytes(id) == "}" && !tok.is_eog(id)) brace = id;
  ASSERT_GE(brace, 0);
  const std::vector<int32_t> open_ids = allowed("{\"a\": 1");
  EXPECT_NE(std::find(open_ids.begin(), open_ids.end(), brace), open_ids.end());
  const std::vector<int32_t> stopped = allowed("{\"a\": 1", {brace});
  EXPECT_EQ(stopped.size() + 1, open_ids.size());
  EXPECT_EQ(std::find(stopped.begin(), stopped.end(), brace), stopped.end());
  std::vector<int32_t> with = allowed("{\"a\": 1}", {brace});
  EXPECT_EQ(with.size(), tok.eog_ids().size() + 1);
  EXPECT_NE(std::find(with.begin(), with.end(), brace), with.end());
  // Before that, no end-of-generation token.
  for (int32_t id : allowed("{\"a\": 1")) EXPECT_FALSE(tok.is_eog(id));
}
