// Structured output (OpenAI's response_format {"type": "json_schema"}, vLLM's guided_json and
// guided_choice): generation constrained, token by token, to JSON text that a JSON Schema accepts,
// or to one of a list of strings.
//
// Grammar::from_schema compiles a schema into a byte-level context-free grammar. Its terminals
// are byte sets, plus three elements the automaton runs itself: a JSON string (quotes, escapes,
// well-formed UTF-8 and, when the schema bounds it, its length in code points), an integer within
// bounds, and the gap between tokens (at most one space or tab, or a newline and at most
// kJsonMaxIndent spaces or tabs). GrammarState is the set of parse stacks that the bytes so far
// leave open (a schema's alternatives, anyOf or optional properties, can keep several open until
// a byte decides).
//
// What the generated text looks like:
// - an object's properties come in the schema's order; every required one is there, the others
//   may be left out; no other property unless `additionalProperties` is true or a schema (absent
//   means none, as llama.cpp's converter and OpenAI's strict mode); extra properties come after
//   the listed ones, named by any string that is none of the listed names (it leaves them, between
//   two characters, at a printable ASCII character);
// - numbers have at most 16 integer digits, 16 fraction digits and 2 exponent digits (within a
//   double's range);
// - `enum` / `const` values are filtered by the type, length and bounds beside them;
// - `oneOf` is generated as `anyOf` (a value matching two of its branches is possible);
// - formats: date is a calendar date of years 0001-9999 (February to the 28th), time RFC 3339's
//   full-time without leap seconds, date-time the two joined by 'T', uuid 8-4-4-4-12 hex digits,
//   ipv4 four octets without leading zeros.
// - `pattern` (regex.h) holds for the string's text (a match anywhere unless `^` / `$` anchor it,
//   as validators read it), together with minLength / maxLength; each character is written in one
//   JSON encoding (`\"`, `\\`, `\n`-style or `\u00XX` escapes for the characters JSON escapes,
//   UTF-8 for the rest).
// Supported keywords: type (a name or a list), properties, required, additionalProperties,
// patternProperties and propertyNames (names ruled by automata; beside patterns the names not
// listed are printable ASCII, where ECMA-262's and Python's readings of a pattern agree),
// minProperties, maxProperties (the properties written are counted, extra ones too; toward
// minProperties the extra ones once, as their names could repeat), items
// (a schema, or a list: a tuple), prefixItems, minItems, maxItems, uniqueItems (items of finitely
// many values: an enum or const, also through $ref, or booleans; the items are then a subsequence
// of the values in their written order), minLength, maxLength, pattern, minimum,
// maximum, exclusiveMinimum, exclusiveMaximum (on integers, and on numbers exactly in decimal, which
// are then written without an exponent), multipleOf (by an integer: integers, also for numbers,
// written as integers; on numbers by a power of ten below 1, 0.01: at most that many fraction
// digits, without an exponent), format (date, time, date-time, uuid,
// ipv4), enum, const, anyOf, oneOf, allOf (merged into one schema; an anyOf / oneOf among its
// schemas distributed; a branch or optional property no value fits left out), $ref (a JSON pointer into the document:
// #/$defs/..., #/definitions/..., #), $defs and definitions. Annotations (title, description,
// default, examples, $schema, $id, $comment, ...) are ignored, and so are other formats (an
// annotation by default in JSON Schema 2020-12: plain strings). The other validation keywords
// (multipleOf by other steps, such as 0.25, uniqueItems over other items, not, if, ...) are refused with
// an error that names them, rather than generating text the schema would reject.
//
// grammar_mask() sets to -inf the logits of the tokens whose bytes cannot continue the text. It
// walks the vocabulary as a trie (GrammarVocab), so a byte that cannot come next rules out every
// token that starts with it at once; inside strings, the tokens of plain string text (JsonVocab's
// flag) that fit the length left are allowed without a walk, and only the others are walked.
// Limits: nesting to about 100 levels, at most kMaxStacks parse stacks open at once, objects of
// at most 1000 properties, const / enum values nested at most 64 levels.
#pragma once
#include <array>
#include <cstdint>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "model/regex.h"

