// JSON mode's cost (response_format json_object, model/json_constraint.h), or with --schema that of
// structured output (response_format json_schema, model/json_schema.h): time per output token
// with and without the token mask, on the same model, engine and number of tokens, measured in
// the same run, and the mask's own time per step (grammar_mask: JSON mode's grammar is that of
// {"type": "object"}).
//
//   json_mode MODEL.gguf [--tokens 64] [--reps 5] [--threads 2] [--schema FILE | --grammar GBNF_FILE | --tools FILE] [--batch 1]
//
// --tools FILE: function calling (server/tools.h): FILE is a chat request's "tools" (and
// "tool_choice", "parallel_tool_calls"); the prompt is a question for them with the tools'
// system text, and the grammar that of the reply (bench/weather.tools.json).
//
// Each repetition generates up to --tokens tokens constrained (greedy) from a prompt that asks
// for JSON, then the same number of tokens without it (end of generation ignored), and compares
// their decode time per token (first token excluded). The mask alone: grammar_mask over the whole
// vocabulary at every byte of the JSON text generated, median microseconds per
// call. bench/cats.schema.json is a schema for the prompt's question (bench/cats_pattern.schema.json
// with `pattern`s, bench/cats.gbnf a GBNF grammar of the same kind of answer). --batch N submits N copies
// of each request at once (sampled with temperature 1 and seeds 0..N-1, so that they differ) and
// compares the time from submission to the last token, per token generated, constrained vs plain:
// the masks of the N sequences share each step.
#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <string>
#include <vector>

#include "core/error.h"
#include "core/timer.h"
#include "engine/engine.h"
#include "model/chat.h"
#include "model/json_schema.h"
#include "server/tools.h"
#include "tools/files.h"
#include "tools/bench.h"

using namespace kvq;

