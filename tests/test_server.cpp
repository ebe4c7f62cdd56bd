// HTTP server end to end on loopback: completions and chat (plain and streamed), usage, stop,
// every bad-input case, /v1/models, /health and /metrics.
// GCC 12 warns of maybe-uninitialized members inside std::regex's own code at -O2 with the
// sanitizers (a false positive in the library's instantiations).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <gtest/gtest.h>
#include <arpa/inet.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <filesystem>
#include <functional>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <optional>
#include <regex>
#include <thread>

#include "gguf/gguf.h"
#include "gguf_writer.h"
#include "server/serve_cli.h"
#include "server/server.h"
#include "sse_events.h"

namespace fs = std::filesystem;
using json = nlohmann::json;
using namespace kvq;

namespace {
std::string model_path() { return std::string(KVQ_SOURCE_DIR) + "/../shared/models/stories260K.gguf"; }

// stories260K on one thread, 256-token context, pages of 16 tokens.
EngineOptions one_thread_options(size_t kv_tokens) {
  EngineOptions o;
  o.model_path = model_path();
  o.threads = 1;
  o.ctx = 256;
  o.kv_tokens = kv_tokens;
  o.kv.page_tokens = 16;
  return o;
}

// Any free loopback port, the model named stories260K.
ServerOptions loopback_options() {
  ServerOptions so;
  so.port = 0;
  so.model_name = "stories260K";
  return so;
}

// A server listening on its own thread for a test's scope.
struct ServerOnThread {
  Server server;
  int port;
  std::thread th;
  ServerOnThread(Engine& e, const ServerOptions& so) : server(e, so), port(server.bind()), th([this] { server.listen(); }) {}
  ~ServerOnThread() {
    server.stop();
    th.join();
  }
};
}  // namespace

class ServerTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { start(256); }
  static void start(int ctx, const std::string& path = model_path(), const std::string& chat_template = "",
                    const std::function<void(ServerOptions&)>& options = {}) {
    if (!fs::exists(model_path())) return;
    EngineOptions o;
    o.model_path = path;
    o.threads = 2;
    o.ctx = ctx;
    o.kv_tokens = 4096;
    o.kv.page_tokens = 16;
    engine_ = new Engine(o);
    ServerOptions so;
    so.port = 0;
    so.model_name = "stories260K";
    so.http_threads = 8;
    so.chat_template = chat_template;
    if (options) options(so);
    server_ = new Server(*engine_, so);
    port_ = server_->bind();
    thread_ = new std::thread([] { server_->listen(); });
  }
  static void TearDownTestSuite() {
    if (!server_) return;
    server_->stop();
    thread_->join();
    delete thread_;
    delete server_;
    delete engine_;
    server_ = nullptr;
  }
  void SetUp() override {
    if (!server_) GTEST_SKIP() << "stories260K.gguf not found at " << model_path();
  }
  httplib::Client client() const {
    httplib::Client c("127.0.0.1", port_);
    c.set_read_timeout(60, 0);
    return c;
  }
  json post_ok(const std::string& path, const json& body) {
    auto c = client();
    auto r = c.Post(path.c_str(), body.dump(), "application/json");
    EXPECT_TRUE(r);
    if (!r) return {};
    EXPECT_EQ(r->status, 200) << r->body;
    return json::parse(r->body);
  }
  // The prompt a chat body renders to, as text (/tokenize, then /detokenize)
  std::string prompt_text(const json& body) {
    const json tokens = post_ok("/tokenize", body)["tokens"];
    return post_ok("/detokenize", {{"tokens", tokens}})["prompt"];
  }
  // Expects a 400 whose error object names `param` (empty: any).
  void expect_bad(const std::string& path, const std::string& body, const std::string& param = "") {
    SCOPED_TRACE(body);
    auto c = client();
    auto r = c.Post(path.c_str(), body, "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 400);
    json j = json::parse(r->body, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << r->body;
    ASSERT_TRUE(j.contains("error"));
    EXPECT_EQ(j["error"]["type"], "invalid_request_error");
    EXPECT_TRUE(j["error"]["message"].is_string());
    EXPECT_TRUE(j["error"].contains("param"));
    EXPECT_TRUE(j["error"].contains("code"));
    if (!param.empty()) {
      EXPECT_EQ(j["error"]["param"], param);
    }
  }
  // The SSE events of a streamed response, "[DONE]" excluded; *done set when it was seen last.
  // A streamed chat reply's tool calls (each chunk's, in order) and its text (content and
  // reasoning_content deltas), and its events.
  struct StreamedReply {
    json calls = json::array();
    std::string text;
    std::vector<json> events;
  };
  StreamedReply stream_reply(const json& body, bool* done) {
    StreamedReply r;
    r.events = stream("/v1/chat/completions", body, done);
    for (const json& e : r.events) {
      if (e["choices"].empty()) continue;
      const json& d = e["choices"][0]["delta"];
      if (d.contains("tool_calls")) r.calls.insert(r.calls.end(), d["tool_calls"].begin(), d["tool_calls"].end());
      for (const char* k : {"content", "reasoning_content"})
        if (d.contains(k) && d[k].is_string()) r.text += d[k].get<std::string>();
    }
    return r;
  }
  std::vector<json> stream(const std::string& path, json body, bool* done) {
    body["stream"] = true;
    auto c = client();
    std::string raw;
    auto r = c.Post(path.c_str(), httplib::Headers{}, body.dump(), "application/json");
    EXPECT_TRUE(r);
    if (!r) return {};
    EXPECT_EQ(r->status, 200);
    EXPECT_NE(r->get_header_value("Content-Type").find("text/event-stream"), std::string::npos);
    raw = r->body;
    return data_sse_events(raw, done);
  }

  // A streamed completion's choices by index: each one's joined text and how many chunks ended it;
  // chunks without choices (usage) are left out. Every chunk carries one choice of index < n.
  struct Streamed {
    std::vector<std::string> text;
    std::vector<int> finishes;
  };
  static Streamed by_choice(const std::vector<json>& evs, int n) {
    Streamed r{std::vector<std::string>(size_t(n)), std::vector<int>(size_t(n), 0)};
    for (const auto& e : evs) {
      if (e["choices"].empty()) continue;
      EXPECT_EQ(e["choices"].size(), 1u);
      const int i = e["choices"][0]["index"];
      EXPECT_TRUE(i >= 0 && i < n) << i;
      if (i < 0 || i >= n) continue;
      r.text[size_t(i)] += e["choices"][0]["text"].get<std::string>();
      if (!e["choices"][0]["finish_reason"].is_null()) ++r.finishes[size_t(i)];
    }
    return r;
  }

  static inline Engine* engine_ = nullptr;
  static inline Server* server_ = nullptr;
  static inline std::thread* thread_ = nullptr;
  static inline int port_ = 0;
};

TEST_F(ServerTest, CompletionGreedyStreamedEqualsPlain) {
  json body = {{"model", "stories260K"}, {"prompt", "Once upon a time"}, {"max_tokens", 24}, {"temperature", 0}};
  json j = post_ok("/v1/completions", body);
  EXPECT_EQ(j["object"], "text_completion");
  const std::string text = j["choices"][0]["text"];
  EXPECT_FALSE(text.empty());
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(j["usage"]["completion_tokens"], 24);
  const int n_prompt = j["usage"]["prompt_tokens"];
  EXPECT_EQ(n_prompt, int(engine_->tokenizer().encode("Once upon a time", true).size()));
  EXPECT_EQ(j["usage"]["total_tokens"], n_prompt + 24);
  // The same through the engine directly.
  GenParams p;
  p.sampling.temperature = 0;
  p.max_tokens = 24;
  EXPECT_EQ(engine_->generate(engine_->tokenizer().encode("Once upon a time", true), p).text, text);

  bool done = false;
  body["stream_options"] = {{"include_usage", true}};
  std::vector<json> evs = stream("/v1/completions", body, &done);
  EXPECT_TRUE(done);
  ASSERT_GE(evs.size(), 2u);
  std::string joined;
  std::string finish;
  for (const auto& e : evs) {
    if (e["choices"].empty()) continue;  // the usage chunk
    joined += e["choices"][0]["text"].get<std::string>();
    if (!e["choices"][0]["finish_reason"].is_null()) finish = e["choices"][0]["finish_reason"];
  }
  EXPECT_EQ(joined, text);
  EXPECT_EQ(finish, "length");
  EXPECT_EQ(evs.back()["usage"]["completion_tokens"], 24);
}

// n choices: one sequence each, the prompt counted once in usage; choice i samples with seed + i,
// so it equals a one-choice request with that seed; greedy choices are all the same. Streamed,
// every chunk names its choice, each choice ends once, and one usage chunk and [DONE] close it.
TEST_F(ServerTest, SeveralChoices) {
  json body = {{"prompt", "Once upon a time"}, {"max_tokens", 12}, {"temperature", 0}, {"n", 3}};
  json j = post_ok("/v1/completions", body);
  ASSERT_EQ(j["choices"].size(), 3u);
  json one = body;
  one.erase("n");
  const json single = post_ok("/v1/completions", one);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(j["choices"][i]["index"], i);
    EXPECT_EQ(j["choices"][i]["text"], single["choices"][0]["text"]);
    EXPECT_EQ(j["choices"][i]["finish_reason"], "length");
  }
  EXPECT_EQ(j["usage"]["prompt_tokens"], single["usage"]["prompt_tokens"]);
  EXPECT_EQ(j["usage"]["completion_tokens"], 36);
  EXPECT_EQ(j["usage"]["total_tokens"], single["usage"]["prompt_tokens"].get<int>() + 36);

  // The choices share the prompt's pages: a fresh prompt of several pages (16 tokens each here) is
  // computed once, the other choices adopt its whole pages.
  const std::string fresh = "The old fisherman walked along the quiet beach every morning and counted the shells that "
                            "the waves had left behind for him";
  const int n_fresh = int(engine_->tokenizer().encode(fresh, true).size());
  ASSERT_GE(n_fresh, 33);
  const uint64_t hits0 = engine_->metrics().prefix_hit_tokens;
  json jf = post_ok("/v1/completions", {{"prompt", fresh}, {"max_tokens", 4}, {"temperature", 0}, {"n", 4}});
  ASSERT_EQ(jf["choices"].size(), 4u);
  EXPECT_EQ(engine_->metrics().prefix_hit_tokens - hits0, uint64_t(3 * ((n_fresh - 1) / 16) * 16));

  // Sampled chat: choice i = the one-choice request with seed 7 + i.
  json chat = {{"messages", json::array({{{"role", "user"}, {"content", "Tell me about a dog"}}})},
               {"max_tokens", 16}, {"temperature", 1.0}, {"seed", 7}, {"n", 2}};
  json jc = post_ok("/v1/chat/completions", chat);
  ASSERT_EQ(jc["choices"].size(), 2u);
  for (int i = 0; i < 2; ++i) {
    json c1 = chat;
    c1.erase("n");
    c1["seed"] = 7 + i;
    EXPECT_EQ(jc["choices"][i]["index"], i);
    EXPECT_EQ(jc["choices"][i]["message"]["content"], post_ok("/v1/chat/completions", c1)["choices"][0]["message"]["content"])
        << "choice " << i;
  }
  EXPECT_NE(jc["choices"][0]["message"]["content"], jc["choices"][1]["message"]["content"]);  // the seeds differ

  // Streamed, with usage.
  body["n"] = 2;
  body["stream_options"] = {{"include_usage", true}};
  bool done = false;
  const std::vector<json> evs = stream("/v1/completions", body, &done);
  EXPECT_TRUE(done);
  int usage_chunks = 0;
  for (const auto& e : evs)
    if (e["choices"].empty()) {
      ++usage_chunks;
      EXPECT_EQ(e["usage"]["completion_tokens"], 24);
    }
  EXPECT_EQ(usage_chunks, 1);
  ASSERT_FALSE(evs.empty());
  EXPECT_TRUE(evs.back()["choices"].empty());  // usage last
  const Streamed got = by_choice(evs, 2);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(got.text[i], single["choices"][0]["text"]) << "choice " << i;
    EXPECT_EQ(got.finishes[i], 1) << "choice " << i;
  }
}

// Sampling controls beyond temperature / top-p / top-k: logit_bias forces or bans tokens,
// ignore_eos generates max_tokens past an end-of-generation token, and the OpenAI / vLLM penalties
// and min_p give what the engine gives with the same sampler settings.
TEST_F(ServerTest, LogitBiasIgnoreEosAndPenalties) {
  const Tokenizer& tk = engine_->tokenizer();
  const int32_t dog = tk.encode("dog", false).at(0);
  json j = post_ok("/v1/completions", {{"prompt", "Once upon a time"}, {"max_tokens", 6}, {"temperature", 0},
                                       {"logit_bias", {{std::to_string(dog), 100}}}});
  std::string six;
  for (int i = 0; i < 6; ++i) six += tk.token_piece(dog);
  EXPECT_EQ(j["choices"][0]["text"], six);

  ASSERT_GE(tk.eos(), 0);
  const json eos_bias = {{std::to_string(tk.eos()), 100}};
  j = post_ok("/v1/completions", {{"prompt", "Once upon a time"}, {"max_tokens", 5}, {"temperature", 0},
                                  {"logit_bias", eos_bias}});
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
  EXPECT_LE(j["usage"]["completion_tokens"].get<int>(), 1);
  j = post_ok("/v1/completions", {{"prompt", "Once upon a time"}, {"max_tokens", 5}, {"temperature", 0},
                                  {"logit_bias", eos_bias}, {"ignore_eos", true}});
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(j["usage"]["completion_tokens"], 5);

  // stop_token_ids: the forced token ends the generation at once, not output; ignore_eos does not
  // exempt it; a token that never comes changes nothing.
  for (bool ign : {false, true}) {
    j = post_ok("/v1/completions", {{"prompt", "Once upon a time"}, {"max_tokens", 6}, {"temperature", 0},
                                    {"logit_bias", {{std::to_string(dog), 100}}}, {"stop_token_ids", {dog}},
                                    {"ignore_eos", ign}});
    EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
    EXPECT_EQ(j["choices"][0]["text"], "");
    EXPECT_EQ(j["usage"]["completion_tokens"], 0);
  }
  j = post_ok("/v1/completions", {{"prompt", "Once upon a time"}, {"max_tokens", 6}, {"temperature", 0},
                                  {"logit_bias", {{std::to_string(dog), 100}}}, {"stop_token_ids", {dog + 1}}});
  EXPECT_EQ(j["choices"][0]["text"], six);

  // Penalties and min_p: the engine's result for the same settings.
  const json body = {{"prompt", "Once upon a time"}, {"max_tokens", 40},       {"temperature", 0.7},
                     {"seed", 3},                    {"presence_penalty", 0.5}, {"frequency_penalty", 0.8},
                     {"repetition_penalty", 1.2},    {"min_p", 0.1},            {"top_p", 0.9}};
  j = post_ok("/v1/completions", body);
  GenParams p;
  p.max_tokens = 40;
  p.sampling.temperature = 0.7f;
  p.sampling.seed = 3;
  p.sampling.top_k = 0;
  p.sampling.top_p = 0.9f;
  p.sampling.min_p = 0.1f;
  p.sampling.presence_penalty = 0.5f;
  p.sampling.frequency_penalty = 0.8f;
  p.sampling.repeat_penalty = 1.2f;
  p.sampling.repeat_last_n = -1;
  EXPECT_EQ(j["choices"][0]["text"], engine_->generate(tk.encode("Once upon a time", true), p).text);
  json plain = body;  // the same draws without the penalties: another text (they took effect)
  for (const char* k : {"presence_penalty", "frequency_penalty", "repetition_penalty"}) plain.erase(k);
  EXPECT_NE(post_ok("/v1/completions", plain)["choices"][0]["text"], j["choices"][0]["text"]);
}

// vLLM's min_tokens, include_stop_str_in_output, allowed_token_ids and truncate_prompt_tokens, and
// other servers' sampling settings at their neutral values (accepted, changing nothing).
TEST_F(ServerTest, VllmSamplingExtras) {
  const Tokenizer& tk = engine_->tokenizer();
  const int32_t dog = tk.encode("dog", false).at(0);
  const json base = {{"prompt", "Once upon a time"}, {"max_tokens", 30}, {"temperature", 0}};
  const json full = post_ok("/v1/completions", base);
  const std::string text = full["choices"][0]["text"];
  ASSERT_EQ(full["usage"]["completion_tokens"], 30);
  // a stop string from the middle: cut before it, or after it when asked
  const std::string stop = text.substr(text.size() / 2, 3);
  EXPECT_TRUE(full["choices"][0]["stop_reason"].is_null());  // vLLM's: null for a length
  json b = base;
  b["stop"] = {"zz-never", stop};
  const json cut = post_ok("/v1/completions", b);
  EXPECT_EQ(cut["choices"][0]["text"], text.substr(0, text.find(stop)));
  EXPECT_EQ(cut["choices"][0]["stop_reason"], stop);  // the stop string that ended it
  b["stream"] = true;
  {
    auto c = client();
    auto r = c.Post("/v1/completions", b.dump(), "application/json");
    ASSERT_TRUE(r);
    EXPECT_NE(r->body.find("\"stop_reason\":" + json(stop).dump()), std::string::npos) << r->body;
  }
  b.erase("stream");
  b["include_stop_str_in_output"] = true;
  EXPECT_EQ(post_ok("/v1/completions", b)["choices"][0]["text"], text.substr(0, text.find(stop) + 3));
  // min_tokens: a stop token forced by logit_bias cannot end the text before min_tokens
  b = base;
  b["logit_bias"] = {{std::to_string(dog), 100}};
  b["stop_token_ids"] = {dog};
  b["min_tokens"] = 7;
  json j = post_ok("/v1/completions", b);
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(j["choices"][0]["stop_reason"], dog);  // the stop token
  EXPECT_EQ(j["usage"]["completion_tokens"], 7);
  j = post_ok("/v1/completions", {{"prompt", "Once upon a time"}, {"max_tokens", 5}, {"temperature", 0},
                                  {"logit_bias", {{std::to_string(tk.eos()), 100}}}, {"stop_token_ids", {tk.eos()}}});
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
  EXPECT_TRUE(j["choices"][0]["stop_reason"].is_null());  // an end of generation, listed or not (vLLM's)
  // allowed_token_ids: greedy picks the likelier of the two at every step
  const int32_t cat = tk.encode("cat", false).at(0);
  b = base;
  b["max_tokens"] = 8;
  b["allowed_token_ids"] = {dog, cat};
  b["logprobs"] = 0;
  j = post_ok("/v1/completions", b);
  const json& toks = j["choices"][0]["logprobs"]["tokens"];
  ASSERT_EQ(toks.size(), 8u);
  for (const json& t : toks) EXPECT_TRUE(t == tk.token_piece(dog) || t == tk.token_piece(cat)) << t;
  // truncate_prompt_tokens: the prompt's last tokens only (the BOS kept first), as that shorter
  // prompt (echo shows it); -1: what leaves room for max_tokens in the context
  const std::vector<int32_t> ids = tk.encode("Once upon a time there was a little dog named Max", true);
  ASSERT_EQ(ids[0], tk.bos());
  b = {{"prompt", ids}, {"max_tokens", 5}, {"temperature", 0}, {"truncate_prompt_tokens", 4}, {"echo", true}};
  j = post_ok("/v1/completions", b);
  std::vector<int32_t> last4 = {tk.bos()};
  last4.insert(last4.end(), ids.end() - 3, ids.end());
  EXPECT_EQ(j["usage"]["prompt_tokens"], 4);
  const json plain = post_ok("/v1/completions", {{"prompt", last4}, {"max_tokens", 5}, {"temperature", 0}, {"echo", true}});
  EXPECT_EQ(j["choices"][0]["text"], plain["choices"][0]["text"]);
  b["truncate_prompt_tokens"] = 200;  // longer than the prompt: all of it
  EXPECT_EQ(post_ok("/v1/completions", b)["usage"]["prompt_tokens"], int(ids.size()));
  std::vector<int32_t> longer;  // 300 tokens: more than the context of 256
  while (longer.size() < 300) longer.insert(longer.end(), ids.begin() + 1, ids.end());
  longer.resize(300);
  longer[0] = tk.bos();
  b = {{"prompt", longer}, {"max_tokens", 6}, {"temperature", 0}, {"truncate_prompt_tokens", -1}};
  j = post_ok("/v1/completions", b);
  EXPECT_EQ(j["usage"]["prompt_tokens"], 256 - 6);
  EXPECT_EQ(j["usage"]["completion_tokens"], 6);
  b.erase("max_tokens");  // room for completions' default of 16
  b["ignore_eos"] = true;
  j = post_ok("/v1/completions", b);
  EXPECT_EQ(j["usage"]["prompt_tokens"], 256 - 16);
  EXPECT_EQ(j["usage"]["completion_tokens"], 16);
  b["truncate_prompt_tokens"] = 257;
  expect_bad("/v1/completions", b.dump(), "truncate_prompt_tokens");
  // llama.cpp's repeat_penalty (over the last repeat_last_n tokens, 64 by default)
  b = base;
  b["repeat_penalty"] = 1.5;
  GenParams rp;
  rp.max_tokens = 30;
  rp.sampling.temperature = 0;
  rp.sampling.repeat_penalty = 1.5f;
  rp.sampling.repeat_last_n = 64;
  const std::string penalized = post_ok("/v1/completions", b)["choices"][0]["text"];
  EXPECT_EQ(penalized, engine_->generate(tk.encode("Once upon a time", true), rp).text);
  EXPECT_NE(penalized, text);
  // vLLM's prompt_logprobs: each prompt token's log-probability and rank (as echo's), with that
  // many alternatives; chat's on the response
  j = post_ok("/v1/completions", {{"prompt", ids}, {"max_tokens", 2}, {"temperature", 0}, {"prompt_logprobs", 2}});
  const json& pl = j["choices"][0]["prompt_logprobs"];
  ASSERT_EQ(pl.size(), ids.size());
  EXPECT_TRUE(pl[0].is_null());
  const json echo = post_ok("/v1/completions", {{"prompt", ids}, {"max_tokens", 0}, {"echo", true}, {"logprobs", 0}});
  for (size_t i = 1; i < ids.size(); ++i) {
    const json& d = pl[i];
    const std::string key = std::to_string(ids[i]);
    ASSERT_TRUE(d.contains(key)) << i;
    EXPECT_NEAR(d[key]["logprob"].get<double>(), echo["choices"][0]["logprobs"]["token_logprobs"][i].get<double>(), 1e-6);
    EXPECT_EQ(d[key]["decoded_token"], tk.token_piece(ids[i]));
    EXPECT_GE(d[key]["rank"].get<int>(), 1);
    EXPECT_LE(d.size(), 3u);  // the token and 2 alternatives (one of them may be it)
    EXPECT_GE(d.size(), 2u);
    for (const auto& [id, e] : d.items()) {
      EXPECT_LE(e["logprob"].get<double>(), 0.0);
      if (e["rank"] == 1) {
        EXPECT_GE(e["logprob"].get<double>(), d[key]["logprob"].get<double>());
      }
    }
  }
  j = post_ok("/v1/chat/completions", {{"messages", json::array({{{"role", "user"}, {"content", "Once upon"}}})},
                                       {"max_tokens", 2}, {"prompt_logprobs", 0}});
  ASSERT_TRUE(j["prompt_logprobs"].is_array());
  EXPECT_TRUE(j["prompt_logprobs"][0].is_null());
  EXPECT_EQ(j["prompt_logprobs"].size(), size_t(j["usage"]["prompt_tokens"].get<int>()));
  EXPECT_EQ(j["prompt_logprobs"][1].size(), 1u);
  // llama.cpp's max_tokens -1 (its web UI's default): as when it is not set (chat: up to the context)
  j = post_ok("/v1/chat/completions", {{"messages", json::array({{{"role", "user"}, {"content", "Once upon"}}})},
                                       {"max_tokens", -1}, {"temperature", 0}, {"ignore_eos", true}});
  EXPECT_EQ(j["usage"]["prompt_tokens"].get<int>() + j["usage"]["completion_tokens"].get<int>(), 256);
  expect_bad("/v1/completions", R"({"prompt": "a", "max_tokens": -2})", "max_tokens");
  j = post_ok("/v1/completions", {{"prompt", "Once upon"}, {"max_tokens", -1}, {"temperature", 0}, {"ignore_eos", true}});
  EXPECT_EQ(j["usage"]["prompt_tokens"].get<int>() + j["usage"]["completion_tokens"].get<int>(), 256);  // not 16
  // neutral settings change nothing (llama.cpp's "off" ranges, SillyTavern's defaults)
  b = base;
  const json neutral = {{"skip_special_tokens", true}, {"typical_p", 1}, {"bad_words", json::array()},
                        {"use_beam_search", false},    {"mirostat", 0},  {"min_tokens", 0},
                        {"top_n_sigma", 0},            {"tfs_z", 1},     {"xtc_probability", 0},
                        {"dry_multiplier", 0},         {"top_a", 0},     {"dynatemp_range", 0},
                        {"include_stop_str_in_output", false}, {"n_probs", 0}};
  for (const auto& [k, v] : neutral.items()) b[k] = v;
  EXPECT_EQ(post_ok("/v1/completions", b)["choices"][0]["text"], text);
  b["logprobs"] = 2;
  b["n_probs"] = 2;  // beside logprobs (as SillyTavern sends them)
  EXPECT_EQ(post_ok("/v1/completions", b)["choices"][0]["text"], text);
}

