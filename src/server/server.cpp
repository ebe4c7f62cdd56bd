#include "server/server.h"

#include <dirent.h>
#include <httplib.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <climits>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <future>
#include <nlohmann/json.hpp>
#include <numeric>
#include <random>
#include <thread>
#include <unordered_map>

#include "core/error.h"
#include "core/timer.h"
#include "model/chat.h"
#include "server/anthropic.h"
#include "server/responses.h"
#include "server/harmony_tools.h"
#include "server/qwen_tools.h"
#include "server/tools.h"

namespace kvq {

using json = nlohmann::json;

namespace {

// A request the client got wrong: 400 with an OpenAI-style error body.
struct ApiError {
  ApiError(std::string m, std::string p, std::string c = "", int s = 400)
      : message(std::move(m)), param(std::move(p)), code(std::move(c)), status(s) {}
  std::string message;
  std::string param;  // empty: null
  std::string code;   // empty: null
  int status = 400;
  // context_length_exceeded: the prompt's tokens, max_tokens (-1: the prompt alone is too long)
  // and the limit (the context, or the KV pool), which Anthropic's clients read from its message
  int prompt_tokens = -1, max_tokens = -1, limit = -1;
};

ApiError context_error(std::string message, std::string param, int prompt_tokens, int max_tokens, size_t limit) {
  ApiError e{std::move(message), std::move(param), "context_length_exceeded"};
  e.prompt_tokens = prompt_tokens;
  e.max_tokens = max_tokens;
  e.limit = int(limit);
  return e;
}

json error_body(const std::string& message, const std::string& type, const std::string& param, const std::string& code) {
  json e = {{"message", message}, {"type", type}, {"param", nullptr}, {"code", nullptr}};
  if (!param.empty()) e["param"] = param;
  if (!code.empty()) e["code"] = code;
  return json{{"error", e}};
}

void send_json(httplib::Response& res, int status, const json& j) {
  res.status = status;
  res.set_content(j.dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
}

void send_error(httplib::Response& res, const ApiError& e) {
  send_json(res, e.status, error_body(e.message, e.status >= 500 ? "server_error" : "invalid_request_error", e.param, e.code));
}

// Request fields shared by both endpoints.
struct ApiRequest {
  GenParams params;
  bool stream = false;
  bool include_usage = false;
  bool max_tokens_set = false;
  bool unlimited = false;  // max_tokens -1: up to the context
  bool echo = false;  // completions: the prompt's text (and log-probabilities) before the completion
  int n = 1;          // choices: n sequences of the same prompt (seeds seed, seed + 1, ...)
  std::string constraint;      // the parameter that constrains the output (empty: none)
  std::string schema_pointer;  // response_format json_schema: where its schema is in the body
  int truncate_prompt_tokens = 0;  // > 0: a prompt keeps its last that many tokens; -1: what fits
  int vllm_prompt_logprobs = -1;   // vLLM's prompt_logprobs: >= 0, that many alternatives per prompt token
};

constexpr int kMaxChoices = 128;     // n, and prompts in a completions batch
constexpr int kMaxBodyDepth = 512;   // arrays and objects nested in a request body
constexpr int kMaxSequences = 1024;  // prompts x n

// raw: the body's text, from which a json_schema is read again keeping its properties' written
// order (the order they are generated in; json sorts an object's keys).
ApiRequest parse_common(const json& body, std::string_view raw) {
  ApiRequest r;
  SamplerParams& s = r.params.sampling;
  // OpenAI semantics: plain temperature / top_p sampling, no top-k or min-p unless asked.
  s.temperature = 1.0f;
  s.top_p = 1.0f;
  s.top_k = 0;
  s.min_p = 0.0f;
  s.repeat_penalty = 1.0f;
  s.seed = std::random_device{}();
  auto number = [&](const char* key, double lo, double hi) -> std::optional<double> {
    if (!body.contains(key) || body[key].is_null()) return std::nullopt;
    const json& v = body[key];
    if (!v.is_number()) throw ApiError{fmt::format("'{}' must be a number", key), key};
    const double x = v.get<double>();
    if (!(x >= lo && x <= hi)) throw ApiError{fmt::format("'{}' must be in [{}, {}] (got {})", key, lo, hi, x), key};
    return x;
  };
  if (auto t = number("temperature", 0.0, 2.0)) s.temperature = float(*t);
  // top_p and repetition_penalty must stay > 0 as the floats the sampler uses (1e-300 is 0 there).
  if (auto p = number("top_p", 0.0, 1.0)) {
    if (!(float(*p) > 0)) throw ApiError{"'top_p' must be > 0", "top_p"};
    s.top_p = float(*p);
  }
  if (auto v = number("presence_penalty", -2.0, 2.0)) s.presence_penalty = float(*v);
  if (auto v = number("frequency_penalty", -2.0, 2.0)) s.frequency_penalty = float(*v);
  if (auto v = number("min_p", 0.0, 1.0)) s.min_p = float(*v);  // vLLM's
  // vLLM's (and transformers'): over the prompt and the generated tokens, > 1 discourages repeats.
  if (auto v = number("repetition_penalty", 0.0, 10.0)) {
    if (!(float(*v) > 0)) throw ApiError{"'repetition_penalty' must be > 0", "repetition_penalty"};
    s.repeat_penalty = float(*v);
    s.repeat_last_n = -1;
  }
  if (body.contains("logit_bias") && !body["logit_bias"].is_null()) {
    const json& lb = body["logit_bias"];
    if (!lb.is_object()) throw ApiError{"'logit_bias' must be an object of token ids to biases", "logit_bias"};
    if (lb.size() > 1024) throw ApiError{"'logit_bias' holds at most 1024 tokens", "logit_bias"};
    for (const auto& [k, v] : lb.items()) {
      char* end = nullptr;
      const long t = std::strtol(k.c_str(), &end, 10);
      // digits only: strtol would also take " 5" and "+5"
      if (k.empty() || k.find_first_not_of("0123456789") != std::string::npos || *end != '\0' || t < 0 ||
          t > INT32_MAX)
        throw ApiError{fmt::format("'logit_bias' keys must be token ids (got '{}')", k), "logit_bias"};
      if (!v.is_number() || !(v.get<double>() >= -100 && v.get<double>() <= 100))
        throw ApiError{fmt::format("'logit_bias' values must be numbers in [-100, 100] (token {})", k), "logit_bias"};
      s.logit_bias.push_back({int32_t(t), v.get<float>()});
    }
  }
  if (body.contains("stop_token_ids") && !body["stop_token_ids"].is_null()) {  // vLLM's
    const json& v = body["stop_token_ids"];
    if (!v.is_array() || v.size() > 64) throw ApiError{"'stop_token_ids' must be an array of at most 64 token ids", "stop_token_ids"};
    for (const auto& t : v) {
      if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() > INT32_MAX)
        throw ApiError{"'stop_token_ids' must hold token ids", "stop_token_ids"};
      r.params.stop_token_ids.push_back(t.get<int32_t>());
    }
  }
  auto flag = [&](const char* key) -> std::optional<bool> {
    if (!body.contains(key) || body[key].is_null()) return std::nullopt;
    if (!body[key].is_boolean()) throw ApiError{fmt::format("'{}' must be a boolean", key), key};
    return body[key].get<bool>();
  };
  if (body.contains("allowed_token_ids") && !body["allowed_token_ids"].is_null()) {  // vLLM's
    const json& v = body["allowed_token_ids"];
    if (!v.is_array() || v.empty()) throw ApiError{"'allowed_token_ids' must be a non-empty array of token ids", "allowed_token_ids"};
    for (const auto& t : v) {
      if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() > INT32_MAX)
        throw ApiError{"'allowed_token_ids' must hold token ids", "allowed_token_ids"};
      s.allowed_tokens.push_back(t.get<int32_t>());
    }
  }
  auto count = [&](const char* key, int64_t lo) -> std::optional<int64_t> {
    if (!body.contains(key) || body[key].is_null()) return std::nullopt;
    const json& v = body[key];
    if (!v.is_number_integer() || (v.is_number_unsigned() ? v.get<uint64_t>() > uint64_t(1) << 30
                                                          : v.get<int64_t>() < lo || v.get<int64_t>() > int64_t(1) << 30))
      throw ApiError{fmt::format("'{}' must be an integer in [{}, {}]", key, lo, int64_t(1) << 30), key};
    return v.get<int64_t>();
  };
  if (auto v = flag("include_stop_str_in_output")) r.params.include_stop_str = *v;  // vLLM's
  if (auto v = count("min_tokens", 0)) r.params.min_tokens = int(*v);                // vLLM's
  // vLLM's: the prompt's last N tokens only (-1: as many as leave room for max_tokens)
  if (auto v = count("truncate_prompt_tokens", -1)) {
    if (*v == 0) throw ApiError{"'truncate_prompt_tokens' must be >= 1 (or -1)", "truncate_prompt_tokens"};
    r.truncate_prompt_tokens = int(*v);
  }
  if (auto v = flag("ignore_eos")) r.params.ignore_eos = *v;  // vLLM's: generate max_tokens
  if (body.contains("top_k") && !body["top_k"].is_null()) {
    const json& v = body["top_k"];
    if (!v.is_number_integer() || (v.is_number_unsigned() ? v.get<uint64_t>() > uint64_t(INT32_MAX)
                                                          : v.get<int64_t>() < -1 || v.get<int64_t>() > INT32_MAX))
      throw ApiError{"'top_k' must be an integer >= 0 (-1 or 0: off)", "top_k"};
    s.top_k = v.get<int>();
  }
  if (body.contains("seed") && !body["seed"].is_null()) {
    if (!body["seed"].is_number_integer()) throw ApiError{"'seed' must be an integer", "seed"};
    s.seed = body["seed"].is_number_unsigned() ? body["seed"].get<uint64_t>() : uint64_t(body["seed"].get<int64_t>());
  }
  // vLLM's priority (lower first; with --scheduling-policy priority, checked by the caller)
  if (body.contains("priority") && !body["priority"].is_null()) {
    const json& v = body["priority"];
    if (!v.is_number_integer() || (v.is_number_unsigned() ? v.get<uint64_t>() > uint64_t(INT32_MAX)
                                                          : v.get<int64_t>() < INT32_MIN || v.get<int64_t>() > INT32_MAX))
      throw ApiError{"'priority' must be an integer", "priority"};
    r.params.priority = v.get<int>();
  }
  for (const char* key : {"max_tokens", "max_completion_tokens"}) {
    if (!body.contains(key) || body[key].is_null()) continue;
    const json& v = body[key];
    if (!v.is_number_integer()) throw ApiError{fmt::format("'{}' must be an integer", key), key};
    const int64_t m = v.get<int64_t>();
    if (m == -1) {  // llama.cpp's (its web UI's default): no limit, up to the context
      r.unlimited = true;
      continue;
    }
    // 0 only with echo and logprobs (scoring a prompt, as evaluation harnesses do): checked by the caller.
    if (m < 0 || m > (int64_t(1) << 30))
      throw ApiError{fmt::format("'{}' must be between 1 and {} (got {})", key, int64_t(1) << 30, m), key};
    r.params.max_tokens = int(m);
    r.max_tokens_set = true;
  }
  if (body.contains("n") && !body["n"].is_null()) {
    const json& v = body["n"];
    if (!v.is_number_integer() || v.get<int64_t>() < 1 || v.get<int64_t>() > kMaxChoices)
      throw ApiError{fmt::format("'n' must be an integer in [1, {}]", kMaxChoices), "n"};
    r.n = v.get<int>();
  }
  if (body.contains("stream") && !body["stream"].is_null()) {
    if (!body["stream"].is_boolean()) throw ApiError{"'stream' must be a boolean", "stream"};
    r.stream = body["stream"].get<bool>();
  }
  if (body.contains("stream_options") && !body["stream_options"].is_null()) {
    const json& so = body["stream_options"];
    if (!so.is_object()) throw ApiError{"'stream_options' must be an object", "stream_options"};
    if (so.contains("include_usage") && !so["include_usage"].is_null()) {
      if (!so["include_usage"].is_boolean())
        throw ApiError{"'stream_options.include_usage' must be a boolean", "stream_options"};
      r.include_usage = so["include_usage"].get<bool>();
    }
  }
  if (body.contains("stop") && !body["stop"].is_null()) {
    const json& st = body["stop"];
    if (st.is_string()) {
      r.params.stop.push_back(st.get<std::string>());
    } else if (st.is_array()) {
      if (st.size() > 16) throw ApiError{"'stop' holds at most 16 strings", "stop"};
      for (const auto& x : st) {
        if (!x.is_string()) throw ApiError{"'stop' must be a string or an array of strings", "stop"};
        r.params.stop.push_back(x.get<std::string>());
      }
    } else {
      throw ApiError{"'stop' must be a string or an array of strings", "stop"};
    }
    std::erase_if(r.params.stop, [](const std::string& x) { return x.empty(); });
  }
  if (body.contains("model") && !body["model"].is_null() && !body["model"].is_string())
    throw ApiError{"'model' must be a string", "model"};
  // Parameters that would change what is generated and that kvq does not implement: refused, so
  // that a client never takes plain sampling for what it asked (metadata such as "user" is ignored).
  auto set = [&](const char* key) { return body.contains(key) && !body[key].is_null(); };
  if (set("response_format")) {
    const json& f = body["response_format"];
    const json* type = f.is_object() && f.contains("type") ? &f["type"] : nullptr;
    if (!type || !type->is_string())
      throw ApiError{"'response_format' must be an object with a string 'type'", "response_format"};
    // A schema: OpenAI's {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}, or
    // llama.cpp's "schema" beside the type ("json_schema" or "json_object").
    const bool in_json_schema = *type == "json_schema" && f.contains("json_schema");
    const bool beside = (*type == "json_schema" || *type == "json_object") && f.contains("schema");
    if (*type == "json_schema" && !in_json_schema && !beside)
      throw ApiError{"'response_format' json_schema needs 'json_schema': {\"name\": ..., \"schema\": {...}}", "response_format"};
    if (in_json_schema || beside) {
      if (in_json_schema && !(f["json_schema"].is_object() && f["json_schema"].contains("schema")))
        throw ApiError{"'response_format.json_schema' must be an object with a 'schema'", "response_format"};
      const nlohmann::ordered_json ordered = nlohmann::ordered_json::parse(raw, nullptr, false);
      const nlohmann::ordered_json::json_pointer at(in_json_schema ? "/response_format/json_schema/schema"
                                                                   : "/response_format/schema");
      if (ordered.is_discarded() || !ordered.contains(at))
        throw ApiError{"'response_format': the schema could not be read from the request body", "response_format"};
      try {
        r.params.grammar = Grammar::from_schema(ordered.at(at));
      } catch (const std::invalid_argument& e) {
        throw ApiError{fmt::format("'response_format': {}", e.what()), "response_format"};
      }
      r.constraint = "response_format";
      r.schema_pointer = at.to_string();
    } else if (*type == "json_object") {
      r.params.json_object = true;
      r.constraint = "response_format";
    } else if (*type != "text") {
      throw ApiError{fmt::format("'response_format' type '{}' is not supported (supported: \"text\", \"json_object\", "
                                 "\"json_schema\")",
                                 type->get<std::string>()),
                     "response_format"};
    }
  }
  // vLLM's structured outputs: {"structured_outputs": {"json" | "regex" | "choice" | "grammar" |
  // "json_object": ...}} (v0.12 on) and the guided_json / guided_regex / guided_choice /
  // guided_grammar parameters before it; and llama.cpp's json_schema (as guided_json) and grammar.
  // A schema is an object or its text; the choice's output is exactly one of its strings; the
  // regex's output matches it whole; a grammar is GBNF.
  struct Guided {
    std::string name;     // as the client wrote it, for errors
    std::string pointer;  // where in the body
    char kind;            // 'j' schema, 'r' regex, 'c' choice, 'g' GBNF, 'o' JSON mode
  };
  std::vector<Guided> guided;
  for (const auto& [key, kind] : {std::pair{"guided_json", 'j'}, {"json_schema", 'j'}, {"guided_regex", 'r'},
                                  {"guided_choice", 'c'}, {"guided_grammar", 'g'}, {"grammar", 'g'}})
    // (llama.cpp's clients may send an empty grammar for none, which its server takes so.)
    if (set(key) && !(std::string_view(key) == "grammar" && body[key] == ""))
      guided.push_back({key, std::string("/") + key, kind});
  if (set("structured_outputs")) {
    const json& so = body["structured_outputs"];
    if (!so.is_object()) throw ApiError{"'structured_outputs' must be an object", "structured_outputs"};
    for (const auto& [k, v] : so.items()) {
      const std::string name = "structured_outputs." + k;
      // Backend settings: kvq has one backend, and leaves out properties a schema does not list unless
      // its additionalProperties allows them. Its JSON allows whitespace between tokens (llama.cpp's
      // rule), so a request for none is refused.
      if (v.is_null() || k == "disable_fallback" || k == "disable_additional_properties") continue;
      if (k == "disable_any_whitespace") {
        if (v == false) continue;
        throw ApiError{fmt::format("'{}' is not supported (kvq's JSON allows whitespace between tokens)", name), name};
      }
      if (k == "json_object" && !v.is_boolean()) throw ApiError{fmt::format("'{}' must be a boolean", name), name};
      const std::string at = "/structured_outputs/" + k;
      if (k == "json") guided.push_back({name, at, 'j'});
      else if (k == "regex") guided.push_back({name, at, 'r'});
      else if (k == "choice") guided.push_back({name, at, 'c'});
      else if (k == "grammar") guided.push_back({name, at, 'g'});
      else if (k == "json_object" && v == true) guided.push_back({name, at, 'o'});
      else if (k == "json_object") continue;
      else if (k == "structural_tag" || k == "whitespace_pattern")
        throw ApiError{fmt::format("'{}' is not supported", name), name};
      else throw ApiError{fmt::format("unknown parameter '{}' (structured_outputs takes json, regex, choice, grammar, json_object)", name), name};
    }
  }
  if (!guided.empty()) {
    const Guided& g = guided.front();
    if (guided.size() > 1 || r.params.grammar || r.params.json_object)
      throw ApiError{"give one of 'response_format' (json_object or json_schema), 'structured_outputs' (one of json, "
                     "regex, choice, grammar, json_object), 'guided_json', 'json_schema', 'guided_regex', 'guided_choice', "
                     "'guided_grammar' and 'grammar'",
                     g.name};
    const json& v = body.at(json::json_pointer(g.pointer));
    r.constraint = g.name;
    try {
      if (g.kind == 'j') {
        if (v.is_string()) {
          r.params.grammar = Grammar::from_schema_text(v.get<std::string>());
        } else {
          const nlohmann::ordered_json ordered = nlohmann::ordered_json::parse(raw, nullptr, false);
          const nlohmann::ordered_json::json_pointer at(g.pointer);
          if (ordered.is_discarded() || !ordered.contains(at))
            throw ApiError{fmt::format("'{}': the schema could not be read from the request body", g.name), g.name};
          r.params.grammar = Grammar::from_schema(ordered.at(at));
        }
      } else if (g.kind == 'r' || g.kind == 'g') {
        if (!v.is_string()) throw ApiError{fmt::format("'{}' must be a string", g.name), g.name};
        r.params.grammar = g.kind == 'r' ? Grammar::from_regex(v.get<std::string>()) : Grammar::from_gbnf(v.get<std::string>());
      } else if (g.kind == 'c') {
        if (!v.is_array()) throw ApiError{fmt::format("'{}' must be a list of strings", g.name), g.name};
        std::vector<std::string> choices;
        for (const json& x : v) {
          if (!x.is_string()) throw ApiError{fmt::format("'{}' must be a list of strings", g.name), g.name};
          choices.push_back(x.get<std::string>());
        }
        r.params.grammar = Grammar::from_choices(choices);
      } else {
        r.params.json_object = true;
      }
    } catch (const std::invalid_argument& e) {
      throw ApiError{fmt::format("'{}': {}", g.name, e.what()), g.name};
    }
  }
  if (set("suffix") && !(body["suffix"].is_string() && body["suffix"].get<std::string>().empty()))
    throw ApiError{"'suffix' (insertion) is not supported", "suffix"};
  // Other servers' sampling settings kvq does not implement: refused unless set to what leaves
  // sampling as it is (llama.cpp's off ranges: top_n_sigma <= 0, typical_p >= 1, ...).
  struct Neutral {
    const char* key;
    std::function<bool(const json&)> off;  // the settings that change nothing
  };
  const auto at_most = [](double x) { return [x](const json& v) { return v.is_number() && v.get<double>() <= x; }; };
  const auto at_least = [](double x) { return [x](const json& v) { return v.is_number() && v.get<double>() >= x; }; };
  const auto equals = [](json x) { return [x](const json& v) { return v == x; }; };
  const bool constrained = r.params.grammar || r.params.json_object;
  const Neutral others[] = {
      {"skip_special_tokens", equals(true)},
      {"spaces_between_special_tokens", equals(true)},
      {"use_beam_search", equals(false)},
      {"typical_p", at_least(1)},
      {"tfs_z", at_least(1)},
      {"mirostat", equals(0)},
      {"dry_multiplier", at_most(0)},
      {"xtc_probability", at_most(0)},
      {"top_n_sigma", at_most(0)},
      {"top_a", at_most(0)},
      {"dynatemp_range", at_most(0)},
      {"n_probs", [&](const json& v) { return v == 0 || (v.is_number_integer() && set("logprobs")); }},  // llama.cpp's logprobs
      {"bad_words", equals(json::array())},
      {"logits_processors", equals(json::array())},
      {"guided_whitespace_pattern", [&](const json&) { return !constrained; }}};
  for (const Neutral& o : others)
    if (set(o.key) && !o.off(body[o.key]))
      throw ApiError{fmt::format("'{}' is not supported (only at the value that turns it off)", o.key), o.key};
  // llama.cpp's names for the repetition penalty (over the last repeat_last_n tokens, default 64)
  if (set("repeat_penalty") && !set("repetition_penalty")) {
    const json& v = body["repeat_penalty"];
    if (!v.is_number() || !(v.get<double>() > 0 && v.get<double>() <= 10))
      throw ApiError{"'repeat_penalty' must be a number in (0, 10]", "repeat_penalty"};
    s.repeat_penalty = v.get<float>();
    s.repeat_last_n = 64;
    if (set("repeat_last_n")) {
      const json& n = body["repeat_last_n"];
      if (!n.is_number_integer() || n.get<int64_t>() < -1 || n.get<int64_t>() > (int64_t(1) << 30))
        throw ApiError{"'repeat_last_n' must be an integer >= -1 (-1: the whole context)", "repeat_last_n"};
      s.repeat_last_n = int(n.get<int64_t>());
    }
  }
  if (set("best_of") && !(body["best_of"].is_number_integer() && body["best_of"].get<int64_t>() == r.n))
    throw ApiError{"'best_of' other than n is not supported", "best_of"};
  return r;
}

// logprobs / top_logprobs / echo. Completions: "logprobs": N (0-20 alternatives per token) and
// "echo": true, which with logprobs also scores the prompt (the first prompt token has none; not
// with stream). Chat: "logprobs": true with "top_logprobs": N. Streamed, each chunk carries the
// tokens sampled since the previous chunk (a token whose text is held back, an incomplete UTF-8
// character or a possible stop string, comes with a later chunk or the last one).
void parse_logprobs(const json& body, bool chat, ApiRequest& r) {
  auto count = [&](const char* key) -> int {
    const json& v = body[key];
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > 20)
      throw ApiError{fmt::format("'{}' must be an integer in [0, 20]", key), key};
    return v.get<int>();
  };
  auto has = [&](const char* key) { return body.contains(key) && !body[key].is_null(); };
  if (chat) {
    bool on = false;
    if (has("logprobs")) {
      if (!body["logprobs"].is_boolean()) throw ApiError{"'logprobs' must be a boolean", "logprobs"};
      on = body["logprobs"].get<bool>();
    }
    if (has("top_logprobs") && !on) throw ApiError{"'top_logprobs' requires 'logprobs': true", "top_logprobs"};
    if (on) r.params.logprobs = has("top_logprobs") ? count("top_logprobs") : 0;
  } else {
    if (has("logprobs")) r.params.logprobs = count("logprobs");
    if (has("echo")) {
      if (!body["echo"].is_boolean()) throw ApiError{"'echo' must be a boolean", "echo"};
      r.echo = body["echo"].get<bool>();
    }
    r.params.prompt_logprobs = r.echo && r.params.logprobs >= 0;
  }
  if (r.stream && r.echo) throw ApiError{"'echo' is not supported with 'stream': true", "echo"};
  // vLLM's prompt_logprobs: each prompt token's log-probability and rank with that many alternatives
  if (has("prompt_logprobs")) {
    r.vllm_prompt_logprobs = count("prompt_logprobs");
    if (r.stream) throw ApiError{"'prompt_logprobs' is not supported with 'stream': true", "prompt_logprobs"};
    r.params.prompt_logprobs = true;
    r.params.prompt_logprobs_top = r.vllm_prompt_logprobs;
  }
}

