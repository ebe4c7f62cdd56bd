// Centered and scaled codecs (*_c, *_s, *_cs): a per-token codec applied to (x - mu) / s, with
// mu the channel mean and s a channel scale of the layer's post-RoPE keys (or values) per KV
// head, both from `kvq calibrate`. Both are exact in attention, so the cache stores only what a
// per-token quantizer handles well:
//  - Centering: keys carry a large common component (on SmolLM2-135M the channel means hold ~60%
//    of the key energy; kvq calibrate prints the share), on which a per-token quantizer spends its
//    range. <q, k> = <q, k - mu> + <q, mu>; <q, mu> is computed once per step (prepare_query) and
//    added to every score. For values, sum_t p_t v_t = sum_t p_t (v_t - mu) + mu sum_t p_t; the
//    second term is added once per pass over the blocks (finish_output_mass), from the weights'
//    sum that attention keeps anyway.
//  - Scaling: <q, k> = <q * s, k / s>, so the inner codec sees keys k / s and queries q * s. A
//    rotated quantizer (TurboQuant, the Hadamard formats) makes an error that is isotropic in the
//    basis it quantizes, so the expected squared score error is proportional to
//    E|k / s|^2 E|q * s|^2: by Cauchy-Schwarz smallest, (sum_c rms(k_c) rms(q_c))^2, at
//    s_c^2 = rms(k_c) / rms(q_c), for keys one scale per RoPE pair (from the pair's pooled
//    statistics, which RoPE does not move; calib_scales). Channels where keys are large but
//    queries small (outlier channels) are shrunk before they can dominate the per-token norm or
//    scale. For values the output error E|s * e|^2 is smallest at s_c^2 = rms(v_c);
//    finish_output multiplies by s.
//    kvq calibrate stores rms(k_c), rms(q_c) (the group's query heads pooled) and rms(v_c) and
//    prints the predicted score-error factor; with centering, the channels' standard deviations
//    replace the key and value RMS. On a model with QK-norm, `--kv-scales qk-norm` gives rms(k_c)
//    and rms(q_c) up to a common factor from the norm weights alone (tools/kv_flags.h,
//    kv_qk_norm_calib); it has no value statistics, so there the *_s formats scale keys only.
// The packed bytes are the inner codec's, so bits per element are unchanged.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "kv/calib.h"
#include "kv/grouped_common.h"
#include "kv/registry_internal.h"

