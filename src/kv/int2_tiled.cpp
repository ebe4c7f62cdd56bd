// int2t_g{32,64,128}: the tiled int2 codec (layout, kernels' arithmetic and error bounds in
// kv/int2_tiled.h), its scalar reference kernels, the dispatch points (int2t's and kivi2t's key
// scores) and the registration.
#include "kv/int2_tiled.h"

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

Int4TiledLayout int2t_layout(int hd, int group) {
  Int4TiledLayout L = int4t_layout(hd, group);
  L.tile_bytes = L.code_off + int2t_code_bytes(hd);
  return L;
}

// A tile is 16 int2_gN rows: per (token, group) the scale and min tables hold one f16 each, the
// KvGroupParams of the row; per element a crumb (the codecs also check tile_bytes == 16 * row_bytes).
static_assert(kv_tile_tokens == 16 && sizeof(KvGroupParams) == 2 * sizeof(f16_t));
static_assert(kv_unit_elems == 32 && kv_unit_int2_bytes * 4 == kv_unit_elems, "int2g's unit packing, read by encode");

namespace {

// <codes of tile slot j over 32-dim block b, q8 of b>, exact.
inline int32_t key_block_dot(const uint8_t* codes, int j, int b, const int8_t* q8) {
  int32_t dot = 0;
  for (int o = 2 * b; o < 2 * b + 2; ++o)
    for (int i = 0; i < 4; ++i) {
      const uint8_t byte = codes[64 * o + 4 * j + i];
      for (int r = 0; r < 4; ++r) dot += int32_t((byte >> (2 * r)) & 3) * q8[16 * o + 4 * r + i];
    }
  return dot;
}

}  // namespace

void int2t_scores_ref(const Int4TiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n,
                      float* out, int out_stride) {
  tiles_scores_ref(L, qp, n_q, block, t0, n, out, out_stride, key_block_dot);
}

void int2t_accum_ref(const Int4TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block, int t0,
                     int n, float* acc) {
  tiles_accum_ref(L, p, p_stride, n_q, block, t0, n, acc, int2t_value_code);
}

void int2t_scores(const Int4TiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n,
                  float* out, int out_stride) {
  KVQ_CPU_PICK(int2t_scores)(L, qp, n_q, block, t0, n, out, out_stride);
}

void int2t_accum(const Int4TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block, int t0,
                 int n, float* acc) {
  KVQ_CPU_PICK(int2t_accum)(L, p, p_stride, n_q, block, t0, n, acc);
}

void kivi2t_scores_ref(const int8_t* q8, const float* dq, const float* cz, int n_q, int hd, const uint8_t* tiles,
                       int t0, int n, float* out, int out_stride) {
  const size_t tile_bytes = int2t_code_bytes(hd);
  for (int i = 0; i < n_q; ++i) {
    const int8_t* qi = q8 + size_t(i) * size_t(hd);
    const float* di = dq + size_t(i) * size_t(hd / 32);
    for (int t = 0; t < n; ++t) {
      const int tt = t0 + t, j = tt % kv_tile_tokens;
      const uint8_t* codes = tiles + size_t(tt / kv_tile_tokens) * tile_bytes;
      float facc = 0;
      for (int b = 0; b < hd / 32; ++b) facc = std::fma(float(key_block_dot(codes, j, b, qi)), di[b], facc);
      out[size_t(i) * size_t(out_stride) + size_t(t)] = facc + cz[i];
    }
  }
}

void kivi2t_scores(const int8_t* q8, const float* dq, const float* cz, int n_q, int hd, const uint8_t* tiles,
                   int t0, int n, float* out, int out_stride) {
  KVQ_CPU_PICK(kivi2t_scores)(q8, dq, cz, n_q, hd, tiles, t0, n, out, out_stride);
}

namespace {

#if defined(KVQ_HAVE_SIMD)
using Int2tSpans = TiledSpansAvx512<Int4TiledLayout, int2t_scores_spans_avx512, int2t_accum_spans_avx512>;
#else
using Int2tSpans = void;
#endif
using Int2tOps = TiledOps<Int4TiledLayout, int4t_prepare_query, int2t_scores, int2t_accum, true, Int2tSpans>;

class Int2TiledCodec final : public TiledCodecBase<Int4TiledLayout, Int2tOps> {
 public:
  Int2TiledCodec(std::string name, KvRole role, int hd, int group)
      : TiledCodecBase(std::move(name), 2, role, int2t_layout(hd, group)), row_(kv_row_fmt(KvElem::int2g, hd, group)) {
    KVQ_CHECK(size_t(kv_tile_tokens) * row_.row_bytes == L_.tile_bytes, "int2t tile {} bytes, int2 row {}",
              L_.tile_bytes, row_.row_bytes);
  }

