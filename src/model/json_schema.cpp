#include "model/json_schema.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <deque>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <unordered_map>
#include <stdexcept>
#include <tuple>

#include "model/gbnf.h"
#include "model/json_constraint.h"
#include "model/regex.h"
#include "model/unicode.h"

namespace kvq {

namespace {

using json = nlohmann::ordered_json;
using Elem = Grammar::Elem;
using Seq = std::vector<Elem>;
using ByteSet = Grammar::ByteSet;

constexpr uint32_t kUnbounded = UINT32_MAX;

bool has(const ByteSet& s, unsigned char c) { return (s[c >> 6] >> (c & 63)) & 1; }

// ---- the string element: its progress packed into a Frame's sub ----

enum StrPhase : uint8_t { kOpen = 0, kBody, kEscape, kHex, kUtf8 };
struct StrSub {
  uint8_t phase = kOpen;
  uint8_t left = 0;  // kHex: digits to go; kUtf8: continuation bytes to go
  bool low = false;  // a \uD800-\uDBFF escape waits for its low half
  uint8_t lo = 0x80, hi = 0xBF;  // kUtf8: the range of the next byte
  uint16_t code = 0;             // kHex: the escape's value so far
  uint32_t count = 0;            // code points so far (counted only when the string is bounded)
};
uint64_t pack(const StrSub& s) {
  return uint64_t(s.phase) | uint64_t(s.left) << 3 | uint64_t(s.low) << 6 | uint64_t(s.lo) << 8 |
         uint64_t(s.hi) << 16 | uint64_t(s.code) << 24 | uint64_t(s.count) << 40;
}
StrSub unpack(uint64_t v) {
  StrSub s;
  s.phase = uint8_t(v & 7);
  s.left = uint8_t(v >> 3 & 7);
  s.low = (v >> 6 & 1) != 0;
  s.lo = uint8_t(v >> 8);
  s.hi = uint8_t(v >> 16);
  s.code = uint16_t(v >> 24);
  s.count = uint32_t(v >> 40);
  return s;
}
constexpr uint64_t kStrFail = ~uint64_t(0);
constexpr uint64_t kStrClosed = ~uint64_t(0) - 1;
constexpr uint32_t kMaxCount = (1u << 24) - 1;

bool is_hex(unsigned char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }

void count_char(StrSub& s, const Grammar::StrBounds& b) {
  if (!b.free() && s.count < kMaxCount) ++s.count;
}

uint64_t str_step(const Grammar::StrBounds& b, uint64_t sub, unsigned char c) {
  StrSub s = unpack(sub);
  if (s.phase == kOpen && b.opened) s.phase = kBody;  // its quote was read before
  switch (s.phase) {
    case kOpen:
      if (c != '"') return kStrFail;
      s.phase = kBody;
      return pack(s);
    case kBody:
      if (s.low) {  // only the low half's escape
        if (c != '\\') return kStrFail;
        s.phase = kEscape;
        return pack(s);
      }
      if (c == '"') return s.count >= b.min_len ? kStrClosed : kStrFail;
      if (b.max_len != kUnbounded && s.count >= b.max_len) return kStrFail;  // no room for another character
      if (c == '\\') {
        s.phase = kEscape;
        return pack(s);
      }
      if (c < 0x20) return kStrFail;
      if (c < 0x80) {
        count_char(s, b);
        return pack(s);
      } else {
        const int len = unicode::utf8_lead_info(c, &s.lo, &s.hi);
        if (len == 0) return kStrFail;
        s.phase = kUtf8;
        s.left = uint8_t(len - 1);
        return pack(s);
      }
    case kUtf8:
      if (c < s.lo || c > s.hi) return kStrFail;
      s.lo = 0x80;
      s.hi = 0xBF;
      if (--s.left == 0) {
        s.phase = kBody;
        count_char(s, b);
      }
      return pack(s);
    case kEscape:
      if (c == 'u') {
        s.phase = kHex;
        s.left = 4;
        s.code = 0;
        return pack(s);
      }
      if (s.low || c == 0 || !std::strchr("\"\\/bfnrt", c)) return kStrFail;
      s.phase = kBody;
      count_char(s, b);
      return pack(s);
    case kHex: {
      if (!is_hex(c)) return kStrFail;
      const int v = c <= '9' ? c - '0' : (c | 0x20) - 'a' + 10;
      s.code = uint16_t(s.code << 4 | v);
      if (!json_u_escape_prefix_ok(s.code, 4 - (s.left - 1), s.low)) return kStrFail;
      if (--s.left == 0) {
        s.phase = kBody;
        if (s.low) {
          s.low = false;  // the pair was counted with its high half
        } else {
          s.low = s.code >= 0xD800 && s.code <= 0xDBFF;
          count_char(s, b);
        }
      }
      return pack(s);
    }
    default:
      return kStrFail;
  }
}

// ---- the gap between tokens: 0 none yet, 1 a space or tab (full), 2 + k a newline and k more ----

constexpr uint64_t kWsFail = ~uint64_t(0);
uint64_t ws_step(uint64_t sub, unsigned char c) {
  const bool blank = c == ' ' || c == '\t';
  if (sub == 0) return blank ? 1 : c == '\n' ? 2 : kWsFail;
  if (sub == 1) return kWsFail;
  return blank && sub - 2 < uint64_t(kJsonMaxIndent) ? sub + 1 : kWsFail;
}
bool ws_more(uint64_t sub) { return sub == 0 || (sub >= 2 && sub - 2 < uint64_t(kJsonMaxIndent)); }

// ---- the bounded integer: sub = digits (bits 0-4), '-' seen (bit 5), magnitude so far (bits 8-) ----

constexpr int kIntDigits = 16;
constexpr uint64_t kIntFail = ~uint64_t(0);
int64_t pow10(int j) {
  int64_t p = 1;
  while (j-- > 0) p *= 10;
  return p;
}
struct IntSub {
  int digits;
  bool neg;
  int64_t mag;
};
IntSub unpack_int(uint64_t v) { return {int(v & 31), (v >> 5 & 1) != 0, int64_t(v >> 8)}; }
uint64_t pack_int(const IntSub& s) { return uint64_t(s.digits) | uint64_t(s.neg) << 5 | uint64_t(s.mag) << 8; }
// Some number of j more digits after s lies in [lo, hi].
bool int_reachable(const Grammar::IntBounds& b, const IntSub& s, int j) {
  int64_t mlo, mhi;  // the magnitudes
  if (s.digits == 0) {
    if (j == 0) return false;
    mlo = j == 1 ? 0 : pow10(j - 1);
    mhi = pow10(j) - 1;
  } else {
    if (s.mag == 0 && j > 0) return false;  // no digit after a leading 0
    mlo = s.mag * pow10(j);
    mhi = (s.mag + 1) * pow10(j) - 1;
  }
  const int64_t lo = std::max(s.neg ? -mhi : mlo, b.lo), hi = std::min(s.neg ? -mlo : mhi, b.hi);
  if (lo > hi) return false;
  if (b.multiple == 1) return true;
  // A multiple of m in [lo, hi]: the greatest one <= hi is >= lo (floor division).
  const int64_t q = hi / b.multiple - (hi % b.multiple != 0 && hi < 0 ? 1 : 0);
  return q * b.multiple >= lo;
}
bool int_more(const Grammar::IntBounds& b, uint64_t sub) {
  IntSub s = unpack_int(sub);
  for (int j = 1; s.digits + j <= kIntDigits; ++j)
    if (int_reachable(b, s, j)) return true;
  if (s.digits == 0 && !s.neg) {  // before anything: a '-' can come, for a range below 0
    s.neg = true;
    for (int j = 1; j <= kIntDigits; ++j)
      if (int_reachable(b, s, j)) return true;
  }
  return false;
}
bool int_complete(const Grammar::IntBounds& b, uint64_t sub) { return int_reachable(b, unpack_int(sub), 0); }
uint64_t int_step(const Grammar::IntBounds& b, uint64_t sub, unsigned char c) {
  IntSub s = unpack_int(sub);
  if (c == '-') {
    if (s.digits > 0 || s.neg) return kIntFail;
    s.neg = true;
  } else if (c >= '0' && c <= '9') {
    if (s.digits >= kIntDigits || (s.digits > 0 && s.mag == 0)) return kIntFail;
    s.mag = s.mag * 10 + (c - '0');
    ++s.digits;
  } else {
    return kIntFail;
  }
  const uint64_t n = pack_int(s);
  return int_more(b, n) || int_complete(b, n) ? n : kIntFail;
}

Seq operator+(Seq a, const Seq& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

}  // namespace

// ---- the schema compiler ----

class SchemaCompiler {
 public:
  SchemaCompiler(Grammar& g, const json& root) : g_(g), root_(root) {}

  void compile_choices(std::vector<std::string> words) {
    if (words.empty()) throw std::invalid_argument("guided_choice: give at least one choice");
    for (const std::string& w : words)
      if (w.size() > kMaxWord) throw std::invalid_argument("guided_choice: a choice is longer than 4096 bytes");
    std::sort(words.begin(), words.end());
    words.erase(std::unique(words.begin(), words.end()), words.end());
    const uint32_t value = word_trie(words, 0, words.size(), 0);
    g_.root_ = uint32_t(g_.elems_.size());
    g_.elems_.push_back(rule(value));
    g_.elems_.push_back({Grammar::kEnd, 0});
  }

  void compile() {
    const uint32_t value = schema(root_, "");
    g_.root_ = uint32_t(g_.elems_.size());
    g_.elems_.push_back(ws());
    g_.elems_.push_back(rule(value));
    g_.elems_.push_back({Grammar::kEnd, 0});
    if (!prune_unproductive(value))
      fail("", "the schema admits no finite document (a required property or item refers back to its own schema)");
    if (left_recursive_rule() != UINT32_MAX) fail("", "the schema refers to itself ($ref) before any text: no document would end");
  }

  // A GBNF grammar: one rule per GBNF rule (made first, so that references resolve), groups and
  // repetitions as rules of their own, characters as the byte sequences of their UTF-8.
  void compile_gbnf(const Gbnf& gb, const std::vector<const json*>& schemas = {}) {
    schema_ = false;
    const uint32_t base = uint32_t(g_.rules_.size());
    for (size_t i = 0; i < gb.rules.size(); ++i) new_rule();
    // External rules: a document of their schema (each schema's $refs point into itself), no
    // whitespace around it
    for (size_t k = 0; k < gb.external.size(); ++k) {
      SchemaCompiler sub(g_, *schemas.at(k));
      const uint32_t value = sub.schema(*schemas[k], "");
      alt(base + gb.external[k], {rule(value)});
    }
    std::vector<uint32_t> owner(gb.rules.size(), 0);  // the GBNF rule each grammar rule was made for
    for (size_t i = 0; i < gb.rules.size(); ++i) owner[i] = uint32_t(i);
    for (size_t i = 0; i < gb.rules.size(); ++i) {
      for (const std::vector<GbnfItem>& seq : gb.rules[i]) alt(base + uint32_t(i), gbnf_seq(seq, base));
      owner.resize(g_.rules_.size() - base, uint32_t(i));
    }
    g_.root_ = uint32_t(g_.elems_.size());
    g_.elems_.push_back(rule(base + gb.root));
    g_.elems_.push_back({Grammar::kEnd, 0});
    if (!prune_unproductive(base + gb.root))
      throw std::invalid_argument("grammar: 'root' admits no finite text (every way through it refers back to a rule it is in)");
    const uint32_t r = left_recursive_rule();
    if (r != UINT32_MAX) {
      const std::string& name = gb.names[r >= base && r - base < owner.size() ? owner[r - base] : gb.root];
      throw std::invalid_argument("grammar: rule '" + name + "' can come back to itself before any text (left recursion, "
                                  "or a repetition of something that can be empty); write it as a repetition, e.g. "
                                  "x ::= y (\"+\" y)*");
    }
  }

 private:
  [[noreturn]] static void fail(const std::string& path, const std::string& why) {
    throw std::invalid_argument("json_schema at '" + (path.empty() ? std::string("#") : "#" + path) + "': " + why);
  }
  // A size limit: as a schema's error, or plainly for a pattern or a grammar of its own.
  [[noreturn]] void limit(const std::string& why) const {
    if (schema_) fail("", why);
    throw std::invalid_argument(why);
  }
  static std::string child(const std::string& path, const std::string& key) {
    std::string k;  // JSON pointer escaping
    for (char c : key) {
      if (c == '~') k += "~0";
      else if (c == '/') k += "~1";
      else k += c;
    }
    return path + "/" + k;
  }

  uint32_t new_rule() {
    g_.rules_.emplace_back();
    if (g_.rules_.size() > 200000)
      limit("more than 200000 grammar rules are needed (lower a schema's minItems/maxItems, or a pattern's or grammar's repetition counts)");
    return uint32_t(g_.rules_.size() - 1);
  }
  void alt(uint32_t r, const Seq& seq) {
    if (g_.elems_.size() + seq.size() > 4000000) limit("more than 4M grammar elements are needed");
    g_.rules_[r].push_back(uint32_t(g_.elems_.size()));
    g_.elems_.insert(g_.elems_.end(), seq.begin(), seq.end());
    g_.elems_.push_back({Grammar::kEnd, 0});
  }
  uint32_t rule_of(const std::vector<Seq>& alts) {
    const uint32_t r = new_rule();
    for (const Seq& a : alts) alt(r, a);
    return r;
  }
  Elem bytes(const ByteSet& s) {
    auto it = set_ids_.find(s);
    if (it == set_ids_.end()) {
      it = set_ids_.emplace(s, uint32_t(g_.sets_.size())).first;
      g_.sets_.push_back(s);
    }
    return {Grammar::kBytes, it->second};
  }
  Elem range(unsigned char lo, unsigned char hi) {
    ByteSet s{};
    for (int c = lo; c <= hi; ++c) s[size_t(c >> 6)] |= uint64_t(1) << (c & 63);
    return bytes(s);
  }
  Elem ch(unsigned char c) { return range(c, c); }
  Seq lit(std::string_view text) {
    Seq s;
    for (unsigned char c : text) s.push_back(ch(c));
    return s;
  }
  static Elem rule(uint32_t r) { return {Grammar::kRule, r}; }
  static Elem ws() { return {Grammar::kWs, 0}; }
  Elem str(uint32_t min_len, uint32_t max_len) {
    g_.strs_.push_back({min_len, max_len});
    return {Grammar::kStr, uint32_t(g_.strs_.size() - 1)};
  }

  // The text of one value (const, enum): containers with the gaps between tokens that other
  // values have, scalars as nlohmann writes them.
  // (Values are nested at most kMaxValueDepth: checked before.)
  void value_text(const json& v, Seq& out) {
    if (v.is_object() || v.is_array()) {
      out.push_back(ch(v.is_object() ? '{' : '['));
      out.push_back(ws());
      bool first = true;
      for (auto it = v.begin(); it != v.end(); ++it) {
        if (!first) {
          out.push_back(ch(','));
          out.push_back(ws());
        }
        first = false;
        if (v.is_object()) {
          for (const Elem& e : lit(json(it.key()).dump(-1, ' ', false, json::error_handler_t::strict))) out.push_back(e);
          out.insert(out.end(), {ws(), ch(':'), ws()});
        }
        value_text(it.value(), out);
        out.push_back(ws());
      }
      out.push_back(ch(v.is_object() ? '}' : ']'));
      return;
    }
    for (const Elem& e : lit(v.dump(-1, ' ', false, json::error_handler_t::strict))) out.push_back(e);
  }
  static constexpr int kMaxValueDepth = 64;
  static constexpr size_t kMaxWord = 4096;  // an enum scalar's or an extra-keyed name's text (tries recurse per byte)
  // The nesting of a value, without recursion (a hostile one may be nested past the stack).
  static int value_depth(const json& v) {
    int deepest = 0;
    std::vector<std::pair<const json*, int>> todo{{&v, 1}};
    while (!todo.empty()) {
      const auto [x, d] = todo.back();
      todo.pop_back();
      deepest = std::max(deepest, d);
      if (d > kMaxValueDepth) break;
      if (x->is_object() || x->is_array())
        for (const json& c : *x) todo.emplace_back(&c, d + 1);
    }
    return deepest;
  }

