// fp8t: the tiled fp8 codecs (layout and arithmetic in kv/fp8_tiled.h), their scalar reference
// kernels, the dispatch points and the registration.
#include "kv/fp8_tiled.h"

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

#include "core/cpu.h"
#include "core/dtypes.h"
#include "core/error.h"
#include "kv/calib.h"
#include "kv/fp8.h"
#include "kv/grouped_common.h"
#include "kv/int4_tiled.h"
#include "kv/kv_rows.h"
#include "kv/registry_internal.h"
#include "kv/tiled_codec.h"

namespace kvq {

Fp8TiledLayout fp8t_layout(int hd, bool e4m3, bool token_scales) {
  KVQ_CHECK(hd >= 32 && hd % 32 == 0 && hd <= kv_max_head_dim, "head_dim {}", hd);
  Fp8TiledLayout L;
  L.hd = hd;
  L.e4m3 = e4m3;
  L.token_scales = token_scales;
  L.code_off = token_scales ? 64 : 0;
  L.tile_bytes = L.code_off + size_t(16 * hd);
  L.qdim = hd + hd / 2;
  return L;
}

float fp8t_mult(const Fp8TiledLayout& L, const uint8_t* tile, int j) {
  if (!L.token_scales) return L.scale;
  float s;
  std::memcpy(&s, tile + 4 * size_t(j), 4);
  return s;
}

void fp8t_prepare_query(const Fp8TiledLayout& L, const float* q, int n_q, float* qp) {
  for (int i = 0; i < n_q; ++i) {
    const float* x = q + size_t(i) * size_t(L.hd);
    float* row = qp + size_t(i) * size_t(L.qdim);
    std::memcpy(row, x, sizeof(float) * size_t(L.hd));
    auto* qb = reinterpret_cast<uint16_t*>(row + L.hd);
    for (int d = 0; d < L.hd; ++d) qb[d] = f32_to_bf16(x[d]);
  }
}

namespace {

// What VDPBF16PS does with one bf16 operand: inputs below 2^-126 in magnitude count as 0.
inline float bf16_daz(uint16_t b) {
  const float v = bf16_to_f32(b);
  return std::fabs(v) < float(kv_rows_bf16_flush) ? 0.f * v : v;
}
// One lane of VDPBF16PS: acc + the odd products, then the even ones (each product exact in f32).
inline float dp_lane(float acc, float a0, float b0, float a1, float b1) { return (acc + a1 * b1) + a0 * b0; }

inline const float* fp8t_table(const Fp8TiledLayout& L) { return L.e4m3 ? fp8_e4m3_table() : fp8_e5m2_table(); }

}  // namespace

void fp8t_scores_ref(const Fp8TiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n,
                     float* out, int out_stride) {
  const float* tab = fp8t_table(L);
  for (int i = 0; i < n_q; ++i) {
    const uint16_t* qb = fp8t_query_bf16(L, qp, i);
    for (int t = 0; t < n; ++t) {
      const int tt = t0 + t, j = tt % kv_tile_tokens;
      const uint8_t* tp = block + size_t(tt / kv_tile_tokens) * L.tile_bytes;
      const uint8_t* codes = tp + L.code_off;
      const auto k = [&](int d) { return tab[codes[fp8t_key_pos(j, d)]]; };
      float a = 0, b = 0;  // the A and B vectors' sums
      for (int u = 0; u < L.hd / 4; ++u) {
        const int d = 4 * u;
        a = dp_lane(a, k(d), bf16_daz(qb[d]), k(d + 1), bf16_daz(qb[d + 1]));
        b = dp_lane(b, k(d + 2), bf16_daz(qb[d + 2]), k(d + 3), bf16_daz(qb[d + 3]));
      }
      out[size_t(i) * size_t(out_stride) + size_t(t)] = (a + b) * fp8t_mult(L, tp, j);
    }
  }
}

void fp8t_accum_ref(const Fp8TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block, int t0,
                    int n, float* acc) {
  if (n <= 0) return;
  const int hd = L.hd;
  const float* tab = fp8t_table(L);
  const int tile0 = t0 / kv_tile_tokens, tile1 = (t0 + n + kv_tile_tokens - 1) / kv_tile_tokens;
  float facc[kv_max_head_dim];
  for (int i = 0; i < n_q; ++i) {
    const float* pi = p + size_t(i) * size_t(p_stride);
    std::fill(facc, facc + hd, 0.f);
    for (int tile = tile0; tile < tile1; ++tile) {
      const uint8_t* tp = block + size_t(tile) * L.tile_bytes;
      const uint8_t* codes = tp + L.code_off;
      // Weights p_t * mult_t in bf16; tokens outside the range weigh 0 and their codes read as 0.
      float w[kv_tile_tokens];
      bool valid[kv_tile_tokens];
      for (int j = 0; j < kv_tile_tokens; ++j) {
        const int t = tile * kv_tile_tokens + j - t0;
        valid[j] = t >= 0 && t < n;
        w[j] = valid[j] ? bf16_daz(f32_to_bf16(pi[t] * fp8t_mult(L, tp, j))) : 0.f;
      }
      for (int d = 0; d < hd; ++d) {
        const auto v = [&](int j) { return valid[j] ? tab[codes[fp8t_value_pos(j, d)]] : 0.f; };
        for (int m = 0; m < kv_tile_tokens / 2; ++m)
          facc[d] = dp_lane(facc[d], v(2 * m), w[2 * m], v(2 * m + 1), w[2 * m + 1]);
      }
    }
    float* a = acc + size_t(i) * size_t(hd);
    for (int d = 0; d < hd; ++d) a[d] += facc[d];
  }
}

void fp8t_scores(const Fp8TiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n, float* out,
                 int out_stride) {
  KVQ_CPU_PICK(fp8t_scores)(L, qp, n_q, block, t0, n, out, out_stride);
}

void fp8t_accum(const Fp8TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block, int t0, int n,
                float* acc) {
  KVQ_CPU_PICK(fp8t_accum)(L, p, p_stride, n_q, block, t0, n, acc);
}

namespace {

#if defined(KVQ_HAVE_SIMD)
using Fp8tSpans = TiledSpansAvx512<Fp8TiledLayout, fp8t_scores_spans_avx512, fp8t_accum_spans_avx512>;
#else
using Fp8tSpans = void;
#endif
using Fp8tOps = TiledOps<Fp8TiledLayout, fp8t_prepare_query, fp8t_scores, fp8t_accum, true, Fp8tSpans>;

KvElem row_elem(bool e4m3, bool token_scales) {
  if (token_scales) return e4m3 ? KvElem::e4m3_dyn : KvElem::e5m2_dyn;
  return e4m3 ? KvElem::e4m3 : KvElem::e5m2;
}

class Fp8TiledCodec final : public TiledCodecBase<Fp8TiledLayout, Fp8tOps> {
 public:
  // head_scales: the calibrated formats' per-head multipliers (empty: 1.0 for every head).
  Fp8TiledCodec(const std::string& name, KvRole role, int hd, bool e4m3, bool token_scales, int n_kv_heads,
                std::vector<float> head_scales)
      : TiledCodecBase(name, 8, role, fp8t_layout(hd, e4m3, token_scales)), row_(kv_row_fmt(row_elem(e4m3, token_scales), hd)) {
    if (head_scales.empty()) head_scales.assign(size_t(std::max(1, n_kv_heads)), 1.f);
    for (float s : head_scales) {
      heads_.push_back(L_);
      heads_.back().scale = token_scales ? 1.f : s;
    }
  }

