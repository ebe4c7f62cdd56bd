// isa_probe: throughput of the AVX2 (and, where present, AVX-512 VNNI) instructions the fused KV
// kernels are built from, on this core, as ratios to VFMADD231PS (f16 / f32 kernels' work)
// measured in the same run. The zmm lines also give VPDPBUSD's latency (one dependent chain).
//
//   build/bench/isa_probe [--iters N]
//
// Each line runs 12 independent register chains of one instruction (or an alternation of two)
// in a loop and prints instructions per ns and the ratio to the FMA line. Ratio ~1 for an integer
// multiply (VPMADDUBSW: 32 u8 x s8 products; VPMADDWD: 16 int16 products) means it issues as
// often as an FMA (8 f32 products); a pair that runs at the single instruction's rate shares its
// ports. Plain x86-64 inline assembly, so the numbers are the core's, not the compiler's; exits
// with a message on a CPU without AVX2 / FMA or off x86-64.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#if defined(__x86_64__) && defined(__GNUC__)

namespace {

// 12 instructions per loop pass on R registers ("ymm" or "zmm"), every destination its own chain
// (latency hidden).
#define KVQ_R12(R, A, B)                                                                                  \
  A " %%" R "15, %%" R "0, %%" R "0\n" B " %%" R "14, %%" R "1, %%" R "1\n" A " %%" R "15, %%" R "2, %%" R \
    "2\n" B " %%" R "14, %%" R "3, %%" R "3\n" A " %%" R "15, %%" R "4, %%" R "4\n" B " %%" R "14, %%" R     \
    "5, %%" R "5\n" A " %%" R "15, %%" R "6, %%" R "6\n" B " %%" R "14, %%" R "7, %%" R "7\n" A " %%" R    \
    "15, %%" R "8, %%" R "8\n" B " %%" R "14, %%" R "9, %%" R "9\n" A " %%" R "15, %%" R "10, %%" R         \
    "10\n" B " %%" R "14, %%" R "11, %%" R "11\n"
// Sources 14 and 15 zeroed (Z: the zeroing instruction for R), then the 12 chains in a loop.
#define KVQ_PROBE_R(R, Z, A, B)                                                                               \
  [](long n) {                                                                                               \
    asm volatile(Z " %%" R "14, %%" R "14, %%" R "14\n " Z " %%" R "15, %%" R "15, %%" R "15\n" ::: "xmm14",   \
                 "xmm15");                                                                                   \
    for (long i = 0; i < n; ++i)                                                                             \
      asm volatile(KVQ_R12(R, A, B)::: "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", \
                   "xmm9", "xmm10", "xmm11");                                                                \
  }
#define KVQ_PROBE(A, B) KVQ_PROBE_R("ymm", "vpxor", A, B)
// The same on zmm registers (AVX-512).
#define KVQ_PROBE_Z(A, B) KVQ_PROBE_R("zmm", "vpxord", A, B)
// One chain of 12 dependent instructions (each adds into zmm0): per ns = 1 / latency.
#define KVQ_Z1(A) A " %%zmm15, %%zmm14, %%zmm0\n"
#define KVQ_PROBE_Z_CHAIN(A)                                                                                  \
  [](long n) {                                                                                               \
    asm volatile("vpxord %%zmm14, %%zmm14, %%zmm14\n vpxord %%zmm15, %%zmm15, %%zmm15\n" ::: "xmm14", "xmm15"); \
    for (long i = 0; i < n; ++i)                                                                             \
      asm volatile(KVQ_Z1(A) KVQ_Z1(A) KVQ_Z1(A) KVQ_Z1(A) KVQ_Z1(A) KVQ_Z1(A) KVQ_Z1(A) KVQ_Z1(A) KVQ_Z1(A)  \
                       KVQ_Z1(A) KVQ_Z1(A) KVQ_Z1(A)::: "xmm0");                                             \
  }

alignas(64) int32_t g_bcast[16];

struct Probe {
  const char* name;
  void (*run)(long);
};

const Probe kProbes[] = {
    {"vfmadd231ps (f32 FMA, 8 products)", KVQ_PROBE("vfmadd231ps", "vfmadd231ps")},
    {"vpmaddubsw (u8 x s8, 32 products)", KVQ_PROBE("vpmaddubsw", "vpmaddubsw")},
    {"vpmaddwd (int16, 16 products)", KVQ_PROBE("vpmaddwd", "vpmaddwd")},
    {"vpaddw", KVQ_PROBE("vpaddw", "vpaddw")},
    {"vpand", KVQ_PROBE("vpand", "vpand")},
    {"vpshufb", KVQ_PROBE("vpshufb", "vpshufb")},
    {"vphaddd", KVQ_PROBE("vphaddd", "vphaddd")},
    {"vpmaddubsw + vfmadd231ps", KVQ_PROBE("vpmaddubsw", "vfmadd231ps")},
    {"vpmaddwd + vfmadd231ps", KVQ_PROBE("vpmaddwd", "vfmadd231ps")},
    {"vpmaddubsw + vpmaddwd", KVQ_PROBE("vpmaddubsw", "vpmaddwd")},
    {"vpmaddubsw + vpaddw", KVQ_PROBE("vpmaddubsw", "vpaddw")},
    {"vfmadd231ps + vpaddw", KVQ_PROBE("vfmadd231ps", "vpaddw")},
};

// AVX-512 (VNNI) lines, run when the CPU has AVX512F and AVX512_VNNI.
void dpbusd_bcast(long n) {
  asm volatile("vpxord %%zmm15, %%zmm15, %%zmm15\n" ::: "xmm15");
  for (long i = 0; i < n; ++i)
    asm volatile(
        "vpdpbusd (%0)%{1to16%}, %%zmm15, %%zmm0\n vpdpbusd 4(%0)%{1to16%}, %%zmm15, %%zmm1\n"
        "vpdpbusd 8(%0)%{1to16%}, %%zmm15, %%zmm2\n vpdpbusd 12(%0)%{1to16%}, %%zmm15, %%zmm3\n"
        "vpdpbusd 16(%0)%{1to16%}, %%zmm15, %%zmm4\n vpdpbusd 20(%0)%{1to16%}, %%zmm15, %%zmm5\n"
        "vpdpbusd 24(%0)%{1to16%}, %%zmm15, %%zmm6\n vpdpbusd 28(%0)%{1to16%}, %%zmm15, %%zmm7\n"
        "vpdpbusd 32(%0)%{1to16%}, %%zmm15, %%zmm8\n vpdpbusd 36(%0)%{1to16%}, %%zmm15, %%zmm9\n"
        "vpdpbusd 40(%0)%{1to16%}, %%zmm15, %%zmm10\n vpdpbusd 44(%0)%{1to16%}, %%zmm15, %%zmm11\n" ::"r"(g_bcast)
        : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", "memory");
}

const Probe kProbes512[] = {
    {"zmm vfmadd231ps (16 products)", KVQ_PROBE_Z("vfmadd231ps", "vfmadd231ps")},
    {"zmm vpdpbusd (u8 x s8, 64 products)", KVQ_PROBE_Z("vpdpbusd", "vpdpbusd")},
    {"zmm vpdpbusd, source {1to16} memory", dpbusd_bcast},
    {"zmm vpdpbusd + vpandd", KVQ_PROBE_Z("vpdpbusd", "vpandd")},
    {"zmm vpdpbusd + vfmadd231ps", KVQ_PROBE_Z("vpdpbusd", "vfmadd231ps")},
    {"zmm vpaddd", KVQ_PROBE_Z("vpaddd", "vpaddd")},
    {"zmm vpdpbusd, one chain (1 / latency)", KVQ_PROBE_Z_CHAIN("vpdpbusd")},
};

double per_ns(void (*run)(long), long iters) {
  run(iters / 10);  // warm up (clock ramp)
  double best = 0;
  for (int r = 0; r < 5; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    run(iters);
    const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, 12.0 * double(iters) / ns);
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  long iters = 20000000;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--iters") == 0 && i + 1 < argc) {
      iters = std::strtol(argv[++i], nullptr, 10);
      if (iters <= 0) {
        std::fprintf(stderr, "isa_probe: --iters needs a positive count\n");
        return 2;
      }
    } else {
      std::fprintf(stderr, "usage: isa_probe [--iters N]\n");
      return 2;
    }
  }
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) {
    std::fprintf(stderr, "isa_probe: this CPU has no AVX2 / FMA; nothing to measure\n");
    return 1;
  }
  double fma = 0;
  std::printf("%-38s %12s %10s\n", "instruction (12 independent chains)", "per ns", "x FMA");
  for (const Probe& p : kProbes) {
    const double r = per_ns(p.run, iters);
    if (fma == 0) fma = r;
    std::printf("%-38s %12.2f %10.2f\n", p.name, r, r / fma);
  }
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vnni")) {
    for (const Probe& p : kProbes512) {
      const double r = per_ns(p.run, iters);
      std::printf("%-38s %12.2f %10.2f\n", p.name, r, r / fma);
    }
  } else {
    std::printf("(no AVX512F / AVX512_VNNI: the zmm lines are skipped)\n");
  }
  return 0;
}

#else

int main() {
  std::fprintf(stderr, "isa_probe: measures x86-64 AVX2 instructions; not built for this CPU\n");
  return 1;
}

#endif
