// An independent JSON automaton, the reference the tests compare the generation grammar
// (model/json_schema.h, Grammar::json_object) with: a character-level pushdown automaton over a
// JSON object's bytes. feed() takes the next byte and says whether the text can still be
// completed into a JSON object. The grammar is JSON's (RFC 8259), with the limits JSON mode keeps
// a model within: the top-level value is an object; whitespace between tokens (and before the
// object) is at most one space or tab, or one newline followed by at most kMaxIndent spaces and
// tabs; nesting is at most kMaxDepth containers. Strings must be valid UTF-8 (no control
// characters; escapes checked) and numbers JSON's (no leading zeros, no bare '.', exponents with
// digits, any number of digits).
#pragma once
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "model/json_constraint.h"
#include "model/unicode.h"

namespace kvq {

class JsonState {
 public:
  static constexpr int kMaxIndent = kJsonMaxIndent;
  static constexpr int kMaxDepth = 64;

  // false: c cannot come next (the state is then unspecified: feed a copy to test).
  bool feed(unsigned char c);
  bool feed(std::string_view bytes) {
    for (unsigned char c : bytes)
      if (!feed(c)) return false;
    return true;
  }
  // The top-level object is complete.
  bool done() const { return mode_ == Mode::done; }
  // Inside a string, between characters: text without '"', '\\' and control characters goes on.
  bool in_string_text() const { return mode_ == Mode::string && utf8_left_ == 0 && !low_needed_; }
  int depth() const { return int(stack_.size()); }

 private:
  enum class Mode : uint8_t {
    start,      // before the top-level object: whitespace or '{'
    obj_first,  // after '{': '"' (a key) or '}'
    obj_key,    // after ',' in an object: '"'
    colon,      // after a key: ':'
    value,      // a value
    arr_first,  // after '[': a value or ']'
    after,      // after a value in a container: ',' or its closer
    string,     // in a string (key_: an object's key)
    escape,     // after '\' in a string
    unicode,    // in \uXXXX: left_ hex digits to go
    literal,    // in true / false / null: word_ and left_
    number,     // in a number: num_
    done,       // the top-level object is closed
  };
  enum class Num : uint8_t { minus, zero, integer, dot, fraction, e, e_sign, exponent };
  static bool is_ws(unsigned char c) { return c == ' ' || c == '\t' || c == '\n'; }
  static bool is_digit(unsigned char c) { return c >= '0' && c <= '9'; }
  static bool is_hex(unsigned char c) { return is_digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }
  bool value_start(unsigned char c);
  bool value_end();
  bool close(unsigned char c);
  bool string_byte(unsigned char c);

