// Serving engine: continuous batching, prefix cache and preemption must not change what a request
// generates. Greedy outputs of concurrent requests are compared with each request run alone
// through Forward::eval on a private cache.
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include <atomic>
#include <filesystem>
#include <cmath>
#include <future>
#include <mutex>
#include <random>
#include <thread>

#include "core/timer.h"
#include "engine/engine.h"
#include "model/chat.h"
#include "test_models.h"
#include "weights/weights.h"

namespace fs = std::filesystem;
using namespace kvq;

namespace {

std::string model_path() { return std::string(KVQ_SOURCE_DIR) + "/../shared/models/stories260K.gguf"; }

// Greedy continuation of prompt, alone, on a private cache: the reference.
std::vector<int32_t> greedy_alone(const Engine& e, const std::vector<int32_t>& prompt, int max_tokens,
                                  const std::string& kv = "f16") {
  const Model& m = e.model();
  ThreadPool tp(1);
  KvFlags f;
  f.kv_cache_dtype = kv;
  KvCacheConfig kc = m.kv_cache_config(kv_flags_resolve(f, m).policy, e.ctx(), 16);
  KvCache cache(kc);
  Forward fwd(m, tp);
  const float* lg = fwd.eval(prompt.data(), int(prompt.size()), cache);
  std::vector<int32_t> out;
  while (int(out.size()) < max_tokens) {
    const int32_t t = argmax(lg, m.config().n_vocab);
    if (e.tokenizer().is_eog(t)) break;
    out.push_back(t);
    if (int(prompt.size() + out.size()) >= e.ctx()) break;
    lg = fwd.eval(&t, 1, cache);
  }
  return out;
}

EngineOptions base_options(size_t kv_tokens) {
  EngineOptions o;
  o.model_path = model_path();
  o.threads = 2;
  o.ctx = 512;
  o.kv_tokens = kv_tokens;
  o.kv.page_tokens = 16;
  o.max_batch = 64;  // small budget: long prompts are prefilled in several chunks
  return o;
}

GenParams greedy(int max_tokens) {
  GenParams p;
  p.sampling.temperature = 0;
  p.max_tokens = max_tokens;
  return p;
}

// Four prompts that share no page: in a pool of 8 pages they cannot all hold their pages at once.
std::vector<std::vector<int32_t>> four_short_prompts(const Tokenizer& tok) {
  return {tok.encode("Lily went to the park and", true), tok.encode("Once upon a time there was a dog", true),
          tok.encode("The sun was hot. Tim", true), tok.encode("Sue liked to draw pictures of", true)};
}

const char* kShared =
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her "
    "friends. One day, she saw a big red ball under a tree and";

void expect_pool_clean(const Engine& e) {
  const PagePool& pool = e.pool();
  EXPECT_EQ(pool.n_used(), 0u);
  EXPECT_EQ(pool.n_free() + pool.n_idle(), pool.n_pages());
  EXPECT_EQ(pool.n_idle(), e.prefix_index().n_idle());
}

// One request's result and, in *streamed, the text its on_text received.
GenResult generate_streamed(Engine& e, const std::vector<int32_t>& prompt, const GenParams& p, std::string* streamed) {
  std::promise<GenResult> pr;
  GenRequest r;
  r.prompt = prompt;
  r.params = p;
  r.on_text = [streamed](const std::string& d) { *streamed += d; };
  r.on_done = [&pr](const GenResult& g) { pr.set_value(g); };
  e.submit(std::move(r));
  return pr.get_future().get();
}

struct Outcome {
  GenResult res;
  std::string streamed;
};

std::vector<Outcome> run_concurrently(Engine& e, const std::vector<std::vector<int32_t>>& prompts, const GenParams& p) {
  std::vector<Outcome> out(prompts.size());
  std::vector<std::promise<void>> done(prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    GenRequest r;
    r.prompt = prompts[i];
    r.params = p;
    r.on_text = [&out, i](const std::string& d) { out[i].streamed += d; };
    r.on_done = [&out, &done, i](const GenResult& g) {
      out[i].res = g;
      done[i].set_value();
    };
    e.submit(std::move(r));
  }
  e.start();
  for (auto& d : done) d.get_future().wait();
  e.wait_idle();
  return out;
}

}  // namespace

class EngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(model_path())) GTEST_SKIP() << "stories260K.gguf not found at " << model_path();
  }
};

TEST_F(EngineTest, ConcurrentRequestsEqualAloneAndSharePrefixes) {
  EngineOptions o = base_options(4096);
  Engine e(o);
  const Tokenizer& tok = e.tokenizer();
  const std::string shared = kShared;
  std::vector<std::vector<int32_t>> prompts = {
      tok.encode(shared + " she ran", true),
      tok.encode(shared + " it was", true),
      tok.encode("The cat sat on the mat.", true),
      tok.encode(shared + " she ran", true),  // identical prompt
      tok.encode("Tom had a blue car. He", true),
      tok.encode(shared, true),
  };
  ASSERT_GT(prompts[0].size(), 32u);  // at least two full shared pages
  // Warm the prefix cache with the shared prefix, then run everything at once.
  GenResult first = e.generate(prompts[5], greedy(8));
  EXPECT_EQ(first.finish_reason, "length");
  EXPECT_EQ(first.tokens, greedy_alone(e, prompts[5], 8));

  std::vector<Outcome> got = run_concurrently(e, prompts, greedy(40));
  for (size_t i = 0; i < prompts.size(); ++i) {
    SCOPED_TRACE(i);
    const std::vector<int32_t> ref = greedy_alone(e, prompts[i], 40);
    EXPECT_EQ(got[i].res.tokens, ref);
    TokenStreamDecoder dec(tok);  // a continuation of the prompt: keeps a leading space
    std::string ref_text;
    for (int32_t t : ref) ref_text += dec.push(t);
    ref_text += dec.flush();
    EXPECT_EQ(got[i].res.text, ref_text);
    EXPECT_EQ(got[i].streamed, got[i].res.text);
    EXPECT_EQ(got[i].res.prompt_tokens, int(prompts[i].size()));
    EXPECT_EQ(got[i].res.completion_tokens, int(ref.size()));
  }
  EXPECT_GT(got[0].res.cached_tokens, 0);
  const EngineMetrics m = e.metrics();
  EXPECT_GT(m.prefix_hit_tokens, 0u);
  EXPECT_GT(m.prefix_query_tokens, m.prefix_hit_tokens);
  EXPECT_EQ(m.running, 0);
  EXPECT_EQ(m.waiting, 0);
  EXPECT_EQ(m.ttft.count, prompts.size() + 1);
  EXPECT_EQ(m.e2e.count, prompts.size() + 1);    // every request ended by its length
  EXPECT_EQ(m.queue.count, prompts.size() + 1);  // each admitted once
  EXPECT_GE(m.e2e.sum, m.ttft.sum);               // a request ends after its first token
  EXPECT_LE(m.queue.sum, m.ttft.sum);             // and is admitted before it
  EXPECT_GT(m.tpot.count, 0u);
  EXPECT_EQ(m.kv_usage, 0.0);
  expect_pool_clean(e);
}

TEST_F(EngineTest, TinyPoolPreemptsAndOutputsStayEqual) {
  // 8 pages of 16 tokens: four requests of ~70 tokens each cannot all hold their pages.
  EngineOptions o = base_options(128);
  Engine e(o);
  const Tokenizer& tok = e.tokenizer();
  const std::vector<std::vector<int32_t>> prompts = four_short_prompts(tok);
  std::vector<Outcome> got = run_concurrently(e, prompts, greedy(60));
  // The prompts share no page: a preempted sequence that finds its own published pages again when
  // readmitted is counted apart, not as prefix reuse (the hit rate stays 0).
  const EngineMetrics m = e.metrics();
  EXPECT_GT(m.preemptions, 0u);
  EXPECT_EQ(m.queue.count, prompts.size());  // readmissions after preemption are not counted again
  EXPECT_EQ(m.prefix_hit_tokens, 0u);
  EXPECT_GT(m.prefix_readmit_query_tokens, 0u);
  EXPECT_LE(m.prefix_readmit_hit_tokens, m.prefix_readmit_query_tokens);
  for (size_t i = 0; i < prompts.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(got[i].res.tokens, greedy_alone(e, prompts[i], 60));
    EXPECT_EQ(got[i].streamed, got[i].res.text);
  }
  expect_pool_clean(e);
}

// Priority scheduling (EngineOptions::priority_scheduling, vLLM's --scheduling-policy priority):
// queued requests are admitted in priority order (lower first, ties in arrival order); a request
// that finds no running slot preempts a running one of a lower priority; under page pressure the
// lowest priority is preempted, not the newest; outputs stay greedy decoding's; first come, first
// served refuses a priority.
TEST_F(EngineTest, PrioritySchedulingOrdersAndPreempts) {
  {  // admission order: one slot, three queued
    EngineOptions o = base_options(4096);
    o.priority_scheduling = true;
    o.max_running = 1;
    o.autostart = false;
    Engine e(o);
    const std::vector<std::vector<int32_t>> prompts = four_short_prompts(e.tokenizer());
    std::mutex mu;
    std::vector<int> order;
    std::vector<std::promise<void>> done(3);
    const int prio[3] = {5, 5, -1};
    for (int i = 0; i < 3; ++i) {
      GenRequest r;
      r.prompt = prompts[size_t(i)];
      r.params = greedy(8);
      r.params.priority = prio[i];
      r.on_done = [&, i](const GenResult& g) {
        EXPECT_EQ(g.finish_reason, "length");
        std::lock_guard<std::mutex> lk(mu);
        order.push_back(i);
        done[size_t(i)].set_value();
      };
      e.submit(std::move(r));
    }
    e.start();
    for (auto& d : done) d.get_future().wait();
    EXPECT_EQ(order, (std::vector<int>{2, 0, 1}));
  }
  {  // a higher priority takes a running one's slot
    EngineOptions o = base_options(4096);
    o.priority_scheduling = true;
    o.max_running = 1;
    Engine e(o);
    const Tokenizer& tok = e.tokenizer();
    const std::vector<int32_t> low_prompt = tok.encode("Once upon a time there was a dog", true);
    const std::vector<int32_t> high_prompt = tok.encode("Lily went to the park and", true);
    std::promise<GenResult> low_done, high_done;
    std::promise<void> low_started;
    std::atomic<bool> told{false};
    std::atomic<int> high_first{-1};
    GenRequest low;
    low.prompt = low_prompt;
    low.params = greedy(300);
    low.params.ignore_eos = true;
    low.params.priority = 10;
    low.on_text = [&](const std::string&) {
      if (!told.exchange(true)) low_started.set_value();
    };
    low.on_done = [&](const GenResult& g) {
      int expected = -1;
      high_first.compare_exchange_strong(expected, 0);
      low_done.set_value(g);
    };
    e.submit(std::move(low));
    low_started.get_future().wait();
    GenRequest high;
    high.prompt = high_prompt;
    high.params = greedy(20);
    high.params.priority = 0;
    high.on_done = [&](const GenResult& g) {
      int expected = -1;
      high_first.compare_exchange_strong(expected, 1);
      high_done.set_value(g);
    };
    e.submit(std::move(high));
    const GenResult h = high_done.get_future().get(), l = low_done.get_future().get();
    EXPECT_EQ(high_first.load(), 1);  // (the high one ended first)
    EXPECT_GE(l.preemptions, 1);
    EXPECT_EQ(h.preemptions, 0);
    EXPECT_EQ(h.tokens, greedy_alone(e, high_prompt, 20));
    EXPECT_EQ(l.tokens.size(), 300u);
    e.wait_idle();
    expect_pool_clean(e);
  }
  {  // page pressure: the lowest priority is preempted, though it came first (and was running)
    // 16 pages of 16 tokens: the first (~210 tokens, 13 pages) and the second (~160, 10 pages)
    // both run until pages run short, some 120 steps after the second came (while the first has
    // not generated 80 tokens before it comes)
    EngineOptions o = base_options(256);
    o.priority_scheduling = true;
    Engine e(o);
    const std::vector<std::vector<int32_t>> prompts = four_short_prompts(e.tokenizer());
    std::vector<std::promise<GenResult>> res(2);
    std::promise<void> first_started;
    std::atomic<bool> told{false};
    for (int i = 0; i < 2; ++i) {
      GenRequest r;
      r.prompt = prompts[size_t(i)];
      r.params = greedy(i == 0 ? 200 : 150);
      r.params.ignore_eos = true;
      r.params.priority = i == 0 ? 3 : 1;  // the first has the lower priority
      if (i == 0)
        r.on_text = [&](const std::string&) {
          if (!told.exchange(true)) first_started.set_value();
        };
      r.on_done = [&res, i](const GenResult& g) { res[size_t(i)].set_value(g); };
      e.submit(std::move(r));
      if (i == 0) first_started.get_future().wait();
    }
    const GenResult low = res[0].get_future().get(), high = res[1].get_future().get();
    EXPECT_EQ(high.preemptions, 0);
    EXPECT_GE(low.preemptions, 1);
    EXPECT_EQ(high.tokens.size(), 150u);
    EXPECT_EQ(low.tokens.size(), 200u);
    e.wait_idle();
    expect_pool_clean(e);
  }
  {  // first come, first served: a priority is refused
    Engine e(base_options(4096));
    GenParams p = greedy(4);
    p.priority = 1;
    const GenResult g = e.generate(e.tokenizer().encode("Lily", true), p);
    EXPECT_EQ(g.finish_reason, "error");
    EXPECT_NE(g.error.find("priority"), std::string::npos) << g.error;
  }
}