const char* finish_reason_api(const std::string& r) { return r == "length" ? "length" : "stop"; }
// vLLM's prompt_logprobs: null for the first prompt token, then per token {id: {"logprob",
// "rank", "decoded_token"}} for the token and its `top` likeliest alternatives.
json prompt_logprobs_api(const Tokenizer& tk, const std::vector<TokenLogprob>& lps, int top) {
  json out = json::array();
  for (size_t i = 0; i < lps.size(); ++i) {
    const TokenLogprob& lp = lps[i];
    if (i == 0 || std::isnan(lp.logprob)) {
      out.push_back(nullptr);
      continue;
    }
    json d = json::object();
    d[std::to_string(lp.token)] = {{"logprob", lp.logprob}, {"rank", lp.rank}, {"decoded_token", tk.token_piece(lp.token)}};
    for (size_t k = 0; k < lp.top.size() && int(k) < top; ++k) {
      const auto& [id, l] = lp.top[k];
      if (!d.contains(std::to_string(id)))
        d[std::to_string(id)] = {{"logprob", l}, {"rank", int(k) + 1}, {"decoded_token", tk.token_piece(id)}};
    }
    out.push_back(std::move(d));
  }
  return out;
}

// vLLM's stop_reason: the stop string or stop token id that ended the text, else null.
json stop_reason_api(const GenResult& g) {
  if (g.stop_token >= 0) return g.stop_token;
  if (!g.stop_string.empty()) return g.stop_string;
  return nullptr;
}

// Streaming: the scheduler thread pushes SSE events, the connection's thread writes them.
struct StreamState {
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::string> events;
  bool done = false;
  std::vector<uint64_t> ids;  // the choices' requests (set before the stream starts)
  int remaining = 0;          // choices not finished yet (under mu)
  int completion_tokens = 0;  // of the finished ones (under mu)
  std::vector<int> cached;    // completions / chat: per prompt, the fewest prompt tokens its finished choices adopted (under mu)
  void cancel(Engine& e) const {
    for (uint64_t id : ids) e.cancel(id);
  }
  void push(std::string ev) {
    {
      std::lock_guard<std::mutex> lk(mu);
      events.push_back(std::move(ev));
    }
    cv.notify_all();
  }
  // No more events: the stream ends once those queued are written.
  void end() {
    {
      std::lock_guard<std::mutex> lk(mu);
      done = true;
    }
    cv.notify_all();
  }
};

// The socket of the connection `req` arrived on, or -1. Debian's cpp-httplib (0.11) gives a
// handler no handle on its connection (Request::is_connection_closed came in later versions), and
// a non-streaming handler writes nothing until the end, so it cannot notice a client that went
// away. The socket is found by its addresses: the one fd whose local and peer host:port are the
// request's (a TCP connection is unique by them). The connection's socket stays open while its
// handler runs, so the fd found cannot be closed and reused for another connection meanwhile.
// Linux: the process's fds are listed in /proc/self/fd.
int connection_fd(const httplib::Request& req) {
  DIR* d = opendir("/proc/self/fd");
  if (!d) return -1;
  auto host_port = [](const sockaddr_storage& a, socklen_t n, std::string* host, int* port) {
    char h[NI_MAXHOST], sv[NI_MAXSERV];
    if (getnameinfo(reinterpret_cast<const sockaddr*>(&a), n, h, sizeof h, sv, sizeof sv, NI_NUMERICHOST | NI_NUMERICSERV))
      return false;
    *host = h;
    *port = std::atoi(sv);
    return true;
  };
  int found = -1;
  while (dirent* e = readdir(d)) {
    char* end = nullptr;
    const long fd = std::strtol(e->d_name, &end, 10);
    if (end == e->d_name || *end != '\0' || fd == dirfd(d)) continue;
    struct stat st;
    if (fstat(int(fd), &st) != 0 || !S_ISSOCK(st.st_mode)) continue;
    sockaddr_storage la{}, pa{};
    socklen_t ln = sizeof la, pn = sizeof pa;
    if (getsockname(int(fd), reinterpret_cast<sockaddr*>(&la), &ln) != 0) continue;
    if (getpeername(int(fd), reinterpret_cast<sockaddr*>(&pa), &pn) != 0) continue;  // a listener
    std::string lh, ph;
    int lp = -1, pp = -1;
    if (!host_port(la, ln, &lh, &lp) || !host_port(pa, pn, &ph, &pp)) continue;
    if (lp == req.local_port && pp == req.remote_port && lh == req.local_addr && ph == req.remote_addr) {
      found = int(fd);
      break;
    }
  }
  closedir(d);
  return found;
}

