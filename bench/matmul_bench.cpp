// Weight matmul kernels on the shapes of SmolLM2-135M and Gemma 3 270M, per type, at 1 and 2
// threads. Decode (n_tok = 1) is reported as GB/s of weight bytes read and as % of this machine's
// measured read bandwidth (same binary, same thread count); prefill (n_tok = 512, and 64 for the
// 4-bit 32-element types Q4_0, IQ4_NL and MXFP4) as GFLOP/s.
// Decode cycles through enough copies of W to exceed the last-level cache, as a forward pass does.
// Run with --benchmark_repetitions=N for medians (the default below is 3).
#include <benchmark/benchmark.h>

#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <vector>

#include "core/aligned.h"
#include "core/dtypes.h"
#include "core/membw.h"
#include "core/thread_pool.h"
#include "weights/weights.h"

using namespace kvq;

namespace {

struct Shape {
  const char* name;
  int64_t n_out, n_in;
};

// Fills W with random bytes and plausible fp16 scales (random bytes there would give inf/NaN).
void fill_weights(GgmlType t, uint8_t* w, size_t bytes, std::mt19937& rng) {
  for (size_t i = 0; i < bytes; ++i) w[i] = uint8_t(rng());
  const auto* tr = ggml_type_traits(uint32_t(t));
  const size_t ts = tr->type_size;
  std::vector<size_t> f16_fields;
  switch (t) {
    case GgmlType::F32:
      for (size_t i = 0; i + 4 <= bytes; i += 4) {
        float v = float(int(rng() % 2001) - 1000) * 1e-4f;
        std::memcpy(w + i, &v, 4);
      }
      return;
    case GgmlType::F16: case GgmlType::BF16:
      for (size_t i = 0; i + 2 <= bytes; i += 2) {
        float v = float(int(rng() % 2001) - 1000) * 1e-4f;
        uint16_t h = t == GgmlType::F16 ? f32_to_f16(v) : f32_to_bf16(v);
        std::memcpy(w + i, &h, 2);
      }
      return;
    case GgmlType::Q4_1: case GgmlType::Q5_1: case GgmlType::Q4_K: case GgmlType::Q5_K: f16_fields = {0, 2}; break;
    case GgmlType::Q6_K: f16_fields = {208}; break;
    case GgmlType::Q2_K: f16_fields = {80, 82}; break;
    case GgmlType::Q3_K: f16_fields = {108}; break;
    case GgmlType::MXFP4:  // no fp16 field: the E8M0 byte, d = 2^-7
      for (size_t b = 0; b + ts <= bytes; b += ts) w[b] = 121;
      return;
    default: f16_fields = {0}; break;
  }
  const uint16_t h = f32_to_f16(0.01f);
  for (size_t b = 0; b + ts <= bytes; b += ts)
    for (size_t off : f16_fields) std::memcpy(w + b + off, &h, 2);
}

ThreadPool& pool_for(int threads) {
  static std::map<int, std::unique_ptr<ThreadPool>> pools;
  auto& p = pools[threads];
  if (!p) p = std::make_unique<ThreadPool>(threads);
  return *p;
}

double read_bw(int threads) {
  static std::map<int, double> bw;
  auto it = bw.find(threads);
  if (it != bw.end()) return it->second;
  return bw[threads] = measure_read_bandwidth_gbs(pool_for(threads), size_t(256) << 20, 5);
}

void bm_matmul(benchmark::State& st, GgmlType t, Shape s, int64_t n_tok) {
  const int threads = int(st.range(0));
  ThreadPool& pool = pool_for(threads);
  const double bw = read_bw(threads);
  const size_t rb = ggml_row_bytes(t, s.n_in);
  const size_t wbytes = rb * size_t(s.n_out);
  // decode: copies of W adding up to > 64 MiB (beyond the 32 MiB L3) so weights come from DRAM
  const size_t copies = n_tok == 1 ? std::max<size_t>(1, (size_t(64) << 20) / wbytes + 1) : 1;
  AlignedBuf<uint8_t> w(wbytes * copies);
  std::mt19937 rng(42);
  fill_weights(t, w.data(), wbytes, rng);
  for (size_t c = 1; c < copies; ++c) std::memcpy(w.data() + c * wbytes, w.data(), wbytes);
  std::vector<float> x(size_t(n_tok * s.n_in)), y(size_t(n_tok * s.n_out));
  std::normal_distribution<float> nd;
  for (auto& v : x) v = nd(rng);
  size_t c = 0;
  for (auto _ : st) {
    WeightView wv{t, w.data() + c * wbytes, s.n_in, s.n_out, rb};
    matmul(wv, x.data(), n_tok, y.data(), pool);
    benchmark::DoNotOptimize(y.data());
    c = (c + 1) % copies;
  }
  const double iters = double(st.iterations());
  st.counters["GB/s"] = benchmark::Counter(double(wbytes) * iters / 1e9, benchmark::Counter::kIsRate);
  st.counters["GFLOP/s"] = benchmark::Counter(2.0 * double(s.n_in) * double(s.n_out) * double(n_tok) * iters / 1e9,
                                              benchmark::Counter::kIsRate);
  // a rate of (GB / bw * 100) per second is GB/s as a percentage of the measured bandwidth
  st.counters["%bw"] = benchmark::Counter(double(wbytes) * iters / 1e9 / bw * 100.0, benchmark::Counter::kIsRate);
  st.counters["bw_GB/s"] = bw;
  st.SetLabel(n_tok == 1 ? "decode" : n_tok <= 16 ? "batched decode" : "prefill");
}

const Shape kShapes32[] = {
    {"smol_576x576", 576, 576}, {"smol_1536x576", 1536, 576}, {"smol_576x1536", 576, 1536},
    {"gemma_2048x640", 2048, 640}};
const Shape kShapesK[] = {{"smol_576x1536", 576, 1536}, {"gemma_640x2048", 640, 2048}, {"gemma_640x1024", 640, 1024}};

int register_all() {
  const GgmlType t32[] = {GgmlType::F32, GgmlType::F16, GgmlType::BF16, GgmlType::Q8_0,
                          GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::IQ4_NL,
                          GgmlType::MXFP4};
  const GgmlType tk[] = {GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K, GgmlType::Q2_K, GgmlType::Q3_K, GgmlType::IQ4_XS};
  auto reg = [](GgmlType t, const Shape& s) {
    // a 64-token prompt too for the 4-bit 32-element types, to compare MXFP4 with its neighbours
    const bool p64 = t == GgmlType::Q4_0 || t == GgmlType::IQ4_NL || t == GgmlType::MXFP4;
    for (int64_t n_tok : {int64_t(1), int64_t(64), int64_t(512)}) {
      if (n_tok == 64 && !p64) continue;
      std::string name = std::string(ggml_type_name(t)) + "/" + s.name + (n_tok == 1 ? "/decode" : "/prefill" + std::to_string(n_tok));
      benchmark::RegisterBenchmark(name.c_str(), [t, s, n_tok](benchmark::State& st) { bm_matmul(st, t, s, n_tok); })
          ->Arg(1)->Arg(2)->ArgName("threads")->UseRealTime()->Unit(benchmark::kMicrosecond)
          ->MinTime(n_tok == 1 ? 0.02 : 0.05)->Repetitions(3)->ReportAggregatesOnly(true);
    }
  };
  for (GgmlType t : t32)
    for (const auto& s : kShapes32) reg(t, s);
  // Gemma 3's output projection (its 262144-token vocabulary, tied to the Q8_0 embeddings in
  // Q4_K_M files) at the few rows of a batched decode step, where it dominates the step.
  const Shape vocab{"gemma_vocab_262144x640", 262144, 640};
  for (int64_t n_tok : {int64_t(1), int64_t(4), int64_t(8), int64_t(16)}) {
    std::string name = std::string("q8_0/") + vocab.name + "/rows" + std::to_string(n_tok);
    benchmark::RegisterBenchmark(name.c_str(), [vocab, n_tok](benchmark::State& st) { bm_matmul(st, GgmlType::Q8_0, vocab, n_tok); })
        ->Arg(1)->Arg(2)->ArgName("threads")->UseRealTime()->Unit(benchmark::kMicrosecond)
        ->MinTime(0.05)->Repetitions(3)->ReportAggregatesOnly(true);
  }
  for (GgmlType t : tk)
    for (const auto& s : kShapesK) reg(t, s);
  return 0;
}
const int registered = register_all();

}  // namespace

BENCHMARK_MAIN();
