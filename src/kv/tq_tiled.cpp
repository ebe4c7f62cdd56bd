// tq4t: TurboQuant 4-bit in int4t's tiles (layout, arithmetic and error bounds in kv/tq_tiled.h):
// the layout, query preparation, scalar reference kernels, dispatch, codec and registration.
#include "kv/tq_tiled.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>

#include "core/cpu.h"
#include "core/dtypes.h"
#include "core/error.h"
#include "kv/grouped_common.h"
#include "kv/registry_internal.h"
#include "kv/tiles_ref.h"
#include "kv/turboquant.h"

namespace kvq {

Int4TiledLayout tq4t_layout(int hd, const float* cb, float* cs) {
  Int4TiledLayout L = int4t_layout(hd, hd);  // one group: the norm is the token's only scale
  L.min_off = 0;                              // no min table: the min terms are scaled by 0
  L.code_off = 32;
  L.tile_bytes = L.code_off + size_t(8 * hd);
  L.min_mul = 0.f;
  L.lut = true;
  float m = 0;
  for (int i = 0; i < 16; ++i) m = std::max(m, std::fabs(cb[i]));
  KVQ_CHECK(m > 0 && std::isfinite(m), "tq4t codebook max {}", m);
  *cs = m / 127.f;
  for (int i = 0; i < 16; ++i) L.lut8[i] = int8_t(std::clamp(std::nearbyint(cb[i] / *cs), -127.f, 127.f));
  L.corr_off = L.qsum_off + L.ng;
  L.qdim = L.corr_off + hd / 32;
  return L;
}

void tq4t_prepare_query(const Int4TiledLayout& L, float cs, const float* rq, int n_q, float* qp) {
  for (int i = 0; i < n_q; ++i) {
    float* row = qp + size_t(i) * size_t(L.qdim);
    int4t_prepare_query(L, rq + size_t(i) * size_t(L.hd), 1, row);  // the rotated query, q8, dq, qsum (x 0)
    float* dq = row + L.dq_off;
    const auto* q8 = reinterpret_cast<const int8_t*>(row + L.q8_off);
    auto* corr = reinterpret_cast<int32_t*>(row + L.corr_off);
    for (int b = 0; b < L.hd / 32; ++b) {
      int32_t s = 0;
      for (int j = 0; j < 32; ++j) s += q8[32 * b + j];
      corr[b] = 128 * s;
      dq[b] *= cs;
    }
  }
}

void tq4t_scores_ref(const Int4TiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n,
                     float* out, int out_stride) {
  tiles_scores_ref(L, qp, n_q, block, t0, n, out, out_stride,
                   [&L](const uint8_t* codes, int j, int b, const int8_t* q8) {
                     int32_t dot = 0;
                     for (int o = 4 * b; o < 4 * b + 4; ++o)
                       for (int k = 0; k < 4; ++k) {
                         const uint8_t byte = codes[64 * o + 4 * j + k];
                         dot += int32_t(L.lut8[byte & 15]) * q8[8 * o + k] + int32_t(L.lut8[byte >> 4]) * q8[8 * o + 4 + k];
                       }
                     return dot;
                   });
}

void tq4t_accum_signed_ref(const Int4TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block,
                           int t0, int n, float* acc) {
  for (int t = 0; t < n; ++t) {
    const int tt = t0 + t, j = tt % kv_tile_tokens;
    const uint8_t* tp = block + size_t(tt / kv_tile_tokens) * L.tile_bytes;
    const float norm = tile_f16(tp, size_t(j));
    for (int i = 0; i < n_q; ++i) {
      const float w = p[size_t(i) * size_t(p_stride) + size_t(t)] * norm;
      float* a = acc + size_t(i) * size_t(L.hd);
      for (int d = 0; d < L.hd; ++d) a[d] = std::fma(w, float(L.lut8[int4t_value_code(tp + L.code_off, j, d)]), a[d]);
    }
  }
}

void tq4t_accum_ref(const Int4TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block, int t0,
                    int n, float* acc) {
  if (!int4t_weights_nonneg(p, p_stride, n_q, n)) return tq4t_accum_signed_ref(L, p, p_stride, n_q, block, t0, n, acc);
  tiles_accum_ref(L, p, p_stride, n_q, block, t0, n, acc,
                  [&L](const uint8_t* codes, int j, int d) { return int(L.lut8[int4t_value_code(codes, j, d)]); });
}

void tq4t_scores(const Int4TiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n, float* out,
                 int out_stride) {
  KVQ_CPU_PICK(tq4t_scores)(L, qp, n_q, block, t0, n, out, out_stride);
}
void tq4t_accum(const Int4TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block, int t0, int n,
                float* acc) {
  KVQ_CPU_PICK(tq4t_accum)(L, p, p_stride, n_q, block, t0, n, acc);
}

namespace {

// The tq4 codec of the same parameters (same rotation seed) does the quantization, the rotation
// of queries and outputs and the reference decode; this codec moves its records into tiles.
class Tq4TiledCodec final : public KvCodec {
 public:
  Tq4TiledCodec(const KvCodecParams& p)
      : inner_(tq_codec_create("tq4", TqConfig{4, false, TqRotationKind::hadamard}, p)), role_(p.role) {
    const int hd = p.head_dim;
    const TqCodebook& cb = tq_lloyd_max(4, hd);
    std::copy(cb.centroids.begin(), cb.centroids.end(), cb_);
    L_ = tq4t_layout(hd, cb_, &cs_);
    info_ = inner_->info();
    info_.name = "tq4t";
  }
  const KvCodecInfo& info() const override { return info_; }
  int head_dim() const override { return L_.hd; }
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

