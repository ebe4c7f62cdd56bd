// Quantized KV formats inside the engine: through the format registry only (the model code is the
// same for every format), checked on real models.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "model/model.h"
#include "model/sampler.h"
#include "model/tokenizer.h"
#include "tools/eval_metrics.h"
#include "test_models.h"

using namespace kvq;
namespace fs = std::filesystem;

namespace {
std::string shared_path(const std::string& rel) { return std::string(KVQ_SOURCE_DIR) + "/../shared/" + rel; }

std::vector<int32_t> greedy_ids(const Model& m, const std::string& kv, int n) {
  ThreadPool pool(2);
  KvCache cache(m.kv_cache_config(kv_policy_uniform(kv, m.config().n_layer), 512));
  Forward fwd(m, pool);
  int32_t t = 1;  // BOS
  const float* lg = fwd.eval(&t, 1, cache);
  std::vector<int32_t> out;
  for (int i = 0; i < n; ++i) {
    t = argmax(lg, m.config().n_vocab);
    out.push_back(t);
    lg = fwd.eval(&t, 1, cache);
  }
  return out;
}
}  // namespace

TEST(KvEngine, Stories260KGreedyEqualsF16ForExactAndEightBitCaches) {
  const std::string path = shared_path("models/stories260K.gguf");
  if (!fs::exists(path)) GTEST_SKIP() << "stories260K.gguf not found at " << path;
  auto m = Model::load(path);
  const auto ref = greedy_ids(*m, "f16", 64);
  for (const char* kv : {"f32", "f16", "int8"}) {
    SCOPED_TRACE(kv);
    EXPECT_EQ(greedy_ids(*m, kv, 64), ref);
  }
}

// Every format that fits SmolLM2's head_dim (64): mean KL divergence against the f16 cache over
// the second half of a 256-token WikiText-2 window stays within a bound set by its bits. A format
// whose kernels or layout were wrong lands at KLD of order 1 (a random distribution).
TEST(KvEngine, SmolLM2FormatsStayWithinKldBounds) {
  const std::string model = kvq_test_model("SmolLM2-135M-Instruct.Q4_1.gguf");
  if (model.empty()) GTEST_SKIP() << "SmolLM2-135M-Instruct.Q4_1.gguf not installed (run scripts/get-models.sh)";
  const std::string text_path = shared_path("data/wikitext-2-test.txt");
  if (!fs::exists(text_path)) GTEST_SKIP() << "WikiText-2 not found at " << text_path;
  std::ifstream in(text_path);
  std::stringstream ss;
  ss << in.rdbuf();
  auto m = Model::load(model);
  Tokenizer tok = Tokenizer::from_gguf(m->file());
  std::vector<int32_t> ids = tok.encode(ss.str().substr(0, 20000), false);
  ids.resize(256);
  const int nv = m->config().n_vocab, n = int(ids.size());
  ThreadPool pool(2);
  // Channel means of K and V per layer and head for the centered formats (*_c), from this window's
  // f16 run (what `kvq calibrate` records from sample text).
  const int nl = m->config().n_layer, nkv = m->config().n_head_kv, hd = m->config().head_dim;
  nlohmann::json calib = {{"layers", nlohmann::json::array()}};
  {
    std::vector<std::vector<double>> ks(size_t(nl), std::vector<double>(size_t(nkv * hd))), vs = ks;
    KvCache cache(m->kv_cache_config(kv_policy_uniform("f16", nl), n));
    Forward fwd(*m, pool);
    fwd.on_kv = [&](int il, int cnt, const float*, const float* k, const float* v) {
      for (size_t i = 0; i < size_t(cnt) * size_t(nkv * hd); ++i) {
        ks[size_t(il)][i % size_t(nkv * hd)] += k[i] / n;
        vs[size_t(il)][i % size_t(nkv * hd)] += v[i] / n;
      }
    };
    fwd.eval(ids.data(), n, cache, false);
    for (int il = 0; il < nl; ++il) {
      nlohmann::json km = nlohmann::json::array(), vm = nlohmann::json::array();
      for (int h = 0; h < nkv; ++h) {
        km.push_back(std::vector<double>(ks[size_t(il)].begin() + h * hd, ks[size_t(il)].begin() + (h + 1) * hd));
        vm.push_back(std::vector<double>(vs[size_t(il)].begin() + h * hd, vs[size_t(il)].begin() + (h + 1) * hd));
      }
      calib["layers"].push_back({{"k_mean", km}, {"v_mean", vm}});
    }
  }
  auto run = [&](const std::string& kv) {
    KvCacheConfig cfg = m->kv_cache_config(kv_policy_uniform(kv, m->config().n_layer), n);
    cfg.calib = &calib;
    KvCache cache(cfg);
    Forward fwd(*m, pool);
    const float* l = fwd.eval(ids.data(), n, cache, true);
    return std::vector<float>(l, l + size_t(n) * size_t(nv));
  };
  const auto base = run("f16");
  struct Case {
    const char* fmt;
    double max_kld;
  };
  const Case cases[] = {{"bf16", 0.005}, {"fp8_e4m3", 0.05}, {"fp8_e5m2", 0.1}, {"int8", 0.02}, {"q8_0", 0.02},
                        {"fp8_e4m3_dyn", 0.05}, {"q4_0", 0.3}, {"int4_g32", 0.3}, {"k8v4", 0.3}, {"kivi4", 0.3},
                        {"tq4", 0.3}, {"tq3.5", 0.5}, {"tq3", 0.6}, {"kvquant4", 0.3}, {"kvquant3", 0.6},
                        {"kivi2", 1.0}, {"tq2.5", 1.0}, {"q8_0h", 0.02}, {"q4_0h", 0.15}, {"q4_0h_c", 0.15},
                        {"tq4_c", 0.3}, {"int8_c", 0.02}, {"int4t_g32", 0.3}};
  for (const auto& c : cases) {
    const auto got = run(c.fmt);
    std::vector<TokenScore> sc;
    for (int p = n / 2; p + 1 < n; ++p)
      sc.push_back(eval_score_token(base.data() + size_t(p) * size_t(nv), got.data() + size_t(p) * size_t(nv), nv, ids[size_t(p + 1)]));
    const BucketSummary b = eval_summarize(n, sc);
    std::printf("[kld] %-14s mean %.5f p99 %.5f top1 %.3f dppl %+.3f%%\n", c.fmt, b.kld_mean, b.kld_p99, b.top1_agree, b.delta_ppl_pct);
    EXPECT_LT(b.kld_mean, c.max_kld) << c.fmt;
  }
}
