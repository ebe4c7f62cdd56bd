// kivi2t (layout, arithmetic and error bound in kv/kivi2_tiled.h): the codecs and their
// registration. Kernels: kivit_fold_query (kv/kivi_tiled.h), kivi2t_scores and int2t_accum
// (kv/int2_tiled.h).
#include "kv/kivi2_tiled.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>

#include "core/dtypes.h"
#include "core/error.h"
#include "kv/grouped_common.h"
#include "kv/int2_tiled.h"
#include "kv/kivi.h"
#include "kv/kivi_tiled.h"
#include "kv/registry_internal.h"

namespace kvq {
namespace {

// kivi's 2-bit min/max quantizer (kv/kivi.cpp, MinMaxQ at bits = 2): scale and zero rounded to
// f16 first, codes chosen against exactly those numbers. The same expressions, so that codes and
// parameters are kivi2's bit for bit (tests/test_kivi2_tiled.cpp compares the decodes).
struct MinMax2 {
  f16_t scale16, zero16;
  float zero, inv;
  MinMax2(float mn, float mx) {
    scale16 = f32_to_f16((mx - mn) / 3.f);
    zero16 = f32_to_f16(mn);
    const float scale = f16_to_f32(scale16);
    zero = f16_to_f32(zero16);
    inv = scale > 0 ? 1.f / scale : 0.f;
  }
  uint8_t code(float x) const { return uint8_t(std::clamp(std::nearbyint((x - zero) * inv), 0.f, 3.f)); }
};

class Kivi2tCodecBase : public KvCodec {
 public:
  Kivi2tCodecBase(std::string name, int hd, int g, int r) : hd_(hd), g_(g) {
    info_.name = std::move(name);
    info_.code_bits = 2;
    info_.group_tokens = g;
    info_.residual_tokens = r;
  }
  const KvCodecInfo& info() const override { return info_; }
  int head_dim() const override { return hd_; }

 protected:
  void check_block(int block_tokens) const { kv_check_block_tokens(info_.name, block_tokens, g_); }
  void check_range(int block_tokens, int t0, int n) const {
    check_block(block_tokens);
    KVQ_CHECK(t0 >= 0 && n >= 0 && t0 + n <= block_tokens, "t0 {} n {} block {}", t0, n, block_tokens);
  }
  KvCodecInfo info_;
  int hd_, g_;
};

class Kivi2tKeyCodec final : public Kivi2tCodecBase {
 public:
  using Kivi2tCodecBase::Kivi2tCodecBase;
  size_t group_bytes() const { return size_t(hd_) * 4 + size_t(g_ / kv_tile_tokens) * int2t_code_bytes(hd_); }
  size_t block_bytes(int block_tokens) const override {
    check_block(block_tokens);
    return size_t(block_tokens / g_) * group_bytes();
  }
  PrefetchRange prefetch_range(int block_tokens, int t0, int n) const override {
    check_block(block_tokens);
    PrefetchRange r;
    kv_unit_range(group_bytes(), g_, t0, n, prefetch_lead_bytes, &r.offset, &r.bytes);
    return r;
  }

  void encode(int, const float* src, size_t src_stride, int n, uint8_t* block, int block_tokens, int t0,
              int) const override {
    check_block(block_tokens);
    kv_check_encode_range(info_.name, block_tokens, g_, t0, n);
    const int D = hd_;
    for (int g0 = 0; g0 < n; g0 += g_) {
      uint8_t* grp = block + size_t((t0 + g0) / g_) * group_bytes();
      const float* x = src + size_t(g0) * src_stride;
      float zero[kvg_max_head_dim], inv[kvg_max_head_dim];
      for (int c = 0; c < D; ++c) {
        float mn = kv_sanitize(x[c]), mx = mn;
        for (int t = 1; t < g_; ++t) {
          const float v = kv_sanitize(x[size_t(t) * src_stride + c]);
          mn = std::min(mn, v);
          mx = std::max(mx, v);
        }
        const MinMax2 q(mn, mx);
        kvg_store_f16(grp, size_t(c), q.scale16);
        kvg_store_f16(grp, size_t(D + c), q.zero16);
        zero[c] = q.zero;
        inv[c] = q.inv;
      }
      uint8_t* tiles = grp + size_t(D) * 4;
      uint8_t code[kvg_max_head_dim];
      for (int t = 0; t < g_; ++t) {
        for (int c = 0; c < D; ++c) {
          // kivi2_k's expression (not MinMax2::code, which kivi's key path does not use either).
          const float qv = std::nearbyint((kv_sanitize(x[size_t(t) * src_stride + c]) - zero[c]) * inv[c]);
          code[c] = uint8_t(std::clamp(qv, 0.f, 3.f));
        }
        // A K tile's code byte belongs to one token: written whole.
        const int j = t % kv_tile_tokens;
        uint8_t* codes = tiles + size_t(t / kv_tile_tokens) * int2t_code_bytes(D);
        for (int o = 0; o < D / 16; ++o)
          for (int i = 0; i < 4; ++i) {
            const uint8_t* c = code + 16 * o + i;
            codes[64 * o + 4 * j + i] = uint8_t(c[0] | c[4] << 2 | c[8] << 4 | c[12] << 6);
          }
      }
    }
  }

