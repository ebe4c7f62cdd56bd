// Error bounds of the tiled int2 kernels (kv/int2_tiled.h) read off a head block, for tests:
// int4t's bounds (tests/int4_tiled_bound.h) with int2t's code layout and codes 0..3. kivi2t's key
// score bound is in tests/kivi_tiled_bound.h, with kivi4t's.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "core/dtypes.h"
#include "int4_tiled_bound.h"
#include "kv/int2_tiled.h"
#include "kvq/kv_format.h"

namespace kvq::test {

inline bool int2t_codec(const KvCodec& c) { return c.info().name.rfind("int2t_g", 0) == 0; }
inline Int4TiledLayout int2t_layout_of(const KvCodec& c) {
  return int2t_layout(c.head_dim(), std::stoi(c.info().name.substr(7)));
}

// int4t's bounds (tests/int4_tiled_bound.h) with int2t's crumb readers.
inline constexpr TileCodes kInt2tCodes{int2t_key_code, int2t_value_code};
inline void int2t_scm(const Int4TiledLayout& L, KvRole role, const uint8_t* block, int t, int d, double* s,
                      double* m, int* c) {
  tile_scm(L, kInt2tCodes, role, block, t, d, s, m, c);
}
inline double int2t_score_bound(const Int4TiledLayout& L, const float* q, const uint8_t* block, int t) {
  return tile_score_bound(L, kInt2tCodes, q, block, t);
}
inline double int2t_value_bound(const Int4TiledLayout& L, const uint8_t* block, int t0, int n, const double* pi,
                                double pi_scale) {
  return tile_value_bound(L, kInt2tCodes, block, t0, n, pi, pi_scale);
}

}  // namespace kvq::test