// True when the client closed its side of the connection (or it failed): end of stream is
// readable (recv peeks 0 bytes) or poll reports a hang-up/error. Bytes of a next request on a
// keep-alive connection stay in the socket (MSG_PEEK) and mean "still there".
bool peer_closed(int fd) {
  pollfd p{fd, POLLIN, 0};
  if (poll(&p, 1, 0) <= 0) return false;
  if (p.revents & (POLLHUP | POLLERR | POLLNVAL)) return true;
  if (!(p.revents & POLLIN)) return false;
  char c;
  const ssize_t r = recv(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
  return r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

// Anthropic's routes (their errors in its form).
bool anthropic_route(const std::string& path) { return path.rfind("/v1/messages", 0) == 0; }

std::string sse(const json& j) { return "data: " + j.dump(-1, ' ', false, json::error_handler_t::replace) + "\n\n"; }

}  // namespace

struct Server::Impl {
  Engine& engine;
  ServerOptions opt;
  httplib::Server http;
  ChatTemplate tpl;
  std::atomic<uint64_t> next_id{1};
  std::atomic<int> listen_fd{-1};  // the listening socket, seen through the socket-options hook
  Impl(Engine& e, const ServerOptions& o) : engine(e), opt(o) {}

  // A completions or chat request read and checked: its prompts, with what their replies need.
  struct PromptIn {
    std::vector<int32_t> ids;
    std::string text;  // what echo returns
    int max_tokens = 0;
  };
  struct ChatTools;
  struct Prepared;
  Prepared prepare(const json& body, std::string_view raw, bool chat);
  // Runs a request's choices to their end (cancelled when the client goes away); a choice that
  // failed or was cancelled throws.
  std::vector<GenResult> run_all(const Prepared& p, const httplib::Request& req);
  // A chat reply's parts: harmony's reasoning, answer and calls, or a tool reply read, or the text.
  struct ChatReply {
    json content;  // a string, or null (a reply of calls only)
    std::string reasoning;
    std::vector<ToolCall> calls;
    bool called = false;  // the reply ended with whole calls (finish "tool_calls")
    bool raw = false;     // content is the raw text of a tool reply cut short before it was a response
    std::string cut_call;  // Qwen's: a call cut short, as its text (the chat endpoint's content ends with it)
  };
  ChatReply read_reply(const Prepared& p, const GenResult& g, std::mt19937_64& rng) const;
  class ChatReplyStream;
  void handle_generate(const httplib::Request& req, httplib::Response& res, bool chat);
  void stream_one(httplib::Response& res, std::shared_ptr<StreamState> st, GenRequest gr);
  // Anthropic's Messages API (anthropic.h): the request read into a chat request, the reply written
  // in Anthropic's form; count_tokens: the prompt's tokens.
  void handle_messages(const httplib::Request& req, httplib::Response& res);
  void handle_count_tokens(const httplib::Request& req, httplib::Response& res);
  // OpenAI's Responses API (responses.h), and the responses it keeps.
  void handle_responses(const httplib::Request& req, httplib::Response& res);
  struct StoredResponse {
    json response;                 // as GET /v1/responses/{id} returns it
    nlohmann::ordered_json input;  // its input items (with ids), as /input_items lists them
    nlohmann::ordered_json items;  // its conversation: earlier items, its input, its output items
    size_t bytes = 0;
  };
  static constexpr int kStoredResponses = 4096;
  static constexpr size_t kStoredBytes = size_t(256) << 20;
  std::mutex store_mu;
  std::unordered_map<std::string, StoredResponse> store;  // (under store_mu)
  // their input and output items by id, with how many kept responses hold each (an item referred
  // to, or an id a client reuses, is in several) (under store_mu)
  std::unordered_map<std::string, std::pair<nlohmann::ordered_json, int>> store_items;
  std::deque<std::string> store_order;                    // oldest first (under store_mu)
  size_t store_bytes = 0;
  // Background responses still running: response id -> engine request id (0 until submitted)
  // (under store_mu)
  std::unordered_map<std::string, uint64_t> background_runs;
  // A finished response's object (non-streamed and background): status, output items, usage.
  json responses_final(const Prepared& p, const GenResult& g, json out, const ResponsesForm& form) const;
  // POST /v1/responses/{id}/cancel, and DELETE's: ends a running background response and waits
  // until its final object (status "cancelled", or whatever it reached first) is kept (at most 30 s).
  void cancel_background(const std::string& id);
  std::shared_ptr<StoredResponse> make_kept(const nlohmann::ordered_json& history, const nlohmann::ordered_json& input);
  // run_ended: a background response's final object (its run forgotten under the same lock).
  void keep_response(const json& response, std::shared_ptr<StoredResponse> kept, bool run_ended = false);
  // Background responses' callbacks run on the engine's thread and may outlive the server: they
  // hold this and do nothing once it is false (the server's end sets it under its mutex, waiting
  // for a callback in progress).
  struct Liveness {
    std::mutex mu;
    bool alive = true;
  };
  std::shared_ptr<Liveness> liveness = std::make_shared<Liveness>();
  static constexpr size_t kMaxBackgroundRuns = 1024;
  void forget_response(const std::string& id);
  void check_model(const json& body) const;
  json messages_chat_body(const httplib::Request& req, bool count_tokens, std::string* raw, bool* omit_thinking) const;
  // Completions' object for tokens whose text starts at byte `offset` of the returned text;
  // *end: the byte after their text.
  json completion_logprobs(const std::vector<TokenLogprob>& lps, size_t offset = 0, size_t* end = nullptr,
                           bool text_start = false) const;
  json chat_logprobs(const std::vector<TokenLogprob>& lps) const;
  // A chat request's tools (tools.h): with ar, the reply's grammar is set on it (the response's
  // form from its response_format, any other constraint refused); without, for /tokenize (the
  // functions' parameters are still compiled, so that the same tools are refused).
  struct ChatTools {
    ToolSpec spec;
    bool response_is_string = true;
    std::string system_extra;  // the tools' prompt (empty: tools not active)
    // Harmony (gpt-oss): the functions as its developer message declares them; Qwen's: the tools'
    // JSON lines (empty: not active). Harmony: what the prompt opens the reply with (a call forced:
    // ' to=functions.')
    std::string native_tools;
    std::string open_reply;
  };
  ChatTools chat_tools(const json& body, std::string_view raw, ApiRequest* ar) const;
  ChatTools harmony_chat_tools(ChatTools t, ApiRequest* ar) const;
  // The chat prompt; tools: what the system turn adds (the tools' prompt, or harmony's functions)
  // and the reply's opening. final_channel: the reply constrained from its first byte: a harmony
  // reply (gpt-oss) opened in its final channel, without reasoning.
  // A reasoning template's (<think>) block is closed in the prompt then, and always with
  // chat_template_kwargs.enable_thinking false. *opening: what the prompt wrote of the reply.
  std::vector<int32_t> chat_prompt(const json& body, const ChatTools& tools, bool final_channel = false,
                                   std::string* opening = nullptr);
  // The prompt the chat endpoint runs for a body (its constraint read, as harmony's reply opens in
  // its final channel and a reasoning template's block is closed under one): /tokenize's and
  // count_tokens'.
  std::vector<int32_t> chat_prompt_of(const json& body, std::string_view raw) {
    ApiRequest ar = parse_common(body, raw);
    const ChatTools t = chat_tools(body, raw, &ar);
    return chat_prompt(body, t, constrained_from_start(ar.params.grammar || ar.params.json_object, t));
  }
  // Whether a chat reply's grammar starts at its first byte (a constraint, or tools other than
  // harmony's lazy ones): harmony's reply opens in its final channel, a reasoning template's
  // block is closed.
  bool constrained_from_start(bool constraint, const ChatTools& t) const {
    if (tpl.family == ChatFamily::harmony) return constraint && !t.spec.active();
    if (native_tools()) return constraint;  // (Qwen's: a grammar from the reply's start is on the request)
    return constraint || t.spec.active();
  }
  // The template writes function calls in its own syntax: harmony's, Qwen's
  bool native_tools() const { return tpl.family == ChatFamily::harmony || (tpl.family == ChatFamily::chatml && tpl.qwen_tools); }

  // A chat reply's bound on its reasoning (chat_reasoning_budget): vLLM's thinking_token_budget or
  // llama.cpp's thinking_budget_tokens (-1: none), else --reasoning-budget; llama.cpp's
  // thinking_budget_message, else --reasoning-budget-message. No effect on a template without
  // reasoning (as there).
  ReasoningBudget reasoning_budget(const json& body, const std::string& opening, bool calls) const;

  struct Prepared {
    ApiRequest ar;
    std::vector<PromptIn> prompts;
    ChatTools tools;
    bool chat = false;
    bool harmony = false;                   // a chat reply in gpt-oss's harmony format
    // A chat reply split into reasoning and answer (harmony, or a reasoning template's <think>),
    // after what the prompt wrote of it (harmony: a forced call's header; <think>: its opening).
    bool split = false;
    std::string reply_opening;
    const ChatTemplate* tpl = nullptr;  // the server's
    bool native_tools = false;          // calls in the template's own syntax (harmony's, Qwen's)
    const char* tool_finish = "tool_calls";  // a reply with calls ends so ("stop" for a call forced by name, as OpenAI's)
    int prompt_tokens = 0;                  // each prompt once (its n choices share its pages)
    int n_choices = 1;
    GenRequest choice_request(int i) const;
  };

  // A chat reply as it streams, told to a sink as content, reasoning and calls (one per choice;
  // scheduler thread).
  class ChatReplyStream {
   public:
    struct Sink {
      std::function<void(const std::string&)> content, reasoning;
      // calls, the first numbered `first` among the reply's
      std::function<void(const std::vector<ToolCall>&, size_t first)> calls;
      // a tool reply cut short before it became a response (a call's start): its raw text told
      // as content (OpenAI's endpoint, as documented), or not (Anthropic's and the Responses API,
      // whose clients would show the reply's JSON as text)
      bool raw_text = true;
    };
    explicit ChatReplyStream(const Prepared& p);
    void feed(const std::string& text, const Sink& s);
    // The reply's end (not for an error or a cancelled one): what was held back; returns whether
    // the reply called tools (finish "tool_calls").
    bool finish(const GenResult& g, const Sink& s);

   private:
    void split_out(const ChatReplyDelta& hd, const Sink& s);
    std::unique_ptr<ChatReplySplitter> split_;
    std::unique_ptr<ToolReplyStream> tools_;
    bool response_is_string_ = true;
    size_t calls_ = 0;   // harmony: the calls told
    bool whole_ = true;  // harmony: every call told has whole arguments
    std::mt19937_64 rng_{std::random_device{}()};  // the calls' ids
  };
};

Server::Impl::ChatTools Server::Impl::chat_tools(const json& body, std::string_view raw, ApiRequest* ar) const {
  ChatTools t;
  const bool any = body.contains("tools") || body.contains("tool_choice") || body.contains("parallel_tool_calls") ||
                   body.contains("functions") || body.contains("function_call");
  if (!any) return t;
  const nlohmann::ordered_json ob = nlohmann::ordered_json::parse(raw, nullptr, false);
  if (ob.is_discarded()) throw ApiError{"the request body is not valid JSON", ""};
  try {
    t.spec = parse_tools(ob);
  } catch (const ToolsError& e) {
    throw ApiError{e.what(), e.param};
  }
  if (!t.spec.active()) {
    // tool_choice "none" on a template that lists tools itself (harmony's, Qwen's): still listed,
    // as vLLM renders them by default, so that the prompt (and the prefix the cache holds) is the
    // one "auto" gives; the reply is free and read as text (a call written anyway is content).
    if (!t.spec.functions.empty() && native_tools())
      t.native_tools = tpl.family == ChatFamily::harmony ? harmony_functions_namespace(t.spec.functions) : qwen_tools_json(ob);
    return t;
  }
  if (ar && !ar->constraint.empty() && ar->constraint != "response_format")
    throw ApiError{fmt::format("'{}' cannot be combined with 'tools': the reply's form is the tools' (tool_choice "
                               "\"none\" turns them off; response_format gives the response's form)",
                               ar->constraint),
                   ar->constraint};
  if (tpl.family == ChatFamily::harmony) return harmony_chat_tools(std::move(t), ar);
  const bool qwen = tpl.family == ChatFamily::chatml && tpl.qwen_tools;
  nlohmann::ordered_json response = nullptr;  // the response's schema (null: a string)
  if (ar && !ar->constraint.empty()) {
    if (ar->params.json_object) {
      response = nlohmann::ordered_json::object();
      response["type"] = "object";
      response["additionalProperties"] = true;
    } else {
      response = ob.at(nlohmann::ordered_json::json_pointer(ar->schema_pointer));
    }
  } else if (!ar && body.contains("response_format") && body["response_format"].is_object()) {
    const json type = body["response_format"].value("type", json());
    t.response_is_string = !(type == "json_schema" || type == "json_object");
  }
  if (qwen) {  // Qwen's own syntax (qwen_tools.h)
    GenParams none;
    try {
      qwen_tool_constraint(t.spec, response, ar ? ar->params : none);
    } catch (const ToolsError& e) {
      throw ApiError{e.what(), e.param};
    }
    t.native_tools = qwen_tools_json(ob);
    t.response_is_string = false;  // (not read: the reply is split by QwenToolReplyStream)
    return t;
  }
  // The reply's grammar: set on the request, or (for /tokenize) compiled only so that a function
  // whose parameters kvq cannot generate is refused here as at /v1/chat/completions.
  try {
    if (ar) {
      t.response_is_string = response.is_null();
      ar->params.grammar = tool_reply_grammar(t.spec, response);
      ar->params.json_object = false;
    } else {
      (void)tool_reply_grammar(t.spec, nullptr);
    }
  } catch (const ToolsError& e) {
    throw ApiError{e.what(), e.param};
  }
  t.system_extra = tool_system_prompt(t.spec, t.response_is_string);
  return t;
}

// Harmony (gpt-oss): the functions declared in its developer message and called in its own syntax.
// tool_choice "auto": the reply is free (reasoning, then an answer or a call) until it writes
// ' to=functions.', from where the call's grammar holds (the name of a function, the header's rest,
// its arguments); with response_format, an answer's final channel holds that form. "required" and a
// named function: the prompt opens the call (no reasoning first) and the grammar holds from the
// reply's first byte (a named function's name is all its grammar allows). One call per reply (the
// format's: a call ends the reply), so parallel_tool_calls changes nothing.
Server::Impl::ChatTools Server::Impl::harmony_chat_tools(ChatTools t, ApiRequest* ar) const {
  GenParams none;  // (for /tokenize: the grammars are still compiled, so that the same tools are refused)
  try {
    t.open_reply = harmony_tool_constraint(t.spec, ar ? ar->params : none);
  } catch (const ToolsError& e) {
    throw ApiError{e.what(), e.param};
  }
  t.native_tools = harmony_functions_namespace(t.spec.functions);
  t.response_is_string = false;  // (not read: harmony's replies are split by HarmonyReplyStream)
  return t;
}

// Whether a reply's calls in the template's own syntax (harmony's, Qwen's) are whole: arguments
// that are JSON (a call a stop string cut is not).
static bool calls_whole(const std::vector<ChatToolCall>& cs) {
  return std::all_of(cs.begin(), cs.end(), [](const ChatToolCall& c) { return json::accept(c.arguments); });
}

// Those calls with their ids.
static std::vector<ToolCall> calls_with_ids(const std::vector<ChatToolCall>& cs, std::mt19937_64& rng) {
  std::vector<ToolCall> out;
  for (const ChatToolCall& c : cs) out.push_back({tool_call_id(rng), c.name, c.arguments});
  return out;
}

// A reply's tool calls as the API writes them; streamed chunks number them.
static json tool_calls_json(const std::vector<ToolCall>& calls, bool indexed) {
  json out = json::array();
  for (size_t k = 0; k < calls.size(); ++k) {
    json c = {{"id", calls[k].id},
              {"type", "function"},
              {"function", {{"name", calls[k].name}, {"arguments", calls[k].arguments}}}};
    if (indexed) c["index"] = k;
    out.push_back(std::move(c));
  }
  return out;
}

std::vector<int32_t> Server::Impl::chat_prompt(const json& body, const ChatTools& tools, bool final_channel,
                                               std::string* opening) {
  if (!body.contains("messages")) throw ApiError{"'messages' is required", "messages", "missing_required_parameter"};
  std::vector<ChatMessage> msgs;
  try {
    msgs = tool_chat_messages(body["messages"], tools.system_extra, tpl);
  } catch (const ToolsError& e) {
    throw ApiError{e.what(), e.param};
  }
  // vLLM's add_generation_prompt (default true) and continue_final_message (default false): the
  // last message, the assistant's, left open and continued (a reply's start given by the client).
  ChatRenderOptions ro;
  ro.tools = tools.native_tools;
  const bool opens_call = !tools.open_reply.empty();
  for (const auto& [key, field] : {std::pair{"add_generation_prompt", &ro.add_generation_prompt},
                                   std::pair{"continue_final_message", &ro.continue_final_message}}) {
    if (!body.contains(key) || body[key].is_null()) continue;
    if (!body[key].is_boolean()) throw ApiError{fmt::format("'{}' must be a boolean", key), key};
    *field = body[key].get<bool>();
  }
  if (ro.continue_final_message) {
    if (body.contains("add_generation_prompt") && !body["add_generation_prompt"].is_null() && ro.add_generation_prompt)
      throw ApiError{"'continue_final_message' continues the last message: 'add_generation_prompt' must be false",
                     "continue_final_message"};
    ro.add_generation_prompt = false;
    if (msgs.back().role != "assistant")
      throw ApiError{"'continue_final_message' needs the last message to be the assistant's", "continue_final_message"};
  }
  if (opens_call && !ro.add_generation_prompt)
    throw ApiError{"a call forced by tool_choice (\"required\" or a named function) opens the reply after the generation "
                   "prompt: 'add_generation_prompt' must be true",
                   "add_generation_prompt"};
  // OpenAI's reasoning_effort: the harmony template's (gpt-oss) "Reasoning:" line; refused for a
  // model without such a setting, as OpenAI refuses it for models without reasoning.
  ChatTemplate t = tpl;
  if (body.contains("reasoning_effort") && !body["reasoning_effort"].is_null()) {
    const json& e = body["reasoning_effort"];
    if (tpl.family != ChatFamily::harmony)
      throw ApiError{fmt::format("'reasoning_effort' is not supported with this model (its chat template, {}, has no "
                                 "reasoning effort; gpt-oss's harmony format has one)",
                                 chat_template_name(tpl)),
                     "reasoning_effort"};
    if (!e.is_string() || (e != "low" && e != "medium" && e != "high"))
      throw ApiError{"'reasoning_effort' must be one of \"low\", \"medium\", \"high\"", "reasoning_effort"};
    t.reasoning_effort = e.get<std::string>();
  }
  // chat_template_kwargs (vLLM's and llama.cpp's): kvq renders the templates itself, and reads
  // enable_thinking (a reasoning template's switch; no effect on others, as on their templates);
  // another key would be silently lost, so it is refused.
  ro.thinking = opt.enable_thinking;
  if (body.contains("chat_template_kwargs") && !body["chat_template_kwargs"].is_null()) {
    try {
      if (const std::optional<bool> v = chat_template_kwargs_json_thinking(body["chat_template_kwargs"])) ro.thinking = *v;
    } catch (const Error& e) {
      throw ApiError{e.what(), "chat_template_kwargs"};
    }
  }
  if (final_channel) ro.thinking = false;
  std::string text;
  if (tpl.known()) {
    try {
      text = chat_render(t, msgs, ro);
    } catch (const Error& e) {
      throw ApiError{e.what(), "messages"};
    }
    if (final_channel && ro.add_generation_prompt && tpl.family == ChatFamily::harmony) text += HarmonyReplyStream::kOpenFinal;
    if (ro.add_generation_prompt) text += tools.open_reply;
    if (opening) *opening = tpl.family == ChatFamily::harmony ? tools.open_reply : chat_reply_opening(tpl, text);
  } else {
    // A model without a chat template kvq knows (a base model): the contents, one per line.
    for (const auto& m : msgs) text += m.content + "\n";
    if (ro.continue_final_message) text.pop_back();
  }
  return engine.tokenizer().encode(text, true, /*parse_special=*/tpl.known());
}

ReasoningBudget Server::Impl::reasoning_budget(const json& body, const std::string& opening, bool calls) const {
  int tokens = opt.reasoning_budget;
  std::optional<int64_t> given;
  for (const char* key : {"thinking_token_budget", "thinking_budget_tokens"}) {
    if (!body.contains(key) || body[key].is_null()) continue;
    const json& x = body[key];
    // (a JSON integer >= 0 is read as unsigned: bounds beyond int are no bound smaller than int's)
    const int64_t v = x.is_number_unsigned() ? int64_t(std::min<uint64_t>(x.get<uint64_t>(), uint64_t(INT_MAX)))
                      : x.is_number_integer() ? x.get<int64_t>()
                                              : -2;
    if (v < -1) throw ApiError{fmt::format("'{}' must be an integer >= 0, or -1 for no bound", key), key};
    if (given && *given != v)
      throw ApiError{"'thinking_token_budget' and 'thinking_budget_tokens' (two names of one bound) differ", key};
    given = v;
  }
  if (given) tokens = int(*given);
  std::string message = opt.reasoning_budget_message;
  if (body.contains("thinking_budget_message") && !body["thinking_budget_message"].is_null()) {
    if (!body["thinking_budget_message"].is_string())
      throw ApiError{"'thinking_budget_message' must be a string", "thinking_budget_message"};
    message = body["thinking_budget_message"].get<std::string>();
  }
  return chat_reasoning_budget(tpl, tokens, message, opening, calls);
}

// Completions' logprobs object (echo: the prompt's tokens first); tokens as the bytes each renders
// as, text_offset their byte offsets in the returned text. A NaN log-probability (the first prompt
// token's) is null. text_start: the tokens start the text (echo), whose first piece loses the space
// a SentencePiece tokenizer puts before a text (as the echoed text does), so that the tokens
// spell the text.
json Server::Impl::completion_logprobs(const std::vector<TokenLogprob>& lps, size_t offset, size_t* end, bool text_start) const {
  const Tokenizer& tk = engine.tokenizer();
  json tokens = json::array(), vals = json::array(), tops = json::array(), offs = json::array();
  bool strip = text_start && tk.add_space_prefix();
  for (const TokenLogprob& lp : lps) {
    std::string piece = tk.token_piece(lp.token);
    if (strip && !piece.empty()) {
      if (piece[0] == ' ') piece.erase(0, 1);
      strip = false;
    }
    tokens.push_back(piece);
    offs.push_back(offset);
    offset += piece.size();
    if (std::isnan(lp.logprob)) {
      vals.push_back(nullptr);
      tops.push_back(nullptr);
      continue;
    }
    vals.push_back(lp.logprob);
    json t = json::object();
    for (const auto& [tid, l] : lp.top) {
      const std::string k = tk.token_piece(tid);
      if (!t.contains(k)) t[k] = l;  // pieces that render alike keep the likelier one
    }
    tops.push_back(t);
  }
  if (end) *end = offset;
  return json{{"tokens", tokens}, {"token_logprobs", vals}, {"top_logprobs", tops}, {"text_offset", offs}};
}

// Chat's logprobs object: {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}.
json Server::Impl::chat_logprobs(const std::vector<TokenLogprob>& lps) const {
  const Tokenizer& tk = engine.tokenizer();
  auto entry = [&](int32_t id, float lp) {
    const std::string piece = tk.token_piece(id);
    json bytes = json::array();
    for (unsigned char c : piece) bytes.push_back(int(c));
    return json{{"token", piece}, {"logprob", lp}, {"bytes", bytes}};
  };
  json content = json::array();
  for (const TokenLogprob& lp : lps) {
    json e = entry(lp.token, lp.logprob);
    json top = json::array();
    for (const auto& [tid, l] : lp.top) top.push_back(entry(tid, l));
    e["top_logprobs"] = top;
    content.push_back(e);
  }
  return json{{"content", content}};
}

// A request body: a JSON object, or a 400 saying what it is instead.
// The request body as J (json, or ordered_json where a schema's written order matters), with the
// checks every body gets.
template <class J = json>
static J parse_body(const httplib::Request& req) {
  // (the JSON parser would stop at a raw NUL byte and ignore what follows it)
  if (req.body.find('\0') != std::string::npos) throw ApiError{"the request body holds a NUL byte", ""};
  // Nesting is bounded while parsing (the parser's callback sees each value's depth): the JSON
  // library copies and frees values recursively.
  J body = J::parse(
      req.body,
      [](int depth, typename J::parse_event_t, J&) {
        if (depth > kMaxBodyDepth)
          throw ApiError{fmt::format("the request body is nested deeper than {} levels", kMaxBodyDepth), ""};
        return true;
      },
      false);
  if (body.is_discarded()) throw ApiError{"the request body is not valid JSON", ""};
  if (!body.is_object()) throw ApiError{"the request body must be a JSON object", ""};
  return body;
}

Server::Impl::Prepared Server::Impl::prepare(const json& body, std::string_view raw, bool chat) {
  Prepared p;
  p.chat = chat;
  ApiRequest& ar = p.ar;
  ar = parse_common(body, raw);
  parse_logprobs(body, chat, ar);
  check_model(body);
  if (ar.params.priority != 0 && !engine.options().priority_scheduling)
    throw ApiError{fmt::format("'priority' {} needs priority scheduling (kvq serve --scheduling-policy priority)",
                               ar.params.priority),
                   "priority"};
  for (const int32_t t : ar.params.stop_token_ids)
    if (t >= engine.tokenizer().n_vocab())
      throw ApiError{fmt::format("'stop_token_ids' token {} is outside the vocabulary [0, {})", t, engine.tokenizer().n_vocab()),
                     "stop_token_ids"};
  for (const int32_t t : ar.params.sampling.allowed_tokens)
    if (t >= engine.tokenizer().n_vocab())
      throw ApiError{fmt::format("'allowed_token_ids' token {} is outside the vocabulary [0, {})", t, engine.tokenizer().n_vocab()),
                     "allowed_token_ids"};
  for (const auto& [t, b] : ar.params.sampling.logit_bias)
    if (t >= engine.tokenizer().n_vocab())
      throw ApiError{fmt::format("'logit_bias' token {} is outside the vocabulary [0, {})", t, engine.tokenizer().n_vocab()),
                     "logit_bias"};
  // The prompts: chat's one, or completions' string / token ids, or a batch of either.
  std::vector<PromptIn>& prompts = p.prompts;
  const char* prompt_param = chat ? "messages" : "prompt";
  p.harmony = chat && tpl.family == ChatFamily::harmony;
  if (chat) {
    p.tools = chat_tools(body, raw, &ar);
    // A reply with calls ends "tool_calls"; as OpenAI's, a call forced by name ends "stop".
    if (p.tools.spec.choice == ToolChoice::named) p.tool_finish = "stop";
    // A constraint's grammar (the tools' too) starts at the reply's first byte: after a continued
    // message's start the text would be that start followed by a whole document.
    if ((ar.params.grammar || ar.params.json_object || !ar.params.lazy_grammars.empty()) &&
        body.contains("continue_final_message") && body["continue_final_message"] == true)
      throw ApiError{fmt::format("'continue_final_message' cannot be combined with '{}': its grammar would start after "
                                 "the continued text",
                                 p.tools.spec.active() ? "tools" : ar.constraint),
                     "continue_final_message"};
    // Harmony (gpt-oss): a reply writes its reasoning, then its answer in the final channel or a
    // function call; a constraint's grammar without tools applies to the answer, opened by the
    // prompt (no reasoning then); with tools, see harmony_chat_tools.
    // A reasoning template's reply (<think>) has its block closed in the prompt then.
    prompts.push_back({chat_prompt(body, p.tools, constrained_from_start(ar.params.grammar || ar.params.json_object, p.tools),
                                   &p.reply_opening),
                       "", 0});
    // (kvq's own tool prompt, on a template without calls of its own, reads its replies itself)
    p.native_tools = native_tools();
    const bool active = p.tools.spec.active();
    // (with tools, only a template that writes calls itself: kvq's own tool replies are read apart)
    p.split = active ? p.native_tools : chat_reasons(tpl);
    p.tpl = &tpl;
    ar.params.reasoning_budget = reasoning_budget(body, p.reply_opening, active);
  } else {
    auto set = [&](const char* key) { return body.contains(key) && !body[key].is_null(); };
    if ((set("tools") && !(body["tools"].is_array() && body["tools"].empty())) || set("functions") ||
        (set("tool_choice") && body["tool_choice"] != "none"))
      throw ApiError{"function calling ('tools', 'tool_choice') is for /v1/chat/completions",
                     set("functions") ? "functions" : set("tools") ? "tools" : "tool_choice"};
    for (const char* key : {"thinking_token_budget", "thinking_budget_tokens", "thinking_budget_message"})
      if (set(key))
        throw ApiError{fmt::format("'{}' is for /v1/chat/completions (the reasoning's markers come from the chat template)", key),
                       key};
    if (!body.contains("prompt")) throw ApiError{"'prompt' is required", "prompt", "missing_required_parameter"};
    const json& pj = body["prompt"];
    auto parse_one = [&](const json& one) {
      PromptIn in;
      if (one.is_string()) {
        in.text = one.get<std::string>();
        in.ids = engine.tokenizer().encode(in.text, true, true);
        if (in.ids.empty()) {
          if (engine.tokenizer().bos() < 0) throw ApiError{"the prompt is empty", "prompt"};
          in.ids.push_back(engine.tokenizer().bos());
        }
      } else if (one.is_array() && !one.empty()) {
        for (const auto& t : one) {
          if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= engine.tokenizer().n_vocab())
            throw ApiError{fmt::format("token ids in 'prompt' must be integers in [0, {})", engine.tokenizer().n_vocab()),
                           "prompt"};
          in.ids.push_back(t.get<int32_t>());
        }
        in.text = engine.tokenizer().decode(in.ids);
      } else {
        throw ApiError{"'prompt' must be a string, a non-empty array of token ids, or a batch (array) of either",
                       "prompt"};
      }
      return in;
    };
    if (pj.is_array() && !pj.empty() && (pj[0].is_string() || pj[0].is_array())) {  // a batch
      if (pj.size() > size_t(kMaxChoices))
        throw ApiError{fmt::format("'prompt' holds at most {} prompts", kMaxChoices), "prompt"};
      for (const auto& one : pj) prompts.push_back(parse_one(one));
    } else {
      prompts.push_back(parse_one(pj));
    }
  }
  if (prompts.size() * size_t(ar.n) > size_t(kMaxSequences))
    throw ApiError{fmt::format("{} prompts x n {} exceed {} sequences per request", prompts.size(), ar.n, kMaxSequences),
                   "n"};
  const int ctx = engine.ctx();
  if (ar.max_tokens_set && ar.params.max_tokens == 0 && !ar.echo)
    throw ApiError{"'max_tokens' must be >= 1 (0 only with echo: the prompt, scored with logprobs)", "max_tokens"};
  // The longest sequence one request can grow to: the context, or a smaller KV pool (a sequence that
  // outgrows the whole pool could never finish; it is refused here rather than cut short).
  const size_t pool_tokens = engine.kv_tokens_capacity();
  const int seq_cap = int(std::min<size_t>(size_t(ctx), pool_tokens));
  for (PromptIn& in : prompts) {
    if (ar.truncate_prompt_tokens > ctx)
      throw ApiError{fmt::format("'truncate_prompt_tokens' {} is more than the context of {} tokens", ar.truncate_prompt_tokens, ctx),
                     "truncate_prompt_tokens"};
    // -1: as many as leave room for max_tokens (16 when it is not set, completions' default)
    const int keep = ar.truncate_prompt_tokens == -1 ? std::max(1, seq_cap - (ar.max_tokens_set ? std::max(1, ar.params.max_tokens) : 16))
                                                     : ar.truncate_prompt_tokens;
    if (ar.truncate_prompt_tokens != 0 && in.ids.size() > size_t(keep)) {
      // the last `keep` tokens, the first kept when it is the BOS (as a tokenizer that truncates
      // the text before adding it)
      const bool bos = keep > 1 && in.ids[0] == engine.tokenizer().bos();
      in.ids.erase(in.ids.begin() + (bos ? 1 : 0), in.ids.end() - (keep - (bos ? 1 : 0)));
      in.text = engine.tokenizer().decode(in.ids);
    }
    const int n_prompt = int(in.ids.size());
    p.prompt_tokens += n_prompt;  // each prompt counts once for its n choices (they share its pages)
    if (n_prompt >= ctx)
      throw context_error(fmt::format("the prompt is {} tokens, the model's context is {} tokens", n_prompt, ctx),
                          prompt_param, n_prompt, -1, size_t(ctx));
    if (size_t(n_prompt) + 1 > pool_tokens)
      throw context_error(fmt::format("the prompt is {} tokens, the KV cache holds {} tokens", n_prompt, pool_tokens),
                          prompt_param, n_prompt, -1, pool_tokens);
    if (!ar.max_tokens_set) {
      in.max_tokens = chat || ar.unlimited ? seq_cap - n_prompt : std::min(16, seq_cap - n_prompt);
    } else if (n_prompt + ar.params.max_tokens > ctx) {
      throw context_error(fmt::format("max_tokens {} + prompt {} tokens exceed the context of {} tokens",
                                      ar.params.max_tokens, n_prompt, ctx),
                          "max_tokens", n_prompt, ar.params.max_tokens, size_t(ctx));
    } else if (size_t(n_prompt) + size_t(ar.params.max_tokens) > pool_tokens) {
      throw context_error(fmt::format("max_tokens {} + prompt {} tokens exceed the KV cache, which holds {} tokens "
                                      "(kvq serve --kv-mem / --kv-tokens)",
                                      ar.params.max_tokens, n_prompt, pool_tokens),
                          "max_tokens", n_prompt, ar.params.max_tokens, pool_tokens);
    } else {
      in.max_tokens = ar.params.max_tokens;
    }
    if (ar.params.min_tokens > in.max_tokens)
      throw ApiError{fmt::format("'min_tokens' {} is more than max_tokens {}", ar.params.min_tokens, in.max_tokens),
                     "min_tokens"};
  }
  p.n_choices = int(prompts.size()) * ar.n;
  return p;
}

