#include "kv/kvquant_mixed.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include <fmt/format.h>

#include "core/error.h"
#include "kv/calib.h"
#include "kv/grouped_common.h"
#include "kv/kvquant.h"
#include "kv/registry_internal.h"

namespace kvq {

std::vector<KvRopePair> kv_rope_pairs(const KvRope& r, int head_dim) {
  const int half = r.n_rot / 2;
  std::vector<KvRopePair> p;
  p.reserve(size_t(head_dim / 2));
  for (int i = 0; i < half; ++i)
    p.push_back({r.neox ? i : 2 * i, r.neox ? i + half : 2 * i + 1, kv_rope_theta(r, i)});
  for (int c = r.n_rot; c + 1 < head_dim; c += 2) p.push_back({c, c + 1, 0.0});
  return p;
}

std::vector<std::vector<int>> kvquant_mixed_assign(const KvquantMixedConfig& c) {
  const std::vector<KvRopePair> pairs = kv_rope_pairs(c.rope, c.head_dim);
  const int np = int(pairs.size());
  std::vector<std::vector<int>> part_of(size_t(c.n_kv_heads), std::vector<int>(size_t(np), 0));
  for (int h = 0; h < c.n_kv_heads; ++h) {
    std::vector<int> order(static_cast<size_t>(np));
    std::iota(order.begin(), order.end(), 0);
    const std::vector<float>* w = c.pair_weight.empty() ? nullptr : &c.pair_weight[size_t(h)];
    std::stable_sort(order.begin(), order.end(), [&](int x, int y) {
      if (w && (*w)[size_t(x)] != (*w)[size_t(y)]) return (*w)[size_t(x)] > (*w)[size_t(y)];
      if (pairs[size_t(x)].theta != pairs[size_t(y)].theta) return pairs[size_t(x)].theta < pairs[size_t(y)].theta;
      return x > y;
    });
    for (size_t part = 0, i = 0; part < c.pairs.size(); ++part)
      for (int k = 0; k < c.pairs[part]; ++k, ++i) part_of[size_t(h)][size_t(order[i])] = int(part);
  }
  return part_of;
}

namespace {

struct MixedScratch;
float* scratch(size_t n) { return kv_thread_scratch<MixedScratch>(n); }

class KvquantMixedKeyCodec final : public KvCodec {
 public:
  KvquantMixedKeyCodec(const KvquantMixedConfig& c, std::vector<std::unique_ptr<KvCodec>> parts,
                       std::vector<std::vector<uint16_t>> chan)
      : cfg_(c), parts_(std::move(parts)), chan_(std::move(chan)) {
    info_.name = c.name;
    double bits = 0;
    for (size_t s = 0; s < parts_.size(); ++s) bits += double(c.bits[s]) * 2 * c.pairs[s];
    info_.code_bits = bits / c.head_dim;
    info_.group_tokens = c.group_tokens;
    info_.residual_tokens = c.residual_tokens;
    info_.pre_rope = true;
    info_.transforms_query = true;  // prepare_query reorders the channels into the parts
    for (size_t s = 0, o = 0; s < parts_.size(); ++s) {
      dim_off_.push_back(int(o));
      o += size_t(parts_[s]->head_dim());
    }
  }
  const KvCodecInfo& info() const override { return info_; }
  int head_dim() const override { return cfg_.head_dim; }

  size_t block_bytes(int block_tokens) const override {
    size_t b = 0;
    for (const auto& p : parts_) b += p->block_bytes(block_tokens);
    return b;
  }

  void encode(int head, const float* src, size_t src_stride, int n, uint8_t* block, int block_tokens, int t0,
              int pos0) const override {
    const int D = cfg_.head_dim;
    const uint16_t* ch = channels(head);
    float* x = scratch(size_t(std::max(n, 1)) * D);
    for (int i = 0; i < n; ++i)
      for (int c = 0; c < D; ++c) x[size_t(i) * D + c] = src[size_t(i) * src_stride + ch[c]];
    for (size_t s = 0; s < parts_.size(); ++s)
      parts_[s]->encode(head, x + dim_off_[s], size_t(D), n, block + part_off(s, block_tokens), block_tokens, t0,
                        pos0);
  }

