// libFuzzer target for structured output's compilers and automaton: arbitrary bytes as a regular
// expression, a GBNF grammar or a JSON Schema (the first byte picks which) must compile or be
// refused with std::invalid_argument, never crash; a compiled grammar then reads the rest of the
// input (after a 0xFF separator, or the pattern itself) byte by byte and must keep its invariants:
// a refused byte leaves the state as it was, an accepting state has an empty stack, and for a
// regular expression on UTF-8 text the grammar and the automaton over code points agree.
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

#include "model/json_schema.h"
#include "model/regex.h"
#include "model/unicode.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const int mode = data[0] % 4;
  const std::string_view rest(reinterpret_cast<const char*>(data + 1), size - 1);
  const size_t cut = rest.find('\xFF');
  const std::string_view source = rest.substr(0, cut);
  const std::string_view text = cut == std::string_view::npos ? source : rest.substr(cut + 1);
  std::shared_ptr<const kvq::Grammar> g;
  kvq::RegexDfa dfa;
  kvq::RegexOptions opt;
  opt.search = (data[0] / 4) & 1;
  opt.json_string = mode == 1;
  try {
    switch (mode) {
      case 0:
      case 1:
        g = kvq::Grammar::from_regex(source, opt);
        dfa = kvq::compile_regex(source, opt);
        break;
      case 2: g = kvq::Grammar::from_gbnf(source); break;
      default: g = kvq::Grammar::from_schema_text(source); break;
    }
  } catch (const std::invalid_argument&) {
    return 0;  // refused, with a message
  }
  kvq::GrammarState s(g);
  if (s.n_stacks() == 0) __builtin_trap();  // compiled grammars start with somewhere to go
  size_t fed = 0;
  for (unsigned char c : text) {
    const kvq::GrammarState before = s;
    if (!s.feed(c)) {
      if (!(s == before)) __builtin_trap();
      break;
    }
    ++fed;
    if (s.n_stacks() == 0) __builtin_trap();
  }
  if (s.done() && !s.accepting()) __builtin_trap();
  if (mode == 0 && kvq::unicode::utf8_is_valid(text)) {
    kvq::GrammarState whole(g);
    const bool by_grammar = whole.feed(text) && whole.accepting();
    if (by_grammar != dfa.matches(text)) __builtin_trap();
  }
  (void)fed;
  return 0;
}
