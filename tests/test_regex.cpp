// Regular expressions compiled to byte automata (model/regex.h), against std::regex (ECMAScript)
// on random patterns and texts, and on UTF-8, JSON-string encoding and length bounds.
// GCC 12 warns of maybe-uninitialized members inside std::regex's own code at -O2 with the
// sanitizers (a false positive in the library's instantiations).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <random>
#include <regex>

#include "model/json_schema.h"
#include "model/regex.h"
#include "model/unicode.h"

using namespace kvq;

namespace {

// A pattern's grammar (what generation follows) and, for UTF-8 text, its automaton over code
// points, which must agree.
struct Re {
  Re(const std::string& p, const RegexOptions& o) : g(Grammar::from_regex(p, o)), d(compile_regex(p, o)), json(o.json_string) {}
  bool matches(std::string_view bytes) const {
    GrammarState s(g);
    const bool ok = s.feed(bytes) && s.accepting();
    if (!json) {
      EXPECT_EQ(ok, d.matches(bytes)) << bytes;
    }
    return ok;
  }
  std::shared_ptr<const Grammar> g;
  RegexDfa d;
  bool json;
};

std::string error_of(const std::string& pattern, RegexOptions o = {}) {
  try {
    compile_regex(pattern, o);
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

// A random pattern over a small alphabet, in the syntax both kvq and std::regex take.
std::string random_pattern(std::mt19937& rng, int depth) {
  auto pick = [&](int n) { return std::uniform_int_distribution<int>(0, n - 1)(rng); };
  static const std::vector<std::string> atoms = {"a", "b", "c", "1", ".", "[ab]", "[^a]", "[a-c1]", "\\d", "\\D",
                                                 "\\w", "\\s", "\\S", "[^\\d]", "\\.", " ", "\\n", "[\\s1]"};
  std::string out;
  const int items = 1 + pick(3);
  for (int i = 0; i < items; ++i) {
    std::string a;
    if (depth > 0 && pick(4) == 0) {
      // (appended piece by piece: GCC 12 warns of -Wrestrict on "(" + std::string)
      a = "(";
      if (pick(2)) a += "?:";
      a += random_pattern(rng, depth - 1);
      if (pick(2)) {
        a += '|';
        a += random_pattern(rng, depth - 1);
      }
      a += ')';
    } else {
      a = atoms[size_t(pick(int(atoms.size())))];
    }
    // (Counted repetitions of groups are left to the tests below: nested ones of overlapping
    // classes make automata of tens of thousands of states.)
    static const std::vector<std::string> quants = {"", "", "", "*", "+", "?", "{2}", "{1,2}", "{0,3}", "{2,}", "*?", "+?"};
    out += a + quants[size_t(pick(a[0] == '(' ? 6 : int(quants.size())))];
  }
  return out;
}

std::string random_text(std::mt19937& rng) {
  static const std::string alphabet = "abc1 .\nx";
  const int n = std::uniform_int_distribution<int>(0, 7)(rng);
  std::string s;
  for (int i = 0; i < n; ++i) s += alphabet[size_t(std::uniform_int_distribution<int>(0, int(alphabet.size()) - 1)(rng))];
  return s;
}

}  // namespace

TEST(Regex, MatchesAsStdRegexOnRandomPatterns) {
  std::mt19937 rng(5);
  int matched = 0, searched = 0, total = 0;
  for (int k = 0; k < 400; ++k) {
    std::string p = random_pattern(rng, 2);
    if (k % 3 == 1) p.insert(0, 1, '^');
    if (k % 5 == 2) p += "$";
    if (k % 7 == 3) {
      p += '|';
      p += random_pattern(rng, 1);
    }
    SCOPED_TRACE(p);
    const std::regex ref(p, std::regex::ECMAScript);
    RegexOptions full, search;
    search.search = true;
    const Re f(p, full);
    const Re s(p, search);
    for (int t = 0; t < 40; ++t) {
      const std::string text = random_text(rng);
      // Full match: anchors are no-ops there, as with std::regex_match.
      const bool want_full = std::regex_match(text, ref);
      ASSERT_EQ(f.matches(text), want_full) << "'" << text << "'";
      const bool want_search = std::regex_search(text, ref);
      ASSERT_EQ(s.matches(text), want_search) << "search '" << text << "'";
      matched += want_full;
      searched += want_search;
      ++total;
    }
  }
  // Both answers occur often enough for the comparison to mean something.
  EXPECT_GT(matched, total / 20);
  EXPECT_GT(searched, total / 5);
  EXPECT_LT(searched, total - total / 10);
}

TEST(Regex, Utf8) {
  const Re dot(".", {});
  // Every code point but the line terminators, as UTF-8, and nothing else.
  for (uint32_t cp = 0; cp <= 0x10FFFF; cp += (cp < 0x3000 ? 1 : 97)) {
    if (cp >= 0xD800 && cp <= 0xDFFF) continue;
    std::string s;
    unicode::utf8_append(s, cp);
    const bool terminator = cp == '\n' || cp == '\r' || cp == 0x2028 || cp == 0x2029;
    ASSERT_EQ(dot.matches(s), !terminator) << cp;
  }
  for (const char* bad : {"\xC0\x80", "\xC1\xBF", "\xE0\x80\x80", "\xED\xA0\x80", "\xF4\x90\x80\x80", "\xF5\x80\x80\x80",
                          "\x80", "\xC3", "\xE2\x82", "\xFF"})
    EXPECT_FALSE(dot.matches(bad)) << bad;
  const Re two("^.{2}$", {});
  EXPECT_TRUE(two.matches("é😀"));
  EXPECT_FALSE(two.matches("é"));
  EXPECT_FALSE(two.matches("ab\n"));
  const Re range("[à-ü]+[^a-z]", {});
  EXPECT_TRUE(range.matches("àéü€"));
  EXPECT_TRUE(range.matches("ç😀"));
  EXPECT_FALSE(range.matches("àa"));
  EXPECT_FALSE(range.matches("ýA"));
  EXPECT_TRUE(Re("\\u{1F600}\\u00e9\\x41", {}).matches("😀éA"));
  EXPECT_TRUE(Re("\\s+", {}).matches(" \t\xC2\xA0\xE3\x80\x80"));  // U+00A0, U+3000
  EXPECT_FALSE(Re("\\S", {}).matches("\xE2\x80\xA8"));  // U+2028
  // What ECMA-262 and Python's re both match: \d and \w ASCII (Python's are Unicode), \s
  // without U+FEFF (Python's lacks it); negations leave out what either reading matches.
  const std::vector<std::pair<std::string, std::string>> neither = {
      {"\\W", "é"},          {"\\W", "\xD9\xA3"},  // U+0663 ARABIC-INDIC DIGIT THREE
      {"\\D", "\xD9\xA3"},  {"[^\\d]", "\xD9\xA3"}, {"\\w", "é"},          {"\\d", "\xD9\xA3"},
      {"\\s", "\xEF\xBB\xBF"},                            // U+FEFF
      {"\\S", "\x1C"},       {"\\S", "\xC2\x85"},      {"[^\\s]", "\xC2\x85"}, {"\\S", "\xEF\xBB\xBF"}};
  for (const auto& [p, text] : neither) EXPECT_FALSE(Re(p, {}).matches(text)) << p << " " << text;
  for (const auto& [p, text] : std::vector<std::pair<std::string, std::string>>{
           {"\\W", "-"}, {"\\D", "x"}, {"[^\\d]", "é"}, {"\\S", "é"}, {"[^\\w]", "+"}, {"\\s", "\xE2\x80\xA9"}})
    EXPECT_TRUE(Re(p, {}).matches(text)) << p << " " << text;
}

TEST(Regex, JsonStringEncodingAndLengths) {
  RegexOptions o;
  o.json_string = true;
  // Each character in one JSON encoding.
  const Re any("^.*$", o);
  EXPECT_TRUE(any.matches(R"(a\"b\\c\t\u0001é)"));
  EXPECT_FALSE(any.matches("a\"b"));     // a raw quote cannot come
  EXPECT_FALSE(any.matches("a\\"));      // half an escape
  EXPECT_FALSE(any.matches("\\u0041"));  // 'A' is written as itself
  EXPECT_FALSE(any.matches("\x01"));     // a raw control character
  EXPECT_FALSE(any.matches("\\n"));      // '.' is no line terminator
  const Re q("^[\"\\\\]\\n$", o);
  EXPECT_TRUE(q.matches("\\\"\\n"));
  EXPECT_TRUE(q.matches("\\\\\\n"));
  EXPECT_FALSE(q.matches("\"\n"));
  // Random texts over characters that JSON escapes: the encoding nlohmann writes is accepted iff
  // the text matches.
  std::mt19937 rng(9);
  const std::string alphabet = "ab\"\\\n\t\x01 ";
  const Re ab("a[^a]*b|\"\\\\", o);
  o.search = true;
  const Re ab_search("a[^a]*b|\"\\\\", o);
  const std::regex ref("a[^a]*b|\"\\\\");
  for (int k = 0; k < 2000; ++k) {
    std::string text;
    for (int i = std::uniform_int_distribution<int>(0, 6)(rng); i > 0; --i)
      text += alphabet[size_t(std::uniform_int_distribution<int>(0, int(alphabet.size()) - 1)(rng))];
    const std::string quoted = nlohmann::json(text).dump();
    const std::string enc = quoted.substr(1, quoted.size() - 2);
    ASSERT_EQ(ab.matches(enc), std::regex_match(text, ref)) << enc;
    ASSERT_EQ(ab_search.matches(enc), std::regex_search(text, ref)) << enc;
  }
  // Lengths in code points, an escape or a multi-byte character counting one.
  RegexOptions len;
  len.json_string = true;
  len.min_len = 2;
  len.max_len = 3;
  const Re b("^[a-z\"é]+$", len);
  EXPECT_FALSE(b.matches("a"));
  EXPECT_TRUE(b.matches("a\\\""));
  EXPECT_TRUE(b.matches("éé"));
  EXPECT_TRUE(b.matches("éaé"));
  EXPECT_FALSE(b.matches("éaéa"));
  len.search = true;
  const Re s("x", len);
  EXPECT_TRUE(s.matches("ax"));
  EXPECT_TRUE(s.matches("x\\n"));
  EXPECT_FALSE(s.matches("x"));
  EXPECT_FALSE(s.matches("aaax"));
  len.min_len = 0;
  len.max_len = UINT32_MAX;
  len.min_len = 5;
  EXPECT_TRUE(Re("^b", len).matches("bcdef"));
  EXPECT_FALSE(Re("^b", len).matches("bcde"));
  EXPECT_NE(error_of("^abcd$", len).find("no text matches it within the length bounds"), std::string::npos);
}

// The automata combined for property names: complements, finite sets of words, length bounds and
// products, against their definitions on random texts over a small alphabet.
TEST(Regex, ComplementWordsLengthsAndProducts) {
  const RegexDfa words = dfa_of_words({"ab", "a", "é", ""});
  const RegexDfa other = dfa_complement(words);
  const RegexDfa ab = compile_regex("a[bc]+|é", {});
  const RegexDfa len = dfa_of_length(1, 2);
  const RegexDfa len_open = dfa_of_length(2, UINT32_MAX);
  const RegexDfa both = intersect(other, ab);
  const RegexDfa not_ab = dfa_complement(ab);
  std::mt19937 rng(5);
  const std::vector<std::string> alphabet = {"a", "b", "c", "é", "\n", "😀"};
  for (int k = 0; k < 3000; ++k) {
    std::string t;
    const int n = std::uniform_int_distribution<int>(0, 4)(rng);
    for (int i = 0; i < n; ++i) t += alphabet[std::uniform_int_distribution<size_t>(0, alphabet.size() - 1)(rng)];
    const bool word = t == "ab" || t == "a" || t == "é" || t.empty();
    const bool re = std::regex_match(t, std::regex("a[bc]+")) || t == "é";
    size_t cps = 0;
    for (unsigned char c : t) cps += (c & 0xC0) != 0x80;
    ASSERT_EQ(words.matches(t), word) << t;
    ASSERT_EQ(other.matches(t), !word) << t;
    ASSERT_EQ(ab.matches(t), re) << t;
    ASSERT_EQ(not_ab.matches(t), !re) << t;
    ASSERT_EQ(both.matches(t), re && !word) << t;
    ASSERT_EQ(len.matches(t), cps >= 1 && cps <= 2) << t;
    ASSERT_EQ(len_open.matches(t), cps >= 2) << t;
  }
  EXPECT_TRUE(dfa_complement(dfa_of_words({})).matches("anything"));  // the complement of nothing
  EXPECT_TRUE(dfa_of_words({}).states.empty());
  EXPECT_TRUE(intersect(words, dfa_of_words({"zz"})).states.empty());
  EXPECT_TRUE(dfa_complement(dfa_of_length(0, UINT32_MAX)).states.empty());  // every text: no complement
  EXPECT_THROW(intersect(compile_regex("[a-z]{30}", {}), dfa_of_length(0, 40), 10), std::invalid_argument);
}

TEST(Regex, RefusesWhatItDoesNotSupport) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"(a)\\1", "backreferences"},       {"(?P<x>a)(?P=x)", "backreferences"}, {"(?=a)b", "lookahead"},
      {"(?<!a)b", "lookbehind"},          {"\\bword", "word boundaries"},        {"\\p{L}", "property"},
      {"(?i)abc", "inline flags"},        {"a{1001}", "above 1000"},             {"a**", "cannot follow"},
      {"a++", "possessive"},              {"[]a]", "empty class"},               {"a^b", "'^' is supported only"},
      {"a$b", "'$' is supported only"},   {"(a", "missing ')'"},                 {"a)", "unmatched ')'"},
      {"[ab", "missing ']'"},             {"ab\\", "at the end"},                {"[z-a]", "out of order"},
      {"\\q", "unknown escape"},          {"*a", "nothing to repeat"},           {"a{3,2}", "n > m"},
      {"\\uD83D\\uDE00", "surrogate escape"},      {"\\u{110000}", "above U+10FFFF"},     {"(^a)", "'^' is supported only"},
      {"\\x4", "hex digits"},             {"a{,2}", "write {0,n}"}, {"a{,}", "write {0,n} or *"},              {"\\Z", "anchors other"},
      {"\xC3(", "not valid UTF-8"},       {"\\012", "octal"}};
  for (const auto& [p, why] : cases) {
    const std::string e = error_of(p);
    EXPECT_NE(e.find(why), std::string::npos) << p << " -> " << e;
    EXPECT_NE(e.find("at offset"), std::string::npos) << e;
  }
  // A literal '{' that starts no quantifier, and lazy quantifiers, are fine.
  EXPECT_TRUE(Re("a{b{x}{2,", {}).matches("a{b{x}{2,"));
  EXPECT_TRUE(Re("[\\d-z]+", {}).matches("1-z"));  // '-' after a class escape is itself
  EXPECT_TRUE(Re("a+?b??", {}).matches("aab"));
  RegexOptions small;
  small.max_states = 50;
  small.max_len = 20;
  EXPECT_NE(error_of("(a|b)*a(a|b){8}", small).find("states with these length bounds"), std::string::npos);
  EXPECT_NE(error_of(std::string(300, '(') + "a" + std::string(300, ')')).find("nested deeper than 200"), std::string::npos);
  // Budgets: patterns whose automata would take too long or too much memory are refused.
  EXPECT_NE(error_of("((a?){1000}){499}").find("more than 200000 states"), std::string::npos);
  RegexOptions search;
  search.search = true;
  EXPECT_NE(error_of("((a?){550}){2}(b|c)*b(b|c){12}", search).find("too complex"), std::string::npos);
  RegexOptions json_search = search;
  json_search.json_string = true;
  EXPECT_THROW(Grammar::from_regex("[a-z].{120}", json_search), std::invalid_argument);  // an NFA of too many stacks
  // Length bounds that the pattern keeps anyway need no counter.
  RegexOptions bounded;
  bounded.max_len = 5000;
  EXPECT_EQ(compile_regex("^cat-[0-9]{3}$", bounded).states.size(), compile_regex("^cat-[0-9]{3}$", {}).states.size());
  EXPECT_TRUE(Re("^[a-z]+$", bounded).matches(std::string(5000, 'a')));
  EXPECT_FALSE(Re("^[a-z]+$", bounded).matches(std::string(5001, 'a')));
}

