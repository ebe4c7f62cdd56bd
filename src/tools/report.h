// Self-contained HTML report of a kvq eval run: SVG plots drawn here (no scripts, no network),
// so the file opens anywhere and can be attached to a ticket.
#pragma once
#include <string>

#include <nlohmann/json.hpp>

namespace kvq {

// eval: the JSON kvq eval prints with --json. Returns the whole HTML document.
std::string report_html(const nlohmann::json& eval);

// bench: the JSON kvq bench prints with --json. Returns the whole HTML document: per load kind
// (clients, request rate), TTFT p50 / p95, throughput and prefix hit rate per format, and the table.
std::string report_bench_html(const nlohmann::json& bench);

// Report files (--json-out, --html): report_check_writable before a long run, so that a bad
// path fails at once instead of after it; report_write at the end. Both throw kvq::Error naming
// the flag and the path.
void report_check_writable(const char* flag, const std::string& path);
void report_write(const char* flag, const std::string& path, const std::string& text);

// One SVG line chart. series: [{"name": s, "points": [[x, y], ...]}]; log-scale x.
std::string report_svg_lines(const std::string& title, const std::string& x_label, const std::string& y_label,
                             const nlohmann::json& series, bool log_y = false, bool log_x = true);

}  // namespace kvq
