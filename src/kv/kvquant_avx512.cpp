// AVX-512 KVQuant score kernel: a sub-block of tokens is dequantized into score order (code bytes
// from the bit planes: per 64 channels one byte permute and one GF(2) affine transpose in the
// instances for head_dim 64 / 128 / 256, else masked adds per plane; one vpermps into the <= 16-entry
// codebook per 16 channels), outlier channels are patched with scalar stores, then the keys are
// turned by R(t) from the table and dotted with up to 4 query rows, 16 (token, query) sums finished
// by one hsum16.
#include "core/avx512.h"

#include <cstring>
#include <type_traits>

#include "core/dtypes.h"
#include "kv/grouped_common.h"
#include "kv/hsum_avx512.h"
#include "kv/kvquant.h"
#include "kv/sincos_poly.h"

namespace kvq {

namespace {

constexpr int kSub = 16;  // tokens dequantized per sub-block: (kSub, head_dim) floats stay in L1

inline __mmask16 plane_mask(const uint8_t* plane, int k) {
  uint16_t m;
  std::memcpy(&m, plane + 2 * k, 2);
  return __mmask16(m);
}

template <int B>
inline __m512 dequant16(const uint8_t* row, int pb, int k, __m512 cb, const float* sc, const float* md) {
  __m512i v = _mm512_setzero_si512();
  for (int j = 0; j < B; ++j) v = _mm512_mask_add_epi32(v, plane_mask(row + j * pb, k), v, _mm512_set1_epi32(1 << j));
  return _mm512_fmadd_ps(_mm512_permutexvar_ps(v, cb), _mm512_load_ps(sc + 16 * k), _mm512_load_ps(md + 16 * k));
}

// The first N (16, 24, 32, 48 or 64) bytes at p in the low bytes of a vector, with loads of exactly
// those bytes (the rest of the vector is never read): no read past a code row, and no masked-off
// lane that could fall on a page nothing has touched yet (a microcode assist each time:
// bench/BENCHMARKS.md, "kvquant4's keys in 16-token tiles").
template <int N>
[[gnu::always_inline]] inline __m512i load_row_bytes(const uint8_t* p) {
  static_assert(N == 16 || N == 24 || N == 32 || N == 48 || N == 64);
  if constexpr (N == 64) {
    return _mm512_loadu_si512(p);
  } else if constexpr (N == 48) {
    return _mm512_inserti32x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))),
                              _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 32)), 2);
  } else if constexpr (N == 32) {
    return _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  } else if constexpr (N == 24) {
    const __m256i v = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
                                              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 16)), 1);
    return _mm512_castsi256_si512(v);
  } else {
    return _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
}

