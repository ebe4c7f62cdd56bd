// libFuzzer target for the tokenizer: arbitrary bytes as text (first byte picks the vocabulary
// and parse_special) must never crash, must give ids inside the vocabulary, must round-trip
// exactly where the algorithm promises it, and must stream as valid UTF-8 only.
// Vocabularies: two small synthetic ones built in memory (SPM with byte fallback and a dummy
// prefix; byte-level BPE with the full byte alphabet), plus $KVQ_FUZZ_TOKENIZER_GGUF if set.
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "../tests/gguf_writer.h"
#include "model/tokenizer.h"
#include "model/unicode.h"

namespace {

using kvq::Tokenizer;
using kvq::test::GgufWriter;
namespace gv = kvq::test::gv;
using VT = kvq::gguf::ValueType;

struct Vocab {
  std::vector<uint8_t> img;  // the File points into it
  std::unique_ptr<kvq::gguf::File> file;
  std::unique_ptr<Tokenizer> tok;
  bool exact_round_trip = false;  // no token types that break decode(encode(x)) == x
};

template <typename T, typename F>
kvq::gguf::Value arr(VT t, const std::vector<T>& v, F make) {
  std::vector<kvq::gguf::Value> items;
  for (const auto& x : v) items.push_back(make(x));
  return gv::arr(t, items);
}

std::string byte_char(int b) {  // GPT-2 byte alphabet
  const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
  int cp = b;
  if (!printable) {
    int k = 0;
    for (int x = 0; x < b; ++x) {
      const bool p = (x >= 33 && x <= 126) || (x >= 161 && x <= 172) || (x >= 174 && x <= 255);
      k += !p;
    }
    cp = 256 + k;
  }
  std::string s;
  kvq::unicode::utf8_append(s, static_cast<uint32_t>(cp));
  return s;
}

Vocab finish(const GgufWriter& w, bool exact) {
  Vocab v;
  v.img = w.build();
  v.file = kvq::gguf::File::parse(v.img.data(), v.img.size(), "fuzz-vocab");
  v.tok = std::make_unique<Tokenizer>(Tokenizer::from_gguf(*v.file));
  v.exact_round_trip = exact;
  return v;
}

Vocab make_spm() {
  const std::string sp = "\xE2\x96\x81";
  std::vector<std::string> toks = {"<unk>", "<s>", "</s>"};
  std::vector<int32_t> types = {2, 3, 3};
  for (int b = 0; b < 256; ++b) {
    char name[8];
    std::snprintf(name, sizeof name, "<0x%02X>", b);
    toks.push_back(name);
    types.push_back(6);
  }
  const std::vector<std::string> pieces = {sp, "a", "b", sp + "a", "ab", sp + "ab", "\xC3\xA9", sp + sp, "e\xCC\x81"};
  for (const std::string& p : pieces) {
    toks.push_back(p);
    types.push_back(1);
  }
  std::vector<float> scores(toks.size());
  for (size_t i = 0; i < scores.size(); ++i) scores[i] = -static_cast<float>(i % 7);
  GgufWriter w;
  w.add_string("tokenizer.ggml.model", "llama");
  w.add("tokenizer.ggml.tokens", arr(VT::string, toks, gv::str));
  w.add("tokenizer.ggml.scores", arr(VT::f32, scores, gv::f32));
  w.add("tokenizer.ggml.token_type", arr(VT::i32, types, gv::i32));
  w.add_u32("tokenizer.ggml.bos_token_id", 1);
  w.add_u32("tokenizer.ggml.eos_token_id", 2);
  return finish(w, true);
}

Vocab make_bpe() {
  std::vector<std::string> toks;
  for (int b = 0; b < 256; ++b) toks.push_back(byte_char(b));
  const std::string G = byte_char(' ');
  std::vector<std::string> merges = {G + " t", "h e", G + "t he", "1 2", "a b", "ab c"};
  for (const std::string& m : merges) {
    const size_t sp = m.find(' ', 1);
    toks.push_back(m.substr(0, sp) + m.substr(sp + 1));
  }
  toks.push_back("<|im_start|>");
  std::vector<int32_t> types(toks.size(), 1);
  types.back() = 3;
  GgufWriter w;
  w.add_string("tokenizer.ggml.model", "gpt2");
  w.add_string("tokenizer.ggml.pre", "smollm");
  w.add("tokenizer.ggml.tokens", arr(VT::string, toks, gv::str));
  w.add("tokenizer.ggml.token_type", arr(VT::i32, types, gv::i32));
  w.add("tokenizer.ggml.merges", arr(VT::string, merges, gv::str));
  return finish(w, true);
}

std::vector<Vocab>& vocabs() {
  static std::vector<Vocab> v;
  return v;
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  vocabs().push_back(make_spm());
  vocabs().push_back(make_bpe());
  if (const char* path = std::getenv("KVQ_FUZZ_TOKENIZER_GGUF")) {
    Vocab v;
    v.file = kvq::gguf::File::open(path);
    v.tok = std::make_unique<Tokenizer>(Tokenizer::from_gguf(*v.file));
    vocabs().push_back(std::move(v));
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const Vocab& v = vocabs()[data[0] % vocabs().size()];
  const bool parse_special = (data[0] / 16) & 1;
  const std::string text(reinterpret_cast<const char*>(data + 1), size - 1);
  const Tokenizer& tok = *v.tok;
  const std::vector<int32_t> ids = tok.encode(text, (data[0] / 32) & 1, parse_special);
  for (int32_t id : ids)
    if (id < 0 || id >= tok.n_vocab()) __builtin_trap();
  const std::string back = tok.decode(ids);
  const bool spm_space = tok.kind() == Tokenizer::Kind::spm && text.find("\xE2\x96\x81") != std::string::npos;
  if (v.exact_round_trip && !parse_special && !spm_space && back != text) __builtin_trap();
  kvq::TokenStreamDecoder sd(tok, true);
  std::string streamed;
  for (int32_t id : ids) {
    const std::string chunk = sd.push(id);
    if (!kvq::unicode::utf8_is_valid(chunk)) __builtin_trap();
    streamed += chunk;
  }
  streamed += sd.flush();
  if (streamed != kvq::unicode::utf8_sanitize(back)) __builtin_trap();
  return 0;
}