// Prompt log-probabilities (what echo + logprobs serve): every prompt token's log-probability
// given the tokens before it equals a private single-sequence run's, also when the prompt's pages
// are cached by an earlier request (the scoring request computes them anyway), when it is
// prefilled in several chunks, and when a tiny pool preempts it; max_tokens 0 scores without
// generating; generated tokens' logprobs are their greedy distribution's largest.
TEST_F(EngineTest, PromptLogprobsEqualAloneWithCachedPagesAndPreemption) {
  EngineOptions o = base_options(128);  // 8 pages of 16 tokens: the scored prompt takes 6
  Engine e(o);
  const Tokenizer& tok = e.tokenizer();
  const std::vector<int32_t> scored =
      tok.encode(std::string(kShared) + " she ran to get it. The ball was soft and she threw it high", true);
  ASSERT_GT(scored.size(), 64u);  // more than one scoring chunk
  ASSERT_LT(scored.size(), 150u);
  // Reference: all rows of one private forward pass.
  const Model& m = e.model();
  const int n_vocab = m.config().n_vocab;
  std::vector<float> ref(scored.size(), 0.f);
  {
    ThreadPool tp(1);
    KvFlags f;
    KvCacheConfig kc = m.kv_cache_config(kv_flags_resolve(f, m).policy, e.ctx(), 16);
    KvCache cache(kc);
    Forward fwd(m, tp);
    const float* lg = fwd.eval(scored.data(), int(scored.size()), cache, /*all_logits=*/true);
    for (size_t i = 1; i < scored.size(); ++i)
      ref[i] = token_logprob(lg + (i - 1) * size_t(n_vocab), n_vocab, scored[i], 0).logprob;
  }
  // Cache the scored prompt's pages first.
  e.generate(scored, greedy(4));
  // Then score it twice (once generating nothing, once 6 tokens with logprobs) among requests that
  // fill the tiny pool.
  GenParams score = greedy(0);
  score.prompt_logprobs = true;
  score.logprobs = 2;
  GenParams score_gen = greedy(6);
  score_gen.prompt_logprobs = true;
  score_gen.logprobs = 1;
  std::vector<GenResult> res(4);
  std::vector<std::promise<void>> done(4);
  const std::vector<std::pair<std::vector<int32_t>, GenParams>> reqs = {
      {tok.encode("Lily went to the park and", true), greedy(60)},
      {scored, score},
      {tok.encode("Once upon a time there was a dog", true), greedy(60)},
      {scored, score_gen},
  };
  // All four in the scheduler's same step (one by one, the first could run alone for a step and
  // the pool not fill), so that one of the scoring requests is preempted.
  std::vector<GenRequest> batch;
  for (size_t i = 0; i < reqs.size(); ++i) {
    GenRequest r;
    r.prompt = reqs[i].first;
    r.params = reqs[i].second;
    r.on_done = [&res, &done, i](const GenResult& g) {
      res[i] = g;
      done[i].set_value();
    };
    batch.push_back(std::move(r));
  }
  const std::vector<uint64_t> ids = e.submit_all(std::move(batch));
  ASSERT_EQ(ids.size(), reqs.size());
  for (size_t i = 1; i < ids.size(); ++i) EXPECT_EQ(ids[i], ids[i - 1] + 1);
  for (auto& d : done) d.get_future().wait();
  e.wait_idle();
  for (size_t k : {size_t(1), size_t(3)}) {
    SCOPED_TRACE(k);
    const GenResult& g = res[k];
    ASSERT_EQ(g.prompt_logprobs.size(), scored.size());
    EXPECT_EQ(g.cached_tokens, 0);
    EXPECT_TRUE(std::isnan(g.prompt_logprobs[0].logprob));
    for (size_t i = 1; i < scored.size(); ++i) {
      EXPECT_EQ(g.prompt_logprobs[i].token, scored[i]);
      EXPECT_NEAR(g.prompt_logprobs[i].logprob, ref[i], 1e-4) << "position " << i;
      EXPECT_EQ(g.prompt_logprobs[i].top.size(), k == 1 ? 2u : 1u);
    }
  }
  EXPECT_EQ(res[1].finish_reason, "length");
  EXPECT_EQ(res[1].completion_tokens, 0);
  EXPECT_TRUE(res[1].logprobs.empty());
  EXPECT_EQ(res[3].tokens, greedy_alone(e, scored, 6));
  ASSERT_EQ(res[3].logprobs.size(), res[3].tokens.size());
  for (size_t i = 0; i < res[3].tokens.size(); ++i) {
    EXPECT_EQ(res[3].logprobs[i].token, res[3].tokens[i]);
    EXPECT_EQ(res[3].logprobs[i].top[0].first, res[3].tokens[i]);
  }
  EXPECT_EQ(res[0].tokens, greedy_alone(e, reqs[0].first, 60));
  EXPECT_GT(res[1].preemptions + res[3].preemptions, 0);  // a scoring request was recomputed
  EXPECT_GT(e.metrics().preemptions, 0u);
  expect_pool_clean(e);
  // Out of range: more than 20 alternatives is refused.
  GenParams bad = greedy(2);
  bad.logprobs = 21;
  EXPECT_EQ(e.generate(scored, bad).finish_reason, "error");
}

static size_t common_prefix(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  size_t i = 0;
  while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
  return i;
}

// Requests that arrive together with a long shared prefix and nothing cached: one of them
// computes the prefix, the others wait for its pages and adopt them as its chunked prefill
// publishes them, so no page of the prefix is computed twice, and outputs stay exact.
TEST_F(EngineTest, ColdSharedPrefixIsComputedOnce) {
  EngineOptions o = base_options(4096);
  o.autostart = false;
  Engine e(o);
  const Tokenizer& tok = e.tokenizer();
  const std::string shared = std::string(kShared) + " it rolled away. Lily ran after the ball and her friend Tom ran too.";
  std::vector<std::vector<int32_t>> prompts = {
      tok.encode(shared + " Then", true), tok.encode(shared + " They", true), tok.encode(shared + " The ball", true),
      tok.encode("Tom had a blue car. He", true), tok.encode(shared + " Lily", true)};
  const size_t lcp = common_prefix(prompts[0], prompts[1]);
  const int P = 16;
  ASSERT_GE(lcp / P, 4u);  // several pages, so the first request needs several 64-token chunks
  std::vector<Outcome> got = run_concurrently(e, prompts, greedy(12));
  int shared_hits = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(got[i].res.tokens, greedy_alone(e, prompts[i], 12));
    EXPECT_EQ(got[i].res.preemptions, 0);
    if (i != 0 && i != 3) {
      // Everything of the shared prefix in whole pages (below the last prompt token) was adopted.
      const size_t pages = std::min(common_prefix(prompts[0], prompts[i]), prompts[i].size() - 1) / P;
      EXPECT_EQ(got[i].res.cached_tokens, int(pages * P));
      shared_hits += got[i].res.cached_tokens;
    }
  }
  EXPECT_EQ(got[0].res.cached_tokens, 0);
  const KvPrefixStats st = e.prefix_index().stats();
  EXPECT_EQ(st.duplicate_pages, 0u);  // no page of the prefix was computed twice
  EXPECT_EQ(e.metrics().prefix_hit_tokens, uint64_t(shared_hits));
  expect_pool_clean(e);
}

// The same under a pool too small for everyone: the sequence computing the prefix can be
// preempted; its waiters then go on (one of them computes what is missing). Never a deadlock,
// outputs exact, every page returned.
TEST_F(EngineTest, ColdSharedPrefixUnderPreemption) {
  EngineOptions o = base_options(160);  // 10 pages of 16 tokens
  o.autostart = false;
  Engine e(o);
  const Tokenizer& tok = e.tokenizer();
  const std::string shared = std::string(kShared) + " it rolled away.";
  std::vector<std::vector<int32_t>> prompts = {tok.encode(shared + " Then", true), tok.encode(shared + " They", true),
                                               tok.encode(shared + " Lily", true), tok.encode(shared + " The", true)};
  ASSERT_LT(prompts[0].size() + 40, 160u);
  std::vector<Outcome> got = run_concurrently(e, prompts, greedy(40));
  for (size_t i = 0; i < prompts.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(got[i].res.tokens, greedy_alone(e, prompts[i], 40));
    EXPECT_EQ(got[i].streamed, got[i].res.text);
  }
  EXPECT_GT(e.metrics().preemptions, 0u);
  EXPECT_GT(e.metrics().prefix_hit_tokens, 0u);
  expect_pool_clean(e);
}

// The prefills' split of a step's budget: the oldest is sure of its share, the rest goes to the
// prompts with the fewest tokens left first (ties to the older); never more than a limit or the
// budget, and no budget left unused while a prefill wants it.
TEST(EnginePrefillShares, OldestSureThenFewestLeftFirst) {
  using V = std::vector<int>;
  const auto shares = [](const V& left, int budget, int oldest) { return prefill_shares(left, left, budget, oldest); };
  EXPECT_EQ(shares({5600, 110, 110, 110}, 256, 64), (V{64, 110, 82, 0}));  // short ones behind a long one
  EXPECT_EQ(shares({5536, 28, 110}, 256, 64), (V{118, 28, 110}));
  EXPECT_EQ(shares({5600}, 256, 64), (V{256}));                    // alone: the whole budget
  EXPECT_EQ(shares({1024, 1024, 1024, 1024}, 256, 64), (V{256, 0, 0, 0}));  // equal: oldest first
  EXPECT_EQ(shares({1024, 1000, 1024}, 256, 64), (V{256, 0, 0}));  // 960 left after its share
  EXPECT_EQ(shares({1024, 900, 1024}, 256, 64), (V{64, 192, 0}));
  EXPECT_EQ(shares({5600, 300, 40}, 256, 64), (V{64, 152, 40}));  // a middle one behind the long one
  EXPECT_EQ(shares({5600, 110, 110}, 256, 256), (V{256, 0, 0}));  // oldest_tokens = budget: oldest first
  EXPECT_EQ(shares({30, 500}, 256, 64), (V{30, 226}));
  EXPECT_EQ(shares({}, 256, 64), V{});
  EXPECT_EQ(shares({10, 20}, 0, 64), (V{0, 0}));
  // A prompt_logprobs request's limit is below what it has left: it is ordered by what is left.
  EXPECT_EQ(prefill_shares({2000, 64, 50}, {2000, 900, 50}, 256, 64), (V{142, 64, 50}));
  std::mt19937 rng(7);
  for (int t = 0; t < 5000; ++t) {
    V left(rng() % 6), lim;
    for (int& l : left) {
      l = 1 + int(rng() % 400);
      lim.push_back(rng() % 4 ? l : std::min(l, 64));
    }
    const int budget = int(rng() % 300), oldest = 1 + int(rng() % 100);
    const V got = prefill_shares(lim, left, budget, oldest);
    ASSERT_EQ(got.size(), lim.size());
    int sum = 0, want = 0;
    for (size_t i = 0; i < lim.size(); ++i) {
      ASSERT_GE(got[i], 0);
      ASSERT_LE(got[i], lim[i]);
      sum += got[i];
      want += lim[i];
    }
    ASSERT_EQ(sum, std::min(budget, want));
    if (!lim.empty()) {
      ASSERT_GE(got[0], std::min({lim[0], oldest, budget}));  // the oldest's share
    }
    // Beyond that share, a prefill with fewer tokens left is served before one with more.
    for (size_t i = 0; i < lim.size(); ++i)
      for (size_t j = 0; j < lim.size(); ++j) {
        const int base_i = i == 0 ? std::min({lim[0], oldest, budget}) : 0;
        const int base_j = j == 0 ? std::min({lim[0], oldest, budget}) : 0;
        if (left[i] - base_i < left[j] - base_j && got[j] > base_j) {
          ASSERT_EQ(got[i], lim[i]) << i << " " << j;
        }
      }
  }
}

