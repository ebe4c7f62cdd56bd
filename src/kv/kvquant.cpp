#include "kv/kvquant.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>
#include <random>

#include "core/cpu.h"
#include "core/error.h"
#include "kv/calib.h"
#include "kv/grouped_common.h"
#include "kv/kivi.h"
#include "kv/kivi_tiled.h"
#include "kv/registry_internal.h"

namespace kvq {

// ---------------------------------------------------------------- scalar kernels

void kvquant_dequant_scalar(const uint8_t* planes, int bits, int head_dim, const float* codebook,
                            const float* scale, const float* mid, float* out) {
  for (int c = 0; c < head_dim; ++c)
    out[c] = scale[c] * codebook[bitplane_code(planes, bits, head_dim, c)] + mid[c];
}

KvquantScoreLayout kvquant_layout(int head_dim, int n_rot, bool neox, bool allow_lanes) {
  const int D = head_dim, half = n_rot / 2;
  KvquantScoreLayout l;
  const bool lanes = allow_lanes && D % 64 == 0 && (n_rot == 0 || (neox ? half % 64 == 0 : n_rot % 64 == 0));
  l.layout = lanes ? kvquant_layout_lanes : kvquant_layout_halves;
  l.neox = neox;
  l.slot.resize(size_t(D));
  for (int c = 0; c < D; ++c) {
    if (lanes) l.slot[size_t(c)] = uint16_t(64 * (c / 64) + 16 * (c % 4) + (c % 64) / 4);
    else l.slot[size_t(c)] = uint16_t(neox || c >= n_rot ? c : (c & 1) * half + c / 2);
  }
  std::vector<int> chan(static_cast<size_t>(D));  // inverse of slot
  for (int c = 0; c < D; ++c) chan[l.slot[size_t(c)]] = c;
  for (int s = 0; s < D; ++s) {
    const int c = chan[size_t(s)];
    const bool is_a = c < n_rot && (neox ? c < half : c % 2 == 0);
    if (!is_a) continue;
    const int partner = neox ? c + half : c + 1;
    l.pair_a.push_back(uint16_t(s));
    l.pair_b.push_back(l.slot[size_t(partner)]);
    l.pair_j.push_back(uint16_t(neox ? c : c / 2));
  }
  return l;
}

void kvquant_scores_scalar(const KvquantScoreArgs& a, float* out, int out_stride) {
  const int D = a.head_dim, half = a.n_rot / 2;
  const KvquantScoreLayout& l = *a.layout;
  float sc[kvg_max_head_dim], mid[kvg_max_head_dim], k[kvg_max_head_dim], kp[kvg_max_head_dim];
  for (int c = 0; c < D; ++c) {
    sc[c] = f16_to_f32(kvg_load_f16(a.params, size_t(c)));
    mid[c] = f16_to_f32(kvg_load_f16(a.params, size_t(D + c)));
  }
  for (int t = 0; t < a.n; ++t) {
    kvquant_dequant_scalar(a.rows + size_t(t) * a.row_bytes, a.bits, D, a.codebook, sc, mid, k);
    for (int j = 0; j < a.k; ++j)
      k[a.oidx[size_t(t) * a.k + j]] = f16_to_f32(kvg_load_f16(a.ovals, size_t(t) * a.k + j));
    for (int c = 0; c < D; ++c) kp[l.slot[size_t(c)]] = k[c];
    const float* cs = a.rot_c + size_t(t) * a.rot_stride;
    const float* sn = a.rot_s + size_t(t) * a.rot_stride;
    for (int p = 0; p < half; ++p) {
      const int ia = l.pair_a[size_t(p)], ib = l.pair_b[size_t(p)];
      const float ka = kp[ia], kb = kp[ib];
      kp[ia] = ka * cs[p] - kb * sn[p];
      kp[ib] = ka * sn[p] + kb * cs[p];
    }
    for (int i = 0; i < a.n_q; ++i) {
      const float* q = a.q + size_t(i) * D;
      float s = 0;
      for (int c = 0; c < D; ++c) s += q[c] * kp[c];
      out[size_t(i) * out_stride + t] = s;
    }
  }
}

void kvquant_prep_scalar(const float* q, int n_q, int head_dim, int n_rot, const KvquantScoreLayout& l,
                         const float* c, const float* s, float* out) {
  const int D = head_dim, half = n_rot / 2;
  for (int i = 0; i < n_q; ++i) {
    const float* qi = q + size_t(i) * D;
    float* o = out + size_t(i) * D;
    for (int p = 0; p < half; ++p) {
      const int j = l.pair_j[size_t(p)];
      const int ca = l.neox ? j : 2 * j, cb = l.neox ? j + half : 2 * j + 1;
      const float x0 = qi[ca], x1 = qi[cb];
      o[l.pair_a[size_t(p)]] = x0 * c[p] + x1 * s[p];
      o[l.pair_b[size_t(p)]] = x1 * c[p] - x0 * s[p];
    }
    for (int ch = n_rot; ch < D; ++ch) o[l.slot[size_t(ch)]] = qi[ch];
  }
}

void kvquant_sincos_scalar(long pos, const double* theta, int half, float* c, float* s) {
  for (int j = 0; j < half; ++j) {
    const double x = double(pos) * theta[j];
    c[j] = float(std::cos(x));
    s[j] = float(std::sin(x));
  }
}

const KvquantKernels& kvquant_kernels() {
  static const KvquantKernels scalar{kvquant_scores_scalar, kvquant_sincos_scalar, kvquant_prep_scalar};
#if defined(KVQ_HAVE_SIMD)
  static const KvquantKernels avx2{kvquant_scores_avx2, kvquant_sincos_avx2, kvquant_prep_avx2};
  static const KvquantKernels avx512{kvquant_scores_avx512, kvquant_sincos_avx512, kvquant_prep_avx512};
  switch (cpu_level()) {
    case CpuLevel::avx512: return avx512;
    case CpuLevel::avx2: return avx2;
    default: break;
  }
#endif
  return scalar;
}

// ---------------------------------------------------------------- RoPE

namespace {

// Pair i of the rotated dims: (2i, 2i+1), or (i, i + n_rot/2) in NeoX order.
inline void rope_rotate(float* x, const float* cs, const float* sn, int n_rot, bool neox) {
  const int half = n_rot / 2;
  for (int i = 0; i < half; ++i) {
    const int a = neox ? i : 2 * i, b = neox ? i + half : 2 * i + 1;
    const float x0 = x[a], x1 = x[b];
    x[a] = x0 * cs[i] - x1 * sn[i];
    x[b] = x0 * sn[i] + x1 * cs[i];
  }
}

}  // namespace

double kv_rope_theta(const KvRope& r, int i) {
  const double t = double(r.freq_scale) * std::pow(double(r.freq_base), -2.0 * i / r.n_rot);
  return r.freq_factors.empty() ? t : t / double(r.freq_factors[size_t(i)]);
}

void kv_rope_apply(const KvRope& r, int pos, float* x, int) {
  if (r.n_rot <= 0) return;
  float cs[kvg_max_head_dim / 2], sn[kvg_max_head_dim / 2];
  for (int i = 0; i < r.n_rot / 2; ++i) {
    const double a = double(pos) * kv_rope_theta(r, i);
    cs[i] = float(std::cos(a));
    sn[i] = float(std::sin(a));
  }
  rope_rotate(x, cs, sn, r.n_rot, r.neox);
}

void kv_check_rope(const char* name, const KvRope& r, int head_dim) {
  if (r.n_rot < 0 || r.n_rot % 2 != 0 || r.n_rot > head_dim)
    fail("{}: rope n_rot {} must be even and in [0, head_dim {}]", name, r.n_rot, head_dim);
  if (r.n_rot > 0 && (!(r.freq_base > 1.f) || !std::isfinite(r.freq_base) ||
                      !(r.freq_scale > 0.f) || !std::isfinite(r.freq_scale)))
    fail("{}: rope freq_base {} must be > 1 and freq_scale {} > 0", name, r.freq_base,
         r.freq_scale);
  if (!r.freq_factors.empty() && r.freq_factors.size() != size_t(r.n_rot / 2))
    fail("{}: rope freq_factors has {} values, n_rot {} needs {} (or none)", name, r.freq_factors.size(), r.n_rot,
         r.n_rot / 2);
  for (float x : r.freq_factors)
    if (!(std::isfinite(x) && x > 0.f)) fail("{}: rope freq_factors holds {}: each must be a finite number > 0", name, x);
}

// ---------------------------------------------------------------- group normalization

namespace {

inline bool is_outlier(const uint8_t* idx, int k, int c) {
  for (int j = 0; j < k; ++j)
    if (idx[j] == c) return true;
  return false;
}

// The channels of the k largest z (D entries) into idx, largest first, ties to the lower channel:
// a vector's dense-and-sparse outliers.
inline void largest_k(const float* z, int D, int k, uint8_t* idx) {
  for (int j = 0; j < k; ++j) {
    float best = -1.f;
    int bc = 0;
    for (int c = 0; c < D; ++c) {
      if (z[c] > best && !is_outlier(idx, j, c)) {
        best = z[c];
        bc = c;
      }
    }
    idx[j] = uint8_t(bc);
  }
}

// Per-channel normalization of one group, shared by encode and kvquant_fit so that the codebook
// is fitted on exactly the distribution the codec quantizes.
//   x: (n, head_dim) rows `stride` floats apart (already sanitized by the caller or finite)
//   sink: (n) 1 = attention-sink token (excluded), oidx: (n, k) outlier channels per token
//   scale16 / mid16: (head_dim) f16
void group_stats(const float* x, size_t stride, int n, int D, const uint8_t* sink, int k,
                 uint8_t* oidx, f16_t* scale16, f16_t* mid16) {
  double sum[kvg_max_head_dim] = {}, sq[kvg_max_head_dim] = {};
  int cnt = 0;
  for (int t = 0; t < n; ++t) {
    if (sink[t]) continue;
    ++cnt;
    for (int c = 0; c < D; ++c) {
      const double v = kv_sanitize(x[size_t(t) * stride + c]);
      sum[c] += v;
      sq[c] += v * v;
    }
  }
  float mean[kvg_max_head_dim], inv_sd[kvg_max_head_dim];
  for (int c = 0; c < D; ++c) {
    const double m = cnt ? sum[c] / cnt : 0.0;
    const double var = cnt ? std::max(0.0, sq[c] / cnt - m * m) : 0.0;
    mean[c] = float(m);
    // A constant channel has no outliers: its normalized distances are all 0.
    inv_sd[c] = var > 0 ? float(1.0 / std::sqrt(var)) : 0.f;
  }
  for (int t = 0; t < n; ++t) {
    uint8_t* idx = oidx + size_t(t) * k;
    if (sink[t]) {
      std::memset(idx, 0, size_t(k));
      continue;
    }
    float z[kvg_max_head_dim];
    for (int c = 0; c < D; ++c) z[c] = std::fabs(kv_sanitize(x[size_t(t) * stride + c]) - mean[c]) * inv_sd[c];
    largest_k(z, D, k, idx);
  }
  for (int c = 0; c < D; ++c) {
    float mn = INFINITY, mx = -INFINITY;
    for (int t = 0; t < n; ++t) {
      if (sink[t] || is_outlier(oidx + size_t(t) * k, k, c)) continue;
      const float v = kv_sanitize(x[size_t(t) * stride + c]);
      mn = std::min(mn, v);
      mx = std::max(mx, v);
    }
    if (mn > mx) mn = mx = mean[c];  // every entry was a sink or an outlier
    scale16[c] = f32_to_f16(0.5f * (mx - mn));
    mid16[c] = f32_to_f16(0.5f * mx + 0.5f * mn);
  }
}

inline int nearest_code(const float* thr, int n_thr, float u) {
  int code = 0;
  while (code < n_thr && u > thr[code]) ++code;
  return code;
}

void check_codebook(const char* name, const std::vector<float>& cb, int bits) {
  if (cb.size() != size_t(1) << bits)
    fail("{}: codebook has {} entries, {} bits need {}", name, cb.size(), bits, 1 << bits);
  for (size_t i = 0; i < cb.size(); ++i) {
    if (!std::isfinite(cb[i]) || cb[i] < -1.f || cb[i] > 1.f)
      fail("{}: codebook entry {} = {} is outside [-1, 1]", name, i, cb[i]);
    if (i > 0 && !(cb[i] > cb[i - 1]))
      fail("{}: codebook entries must be strictly ascending (entry {} = {} after {})", name, i,
           cb[i], cb[i - 1]);
  }
}

int default_outliers(int head_dim) {
  return int(std::ceil(kvquant_default_outlier_fraction * head_dim - 1e-9));
}

// ---------------------------------------------------------------- codec

class KvquantKeyCodec final : public KvCodec {
 public:
  explicit KvquantKeyCodec(const KvquantKeyConfig& c) : cfg_(c), static_(!c.static_mid.empty()) {
    info_.name = c.name;
    info_.code_bits = c.bits;
    info_.group_tokens = static_ ? 1 : c.group_tokens;
    info_.residual_tokens = static_ ? 0 : c.residual_tokens;
    info_.pre_rope = true;
    k_ = c.outliers_per_token;
    std::fill(std::begin(cb_), std::end(cb_), 0.f);
    for (size_t i = 0; i < c.codebook.size(); ++i) cb_[i] = c.codebook[i];
    n_thr_ = int(c.codebook.size()) - 1;
    for (int i = 0; i < n_thr_; ++i) thr_[i] = 0.5f * (cb_[i] + cb_[i + 1]);
    const int half = c.rope.n_rot / 2;
    // One table per head with explicit rates, else one for all heads.
    n_tab_ = c.pair_theta.empty() ? 1 : c.n_kv_heads;
    theta_.resize(size_t(n_tab_) * half);
    rot_c_.resize(size_t(n_tab_) * kRun * half);
    rot_s_.resize(size_t(n_tab_) * kRun * half);
    for (size_t j = 0; j < theta_.size(); ++j)
      theta_[j] = c.pair_theta.empty() ? kv_rope_theta(c.rope, int(j)) : c.pair_theta[j];
    // Every kernel takes either layout; the one the CPU's kernel reads fastest is picked here.
    layout_ = kvquant_layout(c.head_dim, c.rope.n_rot, c.rope.neox, cpu_level() == CpuLevel::avx512);
    theta_tab_.resize(size_t(n_tab_) * half);
    for (int h = 0; h < n_tab_; ++h) {
      const size_t o = size_t(h) * half;
      for (int p = 0; p < half; ++p) theta_tab_[o + size_t(p)] = theta_[o + layout_.pair_j[size_t(p)]];
      for (int t = 0; t < kRun; ++t)
        kvquant_sincos_scalar(t, theta_tab_.data() + o, half, rot_c_.data() + (o * kRun + size_t(t) * half),
                              rot_s_.data() + (o * kRun + size_t(t) * half));
    }
    if (static_) {
      // The f16 image the kernels read (as a group's parameters), and its f32 values for encode.
      const int D = c.head_dim, H = c.n_kv_heads;
      sparams_.resize(size_t(H) * D * 4);
      smid_.resize(size_t(H) * D);
      sinv_.resize(size_t(H) * D);
      for (int h = 0; h < H; ++h) {
        uint8_t* ph = sparams_.data() + size_t(h) * D * 4;
        for (int ch = 0; ch < D; ++ch) {
          const size_t i = size_t(h) * D + ch;
          const f16_t s16 = f32_to_f16(c.static_scale[i]), m16 = f32_to_f16(c.static_mid[i]);
          kvg_store_f16(ph, size_t(ch), s16);
          kvg_store_f16(ph, size_t(D + ch), m16);
          const float s = f16_to_f32(s16);
          sinv_[i] = s > 0 ? 1.f / s : 0.f;
          smid_[i] = f16_to_f32(m16);
        }
      }
    }
  }
  const KvCodecInfo& info() const override { return info_; }
  int head_dim() const override { return cfg_.head_dim; }

