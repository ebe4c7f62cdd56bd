#include "tools/formats.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "kv/calib.h"
#include "kvq/kv_format.h"
#if __has_include("kv/turboquant.h")
#include "kv/turboquant.h"
#define KVQ_FORMATS_HAVE_TQ 1
#endif

namespace kvq {

namespace {

struct CodecStats {
  bool ok = false;           // codec could be built for this dim
  std::string error;         // why not
  bool needs_calib = false;  // calibrated codec: distortion not measured (depends on the scales)
  double bits = 0;           // effective bits per element at ctx
  double code_bits = 0;
  bool measured = false;
  double mse = 0;            // E ||x - x^||^2 over unit vectors x
  double ip_bias = 0;        // E[<q, x^> - <q, x>], q, x unit
  double ip_rmse = 0;        // sqrt E[(<q, x^> - <q, x>)^2]
  double ip_rel_rms = 0;     // ip_rmse / rms(<q, x>)
  double mse_theory = NAN;   // where the format has a known value (TurboQuant's Lloyd-Max MSE)
};

// Calibration values used only to build calibrated codecs for listing their size (the bits do not
// depend on the scales or the channel means). One head of `dim` channels.
const nlohmann::json& listing_calib(int dim) {
  static std::map<int, nlohmann::json> by_dim;
  auto it = by_dim.find(dim);
  if (it == by_dim.end()) it = by_dim.emplace(dim, kv_placeholder_calib(1, 1, dim)).first;
  return it->second;
}

double theory_mse(const std::string& codec, int dim) {
#if defined(KVQ_FORMATS_HAVE_TQ)
  // Plain TurboQuant MSE codecs at integer bits: the Lloyd-Max distortion of the rotated density.
  if (codec.size() >= 3 && codec.rfind("tq", 0) == 0 && codec[2] >= '1' && codec[2] <= '4' &&
      (codec.size() == 3 || codec.substr(3) == "_dense"))
    return tq_lloyd_max_mse(codec[2] - '0', dim);
#else
  (void)codec;
  (void)dim;
#endif
  return NAN;
}

CodecStats measure(const std::string& name, KvRole role, const FormatsOptions& opt) {
  CodecStats st;
  KvCodecParams p;
  p.head_dim = opt.dim;
  p.n_kv_heads = 1;
  p.role = role;
  std::unique_ptr<KvCodec> c;
  try {
    c = kv_codec_create(name, p);
  } catch (const Error& e) {
    p.calib = &listing_calib(opt.dim);
    try {
      c = kv_codec_create(name, p);
      st.needs_calib = true;
    } catch (const Error&) {
      st.error = e.what();
      return st;
    }
  }
  try {  // a codec whose token group does not fit the page (e.g. G = 32 in 16-token pages) is a row of n/a
    st.bits = kv_codec_effective_bits(*c, opt.block_tokens, opt.ctx);
  } catch (const Error& e) {
    st.error = e.what();
    return st;
  }
  st.ok = true;
  st.code_bits = c->info().code_bits;
  st.mse_theory = theory_mse(name, opt.dim);
  if (!opt.distortion || st.needs_calib) return st;

  // Unit vectors encoded one block at a time (grouped codecs quantize G tokens together).
  const int d = opt.dim;
  const int G = std::max(1, c->info().group_tokens);
  const int bt = ((opt.block_tokens + G - 1) / G) * G;
  std::mt19937_64 rng(opt.seed);
  std::normal_distribution<float> nd;
  auto unit = [&](float* v) {
    double s = 0;
    for (int i = 0; i < d; ++i) {
      v[i] = nd(rng);
      s += double(v[i]) * v[i];
    }
    const float inv = float(1 / std::sqrt(s));
    for (int i = 0; i < d; ++i) v[i] *= inv;
  };
  std::vector<float> x(size_t(bt) * size_t(d)), y(x.size()), q(static_cast<size_t>(d));
  std::vector<uint8_t> blk(c->block_bytes(bt));
  double se = 0, eb = 0, e2 = 0, t2 = 0;
  long count = 0;
  for (int done = 0; done < opt.trials; done += bt) {
    for (int t = 0; t < bt; ++t) unit(x.data() + size_t(t) * size_t(d));
    c->encode(0, x.data(), size_t(d), bt, blk.data(), bt, 0, 0);
    c->decode(0, blk.data(), bt, 0, bt, 0, y.data());
    const int n = std::min(bt, opt.trials - done);
    for (int t = 0; t < n; ++t) {
      unit(q.data());
      const float* xt = x.data() + size_t(t) * size_t(d);
      const float* yt = y.data() + size_t(t) * size_t(d);
      double err = 0, ip = 0, ipq = 0;
      for (int i = 0; i < d; ++i) {
        err += double(yt[i] - xt[i]) * double(yt[i] - xt[i]);
        ip += double(q[size_t(i)]) * xt[i];
        ipq += double(q[size_t(i)]) * yt[i];
      }
      se += err;
      eb += ipq - ip;
      e2 += (ipq - ip) * (ipq - ip);
      t2 += ip * ip;
      ++count;
    }
  }
  st.measured = true;
  st.mse = se / double(count);
  st.ip_bias = eb / double(count);
  st.ip_rmse = std::sqrt(e2 / double(count));
  st.ip_rel_rms = t2 > 0 ? st.ip_rmse / std::sqrt(t2 / double(count)) : 0;
  return st;
}

nlohmann::json stats_json(const std::string& codec, const CodecStats& s) {
  nlohmann::json j = {{"codec", codec}};
  if (!s.ok) {
    j["error"] = s.error;
    return j;
  }
  j["bits"] = s.bits;
  j["code_bits"] = s.code_bits;
  j["needs_calibration"] = s.needs_calib;
  if (s.measured) {
    j["mse"] = s.mse;
    j["ip_bias"] = s.ip_bias;
    j["ip_rmse"] = s.ip_rmse;
    j["ip_rel_rms"] = s.ip_rel_rms;
  }
  j["mse_theory"] = std::isnan(s.mse_theory) ? nlohmann::json(nullptr) : nlohmann::json(s.mse_theory);
  return j;
}

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ",") + x;
  return s;
}

}  // namespace