// Choice i (OpenAI's order: prompt i / n, its choice i % n) samples with seed + i % n
// (reproducible per choice; greedy choices of one prompt are all the same).
GenRequest Server::Impl::Prepared::choice_request(int i) const {
  const PromptIn& in = prompts[size_t(i / ar.n)];
  GenRequest gr;
  gr.prompt = in.ids;
  gr.params = ar.params;
  gr.params.max_tokens = in.max_tokens;
  gr.params.sampling.seed = ar.params.sampling.seed + uint64_t(i % ar.n);
  return gr;
}

std::vector<GenResult> Server::Impl::run_all(const Prepared& p, const httplib::Request& req) {
  std::vector<std::future<GenResult>> futs;
  std::vector<GenRequest> grs;
  for (int i = 0; i < p.n_choices; ++i) {
    auto pr = std::make_shared<std::promise<GenResult>>();
    futs.push_back(pr->get_future());
    GenRequest gr = p.choice_request(i);
    gr.on_done = [pr](const GenResult& g) { pr->set_value(g); };
    grs.push_back(std::move(gr));
  }
  const std::vector<uint64_t> rids = engine.submit_all(std::move(grs));
  // Nothing is written before the result, so a client that disconnects is only seen by
  // watching its socket: cancel its requests then, which frees their pages at the next step.
  const int fd = connection_fd(req);
  for (size_t next = 0; next < futs.size();) {
    if (fd >= 0 && peer_closed(fd)) {
      for (uint64_t rid : rids) engine.cancel(rid);
      break;
    }
    if (futs[next].wait_for(std::chrono::milliseconds(fd >= 0 ? 10 : 1000)) == std::future_status::ready) ++next;
  }
  std::vector<GenResult> gs;
  for (auto& f : futs) gs.push_back(f.get());
  for (const GenResult& g : gs)
    if (g.finish_reason == "error" || g.finish_reason == "cancelled")
      throw ApiError{g.error.empty() ? "the request was cancelled" : g.error, "", "", engine.aborting() ? 503 : 500};
  return gs;
}

