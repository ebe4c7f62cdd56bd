#include "gguf/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>
#include <unordered_set>

#include "core/error.h"

namespace kvq::gguf {

namespace {

constexpr uint32_t kMagic = 0x46554747;  // "GGUF" read as a little-endian u32
constexpr int kMaxArrayDepth = 8;
// Each parsed Value costs ~100 bytes of RAM whatever its size on disk (a u8 element is 1 byte),
// so the element count is capped as well as bounded by the file: the largest real vocabularies
// (~260k tokens, ~1M merges) stay far below, while a crafted file cannot blow memory up ~100x.
constexpr uint64_t kMaxValues = uint64_t(1) << 24;
// Smallest encodings, used to bound counts by the bytes left before anything is allocated:
// kv = key length (8) + value type (4) + 1-byte value; tensor info = name length (8) +
// n_dims (4) + type (4) + offset (8) with an empty name and no dims (real ones are larger).
constexpr uint64_t kMinKvBytes = 13;
constexpr uint64_t kMinTensorInfoBytes = 24;

bool valid_value_type(uint32_t t) { return t <= uint32_t(ValueType::f64); }

// Bytes a value of type t takes at least (strings: their length field; arrays: elem type + count).
uint64_t min_value_bytes(ValueType t) {
  switch (t) {
    case ValueType::u8: case ValueType::i8: case ValueType::boolean: return 1;
    case ValueType::u16: case ValueType::i16: return 2;
    case ValueType::u32: case ValueType::i32: case ValueType::f32: return 4;
    case ValueType::u64: case ValueType::i64: case ValueType::f64: return 8;
    case ValueType::string: return 8;
    case ValueType::array: return 12;
  }
  return 1;
}

// Names and keys come from the file: escape what would garble a terminal and cap the length.
std::string printable(std::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (out.size() >= 80) {
      out += "...";
      break;
    }
    unsigned char c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7f && c != '\\') {
      out += char(c);
    } else {
      out += fmt::format("\\x{:02x}", c);
    }
  }
  return out;
}

std::string type_desc(const Value& v) {
  if (v.type == ValueType::array) return fmt::format("array of {}", value_type_name(v.elem_type));
  return value_type_name(v.type);
}

}  // namespace

const char* value_type_name(ValueType t) {
  switch (t) {
    case ValueType::u8: return "u8";
    case ValueType::i8: return "i8";
    case ValueType::u16: return "u16";
    case ValueType::i16: return "i16";
    case ValueType::u32: return "u32";
    case ValueType::i32: return "i32";
    case ValueType::f32: return "f32";
    case ValueType::boolean: return "bool";
    case ValueType::string: return "string";
    case ValueType::array: return "array";
    case ValueType::u64: return "u64";
    case ValueType::i64: return "i64";
    case ValueType::f64: return "f64";
  }
  return "unknown";
}

bool Value::is_integer() const {
  switch (type) {
    case ValueType::u8: case ValueType::i8: case ValueType::u16: case ValueType::i16:
    case ValueType::u32: case ValueType::i32: case ValueType::u64: case ValueType::i64:
      return true;
    default:
      return false;
  }
}

bool Value::is_float() const { return type == ValueType::f32 || type == ValueType::f64; }

std::optional<int64_t> Value::as_int() const {
  switch (type) {
    case ValueType::u8: case ValueType::u16: case ValueType::u32: case ValueType::u64:
      if (u > uint64_t(std::numeric_limits<int64_t>::max())) return std::nullopt;
      return int64_t(u);
    case ValueType::i8: case ValueType::i16: case ValueType::i32: case ValueType::i64:
      return i;
    default:
      return std::nullopt;
  }
}

std::optional<double> Value::as_number() const {
  if (is_float()) return f;
  switch (type) {
    case ValueType::u8: case ValueType::u16: case ValueType::u32: case ValueType::u64:
      return double(u);
    case ValueType::i8: case ValueType::i16: case ValueType::i32: case ValueType::i64:
      return double(i);
    default:
      return std::nullopt;
  }
}

int64_t TensorInfo::n_elements() const {
  int64_t n = 1;
  for (int64_t d : ne) n *= d;  // validated at parse time: no overflow
  return n;
}

// The bounds-checked cursor over the image plus the parsing of each section. Every read checks
// the bytes left first; every count is bounded by the bytes left before anything is reserved.
struct Parser {
  File& file;
  const uint8_t* base;
  size_t size;
  size_t pos = 0;
  std::string ctx;  // where we are, e.g. " (in key 'general.name')", appended to errors
  uint64_t n_values = 0;

  Parser(File& f, const uint8_t* b, size_t n) : file(f), base(b), size(n) {}