// Keys of tokens [0, n) of a into kbuf (n, D) in score order, outliers applied. sc, md: the
// group's scales and mids in channel order (halves) or score order (lanes).
template <int B, int FD>
void dequant_block(const KvquantScoreArgs& a, int t0, int n, const float* sc, const float* md, float* kbuf) {
  const KvquantScoreLayout& l = *a.layout;
  const int D = FD ? FD : a.head_dim, pb = D / 8, nk = D / 16, half = (FD ? FD : a.n_rot) / 2;
  const __m512 cb = _mm512_loadu_ps(a.codebook);
  if constexpr (FD > 0) {
    // The row's B planes in one or two loads; per 64-channel block m a byte permute puts plane j's
    // byte 8m + i at byte 7 - j of qword i (the other bytes zero) and one GF(2) affine transpose
    // turns each qword's 8 x 8 bit matrix into the codes of channels 64m + 8i .. 64m + 8i + 7, one
    // byte each: the byte vector the shifts and vpermps below read (lanes layout).
    constexpr int RB = B * FD / 8;  // row bytes: 16 .. 128
    __mmask64 keep = 0;  // bytes 8 - B .. 7 of every qword
    for (int i = 0; i < 8; ++i)
      for (int j = 0; j < B; ++j) keep |= __mmask64(1) << (8 * i + 7 - j);
    __m512i idx[FD / 64];
    for (int m = 0; m < FD / 64; ++m) {
      alignas(64) uint8_t x[64] = {};
      for (int i = 0; i < 8; ++i)
        for (int j = 0; j < B; ++j) x[8 * i + 7 - j] = uint8_t(j * (FD / 8) + 8 * m + i);
      idx[m] = _mm512_load_si512(x);
    }
    const __m512i sel = _mm512_set1_epi64(0x8040201008040201ll);  // byte b = 1 << b
    for (int u = 0; u < n; ++u) {
      const uint8_t* row = a.rows + size_t(t0 + u) * a.row_bytes;
      float* kp = kbuf + size_t(u) * FD;
      const __m512i lo = load_row_bytes<(RB < 64 ? RB : 64)>(row);
      __m512i hi = lo;
      if constexpr (RB > 64) hi = load_row_bytes<RB - 64>(row + 64);
      for (int m = 0; m < FD / 64; ++m) {
        const __m512i planes = RB > 64 ? _mm512_maskz_permutex2var_epi8(keep, lo, idx[m], hi)
                                       : _mm512_maskz_permutexvar_epi8(keep, idx[m], lo);
        const __m512i v = _mm512_gf2p8affine_epi64_epi8(sel, planes, 0);
        for (int r = 0; r < 4; ++r) {
          const __m512i ix = r == 0 ? v : _mm512_srli_epi32(v, 8 * r);
          const int o = 64 * m + 16 * r;
          _mm512_store_ps(kp + o, _mm512_fmadd_ps(_mm512_permutexvar_ps(ix, cb), _mm512_load_ps(sc + o),
                                                  _mm512_load_ps(md + o)));
        }
      }
    }
  } else if (l.layout == kvquant_layout_lanes) {
    // 64 codes as bytes from the 64-bit plane words; the dword lanes of the byte vector shifted by
    // 8r hold channels 4L + r in their low 4 bits, all vpermps reads.
    for (int u = 0; u < n; ++u) {
      const uint8_t* row = a.rows + size_t(t0 + u) * a.row_bytes;
      float* kp = kbuf + size_t(u) * D;
      for (int m = 0; m < D / 64; ++m) {
        __m512i v = _mm512_setzero_si512();
        for (int j = 0; j < B; ++j) {
          uint64_t w;
          std::memcpy(&w, row + j * pb + 8 * m, 8);
          v = _mm512_mask_add_epi8(v, __mmask64(w), v, _mm512_set1_epi8(char(1 << j)));
        }
        for (int r = 0; r < 4; ++r) {
          const __m512i idx = r == 0 ? v : _mm512_srli_epi32(v, 8 * r);
          const int o = 64 * m + 16 * r;
          _mm512_store_ps(kp + o, _mm512_fmadd_ps(_mm512_permutexvar_ps(idx, cb), _mm512_load_ps(sc + o),
                                                  _mm512_load_ps(md + o)));
        }
      }
    }
  } else {
    const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    const __m512i od = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    for (int u = 0; u < n; ++u) {
      const uint8_t* row = a.rows + size_t(t0 + u) * a.row_bytes;
      float* kp = kbuf + size_t(u) * D;
      int k = 0;
      if (!l.neox) {
        for (; 16 * k < 2 * half; k += 2) {
          const __m512 x0 = dequant16<B>(row, pb, k, cb, sc, md), x1 = dequant16<B>(row, pb, k + 1, cb, sc, md);
          _mm512_store_ps(kp + 8 * k, _mm512_permutex2var_ps(x0, ev, x1));
          _mm512_store_ps(kp + half + 8 * k, _mm512_permutex2var_ps(x0, od, x1));
        }
      }
      for (; k < nk; ++k) _mm512_store_ps(kp + 16 * k, dequant16<B>(row, pb, k, cb, sc, md));
    }
  }
  // Patched after all rows were written, so the vector loads below seldom wait on these stores.
  for (int u = 0; u < n; ++u) {
    float* kp = kbuf + size_t(u) * D;
    for (int j = 0; j < a.k; ++j) {
      const size_t e = size_t(t0 + u) * a.k + j;
      kp[l.slot[a.oidx[e]]] = _cvtsh_ss(kvg_load_f16(a.ovals, e));
    }
  }
}

