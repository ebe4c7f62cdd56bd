#include "model/gbnf.h"

#include <algorithm>
#include <cctype>
#include <map>
#include <stdexcept>

#include "model/unicode.h"

namespace kvq {

namespace {

constexpr uint32_t kMaxCount = 2000;  // as llama.cpp's
constexpr int kMaxNesting = 200;

class Parser {
 public:
  explicit Parser(std::string_view t) : t_(t) {}

  Gbnf parse(const std::vector<std::string>& external) {
    for (const std::string& n : external) {
      const uint32_t r = rule_index(n, 0);
      if (defined_[r]) throw std::invalid_argument("grammar: external rule '" + n + "' is given twice");
      defined_[r] = 1;
      g_.external.push_back(r);
    }
    space(true);
    while (more()) rule();
    size_t first_undefined = std::string::npos;
    std::string undefined;
    for (const auto& [name, use] : first_use_)
      if (!defined_[index_.at(name)] && use < first_undefined) {
        first_undefined = use;
        undefined = name;
      }
    if (!undefined.empty()) fail_at(first_undefined, "rule '" + undefined + "' is used but not defined");
    const auto root = index_.find("root");
    if (root == index_.end() || !defined_[root->second]) fail_at(t_.size(), "no 'root' rule (the text the grammar generates)");
    g_.root = root->second;
    return std::move(g_);
  }

 private:
  [[noreturn]] void fail_at(size_t at, const std::string& why) const {
    size_t line = 1, col = 1;
    for (size_t k = 0; k < at && k < t_.size(); ++k) {
      if (t_[k] == '\n' || (t_[k] == '\r' && (k + 1 >= t_.size() || t_[k + 1] != '\n'))) {
        ++line;
        col = 1;
      } else {
        ++col;
      }
    }
    throw std::invalid_argument("grammar line " + std::to_string(line) + ", column " + std::to_string(col) + ": " + why);
  }
  [[noreturn]] void fail(const std::string& why) const { fail_at(i_, why); }
  bool more() const { return i_ < t_.size(); }
  char peek() const { return more() ? t_[i_] : '\0'; }
  static bool word_char(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-' || c == '_';
  }

  // Spaces, tabs and comments; newlines too when `newlines`.
  void space(bool newlines) {
    while (more()) {
      const char c = t_[i_];
      if (c == ' ' || c == '\t' || (newlines && (c == '\n' || c == '\r'))) {
        ++i_;
      } else if (c == '#') {
        while (more() && t_[i_] != '\n' && t_[i_] != '\r') ++i_;
      } else {
        break;
      }
    }
  }

  uint32_t rule_index(const std::string& name, size_t at) {
    auto it = index_.find(name);
    if (it == index_.end()) {
      it = index_.emplace(name, uint32_t(g_.names.size())).first;
      g_.names.push_back(name);
      g_.rules.emplace_back();
      defined_.push_back(0);
      first_use_.emplace(name, at);
    }
    return it->second;
  }

  std::string name() {
    const size_t from = i_;
    while (more() && word_char(t_[i_])) ++i_;
    if (i_ == from) fail("expected a rule name");
    return std::string(t_.substr(from, i_ - from));
  }

  void rule() {
    const size_t at = i_;
    const std::string n = name();
    space(false);
    if (!t_.substr(i_).starts_with("::=")) fail("expected '::=' after the rule name '" + n + "'");
    i_ += 3;
    space(true);
    const uint32_t r = rule_index(n, at);
    if (defined_[r]) fail_at(at, "rule '" + n + "' is defined twice");
    defined_[r] = 1;
    g_.rules[r] = alternatives(false, 0);
    if (more() && t_[i_] != '\n' && t_[i_] != '\r') fail("expected the end of the line after rule '" + n + "'");
    space(true);
  }

  std::vector<std::vector<GbnfItem>> alternatives(bool nested, int depth) {
    if (depth > kMaxNesting) fail("groups nested deeper than 200");
    std::vector<std::vector<GbnfItem>> alts{sequence(nested, depth)};
    while (peek() == '|') {
      ++i_;
      space(true);
      alts.push_back(sequence(nested, depth));
    }
    return alts;
  }

  uint32_t hex(int n) {
    uint32_t v = 0;
    for (int k = 0; k < n; ++k) {
      const char h = peek();
      if (!std::isxdigit(static_cast<unsigned char>(h))) fail("expected " + std::to_string(n) + " hex digits");
      v = v * 16 + uint32_t(h <= '9' ? h - '0' : (h | 0x20) - 'a' + 10);
      ++i_;
    }
    return v;
  }

  // One character of a literal or a class, escapes read.
  uint32_t character() {
    if (!more()) fail("unexpected end of the grammar");
    if (t_[i_] == '\\') {
      ++i_;
      if (!more()) fail("unexpected end of the grammar");
      const char c = t_[i_++];
      uint32_t cp = 0;
      switch (c) {
        case 'x': cp = hex(2); break;
        case 'u': cp = hex(4); break;
        case 'U': cp = hex(8); break;
        case 't': return '\t';
        case 'n': return '\n';
        case 'r': return '\r';
        case '\\':
        case '"':
        case '[':
        case ']':
        case '-':
        case '^': return uint32_t(c);
        default: fail_at(i_ - 2, std::string("unknown escape '\\") + c + "'");
      }
      if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) fail_at(i_ - 1, "the escape is no Unicode scalar value");
      return cp;
    }
    uint32_t cp;
    const int n = unicode::utf8_decode(t_, i_, &cp);
    if (cp == unicode::k_invalid_cp) fail("not valid UTF-8");
    i_ += size_t(n);
    return cp;
  }

