// Forward-pass gates on real models: stories260K's greedy output byte for byte; SmolLM2 and
// Gemma 3 logits and greedy continuations against an independent reference (golden files made
// by scripts/make_golden.py from the same GGUF).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <cstring>
#include <numeric>
#include <random>
#include <nlohmann/json.hpp>
#include <sstream>

#include "core/dtypes.h"
#include "core/error.h"
#include "gguf/gguf.h"
#include "gguf_writer.h"
#include "kv/kvquant.h"
#include "model/chat.h"
#include "model/config.h"
#include "model/model.h"
#include "model/sampler.h"
#include "model/tokenizer.h"
#include "test_models.h"
#include "tools/plan.h"

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

std::string find_model(const std::string& file) { return kvq_test_model(file); }

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

// The forward's scratch grows linearly with the thread count: only thread 0's buffer serves the
// split-K attention calls (whose scratch holds one part per thread); the others hold one part.
TEST(Stories260K, ScratchLinearInThreads) {
  const std::string path = shared_path("models/stories260K.gguf");
  if (!fs::exists(path)) GTEST_SKIP() << "stories260K.gguf not found at " << path;
  auto m = Model::load(path);
  auto scratch = [&](int threads) {
    ThreadPool pool(threads);
    KvCache cache(m->kv_cache_config(kv_policy_uniform("f16", m->config().n_layer), 4096));
    Forward fwd(*m, pool);
    std::vector<int32_t> ids = {1, 400, 401};
    fwd.eval(ids.data(), 3, cache);
    return double(fwd.scratch_bytes());
  };
  // Growth from 16 to 64 threads against growth from 4 to 16: 4x when linear, 16x when quadratic.
  const double s4 = scratch(4), s16 = scratch(16), s64 = scratch(64);
  EXPECT_LT(s64 - s16, 8 * (s16 - s4)) << s4 << " / " << s16 << " / " << s64 << " bytes at 4 / 16 / 64 threads";
}

// Golden references: tests/golden/forward_<model>.json, made by scripts/make_golden.py with Hugging
// Face transformers loading the same GGUF (weights dequantized to f32, computed in f32).
class GoldenModel : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    const std::string gpath = std::string(KVQ_SOURCE_DIR) + "/tests/golden/" + GetParam();
    if (!fs::exists(gpath)) GTEST_SKIP() << "golden file " << gpath << " absent";
    g_ = nlohmann::json::parse(read_file(gpath));
    model_path_ = find_model(g_["gguf_file"].get<std::string>());
    if (model_path_.empty()) GTEST_SKIP() << g_["gguf_file"].get<std::string>() << " not installed (run scripts/get-models.sh)";
  }
  // Max |log-prob error| over the reference's top tokens at each recorded position; argmax too.
  struct PosResult {
    double max_lp_err = 0;
    bool argmax_equal = false;
    double ref_margin = 0;
  };
  std::vector<PosResult> compare_positions(Model& m, const nlohmann::json& c) {
    const int nv = m.config().n_vocab;
    std::vector<int32_t> ids = c["token_ids"].get<std::vector<int32_t>>();
    ThreadPool pool(2);
    KvCache cache(m.kv_cache_config(kv_policy_uniform("f32", m.config().n_layer), int(ids.size()) + 8));
    Forward fwd(m, pool);
    const float* all = fwd.eval(ids.data(), int(ids.size()), cache, /*all_logits=*/true);
    std::vector<PosResult> out;
    for (const auto& pos : c["positions"]) {
      const float* lg = all + size_t(pos["pos"].get<int>()) * size_t(nv);
      double mx = -1e30;
      for (int i = 0; i < nv; ++i) mx = std::max(mx, double(lg[i]));
      double se = 0;
      for (int i = 0; i < nv; ++i) se += std::exp(double(lg[i]) - mx);
      const double lse = mx + std::log(se), ref_lse = pos["logsumexp"].get<double>();
      PosResult r;
      for (const auto& tl : pos["top"])
        r.max_lp_err = std::max(r.max_lp_err, std::fabs((double(lg[tl[0].get<int>()]) - lse) - (tl[1].get<double>() - ref_lse)));
      r.argmax_equal = argmax(lg, nv) == pos["top"][0][0].get<int>();
      r.ref_margin = pos["top"][0][1].get<double>() - pos["top"][1][1].get<double>();
      out.push_back(r);
    }
    return out;
  }
  nlohmann::json g_;
  std::string model_path_;
};

// The graph against the f32 reference, at reference precision (weights dequantized once, f32
// matmuls): only summation order differs, so log-probs agree to a few 1e-3 and the greedy
// continuation follows the reference for at least 32 tokens.
TEST_P(GoldenModel, ReferencePrecisionMatchesF32Reference) {
  auto m = Model::load_f32(model_path_);
  const int nv = m->config().n_vocab;
  for (const auto& c : g_["prompts"]) {
    SCOPED_TRACE(c["name"].get<std::string>());
    for (const auto& r : compare_positions(*m, c)) {
      EXPECT_LT(r.max_lp_err, 0.02);
      EXPECT_TRUE(r.argmax_equal || r.ref_margin < 0.01);
    }
    // greedy, EOS ignored as in the reference
    std::vector<int32_t> ids = c["token_ids"].get<std::vector<int32_t>>();
    const auto ref = c["greedy"]["ids"].get<std::vector<int32_t>>();
    ThreadPool pool(2);
    KvCache cache(m->kv_cache_config(kv_policy_uniform("f32", m->config().n_layer), int(ids.size() + ref.size()) + 8));
    Forward fwd(*m, pool);
    const float* lg = fwd.eval(ids.data(), int(ids.size()), cache);
    int agree = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
      const int32_t t = argmax(lg, nv);
      if (t != ref[i]) break;
      ++agree;
      lg = fwd.eval(&t, 1, cache);
    }
    EXPECT_GE(agree, std::min<int>(32, int(ref.size()))) << "greedy continuation agrees for " << agree << " tokens";
  }
}

// As served (weights in their GGUF types, activations quantized to 8 bits inside the integer
// dot products, like llama.cpp): the same token wins wherever the reference is not a near tie,
// and log-probs stay within the activation-quantization error. That error is chaotic: moving one
// attention output in 16 by one ulp (six seeds) gave a largest log-prob error of 0.72-1.29 on
// Gemma 3's prompts and 0.57-0.81 on SmolLM2's, so the bound is 1.5, not the 1.0 that a
// last-bit change in a kernel's summation order crossed (0.78 -> 1.17).
TEST_P(GoldenModel, ServedPrecisionCloseToF32Reference) {
  auto m = Model::load(model_path_);
  for (const auto& c : g_["prompts"]) {
    SCOPED_TRACE(c["name"].get<std::string>());
    for (const auto& r : compare_positions(*m, c)) {
      EXPECT_LT(r.max_lp_err, 1.5);
      if (r.ref_margin > 0.5) {
        EXPECT_TRUE(r.argmax_equal) << "reference margin " << r.ref_margin;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Models, GoldenModel,
                         ::testing::Values(std::string("forward_smollm2_135m.json"), std::string("forward_gemma3_270m.json")),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (auto& ch : n)
                             if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
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

// Float hyperparameters from the GGUF metadata: a NaN, infinite, zero or negative epsilon, RoPE
// base or soft-cap, or a sliding window past int range, is an error naming the value, not a model
// that loads and prints garbage.
namespace {
// stories260K rewritten as a Qwen2 / Qwen3 model: metadata keys renamed, each head's Q and K
// projection rows reordered (2i -> i, 2i+1 -> i + head_dim / 2) so that the NeoX-style RoPE of
// those architectures rotates the pairs the llama model's RoPE rotates, plus the architecture's
// own tensors (from `extra`).
// `drop_keys`: metadata keys (as renamed) left out, for `extra` to write again.
std::string write_stories_as(const std::string& arch, const std::string& out_path,
                             const std::function<void(kvq::test::GgufWriter&, const ModelConfig&)>& extra,
                             const std::vector<std::string>& drop_keys = {}) {
  auto f = gguf::File::open(shared_path("models/stories260K.gguf"));
  const ModelConfig c = model_config_from_gguf(*f);
  kvq::test::GgufWriter w;
  for (const auto& kv : f->metadata()) {
    const std::string key = kv.key.rfind("llama.", 0) == 0 ? arch + kv.key.substr(5) : kv.key;
    if (std::find(drop_keys.begin(), drop_keys.end(), key) != drop_keys.end()) continue;
    if (kv.key == "general.architecture") w.add_string(kv.key, arch);
    else w.add(key, kv.value);
  }
  const int hd = c.head_dim;
  for (const auto& t : f->tensors()) {
    std::vector<uint8_t> data(t.data, t.data + t.nbytes);
    const bool q = t.name.find("attn_q.weight") != std::string::npos, k = t.name.find("attn_k.weight") != std::string::npos;
    if (q || k) {
      EXPECT_EQ(t.type, GgmlType::F32);
      const size_t row = size_t(t.ne[0]) * sizeof(float);
      const int heads = q ? c.n_head : c.n_head_kv;
      for (int h = 0; h < heads; ++h)
        for (int j = 0; j < hd; ++j) {
          const int src = j < hd / 2 ? 2 * j : 2 * (j - hd / 2) + 1;
          std::memcpy(data.data() + (size_t(h) * hd + j) * row, t.data + (size_t(h) * hd + src) * row, row);
        }
    }
    w.add_tensor(t.name, t.type, t.ne, std::move(data));
  }
  extra(w, c);
  w.write(out_path);
  return out_path;
}

std::vector<float> stories_logits(const Model& m, const std::vector<int32_t>& ids) {
  ThreadPool pool(1);
  KvCache cache(m.kv_cache_config(kv_policy_uniform("f32", m.config().n_layer), 64));
  Forward fwd(m, pool);
  const float* l = fwd.eval(ids.data(), int(ids.size()), cache, true);
  return std::vector<float>(l, l + ids.size() * size_t(m.config().n_vocab));
}
}  // namespace

TEST(ArchVariants, Qwen2WithZeroBiasesComputesTheLlamaModel) {
  if (!fs::exists(shared_path("models/stories260K.gguf"))) GTEST_SKIP() << "stories260K.gguf not found";
  const std::string path = (fs::temp_directory_path() / "kvq_test_stories_qwen2.gguf").string();
  write_stories_as("qwen2", path, [](kvq::test::GgufWriter& w, const ModelConfig& c) {
    for (int il = 0; il < c.n_layer; ++il) {
      const std::string p = "blk." + std::to_string(il) + ".";
      w.add_tensor(p + "attn_q.bias", GgmlType::F32, {int64_t(c.n_head) * c.head_dim});
      w.add_tensor(p + "attn_k.bias", GgmlType::F32, {int64_t(c.n_head_kv) * c.head_dim});
      w.add_tensor(p + "attn_v.bias", GgmlType::F32, {int64_t(c.n_head_kv) * c.head_dim});
    }
  });
  auto llama = Model::load(shared_path("models/stories260K.gguf"));
  auto qwen = Model::load(path);
  EXPECT_TRUE(qwen->config().rope_neox && qwen->config().qkv_bias && !qwen->config().qk_norm);
  const Tokenizer tok = Tokenizer::from_gguf(qwen->file());
  // the known greedy story, and every logit of a prompt within float rounding of the llama model's
  const std::string expected = read_file(shared_path("models/stories260K.greedy.txt"));
  EXPECT_EQ(greedy(*qwen, tok, {tok.bos()}, 200).substr(0, expected.size()), expected);
  const std::vector<int32_t> ids = tok.encode("Once upon a time, a little girl named Lily found a ball.", true);
  const auto a = stories_logits(*llama, ids), b = stories_logits(*qwen, ids);
  ASSERT_EQ(a.size(), b.size());
  float worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::fabs(a[i] - b[i]));
  EXPECT_LT(worst, 1e-3f);
  fs::remove(path);
}

// The biases are added to q, k and v before RoPE: at layer 0 of the first token (where RoPE is the
// identity) the taps see the unbiased projections plus exactly the biases.
TEST(ArchVariants, Qwen2BiasesAreAddedToQKV) {
  if (!fs::exists(shared_path("models/stories260K.gguf"))) GTEST_SKIP() << "stories260K.gguf not found";
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 0.3f);
  std::vector<std::vector<float>> bias[3];  // q, k, v per layer
  auto write = [&](const std::string& path, bool zero) {
    return write_stories_as("qwen2", path, [&](kvq::test::GgufWriter& w, const ModelConfig& c) {
      const char* names[3] = {"attn_q.bias", "attn_k.bias", "attn_v.bias"};
      for (int il = 0; il < c.n_layer; ++il)
        for (int j = 0; j < 3; ++j) {
          const int64_t n = int64_t(j == 0 ? c.n_head : c.n_head_kv) * c.head_dim;
          std::vector<float> b(size_t(n), 0.0f);
          if (!zero) {
            for (auto& x : b) x = nd(rng);
            bias[j].push_back(b);
          }
          w.add_tensor_f32("blk." + std::to_string(il) + "." + names[j], {n}, b);
        }
    });
  };
  const auto tmp = fs::temp_directory_path();
  const std::string p0 = write((tmp / "kvq_test_qwen2_b0.gguf").string(), true);
  const std::string p1 = write((tmp / "kvq_test_qwen2_b1.gguf").string(), false);
  struct Taps {
    std::vector<float> q, k_pre, v;
  };
  auto run = [](const std::string& path) {
    auto m = Model::load(path);
    ThreadPool pool(1);
    KvCache cache(m->kv_cache_config(kv_policy_uniform("f32", m->config().n_layer), 16));
    Forward fwd(*m, pool);
    Taps t;
    fwd.on_kv = [&](int il, int, const float* k_pre, const float*, const float* v) {
      if (il != 0) return;
      const int n = m->config().n_head_kv * m->config().head_dim;
      t.k_pre.assign(k_pre, k_pre + n);
      t.v.assign(v, v + n);
    };
    fwd.on_q = [&](int il, int, const float* q) {
      if (il == 0) t.q.assign(q, q + m->config().n_head * m->config().head_dim);
    };
    const int32_t bos = 1;
    fwd.eval(&bos, 1, cache);
    return t;
  };
  const Taps a = run(p0), b = run(p1);
  ASSERT_FALSE(a.q.empty() || a.k_pre.empty() || a.v.empty());
  for (size_t i = 0; i < a.q.size(); ++i) EXPECT_EQ(b.q[i], a.q[i] + bias[0][0][i]) << "q " << i;
  for (size_t i = 0; i < a.k_pre.size(); ++i) EXPECT_EQ(b.k_pre[i], a.k_pre[i] + bias[1][0][i]) << "k " << i;
  for (size_t i = 0; i < a.v.size(); ++i) EXPECT_EQ(b.v[i], a.v[i] + bias[2][0][i]) << "v " << i;
  fs::remove(p0);
  fs::remove(p1);
}

TEST(ArchVariants, Qwen3NormalizesQAndKPerHeadAndNeedsItsNorms) {
  if (!fs::exists(shared_path("models/stories260K.gguf"))) GTEST_SKIP() << "stories260K.gguf not found";
  const auto tmp = fs::temp_directory_path();
  // Qwen3 with unit q / k norms: q and k of each head RMS-normalized before RoPE
  const std::string p3 = write_stories_as("qwen3", (tmp / "kvq_test_qwen3.gguf").string(),
                                          [](kvq::test::GgufWriter& w, const ModelConfig& c) {
    for (int il = 0; il < c.n_layer; ++il) {
      const std::string p = "blk." + std::to_string(il) + ".";
      w.add_tensor_f32(p + "attn_q_norm.weight", {c.head_dim}, std::vector<float>(size_t(c.head_dim), 1.0f));
      w.add_tensor_f32(p + "attn_k_norm.weight", {c.head_dim}, std::vector<float>(size_t(c.head_dim), 1.0f));
    }
  });
  auto m = Model::load(p3);
  EXPECT_TRUE(m->config().rope_neox && m->config().qk_norm && !m->config().qkv_bias);
  {
    ThreadPool pool(1);
    KvCache cache(m->kv_cache_config(kv_policy_uniform("f32", m->config().n_layer), 16));
    Forward fwd(*m, pool);
    const int hd = m->config().head_dim;
    std::vector<float> k_pre;
    fwd.on_kv = [&](int il, int, const float* kp, const float*, const float*) {
      if (il == 0) k_pre.assign(kp, kp + m->config().n_head_kv * hd);
    };
    const int32_t bos = 1;
    fwd.eval(&bos, 1, cache);
    ASSERT_FALSE(k_pre.empty());
    for (int h = 0; h < m->config().n_head_kv; ++h) {  // unit norm weights: each head's RMS is 1
      double ss = 0;
      for (int i = 0; i < hd; ++i) ss += double(k_pre[size_t(h * hd + i)]) * k_pre[size_t(h * hd + i)];
      EXPECT_NEAR(std::sqrt(ss / hd), 1.0, 1e-3) << "head " << h;
    }
  }
  m.reset();
  // without them it is refused, naming the tensor
  const std::string p3b = write_stories_as("qwen3", (tmp / "kvq_test_qwen3_nonorm.gguf").string(),
                                           [](kvq::test::GgufWriter&, const ModelConfig&) {});
  try {
    Model::load(p3b);
    ADD_FAILURE() << "a qwen3 file without q / k norms loaded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("attn_q_norm.weight"), std::string::npos) << e.what();
  }
  for (const auto& p : {p3, p3b}) fs::remove(p);
}


// Llama 3.1-style RoPE factors (rope_freqs.weight): every pair turning 2x slower is linear
// position scaling by 2, in the model's RoPE and in the pre-RoPE key codecs' (kv_rope_theta).
TEST(ArchVariants, RopeFrequencyFactorsScaleEachPair) {
  if (!fs::exists(shared_path("models/stories260K.gguf"))) GTEST_SKIP() << "stories260K.gguf not found";
  const auto tmp = fs::temp_directory_path();
  auto with = [&](const std::string& name, const std::function<void(kvq::test::GgufWriter&, const ModelConfig&)>& x) {
    return write_stories_as("llama", (tmp / name).string(), x);
  };
  const std::string pf = with("kvq_test_rope_factors.gguf", [](kvq::test::GgufWriter& w, const ModelConfig& c) {
    w.add_tensor_f32("rope_freqs.weight", {c.n_rot / 2}, std::vector<float>(size_t(c.n_rot / 2), 2.0f));
  });
  // the writer copies the metadata, so the linear scaling goes in as extra keys
  const std::string pl = with("kvq_test_rope_linear.gguf", [](kvq::test::GgufWriter& w, const ModelConfig&) {
    w.add_string("llama.rope.scaling.type", "linear");
    w.add_f32("llama.rope.scaling.factor", 2.0f);
  });
  auto mf = Model::load(pf), ml = Model::load(pl);
  ASSERT_EQ(mf->config().rope_freq_factors.size(), size_t(mf->config().n_rot / 2));
  EXPECT_EQ(ml->config().rope_scale, 2.0f);
  const Tokenizer tok = Tokenizer::from_gguf(mf->file());
  const std::vector<int32_t> ids = tok.encode("Once upon a time, there was a big dog. The dog liked to run and play.", true);
  const auto a = stories_logits(*mf, ids), b = stories_logits(*ml, ids);
  float worst = 0;
  for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, std::fabs(a[i] - b[i]));
  EXPECT_LT(worst, 1e-4f);
  // and the factors reach the cache's RoPE (what pre-RoPE key codecs rotate with)
  const KvCacheConfig kf = mf->kv_cache_config(kv_policy_uniform("f16", mf->config().n_layer), 64);
  ASSERT_EQ(kf.rope[0].freq_factors, mf->config().rope_freq_factors);
  KvRope r = kf.rope[0], lin = kf.rope[0];
  lin.freq_factors.clear();
  lin.freq_scale = 0.5f;
  for (int i = 0; i < r.n_rot / 2; ++i) EXPECT_NEAR(kv_rope_theta(r, i), kv_rope_theta(lin, i), 1e-15) << i;
  // a non-positive factor is refused
  const std::string pz = with("kvq_test_rope_zero.gguf", [](kvq::test::GgufWriter& w, const ModelConfig& c) {
    w.add_tensor_f32("rope_freqs.weight", {c.n_rot / 2}, std::vector<float>(size_t(c.n_rot / 2), 0.0f));
  });
  EXPECT_THROW(Model::load(pz), Error);
  mf.reset();
  ml.reset();
  for (const auto& p : {pf, pl, pz}) fs::remove(p);
}

namespace {
// Replaces each layer's tensors `parts` (in that order) by one tensor `fused` whose rows are theirs
// one after another (Phi-3's attn_qkv and gate / up ffn_up).
void fuse_rows(kvq::test::GgufWriter& w, int n_layer, const std::vector<std::string>& parts, const std::string& fused) {
  auto& ts = w.tensors();
  for (int il = 0; il < n_layer; ++il) {
    const std::string p = "blk." + std::to_string(il) + ".";
    kvq::test::GgufWriter::Tensor out;
    out.name = p + fused;
    for (const auto& part : parts) {
      auto it = std::find_if(ts.begin(), ts.end(), [&](const auto& t) { return t.name == p + part; });
      ASSERT_NE(it, ts.end()) << p + part;
      if (out.dims.empty()) {
        out.dims = {it->dims[0], 0};
        out.type_id = it->type_id;
      }
      ASSERT_EQ(it->dims[0], out.dims[0]);
      out.dims[1] += it->dims[1];
      out.data.insert(out.data.end(), it->data.begin(), it->data.end());
      ts.erase(it);
    }
    ts.push_back(std::move(out));
  }
}

// stories260K's tensors laid out as OLMo 2's (written by write_stories_as("olmo2", ...)): the pre-norms
// dropped, unit post-norms after attention and the FFN, unit q / k norms over all heads.
void as_olmo2(kvq::test::GgufWriter& w, const ModelConfig& c) {
    auto& ts = w.tensors();
    ts.erase(std::remove_if(ts.begin(), ts.end(), [](const auto& t) { return t.name.find("attn_norm") != std::string::npos || t.name.find("ffn_norm") != std::string::npos; }), ts.end());
    for (int il = 0; il < c.n_layer; ++il) {
      const std::string p = "blk." + std::to_string(il) + ".";
      for (const char* nm : {"post_attention_norm", "post_ffw_norm"}) w.add_tensor_f32(p + nm + ".weight", {c.n_embd}, std::vector<float>(size_t(c.n_embd), 1.f));
      w.add_tensor_f32(p + "attn_q_norm.weight", {c.n_head * c.head_dim}, std::vector<float>(size_t(c.n_head * c.head_dim), 1.f));
      w.add_tensor_f32(p + "attn_k_norm.weight", {c.n_head_kv * c.head_dim}, std::vector<float>(size_t(c.n_head_kv * c.head_dim), 1.f));
    }
}

float max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  float worst = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) worst = std::max(worst, std::fabs(a[i] - b[i]));
  return worst;
}
}  // namespace

