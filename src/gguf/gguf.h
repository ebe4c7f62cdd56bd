// GGUF reader (versions 2 and 3): the file is mmapped read-only; metadata is parsed into values,
// tensor data is referenced in place. Every count, length, offset and size is bounds-checked
// against the file; anything malformed throws kvq::Error naming what is wrong (never crashes).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "gguf/ggml_types.h"

namespace kvq::gguf {

enum class ValueType : uint32_t {
  u8 = 0, i8 = 1, u16 = 2, i16 = 3, u32 = 4, i32 = 5, f32 = 6, boolean = 7,
  string = 8, array = 9, u64 = 10, i64 = 11, f64 = 12,
};
const char* value_type_name(ValueType t);

struct Value {
  ValueType type = ValueType::u8;
  // scalars: exactly one of these is meaningful, chosen by `type`
  uint64_t u = 0;   // u8/u16/u32/u64, boolean (0/1)
  int64_t i = 0;    // i8/i16/i32/i64
  double f = 0;     // f32/f64
  std::string s;    // string
  // arrays: element type and elements (arrays may nest)
  ValueType elem_type = ValueType::u8;
  std::vector<Value> arr;

  bool is_integer() const;
  bool is_float() const;
  std::optional<int64_t> as_int() const;    // any integer type (u64 beyond int64 range: nullopt)
  std::optional<double> as_number() const;  // any integer or float type
};

struct KeyValue {
  std::string key;
  Value value;
};

struct TensorInfo {
  std::string name;
  GgmlType type = GgmlType::F32;
  std::vector<int64_t> ne;     // dimensions, ne[0] fastest-varying (a row has ne[0] elements)
  uint64_t offset = 0;         // relative to the start of the tensor data section
  const uint8_t* data = nullptr;  // points into the mapping
  size_t nbytes = 0;
  int64_t n_elements() const;
};

class File {
 public:
  // Maps and parses `path`; throws kvq::Error ("<path>: <what is wrong>") on any problem.
  static std::unique_ptr<File> open(const std::string& path);
  // Parses an in-memory image (the fuzzer and tests use it); the buffer must outlive the File.
  static std::unique_ptr<File> parse(const uint8_t* data, size_t size, const std::string& name = "<memory>");
  ~File();

  uint32_t version() const { return version_; }
  uint32_t alignment() const { return alignment_; }
  const std::vector<KeyValue>& metadata() const { return kv_; }
  const Value* find(std::string_view key) const;

  // Typed getters: nullopt when the key is absent; kvq::Error when present with the wrong type.
  std::optional<std::string> get_string(std::string_view key) const;
  std::optional<int64_t> get_int(std::string_view key) const;
  std::optional<double> get_float(std::string_view key) const;  // accepts integers too
  std::optional<bool> get_bool(std::string_view key) const;
  // Arrays (empty optional when absent; kvq::Error when not an array of the expected kind).
  std::optional<std::vector<std::string>> get_string_array(std::string_view key) const;
  std::optional<std::vector<float>> get_float_array(std::string_view key) const;
  std::optional<std::vector<int64_t>> get_int_array(std::string_view key) const;

  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find_tensor(std::string_view name) const;
  // Sum of all tensors' nbytes (weights memory).
  size_t tensor_bytes() const;
  const std::string& path() const { return path_; }
  // The whole file as mapped (or the buffer given to parse).
  const uint8_t* image() const { return image_; }
  size_t image_size() const { return image_size_; }

 private:
  File() = default;
  std::string path_;
  uint32_t version_ = 0;
  uint32_t alignment_ = 32;
  std::vector<KeyValue> kv_;
  std::vector<TensorInfo> tensors_;
  void* map_ = nullptr;
  size_t map_size_ = 0;
  const uint8_t* image_ = nullptr;
  size_t image_size_ = 0;
  friend struct Parser;
};

}  // namespace kvq::gguf
