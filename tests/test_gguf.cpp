#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <limits>
#include <string>
#include <vector>

#include "core/error.h"
#include "gguf/gguf.h"
#include "gguf_writer.h"

using namespace kvq;
using namespace kvq::gguf;
using kvq::test::GgufWriter;
namespace gv = kvq::test::gv;

namespace {

std::string model_path() { return KVQ_SOURCE_DIR "/../shared/models/stories260K.gguf"; }

std::vector<uint8_t> read_all(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), {});
}

// A temp file removed at scope exit.
struct TempFile {
  std::string path;
  explicit TempFile(const std::string& tag)
      : path((std::filesystem::temp_directory_path() / ("kvq_test_gguf_" + std::to_string(::getpid()) + "_" + tag))
                 .string()) {}
  ~TempFile() { std::filesystem::remove(path); }
};

// Parses img and returns the error message; fails the test if parsing succeeds.
std::string parse_error(const std::vector<uint8_t>& img, const std::string& name = "bad.gguf") {
  try {
    File::parse(img.data(), img.size(), name);
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "parse succeeded on a broken image";
  return "";
}

void expect_error(const std::vector<uint8_t>& img, std::initializer_list<const char*> parts) {
  const std::string msg = parse_error(img);
  EXPECT_EQ(msg.rfind("bad.gguf: ", 0), 0u) << msg;
  for (const char* p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "missing '" << p << "' in: " << msg;
}

std::vector<uint8_t> bytes_u64(uint64_t v) {
  std::vector<uint8_t> b;
  kvq::test::put_u64(b, v);
  return b;
}

// Nested arrays: depth 1 is an array of u8, depth d an array holding one array of depth d-1.
Value nested(int depth) {
  Value v = gv::arr(ValueType::u8, {gv::u8(7), gv::u8(9)});
  for (int d = 1; d < depth; ++d) v = gv::arr(ValueType::array, {v});
  return v;
}

// A small valid file with every value type, nested arrays and tensors of several types.
GgufWriter full_writer(uint32_t version, uint32_t alignment = 0) {
  GgufWriter w(version);
  if (alignment) w.set_alignment(alignment);
  w.add_string("general.architecture", "llama");
  w.add_u8("t.u8", 200);
  w.add_i8("t.i8", -100);
  w.add_u16("t.u16", 60000);
  w.add_i16("t.i16", -30000);
  w.add_u32("t.u32", 4000000000u);
  w.add_i32("t.i32", -2000000000);
  w.add_u64("t.u64", (uint64_t(1) << 63) + 5);
  w.add_i64("t.i64", std::numeric_limits<int64_t>::min());
  w.add_f32("t.f32", 1.5f);
  w.add_f64("t.f64", -2.25e300);
  w.add_bool("t.true", true);
  w.add_bool("t.false", false);
  w.add_string("t.str", std::string("a\0b \xc3\xa9", 6));
  w.add_string("t.empty", "");
  w.add_array("t.arr.empty", ValueType::u8, {});
  w.add_array("t.arr.u16", ValueType::u16, {gv::u16(1), gv::u16(65535)});
  w.add_array("t.arr.i64", ValueType::i64, {gv::i64(-5), gv::i64(int64_t(1) << 40)});
  w.add_array("t.arr.u64big", ValueType::u64, {gv::u64(1), gv::u64(~uint64_t(0))});
  w.add_array("t.arr.f64", ValueType::f64, {gv::f64(0.25), gv::f64(-1e-300)});
  w.add_array("t.arr.bool", ValueType::boolean, {gv::boolean(true), gv::boolean(false)});
  w.add_string_array("t.arr.str", {"x", "", "yz"});
  w.add_f32_array("t.arr.f32", {0.5f, -2.0f});
  w.add_i32_array("t.arr.i32", {3, -4, 5});
  w.add_array("t.arr.nested", ValueType::array,
              {gv::arr(ValueType::i32, {gv::i32(1), gv::i32(2)}), gv::arr(ValueType::string, {gv::str("s")}),
               gv::arr(ValueType::array, {gv::arr(ValueType::f32, {gv::f32(3.0f)})})});
  w.add("t.arr.deep8", nested(8));
  std::vector<float> vals(12);
  for (int k = 0; k < 12; ++k) vals[size_t(k)] = float(k) - 5.5f;
  w.add_tensor_f32("a.weight", {4, 3}, vals);
  std::vector<uint8_t> q8(2 * 34);
  for (size_t k = 0; k < q8.size(); ++k) q8[k] = uint8_t(k * 7 + 1);
  w.add_tensor("b.q8", GgmlType::Q8_0, {32, 2}, q8);
  w.add_tensor("c.q4k", GgmlType::Q4_K, {256});
  w.add_tensor("d.f16", GgmlType::F16, {2, 2, 2, 3});
  w.add_tensor("e.i8", GgmlType::I8, {5});
  return w;
}

const Value& get(const File& f, const char* key) {
  const Value* v = f.find(key);
  EXPECT_NE(v, nullptr) << key;
  static const Value none;
  return v ? *v : none;
}

void check_full(const File& f, uint32_t version, uint32_t alignment) {
  EXPECT_EQ(f.version(), version);
  EXPECT_EQ(f.alignment(), alignment);
  EXPECT_EQ(f.get_string("general.architecture"), "llama");
  EXPECT_EQ(get(f, "t.u8").type, ValueType::u8);
  EXPECT_EQ(get(f, "t.u8").u, 200u);
  EXPECT_EQ(f.get_int("t.u8"), 200);
  EXPECT_EQ(f.get_int("t.i8"), -100);
  EXPECT_EQ(get(f, "t.i8").type, ValueType::i8);
  EXPECT_EQ(f.get_int("t.u16"), 60000);
  EXPECT_EQ(f.get_int("t.i16"), -30000);
  EXPECT_EQ(f.get_int("t.u32"), 4000000000);
  EXPECT_EQ(get(f, "t.u32").type, ValueType::u32);
  EXPECT_EQ(f.get_int("t.i32"), -2000000000);
  EXPECT_EQ(get(f, "t.u64").u, (uint64_t(1) << 63) + 5);
  EXPECT_FALSE(get(f, "t.u64").as_int().has_value());
  EXPECT_EQ(f.get_int("t.i64"), std::numeric_limits<int64_t>::min());
  EXPECT_EQ(get(f, "t.f32").type, ValueType::f32);
  EXPECT_EQ(f.get_float("t.f32"), 1.5);
  EXPECT_EQ(f.get_float("t.f64"), -2.25e300);
  EXPECT_EQ(f.get_float("t.i32"), -2e9);  // integers are numbers too
  EXPECT_EQ(f.get_bool("t.true"), true);
  EXPECT_EQ(f.get_bool("t.false"), false);
  EXPECT_EQ(f.get_string("t.str"), std::string("a\0b \xc3\xa9", 6));
  EXPECT_EQ(f.get_string("t.empty"), "");

  const Value& empty = get(f, "t.arr.empty");
  EXPECT_EQ(empty.type, ValueType::array);
  EXPECT_EQ(empty.elem_type, ValueType::u8);
  EXPECT_TRUE(empty.arr.empty());
  EXPECT_EQ(f.get_int_array("t.arr.u16"), (std::vector<int64_t>{1, 65535}));
  EXPECT_EQ(get(f, "t.arr.u16").arr[1].type, ValueType::u16);
  EXPECT_EQ(f.get_int_array("t.arr.i64"), (std::vector<int64_t>{-5, int64_t(1) << 40}));
  EXPECT_EQ(get(f, "t.arr.u64big").arr[1].u, ~uint64_t(0));
  EXPECT_EQ(get(f, "t.arr.f64").arr[0].f, 0.25);
  EXPECT_EQ(get(f, "t.arr.f64").arr[1].f, -1e-300);
  EXPECT_EQ(get(f, "t.arr.bool").arr[0].u, 1u);
  EXPECT_EQ(get(f, "t.arr.bool").arr[1].u, 0u);
  EXPECT_EQ(f.get_string_array("t.arr.str"), (std::vector<std::string>{"x", "", "yz"}));
  EXPECT_EQ(f.get_float_array("t.arr.f32"), (std::vector<float>{0.5f, -2.0f}));
  EXPECT_EQ(f.get_float_array("t.arr.i32"), (std::vector<float>{3.f, -4.f, 5.f}));
  EXPECT_EQ(f.get_int_array("t.arr.i32"), (std::vector<int64_t>{3, -4, 5}));

  const Value& n = get(f, "t.arr.nested");
  ASSERT_EQ(n.elem_type, ValueType::array);
  ASSERT_EQ(n.arr.size(), 3u);
  EXPECT_EQ(n.arr[0].elem_type, ValueType::i32);
  ASSERT_EQ(n.arr[0].arr.size(), 2u);
  EXPECT_EQ(n.arr[0].arr[1].i, 2);
  EXPECT_EQ(n.arr[1].arr.at(0).s, "s");
  EXPECT_EQ(n.arr[2].arr.at(0).arr.at(0).f, 3.0);
  const Value* d = &get(f, "t.arr.deep8");
  for (int k = 1; k < 8; ++k) {
    ASSERT_EQ(d->elem_type, ValueType::array);
    ASSERT_EQ(d->arr.size(), 1u);
    d = &d->arr[0];
  }
  EXPECT_EQ(d->elem_type, ValueType::u8);
  ASSERT_EQ(d->arr.size(), 2u);
  EXPECT_EQ(d->arr[1].u, 9u);

  // Tensors: index, placement and contents.
  ASSERT_EQ(f.tensors().size(), 5u);
  const TensorInfo* a = f.find_tensor("a.weight");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->type, GgmlType::F32);
  EXPECT_EQ(a->ne, (std::vector<int64_t>{4, 3}));
  EXPECT_EQ(a->n_elements(), 12);
  EXPECT_EQ(a->nbytes, 48u);
  EXPECT_EQ(a->offset, 0u);
  float v[12];
  std::memcpy(v, a->data, sizeof(v));
  for (int k = 0; k < 12; ++k) EXPECT_EQ(v[k], float(k) - 5.5f);
  const TensorInfo* b = f.find_tensor("b.q8");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->type, GgmlType::Q8_0);
  EXPECT_EQ(b->nbytes, 68u);
  for (size_t k = 0; k < 68; ++k) ASSERT_EQ(b->data[k], uint8_t(k * 7 + 1));
  EXPECT_EQ(f.find_tensor("c.q4k")->nbytes, 144u);
  EXPECT_EQ(f.find_tensor("d.f16")->ne, (std::vector<int64_t>{2, 2, 2, 3}));
  EXPECT_EQ(f.find_tensor("d.f16")->nbytes, 48u);
  EXPECT_EQ(f.find_tensor("e.i8")->nbytes, 5u);
  EXPECT_EQ(f.find_tensor("nope"), nullptr);
  size_t sum = 0;
  for (const auto& t : f.tensors()) {
    EXPECT_EQ(t.offset % alignment, 0u) << t.name;
    EXPECT_EQ(t.data - f.tensors()[0].data, std::ptrdiff_t(t.offset)) << t.name;
    sum += t.nbytes;
  }
  EXPECT_EQ(f.tensor_bytes(), sum);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// The real model

TEST(GgufModel, Stories260K) {
  if (!std::filesystem::exists(model_path()))
    GTEST_SKIP() << "model not found: " << model_path() << " (shared test models absent)";
  auto f = File::open(model_path());
  EXPECT_EQ(f->version(), 3u);
  EXPECT_EQ(f->alignment(), 32u);
  EXPECT_EQ(f->metadata().size(), 19u);
  EXPECT_EQ(f->get_string("general.architecture"), "llama");
  EXPECT_EQ(f->get_int("llama.block_count"), 5);
  EXPECT_EQ(f->get_int("llama.embedding_length"), 64);
  EXPECT_EQ(f->get_int("llama.feed_forward_length"), 172);
  EXPECT_EQ(f->get_int("llama.attention.head_count"), 8);
  EXPECT_EQ(f->get_int("llama.attention.head_count_kv"), 4);
  EXPECT_EQ(f->get_int("llama.context_length"), 2048);
  EXPECT_EQ(f->get_int("tokenizer.ggml.bos_token_id"), 1);
  EXPECT_EQ(f->get_int("tokenizer.ggml.padding_token_id"), 4294967295);
  EXPECT_NEAR(*f->get_float("llama.attention.layer_norm_rms_epsilon"), 1e-5, 1e-9);
  EXPECT_FALSE(f->get_int("llama.no_such_key").has_value());

  auto tokens = f->get_string_array("tokenizer.ggml.tokens");
  ASSERT_TRUE(tokens.has_value());
  ASSERT_EQ(tokens->size(), 512u);
  EXPECT_EQ((*tokens)[0], "<unk>");
  EXPECT_EQ((*tokens)[1], "<s>");
  EXPECT_EQ((*tokens)[2], "</s>");
  EXPECT_EQ((*tokens)[3], "<0x00>");
  EXPECT_EQ(f->get_float_array("tokenizer.ggml.scores")->size(), 512u);
  auto types = f->get_int_array("tokenizer.ggml.token_type");
  ASSERT_EQ(types->size(), 512u);
  EXPECT_EQ((*types)[0], 2);  // unknown
  EXPECT_EQ((*types)[1], 3);  // control

  ASSERT_EQ(f->tensors().size(), 48u);
  const auto& ts = f->tensors();
  EXPECT_EQ(ts[0].name, "token_embd.weight");
  EXPECT_EQ(ts[0].ne, (std::vector<int64_t>{64, 512}));
  EXPECT_EQ(ts[0].offset, 0u);
  EXPECT_EQ(ts[1].name, "output_norm.weight");
  EXPECT_EQ(ts[1].ne, (std::vector<int64_t>{64}));
  EXPECT_EQ(ts[2].name, "output.weight");
  struct Shape {
    const char* suffix;
    std::vector<int64_t> ne;
  };
  const Shape layer[] = {{"attn_q.weight", {64, 64}},   {"attn_k.weight", {64, 32}},
                         {"attn_v.weight", {64, 32}},   {"attn_output.weight", {64, 64}},
                         {"attn_norm.weight", {64}},    {"ffn_gate.weight", {64, 172}},
                         {"ffn_down.weight", {172, 64}}, {"ffn_up.weight", {64, 172}},
                         {"ffn_norm.weight", {64}}};
  for (int l = 0; l < 5; ++l) {
    for (const auto& s : layer) {
      const std::string name = "blk." + std::to_string(l) + "." + s.suffix;
      const TensorInfo* t = f->find_tensor(name);
      ASSERT_NE(t, nullptr) << name;
      EXPECT_EQ(t->ne, s.ne) << name;
    }
  }
  size_t total = 0;
  for (const auto& t : ts) {
    EXPECT_EQ(t.type, GgmlType::F32) << t.name;
    EXPECT_EQ(t.nbytes, size_t(t.n_elements()) * 4) << t.name;
    EXPECT_EQ(t.offset % 32, 0u) << t.name;
    total += t.nbytes;
  }
  EXPECT_EQ(f->tensor_bytes(), total);
  // The data section (14176 = header end 14152 rounded up to 32) runs exactly to the end of the file.
  EXPECT_EQ(total, std::filesystem::file_size(model_path()) - 14176);
  EXPECT_EQ(ts.back().data + ts.back().nbytes - ts[0].data, std::ptrdiff_t(total));

  // Typed getters name the key and the actual type on a mismatch.
  try {
    f->get_string("llama.block_count");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'llama.block_count' has type u32"), std::string::npos) << e.what();
  }
  EXPECT_THROW(f->get_int("general.architecture"), Error);
  EXPECT_THROW(f->get_bool("llama.block_count"), Error);
  EXPECT_THROW(f->get_int_array("tokenizer.ggml.tokens"), Error);
  EXPECT_THROW(f->get_string_array("tokenizer.ggml.scores"), Error);

  // The in-memory parse sees the same file.
  const auto img = read_all(model_path());
  auto m = File::parse(img.data(), img.size(), "stories260K.gguf");
  ASSERT_EQ(m->metadata().size(), f->metadata().size());
  for (size_t k = 0; k < m->metadata().size(); ++k) EXPECT_EQ(m->metadata()[k].key, f->metadata()[k].key);
  ASSERT_EQ(m->tensors().size(), ts.size());
  EXPECT_EQ(std::memcmp(m->tensors()[5].data, ts[5].data, ts[5].nbytes), 0);
}

// ---------------------------------------------------------------------------------------------
// Synthetic files

class GgufRoundTrip : public ::testing::TestWithParam<uint32_t> {};

TEST_P(GgufRoundTrip, EveryValueTypeAndTensors) {
  const uint32_t version = GetParam();
  const auto img = full_writer(version).build();
  auto f = File::parse(img.data(), img.size(), "full.gguf");
  check_full(*f, version, 32);

  // Same image from disk through the mapping.
  TempFile tmp("full_v" + std::to_string(version));
  full_writer(version).write(tmp.path);
  auto g = File::open(tmp.path);
  check_full(*g, version, 32);
  EXPECT_EQ(g->path(), tmp.path);
}

TEST_P(GgufRoundTrip, CustomAlignment) {
  const auto img = full_writer(GetParam(), 64).build();
  auto f = File::parse(img.data(), img.size());
  check_full(*f, GetParam(), 64);
  EXPECT_EQ(f->find_tensor("b.q8")->offset, 64u);
  // Data starts at a multiple of 64 from the image start.
  EXPECT_EQ((f->tensors()[0].data - img.data()) % 64, 0);
}

INSTANTIATE_TEST_SUITE_P(Versions, GgufRoundTrip, ::testing::Values(2u, 3u));

TEST(Gguf, MetadataOnlyFile) {
  GgufWriter w;
  w.add_string("general.name", "x");
  const auto img = w.build();
  auto f = File::parse(img.data(), img.size());
  EXPECT_TRUE(f->tensors().empty());
  EXPECT_EQ(f->tensor_bytes(), 0u);
  EXPECT_EQ(f->get_string("general.name"), "x");
}

TEST(Gguf, GetterErrorsNameKeyAndType) {
  const auto img = full_writer(3).build();
  auto f = File::parse(img.data(), img.size(), "full.gguf");
  auto msg = [&](auto fn) -> std::string {
    try {
      fn();
    } catch (const Error& e) {
      return e.what();
    }
    return "(no error)";
  };
  EXPECT_NE(msg([&] { f->get_float("t.str"); }).find("key 't.str' has type string"), std::string::npos);
  EXPECT_NE(msg([&] { f->get_int("t.f32"); }).find("key 't.f32' has type f32"), std::string::npos);
  EXPECT_NE(msg([&] { f->get_bool("t.u8"); }).find("key 't.u8' has type u8"), std::string::npos);
  EXPECT_NE(msg([&] { f->get_string("t.true"); }).find("has type bool"), std::string::npos);
  EXPECT_NE(msg([&] { f->get_int("t.u64"); }).find("does not fit in int64"), std::string::npos);
  EXPECT_NE(msg([&] { f->get_string_array("t.arr.i32"); }).find("has type array of i32"), std::string::npos);
  EXPECT_NE(msg([&] { f->get_int_array("t.arr.f32"); }).find("has type array of f32"), std::string::npos);
  EXPECT_NE(msg([&] { f->get_int_array("t.arr.u64big"); }).find("does not fit"), std::string::npos);
  EXPECT_NE(msg([&] { f->get_float_array("t.arr.nested"); }).find("array of array"), std::string::npos);
  EXPECT_NE(msg([&] { f->get_string_array("t.str"); }).find("has type string"), std::string::npos);
  EXPECT_EQ(msg([&] { f->get_int("t.u32"); }), "(no error)");
  EXPECT_FALSE(f->get_string("absent").has_value());
  EXPECT_FALSE(f->get_string_array("absent").has_value());
}

// ---------------------------------------------------------------------------------------------
// Broken files: each is rejected with a message saying what and where.

TEST(GgufBroken, BadMagic) {
  expect_error(GgufWriter().set_magic(0x46554746).build(), {"bad magic", "not a GGUF file"});
  expect_error({'G', 'G'}, {"truncated", "magic"});
  expect_error({}, {"truncated"});
}

TEST(GgufBroken, Versions) {
  expect_error(GgufWriter().set_version(1).build(), {"GGUF version 1 is not supported"});
  expect_error(GgufWriter().set_version(4).build(), {"unsupported GGUF version 4"});
  expect_error(GgufWriter().set_version(0x03000000).build(), {"big-endian"});
}

TEST(GgufBroken, TruncatedAtEveryOffset) {
  const auto img = full_writer(3).build();
  ASSERT_NO_THROW(File::parse(img.data(), img.size()));
  for (size_t n = 0; n < img.size(); ++n) {
    // A copy of exactly n bytes, so ASan would flag any read past the end.
    std::vector<uint8_t> prefix(img.begin(), img.begin() + std::ptrdiff_t(n));
    const std::string msg = parse_error(prefix);
    const bool ok = msg.find("truncated") != std::string::npos || msg.find("out of file") != std::string::npos;
    ASSERT_TRUE(ok) << "prefix " << n << ": " << msg;
  }
}

TEST(GgufBroken, TruncatedMessageNamesOffsetAndKey) {
  GgufWriter w;
  w.add_raw("general.name", uint32_t(ValueType::string), bytes_u64(1000000));
  const auto img = w.build();
  // Key "general.name" at 24: 8 + 12 bytes, type 4 bytes: the length field is at offset 48.
  const std::string msg = parse_error(img, "model.gguf");
  EXPECT_EQ(msg, "model.gguf: truncated: string length 1000000 at offset 48 exceeds file size 56 "
                 "(in key 'general.name')");
}

TEST(GgufBroken, AbsurdCounts) {
  expect_error(GgufWriter().set_kv_count(uint64_t(1) << 60).build(), {"truncated", "metadata kv count 1152921504606846976"});
  expect_error(GgufWriter().add_string("a", std::string(100, 'x')).set_kv_count(2).build(),
               {"truncated: key", "(in metadata kv #1)"});
  expect_error(GgufWriter().set_tensor_count(~uint64_t(0)).build(), {"truncated", "tensor count 18446744073709551615"});
  GgufWriter w;
  w.add_tensor_f32("a", {2}, {1.f, 2.f}).set_tensor_count(5);
  expect_error(w.build(), {"truncated", "tensor"});
}

TEST(GgufBroken, AbsurdStringLengths) {
  // Value string length.
  auto payload = bytes_u64(uint64_t(1) << 62);
  payload.insert(payload.end(), {'a', 'b', 'c'});
  expect_error(GgufWriter().add_raw("k", uint32_t(ValueType::string), payload).build(),
               {"truncated", "string length 4611686018427387904", "'k'"});
  // Key length.
  std::vector<uint8_t> img;
  kvq::test::put_u32(img, 0x46554747);
  kvq::test::put_u32(img, 3);
  kvq::test::put_u64(img, 0);
  kvq::test::put_u64(img, 1);
  kvq::test::put_u64(img, ~uint64_t(0));
  img.resize(img.size() + 16, 'x');
  expect_error(img, {"truncated", "key length 18446744073709551615", "offset 24"});
  // Tensor name length.
  GgufWriter t;
  t.add_tensor({"abc", {4}, 0, {}, 0});
  auto timg = t.build();
  timg[24] = 0xff;  // low byte of the name length
  timg[29] = 0x10;
  expect_error(timg, {"truncated", "tensor name length"});
}

TEST(GgufBroken, AbsurdArrayLengths) {
  std::vector<uint8_t> p;
  kvq::test::put_u32(p, uint32_t(ValueType::u8));
  kvq::test::put_u64(p, uint64_t(1) << 60);
  p.resize(p.size() + 100, 0);
  expect_error(GgufWriter().add_raw("big", uint32_t(ValueType::array), p).build(),
               {"truncated", "array length 1152921504606846976", "'big'"});
  // 100 string elements need at least 800 bytes (their length fields) where 200 remain.
  std::vector<uint8_t> q;
  kvq::test::put_u32(q, uint32_t(ValueType::string));
  kvq::test::put_u64(q, 100);
  q.resize(q.size() + 200, 0);
  expect_error(GgufWriter().add_raw("strs", uint32_t(ValueType::array), q).build(),
               {"truncated", "array length 100 (string elements)"});
  // Inside a nested array.
  std::vector<uint8_t> r;
  kvq::test::put_u32(r, uint32_t(ValueType::array));
  kvq::test::put_u64(r, 1);
  kvq::test::put_u32(r, uint32_t(ValueType::f64));
  kvq::test::put_u64(r, uint64_t(1) << 50);
  expect_error(GgufWriter().add_raw("nest", uint32_t(ValueType::array), r).build(), {"truncated", "array length"});
}

TEST(GgufBroken, TooManyMetadataValues) {
  // 2^24 + 1 u8 elements: a legal file size, but ~1.6 GB of parsed values; rejected up front.
  const uint64_t n = (uint64_t(1) << 24) + 1;
  std::vector<uint8_t> p;
  kvq::test::put_u32(p, uint32_t(ValueType::u8));
  kvq::test::put_u64(p, n);
  p.resize(p.size() + n, 0);
  expect_error(GgufWriter().add_raw("huge", uint32_t(ValueType::array), std::move(p)).build(),
               {"more than 16777216 values", "'huge'"});
}

TEST(GgufBroken, NestingTooDeep) {
  GgufWriter ok;
  ok.add("deep", nested(8));
  const auto good = ok.build();
  EXPECT_NO_THROW(File::parse(good.data(), good.size()));
  expect_error(GgufWriter().add("deep", nested(9)).build(), {"nested deeper than 8", "'deep'"});
  expect_error(GgufWriter().add("deeper", nested(200)).build(), {"nested deeper than 8"});
}

TEST(GgufBroken, UnknownValueTypes) {
  expect_error(GgufWriter().add_raw("k", 13, {1, 2, 3, 4}).build(), {"unknown value type 13", "'k'"});
  std::vector<uint8_t> p;
  kvq::test::put_u32(p, 99);
  kvq::test::put_u64(p, 1);
  expect_error(GgufWriter().add_raw("arr", uint32_t(ValueType::array), p).build(),
               {"unknown array element type 99", "'arr'"});
}

TEST(GgufBroken, DuplicateKeys) {
  expect_error(GgufWriter().add_u32("a", 1).add_u32("a", 2).build(), {"duplicate metadata key 'a'"});
}

TEST(GgufBroken, UnknownTensorType) {
  expect_error(GgufWriter().add_tensor({"blk.0.w", {32}, 77, {}, 0}).build(),
               {"tensor 'blk.0.w'", "unknown tensor type id 77"});
  expect_error(GgufWriter().add_tensor({"w", {32}, 4, {}, 0}).build(), {"unknown tensor type id 4"});
}

TEST(GgufBroken, BadNDims) {
  expect_error(GgufWriter().add_tensor({"t0", {}, 0, {}, 0}).build(), {"tensor 't0'", "n_dims 0 not in 1..4"});
  expect_error(GgufWriter().add_tensor({"t5", {1, 1, 1, 1, 1}, 0, {}, 0}).build(),
               {"tensor 't5'", "n_dims 5 not in 1..4"});
  GgufWriter w;
  w.add_tensor({"huge", {}, 0, {}, 0});
  auto img = w.build();
  img[24 + 8 + 4 + 3] = 0x80;  // n_dims = 0x80000000
  expect_error(img, {"n_dims 2147483648"});
}

TEST(GgufBroken, ZeroDim) {
  expect_error(GgufWriter().add_tensor({"z", {4, 0, 2}, 0, {}, 0}).build(), {"tensor 'z'", "dimension 1 is zero"});
}

TEST(GgufBroken, OverflowingDims) {
  expect_error(GgufWriter().add_tensor({"o", {uint64_t(1) << 32, uint64_t(1) << 32}, 0, {}, 0}).build(),
               {"tensor 'o'", "overflow"});
  expect_error(GgufWriter().add_tensor({"n", {uint64_t(1) << 63}, 0, {}, 0}).build(), {"tensor 'n'", "overflow"});
  expect_error(GgufWriter().add_tensor({"big", {~uint64_t(0)}, 0, {}, 0}).build(), {"overflow"});
  // 2^62 F64 elements fit in int64 but their 2^65 bytes do not fit in 64 bits.
  expect_error(GgufWriter().add_tensor({"b", {uint64_t(1) << 31, uint64_t(1) << 31}, uint32_t(GgmlType::F64), {}, 0})
                   .build(),
               {"tensor 'b'", "byte size", "overflows"});
}

TEST(GgufBroken, RowNotMultipleOfBlock) {
  expect_error(GgufWriter().add_tensor({"q", {33, 2}, uint32_t(GgmlType::Q4_0), {}, 0}).build(),
               {"tensor 'q'", "ne[0] = 33", "block size 32", "Q4_0"});
}

TEST(GgufBroken, MisalignedOffset) {
  GgufWriter w;
  w.add_tensor_f32("a", {8}, std::vector<float>(8, 1.f));
  w.add_tensor({"m", {2}, 0, std::vector<uint8_t>(8, 0), 36});
  expect_error(w.build(), {"tensor 'm'", "offset 36 is misaligned (alignment 32)"});
  GgufWriter v;
  v.set_alignment(64).add_tensor({"m64", {2}, 0, std::vector<uint8_t>(8, 0), 32});
  expect_error(v.build(), {"tensor 'm64'", "misaligned (alignment 64)"});
}

TEST(GgufBroken, DataOutOfRange) {
  GgufWriter w;
  w.add_tensor({"blk.0.attn_q.weight", {64}, 0, {}, 1 << 20});
  const auto img = w.build();
  const uint64_t start = img.size() + (32 - img.size() % 32) % 32;  // data section start
  expect_error(img, {fmt::format("tensor 'blk.0.attn_q.weight': data [{}, {}) out of file (size {})",
                                 start + (1 << 20), start + (1 << 20) + 256, img.size())
                         .c_str()});
  // An offset near 2^64 must not wrap around.
  GgufWriter x;
  x.add_tensor({"wrap", {8}, 0, {}, ~uint64_t(0) - 31});
  expect_error(x.build(), {"tensor 'wrap'", "out of file"});
  // Data one byte short.
  auto full = GgufWriter().add_tensor_f32("short", {4}, {1, 2, 3, 4}).build();
  full.pop_back();
  expect_error(full, {"tensor 'short'", "out of file"});
}

TEST(GgufBroken, BadAlignment) {
  expect_error(GgufWriter().add_u32("general.alignment", 0).build(), {"general.alignment 0", "power of two"});
  expect_error(GgufWriter().add_u32("general.alignment", 48).build(), {"general.alignment 48", "power of two"});
  expect_error(GgufWriter().add_u64("general.alignment", 32).build(), {"general.alignment has type u64, expected u32"});
  expect_error(GgufWriter().add_string("general.alignment", "32").build(), {"general.alignment has type string"});
}

TEST(GgufBroken, DuplicateTensorNames) {
  GgufWriter w;
  w.add_tensor_f32("dup", {2}, {1, 2}).add_tensor_f32("x", {2}, {1, 2}).add_tensor_f32("dup", {2}, {3, 4});
  expect_error(w.build(), {"duplicate tensor name 'dup'"});
}

TEST(GgufBroken, UnprintableNamesAreEscaped) {
  expect_error(GgufWriter().add_tensor({std::string("a\x1b[2J\n", 6), {32}, 99, {}, 0}).build(),
               {"tensor 'a\\x1b[2J\\x0a'"});
}

TEST(GgufFile, OpenErrors) {
  try {
    File::open("/nonexistent/dir/model.gguf");
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/dir/model.gguf: cannot open"), std::string::npos) << e.what();
  }
  EXPECT_THROW(File::open(std::filesystem::temp_directory_path().string()), Error);
  TempFile empty("empty");
  { std::ofstream(empty.path, std::ios::binary); }
  try {
    File::open(empty.path);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("empty file"), std::string::npos) << e.what();
  }
  TempFile broken("broken");
  GgufWriter().set_version(1).write(broken.path);
  try {
    File::open(broken.path);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()), broken.path + ": GGUF version 1 is not supported (only versions 2 and 3)");
  }
}