// Where the pairs sit in score order: a-vector v (table entries 16v..16v+15) at astride * v, its
// b-elements boff further.
struct PairGeom {
  int astride, boff;
};
inline PairGeom pair_geom(const KvquantScoreArgs& a) {
  if (a.layout->layout == kvquant_layout_lanes && !a.layout->neox) return {32, 16};
  return {16, a.n_rot / 2};
}

// The shape a kernel instance is compiled for: FD = 0 reads head_dim, n_rot, the pair geometry and
// the table stride from the arguments; FD > 0 is head_dim = n_rot = rot_stride * 2 = FD in the lanes
// layout, neox (NX) or adjacent pairs, every loop bound and offset a constant (measured: the dot
// pass of kvquant4 at head_dim 128 from about 42 to 31 cycles per token, bench/BENCHMARKS.md).
template <int FD, bool NX>
struct ScoreShape {
  int D, half, n_rot, rstride;
  PairGeom g;
  explicit ScoreShape(const KvquantScoreArgs& a)
      : D(FD ? FD : a.head_dim),
        half(FD ? FD / 2 : a.n_rot / 2),
        n_rot(FD ? FD : a.n_rot),
        rstride(FD ? FD / 2 : a.rot_stride),
        g(FD ? (NX ? PairGeom{16, FD / 2} : PairGeom{32, 16}) : pair_geom(a)) {}
};

// Accumulators of one (query, token): its R(t)-turned key against the query's score-order rows.
template <int NQ, int TU>
inline void dot_block(const float* kbuf, const float* rc, const float* rs, int rstride, const float* q, int D,
                      int half, int n_rot, PairGeom g, __m512* acc) {
  for (int m = 0; m < half; m += 16) {
    const int ia = g.astride * (m / 16), ib = ia + g.boff;
    __m512 qa[NQ], qb[NQ];
    for (int i = 0; i < NQ; ++i) {
      qa[i] = _mm512_loadu_ps(q + size_t(i) * D + ia);
      qb[i] = _mm512_loadu_ps(q + size_t(i) * D + ib);
    }
    for (int u = 0; u < TU; ++u) {
      const float* kp = kbuf + size_t(u) * D;
      const __m512 ka = _mm512_load_ps(kp + ia), kb = _mm512_load_ps(kp + ib);
      const __m512 c = _mm512_loadu_ps(rc + size_t(u) * rstride + m), s = _mm512_loadu_ps(rs + size_t(u) * rstride + m);
      const __m512 ra = _mm512_fmsub_ps(ka, c, _mm512_mul_ps(kb, s));
      const __m512 rb = _mm512_fmadd_ps(ka, s, _mm512_mul_ps(kb, c));
      for (int i = 0; i < NQ; ++i) {
        acc[i * TU + u] = _mm512_fmadd_ps(qa[i], ra, acc[i * TU + u]);
        acc[i * TU + u] = _mm512_fmadd_ps(qb[i], rb, acc[i * TU + u]);
      }
    }
  }
  for (int c = n_rot; c < D; c += 16) {
    __m512 qv[NQ];
    for (int i = 0; i < NQ; ++i) qv[i] = _mm512_loadu_ps(q + size_t(i) * D + c);
    for (int u = 0; u < TU; ++u) {
      const __m512 kv = _mm512_load_ps(kbuf + size_t(u) * D + c);
      for (int i = 0; i < NQ; ++i) acc[i * TU + u] = _mm512_fmadd_ps(qv[i], kv, acc[i * TU + u]);
    }
  }
}

