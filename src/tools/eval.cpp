#include "tools/eval.h"

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <limits>
#include <thread>

#include "core/cpu.h"
#include "core/error.h"
#include "core/strings.h"
#include "core/timer.h"
#include "model/chat.h"
#include "model/model.h"
#include "model/sampler.h"
#include "model/tokenizer.h"
#include "tools/eval_metrics.h"
#include "tools/files.h"
#include "tools/jsonl.h"
#include "tools/plan.h"
#include "tools/report.h"

namespace kvq {

void eval_add_cli(CLI::App& app, EvalOptions& o) {
  app.add_option("-m,--model", o.model, "GGUF model file")->required();
  app.add_option("--kv", o.formats, "KV formats to evaluate (comma-separated; KFMT/VFMT, FMT@gN); f16 is the reference")
      ->delimiter(',')->required();
  app.add_option("--ctx", o.ctx, "context lengths (comma-separated; 4K, 32k accepted)")->delimiter(',');
  app.add_option("--task", o.tasks, "tasks: ppl, needle, layers, own (comma-separated)")->delimiter(',')->capture_default_str();
  app.add_option("--data", o.data, "text file for ppl (e.g. WikiText-2 test) and the default haystack");
  app.add_option("--haystack", o.haystack, "haystack text for needle (default: --data)");
  app.add_option("--own", o.own,
                 "JSONL eval set for task own: {\"prompt\", \"expected\", \"match\": substring|exact}; an optional "
                 "\"prompt_tokens\" array (token ids) is used as is instead of tokenizing the prompt");
  app.add_option("--depths", o.depths, "needle depths in percent")->delimiter(',')->capture_default_str();
  app.add_option("--needles", o.needles,
                 "needle: trials per (context, depth) cell, each with its own passcode and stretch of the haystack "
                 "(one trial per cell is a coin flip on a small model; accuracy is over all trials)")
      ->check(CLI::Range(1, 100))
      ->capture_default_str();
  app.add_option("--needle-set-out", o.needle_set_out,
                 "needle: also write every trial as one JSONL line of an own-task eval set (prompt text, its exact "
                 "\"prompt_tokens\", the passcode as \"expected\", ctx, depth, trial): the same trials replayed by "
                 "--task own or by another engine");
  app.add_option("--chunks", o.chunks, "ppl: windows per context length")->check(CLI::Range(1, 1000))->capture_default_str();
  app.add_option("-t,--threads", o.threads, "threads (default: all hardware threads)")->check(CLI::Range(1, 1024));
  app.add_option("--max-tokens", o.max_tokens, "own: tokens generated per prompt")->check(CLI::Range(1, 4096))->capture_default_str();
  app.add_flag("--chat", o.chat, "own: wrap prompts in the model's chat template");
  app.add_option("--chat-template-file", o.chat_template_file, "with --chat: "
                 "a chat template (Jinja, as a GGUF carries it) to use instead of the model's, for a file whose own is missing or wrong (llama.cpp's flag); kvq recognizes the families it renders by their markers")
      ->type_name("FILE");
  app.add_option("--chat-template-kwargs", o.chat_template_kwargs,
                 "with --chat: a JSON object of chat template settings, as llama.cpp's flag: kvq reads enable_thinking "
                 "(false: a reasoning template's <think> block closed in the prompt, so replies are answers alone)")
      ->type_name("JSON");
  app.add_option("--reasoning-budget", o.reasoning_budget, std::string("own, with --chat: ") + kReasoningBudgetHelp)
      ->check(CLI::Range(-1, 1 << 30));
  app.add_option("--reasoning-budget-message", o.reasoning_budget_message,
                 std::string("own, with --chat: ") + kReasoningBudgetMessageHelp)
      ->type_name("TEXT");
  app.add_flag("--json", o.json, "print JSON instead of tables");
  app.add_option("--json-out", o.json_out, "also write the JSON report to this file");
  app.add_option("--scale-mode", o.scale_mode, "ppl: dynamic | static-prefill (scales fixed from each window's first half)")
      ->check(CLI::IsMember({"dynamic", "static-prefill"}))->capture_default_str();
  app.add_option("--budget-bits", o.budget_bits,
                 "layers: choose each layer's K and V format among --kv to minimize the summed squared attention-output "
                 "error at this average bits per element (comma-separated: one policy each); printed as --kv-layer "
                 "flags and evaluated as one more format by the other tasks of the run")
      ->delimiter(',')
      ->check(CLI::Range(1.0, 32.0));
  app.add_option("--html", o.html, "write a self-contained HTML report with plots");
  app.add_flag("!--no-progress", o.progress, "no progress bar on stderr");
  app.add_flag("--f32-weights", o.f32_weights,
               "dequantize weights to f32 and run at reference precision (no 8-bit activation quantization): "
               "separates the KV format's error from the engine's own rounding; slower");
  // the same per-layer flags as kvq run, applied to every format under test (not --kv-cache-dtype)
  kv_flags_add_shared(app, o.kv);
}

namespace {

class Progress {
 public:
  Progress(bool on, size_t total) : on_(on), total_(std::max<size_t>(total, 1)), t0_(now_seconds()) {}
  void step(const std::string& what, size_t n = 1) {
    done_ += n;
    if (!on_) return;
    const double f = double(done_) / double(total_);
    const int w = 30, fill = int(f * w);
    const double el = now_seconds() - t0_;
    std::fprintf(stderr, "\r[eval] [%.*s%*s] %3.0f%% %-40.40s eta %4.0fs", fill, "##############################",
                 w - fill, "", 100 * f, what.c_str(), f > 0 ? el / f - el : 0.0);
    std::fflush(stderr);
  }
  ~Progress() {
    if (on_) std::fputc('\n', stderr);
  }

