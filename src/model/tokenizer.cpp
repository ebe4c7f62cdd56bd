#include "model/tokenizer.h"

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <unordered_map>

#include "core/error.h"
#include "core/strings.h"
#include "model/unicode.h"

namespace kvq {
namespace {

constexpr std::string_view k_space_escape = "\xE2\x96\x81";  // U+2581, SentencePiece's space

// GPT-2's byte alphabet: printable Latin-1 bytes stand for themselves, the other 68 bytes are
// shifted to U+0100.. so that every byte is a visible character in the vocabulary.
struct ByteAlphabet {
  std::array<uint32_t, 256> byte_to_cp{};
  std::unordered_map<uint32_t, uint8_t> cp_to_byte;
  ByteAlphabet() {
    uint32_t next = 256;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
      byte_to_cp[b] = printable ? b : next++;
      cp_to_byte[byte_to_cp[b]] = static_cast<uint8_t>(b);
    }
  }
};
const ByteAlphabet& byte_alphabet() {
  static const ByteAlphabet a;
  return a;
}

// Names of end-of-turn tokens across chat formats; a CONTROL token with one of these texts ends
// generation even when the metadata names no EOT id.
constexpr std::string_view k_eog_names[] = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
    "<EOT>", "<|end_of_text|>", "<|end_of_turn|>", "<|return|>", "<|call|>",
};

// Token id from metadata: absent, -1 and 0xFFFFFFFF (how converters write "none") give -1.
int32_t read_token_id(const gguf::File& f, std::string_view key, int32_t n_vocab) {
  const auto v = f.get_int(key);
  if (!v || *v == -1 || *v == 0xFFFFFFFFll) return -1;
  if (*v < 0 || *v >= n_vocab)
    fail("{}: {} = {} is outside the vocabulary (size {})", f.path(), key, *v, n_vocab);
  return static_cast<int32_t>(*v);
}

// "<0x41>" -> 0x41; -1 if the piece is not of that form.
int parse_byte_piece(std::string_view p) {
  if (p.size() != 6 || p.substr(0, 3) != "<0x" || p[5] != '>') return -1;
  int v = 0;
  for (int k = 3; k < 5; ++k) {
    const char c = p[k];
    int d;
    if (c >= '0' && c <= '9') d = c - '0';
    else if (c >= 'A' && c <= 'F') d = c - 'A' + 10;
    else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
    else return -1;
    v = v * 16 + d;
  }
  return v;
}

std::string unescape_spaces(std::string_view p) {
  std::string out;
  out.reserve(p.size());
  for (size_t i = 0; i < p.size();) {
    if (p.substr(i, 3) == k_space_escape) {
      out += ' ';
      i += 3;
    } else {
      out += p[i++];
    }
  }
  return out;
}

// Hash for the piece index: 8 bytes per step, then a final mix so that the high 32 bits kept in
// the slot and the low bits that pick it are both well spread.
uint64_t hash_piece(std::string_view s) {
  const char* p = s.data();
  size_t n = s.size();
  uint64_t h = 0x9E3779B97F4A7C15ull ^ (n * 0xFF51AFD7ED558CCDull);
  while (n >= 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    h = (h ^ v) * 0xBF58476D1CE4E5B9ull;
    h ^= h >> 31;
    p += 8;
    n -= 8;
  }
  uint64_t v = 0;
  std::memcpy(&v, p, n);
  h = (h ^ v) * 0x94D049BB133111EBull;
  h ^= h >> 29;
  h *= 0xBF58476D1CE4E5B9ull;
  h ^= h >> 32;
  return h;
}

// One symbol of a word being merged: a byte range of the text (SPM) or a token id (BPE), in a
// doubly linked list so that merging is O(1).
struct Symbol {
  uint32_t off;
  uint32_t len;  // 0 once merged into its left neighbour
  int32_t id;    // BPE: current token id
  int32_t prev, next;
};

}  // namespace


struct Tokenizer::WordCache {
  struct Hash {
    using is_transparent = void;
    size_t operator()(std::string_view s) const noexcept { return hash_piece(s); }
  };
  // word -> (offset, count) in ids
  std::unordered_map<std::string, std::pair<uint32_t, uint32_t>, Hash, std::equal_to<>> map;
  std::vector<int32_t> ids;
  static constexpr size_t k_max_word = 64;  // longer words are rare: not worth the memory

