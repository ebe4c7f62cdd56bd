// Serving engine: one model, one shared KV page pool with a prefix cache, and a scheduler thread
// that runs continuous batching over every admitted request.
//
// Scheduling (one loop iteration = one Forward::eval_batch):
//   - admission, FIFO: the head of the queue is admitted when the pages for its whole prompt are
//     available, minus the longest cached prefix (which it adopts) or the prefix a running
//     sequence is computing (which it will adopt), and minus the pages running sequences will
//     still take for their own prompts (pages are allocated lazily, chunk by chunk); nobody
//     overtakes it; with an offload tier (EngineOptions::kv_offload_bytes, KvOffload), the pages
//     of its prompt's prefix that the pool evicted into the tier are read back first
//     (restore_offloaded), when the whole prefix fits beside the pages promised, so the lookup
//     adopts them instead of the prefix being recomputed;
//   - in-flight prefixes: a prefilling sequence that holds only cached pages first adopts the
//     pages published since the last step (every step publishes the pages its chunks filled);
//     if its next prompt page is one that another running sequence is computing now, it skips the
//     step instead of computing that page a second time (defer_prefill: a strict order, so no
//     cycle of waits; recomputed every step, so a preempted or finished holder frees its waiters);
//   - step: every running sequence asks for its pending tokens (1 when decoding; a chunk of the
//     prompt when prefilling), decodes before prefills, within max_batch tokens; the prefills
//     share what the decodes leave (prefill_shares): the oldest is sure of oldest_prefill_tokens,
//     the rest goes to those with the fewest prompt tokens left first, so a long prompt does not
//     hold back the shorter ones admitted after it, prompts of equal length run oldest first, and
//     a prompt alone takes the whole budget; while sequences decode, prompt tokens are counted at
//     what their attention costs at their depth (PrefillCost), so steps deep in a long prompt do
//     not stretch the decoding sequences' time per token; with a time per output token target
//     (EngineOptions::tpot_target_ms), their budget is also at most what the step time fitted
//     from the engine's own steps (StepTimeFit) leaves of the target;
//     the pages each step needs are checked before eval_batch (so KvPoolFull never fires inside a
//     batch, where it would leave the earlier sequences of the batch half-appended);
//   - preemption by recompute: when the pool cannot supply a sequence's pages, the most recently
//     admitted running sequence releases its pages and goes back to the FRONT of the queue with
//     its prompt + generated tokens; it is prefilled again later (its sampler state is kept);
//   - after the step: newly full pages are published to the prefix index, one token is sampled
//     for each sequence whose pending tokens are all in the cache, stop conditions are checked,
//     finished sequences release their pages (cached pages stay resident, LRU-evicted).
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include "cache/kv_offload.h"
#include "model/json_constraint.h"
#include "model/json_schema.h"
#include "cache/page_pool.h"
#include "cache/prefix_index.h"
#include "model/model.h"
#include "model/reasoning_budget.h"
#include "model/sampler.h"
#include "model/tokenizer.h"
#include "tools/kv_flags.h"

