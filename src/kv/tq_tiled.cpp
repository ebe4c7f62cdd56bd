// TurboQuant codes in 16-token tiles (layout, arithmetic and error bounds in kv/tq_tiled.h): the
// layout, code access, query preparation, scalar reference kernels, dispatch, codecs and registration.
#include "kv/tq_tiled.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "core/cpu.h"
#include "core/dtypes.h"
#include "core/error.h"
#include "kv/grouped_common.h"
#include "kv/tiled_codec.h"
#include "kv/tiles_ref.h"
#include "kv/turboquant.h"

namespace kvq {

bool tq_tiled_fits(int hd, int n_hi, int bits_hi, int bits_lo) {
  const auto ok = [](int b) { return b >= 2 && b <= 4; };
  if (hd <= 0 || hd % 32 != 0 || hd > kv_max_head_dim || n_hi <= 0 || n_hi > hd || n_hi % 32 != 0) return false;
  return ok(bits_hi) && (n_hi == hd || ok(bits_lo));
}

TqTiledLayout tq_tiled_layout(int hd, int n_hi, int bits_hi, int bits_lo, const float* cb_hi, const float* cb_lo) {
  if (!tq_tiled_fits(hd, n_hi, bits_hi, bits_lo))
    fail("TurboQuant tiles: head_dim {} with channels [0, {}) at {} bits and the rest at {} do not fit (head_dim a "
         "multiple of 32 up to {}, segments of whole 32-channel blocks, 2 to 4 bits)",
         hd, n_hi, bits_hi, bits_lo, kv_max_head_dim);
  TqTiledLayout L;
  L.hd = hd;
  L.nseg = n_hi < hd ? 2 : 1;
  size_t off = 32;  // the norms
  for (int s = 0; s < L.nseg; ++s) {
    TqTileSeg& g = L.seg[s];
    g.ch0 = s == 0 ? 0 : n_hi;
    g.nch = s == 0 ? n_hi : hd - n_hi;
    g.bits = s == 0 ? bits_hi : bits_lo;
    g.off = off;
    off += size_t(2 * g.nch * g.bits);
    const float* cb = s == 0 ? cb_hi : cb_lo;
    const int nc = 1 << g.bits;
    float m = 0;
    for (int i = 0; i < nc; ++i) m = std::max(m, std::fabs(cb[i]));
    KVQ_CHECK(m > 0 && std::isfinite(m), "TurboQuant tiles: codebook max {}", m);
    g.cs = m / 127.f;
    for (int i = 0; i < nc; ++i) g.lut8[i] = int8_t(std::clamp(std::nearbyint(cb[i] / g.cs), -127.f, 127.f));
    for (int b = g.ch0 / 32; b < (g.ch0 + g.nch) / 32; ++b) L.block_seg[b] = uint8_t(s);
  }
  L.tile_bytes = off;
  L.q8_off = hd;
  L.dq_off = hd + hd / 4;
  L.corr_off = L.dq_off + hd / 32;
  L.qdim = L.corr_off + hd / 32;
  // int4t's layout of one group of hd channels (its query offsets are the ones above), read as:
  // the norm the token's scale, no min table (min_mul 0), code bytes from the tile start.
  Int4TiledLayout& V = L.values;
  V = int4t_layout(hd, hd);
  V.min_off = 0;
  V.code_off = 0;
  V.tile_bytes = L.tile_bytes;
  V.min_mul = 0.f;
  V.qdim = L.qdim;  // row stride of the prepared query
  KVQ_CHECK(V.q8_off == L.q8_off && V.dq_off == L.dq_off && V.qsum_off == L.corr_off, "tq tiles: query offsets");
  return L;
}

namespace {

// Where code (role, slot j, channel d) lives: the byte and shift of its low bits (all of them for
// 2 and 4 bits) and, for 3 bits, the byte and bit of its high bit.
struct CodeAt {
  size_t byte;
  int shift, mask;
  size_t hbyte = 0;
  int hbit = -1;
};
CodeAt code_at(const TqTiledLayout& L, KvRole role, int j, int d) {
  const TqTileSeg& g = L.seg[L.block_seg[d / 32]];
  const int dl = d - g.ch0, w = dl % 32;
  const size_t base = g.off + size_t(dl / 32) * size_t(64 * g.bits);
  CodeAt a{};
  if (role == KvRole::key) {
    if (g.bits == 4) return {base + size_t(64 * (w / 8) + 4 * j + w % 4), (w % 8) / 4 * 4, 15};
    a = {base + size_t(64 * (w / 16) + 4 * j + w % 4), 2 * ((w % 16) / 4), 3};
    if (g.bits == 3) {
      a.hbyte = base + 128 + size_t(4 * j + w % 4);
      a.hbit = (w % 16) / 4 + 4 * (w / 16);
    }
    return a;
  }
  if (g.bits == 4) return {base + size_t(64 * (j / 4) + 4 * (w % 16) + j % 4), (w / 16) * 4, 15};
  const int ko = j / 8, jj = j % 8, p = 2 * (jj / 4) + w / 16;
  a = {base + size_t(64 * ko + 4 * (w % 16) + jj % 4), 2 * p, 3};
  if (g.bits == 3) {
    a.hbyte = base + 128 + size_t(4 * (w % 16) + jj % 4);
    a.hbit = p + 4 * ko;
  }
  return a;
}

float tile_norm(const uint8_t* tp, int j) { return tile_f16(tp, size_t(j)); }

}  // namespace

int tq_tiled_code(const TqTiledLayout& L, KvRole role, const uint8_t* tp, int j, int d) {
  const CodeAt a = code_at(L, role, j, d);
  int c = (tp[a.byte] >> a.shift) & a.mask;
  if (a.hbit >= 0) c |= ((tp[a.hbyte] >> a.hbit) & 1) << 2;
  return c;
}

void tq_tiled_prepare_query(const TqTiledLayout& L, const float* rq, int n_q, float* qp) {
  // int4t's int8 image of the query per 32-dim block (L.values has its offsets), then the steps
  // times the block's image step and the per-block corrections.
  int4t_prepare_query(L.values, rq, n_q, qp);
  for (int i = 0; i < n_q; ++i) {
    float* row = qp + size_t(i) * size_t(L.qdim);
    const auto* q8 = reinterpret_cast<const int8_t*>(row + L.q8_off);
    float* dq = row + L.dq_off;
    auto* corr = reinterpret_cast<int32_t*>(row + L.corr_off);
    for (int b = 0; b < L.hd / 32; ++b) {
      int32_t s = 0;
      bool finite = true;
      for (int j = 0; j < 32; ++j) {
        s += q8[32 * b + j];
        finite = finite && std::isfinite(row[32 * b + j]);
      }
      corr[b] = 128 * s;
      // A non-finite block has no int8 image (codes 0, step 0): its step becomes NaN, so the score
      // is NaN as the f32 dot would be.
      dq[b] = finite ? dq[b] * L.seg[L.block_seg[b]].cs : std::numeric_limits<float>::quiet_NaN();
    }
  }
}

void tq_tiled_scores_ref(const TqTiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n,
                         float* out, int out_stride) {
  for (int i = 0; i < n_q; ++i) {
    const float* row = qp + size_t(i) * size_t(L.qdim);
    const auto* q8 = reinterpret_cast<const int8_t*>(row + L.q8_off);
    const float* dq = row + L.dq_off;
    for (int t = 0; t < n; ++t) {
      const int tt = t0 + t, j = tt % kv_tile_tokens;
      const uint8_t* tp = block + size_t(tt / kv_tile_tokens) * L.tile_bytes;
      float facc = 0;
      for (int b = 0; b < L.hd / 32; ++b) {
        const int8_t* lut = L.seg[L.block_seg[b]].lut8;
        int32_t dot = 0;
        for (int d = 32 * b; d < 32 * b + 32; ++d) dot += int32_t(lut[tq_tiled_code(L, KvRole::key, tp, j, d)]) * q8[d];
        facc = std::fma(float(dot), dq[b], facc);
      }
      out[size_t(i) * size_t(out_stride) + size_t(t)] = facc * tile_norm(tp, j);
    }
  }
}

void tq_tiled_accum_signed_ref(const TqTiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block,
                               int t0, int n, float* acc) {
  for (int t = 0; t < n; ++t) {
    const int tt = t0 + t, j = tt % kv_tile_tokens;
    const uint8_t* tp = block + size_t(tt / kv_tile_tokens) * L.tile_bytes;
    const float norm = tile_norm(tp, j);
    for (int i = 0; i < n_q; ++i) {
      const float w = p[size_t(i) * size_t(p_stride) + size_t(t)] * norm;
      float* a = acc + size_t(i) * size_t(L.hd);
      for (int d = 0; d < L.hd; ++d)
        a[d] = std::fma(w, float(L.seg[L.block_seg[d / 32]].lut8[tq_tiled_code(L, KvRole::value, tp, j, d)]), a[d]);
    }
  }
}

void tq_tiled_accum_ref(const TqTiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block, int t0,
                        int n, float* acc) {
  if (!int4t_weights_nonneg(p, p_stride, n_q, n)) return tq_tiled_accum_signed_ref(L, p, p_stride, n_q, block, t0, n, acc);
  tiles_accum_ref(L.values, p, p_stride, n_q, block, t0, n, acc, [&L](const uint8_t* tp, int j, int d) {
    return int(L.seg[L.block_seg[d / 32]].lut8[tq_tiled_code(L, KvRole::value, tp, j, d)]);
  });
}

void tq_tiled_scores(const TqTiledLayout& L, const float* qp, int n_q, const uint8_t* block, int t0, int n,
                     float* out, int out_stride) {
  KVQ_CPU_PICK(tq_tiled_scores)(L, qp, n_q, block, t0, n, out, out_stride);
}
void tq_tiled_accum(const TqTiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block, int t0, int n,
                    float* acc) {
  KVQ_CPU_PICK(tq_tiled_accum)(L, p, p_stride, n_q, block, t0, n, acc);
}

namespace {

// TiledCodecBase's fused entry points; TqTiledCodec overrides them (the query is rotated first,
// and a block of the other role is served in f32).
#if defined(KVQ_HAVE_SIMD)
using TqTiledSpans = TiledSpansAvx512<TqTiledLayout, tq_tiled_scores_spans_avx512, tq_tiled_accum_spans_avx512>;
#else
using TqTiledSpans = void;
#endif
using TqTiledOps = TiledOps<TqTiledLayout, tq_tiled_prepare_query, tq_tiled_scores, tq_tiled_accum, true, TqTiledSpans>;

TqTiledLayout layout_for(const std::string& name, double bits, int hd) {
  int n_hi = 0, bh = 0, bl = 0;
  tq_split_bits(name, TqConfig{bits, false, TqRotationKind::hadamard}, hd, &n_hi, &bh, &bl);
  const auto& ch = tq_lloyd_max(bh, hd).centroids;
  const auto& cl = n_hi < hd ? tq_lloyd_max(bl, hd).centroids : ch;
  return tq_tiled_layout(hd, n_hi, bh, bl, ch.data(), cl.data());
}

// The record codec of the same parameters (same rotation seed) quantizes, rotates queries and
// outputs and decodes; this codec moves its records' norms and codes into tiles.
class TqTiledCodec final : public TiledCodecBase<TqTiledLayout, TqTiledOps> {
 public:
  TqTiledCodec(const std::string& name, double bits, const KvCodecParams& p)
      : TiledCodecBase(name, bits, p.role, layout_for(name, bits, p.head_dim)),
        inner_(tq_codec_create(name, TqConfig{bits, false, TqRotationKind::hadamard}, p)) {
    const int hd = p.head_dim;
    for (int d = 0; d < hd; ++d) cs_[d] = L_.seg[L_.block_seg[d / 32]].cs;
    // Where each (slot, channel) code lives, once: encode and decode touch hd codes per token.
    pos_.resize(size_t(kv_tile_tokens) * size_t(hd));
    for (int j = 0; j < kv_tile_tokens; ++j)
      for (int d = 0; d < hd; ++d) {
        const CodeAt a = code_at(L_, role_, j, d);
        pos_[size_t(j) * size_t(hd) + size_t(d)] = {uint16_t(a.byte), uint16_t(a.hbyte), uint8_t(a.shift),
                                                     uint8_t(a.mask), int8_t(a.hbit)};
      }
    for (int g = 0; g < L_.nseg; ++g) {
      const auto& cb = tq_lloyd_max(L_.seg[g].bits, hd).centroids;
      std::copy(cb.begin(), cb.end(), cb_[g]);
    }
    off_lo_ = 2 + L_.seg[0].nch * L_.seg[0].bits / 8;
    info_ = inner_->info();
    info_.name = name;
  }

