// KIVI and KVQuant fused kernels through the codec API: scores (q.k over packed keys) and
// accumulate (p.V over packed values) for one 256-token head block, per CPU level and GQA group
// size, reported as packed bytes read per second (the block fits in L2: this is kernel speed,
// not memory bandwidth).
#include <benchmark/benchmark.h>

#include <random>
#include <vector>

#include "core/cpu.h"
#include "kvq/kv_format.h"

using namespace kvq;

namespace {

const char* const k_codecs[] = {"kivi2_k", "kivi4_k", "kvquant2_k", "kvquant3_k", "kvquant4_k"};
const char* const v_codecs[] = {"kivi2_v", "kivi4_v", "kvquant3_v"};

struct Setup {
  std::unique_ptr<KvCodec> c;
  std::vector<uint8_t> block;
  std::vector<float> q, p, out, acc;
};

Setup make(const char* name, int n, int n_q) {
  const int d = 128;
  Setup s;
  KvCodecParams prm;
  prm.head_dim = d;
  prm.rope.n_rot = d;
  s.c = kv_codec_create(name, prm);
  std::mt19937_64 rng(1);
  std::normal_distribution<float> nd;
  std::vector<float> x(size_t(n) * d);
  for (auto& v : x) v = nd(rng);
  s.q.resize(size_t(n_q) * d);
  for (auto& v : s.q) v = nd(rng);
  s.block.resize(s.c->block_bytes(n));
  s.c->encode(0, x.data(), d, n, s.block.data(), n, 0, 0);
  s.p.assign(size_t(n_q) * n, 1.f / float(n));
  s.out.resize(size_t(n_q) * n);
  s.acc.resize(size_t(n_q) * d);
  return s;
}

// args: codec index, cpu level, n_q
void BM_grouped_scores(benchmark::State& st) {
  const CpuLevel prev = cpu_set_level(CpuLevel(st.range(1)));
  const int n = 256, n_q = int(st.range(2));
  Setup s = make(k_codecs[st.range(0)], n, n_q);
  for (auto _ : st) {
    s.c->scores(0, s.q.data(), n_q, s.block.data(), n, 0, n, 4096, s.out.data(), n);
    benchmark::DoNotOptimize(s.out.data());
  }
  st.SetBytesProcessed(int64_t(st.iterations()) * int64_t(s.block.size()));
  st.counters["ns_per_token"] = benchmark::Counter(double(n), benchmark::Counter::kIsIterationInvariantRate |
                                                                  benchmark::Counter::kInvert);
  st.SetLabel(std::string(k_codecs[st.range(0)]) + " " + cpu_level_name(cpu_level()));
  cpu_set_level(prev);
}

void BM_grouped_accumulate(benchmark::State& st) {
  const CpuLevel prev = cpu_set_level(CpuLevel(st.range(1)));
  const int n = 256, n_q = int(st.range(2));
  Setup s = make(v_codecs[st.range(0)], n, n_q);
  for (auto _ : st) {
    s.c->accumulate(0, s.p.data(), n, n_q, s.block.data(), n, 0, n, s.acc.data());
    benchmark::DoNotOptimize(s.acc.data());
  }
  st.SetBytesProcessed(int64_t(st.iterations()) * int64_t(s.block.size()));
  st.counters["ns_per_token"] = benchmark::Counter(double(n), benchmark::Counter::kIsIterationInvariantRate |
                                                                  benchmark::Counter::kInvert);
  st.SetLabel(std::string(v_codecs[st.range(0)]) + " " + cpu_level_name(cpu_level()));
  cpu_set_level(prev);
}

}  // namespace

BENCHMARK(BM_grouped_scores)->ArgsProduct({{0, 1, 2, 3, 4}, {0, 1, 2}, {1, 4}});
BENCHMARK(BM_grouped_accumulate)->ArgsProduct({{0, 1, 2}, {0, 1, 2}, {1, 4}});
BENCHMARK_MAIN();
