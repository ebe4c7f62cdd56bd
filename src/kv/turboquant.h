// TurboQuant KV codecs (Zandieh et al., "TurboQuant: online vector quantization with near-optimal
// distortion rate", ICLR 2026), implemented from the paper.
//
// Per token and head: ||x|| as fp16; u = R x / ||x|| with R a seeded random orthogonal transform
// (randomized Hadamard by default, dense Haar-random as an option). Every coordinate of u then
// follows f(t) ~ (1 - t^2)^((d-3)/2) on [-1, 1], so each is quantized with a Lloyd-Max codebook
// for that density (computed here, cached per (bits, dim)). The "prod" variant spends b-1 bits on
// that quantizer and 1 bit on sign(S r), S a seeded d x d Gaussian and r the residual, plus
// ||r|| as fp16: <q, x> is then estimated without bias.
//
// Attention never un-rotates keys: prepare_query() maps q to R q (and S R q for prod), scores()
// reads the packed codes against a codebook held in registers; accumulate() sums values in the
// rotated basis and finish_output() applies R^T once.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/cpu.h"
#include "kvq/kv_format.h"

namespace kvq {

// ---------------------------------------------------------------------------------------------
// Lloyd-Max codebooks for the density of one coordinate of a uniformly random unit vector in R^dim.

struct TqCodebook {
  int bits = 0;
  int dim = 0;
  std::vector<float> centroids;  // 2^bits, ascending, symmetric around 0
  std::vector<float> bounds;     // 2^bits - 1 decision thresholds (midpoints of centroids)
  double coord_mse = 0;          // E[(t - Q(t))^2] for one coordinate
  int iterations = 0;            // Lloyd iterations until convergence
};

// bits in 1..4 (the codecs' range; up to 8 accepted), dim >= 8. Cached and thread-safe: the
// reference stays valid for the life of the process.
const TqCodebook& tq_lloyd_max(int bits, int dim);
// dim * per-coordinate MSE: the expected ||u - Q(u)||^2 for a random unit vector u.
double tq_lloyd_max_mse(int bits, int dim);
std::vector<float> tq_codebook(int bits, int dim);

// ---------------------------------------------------------------------------------------------
// Seeded randomness. Deterministic on every platform (no std:: distributions).

// Derives an independent stream seed for (seed, layer, role, purpose).
uint64_t tq_derive_seed(uint64_t seed, int layer, KvRole role, uint64_t purpose);
// Fills out (n) with i.i.d. N(0, 1) draws from the stream `seed`.
void tq_gaussian(uint64_t seed, float* out, size_t n);

enum class TqRotationKind { hadamard, dense };

// A random orthogonal transform of R^dim.
//  hadamard: R = H D / sqrt(dim), D a diagonal of random signs, H the Walsh-Hadamard matrix;
//            O(d log d); dim must be a power of two.
//  dense:    R = Q from the QR decomposition of a d x d Gaussian matrix (Haar distributed); O(d^2).
class TqRotation {
 public:
  TqRotation(TqRotationKind kind, int dim, uint64_t seed);  // throws kvq::Error on bad dim
  TqRotationKind kind() const { return kind_; }
  int dim() const { return dim_; }
  void forward(const float* x, float* y) const;  // y = R x; x, y: (dim), may alias
  void inverse(const float* y, float* x) const;  // x = R^T y; may alias
  const float* signs() const { return signs_.data(); }    // (dim) hadamard, else empty
  const float* matrix() const { return matrix_.data(); }  // (dim, dim) dense, else empty

