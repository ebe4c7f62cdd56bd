// `kvq serve`: command-line options and the command itself.
#pragma once
#include <string>

#include "engine/engine.h"
#include "server/server.h"

namespace CLI { class App; }

namespace kvq {

struct ServeOptions {
  EngineOptions engine;
  std::string host = "127.0.0.1";
  int port = 8080;
  std::string model_name;
  std::string kv_mem;  // "2GiB", "512MiB", "1e9" ...
  std::string api_key;  // --api-key, else $KVQ_API_KEY; empty: no key asked
  std::string allowed_origins = "*";  // comma-separated; empty: no CORS headers
  int http_threads = ServerOptions{}.http_threads;
};

void serve_add_cli(CLI::App& app, ServeOptions& o);
int serve_command(ServeOptions o);
// "2GiB", "512M", "1000000" -> bytes; throws kvq::Error on anything else.
size_t parse_bytes(const std::string& s);

}  // namespace kvq