  // Appends the ids of `word` to out, computing them with `fn(word, out)` on a miss.
  template <typename Fn>
  void encode(std::string_view word, std::vector<int32_t>& out, Fn&& fn) {
    if (word.size() > k_max_word) {
      fn(word, out);
      return;
    }
    const auto it = map.find(word);
    if (it != map.end()) {
      out.insert(out.end(), ids.begin() + it->second.first, ids.begin() + it->second.first + it->second.second);
      return;
    }
    const size_t start = out.size();
    fn(word, out);
    const auto off = static_cast<uint32_t>(ids.size());
    ids.insert(ids.end(), out.begin() + start, out.end());
    map.emplace(std::string(word), std::make_pair(off, static_cast<uint32_t>(out.size() - start)));
  }
};

Tokenizer Tokenizer::from_gguf(const gguf::File& f) {
  Tokenizer t;
  const auto model = f.get_string("tokenizer.ggml.model");
  if (!model) fail("{}: no tokenizer in the file (tokenizer.ggml.model is missing)", f.path());
  if (*model == "llama") {
    t.kind_ = Kind::spm;
  } else if (*model == "gpt2") {
    t.kind_ = Kind::bpe;
  } else {
    fail("{}: tokenizer.ggml.model = '{}' is not supported (supported: llama, gpt2)", f.path(), printable(*model));
  }

  auto tokens = f.get_string_array("tokenizer.ggml.tokens");
  if (!tokens || tokens->empty()) fail("{}: tokenizer.ggml.tokens is missing or empty", f.path());
  if (tokens->size() >= static_cast<size_t>(std::numeric_limits<int32_t>::max()))
    fail("{}: vocabulary of {} tokens is too large", f.path(), tokens->size());
  t.pieces_ = std::move(*tokens);
  const auto n = static_cast<int32_t>(t.pieces_.size());

  if (auto scores = f.get_float_array("tokenizer.ggml.scores")) {
    if (static_cast<int64_t>(scores->size()) != n)
      fail("{}: tokenizer.ggml.scores has {} entries for {} tokens", f.path(), scores->size(), n);
    t.scores_ = std::move(*scores);
  } else if (t.kind_ == Kind::spm) {
    fail("{}: tokenizer.ggml.scores is missing (a SentencePiece vocabulary needs scores)", f.path());
  } else {
    t.scores_.assign(n, 0.0f);
  }

  t.types_.assign(n, TokenType::normal);
  if (auto types = f.get_int_array("tokenizer.ggml.token_type")) {
    if (static_cast<int64_t>(types->size()) != n)
      fail("{}: tokenizer.ggml.token_type has {} entries for {} tokens", f.path(), types->size(), n);
    for (int32_t i = 0; i < n; ++i) {
      const int64_t v = (*types)[i];
      if (v < 0 || v > 6) fail("{}: token {} has invalid type {}", f.path(), i, v);
      t.types_[i] = v == 0 ? TokenType::normal : static_cast<TokenType>(v);
    }
  }

  {
    size_t cap = 16;
    while (cap < static_cast<size_t>(n) * 2) cap *= 2;  // load factor <= 1/2: short probe runs
    t.index_.assign(cap, 0);
    t.index_mask_ = cap - 1;
    for (int32_t i = 0; i < n; ++i) {
      if (t.lookup(t.pieces_[i]) >= 0) continue;  // duplicate piece: the first id wins
      const uint64_t h = hash_piece(t.pieces_[i]);
      size_t slot = h & t.index_mask_;
      while (t.index_[slot] != 0) slot = (slot + 1) & t.index_mask_;
      t.index_[slot] = (h & 0xFFFFFFFF00000000ull) | static_cast<uint32_t>(i + 1);
    }
  }

  t.bos_ = read_token_id(f, "tokenizer.ggml.bos_token_id", n);
  t.eos_ = read_token_id(f, "tokenizer.ggml.eos_token_id", n);
  t.unk_ = read_token_id(f, "tokenizer.ggml.unknown_token_id", n);
  const bool spm = t.kind_ == Kind::spm;
  t.add_bos_ = f.get_bool("tokenizer.ggml.add_bos_token").value_or(spm);
  t.add_space_prefix_ = spm && f.get_bool("tokenizer.ggml.add_space_prefix").value_or(true);

  // end of generation
  for (const char* key : {"tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"}) {
    const int32_t id = read_token_id(f, key, n);
    if (id >= 0) t.eog_ids_.push_back(id);
  }
  if (t.eos_ >= 0) t.eog_ids_.push_back(t.eos_);
  for (std::string_view name : k_eog_names) {
    const int32_t id = t.find_token(name);
    // control tokens, or user-defined ones (a file that types <|end|> so still ends a turn with
    // it, as llama.cpp treats such tokens)
    if (id >= 0 && (t.types_[id] == TokenType::control || t.types_[id] == TokenType::user_defined)) t.eog_ids_.push_back(id);
  }
  // OpenAI's harmony format (gpt-oss): a reply ends with <|return|>, or <|call|> for a tool call;
  // <|end|> only ends one of its messages (the reasoning before the answer), so it does not end
  // generation there, and the markers of its messages render as text (as llama.cpp treats this
  // vocabulary), so that a reply shows its channels: <|channel|>analysis<|message|>...<|end|>
  // <|start|>assistant<|channel|>final<|message|>...
  auto is_eog_id = [&](int32_t id) { return id >= 0 && std::find(t.eog_ids_.begin(), t.eog_ids_.end(), id) != t.eog_ids_.end(); };
  const int32_t end_id = t.find_token("<|end|>");
  if (is_eog_id(t.find_token("<|return|>")) && is_eog_id(t.find_token("<|call|>")) && is_eog_id(end_id)) {
    t.eog_ids_.erase(std::remove(t.eog_ids_.begin(), t.eog_ids_.end(), end_id), t.eog_ids_.end());  // every listing
    for (std::string_view name : {"<|end|>", "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"})
      if (const int32_t id = t.find_token(name); id >= 0) t.types_[id] = TokenType::user_defined;
  }
  std::sort(t.eog_ids_.begin(), t.eog_ids_.end());
  t.eog_ids_.erase(std::unique(t.eog_ids_.begin(), t.eog_ids_.end()), t.eog_ids_.end());

  // byte tokens and the text every token renders as
  std::fill(std::begin(t.byte_token_), std::end(t.byte_token_), -1);
  t.decoded_.resize(n);
  const ByteAlphabet& alpha = byte_alphabet();
  for (int32_t i = 0; i < n; ++i) {
    const std::string& p = t.pieces_[i];
    switch (t.types_[i]) {
      case TokenType::control:
        break;  // renders as nothing
      case TokenType::unknown:
        t.decoded_[i] = " \xE2\x81\x87 ";  // U+2047, as SentencePiece renders <unk>
        break;
      case TokenType::byte: {
        const int b = parse_byte_piece(p);
        if (b < 0) fail("{}: byte token {} is '{}', expected <0xXX>", f.path(), i, printable(p));
        t.decoded_[i] = std::string(1, static_cast<char>(b));
        if (t.byte_token_[b] < 0) t.byte_token_[b] = i;
        break;
      }
      case TokenType::user_defined:
        t.decoded_[i] = spm ? unescape_spaces(p) : p;
        break;
      default:
        if (spm) {
          t.decoded_[i] = unescape_spaces(p);
        } else {
          std::string& d = t.decoded_[i];
          for (size_t k = 0; k < p.size();) {
            uint32_t cp;
            const int len = unicode::utf8_decode(p, k, &cp);
            const auto it = alpha.cp_to_byte.find(cp);
            if (it != alpha.cp_to_byte.end()) d += static_cast<char>(it->second);
            else d.append(p, k, len);  // not from the byte alphabet: keep as written
            k += len;
          }
        }
    }
  }

  if (t.kind_ == Kind::bpe) {
    for (int b = 0; b < 256; ++b) {
      std::string ch;
      unicode::utf8_append(ch, alpha.byte_to_cp[b]);
      t.byte_token_[b] = t.find_token(ch);
    }
    const auto merges = f.get_string_array("tokenizer.ggml.merges");
    if (!merges) fail("{}: tokenizer.ggml.merges is missing (a gpt2 vocabulary needs merges)", f.path());
    t.merges_.reserve(merges->size());
    for (size_t r = 0; r < merges->size(); ++r) {
      const std::string& m = (*merges)[r];
      // pieces never hold a plain space (the byte alphabet moves it to U+0120), so the first
      // space after the first character separates the pair
      const size_t sp = m.find(' ', 1);
      if (sp == std::string::npos) fail("{}: merge {} ('{}') is not 'left right'", f.path(), r, printable(m));
      const int32_t l = t.find_token(std::string_view(m).substr(0, sp));
      const int32_t rt = t.find_token(std::string_view(m).substr(sp + 1));
      const int32_t merged = t.find_token(std::string(m, 0, sp) + m.substr(sp + 1));
      if (l < 0 || rt < 0 || merged < 0) continue;  // cannot apply: a merge to nothing
      const uint64_t key = (static_cast<uint64_t>(l) << 32) | static_cast<uint32_t>(rt);
      t.merges_.emplace(key, std::make_pair(static_cast<int32_t>(r), merged));  // first rank wins
    }
    const std::string pre = f.get_string("tokenizer.ggml.pre").value_or("default");
    if (pre == "smollm" || pre == "starcoder" || pre == "refact") {
      t.split_digits_ = true;
    } else if (pre == "llama-bpe" || pre == "llama3" || pre == "llama-v3" || pre == "falcon3" || pre == "pixtral" ||
               pre == "midm-2.0") {
      t.llama3_digits_ = 3;
      // As Llama 3's own tokenizer (and llama.cpp): a pre-token that is a word of the vocabulary
      // is that token, without merging; and a BOS opens every text unless the file says otherwise.
      t.ignore_merges_ = true;
      if (!f.find("tokenizer.ggml.add_bos_token")) t.add_bos_ = true;
    } else if (pre == "smaug-bpe" || pre == "dbrx") {
      t.llama3_digits_ = 3;  // Llama 3's pattern, but merged as any BPE and BOS as the file says
    } else if (pre == "qwen2" || pre == "deepseek-r1-qwen") {
      t.llama3_digits_ = 1;
    } else if (pre == "tekken") {
      // Mistral's Tekken (Mistral Nemo, Mistral Small 3): digits one at a time; vocabulary words
      // taken whole and a BOS opening every text, as its tokenizer (and llama.cpp) does. The
      // Tekken and GPT-4o patterns' letter cases are Unicode's, as in the Hugging Face tokenizers
      // (llama.cpp approximates them with ASCII, so on non-ASCII capitals or marks its pieces can
      // differ).
      t.cased_digits_ = 1;
      t.ignore_merges_ = true;
      if (!f.find("tokenizer.ggml.add_bos_token")) t.add_bos_ = true;
    } else if (pre == "gpt-4o" || pre == "llama4") {
      t.cased_digits_ = 3;
      t.cased_contractions_ = true;
    } else if (pre != "gpt2" && pre != "default" && pre != "olmo") {  // OLMo's (OLMoE, OLMo 1.7): GPT-2's pattern
      fail("{}: pre-tokenizer tokenizer.ggml.pre = '{}' is not supported (supported: gpt2, default, olmo, "
           "smollm, starcoder, refact, llama-bpe, llama3, llama-v3, falcon3, pixtral, midm-2.0, smaug-bpe, dbrx, qwen2, "
           "deepseek-r1-qwen, tekken, gpt-4o, llama4)",
           f.path(), printable(pre));
    }
  } else {
    for (int b = 0; b < 256; ++b) {
      char name[8];
      std::snprintf(name, sizeof name, "<0x%02X>", b);
      const int32_t id = t.find_token(name);
      if (id >= 0 && t.types_[id] == TokenType::byte) t.byte_token_[b] = id;
    }
    for (int32_t i = 0; i < n; ++i) {
      if (!t.mergeable(i)) continue;
      const std::string& p = t.pieces_[i];
      uint32_t prev = 0x2581;
      for (size_t k = 0; k < p.size();) {
        uint32_t cp;
        k += unicode::utf8_decode(p, k, &cp);
        if (cp == 0x2581 && prev != 0x2581) t.spm_glue_.push_back(prev);
        prev = cp;
      }
    }
    std::sort(t.spm_glue_.begin(), t.spm_glue_.end());
    t.spm_glue_.erase(std::unique(t.spm_glue_.begin(), t.spm_glue_.end()), t.spm_glue_.end());
  }

  // special tokens, matched in the raw text before the model's own algorithm runs
  for (int32_t i = 0; i < n; ++i) {
    const TokenType ty = t.types_[i];
    if (t.pieces_[i].empty()) continue;
    if (ty == TokenType::user_defined) t.user_specials_.tokens.push_back({t.pieces_[i], i});
    if (ty == TokenType::user_defined || ty == TokenType::control || ty == TokenType::unknown)
      t.all_specials_.tokens.push_back({t.pieces_[i], i});
  }
  t.user_specials_.finish();
  t.all_specials_.finish();
  return t;
}