  Mode mode_ = Mode::start;
  Num num_ = Num::minus;
  bool key_ = false;
  uint8_t left_ = 0;      // unicode: hex digits left; literal: characters left
  uint8_t utf8_left_ = 0; // continuation bytes a string's UTF-8 character still needs
  uint8_t utf8_lo_ = 0x80, utf8_hi_ = 0xBF;  // the range of the next one (narrower after E0, ED, F0, F4)
  uint16_t code_ = 0;     // unicode: the escape's value so far
  bool low_needed_ = false;  // a \uD800-\uDBFF escape waits for its \uDC00-\uDFFF
  uint8_t ws_ = 0;        // spaces and tabs in this gap between tokens
  bool nl_ = false;       // this gap has its newline
  const char* word_ = nullptr;  // literal: the rest of the word
  std::string stack_;     // open containers, '{' or '['
};

inline bool JsonState::value_end() {
  mode_ = stack_.empty() ? Mode::done : Mode::after;
  return true;
}

inline bool JsonState::close(unsigned char c) {
  if (stack_.empty() || (c == '}' ? '{' : '[') != stack_.back()) return false;
  stack_.pop_back();
  return value_end();
}

inline bool JsonState::value_start(unsigned char c) {
  switch (c) {
    case '{':
    case '[':
      if (int(stack_.size()) >= kMaxDepth) return false;
      stack_.push_back(char(c));
      mode_ = c == '{' ? Mode::obj_first : Mode::arr_first;
      return true;
    case '"':
      mode_ = Mode::string;
      key_ = false;
      utf8_left_ = 0;
      return true;
    case '-':
      mode_ = Mode::number;
      num_ = Num::minus;
      return true;
    case 't':
    case 'f':
    case 'n':
      mode_ = Mode::literal;
      word_ = c == 't' ? "rue" : c == 'f' ? "alse" : "ull";
      left_ = uint8_t(std::strlen(word_));
      return true;
    default:
      if (!is_digit(c)) return false;
      mode_ = Mode::number;
      num_ = c == '0' ? Num::zero : Num::integer;
      return true;
  }
}

inline bool JsonState::string_byte(unsigned char c) {
  if (utf8_left_ > 0) {
    if (c < utf8_lo_ || c > utf8_hi_) return false;
    --utf8_left_;
    utf8_lo_ = 0x80;
    utf8_hi_ = 0xBF;
    return true;
  }
  if (low_needed_ && c != '\\') return false;  // a high surrogate's low half comes next
  if (c == '"') {
    if (key_) {
      mode_ = Mode::colon;
      return true;
    }
    return value_end();
  }
  if (c == '\\') {
    mode_ = Mode::escape;
    return true;
  }
  if (c < 0x20) return false;  // control characters are escaped in JSON strings
  if (c < 0x80) return true;
  // Well-formed UTF-8: the first continuation byte's range depends on the lead.
  const int len = unicode::utf8_lead_info(c, &utf8_lo_, &utf8_hi_);
  if (len == 0) return false;
  utf8_left_ = uint8_t(len - 1);
  return true;
}

inline bool JsonState::feed(unsigned char c) {
  const bool ws = is_ws(c);
  switch (mode_) {
    case Mode::string:
      return string_byte(c);
    case Mode::escape:
      if (c == 'u') {
        mode_ = Mode::unicode;
        left_ = 4;
        code_ = 0;
        return true;
      }
      if (low_needed_ || !std::strchr("\"\\/bfnrt", c) || c == 0) return false;
      mode_ = Mode::string;
      return true;
    case Mode::unicode: {
      if (!is_hex(c)) return false;
      const int v = is_digit(c) ? c - '0' : (c | 0x20) - 'a' + 10;
      code_ = uint16_t(code_ << 4 | v);
      if (!json_u_escape_prefix_ok(code_, 4 - (left_ - 1), low_needed_)) return false;
      if (--left_ == 0) {
        mode_ = Mode::string;
        if (low_needed_) low_needed_ = false;
        else if (code_ >= 0xD800 && code_ <= 0xDBFF) low_needed_ = true;
      }
      return true;
    }
    case Mode::literal:
      if (c != uint8_t(*word_)) return false;
      ++word_;
      if (--left_ == 0) return value_end();
      return true;
    case Mode::number:
      switch (num_) {
        case Num::minus:
          if (!is_digit(c)) return false;
          num_ = c == '0' ? Num::zero : Num::integer;
          return true;
        case Num::zero:
        case Num::integer:
          if (is_digit(c) && num_ == Num::integer) return true;
          if (c == '.') {
            num_ = Num::dot;
            return true;
          }
          if (c == 'e' || c == 'E') {
            num_ = Num::e;
            return true;
          }
          break;  // the number ends before c
        case Num::dot:
          if (!is_digit(c)) return false;
          num_ = Num::fraction;
          return true;
        case Num::fraction:
          if (is_digit(c)) return true;
          if (c == 'e' || c == 'E') {
            num_ = Num::e;
            return true;
          }
          break;
        case Num::e:
          if (c == '+' || c == '-') {
            num_ = Num::e_sign;
            return true;
          }
          if (!is_digit(c)) return false;
          num_ = Num::exponent;
          return true;
        case Num::e_sign:
          if (!is_digit(c)) return false;
          num_ = Num::exponent;
          return true;
        case Num::exponent:
          if (is_digit(c)) return true;
          break;
      }
      // A complete number ends here (numbers are always inside the top-level object): c comes
      // after it.
      value_end();
      return feed(c);
    default:
      break;
  }
  // Between tokens of the grammar: whitespace, within its limit.
  if (ws) {
    if (mode_ == Mode::done) return false;
    if (c == '\n') {
      if (nl_ || ws_ > 0) return false;
      nl_ = true;
      return true;
    }
    if (nl_ ? ws_ >= kMaxIndent : ws_ > 0) return false;
    ++ws_;
    return true;
  }
  ws_ = 0;
  nl_ = false;
  switch (mode_) {
    case Mode::start:
      if (c != '{') return false;
      return value_start(c);
    case Mode::obj_first:
      if (c == '}') return close(c);
      [[fallthrough]];
    case Mode::obj_key:
      if (c != '"') return false;
      mode_ = Mode::string;
      key_ = true;
      utf8_left_ = 0;
      return true;
    case Mode::colon:
      if (c != ':') return false;
      mode_ = Mode::value;
      return true;
    case Mode::arr_first:
      if (c == ']') return close(c);
      return value_start(c);
    case Mode::value:
      return value_start(c);
    case Mode::after:
      if (c == ',') {
        mode_ = stack_.back() == '{' ? Mode::obj_key : Mode::value;
        return true;
      }
      if (c == '}' || c == ']') return close(c);
      return false;
    default:
      return false;  // done: nothing more
  }
}

}  // namespace kvq
