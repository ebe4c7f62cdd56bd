#include <gtest/gtest.h>

#include <cmath>
#include <map>

#include "core/error.h"
#include "model/draft.h"
#include "model/reasoning_budget.h"
#include "model/sampler.h"

using namespace kvq;

namespace {
std::map<int32_t, int> histogram(SamplerParams p, const std::vector<float>& logits, int n, std::vector<int32_t> hist = {}) {
  Sampler s(p);
  std::map<int32_t, int> h;
  for (int i = 0; i < n; ++i) h[s.sample(logits.data(), int(logits.size()), hist)]++;
  return h;
}
}  // namespace

TEST(Sampler, GreedyPicksArgmaxLowestIndexOnTies) {
  SamplerParams p;
  p.temperature = 0;
  Sampler s(p);
  std::vector<float> l = {0.1f, 3.f, 3.f, -1.f};
  EXPECT_EQ(s.sample(l.data(), 4, {}), 1);
  EXPECT_EQ(argmax(l.data(), 4), 1);
}

TEST(Sampler, TopKOneIsGreedy) {
  SamplerParams p;
  p.temperature = 1.5f;
  p.top_k = 1;
  auto h = histogram(p, {0.f, 2.f, 1.f}, 200);
  ASSERT_EQ(h.size(), 1u);
  EXPECT_EQ(h.begin()->first, 1);
}

TEST(Sampler, TopPKeepsSmallestSetReachingP) {
  // probabilities ~ (0.665, 0.245, 0.090): top_p 0.7 keeps the first two only
  SamplerParams p;
  p.temperature = 1.f;
  p.top_k = 0;
  p.min_p = 0;
  p.top_p = 0.7f;
  auto h = histogram(p, {2.f, 1.f, 0.f}, 3000);
  EXPECT_EQ(h.count(2), 0u);
  EXPECT_GT(h[0], h[1]);
  EXPECT_GT(h[1], 0);
}

TEST(Sampler, MinPDropsUnlikelyTokens) {
  SamplerParams p;
  p.temperature = 1.f;
  p.top_k = 0;
  p.top_p = 1.f;
  p.min_p = 0.2f;  // token 2 has p/p_max = e^-3 ~ 0.05 < 0.2: dropped; token 1 e^-1 ~ 0.37: kept
  auto h = histogram(p, {3.f, 2.f, 0.f}, 3000);
  EXPECT_EQ(h.count(2), 0u);
  EXPECT_GT(h[1], 0);
}

TEST(Sampler, TemperatureMatchesSoftmaxFrequencies) {
  SamplerParams p;
  p.temperature = 2.f;
  p.top_k = 0;
  p.top_p = 1.f;
  p.min_p = 0;
  const int n = 20000;
  auto h = histogram(p, {std::log(4.f) * 2, 0.f}, n);  // at T=2 the odds are 4:1
  const double f0 = double(h[0]) / n;
  EXPECT_NEAR(f0, 0.8, 0.02);  // 4.5 sigma of a binomial(20000, 0.8) is ~0.013
}

TEST(Sampler, RepetitionPenaltyDividesPositiveAndMultipliesNegative) {
  SamplerParams p;
  p.temperature = 0;
  p.repeat_penalty = 2.f;
  Sampler s(p);
  std::vector<float> l = {3.f, 2.f, -1.f};
  EXPECT_EQ(s.sample(l.data(), 3, {0}), 1);  // 3/2 = 1.5 < 2
  std::vector<float> neg = {-1.f, -1.5f};
  EXPECT_EQ(s.sample(neg.data(), 2, {0}), 1);  // -1*2 = -2 < -1.5
}

