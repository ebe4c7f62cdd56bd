#include "tools/bench.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <limits>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/cpu.h"
#include "core/error.h"
#include "core/thread_pool.h"
#include "core/timer.h"
#include "engine/engine.h"
#include "model/chat.h"
#include "tools/files.h"
#include "tools/jsonl.h"
#include "tools/report.h"
#include "server/serve_cli.h"

namespace kvq {

void bench_add_cli(CLI::App& app, BenchOptions& o) {
  app.add_option("-m,--model", o.model, "GGUF model file")->required();
  app.add_option("--kv", o.kv_list, "KV formats to compare (comma-separated; KFMT/VFMT for different K and V, FMT@gN for a token group)")
      ->capture_default_str();
  app.add_option("--kv-mem", o.kv_mem,
                 "KV page pool budget, the same for every format (e.g. 256MiB, 2GiB; comma-separated: one sweep each)")
      ->capture_default_str();
  app.add_option("--concurrency", o.concurrency,
                 "closed loop: clients, each sending its next request when its previous one ends (comma-separated: "
                 "one run each; default 1,8 unless --rate is given)");
  app.add_option("--rate", o.rate, "open loop: requests per second, Poisson arrivals (comma-separated: one run each)");
  app.add_option("--seed", o.seed, "seed of the --rate arrivals")->capture_default_str();
  app.add_option("--workload", o.workload,
                 "JSONL workload, one request per line: {\"prompt\": \"...\", \"max_tokens\": n, \"turns\": [\"follow-up\", ...]} "
                 "(turns: a conversation; each follow-up is sent with the answers so far)");
  app.add_option("--data", o.data, "text to cut a shared-prefix workload from (instead of --workload)");
  app.add_option("--prefixes", o.prefixes, "shared-prefix workload: distinct prefixes (documents, conversations)")
      ->check(CLI::Range(1, 100000))
      ->capture_default_str();
  app.add_option("--prefix-tokens", o.prefix_tokens, "shared-prefix workload: tokens per prefix")
      ->check(CLI::Range(1, 1 << 24))
      ->capture_default_str();
  app.add_option("--question-tokens", o.question_tokens, "shared-prefix workload: tokens of each request's own suffix")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("--turns", o.turns,
                 "shared-prefix workload: turns per conversation; each turn sends the conversation so far (its "
                 "prefix, earlier questions and answers) plus a new question")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  app.add_option("--requests", o.requests,
                 "requests per run (default: each JSONL line once; 4 per prefix); with --turns, conversations")
      ->check(CLI::Range(1, 1000000));
  app.add_option("--max-tokens", o.max_tokens, "tokens generated per request (a JSONL line's max_tokens wins)")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("-t,--threads", o.threads, "threads (default: all hardware threads)")->check(CLI::Range(1, 1024));
  app.add_option("-c,--ctx-size", o.ctx, "context per request (default: the model's)");
  app.add_option("--draft-max", o.draft_max,
                 "speculative decoding by prompt lookup, as kvq serve --draft-max (0: off); the drafted and kept "
                 "tokens are reported")
      ->check(CLI::Range(0, 64))
      ->capture_default_str();
  app.add_option("--max-batch", o.max_batch, "tokens per engine step (decode + prefill chunks)")
      ->check(CLI::Range(1, 1 << 20))
      ->capture_default_str();
  app.add_option("--max-running", o.max_running, "sequences running at once")->check(CLI::Range(1, 1 << 16))->capture_default_str();
  app.add_option("--prefill-attention-cost", o.prefill_attention_cost, kPrefillAttentionCostHelp)
      ->check(CLI::Range(0.0, 1e6))
      ->capture_default_str();
  app.add_option("--oldest-prefill-tokens", o.oldest_prefill_tokens, kOldestPrefillTokensHelp)
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--kv-offload-dir", o.kv_offload_dir, kKvOffloadDirHelp);
  app.add_flag("--kv-offload-direct", o.kv_offload_direct, kKvOffloadDirectHelp);
  app.add_option("--kv-offload-size", o.kv_offload_size,
                 std::string(kKvOffloadSizeHelp) +
                     ". Comma-separated: every format and load runs with each (0: no tier; 0,8GiB shows what the "
                     "tier buys). Every run starts with an empty tier, as with an empty pool");
  app.add_option("--tpot-target-ms", o.tpot_target_ms,
                 std::string(kTpotTargetHelp) + ". Comma-separated: every format and load runs at each (0,45,60 shows "
                 "what each target costs in TTFT and throughput)")
      ->capture_default_str();
  app.add_flag("--chat", o.chat, "--workload: each prompt is a user turn in the model's chat template");
  app.add_option("--chat-template-file", o.chat_template_file, "with --chat: "
                 "a chat template (Jinja, as a GGUF carries it) to use instead of the model's, for a file whose own is missing or wrong (llama.cpp's flag); kvq recognizes the families it renders by their markers")
      ->type_name("FILE");
  app.add_flag("--json", o.json, "print JSON instead of a table");
  app.add_option("--json-out", o.json_out, "also write the JSON report to this file");
  app.add_option("--html", o.html, "write a self-contained HTML report with plots");
  kv_flags_add_shared(app, o.kv);
}

double bench_percentile(std::vector<double>& v, double p) {
  if (v.empty()) return std::numeric_limits<double>::quiet_NaN();
  std::sort(v.begin(), v.end());
  const double x = std::clamp(p, 0.0, 1.0) * double(v.size() - 1);
  const size_t i = size_t(x);
  if (i + 1 >= v.size()) return v.back();
  return v[i] + (x - double(i)) * (v[i + 1] - v[i]);
}

namespace {

std::vector<std::string> split_csv(const std::string& s, const char* flag) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    const size_t a = item.find_first_not_of(" \t"), b = item.find_last_not_of(" \t");
    if (a == std::string::npos) fail("{}: empty entry in '{}'", flag, s);
    out.push_back(item.substr(a, b - a + 1));
  }
  if (out.empty()) fail("{}: nothing given", flag);
  return out;
}