namespace kvq {

struct EngineOptions {
  std::string model_path;
  int threads = 0;            // 0: hardware threads
  int max_batch = 256;        // tokens per step (decode + prefill chunks)
  int max_running = 64;       // sequences running at once
  // vLLM's --scheduling-policy priority: requests run in the order of GenParams::priority (lower
  // first; ties first come, first served): the waiting queue is kept in that order, the running
  // sequences take pages in that order (so pressure preempts the lowest priority, newest first),
  // and a waiting request that does not fit is admitted by preempting running ones of a lower
  // priority (only when that frees enough). false: first come, first served (priority must be 0).
  bool priority_scheduling = false;
  // Prompt tokens per step the oldest prefill is sure of while shorter prompts are prefilled
  // (prefill_shares); -1: max_batch / 4; >= max_batch: prefills strictly oldest first.
  int oldest_prefill_tokens = -1;
  // While sequences decode, a prompt token at depth d counts as 1 + R x (its attention
  // multiply-adds at d / its weight multiply-adds) of the step's budget and of
  // oldest_prefill_tokens (PrefillCost), so that a step carrying a chunk deep in a long prompt
  // takes about as long as a max_batch step at depth 0 and the decoding sequences' time per token
  // stays bounded. R: what one attention multiply-add costs next to one weight multiply-add; 0:
  // every token counts 1.
  double prefill_attention_cost = 2.0;
  // > 0: while sequences decode, a step carries only as many prompt units (as prefill_cost prices
  // them) as keep its expected time within this many milliseconds, at least
  // kTpotTargetMinPrefill (or what max_batch leaves), so that prompts still progress
  // (StepTimeFit: the engine's own step times, fitted as it runs). Trades the time to first token
  // for the time per output token, as a smaller max_batch does, but in time rather than tokens:
  // it holds at any depth, model and machine. 0: max_batch alone bounds a step.
  double tpot_target_ms = 0;
  // Tests: the step time StepTimeFit is given, from the step's decode and prompt units and the
  // time measured (a model of a machine instead of this one's noisy clock). Empty: the measured.
  std::function<double(double d, double p, double seconds)> step_seconds;
  // > 0: cached prefix pages the pool evicts go to a file of this many bytes in kv_offload_dir
  // (KvOffload) and are read back, instead of recomputed, by the next request with that prefix.
  size_t kv_offload_bytes = 0;
  std::string kv_offload_dir;
  bool kv_offload_direct = false;  // the tier's file past the OS page cache (O_DIRECT)
  // The tier's file is kept across runs (KvOffloadOptions::persist): named by the cache identity,
  // with the model named by a fingerprint of its file's content instead of its path, and saved
  // when the engine stops, after the pool's cached prefix pages have been written to it.
  bool kv_offload_persist = false;
  size_t kv_mem = 0;          // KV pool budget in bytes (0: use kv_tokens)
  size_t kv_tokens = 0;       // KV pool size in tokens (0 and kv_mem 0: 8 contexts' worth)
  int ctx = 0;                // context per sequence (0: the model's)
  KvFlags kv;
  bool autostart = true;      // false: requests wait until start() (tests batch them on purpose)
  // Speculative decoding by prompt lookup (model/draft.h, as kvq run --draft-max): a decoding
  // sequence's step runs its next token and up to draft_max tokens drafted from the latest earlier
  // occurrence of its last draft_ngram_max .. _min tokens (prompt or output), with logits after
  // each; row i is sampled as decoding would sample it, the drafts are kept while the samples
  // equal them, and the first sample that differs is the next token. A sequence's draft length
  // starts at draft_max, is halved back to what was kept plus one after a miss and doubles while
  // all are kept; a constrained request's rows are masked by its grammar's state after the drafts
  // kept before them, as decoding masks them (a lazy grammar's from the kept draft that completes
  // its trigger on). Not for a
  // step that would pack a group of a grouped KV format (kivi*, kvquant*). 0: off.
  int draft_max = 0;
  int draft_ngram_min = 2;
  int draft_ngram_max = 4;
};

struct GenParams {
  SamplerParams sampling;
  int max_tokens = 16;
  std::vector<std::string> stop;  // generation ends before the first occurrence of any of these
  bool ignore_eos = false;        // an end-of-generation token is kept and generation goes on
                                  // (benchmarks: every request generates max_tokens)
  std::vector<int32_t> stop_token_ids;  // generation ends at these tokens, as at end-of-generation
                                        // (not with ignore_eos's exemption; the token is not output)
  // vLLM's include_stop_str_in_output: the text ends after the stop string rather than before it
  // (and a stop token's text is kept).
  bool include_stop_str = false;
  // vLLM's min_tokens: until that many tokens are generated, the tokens that would end the text
  // (end of generation unless ignore_eos, stop_token_ids) are not sampled (unless a grammar leaves
  // nothing else) and stop strings are not looked for: a stop string ends the text only when it
  // ends in a later token (it may start before), as vLLM's check reads it.
  int min_tokens = 0;
  // >= 0: each generated token's log-probability under the model (token_logprob: raw logits,
  // before temperature, penalties and truncation) and that many top alternatives (at most 20).
  int logprobs = -1;
  // Each prompt token's log-probability given the tokens before it (the first has none), with
  // max(logprobs, 0) alternatives: what a harness scores a continuation by. Such a request
  // computes its whole prompt (it adopts no cached prefix pages; it still publishes its own), and
  // may set max_tokens = 0 to generate nothing. Prompts are scored by the prefill path: with f32
  // arithmetic (stories260K) its log-probabilities equal the decode path's to 1e-5; as served
  // (8-bit activations) the two differ by the engine's rounding noise, which any small change
  // amplifies (SmolLM2: up to ~0.1 on single tokens, the size of the f32-vs-f16-KV floor of
  // bench/QUALITY.md), so compare scores from one path, or set matmul_set_batch_invariant(true)
  // (weights/weights.h), with which the two paths agree bit for bit.
  bool prompt_logprobs = false;
  int prompt_logprobs_top = 0;  // the prompt tokens' alternatives: max(logprobs, this)
  // JSON mode (OpenAI's response_format {"type": "json_object"}): only tokens that keep the text a
  // prefix of one JSON object are sampled, and generation ends ("stop") with the token that closes
  // it, ignore_eos or not (the grammar of {"type": "object"}, model/json_schema.h). A request cut
  // short by max_tokens ends with "length" mid-object, as OpenAI's does; a stop string can cut it
  // too. logprobs stay those of the model's distribution (before the mask, as before any sampling
  // setting).
  bool json_object = false;
  // Structured output (OpenAI's response_format {"type": "json_schema"}): only tokens that keep
  // the text a prefix of a document of the schema (model/json_schema.h) are sampled; generation
  // ends ("stop") with the token that completes a document nothing can follow (an object, an
  // array, a string), or with end of generation once the document is complete. Not together
  // with json_object.
  std::shared_ptr<const Grammar> grammar;
  // Grammars that apply from a trigger on (llama.cpp's lazy grammars: a model's own function-call
  // syntax, free text before it): the reply is free until its text first contains one of the
  // triggers (the earliest occurrence; the first listed when two start together); from the end of
  // that occurrence on, that trigger's grammar constrains the rest as `grammar` constrains a whole
  // reply (what the token that completed the trigger wrote past it is read first; when it does not
  // fit, the reply stays free). Not together with json_object or grammar.
  struct LazyGrammar {
    std::string trigger;  // non-empty
    std::shared_ptr<const Grammar> grammar;
  };
  std::vector<LazyGrammar> lazy_grammars;
  // EngineOptions::priority_scheduling: lower runs first (vLLM's priority). Else must be 0.
  int priority = 0;
  // A bound on the reply's reasoning (model/reasoning_budget.h): once its tokens are spent, the
  // block's closing text is written whatever the model's logits say (not while a grammar holds the
  // reply: a call that a lazy grammar constrains is written whole, and a grammar of the whole reply
  // leaves no reasoning). The forced tokens are generated tokens like any (max_tokens counts them,
  // logprobs give their log-probabilities under the model).
  ReasoningBudget reasoning_budget;
};

struct GenResult {
  std::vector<int32_t> tokens;  // generated token ids (EOG not included)
  std::string text;             // generated text, cut before a stop string
  std::string finish_reason;    // "stop", "length", "cancelled", "error"
  // What stopped it (vLLM's stop_reason): the stop string, or the stop token id (stop_token_ids);
  // neither for end of generation, a grammar's end or a length.
  std::string stop_string;
  int32_t stop_token = -1;
  std::string error;            // when finish_reason == "error"
  int prompt_tokens = 0;
  int completion_tokens = 0;
  int cached_tokens = 0;        // prompt tokens adopted from the prefix cache (last admission)
  int preemptions = 0;
  std::vector<TokenLogprob> logprobs;         // (tokens) with GenParams::logprobs >= 0
  std::vector<TokenLogprob> prompt_logprobs;  // (prompt_tokens) with prompt_logprobs; [0]: token only, logprob NaN
  // Timing as a client of the engine sees it (seconds): submit -> first sampled token (an
  // end-of-generation token counts: it ends the wait), and first -> last sampled token. -1 / 0
  // when no token was sampled.
  double ttft_s = -1;
  double decode_s = 0;
};

struct GenRequest {
  std::vector<int32_t> prompt;  // token ids, non-empty
  GenParams params;
  // Text deltas as they become final (valid UTF-8, stop strings held back). Scheduler thread.
  std::function<void(const std::string& delta)> on_text;
  // With params.logprobs >= 0: each generated token's log-probability as the token is sampled,
  // before the text it adds reaches on_text (which may hold that text back). Scheduler thread.
  std::function<void(const TokenLogprob& lp)> on_logprob;
  // Called once at the end (scheduler thread, or the submitting thread for rejected requests).
  std::function<void(const GenResult&)> on_done;
};

struct Histogram {
  std::vector<double> bounds;      // upper bounds of the buckets (the +Inf bucket is implicit)
  std::vector<uint64_t> counts;    // (bounds.size() + 1) per-bucket counts, not cumulative
  double sum = 0;
  uint64_t count = 0;
  explicit Histogram(std::vector<double> b = {}) : bounds(std::move(b)), counts(bounds.size() + 1, 0) {}
  void observe(double v);
};

struct EngineMetrics {
  Histogram ttft{{0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0}};
  Histogram tpot{{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0}};
  // Submit -> end of requests that ended normally (stop, length), and submit -> first admission
  // to the running batch (the wait for pages and for a running slot) of every admitted request.
  Histogram e2e{{0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0}};
  Histogram queue{{0.001, 0.005, 0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0}};
  // Steps on which a sequence that sampled before waits for its next token (scheduling, forward
  // pass and sampling): the time --tpot-target-ms bounds.
  Histogram decode_step{{0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0}};
  int running = 0;
  int waiting = 0;
  double kv_usage = 0;
  size_t kv_tokens_capacity = 0;  // the most tokens one sequence can hold in the pool (kv_tokens_capacity())
  uint64_t prefix_query_tokens = 0;
  uint64_t prefix_hit_tokens = 0;
  uint64_t prefix_readmit_query_tokens = 0;  // preempted sequences admitted again (not in the hit rate)
  uint64_t prefix_readmit_hit_tokens = 0;
  uint64_t preemptions = 0;
  bool offload = false;  // EngineOptions::kv_offload_bytes > 0; then the tier's counters:
  KvOffloadStats offload_stats;
  // Prompt tokens adopted from pages read back from the tier (first admissions, as
  // prefix_hit_tokens: part of those).
  uint64_t offload_hit_tokens = 0;
  uint64_t requests_finished = 0;
  uint64_t requests_cancelled = 0;  // of those, ended by cancel()
  uint64_t prompt_tokens = 0;
  uint64_t generation_tokens = 0;
  // EngineOptions::draft_max: tokens drafted and of those kept (generated by the verifications)
  uint64_t spec_draft_tokens = 0;
  uint64_t spec_accepted_tokens = 0;
};

// How a step's prefill budget is split (Engine::step). Prefills are given oldest first: left[i]
// is prefill i's prompt tokens still to compute, limits[i] (<= left[i]) the most it can take this
// step. The oldest first gets up to oldest_tokens; what is left of the budget then goes to the
// prefills with the fewest tokens left (after that first share) first, ties to the older, each up
// to its limit. So a short prompt is not held back by a long one ahead of it (which still gets
// oldest_tokens a step), and equal prompts run oldest first. Returns each prefill's tokens.
// A name for a GGUF file's content (size and sampled bytes hashed): what a persistent offload
// tier's identity names the model by (EngineOptions::kv_offload_persist).
std::string gguf_fingerprint(const gguf::File& f);

std::vector<int> prefill_shares(const std::vector<int>& limits, const std::vector<int>& left, int budget,
                                int oldest_tokens);

// What prompt tokens cost a step while sequences decode (EngineOptions::prefill_attention_cost), in
// depth-0 tokens: a token at position p costs 1 + per_token + full x (p + 1) + sum over sliding
// windows w of windows[w] x min(p + 1, w), the coefficients being R x attention multiply-adds per
// visible position / weight multiply-adds per token.
struct PrefillCost {
  double full = 0;                               // the full-attention layers together
  std::vector<std::pair<int, double>> windows;   // (window, coefficient) per window size
  double per_token = 0;  // more per token (scored(): each row's logits, output projection and log-softmax)
  static PrefillCost from_model(const ModelConfig& c, double r);
  // The same for prompt tokens whose every row's logits are computed (GenParams::prompt_logprobs):
  // each also costs the output projection, n_vocab x n_embd multiply-adds / the weight ones.
  PrefillCost scored(const ModelConfig& c) const;
  bool active() const { return full > 0 || !windows.empty(); }
  // Tokens [start, start + n), rounded up.
  int cost(int start, int n) const;
  // The same, not rounded.
  double units(int start, int n) const;
  // The most of up to `limit` tokens from `start` that `budget` units pay for.
  int tokens_for(int start, int budget, int limit) const;
};

// The engine's step times, for EngineOptions::tpot_target_ms: t = a + b x D + c x P, D the step's
// decode tokens and P its prompt tokens, both in PrefillCost::units (1 per token when it is off),
// fitted by least squares over every measured step, each weighted by forget^(steps since), so
// that the fit follows a machine whose load changes. Decode and prompt tokens have their own
// coefficient (a few decode rows are bound by reading the weights, prompt chunks by their
// arithmetic); a weak penalty on b - c decides the direction steps leave open while decode and
// prompt units have not been seen apart, and a fit with b < 0 leaves decode units out. A fit
// that prices a prompt unit at (next to) nothing (noise on steps whose time is mostly fixed costs)
// is not used: the last one that did not is kept. A step is taken at most at 3x what the fit in
// use predicts for it, so one stalled step does not shrink the budgets for hundreds of steps.
class StepTimeFit {
 public:
  explicit StepTimeFit(double forget = 0.99) : forget_(forget) {}
  void observe(double d, double p, double seconds);
  // The most prompt units a step with d decode units can carry and be expected to take at most
  // `seconds` (0 when even none would exceed it). Until the fit is in use (kMinSteps steps, some
  // with prompt units, a fit that prices a prompt unit), a step is expected to take the fastest
  // step seen (at least the fixed cost) plus every unit at the dearest time per unit of the steps
  // seen (their fixed costs included; decaying by forget a step): counting the fixed cost twice,
  // so the first steps beside decodes come in under the target, at the price of smaller prompt
  // chunks meanwhile. -1 before any step with tokens.
  double prefill_within(double d, double seconds) const;
  // The fit in use (a, b, c), in seconds; false until there is one.
  bool coefficients(double out[3]) const;
  static constexpr int kMinSteps = 8;

