// Decode attention for one KV head and its GQA group (attn_decode over packed head blocks of
// 64 tokens, no tail), for every registered format: GB/s of KV bytes read, % of this machine's
// read bandwidth measured with the same number of threads (bw_pct of bw_ref_GBps), and speed
// relative to f16 at the same shape and thread count. decode/: one thread (attn_decode);
// decode_t2/: split-K over 2 threads (attn_decode_split); hot/: one thread over 8 L2-resident
// blocks reused for the whole context, i.e. the kernels' compute cost without DRAM. KV buffers are replicated so one iteration's bytes come from DRAM, not
// L3. Also: encode time of one token (one head, K and V) per format, and kernel/: the fused score
// and weighted-sum kernels alone (no softmax, no attention loop) on 1024 L2-resident tokens, a
// figure that stays put on a shared machine when taken as the minimum over repetitions
// (--benchmark_repetitions=N reports a `min` aggregate).
//
// Default run: head_dim 128, 4 query heads, 4K and 32K tokens. KVQ_ATTN_BENCH_FULL=1 adds
// 128K tokens, head_dim 64/256 and 8 query heads. Filter with --benchmark_filter=<regex>.
#include <benchmark/benchmark.h>

#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cstdlib>
#include <ctime>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "attn/attention.h"
#include "core/aligned.h"
#include "core/membw.h"
#include "core/thread_pool.h"
#include "core/timer.h"
#include "kvq/kv_format.h"
#include "kv/kvquant.h"
#include "kv/policy.h"

using namespace kvq;

namespace {

constexpr int kBlock = 64;

// Read bandwidth measured with the same number of threads as the kernel under test: the best of
// 5 measurements (each the median of 3 passes over 512 MiB), as a shared host's other tenants only
// ever lower it; one measurement had a kernel at 108% of the bus on a noisy host.
double machine_bw(int threads) {
  static std::map<int, double> bw;
  auto it = bw.find(threads);
  if (it == bw.end()) {
    ThreadPool pool(threads);
    double best = 0;
    for (int k = 0; k < 5; ++k) best = std::max(best, measure_read_bandwidth_gbs(pool, size_t(1) << 29, 3));
    it = bw.emplace(threads, best).first;
  }
  return it->second;
}

ThreadPool& bench_pool(int threads) {
  static std::map<int, std::unique_ptr<ThreadPool>> pools;
  auto& p = pools[threads];
  if (!p) p = std::make_unique<ThreadPool>(threads);
  return *p;
}

// Calibration artifacts for the formats that read them: static scales, and channel means (one
// head of hd channels) for the centered formats; their values do not change the kernels' work.
const nlohmann::json& bench_calib(int hd) {
  static std::map<int, nlohmann::json> by_hd;
  auto it = by_hd.find(hd);
  if (it == by_hd.end()) {
    std::vector<std::vector<float>> mean(1, std::vector<float>(size_t(hd))), rms = mean;
    for (int c = 0; c < hd; ++c) {
      mean[0][size_t(c)] = 0.1f * std::sin(float(c));
      rms[0][size_t(c)] = 1.f + 0.5f * std::cos(float(c));
    }
    nlohmann::json layer = {{"k_scale", 0.02}, {"v_scale", 0.02}, {"k_mean", mean}, {"v_mean", mean},
                            {"k_rms", rms}, {"q_rms", rms}, {"v_rms", rms}};
    auto width = rms;  // calibrated KVQuant key ranges: three RMS about the mean
    for (float& w : width[0]) w *= 3.f;
    for (int b : {2, 3, 4}) {  // the codebooks a calibration gives the KVQuant keys (the defaults here)
      layer["kvquant_k" + std::to_string(b)] = {{"codebook", kvquant_default_codebook(b)}};
      layer["kvquant_cal_k" + std::to_string(b)] = kvquant_cal_artifact(mean, width, b);
    }
    it = by_hd.emplace(hd, nlohmann::json{{"layers", {layer}}}).first;
  }
  return it->second;
}

double cpu_seconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return double(ts.tv_sec) + 1e-9 * double(ts.tv_nsec);
}

std::map<std::string, double>& f16_time() {  // shape key -> seconds per call of f16
  static std::map<std::string, double> m;
  return m;
}