// OpenAI's penalties count generated tokens only (history past n_prompt): presence once per
// token, frequency per occurrence; logit bias adds before everything (+100 forces, -100 bans).
TEST(Sampler, PresenceFrequencyPenaltiesAndLogitBias) {
  std::vector<float> l = {3.f, 2.5f, 1.f};
  SamplerParams p;
  p.temperature = 0;
  p.presence_penalty = 0.4f;
  {
    Sampler s(p);
    EXPECT_EQ(s.sample(l.data(), 3, {0, 0, 0}, 3), 0);  // all prompt: no penalty
    EXPECT_EQ(s.sample(l.data(), 3, {0, 0, 0}, 2), 0);  // 3 - 0.4 = 2.6 > 2.5
  }
  p.presence_penalty = 0.6f;
  EXPECT_EQ(Sampler(p).sample(l.data(), 3, {0}, 0), 1);  // 2.4 < 2.5
  p.presence_penalty = 0;
  p.frequency_penalty = 0.2f;
  {
    Sampler s(p);
    EXPECT_EQ(s.sample(l.data(), 3, {0, 0}, 0), 0);     // 3 - 0.4 = 2.6
    EXPECT_EQ(s.sample(l.data(), 3, {0, 0, 0}, 0), 1);  // 3 - 0.6 = 2.4
    EXPECT_EQ(s.sample(l.data(), 3, {7, -1, 0, 0, 0}, 0), 1);  // ids outside the vocabulary ignored
  }
  p.frequency_penalty = -1.f;  // negative: encourages repeats
  EXPECT_EQ(Sampler(p).sample(l.data(), 3, {2, 2}, 0), 0);     // 1 + 2 = 3: a tie, the lower id
  EXPECT_EQ(Sampler(p).sample(l.data(), 3, {2, 2, 2}, 0), 2);  // 1 + 3 = 4
  p.frequency_penalty = 0;
  p.logit_bias = {{2, 100.f}};
  EXPECT_EQ(Sampler(p).sample(l.data(), 3, {}), 2);
  p.logit_bias = {{0, -100.f}, {9, 5.f}};  // ids past the vocabulary ignored
  EXPECT_EQ(Sampler(p).sample(l.data(), 3, {}), 1);
  // Sampled: a banned token is never drawn.
  p.temperature = 1.f;
  p.logit_bias = {{0, -100.f}};
  for (const auto& [t, c] : histogram(p, l, 500)) EXPECT_NE(t, 0) << c;
  p.logit_bias = {{-1, 1.f}};
  EXPECT_THROW(Sampler{p}, Error);
  p.logit_bias = {{1, NAN}};
  EXPECT_THROW(Sampler{p}, Error);
  p.logit_bias.clear();
  p.presence_penalty = INFINITY;
  EXPECT_THROW(Sampler{p}, Error);
}

// allowed_token_ids: only those are drawn, greedy or sampled; min_tokens: the end tokens are not
// drawn while fewer than min_tokens tokens follow the prompt; neither leaves nothing to draw.
TEST(Sampler, AllowedTokensAndMinTokens) {
  const std::vector<float> l = {3.f, 2.5f, 1.f, 0.5f};
  SamplerParams p;
  p.temperature = 0;
  p.allowed_tokens = {2, 3, 9};  // ids past the vocabulary ignored
  EXPECT_EQ(Sampler(p).sample(l.data(), 4, {}), 2);
  p.temperature = 1.f;
  p.top_k = 0;
  p.top_p = 1.f;
  p.min_p = 0;
  const auto h = histogram(p, l, 600);
  ASSERT_EQ(h.size(), 2u);
  EXPECT_GT(h.at(2), h.at(3));  // e^1 : e^0.5, drawn in proportion
  // none of them can come (the others masked): the restriction gives way
  const std::vector<float> masked = {3.f, -INFINITY, -INFINITY, -INFINITY};
  p.temperature = 0;
  EXPECT_EQ(Sampler(p).sample(masked.data(), 4, {}), 0);
  p.allowed_tokens.clear();
  p.min_tokens = 2;
  p.end_tokens = {0, 1};
  {
    Sampler s(p);
    EXPECT_EQ(s.sample(l.data(), 4, {7, 7}, 2), 2);        // no token generated yet
    EXPECT_EQ(s.sample(l.data(), 4, {7, 7, 2}, 2), 2);     // one
    EXPECT_EQ(s.sample(l.data(), 4, {7, 7, 2, 2}, 2), 0);  // two: ending allowed
    EXPECT_EQ(s.sample(masked.data(), 4, {7, 7}, 2), 0);   // only an end token can come
  }
  p.temperature = 1.f;
  for (const auto& [t, c] : histogram(p, l, 300, {5})) EXPECT_GE(t, 2) << c;
  p.min_tokens = -1;
  EXPECT_THROW(Sampler{p}, Error);
  p.min_tokens = 1;
  p.end_tokens = {-2};
  EXPECT_THROW(Sampler{p}, Error);
}