void Tokenizer::SpecialSet::finish() {
  std::stable_sort(tokens.begin(), tokens.end(), [](const SpecialToken& a, const SpecialToken& b) {
    const auto fa = static_cast<uint8_t>(a.text[0]), fb = static_cast<uint8_t>(b.text[0]);
    if (fa != fb) return fa < fb;
    return a.text.size() > b.text.size();
  });
  for (size_t k = tokens.size(); k-- > 0;)
    first[static_cast<uint8_t>(tokens[k].text[0])] = static_cast<uint32_t>(k + 1);
}

const Tokenizer::SpecialToken* Tokenizer::SpecialSet::match(std::string_view text, size_t i) const {
  const char c = text[i];
  for (uint32_t k = first[static_cast<uint8_t>(c)]; k > 0 && k <= tokens.size() && tokens[k - 1].text[0] == c; ++k) {
    const SpecialToken& s = tokens[k - 1];
    if (text.compare(i, s.text.size(), s.text) == 0) return &s;  // the longest, as sorted so
  }
  return nullptr;
}

int32_t Tokenizer::lookup(std::string_view piece) const {
  if (index_.empty()) return -1;
  const uint64_t h = hash_piece(piece);
  const uint64_t tag = h & 0xFFFFFFFF00000000ull;
  for (size_t slot = h & index_mask_;; slot = (slot + 1) & index_mask_) {
    const uint64_t e = index_[slot];
    if (e == 0) return -1;
    if ((e & 0xFFFFFFFF00000000ull) == tag) {
      const auto id = static_cast<int32_t>(static_cast<uint32_t>(e) - 1);
      if (pieces_[id] == piece) return id;
    }
  }
}

