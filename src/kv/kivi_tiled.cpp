// kivi4t and kivi2t (layout, arithmetic and error bound in kv/kivi_tiled.h): the per-group query
// fold, kivi4t's scalar score kernel and dispatch point (kivi2t's are int2t's, kv/int2_tiled.h), the
// codecs of both, one template on the code width, and their registration.
#include "kv/kivi_tiled.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <type_traits>

#include "core/cpu.h"
#include "core/dtypes.h"
#include "core/error.h"
#include "kv/grouped_common.h"
#include "kv/int2_tiled.h"
#include "kv/int4_tiled.h"
#include "kv/kivi.h"
#include "kv/prefetch_along.h"
#include "kv/registry_internal.h"
#include "kv/tiled_codec.h"

namespace kvq {

void kivit_fold_query_ref(const uint8_t* params, const float* q, int n_q, int hd, int8_t* q8, float* dq,
                          float* cz) {
  float sc[kvg_max_head_dim], ze[kvg_max_head_dim];
  for (int d = 0; d < hd; ++d) {
    sc[d] = f16_to_f32(kvg_load_f16(params, size_t(d)));
    ze[d] = f16_to_f32(kvg_load_f16(params, size_t(hd + d)));
  }
  for (int i = 0; i < n_q; ++i) {
    const float* x = q + size_t(i) * size_t(hd);
    int8_t* r8 = q8 + size_t(i) * size_t(hd);
    float* rd = dq + size_t(i) * size_t(hd / 32);
    float lane[kivit_c_lanes] = {};
    for (int b = 0; b < hd / 32; ++b) {
      float qs[32];
      float amax = 0;
      for (int j = 0; j < 32; ++j) {
        const int d = 32 * b + j;
        qs[j] = x[d] * sc[d];
        amax = std::max(amax, std::fabs(qs[j]));
        lane[d % kivit_c_lanes] = std::fma(x[d], ze[d], lane[d % kivit_c_lanes]);
      }
      const float step = amax / 127.f;
      // As int4t_prepare_query: a non-finite block has no int8 image (codes 0, step 0); C then
      // carries the NaN / inf into the score as the float kernels would. Nor has a block so small
      // that 1 / step overflows (|q'| < ~3.7e-37: its products would all be +-inf or NaN).
      float inv = step > 0 && std::isfinite(step) ? 1.f / step : 0.f;
      if (!std::isfinite(inv)) inv = 0.f;
      for (int j = 0; j < 32; ++j)
        r8[32 * b + j] = int8_t(std::min(127.f, std::max(-127.f, std::nearbyint(qs[j] * inv))));
      rd[b] = inv > 0 ? step : 0.f;
    }
    cz[i] = kivit_reduce_lanes(lane);
  }
}

void kivit_fold_query(const uint8_t* params, const float* q, int n_q, int hd, int8_t* q8, float* dq, float* cz) {
  KVQ_CPU_PICK(kivit_fold_query)(params, q, n_q, hd, q8, dq, cz);
}

void kivit_scores_ref(const int8_t* q8, const float* dq, const float* cz, int n_q, int hd, const uint8_t* tiles,
                      int t0, int n, float* out, int out_stride) {
  const size_t tile_bytes = size_t(8 * hd);
  for (int i = 0; i < n_q; ++i) {
    const int8_t* qi = q8 + size_t(i) * size_t(hd);
    const float* di = dq + size_t(i) * size_t(hd / 32);
    for (int t = 0; t < n; ++t) {
      const int tt = t0 + t, j = tt % kv_tile_tokens;
      const uint8_t* codes = tiles + size_t(tt / kv_tile_tokens) * tile_bytes;
      float facc = 0;
      for (int b = 0; b < hd / 32; ++b) {
        int32_t dot = 0;
        for (int o = 4 * b; o < 4 * b + 4; ++o)
          for (int k = 0; k < 4; ++k) {
            const uint8_t byte = codes[64 * o + 4 * j + k];
            dot += int32_t(byte & 15) * qi[8 * o + k] + int32_t(byte >> 4) * qi[8 * o + 4 + k];
          }
        facc = std::fma(float(dot), di[b], facc);
      }
      out[size_t(i) * size_t(out_stride) + size_t(t)] = facc + cz[i];
    }
  }
}

void kivit_scores(const int8_t* q8, const float* dq, const float* cz, int n_q, int hd, const uint8_t* tiles, int t0,
                  int n, float* out, int out_stride) {
  KVQ_CPU_PICK(kivit_scores)(q8, dq, cz, n_q, hd, tiles, t0, n, out, out_stride);
}

namespace {

// kivi's b-bit min/max quantizer (kv/kivi.cpp, MinMaxQ): scale and zero rounded to f16 first, codes
// chosen against exactly those numbers, inputs sanitized (NaN -> 0, clamped to the f16 range).
// Repeated here with the same expressions so that codes and parameters are kivi's bit for bit
// (tests/test_kivi_tiled.cpp compares the decodes).
template <int Bits>
struct KiviMinMax {
  static constexpr float top = float((1 << Bits) - 1);
  f16_t scale16, zero16;
  float zero, inv;
  KiviMinMax(float mn, float mx) {
    scale16 = f32_to_f16((mx - mn) / top);
    zero16 = f32_to_f16(mn);
    const float scale = f16_to_f32(scale16);
    zero = f16_to_f32(zero16);
    inv = scale > 0 ? 1.f / scale : 0.f;
  }
  uint8_t code(float x) const { return uint8_t(std::clamp(std::nearbyint((x - zero) * inv), 0.f, top)); }
};

// What kivi4t and kivi2t do not share: the code bytes of a 16-token tile (int4t's or int2t's K and
// V layouts) and the kernels that read them. Everything else (quantization, tables, fold, codec
// plumbing) is one code path.
template <int Bits>
struct KiviTiles;

template <>
struct KiviTiles<4> {
  static constexpr const char* key_name = "kivi4t_k";
  static constexpr const char* value_name = "kivi4t_v";
  static size_t key_tile_bytes(int hd) { return size_t(8 * hd); }
  // int4t's K layout: per dim-octet o 64 bytes, byte 4j + i = code[8o + i] | code[8o + 4 + i] << 4.
  static void put_key(uint8_t* codes, int j, const uint8_t* code, int hd) {
    for (int o = 0; o < hd / 8; ++o)
      for (int k = 0; k < 4; ++k) codes[64 * o + 4 * j + k] = uint8_t(code[8 * o + k] | code[8 * o + 4 + k] << 4);
  }
  static int key_code(const uint8_t* codes, int j, int c) { return int4t_key_code(codes, j, c); }
  static Int4TiledLayout value_layout(int hd) { return int4t_layout(hd, 32); }
  // int4t's V layout: a byte holds two codes of one token, written whole.
  static void put_value(uint8_t* codes, int j, const uint8_t* c, int hd) {
    const int kq = j / 4, m = j % 4;
    for (int ch = 0; ch < hd / 32; ++ch)
      for (int i = 0; i < 16; ++i)
        codes[64 * (4 * ch + kq) + 4 * i + m] = uint8_t(c[32 * ch + i] | c[32 * ch + 16 + i] << 4);
  }
  static int value_code(const uint8_t* codes, int j, int e) { return int4t_value_code(codes, j, e); }
  static void scores(const int8_t* q8, const float* dq, const float* cz, int n_q, int hd, const uint8_t* tiles,
                     int t0, int n, float* out, int out_stride) {
    kivit_scores(q8, dq, cz, n_q, hd, tiles, t0, n, out, out_stride);
  }
  static void accum(const Int4TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block, int t0,
                    int n, float* acc) {
    int4t_accum(L, p, p_stride, n_q, block, t0, n, acc);
  }
  // The values' multi-block weighted sum (KvCodec::accumulate_spans), or void.
#if defined(KVQ_HAVE_SIMD)
  using Spans = TiledSpansAvx512<Int4TiledLayout, int4t_scores_spans_avx512, int4t_accum_spans_avx512>;
#else
  using Spans = void;
#endif
};

template <>
struct KiviTiles<2> {
  static constexpr const char* key_name = "kivi2t_k";
  static constexpr const char* value_name = "kivi2t_v";
  static size_t key_tile_bytes(int hd) { return int2t_code_bytes(hd); }
  // int2t's K layout: a code byte belongs to one token, written whole.
  static void put_key(uint8_t* codes, int j, const uint8_t* code, int hd) {
    for (int o = 0; o < hd / 16; ++o)
      for (int i = 0; i < 4; ++i) {
        const uint8_t* c = code + 16 * o + i;
        codes[64 * o + 4 * j + i] = uint8_t(c[0] | c[4] << 2 | c[8] << 4 | c[12] << 6);
      }
  }
  static int key_code(const uint8_t* codes, int j, int c) { return int2t_key_code(codes, j, c); }
  static Int4TiledLayout value_layout(int hd) { return int2t_layout(hd, 32); }
  // int2t's V layout: a code byte holds crumbs of 8 tokens, so each token clears and sets its own.
  static void put_value(uint8_t* codes, int j, const uint8_t* c, int hd) {
    for (int e = 0; e < hd; ++e) {
      const int gi = e / 32, r = e % 32;
      const size_t byte = size_t(64 * (2 * gi + j / 8) + 4 * (r % 16) + j % 4);
      const int shift = 2 * (r / 16 + 2 * ((j % 8) / 4));
      codes[byte] = uint8_t((codes[byte] & ~(3u << shift)) | unsigned(c[e]) << shift);
    }
  }
  static int value_code(const uint8_t* codes, int j, int e) { return int2t_value_code(codes, j, e); }
  static void scores(const int8_t* q8, const float* dq, const float* cz, int n_q, int hd, const uint8_t* tiles,
                     int t0, int n, float* out, int out_stride) {
    kivi2t_scores(q8, dq, cz, n_q, hd, tiles, t0, n, out, out_stride);
  }
  static void accum(const Int4TiledLayout& L, const float* p, int p_stride, int n_q, const uint8_t* block, int t0,
                    int n, float* acc) {
    int2t_accum(L, p, p_stride, n_q, block, t0, n, acc);
  }
  // The values' multi-block weighted sum (KvCodec::accumulate_spans), or void.
#if defined(KVQ_HAVE_SIMD)
  using Spans = TiledSpansAvx512<Int4TiledLayout, int2t_scores_spans_avx512, int2t_accum_spans_avx512>;
#else
  using Spans = void;
#endif
};

template <class T>
bool kivit_fuses_spans() {
  if constexpr (std::is_void_v<typename T::Spans>) return false;
  else return T::Spans::fused();
}

class KivitCodecBase : public KvCodec {
 public:
  KivitCodecBase(std::string name, int bits, int hd, int g, int r) : hd_(hd), g_(g) {
    info_.name = std::move(name);
    info_.code_bits = bits;
    info_.group_tokens = g;
    info_.residual_tokens = r;
  }
  const KvCodecInfo& info() const override { return info_; }
  int head_dim() const override { return hd_; }