namespace kvq {

namespace {

struct CenteredScratch;
float* scratch(size_t n) { return kv_thread_scratch<CenteredScratch>(n); }

// Extra floats per query row after the inner codec's prepared rows: room for <q_i, mu> (n_q
// floats after n_q inner rows) at any n_q, keeping rows 64-byte multiples.
constexpr int kDotRoom = 16;

// True when the calibration is `--kv-scales qk-norm`'s (kv_qk_norm_calib, tools/kv_flags.h):
// key and query channel RMS from the model's QK-norm weights, nothing else.
bool calib_from_qk_norm(const KvCodecParams& p) { return !kv_calib_missing_hint(p.calib).empty(); }

// The per-head channel vector `key` (n_kv_heads, head_dim) at p.layer from the calibration JSON.
std::vector<std::vector<float>> calib_vectors(const KvCodecParams& p, const std::string& codec, const char* key,
                                              const char* what) {
  if (!p.calib)
    fail("KV codec '{}' uses the {} of the layer's {}: pass a calibration JSON made by "
         "`kvq calibrate` (--kv-scales FILE){}", codec, what, p.role == KvRole::key ? "keys" : "values",
         std::strcmp(key, "q_rms") == 0 || std::strcmp(key, "k_rms") == 0
             ? ", or on a model with QK-norm --kv-scales qk-norm (key scales from its norm weights)"
             : "");
  const nlohmann::json& j = *p.calib;
  if (!j.is_object() || !j.contains("layers") || !j["layers"].is_array())
    fail("KV codec '{}': calibration JSON has no \"layers\" array", codec);
  const auto& layers = j["layers"];
  if (size_t(p.layer) >= layers.size())
    fail("KV codec '{}': calibration JSON has {} layers, layer {} requested", codec, layers.size(), p.layer);
  const auto& L = layers[size_t(p.layer)];
  if (calib_from_qk_norm(p) && L.is_object() && !L.contains(key))
    fail("KV codec '{}' needs the {} of the layer's {}{}", codec, what, p.role == KvRole::key ? "keys" : "values",
         kv_calib_missing_hint(p.calib));
  if (!L.is_object() || !L.contains(key))
    fail("KV codec '{}': calibration layer {} has no \"{}\" (rerun `kvq calibrate` to add the {})", codec, p.layer,
         key, what);
  return kv_calib_head_vectors(L[key], fmt::format("KV codec '{}': calibration layer {} \"{}\"", codec, p.layer, key),
                               p.n_kv_heads, p.head_dim);
}

// Channel scales from the calibration's RMS vectors (kv_channel_scales, kv/calib.h).
std::vector<std::vector<float>> calib_scales(const KvCodecParams& p, const std::string& codec, bool centered) {
  const bool key = p.role == KvRole::key;
  const auto x = calib_vectors(p, codec, key ? "k_rms" : "v_rms", "channel RMS");
  const auto mu = centered ? calib_vectors(p, codec, key ? "k_mean" : "v_mean", "channel means")
                           : std::vector<std::vector<float>>{};
  const auto q = key ? calib_vectors(p, codec, "q_rms", "query channel RMS") : std::vector<std::vector<float>>{};
  std::vector<std::vector<float>> out;
  for (size_t h = 0; h < x.size(); ++h)
    out.push_back(kv_channel_scales(x[h].data(), centered ? mu[h].data() : nullptr, key ? q[h].data() : nullptr,
                                    int(x[h].size()), key ? p.rope : KvRope{}));
  return out;
}

}  // namespace

std::vector<float> kv_channel_scales(const float* x, const float* mu, const float* q, int dim, const KvRope& rope) {
  const bool key = q != nullptr;
  const size_t d = size_t(dim);
  std::vector<double> s(d);
  double smax = 0;
  for (size_t c = 0; c < d; ++c) {
    double v = double(x[c]) * x[c];
    if (mu) v -= double(mu[c]) * mu[c];
    double sd = std::sqrt(std::max(v, 0.0));
    if (key) sd = q[c] > 0 ? sd / q[c] : -1.0;  // -1: unread, set below
    s[c] = sd < 0 ? -1.0 : std::sqrt(sd);
  }
  // RoPE turns each rotated channel pair by a position-dependent angle, so per-channel
  // statistics of post-RoPE keys and queries hold only for the positions they were measured
  // at: a low-frequency pair keeps its measured split between its two channels over a
  // 512-token window and swaps it thousands of tokens later. One scale per pair (from the
  // pair's pooled mean square) commutes with the rotation and holds at every position.
  if (key && rope.n_rot > 0) {
    const int nr = std::min(rope.n_rot, dim), half = nr / 2;
    for (int i = 0; i < half; ++i) {
      const size_t a = rope.neox ? size_t(i) : size_t(2 * i), b = rope.neox ? size_t(i + half) : size_t(2 * i + 1);
      double kk = 0, qq = 0;
      for (size_t c : {a, b}) {
        double v = double(x[c]) * x[c];
        if (mu) v -= double(mu[c]) * mu[c];
        kk += std::max(v, 0.0) / 2;
        qq += double(q[c]) * q[c] / 2;
      }
      s[a] = s[b] = qq > 0 ? std::sqrt(std::sqrt(kk / qq)) : -1.0;
    }
  }
  smax = *std::max_element(s.begin(), s.end());
  if (!(smax > 0)) smax = 1;
  for (auto& v : s)
    if (v < 0) v = smax;
  double lg = 0;
  for (auto& v : s) {
    v = std::max(v, 1e-3 * smax);
    lg += std::log(v);
  }
  const double g = std::exp(lg / double(d));
  std::vector<float> r(d);
  for (size_t c = 0; c < d; ++c) r[c] = float(s[c] / g);
  return r;
}

namespace {

class AffineCodec final : public KvWrappedCodec {
 public:
  // mu: channel means (empty: not centered); s: channel scales (empty: not scaled).
  AffineCodec(std::string name, std::unique_ptr<KvCodec> inner, KvRole role, std::vector<std::vector<float>> mu,
              std::vector<std::vector<float>> s)
      : KvWrappedCodec(std::move(inner)), role_(role), mu_(std::move(mu)), s_(std::move(s)) {
    KVQ_CHECK(!info_.pre_rope && info_.group_tokens == 1, "centered / scaled codec {}: the inner codec must be per-token",
              name);
    info_.name = std::move(name);
    if (!s_.empty()) {
      info_.transforms_output = info_.transforms_output || role_ == KvRole::value;
      info_.transforms_query = info_.transforms_query || role_ == KvRole::key;
    }
  }

  int prepared_query_dim() const override {
    return inner_->prepared_query_dim() + (role_ == KvRole::key && !mu_.empty() ? kDotRoom : 0);
  }

