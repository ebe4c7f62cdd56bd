// CPU feature detection and the one place that decides which kernel variant runs.
// KVQ_CPU=scalar|avx2|avx512 in the environment caps the level (for parity tests and benchmarks).
#pragma once

namespace kvq {

enum class CpuLevel { scalar = 0, avx2 = 1, avx512 = 2 };

struct CpuFeatures {
  bool avx2 = false, fma = false, f16c = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false;
  bool avx512bf16 = false, avx512vnni = false, avx512vbmi = false;
};

const CpuFeatures& cpu_features();
// Highest level both compiled in and supported by this CPU, capped by KVQ_CPU / cpu_set_level.
CpuLevel cpu_level();
// Caps the level for this process (tests use it to run every variant); returns the previous cap.
CpuLevel cpu_set_level(CpuLevel cap);
const char* cpu_level_name(CpuLevel l);

}  // namespace kvq
