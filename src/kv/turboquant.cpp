// TurboQuant codec: encode/decode of token records and the KvCodec entry points around the
// kernels in turboquant_kernels.cpp / _avx2.cpp / _avx512.cpp.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numbers>

#include "core/dtypes.h"
#include "core/error.h"
#include "kv/grouped_common.h"
#include "kv/turboquant.h"

namespace kvq {

namespace {

// Seed purposes: the rotation and the QJL matrix are independent streams of the same
// (seed, layer, role), so a prod codec and an MSE codec with equal parameters share R.
constexpr uint64_t kSeedRotation = 1;
constexpr uint64_t kSeedQjl = 2;
constexpr int kMaxDim = 1024;

inline uint16_t load_u16(const uint8_t* p) { return uint16_t(p[0] | (p[1] << 8)); }

// The Hadamard transform exists for powers of two only; other head sizes (80, 96, 112) get the
// dense Haar rotation, which has the same distribution of rotated coordinates (hence the same
// codebooks and distortion) at O(d^2) instead of O(d log d) per token and query.
TqRotationKind rotation_for(TqRotationKind asked, int dim) {
  if (asked == TqRotationKind::hadamard && (dim <= 0 || (dim & (dim - 1)) != 0)) return TqRotationKind::dense;
  return asked;
}

class TqCodec final : public KvCodec {
 public:
  TqCodec(const std::string& name, const TqConfig& cfg, const KvCodecParams& p)
      : dim_(p.head_dim),
        rot_(rotation_for(cfg.rotation, p.head_dim), p.head_dim,
             tq_derive_seed(p.seed, p.layer, p.role, kSeedRotation)) {
    const int d = p.head_dim;
    if (d % 16 != 0 || d > kMaxDim)
      fail("TurboQuant codec {}: head_dim must be a multiple of 16 up to {}, got {}", name, kMaxDim, d);
    int bits_hi = 0, bits_lo = 0, n_hi = d;
    tq_split_bits(name, cfg, d, &n_hi, &bits_hi, &bits_lo);
    layout_ = tq_layout_make(d, n_hi, bits_hi, bits_lo, cfg.qjl);
    cb_hi_ = &tq_lloyd_max(bits_hi, d);
    cb_lo_ = layout_.n_hi < d ? &tq_lloyd_max(bits_lo, d) : cb_hi_;
    std::fill(std::begin(cb_hi16_), std::end(cb_hi16_), 0.f);
    std::fill(std::begin(cb_lo16_), std::end(cb_lo16_), 0.f);
    std::copy(cb_hi_->centroids.begin(), cb_hi_->centroids.end(), cb_hi16_);
    std::copy(cb_lo_->centroids.begin(), cb_lo_->centroids.end(), cb_lo16_);
    args_.layout = &layout_;
    args_.cb_hi = cb_hi16_;
    args_.cb_lo = cb_lo16_;
    if (cfg.qjl) {
      qjl_.resize(size_t(d) * size_t(d));
      tq_gaussian(tq_derive_seed(p.seed, p.layer, p.role, kSeedQjl), qjl_.data(), qjl_.size());
      args_.qjl_scale = float(std::sqrt(std::numbers::pi / 2) / d);
    }
    std::fill(std::begin(bounds_hi16_), std::end(bounds_hi16_), std::numeric_limits<float>::infinity());
    std::fill(std::begin(bounds_lo16_), std::end(bounds_lo16_), std::numeric_limits<float>::infinity());
    std::copy(cb_hi_->bounds.begin(), cb_hi_->bounds.end(), bounds_hi16_);
    std::copy(cb_lo_->bounds.begin(), cb_lo_->bounds.end(), bounds_lo16_);
    enc_.layout = &layout_;
    enc_.rotation = rot_.kind();
    enc_.signs = rot_.signs();
    enc_.matrix = rot_.matrix();
    enc_.bounds_hi = bounds_hi16_;
    enc_.bounds_lo = bounds_lo16_;
    enc_.cb_hi = cb_hi16_;
    enc_.cb_lo = cb_lo16_;
    enc_.qjl = cfg.qjl ? qjl_.data() : nullptr;
    info_.name = name;
    info_.code_bits = double(layout_.n_hi * bits_hi + (d - layout_.n_hi) * layout_.bits_lo + (cfg.qjl ? d : 0)) / d;
    info_.group_tokens = 1;
    info_.residual_tokens = 0;
    info_.pre_rope = false;
    info_.transforms_query = true;
    info_.transforms_output = true;
  }

