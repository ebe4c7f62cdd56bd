// TurboQuant building blocks: Lloyd-Max codebooks for the rotated-coordinate density, seeded
// random numbers, random rotations, the record layout and code packing.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <utility>

#include "core/error.h"
#include "kv/turboquant.h"

namespace kvq {

// ---------------------------------------------------------------------------------------------
// Lloyd-Max

namespace {

// Cumulative integrals of g(t) = (1 - t^2)^((d-3)/2), t g(t), t^2 g(t) on a fine grid, so that
// the mass and moments of any interval come from two interpolations. Trapezoid rule on 2^16
// cells over the region holding all but ~e^-100 of the mass: relative error ~ (h / sigma)^2.
struct DensityTable {
  double lo = 0, h = 0;
  std::vector<double> m0, m1, m2;  // (n + 1) cumulative, normalized so that m0.back() == 1

  explicit DensityTable(int dim) {
    const int n = 1 << 16;
    const double sigma = 1.0 / std::sqrt(double(dim));
    const double half = std::min(1.0, 15.0 * sigma);
    lo = -half;
    h = 2 * half / n;
    const double e = 0.5 * (dim - 3);
    auto g = [&](double t) {
      double s = 1 - t * t;
      return s <= 0 ? 0.0 : std::exp(e * std::log(s));
    };
    m0.assign(n + 1, 0);
    m1.assign(n + 1, 0);
    m2.assign(n + 1, 0);
    double t_prev = lo, g_prev = g(lo);
    for (int i = 1; i <= n; ++i) {
      double t = lo + i * h, gt = g(t);
      m0[i] = m0[i - 1] + 0.5 * h * (g_prev + gt);
      m1[i] = m1[i - 1] + 0.5 * h * (t_prev * g_prev + t * gt);
      m2[i] = m2[i - 1] + 0.5 * h * (t_prev * t_prev * g_prev + t * t * gt);
      t_prev = t;
      g_prev = gt;
    }
    const double z = m0[n];
    for (int i = 0; i <= n; ++i) {
      m0[i] /= z;
      m1[i] /= z;
      m2[i] /= z;
    }
  }

  // Cumulative value of table `m` at t (clamped to the grid).
  double at(const std::vector<double>& m, double t) const {
    double x = (t - lo) / h;
    const int n = int(m.size()) - 1;
    if (x <= 0) return m[0];
    if (x >= n) return m[n];
    int i = int(x);
    double f = x - i;
    return m[i] + f * (m[i + 1] - m[i]);
  }

