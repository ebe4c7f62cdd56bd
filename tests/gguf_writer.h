// Tiny GGUF image builder for tests: metadata of any type (nested arrays included), tensors with
// given type/dims/data, alignment, raw bytes for deliberately broken files. Produces the image
// as bytes or writes it to a file. Header-only; test code, not part of the library.
//
//   kvq::test::GgufWriter w;                       // version 3, alignment 32
//   w.add_string("general.architecture", "llama");
//   w.add_u32("llama.block_count", 2);
//   w.add_tensor_f32("token_embd.weight", {4, 8}, values);   // ne[0] = 4 (fastest), 32 floats
//   std::vector<uint8_t> img = w.build();
#pragma once
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <unistd.h>

#include "gguf/gguf.h"

namespace kvq::test {

using gguf::Value;
using gguf::ValueType;

// Little-endian byte emitters (also handy for hand-made broken payloads).
inline void put_bytes(std::vector<uint8_t>& out, const void* p, size_t n) {
  const size_t at = out.size();
  out.resize(at + n);
  if (n) std::memcpy(out.data() + at, p, n);
}
template <typename T>
inline void put(std::vector<uint8_t>& out, T v) {
  put_bytes(out, &v, sizeof(T));  // x86-64 is little-endian, as GGUF is
}
inline void put_u32(std::vector<uint8_t>& out, uint32_t v) { put(out, v); }
inline void put_u64(std::vector<uint8_t>& out, uint64_t v) { put(out, v); }
inline void put_str(std::vector<uint8_t>& out, const std::string& s) {
  put_u64(out, s.size());
  put_bytes(out, s.data(), s.size());
}

// Value constructors: gv::u32(7), gv::str("x"), gv::arr(ValueType::i32, {gv::i32(1), gv::i32(2)}).
namespace gv {
inline Value make(ValueType t) {
  Value v;
  v.type = t;
  return v;
}
inline Value u8(uint8_t x) { auto v = make(ValueType::u8); v.u = x; return v; }
inline Value i8(int8_t x) { auto v = make(ValueType::i8); v.i = x; return v; }
inline Value u16(uint16_t x) { auto v = make(ValueType::u16); v.u = x; return v; }
inline Value i16(int16_t x) { auto v = make(ValueType::i16); v.i = x; return v; }
inline Value u32(uint32_t x) { auto v = make(ValueType::u32); v.u = x; return v; }
inline Value i32(int32_t x) { auto v = make(ValueType::i32); v.i = x; return v; }
inline Value u64(uint64_t x) { auto v = make(ValueType::u64); v.u = x; return v; }
inline Value i64(int64_t x) { auto v = make(ValueType::i64); v.i = x; return v; }
inline Value f32(float x) { auto v = make(ValueType::f32); v.f = x; return v; }
inline Value f64(double x) { auto v = make(ValueType::f64); v.f = x; return v; }
inline Value boolean(bool x) { auto v = make(ValueType::boolean); v.u = x; return v; }
inline Value str(std::string s) { auto v = make(ValueType::string); v.s = std::move(s); return v; }
inline Value arr(ValueType elem, std::vector<Value> items) {
  auto v = make(ValueType::array);
  v.elem_type = elem;
  v.arr = std::move(items);
  return v;
}
}  // namespace gv

// Serializes one value's payload (no type tag for scalars; arrays carry elem type + count).
inline void put_value(std::vector<uint8_t>& out, const Value& v) {
  switch (v.type) {
    case ValueType::u8: put(out, uint8_t(v.u)); break;
    case ValueType::i8: put(out, int8_t(v.i)); break;
    case ValueType::u16: put(out, uint16_t(v.u)); break;
    case ValueType::i16: put(out, int16_t(v.i)); break;
    case ValueType::u32: put(out, uint32_t(v.u)); break;
    case ValueType::i32: put(out, int32_t(v.i)); break;
    case ValueType::u64: put(out, uint64_t(v.u)); break;
    case ValueType::i64: put(out, int64_t(v.i)); break;
    case ValueType::f32: put(out, float(v.f)); break;
    case ValueType::f64: put(out, double(v.f)); break;
    case ValueType::boolean: put(out, uint8_t(v.u ? 1 : 0)); break;
    case ValueType::string: put_str(out, v.s); break;
    case ValueType::array:
      put_u32(out, uint32_t(v.elem_type));
      put_u64(out, v.arr.size());
      for (const auto& e : v.arr) put_value(out, e);
      break;
    default: break;  // an invalid type id: the tag alone is written (for negative tests)
  }
}

class GgufWriter {
 public:
  struct Tensor {
    std::string name;
    std::vector<uint64_t> dims;  // ne[0] first; raw so tests can write 0 or absurd values
    uint32_t type_id = 0;        // GgmlType id (raw so tests can write unknown ids)
    std::vector<uint8_t> data;
    std::optional<uint64_t> offset;  // relative to the data section; default: next aligned slot
  };