  // The record of each token (norm, then the segments' codes), scattered into the tile.
  void encode(int head, const float* src, size_t src_stride, int n, uint8_t* block, int block_tokens, int t0,
              int pos0) const override {
    check_range(block_tokens, t0, n);
    uint8_t rec[2 + kv_max_head_dim / 2], c[kv_max_head_dim];
    for (int t = 0; t < n; ++t) {
      inner_->encode(head, src + size_t(t) * src_stride, src_stride, 1, rec, 1, 0, pos0 + t0 + t);
      const int tt = t0 + t, j = tt % kv_tile_tokens;
      uint8_t* tp = block + size_t(tt / kv_tile_tokens) * L_.tile_bytes;
      std::memcpy(tp + 2 * size_t(j), rec, 2);
      unpack(rec, c);
      const Pos* pj = pos_.data() + size_t(j) * size_t(L_.hd);
      for (int d = 0; d < L_.hd; ++d) {  // the other codes of shared bytes kept
        const Pos& a = pj[d];
        tp[a.byte] = uint8_t((tp[a.byte] & ~(a.mask << a.shift)) | ((c[d] & a.mask) << a.shift));
        if (a.hbit >= 0) tp[a.hbyte] = uint8_t((tp[a.hbyte] & ~(1 << a.hbit)) | (((c[d] >> 2) & 1) << a.hbit));
      }
    }
  }