int32_t Tokenizer::find_token(std::string_view piece) const { return lookup(piece); }

bool Tokenizer::mergeable(int32_t id) const {
  // SentencePiece merges only into ordinary pieces; control and byte tokens are never built
  // from text.
  const TokenType ty = types_[id];
  return ty == TokenType::normal || ty == TokenType::user_defined;
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_bos) const {
  return encode(text, add_bos, false);
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_bos, bool parse_special) const {
  return encode_text(text, add_bos, parse_special, true);
}

std::vector<int32_t> Tokenizer::encode_continuation(std::string_view text, bool parse_special) const {
  return encode_text(text, false, parse_special, false);
}

std::vector<int32_t> Tokenizer::encode_text(std::string_view text, bool add_bos, bool parse_special, bool at_start) const {
  // symbol and span offsets are 32-bit
  if (text.size() >= std::numeric_limits<uint32_t>::max()) fail("text of {} bytes is too long to tokenize", text.size());
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 2);
  if (add_bos && this->add_bos()) out.push_back(bos_);
  // SPM dummy prefix: at the start and after each special token (a text's encoding); none in a
  // continuation (a generated text's tokens)
  bool after_special = at_start;
  WordCache cache;
  auto flush_raw = [&](std::string_view raw) {
    if (raw.empty()) return;
    if (kind_ == Kind::spm)
      encode_spm(raw, add_space_prefix_ && after_special, cache, out);
    else
      encode_bpe(raw, cache, out);
    after_special = false;
  };
  const SpecialSet& specials = parse_special ? all_specials_ : user_specials_;
  size_t raw_begin = 0;
  for (size_t i = 0; i < text.size();) {
    const SpecialToken* hit = specials.match(text, i);
    if (!hit) {
      ++i;
      continue;
    }
    flush_raw(text.substr(raw_begin, i - raw_begin));
    out.push_back(hit->id);
    after_special = at_start;
    i += hit->text.size();
    raw_begin = i;
  }
  flush_raw(text.substr(raw_begin));
  return out;
}