static double median(std::vector<double> v) { return bench_percentile(v, 0.5); }

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: json_mode MODEL.gguf [--tokens 64] [--reps 5] [--threads 2] [--schema FILE | --grammar GBNF_FILE | "
                         "--tools FILE] [--batch 1]\n");
    return 2;
  }
  int tokens = 64, reps = 5, threads = 2, batch = 1;
  std::shared_ptr<const Grammar> grammar;
  std::string tools_prompt;  // --tools: the system turn's text
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--tokens") tokens = std::stoi(argv[i + 1]);
    else if (a == "--reps") reps = std::stoi(argv[i + 1]);
    else if (a == "--threads") threads = std::stoi(argv[i + 1]);
    else if (a == "--batch") batch = std::stoi(argv[i + 1]);
    else if (a == "--schema") grammar = Grammar::from_schema_text(read_text_file(argv[i + 1], "--schema"));
    else if (a == "--grammar") grammar = Grammar::from_gbnf(read_text_file(argv[i + 1], "--grammar"));
    else if (a == "--tools") {
      const ToolSpec spec = parse_tools(nlohmann::ordered_json::parse(read_text_file(argv[i + 1], "--tools")));
      if (!spec.active()) {
        std::fprintf(stderr, "--tools: no tools to call in %s\n", argv[i + 1]);
        return 2;
      }
      grammar = tool_reply_grammar(spec, nullptr);
      tools_prompt = tool_system_prompt(spec, true);
    }
    else {
      std::fprintf(stderr, "unknown option %s\n", a.c_str());
      return 2;
    }
  }
  EngineOptions o;
  o.model_path = argv[1];
  o.threads = threads;
  o.ctx = 1024;
  Engine e(o);
  const Tokenizer& tok = e.tokenizer();
  // The model's chat template; a base model (Gemma 3 270M has none) gets an example to follow.
  const std::string ask = tools_prompt.empty() ? "Describe three cats as a JSON object: for each its name, age in years and colors."
                                               : "What will the weather be in Paris and in Rome this week?";
  std::string text_prompt;
  const ChatTemplate tpl = chat_template_detect(e.model().file());
  if (!tools_prompt.empty()) {
    const auto msgs = tool_chat_messages(nlohmann::json::array({{{"role", "user"}, {"content", ask}}}), tools_prompt, tpl);
    if (tpl.known()) {
      text_prompt = chat_render(tpl, msgs);
    } else {
      for (const ChatMessage& m : msgs) text_prompt += m.content + "\n";  // as kvq serve writes it
    }
  } else {
    try {
      text_prompt = chat_render(tpl, {ChatMessage{"user", ask}});
    } catch (const Error&) {
      text_prompt = "Two dogs as a JSON object: {\"dogs\": [{\"name\": \"Rex\", \"age\": 4, \"colors\": [\"brown\"]}, "
                    "{\"name\": \"Bo\", \"age\": 2, \"colors\": [\"black\", \"white\"]}]}\n" + ask + "\n";
    }
  }
  const std::vector<int32_t> prompt = tok.encode(text_prompt, true, true);
  if (batch > 1) {
    // N requests at once: wall time per generated token, constrained vs plain (the plain ones
    // generate as many tokens as the constrained ones did, end of generation ignored).
    std::vector<double> ratio;
    for (int r = 0; r < reps; ++r) {
      double per[2] = {0, 0};
      std::vector<int> counts(size_t(batch), tokens);
      for (int constrained = 1; constrained >= 0; --constrained) {
        std::vector<GenRequest> rs(static_cast<size_t>(batch));
        std::vector<GenResult> out(static_cast<size_t>(batch));
        std::atomic<int> left{batch};
        std::mutex mu;
        std::condition_variable cv;
        for (int b = 0; b < batch; ++b) {
          GenRequest& q = rs[size_t(b)];
          q.prompt = prompt;
          q.params.sampling.temperature = 1.0f;
          q.params.sampling.seed = uint64_t(b);
          q.params.max_tokens = constrained ? tokens : counts[size_t(b)];
          q.params.json_object = constrained && !grammar;
          q.params.grammar = constrained ? grammar : nullptr;
          q.params.ignore_eos = !constrained;
          q.on_done = [&, b](const GenResult& g) {
            out[size_t(b)] = g;
            std::lock_guard<std::mutex> lk(mu);
            if (--left == 0) cv.notify_all();
          };
        }
        const double t0 = now_seconds();
        e.submit_all(std::move(rs));
        {
          std::unique_lock<std::mutex> lk(mu);
          cv.wait(lk, [&] { return left == 0; });
        }
        const double took = now_seconds() - t0;
        size_t total = 0;
        for (int b = 0; b < batch; ++b) {
          total += out[size_t(b)].tokens.size();
          if (constrained) counts[size_t(b)] = std::max<int>(1, int(out[size_t(b)].tokens.size()));
        }
        per[constrained] = took / double(total);
      }
      ratio.push_back(per[1] / per[0]);
      std::printf("batch %d, rep %d: %s %.3f ms per token, plain %.3f, ratio %.3f\n", batch, r,
                  grammar ? "constrained" : "JSON mode", per[1] * 1e3, per[0] * 1e3, per[1] / per[0]);
    }
    std::printf("batch %d: median ratio %.3f\n", batch, median(ratio));
    return 0;
  }
  std::vector<double> per_json, per_plain;
  std::string text;
  int n = 0;
  for (int r = 0; r < reps; ++r) {
    GenParams p;
    p.sampling.temperature = 0;
    p.max_tokens = tokens;
    p.json_object = !grammar;
    p.grammar = grammar;
    const GenResult j = e.generate(prompt, p);
    n = int(j.tokens.size());
    text = j.text;
    if (n < 8) {
      std::fprintf(stderr, "JSON mode generated only %d tokens\n", n);
      return 1;
    }
    p.json_object = false;
    p.grammar = nullptr;
    p.ignore_eos = true;
    p.max_tokens = n;
    const GenResult q = e.generate(prompt, p);
    per_json.push_back(j.decode_s / (n - 1));
    per_plain.push_back(q.decode_s / (int(q.tokens.size()) - 1));
  }
  // The mask alone, at every byte boundary of the generated text.
  const JsonVocab vocab(tok);
  const GrammarVocab gvocab(vocab);
  std::vector<float> logits(size_t(tok.n_vocab()));
  std::vector<double> mask_us, in_string_us, other_us;
  GrammarState g(grammar ? grammar : Grammar::json_object());
  for (unsigned char c : text) {
    std::fill(logits.begin(), logits.end(), 0.f);
    const double t0 = now_seconds();
    grammar_mask(g, gvocab, {}, logits.data(), tok.n_vocab());
    const double us = (now_seconds() - t0) * 1e6;
    mask_us.push_back(us);
    (g.string_room() >= 0 ? in_string_us : other_us).push_back(us);
    if (!g.feed(c)) break;
  }
  std::printf("model %s, vocabulary %d, %d threads, %d reps of %d tokens\n", argv[1], tok.n_vocab(), threads, reps, n);
  std::printf("decode ms/token: %s %.2f, plain %.2f, ratio %.3f\n", grammar ? "constrained" : "JSON mode", median(per_json) * 1e3,
              median(per_plain) * 1e3, median(per_json) / median(per_plain));
  double mean = 0;
  for (double us : mask_us) mean += us / double(mask_us.size());
  std::printf("%s: median %.0f us per step over %zu states, mean %.0f, max %.0f (inside strings %.0f us over %zu, "
              "elsewhere %.0f us over %zu)\n",
              "grammar_mask", median(mask_us), mask_us.size(), mean,
              *std::max_element(mask_us.begin(), mask_us.end()), in_string_us.empty() ? 0.0 : median(in_string_us),
              in_string_us.size(), other_us.empty() ? 0.0 : median(other_us), other_us.size());
  std::printf("text: %s\n", text.c_str());
  return 0;
}