// A session: its first prompt, then follow-up turns (multi-turn chat): turn k + 1's prompt is
// turn k's prompt, the tokens turn k generated (end-of-generation tokens left out) and
// followups[k]. A single request is a session of one turn.
struct BenchRequest {
  std::vector<int32_t> prompt;
  int max_tokens = 0;
  std::vector<std::vector<int32_t>> followups;
  int turns() const { return 1 + int(followups.size()); }
  // Longest prompt + generation of its last turn.
  size_t longest() const {
    size_t n = prompt.size();
    for (const auto& f : followups) n += size_t(max_tokens) + f.size();
    return n + size_t(max_tokens);
  }
  size_t last_prompt() const { return longest() - size_t(max_tokens); }
};

std::vector<BenchRequest> load_workload(const BenchOptions& o, const Tokenizer& tok, const ChatTemplate& tpl) {
  std::vector<BenchRequest> reqs;
  jsonl_for_each(o.workload, "--workload", [&](const nlohmann::json& j, int ln) {
    if (!j.is_object() || !j.contains("prompt") || !j["prompt"].is_string())
      fail("--workload {}:{}: each line needs a string field \"prompt\"", o.workload, ln);
    BenchRequest r;
    r.max_tokens = o.max_tokens;
    if (j.contains("max_tokens")) {
      if (!j["max_tokens"].is_number_integer() || j["max_tokens"].get<long long>() < 1 ||
          j["max_tokens"].get<long long>() > (1 << 20))
        fail("--workload {}:{}: \"max_tokens\" must be an integer in 1..{}", o.workload, ln, 1 << 20);
      r.max_tokens = j["max_tokens"].get<int>();
    }
    if (o.chat)
      r.prompt = tok.encode(chat_render(tpl, {{"user", j["prompt"].get<std::string>()}}), true, true);
    else
      r.prompt = tok.encode(j["prompt"].get<std::string>(), true);
    if (r.prompt.empty()) fail("--workload {}:{}: the prompt is empty", o.workload, ln);
    // A conversation: the follow-up user turns, each sent after the previous answer, with it.
    if (j.contains("turns")) {
      if (!j["turns"].is_array()) fail("--workload {}:{}: \"turns\" must be an array of strings", o.workload, ln);
      for (const auto& t : j["turns"]) {
        if (!t.is_string()) fail("--workload {}:{}: \"turns\" must be an array of strings", o.workload, ln);
        std::string text = t.get<std::string>();
        if (o.chat) text = chat_render_next_turn(tpl, text);
        std::vector<int32_t> ids = tok.encode(text, false, o.chat);
        if (ids.empty()) fail("--workload {}:{}: an empty follow-up turn", o.workload, ln);
        r.followups.push_back(std::move(ids));
      }
    }
    reqs.push_back(std::move(r));
  });
  if (reqs.empty()) fail("--workload {}: no requests (empty file)", o.workload);
  return reqs;
}

// --prefixes documents of --prefix-tokens consecutive tokens of --data, then each request's own
// --question-tokens from the text after them (wrapping around that remainder when it runs out).
std::vector<BenchRequest> shared_prefix_workload(const BenchOptions& o, const Tokenizer& tok, int n_requests) {
  const std::vector<int32_t> ids = tok.encode(read_text_file(o.data, "--data"), false);
  const size_t P = size_t(o.prefix_tokens), Q = size_t(o.question_tokens), N = size_t(o.prefixes);
  if (ids.size() < N * P + Q)
    fail("--data has {} tokens, fewer than --prefixes {} x --prefix-tokens {} + --question-tokens {}", ids.size(), N, P,
         Q);
  const size_t rest = ids.size() - N * P;
  std::vector<BenchRequest> reqs(static_cast<size_t>(n_requests));
  size_t qi = 0;  // questions drawn so far
  auto question = [&] {
    const size_t q0 = (qi++ * Q) % (rest - Q + 1);
    return std::vector<int32_t>(ids.begin() + long(N * P + q0), ids.begin() + long(N * P + q0 + Q));
  };
  for (size_t r = 0; r < reqs.size(); ++r) {
    BenchRequest& b = reqs[r];
    if (tok.add_bos() && tok.bos() >= 0) b.prompt.push_back(tok.bos());
    const size_t p = r % N;
    b.prompt.insert(b.prompt.end(), ids.begin() + long(p * P), ids.begin() + long((p + 1) * P));
    const std::vector<int32_t> q = question();
    b.prompt.insert(b.prompt.end(), q.begin(), q.end());
    b.max_tokens = o.max_tokens;
    for (int t = 1; t < o.turns; ++t) b.followups.push_back(question());
  }
  return reqs;
}

// One run's load: closed loop (clients > 0: each sends its next request when its previous one
// ends) or open loop (rate > 0 requests per second, Poisson arrivals).
struct BenchLoad {
  int clients = 0;
  double rate = 0;
  std::string str() const {
    char b[64];
    if (rate > 0) std::snprintf(b, sizeof b, "%g req/s", rate);
    else std::snprintf(b, sizeof b, "%d client%s", clients, clients == 1 ? "" : "s");
    return b;
  }
};

struct RunResult {
  std::string format;
  double tpot_target_ms = 0;  // --tpot-target-ms of the run (0: none)
  std::string budget;  // --kv-mem as given
  size_t kv_mem = 0;
  BenchLoad load;
  size_t kv_tokens = 0;
  double kv_bytes_per_token = 0;
  bool fits = true;
  bool prefix_cache = true;  // false: the format's residual window keeps prefixes private
  size_t tail_max = 0;        // f32 tail bytes per running sequence at most (KvCache::max_tail_bytes)
  size_t window_reserve = 0;  // of kv_mem: f32 windows of the sequences the load can run at once
  int requests = 0, ok = 0, errors = 0;
  std::string first_error;
  double wall_s = 0;
  long prompt_tokens = 0, completion_tokens = 0;
  double throughput = 0;  // generated tokens per second
  double ttft_p50 = 0, ttft_p95 = 0, tpot_p50 = 0, tpot_p95 = 0;
  // Also the means and 99th percentiles, and end-to-end latency (submit -> last token), as vLLM's
  // serving benchmark reports them.
  double ttft_mean = 0, ttft_p99 = 0, tpot_mean = 0, tpot_p99 = 0, e2e_mean = 0, e2e_p50 = 0, e2e_p95 = 0, e2e_p99 = 0;
  double hit_rate = 0;
  uint64_t preemptions = 0;
  uint64_t drafted = 0, kept = 0;  // --draft-max: tokens drafted, and kept by verification
  // --kv-offload-size: prompt tokens read back from the tier / prompt tokens looked up, and the
  // tier's traffic during the run.
  bool offload = false;
  size_t offload_bytes = 0;  // the run's --kv-offload-size (0: no tier)
  double offload_hit_rate = 0;
  uint64_t offload_loaded = 0, offload_stored = 0;
  double offload_read_s = 0, offload_write_s = 0;
};

