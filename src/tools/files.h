// Files the subcommands read (prompts, text data, workloads, eval sets): one place that turns a
// missing, unreadable or non-file path into a clear error naming the flag. A directory opens as
// an empty stream on Linux, which would otherwise read as an empty prompt or data file.
#pragma once
#include <optional>
#include <string>

namespace kvq {

// Throws kvq::Error naming the flag unless path names something that exists and is not a
// directory (callers open it and report a failure to open).
void check_input_file(const std::string& path, const char* flag);
// The whole file, checked as above; a read error throws too.
std::string read_text_file(const std::string& path, const char* flag);
// --chat-template-file: the template's text (nullopt for an empty path: the model's own). Throws
// kvq::Error when it is none of the families kvq renders.
std::optional<std::string> read_chat_template_file(const std::string& path);

}  // namespace kvq