// Past max_states the automaton is the NFA: the same texts match.
TEST(Regex, LargeAutomataRunAsTheNfa) {
  const std::string p = "(a|b)*a(a|b){11}c";  // 2^12 states as a DFA
  RegexOptions big;
  big.max_states = 10000;
  const Re det(p, big);
  EXPECT_TRUE(det.d.deterministic);
  EXPECT_GT(det.d.states.size(), 4000u);
  RegexOptions small;
  small.max_states = 100;
  const Re nfa(p, small);
  EXPECT_FALSE(nfa.d.deterministic);
  EXPECT_LT(nfa.d.states.size(), 100u);
  const std::regex ref(p);
  std::mt19937 rng(2);
  int yes = 0;
  for (int k = 0; k < 300; ++k) {
    std::string t;
    for (int i = std::uniform_int_distribution<int>(10, 20)(rng); i > 0; --i) t += "ab"[rng() & 1];
    if (k & 1) t += 'c';
    const bool want = std::regex_match(t, ref);
    yes += want;
    ASSERT_EQ(nfa.matches(t), want) << t;
    ASSERT_EQ(det.matches(t), want) << t;
  }
  EXPECT_GT(yes, 30);
}

TEST(Regex, GuidedRegexGrammar) {
  const auto g = Grammar::from_regex("(yes|no), [0-9]{2}");
  GrammarState s(g);
  EXPECT_FALSE(s.accepting());
  EXPECT_TRUE(s.feed("yes, 4"));
  EXPECT_FALSE(s.feed("a"));
  EXPECT_TRUE(s.feed("2"));
  EXPECT_TRUE(s.done());
  GrammarState t(g);
  EXPECT_FALSE(t.feed("maybe"));
  try {
    Grammar::from_regex("(?=x)");
    ADD_FAILURE() << "accepted a lookahead";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("pattern \"(?=x)\": lookahead"), std::string::npos) << e.what();
  }
}