Server::Impl::ChatReply Server::Impl::read_reply(const Prepared& p, const GenResult& g, std::mt19937_64& rng) const {
  ChatReply r;
  if (p.split) {  // the answer as content, the reasoning beside it, calls
    // (harmony's calls only when functions were offered: with none, a call the model writes is content)
    const ChatReplyDelta d = chat_reply_splitter(tpl, p.tools.spec.active())->split_after(p.reply_opening, g.text);
    r.content = d.content;
    r.reasoning = d.reasoning;
    r.cut_call = d.cut_call;
    if (!d.calls.empty()) {
      if (d.content.empty()) r.content = nullptr;
      r.calls = calls_with_ids(d.calls, rng);
      // a call cut short (max_tokens: "length"; a stop string: arguments that are no JSON) keeps
      // the reason it ended for
      r.called = g.finish_reason == "stop" && calls_whole(d.calls) && d.cut_call.empty();
    }
  } else if (p.tools.spec.active()) {
    const ToolReply tr = parse_tool_reply(g.text, p.tools.response_is_string, rng);
    r.content = tr.has_content ? json(tr.content) : json(nullptr);
    r.raw = tr.raw;
    r.calls = tr.calls;
    r.called = !tr.calls.empty();
  } else {
    r.content = g.text;
  }
  return r;
}

Server::Impl::ChatReplyStream::ChatReplyStream(const Prepared& p) {
  // With tools, the reply's text is read as it streams: a response's text goes out as content,
  // tool calls in one piece at the end (tools.h). Harmony: reasoning and answer as they come,
  // each call when it ends.
  if (p.split) {
    split_ = chat_reply_splitter(*p.tpl, p.tools.spec.active());
    (void)split_->feed(p.reply_opening);  // (what the prompt wrote: nothing to send)
  } else if (p.tools.spec.active()) {
    tools_ = std::make_unique<ToolReplyStream>(p.tools.response_is_string);
    response_is_string_ = p.tools.response_is_string;
  }
}

void Server::Impl::ChatReplyStream::split_out(const ChatReplyDelta& hd, const Sink& s) {
  if (!hd.reasoning.empty()) s.reasoning(hd.reasoning);
  if (!hd.content.empty()) s.content(hd.content);
  if (!hd.cut_call.empty()) {  // (told as content where a tool reply's raw text is)
    whole_ = false;
    if (s.raw_text) s.content(hd.cut_call);
  }
  whole_ = whole_ && calls_whole(hd.calls);
  if (hd.calls.empty()) return;
  const std::vector<ToolCall> calls = calls_with_ids(hd.calls, rng_);
  s.calls(calls, calls_);
  calls_ += calls.size();
}

void Server::Impl::ChatReplyStream::feed(const std::string& d, const Sink& s) {
  if (tools_) {
    const std::string c = tools_->feed(d);
    if (!c.empty()) s.content(c);
  } else if (split_) {
    split_out(split_->feed(d), s);
  } else {
    s.content(d);
  }
}

bool Server::Impl::ChatReplyStream::finish(const GenResult& g, const Sink& s) {
  if (split_) {
    split_out(split_->finish(), s);
    return calls_ > 0 && whole_ && g.finish_reason == "stop";
  }
  if (!tools_) return false;
  const ToolReply tr = parse_tool_reply(g.text, response_is_string_, rng_);
  const std::string& sent = tools_->streamed();
  if (!tr.calls.empty()) {
    s.calls(tr.calls, 0);
  } else if ((s.raw_text || !tr.raw) && tr.content.size() > sent.size() && tr.content.compare(0, sent.size(), sent) == 0) {
    s.content(tr.content.substr(sent.size()));
  }
  return !tr.calls.empty();
}

// Writes the stream's events as they come, until it is done; a client that goes away cancels its
// requests.
static void stream_events(httplib::Response& res, std::shared_ptr<StreamState> st, Engine& engine) {
  Engine* eng = &engine;
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream",
      [st, eng](size_t, httplib::DataSink& sink) {
        std::unique_lock<std::mutex> lk(st->mu);
        st->cv.wait_for(lk, std::chrono::milliseconds(200), [&] { return !st->events.empty() || st->done; });
        std::deque<std::string> evs;
        evs.swap(st->events);
        const bool done = st->done;
        lk.unlock();
        for (const auto& ev : evs) {
          if (!sink.write(ev.data(), ev.size())) {
            st->cancel(*eng);  // the client went away
            return false;
          }
        }
        if (done) {
          std::lock_guard<std::mutex> lk2(st->mu);
          if (st->events.empty()) {
            sink.done();
            return true;
          }
        }
        if (!sink.is_writable()) {
          st->cancel(*eng);
          return false;
        }
        return true;
      },
      [st, eng](bool success) {
        if (!success) st->cancel(*eng);
      });
}

// One request streamed: submitted, its events written as they come.
void Server::Impl::stream_one(httplib::Response& res, std::shared_ptr<StreamState> st, GenRequest gr) {
  std::vector<GenRequest> grs;
  grs.push_back(std::move(gr));
  st->ids = engine.submit_all(std::move(grs));
  stream_events(res, std::move(st), engine);
}

void Server::Impl::handle_generate(const httplib::Request& req, httplib::Response& res, bool chat) {
  const json body = parse_body(req);
  const Prepared p = prepare(body, req.body, chat);
  const ApiRequest& ar = p.ar;
  const int prompt_tokens = p.prompt_tokens;
  const std::string id = fmt::format("{}-{}", chat ? "chatcmpl" : "cmpl", next_id++);
  const int64_t created = int64_t(std::time(nullptr));
  const std::string model = opt.model_name;
  // A response's or a stream chunk's envelope around its choices.
  auto envelope = [id, created, model, chat](bool chunk, json choices) {
    return json{{"id", id},
                {"object", chat ? (chunk ? "chat.completion.chunk" : "chat.completion") : "text_completion"},
                {"created", created},
                {"model", model},
                {"choices", std::move(choices)}};
  };
  // prompt_tokens_details.cached_tokens (OpenAI's, vLLM's): of the prompt tokens counted, those
  // the prefix cache held (per prompt, its choice that computed the most of it).
  auto usage = [prompt_tokens](int completion_tokens, int cached_tokens) {
    return json{{"prompt_tokens", prompt_tokens},
                {"completion_tokens", completion_tokens},
                {"total_tokens", prompt_tokens + completion_tokens},
                {"prompt_tokens_details", {{"cached_tokens", cached_tokens}}}};
  };
  const char* tool_finish = p.tool_finish;

  if (!ar.stream) {
    const std::vector<GenResult> gs = run_all(p, req);
    json choices = json::array();
    std::mt19937_64 id_rng(std::random_device{}());  // tool calls' ids
    int completion_tokens = 0;
    json prompt_lps;  // chat's vLLM prompt_logprobs (the response's, one prompt)
    for (int i = 0; i < p.n_choices; ++i) {
      const GenResult& g = gs[size_t(i)];
      completion_tokens += g.completion_tokens;
      json choice = {{"index", i}, {"logprobs", nullptr}, {"finish_reason", finish_reason_api(g.finish_reason)},
                     {"stop_reason", stop_reason_api(g)}};
      if (chat) {
        const ChatReply r = read_reply(p, g, id_rng);
        json msg = {{"role", "assistant"}, {"content", r.content}};
        if (!r.cut_call.empty()) msg["content"] = (r.content.is_string() ? r.content.get<std::string>() : "") + r.cut_call;
        // llama.cpp's and DeepSeek's field, and vLLM's (OpenRouter's) newer one
        if (!r.reasoning.empty()) msg["reasoning_content"] = msg["reasoning"] = r.reasoning;
        if (!r.calls.empty()) msg["tool_calls"] = tool_calls_json(r.calls, false);
        if (r.called) choice["finish_reason"] = tool_finish;
        choice["message"] = std::move(msg);
      } else {
        choice["text"] = ar.echo ? p.prompts[size_t(i / ar.n)].text + g.text : g.text;
      }
      if (chat && ar.params.logprobs >= 0) choice["logprobs"] = chat_logprobs(g.logprobs);
      if (!chat && ar.params.logprobs >= 0) {
        std::vector<TokenLogprob> lps = ar.echo ? g.prompt_logprobs : std::vector<TokenLogprob>{};
        for (TokenLogprob& lp : lps) lp.top.resize(std::min(lp.top.size(), size_t(std::max(0, ar.params.logprobs))));
        lps.insert(lps.end(), g.logprobs.begin(), g.logprobs.end());
        choice["logprobs"] = completion_logprobs(lps, 0, nullptr, ar.echo);
      }
      if (ar.vllm_prompt_logprobs >= 0) {
        const json pl = prompt_logprobs_api(engine.tokenizer(), g.prompt_logprobs, ar.vllm_prompt_logprobs);
        if (chat) prompt_lps = pl;  // chat: the response's
        else choice["prompt_logprobs"] = pl;
      }
      choices.push_back(std::move(choice));
    }
    std::vector<int> cached(p.prompts.size(), INT_MAX);
    for (int i = 0; i < p.n_choices; ++i)
      cached[size_t(i / ar.n)] = std::min(cached[size_t(i / ar.n)], gs[size_t(i)].cached_tokens);
    json body_out = envelope(false, std::move(choices));
    if (chat && ar.vllm_prompt_logprobs >= 0) body_out["prompt_logprobs"] = prompt_lps;
    body_out["usage"] = usage(completion_tokens, std::accumulate(cached.begin(), cached.end(), 0));
    send_json(res, 200, body_out);
    return;
  }

  auto st = std::make_shared<StreamState>();
  st->remaining = p.n_choices;
  st->cached.assign(p.prompts.size(), INT_MAX);
  const int n_per_prompt = ar.n;
  // Log-probabilities of the tokens sampled since the last chunk, per choice (scheduler thread only).
  struct PendingLogprobs {
    std::vector<TokenLogprob> lps;
    size_t offset = 0;  // completions: byte offset of the next token's text
  };
  const bool want_lp = ar.params.logprobs >= 0;
  const bool include_usage = ar.include_usage;
  std::vector<GenRequest> grs;
  for (int i = 0; i < p.n_choices; ++i) {
    auto pend = std::make_shared<PendingLogprobs>();
    auto chunk = [=, this](const json& delta_or_text, const json& finish) {
      json choice = {{"index", i}, {"logprobs", nullptr}, {"finish_reason", finish}, {"stop_reason", nullptr}};
      if (want_lp && !pend->lps.empty()) {
        choice["logprobs"] = chat ? chat_logprobs(pend->lps) : completion_logprobs(pend->lps, pend->offset, &pend->offset);
        pend->lps.clear();
      }
      if (chat) choice["delta"] = delta_or_text;
      else choice["text"] = delta_or_text;
      return envelope(true, json::array({choice}));
    };
    // (with tools, content null until a response's text comes, as OpenAI's streams of calls)
    if (chat) st->push(sse(chunk(json{{"role", "assistant"}, {"content", p.tools.spec.active() ? json(nullptr) : json("")}}, nullptr)));
    GenRequest gr = p.choice_request(i);
    if (want_lp) gr.on_logprob = [pend](const TokenLogprob& lp) { pend->lps.push_back(lp); };
    auto reply = std::make_shared<ChatReplyStream>(p);
    ChatReplyStream::Sink sink;
    sink.content = [st, chunk, chat](const std::string& c) { st->push(sse(chunk(chat ? json{{"content", c}} : json(c), nullptr))); };
    sink.reasoning = [st, chunk](const std::string& r) {
      st->push(sse(chunk(json{{"reasoning_content", r}, {"reasoning", r}}, nullptr)));
    };
    sink.calls = [st, chunk](const std::vector<ToolCall>& calls, size_t first) {
      json tc = tool_calls_json(calls, true);
      for (size_t k = 0; k < tc.size(); ++k) tc[k]["index"] = first + k;
      st->push(sse(chunk(json{{"tool_calls", tc}}, nullptr)));
    };
    gr.on_text = [reply, sink](const std::string& d) { reply->feed(d, sink); };
    gr.on_done = [st, chunk, chat, include_usage, usage, envelope, reply, sink, tool_finish, i, n_per_prompt](const GenResult& g) {
      if (g.finish_reason == "error") {
        st->push(sse(error_body(g.error, "server_error", "", "")));
      } else if (g.finish_reason != "cancelled") {
        const bool called = chat && reply->finish(g, sink);
        json last = chunk(chat ? json::object() : json(""), called ? tool_finish : finish_reason_api(g.finish_reason));
        last["choices"][0]["stop_reason"] = stop_reason_api(g);
        st->push(sse(last));
      }
      int left, tokens, cached;
      {
        std::lock_guard<std::mutex> lk(st->mu);
        st->completion_tokens += g.completion_tokens;
        int& c = st->cached[size_t(i / n_per_prompt)];
        c = std::min(c, g.cached_tokens);
        left = --st->remaining;
        tokens = st->completion_tokens;
        cached = std::accumulate(st->cached.begin(), st->cached.end(), 0);
      }
      if (left > 0) return;  // the last choice to finish ends the stream
      if (include_usage && g.finish_reason != "cancelled") {
        json u = envelope(true, json::array());
        u["usage"] = usage(tokens, cached);
        st->push(sse(u));
      }
      st->push("data: [DONE]\n\n");
      st->end();
    };
    grs.push_back(std::move(gr));
  }
  st->ids = engine.submit_all(std::move(grs));
  stream_events(res, st, engine);
}

