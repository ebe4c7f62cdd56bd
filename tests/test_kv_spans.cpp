// KvCodec::scores_spans / accumulate_spans (several head blocks in one call) and attention's batches
// of blocks: every codec's multi-block calls give what one call per block gives, at every CPU
// level; attention batches blocks only for codecs that fuse spans, requests each batch's later
// blocks along, and gets the same result with and without the requests.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "attn/attention.h"
#include "core/aligned.h"
#include "core/cpu.h"
#include "core/error.h"
#include "forwarding_codec.h"
#include "kv/kvquant.h"
#include "kv/prefetch_along.h"
#include "kvq/kv_format.h"

using namespace kvq;

namespace {

nlohmann::json test_calib(int hd) {
  const std::vector<std::vector<float>> mean(1, std::vector<float>(size_t(hd), 0.25f));
  const std::vector<std::vector<float>> rms(1, std::vector<float>(size_t(hd), 1.f));
  nlohmann::json calib = {{"layers", {{{"k_scale", 0.05}, {"v_scale", 0.05}, {"k_mean", mean}, {"v_mean", mean},
                                       {"k_rms", rms}, {"q_rms", rms}, {"v_rms", rms}}}}};
  for (int b : {2, 3, 4}) {
    calib["layers"][0]["kvquant_k" + std::to_string(b)] = {{"codebook", kvquant_default_codebook(b)}};
    calib["layers"][0]["kvquant_cal_k" + std::to_string(b)] = kvquant_cal_artifact(mean, rms, b);
  }
  return calib;
}

std::unique_ptr<KvCodec> make(const std::string& name, KvRole role, int hd, const nlohmann::json* calib) {
  KvCodecParams p;
  p.head_dim = hd;
  p.n_kv_heads = 1;
  p.role = role;
  p.calib = calib;
  p.rope.n_rot = hd;
  return kv_codec_create(name, p);
}

const CpuLevel kLevels[] = {CpuLevel::scalar, CpuLevel::avx2, CpuLevel::avx512};

// Blocks of random tokens for one codec, and spans over them: a partial first block, full ones,
// an empty span, a partial last one.
struct Blocks {
  std::vector<std::vector<uint8_t>> mem;
  std::vector<KvSpan> spans;
  int total = 0;
};
Blocks make_blocks(const KvCodec& c, int bt, int hd, std::mt19937& rng) {
  const int G = std::max(1, c.info().group_tokens);
  const std::vector<std::pair<int, int>> t0n = {{G > 16 ? 0 : 16, bt - (G > 16 ? 0 : 16)}, {0, bt}, {0, 0},
                                                {0, bt}, {0, G > 1 ? bt / 2 : 37}};
  Blocks b;
  std::normal_distribution<float> nd;
  std::vector<float> x(size_t(bt) * size_t(hd));
  for (size_t i = 0; i < t0n.size(); ++i) {
    b.mem.emplace_back(c.block_bytes(bt));
    for (auto& v : x) v = nd(rng);
    c.encode(0, x.data(), size_t(hd), bt, b.mem.back().data(), bt, 0, int(i) * bt);
  }
  for (size_t i = 0; i < t0n.size(); ++i) {
    // along: the next block (any readable bytes; the requests change no arithmetic)
    const std::vector<uint8_t>& other = b.mem[(i + 1) % b.mem.size()];
    b.spans.push_back({b.mem[i].data(), bt, t0n[i].first, t0n[i].second, int(i) * bt, other.data(), other.size()});
    b.total += t0n[i].second;
  }
  return b;
}

}  // namespace