namespace kvq {

class JsonVocab;

class Grammar {
 public:
  // Throws std::invalid_argument with the schema location (a JSON pointer) and the reason. An
  // ordered_json keeps the properties in the order they were written, which is the order they
  // are generated in.
  static std::shared_ptr<const Grammar> from_schema(const nlohmann::ordered_json& schema);
  static std::shared_ptr<const Grammar> from_schema_text(std::string_view text);
  // vLLM's guided_choice: the text is exactly one of the choices (no quotes, nothing around it).
  // Throws std::invalid_argument for no choice, or one longer than 4096 bytes.
  static std::shared_ptr<const Grammar> from_choices(const std::vector<std::string>& choices);
  // vLLM's guided_regex: the whole text matches the regular expression (regex.h: ECMA-262 syntax;
  // `opt` as compile_regex takes it, and json_string for the inside of a JSON string, written as
  // encode_code_points writes it). Throws std::invalid_argument naming what is not supported, or a
  // pattern nothing matches.
  static std::shared_ptr<const Grammar> from_regex(std::string_view pattern, const RegexOptions& opt = {});
  // llama.cpp's GBNF (its server's `grammar`, vLLM's structured_outputs.grammar; gbnf.h): the text
  // of rule `root`. Throws std::invalid_argument naming the line and column, or a rule that comes
  // back to itself before any text (left recursion), which the parse stacks cannot run.
  // `schemas`: rules the text uses without defining them, each a JSON document of its schema (no
  // whitespace around it; its $refs point into that schema), for a grammar that frames JSON in
  // text of its own (a model's function-call syntax around the arguments). A schema's errors are
  // thrown as from_schema's.
  static std::shared_ptr<const Grammar> from_gbnf(std::string_view text);
  static std::shared_ptr<const Grammar> from_gbnf(std::string_view text,
                                                  const std::vector<std::pair<std::string, nlohmann::ordered_json>>& schemas);
  // JSON mode's grammar (response_format json_object): {"type": "object"}, any JSON object.
  static const std::shared_ptr<const Grammar>& json_object();

  // A byte that would make a parse stack deeper than kMaxStack - kHeadroom cannot come (a document
  // nested past ~100 levels); the headroom is for what completes the document.
  static constexpr size_t kMaxStack = 400;
  static constexpr size_t kHeadroom = 80;
  // A byte that would leave more open stacks than this cannot come (a schema whose alternatives
  // stay undecided that long); the mask's cost grows with the open stacks.
  static constexpr size_t kMaxStacks = 1024;

  enum Kind : uint8_t { kEnd, kBytes, kRule, kStr, kWs, kInt };
  struct Elem {
    Kind kind;
    uint32_t arg;  // kBytes: byte set; kRule: rule; kStr: string bounds; kInt: integer bounds
  };
  // An integer in [lo, hi] (minimum / maximum): a digit can come only while some number it starts
  // is in the range.
  struct IntBounds {
    int64_t lo, hi;
    int64_t multiple = 1;  // multipleOf
  };
  struct StrBounds {
    uint32_t min_len = 0;
    uint32_t max_len = UINT32_MAX;
    bool opened = false;  // the opening quote is not part of it (read before)
    bool free() const { return min_len == 0 && max_len == UINT32_MAX; }
  };
  using ByteSet = std::array<uint64_t, 4>;

  size_t n_rules() const { return rules_.size(); }

 private:
  friend class GrammarState;
  friend class SchemaCompiler;
  std::vector<Elem> elems_;                  // alternatives, each ended by kEnd
  std::vector<std::vector<uint32_t>> rules_; // each rule: its alternatives' first elements
  std::vector<ByteSet> sets_;
  std::vector<StrBounds> strs_;
  std::vector<IntBounds> ints_;
  uint32_t root_ = 0;
};

class GrammarState {
 public:
  struct Frame {
    uint32_t pos;  // the element to match next (below the top: where to return)
    uint64_t sub;  // kStr / kWs: progress inside the element
    bool operator==(const Frame& o) const { return pos == o.pos && sub == o.sub; }
    bool operator<(const Frame& o) const { return pos != o.pos ? pos < o.pos : sub < o.sub; }
  };
  using Stack = std::vector<Frame>;

  explicit GrammarState(std::shared_ptr<const Grammar> g);

