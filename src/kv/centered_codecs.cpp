// Centered codecs (*_c): a per-token codec applied to x - mu, where mu is the channel mean of the
// layer's post-RoPE keys (or values) per KV head, measured by `kvq calibrate` ("k_mean" /
// "v_mean"). Keys carry a large common component: on SmolLM2-135M the channel means hold ~60% of
// the key energy (kvq calibrate prints the share), and a per-token quantizer spends its range on
// it. Centering is exact in attention, so the cache stores only the part that varies by token:
//  - keys:   <q, k> = <q, k - mu> + <q, mu>; <q, mu> is computed once per step (prepare_query)
//            and added to every score, so scores equal those of the decoded keys. (It is also a
//            constant shift per query, to which softmax is invariant.)
//  - values: sum_t p_t v_t = sum_t p_t (v_t - mu) + mu sum_t p_t; accumulate() adds the second
//            term for the tokens it sums, in the inner codec's storage basis (mu mapped through
//            the inverse of the inner codec's output rotation, computed once at construction).
// The packed bytes are the inner codec's, so bits per element are unchanged.
#include <cmath>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "kv/registry_internal.h"

namespace kvq {

namespace {

// Per-thread scratch, grown on first use: kernels do not allocate in steady state.
float* scratch(size_t n) {
  thread_local std::vector<float> buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

// Extra floats per query row after the inner codec's prepared rows: room for <q_i, mu> (n_q
// floats after n_q inner rows) at any n_q, keeping rows 64-byte multiples.
constexpr int kDotRoom = 16;

// mu (n_kv_heads, head_dim) of p.role at p.layer from the calibration JSON.
std::vector<std::vector<float>> calib_means(const KvCodecParams& p, const std::string& codec) {
  const char* key = p.role == KvRole::key ? "k_mean" : "v_mean";
  if (!p.calib)
    fail("KV codec '{}' subtracts the channel means of the layer's {}: pass a calibration JSON made by "
         "`kvq calibrate` (--kv-scales FILE)", codec, p.role == KvRole::key ? "keys" : "values");
  const nlohmann::json& j = *p.calib;
  if (!j.is_object() || !j.contains("layers") || !j["layers"].is_array())
    fail("KV codec '{}': calibration JSON has no \"layers\" array", codec);
  const auto& layers = j["layers"];
  if (size_t(p.layer) >= layers.size())
    fail("KV codec '{}': calibration JSON has {} layers, layer {} requested", codec, layers.size(), p.layer);
  const auto& L = layers[size_t(p.layer)];
  if (!L.is_object() || !L.contains(key))
    fail("KV codec '{}': calibration layer {} has no \"{}\" (rerun `kvq calibrate` to add the channel means)",
         codec, p.layer, key);
  const auto& m = L[key];
  if (!m.is_array() || m.size() != size_t(p.n_kv_heads))
    fail("KV codec '{}': calibration layer {} \"{}\" must hold {} heads of {} numbers", codec, p.layer, key,
         p.n_kv_heads, p.head_dim);
  std::vector<std::vector<float>> out;
  for (const auto& h : m) {
    if (!h.is_array() || h.size() != size_t(p.head_dim))
      fail("KV codec '{}': calibration layer {} \"{}\" must hold {} heads of {} numbers", codec, p.layer, key,
           p.n_kv_heads, p.head_dim);
    std::vector<float> v;
    for (const auto& x : h) {
      if (!x.is_number() || !std::isfinite(x.get<double>()))
        fail("KV codec '{}': calibration layer {} \"{}\" holds a non-finite or non-numeric value", codec, p.layer,
             key);
      v.push_back(x.get<float>());
    }
    out.push_back(std::move(v));
  }
  return out;
}

class CenteredCodec final : public KvCodec {
 public:
  CenteredCodec(std::string name, std::unique_ptr<KvCodec> inner, KvRole role, std::vector<std::vector<float>> mu)
      : inner_(std::move(inner)), role_(role), mu_(std::move(mu)) {
    info_ = inner_->info();
    KVQ_CHECK(!info_.pre_rope && info_.group_tokens == 1, "centered codec {}: the inner codec must be per-token",
              name);
    info_.name = std::move(name);
    const int d = head_dim();
    mu_store_ = mu_;
    if (role_ == KvRole::value && info_.transforms_output) {
      // finish_output maps a row r of the accumulator to M r (M orthogonal). Its image of the
      // identity gives M's columns, and the storage-basis mean is M^T mu.
      std::vector<float> eye(size_t(d) * size_t(d), 0.f);
      for (size_t h = 0; h < mu_.size(); ++h) {
        std::fill(eye.begin(), eye.end(), 0.f);
        for (int j = 0; j < d; ++j) eye[size_t(j) * size_t(d) + size_t(j)] = 1.f;
        inner_->finish_output(int(h), eye.data(), d);
        for (int j = 0; j < d; ++j) {
          double s = 0;
          for (int i = 0; i < d; ++i) s += double(eye[size_t(j) * size_t(d) + size_t(i)]) * mu_[h][size_t(i)];
          mu_store_[h][size_t(j)] = float(s);
        }
      }
    }
  }

  const KvCodecInfo& info() const override { return info_; }
  int head_dim() const override { return inner_->head_dim(); }
  int prepared_query_dim() const override {
    return inner_->prepared_query_dim() + (role_ == KvRole::key ? kDotRoom : 0);
  }
  size_t block_bytes(int block_tokens) const override { return inner_->block_bytes(block_tokens); }

  void encode(int head, const float* src, size_t src_stride, int n, uint8_t* block, int block_tokens, int t0,
              int pos0) const override {
    const int d = head_dim();
    const float* mu = mu_[size_t(head)].data();
    float* x = scratch(size_t(n) * size_t(d));  // (n, head_dim)
    for (int t = 0; t < n; ++t)
      for (int c = 0; c < d; ++c) x[size_t(t) * size_t(d) + size_t(c)] = src[size_t(t) * src_stride + size_t(c)] - mu[c];
    inner_->encode(head, x, size_t(d), n, block, block_tokens, t0, pos0);
  }

  void decode(int head, const uint8_t* block, int block_tokens, int t0, int n, int pos0,
              float* dst) const override {
    inner_->decode(head, block, block_tokens, t0, n, pos0, dst);
    const int d = head_dim();
    const float* mu = mu_[size_t(head)].data();
    for (int t = 0; t < n; ++t)
      for (int c = 0; c < d; ++c) dst[size_t(t) * size_t(d) + size_t(c)] += mu[c];
  }

  // qp: n_q inner prepared rows (inner stride), then <q_i, mu> for i < n_q.
  void prepare_query(int head, const float* q, int n_q, float* qp) const override {
    inner_->prepare_query(head, q, n_q, qp);
    if (role_ != KvRole::key) return;
    const int d = head_dim();
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
    const float* dots = qp + size_t(n_q) * size_t(inner_->prepared_query_dim());
    for (int i = 0; i < n_q; ++i) {
      float* o = out + size_t(i) * size_t(out_stride);
      for (int t = 0; t < n; ++t) o[t] += dots[i];
    }
  }

  void accumulate(int head, const float* p, int p_stride, int n_q, const uint8_t* block, int block_tokens, int t0,
                  int n, float* acc) const override {
    inner_->accumulate(head, p, p_stride, n_q, block, block_tokens, t0, n, acc);
    const int d = head_dim();
    const float* mu = mu_store_[size_t(head)].data();
    for (int i = 0; i < n_q; ++i) {
      // Eight partial sums: a form the compiler vectorizes (one running sum would be a serial
      // chain of float adds, which it may not reorder).
      const float* pi = p + size_t(i) * size_t(p_stride);
      float part[8] = {};
      int t = 0;
      for (; t + 8 <= n; t += 8)
        for (int j = 0; j < 8; ++j) part[j] += pi[t + j];
      float s = 0;
      for (; t < n; ++t) s += pi[t];
      for (int j = 0; j < 8; ++j) s += part[j];
      float* a = acc + size_t(i) * size_t(d);
      for (int c = 0; c < d; ++c) a[c] += s * mu[c];
    }
  }

  void finish_output(int head, float* acc, int n_q) const override { inner_->finish_output(head, acc, n_q); }

 private:
  std::unique_ptr<KvCodec> inner_;
  KvRole role_;
  std::vector<std::vector<float>> mu_;        // (n_kv_heads, head_dim), model basis
  std::vector<std::vector<float>> mu_store_;  // the same in the inner codec's accumulator basis
  KvCodecInfo info_;
};

void add(const std::string& inner) {
  const std::string name = inner + "_c";
  kv_register_codec({name, inner + " of x minus the layer's calibrated channel mean (needs kvq calibrate)",
                     [name, inner](const KvCodecParams& p) -> std::unique_ptr<KvCodec> {
                       auto mu = calib_means(p, name);
                       return std::make_unique<CenteredCodec>(name, kv_codec_create(inner, p), p.role, std::move(mu));
                     }});
}

}  // namespace

void kv_register_centered_codecs() {
  for (const char* c : {"int8", "q8_0", "q4_0", "q8_0h", "q4_0h", "int4_g32", "int4_g64", "int4_g128", "int2_g32", "int2_g64",
                        "int2_g128", "tq2", "tq2.5", "tq3", "tq3.5", "tq4", "int4t_g32", "int4t_g64", "int4t_g128",
                        "int4t_g32h", "int4t_g64h", "int4t_g128h"})
    add(c);
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
