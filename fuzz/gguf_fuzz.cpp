// libFuzzer target for the GGUF reader: any input must either parse into a File whose every
// value and tensor can be read safely, or throw kvq::Error. Crashes, sanitizer reports, leaks
// and huge allocations are bugs. Seeds: fuzz/corpus/gguf/ (regenerate with
// KVQ_GGUF_SEED_DIR=fuzz/corpus/gguf test_gguf --gtest_filter=GgufFuzzSeeds.*).
#include <cstddef>
#include <cstdint>
#include <string>

#include "core/error.h"
#include "gguf/gguf.h"

namespace {

using kvq::gguf::Value;
using kvq::gguf::ValueType;

// Reads every field that the value's type makes meaningful.
uint64_t walk(const Value& v, int depth) {
  if (depth > 8) __builtin_trap();  // the reader promised to cap nesting
  uint64_t h = uint64_t(v.type) + v.u + uint64_t(v.i) + v.s.size();
  if (auto n = v.as_number()) h += uint64_t(*n != 0);
  if (auto n = v.as_int()) h += uint64_t(*n);
  for (unsigned char c : v.s) h = h * 31 + c;
  if (v.type == ValueType::array) {
    for (const auto& e : v.arr) {
      if (e.type != v.elem_type) __builtin_trap();
      h += walk(e, depth + 1);
    }
  }
  return h;
}

template <typename F>
void try_get(F&& f) {
  try {
    f();
  } catch (const kvq::Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::unique_ptr<kvq::gguf::File> f;
  try {
    f = kvq::gguf::File::parse(data, size, "fuzz.gguf");
  } catch (const kvq::Error&) {
    return 0;
  }
  volatile uint64_t sink = f->version() + f->alignment();
  for (const auto& kv : f->metadata()) {
    sink = sink + walk(kv.value, 0);
    if (f->find(kv.key) == nullptr) __builtin_trap();
    try_get([&] { sink = sink + f->get_string(kv.key).value_or("").size(); });
    try_get([&] { sink = sink + uint64_t(f->get_int(kv.key).value_or(0)); });
    try_get([&] { sink = sink + uint64_t(f->get_float(kv.key).value_or(0) != 0); });
    try_get([&] { sink = sink + f->get_bool(kv.key).value_or(false); });
    try_get([&] { sink = sink + f->get_string_array(kv.key).value_or(std::vector<std::string>{}).size(); });
    try_get([&] { sink = sink + f->get_float_array(kv.key).value_or(std::vector<float>{}).size(); });
    try_get([&] { sink = sink + f->get_int_array(kv.key).value_or(std::vector<int64_t>{}).size(); });
  }
  size_t total = 0;
  for (const auto& t : f->tensors()) {
    const auto* tr = kvq::ggml_type_traits(uint32_t(t.type));
    if (!tr || t.ne.empty() || t.ne.size() > 4 || t.nbytes == 0) __builtin_trap();
    if (t.data < data || t.data + t.nbytes > data + size) __builtin_trap();
    if (t.ne[0] % tr->block_size != 0) __builtin_trap();
    const int64_t rows = t.n_elements() / t.ne[0];
    if (kvq::ggml_row_bytes(t.type, t.ne[0]) * size_t(rows) != t.nbytes) __builtin_trap();
    if (f->find_tensor(t.name) != &t) __builtin_trap();
    sink = sink + t.data[0] + t.data[t.nbytes - 1];  // ASan checks both ends are in the input
    total += t.nbytes;
  }
  if (f->tensor_bytes() != total) __builtin_trap();
  return 0;
}
