// Tokenizer built from a GGUF vocabulary (tokenizer.ggml.*):
//  - "llama": SentencePiece BPE. Spaces become U+2581, an optional dummy space prefix
//    (tokenizer.ggml.add_space_prefix, default true), then the adjacent pair whose merged piece has
//    the highest score is merged until none is in the vocabulary; characters that end up as no
//    token fall back to <0xXX> byte tokens (or <unk>).
//  - "gpt2": byte-level BPE. The text is split by the pre-tokenizer that tokenizer.ggml.pre names
//    ("gpt2"/"default": the GPT-2 regex; "smollm", "starcoder", "refact": digits split apart first;
//    "llama-bpe" (Llama 3) and "qwen2": the Llama 3 regex, numbers cut every 3 digits or every one;
//    "tekken" (Mistral Nemo / Small 3) and "gpt-4o" / "llama4": the case-aware patterns),
//    each piece's bytes are mapped to the GPT-2 byte alphabet and merged by merge rank.
// USER_DEFINED tokens written in the text are always matched as single tokens; CONTROL tokens
// (e.g. "<|im_start|>") only when parse_special is set. Matching is leftmost-longest on the raw
// text. For SPM with a dummy prefix, the prefix goes at the start of the text and after every
// special token (as llama.cpp does), so there decode(encode(x, parse_special=true)) gains a space
// after each special token that is followed by text; without parse_special, decode(encode(x)) == x
// for any x that holds no literal U+2581 (SPM) or bytes the vocabulary cannot express.
// A Tokenizer is immutable after from_gguf: encode/decode may be called from several threads.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "gguf/gguf.h"

namespace kvq {

// tokenizer.ggml.token_type values
enum class TokenType : uint8_t {
  undefined = 0, normal = 1, unknown = 2, control = 3, user_defined = 4, unused = 5, byte = 6,
};

class Tokenizer {
 public:
  enum class Kind : uint8_t { spm, bpe };

  // Throws kvq::Error when the vocabulary is missing, inconsistent or of an unsupported kind.
  static Tokenizer from_gguf(const gguf::File& f);

  // add_bos is honored only when the model adds BOS (add_bos() is true and the model has one).
  std::vector<int32_t> encode(std::string_view text, bool add_bos) const;
  std::vector<int32_t> encode(std::string_view text, bool add_bos, bool parse_special) const;
  // Text as a model writes it after other text (tokens a reply is made to write): no BOS, and no
  // SentencePiece dummy prefix, neither at its start nor after its special tokens (encode puts
  // one at both).
  std::vector<int32_t> encode_continuation(std::string_view text, bool parse_special) const;

  // Text of a token sequence. CONTROL tokens (BOS, EOS, <|im_end|>, ...) render as nothing, byte
  // tokens as their byte, so the result may hold invalid UTF-8 only if the ids do. For SPM with a
  // dummy prefix, the space that starts the first piece is dropped (the prefix encode added).
  // Throws kvq::Error for ids outside [0, n_vocab).
  std::string decode(const std::vector<int32_t>& ids) const;
  // Bytes of one token as decode renders it (no leading-space rule); may be part of a UTF-8
  // character: use TokenStreamDecoder to stream text.
  std::string token_piece(int32_t id) const;
  // The vocabulary string itself (e.g. "<|im_start|>", "\u2581the", "<0x0A>", "Ġthe").
  const std::string& token_text(int32_t id) const;
  TokenType token_type(int32_t id) const;

  int32_t bos() const { return bos_; }  // -1 when absent
  int32_t eos() const { return eos_; }  // -1 when absent
  // End of generation: EOS, EOT/EOM from metadata, and CONTROL tokens named like an end of turn
  // (<|im_end|>, <end_of_turn>, <|eot_id|>, <|endoftext|>, ...).
  bool is_eog(int32_t id) const;
  const std::vector<int32_t>& eog_ids() const { return eog_ids_; }
  int32_t n_vocab() const { return static_cast<int32_t>(pieces_.size()); }
  int32_t find_token(std::string_view piece) const;  // -1 if none
  bool add_bos() const { return add_bos_ && bos_ >= 0; }
  bool add_space_prefix() const { return add_space_prefix_; }
  Kind kind() const { return kind_; }