  uint32_t count() {
    const size_t from = i_;
    uint64_t v = 0;
    while (more() && t_[i_] >= '0' && t_[i_] <= '9') {
      v = std::min<uint64_t>(v * 10 + uint64_t(t_[i_] - '0'), uint64_t(1) << 32);
      ++i_;
    }
    if (i_ == from) fail("expected a number");
    if (v > kMaxCount) fail_at(from, "a repetition count above 2000");
    return uint32_t(v);
  }

  std::vector<GbnfItem> sequence(bool nested, int depth) {
    std::vector<GbnfItem> seq;
    while (more()) {
      const size_t at = i_;
      const char c = t_[i_];
      GbnfItem item;
      if (c == '"') {
        ++i_;
        item.kind = GbnfItem::kLiteral;
        while (true) {
          if (!more()) fail_at(at, "a literal without its closing '\"'");
          if (t_[i_] == '"') break;
          unicode::utf8_append(item.literal, character());
        }
        ++i_;
      } else if (c == '[') {
        ++i_;
        item.kind = GbnfItem::kChars;
        const bool negated = peek() == '^';
        if (negated) ++i_;
        CodePoints set;
        while (true) {
          if (!more()) fail_at(at, "a character class without its closing ']'");
          if (t_[i_] == ']') break;
          const uint32_t lo = character();
          uint32_t hi = lo;
          if (peek() == '-' && i_ + 1 < t_.size() && t_[i_ + 1] != ']') {
            ++i_;
            hi = character();
            if (hi < lo) fail_at(at, "a range out of order in a character class");
          }
          set.emplace_back(lo, hi);
        }
        ++i_;
        set = normalize_code_points(std::move(set));
        item.chars = negated ? complement_code_points(set) : set;
        if (item.chars.empty()) fail_at(at, "a character class that matches no character");
      } else if (c == '.') {
        ++i_;
        item.kind = GbnfItem::kChars;
        item.chars = complement_code_points({});
      } else if (c == '(') {
        ++i_;
        space(true);
        item.kind = GbnfItem::kGroup;
        item.alts = alternatives(true, depth + 1);
        if (peek() != ')') fail_at(at, "a group without its closing ')'");
        ++i_;
      } else if (word_char(c)) {
        item.kind = GbnfItem::kRef;
        const std::string n = name();
        item.ref = rule_index(n, at);
      } else if (c == '<') {
        fail("token references (<...>) are not supported");
      } else if (c == '*' || c == '+' || c == '?' || c == '{') {
        if (seq.empty()) fail(std::string("'") + c + "' repeats nothing");
        GbnfItem& last = seq.back();
        if (last.min != 1 || last.max != 1) {
          // A repetition of a repetition: x?? is x?, and x* x+ x? combined are x* but for x++,
          // which is x+; other counts go in a group of their own (at most 8 deep).
          const bool simple = c != '{' && last.min <= 1 && (last.max == 1 || last.max == UINT32_MAX);
          if (simple) {
            const bool optional = last.min == 0 || c == '*' || c == '?';
            const bool many = last.max == UINT32_MAX || c == '*' || c == '+';
            last.min = optional ? 0 : 1;
            last.max = many ? UINT32_MAX : 1;
            ++i_;
            space(nested);
            continue;
          }
          if (++wraps_ > 8) fail("more than 8 repetitions of a repetition");
          GbnfItem inner = std::move(last);
          last = GbnfItem{};
          last.kind = GbnfItem::kGroup;
          last.alts.emplace_back();
          last.alts.back().push_back(std::move(inner));
        }
        ++i_;
        if (c == '*') {
          last.min = 0;
          last.max = UINT32_MAX;
        } else if (c == '+') {
          last.max = UINT32_MAX;
        } else if (c == '?') {
          last.min = 0;
        } else {
          space(true);
          last.min = count();
          last.max = last.min;
          space(true);
          if (peek() == ',') {
            ++i_;
            space(true);
            last.max = std::isdigit(static_cast<unsigned char>(peek())) ? count() : UINT32_MAX;
            space(true);
          }
          if (peek() != '}') fail("expected '}'");
          ++i_;
          if (last.min > last.max) fail_at(at, "a repetition {m,n} with m > n");
        }
        space(nested);
        continue;
      } else {
        break;  // '|', ')', the end of the line
      }
      seq.push_back(std::move(item));
      wraps_ = 0;
      space(nested);
    }
    return seq;
  }

  std::string_view t_;
  size_t i_ = 0;
  Gbnf g_;
  std::map<std::string, uint32_t> index_;
  std::map<std::string, size_t> first_use_;
  std::vector<char> defined_;
  int wraps_ = 0;  // repetitions of the last item's repetition
};

}  // namespace

Gbnf parse_gbnf(std::string_view text, const std::vector<std::string>& external) { return Parser(text).parse(external); }

}  // namespace kvq