 protected:
  void check_block(int block_tokens) const { kv_check_block_tokens(info_.name, block_tokens, g_); }
  void check_range(int block_tokens, int t0, int n) const {
    check_block(block_tokens);
    kv_check_token_range(info().name, block_tokens, t0, n);
  }
  KvCodecInfo info_;
  int hd_, g_;
};

template <int Bits>
class KivitKeyCodec final : public KivitCodecBase {
  using T = KiviTiles<Bits>;

 public:
  KivitKeyCodec(int hd, int g, int r) : KivitCodecBase(T::key_name, Bits, hd, g, r) {}
  size_t group_bytes() const { return size_t(hd_) * 4 + size_t(g_ / kv_tile_tokens) * T::key_tile_bytes(hd_); }
  size_t block_bytes(int block_tokens) const override {
    check_block(block_tokens);
    return size_t(block_tokens / g_) * group_bytes();
  }
  PrefetchRange prefetch_range(int block_tokens, int t0, int n) const override {
    return lead_of(prefetch_along_range(block_tokens, t0, n));
  }
  // scores requests attention's range group by group (a token share each), not inside the kernels.
  bool prefetches_along() const override { return cpu_level() != CpuLevel::scalar; }
  PrefetchRange prefetch_along_range(int block_tokens, int t0, int n) const override {
    check_block(block_tokens);
    PrefetchRange r;
    kv_unit_range(group_bytes(), g_, t0, n, &r.offset, &r.bytes);
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
        const KiviMinMax<Bits> q(mn, mx);
        kvg_store_f16(grp, size_t(c), q.scale16);
        kvg_store_f16(grp, size_t(D + c), q.zero16);
        zero[c] = q.zero;
        inv[c] = q.inv;
      }
      uint8_t* tiles = grp + size_t(D) * 4;
      uint8_t code[kvg_max_head_dim];
      for (int t = 0; t < g_; ++t) {
        for (int c = 0; c < D; ++c) {
          // kivi's key expression (not KiviMinMax::code, which kivi's key path does not use either).
          const float qv = std::nearbyint((kv_sanitize(x[size_t(t) * src_stride + c]) - zero[c]) * inv[c]);
          code[c] = uint8_t(std::clamp(qv, 0.f, KiviMinMax<Bits>::top));
        }
        T::put_key(tiles + size_t(t / kv_tile_tokens) * T::key_tile_bytes(D), t % kv_tile_tokens, code, D);
      }
    }
  }

