// Forward-pass gates on real models: stories260K's greedy output byte for byte; SmolLM2 and
// Gemma 3 logits and greedy continuations against an independent reference (golden files made
// by scripts/make_golden.py from the same GGUF).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/error.h"
#include "model/model.h"
#include "model/sampler.h"
#include "model/tokenizer.h"

using namespace kvq;
namespace fs = std::filesystem;

namespace {

std::string shared_path(const std::string& rel) { return std::string(KVQ_SOURCE_DIR) + "/../shared/" + rel; }

std::string read_file(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Looks for a model in models/ (installed by scripts/get-models.sh) or $KVQ_MODELS_DIR.
std::string find_model(const std::string& file) {
  std::vector<std::string> dirs;
  if (const char* d = std::getenv("KVQ_MODELS_DIR")) dirs.push_back(d);
  dirs.push_back(std::string(KVQ_SOURCE_DIR) + "/models");
  for (const auto& d : dirs)
    if (fs::exists(d + "/" + file)) return d + "/" + file;
  return "";
}

std::string greedy(const Model& m, const Tokenizer& tok, std::vector<int32_t> ids, int n, const std::string& kv = "f16",
                   std::vector<int32_t>* out_ids = nullptr) {
  ThreadPool pool(2);
  KvCache cache(m.kv_cache_config(kv_policy_uniform(kv, m.config().n_layer), m.config().n_ctx_train));
  Forward fwd(m, pool);
  const float* logits = fwd.eval(ids.data(), int(ids.size()), cache);
  std::vector<int32_t> gen;
  for (int i = 0; i < n; ++i) {
    int32_t t = argmax(logits, m.config().n_vocab);
    if (tok.is_eog(t)) break;
    gen.push_back(t);
    logits = fwd.eval(&t, 1, cache);
  }
  if (out_ids) *out_ids = gen;
  return tok.decode(gen);
}

}  // namespace

TEST(Stories260K, GreedyFromBosMatchesKnownOutput) {
  const std::string path = shared_path("models/stories260K.gguf");
  if (!fs::exists(path)) GTEST_SKIP() << "stories260K.gguf not found at " << path;
  const std::string expected = read_file(shared_path("models/stories260K.greedy.txt"));
  ASSERT_FALSE(expected.empty());
  auto m = Model::load(path);
  Tokenizer tok = Tokenizer::from_gguf(m->file());
  std::string out = greedy(*m, tok, {tok.bos()}, 200);
  ASSERT_GE(out.size(), expected.size()) << out;
  EXPECT_EQ(out.substr(0, expected.size()), expected);
}

TEST(Stories260K, ChunkedPrefillEqualsOneShot) {
  const std::string path = shared_path("models/stories260K.gguf");
  if (!fs::exists(path)) GTEST_SKIP() << "stories260K.gguf not found at " << path;
  auto m = Model::load(path);
  Tokenizer tok = Tokenizer::from_gguf(m->file());
  std::vector<int32_t> ids = tok.encode("Once upon a time, there was a little dog named Max. He liked to run", true);
  ASSERT_GT(ids.size(), 8u);
  ThreadPool pool(2);
  const int nv = m->config().n_vocab;
  auto last_logits = [&](int max_batch, bool token_by_token) {
    KvCache cache(m->kv_cache_config(kv_policy_uniform("f32", m->config().n_layer), 512));
    Forward fwd(*m, pool, max_batch);
    const float* l = nullptr;
    if (token_by_token) {
      for (size_t i = 0; i < ids.size(); ++i) l = fwd.eval(&ids[i], 1, cache);
    } else {
      l = fwd.eval(ids.data(), int(ids.size()), cache);
    }
    return std::vector<float>(l, l + nv);
  };
  const auto one = last_logits(256, false);
  const auto chunked = last_logits(3, false);
  const auto stepwise = last_logits(256, true);
  for (int i = 0; i < nv; ++i) {
    ASSERT_NEAR(chunked[size_t(i)], one[size_t(i)], 1e-4f * (1 + std::fabs(one[size_t(i)]))) << i;
    ASSERT_NEAR(stepwise[size_t(i)], one[size_t(i)], 1e-4f * (1 + std::fabs(one[size_t(i)]))) << i;
  }
}

TEST(Stories260K, ContextOverflowIsAnError) {
  const std::string path = shared_path("models/stories260K.gguf");
  if (!fs::exists(path)) GTEST_SKIP() << "stories260K.gguf not found at " << path;
  auto m = Model::load(path);
  ThreadPool pool(1);
  KvCache cache(m->kv_cache_config(kv_policy_uniform("f16", m->config().n_layer), 16));
  Forward fwd(*m, pool);
  std::vector<int32_t> ids(17, 1);
  EXPECT_THROW(fwd.eval(ids.data(), 17, cache), Error);
  std::vector<int32_t> bad = {1, 100000};
  EXPECT_THROW(fwd.eval(bad.data(), 2, cache), Error);
}

// Golden references: tests/golden/<name>.json from scripts/make_golden.py.
class GoldenModel : public ::testing::TestWithParam<std::pair<std::string, std::string>> {};

TEST_P(GoldenModel, LogitsAndGreedyMatchReference) {
  const auto& [golden_name, model_file] = GetParam();
  const std::string gpath = std::string(KVQ_SOURCE_DIR) + "/tests/golden/" + golden_name + ".json";
  if (!fs::exists(gpath)) GTEST_SKIP() << "golden file " << gpath << " absent";
  const std::string mpath = find_model(model_file);
  if (mpath.empty()) GTEST_SKIP() << model_file << " not installed (run scripts/get-models.sh)";
  nlohmann::json g = nlohmann::json::parse(read_file(gpath));
  auto m = Model::load(mpath);
  Tokenizer tok = Tokenizer::from_gguf(m->file());
  const int nv = m->config().n_vocab;
  for (const auto& c : g["cases"]) {
    std::vector<int32_t> ids = c["token_ids"].get<std::vector<int32_t>>();
    SCOPED_TRACE(c.value("name", std::string("case")));
    ThreadPool pool(2);
    KvCache cache(m->kv_cache_config(kv_policy_uniform("f32", m->config().n_layer), int(ids.size()) + 64));
    Forward fwd(*m, pool);
    const float* all = fwd.eval(ids.data(), int(ids.size()), cache, /*all_logits=*/true);
    const double tol = g.value("tolerance", 0.05);
    for (const auto& pos : c["positions"]) {
      const int p = pos["pos"].get<int>();
      const float* lg = all + size_t(p) * size_t(nv);
      double mx = -1e30;
      for (int i = 0; i < nv; ++i) mx = std::max(mx, double(lg[i]));
      double se = 0;
      for (int i = 0; i < nv; ++i) se += std::exp(double(lg[i]) - mx);
      const double lse = mx + std::log(se);
      const double ref_lse = pos["logsumexp"].get<double>();
      int checked = 0;
      double max_err = 0;
      for (const auto& tl : pos["top"]) {
        const int id = tl[0].get<int>();
        const double ref_lp = tl[1].get<double>() - ref_lse;  // compare log-probabilities
        const double lp = double(lg[id]) - lse;
        max_err = std::max(max_err, std::fabs(lp - ref_lp));
        ++checked;
      }
      EXPECT_GT(checked, 0);
      EXPECT_LT(max_err, tol) << "position " << p << ": max |log-prob error| over the reference top tokens";
      EXPECT_EQ(argmax(lg, nv), pos["top"][0][0].get<int>()) << "position " << p;
    }
    std::vector<int32_t> gen;
    greedy(*m, tok, ids, int(c["greedy_ids"].size()), "f32", &gen);
    const auto ref = c["greedy_ids"].get<std::vector<int32_t>>();
    int agree = 0;
    while (agree < int(std::min(gen.size(), ref.size())) && gen[size_t(agree)] == ref[size_t(agree)]) ++agree;
    EXPECT_GE(agree, std::min<int>(32, int(ref.size()))) << "greedy continuation agrees for " << agree << " tokens";
  }
}

INSTANTIATE_TEST_SUITE_P(Models, GoldenModel,
                         ::testing::Values(std::make_pair(std::string("smollm2-135m-instruct"), std::string("SmolLM2-135M-Instruct.Q4_1.gguf")),
                                           std::make_pair(std::string("gemma-3-270m"), std::string("gemma-3-270m-q4_k_m.gguf"))),
                         [](const auto& info) {
                           std::string n = info.param.first;
                           for (auto& ch : n) if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           return n;
                         });

TEST(Stories260K, BatchedSequencesEqualSeparateRuns) {
  // Continuous batching: two sequences at different lengths share one step (their rows go
  // through the weight matmuls together); each must get exactly what it gets alone.
  const std::string path = shared_path("models/stories260K.gguf");
  if (!fs::exists(path)) GTEST_SKIP() << "stories260K.gguf not found at " << path;
  auto m = Model::load(path);
  Tokenizer tok = Tokenizer::from_gguf(m->file());
  const int nv = m->config().n_vocab;
  const std::vector<int32_t> a = tok.encode("Once upon a time, there was a big dog.", true);
  const std::vector<int32_t> b = tok.encode("Tom and Sue went to the park to play with a red ball", true);
  ThreadPool pool(2);
  for (const char* kv : {"f32", "int8"}) {
    SCOPED_TRACE(kv);
    auto cfg = m->kv_cache_config(kv_policy_uniform(kv, m->config().n_layer), 256);
    // alone
    std::vector<std::vector<float>> alone;
    for (const auto* ids : {&a, &b}) {
      KvCache c(cfg);
      Forward f(*m, pool);
      const float* l = f.eval(ids->data(), int(ids->size()) - 1, c);
      l = f.eval(ids->data() + ids->size() - 1, 1, c);
      alone.emplace_back(l, l + nv);
    }
    // batched: prefill a alone, then one step with a's last token and all of b's prompt
    KvCache ca(cfg), cb(cfg);
    Forward f(*m, pool);
    f.eval(a.data(), int(a.size()) - 1, ca);
    f.eval(b.data(), int(b.size()) - 1, cb);
    ForwardSeq seqs[2] = {{a.data() + a.size() - 1, 1, &ca, ForwardSeq::last},
                          {b.data() + b.size() - 1, 1, &cb, ForwardSeq::last}};
    const float* l = f.eval_batch(seqs, 2);
    for (int i = 0; i < nv; ++i) {
      ASSERT_NEAR(l[i], alone[0][size_t(i)], 1e-4f * (1 + std::fabs(alone[0][size_t(i)]))) << "seq a, logit " << i;
      ASSERT_NEAR(l[nv + i], alone[1][size_t(i)], 1e-4f * (1 + std::fabs(alone[1][size_t(i)]))) << "seq b, logit " << i;
    }
    // a sequence may not appear twice in one step
    ForwardSeq dup[2] = {{a.data(), 1, &ca, ForwardSeq::none}, {a.data(), 1, &ca, ForwardSeq::none}};
    EXPECT_THROW(f.eval_batch(dup, 2), Error);
  }
}
