// GBNF grammars (model/gbnf.h, Grammar::from_gbnf): regular grammars against std::regex on random
// grammars and texts, recursive ones against hand-written checkers and nlohmann's JSON parser,
// and the errors.
// GCC 12 warns of maybe-uninitialized members inside std::regex's own code at -O2 with the
// sanitizers (a false positive in the library's instantiations).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <cstdio>
#include <random>
#include <regex>

#include "model/gbnf.h"
#include "grammar_walk.h"
#include "model/json_schema.h"

using namespace kvq;

namespace {

bool accepts(const std::shared_ptr<const Grammar>& g, std::string_view text) {
  GrammarState s(g);
  return s.feed(text) && s.accepting();
}

std::string error_of(const std::string& text) {
  try {
    Grammar::from_gbnf(text);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

// Pieces joined (GCC 12 warns of -Wrestrict on "(" + std::string).
std::string join(std::initializer_list<std::string_view> parts) {
  std::string out;
  for (std::string_view p : parts) out += p;
  return out;
}

// A random regular expression written twice: as GBNF (some parts as rules of their own) and as
// ECMAScript for std::regex.
struct Twin {
  std::string gbnf, ecma;
};
struct RandomGrammar {
  std::mt19937& rng;
  std::vector<std::string> rules;  // "name ::= body"
  int pick(int n) { return std::uniform_int_distribution<int>(0, n - 1)(rng); }

  Twin atom(int depth) {
    switch (pick(depth > 0 ? 8 : 6)) {
      case 0: return {"\"ab\"", "ab"};
      case 1: return {"[ab]", "[ab]"};
      case 2: return {"[^a]", "[^a]"};
      case 3: return {".", "[\\s\\S]"};  // GBNF's '.' is any character, newlines too
      case 4: return {"\"\\n\"", "\\n"};
      case 5: return {"[a-c1 ]", "[a-c1 ]"};
      case 6: {
        const Twin a = alternation(depth - 1);
        return {join({"(", a.gbnf, ")"}), join({"(?:", a.ecma, ")"})};
      }
      default: {  // the same as a rule of its own
        const Twin a = alternation(depth - 1);
        const std::string name = join({"r", std::to_string(rules.size())});
        rules.push_back(join({name, " ::= ", a.gbnf}));
        return {name, join({"(?:", a.ecma, ")"})};
      }
    }
  }
  Twin sequence(int depth) {
    Twin out;
    for (int i = 0, n = 1 + pick(3); i < n; ++i) {
      Twin a = atom(depth);
      static const std::vector<std::string> q = {"", "", "", "*", "+", "?", "{2}", "{0,2}", "{1,}"};
      const std::string& r = q[size_t(pick(int(q.size())))];
      if (!r.empty()) {  // wrapped, so that the repetition applies to the whole of it
        a.ecma = join({"(?:", a.ecma, ")", r});
        a.gbnf = join({"(", a.gbnf, ")", r});
      }
      if (!out.gbnf.empty()) out.gbnf += ' ';
      out.gbnf += a.gbnf;
      out.ecma += a.ecma;
    }
    return out;
  }
  Twin alternation(int depth) {
    Twin out = sequence(depth);
    if (pick(3) == 0) {
      const Twin b = sequence(depth);
      out = {join({out.gbnf, " | ", b.gbnf}), join({out.ecma, "|", b.ecma})};
    }
    return out;
  }
};

}  // namespace

TEST(Gbnf, RegularGrammarsMatchAsStdRegex) {
  std::mt19937 rng(4);
  int yes = 0, total = 0, refused = 0;
  for (int k = 0; k < 300; ++k) {
    RandomGrammar rg{rng, {}};
    const Twin t = rg.alternation(2);
    std::string text = join({"root ::= ", t.gbnf, "\n"});
    for (const std::string& r : rg.rules) text += join({r, "\n"});
    SCOPED_TRACE(join({text, " ~ ", t.ecma}));
    std::shared_ptr<const Grammar> g;
    try {
      g = Grammar::from_gbnf(text);
    } catch (const std::invalid_argument& e) {
      // A repetition of something that can be empty: the one refusal (left recursion).
      EXPECT_NE(std::string(e.what()).find("left recursion"), std::string::npos) << e.what();
      ++refused;
      continue;
    }
    const std::regex ref(t.ecma);
    for (int n = 0; n < 40; ++n) {
      std::string s;
      for (int i = std::uniform_int_distribution<int>(0, 7)(rng); i > 0; --i) s += "abc1 \nx"[rng() % 7];
      const bool want = std::regex_match(s, ref);
      ASSERT_EQ(accepts(g, s), want) << "'" << s << "'";
      yes += want;
      ++total;
    }
  }
  std::printf("%d of %d texts matched; %d of 300 grammars refused\n", yes, total, refused);
  EXPECT_GT(yes, total / 20);
  EXPECT_LT(refused, 150);
}

TEST(Gbnf, RecursiveGrammars) {
  // Balanced parentheses, against a counter.
  const auto parens = Grammar::from_gbnf("root ::= (\"(\" root \")\")*\n");
  std::mt19937 rng(1);
  int balanced = 0;
  for (int k = 0; k < 2000; ++k) {
    std::string s;
    for (int i = std::uniform_int_distribution<int>(0, 10)(rng); i > 0; --i) s += "()"[rng() & 1];
    int depth = 0;
    bool ok = true;
    for (char c : s) {
      depth += c == '(' ? 1 : -1;
      ok = ok && depth >= 0;
    }
    ok = ok && depth == 0;
    balanced += ok;
    ASSERT_EQ(accepts(parens, s), ok) << s;
  }
  EXPECT_GT(balanced, 50);

  // JSON, as GBNF: random texts of the grammar parse as JSON, and JSON texts written by nlohmann
  // are texts of the grammar.
  const std::string json_gbnf = R"(
root   ::= value
value  ::= object | array | string | number | ("true" | "false" | "null")
object ::= "{" ws ( string ws ":" ws value ws ("," ws string ws ":" ws value ws)* )? "}"
array  ::= "[" ws ( value ws ("," ws value ws)* )? "]"
string ::= "\"" ( [^"\\\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4}) )* "\""
number ::= "-"? ([0-9] | [1-9] [0-9]{1,15}) ("." [0-9]{1,15})? ([eE] [-+]? [0-9]{1,2})?
ws     ::= [ \t\n]{0,20}
)";
  const auto g = Grammar::from_gbnf(json_gbnf);
  int parsed = 0;
  for (int k = 0; k < 300; ++k) {
    bool finished = false;
    const std::string out = random_walk(g, rng, &finished);
    if (!finished) continue;
    ++parsed;
    EXPECT_TRUE(nlohmann::json::accept(out)) << out;
  }
  EXPECT_GT(parsed, 200);
  for (const char* doc : {R"({"a": [1, -2.5e+3, true, null, "x\"y\u00e9"], "b": {}})", "[]", "\"\"", "-0", "[[[[1]]]]"}) {
    EXPECT_TRUE(accepts(g, doc)) << doc;
    EXPECT_TRUE(accepts(g, nlohmann::json::parse(doc).dump(2))) << doc;
  }
  for (const char* bad : {"{a: 1}", "[1,]", "01", "\"\x01\"", "{\"a\" 1}", "tru"}) EXPECT_FALSE(accepts(g, bad)) << bad;
}

