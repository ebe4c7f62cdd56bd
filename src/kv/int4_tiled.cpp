// int4t_g{32,64,128}: the tiled int4 codec (layout, kernels' arithmetic and error bounds in
// kv/int4_tiled.h), its scalar reference kernels, the dispatch point and the registration.
#include "kv/int4_tiled.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include <fmt/format.h>

#include "core/cpu.h"
#include "core/error.h"
#include "kv/grouped_common.h"
#include "kv/kv_rows.h"
#include "kv/registry_internal.h"
#include "kv/tiled_codec.h"
#include "kv/tiles_ref.h"

namespace kvq {

Int4TiledLayout int4t_layout(int hd, int group) {
  KVQ_CHECK(group >= 32 && group % 32 == 0 && hd % group == 0 && hd <= kv_max_head_dim, "group {} head_dim {}",
            group, hd);
  Int4TiledLayout L;
  L.hd = hd;
  L.group = group;
  L.ng = hd / group;
  L.min_off = size_t(L.ng) * 32;
  L.code_off = size_t(L.ng) * 64;
  L.tile_bytes = L.code_off + size_t(8 * hd);
  L.q8_off = hd;
  L.dq_off = hd + hd / 4;
  L.qsum_off = L.dq_off + hd / 32;
  L.qdim = L.qsum_off + L.ng;
  return L;
}

Int4TiledLayout q4_0t_layout(int hd) {
  Int4TiledLayout L = int4t_layout(hd, 32);
  L.min_off = 0;
  L.code_off = size_t(L.ng) * 32;
  L.tile_bytes = L.code_off + size_t(8 * hd);
  L.min_mul = -8.f;
  L.signed_scales = true;
  return L;
}

void int4t_prepare_query(const Int4TiledLayout& L, const float* q, int n_q, float* qp) {
  const int hd = L.hd;
  for (int i = 0; i < n_q; ++i) {
    const float* x = q + size_t(i) * size_t(hd);
    float* row = qp + size_t(i) * size_t(L.qdim);
    if (row != x) std::memcpy(row, x, sizeof(float) * size_t(hd));  // in place: tq's tiles (kv/tq_tiled.h)
    auto* q8 = reinterpret_cast<int8_t*>(row + L.q8_off);
    float* dq = row + L.dq_off;
    float* qs = row + L.qsum_off;
    for (int b = 0; b < hd / 32; ++b) {
      float amax = 0;
      for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[32 * b + j]));
      const float d = amax / 127.f;
      // A non-finite query has no int8 image: codes 0, and qsum carries the NaN/inf into the
      // score as the float kernels would.
      const float id = d > 0 && std::isfinite(d) ? 1.f / d : 0.f;
      for (int j = 0; j < 32; ++j)
        q8[32 * b + j] = int8_t(std::min(127.f, std::max(-127.f, std::nearbyint(x[32 * b + j] * id))));
      dq[b] = id > 0 ? d : 0.f;
    }
    for (int g = 0; g < L.ng; ++g) {
      float s = 0;
      for (int j = 0; j < L.group; ++j) s += x[g * L.group + j];
      qs[g] = s * L.min_mul;  // the score kernels multiply it by the min table's entry
    }
  }
}

void int4t_scores_ref(const Int4TiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n,
                      float* out, int out_stride) {
  // Per dim-octet o: byte 4j + k holds dims 8o + k (low nibble) and 8o + 4 + k (high).
  tiles_scores_ref(L, qp, n_q, block, t0, n, out, out_stride,
                   [](const uint8_t* codes, int j, int b, const int8_t* q8) {
                     int32_t dot = 0;
                     for (int o = 4 * b; o < 4 * b + 4; ++o)
                       for (int k = 0; k < 4; ++k) {
                         const uint8_t byte = codes[64 * o + 4 * j + k];
                         dot += int32_t(byte & 15) * q8[8 * o + k] + int32_t(byte >> 4) * q8[8 * o + 4 + k];
                       }
                     return dot;
                   });
}

void int4t_accum_ref(const Int4TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block, int t0,
                     int n, float* acc) {
  tiles_accum_ref(L, p, p_stride, n_q, block, t0, n, acc, int4t_value_code);
}

void int4t_scores(const Int4TiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n,
                  float* out, int out_stride) {
  KVQ_CPU_PICK(int4t_scores)(L, qp, n_q, block, t0, n, out, out_stride);
}

void int4t_accum(const Int4TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block, int t0,
                 int n, float* acc) {
  KVQ_CPU_PICK(int4t_accum)(L, p, p_stride, n_q, block, t0, n, acc);
}