  void decode(int, const uint8_t* block, int block_tokens, int t0, int n, int, float* dst) const override {
    check_range(block_tokens, t0, n);
    const int D = hd_;
    for (int k = 0; k < n; ++k) {
      const int t = t0 + k, tg = t % g_, j = tg % kv_tile_tokens;
      const uint8_t* grp = block + size_t(t / g_) * group_bytes();
      const uint8_t* codes = grp + size_t(D) * 4 + size_t(tg / kv_tile_tokens) * int2t_code_bytes(D);
      for (int c = 0; c < D; ++c)
        // kivi2_k's decode expression: bit-identical values.
        dst[size_t(k) * size_t(D) + size_t(c)] = f16_to_f32(kvg_load_f16(grp, size_t(c))) *
                                                     float(int2t_key_code(codes, j, c)) +
                                                 f16_to_f32(kvg_load_f16(grp, size_t(D + c)));
    }
  }

  void scores(int, const float* qp, int n_q, const uint8_t* block, int block_tokens, int t0, int n, int, float* out,
              int out_stride) const override {
    check_range(block_tokens, t0, n);
    const int D = hd_;
    if (n > 0) {
      const size_t a = size_t(t0 / g_) * group_bytes(), e = size_t((t0 + n + g_ - 1) / g_) * group_bytes();
      kvg_prefetch(block + a, e - a);
    }
    constexpr int qchunk = 8;  // bounds the stack copy of the folded query
    int8_t q8[qchunk * kvg_max_head_dim];
    float dq[qchunk * (kvg_max_head_dim / 32)], cz[qchunk];
    for (int t = t0; t < t0 + n;) {
      const int g = t / g_, te = std::min(t0 + n, (g + 1) * g_);
      const uint8_t* grp = block + size_t(g) * group_bytes();
      for (int i0 = 0; i0 < n_q; i0 += qchunk) {
        const int m = std::min(qchunk, n_q - i0);
        kivit_fold_query(grp, qp + size_t(i0) * size_t(D), m, D, q8, dq, cz);
        kivi2t_scores(q8, dq, cz, m, D, grp + size_t(D) * 4, t - g * g_, te - t,
                      out + size_t(i0) * size_t(out_stride) + size_t(t - t0), out_stride);
      }
      t = te;
    }
  }

  void accumulate(int head, const float* p, int p_stride, int n_q, const uint8_t* block, int block_tokens, int t0,
                  int n, float* acc) const override {
    kv_accumulate_via_decode(*this, head, p, p_stride, n_q, block, block_tokens, t0, n, 0, acc);
  }
};

class Kivi2tValueCodec final : public Kivi2tCodecBase {
 public:
  Kivi2tValueCodec(std::string name, int hd, int g, int r)
      : Kivi2tCodecBase(std::move(name), hd, g, r), L_(int2t_layout(hd, 32)) {}
  size_t block_bytes(int block_tokens) const override {
    check_block(block_tokens);
    return size_t(block_tokens / kv_tile_tokens) * L_.tile_bytes;
  }
  PrefetchRange prefetch_range(int block_tokens, int t0, int n) const override {
    check_block(block_tokens);
    PrefetchRange r;
    kv_unit_range(L_.tile_bytes, kv_tile_tokens, t0, n, prefetch_lead_bytes, &r.offset, &r.bytes);
    return r;
  }