  size_t row_bytes() const { return bitplane_row_bytes(cfg_.bits, cfg_.head_dim); }
  size_t sink_bytes() const { return size_t(cfg_.sink_tokens) * cfg_.head_dim * 2; }
  // Tokens per group: calibrated ranges make the whole block one group without parameters.
  int grp_tokens(int block_tokens) const { return static_ ? block_tokens : cfg_.group_tokens; }
  size_t param_bytes() const { return static_ ? 0 : size_t(cfg_.head_dim) * 4; }
  size_t group_bytes(int G) const { return param_bytes() + size_t(G) * (row_bytes() + size_t(k_) * 3); }
  size_t block_bytes(int block_tokens) const override {
    kv_check_block_tokens(info_.name, block_tokens, info_.group_tokens);
    const int G = grp_tokens(block_tokens);
    return sink_bytes() + size_t(block_tokens / G) * group_bytes(G);
  }
  // The f16 [scale (head_dim)][mid (head_dim)] that hold for group grp of head `head`.
  const uint8_t* params(int head, const uint8_t* grp) const {
    if (!static_) return grp;
    check_head(head);
    return sparams_.data() + size_t(head) * cfg_.head_dim * 4;
  }
  void check_head(int head) const {
    if (head < 0 || head >= cfg_.n_kv_heads)
      fail("{}: head {} is outside the {} calibrated heads", info_.name, head, cfg_.n_kv_heads);
  }

