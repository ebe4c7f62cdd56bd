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

Int4TiledLayout q5t_layout(int hd, bool with_min) {
  Int4TiledLayout L = with_min ? int4t_layout(hd, 32) : q4_0t_layout(hd);
  if (!with_min) L.min_mul = -16.f;
  L.code_bits = 5;
  L.unit_bytes = 320;
  L.tile_bytes = L.code_off + size_t(10 * hd);
  return L;
}

Int4TiledLayout iq4nlt_layout(int hd) {
  Int4TiledLayout L = q4_0t_layout(hd);
  L.min_mul = 0.f;
  L.lut = kv_iq4nl_grid;
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
  // q5_0t / q5_1t / iq4_nlt: the value of every element from its code reader.
  const auto per_element = [&](auto value_of) {
    tiles_scores_ref(L, qp, n_q, block, t0, n, out, out_stride,
                     [value_of](const uint8_t* codes, int j, int b, const int8_t* q8) {
                       int32_t dot = 0;
                       for (int d = 32 * b; d < 32 * b + 32; ++d) dot += int32_t(value_of(codes, j, d)) * q8[d];
                       return dot;
                     });
  };
  if (L.lut)
    return per_element([lut = L.lut](const uint8_t* codes, int j, int d) { return lut[int4t_key_code(codes, j, d)]; });
  if (L.code_bits == 5) return per_element(int5t_key_code);
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
  if (L.lut)
    return tiles_accum_ref(L, p, p_stride, n_q, block, t0, n, acc, [lut = L.lut](const uint8_t* codes, int j, int d) {
      return int(lut[int4t_value_code(codes, j, d)]);
    });
  tiles_accum_ref(L, p, p_stride, n_q, block, t0, n, acc, L.code_bits == 5 ? int5t_value_code : int4t_value_code);
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

#if defined(KVQ_HAVE_SIMD)
using Int4tSpans = TiledSpansAvx512<Int4TiledLayout, int4t_scores_spans_avx512, int4t_accum_spans_avx512>;
#else
using Int4tSpans = void;
#endif
using Int4tOps = TiledOps<Int4TiledLayout, int4t_prepare_query, int4t_scores, int4t_accum, true, Int4tSpans>;

// The layout of llama.cpp type e's blocks in these tiles.
Int4TiledLayout ggml_tiled_layout(int hd, KvElem e) {
  switch (e) {
    case KvElem::q4_0: return q4_0t_layout(hd);
    case KvElem::q5_0: return q5t_layout(hd, false);
    case KvElem::q5_1: return q5t_layout(hd, true);
    case KvElem::iq4_nl: return iq4nlt_layout(hd);
    default: return int4t_layout(hd, 32);  // q4_1: its scale and minimum per 32 are int4t_g32's tables
  }
}

// int4t_gN (rows: int4_gN), or llama.cpp's q4_0t / q4_1t / q5_0t / q5_1t / iq4_nlt (rows: q4_0 ..
// iq4_nl; ggml_tiled_layout).
class Int4TiledCodec final : public TiledCodecBase<Int4TiledLayout, Int4tOps> {
 public:
  Int4TiledCodec(std::string name, KvRole role, int hd, int group)
      : TiledCodecBase(std::move(name), 4, role, int4t_layout(hd, group)), row_(kv_row_fmt(KvElem::int4g, hd, group)) {}
  Int4TiledCodec(std::string name, KvRole role, int hd, KvElem ggml)
      : TiledCodecBase(std::move(name), kv_elem_code_bits(ggml), role, ggml_tiled_layout(hd, ggml)),
        row_(kv_row_fmt(ggml, hd)) {}

  // Each token is quantized by the row encoder (int4_gN's or llama.cpp's, so the codes, scales and
  // minimums are theirs exactly), then scattered into the tile. A token owns its nibble bytes and
  // its K fifth-bit bytes; a V fifth-bit byte holds bits of 4 tokens, so each clears and sets its own.
  void encode(int, const float* src, size_t src_stride, int n, uint8_t* block, int block_tokens, int t0,
              int) const override {
    check_block(block_tokens);
    kv_check_token_range(info().name, block_tokens, t0, n);
    const int hd = L_.hd;
    const size_t ub = size_t(L_.unit_bytes);
    constexpr size_t kRowMax = std::max(sizeof(KvGroupParams) + 16, sizeof(kv_block_q5_1)) * (kv_max_head_dim / 32);
    uint8_t row[kRowMax];
    uint8_t c[kv_max_head_dim];
    for (int t = 0; t < n; ++t) {
      kv_row_encode(row_, 1.f, src + size_t(t) * src_stride, row);
      const int tt = t0 + t, j = tt % kv_tile_tokens;
      uint8_t* tp = block + size_t(tt / kv_tile_tokens) * L_.tile_bytes;
      if (row_.elem == KvElem::int4g) {
        const uint8_t* rc = row + sizeof(KvGroupParams) * size_t(L_.ng);
        for (int e = 0; e < hd; ++e)
          c[e] = uint8_t((rc[(e / 32) * kv_unit_int4_bytes + e % 16] >> ((e % 32) / 16 * 4)) & 15);
        for (int g = 0; g < L_.ng; ++g) {
          KvGroupParams gp;
          std::memcpy(&gp, row + sizeof(KvGroupParams) * size_t(g), sizeof gp);
          kvg_store_f16(tp, size_t(g * 16 + j), gp.scale);
          kvg_store_f16(tp + L_.min_off, size_t(g * 16 + j), gp.min);
        }
      } else {
        // llama.cpp blocks: f16 d, f16 m (the *_1 types: into the min table), the fifth bits (q5_*:
        // bit i of qh for element i), then byte i = low 4 bits of element i (low nibble) and 16 + i.
        const KvElem e = row_.elem;
        const bool has_m = e == KvElem::q4_1 || e == KvElem::q5_1, five = L_.code_bits == 5;
        const size_t bb = kv_row_bytes(e, 32, 0);
        for (int b = 0; b < L_.ng; ++b) {
          const uint8_t* blk = row + bb * size_t(b);
          f16_t d, m;
          std::memcpy(&d, blk, sizeof d);
          kvg_store_f16(tp, size_t(b * 16 + j), d);
          if (has_m) {
            std::memcpy(&m, blk + 2, sizeof m);
            kvg_store_f16(tp + L_.min_off, size_t(b * 16 + j), m);
          }
          const uint8_t* qs = blk + (has_m ? 4 : 2) + (five ? 4 : 0);
          uint32_t qh = 0;
          if (five) std::memcpy(&qh, qs - 4, 4);
          for (int i = 0; i < 16; ++i) {
            c[32 * b + i] = uint8_t((qs[i] & 15) | ((qh >> i) & 1) << 4);
            c[32 * b + 16 + i] = uint8_t((qs[i] >> 4) | ((qh >> (16 + i)) & 1) << 4);
          }
        }
      }
      uint8_t* codes = tp + L_.code_off;
      if (role_ == KvRole::key) {
        for (int o = 0; o < hd / 8; ++o)
          for (int k = 0; k < 4; ++k)
            codes[ub * size_t(o / 4) + 64 * size_t(o % 4) + 4 * size_t(j) + size_t(k)] =
                uint8_t((c[8 * o + k] & 15) | (c[8 * o + 4 + k] & 15) << 4);
        if (L_.code_bits == 5)
          for (int b = 0; b < hd / 32; ++b)
            for (int k = 0; k < 4; ++k) {
              int v = 0;
              for (int oo = 0; oo < 4; ++oo)
                for (int nib = 0; nib < 2; ++nib) v |= (c[32 * b + 8 * oo + 4 * nib + k] >> 4) << (2 * oo + nib);
              codes[ub * size_t(b) + 256 + 32 * size_t(j / 8) + 4 * size_t(j % 8) + size_t(k)] = uint8_t(v);
            }
      } else {
        const int k = j / 4, m = j % 4;
        for (int ch = 0; ch < hd / 32; ++ch)
          for (int i = 0; i < 16; ++i)
            codes[ub * size_t(ch) + 64 * size_t(k) + 4 * size_t(i) + size_t(m)] =
                uint8_t((c[32 * ch + i] & 15) | (c[32 * ch + 16 + i] & 15) << 4);
        if (L_.code_bits == 5)  // channels r and 16 + r share a byte: bits k and 4 + k
          for (int ch = 0; ch < hd / 32; ++ch)
            for (int r = 0; r < 16; ++r) {
              uint8_t& byte = codes[ub * size_t(ch) + 256 + 32 * size_t(r / 8) + 4 * size_t(r % 8) + size_t(m)];
              const int mine = (1 << k) | (1 << (4 + k));
              byte = uint8_t((byte & ~mine) | (c[32 * ch + r] >> 4) << k | (c[32 * ch + 16 + r] >> 4) << (4 + k));
            }
      }
    }
  }

  void decode(int, const uint8_t* block, int block_tokens, int t0, int n, int, float* dst) const override {
    check_block(block_tokens);
    kv_check_token_range(info().name, block_tokens, t0, n);
    const int hd = L_.hd;
    const bool five = L_.code_bits == 5;
    const auto code_of = role_ == KvRole::key ? (five ? int5t_key_code : int4t_key_code)
                                              : (five ? int5t_value_code : int4t_value_code);
    for (int t = 0; t < n; ++t) {
      const int tt = t0 + t, j = tt % kv_tile_tokens;
      const uint8_t* tp = block + size_t(tt / kv_tile_tokens) * L_.tile_bytes;
      const uint8_t* codes = tp + L_.code_off;
      float* x = dst + size_t(t) * size_t(hd);
      for (int e = 0; e < hd; ++e) {
        const int c = code_of(codes, j, e), g = e / L_.group;
        const float s = tile_f16(tp, size_t(g * 16 + j));
        // The same values as the rows' decode (c * d is exact, so q4_1's / q5_1's c * d + m rounds
        // once, as the FMA does): bit-identical.
        switch (row_.elem) {
          case KvElem::q4_0: x[e] = float(c - 8) * s; break;
          case KvElem::q5_0: x[e] = float(c - 16) * s; break;
          case KvElem::iq4_nl: x[e] = s * float(kv_iq4nl_grid[c]); break;
          default: x[e] = std::fma(float(c), s, tile_f16(tp + L_.min_off, size_t(g * 16 + j))); break;
        }
      }
    }
  }

 private:
  KvRowFmt row_;  // the row format whose quantizer the tiles hold
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
  // llama.cpp's types in these tiles: quantization, bytes and decode theirs.
  struct Ggml {
    const char* name;
    KvElem elem;
    const char* bits;
  };
  for (const Ggml g : {Ggml{"q4_0", KvElem::q4_0, "4.5"}, Ggml{"q4_1", KvElem::q4_1, "5"},
                       Ggml{"q5_0", KvElem::q5_0, "5.5"}, Ggml{"q5_1", KvElem::q5_1, "6"},
                       Ggml{"iq4_nl", KvElem::iq4_nl, "4.5"}}) {
    const std::string name = std::string(g.name) + "t";
    const std::string what = fmt::format("llama.cpp {}'s quantization, bytes and decode in {}-token tiles for "
                                         "integer-dot kernels",
                                         g.name, kv_tile_tokens);
    const KvElem e = g.elem;
    const std::string rows = g.name;
    kv_register_codec({name, what, [name, rows, e](const KvCodecParams& p) -> std::unique_ptr<KvCodec> {
                         if (p.head_dim % 32 != 0 || p.head_dim > kv_max_head_dim)
                           fail("KV codec '{}': head_dim {} must be a multiple of 32 ({}'s blocks), at most {}", name,
                                p.head_dim, rows, kv_max_head_dim);
                         return std::make_unique<Int4TiledCodec>(name, p.role, p.head_dim, e);
                       }});
    kv_register_format({name, {}, name, name, fmt::format("{}: {} bits", what, g.bits)});
  }
}

}  // namespace kvq