namespace {
// ggml's YaRN RoPE, written out as ggml-cpu's rope_yarn / ggml_rope_cache_init and llama.cpp's
// context setup compute it (in float, the angle built up pair by pair): pair i of a token at
// position `pos` turns by angle[i], and cos and sin are multiplied by `mscale`.
struct GgmlYarn {
  std::vector<float> angle;
  float mscale = 1;
};
GgmlYarn ggml_yarn(int pos, int n_dims, float base, float factor, int orig_ctx, float beta_fast, float beta_slow,
                   float rope_attn_factor = 1.f) {
  const float freq_scale = 1.0f / factor;
  auto corr_dim = [&](float n_rot) {
    return float(n_dims) * std::log(float(orig_ctx) / (n_rot * 2 * float(M_PI))) / (2 * std::log(base));
  };
  const float corr0 = std::max(0.0f, std::floor(corr_dim(beta_fast)));
  const float corr1 = std::min(float(n_dims - 1), std::ceil(corr_dim(beta_slow)));
  // llama_context: yarn_attn_factor = get_mscale(factor) / (1 + 0.1 ln factor) x rope_attn_factor
  const float get_mscale = factor <= 1.0f ? 1.0f : 0.1f * std::log(factor) + 1.0f;
  const float attn_factor = get_mscale / (1.0f + 0.1f * std::log(factor)) * rope_attn_factor;
  GgmlYarn g;
  const float theta_scale = std::pow(base, -2.0f / float(n_dims));
  float theta = float(pos);
  for (int i0 = 0; i0 < n_dims; i0 += 2) {
    const float theta_extrap = theta, theta_interp = freq_scale * theta_extrap;
    const float y = float(i0 / 2 - corr0) / std::max(0.001f, corr1 - corr0);
    const float ramp_mix = (1 - std::min(1.0f, std::max(0.0f, y))) * 1.0f;  // ext_factor 1
    g.angle.push_back(theta_interp * (1 - ramp_mix) + theta_extrap * ramp_mix);
    g.mscale = attn_factor * (1.0f + 0.1f * std::log(1.0f / freq_scale));
    theta *= theta_scale;
  }
  return g;
}

ModelConfig yarn_config(int n_rot, float base, float factor, int orig_ctx, float beta_fast = 32, float beta_slow = 1) {
  ModelConfig c;
  c.n_layer = 1;
  c.head_dim = c.n_rot = n_rot;
  c.rope_base = c.rope_base_local = base;
  c.rope_scale = factor;
  c.rope_yarn = true;
  c.yarn_orig_ctx = c.n_ctx_orig = orig_ctx;
  c.yarn_beta_fast = beta_fast;
  c.yarn_beta_slow = beta_slow;
  c.layer_sliding = {false};
  return c;
}
}  // namespace

// YaRN as kvq runs it (per-pair rates folded into the RoPE's factors, the magnitude on q) turns
// every pair by ggml's angle and scales q.k as ggml's cos / sin magnitude does, for Qwen3's,
// OLMo 3's and gpt-oss's settings and at positions to 128K.
TEST(Rope, YarnMatchesGgmlRopeYarn) {
  struct Case { int n_rot; float base, factor; int orig; float bf, bs; };
  for (const Case& k : {Case{128, 1000000.f, 4.f, 32768, 32, 1}, Case{128, 500000.f, 8.f, 8192, 32, 1},
                        Case{64, 150000.f, 32.f, 4096, 32, 1}, Case{64, 10000.f, 2.f, 2048, 16, 2},
                        Case{8, 10000.f, 4.f, 256, 32, 1}}) {
    const ModelConfig c = yarn_config(k.n_rot, k.base, k.factor, k.orig, k.bf, k.bs);
    const KvRope r = model_layer_rope(c, 0);
    ASSERT_EQ(r.freq_factors.size(), size_t(k.n_rot / 2));
    EXPECT_EQ(r.freq_scale, 1.f);
    int kept = 0, interp = 0;  // pairs at the trained rate and fully interpolated ones
    for (int pos : {0, 1, 17, 1000, 30000, 131071}) {
      const GgmlYarn g = ggml_yarn(pos, k.n_rot, k.base, k.factor, k.orig, k.bf, k.bs);
      for (int i = 0; i < k.n_rot / 2; ++i) {
        const double mine = double(pos) * kv_rope_theta(r, i);
        // ggml builds the angle in float: relative rounding ~1e-7 per step, pair by pair
        EXPECT_NEAR(mine, double(g.angle[size_t(i)]), 2e-5 * std::max(1.0, std::fabs(mine)))
            << "n_rot " << k.n_rot << " pos " << pos << " pair " << i;
        if (pos == 1) {
          const double plain = std::pow(double(k.base), -2.0 * i / k.n_rot);
          kept += std::fabs(mine / plain - 1) < 1e-6;
          interp += std::fabs(mine / plain * k.factor - 1) < 1e-6;
        }
      }
      EXPECT_NEAR(model_layer_rope_mscale(c, 0), g.mscale, 1e-6);
    }
    // every setting has pairs on both sides of the ramp
    EXPECT_GT(kept, 0) << k.n_rot;
    EXPECT_GT(interp, 0) << k.n_rot;
  }
  // the magnitude: 1 + 0.1 ln(factor), times rope.scaling.attn_factor
  ModelConfig c = yarn_config(128, 1e6f, 4.f, 32768);
  EXPECT_NEAR(model_layer_rope_mscale(c, 0), 1 + 0.1 * std::log(4.0), 1e-6);
  c.rope_attn_factor = 1.5f;
  EXPECT_NEAR(model_layer_rope_mscale(c, 0), ggml_yarn(1, 128, 1e6f, 4.f, 32768, 32, 1, 1.5f).mscale, 1e-6);
  // factor 1 is no scaling at all; linear scaling has no magnitude and one rate
  c = yarn_config(128, 1e6f, 1.f, 32768);
  EXPECT_TRUE(model_layer_rope(c, 0).freq_factors.empty());
  EXPECT_EQ(model_layer_rope_mscale(c, 0), 1.f);
  c = yarn_config(128, 1e6f, 4.f, 32768);
  c.rope_yarn = false;
  EXPECT_TRUE(model_layer_rope(c, 0).freq_factors.empty());
  EXPECT_EQ(model_layer_rope(c, 0).freq_scale, 0.25f);
  EXPECT_EQ(model_layer_rope_mscale(c, 0), 1.f);
  // the command line's YaRN on Gemma 2 (its local layers scale as its global ones in the file): the
  // sliding-window layers keep the file's scaling, as llama.cpp's rope_freq_scale_train_swa
  c = yarn_config(128, 10000.f, 1.f, 8192);
  c.rope_yarn = false;
  c.arch = "gemma2";
  c.n_layer = 2;
  c.layer_sliding = {true, false};
  c.n_ctx_train = 8192;
  RopeOverrides o;
  o.scaling = "yarn";
  o.scale = 4;
  model_config_apply_rope(c, o);
  EXPECT_TRUE(model_layer_rope(c, 0).freq_factors.empty());
  EXPECT_EQ(model_layer_rope(c, 0).freq_scale, 1.f);
  EXPECT_EQ(model_layer_rope_mscale(c, 0), 1.f);
  EXPECT_EQ(model_layer_rope(c, 1).freq_factors.size(), size_t(64));
  EXPECT_NEAR(model_layer_rope_mscale(c, 1), 1 + 0.1 * std::log(4.0), 1e-6);
  EXPECT_EQ(c.n_ctx_train, 4 * 8192);
  // a linear file switched to YaRN keeps its factor and its context (the factor did not change)
  c = yarn_config(128, 10000.f, 2.f, 4096);
  c.rope_yarn = false;
  c.n_ctx_train = 4096;
  o = {};
  o.scaling = "yarn";
  model_config_apply_rope(c, o);
  EXPECT_TRUE(c.rope_yarn);
  EXPECT_EQ(c.rope_scale, 2.f);
  EXPECT_EQ(c.n_ctx_train, 4096);
  // a file's own magnitude (transformers' attention_factor) is for its own factor: another factor
  // computes its own; --rope-scaling none keeps the file's context
  c = yarn_config(128, 500000.f, 8.f, 8192);
  c.yarn_attn_factor = 1.3f;
  c.n_ctx_train = 65536;
  EXPECT_EQ(model_layer_rope_mscale(c, 0), 1.3f);
  ModelConfig c2 = c;
  o = {};
  o.scale = 4;
  model_config_apply_rope(c2, o);
  EXPECT_NEAR(model_layer_rope_mscale(c2, 0), 1 + 0.1 * std::log(4.0), 1e-6);
  EXPECT_EQ(c2.n_ctx_train, 4 * 8192);
  c2 = c;
  o = {};
  o.scaling = "none";
  model_config_apply_rope(c2, o);
  EXPECT_EQ(model_layer_rope_mscale(c2, 0), 1.f);
  EXPECT_EQ(c2.n_ctx_train, 65536);
  // factors too small for a float, or not numbers, are refused (not rounded to 0)
  for (double bad : {1e-50, 1e-4, std::nan(""), 1e9}) {
    c2 = c;
    o = {};
    o.scale = bad;
    EXPECT_THROW(model_config_apply_rope(c2, o), Error) << bad;
  }
  // a file's per-pair factors (Llama 3.1's) stay, YaRN's rates on top: ggml divides the angle by them first
  c = yarn_config(64, 10000.f, 2.f, 2048, 16, 2);
  c.rope_freq_factors.resize(32);
  for (size_t i = 0; i < 32; ++i) c.rope_freq_factors[i] = 1.0f + float(i) / 8;
  const KvRope r = model_layer_rope(c, 0);
  const std::vector<double> rate = model_yarn_pair_rates(64, 10000.f, 2.f, 2048, 16, 2);
  for (int i = 0; i < 32; ++i) {
    const double plain = std::pow(10000.0, -2.0 * i / 64) / c.rope_freq_factors[size_t(i)];
    EXPECT_NEAR(kv_rope_theta(r, i), plain * rate[size_t(i)], 1e-6 * plain) << i;
  }
}

// A YaRN file (stories260K with rope.scaling.type yarn) computes what the model computes with
// ggml's YaRN written out another way: each pair's rate as rope_freqs.weight and the magnitude
// squared on q's rows; --rope-scaling yarn on the plain file gives the same; the cache's RoPE (what
// pre-RoPE key codecs rotate with) has YaRN's rates; OLMo 3's local layers keep plain RoPE.
TEST(ArchVariants, YarnFileAndOverridesComputeGgmlsYarn) {
  if (!fs::exists(shared_path("models/stories260K.gguf"))) GTEST_SKIP() << "stories260K.gguf not found";
  const auto tmp = fs::temp_directory_path();
  auto with = [&](const std::string& name, const std::function<void(kvq::test::GgufWriter&, const ModelConfig&)>& x) {
    return write_stories_as("llama", (tmp / name).string(), x);
  };
  const float factor = 4.f;
  const int orig = 64;  // pair 0 keeps its rate, pair 1 is mixed, pairs 2 and 3 are interpolated
  const std::string py = with("kvq_test_yarn.gguf", [&](kvq::test::GgufWriter& w, const ModelConfig&) {
    w.add_string("llama.rope.scaling.type", "yarn");
    w.add_f32("llama.rope.scaling.factor", factor);
    w.add_u32("llama.rope.scaling.original_context_length", orig);
  });
  const std::string pw = with("kvq_test_yarn_written.gguf", [&](kvq::test::GgufWriter& w, const ModelConfig& c) {
    const GgmlYarn g = ggml_yarn(1, c.n_rot, c.rope_base, factor, orig, 32, 1);
    std::vector<float> ff(size_t(c.n_rot / 2));
    for (int i = 0; i < c.n_rot / 2; ++i)  // ggml's angle at position 1 is the pair's rate
      ff[size_t(i)] = float(std::pow(double(c.rope_base), -2.0 * i / c.n_rot) / double(g.angle[size_t(i)]));
    w.add_tensor_f32("rope_freqs.weight", {c.n_rot / 2}, ff);
    ASSERT_EQ(c.n_rot, c.head_dim);  // every dim rotates: all of q times mscale^2
    for (auto& t : w.tensors()) {
      if (t.name.find("attn_q.weight") == std::string::npos) continue;
      float* rows = reinterpret_cast<float*>(t.data.data());
      for (size_t i = 0; i < size_t(c.n_head) * size_t(c.head_dim) * size_t(c.n_embd); ++i) rows[i] *= g.mscale * g.mscale;
    }
  });
  // (written as the others are: write_stories_as reorders q / k rows, which a llama file rotates by other pairs)
  const std::string pplain = with("kvq_test_yarn_plain.gguf", [](kvq::test::GgufWriter&, const ModelConfig&) {});
  RopeOverrides ov;
  ov.scaling = "yarn";
  ov.scale = factor;
  ov.yarn_orig_ctx = orig;
  auto my = Model::load(py), mw = Model::load(pw), mo = Model::load(pplain, ov), mp = Model::load(pplain);
  const ModelConfig& cy = my->config();
  EXPECT_TRUE(cy.rope_yarn);
  EXPECT_EQ(cy.rope_scale, factor);
  EXPECT_EQ(cy.yarn_orig_ctx, orig);
  EXPECT_EQ(cy.n_ctx_train, mp->config().n_ctx_train);  // the file's own context stays
  EXPECT_EQ(mo->config().n_ctx_train, orig * int(factor));  // an override's: original x factor
  EXPECT_EQ(model_rope_scaling_note(cy), "YaRN RoPE scaling x4 of 64 positions (beta 32 / 1)");
  const Tokenizer tok = Tokenizer::from_gguf(my->file());
  std::string text;
  for (int i = 0; i < 4; ++i) text += "Once upon a time, there was a big dog. The dog liked to run and play in the park. ";
  std::vector<int32_t> ids = tok.encode(text, true);
  ASSERT_GT(ids.size(), size_t(64));
  ids.resize(64);  // the test caches' size
  const auto ly = stories_logits(*my, ids), lw = stories_logits(*mw, ids), lo = stories_logits(*mo, ids),
             lp = stories_logits(*mp, ids);
  EXPECT_LT(max_abs_diff(ly, lw), 1e-4f);
  EXPECT_LT(max_abs_diff(ly, lo), 1e-6f);
  EXPECT_GT(max_abs_diff(ly, lp), 1e-2f);  // YaRN does change this model's output
  // the cache's RoPE (what pre-RoPE key codecs rotate with) carries the rates
  const KvCacheConfig ky = my->kv_cache_config(kv_policy_uniform("f16", cy.n_layer), 64);
  for (int i = 0; i < cy.n_rot / 2; ++i)
    EXPECT_NEAR(kv_rope_theta(ky.rope[0], i), ggml_yarn(1, cy.n_rot, cy.rope_base, factor, orig, 32, 1).angle[size_t(i)], 1e-6) << i;
  // flags: the same as the file through --rope-scale on a file that has YaRN, none switches it off
  RopeOverrides off;
  off.scaling = "none";
  auto mn = Model::load(py, off);
  EXPECT_FALSE(mn->config().rope_yarn);
  EXPECT_LT(max_abs_diff(stories_logits(*mn, ids), lp), 1e-6f);
  RopeOverrides beta;
  beta.yarn_beta_fast = 64;
  beta.yarn_beta_slow = 0.5;
  auto mb = Model::load(py, beta);
  EXPECT_EQ(mb->config().yarn_beta_fast, 64.f);
  EXPECT_EQ(mb->config().n_ctx_train, cy.n_ctx_train);  // the factor did not change
  const std::vector<double> rb = model_yarn_pair_rates(cy.n_rot, cy.rope_base, factor, orig, 64, 0.5f);
  for (int i = 0; i < cy.n_rot / 2; ++i)
    EXPECT_NEAR(kv_rope_theta(mb->kv_cache_config(kv_policy_uniform("f16", cy.n_layer), 64).rope[0], i),
                std::pow(double(cy.rope_base), -2.0 * i / cy.n_rot) * rb[size_t(i)], 1e-7) << i;
  RopeOverrides lin;
  lin.scaling = "linear";
  lin.scale = 2;
  auto ml = Model::load(pplain, lin);
  EXPECT_EQ(ml->config().n_ctx_train, 2 * mp->config().n_ctx_train);
  EXPECT_EQ(model_rope_scaling_note(ml->config()), "linear RoPE scaling x2");

  // bad settings are refused, naming what is wrong
  auto refused = [&](const std::string& path, const RopeOverrides& o, const std::string& what) {
    try {
      Model::load(path, o);
      ADD_FAILURE() << path << " loaded (" << what << ")";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  auto ovr = [](const std::string& s, double scale, int orig_ctx = 0, double bf = 0) {
    RopeOverrides o;
    o.scaling = s;
    o.scale = scale;
    o.yarn_orig_ctx = orig_ctx;
    o.yarn_beta_fast = bf;
    return o;
  };
  refused(pplain, ovr("ntk", 0), "not one of: none, linear, yarn");
  refused(pplain, ovr("yarn", 0), "needs --rope-scale");
  refused(pplain, ovr("linear", -2), "--rope-scale -2");
  refused(pplain, ovr("none", 2), "takes no --rope-scale");
  refused(pplain, ovr("", 0, 512), "need YaRN scaling");
  refused(pplain, ovr("yarn", 4, -1), "--yarn-orig-ctx -1");
  refused(py, ovr("", 0, 0, std::nan("")), "--yarn-beta-fast");
  const std::string plog = with("kvq_test_yarn_logmul.gguf", [&](kvq::test::GgufWriter& w, const ModelConfig&) {
    w.add_string("llama.rope.scaling.type", "yarn").add_f32("llama.rope.scaling.factor", 4.f);
    w.add_f32("llama.rope.scaling.yarn_log_multiplier", 0.1f);
  });
  const std::string pbeta = with("kvq_test_yarn_beta.gguf", [&](kvq::test::GgufWriter& w, const ModelConfig&) {
    w.add_string("llama.rope.scaling.type", "yarn").add_f32("llama.rope.scaling.factor", 4.f);
    w.add_f32("llama.rope.scaling.yarn_beta_slow", 0.f);
  });
  const std::string pkind = with("kvq_test_rope_kind.gguf", [&](kvq::test::GgufWriter& w, const ModelConfig&) {
    w.add_string("llama.rope.scaling.type", "longrope2");
  });
  const std::string pattn = with("kvq_test_yarn_attnf.gguf", [&](kvq::test::GgufWriter& w, const ModelConfig&) {
    w.add_string("llama.rope.scaling.type", "yarn").add_f32("llama.rope.scaling.factor", 4.f);
    w.add_f32("llama.rope.scaling.yarn_attn_factor", 1.25f);
  });
  const std::string pattn_bad = with("kvq_test_yarn_attnf_bad.gguf", [&](kvq::test::GgufWriter& w, const ModelConfig&) {
    w.add_string("llama.rope.scaling.type", "yarn").add_f32("llama.rope.scaling.factor", 4.f);
    w.add_f32("llama.rope.scaling.yarn_attn_factor", -1.f);
  });
  EXPECT_EQ(model_layer_rope_mscale(Model::load(pattn)->config(), 0), 1.25f);
  refused(pattn_bad, {}, "yarn_attn_factor -1");
  refused(plog, {}, "yarn_log_multiplier");
  refused(pbeta, {}, "beta_slow 0");
  refused(pkind, {}, "'longrope2' is not supported (supported: none, linear, yarn)");

  // OLMo 3: YaRN on the global layers only; the sliding-window ones rotate plainly
  const std::string p3 = (tmp / "kvq_test_olmo3_yarn.gguf").string();
  write_stories_as("olmo2", p3, [&](kvq::test::GgufWriter& w, const ModelConfig& c) {
    as_olmo2(w, c);
    w.add_u32("olmo2.attention.sliding_window", 16);
    w.add_f32("olmo2.rope.scaling.factor", 8.f).add_string("olmo2.rope.scaling.type", "yarn");
    w.add_u32("olmo2.rope.scaling.original_context_length", 64);
  });
  {
    auto m3 = Model::load(p3);
    const ModelConfig& c3 = m3->config();
    const KvCacheConfig k3 = m3->kv_cache_config(kv_policy_uniform("f16", c3.n_layer), 64);
    for (int il = 0; il < c3.n_layer; ++il) {
      const bool global = il % 4 == 3;
      EXPECT_EQ(k3.rope[size_t(il)].freq_factors.empty(), !global) << il;
      EXPECT_EQ(k3.rope[size_t(il)].freq_scale, 1.f) << il;
      EXPECT_NEAR(model_layer_rope_mscale(c3, il), global ? 1 + 0.1 * std::log(8.0) : 1.0, 1e-6) << il;
    }
  }
  my.reset(); mw.reset(); mo.reset(); mp.reset(); mn.reset(); mb.reset(); ml.reset();
  for (const auto& p : {py, pw, pplain, plog, pbeta, pkind, p3, pattn, pattn_bad}) fs::remove(p);
}

// Phi-3's fused matrices: stories260K with q, k, v in one attn_qkv (rows q, k, v) and gate and up
// in one ffn_up (gate rows first) computes the llama model (its Q / K rows reordered for Phi-3's
// NeoX RoPE), and loads as separate matrices too.
TEST(ArchVariants, Phi3FusedMatricesComputeTheLlamaModel) {
  if (!fs::exists(shared_path("models/stories260K.gguf"))) GTEST_SKIP() << "stories260K.gguf not found";
  const std::string path = (fs::temp_directory_path() / "kvq_test_stories_phi3.gguf").string();
  write_stories_as("phi3", path, [](kvq::test::GgufWriter& w, const ModelConfig& c) {
    fuse_rows(w, c.n_layer, {"attn_q.weight", "attn_k.weight", "attn_v.weight"}, "attn_qkv.weight");
    fuse_rows(w, c.n_layer, {"ffn_gate.weight", "ffn_up.weight"}, "ffn_up.weight");
  });
  auto llama = Model::load(shared_path("models/stories260K.gguf"));
  auto phi = Model::load(path);
  EXPECT_TRUE(phi->config().rope_neox && phi->config().fused_gate_up && !phi->config().qkv_bias);
  EXPECT_EQ(phi->file().find_tensor("blk.0.attn_q.weight"), nullptr);
  const Tokenizer tok = Tokenizer::from_gguf(phi->file());
  const std::string expected = read_file(shared_path("models/stories260K.greedy.txt"));
  EXPECT_EQ(greedy(*phi, tok, {tok.bos()}, 200).substr(0, expected.size()), expected);
  const std::vector<int32_t> ids = tok.encode("Once upon a time, a little girl named Lily found a ball.", true);
  EXPECT_LT(max_abs_diff(stories_logits(*llama, ids), stories_logits(*phi, ids)), 1e-3f);
  // the f32 reference load splits the fused rows the same way
  auto phi32 = Model::load_f32(path);
  EXPECT_LT(max_abs_diff(stories_logits(*llama, ids), stories_logits(*phi32, ids)), 1e-3f);
  // a fused matrix of the wrong height is refused, naming it
  const std::string bad = (fs::temp_directory_path() / "kvq_test_stories_phi3_bad.gguf").string();
  write_stories_as("phi3", bad, [](kvq::test::GgufWriter& w, const ModelConfig& c) {
    fuse_rows(w, c.n_layer, {"attn_q.weight", "attn_k.weight", "attn_v.weight"}, "attn_qkv.weight");
  });
  try {
    Model::load(bad);
    ADD_FAILURE() << "a phi3 file with an unfused ffn_up loaded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'blk.0.ffn_up.weight' has shape"), std::string::npos) << e.what();
  }
  phi.reset();
  phi32.reset();
  fs::remove(path);
  fs::remove(bad);
}