  explicit GgufWriter(uint32_t version = 3) : version_(version) {}

  // Header fields, overridable to build broken files.
  GgufWriter& set_version(uint32_t v) { version_ = v; return *this; }
  GgufWriter& set_magic(uint32_t m) { magic_ = m; return *this; }
  GgufWriter& set_kv_count(uint64_t n) { kv_count_ = n; return *this; }
  GgufWriter& set_tensor_count(uint64_t n) { tensor_count_ = n; return *this; }
  // Lays data out with alignment a and records general.alignment = a (u32).
  GgufWriter& set_alignment(uint32_t a) {
    alignment_ = a;
    return add_u32("general.alignment", a);
  }
  // Layout alignment only, without the metadata key (for files that lie about it).
  GgufWriter& set_layout_alignment(uint32_t a) { alignment_ = a; return *this; }
  uint32_t alignment() const { return alignment_; }

  GgufWriter& add(const std::string& key, Value v) {
    std::vector<uint8_t> payload;
    put_value(payload, v);
    return add_raw(key, uint32_t(v.type), std::move(payload));
  }
  // Key, type tag and arbitrary payload bytes.
  GgufWriter& add_raw(const std::string& key, uint32_t type, std::vector<uint8_t> payload) {
    std::vector<uint8_t> b;
    put_str(b, key);
    put_u32(b, type);
    b.insert(b.end(), payload.begin(), payload.end());
    kvs_.push_back(std::move(b));
    return *this;
  }
  GgufWriter& add_u8(const std::string& k, uint8_t x) { return add(k, gv::u8(x)); }
  GgufWriter& add_i8(const std::string& k, int8_t x) { return add(k, gv::i8(x)); }
  GgufWriter& add_u16(const std::string& k, uint16_t x) { return add(k, gv::u16(x)); }
  GgufWriter& add_i16(const std::string& k, int16_t x) { return add(k, gv::i16(x)); }
  GgufWriter& add_u32(const std::string& k, uint32_t x) { return add(k, gv::u32(x)); }
  GgufWriter& add_i32(const std::string& k, int32_t x) { return add(k, gv::i32(x)); }
  GgufWriter& add_u64(const std::string& k, uint64_t x) { return add(k, gv::u64(x)); }
  GgufWriter& add_i64(const std::string& k, int64_t x) { return add(k, gv::i64(x)); }
  GgufWriter& add_f32(const std::string& k, float x) { return add(k, gv::f32(x)); }
  GgufWriter& add_f64(const std::string& k, double x) { return add(k, gv::f64(x)); }
  GgufWriter& add_bool(const std::string& k, bool x) { return add(k, gv::boolean(x)); }
  GgufWriter& add_string(const std::string& k, const std::string& s) { return add(k, gv::str(s)); }
  GgufWriter& add_array(const std::string& k, ValueType elem, std::vector<Value> items) {
    return add(k, gv::arr(elem, std::move(items)));
  }
  GgufWriter& add_string_array(const std::string& k, const std::vector<std::string>& xs) {
    std::vector<Value> items;
    for (const auto& x : xs) items.push_back(gv::str(x));
    return add_array(k, ValueType::string, std::move(items));
  }
  GgufWriter& add_f32_array(const std::string& k, const std::vector<float>& xs) {
    std::vector<Value> items;
    for (float x : xs) items.push_back(gv::f32(x));
    return add_array(k, ValueType::f32, std::move(items));
  }
  GgufWriter& add_i32_array(const std::string& k, const std::vector<int32_t>& xs) {
    std::vector<Value> items;
    for (int32_t x : xs) items.push_back(gv::i32(x));
    return add_array(k, ValueType::i32, std::move(items));
  }