  void encode(int head, const float* src, size_t src_stride, int n, uint8_t* block, int block_tokens,
              int t0, int pos0) const override {
    kv_check_block_tokens(info_.name, block_tokens, info_.group_tokens);
    kv_check_encode_range(info_.name, block_tokens, info_.group_tokens, t0, n);
    if (static_) return encode_static(head, src, src_stride, n, block, block_tokens, t0, pos0);
    const int D = cfg_.head_dim, G = cfg_.group_tokens, k = k_;
    uint8_t sink[kvg_max_head_dim];  // G <= block_tokens <= 256 in practice; checked below
    uint8_t codes[kvg_max_head_dim];
    if (G > kvg_max_head_dim) fail("{}: group_tokens {} is too large", info_.name, G);
    for (int g0 = 0; g0 < n; g0 += G) {
      const int tb = t0 + g0;  // first slot of the group
      uint8_t* grp = block + sink_bytes() + size_t(tb / G) * group_bytes(G);
      uint8_t* rows = grp + size_t(D) * 4;
      uint8_t* ovals = rows + size_t(G) * row_bytes();
      uint8_t* oidx = ovals + size_t(G) * k * 2;
      const float* x = src + size_t(g0) * src_stride;
      for (int t = 0; t < G; ++t) {
        const long pos = long(pos0) + tb + t;
        sink[t] = pos >= 0 && pos < cfg_.sink_tokens;
        if (sink[t]) store_sink(block, int(pos), x + size_t(t) * src_stride);
      }
      f16_t sc16[kvg_max_head_dim], mid16[kvg_max_head_dim];
      group_stats(x, src_stride, G, D, sink, k, oidx, sc16, mid16);
      float inv[kvg_max_head_dim], mid[kvg_max_head_dim];
      for (int c = 0; c < D; ++c) {
        kvg_store_f16(grp, c, sc16[c]);
        kvg_store_f16(grp, D + c, mid16[c]);
        const float s = f16_to_f32(sc16[c]);
        inv[c] = s > 0 ? 1.f / s : 0.f;
        mid[c] = f16_to_f32(mid16[c]);
      }
      for (int t = 0; t < G; ++t) {
        const float* xr = x + size_t(t) * src_stride;
        if (sink[t]) {
          std::memset(codes, 0, size_t(D));
        } else {
          for (int c = 0; c < D; ++c)
            codes[c] = uint8_t(nearest_code(thr_, n_thr_, (kv_sanitize(xr[c]) - mid[c]) * inv[c]));
        }
        bitplane_pack(codes, cfg_.bits, D, rows + size_t(t) * row_bytes());
        for (int j = 0; j < k; ++j) {
          const int c = oidx[size_t(t) * k + j];
          kvg_store_f16(ovals, size_t(t) * k + j, sink[t] ? f16_t(0) : f32_to_f16(kv_sanitize(xr[c])));
        }
      }
    }
  }

  // Pre-RoPE key of slot t into out (head_dim); sc/mid hold the f32 scales of t's group.
  void dequant_pre_rope(const uint8_t* block, int block_tokens, int t, int pos,
                        const float* sc, const float* mid, float* out) const {
    const int D = cfg_.head_dim, G = grp_tokens(block_tokens), k = k_;
    if (pos >= 0 && pos < cfg_.sink_tokens) {
      const uint8_t* srow = block + size_t(pos) * D * 2;
      for (int c = 0; c < D; ++c) out[c] = f16_to_f32(kvg_load_f16(srow, c));
      return;
    }
    const uint8_t* grp = block + sink_bytes() + size_t(t / G) * group_bytes(G);
    const uint8_t* rows = grp + param_bytes();
    const uint8_t* ovals = rows + size_t(G) * row_bytes();
    const uint8_t* oidx = ovals + size_t(G) * k * 2;
    const int r = t % G;
    kvquant_dequant_scalar(rows + size_t(r) * row_bytes(), cfg_.bits, D, cb_, sc, mid, out);
    for (int j = 0; j < k; ++j)
      out[oidx[size_t(r) * k + j]] = f16_to_f32(kvg_load_f16(ovals, size_t(r) * k + j));
  }

  void load_group(int head, const uint8_t* block, int block_tokens, int g, float* sc, float* mid) const {
    const int D = cfg_.head_dim, G = grp_tokens(block_tokens);
    const uint8_t* p = params(head, block + sink_bytes() + size_t(g) * group_bytes(G));
    for (int c = 0; c < D; ++c) {
      sc[c] = f16_to_f32(kvg_load_f16(p, c));
      mid[c] = f16_to_f32(kvg_load_f16(p, D + c));
    }
  }

  void decode(int head, const uint8_t* block, int block_tokens, int t0, int n, int pos0,
              float* dst) const override {
    kv_check_block_tokens(info_.name, block_tokens, info_.group_tokens);
    kv_check_token_range(info_.name, block_tokens, t0, n);
    const int D = cfg_.head_dim, G = grp_tokens(block_tokens);
    float sc[kvg_max_head_dim], mid[kvg_max_head_dim];
    for (int i = 0; i < n; ++i) {
      const int t = t0 + i;
      load_group(head, block, block_tokens, t / G, sc, mid);
      float* out = dst + size_t(i) * D;
      dequant_pre_rope(block, block_tokens, t, pos0 + t, sc, mid, out);
      rope_apply(head, pos0 + t, out);
    }
  }