  // The words [lo, hi) of a sorted list, from byte `depth` on, as a trie of rules: one open parse
  // stack per word prefix however many words share it (a long enum does not fill the state with
  // one stack per value).
  uint32_t word_trie(const std::vector<std::string>& w, size_t lo, size_t hi, size_t depth) {
    const uint32_t r = new_rule();
    if (hi - lo == 1) {
      alt(r, lit(std::string_view(w[lo]).substr(depth)));
      return r;
    }
    size_t i = lo;
    if (w[i].size() == depth) {  // a word ends here (sorted first)
      alt(r, {});
      ++i;
    }
    while (i < hi) {
      size_t j = i;
      while (j < hi && w[j][depth] == w[i][depth]) ++j;
      alt(r, {ch(static_cast<unsigned char>(w[i][depth])), rule(word_trie(w, i, j, depth + 1))});
      i = j;
    }
    return r;
  }

  // The rest of a string after its opening quote (no length bounds).
  Elem str_body() {
    g_.strs_.push_back({0, kUnbounded, true});
    return {Grammar::kStr, uint32_t(g_.strs_.size() - 1)};
  }

  // A string's text after its opening quote that is none of the (sorted, JSON-escaped) names
  // [lo, hi) from byte `depth` on, then its closing quote. While it follows a name it takes that
  // name's bytes; it leaves every name with a printable ASCII character none of them has next
  // (not '\\': an escape there could spell a name's character), and then `rest` (any text); it
  // closes anywhere but at a name's end. So a key never equals a listed name, however written.
  uint32_t key_trie(const std::vector<std::string>& w, size_t lo, size_t hi, size_t depth, const Elem& rest) {
    const uint32_t r = new_rule();
    // Between two characters of the names' text (not inside an escape or a UTF-8 sequence): only
    // there may the key leave them or close.
    size_t at = 0;
    while (at < depth) {
      const unsigned char c = static_cast<unsigned char>(w[lo][at]);
      uint8_t l, h;
      at += c == '\\' ? (w[lo][at + 1] == 'u' ? 6 : 2) : c < 0x80 ? 1 : size_t(std::max(1, unicode::utf8_lead_info(c, &l, &h)));
    }
    const bool boundary = at == depth;
    size_t i = lo;
    const bool name_ends = w[i].size() == depth;  // sorted: a name ending here comes first
    if (name_ends) ++i;
    ByteSet leave{};
    for (int c = 0x20; c <= 0x7E; ++c)
      if (c != '"' && c != '\\') leave[size_t(c >> 6)] |= uint64_t(1) << (c & 63);
    while (i < hi) {
      size_t j = i;
      const unsigned char b = static_cast<unsigned char>(w[i][depth]);
      while (j < hi && static_cast<unsigned char>(w[j][depth]) == b) ++j;
      leave[b >> 6] &= ~(uint64_t(1) << (b & 63));
      alt(r, {ch(b), rule(key_trie(w, i, j, depth + 1, rest))});
      i = j;
    }
    if (boundary && leave != ByteSet{}) alt(r, {bytes(leave), rest});
    if (boundary && !name_ends) alt(r, {ch('"')});
    return r;
  }

  // x repeated min..max times (max kUnbounded: no bound).
  uint32_t repeat(const Seq& x, uint32_t min, uint32_t max) {
    // (The empty alternative last: the parse stacks expand it in a loop rather than a call, so a
    // long run of optional items does not nest.)
    uint32_t tail = new_rule();  // up to (max - min) more
    if (max == kUnbounded) alt(tail, x + Seq{rule(tail)});
    alt(tail, {});
    if (max != kUnbounded)
      for (uint32_t k = min; k < max; ++k) tail = rule_of({x + Seq{rule(tail)}, {}});
    Seq seq;
    for (uint32_t k = 0; k < min; ++k) seq = seq + x;
    return rule_of({seq + Seq{rule(tail)}});
  }

  uint32_t number(bool integer) {
    uint32_t& memo = integer ? integer_ : number_;
    if (memo != UINT32_MAX) return memo;
    const Elem digit = range('0', '9');
    const uint32_t int_part = rule_of({lit("0"), Seq{range('1', '9'), rule(repeat({digit}, 0, 15))}});
    const uint32_t signed_int = rule_of({{rule(int_part)}, lit("-") + Seq{rule(int_part)}});
    if (integer) return memo = signed_int;
    const uint32_t frac = rule_of({{}, lit(".") + Seq{rule(repeat({digit}, 1, 16))}});
    ByteSet sign{};
    sign['+' >> 6] |= uint64_t(1) << ('+' & 63);
    sign['-' >> 6] |= uint64_t(1) << ('-' & 63);
    ByteSet e{};
    e['e' >> 6] |= uint64_t(1) << ('e' & 63);
    e['E' >> 6] |= uint64_t(1) << ('E' & 63);
    const uint32_t sign_opt = rule_of({{}, {bytes(sign)}});
    // Exponents of at most two digits: 1e300 is JSON, but past a double's range for most parsers.
    const uint32_t exp = rule_of({{}, Seq{bytes(e), rule(sign_opt), rule(repeat({digit}, 1, 2))}});
    return memo = rule_of({{rule(signed_int), rule(frac), rule(exp)}});
  }

  // Any JSON value.
  uint32_t any() {
    if (any_ != UINT32_MAX) return any_;
    any_ = new_rule();
    const uint32_t member = rule_of({{str(0, kUnbounded), ws(), ch(':'), ws(), rule(any_), ws()}});
    const uint32_t members = new_rule();
    alt(members, {});
    alt(members, Seq{ch(','), ws(), rule(member), rule(members)});
    const uint32_t object = rule_of({{ch('{'), ws(), ch('}')}, {ch('{'), ws(), rule(member), rule(members), ch('}')}});
    const uint32_t item = rule_of({{rule(any_), ws()}});
    const uint32_t items = new_rule();
    alt(items, {});
    alt(items, Seq{ch(','), ws(), rule(item), rule(items)});
    const uint32_t array = rule_of({{ch('['), ws(), ch(']')}, {ch('['), ws(), rule(item), rule(items), ch(']')}});
    for (const Seq& a : std::vector<Seq>{{rule(object)}, {rule(array)}, {str(0, kUnbounded)}, {rule(number(false))},
                                         lit("true"), lit("false"), lit("null")})
      alt(any_, a);
    return any_;
  }

  static bool is_annotation(const std::string& k) {
    static const std::set<std::string> ann = {"title", "description", "default", "examples", "$schema", "$id",
                                              "$comment", "deprecated", "readOnly", "writeOnly", "$defs",
                                              "definitions", "contentMediaType", "contentEncoding", "$anchor",
                                              "discriminator", "nullable", "strict"};
    return ann.count(k) != 0;
  }
  static const std::set<std::string>& unsupported() {
    static const std::set<std::string> u = {
        "dependentRequired",
        "dependentSchemas", "dependencies", "uniqueItems", "contains", "minContains", "maxContains", "not", "if",
        "then", "else", "unevaluatedProperties", "unevaluatedItems", "additionalItems", "$dynamicRef",
        "$recursiveRef", "$dynamicAnchor", "$recursiveAnchor", "contentSchema"};
    return u;
  }
  static const char* supported_list() {
    return "supported: type, properties, required, additionalProperties, patternProperties, propertyNames, minProperties, maxProperties, items, "
           "prefixItems, minItems, uniqueItems (items of finitely many values), "
           "maxItems, minLength, maxLength, pattern, minimum/maximum/exclusiveMinimum/exclusiveMaximum, multipleOf (an integer, "
           "or on numbers a power of ten such as 0.01), format "
           "(date, time, date-time, uuid, ipv4), enum, const, anyOf, oneOf, allOf (merged: see the README), $ref, $defs";
  }

  static uint32_t count_of(const json& s, const char* key, const std::string& path) {
    if (!s.contains(key)) return kUnbounded;
    const json& v = s[key];
    if (!v.is_number_integer() || v.get<int64_t>() < 0) fail(path, std::string("'") + key + "' must be a non-negative integer");
    return uint32_t(std::min<int64_t>(v.get<int64_t>(), int64_t(kUnbounded) - 1));
  }

  // v satisfies the schema's string-length and number bounds (those that apply to its type).
  static bool within_bounds(const json& s, const json& v, const std::string& path) {
    auto num = [&](const char* k) {
      if (!s[k].is_number()) fail(path, std::string("'") + k + "' must be a number");
      return s[k].get<double>();
    };
    if (v.is_string()) {
      size_t n = 0;
      for (unsigned char c : v.get<std::string>()) n += (c & 0xC0) != 0x80;
      if (s.contains("minLength") && n < count_of(s, "minLength", path)) return false;
      if (s.contains("maxLength") && n > count_of(s, "maxLength", path)) return false;
    }
    if (v.is_number()) {
      auto c = [&](const char* k) {
        num(k);  // a number, or an error
        return compare_numbers(v, s[k]);
      };
      const bool ex_lo = s.contains("exclusiveMinimum") && s["exclusiveMinimum"].is_boolean() && s["exclusiveMinimum"].get<bool>();
      const bool ex_hi = s.contains("exclusiveMaximum") && s["exclusiveMaximum"].is_boolean() && s["exclusiveMaximum"].get<bool>();
      if (s.contains("minimum") && (ex_lo ? c("minimum") <= 0 : c("minimum") < 0)) return false;
      if (s.contains("maximum") && (ex_hi ? c("maximum") >= 0 : c("maximum") > 0)) return false;
      if (s.contains("exclusiveMinimum") && !s["exclusiveMinimum"].is_boolean() && c("exclusiveMinimum") <= 0) return false;
      if (s.contains("exclusiveMaximum") && !s["exclusiveMaximum"].is_boolean() && c("exclusiveMaximum") >= 0) return false;
    }
    return true;
  }

  static bool matches_type(const json& v, const std::string& t) {
    if (t == "null") return v.is_null();
    if (t == "boolean") return v.is_boolean();
    if (t == "integer") return v.is_number_integer() || (v.is_number_float() && v.get<double>() == std::floor(v.get<double>()));
    if (t == "number") return v.is_number();
    if (t == "string") return v.is_string();
    if (t == "array") return v.is_array();
    if (t == "object") return v.is_object();
    return false;
  }

  std::vector<std::string> types_of(const json& s, const std::string& path) {
    static const std::set<std::string> known = {"null", "boolean", "integer", "number", "string", "array", "object"};
    std::vector<std::string> types;
    if (!s.contains("type")) return types;
    const json& t = s["type"];
    if (t.is_string()) {
      types.push_back(t.get<std::string>());
    } else if (t.is_array() && !t.empty()) {
      for (const json& x : t) {
        if (!x.is_string()) fail(path, "'type' must be a string or a list of strings");
        types.push_back(x.get<std::string>());
      }
    } else {
      fail(path, "'type' must be a string or a non-empty list of strings");
    }
    for (const std::string& x : types)
      if (!known.count(x))
        fail(path, "unknown type '" + x + "' (types: null, boolean, integer, number, string, array, object)");
    return types;
  }

  // The node a "$ref" into this document names; nullptr when it names none (or another document).
  const json* ref_target(const std::string& target) const {
    if (target.empty() || target[0] != '#') return nullptr;
    try {
      return &root_.at(json::json_pointer(target.substr(1)));
    } catch (const std::exception&) {
      return nullptr;
    }
  }

  uint32_t ref(const std::string& target, const std::string& path) {
    if (target.empty() || target[0] != '#')
      fail(path, "$ref '" + target + "' is not supported (only references into this schema: #, #/$defs/NAME, #/definitions/NAME)");
    auto it = refs_.find(target);
    if (it != refs_.end()) return it->second;
    const std::string pointer = target.substr(1);
    const json* node = ref_target(target);
    if (!node) fail(path, "$ref '" + target + "' points at nothing in the schema");
    const uint32_t r = new_rule();  // before compiling the target: it may refer to itself
    refs_.emplace(target, r);
    alt(r, {rule(schema(*node, pointer))});
    return r;
  }

  // The values of an enum / const that the type, bounds and pattern beside them allow.
  std::vector<json> filter_values(const json& s, const std::vector<std::string>& types, const std::vector<json>& values,
                                  const std::string& path) {
    std::unique_ptr<RegexDfa> pattern;  // strings are filtered by it too
    if (s.contains("pattern") && std::any_of(values.begin(), values.end(), [](const json& v) { return v.is_string(); }))
      pattern = std::make_unique<RegexDfa>(regex(s, path, {}));
    std::vector<json> out;
    for (const json& v : values) {
      bool ok = types.empty();
      for (const std::string& t : types) ok = ok || matches_type(v, t);
      if (!ok || !within_bounds(s, v, path)) continue;
      if (pattern && v.is_string() && !pattern->matches(v.get<std::string>())) continue;
      out.push_back(v);
    }
    return out;
  }

  // uniqueItems: the values an array's items can take when they are finitely many (items an enum
  // or const, booleans or null, through $ref and allOf of one schema), each once; empty when
  // they are not.
  // The schema `s` stands for through a $ref or an allOf of one schema (annotations beside them),
  // followed up to 64 times; nullptr when a $ref points at nothing (*dangling: its target) or the
  // chain goes on (a $ref that comes back to itself).
  const json* follow_aliases(const json* s, std::string* dangling = nullptr) const {
    const auto only_annotations_beside = [](const json& x, const char* key) {
      return std::all_of(x.items().begin(), x.items().end(), [&](const auto& kv) { return kv.key() == key || is_annotation(kv.key()); });
    };
    for (int hops = 0; s->is_object(); ++hops) {
      if (hops == 64) return nullptr;
      if (s->contains("$ref") && (*s)["$ref"].is_string() && only_annotations_beside(*s, "$ref")) {
        const std::string target = (*s)["$ref"].get<std::string>();
        s = ref_target(target);
        if (!s) {
          if (dangling) *dangling = target;
          return nullptr;
        }
      } else if (s->contains("allOf") && (*s)["allOf"].is_array() && (*s)["allOf"].size() == 1 &&
                 only_annotations_beside(*s, "allOf")) {
        s = &(*s)["allOf"][0];
      } else {
        break;
      }
    }
    return s;
  }

  std::vector<json> finite_item_values(const json& items, const std::string& path) {
    const json* s = follow_aliases(&items);
    if (!s || !s->is_object()) return {};
    std::vector<json> values;
    if (s->contains("const")) {
      values.push_back((*s)["const"]);
    } else if (s->contains("enum") && (*s)["enum"].is_array()) {
      for (const json& v : (*s)["enum"]) values.push_back(v);
    } else if (s->contains("type") && ((*s)["type"] == "boolean" || (*s)["type"] == "null") &&
               std::all_of(s->items().begin(), s->items().end(),
                           [](const auto& kv) { return kv.key() == "type" || is_annotation(kv.key()); })) {
      values = (*s)["type"] == "null" ? std::vector<json>{json(nullptr)} : std::vector<json>{json(false), json(true)};
    } else {
      return {};
    }
    std::vector<json> out;
    for (const json& v : filter_values(*s, types_of(*s, path), values, path))
      if (std::find(out.begin(), out.end(), v) == out.end()) out.push_back(v);  // JSON equality: 1 is 1.0
    return out;
  }

  // ---- allOf: its schemas merged into one ----

  // A merge that finds no value every schema accepts (such an anyOf branch is dropped).
  struct NoValue : std::invalid_argument {
    using std::invalid_argument::invalid_argument;
  };
  [[noreturn]] static void no_value(const std::string& path, const std::string& why) {
    throw NoValue("json_schema at '" + (path.empty() ? std::string("#") : "#" + path) + "': no value fits 'allOf': " + why);
  }
  // A schema no value fits (an error at the top; an anyOf branch or optional property left out).
  [[noreturn]] static void no_fit(const std::string& path, const std::string& why) {
    throw NoValue("json_schema at '" + (path.empty() ? std::string("#") : "#" + path) + "': " + why);
  }

  // The schemas an allOf asks all of: the keywords beside it, each listed schema, nested allOfs and
  // $refs followed (a $ref met again on the way is refused: it would not end).
  void all_of_parts(const json& s, const std::string& path, std::vector<json>& parts, std::vector<std::string>& refs) {
    if (refs.size() > 64) fail(path, "'allOf' through more than 64 $refs");
    if (s.is_boolean()) {
      if (s.get<bool>()) return;
      no_value(path, "one of its schemas is false");
    }
    if (!s.is_object()) fail(path, "a schema must be an object or a boolean");
    json own = json::object();
    for (const auto& [k, v] : s.items())
      if (k != "allOf" && k != "$ref" && k != "$defs" && k != "definitions" && !is_annotation(k)) own[k] = v;
    if (!own.empty()) parts.push_back(std::move(own));
    if (s.contains("$ref")) {
      if (!s["$ref"].is_string()) fail(path, "'$ref' must be a string");
      const std::string t = s["$ref"].get<std::string>();
      if (std::find(refs.begin(), refs.end(), t) != refs.end())
        fail(path, "'allOf' through $ref '" + t + "' comes back to the same schema");
      const json* target = ref_target(t);
      if (!target) fail(path, "$ref '" + t + "' points at nothing in the schema");
      refs.push_back(t);
      all_of_parts(*target, t.substr(1), parts, refs);
      refs.pop_back();
    }
    if (s.contains("allOf")) {
      const json& subs = s["allOf"];
      if (!subs.is_array() || subs.empty()) fail(path, "'allOf' must be a non-empty list of schemas");
      for (size_t i = 0; i < subs.size(); ++i) all_of_parts(subs[i], child(child(path, "allOf"), std::to_string(i)), parts, refs);
    }
  }

