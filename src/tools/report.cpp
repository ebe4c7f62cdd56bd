#include "tools/report.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fmt/format.h>

#include "core/error.h"

namespace kvq {

namespace {

std::string esc(const std::string& s) {
  std::string o;
  for (char c : s) {
    switch (c) {
      case '<': o += "&lt;"; break;
      case '>': o += "&gt;"; break;
      case '&': o += "&amp;"; break;
      case '"': o += "&quot;"; break;
      default: o += c;
    }
  }
  return o;
}

const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
                         "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};

}  // namespace

namespace {

// The path a write lands on: a symbolic link's target (rename would replace the link itself).
std::filesystem::path write_target(const std::string& path) {
  std::error_code ec;
  const std::filesystem::path p(path);
  if (std::filesystem::is_symlink(p, ec)) {
    const std::filesystem::path t = std::filesystem::weakly_canonical(p, ec);
    if (!ec) return t;
  }
  return p;
}

// A new, empty file beside `target` (O_EXCL, the umask's mode); its name in `name`.
int open_beside(const std::filesystem::path& target, std::string& name) {
  static std::atomic<unsigned> counter{0};
  for (int attempt = 0; attempt < 100; ++attempt) {
    name = fmt::format("{}.kvq-tmp-{}-{}", target.string(), ::getpid(), counter.fetch_add(1));
    const int fd = ::open(name.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd >= 0 || errno != EEXIST) return fd;
  }
  errno = EEXIST;
  return -1;
}

}  // namespace

void report_check_writable(const char* flag, const std::string& path, const std::vector<ReportPath>& others) {
  if (path.empty()) return;
  std::error_code ec;
  const std::filesystem::path target = write_target(path);
  if (std::filesystem::is_directory(target, ec)) fail("{}: '{}' is a directory", flag, path);
  for (const ReportPath& o : others) {
    if (o.path.empty()) continue;
    if (o.path == path || std::filesystem::equivalent(target, o.path, ec))
      fail("{}: '{}' is also {}; give the output another path", flag, path, o.what);
  }
  const bool exists = std::filesystem::exists(target, ec);
  if (exists && ::access(target.c_str(), W_OK) != 0) fail("{}: cannot write '{}': {}", flag, path, std::strerror(errno));
  if (exists && !std::filesystem::is_regular_file(target, ec)) return;  // a device or pipe: written in place
  std::string tmp;
  const int fd = open_beside(target, tmp);
  if (fd < 0) fail("{}: cannot write '{}': {}", flag, path, std::strerror(errno));
  ::close(fd);
  ::unlink(tmp.c_str());
}

ReportFile::ReportFile(const char* flag, const std::string& path) : flag_(flag), path_(write_target(path).string()) {
  std::error_code ec;
  if (std::filesystem::exists(path_, ec) && !std::filesystem::is_regular_file(path_, ec)) {
    // A device or pipe (/dev/stdout, a FIFO) is written in place: it has no contents to keep, and
    // a rename would replace the node itself.
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CLOEXEC);
  } else {
    fd_ = open_beside(path_, tmp_);
  }
  if (fd_ < 0) fail("{}: cannot write '{}': {}", flag_, path, std::strerror(errno));
}

ReportFile::~ReportFile() {
  if (fd_ >= 0) ::close(fd_);
  if (!tmp_.empty()) ::unlink(tmp_.c_str());
}

void ReportFile::write(const std::string& text) {
  if (fd_ < 0) fail("{}: '{}' was already written", flag_, path_);
  for (size_t done = 0; done < text.size();) {
    const ssize_t n = ::write(fd_, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) fail("{}: writing '{}' failed: {}", flag_, path_, std::strerror(n < 0 ? errno : EIO));
    done += size_t(n);
  }
}

void ReportFile::commit() {
  if (fd_ < 0) fail("{}: '{}' was already written", flag_, path_);
  const int rc = ::close(fd_);  // a full disk or quota can show here, not at write
  fd_ = -1;
  if (rc != 0) fail("{}: writing '{}' failed: {}", flag_, path_, std::strerror(errno));
  if (tmp_.empty()) return;  // written in place
  if (::rename(tmp_.c_str(), path_.c_str()) != 0)
    fail("{}: cannot replace '{}': {}", flag_, path_, std::strerror(errno));
  tmp_.clear();
}

