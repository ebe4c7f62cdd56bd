// Regular expression -> Thompson NFA over code points -> DFA by subset construction over classes
// of code points (with a counter when the length is bounded) -> live states only. The bytes of
// each code point (UTF-8, or a JSON string's encoding) come in when the grammar takes the states.
#include "model/regex.h"

#include <algorithm>
#include <cctype>
#include <map>
#include <stdexcept>

#include "model/unicode.h"

namespace kvq {

namespace {

using Ranges = CodePoints;
constexpr uint32_t kMaxCp = 0x10FFFF;
constexpr uint32_t kRepMax = 1000;
constexpr uint32_t kInf = UINT32_MAX;
// Budgets for one pattern (compiled per request): NFA states and edges, the NFA states the DFA's
// states hold in all (the subset construction's work), and the NFA's transitions once its empty
// moves are taken out.
constexpr size_t kMaxNfaStates = 200000;
constexpr size_t kMaxNfaEdges = 1000000;
constexpr size_t kMaxSubsetWork = 5000000;
constexpr size_t kMaxNfaTransitions = 4096;

// Sorted, merged, without the surrogates (no text holds them).
Ranges normalize(Ranges r) {
  std::sort(r.begin(), r.end());
  Ranges out;
  for (auto [lo, hi] : r) {
    if (!out.empty() && lo <= out.back().second + 1) out.back().second = std::max(out.back().second, hi);
    else out.emplace_back(lo, hi);
  }
  Ranges cut;
  for (auto [lo, hi] : out) {
    if (hi < 0xD800 || lo > 0xDFFF) {
      cut.emplace_back(lo, hi);
      continue;
    }
    if (lo < 0xD800) cut.emplace_back(lo, 0xD7FF);
    if (hi > 0xDFFF) cut.emplace_back(0xE000, hi);
  }
  return cut;
}

Ranges complement(const Ranges& in) {
  const Ranges r = normalize(in);
  Ranges out;
  uint32_t next = 0;
  for (auto [lo, hi] : r) {
    if (lo > next) out.emplace_back(next, lo - 1);
    next = hi + 1;
  }
  if (next <= kMaxCp) out.emplace_back(next, kMaxCp);
  return normalize(out);
}

Ranges unite(Ranges a, const Ranges& b) {
  a.insert(a.end(), b.begin(), b.end());
  return normalize(std::move(a));
}

const Ranges& digits() {
  static const Ranges r{{'0', '9'}};
  return r;
}
const Ranges& word() {
  static const Ranges r{{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}};
  return r;
}
const Ranges& spaces() {  // ECMA-262's WhiteSpace and LineTerminator
  static const Ranges r = normalize({{0x09, 0x0D}, {0x20, 0x20}, {0xA0, 0xA0}, {0x1680, 0x1680}, {0x2000, 0x200A},
                                     {0x2028, 0x2029}, {0x202F, 0x202F}, {0x205F, 0x205F}, {0x3000, 0x3000},
                                     {0xFEFF, 0xFEFF}});
  return r;
}
// The code points of a Unicode category (unicode::char_class), built once.
const Ranges& category(unicode::CharClass which) {
  static const std::array<Ranges, 4> all = [] {
    std::array<Ranges, 4> out;
    for (uint32_t cp = 0; cp <= kMaxCp; ++cp) {
      if (cp >= 0xD800 && cp <= 0xDFFF) continue;
      Ranges& r = out[size_t(unicode::char_class(cp))];
      if (!r.empty() && r.back().second + 1 == cp) r.back().second = cp;
      else r.emplace_back(cp, cp);
    }
    return out;
  }();
  return all[size_t(which)];
}

// A class escape as the two readings of a pattern have it: ECMA-262's (JSON Schema) and Python's
// re (vLLM, and Python's jsonschema), whose \d \w \s are Unicode and whose \s differs. `narrow`
// is in both (what a class may generate), `wide` covers both (what a negated class leaves out).
struct ClassSet {
  Ranges narrow, wide;
};
ClassSet class_escape(char c) {
  using unicode::CharClass;
  static const ClassSet d{digits(), unite(digits(), category(CharClass::number))};
  static const ClassSet w{word(), unite(unite(word(), category(CharClass::letter)), category(CharClass::number))};
  static const ClassSet sp = [] {
    Ranges narrow;  // ECMA-262's spaces but U+FEFF, which Python's \s leaves out
    for (auto [lo, hi] : spaces())
      if (lo != 0xFEFF) narrow.emplace_back(lo, hi);
    return ClassSet{narrow, unite(unite(spaces(), category(CharClass::space)), {{0x1C, 0x1F}, {0x85, 0x85}})};
  }();
  switch (c) {
    case 'd': return d;
    case 'D': return {complement(d.wide), complement(d.narrow)};
    case 'w': return w;
    case 'W': return {complement(w.wide), complement(w.narrow)};
    case 's': return sp;
    default: return {complement(sp.wide), complement(sp.narrow)};  // 'S'
  }
}

struct Node {
  enum Kind { kSet, kCat, kAlt, kRep } kind;
  Ranges set;
  std::vector<uint32_t> kids;
  uint32_t min = 0, max = 0;
};

class Parser {
 public:
  explicit Parser(std::string_view p) : p_(p) {}
  struct Top {
    uint32_t node;
    bool start = false, end = false;  // anchored by ^ / $
  };
  std::vector<Node> nodes;

