// kvq: command-line entry point. Argument parsing and dispatch only.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "core/error.h"
#include "tools/bench.h"
#include "tools/calibrate.h"
#include "tools/eval.h"
#include "tools/formats.h"
#include "tools/plan.h"
#include "tools/run.h"
#include "server/serve_cli.h"
#include "weights/weights.h"

int main(int argc, char** argv) {
  // llama.cpp's multi-letter short flags, which CLI11 cannot declare, mapped to their long names.
  std::vector<std::string> args(argv, argv + argc);
  for (auto& a : args) {
    if (a == "-ctk") a = "--cache-type-k";
    else if (a == "-ctv") a = "--cache-type-v";
  }
  std::vector<char*> argp;
  for (auto& a : args) argp.push_back(a.data());
  argc = int(argp.size());
  argv = argp.data();
  CLI::App app{"kvq: LLM inference with a quantized KV cache"};
  app.require_subcommand(1);
  app.set_help_all_flag("--help-all", "help for every subcommand");

  kvq::RunOptions run_opts;
  auto* run = app.add_subcommand("run", "generate text from a GGUF model");
  kvq::run_add_cli(*run, run_opts);

  kvq::EvalOptions eval_opts;
  auto* eval = app.add_subcommand("eval", "quality of KV formats vs context length: perplexity/KLD, needle, your eval set");
  kvq::eval_add_cli(*eval, eval_opts);

  kvq::CalibrateOptions cal_opts;
  auto* calibrate = app.add_subcommand("calibrate", "fit K/V scales, codebooks, channel means and channel RMS from sample text (for --kv-scales)");
  kvq::calibrate_add_cli(*calibrate, cal_opts);

  kvq::FormatsOptions fmt_opts;
  auto* formats = app.add_subcommand("formats", "list the KV formats (bits per element, description); --distortion measures them");
  formats->add_flag("--distortion", fmt_opts.distortion, "measure MSE and inner-product error on random unit vectors");
  formats->add_option("--dim", fmt_opts.dim, "head dimension")->capture_default_str();
  formats->add_option("--trials", fmt_opts.trials, "random vectors per codec")->capture_default_str();
  formats->add_option("--ctx", fmt_opts.ctx, "context at which residual windows are amortized")->capture_default_str();
  formats->add_option("--page-tokens", fmt_opts.block_tokens, "tokens per KV page")->capture_default_str();
  formats->add_option("--seed", fmt_opts.seed, "seed of the random vectors")->capture_default_str();
  formats->add_flag("--json", fmt_opts.json, "JSON output");

  kvq::PlanOptions plan_opts;
  auto* plan = app.add_subcommand("plan", "memory plan: weights vs KV vs activations, capacity per KV format");
  kvq::plan_add_cli(*plan, plan_opts);

  kvq::BenchOptions bench_opts;
  auto* bench = app.add_subcommand("bench", "serving speed per KV format under one KV memory budget: TTFT, TPOT, throughput, prefix hit rate");
  kvq::bench_add_cli(*bench, bench_opts);

  kvq::ServeOptions serve_opts;
  auto* serve = app.add_subcommand("serve", "OpenAI-compatible HTTP server: continuous batching, paged prefix-cached KV, /metrics");
  kvq::serve_add_cli(*serve, serve_opts);

  // Model-running subcommands: the matmul kernels' batch invariance (weights/weights.h).
  bool batch_invariant = false;
  for (auto* sc : {run, eval, calibrate, bench, serve})
    sc->add_flag("--batch-invariant", batch_invariant,
                 "every matmul runs the one-token kernels and decode attention keeps each KV head on one thread, "
                 "so a token's numbers do not depend on what it is batched with (AVX-512: prefill ~2.5x slower)");

  // An empty value is an error for numeric options and for the items of comma-separated lists:
  // CLI11 would read `-n ''` as 0 and drop the empty item of `--ctx 64,,128`. (Text options keep
  // empty values: `-p ''` starts from BOS, `--allowed-origins ''` allows none.)
  const CLI::Validator non_empty(
      [](std::string& v) { return v.empty() ? std::string("an empty value (give one)") : std::string(); }, "", "non-empty");
  for (auto* sc : app.get_subcommands({}))
    for (CLI::Option* opt : sc->get_options()) {
      if (opt->get_type_size() == 0) continue;  // flags take no value
      const std::string t = opt->get_type_name();
      const bool numeric = t.find("INT") != std::string::npos || t.find("FLOAT") != std::string::npos ||
                           t.find("NUMBER") != std::string::npos;
      if (numeric || opt->get_delimiter() != '\0') opt->check(non_empty);
    }

  // The subcommand named by the first word, if any.
  CLI::App* sc = nullptr;
  for (auto* s : app.get_subcommands({}))
    if (argc > 1 && s->get_name() == argv[1]) sc = s;
  // A first word that is neither a flag nor a subcommand: say so (CLI11 would only ask for one).
  if (argc > 1 && argv[1][0] != '-' && !sc) {
    std::string names;
    for (const auto* s : app.get_subcommands({})) names += (names.empty() ? "" : ", ") + s->get_name();
    std::fprintf(stderr, "kvq: error: unknown subcommand '%s' (one of: %s)\n", argv[1], names.c_str());
    return 1;
  }
  // CLI11 drops the empty items of a comma-separated list (`--ctx 64,,128` would be 64,128):
  // they are errors, looked for in the raw arguments of the list options of the subcommand given.
  for (int i = 2; sc && i < argc; ++i) {
    std::string a = argv[i], value;
    if (a.size() < 2 || a[0] != '-') continue;
    bool inline_value = false;
    if (const size_t eq = a.find('='); eq != std::string::npos && a.rfind("--", 0) == 0) {
      value = a.substr(eq + 1);
      a.resize(eq);
      inline_value = true;
    }
    const CLI::Option* opt = sc->get_option_no_throw(a);
    if (!opt || opt->get_delimiter() == '\0' || opt->get_type_size() == 0) continue;
    if (!inline_value) {
      if (i + 1 >= argc) continue;  // CLI11 reports the missing value
      value = argv[++i];
    }
    const char d = opt->get_delimiter();
    if (!value.empty() && (value.front() == d || value.back() == d || value.find(std::string(2, d)) != std::string::npos)) {
      std::fprintf(stderr, "kvq: error: %s: '%s' has an empty item\n", a.c_str(), value.c_str());
      return 2;
    }
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (batch_invariant) kvq::matmul_set_batch_invariant(true);
  try {
    if (*run) return kvq::run_command(run_opts);
    if (*eval) return kvq::eval_command(eval_opts);
    if (*calibrate) return kvq::calibrate_command(cal_opts);
    if (*formats) return kvq::formats_command(fmt_opts, stdout);
    if (*plan) return kvq::plan_command(plan_opts, stdout, stderr);
    if (*bench) return kvq::bench_command(bench_opts);
    if (*serve) return kvq::serve_command(serve_opts);
  } catch (const kvq::Error& e) {
    std::fprintf(stderr, "kvq: error: %s\n", e.what());
    return 1;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "kvq: error: out of memory\n");
    return 1;
  } catch (const std::exception& e) {  // anything a library below throws: an error line, not an abort
    std::fprintf(stderr, "kvq: error: %s\n", e.what());
    return 1;
  }
  return 0;
}