  const KvCodecInfo& info() const override { return info_; }
  int head_dim() const override { return dim_; }
  size_t block_bytes(int block_tokens) const override {
    kv_check_block(info_.name, block_tokens);
    return size_t(block_tokens) * size_t(layout_.record_bytes);
  }
  int prepared_query_dim() const override { return layout_.qjl ? 2 * dim_ : dim_; }

  void encode(int head, const float* src, size_t src_stride, int n, uint8_t* block, int block_tokens,
              int t0, int pos0) const override {
    (void)head;
    (void)pos0;
    kv_check_token_range(info().name, block_tokens, t0, n);
    const TqEncodeFn enc = tq_kernels_for(cpu_level()).encode;
    for (int t = 0; t < n; ++t)
      enc(enc_, src + size_t(t) * src_stride, block + size_t(t0 + t) * size_t(layout_.record_bytes));
  }

  void decode(int head, const uint8_t* block, int block_tokens, int t0, int n, int pos0,
              float* dst) const override {
    (void)head;
    (void)pos0;
    kv_check_token_range(info().name, block_tokens, t0, n);
    for (int t = 0; t < n; ++t)
      decode_one(block + size_t(t0 + t) * size_t(layout_.record_bytes), dst + size_t(t) * size_t(dim_));
  }

  void prepare_query(int head, const float* q, int n_q, float* qp) const override {
    (void)head;
    const int d = dim_, pd = prepared_query_dim();
    for (int i = 0; i < n_q; ++i) {
      float* o = qp + size_t(i) * size_t(pd);
      rot_.forward(q + size_t(i) * size_t(d), o);
      if (layout_.qjl) {
        for (int j = 0; j < d; ++j) {
          const float* row = &qjl_[size_t(j) * size_t(d)];
          float s = 0;
          for (int c = 0; c < d; ++c) s += row[c] * o[c];
          o[d + j] = s;
        }
      }
    }
  }

  void scores(int head, const float* qp, int n_q, const uint8_t* block, int block_tokens, int t0, int n,
              int pos0, float* out, int out_stride) const override {
    (void)head;
    (void)pos0;
    kv_check_token_range(info().name, block_tokens, t0, n);
    tq_kernels_for(cpu_level())
        .scores(args_, qp, prepared_query_dim(), n_q, block + size_t(t0) * size_t(layout_.record_bytes), n,
                out, out_stride);
  }

  void accumulate(int head, const float* p, int p_stride, int n_q, const uint8_t* block, int block_tokens,
                  int t0, int n, float* acc) const override {
    (void)head;
    kv_check_token_range(info().name, block_tokens, t0, n);
    const uint8_t* recs = block + size_t(t0) * size_t(layout_.record_bytes);
    tq_kernels_for(cpu_level()).accumulate(args_, p, p_stride, n_q, recs, n, acc);
    if (!layout_.qjl) return;
    // The prod variant as a value codec (the formats use MSE values): the QJL part of each value
    // is S^T sign, d^2 per token, added here rather than in the kernels.
    const int d = dim_;
    float r[kMaxDim];
    for (int t = 0; t < n; ++t) {
      const uint8_t* rec = recs + size_t(t) * size_t(layout_.record_bytes);
      qjl_residual(rec, r);
      const float norm = f16_to_f32(load_u16(rec));
      for (int i = 0; i < n_q; ++i) {
        const float w = p[size_t(i) * size_t(p_stride) + size_t(t)] * norm;
        float* o = acc + size_t(i) * size_t(d);
        for (int c = 0; c < d; ++c) o[c] += w * r[c];
      }
    }
  }