  std::vector<Top> parse() {
    std::vector<Top> tops;
    while (true) {
      Top t{0};
      if (i_ < p_.size() && p_[i_] == '^') {
        t.start = true;
        ++i_;
      }
      t.node = cat(true, &t.end);
      tops.push_back(t);
      if (i_ >= p_.size()) break;
      if (p_[i_] == '|') {
        ++i_;
        continue;
      }
      fail("unmatched ')'", i_);
    }
    return tops;
  }

 private:
  [[noreturn]] void fail(const std::string& why, size_t at) const {
    throw std::invalid_argument("pattern \"" + std::string(p_) + "\": " + why + " (at offset " + std::to_string(at) + ")");
  }
  uint32_t add(Node n) {
    nodes.push_back(std::move(n));
    return uint32_t(nodes.size() - 1);
  }
  uint32_t set_node(Ranges r) { return add({Node::kSet, normalize(std::move(r)), {}}); }
  bool more() const { return i_ < p_.size(); }

  uint32_t alternation() {
    std::vector<uint32_t> alts{cat(false, nullptr)};
    while (more() && p_[i_] == '|') {
      ++i_;
      alts.push_back(cat(false, nullptr));
    }
    return alts.size() == 1 ? alts[0] : add({Node::kAlt, {}, alts});
  }

  uint32_t cat(bool top, bool* end) {
    std::vector<uint32_t> items;
    while (more()) {
      const char c = p_[i_];
      if (c == '|' || c == ')') break;
      if (c == '$') {
        if (top && (i_ + 1 == p_.size() || p_[i_ + 1] == '|')) {
          *end = true;
          ++i_;
          break;
        }
        fail("'$' is supported only at the end of the pattern or of a top-level alternative", i_);
      }
      if (c == '^') fail("'^' is supported only at the start of the pattern or of a top-level alternative", i_);
      items.push_back(quantified(atom()));
    }
    return items.size() == 1 ? items[0] : add({Node::kCat, {}, items});
  }

  // {n}, {n,}, {n,m} at i_: true with the counts (i_ past it), false when it is a literal '{'.
  bool braces(uint32_t* mn, uint32_t* mx) {
    size_t j = i_ + 1;
    auto number = [&](uint32_t* v) {
      const size_t from = j;
      uint64_t x = 0;
      while (j < p_.size() && p_[j] >= '0' && p_[j] <= '9') {
        x = std::min<uint64_t>(x * 10 + uint64_t(p_[j] - '0'), uint64_t(1) << 32);
        ++j;
      }
      *v = uint32_t(std::min<uint64_t>(x, kInf - 1));
      return j > from;
    };
    if (j < p_.size() && p_[j] == ',') {
      size_t k = j + 1;
      while (k < p_.size() && p_[k] >= '0' && p_[k] <= '9') ++k;
      if (k < p_.size() && p_[k] == '}')
        fail("'{,n}' and '{,}' are literals in ECMA-262 but quantifiers in Python: write {0,n} or *, or \\{ for the brace", i_);
    }
    if (!number(mn)) return false;
    *mx = *mn;
    if (j < p_.size() && p_[j] == ',') {
      ++j;
      if (!number(mx)) *mx = kInf;
    }
    if (j >= p_.size() || p_[j] != '}') return false;
    i_ = j + 1;
    return true;
  }

  uint32_t quantified(uint32_t a) {
    if (!more()) return a;
    uint32_t mn = 0, mx = 0;
    const size_t at = i_;
    const char c = p_[i_];
    if (c == '*' || c == '+' || c == '?') {
      mn = c == '+' ? 1 : 0;
      mx = c == '?' ? 1 : kInf;
      ++i_;
    } else if (c != '{' || !braces(&mn, &mx)) {
      return a;
    }
    if (more() && p_[i_] == '?') ++i_;  // lazy: the same texts match
    if (more() && (p_[i_] == '*' || p_[i_] == '+' || p_[i_] == '?' || (p_[i_] == '{' && is_quantifier(i_))))
      fail("a quantifier cannot follow a quantifier (possessive quantifiers are not supported)", i_);
    if (mn > mx) fail("a repetition {n,m} with n > m", at);
    if (mn > kRepMax || (mx != kInf && mx > kRepMax)) fail("a repetition count above 1000", at);
    return add({Node::kRep, {}, {a}, mn, mx});
  }
  bool is_quantifier(size_t at) {
    const size_t keep = i_;
    i_ = at;
    uint32_t a, b;
    const bool q = braces(&a, &b);
    i_ = keep;
    return q;
  }

  uint32_t code_point() {
    uint32_t cp = 0;
    const int n = unicode::utf8_decode(p_, i_, &cp);
    if (cp == unicode::k_invalid_cp) fail("not valid UTF-8", i_);
    i_ += size_t(n);
    return cp;
  }