TEST(Sampler, SameSeedSameDraws) {
  SamplerParams p;
  p.temperature = 1.f;
  p.seed = 99;
  std::vector<float> l(50);
  for (size_t i = 0; i < l.size(); ++i) l[i] = float(std::sin(double(i)));
  Sampler a(p), b(p);
  for (int i = 0; i < 100; ++i) ASSERT_EQ(a.sample(l.data(), 50, {}), b.sample(l.data(), 50, {}));
}

TEST(Sampler, InvalidParametersRejected) {
  SamplerParams p;
  p.temperature = -1;
  EXPECT_THROW(Sampler{p}, Error);
  p = SamplerParams{};
  p.top_p = 0;
  EXPECT_THROW(Sampler{p}, Error);
  p = SamplerParams{};
  p.min_p = 2;
  EXPECT_THROW(Sampler{p}, Error);
  p = SamplerParams{};
  p.repeat_penalty = 0;
  EXPECT_THROW(Sampler{p}, Error);
}

// log softmax by hand: logits {2, 0, ln 3 + 0, 2} -> exp {e^2, 1, 3, e^2}, sum 2e^2 + 4.
TEST(TokenLogprob, HandComputedCase) {
  const std::vector<float> l = {2.f, 0.f, float(std::log(3.0)), 2.f};
  const double lse = std::log(2 * std::exp(2.0) + 4.0);
  const TokenLogprob r = token_logprob(l.data(), 4, 2, 3);
  EXPECT_EQ(r.token, 2);
  EXPECT_NEAR(r.logprob, std::log(3.0) - lse, 1e-6);
  ASSERT_EQ(r.top.size(), 3u);
  // ties broken by the lower id: tokens 0 and 3 share the largest logit
  EXPECT_EQ(r.top[0].first, 0);
  EXPECT_EQ(r.top[1].first, 3);
  EXPECT_EQ(r.top[2].first, 2);
  EXPECT_NEAR(r.top[0].second, 2.0 - lse, 1e-6);
  EXPECT_NEAR(r.top[2].second, r.logprob, 0);
  EXPECT_EQ(r.rank, 3);  // two larger logits
  EXPECT_EQ(token_logprob(l.data(), 4, 3, 0).rank, 1);  // tied with token 0: none larger
  EXPECT_EQ(token_logprob(l.data(), 4, 1, 0).rank, 4);
  double total = 0;
  for (int t = 0; t < 4; ++t) total += std::exp(double(token_logprob(l.data(), 4, t, 0).logprob));
  EXPECT_NEAR(total, 1.0, 1e-6);
  EXPECT_TRUE(token_logprob(l.data(), 4, 1, 0).top.empty());
}

// Large logits do not overflow (log-sum-exp around the maximum); bad tokens are refused.
TEST(TokenLogprob, LargeLogitsAndBadTokens) {
  const std::vector<float> l = {1000.f, 999.f};
  const TokenLogprob r = token_logprob(l.data(), 2, 1, 2);
  EXPECT_NEAR(r.logprob, -1.0 - std::log1p(std::exp(-1.0)), 1e-5);
  EXPECT_EQ(r.top[0].first, 0);
  EXPECT_THROW(token_logprob(l.data(), 2, 2, 0), Error);
  EXPECT_THROW(token_logprob(l.data(), 2, -1, 0), Error);
}