// A batch of prompts (strings or token ids) in one completions request: choice i belongs to prompt
// i / n; each prompt counts once in usage; echo returns each choice's own prompt; streamed chunks
// carry the same indices. Oversized or mixed batches are 400s.
TEST_F(ServerTest, PromptBatch) {
  const Tokenizer& tk = engine_->tokenizer();
  const std::string a = "Once upon a time", b = "The little dog";
  auto single = [&](const std::string& pr) {
    return post_ok("/v1/completions", {{"prompt", pr}, {"max_tokens", 8}, {"temperature", 0}});
  };
  const json sa = single(a), sb = single(b);
  json j = post_ok("/v1/completions", {{"prompt", {a, b}}, {"max_tokens", 8}, {"temperature", 0}, {"n", 2}});
  ASSERT_EQ(j["choices"].size(), 4u);
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(j["choices"][i]["index"], i);
    EXPECT_EQ(j["choices"][i]["text"], (i < 2 ? sa : sb)["choices"][0]["text"]) << i;
  }
  const int pt = sa["usage"]["prompt_tokens"].get<int>() + sb["usage"]["prompt_tokens"].get<int>();
  EXPECT_EQ(j["usage"]["prompt_tokens"], pt);
  EXPECT_EQ(j["usage"]["completion_tokens"], 32);
  // Token ids, and echo.
  j = post_ok("/v1/completions", {{"prompt", {tk.encode(b, true), tk.encode(a, true)}},
                                  {"max_tokens", 8}, {"temperature", 0}, {"echo", true}});
  ASSERT_EQ(j["choices"].size(), 2u);
  EXPECT_EQ(j["choices"][0]["text"], tk.decode(tk.encode(b, true)) + sb["choices"][0]["text"].get<std::string>());
  EXPECT_EQ(j["choices"][1]["text"], tk.decode(tk.encode(a, true)) + sa["choices"][0]["text"].get<std::string>());
  // Streamed.
  bool done = false;
  const std::vector<json> evs = stream("/v1/completions", {{"prompt", {a, b}}, {"max_tokens", 8}, {"temperature", 0}}, &done);
  EXPECT_TRUE(done);
  for (const auto& e : evs) EXPECT_FALSE(e["choices"].empty());  // no usage chunk unless asked
  const Streamed got = by_choice(evs, 2);
  EXPECT_EQ(got.text[0], sa["choices"][0]["text"]);
  EXPECT_EQ(got.text[1], sb["choices"][0]["text"]);
  EXPECT_EQ(got.finishes, (std::vector<int>{1, 1}));
  // Bad batches.
  expect_bad("/v1/completions", json{{"prompt", json::array({"a", 5})}}.dump(), "prompt");
  expect_bad("/v1/completions", json{{"prompt", json::array({json::array({1, 2}), "a", json::array()})}}.dump(), "prompt");
  expect_bad("/v1/completions", json{{"prompt", std::vector<std::string>(129, "a")}}.dump(), "prompt");
  expect_bad("/v1/completions", json{{"prompt", std::vector<std::string>(128, "a")}, {"n", 9}}.dump(), "n");
}

// /tokenize and /detokenize (vLLM's): the engine's tokens, with and without BOS, through the chat
// template for messages, and back to the text; bad bodies are 400s.
TEST_F(ServerTest, TokenizeDetokenize) {
  const Tokenizer& tk = engine_->tokenizer();
  json j = post_ok("/tokenize", {{"prompt", "Once upon a time"}});
  const std::vector<int32_t> ids = tk.encode("Once upon a time", true);
  EXPECT_EQ(j["tokens"].get<std::vector<int32_t>>(), ids);
  EXPECT_EQ(j["count"], ids.size());
  EXPECT_EQ(j["max_model_len"], engine_->ctx());
  j = post_ok("/tokenize", {{"prompt", "Once upon a time"}, {"add_special_tokens", false}});
  EXPECT_EQ(j["tokens"].get<std::vector<int32_t>>(), tk.encode("Once upon a time", false));
  // Messages: the prompt a chat completion runs (its usage counts the same tokens).
  const json msgs = json::array({{{"role", "user"}, {"content", "Hello there"}}});
  j = post_ok("/tokenize", {{"messages", msgs}});
  EXPECT_EQ(j["count"], post_ok("/v1/chat/completions", {{"messages", msgs}, {"max_tokens", 1}})["usage"]["prompt_tokens"]);
  std::vector<int32_t> no_bos(ids.begin() + (tk.bos() >= 0 ? 1 : 0), ids.end());
  EXPECT_EQ(post_ok("/detokenize", {{"tokens", no_bos}})["prompt"], tk.decode(no_bos));
  expect_bad("/tokenize", "{}", "prompt");
  expect_bad("/tokenize", R"({"prompt": 5})", "prompt");
  expect_bad("/tokenize", R"({"prompt": "a", "add_special_tokens": "no"})", "add_special_tokens");
  expect_bad("/tokenize", "[1]");
  expect_bad("/detokenize", "{}", "tokens");
  expect_bad("/detokenize", R"({"tokens": [1, -2]})", "tokens");
  expect_bad("/detokenize", R"({"tokens": [99999999]})", "tokens");
}

// JSON mode: response_format {"type": "json_object"} makes every completion, plain or streamed,
// chat or not, the start of one JSON object (stories260K, a story model, never writes JSON by
// itself); one that ends by itself ("stop") is a whole object.
TEST_F(ServerTest, JsonObjectResponseFormat) {
  const auto json_prefix = [](const std::string& t) {
    try {
      return json::parse(t).is_object();
    } catch (const json::parse_error& e) {
      return e.byte == t.size() + 1;  // only the end of the text is missing
    }
  };
  int stopped = 0;
  for (int seed = 0; seed < 6; ++seed) {
    json body = {{"prompt", "Once upon a time"}, {"max_tokens", 48}, {"temperature", 1.0}, {"seed", seed},
                 {"response_format", {{"type", "json_object"}}}};
    const json j = post_ok("/v1/completions", body);
    const std::string text = j["choices"][0]["text"];
    SCOPED_TRACE(text);
    ASSERT_FALSE(text.empty());
    EXPECT_TRUE(json_prefix(text));
    if (j["choices"][0]["finish_reason"] == "stop") {
      ++stopped;
      EXPECT_TRUE(json::parse(text).is_object());
    }
    // Streamed: the same text (same seed).
    bool done = false;
    std::string joined;
    for (const auto& e : stream("/v1/completions", body, &done))
      if (e.contains("choices") && !e["choices"].empty()) joined += e["choices"][0].value("text", "");
    EXPECT_TRUE(done);
    EXPECT_EQ(joined, text);
  }
  // Without it the same requests are no JSON at all.
  const json plain = post_ok("/v1/completions", {{"prompt", "Once upon a time"}, {"max_tokens", 16}, {"temperature", 0}});
  EXPECT_FALSE(json_prefix(plain["choices"][0]["text"]));
  const json chat = post_ok("/v1/chat/completions", {{"messages", json::array({{{"role", "user"}, {"content", "hi"}}})},
                                                    {"max_tokens", 32},
                                                    {"temperature", 0},
                                                    {"response_format", {{"type", "json_object"}}}});
  const std::string content = chat["choices"][0]["message"]["content"];
  EXPECT_FALSE(content.empty());
  EXPECT_TRUE(json_prefix(content));
  RecordProperty("stopped", stopped);  // stories rarely close; EngineEos.JsonModeClosesTheObject does
}

// Structured output: response_format {"type": "json_schema"} (OpenAI's form, and llama.cpp's
// "schema" beside the type) makes every completion a document of the schema, its properties in
// the order the request wrote them; a schema kvq cannot generate for is a 400 naming the keyword.
TEST_F(ServerTest, JsonSchemaResponseFormat) {
  const std::string schema =
      R"({"type": "object", "properties": {"z": {"type": "boolean"}, "a": {"type": "integer"},
          "m": {"enum": ["x", "y"]}}, "required": ["z", "a", "m"]})";
  int stopped = 0;
  for (int seed = 0; seed < 4; ++seed) {
    const std::string body = R"({"prompt": "Once upon a time", "max_tokens": 200, "temperature": 1.0, "seed": )" +
                             std::to_string(seed) +
                             R"(, "response_format": {"type": "json_schema", "json_schema": {"name": "t", "strict": true,
                             "schema": )" + schema + "}}}";
    auto c = client();
    auto r = c.Post("/v1/completions", body, "application/json");
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 200) << r->body;
    const json j = json::parse(r->body);
    const std::string text = j["choices"][0]["text"];
    SCOPED_TRACE(text);
    if (j["choices"][0]["finish_reason"] != "stop") continue;  // cut by max_tokens
    ++stopped;
    const nlohmann::ordered_json doc = nlohmann::ordered_json::parse(text);
    ASSERT_TRUE(doc.is_object());
    std::vector<std::string> keys;
    for (auto it = doc.begin(); it != doc.end(); ++it) keys.push_back(it.key());
    EXPECT_EQ(keys, (std::vector<std::string>{"z", "a", "m"}));  // as written, not sorted
    EXPECT_TRUE(doc["z"].is_boolean());
    EXPECT_TRUE(doc["a"].is_number_integer());
    EXPECT_TRUE(doc["m"] == "x" || doc["m"] == "y");
  }
  EXPECT_GE(stopped, 2);  // a tiny story model: whitespace and digits can run long
  // llama.cpp's spelling, on chat, greedy: an array of two short strings.
  const json chat = post_ok("/v1/chat/completions",
                            {{"messages", json::array({{{"role", "user"}, {"content", "hi"}}})},
                             {"max_tokens", 120},
                             {"temperature", 0},
                             {"response_format", {{"type", "json_object"},
                                                  {"schema", {{"type", "array"}, {"minItems", 2}, {"maxItems", 2},
                                                              {"items", {{"type", "string"}, {"maxLength", 3}}}}}}}});
  const std::string content = chat["choices"][0]["message"]["content"];
  SCOPED_TRACE(content);
  ASSERT_EQ(chat["choices"][0]["finish_reason"], "stop");
  const json arr = json::parse(content);
  ASSERT_TRUE(arr.is_array());
  ASSERT_EQ(arr.size(), 2u);
  for (const json& x : arr) EXPECT_LE(x.get<std::string>().size(), 12u);
  // vLLM's guided_choice and guided_json (a schema, or its text), llama.cpp's json_schema.
  for (int seed = 0; seed < 3; ++seed) {
    const json c = post_ok("/v1/completions", {{"prompt", "Once upon a time"}, {"max_tokens", 20}, {"temperature", 1.0},
                                               {"seed", seed}, {"guided_choice", {"happy", "sad", "hungry"}}});
    const std::string t = c["choices"][0]["text"];
    EXPECT_TRUE(t == "happy" || t == "sad" || t == "hungry") << t;
    EXPECT_EQ(c["choices"][0]["finish_reason"], "stop");
  }
  const json array_schema = {{"type", "array"}, {"items", {{"type", "boolean"}}}, {"minItems", 1}, {"maxItems", 2}};
  for (const auto& [key, schema] : {std::pair<std::string, json>{"guided_json", array_schema},
                                    {"guided_json", json(array_schema.dump())},
                                    {"json_schema", array_schema}}) {  // llama.cpp's field
    const json c = post_ok("/v1/completions",
                           {{"prompt", "Once upon a time"}, {"max_tokens", 40}, {"temperature", 0}, {key, schema}});
    const std::string t = c["choices"][0]["text"];
    ASSERT_EQ(c["choices"][0]["finish_reason"], "stop") << t;
    const json v = json::parse(t);
    ASSERT_TRUE(v.is_array()) << t;
    EXPECT_TRUE(v.size() == 1 || v.size() == 2) << t;
    for (const json& x : v) EXPECT_TRUE(x.is_boolean()) << t;
  }
  // A schema's pattern, vLLM's guided_regex and its structured_outputs (regex, choice, json, json_object).
  const std::regex code("[A-Z]{3}-[0-9]{2}");
  for (int seed = 0; seed < 3; ++seed) {
    const json c = post_ok("/v1/completions",
                           {{"prompt", "Once upon a time"}, {"max_tokens", 40}, {"temperature", 1.0}, {"seed", seed},
                            {"response_format", {{"type", "json_schema"},
                                                 {"json_schema", {{"name", "t"},
                                                                  {"schema", {{"type", "object"},
                                                                              {"properties", {{"id", {{"type", "string"}, {"pattern", "^[A-Z]{3}-[0-9]{2}$"}}}}},
                                                                              {"required", {"id"}}}}}}}}});
    const std::string t = c["choices"][0]["text"];
    ASSERT_EQ(c["choices"][0]["finish_reason"], "stop") << t;
    const json v = json::parse(t);
    EXPECT_TRUE(std::regex_match(v["id"].get<std::string>(), code)) << t;
  }
  const std::regex answer("(yes|no), [0-9]{2}");
  const std::string gbnf = "root ::= answer \", \" [0-9]{2}\nanswer ::= \"yes\" | \"no\"\n";
  for (const json& extra : {json{{"guided_regex", "(yes|no), [0-9]{2}"}},
                            json{{"structured_outputs", {{"regex", "(yes|no), [0-9]{2}"}, {"disable_fallback", true}}}},
                            json{{"grammar", gbnf}}, json{{"guided_grammar", gbnf}},
                            json{{"structured_outputs", {{"grammar", gbnf}}}}}) {
    for (int seed = 0; seed < 3; ++seed) {
      json body = {{"prompt", "Once upon a time"}, {"max_tokens", 20}, {"temperature", 1.0}, {"seed", seed}};
      body.update(extra);
      const json c = post_ok("/v1/completions", body);
      const std::string t = c["choices"][0]["text"];
      EXPECT_TRUE(std::regex_match(t, answer)) << t;
      EXPECT_EQ(c["choices"][0]["finish_reason"], "stop") << t;
    }
  }
  {
    // llama.cpp's clients may send an empty grammar for none.
    const json plain = post_ok("/v1/completions", {{"prompt", "Once"}, {"max_tokens", 5}, {"temperature", 0}});
    const json empty = post_ok("/v1/completions", {{"prompt", "Once"}, {"max_tokens", 5}, {"temperature", 0}, {"grammar", ""}});
    EXPECT_EQ(empty["choices"][0]["text"], plain["choices"][0]["text"]);
  }
  {
    const json c = post_ok("/v1/completions", {{"prompt", "Once"}, {"max_tokens", 20}, {"temperature", 1.0},
                                               {"structured_outputs", {{"choice", {"up", "down"}}}}});
    EXPECT_TRUE(c["choices"][0]["text"] == "up" || c["choices"][0]["text"] == "down") << c.dump();
    const json j = post_ok("/v1/completions", {{"prompt", "Once"}, {"max_tokens", 40}, {"temperature", 0},
                                               {"structured_outputs", {{"json", array_schema}}}});
    EXPECT_TRUE(json::parse(j["choices"][0]["text"].get<std::string>()).is_array()) << j.dump();
    const json o = post_ok("/v1/completions", {{"prompt", "Once"}, {"max_tokens", 3}, {"temperature", 0},
                                               {"structured_outputs", {{"json_object", true}}}});
    const std::string ot = o["choices"][0]["text"];
    ASSERT_NE(ot.find_first_not_of(" \t\n"), std::string::npos) << o.dump();
    EXPECT_EQ(ot[ot.find_first_not_of(" \t\n")], '{') << o.dump();
  }
  // Refused schemas.
  const std::string ch = "/v1/chat/completions";
  expect_bad(ch, R"({"messages": [{"role": "user", "content": "hi"}], "guided_choice": []})", "guided_choice");
  expect_bad(ch, R"({"messages": [{"role": "user", "content": "hi"}], "guided_choice": ["a", 1]})", "guided_choice");
  expect_bad(ch, R"({"messages": [{"role": "user", "content": "hi"}], "guided_choice": ["a"], "guided_json": {}})", "guided_json");
  expect_bad(ch, R"({"messages": [{"role": "user", "content": "hi"}], "guided_choice": ["a"],
                 "response_format": {"type": "json_object"}})",
             "guided_choice");
  expect_bad(ch, R"({"messages": [{"role": "user", "content": "hi"}], "guided_json": "{\"type\": \"strng\"}"})", "guided_json");
  expect_bad(ch, R"j({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema",
                 "json_schema": {"name": "t", "schema": {"type": "string", "pattern": "(?=a)"}}}})j",
             "response_format");
  const std::string hi = R"({"messages": [{"role": "user", "content": "hi"}], )";
  expect_bad(ch, hi + R"j("guided_regex": "(a"})j", "guided_regex");
  expect_bad(ch, hi + R"("guided_regex": 5})", "guided_regex");
  expect_bad(ch, hi + R"("structured_outputs": {"regex": "a\\b"}})", "structured_outputs.regex");
  expect_bad(ch, hi + R"("structured_outputs": {"grammar": "root ::= \"a"}})", "structured_outputs.grammar");
  expect_bad(ch, hi + R"("structured_outputs": {"whitespace_pattern": " "}})", "structured_outputs.whitespace_pattern");
  expect_bad(ch, hi + R"("grammar": "root ::= \"a\"", "guided_regex": "a"})", "guided_regex");
  expect_bad(ch, hi + R"("structured_outputs": {"regxe": "a"}})", "structured_outputs.regxe");
  expect_bad(ch, hi + R"("structured_outputs": {"regex": "a", "choice": ["a"]}})", "structured_outputs.choice");
  expect_bad(ch, hi + R"("structured_outputs": {"regex": "a"}, "guided_regex": "a"})", "guided_regex");
  expect_bad(ch, hi + R"("structured_outputs": "a"})", "structured_outputs");
  expect_bad(ch, hi + R"("structured_outputs": {"json_object": true, "disable_any_whitespace": true}})",
             "structured_outputs.disable_any_whitespace");
  expect_bad(ch, hi + R"("structured_outputs": {"json_object": "yes"}})", "structured_outputs.json_object");
  expect_bad(ch, hi + R"("structured_outputs": {"json": {"type": "strng"}}})", "structured_outputs.json");
  expect_bad(ch, R"({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema",
                 "json_schema": {"name": "t"}}})",
             "response_format");
  expect_bad(ch, R"({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema",
                 "json_schema": {"name": "t", "schema": {"$ref": "#/$defs/x"}}}})",
             "response_format");
  auto c = client();
  auto r = c.Post(ch.c_str(), R"({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema",
                 "json_schema": {"name": "t", "schema": {"type": "array", "items": {"type": "string"}, "uniqueItems": true}}}})",
                  "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400);
  EXPECT_NE(r->body.find("'uniqueItems' is supported on arrays whose items are an enum"), std::string::npos) << r->body;
}

TEST_F(ServerTest, ChatPlainAndStreamedAndStop) {
  json body = {{"messages", json::array({{{"role", "user"}, {"content", "Once upon a time"}}})},
               {"max_tokens", 20},
               {"temperature", 0},
               {"seed", 7}};
  json j = post_ok("/v1/chat/completions", body);
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_EQ(j["choices"][0]["message"]["role"], "assistant");
  const std::string content = j["choices"][0]["message"]["content"];
  EXPECT_FALSE(content.empty());
  bool done = false;
  std::vector<json> evs = stream("/v1/chat/completions", body, &done);
  EXPECT_TRUE(done);
  ASSERT_GE(evs.size(), 2u);
  EXPECT_EQ(evs.front()["choices"][0]["delta"]["role"], "assistant");
  std::string joined;
  for (const auto& e : evs)
    if (e["choices"][0]["delta"].contains("content")) joined += e["choices"][0]["delta"]["content"].get<std::string>();
  EXPECT_EQ(joined, content);
  EXPECT_EQ(evs.back()["object"], "chat.completion.chunk");

  // A stop string taken from the greedy output cuts it there.
  const std::string stop = content.substr(content.size() / 2, 3);
  body["stop"] = json::array({stop});
  json s = post_ok("/v1/chat/completions", body);
  EXPECT_EQ(s["choices"][0]["message"]["content"], content.substr(0, content.find(stop)));
  EXPECT_EQ(s["choices"][0]["finish_reason"], "stop");
  body["stop"] = stop;  // a plain string too
  EXPECT_EQ(post_ok("/v1/chat/completions", body)["choices"][0]["message"]["content"], content.substr(0, content.find(stop)));
}

