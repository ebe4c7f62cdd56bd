// OpenAI-compatible HTTP front end of an Engine (cpp-httplib, one thread per connection):
//   POST /v1/completions, POST /v1/chat/completions (stream via SSE "data: {...}\n\n", ending with
//   "data: [DONE]\n\n"), Anthropic's POST /v1/messages and /v1/messages/count_tokens (anthropic.h:
//   its events and error form), OpenAI's Responses API, POST /v1/responses, GET and DELETE
//   /v1/responses/{id} (responses.h), GET /v1/models, GET /health, GET /metrics (Prometheus text format).
// Every request body is validated here, at the edge: bad input gets a 400 with an OpenAI-style
// error object {"error": {"message", "type", "param", "code"}}; unknown routes a 404; with an API
// key, a request without it a 401.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "engine/engine.h"

namespace kvq {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8080;          // 0: any free port (bind() returns it)
  std::string model_name;   // the id /v1/models reports (default: the model file's stem)
  // Connections served at once: each open connection holds one thread while its request waits
  // for the engine or streams, and /health and /metrics need a free one too.
  int http_threads = 1024;
  // Non-empty: every route but /health and /metrics needs "Authorization: Bearer <api_key>" (or
  // "X-Api-Key: <api_key>"); others get OpenAI's 401 invalid_api_key.
  std::string api_key;
  // Cross-origin requests (browser clients): an Origin in this list, or any with "*", gets
  // Access-Control-Allow-Origin on every response, and OPTIONS preflights are answered (without
  // the API key, which browsers do not send on them). Empty: no CORS headers. Default "*", as vLLM.
  std::vector<std::string> allowed_origins = {"*"};
  // A chat template (Jinja text) to read instead of the model's (--chat-template-file); empty: the model's.
  std::string chat_template;
  // A reasoning template's default for chat_template_kwargs.enable_thinking (--chat-template-kwargs)
  bool enable_thinking = true;
  // The default bound on a reply's reasoning, in tokens (--reasoning-budget, llama.cpp's; < 0: none),
  // and the message written before the block's end when it is spent (--reasoning-budget-message):
  // see chat_reasoning_budget (model/chat.h). A request's thinking_token_budget overrides it.
  int reasoning_budget = -1;
  std::string reasoning_budget_message;
};

class Server {
 public:
  Server(Engine& engine, const ServerOptions& o);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Binds the listening socket; returns the port. Throws kvq::Error when it cannot.
  int bind();
  // Serves until stop() (call bind() first).
  void listen();
  // Stops listening and closes the connections once their handlers return (in-flight requests
  // run to their end first).
  void stop();
  // SIGTERM / SIGINT: every in-flight and queued request ends now (non-streaming ones answered
  // 503, streams with an error event and [DONE]), then stop(); waits at most drain_s for the
  // engine to end them.
  void shutdown(double drain_s = 5.0);

 private:
  void widen_backlog();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Whether a request's headers carry the key: "Authorization: Bearer <key>" (the scheme's case
// ignored) or "X-Api-Key: <key>", compared in time independent of where they differ.
bool api_key_matches(const std::string& authorization, const std::string& x_api_key, const std::string& key);

// Prometheus text exposition of the engine's metrics.
std::string metrics_prometheus(const EngineMetrics& m);

}  // namespace kvq
