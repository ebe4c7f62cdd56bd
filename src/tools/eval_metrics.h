// Quality metrics of a KV format against the f16-cache run on the same tokens: per-token
// negative log-likelihood, KL divergence of the token distributions, top-1 agreement; and their
// summary per context-length bucket.
#pragma once
#include <cstdint>
#include <vector>

namespace kvq {

struct TokenScore {
  double nll = 0;        // -log q(target)
  double base_nll = 0;   // -log p(target) (f16 cache)
  double kld = 0;        // KL(p || q), p = f16-cache distribution, q = format's
  bool top1_agree = false;
};

// Scores one position. base, test: (n_vocab) logits. target: the actual next token.
TokenScore eval_score_token(const float* base, const float* test, int n_vocab, int32_t target);

struct BucketSummary {
  int ctx = 0;
  int n_scored = 0;
  double ppl = 0;            // exp(mean nll)
  double base_ppl = 0;
  double delta_ppl_pct = 0;  // 100 * (ppl / base_ppl - 1)
  double kld_mean = 0;
  double kld_p99 = 0;        // 99th percentile of per-token KLD
  double top1_agree = 0;     // fraction of positions whose argmax equals the f16 run's
};

BucketSummary eval_summarize(int ctx, const std::vector<TokenScore>& scores);

// Paired comparison of two runs over the same trials (needle: a format against the f16 cache):
// lost = trials the reference passed and the format failed, gained = the reverse. p_value: the
// exact two-sided sign test (McNemar's exact test) of lost vs gained, i.e. the probability of a
// split at least this uneven if each discordant trial were a fair coin; 1 when there are none.
struct PairedOutcome {
  int lost = 0, gained = 0;
  double p_value = 1;
};
PairedOutcome eval_paired(const std::vector<bool>& ref_ok, const std::vector<bool>& test_ok);
double eval_sign_test_p(int a, int b);

}  // namespace kvq