 private:
  bool solve(double out[3]) const;
  double forget_;
  double s_[3][3] = {};  // sum of weight x x x^T, x = (1, d, p)
  double r_[3] = {};     // sum of weight x t
  double p_weight_ = 0;  // weight of the steps with prompt units
  int n_ = 0;
  double k_[3] = {};     // the fit in use
  bool valid_ = false;
  double price_ = 0;  // the dearest seconds / (d + p) of the steps seen, decaying by forget a step
  double fastest_ = -1;  // the fastest step seen, seconds (-1: none)
};

// The fewest prompt units a step gives the prompts being prefilled under
// EngineOptions::tpot_target_ms.
inline constexpr int kTpotTargetMinPrefill = 16;

// The engine serves at most the model's trained context (EngineOptions::ctx beyond it is capped):
// the warning kvq serve and kvq bench print when a --ctx-size is capped.
void engine_warn_ctx_capped(int ctx, int n_ctx_train);

// The --oldest-prefill-tokens and --prefill-attention-cost options' help (kvq serve and kvq bench).
inline constexpr const char* kOldestPrefillTokensHelp =
    "prompt tokens per step the oldest prompt being prefilled is sure of (counted as --prefill-attention-cost "
    "prices them while sequences decode); the rest of the step goes to the prompts with the fewest tokens left "
    "(default: --max-batch / 4; >= --max-batch: prompts strictly oldest first)";

inline constexpr const char* kPrefillAttentionCostHelp =
    "while sequences decode, a prompt token at depth d counts as 1 + R x (its attention multiply-adds at d / its "
    "weight multiply-adds) tokens of --max-batch, so that steps carrying a chunk deep in a long prompt take about "
    "as long as steps at depth 0 and the decoding sequences' time per output token stays bounded (0: every "
    "token counts 1, as vLLM's token budget)";

inline constexpr const char* kTpotTargetHelp =
    "while sequences decode, a step carries only as many prompt tokens as keep its expected time (fitted from the "
    "engine's own step times as it runs) within this many milliseconds, and at least 16 (priced as "
    "--prefill-attention-cost prices them), so that each output token takes about this long while first tokens "
    "come later; 0: --max-batch alone bounds a step";

class Engine {
 public:
  explicit Engine(const EngineOptions& o);  // loads the model; throws kvq::Error
  const EngineOptions& options() const { return opt_; }
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  void start();  // starts the scheduler thread (no-op when running)