// Phi-3's LongRoPE: the short factors up to rope.scaling.original_context_length, the long ones
// when kvq runs at a longer context; rope.scaling.attn_factor a scales the rotated part of q.k by
// a^2 (cos and sin times a on q and k), and only that part when the rotation is partial.
TEST(ArchVariants, Phi3LongRopeFactorsFollowTheContext) {
  if (!fs::exists(shared_path("models/stories260K.gguf"))) GTEST_SKIP() << "stories260K.gguf not found";
  const auto tmp = fs::temp_directory_path();
  auto phi3 = [&](const std::string& name, const std::function<void(kvq::test::GgufWriter&, const ModelConfig&)>& x,
                  const std::vector<std::string>& drop = {}) {
    return write_stories_as(
        "phi3", (tmp / name).string(),
        [&](kvq::test::GgufWriter& w, const ModelConfig& c) {
          fuse_rows(w, c.n_layer, {"ffn_gate.weight", "ffn_up.weight"}, "ffn_up.weight");
          x(w, c);
        },
        drop);
  };
  // short factors 1 (none), long factors 2 (linear scaling by 2), switch at 128 tokens
  const std::string pr = phi3("kvq_test_phi3_longrope.gguf", [](kvq::test::GgufWriter& w, const ModelConfig& c) {
    w.add_tensor_f32("rope_factors_short.weight", {c.n_rot / 2}, std::vector<float>(size_t(c.n_rot / 2), 1.0f));
    w.add_tensor_f32("rope_factors_long.weight", {c.n_rot / 2}, std::vector<float>(size_t(c.n_rot / 2), 2.0f));
    w.add_u32("phi3.rope.scaling.original_context_length", 128);
  });
  const std::string pplain = phi3("kvq_test_phi3_plain.gguf", [](kvq::test::GgufWriter&, const ModelConfig&) {});
  const std::string plin = phi3("kvq_test_phi3_linear.gguf", [](kvq::test::GgufWriter& w, const ModelConfig&) {
    w.add_string("phi3.rope.scaling.type", "linear");
    w.add_f32("phi3.rope.scaling.factor", 2.0f);
  });
  auto shorter = Model::load(pr), longer = Model::load(pr), trained = Model::load(pr);
  shorter->set_context(128);
  trained->set_context(2048);
  EXPECT_FALSE(shorter->config().rope_long);
  EXPECT_TRUE(longer->config().rope_long);  // ctx 0: the trained context, 2048 > 128
  EXPECT_TRUE(trained->config().rope_long);
  EXPECT_EQ(longer->config().n_ctx_orig, 128);
  EXPECT_EQ(model_rope_note(longer->config(), 0), "[kvq] LongRoPE: the long factors (context 2048 > 128 original)");
  EXPECT_EQ(model_rope_note(shorter->config(), 128), "[kvq] LongRoPE: the short factors (context 128 <= 128 original)");
  auto plain = Model::load(pplain), lin = Model::load(plin);
  EXPECT_EQ(plain->config().n_ctx_orig, plain->config().n_ctx_train);
  EXPECT_EQ(model_rope_note(plain->config(), 0), "");
  const Tokenizer tok = Tokenizer::from_gguf(plain->file());
  const std::vector<int32_t> ids = tok.encode("Once upon a time, there was a big dog. The dog liked to run and play.", true);
  const auto lp = stories_logits(*plain, ids), ll = stories_logits(*lin, ids);
  EXPECT_LT(max_abs_diff(stories_logits(*shorter, ids), lp), 1e-4f);
  EXPECT_LT(max_abs_diff(stories_logits(*longer, ids), ll), 1e-4f);
  EXPECT_GT(max_abs_diff(lp, ll), 1e-2f);  // the two settings do differ on this prompt
  EXPECT_EQ(longer->kv_cache_config(kv_policy_uniform("f16", 5), 64).rope[0].freq_factors,
            std::vector<float>(size_t(longer->config().n_rot / 2), 2.0f));
  // set_context picks the set again (kvq eval runs each --ctx with its own)
  EXPECT_TRUE(longer->set_context(128));
  EXPECT_FALSE(longer->config().rope_long);
  EXPECT_LT(max_abs_diff(stories_logits(*longer, ids), lp), 1e-4f);
  EXPECT_FALSE(longer->set_context(100));
  EXPECT_TRUE(longer->set_context(0));
  EXPECT_LT(max_abs_diff(stories_logits(*longer, ids), ll), 1e-4f);
  // per-pair factors: long factors f_i = 4^(2i / n_rot) turn pair i as a base of 40000 would
  const std::string pb = phi3("kvq_test_phi3_base.gguf", [](kvq::test::GgufWriter& w, const ModelConfig&) {
    w.add_f32("phi3.rope.freq_base", 40000.f);
  });
  const std::string pv = phi3("kvq_test_phi3_varied.gguf", [](kvq::test::GgufWriter& w, const ModelConfig& c) {
    std::vector<float> f(size_t(c.n_rot / 2));
    for (size_t i = 0; i < f.size(); ++i) f[i] = std::pow(4.0f, 2.0f * float(i) / float(c.n_rot));
    w.add_tensor_f32("rope_factors_short.weight", {c.n_rot / 2}, std::vector<float>(f.size(), 1.0f));
    w.add_tensor_f32("rope_factors_long.weight", {c.n_rot / 2}, f);
    w.add_u32("phi3.rope.scaling.original_context_length", 128);
  });
  {
    auto mb = Model::load(pb), mv = Model::load(pv);
    EXPECT_LT(max_abs_diff(stories_logits(*mb, ids), stories_logits(*mv, ids)), 1e-3f);
  }
  fs::remove(pb);
  fs::remove(pv);

  // attn_factor on a partial rotation (4 of 8 dims): equal to the plain model with the rotated
  // dims of each head's q rows (the first 4, NeoX pairs (i, i + 2)) times a^2.
  const float a = 1.25f;
  auto partial = [](kvq::test::GgufWriter& w) { w.add_u32("phi3.rope.dimension_count", 4); };
  const std::vector<std::string> rot_key = {"phi3.rope.dimension_count"};
  const std::string pa = phi3(
      "kvq_test_phi3_attnf.gguf",
      [&](kvq::test::GgufWriter& w, const ModelConfig&) {
        partial(w);
        w.add_f32("phi3.rope.scaling.attn_factor", a);
      },
      rot_key);
  const std::string pq = phi3("kvq_test_phi3_qscaled.gguf", [&](kvq::test::GgufWriter& w, const ModelConfig& c) {
    partial(w);
    for (auto& t : w.tensors()) {
      if (t.name.find("attn_q.weight") == std::string::npos) continue;
      float* rows = reinterpret_cast<float*>(t.data.data());
      for (int h = 0; h < c.n_head; ++h)
        for (int j = 0; j < 4; ++j)
          for (int64_t i = 0; i < c.n_embd; ++i) rows[(size_t(h) * size_t(c.head_dim) + size_t(j)) * size_t(c.n_embd) + size_t(i)] *= a * a;
    }
  }, rot_key);
  auto ma = Model::load(pa), mq = Model::load(pq);
  EXPECT_EQ(ma->config().rope_attn_factor, a);
  EXPECT_EQ(ma->config().n_rot, 4);
  const auto la = stories_logits(*ma, ids), lq = stories_logits(*mq, ids);
  EXPECT_LT(max_abs_diff(la, lq), 1e-4f);
  EXPECT_GT(max_abs_diff(la, lp), 1e-2f);

  // one set of LongRoPE factors alone, both kinds of factors, or a bad attn_factor are refused
  const std::string p1 = phi3("kvq_test_phi3_onlylong.gguf", [](kvq::test::GgufWriter& w, const ModelConfig& c) {
    w.add_tensor_f32("rope_factors_long.weight", {c.n_rot / 2}, std::vector<float>(size_t(c.n_rot / 2), 2.0f));
  });
  const std::string p2 = phi3("kvq_test_phi3_both.gguf", [](kvq::test::GgufWriter& w, const ModelConfig& c) {
    for (const char* n : {"rope_factors_long.weight", "rope_factors_short.weight", "rope_freqs.weight"})
      w.add_tensor_f32(n, {c.n_rot / 2}, std::vector<float>(size_t(c.n_rot / 2), 2.0f));
  });
  const std::string p3 = phi3("kvq_test_phi3_badattnf.gguf", [](kvq::test::GgufWriter& w, const ModelConfig&) {
    w.add_f32("phi3.rope.scaling.attn_factor", std::nanf(""));
  });
  for (const auto& [p, what] : {std::pair<std::string, std::string>{p1, "needs both"}, {p2, "one set of RoPE factors"},
                                {p3, "attn_factor nan"}}) {
    try {
      Model::load(p);
      ADD_FAILURE() << p << " loaded";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  }
  shorter.reset(); longer.reset(); trained.reset(); plain.reset(); lin.reset(); ma.reset(); mq.reset();
  for (const auto& p : {pr, pplain, plin, pa, pq, p1, p2, p3}) fs::remove(p);
}

// SmolLM3: no RoPE on every 4th layer (stories260K has 5: layer 3), so there the cache's keys are
// the projections as they are, while the other layers rotate theirs; elsewhere the llama model.
TEST(ArchVariants, SmolLM3SkipsRopeOnEveryFourthLayer) {
  if (!fs::exists(shared_path("models/stories260K.gguf"))) GTEST_SKIP() << "stories260K.gguf not found";
  const auto tmp = fs::temp_directory_path();
  const std::string p3 = write_stories_as("smollm3", (tmp / "kvq_test_smollm3.gguf").string(), [](auto&, const auto&) {});
  const std::string pl = write_stories_as("llama", (tmp / "kvq_test_smollm3_ref.gguf").string(), [](auto&, const auto&) {});
  auto m3 = Model::load(p3), ml = Model::load(pl);
  const ModelConfig& c = m3->config();
  ASSERT_EQ(c.n_layer, 5);
  for (int il = 0; il < c.n_layer; ++il) EXPECT_EQ(c.layer_n_rot(il), il == 3 ? 0 : c.n_rot) << il;
  EXPECT_EQ(m3->kv_cache_config(kv_policy_uniform("f16", 5), 64).rope[3].n_rot, 0);
  const Tokenizer tok = Tokenizer::from_gguf(m3->file());
  const std::vector<int32_t> ids = tok.encode("Once upon a time, there was a big dog.", true);
  // keys as cached, per layer: rotated (k != k_pre) except on layer 3
  ThreadPool pool(1);
  KvCache cache(m3->kv_cache_config(kv_policy_uniform("f32", 5), 64));
  Forward f(*m3, pool);
  std::vector<float> rotated(5, 0.f);
  f.on_kv = [&](int il, int n, const float* kpre, const float* k, const float*) {
    for (size_t i = 0; i < size_t(n) * size_t(c.n_head_kv * c.head_dim); ++i)
      rotated[size_t(il)] = std::max(rotated[size_t(il)], std::fabs(k[i] - kpre[i]));
  };
  f.eval(ids.data(), int(ids.size()), cache);
  for (int il = 0; il < 5; ++il) {
    if (il == 3) EXPECT_EQ(rotated[size_t(il)], 0.f);
    else EXPECT_GT(rotated[size_t(il)], 1e-3f) << il;
  }
  // the first token (RoPE the identity at position 0) as the llama model; later tokens differ
  const auto a = stories_logits(*m3, ids), b = stories_logits(*ml, ids);
  const size_t nv = size_t(c.n_vocab);
  float first = 0, later = 0;
  for (size_t i = 0; i < a.size(); ++i) (i < nv ? first : later) = std::max(i < nv ? first : later, std::fabs(a[i] - b[i]));
  EXPECT_LT(first, 1e-4f);
  EXPECT_GT(later, 1e-2f);
  m3.reset();
  ml.reset();
  fs::remove(p3);
  fs::remove(pl);
}

// Granite's multipliers are the llama model with them folded into its weights: embedding_scale s
// into token_embd, residual_scale r into attn_output and ffn_down, attention.scale a into attn_q
// (times sqrt(head_dim)), logit_scale L into output (1 / L).
TEST(ArchVariants, GraniteMultipliersEqualFoldedWeights) {
  if (!fs::exists(shared_path("models/stories260K.gguf"))) GTEST_SKIP() << "stories260K.gguf not found";
  const auto tmp = fs::temp_directory_path();
  const float s = 3.f, r = 0.5f, a = 0.25f, L = 4.f;
  const std::string pg = write_stories_as("granite", (tmp / "kvq_test_granite.gguf").string(),
                                          [&](kvq::test::GgufWriter& w, const ModelConfig&) {
                                            w.add_f32("granite.embedding_scale", s).add_f32("granite.residual_scale", r);
                                            w.add_f32("granite.attention.scale", a).add_f32("granite.logit_scale", L);
                                          });
  const std::string pf = write_stories_as("llama", (tmp / "kvq_test_granite_folded.gguf").string(),
                                          [&](kvq::test::GgufWriter& w, const ModelConfig& c) {
    for (auto& t : w.tensors()) {
      float* x = reinterpret_cast<float*>(t.data.data());
      const size_t n = t.data.size() / sizeof(float);
      float k = 1.f;
      if (t.name == "token_embd.weight") k = s;
      else if (t.name == "output.weight") k = 1.f / L;
      else if (t.name.find("attn_output.weight") != std::string::npos || t.name.find("ffn_down.weight") != std::string::npos) k = r;
      else if (t.name.find("attn_q.weight") != std::string::npos) k = a * std::sqrt(float(c.head_dim));
      for (size_t i = 0; i < n; ++i) x[i] *= k;
    }
  });
  auto mg = Model::load(pg), mf = Model::load(pf);
  EXPECT_EQ(mg->config().logit_scale, L);
  EXPECT_EQ(mg->config().embd_mult, s);
  {  // rope.scaling.finetuned = false: no RoPE on any layer
    const std::string pr = write_stories_as("granite", (tmp / "kvq_test_granite_norope.gguf").string(),
                                            [](kvq::test::GgufWriter& w, const ModelConfig&) {
                                              w.add_f32("granite.logit_scale", 1.f).add_bool("granite.rope.scaling.finetuned", false);
                                            });
    auto mr = Model::load(pr);
    for (int il = 0; il < mr->config().n_layer; ++il) EXPECT_EQ(mr->config().layer_n_rot(il), 0) << il;
    mr.reset();
    fs::remove(pr);
  }
  ASSERT_FALSE(mf->config().tied_output);  // stories260K has its own output.weight (equal to token_embd)
  const Tokenizer tok = Tokenizer::from_gguf(mg->file());
  const std::vector<int32_t> ids = tok.encode("Once upon a time, there was a big dog.", true);
  const auto lg = stories_logits(*mg, ids), lf = stories_logits(*mf, ids);
  float worst = 0, mag = 0;
  for (size_t i = 0; i < lg.size(); ++i) {
    worst = std::max(worst, std::fabs(lg[i] - lf[i]));
    mag = std::max(mag, std::fabs(lf[i]));
  }
  EXPECT_LT(worst, 1e-4f * (1 + mag));
  // logit_scale is required; a bias Granite files may carry is refused rather than ignored
  const std::string pn = write_stories_as("granite", (tmp / "kvq_test_granite_nolog.gguf").string(), [](auto&, const auto&) {});
  const std::string pb = write_stories_as("granite", (tmp / "kvq_test_granite_bias.gguf").string(),
                                          [](kvq::test::GgufWriter& w, const ModelConfig& c) {
                                            w.add_f32("granite.logit_scale", 1.f);
                                            w.add_tensor_f32("blk.0.attn_output.bias", {c.n_embd}, std::vector<float>(size_t(c.n_embd), 0.f));
                                          });
  for (const auto& [p, what] : {std::pair<std::string, std::string>{pn, "granite.logit_scale"}, {pb, "biases in Granite's layers are not supported"}}) {
    try {
      Model::load(p);
      ADD_FAILURE() << p << " loaded";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  }
  mg.reset();
  mf.reset();
  for (const auto& p : {pg, pf, pn, pb}) fs::remove(p);
}

TEST(MoE, RouteIsSoftmaxTopKThenNormalized) {
  // probabilities softmax(logits); the k largest in decreasing order, ties to the lower index
  const float logits[5] = {1.f, 3.f, 2.f, 3.f, -1.f};
  double z = 0;
  for (float l : logits) z += std::exp(double(l));
  int sel[3];
  float w[3];
  moe_route(logits, 5, 2, false, sel, w);
  EXPECT_EQ(sel[0], 1);
  EXPECT_EQ(sel[1], 3);
  EXPECT_NEAR(w[0], std::exp(3.0) / z, 1e-7);
  EXPECT_NEAR(w[1], std::exp(3.0) / z, 1e-7);
  moe_route(logits, 5, 3, false, sel, w);
  EXPECT_EQ(sel[2], 2);
  EXPECT_NEAR(w[2], std::exp(2.0) / z, 1e-7);
  // normalized: divided by the chosen ones' sum
  moe_route(logits, 5, 3, true, sel, w);
  const double s = 2 * std::exp(3.0) + std::exp(2.0);
  EXPECT_NEAR(w[0], std::exp(3.0) / s, 1e-7);
  EXPECT_NEAR(w[2], std::exp(2.0) / s, 1e-7);
  EXPECT_NEAR(w[0] + w[1] + w[2], 1.0, 1e-6);
  // one expert, normalized: weight 1 whatever its probability; large logits do not overflow
  const float big[3] = {-500.f, 800.f, 799.f};
  moe_route(big, 3, 1, true, sel, w);
  EXPECT_EQ(sel[0], 1);
  EXPECT_EQ(w[0], 1.f);
  moe_route(big, 3, 2, false, sel, w);
  EXPECT_EQ(sel[1], 2);
  EXPECT_NEAR(w[0], 1 / (1 + std::exp(-1.0)), 1e-6);
  EXPECT_NEAR(w[1], std::exp(-1.0) / (1 + std::exp(-1.0)), 1e-6);
  // a NaN logit ranks last (its probability stays NaN, as the whole row's then)
  const float nan_row[3] = {std::nanf(""), 1.f, 2.f};
  moe_route(nan_row, 3, 3, false, sel, w);
  EXPECT_EQ(sel[0], 2);
  EXPECT_EQ(sel[1], 1);
  EXPECT_EQ(sel[2], 0);
}

namespace {
// Cuts each layer's F32 FFN (ffn_gate / ffn_up rows are channels, ffn_down rows are outputs) into
// a mixture of experts as llama.cpp's files hold one: channels [routed_from, n_ff) in n_exp equal
// slices (ffn_{gate,up,down}_exps, down times down_scale), channels [0, shared) as a shared expert
// (ffn_{gate,up,down}_shexp, down times shared_scale, with a zero ffn_gate_inp_shexp when
// shexp_gate), and a router of weights router(layer, expert, input).
struct MoeCut {
  int n_exp = 4;
  int routed_from = 0;
  int shared = 0;
  float down_scale = 1.f, shared_scale = 1.f;
  bool shexp_gate = false;
  // the routed experts' tensors' type: F32, or Q8_0 / MXFP4 (their input widths multiples of 32)
  GgmlType expert_type = GgmlType::F32;
  std::function<float(int, int, int)> router = [](int, int, int) { return 0.f; };
};
// llama.cpp's Q8_0 blocks: 32 values as one f16 scale (amax / 127) and 32 rounded int8 codes.
std::vector<uint8_t> quantize_q8_0(const std::vector<float>& x) {
  std::vector<uint8_t> out;
  for (size_t b = 0; b < x.size(); b += 32) {
    float amax = 0;
    for (size_t i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[b + i]));
    const float d = amax / 127.f, id = d > 0 ? 1.f / d : 0.f;
    const uint16_t dh = f32_to_f16(d);
    out.push_back(uint8_t(dh & 0xff));
    out.push_back(uint8_t(dh >> 8));
    for (size_t i = 0; i < 32; ++i) out.push_back(uint8_t(int8_t(std::lround(x[b + i] * id))));
  }
  return out;
}
// MXFP4 blocks: the smallest power-of-two scale d = 2^(e - 128) whose largest (doubled) level 12
// reaches the block's amax, each value the nearest of the levels 0, 1, 2, 3, 4, 6, 8, 12 times d
// with bit 3 the sign. Valid blocks, not llama.cpp's quantizer's choices.
std::vector<uint8_t> quantize_mxfp4(const std::vector<float>& x) {
  const float mag[8] = {0, 1, 2, 3, 4, 6, 8, 12};
  std::vector<uint8_t> out;
  for (size_t b = 0; b < x.size(); b += 32) {
    float amax = 0;
    for (size_t i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[b + i]));
    int e = 0;
    while (e < 254 && 12.f * std::ldexp(1.f, e - 128) < amax) ++e;
    const float d = std::ldexp(1.f, e - 128);
    uint8_t q[32];
    for (size_t i = 0; i < 32; ++i) {
      const float v = std::fabs(x[b + i]) / d;
      int best = 0;
      for (int k = 1; k < 8; ++k)
        if (std::fabs(mag[k] - v) < std::fabs(mag[best] - v)) best = k;
      q[i] = uint8_t(best | (x[b + i] < 0 ? 8 : 0));
    }
    out.push_back(uint8_t(e));
    for (size_t j = 0; j < 16; ++j) out.push_back(uint8_t(q[j] | (q[j + 16] << 4)));
  }
  return out;
}
void cut_into_experts(kvq::test::GgufWriter& w, const ModelConfig& c, const MoeCut& m) {
  auto& ts = w.tensors();
  auto take = [&](const std::string& name) {
    auto it = std::find_if(ts.begin(), ts.end(), [&](const auto& t) { return t.name == name; });
    EXPECT_NE(it, ts.end()) << name;
    EXPECT_EQ(it->type_id, uint32_t(GgmlType::F32));
    std::vector<float> v(it->data.size() / sizeof(float));
    std::memcpy(v.data(), it->data.data(), it->data.size());
    ts.erase(it);
    return v;
  };
  const int E = c.n_embd, F = c.n_ff, fe = (F - m.routed_from) / m.n_exp;
  ASSERT_EQ(fe * m.n_exp, F - m.routed_from);
  for (int il = 0; il < c.n_layer; ++il) {
    const std::string p = "blk." + std::to_string(il) + ".";
    const std::vector<float> gate = take(p + "ffn_gate.weight"), up = take(p + "ffn_up.weight"),
                             down = take(p + "ffn_down.weight");
    auto rows = [&](const std::vector<float>& x, int from, int n) {
      return std::vector<float>(x.begin() + ptrdiff_t(from) * E, x.begin() + ptrdiff_t(from + n) * E);
    };
    auto down_cols = [&](int from, int n, float scale) {
      std::vector<float> d;
      for (int o = 0; o < E; ++o)
        for (int j = from; j < from + n; ++j) d.push_back(down[size_t(o) * size_t(F) + size_t(j)] * scale);
      return d;
    };
    std::vector<float> de;
    for (int e = 0; e < m.n_exp; ++e) {
      const std::vector<float> d = down_cols(m.routed_from + e * fe, fe, m.down_scale);
      de.insert(de.end(), d.begin(), d.end());
    }
    auto add = [&](const std::string& name, const std::vector<int64_t>& ne, const std::vector<float>& v) {
      if (m.expert_type == GgmlType::Q8_0) w.add_tensor(name, GgmlType::Q8_0, ne, quantize_q8_0(v));
      else if (m.expert_type == GgmlType::MXFP4) w.add_tensor(name, GgmlType::MXFP4, ne, quantize_mxfp4(v));
      else w.add_tensor_f32(name, ne, v);
    };
    add(p + "ffn_gate_exps.weight", {E, fe, m.n_exp}, rows(gate, m.routed_from, fe * m.n_exp));
    add(p + "ffn_up_exps.weight", {E, fe, m.n_exp}, rows(up, m.routed_from, fe * m.n_exp));
    add(p + "ffn_down_exps.weight", {fe, E, m.n_exp}, de);
    std::vector<float> router;
    for (int e = 0; e < m.n_exp; ++e)
      for (int i = 0; i < E; ++i) router.push_back(m.router(il, e, i));
    w.add_tensor_f32(p + "ffn_gate_inp.weight", {E, m.n_exp}, router);
    if (m.shared > 0) {
      w.add_tensor_f32(p + "ffn_gate_shexp.weight", {E, m.shared}, rows(gate, 0, m.shared));
      w.add_tensor_f32(p + "ffn_up_shexp.weight", {E, m.shared}, rows(up, 0, m.shared));
      w.add_tensor_f32(p + "ffn_down_shexp.weight", {m.shared, E}, down_cols(0, m.shared, m.shared_scale));
      if (m.shexp_gate) w.add_tensor_f32(p + "ffn_gate_inp_shexp.weight", {E}, std::vector<float>(size_t(E), 0.f));
    }
  }
}
std::function<float(int, int, int)> random_router(float stddev, unsigned seed) {
  auto table = std::make_shared<std::vector<float>>();
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, stddev);
  for (int i = 0; i < 64 * 4 * 16; ++i) table->push_back(nd(rng));
  return [table](int il, int e, int i) { return (*table)[size_t((il * 4 + e) * 64 + i) % table->size()]; };
}
}  // namespace

