// kvq KV format API: codecs that store one KV head's keys or values in packed form, the kernels
// that read them packed, and the registry of named formats (a format = a K codec + a V codec).
//
// Storage unit: a *head block* holds `block_tokens` consecutive tokens of one KV head of one
// layer, for K or for V (block_tokens = the engine's page size, a power of two 16..256). A page
// of the cache is, for every layer, n_kv_heads K head blocks followed by n_kv_heads V head blocks.
// Each codec defines the layout inside its head block (codes, scales, zeros, norms) and reports
// its exact size, so bytes allocated == bytes claimed.
//
// Two kinds of codec:
//  - per-token (group_tokens == 1): each token is encoded as it is appended (fp8, int8, int4,
//    q8_0, q4_0, TurboQuant, ...);
//  - grouped (group_tokens == G > 1): scales span G tokens (KIVI keys, KVQuant keys). The cache
//    keeps the newest tokens in a full-precision tail and encodes G tokens at once. With a
//    residual window R, after n tokens have been appended exactly
//        kv_quantized_tokens(n) = G * floor(max(0, n - R) / G)
//    tokens live in head blocks and the rest in the tail; the rule depends on n only, so results
//    do not depend on how a prompt is chunked.
//
// Errors: a caller's mistake (unknown names, bad parameters, a block size outside 1 .. 2^20 tokens,
// a token range outside the block, a head outside [0, n_kv_heads) where a codec keeps per-head
// state) throws kvq::Error (kvq/error.h). Pointers must be valid for the sizes the calls state.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "kvq/error.h"

namespace kvq {

enum class KvRole { key, value };

// RoPE of the layer, for codecs that store keys before RoPE and rotate after dequantization.
struct KvRope {
  int n_rot = 0;             // rotated dims (<= head_dim); 0: no RoPE
  float freq_base = 10000.f;
  float freq_scale = 1.f;    // linear position scaling (positions multiplied by this)
  bool neox = false;         // false: adjacent pairs (2i, 2i+1); true: halves (i, i + n_rot/2)
  // Per-pair frequency factors (n_rot / 2 of them, or none): pair i turns freq_factors[i] times
  // slower (Llama 3.1-style RoPE scaling, the GGUF tensor rope_freqs.weight).
  std::vector<float> freq_factors = {};
};

// Everything a codec is built from. One codec instance serves all KV heads of one layer's K or V.
struct KvCodecParams {
  KvRole role = KvRole::key;
  int head_dim = 128;
  int n_kv_heads = 1;
  int layer = 0;
  KvRope rope;                       // the layer's RoPE (pre-RoPE key codecs use it)
  uint64_t seed = 0x6b7671;          // rotations / QJL projections are seeded per layer from this
  const nlohmann::json* calib = nullptr;  // calibration artifacts (kvq calibrate), or null
  int group_tokens = 0;              // grouped codecs: G (0 = codec default)
  int residual_tokens = -1;          // grouped codecs: R (-1 = codec default)
  double outlier_fraction = -1;      // dense-and-sparse codecs: share of each vector kept exact (-1 = default)
  int sink_tokens = -1;              // codecs with an exact attention sink: first positions kept exact (-1 = default)
};

struct KvCodecInfo {
  std::string name;          // registry name of the codec, e.g. "int4_g32", "kivi2_k"
  double code_bits = 16;     // bits of the codes alone per element
  int group_tokens = 1;      // 1: per-token codec
  int residual_tokens = 0;   // full-precision window R (grouped codecs)
  bool pre_rope = false;     // keys stored before RoPE; scores() applies RoPE using positions
  bool transforms_query = false;   // prepare_query() is not a copy (rotations)
  bool transforms_output = false;  // finish_output() is not a no-op (rotations)
};

inline int kv_quantized_tokens(int n, int group_tokens, int residual_tokens) {
  if (group_tokens <= 1) return n;
  int over = n - residual_tokens;
  return over <= 0 ? 0 : (over / group_tokens) * group_tokens;
}

// Tokens [t0, t0 + n) of one head block (slot 0 at absolute position pos0), for the kernels that
// take several blocks in one call (KvCodec::scores_spans / accumulate_spans), and the bytes of a
// later block that the kernels request into L2 along their reads of this one (kv/prefetch_along.h;
// null: none).
struct KvSpan {
  const uint8_t* block = nullptr;
  int block_tokens = 0;
  int t0 = 0;
  int n = 0;
  int pos0 = 0;
  const uint8_t* along = nullptr;
  size_t along_bytes = 0;
};

// All pointers are to one head's data unless stated. `block` is a head block of `block_tokens`
// tokens; token slots are addressed by index t within the block; `pos0` is the absolute position
// of slot 0 (pre-RoPE codecs need it). Kernels never allocate.
class KvCodec {
 public:
  virtual ~KvCodec() = default;
  virtual const KvCodecInfo& info() const = 0;
  virtual int head_dim() const = 0;