namespace {

using Int4tOps = TiledOps<Int4TiledLayout, int4t_prepare_query, int4t_scores, int4t_accum>;

// int4t_gN (rows: int4_gN) or q4_0t (rows: q4_0; layout q4_0t_layout).
class Int4TiledCodec final : public TiledCodecBase<Int4TiledLayout, Int4tOps> {
 public:
  Int4TiledCodec(std::string name, KvRole role, int hd, int group)
      : TiledCodecBase(std::move(name), 4, role, int4t_layout(hd, group)), row_(kv_row_fmt(KvElem::int4g, hd, group)) {}
  Int4TiledCodec(std::string name, KvRole role, int hd)
      : TiledCodecBase(std::move(name), 4, role, q4_0t_layout(hd)), row_(kv_row_fmt(KvElem::q4_0, hd)) {}
  // q4_1t: llama.cpp q4_1's blocks (scale and minimum per 32) are int4t_g32's tables; only the
  // quantizer (ggml's rounding) is q4_1's.
  struct Q4_1 {};
  Int4TiledCodec(std::string name, KvRole role, int hd, Q4_1)
      : TiledCodecBase(std::move(name), 4, role, int4t_layout(hd, 32)), row_(kv_row_fmt(KvElem::q4_1, hd)) {}

  // Each token is quantized by the row encoder (int4_gN's, q4_0's or q4_1's, so the codes, scales
  // and minimums are theirs exactly), then scattered into the tile; every byte a token writes is its own.
  void encode(int, const float* src, size_t src_stride, int n, uint8_t* block, int block_tokens, int t0,
              int) const override {
    check_block(block_tokens);
    KVQ_CHECK(t0 >= 0 && n >= 0 && t0 + n <= block_tokens, "t0 {} n {} block {}", t0, n, block_tokens);
    const int hd = L_.hd;
    // One buffer serves both row formats: a q4_0 block (18 bytes per 32 elements) is no larger than
    // int4_g32's (4 + 16).
    static_assert(sizeof(kv_block_q4_0) <= sizeof(KvGroupParams) + 16, "row buffer too small for q4_0 rows");
    static_assert(sizeof(kv_block_q4_1) <= sizeof(KvGroupParams) + 16, "row buffer too small for q4_1 rows");
    uint8_t row[sizeof(KvGroupParams) * (kv_max_head_dim / 32) + kv_max_head_dim / 2];
    uint8_t c[kv_max_head_dim];
    for (int t = 0; t < n; ++t) {
      kv_row_encode(row_, 1.f, src + size_t(t) * src_stride, row);
      const int tt = t0 + t, j = tt % kv_tile_tokens;
      uint8_t* tp = block + size_t(tt / kv_tile_tokens) * L_.tile_bytes;
      if (row_.elem == KvElem::q4_0 || row_.elem == KvElem::q4_1) {
        // llama.cpp blocks: f16 d (q4_1: then f16 m, into the min table), then byte i = code of
        // element i (low nibble) and 16 + i (high).
        const bool q41 = row_.elem == KvElem::q4_1;
        const size_t bb = q41 ? sizeof(kv_block_q4_1) : sizeof(kv_block_q4_0);
        for (int b = 0; b < L_.ng; ++b) {
          const uint8_t* blk = row + bb * size_t(b);
          f16_t d, m;
          std::memcpy(&d, blk, sizeof d);
          kvg_store_f16(tp, size_t(b * 16 + j), d);
          if (q41) {
            std::memcpy(&m, blk + 2, sizeof m);
            kvg_store_f16(tp + L_.min_off, size_t(b * 16 + j), m);
          }
          const uint8_t* qs = blk + (q41 ? 4 : 2);
          for (int i = 0; i < 16; ++i) {
            c[32 * b + i] = uint8_t(qs[i] & 15);
            c[32 * b + 16 + i] = uint8_t(qs[i] >> 4);
          }
        }
      } else {
        const uint8_t* rc = row + sizeof(KvGroupParams) * size_t(L_.ng);
        for (int e = 0; e < hd; ++e)
          c[e] = uint8_t((rc[(e / 32) * kv_unit_int4_bytes + e % 16] >> ((e % 32) / 16 * 4)) & 15);
        for (int g = 0; g < L_.ng; ++g) {
          KvGroupParams gp;
          std::memcpy(&gp, row + sizeof(KvGroupParams) * size_t(g), sizeof gp);
          kvg_store_f16(tp, size_t(g * 16 + j), gp.scale);
          kvg_store_f16(tp + L_.min_off, size_t(g * 16 + j), gp.min);
        }
      }
      uint8_t* codes = tp + L_.code_off;
      if (role_ == KvRole::key) {
        for (int o = 0; o < hd / 8; ++o)
          for (int k = 0; k < 4; ++k) codes[64 * o + 4 * j + k] = uint8_t(c[8 * o + k] | c[8 * o + 4 + k] << 4);
      } else {
        const int k = j / 4, m = j % 4;
        for (int ch = 0; ch < hd / 32; ++ch)
          for (int i = 0; i < 16; ++i)
            codes[64 * (4 * ch + k) + 4 * i + m] = uint8_t(c[32 * ch + i] | c[32 * ch + 16 + i] << 4);
      }
    }
  }

