// Weight types: dequantization against an independent reference (tests/golden, written by
// scripts/ref_dequant.py from the gguf package's numpy code), and every matmul kernel level
// against matmul_ref on random and adversarial inputs.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "core/cpu.h"
#include "core/dtypes.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "weights/blocks.h"
#include "weights/glu.h"
#include "weights/kernels.h"
#include "weights/weights.h"

using namespace kvq;

namespace {

const GgmlType kTypes[] = {GgmlType::F32,  GgmlType::F16,  GgmlType::BF16, GgmlType::Q8_0,
                           GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1,
                           GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K, GgmlType::Q2_K,
                           GgmlType::Q3_K, GgmlType::IQ4_NL, GgmlType::IQ4_XS, GgmlType::MXFP4};

int block_size(GgmlType t) { return ggml_type_traits(uint32_t(t))->block_size; }
size_t type_size(GgmlType t) { return ggml_type_traits(uint32_t(t))->type_size; }

// ---------------------------------------------------------------- golden dequantization

struct GoldenRecord {
  uint32_t type;
  std::vector<uint8_t> raw;
  std::vector<float> vals;
};

std::vector<GoldenRecord> read_golden(const std::string& path) {
  std::vector<GoldenRecord> out;
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) return out;
  for (;;) {
    char magic[4];
    uint32_t hdr[3];
    if (std::fread(magic, 1, 4, f) != 4) break;
    if (std::memcmp(magic, "KVQD", 4) != 0 || std::fread(hdr, 4, 3, f) != 3) {
      ADD_FAILURE() << "corrupt golden file " << path;
      break;
    }
    GoldenRecord r{hdr[0], std::vector<uint8_t>(hdr[2]), std::vector<float>(hdr[1])};
    if (std::fread(r.raw.data(), 1, r.raw.size(), f) != r.raw.size() ||
        std::fread(r.vals.data(), 4, r.vals.size(), f) != r.vals.size()) {
      ADD_FAILURE() << "truncated golden file " << path;
      break;
    }
    out.push_back(std::move(r));
  }
  std::fclose(f);
  return out;
}

// Distance in units in the last place (0 for bit-identical values, including +-0 vs -+0).
int64_t ulp_distance(float a, float b) {
  if (a == b) return 0;
  auto key = [](float f) {
    int32_t i;
    std::memcpy(&i, &f, 4);
    return i < 0 ? int64_t(INT32_MIN) - i : int64_t(i);
  };
  return std::llabs(key(a) - key(b));
}

TEST(WeightsGolden, DequantizeMatchesIndependentReference) {
  for (GgmlType t : kTypes) {
    const std::string path =
        std::string(KVQ_SOURCE_DIR) + "/tests/golden/dequant_" + ggml_type_name(t) + ".bin";
    auto recs = read_golden(path);
    ASSERT_FALSE(recs.empty()) << "missing " << path << " (run scripts/ref_dequant.py)";
    for (size_t k = 0; k < recs.size(); ++k) {
      const auto& r = recs[k];
      ASSERT_EQ(r.type, uint32_t(t));
      const int64_t n = int64_t(r.vals.size());
      ASSERT_EQ(ggml_row_bytes(t, n), r.raw.size());
      std::vector<float> ref(static_cast<size_t>(n)), fast(static_cast<size_t>(n));
      dequantize_row_ref(t, r.raw.data(), ref.data(), n);
      dequantize_row(t, r.raw.data(), fast.data(), n);
      int64_t worst = 0;
      for (int64_t i = 0; i < n; ++i) {
        worst = std::max(worst, ulp_distance(ref[size_t(i)], r.vals[size_t(i)]));
        ASSERT_EQ(f32_bits(fast[size_t(i)]), f32_bits(ref[size_t(i)])) << ggml_type_name(t) << " i=" << i;
      }
      EXPECT_LE(worst, 1) << ggml_type_name(t) << " record " << k;
    }
  }
}