// Mixtral's layout (llama with experts): the FFN cut into 4 slices of its channels, each expert's
// output times 4 and a zero router (every probability 1/4, all 4 experts run) computes the dense
// model, quantized-path and f32 reference loads alike; with 2 of 4 experts a decode step reads
// half the expert bytes.
TEST(ArchVariants, MixtralExpertsCuttingTheFfnComputeTheDenseModel) {
  if (!fs::exists(shared_path("models/stories260K.gguf"))) GTEST_SKIP() << "stories260K.gguf not found";
  const auto tmp = fs::temp_directory_path();
  auto mixtral = [&](const std::string& name, int used) {
    return write_stories_as("llama", (tmp / name).string(), [&](kvq::test::GgufWriter& w, const ModelConfig& c) {
      MoeCut m;
      m.down_scale = 4.f;
      cut_into_experts(w, c, m);
      w.add_u32("llama.expert_count", 4).add_u32("llama.expert_used_count", uint32_t(used));
      w.add_u32("llama.feed_forward_length", uint32_t(c.n_ff / 4));
    }, {"llama.feed_forward_length"});
  };
  const std::string pm = mixtral("kvq_test_mixtral.gguf", 4), p2 = mixtral("kvq_test_mixtral2.gguf", 2);
  const std::string pd = write_stories_as("llama", (tmp / "kvq_test_mixtral_dense.gguf").string(), [](auto&, const auto&) {});
  auto mm = Model::load(pm), md = Model::load(pd), m2 = Model::load(p2);
  const ModelConfig& c = mm->config();
  EXPECT_EQ(c.n_expert, 4);
  EXPECT_EQ(c.n_expert_used, 4);
  EXPECT_EQ(c.n_ff_exp, 43);
  EXPECT_TRUE(c.moe_norm_weights);
  EXPECT_EQ(c.n_ff_shexp, 0);
  EXPECT_EQ(mm->layer(0).ffn_gate_exps.size(), 4u);
  const Tokenizer tok = Tokenizer::from_gguf(mm->file());
  const std::vector<int32_t> ids = tok.encode("Once upon a time, a little girl named Lily found a ball.", true);
  const auto dense = stories_logits(*md, ids);
  EXPECT_LT(max_abs_diff(dense, stories_logits(*mm, ids)), 1e-3f);
  EXPECT_EQ(greedy(*mm, tok, {tok.bos()}, 100), greedy(*md, tok, {tok.bos()}, 100));
  auto m32 = Model::load_f32(pm);
  EXPECT_LT(max_abs_diff(dense, stories_logits(*m32, ids)), 1e-3f);
  // a token runs 2 of 4 experts: 2 experts' gate, up and down (43 x 64 F32 each) fewer per layer
  EXPECT_EQ(mm->decode_weight_bytes() - m2->decode_weight_bytes(), size_t(c.n_layer) * 2 * 3 * 43 * 64 * sizeof(float));
  EXPECT_EQ(mm->weights_bytes(), m2->weights_bytes());
  EXPECT_EQ(m2->decode_weight_bytes(2), mm->decode_weight_bytes());  // 2 sequences x 2 experts: all 4 at most
  EXPECT_EQ(m2->decode_weight_bytes(9), mm->decode_weight_bytes(1));
  // kvq plan reads the same counts from the file: all parameters, and those a token runs through
  const PlanModel pl = plan_model_from_gguf_path(p2);
  EXPECT_EQ(pl.n_expert, 4);
  EXPECT_EQ(pl.n_expert_used, 2);
  EXPECT_EQ(pl.n_params - pl.n_params_active, int64_t(c.n_layer) * 2 * 3 * 43 * 64);
  EXPECT_EQ(pl.weights_bytes, int64_t(m2->weights_bytes()));
  mm.reset();
  md.reset();
  m2.reset();
  m32.reset();
  for (const auto& p : {pm, p2, pd}) fs::remove(p);
}

// Qwen2-MoE's shared expert is added times sigmoid(ffn_gate_inp_shexp . x): the whole FFN as the
// shared expert with its down doubled behind a zero gate (sigmoid 0 = 1/2), beside routed experts
// whose down is zero, computes the dense model (its routing, 2 of 4 by a random router, then adds
// nothing). Granite MoE Shared's shared expert is ungated.
TEST(ArchVariants, SharedExpertsQwen2MoeGatedGraniteMoeNot) {
  if (!fs::exists(shared_path("models/stories260K.gguf"))) GTEST_SKIP() << "stories260K.gguf not found";
  const auto tmp = fs::temp_directory_path();
  const std::string pq = write_stories_as("qwen2moe", (tmp / "kvq_test_qwen2moe.gguf").string(),
                                          [](kvq::test::GgufWriter& w, const ModelConfig& c) {
    MoeCut m;
    m.shared = c.n_ff;
    m.shared_scale = 2.f;
    m.down_scale = 0.f;
    m.shexp_gate = true;
    m.router = random_router(1.f, 7);
    cut_into_experts(w, c, m);
    w.add_u32("qwen2moe.expert_count", 4).add_u32("qwen2moe.expert_used_count", 2);
    w.add_u32("qwen2moe.expert_feed_forward_length", uint32_t(c.n_ff / 4));
    w.add_u32("qwen2moe.expert_shared_feed_forward_length", uint32_t(c.n_ff));
    for (int il = 0; il < c.n_layer; ++il) {
      const std::string p = "blk." + std::to_string(il) + ".";
      w.add_tensor(p + "attn_q.bias", GgmlType::F32, {int64_t(c.n_head) * c.head_dim});
      w.add_tensor(p + "attn_k.bias", GgmlType::F32, {int64_t(c.n_head_kv) * c.head_dim});
      w.add_tensor(p + "attn_v.bias", GgmlType::F32, {int64_t(c.n_head_kv) * c.head_dim});
    }
  });
  const std::string pg = write_stories_as("granitemoe", (tmp / "kvq_test_granitemoe.gguf").string(),
                                          [](kvq::test::GgufWriter& w, const ModelConfig& c) {
    MoeCut m;
    m.shared = c.n_ff;
    m.down_scale = 0.f;
    m.router = random_router(1.f, 8);
    cut_into_experts(w, c, m);
    w.add_u32("granitemoe.expert_count", 4).add_u32("granitemoe.expert_used_count", 2);
    w.add_u32("granitemoe.feed_forward_length", uint32_t(c.n_ff / 4));
    w.add_u32("granitemoe.expert_shared_feed_forward_length", uint32_t(c.n_ff));
    w.add_f32("granitemoe.logit_scale", 1.f);
  }, {"granitemoe.feed_forward_length"});
  const std::string pd = write_stories_as("llama", (tmp / "kvq_test_shexp_dense.gguf").string(), [](auto&, const auto&) {});
  auto mq = Model::load(pq), mg = Model::load(pg), md = Model::load(pd);
  auto llama = Model::load(shared_path("models/stories260K.gguf"));
  EXPECT_TRUE(mq->config().shexp_gated && !mq->config().moe_norm_weights && mq->config().qkv_bias);
  EXPECT_EQ(mq->config().n_ff_exp, 43);
  EXPECT_EQ(mq->config().n_ff_shexp, 172);
  EXPECT_TRUE(!mg->config().shexp_gated && mg->config().moe_norm_weights);
  const Tokenizer tok = Tokenizer::from_gguf(mq->file());
  const std::vector<int32_t> ids = tok.encode("Once upon a time, a little girl named Lily found a ball.", true);
  EXPECT_LT(max_abs_diff(stories_logits(*llama, ids), stories_logits(*mq, ids)), 1e-3f);  // NeoX rows reordered
  EXPECT_LT(max_abs_diff(stories_logits(*md, ids), stories_logits(*mg, ids)), 1e-3f);
  mq.reset();
  mg.reset();
  md.reset();
  for (const auto& p : {pq, pg, pd}) fs::remove(p);
}

namespace {
// Pieces of the one-layer references below, in double: a file's F32 tensor, y = W x for W of
// `rows` rows, RMSNorm times weights, and the largest logit error relative to the logits' size.
const float* tensor_f32(const Model& m, const std::string& name) {
  const gguf::TensorInfo* t = m.file().find_tensor(name);
  EXPECT_NE(t, nullptr) << name;
  return t ? reinterpret_cast<const float*>(t->data) : nullptr;
}
std::vector<double> ref_mv(const float* W, const std::vector<double>& x, int rows) {
  std::vector<double> y(static_cast<size_t>(rows), 0.0);
  for (int r = 0; r < rows; ++r)
    for (size_t i = 0; i < x.size(); ++i) y[size_t(r)] += double(W[size_t(r) * x.size() + i]) * x[i];
  return y;
}
std::vector<double> ref_rms_norm(const std::vector<double>& x, const float* g, float eps) {
  double ss = 0;
  for (double v : x) ss += v * v;
  const double sc = 1.0 / std::sqrt(ss / double(x.size()) + double(eps));
  std::vector<double> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = x[i] * sc * g[i];
  return y;
}
// max |got - want| / (1 + max |want|)
double rel_logit_error(const std::vector<float>& got, const std::vector<double>& want) {
  double worst = 0, mag = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    worst = std::max(worst, std::fabs(double(got[i]) - want[i]));
    mag = std::max(mag, std::fabs(want[i]));
  }
  return worst / (1 + mag);
}
}  // namespace

// The whole model at its first token, computed here from the file's tensors: stories260K cut to
// one layer whose FFN is a mixture of experts (4 routed slices, 2 chosen by a random router, a
// shared expert behind a random gate for Qwen2-MoE, ungated for Granite MoE). At position 0
// attention returns each head's value, so the logits follow from embedding, norms, value and
// output projections, and the MoE FFN, which this reference computes on its own: softmax over
// the router's logits, the 2 largest, weights normalized (Mixtral, Qwen3-MoE, Granite) or not
// (Qwen2-MoE, OLMoE), SiLU-gated experts, the shared one. Qwen3-MoE's file leaves the experts' width to
// feed_forward_length / expert_used_count and gives the count as a per-layer array.
TEST(ArchVariants, OneLayerMixtureOfExpertsMatchesAReference) {
  if (!fs::exists(shared_path("models/stories260K.gguf"))) GTEST_SKIP() << "stories260K.gguf not found";
  for (const std::string arch : {"llama", "qwen2moe", "qwen3moe", "granitemoe", "granite", "olmoe"}) {
    SCOPED_TRACE(arch);
    const bool qwen = arch == "qwen2moe", qwen3 = arch == "qwen3moe", granite = arch.rfind("granite", 0) == 0;
    const bool olmoe = arch == "olmoe";
    const bool shared = qwen || arch == "granitemoe";
    const std::string path = (fs::temp_directory_path() / ("kvq_test_moe1_" + arch + ".gguf")).string();
    write_stories_as(arch, path, [&](kvq::test::GgufWriter& w, const ModelConfig& c) {
      MoeCut m;
      m.routed_from = shared ? 72 : 0;
      m.shared = shared ? 72 : 0;
      m.down_scale = 2.f;
      m.shexp_gate = qwen;
      m.router = random_router(0.05f, 11);
      cut_into_experts(w, c, m);
      auto& ts = w.tensors();
      ts.erase(std::remove_if(ts.begin(), ts.end(), [](const auto& t) { return t.name.rfind("blk.", 0) == 0 && t.name.rfind("blk.0.", 0) != 0; }),
               ts.end());
      for (auto& t : ts)
        if (t.name == "blk.0.ffn_gate_inp_shexp.weight")
          for (size_t i = 0; i < t.data.size() / 4; ++i) {
            const float v = 0.3f * std::sin(float(i));
            std::memcpy(t.data.data() + 4 * i, &v, 4);
          }
      const int fe = (c.n_ff - m.routed_from) / 4;
      w.add_u32(arch + ".block_count", 1).add_u32(arch + ".expert_count", 4);
      // expert_used_count as a per-layer array (one layer) for Qwen3-MoE, as llama.cpp accepts it
      if (qwen3) w.add_array("qwen3moe.expert_used_count", gguf::ValueType::u32, {kvq::test::gv::u32(2)});
      else w.add_u32(arch + ".expert_used_count", 2);
      if (qwen) {
        w.add_u32("qwen2moe.expert_feed_forward_length", uint32_t(fe)).add_u32("qwen2moe.expert_shared_feed_forward_length", 72);
        for (const char* b : {"attn_q", "attn_k", "attn_v"})
          w.add_tensor(std::string("blk.0.") + b + ".bias", GgmlType::F32, {int64_t(b[5] == 'q' ? c.n_head : c.n_head_kv) * c.head_dim});
      } else if (qwen3) {  // no expert_feed_forward_length: feed_forward_length / expert_used_count
        w.add_u32("qwen3moe.feed_forward_length", uint32_t(2 * fe));
        for (const char* nm : {"attn_q_norm", "attn_k_norm"})
          w.add_tensor_f32(std::string("blk.0.") + nm + ".weight", {c.head_dim}, std::vector<float>(size_t(c.head_dim), 1.f));
      } else {
        w.add_u32(arch + ".feed_forward_length", uint32_t(fe));
      }
      if (granite) w.add_f32(arch + ".logit_scale", 1.f);
      if (olmoe) {  // OLMoE's q / k norms span all heads
        w.add_tensor_f32("blk.0.attn_q_norm.weight", {int64_t(c.n_head) * c.head_dim}, std::vector<float>(size_t(c.n_head * c.head_dim), 1.f));
        w.add_tensor_f32("blk.0.attn_k_norm.weight", {int64_t(c.n_head_kv) * c.head_dim}, std::vector<float>(size_t(c.n_head_kv * c.head_dim), 1.f));
      }
      if (arch == "granitemoe") w.add_u32("granitemoe.expert_shared_feed_forward_length", 72);
    }, qwen ? std::vector<std::string>{"qwen2moe.block_count"}
            : std::vector<std::string>{arch + ".block_count", arch + ".feed_forward_length"});
    auto m = Model::load(path);
    const ModelConfig& c = m->config();
    ASSERT_EQ(c.n_layer, 1);
    EXPECT_EQ(c.moe_norm_weights, !qwen && !olmoe);
    EXPECT_EQ(c.n_ff_exp, shared ? 25 : 43);
    EXPECT_EQ(c.n_ff_shexp, shared ? 72 : 0);
    const int E = c.n_embd, hd = c.head_dim, group = c.n_head / c.n_head_kv, Fe = c.n_ff_exp;
    auto T = [&](const std::string& name) { return tensor_f32(*m, name); };
    const auto& mv = ref_mv;
    auto rmsn = [&](const std::vector<double>& x, const float* g) { return ref_rms_norm(x, g, c.rms_eps); };
    auto silu = [](double v) { return v / (1 + std::exp(-v)); };
    auto glu_ffn = [&](const float* G, const float* U, const float* D, int n_ch, const std::vector<double>& x) {
      const auto g = mv(G, x, n_ch), u = mv(U, x, n_ch);
      std::vector<double> h(static_cast<size_t>(n_ch));
      for (int j = 0; j < n_ch; ++j) h[size_t(j)] = silu(g[size_t(j)]) * u[size_t(j)];
      return mv(D, h, E);
    };
    const Tokenizer tok = Tokenizer::from_gguf(m->file());
    const int32_t bos = tok.bos();
    std::vector<double> x(static_cast<size_t>(E));
    for (int i = 0; i < E; ++i) x[size_t(i)] = T("token_embd.weight")[size_t(bos) * size_t(E) + size_t(i)];
    const auto v = mv(T("blk.0.attn_v.weight"), rmsn(x, T("blk.0.attn_norm.weight")), c.n_head_kv * hd);
    std::vector<double> heads(size_t(c.n_head) * size_t(hd));
    for (int h = 0; h < c.n_head; ++h)
      for (int d = 0; d < hd; ++d) heads[size_t(h * hd + d)] = v[size_t((h / group) * hd + d)];
    const auto o = mv(T("blk.0.attn_output.weight"), heads, E);
    for (int i = 0; i < E; ++i) x[size_t(i)] += o[size_t(i)];
    const auto xn = rmsn(x, T("blk.0.ffn_norm.weight"));
    const auto logit = mv(T("blk.0.ffn_gate_inp.weight"), xn, 4);
    std::vector<int> order = {0, 1, 2, 3};
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return logit[size_t(a)] > logit[size_t(b)]; });
    double z = 0;
    for (double l : logit) z += std::exp(l);
    double w0 = std::exp(logit[size_t(order[0])]) / z, w1 = std::exp(logit[size_t(order[1])]) / z;
    if (c.moe_norm_weights) {
      const double s = w0 + w1;
      w0 /= s;
      w1 /= s;
    }
    std::vector<double> ffn(size_t(E), 0.0);
    const size_t up_stride = size_t(Fe) * size_t(E), down_stride = size_t(E) * size_t(Fe);
    for (const auto& [e, we] : {std::pair<int, double>{order[0], w0}, {order[1], w1}}) {
      const auto y = glu_ffn(T("blk.0.ffn_gate_exps.weight") + size_t(e) * up_stride, T("blk.0.ffn_up_exps.weight") + size_t(e) * up_stride,
                             T("blk.0.ffn_down_exps.weight") + size_t(e) * down_stride, Fe, xn);
      for (int i = 0; i < E; ++i) ffn[size_t(i)] += we * y[size_t(i)];
    }
    if (shared) {
      const auto y = glu_ffn(T("blk.0.ffn_gate_shexp.weight"), T("blk.0.ffn_up_shexp.weight"), T("blk.0.ffn_down_shexp.weight"), 72, xn);
      const double g = qwen ? 1 / (1 + std::exp(-mv(T("blk.0.ffn_gate_inp_shexp.weight"), xn, 1)[0])) : 1.0;
      for (int i = 0; i < E; ++i) ffn[size_t(i)] += g * y[size_t(i)];
    }
    for (int i = 0; i < E; ++i) x[size_t(i)] += ffn[size_t(i)];
    const auto want = mv(T("output.weight"), rmsn(x, T("output_norm.weight")), c.n_vocab);
    EXPECT_LT(rel_logit_error(stories_logits(*m, {bos}), want), 1e-4);
    EXPECT_GT(std::fabs(logit[size_t(order[1])] - logit[size_t(order[2])]), 1e-3);  // not a near tie
    m.reset();
    fs::remove(path);
  }
}