// Prompt-lookup drafts: the tokens after the latest earlier occurrence of the longest suffix of
// at least ngram_min and at most ngram_max tokens.
TEST(NgramDraft, LatestOccurrenceOfTheLongestSuffix) {
  using V = std::vector<int32_t>;
  // "1 2 3 9 ... 1 2 3" : the 3-token suffix occurred at 0, followed by 9 8 7
  EXPECT_EQ(ngram_draft({1, 2, 3, 9, 8, 7, 5, 1, 2, 3}, 1, 3, 3), (V{9, 8, 7}));
  EXPECT_EQ(ngram_draft({1, 2, 3, 9, 8, 7, 5, 1, 2, 3}, 1, 3, 2), (V{9, 8}));  // at most n_max
  // the latest occurrence wins: "2 3" after 4 at index 5 beats the one at 1
  EXPECT_EQ(ngram_draft({1, 2, 3, 9, 4, 2, 3, 6, 0, 2, 3}, 2, 2, 4), (V{6, 0, 2, 3}));
  // the longest suffix wins over a later shorter one: "1 2 3" (-> 9) rather than "3" (-> 4)
  EXPECT_EQ(ngram_draft({1, 2, 3, 9, 3, 4, 1, 2, 3}, 1, 3, 1), (V{9}));
  // shorter suffixes are tried down to ngram_min, not below
  EXPECT_EQ(ngram_draft({5, 3, 4, 7, 3}, 1, 3, 2), (V{4, 7}));
  EXPECT_TRUE(ngram_draft({5, 3, 4, 7, 3}, 2, 3, 2).empty());
  // the draft stops at the end of the text (an overlapping repeat drafts what is there)
  EXPECT_EQ(ngram_draft({1, 1, 1, 1}, 2, 2, 5), (V{1}));
  EXPECT_TRUE(ngram_draft({}, 1, 3, 4).empty());
  EXPECT_TRUE(ngram_draft({7}, 1, 3, 4).empty());
  EXPECT_TRUE(ngram_draft({1, 2, 1, 2}, 1, 2, 0).empty());
}