  // Exact bytes of one head block of block_tokens tokens (block_tokens % group_tokens == 0).
  virtual size_t block_bytes(int block_tokens) const = 0;

  // The bytes of a head block that the fused kernels read first for tokens [t0, t0 + n), which
  // attention requests one kernel call early (the V block before the K scores, the next K block
  // before the weighted sum): head blocks are scattered in the page pool and the hardware
  // prefetchers restart at each one, so without this every block starts with demand misses and
  // memory waits alternate with compute instead of overlapping it. Within [0, block_bytes).
  // bytes = 0: nothing (a codec whose kernels are compute-bound and measured slower with it).
  struct PrefetchRange {
    size_t offset = 0;
    size_t bytes = 0;
  };
  static constexpr size_t prefetch_lead_bytes = 8192;
  virtual PrefetchRange prefetch_range(int block_tokens, int t0, int n) const {
    (void)t0;
    (void)n;
    const size_t b = block_bytes(block_tokens);
    return {0, b < prefetch_lead_bytes ? b : prefetch_lead_bytes};
  }
  // Whether this codec's fused scores and weighted sum, at the running CPU level, request the
  // range attention sets for them (a later block's prefetch_along_range) along their own loops
  // (kv/prefetch_along.h). Attention prefetches further ahead that way when both K's and
  // V's do.
  virtual bool prefetches_along() const { return false; }
  // The bytes of a block that a call over tokens [t0, t0 + n) reads, for requests spread along a
  // kernel call (no burst, so not capped at prefetch_lead_bytes as prefetch_range is).
  virtual PrefetchRange prefetch_along_range(int block_tokens, int t0, int n) const {
    return prefetch_range(block_tokens, t0, n);
  }
  // A range's first prefetch_lead_bytes: prefetch_range for codecs that compute the whole range
  // (prefetch_along_range) in one place.
  static PrefetchRange lead_of(PrefetchRange r) {
    if (r.bytes > prefetch_lead_bytes) r.bytes = prefetch_lead_bytes;
    return r;
  }

  // Encodes tokens [t0, t0 + n) of head `head`. src: (n, head_dim) f32, rows src_stride floats
  // apart. For grouped codecs t0 and n are multiples of group_tokens.
  virtual void encode(int head, const float* src, size_t src_stride, int n, uint8_t* block,
                      int block_tokens, int t0, int pos0) const = 0;
  // Reference decode of tokens [t0, t0 + n) -> dst (n, head_dim). For pre-RoPE keys the output
  // is the key *after* RoPE, i.e. what attention sees.
  virtual void decode(int head, const uint8_t* block, int block_tokens, int t0, int n, int pos0,
                      float* dst) const = 0;