// MXFP4 against values worked out here: every code (its E2M1 value, sign bit 3, doubled) in
// both nibbles, under scales 2^(e - 128) from the subnormal e = 0 to e = 254, where the larger
// levels overflow float as they do in ggml's dequantization.
TEST(WeightsMxfp4, DequantizesEveryCodeAndScale) {
  // E2M1: 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives; code 8 (negative zero) is 0
  const float e2m1[16] = {0.f, 0.5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, 0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
  struct Scale {
    uint8_t e;
    float d;  // 2^(e - 128)
  };
  const Scale scales[] = {{0, 0x1p-128f}, {1, 0x1p-127f}, {2, 0x1p-126f}, {127, 0.5f}, {128, 1.0f}, {254, 0x1p126f}};
  for (const Scale& sc : scales) {
    EXPECT_EQ(e8m0_half_to_f32(sc.e), sc.d) << int(sc.e);
    // block 0: element j is code j, element j + 16 code 15 - j; block 1 the other way round
    BlockMXFP4 blk[2];
    for (int b = 0; b < 2; ++b) {
      blk[b].e = sc.e;
      for (int j = 0; j < 16; ++j) {
        const int lo = b == 0 ? j : 15 - j, hi = 15 - lo;
        blk[b].qs[j] = uint8_t(lo | (hi << 4));
      }
    }
    float y[64];
    dequantize_row_ref(GgmlType::MXFP4, blk, y, 64);
    for (int i = 0; i < 64; ++i) {
      const int b = i / 32, j = i % 16;
      const int lo = b == 0 ? j : 15 - j;
      const int code = i % 32 < 16 ? lo : 15 - lo;
      // 2 * e2m1 * 2^(e - 128) = e2m1 * 2^(e - 127): exact, or infinite past FLT_MAX
      const float want = float(std::ldexp(double(e2m1[code]), int(sc.e) - 127));
      EXPECT_EQ(y[i], want) << "e=" << int(sc.e) << " code " << code << " element " << i;
    }
  }
  // the values by name: e = 128 gives the doubled levels themselves, e = 127 the E2M1 values, e = 0
  // multiples of 2^-128, and e = 254 infinity from level 4 up (4 * 2^126 = 2^128)
  BlockMXFP4 b{};
  b.qs[0] = 0x7F;  // element 0: code 15 (-12 doubled), element 16: code 7 (12)
  b.qs[1] = 0x91;  // element 1: code 1 (1), element 17: code 9 (-1)
  float y[32];
  b.e = 128;
  dequantize_row_ref(GgmlType::MXFP4, &b, y, 32);
  EXPECT_EQ(y[0], -12.f);
  EXPECT_EQ(y[16], 12.f);
  EXPECT_EQ(y[1], 1.f);
  EXPECT_EQ(y[17], -1.f);
  EXPECT_EQ(y[2], 0.f);
  b.e = 127;
  dequantize_row_ref(GgmlType::MXFP4, &b, y, 32);
  EXPECT_EQ(y[0], -6.f);
  EXPECT_EQ(y[1], 0.5f);
  b.e = 0;
  dequantize_row_ref(GgmlType::MXFP4, &b, y, 32);
  EXPECT_EQ(y[1], 0x1p-128f);
  EXPECT_EQ(y[16], 12 * 0x1p-128f);
  b.e = 254;
  dequantize_row_ref(GgmlType::MXFP4, &b, y, 32);
  EXPECT_EQ(y[1], 0x1p126f);
  EXPECT_TRUE(std::isinf(y[16]) && y[16] > 0);
  EXPECT_TRUE(std::isinf(y[0]) && y[0] < 0);
}

// ---------------------------------------------------------------- random weights

enum class ScaleMode { normal, tiny, huge, zero, mixed };

f16_t pick_scale(ScaleMode m, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(0.2f, 1.0f);
  std::bernoulli_distribution neg(0.3);
  float v = 0;
  switch (m) {
    case ScaleMode::normal: v = 0.01f * u(rng); break;
    case ScaleMode::tiny: v = 3e-7f * u(rng); break;  // fp16 subnormal
    case ScaleMode::huge: v = 3000.0f * u(rng); break;
    case ScaleMode::zero: v = 0; break;
    case ScaleMode::mixed: {
      const float choices[] = {0.0f, 3e-7f, 0.01f, 0.5f, 3000.0f};
      v = choices[rng() % 5] * u(rng);
      break;
    }
  }
  return f32_to_f16(neg(rng) ? -v : v);
}

// MXFP4's E8M0 scale byte (d = 2^(e - 128), never zero or negative) for the same modes: ordinary,
// the subnormal and smallest scales, large, the smallest for `zero`, and a mix with 1 and 2^-1.
uint8_t pick_e8m0(ScaleMode m, std::mt19937& rng) {
  switch (m) {
    case ScaleMode::normal: return uint8_t(118 + rng() % 7);  // 2^-10 .. 2^-4
    case ScaleMode::tiny: return uint8_t(rng() % 21);         // 2^-128 (subnormal) .. 2^-108
    case ScaleMode::huge: return uint8_t(136 + rng() % 5);    // 2^8 .. 2^12
    case ScaleMode::zero: return 0;
    case ScaleMode::mixed: {
      const uint8_t choices[] = {0, 1, 2, 100, 121, 127, 128, 139};
      return choices[rng() % 8];
    }
  }
  return 0;
}

// n_out rows of n_in elements with row stride `row_bytes` (>= packed row).
std::vector<uint8_t> random_weights(GgmlType t, int64_t n_in, int64_t n_out, size_t row_bytes,
                                    ScaleMode m, std::mt19937& rng) {
  std::vector<uint8_t> w(row_bytes * size_t(n_out));
  for (auto& b : w) b = uint8_t(rng());
  const int64_t nb = n_in / block_size(t);
  const size_t ts = type_size(t);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const float mag = m == ScaleMode::huge ? 1e4f : m == ScaleMode::tiny ? 1e-6f : m == ScaleMode::zero ? 0.0f : 0.05f;
  for (int64_t r = 0; r < n_out; ++r) {
    uint8_t* row = w.data() + size_t(r) * row_bytes;
    for (int64_t b = 0; b < nb; ++b) {
      uint8_t* blk = row + size_t(b) * ts;
      auto put16 = [&](size_t off, uint16_t v) { std::memcpy(blk + off, &v, 2); };
      switch (t) {
        case GgmlType::F32: {
          float v = nd(rng) * mag;
          std::memcpy(blk, &v, 4);
          break;
        }
        case GgmlType::F16: put16(0, f32_to_f16(nd(rng) * std::min(mag, 100.0f))); break;
        case GgmlType::BF16: put16(0, f32_to_bf16(nd(rng) * mag)); break;
        case GgmlType::Q4_0: case GgmlType::Q5_0: case GgmlType::Q8_0: case GgmlType::IQ4_NL: case GgmlType::IQ4_XS:
          put16(0, pick_scale(m, rng));
          break;
        case GgmlType::Q4_1: case GgmlType::Q5_1: case GgmlType::Q4_K: case GgmlType::Q5_K:
          put16(0, pick_scale(m, rng));
          put16(2, pick_scale(m, rng));
          break;
        case GgmlType::Q6_K: put16(208, pick_scale(m, rng)); break;
        case GgmlType::Q2_K:
          put16(80, pick_scale(m, rng));
          put16(82, pick_scale(m, rng));
          break;
        case GgmlType::Q3_K: put16(108, pick_scale(m, rng)); break;
        case GgmlType::MXFP4: blk[0] = pick_e8m0(m, rng); break;
        default: break;
      }
    }
  }
  return w;
}

enum class ActMode { normal, zeros, constant, outlier, tiny, huge, sparse };

std::vector<float> random_acts(int64_t n_tok, int64_t n_in, ActMode m, std::mt19937& rng) {
  std::vector<float> x(size_t(n_tok * n_in));
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (auto& v : x) v = nd(rng);
  for (int64_t t = 0; t < n_tok; ++t) {
    float* xt = x.data() + t * n_in;
    switch (m) {
      case ActMode::normal: break;
      case ActMode::zeros: std::fill(xt, xt + n_in, 0.0f); break;
      case ActMode::constant: std::fill(xt, xt + n_in, -0.75f); break;
      case ActMode::outlier:  // a few channels 1000x the rest, as in real residual streams
        for (int k = 0; k < 3; ++k) xt[rng() % n_in] = (k ? 1 : -1) * 2000.0f;
        break;
      case ActMode::tiny: for (int64_t i = 0; i < n_in; ++i) xt[i] *= 1e-36f; break;
      case ActMode::huge: for (int64_t i = 0; i < n_in; ++i) xt[i] *= 1e25f; break;
      case ActMode::sparse: for (int64_t i = 0; i < n_in; ++i) if (rng() % 7) xt[i] = 0; break;
    }
  }
  return x;
}

// Bound on |matmul - matmul_ref| for one output. Quantized path: x is replaced blockwise by
// d*q with d = amax/127 and q = round(x/d), so |x_i - d q_i| <= d/2 (+ |amax - 127 d| when d
// itself is rounded, e.g. subnormal); the integer dot products are exact, and what remains is
// float rounding of per-block products and of the sum over blocks (n_blocks * 2^-23 relative
// to sum |w x|, kept generous). Float path: only the float rounding term.
double error_bound(GgmlType t, const float* w_row, const float* x, int64_t n_in) {
  const ActFormat af = act_format(t);
  const int64_t bs = af == ActFormat::q8a ? kQK : af == ActFormat::q8k ? kQKK : n_in;
  double quant = 0, mag = 0;
  for (int64_t b = 0; b < n_in; b += bs) {
    double amax = 0, wabs = 0;
    for (int64_t i = b; i < b + bs; ++i) {
      amax = std::max(amax, std::fabs(double(x[i])));
      wabs += std::fabs(double(w_row[i]));
      mag += std::fabs(double(w_row[i]) * double(x[i]));
    }
    if (af != ActFormat::f32) {
      const double d = double(float(amax) / 127.0f);
      quant += (0.5 * d + std::fabs(amax - 127.0 * d)) * wabs;
    }
  }
  const double n_terms = af == ActFormat::f32 ? double(n_in) : double(n_in / bs) + 8;
  return 1.0001 * quant + (n_terms * 1.2e-7 + 1e-6) * (mag + quant) + 1e-37;
}

struct Case {
  int64_t n_in, n_out, n_tok;
};

void check_parity(GgmlType t, const Case& c, ScaleMode sm, ActMode am, int threads, size_t pad,
                  std::mt19937& rng, const char* level) {
  const size_t rb = ggml_row_bytes(t, c.n_in) + pad;
  auto wbytes = random_weights(t, c.n_in, c.n_out, rb, sm, rng);
  auto x = random_acts(c.n_tok, c.n_in, am, rng);
  WeightView w{t, wbytes.data(), c.n_in, c.n_out, rb};
  std::vector<float> y(size_t(c.n_tok * c.n_out), NAN), yr(y.size());
  ThreadPool pool(threads);
  matmul(w, x.data(), c.n_tok, y.data(), pool);
  matmul_ref(w, x.data(), c.n_tok, yr.data());
  std::vector<float> row(size_t(c.n_in));
  int bad = 0;
  for (int64_t r = 0; r < c.n_out && bad < 5; ++r) {
    dequantize_row_ref(t, wbytes.data() + size_t(r) * rb, row.data(), c.n_in);
    for (int64_t k = 0; k < c.n_tok; ++k) {
      const double bound = error_bound(t, row.data(), x.data() + k * c.n_in, c.n_in);
      const float got = y[size_t(k * c.n_out + r)], want = yr[size_t(k * c.n_out + r)];
      if (!(std::fabs(double(got) - double(want)) <= bound)) {
        ADD_FAILURE() << level << " " << ggml_type_name(t) << " n_in=" << c.n_in << " n_out=" << c.n_out
                      << " n_tok=" << c.n_tok << " scale=" << int(sm) << " act=" << int(am)
                      << " threads=" << threads << " r=" << r << " t=" << k << ": got " << got
                      << " want " << want << " bound " << bound;
        ++bad;
      }
    }
  }
}

struct LevelCap {
  CpuLevel prev;
  explicit LevelCap(CpuLevel l) : prev(cpu_set_level(l)) {}
  ~LevelCap() { cpu_set_level(prev); }
};

const CpuLevel kLevels[] = {CpuLevel::scalar, CpuLevel::avx2, CpuLevel::avx512};

class MatmulParity : public ::testing::TestWithParam<GgmlType> {};

TEST_P(MatmulParity, AllLevelsMatchReference) {
  const GgmlType t = GetParam();
  const int64_t bs = block_size(t) == 1 ? 32 : block_size(t);
  // odd row counts and token counts exercise every tile remainder; n_in covers 1..several blocks
  // >= 12 tokens take the AVX-512 row-panel path: 16-row panels with a partial last one, token
  // tiles with a remainder, and more than one 64-token block; fewer go row by row through the
  // streaming tiles (AVX-512 below 12 tokens, AVX2 below 8), more through NR-row tiles
  const Case cases[] = {{bs, 1, 1}, {2 * bs, 7, 1}, {4 * bs, 37, 1}, {3 * bs, 13, 5},
                        {2 * bs, 9, 9}, {8 * bs, 21, 3}, {bs, 16, 8}, {3 * bs, 37, 70}, {2 * bs, 50, 13}};
  for (CpuLevel l : kLevels) {
    LevelCap cap(l);
    if (cpu_level() != l) continue;  // CPU lacks it: nothing more to test at this level
    std::mt19937 rng(1234 + int(t));
    for (const auto& c : cases)
      for (int threads : {1, 2}) check_parity(t, c, ScaleMode::normal, ActMode::normal, threads, 0, rng, cpu_level_name(l));
    // adversarial inputs on the streaming tiles (6 tokens) and on the row panels (13 tokens)
    for (const Case adv : {Case{4 * bs, 11, 6}, Case{4 * bs, 19, 13}})
      for (ScaleMode sm : {ScaleMode::normal, ScaleMode::tiny, ScaleMode::huge, ScaleMode::zero, ScaleMode::mixed})
        for (ActMode am : {ActMode::normal, ActMode::zeros, ActMode::constant, ActMode::outlier,
                           ActMode::tiny, ActMode::huge, ActMode::sparse}) {
          if (sm == ScaleMode::huge && am == ActMode::huge) continue;  // overflows float by design
          check_parity(t, adv, sm, am, 2, 0, rng, cpu_level_name(l));
        }
    // more rows than the panel path packs at once (~384 KiB: 128 rows at these row lengths)
    check_parity(t, {bs == kQKK ? 8 * bs : 64 * bs, 300, 13}, ScaleMode::normal, ActMode::outlier, 1, 0, rng,
                 cpu_level_name(l));
    // rows padded beyond their packed size (row_bytes is a stride, not a size)
    check_parity(t, {2 * bs, 6, 2}, ScaleMode::mixed, ActMode::normal, 1, 64, rng, cpu_level_name(l));
    check_parity(t, {2 * bs, 21, 9}, ScaleMode::mixed, ActMode::outlier, 2, 64, rng, cpu_level_name(l));
    check_parity(t, {2 * bs, 21, 14}, ScaleMode::mixed, ActMode::outlier, 2, 64, rng, cpu_level_name(l));
    if (block_size(t) == 1)  // float rows of any length (stories260K has n_in = 172): vector tails
      for (int64_t n_in : {1, 7, 172})
        check_parity(t, {n_in, 9, 5}, ScaleMode::normal, ActMode::normal, 1, 2, rng, cpu_level_name(l));
    if (HasFailure()) return;
  }
}

TEST_P(MatmulParity, SimdKernelsExist) {
  const GgmlType t = GetParam();
  EXPECT_NE(matmul_kernel_scalar(t), nullptr);
#if defined(KVQ_HAVE_SIMD)
  if (cpu_features().avx2 && cpu_features().fma) {
    EXPECT_NE(matmul_kernel_avx2(t), nullptr);
  }
  LevelCap cap(CpuLevel::avx512);
  if (cpu_level() == CpuLevel::avx512) {
    EXPECT_NE(matmul_kernel_avx512(t), nullptr);
  }
#endif
}

// Batch invariance: a token's outputs from one call over many tokens equal, bit for bit, those
// of a call over that token alone, at every level when matmul_batch_invariant() is set, and at
// the AVX2 and scalar levels always (their kernels sum each row and token on its own). Without
// it, AVX-512's prefill panels (12 or more tokens) round differently; the test only asks that
// they stay within the reference's bound there (AllLevelsMatchReference).
TEST_P(MatmulParity, BatchInvariantTokenByToken) {
  const GgmlType t = GetParam();
  const int64_t bs = block_size(t) == 1 ? 32 : block_size(t);
  const int64_t n_in = 4 * bs, n_out = 37, n_tok = 19;
  std::mt19937 rng(99 + int(t));
  const size_t rb = ggml_row_bytes(t, n_in);
  auto wbytes = random_weights(t, n_in, n_out, rb, ScaleMode::normal, rng);
  auto x = random_acts(n_tok, n_in, ActMode::normal, rng);
  WeightView w{t, wbytes.data(), n_in, n_out, rb};
  ThreadPool pool(2);
  struct Invariant {
    bool prev = matmul_batch_invariant();
    explicit Invariant(bool on) { matmul_set_batch_invariant(on); }
    ~Invariant() { matmul_set_batch_invariant(prev); }
  };
  for (CpuLevel l : kLevels) {
    LevelCap cap(l);
    if (cpu_level() != l) continue;
    for (bool on : {true, false}) {
      if (!on && l == CpuLevel::avx512) continue;  // the panels: not invariant by design
      Invariant inv(on);
      std::vector<float> all(size_t(n_tok * n_out)), one(static_cast<size_t>(n_out));
      matmul(w, x.data(), n_tok, all.data(), pool);
      for (int64_t k = 0; k < n_tok; ++k) {
        matmul(w, x.data() + k * n_in, 1, one.data(), pool);
        for (int64_t r = 0; r < n_out; ++r)
          ASSERT_EQ(std::memcmp(&one[size_t(r)], &all[size_t(k * n_out + r)], sizeof(float)), 0)
              << cpu_level_name(l) << " batch_invariant " << on << " token " << k << " row " << r << ": "
              << one[size_t(r)] << " alone vs " << all[size_t(k * n_out + r)] << " in the batch";
      }
    }
  }
}

// Several products in one pass (the experts of a step): each job's rows bit-equal to its own
// matmul, whatever the neighbours' types, widths and token counts, for jobs sharing activations
// (converted once) and for a job with no tokens.
TEST_P(MatmulParity, ManyJobsEqualEachAlone) {
  const GgmlType t = GetParam();
  const int64_t bs = block_size(t) == 1 ? 32 : block_size(t);
  std::mt19937 rng(7 + int(t));
  struct Shape { GgmlType type; int64_t n_in, n_out, n_tok; };
  const std::vector<Shape> shapes = {{t, 4 * bs, 37, 3}, {t, 4 * bs, 70, 3}, {GgmlType::F32, 4 * bs, 5, 3},
                                     {t, 2 * bs, 33, 1}, {t, 2 * bs, 16, 0}, {GgmlType::Q8_0, 64, 96, 13}};
  std::vector<std::vector<uint8_t>> wb;
  std::vector<WeightView> ws;
  std::vector<std::vector<float>> xs, ys;
  for (const Shape& sh : shapes) {
    const size_t rb = ggml_row_bytes(sh.type, sh.n_in);
    wb.push_back(random_weights(sh.type, sh.n_in, sh.n_out, rb, ScaleMode::normal, rng));
    ws.push_back({sh.type, wb.back().data(), sh.n_in, sh.n_out, rb});
    xs.push_back(random_acts(std::max<int64_t>(sh.n_tok, 1), sh.n_in, ActMode::normal, rng));
    ys.emplace_back(size_t(std::max<int64_t>(sh.n_tok, 1) * sh.n_out), -1.f);
  }
  ThreadPool pool(2);
  std::vector<MatmulJob> jobs;
  for (size_t j = 0; j < shapes.size(); ++j)
    jobs.push_back({&ws[j], j == 1 ? xs[0].data() : j == 2 ? xs[0].data() : xs[j].data(), shapes[j].n_tok, ys[j].data()});
  for (CpuLevel l : kLevels) {
    LevelCap cap(l);
    if (cpu_level() != l) continue;
    for (auto& y : ys) std::fill(y.begin(), y.end(), -1.f);
    matmul_many(jobs.data(), int(jobs.size()), pool);
    for (size_t j = 0; j < shapes.size(); ++j) {
      std::vector<float> alone(ys[j].size(), -1.f);
      matmul(ws[j], jobs[j].x, shapes[j].n_tok, alone.data(), pool);
      ASSERT_EQ(std::memcmp(alone.data(), ys[j].data(), alone.size() * sizeof(float)), 0) << cpu_level_name(l) << " job " << j;
    }
    EXPECT_EQ(ys[4][0], -1.f);  // no tokens: nothing written
  }
}

// Every SIMD kernel against the scalar one on the very same quantized activations: the integer
// dot products are exact at every level, so the results may differ only by float rounding of the
// per-block products and their sum (far tighter than the activation-quantization bound of
// AllLevelsMatchReference, which a wrong code or scale could hide within). The SIMD kernels round
// per lane, where a block's code and offset terms are still apart: with a code equal to the offset
// (w = 0) under a huge activation both terms are large, so the bound scales with them.
TEST_P(MatmulParity, SimdKernelsEqualScalarOnTheSameActivations) {
  const GgmlType t = GetParam();
  const int64_t bs = block_size(t) == 1 ? 32 : block_size(t);
  const int64_t n_in = 4 * bs, n_out = 37;
  const ActFormat af = act_format(t);
  const size_t xs = act_row_bytes(af, n_in), rb = ggml_row_bytes(t, n_in);
  std::mt19937 rng(4321 + int(t));
  struct Level {
    const char* name;
    MatmulTileFn fn;
  };
  std::vector<Level> levels;
#if defined(KVQ_HAVE_SIMD)
  if (cpu_features().avx2 && cpu_features().fma) levels.push_back({"avx2", matmul_kernel_avx2(t)});
  {
    LevelCap cap(CpuLevel::avx512);
    if (cpu_level() == CpuLevel::avx512) {
      levels.push_back({"avx512", matmul_kernel_avx512(t)});
      levels.push_back({"avx512 streaming", matmul_kernel_avx512_streaming(t)});
    }
  }
#endif
  if (levels.empty()) GTEST_SKIP() << "no SIMD level on this CPU";
  for (ScaleMode sm : {ScaleMode::normal, ScaleMode::mixed})
    for (int64_t nt : {1, 3, 6, 13, 70}) {
      auto w = random_weights(t, n_in, n_out, rb, sm, rng);
      auto x = random_acts(nt, n_in, ActMode::outlier, rng);
      // the activations as every kernel reads them, and their dequantized values
      std::vector<uint8_t> xq(xs * size_t(nt));
      std::vector<float> xd(size_t(nt * n_in));
      for (int64_t k = 0; k < nt; ++k) {
        const float* xk = x.data() + k * n_in;
        float* dk = xd.data() + k * n_in;
        if (af == ActFormat::q8a) {
          auto* q = reinterpret_cast<BlockQ8A*>(xq.data() + size_t(k) * xs);
          quantize_act_q8a(xk, q, n_in);
          for (int64_t i = 0; i < n_in; ++i) dk[i] = q[i / kQK].d * float(q[i / kQK].qs[i % kQK]);
        } else if (af == ActFormat::q8k) {
          auto* q = reinterpret_cast<BlockQ8K*>(xq.data() + size_t(k) * xs);
          quantize_act_q8k(xk, q, n_in);
          for (int64_t i = 0; i < n_in; ++i) dk[i] = q[i / kQKK].d * float(q[i / kQKK].qs[i % kQKK]);
        } else {
          std::memcpy(xq.data() + size_t(k) * xs, xk, xs);
          std::memcpy(dk, xk, xs);
        }
      }
      std::vector<float> ref(size_t(nt * n_out)), got(ref.size());
      matmul_kernel_scalar(t)(w.data(), rb, n_out, xq.data(), xs, nt, n_in, ref.data(), n_out);
      std::vector<float> row(static_cast<size_t>(n_in));
      for (const Level& lv : levels) {
        ASSERT_NE(lv.fn, nullptr) << lv.name;
        std::fill(got.begin(), got.end(), NAN);
        lv.fn(w.data(), rb, n_out, xq.data(), xs, nt, n_in, got.data(), n_out);
        int bad = 0;
        for (int64_t r = 0; r < n_out && bad < 3; ++r) {
          dequantize_row_ref(t, w.data() + size_t(r) * rb, row.data(), n_in);
          // The scale of the float rounding: the kernels sum a block's codes and its offset (or min)
          // in separate terms, each up to max |w| + the block's range of w times |x|; float types
          // sum w x itself.
          std::vector<double> amag(static_cast<size_t>(n_in));
          const int64_t blk = block_size(t);
          for (int64_t b0 = 0; b0 < n_in; b0 += blk) {
            double lo = row[size_t(b0)], hi = lo, amax = 0;
            for (int64_t i = b0; i < b0 + blk; ++i) {
              lo = std::min(lo, double(row[size_t(i)]));
              hi = std::max(hi, double(row[size_t(i)]));
              amax = std::max(amax, std::fabs(double(row[size_t(i)])));
            }
            for (int64_t i = b0; i < b0 + blk; ++i) amag[size_t(i)] = blk == 1 ? amax : amax + (hi - lo);
          }
          for (int64_t k = 0; k < nt; ++k) {
            double mag = 0;
            for (int64_t i = 0; i < n_in; ++i) mag += amag[size_t(i)] * std::fabs(double(xd[size_t(k * n_in + i)]));
            const float a = got[size_t(k * n_out + r)], b = ref[size_t(k * n_out + r)];
            if (!(std::fabs(double(a) - double(b)) <= 4e-6 * mag + 1e-30)) {
              ADD_FAILURE() << lv.name << " " << ggml_type_name(t) << " scale " << int(sm) << " nt " << nt << " row " << r
                            << " token " << k << ": " << a << " vs scalar " << b << " (rounding scale " << mag << ")";
              ++bad;
            }
          }
        }
      }
    }
}

// A block whose scale would be subnormal quantizes to zeros at every level (its inverse would
// overflow to infinity and give codes out of range).
TEST(ActQuant, SubnormalScaleBlocksQuantizeToZeros) {
  std::vector<float> x(256, 0.0f);
  x[0] = 1.5e-38f;
  x[1] = -1.5e-38f;
  x[40] = 1e-40f;
  BlockQ8A qa[8], qa2[8];
  BlockQ8K qk[1], qk2[1];
  quantize_act_q8a(x.data(), qa, 256);
  quantize_act_q8k(x.data(), qk, 256);
  for (const auto& b : qa) {
    EXPECT_EQ(b.d, 0.0f);
    for (int8_t q : b.qs) EXPECT_EQ(q, 0);
  }
  EXPECT_EQ(qk[0].d, 0.0f);
  for (int8_t q : qk[0].qs) EXPECT_EQ(q, 0);
  if (cpu_features().avx2) {
    quantize_act_q8a_avx2(x.data(), qa2, 256);
    quantize_act_q8k_avx2(x.data(), qk2, 256);
    EXPECT_EQ(std::memcmp(qa, qa2, sizeof qa), 0);
    EXPECT_EQ(std::memcmp(qk, qk2, sizeof qk), 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Types, MatmulParity, ::testing::ValuesIn(kTypes),
                         [](const auto& info) { return std::string(ggml_type_name(info.param)); });

// ---------------------------------------------------------------- activation quantizers

TEST(ActQuant, RoundTripWithinHalfStep) {
  std::mt19937 rng(7);
  auto x = random_acts(1, 1024, ActMode::outlier, rng);
  std::vector<BlockQ8A> qa(1024 / kQK);
  std::vector<BlockQ8K> qk(1024 / kQKK);
  quantize_act_q8a(x.data(), qa.data(), 1024);
  quantize_act_q8k(x.data(), qk.data(), 1024);
  for (int i = 0; i < 1024; ++i) {
    const auto& a = qa[size_t(i / kQK)];
    EXPECT_LE(std::fabs(x[size_t(i)] - a.d * a.qs[i % kQK]), 0.5f * a.d * 1.0001f);
    const auto& k = qk[size_t(i / kQKK)];
    EXPECT_LE(std::fabs(x[size_t(i)] - k.d * k.qs[i % kQKK]), 0.5f * k.d * 1.0001f);
  }
  for (const auto& k : qk)
    for (int g = 0; g < 16; ++g) {
      int s = 0;
      for (int j = 0; j < 16; ++j) s += k.qs[16 * g + j];
      EXPECT_EQ(k.bsum16[g], s);
      if (g % 2) {
        EXPECT_EQ(k.bsum32[g / 2], k.bsum16[g - 1] + k.bsum16[g]);
      }
    }
  for (const auto& a : qa) {
    int s = 0;
    for (int j = 0; j < kQK; ++j) s += a.qs[j];
    EXPECT_EQ(a.sum, s);
  }
}

TEST(ActQuant, SimdQuantizersAreBitIdentical) {
  if (!cpu_features().avx2) GTEST_SKIP() << "no AVX2";
  std::mt19937 rng(11);
  for (ActMode m : {ActMode::normal, ActMode::zeros, ActMode::constant, ActMode::outlier, ActMode::tiny,
                    ActMode::huge, ActMode::sparse}) {
    auto x = random_acts(1, 1024, m, rng);
    // a block with d = 1 exactly, so x = 2.5 and -3.5 are rounding ties (to even: 2, -4)
    x[0] = 127.0f;
    x[1] = 2.5f;
    x[2] = -3.5f;
    std::vector<BlockQ8A> a0(32), a1(32);
    std::vector<BlockQ8K> k0(4), k1(4);
    quantize_act_q8a(x.data(), a0.data(), 1024);
    quantize_act_q8a_avx2(x.data(), a1.data(), 1024);
    quantize_act_q8k(x.data(), k0.data(), 1024);
    quantize_act_q8k_avx2(x.data(), k1.data(), 1024);
    EXPECT_EQ(std::memcmp(a0.data(), a1.data(), a0.size() * sizeof(BlockQ8A)), 0) << int(m);
    EXPECT_EQ(std::memcmp(k0.data(), k1.data(), k0.size() * sizeof(BlockQ8K)), 0) << int(m);
  }
}

// ---------------------------------------------------------------- gated FFN activation

// The SIMD GLU evaluates act(x) = x / (1 + e^z) with a polynomial exp; against the std::tanh /
// std::exp reference it must stay within a few float ulps of |gate * up| (the reference's own
// 1 + tanh cancels for negative x, so relative error of act(x) itself is not the measure).
TEST(Glu, SimdMatchesReference) {
  const CpuFeatures& cf = cpu_features();
  if (!(cf.avx2 && cf.fma)) GTEST_SKIP() << "no AVX2";
  for (int variant = 0; variant < 2; ++variant) {
  if (variant == 1 && !cf.avx512f) continue;  // AVX-512: where the CPU has it
  auto* simd = variant == 0 ? glu_avx2 : glu_avx512;
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  for (GluAct act : {GluAct::silu, GluAct::gelu_tanh, GluAct::swiglu_oai})
    for (float mag : {1.0f, 4.0f, 30.0f, 1e-30f, 1e20f}) {
      const size_t n = 1000 + rng() % 37;  // a masked tail
      std::vector<float> g(n), u(n), want(n), got(n);
      for (size_t i = 0; i < n; ++i) {
        g[i] = nd(rng) * mag;
        u[i] = nd(rng);
      }
      // edges: zeros, the exp clamp region, infinities
      g[0] = 0.0f;
      g[1] = -0.0f;
      g[2] = 100.0f;
      g[3] = -100.0f;
      g[4] = INFINITY;
      g[5] = -INFINITY;
      g[6] = 1e38f;
      g[7] = -1e38f;
      u[8] = 0.0f;
      glu_ref(act, g.data(), u.data(), want.data(), n);
      simd(act, g.data(), u.data(), got.data(), n);
      for (size_t i = 0; i < n; ++i) {
        // x = -inf: the reference gives inf * 0 = NaN, the SIMD form -inf / (1 + e^88) = -inf; both
        // flag the broken input, which is all a non-finite activation can ask for
        if (!std::isfinite(want[i])) {
          EXPECT_FALSE(std::isfinite(got[i])) << i << " " << g[i];
          continue;
        }
        // swiglu_oai multiplies by clamp(up, -7, 7) + 1 instead of up
        const double uf = act == GluAct::swiglu_oai ? std::clamp(double(u[i]), -7.0, 7.0) + 1.0 : double(u[i]);
        const double bound = 6e-7 * std::fabs(double(g[i]) * uf) + 1e-37;
        ASSERT_LE(std::fabs(double(got[i]) - double(want[i])), bound)
            << (act == GluAct::silu ? "silu" : act == GluAct::gelu_tanh ? "gelu" : "swiglu_oai") << " x=" << g[i] << " up=" << u[i] << " got " << got[i] << " want " << want[i]
            << (variant ? " avx512" : " avx2");
      }
    }
  }
}

// gpt-oss's SwiGLU against its definition written out: the gate clamped above at 7 (not below),
// up clamped to [-7, 7] and shifted by 1, sigmoid(1.702 g); at every CPU level.
TEST(Glu, SwigluOaiClampsAsDefined) {
  const std::vector<float> g = {0.f, 1.f, -1.f, 6.99f, 7.f, 7.5f, 100.f, -3.f, -30.f, 2.f, 2.f, 2.f, 10.f, -10.f, 0.5f, -0.5f, 3.f};
  const std::vector<float> u = {1.f, 0.f, 2.f, 1.f, 1.f, 1.f, 1.f, -1.f, 3.f, 6.f, 9.f, -9.f, -1.f, 20.f, -0.25f, 7.5f, -7.f};
  const size_t n = g.size();
  for (CpuLevel l : kLevels) {
    LevelCap cap(l);
    std::vector<float> got(n);
    ThreadPool pool(1);
    glu(GluAct::swiglu_oai, g.data(), u.data(), got.data(), n, pool);
    for (size_t i = 0; i < n; ++i) {
      const double x = std::min(double(g[i]), 7.0), y = std::clamp(double(u[i]), -7.0, 7.0);
      const double want = x / (1 + std::exp(-1.702 * x)) * (y + 1);
      EXPECT_NEAR(got[i], want, 1e-6 * (1 + std::fabs(want))) << "g=" << g[i] << " u=" << u[i];
    }
    // clamps bite: a gate of 7.5 gives what 7 gives, an up of 9 what 7 gives, -9 what -7 gives
    EXPECT_EQ(got[5], got[4]);
    const float g2[2] = {2.f, 2.f}, u7[2] = {7.f, -7.f};
    float at7[2] = {};
    glu(GluAct::swiglu_oai, g2, u7, at7, 2, pool);
    EXPECT_EQ(got[10], at7[0]);
    EXPECT_EQ(got[11], at7[1]);
    EXPECT_LT(got[11], -11.f);
  }
}

// Both SIMD levels run the same arithmetic per element: the same values bit for bit.
TEST(Glu, Avx2EqualsAvx512) {
  const CpuFeatures& cf = cpu_features();
  if (!(cf.avx2 && cf.fma && cf.avx512f)) GTEST_SKIP() << "needs AVX2 and AVX-512";
  std::mt19937 rng(8);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  for (GluAct act : {GluAct::silu, GluAct::gelu_tanh, GluAct::swiglu_oai}) {
    const size_t n = 517;
    std::vector<float> g(n), u(n), a(n), b(n);
    for (size_t i = 0; i < n; ++i) {
      g[i] = nd(rng);
      u[i] = nd(rng);
    }
    glu_avx2(act, g.data(), u.data(), a.data(), n);
    glu_avx512(act, g.data(), u.data(), b.data(), n);
    EXPECT_EQ(std::memcmp(a.data(), b.data(), n * sizeof(float)), 0);
  }
}

// The pooled entry point splits the work; every split gives the single-threaded result exactly
// (tails go through the same vector math), so chunked prefill equals one-shot prefill.
TEST(Glu, PooledEqualsSingleCall) {
  std::mt19937 rng(6);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  const size_t n = 3 * 8192 + 123;
  std::vector<float> g(n), u(n), one(n), pooled(n);
  for (size_t i = 0; i < n; ++i) {
    g[i] = nd(rng);
    u[i] = nd(rng);
  }
  ThreadPool p1(1), p2(2);
  for (CpuLevel l : kLevels) {
    LevelCap cap(l);
    glu(GluAct::gelu_tanh, g.data(), u.data(), one.data(), n, p1);
    glu(GluAct::gelu_tanh, g.data(), u.data(), pooled.data(), n, p2);
    EXPECT_EQ(std::memcmp(one.data(), pooled.data(), n * sizeof(float)), 0);
    // in place, as the forward pass calls it
    std::vector<float> inplace = g;
    glu(GluAct::gelu_tanh, inplace.data(), u.data(), inplace.data(), n, p2);
    EXPECT_EQ(std::memcmp(one.data(), inplace.data(), n * sizeof(float)), 0);
  }
}

// ---------------------------------------------------------------- API edges

TEST(WeightsApi, SupportedTypes) {
  for (GgmlType t : kTypes) EXPECT_TRUE(weight_type_supported(t));
  EXPECT_FALSE(weight_type_supported(GgmlType::IQ2_XXS));
  EXPECT_FALSE(weight_type_supported(GgmlType::Q8_K));
}

TEST(WeightsApi, BadViewsAreUserErrors) {
  std::vector<uint8_t> buf(4096);
  std::vector<float> x(256), y(16);
  ThreadPool pool(1);
  WeightView unsupported{GgmlType::IQ2_XXS, buf.data(), 256, 2, 66};
  EXPECT_THROW(matmul(unsupported, x.data(), 1, y.data(), pool), Error);
  WeightView ragged{GgmlType::Q4_0, buf.data(), 40, 2, 40};
  EXPECT_THROW(matmul(ragged, x.data(), 1, y.data(), pool), Error);
  WeightView short_stride{GgmlType::Q8_0, buf.data(), 64, 2, 34};
  EXPECT_THROW(matmul_ref(short_stride, x.data(), 1, y.data()), Error);
  WeightView ok{GgmlType::Q8_0, buf.data(), 64, 2, 68};
  EXPECT_THROW(weight_row(ok, 2, x.data()), Error);
  EXPECT_THROW(weight_row(ok, -1, x.data()), Error);
}

TEST(WeightsApi, WeightRowIsDequantizedRow) {
  std::mt19937 rng(99);
  for (GgmlType t : kTypes) {
    const int64_t n_in = 512;
    const size_t rb = ggml_row_bytes(t, n_in) + 16;
    auto wb = random_weights(t, n_in, 3, rb, ScaleMode::mixed, rng);
    WeightView w{t, wb.data(), n_in, 3, rb};
    std::vector<float> a(static_cast<size_t>(n_in)), b(static_cast<size_t>(n_in));
    for (CpuLevel l : kLevels) {
      LevelCap cap(l);
      weight_row(w, 2, a.data());
      dequantize_row_ref(t, wb.data() + 2 * rb, b.data(), n_in);
      for (int64_t i = 0; i < n_in; ++i)
        ASSERT_EQ(f32_bits(a[size_t(i)]), f32_bits(b[size_t(i)])) << ggml_type_name(t) << " " << i;
    }
  }
}

}  // namespace
