#include "kv/kv_rows.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "core/cpu.h"
#include "core/error.h"
#include "kv/fp8.h"

namespace kvq {

size_t kv_row_bytes(KvElem e, int hd, int group) {
  const size_t d = size_t(hd);
  switch (e) {
    case KvElem::f32: return 4 * d;
    case KvElem::f16:
    case KvElem::bf16: return 2 * d;
    case KvElem::e4m3:
    case KvElem::e5m2:
    case KvElem::int8_static: return d;
    case KvElem::e4m3_dyn:
    case KvElem::e5m2_dyn:
    case KvElem::int8: return sizeof(KvRowScaled) + d;
    case KvElem::int4g: return sizeof(KvGroupParams) * (d / size_t(group)) + d / 2;
    case KvElem::int2g: return sizeof(KvGroupParams) * (d / size_t(group)) + d / 4;
    case KvElem::q8_0: return sizeof(kv_block_q8_0) * (d / 32);
    case KvElem::q4_0: return sizeof(kv_block_q4_0) * (d / 32);
    case KvElem::q4_1: return sizeof(kv_block_q4_1) * (d / 32);
    case KvElem::q5_0: return sizeof(kv_block_q5_0) * (d / 32);
    case KvElem::q5_1: return sizeof(kv_block_q5_1) * (d / 32);
    case KvElem::iq4_nl: return sizeof(kv_block_iq4_nl) * (d / 32);
  }
  return 0;
}

double kv_elem_code_bits(KvElem e) {
  switch (e) {
    case KvElem::f32: return 32;
    case KvElem::f16:
    case KvElem::bf16: return 16;
    case KvElem::int4g:
    case KvElem::q4_0:
    case KvElem::q4_1:
    case KvElem::iq4_nl: return 4;
    case KvElem::q5_0:
    case KvElem::q5_1: return 5;
    case KvElem::int2g: return 2;
    default: return 8;
  }
}

KvRowFmt kv_row_fmt(KvElem e, int hd, int group) {
  KVQ_CHECK(hd > 0 && hd <= kv_max_head_dim, "head_dim {}", hd);
  if (e == KvElem::int4g || e == KvElem::int2g)
    KVQ_CHECK(group > 0 && group % kv_unit_elems == 0 && hd % group == 0, "group {} head_dim {}",
              group, hd);
  if (e == KvElem::q8_0 || e == KvElem::q4_0 || kv_elem_ggml_ext(e)) KVQ_CHECK(hd % 32 == 0, "head_dim {}", hd);
  KvRowFmt f;
  f.elem = e;
  f.head_dim = hd;
  f.group = group;
  f.row_bytes = kv_row_bytes(e, hd, group);
  return f;
}

namespace {

float absmax(const float* x, int n) {
  float m = 0;
  for (int i = 0; i < n; ++i) m = std::max(m, std::fabs(x[i]));
  return m;
}

float load_f32(const uint8_t* p) { float v; std::memcpy(&v, p, 4); return v; }
void store_f32(uint8_t* p, float v) { std::memcpy(p, &v, 4); }
f16_t load_u16(const uint8_t* p) { f16_t v; std::memcpy(&v, p, 2); return v; }
void store_u16(uint8_t* p, f16_t v) { std::memcpy(p, &v, 2); }

// f16 of a finite value, saturating instead of overflowing to inf (a scale or minimum of inf
// would turn a whole group into NaN).
f16_t f16_sat(float v) {
  v = std::min(65504.f, std::max(-65504.f, v));
  return f32_to_f16(v);
}

// Asymmetric min/max quantization of one group to `levels` + 1 codes. Codes are computed against
// the f16-rounded scale and minimum, i.e. against exactly what decode will use.
void encode_group(const float* x, int g, int levels, KvGroupParams* gp, uint8_t* codes) {
  float mn = x[0], mx = x[0];
  for (int i = 1; i < g; ++i) {
    mn = std::min(mn, x[i]);
    mx = std::max(mx, x[i]);
  }
  gp->scale = f16_sat((mx - mn) / float(levels));
  gp->min = f16_sat(mn);
  const float s = f16_to_f32(gp->scale), m = f16_to_f32(gp->min);
  const float inv = s > 0 ? 1.f / s : 0.f;
  for (int i = 0; i < g; ++i) {
    float c = std::nearbyint((x[i] - m) * inv);
    c = std::min(float(levels), std::max(0.f, c));
    codes[i] = uint8_t(c);
  }
}

// ggml's reference quantizers for llama.cpp's other KV types, one 32-element block each (the same
// formulas and operation order, so the codes match llama.cpp's). The 4-bit min/max split of
// q4_1 / q5_1: codes from the unrounded d and min, as ggml.
void minmax(const float* x, float* mn, float* mx) {
  *mn = std::numeric_limits<float>::max();
  *mx = -std::numeric_limits<float>::max();
  for (int j = 0; j < 32; ++j) {
    if (x[j] < *mn) *mn = x[j];
    if (x[j] > *mx) *mx = x[j];
  }
}
// The signed value of largest magnitude (the first one on ties), and that magnitude.
float signed_absmax(const float* x, float* amax) {
  float a = 0, v = 0;
  for (int j = 0; j < 32; ++j)
    if (std::fabs(x[j]) > a) {
      a = std::fabs(x[j]);
      v = x[j];
    }
  *amax = a;
  return v;
}
// Fifth bits of 32 5-bit codes as q5_*'s qh: bit j = bit 4 of code j.
void store_qh(const uint8_t* c, uint8_t* qh) {
  uint32_t h = 0;
  for (int j = 0; j < 32; ++j) h |= uint32_t((c[j] >> 4) & 1) << j;
  std::memcpy(qh, &h, 4);  // little-endian, as ggml's memcpy on the hosts kvq runs on
}
void pack_nibbles(const uint8_t* c, uint8_t* qs) {
  for (int j = 0; j < 16; ++j) qs[j] = uint8_t((c[j] & 15) | ((c[j + 16] & 15) << 4));
}
// Writes one llama.cpp 4- / 5-bit block of type e (q4_0, q4_1, q5_0, q5_1) at dst: f16 d, f16 m
// (the *_1 types), the fifth bits (q5_*), the nibbles; codes c[32].
void store_ggml_block(KvElem e, float d, float m, const uint8_t* c, uint8_t* dst) {
  const bool has_m = e == KvElem::q4_1 || e == KvElem::q5_1, five = e == KvElem::q5_0 || e == KvElem::q5_1;
  const f16_t dh = f32_to_f16(d);
  std::memcpy(dst, &dh, 2);
  dst += 2;
  if (has_m) {
    const f16_t mh = f32_to_f16(m);
    std::memcpy(dst, &mh, 2);
    dst += 2;
  }
  if (five) {
    store_qh(c, dst);
    dst += 4;
  }
  pack_nibbles(c, dst);
}
// Nearest grid point of iq4_nl (exact midpoints: 2x against the sum of neighbours; ties go up).
int iq4nl_index(float x) {
  const float x2 = x + x;
  int idx = 0;
  for (int step = 8; step > 0; step >>= 1) {
    const int j = idx + step;
    if (x2 >= float(kv_iq4nl_grid[j - 1] + kv_iq4nl_grid[j])) idx = j;
  }
  return idx;
}
// iq4_nl's reference quantization of one block (ggml's quantize_row_iq4_nl_ref: no scale search):
// the grid point of x / d0 with d0 = (value of largest magnitude) / -127, then the least-squares
// scale for those points with weights x^2. L keeps the previous block's indices when the block is
// (nearly) all zeros, whose d is 0 (decoded values 0 whatever the indices).
void encode_iq4nl(const float* x, uint8_t* L, kv_block_iq4_nl* blk) {
  float amax = 0;
  const float maxv = signed_absmax(x, &amax);
  float d = 0;
  if (amax >= 1e-15f) {
    d = maxv / float(kv_iq4nl_grid[0]);
    const float id = 1.f / d;
    float sumqx = 0, sumq2 = 0;
    for (int j = 0; j < 32; ++j) {
      const float al = id * x[j];
      const int l = iq4nl_index(al);
      L[j] = uint8_t(l);
      const float q = float(kv_iq4nl_grid[l]);
      const float w = x[j] * x[j];
      const float wq = w * q;
      sumqx += wq * x[j];
      sumq2 += wq * q;
    }
    d = sumqx / sumq2;
  }
  blk->d = f32_to_f16(d);
  pack_nibbles(L, blk->qs);
}

// Element index -> (byte, shift) of the unit packings described in kv_rows.h.
inline int int4_byte(int e) { return (e / 32) * kv_unit_int4_bytes + (e % 16); }
inline int int4_shift(int e) { return ((e % 32) / 16) * 4; }
inline int int2_byte(int e) { return (e / 32) * kv_unit_int2_bytes + (e % 8); }
inline int int2_shift(int e) { return ((e % 32) / 8) * 2; }

}  // namespace

void kv_row_encode(const KvRowFmt& f, float scale, const float* x, uint8_t* row) {
  const int hd = f.head_dim;
  switch (f.elem) {
    case KvElem::f32: std::memcpy(row, x, 4 * size_t(hd)); return;
    case KvElem::f16:
      for (int i = 0; i < hd; ++i) store_u16(row + 2 * i, f32_to_f16(x[i]));
      return;
    case KvElem::bf16:
      for (int i = 0; i < hd; ++i) store_u16(row + 2 * i, f32_to_bf16(x[i]));
      return;
    case KvElem::e4m3:
    case KvElem::e5m2: {
      const bool e4 = f.elem == KvElem::e4m3;
#if defined(KVQ_HAVE_SIMD)
      if (cpu_level() == CpuLevel::avx512)
        return e4 ? fp8_e4m3_encode_avx512(x, hd, scale, row) : fp8_e5m2_encode_avx512(x, hd, scale, row);
#endif
      for (int i = 0; i < hd; ++i) {
        const float v = x[i] / scale;
        row[i] = e4 ? fp8_e4m3_from_f32(v) : fp8_e5m2_from_f32(v);
      }
      return;
    }
    case KvElem::e4m3_dyn:
    case KvElem::e5m2_dyn: {
      const bool e4 = f.elem == KvElem::e4m3_dyn;
      float s = absmax(x, hd) / (e4 ? fp8_e4m3_max : fp8_e5m2_max);
      if (!(s > 0)) s = 1.f;  // all zeros: any scale decodes them exactly
      store_f32(row, s);
      uint8_t* c = row + sizeof(KvRowScaled);
#if defined(KVQ_HAVE_SIMD)
      if (cpu_level() == CpuLevel::avx512)
        return e4 ? fp8_e4m3_encode_avx512(x, hd, s, c) : fp8_e5m2_encode_avx512(x, hd, s, c);
#endif
      for (int i = 0; i < hd; ++i) c[i] = e4 ? fp8_e4m3_from_f32(x[i] / s) : fp8_e5m2_from_f32(x[i] / s);
      return;
    }
    case KvElem::int8:
    case KvElem::int8_static: {
      float s = scale;
      int8_t* c = reinterpret_cast<int8_t*>(row);
      if (f.elem == KvElem::int8) {
        s = absmax(x, hd) / 127.f;
        store_f32(row, s);
        c = reinterpret_cast<int8_t*>(row + sizeof(KvRowScaled));
      }
      const float inv = s > 0 ? 1.f / s : 0.f;
      for (int i = 0; i < hd; ++i) {
        float q = std::nearbyint(x[i] * inv);
        c[i] = int8_t(std::min(127.f, std::max(-127.f, q)));
      }
      return;
    }
    case KvElem::int4g:
    case KvElem::int2g: {
      const bool i4 = f.elem == KvElem::int4g;
      const int g = f.group, ng = hd / g;
      auto* gp = reinterpret_cast<KvGroupParams*>(row);
      uint8_t* codes = row + sizeof(KvGroupParams) * size_t(ng);
      std::memset(codes, 0, size_t(hd) / (i4 ? 2 : 4));
      uint8_t c[kv_max_head_dim];
      for (int j = 0; j < ng; ++j) {
        KvGroupParams p;
        encode_group(x + j * g, g, i4 ? 15 : 3, &p, c + j * g);
        std::memcpy(gp + j, &p, sizeof p);
      }
      for (int e = 0; e < hd; ++e) {
        if (i4) codes[int4_byte(e)] |= uint8_t(c[e] << int4_shift(e));
        else codes[int2_byte(e)] |= uint8_t(c[e] << int2_shift(e));
      }
      return;
    }
    case KvElem::q8_0: {
      for (int b = 0; b < hd / 32; ++b) {
        const float* xb = x + 32 * b;
        kv_block_q8_0 blk;
        const float d = absmax(xb, 32) / 127.f;
        const float id = d != 0 ? 1.f / d : 0.f;
        blk.d = f32_to_f16(d);
        // roundf (half away from zero) on x * (1/d), as ggml: required for bit-identical codes.
        for (int j = 0; j < 32; ++j) blk.qs[j] = int8_t(std::round(xb[j] * id));
        std::memcpy(row + b * sizeof(blk), &blk, sizeof blk);
      }
      return;
    }
    case KvElem::q4_1:
    case KvElem::q5_1: {
      const bool five = f.elem == KvElem::q5_1;
      const size_t bb = kv_row_bytes(f.elem, 32, 0);  // bytes per block
      for (int b = 0; b < hd / 32; ++b) {
        const float* xb = x + 32 * b;
        float mn, mx;
        minmax(xb, &mn, &mx);
        const float d = (mx - mn) / (five ? 31.f : 15.f);
        const float id = d != 0 ? 1.f / d : 0.f;
        uint8_t c[32];
        for (int j = 0; j < 32; ++j) {
          const float v = (xb[j] - mn) * id;
          // q4_1 clamps the truncated code to 15; q5_1 stores it as is (<= 31 by construction).
          c[j] = five ? uint8_t(v + 0.5f) : uint8_t(std::min(15, int(int8_t(v + 0.5f))));
        }
        store_ggml_block(f.elem, d, mn, c, row + size_t(b) * bb);
      }
      return;
    }
    case KvElem::q4_0:
    case KvElem::q5_0: {
      // The signed value of largest magnitude goes exactly on code 0 (d = max / -half), which uses
      // the asymmetric code range -half..half-1 fully on the side that needs it; codes are the
      // truncation of x/d + half + 0.5 (>= 0.5 here: round half up), clamped, as ggml.
      const bool five = f.elem == KvElem::q5_0;
      const float half = five ? 16.f : 8.f;
      const int top = five ? 31 : 15;
      const size_t bb = kv_row_bytes(f.elem, 32, 0);  // bytes per block
      for (int b = 0; b < hd / 32; ++b) {
        const float* xb = x + 32 * b;
        float amax;
        const float d = signed_absmax(xb, &amax) / -half;
        const float id = d != 0 ? 1.f / d : 0.f;
        uint8_t c[32];
        for (int j = 0; j < 32; ++j) c[j] = uint8_t(std::min(top, int(int8_t(xb[j] * id + (half + 0.5f)))));
        store_ggml_block(f.elem, d, 0.f, c, row + size_t(b) * bb);
      }
      return;
    }
    case KvElem::iq4_nl: {
      uint8_t L[32] = {};
      for (int b = 0; b < hd / 32; ++b) {
        kv_block_iq4_nl blk;
        encode_iq4nl(x + 32 * b, L, &blk);
        std::memcpy(row + b * sizeof(blk), &blk, sizeof blk);
      }
      return;
    }
  }
}

void kv_row_decode(const KvRowFmt& f, float scale, const uint8_t* row, float* x) {
  const int hd = f.head_dim;
  switch (f.elem) {
    case KvElem::f32: std::memcpy(x, row, 4 * size_t(hd)); return;
    case KvElem::f16:
      for (int i = 0; i < hd; ++i) x[i] = f16_to_f32(load_u16(row + 2 * i));
      return;
    case KvElem::bf16:
      for (int i = 0; i < hd; ++i) x[i] = bf16_to_f32(load_u16(row + 2 * i));
      return;
    case KvElem::e4m3:
    case KvElem::e5m2: {
      const float* t = f.elem == KvElem::e4m3 ? fp8_e4m3_table() : fp8_e5m2_table();
      for (int i = 0; i < hd; ++i) x[i] = t[row[i]] * scale;
      return;
    }
    case KvElem::e4m3_dyn:
    case KvElem::e5m2_dyn: {
      const float* t = f.elem == KvElem::e4m3_dyn ? fp8_e4m3_table() : fp8_e5m2_table();
      const float s = load_f32(row);
      const uint8_t* c = row + sizeof(KvRowScaled);
      for (int i = 0; i < hd; ++i) x[i] = t[c[i]] * s;
      return;
    }
    case KvElem::int8:
    case KvElem::int8_static: {
      float s = scale;
      const int8_t* c = reinterpret_cast<const int8_t*>(row);
      if (f.elem == KvElem::int8) {
        s = load_f32(row);
        c = reinterpret_cast<const int8_t*>(row + sizeof(KvRowScaled));
      }
      for (int i = 0; i < hd; ++i) x[i] = float(c[i]) * s;
      return;
    }
    case KvElem::int4g:
    case KvElem::int2g: {
      const bool i4 = f.elem == KvElem::int4g;
      const int g = f.group, ng = hd / g;
      const uint8_t* codes = row + sizeof(KvGroupParams) * size_t(ng);
      for (int e = 0; e < hd; ++e) {
        KvGroupParams p;
        std::memcpy(&p, row + sizeof(KvGroupParams) * size_t(e / g), sizeof p);
        const int c = i4 ? (codes[int4_byte(e)] >> int4_shift(e)) & 15
                         : (codes[int2_byte(e)] >> int2_shift(e)) & 3;
        x[e] = std::fma(float(c), f16_to_f32(p.scale), f16_to_f32(p.min));
      }
      return;
    }
    case KvElem::q8_0:
      for (int b = 0; b < hd / 32; ++b) {
        kv_block_q8_0 blk;
        std::memcpy(&blk, row + b * sizeof(blk), sizeof blk);
        const float d = f16_to_f32(blk.d);
        for (int j = 0; j < 32; ++j) x[32 * b + j] = float(blk.qs[j]) * d;
      }
      return;
    case KvElem::q4_0:
    case KvElem::q4_1:
    case KvElem::q5_0:
    case KvElem::q5_1:
    case KvElem::iq4_nl: {
      // llama.cpp's 4- / 5-bit blocks: f16 d, f16 m (the *_1 types), the fifth bits (q5_*), then
      // element j's low 4 bits in byte j % 16 (the high nibble for j >= 16). Each value is ggml's
      // expression; the products are exact, so c * d + m rounds once.
      const KvElem e = f.elem;
      const bool has_m = e == KvElem::q4_1 || e == KvElem::q5_1, five = e == KvElem::q5_0 || e == KvElem::q5_1;
      const size_t bb = kv_row_bytes(e, 32, 0);
      for (int b = 0; b < hd / 32; ++b) {
        const uint8_t* p = row + size_t(b) * bb;
        const float d = f16_to_f32(load_u16(p)), m = has_m ? f16_to_f32(load_u16(p + 2)) : 0.f;
        const uint8_t* qs = p + (has_m ? 4 : 2) + (five ? 4 : 0);
        uint32_t qh = 0;
        if (five) std::memcpy(&qh, qs - 4, 4);
        for (int j = 0; j < 32; ++j) {
          const int c = ((qs[j % 16] >> (j / 16 * 4)) & 15) | int(((qh >> j) & 1) << 4);
          float& v = x[32 * b + j];
          switch (e) {
            case KvElem::q4_0: v = float(c - 8) * d; break;
            case KvElem::q5_0: v = float(c - 16) * d; break;
            case KvElem::iq4_nl: v = d * float(kv_iq4nl_grid[c]); break;
            default: v = float(c) * d + m; break;  // q4_1, q5_1
          }
        }
      }
      return;
    }
  }
}

void kv_rows_scores_ref(const KvRowFmt& f, float scale, const float* q, int n_q,
                        const uint8_t* rows, size_t row_stride, int n, float* out, int out_stride) {
  const int hd = f.head_dim;
  float x[kv_max_head_dim];
  for (int t = 0; t < n; ++t) {
    kv_row_decode(f, scale, rows + size_t(t) * row_stride, x);
    for (int i = 0; i < n_q; ++i) {
      const float* qi = q + size_t(i) * size_t(hd);
      float s = 0;
      for (int d = 0; d < hd; ++d) s += qi[d] * x[d];
      out[size_t(i) * size_t(out_stride) + size_t(t)] = s;
    }
  }
}

void kv_rows_accum_ref(const KvRowFmt& f, float scale, const float* p, int p_stride, int n_q,
                       const uint8_t* rows, size_t row_stride, int n, float* acc) {
  const int hd = f.head_dim;
  float x[kv_max_head_dim];
  for (int t = 0; t < n; ++t) {
    kv_row_decode(f, scale, rows + size_t(t) * row_stride, x);
    for (int i = 0; i < n_q; ++i) {
      const float w = p[size_t(i) * size_t(p_stride) + size_t(t)];
      float* a = acc + size_t(i) * size_t(hd);
      for (int d = 0; d < hd; ++d) a[d] += w * x[d];
    }
  }
}

int kv_rows_query_extra_floats(const KvRowFmt& f) {
  // qlo + qhi (head_dim bytes) + dq + qs (2 * head_dim / 8 floats) = 2 * head_dim bytes.
  return kv_rows_int_dot_ok(f) ? f.head_dim / 2 : 0;
}

void kv_rows_prepare_query(const KvRowFmt& f, const float* q, int n_q, float* qp) {
  const int hd = f.head_dim, extra = kv_rows_query_extra_floats(f);
  const size_t qs_stride = size_t(hd + extra);
  for (int i = 0; i < n_q; ++i) {
    const float* qi = q + size_t(i) * size_t(hd);
    float* row = qp + size_t(i) * qs_stride;
    std::memcpy(row, qi, sizeof(float) * size_t(hd));
    if (extra == 0) continue;
    auto* qlo = reinterpret_cast<int8_t*>(row + hd);
    int8_t* qhi = qlo + hd / 2;
    float* dq = row + hd + hd / 4;  // after hd bytes of codes
    float* qs = dq + hd / 8;
    for (int b = 0; b < hd / 32; ++b) {
      const float* x = qi + 32 * b;
      const float d = absmax(x, 32) / 127.f;
      // A non-finite query has no int8 image; d = 0 keeps the codes 0 and the float part (qs)
      // carries the NaN/inf into the score, as the float kernels would.
      const float id = d > 0 && std::isfinite(d) ? 1.f / d : 0.f;
      if (f.elem != KvElem::int2g) {
        for (int j = 0; j < 32; ++j) {
          const float c = std::min(127.f, std::max(-127.f, std::nearbyint(x[j] * id)));
          (j < 16 ? qlo : qhi)[16 * b + (j % 16)] = int8_t(c);
        }
        for (int k = 0; k < 4; ++k) {
          dq[4 * b + k] = id > 0 ? d : 0.f;
          float s = 0;
          for (int u = 0; u < 4; ++u) s += x[4 * k + u] + x[16 + 4 * k + u];
          qs[4 * b + k] = s;
        }
      } else {
        // Chunk c = b / 4 of 128 elements, unit u = b % 4; plane k, byte j of the unit.
        const int c = b / 4, u = b % 4;
        for (int j = 0; j < 32; ++j) {
          const int k = j / 8;
          const float v = std::min(127.f, std::max(-127.f, std::nearbyint(x[j] * id)));
          (k < 2 ? qlo : qhi)[64 * c + 32 * (k % 2) + 8 * u + j % 8] = int8_t(v);
        }
        for (int h = 0; h < 2; ++h)
          for (int r = 0; r < 2; ++r) {
            const int l = 16 * c + 8 * h + 2 * u + r;
            dq[l] = id > 0 ? d : 0.f;
            float s = 0;
            for (int e = 0; e < 4; ++e) s += x[8 * h + 4 * r + e] + x[8 * (h + 2) + 4 * r + e];
            qs[l] = s;
          }
      }
    }
  }
}

void kv_rows_scores_prepared(const KvRowFmt& f, float scale, const float* qp, int n_q, const uint8_t* rows,
                             size_t row_stride, int n, float* out, int out_stride) {
  const int extra = kv_rows_query_extra_floats(f);
  if (extra == 0) return kv_rows_scores(f, scale, qp, n_q, rows, row_stride, n, out, out_stride);
#if defined(KVQ_HAVE_SIMD)
  switch (cpu_level()) {
    case CpuLevel::avx512: return kv_rows_scores_i8_avx512(f, qp, n_q, rows, row_stride, n, out, out_stride);
    case CpuLevel::avx2: return kv_rows_scores_i8_avx2(f, qp, n_q, rows, row_stride, n, out, out_stride);
    case CpuLevel::scalar: break;
  }
#endif
  // Scalar level: the float reference, one query row at a time (rows are head_dim + extra apart).
  const size_t qs_stride = size_t(f.head_dim + extra);
  for (int i = 0; i < n_q; ++i)
    kv_rows_scores_ref(f, scale, qp + size_t(i) * qs_stride, 1, rows, row_stride, n,
                       out + size_t(i) * size_t(out_stride), out_stride);
}

void kv_rows_scores(const KvRowFmt& f, float scale, const float* q, int n_q, const uint8_t* rows,
                    size_t row_stride, int n, float* out, int out_stride) {
#if defined(KVQ_HAVE_SIMD)
  if (kv_rows_simd_ok(f)) {
    switch (cpu_level()) {
      case CpuLevel::avx512:
        return kv_rows_scores_avx512(f, scale, q, n_q, rows, row_stride, n, out, out_stride);
      case CpuLevel::avx2:
        return kv_rows_scores_avx2(f, scale, q, n_q, rows, row_stride, n, out, out_stride);
      case CpuLevel::scalar: break;
    }
  }
#endif
  kv_rows_scores_ref(f, scale, q, n_q, rows, row_stride, n, out, out_stride);
}

void kv_rows_accum(const KvRowFmt& f, float scale, const float* p, int p_stride, int n_q,
                   const uint8_t* rows, size_t row_stride, int n, float* acc) {
#if defined(KVQ_HAVE_SIMD)
  if (kv_rows_simd_ok(f)) {
    switch (cpu_level()) {
      case CpuLevel::avx512:
        return kv_rows_accum_avx512(f, scale, p, p_stride, n_q, rows, row_stride, n, acc);
      case CpuLevel::avx2:
        return kv_rows_accum_avx2(f, scale, p, p_stride, n_q, rows, row_stride, n, acc);
      case CpuLevel::scalar: break;
    }
  }
#endif
  kv_rows_accum_ref(f, scale, p, p_stride, n_q, rows, row_stride, n, acc);
}

}  // namespace kvq
