#include "model/json_constraint.h"

#include <algorithm>

#include "model/tokenizer.h"
#include "model/unicode.h"

namespace kvq {


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
    string_text_[size_t(id)] =
        !b.empty() && unicode::utf8_is_valid(b) &&
        std::none_of(b.begin(), b.end(), [](char ch) { return ch == '"' || ch == '\\' || static_cast<unsigned char>(ch) < 0x20; });
  }
}

}  // namespace kvq