  // Errors that name their subject themselves (a tensor, a header field).
  template <typename... Args>
  [[noreturn]] void fail(fmt::format_string<Args...> f, Args&&... args) {
    throw Error(fmt::format("{}: {}", file.path_, fmt::format(f, std::forward<Args>(args)...)));
  }
  // Errors at the cursor: add which key / tensor entry is being read.
  template <typename... Args>
  [[noreturn]] void fail_here(fmt::format_string<Args...> f, Args&&... args) {
    throw Error(fmt::format("{}: {}{}", file.path_, fmt::format(f, std::forward<Args>(args)...), ctx));
  }

  size_t remaining() const { return size - pos; }

  void need(uint64_t n, const char* what) {
    if (n > remaining())
      fail_here("truncated: {} ({} bytes) at offset {} exceeds file size {}", what, n, pos, size);
  }

  template <typename T>
  T read(const char* what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, base + pos, sizeof(T));  // unaligned, little-endian host (x86-64)
    pos += sizeof(T);
    return v;
  }
  uint32_t read_u32(const char* what) { return read<uint32_t>(what); }
  uint64_t read_u64(const char* what) { return read<uint64_t>(what); }

  std::string read_string(const char* what) {
    const size_t at = pos;
    if (remaining() < 8)
      fail_here("truncated: {} length (8 bytes) at offset {} exceeds file size {}", what, pos, size);
    uint64_t n = read_u64(what);
    if (n > remaining())
      fail_here("truncated: {} length {} at offset {} exceeds file size {}", what, n, at, size);
    std::string s(reinterpret_cast<const char*>(base + pos), size_t(n));
    pos += size_t(n);
    return s;
  }

  void count_values(uint64_t n) {
    n_values += n;
    if (n_values > kMaxValues) fail_here("metadata holds more than {} values", kMaxValues);
  }

  Value read_value(ValueType type, int depth) {
    Value v;
    v.type = type;
    switch (type) {
      case ValueType::u8: v.u = read<uint8_t>("u8 value"); break;
      case ValueType::i8: v.i = read<int8_t>("i8 value"); break;
      case ValueType::u16: v.u = read<uint16_t>("u16 value"); break;
      case ValueType::i16: v.i = read<int16_t>("i16 value"); break;
      case ValueType::u32: v.u = read<uint32_t>("u32 value"); break;
      case ValueType::i32: v.i = read<int32_t>("i32 value"); break;
      case ValueType::u64: v.u = read<uint64_t>("u64 value"); break;
      case ValueType::i64: v.i = read<int64_t>("i64 value"); break;
      case ValueType::f32: v.f = read<float>("f32 value"); break;
      case ValueType::f64: v.f = read<double>("f64 value"); break;
      case ValueType::boolean: v.u = read<uint8_t>("bool value") != 0; break;
      case ValueType::string: v.s = read_string("string"); break;
      case ValueType::array: {
        if (depth >= kMaxArrayDepth) fail_here("arrays nested deeper than {} levels", kMaxArrayDepth);
        const size_t type_at = pos;
        uint32_t et = read_u32("array element type");
        if (!valid_value_type(et)) fail_here("unknown array element type {} at offset {}", et, type_at);
        v.elem_type = ValueType(et);
        const size_t count_at = pos;
        uint64_t n = read_u64("array length");
        const uint64_t min_bytes = min_value_bytes(v.elem_type);
        if (n > remaining() / min_bytes)
          fail_here("truncated: array length {} ({} elements) at offset {} exceeds file size {}", n,
               value_type_name(v.elem_type), count_at, size);
        count_values(n);
        v.arr.reserve(size_t(n));
        for (uint64_t k = 0; k < n; ++k) v.arr.push_back(read_value(v.elem_type, depth + 1));
        break;
      }
    }
    return v;
  }

  void parse() {
    const uint32_t magic = read_u32("magic");
    if (magic != kMagic)
      fail("bad magic {:02x} {:02x} {:02x} {:02x}: not a GGUF file (expected 'GGUF')", base[0], base[1],
           base[2], base[3]);
    const uint32_t version = read_u32("version");
    if (version == 1) fail("GGUF version 1 is not supported (only versions 2 and 3)");
    if (version != 2 && version != 3) {
      if ((version & 0xffff) == 0 && (__builtin_bswap32(version) == 2 || __builtin_bswap32(version) == 3))
        fail("big-endian GGUF files are not supported");
      fail("unsupported GGUF version {} (only versions 2 and 3)", version);
    }
    file.version_ = version;

    const size_t nt_at = pos;
    const uint64_t n_tensors = read_u64("tensor count");
    const size_t nkv_at = pos;
    const uint64_t n_kv = read_u64("metadata kv count");
    if (n_tensors > remaining() / kMinTensorInfoBytes)
      fail("truncated: tensor count {} at offset {} exceeds file size {}", n_tensors, nt_at, size);
    if (n_kv > remaining() / kMinKvBytes)
      fail("truncated: metadata kv count {} at offset {} exceeds file size {}", n_kv, nkv_at, size);

    // Metadata
    file.kv_.reserve(size_t(n_kv));
    std::unordered_set<std::string> keys;
    for (uint64_t k = 0; k < n_kv; ++k) {
      ctx = fmt::format(" (in metadata kv #{})", k);
      std::string key = read_string("key");
      if (!keys.insert(key).second) fail("duplicate metadata key '{}'", printable(key));
      ctx = fmt::format(" (in key '{}')", printable(key));
      const size_t type_at = pos;
      const uint32_t t = read_u32("value type");
      if (!valid_value_type(t)) fail_here("unknown value type {} at offset {}", t, type_at);
      count_values(1);
      file.kv_.push_back({std::move(key), read_value(ValueType(t), 0)});
    }
    ctx.clear();

    if (const Value* a = file.find("general.alignment")) {
      if (a->type != ValueType::u32)
        fail("general.alignment has type {}, expected u32", type_desc(*a));
      if (a->u == 0 || (a->u & (a->u - 1)) != 0)
        fail("general.alignment {} is not a nonzero power of two", a->u);
      file.alignment_ = uint32_t(a->u);
    }

    // Tensor index
    if (n_tensors > remaining() / kMinTensorInfoBytes)
      fail("truncated: tensor count {} at offset {} exceeds file size {}", n_tensors, nt_at, size);
    file.tensors_.reserve(size_t(n_tensors));
    std::unordered_set<std::string> names;
    for (uint64_t k = 0; k < n_tensors; ++k) {
      ctx = fmt::format(" (in tensor info #{})", k);
      TensorInfo ti;
      ti.name = read_string("tensor name");
      const std::string tn = printable(ti.name);
      if (!names.insert(ti.name).second) fail("duplicate tensor name '{}'", tn);
      ctx = fmt::format(" (in tensor '{}')", tn);
      const uint32_t n_dims = read_u32("n_dims");
      if (n_dims < 1 || n_dims > 4) fail("tensor '{}': n_dims {} not in 1..4", tn, n_dims);
      ti.ne.resize(n_dims);
      int64_t n_el = 1;
      for (uint32_t d = 0; d < n_dims; ++d) {
        const uint64_t ne = read_u64("dimension");
        if (ne == 0) fail("tensor '{}': dimension {} is zero", tn, d);
        if (ne > uint64_t(std::numeric_limits<int64_t>::max()) ||
            __builtin_mul_overflow(n_el, int64_t(ne), &n_el)) {
          fail("tensor '{}': dimensions overflow (dimension {} = {} makes the element count exceed 2^63-1)",
               tn, d, ne);
        }
        ti.ne[d] = int64_t(ne);
      }
      const size_t type_at = pos;
      const uint32_t type_id = read_u32("tensor type");
      const GgmlTypeTraits* tr = ggml_type_traits(type_id);
      if (!tr) fail("tensor '{}': unknown tensor type id {} at offset {}", tn, type_id, type_at);
      ti.type = GgmlType(type_id);
      if (ti.ne[0] % tr->block_size != 0)
        fail("tensor '{}': ne[0] = {} is not a multiple of the block size {} of type {}", tn, ti.ne[0],
             tr->block_size, tr->name);
      // n_el <= 2^63 and type_size/block_size <= 8, so only the multiplication can overflow.
      const uint64_t n_blocks = uint64_t(n_el) / uint64_t(tr->block_size);
      uint64_t nbytes = 0;
      if (__builtin_mul_overflow(n_blocks, uint64_t(tr->type_size), &nbytes))
        fail("tensor '{}': byte size of {} elements of type {} overflows", tn, n_el, tr->name);
      ti.offset = read_u64("tensor data offset");
      ti.nbytes = size_t(nbytes);
      file.tensors_.push_back(std::move(ti));
    }
    ctx.clear();

    // The data section starts at the header's end rounded up to the alignment.
    const uint64_t a = file.alignment_;
    const uint64_t data_start = (uint64_t(pos) + a - 1) / a * a;
    for (auto& ti : file.tensors_) {
      const std::string tn = printable(ti.name);
      if (ti.offset % a != 0)
        fail("tensor '{}': data offset {} is misaligned (alignment {})", tn, ti.offset, a);
      uint64_t begin = 0, end = 0;
      if (__builtin_add_overflow(data_start, ti.offset, &begin) || __builtin_add_overflow(begin, ti.nbytes, &end))
        fail("tensor '{}': data offset {} + {} bytes out of file (size {})", tn, ti.offset, ti.nbytes, size);
      if (end > size) fail("tensor '{}': data [{}, {}) out of file (size {})", tn, begin, end, size);
      ti.data = base + begin;
    }
  }
};