  // Numbers compared exactly (integers as integers, a float against an integer in long double,
  // whose 64-bit mantissa holds both): -1, 0, 1.
  static int compare_numbers(const json& a, const json& b) {
    if (a.is_number_integer() && b.is_number_integer()) {
      const auto wide = [](const json& x) { return x.is_number_unsigned() ? __int128(x.get<uint64_t>()) : __int128(x.get<int64_t>()); };
      const __int128 x = wide(a), y = wide(b);
      return x < y ? -1 : x > y ? 1 : 0;
    }
    const auto wide = [](const json& x) {
      return x.is_number_unsigned() ? (long double)x.get<uint64_t>()
             : x.is_number_integer() ? (long double)x.get<int64_t>()
                                     : (long double)x.get<double>();
    };
    const long double x = wide(a), y = wide(b);
    return x < y ? -1 : x > y ? 1 : 0;
  }
  // JSON equality with numbers compared exactly (nlohmann's == compares an integer and a float as
  // doubles: 9007199254740993 would equal 9007199254740992.0).
  static bool same_value(const json& a, const json& b) {
    if (a.is_number() && b.is_number()) return compare_numbers(a, b) == 0;
    if (a.is_array() && b.is_array()) {
      if (a.size() != b.size()) return false;
      for (size_t i = 0; i < a.size(); ++i)
        if (!same_value(a[i], b[i])) return false;
      return true;
    }
    if (a.is_object() && b.is_object()) {
      if (a.size() != b.size()) return false;
      for (const auto& [k, v] : a.items())
        if (!b.contains(k) || !same_value(v, b[k])) return false;
      return true;
    }
    return a == b;
  }
  // The distinct schemas of a list, in order.
  static void dedupe(std::vector<json>& xs) {
    std::vector<json> out;
    for (json& x : xs)
      if (std::none_of(out.begin(), out.end(), [&](const json& y) { return same_value(x, y); })) out.push_back(std::move(x));
    xs = std::move(out);
  }

  // A schema merged alone (its allOf, $refs), for the checks below; nullopt when no value fits it,
  // or when it still holds an anyOf / oneOf (nothing is proved of it then: *open set).
  std::optional<json> merged_alone(const json& s, const std::string& path, bool* open) {
    std::vector<json> parts;
    std::vector<std::string> refs;
    all_of_parts(json{{"allOf", json::array({s})}}, path, parts, refs);
    dedupe(parts);
    for (const json& p : parts)
      if (p.contains("anyOf") || p.contains("oneOf")) {
        *open = true;
        return std::nullopt;
      }
    try {
      return merge_parts(parts, path);
    } catch (const NoValue&) {
      return std::nullopt;
    }
  }
  // The finite values a schema allows (enum / const), or none.
  static std::optional<std::vector<json>> finite_values(const json& s) {
    if (!s.is_object()) return std::nullopt;
    if (s.contains("const")) return std::vector<json>{s["const"]};
    if (s.contains("enum") && s["enum"].is_array()) return s["enum"].get<std::vector<json>>();
    return std::nullopt;
  }
  bool types_apart(const json& a, const json& b, const std::string& path) {
    if (!a.contains("type") || !b.contains("type")) return false;
    const std::vector<std::string> x = types_of(a, path), y = types_of(b, path);
    const auto has = [&](const std::string& t) { return std::find(y.begin(), y.end(), t) != y.end(); };
    for (const std::string& t : x)
      if (has(t) || (t == "integer" && has("number")) || (t == "number" && has("integer"))) return false;
    return true;
  }
  static bool values_apart(const std::vector<json>& x, const std::vector<json>& y) {
    for (const json& a : x)
      for (const json& b : y)
        if (same_value(a, b)) return false;
    return true;
  }
  // A oneOf distributed over an allOf's other schemas is generated as anyOf: sound only when no
  // document matches two of its branches. Each pair must be told apart by their types, by their
  // values (enum / const), by a property one requires whose values the other's schema for it
  // rules out (a tagged union's discriminator), or by a property the other requires that one's
  // documents (objects of its listed properties alone) never have; otherwise refused.
  void one_of_apart(const json& branches, const json& alts, const std::string& path) {
    const size_t n = alts.size();
    std::vector<std::optional<json>> mine(n), theirs(n);  // branch i merged with the others; alternative j alone
    for (size_t i = 0; i < n; ++i) {
      bool open = false;
      mine[i] = merged_alone(branches[i], path, &open);
      if (!open) theirs[i] = merged_alone(alts[i], path, &open);
      if (open) fail(path, "'oneOf' with an 'anyOf' / 'oneOf' inside its branches, beside other schemas in 'allOf', is not supported");
      if (!mine[i]) continue;  // no document: apart from every other branch
      if (!theirs[i]) mine[i].reset();
    }
    const auto values_of = [&](const json& x) -> std::optional<std::vector<json>> {  // through allOf / $ref
      bool open = false;
      const std::optional<json> m = merged_alone(x, path, &open);
      return m ? finite_values(*m) : std::nullopt;
    };
    // a's documents are objects of its listed properties alone
    const auto closed_object = [](const json& a) {
      const bool object = a.contains("type") ? a["type"] == "object" : a.contains("properties");
      return object && a.contains("properties") && !a.contains("patternProperties") && !a.contains("propertyNames") &&
             (!a.contains("additionalProperties") || a["additionalProperties"] == false);
    };
    const auto apart = [&](const json& a, const json& b) {  // a document of a fails b
      if (types_apart(a, b, path)) return true;
      const auto va = finite_values(a), vb = finite_values(b);
      if (va && vb && values_apart(*va, *vb)) return true;
      if (closed_object(a) && b.contains("required") && b["required"].is_array())
        for (const json& r : b["required"])  // b requires a property a never writes
          if (r.is_string() && !a["properties"].contains(r.get<std::string>())) return true;
      if (!a.contains("required") || !a.contains("properties") || !b.contains("properties")) return false;
      for (const json& r : a["required"]) {
        if (!r.is_string() || !a["properties"].contains(r.get<std::string>()) || !b["properties"].contains(r.get<std::string>()))
          continue;
        const auto x = values_of(a["properties"][r.get<std::string>()]);
        const auto y = values_of(b["properties"][r.get<std::string>()]);
        if (x && y && values_apart(*x, *y)) return true;
      }
      return false;
    };
    for (size_t i = 0; i < n; ++i)
      for (size_t j = 0; j < n; ++j)
        if (i != j && mine[i] && !apart(*mine[i], *theirs[j]))
          fail(path, "'oneOf' beside other schemas in 'allOf' whose branches " + std::to_string(i) + " and " + std::to_string(j) +
                         " a document could both match: kvq generates oneOf as anyOf, which is sound only for branches told "
                         "apart by their types, values or a required property's const / enum (use anyOf, or tag the branches)");
  }

  // One schema that asks what all the parts ask: types intersected, lower bounds raised and upper
  // bounds lowered, enum / const values intersected, required names united, object properties
  // merged as JSON Schema reads them (a name one part lists and another does not takes the other's
  // additionalProperties, or is ruled out by its false), items as allOf; an anyOf / oneOf in a part
  // distributed over the others. Other keywords must agree where several parts have them.
  json merge_parts(const std::vector<json>& parts, const std::string& path) {
    for (size_t i = 0; i < parts.size(); ++i)
      for (const char* k : {"anyOf", "oneOf"}) {
        if (!parts[i].contains(k)) continue;
        const json& alts = parts[i][k];
        if (!alts.is_array() || alts.empty()) fail(path, std::string("'") + k + "' must be a non-empty list of schemas");
        if (alts.size() > 64) fail(path, std::string("'allOf' beside an '") + k + "' of more than 64 schemas is not supported");
        distributed_ += alts.size();
        if (distributed_ > 256)
          fail(path, "'allOf' over 'anyOf'/'oneOf' distributes into more than 256 alternatives, which kvq does not generate");
        json rest = parts[i];
        rest.erase(k);
        json branches = json::array();
        for (const json& a : alts) {
          json all = json::array();
          for (size_t j = 0; j < parts.size(); ++j)
            if (j != i) all.push_back(parts[j]);
          if (!rest.empty()) all.push_back(rest);
          all.push_back(a);
          branches.push_back(json{{"allOf", std::move(all)}});
        }
        if (std::string(k) == "oneOf") one_of_apart(branches, alts, path);
        return json{{"anyOf", std::move(branches)}};
      }
    if (parts.empty()) return json::object();
    if (parts.size() == 1) return parts[0];
    json out = json::object();
    // type: what every part allows (an integer is a number)
    std::optional<std::set<std::string>> types;
    for (const json& p : parts) {
      if (!p.contains("type")) continue;
      const std::vector<std::string> t = types_of(p, path);
      const std::set<std::string> mine(t.begin(), t.end());
      if (!types) {
        types = mine;
        continue;
      }
      std::set<std::string> both;
      for (const std::string& x : *types)
        if (mine.count(x) || (x == "integer" && mine.count("number"))) both.insert(x);
      if (types->count("number") && mine.count("integer")) both.insert("integer");
      types = both;
    }
    if (types) {
      if (types->empty()) no_value(path, "its schemas' types have none in common");
      out["type"] = types->size() == 1 ? json(*types->begin()) : json(std::vector<std::string>(types->begin(), types->end()));
    }
    // enum / const: the values every part that lists values lists
    std::optional<std::vector<json>> values;
    for (const json& p : parts) {
      if (!p.contains("const") && !p.contains("enum")) continue;
      std::vector<json> mine;
      if (p.contains("enum")) {
        if (!p["enum"].is_array() || p["enum"].empty()) fail(path, "'enum' must be a non-empty list");
        mine = p["enum"].get<std::vector<json>>();
      }
      if (p.contains("const")) {
        const bool listed = !p.contains("enum") ||
                            std::any_of(mine.begin(), mine.end(), [&](const json& v) { return same_value(v, p["const"]); });
        mine.clear();
        if (listed) mine.push_back(p["const"]);
      }
      if (mine.empty()) no_value(path, "a schema's const is not one of its enum");
      if (!values) {
        values = mine;
        continue;
      }
      std::erase_if(*values, [&](const json& v) {
        return std::none_of(mine.begin(), mine.end(), [&](const json& m) { return same_value(v, m); });
      });
    }
    if (values) {
      if (values->empty()) no_value(path, "its schemas' enum / const values have none in common");
      out["enum"] = *values;
    }
    static const std::set<std::string> lower = {"minLength", "minItems", "minProperties", "minimum", "exclusiveMinimum"};
    static const std::set<std::string> upper = {"maxLength", "maxItems", "maxProperties", "maximum", "exclusiveMaximum"};
    static const std::set<std::string> object_kw = {"properties", "required", "additionalProperties", "patternProperties",
                                                    "propertyNames"};
    // arrays: items and prefixItems from one schema as they are; from several, the allOf of their
    // items (a prefixItems beside another schema's items or prefixItems is refused: the positions
    // it covers would need both)
    size_t array_parts = 0, prefix_parts = 0;
    for (const json& p : parts) {
      array_parts += p.contains("items") || p.contains("prefixItems");
      prefix_parts += p.contains("prefixItems");
    }
    if (array_parts > 1 && prefix_parts > 0)
      fail(path, "'allOf' with 'prefixItems' in one schema and 'items' or 'prefixItems' in another is not supported");
    std::vector<std::string> seen;  // the other keywords, in the order met
    for (const json& p : parts)
      for (const auto& [k, v] : p.items()) {
        if (k == "type" || k == "enum" || k == "const" || object_kw.count(k)) continue;
        if ((lower.count(k) || upper.count(k)) && v.is_number() && (!out.contains(k) || out[k].is_number())) {
          if (!out.contains(k) || (lower.count(k) ? compare_numbers(v, out[k]) > 0 : compare_numbers(v, out[k]) < 0)) out[k] = v;
        } else if (k == "uniqueItems") {
          if (!out.contains(k) || v == true) out[k] = v;
        } else if (k == "items" && array_parts > 1) {  // (no prefixItems then)
          if (!v.is_object() && !v.is_boolean()) fail(path, "'items' must be a schema");
          if (!out.contains(k)) out[k] = json{{"allOf", json::array()}};
          out[k]["allOf"].push_back(v);
        } else if (k == "multipleOf" && out.contains(k) && out[k] != v) {
          const json& m = out[k];
          if (!m.is_number_integer() || !v.is_number_integer() || m.get<int64_t>() <= 0 || v.get<int64_t>() <= 0)
            fail(path, "'allOf' with different 'multipleOf' steps other than integers is not supported");
          const int64_t a = m.get<int64_t>(), b = v.get<int64_t>();
          const int64_t l = a / std::gcd(a, b);
          if (l > (int64_t(1) << 53) / b) fail(path, "'allOf': the 'multipleOf' steps' least common multiple is too large");
          out[k] = l * b;
        } else if (!out.contains(k)) {
          out[k] = v;
          seen.push_back(k);
        } else if (out[k] != v) {
          fail(path, "'allOf' whose schemas set '" + k + "' differently is not supported (kvq merges types, bounds, "
                     "enum/const, required, properties, additionalProperties and items)");
        }
      }
    // objects
    size_t object_parts = 0;
    for (const json& p : parts)
      object_parts += std::any_of(p.items().begin(), p.items().end(), [](const auto& kv) { return object_kw.count(kv.key()) != 0; });
    if (object_parts == 1) {
      for (const json& p : parts)
        for (const auto& [k, v] : p.items())
          if (object_kw.count(k)) out[k] = v;
    } else if (object_parts > 1) {
      for (const json& p : parts)
        for (const char* k : {"patternProperties", "propertyNames"})
          if (p.contains(k)) fail(path, std::string("'") + k + "' in 'allOf' beside another object schema is not supported");
      std::vector<std::string> names, required;
      for (const json& p : parts) {
        if (p.contains("properties")) {
          if (!p["properties"].is_object()) fail(path, "'properties' must be an object");
          for (const auto& [n, v] : p["properties"].items())
            if (std::find(names.begin(), names.end(), n) == names.end()) names.push_back(n);
        }
        if (p.contains("required")) {
          if (!p["required"].is_array()) fail(path, "'required' must be a list of names");
          for (const json& r : p["required"]) {
            if (!r.is_string()) fail(path, "'required' must be a list of names");
            if (std::find(required.begin(), required.end(), r.get<std::string>()) == required.end())
              required.push_back(r.get<std::string>());
          }
        }
      }
      for (const std::string& r : required)
        if (std::find(names.begin(), names.end(), r) == names.end()) names.push_back(r);  // required without a schema of its own
      json props = json::object();
      for (const std::string& n : names) {
        json cons = json::array();
        bool out_ruled = false;
        for (const json& p : parts) {
          if (p.contains("properties") && p["properties"].contains(n)) {
            cons.push_back(p["properties"][n]);
          } else if (p.contains("additionalProperties")) {
            const json& ap = p["additionalProperties"];
            if (ap == false) out_ruled = true;
            else if (ap != true) cons.push_back(ap);
          }
        }
        {
          std::vector<json> distinct(cons.begin(), cons.end());
          dedupe(distinct);
          cons = distinct;
        }
        if (out_ruled) {
          if (std::find(required.begin(), required.end(), n) != required.end())
            no_value(path, "property '" + n + "' is required by one schema and ruled out by another's additionalProperties");
          continue;
        }
        props[n] = cons.empty() ? json(true) : cons.size() == 1 ? cons[0] : json{{"allOf", cons}};
      }
      out["properties"] = props;
      if (!required.empty()) out["required"] = required;
      bool closed = false;
      json extra = json::array();
      size_t explicit_extra = 0;
      for (const json& p : parts) {
        if (!p.contains("additionalProperties")) continue;
        ++explicit_extra;
        const json& ap = p["additionalProperties"];
        if (ap == false) closed = true;
        else if (ap != true) extra.push_back(ap);
      }
      if (closed) out["additionalProperties"] = false;
      else if (explicit_extra > 0) {
        std::vector<json> distinct(extra.begin(), extra.end());
        dedupe(distinct);
        out["additionalProperties"] = distinct.empty() ? json(true) : distinct.size() == 1 ? distinct[0] : json{{"allOf", distinct}};
      }
    }
    if (out.contains("items") && out["items"].is_object() && out["items"].contains("allOf")) {
      std::vector<json> its = out["items"]["allOf"].get<std::vector<json>>();
      dedupe(its);
      out["items"] = its.size() == 1 ? its[0] : json{{"allOf", its}};
    }
    return out;
  }