EngineOptions engine_options(const BenchOptions& o, const std::string& format, size_t kv_mem, double tpot_target_ms,
                             size_t offload_bytes) {
  EngineOptions eo;
  eo.model_path = o.model;
  eo.threads = o.threads;
  eo.max_batch = o.max_batch;
  eo.draft_max = o.draft_max;
  eo.max_running = o.max_running;
  eo.oldest_prefill_tokens = o.oldest_prefill_tokens;
  eo.prefill_attention_cost = o.prefill_attention_cost;
  eo.tpot_target_ms = tpot_target_ms;
  eo.kv_mem = kv_mem;
  eo.kv_offload_bytes = offload_bytes;
  if (offload_bytes > 0) eo.kv_offload_dir = o.kv_offload_dir;
  eo.kv_offload_direct = offload_bytes > 0 && o.kv_offload_direct;
  eo.ctx = o.ctx;
  eo.kv = o.kv;
  eo.kv.kv_cache_dtype = format;
  return eo;
}

RunResult run_one(Engine& eng, const std::string& format, const BenchLoad& load, const std::vector<BenchRequest>& reqs,
                  unsigned seed) {
  RunResult rr;
  rr.format = format;
  rr.load = load;
  rr.requests = 0;
  for (const auto& r : reqs) rr.requests += r.turns();
  rr.kv_tokens = eng.kv_tokens_capacity();
  rr.kv_bytes_per_token = eng.kv_shape().bytes_per_token();

  // Warm-up (not measured): the first forward pass faults in the weights and scratch. A prompt
  // shorter than a page publishes nothing to the prefix cache.
  {
    std::vector<int32_t> w(reqs.front().prompt.begin(),
                           reqs.front().prompt.begin() + long(std::min<size_t>(reqs.front().prompt.size(), 8)));
    GenParams gp;
    gp.sampling.temperature = 0;
    gp.max_tokens = 2;
    gp.ignore_eos = true;
    eng.generate(w, gp);
  }
  const EngineMetrics m0 = eng.metrics();

  // Results of every turn: session i's turn k at first[i] + k.
  std::vector<size_t> first(reqs.size() + 1, 0);
  for (size_t i = 0; i < reqs.size(); ++i) first[i + 1] = first[i] + size_t(reqs[i].turns());
  std::mutex mu;
  std::condition_variable cv;
  std::vector<GenResult> res(first.back());
  std::vector<size_t> ended;  // sessions whose current turn ended (driver's queue)
  std::vector<std::vector<int32_t>> prompt(reqs.size());
  std::vector<int> turn(reqs.size(), 0);
  int in_flight = 0;  // sessions started and not finished
  size_t next = 0;    // next session to start
  // Open loop: session i starts at arrival[i] (Poisson process, seeded), whatever is in flight;
  // its follow-up turns are sent as soon as the previous one ends.
  std::vector<double> arrival(reqs.size(), 0.0);
  if (load.rate > 0) {
    std::mt19937_64 rng(seed);
    std::exponential_distribution<double> gap(load.rate);
    for (size_t i = 1; i < reqs.size(); ++i) arrival[i] = arrival[i - 1] + gap(rng);
  }
  const int conc = load.rate > 0 ? std::numeric_limits<int>::max() : load.clients;
  auto submit_turn = [&](size_t i) {  // called without mu held
    GenRequest r;
    r.prompt = prompt[i];
    r.params.max_tokens = reqs[i].max_tokens;
    r.params.sampling.temperature = 0;
    r.params.ignore_eos = true;
    const size_t slot = first[i] + size_t(turn[i]);
    r.on_done = [&, i, slot](const GenResult& g) {
      std::lock_guard<std::mutex> g_lk(mu);
      res[slot] = g;
      ended.push_back(i);
      cv.notify_one();
    };
    eng.submit(std::move(r));  // a rejected request finishes inside submit, on this thread
  };
  const Tokenizer& tok = eng.tokenizer();
  const double t0 = now_seconds();
  std::unique_lock<std::mutex> lk(mu);
  while (next < reqs.size() || in_flight > 0) {
    // Turns that ended: the session's next turn, or the session is done.
    while (!ended.empty()) {
      const size_t i = ended.back();
      ended.pop_back();
      const GenResult& g = res[first[i] + size_t(turn[i])];
      const bool failed = g.finish_reason == "error" || g.finish_reason == "cancelled";
      if (failed || turn[i] + 1 >= reqs[i].turns()) {
        --in_flight;
        continue;
      }
      for (int32_t t : g.tokens)
        if (!tok.is_eog(t)) prompt[i].push_back(t);
      const auto& f = reqs[i].followups[size_t(turn[i])];
      prompt[i].insert(prompt[i].end(), f.begin(), f.end());
      ++turn[i];
      lk.unlock();
      submit_turn(i);
      lk.lock();
    }
    while (in_flight < conc && next < reqs.size() && now_seconds() - t0 >= arrival[next]) {
      const size_t i = next++;
      ++in_flight;
      prompt[i] = reqs[i].prompt;
      lk.unlock();
      submit_turn(i);
      lk.lock();
    }
    if (!ended.empty()) continue;
    if (load.rate > 0 && next < reqs.size()) {
      cv.wait_for(lk, std::chrono::duration<double>(std::max(0.0, t0 + arrival[next] - now_seconds())));
      continue;
    }
    if (next >= reqs.size() && in_flight == 0) break;
    cv.wait(lk, [&] { return !ended.empty() || (in_flight < conc && next < reqs.size()); });
  }
  lk.unlock();
  rr.wall_s = now_seconds() - t0;
  const EngineMetrics m1 = eng.metrics();

  std::vector<double> ttft, tpot, e2e;
  for (const GenResult& g : res) {
    if (g.finish_reason.empty() || g.finish_reason == "error" || g.finish_reason == "cancelled") {
      ++rr.errors;  // empty: never sent, an earlier turn of its conversation failed
      if (rr.first_error.empty() && !g.finish_reason.empty()) rr.first_error = g.error.empty() ? g.finish_reason : g.error;
      continue;
    }
    ++rr.ok;
    rr.prompt_tokens += g.prompt_tokens;
    rr.completion_tokens += g.completion_tokens;
    if (g.ttft_s >= 0) ttft.push_back(g.ttft_s);
    if (g.ttft_s >= 0) e2e.push_back(g.ttft_s + g.decode_s);
    if (g.completion_tokens >= 2) tpot.push_back(g.decode_s / double(g.completion_tokens - 1));
  }
  rr.throughput = rr.wall_s > 0 ? double(rr.completion_tokens) / rr.wall_s : 0;
  rr.ttft_p50 = bench_percentile(ttft, 0.5);
  rr.ttft_p95 = bench_percentile(ttft, 0.95);
  rr.tpot_p50 = bench_percentile(tpot, 0.5);
  rr.tpot_p95 = bench_percentile(tpot, 0.95);
  const auto mean = [](const std::vector<double>& v) {
    double s = 0;
    for (double x : v) s += x;
    return v.empty() ? std::numeric_limits<double>::quiet_NaN() : s / double(v.size());
  };
  rr.ttft_mean = mean(ttft);
  rr.ttft_p99 = bench_percentile(ttft, 0.99);
  rr.tpot_mean = mean(tpot);
  rr.tpot_p99 = bench_percentile(tpot, 0.99);
  rr.e2e_mean = mean(e2e);
  rr.e2e_p50 = bench_percentile(e2e, 0.5);
  rr.e2e_p95 = bench_percentile(e2e, 0.95);
  rr.e2e_p99 = bench_percentile(e2e, 0.99);
  const uint64_t q = m1.prefix_query_tokens - m0.prefix_query_tokens;
  rr.hit_rate = q ? double(m1.prefix_hit_tokens - m0.prefix_hit_tokens) / double(q) : 0;
  rr.preemptions = m1.preemptions - m0.preemptions;
  rr.drafted = m1.spec_draft_tokens - m0.spec_draft_tokens;
  rr.kept = m1.spec_accepted_tokens - m0.spec_accepted_tokens;
  if (m1.offload) {
    rr.offload = true;
    rr.offload_hit_rate = q ? double(m1.offload_hit_tokens - m0.offload_hit_tokens) / double(q) : 0;
    rr.offload_loaded = m1.offload_stats.loaded_pages - m0.offload_stats.loaded_pages;
    rr.offload_stored = m1.offload_stats.stored_pages - m0.offload_stats.stored_pages;
    rr.offload_read_s = m1.offload_stats.read_seconds - m0.offload_stats.read_seconds;
    rr.offload_write_s = m1.offload_stats.write_seconds - m0.offload_stats.write_seconds;
  }
  return rr;
}