// A request body nested past 512 levels is refused before it is parsed, and the server goes on.
TEST_F(ServerTest, DeeplyNestedBodyIsRefused) {
  const std::string deep = std::string(200000, '[') + "1" + std::string(200000, ']');
  expect_bad("/v1/chat/completions", R"({"messages": [{"role": "user", "content": "x"}], "tools": )" + deep + "}");
  expect_bad("/v1/completions", R"({"prompt": "x", "stop": ")" + std::string(600, '[') + R"(", "x": )" + std::string(600, '{'));
  auto c = client();
  auto r = c.Post("/v1/chat/completions", R"({"tools": )" + deep + "}", "application/json");
  ASSERT_TRUE(r);
  EXPECT_NE(r->body.find("nested deeper than 512 levels"), std::string::npos) << r->body.substr(0, 200);
  // brackets inside strings do not count
  json ok = {{"prompt", "x"}, {"user", std::string(600, '[') + "\\\"" + std::string(600, '{')}, {"max_tokens", 2}};
  EXPECT_EQ(post_ok("/v1/completions", ok)["usage"]["completion_tokens"], 2);
}

// vLLM's continue_final_message: the assistant's last message is continued, as the plain text
// would be (the story model has no template: messages one per line); add_generation_prompt.
TEST_F(ServerTest, ContinueFinalMessage) {
  json body = {{"messages", json::array({{{"role", "user"}, {"content", "Once upon a time"}},
                                         {{"role", "assistant"}, {"content", "there was a little"}}})},
               {"continue_final_message", true},
               {"add_generation_prompt", false},
               {"max_tokens", 16},
               {"temperature", 0}};
  const std::string cont = post_ok("/v1/chat/completions", body)["choices"][0]["message"]["content"];
  json plain = {{"prompt", "Once upon a time\nthere was a little"}, {"max_tokens", 16}, {"temperature", 0}};
  EXPECT_EQ(cont, post_ok("/v1/completions", plain)["choices"][0]["text"].get<std::string>());
  body.erase("add_generation_prompt");  // false is implied
  EXPECT_EQ(post_ok("/v1/chat/completions", body)["choices"][0]["message"]["content"], cont);
  // /tokenize reads them too: the open message has no line end after it
  json tok = body;
  const int open_count = post_ok("/tokenize", tok)["count"];
  tok.erase("continue_final_message");
  EXPECT_EQ(post_ok("/tokenize", tok)["count"].get<int>(), open_count + 1);

  body["add_generation_prompt"] = nullptr;  // null: unset
  EXPECT_EQ(post_ok("/v1/chat/completions", body)["choices"][0]["message"]["content"], cont);
  const std::string two = R"("messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])";
  expect_bad("/v1/chat/completions", "{" + two + R"(, "continue_final_message": true, "response_format": {"type": "json_object"}})",
             "continue_final_message");
  expect_bad("/v1/chat/completions", "{" + two + R"(, "continue_final_message": true, "guided_regex": "a+"})",
             "continue_final_message");
  expect_bad("/v1/chat/completions",
             "{" + two + R"(, "continue_final_message": true, "tools": [{"type": "function", "function": {"name": "f"}}]})",
             "continue_final_message");
  expect_bad("/v1/chat/completions", "{" + two + R"(, "continue_final_message": true, "add_generation_prompt": true})",
             "continue_final_message");
  expect_bad("/v1/chat/completions", R"({"messages": [{"role": "user", "content": "a"}], "continue_final_message": true})",
             "continue_final_message");
  expect_bad("/v1/chat/completions", "{" + two + R"(, "continue_final_message": 1})", "continue_final_message");
  expect_bad("/v1/chat/completions", "{" + two + R"(, "add_generation_prompt": "no"})", "add_generation_prompt");
}

// The same server with a 2048-token context: the tools' prompt is ~500 of the story model's tokens.
class ToolServerTest : public ServerTest {
 protected:
  static void SetUpTestSuite() { start(2048); }
};

// Function calling (server/tools.h): calls whose arguments follow the function's parameters, the
// same streamed as plain, each tool_choice, the response form, conversations with tool results,
// and the 400s.
TEST_F(ToolServerTest, ToolCalls) {
  const json tools = json::parse(R"j([
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
       "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object",
     "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99}, "b": {"type": "integer", "minimum": -99, "maximum": 99}},
     "required": ["a", "b"]}}}])j");
  json body = {{"messages", json::array({{{"role", "user"}, {"content", "Lily"}}})},
               {"tools", tools},
               {"tool_choice", "required"},
               {"parallel_tool_calls", false},
               {"max_tokens", 200},
               {"temperature", 0}};
  // Checks a call against its function: name, and arguments as the parameters say.
  auto check_call = [](const json& c) {
    EXPECT_EQ(c["type"], "function");
    const std::string id = c["id"];
    EXPECT_TRUE(std::regex_match(id, std::regex("call_[A-Za-z0-9]{24}"))) << id;
    const std::string name = c["function"]["name"];
    const json args = json::parse(c["function"]["arguments"].get<std::string>());
    if (name == "get_weather") {
      EXPECT_TRUE(args["city"].is_string() && args["city"].get<std::string>().size() <= 8) << args;
      EXPECT_TRUE(args["days"].is_number_integer() && args["days"] >= 1 && args["days"] <= 7) << args;
    } else {
      EXPECT_EQ(name, "add");
      EXPECT_TRUE(args["a"].is_number_integer() && args["a"] >= -99 && args["a"] <= 99) << args;
      EXPECT_TRUE(args["b"].is_number_integer() && args["b"] >= -99 && args["b"] <= 99) << args;
    }
    return name;
  };
  json j = post_ok("/v1/chat/completions", body);
  const json& ch = j["choices"][0];
  EXPECT_EQ(ch["finish_reason"], "tool_calls") << ch;
  EXPECT_TRUE(ch["message"]["content"].is_null());
  ASSERT_EQ(ch["message"]["tool_calls"].size(), 1u) << ch;
  check_call(ch["message"]["tool_calls"][0]);
  const json first = ch["message"]["tool_calls"][0];

  // Streamed: the same call, whole in one chunk, then the finish.
  bool done = false;
  StreamedReply sr = stream_reply(body, &done);
  EXPECT_TRUE(done);
  const json& streamed_calls = sr.calls;
  const std::string& streamed_content = sr.text;
  std::vector<json> evs = sr.events;
  EXPECT_EQ(streamed_content, "");
  ASSERT_EQ(streamed_calls.size(), 1u);
  EXPECT_EQ(streamed_calls[0]["index"], 0);
  EXPECT_EQ(streamed_calls[0]["function"], first["function"]);
  EXPECT_EQ(streamed_calls[0]["type"], "function");
  EXPECT_TRUE(std::regex_match(streamed_calls[0]["id"].get<std::string>(), std::regex("call_[A-Za-z0-9]{24}")));
  EXPECT_NE(streamed_calls[0]["id"], first["id"]);  // ids are drawn per reply
  EXPECT_EQ(evs.back()["choices"][0]["finish_reason"], "tool_calls");
  // as OpenAI's streams of calls, the first chunk's content is null
  EXPECT_TRUE(evs.front()["choices"][0]["delta"]["content"].is_null());
  EXPECT_EQ(evs.front()["choices"][0]["delta"]["role"], "assistant");

  // n = 2, streamed: each choice's call in its own chunk, indexed within the choice
  json two = body;
  two["n"] = 2;
  two["temperature"] = 1.0;
  two["seed"] = 5;
  evs = stream("/v1/chat/completions", two, &done);
  std::vector<int> calls_of(2, 0), finishes(2, 0);
  for (const json& e : evs) {
    if (e["choices"].empty()) continue;
    const json& c = e["choices"][0];
    const int i = c["index"];
    ASSERT_TRUE(i == 0 || i == 1);
    if (c["delta"].contains("tool_calls")) {
      for (const json& tc : c["delta"]["tool_calls"]) {
        EXPECT_EQ(tc["index"], calls_of[size_t(i)]);
        check_call(tc);
        ++calls_of[size_t(i)];
      }
    }
    if (!c["finish_reason"].is_null()) {
      ++finishes[size_t(i)];
      EXPECT_EQ(c["finish_reason"], "tool_calls");
    }
  }
  EXPECT_EQ(calls_of, std::vector<int>({1, 1}));
  EXPECT_EQ(finishes, std::vector<int>({1, 1}));

  // A named function: a call of it, whatever the model prefers.
  const std::string other = first["function"]["name"] == "add" ? "get_weather" : "add";
  body["tool_choice"] = {{"type", "function"}, {"function", {{"name", other}}}};
  body["parallel_tool_calls"] = true;
  j = post_ok("/v1/chat/completions", body);
  ASSERT_EQ(j["choices"][0]["message"]["tool_calls"].size(), 1u) << j;
  EXPECT_EQ(check_call(j["choices"][0]["message"]["tool_calls"][0]), other);
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");  // OpenAI's for a call forced by name

  // auto, sampled: calls or a response; a response streams as content and equals the plain one.
  body["tool_choice"] = "auto";
  body["parallel_tool_calls"] = false;
  body["temperature"] = 1.0;
  int calls = 0;
  for (int seed = 1; seed <= 12; ++seed) {
    body["seed"] = seed;
    j = post_ok("/v1/chat/completions", body);
    const json& c = j["choices"][0];
    if (c["finish_reason"] == "tool_calls") {
      ++calls;
      check_call(c["message"]["tool_calls"][0]);
      continue;
    }
    EXPECT_FALSE(c["message"].contains("tool_calls"));
    ASSERT_TRUE(c["message"]["content"].is_string());
    evs = stream("/v1/chat/completions", body, &done);
    std::string joined;
    for (const json& e : evs) {
      const json& d = e["choices"][0]["delta"];
      EXPECT_FALSE(d.contains("tool_calls"));
      if (d.contains("content") && d["content"].is_string()) joined += d["content"].get<std::string>();
    }
    EXPECT_EQ(joined, c["message"]["content"].get<std::string>());
  }
  EXPECT_GT(calls, 0);
  // A response, pushed there by a bias on the word's tokens (the story model calls otherwise): its
  // text streams as content, the same as the plain reply's, cut at max_tokens.
  json biased = body;
  biased["max_tokens"] = 60;
  biased["logit_bias"] = json::object();
  const json word = post_ok("/tokenize", {{"prompt", "response"}, {"add_special_tokens", false}});
  ASSERT_FALSE(word["tokens"].empty());
  for (const json& t : word["tokens"]) biased["logit_bias"][std::to_string(t.get<int>())] = 8;
  for (int seed = 1; seed <= 20; ++seed) {  // the first seed whose reply is a response
    biased["seed"] = seed;
    j = post_ok("/v1/chat/completions", biased);
    if (!j["choices"][0]["message"]["content"].is_null() && j["choices"][0]["message"]["content"].get<std::string>().find('{') ==
                                                                 std::string::npos)
      break;
  }
  const json& bc = j["choices"][0];
  EXPECT_EQ(bc["finish_reason"], "length") << j;
  EXPECT_FALSE(bc["message"].contains("tool_calls"));
  const std::string response = bc["message"]["content"];
  EXPECT_FALSE(response.empty());
  EXPECT_EQ(response.find("{"), std::string::npos) << response;  // the text, not the envelope
  evs = stream("/v1/chat/completions", biased, &done);
  std::string joined;
  int pieces = 0;
  for (const json& e : evs)
    if (e["choices"][0]["delta"].contains("content") && e["choices"][0]["delta"]["content"].is_string() &&
        !e["choices"][0]["delta"]["content"].get<std::string>().empty()) {
      joined += e["choices"][0]["delta"]["content"].get<std::string>();
      ++pieces;
    }
  EXPECT_EQ(joined, response);
  EXPECT_GT(pieces, 5);  // as it is generated, not at the end
  EXPECT_EQ(evs.back()["choices"][0]["finish_reason"], "length");

  // tool_choice none: the tools are not offered, the reply is free text (the plain chat's).
  json plain = {{"messages", body["messages"]}, {"max_tokens", 20}, {"temperature", 0}};
  json none = plain;
  none["tools"] = tools;
  none["tool_choice"] = "none";
  EXPECT_EQ(post_ok("/v1/chat/completions", none)["choices"][0]["message"]["content"],
            post_ok("/v1/chat/completions", plain)["choices"][0]["message"]["content"]);

  // response_format's schema for the response, beside the calls
  json rf = body;
  rf["tool_choice"] = "auto";
  rf["temperature"] = 0;
  rf["response_format"] = json::parse(R"j({"type": "json_schema", "json_schema": {"name": "r", "schema":
      {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}})j");
  rf["logit_bias"] = biased["logit_bias"];  // toward the response
  rf["max_tokens"] = 400;
  j = post_ok("/v1/chat/completions", rf);
  ASSERT_EQ(j["choices"][0]["finish_reason"], "stop") << j;
  const json r = json::parse(j["choices"][0]["message"]["content"].get<std::string>());
  EXPECT_TRUE(r.is_object() && r.size() == 1 && r["n"].is_number_integer()) << j;
  // JSON mode's response: any object; cut short (the bias keeps the story model in a key), the
  // object so far, without the reply's wrapper
  rf.erase("response_format");
  rf["response_format"] = {{"type", "json_object"}};
  rf["max_tokens"] = 40;
  j = post_ok("/v1/chat/completions", rf);
  const std::string obj = j["choices"][0]["message"]["content"];
  if (j["choices"][0]["finish_reason"] == "stop") {
    EXPECT_TRUE(json::parse(obj).is_object()) << j;
  } else {
    EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
    EXPECT_EQ(obj.substr(0, 1), "{") << j;
    EXPECT_FALSE(std::regex_search(obj, std::regex(R"(^\{\s*"response"\s*:\s*\{)"))) << j;
  }

  // A conversation with an earlier call and its result; /tokenize counts the tools' prompt.
  json convo = body;
  convo["tool_choice"] = "required";
  convo["temperature"] = 0;
  convo["messages"] = json::parse(R"j([{"role": "user", "content": "Lily"},
    {"role": "assistant", "content": null, "tool_calls": [{"id": "call_x", "type": "function",
      "function": {"name": "add", "arguments": "{\"a\": 1, \"b\": 2}"}}]},
    {"role": "tool", "tool_call_id": "call_x", "content": "3"}])j");
  j = post_ok("/v1/chat/completions", convo);
  EXPECT_EQ(j["choices"][0]["finish_reason"], "tool_calls") << j;
  const int with_tools = post_ok("/tokenize", convo)["count"];
  convo.erase("tools");
  convo.erase("tool_choice");
  convo.erase("parallel_tool_calls");
  const int without = post_ok("/tokenize", convo)["count"];
  EXPECT_GT(with_tools, without + 50);
  EXPECT_EQ(post_ok("/v1/chat/completions", convo)["choices"][0]["message"].count("tool_calls"), 0u);

  // 400s
  const std::string msgs = R"("messages": [{"role": "user", "content": "x"}])";
  const std::string fn = R"({"type": "function", "function": {"name": "f"}})";
  expect_bad("/v1/chat/completions", "{" + msgs + R"(, "tools": [{"type": "function", "function": {"name": "f g"}}]})",
             "tools[0].function.name");
  expect_bad("/v1/chat/completions", "{" + msgs + R"(, "tools": [)" + fn + R"(], "tool_choice": "maybe"})", "tool_choice");
  expect_bad("/v1/chat/completions", "{" + msgs + R"(, "tool_choice": "required"})", "tool_choice");
  expect_bad("/v1/chat/completions",
             "{" + msgs + R"(, "tools": [)" + fn + R"(], "tool_choice": {"type": "function", "function": {"name": "g"}}})",
             "tool_choice");
  expect_bad("/v1/chat/completions", "{" + msgs + R"(, "tools": [)" + fn + R"(], "guided_regex": "a+"})", "guided_regex");
  expect_bad("/v1/chat/completions", "{" + msgs + R"(, "tools": [)" + fn + R"(], "structured_outputs": {"choice": ["a"]}})",
             "structured_outputs.choice");
  expect_bad("/v1/chat/completions", "{" + msgs + R"(, "functions": [{"name": "f"}]})", "functions");
  expect_bad("/v1/chat/completions",
             R"({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}]})",
             "messages[0].tool_calls[0].function.arguments");
  expect_bad("/v1/completions", R"({"prompt": "x", "tools": [)" + fn + "]}", "tools");
  // parameters kvq cannot generate: refused by /tokenize as by the chat route
  const std::string bad_params =
      "{" + msgs + R"(, "tools": [{"type": "function", "function": {"name": "f", "strict": true, "parameters": {"type": "object",
      "properties": {"s": {"type": "string", "uniqueItems": 3}}, "patternProperties": {"^x": {}}}}}]})";
  expect_bad("/v1/chat/completions", bad_params, "tools[0].function.parameters");
  expect_bad("/tokenize", bad_params, "tools[0].function.parameters");
  // ... and a constraint is served beside tools turned off
  const json yn = post_ok("/v1/chat/completions", json::parse("{" + msgs + R"(, "tools": [)" + fn +
                                                               R"(], "tool_choice": "none", "guided_choice": ["yes", "no"], "max_tokens": 5})"));
  const std::string answer = yn["choices"][0]["message"]["content"];
  EXPECT_TRUE(answer == "yes" || answer == "no") << answer;
}

// stories260K with gpt-oss's chat format (harmony): its template named in the metadata (its
// vocabulary has no harmony tokens: the markers are text).
// Two functions with bounded arguments, and a check that a returned call is one of them with
// arguments its parameters accept (returns its name)
static json weather_and_add_tools() {
  return json::parse(R"j([
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
     "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
       "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object",
     "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99}}, "required": ["a"]}}}])j");
}
static std::string check_call(const json& c) {
  EXPECT_EQ(c["type"], "function");
  EXPECT_TRUE(std::regex_match(c["id"].get<std::string>(), std::regex("call_[A-Za-z0-9]{24}"))) << c;
  const std::string name = c["function"]["name"];
  const json args = json::parse(c["function"]["arguments"].get<std::string>());
  if (name == "get_weather") {
    EXPECT_TRUE(args["city"].is_string() && args["city"].get<std::string>().size() <= 8) << args;
    EXPECT_TRUE(args["days"].is_number_integer() && args["days"] >= 1 && args["days"] <= 7) << args;
  } else {
    EXPECT_EQ(name, "add");
    EXPECT_TRUE(args["a"].is_number_integer() && args["a"] >= -99 && args["a"] <= 99) << args;
  }
  return name;
}

class HarmonyServerTest : public ServerTest {
 protected:
  static void SetUpTestSuite() {
    if (!fs::exists(model_path())) return;
    const std::string path = (fs::temp_directory_path() / "kvq_test_stories_harmony.gguf").string();
    auto f = gguf::File::open(model_path());
    kvq::test::GgufWriter w;
    for (const auto& kv : f->metadata()) w.add(kv.key, kv.value);
    w.add_string("tokenizer.chat_template", "{{- '<|start|>system<|message|>' }}{{- '<|channel|>' }}");
    for (const auto& t : f->tensors()) w.add_tensor(t.name, t.type, t.ne, std::vector<uint8_t>(t.data, t.data + t.nbytes));
    w.write(path);
    start(2048, path);
  }
};

