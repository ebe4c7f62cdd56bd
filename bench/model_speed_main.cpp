// Model speed: prompt processing (pp) and decode (tg) tokens/s of kvq on a GGUF model, like
// llama-bench's pp512 / tg128, plus the memory bandwidth decode reaches as a share of this
// machine's read bandwidth measured in the same run.
//
//   model_speed MODEL.gguf [--pp 512] [--tg 128] [--depth 0] [--threads 1,2] [--reps 3] [--kv f16] [--json]
//
// Decode bandwidth = (weight bytes + KV bytes read per token) / time per token.
// --depth N measures both tests after an N-token context (llama-bench's -d): for decode the context
// is prefilled once per thread count (untimed), then each repetition decodes tg tokens on top of
// it, so the KV cache format's attention cost shows next to the weights'; for the prompt each
// repetition prefills the context (untimed) and then times pp more tokens in chunks of 512: the
// time to first token of a prompt that continues a long one. --pp 0 skips the prompt test.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "cache/kv_cache.h"
#include "core/error.h"
#include "core/membw.h"
#include "core/timer.h"
#include "model/model.h"

using namespace kvq;

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: model_speed MODEL.gguf [--pp N] [--tg N] [--depth N] [--threads 1,2] [--reps N] [--kv FMT] [--json]\n");
    return 2;
  }
  std::string path = argv[1], kv = "f16";
  int pp = 512, tg = 128, reps = 3, depth = 0;
  bool json = false;
  std::vector<int> threads = {1, 2};
  for (int i = 2; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) { std::fprintf(stderr, "%s needs a value\n", a.c_str()); std::exit(2); }
      return argv[++i];
    };
    if (a == "--pp") pp = std::stoi(next());
    else if (a == "--tg") tg = std::stoi(next());
    else if (a == "--reps") reps = std::stoi(next());
    else if (a == "--depth") depth = std::stoi(next());
    else if (a == "--kv") kv = next();
    else if (a == "--json") json = true;
    else if (a == "--threads") {
      threads.clear();
      std::string s = next();
      for (size_t p = 0; p <= s.size();) {
        size_t q = s.find(',', p);
        if (q == std::string::npos) q = s.size();
        threads.push_back(std::stoi(s.substr(p, q - p)));
        p = q + 1;
      }
    } else { std::fprintf(stderr, "unknown option %s\n", a.c_str()); return 2; }
  }
  if (pp < 0 || tg < 1 || reps < 1 || depth < 0) {
    std::fprintf(stderr, "model_speed: --pp and --depth must be >= 0, --tg and --reps >= 1\n");
    return 2;
  }
  try {
    auto m = Model::load(path);
    if (depth + pp + 8 > m->config().n_ctx_train && m->config().n_ctx_train > 0)
      fail("--depth {} + --pp {} exceeds the model's context of {} tokens", depth, pp, m->config().n_ctx_train);
    if (depth + reps * tg + 8 > m->config().n_ctx_train && m->config().n_ctx_train > 0)
      fail("--depth {} + {} x {} decoded tokens exceeds the model's context of {} tokens", depth, reps, tg,
           m->config().n_ctx_train);
    const ModelConfig& c = m->config();
    std::mt19937 rng(1234);
    std::vector<int32_t> prompt(static_cast<size_t>(std::max(pp, tg + 1)), 0);  // also the decoded tokens
    for (auto& t : prompt) t = int32_t(rng() % uint32_t(c.n_vocab));
    const KvPolicy policy = kv_policy_uniform(kv, c.n_layer);
    if (!json) std::printf("model %s (%s), weights %.1f MiB, KV %s\n", c.name.c_str(), c.arch.c_str(), m->weights_bytes() / 1048576.0, policy.name.c_str());
    for (int nt : threads) {
      ThreadPool pool(nt);
      const double bw = measure_read_bandwidth_gbs(pool, size_t(512) << 20, 3);
      std::vector<double> pp_tps, tg_tps, tg_gbs;
      Forward fwd(*m, pool, 512);
      std::vector<int32_t> ctx(static_cast<size_t>(depth), 0);
      for (auto& t : ctx) t = int32_t(rng() % uint32_t(c.n_vocab));
      for (int r = 0; r < reps && pp > 0; ++r) {
        KvCache cache(m->kv_cache_config(policy, depth + pp + 8));
        if (depth > 0) fwd.eval(ctx.data(), depth, cache);
        double t0 = now_seconds();
        fwd.eval(prompt.data(), pp, cache);
        pp_tps.push_back(pp / (now_seconds() - t0));
      }
      // Decode: from a fresh one-token context as llama-bench's tg does, or on top of a prefilled
      // context of `depth` tokens (each repetition continues the same sequence).
      KvCache deep(m->kv_cache_config(policy, depth + reps * tg + 8));
      if (depth > 0) fwd.eval(ctx.data(), depth, deep);
      for (int r = 0; r < reps; ++r) {
        std::unique_ptr<KvCache> fresh;
        KvCache* cache2 = &deep;
        if (depth == 0) {
          fresh = std::make_unique<KvCache>(m->kv_cache_config(policy, tg + 8));
          cache2 = fresh.get();
        }
        int32_t tok = prompt[0];
        if (depth == 0) fwd.eval(&tok, 1, *cache2);
        double kv_read = 0;
        double t0 = now_seconds();
        for (int i = 0; i < tg; ++i) {
          tok = prompt[size_t(i + 1) % prompt.size()];
          kv_read += cache2->decode_read_bytes(cache2->n_tokens());
          fwd.eval(&tok, 1, *cache2);
        }
        double t_tg = now_seconds() - t0;
        tg_tps.push_back(tg / t_tg);
        tg_gbs.push_back((double(m->decode_weight_bytes()) * tg + kv_read) / t_tg / 1e9);
      }
      const double mpp = pp > 0 ? median(pp_tps) : 0, mtg = median(tg_tps), mgbs = median(tg_gbs);
      if (json)
        std::printf("{\"threads\": %d, \"kv\": \"%s\", \"pp\": %d, \"pp_tps\": %.2f, \"tg\": %d, \"depth\": %d, \"tg_tps\": %.2f, \"tg_gbs\": %.2f, \"read_bw_gbs\": %.2f}\n",
                    nt, kv.c_str(), pp, mpp, tg, depth, mtg, mgbs, bw);
      else
        std::printf("threads %d: pp%d @ depth %d %.1f tokens/s | tg%d @ depth %d %.1f tokens/s | decode reads %.2f GB/s = %.0f%% of measured read bandwidth %.2f GB/s\n",
                    nt, pp, depth, mpp, tg, depth, mtg, mgbs, 100.0 * mgbs / bw, bw);
      std::fflush(stdout);
    }
  } catch (const Error& e) {
    std::fprintf(stderr, "model_speed: %s\n", e.what());
    return 1;
  }
  return 0;
}