void report_write(const char* flag, const std::string& path, const std::string& text) {
  ReportFile f(flag, path);
  f.write(text);
  f.commit();
}

std::string report_svg_lines(const std::string& title, const std::string& x_label, const std::string& y_label,
                             const nlohmann::json& series, bool log_y, bool log_x) {
  const double W = 640, H = 360, L = 70, R = 170, T = 30, B = 50;
  double x0 = 1e300, x1 = -1e300, y0 = 1e300, y1 = -1e300;
  auto ty = [&](double y) { return log_y ? std::log10(y) : y; };
  auto tx = [&](double x) { return log_x ? std::log2(x) : x; };
  bool nonneg = true;
  for (const auto& s : series)
    for (const auto& p : s["points"]) {
      const double x = tx(p[0].get<double>()), yv = p[1].get<double>();
      x0 = std::min(x0, x), x1 = std::max(x1, x);
      nonneg = nonneg && yv >= 0;
      if (log_y && !(yv > 0)) continue;  // a zero (the f16 reference's KLD) has no place on a log axis
      y0 = std::min(y0, ty(yv)), y1 = std::max(y1, ty(yv));
    }
  if (x0 > x1) return "<p>(no data)</p>";
  if (y0 > y1) y0 = y1 = log_y ? -6 : 0;  // every value zero
  if (x1 - x0 < 1e-9) x0 -= 0.5, x1 += 0.5;
  if (y1 - y0 < 1e-12) y0 -= 0.5, y1 += 0.5;
  const double pad = 0.05 * (y1 - y0);
  y0 -= pad, y1 += pad;
  if (!log_y && nonneg) y0 = std::max(y0, 0.0);  // no negative ticks for values that cannot be negative
  auto px = [&](double x) { return L + (tx(x) - x0) / (x1 - x0) * (W - L - R); };
  // zeros on a log axis sit on the bottom edge
  auto py = [&](double y) { return T + (1 - ((log_y && !(y > 0) ? y0 : ty(y)) - y0) / (y1 - y0)) * (H - T - B); };
  std::string s = fmt::format("<svg xmlns='http://www.w3.org/2000/svg' width='{}' height='{}' font-family='sans-serif' font-size='11'>", W, H);
  s += fmt::format("<text x='{}' y='18' font-size='14' font-weight='bold'>{}</text>", L, esc(title));
  s += fmt::format("<rect x='{}' y='{}' width='{}' height='{}' fill='none' stroke='#999'/>", L, T, W - L - R, H - T - B);
  for (int i = 0; i <= 4; ++i) {  // y grid
    const double v = y0 + (y1 - y0) * i / 4.0;
    const double yy = T + (1 - i / 4.0) * (H - T - B);
    const double shown = log_y ? std::pow(10.0, v) : v;
    s += fmt::format("<line x1='{}' x2='{}' y1='{:.1f}' y2='{:.1f}' stroke='#eee'/><text x='{}' y='{:.1f}' text-anchor='end'>{:.3g}</text>",
                     L, W - R, yy, yy, L - 4, yy + 4, shown);
  }
  for (const auto& ser : series)  // x ticks at the data points (the first series's)
    for (const auto& p : ser["points"]) {
      if (&ser != &series[0]) break;
      const double x = p[0].get<double>();
      s += fmt::format("<text x='{:.1f}' y='{}' text-anchor='middle'>{:g}</text>", px(x), H - B + 14, x);
    }
  s += fmt::format("<text x='{}' y='{}' text-anchor='middle'>{}</text>", L + (W - L - R) / 2, H - 12, esc(x_label));
  s += fmt::format("<text x='14' y='{}' transform='rotate(-90 14 {})' text-anchor='middle'>{}</text>", T + (H - T - B) / 2,
                   T + (H - T - B) / 2, esc(y_label));
  int k = 0;
  for (const auto& ser : series) {
    const char* col = kColors[k % 10];
    std::string pts;
    for (const auto& p : ser["points"]) pts += fmt::format("{:.1f},{:.1f} ", px(p[0].get<double>()), py(p[1].get<double>()));
    s += fmt::format("<polyline fill='none' stroke='{}' stroke-width='2' points='{}'/>", col, pts);
    for (const auto& p : ser["points"])
      s += fmt::format("<circle cx='{:.1f}' cy='{:.1f}' r='3' fill='{}'/>", px(p[0].get<double>()), py(p[1].get<double>()), col);
    s += fmt::format("<rect x='{}' y='{}' width='10' height='10' fill='{}'/><text x='{}' y='{}'>{}</text>", W - R + 10, T + 14 * k, col,
                     W - R + 24, T + 14 * k + 9, esc(ser["name"].get<std::string>()));
    ++k;
  }
  return s + "</svg>";
}

