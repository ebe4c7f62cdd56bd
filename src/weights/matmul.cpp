// matmul driver (activation conversion, threading, dispatch), its scalar reference, and the
// scalar level of the quantized-activation kernels.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/aligned.h"
#include "core/cpu.h"
#include "core/error.h"
#include "weights/blocks.h"
#include "weights/kernels.h"
#include "weights/weights.h"

namespace kvq {

size_t act_row_bytes(ActFormat f, int64_t n_in) {
  switch (f) {
    case ActFormat::q8a: return size_t(n_in / kQK) * sizeof(BlockQ8A);
    case ActFormat::q8k: return size_t(n_in / kQKK) * sizeof(BlockQ8K);
    case ActFormat::f32: break;
  }
  return size_t(n_in) * sizeof(float);
}

// Symmetric round-to-nearest with d = amax / 127: |x - d q| <= d / 2, the bound the parity tests use.
static inline int8_t quant_one(float x, float id) {
  return int8_t(std::nearbyint(x * id));
}

void quantize_act_q8a(const float* x, BlockQ8A* y, int64_t n) {
  for (int64_t b = 0; b < n / kQK; ++b, x += kQK) {
    float amax = 0;
    for (int j = 0; j < kQK; ++j) amax = std::fmax(amax, std::fabs(x[j]));
    const float d = act_scale(amax);
    const float id = d != 0 ? 1.0f / d : 0.0f;
    int sum = 0;
    for (int j = 0; j < kQK; ++j) {
      y[b].qs[j] = quant_one(x[j], id);
      sum += y[b].qs[j];
    }
    y[b].d = d;
    y[b].sum = sum;
    y[b].ds = d * float(sum);
  }
}

void quantize_act_q8k(const float* x, BlockQ8K* y, int64_t n) {
  for (int64_t b = 0; b < n / kQKK; ++b, x += kQKK) {
    float amax = 0;
    for (int j = 0; j < kQKK; ++j) amax = std::fmax(amax, std::fabs(x[j]));
    const float d = act_scale(amax);
    const float id = d != 0 ? 1.0f / d : 0.0f;
    for (int j = 0; j < kQKK; ++j) y[b].qs[j] = quant_one(x[j], id);
    for (int g = 0; g < 16; ++g) {
      int s = 0;
      for (int j = 0; j < 16; ++j) s += y[b].qs[16 * g + j];
      y[b].bsum16[g] = int16_t(s);
    }
    for (int g = 0; g < 8; ++g) y[b].bsum32[g] = int16_t(y[b].bsum16[2 * g] + y[b].bsum16[2 * g + 1]);
    y[b].d = d;
    y[b].pad[0] = y[b].pad[1] = y[b].pad[2] = 0;
  }
}

namespace {

// ---- scalar level: the same integer arithmetic as the SIMD kernels, one (row, token) at a time.

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline int dot32(const int8_t* a, const int8_t* b) {
  int s = 0;
  for (int j = 0; j < kQK; ++j) s += int(a[j]) * int(b[j]);
  return s;
}

// Weight block -> signed codes q (w = d * q + m).
template <GgmlType T>
float row_dot_q8a(const uint8_t* w, const BlockQ8A* x, int64_t nb) {
  float acc = 0;
  int8_t q[kQK];
  for (int64_t b = 0; b < nb; ++b) {
    float d, m = 0;
    if constexpr (T == GgmlType::Q4_0) {
      const auto& blk = reinterpret_cast<const BlockQ4_0*>(w)[b];
      d = f16_to_f32(blk.d);
      for (int j = 0; j < 16; ++j) {
        q[j] = int8_t((blk.qs[j] & 0xF) - 8);
        q[j + 16] = int8_t((blk.qs[j] >> 4) - 8);
      }
    } else if constexpr (T == GgmlType::Q4_1) {
      const auto& blk = reinterpret_cast<const BlockQ4_1*>(w)[b];
      d = f16_to_f32(blk.d);
      m = f16_to_f32(blk.m);
      for (int j = 0; j < 16; ++j) {
        q[j] = int8_t(blk.qs[j] & 0xF);
        q[j + 16] = int8_t(blk.qs[j] >> 4);
      }
    } else if constexpr (T == GgmlType::Q5_0 || T == GgmlType::Q5_1) {
      using B = std::conditional_t<T == GgmlType::Q5_0, BlockQ5_0, BlockQ5_1>;
      const auto& blk = reinterpret_cast<const B*>(w)[b];
      d = f16_to_f32(blk.d);
      const int off = T == GgmlType::Q5_0 ? 16 : 0;
      if constexpr (T == GgmlType::Q5_1) m = f16_to_f32(blk.m);
      const uint32_t qh = load_u32(blk.qh);
      for (int j = 0; j < 16; ++j) {
        q[j] = int8_t(((blk.qs[j] & 0xF) | ((qh >> j) & 1) << 4) - off);
        q[j + 16] = int8_t(((blk.qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4) - off);
      }
    } else if constexpr (T == GgmlType::IQ4_NL) {
      const auto& blk = reinterpret_cast<const BlockIQ4_NL*>(w)[b];
      d = f16_to_f32(blk.d);
      for (int j = 0; j < 16; ++j) {
        q[j] = kIq4nlValues[blk.qs[j] & 0xF];
        q[j + 16] = kIq4nlValues[blk.qs[j] >> 4];
      }
    } else if constexpr (T == GgmlType::MXFP4) {
      const auto& blk = reinterpret_cast<const BlockMXFP4*>(w)[b];
      d = e8m0_half_to_f32(blk.e);
      for (int j = 0; j < 16; ++j) {
        q[j] = kMxfp4Values[blk.qs[j] & 0xF];
        q[j + 16] = kMxfp4Values[blk.qs[j] >> 4];
      }
    } else {
      static_assert(T == GgmlType::Q8_0);
      const auto& blk = reinterpret_cast<const BlockQ8_0*>(w)[b];
      d = f16_to_f32(blk.d);
      std::memcpy(q, blk.qs, kQK);
    }
    acc += d * x[b].d * float(dot32(q, x[b].qs)) + m * x[b].ds;
  }
  return acc;
}

template <GgmlType T>
float row_dot_q8k(const uint8_t* w, const BlockQ8K* x, int64_t nb) {
  float acc = 0;
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* xq = x[b].qs;
    if constexpr (T == GgmlType::Q4_K || T == GgmlType::Q5_K) {
      using B = std::conditional_t<T == GgmlType::Q4_K, BlockQ4_K, BlockQ5_K>;
      const auto& blk = reinterpret_cast<const B*>(w)[b];
      int isum = 0, msum = 0;
      for (int j = 0; j < 8; ++j) {
        uint8_t sc, m;
        k_scale_min(blk.scales, j, &sc, &m);
        const uint8_t* q = blk.qs + 32 * (j / 2);
        const int shift = 4 * (j & 1);
        int s = 0;
        for (int l = 0; l < 32; ++l) {
          int v = (q[l] >> shift) & 0xF;
          if constexpr (T == GgmlType::Q5_K) v |= ((blk.qh[l] >> j) & 1) << 4;
          s += v * xq[32 * j + l];
        }
        isum += int(sc) * s;
        msum += int(m) * x[b].bsum32[j];
      }
      acc += f16_to_f32(blk.d) * x[b].d * float(isum) - f16_to_f32(blk.dmin) * x[b].d * float(msum);
    } else if constexpr (T == GgmlType::Q2_K || T == GgmlType::Q3_K) {
      // 16 sub-blocks of 16: element 32k + l of half h is bits 2k of qs[32h + l], sub-block 8h + 2k + l / 16
      using B = std::conditional_t<T == GgmlType::Q2_K, BlockQ2_K, BlockQ3_K>;
      const auto& blk = reinterpret_cast<const B*>(w)[b];
      int8_t sc3[16];
      if constexpr (T == GgmlType::Q3_K) q3k_scales(blk.scales, sc3);
      int isum = 0, msum = 0;
      for (int j = 0; j < 16; ++j) {
        const int h = j / 8, k = (j % 8) / 2, l0 = 16 * (j % 2);
        int s = 0;
        for (int l = l0; l < l0 + 16; ++l) {
          int v = (blk.qs[32 * h + l] >> (2 * k)) & 3;
          if constexpr (T == GgmlType::Q3_K) v -= ((blk.hmask[l] >> (4 * h + k)) & 1) ? 0 : 4;
          s += v * xq[128 * h + 32 * k + l];
        }
        if constexpr (T == GgmlType::Q2_K) {
          isum += int(blk.scales[j] & 0xF) * s;
          msum += int(blk.scales[j] >> 4) * x[b].bsum16[j];
        } else {
          isum += int(sc3[j]) * s;
        }
      }
      acc += f16_to_f32(blk.d) * x[b].d * float(isum);
      if constexpr (T == GgmlType::Q2_K) acc -= f16_to_f32(blk.dmin) * x[b].d * float(msum);
    } else if constexpr (T == GgmlType::IQ4_XS) {
      const auto& blk = reinterpret_cast<const BlockIQ4_XS*>(w)[b];
      int isum = 0;
      for (int j = 0; j < 8; ++j) {
        int s = 0;
        for (int l = 0; l < 16; ++l) {
          s += kIq4nlValues[blk.qs[16 * j + l] & 0xF] * xq[32 * j + l];
          s += kIq4nlValues[blk.qs[16 * j + l] >> 4] * xq[32 * j + l + 16];
        }
        isum += iq4xs_scale(blk, j) * s;
      }
      acc += f16_to_f32(blk.d) * x[b].d * float(isum);
    } else {
      static_assert(T == GgmlType::Q6_K);
      const auto& blk = reinterpret_cast<const BlockQ6_K*>(w)[b];
      int isum = 0;
      for (int h = 0; h < 2; ++h) {
        const uint8_t* ql = blk.ql + 64 * h;
        const uint8_t* qh = blk.qh + 32 * h;
        for (int g = 0; g < 8; ++g) {  // sub-blocks of 16 in this half
          int s = 0;
          for (int l = 0; l < 16; ++l) {
            const int e = 16 * g + l;
            const int lo = e < 64 ? (ql[e] & 0xF) : (ql[e - 64] >> 4);
            const int hi = (qh[e % 32] >> (2 * (e / 32))) & 3;
            s += ((lo | (hi << 4)) - 32) * xq[128 * h + e];
          }
          isum += int(blk.scales[8 * h + g]) * s;
        }
      }
      acc += f16_to_f32(blk.d) * x[b].d * float(isum);
    }
  }
  return acc;
}

template <GgmlType T>
float row_dot_float(const uint8_t* w, const float* x, int64_t n) {
  // 8 partial sums: the scalar level should not be bound by one add chain
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  auto wv = [&](int64_t i) -> float {
    if constexpr (T == GgmlType::F32) {
      float f;
      std::memcpy(&f, w + 4 * i, 4);
      return f;
    } else {
      uint16_t h;
      std::memcpy(&h, w + 2 * i, 2);
      return T == GgmlType::F16 ? f16_to_f32(h) : bf16_to_f32(h);
    }
  };
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) s[j] += wv(i + j) * x[i + j];
  for (; i < n; ++i) s[0] += wv(i) * x[i];
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

template <GgmlType T>
void tile_scalar(const uint8_t* w, size_t ws, int64_t nr, const uint8_t* x, size_t xs, int64_t nt,
                 int64_t n_in, float* y, int64_t ldy) {
  for (int64_t r = 0; r < nr; ++r)
    for (int64_t t = 0; t < nt; ++t) {
      const uint8_t* wr = w + r * ws;
      const uint8_t* xt = x + t * xs;
      float v;
      if constexpr (T == GgmlType::F32 || T == GgmlType::F16 || T == GgmlType::BF16)
        v = row_dot_float<T>(wr, reinterpret_cast<const float*>(xt), n_in);
      else if constexpr (act_format(T) == ActFormat::q8k)
        v = row_dot_q8k<T>(wr, reinterpret_cast<const BlockQ8K*>(xt), n_in / kQKK);
      else
        v = row_dot_q8a<T>(wr, reinterpret_cast<const BlockQ8A*>(xt), n_in / kQK);
      y[t * ldy + r] = v;
    }
}

}  // namespace

MatmulTileFn matmul_kernel_scalar(GgmlType t) {
  switch (t) {
    case GgmlType::F32: return tile_scalar<GgmlType::F32>;
    case GgmlType::F16: return tile_scalar<GgmlType::F16>;
    case GgmlType::BF16: return tile_scalar<GgmlType::BF16>;
    case GgmlType::Q4_0: return tile_scalar<GgmlType::Q4_0>;
    case GgmlType::Q4_1: return tile_scalar<GgmlType::Q4_1>;
    case GgmlType::Q5_0: return tile_scalar<GgmlType::Q5_0>;
    case GgmlType::Q5_1: return tile_scalar<GgmlType::Q5_1>;
    case GgmlType::Q8_0: return tile_scalar<GgmlType::Q8_0>;
    case GgmlType::Q4_K: return tile_scalar<GgmlType::Q4_K>;
    case GgmlType::Q5_K: return tile_scalar<GgmlType::Q5_K>;
    case GgmlType::Q6_K: return tile_scalar<GgmlType::Q6_K>;
    case GgmlType::Q2_K: return tile_scalar<GgmlType::Q2_K>;
    case GgmlType::Q3_K: return tile_scalar<GgmlType::Q3_K>;
    case GgmlType::IQ4_NL: return tile_scalar<GgmlType::IQ4_NL>;
    case GgmlType::IQ4_XS: return tile_scalar<GgmlType::IQ4_XS>;
    case GgmlType::MXFP4: return tile_scalar<GgmlType::MXFP4>;
    default: return nullptr;
  }
}

#if !defined(KVQ_HAVE_SIMD)
void quantize_act_q8a_avx2(const float* x, BlockQ8A* y, int64_t n) { quantize_act_q8a(x, y, n); }
void quantize_act_q8k_avx2(const float* x, BlockQ8K* y, int64_t n) { quantize_act_q8k(x, y, n); }
MatmulTileFn matmul_kernel_avx2(GgmlType) { return nullptr; }
MatmulTileFn matmul_kernel_avx512(GgmlType) { return nullptr; }
MatmulTileFn matmul_kernel_avx512_streaming(GgmlType) { return nullptr; }
void dequantize_row_f16_avx2(GgmlType t, const void* src, float* dst, int64_t n) {
  dequantize_row_ref(t, src, dst, n);
}
#endif

namespace {
std::atomic<bool> g_batch_invariant{false};
}  // namespace

void matmul_set_batch_invariant(bool on) { g_batch_invariant.store(on, std::memory_order_relaxed); }
bool matmul_batch_invariant() { return g_batch_invariant.load(std::memory_order_relaxed); }

MatmulTileFn matmul_kernel(GgmlType t) {
  MatmulTileFn fn = nullptr;
  const CpuLevel l = cpu_level();
  if (l >= CpuLevel::avx512) fn = matmul_batch_invariant() ? matmul_kernel_avx512_streaming(t) : matmul_kernel_avx512(t);
  if (!fn && l >= CpuLevel::avx2) fn = matmul_kernel_avx2(t);
  if (!fn) fn = matmul_kernel_scalar(t);
  return fn;
}

static void check_view(const WeightView& w) {
  const auto* tr = ggml_type_traits(uint32_t(w.type));
  if (!tr || !weight_type_supported(w.type))
    fail("weight type {} is not supported by kvq's kernels", tr ? tr->name : "unknown");
  if (w.n_in <= 0 || w.n_out <= 0 || w.n_in % tr->block_size != 0)
    fail("weight tensor of type {}: row length {} is not a positive multiple of its block size {}",
         tr->name, w.n_in, tr->block_size);
  if (w.row_bytes < ggml_row_bytes(w.type, w.n_in))
    fail("weight tensor of type {}: row stride {} bytes is shorter than a row ({} bytes)", tr->name,
         w.row_bytes, ggml_row_bytes(w.type, w.n_in));
  KVQ_CHECK(w.data != nullptr);
}

namespace {
// x (n_tok, n_in) converted to the activation format of w's type into dst (when not f32): the
// converted rows, or x itself.
const uint8_t* convert_activations(const WeightView& w, const float* x, int64_t n_tok, AlignedBuf<uint8_t>& dst,
                                   ThreadPool& pool) {
  const ActFormat af = act_format(w.type);
  if (af == ActFormat::f32) return reinterpret_cast<const uint8_t*>(x);
  const size_t xs = act_row_bytes(af, w.n_in);
  if (dst.size() < xs * size_t(n_tok)) dst.resize(xs * size_t(n_tok));
  uint8_t* d = dst.data();
  const int64_t n_in = w.n_in;
  const bool simd = cpu_level() >= CpuLevel::avx2;
  auto quant = [&](size_t b, size_t e) {
    for (size_t t = b; t < e; ++t) {
      auto* qa = reinterpret_cast<BlockQ8A*>(d + t * xs);
      auto* qk = reinterpret_cast<BlockQ8K*>(d + t * xs);
      if (af == ActFormat::q8a) simd ? quantize_act_q8a_avx2(x + t * n_in, qa, n_in) : quantize_act_q8a(x + t * n_in, qa, n_in);
      else simd ? quantize_act_q8k_avx2(x + t * n_in, qk, n_in) : quantize_act_q8k(x + t * n_in, qk, n_in);
    }
  };
  if (n_tok >= 4 * pool.size()) pool.parallel_for(size_t(n_tok), 1, quant);
  else quant(0, size_t(n_tok));
  return d;
}
}  // namespace

void matmul(const WeightView& w, const float* x, int64_t n_tok, float* y, ThreadPool& pool) {
  const MatmulJob job{&w, x, n_tok, y};
  matmul_many(&job, 1, pool);
}

void matmul_many(const MatmulJob* jobs, int n_jobs, ThreadPool& pool) {
  // Per calling thread: matmul is re-entrant across threads that each own their pool.
  // (The pool's workers read these through references: a thread_local named inside the lambda
  // would be each worker's own.)
  // Per job: converted activations, their row stride, the kernel, and the job's rows at
  // [first[j], first[j] + n_out) of all jobs' rows.
  thread_local std::vector<AlignedBuf<uint8_t>> xq_tl;
  thread_local std::vector<const uint8_t*> xa_tl;
  thread_local std::vector<size_t> xs_tl, first_tl;
  thread_local std::vector<MatmulTileFn> fn_tl;
  std::vector<AlignedBuf<uint8_t>>& xq = xq_tl;
  std::vector<const uint8_t*>& xa = xa_tl;
  std::vector<size_t>& xs = xs_tl;
  std::vector<size_t>& first = first_tl;
  std::vector<MatmulTileFn>& fn = fn_tl;
  if (xq.size() < size_t(n_jobs)) xq.resize(size_t(n_jobs));
  xa.assign(size_t(n_jobs), nullptr);
  xs.resize(size_t(n_jobs));
  fn.resize(size_t(n_jobs));
  first.assign(size_t(n_jobs) + 1, 0);
  for (int j = 0; j < n_jobs; ++j) {
    const MatmulJob& jb = jobs[j];
    check_view(*jb.w);
    xs[size_t(j)] = act_row_bytes(act_format(jb.w->type), jb.w->n_in);
    fn[size_t(j)] = matmul_kernel(jb.w->type);
    if (jb.n_tok > 0) {
      // the same activations for the same input width and format are converted once
      for (int i = 0; i < j && !xa[size_t(j)]; ++i)
        if (jobs[i].x == jb.x && jobs[i].n_tok == jb.n_tok && jobs[i].w->n_in == jb.w->n_in &&
            act_format(jobs[i].w->type) == act_format(jb.w->type))
          xa[size_t(j)] = xa[size_t(i)];
      if (!xa[size_t(j)]) xa[size_t(j)] = convert_activations(*jb.w, jb.x, jb.n_tok, xq[size_t(j)], pool);
    }
    // each job's rows padded to whole tiles, so that no chunk spans two jobs' tile boundaries
    const int64_t rows = jb.n_tok > 0 ? jb.w->n_out : 0;
    first[size_t(j) + 1] = first[size_t(j)] + size_t((rows + kTileRows - 1) / kTileRows * kTileRows);
  }
  // Chunks of rows, a multiple of the kernels' row tile; threads take contiguous chunk ranges so
  // each streams its own part of W once.
  pool.parallel_for(first[size_t(n_jobs)], kTileRows, [&](size_t b, size_t e) {
    // the jobs whose padded rows meet [b, e), from the one holding row b on
    for (size_t j = size_t(std::upper_bound(first.begin(), first.end(), b) - first.begin()) - 1;
         j < size_t(n_jobs) && first[j] < e; ++j) {
      const MatmulJob& jb = jobs[j];
      const size_t lo = std::max(b, first[j]), hi = std::min(e, first[j] + size_t(jb.n_tok > 0 ? jb.w->n_out : 0));
      if (lo >= hi) continue;
      const WeightView& w = *jb.w;
      const size_t r0 = lo - first[j];
      fn[j](static_cast<const uint8_t*>(w.data) + r0 * w.row_bytes, w.row_bytes, int64_t(hi - lo), xa[j], xs[j], jb.n_tok,
            w.n_in, jb.y + r0, w.n_out);
    }
  });
}

void matmul_ref(const WeightView& w, const float* x, int64_t n_tok, float* y) {
  check_view(w);
  std::vector<float> row(size_t(w.n_in));
  const auto* wd = static_cast<const uint8_t*>(w.data);
  for (int64_t r = 0; r < w.n_out; ++r) {
    dequantize_row_ref(w.type, wd + size_t(r) * w.row_bytes, row.data(), w.n_in);
    for (int64_t t = 0; t < n_tok; ++t) {
      const float* xt = x + t * w.n_in;
      double s = 0;
      for (int64_t i = 0; i < w.n_in; ++i) s += double(row[size_t(i)]) * double(xt[i]);
      y[t * w.n_out + r] = float(s);
    }
  }
}

void weight_row(const WeightView& w, int64_t r, float* dst) {
  check_view(w);
  if (r < 0 || r >= w.n_out) fail("row {} out of range: the tensor has {} rows", r, w.n_out);
  dequantize_row(w.type, static_cast<const uint8_t*>(w.data) + size_t(r) * w.row_bytes, dst, w.n_in);
}

}  // namespace kvq