TEST(KvSpans, MultiBlockCallsEqualOneCallPerBlockForEveryCodec) {
  const CpuLevel saved = cpu_level();
  const int hd = 128, n_q = 5, bt = 64;
  const nlohmann::json calib = test_calib(hd);
  for (CpuLevel lvl : kLevels) {
    cpu_set_level(lvl);
    for (const std::string& name : kv_codec_names()) {
      for (KvRole role : {KvRole::key, KvRole::value}) {
        std::unique_ptr<KvCodec> c;
        try {
          c = make(name, role, hd, &calib);
        } catch (const Error& e) {
          ADD_FAILURE() << name << ": " << e.what();
          continue;
        }
        if (bt % std::max(1, c->info().group_tokens) != 0) continue;
        std::mt19937 rng(17);
        std::normal_distribution<float> nd;
        const Blocks b = make_blocks(*c, bt, hd, rng);
        const int stride = b.total + 3;
        const std::string what = name + (role == KvRole::key ? " K " : " V ") + cpu_level_name(cpu_level());
        if (role == KvRole::key) {
          std::vector<float> q(size_t(n_q) * hd), qp(size_t(n_q) * size_t(c->prepared_query_dim()));
          for (auto& v : q) v = nd(rng);
          c->prepare_query(0, q.data(), n_q, qp.data());
          std::vector<float> one(size_t(n_q) * size_t(stride), -7.f), all(one.size(), -7.f);
          int o = 0;
          for (const KvSpan& sp : b.spans) {
            if (sp.n <= 0) continue;
            c->scores(0, qp.data(), n_q, sp.block, sp.block_tokens, sp.t0, sp.n, sp.pos0, one.data() + o, stride);
            o += sp.n;
          }
          c->scores_spans(0, qp.data(), n_q, b.spans.data(), int(b.spans.size()), all.data(), stride);
          EXPECT_EQ(all, one) << what;  // bit for bit, and nothing written past the spans' columns
        } else {
          std::vector<float> p(size_t(n_q) * size_t(stride));
          for (auto& v : p) v = std::exp(-std::fabs(nd(rng)) * 2.f);
          std::vector<float> one(size_t(n_q) * hd, 0.5f), all(one.size(), 0.5f);
          int o = 0;
          for (const KvSpan& sp : b.spans) {
            if (sp.n <= 0) continue;
            c->accumulate(0, p.data() + o, stride, n_q, sp.block, sp.block_tokens, sp.t0, sp.n, one.data());
            o += sp.n;
          }
          c->accumulate_spans(0, p.data(), stride, n_q, b.spans.data(), int(b.spans.size()), all.data());
          double scale = 0;
          for (float v : one) scale = std::max(scale, double(std::fabs(v)));
          for (size_t i = 0; i < one.size(); ++i) ASSERT_NEAR(all[i], one[i], 1e-5 * scale) << what << " " << i;
        }
        EXPECT_EQ(kv_prefetch_along.p, nullptr) << what;  // no range left set
      }
    }
  }
  cpu_set_level(saved);
}

TEST(KvSpans, TiledCodecsFuseSpansAtAvx512Only) {
  const CpuLevel saved = cpu_level();
  for (const char* name : {"int4t_g128", "int4t_g32", "q4_0t", "q4_0h", "q4_1t", "q5_0t", "iq4_nlt", "int2t_g64", "tq4", "tq3.5",
                           "fp8_e4m3t", "fp8_e5m2t_dyn"}) {
    for (KvRole role : {KvRole::key, KvRole::value}) {
      auto c = make(name, role, 128, nullptr);
      cpu_set_level(CpuLevel::scalar);
      EXPECT_FALSE(c->fuses_spans()) << name;
      cpu_set_level(CpuLevel::avx2);
      EXPECT_FALSE(c->fuses_spans()) << name;
      cpu_set_level(CpuLevel::avx512);
      EXPECT_EQ(c->fuses_spans(), cpu_level() == CpuLevel::avx512) << name;
    }
  }
  // KIVI's tiles: the values' weighted sum takes spans; the keys (one query fold per key group)
  // stay one call per block but report fusing so that their format's values get batches.
  for (const char* name : {"kivi4t_k", "kivi4t_v", "kivi2t_k", "kivi2t_v"}) {
    const KvRole role = std::string(name).back() == 'k' ? KvRole::key : KvRole::value;
    auto c = make(name, role, 128, nullptr);
    cpu_set_level(CpuLevel::avx2);
    EXPECT_FALSE(c->fuses_spans()) << name;
    cpu_set_level(CpuLevel::avx512);
    EXPECT_EQ(c->fuses_spans(), cpu_level() == CpuLevel::avx512) << name;
  }
  // Row codecs, the 8-bit tiles (measured slower in batches) and KVQuant's keys keep one call per
  // block.
  for (const char* name : {"f16", "int8_rows", "int8t", "q8_0t", "kvquant4_k"}) EXPECT_FALSE(make(name, KvRole::key, 128, nullptr)->fuses_spans()) << name;
  cpu_set_level(saved);
}

