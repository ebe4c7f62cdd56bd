#include "kv/kivi.h"
#include "kv/kivi_tiled.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/cpu.h"
#include "core/error.h"
#include "kv/grouped_common.h"
#include "kv/registry_internal.h"

namespace kvq {

void bitplane_pack(const uint8_t* codes, int bits, int head_dim, uint8_t* row) {
  const int pb = head_dim / 8;
  std::memset(row, 0, size_t(bits) * pb);
  for (int c = 0; c < head_dim; ++c)
    for (int j = 0; j < bits; ++j)
      row[j * pb + c / 8] |= uint8_t(((codes[c] >> j) & 1) << (c % 8));
}

// ---------------------------------------------------------------- scalar kernels

void kivi_k_scores_scalar(const uint8_t* codes, size_t row_bytes, int n, int bits, int head_dim,
                          const float* qs, const float* qz, int n_q, float* out, int out_stride) {
  uint8_t code[kvg_max_head_dim];
  for (int t = 0; t < n; ++t) {
    const uint8_t* row = codes + size_t(t) * row_bytes;
    for (int c = 0; c < head_dim; ++c) code[c] = uint8_t(bitplane_code(row, bits, head_dim, c));
    for (int i = 0; i < n_q; ++i) {
      const float* w = qs + size_t(i) * head_dim;
      float s = 0;
      for (int c = 0; c < head_dim; ++c) s += w[c] * float(code[c]);
      out[size_t(i) * out_stride + t] = s + qz[i];
    }
  }
}

void kivi_v_accum_scalar(const uint8_t* rows, size_t row_bytes, int n, int bits, int head_dim,
                         int group, const float* p, int p_stride, int n_q, float* acc) {
  const int ng = head_dim / group;
  for (int t = 0; t < n; ++t) {
    const uint8_t* row = rows + size_t(t) * row_bytes;
    const uint8_t* planes = row + size_t(ng) * 4;
    float sc[kvg_max_head_dim / 16], ze[kvg_max_head_dim / 16];
    for (int g = 0; g < ng; ++g) {
      sc[g] = f16_to_f32(kvg_load_f16(row, g));
      ze[g] = f16_to_f32(kvg_load_f16(row, ng + g));
    }
    for (int i = 0; i < n_q; ++i) {
      const float w = p[size_t(i) * p_stride + t];
      float* a = acc + size_t(i) * head_dim;
      for (int c = 0; c < head_dim; ++c) {
        const int g = c / group;
        a[c] += w * (sc[g] * float(bitplane_code(planes, bits, head_dim, c)) + ze[g]);
      }
    }
  }
}

void kivi_fold_query_scalar(const uint8_t* params, const float* q, int n_q, int head_dim, float* qs, float* qz) {
  float sc[kvg_max_head_dim], ze[kvg_max_head_dim];
  for (int c = 0; c < head_dim; ++c) {
    sc[c] = f16_to_f32(kvg_load_f16(params, size_t(c)));
    ze[c] = f16_to_f32(kvg_load_f16(params, size_t(head_dim + c)));
  }
  for (int i = 0; i < n_q; ++i) {
    const float* qi = q + size_t(i) * head_dim;
    float z = 0;
    for (int c = 0; c < head_dim; ++c) {
      qs[size_t(i) * head_dim + c] = qi[c] * sc[c];
      z += qi[c] * ze[c];
    }
    qz[i] = z;
  }
}

void kivi_fold_query(const uint8_t* params, const float* q, int n_q, int head_dim, float* qs, float* qz) {
#if defined(KVQ_HAVE_SIMD)
  if (cpu_level() == CpuLevel::avx512) return kivi_fold_query_avx512(params, q, n_q, head_dim, qs, qz);
#endif
  kivi_fold_query_scalar(params, q, n_q, head_dim, qs, qz);
}

const KiviKernels& kivi_kernels() {
  static const KiviKernels scalar{kivi_k_scores_scalar, kivi_v_accum_scalar};
#if defined(KVQ_HAVE_SIMD)
  static const KiviKernels avx2{kivi_k_scores_avx2, kivi_v_accum_avx2};
  static const KiviKernels avx512{kivi_k_scores_avx512, kivi_v_accum_avx512};
  switch (cpu_level()) {
    case CpuLevel::avx512: return avx512;
    case CpuLevel::avx2: return avx2;
    default: break;
  }
#endif
  return scalar;
}

// ---------------------------------------------------------------- codecs

namespace {

// Asymmetric min/max over `n` values, scale and zero rounded to f16 first so that the codes are
// chosen against exactly the numbers decode will use.
struct MinMaxQ {
  f16_t scale16, zero16;
  float scale, zero, inv;
  MinMaxQ(float mn, float mx, int bits) {
    const float levels = float((1 << bits) - 1);
    scale16 = f32_to_f16((mx - mn) / levels);
    zero16 = f32_to_f16(mn);
    scale = f16_to_f32(scale16);
    zero = f16_to_f32(zero16);
    inv = scale > 0 ? 1.f / scale : 0.f;
  }
  uint8_t code(float x, int bits) const {
    const float q = std::nearbyint((x - zero) * inv);
    return uint8_t(std::clamp(q, 0.f, float((1 << bits) - 1)));
  }
};

class KiviCodecBase : public KvCodec {
 public:
  explicit KiviCodecBase(const KiviConfig& c) : cfg_(c) {
    info_.name = c.name;
    info_.code_bits = c.bits;
    info_.group_tokens = c.group_tokens;
    info_.residual_tokens = c.residual_tokens;
  }
  const KvCodecInfo& info() const override { return info_; }
  int head_dim() const override { return cfg_.head_dim; }