void Tokenizer::encode_spm(std::string_view text, bool prefix_space, WordCache& cache,
                           std::vector<int32_t>& out) const {
  thread_local std::string buf;
  buf.clear();
  if (prefix_space) buf += k_space_escape;
  for (char c : text) {
    if (c == ' ')
      buf += k_space_escape;
    else
      buf += c;
  }
  const std::string_view bv(buf);
  auto run = [this](std::string_view w, std::vector<int32_t>& o) { spm_word(w, o); };
  size_t word_begin = 0;
  uint32_t prev = 0x2581;
  for (size_t i = 0; i < bv.size();) {
    uint32_t cp;
    const int len = unicode::utf8_decode(bv, i, &cp);
    if (cp == 0x2581 && prev != 0x2581 && !std::binary_search(spm_glue_.begin(), spm_glue_.end(), prev)) {
      cache.encode(bv.substr(word_begin, i - word_begin), out, run);
      word_begin = i;
    }
    prev = cp;
    i += len;
  }
  cache.encode(bv.substr(word_begin), out, run);
}

void Tokenizer::spm_word(std::string_view bv, std::vector<int32_t>& out) const {
  thread_local std::vector<Symbol> sym;
  sym.clear();
  for (size_t i = 0; i < bv.size();) {
    uint32_t cp;
    const int len = unicode::utf8_decode(bv, i, &cp);
    const auto idx = static_cast<int32_t>(sym.size());
    sym.push_back({static_cast<uint32_t>(i), static_cast<uint32_t>(len), -1, idx - 1, idx + 1});
    i += len;
  }
  if (sym.empty()) return;
  sym.back().next = -1;

  struct Bigram {
    float score;
    int32_t left;
    uint32_t len;
  };
  // highest score first; among equal scores the leftmost pair
  auto worse = [](const Bigram& a, const Bigram& b) {
    return a.score < b.score || (a.score == b.score && a.left > b.left);
  };
  thread_local std::vector<Bigram> heap;
  heap.clear();
  auto try_add = [&](int32_t l, int32_t r) {
    if (l < 0 || r < 0) return;
    const uint32_t len = sym[l].len + sym[r].len;
    const int32_t id = lookup(bv.substr(sym[l].off, len));
    if (id < 0 || !mergeable(id)) return;
    heap.push_back({scores_[id], l, len});
    std::push_heap(heap.begin(), heap.end(), worse);
  };
  for (size_t i = 0; i + 1 < sym.size(); ++i) try_add(static_cast<int32_t>(i), static_cast<int32_t>(i + 1));

  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), worse);
    const Bigram b = heap.back();
    heap.pop_back();
    Symbol& l = sym[b.left];
    // stale: one side was merged elsewhere since this pair was queued
    if (l.len == 0 || l.next < 0 || l.len + sym[l.next].len != b.len) continue;
    Symbol& r = sym[l.next];
    l.len = b.len;
    r.len = 0;
    l.next = r.next;
    if (l.next >= 0) sym[l.next].prev = b.left;
    try_add(l.prev, b.left);
    try_add(b.left, l.next);
  }

  for (int32_t i = 0; i >= 0; i = sym[i].next) {
    const std::string_view piece = bv.substr(sym[i].off, sym[i].len);
    const int32_t id = lookup(piece);
    if (id >= 0 && mergeable(id)) {
      out.push_back(id);
      continue;
    }
    // not in the vocabulary: one byte token per byte, <unk> where the model has none
    for (char c : piece) {
      const int32_t bt = byte_token_[static_cast<uint8_t>(c)];
      if (bt >= 0)
        out.push_back(bt);
      else if (has_unk())
        out.push_back(unk_);
    }
  }
}

