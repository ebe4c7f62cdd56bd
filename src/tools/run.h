// kvq run: generate text from a GGUF model. stdout carries the generated text only (the prompt
// too with --echo), streamed as produced; stderr ends with speed and memory.
#pragma once
#include <string>

#include "model/sampler.h"
#include "tools/kv_flags.h"

namespace CLI { class App; }

namespace kvq {

struct RunOptions {
  std::string model;
  std::string prompt;
  bool prompt_set = false;
  std::string prompt_file;
  int n_predict = 256;
  int threads = 0;       // 0: all hardware threads
  int ctx = 0;           // 0: the model's training context
  bool chat = false;
  bool interactive = false;  // --chat -i: a conversation read from stdin, one user turn per line
  bool echo = false;
  bool json_object = false;  // --json: the output is one JSON object (model/json_constraint.h)
  std::string json_schema;   // --json-schema FILE: the output is a document of the schema (model/json_schema.h)
  std::string regex;         // --regex PATTERN: the output matches it whole (model/regex.h)
  std::string grammar;       // --grammar GBNF: the output is a text of the grammar (model/gbnf.h)
  std::string grammar_file;  // --grammar-file FILE: the same, read from FILE
  bool regex_given = false, grammar_given = false;  // --regex / --grammar given (an empty one too)
  std::string system;    // --system, with --chat
  std::string chat_template_file;  // --chat-template-file: a template instead of the model's
  std::string chat_template_kwargs;  // --chat-template-kwargs: {"enable_thinking": false} (a reasoning template's switch)
  std::string reasoning_effort;  // --reasoning-effort: harmony's (gpt-oss) low / medium / high
  int reasoning_budget = -1;             // --reasoning-budget: tokens of reasoning per reply (< 0: no bound)
  std::string reasoning_budget_message;  // --reasoning-budget-message
  std::string reasoning_format = "split";  // --reasoning-format: harmony replies split (answer on stdout) or raw
  bool reasoning_format_given = false;
  SamplerParams sampling;
  KvFlags kv;
  // Speculative decoding by prompt lookup (model/draft.h): up to draft_max drafted tokens per
  // step (0: off), from the latest earlier occurrence of the last draft_ngram_max .. _min tokens.
  int draft_max = 0;
  int draft_ngram_min = 2;
  int draft_ngram_max = 4;
};

void run_add_cli(CLI::App& app, RunOptions& o);
int run_command(const RunOptions& o);

}  // namespace kvq
