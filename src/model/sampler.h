// Token sampling from logits: greedy, temperature, top-k, top-p, min-p, logit bias, presence /
// frequency and repetition penalties, allowed tokens and a minimum length, seeded. The order of
// operations is llama.cpp's: logit bias (allowed tokens, minimum length) -> penalties -> top-k ->
// top-p -> min-p -> temperature -> draw.
#pragma once
#include <cstdint>
#include <random>
#include <vector>

namespace kvq {

struct SamplerParams {
  float temperature = 0.8f;   // <= 0: greedy
  int top_k = 40;             // <= 0: off
  float top_p = 0.95f;        // >= 1: off
  float min_p = 0.05f;        // <= 0: off
  float repeat_penalty = 1.0f;  // 1: off
  int repeat_last_n = 64;     // tokens considered by the penalty (< 0: the whole history)
  // OpenAI's penalties over the generated tokens (history past n_prompt): a token's logit less
  // presence_penalty once if it occurred, and frequency_penalty times its count. 0: off.
  float presence_penalty = 0.0f;
  float frequency_penalty = 0.0f;
  // Added to the logits of these token ids before anything else (OpenAI's logit_bias).
  std::vector<std::pair<int32_t, float>> logit_bias;
  // vLLM's min_tokens: while fewer than min_tokens tokens follow the prompt (history past
  // n_prompt), the end_tokens (end of generation, stop token ids) are not sampled, unless nothing
  // else could be (a grammar's mask that leaves only them).
  int min_tokens = 0;
  std::vector<int32_t> end_tokens;
  // vLLM's allowed_token_ids: only these are sampled (empty: all), unless none of them could be.
  std::vector<int32_t> allowed_tokens;
  uint64_t seed = 0xC0FFEE;
};

class Sampler {
 public:
  explicit Sampler(const SamplerParams& p);
  // logits: (n_vocab). history: tokens so far (prompt + generated), for the penalties; the first
  // n_prompt of them are the prompt (presence and frequency penalties count only the rest).
  int32_t sample(const float* logits, int n_vocab, const std::vector<int32_t>& history, size_t n_prompt = 0);
  const SamplerParams& params() const { return p_; }

 private:
  SamplerParams p_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, int32_t>> cand_;
  // The penalties' per-token counts of the generated tokens (zero between calls) and which are set.
  std::vector<int> count_;
  std::vector<int32_t> counted_;
  std::vector<char> allowed_;  // allowed_tokens as a per-token flag
};

// Index of the largest logit (lowest index on ties).
int32_t argmax(const float* logits, int n);

// log(sum_i exp(x[i])), in double around the largest x.
double log_sum_exp(const float* x, int n);

// A token's log-probability under the model's distribution softmax(logits) (the raw model
// output: no temperature, penalty or truncation, as OpenAI-compatible servers report it by
// default), and the top_n most likely tokens with theirs, most likely first (lower id first on
// ties).
struct TokenLogprob {
  int32_t token = -1;
  float logprob = 0;
  int rank = 0;  // 1 + how many tokens have a larger logit (vLLM's rank)
  std::vector<std::pair<int32_t, float>> top;
};
// token in [0, n_vocab); top_n in [0, n_vocab]. log-sum-exp in double.
TokenLogprob token_logprob(const float* logits, int n_vocab, int32_t token, int top_n);

}  // namespace kvq
