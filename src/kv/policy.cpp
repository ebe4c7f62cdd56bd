#include "kv/policy.h"

#include <algorithm>
#include <cctype>
#include <charconv>

#include "core/error.h"
#include "kvq/kv_format.h"

namespace kvq {

namespace {

// "FMT" (K and V of one format) or "KFMT/VFMT" (K codec of one format, V codec of another);
// shared by whole-model formats and --kv-layer overrides. `where` names the value in errors (e.g.
// "KV format 'tq4/f16'"); unknown format names are reported as kv_format_find does, after `where`
// when `where_unknown`. Either side may end in "@gN": the token group of its grouped codecs
// (kv_codec_create).
struct KvPair {
  KvLayerFormat codecs;
  std::string name;
};

// "kvquant3@g128" -> the format and "@g128" (empty when there is no suffix).
std::pair<const KvFormatDesc*, std::string> format_and_group(std::string_view side, const std::string& where,
                                                             bool where_unknown) {
  const size_t at = side.find('@');
  const std::string name(side.substr(0, at));
  const KvFormatDesc* d = nullptr;
  if (!where_unknown) {
    d = &kv_format_find(name);
  } else {
    try {
      d = &kv_format_find(name);
    } catch (const Error& e) {
      fail("{}: {}", where, e.what());
    }
  }
  if (at == std::string_view::npos) return {d, ""};
  const std::string suffix(side.substr(at));
  kv_parse_group_suffix(suffix, where);
  return {d, suffix};
}

KvPair parse_kv_pair(std::string_view spec, const std::string& where, bool where_unknown) {
  const size_t slash = spec.find('/');
  if (slash == std::string_view::npos) {
    const auto [d, g] = format_and_group(spec, where, where_unknown);
    return {KvLayerFormat{d->k_codec + g, d->v_codec + g}, d->name + g};
  }
  const std::string_view kf = spec.substr(0, slash), vf = spec.substr(slash + 1);
  if (kf.empty() || vf.empty() || vf.find('/') != std::string_view::npos)
    fail("{}: expected FMT or KFMT/VFMT", where);
  const auto [kd, kg] = format_and_group(kf, where, where_unknown);
  const auto [vd, vg] = format_and_group(vf, where, where_unknown);
  return {KvLayerFormat{kd->k_codec + kg, vd->v_codec + vg}, kd->name + kg + "/" + vd->name + vg};
}

}  // namespace

KvPolicy kv_policy_uniform(const std::string& format, int n_layer) {
  // "tq4/f16" quantizes only the keys: eval measures K and V error separately this way, without a
  // registered mix for every pair.
  KvPair kv = parse_kv_pair(format, fmt::format("KV format '{}'", format), false);
  KvPolicy p;
  p.name = std::move(kv.name);
  p.layers.assign(size_t(n_layer), kv.codecs);
  return p;
}

static int parse_int(std::string_view s, const char* what, std::string_view item) {
  int v = 0;
  auto [ptr, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || ptr != s.data() + s.size() || s.empty())
    fail("{}: '{}' is not a number (in '{}')", what, s, item);
  return v;
}

std::vector<int> kv_parse_skip_layers(std::string_view spec, int n_layer, const std::vector<bool>& sliding) {
  std::vector<int> out;
  const char* what = "--kv-cache-dtype-skip-layers";
  size_t p = 0;
  while (p <= spec.size()) {
    size_t q = spec.find(',', p);
    if (q == std::string_view::npos) q = spec.size();
    std::string_view raw = spec.substr(p, q - p);
    p = q + 1;
    while (!raw.empty() && (raw.front() == ' ' || raw.front() == '\t')) raw.remove_prefix(1);
    while (!raw.empty() && (raw.back() == ' ' || raw.back() == '\t')) raw.remove_suffix(1);
    std::string lowered(raw);
    for (char& ch : lowered) ch = char(std::tolower(static_cast<unsigned char>(ch)));
    std::string_view item = lowered;
    if (item.empty()) {
      if (q == spec.size() && !out.empty()) break;
      if (spec.find_first_not_of(" \t") == std::string_view::npos) break;
      fail("{}: empty item in '{}' (valid: first:N, last:N, sliding_window, layer indices)", what, spec);
    }
    if (item == "sliding_window") {
      for (int il = 0; il < n_layer && size_t(il) < sliding.size(); ++il)
        if (sliding[size_t(il)]) out.push_back(il);
    } else if (item.rfind("first:", 0) == 0 || item.rfind("last:", 0) == 0) {
      const bool first = item[0] == 'f';
      const int n = parse_int(item.substr(first ? 6 : 5), what, item);
      if (n < 0 || n > n_layer) fail("{}: '{}' asks for {} layers, the model has {}", what, item, n, n_layer);
      for (int i = 0; i < n; ++i) out.push_back(first ? i : n_layer - 1 - i);
    } else {
      if (item.empty() || item.find_first_not_of("0123456789") != std::string_view::npos)
        fail("{}: '{}' is not understood (use first:N, last:N, sliding_window or a layer index)", what, raw);
      const int il = parse_int(item, what, item);
      if (il < 0 || il >= n_layer) fail("{}: layer {} does not exist (the model has layers 0..{})", what, il, n_layer - 1);
      out.push_back(il);
    }
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

void kv_policy_skip_layers(KvPolicy& p, const std::vector<int>& layers) {
  const KvFormatDesc& f16 = kv_format_find("f16");
  for (int il : layers) {
    KVQ_CHECK(il >= 0 && size_t(il) < p.layers.size(), "layer {}", il);
    p.layers[size_t(il)] = KvLayerFormat{f16.k_codec, f16.v_codec};
  }
}

int kv_policy_override_layer(KvPolicy& p, std::string_view spec) {
  const size_t eq = spec.find('=');
  if (eq == std::string_view::npos) fail("--kv-layer '{}': expected L=KFMT/VFMT or L=FMT", spec);
  const int il = parse_int(spec.substr(0, eq), "--kv-layer", spec);
  if (il < 0 || size_t(il) >= p.layers.size()) fail("--kv-layer '{}': layer {} out of range [0, {})", spec, il, p.layers.size());
  const std::string_view rhs = spec.substr(eq + 1);
  if (rhs.empty()) fail("--kv-layer '{}': expected L=KFMT/VFMT or L=FMT", spec);
  p.layers[size_t(il)] = parse_kv_pair(rhs, fmt::format("--kv-layer '{}' (layer {})", spec, il), true).codecs;
  return il;
}

std::string kv_policy_describe(const KvPolicy& p) {
  std::string s = p.name;
  if (p.layers.empty()) return s;
  // the most common (K, V) pair is the base; list the layers that differ
  const KvLayerFormat& base = p.layers[p.layers.size() / 2];
  std::string diff;
  for (size_t il = 0; il < p.layers.size(); ++il) {
    const auto& l = p.layers[il];
    if (l.k_codec == base.k_codec && l.v_codec == base.v_codec) continue;
    if (!diff.empty()) diff += ", ";
    diff += fmt::format("{}={}/{}", il, l.k_codec, l.v_codec);
  }
  return diff.empty() ? s : s + " [" + diff + "]";
}

}  // namespace kvq