// Writes the fuzzer's seed corpus when KVQ_GGUF_SEED_DIR is set (see fuzz/gguf_fuzz.cpp).
TEST(GgufFuzzSeeds, Write) {
  const char* dir = std::getenv("KVQ_GGUF_SEED_DIR");
  if (!dir) GTEST_SKIP() << "set KVQ_GGUF_SEED_DIR to write the fuzz seed corpus";
  std::filesystem::create_directories(dir);
  const std::string d = dir;
  full_writer(3).write(d + "/full_v3.gguf");
  full_writer(2, 64).write(d + "/full_v2_align64.gguf");
  GgufWriter().add_string("general.name", "x").write(d + "/metadata_only.gguf");
  GgufWriter q;
  q.add_string("general.architecture", "llama").add_u32("llama.block_count", 1);
  q.add_string_array("tokenizer.ggml.tokens", {"<unk>", "<s>", "</s>", "a"});
  q.add_f32_array("tokenizer.ggml.scores", {0, 0, 0, -1});
  q.add_tensor("blk.0.attn_q.weight", GgmlType::Q4_K, {256, 2});
  q.add_tensor("blk.0.attn_k.weight", GgmlType::Q6_K, {256});
  q.add_tensor("blk.0.ffn_up.weight", GgmlType::BF16, {8, 2, 2});
  q.write(d + "/quant.gguf");
  EXPECT_TRUE(std::filesystem::exists(d + "/quant.gguf"));
}