// The model a request names must be the one served (OpenAI's and vLLM's servers refuse another).
void Server::Impl::check_model(const json& body) const {
  if (body.contains("model") && body["model"].is_string() && body["model"].get<std::string>() != opt.model_name)
    throw ApiError{fmt::format("the model '{}' does not exist: this server serves '{}' (GET /v1/models)",
                               body["model"].get<std::string>(), opt.model_name),
                   "model", "model_not_found", 404};
}

// A Messages request's chat request body (anthropic.h); raw: its text; omit_thinking: the
// reasoning is not returned.
json Server::Impl::messages_chat_body(const httplib::Request& req, bool count_tokens, std::string* raw,
                                      bool* omit_thinking) const {
  const nlohmann::ordered_json in = parse_body<nlohmann::ordered_json>(req);
  nlohmann::ordered_json chat;
  try {
    chat = anthropic_chat_body(in, count_tokens);
  } catch (const AnthropicError& e) {
    throw ApiError{e.what(), e.param};
  }
  if (omit_thinking) *omit_thinking = anthropic_omits_thinking(in);
  *raw = chat.dump();
  return json::parse(*raw);
}

void Server::Impl::handle_messages(const httplib::Request& req, httplib::Response& res) {
  std::string raw;
  bool omit_thinking = false;
  const json body = messages_chat_body(req, false, &raw, &omit_thinking);
  const Prepared p = prepare(body, raw, true);
  std::mt19937_64 rng = responses_rng();
  const std::string id = responses_id("msg", rng);
  const std::string model = opt.model_name;
  const int prompt_tokens = p.prompt_tokens;

  if (!p.ar.stream) {
    const GenResult g = run_all(p, req).at(0);
    ChatReply r = read_reply(p, g, rng);
    if (r.raw) r.content = nullptr;  // (a call cut short: not the reply's JSON as text)
    json content = json::array();
    if (!r.reasoning.empty() && !omit_thinking)
      content.push_back({{"type", "thinking"}, {"thinking", r.reasoning}, {"signature", ""}});
    if (r.content.is_string() && !r.content.get<std::string>().empty())
      content.push_back({{"type", "text"}, {"text", r.content}});
    for (const ToolCall& c : r.calls) content.push_back(anthropic_tool_use(c.id, c.name, c.arguments));
    const AnthropicStop stop = anthropic_stop(g.finish_reason, g.stop_string, r.called);
    send_json(res, 200,
              json{{"id", id},
                   {"type", "message"},
                   {"role", "assistant"},
                   {"model", model},
                   {"content", std::move(content)},
                   {"stop_reason", stop.reason},
                   {"stop_sequence", stop.sequence},
                   {"usage", anthropic_usage(prompt_tokens, g.cached_tokens, g.completion_tokens)}});
    return;
  }

  auto st = std::make_shared<StreamState>();
  st->remaining = 1;
  auto as = std::make_shared<AnthropicStream>(id, model);
  st->push(as->start(prompt_tokens));
  GenRequest gr = p.choice_request(0);
  auto reply = std::make_shared<ChatReplyStream>(p);
  ChatReplyStream::Sink sink;
  sink.raw_text = false;
  sink.content = [st, as](const std::string& c) { st->push(as->text(c)); };
  sink.reasoning = [st, as, omit_thinking](const std::string& r) {
    if (!omit_thinking) st->push(as->thinking(r));
  };
  sink.calls = [st, as](const std::vector<ToolCall>& calls, size_t) {
    for (const ToolCall& c : calls) st->push(as->tool_use(c.id, c.name, c.arguments));
  };
  gr.on_text = [reply, sink](const std::string& d) { reply->feed(d, sink); };
  Engine* eng = &engine;
  gr.on_done = [st, as, reply, sink, prompt_tokens, eng](const GenResult& g) {
    if (g.finish_reason == "error") {
      st->push(AnthropicStream::error(g.error, eng->aborting() ? 503 : 500));
    } else if (g.finish_reason != "cancelled") {
      const bool called = reply->finish(g, sink);
      st->push(as->finish(anthropic_stop(g.finish_reason, g.stop_string, called),
                          anthropic_usage(prompt_tokens, g.cached_tokens, g.completion_tokens)));
    }
    st->end();
  };
  stream_one(res, st, std::move(gr));
}

// OpenAI's Responses API (responses.h): the request read into a chat request (after the items of
// the response it continues, item references replaced by the items kept), the reply written as
// output items; kept in memory unless store is false.
void Server::Impl::handle_responses(const httplib::Request& req, httplib::Response& res) {
  nlohmann::ordered_json in = parse_body<nlohmann::ordered_json>(req);
  nlohmann::ordered_json history = nlohmann::ordered_json::array();
  auto set = [&](const char* key) { return in.contains(key) && !in[key].is_null(); };
  {
    std::lock_guard<std::mutex> lk(store_mu);
    if (set("previous_response_id")) {
      if (!in["previous_response_id"].is_string()) throw ApiError{"'previous_response_id' must be a string", "previous_response_id"};
      const std::string prev = in["previous_response_id"].get<std::string>();
      auto it = store.find(prev);
      if (it == store.end())
        throw ApiError{fmt::format("Previous response with id '{}' not found (kvq keeps responses asked with store true in "
                                   "memory, until the server restarts or {} newer ones displace them)",
                                   prev, kStoredResponses),
                       "previous_response_id", "previous_response_not_found"};
      const json& status = it->second.response["status"];
      if (status == "queued" || status == "in_progress")
        throw ApiError{fmt::format("Previous response with id '{}' is still in progress (a background response): wait "
                                   "until GET /v1/responses/{} says it is done",
                                   prev, prev),
                       "previous_response_id"};
      history = it->second.items;
    }
    // item references: the items kvq keeps (those of responses kept with store)
    if (set("input") && in["input"].is_array())
      for (auto& item : in["input"])
        if (responses_is_reference(item)) {
          auto found = store_items.find(item["id"].get<std::string>());
          if (found != store_items.end()) item = found->second.first;
        }
  }
  nlohmann::ordered_json chat;
  nlohmann::ordered_json input_items;
  try {
    chat = responses_chat_body(in, history);
    input_items = responses_input_items(in);
  } catch (const ResponsesError& e) {
    throw ApiError{e.what(), e.param, "", e.status};
  }
  const std::string raw = chat.dump();
  const json body = json::parse(raw);
  const Prepared p = [&] {
    try {
      return prepare(body, raw, true);
    } catch (ApiError& e) {  // the chat request's names for the Responses API's fields
      e.param = e.param == "messages" ? "input" : responses_names(in, e.param);
      e.message = responses_names(in, e.message);
      throw;
    }
  }();
  std::mt19937_64 rng = responses_rng();
  const ResponsesForm form = responses_form(in);
  json base = responses_echo(in);
  {
    std::lock_guard<std::mutex> lk(store_mu);
    do base["id"] = responses_id("resp", rng);
    while (store.count(base["id"].get<std::string>()));
  }
  base["object"] = "response";
  base["created_at"] = int64_t(std::time(nullptr));
  base["model"] = opt.model_name;
  base["status"] = "in_progress";
  base["output"] = json::array();
  base["usage"] = nullptr;
  const bool keep = !set("store") || in["store"] == true;
  const int prompt_tokens = p.prompt_tokens;
  const Tokenizer* tk = &engine.tokenizer();

  // Background: answered at once ("queued"), kept, run on; the engine's end keeps its final object.
  if (set("background") && in["background"] == true) {
    if (!keep)
      throw ApiError{"background mode needs 'store' true: a background response is read back by GET /v1/responses/{id}",
                     "background"};
    if (p.ar.stream)
      throw ApiError{"'background' with 'stream' is not supported: poll GET /v1/responses/{id} instead", "background"};
    const std::string id = base["id"];
    json queued = base;
    queued["status"] = "queued";
    {
      std::lock_guard<std::mutex> lk(store_mu);
      if (background_runs.size() >= kMaxBackgroundRuns)
        throw ApiError{fmt::format("{} background responses are running already: wait for one to end", kMaxBackgroundRuns),
                       "background", "rate_limit_exceeded", 429};
      background_runs[id] = 0;
    }
    // (its input items keep their ids: the queued object and the final one share them)
    std::shared_ptr<StoredResponse> kept = make_kept(history, input_items);
    keep_response(queued, std::make_shared<StoredResponse>(*kept));
    auto prepared = std::make_shared<const Prepared>(p);
    GenRequest gr = p.choice_request(0);
    auto started = std::make_shared<std::atomic<bool>>(false);
    std::shared_ptr<Liveness> live = liveness;
    gr.on_text = [this, live, started, id](const std::string&) {
      if (started->exchange(true)) return;
      std::lock_guard<std::mutex> alive(live->mu);
      if (!live->alive) return;
      std::lock_guard<std::mutex> lk(store_mu);
      auto it = store.find(id);
      if (it != store.end() && it->second.response["status"] == "queued") it->second.response["status"] = "in_progress";
    };
    gr.on_done = [this, live, prepared, base, form, kept, id](const GenResult& g) {
      std::lock_guard<std::mutex> alive(live->mu);
      if (!live->alive) return;
      json out = base;
      try {
        if (g.finish_reason == "cancelled" && !engine.aborting()) {
          out["status"] = "cancelled";
        } else if (g.finish_reason == "error" || g.finish_reason == "cancelled") {
          out["status"] = "failed";
          out["error"] = {{"code", "server_error"}, {"message", g.error.empty() ? "the server is shutting down" : g.error}};
        } else {
          out = responses_final(*prepared, g, out, form);
        }
        keep_response(out, kept, true);
      } catch (const std::exception& e) {  // (the engine's thread: nothing may escape)
        out = base;
        out["status"] = "failed";
        out["error"] = {{"code", "server_error"}, {"message", e.what()}};
        try {
          keep_response(out, std::make_shared<StoredResponse>(), true);
        } catch (...) {
          std::lock_guard<std::mutex> lk(store_mu);
          background_runs.erase(id);
        }
      }
    };
    const uint64_t rid = engine.submit(std::move(gr));
    {
      std::lock_guard<std::mutex> lk(store_mu);
      auto it = background_runs.find(id);
      if (it != background_runs.end()) it->second = rid;  // (unless it ended already)
    }
    send_json(res, 200, queued);
    return;
  }

  if (!p.ar.stream) {
    const GenResult g = run_all(p, req).at(0);
    const json out = responses_final(p, g, base, form);
    if (keep) keep_response(out, make_kept(history, input_items));
    send_json(res, 200, out);
    return;
  }

  auto st = std::make_shared<StreamState>();
  st->remaining = 1;
  auto rs = std::make_shared<ResponsesStream>(base, form);
  st->push(rs->start());
  GenRequest gr = p.choice_request(0);
  auto reply = std::make_shared<ChatReplyStream>(p);
  auto reasoning = std::make_shared<std::string>();  // (scheduler thread only)
  ChatReplyStream::Sink sink;
  sink.raw_text = false;
  sink.content = [st, rs](const std::string& c) { st->push(rs->text(c)); };
  sink.reasoning = [st, rs, reasoning](const std::string& r) {
    *reasoning += r;
    st->push(rs->reasoning(r));
  };
  sink.calls = [st, rs](const std::vector<ToolCall>& calls, size_t) {
    for (const ToolCall& c : calls) st->push(rs->call(c));
  };
  gr.on_text = [reply, sink](const std::string& d) { reply->feed(d, sink); };
  std::shared_ptr<StoredResponse> kept = keep ? make_kept(history, input_items) : nullptr;
  gr.on_done = [this, st, rs, reply, sink, prompt_tokens, tk, reasoning, kept](const GenResult& g) {
    if (g.finish_reason == "error") {
      st->push(rs->error(g.error));
    } else if (g.finish_reason != "cancelled") {
      (void)reply->finish(g, sink);
      json final;
      const std::string last = rs->finish(responses_usage(prompt_tokens, g.cached_tokens, g.completion_tokens,
                                                          int(tk->encode(*reasoning, false, false).size())),
                                          g.finish_reason != "length", &final);
      // kept before the client hears it is done: a next request may continue it at once
      if (kept) keep_response(final, kept);
      st->push(last);
    }
    st->end();
  };
  stream_one(res, st, std::move(gr));
}