template <int NQ, int FD, bool NX>
void scores_nq(const KvquantScoreArgs& a, const float* kbuf, int t0, int n, const float* q, float* out,
               int out_stride) {
  constexpr int NQP = NQ == 3 ? 4 : NQ;
  constexpr int TU = 16 / NQP;
  const ScoreShape<FD, NX> sh(a);
  const int D = sh.D, half = sh.half, rstride = sh.rstride;
  const PairGeom g = sh.g;
  int u = 0;
  for (; u + TU <= n; u += TU) {
    __m512 acc[NQ * TU];
    for (auto& v : acc) v = _mm512_setzero_ps();
    dot_block<NQ, TU>(kbuf + size_t(u) * D, a.rot_c + size_t(t0 + u) * rstride, a.rot_s + size_t(t0 + u) * rstride,
                      rstride, q, D, half, sh.n_rot, g, acc);
    __m512 v[16];
    for (int j = 0; j < 16; ++j) v[j] = _mm512_setzero_ps();
    for (int o = 0; o < NQ * TU; ++o) v[4 * (o % 4) + o / 4] = acc[o];  // lane o: query o / TU, token o % TU
    alignas(64) float z[16];
    _mm512_store_ps(z, hsum16_avx512(v));
    for (int i = 0; i < NQ; ++i)
      for (int w = 0; w < TU; ++w) out[size_t(i) * out_stride + size_t(t0 + u + w)] = z[i * TU + w];
  }
  for (; u < n; ++u) {
    __m512 acc[NQ];
    for (auto& v : acc) v = _mm512_setzero_ps();
    dot_block<NQ, 1>(kbuf + size_t(u) * D, a.rot_c + size_t(t0 + u) * rstride, a.rot_s + size_t(t0 + u) * rstride,
                     rstride, q, D, half, sh.n_rot, g, acc);
    for (int i = 0; i < NQ; ++i) out[size_t(i) * out_stride + size_t(t0 + u)] = _mm512_reduce_add_ps(acc[i]);
  }
}

template <int B, int FD, bool NX>
void scores_impl(const KvquantScoreArgs& a, float* out, int out_stride) {
  const int D = FD ? FD : a.head_dim;
  alignas(64) float sc[kvg_max_head_dim], md[kvg_max_head_dim];
  if (FD || a.layout->layout == kvquant_layout_lanes) {
    // Straight into score order: lanes r of block m are channels 64m + 4L + r, picked from the
    // block's 64 f16 values with one two-source word permute.
    for (int m = 0; m < D / 64; ++m)
      for (int h = 0; h < 2; ++h) {
        const uint8_t* src = a.params + 2 * size_t(h) * D + 128 * size_t(m);
        const __m512i lo = _mm512_loadu_si512(src), hi = _mm512_loadu_si512(src + 64);
        float* dst = (h ? md : sc) + 64 * m;
        for (int r = 0; r < 4; ++r) {
          const __m512i idx = _mm512_add_epi16(
              _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 60, 56, 52, 48, 44, 40, 36, 32, 28, 24,
                               20, 16, 12, 8, 4, 0),
              _mm512_set1_epi16(short(r)));
          _mm512_store_ps(dst + 16 * r,
                          _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutex2var_epi16(lo, idx, hi))));
        }
      }
  } else {
    for (int k = 0; k < D / 16; ++k) {
      _mm512_store_ps(sc + 16 * k, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.params + 32 * k))));
      _mm512_store_ps(md + 16 * k, _mm512_cvtph_ps(_mm256_loadu_si256(
                                       reinterpret_cast<const __m256i*>(a.params + 2 * size_t(D) + 32 * k))));
    }
  }
  alignas(64) float kbuf[kSub * kvg_max_head_dim];
  for (int t0 = 0; t0 < a.n; t0 += kSub) {
    const int n = a.n - t0 < kSub ? a.n - t0 : kSub;
    dequant_block<B, FD>(a, t0, n, sc, md, kbuf);
    for (int i0 = 0; i0 < a.n_q; i0 += 4) {
      const float* q = a.q + size_t(i0) * D;
      float* o = out + size_t(i0) * out_stride;
      switch (a.n_q - i0 < 4 ? a.n_q - i0 : 4) {
        case 1: scores_nq<1, FD, NX>(a, kbuf, t0, n, q, o, out_stride); break;
        case 2: scores_nq<2, FD, NX>(a, kbuf, t0, n, q, o, out_stride); break;
        case 3: scores_nq<3, FD, NX>(a, kbuf, t0, n, q, o, out_stride); break;
        default: scores_nq<4, FD, NX>(a, kbuf, t0, n, q, o, out_stride); break;
      }
    }
  }
}

}  // namespace