// OLMo 2: no norm before attention or the FFN, RMSNorm of their outputs before the residual add
// (post_attention_norm, post_ffw_norm), and q / k normalized over all heads at once. Checked on
// stories260K cut to one layer at its first token against the same computation written out here
// (queries through the tap, where RoPE at position 0 is the identity; logits end to end).
TEST(ArchVariants, Olmo2PostNormsAndFullWidthQkNorm) {
  if (!fs::exists(shared_path("models/stories260K.gguf"))) GTEST_SKIP() << "stories260K.gguf not found";
  const std::string path = (fs::temp_directory_path() / "kvq_test_olmo2.gguf").string();
  write_stories_as("olmo2", path, [](kvq::test::GgufWriter& w, const ModelConfig& c) {
    auto& ts = w.tensors();
    ts.erase(std::remove_if(ts.begin(), ts.end(), [](const auto& t) {
               const bool other_layer = t.name.rfind("blk.", 0) == 0 && t.name.rfind("blk.0.", 0) != 0;
               return other_layer || t.name == "blk.0.attn_norm.weight" || t.name == "blk.0.ffn_norm.weight";
             }), ts.end());
    auto vec = [](size_t n, float base, float step) {
      std::vector<float> v(n);
      for (size_t i = 0; i < n; ++i) v[i] = base + step * std::sin(float(i) * 1.7f);
      return v;
    };
    const size_t qd = size_t(c.n_head * c.head_dim), kvd = size_t(c.n_head_kv * c.head_dim), E = size_t(c.n_embd);
    w.add_tensor_f32("blk.0.post_attention_norm.weight", {c.n_embd}, vec(E, 1.f, 0.3f));
    w.add_tensor_f32("blk.0.post_ffw_norm.weight", {c.n_embd}, vec(E, 0.8f, 0.2f));
    w.add_tensor_f32("blk.0.attn_q_norm.weight", {int64_t(qd)}, vec(qd, 1.f, 0.4f));
    w.add_tensor_f32("blk.0.attn_k_norm.weight", {int64_t(kvd)}, vec(kvd, 1.f, 0.4f));
    w.add_u32("olmo2.block_count", 1);
  }, {"olmo2.block_count"});
  auto m = Model::load(path);
  const ModelConfig& c = m->config();
  EXPECT_TRUE(c.qk_norm && c.qk_norm_full && c.post_norms && !c.pre_norms && c.rope_neox);
  EXPECT_FALSE(c.layer_sliding[0]);
  const int E = c.n_embd, qd = c.n_head * c.head_dim, hd = c.head_dim, group = c.n_head / c.n_head_kv;
  auto T = [&](const std::string& name) { return tensor_f32(*m, name); };
  const auto& mv = ref_mv;
  auto rmsn = [&](const std::vector<double>& x, const float* g) { return ref_rms_norm(x, g, c.rms_eps); };
  const Tokenizer tok = Tokenizer::from_gguf(m->file());
  const int32_t bos = tok.bos();
  std::vector<double> x(static_cast<size_t>(E));
  for (int i = 0; i < E; ++i) x[size_t(i)] = T("token_embd.weight")[size_t(bos) * size_t(E) + size_t(i)];
  // q: the raw embedding projected (no pre-norm), normalized over all 8 heads at once
  const int kvd = c.n_head_kv * hd;
  const auto q_want = rmsn(mv(T("blk.0.attn_q.weight"), x, qd), T("blk.0.attn_q_norm.weight"));
  const auto k_want = rmsn(mv(T("blk.0.attn_k.weight"), x, kvd), T("blk.0.attn_k_norm.weight"));
  std::vector<float> q_got, k_got;
  {
    ThreadPool pool(1);
    KvCache cache(m->kv_cache_config(kv_policy_uniform("f32", 1), 64));
    Forward f(*m, pool);
    f.on_q = [&](int, int n, const float* q) { q_got.assign(q, q + size_t(n) * size_t(qd)); };
    f.on_kv = [&](int, int n, const float* kpre, const float*, const float*) { k_got.assign(kpre, kpre + size_t(n) * size_t(kvd)); };
    f.eval(&bos, 1, cache);
  }
  ASSERT_EQ(q_got.size(), size_t(qd));
  ASSERT_EQ(k_got.size(), size_t(kvd));
  double q_worst = 0, k_worst = 0, head_rms_spread = 0;
  for (int i = 0; i < qd; ++i) q_worst = std::max(q_worst, std::fabs(double(q_got[size_t(i)]) - q_want[size_t(i)]));
  for (int i = 0; i < kvd; ++i) k_worst = std::max(k_worst, std::fabs(double(k_got[size_t(i)]) - k_want[size_t(i)]));
  EXPECT_LT(q_worst, 1e-5);
  EXPECT_LT(k_worst, 1e-5);
  {  // per-head norms would make every head's RMS ~ its weights'; all-heads-at-once does not
    std::vector<double> rms;
    for (int h = 0; h < c.n_head; ++h) {
      double ss = 0;
      for (int d = 0; d < hd; ++d) ss += double(q_got[size_t(h * hd + d)]) * q_got[size_t(h * hd + d)];
      rms.push_back(std::sqrt(ss / hd));
    }
    head_rms_spread = *std::max_element(rms.begin(), rms.end()) / *std::min_element(rms.begin(), rms.end());
  }
  EXPECT_GT(head_rms_spread, 1.5);
  // logits: x + post_attn_norm(attention), then + post_ffw_norm(FFN of that), no pre-norms
  const auto v = mv(T("blk.0.attn_v.weight"), x, c.n_head_kv * hd);
  std::vector<double> heads(static_cast<size_t>(qd));
  for (int h = 0; h < c.n_head; ++h)
    for (int d = 0; d < hd; ++d) heads[size_t(h * hd + d)] = v[size_t((h / group) * hd + d)];
  const auto o = rmsn(mv(T("blk.0.attn_output.weight"), heads, E), T("blk.0.post_attention_norm.weight"));
  for (int i = 0; i < E; ++i) x[size_t(i)] += o[size_t(i)];
  const auto g = mv(T("blk.0.ffn_gate.weight"), x, c.n_ff), u = mv(T("blk.0.ffn_up.weight"), x, c.n_ff);
  std::vector<double> hmid(static_cast<size_t>(c.n_ff));
  for (int j = 0; j < c.n_ff; ++j) hmid[size_t(j)] = g[size_t(j)] / (1 + std::exp(-g[size_t(j)])) * u[size_t(j)];
  const auto ffn = rmsn(mv(T("blk.0.ffn_down.weight"), hmid, E), T("blk.0.post_ffw_norm.weight"));
  for (int i = 0; i < E; ++i) x[size_t(i)] += ffn[size_t(i)];
  const auto want = mv(T("output.weight"), rmsn(x, T("output_norm.weight")), c.n_vocab);
  EXPECT_LT(rel_logit_error(stories_logits(*m, {bos}), want), 1e-4);
  m.reset();
  fs::remove(path);
  // OLMo 3 (olmo2 with a sliding window): 3 local layers, then a global one; local RoPE unscaled and
  // at the global base
  const std::string p3 = (fs::temp_directory_path() / "kvq_test_olmo3.gguf").string();
  write_stories_as("olmo2", p3, [](kvq::test::GgufWriter& w, const ModelConfig& c) {
    as_olmo2(w, c);
    w.add_u32("olmo2.attention.sliding_window", 16).add_f32("olmo2.rope.freq_base_swa", 5000.f);
    w.add_f32("olmo2.rope.scaling.factor", 2.f).add_string("olmo2.rope.scaling.type", "linear");
  });
  auto m3 = Model::load(p3);
  const ModelConfig& c3 = m3->config();
  for (int il = 0; il < c3.n_layer; ++il) {
    EXPECT_EQ(c3.layer_sliding[size_t(il)], il % 4 != 3) << il;
    EXPECT_EQ(c3.layer_window(il), il % 4 != 3 ? 16 : 0) << il;
    EXPECT_EQ(c3.layer_rope_scale(il), il % 4 != 3 ? 1.f : 2.f) << il;
    EXPECT_EQ(c3.layer_rope_base(il), 10000.f) << il;  // rope.freq_base_swa not used, as in llama.cpp's graph
  }
  m3.reset();
  fs::remove(p3);
}

// Routed rows: two sequences whose tokens pick experts (2 of 4, random router) in one decode
// step get what each gets alone, so the rows gathered per expert are scattered back to their own.
TEST(ArchVariants, ExpertRowsBatchedEqualAlone) {
  if (!fs::exists(shared_path("models/stories260K.gguf"))) GTEST_SKIP() << "stories260K.gguf not found";
  const std::string path = (fs::temp_directory_path() / "kvq_test_qwen3moe.gguf").string();
  write_stories_as("qwen3moe", path, [](kvq::test::GgufWriter& w, const ModelConfig& c) {
    MoeCut m;
    m.down_scale = 2.f;
    m.router = random_router(2.f, 3);
    cut_into_experts(w, c, m);
    w.add_u32("qwen3moe.expert_count", 4).add_u32("qwen3moe.expert_used_count", 2);
    w.add_u32("qwen3moe.expert_feed_forward_length", uint32_t(c.n_ff / 4));
    for (int il = 0; il < c.n_layer; ++il)
      for (const char* nm : {"attn_q_norm", "attn_k_norm"})
        w.add_tensor_f32("blk." + std::to_string(il) + "." + nm + ".weight", {c.head_dim}, std::vector<float>(size_t(c.head_dim), 1.f));
  });
  auto m = Model::load(path);
  const Tokenizer tok = Tokenizer::from_gguf(m->file());
  const int nv = m->config().n_vocab;
  ThreadPool pool(2);
  auto cfg = m->kv_cache_config(kv_policy_uniform("f32", m->config().n_layer), 256);
  std::vector<std::vector<int32_t>> prompts = {tok.encode("Once upon a time, there was a big dog.", true),
                                               tok.encode("Tom and Sue went to the park to play with a red ball", true),
                                               tok.encode("The cat sat", true)};
  std::vector<std::vector<float>> alone;
  for (const auto& ids : prompts) {
    KvCache c(cfg);
    Forward f(*m, pool);
    f.eval(ids.data(), int(ids.size()) - 1, c);
    const float* l = f.eval(ids.data() + ids.size() - 1, 1, c);
    alone.emplace_back(l, l + nv);
  }
  std::vector<std::unique_ptr<KvCache>> caches;
  Forward f(*m, pool);
  std::vector<ForwardSeq> seqs;
  for (const auto& ids : prompts) {
    caches.push_back(std::make_unique<KvCache>(cfg));
    f.eval(ids.data(), int(ids.size()) - 1, *caches.back());
    seqs.push_back({ids.data() + ids.size() - 1, 1, caches.back().get(), ForwardSeq::last});
  }
  const float* l = f.eval_batch(seqs.data(), int(seqs.size()));
  float worst = 0, spread = 0;
  for (size_t s = 0; s < prompts.size(); ++s)
    for (int i = 0; i < nv; ++i) {
      worst = std::max(worst, std::fabs(l[s * size_t(nv) + size_t(i)] - alone[s][size_t(i)]));
      spread = std::max(spread, std::fabs(alone[s][size_t(i)] - alone[0][size_t(i)]));
    }
  EXPECT_LT(worst, 1e-4f);
  EXPECT_GT(spread, 0.1f);  // the sequences' logits differ: a mixed-up row would show
  // a prompt's rows in one step (each expert's rows gathered from the whole prompt) as one by one
  const auto& ids = prompts[1];
  KvCache c1(cfg), c2(cfg);
  Forward f1(*m, pool), f2(*m, pool);
  const float* all = f1.eval(ids.data(), int(ids.size()), c1, true);
  const std::vector<float> whole(all, all + ids.size() * size_t(nv));
  float step_worst = 0;
  for (size_t t = 0; t < ids.size(); ++t) {
    const float* one = f2.eval(ids.data() + t, 1, c2);
    for (int i = 0; i < nv; ++i) step_worst = std::max(step_worst, std::fabs(one[i] - whole[t * size_t(nv) + size_t(i)]));
  }
  EXPECT_LT(step_worst, 1e-4f);
  m.reset();
  fs::remove(path);
}

// Expert tensors in a quantized type (Q8_0, and MXFP4 as gpt-oss stores its experts: the down
// projections' rows are one 17-byte block, so most start at odd offsets): each expert's rows are
// viewed at its own offset of the 3-D tensor, and the quantized kernels (8-bit activations) agree
// with the f32 reference load (weights dequantized, f32 activations) as closely as on a dense model.
TEST(ArchVariants, QuantizedExpertTensors) {
  if (!fs::exists(shared_path("models/stories260K.gguf"))) GTEST_SKIP() << "stories260K.gguf not found";
  for (GgmlType type : {GgmlType::Q8_0, GgmlType::MXFP4}) {
    SCOPED_TRACE(ggml_type_name(type));
    // MXFP4 runs all 4 experts, weighted by the router: with 2 of 4, its 4-bit weights leave token
    // 9 with a near-tie in the last layer's router (experts 2 and 0: 0.076 vs 0.070 with 8-bit
    // activations, 0.073 vs 0.077 in the f32 load), which picks another expert there (a 5.8 logit
    // gap at every kernel level, the other tokens 0.1-0.6)
    const uint32_t used = type == GgmlType::MXFP4 ? 4 : 2;
    const std::string path = (fs::temp_directory_path() / (std::string("kvq_test_moe_") + ggml_type_name(type) + ".gguf")).string();
    write_stories_as("llama", path, [type, used](kvq::test::GgufWriter& w, const ModelConfig& c) {
      MoeCut m;
      m.routed_from = c.n_ff - 4 * 32;  // experts of 32 channels, one block
      m.down_scale = 4.f;
      m.expert_type = type;
      m.router = random_router(0.05f, 5);
      cut_into_experts(w, c, m);
      w.add_u32("llama.expert_count", 4).add_u32("llama.expert_used_count", used).add_u32("llama.feed_forward_length", 32);
    }, {"llama.feed_forward_length"});
    auto q = Model::load(path), r = Model::load_f32(path);
    EXPECT_EQ(q->layer(0).ffn_down_exps[3].type, type);
    EXPECT_EQ(r->layer(0).ffn_down_exps[3].type, GgmlType::F32);
    const Tokenizer tok = Tokenizer::from_gguf(q->file());
    const std::vector<int32_t> ids = tok.encode("Once upon a time, a little girl named Lily found a ball.", true);
    const auto a = stories_logits(*q, ids), b = stories_logits(*r, ids);
    const size_t nv = size_t(q->config().n_vocab);
    float mag = 0;
    for (float x : b) mag = std::max(mag, std::fabs(x));
    EXPECT_LT(max_abs_diff(a, b), 0.05f * mag);  // 8-bit activations: 0.013-0.037 x mag per token
    for (size_t t = 0; t < ids.size(); ++t)
      EXPECT_EQ(std::max_element(a.begin() + ptrdiff_t(t * nv), a.begin() + ptrdiff_t((t + 1) * nv)) - a.begin(),
                std::max_element(b.begin() + ptrdiff_t(t * nv), b.begin() + ptrdiff_t((t + 1) * nv)) - b.begin()) << t;
    q.reset();
    r.reset();
    fs::remove(path);
  }
}