 protected:
  void check_block(int block_tokens) const {
    kv_check_block_tokens(info_.name, block_tokens, cfg_.group_tokens);
  }
  void check_encode(int block_tokens, int t0, int n) const {
    check_block(block_tokens);
    kv_check_encode_range(info_.name, block_tokens, cfg_.group_tokens, t0, n);
  }
  KiviConfig cfg_;
  KvCodecInfo info_;
};

// Head block: block_tokens / G groups, each [f16 scale (D)][f16 zero (D)][G code rows]; scales
// and zeros sit in front of the codes they describe so that a group is one contiguous read.
class KiviKeyCodec final : public KiviCodecBase {
 public:
  using KiviCodecBase::KiviCodecBase;
  size_t row_bytes() const { return bitplane_row_bytes(cfg_.bits, cfg_.head_dim); }
  size_t group_bytes() const {
    return size_t(cfg_.head_dim) * 4 + size_t(cfg_.group_tokens) * row_bytes();
  }
  size_t block_bytes(int block_tokens) const override {
    check_block(block_tokens);
    return size_t(block_tokens / cfg_.group_tokens) * group_bytes();
  }

  void encode(int, const float* src, size_t src_stride, int n, uint8_t* block, int block_tokens,
              int t0, int) const override {
    check_encode(block_tokens, t0, n);
    const int D = cfg_.head_dim, G = cfg_.group_tokens;
    uint8_t codes[kvg_max_head_dim];
    for (int g0 = 0; g0 < n; g0 += G) {
      uint8_t* grp = block + size_t((t0 + g0) / G) * group_bytes();
      const float* x = src + size_t(g0) * src_stride;
      float zero[kvg_max_head_dim], inv[kvg_max_head_dim];
      for (int c = 0; c < D; ++c) {
        float mn = kv_sanitize(x[c]), mx = mn;
        for (int t = 1; t < G; ++t) {
          const float v = kv_sanitize(x[size_t(t) * src_stride + c]);
          mn = std::min(mn, v);
          mx = std::max(mx, v);
        }
        MinMaxQ q(mn, mx, cfg_.bits);
        kvg_store_f16(grp, c, q.scale16);
        kvg_store_f16(grp, D + c, q.zero16);
        zero[c] = q.zero;
        inv[c] = q.inv;
      }
      const float top = float((1 << cfg_.bits) - 1);
      for (int t = 0; t < G; ++t) {
        for (int c = 0; c < D; ++c) {
          const float qv = std::nearbyint((kv_sanitize(x[size_t(t) * src_stride + c]) - zero[c]) * inv[c]);
          codes[c] = uint8_t(std::clamp(qv, 0.f, top));
        }
        bitplane_pack(codes, cfg_.bits, D, grp + size_t(D) * 4 + size_t(t) * row_bytes());
      }
    }
  }

  void decode(int, const uint8_t* block, int block_tokens, int t0, int n, int,
              float* dst) const override {
    check_block(block_tokens);
    kv_check_token_range(info_.name, block_tokens, t0, n);
    const int D = cfg_.head_dim, G = cfg_.group_tokens;
    for (int k = 0; k < n; ++k) {
      const int t = t0 + k;
      const uint8_t* grp = block + size_t(t / G) * group_bytes();
      const uint8_t* row = grp + size_t(D) * 4 + size_t(t % G) * row_bytes();
      for (int c = 0; c < D; ++c)
        dst[size_t(k) * D + c] = f16_to_f32(kvg_load_f16(grp, c)) *
                                     float(bitplane_code(row, cfg_.bits, D, c)) +
                                 f16_to_f32(kvg_load_f16(grp, D + c));
    }
  }

