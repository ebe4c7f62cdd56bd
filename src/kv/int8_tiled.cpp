// int8t: the tiled int8 codec (layout, kernels' arithmetic and error bounds in kv/int8_tiled.h),
// its scalar reference kernels, the dispatch point and the registration.
#include "kv/int8_tiled.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include <fmt/format.h>

#include "core/cpu.h"
#include "core/error.h"
#include "kv/grouped_common.h"
#include "kv/int4_tiled.h"
#include "kv/kv_rows.h"
#include "kv/registry_internal.h"
#include "kv/tiled_codec.h"
#include "kv/tiles_ref.h"

namespace kvq {

Int8TiledLayout int8t_layout(int hd) {
  KVQ_CHECK(hd >= 32 && hd % 32 == 0 && hd <= kv_max_head_dim, "head_dim {}", hd);
  Int8TiledLayout L;
  L.hd = hd;
  L.code_off = 64;
  L.tile_bytes = L.code_off + size_t(16 * hd);
  L.q8_off = hd;
  L.q8lo_off = hd + hd / 4;
  L.dq_off = hd + hd / 2;
  L.qs8_off = L.dq_off + hd / 32;
  L.q16_off = L.qs8_off + hd / 32;
  L.qdim = L.q16_off + hd / 2;
  return L;
}

Int8TiledLayout q8_0t_layout(int hd) {
  Int8TiledLayout L = int8t_layout(hd);
  L.block_scales = true;
  L.code_off = size_t(hd);  // f16 [hd / 32][16]
  L.tile_bytes = L.code_off + size_t(16 * hd);
  return L;
}

float int8t_tile_scale(const Int8TiledLayout& L, const uint8_t* tp, int j, int b) {
  if (L.block_scales) return tile_f16(tp, size_t(b * 16 + j));
  float s;
  std::memcpy(&s, tp + 4 * size_t(j), 4);
  return s;
}

Int8tQueryRow int8t_query_row(const Int8TiledLayout& L, const float* qp, int row) {
  const float* r = qp + size_t(row) * size_t(L.qdim);
  return {reinterpret_cast<const int8_t*>(r + L.q8_off), reinterpret_cast<const int8_t*>(r + L.q8lo_off), r + L.dq_off,
          reinterpret_cast<const int32_t*>(r + L.qs8_off), reinterpret_cast<const int16_t*>(r + L.q16_off)};
}

void int8t_prepare_query(const Int8TiledLayout& L, const float* q, int n_q, float* qp) {
  const int hd = L.hd;
  for (int i = 0; i < n_q; ++i) {
    const float* x = q + size_t(i) * size_t(hd);
    float* row = qp + size_t(i) * size_t(L.qdim);
    std::memcpy(row, x, sizeof(float) * size_t(hd));
    auto* q8 = reinterpret_cast<int8_t*>(row + L.q8_off);
    auto* ql = reinterpret_cast<int8_t*>(row + L.q8lo_off);
    auto* q16 = reinterpret_cast<int16_t*>(row + L.q16_off);
    float* dq = row + L.dq_off;
    for (int b = 0; b < hd / 32; ++b) {
      float amax = 0;
      bool finite = true;
      for (int j = 0; j < 32; ++j) {
        amax = std::max(amax, std::fabs(x[32 * b + j]));
        finite = finite && std::isfinite(x[32 * b + j]);
      }
      // A non-finite query block has no int8 image: codes 0 and step NaN, so the score is NaN as
      // the float kernels' would be (never silently finite).
      const float d = amax / 127.f;
      const float id = finite && d > 0 ? 1.f / d : 0.f;
      int32_t s = 0;
      for (int j = 0; j < 32; ++j) {
        const float y = x[32 * b + j] * id;
        const float hi = std::min(127.f, std::max(-127.f, std::nearbyint(y)));
        // y - hi is exact (hi is the integer nearest y, |y| <= 127 (1 + 2^-23)), |.| <= 1/2.
        const float lo = std::min(127.f, std::max(-127.f, std::nearbyint((y - hi) * kv_int8t_lo_levels)));
        q8[32 * b + j] = int8_t(hi);
        ql[32 * b + j] = int8_t(lo);
        q16[32 * b + j] = int16_t(int32_t(kv_int8t_lo_levels) * int32_t(hi) + int32_t(lo));
        s += int32_t(kv_int8t_lo_levels) * int32_t(hi) + int32_t(lo);
      }
      s *= 128;
      dq[b] = !finite ? std::numeric_limits<float>::quiet_NaN() : id > 0 ? d / kv_int8t_lo_levels : 0.f;
      std::memcpy(row + L.qs8_off + b, &s, 4);
    }
  }
}

void int8t_scores_ref(const Int8TiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n,
                      float* out, int out_stride) {
  for (int i = 0; i < n_q; ++i) {
    const Int8tQueryRow qr = int8t_query_row(L, qp, i);
    for (int t = 0; t < n; ++t) {
      const int tt = t0 + t, j = tt % kv_tile_tokens;
      const uint8_t* tp = block + size_t(tt / kv_tile_tokens) * L.tile_bytes;
      const uint8_t* codes = tp + L.code_off;
      float facc = 0;
      for (int b = 0; b < L.hd / 32; ++b) {
        int32_t hi = 0, lo = 0;
        for (int o = 8 * b; o < 8 * b + 8; ++o)
          for (int k = 0; k < 4; ++k) {
            hi += int32_t(codes[64 * o + 4 * j + k]) * qr.q8[4 * o + k];
            lo += int32_t(codes[64 * o + 4 * j + k]) * qr.q8lo[4 * o + k];
          }
        const int32_t dot = int32_t(kv_int8t_lo_levels) * hi + lo - qr.qs8[b];
        // q8_0t: each block times its own scale; int8t: the token's scale once, at the end.
        if (L.block_scales) facc = std::fma(float(dot) * qr.dq[b], int8t_tile_scale(L, tp, j, b), facc);
        else facc = std::fma(float(dot), qr.dq[b], facc);
      }
      out[size_t(i) * size_t(out_stride) + size_t(t)] = L.block_scales ? facc : facc * int8t_tile_scale(L, tp, j, 0);
    }
  }
}

void int8t_accum_ref(const Int8TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block, int t0,
                     int n, float* acc) {
  if (n <= 0) return;
  const int hd = L.hd;
  const int tile0 = t0 / kv_tile_tokens, tile1 = (t0 + n + kv_tile_tokens - 1) / kv_tile_tokens;
  float facc[kv_max_head_dim];
  const bool u8 = int4t_weights_nonneg(p, p_stride, n_q, n);
  for (int i = 0; i < n_q; ++i) {
    const float* pi = p + size_t(i) * size_t(p_stride);
    std::fill(facc, facc + hd, 0.f);
    for (int tile = tile0; tile < tile1; ++tile) {
      const uint8_t* tp = block + size_t(tile) * L.tile_bytes;
      const auto* codes = reinterpret_cast<const int8_t*>(tp + L.code_off);
      // Weights per scale block: the whole head for int8t, 32 channels for q8_0t.
      const int nsb = L.block_scales ? hd / 32 : 1, span = hd / nsb;
      for (int sb = 0; sb < nsb; ++sb) {
        float w[kv_tile_tokens];
        for (int j = 0; j < kv_tile_tokens; ++j) {
          const int t = tile * kv_tile_tokens + j - t0;
          w[j] = t >= 0 && t < n ? pi[t] * int8t_tile_scale(L, tp, j, sb) : 0.f;
        }
        int32_t wq[kv_tile_tokens];
        const float dw = tile_quantize_weights_ref(w, u8, wq);
        for (int d = sb * span; d < (sb + 1) * span; ++d) {
          const int c = d / 16, lane = d % 16;
          int32_t dot = 0;
          for (int j = 0; j < kv_tile_tokens; ++j) dot += wq[j] * int32_t(codes[64 * (4 * c + j / 4) + 4 * lane + j % 4]);
          facc[d] = std::fma(float(dot), dw, facc[d]);
        }
      }
    }
    float* a = acc + size_t(i) * size_t(hd);
    for (int d = 0; d < hd; ++d) a[d] += facc[d];
  }
}

void int8t_scores(const Int8TiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n,
                  float* out, int out_stride) {
  KVQ_CPU_PICK(int8t_scores)(L, qp, n_q, block, t0, n, out, out_stride);
}

void int8t_accum(const Int8TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block, int t0,
                 int n, float* acc) {
  KVQ_CPU_PICK(int8t_accum)(L, p, p_stride, n_q, block, t0, n, acc);
}

namespace {

using Int8tOps = TiledOps<Int8TiledLayout, int8t_prepare_query, int8t_scores, int8t_accum, true>;

// int8t (rows: int8) or q8_0t (rows: q8_0; layout q8_0t_layout).
class Int8TiledCodec final : public TiledCodecBase<Int8TiledLayout, Int8tOps> {
 public:
  Int8TiledCodec(KvRole role, int hd, bool q8_0)
      : TiledCodecBase(q8_0 ? "q8_0t" : "int8t", 8, role, q8_0 ? q8_0t_layout(hd) : int8t_layout(hd)),
        row_(q8_0 ? kv_row_fmt(KvElem::q8_0, hd) : kv_row_fmt(KvElem::int8, hd)) {}