// Experts in files kvq does not run them in, missing or inconsistent counts, and expert tensors
// of the wrong shape are refused with the key or tensor named.
// gpt-oss: stories260K cut to two layers (a sliding-window one of 3 tokens, then a global one)
// with every gpt-oss part: q / k / v and output biases, a sink logit per query head, NeoX RoPE,
// the FFN norm named post_attention_norm, 4 experts of which the router (plus its bias) picks 2 by
// their logits, weighted by the softmax over those 2, each with gate / up / down biases and the
// clamped SwiGLU (limit 7, alpha 1.702). The logits of every position, prefilled at once and
// decoded token by token, against the whole computation written out here in double.
TEST(ArchVariants, GptOssMatchesAReference) {
  if (!fs::exists(shared_path("models/stories260K.gguf"))) GTEST_SKIP() << "stories260K.gguf not found";
  const std::string path = (fs::temp_directory_path() / "kvq_test_gpt_oss.gguf").string();
  const int W = 3, n_exp = 4;
  std::mt19937 rng(31);
  std::normal_distribution<float> nd;
  write_stories_as("gpt-oss", path, [&](kvq::test::GgufWriter& w, const ModelConfig& c) {
    MoeCut m;
    m.n_exp = n_exp;
    m.down_scale = 2.f;
    m.router = random_router(0.3f, 7);
    cut_into_experts(w, c, m);
    auto& ts = w.tensors();
    ts.erase(std::remove_if(ts.begin(), ts.end(), [](const auto& t) {
               return t.name.rfind("blk.", 0) == 0 && t.name.rfind("blk.0.", 0) != 0 && t.name.rfind("blk.1.", 0) != 0;
             }), ts.end());
    for (auto& t : ts)  // the FFN norm's name in gpt-oss files
      if (t.name.size() > 16 && t.name.substr(t.name.size() - 16) == ".ffn_norm.weight")
        t.name = t.name.substr(0, t.name.size() - 15) + "post_attention_norm.weight";
    auto rnd = [&](size_t n, float sd) {
      std::vector<float> v(n);
      for (auto& x : v) x = nd(rng) * sd;
      return v;
    };
    const int64_t E = c.n_embd, qd = int64_t(c.n_head) * c.head_dim, kvd = int64_t(c.n_head_kv) * c.head_dim, fe = c.n_ff / n_exp;
    for (int il = 0; il < 2; ++il) {
      const std::string p = "blk." + std::to_string(il) + ".";
      w.add_tensor_f32(p + "attn_q.bias", {qd}, rnd(size_t(qd), 0.3f));
      w.add_tensor_f32(p + "attn_k.bias", {kvd}, rnd(size_t(kvd), 0.3f));
      w.add_tensor_f32(p + "attn_v.bias", {kvd}, rnd(size_t(kvd), 0.3f));
      w.add_tensor_f32(p + "attn_output.bias", {E}, rnd(size_t(E), 0.1f));
      w.add_tensor_f32(p + "attn_sinks.weight", {c.n_head}, rnd(size_t(c.n_head), 1.5f));
      w.add_tensor_f32(p + "ffn_gate_inp.bias", {n_exp}, rnd(size_t(n_exp), 0.5f));
      w.add_tensor_f32(p + "ffn_gate_exps.bias", {fe, n_exp}, rnd(size_t(fe * n_exp), 0.5f));
      w.add_tensor_f32(p + "ffn_up_exps.bias", {fe, n_exp}, rnd(size_t(fe * n_exp), 0.5f));
      w.add_tensor_f32(p + "ffn_down_exps.bias", {E, n_exp}, rnd(size_t(E * n_exp), 0.1f));
    }
    w.add_u32("gpt-oss.block_count", 2).add_u32("gpt-oss.expert_count", uint32_t(n_exp)).add_u32("gpt-oss.expert_used_count", 2);
    w.add_u32("gpt-oss.expert_feed_forward_length", uint32_t(fe)).add_u32("gpt-oss.attention.sliding_window", uint32_t(W));
  }, {"gpt-oss.block_count"});
  auto m = Model::load(path);
  const ModelConfig& c = m->config();
  ASSERT_EQ(c.n_layer, 2);
  EXPECT_TRUE(c.layer_sliding[0]);
  EXPECT_FALSE(c.layer_sliding[1]);
  EXPECT_EQ(c.sliding_window, W);
  EXPECT_TRUE(c.rope_neox && c.qkv_bias && c.attn_out_bias && c.attn_sinks && c.swiglu_oai && c.moe_softmax_chosen);
  EXPECT_FALSE(c.moe_norm_weights);
  const int E = c.n_embd, hd = c.head_dim, nh = c.n_head, nkv = c.n_head_kv, group = nh / nkv, Fe = c.n_ff_exp;
  EXPECT_EQ(Fe, 43);
  auto T = [&](const std::string& name) { return tensor_f32(*m, name); };
  const auto& mv = ref_mv;
  auto rmsn = [&](const std::vector<double>& x, const float* g) { return ref_rms_norm(x, g, c.rms_eps); };
  auto plus = [](std::vector<double> a, const float* b) {
    for (size_t i = 0; i < a.size(); ++i) a[i] += b[i];
    return a;
  };
  const Tokenizer tok = Tokenizer::from_gguf(m->file());
  const std::vector<int32_t> ids = tok.encode("Once upon a time there was a little fox who", true, false);
  const int n = int(ids.size());
  ASSERT_GE(n, 8);
  std::vector<std::vector<double>> x(static_cast<size_t>(n), std::vector<double>(static_cast<size_t>(E)));
  for (int t = 0; t < n; ++t)
    for (int i = 0; i < E; ++i) x[size_t(t)][size_t(i)] = T("token_embd.weight")[size_t(ids[size_t(t)]) * size_t(E) + size_t(i)];
  int chose_differently = 0;
  for (int il = 0; il < 2; ++il) {
    const std::string p = "blk." + std::to_string(il) + ".";
    std::vector<std::vector<double>> q(static_cast<size_t>(n)), k(static_cast<size_t>(n)), v(static_cast<size_t>(n));
    for (int t = 0; t < n; ++t) {
      const auto xn = rmsn(x[size_t(t)], T(p + "attn_norm.weight"));
      q[size_t(t)] = plus(mv(T(p + "attn_q.weight"), xn, nh * hd), T(p + "attn_q.bias"));
      k[size_t(t)] = plus(mv(T(p + "attn_k.weight"), xn, nkv * hd), T(p + "attn_k.bias"));
      v[size_t(t)] = plus(mv(T(p + "attn_v.weight"), xn, nkv * hd), T(p + "attn_v.bias"));
      for (auto* r : {&q[size_t(t)], &k[size_t(t)]})  // NeoX RoPE: pairs (i, i + hd / 2)
        for (size_t h = 0; h < r->size() / size_t(hd); ++h)
          for (int i = 0; i < hd / 2; ++i) {
            const double th = double(t) * std::pow(double(c.rope_base), -2.0 * i / hd);
            double& a = (*r)[h * size_t(hd) + size_t(i)];
            double& b = (*r)[h * size_t(hd) + size_t(i + hd / 2)];
            const double a0 = a, b0 = b;
            a = a0 * std::cos(th) - b0 * std::sin(th);
            b = a0 * std::sin(th) + b0 * std::cos(th);
          }
    }
    const float* sinks = T(p + "attn_sinks.weight");
    for (int t = 0; t < n; ++t) {
      std::vector<double> att(static_cast<size_t>(nh * hd), 0.0);
      const int first = il == 0 ? std::max(0, t - W + 1) : 0;
      for (int h = 0; h < nh; ++h) {
        const int kh = h / group;
        std::vector<double> s;
        double mx = sinks[h];
        for (int j = first; j <= t; ++j) {
          double d = 0;
          for (int e = 0; e < hd; ++e) d += q[size_t(t)][size_t(h * hd + e)] * k[size_t(j)][size_t(kh * hd + e)];
          s.push_back(d / std::sqrt(double(hd)));
          mx = std::max(mx, s.back());
        }
        double l = std::exp(double(sinks[h]) - mx);
        for (double& d : s) l += (d = std::exp(d - mx));
        for (int j = first; j <= t; ++j)
          for (int e = 0; e < hd; ++e) att[size_t(h * hd + e)] += s[size_t(j - first)] / l * v[size_t(j)][size_t(kh * hd + e)];
      }
      const auto o = plus(mv(T(p + "attn_output.weight"), att, E), T(p + "attn_output.bias"));
      for (int i = 0; i < E; ++i) x[size_t(t)][size_t(i)] += o[size_t(i)];
      const auto xn = rmsn(x[size_t(t)], T(p + "post_attention_norm.weight"));
      const auto logit = plus(mv(T(p + "ffn_gate_inp.weight"), xn, n_exp), T(p + "ffn_gate_inp.bias"));
      std::vector<int> order(static_cast<size_t>(n_exp));
      std::iota(order.begin(), order.end(), 0);
      std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return logit[size_t(a)] > logit[size_t(b)]; });
      EXPECT_GT(logit[size_t(order[1])] - logit[size_t(order[2])], 1e-4) << "a near tie in the routing";
      // softmax over the two chosen logits (not over all four, renormalized: the same thing) ...
      const double w0 = 1 / (1 + std::exp(logit[size_t(order[1])] - logit[size_t(order[0])])), w1 = 1 - w0;
      // ... whose choice differs from the one a router without its bias would make for some tokens
      const auto unbiased = mv(T(p + "ffn_gate_inp.weight"), xn, n_exp);
      if (std::max_element(unbiased.begin(), unbiased.end()) - unbiased.begin() != order[0]) ++chose_differently;
      const size_t up_stride = size_t(Fe) * size_t(E), down_stride = size_t(E) * size_t(Fe);
      for (const auto& [e, we] : {std::pair<int, double>{order[0], w0}, {order[1], w1}}) {
        const auto g = plus(mv(T(p + "ffn_gate_exps.weight") + size_t(e) * up_stride, xn, Fe), T(p + "ffn_gate_exps.bias") + size_t(e) * size_t(Fe));
        const auto u = plus(mv(T(p + "ffn_up_exps.weight") + size_t(e) * up_stride, xn, Fe), T(p + "ffn_up_exps.bias") + size_t(e) * size_t(Fe));
        std::vector<double> hh(static_cast<size_t>(Fe));
        for (int j = 0; j < Fe; ++j) {
          const double gg = std::min(g[size_t(j)], 7.0), uu = std::clamp(u[size_t(j)], -7.0, 7.0);
          hh[size_t(j)] = gg / (1 + std::exp(-1.702 * gg)) * (uu + 1);
        }
        const auto y = plus(mv(T(p + "ffn_down_exps.weight") + size_t(e) * down_stride, hh, E), T(p + "ffn_down_exps.bias") + size_t(e) * size_t(E));
        for (int i = 0; i < E; ++i) x[size_t(t)][size_t(i)] += we * y[size_t(i)];
      }
    }
  }
  EXPECT_GT(chose_differently, 0);
  {  // YaRN in the file: gpt-oss's sliding-window layers are scaled as its global ones (as llama.cpp
     // runs them: their freq_scale is the file's), magnitude included
    const std::string yp = (fs::temp_directory_path() / "kvq_test_gpt_oss_yarn.gguf").string();
    write_stories_as("gpt-oss", yp, [&](kvq::test::GgufWriter& w, const ModelConfig&) {
      for (const auto& t : m->file().tensors()) w.add_tensor(t.name, t.type, t.ne, std::vector<uint8_t>(t.data, t.data + t.nbytes));
      w.tensors().erase(w.tensors().begin(), w.tensors().begin() + ptrdiff_t(w.tensors().size() - m->file().tensors().size()));
      w.add_u32("gpt-oss.block_count", 2).add_u32("gpt-oss.expert_count", uint32_t(n_exp)).add_u32("gpt-oss.expert_used_count", 2);
      w.add_u32("gpt-oss.expert_feed_forward_length", uint32_t(Fe)).add_u32("gpt-oss.attention.sliding_window", uint32_t(W));
      w.add_string("gpt-oss.rope.scaling.type", "yarn").add_f32("gpt-oss.rope.scaling.factor", 4.f);
      w.add_u32("gpt-oss.rope.scaling.original_context_length", 128);
    }, {"gpt-oss.block_count"});
    auto ym = Model::load(yp);
    const ModelConfig& yc = ym->config();
    ASSERT_TRUE(yc.layer_sliding[0] && !yc.layer_sliding[1]);
    const KvRope r0 = model_layer_rope(yc, 0), r1 = model_layer_rope(yc, 1);
    EXPECT_EQ(r0.freq_factors, r1.freq_factors);
    ASSERT_EQ(r0.freq_factors.size(), size_t(hd / 2));
    EXPECT_GT(r0.freq_factors.back(), 3.9f);  // the slowest pair interpolated by ~4
    EXPECT_NEAR(model_layer_rope_mscale(yc, 0), 1 + 0.1 * std::log(4.0), 1e-6);
    EXPECT_EQ(model_layer_rope_mscale(yc, 0), model_layer_rope_mscale(yc, 1));
    ym.reset();
    fs::remove(yp);
  }
  const std::vector<float> pre = stories_logits(*m, ids);
  std::vector<float> dec;
  {
    ThreadPool pool(2);
    KvCache cache(m->kv_cache_config(kv_policy_uniform("f32", c.n_layer), 64));
    Forward fwd(*m, pool);
    for (int t = 0; t < n; ++t) {
      const float* l = fwd.eval(&ids[size_t(t)], 1, cache);
      dec.insert(dec.end(), l, l + c.n_vocab);
    }
  }
  for (int t = 0; t < n; ++t) {
    const auto want = mv(T(c.tied_output ? "token_embd.weight" : "output.weight"), rmsn(x[size_t(t)], T("output_norm.weight")), c.n_vocab);
    const std::vector<float> got_pre(pre.begin() + ptrdiff_t(t) * c.n_vocab, pre.begin() + ptrdiff_t(t + 1) * c.n_vocab);
    const std::vector<float> got_dec(dec.begin() + ptrdiff_t(t) * c.n_vocab, dec.begin() + ptrdiff_t(t + 1) * c.n_vocab);
    EXPECT_LT(rel_logit_error(got_pre, want), 1e-4) << "prefill, position " << t;
    EXPECT_LT(rel_logit_error(got_dec, want), 1e-4) << "decode, position " << t;
  }
  m.reset();
  fs::remove(path);
}

TEST(ArchVariants, ExpertMetadataAndShapesAreChecked) {
  if (!fs::exists(shared_path("models/stories260K.gguf"))) GTEST_SKIP() << "stories260K.gguf not found";
  const auto tmp = fs::temp_directory_path();
  struct Case {
    std::string arch, what;
    std::function<void(kvq::test::GgufWriter&, const ModelConfig&)> edit;
    std::vector<std::string> drop;
  };
  auto cut = [](int n_exp) {
    return [n_exp](kvq::test::GgufWriter& w, const ModelConfig& c) {
      MoeCut m;
      m.n_exp = n_exp;
      cut_into_experts(w, c, m);
    };
  };
  const std::vector<Case> cases = {
      {"qwen2", "experts are not supported in a qwen2 model",
       [](kvq::test::GgufWriter& w, const ModelConfig&) { w.add_u32("qwen2.expert_count", 4).add_u32("qwen2.expert_used_count", 2); }, {}},
      {"qwen3moe", "needs 'qwen3moe.expert_count' > 0", [](auto&, const auto&) {}, {}},
      {"llama", "'llama.expert_used_count' = 5 must be in [1, 4]",
       [&](kvq::test::GgufWriter& w, const ModelConfig& c) {
         cut(4)(w, c);
         w.add_u32("llama.expert_count", 4).add_u32("llama.expert_used_count", 5).add_u32("llama.feed_forward_length", 43);
       }, {"llama.feed_forward_length"}},
      {"llama", "'blk.0.ffn_gate_exps.weight' has shape [64, 43, 4], expected [64, 172, 4]",
       [&](kvq::test::GgufWriter& w, const ModelConfig& c) {
         cut(4)(w, c);
         w.add_u32("llama.expert_count", 4).add_u32("llama.expert_used_count", 2);
       }, {}},
      {"llama", "'llama.expert_count' = 2000 is out of range [1, 1024]",
       [](kvq::test::GgufWriter& w, const ModelConfig&) { w.add_u32("llama.expert_count", 2000).add_u32("llama.expert_used_count", 2); }, {}},
      {"llama", "without 'llama.expert_used_count'",
       [](kvq::test::GgufWriter& w, const ModelConfig&) { w.add_u32("llama.expert_count", 4); }, {}},
      {"qwen3moe", "'qwen3moe.expert_used_count' must hold one integer for every layer",
       [](kvq::test::GgufWriter& w, const ModelConfig&) {
         w.add_u32("qwen3moe.expert_count", 4);
         w.add_array("qwen3moe.expert_used_count", gguf::ValueType::u32, {kvq::test::gv::u32(2), kvq::test::gv::u32(3)});
       }, {}},
      {"qwen3moe", "routing within expert groups is not supported",
       [](kvq::test::GgufWriter& w, const ModelConfig&) {
         w.add_u32("qwen3moe.expert_count", 4).add_u32("qwen3moe.expert_used_count", 2).add_u32("qwen3moe.expert_group_count", 2);
       }, {}},
      {"llama", "missing tensor 'blk.0.ffn_gate_inp.weight'",
       [&](kvq::test::GgufWriter& w, const ModelConfig& c) {
         cut(4)(w, c);
         auto& ts = w.tensors();
         ts.erase(std::find_if(ts.begin(), ts.end(), [](const auto& t) { return t.name == "blk.0.ffn_gate_inp.weight"; }));
         w.add_u32("llama.expert_count", 4).add_u32("llama.expert_used_count", 2).add_u32("llama.feed_forward_length", 43);
       }, {"llama.feed_forward_length"}},
  };
  for (const Case& k : cases) {
    SCOPED_TRACE(k.what);
    const std::string p = write_stories_as(k.arch, (tmp / "kvq_test_moe_bad.gguf").string(), k.edit, k.drop);
    try {
      Model::load(p);
      ADD_FAILURE() << "loaded";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(k.what), std::string::npos) << e.what();
    }
    fs::remove(p);
  }
}

// Gemma 2 and Gemma 3 hyperparameters: the sliding-window layout (the file's pattern, else each
// architecture's own), the soft-caps (Gemma 2's 50 / 30 by default), the 27B models' attention
// scale, and the local layers' RoPE.
TEST(ModelConfig, GemmaLayoutsSoftcapsAndScales) {
  using kvq::test::GgufWriter;
  auto cfg = [](const std::string& arch, int n_layer, const std::function<void(GgufWriter&)>& extra) {
    GgufWriter w;
    w.add_string("general.architecture", arch);
    const std::string a = arch + ".";
    w.add_u32(a + "block_count", uint32_t(n_layer)).add_u32(a + "embedding_length", 512).add_u32(a + "feed_forward_length", 128);
    w.add_u32(a + "attention.head_count", 4).add_u32(a + "attention.head_count_kv", 2).add_u32(a + "context_length", 256);
    w.add_u32(a + "attention.key_length", 64).add_u32(a + "attention.value_length", 64);
    w.add_string_array("tokenizer.ggml.tokens", {"a", "b", "c"});
    extra(w);
    const std::vector<uint8_t> img = w.build();
    return model_config_from_gguf(*gguf::File::parse(img.data(), img.size(), "m.gguf"));
  };
  auto none = [](GgufWriter&) {};
  auto layout = [](const ModelConfig& c) {
    std::string s;
    for (bool b : c.layer_sliding) s += b ? 'L' : 'G';
    return s;
  };
  const ModelConfig g2 = cfg("gemma2", 6, none);
  EXPECT_EQ(layout(g2), "LGLGLG");
  EXPECT_EQ(g2.sliding_window, 4096);
  EXPECT_FALSE(g2.qk_norm);
  EXPECT_TRUE(g2.post_norms && g2.geglu && g2.embd_scale && g2.rope_neox);
  EXPECT_EQ(g2.attn_softcap, 50.f);
  EXPECT_EQ(g2.final_softcap, 30.f);
  EXPECT_FLOAT_EQ(g2.attn_scale, 1.f / 8.f);  // 1/sqrt(head_dim 64)
  EXPECT_EQ(g2.rope_base_local, g2.rope_base);
  const ModelConfig g2b = cfg("gemma2", 6, [](GgufWriter& w) {
    w.add_f32("gemma2.attn_logit_softcapping", 0.f).add_f32("gemma2.final_logit_softcapping", 20.f);
    w.add_u32("gemma2.attention.sliding_window", 128).add_f32("gemma2.rope.freq_base", 1e6f);
  });
  EXPECT_EQ(g2b.attn_softcap, 0.f);
  EXPECT_EQ(g2b.final_softcap, 20.f);
  EXPECT_EQ(g2b.sliding_window, 128);
  EXPECT_EQ(g2b.rope_base_local, 1e6f);
  // the 27B models: 1/sqrt(n_embd / n_head) = 1/sqrt(128)
  EXPECT_FLOAT_EQ(cfg("gemma2", 46, none).attn_scale, 1.f / std::sqrt(128.f));
  EXPECT_FLOAT_EQ(cfg("gemma3", 62, none).attn_scale, 1.f / std::sqrt(128.f));
  EXPECT_FLOAT_EQ(cfg("gemma3", 46, none).attn_scale, 1.f / 8.f);

  const ModelConfig g3 = cfg("gemma3", 12, none);
  EXPECT_EQ(layout(g3), "LLLLLGLLLLLG");
  EXPECT_TRUE(g3.qk_norm);
  EXPECT_EQ(g3.attn_softcap, 0.f);
  EXPECT_EQ(g3.final_softcap, 0.f);
  EXPECT_EQ(g3.rope_base_local, 10000.f);
  const ModelConfig g3b = cfg("gemma3", 12, [](GgufWriter& w) {
    w.add_f32("gemma3.rope.freq_base_swa", 5e4f).add_string("gemma3.rope.scaling.type", "linear");
    w.add_f32("gemma3.rope.scaling.factor", 8.f);
  });
  EXPECT_EQ(g3b.rope_base_local, 5e4f);
  EXPECT_EQ(g3b.layer_rope_scale(0), 1.f);  // local layers unscaled
  EXPECT_EQ(g3b.layer_rope_scale(5), 8.f);
  EXPECT_EQ(cfg("gemma2", 6, [](GgufWriter& w) {
              w.add_string("gemma2.rope.scaling.type", "linear");
              w.add_f32("gemma2.rope.scaling.factor", 2.f);
            }).layer_rope_scale(0),
            2.f);  // Gemma 2's local layers scale as its global ones

  // sliding_window_pattern as llama.cpp reads it: n (0: all local, 1: none), or one boolean per layer
  auto with_pattern = [&](uint32_t n) {
    return layout(cfg("gemma3", 6, [&](GgufWriter& w) { w.add_u32("gemma3.attention.sliding_window_pattern", n); }));
  };
  EXPECT_EQ(with_pattern(0), "LLLLLL");
  EXPECT_EQ(with_pattern(1), "GGGGGG");
  EXPECT_EQ(with_pattern(3), "LLGLLG");
  EXPECT_EQ(layout(cfg("gemma2", 4, [](GgufWriter& w) {
              w.add_array("gemma2.attention.sliding_window_pattern", gguf::ValueType::boolean,
                          {kvq::test::gv::boolean(false), kvq::test::gv::boolean(true), kvq::test::gv::boolean(true),
                           kvq::test::gv::boolean(false)});
            })),
            "GLLG");
  EXPECT_THROW(cfg("gemma2", 4, [](GgufWriter& w) {
                 w.add_array("gemma2.attention.sliding_window_pattern", gguf::ValueType::boolean,
                             {kvq::test::gv::boolean(true)});
               }),
               Error);
  // Phi-3's sliding window is not used (as in llama.cpp)
  const ModelConfig p3 = cfg("phi3", 4, [](GgufWriter& w) { w.add_u32("phi3.attention.sliding_window", 2047); });
  EXPECT_EQ(layout(p3), "GGGG");
  EXPECT_EQ(p3.layer_window(0), 0);
}

