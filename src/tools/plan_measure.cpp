// kvq plan --measure: runs the engine at several context lengths and compares the process's
// measured resident memory with the plan. The cache allocates whole pages, so a context of n
// tokens holds room for ceil(n / page) x page tokens; a least-squares line through (room, RSS)
// splits the measurement into a baseline (weights, scratch, runtime) and growth per token (the
// KV cache). The prediction is fitted over the same points, so the two growths compare alike.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <thread>
#include <malloc.h>
#include <unistd.h>

#include <fmt/format.h>

#include "core/error.h"
#include "model/model.h"
#include "tools/plan.h"

namespace kvq {

namespace {
int64_t rss_bytes() {
  std::ifstream in("/proc/self/statm");
  long size = 0, resident = 0;
  if (!(in >> size >> resident)) fail("--measure: cannot read /proc/self/statm (Linux only)");
  return int64_t(resident) * int64_t(sysconf(_SC_PAGESIZE));
}
}  // namespace

int plan_measure(const PlanOptions& o, const PlanModel& pm, const PlanConfig& c, std::FILE* out) {
  if (o.model_path.empty()) fail("--measure needs -m MODEL.gguf (it runs the engine)");
  std::vector<std::string> formats = c.formats;
  if (formats.empty()) formats.push_back("f16");
  std::vector<int64_t> ctxs = c.ctx;
  std::sort(ctxs.begin(), ctxs.end());
  auto model = Model::load(o.model_path, o.rope);
  const ModelConfig& mc = model->config();
  for (int64_t x : ctxs)
    if (x > mc.n_ctx_train) fail("--ctx {} exceeds the model's context length {}", x, mc.n_ctx_train);
  if (!ctxs.empty()) model->set_context(int(ctxs.back()));
  if (ctxs.size() < 2) fail("--measure needs at least two --ctx values to separate baseline and growth");
  const int64_t P = c.page_tokens;
  auto room = [P](int64_t ctx) { return (ctx + P - 1) / P * P; };
  if (room(ctxs.front()) == room(ctxs.back()))
    fail("--measure: every --ctx value fits in {} KV page(s) of {} tokens, so the cache allocates the same memory for "
         "each and growth per token cannot be measured; give two lengths that need different page counts (e.g. --ctx {},{})",
         room(ctxs.back()) / P, P, room(ctxs.back()), room(ctxs.back()) + P);

  ThreadPool pool(int(std::max(1u, std::thread::hardware_concurrency())));
  Forward fwd(*model, pool, int(std::min<int64_t>(c.prefill_chunk, 512)));
  std::mt19937 rng(7);
  constexpr int kWarmTokens = 32;
  std::vector<int32_t> toks(size_t(std::max<int64_t>(ctxs.back(), kWarmTokens)));
  for (auto& t : toks) t = int32_t(rng() % uint32_t(mc.n_vocab));
  {  // size the scratch once and touch every page of the weights mapping (random prompt tokens
     // would otherwise fault in more embedding rows as the context grows), so the baseline is steady
    KvCache warm(model->kv_cache_config(kv_policy_uniform("f16", mc.n_layer), 2 * kWarmTokens, c.page_tokens));
    fwd.eval(toks.data(), kWarmTokens, warm);
    volatile uint8_t sink = 0;
    for (const auto& t : model->file().tensors())
      for (size_t i = 0; i < t.nbytes; i += 4096) sink = uint8_t(sink + t.data[i]);
  }
  // Freed caches must go back to the system or the next (smaller) measurement reuses them unseen.
  malloc_trim(0);
  nlohmann::json jout = nlohmann::json::array();
  if (!o.json)
    std::fprintf(out, "measured on the engine: %s, page %d tokens, RSS from /proc/self/statm\n", o.model_path.c_str(), c.page_tokens);
  for (const auto& f : formats) {
    KvPolicy pol = kv_policy_uniform(f, mc.n_layer);
    if (!c.skip_layers.empty()) kv_policy_skip_layers(pol, c.skip_layers);
    const PlanFormatCost cost = plan_format_cost(pm, c, f);
    std::vector<double> xs, ys, ps;
    if (!o.json)
      std::fprintf(out, "\n%-14s %8s %14s %14s %14s %8s\n", f.c_str(), "ctx", "RSS", "measured KV", "predicted KV", "diff");
    const int64_t base = rss_bytes();
    nlohmann::json rows = nlohmann::json::array();
    for (int64_t ctx : ctxs) {
      int64_t rss = 0;
      {
        KvCache cache(model->kv_cache_config(pol, int(ctx), c.page_tokens));
        fwd.eval(toks.data(), int(ctx), cache);
        rss = rss_bytes();
      }
      malloc_trim(0);
      const int64_t pred = plan_sequence_kv_bytes(pm, cost, c.page_tokens, ctx, false);
      const double meas = double(rss - base);
      xs.push_back(double(room(ctx)));
      ys.push_back(double(rss));
      ps.push_back(double(pred));
      const double diff = pred > 0 ? 100.0 * (meas / double(pred) - 1.0) : 0.0;
      if (!o.json)
        std::fprintf(out, "%-14s %8lld %14s %14s %14s %+7.1f%%\n", "", (long long)ctx, plan_format_bytes(double(rss)).c_str(),
                     plan_format_bytes(meas).c_str(), plan_format_bytes(double(pred)).c_str(), diff);
      rows.push_back({{"ctx", ctx}, {"rss_bytes", rss}, {"measured_kv_bytes", meas}, {"predicted_kv_bytes", pred}, {"diff_pct", diff}});
    }
    // least squares y = a + b * room; the room values are not all equal (checked above)
    auto fit = [&xs](const std::vector<double>& y, double& a, double& b) {
      const double n = double(xs.size());
      double sx = 0, sy = 0, sxx = 0, sxy = 0;
      for (size_t i = 0; i < xs.size(); ++i) {
        sx += xs[i];
        sy += y[i];
        sxx += xs[i] * xs[i];
        sxy += xs[i] * y[i];
      }
      b = (n * sxy - sx * sy) / (n * sxx - sx * sx);
      a = (sy - b * sx) / n;
    };
    double a = 0, b = 0, pred_a = 0, pred_per_tok = 0;
    fit(ys, a, b);
    fit(ps, pred_a, pred_per_tok);
    // A prediction without growth (every layer windowed and every length past the window) has
    // nothing to compare the measured growth with.
    const bool comparable = pred_per_tok > 0;
    const double growth_diff = comparable ? 100.0 * (b / pred_per_tok - 1.0) : 0.0;
    if (!o.json)
      std::fprintf(out, "%-14s growth %.0f bytes/token measured vs %.0f predicted (%s); baseline %s (weights %s in the file)\n", "",
                   b, pred_per_tok, comparable ? fmt::format("{:+.1f}%", growth_diff).c_str() : "n/a",
                   plan_format_bytes(a).c_str(), plan_format_bytes(double(model->weights_bytes())).c_str());
    jout.push_back({{"format", f}, {"rows", rows}, {"growth_bytes_per_token", b}, {"predicted_bytes_per_token", pred_per_tok},
                    {"growth_diff_pct", comparable ? nlohmann::json(growth_diff) : nlohmann::json(nullptr)},
                    {"baseline_bytes", a}, {"weights_bytes", model->weights_bytes()}});
  }
  if (o.json) std::fprintf(out, "%s\n", nlohmann::json{{"measure", jout}}.dump(2).c_str());
  return 0;
}

}  // namespace kvq