  void decode(int head, const uint8_t* block, int block_tokens, int t0, int n, int pos0, float* dst) const override {
    kv_check_token_range(info().name, block_tokens, t0, n);
    const int D = cfg_.head_dim;
    const uint16_t* ch = channels(head);
    for (size_t s = 0; s < parts_.size(); ++s) {
      const int d = parts_[s]->head_dim();
      float* y = scratch(size_t(std::max(n, 1)) * d);
      parts_[s]->decode(head, block + part_off(s, block_tokens), block_tokens, t0, n, pos0, y);
      for (int i = 0; i < n; ++i)
        for (int c = 0; c < d; ++c) dst[size_t(i) * D + ch[dim_off_[s] + c]] = y[size_t(i) * d + c];
    }
  }

  // Once per step: q (n_q, head_dim) -> the parts' queries one after the other, part s's n_q rows
  // of its channels (in its order) from n_q * dim_off_[s].
  void prepare_query(int head, const float* q, int n_q, float* qp) const override {
    const int D = cfg_.head_dim;
    const uint16_t* ch = channels(head);
    for (size_t s = 0; s < parts_.size(); ++s) {
      const int d = parts_[s]->head_dim();
      float* o = qp + size_t(n_q) * size_t(dim_off_[s]);
      for (int i = 0; i < n_q; ++i)
        for (int c = 0; c < d; ++c) o[size_t(i) * d + c] = q[size_t(i) * D + ch[dim_off_[s] + c]];
    }
  }

  // The parts' scores added, each part against its prepared query.
  void scores(int head, const float* qp, int n_q, const uint8_t* block, int block_tokens, int t0, int n, int pos0,
              float* out, int out_stride) const override {
    channels(head);  // checks the head
    kv_check_token_range(info().name, block_tokens, t0, n);
    float* tmp = scratch(size_t(n_q) * size_t(std::max(n, 1)));
    for (size_t s = 0; s < parts_.size(); ++s) {
      const float* q = qp + size_t(n_q) * size_t(dim_off_[s]);
      const uint8_t* pb = block + part_off(s, block_tokens);
      if (s == 0) {
        parts_[s]->scores(head, q, n_q, pb, block_tokens, t0, n, pos0, out, out_stride);
        continue;
      }
      parts_[s]->scores(head, q, n_q, pb, block_tokens, t0, n, pos0, tmp, n);
      for (int i = 0; i < n_q; ++i)
        for (int t = 0; t < n; ++t) out[size_t(i) * out_stride + t] += tmp[size_t(i) * n + t];
    }
  }

  void accumulate(int head, const float* p, int p_stride, int n_q, const uint8_t* block, int block_tokens, int t0,
                  int n, float* acc) const override {
    // A key codec used for values: no positions reach accumulate() (only meaningful without RoPE).
    kv_accumulate_via_decode(*this, head, p, p_stride, n_q, block, block_tokens, t0, n, 0, acc);
  }

 private:
  const uint16_t* channels(int head) const {
    if (head < 0 || head >= cfg_.n_kv_heads)
      fail("{}: head {} is outside the layer's {} KV heads", info_.name, head, cfg_.n_kv_heads);
    return chan_[size_t(head)].data();
  }
  size_t part_off(size_t s, int block_tokens) const {
    size_t o = 0;
    for (size_t i = 0; i < s; ++i) o += parts_[i]->block_bytes(block_tokens);
    return o;
  }