// Function calls in gpt-oss's own syntax: the functions declared in the developer message, a call
// forced by tool_choice "required" or by name (opened by the prompt, its arguments those of the
// function's parameters), read back as tool_calls, plain and streamed; a conversation's calls and
// results written as the template writes them; tool_choice "auto" leaves the reply free until a
// call starts; the 400s.
TEST_F(HarmonyServerTest, FunctionCallsInItsOwnSyntax) {
  const json tools = weather_and_add_tools();
  json body = {{"messages", json::array({{{"role", "user"}, {"content", "Lily"}}})},
               {"tools", tools},
               {"tool_choice", "required"},
               {"max_tokens", 60},
               {"temperature", 0}};
  // the prompt: the functions declared, the call opened
  std::string p = prompt_text(body);
  EXPECT_NE(p.find("Calls to these tools must go to the commentary channel: 'functions'.<|end|><|start|>developer<|message|>"
                   "# Tools\n\n## functions\n\nnamespace functions {\n\n// Weather for a city\ntype get_weather = (_: {\n"
                   "city: string,\ndays: number,\n}) => any;\n\n// \ntype add = (_: {\na: number,\n}) => any;\n\n"
                   "} // namespace functions<|end|><|start|>user<|message|>Lily<|end|>"),
            std::string::npos)
      << p;
  EXPECT_TRUE(p.ends_with("<|end|><|start|>assistant to=functions.")) << p;

  json j = post_ok("/v1/chat/completions", body);
  const json& ch = j["choices"][0];
  EXPECT_EQ(ch["finish_reason"], "tool_calls") << ch;
  EXPECT_TRUE(ch["message"]["content"].is_null()) << ch;
  EXPECT_FALSE(ch["message"].contains("reasoning_content")) << ch;
  ASSERT_EQ(ch["message"]["tool_calls"].size(), 1u) << ch;
  const std::string name = check_call(ch["message"]["tool_calls"][0]);
  const json first = ch["message"]["tool_calls"][0];

  bool done = false;
  const StreamedReply sr = stream_reply(body, &done);
  EXPECT_TRUE(done);
  const json& streamed = sr.calls;
  const std::string& text = sr.text;
  const std::vector<json>& evs = sr.events;
  EXPECT_EQ(text, "");
  ASSERT_EQ(streamed.size(), 1u);
  EXPECT_EQ(streamed[0]["index"], 0);
  EXPECT_EQ(streamed[0]["function"], first["function"]);
  EXPECT_EQ(evs.back()["choices"][0]["finish_reason"], "tool_calls");

  // by name: that function, "stop"
  const std::string other = name == "add" ? "get_weather" : "add";
  json named = body;
  named["tool_choice"] = {{"type", "function"}, {"function", {{"name", other}}}};
  j = post_ok("/v1/chat/completions", named);
  ASSERT_EQ(j["choices"][0]["message"]["tool_calls"].size(), 1u) << j;
  EXPECT_EQ(check_call(j["choices"][0]["message"]["tool_calls"][0]), other);
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
  // cut short inside the arguments: the call as far as it went, "length"
  named["max_tokens"] = 3;
  j = post_ok("/v1/chat/completions", named);
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length") << j;

  // auto: the functions declared, the reply free from its start
  json automatic = body;
  automatic["tool_choice"] = "auto";
  p = prompt_text(automatic);
  EXPECT_NE(p.find("namespace functions {"), std::string::npos);
  EXPECT_TRUE(p.ends_with("<|start|>assistant")) << p;
  j = post_ok("/v1/chat/completions", automatic);  // (the story model writes no call: a story)
  EXPECT_FALSE(j["choices"][0]["message"].contains("tool_calls")) << j;
  EXPECT_FALSE(j["choices"][0]["message"]["content"].get<std::string>().empty()) << j;
  // none: still declared (vLLM's default; the prompt, and its cached prefix, is auto's), the reply free
  const std::string auto_prompt = p;
  automatic["tool_choice"] = "none";
  EXPECT_EQ(prompt_text(automatic), auto_prompt);
  j = post_ok("/v1/chat/completions", automatic);
  EXPECT_FALSE(j["choices"][0]["message"].contains("tool_calls")) << j;
  EXPECT_FALSE(j["choices"][0]["message"]["content"].get<std::string>().empty()) << j;
  // without tools: not declared
  json no_tools = automatic;
  no_tools.erase("tools");
  no_tools.erase("tool_choice");
  p = prompt_text(no_tools);
  EXPECT_EQ(p.find("# Tools"), std::string::npos) << p;
  EXPECT_EQ(p.find("Calls to these tools"), std::string::npos) << p;

  // a conversation with a call and its result, given back
  json convo = body;
  convo["tool_choice"] = "auto";
  convo["messages"] = json::parse(R"j([{"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": null, "reasoning_content": "Look it up.",
     "tool_calls": [{"id": "call_x", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\",\"days\":1}"}}]},
    {"role": "tool", "tool_call_id": "call_x", "content": "20 C"}])j");
  p = prompt_text(convo);
  EXPECT_NE(p.find("<|start|>user<|message|>Weather in Paris?<|end|><|start|>assistant<|channel|>analysis<|message|>Look it up."
                   "<|end|><|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": "
                   "\"Paris\", \"days\": 1}<|call|><|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"
                   "\"20 C\"<|end|><|start|>assistant"),
            std::string::npos)
      << p;
  post_ok("/v1/chat/completions", convo);

  // 400s: another constraint beside the tools, parameters kvq cannot generate, a result of no call
  const std::string msgs = R"("messages": [{"role": "user", "content": "a"}])";
  const std::string f = R"("tools": [{"type": "function", "function": {"name": "f"}}])";
  expect_bad("/v1/chat/completions", "{" + msgs + ", " + f + R"(, "guided_regex": "a+"})", "guided_regex");
  expect_bad("/v1/chat/completions",
             "{" + msgs + R"(, "tools": [{"type": "function", "function": {"name": "f", "strict": true, "parameters": {"type": "object", "not": {}}}}]})",
             "tools[0].function.parameters");
  expect_bad("/v1/chat/completions", R"({"messages": [{"role": "user", "content": "a"}, {"role": "tool", "content": "1"}]})",
             "messages[1]");
  // a stop string inside the arguments: the call as far as it went, not a finished call
  json cut = body;  // (required: a whole call would end "tool_calls")
  cut["stop"] = json::array({"{"});
  j = post_ok("/v1/chat/completions", cut);
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop") << j;
  for (const json& e : stream("/v1/chat/completions", cut, &done))
    EXPECT_NE(e["choices"].empty() ? json() : e["choices"][0]["finish_reason"], "tool_calls") << e;
  // with no functions offered, a call the model writes is content (here forced by a choice)
  json none = {{"messages", json::array({{{"role", "user"}, {"content", "hi"}}})},
               {"guided_choice", json::array({"ok<|end|><|start|>assistant to=functions.add<|channel|>commentary json<|message|>{}"})},
               {"max_tokens", 80}};
  for (const json& tc : {json(nullptr), json("none")}) {
    if (!tc.is_null()) {
      none["tools"] = tools;
      none["tool_choice"] = tc;
    }
    j = post_ok("/v1/chat/completions", none);
    EXPECT_FALSE(j["choices"][0]["message"].contains("tool_calls")) << j;
    EXPECT_EQ(j["choices"][0]["message"]["content"], "ok\n{}") << j;
    EXPECT_EQ(j["choices"][0]["finish_reason"], "stop") << j;
  }
  // a forced call needs the generation prompt it opens after; a continued message takes no tools
  json no_prompt = body;
  no_prompt["add_generation_prompt"] = false;
  expect_bad("/v1/chat/completions", no_prompt.dump(), "add_generation_prompt");
  json cont = automatic;
  cont["tool_choice"] = "auto";
  cont["messages"] = json::parse(R"([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}])");
  cont["continue_final_message"] = true;
  cont["add_generation_prompt"] = false;
  cont["response_format"] = {{"type", "json_object"}};
  expect_bad("/v1/chat/completions", cont.dump(), "continue_final_message");
  cont.erase("response_format");
  expect_bad("/v1/chat/completions", cont.dump(), "continue_final_message");
  // the reasoning effort still reaches the system message
  json effort = body;
  effort["reasoning_effort"] = "high";
  EXPECT_NE(prompt_text(effort).find("Reasoning: high"), std::string::npos);
}

// Anthropic's Messages API (server/anthropic.h) against the chat endpoint on the same requests:
// greedy replies, stop reasons, usage (prefix-cache reads), streamed events, a reply's start,
// tool use plain and streamed, count_tokens, and errors in Anthropic's form.
namespace {
std::vector<std::pair<std::string, json>> named_events(const std::string& raw) { return named_sse_events(raw); }
// A streamed message assembled as Anthropic's clients assemble it: its blocks, stop and usage.
json assemble_message(const std::vector<std::pair<std::string, json>>& evs) {
  json m;
  for (const auto& [name, d] : evs) {
    if (name == "message_start") {
      m = d["message"];
    } else if (name == "content_block_start") {
      EXPECT_EQ(d["index"], m["content"].size());
      m["content"].push_back(d["content_block"]);
      if (d["content_block"]["type"] == "tool_use") m["content"].back()["partial"] = "";
    } else if (name == "content_block_delta") {
      json& b = m["content"][d["index"].get<size_t>()];
      const json& delta = d["delta"];
      if (delta["type"] == "text_delta") b["text"] = b["text"].get<std::string>() + delta["text"].get<std::string>();
      else if (delta["type"] == "thinking_delta") b["thinking"] = b["thinking"].get<std::string>() + delta["thinking"].get<std::string>();
      else if (delta["type"] == "input_json_delta") b["partial"] = b["partial"].get<std::string>() + delta["partial_json"].get<std::string>();
      else ADD_FAILURE() << delta;
    } else if (name == "content_block_stop") {
      json& b = m["content"][d["index"].get<size_t>()];
      if (b["type"] == "tool_use") {
        b["input"] = json::parse(b["partial"].get<std::string>());
        b.erase("partial");
      }
    } else if (name == "message_delta") {
      m["stop_reason"] = d["delta"]["stop_reason"];
      m["stop_sequence"] = d["delta"]["stop_sequence"];
      m["usage"] = d["usage"];
    } else if (name != "ping" && name != "message_stop") {
      ADD_FAILURE() << name << " " << d;
    }
  }
  return m;
}
}  // namespace

TEST_F(ToolServerTest, AnthropicMessagesAsChat) {
  auto c = client();
  auto messages_stream = [&](json body) {
    body["stream"] = true;
    auto r = c.Post("/v1/messages", body.dump(), "application/json");
    EXPECT_TRUE(r);
    if (!r) return std::vector<std::pair<std::string, json>>{};
    EXPECT_EQ(r->status, 200) << r->body;
    EXPECT_NE(r->get_header_value("Content-Type").find("text/event-stream"), std::string::npos);
    return named_events(r->body);
  };
  const json user = {{"role", "user"}, {"content", "Lily"}};
  const std::string sys = "Once upon a time there was a little girl named Lily who loved to play in the park with her friends.";
  // A plain reply: the chat endpoint's text, its stop, and usage; the prompt, asked second, read
  // from the prefix cache.
  const json chat = post_ok("/v1/chat/completions",
                            {{"messages", json::array({{{"role", "system"}, {"content", sys}}, user})},
                             {"max_tokens", 24},
                             {"temperature", 0}});
  const json body = {{"model", "stories260K"}, {"max_tokens", 24}, {"temperature", 0},
                     {"system", json::array({{{"type", "text"}, {"text", sys}, {"cache_control", {{"type", "ephemeral"}}}}})},
                     {"messages", json::array({user})}};
  const json m = post_ok("/v1/messages", body);
  EXPECT_TRUE(std::regex_match(m["id"].get<std::string>(), std::regex("msg_[A-Za-z0-9]{24}"))) << m;
  EXPECT_EQ(m["type"], "message");
  EXPECT_EQ(m["role"], "assistant");
  EXPECT_EQ(m["model"], "stories260K");
  const std::string text = chat["choices"][0]["message"]["content"];
  ASSERT_GT(text.size(), 8u);
  ASSERT_EQ(m["content"].size(), 1u) << m;
  EXPECT_EQ(m["content"][0], json({{"type", "text"}, {"text", text}}));
  EXPECT_EQ(m["stop_reason"], chat["choices"][0]["finish_reason"] == "length" ? "max_tokens" : "end_turn");
  EXPECT_TRUE(m["stop_sequence"].is_null());
  const json& u = m["usage"];
  EXPECT_EQ(u["input_tokens"].get<int>() + u["cache_read_input_tokens"].get<int>(), chat["usage"]["prompt_tokens"].get<int>()) << u;
  EXPECT_GE(u["cache_read_input_tokens"].get<int>(), 16) << u;  // at least a page
  EXPECT_EQ(u["cache_creation_input_tokens"], 0);
  EXPECT_EQ(u["output_tokens"], chat["usage"]["completion_tokens"]);
  // count_tokens: the same prompt
  EXPECT_EQ(post_ok("/v1/messages/count_tokens", {{"model", "stories260K"}, {"system", sys},
                                                  {"messages", json::array({user})}})["input_tokens"],
            chat["usage"]["prompt_tokens"]);

  // Streamed: message_start, ping, the text block, message_delta, message_stop; assembled, the same message.
  auto evs = messages_stream(body);
  ASSERT_GE(evs.size(), 6u);
  EXPECT_EQ(evs[0].first, "message_start");
  EXPECT_EQ(evs[1].first, "ping");
  EXPECT_EQ(evs[evs.size() - 2].first, "message_delta");
  EXPECT_EQ(evs.back().first, "message_stop");
  json sm = assemble_message(evs);
  EXPECT_EQ(sm["content"], m["content"]);
  EXPECT_EQ(sm["stop_reason"], m["stop_reason"]);
  EXPECT_EQ(sm["usage"]["output_tokens"], u["output_tokens"]);
  EXPECT_EQ(sm["usage"]["input_tokens"].get<int>() + sm["usage"]["cache_read_input_tokens"].get<int>(),
            chat["usage"]["prompt_tokens"].get<int>());

  // A stop sequence from the reply's middle: the text before its first occurrence, stop_sequence.
  const std::string stop = text.substr(text.size() / 2, 3);
  json sb = body;
  sb["stop_sequences"] = {stop, "never-seen-stop"};
  for (bool streamed : {false, true}) {
    SCOPED_TRACE(streamed);
    const json s = streamed ? assemble_message(messages_stream(sb)) : post_ok("/v1/messages", sb);
    EXPECT_EQ(s["stop_reason"], "stop_sequence") << s;
    EXPECT_EQ(s["stop_sequence"], stop);
    ASSERT_EQ(s["content"].size(), 1u) << s;
    EXPECT_EQ(s["content"][0]["text"], text.substr(0, text.find(stop)));
  }

  // The reply's start: continued as the chat endpoint continues a final message.
  const json start = {{"role", "assistant"}, {"content", "Lily went"}};
  const json cont = post_ok("/v1/chat/completions", {{"messages", json::array({user, start})},
                                                     {"continue_final_message", true},
                                                     {"add_generation_prompt", false},
                                                     {"max_tokens", 12},
                                                     {"temperature", 0}});
  const json pm = post_ok("/v1/messages", {{"max_tokens", 12}, {"temperature", 0}, {"messages", json::array({user, start})}});
  ASSERT_EQ(pm["content"].size(), 1u) << pm;
  EXPECT_EQ(pm["content"][0]["text"], cont["choices"][0]["message"]["content"]);

  // Tool use: the chat endpoint's call (greedy), as a tool_use block with its input; plain and streamed.
  const json tools = json::parse(R"j([{"name": "get_weather", "description": "Weather for a city", "input_schema":
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer",
     "minimum": 1, "maximum": 7}}, "required": ["city", "days"]}},
    {"name": "add", "input_schema": {"type": "object", "properties": {"a": {"type": "integer", "minimum": -99,
     "maximum": 99}}, "required": ["a"]}}])j");
  json chat_tools = json::array();
  for (const json& t : tools)
    chat_tools.push_back({{"type", "function"},
                          {"function", {{"name", t["name"]}, {"parameters", t["input_schema"]}}}});
  chat_tools[0]["function"]["description"] = "Weather for a city";
  int call_tokens = 0;  // the tokens of tool_choice any's call
  for (const auto& [choice, chat_choice] :
       {std::pair{json{{"type", "any"}, {"disable_parallel_tool_use", true}}, json("required")},
        std::pair{json{{"type", "tool"}, {"name", "add"}}, json{{"type", "function"}, {"function", {{"name", "add"}}}}}}) {
    SCOPED_TRACE(choice.dump());
    const json cc = post_ok("/v1/chat/completions", {{"messages", json::array({user})},
                                                     {"tools", chat_tools},
                                                     {"tool_choice", chat_choice},
                                                     {"parallel_tool_calls", false},
                                                     {"max_tokens", 200},
                                                     {"temperature", 0}});
    ASSERT_EQ(cc["choices"][0]["message"]["tool_calls"].size(), 1u) << cc;
    const json& call = cc["choices"][0]["message"]["tool_calls"][0]["function"];
    const json tb = {{"max_tokens", 200}, {"temperature", 0}, {"tools", tools}, {"tool_choice", choice},
                     {"messages", json::array({user})}};
    for (bool streamed : {false, true}) {
      SCOPED_TRACE(streamed);
      const json tm = streamed ? assemble_message(messages_stream(tb)) : post_ok("/v1/messages", tb);
      if (choice["type"] == "any") call_tokens = tm["usage"]["output_tokens"];
      EXPECT_EQ(tm["stop_reason"], "tool_use") << tm;
      ASSERT_EQ(tm["content"].size(), 1u) << tm;
      const json& b = tm["content"][0];
      EXPECT_EQ(b["type"], "tool_use");
      EXPECT_TRUE(std::regex_match(b["id"].get<std::string>(), std::regex("toolu_[A-Za-z0-9]{24}"))) << b;
      EXPECT_EQ(b["name"], call["name"]);
      EXPECT_EQ(b["input"], json::parse(call["arguments"].get<std::string>()));
    }
  }

  // A call cut short by max_tokens: no text block of the reply's JSON (the chat endpoint returns
  // that raw text as content, as documented), stop_reason max_tokens.
  {
    ASSERT_GT(call_tokens, 8);
    const json cut = {{"max_tokens", call_tokens - 3}, {"temperature", 0}, {"tools", tools}, {"tool_choice", {{"type", "any"}}},
                      {"messages", json::array({user})}};
    const json raw = post_ok("/v1/chat/completions", {{"messages", json::array({user})}, {"tools", chat_tools},
                                                      {"tool_choice", "required"}, {"max_tokens", call_tokens - 3}, {"temperature", 0}});
    EXPECT_NE(raw["choices"][0]["message"]["content"].get<std::string>().find("tool_calls"), std::string::npos) << raw;
    for (bool streamed : {false, true}) {
      SCOPED_TRACE(streamed);
      const json cm = streamed ? assemble_message(messages_stream(cut)) : post_ok("/v1/messages", cut);
      EXPECT_EQ(cm["stop_reason"], "max_tokens");
      EXPECT_EQ(cm["content"], json::array()) << cm;
    }
  }

  // A conversation with tool use and results: the chat endpoint's prompt, token for token counted.
  const json conv = json::parse(R"j([{"role": "user", "content": "Lily"},
    {"role": "assistant", "content": [{"type": "text", "text": "Let me see."},
      {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Rome", "days": 2}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"},
      {"type": "text", "text": "And now?"}]}])j");
  const json chat_conv = json::parse(R"j([{"role": "user", "content": "Lily"},
    {"role": "assistant", "content": "Let me see.", "tool_calls": [{"id": "toolu_1", "type": "function",
      "function": {"name": "get_weather", "arguments": "{\"city\":\"Rome\",\"days\":2}"}}]},
    {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny"},
    {"role": "user", "content": "And now?"}])j");
  const json counted = post_ok("/v1/messages/count_tokens", {{"tools", tools}, {"messages", conv}});
  EXPECT_EQ(counted["input_tokens"], post_ok("/tokenize", {{"tools", chat_tools}, {"messages", chat_conv}})["count"]);
  const json cm = post_ok("/v1/messages", {{"tools", tools}, {"messages", conv}, {"max_tokens", 8}});
  EXPECT_EQ(cm["usage"]["input_tokens"].get<int>() + cm["usage"]["cache_read_input_tokens"].get<int>(),
            counted["input_tokens"].get<int>());
}

