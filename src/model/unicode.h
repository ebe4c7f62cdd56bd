// Unicode helpers for the tokenizer: UTF-8 decoding that never fails (invalid bytes become single
// "other" code points, so byte-level BPE still sees every byte), the \p{L} / \p{N} / \s classes and
// letter cases the pre-tokenizer regexes use, and the GPT-2, Llama 3 and Tekken / GPT-4o
// pre-tokenizers as hand-written state machines.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kvq::unicode {

enum class CharClass : uint8_t { other, letter, number, space };

// Category of a code point: letter = general category L*, number = N*, space = White_Space.
CharClass char_class(uint32_t cp);

// The case classes the Tekken and GPT-4o patterns use: upper = Lu, Lt; lower = Ll; caseless =
// Lm, Lo (letters of neither case); mark = M*; none for the rest.
enum class LetterCase : uint8_t { none, upper, lower, caseless, mark };
LetterCase letter_case(uint32_t cp);

// Decodes one code point at s[i]; returns its byte length (1..4). Invalid or truncated sequences,
// overlong forms and surrogates decode as one byte with cp = 0xFFFFFFFF (class other).
inline constexpr uint32_t k_invalid_cp = 0xFFFFFFFFu;
int utf8_decode(std::string_view s, size_t i, uint32_t* cp);
// Expected length of a UTF-8 sequence starting with lead byte b, and the allowed range of its
// second byte (excludes overlong forms, surrogates and code points above U+10FFFF); 0 if b is no
// lead byte.
int utf8_lead_info(uint8_t b, uint8_t* lo, uint8_t* hi);
void utf8_append(std::string& out, uint32_t cp);

// Length of the longest prefix of `s` that does not end inside an incomplete (but so far valid)
// UTF-8 sequence: what a streaming decoder may emit now.
size_t utf8_complete_prefix(std::string_view s);
// `s` with every invalid byte replaced by U+FFFD (so the result is valid UTF-8).
std::string utf8_sanitize(std::string_view s);
bool utf8_is_valid(std::string_view s);

// A piece of the input text: byte offset and length.
struct Span {
  uint32_t begin = 0;
  uint32_t len = 0;
};

// GPT-2 pre-tokenizer, the split made by the regex
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// With split_digits, every \p{N} code point is first cut out as its own piece and the regex runs
// on the stretches between them (the "smollm" / StarCoder pre-tokenizer). Appends to `out`.
void pretokenize_gpt2(std::string_view text, bool split_digits, std::vector<Span>& out);

// Llama 3's pre-tokenizer ("llama-bpe"), the split made by the regex
//   (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|
//   \s*[\r\n]+|\s+(?!\S)|\s+
// max_digits 3; Qwen2's ("qwen2") is the same with \p{N} one at a time (max_digits 1). Appends to `out`.
void pretokenize_llama3(std::string_view text, int max_digits, std::vector<Span>& out);

// Mistral's Tekken pre-tokenizer ("tekken"; max_digits 1, no contractions), the split made by
//   [^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|
//   [^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}|
//    ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+
// and GPT-4o's ("gpt-4o", "llama4"; max_digits 3, contractions): the same with
// (?i:'s|'t|'re|'ve|'m|'ll|'d)? after each of the two letter alternatives and \p{N}{1,3}. A word
// is cut before a capital that follows lower-case letters ("HelloWorld": "Hello", "World"), an
// all-capitals word is kept whole. Appends to `out`.
void pretokenize_cased(std::string_view text, int max_digits, bool contractions, std::vector<Span>& out);

}  // namespace kvq::unicode