struct Shape {
  int ctx, hd, n_q;
  std::string key() const { return std::to_string(ctx) + "/" + std::to_string(hd) + "/" + std::to_string(n_q); }
};

// KV buffers straight from mmap, advised to 2 MiB pages before the first touch as the engine's
// page pool is (src/cache/page_pool.cpp); KVQ_ATTN_BENCH_HUGEPAGES=0 keeps 4 KiB pages, to see
// the TLB cost a pool without huge pages pays.
class PageBuf {
 public:
  PageBuf() = default;
  PageBuf(const PageBuf&) = delete;
  PageBuf& operator=(const PageBuf&) = delete;
  ~PageBuf() { if (p_) munmap(p_, n_); }
  void resize(size_t n) {
    if (p_) munmap(p_, n_);
    n_ = std::max<size_t>(n, 1);
    void* p = mmap(nullptr, n_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    const char* hp = std::getenv("KVQ_ATTN_BENCH_HUGEPAGES");
    if (!hp || std::string(hp) != "0") madvise(p, n_, MADV_HUGEPAGE);
    p_ = static_cast<uint8_t*>(p);
    std::memset(p_, 0, n_);
  }
  uint8_t* data() { return p_; }
  const uint8_t* data() const { return p_; }

 private:
  uint8_t* p_ = nullptr;
  size_t n_ = 0;
};

// A benchmarked format: a registry name, or what --kv-cache-dtype takes (KFMT/VFMT, FMT@gN for
// N-token groups of a grouped codec; blocks then hold max(kBlock, N) tokens). Extra ones come from
// KVQ_ATTN_BENCH_EXTRA (comma-separated), e.g. "kvquant3@g128/tq2.5_s".
struct BenchFormat {
  std::string k_codec, v_codec;
};
BenchFormat bench_format(const std::string& spec) {
  const KvPolicy p = kv_policy_uniform(spec, 1);
  return {p.layers[0].k_codec, p.layers[0].v_codec};
}
// Tokens per block for these codecs: kBlock, or their token group when longer.
int bench_block_tokens(const KvCodec& kc, const KvCodec& vc) {
  return std::max({kBlock, kc.info().group_tokens, vc.info().group_tokens});
}

// The K and V codecs of a benchmarked format at head_dim hd (keys rotated over all of hd, the
// bench calibration); false, with the benchmark skipped, when the format does not take the shape.
bool bench_codecs(benchmark::State& st, const std::string& format, int hd, std::unique_ptr<KvCodec>* kc,
                  std::unique_ptr<KvCodec>* vc) {
  KvCodecParams pk, pv;
  pk.head_dim = pv.head_dim = hd;
  pk.role = KvRole::key;
  pv.role = KvRole::value;
  pk.calib = pv.calib = &bench_calib(hd);
  pk.rope.n_rot = hd;
  try {
    const BenchFormat f = bench_format(format);
    *kc = kv_codec_create(f.k_codec, pk);
    *vc = kv_codec_create(f.v_codec, pv);
  } catch (const std::exception& e) {
    st.SkipWithError(e.what());
    return false;
  }
  return true;
}

// The encoded KV of the last (format, shape): Google Benchmark calls a benchmark function several
// times (iteration-count probing, repetitions); encoding 2 x 128K tokens each time would dominate
// the run. One entry only, so memory stays at one format's buffers.
struct DecodeData {
  std::string key;
  int bt = kBlock;  // tokens per block: kBlock, or the token group when longer
  std::unique_ptr<KvCodec> kc, vc;
  PageBuf kbuf, vbuf;
  int copies = 0;
  size_t kb = 0, vb = 0;
};

void bm_decode(benchmark::State& st, std::string format, Shape sh, bool hot, int threads) {
  static std::unique_ptr<DecodeData> cache;
  const std::string key = format + "/" + sh.key();
  if (!cache || cache->key != key) {
    cache.reset();
    auto d = std::make_unique<DecodeData>();
    d->key = key;
    if (!bench_codecs(st, format, sh.hd, &d->kc, &d->vc)) return;
    d->bt = bench_block_tokens(*d->kc, *d->vc);
    const int bt = d->bt;
    const int n_blocks = sh.ctx / bt;
    d->kb = d->kc->block_bytes(bt);
    d->vb = d->vc->block_bytes(bt);
    const size_t copy_bytes = size_t(n_blocks) * (d->kb + d->vb);
    // Enough copies that consecutive iterations do not find the data in the 32 MiB L3.
    d->copies = int(std::min<size_t>(64, std::max<size_t>(1, (size_t(96) << 20) / copy_bytes + 1)));
    const size_t kb = d->kb, vb = d->vb;
    const int copies = d->copies;
    d->kbuf.resize(size_t(copies) * size_t(n_blocks) * kb);
    d->vbuf.resize(size_t(copies) * size_t(n_blocks) * vb);
    std::mt19937_64 rng(7);
    std::normal_distribution<float> nd;
    std::vector<float> x(size_t(bt) * size_t(sh.hd));
    for (int b = 0; b < n_blocks; ++b) {
      for (auto& v : x) v = nd(rng);
      d->kc->encode(0, x.data(), size_t(sh.hd), bt, d->kbuf.data() + size_t(b) * kb, bt, 0, b * bt);
      for (auto& v : x) v = nd(rng);
      d->vc->encode(0, x.data(), size_t(sh.hd), bt, d->vbuf.data() + size_t(b) * vb, bt, 0, b * bt);
    }
    for (int c = 1; c < copies; ++c) {
      std::copy(d->kbuf.data(), d->kbuf.data() + size_t(n_blocks) * kb, d->kbuf.data() + size_t(c) * size_t(n_blocks) * kb);
      std::copy(d->vbuf.data(), d->vbuf.data() + size_t(n_blocks) * vb, d->vbuf.data() + size_t(c) * size_t(n_blocks) * vb);
    }
    cache = std::move(d);
  }
  const DecodeData& d = *cache;
  const KvCodec* kc = d.kc.get();
  const KvCodec* vc = d.vc.get();
  const int bt = d.bt;
  const int n_blocks = sh.ctx / bt;
  const size_t kb = d.kb, vb = d.vb;
  const int copies = d.copies;
  const size_t copy_bytes = size_t(n_blocks) * (kb + vb);
  const uint8_t* kbase = d.kbuf.data();
  const uint8_t* vbase = d.vbuf.data();
  std::vector<std::vector<KvBlockSpan>> spans(static_cast<size_t>(copies));
  // hot: every span reads one of the first 8 blocks (L2-resident), so the time is the kernels'
  // compute cost alone; the cold/hot ratio shows how far a format is from compute-bound.
  for (int c = 0; c < copies; ++c)
    for (int b = 0; b < n_blocks; ++b) {
      const size_t blk = hot ? size_t(b % 8) : size_t(c) * size_t(n_blocks) + size_t(b);
      spans[size_t(c)].push_back({kbase + blk * kb, vbase + blk * vb, bt, 0, bt, b * bt});
    }
  std::vector<float> q(size_t(sh.n_q) * size_t(sh.hd), 0.05f), out(q.size());
  AlignedBuf<float> scratch(threads > 1 ? attn_split_scratch_floats(*kc, *vc, sh.n_q, bt, threads)
                                        : attn_scratch_floats(*kc, *vc, sh.n_q, bt));
  AttnParams ap;
  ap.scale = 1.f / std::sqrt(float(sh.hd));
  ThreadPool* pool = threads > 1 ? &bench_pool(threads) : nullptr;
  int c = 0;
  const double t0 = threads > 1 ? now_seconds() : cpu_seconds();
  for (auto _ : st) {
    if (pool)
      attn_decode_split(*kc, *vc, 0, q.data(), sh.n_q, spans[size_t(c)].data(), n_blocks, nullptr, nullptr, 0, 0, ap,
                        out.data(), scratch.data(), *pool, threads);
    else
      attn_decode(*kc, *vc, 0, q.data(), sh.n_q, spans[size_t(c)].data(), n_blocks, nullptr, nullptr, 0, 0, ap,
                  out.data(), scratch.data());
    benchmark::DoNotOptimize(out.data());
    c = (c + 1) % copies;
  }
  const double t1 = threads > 1 ? now_seconds() : cpu_seconds();
  const double per_call = (t1 - t0) / double(std::max<int64_t>(1, int64_t(st.iterations())));
  // Single thread: rates from this thread's CPU time (the machine is shared, and wall time would
  // charge the kernel for other processes' time slices). Split-K over several threads: wall time,
  // which a busy machine inflates.
  const double bytes = double(copy_bytes);
  st.counters["GBps"] = bytes / per_call / 1e9;
  // bw_pct: % of the read bandwidth measured with `threads` threads (bw_ref_GBps).
  st.counters["bw_pct"] = 100 * bytes / per_call / 1e9 / machine_bw(threads);
  st.counters["bw_ref_GBps"] = machine_bw(threads);
  st.counters["threads"] = threads;
  st.counters["us"] = per_call * 1e6;
  st.counters["bits"] = 8.0 * bytes / (2.0 * sh.ctx * sh.hd);
  // Speed relative to f16 at the same shape (f16 is registered before the quantized formats):
  // > 1 = faster than f16.
  const std::string fkey = sh.key() + (hot ? "/hot" : "") + "/t" + std::to_string(threads);
  if (format == "f16") f16_time()[fkey] = per_call;
  auto it = f16_time().find(fkey);
  if (it != f16_time().end()) st.counters["x_f16"] = it->second / per_call;
}

// The fused kernels alone: `scores` (every query row against 1024 packed keys) or `accum` (the
// weighted sum of 1024 packed values), head_dim hd, n_q rows, blocks of the format's block size,
// all L2-resident. us = one pass over the 1024 tokens (take ratios of the `min` aggregates).
void bm_kernel(benchmark::State& st, std::string format, int hd, int n_q, bool scores) {
  constexpr int kTokens = 1024;
  std::unique_ptr<KvCodec> kc, vc;
  if (!bench_codecs(st, format, hd, &kc, &vc)) return;
  const KvCodec& c = scores ? *kc : *vc;
  const int bt = bench_block_tokens(*kc, *vc), n_blocks = kTokens / bt;
  const size_t bb = c.block_bytes(bt);
  std::vector<uint8_t> buf(size_t(n_blocks) * bb);
  std::mt19937_64 rng(5);
  std::normal_distribution<float> nd;
  std::vector<float> x(size_t(bt) * size_t(hd));
  for (int b = 0; b < n_blocks; ++b) {
    for (auto& v : x) v = nd(rng);
    c.encode(0, x.data(), size_t(hd), bt, buf.data() + size_t(b) * bb, bt, 0, b * bt);
  }
  std::vector<float> q(size_t(n_q) * size_t(hd)), qp(size_t(n_q) * size_t(std::max(1, c.prepared_query_dim())));
  for (auto& v : q) v = nd(rng);
  if (scores) c.prepare_query(0, q.data(), n_q, qp.data());
  std::vector<float> p(size_t(n_q) * size_t(bt)), out(size_t(n_q) * size_t(bt)), acc(size_t(n_q) * size_t(hd));
  for (auto& v : p) v = std::exp(-std::fabs(nd(rng)) * 3.f);
  const double t0 = cpu_seconds();
  for (auto _ : st) {
    for (int b = 0; b < n_blocks; ++b) {
      const uint8_t* blk = buf.data() + size_t(b) * bb;
      if (scores) c.scores(0, qp.data(), n_q, blk, bt, 0, bt, b * bt, out.data(), bt);
      else c.accumulate(0, p.data(), bt, n_q, blk, bt, 0, bt, acc.data());
    }
    benchmark::DoNotOptimize(out.data());
    benchmark::DoNotOptimize(acc.data());
  }
  const double per_call = (cpu_seconds() - t0) / double(std::max<int64_t>(1, int64_t(st.iterations())));
  st.counters["us"] = per_call * 1e6;
  st.counters["bits"] = 8.0 * double(buf.size()) / (double(kTokens) * hd);
}

void bm_encode(benchmark::State& st, std::string format, int hd) {
  std::unique_ptr<KvCodec> kc, vc;
  if (!bench_codecs(st, format, hd, &kc, &vc)) return;
  // Grouped codecs encode G tokens at once: report the per-token share of one group's encode,
  // with the other side encoding the same tokens (a per-token codec all g of them).
  const int gk = std::max(1, kc->info().group_tokens), gv = std::max(1, vc->info().group_tokens);
  const int g = std::max(gk, gv);  // both powers of two: a multiple of each
  const int bt = std::max(kBlock, g);
  std::vector<uint8_t> kb(kc->block_bytes(bt)), vb(vc->block_bytes(bt));
  std::mt19937_64 rng(3);
  std::normal_distribution<float> nd;
  std::vector<float> x(size_t(g) * size_t(hd));
  for (auto& v : x) v = nd(rng);
  for (auto _ : st) {
    kc->encode(0, x.data(), size_t(hd), g, kb.data(), bt, 0, 0);
    vc->encode(0, x.data(), size_t(hd), g, vb.data(), bt, 0, 0);
    benchmark::ClobberMemory();
  }
  st.counters["tokens_per_iter"] = g == 1 ? 1 : double(g);
}

struct Registrar {
  Registrar() {
    const bool full = std::getenv("KVQ_ATTN_BENCH_FULL") != nullptr;
    std::vector<Shape> shapes;
    for (int hd : full ? std::vector<int>{64, 128, 256} : std::vector<int>{128})
      for (int n_q : full ? std::vector<int>{4, 8} : std::vector<int>{4})
        for (int ctx : full ? std::vector<int>{4096, 32768, 131072} : std::vector<int>{4096, 32768})
          shapes.push_back({ctx, hd, n_q});
    std::vector<std::string> names;
    for (const auto& f : kv_formats()) names.push_back(f.name);
    if (const char* extra = std::getenv("KVQ_ATTN_BENCH_EXTRA")) {
      std::string e = extra;
      for (size_t a = 0; a <= e.size();) {
        const size_t b = std::min(e.find(',', a), e.size());
        if (b > a) names.push_back(e.substr(a, b - a));
        a = b + 1;
      }
    }
    for (const Shape& sh : shapes)
      for (const auto& n : names)
        benchmark::RegisterBenchmark(("decode/" + n + "/ctx" + std::to_string(sh.ctx) + "/hd" + std::to_string(sh.hd) +
                                      "/nq" + std::to_string(sh.n_q)).c_str(),
                                     bm_decode, n, sh, false, 1)
            ->Unit(benchmark::kMicrosecond)
            ->MinTime(0.2);
    // Split-K over 2 threads (attn_decode_split), against the 2-thread read bandwidth.
    for (const Shape& sh : shapes)
      for (const auto& n : names)
        benchmark::RegisterBenchmark(("decode_t2/" + n + "/ctx" + std::to_string(sh.ctx) + "/hd" + std::to_string(sh.hd) +
                                      "/nq" + std::to_string(sh.n_q)).c_str(),
                                     bm_decode, n, sh, false, 2)
            ->Unit(benchmark::kMicrosecond)
            ->UseRealTime()
            ->MinTime(0.2);
    for (const Shape& sh : shapes)
      for (const auto& n : names)
        benchmark::RegisterBenchmark(("hot/" + n + "/ctx" + std::to_string(sh.ctx) + "/hd" + std::to_string(sh.hd) +
                                      "/nq" + std::to_string(sh.n_q)).c_str(),
                                     bm_decode, n, sh, true, 1)
            ->Unit(benchmark::kMicrosecond)
            ->MinTime(0.2);
    const auto min_of = [](const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); };
    for (const char* kind : {"scores", "accum"})
      for (const auto& n : names)
        benchmark::RegisterBenchmark((std::string("kernel/") + kind + "/" + n + "/hd128/nq4").c_str(), bm_kernel, n, 128, 4,
                                     std::string(kind) == "scores")
            ->Unit(benchmark::kMicrosecond)
            ->MinTime(0.05)
            ->ComputeStatistics("min", min_of);
    for (const auto& n : names)
      benchmark::RegisterBenchmark(("encode/" + n + "/hd128").c_str(), bm_encode, n, 128)
          ->Unit(benchmark::kNanosecond)
          ->MinTime(0.05);
  }
} registrar;

}  // namespace

BENCHMARK_MAIN();