  uint32_t atom() {
    const size_t at = i_;
    const char c = p_[i_];
    if (c == '(') {
      ++i_;
      if (++depth_ > 200) fail("groups nested deeper than 200", at);
      struct Leave {
        int& d;
        ~Leave() { --d; }
      } leave{depth_};
      if (more() && p_[i_] == '?') {
        const std::string_view rest = p_.substr(i_);
        if (rest.starts_with("?:")) {
          i_ += 2;
        } else if (rest.starts_with("?=") || rest.starts_with("?!") || rest.starts_with("?<=") || rest.starts_with("?<!")) {
          fail("lookahead and lookbehind are not supported", at);
        } else if (rest.starts_with("?P=")) {
          fail("backreferences are not supported", at);
        } else if (rest.starts_with("?<") || rest.starts_with("?P<")) {
          const size_t close = p_.find('>', i_);
          if (close == std::string_view::npos) fail("a group name without '>'", at);
          i_ = close + 1;
        } else {
          fail("inline flags and this kind of group are not supported", at);
        }
      }
      const uint32_t body = alternation();
      if (!more() || p_[i_] != ')') fail("missing ')'", at);
      ++i_;
      return body;
    }
    if (c == '[') return set_node(char_class());
    if (c == '.') {
      ++i_;
      return set_node(complement({{'\n', '\n'}, {'\r', '\r'}, {0x2028, 0x2029}}));
    }
    if (c == '\\') {
      ClassSet r;
      const uint32_t cp = escape(false, &r);
      return set_node(cp == kInf ? r.narrow : Ranges{{cp, cp}});
    }
    if (c == '*' || c == '+' || c == '?' || (c == '{' && is_quantifier(i_))) fail("nothing to repeat", at);
    const uint32_t cp = code_point();
    return set_node({{cp, cp}});
  }

  Ranges char_class() {
    const size_t at = i_;
    ++i_;
    bool neg = false;
    if (more() && p_[i_] == '^') {
      neg = true;
      ++i_;
    }
    if (more() && p_[i_] == ']')
      fail("an empty class '[]' or '[^]' (ECMA-262: none or any character; Python: a literal ']'); write '\\]' for the bracket", at);
    // The characters of the class as both readings have them, and all that either may have.
    Ranges narrow, wide;
    while (true) {
      if (!more()) fail("missing ']'", at);
      if (p_[i_] == ']') {
        ++i_;
        break;
      }
      ClassSet esc;
      const uint32_t lo = class_atom(&esc);
      if (lo == kInf) {
        narrow = unite(std::move(narrow), esc.narrow);
        wide = unite(std::move(wide), esc.wide);
        continue;
      }
      if (i_ + 1 < p_.size() && p_[i_] == '-' && p_[i_ + 1] != ']') {
        const size_t dash = i_;
        ++i_;
        const uint32_t hi = class_atom(&esc);
        if (hi == kInf) fail("a range cannot end at a class escape such as \\d", dash);
        if (hi < lo) fail("a range out of order", dash);
        narrow.emplace_back(lo, hi);
        wide.emplace_back(lo, hi);
      } else {
        narrow.emplace_back(lo, lo);
        wide.emplace_back(lo, lo);
      }
    }
    return neg ? complement(wide) : normalize(std::move(narrow));
  }
  uint32_t class_atom(ClassSet* set) {
    if (p_[i_] == '\\') return escape(true, set);
    return code_point();
  }

  uint32_t hex(size_t n, size_t at) {
    uint32_t v = 0;
    for (size_t k = 0; k < n; ++k) {
      if (!more() || !std::isxdigit(static_cast<unsigned char>(p_[i_]))) fail("a hexadecimal escape needs " + std::to_string(n) + " hex digits", at);
      const char h = p_[i_++];
      v = v * 16 + uint32_t(h <= '9' ? h - '0' : (h | 0x20) - 'a' + 10);
    }
    return v;
  }

  // The code point an escape stands for, or kInf with the set (\d, \w, \s and their negations).
  uint32_t escape(bool in_class, ClassSet* set) {
    const size_t at = i_;
    ++i_;
    if (!more()) fail("'\\' at the end of the pattern", at);
    const char c = p_[i_++];
    switch (c) {
      case 'd':
      case 'D':
      case 'w':
      case 'W':
      case 's':
      case 'S': *set = class_escape(c); return kInf;
      case 't': return '\t';
      case 'n': return '\n';
      case 'r': return '\r';
      case 'f': return '\f';
      case 'v': return '\v';
      case '0':
        if (more() && p_[i_] >= '0' && p_[i_] <= '9') fail("octal escapes are not supported", at);
        return 0;
      case 'b':
        if (in_class) return 8;
        fail("word boundaries (\\b, \\B) are not supported", at);
      case 'B': fail("word boundaries (\\b, \\B) are not supported", at);
      case 'x': return hex(2, at);
      case 'u': {
        uint32_t cp;
        if (more() && p_[i_] == '{') {
          ++i_;
          cp = 0;
          size_t n = 0;
          while (more() && p_[i_] != '}') {
            cp = std::min<uint32_t>(cp * 16 + hex(1, at), kMaxCp + 1);
            ++n;
          }
          if (!more() || n == 0) fail("\\u{...} needs hex digits and '}'", at);
          ++i_;
          if (cp > kMaxCp) fail("a code point above U+10FFFF", at);
        } else {
          cp = hex(4, at);
        }
        if (cp >= 0xD800 && cp <= 0xDFFF)
          fail("a surrogate escape (ECMA-262 reads a pair as one character, Python as two that no text has): "
               "write the character itself", at);
        return cp;
      }
      case 'c':
        if (more() && std::isalpha(static_cast<unsigned char>(p_[i_]))) return uint32_t(p_[i_++]) % 32;
        fail("\\c needs a letter", at);
      case 'p':
      case 'P': fail("Unicode property escapes (\\p, \\P) are not supported", at);
      case 'k': fail("backreferences are not supported", at);
      case 'A':
      case 'Z':
      case 'z':
      case 'G': fail("anchors other than '^' and '$' are not supported", at);
      default: break;
    }
    if (c >= '1' && c <= '9') fail("backreferences are not supported", at);
    if (std::isalnum(static_cast<unsigned char>(c))) fail(std::string("unknown escape '\\") + c + "'", at);
    --i_;  // an escaped punctuation or other character: itself
    return code_point();
  }