  // Each token is quantized by int2_gN's row encoder (so the codes, scales and minimums are
  // int2_gN's exactly), then scattered into the tile. A code byte holds crumbs of one token only
  // in K tiles but of 8 tokens in V tiles, so a token clears and sets its own crumbs.
  void encode(int, const float* src, size_t src_stride, int n, uint8_t* block, int block_tokens, int t0,
              int) const override {
    check_range(block_tokens, t0, n);
    const int hd = L_.hd;
    uint8_t row[sizeof(KvGroupParams) * (kv_max_head_dim / 32) + kv_max_head_dim / 4];
    for (int t = 0; t < n; ++t) {
      kv_row_encode(row_, 1.f, src + size_t(t) * src_stride, row);
      const uint8_t* rc = row + sizeof(KvGroupParams) * size_t(L_.ng);
      const int tt = t0 + t, j = tt % kv_tile_tokens;
      uint8_t* tp = block + size_t(tt / kv_tile_tokens) * L_.tile_bytes;
      for (int g = 0; g < L_.ng; ++g) {
        KvGroupParams gp;
        std::memcpy(&gp, row + sizeof(KvGroupParams) * size_t(g), sizeof gp);
        kvg_store_f16(tp, size_t(g * 16 + j), gp.scale);
        kvg_store_f16(tp + L_.min_off, size_t(g * 16 + j), gp.min);
      }
      uint8_t* codes = tp + L_.code_off;
      for (int e = 0; e < hd; ++e) {
        // int2g's unit packing (kv_rows.h): element e in byte (e / 32) * 8 + e % 8, bits 2 * ((e % 32) / 8).
        const int c = (rc[(e / 32) * kv_unit_int2_bytes + e % 8] >> (2 * ((e % 32) / 8))) & 3;
        size_t byte;
        int shift;
        if (role_ == KvRole::key) {
          byte = size_t(64 * (e / 16) + 4 * j + e % 4);
          shift = 2 * ((e % 16) / 4);
        } else {
          const int r = e % 32;
          byte = size_t(64 * (2 * (e / 32) + j / 8) + 4 * (r % 16) + j % 4);
          shift = 2 * (r / 16 + 2 * ((j % 8) / 4));
        }
        codes[byte] = uint8_t((codes[byte] & ~(3u << shift)) | unsigned(c) << shift);
      }
    }
  }

  void decode(int, const uint8_t* block, int block_tokens, int t0, int n, int, float* dst) const override {
    check_range(block_tokens, t0, n);
    const int hd = L_.hd;
    for (int t = 0; t < n; ++t) {
      const int tt = t0 + t, j = tt % kv_tile_tokens;
      const uint8_t* tp = block + size_t(tt / kv_tile_tokens) * L_.tile_bytes;
      const uint8_t* codes = tp + L_.code_off;
      float* x = dst + size_t(t) * size_t(hd);
      for (int e = 0; e < hd; ++e) {
        const int c = role_ == KvRole::key ? int2t_key_code(codes, j, e) : int2t_value_code(codes, j, e);
        const int g = e / L_.group;
        // The same expression as int2_gN's decode: bit-identical values.
        x[e] = std::fma(float(c), tile_f16(tp, size_t(g * 16 + j)), tile_f16(tp + L_.min_off, size_t(g * 16 + j)));
      }
    }
  }

 private:
  KvRowFmt row_;  // int2_gN's row format: the quantizer
};

}  // namespace

void kv_register_int2_tiled() {
  for (int g : {32, 64, 128}) {
    const std::string name = fmt::format("int2t_g{}", g);
    kv_register_codec(
        {name, fmt::format("int2_g{}'s quantization in a 16-token tiled layout for integer-dot kernels", g),
         [name, g](const KvCodecParams& p) -> std::unique_ptr<KvCodec> {
           kv_check_group_size(name, g, p.head_dim);
           return std::make_unique<Int2TiledCodec>(name, p.role, p.head_dim, g);
         }});
    // "int2" is int2t_g32 (int2_g32's quantization and bytes; 3 bits: at 2 bits only small groups keep
    // the error tolerable).
    kv_register_format({name, g == 32 ? std::vector<std::string>{"int2"} : std::vector<std::string>{}, name, name,
                        fmt::format("int2_g{}'s quantization in a 16-token tiled layout for integer-dot kernels: "
                                    "{} bits",
                                    g, 2 + 32.0 / g)});
  }
}

}  // namespace kvq