// What a prompt chunk costs a step while sequences decode, against a hand count: 2 layers
// (layer 0 full attention, layer 1 a window of 4), n_embd 8, 2 query heads and 1 KV head of 2
// dimensions, n_ff 16. Weight multiply-adds per token: 2 x (8 x 2 x (2 + 2 + 1 + 1) + 3 x 8 x 16)
// = 960; attention per visible position and layer: 2 x 2 x 2 = 8; so each layer adds R x 8 / 960
// = R / 120 per visible position.
TEST(EnginePrefillCost, ChunkCostAgainstAHandCount) {
  ModelConfig c;
  c.n_layer = 2;
  c.n_embd = 8;
  c.n_head = 2;
  c.n_head_kv = 1;
  c.head_dim = 2;
  c.n_ff = 16;
  c.sliding_window = 4;
  c.layer_sliding = {false, true};
  const PrefillCost pc = PrefillCost::from_model(c, 1.0);
  ASSERT_TRUE(pc.active());
  EXPECT_DOUBLE_EQ(pc.full, 1.0 / 120);
  ASSERT_EQ(pc.windows.size(), 1u);
  EXPECT_EQ(pc.windows[0].first, 4);
  // Tokens 0..5 see 1..6 positions (21 in all) in layer 0 and 1, 2, 3, 4, 4, 4 (18) in layer 1:
  // 6 + 39 / 120 -> 7.
  EXPECT_EQ(pc.cost(0, 6), 7);
  // Tokens 10, 11: 11 + 12 = 23 positions in layer 0, 4 + 4 in layer 1: 2 + 31 / 120 -> 3.
  EXPECT_EQ(pc.cost(10, 2), 3);
  // Tokens whose every row's logits are computed also pay the output projection: n_vocab x
  // n_embd / 960 each (vocabulary 240: 2 more per token).
  c.n_vocab = 240;
  const PrefillCost scored = pc.scored(c);
  EXPECT_DOUBLE_EQ(scored.units(10, 2), pc.units(10, 2) + 2 * 2.0);
  EXPECT_EQ(scored.cost(10, 2), 7);
  EXPECT_EQ(PrefillCost::from_model(c, 0.0).scored(c).cost(10, 2), 2);  // R = 0: tokens
  EXPECT_EQ(pc.cost(5, 0), 0);
  EXPECT_EQ(pc.tokens_for(0, 7, 100), 6);  // 7 tokens cost 7 + 50 / 120 -> 8
  EXPECT_EQ(pc.tokens_for(0, 7, 3), 3);    // the limit
  EXPECT_EQ(pc.tokens_for(10, 2, 100), 1);
  // Deep in a context a token costs more: at 1200 positions, 1 + 1200 / 120 + 4 / 120.
  EXPECT_EQ(pc.cost(1199, 1), 12);
  EXPECT_EQ(pc.tokens_for(1199, 64, 1000), 5);
  // R = 0: every token counts 1.
  const PrefillCost off = PrefillCost::from_model(c, 0.0);
  EXPECT_FALSE(off.active());
  EXPECT_EQ(off.cost(1199, 64), 64);
}

// The step-time fit recovers a + b x decode units + c x prompt units from measured steps, says
// how many prompt units a target leaves, and follows a machine that slows down.
TEST(StepTimeFit, RecoversCoefficientsAndBudget) {
  StepTimeFit f;
  const auto t = [](double d, double p) { return 0.02 + 0.001 * d + 0.0005 * p; };
  EXPECT_EQ(f.prefill_within(8, 0.05), -1);  // nothing seen
  f.observe(8, 0, t(8, 0));
  f.observe(4, 0, t(4, 0));
  // No fit yet: the fastest step (24 ms) plus every unit at the dearest price seen, 24 ms / 4
  // units (fixed costs included).
  double none[3];
  EXPECT_FALSE(f.coefficients(none));
  EXPECT_NEAR(f.prefill_within(1, 0.05), (0.05 - 0.024) / 0.006 - 1, 1e-9);
  EXPECT_EQ(f.prefill_within(8, 0.04), 0.0);
  const double steps[][2] = {{0, 256}, {7, 249}, {8, 24}, {6, 100}, {3, 0}, {8, 16}};
  for (const auto& x : steps) f.observe(x[0], x[1], t(x[0], x[1]));
  double k[3];
  ASSERT_TRUE(f.coefficients(k));
  EXPECT_NEAR(k[0], 0.02, 2e-4);
  EXPECT_NEAR(k[1], 0.001, 2e-5);
  EXPECT_NEAR(k[2], 0.0005, 5e-6);
  // 8 decode units take 28 ms: 22 ms of a 50 ms target buy 44 prompt units.
  EXPECT_NEAR(f.prefill_within(8, 0.05), 44.0, 0.5);
  EXPECT_EQ(f.prefill_within(8, 0.02), 0.0);  // below the decodes' own time: none
  // The machine gets twice as slow: the fit follows within a few hundred steps.
  for (int i = 0; i < 400; ++i) {
    const double d = 1 + i % 8, p = (i * 37) % 200;
    f.observe(d, p, 2 * t(d, p));
  }
  ASSERT_TRUE(f.coefficients(k));
  EXPECT_NEAR(k[2], 0.001, 2e-5);
  EXPECT_NEAR(f.prefill_within(8, 0.1), 44.0, 0.5);
}

TEST(StepTimeFit, OpenDirectionsFreePromptsAndBadTimes) {
  // Only prefill-only and decode-only steps (decode and prompt units never seen apart): the weak
  // b = c penalty determines the fit, which fits both kinds of step.
  StepTimeFit f;
  for (int i = 0; i < 10; ++i) {
    f.observe(0, 64, 0.010 + 64 * 0.0005);
    f.observe(1, 0, 0.010 + 0.0005);
  }
  double k[3];
  ASSERT_TRUE(f.coefficients(k));
  EXPECT_NEAR(k[0] + 64 * k[2], 0.042, 1e-4);
  EXPECT_NEAR(k[0] + k[1], 0.0105, 1e-4);
  EXPECT_GT(f.prefill_within(1, 0.03), 0);
  // Steps that took less with more prompt units, and no fit before them that priced a prompt
  // unit: no fit, so the fastest step (46 ms) plus units at the dearest price seen (50 ms for 4
  // units, last seen 4 steps back, decayed by 0.99 a step since).
  StepTimeFit g;
  for (int i = 0; i < 20; ++i) g.observe(4, 10.0 * (i % 5), 0.05 - 0.001 * (i % 5));
  EXPECT_FALSE(g.coefficients(k));
  EXPECT_NEAR(g.prefill_within(4, 0.1), (0.1 - 0.046) / (0.0125 * std::pow(0.99, 4)) - 4, 1e-6);
  // NaN and negative times are not steps.
  StepTimeFit h;
  for (int i = 0; i < 10; ++i) h.observe(1, 16, std::nan(""));
  h.observe(1, 16, -1);
  EXPECT_FALSE(h.coefficients(k));
  // A valid fit is kept through steps whose noise would price a prompt unit at nothing.
  StepTimeFit v;
  for (int i = 0; i < 8; ++i) v.observe(1, 16.0 * (i % 4), 0.010 + 0.0005 * 16 * (i % 4));
  ASSERT_TRUE(v.coefficients(k));
  for (int i = 0; i < 200; ++i) v.observe(1, 16.0 * (i % 4), 0.03 - 0.0001 * (i % 4));
  double now[3];
  ASSERT_TRUE(v.coefficients(now));
  EXPECT_GT(now[2], 0);
  EXPECT_GE(v.prefill_within(1, 0.05), 0);
  // Every step full (decode + prompt units = 64, prefill-only steps too): the steps leave the
  // direction (a - 64 x, x, x) open, where rounding can give c ~ 1e-16 and "any budget": such a
  // fit is refused, not used.
  StepTimeFit full;
  for (int i = 0; i < 50; ++i) {
    const double d = i % 9;
    full.observe(d, 64 - d, 0.04);
  }
  if (full.coefficients(k)) {
    EXPECT_GT(k[2] * 64, 1e-3 * k[0]);
  }
  EXPECT_LT(full.prefill_within(4, 0.05), 1e6);
}

// Before the fit, whatever steps came first (large prefill-only chunks, decode-only steps, mixed
// ones), the budget never makes a step of a machine of that kind (a fixed cost + per-unit costs)
// exceed the target: the fastest step bounds the fixed cost, the dearest price the units.
TEST(StepTimeFit, BeforeTheFitStepsStayWithinTheTarget) {
  const auto t = [](double d, double p) { return 0.02 + 0.001 * d + 0.0005 * p; };
  const double steps[][2] = {{0, 256}, {0, 200}, {1.3, 250}, {8, 0}, {4, 30}, {8, 16}, {2, 100}};
  for (size_t first = 0; first < 3; ++first) {  // histories starting with each kind of step
    StepTimeFit f;
    for (size_t i = 0; i < 7; ++i) {
      const auto& x = steps[(first + i) % 7];
      f.observe(x[0], x[1], t(x[0], x[1]));
      double k[3];
      ASSERT_FALSE(f.coefficients(k));  // fewer than kMinSteps: the cautious price
      for (const double d : {1.0, 4.0, 8.0})
        for (const double target : {0.03, 0.05, 0.1, 0.2}) {
          const double p = f.prefill_within(d, target);
          ASSERT_GE(p, 0);
          if (p > 0) {
            EXPECT_LE(t(d, p), target + 1e-12) << "first " << first << " step " << i << " d " << d;
          }
        }
    }
  }
}

// One stalled step (the host busy for a second) is taken at 3x the prediction, so the budgets
// stay close to what they were.
TEST(StepTimeFit, OneStalledStepDoesNotShrinkTheBudget) {
  StepTimeFit f;
  const auto t = [](double d, double p) { return 0.02 + 0.001 * d + 0.0005 * p; };
  for (int i = 0; i < 200; ++i) {
    const double d = 1 + i % 8, p = (i * 37) % 200;
    f.observe(d, p, t(d, p));
  }
  const double before = f.prefill_within(8, 0.06);
  ASSERT_NEAR(before, 64.0, 0.5);
  f.observe(8, 64, 1.0);
  EXPECT_GT(f.prefill_within(8, 0.06), 0.5 * before);
  for (int i = 0; i < 50; ++i) {
    const double d = 1 + i % 8, p = (i * 37) % 200;
    f.observe(d, p, t(d, p));
  }
  EXPECT_NEAR(f.prefill_within(8, 0.06), before, 0.1 * before);
}

// --tpot-target-ms: a prompt that arrives while a sequence decodes is prefilled in steps of as
// many units as the fitted step time leaves of the target (the steps timed by a model of a
// machine, 1 ms + 0.1 ms a decode unit + 0.02 ms a prompt unit, so the schedule does not depend
// on this host's noise): ~63 units a step with a 2.6 ms target, kTpotTargetMinPrefill units when
// the target is below a decode step's own time, one max_batch step without a target; with
// --prefill-attention-cost 0 the units are tokens. The decoding sequence samples one token a
// step, so its tokens count the steps B's prompt took. The units the fit is given add up to both
// prompts' PrefillCost, and outputs equal each request run alone.
TEST_F(EngineTest, TpotTargetBoundsPromptUnitsBesideDecodes) {
  struct Case {
    double target, r;
    int arrive;  // A's tokens when B is submitted (10: the fit is in use; 1: before it)
  };
  for (const Case cs : {Case{0.0, 2.0, 10}, Case{2.6, 2.0, 10}, Case{1e-6, 2.0, 10}, Case{1e-6, 0.0, 10}, Case{2.6, 2.0, 1}}) {
    SCOPED_TRACE(testing::Message() << "target " << cs.target << " R " << cs.r << " arrive " << cs.arrive);
    EngineOptions o = base_options(4096);
    o.tpot_target_ms = cs.target;
    o.prefill_attention_cost = cs.r;
    double prompt_units_seen = 0;  // scheduler thread, read after wait_idle
    double slowest_beside_decodes = 0;
    o.step_seconds = [&](double d, double p, double) {
      prompt_units_seen += p;
      const double t = 0.001 + 0.0001 * d + 0.00002 * p;
      if (d > 0 && p > 0) slowest_beside_decodes = std::max(slowest_beside_decodes, t);
      return t;
    };
    o.max_batch = 256;  // A's prompt in large chunks
    Engine e(o);
    const Tokenizer& tok = e.tokenizer();
    std::string story, other;
    while (story.size() < 900) story += std::string(kShared) + " it rolled away. ";
    while (other.size() < 300) other += "Tom had a blue car and a red hat. ";
    const std::vector<int32_t> pa = tok.encode(story, true), pb = tok.encode(other, true);
    ASSERT_GT(pa.size(), size_t(o.max_batch));  // A's own prefill: more than one chunk
    // B's prompt in the units steps are priced in (its attention counts too with R > 0): many
    // floors' worth, one max_batch step's worth.
    const PrefillCost pc = PrefillCost::from_model(e.model().config(), cs.r);
    const int units = cs.r > 0 ? pc.cost(0, int(pb.size())) : int(pb.size());
    ASSERT_GT(units, 9 * kTpotTargetMinPrefill);
    ASSERT_LT(units, o.max_batch);
    std::mutex mu;
    int a_tokens = 0, a_at_b_first = -1;
    std::promise<GenResult> ra, rb;
    GenRequest b;
    b.prompt = pb;
    b.params = greedy(4);
    b.params.logprobs = 0;
    b.on_logprob = [&](const TokenLogprob&) {
      std::lock_guard<std::mutex> lk(mu);
      if (a_at_b_first < 0) a_at_b_first = a_tokens;
    };
    b.on_done = [&](const GenResult& g) { rb.set_value(g); };
    GenRequest a;
    a.prompt = pa;
    a.params = greedy(60);
    a.params.ignore_eos = true;
    a.params.logprobs = 0;
    a.on_logprob = [&](const TokenLogprob&) {
      bool submit_b = false;
      {
        std::lock_guard<std::mutex> lk(mu);
        // B arrives while A decodes, once the fit is in use (from the scheduler thread: the next
        // step sees it)
        submit_b = ++a_tokens == cs.arrive;
      }
      if (submit_b) e.submit(std::move(b));
    };
    a.on_done = [&](const GenResult& g) { ra.set_value(g); };
    e.submit(std::move(a));
    const GenResult ga = ra.get_future().get(), gb = rb.get_future().get();
    e.wait_idle();
    EXPECT_EQ(gb.tokens, greedy_alone(e, pb, 4));
    ASSERT_EQ(ga.tokens.size(), 60u);
    const std::vector<int32_t> ref = greedy_alone(e, pa, 60);  // up to an end-of-generation token
    EXPECT_EQ(std::vector<int32_t>(ga.tokens.begin(), ga.tokens.begin() + ptrdiff_t(ref.size())), ref);
    const double want = cs.r > 0 ? pc.units(0, int(pa.size())) + pc.units(0, int(pb.size())) : double(pa.size() + pb.size());
    EXPECT_NEAR(prompt_units_seen, want, 1e-6 * want);
    const int steps_for_b = a_at_b_first - cs.arrive;  // A's tokens while B's prompt was computed
    if (cs.target == 0) {
      EXPECT_EQ(steps_for_b, 1);  // all of it in one max_batch step
    } else if (cs.target > 1 && cs.arrive == 10) {
      // 2.6 ms - 1 ms - 0.1 ms x A's ~3.3 decode units leave ~63 prompt units: 4 steps, or 5 where
      // a step's last token would overrun its share.
      EXPECT_GE(steps_for_b, 4);
      EXPECT_LE(steps_for_b, 5);
    } else if (cs.target > 1) {
      // Before the fit (A's 2 prefill steps seen when B arrives) the cautious price: every step beside A's
      // decodes within the target, so more steps than with the fit.
      EXPECT_LE(slowest_beside_decodes, cs.target / 1000 + 1e-12);
      EXPECT_GE(steps_for_b, 4);
    } else {
      EXPECT_GE(steps_for_b, units / kTpotTargetMinPrefill - 1);
      EXPECT_LE(steps_for_b, units / kTpotTargetMinPrefill + 4);
    }
    expect_pool_clean(e);
  }
}