  void encode(int head, const float* src, size_t src_stride, int n, uint8_t* block, int block_tokens, int t0,
              int pos0) const override {
    const int d = head_dim();
    float* x = scratch(size_t(n) * size_t(d));  // (n, head_dim)
    for (int t = 0; t < n; ++t) {
      const float* r = src + size_t(t) * src_stride;
      float* o = x + size_t(t) * size_t(d);
      for (int c = 0; c < d; ++c) o[c] = r[c];
      if (!mu_.empty())
        for (int c = 0; c < d; ++c) o[c] -= mu_[size_t(head)][size_t(c)];
      if (!s_.empty())
        for (int c = 0; c < d; ++c) o[c] /= s_[size_t(head)][size_t(c)];
    }
    inner_->encode(head, x, size_t(d), n, block, block_tokens, t0, pos0);
  }

  void decode(int head, const uint8_t* block, int block_tokens, int t0, int n, int pos0,
              float* dst) const override {
    inner_->decode(head, block, block_tokens, t0, n, pos0, dst);
    const int d = head_dim();
    for (int t = 0; t < n; ++t) {
      float* o = dst + size_t(t) * size_t(d);
      if (!s_.empty())
        for (int c = 0; c < d; ++c) o[c] *= s_[size_t(head)][size_t(c)];
      if (!mu_.empty())
        for (int c = 0; c < d; ++c) o[c] += mu_[size_t(head)][size_t(c)];
    }
  }

  // qp: n_q inner prepared rows (of q * s when scaled; inner stride), then <q_i, mu> for i < n_q
  // when centered.
  void prepare_query(int head, const float* q, int n_q, float* qp) const override {
    const int d = head_dim();
    if (role_ == KvRole::key && !s_.empty()) {
      float* qs = scratch(size_t(n_q) * size_t(d));
      const float* s = s_[size_t(head)].data();
      for (int i = 0; i < n_q; ++i)
        for (int c = 0; c < d; ++c) qs[size_t(i) * size_t(d) + size_t(c)] = q[size_t(i) * size_t(d) + size_t(c)] * s[c];
      inner_->prepare_query(head, qs, n_q, qp);
    } else {
      inner_->prepare_query(head, q, n_q, qp);
    }
    if (role_ != KvRole::key || mu_.empty()) return;
    const float* mu = mu_[size_t(head)].data();
    float* dots = qp + size_t(n_q) * size_t(inner_->prepared_query_dim());
    for (int i = 0; i < n_q; ++i) {
      double s = 0;
      for (int c = 0; c < d; ++c) s += double(q[size_t(i) * size_t(d) + size_t(c)]) * mu[c];
      dots[i] = float(s);
    }
  }

  void scores(int head, const float* qp, int n_q, const uint8_t* block, int block_tokens, int t0, int n, int pos0,
              float* out, int out_stride) const override {
    inner_->scores(head, qp, n_q, block, block_tokens, t0, n, pos0, out, out_stride);
    add_mean_dots(qp, n_q, n, out, out_stride);
  }
  void scores_spans(int head, const float* qp, int n_q, const KvSpan* spans, int n_spans, float* out,
                    int out_stride) const override {
    inner_->scores_spans(head, qp, n_q, spans, n_spans, out, out_stride);
    int n = 0;
    for (int s = 0; s < n_spans; ++s) n += std::max(0, spans[s].n);
    add_mean_dots(qp, n_q, n, out, out_stride);
  }

  // The weighted sums are the inner codec's (KvWrappedCodec); the value mean's share,
  // mu * sum_t p_t, is added once per pass in finish_output_mass.

  // The linear part: the inner codec's map to the model's basis, then the value scales.
  void finish_output(int head, float* acc, int n_q) const override {
    inner_->finish_output(head, acc, n_q);
    if (role_ != KvRole::value || s_.empty()) return;
    const int d = head_dim();
    const float* s = s_[size_t(head)].data();
    for (int i = 0; i < n_q; ++i)
      for (int c = 0; c < d; ++c) acc[size_t(i) * size_t(d) + size_t(c)] *= s[c];
  }

  // sum_t p_t v_t = s * (linear part) + mu * sum_t p_t.
  void finish_output_mass(int head, float* acc, int n_q, const float* mass) const override {
    finish_output(head, acc, n_q);
    if (role_ != KvRole::value || mu_.empty()) return;
    const int d = head_dim();
    const float* mu = mu_[size_t(head)].data();
    for (int i = 0; i < n_q; ++i)
      for (int c = 0; c < d; ++c) acc[size_t(i) * size_t(d) + size_t(c)] += mass[i] * mu[c];
  }

 private:
  // The key mean's share of each score, q . mu (prepared after the inner query), on n columns.
  void add_mean_dots(const float* qp, int n_q, int n, float* out, int out_stride) const {
    if (mu_.empty()) return;
    const float* dots = qp + size_t(n_q) * size_t(inner_->prepared_query_dim());
    for (int i = 0; i < n_q; ++i) {
      float* o = out + size_t(i) * size_t(out_stride);
      for (int t = 0; t < n; ++t) o[t] += dots[i];
    }
  }