  uint32_t schema(const json& s, const std::string& path) {
    if (++depth_ > 256) fail(path, "the schema is nested more than 256 levels");
    struct Leave {
      int& d;
      ~Leave() { --d; }
    } leave{depth_};
    if (s.is_boolean()) {
      if (s.get<bool>()) return any();
      no_fit(path, "the schema false accepts no value");
    }
    if (!s.is_object()) fail(path, "a schema must be an object or a boolean");
    std::vector<std::string> constraints;  // the keywords that constrain, for the combinations refused
    for (const auto& [k, v] : s.items()) {
      // Settings that constrain nothing.
      if ((k == "uniqueItems" && v == false) || (k == "minContains" && v == 0)) continue;
      if (k == "uniqueItems" && v == true) {  // arrays of finitely many values only (array())
        constraints.push_back(k);
        continue;
      }
      if (unsupported().count(k)) fail(path, "'" + k + "' is not supported (" + supported_list() + ")");
      if (!is_annotation(k)) constraints.push_back(k);
    }
    auto only = [&](const char* keyword) {
      for (const std::string& k : constraints)
        if (k != keyword && k != "$defs" && k != "definitions")
          fail(path, std::string("'") + keyword + "' beside '" + k + "' is not supported (put the constraints inside its schemas)");
    };
    if (s.contains("allOf")) {
      const json& subs = s["allOf"];
      if (!subs.is_array() || subs.empty()) fail(path, "'allOf' must be a non-empty list of schemas");
      const bool alone = std::all_of(constraints.begin(), constraints.end(), [](const std::string& k) {
        return k == "allOf" || k == "$defs" || k == "definitions";
      });
      if (alone && subs.size() == 1) return schema(subs[0], child(child(path, "allOf"), "0"));
      // Merged once per distinct set of schemas (a recursive allOf refers back to its own rule).
      std::vector<json> parts;
      std::vector<std::string> refs;
      all_of_parts(s, path, parts, refs);
      dedupe(parts);
      const std::string key = json(parts).dump();
      if (auto it = all_of_rules_.find(key); it != all_of_rules_.end()) return it->second;
      if (all_of_rules_.size() >= 1000)
        fail(path, "more than 1000 distinct 'allOf' merges (a recursion through 'allOf' that does not close)");
      merged_.push_back(merge_parts(parts, path));
      const uint32_t r = new_rule();
      all_of_rules_.emplace(key, r);
      alt(r, {rule(schema(merged_.back(), path))});
      return r;
    }
    if (s.contains("$ref")) {
      only("$ref");
      if (!s["$ref"].is_string()) fail(path, "'$ref' must be a string");
      return ref(s["$ref"].get<std::string>(), child(path, "$ref"));
    }
    for (const char* k : {"anyOf", "oneOf"}) {
      if (!s.contains(k)) continue;
      only(k);
      const json& subs = s[k];
      if (!subs.is_array() || subs.empty()) fail(path, std::string("'") + k + "' must be a non-empty list of schemas");
      const uint32_t r = new_rule();
      int n = 0;
      std::string none_fits;
      for (size_t i = 0; i < subs.size(); ++i) {
        if (subs[i].is_boolean() && !subs[i].get<bool>()) continue;  // accepts nothing: no branch
        try {
          alt(r, {rule(schema(subs[i], child(child(path, k), std::to_string(i))))});
          ++n;
        } catch (const NoValue& e) {  // an allOf (distributed over this anyOf) that no value fits: no branch
          none_fits = e.what();
        }
      }
      if (n == 0) no_fit(path, std::string("no schema of '") + k + "' accepts a value" + (none_fits.empty() ? "" : " (" + none_fits + ")"));
      return r;
    }
    const std::vector<std::string> types = types_of(s, path);
    if (s.contains("const") || s.contains("enum")) {
      // Beside the values, only what can be checked on them: they are filtered by it.
      static const std::set<std::string> siblings = {"const", "enum", "type", "minLength", "maxLength", "pattern", "minimum",
                                                     "maximum", "exclusiveMinimum", "exclusiveMaximum", "$defs",
                                                     "definitions"};
      for (const std::string& k : constraints)
        if (!siblings.count(k)) fail(path, "'enum'/'const' beside '" + k + "' is not supported");
      for (const char* k : {"const", "enum"})
        if (s.contains(k) && value_depth(s[k]) > kMaxValueDepth)
          fail(path, std::string("'") + k + "' is nested deeper than " + std::to_string(kMaxValueDepth) + " levels");
      std::vector<json> values;
      if (s.contains("const")) values.push_back(s["const"]);
      if (s.contains("enum")) {
        if (!s["enum"].is_array() || s["enum"].empty()) fail(path, "'enum' must be a non-empty list");
        for (const json& v : s["enum"]) values.push_back(v);
      }
      if (s.contains("const") && s.contains("enum") &&
          std::find(values.begin() + 1, values.end(), values[0]) == values.end())
        fail(path, "'const' is not one of 'enum'");
      if (s.contains("const")) values.resize(1);
      const uint32_t r = new_rule();
      int n = 0;
      std::vector<std::string> words;  // the scalars' texts, merged into one trie
      for (const json& v : filter_values(s, types, values, path)) {
        if (v.is_object() || v.is_array()) {
          Seq text;
          value_text(v, text);
          alt(r, text);
        }
        else words.push_back(v.dump(-1, ' ', false, json::error_handler_t::strict));
        if (!words.empty() && words.back().size() > kMaxWord) fail(path, "an 'enum'/'const' value longer than 4096 bytes");
        ++n;
      }
      if (n == 0) no_fit(path, "no value of 'enum'/'const' has the schema's 'type' and bounds");
      if (!words.empty()) {
        std::sort(words.begin(), words.end());
        words.erase(std::unique(words.begin(), words.end()), words.end());
        alt(r, {rule(word_trie(words, 0, words.size(), 0))});
      }
      return r;
    }
    std::vector<std::string> ts = types;
    if (ts.empty()) {  // the type the keywords imply, or any value
      const bool obj = s.contains("properties") || s.contains("required") || s.contains("additionalProperties") ||
                       s.contains("patternProperties") || s.contains("propertyNames");
      const bool arr = s.contains("items") || s.contains("prefixItems") || s.contains("minItems") || s.contains("maxItems") ||
                       (s.contains("uniqueItems") && s["uniqueItems"] == true);
      const bool str_kw = s.contains("minLength") || s.contains("maxLength") || s.contains("format") || s.contains("pattern");
      const bool num_kw = s.contains("minimum") || s.contains("maximum") || s.contains("exclusiveMinimum") ||
                          s.contains("exclusiveMaximum") || s.contains("multipleOf");
      if (obj + arr + str_kw + num_kw > 1) fail(path, "keywords of several types without 'type'");
      if (num_kw) fail(path, "minimum/maximum/multipleOf without \"type\": \"integer\" or \"number\" are not supported");
      if (obj) ts = {"object"};
      else if (arr) ts = {"array"};
      else if (str_kw) ts = {"string"};
      else return any();
    }
    if (ts.size() == 1) return typed(s, ts[0], path);
    const uint32_t r = new_rule();
    std::set<std::string> seen;
    for (const std::string& t : ts)
      if (seen.insert(t).second) alt(r, {rule(typed(s, t, path))});
    return r;
  }

  uint32_t typed(const json& s, const std::string& t, const std::string& path) {
    if (t == "null") return rule_of({lit("null")});
    if (t == "boolean") return rule_of({lit("true"), lit("false")});
    const bool bounded = s.contains("minimum") || s.contains("maximum") || s.contains("exclusiveMinimum") ||
                         s.contains("exclusiveMaximum") || s.contains("multipleOf");
    if (t == "integer") return bounded ? bounded_integer(s, path) : number(true);
    if (t == "number") {
      if (s.contains("multipleOf")) {
        // An integer's multiples are integers (written so); a power of ten's below 1 (0.01) are the
        // numbers of at most that many fraction digits. Other steps (0.25) are refused.
        const json& m = s["multipleOf"];
        if (!m.is_number() || !(m.get<double>() > 0)) fail(path, "'multipleOf' must be a number > 0");
        if (std::floor(m.get<double>()) == m.get<double>()) return bounded_integer(s, path);
        const Decimal d = decimal_of(m);
        const size_t k = d.frac.size();
        if (d.int_digits != "0" || k == 0 || k > 16 || d.frac.find_first_not_of('0') != k - 1 || d.frac.back() != '1')
          fail(path, "'multipleOf' on numbers is supported as an integer or a power of ten below 1 (0.1, 0.01, ...)");
        frac_digits_ = int(k);
        const uint32_t r = bounded_number(s, path);
        frac_digits_ = 16;
        return r;
      }
      return bounded ? bounded_number(s, path) : number(false);
    }
    if (t == "string" && s.contains("format")) {
      const uint32_t r = format(s["format"], path);
      if (r != UINT32_MAX) {
        if (s.contains("minLength") || s.contains("maxLength") || s.contains("pattern"))
          fail(path, "'format' beside minLength/maxLength/pattern is not supported");
        return r;
      }
      // Another format: an annotation (JSON Schema 2020-12's default), the string is plain.
    }
    if (t == "string") {
      const uint32_t min_len = s.contains("minLength") ? count_of(s, "minLength", path) : 0;
      const uint32_t max_len = count_of(s, "maxLength", path);
      if (min_len > max_len) no_fit(path, "'minLength' is larger than 'maxLength'");
      if (s.contains("pattern")) {
        RegexOptions o;
        o.json_string = true;
        o.min_len = min_len;
        o.max_len = max_len;
        return rule_of({Seq{ch('"'), rule(dfa_rules(regex(s, path, o), true)), ch('"')}});
      }
      return rule_of({{str(min_len, max_len)}});
    }
    if (t == "array") return array(s, path);
    return object(s, path);
  }

  // A pattern as a JSON Schema validator reads it: a match anywhere unless anchored; its errors
  // name `path`.
  static RegexDfa search_regex(const std::string& pattern, const std::string& path, RegexOptions o) {
    o.search = true;
    try {
      return compile_regex(pattern, o);
    } catch (const std::invalid_argument& e) {
      fail(path, e.what());
    }
  }
  // A string's `pattern`.
  static RegexDfa regex(const json& s, const std::string& path, RegexOptions o) {
    if (!s["pattern"].is_string()) fail(path, "'pattern' must be a string");
    return search_regex(s["pattern"].get<std::string>(), path, o);
  }

  // A rule that reads one code point of `set`: its bytes (UTF-8, or its JSON encoding) as a tree
  // of rules, the encodings determinized byte by byte, so that a rule has one alternative per set
  // of bytes that lead alike (a class of hundreds of ranges, such as [^\w], keeps a handful of
  // parse stacks). One per set, shared by every state and rule that reads it.
  uint32_t code_point_rule(const CodePoints& set, bool json_string) {
    auto found = code_point_rules_.find({set, json_string});
    if (found != code_point_rules_.end()) return found->second;
    const std::vector<ByteSeq> seqs = encode_code_points(set, json_string);
    using Key = std::vector<std::pair<uint32_t, uint32_t>>;  // (encoding, bytes of it read)
    std::map<Key, uint32_t> node_rule;
    std::vector<std::pair<Key, uint32_t>> todo;
    Key root;
    for (uint32_t c = 0; c < seqs.size(); ++c) root.emplace_back(c, 0);
    const uint32_t top = new_rule();
    todo.emplace_back(std::move(root), top);
    std::array<std::vector<uint32_t>, 256> at;  // per byte: the key's entries that take it
    for (size_t t = 0; t < todo.size(); ++t) {
      const Key key = todo[t].first;
      const uint32_t r = todo[t].second;
      for (auto& a : at) a.clear();
      for (uint32_t j = 0; j < key.size(); ++j) {
        const ByteClass& cls = seqs[key[j].first][key[j].second];
        for (int w = 0; w < 4; ++w)
          for (uint64_t bits = cls[size_t(w)]; bits; bits &= bits - 1) at[size_t(w * 64 + __builtin_ctzll(bits))].push_back(j);
      }
      std::map<std::vector<uint32_t>, ByteSet> groups;
      for (int b = 0; b < 256; ++b)
        if (!at[size_t(b)].empty()) groups[at[size_t(b)]][size_t(b >> 6)] |= uint64_t(1) << (b & 63);
      for (const auto& [entries, bs] : groups) {
        Key next;
        bool done = false;
        for (uint32_t j : entries) {
          const auto [c, p] = key[j];
          if (p + 1 == seqs[c].size()) done = true;
          else next.emplace_back(c, p + 1);
        }
        if (done) alt(r, {bytes(bs)});
        if (next.empty()) continue;
        auto [it, fresh] = node_rule.emplace(next, 0);
        if (fresh) {
          it->second = new_rule();
          todo.emplace_back(next, it->second);
        }
        alt(r, {bytes(bs), rule(it->second)});
      }
    }
    code_point_rules_.emplace(std::make_pair(set, json_string), top);
    return top;
  }

  // One rule per state of the automaton: for each set of code points it reads, the rule of one
  // such code point, then the rule of the state it leads to (which ends the state's rule: the
  // stack keeps one frame per state), and the empty alternative where it accepts. An NFA (a pattern
  // past RegexOptions::max_states) is refused when its states' alternatives in all could open more
  // parse stacks than half of kMaxStacks: the text may be in all its states at once.
  uint32_t dfa_rules(const RegexDfa& d, bool json_string) {
    const uint32_t base = uint32_t(g_.rules_.size());
    for (size_t i = 0; i < d.states.size(); ++i) new_rule();
    size_t opened = 0;
    for (size_t i = 0; i < d.states.size(); ++i) {
      for (const auto& [set, to] : d.states[i].next) {
        const uint32_t cp = code_point_rule(set, json_string);
        alt(base + uint32_t(i), {rule(cp), rule(base + to)});
        opened += g_.rules_[cp].size();
      }
      if (d.states[i].accept) alt(base + uint32_t(i), {});
      if (!d.deterministic && opened > Grammar::kMaxStacks / 2)
        throw std::invalid_argument("the pattern is too complex: its automaton needs more states than kvq builds, and "
                                    "its NFA could open more parse stacks than kvq tracks");
    }
    return base;
  }

 public:
  void compile_regex_text(std::string_view pattern, const RegexOptions& opt) {
    schema_ = false;
    const uint32_t r = dfa_rules(compile_regex(pattern, opt), opt.json_string);
    g_.root_ = uint32_t(g_.elems_.size());
    g_.elems_.push_back(rule(r));
    g_.elems_.push_back({Grammar::kEnd, 0});
  }

 private:
  // A number's bound as exact decimal digits (from the shortest text that reads back as it).
  struct Decimal {
    bool neg = false;
    std::string int_digits = "0";  // no leading zeros; past 16 digits, 10^16
    std::string frac;              // no trailing zeros
  };
  static Decimal decimal_of(const json& v) {
    const std::string t = v.dump();
    Decimal d;
    size_t i = 0;
    if (t[0] == '-') {
      d.neg = true;
      i = 1;
    }
    std::string mant;
    int point = -1;
    for (; i < t.size() && t[i] != 'e' && t[i] != 'E'; ++i) {
      if (t[i] == '.') point = int(mant.size());
      else mant += t[i];
    }
    if (point < 0) point = int(mant.size());
    if (i < t.size()) point += std::stoi(t.substr(i + 1));
    std::string ip, fp;
    if (point <= 0) {
      ip = "0";
      fp = std::string(size_t(std::min(-point, 400)), '0') + mant;
    } else if (size_t(point) >= mant.size()) {
      ip = mant + std::string(size_t(std::min(point, 400)) - mant.size(), '0');
    } else {
      ip = mant.substr(0, size_t(point));
      fp = mant.substr(size_t(point));
    }
    while (ip.size() > 1 && ip[0] == '0') ip.erase(0, 1);
    while (!fp.empty() && fp.back() == '0') fp.pop_back();
    if (ip.size() > 16) {
      ip = "10000000000000000";
      fp.clear();
    }
    if (ip == "0" && fp.empty()) d.neg = false;
    d.int_digits = ip;
    d.frac = fp;
    return d;
  }
  struct NumBound {
    bool set = false;
    Decimal d;
    bool exclusive = false;
  };