// OpenAI's Responses API (server/responses.h) against the chat endpoint on the same requests:
// greedy replies, usage, a conversation continued by previous_response_id, what store keeps (GET,
// DELETE), streamed events assembled as the SDK assembles them, function calls and their outputs,
// logprobs, and errors.
TEST_F(ToolServerTest, ResponsesAsChat) {
  auto c = client();
  auto stream_response = [&](json body) {
    body["stream"] = true;
    auto r = c.Post("/v1/responses", body.dump(), "application/json");
    EXPECT_TRUE(r);
    if (!r) return json();
    EXPECT_EQ(r->status, 200) << r->body;
    const auto evs = named_events(r->body);
    // assembled: items added, their deltas, done; the last event's response
    json output = json::array();
    std::vector<std::string> texts;
    json last;
    for (const auto& [name, d] : evs) {
      if (name == "response.output_item.added") {
        EXPECT_EQ(d["output_index"], output.size());
        output.push_back(d["item"]);
        texts.emplace_back();
      } else if (name == "response.output_text.delta" || name == "response.function_call_arguments.delta" ||
                 name == "response.reasoning_text.delta") {
        texts.at(d["output_index"].get<size_t>()) += d["delta"].get<std::string>();
      } else if (name == "response.output_item.done") {
        const size_t k = d["output_index"];
        EXPECT_EQ(d["item"]["id"], output.at(k)["id"]);
        const json& item = d["item"];
        if (item["type"] == "message") {
          EXPECT_EQ(item["content"][0]["text"], texts[k]);
        }
        if (item["type"] == "function_call") {
          EXPECT_EQ(item["arguments"], texts[k]);
        }
        output[k] = item;
      } else if (name == "response.completed" || name == "response.incomplete") {
        last = d["response"];
      }
    }
    EXPECT_FALSE(evs.empty());
    if (evs.empty()) return json();
    EXPECT_EQ(evs[0].first, "response.created");
    EXPECT_EQ(evs[1].first, "response.in_progress");
    EXPECT_EQ(last["output"], output);
    return last;
  };
  auto text_of = [](const json& r) {
    std::string s;
    for (const json& it : r["output"])
      if (it["type"] == "message") s += it["content"][0]["text"].get<std::string>();
    return s;
  };
  const std::string sys = "Once upon a time there was a little girl named Lily who loved to play in the park with her friends.";
  const json chat = post_ok("/v1/chat/completions", {{"messages", json::array({{{"role", "system"}, {"content", sys}},
                                                                               {{"role", "user"}, {"content", "Lily"}}})},
                                                     {"max_tokens", 24},
                                                     {"temperature", 0}});
  const json body = {{"model", "stories260K"}, {"instructions", sys}, {"input", "Lily"}, {"max_output_tokens", 24},
                     {"temperature", 0}, {"metadata", {{"k", "v"}}}};
  const json r = post_ok("/v1/responses", body);
  EXPECT_TRUE(std::regex_match(r["id"].get<std::string>(), std::regex("resp_[A-Za-z0-9]{24}"))) << r;
  EXPECT_EQ(r["object"], "response");
  EXPECT_EQ(r["model"], "stories260K");
  EXPECT_EQ(r["instructions"], sys);
  EXPECT_EQ(r["metadata"], json({{"k", "v"}}));
  EXPECT_EQ(r["temperature"], 0);
  const bool cut = chat["choices"][0]["finish_reason"] == "length";
  EXPECT_EQ(r["status"], cut ? "incomplete" : "completed");
  if (cut) {
    EXPECT_EQ(r["incomplete_details"]["reason"], "max_output_tokens");
  }
  ASSERT_EQ(r["output"].size(), 1u) << r;
  EXPECT_EQ(r["output"][0]["role"], "assistant");
  EXPECT_EQ(text_of(r), chat["choices"][0]["message"]["content"]);
  EXPECT_EQ(r["usage"]["input_tokens"], chat["usage"]["prompt_tokens"]);
  EXPECT_GE(r["usage"]["input_tokens_details"]["cached_tokens"].get<int>(), 16);  // asked second: its pages cached
  EXPECT_EQ(r["usage"]["output_tokens"], chat["usage"]["completion_tokens"]);
  EXPECT_EQ(r["usage"]["total_tokens"], chat["usage"]["total_tokens"]);
  // streamed: the same output
  const json sr = stream_response(body);
  EXPECT_EQ(text_of(sr), text_of(r));
  EXPECT_EQ(sr["status"], r["status"]);
  EXPECT_EQ(sr["usage"]["output_tokens"], r["usage"]["output_tokens"]);

  // kept: GET returns it; continued by previous_response_id as the chat endpoint continues the
  // whole conversation (instructions are the new request's only)
  EXPECT_EQ(post_ok("/v1/responses", body)["store"], true);
  auto g = c.Get(("/v1/responses/" + r["id"].get<std::string>()).c_str());
  ASSERT_TRUE(g);
  ASSERT_EQ(g->status, 200);
  EXPECT_EQ(json::parse(g->body), r);
  const json next = post_ok("/v1/responses", {{"previous_response_id", r["id"]}, {"input", "Tom"}, {"max_output_tokens", 12},
                                              {"temperature", 0}});
  EXPECT_EQ(next["previous_response_id"], r["id"]);
  const json chat2 = post_ok("/v1/chat/completions",
                             {{"messages", json::array({{{"role", "user"}, {"content", "Lily"}},
                                                        {{"role", "assistant"}, {"content", text_of(r)}},
                                                        {{"role", "user"}, {"content", "Tom"}}})},
                              {"max_tokens", 12},
                              {"temperature", 0}});
  EXPECT_EQ(text_of(next), chat2["choices"][0]["message"]["content"]);
  EXPECT_EQ(next["usage"]["input_tokens"], chat2["usage"]["prompt_tokens"]);
  // an item reference: the item kept (r's answer) in its place
  const json referenced = post_ok("/v1/responses", {{"input", json::array({{{"type", "item_reference"}, {"id", r["output"][0]["id"]}},
                                                                          {{"role", "user"}, {"content", "Tom"}}})},
                                                    {"max_output_tokens", 2}});
  const json chat_ref = post_ok("/v1/chat/completions", {{"messages", json::array({{{"role", "assistant"}, {"content", text_of(r)}},
                                                                                   {{"role", "user"}, {"content", "Tom"}}})},
                                                         {"max_tokens", 2}});
  EXPECT_EQ(referenced["usage"]["input_tokens"], chat_ref["usage"]["prompt_tokens"]);
  // (the SDK's ItemReference may leave out its type)
  EXPECT_EQ(post_ok("/v1/responses", {{"input", json::array({{{"id", r["output"][0]["id"]}}, {{"role", "user"}, {"content", "Tom"}}})},
                                      {"max_output_tokens", 2}})["usage"]["input_tokens"],
            chat_ref["usage"]["prompt_tokens"]);
  auto unknown = c.Post("/v1/responses", json{{"input", json::array({{{"type", "item_reference"}, {"id", "msg_nope"}}})}}.dump(),
                        "application/json");
  ASSERT_TRUE(unknown);
  EXPECT_EQ(unknown->status, 400);
  EXPECT_EQ(json::parse(unknown->body)["error"]["param"], "input[0].id");
  // the streamed one is kept by the time its last event is sent
  auto sg = c.Get(("/v1/responses/" + sr["id"].get<std::string>()).c_str());
  ASSERT_TRUE(sg);
  EXPECT_EQ(sg->status, 200);
  EXPECT_EQ(json::parse(sg->body), sr);
  // its input items, listed as the API lists them (newest first by default; limit, after)
  const json three = post_ok("/v1/responses", {{"input", json::array({{{"role", "user"}, {"content", "a"}},
                                                                      {{"role", "assistant"}, {"content", "b"}},
                                                                      {{"role", "user"}, {"content", "c"}}})},
                                               {"max_output_tokens", 2}});
  auto list = [&](const std::string& query) {
    auto l = c.Get(("/v1/responses/" + three["id"].get<std::string>() + "/input_items" + query).c_str());
    EXPECT_TRUE(l);
    if (!l) return json();
    EXPECT_EQ(l->status, 200) << l->body;
    const json j = json::parse(l->body);
    EXPECT_EQ(j["object"], "list");
    std::string contents;
    for (const json& it : j["data"]) {
      EXPECT_TRUE(std::regex_match(it["id"].get<std::string>(), std::regex("msg_[A-Za-z0-9]{24}"))) << it;
      EXPECT_EQ(it["type"], "message");  // (in the API's form: typed, parts, a status)
      EXPECT_EQ(it["status"], "completed");
      EXPECT_EQ(it["content"][0]["type"], it["role"] == "assistant" ? "output_text" : "input_text");
      contents += it["content"][0]["text"].get<std::string>();
    }
    return json{{"contents", contents}, {"has_more", j["has_more"]}, {"first", j["first_id"]}, {"data", j["data"]}};
  };
  EXPECT_EQ(list("")["contents"], "cba");
  const json asc2 = list("?order=asc&limit=2");
  EXPECT_EQ(asc2["contents"], "ab");
  EXPECT_EQ(asc2["has_more"], true);
  EXPECT_EQ(list("?order=asc&after=" + asc2["first"].get<std::string>())["contents"], "bc");
  EXPECT_EQ(list("?order=asc&after=" + asc2["first"].get<std::string>())["has_more"], false);
  const json all_desc = list("");  // c, b, a
  EXPECT_EQ(list("?limit=1&before=" + all_desc["data"][2]["id"].get<std::string>())["contents"], "b");  // just before a
  auto badl = c.Get(("/v1/responses/" + three["id"].get<std::string>() + "/input_items?limit=0").c_str());
  ASSERT_TRUE(badl);
  EXPECT_EQ(badl->status, 400);
  // a chain: the next one continues both
  const json third = post_ok("/v1/responses", {{"previous_response_id", next["id"]}, {"input", "Sue"}, {"max_output_tokens", 4}});
  EXPECT_GT(third["usage"]["input_tokens"].get<int>(), next["usage"]["input_tokens"].get<int>());
  // deleted: gone; store false: never kept
  auto d = c.Delete(("/v1/responses/" + r["id"].get<std::string>()).c_str());
  ASSERT_TRUE(d);
  EXPECT_EQ(d->status, 200);
  EXPECT_EQ(json::parse(d->body), json({{"id", r["id"]}, {"object", "response"}, {"deleted", true}}));
  // (r's answer is still held by the response that referred to it)
  EXPECT_EQ(post_ok("/v1/responses", {{"input", json::array({{{"type", "item_reference"}, {"id", r["output"][0]["id"]}},
                                                             {{"role", "user"}, {"content", "Tom"}}})},
                                      {"max_output_tokens", 2}})["usage"]["input_tokens"],
            referenced["usage"]["input_tokens"]);

  for (const std::string& id : {r["id"].get<std::string>(), post_ok("/v1/responses", {{"input", "Lily"}, {"store", false},
                                                                                        {"max_output_tokens", 2}})["id"]
                                                                 .get<std::string>()}) {
    auto gone = c.Get(("/v1/responses/" + id).c_str());
    ASSERT_TRUE(gone);
    EXPECT_EQ(gone->status, 404) << id;
    auto p = c.Post("/v1/responses", json{{"previous_response_id", id}, {"input", "x"}}.dump(), "application/json");
    ASSERT_TRUE(p);
    EXPECT_EQ(p->status, 400);  // (OpenAI's)
    EXPECT_EQ(json::parse(p->body)["error"]["code"], "previous_response_not_found");
  }

  // function calls: the chat endpoint's call (greedy), plain and streamed; its output continues it
  const json tools = json::parse(R"j([{"type": "function", "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer",
     "minimum": 1, "maximum": 7}}, "required": ["city", "days"]}}])j");
  const json chat_tools = json::parse(R"j([{"type": "function", "function": {"name": "get_weather", "description":
    "Weather for a city", "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
    "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["city", "days"]}}}])j");
  const json cc = post_ok("/v1/chat/completions", {{"messages", json::array({{{"role", "user"}, {"content", "Lily"}}})},
                                                   {"tools", chat_tools}, {"tool_choice", "required"},
                                                   {"parallel_tool_calls", false}, {"max_tokens", 200}, {"temperature", 0}});
  const json& call = cc["choices"][0]["message"]["tool_calls"][0]["function"];
  const json tb = {{"input", "Lily"}, {"tools", tools}, {"tool_choice", "required"}, {"parallel_tool_calls", false},
                   {"max_output_tokens", 200}, {"temperature", 0}};
  json fc;
  for (bool streamed : {false, true}) {
    SCOPED_TRACE(streamed);
    const json tr = streamed ? stream_response(tb) : post_ok("/v1/responses", tb);
    EXPECT_EQ(tr["status"], "completed");
    ASSERT_EQ(tr["output"].size(), 1u) << tr;
    const json& item = tr["output"][0];
    EXPECT_EQ(item["type"], "function_call");
    EXPECT_TRUE(std::regex_match(item["call_id"].get<std::string>(), std::regex("call_[A-Za-z0-9]{24}"))) << item;
    EXPECT_EQ(item["name"], call["name"]);
    EXPECT_EQ(item["arguments"], call["arguments"]);
    if (!streamed) fc = tr;
  }
  const json out_item = {{"type", "function_call_output"}, {"call_id", fc["output"][0]["call_id"]}, {"output", "Sunny"}};
  const json cont = post_ok("/v1/responses", {{"previous_response_id", fc["id"]}, {"input", json::array({out_item})},
                                              {"tools", tools}, {"max_output_tokens", 8}});
  const json chat_cont = json::array({{{"role", "user"}, {"content", "Lily"}},
                                      {{"role", "assistant"}, {"content", nullptr},
                                       {"tool_calls", json::array({{{"id", fc["output"][0]["call_id"]}, {"type", "function"},
                                                                    {"function", call}}})}},
                                      {{"role", "tool"}, {"tool_call_id", fc["output"][0]["call_id"]}, {"content", "Sunny"}}});
  EXPECT_EQ(cont["usage"]["input_tokens"],
            post_ok("/tokenize", {{"tools", chat_tools}, {"messages", chat_cont}})["count"]);

  // logprobs: the chat endpoint's
  const json lr = post_ok("/v1/responses", {{"input", "Lily"}, {"max_output_tokens", 4}, {"temperature", 0},
                                            {"top_logprobs", 2}, {"include", {"message.output_text.logprobs"}}});
  const json lc = post_ok("/v1/chat/completions", {{"messages", json::array({{{"role", "user"}, {"content", "Lily"}}})},
                                                   {"max_tokens", 4}, {"temperature", 0}, {"logprobs", true}, {"top_logprobs", 2}});
  EXPECT_EQ(lr["output"][0]["content"][0]["logprobs"], lc["choices"][0]["logprobs"]["content"]);
  EXPECT_EQ(lr["output"][0]["content"][0]["logprobs"].size(), 4u);

  // errors: OpenAI's form, the field named
  for (const auto& [b, param] : std::vector<std::pair<json, std::string>>{
           {{{"input", "x"}, {"tools", json::array({{{"type", "web_search"}}})}, {"tool_choice", {{"type", "web_search"}}}}, "tool_choice"},
           {{{"input", "x"}, {"store", "no"}}, "store"},
           // the request's own tool index and field (the hosted tool before it is not offered)
           {{{"input", "x"}, {"tools", json::parse(R"j([{"type": "web_search"}, {"type": "function", "name": "f", "strict": true,
              "parameters": {"type": "object", "not": {}}}])j")}}, "tools[1].parameters"},
           {{{"input", "x"}, {"reasoning", {{"effort", "low"}}}}, "reasoning.effort"},  // no reasoning: not gpt-oss
           {{{"input", "x"}, {"stop", "y"}}, "stop"},
           {{{"input", json::array({{{"role", "user"}, {"content", json::array({{{"type", "input_image"}}})}}})}}, "input[0].content[0]"},
           {{{"input", "x"}, {"max_output_tokens", 5000}}, "max_output_tokens"}}) {
    SCOPED_TRACE(b.dump());
    auto e = c.Post("/v1/responses", b.dump(), "application/json");
    ASSERT_TRUE(e);
    EXPECT_EQ(e->status, 400) << e->body;
    const json j = json::parse(e->body);
    EXPECT_EQ(j["error"]["type"], "invalid_request_error");
    EXPECT_EQ(j["error"]["param"], param);
  }
  auto m = c.Post("/v1/responses", json{{"model", "gpt-5"}, {"input", "x"}}.dump(), "application/json");
  ASSERT_TRUE(m);
  EXPECT_EQ(m->status, 404);
}

// Errors in Anthropic's form ({"type": "error", "error": {"type", "message"}}) with their statuses;
// the server serves on.
TEST_F(ServerTest, AnthropicErrors) {
  auto c = client();
  auto expect_error = [&](const httplib::Result& r, int status, const std::string& type, const std::string& what) {
    SCOPED_TRACE(what);
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, status) << r->body;
    const json j = json::parse(r->body, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << r->body;
    EXPECT_EQ(j["type"], "error") << j;
    EXPECT_EQ(j["error"]["type"], type) << j;
    EXPECT_TRUE(j["error"]["message"].is_string() && !j["error"]["message"].get<std::string>().empty()) << j;
  };
  const std::string user = R"j("messages": [{"role": "user", "content": "Once"}])j";
  for (const std::string& body : std::vector<std::string>{std::string("{"), std::string("[]"), "{" + user + "}", R"j({"max_tokens": 4, "messages": [{"role": "user",
         "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}]}]})j",
        R"j({"max_tokens": 4, "seed": 3, )j" + user + "}", R"j({"max_tokens": 4, "temperature": 2, )j" + user + "}",
        // a model without reasoning has no effort
        R"j({"max_tokens": 4, "output_config": {"effort": "high"}, )j" + user + "}",
        R"j({"max_tokens": 4, "tools": [{"type": "text_editor_20250728", "name": "str_replace_based_edit_tool"}], )j" + user + "}"})
    expect_error(c.Post("/v1/messages", body, "application/json"), 400, "invalid_request_error", body);
  // beyond the context (256 tokens): Anthropic's words, which its clients read (Claude Code retries
  // with the max_tokens that fits)
  auto r = c.Post("/v1/messages", R"j({"max_tokens": 400, )j" + user + "}", "application/json");
  expect_error(r, 400, "invalid_request_error", "max_tokens beyond the context");
  const int n_prompt = post_ok("/v1/messages/count_tokens", json::parse("{" + user + "}"))["input_tokens"];
  EXPECT_EQ(json::parse(r->body)["error"]["message"],
            fmt::format("input length and `max_tokens` exceed context limit: {} + 400 > 256, decrease input length or "
                        "`max_tokens` and try again",
                        n_prompt));
  std::string long_text;
  for (int k = 0; k < 300; ++k) long_text += "Once upon a time ";
  r = c.Post("/v1/messages", json{{"max_tokens", 4}, {"messages", json::array({{{"role", "user"}, {"content", long_text}}})}}.dump(),
             "application/json");
  expect_error(r, 400, "invalid_request_error", "a prompt beyond the context");
  EXPECT_TRUE(std::regex_match(json::parse(r->body)["error"]["message"].get<std::string>(),
                               std::regex("prompt is too long: [0-9]+ tokens > 256 maximum")))
      << r->body;
  // a strict tool whose schema kvq cannot generate: named as the Messages API names it
  r = c.Post("/v1/messages", R"j({"max_tokens": 4, "tools": [{"name": "f", "strict": true, "input_schema": {"type": "object",
    "not": {}}}], )j" + user + "}", "application/json");
  expect_error(r, 400, "invalid_request_error", "a strict tool kvq cannot generate");
  EXPECT_NE(json::parse(r->body)["error"]["message"].get<std::string>().find("'tools[0].input_schema'"), std::string::npos) << r->body;
  expect_error(c.Post("/v1/messages/count_tokens", R"j({"max_tokens": 4, )j" + user + "}", "application/json"), 400,
               "invalid_request_error", "count_tokens with max_tokens");
  expect_error(c.Post("/v1/messages", R"j({"model": "claude-x", "max_tokens": 4, )j" + user + "}", "application/json"), 404,
               "not_found_error", "another model");
  expect_error(c.Get("/v1/messages"), 405, "invalid_request_error", "GET");
  expect_error(c.Post("/v1/messages/batches", "{}", "application/json"), 404, "not_found_error", "batches");
  const json ok = post_ok("/v1/messages", json::parse(R"j({"max_tokens": 4, "temperature": 0, )j" + user + "}"));
  EXPECT_EQ(ok["usage"]["output_tokens"], 4);
  EXPECT_EQ(ok["stop_reason"], "max_tokens");
}

// Anthropic's Messages API on a harmony (gpt-oss) template: a call forced by name in gpt-oss's own
// syntax comes back as a tool_use block, plain and streamed alike; the effort and an earlier turn's
// thinking reach the prompt as the chat endpoint's reasoning_effort and reasoning_content do.
TEST_F(HarmonyServerTest, AnthropicToolUseThinkingAndEffort) {
  const json tools = json::parse(R"j([{"name": "get_weather", "description": "Weather for a city", "input_schema":
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer",
     "minimum": 1, "maximum": 7}}, "required": ["city", "days"]}}])j");
  const json body = {{"max_tokens", 60}, {"temperature", 0}, {"tools", tools},
                     {"tool_choice", {{"type", "tool"}, {"name", "get_weather"}}},
                     {"messages", json::array({{{"role", "user"}, {"content", "Lily"}}})}};
  const json m = post_ok("/v1/messages", body);
  EXPECT_EQ(m["stop_reason"], "tool_use") << m;
  ASSERT_EQ(m["content"].size(), 1u) << m;
  const json& b = m["content"][0];
  EXPECT_EQ(b["type"], "tool_use");
  EXPECT_EQ(b["name"], "get_weather");
  EXPECT_TRUE(b["input"]["city"].is_string() && b["input"]["city"].get<std::string>().size() <= 8) << b;
  EXPECT_TRUE(b["input"]["days"].is_number_integer() && b["input"]["days"] >= 1 && b["input"]["days"] <= 7) << b;
  json sbody = body;
  sbody["stream"] = true;
  auto c = client();
  auto r = c.Post("/v1/messages", sbody.dump(), "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json sm = assemble_message(named_events(r->body));
  EXPECT_EQ(sm["stop_reason"], "tool_use");
  ASSERT_EQ(sm["content"].size(), 1u) << sm;
  EXPECT_EQ(sm["content"][0]["input"], b["input"]);

  // an earlier call with its thinking, and the effort
  const json conv = json::parse(R"j([{"role": "user", "content": "Lily"},
    {"role": "assistant", "content": [{"type": "thinking", "thinking": "Look it up.", "signature": ""},
      {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Rome", "days": 2}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"}]}])j");
  const json chat_conv = json::parse(R"j([{"role": "user", "content": "Lily"},
    {"role": "assistant", "content": null, "reasoning_content": "Look it up.", "tool_calls": [{"id": "toolu_1",
      "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Rome\",\"days\":2}"}}]},
    {"role": "tool", "tool_call_id": "toolu_1", "content": "Sunny"}])j");
  json chat_tools = json::array({{{"type", "function"},
                                  {"function", {{"name", "get_weather"}, {"description", "Weather for a city"},
                                                {"parameters", tools[0]["input_schema"]}}}}});
  const std::string chat_prompt = prompt_text({{"tools", chat_tools}, {"messages", chat_conv}, {"reasoning_effort", "low"}});
  EXPECT_NE(chat_prompt.find("Reasoning: low"), std::string::npos) << chat_prompt;
  EXPECT_NE(chat_prompt.find("Look it up."), std::string::npos) << chat_prompt;
  const json counted = post_ok("/v1/messages/count_tokens",
                               {{"tools", tools}, {"messages", conv}, {"output_config", {{"effort", "low"}}}});
  EXPECT_EQ(counted["input_tokens"],
            post_ok("/tokenize", {{"tools", chat_tools}, {"messages", chat_conv}, {"reasoning_effort", "low"}})["count"]);
  // (without the thinking, fewer tokens: it is in the prompt)
  json no_thinking = conv;
  no_thinking[1]["content"].erase(0);
  EXPECT_LT(post_ok("/v1/messages/count_tokens", {{"tools", tools}, {"messages", no_thinking}, {"output_config", {{"effort", "low"}}}})["input_tokens"],
            counted["input_tokens"]);
  const json em = post_ok("/v1/messages", {{"max_tokens", 4}, {"output_config", {{"effort", "low"}}},
                                           {"messages", json::array({{{"role", "user"}, {"content", "Lily"}}})}});
  EXPECT_EQ(em["usage"]["output_tokens"], 4);
}

// usage.prompt_tokens_details.cached_tokens: the prompt tokens the prefix cache held; a prompt seen
// for the first time has none, asked again its whole pages; n choices of one prompt count it once;
// streamed with include_usage alike.
TEST_F(ServerTest, UsageCountsCachedPromptTokens) {
  const std::string prompt =
      "Zebras and pelicans argued about the purple moon over a bowl of cold soup while the clock struck thirteen again";
  json body = {{"prompt", prompt}, {"max_tokens", 2}, {"temperature", 0}};
  const json first = post_ok("/v1/completions", body);
  const int n_prompt = first["usage"]["prompt_tokens"];
  ASSERT_GT(n_prompt, 20);
  EXPECT_EQ(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0) << first["usage"];
  const json again = post_ok("/v1/completions", body);
  const int cached = again["usage"]["prompt_tokens_details"]["cached_tokens"];
  EXPECT_GE(cached, 16) << again["usage"];
  EXPECT_LT(cached, n_prompt);  // (the last token is always computed: its logits give the first token)
  EXPECT_EQ(cached % 16, 0);    // whole pages
  body["n"] = 3;
  const json three = post_ok("/v1/completions", body);
  EXPECT_EQ(three["usage"]["prompt_tokens"], n_prompt);
  EXPECT_EQ(three["usage"]["prompt_tokens_details"]["cached_tokens"], cached);
  body.erase("n");
  body["stream_options"] = {{"include_usage", true}};
  bool done = false;
  const std::vector<json> evs = stream("/v1/completions", body, &done);
  ASSERT_FALSE(evs.empty());
  EXPECT_EQ(evs.back()["usage"]["prompt_tokens_details"]["cached_tokens"], cached) << evs.back();
  // a batch of two prompts: the new one's none, the known one's pages
  json batch = {{"prompt", {prompt, "A completely different beginning about seventeen orange kites and a ferry"}},
                {"max_tokens", 2},
                {"temperature", 0}};
  EXPECT_EQ(post_ok("/v1/completions", batch)["usage"]["prompt_tokens_details"]["cached_tokens"], cached);
}

TEST_F(ServerTest, ConcurrentRequests) {
  std::vector<std::thread> ts;
  std::vector<std::string> got(6);
  for (int i = 0; i < 6; ++i)
    ts.emplace_back([&, i] {
      auto c = client();
      json b = {{"prompt", "Lily and Tom went to the park. They saw a " + std::string(i % 2 ? "dog" : "cat")},
                {"max_tokens", 16},
                {"temperature", 0}};
      auto r = c.Post("/v1/completions", b.dump(), "application/json");
      if (r && r->status == 200) got[size_t(i)] = json::parse(r->body)["choices"][0]["text"];
    });
  for (auto& t : ts) t.join();
  for (int i = 2; i < 6; ++i) EXPECT_EQ(got[size_t(i)], got[size_t(i % 2)]);
  EXPECT_FALSE(got[0].empty());
}