// A long prompt admitted first no longer holds back the short prompts admitted with it: by
// default (the oldest prefill sure of max_batch / 4 tokens a step) the short ones get their first
// tokens before the long one; strictly oldest first (oldest_prefill_tokens = max_batch) after it.
// Outputs equal each request run alone either way.
TEST_F(EngineTest, LongPrefillDoesNotHoldBackShortPrompts) {
  for (const int oldest : {-1, 64}) {
    SCOPED_TRACE(oldest);
    EngineOptions o = base_options(4096);
    o.autostart = false;
    o.oldest_prefill_tokens = oldest;
    ASSERT_EQ(o.max_batch, 64);
    Engine e(o);
    const Tokenizer& tok = e.tokenizer();
    std::string story;
    while (story.size() < 1400) story += std::string(kShared) + " it rolled away. ";
    const std::vector<std::vector<int32_t>> prompts = {tok.encode(story, true), tok.encode("Tom had a blue car. He", true),
                                                       tok.encode("The sun was hot. Tim", true),
                                                       tok.encode("Sue liked to draw pictures of", true)};
    ASSERT_GT(prompts[0].size(), 4u * size_t(o.max_batch));  // several steps of prefill
    std::mutex mu;
    std::vector<int> first_at(prompts.size(), -1);  // order in which the first tokens came
    int n_first = 0;
    std::vector<GenRequest> rs;
    std::vector<GenResult> res(prompts.size());
    for (size_t i = 0; i < prompts.size(); ++i) {
      GenRequest r;
      r.prompt = prompts[i];
      r.params = greedy(6);
      r.params.logprobs = 0;
      r.on_logprob = [&, i](const TokenLogprob&) {
        std::lock_guard<std::mutex> lk(mu);
        if (first_at[i] < 0) first_at[i] = n_first++;
      };
      r.on_done = [&, i](const GenResult& g) { res[i] = g; };
      rs.push_back(std::move(r));
    }
    e.submit_all(std::move(rs));
    e.start();
    e.wait_idle();
    for (size_t i = 0; i < prompts.size(); ++i) {
      SCOPED_TRACE(i);
      EXPECT_EQ(res[i].tokens, greedy_alone(e, prompts[i], 6));
      ASSERT_GE(first_at[i], 0);
    }
    EXPECT_EQ(first_at[0], oldest < 0 ? 3 : 0);  // the three short prompts first, or the long one
    expect_pool_clean(e);
  }
}

TEST_F(EngineTest, StopStringsMaxTokensAndStreaming) {
  Engine e(base_options(2048));
  const Tokenizer& tok = e.tokenizer();
  const std::vector<int32_t> prompt = tok.encode("Once upon a time", true);
  GenResult full = e.generate(prompt, greedy(50));
  ASSERT_EQ(full.tokens.size(), 50u);
  EXPECT_EQ(full.finish_reason, "length");
  // Stop strings from the middle of the greedy text, starting at each of 12 consecutive bytes (so
  // at token boundaries and inside tokens): output ends right before the first occurrence, and
  // the streamed text is that output, the bytes held back before the stop string included.
  int inside_token = 0;
  for (size_t cut = full.text.size() / 2; cut < full.text.size() / 2 + 12; ++cut) {
    const std::string stop = full.text.substr(cut, 3);
    const size_t first = full.text.find(stop);
    // whether the stop string starts inside a token (not at the end of a prefix's decoded text)
    bool boundary = false;
    for (size_t k = 1; k <= full.tokens.size() && !boundary; ++k)
      boundary = tok.decode(std::vector<int32_t>(full.tokens.begin(), full.tokens.begin() + ptrdiff_t(k))).size() == first;
    inside_token += !boundary;
    GenParams p = greedy(50);
    p.stop = {"zzzz-never", stop};
    std::string streamed;
    GenResult stopped = generate_streamed(e, prompt, p, &streamed);
    EXPECT_EQ(stopped.finish_reason, "stop") << "stop '" << stop << "'";
    EXPECT_EQ(stopped.text, full.text.substr(0, first)) << "stop '" << stop << "'";
    EXPECT_EQ(streamed, stopped.text) << "stop '" << stop << "'";  // nothing before the stop lost, nothing of it sent
  }
  EXPECT_GT(inside_token, 0);  // the case that once lost the bytes before the stop string
  e.wait_idle();
  expect_pool_clean(e);
}

// vLLM's include_stop_str_in_output and min_tokens: the text ends after the stop string rather
// than before it; before min_tokens tokens, neither a stop string nor a stop token ends the text.
TEST_F(EngineTest, StopStringKeptAndMinTokens) {
  Engine e(base_options(2048));
  const Tokenizer& tok = e.tokenizer();
  const std::vector<int32_t> prompt = tok.encode("Once upon a time", true);
  const GenResult full = e.generate(prompt, greedy(60));
  ASSERT_EQ(full.tokens.size(), 60u);
  const auto run = [&](const GenParams& p, std::string* streamed) { return generate_streamed(e, prompt, p, streamed); };
  for (size_t cut = full.text.size() / 2; cut < full.text.size() / 2 + 6; ++cut) {
    const std::string stop = full.text.substr(cut, 4);
    const size_t first = full.text.find(stop);
    GenParams p = greedy(60);
    p.stop = {"zz-never", stop};
    p.include_stop_str = true;
    std::string streamed;
    const GenResult kept = run(p, &streamed);
    EXPECT_EQ(kept.finish_reason, "stop");
    EXPECT_EQ(kept.text, full.text.substr(0, first + 4)) << stop;
    EXPECT_EQ(streamed, kept.text);
  }
  // A stop string that occurs once, within the first 10 tokens' text: it ends the text, unless
  // min_tokens is past it.
  const size_t ten = tok.decode(std::vector<int32_t>(full.tokens.begin(), full.tokens.begin() + 10)).size();
  std::string early;
  for (size_t at = 0; at + 4 <= ten && early.empty(); ++at)
    if (full.text.find(full.text.substr(at, 4)) == at && full.text.find(full.text.substr(at, 4), at + 1) == std::string::npos)
      early = full.text.substr(at, 4);
  ASSERT_FALSE(early.empty());
  GenParams p = greedy(60);
  p.stop = {early};
  EXPECT_EQ(e.generate(prompt, p).finish_reason, "stop");
  p.min_tokens = 20;
  std::string streamed;
  const GenResult past = run(p, &streamed);
  EXPECT_EQ(past.finish_reason, "length");
  EXPECT_EQ(past.text, full.text);
  EXPECT_EQ(streamed, full.text);
  // ... also when it ends with token min_tokens and a longer stop string it begins holds it back
  // unsent: the next token does not find it (vLLM's check: stop strings that end past min_tokens)
  std::string held;
  int upto = 0;
  size_t end = 0;
  for (int j = 0; j < 30 && held.empty(); ++j) {
    end += tok.token_piece(full.tokens[size_t(j)]).size();
    if (end < 4) continue;
    const std::string c = full.text.substr(end - 4, 4);
    if (full.text.find(c) == end - 4 && full.text.find(c, end - 3) == std::string::npos) {
      held = c;
      upto = j + 1;
    }
  }
  ASSERT_FALSE(held.empty());
  p.stop = {held, held + "\x01"};
  p.min_tokens = upto;
  streamed.clear();
  EXPECT_EQ(run(p, &streamed).text, full.text) << held;
  EXPECT_EQ(streamed, full.text);
  p.min_tokens = upto - 1;  // one token earlier it ends the text
  EXPECT_EQ(e.generate(prompt, p).text, full.text.substr(0, end - 4));
  // min_tokens 1: a stop string in the first token's text does not end the text (it would leave it
  // empty); one in the second token's text does
  const std::string first_text = tok.token_piece(full.tokens[0]);
  ASSERT_FALSE(first_text.empty());
  p = greedy(60);
  p.stop = {first_text};
  EXPECT_EQ(e.generate(prompt, p).text, "");
  p.min_tokens = 1;
  const GenResult one = e.generate(prompt, p);
  const size_t again = full.text.find(first_text, 1);
  EXPECT_EQ(one.text, full.text.substr(0, again == std::string::npos ? full.text.size() : again));
  // A stop token: it ends the text where greedy decoding writes it; with min_tokens past that
  // place another token comes there and the text goes on to min_tokens at least.
  const size_t k = 6;
  const int32_t t = full.tokens[k];
  const size_t at = size_t(std::find(full.tokens.begin(), full.tokens.end(), t) - full.tokens.begin());
  p = greedy(60);
  p.stop_token_ids = {t};
  const GenResult stopped = e.generate(prompt, p);
  EXPECT_EQ(stopped.finish_reason, "stop");
  EXPECT_EQ(stopped.tokens.size(), at);
  p.include_stop_str = true;  // the stop token's text kept
  EXPECT_EQ(e.generate(prompt, p).text, stopped.text + tok.token_piece(t));
  p.include_stop_str = false;
  p.min_tokens = int(at) + 3;
  const GenResult longer = e.generate(prompt, p);
  ASSERT_GE(longer.tokens.size(), at + 3);
  EXPECT_TRUE(std::equal(full.tokens.begin(), full.tokens.begin() + ptrdiff_t(at), longer.tokens.begin()));
  EXPECT_EQ(std::count(longer.tokens.begin(), longer.tokens.begin() + ptrdiff_t(at + 3), t), 0);
  e.wait_idle();
  expect_pool_clean(e);
}

// ignore_eos (what kvq bench uses): the end-of-generation token is kept and generation goes on to
// max_tokens; the tokens before it are the ones a normal request gets. Timings are filled in.
// SmolLM2-Instruct ends a chat turn with <|im_end|> (stories260K's stories never end).
// SmolLM2-135M-Instruct in a small engine, and a user turn in its chat template.
static EngineOptions smollm2_options(const std::string& model) {
  EngineOptions o;
  o.model_path = model;
  o.threads = 2;
  o.ctx = 512;
  o.kv_tokens = 1024;
  return o;
}

static std::vector<int32_t> chat_prompt(const Engine& e, const std::string& user) {
  const std::string text = chat_render(chat_template_detect(e.model().file()), {{"user", user}});
  return e.tokenizer().encode(text, true, true);
}