  // Queues a request; returns its id. Thread-safe. Requests that can never run (empty prompt,
  // prompt + 1 beyond the context, prompt larger than the whole pool) finish at once with
  // finish_reason "error".
  uint64_t submit(GenRequest r);
  // Queues several requests at once: the scheduler sees all of them at the same step (their ids,
  // in order). Thread-safe.
  std::vector<uint64_t> submit_all(std::vector<GenRequest> rs);
  // The request ends as soon as the scheduler sees it ("cancelled"), its pages are freed.
  void cancel(uint64_t id);
  // Shutting down: every queued and running request ends at the next step with finish_reason
  // "error" and `reason` (its pages freed), and every later submit at once. Thread-safe.
  void abort_all(const std::string& reason);
  bool aborting() const;
  // submit and wait.
  GenResult generate(const std::vector<int32_t>& prompt, const GenParams& p);

  EngineMetrics metrics() const;
  const Model& model() const { return *model_; }
  const Tokenizer& tokenizer() const { return tok_; }
  // What the KV flags resolved to (the formats per layer, calibration, G and R).
  const KvSetup& kv_setup() const { return kv_; }
  int ctx() const { return ctx_; }
  const PagePool& pool() const { return *pool_; }  // inspect only when the engine is idle
  // The most tokens one sequence can hold in the whole pool, prefilled in max_batch steps: with
  // sliding-window layers, every position's page of the full-attention group plus the window's
  // pages of the sliding groups.
  size_t kv_tokens_capacity() const { return kv_capacity_; }
  // A cache of the engine's configuration in its pool, holding nothing (page counts, shapes).
  const KvCache& kv_shape() const { return *shape_; }
  const PrefixIndex& prefix_index() const { return *index_; }
  // True when no request is queued or running.
  bool idle() const;
  // Blocks until idle() (tests).
  void wait_idle() const;