  // Each token is quantized by the fp8 rows' encoder (codes and scale are theirs exactly), then
  // scattered into its tile.
  void encode(int head, const float* src, size_t src_stride, int n, uint8_t* block, int block_tokens, int t0,
              int) const override {
    check_block(block_tokens);
    kv_check_token_range(info().name, block_tokens, t0, n);
    const Fp8TiledLayout& L = head_layout(head);
    const int hd = L.hd;
    uint8_t row[sizeof(KvRowScaled) + kv_max_head_dim];
    for (int t = 0; t < n; ++t) {
      kv_row_encode(row_, L.scale, src + size_t(t) * src_stride, row);
      const int tt = t0 + t, j = tt % kv_tile_tokens;
      uint8_t* tp = block + size_t(tt / kv_tile_tokens) * L.tile_bytes;
      const uint8_t* c = row;
      if (L.token_scales) {
        std::memcpy(tp + 4 * size_t(j), row, 4);
        c += sizeof(KvRowScaled);
      }
      uint8_t* codes = tp + L.code_off;
      for (int d = 0; d < hd; ++d) codes[role_ == KvRole::key ? fp8t_key_pos(j, d) : fp8t_value_pos(j, d)] = c[d];
    }
  }

  void decode(int head, const uint8_t* block, int block_tokens, int t0, int n, int, float* dst) const override {
    check_block(block_tokens);
    kv_check_token_range(info().name, block_tokens, t0, n);
    const Fp8TiledLayout& L = head_layout(head);
    const float* tab = L.e4m3 ? fp8_e4m3_table() : fp8_e5m2_table();
    for (int t = 0; t < n; ++t) {
      const int tt = t0 + t, j = tt % kv_tile_tokens;
      const uint8_t* tp = block + size_t(tt / kv_tile_tokens) * L.tile_bytes;
      const uint8_t* codes = tp + L.code_off;
      const float s = fp8t_mult(L, tp, j);
      float* x = dst + size_t(t) * size_t(L.hd);
      // the rows' decode expression (table value times the scale): bit-identical values
      for (int d = 0; d < L.hd; ++d)
        x[d] = tab[codes[role_ == KvRole::key ? fp8t_key_pos(j, d) : fp8t_value_pos(j, d)]] * s;
    }
  }

