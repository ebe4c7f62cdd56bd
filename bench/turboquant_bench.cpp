// TurboQuant fused kernels: scores (q.k over packed keys) and accumulate (p.V) per CPU level,
// reported as bytes of packed records read per second; encode of one token per CPU level.
#include <benchmark/benchmark.h>

#include <random>
#include <vector>

#include "core/cpu.h"
#include "kv/turboquant.h"

using namespace kvq;

namespace {

struct Setup {
  std::unique_ptr<KvCodec> c;
  std::vector<uint8_t> block;
  std::vector<float> qp, p, out, acc;
  int n = 0, n_q = 0;
};

Setup make(double bits, bool qjl, int d, int n, int n_q) {
  Setup s;
  KvCodecParams prm;
  prm.head_dim = d;
  s.c = tq_codec_create("bench", {bits, qjl, TqRotationKind::hadamard}, prm);
  s.n = n;
  s.n_q = n_q;
  std::mt19937_64 rng(1);
  std::normal_distribution<float> nd;
  std::vector<float> x(size_t(n) * size_t(d)), q(size_t(n_q) * size_t(d));
  for (auto& v : x) v = nd(rng);
  for (auto& v : q) v = nd(rng);
  s.block.resize(s.c->block_bytes(n));
  s.c->encode(0, x.data(), size_t(d), n, s.block.data(), n, 0, 0);
  s.qp.resize(size_t(n_q) * size_t(s.c->prepared_query_dim()));
  s.c->prepare_query(0, q.data(), n_q, s.qp.data());
  s.p.assign(size_t(n_q) * size_t(n), 1.f / float(n));
  s.out.resize(size_t(n_q) * size_t(n));
  s.acc.resize(size_t(n_q) * size_t(d));
  return s;
}

// args: bits*10, qjl, cpu level, n_q
void BM_tq_scores(benchmark::State& st) {
  const CpuLevel prev = cpu_set_level(CpuLevel(st.range(2)));
  Setup s = make(double(st.range(0)) / 10, st.range(1) != 0, 128, 256, int(st.range(3)));
  for (auto _ : st) {
    s.c->scores(0, s.qp.data(), s.n_q, s.block.data(), s.n, 0, s.n, 0, s.out.data(), s.n);
    benchmark::DoNotOptimize(s.out.data());
  }
  st.SetBytesProcessed(int64_t(st.iterations()) * int64_t(s.block.size()));
  st.SetLabel(cpu_level_name(cpu_level()));
  cpu_set_level(prev);
}

void BM_tq_accumulate(benchmark::State& st) {
  const CpuLevel prev = cpu_set_level(CpuLevel(st.range(2)));
  Setup s = make(double(st.range(0)) / 10, false, 128, 256, int(st.range(3)));
  for (auto _ : st) {
    s.c->accumulate(0, s.p.data(), s.n, s.n_q, s.block.data(), s.n, 0, s.n, s.acc.data());
    benchmark::DoNotOptimize(s.acc.data());
  }
  st.SetBytesProcessed(int64_t(st.iterations()) * int64_t(s.block.size()));
  st.SetLabel(cpu_level_name(cpu_level()));
  cpu_set_level(prev);
}

// One token through encode (norm, rotation, codebook search, packing; QJL signs for prod).
// args: bits*10, qjl, cpu level, rotation (0 hadamard, 1 dense)
void BM_tq_encode(benchmark::State& st) {
  const CpuLevel prev = cpu_set_level(CpuLevel(st.range(2)));
  KvCodecParams prm;
  prm.head_dim = 128;
  auto c = tq_codec_create("bench", {double(st.range(0)) / 10, st.range(1) != 0,
                                     st.range(3) ? TqRotationKind::dense : TqRotationKind::hadamard},
                           prm);
  std::mt19937_64 rng(2);
  std::normal_distribution<float> nd;
  std::vector<float> x(128);
  for (auto& v : x) v = nd(rng);
  std::vector<uint8_t> rec(c->block_bytes(1));
  for (auto _ : st) {
    c->encode(0, x.data(), 128, 1, rec.data(), 1, 0, 0);
    benchmark::ClobberMemory();
  }
  st.SetLabel(cpu_level_name(cpu_level()));
  cpu_set_level(prev);
}

}  // namespace

BENCHMARK(BM_tq_encode)
    ->ArgsProduct({{40, 30, 35}, {0}, {0, 2}, {0}})
    ->ArgsProduct({{30}, {1}, {0, 2}, {0}})
    ->ArgsProduct({{40}, {0}, {0, 2}, {1}});
BENCHMARK(BM_tq_scores)
    ->ArgsProduct({{40, 30, 35}, {0}, {0, 1, 2}, {1, 4}})
    ->ArgsProduct({{30}, {1}, {0, 1, 2}, {1, 4}});
BENCHMARK(BM_tq_accumulate)->ArgsProduct({{40, 30}, {0}, {0, 1, 2}, {1, 4}});
BENCHMARK_MAIN();