 private:
  struct Seq;
  void loop();
  bool step();  // one scheduling iteration; false when there was nothing to do
  void finish(Seq& s, const char* reason, const std::string& error = "");
  // GenParams::lazy_grammars: the token just generated, looked at for a trigger
  void trigger_lazy_grammar(Seq& s, int32_t token);
  // A sampled token taken into the sequence (end of generation, stop strings, grammar, log
  // probabilities from its row `lg`, text, max_tokens). false: the sequence finished.
  // tpot: the time per output token to record (NaN: since the last token; < 0: none).
  bool take_token(Seq& s, int32_t next, const float* lg, int n_vocab,
                  double tpot = std::numeric_limits<double>::quiet_NaN());
  // EngineOptions::draft_max: the step's rows of a sequence that ran drafted tokens, verified;
  // the cache's step committed with what was kept, the tokens taken.
  void verify_drafts(Seq& s, int n, const float* rows, int n_vocab);
  // The token a reasoning budget makes the sequence take next (-1: none: sample).
  int32_t forced_token(const Seq& s) const;
  // The stop string, if any, that ends in the text added at `added` (past min_tokens): the text
  // cut there (GenParams::include_stop_str: after it), GenResult::stop_string set.
  bool stop_string_ends(Seq& s, size_t added);
  void preempt(size_t running_index);
  void emit_text(Seq& s, bool final);
  void update_gauges();
  void update_keys(Seq& s) const;
  size_t inflight_pages(const Seq& s, size_t limit, size_t before) const;
  bool defer_prefill(Seq& s, size_t index) const;
  // skip: running sequences left out (those an admission would preempt)
  size_t outstanding_pages(const std::function<bool(const Seq&)>& skip = {}) const;
  // EngineOptions::priority_scheduling: the running sequences of a lower priority than `head`
  // preempted, lowest first, while `head` does not fit (pages: need, beyond what stays promised;
  // or a running slot) and only when preempting all of them would make it fit. true: it fits now.
  bool preempt_for(const Seq& head, size_t need);
  size_t active_running() const;
  // The pages of the longest prefix of s's first n tokens held by the pool or the offload tier
  // (group 0 and the window pages each sliding group reads after it) are read back into the pool
  // and cached in the index, if they all fit beside `outstanding` promised pages.
  void restore_offloaded(Seq& s, int n, size_t outstanding);