 protected:
  const Fp8TiledLayout& head_layout(int head) const override {
    if (head < 0 || size_t(head) >= heads_.size())
      fail("{}: KV head {} is outside the codec's {} heads (KvCodecParams::n_kv_heads)", info().name, head,
           heads_.size());
    return heads_[size_t(head)];
  }

 private:
  KvRowFmt row_;  // the fp8 rows' format: the encoder
  std::vector<Fp8TiledLayout> heads_;  // L_ with each head's scale
};

}  // namespace

// Codecs fp8_e4m3t, fp8_e5m2t (scale 1.0), fp8_e4m3t_static, fp8_e5m2t_static (calibrated per
// head, kv/calib.h, under the rows' calibration keys) and fp8_e4m3t_dyn, fp8_e5m2t_dyn (per-token
// scale): what the fp8 formats store where head_dim % 32 == 0 (kv/fp8_codecs.cpp).
void kv_register_fp8_tiled() {
  for (bool e4m3 : {true, false})
    for (int mode = 0; mode < 3; ++mode) {
      const std::string kind = e4m3 ? "e4m3" : "e5m2";
      const std::string suffix = mode == 0 ? "" : mode == 1 ? "_static" : "_dyn";
      const std::string name = "fp8_" + kind + "t" + suffix, rows = "fp8_" + kind + suffix + "_rows";
      const std::string what = fmt::format("the fp8_{}{} codes and scales in 16-token tiles for VDPBF16PS kernels",
                                           kind, suffix);
      const std::string fmt_name = "fp8_" + kind + suffix;  // the format users name (calibration messages)
      kv_register_codec({name, what, [name, rows, fmt_name, e4m3, mode](const KvCodecParams& p) -> std::unique_ptr<KvCodec> {
                           if (p.head_dim % 32 != 0 || p.head_dim > kv_max_head_dim)
                             fail("KV codec '{}': head_dim {} must be a multiple of 32 (at most {}); use '{}'", name,
                                  p.head_dim, kv_max_head_dim, rows);
                           std::vector<float> scales;
                           if (mode == 1) scales = kv_calib_head_scales(p, fmt_name);
                           return std::make_unique<Fp8TiledCodec>(name, p.role, p.head_dim, e4m3, mode == 2,
                                                                  p.n_kv_heads, std::move(scales));
                         }});
    }
}

}  // namespace kvq