json Server::Impl::responses_final(const Prepared& p, const GenResult& g, json out, const ResponsesForm& form) const {
  std::mt19937_64 rng = responses_rng();
  ChatReply r = read_reply(p, g, rng);
  if (r.raw) r.content = nullptr;  // (a call cut short: not the reply's JSON as text)
  ResponsesReply rr;
  rr.reasoning = r.reasoning;
  rr.content = r.content;
  rr.calls = r.calls;
  rr.complete = g.finish_reason != "length";
  if (p.ar.params.logprobs >= 0) rr.logprobs = chat_logprobs(g.logprobs)["content"];
  out["status"] = rr.complete ? "completed" : "incomplete";
  if (!rr.complete) out["incomplete_details"] = {{"reason", "max_output_tokens"}};
  out["completed_at"] = rr.complete ? json(int64_t(std::time(nullptr))) : json(nullptr);
  out["output"] = responses_output(rr, form, rng);
  out["usage"] = responses_usage(p.prompt_tokens, g.cached_tokens, g.completion_tokens,
                                 int(engine.tokenizer().encode(r.reasoning, false, false).size()));
  return out;
}

void Server::Impl::cancel_background(const std::string& id) {
  // (the engine is told outside the lock: a request it ends calls on_done, which takes it)
  const auto t0 = std::chrono::steady_clock::now();
  bool told = false;
  for (;;) {
    uint64_t rid = 0;
    {
      std::lock_guard<std::mutex> lk(store_mu);
      auto it = background_runs.find(id);
      if (it == background_runs.end()) return;
      rid = it->second;
    }
    if (rid != 0 && !told) {
      engine.cancel(rid);
      told = true;
    }
    if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(30)) return;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
}

// What a response will keep, made before it runs (not on the scheduler thread): its conversation so
// far, the earlier items (history) and its input, the input items in the API's form with an id each.
std::shared_ptr<Server::Impl::StoredResponse> Server::Impl::make_kept(const nlohmann::ordered_json& history,
                                                                      const nlohmann::ordered_json& input) {
  auto s = std::make_shared<StoredResponse>();
  std::mt19937_64 rng = responses_rng();
  s->input = nlohmann::ordered_json::array();
  for (const auto& it : input) s->input.push_back(responses_item_form(it, rng));
  s->items = history;
  for (const auto& it : s->input) s->items.push_back(it);
  s->bytes = s->items.dump().size() + s->input.dump().size();
  return s;
}

// A finished response kept for GET /v1/responses/{id}, its input items, previous_response_id and
// item references: `kept` (make_kept) with its output items added. The oldest go first past
// kStoredResponses responses or about kStoredBytes of them.
void Server::Impl::keep_response(const json& response, std::shared_ptr<StoredResponse> kept, bool run_ended) {
  StoredResponse& s = *kept;
  s.response = response;
  // (a logprobs token may be part of a character: kept as text, U+FFFD in its place)
  const auto text = [](const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); };
  for (const json& it : response["output"]) s.items.push_back(nlohmann::ordered_json::parse(text(it)));
  s.bytes += 2 * text(response).size();  // (the response, and its output among the items)
  std::lock_guard<std::mutex> lk(store_mu);
  const std::string id = response["id"];
  if (run_ended) background_runs.erase(id);  // (with its final object kept, as one step for cancel_background)
  forget_response(id);
  // an id two responses hold (an item referred to, an id a client reuses): the newest's item
  auto hold = [this](const std::string& item_id, nlohmann::ordered_json item) {
    auto& held = store_items[item_id];
    held.first = std::move(item);
    ++held.second;
  };
  for (const auto& it : s.input) hold(it["id"].get<std::string>(), it);
  for (const json& it : response["output"]) hold(it["id"].get<std::string>(), nlohmann::ordered_json::parse(text(it)));
  store_bytes += s.bytes;
  store[id] = std::move(s);
  store_order.push_back(id);
  // the oldest go first, but not a background response still running (GET and cancel need it)
  while (store.size() > size_t(kStoredResponses) || store_bytes > kStoredBytes) {
    auto old = std::find_if(store_order.begin(), store_order.end(),
                            [this](const std::string& o) { return !background_runs.count(o); });
    if (old == store_order.end()) break;
    forget_response(*old);
  }
}

// Forgets a kept response and its items (under store_mu).
void Server::Impl::forget_response(const std::string& id) {
  auto it = store.find(id);
  if (it == store.end()) return;
  auto release = [this](const std::string& item_id) {
    auto at = store_items.find(item_id);
    if (at != store_items.end() && --at->second.second == 0) store_items.erase(at);
  };
  for (const auto& item : it->second.input) release(item["id"].get<std::string>());
  for (const json& item : it->second.response["output"]) release(item["id"].get<std::string>());
  store_bytes -= it->second.bytes;
  store.erase(it);
  std::erase(store_order, id);
}

void Server::Impl::handle_count_tokens(const httplib::Request& req, httplib::Response& res) {
  std::string raw;
  const json body = messages_chat_body(req, true, &raw, nullptr);
  check_model(body);
  send_json(res, 200, json{{"input_tokens", chat_prompt_of(body, raw).size()}});
}

Server::Server(Engine& engine, const ServerOptions& o) : impl_(std::make_unique<Impl>(engine, o)) {
  Impl& I = *impl_;
  if (I.opt.model_name.empty()) I.opt.model_name = "kvq";
  I.tpl = chat_template_detect(engine.model().file(),
                               I.opt.chat_template.empty() ? std::nullopt : std::optional<std::string>(I.opt.chat_template));
  chat_warn_budget_unused(I.tpl, I.opt.reasoning_budget);
  // Debian's cpp-httplib listens with a backlog of 5 (compiled into the library): 32 clients
  // connecting at once overflow it and the kernel drops handshakes, which clients see as resets
  // under load. The hook keeps httplib's own options and remembers the socket, so bind() can
  // listen again with the system's maximum backlog (listen() on a listening socket resizes it).
  I.http.set_socket_options([this](socket_t sock) {
    httplib::default_socket_options(sock);
    impl_->listen_fd = int(sock);
  });
  const int n_threads = std::max(2, o.http_threads);
  I.http.new_task_queue = [n_threads] { return new httplib::ThreadPool(size_t(n_threads)); };
  I.http.set_payload_max_length(size_t(64) << 20);

  if (!I.opt.allowed_origins.empty()) {
    const std::vector<std::string>& origins = I.opt.allowed_origins;
    const bool any = std::find(origins.begin(), origins.end(), "*") != origins.end();
    // The allowed origin as the response names it ("*" or the request's own); empty: none.
    auto allow = [&origins, any](const httplib::Request& req) -> std::string {
      const std::string origin = req.get_header_value("Origin");
      if (origin.empty()) return "";
      if (any) return "*";
      return std::find(origins.begin(), origins.end(), origin) != origins.end() ? origin : "";
    };
    I.http.set_post_routing_handler([allow, any](const httplib::Request& req, httplib::Response& res) {
      // With a list of origins the answer depends on the request's Origin: caches must key on it,
      // also for the responses that name no origin.
      if (!any) res.set_header("Vary", "Origin");
      const std::string a = allow(req);
      if (!a.empty()) res.set_header("Access-Control-Allow-Origin", a);
    });
    I.http.Options(R"(.*)", [allow](const httplib::Request& req, httplib::Response& res) {
      res.status = 204;
      if (allow(req).empty()) return;
      res.set_header("Access-Control-Allow-Methods", "GET, POST, OPTIONS");
      const std::string h = req.get_header_value("Access-Control-Request-Headers");
      res.set_header("Access-Control-Allow-Headers", h.empty() ? "Authorization, Content-Type, X-Api-Key" : h);
      res.set_header("Access-Control-Max-Age", "600");
    });
  }
  if (!I.opt.api_key.empty()) {
    I.http.set_pre_routing_handler([this](const httplib::Request& req, httplib::Response& res) {
      if (req.path == "/health" || req.path == "/metrics" || req.method == "OPTIONS")
        return httplib::Server::HandlerResponse::Unhandled;
      if (api_key_matches(req.get_header_value("Authorization"), req.get_header_value("X-Api-Key"), impl_->opt.api_key))
        return httplib::Server::HandlerResponse::Unhandled;
      res.set_header("WWW-Authenticate", "Bearer");
      if (anthropic_route(req.path))
        send_json(res, 401, anthropic_error_body("invalid x-api-key: send the key as 'x-api-key: <key>'", 401));
      else
        send_error(res, ApiError{"Incorrect API key provided: send it as 'Authorization: Bearer <key>'.", "",
                                 "invalid_api_key", 401});
      return httplib::Server::HandlerResponse::Handled;
    });
  }

  auto wrap = [this](bool chat) {
    return [this, chat](const httplib::Request& req, httplib::Response& res) {
      try {
        impl_->handle_generate(req, res, chat);
      } catch (const ApiError& e) {
        send_error(res, e);
      } catch (const json::exception& e) {
        send_error(res, ApiError{fmt::format("invalid request: {}", e.what()), ""});
      } catch (const std::exception& e) {
        send_error(res, ApiError{e.what(), "", "", 500});
      }
    };
  };
  I.http.Post("/v1/completions", wrap(false));
  I.http.Post("/v1/chat/completions", wrap(true));
  // Anthropic's Messages API, its errors in its own form.
  auto wrap_messages = [this](void (Impl::*handle)(const httplib::Request&, httplib::Response&)) {
    return [this, handle](const httplib::Request& req, httplib::Response& res) {
      try {
        (impl_.get()->*handle)(req, res);
      } catch (const ApiError& e) {
        // a context too small in Anthropic's words, which its clients read (Claude Code retries with
        // the max_tokens that fits)
        std::string message = anthropic_names(e.message);  // (the chat request's field names as the API's)
        if (e.code == "context_length_exceeded" && e.limit >= 0)
          message = e.max_tokens >= 0
                        ? fmt::format("input length and `max_tokens` exceed context limit: {} + {} > {}, decrease input "
                                      "length or `max_tokens` and try again",
                                      e.prompt_tokens, e.max_tokens, e.limit)
                        : fmt::format("prompt is too long: {} tokens > {} maximum", e.prompt_tokens, e.limit);
        send_json(res, e.status, anthropic_error_body(message, e.status));
      } catch (const json::exception& e) {
        send_json(res, 400, anthropic_error_body(fmt::format("invalid request: {}", e.what()), 400));
      } catch (const std::exception& e) {
        send_json(res, 500, anthropic_error_body(e.what(), 500));
      }
    };
  };
  I.http.Post("/v1/responses", [this](const httplib::Request& req, httplib::Response& res) {
    try {
      impl_->handle_responses(req, res);
    } catch (const ApiError& e) {
      send_error(res, e);
    } catch (const json::exception& e) {
      send_error(res, ApiError{fmt::format("invalid request: {}", e.what()), ""});
    } catch (const std::exception& e) {
      send_error(res, ApiError{e.what(), "", "", 500});
    }
  });
  // A kept response, and deleting it.
  I.http.Get(R"(/v1/responses/([A-Za-z0-9_\-]+))", [this](const httplib::Request& req, httplib::Response& res) {
    if (req.has_param("stream") && req.get_param_value("stream") != "false") {
      send_error(res, ApiError{"streaming a kept response again ('stream') is not supported: GET returns its object", "stream"});
      return;
    }
    std::lock_guard<std::mutex> lk(impl_->store_mu);
    auto it = impl_->store.find(req.matches[1].str());
    if (it == impl_->store.end())
      send_error(res, ApiError{fmt::format("No response found with id '{}'.", req.matches[1].str()), "", "not_found", 404});
    else
      send_json(res, 200, it->second.response);
  });
  // Cancelling a background response: its object once it ended (status "cancelled" unless it
  // finished first); a response that did not run in the background is refused.
  I.http.Post(R"(/v1/responses/([A-Za-z0-9_\-]+)/cancel)", [this](const httplib::Request& req, httplib::Response& res) {
    const std::string id = req.matches[1].str();
    {
      std::lock_guard<std::mutex> lk(impl_->store_mu);
      auto it = impl_->store.find(id);
      if (it == impl_->store.end()) {
        send_error(res, ApiError{fmt::format("No response found with id '{}'.", id), "", "not_found", 404});
        return;
      }
      if (it->second.response["background"] != true) {
        send_error(res, ApiError{"Only a response created with background true can be cancelled", ""});
        return;
      }
    }
    impl_->cancel_background(id);
    std::lock_guard<std::mutex> lk(impl_->store_mu);
    auto it = impl_->store.find(id);
    if (it == impl_->store.end())
      send_error(res, ApiError{fmt::format("No response found with id '{}'.", id), "", "not_found", 404});
    else
      send_json(res, 200, it->second.response);
  });
  I.http.Delete(R"(/v1/responses/([A-Za-z0-9_\-]+))", [this](const httplib::Request& req, httplib::Response& res) {
    impl_->cancel_background(req.matches[1].str());  // (a running background response ends first)
    std::lock_guard<std::mutex> lk(impl_->store_mu);
    const std::string id = req.matches[1].str();
    if (!impl_->store.count(id)) {
      send_error(res, ApiError{fmt::format("No response found with id '{}'.", id), "", "not_found", 404});
      return;
    }
    impl_->forget_response(id);
    send_json(res, 200, json{{"id", id}, {"object", "response"}, {"deleted", true}});
  });
  // Its input items, as the API lists them: order (desc by default), limit (20; 1-100), after / before an item id.
  I.http.Get(R"(/v1/responses/([A-Za-z0-9_\-]+)/input_items)", [this](const httplib::Request& req, httplib::Response& res) {
    const std::string id = req.matches[1].str();
    nlohmann::ordered_json items;
    {
      std::lock_guard<std::mutex> lk(impl_->store_mu);
      auto it = impl_->store.find(id);
      if (it == impl_->store.end()) {
        send_error(res, ApiError{fmt::format("No response found with id '{}'.", id), "", "not_found", 404});
        return;
      }
      items = it->second.input;
    }
    const std::string order = req.has_param("order") ? req.get_param_value("order") : "desc";
    if (order != "asc" && order != "desc") {
      send_error(res, ApiError{"'order' must be \"asc\" or \"desc\"", "order"});
      return;
    }
    int limit = 20;
    if (req.has_param("limit")) {
      const std::string l = req.get_param_value("limit");
      if (l.empty() || l.size() > 3 || l.find_first_not_of("0123456789") != std::string::npos || std::stoi(l) < 1 || std::stoi(l) > 100) {
        send_error(res, ApiError{"'limit' must be an integer in [1, 100]", "limit"});
        return;
      }
      limit = std::stoi(l);
    }
    std::vector<nlohmann::ordered_json> list(items.begin(), items.end());
    if (order == "desc") std::reverse(list.begin(), list.end());
    size_t from = 0, to = list.size();
    for (const char* cursor : {"after", "before"}) {
      if (!req.has_param(cursor)) continue;
      const std::string c = req.get_param_value(cursor);
      auto at = std::find_if(list.begin(), list.end(), [&](const nlohmann::ordered_json& x) { return x["id"] == c; });
      if (at == list.end()) {
        send_error(res, ApiError{fmt::format("no input item '{}' in this response", c), cursor});
        return;
      }
      if (std::string_view(cursor) == "after") from = size_t(at - list.begin()) + 1;
      else to = size_t(at - list.begin());
    }
    // (with before and no after: the `limit` items just before it)
    bool more_before = false;
    if (req.has_param("before") && !req.has_param("after") && to > from + size_t(limit)) {
      from = to - size_t(limit);
      more_before = true;
    }
    nlohmann::ordered_json data = nlohmann::ordered_json::array();
    for (size_t k = from; k < to && data.size() < size_t(limit); ++k) data.push_back(list[k]);
    nlohmann::ordered_json out = nlohmann::ordered_json::object();
    out["object"] = "list";
    out["data"] = data;
    out["first_id"] = data.empty() ? nlohmann::ordered_json() : data.front()["id"];
    out["last_id"] = data.empty() ? nlohmann::ordered_json() : data.back()["id"];
    out["has_more"] = more_before || from + data.size() < to;
    res.status = 200;
    res.set_content(out.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace), "application/json");
  });
  I.http.Post("/v1/messages", wrap_messages(&Impl::handle_messages));
  I.http.Post("/v1/messages/count_tokens", wrap_messages(&Impl::handle_count_tokens));
  I.http.Get("/v1/models", [this](const httplib::Request&, httplib::Response& res) {
    send_json(res, 200,
              json{{"object", "list"},
                   {"data", json::array({json{{"id", impl_->opt.model_name},
                                              {"object", "model"},
                                              {"created", int64_t(std::time(nullptr))},
                                              {"owned_by", "kvq"},
                                              {"max_model_len", impl_->engine.ctx()}}})}});
  });
  // vLLM's /tokenize and /detokenize: the engine's own tokens for a prompt (or chat messages
  // through the model's template), and the text of token ids.
  I.http.Post("/tokenize", [this](const httplib::Request& req, httplib::Response& res) {
    try {
      const json body = parse_body(req);
      const Tokenizer& tk = impl_->engine.tokenizer();
      std::vector<int32_t> ids;
      if (body.contains("messages")) {
        ids = impl_->chat_prompt_of(body, req.body);
      } else {
        if (!body.contains("prompt") || !body["prompt"].is_string())
          throw ApiError{"'prompt' (a string) or 'messages' is required", "prompt", "missing_required_parameter"};
        bool special = true;
        if (body.contains("add_special_tokens") && !body["add_special_tokens"].is_null()) {
          if (!body["add_special_tokens"].is_boolean())
            throw ApiError{"'add_special_tokens' must be a boolean", "add_special_tokens"};
          special = body["add_special_tokens"].get<bool>();
        }
        ids = tk.encode(body["prompt"].get<std::string>(), special, true);
      }
      send_json(res, 200, json{{"tokens", ids}, {"count", ids.size()}, {"max_model_len", impl_->engine.ctx()}});
    } catch (const ApiError& e) {
      send_error(res, e);
    } catch (const std::exception& e) {
      send_error(res, ApiError{e.what(), "", "", 500});
    }
  });
  I.http.Post("/detokenize", [this](const httplib::Request& req, httplib::Response& res) {
    try {
      const json body = parse_body(req);
      const Tokenizer& tk = impl_->engine.tokenizer();
      if (!body.contains("tokens") || !body["tokens"].is_array())
        throw ApiError{"'tokens' (an array of token ids) is required", "tokens", "missing_required_parameter"};
      std::vector<int32_t> ids;
      for (const auto& t : body["tokens"]) {
        if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= tk.n_vocab())
          throw ApiError{fmt::format("'tokens' must be integers in [0, {})", tk.n_vocab()), "tokens"};
        ids.push_back(t.get<int32_t>());
      }
      send_json(res, 200, json{{"prompt", tk.decode(ids)}});
    } catch (const ApiError& e) {
      send_error(res, e);
    } catch (const std::exception& e) {
      send_error(res, ApiError{e.what(), "", "", 500});
    }
  });
  I.http.Get("/health", [](const httplib::Request&, httplib::Response& res) { send_json(res, 200, json{{"status", "ok"}}); });
  // A route asked with the other method: 405 naming the one it takes (rather than a 404).
  for (const auto& [route, allowed] : {std::pair{"/v1/completions", "POST"}, std::pair{"/v1/chat/completions", "POST"},
                                       std::pair{"/v1/messages", "POST"}, std::pair{"/v1/messages/count_tokens", "POST"},
                                       std::pair{"/v1/responses", "POST"},
                                       std::pair{"/tokenize", "POST"}, std::pair{"/detokenize", "POST"},
                                       std::pair{"/v1/models", "GET"}, std::pair{"/health", "GET"},
                                       std::pair{"/metrics", "GET"}}) {
    auto wrong = [route = std::string(route), allowed = std::string(allowed)](const httplib::Request& req,
                                                                             httplib::Response& res) {
      res.set_header("Allow", allowed);
      const std::string message = fmt::format("{} takes {}, not {}", route, allowed, req.method);
      send_json(res, 405,
                anthropic_route(route) ? anthropic_error_body(message, 405)
                                       : error_body(message, "invalid_request_error", "", "method_not_allowed"));
    };
    if (std::string(allowed) == "POST") I.http.Get(route, wrong);
    else I.http.Post(route, wrong);
    I.http.Put(route, wrong);
    I.http.Delete(route, wrong);
    I.http.Patch(route, wrong);
  }
  I.http.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
    res.set_content(metrics_prometheus(impl_->engine.metrics()), "text/plain; version=0.0.4");
  });
  I.http.set_error_handler([](const httplib::Request& req, httplib::Response& res) {
    if (!res.body.empty()) return;
    if (anthropic_route(req.path))
      send_json(res, res.status,
                anthropic_error_body(res.status == 404   ? fmt::format("no route {} {}", req.method, req.path)
                                     : res.status == 413 ? "the request body is larger than 64 MiB"
                                                         : fmt::format("HTTP {}: the request could not be read (its "
                                                                       "headers, Content-Type or Content-Length)",
                                                                       res.status),
                                     res.status));
    else if (res.status == 404)
      send_json(res, 404, error_body(fmt::format("no route {} {}", req.method, req.path), "invalid_request_error", "", "not_found"));
    else if (res.status == 413)
      send_json(res, 413, error_body("the request body is larger than 64 MiB", "invalid_request_error", "", ""));
    else
      send_json(res, res.status,
                error_body(fmt::format("HTTP {}: the request could not be read (its headers, Content-Type or "
                                       "Content-Length)",
                                       res.status),
                           "invalid_request_error", "", ""));
  });
}