  void decode(int, const uint8_t* block, int block_tokens, int t0, int n, int, float* dst) const override {
    check_range(block_tokens, t0, n);
    const int D = hd_;
    for (int k = 0; k < n; ++k) {
      const int t = t0 + k, tg = t % g_, j = tg % kv_tile_tokens;
      const uint8_t* grp = block + size_t(t / g_) * group_bytes();
      const uint8_t* codes = grp + size_t(D) * 4 + size_t(tg / kv_tile_tokens) * T::key_tile_bytes(D);
      for (int c = 0; c < D; ++c)
        // kivi's key decode expression: bit-identical values.
        dst[size_t(k) * size_t(D) + size_t(c)] = f16_to_f32(kvg_load_f16(grp, size_t(c))) *
                                                     float(T::key_code(codes, j, c)) +
                                                 f16_to_f32(kvg_load_f16(grp, size_t(D + c)));
    }
  }

  void scores(int, const float* qp, int n_q, const uint8_t* block, int block_tokens, int t0, int n, int, float* out,
              int out_stride) const override {
    check_range(block_tokens, t0, n);
    const int D = hd_;
    const KvPrefetchAlong along = kv_prefetch_along;
    if (n > 0 && !along.p) {  // requested along the previous calls when attention sets a range
      const size_t a = size_t(t0 / g_) * group_bytes(), e = size_t((t0 + n + g_ - 1) / g_) * group_bytes();
      kvg_prefetch(block + a, e - a);
    }
    constexpr int qchunk = 8;  // bounds the stack copy of the folded query
    int8_t q8[qchunk * kvg_max_head_dim];
    float dq[qchunk * (kvg_max_head_dim / 32)], cz[qchunk];
    for (int t = t0; t < t0 + n;) {
      const int g = t / g_, te = std::min(t0 + n, (g + 1) * g_);
      const uint8_t* grp = block + size_t(g) * group_bytes();
      kv_prefetch_along_tokens(along, t - t0, te - t, n);
      for (int i0 = 0; i0 < n_q; i0 += qchunk) {
        const int m = std::min(qchunk, n_q - i0);
        kivit_fold_query(grp, qp + size_t(i0) * size_t(D), m, D, q8, dq, cz);
        T::scores(q8, dq, cz, m, D, grp + size_t(D) * 4, t - g * g_, te - t,
                  out + size_t(i0) * size_t(out_stride) + size_t(t - t0), out_stride);
      }
      t = te;
    }
  }