 private:
  struct SpecialToken {
    std::string text;
    int32_t id;
  };
  // Tokens matched in the raw text, sorted by first byte, then longest first; `first` holds
  // index + 1 of the first token starting with each byte (0: none).
  struct SpecialSet {
    std::vector<SpecialToken> tokens;
    uint32_t first[256] = {};
    void finish();
    const SpecialToken* match(std::string_view text, size_t i) const;
  };

  std::vector<int32_t> encode_text(std::string_view text, bool add_bos, bool parse_special, bool at_start) const;
  struct WordCache;  // ids of words already seen during one encode call
  void encode_spm(std::string_view text, bool prefix_space, WordCache& cache, std::vector<int32_t>& out) const;
  void encode_bpe(std::string_view text, WordCache& cache, std::vector<int32_t>& out) const;
  void spm_word(std::string_view word, std::vector<int32_t>& out) const;  // word: escaped text
  void bpe_word(std::string_view word, std::vector<int32_t>& out) const;
  int32_t lookup(std::string_view piece) const;
  bool mergeable(int32_t id) const;
  // Text the vocabulary cannot express becomes <unk> only when the unknown id names a real UNKNOWN
  // token: some vocabularies point it at a control token such as <|endoftext|>, which must never
  // appear in the middle of a user's text (the bytes are dropped instead).
  bool has_unk() const { return unk_ >= 0 && types_[unk_] == TokenType::unknown; }

  Kind kind_ = Kind::spm;
  std::vector<std::string> pieces_;   // (n_vocab) vocabulary strings
  std::vector<float> scores_;         // (n_vocab) SPM merge priority
  std::vector<TokenType> types_;      // (n_vocab)
  std::vector<std::string> decoded_;  // (n_vocab) bytes each token renders as
  // piece -> id, open addressing (the encoder's hot path: one probe is usually one cache miss);
  // slot = (hash >> 32) << 32 | (id + 1), 0 = empty
  std::vector<uint64_t> index_;
  uint64_t index_mask_ = 0;
  // byte-level BPE: (left id << 32 | right id) -> rank (lower merges first) and merged id
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges_;
  int32_t byte_token_[256] = {};  // SPM: id of <0xXX>, BPE: id of the byte's GPT-2 character; -1 if none
  SpecialSet user_specials_;  // USER_DEFINED: always matched
  SpecialSet all_specials_;   // plus CONTROL and UNKNOWN: when parse_special
  bool split_digits_ = false;
  int llama3_digits_ = 0;  // > 0: the Llama 3 pre-tokenizer, numbers cut every llama3_digits_ digits
  int cased_digits_ = 0;   // > 0: the Tekken / GPT-4o pre-tokenizer (pretokenize_cased)
  bool cased_contractions_ = false;
  bool ignore_merges_ = false;  // a pre-token that is a normal token is taken whole (Llama 3)
  // SPM: code points c such that some mergeable piece holds "c\u2581". Elsewhere no piece can
  // span the boundary between a character and a following U+2581, so the text is encoded word by
  // word there (with the same result, as no merge crosses it), which lets repeated words be cached.
  std::vector<uint32_t> spm_glue_;  // sorted
  int32_t bos_ = -1, eos_ = -1, unk_ = -1;
  bool add_bos_ = false;
  bool add_space_prefix_ = false;
  std::vector<int32_t> eog_ids_;
};

// Streams decoded text one token at a time and emits only complete, valid UTF-8: bytes of a
// character split across tokens wait for the rest; bytes that can never complete a character
// become U+FFFD.
class TokenStreamDecoder {
 public:
  // at_text_start: the first token starts the text, so the SPM dummy-prefix space is dropped as
  // decode() does (leave false when streaming a continuation of a prompt).
  explicit TokenStreamDecoder(const Tokenizer& tok, bool at_text_start = false)
      : tok_(&tok), strip_space_(at_text_start && tok.add_space_prefix()) {}
  std::string push(int32_t id);
  std::string flush();  // whatever is pending, invalid bytes as U+FFFD
  bool pending() const { return !pending_.empty(); }  // part of a character held back

 private:
  const Tokenizer* tok_;
  std::string pending_;
  bool strip_space_;
};

}  // namespace kvq