  void scores(int, const float* qp, int n_q, const uint8_t* block, int block_tokens, int t0, int n,
              int, float* out, int out_stride) const override {
    check_block(block_tokens);
    kv_check_token_range(info_.name, block_tokens, t0, n);
    const int D = cfg_.head_dim, G = cfg_.group_tokens;
    const KiviKernels& kk = kivi_kernels();
    {
      const size_t a = size_t(t0 / G) * group_bytes(), e = size_t((t0 + n + G - 1) / G) * group_bytes();
      kvg_prefetch(block + a, e - a);
    }
    constexpr int qchunk = 8;  // bounds the stack copy of q * scale
    float qs[qchunk * kvg_max_head_dim], qz[qchunk];
    for (int t = t0; t < t0 + n;) {
      const int g = t / G, te = std::min(t0 + n, (g + 1) * G);
      const uint8_t* grp = block + size_t(g) * group_bytes();
      for (int i0 = 0; i0 < n_q; i0 += qchunk) {
        const int m = std::min(qchunk, n_q - i0);
        kivi_fold_query(grp, qp + size_t(i0) * D, m, D, qs, qz);
        kk.k_scores(grp + size_t(D) * 4 + size_t(t - g * G) * row_bytes(), row_bytes(), te - t,
                    cfg_.bits, D, qs, qz, m, out + size_t(i0) * out_stride + (t - t0), out_stride);
      }
      t = te;
    }
  }

  void accumulate(int head, const float* p, int p_stride, int n_q, const uint8_t* block,
                  int block_tokens, int t0, int n, float* acc) const override {
    kv_accumulate_via_decode(*this, head, p, p_stride, n_q, block, block_tokens, t0, n, 0, acc);
  }
};

// Head block: block_tokens rows, each [f16 scale (D/g)][f16 zero (D/g)][code planes].
class KiviValueCodec final : public KiviCodecBase {
 public:
  using KiviCodecBase::KiviCodecBase;
  size_t row_bytes() const { return kivi_v_row_bytes(cfg_.bits, cfg_.head_dim, cfg_.value_group); }
  size_t block_bytes(int block_tokens) const override {
    check_block(block_tokens);
    return size_t(block_tokens) * row_bytes();
  }

  void encode(int, const float* src, size_t src_stride, int n, uint8_t* block, int block_tokens,
              int t0, int) const override {
    check_encode(block_tokens, t0, n);
    const int D = cfg_.head_dim, g = cfg_.value_group, ng = D / g;
    uint8_t codes[kvg_max_head_dim];
    for (int k = 0; k < n; ++k) {
      const float* x = src + size_t(k) * src_stride;
      uint8_t* row = block + size_t(t0 + k) * row_bytes();
      for (int gi = 0; gi < ng; ++gi) {
        float mn = kv_sanitize(x[gi * g]), mx = mn;
        for (int c = gi * g + 1; c < (gi + 1) * g; ++c) {
          mn = std::min(mn, kv_sanitize(x[c]));
          mx = std::max(mx, kv_sanitize(x[c]));
        }
        MinMaxQ q(mn, mx, cfg_.bits);
        kvg_store_f16(row, gi, q.scale16);
        kvg_store_f16(row, ng + gi, q.zero16);
        for (int c = gi * g; c < (gi + 1) * g; ++c) codes[c] = q.code(kv_sanitize(x[c]), cfg_.bits);
      }
      bitplane_pack(codes, cfg_.bits, D, row + size_t(ng) * 4);
    }
  }

  void decode(int, const uint8_t* block, int block_tokens, int t0, int n, int,
              float* dst) const override {
    check_block(block_tokens);
    kv_check_token_range(info_.name, block_tokens, t0, n);
    const int D = cfg_.head_dim, g = cfg_.value_group, ng = D / g;
    for (int k = 0; k < n; ++k) {
      const uint8_t* row = block + size_t(t0 + k) * row_bytes();
      for (int c = 0; c < D; ++c)
        dst[size_t(k) * D + c] =
            f16_to_f32(kvg_load_f16(row, c / g)) *
                float(bitplane_code(row + size_t(ng) * 4, cfg_.bits, D, c)) +
            f16_to_f32(kvg_load_f16(row, ng + c / g));
    }
  }

  void scores(int head, const float* qp, int n_q, const uint8_t* block, int block_tokens, int t0,
              int n, int pos0, float* out, int out_stride) const override {
    kv_scores_via_decode(*this, head, qp, n_q, block, block_tokens, t0, n, pos0, out, out_stride);
  }