  KvRole role_;
  std::vector<std::vector<float>> mu_;        // (n_kv_heads, head_dim), model basis; empty: not centered
  std::vector<std::vector<float>> s_;         // (n_kv_heads, head_dim) channel scales; empty: not scaled
};

// Registers inner + suffix: "_c" centered, "_s" scaled, "_cs" both.
void add(const std::string& inner, const char* suffix) {
  const std::string name = inner + suffix;
  const bool center = suffix[1] == 'c', scale = suffix[std::strlen(suffix) - 1] == 's';
  const char* what = center && scale ? " of (x - mean) / scale, per channel"
                     : center        ? " of x minus the layer's calibrated channel mean"
                                     : " of x / scale, per channel";
  kv_register_codec({name, inner + what + " (needs kvq calibrate)",
                     [name, inner, center, scale](const KvCodecParams& p) -> std::unique_ptr<KvCodec> {
                       auto mu = center ? calib_vectors(p, name, p.role == KvRole::key ? "k_mean" : "v_mean",
                                                        "channel means")
                                        : std::vector<std::vector<float>>{};
                       // --kv-scales qk-norm has no value statistics (the model does not normalize
                       // values): its *_s formats scale keys only.
                       const bool unscaled_values = p.role == KvRole::value && !center && calib_from_qk_norm(p);
                       auto s = scale && !unscaled_values ? calib_scales(p, name, center)
                                                          : std::vector<std::vector<float>>{};
                       return std::make_unique<AffineCodec>(name, kv_codec_create(inner, p), p.role, std::move(mu),
                                                            std::move(s));
                     }});
}

}  // namespace

void kv_register_centered_codecs() {
  for (const char* c : {"int8", "q8_0", "q4_0", "q8_0h", "q4_0h", "int4_g32", "int4_g64", "int4_g128", "int2_g32", "int2_g64",
                        "int2_g128", "tq2", "tq2.5", "tq3", "tq3.5", "tq4", "int4t_g32", "int4t_g64", "int4t_g128",
                        "int4t_g32h", "int4t_g64h", "int4t_g128h"})
    add(c, "_c");
  for (const char* c : {"q8_0h", "q4_0h", "int4t_g64h", "int4t_g128h", "tq2", "tq2.5", "tq3", "tq3.5", "tq4"}) {
    for (const char* suf : {"_s", "_cs"}) {
      add(c, suf);
      const std::string n = std::string(c) + suf;
      kv_register_format({n, {}, n, n,
                          std::string(c) + (suf[1] == 'c' ? " of keys and values centered and scaled per channel"
                                                          : " of keys and values scaled per channel") +
                              " (keys s^2 = rms(k) / rms(q) per RoPE pair, values s^2 = rms(v); needs kvq calibrate" +
                              (suf[1] == 'c' ? ")" : ", or --kv-scales qk-norm for keys alone on a QK-norm model)")});
    }
  }
  const char* what = " of keys and values minus their calibrated channel means (needs kvq calibrate)";
  auto fmt = [&](const char* name, const char* k, const char* v, const std::string& desc) {
    kv_register_format({name, {}, k, v, desc});
  };
  fmt("int8_c", "int8_c", "int8_c", std::string("int8 per token") + what + ": 8 + 32/head_dim bits");
  fmt("q4_0h_c", "q4_0h_c", "q4_0h_c", std::string("q4_0h") + what + ": 4.5 bits");
  fmt("int4_c", "int4t_g64_c", "int4t_g64_c", std::string("int4t_g64") + what + ": 4.5 bits");
  fmt("int4t_g64h_c", "int4t_g64h_c", "int4t_g64h_c", std::string("int4t_g64h (rotated)") + what + ": 4.5 bits");
  fmt("int2_c", "int2_g32_c", "int2_g32_c", std::string("int2_g32") + what + ": 3 bits");
  fmt("tq2_c", "tq2_c", "tq2_c", std::string("TurboQuant 2 bits") + what);
  fmt("tq2.5_c", "tq2.5_c", "tq2.5_c", std::string("TurboQuant 2.5 bits") + what);
  fmt("tq3_c", "tq3_c", "tq3_c", std::string("TurboQuant 3 bits") + what);
  fmt("tq3.5_c", "tq3.5_c", "tq3.5_c", std::string("TurboQuant 3.5 bits") + what);
  fmt("tq4_c", "tq4_c", "tq4_c", std::string("TurboQuant 4 bits") + what);
}

}  // namespace kvq