Server::~Server() {
  stop();
  // Background responses still running are ended (waiting a few seconds for the engine to end
  // them); their callbacks, which refer to the server, then do nothing.
  Impl& I = *impl_;
  std::vector<uint64_t> rids;
  {
    std::lock_guard<std::mutex> lk(I.store_mu);
    for (const auto& [id, rid] : I.background_runs)
      if (rid != 0) rids.push_back(rid);
  }
  for (uint64_t rid : rids) I.engine.cancel(rid);
  for (int i = 0; i < 500; ++i) {
    {
      std::lock_guard<std::mutex> lk(I.store_mu);
      if (I.background_runs.empty()) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::lock_guard<std::mutex> lk(I.liveness->mu);
  I.liveness->alive = false;
}

int Server::bind() {
  Impl& I = *impl_;
  if (I.opt.port < 0 || I.opt.port > 65535) fail("--port must be in [0, 65535] (got {})", I.opt.port);
  if (I.opt.port == 0) {
    const int p = I.http.bind_to_any_port(I.opt.host);
    if (p <= 0) fail("cannot listen on {} (any port)", I.opt.host);
    widen_backlog();
    return p;
  }
  if (!I.http.bind_to_port(I.opt.host, I.opt.port)) fail("cannot listen on {}:{}", I.opt.host, I.opt.port);
  widen_backlog();
  return I.opt.port;
}

void Server::widen_backlog() {
  const int fd = impl_->listen_fd.load();
  if (fd >= 0) ::listen(fd, SOMAXCONN);  // best effort: on failure httplib's backlog stays
}

void Server::listen() { impl_->http.listen_after_bind(); }

void Server::stop() {
  if (impl_->http.is_running()) impl_->http.stop();
}

void Server::shutdown(double drain_s) {
  Impl& I = *impl_;
  I.engine.abort_all("the server is shutting down");
  // The handlers answer their clients (a 503, or a stream's error event and [DONE]) once the
  // engine has ended their requests; then the listener and the connections close.
  const double t0 = now_seconds();
  while (!I.engine.idle() && now_seconds() - t0 < drain_s) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  stop();
}

bool api_key_matches(const std::string& authorization, const std::string& x_api_key, const std::string& key) {
  // Constant time in the key's bytes: a mismatch found early takes as long as one found late.
  auto same = [&key](const std::string& given) {
    unsigned diff = given.size() == key.size() ? 0u : 1u;
    for (size_t i = 0; i < key.size(); ++i) diff |= unsigned(uint8_t(i < given.size() ? given[i] : 0) ^ uint8_t(key[i]));
    return diff == 0;
  };
  bool ok = false;
  if (authorization.size() > 7) {
    std::string scheme = authorization.substr(0, 7);
    for (char& c : scheme) c = char(std::tolower(uint8_t(c)));
    if (scheme == "bearer ") ok = same(authorization.substr(7));
  }
  if (!x_api_key.empty()) ok = same(x_api_key) || ok;
  return ok;
}

std::string metrics_prometheus(const EngineMetrics& m) {
  std::string s;
  auto hist = [&](const char* name, const char* help, const Histogram& h) {
    s += fmt::format("# HELP {} {}\n# TYPE {} histogram\n", name, help, name);
    uint64_t cum = 0;
    for (size_t i = 0; i < h.bounds.size(); ++i) {
      cum += h.counts[i];
      s += fmt::format("{}_bucket{{le=\"{}\"}} {}\n", name, h.bounds[i], cum);
    }
    s += fmt::format("{}_bucket{{le=\"+Inf\"}} {}\n{}_sum {}\n{}_count {}\n", name, h.count, name, h.sum, name, h.count);
  };
  auto one = [&](const char* name, const char* type, const char* help, auto v) {
    s += fmt::format("# HELP {} {}\n# TYPE {} {}\n{} {}\n", name, help, name, type, name, v);
  };
  hist("kvq_time_to_first_token_seconds", "Time from request arrival to its first generated token.", m.ttft);
  hist("kvq_time_per_output_token_seconds", "Time between consecutive generated tokens of a request.", m.tpot);
  hist("kvq_e2e_request_latency_seconds", "Time from request arrival to its end (requests that stopped or reached their length).",
       m.e2e);
  hist("kvq_request_queue_time_seconds", "Time from request arrival to its admission to the running batch.", m.queue);
  hist("kvq_decode_step_seconds",
       "Time of an engine step on which a request that has generated tokens waits for its next one (scheduling, "
       "forward pass and sampling): what --tpot-target-ms bounds.",
       m.decode_step);
  one("kvq_requests_running", "gauge", "Requests in the running batch.", m.running);
  one("kvq_requests_waiting", "gauge", "Requests queued for admission.", m.waiting);
  one("kvq_kv_cache_usage_ratio", "gauge", "Referenced KV pages / all KV pages.", m.kv_usage);
  one("kvq_kv_cache_tokens_capacity", "gauge",
      "The most tokens one sequence can hold in the KV page pool (sliding-window layers hold only their window).",
      m.kv_tokens_capacity);
  one("kvq_prefix_cache_queries_total", "counter", "Prompt tokens looked up in the prefix cache.", m.prefix_query_tokens);
  one("kvq_prefix_cache_hits_total", "counter", "Prompt tokens served from the prefix cache.", m.prefix_hit_tokens);
  one("kvq_prefix_cache_preempted_queries_total", "counter",
      "Tokens of preempted sequences looked up again when readmitted (not in the hit rate).", m.prefix_readmit_query_tokens);
  one("kvq_prefix_cache_preempted_hits_total", "counter",
      "Of those, tokens found in the prefix cache (recomputation the cache saved them).", m.prefix_readmit_hit_tokens);
  one("kvq_preemptions_total", "counter", "Sequences preempted (recomputed later) for lack of KV pages.", m.preemptions);
  if (m.offload) {
    const KvOffloadStats& o = m.offload_stats;
    one("kvq_kv_offload_capacity_pages", "gauge", "KV pages the offload tier (--kv-offload-size) holds.", o.capacity_pages);
    one("kvq_kv_offload_pages", "gauge", "KV pages in the offload tier now.", o.resident_pages);
    one("kvq_kv_offload_pages_at_start", "gauge",
        "KV pages a persistent offload tier (--kv-offload-persist) kept from the last run.", o.pages_at_start);
    one("kvq_kv_offload_stored_pages_total", "counter", "Cached KV pages evicted from the pool and written to the tier.",
        o.stored_pages);
    one("kvq_kv_offload_loaded_pages_total", "counter", "KV pages read back from the tier instead of recomputed.",
        o.loaded_pages);
    one("kvq_kv_offload_hit_tokens_total", "counter", "Prompt tokens adopted from KV pages read back from the tier (first admissions).",
        m.offload_hit_tokens);
    one("kvq_kv_offload_dropped_pages_total", "counter", "Pages the tier let go for newer ones (least recently used).",
        o.dropped_pages);
    one("kvq_kv_offload_errors_total", "counter", "Failed tier writes and reads (the pages were recomputed).",
        o.write_errors + o.read_errors);
    one("kvq_kv_offload_write_seconds_total", "counter", "Time spent writing pages to the tier.", o.write_seconds);
    one("kvq_kv_offload_read_seconds_total", "counter", "Time spent reading pages from the tier.", o.read_seconds);
  }
  one("kvq_requests_finished_total", "counter", "Requests finished.", m.requests_finished);
  one("kvq_requests_cancelled_total", "counter", "Requests cancelled (client gone) before they finished.",
      m.requests_cancelled);
  one("kvq_prompt_tokens_total", "counter", "Prompt tokens of finished requests.", m.prompt_tokens);
  one("kvq_generation_tokens_total", "counter", "Tokens generated.", m.generation_tokens);
  one("kvq_spec_draft_tokens_total", "counter", "Tokens drafted by prompt lookup (--draft-max).", m.spec_draft_tokens);
  one("kvq_spec_accepted_tokens_total", "counter", "Drafted tokens kept by verification.", m.spec_accepted_tokens);
  return s;
}

}  // namespace kvq