  // kivi2_v's per-token quantization (groups of 32 channels), written into int2t_g32's tiles. A V
  // tile's code byte holds crumbs of 8 tokens: each token clears and sets its own.
  void encode(int, const float* src, size_t src_stride, int n, uint8_t* block, int block_tokens, int t0,
              int) const override {
    check_block(block_tokens);
    kv_check_encode_range(info_.name, block_tokens, g_, t0, n);
    for (int k = 0; k < n; ++k) {
      const float* x = src + size_t(k) * src_stride;
      const int tt = t0 + k, j = tt % kv_tile_tokens;
      uint8_t* tp = block + size_t(tt / kv_tile_tokens) * L_.tile_bytes;
      uint8_t* codes = tp + L_.code_off;
      for (int gi = 0; gi < L_.ng; ++gi) {
        float mn = kv_sanitize(x[gi * 32]), mx = mn;
        for (int e = gi * 32 + 1; e < (gi + 1) * 32; ++e) {
          mn = std::min(mn, kv_sanitize(x[e]));
          mx = std::max(mx, kv_sanitize(x[e]));
        }
        const MinMax2 q(mn, mx);
        kvg_store_f16(tp, size_t(gi * 16 + j), q.scale16);
        kvg_store_f16(tp + L_.min_off, size_t(gi * 16 + j), q.zero16);
        for (int r = 0; r < 32; ++r) {
          const size_t byte = size_t(64 * (2 * gi + j / 8) + 4 * (r % 16) + j % 4);
          const int shift = 2 * (r / 16 + 2 * ((j % 8) / 4));
          codes[byte] = uint8_t((codes[byte] & ~(3u << shift)) | unsigned(q.code(kv_sanitize(x[gi * 32 + r]))) << shift);
        }
      }
    }
  }

  void decode(int, const uint8_t* block, int block_tokens, int t0, int n, int, float* dst) const override {
    check_range(block_tokens, t0, n);
    const int D = hd_;
    for (int k = 0; k < n; ++k) {
      const int tt = t0 + k, j = tt % kv_tile_tokens;
      const uint8_t* tp = block + size_t(tt / kv_tile_tokens) * L_.tile_bytes;
      const uint8_t* codes = tp + L_.code_off;
      for (int e = 0; e < D; ++e) {
        const int g = e / 32;
        // kivi2_v's decode expression (a product then a sum, not int2t's fma): bit-identical.
        dst[size_t(k) * size_t(D) + size_t(e)] =
            f16_to_f32(kvg_load_f16(tp, size_t(g * 16 + j))) * float(int2t_value_code(codes, j, e)) +
            f16_to_f32(kvg_load_f16(tp + L_.min_off, size_t(g * 16 + j)));
      }
    }
  }

  void scores(int head, const float* qp, int n_q, const uint8_t* block, int block_tokens, int t0, int n, int pos0,
              float* out, int out_stride) const override {
    kv_scores_via_decode(*this, head, qp, n_q, block, block_tokens, t0, n, pos0, out, out_stride);
  }
  // The block is an int2t_g32 value block: int2t's weighted sum (and its bound) applies as is.
  void accumulate(int, const float* p, int p_stride, int n_q, const uint8_t* block, int block_tokens, int t0, int n,
                  float* acc) const override {
    check_range(block_tokens, t0, n);
    int2t_accum(L_, p, p_stride, n_q, block, t0, n, acc);
  }

 private:
  Int4TiledLayout L_;
};

}  // namespace

void kv_register_kivi2_tiled() {
  struct Def {
    const char* name;
    KvRole role;
    const char* desc;
  };
  static const Def defs[] = {
      {"kivi2t_k", KvRole::key,
       "kivi2_k's per-channel 2-bit keys (G=32, R=128) in 16-token tiles for integer-dot scores"},
      {"kivi2t_v", KvRole::value,
       "kivi2_v's per-token 2-bit values (groups of 32 channels; G=32, R=128) in int2t_g32's tiles"},
  };
  for (const Def& d : defs) {
    kv_register_codec({d.name, d.desc, [d](const KvCodecParams& p) -> std::unique_ptr<KvCodec> {
                         int g = 0, r = 0;
                         kv_resolve_grouped(d.name, p, kivi_default_group_tokens, kivi_default_residual_tokens, &g,
                                            &r);
                         kv_check_grouped_params(d.name, p.head_dim, g, r);
                         if (p.head_dim % 32 != 0)
                           fail("KV codec '{}': head_dim {} must be a multiple of 32 (int8 query blocks and value "
                                "groups of 32 channels)",
                                d.name, p.head_dim);
                         if (g % kv_tile_tokens != 0)
                           fail("KV codec '{}': group of {} tokens; this codec stores 16-token tiles, so G must be a "
                                "multiple of 16",
                                d.name, g);
                         if (d.role == KvRole::key) return std::make_unique<Kivi2tKeyCodec>(d.name, p.head_dim, g, r);
                         return std::make_unique<Kivi2tValueCodec>(d.name, p.head_dim, g, r);
                       }});
  }
  kv_register_format({"kivi2t", {}, "kivi2t_k", "kivi2t_v",
                      "KIVI 2-bit (kivi2's quantization and bytes) in 16-token tiles for integer-dot kernels: keys "
                      "per channel, values per token, newest 128 tokens full precision"});
}

}  // namespace kvq