std::string report_html(const nlohmann::json& ev) {
  std::string h = "<!DOCTYPE html><html><head><meta charset='utf-8'><title>kvq eval</title><style>"
                  "body{font-family:sans-serif;margin:24px;max-width:1100px}table{border-collapse:collapse;margin:8px 0}"
                  "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}th{background:#f4f4f4}"
                  ".ok{background:#b7e1b0}.miss{background:#f3b0a8}.part{background:#f6e3a1}</style></head><body>";
  h += fmt::format("<h1>kvq eval: {}</h1><p>model file {}</p>", esc(ev.value("model", std::string("?"))),
                   esc(ev.value("model_file", std::string("?"))));
  const auto& fmts = ev["formats"];
  bool any_ppl = false;
  for (const auto& f : fmts) any_ppl |= !f["buckets"].empty();
  if (any_ppl) {
    nlohmann::json dppl = nlohmann::json::array(), kld = nlohmann::json::array(), agree = nlohmann::json::array();
    for (const auto& f : fmts) {
      nlohmann::json a = nlohmann::json::array(), b = a, c = a;
      for (const auto& bk : f["buckets"]) {
        a.push_back({bk["ctx"], bk["delta_ppl_pct"]});
        b.push_back({bk["ctx"], bk["kld_mean"]});
        c.push_back({bk["ctx"], 100.0 * bk["top1_agree"].get<double>()});
      }
      const std::string name = f["format"].get<std::string>();
      dppl.push_back({{"name", name}, {"points", a}});
      kld.push_back({{"name", name}, {"points", b}});
      agree.push_back({{"name", name}, {"points", c}});
    }
    h += "<h2>Quality vs context length (against the f16 cache)</h2>";
    h += report_svg_lines("Delta perplexity", "context (tokens)", "delta PPL %", dppl);
    h += report_svg_lines("Mean KL divergence", "context (tokens)", "KLD (log scale)", kld, true);
    h += report_svg_lines("Top-1 agreement with f16", "context (tokens)", "%", agree);
    h += "<table><tr><th>format</th><th>bits/elem</th><th>ctx</th><th>PPL</th><th>f16 PPL</th><th>dPPL %</th><th>KLD mean</th>"
         "<th>KLD p99</th><th>top-1</th></tr>";
    for (const auto& f : fmts)
      for (const auto& bk : f["buckets"])
        h += fmt::format("<tr><td style='text-align:left'>{}</td><td>{:.2f}</td><td>{}</td><td>{:.4f}</td><td>{:.4f}</td><td>{:+.3f}</td>"
                         "<td>{:.6f}</td><td>{:.6f}</td><td>{:.2f}%</td></tr>",
                         esc(f["format"].get<std::string>()), bk.value("bits_per_element", f["bits_per_element"].get<double>()),
                         bk["ctx"].get<int>(),
                         bk["ppl"].get<double>(), bk["base_ppl"].get<double>(), bk["delta_ppl_pct"].get<double>(),
                         bk["kld_mean"].get<double>(), bk["kld_p99"].get<double>(), 100 * bk["top1_agree"].get<double>());
    h += "</table>";
  }
  bool any_needle = false;
  for (const auto& f : fmts) any_needle |= f.contains("needle");
  if (any_needle) {
    h += "<h2>Needle in a haystack</h2><p>Rows: context length; columns: needle depth (% of the context). Green: retrieved (k/n: k of n trials, yellow when some).</p>";
    for (const auto& f : fmts) {
      if (!f.contains("needle")) continue;
      std::string paired;
      if (f["needle"].contains("vs_f16")) {
        const auto& v = f["needle"]["vs_f16"];
        paired = fmt::format("; f16 {:.0f}%: {} trials lost, {} gained, sign test p = {:.3g}",
                             100 * f.value("needle_f16", 0.0), v["lost"].get<int>(), v["gained"].get<int>(),
                             v["p_value"].get<double>());
      }
      h += fmt::format("<h3>{} ({:.0f}%{})</h3><table>", esc(f["format"].get<std::string>()),
                       100 * f["needle"]["accuracy"].get<double>(), paired);
      std::vector<int> ctxs, depths;
      for (const auto& g : f["needle"]["grid"]) {
        ctxs.push_back(g["ctx"].get<int>());
        depths.push_back(g["depth"].get<int>());
      }
      std::sort(ctxs.begin(), ctxs.end());
      ctxs.erase(std::unique(ctxs.begin(), ctxs.end()), ctxs.end());
      std::sort(depths.begin(), depths.end());
      depths.erase(std::unique(depths.begin(), depths.end()), depths.end());
      h += "<tr><th>ctx \\ depth</th>";
      for (int d : depths) h += fmt::format("<th>{}%</th>", d);
      h += "</tr>";
      for (int c : ctxs) {
        h += fmt::format("<tr><th>{}</th>", c);
        for (int d : depths) {
          // A cell holds one trial per --needles: "yes" / "no" for one, "k/n" for several.
          int n = 0, ok = 0;
          for (const auto& g : f["needle"]["grid"])
            if (g["ctx"].get<int>() == c && g["depth"].get<int>() == d) {
              ++n;
              ok += g["ok"].get<bool>() ? 1 : 0;
            }
          if (n == 0) h += "<td></td>";
          else if (n == 1) h += ok ? "<td class='ok'>yes</td>" : "<td class='miss'>no</td>";
          else h += fmt::format("<td class='{}'>{}/{}</td>", ok == n ? "ok" : ok == 0 ? "miss" : "part", ok, n);
        }
        h += "</tr>";
      }
      h += "</table>";
    }
  }
  bool any_layers = false;
  for (const auto& f : fmts) any_layers |= f.contains("layers");
  if (any_layers) {
    h += "<h2>Per-layer sensitivity</h2><p>Relative error of each layer's attention output when only that layer's K "
         "(or V) uses the format, all else f16. High layers are candidates for --kv-cache-dtype-skip-layers or --kv-layer.</p>";
    for (const auto& f : fmts) {
      if (!f.contains("layers")) continue;
      nlohmann::json k = nlohmann::json::array(), v = nlohmann::json::array();
      for (const auto& e : f["layers"]["per_layer"]) {
        k.push_back({e["layer"], e["k_rel_err"]});
        v.push_back({e["layer"], e["v_rel_err"]});
      }
      h += report_svg_lines(f["format"].get<std::string>() + ": per-layer relative error", "layer", "relative error",
                            nlohmann::json::array({{{"name", "K quantized"}, {"points", k}}, {{"name", "V quantized"}, {"points", v}}}),
                            false, false);
    }
  }
  if (ev.contains("policies")) {
    h += "<h2>Per-layer policies within a bit budget</h2><p>Each layer's K and V format chosen among the formats "
         "above to minimize the summed squared per-layer error at the budget (kvq eval --budget-bits); the other "
         "sections evaluate them as policy@B.</p><table><tr><th>policy</th><th>bits / element</th><th>summed squared "
         "relative error</th><th>flags</th></tr>";
    for (const auto& p : ev["policies"])
      h += fmt::format("<tr><td style='text-align:left'>{}</td><td>{:.2f}</td><td>{:.4g}</td><td style='text-align:left'><code>{}</code></td></tr>",
                       esc(p["format"].get<std::string>()), p["bits_per_element"].get<double>(),
                       p["sum_sq_rel_err"].get<double>(), esc(p["flags"].get<std::string>()));
    h += "</table>";
  }
  bool any_own = false;
  for (const auto& f : fmts) any_own |= f.contains("own");
  if (any_own) {
    h += "<h2>Your eval set</h2><p>Lost / gained: cases the f16 cache got right and the format missed, and the "
         "reverse; p: exact sign test of that split.</p><table><tr><th>format</th><th>accuracy</th><th>cases</th>"
         "<th>lost</th><th>gained</th><th>p</th></tr>";
    for (const auto& f : fmts)
      if (f.contains("own_f16")) {
        h += fmt::format("<tr><td style='text-align:left'>f16</td><td>{:.1f}%</td><td>{}</td><td>-</td><td>-</td><td>-</td></tr>",
                         100 * f["own_f16"].get<double>(), f["own_f16_ok"].size());
        break;
      }
    for (const auto& f : fmts)
      if (f.contains("own")) {
        const auto& v = f["own"]["vs_f16"];
        h += fmt::format("<tr><td style='text-align:left'>{}</td><td>{:.1f}%</td><td>{}</td><td>{}</td><td>{}</td><td>{:.3g}</td></tr>",
                         esc(f["format"].get<std::string>()), 100 * f["own"]["accuracy"].get<double>(),
                         f["own"]["n"].get<int>(), v["lost"].get<int>(), v["gained"].get<int>(), v["p_value"].get<double>());
      }
    h += "</table>";
  }
  return h + "</body></html>\n";
}