namespace {

// Forwards to a real codec, claims to fuse spans (or not), and records each call's blocks and
// along ranges (a multi-block call's spans, or a per-block call's block).
class BatchRecorder : public ForwardingCodec {
 public:
  BatchRecorder(const char* name, KvRole role, bool fuse) : ForwardingCodec(make(name, role, 128, nullptr)), fuse_(fuse) {}
  // A one-block batch comes as a per-block call, its range in kv_prefetch_along.
  void scores(int head, const float* qp, int n_q, const uint8_t* block, int bt, int t0, int n, int pos0, float* out,
              int out_stride) const override {
    calls.push_back({{block, kv_prefetch_along.p}});
    inner_->scores(head, qp, n_q, block, bt, t0, n, pos0, out, out_stride);
  }
  void accumulate(int head, const float* p, int p_stride, int n_q, const uint8_t* block, int bt, int t0, int n,
                  float* acc) const override {
    calls.push_back({{block, kv_prefetch_along.p}});
    inner_->accumulate(head, p, p_stride, n_q, block, bt, t0, n, acc);
  }
  bool fuses_spans() const override { return fuse_; }
  void scores_spans(int head, const float* qp, int n_q, const KvSpan* spans, int n_spans, float* out,
                    int out_stride) const override {
    record(spans, n_spans);
    inner_->scores_spans(head, qp, n_q, spans, n_spans, out, out_stride);
  }
  void accumulate_spans(int head, const float* p, int p_stride, int n_q, const KvSpan* spans, int n_spans,
                        float* acc) const override {
    record(spans, n_spans);
    inner_->accumulate_spans(head, p, p_stride, n_q, spans, n_spans, acc);
  }
  // Per call: (block, along) of each span.
  mutable std::vector<std::vector<std::pair<const uint8_t*, const uint8_t*>>> calls;

 private:
  void record(const KvSpan* spans, int n) const {
    calls.emplace_back();
    for (int s = 0; s < n; ++s) calls.back().emplace_back(spans[s].block, spans[s].along);
  }
  bool fuse_;
};

}  // namespace