  // Fraction digits D (the number's 0.D) at least (or above) 0.f: a regular expression.
  static std::string frac_at_least(const std::string& f, bool exclusive) {
    if (f.empty()) return exclusive ? "0*[1-9][0-9]*" : "[0-9]*";
    const char c = f[0];
    std::string alts;
    if (c < '9') alts = std::string("[") + char(c + 1) + "-9][0-9]*|";
    return "(?:" + alts + c + frac_at_least(f.substr(1), exclusive) + ")";
  }
  // ... at most (or below) 0.f; empty when none is (below 0).
  static std::string frac_at_most(const std::string& f, bool exclusive) {
    if (f.empty()) return exclusive ? "" : "0*";
    const char c = f[0];
    std::string alts = "|";  // D ends before f does: below it (f has no trailing zeros)
    if (c > '0') alts += std::string("[0-") + char(c - 1) + "][0-9]*|";
    const std::string rest = frac_at_most(f.substr(1), exclusive);
    if (!rest.empty()) alts += c + rest + "|";
    alts.pop_back();
    return "(?:" + alts + ")";
  }

  // An optional fraction (".D", at most frac_digits_ digits) whose 0.D keeps within the bounds
  // given; the empty text stands for no fraction (0.D = 0). UINT32_MAX when no fraction, not even
  // none, does.
  uint32_t fraction(const std::string* lo, bool lo_ex, const std::string* hi, bool hi_ex) {
    RegexOptions o;
    o.max_len = 16;  // (a bound's fractions may all be longer than frac_digits_: cut below)
    RegexDfa d = compile_regex(frac_digits_ < 16 ? "[0-9]{0," + std::to_string(frac_digits_) + "}" : "[0-9]*", o);
    // (A bound no fraction of at most 16 digits passes leaves none: compile_regex refuses a
    // pattern with no text within its length bound.)
    const auto bound = [&](const std::string& re) -> std::optional<RegexDfa> {
      try {
        return compile_regex(re, o);
      } catch (const std::invalid_argument&) {
        return std::nullopt;
      }
    };
    if (lo) {
      const auto b = bound(frac_at_least(*lo, lo_ex));
      if (!b) return UINT32_MAX;
      d = intersect(d, *b);
    }
    if (hi) {
      const std::string re = frac_at_most(*hi, hi_ex);
      if (re.empty()) return UINT32_MAX;
      const auto b = bound(re);
      if (!b) return UINT32_MAX;
      if (!d.states.empty()) d = intersect(d, *b);
    }
    if (d.states.empty()) return UINT32_MAX;
    const uint32_t base = dfa_rules(d, false);
    const uint32_t r = new_rule();
    for (const auto& [set, to] : d.states[0].next) alt(r, {ch('.'), rule(code_point_rule(set, false)), rule(base + to)});
    if (d.states[0].accept) alt(r, {});
    return g_.rules_[r].empty() ? UINT32_MAX : r;
  }

  // A non-negative magnitude I(.D) within [lo, hi] (exclusive where said; hi unset: no bound), with
  // no exponent: the integer parts strictly between the bounds' take any fraction, those equal to a
  // bound's take the fractions on its side of it. UINT32_MAX when none is.
  uint32_t magnitude(const NumBound& lo, const NumBound& hi) {
    constexpr int64_t big = 9999999999999999;
    const int64_t a = std::stoll(lo.d.int_digits);
    const int64_t b = hi.set ? std::min<int64_t>(std::stoll(hi.d.int_digits), big) : big;
    const uint32_t r = new_rule();
    if (a + 1 <= b - (hi.set ? 1 : 0)) {
      g_.ints_.push_back({a + 1, hi.set ? b - 1 : big, 1});
      Seq x{Elem{Grammar::kInt, uint32_t(g_.ints_.size() - 1)}};
      const uint32_t any = fraction(nullptr, false, nullptr, false);
      alt(r, x + Seq{rule(any)});
    }
    if (a <= b) {
      const bool same = hi.set && a == b;
      const uint32_t f = fraction(&lo.d.frac, lo.exclusive, same ? &hi.d.frac : nullptr, hi.exclusive);
      if (f != UINT32_MAX) alt(r, lit(std::to_string(a)) + Seq{rule(f)});
    }
    if (hi.set && b > a) {
      const uint32_t f = fraction(nullptr, false, &hi.d.frac, hi.exclusive);
      if (f != UINT32_MAX) alt(r, lit(std::to_string(b)) + Seq{rule(f)});
    }
    return g_.rules_[r].empty() ? UINT32_MAX : r;
  }

  // A number within minimum / maximum (exclusive ones too), exact in decimal, written without an
  // exponent, at most 16 digits on each side of the point.
  uint32_t bounded_number(const json& s, const std::string& path) {
    NumBound lo, hi;
    auto take = [&](const char* k, bool lower, bool exclusive) {
      if (!s[k].is_number()) fail(path, std::string("'") + k + "' must be a number");
      if (decimal_of(s[k]).frac.size() > 16)
        fail(path, std::string("'") + k + "' has more than 16 fraction digits (numbers are written with at most 16)");
      NumBound& b = lower ? lo : hi;
      const int c = b.set ? compare_numbers(s[k], lower ? lo_json_ : hi_json_) : 0;
      if (!b.set || (lower ? c > 0 : c < 0) || (c == 0 && exclusive)) {
        b = {true, decimal_of(s[k]), exclusive};
        (lower ? lo_json_ : hi_json_) = s[k];
      }
    };
    const bool ex_lo_flag = s.contains("exclusiveMinimum") && s["exclusiveMinimum"].is_boolean() && s["exclusiveMinimum"].get<bool>();
    const bool ex_hi_flag = s.contains("exclusiveMaximum") && s["exclusiveMaximum"].is_boolean() && s["exclusiveMaximum"].get<bool>();
    if (s.contains("minimum")) take("minimum", true, ex_lo_flag);
    if (s.contains("maximum")) take("maximum", false, ex_hi_flag);
    if (s.contains("exclusiveMinimum") && !s["exclusiveMinimum"].is_boolean()) take("exclusiveMinimum", true, true);
    if (s.contains("exclusiveMaximum") && !s["exclusiveMaximum"].is_boolean()) take("exclusiveMaximum", false, true);
    const uint32_t r = new_rule();
    // Non-negative numbers: magnitudes from max(lo, 0) to hi.
    if (!hi.set || !hi.d.neg) {
      NumBound mlo = lo.set && !lo.d.neg ? lo : NumBound{true, Decimal{}, false};
      const uint32_t m = magnitude(mlo, hi);
      if (m != UINT32_MAX) alt(r, {rule(m)});
    }
    // Negative numbers, -m: m from max(-hi, 0) to -lo.
    if (!lo.set || lo.d.neg) {
      NumBound mlo = hi.set && hi.d.neg ? hi : NumBound{true, Decimal{}, false};
      mlo.d.neg = false;
      NumBound mhi = lo;
      mhi.d.neg = false;
      if (!hi.set || !hi.d.neg) mlo.exclusive = true;  // -0 is 0, written as 0 above
      const uint32_t m = magnitude(mlo, mhi);
      if (m != UINT32_MAX) alt(r, {ch('-'), rule(m)});
    }
    if (g_.rules_[r].empty()) no_fit(path, "no number lies within the schema's minimum and maximum");
    return r;
  }

  // An integer within minimum / maximum (exclusive ones too, numeric as draft 6+ or boolean as
  // draft 4). Bounds past 16 digits are clamped to what the grammar writes.
  uint32_t bounded_integer(const json& s, const std::string& path) {
    constexpr int64_t big = 9999999999999999;  // 16 digits
    int64_t lo = -big, hi = big;
    const bool ex_lo_flag = s.contains("exclusiveMinimum") && s["exclusiveMinimum"].is_boolean() && s["exclusiveMinimum"].get<bool>();
    const bool ex_hi_flag = s.contains("exclusiveMaximum") && s["exclusiveMaximum"].is_boolean() && s["exclusiveMaximum"].get<bool>();
    auto bound = [&](const char* k, bool lower, bool exclusive) {
      if (!s[k].is_number()) fail(path, std::string("'") + k + "' must be a number");
      return int_bound(s[k], lower, exclusive);
    };
    if (s.contains("minimum")) lo = std::max(lo, bound("minimum", true, ex_lo_flag));
    if (s.contains("maximum")) hi = std::min(hi, bound("maximum", false, ex_hi_flag));
    if (s.contains("exclusiveMinimum") && !s["exclusiveMinimum"].is_boolean()) lo = std::max(lo, bound("exclusiveMinimum", true, true));
    if (s.contains("exclusiveMaximum") && !s["exclusiveMaximum"].is_boolean()) hi = std::min(hi, bound("exclusiveMaximum", false, true));
    if (lo > hi) no_fit(path, "no integer of at most 16 digits lies within the schema's minimum and maximum");
    int64_t multiple = 1;
    if (s.contains("multipleOf")) {
      const json& m = s["multipleOf"];
      if (!m.is_number() || !(m.get<double>() > 0)) fail(path, "'multipleOf' must be a number > 0");
      if (!(std::floor(m.get<double>()) == m.get<double>())) fail(path, "'multipleOf' other than an integer is not supported");
      if (m.get<double>() >= 1e16) fail(path, "'multipleOf' of more than 16 digits is not supported");
      multiple = m.is_number_unsigned() ? int64_t(m.get<uint64_t>()) : m.is_number_integer() ? m.get<int64_t>() : int64_t(m.get<double>());
      const int64_t q = hi / multiple - (hi % multiple != 0 && hi < 0 ? 1 : 0);  // floor(hi / multiple)
      if (q * multiple < lo) no_fit(path, "no multiple of 'multipleOf' lies within the schema's minimum and maximum");
    }
    g_.ints_.push_back({lo, hi, multiple});
    return rule_of({{Elem{Grammar::kInt, uint32_t(g_.ints_.size() - 1)}}});
  }

  // The integer bound a number sets: the least integer >= it (lower) or the greatest <= it,
  // past it when exclusive; exact for integers of any size (as JSON writes them), clamped just
  // outside 16 digits.
  static int64_t int_bound(const json& v, bool lower, bool exclusive) {
    constexpr int64_t edge = 10000000000000000;  // one past 16 digits
    if (v.is_number_integer()) {
      __int128 x = v.is_number_unsigned() ? __int128(v.get<uint64_t>()) : __int128(v.get<int64_t>());
      if (exclusive) x += lower ? 1 : -1;
      return int64_t(std::clamp<__int128>(x, -edge, edge));
    }
    const double x = v.get<double>();
    double r = lower ? (exclusive ? std::floor(x) + 1 : std::ceil(x)) : (exclusive ? std::ceil(x) - 1 : std::floor(x));
    r = std::clamp(r, -double(edge), double(edge));
    return int64_t(r);
  }

  // A string of a format: the quotes around the format's text. UINT32_MAX for a format kvq does
  // not generate.
  uint32_t format(const json& f, const std::string& path) {
    if (!f.is_string()) fail(path, "'format' must be a string");
    const std::string name = f.get<std::string>();
    const Elem d = range('0', '9');
    ByteSet hex{};
    for (int c : std::string("0123456789abcdefABCDEF")) hex[size_t(c >> 6)] |= uint64_t(1) << (c & 63);
    const Elem h = bytes(hex);
    auto times = [](const Elem& e, int n) { return Seq(size_t(n), e); };
    auto hour = [&] { return rule_of({Seq{range('0', '1'), d}, Seq{ch('2'), range('0', '3')}}); };
    // A calendar date: years 0001-9999, each month's days (February to the 28th: the 29th would
    // need the year's leap rule).
    auto date = [&] {
      const Elem nz = range('1', '9');
      const uint32_t year = rule_of({Seq{nz, d, d, d}, Seq{ch('0'), nz, d, d}, Seq{ch('0'), ch('0'), nz, d},
                                     Seq{ch('0'), ch('0'), ch('0'), nz}});
      const Seq d_lo = {ch('0'), nz}, d_mid = {range('1', '2'), d};
      const uint32_t d31 = rule_of({d_lo, d_mid, Seq{ch('3'), range('0', '1')}});
      const uint32_t d30 = rule_of({d_lo, d_mid, lit("30")});
      const uint32_t d28 = rule_of({d_lo, Seq{ch('1'), d}, Seq{ch('2'), range('0', '8')}});
      std::vector<Seq> months;
      for (const char* m : {"01", "03", "05", "07", "08", "10", "12"}) months.push_back(lit(m) + Seq{ch('-'), rule(d31)});
      for (const char* m : {"04", "06", "09", "11"}) months.push_back(lit(m) + Seq{ch('-'), rule(d30)});
      months.push_back(lit("02-") + Seq{rule(d28)});
      return Seq{rule(year), ch('-'), rule(rule_of(months))};
    };
    auto time = [&] {
      const uint32_t frac = rule_of({{}, Seq{ch('.'), rule(repeat({d}, 1, 9))}});
      ByteSet sign{};
      sign['+' >> 6] |= uint64_t(1) << ('+' & 63);
      sign['-' >> 6] |= uint64_t(1) << ('-' & 63);
      const uint32_t zone = rule_of({lit("Z"), Seq{bytes(sign), rule(hour()), ch(':'), range('0', '5'), d}});
      return Seq{rule(hour()), ch(':'), range('0', '5'), d, ch(':'), range('0', '5'), d, rule(frac), rule(zone)};
    };
    Seq text;
    if (name == "date") {
      text = date();
    } else if (name == "time") {
      text = time();
    } else if (name == "date-time") {
      text = date() + Seq{ch('T')} + time();
    } else if (name == "uuid") {
      text = times(h, 8) + Seq{ch('-')} + times(h, 4) + Seq{ch('-')} + times(h, 4) + Seq{ch('-')} + times(h, 4) +
             Seq{ch('-')} + times(h, 12);
    } else if (name == "ipv4") {
      const uint32_t octet = rule_of({Seq{d}, Seq{range('1', '9'), d}, Seq{ch('1'), d, d}, Seq{ch('2'), range('0', '4'), d},
                                      Seq{ch('2'), ch('5'), range('0', '5')}});
      text = Seq{rule(octet), ch('.'), rule(octet), ch('.'), rule(octet), ch('.'), rule(octet)};
    } else {
      return UINT32_MAX;
    }
    return rule_of({Seq{ch('"')} + text + Seq{ch('"')}});
  }

  uint32_t array(const json& s, const std::string& path) {
    if (s.contains("uniqueItems") && s["uniqueItems"] == true) return unique_array(s, path);
    std::vector<uint32_t> prefix;  // a tuple's item schemas
    uint32_t rest = UINT32_MAX;    // the others' (none: no more items)
    const json* tuple = nullptr;
    std::string tuple_path;
    if (s.contains("prefixItems")) {
      tuple = &s["prefixItems"];
      tuple_path = child(path, "prefixItems");
    } else if (s.contains("items") && s["items"].is_array()) {
      tuple = &s["items"];  // draft 4-7 tuples: no more items
      tuple_path = child(path, "items");
    }
    if (tuple) {
      if (!tuple->is_array()) fail(tuple_path, "must be a list of schemas");
      for (size_t i = 0; i < tuple->size(); ++i) prefix.push_back(schema((*tuple)[i], child(tuple_path, std::to_string(i))));
    }
    if (s.contains("items") && !s["items"].is_array()) {
      const json& it = s["items"];
      if (!(it.is_boolean() && !it.get<bool>())) rest = schema(it, child(path, "items"));
    } else if (!s.contains("items") && !s.contains("prefixItems")) {
      rest = any();
    } else if (s.contains("prefixItems") && !s.contains("items")) {
      rest = any();
    }
    const uint32_t min = s.contains("minItems") ? count_of(s, "minItems", path) : 0;
    uint32_t max = count_of(s, "maxItems", path);
    if (rest == UINT32_MAX) max = std::min<uint32_t>(max, uint32_t(prefix.size()));
    if (min > max) no_fit(path, "no array fits: 'minItems' is larger than " + std::string(rest == UINT32_MAX ? "the tuple" : "'maxItems'"));
    const uint32_t top = max == kUnbounded ? std::max<uint32_t>({uint32_t(prefix.size()), min, 1}) : max;
    if (top > 10000) fail(path, "'minItems'/'maxItems' above 10000 are not supported");
    auto slot = [&](uint32_t j) { return j < prefix.size() ? prefix[j] : rest; };
    if (max == 0) return rule_of({{ch('['), ws(), ch(']')}});
    // after[j]: after j items, the rest of the array up to its ']'.
    uint32_t next = new_rule();  // after[top]
    alt(next, {});
    if (max == kUnbounded) alt(next, Seq{ch(','), ws(), rule(slot(top)), ws(), rule(next)});
    for (uint32_t j = top - 1; j >= 1; --j) {
      const uint32_t r = new_rule();
      if (j >= min) alt(r, {});
      alt(r, Seq{ch(','), ws(), rule(slot(j)), ws(), rule(next)});
      next = r;
    }
    std::vector<Seq> alts;
    if (min == 0) alts.push_back({ch('['), ws(), ch(']')});
    alts.push_back({ch('['), ws(), rule(slot(0)), ws(), rule(next), ch(']')});
    return rule_of(alts);
  }

