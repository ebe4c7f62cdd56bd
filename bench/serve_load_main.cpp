// Load generator for `kvq serve` (or another OpenAI-compatible server: bench/compare_llamacpp_serve.sh
// drives llama.cpp's llama-server with it): N concurrent clients stream /v1/completions requests that share
// long prefixes (so the server's prefix cache has something to hit) and measure TTFT, TPOT and
// throughput as a user of the OpenAI API sees them (wall clock on the client side, SSE parsing
// included).
// One prefix (default): the whole --prefix-file. Several (--prefixes N --prefix-bytes B): N distinct
// chunks of the file, one per "conversation", requests cycling over them, so a prefix recurs only
// after the others were used: the workload where a small pool must evict and recompute prefixes
// that a larger (quantized) pool keeps resident.
#include <httplib.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

using json = nlohmann::json;
using clk = std::chrono::steady_clock;

namespace {

struct Args {
  std::string host = "127.0.0.1";
  int port = 0;
  int concurrency = 1;
  int requests = 1;
  int max_tokens = 16;
  std::string prefix_file;
  int prefixes = 1;
  long prefix_bytes = 0;  // 0: the whole file (one prefix only)
  std::string order = "rr";  // rr: request i uses prefix i % N; random: seeded uniform choice
  unsigned seed = 1;
  double timeout_s = 600;
  bool ignore_eos = false;  // every request generates max_tokens (servers compared on equal work)
};

struct Sample {
  bool ok = false;
  bool empty = false;  // the model ended at once (end-of-sequence as first token): no TTFT to measure
  double ttft_s = 0;
  double tpot_s = -1;  // < 0: fewer than 2 tokens, no inter-token time
  double end_s = 0;    // when the request ended, seconds since the run started (to place failures in time)
  int tokens = 0;
  int prompt_tokens = -1;  // the server's usage.prompt_tokens, if it sent usage
  std::string error;
};

[[noreturn]] void usage_exit(const std::string& msg) {
  std::fprintf(stderr,
               "error: %s\nusage: serve_load --port P [--host H] [--concurrency N] [--requests M] [--max-tokens T]\n"
               "                  --prefix-file FILE [--prefixes N --prefix-bytes B [--order rr|random]]\n"
               "                  [--seed S] [--timeout SECONDS] [--ignore-eos]\n",
               msg.c_str());
  std::exit(2);
}

Args parse_args(int argc, char** argv) {
  Args a;
  auto need = [&](int& i) -> std::string {
    if (i + 1 >= argc) usage_exit(std::string(argv[i]) + " needs a value");
    return argv[++i];
  };
  auto to_int = [](const std::string& flag, const std::string& v) {
    try {
      size_t pos = 0;
      const long x = std::stol(v, &pos);
      if (pos != v.size()) throw std::invalid_argument(v);
      return x;
    } catch (const std::exception&) {
      usage_exit(flag + ": '" + v + "' is not an integer");
    }
  };
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    if (f == "--host") a.host = need(i);
    else if (f == "--port") a.port = int(to_int(f, need(i)));
    else if (f == "--concurrency") a.concurrency = int(to_int(f, need(i)));
    else if (f == "--requests") a.requests = int(to_int(f, need(i)));
    else if (f == "--max-tokens") a.max_tokens = int(to_int(f, need(i)));
    else if (f == "--prefix-file") a.prefix_file = need(i);
    else if (f == "--prefixes") a.prefixes = int(to_int(f, need(i)));
    else if (f == "--prefix-bytes") a.prefix_bytes = to_int(f, need(i));
    else if (f == "--order") a.order = need(i);
    else if (f == "--seed") a.seed = unsigned(to_int(f, need(i)));
    else if (f == "--timeout") a.timeout_s = double(to_int(f, need(i)));
    else if (f == "--ignore-eos") a.ignore_eos = true;
    else usage_exit("unknown flag " + f);
  }
  if (a.port <= 0 || a.port > 65535) usage_exit("--port must be in [1, 65535]");
  if (a.concurrency < 1 || a.concurrency > 1024) usage_exit("--concurrency must be in [1, 1024]");
  if (a.requests < 1) usage_exit("--requests must be >= 1");
  if (a.max_tokens < 1) usage_exit("--max-tokens must be >= 1");
  if (a.timeout_s < 1) usage_exit("--timeout must be >= 1");
  if (a.prefix_file.empty()) usage_exit("--prefix-file is required");
  if (a.prefixes < 1 || a.prefixes > 4096) usage_exit("--prefixes must be in [1, 4096]");
  if (a.prefix_bytes < 0) usage_exit("--prefix-bytes must be >= 0");
  if (a.prefixes > 1 && a.prefix_bytes == 0) usage_exit("--prefixes > 1 needs --prefix-bytes");
  if (a.order != "rr" && a.order != "random") usage_exit("--order must be rr or random");
  return a;
}