// "412.0ms" below a second, "1.234s" from there; "-" when nothing was measured.
std::string fmt_time(double s) {
  char b[32];
  if (!std::isfinite(s)) return "-";
  if (s < 1) std::snprintf(b, sizeof b, "%.1fms", 1e3 * s);
  else std::snprintf(b, sizeof b, "%.3fs", s);
  return b;
}

nlohmann::json num_or_null(double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(nullptr); }

}  // namespace

int bench_command(const BenchOptions& o) {
  const std::vector<std::string> formats = split_csv(o.kv_list, "--kv");
  // A whole list item as a decimal number within [lo, hi] (not NaN, not hexadecimal), or NaN.
  const auto number_in = [](const std::string& c, double lo, double hi) {
    size_t pos = 0;
    double v = 0;
    try {
      if (c.find_first_of("xX") == std::string::npos) v = std::stod(c, &pos);
    } catch (const std::exception&) {
      pos = 0;
    }
    return pos > 0 && pos == c.size() && v >= lo && v <= hi ? v : std::nan("");
  };
  // Closed-loop runs (--concurrency, default 1,8 when --rate is not given), then open-loop ones.
  std::vector<BenchLoad> loads;
  const std::string clients = o.concurrency.empty() && o.rate.empty() ? "1,8" : o.concurrency;
  if (!clients.empty()) {
    for (const std::string& c : split_csv(clients, "--concurrency")) {
      const double v = number_in(c, 1, 4096);
      if (std::isnan(v) || v != std::floor(v)) fail("--concurrency: '{}' is not a number of clients in 1..4096", c);
      loads.push_back({int(v), 0});
    }
  }
  if (!o.rate.empty()) {
    for (const std::string& c : split_csv(o.rate, "--rate")) {
      // below one request per ~17 minutes a run would mostly wait for its arrivals
      const double v = number_in(c, 1e-3, 1e6);
      if (std::isnan(v)) fail("--rate: '{}' is not a request rate in [0.001, 1000000] requests per second", c);
      loads.push_back({0, v});
    }
  }
  std::vector<double> targets;
  for (const std::string& c : split_csv(o.tpot_target_ms, "--tpot-target-ms")) {
    const double v = number_in(c, 0, 1e9);
    if (std::isnan(v)) fail("--tpot-target-ms: '{}' is not a time in [0, 1e9] ms", c);
    if (std::find(targets.begin(), targets.end(), v) != targets.end()) fail("--tpot-target-ms: {} given twice", c);
    targets.push_back(v);
  }
  // --kv-offload-size: one tier size, or a list whose "0" runs without a tier.
  std::vector<size_t> offloads;
  std::vector<std::string> offload_names;
  for (const std::string& c : split_csv(o.kv_offload_size.empty() ? std::string("0") : o.kv_offload_size,
                                        "--kv-offload-size")) {
    size_t v = 0;
    if (c != "0") {
      try {
        v = parse_bytes(c);
      } catch (const Error& e) {
        fail("--kv-offload-size: {}", e.what());
      }
    }
    if (std::find(offloads.begin(), offloads.end(), v) != offloads.end()) fail("--kv-offload-size: {} given twice", c);
    offloads.push_back(v);
    offload_names.push_back(c);
  }
  std::vector<std::pair<double, size_t>> variants;  // (target, tier size): a run each per format, budget, load
  for (const double t : targets)
    for (const size_t b : offloads) variants.emplace_back(t, b);
  const bool any_tier = std::any_of(offloads.begin(), offloads.end(), [](size_t v) { return v > 0; });
  if (any_tier != !o.kv_offload_dir.empty())
    fail("--kv-offload-dir and --kv-offload-size go together (the tier's directory and its size)");
  if (o.kv_offload_direct && !any_tier) fail("--kv-offload-direct needs --kv-offload-dir and --kv-offload-size");
  const auto offload_name = [&](size_t bytes) {
    for (size_t i = 0; i < offloads.size(); ++i)
      if (offloads[i] == bytes) return offload_names[i];
    return std::to_string(bytes);
  };
  // A run's name in the table and the plots: its format, and its target and tier size when several
  // are swept.
  const auto run_name = [&](const std::string& format, double target, size_t offload) {
    std::string n = targets.size() > 1 && target > 0 ? fmt::format("{} @{:g}ms", format, target) : format;
    if (offloads.size() > 1 && offload > 0) n += " +" + offload_name(offload);
    return n;
  };
  {  // no output may be an input or the other output
    const std::vector<ReportPath> inputs = {{"the model (-m)", o.model},
                                            {"the text (--data)", o.data},
                                            {"the workload (--workload)", o.workload},
                                            {"the calibration (--kv-scales)", o.kv.scales_file}};
    std::vector<ReportPath> json_others = inputs;
    json_others.push_back({"--html", o.html});
    report_check_writable("--json-out", o.json_out, json_others);
    report_check_writable("--html", o.html, inputs);
  }
  if (o.chat && o.workload.empty()) fail("--chat applies to --workload prompts");
  if (!o.chat_template_file.empty() && !o.chat) fail("--chat-template-file needs --chat");
  if (o.workload.empty() == o.data.empty())
    fail("give a workload: --workload FILE.jsonl (your requests) or --data FILE (a shared-prefix workload cut from text)");
  const std::vector<std::string> budgets = split_csv(o.kv_mem, "--kv-mem");
  std::vector<size_t> kv_mems;
  for (const auto& b : budgets) {
    try {
      kv_mems.push_back(parse_bytes(b));
    } catch (const Error& e) {
      fail("--kv-mem: {}", e.what());
    }
  }
  // Every format name is checked (and the model loaded once) before any run.
  std::vector<BenchRequest> reqs;
  std::vector<size_t> page_bytes;  // per format
  std::vector<double> bytes_per_token;  // per format: KvCache::bytes_per_token()
  std::vector<bool> shareable;     // per format: KvCache::prefix_shareable()
  std::vector<size_t> tail_max;    // per format: KvCache::max_tail_bytes() (f32, outside --kv-mem)
  std::string model_name;
  int ctx = 0;
  {
    EngineOptions po = engine_options(o, formats.front(), 0, 0, 0);
    po.kv_tokens = size_t(std::max(o.kv.page_tokens, 1));  // one page: the budget is checked per format below
    Engine probe(po);
    for (const std::string& f : formats) {  // names and codec shapes checked now, not mid-run
      const KvSetup kv = kv_flags_resolve(o.kv, probe.model(), f);
      kv_flags_warn_unused(o.kv, kv, probe.model());
      KvCacheConfig kc = probe.model().kv_cache_config(kv.policy, 64, o.kv.page_tokens);
      kv.apply(kc);
      KvCache check(kc);
      page_bytes.push_back(kv_cache_page_bytes(kc));
      bytes_per_token.push_back(check.bytes_per_token());
      shareable.push_back(check.prefix_shareable());
      tail_max.push_back(check.max_tail_bytes());
    }
    ctx = probe.ctx();
    engine_warn_ctx_capped(o.ctx, probe.model().config().n_ctx_train);
    model_name = probe.model().config().name;
    if (!o.workload.empty()) {
      const ChatTemplate tpl = o.chat ? chat_template_detect(probe.model().file(), read_chat_template_file(o.chat_template_file))
                                      : ChatTemplate{};
      if (o.chat && !tpl.known()) fail("--chat: the model has no chat template kvq knows ({})", chat_supported_families());
      reqs = load_workload(o, probe.tokenizer(), tpl);
      if (o.requests > 0) {
        std::vector<BenchRequest> all;
        for (int i = 0; i < o.requests; ++i) all.push_back(reqs[size_t(i) % reqs.size()]);
        reqs = std::move(all);
      }
    } else {
      reqs = shared_prefix_workload(o, probe.tokenizer(), o.requests > 0 ? o.requests : 4 * o.prefixes);
    }
  }
  size_t longest = 0, n_requests = 0;
  for (size_t i = 0; i < reqs.size(); ++i) {
    if (reqs[i].last_prompt() + 1 > size_t(ctx)) {
      if (reqs[i].turns() > 1)
        fail("session {}: its last turn's prompt reaches {} tokens: no room to generate in the context of {} tokens "
             "(fewer --turns, shorter --prefix-tokens / --max-tokens, or -c/--ctx-size)",
             i + 1, reqs[i].last_prompt(), ctx);
      fail("request {} has a {}-token prompt: no room to generate in the context of {} tokens (-c/--ctx-size)", i + 1,
           reqs[i].prompt.size(), ctx);
    }
    longest = std::max(longest, std::min(reqs[i].longest(), size_t(ctx)));
    n_requests += size_t(reqs[i].turns());
  }
  long prompt_total = 0;  // first turns
  for (const auto& r : reqs) prompt_total += long(r.prompt.size());

  std::vector<RunResult> runs;
  for (size_t bi = 0; bi < kv_mems.size(); ++bi)
  for (size_t f = 0; f < formats.size(); ++f) {
    const std::string& fmt = formats[f];
    const size_t kv_mem = kv_mems[bi];
    bool fits = true;
    for (const BenchLoad& load : loads) {
      // The pool's page size as PagePool rounds it: a budget below one page holds no token.
      const size_t pb = (page_bytes[f] + 63) / 64 * 64;
      // A format with a full-precision window keeps it in f32 beside the pool, per running sequence:
      // the budget holds it for as many sequences as the load can run at once, the pool the rest.
      const size_t seqs = size_t(load.rate > 0 ? o.max_running : std::min(load.clients, o.max_running));
      const size_t reserve = tail_max[f] * seqs;
      const size_t pool_mem = kv_mem > reserve ? kv_mem - reserve : 0;
      for (const auto& [target, offload_bytes] : variants) {
        std::unique_ptr<Engine> eng;
        if (pool_mem >= pb)  // fresh: cold prefix cache (and an empty tier)
          eng = std::make_unique<Engine>(engine_options(o, fmt, pool_mem, target, offload_bytes));
        const size_t cap = eng ? eng->kv_tokens_capacity() : 0;
        if (cap < longest) {
          RunResult rr;
          rr.format = fmt;
          rr.budget = budgets[bi];
          rr.kv_mem = kv_mem;
          rr.load = load;
          rr.requests = int(n_requests);
          rr.kv_tokens = cap;
          rr.kv_bytes_per_token = bytes_per_token[f];
          rr.fits = false;
          rr.tpot_target_ms = target;  // the first: a budget that does not fit fails them all
          rr.offload_bytes = offload_bytes;
          rr.prefix_cache = shareable[f];
          rr.tail_max = tail_max[f];
          rr.window_reserve = reserve;
          std::fprintf(stderr, "[bench] %s: --kv-mem %s holds %zu tokens%s, the longest request needs %zu: not run\n",
                       fmt.c_str(), budgets[bi].c_str(), rr.kv_tokens,
                       reserve ? fmt::format(" after {:.1f} MiB of f32 windows for {} sequences", double(reserve) / 1048576.0,
                                             seqs).c_str()
                               : "",
                       longest);
          runs.push_back(rr);
          fits = reserve > 0;  // without windows, the same at every load
          break;               // and at every target and tier size
        }
        std::fprintf(stderr, "[bench] %s, %s, %s%s%s, %zu requests ...\n", fmt.c_str(), budgets[bi].c_str(),
                     load.str().c_str(), target > 0 ? fmt::format(", --tpot-target-ms {:g}", target).c_str() : "",
                     offload_bytes > 0 ? fmt::format(", offload tier {}", offload_name(offload_bytes)).c_str() : "",
                     n_requests);
        runs.push_back(run_one(*eng, fmt, load, reqs, o.seed));
        runs.back().tpot_target_ms = target;
        runs.back().offload_bytes = offload_bytes;
        runs.back().tail_max = tail_max[f];
        runs.back().window_reserve = reserve;
        runs.back().prefix_cache = shareable[f];
        runs.back().budget = budgets[bi];
        runs.back().kv_mem = kv_mem;
      }
      if (!fits) break;
    }
  }
  bool any = false;
  for (const auto& r : runs) any = any || (r.fits && r.ok > 0);

  nlohmann::json j;
  j["model"] = model_name;
  j["model_file"] = o.model;
  j["cpu"] = cpu_level_name(cpu_level());  // the kernels' SIMD level: speed differs by level
  j["kv_scales"] = o.kv.scales_file.empty() ? nlohmann::json() : nlohmann::json(o.kv.scales_file);  // as eval's
  j["kv_mem_bytes"] = kv_mems;
  j["kv_offload_bytes"] = offloads;  // each run has its own (0: no offload tier)
  j["kv_offload_direct"] = o.kv_offload_direct;
  j["ctx"] = ctx;
  nlohmann::json w;
  if (!o.workload.empty()) {
    w["kind"] = "jsonl";
    w["file"] = o.workload;
  } else {
    w["kind"] = "shared_prefix";
    w["data"] = o.data;
    w["prefixes"] = o.prefixes;
    w["prefix_tokens"] = o.prefix_tokens;
    w["question_tokens"] = o.question_tokens;
    w["turns"] = o.turns;
  }
  w["sessions"] = reqs.size();
  w["requests"] = n_requests;
  w["first_prompt_tokens_mean"] = double(prompt_total) / double(reqs.size());
  w["sampling"] = "greedy, end-of-generation ignored";
  j["workload"] = w;
  // The engine's scheduling settings: what TTFT and TPOT depend on besides the format.
  j["scheduler"] = {{"max_batch", o.max_batch},
                    {"max_running", o.max_running},
                    {"oldest_prefill_tokens", o.oldest_prefill_tokens > 0 ? o.oldest_prefill_tokens : std::max(1, o.max_batch / 4)},
                    {"prefill_attention_cost", o.prefill_attention_cost},
                    {"tpot_target_ms", targets},  // each run has its own (its tpot_target_ms)
                    {"threads", resolve_threads(o.threads)}};
  j["runs"] = nlohmann::json::array();
  for (const auto& r : runs) {
    nlohmann::json e{{"format", r.format},
                     {"tpot_target_ms", r.tpot_target_ms},
                     {"kv_offload_bytes", r.offload_bytes},
                     {"kv_mem_bytes", r.kv_mem},
                     {"concurrency", r.load.clients > 0 ? nlohmann::json(r.load.clients) : nlohmann::json(nullptr)},
                     {"rate", r.load.rate > 0 ? nlohmann::json(r.load.rate) : nlohmann::json(nullptr)},
                     {"fits", r.fits},
                     {"prefix_cache", r.prefix_cache},
                     {"kv_tokens", r.kv_tokens},
                     {"kv_bytes_per_token", r.kv_bytes_per_token},
                     // f32 tail per running sequence at most (windows, unfilled groups), and what of
                     // kv_mem_bytes is reserved for them (the pool gets the rest)
                     {"tail_bytes_per_sequence_max", r.tail_max},
                     {"window_reserve_bytes", r.window_reserve},
                     {"requests", r.requests}};
    if (r.fits) {
      e["ok"] = r.ok;
      e["errors"] = r.errors;
      if (!r.first_error.empty()) e["first_error"] = r.first_error;
      e["wall_s"] = r.wall_s;
      e["prompt_tokens"] = r.prompt_tokens;
      e["completion_tokens"] = r.completion_tokens;
      e["throughput_tok_s"] = r.throughput;
      const std::pair<const char*, double> latencies[] = {
          {"ttft_p50_s", r.ttft_p50},   {"ttft_p95_s", r.ttft_p95}, {"tpot_p50_s", r.tpot_p50},
          {"tpot_p95_s", r.tpot_p95},   {"ttft_mean_s", r.ttft_mean}, {"ttft_p99_s", r.ttft_p99},
          {"tpot_mean_s", r.tpot_mean}, {"tpot_p99_s", r.tpot_p99}, {"e2e_mean_s", r.e2e_mean},
          {"e2e_p50_s", r.e2e_p50},     {"e2e_p95_s", r.e2e_p95},   {"e2e_p99_s", r.e2e_p99}};
      for (const auto& [name, v] : latencies) e[name] = num_or_null(v);
      e["prefix_hit_rate"] = r.hit_rate;
      e["preemptions"] = r.preemptions;
      if (o.draft_max > 0) {
        e["draft_tokens"] = r.drafted;
        e["draft_tokens_kept"] = r.kept;
      }
      if (r.offload) {
        // Of the prompt tokens looked up, those read back from the tier (part of prefix_hit_rate).
        e["offload_hit_rate"] = r.offload_hit_rate;
        e["offload_loaded_pages"] = r.offload_loaded;
        e["offload_stored_pages"] = r.offload_stored;
        e["offload_read_s"] = r.offload_read_s;
        e["offload_write_s"] = r.offload_write_s;
      }
    }
    j["runs"].push_back(e);
  }
  if (!o.json_out.empty()) report_write("--json-out", o.json_out, j.dump(2) + "\n");
  if (!o.html.empty()) report_write("--html", o.html, report_bench_html(j));
  if (o.json) {
    std::printf("%s\n", j.dump(2).c_str());
  } else {
    std::printf("model %s, KV budget %s, context %d\n", model_name.c_str(), o.kv_mem.c_str(), ctx);
    if (o.workload.empty() && o.turns > 1)
      std::printf("workload: %d prefixes x %d tokens, %zu conversations of %d turns (%d-token questions; each turn "
                  "resends the conversation so far), %zu requests",
                  o.prefixes, o.prefix_tokens, reqs.size(), o.turns, o.question_tokens, n_requests);
    else if (o.workload.empty())
      std::printf("workload: %d prefixes x %d tokens, %d-token questions, %zu requests (mean prompt %.0f tokens)",
                  o.prefixes, o.prefix_tokens, o.question_tokens, reqs.size(), double(prompt_total) / double(reqs.size()));
    else
      std::printf("workload: %s, %zu requests (mean prompt %.0f tokens)", o.workload.c_str(), reqs.size(),
                  double(prompt_total) / double(reqs.size()));
    std::printf(", greedy, end-of-generation ignored\n");
    std::printf("scheduler: --max-batch %d", o.max_batch);
    if (targets.size() > 1) std::printf(", --tpot-target-ms %s (runs marked @N ms; none unmarked)", o.tpot_target_ms.c_str());
    else if (targets.front() > 0) std::printf(", --tpot-target-ms %g", targets.front());
    if (any_tier)
      std::printf("\nKV offload tier: %s in %s%s (evicted prefix pages written there and read back; every run starts "
                  "empty%s)",
                  o.kv_offload_size.c_str(), o.kv_offload_dir.c_str(), o.kv_offload_direct ? ", O_DIRECT" : "",
                  offloads.size() > 1 ? "; runs marked +SIZE" : "");
    std::printf("\n\n");
    bool header = false;
    std::printf("%-14s %8s %9s %8s %12s %7s %9s %9s %9s %9s %9s %6s %7s %7s\n", "format", "KV mem", "KV tokens",
                "B/token", "load", "ok/req", "tok/s", "TTFT p50", "TTFT p95", "TPOT p50", "TPOT p95", "hit", "preempt",
                "wall s");
    for (const auto& r : runs) {
      if (!r.fits) {
        std::printf("%-14s %8s %9zu %8.0f %12s  (the longest request does not fit in the budget%s)\n", r.format.c_str(),
                    r.budget.c_str(), r.kv_tokens, r.kv_bytes_per_token,
                    r.window_reserve ? r.load.str().c_str() : "every load",
                    r.window_reserve ? ", after the f32 windows of the sequences this load runs at once" : "");
        continue;
      }
      std::printf("%-14s %8s %9zu %8.0f %12s %3d/%-3d %9.1f %9s %9s %9s %9s %6.2f %7llu %7.1f\n",
                  run_name(r.format, r.tpot_target_ms, r.offload_bytes).c_str(),
                  r.budget.c_str(), r.kv_tokens, r.kv_bytes_per_token, r.load.str().c_str(), r.ok, r.requests, r.throughput,
                  fmt_time(r.ttft_p50).c_str(), fmt_time(r.ttft_p95).c_str(), fmt_time(r.tpot_p50).c_str(),
                  fmt_time(r.tpot_p95).c_str(), r.hit_rate,
                  static_cast<unsigned long long>(r.preemptions), r.wall_s);
      if (r.errors) std::printf("  %d request(s) failed: %s\n", r.errors, r.first_error.c_str());
      if (o.draft_max > 0)
        std::printf("  speculative (--draft-max %d): %llu of %llu drafted tokens kept (%.1f%%)\n", o.draft_max,
                    static_cast<unsigned long long>(r.kept), static_cast<unsigned long long>(r.drafted),
                    r.drafted ? 100.0 * double(r.kept) / double(r.drafted) : 0.0);
    }
    header = false;
    for (const auto& r : runs) {
      if (!r.fits || !r.offload) continue;
      if (!header) std::printf("\nKV offload tier (of the hit rate, the prompt tokens read back from the tier):\n");
      header = true;
      std::printf("  %-14s %8s %12s  %.2f of the prompt tokens; %llu pages read (%.3f s), %llu written (%.3f s)\n",
                  run_name(r.format, r.tpot_target_ms, r.offload_bytes).c_str(), r.budget.c_str(), r.load.str().c_str(),
                  r.offload_hit_rate, static_cast<unsigned long long>(r.offload_loaded), r.offload_read_s,
                  static_cast<unsigned long long>(r.offload_stored), r.offload_write_s);
    }
    // Each format against the first one at the same load: what the budget buys.
    header = false;
    for (const auto& base : runs) {
      if (base.format != formats.front() || !base.fits || base.ok == 0) continue;
      for (const auto& r : runs) {
        if (r.format == base.format || !r.fits || r.ok == 0 || r.load.clients != base.load.clients ||
            r.load.rate != base.load.rate || r.kv_mem != base.kv_mem || r.tpot_target_ms != base.tpot_target_ms ||
            r.offload_bytes != base.offload_bytes)
          continue;
        if (!header)
          std::printf("\nagainst %s at the same budget and load%s%s:\n", base.format.c_str(),
                      targets.size() > 1 ? " and TPOT target" : "", offloads.size() > 1 ? " and offload tier" : "");
        header = true;
        std::string ttft = "-";
        if (r.ttft_p50 > 0 && base.ttft_p50 > 0)
          ttft = r.ttft_p50 <= base.ttft_p50 ? fmt::format("{:.2f}x lower", base.ttft_p50 / r.ttft_p50)
                                             : fmt::format("{:.2f}x higher", r.ttft_p50 / base.ttft_p50);
        std::printf("  %-14s %8s %12s  TTFT p50 %s, throughput %.2fx, prefix hit rate %.2f (%.2f)\n",
                    run_name(r.format, r.tpot_target_ms, r.offload_bytes).c_str(), r.budget.c_str(), r.load.str().c_str(), ttft.c_str(), base.throughput > 0 ? r.throughput / base.throughput : 0.0,
                    r.hit_rate, base.hit_rate);
      }
    }
    // Each target against the first one, same format, budget and load: what the target costs.
    header = false;
    for (const auto& base : runs) {
      if (targets.size() < 2 || base.tpot_target_ms != targets.front() || !base.fits || base.ok == 0) continue;
      for (const auto& r : runs) {
        if (r.tpot_target_ms == base.tpot_target_ms || r.format != base.format || !r.fits || r.ok == 0 ||
            r.load.clients != base.load.clients || r.load.rate != base.load.rate || r.kv_mem != base.kv_mem ||
            r.offload_bytes != base.offload_bytes)
          continue;
        if (!header)
          std::printf("\nagainst %s at the same format, budget and load:\n",
                      targets.front() > 0 ? fmt::format("--tpot-target-ms {:g}", targets.front()).c_str() : "no target");
        header = true;
        const auto ratio = [](double a, double b) { return a > 0 && b > 0 ? fmt::format("{:.2f}x", a / b) : std::string("-"); };
        std::printf("  %-14s %8s %12s  TPOT p50 %s, TTFT p50 %s, throughput %s\n", run_name(r.format, r.tpot_target_ms, r.offload_bytes).c_str(),
                    r.budget.c_str(), r.load.str().c_str(), ratio(r.tpot_p50, base.tpot_p50).c_str(),
                    ratio(r.ttft_p50, base.ttft_p50).c_str(), ratio(r.throughput, base.throughput).c_str());
      }
    }
    // Each tier size against the first (a list starting with 0: against no tier), same format,
    // budget, load and target: what the tier buys.
    header = false;
    for (const auto& base : runs) {
      if (offloads.size() < 2 || base.offload_bytes != offloads.front() || !base.fits || base.ok == 0) continue;
      for (const auto& r : runs) {
        if (r.offload_bytes == base.offload_bytes || r.format != base.format || !r.fits || r.ok == 0 ||
            r.load.clients != base.load.clients || r.load.rate != base.load.rate || r.kv_mem != base.kv_mem ||
            r.tpot_target_ms != base.tpot_target_ms)
          continue;
        if (!header)
          std::printf("\nagainst %s at the same format, budget, load and target:\n",
                      offloads.front() > 0 ? fmt::format("an offload tier of {}", offload_names.front()).c_str()
                                           : "no offload tier");
        header = true;
        const auto lower = [](double a, double b) {
          if (!(a > 0 && b > 0)) return std::string("-");
          return a <= b ? fmt::format("{:.2f}x lower", b / a) : fmt::format("{:.2f}x higher", a / b);
        };
        std::printf("  %-14s %8s %12s  TTFT p50 %s, throughput %s, prefix hit rate %.2f (%.2f)\n",
                    run_name(r.format, r.tpot_target_ms, r.offload_bytes).c_str(), r.budget.c_str(),
                    r.load.str().c_str(), lower(r.ttft_p50, base.ttft_p50).c_str(),
                    base.throughput > 0 ? fmt::format("{:.2f}x", r.throughput / base.throughput).c_str() : "-",
                    r.hit_rate, base.hit_rate);
      }
    }
    bool noted = false;
    for (size_t f = 0; f < formats.size(); ++f) {
      if (tail_max[f] > 0) {
        if (!noted) std::printf("\n");
        noted = true;
        std::printf("%s: each running sequence holds up to %.1f KiB of f32 keys and values beside the pages (its "
                    "full-precision window and unfilled token group); --kv-mem reserves that for as many sequences "
                    "as each load runs at once (--max-running with --rate), and its pool gets the rest\n",
                    formats[f].c_str(), double(tail_max[f]) / 1024.0);
      }
      if (shareable[f]) continue;
      if (!noted) std::printf("\n");
      noted = true;
      std::printf("%s: no prefix sharing: its newest tokens stay in full precision outside the pages (residual window), "
                  "so a cached prefix would not reproduce the request served alone; --kv-residual-tokens 0 shares "
                  "prefixes\n",
                  formats[f].c_str());
    }
  }
  if (!any) fail("no format ran a request within --kv-mem {}: raise the budget or shorten the workload", o.kv_mem);
  return 0;
}

}  // namespace kvq