void kvquant_scores_avx512(const KvquantScoreArgs& a, float* out, int out_stride) {
  // Pair chunks must be whole vectors (n_rot / 2 % 16 == 0); other shapes (e.g. the 8- and 24-pair
  // parts of the mixed-precision keys at head_dim 64) go to the AVX2 kernel (8-pair chunks, else
  // the reference).
  if ((a.n_rot / 2) % 16 != 0 || a.head_dim > kvg_max_head_dim) return kvquant_scores_avx2(a, out, out_stride);
  // Every channel rotated, lanes layout, the usual head sizes: an instance with constant shapes.
  const bool fixed = a.layout->layout == kvquant_layout_lanes && a.n_rot == a.head_dim && a.rot_stride == a.n_rot / 2;
  const auto run = [&](auto fd, auto nx) {
    switch (a.bits) {
      case 2: return scores_impl<2, fd(), nx()>(a, out, out_stride);
      case 3: return scores_impl<3, fd(), nx()>(a, out, out_stride);
      default: return scores_impl<4, fd(), nx()>(a, out, out_stride);
    }
  };
  kvg_with_head_dim(fixed ? a.head_dim : 0, [&](auto fd) {
    if constexpr (fd() == 0) run(fd, std::false_type{});  // NX unused: the shape is read at run time
    else if (a.layout->neox) run(fd, std::true_type{});
    else run(fd, std::false_type{});
  });
}

void kvquant_prep_avx512(const float* q, int n_q, int head_dim, int n_rot, const KvquantScoreLayout& l,
                         const float* c, const float* s, float* out) {
  if (l.layout != kvquant_layout_lanes) return kvquant_prep_avx2(q, n_q, head_dim, n_rot, l, c, s, out);
  const int D = head_dim, half = n_rot / 2;
  // Lanes r of block m = channels 64m + 4L + r: two two-source permutes pick lanes 0-7 from the
  // block's first 32 floats and 8-15 from the last 32.
  const __m512i pick = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 0, 4, 8, 12, 16, 20, 24, 28);
  const PairGeom g = l.neox ? PairGeom{16, half} : PairGeom{32, 16};
  for (int i = 0; i < n_q; ++i) {
    const float* qi = q + size_t(i) * D;
    float* o = out + size_t(i) * D;
    for (int m = 0; m < D / 64; ++m) {
      const __m512 x0 = _mm512_loadu_ps(qi + 64 * m), x1 = _mm512_loadu_ps(qi + 64 * m + 16);
      const __m512 x2 = _mm512_loadu_ps(qi + 64 * m + 32), x3 = _mm512_loadu_ps(qi + 64 * m + 48);
      for (int r = 0; r < 4; ++r) {
        const __m512i idx = _mm512_add_epi32(pick, _mm512_set1_epi32(r));
        const __m512 lo = _mm512_permutex2var_ps(x0, idx, x1), hi = _mm512_permutex2var_ps(x2, idx, x3);
        _mm512_storeu_ps(o + 64 * m + 16 * r, _mm512_shuffle_f32x4(lo, hi, _MM_SHUFFLE(1, 0, 1, 0)));
      }
    }
    for (int p = 0; p < half; p += 16) {  // R(P)^T on the pairs, now in score order
      const int ia = g.astride * (p / 16), ib = ia + g.boff;
      const __m512 qa = _mm512_loadu_ps(o + ia), qb = _mm512_loadu_ps(o + ib);
      const __m512 cv = _mm512_loadu_ps(c + p), sv = _mm512_loadu_ps(s + p);
      _mm512_storeu_ps(o + ia, _mm512_fmadd_ps(qa, cv, _mm512_mul_ps(qb, sv)));
      _mm512_storeu_ps(o + ib, _mm512_fmsub_ps(qb, cv, _mm512_mul_ps(qa, sv)));
    }
  }
}