// Distinct short questions so that requests share the prefix but not their whole prompt.
std::string question(int i, std::mt19937& rng) {
  static const char* topics[] = {"startups", "essays", "programming", "investors", "cities", "founders",
                                 "languages", "wealth", "design", "schools", "hackers", "ideas"};
  static const char* asks[] = {"What does the author think about", "Summarize the view on", "Give one fact about",
                               "Why does the text mention", "Explain briefly the point about"};
  std::uniform_int_distribution<int> t(0, 11), q(0, 4);
  return "\n\nQuestion " + std::to_string(i) + ": " + asks[q(rng)] + " " + topics[t(rng)] + "?\nAnswer: The author";
}

bool is_space(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }

// n chunks of about `bytes` bytes from evenly spaced offsets of the text, so every chunk is a distinct
// prefix from its first token on. Chunks start after and end before ASCII whitespace: never in the
// middle of a UTF-8 sequence (the JSON body must be valid UTF-8) nor of a word.
std::vector<std::string> split_prefixes(const std::string& text, int n, long bytes) {
  if (n == 1 && bytes == 0) return {text};
  const size_t b = size_t(bytes), stride = text.size() / size_t(n);
  if (b + 64 > stride)
    usage_exit("--prefix-file has " + std::to_string(text.size()) + " bytes: too few for " + std::to_string(n) +
               " disjoint prefixes of " + std::to_string(bytes) + " bytes");
  std::vector<std::string> out;
  for (int k = 0; k < n; ++k) {
    size_t lo = size_t(k) * stride;
    if (k > 0) {
      const size_t lim = lo + 64;
      while (lo < lim && !is_space(text[lo])) ++lo;
      while (lo < lim && is_space(text[lo])) ++lo;
    }
    size_t hi = lo + b;
    while (hi > lo + b / 2 && !is_space(text[hi])) --hi;
    out.push_back(text.substr(lo, hi - lo));
  }
  return out;
}