 private:
  bool on_;
  size_t total_, done_ = 0;
  double t0_;
};

struct FormatRun {
  std::string name;
  KvSetup kv;
  double bits_per_element = 0;
  nlohmann::json report = nlohmann::json::object();
};

// Bits per K or V element for `bytes_per_token` of K and V over all layers and KV heads.
double bits_per_element(double bytes_per_token, const ModelConfig& cfg) {
  return bytes_per_token * 8.0 / (2.0 * cfg.n_layer * cfg.n_head_kv * cfg.head_dim);
}
double bits_per_element(const KvCache& c, const ModelConfig& cfg) { return bits_per_element(c.bytes_per_token(), cfg); }

// The reference every format is compared with: the f16 cache in every layer. The per-layer flags
// (--kv-layer, --kv-cache-dtype-skip-layers) shape the formats under test, not the reference.
KvSetup f16_reference(const KvFlags& flags, const Model& m) {
  KvFlags f = flags;
  f.layer_overrides.clear();
  f.skip_layers.clear();
  return kv_flags_resolve(f, m, "f16");
}

struct Ctx {
  const EvalOptions& o;
  Model& m;
  const Tokenizer& tok;
  ThreadPool& pool;
  std::vector<FormatRun>& runs;
  std::vector<int> ctxs;
};

// Each context length runs with the RoPE factors kvq would run at that context (Phi-3's LongRoPE:
// short up to its original context, long past it); the caches of a context are made after this.
void use_context(Ctx& c, int ctx) {
  if (c.m.set_context(ctx)) std::fprintf(stderr, "%s\n", model_rope_note(c.m.config(), ctx).c_str());
}

std::unique_ptr<KvCache> make_cache(const Ctx& c, const FormatRun& r, int max_tokens) {
  KvCacheConfig kc = c.m.kv_cache_config(r.kv.policy, max_tokens, c.o.kv.page_tokens);
  r.kv.apply(kc);
  return std::make_unique<KvCache>(kc);
}

// Scales fixed from the first n tokens of a window (per layer and KV head, absmax), in the
// calibration schema the static codecs read (kv/calib.h).
std::shared_ptr<const nlohmann::json> prefill_scales(const Ctx& c, const int32_t* tokens, int n) {
  const ModelConfig& cfg = c.m.config();
  const int nkv = cfg.n_head_kv, hd = cfg.head_dim;
  std::vector<std::vector<float>> ka(size_t(cfg.n_layer), std::vector<float>(size_t(nkv), 1e-6f)), va = ka;
  Forward fwd(c.m, c.pool, 256);
  fwd.on_kv = [&](int il, int rows, const float*, const float* k, const float* v) {
    for (int t = 0; t < rows; ++t)
      for (int h = 0; h < nkv; ++h)
        for (int d = 0; d < hd; ++d) {
          const size_t i = (size_t(t) * size_t(nkv) + size_t(h)) * size_t(hd) + size_t(d);
          ka[size_t(il)][size_t(h)] = std::max(ka[size_t(il)][size_t(h)], std::fabs(k[i]));
          va[size_t(il)][size_t(h)] = std::max(va[size_t(il)][size_t(h)], std::fabs(v[i]));
        }
  };
  KvCache cache(c.m.kv_cache_config(kv_policy_uniform("f16", cfg.n_layer), n));
  fwd.eval(tokens, n, cache);
  nlohmann::json j = {{"layers", nlohmann::json::array()}};
  auto div = [](std::vector<float> a, float d) {
    for (auto& x : a) x /= d;
    return a;
  };
  for (int il = 0; il < cfg.n_layer; ++il)
    j["layers"].push_back({{"k_scale", div(ka[size_t(il)], 448.f)}, {"v_scale", div(va[size_t(il)], 448.f)},
                           {"int8_k_scale", div(ka[size_t(il)], 127.f)}, {"int8_v_scale", div(va[size_t(il)], 127.f)}});
  return std::make_shared<const nlohmann::json>(std::move(j));
}

// The run with its int8 / fp8 codecs swapped for their fixed-scale variants.
FormatRun with_static_scales(const FormatRun& r, std::shared_ptr<const nlohmann::json> calib) {
  FormatRun s = r;
  auto swap = [](std::string& codec) {
    for (const char* base : {"int8", "int8_rows", "int8t"})
      if (codec == base) codec = "int8_static";
    for (const char* base : {"fp8_e4m3", "fp8_e5m2", "fp8_e4m3t", "fp8_e5m2t"})
      if (codec == base) codec += "_static";
    for (const char* base : {"fp8_e4m3", "fp8_e5m2"})
      if (codec == std::string(base) + "_rows") codec = std::string(base) + "_static_rows";
  };
  for (auto& l : s.kv.policy.layers) {
    swap(l.k_codec);
    swap(l.v_codec);
  }
  s.kv.calib = std::move(calib);
  return s;
}

// ---- ppl: windows of ctx tokens; the second half of each window is scored (the first half is
// context), against the f16 run on the same tokens.
void task_ppl(Ctx& c, const std::vector<int32_t>& text_ids) {
  const ModelConfig& cfg = c.m.config();
  const int nv = cfg.n_vocab;
  const FormatRun base{"f16", f16_reference(c.o.kv, c.m), 0, {}};
  size_t total = 0;
  for (int ctx : c.ctxs) total += size_t(ctx) * size_t(c.o.chunks) * (c.runs.size() + 1);
  Progress prog(c.o.progress, total);
  const int B = 256;
  Forward fwd(c.m, c.pool, B);
  std::vector<float> base_logits;
  for (int ctx : c.ctxs) {
    use_context(c, ctx);
    if (size_t(ctx) * size_t(c.o.chunks) > text_ids.size())
      fail("--data has {} tokens, fewer than {} window(s) of {} tokens", text_ids.size(), c.o.chunks, ctx);
    std::vector<std::vector<TokenScore>> scores(c.runs.size());
    std::vector<double> bits_at(c.runs.size(), 0.0);  // at this context: the full-precision window included
    for (int ch = 0; ch < c.o.chunks; ++ch) {
      std::vector<int32_t> win(text_ids.begin() + std::ptrdiff_t(size_t(ch) * size_t(ctx)),
                               text_ids.begin() + std::ptrdiff_t(size_t(ch + 1) * size_t(ctx)));
      if (c.tok.add_bos()) win[0] = c.tok.bos();
      auto base_cache = make_cache(c, base, ctx);
      std::vector<std::unique_ptr<KvCache>> caches;
      if (c.o.scale_mode == "static-prefill") {
        auto calib = prefill_scales(c, win.data(), ctx / 2);
        for (const auto& r : c.runs) caches.push_back(make_cache(c, with_static_scales(r, calib), ctx));
      } else {
        for (const auto& r : c.runs) caches.push_back(make_cache(c, r, ctx));
      }
      for (int b0 = 0; b0 < ctx; b0 += B) {
        const int n = std::min(B, ctx - b0);
        // batches wholly inside the unscored first half only fill the caches: no vocabulary
        // projection for their tokens (most of the cost for large-vocabulary models)
        const bool scored = b0 + n > ctx / 2;
        const float* lg = fwd.eval(win.data() + b0, n, *base_cache, scored);
        if (scored) base_logits.assign(lg, lg + size_t(n) * size_t(nv));
        prog.step(fmt::format("ppl ctx {} f16", ctx), size_t(n));
        for (size_t f = 0; f < c.runs.size(); ++f) {
          const float* tl = fwd.eval(win.data() + b0, n, *caches[f], scored);
          if (!scored) {
            prog.step(fmt::format("ppl ctx {} {}", ctx, c.runs[f].name), size_t(n));
            continue;
          }
          for (int i = 0; i < n; ++i) {
            const int pos = b0 + i;
            if (pos < ctx / 2 || pos + 1 >= ctx) continue;
            scores[f].push_back(eval_score_token(base_logits.data() + size_t(i) * size_t(nv), tl + size_t(i) * size_t(nv), nv,
                                                 win[size_t(pos + 1)]));
          }
          prog.step(fmt::format("ppl ctx {} {}", ctx, c.runs[f].name), size_t(n));
        }
      }
      for (size_t f = 0; f < c.runs.size(); ++f) {
        c.runs[f].bits_per_element = bits_per_element(*caches[f], cfg);
        bits_at[f] = bits_per_element(caches[f]->bytes_per_token_at(ctx), cfg);
      }
    }
    for (size_t f = 0; f < c.runs.size(); ++f) {
      BucketSummary s = eval_summarize(ctx, scores[f]);
      c.runs[f].report["buckets"].push_back({{"ctx", s.ctx}, {"bits_per_element", bits_at[f]}, {"n_scored", s.n_scored},
                                             {"ppl", s.ppl}, {"base_ppl", s.base_ppl},
                                             {"delta_ppl_pct", s.delta_ppl_pct}, {"kld_mean", s.kld_mean}, {"kld_p99", s.kld_p99},
                                             {"top1_agree", s.top1_agree}});
    }
  }
}

// budget: a bound on the reply's reasoning (own, --reasoning-budget), its close forced as the
// engine forces it; none by default.
std::string greedy_generate(Ctx& c, Forward& fwd, KvCache& cache, const std::vector<int32_t>& prompt, int max_tokens,
                            const ReasoningBudget& budget = {}) {
  const float* lg = fwd.eval(prompt.data(), int(prompt.size()), cache);
  std::vector<int32_t> out;
  std::unique_ptr<ReasoningBudgetState> bound = budget.active() ? std::make_unique<ReasoningBudgetState>(budget, c.tok) : nullptr;
  TokenStreamDecoder stream(c.tok, false);
  for (int i = 0; i < max_tokens; ++i) {
    int32_t t = bound && bound->forced() >= 0 ? bound->forced() : argmax(lg, c.m.config().n_vocab);
    if (c.tok.is_eog(t)) break;
    out.push_back(t);
    if (bound) {
      const std::string piece = stream.push(t);
      bound->take(t, piece, stream.pending());
    }
    if (cache.n_tokens() >= cache.capacity()) break;
    lg = fwd.eval(&t, 1, cache);
  }
  return c.tok.decode(out);
}

// ---- needle: a passcode sentence inserted at depth d of a haystack of ctx tokens, then the
// question; retrieval counts when the generated answer contains the passcode. With --needles N
// each (ctx, depth) cell holds N trials: trial k has its own passcode and starts its haystack at
// the k-th of N evenly spaced offsets into the text (all at offset 0 when the text is no longer
// than the context needs).
constexpr int kNeedleAnswerTokens = 10;  // greedy tokens after the question that must hold the passcode

// The f16 cache first, then the formats under test: the trial tasks (needle, own) run every case
// on all of them and report each format against the f16 cache's own outcome.
std::vector<FormatRun> with_f16_reference(const Ctx& c) {
  std::vector<FormatRun> all;
  all.push_back(FormatRun{"f16", f16_reference(c.o.kv, c.m), 0, {}});
  for (const auto& r : c.runs) all.push_back(FormatRun{r.name, r.kv, 0, {}});
  return all;
}

// Which trials a format lost or gained against the f16 cache on the same trials, and whether the
// difference is more than chance (exact sign test over the discordant trials).
nlohmann::json vs_f16(const std::vector<bool>& ref_ok, const std::vector<bool>& ok) {
  const PairedOutcome po = eval_paired(ref_ok, ok);
  return {{"lost", po.lost}, {"gained", po.gained}, {"p_value", po.p_value}};
}

constexpr const char* kNeedleQuestion = "\nWhat is the secret passcode mentioned in the text above? The secret passcode is";
std::string needle_sentence(const std::string& code) { return " The secret passcode is " + code + ". Remember it. "; }

// The haystack tokens of a trial at context ctx whose needle has needle_tokens tokens; fails when
// the context cannot hold the needle and question or the haystack is too short.
int needle_hay_len(int ctx, size_t needle_tokens, size_t question_tokens, size_t hay_tokens) {
  const int hay_len = ctx - int(needle_tokens + question_tokens) - 1 - (kNeedleAnswerTokens + 2);
  if (hay_len < 16) fail("needle: context {} is too short for the needle and question", ctx);
  if (size_t(hay_len) > hay_tokens)
    fail("needle: the haystack has {} tokens, fewer than the {} needed for context {}", hay_tokens, hay_len, ctx);
  return hay_len;
}

void task_needle(Ctx& c, const std::vector<int32_t>& hay_ids) {
  std::mt19937 rng(4242);
  const std::vector<int32_t> q_ids = c.tok.encode(kNeedleQuestion, false);
  const int trials = c.o.needles;
  size_t total = c.ctxs.size() * c.o.depths.size() * size_t(trials) * (c.runs.size() + 1);
  Progress prog(c.o.progress, total);
  Forward fwd(c.m, c.pool, 256);
  const std::vector<FormatRun> all = with_f16_reference(c);
  std::vector<nlohmann::json> grids(all.size(), nlohmann::json::array());
  // --needle-set-out: the trials as an own-task eval set (the path was checked before the model loaded).
  // Written whole at the end: a failed run leaves an existing file as it was.
  std::optional<ReportFile> set_out;
  if (!c.o.needle_set_out.empty()) set_out.emplace("--needle-set-out", c.o.needle_set_out);
  for (int ctx : c.ctxs) {
    use_context(c, ctx);
    for (int depth : c.o.depths) {
      for (int k = 0; k < trials; ++k) {
        const std::string code = std::to_string(100000 + rng() % 900000);
        const std::vector<int32_t> needle = c.tok.encode(needle_sentence(code), false);
        const int hay_len = needle_hay_len(ctx, needle.size(), q_ids.size(), hay_ids.size());
        const size_t spare = hay_ids.size() - size_t(hay_len);
        const size_t off = trials > 1 ? spare * size_t(k) / size_t(trials - 1) : 0;
        const auto hay = hay_ids.begin() + std::ptrdiff_t(off);
        std::vector<int32_t> prompt;
        if (c.tok.add_bos()) prompt.push_back(c.tok.bos());
        const size_t at = size_t(double(hay_len) * depth / 100.0);
        prompt.insert(prompt.end(), hay, hay + std::ptrdiff_t(at));
        prompt.insert(prompt.end(), needle.begin(), needle.end());
        prompt.insert(prompt.end(), hay + std::ptrdiff_t(at), hay + hay_len);
        prompt.insert(prompt.end(), q_ids.begin(), q_ids.end());
        if (set_out) {
          // The text (without BOS) for engines that tokenize it themselves; the exact tokens for
          // --task own, which then reproduces this trial bit for bit.
          const bool bos = c.tok.add_bos();
          const std::vector<int32_t> body(prompt.begin() + (bos ? 1 : 0), prompt.end());
          const nlohmann::json line = {{"prompt", c.tok.decode(body)}, {"prompt_tokens", prompt},
                                       {"expected", code},           {"match", "substring"},
                                       {"max_tokens", kNeedleAnswerTokens}, {"ctx", ctx},
                                       {"depth", depth},             {"trial", k},
                                       {"haystack_offset", off}};
          set_out->write(line.dump() + "\n");
        }
        for (size_t f = 0; f < all.size(); ++f) {
          auto cache = make_cache(c, all[f], int(prompt.size()) + kNeedleAnswerTokens + 2);
          const std::string ans = greedy_generate(c, fwd, *cache, prompt, kNeedleAnswerTokens);
          const bool ok = ans.find(code) != std::string::npos;
          grids[f].push_back({{"ctx", ctx}, {"depth", depth}, {"trial", k}, {"haystack_offset", off}, {"ok", ok},
                              {"answer", ans}});
          prog.step(fmt::format("needle ctx {} depth {} trial {} {}", ctx, depth, k, all[f].name));
        }
      }
    }
  }
  if (set_out) set_out->commit();
  auto oks = [&](size_t f) {
    std::vector<bool> v;
    for (const auto& g : grids[f]) v.push_back(g["ok"].get<bool>());
    return v;
  };
  const std::vector<bool> ref_ok = oks(0);
  for (size_t f = 0; f < all.size(); ++f) {
    int ok = 0;
    for (const auto& g : grids[f]) ok += g["ok"].get<bool>() ? 1 : 0;
    nlohmann::json r = {{"grid", grids[f]}, {"accuracy", grids[f].empty() ? 0.0 : double(ok) / double(grids[f].size())}};
    if (f == 0) {
      for (auto& run : c.runs) {
        run.report["needle_f16"] = r["accuracy"];
        run.report["needle_f16_ok"] = ref_ok;
      }
    } else {
      r["vs_f16"] = vs_f16(ref_ok, oks(f));
      c.runs[f - 1].report["needle"] = r;
    }
  }
}

// ---- own: the user's JSONL eval set.
struct OwnCase {
  std::string prompt, expected, match;
  std::vector<int32_t> tokens;  // "prompt_tokens": used as is (no template, no tokenization) when given
  int max_tokens = 0;           // "max_tokens": this case's answer length (0: --max-tokens)
  int line = 0;
  std::string opening = {};     // with --chat, what the rendered prompt wrote of the reply ('<think>\n')
};

std::vector<OwnCase> load_own(const std::string& path) {
  std::vector<OwnCase> cases;
  jsonl_for_each(path, "--own", [&](const nlohmann::json& j, int ln) {
    if (!j.is_object() || !j.contains("prompt") || !j["prompt"].is_string() || !j.contains("expected") || !j["expected"].is_string())
      fail("--own {}:{}: each line needs string fields \"prompt\" and \"expected\"", path, ln);
    if (j.contains("match") && !j["match"].is_string())
      fail("--own {}:{}: \"match\" must be the string \"substring\" or \"exact\"", path, ln);
    OwnCase c{j["prompt"], j["expected"], j.value("match", std::string("substring")), {}, 0, ln, {}};
    if (c.match != "substring" && c.match != "exact")
      fail("--own {}:{}: \"match\" must be \"substring\" or \"exact\", not \"{}\"", path, ln, c.match);
    if (c.match == "substring" && c.expected.empty())
      fail("--own {}:{}: an empty \"expected\" is a substring of every output (the case could not fail)", path, ln);
    if (j.contains("prompt_tokens")) {
      const auto& t = j["prompt_tokens"];
      if (!t.is_array() || t.empty())
        fail("--own {}:{}: \"prompt_tokens\" must be a non-empty array of token ids", path, ln);
      for (const auto& id : t) {
        if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > std::numeric_limits<int32_t>::max())
          fail("--own {}:{}: \"prompt_tokens\" must hold non-negative integer token ids", path, ln);
        c.tokens.push_back(id.get<int32_t>());
      }
    }
    if (j.contains("max_tokens")) {
      const auto& m = j["max_tokens"];
      if (!m.is_number_integer() || m.get<int64_t>() < 1 || m.get<int64_t>() > 4096)
        fail("--own {}:{}: \"max_tokens\" must be an integer in [1, 4096]", path, ln);
      c.max_tokens = m.get<int>();
    }
    cases.push_back(std::move(c));
  });
  if (cases.empty()) fail("--own {}: no eval cases (empty file)", path);
  return cases;
}

// ---- layers: for each layer L and side (K or V), only that layer's K (or V) uses the format and
// everything else stays f16, so layer L sees exactly the f16 run's inputs; the relative error of
// its attention output against the f16 run is the layer's sensitivity to quantizing that side.
void task_layers(Ctx& c, const std::vector<int32_t>& text_ids) {
  const ModelConfig& cfg = c.m.config();
  const int ctx = c.ctxs.front();
  use_context(c, ctx);
  if (size_t(ctx) > text_ids.size()) fail("--data has {} tokens, fewer than the {} of --ctx", text_ids.size(), ctx);
  std::vector<int32_t> win(text_ids.begin(), text_ids.begin() + ctx);
  if (c.tok.add_bos()) win[0] = c.tok.bos();
  const size_t row = size_t(cfg.n_head) * size_t(cfg.head_dim);
  Forward fwd(c.m, c.pool, 256);
  // f16 reference: every layer's attention output
  std::vector<std::vector<float>> ref(size_t(cfg.n_layer));
  const FormatRun base{"f16", f16_reference(c.o.kv, c.m), 0, {}};
  fwd.on_attn = [&](int il, int n, const float* a) { ref[size_t(il)].insert(ref[size_t(il)].end(), a, a + size_t(n) * row); };
  {
    auto cache = make_cache(c, base, ctx);
    fwd.eval(win.data(), ctx, *cache);
  }
  Progress prog(c.o.progress, c.runs.size() * size_t(cfg.n_layer) * 2);
  for (auto& r : c.runs) {
    nlohmann::json layers = nlohmann::json::array();
    for (int il = 0; il < cfg.n_layer; ++il) {
      nlohmann::json e = {{"layer", il}, {"sliding", bool(cfg.layer_sliding[size_t(il)])}};
      for (int side = 0; side < 2; ++side) {
        FormatRun one = base;
        auto& lf = one.kv.policy.layers[size_t(il)];
        (side == 0 ? lf.k_codec : lf.v_codec) = side == 0 ? r.kv.policy.layers[size_t(il)].k_codec : r.kv.policy.layers[size_t(il)].v_codec;
        one.kv.calib = r.kv.calib;
        double num = 0, den = 0;
        size_t off = 0;
        fwd.on_attn = [&](int l, int n, const float* a) {
          if (l != il) return;
          const float* b = ref[size_t(il)].data() + off;
          for (size_t i = 0; i < size_t(n) * row; ++i) {
            num += double(a[i] - b[i]) * double(a[i] - b[i]);
            den += double(b[i]) * double(b[i]);
          }
          off += size_t(n) * row;
        };
        auto cache = make_cache(c, one, ctx);
        fwd.eval(win.data(), ctx, *cache);
        e[side == 0 ? "k_rel_err" : "v_rel_err"] = den > 0 ? std::sqrt(num / den) : 0.0;
        prog.step(fmt::format("layers {} L{} {}", r.name, il, side == 0 ? "K" : "V"));
      }
      layers.push_back(e);
    }
    r.report["layers"] = {{"ctx", ctx}, {"per_layer", layers}};
  }
  fwd.on_attn = nullptr;
}

// ---- the per-layer policy under a bit budget (--budget-bits), from task_layers' errors: each
// (layer, side) is an item whose options are the formats under test, each with its bits per element
// on that side and the squared relative error it gave there. A greedy multiple-choice knapsack:
// every item starts at its cheapest option and the upgrade with the largest error reduction per bit
// is taken while the average stays within the budget. Errors of different layers add as
// independent noise would (squared), which is what the layers task measures one at a time.
struct LayerPolicy {
  std::vector<int> k_choice, v_choice;  // per layer: index into the runs
  double bits = 0;                      // average bits per element over both sides
  double err2 = 0;                      // summed squared relative errors
};

LayerPolicy choose_layer_policy(const std::vector<FormatRun>& runs, const std::vector<double>& k_bits,
                                const std::vector<double>& v_bits, int n_layer, double budget) {
  struct Item {
    int layer, side;
    std::vector<int> opts;  // run indices by increasing bits (ties: lower error first)
    int at = 0;
  };
  auto err2 = [&](int f, int l, int side) {
    const double e = runs[size_t(f)].report["layers"]["per_layer"][size_t(l)][side == 0 ? "k_rel_err" : "v_rel_err"];
    return e * e;
  };
  auto bits = [&](int f, int side) { return side == 0 ? k_bits[size_t(f)] : v_bits[size_t(f)]; };
  std::vector<Item> items;
  for (int l = 0; l < n_layer; ++l)
    for (int side = 0; side < 2; ++side) {
      Item it{l, side, {}, 0};
      for (int f = 0; f < int(runs.size()); ++f) it.opts.push_back(f);
      std::sort(it.opts.begin(), it.opts.end(), [&](int a, int b) {
        return bits(a, side) != bits(b, side) ? bits(a, side) < bits(b, side) : err2(a, l, side) < err2(b, l, side);
      });
      items.push_back(it);
    }
  const double n_items = double(items.size());
  double total = 0;
  for (const auto& it : items) total += bits(it.opts[0], it.side);
  if (total / n_items > budget + 1e-9)
    fail("--budget-bits {}: below the cheapest choice, {:.2f} bits per element", budget, total / n_items);
  for (;;) {
    int best = -1, best_to = -1;
    double best_ratio = 0;
    for (int i = 0; i < int(items.size()); ++i) {
      const Item& it = items[size_t(i)];
      const int cur = it.opts[size_t(it.at)];
      for (int j = it.at + 1; j < int(it.opts.size()); ++j) {
        const int f = it.opts[size_t(j)];
        const double db = bits(f, it.side) - bits(cur, it.side);
        const double de = err2(cur, it.layer, it.side) - err2(f, it.layer, it.side);
        if (de <= 0 || (total + db) / n_items > budget + 1e-9) continue;
        const double ratio = db > 0 ? de / db : std::numeric_limits<double>::infinity();
        if (ratio > best_ratio) {
          best_ratio = ratio;
          best = i;
          best_to = j;
        }
      }
    }
    if (best < 0) break;
    Item& it = items[size_t(best)];
    total += bits(it.opts[size_t(best_to)], it.side) - bits(it.opts[size_t(it.at)], it.side);
    it.at = best_to;
  }
  LayerPolicy p;
  p.k_choice.assign(size_t(n_layer), 0);
  p.v_choice.assign(size_t(n_layer), 0);
  for (const auto& it : items) {
    const int f = it.opts[size_t(it.at)];
    (it.side == 0 ? p.k_choice : p.v_choice)[size_t(it.layer)] = f;
    p.err2 += err2(f, it.layer, it.side);
  }
  p.bits = total / n_items;
  return p;
}

// Tokenizes the cases that have no "prompt_tokens" (through the chat template with --chat) and
// checks every case against the model, so that a bad case fails before any model time is spent.
void prepare_own(std::vector<OwnCase>& cases, const EvalOptions& o, const Model& m, const Tokenizer& tok) {
  const ChatTemplate tpl = o.chat ? chat_template_detect(m.file(), read_chat_template_file(o.chat_template_file)) : ChatTemplate{};
  if (o.chat && !tpl.known()) fail("--chat: the model has no chat template kvq supports");
  ChatRenderOptions ro;
  ro.thinking = chat_template_kwargs_flag(o.chat_template_kwargs);
  for (OwnCase& oc : cases) {
    if (oc.tokens.empty()) {
      const std::string text = o.chat ? chat_render(tpl, {{"user", oc.prompt}}, ro) : oc.prompt;
      oc.tokens = tok.encode(text, true, o.chat);
      if (o.chat) oc.opening = chat_reply_opening(tpl, text);
    }
    for (int32_t id : oc.tokens)
      if (id >= tok.n_vocab())
        fail("--own line {}: prompt token {} is outside the model's vocabulary of {}", oc.line, id, tok.n_vocab());
    const int max_tokens = oc.max_tokens > 0 ? oc.max_tokens : o.max_tokens;
    if (int64_t(oc.tokens.size()) + max_tokens > m.config().n_ctx_train)
      fail("--own line {}: a prompt of {} tokens and {} answer tokens do not fit the model's context of {}", oc.line,
           oc.tokens.size(), max_tokens, m.config().n_ctx_train);
  }
}

// cases: after prepare_own.
void task_own(Ctx& c, const std::vector<OwnCase>& cases) {
  // at the longest --ctx, or the trained context without one (as kvq run without --ctx-size)
  use_context(c, c.ctxs.empty() ? 0 : *std::max_element(c.ctxs.begin(), c.ctxs.end()));
  // Like needle: the f16 cache runs the same cases first, and each format reports the cases it
  // lost and gained against it (a replayed needle set gives the needle task's table).
  const std::vector<FormatRun> all = with_f16_reference(c);
  Progress prog(c.o.progress, cases.size() * all.size());
  Forward fwd(c.m, c.pool, 256);
  std::vector<bool> ref_ok;
  // A harmony model's reply (gpt-oss) is matched on its answer, the final channel, not on its
  // reasoning; a reasoning template's (<think>) on what follows its reasoning
  const ChatTemplate tpl = c.o.chat ? chat_template_detect(c.m.file(), read_chat_template_file(c.o.chat_template_file)) : ChatTemplate{};
  const bool split = c.o.chat && chat_reasons(tpl);
  for (size_t f = 0; f < all.size(); ++f) {
    std::vector<bool> oks;
    nlohmann::json items = nlohmann::json::array();
    for (const auto& oc : cases) {
      const std::vector<int32_t>& ids = oc.tokens;
      const int max_tokens = oc.max_tokens > 0 ? oc.max_tokens : c.o.max_tokens;
      auto cache = make_cache(c, all[f], int(ids.size()) + max_tokens + 2);
      const ReasoningBudget budget =
          c.o.chat ? chat_reasoning_budget(tpl, c.o.reasoning_budget, c.o.reasoning_budget_message, oc.opening, false)
                   : ReasoningBudget{};
      const std::string out = greedy_generate(c, fwd, *cache, ids, max_tokens, budget);
      const std::string answer = split ? chat_reply_splitter(tpl)->split_after(oc.opening, out).content : out;
      const bool hit = oc.match == "exact" ? trim(answer) == trim(oc.expected) : answer.find(oc.expected) != std::string::npos;
      oks.push_back(hit);
      items.push_back({{"prompt", oc.prompt}, {"expected", oc.expected}, {"output", out}, {"ok", hit}});
      if (split) items.back()["answer"] = answer;
      prog.step("own " + all[f].name);
    }
    const double acc = double(std::count(oks.begin(), oks.end(), true)) / double(cases.size());
    if (f == 0) {
      ref_ok = oks;
      for (auto& run : c.runs) {
        run.report["own_f16"] = acc;
        run.report["own_f16_ok"] = ref_ok;
      }
    } else {
      c.runs[f - 1].report["own"] = {{"accuracy", acc}, {"n", cases.size()}, {"items", items}, {"vs_f16", vs_f16(ref_ok, oks)}};
    }
  }
}

}  // namespace

