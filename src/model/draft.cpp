#include "model/draft.h"

#include <algorithm>

namespace kvq {

std::vector<int32_t> ngram_draft(const std::vector<int32_t>& tokens, int ngram_min, int ngram_max, int n_max) {
  const int n = int(tokens.size());
  if (n_max <= 0) return {};
  for (int m = std::min(ngram_max, n - 1); m >= std::max(ngram_min, 1); --m) {
    const int32_t* suffix = tokens.data() + (n - m);
    // latest start s < n - m whose m tokens equal the suffix (s + m < n: a token follows)
    for (int s = n - m - 1; s >= 0; --s) {
      if (!std::equal(suffix, suffix + m, tokens.data() + s)) continue;
      const int from = s + m, to = std::min(n, from + n_max);
      return std::vector<int32_t>(tokens.begin() + from, tokens.begin() + to);
    }
  }
  return {};
}

}  // namespace kvq
