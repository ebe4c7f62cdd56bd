// The KV format registry: codec factories and named formats (K codec + V codec), filled once on
// first use by each family's kv_register_<family>() hook.
#include <algorithm>
#include <cctype>
#include <charconv>
#include <mutex>

#include "core/error.h"
#include "kv/prefetch_along.h"
#include "kv/registry_internal.h"

namespace kvq {

// Family hooks (one per src/kv/<family>*.cpp). Called explicitly because a static library drops
// object files that nothing references.
void kv_register_float_codecs();
void kv_register_fp8_codecs();
void kv_register_int_codecs();
void kv_register_ggml_codecs();
void kv_register_mixed_formats();
void kv_register_kivi();
void kv_register_kvquant();
void kv_register_kvquant_mixed();
void kv_register_turboquant();
void kv_register_rotated_codecs();
void kv_register_centered_codecs();
void kv_register_int4_tiled();
void kv_register_kivi_tiled();
void kv_register_int8_tiled();
void kv_register_fp8_tiled();
void kv_register_int2_tiled();

namespace {

struct Registry {
  std::vector<KvCodecEntry> codecs;
  std::vector<KvFormatDesc> formats;
};

Registry& storage() {
  static Registry r;
  return r;
}

std::string lower(std::string s) {
  for (char& c : s) c = char(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// Every name and alias of every format, lower-cased, must resolve to exactly one format, and
// every format must name registered codecs: checked once, after all families registered.
void validate(const Registry& r) {
  std::vector<std::string> seen;
  for (const auto& c : r.codecs) {
    KVQ_CHECK(std::find(seen.begin(), seen.end(), lower(c.name)) == seen.end(), "duplicate codec {}", c.name);
    seen.push_back(lower(c.name));
  }
  auto has_codec = [&](const std::string& n) {
    return std::any_of(r.codecs.begin(), r.codecs.end(), [&](const KvCodecEntry& c) { return c.name == n; });
  };
  seen.clear();
  for (const auto& f : r.formats) {
    KVQ_CHECK(has_codec(f.k_codec) && has_codec(f.v_codec), "format {}: unknown codec {} / {}", f.name,
              f.k_codec, f.v_codec);
    std::vector<std::string> names = f.aliases;
    names.push_back(f.name);
    for (const auto& n : names) {
      KVQ_CHECK(std::find(seen.begin(), seen.end(), lower(n)) == seen.end(), "duplicate format name {}", n);
      seen.push_back(lower(n));
    }
  }
}

const Registry& registry() {
  static std::once_flag once;
  std::call_once(once, [] {
    kv_register_float_codecs();
    kv_register_fp8_codecs();
    kv_register_int_codecs();
    kv_register_ggml_codecs();
    kv_register_mixed_formats();
    kv_register_kivi();
    kv_register_kvquant();
    kv_register_kvquant_mixed();
    kv_register_turboquant();
    kv_register_rotated_codecs();
    kv_register_centered_codecs();
    kv_register_int4_tiled();
    kv_register_kivi_tiled();
    kv_register_int8_tiled();
    kv_register_fp8_tiled();
    kv_register_int2_tiled();
    validate(storage());
  });
  return storage();
}

std::string format_list(const Registry& r) {
  std::string s;
  for (const auto& f : r.formats) {
    if (!s.empty()) s += ", ";
    s += f.name;
    if (!f.aliases.empty()) {
      s += " (";
      for (size_t i = 0; i < f.aliases.size(); ++i) s += (i ? ", " : "") + f.aliases[i];
      s += ")";
    }
  }
  return s;
}

}  // namespace

void kv_register_codec(KvCodecEntry e) { storage().codecs.push_back(std::move(e)); }
void kv_register_format(KvFormatDesc d) { storage().formats.push_back(std::move(d)); }

void kv_check_group_size(const std::string& name, int group, int head_dim) {
  if (head_dim % group == 0) return;
  std::string valid;
  for (int v : {32, 64, 128})
    if (head_dim % v == 0) valid += fmt::format("{}{}", valid.empty() ? "" : ", ", v);
  fail("KV codec '{}': group size {} does not divide head_dim {}; valid group sizes for this head_dim: {}", name, group,
       head_dim, valid.empty() ? std::string("none (head_dim must be a multiple of 32)") : valid);
}

const std::vector<KvFormatDesc>& kv_formats() { return registry().formats; }

const KvFormatDesc& kv_format_find(const std::string& name) {
  const Registry& r = registry();
  const std::string key = lower(name);
  for (const auto& f : r.formats) {
    if (lower(f.name) == key) return f;
    for (const auto& a : f.aliases)
      if (lower(a) == key) return f;
  }
  fail("unknown KV format '{}'; valid formats (aliases in parentheses): {}", name, format_list(r));
}

std::vector<std::string> kv_codec_names() {
  std::vector<std::string> v;
  for (const auto& c : registry().codecs) v.push_back(c.name);
  return v;
}

int kv_parse_group_suffix(const std::string& suffix, const std::string& where) {
  int n = 0;
  const char* b = suffix.data() + 2;
  const char* e = suffix.data() + suffix.size();
  const bool ok = suffix.size() > 2 && suffix.compare(0, 2, "@g") == 0 && std::from_chars(b, e, n).ptr == e &&
                  n >= 2 && n <= 1024;
  if (!ok)
    fail("{}: '{}' is not a token-group suffix: expected @gN with N in 2..1024 (e.g. kvquant3@g128)", where,
         suffix);
  return n;
}

std::unique_ptr<KvCodec> kv_codec_create(const std::string& codec_name, const KvCodecParams& p0) {
  const size_t at = codec_name.find('@');
  if (at != std::string::npos) {
    KvCodecParams p = p0;
    p.group_tokens = kv_parse_group_suffix(codec_name.substr(at), "KV codec '" + codec_name + "'");
    auto c = kv_codec_create(codec_name.substr(0, at), p);
    if (c->info().group_tokens <= 1)
      fail("KV codec '{}': {} stores each token on its own; @gN sets the token group of grouped codecs "
           "(kivi*, kvquant*)", codec_name, c->info().name);
    return c;
  }
  const KvCodecParams& p = p0;
  const Registry& r = registry();
  const std::string key = lower(codec_name);
  for (const auto& c : r.codecs) {
    if (lower(c.name) != key) continue;
    if (p.head_dim <= 0 || p.head_dim > 1024)
      fail("KV codec '{}': head_dim {} out of range (1..1024)", c.name, p.head_dim);
    if (p.n_kv_heads <= 0) fail("KV codec '{}': n_kv_heads {} must be positive", c.name, p.n_kv_heads);
    return c.make(p);
  }
  std::string names;
  for (const auto& c : r.codecs) names += (names.empty() ? "" : ", ") + c.name;
  fail("unknown KV codec '{}'; valid codecs: {}", codec_name, names);
}

double kv_codec_effective_bits(const KvCodec& c, int block_tokens, int ctx) {
  const KvCodecInfo& in = c.info();
  const double hd = c.head_dim();
  const double block_bits = 8.0 * double(c.block_bytes(block_tokens)) / (double(block_tokens) * hd);
  if (ctx <= 0) return block_bits;
  const int q = kv_quantized_tokens(ctx, in.group_tokens, in.residual_tokens);
  // Head blocks amortized per token (a partly filled page's unused slots are not counted: this
  // is the format's density, not the page allocator's rounding); the tail at f32.
  return (block_bits * q + 32.0 * (ctx - q)) / double(ctx);
}

void KvCodec::prepare_query(int, const float* q, int n_q, float* qp) const {
  const size_t hd = size_t(head_dim());
  const size_t qd = size_t(prepared_query_dim());
  for (int i = 0; i < n_q; ++i) std::copy(q + size_t(i) * hd, q + size_t(i) * hd + hd, qp + size_t(i) * qd);
}

void KvCodec::scores_spans(int head, const float* qp, int n_q, const KvSpan* spans, int n_spans, float* out,
                           int out_stride) const {
  kv_for_spans(spans, n_spans, [&](const KvSpan& sp, int o) {
    scores(head, qp, n_q, sp.block, sp.block_tokens, sp.t0, sp.n, sp.pos0, out + o, out_stride);
  });
}

void KvCodec::accumulate_spans(int head, const float* p, int p_stride, int n_q, const KvSpan* spans, int n_spans,
                               float* acc) const {
  kv_for_spans(spans, n_spans, [&](const KvSpan& sp, int o) {
    accumulate(head, p + o, p_stride, n_q, sp.block, sp.block_tokens, sp.t0, sp.n, acc);
  });
}

void KvCodec::finish_output(int, float*, int) const {}

void KvCodec::finish_output_mass(int head, float* acc, int n_q, const float*) const { finish_output(head, acc, n_q); }

}  // namespace kvq