  void accumulate(int, const float* p, int p_stride, int n_q, const uint8_t* block,
                  int block_tokens, int t0, int n, float* acc) const override {
    check_block(block_tokens);
    kv_check_token_range(info_.name, block_tokens, t0, n);
    kvg_prefetch(block + size_t(t0) * row_bytes(), size_t(n) * row_bytes());
    kivi_kernels().v_accum(block + size_t(t0) * row_bytes(), row_bytes(), n, cfg_.bits,
                           cfg_.head_dim, cfg_.value_group, p, p_stride, n_q, acc);
  }
};

}  // namespace

std::unique_ptr<KvCodec> kivi_codec_create(const KiviConfig& c) {
  if (c.bits < 2 || c.bits > 4) fail("{}: bits must be 2, 3 or 4 (got {})", c.name, c.bits);
  kv_check_grouped_params(c.name.c_str(), c.head_dim, c.group_tokens, c.residual_tokens);
  if (c.role == KvRole::value) {
    if (c.value_group <= 0 || c.value_group % 16 != 0 || c.head_dim % c.value_group != 0)
      fail("{}: value group {} must be a multiple of 16 that divides head_dim {}", c.name,
           c.value_group, c.head_dim);
    return std::make_unique<KiviValueCodec>(c);
  }
  return std::make_unique<KiviKeyCodec>(c);
}

void kv_register_kivi() {
  struct Def {
    const char* name;
    KvRole role;
    int bits;
    bool tiles_when_fit;  // kivi4t's / kivi2t's tiles (kv/kivi_tiled.h) when head_dim and G allow them
    const char* desc;
  };
  static const Def defs[] = {
      {"kivi2_k", KvRole::key, 2, true,
       "KIVI keys: 2-bit per channel over groups of G tokens (G=32, R=128); kivi2t_k's tiles when head_dim % 32 == 0 "
       "and G % 16 == 0, else kivi2p_k's bit planes"},
      {"kivi2p_k", KvRole::key, 2, false, "KIVI keys: 2-bit per channel over groups of G tokens in bit planes"},
      {"kivi4_k", KvRole::key, 4, true,
       "KIVI keys: 4-bit per channel over groups of G tokens (G=32, R=128); kivi4t_k's tiles when head_dim % 32 == 0 "
       "and G % 16 == 0, else kivi4p_k's bit planes"},
      {"kivi4p_k", KvRole::key, 4, false, "KIVI keys: 4-bit per channel over groups of G tokens in bit planes"},
      {"kivi2_v", KvRole::value, 2, true,
       "KIVI values: 2-bit per token, groups of 32 channels (G=32, R=128); kivi2t_v's tiles when head_dim % 32 == 0 "
       "and G % 16 == 0, else kivi2p_v's bit planes"},
      {"kivi2p_v", KvRole::value, 2, false, "KIVI values: 2-bit per token, groups of 32 channels, in bit planes"},
      {"kivi4_v", KvRole::value, 4, true,
       "KIVI values: 4-bit per token, groups of 32 channels (G=32, R=128); kivi4t_v's tiles when head_dim % 32 == 0 "
       "and G % 16 == 0, else kivi4p_v's bit planes"},
      {"kivi4p_v", KvRole::value, 4, false, "KIVI values: 4-bit per token, groups of 32 channels, in bit planes"},
  };
  for (const Def& d : defs) {
    kv_register_codec({d.name, d.desc, [d](const KvCodecParams& p) {
                         KiviConfig c;
                         c.role = d.role;
                         c.bits = d.bits;
                         c.head_dim = p.head_dim;
                         c.name = d.name;
                         kv_resolve_grouped(d.name, p, kivi_default_group_tokens,
                                            kivi_default_residual_tokens, &c.group_tokens,
                                            &c.residual_tokens);
                         // Same quantization, bytes and decode either way; the tiles' kernels are integer
                         // dots (bench/BENCHMARKS.md, kivi4: ~1.8x the planes' speed on AVX-512, ~8x on AVX2).
                         if (d.tiles_when_fit && kivi_tiled_fits(c.head_dim, c.group_tokens))
                           return kivi_tiled_codec_create(c.role, c.bits, c.head_dim, c.group_tokens,
                                                          c.residual_tokens);
                         return kivi_codec_create(c);
                       }});
  }
  kv_register_format({"kivi2", {"kivi-2", "kivi_2bit"}, "kivi2_k", "kivi2_v",
                      "KIVI 2-bit: keys per channel, values per token, newest 128 tokens full "
                      "precision (Liu et al. 2024); stored as kivi2t's tiles when head_dim % 32 == 0 and G % 16 == 0"});
  kv_register_format({"kivi2p", {}, "kivi2p_k", "kivi2p_v",
                      "KIVI 2-bit in bit planes (kivi2's layout when the tiles do not fit the shape)"});
  kv_register_format({"kivi4", {"kivi-4", "kivi_4bit"}, "kivi4_k", "kivi4_v",
                      "KIVI 4-bit: keys per channel, values per token, newest 128 tokens full "
                      "precision (Liu et al. 2024); stored as kivi4t's tiles when head_dim % 32 == 0 and G % 16 == 0"});
  kv_register_format({"kivi4p", {}, "kivi4p_k", "kivi4p_v",
                      "KIVI 4-bit in bit planes (kivi4's layout when the tiles do not fit the shape)"});
}

}  // namespace kvq