TEST(ModelConfig, RejectsNonFiniteOrOutOfRangeFloatMetadata) {
  using kvq::test::GgufWriter;
  auto build = [](const std::string& arch, const std::function<void(GgufWriter&)>& extra) {
    GgufWriter w;
    w.add_string("general.architecture", arch);
    const std::string a = arch + ".";
    w.add_u32(a + "block_count", 2).add_u32(a + "embedding_length", 64).add_u32(a + "feed_forward_length", 128);
    w.add_u32(a + "attention.head_count", 4).add_u32(a + "attention.head_count_kv", 2).add_u32(a + "context_length", 256);
    w.add_string_array("tokenizer.ggml.tokens", {"a", "b", "c"});
    extra(w);
    return w.build();
  };
  auto error_of = [](const std::vector<uint8_t>& img) -> std::string {
    try {
      model_config_from_gguf(*gguf::File::parse(img.data(), img.size(), "m.gguf"));
    } catch (const Error& e) {
      return e.what();
    }
    return "(no error)";
  };
  EXPECT_EQ(error_of(build("llama", [](GgufWriter&) {})), "(no error)");
  EXPECT_EQ(error_of(build("gemma3", [](GgufWriter&) {})), "(no error)");
  for (float eps : {std::nanf(""), -1.f, 0.f, INFINITY})
    EXPECT_NE(error_of(build("llama", [&](GgufWriter& w) { w.add_f32("llama.attention.layer_norm_rms_epsilon", eps); }))
                  .find("RMS norm epsilon"),
              std::string::npos)
        << eps;
  for (float base : {0.f, -1.f, 1.f, std::nanf(""), INFINITY})
    EXPECT_NE(error_of(build("llama", [&](GgufWriter& w) { w.add_f32("llama.rope.freq_base", base); }))
                  .find("RoPE frequency base"),
              std::string::npos)
        << base;
  EXPECT_NE(error_of(build("gemma3", [](GgufWriter& w) { w.add_u32("gemma3.attention.sliding_window", 0xFFFFFFFFu); }))
                .find("sliding window 4294967295"),
            std::string::npos);
  EXPECT_NE(error_of(build("gemma3", [](GgufWriter& w) { w.add_f32("gemma3.final_logit_softcapping", std::nanf("")); }))
                .find("soft-capping"),
            std::string::npos);
}

