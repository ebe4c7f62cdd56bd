#include <gtest/gtest.h>

#include <cmath>

#include "tools/eval_metrics.h"

using namespace kvq;

TEST(EvalMetrics, HandComputedTwoTokenVocabulary) {
  // base logits (0, 0): p = (1/2, 1/2). test logits (ln 3, 0): q = (3/4, 1/4).
  const float base[2] = {0.f, 0.f};
  const float test[2] = {float(std::log(3.0)), 0.f};
  TokenScore s = eval_score_token(base, test, 2, /*target=*/1);
  // KL(p||q) = 1/2 ln((1/2)/(3/4)) + 1/2 ln((1/2)/(1/4)) = 1/2 ln(2/3) + 1/2 ln 2 = 1/2 ln(4/3)
  EXPECT_NEAR(s.kld, 0.5 * std::log(4.0 / 3.0), 1e-7);
  EXPECT_NEAR(s.nll, std::log(4.0), 1e-6);       // -ln(1/4)
  EXPECT_NEAR(s.base_nll, std::log(2.0), 1e-7);  // -ln(1/2)
  EXPECT_TRUE(s.top1_agree);                     // argmax of (0,0) is 0 (lowest index), of test 0
}

TEST(EvalMetrics, IdenticalLogitsGiveZeroKld) {
  const float x[4] = {1.f, -2.f, 3.f, 0.5f};
  TokenScore s = eval_score_token(x, x, 4, 2);
  EXPECT_NEAR(s.kld, 0.0, 1e-12);
  EXPECT_DOUBLE_EQ(s.nll, s.base_nll);
  EXPECT_TRUE(s.top1_agree);
}

TEST(EvalMetrics, SummaryPerplexityPercentileAgreement) {
  std::vector<TokenScore> v;
  // nll ln2 and ln8 -> mean ln4 -> ppl 4; base nll ln2 both -> ppl 2 -> +100%
  v.push_back({std::log(2.0), std::log(2.0), 0.1, true});
  v.push_back({std::log(8.0), std::log(2.0), 0.3, false});
  BucketSummary b = eval_summarize(128, v);
  EXPECT_EQ(b.ctx, 128);
  EXPECT_EQ(b.n_scored, 2);
  EXPECT_NEAR(b.ppl, 4.0, 1e-9);
  EXPECT_NEAR(b.base_ppl, 2.0, 1e-9);
  EXPECT_NEAR(b.delta_ppl_pct, 100.0, 1e-7);
  EXPECT_NEAR(b.kld_mean, 0.2, 1e-12);
  EXPECT_NEAR(b.kld_p99, 0.3, 1e-12);  // nearest rank: ceil(0.99*2) = 2nd value
  EXPECT_NEAR(b.top1_agree, 0.5, 1e-12);
  // 100 values 0..99: p99 by nearest rank is the 99th smallest = 98
  std::vector<TokenScore> w(100);
  for (int i = 0; i < 100; ++i) w[size_t(i)].kld = i;
  EXPECT_NEAR(eval_summarize(1, w).kld_p99, 98.0, 1e-12);
}

TEST(EvalMetrics, PairedSignTestHandComputed) {
  // 0 vs 5 discordant trials: 2 * (1/2)^5 = 1/16.
  EXPECT_NEAR(eval_sign_test_p(0, 5), 0.0625, 1e-12);
  // 1 vs 4: 2 * (1 + 5) / 32 = 12/32.
  EXPECT_NEAR(eval_sign_test_p(4, 1), 0.375, 1e-12);
  // an even split, and no discordant trial at all, are no evidence of a difference
  EXPECT_DOUBLE_EQ(eval_sign_test_p(3, 3), 1.0);
  EXPECT_DOUBLE_EQ(eval_sign_test_p(0, 0), 1.0);
  // 0 vs 20: 2 / 2^20
  EXPECT_NEAR(eval_sign_test_p(20, 0), 2.0 / 1048576.0, 1e-15);
  const std::vector<bool> ref = {true, true, false, true, false, true};
  const std::vector<bool> tst = {true, false, true, false, false, true};
  const PairedOutcome o = eval_paired(ref, tst);
  EXPECT_EQ(o.lost, 2);    // trials 1 and 3
  EXPECT_EQ(o.gained, 1);  // trial 2
  EXPECT_NEAR(o.p_value, 1.0, 1e-12);  // 2 * (1 + 3) / 8 = 1
}