void kvquant_sincos_avx512(long pos, const double* theta, int half, float* c, float* s) {
  const __m512d p = _mm512_set1_pd(double(pos));
  const __m512d two_over_pi = _mm512_set1_pd(kSincosTwoOverPi);
  // pi/2 = p1 + p2 + p3 to ~160 bits; n * p_i is exact inside each FMA.
  const __m512d p1 = _mm512_set1_pd(kSincosHalfPi[0]), p2 = _mm512_set1_pd(kSincosHalfPi[1]),
                p3 = _mm512_set1_pd(kSincosHalfPi[2]);
  for (int j = 0; j < half; j += 8) {
    const __mmask8 m = half - j >= 8 ? __mmask8(0xff) : __mmask8((1u << (half - j)) - 1);
    const __m512d x = _mm512_mul_pd(p, _mm512_maskz_loadu_pd(m, theta + j));
    const __m512d n = _mm512_roundscale_pd(_mm512_mul_pd(x, two_over_pi), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512d r = _mm512_fnmadd_pd(n, p1, x);
    r = _mm512_fnmadd_pd(n, p2, r);
    r = _mm512_fnmadd_pd(n, p3, r);
    const __m512d z = _mm512_mul_pd(r, r);
    // Taylor series on |r| <= pi/4 (kv/sincos_poly.h): the first omitted terms are < 1e-17.
    __m512d ps = _mm512_set1_pd(kSinTaylor[0]), pc = _mm512_set1_pd(kCosTaylor[0]);
    for (int i = 1; i < 8; ++i) {
      ps = _mm512_fmadd_pd(ps, z, _mm512_set1_pd(kSinTaylor[i]));
      pc = _mm512_fmadd_pd(pc, z, _mm512_set1_pd(kCosTaylor[i]));
    }
    const __m512d sr = _mm512_fmadd_pd(_mm512_mul_pd(ps, z), r, r);
    const __m512d cr = _mm512_fmadd_pd(pc, z, _mm512_set1_pd(1.0));
    // Quadrant n mod 4: sin = (q odd ? cos r : sin r), negated for q in {2, 3}; cos = (q odd ?
    // sin r : cos r), negated for q in {1, 2}.
    const __m512i q = _mm512_and_si512(_mm512_cvtpd_epi64(n), _mm512_set1_epi64(3));
    const __mmask8 odd = _mm512_test_epi64_mask(q, _mm512_set1_epi64(1));
    const __mmask8 neg_s = _mm512_test_epi64_mask(q, _mm512_set1_epi64(2));
    const __mmask8 neg_c = _mm512_test_epi64_mask(_mm512_add_epi64(q, _mm512_set1_epi64(1)), _mm512_set1_epi64(2));
    __m512d so = _mm512_mask_blend_pd(odd, sr, cr), co = _mm512_mask_blend_pd(odd, cr, sr);
    so = _mm512_mask_sub_pd(so, neg_s, _mm512_setzero_pd(), so);
    co = _mm512_mask_sub_pd(co, neg_c, _mm512_setzero_pd(), co);
    _mm256_mask_storeu_ps(s + j, m, _mm512_cvtpd_ps(so));
    _mm256_mask_storeu_ps(c + j, m, _mm512_cvtpd_ps(co));
  }
}

}  // namespace kvq