TEST(Gbnf, SyntaxAndCharacters) {
  const auto g = Grammar::from_gbnf(
      "# a comment line\n"
      "root ::= greeting \" \" name   # trailing comment\n"
      "greeting ::=\n"
      "    \"hi\" |\n"
      "    \"h\\u00e9llo\"\n"
      "name ::= [A-Z] [a-z\\-]{1,4} ( \"!\" | \"\\x3F\" )?\n"
      "emoji ::= [\\U0001F600-\\U0001F64F]\n");
  EXPECT_TRUE(accepts(g, "hi Ann"));
  EXPECT_TRUE(accepts(g, "h\xC3\xA9llo Bo-b?"));
  EXPECT_FALSE(accepts(g, "hi Annnnn"));
  EXPECT_FALSE(accepts(g, "hello Ann"));
  const auto u = Grammar::from_gbnf("root ::= [^a-z]+ \"\\n\"\nx ::= \"y\"");
  EXPECT_TRUE(accepts(u, "\xF0\x9F\x98\x80\xC3\xA9Z\n"));
  EXPECT_FALSE(accepts(u, "a\n"));
  EXPECT_FALSE(accepts(u, "\xED\xA0\x80\n"));  // a surrogate is no character
  const auto d = Grammar::from_gbnf("root ::= (\"a\" | \"b\")* \"c\"");
  GrammarState s(d);
  EXPECT_TRUE(s.feed("abbac"));
  EXPECT_TRUE(s.done());  // nothing can follow: generation ends there
}

