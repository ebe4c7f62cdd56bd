// The KV-cache flags (tools/kv_flags.h) resolved against a real model: -ctk / -ctv on top of a
// K/V split or a token group, --kv-layer's errors, --kv-scales files that cannot be read, empty
// format names. Every bad value is a kvq::Error naming the flag, never another exception.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "core/error.h"
#include "kv/calib.h"
#include "kvq/kv_format.h"
#include "model/model.h"
#include "test_models.h"
#include "tools/kv_flags.h"

namespace fs = std::filesystem;
using namespace kvq;

namespace {

// stories260K: 5 layers, head_dim 8.
const Model* stories() {
  static std::unique_ptr<Model> m = [] {
    const std::string path = std::string(KVQ_SOURCE_DIR) + "/../shared/models/stories260K.gguf";
    return fs::exists(path) ? Model::load(path) : nullptr;
  }();
  return m.get();
}

#define REQUIRE_STORIES()                                                      \
  const Model* model = stories();                                              \
  if (!model) GTEST_SKIP() << "stories260K.gguf not found in ../shared/models"

// The error kv_flags_resolve throws for f ("no error" when it throws none); any other exception
// fails the test.
std::string resolve_error(const KvFlags& f, const Model& m) {
  try {
    kv_flags_resolve(f, m);
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

// -ctk replaces the K side of --kv and -ctv the V side; the other side keeps its format and its
// @gN.
TEST(KvFlags, CacheTypeOverridesOneSideOfASplitOrGroupedFormat) {
  REQUIRE_STORIES();
  struct Case {
    const char* kv;
    const char* ctk;
    const char* ctv;
    std::string k_codec, v_codec;
  };
  const std::string g64 = "@g64";
  const Case cases[] = {
      {"int8/int4", "", "q8_0", kv_format_find("int8").k_codec, kv_format_find("q8_0").v_codec},
      {"q8_0/q4_0", "f16", "", kv_format_find("f16").k_codec, kv_format_find("q4_0").v_codec},
      {"kivi4@g64", "", "q8_0", kv_format_find("kivi4").k_codec + g64, kv_format_find("q8_0").v_codec},
      {"kivi4@g64/q4_0", "f16", "", kv_format_find("f16").k_codec, kv_format_find("q4_0").v_codec},
      {"f16/kivi4@g64", "q8_0", "", kv_format_find("q8_0").k_codec, kv_format_find("kivi4").v_codec + g64},
      {"f16", "kivi4@g64", "", kv_format_find("kivi4").k_codec + g64, kv_format_find("f16").v_codec},
      {"q4_0", "q8_0", "int8", kv_format_find("q8_0").k_codec, kv_format_find("int8").v_codec},
  };
  for (const Case& c : cases) {
    KvFlags f;
    f.kv_cache_dtype = c.kv;
    f.cache_type_k = c.ctk;
    f.cache_type_v = c.ctv;
    f.cache_type_k_given = !f.cache_type_k.empty();
    f.cache_type_v_given = !f.cache_type_v.empty();
    const std::string what = std::string(c.kv) + " -ctk '" + c.ctk + "' -ctv '" + c.ctv + "'";
    KvSetup s;
    ASSERT_NO_THROW(s = kv_flags_resolve(f, *model)) << what << ": " << resolve_error(f, *model);
    ASSERT_EQ(int(s.policy.layers.size()), model->config().n_layer);
    for (const auto& l : s.policy.layers) {
      EXPECT_EQ(l.k_codec, c.k_codec) << what;
      EXPECT_EQ(l.v_codec, c.v_codec) << what;
    }
  }
  // The same format on both sides keeps its plain name.
  KvFlags same;
  same.kv_cache_dtype = "q8_0/q4_0";
  same.cache_type_v = "q8_0";
  same.cache_type_v_given = true;
  EXPECT_EQ(kv_flags_resolve(same, *model).policy.name, "q8_0");
  // Each flag takes one format: a split there is an error naming the flag.
  KvFlags split;
  split.cache_type_k = "q8_0/q4_0";
  split.cache_type_k_given = true;
  EXPECT_NE(resolve_error(split, *model).find("--cache-type-k (-ctk)"), std::string::npos);
  KvFlags unknown;
  unknown.kv_cache_dtype = "int8/int4";
  unknown.cache_type_v = "int7";
  unknown.cache_type_v_given = true;
  const std::string e = resolve_error(unknown, *model);
  EXPECT_NE(e.find("--cache-type-v (-ctv)"), std::string::npos) << e;
  EXPECT_NE(e.find("unknown KV format 'int7'"), std::string::npos) << e;
}

// An empty format name (-ctk '') is an error, not the default f16.
TEST(KvFlags, EmptyFormatNamesRejected) {
  REQUIRE_STORIES();
  KvFlags k;
  k.cache_type_k_given = true;
  EXPECT_NE(resolve_error(k, *model).find("--cache-type-k (-ctk): the format name is empty"), std::string::npos);
  KvFlags v;
  v.kv_cache_dtype = "int8";
  v.cache_type_v_given = true;
  EXPECT_NE(resolve_error(v, *model).find("--cache-type-v (-ctv): the format name is empty"), std::string::npos);
  KvFlags kv;
  kv.kv_cache_dtype = "";
  EXPECT_NE(resolve_error(kv, *model).find("--kv-cache-dtype: the format name is empty"), std::string::npos);
}

// A layer given twice to --kv-layer is an error naming it (not the last one winning); a format
// that does not fit its layer names the layer and the flag.
TEST(KvFlags, KvLayerErrorsNameTheLayer) {
  REQUIRE_STORIES();
  KvFlags twice;
  twice.kv_cache_dtype = "int8";
  twice.layer_overrides = {"0=f16", "2=int8/f16", "0=bf16"};
  const std::string e = resolve_error(twice, *model);
  EXPECT_NE(e.find("layer 0 is given twice"), std::string::npos) << e;
  EXPECT_NE(e.find("'0=f16'"), std::string::npos) << e;
  EXPECT_NE(e.find("'0=bf16'"), std::string::npos) << e;
  KvFlags ok = twice;
  ok.layer_overrides = {"0=f16", "2=int8/f16", "4=bf16"};
  EXPECT_EQ(resolve_error(ok, *model), "no error");
  // int4_g128: groups of 128 channels, the model's head_dim is 8
  KvFlags misfit;
  misfit.layer_overrides = {"3=int4_g128"};
  const std::string m = resolve_error(misfit, *model);
  EXPECT_NE(m.find("--kv-layer '3=int4_g128' (layer 3)"), std::string::npos) << m;
  KvFlags unknown;
  unknown.layer_overrides = {"3=int7/f16"};
  const std::string u = resolve_error(unknown, *model);
  EXPECT_NE(u.find("--kv-layer '3=int7/f16' (layer 3)"), std::string::npos) << u;
  EXPECT_NE(u.find("unknown KV format 'int7'"), std::string::npos) << u;
  // a static format whose calibration lacks the layer
  const fs::path dir = fs::temp_directory_path() / ("kvq_kv_flags_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  std::ofstream(dir / "one_layer.json") << R"({"layers": [{"k_scale": 1.0, "v_scale": 1.0}]})";
  KvFlags cal;
  cal.layer_overrides = {"3=int8_static"};
  cal.scales_file = (dir / "one_layer.json").string();
  const std::string c = resolve_error(cal, *model);
  fs::remove_all(dir);
  EXPECT_NE(c.find("--kv-layer '3=int8_static' (layer 3)"), std::string::npos) << c;
  EXPECT_NE(c.find("layer 3 requested"), std::string::npos) << c;
}

// --kv-scales that names a directory, or a file that fails while it is read, is a kvq::Error
// (the CLI's one-line message), not an uncaught stream exception.
TEST(KvFlags, UnreadableScalesFileRejected) {
  REQUIRE_STORIES();
  const fs::path dir = fs::temp_directory_path() / ("kvq_kv_flags_dir_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  KvFlags f;
  f.kv_cache_dtype = "int8_static";
  f.scales_file = dir.string();
  const std::string e = resolve_error(f, *model);
  fs::remove_all(dir);
  EXPECT_NE(e.find("is a directory"), std::string::npos) << e;
  EXPECT_NE(e.find("--kv-scales"), std::string::npos) << e;
  f.scales_file = (dir / "missing.json").string();
  EXPECT_NE(resolve_error(f, *model).find("cannot read"), std::string::npos);
  // A file that opens but fails on read (EIO at address 0 of the process's memory).
  if (fs::exists("/proc/self/mem")) {
    f.scales_file = "/proc/self/mem";
    EXPECT_NE(resolve_error(f, *model).find("--kv-scales"), std::string::npos);
  }
}

// A KVQuant format with a calibration of another model (stories260K's: 5 layers of head_dim 8,
// no KVQuant codebooks, as kvq calibrate writes none for head_dim 8) is refused on SmolLM2 (30
// layers of head_dim 64) when its cache is built, as a static format is; without --kv-scales it
// runs with the default codebooks.
TEST(KvFlags, KvquantRefusesAnotherModelsCalibration) {
  const std::string smol = kvq_test_model("SmolLM2-135M-Instruct.Q4_1.gguf");
  if (smol.empty()) GTEST_SKIP() << "SmolLM2-135M-Instruct.Q4_1.gguf not installed (run scripts/get-models.sh)";
  auto m = Model::load(smol);
  const ModelConfig& c = m->config();
  const nlohmann::json other = kv_placeholder_calib(5, 1, 8);
  const nlohmann::json one_layer = kv_placeholder_calib(1, c.n_head_kv, c.head_dim);
  const nlohmann::json own = kv_placeholder_calib(c.n_layer, c.n_head_kv, c.head_dim);
  auto build = [&](const std::string& format, const nlohmann::json* calib) {
    KvFlags f;
    f.kv_cache_dtype = format;
    KvSetup s = kv_flags_resolve(f, *m);
    KvCacheConfig kc = m->kv_cache_config(s.policy, 64);
    s.apply(kc);
    kc.calib = calib;
    try {
      KvCache cache(kc);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  for (const char* format : {"kvquant4", "kvquant3.25", "kvquant4_cal"}) {
    EXPECT_EQ(build(format, &own), "no error") << format;
    const std::string e = build(format, &other);
    EXPECT_NE(e.find("another model"), std::string::npos) << format << ": " << e;
    EXPECT_NE(e.find("kvq calibrate"), std::string::npos) << format << ": " << e;
    const std::string l = build(format, &one_layer);
    EXPECT_NE(l.find("has 1 layers, layer 1 requested"), std::string::npos) << format << ": " << l;
  }
  EXPECT_EQ(build("kvquant4", nullptr), "no error");
  EXPECT_EQ(build("kvquant3.25", nullptr), "no error");
}