  std::string_view p_;
  size_t i_ = 0;
  int depth_ = 0;
};

// ---- the NFA over code points ----

struct TooLarge {};

class Nfa {
 public:
  struct Edge {
    uint32_t lo, hi;  // code points
    uint32_t to;
  };
  struct Frag {
    uint32_t s, e;
  };
  std::vector<std::vector<uint32_t>> eps;
  std::vector<std::vector<Edge>> edges;

  explicit Nfa(const std::vector<Node>& nodes) : nodes_(nodes) {}

  uint32_t add() {
    if (eps.size() >= kMaxNfaStates) throw std::invalid_argument("the pattern is too large (its NFA needs more than 200000 states)");
    eps.emplace_back();
    edges.emplace_back();
    return uint32_t(eps.size() - 1);
  }

  Frag build(uint32_t id) {
    const Node& n = nodes_[id];
    switch (n.kind) {
      case Node::kSet: {
        const uint32_t s = add(), e = add();
        n_edges_ += n.set.size();
        if (n_edges_ > kMaxNfaEdges) throw std::invalid_argument("the pattern is too large (its NFA needs more than 1M edges)");
        for (auto [lo, hi] : n.set) edges[s].push_back({lo, hi, e});
        return {s, e};
      }
      case Node::kCat: {
        const uint32_t s = add();
        uint32_t cur = s;
        for (uint32_t k : n.kids) {
          const Frag f = build(k);
          eps[cur].push_back(f.s);
          cur = f.e;
        }
        return {s, cur};
      }
      case Node::kAlt: {
        const uint32_t s = add(), e = add();
        for (uint32_t k : n.kids) {
          const Frag f = build(k);
          eps[s].push_back(f.s);
          eps[f.e].push_back(e);
        }
        return {s, e};
      }
      case Node::kRep: {
        const uint32_t s = add();
        uint32_t cur = s;
        for (uint32_t k = 0; k < n.min; ++k) {
          const Frag f = build(n.kids[0]);
          eps[cur].push_back(f.s);
          cur = f.e;
        }
        const uint32_t e = add();
        if (n.max == kInf) {
          const uint32_t loop = add();
          eps[cur].push_back(loop);
          const Frag f = build(n.kids[0]);
          eps[loop].push_back(f.s);
          eps[f.e].push_back(loop);
          eps[loop].push_back(e);
        } else {
          eps[cur].push_back(e);
          for (uint32_t k = n.min; k < n.max; ++k) {
            const Frag f = build(n.kids[0]);
            eps[cur].push_back(f.s);
            cur = f.e;
            eps[cur].push_back(e);
          }
        }
        return {s, e};
      }
    }
    return {0, 0};
  }