  void finish_output(int head, float* acc, int n_q) const override {
    (void)head;
    for (int i = 0; i < n_q; ++i) rot_.inverse(acc + size_t(i) * size_t(dim_), acc + size_t(i) * size_t(dim_));
  }

 private:
  // ||r|| * sqrt(pi/2)/d * S^T sign: the QJL estimate of the residual, rotated basis.
  void qjl_residual(const uint8_t* rec, float* r) const {
    const int d = dim_;
    const float g = f16_to_f32(load_u16(rec + layout_.off_qjl)) * args_.qjl_scale;
    const uint8_t* sg = rec + layout_.off_qjl + 2;
    for (int c = 0; c < d; ++c) r[c] = 0;
    for (int j = 0; j < d; ++j) {
      const float s = ((sg[j / 8] >> (j % 8)) & 1) ? g : -g;
      const float* row = &qjl_[size_t(j) * size_t(d)];
      for (int c = 0; c < d; ++c) r[c] += s * row[c];
    }
  }

  void decode_one(const uint8_t* rec, float* out) const {
    const int d = dim_;
    uint8_t codes[kMaxDim];
    tq_unpack_codes(rec + layout_.off_hi, layout_.n_hi, layout_.bits_hi, codes);
    if (layout_.n_hi < d) tq_unpack_codes(rec + layout_.off_lo, d - layout_.n_hi, layout_.bits_lo, codes + layout_.n_hi);
    float y[kMaxDim];
    for (int c = 0; c < d; ++c) y[c] = c < layout_.n_hi ? cb_hi16_[codes[c]] : cb_lo16_[codes[c]];
    if (layout_.qjl) {
      float r[kMaxDim];
      qjl_residual(rec, r);
      for (int c = 0; c < d; ++c) y[c] += r[c];
    }
    rot_.inverse(y, out);
    const float norm = f16_to_f32(load_u16(rec));
    for (int c = 0; c < d; ++c) out[c] *= norm;
  }

  int dim_;
  TqRotation rot_;
  TqLayout layout_;
  const TqCodebook* cb_hi_ = nullptr;
  const TqCodebook* cb_lo_ = nullptr;
  float cb_hi16_[16];
  float cb_lo16_[16];
  float bounds_hi16_[16];  // thresholds padded with +inf: the code is the count below y
  float bounds_lo16_[16];
  std::vector<float> qjl_;  // (dim, dim) S, row-major
  TqKernelArgs args_;
  TqEncodeArgs enc_;
  KvCodecInfo info_;
};

}  // namespace

void tq_split_bits(const std::string& name, const TqConfig& cfg, int d, int* n_hi, int* bits_hi, int* bits_lo) {
  *n_hi = d;
  *bits_lo = 0;
  if (cfg.qjl) {
    if (cfg.bits != std::floor(cfg.bits) || cfg.bits < 2 || cfg.bits > 5)
      fail("TurboQuant codec {}: the QJL (prod) variant needs integer bits 2..5, got {}", name, cfg.bits);
    *bits_hi = int(cfg.bits) - 1;  // one bit of the budget goes to the QJL signs
    return;
  }
  if (!(cfg.bits >= 1 && cfg.bits <= 4)) fail("TurboQuant codec {}: bits must be in [1, 4], got {}", name, cfg.bits);
  *bits_lo = int(std::floor(cfg.bits));
  const double frac = cfg.bits - *bits_lo;
  if (frac == 0) {
    *bits_hi = *bits_lo;
    return;
  }
  *bits_hi = *bits_lo + 1;
  *n_hi = int(std::lround(frac * d / 16.0)) * 16;
  if (*n_hi <= 0 || *n_hi >= d)
    fail("TurboQuant codec {}: {} bits cannot be split over head_dim {} in 16-channel steps", name, cfg.bits, d);
}

std::unique_ptr<KvCodec> tq_codec_create(const std::string& name, const TqConfig& cfg, const KvCodecParams& p) {
  return std::make_unique<TqCodec>(name, cfg, p);
}

}  // namespace kvq