  void accumulate(int head, const float* p, int p_stride, int n_q, const uint8_t* block, int block_tokens, int t0,
                  int n, float* acc) const override {
    kv_accumulate_via_decode(*this, head, p, p_stride, n_q, block, block_tokens, t0, n, 0, acc);
  }
  // The query fold is per key group whatever the batch, so scores_spans stays one call per block;
  // the values' weighted sum is what batches save (KivitValueCodec).
  bool fuses_spans() const override { return kivit_fuses_spans<T>(); }
};

template <int Bits>
class KivitValueCodec final : public KivitCodecBase {
  using T = KiviTiles<Bits>;

 public:
  KivitValueCodec(int hd, int g, int r) : KivitCodecBase(T::value_name, Bits, hd, g, r), L_(T::value_layout(hd)) {}
  size_t block_bytes(int block_tokens) const override {
    check_block(block_tokens);
    return size_t(block_tokens / kv_tile_tokens) * L_.tile_bytes;
  }
  PrefetchRange prefetch_range(int block_tokens, int t0, int n) const override {
    return lead_of(prefetch_along_range(block_tokens, t0, n));
  }
  // int4t's / int2t's weighted sum requests attention's range along its segments.
  bool prefetches_along() const override { return cpu_level() != CpuLevel::scalar; }
  PrefetchRange prefetch_along_range(int block_tokens, int t0, int n) const override {
    check_block(block_tokens);
    PrefetchRange r;
    kv_unit_range(L_.tile_bytes, kv_tile_tokens, t0, n, &r.offset, &r.bytes);
    return r;
  }

