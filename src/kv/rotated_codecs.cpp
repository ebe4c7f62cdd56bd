// Hadamard-rotated per-token codecs: q8_0h, q4_0h, q4_1h, q5_0h, q5_1h, iq4_nlh, int4t_g32h / g64h /
// g128h. Each vector is multiplied by an orthonormal
// Walsh-Hadamard matrix (block-diagonal, blocks of `rot` channels) before it is quantized, so
// that the energy of an outlier channel is spread over the whole block and the per-block scale
// no longer has to cover it. Attention needs no inverse rotation of the cache:
//  - keys:   <q, k> = <H q, H k>, so the query is rotated once per step (prepare_query);
//  - values: sum_t p_t v_t = H^T sum_t p_t (H v_t), so the output is rotated back once per step
//            (finish_output; H is symmetric and its own inverse).
// The block sizes follow llama.cpp's KV rotation, which these formats exist to compare with:
// keys use the largest power of two that divides head_dim, values blocks of 64. The packed
// layout is the inner codec's, unchanged (same bytes per token; q4_0h is q4_0 of H k).
#include <cmath>
#include <vector>

#include "core/error.h"
#include "kv/grouped_common.h"
#include "kv/registry_internal.h"
#include "kv/turboquant.h"

namespace kvq {

namespace {

// In-place orthonormal block Walsh-Hadamard transform of one row of `dim` floats.
void hadamard_rows(float* x, int n_rows, int dim, int block) {
  const float s = 1.f / std::sqrt(float(block));
  for (int r = 0; r < n_rows; ++r) {
    float* row = x + size_t(r) * size_t(dim);
    for (int b = 0; b < dim; b += block) tq_fwht(row + b, block);
    for (int c = 0; c < dim; ++c) row[c] *= s;
  }
}

struct RotatedScratch;
float* scratch(size_t n) { return kv_thread_scratch<RotatedScratch>(n); }

class RotatedCodec final : public KvWrappedCodec {
 public:
  RotatedCodec(std::string name, std::unique_ptr<KvCodec> inner, KvRole role, int block)
      : KvWrappedCodec(std::move(inner)), block_(block) {
    KVQ_CHECK(!info_.transforms_query && !info_.transforms_output && !info_.pre_rope && info_.group_tokens == 1,
              "rotated codec {}: the inner codec must be a plain per-token codec", name);
    info_.name = std::move(name);
    info_.transforms_query = role == KvRole::key;
    info_.transforms_output = role == KvRole::value;
  }

  int prepared_query_dim() const override { return inner_->prepared_query_dim(); }

  void encode(int head, const float* src, size_t src_stride, int n, uint8_t* block, int block_tokens, int t0,
              int pos0) const override {
    const int d = head_dim();
    float* x = scratch(size_t(n) * size_t(d));  // (n, head_dim)
    for (int t = 0; t < n; ++t)
      for (int c = 0; c < d; ++c) x[size_t(t) * size_t(d) + size_t(c)] = src[size_t(t) * src_stride + size_t(c)];
    hadamard_rows(x, n, d, block_);
    inner_->encode(head, x, size_t(d), n, block, block_tokens, t0, pos0);
  }

  void decode(int head, const uint8_t* block, int block_tokens, int t0, int n, int pos0,
              float* dst) const override {
    inner_->decode(head, block, block_tokens, t0, n, pos0, dst);
    hadamard_rows(dst, n, head_dim(), block_);
  }

  void prepare_query(int head, const float* q, int n_q, float* qp) const override {
    if (!info_.transforms_query) return inner_->prepare_query(head, q, n_q, qp);
    const int d = head_dim();
    float* x = scratch(size_t(n_q) * size_t(d));
    for (size_t i = 0; i < size_t(n_q) * size_t(d); ++i) x[i] = q[i];
    hadamard_rows(x, n_q, d, block_);
    inner_->prepare_query(head, x, n_q, qp);
  }

  void scores(int head, const float* qp, int n_q, const uint8_t* block, int block_tokens, int t0, int n, int pos0,
              float* out, int out_stride) const override {
    inner_->scores(head, qp, n_q, block, block_tokens, t0, n, pos0, out, out_stride);
  }

  void scores_spans(int head, const float* qp, int n_q, const KvSpan* spans, int n_spans, float* out,
                    int out_stride) const override {
    inner_->scores_spans(head, qp, n_q, spans, n_spans, out, out_stride);
  }

  // The weighted sums run on the rotated values (KvWrappedCodec); finish_output rotates back.
  void finish_output(int head, float* acc, int n_q) const override {
    inner_->finish_output(head, acc, n_q);
    if (info_.transforms_output) hadamard_rows(acc, n_q, head_dim(), block_);
  }

 private:
  int block_;
};

// llama.cpp's choice: keys rotate over the largest power of two dividing head_dim; values over
// blocks of 64 (smaller rotations measured better for V there).
int rotation_block(KvRole role, int head_dim) {
  int b = 1;
  while (head_dim % (b * 2) == 0 && b * 2 <= 1024) b *= 2;
  if (role == KvRole::value) b = std::min(b, 64);
  return b;
}

void add(const std::string& name, const std::string& inner, const std::string& what) {
  kv_register_codec({name, what, [name, inner](const KvCodecParams& p) -> std::unique_ptr<KvCodec> {
                       const int block = rotation_block(p.role, p.head_dim);
                       if (block < 32)
                         fail("KV codec '{}' rotates blocks of a power of two >= 32 channels; head_dim {} has none",
                              name, p.head_dim);
                       return std::make_unique<RotatedCodec>(name, kv_codec_create(inner, p), p.role, block);
                     }});
}

}  // namespace

void kv_register_rotated_codecs() {
  // llama.cpp's cache types as its default (rotated) KV cache stores them, each in its tiles (q8_0t,
  // q4_0t .. iq4_nlt: the same bytes and decode as the rows, integer-dot kernels).
  struct Ggml {
    const char* type;
    const char* bits;
  };
  for (const Ggml g : {Ggml{"q8_0", "8.5"}, Ggml{"q4_0", "4.5"}, Ggml{"q4_1", "5"}, Ggml{"q5_0", "5.5"},
                       Ggml{"q5_1", "6"}, Ggml{"iq4_nl", "4.5"}}) {
    const std::string type = g.type, name = type + "h";
    add(name, type + "t", type + " of the Hadamard-rotated vector (K: largest power-of-two block, V: blocks of 64)");
    kv_register_format({name, {type + "_hadamard", type + "_rot"}, name, name,
                        type + " after a Hadamard rotation (llama.cpp's rotated " + type + " KV): " + g.bits + " bits"});
  }
  kv_register_format({"q8_0_q4_0h", {"k8v4h"}, "q8_0h", "q4_0h",
                      "keys q8_0, values q4_0, both Hadamard-rotated: 6.5 bits"});
  // The tiled int4 codecs rotated the same way: the outlier-channel fix of q4_0h with int4t's
  // integer-dot kernels (the rotation costs one transform of the query and of the output per step).
  struct Tiled {
    const char* inner;
    const char* bits;
  };
  for (const Tiled t : {Tiled{"int4t_g32", "5"}, Tiled{"int4t_g64", "4.5"}, Tiled{"int4t_g128", "4.25"}}) {
    const std::string name = std::string(t.inner) + "h";
    add(name, t.inner, std::string(t.inner) + " of the Hadamard-rotated vector (K: largest power-of-two block, V: blocks of 64)");
    kv_register_format({name, {}, name, name, std::string(t.inner) + " after a Hadamard rotation of K and V: " + t.bits + " bits"});
  }
}

}  // namespace kvq
