// kvq eval: what each KV format costs in quality, as a function of context length, on the
// user's model and text: perplexity / KL divergence against the f16-cache run (ppl), needle in a
// haystack retrieval (needle), the user's own JSONL eval set (own).
#pragma once
#include <string>
#include <vector>

#include "tools/kv_flags.h"

namespace CLI { class App; }

namespace kvq {

struct EvalOptions {
  std::string model;
  std::vector<std::string> formats;   // --kv LIST (comma-separated or repeated)
  std::vector<std::string> ctx;       // --ctx LIST (4096, 4K, 32k)
  std::vector<std::string> tasks{"ppl"};
  std::string data;                   // text for ppl (and the default haystack)
  std::string haystack;               // needle haystack (default: --data)
  std::string own;                    // JSONL eval set for task own
  std::vector<int> depths{0, 25, 50, 75, 100};  // needle depths in percent
  int needles = 1;                    // needle: trials per (context, depth) cell
  std::string needle_set_out;         // needle: write the trials as an own-task JSONL (exact tokens)
  int chunks = 1;                     // ppl: windows per context length
  int threads = 0;
  int max_tokens = 48;                // own: tokens generated per prompt
  bool chat = false;                  // own: wrap prompts in the chat template
  std::string chat_template_file;     // --chat-template-file: a template instead of the model's
  std::string chat_template_kwargs;  // --chat-template-kwargs: {"enable_thinking": false} (a reasoning template's switch)
  int reasoning_budget = -1;             // --reasoning-budget: own's replies' reasoning bounded (< 0: no bound)
  std::string reasoning_budget_message;  // --reasoning-budget-message
  bool json = false;
  std::string json_out;               // --json-out FILE (also writes JSON there)
  std::string html;                   // --html REPORT.html (self-contained, SVG plots)
  bool progress = true;
  bool f32_weights = false;  // dequantize the weights to f32 (reference precision, no 8-bit activations)
  // ppl: "dynamic" (each format as registered) or "static-prefill": the int8/fp8 formats use
  // fixed per-layer/head scales measured on the first half of each window (the context part)
  // and reused for the scored second half, as an engine that calibrates at prefill would.
  std::string scale_mode = "dynamic";
  // layers: for each budget, each layer's K and V format among --kv chosen to minimize the summed
  // squared attention-output error at that average bits per element (kvq eval prints it as
  // --kv-layer flags and runs it as one more format through ppl / needle / own).
  std::vector<double> budget_bits;
  KvFlags kv;                         // skip-layers, overrides, scales apply to every format
};

void eval_add_cli(CLI::App& app, EvalOptions& o);
int eval_command(const EvalOptions& o);

}  // namespace kvq