TEST(Gbnf, Errors) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"root ::= x", "line 1, column 10: rule 'x' is used but not defined"},
      {"a ::= \"x\"", "no 'root' rule"},
      {"root ::= \"a\"\nroot ::= \"b\"", "line 2, column 1: rule 'root' is defined twice"},
      {"root ::= <think>", "token references"},
      {"root ::= (\"a\"?)*", "rule 'root' can come back to itself before any text"},
      {"root ::= r \"a\"\nr ::= root \"b\" | \"c\"", "left recursion"},
      {"root ::= [b-a]", "out of order"},
      {"root ::= \"abc", "without its closing '\"'"},
      {"root ::= [abc", "without its closing ']'"},
      {"root ::= (\"a\"", "without its closing ')'"},
      {"root ::= * \"a\"", "repeats nothing"},
      {"root ::= \"a\"{2001}", "above 2000"},
      {"root ::= x y\ny ::= \"a\"\nx ::= z", "line 3, column 7: rule 'z' is used but not defined"},
      {"root ::= \"a\"\r\rroot ::= \"b\"", "line 3, column 1: rule 'root' is defined twice"},
      {"root ::= (\"a\"{2}){2}{2}{2}{2}{2}{2}{2}{2}{2}{2}", "more than 8 repetitions of a repetition"},
      {"root ::= \"a\"{3,2}", "m > n"},
      {"root ::= \"\\q\"", "unknown escape"},
      {"root ::= \"\\uD800\"", "no Unicode scalar value"},
      {"root = \"a\"", "expected '::='"},
      {"root ::= \"a\" )", "expected the end of the line"},
      {"root ::= r\nr ::= r \"x\"", "admits no finite text"},
      {"root ::= [^\\x00-\\U0010FFFF]", "matches no character"},
  };
  for (const auto& [text, why] : cases) {
    const std::string e = error_of(text);
    EXPECT_NE(e.find(why), std::string::npos) << text << " -> " << e;
  }
  // Hostile grammars end in an error or a grammar, quickly, never in a crash: a long run of
  // repetition operators, empty alternatives nested a million deep, and a bottom-up chain of
  // 50000 rules (linear, not quadratic, in the rules).
  {
    const auto g = Grammar::from_gbnf(join({"root ::= \"a\"", std::string(50000, '?'), std::string(20000, '*'), " \"b\""}));
    EXPECT_TRUE(accepts(g, "aaab"));  // "a"?...* is "a"*
    EXPECT_TRUE(accepts(g, "b"));
  }
  EXPECT_NE(error_of("root ::= ((\"x\"?){1000}){1000}").find("rules expanded"), std::string::npos);
  {
    std::string chain = "r0 ::= \"x\"\n";
    for (int k = 1; k < 50000; ++k) chain += join({"r", std::to_string(k), " ::= r", std::to_string(k - 1), "\n"});
    chain += "root ::= r49999 \"y\"\n";
    EXPECT_TRUE(accepts(Grammar::from_gbnf(chain), "xy"));
  }
  // Empty alternatives that derive the empty text many ways: each configuration once.
  const auto amb = Grammar::from_gbnf("root ::= \"a\" ( | ){11} (\"b\"? | \"c\"?){30} \"d\"");
  EXPECT_TRUE(accepts(amb, "ad"));
  EXPECT_TRUE(accepts(amb, "abcbd"));
  EXPECT_FALSE(accepts(amb, join({"a", std::string(31, 'b'), "d"})));
}

// Rules given as JSON Schemas (Grammar::from_gbnf's `schemas`): text framing JSON documents, each
// of its own schema (its $refs into itself), no whitespace added around them; a schema's error is
// thrown as a schema's; the text may not define such a rule again.
TEST(Gbnf, SchemaRules) {
  using ojson = nlohmann::ordered_json;
  const std::vector<std::pair<std::string, ojson>> schemas = {
      {"point", ojson::parse(R"({"type": "object", "properties": {"x": {"$ref": "#/$defs/n"}}, "required": ["x"],
                                 "$defs": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}})")},
      {"word", ojson::parse(R"({"enum": ["yes", "no"]})")}};
  const auto g = Grammar::from_gbnf(R"(root ::= "at " point | "say " word "!")", schemas);
  auto accepts = [&](const std::string& t) {
    GrammarState st(g);
    return st.feed(t) && st.accepting();
  };
  EXPECT_TRUE(accepts(R"(at {"x": 3})"));
  EXPECT_TRUE(accepts(R"(at {"x":9})"));
  EXPECT_TRUE(accepts(R"(say "no"!)"));
  EXPECT_FALSE(accepts(R"(at {"x": 12})"));
  EXPECT_FALSE(accepts(R"(at  {"x": 3})"));  // no whitespace before the document
  EXPECT_FALSE(accepts(R"(say "maybe"!)"));
  EXPECT_FALSE(accepts(R"(say {"x": 3}!)"));
  EXPECT_THROW(Grammar::from_gbnf("root ::= point\npoint ::= \"p\"", schemas), std::invalid_argument);
  try {
    (void)Grammar::from_gbnf("root ::= bad", {{"bad", ojson::parse(R"({"type": "string", "not": {}})")}});
    ADD_FAILURE() << "no error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("json_schema"), std::string::npos) << e.what();
  }
  EXPECT_THROW(Grammar::from_gbnf("root ::= other", schemas), std::invalid_argument);  // still undefined
}