TEST(EngineEos, IgnoreEosRunsToMaxTokens) {
  const std::string model = kvq_test_model("SmolLM2-135M-Instruct.Q4_1.gguf");
  if (model.empty()) GTEST_SKIP() << "SmolLM2-135M-Instruct.Q4_1.gguf not installed (run scripts/get-models.sh)";
  Engine e(smollm2_options(model));
  const std::vector<int32_t> prompt = chat_prompt(e, "Say hello.");
  const GenResult stopped = e.generate(prompt, greedy(100));
  ASSERT_EQ(stopped.finish_reason, "stop") << "the model no longer ends this turn within 100 tokens";
  ASSERT_LT(stopped.tokens.size(), 99u);
  GenParams p = greedy(100);
  p.ignore_eos = true;
  const GenResult full = e.generate(prompt, p);
  EXPECT_EQ(full.finish_reason, "length");
  ASSERT_EQ(full.tokens.size(), 100u);
  EXPECT_TRUE(std::equal(stopped.tokens.begin(), stopped.tokens.end(), full.tokens.begin()));
  EXPECT_TRUE(e.tokenizer().is_eog(full.tokens[stopped.tokens.size()]));
  EXPECT_GT(full.ttft_s, 0);
  EXPECT_GT(full.decode_s, 0);
  EXPECT_GT(stopped.ttft_s, 0);
  e.wait_idle();
  expect_pool_clean(e);
}

// JSON mode on an instruction-tuned model: the answer is one JSON object that ends the request
// ("stop") with the token that closes it, with or without ignore_eos (nothing can follow the
// object); without JSON mode the same request is no JSON object.
TEST(EngineEos, JsonModeClosesTheObject) {
  const std::string model = kvq_test_model("SmolLM2-135M-Instruct.Q4_1.gguf");
  if (model.empty()) GTEST_SKIP() << "SmolLM2-135M-Instruct.Q4_1.gguf not installed (run scripts/get-models.sh)";
  Engine e(smollm2_options(model));
  const std::vector<int32_t> prompt = chat_prompt(e, "Describe a cat as a JSON object with its name and age.");
  GenParams p = greedy(120);
  p.json_object = true;
  const GenResult a = e.generate(prompt, p);
  ASSERT_EQ(a.finish_reason, "stop") << a.text;
  const nlohmann::json doc = nlohmann::json::parse(a.text);
  EXPECT_TRUE(doc.is_object());
  EXPECT_FALSE(doc.empty());
  EXPECT_EQ(a.text.back(), '}');
  p.ignore_eos = true;
  const GenResult b = e.generate(prompt, p);
  EXPECT_EQ(b.finish_reason, "stop");
  EXPECT_EQ(b.text, a.text);
  EXPECT_EQ(b.tokens, a.tokens);
  GenParams plain = greedy(int(a.tokens.size()));
  const GenResult c = e.generate(prompt, plain);
  EXPECT_FALSE(nlohmann::json::accept(c.text)) << c.text;
  e.wait_idle();
  expect_pool_clean(e);
}

// Structured output on a real chat model: greedy, the answer is a document of the schema (the
// properties in the schema's order), ends "stop" with the token that closes it, ignore_eos or
// not; JSON mode and a schema together are refused.
TEST(EngineEos, JsonSchemaCompletesTheDocument) {
  const std::string model = kvq_test_model("SmolLM2-135M-Instruct.Q4_1.gguf");
  if (model.empty()) GTEST_SKIP() << "SmolLM2-135M-Instruct.Q4_1.gguf not installed (run scripts/get-models.sh)";
  Engine e(smollm2_options(model));
  const std::vector<int32_t> prompt = chat_prompt(e, "Describe a cat as a JSON object with its name, age and color.");
  GenParams p = greedy(160);
  p.grammar = Grammar::from_schema_text(
      R"({"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
          "color": {"enum": ["black", "white", "orange", "gray"]}, "indoor": {"type": "boolean"}},
          "required": ["name", "age", "color"]})");
  const GenResult a = e.generate(prompt, p);
  ASSERT_EQ(a.finish_reason, "stop") << a.text;
  const nlohmann::ordered_json doc = nlohmann::ordered_json::parse(a.text);
  ASSERT_TRUE(doc.is_object());
  auto it = doc.begin();
  ASSERT_EQ(it.key(), "name");
  size_t chars = 0;
  for (unsigned char ch : it.value().get<std::string>()) chars += (ch & 0xC0) != 0x80;
  EXPECT_LE(chars, 20u);
  ASSERT_EQ((++it).key(), "age");
  EXPECT_TRUE(it.value().is_number_integer());
  ASSERT_EQ((++it).key(), "color");
  EXPECT_NE(std::string("black white orange gray").find(it.value().get<std::string>()), std::string::npos);
  EXPECT_EQ(a.text.back(), '}');
  p.ignore_eos = true;
  const GenResult b = e.generate(prompt, p);
  EXPECT_EQ(b.finish_reason, "stop");
  EXPECT_EQ(b.tokens, a.tokens);
  GenParams both = p;
  both.json_object = true;
  const GenResult c = e.generate(prompt, both);
  EXPECT_EQ(c.finish_reason, "error");
  EXPECT_NE(c.error.find("JSON mode and a json_schema"), std::string::npos) << c.error;
  e.wait_idle();
  expect_pool_clean(e);
}

// Lazy grammars (GenParams::lazy_grammars): the reply is free until its text contains a trigger,
// then that trigger's grammar holds: from a token's end, or from inside a token (the token's rest
// read first); a rest the grammar refuses leaves the reply free; the earliest trigger wins.
TEST_F(EngineTest, LazyGrammarHoldsFromItsTrigger) {
  Engine e(base_options(2048));
  const Tokenizer& tok = e.tokenizer();
  const std::vector<int32_t> prompt = tok.encode("Once upon a time", true);
  const GenResult free = e.generate(prompt, greedy(40));
  ASSERT_EQ(free.tokens.size(), 40u);
  auto pieces = [&](const std::vector<int32_t>& ts, size_t n) {
    std::string s;
    for (size_t k = 0; k < std::min(n, ts.size()); ++k) s += tok.token_piece(ts[k]);
    return s;
  };
  const std::string text = pieces(free.tokens, free.tokens.size());
  // a token of two bytes or more whose last 5 bytes are first seen there
  size_t end = 0;
  for (size_t k = 5; k < 30 && !end; ++k) {
    const size_t e1 = pieces(free.tokens, k + 1).size();
    if (tok.token_piece(free.tokens[k]).size() >= 2 && text.find(text.substr(e1 - 5, 5)) == e1 - 5) end = e1;
  }
  ASSERT_GT(end, 0u) << text;
  auto lazy = [&](std::vector<GenParams::LazyGrammar> lg) {
    GenParams p = greedy(40);
    p.lazy_grammars = std::move(lg);
    return e.generate(prompt, p);
  };
  // the trigger ends where a token does
  GenResult r = lazy({{text.substr(end - 4, 4), Grammar::from_choices({" XYZ!"})}});
  EXPECT_EQ(r.finish_reason, "stop");
  EXPECT_EQ(pieces(r.tokens, r.tokens.size()), text.substr(0, end) + " XYZ!");
  // inside a token: its last byte is the grammar's first
  r = lazy({{text.substr(end - 5, 4), Grammar::from_choices({text.substr(end - 1, 1) + " XYZ!"})}});
  EXPECT_EQ(r.finish_reason, "stop");
  EXPECT_EQ(pieces(r.tokens, r.tokens.size()), text.substr(0, end) + " XYZ!");
  // a rest the grammar refuses: free
  r = lazy({{text.substr(end - 5, 4), Grammar::from_choices({"Q"})}});
  EXPECT_EQ(r.finish_reason, "length");
  EXPECT_EQ(r.tokens, free.tokens);
  // two triggers: the one whose text comes first holds, whatever the order they are listed in
  r = lazy({{text.substr(end - 4, 4), Grammar::from_choices({" late"})}, {text.substr(end - 5, 4), Grammar::from_choices({text.substr(end - 1, 1) + " early"})}});
  EXPECT_EQ(pieces(r.tokens, r.tokens.size()), text.substr(0, end) + " early");
  // a trigger never written: free
  r = lazy({{"zzzz-never", Grammar::from_choices({"x"})}});
  EXPECT_EQ(r.tokens, free.tokens);
  // not together with a grammar of the whole reply, nor without a trigger
  GenParams both = greedy(8);
  both.json_object = true;
  both.lazy_grammars = {{"a", Grammar::from_choices({"x"})}};
  EXPECT_EQ(e.generate(prompt, both).finish_reason, "error");
  r = lazy({{"", Grammar::from_choices({"x"})}});
  EXPECT_EQ(r.finish_reason, "error");
  EXPECT_NE(r.error.find("trigger"), std::string::npos) << r.error;
  e.wait_idle();
  expect_pool_clean(e);
}

// abort_all (the server's shutdown): a request running mid-generation and one still queued both
// end with "error" and the reason, their pages freed; a later submit fails at once.
TEST_F(EngineTest, AbortAllEndsRunningAndQueuedRequests) {
  EngineOptions o = base_options(2048);
  o.max_running = 1;  // the second request queues behind the first
  Engine e(o);
  const Tokenizer& tok = e.tokenizer();
  std::promise<GenResult> first, second;
  std::atomic<int> deltas{0};
  std::vector<GenRequest> rs(2);
  for (auto& r : rs) {
    r.prompt = tok.encode("Once upon a time", true);
    r.params = greedy(400);
  }
  rs[0].on_text = [&](const std::string&) {
    if (++deltas == 3) e.abort_all("shutting down");
  };
  rs[0].on_done = [&](const GenResult& g) { first.set_value(g); };
  rs[1].on_done = [&](const GenResult& g) { second.set_value(g); };
  e.submit_all(std::move(rs));
  const GenResult a = first.get_future().get(), b = second.get_future().get();
  EXPECT_EQ(a.finish_reason, "error");
  EXPECT_EQ(a.error, "shutting down");
  EXPECT_GE(a.tokens.size(), 3u);
  EXPECT_LT(a.tokens.size(), 400u);
  EXPECT_EQ(b.finish_reason, "error");
  EXPECT_TRUE(b.tokens.empty());
  EXPECT_TRUE(e.aborting());
  const GenResult later = e.generate(tok.encode("Hi", true), greedy(3));
  EXPECT_EQ(later.finish_reason, "error");
  EXPECT_EQ(later.error, "shutting down");
  e.wait_idle();
  expect_pool_clean(e);
}

TEST_F(EngineTest, CancelFreesPagesAndBadRequestsFail) {
  Engine e(base_options(2048));
  const Tokenizer& tok = e.tokenizer();
  std::promise<GenResult> pr;
  std::atomic<uint64_t> id{0};
  std::atomic<int> deltas{0};
  GenRequest r;
  r.prompt = tok.encode("Once upon a time", true);
  r.params = greedy(400);
  r.on_text = [&](const std::string&) {
    // The id is stored after submit returns: keep asking until it is known.
    if (++deltas >= 3 && id.load() != 0) e.cancel(id.load());
  };
  r.on_done = [&](const GenResult& g) { pr.set_value(g); };
  id = e.submit(std::move(r));
  GenResult g = pr.get_future().get();
  EXPECT_EQ(g.finish_reason, "cancelled");
  EXPECT_LT(g.tokens.size(), 400u);
  e.wait_idle();
  expect_pool_clean(e);

  GenResult empty = e.generate({}, greedy(4));
  EXPECT_EQ(empty.finish_reason, "error");
  EXPECT_FALSE(empty.error.empty());
  GenResult too_long = e.generate(std::vector<int32_t>(600, 5), greedy(4));
  EXPECT_EQ(too_long.finish_reason, "error");
  EXPECT_NE(too_long.error.find("context"), std::string::npos);
  GenResult bad_id = e.generate({1, 100000}, greedy(4));
  EXPECT_EQ(bad_id.finish_reason, "error");
  // Still serving.
  EXPECT_EQ(e.generate(tok.encode("Hi", true), greedy(3)).tokens.size(), 3u);

  // Several at once: a bad request among good ones fails alone; max_tokens 0 ends at once.
  std::vector<std::promise<GenResult>> got(4);
  std::vector<GenRequest> batch(4);
  const std::vector<std::vector<int32_t>> prompts = {tok.encode("Hi", true), {}, tok.encode("Lily", true),
                                                     tok.encode("Tom", true)};
  for (size_t i = 0; i < batch.size(); ++i) {
    batch[i].prompt = prompts[i];
    batch[i].params = greedy(i == 3 ? 0 : 3);
    batch[i].on_done = [&got, i](const GenResult& g) { got[i].set_value(g); };
  }
  const std::vector<uint64_t> ids = e.submit_all(std::move(batch));
  ASSERT_EQ(ids.size(), 4u);
  std::vector<GenResult> res;
  for (auto& p : got) res.push_back(p.get_future().get());
  EXPECT_EQ(res[0].tokens, e.generate(prompts[0], greedy(3)).tokens);
  EXPECT_EQ(res[1].finish_reason, "error");
  EXPECT_NE(res[1].error.find("empty"), std::string::npos);
  EXPECT_EQ(res[2].tokens, e.generate(prompts[2], greedy(3)).tokens);
  EXPECT_EQ(res[3].finish_reason, "length");
  EXPECT_TRUE(res[3].tokens.empty());
  EXPECT_TRUE(e.submit_all({}).empty());
  e.wait_idle();
  expect_pool_clean(e);
}