  // false: c cannot come next (the state is then unchanged).
  bool feed(unsigned char c);
  bool feed(std::string_view bytes);
  // The text so far is a whole document (end of generation may come).
  bool accepting() const;
  // Accepting, and no byte can follow (an object or array closed at the top).
  bool done() const;
  // Inside a string, between characters, in every open stack: plain string text (no '"', '\\' or
  // control character, whole UTF-8 characters) goes on while it fits. Returns the most code points
  // one more piece of text can have (UINT32_MAX: no bound), or -1 when not in a string everywhere.
  int64_t string_room() const;
  bool in_free_string() const { return string_room() == int64_t(UINT32_MAX); }
  size_t n_stacks() const { return stacks_.size(); }
  // Rules expanded for one byte at most (a grammar whose empty alternatives branch past it refuses
  // the byte).
  static constexpr size_t kMaxExpansion = 1 << 16;
  // Two states of one grammar are equal when their parse stacks are (what follows is the same).
  bool operator==(const GrammarState& o) const { return g_ == o.g_ && stacks_ == o.stacks_; }
  size_t hash() const;
  size_t n_frames() const {
    size_t n = 0;
    for (const Stack& st : stacks_) n += st.size();
    return n;
  }

  // The state after c, in `out` (false and `out` empty when c cannot come next). For the mask's
  // walk, which keeps one state per depth of the vocabulary trie.
  bool step(unsigned char c, GrammarState& out) const;

 private:
  // Pushes onto `out` (past out[from]) the stacks `stack` opens (each with a terminal on top, or
  // empty: the document is complete). false past kMaxStack or kMaxStacks (distinct stacks), or past
  // kMaxExpansion rules expanded: what it pushed is to be dropped. Past 1024 rules expanded in one
  // call (alternatives that can be empty, nested: `("a"? | "b"?)*`), each configuration is
  // expanded once.
  struct Expansion {
    size_t from = 0;  // out[from...] is this expansion's
    size_t work = 0;
    std::set<Stack> seen;
  };
  bool expand(Stack& stack, std::vector<Stack>& out, Expansion& x, int depth) const;
  static void normalize(std::vector<Stack>& stacks);

  std::shared_ptr<const Grammar> g_;
  std::vector<Stack> stacks_;  // sorted, unique; an empty stack = a complete document
};

// The vocabulary as a trie over each token's bytes (JsonVocab's: Tokenizer::token_piece), in preorder: each
// node has its byte, its depth, the end of its subtree and the tokens whose bytes end there.
class GrammarVocab {
 public:
  explicit GrammarVocab(const JsonVocab& vocab);
  int32_t n_vocab() const { return int32_t(bytes_.size()); }
  const std::string& bytes(int32_t id) const { return bytes_[size_t(id)]; }

  struct Node {
    uint32_t end;        // preorder index past this node's subtree
    uint32_t tok_begin;  // tokens_[tok_begin, tok_begin + tok_count) end at this node
    uint32_t tok_count;
    uint16_t depth;      // 1 for the root's children
    uint8_t byte;
  };
  struct Trie {
    std::vector<Node> nodes;
    std::vector<int32_t> tokens;
    uint16_t max_depth = 0;
  };

 private:
  friend int grammar_mask(const GrammarState&, const GrammarVocab&, const std::vector<int32_t>&, float*, int);
  static Trie build(const std::vector<std::string>& bytes, const std::vector<int32_t>& ids);
  std::vector<std::string> bytes_;
  std::vector<int32_t> eog_ids_;  // the end-of-generation tokens
  std::vector<char> text_;  // JsonVocab::string_text
  std::vector<uint32_t> text_len_;  // and such a token's length in code points
  Trie all_;                // every token with bytes
  Trie special_;            // those that are not plain string text
};

// Sets logits[t] = -inf for every token t that cannot come after `state`; stop_ids end generation
// as end-of-generation tokens do (only once the document is complete). Returns the number of
// tokens left allowed (when none would be, the end-of-generation tokens are left).
int grammar_mask(const GrammarState& state, const GrammarVocab& vocab, const std::vector<int32_t>& stop_ids,
                 float* logits, int n_vocab);

}  // namespace kvq