  // kivi's per-token quantization (groups of 32 channels), written into int4t_g32's / int2t_g32's tiles.
  void encode(int, const float* src, size_t src_stride, int n, uint8_t* block, int block_tokens, int t0,
              int) const override {
    check_block(block_tokens);
    kv_check_encode_range(info_.name, block_tokens, g_, t0, n);
    uint8_t c[kvg_max_head_dim];
    for (int k = 0; k < n; ++k) {
      const float* x = src + size_t(k) * src_stride;
      const int tt = t0 + k, j = tt % kv_tile_tokens;
      uint8_t* tp = block + size_t(tt / kv_tile_tokens) * L_.tile_bytes;
      for (int gi = 0; gi < L_.ng; ++gi) {
        float mn = kv_sanitize(x[gi * 32]), mx = mn;
        for (int e = gi * 32 + 1; e < (gi + 1) * 32; ++e) {
          mn = std::min(mn, kv_sanitize(x[e]));
          mx = std::max(mx, kv_sanitize(x[e]));
        }
        const KiviMinMax<Bits> q(mn, mx);
        kvg_store_f16(tp, size_t(gi * 16 + j), q.scale16);
        kvg_store_f16(tp + L_.min_off, size_t(gi * 16 + j), q.zero16);
        for (int e = gi * 32; e < (gi + 1) * 32; ++e) c[e] = q.code(kv_sanitize(x[e]));
      }
      T::put_value(tp + L_.code_off, j, c, hd_);
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
        // kivi's value decode expression (a product then a sum, not int4t's / int2t's fma): bit-identical.
        dst[size_t(k) * size_t(D) + size_t(e)] =
            f16_to_f32(kvg_load_f16(tp, size_t(g * 16 + j))) * float(T::value_code(codes, j, e)) +
            f16_to_f32(kvg_load_f16(tp + L_.min_off, size_t(g * 16 + j)));
      }
    }
  }

  void scores(int head, const float* qp, int n_q, const uint8_t* block, int block_tokens, int t0, int n, int pos0,
              float* out, int out_stride) const override {
    kv_scores_via_decode(*this, head, qp, n_q, block, block_tokens, t0, n, pos0, out, out_stride);
  }
  // The block is an int4t_g32 / int2t_g32 value block: that codec's weighted sum (and its bound) applies as is.
  void accumulate(int, const float* p, int p_stride, int n_q, const uint8_t* block, int block_tokens, int t0, int n,
                  float* acc) const override {
    check_range(block_tokens, t0, n);
    T::accum(L_, p, p_stride, n_q, block, t0, n, acc);
  }
  bool fuses_spans() const override { return kivit_fuses_spans<T>(); }
  void accumulate_spans(int head, const float* p, int p_stride, int n_q, const KvSpan* spans, int n_spans,
                        float* acc) const override {
    if constexpr (!std::is_void_v<typename T::Spans>) {
      if (T::Spans::fused()) {
        for (int s = 0; s < n_spans; ++s) check_range(spans[s].block_tokens, spans[s].t0, std::max(0, spans[s].n));
        return T::Spans::accum(L_, p, p_stride, n_q, spans, n_spans, acc);
      }
    }
    KvCodec::accumulate_spans(head, p, p_stride, n_q, spans, n_spans, acc);
  }

 private:
  Int4TiledLayout L_;
};

}  // namespace