std::unique_ptr<File> File::parse(const uint8_t* data, size_t size, const std::string& name) {
  std::unique_ptr<File> f(new File());
  f->path_ = name;
  f->image_ = data;
  f->image_size_ = size;
  Parser p(*f, data, size);
  p.parse();
  return f;
}

std::unique_ptr<File> File::open(const std::string& path) {
  std::unique_ptr<File> f(new File());
  f->path_ = path;
  if (path.empty()) fail("the model path is empty (give a GGUF file)");
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("{}: cannot open: {}", path, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    fail("{}: cannot stat: {}", path, std::strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    fail("{}: not a regular file", path);
  }
  if (st.st_size == 0) {
    ::close(fd);
    fail("{}: empty file", path);
  }
  const size_t size = size_t(st.st_size);
  void* m = ::mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int e = errno;
  ::close(fd);  // the mapping keeps the file alive
  if (m == MAP_FAILED) fail("{}: mmap failed: {}", path, std::strerror(e));
  f->map_ = m;  // owned from here: ~File unmaps even if parsing throws
  f->map_size_ = size;
  f->image_ = static_cast<const uint8_t*>(m);
  f->image_size_ = size;
  Parser p(*f, static_cast<const uint8_t*>(m), size);
  p.parse();
  return f;
}

File::~File() {
  if (map_) ::munmap(map_, map_size_);
}

const Value* File::find(std::string_view key) const {
  for (const auto& kv : kv_)
    if (kv.key == key) return &kv.value;
  return nullptr;
}

const TensorInfo* File::find_tensor(std::string_view name) const {
  for (const auto& t : tensors_)
    if (t.name == name) return &t;
  return nullptr;
}

size_t File::tensor_bytes() const {
  size_t n = 0;
  for (const auto& t : tensors_) n += t.nbytes;  // tensors that overlap (not rejected) count once each
  return n;
}

namespace {
[[noreturn]] void wrong_type(const std::string& path, std::string_view key, const Value& v, const char* expected) {
  fail("{}: key '{}' has type {}, expected {}", path, key, type_desc(v), expected);
}

int64_t to_int(const std::string& path, std::string_view key, const Value& v) {
  auto n = v.as_int();
  if (!n) fail("{}: key '{}': value {} does not fit in int64", path, key, v.u);
  return *n;
}
}  // namespace

std::optional<std::string> File::get_string(std::string_view key) const {
  const Value* v = find(key);
  if (!v) return std::nullopt;
  if (v->type != ValueType::string) wrong_type(path_, key, *v, "string");
  return v->s;
}

std::optional<int64_t> File::get_int(std::string_view key) const {
  const Value* v = find(key);
  if (!v) return std::nullopt;
  if (!v->is_integer()) wrong_type(path_, key, *v, "an integer");
  return to_int(path_, key, *v);
}

std::optional<double> File::get_float(std::string_view key) const {
  const Value* v = find(key);
  if (!v) return std::nullopt;
  if (!v->is_float() && !v->is_integer()) wrong_type(path_, key, *v, "a number");
  return *v->as_number();
}

std::optional<bool> File::get_bool(std::string_view key) const {
  const Value* v = find(key);
  if (!v) return std::nullopt;
  if (v->type != ValueType::boolean) wrong_type(path_, key, *v, "bool");
  return v->u != 0;
}

std::optional<std::vector<std::string>> File::get_string_array(std::string_view key) const {
  const Value* v = find(key);
  if (!v) return std::nullopt;
  if (v->type != ValueType::array || v->elem_type != ValueType::string)
    wrong_type(path_, key, *v, "array of string");
  std::vector<std::string> out;
  out.reserve(v->arr.size());
  for (const auto& e : v->arr) out.push_back(e.s);
  return out;
}

std::optional<std::vector<float>> File::get_float_array(std::string_view key) const {
  const Value* v = find(key);
  if (!v) return std::nullopt;
  Value probe;
  probe.type = v->elem_type;
  if (v->type != ValueType::array || (!probe.is_float() && !probe.is_integer()))
    wrong_type(path_, key, *v, "array of numbers");
  std::vector<float> out;
  out.reserve(v->arr.size());
  for (const auto& e : v->arr) out.push_back(float(*e.as_number()));
  return out;
}

std::optional<std::vector<int64_t>> File::get_int_array(std::string_view key) const {
  const Value* v = find(key);
  if (!v) return std::nullopt;
  Value probe;
  probe.type = v->elem_type;
  if (v->type != ValueType::array || !probe.is_integer()) wrong_type(path_, key, *v, "array of integers");
  std::vector<int64_t> out;
  out.reserve(v->arr.size());
  for (const auto& e : v->arr) out.push_back(to_int(path_, key, e));
  return out;
}

}  // namespace kvq::gguf
