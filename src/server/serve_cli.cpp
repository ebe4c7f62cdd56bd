#include "server/serve_cli.h"

#include <CLI/CLI.hpp>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <thread>

#include "core/error.h"
#include "core/strings.h"
#include "model/chat.h"
#include "server/server.h"
#include "tools/files.h"
#include "tools/kv_flags.h"

namespace kvq {

void serve_add_cli(CLI::App& app, ServeOptions& o) {
  app.add_option("-m,--model", o.engine.model_path, "GGUF model file")->required();
  app.add_option("--host", o.host, "address to listen on")->capture_default_str();
  app.add_option("--port", o.port, "port (0: any free port)")->capture_default_str();
  app.add_option("--model-name", o.model_name, "model id reported by the API (default: the file's stem)");
  app.add_option("--chat-template-file", o.chat_template_file,
                 "a chat template (Jinja, as a GGUF carries it) for /v1/chat/completions instead of the model's, for a "
                 "file whose own is missing or wrong (llama.cpp's flag; vLLM's --chat-template); kvq recognizes the "
                 "families it renders by their markers")
      ->type_name("FILE");
  app.add_option("--chat-template-kwargs", o.chat_template_kwargs,
                 "a JSON object of chat template settings, as llama.cpp's flag: kvq reads enable_thinking (false: a reasoning "
                 "template's <think> block, Qwen3's, closed in the prompt, so the reply is the answer alone)")
      ->type_name("JSON");
  app.add_option("--reasoning-budget", o.reasoning_budget, kReasoningBudgetHelp)
      ->check(CLI::Range(-1, 1 << 30))
      ->capture_default_str();
  app.add_option("--reasoning-budget-message", o.reasoning_budget_message, kReasoningBudgetMessageHelp)->type_name("TEXT");
  app.add_option("--kv-mem", o.kv_mem, "KV page pool budget in bytes (e.g. 2GiB, 512MiB)");
  app.add_option("--kv-tokens", o.engine.kv_tokens, "KV page pool size: room for one prompt of this many tokens, prefilled in --max-batch steps (instead of --kv-mem)");
  app.add_option("--kv-offload-dir", o.engine.kv_offload_dir, kKvOffloadDirHelp);
  app.add_option("--kv-offload-size", o.kv_offload_size, kKvOffloadSizeHelp);
  app.add_flag("--kv-offload-direct", o.engine.kv_offload_direct, kKvOffloadDirectHelp);
  app.add_flag("--kv-offload-persist", o.engine.kv_offload_persist, kKvOffloadPersistHelp);
  app.add_option("-t,--threads", o.engine.threads, "threads (default: all hardware threads)")->check(CLI::Range(1, 1024));
  app.add_option("--max-batch", o.engine.max_batch, "tokens per step (decode + prefill chunks)")->capture_default_str();
  app.add_option("--max-running", o.engine.max_running, "sequences running at once")->capture_default_str();
  app.add_option("--scheduling-policy", o.scheduling_policy,
                 "fcfs (first come, first served) or priority (vLLM's: requests run in the order of their 'priority', "
                 "lower first, ties first come; a request that does not fit preempts running ones of a lower priority)")
      ->check(CLI::IsMember({"fcfs", "priority"}))
      ->capture_default_str();
  app.add_option("--http-threads", o.http_threads,
                 "connections served at once (each open connection holds one while its request waits or streams; "
                 "/health and /metrics need a free one)")
      ->check(CLI::Range(4, 65536))
      ->capture_default_str();
  app.add_option("--prefill-attention-cost", o.engine.prefill_attention_cost, kPrefillAttentionCostHelp)
      ->check(CLI::Range(0.0, 1e6))
      ->capture_default_str();
  app.add_option("--oldest-prefill-tokens", o.engine.oldest_prefill_tokens, kOldestPrefillTokensHelp)
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--tpot-target-ms", o.engine.tpot_target_ms, kTpotTargetHelp)->check(CLI::Range(0.0, 1e9));
  app.add_option("-c,--ctx-size", o.engine.ctx, "context per request (default: the model's)");
  app.add_option("--draft-max", o.engine.draft_max,
                 "speculative decoding by prompt lookup: up to N tokens drafted per step for each decoding request from "
                 "where its last tokens occurred before (its prompt, or what it generated), verified in the same step; "
                 "each token is sampled (and masked by a request's grammar) as decoding samples it (0: off)")
      ->check(CLI::Range(0, 64))
      ->capture_default_str();
  app.add_option("--draft-ngram-min", o.engine.draft_ngram_min, "prompt lookup: the fewest last tokens that must match")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  app.add_option("--draft-ngram-max", o.engine.draft_ngram_max, "prompt lookup: the most last tokens matched (the longest match wins)")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  app.add_option("--api-key", o.api_key,
                 "key clients must send (Authorization: Bearer KEY) on every route but /health and /metrics "
                 "(default: $KVQ_API_KEY; none: no key asked)");
  app.add_option("--allowed-origins", o.allowed_origins,
                 "origins browsers may call from, comma-separated (\"*\": any; \"\": no CORS headers)")
      ->capture_default_str();
  kv_flags_add(app, o.engine.kv);
}

size_t parse_bytes(const std::string& s) {
  size_t pos = 0;
  double v = 0;
  // decimal only: std::stod would also read hexadecimal ("0x10MiB") and "inf" / "nan"
  const bool decimal = !s.empty() && s.find_first_not_of("0123456789.eE+- KMGiBb") == std::string::npos &&
                       s.find("0x") == std::string::npos && s.find("0X") == std::string::npos;
  try {
    if (!decimal) throw std::invalid_argument(s);
    v = std::stod(s, &pos);
  } catch (const std::exception&) {
    fail("'{}' is not a size (examples: 2GiB, 512MiB, 1000000)", s);
  }
  std::string unit = s.substr(pos);
  while (!unit.empty() && unit.front() == ' ') unit.erase(unit.begin());
  double mul = 1;
  if (unit.empty() || unit == "B") mul = 1;
  else if (unit == "K" || unit == "KiB") mul = 1024.0;
  else if (unit == "M" || unit == "MiB") mul = 1024.0 * 1024.0;
  else if (unit == "G" || unit == "GiB") mul = 1024.0 * 1024.0 * 1024.0;
  else if (unit == "KB") mul = 1e3;
  else if (unit == "MB") mul = 1e6;
  else if (unit == "GB") mul = 1e9;
  else fail("'{}': unknown size unit '{}' (use B, KiB, MiB, GiB, KB, MB, GB)", s, unit);
  if (!(v > 0)) fail("'{}' is not a positive size", s);
  if (v * mul > 1e15) fail("'{}' is larger than 1e15 bytes (~909 TiB), the largest size kvq takes", s);
  return size_t(v * mul);
}

// The handler only records the signal (nothing else is async-signal-safe); a watcher thread
// shuts the server down. A second signal during the drain exits at once.
static volatile std::sig_atomic_t g_signalled = 0;
static void on_signal(int) {
  if (g_signalled) std::_Exit(1);
  g_signalled = 1;
}

int serve_command(ServeOptions o) {
  if (!o.kv_mem.empty() && o.engine.kv_tokens > 0) fail("give either --kv-mem or --kv-tokens, not both");
  if (o.engine.draft_ngram_min > o.engine.draft_ngram_max)
    fail("--draft-ngram-min {} exceeds --draft-ngram-max {}", o.engine.draft_ngram_min, o.engine.draft_ngram_max);
  if (!o.kv_mem.empty()) {
    try {
      o.engine.kv_mem = parse_bytes(o.kv_mem);
    } catch (const Error& e) {
      fail("--kv-mem: {}", e.what());
    }
  }
  if (!o.kv_offload_size.empty()) {
    try {
      o.engine.kv_offload_bytes = parse_bytes(o.kv_offload_size);
    } catch (const Error& e) {
      fail("--kv-offload-size: {}", e.what());
    }
  }
  const std::optional<std::string> chat_template = read_chat_template_file(o.chat_template_file);  // (before the model loads)
  const bool enable_thinking = chat_template_kwargs_flag(o.chat_template_kwargs);
  o.engine.priority_scheduling = o.scheduling_policy == "priority";
  Engine engine(o.engine);
  kv_flags_warn_unused(o.engine.kv, engine.kv_setup(), engine.model());
  engine_warn_ctx_capped(o.engine.ctx, engine.model().config().n_ctx_train);
  ServerOptions so;
  so.host = o.host;
  so.port = o.port;
  so.model_name = o.model_name.empty() ? std::filesystem::path(o.engine.model_path).stem().string() : o.model_name;
  so.api_key = o.api_key;
  so.chat_template = chat_template.value_or("");
  so.enable_thinking = enable_thinking;
  so.reasoning_budget = o.reasoning_budget;
  so.reasoning_budget_message = o.reasoning_budget_message;
  so.http_threads = o.http_threads;
  so.allowed_origins.clear();
  for (const std::string& one : split_list(o.allowed_origins))
    if (!one.empty()) so.allowed_origins.push_back(one);
  if (so.api_key.empty())
    if (const char* k = std::getenv("KVQ_API_KEY")) so.api_key = k;
  Server server(engine, so);
  const int port = server.bind();
  const std::string target =
      o.engine.tpot_target_ms > 0 ? fmt::format(", {:g} ms per output token targeted", o.engine.tpot_target_ms) : "";
  const EngineMetrics em = engine.metrics();
  const std::string offload =
      em.offload  // a tier was made (none where prefixes are private)
          ? fmt::format(", offload tier {} pages ({:.1f} MiB) in {}{}", em.offload_stats.capacity_pages,
                        double(em.offload_stats.capacity_pages) * double(em.offload_stats.page_bytes) / 1048576.0,
                        o.engine.kv_offload_dir,
                        em.offload_stats.persistent
                            ? fmt::format(", kept across runs: {} pages from the last run", em.offload_stats.pages_at_start)
                            : "")
          : "";
  std::fprintf(stderr, "[kvq] serving %s on http://%s:%d (context %d, KV pool %zu tokens%s, steps of up to %d tokens%s%s)\n",
               so.model_name.c_str(), o.host.c_str(), port, engine.ctx(), engine.kv_tokens_capacity(), offload.c_str(),
               o.engine.max_batch, target.c_str(), so.api_key.empty() ? "" : ", API key required");
  std::signal(SIGINT, on_signal);
  std::signal(SIGTERM, on_signal);
  std::atomic<bool> listening{true};
  std::thread watcher([&] {
    while (listening.load() && !g_signalled) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    if (g_signalled) {
      std::fprintf(stderr, "[kvq] shutting down: ending the requests in flight\n");
      server.shutdown();
    }
  });
  server.listen();
  listening = false;
  watcher.join();
  return 0;
}

}  // namespace kvq