  void decode(int, const uint8_t* block, int block_tokens, int t0, int n, int, float* dst) const override {
    check_block(block_tokens);
    KVQ_CHECK(t0 >= 0 && n >= 0 && t0 + n <= block_tokens, "t0 {} n {} block {}", t0, n, block_tokens);
    const int hd = L_.hd;
    for (int t = 0; t < n; ++t) {
      const int tt = t0 + t, j = tt % kv_tile_tokens;
      const uint8_t* tp = block + size_t(tt / kv_tile_tokens) * L_.tile_bytes;
      const uint8_t* codes = tp + L_.code_off;
      float* x = dst + size_t(t) * size_t(hd);
      for (int e = 0; e < hd; ++e) {
        int c;
        if (role_ == KvRole::key) {
          const int o = e / 8, r = e % 8;
          c = (codes[64 * o + 4 * j + r % 4] >> (r / 4 * 4)) & 15;
        } else {
          const int ch = e / 32, r = e % 32;
          c = (codes[64 * (4 * ch + j / 4) + 4 * (r % 16) + j % 4] >> (r / 16 * 4)) & 15;
        }
        const int g = e / L_.group;
        // The same values as int4_gN's / q4_0's / q4_1's decode (q4_1's c * d is exact, so its
        // c * d + m rounds once, as the FMA does): bit-identical.
        x[e] = row_.elem == KvElem::q4_0
                   ? float(c - 8) * tile_f16(tp, size_t(g * 16 + j))
                   : std::fma(float(c), tile_f16(tp, size_t(g * 16 + j)), tile_f16(tp + L_.min_off, size_t(g * 16 + j)));
      }
    }
  }

 private:
  KvRowFmt row_;  // int4_gN's or q4_0's row format: the quantizer
};

}  // namespace

void kv_register_int4_tiled() {
  for (int g : {32, 64, 128}) {
    const std::string name = fmt::format("int4t_g{}", g);
    kv_register_codec(
        {name, fmt::format("int4_g{}'s quantization in a 16-token tiled layout for integer-dot kernels", g),
         [name, g](const KvCodecParams& p) -> std::unique_ptr<KvCodec> {
           kv_check_group_size(name, g, p.head_dim);
           return std::make_unique<Int4TiledCodec>(name, p.role, p.head_dim, g);
         }});
    kv_register_format({name, g == 64 ? std::vector<std::string>{"int4"} : std::vector<std::string>{}, name, name,
                        fmt::format("int4_g{}'s quantization in a 16-token tiled layout for integer-dot kernels: "
                                    "{} bits",
                                    g, 4 + 32.0 / g)});
  }
  kv_register_codec({"q4_0t", "llama.cpp q4_0's quantization in int4t's 16-token tiles for integer-dot kernels",
                     [](const KvCodecParams& p) -> std::unique_ptr<KvCodec> {
                       if (p.head_dim % 32 != 0 || p.head_dim > kv_max_head_dim)
                         fail("KV codec 'q4_0t': head_dim {} must be a multiple of 32 (q4_0's blocks), at most {}",
                              p.head_dim, kv_max_head_dim);
                       return std::make_unique<Int4TiledCodec>("q4_0t", p.role, p.head_dim);
                     }});
  kv_register_format({"q4_0t", {}, "q4_0t", "q4_0t",
                      "llama.cpp q4_0's quantization, bytes and decode in 16-token tiles for integer-dot kernels: "
                      "4.5 bits"});
  kv_register_codec({"q4_1t", "llama.cpp q4_1's quantization in int4t's 16-token tiles for integer-dot kernels",
                     [](const KvCodecParams& p) -> std::unique_ptr<KvCodec> {
                       if (p.head_dim % 32 != 0 || p.head_dim > kv_max_head_dim)
                         fail("KV codec 'q4_1t': head_dim {} must be a multiple of 32 (q4_1's blocks), at most {}",
                              p.head_dim, kv_max_head_dim);
                       return std::make_unique<Int4TiledCodec>("q4_1t", p.role, p.head_dim, Int4TiledCodec::Q4_1{});
                     }});
  kv_register_format({"q4_1t", {}, "q4_1t", "q4_1t",
                      "llama.cpp q4_1's quantization, bytes and decode in 16-token tiles for integer-dot kernels: "
                      "5 bits"});
}

}  // namespace kvq