  // uniqueItems on an array whose items take finitely many values (an enum, a const, booleans):
  // the items are a subsequence of the values in their written order, so each comes at most once.
  // Other item schemas are refused: uniqueness among free strings or numbers is not a grammar.
  uint32_t unique_array(const json& s, const std::string& path) {
    if (s.contains("prefixItems") || !s.contains("items") || !s["items"].is_object())
      fail(path, "'uniqueItems' is supported on arrays whose 'items' is one schema of finitely many values (an enum, "
                 "a const, booleans)");
    // The item schema compiled as any other, for its checks (keywords refused, values too deep, a
    // const not in its enum, ...); its values are then read from it.
    (void)schema(s["items"], child(path, "items"));
    const std::vector<json> values = finite_item_values(s["items"], child(path, "items"));
    if (values.empty())
      fail(path, "'uniqueItems' is supported on arrays whose items are an enum, a const or booleans (uniqueness among "
                 "other values is not a grammar)");
    if (values.size() > 256) fail(path, "'uniqueItems' over more than 256 values is not supported");
    const uint32_t k = uint32_t(values.size());
    const uint32_t min = s.contains("minItems") ? count_of(s, "minItems", path) : 0;
    const uint32_t max_items = count_of(s, "maxItems", path);
    if (min > max_items) no_fit(path, "no array fits: 'minItems' is larger than 'maxItems'");
    if (min > k) no_fit(path, "no array fits: 'minItems' is larger than the distinct values of the items");
    const uint32_t max = std::min(max_items, k);
    // from[j][c]: the c-th item, value j or a later one, then the rest; after it, the rest up to
    // ']'. The count c only where minItems / maxItems bound it (else one level).
    const bool counted = min > 0 || max < k;
    const uint32_t top = counted ? std::max<uint32_t>(max, 1) : 1;
    if (size_t(k) * top > 16384) fail(path, "'uniqueItems' with this many values and items is not supported");
    std::vector<uint32_t> item(k);  // each value's text, one rule
    for (uint32_t i = 0; i < k; ++i) {
      Seq text;
      value_text(values[i], text);
      item[i] = rule_of({text});
    }
    const auto next = [&](uint32_t c) { return counted ? c + 1 : 1; };
    const auto may_add = [&](uint32_t c) { return !counted || c < max; };
    const auto may_end = [&](uint32_t c) { return !counted || c >= min; };
    std::vector<uint32_t> from(size_t(k) * top);
    auto at = [&](uint32_t j, uint32_t c) { return from[size_t(j) * top + (c - 1)]; };
    for (uint32_t j = 0; j < k; ++j)
      for (uint32_t c = 1; c <= top; ++c) from[size_t(j) * top + (c - 1)] = new_rule();
    for (uint32_t j = 0; j < k; ++j)
      for (uint32_t c = 1; c <= top; ++c) {
        const uint32_t rest = new_rule();
        if (may_add(c) && j + 1 < k) alt(rest, Seq{ch(','), ws(), rule(at(j + 1, next(c)))});
        if (may_end(c)) alt(rest, {});
        alt(at(j, c), {rule(item[j]), ws(), rule(rest)});
        if (j + 1 < k) alt(at(j, c), {rule(at(j + 1, c))});
      }
    std::vector<Seq> alts;
    if (min == 0) alts.push_back({ch('['), ws(), ch(']')});
    if (max > 0) alts.push_back({ch('['), ws(), rule(at(0, 1)), ch(']')});
    return rule_of(alts);
  }

  // A property name's automaton from a pattern, over the name's code points, each in one JSON
  // encoding.
  static RegexDfa name_regex(const std::string& pattern, const std::string& path) {
    RegexOptions o;
    o.json_string = true;
    return search_regex(pattern, path, o);
  }

  // `propertyNames`: the names it allows, as a finite list (an enum or const, `false`) or as an
  // automaton (pattern, minLength, maxLength); neither when it allows any name.
  struct NameRule {
    std::optional<std::vector<std::string>> words;
    std::optional<RegexDfa> dfa;
    bool allows(const std::string& name) const {
      if (words) return std::find(words->begin(), words->end(), name) != words->end();
      return !dfa || dfa->matches(name);
    }
  };
  NameRule property_names(const json& pn, const std::string& path) {
    NameRule out;
    std::string dangling;
    const json* s = follow_aliases(&pn, &dangling);  // $ref (pydantic's dict keyed by an Enum), allOf of one
    if (!s && !dangling.empty()) fail(path, "$ref '" + dangling + "' points at nothing in the schema");
    if (!s) fail(path, "'propertyNames' through more than 64 $refs (a $ref that comes back to itself?)");
    if (s->is_boolean()) {
      if (!s->get<bool>()) out.words.emplace();
      return out;
    }
    if (!s->is_object()) fail(path, "a schema must be an object or a boolean");
    static const std::set<std::string> known = {"type", "pattern", "minLength", "maxLength", "enum", "const", "format"};
    for (const auto& [k, v] : s->items())
      if (!known.count(k) && !is_annotation(k))
        fail(path, "'" + k + "' in 'propertyNames' is not supported (supported there: type, pattern, minLength, maxLength, enum, "
                   "const, and $ref to a schema of those)");
    if (s->contains("format") && (*s)["format"].is_string()) {
      static const std::set<std::string> generated = {"date", "time", "date-time", "uuid", "ipv4"};
      if (generated.count((*s)["format"].get<std::string>()))
        fail(path, "'format' in 'propertyNames' is not supported (give a 'pattern')");
    }
    const uint32_t min_len = s->contains("minLength") ? count_of(*s, "minLength", path) : 0;
    const uint32_t max_len = count_of(*s, "maxLength", path);
    if (s->contains("pattern") && !(*s)["pattern"].is_string()) fail(path, "'pattern' must be a string");
    std::vector<json> values;
    if (s->contains("enum")) {
      if (!(*s)["enum"].is_array() || (*s)["enum"].empty()) fail(path, "'enum' must be a non-empty list");
      values = (*s)["enum"].get<std::vector<json>>();
      if (s->contains("const") && std::find(values.begin(), values.end(), (*s)["const"]) == values.end())
        fail(path, "'const' is not one of 'enum'");
    }
    if (s->contains("const")) values = {(*s)["const"]};
    // A rule that no name meets leaves the object no property (JSON Schema: {} still validates).
    bool none = min_len > max_len;
    if (s->contains("type")) {
      const std::vector<std::string> ts = types_of(*s, path);
      none = none || std::find(ts.begin(), ts.end(), "string") == ts.end();
    }
    std::optional<RegexDfa> pattern;
    if (!none && s->contains("pattern")) {
      const std::string text = (*s)["pattern"].get<std::string>();
      try {
        RegexOptions o;
        o.json_string = true;
        o.search = true;
        o.min_len = min_len;
        o.max_len = max_len;
        pattern = compile_regex(text, o);
      } catch (const std::invalid_argument&) {
        (void)name_regex(text, path);  // the pattern's own error, if it has one
        none = true;                   // else: no name of it within the length bounds
      }
    }
    if (none) {
      out.words.emplace();
      return out;
    }
    if (s->contains("enum") || s->contains("const")) {
      out.words.emplace();
      for (const json& v : values) {
        if (!v.is_string()) continue;  // names are strings
        const std::string w = v.get<std::string>();
        if (!within_bounds(*s, v, path) || (pattern && !pattern->matches(w))) continue;
        if (std::find(out.words->begin(), out.words->end(), w) == out.words->end()) out.words->push_back(w);
      }
      return out;
    }
    if (pattern) {
      out.dfa = std::move(pattern);
    } else if (min_len > 0 || max_len != UINT32_MAX) {
      try {
        out.dfa = dfa_of_length(min_len, max_len);
      } catch (const std::invalid_argument& e) {
        fail(path, e.what());
      }
    }
    return out;
  }

  // Names of printable ASCII alone, on which ECMA-262's and Python's readings of a pattern agree
  // (they differ on `$` before a final newline, `.` on \r and U+2028/9, and \d \w \s beyond
  // ASCII): the names whose pattern a complement decides are kept to these.
  static bool printable_ascii(const std::string& name) {
    return std::all_of(name.begin(), name.end(), [](char c) { return c >= 0x20 && c <= 0x7E; });
  }
  static RegexDfa printable_ascii_dfa() {
    RegexDfa d;
    d.states.resize(1);
    d.states[0].accept = true;
    d.states[0].next.push_back({CodePoints{{0x20, 0x7E}}, 0});
    return d;
  }

  // True for the schemas that accept every value: true, {} and annotations alone.
  static bool accepts_all(const json& s) {
    if (s.is_boolean()) return s.get<bool>();
    return s.is_object() && std::all_of(s.items().begin(), s.items().end(), [](const auto& kv) { return is_annotation(kv.key()); });
  }

  struct Prop {
    std::string name;
    const json* schema;
    std::string path;
  };
  struct NamePattern {
    std::string pattern;
    RegexDfa dfa;
    const json* schema;
  };

  // The extra properties' keys (with their quotes) and values' rules where names are ruled by
  // patterns or propertyNames: a name no listed property has and propertyNames allows, in one
  // alternative per pattern (the names it matches, but not those of a pattern with another
  // schema: such a name would need both) and one for additionalProperties (the names no pattern
  // matches). Each key is written in one encoding per character.
  std::vector<std::pair<Seq, uint32_t>> extra_rules(const std::vector<Prop>& props, const std::vector<NamePattern>& patterns,
                                                    const NameRule& names_rule, const json* extra_schema,
                                                    const std::string& extra_path, const std::string& path) {
    constexpr size_t kMaxNameStates = 20000;
    std::vector<std::tuple<std::optional<RegexDfa>, const json*, std::string>> branches;  // keys (none: any), value
    try {
      std::vector<std::string> listed;
      for (const Prop& p : props) listed.push_back(p.name);
      std::optional<RegexDfa> base;
      const auto meet = [&](std::optional<RegexDfa>& acc, const RegexDfa& d) {
        acc = acc ? intersect(*acc, d, kMaxNameStates) : d;
      };
      const bool combined = !listed.empty() || names_rule.dfa || patterns.size() > 1 || (extra_schema && !patterns.empty());
      for (const NamePattern& np : patterns)
        if (combined && !np.dfa.deterministic)
          fail(child(child(path, "patternProperties"), np.pattern),
               "the pattern's automaton is too large to be deterministic, which combining it with the other property names needs");
      if (combined && names_rule.dfa && !names_rule.dfa->deterministic)
        fail(child(path, "propertyNames"), "the pattern's automaton is too large to be deterministic, which combining it with the other property names needs");
      if (!listed.empty()) base = dfa_complement(dfa_of_words(listed));
      if (names_rule.dfa) meet(base, *names_rule.dfa);
      if (!patterns.empty()) meet(base, printable_ascii_dfa());
      for (size_t i = 0; i < patterns.size(); ++i) {
        if (*patterns[i].schema == false) continue;  // names it matches are not written
        std::optional<RegexDfa> keys = patterns[i].dfa;
        for (size_t j = 0; j < patterns.size(); ++j)
          if (j != i && *patterns[j].schema != *patterns[i].schema) meet(keys, dfa_complement(patterns[j].dfa));
        if (base) meet(keys, *base);
        if (!keys->states.empty())
          branches.emplace_back(std::move(keys), patterns[i].schema, child(child(path, "patternProperties"), patterns[i].pattern));
      }
      if (extra_schema) {
        std::optional<RegexDfa> keys = base;
        for (const NamePattern& np : patterns) meet(keys, dfa_complement(np.dfa));
        if (!keys || !keys->states.empty()) branches.emplace_back(std::move(keys), extra_schema, extra_path);
      }
    } catch (const std::invalid_argument& e) {
      if (std::string_view(e.what()).starts_with("json_schema at ")) throw;  // already names its place
      fail(path, std::string("property names (patternProperties / propertyNames / the listed names): ") + e.what());
    }
    std::vector<std::pair<Seq, uint32_t>> out;
    for (const auto& [keys, sch, where] : branches) {
      const Seq key = keys ? Seq{ch('"'), rule(dfa_rules(*keys, true)), ch('"')} : Seq{str(0, kUnbounded)};
      out.emplace_back(key, schema(*sch, where));
    }
    return out;
  }

