#include "tools/run.h"

#include <CLI/CLI.hpp>
#include <charconv>
#include <cstdint>
#include <cstdio>
#include <iostream>
#include <thread>

#include <fmt/format.h>

#include "core/cpu.h"
#include "core/error.h"
#include "core/timer.h"
#include "model/chat.h"
#include "model/draft.h"
#include "model/model.h"
#include "model/json_constraint.h"
#include "model/json_schema.h"
#include "model/tokenizer.h"
#include "tools/files.h"
#include "weights/weights.h"

namespace kvq {

void run_add_cli(CLI::App& app, RunOptions& o) {
  app.add_option("-m,--model", o.model, "GGUF model file")->required();
  app.add_option("-p,--prompt", o.prompt, "prompt text (empty: start from BOS)")->each([&](const std::string&) { o.prompt_set = true; });
  app.add_option("-f,--file", o.prompt_file, "read the prompt from a file");
  app.add_option("-n,--n-predict", o.n_predict, "tokens to generate")->capture_default_str();
  app.add_option("-t,--threads", o.threads, "threads (default: all hardware threads)")->check(CLI::Range(1, 1024));
  app.add_option("-c,--ctx-size", o.ctx, "context length (default: the model's)");
  app.add_flag("--chat", o.chat, "wrap the prompt in the model's chat template");
  app.add_flag("-i,--interactive", o.interactive,
               "with --chat: a conversation, one user turn per line of stdin (after -p, if given), each reply "
               "continuing the same KV cache");
  app.add_option("--system", o.system, "system message (with --chat)");
  app.add_option("--chat-template-file", o.chat_template_file,
                 "a chat template (Jinja, as a GGUF carries it) to use instead of the model's, for a file whose own is missing or wrong (llama.cpp's flag); kvq recognizes the families it renders by their markers")
      ->type_name("FILE");
  app.add_option("--reasoning-effort", o.reasoning_effort,
                 "with --chat on a harmony model (gpt-oss): low, medium (its default) or high")
      ->check(CLI::IsMember({"low", "medium", "high"}));
  app.add_option("--reasoning-budget", o.reasoning_budget, std::string("with --chat: ") + kReasoningBudgetHelp)
      ->check(CLI::Range(-1, 1 << 30));
  app.add_option("--reasoning-budget-message", o.reasoning_budget_message,
                 std::string("with --chat: ") + kReasoningBudgetMessageHelp)
      ->type_name("TEXT");
  app.add_option("--chat-template-kwargs", o.chat_template_kwargs,
                 "with --chat: a JSON object of chat template settings, as llama.cpp's flag: kvq reads enable_thinking "
                 "(false: a reasoning template's <think> block, Qwen3's, closed in the prompt, so the reply is the answer alone)")
      ->type_name("JSON");
  app.add_option("--reasoning-format", o.reasoning_format,
                 "with --chat on a harmony model (gpt-oss) or a reasoning template (<think>: Qwen3, QwQ): split (the "
                 "answer on stdout, the reasoning on stderr; default) or raw (the reply as generated, its markers "
                 "included, on stdout)")
      ->check(CLI::IsMember({"split", "raw"}))
      ->each([&o](const std::string&) { o.reasoning_format_given = true; });
  app.add_flag("--echo", o.echo, "print the prompt before the generated text");
  app.add_flag("--json", o.json_object,
               "JSON mode: only tokens that continue one JSON object are sampled, and generation ends when it "
               "closes (as kvq serve's response_format json_object)");
  app.add_option("--json-schema", o.json_schema,
                 "structured output: only tokens that continue a document of the JSON Schema in FILE are sampled, "
                 "and generation ends when it is complete (as kvq serve's response_format json_schema)")
      ->type_name("FILE");
  app.add_option("--regex", o.regex,
                 "structured output: only tokens that continue a text matching the regular expression PATTERN "
                 "whole are sampled, and generation ends when no more can come (as kvq serve's structured_outputs "
                 "regex; ECMA-262 syntax)")
      ->type_name("PATTERN")
      ->each([&o](const std::string&) { o.regex_given = true; });
  app.add_option("--grammar", o.grammar,
                 "structured output: only tokens that continue a text of the GBNF grammar (llama.cpp's format; its "
                 "rule root) are sampled, and generation ends when no more can come")
      ->type_name("GBNF")
      ->each([&o](const std::string&) { o.grammar_given = true; });
  app.add_option("--grammar-file", o.grammar_file, "--grammar, read from FILE")->type_name("FILE");
  app.add_option("--temp", o.sampling.temperature, "temperature (0: greedy)")->capture_default_str();
  app.add_option("--top-k", o.sampling.top_k, "top-k (0: off)")->capture_default_str();
  app.add_option("--top-p", o.sampling.top_p, "top-p (1: off)")->capture_default_str();
  app.add_option("--min-p", o.sampling.min_p, "min-p (0: off)")->capture_default_str();
  app.add_option("--repeat-penalty", o.sampling.repeat_penalty, "repetition penalty (1: off)")->capture_default_str();
  app.add_option("--repeat-last-n", o.sampling.repeat_last_n, "tokens the penalty looks back (-1: all)")->capture_default_str();
  app.add_option("--presence-penalty", o.sampling.presence_penalty, "subtracted once from each generated token's logit (0: off)")
      ->capture_default_str();
  app.add_option("--frequency-penalty", o.sampling.frequency_penalty,
                 "subtracted per occurrence from each generated token's logit (0: off)")
      ->capture_default_str();
  app.add_option("-s,--seed", o.sampling.seed, "random seed")
      ->capture_default_str()
      ->check(CLI::Validator(
          [](std::string& v) {  // exactly a uint64 (a larger number would otherwise saturate silently)
            uint64_t x = 0;
            const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), x);
            return ec == std::errc() && end == v.data() + v.size()
                       ? std::string()
                       : fmt::format("must be an integer in [0, {}] (got {})", UINT64_MAX, v);
          },
          "UINT64"));
  app.add_option("--draft-max", o.draft_max,
                 "speculative decoding by prompt lookup: up to N tokens drafted per step from where the text's last "
                 "tokens occurred before (the prompt, or what was generated), verified in one forward pass; the output is "
                 "what decoding without it gives (0: off)")
      ->check(CLI::Range(0, 64))
      ->capture_default_str();
  app.add_option("--draft-ngram-min", o.draft_ngram_min, "prompt lookup: the fewest last tokens that must match")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  app.add_option("--draft-ngram-max", o.draft_ngram_max, "prompt lookup: the most last tokens matched (the longest match wins)")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  kv_flags_add(app, o.kv);
}

