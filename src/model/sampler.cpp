#include "model/sampler.h"

#include <algorithm>
#include <cmath>
#include <unordered_set>

#include "core/error.h"

namespace kvq {

int32_t argmax(const float* logits, int n) {
  int32_t best = 0;
  for (int i = 1; i < n; ++i)
    if (logits[i] > logits[best]) best = i;
  return best;
}

double log_sum_exp(const float* x, int n) {
  const double m = x[argmax(x, n)];
  double s = 0;
  for (int i = 0; i < n; ++i) s += std::exp(double(x[i]) - m);
  return m + std::log(s);
}

TokenLogprob token_logprob(const float* logits, int n_vocab, int32_t token, int top_n) {
  if (n_vocab < 1 || token < 0 || token >= n_vocab) fail("token_logprob: token {} outside [0, {})", token, n_vocab);
  top_n = std::clamp(top_n, 0, n_vocab);
  const double lse = log_sum_exp(logits, n_vocab);
  TokenLogprob r;
  r.token = token;
  r.logprob = float(double(logits[token]) - lse);
  r.rank = 1;
  for (int i = 0; i < n_vocab; ++i) r.rank += logits[i] > logits[token];
  // The top_n largest in one pass (top_n <= 20 in practice): a short list kept sorted, larger
  // logit first; ids arrive ascending, so an equal logit lands after the lower id.
  std::vector<std::pair<float, int32_t>> best;
  best.reserve(size_t(top_n) + 1);
  for (int i = 0; i < n_vocab && top_n > 0; ++i) {
    if (best.size() == size_t(top_n) && !(logits[i] > best.back().first)) continue;
    const auto at = std::upper_bound(best.begin(), best.end(), logits[i],
                                     [](float v, const std::pair<float, int32_t>& e) { return v > e.first; });
    best.insert(at, {logits[i], i});
    if (best.size() > size_t(top_n)) best.pop_back();
  }
  for (const auto& [l, id] : best) r.top.push_back({id, float(double(l) - lse)});
  return r;
}

Sampler::Sampler(const SamplerParams& p) : p_(p), rng_(p.seed) {
  if (!(p_.temperature >= 0) || std::isinf(p_.temperature)) fail("temperature must be >= 0 (got {})", p_.temperature);
  if (!(p_.top_p > 0 && p_.top_p <= 1)) fail("top_p must be in (0, 1] (got {})", p_.top_p);
  if (!(p_.min_p >= 0 && p_.min_p <= 1)) fail("min_p must be in [0, 1] (got {})", p_.min_p);
  if (!(p_.repeat_penalty > 0)) fail("repeat penalty must be > 0 (got {})", p_.repeat_penalty);
  if (p_.top_k < -1) fail("top_k must be >= 0, or -1 for off (got {})", p_.top_k);
  if (p_.repeat_last_n < -1) fail("repeat_last_n must be >= 0, or -1 for the whole context (got {})", p_.repeat_last_n);
  if (!std::isfinite(p_.presence_penalty) || !std::isfinite(p_.frequency_penalty))
    fail("presence / frequency penalties must be finite (got {} / {})", p_.presence_penalty, p_.frequency_penalty);
  for (const auto& [t, b] : p_.logit_bias)
    if (t < 0 || !std::isfinite(b)) fail("logit bias {} for token {}: needs a token id >= 0 and a finite bias", b, t);
  if (p_.min_tokens < 0) fail("min_tokens must be >= 0 (got {})", p_.min_tokens);
  std::sort(p_.end_tokens.begin(), p_.end_tokens.end());
  p_.end_tokens.erase(std::unique(p_.end_tokens.begin(), p_.end_tokens.end()), p_.end_tokens.end());
  for (const std::vector<int32_t>* ids : {&p_.end_tokens, &p_.allowed_tokens})
    for (int32_t t : *ids)
      if (t < 0) fail("token id {} is not >= 0", t);
}

// Leaves only the candidates `keep` says yes to, unless that would leave none that can come
// (cand in token order).
template <typename Keep>
static void restrict_to(std::vector<std::pair<float, int32_t>>& cand, Keep keep) {
  bool any = false;
  for (const auto& [l, t] : cand)
    if (l != -INFINITY && keep(t)) {
      any = true;
      break;
    }
  if (!any) return;
  for (auto& [l, t] : cand)
    if (!keep(t)) l = -INFINITY;
}

int32_t Sampler::sample(const float* logits, int n_vocab, const std::vector<int32_t>& history, size_t n_prompt) {
  cand_.resize(size_t(n_vocab));
  for (int i = 0; i < n_vocab; ++i) cand_[size_t(i)] = {logits[i], i};
  for (const auto& [t, b] : p_.logit_bias)
    if (t < n_vocab) cand_[size_t(t)].first += b;
  if (!p_.allowed_tokens.empty()) {
    if (allowed_.size() != size_t(n_vocab)) {  // built once per vocabulary
      allowed_.assign(size_t(n_vocab), 0);
      for (int32_t t : p_.allowed_tokens)
        if (t < n_vocab) allowed_[size_t(t)] = 1;
    }
    restrict_to(cand_, [&](int32_t t) { return allowed_[size_t(t)] != 0; });
  }
  if (p_.min_tokens > 0 && !p_.end_tokens.empty() && history.size() < n_prompt + size_t(p_.min_tokens)) {
    // The end tokens (distinct, sorted) out, unless only they can come: every other candidate -inf.
    size_t can = 0, ends = 0;
    for (const auto& c : cand_) can += c.first != -INFINITY;
    for (int32_t t : p_.end_tokens) ends += t < n_vocab && cand_[size_t(t)].first != -INFINITY;
    if (can > ends)
      for (int32_t t : p_.end_tokens)
        if (t < n_vocab) cand_[size_t(t)].first = -INFINITY;
  }
  if ((p_.presence_penalty != 0 || p_.frequency_penalty != 0) && history.size() > n_prompt) {
    // Counted in a dense array (a decode step recounts every generated token: no hashing).
    count_.resize(size_t(n_vocab));
    for (size_t i = n_prompt; i < history.size(); ++i) {
      const int32_t t = history[i];
      if (t < 0 || t >= n_vocab) continue;
      if (count_[size_t(t)]++ == 0) counted_.push_back(t);
    }
    for (int32_t t : counted_) {
      cand_[size_t(t)].first -= p_.presence_penalty + p_.frequency_penalty * float(count_[size_t(t)]);
      count_[size_t(t)] = 0;
    }
    counted_.clear();
  }
  if (p_.repeat_penalty != 1.0f && p_.repeat_last_n != 0) {
    size_t n = history.size();
    size_t from = p_.repeat_last_n < 0 || size_t(p_.repeat_last_n) >= n ? 0 : n - size_t(p_.repeat_last_n);
    std::unordered_set<int32_t> seen(history.begin() + std::ptrdiff_t(from), history.end());
    for (int32_t t : seen) {
      if (t < 0 || t >= n_vocab) continue;
      float& l = cand_[size_t(t)].first;
      l = l > 0 ? l / p_.repeat_penalty : l * p_.repeat_penalty;
    }
  }
  if (p_.temperature <= 0) {
    size_t best = 0;
    for (size_t i = 1; i < cand_.size(); ++i)
      if (cand_[i].first > cand_[best].first) best = i;
    return cand_[best].second;
  }
  auto by_logit = [](const auto& a, const auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); };
  size_t k = cand_.size();
  if (p_.top_k > 0 && size_t(p_.top_k) < k) {
    k = size_t(p_.top_k);
    std::partial_sort(cand_.begin(), cand_.begin() + std::ptrdiff_t(k), cand_.end(), by_logit);
  } else {
    std::sort(cand_.begin(), cand_.end(), by_logit);
  }
  cand_.resize(k);
  // softmax over the survivors (before temperature, as the top-p/min-p filters see it)
  const float mx = cand_[0].first;
  std::vector<double> prob(k);
  double sum = 0;
  for (size_t i = 0; i < k; ++i) sum += prob[i] = std::exp(double(cand_[i].first - mx));
  for (auto& pr : prob) pr /= sum;
  if (p_.top_p < 1.0f) {
    double cum = 0;
    size_t keep = k;
    for (size_t i = 0; i < k; ++i) {
      cum += prob[i];
      if (cum >= p_.top_p) {
        keep = i + 1;
        break;
      }
    }
    k = keep;
  }
  if (p_.min_p > 0) {
    size_t keep = 1;
    while (keep < k && prob[keep] >= p_.min_p * prob[0]) ++keep;
    k = keep;
  }
  // temperature, then draw
  std::vector<double> w(k);
  double ws = 0;
  for (size_t i = 0; i < k; ++i) ws += w[i] = std::exp(double(cand_[i].first - mx) / p_.temperature);
  std::uniform_real_distribution<double> U(0.0, ws);
  double r = U(rng_), acc = 0;
  for (size_t i = 0; i < k; ++i) {
    acc += w[i];
    if (r < acc) return cand_[i].second;
  }
  return cand_[k - 1].second;
}

}  // namespace kvq