int eval_command(const EvalOptions& o) {
  for (const auto& t : o.tasks)
    if (t != "ppl" && t != "needle" && t != "own" && t != "layers")
      fail("--task: unknown task '{}' (valid: ppl, needle, layers, own)", t);
  auto has = [&](const char* t) { return std::find(o.tasks.begin(), o.tasks.end(), t) != o.tasks.end(); };
  if ((has("ppl") || has("needle") || has("layers")) && o.ctx.empty()) fail("--ctx is required for tasks ppl, needle and layers");
  if ((has("ppl") || has("layers")) && o.data.empty()) fail("--data is required for tasks ppl and layers");
  if (has("needle") && o.data.empty() && o.haystack.empty()) fail("--haystack (or --data) is required for task needle");
  if (has("own") && o.own.empty()) fail("--own FILE.jsonl is required for task own");
  if (!o.needle_set_out.empty() && !has("needle")) fail("--needle-set-out writes the trials of task needle: add --task needle");
  for (int d : o.depths)
    if (d < 0 || d > 100) fail("--depths: {} is not a percentage in [0, 100]", d);
  for (double b : o.budget_bits)
    if (!std::isfinite(b)) fail("--budget-bits: {} is not a number of bits in [1, 32]", b);

  auto model = o.f32_weights ? Model::load_f32(o.model, o.kv.rope) : Model::load(o.model, o.kv.rope);
  const ModelConfig& cfg = model->config();
  Tokenizer tok = Tokenizer::from_gguf(model->file());
  std::vector<int> ctxs;
  for (const auto& s : o.ctx) {
    const int64_t v = plan_parse_count(s, "--ctx");
    if (v < 16) fail("--ctx: {} is too short (minimum 16)", v);
    if (v > cfg.n_ctx_train) fail("--ctx: {} exceeds the model's context length {}", v, cfg.n_ctx_train);
    if (std::find(ctxs.begin(), ctxs.end(), int(v)) != ctxs.end()) fail("--ctx: {} is given twice", v);
    ctxs.push_back(int(v));
  }
  // The RoPE factors of the longest context asked (LongRoPE models; each task then takes its own
  // context's, use_context); the formats' calibration is checked against these.
  const int ctx_max = ctxs.empty() ? 0 : *std::max_element(ctxs.begin(), ctxs.end());
  model->set_context(ctx_max);
  if (const std::string note = model_rope_note(cfg, ctx_max); !note.empty()) std::fprintf(stderr, "%s\n", note.c_str());
  std::vector<FormatRun> runs;
  for (const auto& f : o.formats) {
    FormatRun r;
    r.kv = kv_flags_resolve(o.kv, *model, f);
    kv_flags_warn_unused(o.kv, r.kv, *model);
    r.name = r.kv.policy.name;
    KvCacheConfig kc = model->kv_cache_config(r.kv.policy, 64, o.kv.page_tokens);
    r.kv.apply(kc);
    KvCache probe(kc);  // validates the codecs for this model now, not mid-run
    r.bits_per_element = bits_per_element(probe, cfg);
    runs.push_back(std::move(r));
  }
  {  // output paths too: before the runs, not after them; none may be an input or another output
    const std::vector<ReportPath> inputs = {{"the model (-m)", o.model},           {"the text (--data)", o.data},
                                            {"the haystack (--haystack)", o.haystack}, {"the eval set (--own)", o.own},
                                            {"the calibration (--kv-scales)", o.kv.scales_file}};
    auto others = [&](std::vector<ReportPath> outs) {
      outs.insert(outs.begin(), inputs.begin(), inputs.end());
      return outs;
    };
    report_check_writable("--json-out", o.json_out,
                          others({{"--needle-set-out", o.needle_set_out}, {"--html", o.html}}));
    report_check_writable("--needle-set-out", o.needle_set_out, others({{"--html", o.html}}));
    report_check_writable("--html", o.html, inputs);
  }
  // the own-set file is validated before any model time is spent
  std::vector<OwnCase> own_cases;
  if (has("own")) {
    own_cases = load_own(o.own);
    prepare_own(own_cases, o, *model, tok);
  }
  // The texts, read and checked against every context before any task runs.
  std::vector<int32_t> text_ids, hay_ids;
  if (has("ppl") || has("layers")) text_ids = tok.encode(read_text_file(o.data, "--data"), false);
  if (has("needle")) {
    hay_ids = o.haystack.empty() && !text_ids.empty()
                  ? text_ids
                  : tok.encode(read_text_file(o.haystack.empty() ? o.data : o.haystack, "--haystack"), false);
    const size_t q_tokens = tok.encode(kNeedleQuestion, false).size();
    const size_t n_tokens = tok.encode(needle_sentence("100000"), false).size();  // a six-digit passcode's needle
    for (int ctx : ctxs) needle_hay_len(ctx, n_tokens, q_tokens, hay_ids.size());
  }
  for (int ctx : ctxs) {
    if (has("ppl") && size_t(ctx) * size_t(o.chunks) > text_ids.size())
      fail("--data has {} tokens, fewer than {} window(s) of {} tokens", text_ids.size(), o.chunks, ctx);
    if (has("layers") && size_t(ctx) > text_ids.size())
      fail("--data has {} tokens, fewer than the {} of --ctx", text_ids.size(), ctx);
  }

  if (!o.budget_bits.empty() && !has("layers")) fail("--budget-bits needs --task layers (its per-layer errors)");
  if (!o.chat_template_file.empty() && !o.chat) fail("--chat-template-file needs --chat");
  if (!o.chat_template_kwargs.empty() && !o.chat) fail("--chat-template-kwargs needs --chat");
  if ((o.reasoning_budget >= 0 || !o.reasoning_budget_message.empty()) && !(o.chat && has("own")))
    fail("--reasoning-budget and --reasoning-budget-message need --task own with --chat");
  // Bits per element of each format's K side and V side alone (the other side f16: 16 bits).
  std::vector<double> k_bits, v_bits;
  if (!o.budget_bits.empty()) {
    const KvSetup f16 = f16_reference(o.kv, *model);
    for (const auto& r : runs)
      for (int side = 0; side < 2; ++side) {
        KvSetup one = f16;
        for (int l = 0; l < cfg.n_layer; ++l)
          (side == 0 ? one.policy.layers[size_t(l)].k_codec : one.policy.layers[size_t(l)].v_codec) =
              side == 0 ? r.kv.policy.layers[size_t(l)].k_codec : r.kv.policy.layers[size_t(l)].v_codec;
        one.calib = r.kv.calib;
        KvCacheConfig kc = model->kv_cache_config(one.policy, 64, o.kv.page_tokens);
        one.apply(kc);
        KvCache probe(kc);
        (side == 0 ? k_bits : v_bits).push_back(2 * bits_per_element(probe, cfg) - 16);
      }
  }

  // A budget below every layer's cheapest K and V is rejected before any model time is spent.
  if (!o.budget_bits.empty()) {
    const double least = (*std::min_element(k_bits.begin(), k_bits.end()) + *std::min_element(v_bits.begin(), v_bits.end())) / 2;
    for (double b : o.budget_bits)
      if (b < least - 1e-9) fail("--budget-bits {}: below the cheapest choice, {:.2f} bits per element", b, least);
  }

  const int threads = resolve_threads(o.threads);
  ThreadPool pool(threads);
  Ctx c{o, *model, tok, pool, runs, ctxs};
  // layers first: with --budget-bits its policies join the formats the other tasks evaluate.
  nlohmann::json policies = nlohmann::json::array();
  if (has("layers")) {
    task_layers(c, text_ids);
    const size_t n_measured = runs.size();
    for (double budget : o.budget_bits) {
      const std::vector<FormatRun> measured(runs.begin(), runs.begin() + std::ptrdiff_t(n_measured));
      const LayerPolicy lp = choose_layer_policy(measured, k_bits, v_bits, cfg.n_layer, budget);
      FormatRun pr;
      pr.kv = runs.front().kv;
      std::string flags;
      nlohmann::json layers = nlohmann::json::array();
      for (int l = 0; l < cfg.n_layer; ++l) {
        const FormatRun& kr = runs[size_t(lp.k_choice[size_t(l)])];
        const FormatRun& vr = runs[size_t(lp.v_choice[size_t(l)])];
        pr.kv.policy.layers[size_t(l)].k_codec = kr.kv.policy.layers[size_t(l)].k_codec;
        pr.kv.policy.layers[size_t(l)].v_codec = vr.kv.policy.layers[size_t(l)].v_codec;
        flags += fmt::format("{}--kv-layer {}={}/{}", flags.empty() ? "" : " ", l, kr.name, vr.name);
        layers.push_back({{"layer", l}, {"k", kr.name}, {"v", vr.name}});
      }
      pr.name = pr.kv.policy.name = fmt::format("policy@{:g}", budget);
      KvCacheConfig kc = model->kv_cache_config(pr.kv.policy, 64, o.kv.page_tokens);
      pr.kv.apply(kc);
      KvCache probe(kc);
      pr.bits_per_element = bits_per_element(probe, cfg);
      policies.push_back({{"budget_bits", budget}, {"bits_per_element", lp.bits}, {"sum_sq_rel_err", lp.err2},
                          {"layers", layers}, {"flags", flags}, {"format", pr.name}});
      runs.push_back(std::move(pr));
    }
  }
  if (has("ppl")) task_ppl(c, text_ids);
  if (has("needle")) task_needle(c, hay_ids);
  if (has("own")) task_own(c, own_cases);

  // cpu: the kernels' SIMD level (rounding of the integer-dot kernels differs by level, within bounds)
  nlohmann::json j = {{"model", cfg.name}, {"model_file", o.model}, {"arch", cfg.arch}, {"cpu", cpu_level_name(cpu_level())},
                      {"tasks", o.tasks}, {"scale_mode", o.scale_mode}};
  // where the formats' calibration came from (--kv-scales: a file, or qk-norm), null without one
  j["kv_scales"] = o.kv.scales_file.empty() ? nlohmann::json() : nlohmann::json(o.kv.scales_file);
  if (!policies.empty()) j["policies"] = policies;
  j["formats"] = nlohmann::json::array();
  for (auto& r : runs) {
    nlohmann::json f = r.report;
    f["format"] = r.name;
    f["bits_per_element"] = r.bits_per_element;
    if (!f.contains("buckets")) f["buckets"] = nlohmann::json::array();
    j["formats"].push_back(f);
  }
  if (!o.json_out.empty()) report_write("--json-out", o.json_out, j.dump(2) + "\n");
  if (!o.html.empty()) report_write("--html", o.html, report_html(j));
  if (o.json) {
    std::printf("%s\n", j.dump(2).c_str());
    return 0;
  }
  std::printf("model %s (%s)\n", cfg.name.c_str(), o.model.c_str());
  if (has("ppl")) {
    if (o.scale_mode == "static-prefill")
      std::printf("scale mode static-prefill: int8/fp8 scales fixed from each window's first half, reused for the scored half\n");
    std::printf("\n%-28s %6s %7s %10s %10s %9s %11s %11s %8s\n", "format", "bits", "ctx", "ppl", "f16 ppl", "dPPL %", "KLD mean", "KLD p99", "top1");
    for (const auto& r : runs)
      for (const auto& b : r.report["buckets"])
        std::printf("%-28s %6.2f %7d %10.4f %10.4f %+9.3f %11.6f %11.6f %7.2f%%\n", r.name.c_str(),
                    b.value("bits_per_element", r.bits_per_element),
                    b["ctx"].get<int>(), b["ppl"].get<double>(), b["base_ppl"].get<double>(), b["delta_ppl_pct"].get<double>(),
                    b["kld_mean"].get<double>(), b["kld_p99"].get<double>(), 100 * b["top1_agree"].get<double>());
  }
  if (has("needle")) {
    std::printf("\nneedle retrieval (lost / gained: trials f16 found and the format missed / the reverse; p: exact\n"
                "sign test of that split, small = a real difference)\n");
    std::printf("%-28s accuracy %3.0f%%  [", "f16", 100 * runs.front().report.value("needle_f16", 0.0));
    for (bool ok : runs.front().report["needle_f16_ok"]) std::printf("%s", ok ? "+" : ".");
    std::printf("]\n");
    for (const auto& r : runs) {
      const auto& nd = r.report["needle"];
      std::printf("%-28s accuracy %3.0f%%  [", r.name.c_str(), 100 * nd["accuracy"].get<double>());
      for (const auto& g : nd["grid"]) std::printf("%s", g["ok"].get<bool>() ? "+" : ".");
      std::printf("]  lost %d gained %d p %.3g\n", nd["vs_f16"]["lost"].get<int>(), nd["vs_f16"]["gained"].get<int>(),
                  nd["vs_f16"]["p_value"].get<double>());
    }
  }
  if (has("layers")) {
    std::printf("\nper-layer relative error of the attention output (only that layer's K or V quantized, ctx %d)\n", ctxs.front());
    for (const auto& r : runs) {
      if (!r.report.contains("layers")) continue;  // the --budget-bits policy
      std::printf("%-28s", r.name.c_str());
      for (const auto& e : r.report["layers"]["per_layer"])
        std::printf(" L%d K%.3f/V%.3f", e["layer"].get<int>(), e["k_rel_err"].get<double>(), e["v_rel_err"].get<double>());
      std::printf("\n");
    }
  }
  for (const auto& pj : policies)
    std::printf("\nper-layer policy within %g bits per element (%.2f bits, summed squared relative error %.4g; "
                "evaluated above as %s):\n  %s\n",
                pj["budget_bits"].get<double>(), pj["bits_per_element"].get<double>(), pj["sum_sq_rel_err"].get<double>(),
                pj["format"].get<std::string>().c_str(), pj["flags"].get<std::string>().c_str());
  if (has("own")) {
    std::printf("\nown eval set (%zu cases; lost / gained against the f16 cache, as for needle)\n", own_cases.size());
    std::printf("%-28s accuracy %.1f%%\n", "f16", 100 * runs.front().report.value("own_f16", 0.0));
    for (const auto& r : runs) {
      const auto& v = r.report["own"]["vs_f16"];
      std::printf("%-28s accuracy %.1f%%  lost %d gained %d p %.3g\n", r.name.c_str(),
                  100 * r.report["own"]["accuracy"].get<double>(), v["lost"].get<int>(), v["gained"].get<int>(),
                  v["p_value"].get<double>());
    }
  }
  return 0;
}

}  // namespace kvq