static std::string mib(size_t b) { return fmt::format("{:.1f} MiB", double(b) / (1024.0 * 1024.0)); }

int run_command(const RunOptions& o) {
  if (o.threads < 0) fail("--threads must be >= 1 (got {})", o.threads);
  if (o.n_predict < 0) fail("--n-predict must be >= 0 (got {})", o.n_predict);
  if (o.prompt_set && !o.prompt_file.empty()) fail("give either --prompt or --file, not both");
  std::string prompt = o.prompt;
  if (!o.prompt_file.empty()) {
    prompt = read_text_file(o.prompt_file, "-f");
  }
  const int threads = resolve_threads(o.threads);
  const bool regex = o.regex_given, gbnf = o.grammar_given;
  if (int(o.json_object) + int(!o.json_schema.empty()) + int(regex) + int(gbnf) + int(!o.grammar_file.empty()) > 1)
    fail("give one of --json, --json-schema, --regex, --grammar and --grammar-file");
  std::shared_ptr<const Grammar> grammar = o.json_object ? Grammar::json_object() : nullptr;
  if (!o.json_schema.empty()) {
    try {
      grammar = Grammar::from_schema_text(read_text_file(o.json_schema, "--json-schema"));
    } catch (const std::invalid_argument& e) {
      fail("--json-schema {}: {}", o.json_schema, e.what());
    }
  }
  if (regex) {
    try {
      grammar = Grammar::from_regex(o.regex);
    } catch (const std::invalid_argument& e) {
      fail("--regex: {}", e.what());
    }
  }
  if (gbnf || !o.grammar_file.empty()) {
    const char* flag = gbnf ? "--grammar" : "--grammar-file";
    const std::string text = gbnf ? o.grammar : read_text_file(o.grammar_file, "--grammar-file");
    try {
      grammar = Grammar::from_gbnf(text);
    } catch (const std::invalid_argument& e) {
      fail("{}: {}", flag, e.what());
    }
  }

  if (o.draft_ngram_min > o.draft_ngram_max)
    fail("--draft-ngram-min {} exceeds --draft-ngram-max {}", o.draft_ngram_min, o.draft_ngram_max);
  if (o.ctx < 0) fail("--ctx-size must be > 0 (got {})", o.ctx);
  auto model = Model::load(o.model, o.kv.rope);
  model->set_context(o.ctx);
  const ModelConfig& c = model->config();
  Tokenizer tok = Tokenizer::from_gguf(model->file());
  const int ctx = o.ctx > 0 ? o.ctx : c.n_ctx_train;
  if (const std::string note = model_rope_note(c, o.ctx); !note.empty()) std::fprintf(stderr, "%s\n", note.c_str());
  if (ctx > c.n_ctx_train)
    std::fprintf(stderr, "[kvq] warning: --ctx-size %d is beyond the %d tokens the model was trained on; past them its output may degrade\n",
                 ctx, c.n_ctx_train);
  if (!o.system.empty() && !o.chat) fail("--system needs --chat (the system message goes into the chat template)");

  if (o.interactive && !o.chat) fail("--interactive needs --chat (each line is a user turn in the chat template)");
  if (o.interactive && o.echo) fail("--echo does not apply to --interactive");

  if (!o.chat_template_file.empty() && !o.chat) fail("--chat-template-file needs --chat");
  ChatTemplate tpl;
  if (o.chat) {
    tpl = chat_template_detect(model->file(), read_chat_template_file(o.chat_template_file));
    if (!tpl.known()) fail("{}: the model has no chat template kvq supports ({})", o.model, chat_supported_families());
  }
  if (!o.reasoning_effort.empty() && tpl.family != ChatFamily::harmony)
    fail("--reasoning-effort is harmony's (gpt-oss) setting, with --chat; this model's chat template is {}",
         o.chat ? chat_template_name(tpl) : "not in use");
  tpl.reasoning_effort = o.reasoning_effort;
  // Harmony (gpt-oss): a reply is its reasoning, then its answer in the final channel; split, the
  // answer goes to stdout and the reasoning to stderr as they come. A constrained reply (--json,
  // ...) is opened in the final channel, without reasoning, as kvq serve opens it.
  // A reasoning template's (<think>: Qwen3, QwQ) replies are split the same way; its block is
  // closed in the prompt with --chat-template-kwargs '{"enable_thinking": false}' and for a
  // constrained reply.
  const bool harmony = o.chat && tpl.family == ChatFamily::harmony;
  const bool think = o.chat && tpl.think != ChatTemplate::Think::none;
  const bool reasons = o.chat && chat_reasons(tpl);
  const bool reply_split = reasons && o.reasoning_format == "split";
  if (o.reasoning_format_given && !reasons)
    std::fprintf(stderr, "[kvq] warning: --reasoning-format applies to harmony replies (gpt-oss) and reasoning templates' "
                 "(<think>), with --chat; ignored\n");
  if (!o.chat_template_kwargs.empty() && !o.chat) fail("--chat-template-kwargs needs --chat");
  if ((o.reasoning_budget >= 0 || !o.reasoning_budget_message.empty()) && !o.chat)
    fail("--reasoning-budget and --reasoning-budget-message need --chat");
  if (o.chat) chat_warn_budget_unused(tpl, o.reasoning_budget);
  ChatRenderOptions ro;
  ro.thinking = chat_template_kwargs_flag(o.chat_template_kwargs);
  if (grammar) ro.thinking = false;
  // The first turn: the whole prompt in the template (system message first).
  auto first_turn = [&](const std::string& user) {
    std::vector<ChatMessage> msgs;
    if (!o.system.empty()) msgs.push_back({"system", o.system});
    msgs.push_back({"user", user});
    return chat_render(tpl, msgs, ro) + (harmony && grammar ? HarmonyReplyStream::kOpenFinal : "");
  };
  // Reply text out: to stdout, or split into reasoning and answer (harmony's channels, <think>)
  std::unique_ptr<ChatReplySplitter> hreply;
  bool reasoning_open = false;  // stderr is inside a "[reasoning]" block
  std::string reply_text;       // the turn's reply as generated
  auto out_text = [&](const std::string& piece) {
    reply_text += piece;
    if (!hreply) {
      std::fwrite(piece.data(), 1, piece.size(), stdout);
      std::fflush(stdout);
      return;
    }
    const ChatReplyDelta d = piece.empty() ? hreply->finish() : hreply->feed(piece);
    if (!d.reasoning.empty()) {
      if (!reasoning_open) std::fputs("[reasoning] ", stderr);
      reasoning_open = true;
      std::fwrite(d.reasoning.data(), 1, d.reasoning.size(), stderr);
    }
    if (!d.content.empty()) {
      if (reasoning_open) std::fputs("\n[/reasoning]\n", stderr);
      reasoning_open = false;
      std::fwrite(d.content.data(), 1, d.content.size(), stdout);
      std::fflush(stdout);
    }
  };

  ThreadPool pool(threads);
  const KvSetup kv = kv_flags_resolve(o.kv, *model);
  kv_flags_warn_unused(o.kv, kv, *model);
  const KvPolicy& policy = kv.policy;
  KvCacheConfig kcfg = model->kv_cache_config(policy, ctx, o.kv.page_tokens);
  kv.apply(kcfg);
  KvCache cache(kcfg);
  // A harmony conversation (gpt-oss, -i) shows earlier replies as their final answer only, as its
  // template does: the cache at each reply's start is kept (a copy; sliding-window layers keep
  // their window), and the next turn goes on from there with the answer alone, the reasoning
  // dropped. (A constrained reply is opened in its final channel: it has no reasoning to drop.)
  // A reasoning template's likewise (Qwen3's and QwQ's show an earlier reply's answer alone), from
  // before what the prompt wrote of the reply ('<think>\n').
  const bool rewind = o.interactive && reasons && !grammar;
  std::unique_ptr<KvCache> reply_start;
  size_t reply_start_history = 0;
  Forward fwd(*model, pool);
  Sampler sampler(o.sampling);
  const std::unique_ptr<JsonVocab> json_vocab = grammar ? std::make_unique<JsonVocab>(tok) : nullptr;
  const std::unique_ptr<GrammarVocab> grammar_vocab = grammar ? std::make_unique<GrammarVocab>(*json_vocab) : nullptr;
  std::vector<float> masked;
  std::vector<int32_t> history;  // every token in the cache, and the one sampled last
  double t_prompt = 0, t_gen = 0;
  size_t n_prompt = 0;
  int n_eval = 0;                // tokens decoded (run through the model, one at a time or verified in a batch)
  int spec_steps = 0, spec_drafted = 0, spec_accepted = 0;  // --draft-max: verification steps, drafts, kept
  const char* stop_reason = "length";

  // One turn: the new prompt tokens into the cache, then up to n_predict sampled tokens streamed
  // to stdout. Returns false when the context is full.
  // opening: the prompt's last tokens, what it wrote of the reply (kept out of the reply's start,
  // and read by the splitter).
  auto turn = [&](const std::vector<int32_t>& ids, bool from_start, size_t opening_tokens = 0,
                  const std::string& opening = {}) -> bool {
    if (cache.n_tokens() + int(ids.size()) >= ctx) {
      if (cache.n_tokens() == 0)
        fail("prompt is {} tokens, the context is {} (use a shorter prompt or a larger --ctx-size)", ids.size(), ctx);
      stop_reason = "context full";
      return false;
    }
    const double t0 = now_seconds();
    // with rewind, the reply's start is kept before the opening: run in two parts then
    const size_t body = rewind && opening_tokens < ids.size() ? ids.size() - opening_tokens : ids.size();
    const float* logits = fwd.eval(ids.data(), int(body), cache);
    if (rewind) {
      if (!reply_start) reply_start = std::make_unique<KvCache>(kcfg);
      reply_start->clear();
      reply_start->fork_from(cache);
      reply_start_history = history.size() + body;
    }
    if (body < ids.size()) logits = fwd.eval(ids.data() + body, int(ids.size() - body), cache);
    t_prompt += now_seconds() - t0;
    n_prompt += ids.size();
    history.insert(history.end(), ids.begin(), ids.end());
    const size_t turn_start = history.size();
    reply_text.clear();
    TokenStreamDecoder stream(tok, from_start);
    // --reasoning-budget: the reasoning ended for the model once it has taken that many tokens
    // (not in a constrained reply, whose block the prompt closed)
    const ReasoningBudget rb = o.chat && !grammar ? chat_reasoning_budget(tpl, o.reasoning_budget, o.reasoning_budget_message,
                                                                          opening, false)
                                                  : ReasoningBudget{};
    std::unique_ptr<ReasoningBudgetState> budget = rb.active() ? std::make_unique<ReasoningBudgetState>(rb, tok) : nullptr;
    if (reply_split) {
      hreply = chat_reply_splitter(tpl);
      (void)hreply->feed(opening);  // (what the prompt wrote of the reply)
    }
    const double t1 = now_seconds();
    stop_reason = "length";
    bool room = true;
    // Each turn's answer is one document (--json: one object).
    std::unique_ptr<GrammarState> doc = grammar ? std::make_unique<GrammarState>(grammar) : nullptr;
    if (doc && doc->done()) stop_reason = "end of the text";  // only the empty text (--regex '')
    if (o.n_predict > 0 && !(doc && doc->done())) {
      // Decoding: sample `next`, run it, sample the next from its logits. With --draft-max
      // (speculative decoding), the tokens that followed the latest earlier occurrence of the
      // text's end are drafted after `next`, and one forward pass gives logits after each. Row i
      // is sampled as decoding would sample it (the history, and the grammar's state, holding the
      // drafts kept so far): while the sample equals the draft that follows, the draft is kept;
      // the first sample that differs (or the one after the last draft) is the next token. For
      // greedy decoding the output is decoding's; for sampling, its distribution.
      auto sample_row = [&](const float* row) {
        if (budget && budget->forced() >= 0) return budget->forced();
        const float* lg = row;
        if (doc) {
          masked.assign(row, row + c.n_vocab);
          grammar_mask(*doc, *grammar_vocab, {}, masked.data(), int(c.n_vocab));
          lg = masked.data();
        }
        return sampler.sample(lg, c.n_vocab, history, turn_start);
      };
      // go: emitted, generation goes on; last: emitted, and the text ends with it (the document is
      // complete); none: the text ends before it (end-of-generation, or no token continues the document)
      enum class Emit { go, last, none };
      int n_gen = 0;
      auto emit = [&](int32_t t) {
        if (tok.is_eog(t)) {
          stop_reason = doc && !doc->accepting() ? "no token continues the document" : "end of generation token";
          return Emit::none;
        }
        history.push_back(t);
        const std::string piece = stream.push(t);
        if (!piece.empty()) out_text(piece);
        if (budget) budget->take(t, piece, stream.pending());
        ++n_gen;
        if (doc && (!doc->feed(json_vocab->bytes(t)) || doc->done())) {
          stop_reason = !doc->done()      ? "no token continues the document"
                        : o.json_object ? "end of the JSON object"
                        : o.json_schema.empty() ? "end of the text"
                                                : "end of the document";
          return Emit::last;
        }
        return Emit::go;
      };
      // Drafts as long as the last verification kept plus one, doubled while all are kept (up to
      // --draft-max): a verified row costs a good part of a decode step, so long drafts are
      // tried where the text has been copying.
      int draft_len = o.draft_max;
      int32_t next = sample_row(logits);
      for (;;) {
        if (emit(next) != Emit::go) break;
        if (cache.n_tokens() >= ctx) {
          stop_reason = "context full";
          room = false;
          break;
        }
        if (n_gen == o.n_predict) {
          // a conversation goes on from here: the last token into the cache, as decoding does
          if (o.interactive) {
            fwd.eval(&next, 1, cache);
            ++n_eval;
          }
          break;
        }
        // drafts (none without --draft-max): no more than the tokens still wanted and the room in
        // the context allow, and none when the step would pack a group of a grouped KV format
        const int room_left = std::min(o.n_predict - n_gen, ctx - cache.n_tokens() - 1);
        std::vector<int32_t> d = ngram_draft(history, o.draft_ngram_min, o.draft_ngram_max,
                                             std::min({draft_len, room_left, fwd.max_batch() - 1}));
        if (!d.empty() && !cache.step_keeps_any(int(d.size()) + 1)) d.clear();
        if (d.empty()) {
          logits = fwd.eval(&next, 1, cache);
          ++n_eval;
          next = sample_row(logits);
          continue;
        }
        std::vector<int32_t> batch(1, next);
        batch.insert(batch.end(), d.begin(), d.end());
        // the rows through decode's one-token weight kernels (12 or more rows would otherwise
        // run the prefill kernels, whose sums round differently), so that each is what decoding
        // computes for its token
        const bool invariant = matmul_batch_invariant();
        matmul_set_batch_invariant(true);
        const float* rows = fwd.eval_held(batch.data(), int(batch.size()), cache);
        matmul_set_batch_invariant(invariant);
        // kept: drafts that were right; in_cache: the step's tokens the cache keeps (decoding
        // runs neither a token that ends the text nor, outside a conversation, the last of -n)
        int kept = 0, in_cache = 1;
        bool ended = false;
        for (size_t i = 0;; ++i) {
          next = sample_row(rows + i * size_t(c.n_vocab));
          if (i == d.size() || next != d[i]) break;
          const Emit e = emit(next);
          ended = e != Emit::go || n_gen == o.n_predict;
          if (e == Emit::none) break;
          ++kept;
          if (e == Emit::go && !(n_gen == o.n_predict && !o.interactive)) ++in_cache;
          if (ended) break;
        }
        cache.commit(int(batch.size()), in_cache);
        draft_len = kept == int(d.size()) ? std::min(o.draft_max, 2 * draft_len) : kept + 1;
        ++spec_steps;
        spec_drafted += int(d.size());
        spec_accepted += kept;
        n_eval += in_cache;
        if (ended) break;
      }
    }
    const std::string rest = stream.flush();
    if (!rest.empty()) out_text(rest);
    if (hreply) {
      out_text("");  // what the reply stream held back
      if (reasoning_open) std::fputs("\n[/reasoning]\n", stderr);
      reasoning_open = false;
    }
    std::fputc('\n', stdout);
    std::fflush(stdout);
    t_gen += now_seconds() - t1;
    return room;
  };

  if (!o.interactive) {
    const std::string text = o.chat ? first_turn(prompt) : prompt;
    std::vector<int32_t> ids = tok.encode(text, /*add_bos=*/true, /*parse_special=*/o.chat);
    const bool from_start = text.empty();  // generated text starts the document (no prompt)
    if (ids.empty()) {
      if (tok.bos() < 0) fail("empty prompt and the model has no BOS token to start from");
      ids.push_back(tok.bos());
    }
    if (o.echo) {
      std::fwrite(prompt.data(), 1, prompt.size(), stdout);  // all of it, NUL bytes included
      std::fflush(stdout);
    }
    const std::string opening = o.chat ? chat_reply_opening(tpl, text) : std::string();
    turn(ids, from_start, 0, opening);
  } else {
    // Each user line, rendered as the template continues the conversation, goes into the same
    // cache after the reply before it: nothing already in the cache is computed again.
    std::string line = prompt;
    std::string reply_opening;  // what the prompt wrote of the last reply
    bool have = o.prompt_set || !o.prompt_file.empty();
    int turns = 0;
    for (;;) {
      if (!have) {
        std::fprintf(stderr, "> ");
        std::fflush(stderr);
        if (!std::getline(std::cin, line)) break;
        if (line.empty()) continue;
      }
      have = false;
      std::string text = turns == 0 ? first_turn(line) : chat_render_next_turn(tpl, line, ro);
      // harmony, <think>: from the last reply's start, its answer alone
      const bool back = rewind && turns > 0;
      if (back && harmony) text = HarmonyReplyStream::kOpenFinal + HarmonyReplyStream::split(reply_text).content + text;
      if (back && think) text = ThinkReplyStream().split_after(reply_opening, reply_text).content + text;
      const std::vector<int32_t> ids = tok.encode(text, /*add_bos=*/turns == 0, /*parse_special=*/true);
      // what the prompt writes of the next reply ('<think>\n'): its tokens, where the text before
      // it tokenizes to the prompt's start (else the reply's start is kept after it)
      const std::string opening = chat_reply_opening(tpl, text);
      size_t opening_tokens = 0;
      if (!opening.empty()) {
        const std::vector<int32_t> before = tok.encode(text.substr(0, text.size() - opening.size()), turns == 0, true);
        if (before.size() < ids.size() && std::equal(before.begin(), before.end(), ids.begin()))
          opening_tokens = ids.size() - before.size();
      }
      const int held = back ? reply_start->n_tokens() : cache.n_tokens();
      if (held + int(ids.size()) >= ctx) {
        // Too long for what is left of the context: not sent, the conversation goes on as it was.
        std::fprintf(stderr, "[kvq] this turn is %zu tokens and the context has room for %d more: not sent (type a "
                     "shorter one)\n", ids.size(), ctx - held - 1);
        continue;
      }
      if (back) {
        cache.clear();
        cache.fork_from(*reply_start);
        history.resize(reply_start_history);
      }
      const size_t before = n_prompt;
      const bool room = turn(ids, false, opening_tokens, opening);
      reply_opening = opening;
      ++turns;
      std::fprintf(stderr, "[kvq] turn %d: %zu new prompt tokens, %d in the cache\n", turns, n_prompt - before,
                   cache.n_tokens());
      if (!room) {
        std::fprintf(stderr, "[kvq] the context of %d tokens is full: conversation ends\n", ctx);
        break;
      }
    }
  }
  std::string arch = c.n_expert > 0 ? fmt::format("{}, {} of {} experts per token", c.arch, c.n_expert_used, c.n_expert) : c.arch;
  if (const std::string n = model_rope_scaling_note(c); !n.empty()) arch += ", " + n;
  std::fprintf(stderr, "\n[kvq] %s | %s | %d threads | cpu %s | KV %s (%.1f bytes/token)\n", c.name.c_str(),
               arch.c_str(), threads, cpu_level_name(cpu_level()), kv_policy_describe(policy).c_str(),
               cache.bytes_per_token());
  std::fprintf(stderr, "[kvq] stop: %s\n", stop_reason);
  std::fprintf(stderr, "[kvq] prompt: %zu tokens in %.3f s (%.1f tokens/s)\n", n_prompt, t_prompt,
               double(n_prompt) / std::max(t_prompt, 1e-9));
  std::fprintf(stderr, "[kvq] decode: %d tokens in %.3f s (%.1f tokens/s)\n", n_eval, t_gen,
               n_eval > 0 ? double(n_eval) / std::max(t_gen, 1e-9) : 0.0);
  if (o.draft_max > 0)
    std::fprintf(stderr, "[kvq] speculative: %d verification steps, %d of %d drafted tokens kept (%.1f%%), %.2f tokens per step\n",
                 spec_steps, spec_accepted, spec_drafted, spec_drafted > 0 ? 100.0 * spec_accepted / spec_drafted : 0.0,
                 spec_steps > 0 ? double(spec_steps + spec_accepted) / spec_steps : 0.0);
  std::fprintf(stderr, "[kvq] memory: weights %s, KV %s (%d tokens), scratch %s\n", mib(model->weights_bytes()).c_str(),
               mib(cache.bytes_pages() + cache.bytes_tail()).c_str(), cache.n_tokens(), mib(fwd.scratch_bytes()).c_str());
  return 0;
}

}  // namespace kvq