 private:
  TqRotationKind kind_;
  int dim_;
  std::vector<float> signs_;   // (dim) hadamard: the diagonal of D
  std::vector<float> matrix_;  // (dim, dim) dense: R row-major
};

// In-place unnormalized fast Walsh-Hadamard transform; n a power of two.
void tq_fwht(float* x, int n);

// ---------------------------------------------------------------------------------------------
// Record layout of one token (all offsets in bytes from the token's record start):
//   [fp16 ||x||] [codes of channels [0, n_hi) at bits_hi] [codes of [n_hi, dim) at bits_lo]
//   (prod only:) [fp16 ||r||] [sign bits of S r, dim bits]
// Codes of a segment are one little-endian bit stream: the code of channel c (within the segment)
// occupies bits [bits * c, bits * c + bits), bit 0 of byte 0 first (4-bit codes: channel 2j in the
// low nibble of byte j). The sign bits follow the same rule with bits = 1.
// Why: a group of 16 channels is 2 * bits contiguous bytes, so an AVX-512 kernel turns it into 16
// code lanes with one byte permute (vpermb) and one variable shift, and AVX2 does 8 with a
// broadcast and a variable shift; a codebook of 2^bits entries repeated to 16 then maps a lane to
// its centroid with one vpermps, whatever junk the next channel's bits leave above the code.
// Fractional rates split channels: the first n_hi rotated coordinates get one bit more. After a
// random rotation the coordinates are exchangeable, so which ones get the extra bit does not
// matter statistically; a contiguous prefix keeps both segments 16-channel (2 * bits byte) aligned.
struct TqLayout {
  int dim = 0;
  int n_hi = 0;        // channels [0, n_hi) at bits_hi; multiple of 16
  int bits_hi = 0;
  int bits_lo = 0;     // channels [n_hi, dim) at bits_lo (unused when n_hi == dim)
  bool qjl = false;
  int off_hi = 2;      // codes of the high segment
  int off_lo = 0;      // codes of the low segment
  int off_qjl = 0;     // fp16 ||r||, then dim/8 bytes of signs
  int record_bytes = 0;
};

// Bytes of one record; tq_layout_make lays records out with exactly this size, so effective bits
// are the code bits plus 16 (norm) or 32 (norm and ||r||) per dim channels and nothing else.
constexpr int tq_record_bytes(int dim, int n_hi, int bits_hi, int bits_lo, bool qjl) {
  return 2 + (n_hi * bits_hi + (dim - n_hi) * bits_lo) / 8 + (qjl ? 2 + dim / 8 : 0);
}
static_assert(tq_record_bytes(128, 128, 4, 0, false) == 66, "tq4, head_dim 128: norm + 64 code bytes");
static_assert(tq_record_bytes(128, 64, 4, 3, false) == 2 + 32 + 24, "tq3.5: 64 channels at 4 bits, 64 at 3");
static_assert(tq_record_bytes(128, 128, 2, 0, true) == 2 + 32 + 2 + 16, "tq3_qjl: 2-bit codes, norm of r, signs");

// dim % 16 == 0; n_hi % 16 == 0. Throws kvq::Error otherwise.
TqLayout tq_layout_make(int dim, int n_hi, int bits_hi, int bits_lo, bool qjl);

// Packs / unpacks `n` codes (n % 16 == 0) of `bits` bits as the segment bit stream above.
void tq_pack_codes(const uint8_t* codes, int n, int bits, uint8_t* out);
void tq_unpack_codes(const uint8_t* in, int n, int bits, uint8_t* codes);

// ---------------------------------------------------------------------------------------------
// Kernels over token records. Scalar reference, AVX2 and AVX-512 variants share the signatures.

struct TqKernelArgs {
  const TqLayout* layout = nullptr;
  const float* cb_hi = nullptr;  // (16) codebook of the high segment, padded with zeros
  const float* cb_lo = nullptr;  // (16) codebook of the low segment
  float qjl_scale = 0;           // sqrt(pi/2) / dim
};

// out[i * out_stride + t] = ||x_t|| * (<qp_i, c_t> + ||r_t|| * qjl_scale * <Sq_i, sign_t>)
// qp: (n_q, qp_stride) rotated queries; for prod, S R q follows at qp + dim.
// recs: (n, record_bytes) token records.
using TqScoresFn = void (*)(const TqKernelArgs& a, const float* qp, int qp_stride, int n_q,
                            const uint8_t* recs, int n, float* out, int out_stride);
// acc[i * dim + c] += sum_t p[i * p_stride + t] * ||x_t|| * c_t[c]   (rotated basis, MSE part)
// p: (n_q, p_stride); recs: (n, record_bytes); acc: (n_q, dim).
using TqAccumulateFn = void (*)(const TqKernelArgs& a, const float* p, int p_stride, int n_q,
                                const uint8_t* recs, int n, float* acc);

// The AVX-512 scores run on int8 dot products (vpdpbusd, 64 multiply-adds per instruction, as the
// int8 row kernels after quantizing the query once per step): codebook entries become
// C = round(c / cs) with cs = max|c| / kTqScoreCbMax, each rotated query Q = round(q / qs) with
// qs = max|q| / kTqScoreQMax. With q = qs Q + eq, c = cs C + ec, |eq| <= qs / 2, |ec| <= cs / 2,
// expanding q c - qs cs Q C bounds the difference per score from the float reference by
//   ||x|| * (||q||_1 * cs / 2 + dim * max|c| * qs / 2 + dim * qs * cs / 4)
// (tq_score_error_bound). The stored codes and centroids, and with them the values, the
// accumulate path and every other variant, are untouched. QJL (prod) keys and queries with a
// non-finite entry take the float path: a rounded codebook is a fixed, query-correlated
// perturbation, which would bias the otherwise unbiased prod estimator.
constexpr int kTqScoreCbMax = 127;
constexpr int kTqScoreQMax = 127;
inline double tq_score_error_bound(double x_norm, double q_l1, double q_max, double cb_max, int dim) {
  const double qs = q_max / kTqScoreQMax, cs = cb_max / kTqScoreCbMax;
  return x_norm * (q_l1 * cs / 2 + dim * cb_max * qs / 2 + dim * qs * cs / 4);
}

// The AVX-512 accumulate (64-channel steps within a segment) runs in bf16 (vdpbf16ps, 32
// multiply-adds per instruction, two tokens per channel pair): weights w = p * ||x|| and
// centroids are rounded to bf16 (RNE, relative error <= 2^-9 each; weights below 2^-126 flush to
// zero), products are exact and sums fp32, so per output channel
//   |d acc[c]| <= (2^-8 + 2^-18) * sum_t |w_t * c_t[c]|   (+ the fp32 summation error)
// kTqAccumBf16Rel rounds that up for tests. Steps across a segment boundary, 16/32-channel
// remainders, AVX2 and scalar accumulate in fp32.
constexpr double kTqAccumBf16Rel = 1.0 / 128;

// Everything encode needs: the rotation (signs for Hadamard, the matrix for dense), decision
// thresholds and codebooks of both segments, and S for prod.
struct TqEncodeArgs {
  const TqLayout* layout = nullptr;
  TqRotationKind rotation = TqRotationKind::hadamard;
  const float* signs = nullptr;     // (dim) hadamard: the diagonal of D
  const float* matrix = nullptr;    // (dim, dim) dense: R row-major
  const float* bounds_hi = nullptr; // (16) ascending thresholds, padded with +inf
  const float* bounds_lo = nullptr; // (16)
  const float* cb_hi = nullptr;     // (16) as in TqKernelArgs
  const float* cb_lo = nullptr;
  const float* qjl = nullptr;       // (dim, dim) S row-major; prod only
};

// Encodes one token: x (dim) -> rec (record_bytes), every byte written. All variants produce
// identical bytes: double sums run in the fixed order of tq_dot_ref (8 interleaved lanes, then a
// fixed tree), the rotation and thresholds are the same float operations in the same order.
using TqEncodeFn = void (*)(const TqEncodeArgs& a, const float* x, uint8_t* rec);

// sum_c a[c] * b[c] in double, n % 8 == 0: lane l (0..7) sums the products with c % 8 == l in
// increasing c; the lanes are combined as ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7)). Float products
// are exact in double, so an FMA in a SIMD lane gives the same bits.
double tq_dot_ref(const float* a, const float* b, int n);

struct TqKernels {
  const char* name;
  TqScoresFn scores;
  TqAccumulateFn accumulate;
  TqEncodeFn encode;
};

const TqKernels& tq_kernels_scalar();
#if defined(KVQ_HAVE_SIMD)
const TqKernels& tq_kernels_avx2();
const TqKernels& tq_kernels_avx512();
#endif
// The one place that picks a variant: the best one not above `level`.
const TqKernels& tq_kernels_for(CpuLevel level);

// ---------------------------------------------------------------------------------------------
// Codecs.

struct TqConfig {
  double bits = 4;     // total code bits per element: 1..4, or fractional (2.25, 2.5, 3.5, ...)
  bool qjl = false;    // prod: bits-1 for the MSE quantizer + 1 for the QJL signs
  TqRotationKind rotation = TqRotationKind::hadamard;
};

// How a codec of cfg splits head_dim d: channels [0, n_hi) at bits_hi, the rest at bits_lo
// (n_hi = d for whole bits; the prod variant: bits - 1 for the MSE codes). Throws kvq::Error on
// invalid bits.
void tq_split_bits(const std::string& name, const TqConfig& cfg, int d, int* n_hi, int* bits_hi, int* bits_lo);

// Builds a TurboQuant codec; `name` is reported in info(). A Hadamard codec on a head_dim that is
// not a power of two uses the dense rotation instead. All KV heads of the layer share R (and S).
// Throws kvq::Error on invalid parameters (head_dim not a multiple of 16 or above 1024, bits).
std::unique_ptr<KvCodec> tq_codec_create(const std::string& name, const TqConfig& cfg,
                                         const KvCodecParams& p);

// Registers the tq* codecs and formats (called once by the registry).
void kv_register_turboquant();

}  // namespace kvq