// Chat templates from their Jinja text: the family, and for ChatML the default system turn the
// template writes when a conversation has none (SmolLM2's and Qwen2.5's), or none at all (a
// plain ChatML template must not get another model's system prompt).
TEST(ChatTemplate, FamilyAndDefaultSystemFromTheJinja) {
  const std::string smollm2 =
      "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
      "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
      "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
      "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
  const std::string qwen_like =
      "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + "
      "'<|im_end|>\\n' }}{%- else %}{{- '<|im_start|>system\\nYou are Qwen, a helpful assistant.<|im_end|>\\n' }}"
      "{%- endif %}";
  const std::string plain =
      "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + "
      "'\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
  const std::string gemma = "{{ bos_token }}{% for message in messages %}<start_of_turn>...{% endfor %}";

  const ChatTemplate s = chat_template_from_text(smollm2);
  EXPECT_EQ(s.family, ChatFamily::chatml);
  EXPECT_EQ(s.default_system, "You are a helpful AI assistant named SmolLM, trained by Hugging Face");
  EXPECT_EQ(chat_render(s, {{"user", "Hi"}}),
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(chat_render(s, {{"system", "Be brief."}, {"user", "Hi"}}),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");

  const ChatTemplate q = chat_template_from_text(qwen_like);
  EXPECT_EQ(q.family, ChatFamily::chatml);
  EXPECT_EQ(q.default_system, "You are Qwen, a helpful assistant.");

  const ChatTemplate p = chat_template_from_text(plain);
  EXPECT_EQ(p.family, ChatFamily::chatml);
  EXPECT_EQ(p.default_system, "");
  EXPECT_EQ(chat_render(p, {{"user", "Hi"}}), "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");

  EXPECT_EQ(chat_template_from_text(gemma).family, ChatFamily::gemma);
  // Llama 3's (as its tokenizer_config.json writes it): headers, trimmed contents, <|eot_id|>
  const std::string llama3 =
      "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
      "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
      "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
      "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";
  const ChatTemplate l3 = chat_template_from_text(llama3);
  EXPECT_EQ(l3.family, ChatFamily::llama3);
  EXPECT_EQ(chat_render(l3, {{"system", "Be brief. "}, {"user", "\nHi there"}}),
            "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
  EXPECT_EQ(chat_render(l3, {{"user", "Hi"}, {"assistant", "Hello, I"}}, ChatRenderOptions{false, true}),
            "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\nHello, I");
  // trimmed as Python's str.strip: Unicode whitespace too (NBSP, ideographic space)
  EXPECT_EQ(chat_render(l3, {{"user", "\xC2\xA0hi\xE3\x80\x80"}}, ChatRenderOptions{false, false}),
            "<|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>");
  // Llama 3.1+: a system turn always, opening with the knowledge cutoff and the template's date
  const ChatTemplate l31 = chat_template_from_text(
      "{{- \"<|start_header_id|>system<|end_header_id|>\\n\\n\" }}{{- \"Cutting Knowledge Date: December 2023\\n\" }}"
      "{{- \"Today Date: \" + date_string + \"\\n\\n\" }}{{- system_message }}{{- \"<|eot_id|>\" }}");
  EXPECT_EQ(l31.family, ChatFamily::llama3);
  const std::string head = "<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
                           "Today Date: 26 Jul 2024\n\n";
  EXPECT_EQ(chat_render(l31, {{"user", "Hi"}}),
            head + "<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                   "<|start_header_id|>assistant<|end_header_id|>\n\n");
  EXPECT_EQ(chat_render(l31, {{"system", " Be brief."}, {"user", "Hi"}}, ChatRenderOptions{false, false}),
            head + "Be brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>");
  // Phi-3.5's (and Phi-3's): '<|role|>\n' + content + '<|end|>\n', empty system turns left out
  const ChatTemplate phi = chat_template_from_text(
      "{% for message in messages %}{% if message['role'] == 'system' and message['content'] %}{{'<|system|>\n' + "
      "message['content'] + '<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + "
      "'<|end|>\n'}}{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}"
      "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}");
  EXPECT_EQ(phi.family, ChatFamily::phi3);
  EXPECT_STREQ(chat_template_name(phi), "phi3");
  EXPECT_EQ(chat_render(phi, {{"system", "Be brief."}, {"user", "Hi"}}),
            "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n");
  EXPECT_EQ(chat_render(phi, {{"system", ""}, {"user", "Hi"}, {"assistant", "Hello, I"}}, ChatRenderOptions{false, true}),
            "<|user|>\nHi<|end|>\n<|assistant|>\nHello, I");
  // Phi-3-mini's first template: the newline as a string of its own
  EXPECT_EQ(chat_template_from_text("{{'<|user|>' + '\\n' + message['content'] + '<|end|>' + '\\n' + '<|assistant|>'}}").family,
            ChatFamily::phi3);
  // Phi-4-mini's turns have no newline; Phi-4's are '<|im_start|>user<|im_sep|>' (not ChatML's)
  const ChatTemplate p4m = chat_template_from_text(
      "{% for message in messages %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|end|>' }}{% endfor %}"
      "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}");
  EXPECT_EQ(p4m.family, ChatFamily::phi4_mini);
  // Phi-3-small's and Phi-3-vision's build the tag the same way, with a newline after it: Phi-3's turns
  EXPECT_EQ(chat_template_from_text("{{ '<|' + message['role'] + '|>' + '\n' + message['content'] + '<|end|>\n' }}"
                                    "{{ '<|assistant|>\n' }}").family,
            ChatFamily::phi3);
  EXPECT_EQ(chat_render(p4m, {{"system", "S"}, {"user", "Hi"}}), "<|system|>S<|end|><|user|>Hi<|end|><|assistant|>");
  const ChatTemplate p4 = chat_template_from_text(
      "{% for message in messages %}{% if (message['role'] == 'user') %}{{'<|im_start|>user<|im_sep|>' + "
      "message['content'] + '<|im_end|>'}}{% endif %}{% endfor %}{% if add_generation_prompt %}"
      "{{ '<|im_start|>assistant<|im_sep|>' }}{% endif %}");
  EXPECT_EQ(p4.family, ChatFamily::phi4);
  EXPECT_EQ(chat_render(p4, {{"system", "S"}, {"user", "Hi"}, {"assistant", "Hel"}}, ChatRenderOptions{false, true}),
            "<|im_start|>system<|im_sep|>S<|im_end|><|im_start|>user<|im_sep|>Hi<|im_end|><|im_start|>assistant<|im_sep|>Hel");
  // Mistral's (the templates of mistralai/cookbook's tokenization guide): v1 with '[INST]' as spaced
  // text and the system prompt in the first user turn; v2 / v3 / Tekken with the control tokens
  // right before each message (a SentencePiece vocabulary's dummy prefix gives the space) and the
  // system prompt in the last user turn; v7 with [SYSTEM_PROMPT] turns
  const std::string body = "{% if message['role'] == 'user' %}{{ %s }}{% elif message['role'] == 'assistant' %}{{ %s }}{% endif %}";
  auto mistral = [&](const std::string& user, const std::string& assistant) {
    std::string b = body;
    b.replace(b.find("%s"), 2, user);
    b.replace(b.find("%s"), 2, assistant);
    return chat_template_from_text("{{ bos_token }}{% for message in messages %}" + b + "{% endfor %}");
  };
  const ChatTemplate mv1 = mistral("' [INST] ' + message['content'] + ' [/INST]'", "' ' + message['content'] + eos_token");
  const ChatTemplate mv3 = mistral("'[INST] ' + message['content'] + '[/INST]'", "' ' + message['content'] + eos_token");
  const ChatTemplate mtk = mistral("'[INST]' + message['content'] + '[/INST]'", "message['content'] + eos_token");
  EXPECT_EQ(mv1.family, ChatFamily::mistral_v1);
  EXPECT_EQ(mv3.family, ChatFamily::mistral);
  EXPECT_EQ(mtk.family, ChatFamily::mistral);
  const std::vector<ChatMessage> conv = {{"system", "Be brief."}, {"user", "Hi"}, {"assistant", "Hello"}, {"user", "Bye"}};
  EXPECT_EQ(chat_render(mv1, conv), "[INST] Be brief.\n\nHi [/INST] Hello</s>[INST] Bye [/INST]");
  EXPECT_EQ(chat_render(mtk, conv), "[INST]Hi[/INST]Hello</s>[INST]Be brief.\n\nBye[/INST]");
  EXPECT_EQ(chat_render(mtk, {{"user", "Hi"}, {"assistant", "Hel"}}, ChatRenderOptions{false, true}), "[INST]Hi[/INST]Hel");
  // a reply's own leading space (SentencePiece's, as kvq generated it) and trailing blanks are trimmed
  EXPECT_EQ(chat_render(mtk, {{"user", "Hi"}, {"assistant", " Hello \n"}, {"user", "Bye"}}),
            "[INST]Hi[/INST]Hello</s>[INST]Bye[/INST]");
  EXPECT_EQ(chat_render(mv1, {{"user", "Hi"}, {"assistant", " Hello"}, {"user", "Bye"}}),
            "[INST] Hi [/INST] Hello</s>[INST] Bye [/INST]");
  EXPECT_EQ(chat_render(mtk, {{"system", "S"}}), "[INST]S[/INST]");  // no user turn to go into
  const ChatTemplate mv7 = chat_template_from_text(
      "{%- if messages[0]['role'] == 'system' %}{{- '[SYSTEM_PROMPT]' + messages[0]['content'] + '[/SYSTEM_PROMPT]' }}"
      "{%- endif %}{{- '[INST]' + message['content'] + '[/INST]' }}");
  EXPECT_EQ(mv7.family, ChatFamily::mistral_v7);
  EXPECT_STREQ(chat_template_name(mv7), "mistral-v7");
  EXPECT_EQ(chat_render(mv7, conv), "[SYSTEM_PROMPT]Be brief.[/SYSTEM_PROMPT][INST]Hi[/INST]Hello</s>[INST]Bye[/INST]");
  // Granite 3.x's
  const ChatTemplate gr = chat_template_from_text(
      "{%- for message in loop_messages %}{{- '<|start_of_role|>' + message['role'] + '<|end_of_role|>' + "
      "message['content'] + '<|end_of_text|>\n' }}{%- endfor %}");
  EXPECT_EQ(gr.family, ChatFamily::granite);
  EXPECT_EQ(chat_render(gr, {{"system", "S"}, {"user", "Hi"}}),
            "<|start_of_role|>system<|end_of_role|>S<|end_of_text|>\n<|start_of_role|>user<|end_of_role|>Hi<|end_of_text|>\n"
            "<|start_of_role|>assistant<|end_of_role|>");
  // Llama 2's [INST] template (<<SYS>>) is not Mistral's
  EXPECT_FALSE(chat_template_from_text("{{ '[INST] <<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' }}").known());
  EXPECT_FALSE(chat_template_from_text("{{ messages }}").known());
  EXPECT_THROW(chat_render(ChatTemplate{}, {{"user", "Hi"}}), Error);

  // add_generation_prompt false, and the assistant's last message continued
  const ChatRenderOptions no_prompt{false, false}, cont{false, true};
  EXPECT_EQ(chat_render(p, {{"user", "Hi"}}, no_prompt), "<|im_start|>user\nHi<|im_end|>\n");
  EXPECT_EQ(chat_render(p, {{"user", "Hi"}, {"assistant", "Hello, I"}}, cont),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello, I");
  const ChatTemplate g = chat_template_from_text(gemma);
  EXPECT_EQ(chat_render(g, {{"system", "Be brief."}, {"user", "Hi"}}, no_prompt),
            "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n");
  EXPECT_EQ(chat_render(g, {{"user", "Hi"}, {"assistant", "Hello, I"}}, cont),
            "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello, I");
  // a system text with no user turn after it becomes a user turn of its own
  EXPECT_EQ(chat_render(g, {{"system", "Be brief."}, {"assistant", "Sure,"}}, cont),
            "<start_of_turn>user\nBe brief.<end_of_turn>\n<start_of_turn>model\nSure,");
  EXPECT_EQ(chat_render(g, {{"system", "Be brief."}}), "<start_of_turn>user\nBe brief.<end_of_turn>\n<start_of_turn>model\n");
  EXPECT_THROW(chat_render(p, {{"user", "Hi"}}, cont), Error);                               // last is the user's
  EXPECT_THROW(chat_render(p, {{"user", "Hi"}, {"assistant", "x"}}, ChatRenderOptions{true, true}), Error);
}

// Mistral's [INST] rendering follows the vocabulary: v0.3 files carry v1's spaced template with a
// control-token [INST], which takes the control-token rendering.
// Harmony (gpt-oss): detected by its markers; its own system message with the date and reasoning
// effort, the conversation's system message as developer instructions, earlier replies as their
// final channel, the reply opened with '<|start|>assistant' (its channels are the model's to write),
// and the template's endings (<|return|> after a closed last reply, nothing after an open one).
TEST(ChatTemplate, HarmonyOfGptOss) {
  ChatTemplate t = chat_template_from_text(
      "{{- \"<|start|>system<|message|>\" }}...{%- if message.role == 'assistant' -%}"
      "{{- \"<|start|>assistant<|channel|>final<|message|>\" + message.content + \"<|end|>\" }}");
  ASSERT_EQ(t.family, ChatFamily::harmony);
  EXPECT_STREQ(chat_template_name(t), "harmony");
  t.date = "2026-01-02";
  const std::string sys = "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
                          "Knowledge cutoff: 2024-06\nCurrent date: 2026-01-02\n\nReasoning: medium\n\n"
                          "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>";
  EXPECT_EQ(chat_render(t, {{"user", "Hi"}}), sys + "<|start|>user<|message|>Hi<|end|><|start|>assistant");
  EXPECT_EQ(chat_render(t, {{"system", "Be brief."}, {"user", "Hi"}, {"assistant", "Hello."}, {"user", "Bye"}}),
            sys + "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n<|end|><|start|>user<|message|>Hi<|end|>"
                  "<|start|>assistant<|channel|>final<|message|>Hello.<|end|><|start|>user<|message|>Bye<|end|><|start|>assistant");
  EXPECT_EQ(chat_render(t, {{"user", "Hi"}, {"assistant", "Hel"}}, {false, true}),
            sys + "<|start|>user<|message|>Hi<|end|><|start|>assistant<|channel|>final<|message|>Hel");
  EXPECT_EQ(chat_render(t, {{"user", "Hi"}, {"assistant", "Hello."}}, {false, false}),
            sys + "<|start|>user<|message|>Hi<|end|><|start|>assistant<|channel|>final<|message|>Hello.<|return|>");
  EXPECT_EQ(chat_render_next_turn(t, "More"), "<|end|><|start|>user<|message|>More<|end|><|start|>assistant");
  t.reasoning_effort = "high";
  EXPECT_NE(chat_render(t, {{"user", "Hi"}}).find("\n\nReasoning: high\n\n"), std::string::npos);
  t.reasoning_effort = "extreme";
  EXPECT_THROW(chat_render(t, {{"user", "Hi"}}), Error);
  t.reasoning_effort.clear();
  t.date.clear();  // today's, as YYYY-MM-DD
  const std::string today = chat_render(t, {{"user", "Hi"}});
  const size_t at = today.find("Current date: ");
  ASSERT_NE(at, std::string::npos);
  const std::string d = today.substr(at + 14, 11);
  EXPECT_TRUE(d.size() == 11 && std::isdigit(uint8_t(d[0])) && d[4] == '-' && d[7] == '-' && d[10] == '\n') << d;
  // Phi-3's template has <|end|> but no <|start|> / <|channel|>: not harmony
  EXPECT_NE(chat_template_from_text("{{'<|user|>' + '\n' + message['content'] + '<|end|>' + '\n'}}<|assistant|>").family,
            ChatFamily::harmony);
}

// A harmony reply split into reasoning (analysis channel) and content (the rest), whole and fed
// byte by byte (markers held back until they are whole); a reply whose final channel the prompt
// opened is content from its first byte; a held-back '<|' that was text comes out at the end.
TEST(ChatTemplate, HarmonyReplySplitsReasoningFromContent) {
  auto run = [](const std::string& text, size_t piece) {
    HarmonyReplyStream hs;
    std::string r, c;
    for (size_t i = 0; i < text.size(); i += piece) {
      const HarmonyReplyStream::Delta d = hs.feed(text.substr(i, piece));
      r += d.reasoning;
      c += d.content;
    }
    const HarmonyReplyStream::Delta d = hs.finish();
    return std::pair{r + d.reasoning, c + d.content};
  };
  const std::string reply = "<|channel|>analysis<|message|>User says hi. Answer <b> briefly.<|end|>"
                            "<|start|>assistant<|channel|>final<|message|>Hello! a<|b";
  for (size_t piece : {reply.size(), size_t(1), size_t(3), size_t(7)}) {
    SCOPED_TRACE(piece);
    const auto [r, c] = run(reply, piece);
    EXPECT_EQ(r, "User says hi. Answer <b> briefly.");
    EXPECT_EQ(c, "Hello! a<|b");
  }
  const HarmonyReplyStream::Delta whole = HarmonyReplyStream::split(reply);  // all at once
  EXPECT_EQ(whole.reasoning, "User says hi. Answer <b> briefly.");
  EXPECT_EQ(whole.content, "Hello! a<|b");
  EXPECT_EQ(run("{\"a\": 1}", 2), (std::pair<std::string, std::string>{"", "{\"a\": 1}"}));
  // a commentary preamble and a final answer: content; reasoning cut short by max_tokens
  EXPECT_EQ(run("<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>final<|message|>Done.", 5),
            (std::pair<std::string, std::string>{"", "Checking.\nDone."}));
  // two analysis messages: one reasoning, a line apart
  EXPECT_EQ(run("<|channel|>analysis<|message|>A.<|end|><|start|>assistant<|channel|>analysis<|message|>B.<|end|>"
                "<|start|>assistant<|channel|>final<|message|>C.", 2),
            (std::pair<std::string, std::string>{"A.\nB.", "C."}));
  // a reply that opens with '<|' but no marker is content, not a header that never completes; and a
  // marker other than the ends inside a message is its text
  EXPECT_EQ(run("<|x|> is not a marker", 3), (std::pair<std::string, std::string>{"", "<|x|> is not a marker"}));
  EXPECT_EQ(run("<|channel|>final<|message|>the <|channel|> and <|message|> tokens<|return|>", 4),
            (std::pair<std::string, std::string>{"", "the <|channel|> and <|message|> tokens"}));
  EXPECT_EQ(run("<|channel|>analysis<|message|>Thinking abo", 4), (std::pair<std::string, std::string>{"Thinking abo", ""}));
  EXPECT_EQ(run("<|channel|>analy", 4), (std::pair<std::string, std::string>{"", ""}));  // a header cut short
}

// Reasoning templates (<think>): which kind each template is, from its text. Qwen3's writes
// '<think>' nowhere in its generation prompt (the model opens the block) and reads enable_thinking
// and last_query_index; QwQ's and Qwen3's Thinking-2507's prompt opens it in one literal; Qwen3.5's
// in a literal of its own after the turn's opening; a ChatML template without '<think>' has none.
TEST(ChatTemplate, ReasoningTemplatesFromTheJinja) {
  const std::string qwen3 =
      "{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}"
      "{%- if '</think>' in message.content %}{%- endif %}"
      "{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' }}"
      "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
      "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}";
  const ChatTemplate q = chat_template_from_text(qwen3);
  EXPECT_EQ(q.family, ChatFamily::chatml);
  EXPECT_EQ(q.think, ChatTemplate::Think::model_opens);
  EXPECT_TRUE(q.think_after_query);
  EXPECT_TRUE(q.think_switch);
  const ChatTemplate qwq = chat_template_from_text(
      "{%- set content = message.content.split('</think>')[-1].lstrip('\\n') %}"
      "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}");
  EXPECT_EQ(qwq.think, ChatTemplate::Think::prompt_opens);
  EXPECT_FALSE(qwq.think_after_query);
  EXPECT_FALSE(qwq.think_switch);
  const ChatTemplate q35 = chat_template_from_text(
      "{%- set ns = namespace(last_query_index=0) %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
      "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
      "{%- else %}{{- '<think>\\n' }}{%- endif %}{%- endif %}");
  EXPECT_EQ(q35.think, ChatTemplate::Think::prompt_opens);
  EXPECT_TRUE(q35.think_switch);
  EXPECT_EQ(chat_template_from_text("{{ '<|im_start|>' + message['role'] + '\\n' }}").think, ChatTemplate::Think::none);
  // a '<think>\n' literal before the generation prompt shows earlier replies' blocks (Falcon-H1R's
  // kind): the model opens its own
  EXPECT_EQ(chat_template_from_text("{{- '<think>\\n' + reasoning_content + '\\n</think>\\n\\n' }}"
                                    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
                .think,
            ChatTemplate::Think::model_opens);
}

// The reasoning budget a template's replies get: Qwen3's block opened by the model, a prompt-opened
// one counted from the start, a block closed in the prompt or a template without reasoning not
// bounded; the close with its message, '<tool_call>' ending Qwen's reasoning when functions are
// offered; harmony's analysis message ended, its final channel opened unless functions are offered.
TEST(ChatTemplate, ReasoningBudgetOfEachKind) {
  ChatTemplate t;
  t.family = ChatFamily::chatml;
  t.think = ChatTemplate::Think::model_opens;
  EXPECT_FALSE(chat_reasoning_budget(t, -1, "", "", false).active());
  ReasoningBudget b = chat_reasoning_budget(t, 100, "", "", false);
  EXPECT_TRUE(b.active());
  EXPECT_EQ(b.tokens, 100);
  EXPECT_EQ(b.open, "<think>");
  EXPECT_EQ(b.close, std::vector<std::string>{"</think>"});
  EXPECT_EQ(b.force, "\n</think>\n\n");
  EXPECT_EQ(b.message, "");
  EXPECT_TRUE(b.prompt_newline);
  EXPECT_FALSE(b.reopen);
  b = chat_reasoning_budget(t, 0, "Time to answer.", "<think>\n", false);  // opened by the prompt
  EXPECT_EQ(b.open, "");
  EXPECT_EQ(b.tokens, 0);
  EXPECT_EQ(b.message, "\nTime to answer.");
  EXPECT_EQ(b.force, "\n</think>\n\n");
  EXPECT_TRUE(b.prompt_newline);
  EXPECT_FALSE(chat_reasoning_budget(t, 0, "", "<think>\nLily was", false).prompt_newline);  // a continued reply
  EXPECT_FALSE(chat_reasoning_budget(t, 100, "", "<think>\n\n</think>\n\n", false).active());  // closed
  t.qwen_tools = true;
  EXPECT_EQ(chat_reasoning_budget(t, 100, "", "", true).close, (std::vector<std::string>{"</think>", "<tool_call>"}));
  EXPECT_EQ(chat_reasoning_budget(t, 100, "", "", false).close, std::vector<std::string>{"</think>"});
  t.think = ChatTemplate::Think::none;
  EXPECT_FALSE(chat_reasoning_budget(t, 100, "", "", false).active());
  ChatTemplate h;
  h.family = ChatFamily::harmony;
  b = chat_reasoning_budget(h, 50, "", "", false);
  EXPECT_EQ(b.open, "<|channel|>analysis<|message|>");
  EXPECT_EQ(b.close, std::vector<std::string>{"<|end|>"});
  EXPECT_EQ(b.force, "<|end|><|start|>assistant<|channel|>final<|message|>");
  EXPECT_FALSE(b.reopen);
  b = chat_reasoning_budget(h, 50, "Enough.", "", true);  // functions offered: the model picks its channel
  EXPECT_EQ(b.message, "\nEnough.");
  EXPECT_EQ(b.force, "<|end|><|start|>assistant");
  EXPECT_TRUE(b.reopen);
  EXPECT_FALSE(chat_reasoning_budget(h, 50, "", " to=functions.", true).active());  // a forced call
}

// Qwen3's template, as jinja2 renders it (checked against the template itself, conversation by
// conversation): enable_thinking false closes an empty block; an earlier reply shows its answer
// alone (its reasoning, given as reasoning_content or written before '</think>' in its content,
// dropped) unless it comes after the last user query that is not a tool's response, where its
// reasoning is shown again; a continued last reply shows its (possibly empty) block.
TEST(ChatTemplate, Qwen3ReasoningTurns) {
  ChatTemplate t;
  t.family = ChatFamily::chatml;
  t.think = ChatTemplate::Think::model_opens;
  t.think_after_query = t.think_switch = true;
  ChatRenderOptions off;
  off.thinking = false;
  EXPECT_EQ(chat_render(t, {{"user", "Hi"}}), "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(chat_render(t, {{"user", "Hi"}}, off), "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
  ChatMessage a{"assistant", "Hello!"};
  a.reasoning = "\nThe user greets.\n";
  EXPECT_EQ(chat_render(t, {{"user", "Hi"}, a, {"user", "Bye"}}),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
            "<|im_start|>assistant\n");
  EXPECT_EQ(chat_render(t, {{"user", "Hi"}, {"assistant", "<think>\nhmm\n</think>\n\nHello!"}, {"user", "Bye"}}),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
            "<|im_start|>assistant\n");
  // a tool loop: the replies after the last real query keep their reasoning
  ChatMessage r1{"assistant", "Hello!"}, r2{"assistant", "ok"};
  r1.reasoning = "r1";
  r2.reasoning = "r2";
  EXPECT_EQ(chat_render(t, {{"user", "Hi"}, r1, {"user", "<tool_response>\n42\n</tool_response>"}, r2,
                            {"user", "<tool_response>\n43\n</tool_response>"}}),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\nr1\n</think>\n\nHello!<|im_end|>\n"
            "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n<think>\nr2\n</think>\n\nok<|im_end|>\n"
            "<|im_start|>user\n<tool_response>\n43\n</tool_response><|im_end|>\n<|im_start|>assistant\n");
  // the last message: its block shown even when empty; continued, left open after its text
  ChatRenderOptions cont;
  cont.add_generation_prompt = false;
  cont.continue_final_message = true;
  EXPECT_EQ(chat_render(t, {{"user", "Hi"}, {"assistant", "Hel"}}, cont),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHel");
  // the text after the last '</think>' is the answer, before the first the reasoning
  EXPECT_EQ(chat_render(t, {{"user", "Q"}, {"assistant", "x</think>\n\ny</think>z"}, {"user", "Q2"}}, off),
            "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\nz<|im_end|>\n<|im_start|>user\nQ2<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\n");
  // reasoning_content given, even empty: the content is not split (Qwen3's "is defined and is not none")
  ChatMessage given{"assistant", "<think>\nR\n</think>\n\nHi"};
  given.reasoning_given = true;
  EXPECT_EQ(chat_render(t, {{"user", "Q"}, given, {"user", "<tool_response>\nx\n</tool_response>"}}, off),
            "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\nR\n</think>\n\nHi<|im_end|>\n"
            "<|im_start|>user\n<tool_response>\nx\n</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
  // QwQ: the prompt opens the block (closed with thinking off); earlier replies are their answers
  t.think = ChatTemplate::Think::prompt_opens;
  t.think_after_query = t.think_switch = false;
  EXPECT_EQ(chat_render(t, {{"user", "Q"}, a, {"user", "Q2"}}),
            "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nQ2<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n");
  EXPECT_EQ(chat_render(t, {{"user", "Q"}}, off), "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
  // (its leading newlines go, with or without a block: QwQ's lstrip)
  EXPECT_EQ(chat_render(t, {{"user", "Q"}, {"assistant", "\n\nHi"}, {"user", "Q2"}}),
            "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\nHi<|im_end|>\n<|im_start|>user\nQ2<|im_end|>\n"
            "<|im_start|>assistant\n<think>\n");
  EXPECT_EQ(chat_reply_opening(t, chat_render(t, {{"user", "Q"}})), "<think>\n");
  EXPECT_EQ(chat_render_next_turn(t, "Q2", off), "<|im_end|>\n<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
}

// A reasoning template's reply split as it streams, in pieces of every size: '<think>' opens the
// reasoning only at the reply's start, '</think>' ends it; the newlines around the reasoning and
// before the answer go; a reply without the block is all answer, leading whitespace and all; a
// reply cut inside the block is all reasoning; the prompt's opening read first.
TEST(ChatTemplate, ThinkReplySplitsReasoningFromContent) {
  auto run = [](const std::string& opening, const std::string& text, size_t piece) {
    ThinkReplyStream ts;
    (void)ts.feed(opening);
    std::string r, c;
    for (size_t i = 0; i < text.size(); i += piece) {
      const ChatReplyDelta d = ts.feed(text.substr(i, piece));
      r += d.reasoning;
      c += d.content;
    }
    const ChatReplyDelta d = ts.finish();
    return std::pair{r + d.reasoning, c + d.content};
  };
  using P = std::pair<std::string, std::string>;
  const std::vector<std::tuple<std::string, std::string, P>> cases = {
      {"", "<think>\nThe user greets.\n\nSay hi.\n</think>\n\nHello!\n\nBye.", {"The user greets.\n\nSay hi.", "Hello!\n\nBye."}},
      {"", "\n <think>a</think>b", {"a", "b"}},
      {"", "Hello <think>x</think>", {"", "Hello <think>x</think>"}},
      {"", "\n\nHello", {"", "\n\nHello"}},
      {"", "<thin", {"", "<thin"}},
      {"", "<think>\nstill thinking\n\n</thi", {"still thinking\n\n</thi", ""}},
      {"", "<think>\nstill thinking\n\n", {"still thinking", ""}},
      {"", "<think>\n\n</think>\n\n", {"", ""}},
      {"", "<think>a </think b</think>c</think>", {"a </think b", "c</think>"}},
      {"<think>\n", "Reasoning.\n</think>\n\nAnswer.", {"Reasoning.", "Answer."}},
      {"<think>\n", "Cut short", {"Cut short", ""}},
      {"<think>\n\n</think>\n\n", "\n{\"a\": 1}", {"", "{\"a\": 1}"}},
      {"<think>\nr\n</think>\n\nOnce", " upon", {"", " upon"}},
  };
  for (const auto& [opening, text, want] : cases)
    for (size_t piece : {text.size(), size_t(1), size_t(2), size_t(5)}) {
      SCOPED_TRACE(text + " / " + std::to_string(piece));
      EXPECT_EQ(run(opening, text, piece), want);
    }
  EXPECT_EQ(ThinkReplyStream().split_after("", "<think>a</think>\nb").content, "b");
  ChatTemplate q;
  q.family = ChatFamily::chatml;
  EXPECT_EQ(chat_reply_splitter(q), nullptr);
  q.think = ChatTemplate::Think::model_opens;
  EXPECT_EQ(chat_reply_splitter(q)->split_after("", "<think>x</think>y").reasoning, "x");
  q.family = ChatFamily::harmony;
  EXPECT_EQ(chat_reply_splitter(q)->split_after("", "<|channel|>analysis<|message|>x<|end|>").reasoning, "x");
}

// chat_template_kwargs: kvq reads enable_thinking; any other key, or a value that is not a boolean,
// is refused rather than lost.
TEST(ChatTemplate, TemplateKwargsReadEnableThinking) {
  EXPECT_EQ(chat_template_kwargs_thinking("{}"), std::nullopt);
  EXPECT_EQ(chat_template_kwargs_thinking("{\"enable_thinking\": false}"), std::optional<bool>(false));
  EXPECT_EQ(chat_template_kwargs_thinking("{\"enable_thinking\": true}"), std::optional<bool>(true));
  for (const char* bad : {"", "[]", "{\"enable_thinking\": 0}", "{\"thinking\": true}", "not json"})
    EXPECT_THROW(chat_template_kwargs_thinking(bad), Error) << bad;
}

// Function calls in a harmony reply: a message to 'functions.NAME' (the recipient in the channel's
// part or the role's) is a call, its text the arguments, neither reasoning nor content; a message
// to another recipient is content; a call cut short comes out at finish().
TEST(ChatTemplate, HarmonyReplyCallsAFunction) {
  auto run = [](const std::string& text, size_t piece) {
    HarmonyReplyStream hs;
    HarmonyReplyStream::Delta all;
    auto add = [&](const HarmonyReplyStream::Delta& d) {
      all.reasoning += d.reasoning;
      all.content += d.content;
      all.calls.insert(all.calls.end(), d.calls.begin(), d.calls.end());
    };
    for (size_t i = 0; i < text.size(); i += piece) add(hs.feed(text.substr(i, piece)));
    add(hs.finish());
    return all;
  };
  const std::string reply = "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary "
                            "to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Paris\"}<|call|>";
  for (size_t piece : {reply.size(), size_t(1), size_t(4)}) {
    SCOPED_TRACE(piece);
    const HarmonyReplyStream::Delta d = run(reply, piece);
    EXPECT_EQ(d.reasoning, "Need weather.");
    EXPECT_EQ(d.content, "");
    ASSERT_EQ(d.calls.size(), 1u);
    EXPECT_EQ(d.calls[0].name, "get_weather");
    EXPECT_EQ(d.calls[0].arguments, "{\"city\": \"Paris\"}");
  }
  // the recipient in the role's part, right after the prompt's '<|start|>assistant'; the grammar's
  // end (no <|call|>) ends it at finish()
  HarmonyReplyStream::Delta d = run(" to=functions.add<|channel|>commentary json<|message|>{\"a\": 1}", 3);
  ASSERT_EQ(d.calls.size(), 1u);
  EXPECT_EQ(d.calls[0].name, "add");
  EXPECT_EQ(d.calls[0].arguments, "{\"a\": 1}");
  EXPECT_EQ(d.reasoning + d.content, "");
  // a preamble for the user, then the call; another recipient's message is content
  d = run("<|channel|>commentary<|message|>Looking it up.<|end|><|start|>assistant to=functions.f<|channel|>commentary "
          "json<|message|>{}<|call|>", 5);
  EXPECT_EQ(d.content, "Looking it up.");
  ASSERT_EQ(d.calls.size(), 1u);
  EXPECT_EQ(d.calls[0].name, "f");
  d = run("<|channel|>commentary to=python<|message|>print(1)<|call|>", 2);
  EXPECT_EQ(d.content, "print(1)");
  EXPECT_TRUE(d.calls.empty());
  // split() gives the same
  const HarmonyReplyStream::Delta whole = HarmonyReplyStream::split(reply);
  ASSERT_EQ(whole.calls.size(), 1u);
  EXPECT_EQ(whole.calls[0].arguments, "{\"city\": \"Paris\"}");
  // calls not taken (no functions offered): a call in the commentary channel is content, one in the
  // analysis channel reasoning
  const HarmonyReplyStream::Delta off = HarmonyReplyStream::split(reply, false);
  EXPECT_TRUE(off.calls.empty());
  EXPECT_EQ(off.reasoning, "Need weather.");
  EXPECT_EQ(off.content, "{\"city\": \"Paris\"}");
  const HarmonyReplyStream::Delta in_analysis =
      HarmonyReplyStream::split("<|channel|>analysis to=functions.f<|message|>{}<|call|>", false);
  EXPECT_EQ(in_analysis.reasoning, "{}");
  EXPECT_EQ(in_analysis.content, "");
}

TEST(ChatTemplate, MistralRenderingFollowsTheVocabulary) {
  auto detect = [](int inst_type) {
    kvq::test::GgufWriter w;
    w.add_string("tokenizer.chat_template", "{{ ' [INST] ' + message['content'] + ' [/INST]' }}");
    w.add_string_array("tokenizer.ggml.tokens", {"<unk>", "<s>", "</s>", "[INST]", "[/INST]"});
    w.add_i32_array("tokenizer.ggml.token_type", {2, 3, 3, inst_type, inst_type});
    const std::vector<uint8_t> img = w.build();
    return chat_template_detect(*gguf::File::parse(img.data(), img.size(), "m.gguf")).family;
  };
  EXPECT_EQ(detect(3), ChatFamily::mistral);     // control tokens: v2 / v3
  EXPECT_EQ(detect(1), ChatFamily::mistral_v1);  // text: v1
}

// OLMo 2's template (Tülu 3): user and system turns end with a newline, an assistant's with EOS
// and a newline before the next message; its '{{ bos_token }}' is written when the vocabulary
// does not add BOS (OLMo 2's files do not say add_bos_token). Zephyr's and Phi-3's turns are not it.
TEST(ChatTemplate, TuluTurnsOfOlmo2) {
  const std::string olmo2 =
      "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}{{ '<|system|>\n' + "
      "message['content'] + '\n' }}{% elif message['role'] == 'user' %}{{ '<|user|>\n' + message['content'] + '\n' }}"
      "{% elif message['role'] == 'assistant' %}{% if not loop.last %}{{ '<|assistant|>\n'  + message['content'] + "
      "eos_token + '\n' }}{% else %}{{ '<|assistant|>\n'  + message['content'] + eos_token }}{% endif %}{% endif %}"
      "{% if loop.last and add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}{% endfor %}";
  const ChatTemplate t = chat_template_from_text(olmo2);
  ASSERT_EQ(t.family, ChatFamily::tulu);
  EXPECT_STREQ(chat_template_name(t), "tulu");
  const std::vector<ChatMessage> msgs = {{"system", "S"}, {"user", "U1"}, {"assistant", "A1"}, {"user", "U2"}};
  EXPECT_EQ(chat_render(t, msgs), "<|system|>\nS\n<|user|>\nU1\n<|assistant|>\nA1<|endoftext|>\n<|user|>\nU2\n<|assistant|>\n");
  ChatRenderOptions none;
  none.add_generation_prompt = false;
  EXPECT_EQ(chat_render(t, {{"user", "U"}, {"assistant", "A"}}, none), "<|user|>\nU\n<|assistant|>\nA<|endoftext|>");
  ChatRenderOptions cont;
  cont.add_generation_prompt = false;
  cont.continue_final_message = true;
  EXPECT_EQ(chat_render(t, {{"user", "U"}, {"assistant", "The"}}, cont), "<|user|>\nU\n<|assistant|>\nThe");
  EXPECT_EQ(chat_render_next_turn(t, "U3"), "<|endoftext|>\n<|user|>\nU3\n<|assistant|>\n");
  // Zephyr ends every turn with EOS; Phi-3 with <|end|>
  EXPECT_NE(chat_template_from_text("{% for message in messages %}{{ '<|user|>\n' + message['content'] + eos_token }}"
                                    "{{ '<|assistant|>\n' }}{% endfor %}").family, ChatFamily::tulu);
  EXPECT_EQ(chat_template_from_text("{{ '<|user|>\n' + message['content'] + '<|end|>\n' + '<|assistant|>\n' }}").family,
            ChatFamily::phi3);
  // from a file: the vocabulary's EOS and BOS texts, BOS written unless the tokenizer adds it
  auto detect = [&](std::optional<bool> add_bos) {
    kvq::test::GgufWriter w;
    w.add_string("tokenizer.chat_template", olmo2);
    w.add_string_array("tokenizer.ggml.tokens", {"a", "<|endoftext|>", "<|pad|>", "<|eos|>"});
    w.add_u32("tokenizer.ggml.bos_token_id", 1).add_u32("tokenizer.ggml.eos_token_id", 3);
    if (add_bos) w.add_bool("tokenizer.ggml.add_bos_token", *add_bos);
    const std::vector<uint8_t> img = w.build();
    return chat_template_detect(*gguf::File::parse(img.data(), img.size(), "m.gguf"));
  };
  const ChatTemplate f = detect(std::nullopt);
  EXPECT_EQ(f.bos_prefix, "<|endoftext|>");
  EXPECT_EQ(chat_render(f, {{"user", "U"}}), "<|endoftext|><|user|>\nU\n<|assistant|>\n");
  EXPECT_EQ(chat_render(f, {{"user", "U"}, {"assistant", "A"}}, none), "<|endoftext|><|user|>\nU\n<|assistant|>\nA<|eos|>");
  EXPECT_EQ(detect(true).bos_prefix, "");
}

// The installed SmolLM2 GGUF's own template gives its default system turn.
TEST(ChatTemplate, SmolLM2GgufHasItsDefaultSystemTurn) {
  const std::string path = kvq_test_model("SmolLM2-135M-Instruct.Q4_1.gguf");
  if (path.empty()) GTEST_SKIP() << "SmolLM2-135M-Instruct.Q4_1.gguf not installed (run scripts/get-models.sh)";
  const auto f = gguf::File::open(path);
  const ChatTemplate t = chat_template_detect(*f);
  EXPECT_EQ(t.family, ChatFamily::chatml);
  EXPECT_EQ(t.default_system, "You are a helpful AI assistant named SmolLM, trained by Hugging Face");
}
