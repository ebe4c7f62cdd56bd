// GBNF, llama.cpp's grammar format (its server's `grammar`, vLLM's `structured_outputs.grammar`):
// parsed into rules that Grammar::from_gbnf compiles into the byte-level grammar of json_schema.h.
//
//   root  ::= "Answer: " (yes | no) "\n"
//   yes   ::= "yes" [!.]?        # a comment
//   no    ::= [nN] "o"{1,3}
//
// Rules `name ::= alternatives` (names of letters, digits, '-' and '_'; a rule ends at the end of
// its line, except inside parentheses or after '|' or '::='); `root` is the text. Terms: "literal"
// and [character class] / [^negated] with ranges, escapes \t \n \r \\ \" \[ \] \- \xHH \uHHHH
// \UHHHHHHHH, `.` (any character), rule names, ( groups ) and `|`; repetition *, +, ?, {m}, {m,},
// {m,n} (counts up to 2000, as llama.cpp); # comments. Characters are Unicode code points, the text UTF-8.
// Refused with the line and column: token references (<...>), undefined or twice-defined rules, no
// `root`.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "model/regex.h"

namespace kvq {

struct GbnfItem {
  enum Kind : uint8_t { kChars, kLiteral, kRef, kGroup } kind = kLiteral;
  CodePoints chars;                          // kChars
  std::string literal;                       // kLiteral, UTF-8
  uint32_t ref = 0;                          // kRef: the rule
  std::vector<std::vector<GbnfItem>> alts;   // kGroup: alternatives, each a sequence
  uint32_t min = 1, max = 1;                 // repeated min..max times (max UINT32_MAX: no bound)
};

struct Gbnf {
  std::vector<std::string> names;
  std::vector<std::vector<std::vector<GbnfItem>>> rules;  // each rule: alternatives, each a sequence
  uint32_t root = 0;
  // Rules defined outside the text (parse_gbnf's `external`, in its order): no alternatives here.
  std::vector<uint32_t> external;
};

// Throws std::invalid_argument "grammar line L, column C: ...". `external`: names of rules the text
// may use without defining them (defined by whoever compiles the grammar: Grammar::from_gbnf's
// JSON Schemas); the text defining one is refused as a rule defined twice.
Gbnf parse_gbnf(std::string_view text, const std::vector<std::string>& external = {});

}  // namespace kvq