void Tokenizer::encode_bpe(std::string_view text, WordCache& cache, std::vector<int32_t>& out) const {
  thread_local std::vector<unicode::Span> spans;
  spans.clear();
  if (cased_digits_ > 0) unicode::pretokenize_cased(text, cased_digits_, cased_contractions_, spans);
  else if (llama3_digits_ > 0) unicode::pretokenize_llama3(text, llama3_digits_, spans);
  else unicode::pretokenize_gpt2(text, split_digits_, spans);
  auto run = [this](std::string_view w, std::vector<int32_t>& o) { bpe_word(w, o); };
  for (const unicode::Span& s : spans) cache.encode(text.substr(s.begin, s.len), out, run);
}

void Tokenizer::bpe_word(std::string_view word, std::vector<int32_t>& out) const {
  if (ignore_merges_) {
    thread_local std::string mapped;  // the word in the vocabulary's byte alphabet
    mapped.clear();
    bool ok = true;
    for (char ch : word) {
      const int32_t b = byte_token_[static_cast<uint8_t>(ch)];
      if (b < 0) {
        ok = false;
        break;
      }
      mapped += pieces_[static_cast<size_t>(b)];
    }
    const int32_t id = ok ? find_token(mapped) : -1;
    if (id >= 0 && types_[static_cast<size_t>(id)] == TokenType::normal) {
      out.push_back(id);
      return;
    }
  }
  thread_local std::vector<Symbol> sym;
  sym.clear();
  for (size_t i = 0; i < word.size(); ++i) {
    const auto idx = static_cast<int32_t>(sym.size());
    sym.push_back({static_cast<uint32_t>(i), 1, byte_token_[static_cast<uint8_t>(word[i])], idx - 1, idx + 1});
  }
  if (sym.empty()) return;
  sym.back().next = -1;

  struct Pair {
    int32_t rank;
    int32_t left, right;
    int32_t left_id, right_id;
    int32_t merged;
  };
  // lowest rank first; among equal ranks the leftmost pair
  auto worse = [](const Pair& a, const Pair& b) {
    return a.rank > b.rank || (a.rank == b.rank && a.left > b.left);
  };
  thread_local std::vector<Pair> heap;
  heap.clear();
  auto try_add = [&](int32_t l, int32_t r) {
    if (l < 0 || r < 0 || sym[l].id < 0 || sym[r].id < 0) return;
    const uint64_t key = (static_cast<uint64_t>(sym[l].id) << 32) | static_cast<uint32_t>(sym[r].id);
    const auto it = merges_.find(key);
    if (it == merges_.end()) return;
    heap.push_back({it->second.first, l, r, sym[l].id, sym[r].id, it->second.second});
    std::push_heap(heap.begin(), heap.end(), worse);
  };
  for (size_t i = 0; i + 1 < sym.size(); ++i) try_add(static_cast<int32_t>(i), static_cast<int32_t>(i + 1));

  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), worse);
    const Pair p = heap.back();
    heap.pop_back();
    Symbol& l = sym[p.left];
    if (l.len == 0 || l.next != p.right || l.id != p.left_id || sym[p.right].id != p.right_id) continue;
    Symbol& r = sym[p.right];
    l.id = p.merged;
    l.len += r.len;
    r.len = 0;
    r.id = -1;
    l.next = r.next;
    if (l.next >= 0) sym[l.next].prev = p.left;
    try_add(l.prev, p.left);
    try_add(p.left, l.next);
  }
  for (int32_t i = 0; i >= 0; i = sym[i].next) {
    if (sym[i].id >= 0)
      out.push_back(sym[i].id);
    else if (has_unk())
      out.push_back(unk_);  // a byte whose character is missing from the vocabulary
  }
}

