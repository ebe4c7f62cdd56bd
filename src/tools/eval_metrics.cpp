#include "tools/eval_metrics.h"

#include <algorithm>
#include <cmath>

#include "model/sampler.h"

namespace kvq {

TokenScore eval_score_token(const float* base, const float* test, int n_vocab, int32_t target) {
  const int ab = argmax(base, n_vocab), at = argmax(test, n_vocab);
  const double lb = log_sum_exp(base, n_vocab);
  const double lt = log_sum_exp(test, n_vocab);
  TokenScore s;
  s.base_nll = lb - double(base[target]);
  s.nll = lt - double(test[target]);
  double kld = 0;
  for (int i = 0; i < n_vocab; ++i) {
    const double lp = double(base[i]) - lb, lq = double(test[i]) - lt;
    kld += std::exp(lp) * (lp - lq);
  }
  s.kld = std::max(0.0, kld);  // exact value is >= 0; rounding can leave -1e-17
  s.top1_agree = ab == at;
  return s;
}

BucketSummary eval_summarize(int ctx, const std::vector<TokenScore>& scores) {
  BucketSummary b;
  b.ctx = ctx;
  b.n_scored = int(scores.size());
  if (scores.empty()) return b;
  double nll = 0, bnll = 0, kld = 0, agree = 0;
  std::vector<double> klds;
  klds.reserve(scores.size());
  for (const auto& s : scores) {
    nll += s.nll;
    bnll += s.base_nll;
    kld += s.kld;
    agree += s.top1_agree ? 1 : 0;
    klds.push_back(s.kld);
  }
  const double n = double(scores.size());
  b.ppl = std::exp(nll / n);
  b.base_ppl = std::exp(bnll / n);
  b.delta_ppl_pct = 100.0 * (b.ppl / b.base_ppl - 1.0);
  b.kld_mean = kld / n;
  std::sort(klds.begin(), klds.end());
  // nearest-rank percentile
  size_t idx = size_t(std::ceil(0.99 * n)) - 1;
  b.kld_p99 = klds[std::min(idx, klds.size() - 1)];
  b.top1_agree = agree / n;
  return b;
}

double eval_sign_test_p(int a, int b) {
  const int n = a + b, k = std::min(a, b);
  if (n == 0) return 1.0;
  // 2 * P(X <= k), X ~ Binomial(n, 1/2), in logs (n can be large).
  double tail = 0;
  for (int i = 0; i <= k; ++i)
    tail += std::exp(std::lgamma(n + 1.0) - std::lgamma(i + 1.0) - std::lgamma(n - i + 1.0) - n * std::log(2.0));
  return std::min(1.0, 2 * tail);
}

PairedOutcome eval_paired(const std::vector<bool>& ref_ok, const std::vector<bool>& test_ok) {
  PairedOutcome r;
  for (size_t i = 0; i < std::min(ref_ok.size(), test_ok.size()); ++i) {
    r.lost += ref_ok[i] && !test_ok[i];
    r.gained += !ref_ok[i] && test_ok[i];
  }
  r.p_value = eval_sign_test_p(r.lost, r.gained);
  return r;
}

}  // namespace kvq
