#include "model/model.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include <fmt/ranges.h>

#include "core/error.h"
#include "kv/kvquant.h"
#include "weights/glu.h"
#include "weights/weights.h"

namespace kvq {

namespace {

// Decode attention: an item (row x KV head) is cut between threads only where both sides keep at
// least this many tokens (attn_balance_pieces); shorter parts cost more in merging than they save.
constexpr int kMinPieceTokens = 1024;
// Prefill rows of one sequence per attention call (KvCache::attend_rows).
constexpr int kPrefillRows = 16;

WeightView view_of(const gguf::File& f, const std::string& name, int64_t n_in, int64_t n_out, bool required = true) {
  const gguf::TensorInfo* t = f.find_tensor(name);
  if (!t) {
    if (required) fail("{}: missing tensor '{}'", f.path(), name);
    return {};
  }
  int64_t ne0 = t->ne.empty() ? 0 : t->ne[0];
  int64_t ne1 = 1;
  for (size_t i = 1; i < t->ne.size(); ++i) ne1 *= t->ne[i];
  if (ne0 != n_in || ne1 != n_out)
    fail("{}: tensor '{}' has shape [{}, {}], expected [{}, {}]", f.path(), name, ne0, ne1, n_in, n_out);
  if (!weight_type_supported(t->type))
    fail("{}: tensor '{}' has type {}, which kvq does not support", f.path(), name, ggml_type_name(t->type));
  if (n_out > 1 && ne1 > 1 && t->ne.size() > 2) fail("{}: tensor '{}' must be 2-D", f.path(), name);
  WeightView w;
  w.type = t->type;
  w.data = t->data;
  w.n_in = n_in;
  w.n_out = n_out;
  w.row_bytes = ggml_row_bytes(t->type, n_in);
  return w;
}

// Rows [from, from + n) of a weight matrix: a view into the same data (rows are whole blocks).
WeightView rows_of(const WeightView& w, int64_t from, int64_t n) {
  WeightView r = w;
  r.data = static_cast<const uint8_t*>(w.data) + size_t(from) * w.row_bytes;
  r.n_out = n;
  return r;
}

// Expert e's matrix of a 3-D tensor [n_in, n_out, n_expert] (ne order), one row view per expert.
std::vector<WeightView> experts_of(const gguf::File& f, const std::string& name, int64_t n_in, int64_t n_out, int n_expert) {
  const gguf::TensorInfo* t = f.find_tensor(name);
  if (!t) fail("{}: missing tensor '{}'", f.path(), name);
  if (t->ne.size() != 3 || t->ne[0] != n_in || t->ne[1] != n_out || t->ne[2] != n_expert)
    fail("{}: tensor '{}' has shape [{}], expected [{}, {}, {}] (inputs, outputs, experts)", f.path(), name,
         fmt::format("{}", fmt::join(t->ne, ", ")), n_in, n_out, n_expert);
  if (!weight_type_supported(t->type))
    fail("{}: tensor '{}' has type {}, which kvq does not support", f.path(), name, ggml_type_name(t->type));
  WeightView all;
  all.type = t->type;
  all.data = t->data;
  all.n_in = n_in;
  all.n_out = n_out * n_expert;
  all.row_bytes = ggml_row_bytes(t->type, n_in);
  std::vector<WeightView> v;
  for (int e = 0; e < n_expert; ++e) v.push_back(rows_of(all, int64_t(e) * n_out, n_out));
  return v;
}

WeightView norm_of(const gguf::File& f, const std::string& name, int64_t n, bool required = true) {
  WeightView w = view_of(f, name, n, 1, required);
  if (w.data && w.type != GgmlType::F32) fail("{}: tensor '{}' (a norm or bias) must be F32, is {}", f.path(), name, ggml_type_name(w.type));
  return w;
}

// The experts' biases: F32 [n, n_expert] (expert e's n values from e * n on)
WeightView expert_bias_of(const gguf::File& f, const std::string& name, int64_t n, int n_expert) {
  WeightView w = view_of(f, name, n, n_expert);
  if (w.type != GgmlType::F32) fail("{}: tensor '{}' (a bias) must be F32, is {}", f.path(), name, ggml_type_name(w.type));
  return w;
}

// y = x / rms(x) * w, row by row. x, y: (n_rows, n); w: (n)
void rms_norm(const float* x, float* y, const float* w, int n_rows, int n, float eps) {
  for (int r = 0; r < n_rows; ++r) {
    const float* xr = x + size_t(r) * size_t(n);
    float* yr = y + size_t(r) * size_t(n);
    double ss = 0;
    for (int i = 0; i < n; ++i) ss += double(xr[i]) * double(xr[i]);
    const float s = float(1.0 / std::sqrt(ss / n + double(eps)));
    for (int i = 0; i < n; ++i) yr[i] = xr[i] * s * w[i];
  }
}

// x += y * scale (scale 0: 1), the residual add of a layer's attention or FFN output y
void add_residual(float* x, const float* y, size_t n, float scale) {
  if (scale > 0)
    for (size_t i = 0; i < n; ++i) x[i] += y[i] * scale;
  else
    for (size_t i = 0; i < n; ++i) x[i] += y[i];
}

// x (n_rows, n) += b (n) on every row
void add_bias(float* x, const float* b, int n_rows, int64_t n) {
  for (int r = 0; r < n_rows; ++r)
    for (int64_t i = 0; i < n; ++i) x[size_t(r) * size_t(n) + size_t(i)] += b[i];
}

// RoPE in place on `n_heads` heads of one token. x: (n_heads, head_dim)
void rope(float* x, int n_heads, int head_dim, int n_rot, bool neox, const float* cs /* (n_rot/2, 2) */) {
  const int half = n_rot / 2;
  for (int h = 0; h < n_heads; ++h) {
    float* xh = x + size_t(h) * size_t(head_dim);
    for (int i = 0; i < half; ++i) {
      const int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
      const float c = cs[2 * i], s = cs[2 * i + 1];
      const float x0 = xh[a], x1 = xh[b];
      xh[a] = x0 * c - x1 * s;
      xh[b] = x0 * s + x1 * c;
    }
  }
}

// The RoPE table of one position: the angles in double, at the rates of kv_rope_theta, which the
// pre-RoPE key codecs rotate with too (at positions in the tens of thousands float angles drift by
// ~1e-3 rad).
void rope_table(float* cs, int pos, const KvRope& r) {
  for (int i = 0; i < r.n_rot / 2; ++i) {
    const double theta = double(pos) * kv_rope_theta(r, i);
    cs[2 * i] = float(std::cos(theta));
    cs[2 * i + 1] = float(std::sin(theta));
  }
}

}  // namespace

std::unique_ptr<Model> Model::load(const std::string& path, const RopeOverrides& rope) {
  auto m = std::unique_ptr<Model>(new Model());
  m->file_ = gguf::File::open(path);
  const gguf::File& f = *m->file_;
  m->cfg_ = model_config_from_gguf(f);
  model_config_apply_rope(m->cfg_, rope);
  const ModelConfig& c = m->cfg_;
  const int64_t qd = int64_t(c.n_head) * c.head_dim, kvd = int64_t(c.n_head_kv) * c.head_dim;
  m->tok_embd_ = view_of(f, "token_embd.weight", c.n_embd, c.n_vocab);
  m->output_norm_ = norm_of(f, "output_norm.weight", c.n_embd);
  m->output_ = c.tied_output ? m->tok_embd_ : view_of(f, "output.weight", c.n_embd, c.n_vocab);
  m->layers_.resize(size_t(c.n_layer));
  m->build_layer_rope();
  for (int il = 0; il < c.n_layer; ++il) {
    auto& L = m->layers_[size_t(il)];
    const std::string p = "blk." + std::to_string(il) + ".";
    if (c.pre_norms) L.attn_norm = norm_of(f, p + "attn_norm.weight", c.n_embd);
    if (f.find_tensor(p + "attn_qkv.weight")) {  // one matrix: the q rows, then k's, then v's (Phi-3)
      const WeightView qkv = view_of(f, p + "attn_qkv.weight", c.n_embd, qd + 2 * kvd);
      L.wq = rows_of(qkv, 0, qd);
      L.wk = rows_of(qkv, qd, kvd);
      L.wv = rows_of(qkv, qd + kvd, kvd);
    } else {
      L.wq = view_of(f, p + "attn_q.weight", c.n_embd, qd);
      L.wk = view_of(f, p + "attn_k.weight", c.n_embd, kvd);
      L.wv = view_of(f, p + "attn_v.weight", c.n_embd, kvd);
    }
    L.wo = view_of(f, p + "attn_output.weight", qd, c.n_embd);
    // (gpt-oss's files name the FFN's norm post_attention_norm)
    if (c.pre_norms) L.ffn_norm = norm_of(f, p + (c.arch == "gpt-oss" ? "post_attention_norm.weight" : "ffn_norm.weight"), c.n_embd);
    if (c.attn_out_bias) L.bo = norm_of(f, p + "attn_output.bias", c.n_embd);
    if (c.attn_sinks) L.attn_sinks = norm_of(f, p + "attn_sinks.weight", c.n_head);
    if (c.n_expert > 0) {
      L.ffn_gate_inp = view_of(f, p + "ffn_gate_inp.weight", c.n_embd, c.n_expert);
      L.ffn_gate_exps = experts_of(f, p + "ffn_gate_exps.weight", c.n_embd, c.n_ff_exp, c.n_expert);
      L.ffn_up_exps = experts_of(f, p + "ffn_up_exps.weight", c.n_embd, c.n_ff_exp, c.n_expert);
      L.ffn_down_exps = experts_of(f, p + "ffn_down_exps.weight", c.n_ff_exp, c.n_embd, c.n_expert);
      for (const char* t : {"ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight"})
        m->expert_bytes_ += f.find_tensor(p + t)->nbytes;
      if (c.moe_bias) {
        L.ffn_gate_inp_b = norm_of(f, p + "ffn_gate_inp.bias", c.n_expert);
        L.ffn_gate_exps_b = expert_bias_of(f, p + "ffn_gate_exps.bias", c.n_ff_exp, c.n_expert);
        L.ffn_up_exps_b = expert_bias_of(f, p + "ffn_up_exps.bias", c.n_ff_exp, c.n_expert);
        L.ffn_down_exps_b = expert_bias_of(f, p + "ffn_down_exps.bias", c.n_embd, c.n_expert);
      }
      if (c.n_ff_shexp > 0) {
        L.ffn_gate_shexp = view_of(f, p + "ffn_gate_shexp.weight", c.n_embd, c.n_ff_shexp);
        L.ffn_up_shexp = view_of(f, p + "ffn_up_shexp.weight", c.n_embd, c.n_ff_shexp);
        L.ffn_down_shexp = view_of(f, p + "ffn_down_shexp.weight", c.n_ff_shexp, c.n_embd);
        if (c.shexp_gated) L.ffn_gate_inp_shexp = view_of(f, p + "ffn_gate_inp_shexp.weight", c.n_embd, 1);
      }
    } else if (c.fused_gate_up) {  // ffn_up: the gate rows, then the up rows (Phi-3)
      const WeightView gu = view_of(f, p + "ffn_up.weight", c.n_embd, 2 * int64_t(c.n_ff));
      L.ffn_gate = rows_of(gu, 0, c.n_ff);
      L.ffn_up = rows_of(gu, c.n_ff, c.n_ff);
    } else {
      L.ffn_gate = view_of(f, p + "ffn_gate.weight", c.n_embd, c.n_ff);
      L.ffn_up = view_of(f, p + "ffn_up.weight", c.n_embd, c.n_ff);
    }
    if (c.n_expert == 0) L.ffn_down = view_of(f, p + "ffn_down.weight", c.n_ff, c.n_embd);
    if (c.qkv_bias) {
      L.bq = norm_of(f, p + "attn_q.bias", qd);
      L.bk = norm_of(f, p + "attn_k.bias", kvd);
      L.bv = norm_of(f, p + "attn_v.bias", kvd);
    }
    if (c.qk_norm) {
      L.attn_q_norm = norm_of(f, p + "attn_q_norm.weight", c.qk_norm_full ? qd : c.head_dim);
      L.attn_k_norm = norm_of(f, p + "attn_k_norm.weight", c.qk_norm_full ? kvd : c.head_dim);
    }
    if (c.post_norms) {
      L.attn_post_norm = norm_of(f, p + "post_attention_norm.weight", c.n_embd);
      L.ffn_post_norm = norm_of(f, p + "post_ffw_norm.weight", c.n_embd);
    }
  }
  return m;
}

void Model::build_layer_rope() {
  const ModelConfig& c = cfg_;
  layer_rope_.clear();
  layer_rope_mscale_.clear();
  for (int il = 0; il < c.n_layer; ++il) {
    layer_rope_.push_back(model_layer_rope(c, il));
    layer_rope_mscale_.push_back(model_layer_rope_mscale(c, il));
  }
}

bool Model::set_context(int ctx) {
  const bool was = cfg_.rope_long;
  model_config_pick_rope(cfg_, ctx);
  build_layer_rope();
  return cfg_.rope_long != was;
}

size_t Model::decode_weight_bytes(int n_seqs) const {
  size_t b = file_->tensor_bytes();
  if (!cfg_.tied_output) b -= size_t(tok_embd_.n_out) * tok_embd_.row_bytes;
  // n_seqs tokens read at most n_seqs x n_expert_used of each layer's experts
  if (cfg_.n_expert > 0) {
    const int64_t read = std::min<int64_t>(cfg_.n_expert, int64_t(std::max(n_seqs, 1)) * cfg_.n_expert_used);
    b -= size_t(double(expert_bytes_) * double(cfg_.n_expert - read) / double(cfg_.n_expert));
  }
  return b;
}

std::unique_ptr<Model> Model::load_f32(const std::string& path, const RopeOverrides& rope) {
  auto m = load(path, rope);
  m->dequantize_all_f32();
  return m;
}

void Model::dequantize_all_f32() {
  auto convert = [&](WeightView& w) {
    if (!w.data || w.type == GgmlType::F32 || w.n_out <= 1) return;
    AlignedBuf<float> buf(size_t(w.n_in) * size_t(w.n_out));
    for (int64_t r = 0; r < w.n_out; ++r)
      dequantize_row_ref(w.type, static_cast<const uint8_t*>(w.data) + size_t(r) * w.row_bytes, buf.data() + size_t(r) * size_t(w.n_in), w.n_in);
    w.type = GgmlType::F32;
    w.data = buf.data();
    w.row_bytes = size_t(w.n_in) * sizeof(float);
    f32_weights_.push_back(std::move(buf));
  };
  const bool tied = cfg_.tied_output;
  convert(tok_embd_);
  if (tied) output_ = tok_embd_;
  else convert(output_);
  for (auto& L : layers_) {
    for (WeightView* w : {&L.wq, &L.wk, &L.wv, &L.wo, &L.ffn_gate, &L.ffn_up, &L.ffn_down, &L.ffn_gate_inp,
                          &L.ffn_gate_shexp, &L.ffn_up_shexp, &L.ffn_down_shexp})
      convert(*w);
    for (auto* ws : {&L.ffn_gate_exps, &L.ffn_up_exps, &L.ffn_down_exps})
      for (WeightView& w : *ws) convert(w);
  }
}

KvCacheConfig Model::kv_cache_config(const KvPolicy& policy, int max_tokens, int page_tokens) const {
  KvCacheConfig kc;
  kc.n_layer = cfg_.n_layer;
  kc.n_kv_heads = cfg_.n_head_kv;
  kc.head_dim = cfg_.head_dim;
  kc.page_tokens = page_tokens;
  kc.max_tokens = max_tokens;
  kc.policy = policy;
  kc.rope = layer_rope_;
  for (int il = 0; il < cfg_.n_layer; ++il) kc.window.push_back(cfg_.layer_window(il));
  return kc;
}

Forward::Forward(const Model& m, ThreadPool& pool, int max_batch) : m_(m), pool_(pool), max_batch_(max_batch) {
  const ModelConfig& c = m.cfg_;
  const size_t B = size_t(max_batch);
  x_.resize(B * size_t(c.n_embd));
  xn_.resize(B * size_t(c.n_embd));
  tmp_.resize(B * size_t(c.n_embd));
  q_.resize(B * size_t(c.n_head) * size_t(c.head_dim));
  attn_out_.resize(B * size_t(c.n_head) * size_t(c.head_dim));
  k_pre_.resize(B * size_t(c.n_head_kv) * size_t(c.head_dim));
  k_.resize(B * size_t(c.n_head_kv) * size_t(c.head_dim));
  v_.resize(B * size_t(c.n_head_kv) * size_t(c.head_dim));
  gate_.resize(B * size_t(c.ffn_active_channels()));
  up_.resize(B * size_t(c.ffn_active_channels()));
  if (c.n_expert > 0) {
    const size_t k = size_t(c.n_expert_used);
    router_.resize(B * size_t(c.n_expert));
    moe_w_.resize(B * k);
    moe_sel_.resize(B * k);
    moe_rows_.resize(2 * B * k);
    moe_off_.resize(size_t(c.n_expert) + 1);
    moe_fill_.resize(size_t(c.n_expert));
    moe_x_.resize(B * k * size_t(c.n_embd));
    moe_y_.resize(B * (k + (c.n_ff_shexp > 0 ? 1 : 0)) * size_t(c.n_embd));
    shexp_gate_.resize(B);
    moe_jobs_.reserve(2 * size_t(c.n_expert) + 3);
  }
  attn_scratch_.resize(size_t(pool.size()));
  spans_.resize(size_t(pool.size()));
}

size_t Forward::scratch_bytes() const {
  size_t b = 0;
  for (const auto* a : {&x_, &xn_, &tmp_, &q_, &attn_out_, &k_pre_, &k_, &v_, &gate_, &up_, &logits_, &router_, &moe_w_,
                        &moe_x_, &moe_y_, &shexp_gate_})
    b += a->bytes();
  b += (moe_sel_.capacity() + moe_rows_.capacity() + moe_off_.capacity() + moe_fill_.capacity()) * sizeof(int);
  b += moe_jobs_.capacity() * sizeof(MatmulJob);
  for (const auto& s : attn_scratch_) b += s.bytes();
  return b + part_states_.bytes();
}

const float* Forward::eval(const int32_t* tokens, int n, KvCache& cache, bool all_logits) {
  const int nv = m_.cfg_.n_vocab;
  logits_.resize(size_t(all_logits ? n : 1) * size_t(nv));
  for (int i = 0; i < n; i += max_batch_) {
    const int nc = std::min(max_batch_, n - i);
    ForwardSeq s{tokens + i, nc, &cache, all_logits ? ForwardSeq::all : (i + nc == n ? ForwardSeq::last : ForwardSeq::none)};
    float* out = all_logits ? logits_.data() + size_t(i) * size_t(nv) : logits_.data();
    eval_rows(&s, 1, out);
  }
  return logits_.data();
}

const float* Forward::eval_held(const int32_t* tokens, int n, KvCache& cache) {
  if (n < 1 || n > max_batch_) fail("eval_held: {} tokens (1 to {} per step)", n, max_batch_);
  if (!cache.step_keeps_any(n)) fail("eval_held: a step of {} tokens packs a token group of the cache", n);
  logits_.resize(size_t(n) * size_t(m_.cfg_.n_vocab));
  ForwardSeq s{tokens, n, &cache, ForwardSeq::all, true};
  eval_rows(&s, 1, logits_.data());
  return logits_.data();
}

const float* Forward::eval_batch(const ForwardSeq* seqs, int n_seqs) {
  int rows = 0, out_rows = 0;
  for (int i = 0; i < n_seqs; ++i) {
    rows += seqs[i].n;
    out_rows += seqs[i].logits == ForwardSeq::all ? seqs[i].n : seqs[i].logits == ForwardSeq::last ? 1 : 0;
    for (int j = 0; j < i; ++j)
      if (seqs[j].cache == seqs[i].cache) fail("eval_batch: a sequence appears twice in one batch");
  }
  if (rows > max_batch_) fail("eval_batch: {} tokens exceed the batch capacity {}", rows, max_batch_);
  logits_.resize(size_t(std::max(out_rows, 1)) * size_t(m_.cfg_.n_vocab));
  eval_rows(seqs, n_seqs, logits_.data());
  return logits_.data();
}

// The tokens of every sequence go through the weight matmuls together (one matrix-matrix product
// per weight); RoPE, the cache append and attention are per sequence.
void Forward::eval_rows(const ForwardSeq* seqs, int n_seqs, float* logits_out) {
  const ModelConfig& c = m_.cfg_;
  const int E = c.n_embd, hd = c.head_dim, nh = c.n_head, nkv = c.n_head_kv, F = c.n_ff;
  const int qd = nh * hd, kvd = nkv * hd, group = nh / nkv;
  // row r belongs to sequence row_seq[r] at position row_pos[r]
  row_seq_.clear();
  row_pos_.clear();
  for (int si = 0; si < n_seqs; ++si) {
    const ForwardSeq& s = seqs[si];
    const int pos0 = s.cache->n_tokens();
    if (pos0 + s.n > s.cache->capacity())
      fail("context full: {} tokens in the cache + {} new exceed the context of {}", pos0, s.n, s.cache->capacity());
    for (int t = 0; t < s.n; ++t) {
      if (s.tokens[t] < 0 || s.tokens[t] >= c.n_vocab) fail("token id {} out of range [0, {})", s.tokens[t], c.n_vocab);
      row_seq_.push_back(si);
      row_pos_.push_back(pos0 + t);
    }
  }
  const int n = int(row_seq_.size());
  for (int r = 0; r < n; ++r) {
    const ForwardSeq& s = seqs[row_seq_[size_t(r)]];
    float* xr = x_.data() + size_t(r) * size_t(E);
    weight_row(m_.tok_embd_, s.tokens[row_pos_[size_t(r)] - s.cache->n_tokens()], xr);
    if (c.embd_scale || c.embd_mult > 0) {
      const float sc = (c.embd_scale ? std::sqrt(float(E)) : 1.f) * (c.embd_mult > 0 ? c.embd_mult : 1.f);
      for (int i = 0; i < E; ++i) xr[i] *= sc;
    }
  }
  size_t scratch_need = 0, part_need = 0;
  for (int si = 0; si < n_seqs; ++si) {
    scratch_need = std::max(scratch_need, seqs[si].cache->attend_scratch_floats(group));
    part_need = std::max(part_need, seqs[si].cache->attend_part_floats(group));
  }
  // Prefill: up to kPrefillRows rows of a sequence per attention call, their queries gathered
  // (and outputs scattered) through two more regions of the thread's buffer.
  const bool prefill = n > n_seqs;
  const size_t rows_floats = size_t(kPrefillRows) * size_t(group) * size_t(hd);
  size_t prefill_attn = 0;
  if (prefill) {
    for (int si = 0; si < n_seqs; ++si)
      prefill_attn = std::max(prefill_attn, seqs[si].cache->attend_scratch_floats(group * kPrefillRows));
    prefill_attn = (prefill_attn + 15) / 16 * 16;
    scratch_need = std::max(scratch_need, prefill_attn + 2 * rows_floats);
  }
  for (auto& s : attn_scratch_)
    if (s.size() < scratch_need) s.resize(scratch_need);
  std::vector<float> cs(size_t(c.n_rot));
  AttnParams ap;
  ap.scale = c.attn_scale > 0 ? c.attn_scale : 1.0f / std::sqrt(float(hd));
  ap.softcap = c.attn_softcap;
  // One row per sequence (a decode step): each block is read once, from memory.
  ap.prefetch_blocks = n == n_seqs;

  for (int il = 0; il < c.n_layer; ++il) {
    const LayerWeights& L = m_.layers_[size_t(il)];
    ap.sinks = c.attn_sinks ? static_cast<const float*>(L.attn_sinks.data) : nullptr;
    pre_norm(L.attn_norm, n);
    {  // q, k and v in one pass over the pool, the activations converted once (matmul_many: each
       // row as its own matmul computes it)
      const MatmulJob qkv[3] = {{&L.wq, xn_.data(), n, q_.data()}, {&L.wk, xn_.data(), n, k_.data()},
                                {&L.wv, xn_.data(), n, v_.data()}};
      matmul_many(qkv, 3, pool_);
    }
    if (c.qkv_bias) {
      add_bias(q_.data(), static_cast<const float*>(L.bq.data), n, qd);
      add_bias(k_.data(), static_cast<const float*>(L.bk.data), n, kvd);
      add_bias(v_.data(), static_cast<const float*>(L.bv.data), n, kvd);
    }
    if (c.qk_norm) {  // per head, or over all heads of a row (qk_norm_full)
      const bool full = c.qk_norm_full;
      rms_norm(q_.data(), q_.data(), static_cast<const float*>(L.attn_q_norm.data), full ? n : n * nh, full ? qd : hd, c.rms_eps);
      rms_norm(k_.data(), k_.data(), static_cast<const float*>(L.attn_k_norm.data), full ? n : n * nkv, full ? kvd : hd, c.rms_eps);
    }
    std::memcpy(k_pre_.data(), k_.data(), size_t(n) * size_t(kvd) * sizeof(float));
    const int n_rot = m_.layer_rope_[size_t(il)].n_rot;  // 0 on a layer without RoPE
    for (int r = 0; r < n && n_rot > 0; ++r) {
      rope_table(cs.data(), row_pos_[size_t(r)], m_.layer_rope_[size_t(il)]);
      rope(q_.data() + size_t(r) * size_t(qd), nh, hd, n_rot, c.rope_neox, cs.data());
      rope(k_.data() + size_t(r) * size_t(kvd), nkv, hd, n_rot, c.rope_neox, cs.data());
    }
    if (const float a = m_.layer_rope_mscale_[size_t(il)]; a != 1.f && n_rot > 0) {
      // RoPE scaled by a factor a (cos and sin times a: rope.scaling.attn_factor, YaRN's
      // magnitude) on q and k scales the rotated part of q.k by a^2: done on q alone, so that the
      // cache keeps the keys as rotated without it (and the pre-RoPE key codecs need no magnitude
      // of their own).
      const float a2 = a * a;
      const int half = n_rot / 2;
      for (int r = 0; r < n * nh; ++r) {
        float* qh = q_.data() + size_t(r) * size_t(hd);
        for (int i = 0; i < half; ++i) {
          qh[c.rope_neox ? i : 2 * i] *= a2;
          qh[c.rope_neox ? i + half : 2 * i + 1] *= a2;
        }
      }
    }
    if (on_kv) on_kv(il, n, k_pre_.data(), k_.data(), v_.data());
    if (on_q) on_q(il, n, q_.data());
    for (int si = 0, r0 = 0; si < n_seqs; r0 += seqs[si].n, ++si) {
      const size_t o = size_t(r0) * size_t(kvd);
      seqs[si].cache->append(il, seqs[si].n, k_pre_.data() + o, k_.data() + o, v_.data() + o);
    }
    const int window = c.layer_window(il);
    const int items = n * nkv;
    if (!prefill) {
      // Decode: the items' tokens laid end to end and cut into one share per thread
      // (attn_balance_pieces), so that heads and sequences of unequal count or length keep every
      // thread busy (SmolLM2's 3 KV heads on 2 threads, Gemma 3's single one, a long document
      // beside short chats). An item cut in parts is merged after the threads finish.
      item_tokens_.resize(size_t(items));
      for (int w = 0; w < items; ++w) item_tokens_[size_t(w)] = KvCache::visible_tokens(row_pos_[size_t(w / nkv)], window);
      // Batch-invariant mode: no item is cut, so that a sequence's attention does not depend on
      // what it is batched with (a cut item's merge rounds differently from one pass, which is
      // what the prefill path computes); the whole items are still balanced by their tokens.
      const int min_piece = matmul_batch_invariant() ? std::numeric_limits<int>::max() : kMinPieceTokens;
      pieces_ = attn_balance_pieces(item_tokens_.data(), items, pool_.size(), min_piece);
      // parts_[j]: piece j's state when its item is cut, else null.
      auto is_cut = [&](const AttnPiece& pc) { return pc.from > 0 || pc.to < item_tokens_[size_t(pc.item)]; };
      const size_t n_cut = size_t(std::count_if(pieces_.begin(), pieces_.end(), is_cut));
      if (part_states_.size() < n_cut * part_need) part_states_.resize(n_cut * part_need);
      parts_.assign(pieces_.size(), nullptr);
      for (size_t j = 0, c = 0; j < pieces_.size(); ++j)
        if (is_cut(pieces_[j])) parts_[j] = part_states_.data() + part_need * c++;
      // Item w's query rows and output: row w / nkv, KV head w % nkv's group of query heads.
      auto q_off = [&](int w) { return size_t(w / nkv) * size_t(qd) + size_t(w % nkv) * size_t(group) * size_t(hd); };
      pool_.run([&](int ti, int) {
        for (size_t j = 0; j < pieces_.size(); ++j) {
          const AttnPiece& pc = pieces_[j];
          if (pc.thread != ti) continue;
          const int r = pc.item / nkv, h = pc.item % nkv;
          const size_t qo = q_off(pc.item);
          const KvCache& cache = *seqs[row_seq_[size_t(r)]].cache;
          if (parts_[j])
            cache.attend_head_part(il, h, row_pos_[size_t(r)], q_.data() + qo, group, ap, window, pc.from, pc.to,
                                   parts_[j], attn_scratch_[size_t(ti)].data(), spans_[size_t(ti)]);
          else
            cache.attend_head(il, h, row_pos_[size_t(r)], q_.data() + qo, group, ap, window, attn_out_.data() + qo,
                              attn_scratch_[size_t(ti)].data(), spans_[size_t(ti)]);
        }
      });
      for (size_t j = 0; j < pieces_.size();) {
        size_t e = j + 1;
        while (e < pieces_.size() && pieces_[e].item == pieces_[j].item) ++e;
        if (parts_[j])
          attn_merge_parts(parts_.data() + j, int(e - j), group, hd, attn_out_.data() + q_off(pieces_[j].item),
                           ap.sinks ? ap.sinks + size_t(pieces_[j].item % nkv) * size_t(group) : nullptr);
        j = e;
      }
    } else {
      // (sequence, block of up to kPrefillRows of its rows, KV head) items: each packed block is
      // decoded once per item instead of once per row.
      blocks_.clear();
      for (int si = 0, r0 = 0; si < n_seqs; r0 += seqs[si].n, ++si)
        for (int b = 0; b < seqs[si].n; b += kPrefillRows) blocks_.push_back({si, r0 + b, std::min(kPrefillRows, seqs[si].n - b)});
      const int n_items = int(blocks_.size()) * nkv;
      const size_t grp = size_t(group) * size_t(hd);
      pool_.run([&](int ti, int nt) {
        float* sc = attn_scratch_[size_t(ti)].data();
        float* qb = sc + prefill_attn;
        float* ob = qb + rows_floats;
        for (int w = ti; w < n_items; w += nt) {
          const RowBlock& bk = blocks_[size_t(w / nkv)];
          const int h = w % nkv;
          for (int x = 0; x < bk.n; ++x)
            std::memcpy(qb + size_t(x) * grp, q_.data() + size_t(bk.r0 + x) * size_t(qd) + size_t(h) * grp, grp * sizeof(float));
          seqs[bk.seq].cache->attend_rows(il, h, row_pos_[size_t(bk.r0)], bk.n, qb, group, ap, window, ob, sc,
                                          spans_[size_t(ti)]);
          for (int x = 0; x < bk.n; ++x)
            std::memcpy(attn_out_.data() + size_t(bk.r0 + x) * size_t(qd) + size_t(h) * grp, ob + size_t(x) * grp,
                        grp * sizeof(float));
        }
      });
    }
    if (on_attn) on_attn(il, n, attn_out_.data());
    matmul(L.wo, attn_out_.data(), n, tmp_.data(), pool_);
    if (c.attn_out_bias) add_bias(tmp_.data(), static_cast<const float*>(L.bo.data), n, E);
    if (c.post_norms)
      rms_norm(tmp_.data(), tmp_.data(), static_cast<const float*>(L.attn_post_norm.data), n, E, c.rms_eps);
    add_residual(x_.data(), tmp_.data(), size_t(n) * size_t(E), c.residual_scale);

    pre_norm(L.ffn_norm, n);
    if (c.n_expert > 0) {
      ffn_moe(L, n);
    } else {
      const MatmulJob gate_up[2] = {{&L.ffn_gate, xn_.data(), n, gate_.data()}, {&L.ffn_up, xn_.data(), n, up_.data()}};
      matmul_many(gate_up, 2, pool_);  // likewise
      glu(c.geglu ? GluAct::gelu_tanh : GluAct::silu, gate_.data(), up_.data(), gate_.data(), size_t(n) * size_t(F), pool_);
      matmul(L.ffn_down, gate_.data(), n, tmp_.data(), pool_);
    }
    if (c.post_norms)
      rms_norm(tmp_.data(), tmp_.data(), static_cast<const float*>(L.ffn_post_norm.data), n, E, c.rms_eps);
    add_residual(x_.data(), tmp_.data(), size_t(n) * size_t(E), c.residual_scale);
  }
  for (int si = 0; si < n_seqs; ++si)
    if (!seqs[si].hold) seqs[si].cache->commit(seqs[si].n);

  // gather the rows that need logits, in sequence order
  int out_rows = 0;
  for (int si = 0, r0 = 0; si < n_seqs; r0 += seqs[si].n, ++si) {
    const ForwardSeq& s = seqs[si];
    const int first = s.logits == ForwardSeq::all ? 0 : s.logits == ForwardSeq::last ? s.n - 1 : s.n;
    for (int t = first; t < s.n; ++t, ++out_rows)
      if (out_rows != r0 + t)
        std::memcpy(x_.data() + size_t(out_rows) * size_t(E), x_.data() + size_t(r0 + t) * size_t(E), size_t(E) * sizeof(float));
  }
  if (out_rows == 0) return;
  rms_norm(x_.data(), xn_.data(), static_cast<const float*>(m_.output_norm_.data), out_rows, E, c.rms_eps);
  matmul(m_.output_, xn_.data(), out_rows, logits_out, pool_);
  if (c.logit_scale > 0) {
    const float inv = 1.0f / c.logit_scale;
    for (size_t i = 0; i < size_t(out_rows) * size_t(c.n_vocab); ++i) logits_out[i] *= inv;
  }
  if (c.final_softcap > 0) {
    const float cap = c.final_softcap;
    for (size_t i = 0; i < size_t(out_rows) * size_t(c.n_vocab); ++i) logits_out[i] = cap * std::tanh(logits_out[i] / cap);
  }
}
// xn_ = the layer input normalized by `w`, or as it is for models without pre-norms (OLMo 2).
void Forward::pre_norm(const WeightView& w, int n) {
  const ModelConfig& c = m_.cfg_;
  if (c.pre_norms) rms_norm(x_.data(), xn_.data(), static_cast<const float*>(w.data), n, c.n_embd, c.rms_eps);
  else std::memcpy(xn_.data(), x_.data(), size_t(n) * size_t(c.n_embd) * sizeof(float));
}

void moe_route(const float* logits, int n, int k, bool normalize, int* experts, float* weights, bool softmax_chosen) {
  // NaN logits rank last (a strict order for the sort); their probabilities stay NaN
  auto key = [&](int e) { return std::isnan(logits[e]) ? -std::numeric_limits<float>::infinity() : logits[e]; };
  float mx = -std::numeric_limits<float>::infinity();
  for (int e = 0; e < n; ++e) mx = std::max(mx, key(e));
  double sum = 0;
  for (int e = 0; e < n; ++e) sum += std::exp(double(logits[e]) - double(mx));
  thread_local std::vector<int> idx;
  idx.resize(size_t(n));
  for (int e = 0; e < n; ++e) idx[size_t(e)] = e;
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](int a, int b) {
    const float ka = key(a), kb = key(b);
    return ka > kb || (ka == kb && a < b);
  });
  double chosen = 0;  // softmax_chosen: the chosen ones' sum (the largest logit is mx)
  for (int j = 0; j < k; ++j) {
    experts[j] = idx[size_t(j)];
    chosen += std::exp(double(logits[experts[j]]) - double(mx));
  }
  for (int j = 0; j < k; ++j)
    weights[j] = float(std::exp(double(logits[experts[j]]) - double(mx)) / (softmax_chosen ? chosen : sum));
  if (normalize) {
    double s = 0;
    for (int j = 0; j < k; ++j) s += weights[j];
    const double d = std::max(s, 6.103515625e-5);
    for (int j = 0; j < k; ++j) weights[j] = float(weights[j] / d);
  }
}

