// Self-contained HTML report of a kvq eval run: SVG plots drawn here (no scripts, no network),
// so the file opens anywhere and can be attached to a ticket.
#pragma once
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace kvq {

// eval: the JSON kvq eval prints with --json. Returns the whole HTML document.
std::string report_html(const nlohmann::json& eval);

// bench: the JSON kvq bench prints with --json. Returns the whole HTML document: per load kind
// (clients, request rate), TTFT p50 / p95, throughput and prefix hit rate per format, and the table.
std::string report_bench_html(const nlohmann::json& bench);

// Output files (--json-out, --html, --needle-set-out, calibrate's -o). report_check_writable
// before a long run, so that a bad path fails at once instead of after it: the path must not be a
// directory, nor any of `others` (the run's input files and its other outputs, by file identity,
// so another spelling of the same file counts), and its directory must take a new file. The
// check leaves nothing behind. Both throw kvq::Error naming the flag and the path.
struct ReportPath {
  const char* what;   // e.g. "the model (-m)"
  std::string path;   // empty: not given
};
void report_check_writable(const char* flag, const std::string& path, const std::vector<ReportPath>& others = {});

// A file written whole or not at all: the text goes to a new file beside `path`, which replaces
// `path` (rename) only at commit(); until then an existing file at `path` is untouched, and a
// run that fails or is interrupted before commit() leaves no partial file (the destructor removes
// the temporary one). A path that is a device or a pipe (/dev/stdout, a FIFO) is written in place.
class ReportFile {
 public:
  ReportFile(const char* flag, const std::string& path);
  ~ReportFile();
  ReportFile(const ReportFile&) = delete;
  ReportFile& operator=(const ReportFile&) = delete;
  void write(const std::string& text);
  void commit();

 private:
  const char* flag_;
  std::string path_, tmp_;
  int fd_ = -1;
};
void report_write(const char* flag, const std::string& path, const std::string& text);

// One SVG line chart. series: [{"name": s, "points": [[x, y], ...]}]; log-scale x.
std::string report_svg_lines(const std::string& title, const std::string& x_label, const std::string& y_label,
                             const nlohmann::json& series, bool log_y = false, bool log_x = true);

}  // namespace kvq
