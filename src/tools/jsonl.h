// JSONL input files (eval's --own set, bench's --workload): one JSON value per line.
#pragma once
#include <functional>
#include <string>

#include <nlohmann/json.hpp>

namespace kvq {

// Calls fn(value, line_number) for every non-blank line of path, in order. Throws kvq::Error
// naming `flag`, the file and the line when the file cannot be read or a line is not JSON (fn
// throws its own errors for lines of the wrong shape). Returns the number of values read.
size_t jsonl_for_each(const std::string& path, const char* flag,
                      const std::function<void(const nlohmann::json& value, int line)>& fn);

}  // namespace kvq