  // Runs of up to kRun tokens share one query rotation R(P)^T (P = the run's first position);
  // inside a run each key turns by R(t) from the codec's table (kvquant.h, KvquantScoreArgs).
  // Sink rows (f16, outside the groups' codes) are scored afterwards from their exact values.
  void scores(int head, const float* qp, int n_q, const uint8_t* block, int block_tokens, int t0, int n,
              int pos0, float* out, int out_stride) const override {
    kv_check_block_tokens(info_.name, block_tokens, info_.group_tokens);
    kv_check_token_range(info_.name, block_tokens, t0, n);
    const KvquantKernels& kk = kvquant_kernels();
    const int D = cfg_.head_dim, G = grp_tokens(block_tokens), half = cfg_.rope.n_rot / 2;
    const size_t gb = group_bytes(G);
    {
      // The groups the span touches (with calibrated ranges: the block, one group).
      const size_t a = sink_bytes() + size_t(t0 / G) * gb;
      const size_t e = sink_bytes() + size_t((t0 + n + G - 1) / G) * gb;
      kvg_prefetch(block + a, e - a);
    }
    constexpr int qchunk = 8;  // bounds the stack copy of the rotated queries
    alignas(64) float qr[qchunk * kvg_max_head_dim];
    float pc[kvg_max_head_dim / 2], ps[kvg_max_head_dim / 2];
    KvquantScoreArgs a{};
    a.bits = cfg_.bits;
    a.head_dim = D;
    a.row_bytes = row_bytes();
    a.codebook = cb_;
    a.k = k_;
    a.rot_stride = half;
    a.n_rot = cfg_.rope.n_rot;
    a.layout = &layout_;
    a.q = qr;
    for (int r0 = t0; r0 < t0 + n; r0 += kRun) {
      const int re = std::min(t0 + n, r0 + kRun);
      if (half > 0) kk.sincos(long(pos0) + r0, theta_tab(head), half, pc, ps);
      for (int i0 = 0; i0 < n_q; i0 += qchunk) {
        const int m = std::min(qchunk, n_q - i0);
        kk.prep(qp + size_t(i0) * D, m, D, cfg_.rope.n_rot, layout_, pc, ps, qr);
        a.n_q = m;
        for (int t = r0; t < re;) {
          const int g = t / G, te = std::min(re, (g + 1) * G);
          const uint8_t* grp = block + sink_bytes() + size_t(g) * gb;
          const uint8_t* rows = grp + param_bytes();
          const uint8_t* ovals = rows + size_t(G) * row_bytes();
          const int r = t - g * G;
          a.rows = rows + size_t(r) * row_bytes();
          a.n = te - t;
          a.params = params(head, grp);
          a.ovals = ovals + size_t(r) * k_ * 2;
          a.oidx = ovals + size_t(G) * k_ * 2 + size_t(r) * k_;
          a.rot_c = rot_tab(rot_c_, head) + size_t(t - r0) * half;
          a.rot_s = rot_tab(rot_s_, head) + size_t(t - r0) * half;
          kk.scores(a, out + size_t(i0) * out_stride + (t - t0), out_stride);
          t = te;
        }
      }
    }
    // Sink positions inside [t0, t0 + n): exact rows, direct RoPE.
    const long s_lo = std::max<long>(long(pos0) + t0, 0);
    const long s_hi = std::min<long>(long(pos0) + t0 + n, cfg_.sink_tokens);
    if (s_lo < s_hi) {
      alignas(64) float key[kvg_max_head_dim];
      float sc[kvg_max_head_dim], mid[kvg_max_head_dim];
      for (long pos = s_lo; pos < s_hi; ++pos) {
        const int t = int(pos - pos0);
        load_group(head, block, block_tokens, t / G, sc, mid);
        dequant_pre_rope(block, block_tokens, t, int(pos), sc, mid, key);
        rope_apply(head, int(pos), key);
        for (int i = 0; i < n_q; ++i) {
          float s = 0;
          for (int c = 0; c < D; ++c) s += qp[size_t(i) * D + c] * key[c];
          out[size_t(i) * out_stride + (t - t0)] = s;
        }
      }
    }
  }

  void accumulate(int head, const float* p, int p_stride, int n_q, const uint8_t* block,
                  int block_tokens, int t0, int n, float* acc) const override {
    // A key codec used for values: no positions reach accumulate(), so slot positions are taken
    // from 0 (only meaningful without RoPE).
    kv_accumulate_via_decode(*this, head, p, p_stride, n_q, block, block_tokens, t0, n, 0, acc);
  }

 private:
  int tab_index(int head) const {
    if (n_tab_ == 1) return 0;
    check_head(head);
    return head;
  }
  const double* theta_tab(int head) const {
    return theta_tab_.data() + size_t(tab_index(head)) * size_t(cfg_.rope.n_rot / 2);
  }
  const float* rot_tab(const std::vector<float>& v, int head) const {
    return v.data() + size_t(tab_index(head)) * kRun * size_t(cfg_.rope.n_rot / 2);
  }
  // RoPE at position pos on x (head_dim), with head `head`'s rates.
  void rope_apply(int head, int pos, float* x) const {
    if (cfg_.pair_theta.empty()) return kv_rope_apply(cfg_.rope, pos, x, cfg_.head_dim);
    const int half = cfg_.rope.n_rot / 2;
    const double* th = theta_.data() + size_t(tab_index(head)) * half;
    float cs[kvg_max_head_dim / 2], sn[kvg_max_head_dim / 2];
    for (int j = 0; j < half; ++j) {
      const double a = double(pos) * th[j];
      cs[j] = float(std::cos(a));
      sn[j] = float(std::sin(a));
    }
    rope_rotate(x, cs, sn, cfg_.rope.n_rot, true);
  }

  void store_sink(uint8_t* block, int pos, const float* x) const {
    uint8_t* srow = block + size_t(pos) * cfg_.head_dim * 2;
    for (int c = 0; c < cfg_.head_dim; ++c) kvg_store_f16(srow, c, f32_to_f16(kv_sanitize(x[c])));
  }

  // Per token against the calibrated ranges: the k channels farthest outside them stay exact.
  void encode_static(int head, const float* src, size_t src_stride, int n, uint8_t* block,
                     int block_tokens, int t0, int pos0) const {
    check_head(head);
    const int D = cfg_.head_dim, k = k_;
    const float* inv = sinv_.data() + size_t(head) * D;
    const float* mid = smid_.data() + size_t(head) * D;
    uint8_t* rows = block + sink_bytes();
    uint8_t* ovals = rows + size_t(block_tokens) * row_bytes();
    uint8_t* oidx = ovals + size_t(block_tokens) * k * 2;
    uint8_t codes[kvg_max_head_dim];
    float u[kvg_max_head_dim];
    for (int i = 0; i < n; ++i) {
      const int t = t0 + i;
      const long pos = long(pos0) + t;
      const float* xr = src + size_t(i) * src_stride;
      uint8_t* idx = oidx + size_t(t) * k;
      if (pos >= 0 && pos < cfg_.sink_tokens) {
        store_sink(block, int(pos), xr);
        std::memset(codes, 0, size_t(D));
        bitplane_pack(codes, cfg_.bits, D, rows + size_t(t) * row_bytes());
        for (int j = 0; j < k; ++j) {
          idx[j] = 0;
          kvg_store_f16(ovals, size_t(t) * k + j, f16_t(0));
        }
        continue;
      }
      for (int c = 0; c < D; ++c) {
        const float v = kv_sanitize(xr[c]);
        const float uc = (v - mid[c]) * inv[c];
        codes[c] = uint8_t(nearest_code(thr_, n_thr_, uc));
        // A channel constant in calibration (scale 0) is out of range by any difference at all.
        u[c] = inv[c] > 0 ? std::fabs(uc) : (v != mid[c] ? INFINITY : 0.f);
      }
      bitplane_pack(codes, cfg_.bits, D, rows + size_t(t) * row_bytes());
      largest_k(u, D, k, idx);
      for (int j = 0; j < k; ++j) kvg_store_f16(ovals, size_t(t) * k + j, f32_to_f16(kv_sanitize(xr[idx[j]])));
    }
  }