 private:
  const std::vector<Node>& nodes_;
  size_t n_edges_ = 0;
};

// The UTF-8 encodings of [lo, hi] (no surrogates inside) as sequences of byte ranges, each range a
// product position by position (the usual split at the encoding's length and continuation-byte
// boundaries).
void utf8_seqs(uint32_t lo, uint32_t hi, std::vector<ByteSeq>& out) {
  for (uint32_t m : {0x7Fu, 0x7FFu, 0xFFFFu}) {
    if (lo <= m && m < hi) {
      utf8_seqs(lo, m, out);
      utf8_seqs(m + 1, hi, out);
      return;
    }
  }
  const int n = hi <= 0x7F ? 1 : hi <= 0x7FF ? 2 : hi <= 0xFFFF ? 3 : 4;
  for (int i = 1; i < n; ++i) {
    const uint32_t m = (1u << (6 * i)) - 1;
    if ((lo & ~m) != (hi & ~m)) {
      if ((lo & m) != 0) {
        utf8_seqs(lo, lo | m, out);
        utf8_seqs((lo | m) + 1, hi, out);
        return;
      }
      if ((hi & m) != m) {
        utf8_seqs(lo, (hi & ~m) - 1, out);
        utf8_seqs(hi & ~m, hi, out);
        return;
      }
    }
  }
  std::string a, b;
  unicode::utf8_append(a, lo);
  unicode::utf8_append(b, hi);
  ByteSeq seq;
  for (size_t k = 0; k < a.size(); ++k) {
    ByteClass c{};
    for (int x = static_cast<unsigned char>(a[k]); x <= static_cast<unsigned char>(b[k]); ++x)
      c[size_t(x >> 6)] |= uint64_t(1) << (x & 63);
    seq.push_back(c);
  }
  out.push_back(std::move(seq));
}

ByteClass byte_class(std::string_view bytes) {
  ByteClass c{};
  for (unsigned char x : bytes) c[x >> 6] |= uint64_t(1) << (x & 63);
  return c;
}

// Sequences of one length that differ at one position only, merged into one (each alternative of
// a grammar rule is a parse stack of its own).
std::vector<ByteSeq> merged(std::vector<ByteSeq> seqs) {
  // One pass per position, last first: sequences equal but at that position become one.
  size_t longest = 0;
  for (const ByteSeq& q : seqs) longest = std::max(longest, q.size());
  for (size_t at = longest; at-- > 0;) {
    std::map<std::vector<ByteClass>, size_t> first;  // the sequence without position `at` -> where it went
    std::vector<ByteSeq> out;
    for (ByteSeq& q : seqs) {
      if (q.size() <= at) {
        out.push_back(std::move(q));
        continue;
      }
      std::vector<ByteClass> key = q;
      key[at] = ByteClass{};
      key.push_back(ByteClass{q.size(), 0, 0, 0});  // only sequences of one length merge
      auto [it, fresh] = first.emplace(std::move(key), out.size());
      if (fresh) {
        out.push_back(std::move(q));
      } else {
        for (size_t w = 0; w < 4; ++w) out[it->second][at][w] |= q[at][w];
      }
    }
    seqs = std::move(out);
  }
  return seqs;
}

}  // namespace

CodePoints normalize_code_points(CodePoints ranges) { return normalize(std::move(ranges)); }
CodePoints complement_code_points(const CodePoints& set) { return complement(set); }

std::vector<ByteSeq> encode_code_points(const CodePoints& set, bool json_string) {
  std::vector<ByteSeq> out;
  if (!json_string) {
    for (auto [lo, hi] : set) utf8_seqs(lo, hi, out);
    return merged(std::move(out));
  }
  // JSON: the short escapes, \u00XX for the other control characters, UTF-8 for the rest.
  std::string shorts;
  std::array<std::string, 2> hex_low;  // \u000X, \u001X
  static const char* hx = "0123456789abcdef";
  for (auto [lo, hi] : set) {
    for (uint32_t cp = lo; cp <= std::min<uint32_t>(hi, 0x5C); ++cp) {
      switch (cp) {
        case '"': shorts += '"'; break;
        case '\\': shorts += '\\'; break;
        case '\b': shorts += 'b'; break;
        case '\f': shorts += 'f'; break;
        case '\n': shorts += 'n'; break;
        case '\r': shorts += 'r'; break;
        case '\t': shorts += 't'; break;
        default:
          if (cp < 0x20) hex_low[cp >> 4] += hx[cp & 15];
      }
    }
    for (auto [a, b] : CodePoints{{std::max<uint32_t>(lo, 0x20), std::min<uint32_t>(hi, 0x21)},
                                  {std::max<uint32_t>(lo, 0x23), std::min<uint32_t>(hi, 0x5B)},
                                  {std::max<uint32_t>(lo, 0x5D), hi}})
      if (a <= b) utf8_seqs(a, b, out);
  }
  if (!shorts.empty()) out.push_back({byte_class("\\"), byte_class(shorts)});
  for (size_t h = 0; h < 2; ++h)
    if (!hex_low[h].empty())
      out.push_back({byte_class("\\"), byte_class("u"), byte_class("0"), byte_class("0"), byte_class(std::string(1, hx[h])),
                     byte_class(hex_low[h])});
  return merged(std::move(out));
}

namespace {

// The shortest and longest texts (code points) an automaton accepts; longest UINT32_MAX when a
// loop makes it unbounded. (Every state can reach an accepting one.)
std::pair<uint32_t, uint32_t> length_range(const RegexDfa& d) {
  const size_t n = d.states.size();
  std::vector<uint32_t> shortest(n, kInf), longest(n, 0);
  std::vector<uint8_t> color(n, 0);  // 0 new, 1 on the path, 2 done
  bool loop = false;
  // Depth first from the start: the lengths to an accepting state from each state after its
  // successors.
  std::vector<std::pair<uint32_t, size_t>> st{{0, 0}};
  color[0] = 1;
  while (!st.empty() && !loop) {
    auto& [q, i] = st.back();
    if (i < d.states[q].next.size()) {
      const uint32_t to = d.states[q].next[i++].second;
      if (color[to] == 1) loop = true;
      else if (color[to] == 0) {
        color[to] = 1;
        st.push_back({to, 0});
      }
      continue;
    }
    uint32_t lo = d.states[q].accept ? 0 : kInf, hi = 0;
    for (const auto& [r, to] : d.states[q].next) {
      if (shortest[to] != kInf) lo = std::min(lo, shortest[to] + 1);
      hi = std::max(hi, longest[to] + 1);
    }
    shortest[q] = lo;
    longest[q] = hi;
    color[q] = 2;
    st.pop_back();
  }
  if (loop) {  // the shortest still matters: breadth first over the reversed edges
    std::vector<std::vector<uint32_t>> back(n);
    std::vector<uint32_t> dist(n, kInf), todo;
    for (size_t q = 0; q < n; ++q) {
      for (const auto& [r, to] : d.states[q].next) back[to].push_back(uint32_t(q));
      if (d.states[q].accept) {
        dist[q] = 0;
        todo.push_back(uint32_t(q));
      }
    }
    for (size_t k = 0; k < todo.size(); ++k)
      for (uint32_t p : back[todo[k]])
        if (dist[p] == kInf) {
          dist[p] = dist[todo[k]] + 1;
          todo.push_back(p);
        }
    return {dist[0], kInf};
  }
  return {shortest[0], longest[0]};
}

RegexDfa compile_impl(std::string_view pattern, const RegexOptions& opt);

// Only the states from which some text is accepted, the start first; none when the start is not.
RegexDfa live_states(RegexDfa dfa) {
  const size_t n = dfa.states.size();
  std::vector<std::vector<uint32_t>> back(n);
  std::vector<char> live(n, 0);
  std::vector<uint32_t> todo;
  for (size_t d = 0; d < n; ++d) {
    for (const auto& [r, to] : dfa.states[d].next) back[to].push_back(uint32_t(d));
    if (dfa.states[d].accept) {
      live[d] = 1;
      todo.push_back(uint32_t(d));
    }
  }
  while (!todo.empty()) {
    const uint32_t s = todo.back();
    todo.pop_back();
    for (uint32_t p : back[s])
      if (!live[p]) {
        live[p] = 1;
        todo.push_back(p);
      }
  }
  RegexDfa out;
  out.deterministic = dfa.deterministic;
  if (n == 0 || !live[0]) return out;
  std::vector<uint32_t> renum(n, kInf);
  for (size_t d = 0; d < n; ++d)
    if (live[d]) {
      renum[d] = uint32_t(out.states.size());
      out.states.emplace_back();
    }
  for (size_t d = 0; d < n; ++d) {
    if (!live[d]) continue;
    RegexDfa::State& st = out.states[renum[d]];
    st.accept = dfa.states[d].accept;
    for (auto& [r, to] : dfa.states[d].next)
      if (live[to]) st.next.emplace_back(std::move(r), renum[to]);
  }
  return out;
}

}  // namespace

RegexDfa intersect(const RegexDfa& a, const RegexDfa& b, size_t max_states) {
  if (!a.deterministic || !b.deterministic) throw std::invalid_argument("intersect: automata must be deterministic");
  RegexDfa out;
  std::map<std::pair<uint32_t, uint32_t>, uint32_t> ids;
  std::vector<std::pair<uint32_t, uint32_t>> todo;
  const auto id = [&](uint32_t p, uint32_t q) {
    auto [it, fresh] = ids.emplace(std::make_pair(p, q), uint32_t(todo.size()));
    if (fresh) {
      if (todo.size() >= max_states)
        throw std::invalid_argument("the automata's product needs more than " + std::to_string(max_states) + " states");
      todo.emplace_back(p, q);
      out.states.emplace_back();
    }
    return it->second;
  };
  if (a.states.empty() || b.states.empty()) return out;
  id(0, 0);
  for (size_t k = 0; k < todo.size(); ++k) {
    const auto [p, q] = todo[k];
    out.states[k].accept = a.states[p].accept && b.states[q].accept;
    for (const auto& [ra, ta] : a.states[p].next)
      for (const auto& [rb, tb] : b.states[q].next) {
        CodePoints both;  // ra and rb, both sorted
        for (size_t i = 0, j = 0; i < ra.size() && j < rb.size();) {
          const uint32_t lo = std::max(ra[i].first, rb[j].first), hi = std::min(ra[i].second, rb[j].second);
          if (lo <= hi) both.emplace_back(lo, hi);
          if (ra[i].second < rb[j].second) ++i;
          else ++j;
        }
        if (both.empty()) continue;
        const uint32_t to = id(ta, tb);
        out.states[k].next.emplace_back(std::move(both), to);
      }
  }
  return live_states(std::move(out));
}

RegexDfa dfa_complement(const RegexDfa& d) {
  if (!d.deterministic) throw std::invalid_argument("dfa_complement: the automaton must be deterministic");
  RegexDfa out;
  out.states = d.states;
  if (out.states.empty()) out.states.emplace_back();  // accepts nothing: its complement everything
  const uint32_t sink = uint32_t(out.states.size());
  bool sink_used = false;
  for (RegexDfa::State& st : out.states) {
    CodePoints read;
    for (const auto& [set, to] : st.next) read.insert(read.end(), set.begin(), set.end());
    CodePoints rest = complement(normalize(std::move(read)));
    if (!rest.empty()) {
      st.next.emplace_back(std::move(rest), sink);
      sink_used = true;
    }
    st.accept = !st.accept;
  }
  if (sink_used) {
    out.states.emplace_back();
    out.states.back().accept = true;
    out.states.back().next.emplace_back(normalize({{0, kMaxCp}}), sink);
  }
  return live_states(std::move(out));
}

RegexDfa dfa_of_words(const std::vector<std::string>& words) {
  RegexDfa out;
  out.states.emplace_back();
  for (const std::string& w : words) {
    uint32_t at = 0;
    for (size_t i = 0; i < w.size();) {
      uint32_t cp;
      const int len = unicode::utf8_decode(w, i, &cp);
      if (cp == unicode::k_invalid_cp) throw std::invalid_argument("dfa_of_words: a word is not UTF-8");
      i += size_t(len);
      uint32_t to = kInf;
      for (const auto& [set, t] : out.states[at].next)
        if (set.front().first == cp) to = t;
      if (to == kInf) {
        to = uint32_t(out.states.size());
        out.states[at].next.push_back({CodePoints{{cp, cp}}, to});
        out.states.emplace_back();
      }
      at = to;
    }
    out.states[at].accept = true;
  }
  return live_states(std::move(out));
}

RegexDfa dfa_of_length(uint32_t min_len, uint32_t max_len) {
  if (min_len > max_len) throw std::invalid_argument("the minimum length is above the maximum");
  const uint32_t top = max_len == kInf ? min_len : max_len;  // the last state: loops when unbounded
  if (top > 100000) throw std::invalid_argument("length bounds above 100000 code points are not supported here");
  RegexDfa out;
  out.states.resize(size_t(top) + 1);
  const CodePoints all = normalize({{0, kMaxCp}});
  for (uint32_t i = 0; i <= top; ++i) {
    out.states[i].accept = i >= min_len;
    if (i < top) out.states[i].next.emplace_back(all, i + 1);
    else if (max_len == kInf) out.states[i].next.emplace_back(all, i);
  }
  return out;
}

RegexDfa compile_regex(std::string_view pattern, const RegexOptions& opt) {
  if (opt.min_len > opt.max_len) throw std::invalid_argument("the minimum length is above the maximum");
  if (opt.min_len == 0 && opt.max_len == kInf) return compile_impl(pattern, opt);
  // Length bounds: none needed when every text of the pattern already keeps within them;
  // otherwise a code-point counter in the states, with room for as many states as it needs.
  RegexOptions free = opt;
  free.min_len = 0;
  free.max_len = kInf;
  {
    RegexDfa d = compile_impl(pattern, free);
    const auto [lo, hi] = length_range(d);
    if (lo >= opt.min_len && hi <= opt.max_len) return d;
  }
  RegexOptions counted = opt;
  counted.max_states = opt.max_states * 16;
  return compile_impl(pattern, counted);
}

namespace {

RegexDfa compile_impl(std::string_view pattern, const RegexOptions& opt) {
  Parser parser(pattern);
  const std::vector<Parser::Top> tops = parser.parse();
  std::vector<Node>& nodes = parser.nodes;
  // The text: one of the alternatives, with anything around it where unanchored (search).
  const uint32_t any = uint32_t(nodes.size());
  nodes.push_back({Node::kSet, normalize({{0, kMaxCp}}), {}});
  const uint32_t any_star = uint32_t(nodes.size());
  nodes.push_back({Node::kRep, {}, {any}, 0, kInf});
  std::vector<uint32_t> alts;
  for (const Parser::Top& t : tops) {
    if (!opt.search) {
      alts.push_back(t.node);
      continue;
    }
    std::vector<uint32_t> seq;
    if (!t.start) seq.push_back(any_star);
    seq.push_back(t.node);
    if (!t.end) seq.push_back(any_star);
    nodes.push_back({Node::kCat, {}, seq});
    alts.push_back(uint32_t(nodes.size() - 1));
  }
  nodes.push_back({Node::kAlt, {}, alts});
  const uint32_t root = uint32_t(nodes.size() - 1);

  Nfa nfa(nodes);
  const Nfa::Frag top = nfa.build(root);
  const uint32_t final_state = top.e;

  // Classes of code points that no edge tells apart: [bounds[i], bounds[i + 1]).
  std::vector<uint32_t> bounds{0, kMaxCp + 1};
  for (const auto& es : nfa.edges)
    for (const Nfa::Edge& e : es) {
      bounds.push_back(e.lo);
      bounds.push_back(e.hi + 1);
    }
  std::sort(bounds.begin(), bounds.end());
  bounds.erase(std::unique(bounds.begin(), bounds.end()), bounds.end());
  const auto class_of = [&](uint32_t cp) { return size_t(std::upper_bound(bounds.begin(), bounds.end(), cp) - bounds.begin() - 1); };
  const size_t n_classes = bounds.size() - 1;

  std::vector<uint32_t> mark(nfa.eps.size(), 0);
  uint32_t epoch = 0;
  const auto closure = [&](std::vector<uint32_t> todo) {
    ++epoch;
    std::vector<uint32_t> out;
    while (!todo.empty()) {
      const uint32_t s = todo.back();
      todo.pop_back();
      if (mark[s] == epoch) continue;
      mark[s] = epoch;
      out.push_back(s);
      for (uint32_t t : nfa.eps[s]) todo.push_back(t);
    }
    std::sort(out.begin(), out.end());
    return out;
  };

  using Key = std::pair<std::vector<uint32_t>, uint32_t>;  // NFA states, code points so far
  std::map<Key, uint32_t> ids;
  size_t work = 0;
  std::vector<Key> keys;
  RegexDfa dfa;
  const auto intern = [&](Key k) {
    auto it = ids.find(k);
    if (it != ids.end()) return it->second;
    if (keys.size() >= opt.max_states) throw TooLarge{};
    const uint32_t id = uint32_t(keys.size());
    ids.emplace(k, id);
    keys.push_back(std::move(k));
    dfa.states.emplace_back();
    return id;
  };
  std::vector<std::vector<uint32_t>> targets(n_classes);
  std::vector<size_t> touched;
  try {
  intern({closure({top.s}), 0});
  for (size_t d = 0; d < keys.size(); ++d) {
    const uint32_t count = keys[d].second;
    touched.clear();
    bool accept = false;
    for (uint32_t s : keys[d].first) {
      work += 1 + nfa.edges[s].size();
      accept = accept || s == final_state;
      for (const Nfa::Edge& e : nfa.edges[s])
        for (size_t c = class_of(e.lo), last = class_of(e.hi); c <= last; ++c) {
          if (targets[c].empty()) touched.push_back(c);
          targets[c].push_back(e.to);
        }
    }
    if (work > kMaxSubsetWork) throw TooLarge{};
    dfa.states[d].accept = accept && count >= opt.min_len;
    std::sort(touched.begin(), touched.end());
    uint32_t n = count + 1;
    const bool room = opt.max_len == kInf || n <= opt.max_len;
    if (opt.max_len == kInf) n = std::min(n, opt.min_len);
    std::map<uint32_t, CodePoints> next;
    std::map<std::vector<uint32_t>, uint32_t> closed;  // the classes' targets -> the state they lead to
    for (size_t c : touched) {
      if (room) {
        std::vector<uint32_t>& tg = targets[c];
        std::sort(tg.begin(), tg.end());
        tg.erase(std::unique(tg.begin(), tg.end()), tg.end());
        auto found = closed.find(tg);
        if (found == closed.end()) found = closed.emplace(tg, intern({closure(tg), n})).first;
        const uint32_t to = found->second;
        CodePoints& r = next[to];
        if (!r.empty() && r.back().second + 1 == bounds[c]) r.back().second = bounds[c + 1] - 1;
        else r.emplace_back(bounds[c], bounds[c + 1] - 1);
      }
      targets[c].clear();
    }
    for (auto& [to, r] : next) dfa.states[d].next.emplace_back(normalize(std::move(r)), to);
  }
  } catch (const TooLarge&) {
    // Past max_states the pattern runs as the NFA itself (without its empty moves): the grammar
    // keeps one parse stack per NFA state the text so far can be in, which a code-point counter
    // would multiply.
    if (opt.min_len > 0 || opt.max_len != kInf)
      throw std::invalid_argument("pattern \"" + std::string(pattern) + "\": its automaton needs more than " +
                                  std::to_string(opt.max_states) + " states with these length bounds (minLength/maxLength)");
    dfa = RegexDfa{};
    dfa.deterministic = false;
    std::map<uint32_t, uint32_t> id;  // NFA state -> state
    std::vector<uint32_t> order;
    const auto state_of = [&](uint32_t q) {
      auto [it, fresh] = id.emplace(q, uint32_t(order.size()));
      if (fresh) {
        order.push_back(q);
        dfa.states.emplace_back();
      }
      return it->second;
    };
    state_of(top.s);
    size_t transitions = 0;
    for (size_t d = 0; d < order.size(); ++d) {
      std::map<uint32_t, CodePoints> next;
      bool accept = false;
      const std::vector<uint32_t> cl = closure({order[d]});
      if ((work += cl.size()) > kMaxSubsetWork)
        throw std::invalid_argument("pattern \"" + std::string(pattern) + "\" is too complex: its automaton needs more than " +
                                    std::to_string(opt.max_states) + " states");
      for (uint32_t s : cl) {
        accept = accept || s == final_state;
        for (const Nfa::Edge& e : nfa.edges[s]) next[e.to].emplace_back(e.lo, e.hi);
      }
      dfa.states[d].accept = accept;
      for (auto& [q, r] : next) {
        const uint32_t to = state_of(q);
        dfa.states[d].next.emplace_back(normalize(std::move(r)), to);
        if ((transitions += 1) > kMaxNfaTransitions)
          throw std::invalid_argument("pattern \"" + std::string(pattern) + "\" is too complex: its automaton needs more than " +
                                      std::to_string(opt.max_states) + " states, and its NFA more than 4096 transitions");
      }
    }
  }

  RegexDfa out = live_states(std::move(dfa));
  if (out.states.empty())
    throw std::invalid_argument("pattern \"" + std::string(pattern) + "\": no text matches it" +
                                (opt.min_len > 0 || opt.max_len != kInf ? " within the length bounds" : ""));
  return out;
}

}  // namespace

bool RegexDfa::matches(std::string_view text) const {
  std::vector<uint32_t> at{0}, next;
  for (size_t i = 0; i < text.size();) {
    uint32_t cp;
    const int len = unicode::utf8_decode(text, i, &cp);
    if (cp == unicode::k_invalid_cp) return false;
    i += size_t(len);
    next.clear();
    for (uint32_t s : at)
      for (const auto& [r, to] : states[s].next) {
        const auto it = std::upper_bound(r.begin(), r.end(), std::pair<uint32_t, uint32_t>{cp, UINT32_MAX});
        if (it != r.begin() && std::prev(it)->second >= cp) next.push_back(to);
      }
    std::sort(next.begin(), next.end());
    next.erase(std::unique(next.begin(), next.end()), next.end());
    at.swap(next);
    if (at.empty()) return false;
  }
  for (uint32_t s : at)
    if (states[s].accept) return true;
  return false;
}

}  // namespace kvq