  // The record rebuilt from the tile and decoded by the record codec: bit-identical to its decode.
  void decode(int head, const uint8_t* block, int block_tokens, int t0, int n, int pos0, float* dst) const override {
    check_range(block_tokens, t0, n);
    uint8_t rec[2 + kv_max_head_dim / 2], c[kv_max_head_dim];
    for (int t = 0; t < n; ++t) {
      const int tt = t0 + t, j = tt % kv_tile_tokens;
      const uint8_t* tp = block + size_t(tt / kv_tile_tokens) * L_.tile_bytes;
      codes(tp, j, c);
      std::memcpy(rec, tp + 2 * size_t(j), 2);
      const TqTileSeg& g0 = L_.seg[0];
      tq_pack_codes(c, g0.nch, g0.bits, rec + 2);
      if (L_.nseg > 1) tq_pack_codes(c + g0.nch, L_.seg[1].nch, L_.seg[1].bits, rec + off_lo_);
      inner_->decode(head, rec, 1, 0, 1, pos0 + tt, dst + size_t(t) * size_t(L_.hd));
    }
  }

  int prepared_query_dim() const override { return L_.qdim; }
  void prepare_query(int head, const float* q, int n_q, float* qp) const override {
    for (int i = 0; i < n_q; ++i) {
      float* row = qp + size_t(i) * size_t(L_.qdim);
      inner_->prepare_query(head, q + size_t(i) * size_t(L_.hd), 1, row);  // R q into the row's start
      tq_tiled_prepare_query(L_, row, 1, row);
    }
  }

