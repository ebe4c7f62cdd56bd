#include "tools/calibrate.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <nlohmann/json.hpp>
#include <thread>

#include "core/error.h"
#include "kv/calib.h"
#include "kv/kvquant.h"
#include "kv/kvquant_mixed.h"
#include "model/model.h"
#include "model/tokenizer.h"
#include "tools/files.h"
#include "tools/kv_flags.h"
#include "tools/report.h"

namespace kvq {

void calibrate_add_cli(CLI::App& app, CalibrateOptions& o) {
  app.add_option("-m,--model", o.model, "GGUF model file")->required();
  app.add_option("--data", o.data, "sample text")->required();
  app.add_option("-o,--output", o.out, "calibration JSON to write")->required();
  app.add_option("--ctx", o.ctx, "tokens per window")->check(CLI::Range(16, 1 << 20))->capture_default_str();
  app.add_option("--chunks", o.chunks, "windows of sample text")->check(CLI::Range(1, 10000))->capture_default_str();
  app.add_option("-t,--threads", o.threads, "threads")->check(CLI::Range(1, 1024));
  app.add_option("--kvquant-bits", o.kvquant_bits, "bit widths to fit KVQuant key codebooks for")->delimiter(',')->capture_default_str();
  rope_flags_add(app, o.rope);
}

int calibrate_command(const CalibrateOptions& o) {
  for (int b : o.kvquant_bits)
    if (b < 2 || b > 4) fail("--kvquant-bits: {} is not one of 2, 3, 4", b);
  // The output path before the passes over the text, not after them.
  report_check_writable("-o", o.out, {{"the model (-m)", o.model}, {"the text (--data)", o.data}});
  auto model = Model::load(o.model, o.rope);
  const ModelConfig& c = model->config();
  if (o.ctx > c.n_ctx_train) fail("--ctx {} exceeds the model's context length {}", o.ctx, c.n_ctx_train);
  model->set_context(o.ctx);
  Tokenizer tok = Tokenizer::from_gguf(model->file());
  const std::vector<int32_t> ids = tok.encode(read_text_file(o.data, "--data"), false);
  const int chunks = int(std::min<size_t>(size_t(o.chunks), ids.size() / size_t(o.ctx)));
  if (chunks < 1) fail("--data has {} tokens, fewer than one window of {}", ids.size(), o.ctx);
  // The KVQuant codebooks need a whole token group besides the sink: checked here rather than
  // after the forward passes.
  if (!o.kvquant_bits.empty() && chunks * o.ctx < kvquant_default_sink_tokens + kvquant_default_group_tokens)
    fail("--ctx {} x {} window(s): the KVQuant codebooks (--kvquant-bits) need at least {} tokens ({} sink + a group "
         "of {}); use a larger --ctx or more --chunks",
         o.ctx, chunks, kvquant_default_sink_tokens + kvquant_default_group_tokens, kvquant_default_sink_tokens,
         kvquant_default_group_tokens);

  const int nkv = c.n_head_kv, hd = c.head_dim, kvd = nkv * hd;
  std::vector<std::vector<float>> kabs(size_t(c.n_layer), std::vector<float>(size_t(nkv), 0.f));
  std::vector<std::vector<float>> vabs = kabs;
  std::vector<std::vector<float>> kpre(size_t(c.n_layer));  // (tokens, nkv, hd) per layer
  // Per-channel sums of the post-RoPE keys and of the values (nkv, hd) per layer, for the channel
  // means that the centered formats (*_c) subtract, and per-channel sums of squares of the keys,
  // the values and the queries (the group's query heads averaged onto their KV head), for the
  // channel scales of the scaled formats (*_s) and the share of energy the means hold.
  // Position 0 of each window (BOS, the attention sink) is left out: its K/V are atypical.
  std::vector<std::vector<double>> ksum(size_t(c.n_layer), std::vector<double>(size_t(kvd), 0.0));
  std::vector<std::vector<double>> vsum = ksum;
  std::vector<std::vector<double>> kch2(size_t(c.n_layer), std::vector<double>(size_t(kvd), 0.0));
  std::vector<std::vector<double>> vch2 = kch2, qch2 = kch2;
  const int group = c.n_head / nkv;
  int pos_in_window = 0;  // on_kv is called per layer with consecutive chunks of one window

  const int threads = resolve_threads(o.threads);
  ThreadPool pool(threads);
  Forward fwd(*model, pool);
  fwd.on_kv = [&](int il, int n, const float* k_pre, const float* k, const float* v) {
    for (int t = 0; t < n; ++t)
      for (int h = 0; h < nkv; ++h)
        for (int d = 0; d < hd; ++d) {
          const size_t i = size_t(t) * size_t(kvd) + size_t(h) * size_t(hd) + size_t(d);
          kabs[size_t(il)][size_t(h)] = std::max(kabs[size_t(il)][size_t(h)], std::fabs(k[i]));
          vabs[size_t(il)][size_t(h)] = std::max(vabs[size_t(il)][size_t(h)], std::fabs(v[i]));
          if (pos_in_window + t == 0) continue;
          const size_t hc = size_t(h) * size_t(hd) + size_t(d);
          ksum[size_t(il)][hc] += k[i];
          vsum[size_t(il)][hc] += v[i];
          kch2[size_t(il)][hc] += double(k[i]) * k[i];
          vch2[size_t(il)][hc] += double(v[i]) * v[i];
        }
    kpre[size_t(il)].insert(kpre[size_t(il)].end(), k_pre, k_pre + size_t(n) * size_t(kvd));
  };
  // Called after on_kv of the same layer, so pos_in_window still points at this chunk's start.
  fwd.on_q = [&](int il, int n, const float* q) {
    for (int t = 0; t < n; ++t) {
      if (pos_in_window + t == 0) continue;
      for (int hq = 0; hq < c.n_head; ++hq)
        for (int d = 0; d < hd; ++d) {
          const float x = q[(size_t(t) * size_t(c.n_head) + size_t(hq)) * size_t(hd) + size_t(d)];
          qch2[size_t(il)][size_t(hq / group) * size_t(hd) + size_t(d)] += double(x) * x / group;
        }
    }
    if (il == c.n_layer - 1) pos_in_window += n;
  };
  const KvCacheConfig cache_cfg = model->kv_cache_config(kv_policy_uniform("f16", c.n_layer), o.ctx);
  for (int ch = 0; ch < chunks; ++ch) {
    std::vector<int32_t> win(ids.begin() + std::ptrdiff_t(size_t(ch) * size_t(o.ctx)),
                             ids.begin() + std::ptrdiff_t(size_t(ch + 1) * size_t(o.ctx)));
    if (tok.add_bos()) win[0] = tok.bos();
    KvCache cache(cache_cfg);
    pos_in_window = 0;
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
  // LongRoPE models: the factor set the keys were rotated with (the channel statistics depend on it)
  if (c.has_long_rope) j["rope_factors"] = c.rope_long ? "long" : "short";
  if (const std::string n = model_rope_scaling_note(c); !n.empty()) j["rope_scaling"] = n;  // likewise
  j["layers"] = nlohmann::json::array();
  const int n_tok = chunks * o.ctx;
  const double n_mean = double(n_tok - chunks);  // tokens in the means (position 0 left out)
  // The channel means, and the share of the mean energy E|x|^2 that centering removes
  // (|mean|^2 / E|x|^2 per head): what the *_c formats gain depends on it.
  auto means = [&](const std::vector<double>& sum, const std::vector<double>& sq, double& removed) {
    nlohmann::json heads = nlohmann::json::array();
    double rem = 0, tot = 0;
    for (int h = 0; h < nkv; ++h) {
      std::vector<float> m(static_cast<size_t>(hd));
      double m2 = 0;
      for (int d = 0; d < hd; ++d) {
        m[size_t(d)] = float(sum[size_t(h) * size_t(hd) + size_t(d)] / n_mean);
        m2 += double(m[size_t(d)]) * m[size_t(d)];
        tot += sq[size_t(h) * size_t(hd) + size_t(d)] / n_mean;
      }
      rem += m2;
      heads.push_back(m);
    }
    removed = tot > 0 ? rem / tot : 0;
    return heads;
  };
  // Root mean squares per (head, channel) over the tokens of the means.
  auto rms = [&](const std::vector<double>& sq) {
    nlohmann::json heads = nlohmann::json::array();
    for (int h = 0; h < nkv; ++h) {
      std::vector<float> r(static_cast<size_t>(hd));
      for (int d = 0; d < hd; ++d) r[size_t(d)] = float(std::sqrt(sq[size_t(h) * size_t(hd) + size_t(d)] / n_mean));
      heads.push_back(r);
    }
    return heads;
  };
  // What the key channel scales of the scaled formats (*_s) buy a rotated per-token quantizer,
  // whose error is isotropic in the basis it quantizes: with keys divided by s and queries
  // multiplied by it, the expected squared score error is proportional to E|k / s|^2 E|q s|^2,
  // which the codecs minimize with one scale per RoPE pair (kv/centered_codecs.cpp). The ratio
  // of the unscaled value E|k|^2 E|q|^2 to that minimum is printed: near 1, the model's key
  // imbalance lies within RoPE pairs (it moves with position) and scaling has nothing to take.
  // On a model with QK-norm the same ratio is printed for the scales `--kv-scales qk-norm` takes
  // from the norm weights (tools/kv_flags.h), evaluated on the measured statistics: how much of
  // the gain needs no calibration.
  double k_scale_gain_log = 0, k_qkn_gain_log = 0;
  // (not for q / k norms over all heads at once, OLMo 2's: their weights give no per-head scale)
  const nlohmann::json qkn = c.qk_norm && !c.qk_norm_full ? kv_qk_norm_calib(*model) : nlohmann::json();
  double k_removed_all = 0, v_removed_all = 0;
  for (int il = 0; il < c.n_layer; ++il) {
    double k_removed = 0, v_removed = 0;
    nlohmann::json L = {{"layer", il}, {"k_absmax", kabs[size_t(il)]}, {"v_absmax", vabs[size_t(il)]},
                        {"k_scale", scaled(kabs[size_t(il)], 448.f)}, {"v_scale", scaled(vabs[size_t(il)], 448.f)},
                        {"int8_k_scale", scaled(kabs[size_t(il)], 127.f)}, {"int8_v_scale", scaled(vabs[size_t(il)], 127.f)}};
    if (n_mean > 0) {
      L["k_mean"] = means(ksum[size_t(il)], kch2[size_t(il)], k_removed);
      L["v_mean"] = means(vsum[size_t(il)], vch2[size_t(il)], v_removed);
      L["k_mean_energy"] = k_removed;
      L["v_mean_energy"] = v_removed;
      k_removed_all += k_removed / c.n_layer;
      v_removed_all += v_removed / c.n_layer;
      L["k_rms"] = rms(kch2[size_t(il)]);
      L["v_rms"] = rms(vch2[size_t(il)]);
      L["q_rms"] = rms(qch2[size_t(il)]);
      const int nr = std::min(c.layer_n_rot(int(il)), hd), half = nr / 2;
      for (int h = 0; h < nkv; ++h) {
        const double* k2 = kch2[size_t(il)].data() + size_t(h) * size_t(hd);
        const double* q2 = qch2[size_t(il)].data() + size_t(h) * size_t(hd);
        double kk = 0, qq = 0, kq = 0;
        for (int d = 0; d < hd; ++d) {
          kk += k2[d];
          qq += q2[d];
        }
        for (int i = 0; i < half; ++i) {  // pairs: one scale each
          const int a = c.rope_neox ? i : 2 * i, b = c.rope_neox ? i + half : 2 * i + 1;
          kq += 2 * std::sqrt((k2[a] + k2[b]) / 2 * (q2[a] + q2[b]) / 2);
        }
        for (int d = 2 * half; d < hd; ++d) kq += std::sqrt(k2[d] * q2[d]);  // channels RoPE leaves alone
        if (kq > 0) k_scale_gain_log += std::log(kk * qq / (kq * kq)) / (c.n_layer * nkv);
        if (!qkn.is_null()) {
          const auto& QL = qkn["layers"][size_t(il)];
          const std::vector<float> wk = QL["k_rms"][size_t(h)], wq = QL["q_rms"][size_t(h)];
          const std::vector<float> s = kv_channel_scales(wk.data(), nullptr, wq.data(), hd, cache_cfg.rope[size_t(il)]);
          double ks = 0, qs = 0;
          for (int d = 0; d < hd; ++d) {
            ks += k2[d] / (double(s[size_t(d)]) * s[size_t(d)]);
            qs += q2[d] * s[size_t(d)] * s[size_t(d)];
          }
          if (ks * qs > 0) k_qkn_gain_log += std::log(kk * qq / (ks * qs)) / (c.n_layer * nkv);
        }
      }
    }
    if (hd % 16 == 0)
      for (int b : o.kvquant_bits) {
        nlohmann::json art =
            kvquant_fit(kpre[size_t(il)].data(), n_tok, nkv, hd, b, kvquant_default_group_tokens,
                        kvquant_default_sink_tokens, -1, o.ctx);
        for (auto it = art.begin(); it != art.end(); ++it) L[it.key()] = it.value();
        art = kvquant_fit_static(kpre[size_t(il)].data(), n_tok, nkv, hd, b, kvquant_default_sink_tokens, -1, o.ctx);
        for (auto it = art.begin(); it != art.end(); ++it) L[it.key()] = it.value();
      }
    // Which RoPE pairs the mixed-precision KVQuant keys (kvquant2.25 .. kvquant3.75) widen.
    // (Needs a group of 32 tokens past each window's sink position.)
    if (hd % 16 == 0 && n_mean > 0 && o.ctx > kvquant_default_group_tokens) {
      const KvRope& r = cache_cfg.rope[size_t(il)];  // the layer's RoPE, as the cache's codecs get it
      std::vector<double> q_ms(qch2[size_t(il)].size());
      for (size_t i = 0; i < q_ms.size(); ++i) q_ms[i] = qch2[size_t(il)][i] / n_mean;
      const nlohmann::json art = kvquant_pair_weights(kpre[size_t(il)].data(), n_tok, nkv, hd, r, q_ms,
                                                      kvquant_default_group_tokens, kvquant_default_sink_tokens, o.ctx);
      for (auto it = art.begin(); it != art.end(); ++it) L[it.key()] = it.value();
    }
    j["layers"].push_back(L);
  }
  if (n_mean > 0) {  // the predicted gains printed below, kept with the artifacts
    j["k_scale_gain"] = std::exp(k_scale_gain_log);
    if (!qkn.is_null()) j["k_scale_gain_qk_norm"] = std::exp(k_qkn_gain_log);
  }
  report_write("-o", o.out, j.dump(1) + "\n");
  std::fprintf(stderr, "[calibrate] %d layers, %d tokens -> %s\n", c.n_layer, n_tok, o.out.c_str());
  std::fprintf(stderr, "[calibrate] channel means hold %.1f%% of the key energy and %.1f%% of the value energy (layer average)\n",
               100 * k_removed_all, 100 * v_removed_all);
  if (n_mean > 0) {
    const double gain = j["k_scale_gain"].get<double>();
    std::fprintf(stderr, "[calibrate] key channel scales (*_s formats) cut a rotated quantizer's expected squared score error %.2fx (geometric mean over layers and heads)%s\n",
                 gain, gain < 1.3 ? ": little to gain on this model, the unscaled formats will do as well" : "");
    if (!qkn.is_null())
      std::fprintf(stderr, "[calibrate] with the scales of --kv-scales qk-norm (the model's QK-norm weights, no calibration): %.2fx\n",
                   j["k_scale_gain_qk_norm"].get<double>());
  }
  return 0;
}

}  // namespace kvq
