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
  std::string chat_template_file;  // --chat-template-file: a template instead of the model's
  std::string chat_template_kwargs;  // --chat-template-kwargs: {"enable_thinking": false} (a reasoning template's switch)
  std::string kv_mem;  // "2GiB", "512MiB", "1e9" ...
  std::string kv_offload_size;  // the same kind of size
  std::string api_key;  // --api-key, else $KVQ_API_KEY; empty: no key asked
  std::string allowed_origins = "*";  // comma-separated; empty: no CORS headers
  int http_threads = ServerOptions{}.http_threads;
  std::string scheduling_policy = "fcfs";  // --scheduling-policy: fcfs | priority
  int reasoning_budget = -1;             // --reasoning-budget
  std::string reasoning_budget_message;  // --reasoning-budget-message
};

void serve_add_cli(CLI::App& app, ServeOptions& o);
// --kv-offload-dir and --kv-offload-size (kvq serve and kvq bench): the help texts.
inline constexpr const char* kKvOffloadDirHelp =
    "directory for the KV offload tier's file (an SSD, not a RAM disk; created there and unlinked at once, unless "
    "kvq serve's --kv-offload-persist keeps it): cached prefix pages the pool evicts are written there and read "
    "back, instead of recomputed, by the next request with that prefix";
inline constexpr const char* kKvOffloadSizeHelp =
    "size of the KV offload tier (e.g. 8GiB; with --kv-offload-dir); pages in the cache's format, so a 4-bit "
    "cache keeps ~4x the prefixes of f16";
inline constexpr const char* kKvOffloadDirectHelp =
    "read and write the offload tier with O_DIRECT, past the OS page cache: the tier then takes no memory beyond "
    "the KV pool, and every page read back comes from the device";
inline constexpr const char* kKvOffloadPersistHelp =
    "keep the offload tier's file (DIR/kvq-offload-<id>.kvq, <id> naming the model's content and the KV "
    "configuration) when the server stops, after writing the pool's cached prefixes to it, and start from it "
    "the next time: the prefixes kept are read back instead of recomputed after a restart";
int serve_command(ServeOptions o);
// "2GiB", "512M", "1000000" -> bytes; throws kvq::Error on anything else.
size_t parse_bytes(const std::string& s);

}  // namespace kvq