Sample run_one(const Args& a, const std::string& prompt) {
  Sample s;
  httplib::Client cli(a.host, a.port);
  const time_t to = time_t(a.timeout_s);
  cli.set_connection_timeout(to, 0);
  cli.set_read_timeout(to, 0);
  cli.set_write_timeout(to, 0);
  json body = {{"prompt", prompt},         {"max_tokens", a.max_tokens},
               {"temperature", 0},         {"stream", true},
               {"stream_options", {{"include_usage", true}}}};
  if (a.ignore_eos) body["ignore_eos"] = true;
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.headers = {{"Content-Type", "application/json"}};
  req.body = body.dump();
  const auto t0 = clk::now();
  clk::time_point t_first{}, t_last{};
  int text_chunks = 0, usage_tokens = -1;
  std::string buf;
  bool done = false;
  req.content_receiver = [&](const char* data, size_t n, uint64_t, uint64_t) {
    const auto now = clk::now();
    buf.append(data, n);
    size_t pos;
    // SSE events end with a blank line; one network read may carry several or half of one.
    while ((pos = buf.find("\n\n")) != std::string::npos) {
      std::string ev = buf.substr(0, pos);
      buf.erase(0, pos + 2);
      if (ev.rfind("data: ", 0) != 0) continue;
      ev.erase(0, 6);
      if (ev == "[DONE]") {
        done = true;
        continue;
      }
      json j = json::parse(ev, nullptr, false);
      if (j.is_discarded()) continue;
      if (j.contains("error")) {
        s.error = j["error"].value("message", std::string("error event"));
        continue;
      }
      if (j.contains("usage") && j["usage"].is_object()) {
        usage_tokens = j["usage"].value("completion_tokens", -1);
        s.prompt_tokens = j["usage"].value("prompt_tokens", -1);
      }
      if (j.contains("choices") && j["choices"].is_array() && !j["choices"].empty()) {
        const auto& c = j["choices"][0];
        if (c.contains("text") && c["text"].is_string() && !c["text"].get<std::string>().empty()) {
          if (text_chunks == 0) t_first = now;
          t_last = now;
          ++text_chunks;
        }
      }
    }
    return true;
  };
  httplib::Response res;
  httplib::Error err = httplib::Error::Success;
  const bool sent = cli.send(req, res, err);
  if (!sent) {
    s.error = "http error: " + httplib::to_string(err);
    return s;
  }
  if (res.status != 200) {
    s.error = "status " + std::to_string(res.status) + ": " + res.body.substr(0, 200);
    return s;
  }
  if (text_chunks == 0) {
    if (s.error.empty() && done && usage_tokens == 0) s.empty = true;
    else if (s.error.empty()) s.error = "no text chunk";
    return s;
  }
  if (!done && s.error.empty()) s.error = "stream ended without [DONE]";
  s.tokens = usage_tokens > 0 ? usage_tokens : text_chunks;
  s.ttft_s = std::chrono::duration<double>(t_first - t0).count();
  if (s.tokens > 1) s.tpot_s = std::chrono::duration<double>(t_last - t_first).count() / (s.tokens - 1);
  s.ok = s.error.empty();
  return s;
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return std::nan("");
  std::sort(v.begin(), v.end());
  // nearest rank: small samples (2 requests) must still give an observed value
  const size_t k = size_t(std::ceil(p / 100.0 * double(v.size())));
  return v[std::min(v.size() - 1, k == 0 ? 0 : k - 1)];
}

}  // namespace