TEST(KvSpans, AttentionBatchesFusedCodecsAndRequestsTheNextBatches) {
  const CpuLevel saved = cpu_set_level(CpuLevel::avx512);
  const int hd = 128, n_q = 4, bt = 64;
  // 11 blocks (one empty). Batches: int4t_g128's 64-token K + V blocks are 8.5 KiB, so 4 make a
  // batch (kBatchTokens 256, kBatchBytes 36 KiB): 4, 4, 2; q5_1t's are 12 KiB: 3, 3, 3, 1.
  const std::vector<std::pair<int, int>> t0n = {{16, 48}, {0, 64}, {0, 64}, {0, 0}, {0, 64}, {0, 64},
                                                {0, 64},  {0, 64}, {0, 64}, {0, 64}, {0, 20}};
  for (auto [name, per_fused] : {std::pair{"int4t_g128", size_t(4)}, std::pair{"q5_1t", size_t(3)}})
  for (bool fuse : {true, false}) {
    SCOPED_TRACE(name);
    BatchRecorder kc(name, KvRole::key, fuse), vc(name, KvRole::value, fuse);
    std::mt19937 rng(8);
    std::normal_distribution<float> nd;
    std::vector<std::vector<uint8_t>> kb, vb;
    std::vector<KvBlockSpan> spans;
    std::vector<float> x(size_t(bt) * hd);
    for (size_t i = 0; i < t0n.size(); ++i) {
      kb.emplace_back(kc.block_bytes(bt));
      vb.emplace_back(vc.block_bytes(bt));
      for (auto& v : x) v = nd(rng);
      kc.encode(0, x.data(), hd, bt, kb.back().data(), bt, 0, int(i) * bt);
      for (auto& v : x) v = nd(rng);
      vc.encode(0, x.data(), hd, bt, vb.back().data(), bt, 0, int(i) * bt);
    }
    for (size_t i = 0; i < t0n.size(); ++i)
      spans.push_back({kb[i].data(), vb[i].data(), bt, t0n[i].first, t0n[i].second, int(i) * bt});
    std::vector<float> q(size_t(n_q) * hd), on(q.size()), off(q.size()), ref(q.size());
    for (auto& v : q) v = nd(rng);
    AttnParams ap;
    ap.scale = 0.088f;
    AlignedBuf<float> scratch(attn_scratch_floats(kc, vc, n_q, bt));
    attn_decode(kc, vc, 0, q.data(), n_q, spans.data(), int(spans.size()), nullptr, nullptr, 0, 0, ap, on.data(),
                scratch.data());
    EXPECT_EQ(kv_prefetch_along.p, nullptr);
    // The non-empty blocks, grouped into the expected batches.
    std::vector<size_t> filled;
    for (size_t i = 0; i < t0n.size(); ++i)
      if (t0n[i].second > 0) filled.push_back(i);
    const size_t per = fuse ? per_fused : 1;
    const size_t n_batches = (filled.size() + per - 1) / per;
    ASSERT_EQ(kc.calls.size(), n_batches) << fuse;
    ASSERT_EQ(vc.calls.size(), n_batches) << fuse;
    // D: one batch ahead (a batch's K + V bytes reach 8 KiB: a 64-token int4t_g128 block pair is 8.5 KiB).
    const uint8_t* const none = nullptr;
    for (size_t i = 0; i < n_batches; ++i) {
      for (size_t x = 0; x < per && i * per + x < filled.size(); ++x) {
        const size_t blk = filled[i * per + x];
        ASSERT_LT(x, kc.calls[i].size());
        EXPECT_EQ(kc.calls[i][x].first, kb[blk].data());
        EXPECT_EQ(vc.calls[i][x].first, vb[blk].data());
        // scores: span x of the same batch's V (D - 1 = 0 batches ahead)
        const auto vr = vc.prefetch_along_range(bt, t0n[blk].first, t0n[blk].second);
        EXPECT_EQ(kc.calls[i][x].second, vb[blk].data() + vr.offset) << fuse << " batch " << i << " span " << x;
        // weighted sum: span x of the next batch's K, if there is one
        const size_t nx = (i + 1) * per + x;
        const uint8_t* want = none;
        if (nx < filled.size() && (i + 1) * per < filled.size()) {
          const size_t nb = filled[nx];
          want = kb[nb].data() + kc.prefetch_along_range(bt, t0n[nb].first, t0n[nb].second).offset;
        }
        EXPECT_EQ(vc.calls[i][x].second, want) << fuse << " batch " << i << " span " << x;
      }
    }
    // The requests change no arithmetic, and the result is attention's.
    ap.prefetch_blocks = false;
    attn_decode(kc, vc, 0, q.data(), n_q, spans.data(), int(spans.size()), nullptr, nullptr, 0, 0, ap, off.data(),
                scratch.data());
    EXPECT_EQ(on, off) << fuse;
    attn_decode_ref(kc, vc, 0, q.data(), n_q, spans.data(), int(spans.size()), nullptr, nullptr, 0, 0, ap, ref.data());
    for (size_t i = 0; i < on.size(); ++i) EXPECT_NEAR(on[i], ref[i], 2e-2f) << fuse << " " << i;
  }
  cpu_set_level(saved);
}