  // Length of a prepared query row (head_dim unless the codec needs more).
  virtual int prepared_query_dim() const { return head_dim(); }
  // q (n_q, head_dim) -> qp (n_q, prepared_query_dim()). Once per decode step per GQA group.
  virtual void prepare_query(int head, const float* q, int n_q, float* qp) const;
  // Fused scores: out[i * out_stride + t] = <q_i, k_{t0+t}> for i < n_q, t < n (no scaling), k
  // the decoded key, up to the kernels' own rounding: the integer-dot kernels round the prepared
  // query to int8 (per 32 channels) and the bf16 / fp8 kernels to bf16, as GPU attention kernels
  // do; each kernel's bound against decode-then-dot is stated in its header under src/kv and
  // checked by its parity test.
  virtual void scores(int head, const float* qp, int n_q, const uint8_t* block, int block_tokens,
                      int t0, int n, int pos0, float* out, int out_stride) const = 0;
  // Fused weighted sum: acc[i * head_dim + d] += sum_t p[i * p_stride + t] * v_{t0+t}[d], up to
  // the kernels' rounding of the weights (the integer-dot kernels quantize p times the token's
  // scale to 8 bits per 16-token tile; bounds as for scores).
  virtual void accumulate(int head, const float* p, int p_stride, int n_q, const uint8_t* block,
                          int block_tokens, int t0, int n, float* acc) const = 0;
  // The same over several head blocks in one call, their tokens side by side: span s's token
  // t0 + t is column o_s + t of out / p, o_s = the sum of the n (> 0) of the spans before it.
  // Scores equal one scores() per span bit for bit; the weighted sum equals one accumulate() per
  // span up to f32 summation order. Attention calls these with a batch of consecutive blocks, so
  // that a call's fixed work (the query's setup, the weight scan, reductions, the softmax's latency
  // chain) is paid once per batch instead of once per page. Default: one call per span, each with
  // its span's `along` range set as kv_prefetch_along (kv/prefetch_along.h); codecs override them
  // where one call saves that work, and then request each span's range along its own reads.
  virtual void scores_spans(int head, const float* qp, int n_q, const KvSpan* spans, int n_spans, float* out,
                            int out_stride) const;
  virtual void accumulate_spans(int head, const float* p, int p_stride, int n_q, const KvSpan* spans, int n_spans,
                                float* acc) const;
  // Whether this codec's scores_spans (keys) / accumulate_spans (values) run all spans in one
  // kernel call at the running CPU level (KIVI's keys, one query fold per key group, say so for
  // their values' sake). Attention batches blocks only when K's and V's both do: with per-span
  // calls the batches save little, and codecs whose kernels do not prefetch along (one burst of
  // requests per call) measured slower with them (bench/BENCHMARKS.md).
  virtual bool fuses_spans() const { return false; }
  // Maps the accumulated output (n_q, head_dim) back to the model's basis (in place).
  virtual void finish_output(int head, float* acc, int n_q) const;
  // What attention calls once per pass over the blocks instead: the same, given mass[i], the sum
  // of the weights accumulated into row i (in acc's scale). Codecs that store an affine image of
  // the values (centered: v - mu) add their constant part, mu * mass, here once instead of per
  // block. Default: finish_output.
  virtual void finish_output_mass(int head, float* acc, int n_q, const float* mass) const;
};

// A named KV format: which codec K uses and which V uses.
struct KvFormatDesc {
  std::string name;
  std::vector<std::string> aliases;
  std::string k_codec;   // codec names (see kv_codec_names())
  std::string v_codec;
  std::string description;
};

// Registry. Names are case-insensitive; aliases include vLLM and llama.cpp spellings.
const std::vector<KvFormatDesc>& kv_formats();
// Resolves a format name or alias; throws kvq::Error listing valid names when unknown.
const KvFormatDesc& kv_format_find(const std::string& name);
std::vector<std::string> kv_codec_names();
// Builds a codec by codec name; throws kvq::Error on unknown names or invalid parameters
// (e.g. a group size that does not divide head_dim). A name may end in "@gN" (e.g.
// "kvquant3_k@g128"): the codec's token group G = N, overriding KvCodecParams::group_tokens; only
// grouped codecs take it (a per-token codec named so is an error).
std::unique_ptr<KvCodec> kv_codec_create(const std::string& codec_name, const KvCodecParams& p);

// The N of a "@gN" suffix (N in 1..1024); throws kvq::Error naming `where` otherwise.
int kv_parse_group_suffix(const std::string& suffix, const std::string& where);

// Effective bits per element of a codec at context `ctx` tokens (blocks of block_tokens tokens;
// the full-precision tail of grouped codecs counted at 32 bits per element).
double kv_codec_effective_bits(const KvCodec& c, int block_tokens, int ctx);

}  // namespace kvq
