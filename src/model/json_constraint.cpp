#include "model/json_constraint.h"

#include <cstring>

#include "model/tokenizer.h"
#include "model/unicode.h"

namespace kvq {

namespace {

bool is_ws(unsigned char c) { return c == ' ' || c == '\t' || c == '\n'; }
bool is_digit(unsigned char c) { return c >= '0' && c <= '9'; }
bool is_hex(unsigned char c) { return is_digit(c) || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }

}  // namespace

bool json_u_escape_prefix_ok(uint16_t code, int digits, bool low_needed) {
  // A surrogate only as a pair: a high half (D800-DBFF) then a low one (DC00-DFFF). Checked as
  // soon as the first digits decide it.
  const uint32_t top = uint32_t(code) << (4 * (4 - digits));
  const uint32_t span = (1u << (4 * (4 - digits))) - 1;  // values the rest can add
  const bool may_high = top <= 0xDBFF && top + span >= 0xD800;
  const bool may_low = top <= 0xDFFF && top + span >= 0xDC00;
  const bool may_other = top < 0xD800 || top + span > 0xDFFF;
  return low_needed ? may_low : (may_other || may_high);
}

bool JsonState::value_end() {
  mode_ = stack_.empty() ? Mode::done : Mode::after;
  return true;
}

bool JsonState::close(unsigned char c) {
  if (stack_.empty() || (c == '}' ? '{' : '[') != stack_.back()) return false;
  stack_.pop_back();
  return value_end();
}

bool JsonState::value_start(unsigned char c) {
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

bool JsonState::string_byte(unsigned char c) {
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

bool JsonState::feed(unsigned char c) {
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

JsonVocab::JsonVocab(const Tokenizer& tok) {
  const int32_t n = tok.n_vocab();
  bytes_.resize(size_t(n));
  eog_.assign(size_t(n), 0);
  for (int32_t id = 0; id < n; ++id) {
    const TokenType t = tok.token_type(id);
    // Control and unused tokens render as nothing: they are no JSON text (end-of-generation
    // tokens are handled apart).
    if (t != TokenType::control && t != TokenType::unused) bytes_[size_t(id)] = tok.token_piece(id);
  }
  for (int32_t id : tok.eog_ids())
    if (id >= 0 && id < n) eog_[size_t(id)] = 1;
  string_text_.assign(size_t(n), 0);
  for (int32_t id = 0; id < n; ++id) {
    const std::string& b = bytes_[size_t(id)];
    if (b.empty()) continue;
    JsonState s;  // inside a string value
    s.feed(std::string_view("{\"k\":\""));
    string_text_[size_t(id)] = s.feed(b) && s.in_string_text() && b.find_first_of("\"\\") == std::string::npos;
  }
}

}  // namespace kvq