  // Smallest t with mass(-inf, t) >= p, by bisection on the cumulative table.
  double quantile(double p) const {
    double a = lo, b = lo + h * double(m0.size() - 1);
    for (int it = 0; it < 100; ++it) {
      double mid = 0.5 * (a + b);
      (at(m0, mid) < p ? a : b) = mid;
    }
    return 0.5 * (a + b);
  }
};

TqCodebook compute_lloyd_max(int bits, int dim) {
  const int k = 1 << bits;
  DensityTable tab(dim);
  const double sigma = 1.0 / std::sqrt(double(dim));
  std::vector<double> c(static_cast<size_t>(k)), t(static_cast<size_t>(k + 1));
  // Start from the centroids of equal-mass cells: already close, and symmetric.
  for (int i = 0; i < k; ++i) {
    double a = tab.quantile(double(i) / k), b = tab.quantile(double(i + 1) / k);
    if (i == 0) a = -1;
    if (i == k - 1) b = 1;
    c[size_t(i)] = (tab.at(tab.m1, b) - tab.at(tab.m1, a)) / (tab.at(tab.m0, b) - tab.at(tab.m0, a));
  }
  TqCodebook cb;
  cb.bits = bits;
  cb.dim = dim;
  const int max_iter = 100000;
  int it = 0;
  for (; it < max_iter; ++it) {
    t[0] = -1;
    t[size_t(k)] = 1;
    for (int i = 1; i < k; ++i) t[size_t(i)] = 0.5 * (c[size_t(i - 1)] + c[size_t(i)]);
    double delta = 0;
    for (int i = 0; i < k; ++i) {
      double mass = tab.at(tab.m0, t[size_t(i + 1)]) - tab.at(tab.m0, t[size_t(i)]);
      double mom = tab.at(tab.m1, t[size_t(i + 1)]) - tab.at(tab.m1, t[size_t(i)]);
      double ci = mass > 0 ? mom / mass : 0.5 * (t[size_t(i)] + t[size_t(i + 1)]);
      delta = std::max(delta, std::fabs(ci - c[size_t(i)]));
      c[size_t(i)] = ci;
    }
    // Enforce exact symmetry (the density is even); Lloyd keeps it up to rounding.
    for (int i = 0; i < k / 2; ++i) {
      double s = 0.5 * (c[size_t(k - 1 - i)] - c[size_t(i)]);
      c[size_t(i)] = -s;
      c[size_t(k - 1 - i)] = s;
    }
    // Converged far below float resolution of the centroids; the cumulative tables' rounding
    // (~1e-16 of the total mass) leaves a ~1e-13 sigma jitter, so do not ask for less than 1e-10.
    if (delta < 1e-10 * sigma) break;
  }
  KVQ_CHECK(it < max_iter, "Lloyd-Max did not converge (bits {}, dim {})", bits, dim);
  cb.iterations = it + 1;
  // MSE = sum over cells of E[(t - c_i)^2] = m2 - 2 c_i m1 + c_i^2 m0.
  t[0] = -1;
  t[size_t(k)] = 1;
  for (int i = 1; i < k; ++i) t[size_t(i)] = 0.5 * (c[size_t(i - 1)] + c[size_t(i)]);
  double mse = 0;
  for (int i = 0; i < k; ++i) {
    double a = t[size_t(i)], b = t[size_t(i + 1)], ci = c[size_t(i)];
    double w0 = tab.at(tab.m0, b) - tab.at(tab.m0, a);
    double w1 = tab.at(tab.m1, b) - tab.at(tab.m1, a);
    double w2 = tab.at(tab.m2, b) - tab.at(tab.m2, a);
    mse += w2 - 2 * ci * w1 + ci * ci * w0;
  }
  cb.coord_mse = mse;
  cb.centroids.resize(size_t(k));
  for (int i = 0; i < k; ++i) cb.centroids[size_t(i)] = float(c[size_t(i)]);
  cb.bounds.resize(size_t(k - 1));
  for (int i = 1; i < k; ++i) cb.bounds[size_t(i - 1)] = float(t[size_t(i)]);
  return cb;
}

}  // namespace

const TqCodebook& tq_lloyd_max(int bits, int dim) {
  if (bits < 1 || bits > 8) fail("TurboQuant: codebook bits must be 1..8, got {}", bits);
  if (dim < 8) fail("TurboQuant: dimension must be >= 8, got {}", dim);
  static std::mutex mu;
  static std::map<std::pair<int, int>, std::unique_ptr<TqCodebook>> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = cache[{bits, dim}];
  if (!slot) slot = std::make_unique<TqCodebook>(compute_lloyd_max(bits, dim));
  return *slot;
}

double tq_lloyd_max_mse(int bits, int dim) { return dim * tq_lloyd_max(bits, dim).coord_mse; }

std::vector<float> tq_codebook(int bits, int dim) { return tq_lloyd_max(bits, dim).centroids; }

// ---------------------------------------------------------------------------------------------
// Random numbers: splitmix64 to derive seeds, xoshiro256** for streams, Box-Muller for normals.

namespace {

uint64_t splitmix64(uint64_t& s) {
  uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

struct Xoshiro256 {
  uint64_t s[4];
  explicit Xoshiro256(uint64_t seed) {
    for (auto& w : s) w = splitmix64(seed);
  }
  static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  uint64_t next() {
    uint64_t r = rotl(s[1] * 5, 7) * 9, t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return r;
  }
  // Uniform in (0, 1]: never 0, so log() is finite.
  double uniform() { return (double(next() >> 11) + 1.0) * 0x1.0p-53; }
};

}  // namespace

uint64_t tq_derive_seed(uint64_t seed, int layer, KvRole role, uint64_t purpose) {
  uint64_t s = seed;
  uint64_t h = splitmix64(s);
  s = h ^ (uint64_t(uint32_t(layer)) * 0xd1342543de82ef95ull);
  h = splitmix64(s);
  s = h ^ (role == KvRole::key ? 0x4b4559ull : 0x56414cull);
  h = splitmix64(s);
  s = h ^ purpose;
  return splitmix64(s);
}

void tq_gaussian(uint64_t seed, float* out, size_t n) {
  Xoshiro256 rng(seed);
  for (size_t i = 0; i < n; i += 2) {
    double r = std::sqrt(-2.0 * std::log(rng.uniform()));
    double a = 6.283185307179586 * rng.uniform();
    out[i] = float(r * std::cos(a));
    if (i + 1 < n) out[i + 1] = float(r * std::sin(a));
  }
}

// ---------------------------------------------------------------------------------------------
// Rotations

void tq_fwht(float* x, int n) {
  for (int len = 1; len < n; len <<= 1)
    for (int i = 0; i < n; i += 2 * len)
      for (int j = i; j < i + len; ++j) {
        float a = x[j], b = x[j + len];
        x[j] = a + b;
        x[j + len] = a - b;
      }
}

TqRotation::TqRotation(TqRotationKind kind, int dim, uint64_t seed) : kind_(kind), dim_(dim) {
  if (dim < 8 || dim > 1024) fail("TurboQuant: head_dim must be in 8..1024, got {}", dim);
  if (kind == TqRotationKind::hadamard) {
    if (dim & (dim - 1))
      fail("TurboQuant: the Hadamard rotation needs a power-of-two dimension (64, 128, 256), got {}; "
           "use the dense rotation",
           dim);
    Xoshiro256 rng(seed);
    signs_.resize(size_t(dim));
    for (auto& s : signs_) s = (rng.next() >> 63) ? -1.f : 1.f;
    return;
  }
  // Dense: Gram-Schmidt (twice, for orthogonality to double rounding) on the columns of a
  // Gaussian matrix. The resulting Q has a positive-diagonal R factor, which makes Q Haar.
  const size_t d = size_t(dim);
  std::vector<float> g(d * d);
  tq_gaussian(seed, g.data(), g.size());
  std::vector<double> q(d * d);  // column-major: column j at q[j * d]
  for (size_t j = 0; j < d; ++j)
    for (size_t i = 0; i < d; ++i) q[j * d + i] = g[i * d + j];
  for (size_t j = 0; j < d; ++j) {
    double* v = &q[j * d];
    for (int pass = 0; pass < 2; ++pass)
      for (size_t k = 0; k < j; ++k) {
        const double* u = &q[k * d];
        double dot = 0;
        for (size_t i = 0; i < d; ++i) dot += u[i] * v[i];
        for (size_t i = 0; i < d; ++i) v[i] -= dot * u[i];
      }
    double nrm = 0;
    for (size_t i = 0; i < d; ++i) nrm += v[i] * v[i];
    nrm = std::sqrt(nrm);
    KVQ_CHECK(nrm > 0, "degenerate Gaussian matrix");
    for (size_t i = 0; i < d; ++i) v[i] /= nrm;
  }
  // R's rows are Q's columns (R = Q^T is Haar as well).
  matrix_.resize(d * d);
  for (size_t r = 0; r < d; ++r)
    for (size_t c = 0; c < d; ++c) matrix_[r * d + c] = float(q[r * d + c]);
}

void TqRotation::forward(const float* x, float* y) const {
  const int d = dim_;
  if (kind_ == TqRotationKind::hadamard) {
    const float s = 1.f / std::sqrt(float(d));
    for (int i = 0; i < d; ++i) y[i] = x[i] * signs_[size_t(i)];
    tq_fwht(y, d);
    for (int i = 0; i < d; ++i) y[i] *= s;
    return;
  }
  float tmp[1024];
  for (int r = 0; r < d; ++r) {
    const float* row = &matrix_[size_t(r) * size_t(d)];
    double acc = 0;
    for (int c = 0; c < d; ++c) acc += double(row[c]) * x[c];
    tmp[r] = float(acc);
  }
  std::memcpy(y, tmp, sizeof(float) * size_t(d));
}

void TqRotation::inverse(const float* y, float* x) const {
  const int d = dim_;
  if (kind_ == TqRotationKind::hadamard) {
    const float s = 1.f / std::sqrt(float(d));
    if (x != y) std::memcpy(x, y, sizeof(float) * size_t(d));
    tq_fwht(x, d);
    for (int i = 0; i < d; ++i) x[i] *= s * signs_[size_t(i)];
    return;
  }
  double tmp[1024] = {};
  for (int r = 0; r < d; ++r) {
    const float* row = &matrix_[size_t(r) * size_t(d)];
    const double yr = y[r];
    for (int c = 0; c < d; ++c) tmp[c] += double(row[c]) * yr;
  }
  for (int c = 0; c < d; ++c) x[c] = float(tmp[c]);
}

// ---------------------------------------------------------------------------------------------
// Layout and packing

TqLayout tq_layout_make(int dim, int n_hi, int bits_hi, int bits_lo, bool qjl) {
  if (dim % 16 != 0 || dim <= 0)
    fail("TurboQuant: head_dim must be a positive multiple of 16, got {}", dim);
  if (n_hi % 16 != 0 || n_hi <= 0 || n_hi > dim)
    fail("TurboQuant: the high-bit channel count must be a multiple of 16 in (0, {}], got {}", dim, n_hi);
  if (bits_hi < 1 || bits_hi > 4 || (n_hi < dim && (bits_lo < 1 || bits_lo > 4)))
    fail("TurboQuant: code bits must be 1..4 (got {} and {})", bits_hi, bits_lo);
  TqLayout l;
  l.dim = dim;
  l.n_hi = n_hi;
  l.bits_hi = bits_hi;
  l.bits_lo = n_hi < dim ? bits_lo : 0;
  l.qjl = qjl;
  l.off_hi = 2;
  l.off_lo = l.off_hi + n_hi * bits_hi / 8;
  l.off_qjl = l.off_lo + (dim - n_hi) * l.bits_lo / 8;
  l.record_bytes = l.off_qjl + (qjl ? 2 + dim / 8 : 0);
  KVQ_CHECK(l.record_bytes == tq_record_bytes(dim, n_hi, bits_hi, l.bits_lo, qjl), "layout {} bytes", l.record_bytes);
  return l;
}

void tq_pack_codes(const uint8_t* codes, int n, int bits, uint8_t* out) {
  std::memset(out, 0, size_t(n) * size_t(bits) / 8);
  const unsigned mask = (1u << bits) - 1;
  for (int c = 0; c < n; ++c) {
    const int bit = bits * c;
    const unsigned v = (codes[c] & mask) << (bit % 8);  // at most 11 bits: spans two bytes
    out[bit / 8] = uint8_t(out[bit / 8] | v);
    if (v >> 8) out[bit / 8 + 1] = uint8_t(out[bit / 8 + 1] | (v >> 8));
  }
}

void tq_unpack_codes(const uint8_t* in, int n, int bits, uint8_t* codes) {
  const unsigned mask = (1u << bits) - 1;
  for (int c = 0; c < n; ++c) {
    const int bit = bits * c;
    unsigned v = in[bit / 8];
    if (bit % 8 + bits > 8) v |= unsigned(in[bit / 8 + 1]) << 8;
    codes[c] = uint8_t((v >> (bit % 8)) & mask);
  }
}

}  // namespace kvq
