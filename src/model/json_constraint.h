// Each token's bytes as JSON text sees them, and what JSON's \u escapes allow.
//
// JsonVocab holds each token's bytes as generated text renders them (Tokenizer::token_piece) once
// per tokenizer, which tokens end generation, and which are plain string text. JSON mode and
// structured output generate with the grammar of model/json_schema.h; tests/json_reference.h
// keeps an independent JSON automaton their tests compare it with.
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

// The gap between JSON tokens that JSON mode and structured output allow: at most one space or
// tab, or a newline and at most this many spaces or tabs (llama.cpp's JSON grammar allows 20).
constexpr int kJsonMaxIndent = 32;

class JsonVocab {
 public:
  explicit JsonVocab(const Tokenizer& tok);
  const std::string& bytes(int32_t id) const { return bytes_[size_t(id)]; }
  bool ends(int32_t id) const { return eog_[size_t(id)] != 0; }
  // The token is whole, well-formed UTF-8 characters with no '"', '\\' or control character:
  // inside a string it is text, and leaves the state as it was.
  bool string_text(int32_t id) const { return string_text_[size_t(id)] != 0; }
  int32_t n_vocab() const { return int32_t(bytes_.size()); }

 private:
  std::vector<std::string> bytes_;  // token_piece of each token ("" for control tokens)
  std::vector<char> eog_;           // end-of-generation tokens
  std::vector<char> string_text_;   // string_text()
};

}  // namespace kvq