  KvquantMixedConfig cfg_;
  KvCodecInfo info_;
  std::vector<std::unique_ptr<KvCodec>> parts_;
  std::vector<std::vector<uint16_t>> chan_;  // (n_kv_heads, head_dim): model channel of each part-order slot
  std::vector<int> dim_off_;                 // first part-order slot of each part
};

}  // namespace

std::unique_ptr<KvCodec> kvquant_mixed_key_codec_create(const KvquantMixedConfig& c) {
  const char* name = c.name.c_str();
  kv_check_grouped_params(name, c.head_dim, c.group_tokens, c.residual_tokens);
  if (c.n_kv_heads < 1) fail("{}: n_kv_heads must be >= 1 (got {})", name, c.n_kv_heads);
  if (c.bits.empty() || c.bits.size() != c.pairs.size())
    fail("{}: needs one pair count per part ({} widths, {} counts)", name, c.bits.size(), c.pairs.size());
  int total = 0;
  for (size_t s = 0; s < c.bits.size(); ++s) {
    if (c.bits[s] < 2 || c.bits[s] > 4) fail("{}: part widths must be 2, 3 or 4 bits (got {})", name, c.bits[s]);
    if (c.pairs[s] <= 0 || c.pairs[s] % 8 != 0)
      fail("{}: part {} would hold {} RoPE pairs; parts need multiples of 8 pairs (16 channels), which head_dim "
           "{} does not split into for this format",
           name, s, c.pairs[s], c.head_dim);
    if (s > 0 && c.bits[s] >= c.bits[s - 1]) fail("{}: parts must be listed widest first", name);
    total += c.pairs[s];
  }
  if (2 * total != c.head_dim) fail("{}: parts hold {} pairs, head_dim {} has {}", name, total, c.head_dim, c.head_dim / 2);
  kv_check_rope(name, c.rope, c.head_dim);
  if (!c.codebooks.empty() && c.codebooks.size() != c.bits.size())
    fail("{}: {} codebooks for {} parts", name, c.codebooks.size(), c.bits.size());
  const std::vector<KvRopePair> pairs = kv_rope_pairs(c.rope, c.head_dim);
  if (!c.pair_weight.empty()) {
    if (c.pair_weight.size() != size_t(c.n_kv_heads))
      fail("{}: pair weights for {} heads, the layer has {}", name, c.pair_weight.size(), c.n_kv_heads);
    for (const auto& w : c.pair_weight) {
      if (w.size() != pairs.size()) fail("{}: {} pair weights per head, head_dim {} has {} pairs", name, w.size(), c.head_dim, pairs.size());
      for (float x : w)
        if (!std::isfinite(x) || x < 0) fail("{}: pair weight {} is not finite and >= 0", name, x);
    }
  }
  const int k_all = c.outliers_per_token < 0 ? int(std::ceil(0.01 * c.head_dim - 1e-9)) : c.outliers_per_token;
  if (k_all > 2 * c.pairs.back() / 8)
    fail("{}: {} outliers per token exceed the narrowest part's {} channels / 8 (they are kept there)", name, k_all,
         2 * c.pairs.back());

  const std::vector<std::vector<int>> part_of = kvquant_mixed_assign(c);
  std::vector<std::vector<uint16_t>> chan(size_t(c.n_kv_heads));
  std::vector<std::unique_ptr<KvCodec>> parts;
  for (size_t s = 0; s < c.bits.size(); ++s) {
    KvquantKeyConfig pc;
    pc.bits = c.bits[s];
    pc.head_dim = 2 * c.pairs[s];
    pc.group_tokens = c.group_tokens;
    pc.residual_tokens = c.residual_tokens;
    pc.sink_tokens = c.sink_tokens;
    pc.outliers_per_token = s + 1 == c.bits.size() ? k_all : 0;
    pc.rope = c.rope;
    pc.rope.n_rot = pc.head_dim;
    pc.rope.neox = true;
    pc.rope.freq_factors.clear();  // in pair_theta below, with the rates (and for the model's n_rot)
    if (!(pc.rope.freq_base > 1.f)) pc.rope.freq_base = 10000.f;  // unused: the rates below
    if (!(pc.rope.freq_scale > 0.f)) pc.rope.freq_scale = 1.f;
    if (!c.codebooks.empty()) pc.codebook = c.codebooks[s];
    pc.name = fmt::format("{} ({}-bit part)", c.name, c.bits[s]);
    pc.n_kv_heads = c.n_kv_heads;
    // Part order: the part's pairs in pair order, a-elements then b-elements (NeoX).
    for (int h = 0; h < c.n_kv_heads; ++h) {
      std::vector<int> mine;
      for (size_t j = 0; j < pairs.size(); ++j)
        if (part_of[size_t(h)][j] == int(s)) mine.push_back(int(j));
      for (int j : mine) chan[size_t(h)].push_back(uint16_t(pairs[size_t(j)].a));
      for (int j : mine) chan[size_t(h)].push_back(uint16_t(pairs[size_t(j)].b));
      for (int j : mine) pc.pair_theta.push_back(pairs[size_t(j)].theta);
    }
    parts.push_back(kvquant_key_codec_create(pc));
  }
  return std::make_unique<KvquantMixedKeyCodec>(c, std::move(parts), std::move(chan));
}

nlohmann::json kvquant_pair_weights(const float* keys, int n_tokens, int n_kv_heads, int head_dim, const KvRope& rope,
                                    const std::vector<double>& q_ms, int group_tokens, int sink_tokens,
                                    int window_tokens) {
  const int H = n_kv_heads, D = head_dim;
  if (H < 1 || D <= 0 || D % 2 != 0 || D > kvg_max_head_dim)
    fail("kvquant_pair_weights: {} heads of head_dim {} (needs >= 1 head, an even head_dim <= {})", H, D,
         kvg_max_head_dim);
  if (group_tokens < 2) fail("kvquant_pair_weights: group_tokens must be >= 2 (got {})", group_tokens);
  if (rope.n_rot < 0 || rope.n_rot % 2 != 0 || rope.n_rot > D)
    fail("kvquant_pair_weights: rope n_rot {} must be even and in [0, head_dim {}]", rope.n_rot, D);
  if (q_ms.size() != size_t(H) * D)
    fail("kvquant_pair_weights: {} query mean squares, need {} heads x {}", q_ms.size(), H, D);
  const size_t stride = size_t(H) * D;
  for (size_t i = 0; i < size_t(n_tokens) * stride; ++i)
    if (!std::isfinite(keys[i])) fail("kvquant_pair_weights: calibration key {} is not finite", i);
  for (double v : q_ms)
    if (!std::isfinite(v) || v < 0) fail("kvquant_pair_weights: query mean square {} is not finite and >= 0", v);
  const std::vector<KvRopePair> pairs = kv_rope_pairs(rope, D);
  nlohmann::json heads = nlohmann::json::array();
  int groups_used = 0;
  for (int h = 0; h < H; ++h) {
    std::vector<double> r2(size_t(D), 0.0);
    int groups = 0;
    for (int g0 = 0; g0 + group_tokens <= n_tokens; g0 += group_tokens) {
      std::vector<float> mn(size_t(D), INFINITY), mx(size_t(D), -INFINITY);
      int used = 0;
      for (int t = g0; t < g0 + group_tokens; ++t) {
        if ((window_tokens > 0 ? t % window_tokens : t) < sink_tokens) continue;
        ++used;
        const float* x = keys + size_t(t) * stride + size_t(h) * D;
        for (int c = 0; c < D; ++c) {
          mn[size_t(c)] = std::min(mn[size_t(c)], x[c]);
          mx[size_t(c)] = std::max(mx[size_t(c)], x[c]);
        }
      }
      if (used < 2) continue;
      ++groups;
      for (int c = 0; c < D; ++c) {
        const double half_range = 0.5 * (double(mx[size_t(c)]) - mn[size_t(c)]);
        r2[size_t(c)] += half_range * half_range;
      }
    }
    if (groups == 0) fail("kvquant_pair_weights: no group of {} tokens besides the sink tokens", group_tokens);
    groups_used = groups;
    std::vector<float> w;
    for (const KvRopePair& p : pairs) {
      const double q2 = q_ms[size_t(h) * D + size_t(p.a)] + q_ms[size_t(h) * D + size_t(p.b)];
      w.push_back(float(q2 * (r2[size_t(p.a)] + r2[size_t(p.b)]) / groups));
    }
    heads.push_back(w);
  }
  nlohmann::json art;
  art["kvquant_pair_weight"] = heads;
  art["kvquant_pair_weight_groups"] = groups_used;
  return art;
}

void kv_register_kvquant_mixed() {
  // kvquant<X>_k: X = lo + quarters / 4, quarters of the pairs at lo + 1 bits.
  struct Mix {
    const char* tag;
    int lo, quarters;
  };
  static const Mix mixes[] = {{"2.25", 2, 1}, {"2.5", 2, 2}, {"2.75", 2, 3},
                              {"3.25", 3, 1}, {"3.5", 3, 2}, {"3.75", 3, 3}};
  for (const Mix& m : mixes) {
    const std::string kname = fmt::format("kvquant{}_k", m.tag);
    const int lo = m.lo, quarters = m.quarters;
    kv_register_codec(
        {kname,
         fmt::format("KVQuant-style keys at {} bits: per-channel nuq before RoPE, {} of each head's RoPE pairs "
                     "(the largest query x range weight, from kvq calibrate; else the lowest frequencies) at "
                     "{} bits, the rest at {} (G=32, R=0)",
                     m.tag, quarters == 2 ? std::string("half") : fmt::format("{}/4", quarters), lo + 1, lo),
         [kname, lo, quarters](const KvCodecParams& p) {
           KvquantMixedConfig c;
           c.name = kname;
           c.head_dim = p.head_dim;
           c.n_kv_heads = p.n_kv_heads;
           c.rope = p.rope;
           if (p.head_dim % 8 != 0 || (p.head_dim / 2) % 4 != 0)
             fail("{}: head_dim {} does not split into quarters of whole RoPE pairs", kname, p.head_dim);
           const int np = p.head_dim / 2, hi = np / 4 * quarters;
           c.bits = {lo + 1, lo};
           c.pairs = {hi, np - hi};
           kv_resolve_grouped(kname.c_str(), p, kvquant_default_group_tokens, kvquant_default_residual_tokens,
                              &c.group_tokens, &c.residual_tokens);
           if (p.outlier_fraction != -1) {
             if (!(p.outlier_fraction >= 0 && p.outlier_fraction <= 0.125))
               fail("{}: outlier fraction {} is outside [0, 0.125]", kname, p.outlier_fraction);
             c.outliers_per_token = int(std::ceil(p.outlier_fraction * p.head_dim - 1e-9));
           }
           if (p.sink_tokens >= 0) c.sink_tokens = p.sink_tokens;
           c.codebooks = {kvquant_codebook_from_calib(kname, p, lo + 1), kvquant_codebook_from_calib(kname, p, lo)};
           if (const nlohmann::json* e = kvquant_calib_layer(kname, p.calib, p.layer);
               e && e->contains("kvquant_pair_weight"))
             c.pair_weight = kv_calib_head_vectors((*e)["kvquant_pair_weight"],
                                                   fmt::format("{}: calibration layer {} \"kvquant_pair_weight\"",
                                                               kname, p.layer),
                                                   p.n_kv_heads, p.head_dim / 2);
           return kvquant_mixed_key_codec_create(c);
         }});
    const int v_bits = quarters >= 2 ? lo + 1 : lo;
    kv_register_format({fmt::format("kvquant{}", m.tag),
                        {fmt::format("kvquant-{}", m.tag)},
                        kname,
                        fmt::format("kvquant{}_v", v_bits),
                        fmt::format("KVQuant-style keys at {} bits (the most important RoPE pairs of each head at "
                                    "{} bits, the rest at {}), per-token {}-bit values",
                                    m.tag, lo + 1, lo, v_bits)});
  }
}

}  // namespace kvq