  uint32_t object(const json& s, const std::string& path) {
    std::vector<Prop> props;
    if (s.contains("properties")) {
      if (!s["properties"].is_object()) fail(path, "'properties' must be an object");
      for (const auto& [k, v] : s["properties"].items()) props.push_back({k, &v, child(child(path, "properties"), k)});
    }
    if (props.size() > 1000) fail(path, "objects of more than 1000 properties are not supported");
    std::set<std::string> required;
    if (s.contains("required")) {
      if (!s["required"].is_array()) fail(path, "'required' must be a list of names");
      for (const json& r : s["required"]) {
        if (!r.is_string()) fail(path, "'required' must be a list of names");
        const std::string name = r.get<std::string>();
        if (std::none_of(props.begin(), props.end(), [&](const Prop& p) { return p.name == name; }))
          fail(path, "required property '" + name + "' is not in 'properties'");
        required.insert(name);
      }
    }
    // The extra properties' schema (additionalProperties; absent: none, unless the schema lists no
    // properties at all: {"type": "object"} is any object).
    static const json kAnyValue = true;
    const json* extra_schema = nullptr;
    std::string extra_path = child(path, "additionalProperties");
    if (s.contains("additionalProperties")) {
      const json& ap = s["additionalProperties"];
      if (!ap.is_boolean() || ap.get<bool>()) extra_schema = &ap;
    } else if (!s.contains("properties") && !s.contains("patternProperties")) {
      extra_schema = &kAnyValue;
    }
    // patternProperties: a name that matches a pattern takes its schema; propertyNames holds for
    // every name. The names of the listed properties are checked against both here.
    std::vector<NamePattern> patterns;
    if (s.contains("patternProperties")) {
      const json& pp = s["patternProperties"];
      if (!pp.is_object()) fail(path, "'patternProperties' must be an object");
      if (pp.size() > 64) fail(path, "'patternProperties' with more than 64 patterns is not supported");
      for (const auto& [k, v] : pp.items())
        patterns.push_back({k, name_regex(k, child(child(path, "patternProperties"), k)), &v});
    }
    NameRule names_rule;
    if (s.contains("propertyNames")) names_rule = property_names(s["propertyNames"], child(path, "propertyNames"));
    std::erase_if(props, [&](const Prop& p) {
      if (names_rule.allows(p.name)) return false;
      if (required.count(p.name)) no_fit(path, "no object fits: required property '" + p.name + "' is not allowed by 'propertyNames'");
      return true;  // an optional property propertyNames rules out: never written
    });
    // A listed property a pattern of another schema matches would need both: refused (one whose
    // pattern schema is false: left out, or no object fits when it is required). Outside printable
    // ASCII, where Python's reading of a pattern may match what kvq's does not, such a pattern
    // refuses the name whether or not kvq's reading matches it.
    std::erase_if(props, [&](const Prop& p) {
      for (const NamePattern& np : patterns) {
        if (accepts_all(*np.schema) || *np.schema == *p.schema) continue;
        const bool hit = np.dfa.matches(p.name);
        if (!hit && printable_ascii(p.name)) continue;
        if (hit && *np.schema == false) {
          if (required.count(p.name)) no_fit(path, "no object fits: required property '" + p.name + "' matches 'patternProperties' '" + np.pattern + "', whose schema is false");
          return true;
        }
        fail(path, "property '" + p.name + "' is in 'properties' and " +
                       (hit ? "matches" : "has characters outside printable ASCII beside") + " 'patternProperties' '" + np.pattern +
                       "' with another schema: both could apply, which is not supported");
      }
      return false;
    });
    // The schema a name outside the listed ones takes: that of the patterns it matches (all alike),
    // else additionalProperties; nullptr when none (or patterns with different schemas) would.
    const auto extra_for = [&](const std::string& name) -> std::pair<const json*, std::string> {
      if (!patterns.empty() && !printable_ascii(name)) return {nullptr, ""};  // the readings could differ
      const NamePattern* hit = nullptr;
      for (const NamePattern& np : patterns)
        if (np.dfa.matches(name)) {
          if (hit && *hit->schema != *np.schema) return {nullptr, ""};
          hit = &np;
        }
      if (hit) {
        if (*hit->schema == false) return {nullptr, ""};
        return {hit->schema, child(child(path, "patternProperties"), hit->pattern)};
      }
      return {extra_schema, extra_path};
    };
    // The extra properties as alternatives of a key and its value's rule.
    std::vector<std::pair<Seq, uint32_t>> extras;
    if (names_rule.words) {
      // Finitely many names: each one not listed becomes an optional property after the listed
      // ones (so none is written twice).
      for (const std::string& w : *names_rule.words) {
        if (std::any_of(props.begin(), props.end(), [&](const Prop& p) { return p.name == w; })) continue;
        const auto [sch, where] = extra_for(w);
        if (sch) props.push_back({w, sch, where});
      }
      if (props.size() > 1000) fail(path, "objects of more than 1000 properties are not supported");
    } else if (!patterns.empty() || names_rule.dfa) {
      extras = extra_rules(props, patterns, names_rule, extra_schema, extra_path, path);
    } else if (extra_schema) {
      std::vector<std::string> names;  // an extra property is none of the listed ones
      for (const Prop& p : props) {
        const std::string q = json(p.name).dump(-1, ' ', false, json::error_handler_t::strict);
        if (q.size() > kMaxWord) fail(path, "a property name longer than 4096 bytes beside additionalProperties");
        names.push_back(q.substr(1, q.size() - 2));
      }
      std::sort(names.begin(), names.end());
      extras.emplace_back(names.empty() ? Seq{str(0, kUnbounded)}
                                        : Seq{ch('"'), rule(key_trie(names, 0, names.size(), 0, str_body()))},
                          schema(*extra_schema, extra_path));
    }
    const bool has_extra = !extras.empty();
    // The listed properties' values; an optional property whose merged allOf no value fits is
    // left out (a required one: no object fits).
    std::vector<uint32_t> value_rules;
    for (size_t i = 0; i < props.size();) {
      try {
        value_rules.push_back(schema(*props[i].schema, props[i].path));
        ++i;
      } catch (const NoValue&) {
        if (required.count(props[i].name)) throw;
        props.erase(props.begin() + std::ptrdiff_t(i));
      }
    }
    // minProperties / maxProperties: the rules below count the properties written, c, up to T (past
    // it, counts are alike: T is maxProperties when set, else minProperties).
    const uint32_t n_required = uint32_t(required.size());
    const uint32_t min_props = s.contains("minProperties") ? count_of(s, "minProperties", path) : 0;
    const uint32_t max_props = count_of(s, "maxProperties", path);
    if (n_required > max_props) no_fit(path, "no object fits: more properties are required than 'maxProperties'");
    if (min_props > max_props) no_fit(path, "no object fits: 'minProperties' is more than 'maxProperties'");
    // Other properties count once toward minProperties: their names could repeat (a JSON object
    // with a repeated name has one property of it), the listed ones' cannot.
    if (min_props > props.size() + (has_extra ? 1 : 0)) {
      if (!has_extra) no_fit(path, "no object fits: 'minProperties' is more than the properties the schema allows");
      fail(path, has_extra ? "'minProperties' beyond the listed properties and one other is not supported (other "
                             "properties' names could repeat, and a repeated name is one property)"
                           : "");
    }
    const bool counted = min_props > n_required || (max_props != kUnbounded && (max_props < props.size() || has_extra));
    const uint32_t T = !counted ? 0 : max_props != kUnbounded ? max_props : min_props;
    if (size_t(props.size() + 1) * (size_t(T) + 1) > 65536)
      fail(path, "'minProperties'/'maxProperties' with this many properties are not supported");
    const auto level = [&](uint32_t c) { return std::min(c, T); };
    const auto may_end = [&](uint32_t c) { return !counted || c >= min_props; };
    const auto may_add = [&](uint32_t c) { return !counted || max_props == kUnbounded || c < max_props; };
    // C[i][c]: one property at or after i (an optional one may be passed over), then B of the next;
    // B[i][c]: after at least one property, the rest from i on (each after a ','; the ',' and its gap
    // shared, so that the candidates after it are one parse stack each); c: the properties written
    // before. Past the listed properties (i = n), the extra ones.
    const size_t n = props.size();
    std::vector<char> rest_optional(n + 1, 1);  // no required property at or after i
    for (size_t i = n; i-- > 0;) rest_optional[i] = rest_optional[i + 1] && !required.count(props[i].name);
    const uint32_t levels = T + 1;
    std::vector<uint32_t> c_next(levels, UINT32_MAX), b_next(levels);  // C[n], B[n] (C: none when no extra property)
    if (has_extra) {
      std::vector<Seq> kvs;
      for (const auto& [key, value] : extras) kvs.push_back(key + Seq{ws(), ch(':'), ws(), rule(value), ws()});
      const Seq kv = kvs.size() == 1 ? kvs[0] : Seq{rule(rule_of(kvs))};
      // X[c]: after an other property, c written in all (for maxProperties); minProperties was met
      // on the way in: the listed ones written, c, and one other when c is one short.
      std::vector<uint32_t> x(levels);
      for (uint32_t c = 0; c < levels; ++c) x[c] = new_rule();
      for (uint32_t c = 0; c < levels; ++c) {
        alt(x[c], {});
        if (may_add(c)) alt(x[c], Seq{ch(','), ws()} + kv + Seq{rule(x[level(c + 1)])});
      }
      const auto enough = [&](uint32_t c) { return !counted || c + 1 >= min_props; };  // with one other
      for (uint32_t c = 0; c < levels; ++c) {
        b_next[c] = new_rule();
        if (may_end(c)) alt(b_next[c], {});
        if (may_add(c) && enough(c)) alt(b_next[c], Seq{ch(','), ws()} + kv + Seq{rule(x[level(c + 1)])});
        if (may_add(c) && enough(c)) c_next[c] = rule_of({kv + Seq{rule(x[level(c + 1)])}});
      }
    } else {
      for (uint32_t c = 0; c < levels; ++c) b_next[c] = may_end(c) ? rule_of({{}}) : new_rule();
    }
    for (size_t i = n; i-- > 0;) {
      const std::string& name = props[i].name;
      const Seq kv = lit(json(name).dump(-1, ' ', false, json::error_handler_t::strict)) +
                     Seq{ws(), ch(':'), ws(), rule(value_rules[i]), ws()};
      std::vector<uint32_t> cs(levels, UINT32_MAX), bs(levels);
      for (uint32_t c = 0; c < levels; ++c) {
        const uint32_t cr = new_rule();
        if (may_add(c)) alt(cr, kv + Seq{rule(b_next[level(c + 1)])});
        if (!required.count(name) && c_next[c] != UINT32_MAX) alt(cr, {rule(c_next[c])});
        cs[c] = cr;
        const uint32_t b = new_rule();
        if (rest_optional[i] && may_end(c)) alt(b, {});
        alt(b, Seq{ch(','), ws(), rule(cr)});
        bs[c] = b;
      }
      c_next = std::move(cs);
      b_next = std::move(bs);
    }
    std::vector<Seq> open;  // after '{' and its gap
    if (rest_optional[0] && may_end(0)) open.push_back({ch('}')});
    if (c_next[0] != UINT32_MAX) open.push_back({rule(c_next[0]), ch('}')});
    if (open.empty()) no_fit(path, "no object fits the schema's 'minProperties'/'maxProperties'");
    return rule_of({{ch('{'), ws(), rule(rule_of(open))}});
  }

  // Drops the alternatives that cannot end (they call a rule that never ends: a required
  // recursion), so that no generation goes into one. false when the root is such a rule.
  // The rules whose alternatives satisfy `holds`: those with an alternative whose elements all do,
  // an element `counts` being one that holds only if its rule does (the others: `plain`). A
  // worklist, linear in the grammar's size whatever order the rules come in.
  template <typename Plain>
  std::vector<char> rule_fixpoint(Plain plain) {
    const size_t n = g_.rules_.size();
    std::vector<char> holds(n, 0);
    std::vector<uint32_t> alt_rule, left;                  // per alternative: its rule, rules not yet known
    std::vector<std::vector<uint32_t>> users(n);           // per rule: the alternatives that call it
    std::vector<uint32_t> todo;
    for (size_t r = 0; r < n; ++r)
      for (uint32_t a : g_.rules_[r]) {
        const uint32_t id = uint32_t(alt_rule.size());
        alt_rule.push_back(uint32_t(r));
        uint32_t count = 0;
        bool possible = true;
        for (uint32_t p = a; g_.elems_[p].kind != Grammar::kEnd; ++p) {
          const Elem& e = g_.elems_[p];
          if (e.kind == Grammar::kRule) {
            ++count;
            users[e.arg].push_back(id);
          } else if (!plain(e)) {
            possible = false;
          }
        }
        left.push_back(possible ? count : UINT32_MAX);
        if (possible && count == 0 && !holds[r]) {
          holds[r] = 1;
          todo.push_back(uint32_t(r));
        }
      }
    while (!todo.empty()) {
      const uint32_t r = todo.back();
      todo.pop_back();
      for (uint32_t id : users[r]) {
        if (left[id] == UINT32_MAX || --left[id] != 0) continue;
        const uint32_t q = alt_rule[id];
        if (!holds[q]) {
          holds[q] = 1;
          todo.push_back(q);
        }
      }
    }
    return holds;
  }

  bool prune_unproductive(uint32_t root) {
    const std::vector<char> ends = rule_fixpoint([](const Elem&) { return true; });
    auto alt_ends = [&](uint32_t a) {
      for (uint32_t p = a; g_.elems_[p].kind != Grammar::kEnd; ++p)
        if (g_.elems_[p].kind == Grammar::kRule && !ends[g_.elems_[p].arg]) return false;
      return true;
    };
    for (auto& alts : g_.rules_) std::erase_if(alts, [&](uint32_t a) { return !alt_ends(a); });
    return ends[root] != 0;
  }

  // A rule that can call itself (or another that calls it back) before reading any byte would
  // never end: returns one such rule, or UINT32_MAX when there is none.
  uint32_t left_recursive_rule() {
    const size_t n = g_.rules_.size();
    const std::vector<char> nullable = rule_fixpoint([](const Elem& e) { return e.kind == Grammar::kWs; });
    auto elem_nullable = [&](const Elem& e) {
      return e.kind == Grammar::kWs || (e.kind == Grammar::kRule && nullable[e.arg]);
    };
    std::vector<std::vector<uint32_t>> calls(n);  // rules called before any byte
    for (size_t r = 0; r < n; ++r)
      for (uint32_t a : g_.rules_[r])
        for (uint32_t p = a; g_.elems_[p].kind != Grammar::kEnd; ++p) {
          const Elem& e = g_.elems_[p];
          if (e.kind == Grammar::kRule) calls[r].push_back(e.arg);
          if (!elem_nullable(e)) break;
        }
    std::vector<uint8_t> color(n, 0);  // 0 new, 1 on the path, 2 done
    for (size_t start = 0; start < n; ++start) {
      if (color[start]) continue;
      std::vector<std::pair<uint32_t, size_t>> st{{uint32_t(start), 0}};
      color[start] = 1;
      while (!st.empty()) {
        auto& [r, i] = st.back();
        if (i < calls[r].size()) {
          const uint32_t c = calls[r][i++];
          if (color[c] == 1) return c;
          if (color[c] == 0) {
            color[c] = 1;
            st.push_back({c, 0});
          }
        } else {
          color[r] = 2;
          st.pop_back();
        }
      }
    }
    return UINT32_MAX;
  }

  // A GBNF sequence's elements.
  Seq gbnf_seq(const std::vector<GbnfItem>& seq, uint32_t base) {
    Seq out;
    for (const GbnfItem& item : seq) {
      Seq x;
      switch (item.kind) {
        case GbnfItem::kLiteral: x = lit(item.literal); break;
        case GbnfItem::kRef: x = {rule(base + item.ref)}; break;
        case GbnfItem::kChars: {
          x = {rule(code_point_rule(item.chars, false))};
          break;
        }
        case GbnfItem::kGroup: {
          const uint32_t r = new_rule();
          for (const std::vector<GbnfItem>& a : item.alts) alt(r, gbnf_seq(a, base));
          x = {rule(r)};
          break;
        }
      }
      if (item.min == 1 && item.max == 1) {
        out.insert(out.end(), x.begin(), x.end());
        continue;
      }
      if (x.size() != 1) x = {rule(rule_of({x}))};
      out.push_back(rule(repeat(x, item.min, item.max == UINT32_MAX ? kUnbounded : item.max)));
    }
    return out;
  }

