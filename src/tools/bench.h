// kvq bench: serving speed per KV format under one fixed KV memory budget, on a workload: TTFT,
// TPOT, throughput, prefix-cache hit rate and preemptions at each concurrency, measured on the
// serving engine itself (continuous batching, paged prefix-cached KV; no HTTP in the loop).
//
// Workload: the user's JSONL file (--workload: one request per line, {"prompt": "...",
// "max_tokens": n} with max_tokens optional), or a shared-prefix workload cut from a text file
// (--data): --prefixes distinct documents of --prefix-tokens tokens, each request one of them
// (in turn) followed by --question-tokens tokens of its own, the shape of document QA and
// multi-turn chat, where a cache that holds more prefixes recomputes fewer. With --turns T each
// request is a conversation of T turns: turn k + 1 resends turn k's prompt and answer plus a new
// question, as a chat client does.
// Each (format, load) runs on a fresh engine (cold prefix cache). A load is --concurrency N
// closed-loop clients (each sends its next request when its previous one ends) or --rate R
// requests per second arriving as a seeded Poisson process (open loop, as vLLM's serving
// benchmark sends them).
#pragma once
#include <string>
#include <vector>

#include "tools/kv_flags.h"

namespace CLI { class App; }

namespace kvq {

struct BenchOptions {
  std::string model;
  std::string kv_list = "f16,int8,q4_0";  // --kv: formats to compare
  std::string kv_mem = "256MiB";          // --kv-mem: the one budget every format gets
  std::string concurrency;                // --concurrency: comma-separated clients (closed loop)
  std::string rate;                       // --rate: comma-separated requests/s (open loop, Poisson)
  unsigned seed = 1;                      // --seed: of the arrivals
  std::string workload;                   // --workload FILE.jsonl
  std::string data;                       // --data FILE: text for the shared-prefix workload
  int prefixes = 4;
  int prefix_tokens = 1024;
  int question_tokens = 32;
  int turns = 1;                          // --turns: turns per conversation (shared-prefix workload)
  int requests = 0;                       // 0: JSONL lines / 4 per prefix
  int max_tokens = 32;                    // per request unless the JSONL line sets it
  int threads = 0;
  int ctx = 0;
  int max_batch = 256;
  int draft_max = 0;  // --draft-max: EngineOptions::draft_max (speculative decoding by prompt lookup)
  int oldest_prefill_tokens = -1;  // EngineOptions::oldest_prefill_tokens
  double prefill_attention_cost = 2.0;  // EngineOptions::prefill_attention_cost
  std::string tpot_target_ms = "0";      // --tpot-target-ms: comma-separated EngineOptions::tpot_target_ms, a run each
  int max_running = 64;
  std::string kv_offload_dir;             // --kv-offload-dir (EngineOptions::kv_offload_dir)
  std::string kv_offload_size;            // --kv-offload-size, e.g. 4GiB (every run gets a fresh tier)
  bool kv_offload_direct = false;         // --kv-offload-direct
  bool chat = false;                      // --chat: JSONL prompts as a user turn of the model's chat template
  std::string chat_template_file;         // --chat-template-file: a template instead of the model's
  bool json = false;
  std::string json_out;
  std::string html;                       // --html: self-contained report with plots
  KvFlags kv;
};

void bench_add_cli(CLI::App& app, BenchOptions& o);
int bench_command(const BenchOptions& o);

// Percentile p in [0, 1] of v by linear interpolation between order statistics (v is sorted in
// place); NaN for an empty v.
double bench_percentile(std::vector<double>& v, double p);

}  // namespace kvq