  GgufWriter& add_tensor(Tensor t) {
    tensors_.push_back(std::move(t));
    return *this;
  }
  // The tensors added so far, to edit or remove before build().
  std::vector<Tensor>& tensors() { return tensors_; }
  // A tensor with data of the right size for its type and shape (zero-filled when data is empty).
  GgufWriter& add_tensor(const std::string& name, GgmlType type, const std::vector<int64_t>& ne,
                         std::vector<uint8_t> data = {}) {
    const auto* tr = ggml_type_traits(uint32_t(type));
    if (!tr) throw std::invalid_argument("GgufWriter: unknown type");
    uint64_t n = 1;
    std::vector<uint64_t> dims;
    for (int64_t d : ne) {
      n *= uint64_t(d);
      dims.push_back(uint64_t(d));
    }
    const size_t nbytes = size_t(n / uint64_t(tr->block_size) * tr->type_size);
    if (data.empty()) data.assign(nbytes, 0);
    if (data.size() != nbytes) throw std::invalid_argument("GgufWriter: data size does not match shape");
    return add_tensor(Tensor{name, std::move(dims), uint32_t(type), std::move(data), std::nullopt});
  }
  GgufWriter& add_tensor_f32(const std::string& name, const std::vector<int64_t>& ne,
                             const std::vector<float>& values) {
    std::vector<uint8_t> data(values.size() * sizeof(float));
    if (!values.empty()) std::memcpy(data.data(), values.data(), data.size());
    return add_tensor(name, GgmlType::F32, ne, std::move(data));
  }

  // The image: header, kv, tensor index, padding to the alignment, data section. The file ends
  // right after the last tensor's data (no trailing padding), so every shorter prefix is invalid.
  std::vector<uint8_t> build() const {
    std::vector<uint8_t> out;
    put_u32(out, magic_);
    put_u32(out, version_);
    put_u64(out, tensor_count_.value_or(tensors_.size()));
    put_u64(out, kv_count_.value_or(kvs_.size()));
    for (const auto& kv : kvs_) out.insert(out.end(), kv.begin(), kv.end());

    std::vector<uint64_t> offsets;
    uint64_t next = 0;
    for (const auto& t : tensors_) {
      const uint64_t off = t.offset.value_or(next);
      offsets.push_back(off);
      if (!t.offset) next = align_up(off + t.data.size());
    }
    for (size_t k = 0; k < tensors_.size(); ++k) {
      const auto& t = tensors_[k];
      put_str(out, t.name);
      put_u32(out, uint32_t(t.dims.size()));
      for (uint64_t d : t.dims) put_u64(out, d);
      put_u32(out, t.type_id);
      put_u64(out, offsets[k]);
    }
    if (tensors_.empty()) return out;

    const size_t data_start = size_t(align_up(out.size()));
    out.resize(data_start, 0);
    for (size_t k = 0; k < tensors_.size(); ++k) {
      const auto& t = tensors_[k];
      if (t.data.empty()) continue;
      const size_t at = data_start + size_t(offsets[k]);
      if (out.size() < at + t.data.size()) out.resize(at + t.data.size(), 0);
      std::memcpy(out.data() + at, t.data.data(), t.data.size());
    }
    return out;
  }

  // Written beside `path` under a name of this process's own, then renamed over it: ctest runs a
  // suite's tests as separate processes at once, and a test that rewrote a file in place under
  // another's mapping of it would kill that one with SIGBUS. A rename leaves the old file to whoever
  // still maps it.
  void write(const std::string& path) const {
    const auto img = build();
    const std::string tmp = path + ".tmp" + std::to_string(::getpid());
    std::FILE* f = std::fopen(tmp.c_str(), "wb");
    if (!f) throw std::runtime_error("GgufWriter: cannot create " + tmp);
    const size_t n = std::fwrite(img.data(), 1, img.size(), f);
    if (std::fclose(f) != 0 || n != img.size()) {
      std::remove(tmp.c_str());
      throw std::runtime_error("GgufWriter: cannot write " + tmp);
    }
    if (std::rename(tmp.c_str(), path.c_str()) != 0) {
      std::remove(tmp.c_str());
      throw std::runtime_error("GgufWriter: cannot rename " + tmp + " to " + path);
    }
  }

 private:
  uint64_t align_up(uint64_t n) const { return (n + alignment_ - 1) / alignment_ * alignment_; }

  uint32_t magic_ = 0x46554747;  // "GGUF"
  uint32_t version_;
  uint32_t alignment_ = 32;
  std::optional<uint64_t> kv_count_, tensor_count_;
  std::vector<std::vector<uint8_t>> kvs_;  // serialized key + type + value, in order
  std::vector<Tensor> tensors_;
};

}  // namespace kvq::test