// The mixture-of-experts FFN of n rows of xn_ into tmp_: each expert runs once on the rows that
// chose it (their inputs gathered, so a step's tokens share its weights as in the dense matmuls),
// all experts' (and the shared expert's) gate and up products in one pass over the pool and their
// down products in another; each row adds its experts' outputs in expert order, so a row's result
// depends only on its own routing, then the shared expert's.
void Forward::ffn_moe(const LayerWeights& L, int n) {
  const ModelConfig& c = m_.cfg_;
  const int E = c.n_embd, ne = c.n_expert, k = c.n_expert_used, Fe = c.n_ff_exp, Fs = c.n_ff_shexp;
  const GluAct act = c.swiglu_oai ? GluAct::swiglu_oai : c.geglu ? GluAct::gelu_tanh : GluAct::silu;
  matmul(L.ffn_gate_inp, xn_.data(), n, router_.data(), pool_);
  if (c.moe_bias) add_bias(router_.data(), static_cast<const float*>(L.ffn_gate_inp_b.data), n, ne);
  for (int r = 0; r < n; ++r)
    moe_route(router_.data() + size_t(r) * size_t(ne), ne, k, c.moe_norm_weights, moe_sel_.data() + size_t(r) * size_t(k),
              moe_w_.data() + size_t(r) * size_t(k), c.moe_softmax_chosen);
  // The (row, choice) pairs grouped by expert, rows in order: expert e's are pairs
  // moe_off_[e] .. moe_off_[e + 1], and its gathered rows sit at the same row offsets.
  moe_off_.assign(size_t(ne) + 1, 0);
  for (int i = 0; i < n * k; ++i) ++moe_off_[size_t(moe_sel_[size_t(i)]) + 1];
  for (int e = 0; e < ne; ++e) moe_off_[size_t(e) + 1] += moe_off_[size_t(e)];
  moe_rows_.resize(2 * size_t(n) * size_t(k));
  moe_fill_.assign(moe_off_.begin(), moe_off_.end() - 1);
  for (int r = 0; r < n; ++r)
    for (int j = 0; j < k; ++j) {
      const size_t at = size_t(moe_fill_[size_t(moe_sel_[size_t(r) * size_t(k) + size_t(j)])]++);
      moe_rows_[2 * at] = r;
      moe_rows_[2 * at + 1] = j;
      std::memcpy(moe_x_.data() + at * size_t(E), xn_.data() + size_t(r) * size_t(E), size_t(E) * sizeof(float));
    }
  // gate_ / up_: the n * k routed rows of Fe, then the shared expert's n rows of Fs; moe_y_: the
  // routed outputs, then the shared one's
  const size_t routed = size_t(n) * size_t(k);
  float* gate_sh = gate_.data() + routed * size_t(Fe);
  float* up_sh = up_.data() + routed * size_t(Fe);
  float* y_sh = moe_y_.data() + routed * size_t(E);
  moe_jobs_.clear();
  for (int e = 0; e < ne; ++e) {
    const size_t o = size_t(moe_off_[size_t(e)]), m = size_t(moe_off_[size_t(e) + 1]) - o;
    if (m == 0) continue;
    moe_jobs_.push_back({&L.ffn_gate_exps[size_t(e)], moe_x_.data() + o * size_t(E), int64_t(m), gate_.data() + o * size_t(Fe)});
    moe_jobs_.push_back({&L.ffn_up_exps[size_t(e)], moe_x_.data() + o * size_t(E), int64_t(m), up_.data() + o * size_t(Fe)});
  }
  if (Fs > 0) {
    moe_jobs_.push_back({&L.ffn_gate_shexp, xn_.data(), n, gate_sh});
    moe_jobs_.push_back({&L.ffn_up_shexp, xn_.data(), n, up_sh});
    if (c.shexp_gated) moe_jobs_.push_back({&L.ffn_gate_inp_shexp, xn_.data(), n, shexp_gate_.data()});
  }
  matmul_many(moe_jobs_.data(), int(moe_jobs_.size()), pool_);
  if (c.moe_bias)  // each routed row's expert's gate and up biases
    for (int e = 0; e < ne; ++e)
      for (int i = moe_off_[size_t(e)]; i < moe_off_[size_t(e) + 1]; ++i) {
        const size_t o = size_t(e) * size_t(Fe);
        add_bias(gate_.data() + size_t(i) * size_t(Fe), static_cast<const float*>(L.ffn_gate_exps_b.data) + o, 1, Fe);
        add_bias(up_.data() + size_t(i) * size_t(Fe), static_cast<const float*>(L.ffn_up_exps_b.data) + o, 1, Fe);
      }
  glu(act, gate_.data(), up_.data(), gate_.data(), routed * size_t(Fe) + size_t(n) * size_t(Fs), pool_);
  moe_jobs_.clear();
  for (int e = 0; e < ne; ++e) {
    const size_t o = size_t(moe_off_[size_t(e)]), m = size_t(moe_off_[size_t(e) + 1]) - o;
    if (m > 0) moe_jobs_.push_back({&L.ffn_down_exps[size_t(e)], gate_.data() + o * size_t(Fe), int64_t(m), moe_y_.data() + o * size_t(E)});
  }
  if (Fs > 0) moe_jobs_.push_back({&L.ffn_down_shexp, gate_sh, n, y_sh});
  matmul_many(moe_jobs_.data(), int(moe_jobs_.size()), pool_);
  if (c.moe_bias)  // the down biases, before the routing weight
    for (int e = 0; e < ne; ++e)
      for (int i = moe_off_[size_t(e)]; i < moe_off_[size_t(e) + 1]; ++i)
        add_bias(moe_y_.data() + size_t(i) * size_t(E), static_cast<const float*>(L.ffn_down_exps_b.data) + size_t(e) * size_t(E), 1, E);
  std::fill(tmp_.data(), tmp_.data() + size_t(n) * size_t(E), 0.0f);
  for (size_t i = 0; i < routed; ++i) {  // pairs in expert order
    const int r = moe_rows_[2 * i];
    const float w = moe_w_[size_t(r) * size_t(k) + size_t(moe_rows_[2 * i + 1])];
    float* o = tmp_.data() + size_t(r) * size_t(E);
    const float* y = moe_y_.data() + i * size_t(E);
    for (int d = 0; d < E; ++d) o[d] += w * y[d];
  }
  for (int r = 0; r < n && Fs > 0; ++r) {
    const float g = c.shexp_gated ? 1.0f / (1.0f + std::exp(-shexp_gate_[size_t(r)])) : 1.0f;
    float* o = tmp_.data() + size_t(r) * size_t(E);
    const float* y = y_sh + size_t(r) * size_t(E);
    for (int d = 0; d < E; ++d) o[d] += g * y[d];
  }
}

}  // namespace kvq