std::unique_ptr<KvCodec> kivi_tiled_codec_create(KvRole role, int bits, int head_dim, int g, int r) {
  KVQ_CHECK(bits == 2 || bits == 4, "kivi tiles: bits {}", bits);
  const char* name = role == KvRole::key ? (bits == 4 ? KiviTiles<4>::key_name : KiviTiles<2>::key_name)
                                         : (bits == 4 ? KiviTiles<4>::value_name : KiviTiles<2>::value_name);
  kv_check_grouped_params(name, head_dim, g, r);
  if (head_dim % 32 != 0)
    fail("KV codec '{}': head_dim {} must be a multiple of 32 (int8 query blocks and value groups of 32 channels)",
         name, head_dim);
  if (g % kv_tile_tokens != 0)
    fail("KV codec '{}': group of {} tokens; this codec stores 16-token tiles, so G must be a multiple of 16", name,
         g);
  if (bits == 4) {
    if (role == KvRole::key) return std::make_unique<KivitKeyCodec<4>>(head_dim, g, r);
    return std::make_unique<KivitValueCodec<4>>(head_dim, g, r);
  }
  if (role == KvRole::key) return std::make_unique<KivitKeyCodec<2>>(head_dim, g, r);
  return std::make_unique<KivitValueCodec<2>>(head_dim, g, r);
}

void kv_register_kivi_tiled() {
  struct Def {
    const char* name;
    KvRole role;
    int bits;
    const char* desc;
  };
  static const Def defs[] = {
      {"kivi4t_k", KvRole::key, 4,
       "kivi4_k's per-channel 4-bit keys (G=32, R=128) in 16-token tiles for integer-dot scores"},
      {"kivi4t_v", KvRole::value, 4,
       "kivi4_v's per-token 4-bit values (groups of 32 channels; G=32, R=128) in int4t_g32's tiles"},
      {"kivi2t_k", KvRole::key, 2,
       "kivi2_k's per-channel 2-bit keys (G=32, R=128) in 16-token tiles for integer-dot scores"},
      {"kivi2t_v", KvRole::value, 2,
       "kivi2_v's per-token 2-bit values (groups of 32 channels; G=32, R=128) in int2t_g32's tiles"},
  };
  for (const Def& d : defs) {
    kv_register_codec({d.name, d.desc, [d](const KvCodecParams& p) -> std::unique_ptr<KvCodec> {
                         int g = 0, r = 0;
                         kv_resolve_grouped(d.name, p, kivi_default_group_tokens, kivi_default_residual_tokens, &g,
                                            &r);
                         return kivi_tiled_codec_create(d.role, d.bits, p.head_dim, g, r);
                       }});
  }
  kv_register_format({"kivi4t", {}, "kivi4t_k", "kivi4t_v",
                      "KIVI 4-bit (kivi4's quantization and bytes) in 16-token tiles for integer-dot kernels: keys "
                      "per channel, values per token, newest 128 tokens full precision"});
  kv_register_format({"kivi2t", {}, "kivi2t_k", "kivi2t_v",
                      "KIVI 2-bit (kivi2's quantization and bytes) in 16-token tiles for integer-dot kernels: keys "
                      "per channel, values per token, newest 128 tokens full precision"});
}

}  // namespace kvq