TEST_F(ServerTest, BadInputIs400AndServerKeepsServing) {
  const std::string c = "/v1/completions", ch = "/v1/chat/completions";
  expect_bad(c, "{not json");
  expect_bad(c, "[1, 2]");
  expect_bad(c, std::string(R"({"prompt": "a", "max_tokens": 2})") + std::string(1, '\0') + "garbage");
  // Completions bodies and the parameter each one's error names.
  const std::pair<const char*, const char*> bad[] = {
      {R"({"max_tokens": 4})", "prompt"},
      {R"({"prompt": 5})", "prompt"},
      {R"({"prompt": "a", "max_tokens": "4"})", "max_tokens"},
      {R"({"prompt": "a", "max_tokens": 0})", "max_tokens"},
      {R"({"prompt": "a", "max_tokens": 100000})", "max_tokens"},
      {R"({"prompt": "a", "temperature": "hot"})", "temperature"},
      {R"({"prompt": "a", "temperature": 5})", "temperature"},
      {R"({"prompt": "a", "top_p": 0})", "top_p"},
      {R"({"prompt": "a", "top_p": 1e-300})", "top_p"},  // > 0 as a double, 0 as the sampler's float
      {R"({"prompt": "a", "repetition_penalty": 1e-300})", "repetition_penalty"},
      {R"({"prompt": "a", "top_k": 4294967297})", "top_k"},  // would wrap to 1 as an int
      {R"({"prompt": "a", "top_k": -2})", "top_k"},
      {R"({"prompt": "a", "logit_bias": {" 5": 1}})", "logit_bias"},
      {R"({"prompt": "a", "logit_bias": {"+5": 1}})", "logit_bias"},
      {R"({"prompt": "a", "stream": true, "stream_options": 5})", "stream_options"},
      {R"({"prompt": "a", "stream": true, "stream_options": {"include_usage": "yes"}})", "stream_options"},
      {R"({"prompt": "a", "stop": 3})", "stop"},
      {R"({"prompt": "a", "stop": ["x", 3]})", "stop"},
      {R"({"prompt": "a", "seed": 1.5})", "seed"},
      {R"({"prompt": "a", "stream": "yes"})", "stream"},
      {R"({"prompt": "a", "presence_penalty": 3})", "presence_penalty"},
      {R"({"prompt": "a", "frequency_penalty": "x"})", "frequency_penalty"},
      {R"({"prompt": "a", "repetition_penalty": 0})", "repetition_penalty"},
      {R"({"prompt": "a", "min_p": 2})", "min_p"},
      {R"({"prompt": "a", "logit_bias": [1]})", "logit_bias"},
      {R"({"prompt": "a", "logit_bias": {"abc": 1}})", "logit_bias"},
      {R"({"prompt": "a", "logit_bias": {"5": 200}})", "logit_bias"},
      {R"({"prompt": "a", "logit_bias": {"5": "up"}})", "logit_bias"},
      {R"({"prompt": "a", "logit_bias": {"99999999": 1}})", "logit_bias"},
      {R"({"prompt": "a", "ignore_eos": "yes"})", "ignore_eos"},
      {R"({"prompt": "a", "stop_token_ids": 5})", "stop_token_ids"},
      {R"({"prompt": "a", "stop_token_ids": [-1]})", "stop_token_ids"},
      {R"({"prompt": "a", "stop_token_ids": [99999999]})", "stop_token_ids"},
      {R"({"prompt": "a", "min_tokens": -1})", "min_tokens"},
      {R"({"prompt": "a", "min_tokens": 1.5})", "min_tokens"},
      {R"({"prompt": "a", "min_tokens": 17})", "min_tokens"},  // more than the default max_tokens 16
      {R"({"prompt": "a", "max_tokens": 4, "min_tokens": 5})", "min_tokens"},
      {R"({"prompt": "a", "include_stop_str_in_output": 1})", "include_stop_str_in_output"},
      {R"({"prompt": "a", "allowed_token_ids": []})", "allowed_token_ids"},
      {R"({"prompt": "a", "allowed_token_ids": [-3]})", "allowed_token_ids"},
      {R"({"prompt": "a", "allowed_token_ids": [99999999]})", "allowed_token_ids"},
      {R"({"prompt": "a", "truncate_prompt_tokens": 0})", "truncate_prompt_tokens"},
      {R"({"prompt": "a", "truncate_prompt_tokens": -2})", "truncate_prompt_tokens"},
      {R"({"prompt": "a", "skip_special_tokens": false})", "skip_special_tokens"},
      {R"({"prompt": "a", "typical_p": 0.9})", "typical_p"},
      {R"({"prompt": "a", "bad_words": ["x"]})", "bad_words"},
      {R"({"prompt": "a", "prompt_logprobs": 21})", "prompt_logprobs"},
      {R"({"prompt": "a", "prompt_logprobs": 1, "stream": true})", "prompt_logprobs"},
      {R"({"prompt": "a", "use_beam_search": true})", "use_beam_search"},
      {R"({"prompt": "a", "mirostat": 2})", "mirostat"},
      {R"({"prompt": "a", "n": 0})", "n"},
      {R"({"prompt": "a", "n": 129})", "n"},
      {R"({"prompt": "a", "n": "2"})", "n"},
      {R"({"prompt": "a", "n": 1.5})", "n"},
      // generation features kvq does not implement: refused, never silently dropped
      {R"({"prompt": "a", "suffix": "end"})", "suffix"},
      {R"({"prompt": "a", "best_of": 3})", "best_of"},
      {R"({"prompt": "a", "guided_grammar": "root ::= x"})", "guided_grammar"},
      {R"({"prompt": "a", "grammar": "root ::= (\"a\"?)*"})", "grammar"},
      {R"({"prompt": "a", "grammar": 3})", "grammar"},
  };
  for (const auto& [b, param] : bad) expect_bad(c, b, param);
  // Chat's unsupported features.
  expect_bad(ch, R"({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema"}})",
             "response_format");
  expect_bad(ch, R"({"messages": [{"role": "user", "content": "hi"}], "response_format": "json"})", "response_format");
  expect_bad(ch, R"({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": 1}})",
             "response_format");
  expect_bad(ch, R"({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]})", "tools[0].function");
  expect_bad(ch, R"({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto"})", "tool_choice");
  // a priority without priority scheduling (vLLM's rule), or not an integer; 0 passes
  expect_bad(ch, R"({"messages": [{"role": "user", "content": "hi"}], "priority": 1})", "priority");
  expect_bad(c, R"({"prompt": "hi", "priority": "high"})", "priority");
  post_ok(c, {{"prompt", "a"}, {"max_tokens", 1}, {"priority", 0}});
  // a reasoning effort for a model whose template has none (gpt-oss's harmony has one)
  expect_bad(ch, R"({"messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "low"})", "reasoning_effort");
  // ... while their neutral values and metadata pass.
  post_ok(ch, {{"messages", json::array({{{"role", "user"}, {"content", "hi"}}})},
               {"max_tokens", 2},
               {"response_format", {{"type", "text"}}},
               {"tools", json::array()},
               {"tool_choice", "none"},
               {"user", "someone"}});
  post_ok(c, {{"prompt", "a"}, {"max_tokens", 2}, {"best_of", 1}, {"suffix", ""}});
  std::string long_prompt;
  for (int i = 0; i < 300; ++i) long_prompt += "the cat sat. ";
  expect_bad(c, json{{"prompt", long_prompt}}.dump(), "prompt");
  expect_bad(ch, R"({"max_tokens": 4})", "messages");
  expect_bad(ch, R"({"messages": []})", "messages");
  expect_bad(ch, R"({"messages": "hi"})", "messages");
  expect_bad(ch, R"({"messages": [{"content": "hi"}]})", "messages[0].role");
  expect_bad(ch, R"({"messages": [{"role": "wizard", "content": "hi"}]})", "messages[0].role");
  expect_bad(ch, R"({"messages": [{"role": "user", "content": 3}]})", "messages[0].content");

  // A request for another model is refused with OpenAI's 404 model_not_found; this one's name passes.
  for (const auto& [path, body] :
       {std::pair{c, json{{"model", "gpt-4o"}, {"prompt", "a"}, {"max_tokens", 2}}},
        std::pair{ch, json{{"model", "no-such-model"}, {"messages", json::array({{{"role", "user"}, {"content", "hi"}}})}}}}) {
    auto cm = client();
    auto rm = cm.Post(path.c_str(), body.dump(), "application/json");
    ASSERT_TRUE(rm);
    EXPECT_EQ(rm->status, 404) << rm->body;
    const json e = json::parse(rm->body);
    EXPECT_EQ(e["error"]["code"], "model_not_found");
    EXPECT_EQ(e["error"]["param"], "model");
  }
  post_ok(c, {{"model", "stories260K"}, {"prompt", "a"}, {"max_tokens", 2}});
  {  // an out-of-range max_tokens names the range
    auto cm = client();
    auto rm = cm.Post(c.c_str(), R"({"prompt": "a", "max_tokens": 99999999999})", "application/json");
    ASSERT_TRUE(rm);
    EXPECT_EQ(rm->status, 400);
    EXPECT_NE(json::parse(rm->body)["error"]["message"].get<std::string>().find("between 1 and"), std::string::npos)
        << rm->body;
  }

  {  // echo with max_tokens 0 and no logprobs: the prompt back, as OpenAI's API
    const json e = post_ok(c, {{"prompt", "Once upon"}, {"max_tokens", 0}, {"echo", true}});
    EXPECT_EQ(e["choices"][0]["text"], "Once upon");
    EXPECT_EQ(e["usage"]["completion_tokens"], 0);
  }

  auto cl = client();
  // A route asked with the other method: 405 naming the one it takes.
  auto expect_405 = [](const httplib::Result& rr) {
    ASSERT_TRUE(rr);
    EXPECT_EQ(rr->status, 405) << rr->body;
    EXPECT_EQ(json::parse(rr->body)["error"]["code"], "method_not_allowed");
    EXPECT_FALSE(rr->get_header_value("Allow").empty());
  };
  expect_405(cl.Get(c.c_str()));
  expect_405(cl.Get("/tokenize"));
  expect_405(cl.Post("/v1/models", "{}", "application/json"));
  expect_405(cl.Delete("/v1/chat/completions"));
  auto r = cl.Get("/v1/nothing");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 404);
  EXPECT_TRUE(json::parse(r->body).contains("error"));
  r = cl.Post("/v1/unknown", "{}", "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 404);
  // Still serving.
  json j = post_ok(c, {{"prompt", "Hi"}, {"max_tokens", 2}});
  EXPECT_EQ(j["usage"]["completion_tokens"].get<int>() <= 2, true);
}

// logprobs: greedy tokens are their distribution's most likely; the log-probabilities the decode
// steps report equal those the prompt-scoring path (echo, every row of a prefill) computes for the
// same tokens; a second scoring request (whose prompt pages are cached) gives the same numbers.
TEST_F(ServerTest, LogprobsDecodeAndEchoAgree) {
  const std::string prompt = "Once upon a time, there was a little";
  json j = post_ok("/v1/completions", {{"prompt", prompt}, {"max_tokens", 8}, {"temperature", 0}, {"logprobs", 3}});
  const json& lp = j["choices"][0]["logprobs"];
  ASSERT_TRUE(lp.is_object()) << j.dump();
  const int n_gen = j["usage"]["completion_tokens"];
  ASSERT_EQ(n_gen, 8);
  ASSERT_EQ(lp["tokens"].size(), 8u);
  ASSERT_EQ(lp["token_logprobs"].size(), 8u);
  ASSERT_EQ(lp["top_logprobs"].size(), 8u);
  std::string joined;
  for (int i = 0; i < n_gen; ++i) {
    const double l = lp["token_logprobs"][i];
    EXPECT_LE(l, 0.0);
    double best = -1e30;
    for (const auto& [k, v] : lp["top_logprobs"][i].items()) best = std::max(best, v.get<double>());
    EXPECT_GE(lp["top_logprobs"][i].size(), 1u);
    EXPECT_LE(lp["top_logprobs"][i].size(), 3u);
    EXPECT_NEAR(l, best, 1e-6) << "greedy token " << i << " is not its distribution's most likely";
    EXPECT_EQ(lp["text_offset"][i].get<size_t>(), joined.size());
    joined += lp["tokens"][i].get<std::string>();
  }
  const std::string text = j["choices"][0]["text"];
  EXPECT_TRUE(joined == text || joined == " " + text) << joined << " | " << text;

  // Score prompt + the generated tokens (as token ids): echo, logprobs, max_tokens 0.
  std::vector<int32_t> ids = engine_->tokenizer().encode(prompt, true);
  const size_t n_prompt = ids.size();
  GenParams gp;
  gp.sampling.temperature = 0;
  gp.max_tokens = 8;
  const GenResult direct = engine_->generate(ids, gp);
  ASSERT_EQ(direct.tokens.size(), 8u);
  ids.insert(ids.end(), direct.tokens.begin(), direct.tokens.end());
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE(round);
    json e = post_ok("/v1/completions",
                     {{"prompt", ids}, {"max_tokens", 0}, {"echo", true}, {"logprobs", 1}, {"temperature", 0}});
    const json& el = e["choices"][0]["logprobs"];
    EXPECT_EQ(e["usage"]["completion_tokens"], 0);
    EXPECT_EQ(e["choices"][0]["finish_reason"], "length");
    ASSERT_EQ(el["token_logprobs"].size(), ids.size());
    EXPECT_TRUE(el["token_logprobs"][0].is_null());
    EXPECT_TRUE(el["top_logprobs"][0].is_null());
    for (size_t i = 1; i < ids.size(); ++i) EXPECT_LE(el["token_logprobs"][i].get<double>(), 0.0);
    for (int i = 0; i < n_gen; ++i)
      EXPECT_NEAR(el["token_logprobs"][n_prompt + size_t(i)].get<double>(), lp["token_logprobs"][i].get<double>(), 2e-3)
          << "token " << i;
    EXPECT_EQ(e["choices"][0]["text"], engine_->tokenizer().decode(ids));
    // the echoed tokens spell the text, each at its text_offset (the SentencePiece space before
    // the text is not in it)
    std::string spelled;
    for (size_t i = 0; i < ids.size(); ++i) {
      EXPECT_EQ(el["text_offset"][i].get<size_t>(), spelled.size()) << i;
      spelled += el["tokens"][i].get<std::string>();
    }
    EXPECT_EQ(spelled, e["choices"][0]["text"]);
  }
  json e = post_ok("/v1/completions", {{"prompt", prompt}, {"max_tokens", 3}, {"echo", true}, {"logprobs", 0}, {"temperature", 0}});
  const std::string echoed = e["choices"][0]["text"];
  ASSERT_EQ(echoed.rfind(prompt, 0), 0u);
  const json& offs = e["choices"][0]["logprobs"]["text_offset"];
  const json& toks = e["choices"][0]["logprobs"]["tokens"];
  for (size_t i = 0; i < toks.size(); ++i)
    EXPECT_EQ(echoed.compare(offs[i].get<size_t>(), toks[i].get<std::string>().size(), toks[i].get<std::string>()), 0) << i;
}

TEST_F(ServerTest, ChatLogprobsAndTokenPrompts) {
  json j = post_ok("/v1/chat/completions", {{"messages", json::array({{{"role", "user"}, {"content", "Once upon"}}})},
                                            {"max_tokens", 5}, {"temperature", 0}, {"logprobs", true},
                                            {"top_logprobs", 2}});
  const json& c = j["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(c.size(), size_t(j["usage"]["completion_tokens"].get<int>()));
  for (const auto& e : c) {
    std::string b;
    for (const auto& x : e["bytes"]) b += char(x.get<int>());
    EXPECT_EQ(b, e["token"].get<std::string>());
    ASSERT_EQ(e["top_logprobs"].size(), 2u);
    EXPECT_NEAR(e["logprob"].get<double>(), e["top_logprobs"][0]["logprob"].get<double>(), 1e-6);
    EXPECT_GE(e["top_logprobs"][0]["logprob"].get<double>(), e["top_logprobs"][1]["logprob"].get<double>());
  }
  // Without logprobs the field stays null.
  j = post_ok("/v1/chat/completions", {{"messages", json::array({{{"role", "user"}, {"content", "Hi"}}})}, {"max_tokens", 2}});
  EXPECT_TRUE(j["choices"][0]["logprobs"].is_null());

  // A prompt of token ids (and a batch of one) completes as its text does.
  const std::vector<int32_t> ids = engine_->tokenizer().encode("Once upon a time", true);
  const json a = post_ok("/v1/completions", {{"prompt", "Once upon a time"}, {"max_tokens", 6}, {"temperature", 0}});
  const json b = post_ok("/v1/completions", {{"prompt", ids}, {"max_tokens", 6}, {"temperature", 0}});
  const json d = post_ok("/v1/completions", {{"prompt", json::array({ids})}, {"max_tokens", 6}, {"temperature", 0}});
  EXPECT_EQ(a["choices"][0]["text"], b["choices"][0]["text"]);
  EXPECT_EQ(a["choices"][0]["text"], d["choices"][0]["text"]);
  // echo without logprobs: the prompt's text, then the completion.
  const json e = post_ok("/v1/completions", {{"prompt", "Once upon a time"}, {"max_tokens", 6}, {"temperature", 0}, {"echo", true}});
  EXPECT_EQ(e["choices"][0]["text"], "Once upon a time" + a["choices"][0]["text"].get<std::string>());

  const std::string cp = "/v1/completions", ch = "/v1/chat/completions";
  expect_bad(cp, R"({"prompt": "a", "logprobs": 21})", "logprobs");
  expect_bad(cp, R"({"prompt": "a", "logprobs": -1})", "logprobs");
  expect_bad(cp, R"({"prompt": "a", "echo": true, "stream": true})", "echo");
  expect_bad(cp, R"({"prompt": "a", "echo": "yes"})", "echo");
  expect_bad(cp, R"({"prompt": [1, 99999]})", "prompt");
  expect_bad(cp, R"({"prompt": [1, -2]})", "prompt");
  expect_bad(cp, R"({"prompt": []})", "prompt");
  expect_bad(cp, R"({"prompt": [1, 2.5]})", "prompt");
  expect_bad(ch, R"({"messages": [{"role": "user", "content": "a"}], "logprobs": "yes"})", "logprobs");
  expect_bad(ch, R"({"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2})", "top_logprobs");
  expect_bad(ch, R"({"messages": [{"role": "user", "content": "a"}], "logprobs": true, "top_logprobs": 30})", "top_logprobs");
}

// Streamed, the chunks' logprobs put together are the plain response's, token for token.
TEST_F(ServerTest, StreamedLogprobsEqualPlain) {
  json body = {{"prompt", "Once upon a time"}, {"max_tokens", 12}, {"temperature", 0}, {"logprobs", 2}};
  const json plain = post_ok("/v1/completions", body)["choices"][0]["logprobs"];
  bool done = false;
  std::vector<json> evs = stream("/v1/completions", body, &done);
  EXPECT_TRUE(done);
  json tokens = json::array(), lps = json::array(), offs = json::array(), tops = json::array();
  for (const auto& e : evs) {
    if (e["choices"].empty() || e["choices"][0]["logprobs"].is_null()) continue;
    const json& l = e["choices"][0]["logprobs"];
    for (size_t i = 0; i < l["tokens"].size(); ++i) {
      tokens.push_back(l["tokens"][i]);
      lps.push_back(l["token_logprobs"][i]);
      offs.push_back(l["text_offset"][i]);
      tops.push_back(l["top_logprobs"][i]);
    }
  }
  EXPECT_EQ(tokens, plain["tokens"]);
  EXPECT_EQ(lps, plain["token_logprobs"]);
  EXPECT_EQ(offs, plain["text_offset"]);
  EXPECT_EQ(tops, plain["top_logprobs"]);
  EXPECT_EQ(tokens.size(), 12u);

  json cbody = {{"messages", json::array({{{"role", "user"}, {"content", "Once upon"}}})},
                {"max_tokens", 8}, {"temperature", 0}, {"logprobs", true}, {"top_logprobs", 1}};
  const json cplain = post_ok("/v1/chat/completions", cbody)["choices"][0]["logprobs"]["content"];
  evs = stream("/v1/chat/completions", cbody, &done);
  EXPECT_TRUE(done);
  json content = json::array();
  for (const auto& e : evs)
    if (!e["choices"].empty() && !e["choices"][0]["logprobs"].is_null())
      for (const auto& x : e["choices"][0]["logprobs"]["content"]) content.push_back(x);
  EXPECT_EQ(content, cplain);
  EXPECT_FALSE(content.empty());
}

TEST_F(ServerTest, ModelsHealthMetrics) {
  auto c = client();
  auto r = c.Get("/health");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  r = c.Get("/v1/models");
  ASSERT_TRUE(r);
  json m = json::parse(r->body);
  EXPECT_EQ(m["object"], "list");
  EXPECT_EQ(m["data"][0]["id"], "stories260K");
  // Two requests with a shared prefix of several pages, so the prefix cache is hit.
  std::string prefix;
  for (int i = 0; i < 6; ++i) prefix += "Lily had a red ball and a blue hat. ";
  const uint64_t decode_steps0 = engine_->metrics().decode_step.count;
  post_ok("/v1/completions", {{"prompt", prefix + "She"}, {"max_tokens", 4}, {"temperature", 0}});
  post_ok("/v1/completions", {{"prompt", prefix + "He"}, {"max_tokens", 4}, {"temperature", 0}});
  r = c.Get("/metrics");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  const std::string t = r->body;
  for (const char* name :
       {"kvq_time_to_first_token_seconds_bucket{le=\"+Inf\"}", "kvq_time_to_first_token_seconds_count",
        "kvq_time_per_output_token_seconds_sum", "kvq_requests_running 0", "kvq_requests_waiting 0",
        "kvq_kv_cache_usage_ratio 0", "kvq_kv_cache_tokens_capacity 4096", "kvq_prefix_cache_queries_total",
        "kvq_prefix_cache_hits_total", "kvq_preemptions_total", "# TYPE kvq_time_to_first_token_seconds histogram",
        "# TYPE kvq_e2e_request_latency_seconds histogram", "kvq_e2e_request_latency_seconds_count",
        "# TYPE kvq_request_queue_time_seconds histogram", "kvq_request_queue_time_seconds_bucket{le=\"+Inf\"}",
        "# TYPE kvq_decode_step_seconds histogram"})
    EXPECT_NE(t.find(name), std::string::npos) << name << "\n" << t;
  const EngineMetrics em = engine_->metrics();
  EXPECT_GT(em.prefix_hit_tokens, 0u);
  EXPECT_NE(t.find(fmt::format("kvq_prefix_cache_hits_total {}", em.prefix_hit_tokens)), std::string::npos);
  EXPECT_NE(t.find(fmt::format("kvq_e2e_request_latency_seconds_count {}", em.e2e.count)), std::string::npos);
  EXPECT_GE(em.e2e.count, 2u);
  // One after the other, each request's 3 tokens after its first come from steps that decode
  // (its prompt steps are not counted).
  EXPECT_EQ(em.decode_step.count - decode_steps0, 6u);
  EXPECT_NE(t.find(fmt::format("kvq_decode_step_seconds_count {}", em.decode_step.count)), std::string::npos);
}

// A KV pool smaller than the context: a request whose prompt + max_tokens outgrows the whole pool
// could never finish, so it is refused up front (not cut short with "length"); one that fits runs
// to its max_tokens, and a request without max_tokens is capped by the pool.
TEST(ServerSmallPool, RequestsLargerThanThePoolAreRefused) {
  if (!fs::exists(model_path())) GTEST_SKIP() << "stories260K.gguf not found at " << model_path();
  Engine engine(one_thread_options(64));
  ASSERT_LT(engine.pool().tokens_capacity(), size_t(engine.ctx()));
  const int cap = int(engine.pool().tokens_capacity());
  ServerOnThread srv(engine, loopback_options());
  httplib::Client cl("127.0.0.1", srv.port);
  cl.set_read_timeout(60, 0);
  const json prompt = json::array({1, 400, 401, 402});  // 4 tokens
  auto post = [&](const json& body) { return cl.Post("/v1/completions", body.dump(), "application/json"); };
  auto r = post({{"prompt", prompt}, {"max_tokens", cap - 3}, {"ignore_eos", true}});
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400) << r->body;
  if (r->status == 400) {
    const json e = json::parse(r->body);
    EXPECT_EQ(e["error"]["code"], "context_length_exceeded");
    EXPECT_EQ(e["error"]["param"], "max_tokens");
  }
  r = post({{"prompt", prompt}, {"max_tokens", cap - 4}, {"ignore_eos", true}, {"temperature", 0}});
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  json j = json::parse(r->body);
  EXPECT_EQ(j["usage"]["completion_tokens"], cap - 4);
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  r = cl.Post("/v1/chat/completions",
              json{{"messages", json::array({{{"role", "user"}, {"content", "hi"}}})}, {"ignore_eos", true}}.dump(),
              "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  j = json::parse(r->body);
  EXPECT_EQ(j["usage"]["prompt_tokens"].get<int>() + j["usage"]["completion_tokens"].get<int>(), cap);
}