  // Each token is quantized by the row encoder (int8's or q8_0's: codes and scales are theirs
  // exactly), then scattered into its tile; every byte a token writes is its own.
  void encode(int, const float* src, size_t src_stride, int n, uint8_t* block, int block_tokens, int t0,
              int) const override {
    check_block(block_tokens);
    kv_check_token_range(info().name, block_tokens, t0, n);
    const int hd = L_.hd;
    static_assert(sizeof(kv_block_q8_0) == 34, "q8_0 block: f16 d + 32 int8 codes");
    uint8_t row[sizeof(kv_block_q8_0) * (kv_max_head_dim / 32)];
    uint8_t cbuf[kv_max_head_dim];
    for (int t = 0; t < n; ++t) {
      kv_row_encode(row_, 1.f, src + size_t(t) * src_stride, row);
      const int tt = t0 + t, j = tt % kv_tile_tokens;
      uint8_t* tp = block + size_t(tt / kv_tile_tokens) * L_.tile_bytes;
      const uint8_t* c = row + sizeof(KvRowScaled);
      if (L_.block_scales) {
        for (int b = 0; b < hd / 32; ++b) {
          kv_block_q8_0 blk;
          std::memcpy(&blk, row + sizeof(blk) * size_t(b), sizeof blk);
          kvg_store_f16(tp, size_t(b * 16 + j), blk.d);
          std::memcpy(cbuf + 32 * b, blk.qs, 32);
        }
        c = cbuf;
      } else {
        std::memcpy(tp + 4 * size_t(j), row, 4);
      }
      uint8_t* codes = tp + L_.code_off;
      if (role_ == KvRole::key) {
        for (int e = 0; e < hd; ++e) codes[64 * (e / 4) + 4 * j + e % 4] = uint8_t(c[e] ^ 0x80);
      } else {
        for (int e = 0; e < hd; ++e) codes[64 * (4 * (e / 16) + j / 4) + 4 * (e % 16) + j % 4] = c[e];
      }
    }
  }

