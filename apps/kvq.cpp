// kvq: command-line entry point. Argument parsing and dispatch only.
#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "core/error.h"
#include "tools/run.h"

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

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    if (*run) return kvq::run_command(run_opts);
  } catch (const kvq::Error& e) {
    std::fprintf(stderr, "kvq: error: %s\n", e.what());
    return 1;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr, "kvq: error: out of memory\n");
    return 1;
  }
  return 0;
}