  // tq4's record of each token (norm, then 4-bit codes of channel pairs), scattered into the tile.
  void encode(int head, const float* src, size_t src_stride, int n, uint8_t* block, int block_tokens, int t0,
              int pos0) const override {
    check_range(block_tokens, t0, n);
    const int hd = L_.hd;
    uint8_t rec[2 + kv_max_head_dim / 2], c[kv_max_head_dim];
    for (int t = 0; t < n; ++t) {
      inner_->encode(head, src + size_t(t) * src_stride, src_stride, 1, rec, 1, 0, pos0 + t0 + t);
      const int tt = t0 + t, j = tt % kv_tile_tokens;
      uint8_t* tp = block + size_t(tt / kv_tile_tokens) * L_.tile_bytes;
      std::memcpy(tp + 2 * size_t(j), rec, 2);
      tq_unpack_codes(rec + 2, hd, 4, c);
      uint8_t* codes = tp + L_.code_off;
      if (role_ == KvRole::key) {
        for (int o = 0; o < hd / 8; ++o)
          for (int k = 0; k < 4; ++k) codes[64 * o + 4 * j + k] = uint8_t(c[8 * o + k] | c[8 * o + 4 + k] << 4);
      } else {
        for (int ch = 0; ch < hd / 32; ++ch)
          for (int i = 0; i < 16; ++i)
            codes[64 * (4 * ch + j / 4) + 4 * i + j % 4] = uint8_t(c[32 * ch + i] | c[32 * ch + 16 + i] << 4);
      }
    }
  }

  // The record rebuilt from the tile and decoded by tq4: bit-identical to tq4's decode.
  void decode(int head, const uint8_t* block, int block_tokens, int t0, int n, int pos0, float* dst) const override {
    check_range(block_tokens, t0, n);
    const int hd = L_.hd;
    uint8_t rec[2 + kv_max_head_dim / 2], c[kv_max_head_dim];
    for (int t = 0; t < n; ++t) {
      const int tt = t0 + t;
      const uint8_t* tp = tile_codes(block, tt, c);
      std::memcpy(rec, tp + 2 * size_t(tt % kv_tile_tokens), 2);
      tq_pack_codes(c, hd, 4, rec + 2);
      inner_->decode(head, rec, 1, 0, 1, pos0 + tt, dst + size_t(t) * size_t(hd));
    }
  }

  int prepared_query_dim() const override { return L_.qdim; }
  void prepare_query(int head, const float* q, int n_q, float* qp) const override {
    for (int i = 0; i < n_q; ++i) inner_->prepare_query(head, q + size_t(i) * size_t(L_.hd), 1, qp + size_t(i) * size_t(L_.qdim));
    for (int i = 0; i < n_q; ++i) {
      float* row = qp + size_t(i) * size_t(L_.qdim);
      tq4t_prepare_query(L_, cs_, row, 1, row);
    }
  }

  void scores(int head, const float* qp, int n_q, const uint8_t* block, int block_tokens, int t0, int n, int pos0,
              float* out, int out_stride) const override {
    (void)head;
    (void)pos0;
    check_range(block_tokens, t0, n);
    if (role_ == KvRole::key) return tq4t_scores(L_, qp, n_q, block, t0, n, out, out_stride);
    // A value-layout block (not asked to score in attention): f32 dots in the rotated basis.
    float y[kv_max_head_dim];
    for (int t = 0; t < n; ++t) {
      rotated(block, t0 + t, y);
      for (int i = 0; i < n_q; ++i) {
        const float* r = qp + size_t(i) * size_t(L_.qdim);
        float s = 0;
        for (int d = 0; d < L_.hd; ++d) s += r[d] * y[d];
        out[size_t(i) * size_t(out_stride) + size_t(t)] = s;
      }
    }
  }