  void decode(int, const uint8_t* block, int block_tokens, int t0, int n, int, float* dst) const override {
    check_block(block_tokens);
    kv_check_token_range(info().name, block_tokens, t0, n);
    const int hd = L_.hd;
    for (int t = 0; t < n; ++t) {
      const int tt = t0 + t, j = tt % kv_tile_tokens;
      const uint8_t* tp = block + size_t(tt / kv_tile_tokens) * L_.tile_bytes;
      const uint8_t* codes = tp + L_.code_off;
      float* x = dst + size_t(t) * size_t(hd);
      for (int e = 0; e < hd; ++e) {
        const int c = role_ == KvRole::key ? int(codes[64 * (e / 4) + 4 * j + e % 4]) - 128
                                           : int(int8_t(codes[64 * (4 * (e / 16) + j / 4) + 4 * (e % 16) + j % 4]));
        // int8's / q8_0's decode expression: bit-identical values
        x[e] = float(c) * int8t_tile_scale(L_, tp, j, e / 32);
      }
    }
  }

 private:
  KvRowFmt row_;  // int8's or q8_0's row format: the quantizer
};

}  // namespace

void kv_register_int8_tiled() {
  kv_register_codec({"int8t", "int8's quantization in a 16-token tiled layout for integer-dot kernels",
                     [](const KvCodecParams& p) -> std::unique_ptr<KvCodec> {
                       if (p.head_dim % 32 != 0 || p.head_dim > kv_max_head_dim)
                         fail("KV codec 'int8t': head_dim {} must be a multiple of 32 (at most {}); use 'int8'",
                              p.head_dim, kv_max_head_dim);
                       return std::make_unique<Int8TiledCodec>(p.role, p.head_dim, false);
                     }});
  kv_register_format({"int8t", {}, "int8t", "int8t",
                      "int8's quantization in a 16-token tiled layout for integer-dot kernels: 8 + 32/head_dim bits"});
  kv_register_codec({"q8_0t", "llama.cpp q8_0's quantization in int8t's 16-token tiles for integer-dot kernels",
                     [](const KvCodecParams& p) -> std::unique_ptr<KvCodec> {
                       if (p.head_dim % 32 != 0 || p.head_dim > kv_max_head_dim)
                         fail("KV codec 'q8_0t': head_dim {} must be a multiple of 32 (q8_0's blocks), at most {}",
                              p.head_dim, kv_max_head_dim);
                       return std::make_unique<Int8TiledCodec>(p.role, p.head_dim, true);
                     }});
  kv_register_format({"q8_0t", {}, "q8_0t", "q8_0t",
                      "llama.cpp q8_0's quantization, bytes and decode in 16-token tiles for integer-dot kernels: "
                      "8.5 bits"});
}

}  // namespace kvq