// Quantized caches (per-token codecs: the ones stories260K's head_dim 8 allows) share prefixes and
// serve the same tokens as a private cache of the same format.
TEST_F(EngineTest, QuantizedFormatsConcurrentEqualAlone) {
  for (const std::string kv : {"int8", "fp8_e4m3"}) {
    SCOPED_TRACE(kv);
    EngineOptions o = base_options(2048);
    o.kv.kv_cache_dtype = kv;
    Engine e(o);
    const Tokenizer& tok = e.tokenizer();
    const std::string shared = kShared;
    std::vector<std::vector<int32_t>> prompts = {tok.encode(shared + " she", true), tok.encode(shared + " he", true),
                                                 tok.encode("Tom had a blue car. He", true)};
    e.generate(tok.encode(shared, true), greedy(4));  // publishes the shared pages
    std::vector<Outcome> got = run_concurrently(e, prompts, greedy(30));
    for (size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(got[i].res.tokens, greedy_alone(e, prompts[i], 30, kv)) << i;
    EXPECT_GT(e.metrics().prefix_hit_tokens, 0u);
    expect_pool_clean(e);
  }
}

// A pool smaller than one context: a prompt that cannot fit is refused, and a lone sequence that
// outgrows the pool ends with "length" (the tokens it produced are still the right ones).
TEST_F(EngineTest, PoolSmallerThanContext) {
  Engine e(base_options(64));  // 4 pages of 16 tokens
  const Tokenizer& tok = e.tokenizer();
  const std::vector<int32_t> prompt = tok.encode("Lily went to the park and", true);
  GenResult g = e.generate(prompt, greedy(100));
  EXPECT_EQ(g.finish_reason, "length");
  EXPECT_EQ(int(prompt.size() + g.tokens.size()), 64 + 1);  // the last sampled token needs no page
  const std::vector<int32_t> ref = greedy_alone(e, prompt, int(g.tokens.size()));
  EXPECT_EQ(g.tokens, ref);
  GenResult big = e.generate(std::vector<int32_t>(100, 5), greedy(4));
  EXPECT_EQ(big.finish_reason, "error");
  EXPECT_NE(big.error.find("KV pool"), std::string::npos);
  e.wait_idle();
  expect_pool_clean(e);
}

namespace {

// Batch-invariant mode (kvq ... --batch-invariant) for the scope of a test.
struct BatchInvariantOn {
  bool prev = matmul_batch_invariant();
  BatchInvariantOn() { matmul_set_batch_invariant(true); }
  ~BatchInvariantOn() { matmul_set_batch_invariant(prev); }
};

// Each prompt token's log-probability through the prefill path (a request that generates nothing).
std::vector<TokenLogprob> score_prompt(Engine& e, const std::vector<int32_t>& ids) {
  GenParams s;
  s.max_tokens = 0;
  s.prompt_logprobs = true;
  const GenResult r = e.generate(ids, s);
  EXPECT_EQ(r.prompt_logprobs.size(), ids.size());
  return r.prompt_logprobs;
}

// Generates n greedy tokens after prompt, then scores prompt + those tokens by prefill: the
// log-probabilities the decode steps reported must equal the prefill path's bit for bit (the
// first generated token comes from the prompt's prefill, the others from decode steps). Returns
// the prefill scores.
std::vector<TokenLogprob> expect_decode_scores_equal_prefill(Engine& e, const std::vector<int32_t>& prompt, int n) {
  GenParams g;
  g.sampling.temperature = 0;
  g.max_tokens = n;
  g.logprobs = 0;
  g.ignore_eos = true;
  const GenResult gen = e.generate(prompt, g);
  EXPECT_EQ(gen.tokens.size(), size_t(n));
  std::vector<int32_t> all = prompt;
  all.insert(all.end(), gen.tokens.begin(), gen.tokens.end());
  const auto scored = score_prompt(e, all);
  if (scored.size() != all.size() || gen.logprobs.size() != gen.tokens.size()) {
    ADD_FAILURE() << "missing log-probabilities";
    return scored;
  }
  for (size_t i = 0; i < gen.tokens.size(); ++i)
    EXPECT_EQ(scored[prompt.size() + i].logprob, gen.logprobs[i].logprob) << "generated token " << i;
  return scored;
}

EngineOptions smollm2_options(const std::string& path, int ctx, int kv_tokens) {
  EngineOptions o;
  o.model_path = path;
  o.threads = 2;
  o.ctx = ctx;
  o.kv_tokens = kv_tokens;
  return o;
}

}  // namespace

// Batch-invariant matmuls on a model with quantized weights: the log-probabilities decode steps
// report for the generated tokens equal, bit for bit, those the prefill path scores for the same
// tokens, and a short prompt's scores equal the same tokens' inside a longer prompt (on AVX-512
// without the switch both differ by the 8-bit activation rounding's amplification of the prefill
// kernels' rounding: README, "Batch size and results").
TEST(EngineBatchInvariant, DecodeAndPrefillScoresAgreeExactly) {
  const std::string path = kvq_test_model("SmolLM2-135M-Instruct.Q4_1.gguf");
  if (path.empty()) GTEST_SKIP() << "SmolLM2-135M-Instruct.Q4_1.gguf not installed (run scripts/get-models.sh)";
  BatchInvariantOn inv;
  Engine e(smollm2_options(path, 256, 1024));
  const std::vector<int32_t> prompt =
      e.tokenizer().encode("The Roman empire was one of the largest empires in history.", true);
  ASSERT_GE(prompt.size(), 10u);
  const auto scored = expect_decode_scores_equal_prefill(e, prompt, 8);
  ASSERT_EQ(scored.size(), prompt.size() + 8);
  const std::vector<int32_t> head(prompt.begin(), prompt.begin() + 5);  // a prompt of fewer than 8 tokens
  const auto short_scores = score_prompt(e, head);
  ASSERT_EQ(short_scores.size(), head.size());
  for (size_t i = 1; i < head.size(); ++i) EXPECT_EQ(short_scores[i].logprob, scored[i].logprob) << "prompt token " << i;
}

// The same past 2048 tokens, where decode attention cuts a KV head's context between the threads
// unless batch invariance is on (SmolLM2: 3 KV heads on 2 threads): with it, no item is cut, and
// the generated tokens' log-probabilities still equal the prefill path's bit for bit.
TEST(EngineBatchInvariant, LongContextDecodeAndPrefillScoresAgreeExactly) {
  const std::string path = kvq_test_model("SmolLM2-135M-Instruct.Q4_1.gguf");
  if (path.empty()) GTEST_SKIP() << "SmolLM2-135M-Instruct.Q4_1.gguf not installed (run scripts/get-models.sh)";
  BatchInvariantOn inv;
  Engine e(smollm2_options(path, 2304, 4608));
  std::string text;
  for (int i = 0; text.size() < 12000; ++i)
    text += "Item " + std::to_string(i) + " of the list is a number that nobody has written down before. ";
  std::vector<int32_t> prompt = e.tokenizer().encode(text, true);
  ASSERT_GE(prompt.size(), 2200u);
  prompt.resize(2200);
  expect_decode_scores_equal_prefill(e, prompt, 3);
}

namespace {

// A long text of numbered lines (no shared data needed).
std::string numbered_text(int lines, const char* topic) {
  std::string s;
  for (int i = 1; i <= lines; ++i)
    s += fmt::format("Note {} on {}: the river by mill {} ran {} while the baker counted {} loaves.\n", i, topic,
                     i * 7 % 13, i % 2 ? "fast" : "slow", i * 3 + 1);
  return s;
}

}  // namespace

// Gemma 3 (15 of 18 layers see the last 512 positions) served from a pool: the sliding layers'
// pages are freed behind the window, prompts longer than the window share a cached prefix (its
// full-attention pages and the window pages it still reads), and a pool too small for all three
// sequences admits them as their pages allow; every output equals the request run alone on a
// private cache (batch-invariant matmuls, so that chunking does not move the 8-bit activation
// rounding). Preemption with sliding groups: KvPaging.WindowedPoolUnderRandomTraffic.
// Gemma 3 270M in 32-token pages, 128-token steps and a pool that holds one ~750-token sequence
// (not three at once).
EngineOptions gemma_window_options(const std::string& path) {
  EngineOptions o;
  o.model_path = path;
  o.threads = 2;
  o.ctx = 2048;
  o.kv.page_tokens = 32;
  o.max_batch = 128;
  o.kv_tokens = 1100;
  return o;
}

// An engine that drafts by prompt lookup, and a prompt whose continuation repeats it (its drafts kept).
static EngineOptions drafting_options() {
  EngineOptions o = base_options(4096);
  o.draft_max = 8;
  return o;
}
constexpr const char* kRepeating = "They have a big box. They have a big box. They have a";

// Speculative decoding by prompt lookup (EngineOptions::draft_max): with every row computed as a
// decode step computes it (batch invariance), the output is decoding's, token for token, greedy
// and sampled (each row samples as decoding would), alone and four at once, with log-probabilities,
// stop strings and max_tokens as without; drafts were made and kept.
TEST_F(EngineTest, SpeculativeDecodingKeepsDecodingsOutput) {
  BatchInvariantOn inv;
  Engine plain(base_options(4096)), spec(drafting_options());
  const Tokenizer& tok = plain.tokenizer();
  const std::vector<std::vector<int32_t>> prompts = {tok.encode("Once upon a time", true), tok.encode("Lily and Ben", true),
                                                     tok.encode("The cat sat on the mat. The cat", true),
                                                     tok.encode("One day, a little", true)};
  GenParams p = greedy(160);
  p.logprobs = 2;
  for (const auto& pr : prompts) {
    const GenResult a = plain.generate(pr, p), b = spec.generate(pr, p);
    EXPECT_EQ(a.tokens, b.tokens);
    EXPECT_EQ(a.text, b.text);
    EXPECT_EQ(a.finish_reason, b.finish_reason);
    ASSERT_EQ(a.logprobs.size(), b.logprobs.size());
    for (size_t i = 0; i < a.logprobs.size(); ++i) EXPECT_EQ(a.logprobs[i].logprob, b.logprobs[i].logprob) << i;
  }
  const EngineMetrics m = spec.metrics();
  EXPECT_GT(m.spec_draft_tokens, 0u);
  EXPECT_GT(m.spec_accepted_tokens, 0u);
  EXPECT_LE(m.spec_accepted_tokens, m.spec_draft_tokens);
  EXPECT_EQ(plain.metrics().spec_draft_tokens, 0u);
  // sampled, with penalties over the history: the same draws
  GenParams t = greedy(120);
  t.sampling.temperature = 0.9f;
  t.sampling.seed = 11;
  t.sampling.repeat_penalty = 1.1f;
  for (const auto& pr : prompts) EXPECT_EQ(plain.generate(pr, t).tokens, spec.generate(pr, t).tokens);
  // four at once, as each alone
  const std::vector<Outcome> together = run_concurrently(spec, prompts, greedy(100));
  for (size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(together[i].res.tokens, plain.generate(prompts[i], greedy(100)).tokens) << i;
  // max_tokens and a stop string cut where they cut without drafts
  const GenResult full = plain.generate(prompts[0], greedy(60));
  for (int n : {1, 2, 7, 37}) EXPECT_EQ(spec.generate(prompts[0], greedy(n)).tokens.size(), size_t(n));
  GenParams st = greedy(60);
  st.stop = {full.text.substr(full.text.size() / 2, 4)};
  const GenResult sa = plain.generate(prompts[0], st), sb = spec.generate(prompts[0], st);
  EXPECT_EQ(sa.text, sb.text);
  EXPECT_EQ(sb.finish_reason, "stop");
  plain.wait_idle();
  spec.wait_idle();
  expect_pool_clean(plain);
  expect_pool_clean(spec);

  // A pool of 4 pages: drafts take only pages the pool has (no preemption, no early end for them):
  // the sequence grows as far as without drafts
  EngineOptions small_o = base_options(64);
  small_o.draft_max = 8;
  Engine small(small_o);
  for (const char* text : {"Lily went to the park and", "Once upon a time"}) {
    const std::vector<int32_t> pr = tok.encode(text, true);
    const GenResult g = small.generate(pr, greedy(100));
    EXPECT_EQ(g.finish_reason, "length");
    EXPECT_EQ(int(pr.size() + g.tokens.size()), 64 + 1) << text;
    EXPECT_EQ(small.metrics().preemptions, 0u);
  }
  // Drafts leave the prefills waiting their share of a step: with 4 tokens a step, a prompt
  // submitted beside a decoding sequence whose drafts could fill every step has prompt tokens in
  // every step until it is computed, and gets its first token while that sequence still decodes
  EngineOptions tight = base_options(4096);
  tight.max_batch = 4;
  tight.draft_max = 8;
  tight.autostart = false;  // (both requests in from the first step)
  tight.prefill_attention_cost = 0;  // (units are tokens)
  std::vector<std::pair<double, double>> steps;  // (decode, prompt) tokens of each step
  tight.step_seconds = [&steps](double d, double p, double s) {
    steps.emplace_back(d, p);
    return s;
  };
  Engine busy(tight);
  const std::vector<int32_t> repeat = tok.encode("Lily and Ben. Lily and Ben. Lily and Ben. Lily and", true);
  std::promise<GenResult> long_done, short_done;
  GenRequest a;
  a.prompt = repeat;
  a.params = greedy(200);
  a.params.ignore_eos = true;
  std::atomic<double> a_end{0}, c_end{0};
  a.on_done = [&](const GenResult& g) {
    a_end = now_seconds();
    long_done.set_value(g);
  };
  busy.submit(std::move(a));
  GenRequest c;
  c.prompt = tok.encode("One day, a little girl named Sue saw a big red ball", true);
  c.params = greedy(1);
  c.on_done = [&](const GenResult& g) {
    c_end = now_seconds();
    short_done.set_value(g);
  };
  busy.submit(std::move(c));
  busy.start();
  const GenResult cg = short_done.get_future().get();
  const GenResult ag = long_done.get_future().get();
  EXPECT_EQ(cg.finish_reason, "length");
  EXPECT_EQ(ag.tokens.size(), 200u);
  EXPECT_GT(busy.metrics().spec_accepted_tokens, 0u);
  EXPECT_LT(c_end.load(), a_end.load()) << "the prompt waited for the drafting sequence to end";
  busy.wait_idle();
  const double prompt_tokens = double(repeat.size() + tok.encode("One day, a little girl named Sue saw a big red ball", true).size());
  double computed = 0;
  bool drafted_beside = false;
  for (const auto& [d, p] : steps) {
    if (computed < prompt_tokens) {
      EXPECT_GT(p, 0) << "a step of " << d << " decode tokens left the prompt waiting";
      drafted_beside |= d > 1;
    }
    computed += p;
  }
  EXPECT_TRUE(drafted_beside);  // (drafts were made while the prompt waited)
}

// Drafts under lazy grammars: rows after the kept draft that completes a trigger are masked by
// its grammar, as decoding masks them; the output is decoding's (batch invariance).
TEST_F(EngineTest, SpeculativeDecodingUnderLazyGrammars) {
  BatchInvariantOn inv;
  Engine plain(base_options(4096)), spec(drafting_options());
  const Tokenizer& tok = plain.tokenizer();
  const std::vector<int32_t> prompt = tok.encode(kRepeating, true);
  const GenResult free = plain.generate(prompt, greedy(60));
  std::string text;
  for (int32_t t : free.tokens) text += tok.token_piece(t);
  ASSERT_GT(text.size(), 40u);
  // triggers that end where a token does, at their first occurrence (a trigger ending inside a
  // token leaves the rest of that token to the grammar)
  int fired = 0;
  size_t end = 0;
  for (size_t k = 0; k < free.tokens.size(); ++k) {
    end += tok.token_piece(free.tokens[k]).size();
    if (k < 1 || k > 12 || end < 4 || text.find(text.substr(end - 4, 4)) != end - 4) continue;
    SCOPED_TRACE(k);
    GenParams p = greedy(60);
    p.lazy_grammars = {{text.substr(end - 4, 4), Grammar::from_choices({" Q Q Q."})}};
    const GenResult a = plain.generate(prompt, p), b = spec.generate(prompt, p);
    EXPECT_EQ(a.tokens, b.tokens) << a.text << "\n---\n" << b.text;
    EXPECT_EQ(a.finish_reason, b.finish_reason);
    fired += b.text.ends_with(" Q Q Q.");
  }
  EXPECT_GE(fired, 2);
  EXPECT_GT(spec.metrics().spec_accepted_tokens, 0u);
  spec.wait_idle();
  expect_pool_clean(spec);
}

// A reasoning budget (GenParams::reasoning_budget): the reply's first `tokens` tokens after its
// block opens (opened by the prompt, or by the reply's first two tokens' text), then the closing
// text's tokens whatever the logits say (its first newline left out after a newline), then the
// model's greedy continuation of all that; a block closed in time, a reply that opens none and a
// budget given up by a grammar leave the reply as it was; speculative decoding gives the same.
TEST_F(EngineTest, ReasoningBudgetForcesTheClose) {
  BatchInvariantOn inv;
  Engine e(base_options(4096)), spec(drafting_options());
  const Tokenizer& tok = e.tokenizer();
  const std::vector<int32_t> prompt = tok.encode(kRepeating, true);
  const std::vector<int32_t> free = greedy_alone(e, prompt, 40);
  ASSERT_EQ(free.size(), 40u);
  auto text_of = [&](size_t from, size_t to) {
    std::string t;
    for (size_t i = from; i < to; ++i) t += tok.token_piece(free[i]);
    return t;
  };
  const std::string close = "\n</think>\n\n";
  // the reply expected: `opened` tokens open the block, n reasoning tokens, the close, the rest
  auto expected = [&](size_t opened, size_t n, int max_tokens) {
    std::vector<int32_t> out(free.begin(), free.begin() + std::ptrdiff_t(opened + n));
    const bool nl = opened + n == 0 || text_of(0, opened + n).ends_with('\n');
    const std::vector<int32_t> forced = tok.encode_continuation(nl ? close.substr(1) : close, true);
    out.insert(out.end(), forced.begin(), forced.end());
    std::vector<int32_t> all = prompt;
    all.insert(all.end(), out.begin(), out.end());
    const std::vector<int32_t> rest = greedy_alone(e, all, max_tokens - int(out.size()));
    out.insert(out.end(), rest.begin(), rest.end());
    return out;
  };
  const std::vector<int32_t> as_free(free.begin(), free.begin() + 30);
  GenParams p = greedy(30);
  p.reasoning_budget.tokens = 6;
  p.reasoning_budget.close = {"</think>"};
  p.reasoning_budget.force = close;
  // opened by the prompt
  std::vector<int32_t> want = expected(0, 6, 30);
  ASSERT_NE(want, as_free);
  EXPECT_EQ(e.generate(prompt, p).tokens, want);
  EXPECT_EQ(spec.generate(prompt, p).tokens, want);
  p.reasoning_budget.tokens = 0;
  EXPECT_EQ(e.generate(prompt, p).tokens, expected(0, 0, 30));
  // opened by the reply's first two tokens
  std::string open = text_of(0, 2);
  open.erase(0, open.find_first_not_of(" \t\r\n"));
  ASSERT_FALSE(open.empty());
  p.reasoning_budget.open = open;
  p.reasoning_budget.tokens = 6;
  want = expected(2, 6, 30);
  EXPECT_EQ(e.generate(prompt, p).tokens, want);
  EXPECT_EQ(spec.generate(prompt, p).tokens, want);
  // a forced token's log-probability is the model's for it (the first: not greedy decoding's choice)
  GenParams lp = p;
  lp.logprobs = 0;
  const GenResult r = e.generate(prompt, lp);
  ASSERT_EQ(r.logprobs.size(), r.tokens.size());
  ASSERT_NE(want[8], free[8]);
  EXPECT_EQ(r.logprobs[8].token, want[8]);
  EXPECT_GT(r.logprobs[8].rank, 1);
  EXPECT_TRUE(std::isfinite(r.logprobs[8].logprob));
  // closed in time (the text of the reply's fifth token ends the block): untouched
  p.reasoning_budget.close = {text_of(4, 5)};
  EXPECT_EQ(e.generate(prompt, p).tokens, as_free);
  // a reply that opens no block: untouched
  p.reasoning_budget.close = {"</think>"};
  p.reasoning_budget.open = "<think>";
  EXPECT_EQ(e.generate(prompt, p).tokens, as_free);
  // under a grammar of the whole reply: not bounded
  GenParams g = greedy(30);
  g.grammar = Grammar::from_choices({" a b c d e f g h i j"});
  g.reasoning_budget = p.reasoning_budget;
  g.reasoning_budget.open.clear();
  g.reasoning_budget.tokens = 1;
  EXPECT_EQ(e.generate(prompt, g).text, " a b c d e f g h i j");
  EXPECT_GT(spec.metrics().spec_draft_tokens, 0u);
  spec.wait_idle();
  expect_pool_clean(spec);
}

// The same on a real model with the int8 and grouped (kivi4: drafts only in steps that pack no key
// group) KV formats, free and under a JSON Schema: decoding's output, token for token, and drafts kept.
TEST(EngineSpeculative, RealModelAndGroupedFormats) {
  const std::string path = kvq_test_model("SmolLM2-135M-Instruct.Q4_1.gguf");
  if (path.empty()) GTEST_SKIP() << "SmolLM2-135M-Instruct.Q4_1.gguf not installed (run scripts/get-models.sh)";
  BatchInvariantOn inv;
  for (const char* fmt : {"int8", "kivi4"}) {
    SCOPED_TRACE(fmt);
    EngineOptions o = smollm2_options(path, 512, 4096);
    o.kv.kv_cache_dtype = fmt;
    Engine plain(o);
    o.draft_max = 8;
    Engine spec(o);
    const std::vector<int32_t> prompt = chat_prompt(plain, "Repeat this list three times: apple, pear, plum, fig.");
    const GenResult a = plain.generate(prompt, greedy(96)), b = spec.generate(prompt, greedy(96));
    EXPECT_EQ(a.tokens, b.tokens) << a.text << "\n---\n" << b.text;
    EXPECT_GT(spec.metrics().spec_accepted_tokens, 0u);
    // constrained: each row masked by the grammar's state after the drafts kept before it
    const uint64_t kept_before = spec.metrics().spec_accepted_tokens;
    GenParams js = greedy(120);
    js.grammar = Grammar::from_schema_text(
        R"({"type": "object", "properties": {"fruits": {"type": "array", "items": {"enum": ["apple", "pear", "plum", "fig"]}}},
            "required": ["fruits"]})");
    const std::vector<int32_t> jp = chat_prompt(plain, "Write the list apple, pear, plum, fig three times as a JSON object.");
    const GenResult ja = plain.generate(jp, js), jb = spec.generate(jp, js);
    EXPECT_EQ(ja.tokens, jb.tokens) << ja.text << "\n---\n" << jb.text;
    EXPECT_EQ(ja.finish_reason, jb.finish_reason);
    EXPECT_GT(spec.metrics().spec_accepted_tokens, kept_before) << jb.text;
    spec.wait_idle();
    expect_pool_clean(spec);
  }
}

TEST(EngineWindows, GemmaSlidingPagesFreedAndShared) {
  const std::string path = kvq_test_model("gemma-3-270m-q4_k_m.gguf");
  if (path.empty()) GTEST_SKIP() << "gemma-3-270m-q4_k_m.gguf not installed (run scripts/get-models.sh)";
  BatchInvariantOn bi;
  EngineOptions o = gemma_window_options(path);
  o.autostart = false;
  Engine e(o);
  EXPECT_EQ(e.kv_shape().n_groups(), 6);  // 3 global layers, 15 sliding ones in 5 groups of 3
  const size_t pages = e.pool().n_pages();
  EXPECT_EQ(pages, e.kv_shape().pages_at(1100, 128));  // prefilled in 128-token steps
  EXPECT_GE(e.kv_tokens_capacity(), 1100u);
  EXPECT_LT(e.kv_tokens_capacity(), 1100u + 32u);
  // A page holding all 18 layers would give the same bytes pages / 6 positions.
  EXPECT_GT(e.kv_tokens_capacity(), pages * 32 / 6 * 3 / 2);
  const Tokenizer& tok = e.tokenizer();
  const std::string doc = numbered_text(30, "the valley");
  std::vector<std::vector<int32_t>> prompts = {
      tok.encode(doc + "Question: which mill ran fast? Answer:", true),
      tok.encode(doc + "Question: how many loaves were counted in note 3? Answer:", true),
      tok.encode(numbered_text(26, "the harbour") + "Summary:", true)};
  ASSERT_GT(prompts[0].size(), 600u);
  ASSERT_LT(prompts[0].size(), 1000u);
  std::vector<Outcome> got = run_concurrently(e, prompts, greedy(16));
  for (size_t i = 0; i < prompts.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(got[i].res.finish_reason, "length") << got[i].res.error;
    EXPECT_EQ(got[i].res.tokens, greedy_alone(e, prompts[i], 16));
  }
  // The second question adopts the document's pages (whole pages below its last prompt token).
  EXPECT_GE(got[1].res.cached_tokens, int(common_prefix(prompts[0], prompts[1]) / 32 * 32) - 32);
  EXPECT_GT(got[1].res.cached_tokens, 512);
  EXPECT_EQ(e.prefix_index().stats().duplicate_pages, 0u);
  expect_pool_clean(e);
}

// The KV offload tier (EngineOptions::kv_offload_bytes): a document's pages, evicted from a pool
// too small to keep them beside two other prompts, are read back from the tier by a later question
// on the same document instead of recomputed, and that question generates what it generates alone.
// Without the tier the same sequence of requests recomputes the document (the control: the tier is
// what makes the hit). f16 and int8 (the tier keeps the pool's packed bytes as they are; Gemma 3's
// test below runs q4_0).
TEST_F(EngineTest, OffloadedPrefixIsReadBackAndOutputsStayEqual) {
  const fs::path dir = fs::temp_directory_path() / "kvq_test_offload";
  fs::create_directories(dir);
  for (const char* kv : {"f16", "int8"})
    for (const bool tier : {false, true}) {
      SCOPED_TRACE(std::string(kv) + (tier ? " with the tier" : " without"));
      EngineOptions o = base_options(160);  // 10 pages of 16 tokens: one prompt and its answer
      o.kv.kv_cache_dtype = kv;
      if (tier) {
        o.kv_offload_dir = dir.string();
        o.kv_offload_bytes = size_t(4) << 20;
      }
      Engine e(o);
      const Tokenizer& tok = e.tokenizer();
      const std::string doc = std::string(kShared) + " ran to get it. The ball was shiny and new.";
      const std::vector<int32_t> first = tok.encode(doc + " Lily said", true);
      const std::vector<int32_t> later = tok.encode(doc + " Her mom smiled and", true);
      ASSERT_GE(common_prefix(first, later), 64u);
      ASSERT_LE(first.size() + 8, 150u);
      EXPECT_EQ(e.generate(first, greedy(8)).finish_reason, "length");
      // Two other prompts take the pool: the document's idle pages are evicted.
      for (const char* other : {"Tom had a little dog named Max. Max liked to run and jump in the sun and the rain all day",
                                "The sun was hot and the sky was blue. Sue and Ben went to the lake to swim with the ducks"}) {
        const std::vector<int32_t> p = tok.encode(std::string(other) + " long.", true);
        EXPECT_EQ(e.generate(p, greedy(40)).finish_reason, "length");
      }
      const EngineMetrics before = e.metrics();
      const GenResult g = e.generate(later, greedy(12));
      const EngineMetrics after = e.metrics();
      EXPECT_EQ(g.finish_reason, "length") << g.error;
      EXPECT_EQ(g.tokens, greedy_alone(e, later, 12, kv));
      EXPECT_EQ(after.offload, tier);
      if (tier) {
        // Every whole page of the common prefix below the last prompt token comes back.
        const int pages = int(std::min(common_prefix(first, later), later.size() - 1) / 16);
        EXPECT_EQ(g.cached_tokens, pages * 16);
        EXPECT_GT(after.offload_stats.stored_pages, 0u);
        EXPECT_EQ(after.offload_stats.loaded_pages - before.offload_stats.loaded_pages, uint64_t(pages));
        EXPECT_EQ(after.offload_hit_tokens - before.offload_hit_tokens, uint64_t(pages * 16));
        EXPECT_EQ(after.offload_stats.write_errors + after.offload_stats.read_errors, 0u);
      } else {
        EXPECT_EQ(g.cached_tokens, 0);
      }
      expect_pool_clean(e);
    }
  fs::remove_all(dir);
}

// --kv-offload-persist: the document a run computed (its pages in the pool when the engine stops,
// written to the tier then) is read back by the next run's question on it, under the same hash key,
// and the answer equals the request alone. The model is named by its content: a copy of the file
// under another path finds the same tier; another KV format has a file of its own; a run without
// persistence leaves the files alone.
TEST_F(EngineTest, PersistentOffloadTierServesTheNextRun) {
  const fs::path dir = fs::temp_directory_path() / "kvq_test_offload_persist";
  const fs::path copy_dir = fs::temp_directory_path() / "kvq_test_offload_persist_model";
  fs::remove_all(dir);
  fs::remove_all(copy_dir);
  fs::create_directories(dir);
  fs::create_directories(copy_dir);
  const auto options = [&](const char* kv) {
    EngineOptions o = base_options(160);
    o.kv.kv_cache_dtype = kv;
    o.kv_offload_dir = dir.string();
    o.kv_offload_bytes = size_t(4) << 20;
    o.kv_offload_persist = true;
    return o;
  };
  const auto files = [&] {
    size_t n = 0;
    for ([[maybe_unused]] const auto& e : fs::directory_iterator(dir)) ++n;
    return n;
  };
  const std::string doc = std::string(kShared) + " ran to get it. The ball was shiny and new.";
  std::vector<int32_t> first, later;
  {
    Engine e(options("int8"));
    first = e.tokenizer().encode(doc + " Lily said", true);
    later = e.tokenizer().encode(doc + " Her mom smiled and", true);
    EXPECT_EQ(e.metrics().offload_stats.pages_at_start, 0u);
    EXPECT_TRUE(e.metrics().offload_stats.persistent);
    EXPECT_EQ(e.generate(first, greedy(8)).finish_reason, "length");
    EXPECT_EQ(e.metrics().offload_stats.stored_pages, 0u);  // all in the pool still
  }
  EXPECT_EQ(files(), 1u);
  const int pages = int(std::min(common_prefix(first, later), later.size() - 1) / 16);
  ASSERT_GE(pages, 4);
  fs::copy_file(model_path(), copy_dir / "renamed.gguf");
  for (const bool renamed : {false, true}) {
    SCOPED_TRACE(renamed ? "the model under another path" : "the same model file");
    EngineOptions o = options("int8");
    if (renamed) o.model_path = (copy_dir / "renamed.gguf").string();
    Engine e(o);
    const EngineMetrics before = e.metrics();
    // The first run left the document's pages; the second, this very prompt's.
    const int hit = renamed ? int((later.size() - 1) / 16) : pages;
    EXPECT_GE(before.offload_stats.pages_at_start, size_t(hit));
    const GenResult g = e.generate(later, greedy(12));
    const EngineMetrics after = e.metrics();
    EXPECT_EQ(g.finish_reason, "length") << g.error;
    EXPECT_EQ(g.cached_tokens, hit * 16);
    EXPECT_EQ(after.offload_stats.loaded_pages - before.offload_stats.loaded_pages, uint64_t(hit));
    EXPECT_EQ(after.offload_hit_tokens - before.offload_hit_tokens, uint64_t(hit * 16));
    EXPECT_EQ(after.offload_stats.read_errors, 0u);
    EXPECT_EQ(g.tokens, greedy_alone(e, later, 12, "int8"));
    expect_pool_clean(e);
  }
  EXPECT_EQ(files(), 1u);
  {
    Engine e(options("f16"));  // another identity
    EXPECT_EQ(e.metrics().offload_stats.pages_at_start, 0u);
    const GenResult g = e.generate(later, greedy(4));
    EXPECT_EQ(g.cached_tokens, 0);
  }
  EXPECT_EQ(files(), 2u);
  {
    EngineOptions o = options("int8");
    o.kv_offload_persist = false;
    Engine e(o);
    EXPECT_EQ(e.generate(later, greedy(4)).cached_tokens, 0);
  }
  EXPECT_EQ(files(), 2u);
  {
    Engine e(options("int8"));
    EXPECT_GE(e.metrics().offload_stats.pages_at_start, size_t(pages));
  }
  fs::remove_all(dir);
  fs::remove_all(copy_dir);
}

TEST_F(EngineTest, OffloadOptionsAreChecked) {
  const fs::path dir = fs::temp_directory_path() / "kvq_test_offload_opts";
  fs::create_directories(dir);
  const auto error_of = [](const EngineOptions& o) {
    try {
      Engine e(o);
    } catch (const Error& err) {
      return std::string(err.what());
    }
    return std::string();
  };
  EngineOptions o = base_options(160);
  o.kv_offload_bytes = 1 << 20;
  EXPECT_NE(error_of(o).find("needs --kv-offload-dir"), std::string::npos);
  o = base_options(160);
  o.kv_offload_dir = dir.string();
  EXPECT_NE(error_of(o).find("needs --kv-offload-size"), std::string::npos);
  o.kv_offload_dir.clear();
  o.kv_offload_direct = true;
  EXPECT_NE(error_of(o).find("--kv-offload-direct needs"), std::string::npos);
  o.kv_offload_direct = false;
  o.kv_offload_persist = true;
  EXPECT_NE(error_of(o).find("--kv-offload-persist needs"), std::string::npos);
  o.kv_offload_persist = false;
  o.kv_offload_dir = dir.string();
  o.kv_offload_bytes = 1 << 20;
  o.kv_offload_dir = (dir / "missing").string();
  EXPECT_NE(error_of(o).find("is not a directory"), std::string::npos);
  o.kv_offload_dir = dir.string();
  o.kv_offload_bytes = 100;  // below one page
  EXPECT_NE(error_of(o).find("holds no KV page"), std::string::npos);
  o.kv_offload_bytes = 1 << 20;
  EXPECT_EQ(error_of(o), "");
  // The tier's file is unlinked once created: nothing stays in the directory.
  {
    Engine e(o);
    EXPECT_TRUE(fs::is_empty(dir));
  }
  fs::remove_all(dir);
}

// Gemma 3's sliding-window page groups: the document's group-0 pages and the window pages its next
// query reads are read back from the tier together, and the answer equals the request alone (a
// q4_0 cache: the tier holds packed 4-bit pages).
TEST(EngineWindows, GemmaOffloadedPrefixReadBack) {
  const std::string path = kvq_test_model("gemma-3-270m-q4_k_m.gguf");
  if (path.empty()) GTEST_SKIP() << "gemma-3-270m-q4_k_m.gguf not installed (run scripts/get-models.sh)";
  BatchInvariantOn bi;
  const fs::path dir = fs::temp_directory_path() / "kvq_test_offload_gemma";
  fs::create_directories(dir);
  EngineOptions o = gemma_window_options(path);
  o.kv_offload_dir = dir.string();
  o.kv_offload_bytes = size_t(64) << 20;
  o.kv.kv_cache_dtype = "q4_0";
  Engine e(o);
  const Tokenizer& tok = e.tokenizer();
  const std::string doc = numbered_text(30, "the valley");
  const std::vector<int32_t> first = tok.encode(doc + "Question: which mill ran fast? Answer:", true);
  const std::vector<int32_t> other = tok.encode(numbered_text(26, "the harbour") + "Summary:", true);
  const std::vector<int32_t> later = tok.encode(doc + "Question: how many loaves were counted in note 3? Answer:", true);
  EXPECT_EQ(e.generate(first, greedy(8)).finish_reason, "length");
  EXPECT_EQ(e.generate(other, greedy(8)).finish_reason, "length");
  const EngineMetrics before = e.metrics();
  const GenResult g = e.generate(later, greedy(16));
  const EngineMetrics after = e.metrics();
  EXPECT_EQ(g.finish_reason, "length") << g.error;
  EXPECT_EQ(g.tokens, greedy_alone(e, later, 16, "q4_0"));
  EXPECT_GT(g.cached_tokens, 512);
  EXPECT_GT(after.offload_hit_tokens - before.offload_hit_tokens, 0u);
  EXPECT_LE(after.offload_hit_tokens - before.offload_hit_tokens, uint64_t(g.cached_tokens));
  // Sliding groups' pages came back too, not only group 0's.
  EXPECT_GT(after.offload_stats.loaded_pages - before.offload_stats.loaded_pages,
            (after.offload_hit_tokens - before.offload_hit_tokens) / 32);
  EXPECT_EQ(after.offload_stats.write_errors + after.offload_stats.read_errors, 0u);
  expect_pool_clean(e);
  fs::remove_all(dir);
}

// Preemption with the offload tier: in a pool too small for four requests, preempted sequences'
// published pages are evicted into the tier and read back when they are admitted again. Outputs
// equal each request alone, the pool ends clean, and pages read back for readmissions are not
// counted as offload hits (the prompts share nothing: no hit of either kind).
TEST_F(EngineTest, PreemptedSequencesReadTheirPagesBackFromTheTier) {
  const fs::path dir = fs::temp_directory_path() / "kvq_test_offload_preempt";
  fs::create_directories(dir);
  EngineOptions o = base_options(128);  // 8 pages of 16 tokens
  o.kv_offload_dir = dir.string();
  o.kv_offload_bytes = size_t(4) << 20;
  {
    Engine e(o);
    const Tokenizer& tok = e.tokenizer();
    const std::vector<std::vector<int32_t>> prompts = four_short_prompts(tok);
    std::vector<Outcome> got = run_concurrently(e, prompts, greedy(60));
    const EngineMetrics m = e.metrics();
    EXPECT_GT(m.preemptions, 0u);
    EXPECT_EQ(m.prefix_hit_tokens, 0u);
    EXPECT_EQ(m.offload_hit_tokens, 0u);
    EXPECT_GT(m.offload_stats.stored_pages, 0u);
    EXPECT_EQ(m.offload_stats.write_errors + m.offload_stats.read_errors, 0u);
    for (size_t i = 0; i < prompts.size(); ++i) {
      SCOPED_TRACE(i);
      EXPECT_EQ(got[i].res.tokens, greedy_alone(e, prompts[i], 60));
    }
    // Readmitted sequences found their evicted pages in the tier (2-5 pages in every schedule seen).
    EXPECT_GT(m.offload_stats.loaded_pages, 0u);
    expect_pool_clean(e);
  }
  fs::remove_all(dir);
}
