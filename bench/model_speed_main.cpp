// Model speed: prompt processing (pp) and decode (tg) tokens/s of kvq on a GGUF model, like
// llama-bench's pp512 / tg128, plus the memory bandwidth decode reaches as a share of this
// machine's read bandwidth measured in the same run.
//
//   model_speed MODEL.gguf [--pp 512] [--tg 128] [--depth 0] [--batch 1] [--threads 1,2] [--reps 3] [--kv f16] [--json]
//
// Decode bandwidth = (weight bytes + KV bytes read per token) / time per token.
// --depth N measures both tests after an N-token context (llama-bench's -d): for decode the context
// is prefilled once per thread count (untimed), then each repetition decodes tg tokens on top of
// it, so the KV cache format's attention cost shows next to the weights'; for the prompt each
// repetition prefills the context (untimed) and then times pp more tokens in chunks of 512: the
// time to first token of a prompt that continues a long one. --pp 0 skips the prompt test.
// --batch B decodes B sequences at once (each its own cache at the same depth, one step = one
// token of each, as a server's decode steps): tg tokens/s counts all B sequences' tokens, as
// llama-batched-bench's S_TG does.
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
    std::fprintf(stderr, "usage: model_speed MODEL.gguf [--pp N] [--tg N] [--depth N] [--batch B] [--threads 1,2] [--reps N] [--kv FMT] [--json]\n");
    return 2;
  }
  std::string path = argv[1], kv = "f16";
  int pp = 512, tg = 128, reps = 3, depth = 0, batch = 1;
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
    else if (a == "--batch") batch = std::stoi(next());
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
  if (pp < 0 || tg < 1 || reps < 1 || depth < 0 || batch < 1 || batch > 512) {
    std::fprintf(stderr, "model_speed: --pp and --depth must be >= 0, --tg and --reps >= 1, --batch in 1..512\n");
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
      // context of `depth` tokens (each repetition continues the same sequences).
      std::vector<std::unique_ptr<KvCache>> deep;
      for (int b = 0; b < batch; ++b) {
        deep.push_back(std::make_unique<KvCache>(m->kv_cache_config(policy, depth + reps * tg + 8)));
        if (depth > 0) fwd.eval(ctx.data(), depth, *deep.back());
      }
      for (int r = 0; r < reps; ++r) {
        std::vector<std::unique_ptr<KvCache>> fresh;
        std::vector<KvCache*> caches;
        for (int b = 0; b < batch; ++b) {
          if (depth == 0) {
            fresh.push_back(std::make_unique<KvCache>(m->kv_cache_config(policy, tg + 8)));
            caches.push_back(fresh.back().get());
            const int32_t first = prompt[0];
            fwd.eval(&first, 1, *caches.back());
          } else {
            caches.push_back(deep[size_t(b)].get());
          }
        }
        std::vector<int32_t> toks(static_cast<size_t>(batch));
        std::vector<ForwardSeq> fs(static_cast<size_t>(batch));
        double kv_read = 0;
        double t0 = now_seconds();
        for (int i = 0; i < tg; ++i) {
          for (int b = 0; b < batch; ++b) {
            toks[size_t(b)] = prompt[size_t(i + 1 + b) % prompt.size()];
            kv_read += caches[size_t(b)]->decode_read_bytes(caches[size_t(b)]->n_tokens());
            fs[size_t(b)] = ForwardSeq{&toks[size_t(b)], 1, caches[size_t(b)], ForwardSeq::last};
          }
          if (batch == 1) fwd.eval(toks.data(), 1, *caches[0]);
          else fwd.eval_batch(fs.data(), batch);
        }
        double t_tg = now_seconds() - t0;
        tg_tps.push_back(double(tg) * batch / t_tg);
        tg_gbs.push_back((double(m->decode_weight_bytes(batch)) * tg + kv_read) / t_tg / 1e9);
      }
      const double mpp = pp > 0 ? median(pp_tps) : 0, mtg = median(tg_tps), mgbs = median(tg_gbs);
      if (json)
        std::printf("{\"threads\": %d, \"kv\": \"%s\", \"pp\": %d, \"pp_tps\": %.2f, \"tg\": %d, \"depth\": %d, \"batch\": %d, \"tg_tps\": %.2f, \"tg_gbs\": %.2f, \"read_bw_gbs\": %.2f}\n",
                    nt, kv.c_str(), pp, mpp, tg, depth, batch, mtg, mgbs, bw);
      else
        std::printf("threads %d: pp%d @ depth %d %.1f tokens/s | tg%d @ depth %d x %d sequences %.1f tokens/s | decode reads %.2f GB/s = %.0f%% of measured read bandwidth %.2f GB/s\n",
                    nt, pp, depth, mpp, tg, depth, batch, mtg, mgbs, 100.0 * mgbs / bw, bw);
      std::fflush(stdout);
    }
  } catch (const Error& e) {
    std::fprintf(stderr, "model_speed: %s\n", e.what());
    return 1;
  }
  return 0;
}
