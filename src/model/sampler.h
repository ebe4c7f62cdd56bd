// Token sampling from logits: greedy, temperature, top-k, top-p, min-p, repetition penalty,
// seeded. The order of operations is llama.cpp's: penalties -> top-k -> top-p -> min-p ->
// temperature -> draw.
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
  int repeat_last_n = 64;     // tokens considered by the penalty
  uint64_t seed = 0xC0FFEE;
};

class Sampler {
 public:
  explicit Sampler(const SamplerParams& p);
  // logits: (n_vocab). history: tokens so far (prompt + generated), for the penalty.
  int32_t sample(const float* logits, int n_vocab, const std::vector<int32_t>& history);
  const SamplerParams& params() const { return p_; }

 private:
  SamplerParams p_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, int32_t>> cand_;
};

// Index of the largest logit (lowest index on ties).
int32_t argmax(const float* logits, int n);

}  // namespace kvq
