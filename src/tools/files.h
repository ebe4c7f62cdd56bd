// Files the subcommands read (prompts, text data, workloads, eval sets): one place that turns a
// missing, unreadable or non-file path into a clear error naming the flag. A directory opens as
// an empty stream on Linux, which would otherwise read as an empty prompt or data file.
#pragma once
#include <string>

namespace kvq {

// Throws kvq::Error naming the flag unless path names something that exists and is not a
// directory (callers open it and report a failure to open).
void check_input_file(const std::string& path, const char* flag);
// The whole file, checked as above; a read error throws too.
std::string read_text_file(const std::string& path, const char* flag);

}  // namespace kvq
