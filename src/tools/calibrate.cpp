#include "tools/calibrate.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "core/error.h"
#include "kv/kvquant.h"
#include "model/model.h"
#include "model/tokenizer.h"

namespace kvq {

void calibrate_add_cli(CLI::App& app, CalibrateOptions& o) {
  app.add_option("-m,--model", o.model, "GGUF model file")->required();
  app.add_option("--data", o.data, "sample text")->required();
  app.add_option("-o,--output", o.out, "calibration JSON to write")->required();
  app.add_option("--ctx", o.ctx, "tokens per window")->check(CLI::Range(16, 1 << 20))->capture_default_str();
  app.add_option("--chunks", o.chunks, "windows of sample text")->check(CLI::Range(1, 10000))->capture_default_str();
  app.add_option("-t,--threads", o.threads, "threads")->check(CLI::Range(1, 1024));
  app.add_option("--kvquant-bits", o.kvquant_bits, "bit widths to fit KVQuant key codebooks for")->delimiter(',')->capture_default_str();
}

int calibrate_command(const CalibrateOptions& o) {
  for (int b : o.kvquant_bits)
    if (b < 2 || b > 4) fail("--kvquant-bits: {} is not one of 2, 3, 4", b);
  auto model = Model::load(o.model);
  const ModelConfig& c = model->config();
  if (o.ctx > c.n_ctx_train) fail("--ctx {} exceeds the model's context length {}", o.ctx, c.n_ctx_train);
  Tokenizer tok = Tokenizer::from_gguf(model->file());
  std::ifstream in(o.data, std::ios::binary);
  if (!in) fail("--data: cannot read '{}'", o.data);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::vector<int32_t> ids = tok.encode(ss.str(), false);
  const int chunks = int(std::min<size_t>(size_t(o.chunks), ids.size() / size_t(o.ctx)));
  if (chunks < 1) fail("--data has {} tokens, fewer than one window of {}", ids.size(), o.ctx);

  const int nkv = c.n_head_kv, hd = c.head_dim, kvd = nkv * hd;
  std::vector<std::vector<float>> kabs(size_t(c.n_layer), std::vector<float>(size_t(nkv), 0.f));
  std::vector<std::vector<float>> vabs = kabs;
  std::vector<std::vector<float>> kpre(size_t(c.n_layer));  // (tokens, nkv, hd) per layer

  const int threads = o.threads > 0 ? o.threads : int(std::max(1u, std::thread::hardware_concurrency()));
  ThreadPool pool(threads);
  Forward fwd(*model, pool);
  fwd.on_kv = [&](int il, int n, const float* k_pre, const float* k, const float* v) {
    for (int t = 0; t < n; ++t)
      for (int h = 0; h < nkv; ++h)
        for (int d = 0; d < hd; ++d) {
          const size_t i = size_t(t) * size_t(kvd) + size_t(h) * size_t(hd) + size_t(d);
          kabs[size_t(il)][size_t(h)] = std::max(kabs[size_t(il)][size_t(h)], std::fabs(k[i]));
          vabs[size_t(il)][size_t(h)] = std::max(vabs[size_t(il)][size_t(h)], std::fabs(v[i]));
        }
    kpre[size_t(il)].insert(kpre[size_t(il)].end(), k_pre, k_pre + size_t(n) * size_t(kvd));
  };
  for (int ch = 0; ch < chunks; ++ch) {
    std::vector<int32_t> win(ids.begin() + std::ptrdiff_t(size_t(ch) * size_t(o.ctx)),
                             ids.begin() + std::ptrdiff_t(size_t(ch + 1) * size_t(o.ctx)));
    if (tok.add_bos()) win[0] = tok.bos();
    KvCache cache(model->kv_cache_config(kv_policy_uniform("f16", c.n_layer), o.ctx));
    fwd.eval(win.data(), int(win.size()), cache);
    std::fprintf(stderr, "\r[calibrate] window %d/%d", ch + 1, chunks);
  }
  std::fprintf(stderr, "\n");

  auto scaled = [](const std::vector<float>& a, float div) {
    std::vector<float> r(a.size());
    // a head that never saw a non-zero value still needs a usable (positive) scale
    for (size_t i = 0; i < a.size(); ++i) r[i] = std::max(a[i], 1e-6f) / div;
    return r;
  };
  nlohmann::json j = {{"model", c.name}, {"model_file", o.model}, {"data", o.data}, {"tokens", chunks * o.ctx}};
  j["layers"] = nlohmann::json::array();
  const int n_tok = chunks * o.ctx;
  for (int il = 0; il < c.n_layer; ++il) {
    nlohmann::json L = {{"layer", il}, {"k_absmax", kabs[size_t(il)]}, {"v_absmax", vabs[size_t(il)]},
                        {"k_scale", scaled(kabs[size_t(il)], 448.f)}, {"v_scale", scaled(vabs[size_t(il)], 448.f)},
                        {"int8_k_scale", scaled(kabs[size_t(il)], 127.f)}, {"int8_v_scale", scaled(vabs[size_t(il)], 127.f)}};
    if (hd % 16 == 0)
      for (int b : o.kvquant_bits) {
        nlohmann::json art = kvquant_fit(kpre[size_t(il)].data(), n_tok, nkv, hd, b);
        for (auto it = art.begin(); it != art.end(); ++it) L[it.key()] = it.value();
      }
    j["layers"].push_back(L);
  }
  std::ofstream out(o.out);
  if (!out) fail("-o: cannot write '{}'", o.out);
  out << j.dump(1) << "\n";
  std::fprintf(stderr, "[calibrate] %d layers, %d tokens -> %s\n", c.n_layer, n_tok, o.out.c_str());
  return 0;
}

}  // namespace kvq
