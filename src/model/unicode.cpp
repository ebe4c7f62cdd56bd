#include "model/unicode.h"

#include <algorithm>
#include <array>

namespace kvq::unicode {
namespace {

struct CodepointRange {
  uint32_t lo, hi;  // inclusive
};

#include "model/unicode_tables.inc"

bool in_ranges(const CodepointRange* begin, const CodepointRange* end, uint32_t cp) {
  const CodepointRange* it =
      std::upper_bound(begin, end, cp, [](uint32_t v, const CodepointRange& r) { return v < r.lo; });
  return it != begin && cp <= (it - 1)->hi;
}

bool is_white_space(uint32_t cp) {
  // Unicode White_Space property: what \s matches in the Unicode-aware regex engines the
  // reference tokenizers use (a short, stable list, so no table).
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

CharClass classify_slow(uint32_t cp) {
  if (cp == k_invalid_cp) return CharClass::other;
  if (is_white_space(cp)) return CharClass::space;
  if (in_ranges(std::begin(k_letter_ranges), std::end(k_letter_ranges), cp)) return CharClass::letter;
  if (in_ranges(std::begin(k_number_ranges), std::end(k_number_ranges), cp)) return CharClass::number;
  return CharClass::other;
}

LetterCase letter_case_slow(uint32_t cp) {
  if (cp == k_invalid_cp) return LetterCase::none;
  if (in_ranges(std::begin(k_upper_ranges), std::end(k_upper_ranges), cp)) return LetterCase::upper;
  if (in_ranges(std::begin(k_lower_ranges), std::end(k_lower_ranges), cp)) return LetterCase::lower;
  if (in_ranges(std::begin(k_mark_ranges), std::end(k_mark_ranges), cp)) return LetterCase::mark;
  if (in_ranges(std::begin(k_letter_ranges), std::end(k_letter_ranges), cp)) return LetterCase::caseless;
  return LetterCase::none;
}

// Most text is ASCII; a flat table keeps the hot path free of the binary search.
const std::array<CharClass, 128> k_ascii_class = [] {
  std::array<CharClass, 128> t{};
  for (uint32_t c = 0; c < 128; ++c) t[c] = classify_slow(c);
  return t;
}();

bool is_cont(uint8_t b) { return (b & 0xC0) == 0x80; }

}  // namespace

int utf8_lead_info(uint8_t b, uint8_t* lo, uint8_t* hi) {
  *lo = 0x80;
  *hi = 0xBF;
  if (b >= 0xC2 && b <= 0xDF) return 2;
  if (b >= 0xE0 && b <= 0xEF) {
    if (b == 0xE0) *lo = 0xA0;
    if (b == 0xED) *hi = 0x9F;
    return 3;
  }
  if (b >= 0xF0 && b <= 0xF4) {
    if (b == 0xF0) *lo = 0x90;
    if (b == 0xF4) *hi = 0x8F;
    return 4;
  }
  return 0;
}

CharClass char_class(uint32_t cp) { return cp < 128 ? k_ascii_class[cp] : classify_slow(cp); }

LetterCase letter_case(uint32_t cp) {
  if (cp < 128) return cp >= 'A' && cp <= 'Z' ? LetterCase::upper : cp >= 'a' && cp <= 'z' ? LetterCase::lower : LetterCase::none;
  return letter_case_slow(cp);
}

int utf8_decode(std::string_view s, size_t i, uint32_t* cp) {
  const auto b0 = static_cast<uint8_t>(s[i]);
  if (b0 < 0x80) {
    *cp = b0;
    return 1;
  }
  uint8_t lo, hi;
  const int len = utf8_lead_info(b0, &lo, &hi);
  if (len == 0 || i + len > s.size()) {
    *cp = k_invalid_cp;
    return 1;
  }
  const auto b1 = static_cast<uint8_t>(s[i + 1]);
  if (b1 < lo || b1 > hi) {
    *cp = k_invalid_cp;
    return 1;
  }
  uint32_t v = len == 2 ? (b0 & 0x1Fu) : len == 3 ? (b0 & 0x0Fu) : (b0 & 0x07u);
  v = (v << 6) | (b1 & 0x3Fu);
  for (int k = 2; k < len; ++k) {
    const auto b = static_cast<uint8_t>(s[i + k]);
    if (!is_cont(b)) {
      *cp = k_invalid_cp;
      return 1;
    }
    v = (v << 6) | (b & 0x3Fu);
  }
  *cp = v;
  return len;
}

void utf8_append(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

size_t utf8_complete_prefix(std::string_view s) {
  const size_t n = s.size();
  // An incomplete sequence is a lead byte in the last 3 bytes followed only by bytes that could
  // still continue it.
  for (size_t k = 1; k <= 3 && k <= n; ++k) {
    const size_t p = n - k;
    uint8_t lo, hi;
    const int len = utf8_lead_info(static_cast<uint8_t>(s[p]), &lo, &hi);
    if (len == 0) {
      if (is_cont(static_cast<uint8_t>(s[p]))) continue;  // keep looking for its lead byte
      return n;                                            // ASCII or invalid: nothing pending
    }
    if (static_cast<size_t>(len) <= k) return n;  // that sequence is complete (or invalid)
    if (k >= 2) {
      const auto b1 = static_cast<uint8_t>(s[p + 1]);
      if (b1 < lo || b1 > hi) return n;
    }
    // bytes after the second were already checked to be continuation bytes by the loop
    return p;
  }
  return n;
}

std::string utf8_sanitize(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    uint32_t cp;
    const int len = utf8_decode(s, i, &cp);
    if (cp == k_invalid_cp)
      out += "\xEF\xBF\xBD";
    else
      out.append(s.substr(i, len));
    i += len;
  }
  return out;
}

bool utf8_is_valid(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    uint32_t cp;
    i += utf8_decode(s, i, &cp);
    if (cp == k_invalid_cp) return false;
  }
  return true;
}

namespace {

// Code points a thread's buffers keep between texts; a longer text's buffers are released by the
// next shorter one.
constexpr size_t kKeepCodePoints = size_t(1) << 16;

struct Cp {
  uint32_t cp;
  uint32_t off;  // byte offset in the text
  CharClass cls;
};

// The text's code points with their offsets and classes (one buffer per thread, reused).
const std::vector<Cp>& code_points(std::string_view text) {
  thread_local std::vector<Cp> cps;
  cps.clear();
  if (cps.capacity() > kKeepCodePoints && text.size() < kKeepCodePoints) cps.shrink_to_fit();  // after a huge text
  for (size_t i = 0; i < text.size();) {
    uint32_t cp;
    const int len = utf8_decode(text, i, &cp);
    cps.push_back({cp, static_cast<uint32_t>(i), char_class(cp)});
    i += len;
  }
  return cps;
}

// Length of the contraction 's 't 're 've 'm 'll 'd at cps[i] (before e), 0 if none; ASCII letters
// of either case when any_case.
size_t contraction(const std::vector<Cp>& cps, size_t i, size_t e, bool any_case) {
  if (cps[i].cp != '\'' || i + 1 >= e) return 0;
  // (?i) case folding of the letters involved: ASCII capitals, and U+017F (long s) folding to s
  auto low = [&](uint32_t c) { return !any_case ? c : c >= 'A' && c <= 'Z' ? c + 32 : c == 0x17F ? uint32_t('s') : c; };
  const uint32_t c1 = low(cps[i + 1].cp);
  if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') return 2;
  if (i + 2 >= e) return 0;
  const uint32_t c2 = low(cps[i + 2].cp);
  return (c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l') ? 3 : 0;
}

// Where '\s+(?!\S)|\s+' ends for the whitespace run [i, k) (e: the end of the text): before the
// run's last character when a non-space follows it, so that it joins the next piece; the whole run
// at the end of the text, or when it is a single character.
size_t whitespace_end(size_t i, size_t k, size_t e) { return k == e || k - i == 1 ? k : k - 1; }

// A splitter's output and class runs over cps[.., e) (e: "end of string" for the lookaheads).
struct Pieces {
  const std::vector<Cp>& cps;
  size_t e;
  uint32_t end_off;  // byte offset of e
  std::vector<Span>& out;
  uint32_t off(size_t k) const { return k < e ? cps[k].off : end_off; }
  void emit(size_t from, size_t to) const { out.push_back({off(from), off(to) - off(from)}); }
  size_t run(size_t k, CharClass c) const {
    while (k < e && cps[k].cls == c) ++k;
    return k;
  }
};

// The GPT-2 regex over cps[b, e) (one stretch; e is "end of string" for the lookahead).
void split_gpt2_stretch(const std::vector<Cp>& cps, size_t b, size_t e, uint32_t end_off,
                        std::vector<Span>& out) {
  const Pieces pc{cps, e, end_off, out};
  size_t i = b;
  while (i < e) {
    const uint32_t c = cps[i].cp;
    // 's 't 're 've 'm 'll 'd (case-sensitive, as in the GPT-2 pattern)
    if (const size_t n = contraction(cps, i, e, false)) {
      pc.emit(i, i + n);
      i += n;
      continue;
    }
    // ' ?\p{L}+', ' ?\p{N}+', ' ?[^\s\p{L}\p{N}]+': an ASCII space joins the piece after it
    size_t j = i;
    if (c == ' ' && i + 1 < e && cps[i + 1].cls != CharClass::space) j = i + 1;
    const CharClass cj = cps[j].cls;
    if (cj != CharClass::space) {
      const size_t k = pc.run(j, cj);
      pc.emit(i, k);
      i = k;
      continue;
    }
    const size_t k = whitespace_end(i, pc.run(i, CharClass::space), e);
    pc.emit(i, k);
    i = k;
  }
}

inline bool is_cr_lf(uint32_t c) { return c == '\r' || c == '\n'; }

// The end of the piece at cps[i] (a character that no letter or digit alternative took) by the last
// alternatives the Llama 3, Tekken and GPT-4o patterns share: ' ?[^\s\p{L}\p{N}]+[\r\n]*' (with '/'
// among the trailing characters for Tekken / GPT-4o), then for whitespace '\s*[\r\n]+' up to the
// run's last CR / LF, '\s+(?!\S)' and '\s+'.
size_t punct_or_space_end(const Pieces& pc, size_t i, bool slash) {
  const std::vector<Cp>& cps = pc.cps;
  const size_t e = pc.e;
  const size_t j = cps[i].cp == ' ' && i + 1 < e && cps[i + 1].cls == CharClass::other ? i + 1 : i;
  if (cps[j].cls == CharClass::other) {
    size_t k = pc.run(j, CharClass::other);
    while (k < e && (is_cr_lf(cps[k].cp) || (slash && cps[k].cp == '/'))) ++k;
    return k;
  }
  const size_t k = pc.run(i, CharClass::space);
  size_t nl = k;
  while (nl > i && !is_cr_lf(cps[nl - 1].cp)) --nl;
  return nl > i ? nl : whitespace_end(i, k, e);
}

// The Llama 3 regex over cps (max_digits 3; Qwen2's: 1):
//   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,max_digits}|
//   ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
// Each position takes the first alternative that matches there, as the regex engine does.
void split_llama3(const std::vector<Cp>& cps, int max_digits, uint32_t end_off, std::vector<Span>& out) {
  const size_t e = cps.size();
  const Pieces pc{cps, e, end_off, out};
  size_t i = 0;
  while (i < e) {
    const uint32_t c = cps[i].cp;
    const CharClass cl = cps[i].cls;
    // contractions, either case
    if (const size_t n = contraction(cps, i, e, true)) {
      pc.emit(i, i + n);
      i += n;
      continue;
    }
    // [^\r\n\p{L}\p{N}]?\p{L}+: letters, after at most one character that is none of these
    if (cl == CharClass::letter) {
      const size_t k = pc.run(i, CharClass::letter);
      pc.emit(i, k);
      i = k;
      continue;
    }
    if (cl != CharClass::number && !is_cr_lf(c) && i + 1 < e && cps[i + 1].cls == CharClass::letter) {
      const size_t k = pc.run(i + 1, CharClass::letter);
      pc.emit(i, k);
      i = k;
      continue;
    }
    // \p{N}{1,max_digits}
    if (cl == CharClass::number) {
      const size_t k = std::min(pc.run(i, CharClass::number), i + size_t(max_digits));
      pc.emit(i, k);
      i = k;
      continue;
    }
    const size_t k = punct_or_space_end(pc, i, false);
    pc.emit(i, k);
    i = k;
  }
}

// The Tekken / GPT-4o patterns over cps (pretokenize_cased). U = [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}],
// W = [\p{Ll}\p{Lm}\p{Lo}\p{M}], P = [^\r\n\p{L}\p{N}] (a mark is in all three). Each position
// takes the first alternative that matches, with the regex engine's backtracking: P? first taken,
// then left out; U* giving back characters until W+ matches.
void split_cased(const std::vector<Cp>& cps, const std::vector<LetterCase>& lc, int max_digits, bool contractions,
                 uint32_t end_off, std::vector<Span>& out) {
  const size_t e = cps.size();
  const Pieces pc{cps, e, end_off, out};
  auto is_u = [&](size_t k) { return lc[k] == LetterCase::upper || lc[k] == LetterCase::caseless || lc[k] == LetterCase::mark; };
  auto is_w = [&](size_t k) { return lc[k] == LetterCase::lower || lc[k] == LetterCase::caseless || lc[k] == LetterCase::mark; };
  auto is_p = [&](size_t k) {
    return cps[k].cls != CharClass::letter && cps[k].cls != CharClass::number && !is_cr_lf(cps[k].cp);
  };
  auto u_run = [&](size_t k) {
    while (k < e && is_u(k)) ++k;
    return k;
  };
  auto w_run = [&](size_t k) {
    while (k < e && is_w(k)) ++k;
    return k;
  };
  // U*W+ from s: its end, or 0 (s > 0 always where it is called with a P taken; s == i otherwise,
  // so the end is > s when it matches)
  auto upper_then_lower = [&](size_t s) -> size_t {
    const size_t eu = u_run(s);
    if (eu < e && is_w(eu)) return w_run(eu);
    for (size_t j = eu; j > s; --j)  // U* gives back up to the last character W+ can take
      if (is_w(j - 1)) return j;
    return 0;
  };
  // U+W* from s: its end, or 0
  auto upper_run = [&](size_t s) -> size_t {
    const size_t eu = u_run(s);
    return eu == s ? 0 : w_run(eu);
  };
  auto with_contraction = [&](size_t k) { return contractions && k < e ? k + contraction(cps, k, e, true) : k; };
  size_t i = 0;
  while (i < e) {
    const CharClass cl = cps[i].cls;
    size_t k = 0;
    const bool p = is_p(i) && i + 1 < e;
    if (p) k = upper_then_lower(i + 1);
    if (!k) k = upper_then_lower(i);
    if (!k && p) k = upper_run(i + 1);
    if (!k) k = upper_run(i);
    if (k) {
      k = with_contraction(k);
      pc.emit(i, k);
      i = k;
      continue;
    }
    // \p{N}{1,max_digits}
    if (cl == CharClass::number) {
      k = std::min(pc.run(i, CharClass::number), i + size_t(max_digits));
      pc.emit(i, k);
      i = k;
      continue;
    }
    k = punct_or_space_end(pc, i, true);
    pc.emit(i, k);
    i = k;
  }
}

}  // namespace

void pretokenize_gpt2(std::string_view text, bool split_digits, std::vector<Span>& out) {
  const std::vector<Cp>& cps = code_points(text);
  const auto end_off = static_cast<uint32_t>(text.size());
  if (!split_digits) {
    split_gpt2_stretch(cps, 0, cps.size(), end_off, out);
    return;
  }
  size_t b = 0;
  for (size_t i = 0; i < cps.size(); ++i) {
    if (cps[i].cls != CharClass::number) continue;
    const uint32_t next_off = i + 1 < cps.size() ? cps[i + 1].off : end_off;
    split_gpt2_stretch(cps, b, i, cps[i].off, out);
    out.push_back({cps[i].off, next_off - cps[i].off});
    b = i + 1;
  }
  split_gpt2_stretch(cps, b, cps.size(), end_off, out);
}

void pretokenize_llama3(std::string_view text, int max_digits, std::vector<Span>& out) {
  const std::vector<Cp>& cps = code_points(text);
  split_llama3(cps, max_digits, static_cast<uint32_t>(text.size()), out);
}

void pretokenize_cased(std::string_view text, int max_digits, bool contractions, std::vector<Span>& out) {
  const std::vector<Cp>& cps = code_points(text);
  thread_local std::vector<LetterCase> lc;
  lc.clear();
  if (lc.capacity() > kKeepCodePoints && cps.size() < kKeepCodePoints) lc.shrink_to_fit();
  for (const Cp& c : cps) lc.push_back(letter_case(c.cp));
  split_cased(cps, lc, max_digits, contractions, static_cast<uint32_t>(text.size()), out);
}

}  // namespace kvq::unicode