  EngineOptions opt_;
  std::unique_ptr<Model> model_;
  Tokenizer tok_;
  int ctx_ = 0;
  int oldest_prefill_tokens_ = 0;  // prefill_shares' oldest_tokens (resolved from the options)
  PrefillCost prefill_cost_;  // prompt tokens' cost while sequences decode
  PrefillCost prefill_cost_scored_;  // the same for prompt_logprobs chunks (every row's logits)
  StepTimeFit step_fit_;      // scheduler thread only
  KvSetup kv_;
  KvCacheConfig kcfg_;
  std::unique_ptr<ThreadPool> threads_;
  std::unique_ptr<Forward> fwd_;
  // The pool points at the index (its evictor): the index must outlive the pool, so it is
  // declared first (destroyed last).
  std::unique_ptr<PrefixIndex> index_;
  std::unique_ptr<PagePool> pool_;
  std::unique_ptr<KvCache> shape_;  // holds no page; destroyed before the pool
  std::unique_ptr<JsonVocab> json_vocab_;        // the tokens' bytes (made on first use)
  std::unique_ptr<GrammarVocab> grammar_vocab_;  // and the vocabulary's trie, for JSON mode and json_schema
  const GrammarVocab& grammar_vocab();            // (made on first use)
  std::unique_ptr<KvOffload> offload_;  // the index's spill (detached before the pool empties)
  uint64_t offload_hit_tokens_ = 0;
  double restore_seconds_ = 0;  // this step's offload reads (left out of the step-time fit)
  size_t kv_capacity_ = 0;           // kv_tokens_capacity(): the pool never changes size

  // Shared with submitters (mu_).
  mutable std::mutex mu_;
  mutable std::condition_variable cv_, idle_cv_;
  std::deque<std::unique_ptr<Seq>> incoming_;
  std::unordered_set<uint64_t> cancelled_;
  std::string abort_reason_;  // non-empty: abort_all was called
  uint64_t next_id_ = 1;
  bool stop_ = false;
  bool busy_ = false;  // the scheduler holds requests
  EngineMetrics metrics_;

  // Scheduler thread only.
  std::deque<std::unique_ptr<Seq>> waiting_;
  std::vector<std::unique_ptr<Seq>> running_;  // admission order
  std::vector<std::function<void()>> done_;    // on_done calls of the current step
  std::thread thread_;
};

}  // namespace kvq