  void accumulate(int head, const float* p, int p_stride, int n_q, const uint8_t* block, int block_tokens, int t0,
                  int n, float* acc) const override {
    (void)head;
    check_range(block_tokens, t0, n);
    const int hd = L_.hd;
    // The accumulator is kept in codebook-image units (the storage basis is R v / cs); finish_output
    // multiplies by cs before rotating back.
    if (role_ == KvRole::value) return tq4t_accum(L_, p, p_stride, n_q, block, t0, n, acc);
    float y[kv_max_head_dim];  // a key-layout block: f32 sums in the same basis
    for (int t = 0; t < n; ++t) {
      rotated(block, t0 + t, y);
      for (int i = 0; i < n_q; ++i) {
        const float w = p[size_t(i) * size_t(p_stride) + size_t(t)] / cs_;
        float* a = acc + size_t(i) * size_t(hd);
        for (int d = 0; d < hd; ++d) a[d] += w * y[d];
      }
    }
  }

  void finish_output(int head, float* acc, int n_q) const override {
    for (size_t i = 0; i < size_t(n_q) * size_t(L_.hd); ++i) acc[i] *= cs_;
    inner_->finish_output(head, acc, n_q);
  }

 private:
  void check_block(int block_tokens) const {
    if (block_tokens <= 0 || block_tokens % kv_tile_tokens != 0)
      fail("KV codec 'tq4t': block of {} tokens; this codec stores 16-token tiles, so the block (page) size must be a "
           "positive multiple of 16",
           block_tokens);
  }
  void check_range(int block_tokens, int t0, int n) const {
    check_block(block_tokens);
    KVQ_CHECK(t0 >= 0 && n >= 0 && t0 + n <= block_tokens, "t0 {} n {} block {}", t0, n, block_tokens);
  }
  // Codes of block slot tt -> c (hd); returns its tile.
  const uint8_t* tile_codes(const uint8_t* block, int tt, uint8_t* c) const {
    const int j = tt % kv_tile_tokens;
    const uint8_t* tp = block + size_t(tt / kv_tile_tokens) * L_.tile_bytes;
    const uint8_t* codes = tp + L_.code_off;
    for (int d = 0; d < L_.hd; ++d)
      c[d] = uint8_t(role_ == KvRole::key ? int4t_key_code(codes, j, d) : int4t_value_code(codes, j, d));
    return tp;
  }
  // Slot tt in the rotated basis: norm * centroid.
  void rotated(const uint8_t* block, int tt, float* y) const {
    uint8_t c[kv_max_head_dim];
    const uint8_t* tp = tile_codes(block, tt, c);
    const float norm = tile_f16(tp, size_t(tt % kv_tile_tokens));
    for (int d = 0; d < L_.hd; ++d) y[d] = norm * cb_[c[d]];
  }

  std::unique_ptr<KvCodec> inner_;
  KvRole role_;
  float cb_[16] = {};
  float cs_ = 1;
  Int4TiledLayout L_;
  KvCodecInfo info_;
};

}  // namespace

bool tq4t_fits(int head_dim) { return head_dim > 0 && head_dim % 32 == 0 && head_dim <= kv_max_head_dim; }

std::unique_ptr<KvCodec> tq4t_codec_create(const KvCodecParams& p) {
  if (!tq4t_fits(p.head_dim))
    fail("KV codec 'tq4t': head_dim {} must be a multiple of 32 (the tiles' query blocks), at most {}; tq4_rows "
         "stores any multiple of 16",
         p.head_dim, kv_max_head_dim);
  return std::make_unique<Tq4TiledCodec>(p);
}

void kv_register_tq_tiled() {
  kv_register_codec({"tq4t", "TurboQuant 4 bits (tq4's codes, norm and decode) in 16-token tiles for integer-dot kernels",
                     tq4t_codec_create});
  kv_register_format({"tq4t", {}, "tq4t", "tq4t",
                      "TurboQuant 4 bits K and V (tq4's codes, norm and decode) in 16-token tiles for integer-dot "
                      "kernels (+16/head_dim for the norm)"});
}

}  // namespace kvq
