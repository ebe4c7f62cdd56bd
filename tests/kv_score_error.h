// Shared by the format tests: the rms error of <q, k> over a block of keys after a codec's round
// trip (encode, then the reference decode), the quantity the rotation and centering tests compare.
#pragma once
#include <cmath>
#include <cstdint>
#include <vector>

#include "kvq/kv_format.h"

namespace kvq::test {

// k: (n, d) rows; q: (d). Head 0, one block of n tokens at position 0.
inline double score_rms_error(const KvCodec& c, const std::vector<float>& k, const std::vector<float>& q, int n) {
  const int d = c.head_dim();
  std::vector<uint8_t> blk(c.block_bytes(n));
  c.encode(0, k.data(), size_t(d), n, blk.data(), n, 0, 0);
  std::vector<float> kd(k.size());
  c.decode(0, blk.data(), n, 0, n, 0, kd.data());
  double se = 0;
  for (int t = 0; t < n; ++t) {
    double e = 0;
    for (int j = 0; j < d; ++j) e += double(q[size_t(j)]) * (kd[size_t(t) * size_t(d) + size_t(j)] - k[size_t(t) * size_t(d) + size_t(j)]);
    se += e * e;
  }
  return std::sqrt(se / n);
}

}  // namespace kvq::test