int formats_command(const FormatsOptions& opt, std::FILE* out) {
  if (opt.dim < 8 || opt.dim > 1024) fail("formats: --dim {} out of range (8..1024)", opt.dim);
  if (opt.trials < 1 || opt.trials > 10000000) fail("formats: --trials {} out of range (1..10^7)", opt.trials);
  if (opt.ctx < 1) fail("formats: --ctx {} must be positive", opt.ctx);
  if (opt.block_tokens < 16 || opt.block_tokens > 256 || (opt.block_tokens & (opt.block_tokens - 1)))
    fail("formats: --page-tokens {} must be a power of two in 16..256", opt.block_tokens);

  std::map<std::pair<std::string, int>, CodecStats> cache;  // codecs are shared between formats
  auto stats = [&](const std::string& name, KvRole role) -> const CodecStats& {
    auto key = std::make_pair(name, int(role));
    auto it = cache.find(key);
    if (it == cache.end()) it = cache.emplace(key, measure(name, role, opt)).first;
    return it->second;
  };

  if (opt.json) {
    nlohmann::json arr = nlohmann::json::array();
    for (const auto& f : kv_formats()) {
      const CodecStats& k = stats(f.k_codec, KvRole::key);
      const CodecStats& v = stats(f.v_codec, KvRole::value);
      nlohmann::json j = {{"name", f.name}, {"aliases", f.aliases}, {"description", f.description},
                          {"k", stats_json(f.k_codec, k)}, {"v", stats_json(f.v_codec, v)}};
      j["bits"] = (k.ok && v.ok) ? nlohmann::json((k.bits + v.bits) / 2) : nlohmann::json(nullptr);
      arr.push_back(j);
    }
    nlohmann::json top = {{"dim", opt.dim}, {"ctx", opt.ctx}, {"block_tokens", opt.block_tokens},
                          {"formats", arr}};
    if (opt.distortion) top["trials"] = opt.trials;
    std::fprintf(out, "%s\n", top.dump(2).c_str());
    return 0;
  }

  std::fprintf(out, "KV formats (head_dim %d, ctx %d, block %d tokens; bits = codes + scales + zeros + norms,\n"
                    "residual window amortized at ctx; 'bits' = mean of K and V)\n\n",
               opt.dim, opt.ctx, opt.block_tokens);
  // Columns as wide as their longest entry (at least the usual widths).
  int wn = 18, wc = 16;
  for (const auto& f : kv_formats()) {
    wn = std::max(wn, int(f.name.size()));
    wc = std::max({wc, int(f.k_codec.size()), int(f.v_codec.size())});
  }
  std::fprintf(out, "%-*s %-28s %-*s %-*s %6s %6s %6s  %s\n", wn, "format", "aliases", wc, "K codec", wc, "V codec",
               "K bits", "V bits", "bits", "description");
  for (const auto& f : kv_formats()) {
    const CodecStats& k = stats(f.k_codec, KvRole::key);
    const CodecStats& v = stats(f.v_codec, KvRole::value);
    auto b = [](const CodecStats& s) { return s.ok ? fmt::format("{:.3f}", s.bits) : std::string("n/a"); };
    const std::string mean = (k.ok && v.ok) ? fmt::format("{:.3f}", (k.bits + v.bits) / 2) : "n/a";
    std::fprintf(out, "%-*s %-28s %-*s %-*s %6s %6s %6s  %s\n", wn, f.name.c_str(), join(f.aliases).c_str(), wc,
                 f.k_codec.c_str(), wc, f.v_codec.c_str(), b(k).c_str(), b(v).c_str(), mean.c_str(),
                 f.description.c_str());
  }
  if (opt.distortion) {
    std::fprintf(out, "\nDistortion on %d random unit vectors of dim %d (per codec; MSE = E||x - x^||^2,\n"
                      "ip = <q, x^> - <q, x> for a random unit q; rel = RMS(ip) / RMS(<q, x>))\n\n",
                 opt.trials, opt.dim);
    std::fprintf(out, "%-16s %-5s %7s %11s %11s %11s %11s %8s\n", "codec", "role", "bits", "mse", "mse_theory",
                 "ip_bias", "ip_rmse", "ip_rel");
    for (const auto& [key, s] : cache) {
      const char* role = key.second == int(KvRole::key) ? "K" : "V";
      if (!s.ok) {
        std::fprintf(out, "%-16s %-5s %s\n", key.first.c_str(), role, s.error.c_str());
      } else if (!s.measured) {
        std::fprintf(out, "%-16s %-5s %7.3f  (needs calibration scales: not measured)\n", key.first.c_str(), role,
                     s.bits);
      } else {
        const std::string th = std::isnan(s.mse_theory) ? "-" : fmt::format("{:.4g}", s.mse_theory);
        std::fprintf(out, "%-16s %-5s %7.3f %11.4g %11s %11.3g %11.4g %8.4f\n", key.first.c_str(), role, s.bits,
                     s.mse, th.c_str(), s.ip_bias, s.ip_rmse, s.ip_rel_rms);
      }
    }
  }
  return 0;
}

}  // namespace kvq