  Grammar& g_;
  const json& root_;
  std::map<std::string, uint32_t> refs_;
  std::map<std::string, uint32_t> all_of_rules_;  // by the text of the allOf's distinct schemas
  size_t distributed_ = 0;                        // anyOf / oneOf branches distributed over allOfs
  std::deque<json> merged_;                       // allOf schemas merged (the rules refer to their paths)
  std::map<ByteSet, uint32_t> set_ids_;
  std::map<std::pair<CodePoints, bool>, uint32_t> code_point_rules_;  // code_point_rule's, by set and encoding
  bool schema_ = true;                          // compiling a JSON Schema (errors name their location)
  json lo_json_, hi_json_;                      // bounded_number's bounds so far
  int frac_digits_ = 16;                        // bounded_number's fraction digits at most (multipleOf 10^-k: k)
  uint32_t any_ = UINT32_MAX, number_ = UINT32_MAX, integer_ = UINT32_MAX;
  int depth_ = 0;
};

std::shared_ptr<const Grammar> Grammar::from_schema(const nlohmann::ordered_json& schema) {
  auto g = std::make_shared<Grammar>();
  SchemaCompiler c(*g, schema);
  c.compile();
  if (GrammarState(g).n_stacks() == 0)
    throw std::invalid_argument("json_schema at '#': the schema's alternatives at the start are more than kvq tracks at once (" +
                                std::to_string(kMaxStacks) + " parse stacks, " + std::to_string(GrammarState::kMaxExpansion) + " rules expanded)");
  return g;
}

std::shared_ptr<const Grammar> Grammar::from_choices(const std::vector<std::string>& choices) {
  auto g = std::make_shared<Grammar>();
  static const nlohmann::ordered_json none;
  SchemaCompiler c(*g, none);
  c.compile_choices(choices);
  return g;
}

std::shared_ptr<const Grammar> Grammar::from_gbnf(std::string_view text) { return from_gbnf(text, {}); }

std::shared_ptr<const Grammar> Grammar::from_gbnf(std::string_view text, const std::vector<std::pair<std::string, nlohmann::ordered_json>>& schemas) {
  std::vector<std::string> names;
  std::vector<const json*> docs;
  for (const auto& [name, schema] : schemas) {
    names.push_back(name);
    docs.push_back(&schema);
  }
  const Gbnf gb = parse_gbnf(text, names);
  auto g = std::make_shared<Grammar>();
  SchemaCompiler(*g, json()).compile_gbnf(gb, docs);
  if (GrammarState(g).n_stacks() == 0)
    throw std::invalid_argument("grammar: root's alternatives at the start are more than kvq tracks at once (" +
                                std::to_string(kMaxStacks) + " parse stacks, " + std::to_string(GrammarState::kMaxExpansion) + " rules expanded)");
  return g;
}

std::shared_ptr<const Grammar> Grammar::from_regex(std::string_view pattern, const RegexOptions& opt) {
  auto g = std::make_shared<Grammar>();
  SchemaCompiler(*g, json()).compile_regex_text(pattern, opt);
  if (GrammarState(g).n_stacks() == 0)
    throw std::invalid_argument("pattern \"" + std::string(pattern) + "\": its alternatives at the start are more than kvq tracks at once (" +
                                std::to_string(kMaxStacks) + " parse stacks, " + std::to_string(GrammarState::kMaxExpansion) + " rules expanded)");
  return g;
}

const std::shared_ptr<const Grammar>& Grammar::json_object() {
  static const std::shared_ptr<const Grammar> g = from_schema_text(R"({"type": "object"})");
  return g;
}

std::shared_ptr<const Grammar> Grammar::from_schema_text(std::string_view text) {
  nlohmann::ordered_json schema;
  try {
    schema = nlohmann::ordered_json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    throw std::invalid_argument(std::string("json_schema is not JSON: ") + e.what());
  }
  return from_schema(schema);
}

// ---- the parse state ----

GrammarState::GrammarState(std::shared_ptr<const Grammar> g) : g_(std::move(g)) {
  if (!g_) return;  // an empty state, to be filled by step()
  Stack s{{g_->root_, 0}};
  Expansion x;
  if (!expand(s, stacks_, x, 0)) stacks_.clear();
  normalize(stacks_);
  if (stacks_.size() > Grammar::kMaxStacks) stacks_.clear();
}

void GrammarState::normalize(std::vector<Stack>& stacks) {
  std::sort(stacks.begin(), stacks.end());
  stacks.erase(std::unique(stacks.begin(), stacks.end()), stacks.end());
}

bool GrammarState::expand(Stack& stack, std::vector<Stack>& out, Expansion& x, int depth) const {
  const Grammar& g = *g_;
  while (true) {
    if (stack.empty()) {
      out.push_back(stack);
      return true;
    }
    Frame& f = stack.back();
    const Elem& e = g.elems_[f.pos];
    switch (e.kind) {
      case Grammar::kEnd:
        stack.pop_back();
        continue;
      case Grammar::kBytes:
      case Grammar::kStr:
        out.push_back(stack);
        return true;
      case Grammar::kWs:
        if (ws_more(f.sub)) out.push_back(stack);
        f = {f.pos + 1, 0};
        continue;
      case Grammar::kInt: {
        const Grammar::IntBounds& b = g.ints_[e.arg];
        if (int_more(b, f.sub)) out.push_back(stack);
        if (!int_complete(b, f.sub)) return true;
        f = {f.pos + 1, 0};
        continue;
      }
      case Grammar::kRule: {
        f = {f.pos + 1, 0};  // where the rule returns to
        while (!stack.empty() && g.elems_[stack.back().pos].kind == Grammar::kEnd) stack.pop_back();
        // Past the limits: the caller drops everything this expansion made (the byte that led
        // here cannot come), rather than keep a part of it that may go nowhere.
        if (stack.size() >= Grammar::kMaxStack || ++x.work > kMaxExpansion || depth > 1000) return false;
        if (out.size() > Grammar::kMaxStacks) {  // the distinct ones only
          std::sort(out.begin() + std::ptrdiff_t(x.from), out.end());
          out.erase(std::unique(out.begin() + std::ptrdiff_t(x.from), out.end()), out.end());
          if (out.size() > Grammar::kMaxStacks) return false;
        }
        const std::vector<uint32_t>& alts = g.rules_[e.arg];
        if (alts.empty()) return true;
        if (x.work > 1024) {  // a configuration met before opens nothing new
          stack.push_back({e.arg, UINT64_MAX});  // (a marker frame: the rule about to be expanded)
          const bool fresh = x.seen.insert(stack).second;
          stack.pop_back();
          if (!fresh) return true;
        }
        for (size_t i = 0; i + 1 < alts.size(); ++i) {
          Stack copy = stack;
          copy.push_back({alts[i], 0});
          if (!expand(copy, out, x, depth + 1)) return false;
        }
        stack.push_back({alts.back(), 0});
        continue;
      }
    }
  }
}

bool GrammarState::step(unsigned char c, GrammarState& out) const {
  const Grammar& g = *g_;
  if (out.g_ != g_) out.g_ = g_;
  out.stacks_.clear();
  const auto grow = [&](Stack& s) {
    const size_t mark = out.stacks_.size();
    Expansion x;
    x.from = mark;
    if (!expand(s, out.stacks_, x, 0)) out.stacks_.resize(mark);
  };
  for (const Stack& st : stacks_) {
    if (st.empty()) continue;
    const Frame& f = st.back();
    const Elem& e = g.elems_[f.pos];
    if (e.kind == Grammar::kBytes) {
      if (!has(g.sets_[e.arg], c)) continue;
      Stack s = st;
      s.back() = {f.pos + 1, 0};
      grow(s);
    } else if (e.kind == Grammar::kStr) {
      const uint64_t n = str_step(g.strs_[e.arg], f.sub, c);
      if (n == kStrFail) continue;
      Stack s = st;
      if (n == kStrClosed) {
        s.back() = {f.pos + 1, 0};
        grow(s);
      } else {
        s.back().sub = n;
        out.stacks_.push_back(std::move(s));
      }
    } else if (e.kind == Grammar::kWs) {
      const uint64_t n = ws_step(f.sub, c);
      if (n == kWsFail) continue;
      Stack s = st;
      s.back().sub = n;
      grow(s);
    } else if (e.kind == Grammar::kInt) {
      const uint64_t n = int_step(g.ints_[e.arg], f.sub, c);
      if (n == kIntFail) continue;
      Stack s = st;
      s.back().sub = n;
      grow(s);
    }
  }
  // Stacks deeper than kMaxStack - kHeadroom are dropped: what completes a document from one may
  // push that many frames more.
  std::erase_if(out.stacks_, [](const Stack& st) { return st.size() > Grammar::kMaxStack - Grammar::kHeadroom; });
  if (out.stacks_.empty()) return false;
  normalize(out.stacks_);
  if (out.stacks_.size() > Grammar::kMaxStacks) {
    out.stacks_.clear();
    return false;
  }
  return true;
}

bool GrammarState::feed(unsigned char c) {
  GrammarState next(nullptr);
  if (!step(c, next)) return false;
  stacks_.swap(next.stacks_);
  return true;
}

bool GrammarState::feed(std::string_view bytes) {
  GrammarState s = *this;
  for (unsigned char c : bytes)
    if (!s.feed(c)) return false;
  stacks_.swap(s.stacks_);
  return true;
}

size_t GrammarState::hash() const {
  uint64_t h = 0x9E3779B97F4A7C15ull ^ stacks_.size();
  for (const Stack& st : stacks_) {
    h = (h ^ st.size()) * 0x100000001B3ull;
    for (const Frame& f : st) h = (h ^ (uint64_t(f.pos) * 0x9E3779B97F4A7C15ull ^ f.sub)) * 0x100000001B3ull;
  }
  return size_t(h ^ (h >> 29));
}

bool GrammarState::accepting() const { return !stacks_.empty() && stacks_.front().empty(); }

bool GrammarState::done() const { return stacks_.size() == 1 && stacks_.front().empty(); }

int64_t GrammarState::string_room() const {
  if (stacks_.empty()) return -1;
  int64_t room = 0;
  for (const Stack& st : stacks_) {
    if (st.empty()) return -1;
    const Elem& e = g_->elems_[st.back().pos];
    if (e.kind != Grammar::kStr) return -1;
    const StrSub s = unpack(st.back().sub);
    const Grammar::StrBounds& b = g_->strs_[e.arg];
    if ((s.phase != kBody && !(s.phase == kOpen && b.opened)) || s.low) return -1;
    room = std::max<int64_t>(room, b.max_len == kUnbounded ? int64_t(kUnbounded) : int64_t(b.max_len) - s.count);
  }
  return room;
}

// ---- the vocabulary trie and the mask ----

GrammarVocab::GrammarVocab(const JsonVocab& vocab) {
  const int32_t n = vocab.n_vocab();
  bytes_.resize(size_t(n));
  text_.assign(size_t(n), 0);
  text_len_.assign(size_t(n), 0);
  std::vector<int32_t> all, special;
  for (int32_t id = 0; id < n; ++id) {
    bytes_[size_t(id)] = vocab.bytes(id);
    if (vocab.ends(id)) eog_ids_.push_back(id);
    text_[size_t(id)] = vocab.string_text(id);
    for (unsigned char c : bytes_[size_t(id)]) text_len_[size_t(id)] += (c & 0xC0) != 0x80;
    if (bytes_[size_t(id)].empty() || vocab.ends(id)) continue;
    all.push_back(id);
    if (!text_[size_t(id)]) special.push_back(id);
  }
  all_ = build(bytes_, all);
  special_ = build(bytes_, special);
}

GrammarVocab::Trie GrammarVocab::build(const std::vector<std::string>& bytes, const std::vector<int32_t>& ids_in) {
  std::vector<int32_t> ids = ids_in;
  std::stable_sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) { return bytes[size_t(a)] < bytes[size_t(b)]; });
  Trie t;
  std::vector<uint32_t> path;  // path[d]: the node at depth d + 1 on the current token's path
  const std::string* prev = nullptr;
  for (int32_t id : ids) {
    const std::string& b = bytes[size_t(id)];
    if (b.size() > 65535) continue;
    size_t common = 0;
    if (prev)
      while (common < prev->size() && common < b.size() && (*prev)[common] == b[common]) ++common;
    while (path.size() > common) {
      t.nodes[path.back()].end = uint32_t(t.nodes.size());
      path.pop_back();
    }
    for (size_t d = common; d < b.size(); ++d) {
      path.push_back(uint32_t(t.nodes.size()));
      t.nodes.push_back({0, uint32_t(t.tokens.size()), 0, uint16_t(d + 1), static_cast<uint8_t>(b[d])});
    }
    Node& end = t.nodes[path.back()];
    if (end.tok_count == 0) end.tok_begin = uint32_t(t.tokens.size());
    t.tokens.push_back(id);
    ++end.tok_count;
    t.max_depth = std::max<uint16_t>(t.max_depth, uint16_t(b.size()));
    prev = &b;
  }
  while (!path.empty()) {
    t.nodes[path.back()].end = uint32_t(t.nodes.size());
    path.pop_back();
  }
  return t;
}

namespace {

// Marks in `ok` every token of the trie whose bytes can follow `state`.
// uint64 -> int32, open addressing; emptied in O(1) by an epoch (a mask call empties it each time,
// and most calls use a small part of what the largest one grew it to).
class FlatMap {
 public:
  void reset() {
    if (keys_.empty()) resize(1024);
    if (++epoch_ == 0) {
      std::fill(stamp_.begin(), stamp_.end(), 0u);
      epoch_ = 1;
    }
    used_ = 0;
  }
  const int32_t* find(uint64_t k) const {
    for (size_t i = slot(k);; i = (i + 1) & mask_) {
      if (stamp_[i] != epoch_) return nullptr;
      if (keys_[i] == k) return &vals_[i];
    }
  }
  void put(uint64_t k, int32_t v) {
    if ((used_ + 1) * 2 > keys_.size()) resize(keys_.size() * 2);
    size_t i = slot(k);
    while (stamp_[i] == epoch_ && keys_[i] != k) i = (i + 1) & mask_;
    if (stamp_[i] != epoch_) ++used_;
    stamp_[i] = epoch_;
    keys_[i] = k;
    vals_[i] = v;
  }

 private:
  size_t slot(uint64_t k) const { return size_t((k * 0x9E3779B97F4A7C15ull) >> 20) & mask_; }
  void resize(size_t n) {
    std::vector<uint64_t> keys = std::move(keys_);
    std::vector<int32_t> vals = std::move(vals_);
    std::vector<uint32_t> stamp = std::move(stamp_);
    const uint32_t old = epoch_;
    keys_.assign(n, 0);
    vals_.assign(n, 0);
    stamp_.assign(n, 0);
    mask_ = n - 1;
    epoch_ = 1;
    used_ = 0;
    for (size_t i = 0; i < keys.size(); ++i)
      if (stamp[i] == old && old != 0) put(keys[i], vals[i]);
  }
  std::vector<uint64_t> keys_;
  std::vector<int32_t> vals_;
  std::vector<uint32_t> stamp_;
  uint32_t epoch_ = 0;
  size_t used_ = 0, mask_ = 0;
};

// The trie in preorder, one state per depth. The states met are kept, each once, with the step
// from each on each byte: many nodes share a state and a byte (a pattern's loop such as
// `[a-z]+` comes back to one state after every letter), and those take the step already made.
void walk(const GrammarState& state, const GrammarVocab::Trie& trie, std::vector<char>& ok) {
  struct Memo {
    std::vector<GrammarState> states;
    std::vector<int32_t> same_hash;  // per state: the next one of the same hash, or -1
    FlatMap by_hash;                 // hash -> the last state of that hash
    FlatMap next;                    // state << 8 | byte -> state; -1: the byte cannot come
    std::vector<int32_t> level;      // per depth: the state, or kScratch: it is in scratch[depth]
    std::vector<GrammarState> scratch;
    size_t frames = 0;               // in the states kept
  };
  constexpr int32_t kDead = -1, kScratch = -2;
  constexpr size_t kMaxFrames = size_t(1) << 22;  // ~50 MB of kept states; past it, steps are not kept
  static thread_local Memo m;
  m.states.clear();
  m.same_hash.clear();
  m.by_hash.reset();
  m.next.reset();
  m.frames = 0;
  if (m.scratch.size() < size_t(trie.max_depth) + 1) m.scratch.resize(size_t(trie.max_depth) + 1, GrammarState(nullptr));
  const auto intern = [&](GrammarState&& s, size_t depth) {
    const uint64_t h = s.hash();
    const int32_t* head = m.by_hash.find(h);
    for (int32_t id = head ? *head : -1; id >= 0; id = m.same_hash[size_t(id)])
      if (m.states[size_t(id)] == s) return id;
    if (m.frames > kMaxFrames) {
      m.scratch[depth] = std::move(s);
      return kScratch;
    }
    const int32_t id = int32_t(m.states.size());
    m.frames += s.n_frames();
    m.states.push_back(std::move(s));
    m.same_hash.push_back(head ? *head : -1);
    m.by_hash.put(h, id);
    return id;
  };
  m.level.assign(size_t(trie.max_depth) + 1, 0);
  m.level[0] = intern(GrammarState(state), 0);
  const auto& nodes = trie.nodes;
  for (uint32_t i = 0; i < nodes.size();) {
    const GrammarVocab::Node& nd = nodes[i];
    const int32_t from = m.level[nd.depth - 1];
    int32_t to;
    const uint64_t key = uint64_t(uint32_t(from)) << 8 | nd.byte;
    const int32_t* found = from >= 0 ? m.next.find(key) : nullptr;
    if (found) {
      to = *found;
    } else {
      GrammarState t(nullptr);
      const GrammarState& parent = from >= 0 ? m.states[size_t(from)] : m.scratch[nd.depth - 1];
      to = parent.step(nd.byte, t) ? intern(std::move(t), nd.depth) : kDead;
      if (from >= 0 && to != kScratch) m.next.put(key, to);
    }
    if (to == kDead) {
      i = nd.end;
      continue;
    }
    m.level[nd.depth] = to;
    for (uint32_t k = 0; k < nd.tok_count; ++k) ok[size_t(trie.tokens[nd.tok_begin + k])] = 1;
    ++i;
  }
  m.states.clear();  // (they hold the grammar)
}

}  // namespace

int grammar_mask(const GrammarState& state, const GrammarVocab& vocab, const std::vector<int32_t>& stop_ids,
                 float* logits, int n_vocab) {
  const float ninf = -std::numeric_limits<float>::infinity();
  const int n = std::min(n_vocab, vocab.n_vocab());
  static thread_local std::vector<char> ok;
  ok.assign(size_t(n), 0);
  const int64_t room = state.string_room();
  if (room >= 0) {
    // Inside strings: plain text that fits in the room left, without a walk; the other tokens
    // (quotes, escapes, partial UTF-8) walked.
    for (int32_t id = 0; id < n; ++id) ok[size_t(id)] = vocab.text_[size_t(id)] && vocab.text_len_[size_t(id)] <= room;
    walk(state, vocab.special_, ok);
  } else {
    walk(state, vocab.all_, ok);
  }
  const bool end = state.accepting();
  for (int32_t id : vocab.eog_ids_)
    if (id < n) ok[size_t(id)] = end;
  for (int32_t id : stop_ids)
    if (id >= 0 && id < n) ok[size_t(id)] = end;
  int allowed = 0;
  for (int32_t id = 0; id < n; ++id) {
    if (ok[size_t(id)]) ++allowed;
    else logits[id] = ninf;
  }
  for (int id = n; id < n_vocab; ++id) logits[id] = ninf;
  if (allowed == 0) {
    // Nothing can continue the text (a vocabulary without some byte): end it.
    for (int32_t id : vocab.eog_ids_)
      if (id < n) {
        logits[id] = 0;
        ++allowed;
      }
  }
  return allowed;
}

}  // namespace kvq
