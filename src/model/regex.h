// Regular expressions for structured output (JSON Schema's `pattern`, vLLM's `guided_regex`),
// compiled into a deterministic automaton over the bytes of the text they describe, which the
// grammar (json_schema.h) runs one rule per state.
//
// Syntax: ECMA-262's, as JSON Schema's `pattern` takes it, in the part Python's `re` reads the same
// (vLLM's regexes, Python's jsonschema): literals (any UTF-8 text), `.`, character classes `[...]`
// / `[^...]` with ranges and escapes, `\d \D \w \W \s \S`, `\t \n \r \f \v \0 \xHH \uHHHH`
// `\u{H...}` `\cX` and escaped punctuation, groups `(...)`, `(?:...)`, `(?<name>...)`,
// `(?P<name>...)`, alternation `|`, the quantifiers `* + ? {n} {n,} {n,m}` (lazy `?` accepted: it
// does not change what matches; n, m <= 1000), and `^` / `$` at the start / end of the pattern or
// of one of its top-level alternatives. `.` is any code point but the line terminators (\n, \r,
// U+2028, U+2029), as in ECMA-262. Where the two readings differ, the automaton takes only what
// both match: \d and \w are ASCII (Python's are Unicode), \s is ECMA-262's without U+FEFF, and
// \D \W \S and negated classes leave out what either reading would take as a digit, word
// character or space.
// Refused, with an error naming it and where: backreferences, lookaround, word boundaries (\b \B),
// Unicode property escapes (\p), inline flags, anchors elsewhere, possessive quantifiers, surrogate
// escapes, `[]`, `{,n}` and `{,}` (read differently by the two), groups nested deeper than 200, and
// patterns whose automata would be too large to build per request.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kvq {

using CodePoints = std::vector<std::pair<uint32_t, uint32_t>>;  // ranges of code points, sorted, disjoint
// Any ranges sorted, merged and without the surrogates (no text holds them); and the code points
// not in a set.
CodePoints normalize_code_points(CodePoints ranges);
CodePoints complement_code_points(const CodePoints& set);

// The automaton over code points: each state's transitions on sets of code points, disjoint when
// it is deterministic (up to RegexOptions::max_states states); past that, the pattern's NFA
// without its empty moves, whose sets may overlap (the text may be in several states at once).
struct RegexDfa {
  struct State {
    bool accept = false;
    std::vector<std::pair<CodePoints, uint32_t>> next;
  };
  std::vector<State> states;  // 0 is the start; every state can reach an accepting one
  bool deterministic = true;
  // The UTF-8 text is accepted (a reference for tests; the grammar runs the states itself).
  bool matches(std::string_view utf8) const;
};

struct RegexOptions {
  // The text is the inside of a JSON string (without its quotes): written as encode_code_points
  // writes it (Grammar::from_regex).
  bool json_string = false;
  // JSON Schema's `pattern`: a match anywhere in the text, unless `^` / `$` anchor it. Otherwise
  // (vLLM's guided_regex) the whole text matches, and `^` / `$` change nothing.
  bool search = false;
  // The text's length in code points (JSON Schema's minLength / maxLength).
  uint32_t min_len = 0;
  uint32_t max_len = UINT32_MAX;
  // Past it, the NFA (16 times as many with a length bound the pattern does not keep by itself,
  // whose counter the NFA cannot carry: past that the pattern is refused).
  size_t max_states = 4000;
};

// Throws std::invalid_argument naming what is wrong or not supported (with its offset in the
// pattern), or a pattern that no text matches within the length bounds.
RegexDfa compile_regex(std::string_view pattern, const RegexOptions& opt);

// The texts both deterministic automata accept (no states when there are none); throws
// std::invalid_argument past max_states states.
RegexDfa intersect(const RegexDfa& a, const RegexDfa& b, size_t max_states = SIZE_MAX);
// The texts a deterministic automaton does not accept.
RegexDfa dfa_complement(const RegexDfa& d);
// Exactly these UTF-8 texts.
RegexDfa dfa_of_words(const std::vector<std::string>& words);
// Any text of min_len to max_len code points (max_len UINT32_MAX: unbounded).
RegexDfa dfa_of_length(uint32_t min_len, uint32_t max_len);

// The bytes of a set of code points, as sequences of byte sets: UTF-8, or with json_string each
// code point in one JSON encoding: `\"`, `\\`, `\b \f \n \r \t`, `\u00xx` for the other control
// characters, UTF-8 for the rest.
using ByteClass = std::array<uint64_t, 4>;
using ByteSeq = std::vector<ByteClass>;
std::vector<ByteSeq> encode_code_points(const CodePoints& set, bool json_string);

}  // namespace kvq