int main(int argc, char** argv) {
  const Args a = parse_args(argc, argv);
  std::ifstream in(a.prefix_file, std::ios::binary);
  if (!in) usage_exit("cannot read --prefix-file " + a.prefix_file);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  if (text.empty()) usage_exit("--prefix-file " + a.prefix_file + " is empty");
  const std::vector<std::string> prefixes = split_prefixes(text, a.prefixes, a.prefix_bytes);

  std::mt19937 rng(a.seed);
  std::uniform_int_distribution<int> pick(0, a.prefixes - 1);
  std::vector<std::string> prompts;
  for (int i = 0; i < a.requests; ++i) {
    const int k = a.order == "rr" ? i % a.prefixes : pick(rng);
    prompts.push_back(prefixes[size_t(k)] + question(i, rng));
  }

  std::vector<Sample> samples(size_t(a.requests));
  std::atomic<int> next{0};
  const auto t0 = clk::now();
  const auto deadline = t0 + std::chrono::duration<double>(a.timeout_s);
  std::atomic<int> skipped{0};
  std::vector<std::thread> workers;
  for (int w = 0; w < std::min(a.concurrency, a.requests); ++w)
    workers.emplace_back([&] {
      for (int i; (i = next.fetch_add(1)) < a.requests;) {
        if (clk::now() >= deadline) {
          samples[size_t(i)].error = "not sent: --timeout reached";
          skipped.fetch_add(1);
          continue;
        }
        samples[size_t(i)] = run_one(a, prompts[size_t(i)]);
        samples[size_t(i)].end_s = std::chrono::duration<double>(clk::now() - t0).count();
      }
    });
  for (auto& t : workers) t.join();
  const double wall = std::chrono::duration<double>(clk::now() - t0).count();

  std::vector<double> ttft, tpot;
  long tokens = 0, prompt_tokens = 0;
  int with_usage = 0;
  int ok = 0, empty = 0;
  std::string first_error;
  struct ErrorCount {
    int n = 0;
    double first_s = 0, last_s = 0;
  };
  std::map<std::string, ErrorCount> errors;  // failures grouped by message, with when they happened
  for (const auto& s : samples) {
    if (s.empty) ++empty;
    if (!s.ok) {
      if (!s.empty) {
        if (first_error.empty()) first_error = s.error;
        ErrorCount& e = errors[s.error];
        e.first_s = e.n == 0 ? s.end_s : std::min(e.first_s, s.end_s);
        e.last_s = std::max(e.last_s, s.end_s);
        ++e.n;
      }
      continue;
    }
    ++ok;
    tokens += s.tokens;
    if (s.prompt_tokens >= 0) {
      prompt_tokens += s.prompt_tokens;
      ++with_usage;
    }
    ttft.push_back(s.ttft_s);
    if (s.tpot_s >= 0) tpot.push_back(s.tpot_s);
  }
  const double thr = wall > 0 ? double(tokens) / wall : 0;
  const double ttft50 = percentile(ttft, 50) * 1e3, ttft95 = percentile(ttft, 95) * 1e3;
  const double tpot50 = percentile(tpot, 50) * 1e3, tpot95 = percentile(tpot, 95) * 1e3;
  const int failed = a.requests - ok - empty;
  size_t prefix_chars = 0;
  for (const auto& p : prefixes) prefix_chars += p.size();
  std::printf("requests %d ok %d empty %d failed %d (concurrency %d, max_tokens %d, %d prefixes of %zu bytes on average, order %s)\n",
              a.requests, ok, empty, failed, a.concurrency, a.max_tokens, a.prefixes, prefix_chars / prefixes.size(),
              a.order.c_str());
  if (!first_error.empty()) std::printf("first error: %s\n", first_error.c_str());
  for (const auto& [msg, e] : errors)
    std::printf("error x%d (ended at %.1f-%.1f s): %s\n", e.n, e.first_s, e.last_s, msg.c_str());
  std::printf("wall %.2f s, completion tokens %ld, throughput %.2f tok/s\n", wall, tokens, thr);
  std::printf("TTFT ms p50 %.1f p95 %.1f | TPOT ms p50 %.1f p95 %.1f\n", ttft50, ttft95, tpot50, tpot95);
  auto num = [](double x) { return std::isnan(x) ? json(nullptr) : json(std::round(x * 100) / 100); };
  json j = {{"requests", a.requests},
            {"ok", ok},
            {"empty", empty},
            {"failed", failed},
            {"concurrency", a.concurrency},
            {"max_tokens", a.max_tokens},
            {"prefixes", a.prefixes},
            {"order", a.order},
            {"wall_s", num(wall)},
            {"completion_tokens", tokens},
            {"throughput_tok_s", num(thr)},
            {"ttft_ms_p50", num(ttft50)},
            {"ttft_ms_p95", num(ttft95)},
            {"tpot_ms_p50", num(tpot50)},
            {"tpot_ms_p95", num(tpot95)},
            {"ignore_eos", a.ignore_eos},
            {"prompt_tokens_mean", with_usage > 0 ? num(double(prompt_tokens) / with_usage) : json(nullptr)}};
  std::printf("--json %s\n", j.dump().c_str());
  return failed == 0 ? 0 : 1;
}
