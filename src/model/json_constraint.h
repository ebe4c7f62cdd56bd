// A JSON automaton, and each token's bytes as JSON text sees them.
//
// JsonState is a character-level pushdown automaton over a JSON object's bytes: feed() takes the
// next byte and says whether the text can still be completed into a JSON object. The grammar is
// JSON's (RFC 8259), with the limits JSON mode keeps a model within: the top-level value is an
// object; whitespace between tokens (and before the object) is at most one space or tab, or one
// newline followed by at most kMaxIndent spaces and tabs (llama.cpp's JSON grammar allows 20);
// nesting is at most kMaxDepth containers. Strings must be valid UTF-8 (no control characters;
// escapes checked) and numbers JSON's (no leading zeros, no bare '.', exponents with digits).
// Generation runs on the grammar of model/json_schema.h ({"type": "object"} for JSON mode, the same
// rules); JsonState is the reference its tests compare that grammar with, and what JsonVocab uses
// to find the tokens that are plain string text.
//
// JsonVocab holds each token's bytes as generated text renders them (Tokenizer::token_piece) once
// per tokenizer, which tokens end generation, and which are plain string text.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kvq {

class Tokenizer;

// The first `digits` (1..4) hex digits of a \u escape, value `code`, can still end as JSON allows:
// a surrogate only as a pair, a high half (D800-DBFF) then, when low_needed, a low one (DC00-DFFF).
bool json_u_escape_prefix_ok(uint16_t code, int digits, bool low_needed);

class JsonState {
 public:
  static constexpr int kMaxIndent = 32;
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

class JsonVocab {
 public:
  explicit JsonVocab(const Tokenizer& tok);
  const std::string& bytes(int32_t id) const { return bytes_[size_t(id)]; }
  bool ends(int32_t id) const { return eog_[size_t(id)] != 0; }
  // The token is whole UTF-8 characters with no '"', '\\' or control character: inside a string
  // it is text, and leaves the state as it was.
  bool string_text(int32_t id) const { return string_text_[size_t(id)] != 0; }
  int32_t n_vocab() const { return int32_t(bytes_.size()); }

 private:
  std::vector<std::string> bytes_;  // token_piece of each token ("" for control tokens)
  std::vector<char> eog_;           // end-of-generation tokens
  std::vector<char> string_text_;   // string_text()
};

}  // namespace kvq