  KvquantKeyConfig cfg_;
  bool static_ = false;
  KvCodecInfo info_;
  int k_ = 0;
  float cb_[16];
  float thr_[15];
  int n_thr_ = 0;
  static constexpr int kRun = 64;
  int n_tab_ = 1;                    // angle tables: 1, or one per head (explicit pair rates)
  std::vector<double> theta_;        // (n_tab, n_rot / 2)
  std::vector<double> theta_tab_;    // (n_tab, n_rot / 2): theta of table entry p
  KvquantScoreLayout layout_;
  std::vector<float> rot_c_, rot_s_;  // (n_tab, kRun, n_rot / 2): cos / sin of t * theta of table entry p
  std::vector<uint8_t> sparams_;      // calibrated ranges: (n_kv_heads) x f16 [scale (D)][mid (D)]
  std::vector<float> smid_, sinv_;    // (n_kv_heads, D): their f32 mid and 1 / scale
};

// 1-D Lloyd-Max on sorted samples: prefix sums make each iteration O(levels * log n).
std::vector<float> lloyd_1d(const std::vector<float>& sorted, int levels, double* mse_out) {
  const size_t n = sorted.size();
  std::vector<double> pre(n + 1, 0.0), pre2(n + 1, 0.0);
  for (size_t i = 0; i < n; ++i) {
    pre[i + 1] = pre[i] + sorted[i];
    pre2[i + 1] = pre2[i] + double(sorted[i]) * sorted[i];
  }
  std::vector<double> cb(levels);
  for (int j = 0; j < levels; ++j) cb[j] = sorted[std::min(n - 1, size_t((j + 0.5) / levels * n))];
  std::vector<size_t> lo(levels + 1);
  for (int it = 0; it < 200; ++it) {
    lo[0] = 0;
    lo[levels] = n;
    for (int j = 1; j < levels; ++j) {
      const float thr = float(0.5 * (cb[j - 1] + cb[j]));
      lo[j] = size_t(std::upper_bound(sorted.begin(), sorted.end(), thr) - sorted.begin());
    }
    double moved = 0;
    for (int j = 0; j < levels; ++j) {
      const size_t a = lo[j], b = lo[j + 1];
      if (b > a) {
        const double c = (pre[b] - pre[a]) / double(b - a);
        moved = std::max(moved, std::fabs(c - cb[j]));
        cb[j] = c;
      }
    }
    // Keep levels distinct when a cell emptied (tiny or degenerate calibration sets).
    for (int j = 1; j < levels; ++j) cb[j] = std::max(cb[j], cb[j - 1] + 1e-6);
    if (moved < 1e-7) break;
  }
  double err = 0;
  for (int j = 0; j < levels; ++j) {
    const size_t a = lo[j], b = lo[j + 1];
    const double m = double(b - a);
    err += (pre2[b] - pre2[a]) - 2 * cb[j] * (pre[b] - pre[a]) + m * cb[j] * cb[j];
  }
  *mse_out = n ? err / double(n) : 0.0;
  std::vector<float> out(levels);
  for (int j = 0; j < levels; ++j) out[j] = float(std::clamp(cb[j], -1.0, 1.0));
  return out;
}

// Layer `layer`'s calibration entry: the one whose "layer" equals it, or the layer-th entry when
// entries carry no "layer"; null when the calibration has none.
const nlohmann::json* calib_layer_entry(const char* name, const nlohmann::json* calib, int layer) {
  if (!calib || !calib->is_object() || !calib->contains("layers")) return nullptr;
  const auto& layers = (*calib)["layers"];
  if (!layers.is_array()) fail("{}: calibration \"layers\" must be an array", name);
  for (size_t i = 0; i < layers.size(); ++i) {
    const auto& e = layers[i];
    if (!e.is_object()) fail("{}: calibration layers[{}] must be an object", name, i);
    if (e.contains("layer") ? (e["layer"].is_number_integer() && e["layer"].get<long>() == layer)
                            : long(i) == layer)
      return &e;
  }
  return nullptr;
}

std::vector<float> read_codebook(const char* name, const nlohmann::json& a, int layer, const std::string& key,
                                 int bits) {
  if (!a.is_object() || !a.contains("codebook") || !a["codebook"].is_array())
    fail("{}: calibration layer {} \"{}\" needs a \"codebook\" array", name, layer, key);
  std::vector<float> cb;
  for (const auto& v : a["codebook"]) {
    if (!v.is_number()) fail("{}: calibration layer {} \"{}\".codebook holds a non-number", name, layer, key);
    cb.push_back(v.get<float>());
  }
  check_codebook(name, cb, bits);
  return cb;
}

// `kvq calibrate`'s options that write what a format reads from the calibration, for errors.
std::string rerun_calibrate(int bits) {
  return fmt::format("rerun `kvq calibrate -m MODEL --data TEXT -o FILE --kvquant-bits {}` with this model", bits);
}

// Layer `layer`'s entry of a calibration given to a KVQuant key codec, which must be there and be
// the model's: a calibration with fewer layers, or whose channel statistics (k_rms, k_mean:
// n_kv_heads x head_dim) are another shape, is another model's (or a truncated file's), and its
// codebooks and ranges were fitted to other keys.
const nlohmann::json& calib_model_layer(const char* name, const nlohmann::json& calib, int layer, int n_kv_heads,
                                        int head_dim, int bits) {
  if (!calib.is_object() || !calib.contains("layers"))
    fail("{}: the calibration has no \"layers\" array; {}", name, rerun_calibrate(bits));
  const nlohmann::json* entry = calib_layer_entry(name, &calib, layer);
  if (!entry)
    fail("{}: the calibration has {} layers, layer {} requested (a calibration of another model?); {}", name,
         calib["layers"].size(), layer, rerun_calibrate(bits));
  for (const char* stat : {"k_rms", "k_mean"}) {
    if (!entry->contains(stat)) continue;
    const auto& v = (*entry)[stat];
    const size_t heads = v.is_array() ? v.size() : 0;
    const size_t dim = heads && v[0].is_array() ? v[0].size() : 0;
    const bool fits = heads == size_t(n_kv_heads) &&
                      std::all_of(v.begin(), v.end(),
                                  [&](const nlohmann::json& h) { return h.is_array() && h.size() == size_t(head_dim); });
    if (!fits)
      fail("{}: calibration layer {} \"{}\" is {} heads of {} channels, the model's keys are {} heads of {} (a "
           "calibration of another model?); {}",
           name, layer, stat, heads, dim, n_kv_heads, head_dim, rerun_calibrate(bits));
  }
  return *entry;
}

// The codebook of kvquant<bits>_k for one layer: empty (the default codebook) without a calibration
// or with --kv-scales qk-norm's, which holds none; otherwise the layer's "kvquant_k<bits>", which
// must be there.
std::vector<float> codebook_from_calib(const char* name, const KvCodecParams& p, int bits) {
  if (!p.calib || (p.calib->is_object() && p.calib->value("source", std::string()) == "qk-norm")) return {};
  const nlohmann::json& entry = calib_model_layer(name, *p.calib, p.layer, p.n_kv_heads, p.head_dim, bits);
  const std::string key = "kvquant_k" + std::to_string(bits);
  if (!entry.contains(key))
    fail("{}: calibration layer {} has no \"{}\" (the {}-bit codebook); {}", name, p.layer, key, bits,
         rerun_calibrate(bits));
  return read_codebook(name, entry[key], p.layer, key, bits);
}

// The calibrated ranges and codebook of kvquant<bits>_cal_k for one layer into c (which holds
// head_dim and bits); the outliers per token and sink as calibrated unless the caller overrides.
void static_from_calib(const char* name, const nlohmann::json* calib, int layer, int n_kv_heads,
                       KvquantKeyConfig& c) {
  const std::string key = "kvquant_cal_k" + std::to_string(c.bits);
  if (!calib)
    fail("{}: needs the calibrated key ranges of `kvq calibrate` (--kv-scales FILE)", name);
  const nlohmann::json& entry = calib_model_layer(name, *calib, layer, n_kv_heads, c.head_dim, c.bits);
  if (!entry.contains(key))
    fail("{}: calibration layer {} has no \"{}\"{}", name, layer, key,
         kv_calib_missing_hint(calib).empty() ? "; " + rerun_calibrate(c.bits) : kv_calib_missing_hint(calib));
  const auto& a = entry[key];
  c.codebook = read_codebook(name, a, layer, key, c.bits);
  auto vec = [&](const char* what, std::vector<float>& out) {
    const std::string where = fmt::format("{}: calibration layer {} \"{}\".{}", name, layer, key, what);
    out.clear();
    for (const auto& h : kv_calib_head_vectors(a.contains(what) ? a[what] : nlohmann::json(), where, n_kv_heads,
                                               c.head_dim))
      out.insert(out.end(), h.begin(), h.end());
  };
  vec("mid", c.static_mid);
  vec("scale", c.static_scale);
  // A channel constant in calibration has scale 0 (the codec keeps any other value exact as an
  // outlier); a head with no positive scale at all has no range to quantize in.
  for (int h = 0; h < n_kv_heads; ++h) {
    const float* s = c.static_scale.data() + size_t(h) * size_t(c.head_dim);
    for (int i = 0; i < c.head_dim; ++i)
      if (!std::isfinite(s[i]) || s[i] < 0 || s[i] > 65504.f)
        fail("{}: calibration layer {} \"{}\".scale of head {} channel {} is {}: scales must be positive and "
             "finite (not negative, at most 65504; 0 only for a channel constant in calibration); {}",
             name, layer, key, h, i, s[i], rerun_calibrate(c.bits));
    if (std::none_of(s, s + c.head_dim, [](float v) { return v > 0; }))
      fail("{}: calibration layer {} \"{}\".scale of head {} is 0 in every channel: scales must be positive "
           "and finite (0 only for a channel constant in calibration); {}",
           name, layer, key, h, rerun_calibrate(c.bits));
  }
  c.n_kv_heads = n_kv_heads;
  if (a.contains("outliers_per_token") && a["outliers_per_token"].is_number_integer())
    c.outliers_per_token = a["outliers_per_token"].get<int>();
  if (a.contains("sink_tokens") && a["sink_tokens"].is_number_integer()) c.sink_tokens = a["sink_tokens"].get<int>();
}


}  // namespace

std::unique_ptr<KvCodec> kvquant_key_codec_create(const KvquantKeyConfig& c0) {
  KvquantKeyConfig c = c0;
  const char* name = c.name.c_str();
  if (c.bits < 2 || c.bits > 4) fail("{}: bits must be 2, 3 or 4 (got {})", name, c.bits);
  kv_check_grouped_params(name, c.head_dim, c.group_tokens, c.residual_tokens);
  if (c.head_dim > 256)
    fail("{}: head_dim {} > 256 (outlier channels are stored as one byte)", name, c.head_dim);
  if (c.group_tokens > 256) fail("{}: group_tokens {} > 256", name, c.group_tokens);
  if (c.sink_tokens < 0 || c.sink_tokens > 1024)
    fail("{}: sink_tokens must be in [0, 1024] (got {})", name, c.sink_tokens);
  if (c.outliers_per_token < 0) c.outliers_per_token = default_outliers(c.head_dim);
  if (c.outliers_per_token > c.head_dim / 8)
    fail("{}: outliers_per_token {} exceeds head_dim / 8 = {}", name, c.outliers_per_token,
         c.head_dim / 8);
  kv_check_rope(name, c.rope, c.head_dim);
  if (!c.pair_theta.empty()) {
    if (!c.rope.neox || c.n_kv_heads < 1 ||
        c.pair_theta.size() != size_t(c.n_kv_heads) * size_t(c.rope.n_rot / 2))
      fail("{}: explicit pair rates need NeoX pairs and {} heads x {} pairs (got {} values)", name,
           c.n_kv_heads, c.rope.n_rot / 2, c.pair_theta.size());
    for (double th : c.pair_theta)
      if (!std::isfinite(th) || th < 0) fail("{}: pair rate {} is not finite and >= 0", name, th);
  }
  if (c.codebook.empty()) c.codebook = kvquant_default_codebook(c.bits);
  check_codebook(name, c.codebook, c.bits);
  if (!c.static_mid.empty() || !c.static_scale.empty()) {
    const size_t want = size_t(std::max(c.n_kv_heads, 0)) * size_t(c.head_dim);
    if (c.n_kv_heads < 1 || c.static_mid.size() != want || c.static_scale.size() != want)
      fail("{}: calibrated ranges need {} heads x {} channels of mid and scale (got {} and {})", name,
           c.n_kv_heads, c.head_dim, c.static_mid.size(), c.static_scale.size());
    for (size_t i = 0; i < want; ++i)
      if (!std::isfinite(c.static_mid[i]) || !std::isfinite(c.static_scale[i]) || !(c.static_scale[i] >= 0) ||
          std::fabs(c.static_mid[i]) > 65504.f || c.static_scale[i] > 65504.f)
        fail("{}: calibrated range {} (mid {}, scale {}) is not finite, negative or beyond f16", name, i,
             c.static_mid[i], c.static_scale[i]);
  }
  return std::make_unique<KvquantKeyCodec>(c);
}

nlohmann::json kvquant_fit(const float* keys, int n_tokens, int n_kv_heads, int head_dim, int bits,
                           int group_tokens, int sink_tokens, int outliers_per_token, int window_tokens) {
  if (bits < 2 || bits > 4) fail("kvquant_fit: bits must be 2, 3 or 4 (got {})", bits);
  if (head_dim <= 0 || head_dim % 16 != 0 || head_dim > 256)
    fail("kvquant_fit: head_dim {} must be a multiple of 16 in [16, 256]", head_dim);
  if (n_kv_heads < 1) fail("kvquant_fit: n_kv_heads must be >= 1 (got {})", n_kv_heads);
  if (group_tokens < 2 || group_tokens > 256)
    fail("kvquant_fit: group_tokens must be in [2, 256] (got {})", group_tokens);
  if (sink_tokens < 0) fail("kvquant_fit: sink_tokens must be >= 0 (got {})", sink_tokens);
  if (window_tokens < 0) fail("kvquant_fit: window_tokens must be >= 0 (got {})", window_tokens);
  if (n_tokens < sink_tokens + group_tokens)
    fail("kvquant_fit: {} tokens are fewer than one group of {} after {} sink tokens", n_tokens,
         group_tokens, sink_tokens);
  const int k = outliers_per_token < 0 ? default_outliers(head_dim) : outliers_per_token;
  if (k > head_dim / 8) fail("kvquant_fit: outliers_per_token {} exceeds head_dim / 8", k);
  const size_t total = size_t(n_tokens) * n_kv_heads * head_dim;
  for (size_t i = 0; i < total; ++i)
    if (!std::isfinite(keys[i])) fail("kvquant_fit: calibration key {} is not finite", i);

  const size_t stride = size_t(n_kv_heads) * head_dim;
  std::vector<float> samples;
  samples.reserve(total);
  std::vector<uint8_t> oidx(size_t(group_tokens) * std::max(k, 1));
  uint8_t sink[256];
  f16_t sc16[kvg_max_head_dim], mid16[kvg_max_head_dim];
  for (int h = 0; h < n_kv_heads; ++h) {
    for (int g0 = 0; g0 + group_tokens <= n_tokens; g0 += group_tokens) {
      const float* x = keys + size_t(g0) * stride + size_t(h) * head_dim;
      for (int t = 0; t < group_tokens; ++t)
        sink[t] = (window_tokens > 0 ? (g0 + t) % window_tokens : g0 + t) < sink_tokens;
      group_stats(x, stride, group_tokens, head_dim, sink, k, oidx.data(), sc16, mid16);
      for (int t = 0; t < group_tokens; ++t) {
        if (sink[t]) continue;
        for (int c = 0; c < head_dim; ++c) {
          const float s = f16_to_f32(sc16[c]);
          if (!(s > 0) || is_outlier(oidx.data() + size_t(t) * k, k, c)) continue;
          const float u = (kv_sanitize(x[size_t(t) * stride + c]) - f16_to_f32(mid16[c])) / s;
          samples.push_back(std::clamp(u, -1.f, 1.f));
        }
      }
    }
  }
  if (samples.size() < size_t(1) << bits)
    fail("kvquant_fit: only {} usable samples (constant keys?), need at least {}", samples.size(),
         1 << bits);
  std::sort(samples.begin(), samples.end());
  double mse = 0;
  std::vector<float> cb = lloyd_1d(samples, 1 << bits, &mse);
  nlohmann::json art;
  art["codebook"] = cb;
  art["group_tokens"] = group_tokens;
  art["outliers_per_token"] = k;
  art["sink_tokens"] = sink_tokens;
  art["n_samples"] = samples.size();
  art["mse"] = mse;
  nlohmann::json out;
  out["kvquant_k" + std::to_string(bits)] = art;
  return out;
}

nlohmann::json kvquant_fit_static(const float* keys, int n_tokens, int n_kv_heads, int head_dim, int bits,
                                  int sink_tokens, int outliers_per_token, int window_tokens) {
  if (bits < 2 || bits > 4) fail("kvquant_fit_static: bits must be 2, 3 or 4 (got {})", bits);
  if (head_dim <= 0 || head_dim % 16 != 0 || head_dim > 256)
    fail("kvquant_fit_static: head_dim {} must be a multiple of 16 in [16, 256]", head_dim);
  if (n_kv_heads < 1) fail("kvquant_fit_static: n_kv_heads must be >= 1 (got {})", n_kv_heads);
  if (sink_tokens < 0) fail("kvquant_fit_static: sink_tokens must be >= 0 (got {})", sink_tokens);
  const int k = outliers_per_token < 0 ? default_outliers(head_dim) : outliers_per_token;
  if (k > head_dim / 8) fail("kvquant_fit_static: outliers_per_token {} exceeds head_dim / 8", k);
  if (window_tokens < 0) fail("kvquant_fit_static: window_tokens must be >= 0 (got {})", window_tokens);
  // The tokens the codec quantizes: all but each window's first sink_tokens positions.
  std::vector<int> rows;
  for (int t = 0; t < n_tokens; ++t)
    if ((window_tokens > 0 ? t % window_tokens : t) >= sink_tokens) rows.push_back(t);
  const int n = int(rows.size());
  if (n < 16) fail("kvquant_fit_static: {} tokens besides the sink tokens, need at least 16", n);
  const int D = head_dim, H = n_kv_heads;
  const size_t stride = size_t(H) * D;
  for (size_t i = 0; i < size_t(n_tokens) * stride; ++i)
    if (!std::isfinite(keys[i])) fail("kvquant_fit_static: calibration key {} is not finite", i);
  auto key = [&](int t, int h, int c) { return keys[size_t(rows[size_t(t)]) * stride + size_t(h) * D + c]; };

  // Each token's k outliers by distance from the channel mean in standard deviations: what the
  // ranges must not be stretched by (the codec then keeps exact whatever lies farthest outside).
  std::vector<uint8_t> out_mask(size_t(n) * stride, 0);
  for (int h = 0; h < H; ++h) {
    std::vector<double> mean(size_t(D), 0.0), inv_sd(size_t(D), 0.0);
    for (int c = 0; c < D; ++c) {
      double s = 0, q = 0;
      for (int t = 0; t < n; ++t) {
        s += key(t, h, c);
        q += double(key(t, h, c)) * key(t, h, c);
      }
      mean[size_t(c)] = s / n;
      const double var = std::max(0.0, q / n - mean[size_t(c)] * mean[size_t(c)]);
      inv_sd[size_t(c)] = var > 0 ? 1.0 / std::sqrt(var) : 0.0;
    }
    float z[kvg_max_head_dim];
    uint8_t idx[kvg_max_head_dim];
    for (int t = 0; t < n; ++t) {
      for (int c = 0; c < D; ++c) z[c] = float(std::fabs(key(t, h, c) - mean[size_t(c)]) * inv_sd[size_t(c)]);
      largest_k(z, D, k, idx);
      for (int j = 0; j < k; ++j) out_mask[size_t(t) * stride + size_t(h) * D + idx[j]] = 1;
    }
  }
  // Each channel's sorted inliers.
  std::vector<std::vector<float>> chan(stride);
  for (int h = 0; h < H; ++h)
    for (int c = 0; c < D; ++c) {
      auto& v = chan[size_t(h) * D + c];
      for (int t = 0; t < n; ++t)
        if (!out_mask[size_t(t) * stride + size_t(h) * D + c]) v.push_back(key(t, h, c));
      std::sort(v.begin(), v.end());
    }
  double energy = 0;  // of the inliers about their channel means: the error's natural unit
  for (const auto& v : chan) {
    double s = 0, q = 0;
    for (float x : v) {
      s += x;
      q += double(x) * x;
    }
    if (!v.empty()) energy += q - s * s / double(v.size());
  }

  // Each channel's range is its inliers' [min, max] (what the per-group codec takes over G tokens),
  // stored in f16 as the codec stores it, so the codebook is fitted on the codec's own
  // normalization. Clipping the ranges at a quantile (chosen by squared key error) was measured
  // to give the same or larger KLD in the models (bench/QUALITY.md), so the ranges are not clipped.
  std::vector<float> fmid(stride), fscale(stride);
  for (size_t i = 0; i < stride; ++i) {
    const float lo = chan[i].empty() ? 0.f : chan[i].front(), hi = chan[i].empty() ? 0.f : chan[i].back();
    fscale[i] = f16_to_f32(f32_to_f16(0.5f * (hi - lo)));
    fmid[i] = f16_to_f32(f32_to_f16(0.5f * hi + 0.5f * lo));
  }
  std::vector<float> u;
  for (size_t i = 0; i < stride; ++i) {
    if (!(fscale[i] > 0)) continue;
    for (float x : chan[i]) u.push_back(std::clamp((x - fmid[i]) / fscale[i], -1.f, 1.f));
  }
  if (u.size() < size_t(1) << bits)
    fail("kvquant_fit_static: too few usable samples (constant keys?) for {} levels", 1 << bits);
  std::sort(u.begin(), u.end());
  double mse_norm = 0;
  const std::vector<float> cb = lloyd_1d(u, 1 << bits, &mse_norm);
  // The quantizer's squared error in the keys' units.
  float thr[15];
  const int nt = (1 << bits) - 1;
  for (int j = 0; j < nt; ++j) thr[j] = 0.5f * (cb[size_t(j)] + cb[size_t(j) + 1]);
  double err = 0;
  for (size_t i = 0; i < stride; ++i) {
    const float sc = fscale[i], m = fmid[i], inv = sc > 0 ? 1.f / sc : 0.f;
    for (float x : chan[i]) {
      const float y = m + sc * cb[size_t(nearest_code(thr, nt, (x - m) * inv))];
      err += double(x - y) * (x - y);
    }
  }
  nlohmann::json art, mid = nlohmann::json::array(), scale = nlohmann::json::array();
  for (int h = 0; h < H; ++h) {
    mid.push_back(std::vector<float>(fmid.begin() + ptrdiff_t(h) * D, fmid.begin() + ptrdiff_t(h + 1) * D));
    scale.push_back(std::vector<float>(fscale.begin() + ptrdiff_t(h) * D, fscale.begin() + ptrdiff_t(h + 1) * D));
  }
  art["mid"] = mid;
  art["scale"] = scale;
  art["codebook"] = cb;
  art["outliers_per_token"] = k;
  art["sink_tokens"] = sink_tokens;
  art["rel_mse"] = energy > 0 ? err / energy : 0.0;
  art["n_samples"] = u.size();
  nlohmann::json out;
  out["kvquant_cal_k" + std::to_string(bits)] = art;
  return out;
}

nlohmann::json kvquant_cal_artifact(const std::vector<std::vector<float>>& mid,
                                    const std::vector<std::vector<float>>& scale, int bits) {
  return {{"mid", mid}, {"scale", scale}, {"codebook", kvquant_default_codebook(bits)}};
}

std::vector<float> kvquant_codebook_from_calib(const std::string& name, const KvCodecParams& p, int bits) {
  return codebook_from_calib(name.c_str(), p, bits);
}

const nlohmann::json* kvquant_calib_layer(const std::string& name, const nlohmann::json* calib, int layer) {
  return calib_layer_entry(name.c_str(), calib, layer);
}

const std::vector<float>& kvquant_default_codebook(int bits) {
  static std::vector<float> cbs[5];
  static std::once_flag once[5];
  KVQ_CHECK(bits >= 2 && bits <= 4, "bits {}", bits);
  std::call_once(once[bits], [bits] {
    // Standard-normal keys, fitted through the same normalization as real calibration data.
    constexpr int n_tok = 1024, D = 128;
    std::vector<float> keys(size_t(n_tok) * D);
    std::mt19937_64 rng(0x6b7671 + bits);
    std::normal_distribution<float> nd(0.f, 1.f);
    for (float& v : keys) v = nd(rng);
    const auto art = kvquant_fit(keys.data(), n_tok, 1, D, bits, kvquant_default_group_tokens, 0);
    cbs[bits] = art.begin().value()["codebook"].get<std::vector<float>>();
  });
  return cbs[bits];
}

void kv_register_kvquant() {
  // --kv-outliers: the share of each key kept exact, as k per token.
  auto outliers = [](const std::string& name, const KvCodecParams& p, KvquantKeyConfig& c) {
    if (p.outlier_fraction != -1) {
      if (!(p.outlier_fraction >= 0 && p.outlier_fraction <= 0.125))
        fail("{}: outlier fraction {} is outside [0, 0.125]", name, p.outlier_fraction);
      c.outliers_per_token = int(std::ceil(p.outlier_fraction * p.head_dim - 1e-9));
    }
    if (p.sink_tokens >= 0) c.sink_tokens = p.sink_tokens;
  };
  auto base = [](int bits, const std::string& name, const KvCodecParams& p) {
    KvquantKeyConfig c;
    c.bits = bits;
    c.head_dim = p.head_dim;
    c.name = name;
    c.rope = p.rope;
    return c;
  };
  for (int bits : {2, 3, 4}) {
    const std::string kname = "kvquant" + std::to_string(bits) + "_k";
    const std::string vname = "kvquant" + std::to_string(bits) + "_v";
    const std::string cname = "kvquant" + std::to_string(bits) + "_cal_k";
    kv_register_codec(
        {kname,
         fmt::format("KVQuant-style keys: {}-bit nuq per channel before RoPE, 1% dense-and-sparse "
                     "outliers, exact sink token (G=32, R=0)",
                     bits),
         [bits, kname, base, outliers](const KvCodecParams& p) {
           KvquantKeyConfig c = base(bits, kname, p);
           kv_resolve_grouped(kname.c_str(), p, kvquant_default_group_tokens,
                              kvquant_default_residual_tokens, &c.group_tokens, &c.residual_tokens);
           c.codebook = codebook_from_calib(kname.c_str(), p, bits);
           outliers(kname, p, c);
           return kvquant_key_codec_create(c);
         }});
    kv_register_codec(
        {cname,
         fmt::format("KVQuant-style keys with calibrated ranges: {}-bit nuq per channel before RoPE, "
                     "per-channel mid and scale from kvq calibrate (none stored per group), 1% "
                     "dense-and-sparse outliers, exact sink token; per token (needs kvq calibrate)",
                     bits),
         [bits, cname, base, outliers](const KvCodecParams& p) {
           KvquantKeyConfig c = base(bits, cname, p);
           static_from_calib(cname.c_str(), p.calib, p.layer, p.n_kv_heads, c);
           outliers(cname, p, c);
           return kvquant_key_codec_create(c);
         }});
    kv_register_codec(
        {vname,
         fmt::format("values for the KVQuant formats: {}-bit per token, groups of 32 channels "
                     "(KIVI value layout; G=32, R=0)",
                     bits),
         [bits, vname](const KvCodecParams& p) {
           KiviConfig c;
           c.role = KvRole::value;
           c.bits = bits;
           c.head_dim = p.head_dim;
           c.name = vname;
           kv_resolve_grouped(vname.c_str(), p, kvquant_default_group_tokens,
                              kvquant_default_residual_tokens, &c.group_tokens, &c.residual_tokens);
           // KIVI's 2- and 4-bit values in their tiles when the shape allows (same bytes and
           // decode; integer-dot weighted sums), as kivi2 / kivi4 store them; 3-bit in bit planes.
           if ((bits == 2 || bits == 4) && kivi_tiled_fits(c.head_dim, c.group_tokens))
             return kivi_tiled_codec_create(KvRole::value, bits, c.head_dim, c.group_tokens, c.residual_tokens);
           return kivi_codec_create(c);
         }});
    kv_register_format({"kvquant" + std::to_string(bits),
                        {"kvquant-" + std::to_string(bits)},
                        kname,
                        vname,
                        fmt::format("KVQuant-style {}-bit: pre-RoPE per-channel nuq keys with "
                                    "outliers and sink, per-token values (Hooper et al. 2024)",
                                    bits)});
    kv_register_format({"kvquant" + std::to_string(bits) + "_cal",
                        {},
                        cname,
                        vname,
                        fmt::format("KVQuant-style {}-bit with the key ranges calibrated offline (per "
                                    "token, no group scales); per-token values (needs kvq calibrate)",
                                    bits)});
  }
}

}  // namespace kvq