// The reasoning budget's state machine: a block opened at the reply's start (past whitespace, its
// marker split across tokens) is counted, the closing text forced at the budget (its first newline
// left out after a newline, after a character's end), not when the block closes in time, nor in a
// reply that opens none; a prompt-opened block with budget 0 is closed at once; a token other than
// the forced one gives the bound up.
TEST(ReasoningBudget, CountsAndForcesTheClose) {
  ReasoningBudget b;
  b.tokens = 3;
  b.open = "<think>";
  b.close = {"</think>", "<tool_call>"};
  b.force = "\n</think>\n\n";
  const std::vector<int32_t> ids = {900, 901, 902}, nl = {901, 902};
  {
    ReasoningBudgetState s(b, ids, nl);
    EXPECT_EQ(s.forced(), -1);
    s.take(1, "\n <thi", false);  // (a start of the marker: undecided)
    EXPECT_EQ(s.forced(), -1);
    s.take(2, "nk>", false);
    EXPECT_EQ(s.counted(), 0);
    s.take(3, "So", false);
    s.take(4, " the", false);
    EXPECT_EQ(s.forced(), -1);
    EXPECT_FALSE(s.spent());
    s.take(5, " cat", false);  // the third: spent
    EXPECT_TRUE(s.spent());
    EXPECT_EQ(s.forced(), 900);
    s.take(900, "\n", false);
    EXPECT_EQ(s.forced(), 901);
    s.take(901, "</think>", false);
    EXPECT_EQ(s.forced(), 902);
    s.take(902, "\n\n", false);
    EXPECT_EQ(s.forced(), -1);  // then free
    s.take(6, "A", false);
    EXPECT_EQ(s.forced(), -1);
  }
  {  // the reasoning ends with a newline: the close without its first one
    ReasoningBudgetState s(b, ids, nl);
    for (const char* t : {"<think>", "a", "b", "c\n"}) s.take(7, t, false);
    EXPECT_EQ(s.forced(), 901);
  }
  {  // half a character at the budget: the rest comes first
    ReasoningBudgetState s(b, ids, nl);
    for (const char* t : {"<think>", "a", "b"}) s.take(7, t, false);
    s.take(8, "", true);
    EXPECT_EQ(s.forced(), -1);
    s.take(9, "\xC3\xA9", false);
    EXPECT_EQ(s.forced(), 900);
  }
  {  // ... for at most 4 tokens (a run of stray lead bytes never completes one)
    ReasoningBudgetState s(b, ids, nl);
    for (const char* t : {"<think>", "a", "b"}) s.take(7, t, false);
    for (int i = 0; i < 4; ++i) {
      s.take(8, "", true);
      EXPECT_EQ(s.forced(), -1) << i;
    }
    s.take(8, "", true);
    EXPECT_EQ(s.forced(), 900);
  }
  {  // the opening token's own text past the marker is read first (budget 0: after a newline)
    ReasoningBudget z = b;
    z.tokens = 0;
    ReasoningBudgetState s(z, ids, nl);
    s.take(7, "<think>\n", false);
    EXPECT_EQ(s.forced(), 901);
    ReasoningBudgetState closed(z, ids, nl);
    closed.take(7, "<think></think>", false);  // (closed already: nothing forced)
    EXPECT_EQ(closed.forced(), -1);
  }
  {  // closed in time (its marker split across tokens): never forced
    ReasoningBudgetState s(b, ids, nl);
    for (const char* t : {"<think>", "a</th", "ink>"}) s.take(7, t, false);
    for (int i = 0; i < 5; ++i) s.take(7, "x", false);
    EXPECT_EQ(s.forced(), -1);
    EXPECT_FALSE(s.spent());
  }
  {  // a Qwen call ends the reasoning too
    ReasoningBudgetState s(b, ids, nl);
    for (const char* t : {"<think>", "<tool_", "call>", "x", "y", "z"}) s.take(7, t, false);
    EXPECT_EQ(s.forced(), -1);
  }
  {  // a reply that opens no block
    ReasoningBudgetState s(b, ids, nl);
    for (const char* t : {"Once", "<think>", "a", "b", "c", "d"}) s.take(7, t, false);
    EXPECT_EQ(s.forced(), -1);
  }
  {  // a token other than the forced one: given up
    ReasoningBudgetState s(b, ids, nl);
    for (const char* t : {"<think>", "a", "b", "c"}) s.take(7, t, false);
    ASSERT_EQ(s.forced(), 900);
    s.take(5, "!", false);
    EXPECT_EQ(s.forced(), -1);
  }
  {  // opened by the prompt, budget 0: closed at once (its '<think>\n' ends with a newline; a
     // continued reply's text may not)
    ReasoningBudget p = b;
    p.open.clear();
    p.tokens = 0;
    ReasoningBudgetState s(p, ids, nl);
    EXPECT_EQ(s.forced(), 901);
    p.prompt_newline = false;
    EXPECT_EQ(ReasoningBudgetState(p, ids, nl).forced(), 900);
  }
  {  // reopen (harmony's later analysis messages): counted on from what was spent
    ReasoningBudget h;
    h.tokens = 2;
    h.open = "<|channel|>analysis<|message|>";
    h.close = {"<|end|>"};
    h.force = "<|end|><|start|>assistant";
    h.reopen = true;
    ReasoningBudgetState s(h, {50, 51, 52}, {50, 51, 52});
    for (const char* t : {"<|channel|>", "analysis", "<|message|>", "x", "<|end|>"}) s.take(7, t, false);
    EXPECT_EQ(s.forced(), -1);  // closed in time, one token spent
    for (const char* t : {"<|start|>", "assistant", "<|channel|>analysis<|message|>"}) s.take(7, t, false);
    EXPECT_EQ(s.forced(), -1);
    s.take(7, "y", false);  // the second: spent
    EXPECT_EQ(s.forced(), 50);
    for (int32_t f : {50, 51, 52}) s.take(f, "", false);
    for (const char* t : {"<|channel|>", "analysis", "<|message|>"}) s.take(7, t, false);
    EXPECT_EQ(s.forced(), 50);  // a third: ended as soon as it opens
    h.reopen = false;
    ReasoningBudgetState once(h, {50, 51, 52}, {50, 51, 52});
    for (const char* t : {"<|channel|>analysis<|message|>", "x", "y"}) once.take(7, t, false);
    for (int32_t f : {50, 51, 52}) once.take(f, "", false);
    for (const char* t : {"<|channel|>analysis<|message|>", "x", "y", "z"}) once.take(7, t, false);
    EXPECT_EQ(once.forced(), -1);  // without reopen: not bounded again
  }
  {  // no bound
    ReasoningBudget off = b;
    off.tokens = -1;
    ReasoningBudgetState s(off, ids, nl);
    for (const char* t : {"<think>", "a", "b", "c", "d"}) s.take(7, t, false);
    EXPECT_EQ(s.forced(), -1);
  }
}