const std::string& Tokenizer::token_text(int32_t id) const {
  if (id < 0 || id >= n_vocab()) fail("token id {} is outside the vocabulary (size {})", id, n_vocab());
  return pieces_[id];
}

TokenType Tokenizer::token_type(int32_t id) const {
  if (id < 0 || id >= n_vocab()) fail("token id {} is outside the vocabulary (size {})", id, n_vocab());
  return types_[id];
}

std::string Tokenizer::token_piece(int32_t id) const {
  if (id < 0 || id >= n_vocab()) fail("token id {} is outside the vocabulary (size {})", id, n_vocab());
  return decoded_[id];
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids) const {
  std::string out;
  bool strip_space = add_space_prefix_;
  for (int32_t id : ids) {
    if (id < 0 || id >= n_vocab()) fail("token id {} is outside the vocabulary (size {})", id, n_vocab());
    const std::string& p = decoded_[id];
    if (strip_space && !p.empty()) {
      out.append(p, p[0] == ' ' ? 1 : 0, std::string::npos);
      strip_space = false;
    } else {
      out += p;
    }
  }
  return out;
}

bool Tokenizer::is_eog(int32_t id) const {
  return std::find(eog_ids_.begin(), eog_ids_.end(), id) != eog_ids_.end();
}

std::string TokenStreamDecoder::push(int32_t id) {
  std::string piece = tok_->token_piece(id);
  if (strip_space_ && !piece.empty()) {
    if (piece[0] == ' ') piece.erase(0, 1);
    strip_space_ = false;
  }
  pending_ += piece;
  const size_t n = unicode::utf8_complete_prefix(pending_);
  std::string out = unicode::utf8_sanitize(std::string_view(pending_).substr(0, n));
  pending_.erase(0, n);
  return out;
}

std::string TokenStreamDecoder::flush() {
  std::string out = unicode::utf8_sanitize(pending_);
  pending_.clear();
  return out;
}

}  // namespace kvq
