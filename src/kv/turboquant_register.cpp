// Registry entries of the TurboQuant family: codecs tq1..tq4, fractional, prod (QJL), dense
// rotation, and the formats built from them (including K/V-split presets).
#include <string>

#include "kv/registry_internal.h"
#include "kv/tq_tiled.h"
#include "kv/turboquant.h"

namespace kvq {

namespace {

// Codec name of the basic library's per-token int8 (symmetric absmax per token and head), used as
// the K half of k8v4.
constexpr const char* kInt8Codec = "int8";

// The MSE rates that have tiles (kv/tq_tiled.h) besides their token records.
struct Rate {
  const char* name;
  double bits;
  const char* what;
};
constexpr Rate kRates[] = {
    {"tq2", 2, "2 bits/elem"},
    {"tq3", 3, "3 bits/elem"},
    {"tq4", 4, "4 bits/elem"},
    {"tq2.25", 2.25, "the paper's '2.5-bit' split (1/4 of rotated channels at 3 bits, 3/4 at 2): 2.25 bits/elem"},
    {"tq2.5", 2.5, "2.5 bits/elem: first half of the rotated channels at 3 bits, second half at 2"},
    {"tq3.5", 3.5, "3.5 bits/elem: first half of the rotated channels at 4 bits, second half at 3"},
};

void add_codec(const std::string& name, TqConfig cfg, const std::string& what) {
  kv_register_codec({name, what, [name, cfg](const KvCodecParams& p) { return tq_codec_create(name, cfg, p); }});
}

}  // namespace

void kv_register_turboquant() {
  using R = TqRotationKind;
  add_codec("tq1", {1, false, R::hadamard}, "TurboQuant MSE, 1 bit/elem: Hadamard rotation + Lloyd-Max codes, fp16 norm");
  // tq2 .. tq4 and the fractional rates: "<name>" stores the tiles of kv/tq_tiled.h where the head
  // allows (same quantization, bytes and decode; integer-dot kernels: bench/BENCHMARKS.md), else
  // the records; "<name>t" always the tiles; "<name>_rows" always the records.
  for (const Rate& r : kRates) {
    const std::string n = r.name, desc = std::string("TurboQuant MSE, ") + r.what + ": Hadamard rotation + Lloyd-Max codes, fp16 norm";
    const double b = r.bits;
    kv_register_codec({n, desc + "; " + n + "t's 16-token tiles where head_dim allows (a multiple of 32), else token records",
                       [n, b](const KvCodecParams& p) { return tq_codec_tiles_or_rows(n + "t", n, b, p); }});
    kv_register_codec({n + "t", desc + ", in 16-token tiles for integer-dot kernels",
                       [n, b](const KvCodecParams& p) { return tq_tiled_codec_create(n + "t", b, p); }});
    add_codec(n + "_rows", {b, false, R::hadamard}, desc + ", in token records");
  }
  add_codec("tq2_qjl", {2, true, R::hadamard},
            "TurboQuant prod, 2 bits/elem: 1-bit MSE codes + 1-bit QJL signs of the residual (unbiased q.k)");
  add_codec("tq3_qjl", {3, true, R::hadamard},
            "TurboQuant prod, 3 bits/elem: 2-bit MSE codes + 1-bit QJL signs of the residual (unbiased q.k)");
  add_codec("tq4_qjl", {4, true, R::hadamard},
            "TurboQuant prod, 4 bits/elem: 3-bit MSE codes + 1-bit QJL signs of the residual (unbiased q.k)");
  add_codec("tq4_dense", {4, false, R::dense},
            "TurboQuant MSE, 4 bits/elem with a dense Haar-random rotation (any head_dim multiple of 16)");

  auto fmt = [](std::string name, std::vector<std::string> aliases, std::string k, std::string v, std::string what) {
    kv_register_format({std::move(name), std::move(aliases), std::move(k), std::move(v), std::move(what)});
  };
  const std::string tiles = "; 16-token tiles where the head allows (*_rows: the records)";
  fmt("tq1", {"turboquant1"}, "tq1", "tq1", "TurboQuant 1 bit K and V (+16/head_dim for the norm)");
  fmt("tq2", {"turboquant2"}, "tq2", "tq2", "TurboQuant 2 bits K and V (+16/head_dim for the norm)" + tiles);
  fmt("tq3", {"turboquant3"}, "tq3", "tq3", "TurboQuant 3 bits K and V (+16/head_dim for the norm)" + tiles);
  fmt("tq4", {"turboquant4"}, "tq4", "tq4", "TurboQuant 4 bits K and V (+16/head_dim for the norm)" + tiles);
  fmt("tq2.25", {}, "tq2.25", "tq2.25", "TurboQuant 2.25 bits K and V: the paper's 32-of-128 channels at 3 bits split" + tiles);
  fmt("tq2.5", {"turboquant2.5"}, "tq2.5", "tq2.5", "TurboQuant 2.5 bits K and V (half the rotated channels at 3 bits)" + tiles);
  fmt("tq3.5", {"turboquant3.5"}, "tq3.5", "tq3.5", "TurboQuant 3.5 bits K and V (half the rotated channels at 4 bits)" + tiles);
  fmt("tq2_qjl", {}, "tq2_qjl", "tq2", "TurboQuant prod keys (1-bit MSE + QJL), 2-bit MSE values");
  fmt("tq3_qjl", {}, "tq3_qjl", "tq3", "TurboQuant prod keys (2-bit MSE + QJL), 3-bit MSE values");
  fmt("tq4_qjl", {}, "tq4_qjl", "tq4", "TurboQuant prod keys (3-bit MSE + QJL), 4-bit MSE values");
  for (const Rate& r : kRates) {
    const std::string n = r.name, bits = n.substr(2);
    fmt(n + "t", {}, n + "t", n + "t",
        "TurboQuant " + bits + " bits K and V in 16-token tiles for integer-dot kernels (+16/head_dim for the norm)");
    fmt(n + "_rows", {}, n + "_rows", n + "_rows", "TurboQuant " + bits + " bits K and V in token records (the record kernels)");
  }
  // K/V-split presets ("k8v4" alone is the basic library's int8/int4 format).
  fmt("tq_k8v4", {"turboquant_k8v4"}, kInt8Codec, "tq4", "keys int8 per token, values TurboQuant 4 bits");
  fmt("tq_k3v4", {"k3v4", "turboquant_k3v4"}, "tq3", "tq4", "keys TurboQuant 3 bits, values TurboQuant 4 bits");
  // The other split: a key's error reaches every score, so where keys have outlier channels the
  // bits buy more there (SmolLM2 at 3.75 bits: half tq3.5's KL divergence; on needles it does as
  // well as tq4, whose keys it has; bench/QUALITY.md).
  fmt("tq_k4v3", {"k4v3", "turboquant_k4v3"}, "tq4", "tq3", "keys TurboQuant 4 bits, values TurboQuant 3 bits");
  fmt("tq4_dense", {}, "tq4_dense", "tq4_dense", "TurboQuant 4 bits K and V with dense random rotations");
}

}  // namespace kvq