// The Responses API's background mode: answered at once ("queued", kept), run on and read back by
// GET (the output the same request gives in the foreground); a response still running is not
// continued; cancelled (POST .../cancel: its object, "cancelled"; one that finished is returned as
// it is; a foreground one refused); DELETE ends a running one; bad combinations refused.
TEST(ServerResponses, BackgroundRunsOnAndIsCancelled) {
  if (!fs::exists(model_path())) GTEST_SKIP() << "stories260K.gguf not found at " << model_path();
  EngineOptions o = one_thread_options(4096);
  o.autostart = false;  // the background requests wait until the engine starts
  Engine engine(o);
  ServerOnThread srv(engine, loopback_options());
  httplib::Client c("127.0.0.1", srv.port);
  c.set_read_timeout(60, 0);
  auto call = [&](const char* method, const std::string& path, const json& body = nullptr) {
    auto r = std::string(method) == "GET"      ? c.Get(path.c_str())
             : std::string(method) == "DELETE" ? c.Delete(path.c_str())
                                               : c.Post(path.c_str(), body.is_null() ? "" : body.dump(), "application/json");
    EXPECT_TRUE(r);
    return r ? std::pair{r->status, json::parse(r->body, nullptr, false)} : std::pair{0, json()};
  };
  const json body = {{"input", "Lily"}, {"max_output_tokens", 24}, {"temperature", 0}, {"background", true}};
  auto [st, a] = call("POST", "/v1/responses", body);
  ASSERT_EQ(st, 200) << a;
  EXPECT_EQ(a["status"], "queued");
  EXPECT_EQ(a["background"], true);
  EXPECT_EQ(a["output"], json::array());
  const std::string aid = a["id"];
  EXPECT_EQ(call("GET", "/v1/responses/" + aid).second["status"], "queued");
  // not continued while it runs
  auto [st2, e2] = call("POST", "/v1/responses", {{"previous_response_id", aid}, {"input", "Tom"}});
  EXPECT_EQ(st2, 400);
  EXPECT_EQ(e2["error"]["param"], "previous_response_id") << e2;
  // another, cancelled before the engine runs it
  const json b = call("POST", "/v1/responses", body).second;
  const std::string bid = b["id"];
  std::pair<int, json> cancelled;
  std::thread canceller([&] { cancelled = call("POST", "/v1/responses/" + bid + "/cancel"); });
  for (int i = 0; i < 200 && engine.metrics().requests_cancelled == 0; ++i) {
    if (i == 20) engine.start();  // (the cancel is told first, then the engine sees it)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  canceller.join();
  EXPECT_EQ(cancelled.first, 200) << cancelled.second;
  EXPECT_EQ(cancelled.second["status"], "cancelled") << cancelled.second;
  EXPECT_EQ(call("GET", "/v1/responses/" + bid).second["status"], "cancelled");
  // the first runs to its end: the foreground request's output
  json done;
  for (int i = 0; i < 3000; ++i) {
    done = call("GET", "/v1/responses/" + aid).second;
    if (done["status"] != "queued" && done["status"] != "in_progress") break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  json fg_body = body;
  fg_body.erase("background");
  const json fg = call("POST", "/v1/responses", fg_body).second;
  EXPECT_EQ(done["status"], fg["status"]) << done;
  ASSERT_EQ(done["output"].size(), 1u) << done;
  EXPECT_EQ(done["output"][0]["content"], fg["output"][0]["content"]);
  EXPECT_EQ(done["usage"]["output_tokens"], fg["usage"]["output_tokens"]);
  EXPECT_EQ(done["background"], true);
  // now continued; cancelling a finished one returns it as it is; a foreground one is refused
  EXPECT_EQ(call("POST", "/v1/responses", {{"previous_response_id", aid}, {"input", "Tom"}, {"max_output_tokens", 2}}).first, 200);
  EXPECT_EQ(call("POST", "/v1/responses/" + aid + "/cancel").second, done);
  auto [st3, e3] = call("POST", "/v1/responses/" + fg["id"].get<std::string>() + "/cancel");
  EXPECT_EQ(st3, 400) << e3;
  EXPECT_EQ(call("POST", "/v1/responses/resp_nope/cancel").first, 404);
  // DELETE ends a running one (or deletes it once done)
  json long_body = body;
  long_body["max_output_tokens"] = 200;
  const std::string cid = call("POST", "/v1/responses", long_body).second["id"];
  EXPECT_EQ(call("DELETE", "/v1/responses/" + cid).second["deleted"], true);
  EXPECT_EQ(call("GET", "/v1/responses/" + cid).first, 404);
  // refused: without store, with stream, not a boolean; GET as a stream
  for (const auto& [key, value] : {std::pair{"store", json(false)}, std::pair{"stream", json(true)}, std::pair{"background", json("yes")}}) {
    json bad = body;
    bad[key] = value;
    auto [sb, eb] = call("POST", "/v1/responses", bad);
    EXPECT_EQ(sb, 400) << key;
    EXPECT_EQ(eb["error"]["param"], "background") << eb;
  }
  EXPECT_EQ(call("GET", "/v1/responses/" + aid + "?stream=true").first, 400);
  // logprobs of tokens that are part of a character (byte tokens) are kept too (as U+FFFD in text)
  const json cjk = {{"input", "Lily"}, {"max_output_tokens", 24}, {"background", true}, {"top_logprobs", 1},
                    {"include", {"message.output_text.logprobs"}},
                    {"text", {{"format", {{"type", "json_schema"}, {"name", "w"}, {"schema", {{"enum", {"中文"}}}}}}}}};
  const std::string did = call("POST", "/v1/responses", cjk).second["id"];
  json d;
  for (int i = 0; i < 3000; ++i) {
    d = call("GET", "/v1/responses/" + did).second;
    if (d["status"] != "queued" && d["status"] != "in_progress") break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(d["status"], "completed") << d;
  EXPECT_EQ(d["output"][0]["content"][0]["text"], "\"中文\"") << d;
  // the input items keep their ids from queued to done
  const json q = call("POST", "/v1/responses", body).second;
  const json items_queued = call("GET", "/v1/responses/" + q["id"].get<std::string>() + "/input_items").second;
  for (int i = 0; i < 3000; ++i) {
    const json st_q = call("GET", "/v1/responses/" + q["id"].get<std::string>()).second["status"];
    if (st_q != "queued" && st_q != "in_progress") break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(call("GET", "/v1/responses/" + q["id"].get<std::string>() + "/input_items").second, items_queued);
  engine.wait_idle();
  EXPECT_EQ(engine.pool().n_used(), 0u);
}

// Shutting down (SIGTERM): requests in flight end at once, a plain one answered 503 and a stream
// closed with an error event and [DONE]; later requests are refused; nothing stays allocated.
TEST(ServerShutdown, InFlightRequestsEndWithAnAnswer) {
  if (!fs::exists(model_path())) GTEST_SKIP() << "stories260K.gguf not found at " << model_path();
  EngineOptions o = one_thread_options(1024);
  o.autostart = false;  // the requests queue until the engine starts: still in flight at shutdown
  Engine engine(o);
  ServerOnThread srv(engine, loopback_options());
  auto post = [&](const json& body) {
    httplib::Client cl("127.0.0.1", srv.port);
    cl.set_read_timeout(30, 0);
    return cl.Post("/v1/completions", body.dump(), "application/json");
  };
  std::optional<httplib::Result> plain, streamed;
  std::thread t1([&] { plain.emplace(post({{"prompt", "Once upon a time"}, {"max_tokens", 100}})); });
  std::thread t2([&] { streamed.emplace(post({{"prompt", "Once upon a time"}, {"max_tokens", 100}, {"stream", true}})); });
  for (int i = 0; i < 500 && engine.metrics().waiting < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_EQ(engine.metrics().waiting, 2);
  engine.abort_all("the server is shutting down");
  engine.start();
  t1.join();
  t2.join();
  ASSERT_TRUE(plain && *plain);
  EXPECT_EQ((*plain)->status, 503) << (*plain)->body;
  EXPECT_NE((*plain)->body.find("shutting down"), std::string::npos) << (*plain)->body;
  ASSERT_TRUE(streamed && *streamed);
  const std::string& sb = (*streamed)->body;
  EXPECT_EQ((*streamed)->status, 200);
  EXPECT_NE(sb.find("\"error\""), std::string::npos) << sb;
  EXPECT_NE(sb.find("shutting down"), std::string::npos) << sb;
  EXPECT_EQ(sb.rfind("data: [DONE]\n\n"), sb.size() - 14) << sb;
  auto later = post({{"prompt", "Hi"}, {"max_tokens", 2}});
  ASSERT_TRUE(later);
  EXPECT_EQ(later->status, 503) << later->body;
  engine.wait_idle();
  EXPECT_EQ(engine.pool().n_used(), 0u);
  srv.server.shutdown(1.0);  // returns at once: nothing is left to end
}

TEST(ServerApiKey, Matches) {
  EXPECT_TRUE(api_key_matches("Bearer s3cret", "", "s3cret"));
  EXPECT_TRUE(api_key_matches("bearer s3cret", "", "s3cret"));
  EXPECT_TRUE(api_key_matches("", "s3cret", "s3cret"));
  EXPECT_TRUE(api_key_matches("Bearer wrong", "s3cret", "s3cret"));
  EXPECT_FALSE(api_key_matches("", "", "s3cret"));
  EXPECT_FALSE(api_key_matches("Bearer s3cre", "", "s3cret"));
  EXPECT_FALSE(api_key_matches("Bearer s3cret2", "", "s3cret"));
  EXPECT_FALSE(api_key_matches("Bearer S3cret", "", "s3cret"));
  EXPECT_FALSE(api_key_matches("s3cret", "", "s3cret"));         // no scheme
  EXPECT_FALSE(api_key_matches("Basic s3cret", "", "s3cret"));
  EXPECT_FALSE(api_key_matches("Bearer ", "", "s3cret"));
  EXPECT_FALSE(api_key_matches("Bearer  s3cret", "", "s3cret"));  // the key as sent, not trimmed
}

// With an API key every route but /health and /metrics answers 401 invalid_api_key without it or
// with a wrong one, and serves as before with it.
TEST(ServerApiKey, RoutesNeedTheKey) {
  if (!fs::exists(model_path())) GTEST_SKIP() << "stories260K.gguf not found at " << model_path();
  Engine engine(one_thread_options(1024));
  ServerOptions so = loopback_options();
  so.api_key = "s3cret";
  ServerOnThread srv(engine, so);
  const int port = srv.port;
  httplib::Client cl("127.0.0.1", port);
  cl.set_read_timeout(60, 0);
  const std::string body = json{{"prompt", "Once upon a time"}, {"max_tokens", 4}, {"temperature", 0}}.dump();
  auto expect_401 = [&](const httplib::Result& r, const std::string& what) {
    SCOPED_TRACE(what);
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 401) << r->body;
    EXPECT_EQ(r->get_header_value("WWW-Authenticate"), "Bearer");
    const json e = json::parse(r->body);
    EXPECT_EQ(e["error"]["code"], "invalid_api_key");
    EXPECT_EQ(e["error"]["type"], "invalid_request_error");
  };
  expect_401(cl.Post("/v1/completions", body, "application/json"), "completions, no key");
  expect_401(cl.Get("/v1/models"), "models, no key");
  expect_401(cl.Post("/tokenize", json{{"prompt", "hi"}}.dump(), "application/json"), "tokenize, no key");
  expect_401(cl.Get("/v1/nothing"), "an unknown route, no key");
  cl.set_bearer_token_auth("wrong");
  expect_401(cl.Post("/v1/completions", body, "application/json"), "completions, wrong key");
  EXPECT_EQ(engine.metrics().requests_finished, 0u);  // nothing reached the engine
  httplib::Client open("127.0.0.1", port);
  auto r = open.Get("/health");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  r = open.Get("/metrics");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  cl.set_bearer_token_auth("s3cret");
  r = cl.Post("/v1/completions", body, "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(json::parse(r->body)["usage"]["completion_tokens"], 4);
  r = cl.Get("/v1/models");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  httplib::Client xk("127.0.0.1", port);
  r = xk.Get("/v1/models", httplib::Headers{{"X-Api-Key", "s3cret"}});
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  // Anthropic's route: its clients' x-api-key header; without it, Anthropic's 401
  const std::string mb = json{{"max_tokens", 2}, {"messages", json::array({{{"role", "user"}, {"content", "Once"}}})}}.dump();
  r = open.Post("/v1/messages", mb, "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 401);
  const json e = json::parse(r->body);
  EXPECT_EQ(e["type"], "error");
  EXPECT_EQ(e["error"]["type"], "authentication_error");
  r = xk.Post("/v1/messages", httplib::Headers{{"x-api-key", "s3cret"}}, mb, "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200) << r->body;
}

// Cross-origin requests: allowed origins get Access-Control-Allow-Origin on every response (JSON,
// SSE, errors), OPTIONS preflights are answered without the API key; other origins get no CORS
// header; an empty list adds none.
TEST(ServerCors, AllowedOriginsAndPreflight) {
  if (!fs::exists(model_path())) GTEST_SKIP() << "stories260K.gguf not found at " << model_path();
  Engine engine(one_thread_options(1024));
  const std::string body = json{{"prompt", "Once upon a time"}, {"max_tokens", 3}, {"temperature", 0}}.dump();
  const std::string stream_body =
      json{{"prompt", "Once upon a time"}, {"max_tokens", 3}, {"temperature", 0}, {"stream", true}}.dump();
  for (const std::vector<std::string>& origins :
       {std::vector<std::string>{"*"}, std::vector<std::string>{"http://ui.example", "http://other.example"},
        std::vector<std::string>{}}) {
    SCOPED_TRACE(origins.empty() ? "none" : origins[0]);
    ServerOptions so = loopback_options();
    so.api_key = "k3y";
    so.allowed_origins = origins;
    ServerOnThread srv(engine, so);
    httplib::Client cl("127.0.0.1", srv.port);
    cl.set_read_timeout(60, 0);
    const bool any = !origins.empty() && origins[0] == "*";
    const std::string want = origins.empty() ? "" : any ? "*" : "http://ui.example";
    const httplib::Headers from_ui{{"Origin", "http://ui.example"}, {"Authorization", "Bearer k3y"}};
    auto r = cl.Post("/v1/completions", from_ui, body, "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 200);
    EXPECT_EQ(r->get_header_value("Access-Control-Allow-Origin"), want);
    EXPECT_EQ(r->get_header_value("Vary"), origins.empty() || any ? "" : "Origin");
    r = cl.Post("/v1/completions", from_ui, stream_body, "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 200);
    EXPECT_NE(r->body.find("data: [DONE]"), std::string::npos);
    EXPECT_EQ(r->get_header_value("Access-Control-Allow-Origin"), want);
    r = cl.Post("/v1/completions", httplib::Headers{{"Origin", "http://ui.example"}}, body, "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 401);  // the key is still needed; the error is readable cross-origin
    EXPECT_EQ(r->get_header_value("Access-Control-Allow-Origin"), want);
    r = cl.Options("/v1/chat/completions", httplib::Headers{{"Origin", "http://ui.example"},
                                                            {"Access-Control-Request-Method", "POST"},
                                                            {"Access-Control-Request-Headers", "authorization,content-type"}});
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, origins.empty() ? 404 : 204);  // no API key on a preflight
    EXPECT_EQ(r->get_header_value("Access-Control-Allow-Origin"), want);
    EXPECT_EQ(r->get_header_value("Access-Control-Allow-Headers"), want.empty() ? "" : "authorization,content-type");
    EXPECT_EQ(r->get_header_value("Access-Control-Allow-Methods"), want.empty() ? "" : "GET, POST, OPTIONS");
    r = cl.Get("/health", httplib::Headers{{"Origin", "http://elsewhere.example"}});
    ASSERT_TRUE(r);
    EXPECT_EQ(r->get_header_value("Access-Control-Allow-Origin"), any ? "*" : "");
    EXPECT_EQ(r->get_header_value("Vary"), origins.empty() || any ? "" : "Origin");  // also where no origin is named
    r = cl.Get("/health");
    ASSERT_TRUE(r);
    EXPECT_FALSE(r->has_header("Access-Control-Allow-Origin"));  // not a cross-origin request
  }
}

TEST(ServeCli, ParseBytes) {
  EXPECT_EQ(parse_bytes("2GiB"), size_t(2) << 30);
  EXPECT_EQ(parse_bytes("512MiB"), size_t(512) << 20);
  EXPECT_EQ(parse_bytes("1000"), 1000u);
  EXPECT_EQ(parse_bytes("1.5KiB"), 1536u);
  EXPECT_THROW(parse_bytes("lots"), Error);
  EXPECT_THROW(parse_bytes("2XB"), Error);
  EXPECT_THROW(parse_bytes("-5"), Error);
  EXPECT_THROW(parse_bytes("0x10MiB"), Error);  // not read as hexadecimal
  EXPECT_THROW(parse_bytes("inf"), Error);
  EXPECT_EQ(parse_bytes("1e9"), 1000000000u);
  try {
    parse_bytes("1e30GiB");
    FAIL() << "1e30GiB accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("larger than"), std::string::npos) << e.what();
  }
}

TEST_F(ServerTest, ClientGoneMidStreamCancelsAndFreesPages) {
  const uint64_t gen_before = engine_->metrics().generation_tokens;
  {
    auto c = client();
    json b = {{"prompt", "Once upon a time"}, {"max_tokens", 200}, {"temperature", 0}, {"stream", true}};
    int chunks = 0;
    httplib::Request req;
    req.method = "POST";
    req.path = "/v1/completions";
    req.body = b.dump();
    req.set_header("Content-Type", "application/json");
    // Stop reading after the first chunk: the client closes the connection.
    req.content_receiver = [&](const char*, size_t, uint64_t, uint64_t) { return ++chunks < 2; };
    auto r = c.send(req);
    EXPECT_FALSE(r);  // the client aborted
    EXPECT_GE(chunks, 1);
  }
  // The server notices at its next write and cancels: the request ends well before 200 tokens.
  for (int i = 0; i < 200 && !(engine_->idle() && engine_->metrics().running == 0); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  engine_->wait_idle();
  EXPECT_LT(engine_->metrics().generation_tokens - gen_before, 200u);
  EXPECT_EQ(engine_->pool().n_used(), 0u);
  // And keeps serving.
  json j = post_ok("/v1/completions", {{"prompt", "Hi"}, {"max_tokens", 2}});
  EXPECT_TRUE(j.contains("choices"));
}

// A client that sends a non-streaming request and disconnects before the answer: the server
// watches the connection while the request runs, cancels it and frees its pages.
TEST_F(ServerTest, ClientGoneBeforePlainResponseCancelsAndFreesPages) {
  engine_->wait_idle();
  const EngineMetrics m0 = engine_->metrics();
  const std::string body = json{{"prompt", "Once upon a time"}, {"max_tokens", 200}, {"temperature", 0}}.dump();
  const std::string http = fmt::format(
      "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
      "Content-Length: {}\r\n\r\n{}",
      body.size(), body);
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(uint16_t(port_));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(::send(fd, http.data(), http.size(), MSG_NOSIGNAL), ssize_t(http.size()));
  ::close(fd);  // gone before any byte of the answer
  for (int i = 0; i < 500 && engine_->metrics().requests_finished == m0.requests_finished; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  engine_->wait_idle();
  const EngineMetrics m1 = engine_->metrics();
  EXPECT_EQ(m1.requests_finished, m0.requests_finished + 1);
  EXPECT_EQ(m1.requests_cancelled, m0.requests_cancelled + 1);
  EXPECT_LT(m1.generation_tokens - m0.generation_tokens, 200u);
  EXPECT_EQ(engine_->pool().n_used(), 0u);
  // A client that stays gets its answer on the same server.
  json j = post_ok("/v1/completions", {{"prompt", "Hi"}, {"max_tokens", 2}});
  EXPECT_TRUE(j.contains("choices"));
  EXPECT_EQ(engine_->metrics().requests_cancelled, m0.requests_cancelled + 1);
}

// A reasoning template (Qwen3's: the model opens '<think>', enable_thinking false closes the
// block, earlier replies' reasoning shown only after the last user query), over stories260K.
class ThinkServerTest : public ServerTest {
 protected:
  static constexpr const char* kQwen3Like =
      "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
      "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
      "{%- if '</think>' in message.content %}{%- endif %}"
      "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
      "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}";
  static void SetUpTestSuite() { start(512, model_path(), kQwen3Like); }
  // The greedy text that follows a chat body's prompt, from /v1/completions on its tokens
  std::string continuation(const json& body, int max_tokens) {
    const json tokens = post_ok("/tokenize", body)["tokens"];
    return post_ok("/v1/completions", {{"prompt", tokens}, {"max_tokens", max_tokens}, {"temperature", 0}})["choices"][0]["text"];
  }
};

static std::string without_trailing_newlines(std::string s) {
  s.erase(s.find_last_not_of('\n') + 1);
  return s;
}
static std::string without_leading_newlines(std::string s) {
  s.erase(0, s.find_first_not_of('\n'));
  return s;
}

// Qwen3's kind: a reply that opens no block is all answer, and one continued after its block
// answer; thinking switched off (chat_template_kwargs, Anthropic's thinking disabled, or a
// constraint whose grammar starts at the reply's first byte) closes the block in the prompt; an
// earlier reply's reasoning given back is shown only after the last user query; bad kwargs are
// refused by name.
TEST_F(ThinkServerTest, Qwen3AnswersAndSwitch) {
  const json user = {{"role", "user"}, {"content", "Lily"}};
  // The model opens no block (stories260K writes stories): the reply is all answer.
  json body = {{"messages", json::array({user})}, {"max_tokens", 20}, {"temperature", 0}};
  EXPECT_TRUE(prompt_text(body).ends_with("<|im_start|>assistant\n")) << prompt_text(body);
  json j = post_ok("/v1/chat/completions", body);
  EXPECT_EQ(j["choices"][0]["message"]["content"], continuation(body, 20)) << j;
  EXPECT_FALSE(j["choices"][0]["message"].contains("reasoning_content")) << j;
  // a reply continued after its block: answer
  json after = {{"messages", json::array({user, {{"role", "assistant"}, {"content", "<think>\nA girl.\n</think>\n\nOnce upon"}}})},
                {"add_generation_prompt", false},
                {"continue_final_message", true},
                {"max_tokens", 20},
                {"temperature", 0}};
  EXPECT_TRUE(prompt_text(after).ends_with("<|im_start|>assistant\n<think>\nA girl.\n</think>\n\nOnce upon")) << prompt_text(after);
  j = post_ok("/v1/chat/completions", after);
  EXPECT_EQ(j["choices"][0]["message"]["content"], continuation(after, 20)) << j;
  EXPECT_FALSE(j["choices"][0]["message"].contains("reasoning_content")) << j;

  // enable_thinking false: the block closed in the prompt, the reply the answer
  json off = body;
  off["chat_template_kwargs"] = {{"enable_thinking", false}};
  EXPECT_TRUE(prompt_text(off).ends_with("<|im_start|>assistant\n<think>\n\n</think>\n\n")) << prompt_text(off);
  j = post_ok("/v1/chat/completions", off);
  EXPECT_EQ(j["choices"][0]["message"]["content"], without_leading_newlines(continuation(off, 20))) << j;
  // a constraint: closed too, its document the content
  json constrained = body;
  constrained["response_format"] = {{"type", "json_object"}};
  constrained["max_tokens"] = 40;
  EXPECT_TRUE(prompt_text(constrained).ends_with("<think>\n\n</think>\n\n")) << prompt_text(constrained);
  j = post_ok("/v1/chat/completions", constrained);
  const std::string doc = j["choices"][0]["message"]["content"];
  EXPECT_EQ(doc.substr(doc.find_first_not_of(' '), 1), "{") << j;
  EXPECT_FALSE(j["choices"][0]["message"].contains("reasoning_content")) << j;
  // Anthropic's thinking disabled: the prompt enable_thinking false gives
  const json plain = {{"messages", json::array({user})}};
  json disabled = plain;
  disabled["thinking"] = {{"type", "disabled"}};
  const size_t off_count = post_ok("/tokenize", {{"messages", json::array({user})}, {"chat_template_kwargs", {{"enable_thinking", false}}}})["count"];
  const size_t on_count = post_ok("/tokenize", plain)["count"];
  EXPECT_EQ(post_ok("/v1/messages/count_tokens", disabled)["input_tokens"], off_count);
  EXPECT_EQ(post_ok("/v1/messages/count_tokens", plain)["input_tokens"], on_count);
  EXPECT_GT(off_count, on_count);

  // an earlier reply's reasoning: dropped before the last user query, shown after it
  const json reply = {{"role", "assistant"}, {"content", "Hi!"}, {"reasoning_content", "A greeting."}};
  std::string p = prompt_text({{"messages", json::array({user, reply, {{"role", "user"}, {"content", "Tom"}}})}});
  EXPECT_NE(p.find("<|im_start|>assistant\nHi!<|im_end|>\n<|im_start|>user\nTom"), std::string::npos) << p;
  EXPECT_EQ(p.find("A greeting."), std::string::npos) << p;
  p = prompt_text({{"messages", json::array({user, reply, {{"role", "user"}, {"content", "<tool_response>\n1\n</tool_response>"}}})}});
  EXPECT_NE(p.find("<|im_start|>assistant\n<think>\nA greeting.\n</think>\n\nHi!<|im_end|>"), std::string::npos) << p;
  // given back under vLLM's newer name, reasoning, alike
  const json reply2 = {{"role", "assistant"}, {"content", "Hi!"}, {"reasoning", "A greeting."}};
  EXPECT_EQ(prompt_text({{"messages", json::array({user, reply2, {{"role", "user"}, {"content", "<tool_response>\n1\n</tool_response>"}}})}}), p);

  // kwargs kvq does not read, or of the wrong type: 400s naming them
  const std::string msgs = R"("messages": [{"role": "user", "content": "a"}])";
  expect_bad("/v1/chat/completions", "{" + msgs + R"(, "chat_template_kwargs": {"tools_in_user_message": true}})",
             "chat_template_kwargs");
  expect_bad("/v1/chat/completions", "{" + msgs + R"(, "chat_template_kwargs": {"enable_thinking": "no"}})",
             "chat_template_kwargs");
  expect_bad("/v1/chat/completions", "{" + msgs + R"(, "chat_template_kwargs": [1]})", "chat_template_kwargs");
}

// A template whose prompt opens the block (Qwen3.5's kind, with its enable_thinking switch): the
// reply is reasoning until '</think>', as reasoning_content (plain and streamed alike), Anthropic's
// thinking blocks and the Responses API's reasoning item; switched off, answer.
TEST_F(ThinkServerTest, PromptOpenedReasoning) {
  ServerOptions so;
  so.port = 0;
  so.model_name = "stories260K";
  so.http_threads = 4;
  so.chat_template =
      "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
      "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
      "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
      "{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}";
  Server srv(*engine_, so);
  const int port = srv.bind();
  std::thread t([&] { srv.listen(); });
  httplib::Client qc("127.0.0.1", port);
  qc.set_read_timeout(60, 0);
  auto post = [&](const std::string& path, const json& body) {
    auto r = qc.Post(path.c_str(), body.dump(), "application/json");
    EXPECT_TRUE(r);
    if (!r) return json();
    EXPECT_EQ(r->status, 200) << r->body;
    return json::parse(r->body, nullptr, false);
  };
  const json user = {{"role", "user"}, {"content", "Lily"}};
  const json body = {{"messages", json::array({user})}, {"max_tokens", 20}, {"temperature", 0}};
  const json tokens = post("/tokenize", body)["tokens"];
  EXPECT_TRUE(post("/detokenize", {{"tokens", tokens}})["prompt"].get<std::string>().ends_with("<|im_start|>assistant\n<think>\n"));
  const std::string thought = post("/v1/completions", {{"prompt", tokens}, {"max_tokens", 20}, {"temperature", 0}})["choices"][0]["text"];
  const std::string reasoning = without_trailing_newlines(without_leading_newlines(thought));
  ASSERT_FALSE(reasoning.empty());
  json j = post("/v1/chat/completions", body);
  EXPECT_EQ(j["choices"][0]["message"]["reasoning_content"], reasoning) << j;
  EXPECT_EQ(j["choices"][0]["message"]["reasoning"], reasoning) << j;  // (vLLM's newer name)
  EXPECT_EQ(j["choices"][0]["message"]["content"], "") << j;
  json sbody = body;
  sbody["stream"] = true;
  auto r = qc.Post("/v1/chat/completions", sbody.dump(), "application/json");
  ASSERT_TRUE(r);
  std::string rs, rs2, cs;
  bool done = false;
  for (const json& e : data_sse_events(r->body, &done)) {
    if (e["choices"].empty()) continue;
    const json& d = e["choices"][0]["delta"];
    if (d.contains("reasoning_content")) rs += d["reasoning_content"].get<std::string>();
    if (d.contains("reasoning")) rs2 += d["reasoning"].get<std::string>();
    if (d.contains("content") && d["content"].is_string()) cs += d["content"].get<std::string>();
  }
  EXPECT_TRUE(done);
  EXPECT_EQ(rs, reasoning);
  EXPECT_EQ(rs2, reasoning);
  EXPECT_EQ(cs, "");
  // Anthropic: a thinking block, plain and streamed
  const json mbody = {{"max_tokens", 20}, {"temperature", 0}, {"messages", json::array({user})}};
  const json m = post("/v1/messages", mbody);
  ASSERT_EQ(m["content"].size(), 1u) << m;
  EXPECT_EQ(m["content"][0]["type"], "thinking") << m;
  EXPECT_EQ(m["content"][0]["thinking"], reasoning) << m;
  json smbody = mbody;
  smbody["stream"] = true;
  r = qc.Post("/v1/messages", smbody.dump(), "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(assemble_message(named_events(r->body))["content"], m["content"]);
  // Responses: a reasoning item
  const json resp = post("/v1/responses", {{"input", "Lily"}, {"max_output_tokens", 20}, {"temperature", 0}, {"store", false}});
  ASSERT_EQ(resp["output"].size(), 1u) << resp;
  EXPECT_EQ(resp["output"][0]["type"], "reasoning") << resp;
  EXPECT_EQ(resp["output"][0]["content"][0]["text"], reasoning) << resp;
  // switched off: the answer
  json off = body;
  off["chat_template_kwargs"] = {{"enable_thinking", false}};
  j = post("/v1/chat/completions", off);
  EXPECT_FALSE(j["choices"][0]["message"].contains("reasoning_content")) << j;
  EXPECT_FALSE(j["choices"][0]["message"]["content"].get<std::string>().empty()) << j;
  srv.stop();
  t.join();
}

// A thinking budget on a template whose prompt opens the block, over stories260K (whose reply is
// all reasoning unless it is cut): the server's --reasoning-budget (8 here) or the request's
// thinking_token_budget / thinking_budget_tokens (-1: none) ends the reasoning after that many
// tokens, with thinking_budget_message before the close; the model answers after it; plain and
// streamed alike; bad values refused by name.
class ThinkBudgetServerTest : public ServerTest {
 protected:
  static void SetUpTestSuite() {
    start(512, model_path(),
          "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
          "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}",
          [](ServerOptions& so) { so.reasoning_budget = 8; });
  }
  json completion(const json& tokens, int max_tokens) {
    return post_ok("/v1/completions", {{"prompt", tokens}, {"max_tokens", max_tokens}, {"temperature", 0}});
  }
  // a generated text's tokens (as the text continues the prompt: no dummy prefix)
  static json tokens_of(const std::string& text) { return engine_->tokenizer().encode_continuation(text, true); }
  // The reply a budget of n (message: what ends the reasoning) gives, from /v1/completions: the
  // first n tokens, the close, then the continuation, up to max_tokens in all.
  std::pair<std::string, std::string> expected(const json& body, int n, const std::string& message, int max_tokens) {
    const json prompt = post_ok("/tokenize", body)["tokens"];
    const std::string thought = completion(prompt, n)["choices"][0]["text"];
    std::string close = thought.ends_with('\n') ? "" : "\n";
    if (!message.empty()) close += message + "\n";
    close += "</think>\n\n";
    json all = prompt;
    for (const json& t : tokens_of(thought)) all.push_back(t);
    const json forced = tokens_of(close);
    for (const json& t : forced) all.push_back(t);
    const std::string answer = completion(all, max_tokens - n - int(forced.size()))["choices"][0]["text"];
    std::string reasoning = thought;
    if (!message.empty()) reasoning += "\n" + message;
    return {without_trailing_newlines(without_leading_newlines(reasoning)), without_leading_newlines(answer)};
  }
};

TEST_F(ThinkBudgetServerTest, EndsTheReasoning) {
  const json user = {{"role", "user"}, {"content", "Lily"}};
  const json body = {{"messages", json::array({user})}, {"max_tokens", 40}, {"temperature", 0}};
  // the server's budget
  const auto [reasoning, answer] = expected(body, 8, "", 40);
  ASSERT_FALSE(answer.empty());
  json j = post_ok("/v1/chat/completions", body);
  EXPECT_EQ(j["choices"][0]["message"]["reasoning_content"], reasoning) << j;
  EXPECT_EQ(j["choices"][0]["message"]["content"], answer) << j;
  EXPECT_EQ(j["usage"]["completion_tokens"], 40) << j;
  // streamed: the same
  json sbody = body;
  sbody["stream"] = true;
  auto c = client();
  auto r = c.Post("/v1/chat/completions", sbody.dump(), "application/json");
  ASSERT_TRUE(r);
  std::string rs, cs;
  bool done = false;
  for (const json& e : data_sse_events(r->body, &done)) {
    if (e["choices"].empty()) continue;
    const json& d = e["choices"][0]["delta"];
    if (d.contains("reasoning_content")) rs += d["reasoning_content"].get<std::string>();
    if (d.contains("content") && d["content"].is_string()) cs += d["content"].get<std::string>();
  }
  EXPECT_TRUE(done);
  EXPECT_EQ(rs, reasoning);
  EXPECT_EQ(cs, answer);
  // the request's (either name), with a message
  json own = body;
  own["thinking_budget_tokens"] = 3;
  own["thinking_budget_message"] = "Time to answer.";
  const auto [reasoning3, answer3] = expected(body, 3, "Time to answer.", 40);
  j = post_ok("/v1/chat/completions", own);
  EXPECT_EQ(j["choices"][0]["message"]["reasoning_content"], reasoning3) << j;
  EXPECT_EQ(j["choices"][0]["message"]["content"], answer3) << j;
  own.erase("thinking_budget_tokens");
  own["thinking_token_budget"] = 3;
  EXPECT_EQ(post_ok("/v1/chat/completions", own)["choices"][0]["message"], j["choices"][0]["message"]);
  // a message is text: a marker in it is not the model's token (here the end of generation's)
  json marker = body;
  marker["thinking_budget_tokens"] = 3;
  marker["thinking_budget_message"] = "</s>";
  j = post_ok("/v1/chat/completions", marker);
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length") << j;
  EXPECT_TRUE(j["choices"][0]["message"]["reasoning_content"].get<std::string>().ends_with("\n</s>")) << j;
  // -1: no bound (the reply all reasoning)
  json unbounded = body;
  unbounded["thinking_token_budget"] = -1;
  j = post_ok("/v1/chat/completions", unbounded);
  EXPECT_EQ(j["choices"][0]["message"]["content"], "") << j;
  EXPECT_EQ(j["choices"][0]["message"]["reasoning_content"],
            without_trailing_newlines(without_leading_newlines(completion(post_ok("/tokenize", body)["tokens"], 40)["choices"][0]["text"])));
  // bad values
  const std::string msgs = R"("messages": [{"role": "user", "content": "Lily"}])";
  expect_bad("/v1/chat/completions", "{" + msgs + R"(, "thinking_token_budget": "8"})", "thinking_token_budget");
  expect_bad("/v1/chat/completions", "{" + msgs + R"(, "thinking_token_budget": -2})", "thinking_token_budget");
  expect_bad("/v1/chat/completions", "{" + msgs + R"(, "thinking_token_budget": 2.5})", "thinking_token_budget");
  expect_bad("/v1/chat/completions", "{" + msgs + R"(, "thinking_token_budget": 8, "thinking_budget_tokens": 9})",
             "thinking_budget_tokens");
  expect_bad("/v1/chat/completions", "{" + msgs + R"(, "thinking_budget_message": 5})", "thinking_budget_message");
  expect_bad("/v1/chat/completions", "{" + msgs + R"(, "thinking_token_budget": -9223372036854775808})", "thinking_token_budget");
  expect_bad("/v1/completions", R"({"prompt": "Lily", "thinking_token_budget": 8})", "thinking_token_budget");
  // a bound beyond int's: no smaller bound (the reply as unbounded)
  json huge = body;
  huge["thinking_token_budget"] = 18446744073709551615ull;
  EXPECT_EQ(post_ok("/v1/chat/completions", huge)["choices"][0]["message"], j["choices"][0]["message"]);
}

// Qwen's function calling (a Qwen3-like template: its tools sentence, '<tool_call>', reasoning and
// its switch), over stories260K: the tools listed in the system turn, calls forced by tool_choice
// written in its syntax from the reply's first byte (the reasoning block closed), read back as
// tool_calls plain and streamed, and by the Messages and Responses APIs; a conversation's calls and
// results in its syntax; a call cut short is no call.
class QwenToolServerTest : public ServerTest {
 protected:
  static void SetUpTestSuite() {
    start(1024, model_path(),
          "{{- \"# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\" }}"
          "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
          "{{- '<tool_call>\\n{\"name\": \"' }}{{- '<|im_start|>' + message.role + '\\n' }}{%- if '</think>' in content %}{%- endif %}"
          "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
          "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}");
  }
};

TEST_F(QwenToolServerTest, CallsInItsOwnSyntax) {
  const json tools = weather_and_add_tools();
  json body = {{"messages", json::array({{{"role", "user"}, {"content", "Lily"}}})},
               {"tools", tools},
               {"tool_choice", "required"},
               {"parallel_tool_calls", false},
               {"max_tokens", 200},
               {"temperature", 0}};
  // the prompt: the tools listed as the request wrote them, the block closed before a forced call
  std::string p = prompt_text(body);
  // (as the request wrote them: this client's JSON library sorts keys)
  EXPECT_NE(p.find("<tools>\n{\"function\": {\"description\": \"Weather for a city\", \"name\": \"get_weather\", "
                   "\"parameters\": {\"properties\": {\"city\": {\"maxLength\": 8, \"type\": \"string\"}, \"days\": "
                   "{\"maximum\": 7, \"minimum\": 1, \"type\": \"integer\"}}, \"required\": [\"city\", \"days\"], \"type\": "
                   "\"object\"}}, \"type\": \"function\"}\n{\"function\": {\"name\": \"add\""),
            std::string::npos)
      << p;
  EXPECT_TRUE(p.ends_with("<|im_end|>\n<|im_start|>user\nLily<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")) << p;
  json j = post_ok("/v1/chat/completions", body);
  ASSERT_EQ(j["choices"][0]["message"]["tool_calls"].size(), 1u) << j;
  const std::string name = check_call(j["choices"][0]["message"]["tool_calls"][0]);
  EXPECT_EQ(j["choices"][0]["finish_reason"], "tool_calls") << j;
  EXPECT_TRUE(j["choices"][0]["message"]["content"].is_null()) << j;
  // streamed: the same call, whole, in one chunk
  bool done = false;
  const StreamedReply sr = stream_reply(body, &done);
  EXPECT_TRUE(done);
  ASSERT_EQ(sr.calls.size(), 1u);
  EXPECT_EQ(sr.calls[0]["function"], j["choices"][0]["message"]["tool_calls"][0]["function"]);
  EXPECT_EQ(sr.events.back()["choices"][0]["finish_reason"], "tool_calls");
  // a named function: that one, finish "stop" as OpenAI's
  json named = body;
  named["tool_choice"] = {{"type", "function"}, {"function", {{"name", "add"}}}};
  j = post_ok("/v1/chat/completions", named);
  ASSERT_EQ(j["choices"][0]["message"]["tool_calls"].size(), 1u) << j;
  EXPECT_EQ(check_call(j["choices"][0]["message"]["tool_calls"][0]), "add");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop") << j;
  // cut short by max_tokens: no call, the call's text as content, finish length
  json cut = body;
  cut["max_tokens"] = 20;
  j = post_ok("/v1/chat/completions", cut);
  EXPECT_FALSE(j["choices"][0]["message"].contains("tool_calls")) << j;
  EXPECT_TRUE(j["choices"][0]["message"]["content"].get<std::string>().starts_with("<tool_call>")) << j;
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length") << j;
  // auto: the block open, the reply free (a story: no call)
  json automatic = body;
  automatic["tool_choice"] = "auto";
  EXPECT_TRUE(prompt_text(automatic).ends_with("<|im_start|>assistant\n")) << prompt_text(automatic);
  j = post_ok("/v1/chat/completions", automatic);
  EXPECT_FALSE(j["choices"][0]["message"].contains("tool_calls")) << j;
  EXPECT_FALSE(j["choices"][0]["message"]["content"].get<std::string>().empty()) << j;
  // none: still listed (vLLM's default; the prompt, and its cached prefix, is auto's), the reply
  // read as text: a call written is content (here forced by a choice)
  const std::string auto_prompt = prompt_text(automatic);
  ASSERT_NE(auto_prompt.find("# Tools"), std::string::npos);
  automatic["tool_choice"] = "none";
  EXPECT_EQ(prompt_text(automatic), auto_prompt);
  json none = automatic;
  none["guided_choice"] = json::array({"ok <tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1, \"b\": 2}}\n</tool_call>"});
  none["max_tokens"] = 80;
  j = post_ok("/v1/chat/completions", none);
  EXPECT_FALSE(j["choices"][0]["message"].contains("tool_calls")) << j;
  EXPECT_EQ(j["choices"][0]["message"]["content"], none["guided_choice"][0]) << j;
  // without tools: not listed
  json no_tools = automatic;
  no_tools.erase("tools");
  no_tools.erase("tool_choice");
  EXPECT_EQ(prompt_text(no_tools).find("# Tools"), std::string::npos);

  // a conversation's calls and results, in its syntax
  json convo = body;
  convo["tool_choice"] = "auto";
  convo["messages"] = json::parse(R"j([{"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": null, "reasoning_content": "Look it up.",
     "tool_calls": [{"id": "call_x", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Paris\",\"days\":1}"}}]},
    {"role": "tool", "tool_call_id": "call_x", "content": "20 C"}])j");
  p = prompt_text(convo);
  EXPECT_NE(p.find("<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n<think>\nLook it up.\n</think>\n\n"
                   "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 1}}\n</tool_call>"
                   "<|im_end|>\n<|im_start|>user\n<tool_response>\n20 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n"),
            std::string::npos)
      << p;

  // Anthropic: tool_use blocks; a cut call is no text
  const json mbody = {{"max_tokens", 200}, {"temperature", 0},
                      {"tools", json::array({{{"name", "add"}, {"input_schema", tools[1]["function"]["parameters"]}}})},
                      {"tool_choice", {{"type", "any"}, {"disable_parallel_tool_use", true}}},
                      {"messages", json::array({{{"role", "user"}, {"content", "Lily"}}})}};
  json m = post_ok("/v1/messages", mbody);
  EXPECT_EQ(m["stop_reason"], "tool_use") << m;
  // count_tokens: the prompt that ran (its block closed before the forced call)
  json counted = mbody;
  counted.erase("max_tokens");
  counted.erase("temperature");
  EXPECT_EQ(post_ok("/v1/messages/count_tokens", counted)["input_tokens"],
            m["usage"]["input_tokens"].get<int>() + m["usage"]["cache_read_input_tokens"].get<int>())
      << m["usage"];
  ASSERT_GE(m["content"].size(), 1u) << m;
  EXPECT_EQ(m["content"][0]["type"], "tool_use") << m;
  EXPECT_TRUE(m["content"][0]["input"]["a"].is_number_integer()) << m;
  json mcut = mbody;
  mcut["max_tokens"] = 20;
  m = post_ok("/v1/messages", mcut);
  EXPECT_EQ(m["stop_reason"], "max_tokens") << m;
  for (const json& b : m["content"]) EXPECT_NE(b["type"], "tool_use") << m;
  for (const json& b : m["content"]) {
    if (b["type"] == "text") {
      EXPECT_EQ(b["text"].get<std::string>().find("<tool_call>"), std::string::npos) << m;
    }
  }
  // Responses: a function_call item
  const json resp = post_ok("/v1/responses", {{"input", "Lily"}, {"max_output_tokens", 200}, {"temperature", 0}, {"store", false},
                                              {"tools", json::array({{{"type", "function"}, {"name", "add"},
                                                                      {"parameters", tools[1]["function"]["parameters"]}}})},
                                              {"tool_choice", "required"}, {"parallel_tool_calls", false}});
  ASSERT_EQ(resp["output"].size(), 1u) << resp;
  EXPECT_EQ(resp["output"][0]["type"], "function_call") << resp;
  EXPECT_EQ(resp["output"][0]["name"], "add") << resp;
  (void)name;
}