std::string report_bench_html(const nlohmann::json& b) {
  std::string h = "<!DOCTYPE html><html><head><meta charset='utf-8'><title>kvq bench</title><style>"
                  "body{font-family:sans-serif;margin:24px;max-width:1100px}table{border-collapse:collapse;margin:8px 0}"
                  "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}th{background:#f4f4f4}</style></head><body>";
  const nlohmann::json& w = b["workload"];
  const nlohmann::json budgets = b.value("kv_mem_bytes", nlohmann::json::array());
  h += fmt::format("<h1>kvq bench: {}</h1><p>model file {}, KV budget(s) {} bytes, context {}</p>",
                   esc(b.value("model", std::string("?"))), esc(b.value("model_file", std::string("?"))),
                   esc(budgets.dump()), b.value("ctx", 0));
  // A series per format, or per (format, TPOT target, budget) when several were swept.
  const nlohmann::json sched = b.value("scheduler", nlohmann::json::object());
  const bool several_targets = sched.contains("tpot_target_ms") && sched["tpot_target_ms"].is_array() &&
                               sched["tpot_target_ms"].size() > 1;
  const bool several_tiers = b.contains("kv_offload_bytes") && b["kv_offload_bytes"].is_array() &&
                             b["kv_offload_bytes"].size() > 1;
  const auto bytes_name = [](double v) {
    return v >= 1073741824.0 ? fmt::format("{:g} GiB", v / 1073741824.0)
           : v >= 1048576.0  ? fmt::format("{:g} MiB", v / 1048576.0)
                             : fmt::format("{:g} KiB", v / 1024.0);
  };
  // The run's format, with its target and offload tier when several were swept.
  auto run_label = [&](const nlohmann::json& r) {
    std::string n = r["format"].get<std::string>();
    if (several_targets && r.value("tpot_target_ms", 0.0) > 0) n += fmt::format(" @{:g}ms", r.value("tpot_target_ms", 0.0));
    if (several_tiers && r.value("kv_offload_bytes", 0.0) > 0) n += " +" + bytes_name(r.value("kv_offload_bytes", 0.0)) + " tier";
    return n;
  };
  auto series_name = [&](const nlohmann::json& r) {
    std::string n = run_label(r);
    if (budgets.size() > 1) n += " @ " + bytes_name(r["kv_mem_bytes"].get<double>());
    return n;
  };
  h += "<p>workload: " + esc(w.dump()) + "</p>";
  // One chart per metric and load kind, x = clients or requests per second, one series per format.
  for (const char* kind : {"concurrency", "rate"}) {
    const bool clients = std::string(kind) == "concurrency";
    std::vector<std::string> names;
    for (const auto& r : b["runs"])
      if (r["fits"].get<bool>() && !r[kind].is_null() &&
          std::find(names.begin(), names.end(), series_name(r)) == names.end())
        names.push_back(series_name(r));
    if (names.empty()) continue;
    struct Metric {
      const char* key;
      const char* label;
      double mul;
      bool log_y;
    };
    for (const Metric m : {Metric{"ttft_p50_s", "TTFT p50 (ms)", 1e3, true}, Metric{"ttft_p95_s", "TTFT p95 (ms)", 1e3, true},
                           Metric{"tpot_p50_s", "TPOT p50 (ms)", 1e3, false},
                           Metric{"throughput_tok_s", "generated tokens/s", 1.0, false},
                           Metric{"prefix_hit_rate", "prefix hit rate", 1.0, false}}) {
      nlohmann::json series = nlohmann::json::array();
      for (const auto& n : names) {
        nlohmann::json pts = nlohmann::json::array();
        for (const auto& r : b["runs"])
          if (series_name(r) == n && r["fits"].get<bool>() && !r[kind].is_null() && !r[m.key].is_null())
            pts.push_back({r[kind].get<double>(), m.mul * r[m.key].get<double>()});
        series.push_back({{"name", n}, {"points", pts}});
      }
      h += report_svg_lines(m.label, clients ? "clients (closed loop)" : "requests per second (Poisson arrivals)",
                            m.label, series, m.log_y);
    }
  }
  h += "<h2>Runs</h2><table><tr><th>format</th><th>KV bytes</th><th>KV tokens</th><th>bytes/token</th><th>load</th><th>ok / requests</th>"
       "<th>tok/s</th><th>TTFT p50 (ms)</th><th>TTFT p95 (ms)</th><th>TPOT p50 (ms)</th><th>TPOT p95 (ms)</th>"
       "<th>prefix hit rate</th><th>preemptions</th></tr>";
  auto ms = [](const nlohmann::json& v) { return v.is_null() ? std::string("-") : fmt::format("{:.1f}", 1e3 * v.get<double>()); };
  for (const auto& r : b["runs"]) {
    const std::string load = r["concurrency"].is_null() ? fmt::format("{} req/s", r["rate"].get<double>())
                                                        : fmt::format("{} clients", r["concurrency"].get<int>());
    if (!r["fits"].get<bool>()) {
      // without windows a budget that does not fit fails every load alike (one row)
      const bool per_load = r.value("window_reserve_bytes", size_t(0)) > 0;
      h += fmt::format("<tr><td>{}</td><td>{}</td><td>{}</td><td>{:.0f}</td><td>{}</td><td colspan='8' "
                       "style='text-align:left'>the longest request does not fit in the budget{}</td></tr>",
                       esc(r["format"].get<std::string>()), r["kv_mem_bytes"].get<size_t>(), r["kv_tokens"].get<size_t>(),
                       r["kv_bytes_per_token"].get<double>(), per_load ? load : std::string("every load"),
                       per_load ? " after the f32 windows of the sequences this load runs at once" : "");
      continue;
    }
    h += fmt::format(
        "<tr><td>{}</td><td>{}</td><td>{}</td><td>{:.0f}</td><td>{}</td><td>{} / {}</td><td>{:.1f}</td><td>{}</td>"
        "<td>{}</td><td>{}</td><td>{}</td><td>{:.2f}{}</td><td>{}</td></tr>",
        esc(run_label(r)),
        r["kv_mem_bytes"].get<size_t>(), r["kv_tokens"].get<size_t>(), r["kv_bytes_per_token"].get<double>(), load,
        r["ok"].get<int>(), r["requests"].get<int>(), r["throughput_tok_s"].get<double>(), ms(r["ttft_p50_s"]),
        ms(r["ttft_p95_s"]), ms(r["tpot_p50_s"]), ms(r["tpot_p95_s"]), r["prefix_hit_rate"].get<double>(),
        r["prefix_cache"].get<bool>() ? "" : " (no sharing: residual window)", r["preemptions"].get<uint64_t>());
  }
  h += "</table></body></html>\n";
  return h;
}

}  // namespace kvq