  void scores(int head, const float* qp, int n_q, const uint8_t* block, int block_tokens, int t0, int n, int pos0,
              float* out, int out_stride) const override {
    (void)head;
    (void)pos0;
    check_range(block_tokens, t0, n);
    if (role_ == KvRole::key) return tq_tiled_scores(L_, qp, n_q, block, t0, n, out, out_stride);
    float y[kv_max_head_dim];  // a value-layout block (not asked to score in attention): f32 dots
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

  // The accumulator holds the sums in codebook-image units; finish_output multiplies by cs.
  void accumulate(int head, const float* p, int p_stride, int n_q, const uint8_t* block, int block_tokens, int t0,
                  int n, float* acc) const override {
    (void)head;
    check_range(block_tokens, t0, n);
    if (role_ == KvRole::value) return tq_tiled_accum(L_, p, p_stride, n_q, block, t0, n, acc);
    float y[kv_max_head_dim];  // a key-layout block: f32 sums in the same units
    for (int t = 0; t < n; ++t) {
      rotated(block, t0 + t, y);
      for (int i = 0; i < n_q; ++i) {
        const float w = p[size_t(i) * size_t(p_stride) + size_t(t)];
        float* a = acc + size_t(i) * size_t(L_.hd);
        for (int d = 0; d < L_.hd; ++d) a[d] += w * y[d] / cs_[d];
      }
    }
  }

  void finish_output(int head, float* acc, int n_q) const override {
    for (int i = 0; i < n_q; ++i)
      for (int d = 0; d < L_.hd; ++d) acc[size_t(i) * size_t(L_.hd) + size_t(d)] *= cs_[d];
    inner_->finish_output(head, acc, n_q);
  }

 private:
  // A record's codes -> c (hd).
  void unpack(const uint8_t* rec, uint8_t* c) const {
    const TqTileSeg& g0 = L_.seg[0];
    tq_unpack_codes(rec + 2, g0.nch, g0.bits, c);
    if (L_.nseg > 1) tq_unpack_codes(rec + off_lo_, L_.seg[1].nch, L_.seg[1].bits, c + g0.nch);
  }
  // Slot tt in the rotated basis: norm * centroid.
  void rotated(const uint8_t* block, int tt, float* y) const {
    const int j = tt % kv_tile_tokens;
    const uint8_t* tp = block + size_t(tt / kv_tile_tokens) * L_.tile_bytes;
    const float norm = tile_norm(tp, j);
    uint8_t c[kv_max_head_dim];
    codes(tp, j, c);
    for (int d = 0; d < L_.hd; ++d) y[d] = norm * cb_[L_.block_seg[d / 32]][c[d]];
  }
  // Slot j's codes of the tile at tp -> c (hd), through the position table.
  void codes(const uint8_t* tp, int j, uint8_t* c) const {
    const Pos* pj = pos_.data() + size_t(j) * size_t(L_.hd);
    for (int d = 0; d < L_.hd; ++d) {
      const Pos& a = pj[d];
      int v = (tp[a.byte] >> a.shift) & a.mask;
      if (a.hbit >= 0) v |= ((tp[a.hbyte] >> a.hbit) & 1) << 2;
      c[d] = uint8_t(v);
    }
  }

  struct Pos {  // CodeAt in bytes (tiles are at most 32 + 8 * kv_max_head_dim bytes)
    uint16_t byte, hbyte;
    uint8_t shift, mask;
    int8_t hbit;
  };
  static_assert(32 + 8 * kv_max_head_dim <= 65535, "tile offsets fit 16 bits");

  std::unique_ptr<KvCodec> inner_;
  std::vector<Pos> pos_;  // (slot, channel)
  float cb_[2][16] = {};
  float cs_[kv_max_head_dim] = {};
  int off_lo_ = 0;
};

bool fits(const std::string& name, double bits, int hd) {
  if (hd % 16 != 0 || hd <= 0) return false;
  int n_hi = 0, bh = 0, bl = 0;
  tq_split_bits(name, TqConfig{bits, false, TqRotationKind::hadamard}, hd, &n_hi, &bh, &bl);
  return tq_tiled_fits(hd, n_hi, bh, bl);
}

}  // namespace

std::unique_ptr<KvCodec> tq_tiled_codec_create(const std::string& name, double bits, const KvCodecParams& p) {
  if (!fits(name, bits, p.head_dim))
    fail("KV codec '{}': head_dim {} does not fit TurboQuant's tiles (a multiple of 32 up to {}, each bit-width "
         "segment whole 32-channel blocks); the record codec stores any multiple of 16",
         name, p.head_dim, kv_max_head_dim);
  return std::make_unique<TqTiledCodec>(name, bits, p);
}

std::unique_ptr<KvCodec> tq_codec_tiles_or_rows(const std::string& tiled_name, const std::string& rows_name,
                                                double bits, const KvCodecParams& p) {
  if (fits(rows_name, bits, p.head_dim)) return tq_tiled_codec_create(tiled_name, bits, p);
  return tq_codec_create(rows_name, TqConfig{bits, false, TqRotationKind::hadamard}, p);
}

}  // namespace kvq
