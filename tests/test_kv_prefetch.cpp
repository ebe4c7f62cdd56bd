// KvCodec::prefetch_range: the byte range attention requests one kernel call early must lie inside
// the head block for every codec, and attn_decode must ask for it for every span it reads.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <random>
#include <set>
#include <tuple>
#include <vector>

#include <nlohmann/json.hpp>

#include "attn/attention.h"
#include "core/aligned.h"
#include "core/cpu.h"
#include "forwarding_codec.h"
#include "kv/prefetch_along.h"
#include "kv/row_codec.h"
#include "kvq/kv_format.h"
#include "kv/kvquant.h"

using namespace kvq;

namespace {

std::unique_ptr<KvCodec> make(const std::string& name, KvRole role, const nlohmann::json* calib) {
  KvCodecParams p;
  p.head_dim = 128;
  p.n_kv_heads = 2;
  p.role = role;
  p.calib = calib;
  p.rope.n_rot = 128;
  return kv_codec_create(name, p);
}

nlohmann::json test_calib() {
  const std::vector<std::vector<float>> mean(2, std::vector<float>(128, 0.25f)), rms(2, std::vector<float>(128, 1.f));
  nlohmann::json calib = {{"layers", {{{"k_scale", 0.05}, {"v_scale", 0.05}, {"k_mean", mean}, {"v_mean", mean},
                                       {"k_rms", rms}, {"q_rms", rms}, {"v_rms", rms}}}}};
  for (int b : {2, 3, 4}) {
    calib["layers"][0]["kvquant_k" + std::to_string(b)] = {{"codebook", kvquant_default_codebook(b)}};
    calib["layers"][0]["kvquant_cal_k" + std::to_string(b)] = kvquant_cal_artifact(mean, rms, b);
  }
  return calib;
}

}  // namespace

TEST(PrefetchRange, InsideTheBlockForEveryCodec) {
  const nlohmann::json calib = test_calib();
  for (const std::string& name : kv_codec_names()) {
    for (KvRole role : {KvRole::key, KvRole::value}) {
      std::unique_ptr<KvCodec> c;
      try {
        c = make(name, role, &calib);
      } catch (const std::exception& e) {
        ADD_FAILURE() << name << ": " << e.what();
        continue;
      }
      const int G = std::max(1, c->info().group_tokens);
      for (int bt : {16, 64, 256}) {
        if (bt % G != 0) continue;
        const size_t bytes = c->block_bytes(bt);
        // whole blocks, a span starting mid-block (sliding window), a single token, the last token
        for (auto [t0, n] : {std::pair{0, bt}, std::pair{bt / 2, bt - bt / 2}, std::pair{0, 1}, std::pair{bt - 1, 1}}) {
          const KvCodec::PrefetchRange r = c->prefetch_range(bt, t0, n);
          EXPECT_LE(r.offset, bytes) << name << " bt " << bt << " t0 " << t0;
          EXPECT_LE(r.bytes, bytes - std::min(bytes, r.offset)) << name << " bt " << bt << " t0 " << t0 << " n " << n;
          const KvCodec::PrefetchRange a = c->prefetch_along_range(bt, t0, n);
          EXPECT_LE(a.offset, bytes) << name << " bt " << bt << " t0 " << t0;
          EXPECT_LE(a.bytes, bytes - std::min(bytes, a.offset)) << name << " bt " << bt << " t0 " << t0 << " n " << n;
          if (c->prefetches_along() && n == bt) {
            EXPECT_EQ(a.bytes, bytes) << name << " bt " << bt;  // uncapped
          }
          if (const auto* rc = dynamic_cast<const KvRowCodec*>(c.get()); rc && r.bytes > 0) {
            // a row codec's kernels start at the span's first row
            EXPECT_EQ(r.offset, size_t(t0) * rc->fmt().row_bytes) << name;
            EXPECT_LE(r.bytes, size_t(n) * rc->fmt().row_bytes) << name;
          }
        }
      }
    }
  }
}

TEST(PrefetchRange, RowCodecsOptInByElement) {
  // f16 rows gain from the early request, int8 rows measured slower with it (row_codec.cpp).
  auto f16 = make("f16", KvRole::key, nullptr);
  auto i8 = make("int8_rows", KvRole::key, nullptr);
  EXPECT_EQ(f16->prefetch_range(64, 0, 64).bytes, std::min(f16->block_bytes(64), KvCodec::prefetch_lead_bytes));
  EXPECT_EQ(f16->prefetch_range(64, 8, 56).offset, size_t(8) * 128 * 2);
  EXPECT_EQ(i8->prefetch_range(64, 0, 64).bytes, 0u);
}

namespace {
// f16 codec that records the prefetch requests attention makes.
class RecordingCodec final : public ForwardingCodec {
 public:
  explicit RecordingCodec(KvRole role, bool along = false) : ForwardingCodec(make("f16", role, nullptr)), along_(along) {}
  void scores(int head, const float* qp, int n_q, const uint8_t* block, int bt, int t0, int n, int pos0, float* out,
              int out_stride) const override {
    along_seen.push_back(kv_prefetch_along.p);
    inner_->scores(head, qp, n_q, block, bt, t0, n, pos0, out, out_stride);
  }
  void accumulate(int head, const float* p, int p_stride, int n_q, const uint8_t* block, int bt, int t0, int n,
                  float* acc) const override {
    along_seen.push_back(kv_prefetch_along.p);
    inner_->accumulate(head, p, p_stride, n_q, block, bt, t0, n, acc);
  }
  bool prefetches_along() const override { return along_; }
  PrefetchRange prefetch_range(int bt, int t0, int n) const override {
    calls.emplace_back(bt, t0, n);
    return inner_->prefetch_range(bt, t0, n);
  }
  mutable std::vector<std::tuple<int, int, int>> calls;
  mutable std::vector<const uint8_t*> along_seen;  // kv_prefetch_along.p at each fused call

 private:
  bool along_;
};
// One K and one V block of bt tokens per (t0, n) entry, random content, and their spans.
struct TestBlocks {
  std::vector<std::vector<uint8_t>> k, v;
  std::vector<KvBlockSpan> spans;
};
TestBlocks make_blocks(const KvCodec& kc, const KvCodec& vc, int bt, int hd, const std::vector<std::pair<int, int>>& t0n,
                       std::mt19937& rng) {
  TestBlocks tb;
  tb.k.resize(t0n.size());
  tb.v.resize(t0n.size());
  std::normal_distribution<float> nd;
  std::vector<float> x(size_t(bt) * size_t(hd));
  for (size_t b = 0; b < t0n.size(); ++b) {
    tb.k[b].resize(kc.block_bytes(bt));
    tb.v[b].resize(vc.block_bytes(bt));
    for (auto& v : x) v = nd(rng);
    kc.encode(0, x.data(), size_t(hd), bt, tb.k[b].data(), bt, 0, int(b) * bt);
    for (auto& v : x) v = nd(rng);
    vc.encode(0, x.data(), size_t(hd), bt, tb.v[b].data(), bt, 0, int(b) * bt);
    tb.spans.push_back({tb.k[b].data(), tb.v[b].data(), bt, t0n[b].first, t0n[b].second, int(b) * bt});
  }
  return tb;
}
}  // namespace

TEST(PrefetchRange, AttnDecodeRequestsEverySpanAndKeepsResults) {
  RecordingCodec kc(KvRole::key), vc(KvRole::value);
  const int bt = 16, hd = 128, n_q = 4;
  // spans: a partial first block (sliding window), full blocks, an empty span, a partial last one
  const std::vector<std::pair<int, int>> t0n = {{5, 11}, {0, 16}, {0, 0}, {0, 16}, {0, 7}};
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  const TestBlocks tb = make_blocks(kc, vc, bt, hd, t0n, rng);
  const std::vector<KvBlockSpan>& spans = tb.spans;
  std::vector<float> q(size_t(n_q) * hd), out(q.size()), ref(q.size());
  for (auto& v : q) v = nd(rng);
  AttnParams ap;
  ap.scale = 0.088f;
  AlignedBuf<float> scratch(attn_scratch_floats(kc, vc, n_q, bt));
  attn_decode(kc, vc, 0, q.data(), n_q, spans.data(), int(spans.size()), nullptr, nullptr, 0, 0, ap, out.data(),
              scratch.data());
  using Calls = std::multiset<std::tuple<int, int, int>>;
  Calls want;
  for (auto [t0, n] : t0n)
    if (n > 0) want.emplace(bt, t0, n);
  // each K and V block once, none for the empty span
  EXPECT_EQ(Calls(kc.calls.begin(), kc.calls.end()), want);
  EXPECT_EQ(Calls(vc.calls.begin(), vc.calls.end()), want);
  attn_decode_ref(kc, vc, 0, q.data(), n_q, spans.data(), int(spans.size()), nullptr, nullptr, 0, 0, ap, ref.data());
  for (size_t i = 0; i < out.size(); ++i) EXPECT_NEAR(out[i], ref[i], 2e-3f) << i;

  // Off (prefill rows): no requests, the same result bit for bit.
  kc.calls.clear();
  vc.calls.clear();
  ap.prefetch_blocks = false;
  std::vector<float> out_off(q.size());
  attn_decode(kc, vc, 0, q.data(), n_q, spans.data(), int(spans.size()), nullptr, nullptr, 0, 0, ap, out_off.data(),
              scratch.data());
  EXPECT_TRUE(kc.calls.empty());
  EXPECT_TRUE(vc.calls.empty());
  EXPECT_EQ(out_off, out);
}

TEST(PrefetchAlong, LinesCoverTheRangeOnce) {
  for (size_t bytes : std::vector<size_t>{0, 1, 63, 64, 65, 4352, 8192, 8193})
    for (int n : {1, 2, 3, 4, 7, 16}) {
      size_t next = 0;
      for (int i = 0; i < n; ++i) {
        const KvLineSpan sp = kv_prefetch_along_lines(bytes, i, n);
        EXPECT_EQ(sp.first, next) << bytes << " " << n << " " << i;
        EXPECT_LE(sp.first, sp.end);
        next = sp.end;
      }
      EXPECT_EQ(next, (bytes + 63) / 64) << bytes << " " << n;
    }
  // Token by token in steps of tu (the last step shorter), as the row kernels walk a block.
  for (size_t bytes : std::vector<size_t>{0, 64, 4096, 16384, 16448})
    for (int n : {1, 7, 16, 64})
      for (int tu : {1, 2, 4, 16}) {
        size_t next = 0;
        for (int t = 0; t < n; t += tu) {
          const KvLineSpan sp = kv_prefetch_along_token_lines(bytes, t, std::min(tu, n - t), n);
          EXPECT_EQ(sp.first, next) << bytes << " " << n << " " << t;
          EXPECT_LE(sp.first, sp.end);
          next = sp.end;
        }
        EXPECT_EQ(next, (bytes + 63) / 64) << bytes << " " << n << " " << tu;
      }
}

TEST(PrefetchAlong, CodecsOptInAtSimdLevels) {
  const CpuLevel saved = cpu_level();
  // q4_0t: llama.cpp's q4_0 in int4t's tiles; q4_0h: the same behind a Hadamard rotation (the
  // wrapper forwards the inner codec's kernels and so its answer).
  for (const char* name : {"int4t_g128", "int4t_g64", "int2t_g64", "q4_0t", "q4_0h", "int8t", "q8_0t", "tq4", "tq3.5",
                           "f32", "f16", "bf16", "fp8_e4m3", "fp8_e5m2_dyn", "int8_rows", "q8_0", "int4_g64"}) {
    auto k = make(name, KvRole::key, nullptr), v = make(name, KvRole::value, nullptr);
    cpu_set_level(CpuLevel::scalar);
    EXPECT_FALSE(k->prefetches_along()) << name;  // the scalar kernels do not request it
    EXPECT_FALSE(v->prefetches_along()) << name;
    cpu_set_level(CpuLevel::avx512);
    EXPECT_EQ(k->prefetches_along(), cpu_level() != CpuLevel::scalar) << name;
    EXPECT_EQ(v->prefetches_along(), cpu_level() != CpuLevel::scalar) << name;
  }
  for (const char* name : {"kivi4t_k", "kivi2t_k"}) {
    EXPECT_EQ(make(name, KvRole::key, nullptr)->prefetches_along(), cpu_level() != CpuLevel::scalar) << name;
  }
  // KVQuant's kernels and TurboQuant's records (QJL) keep the lead requests.
  for (const char* name : {"kvquant4_k", "tq4_qjl"})
    EXPECT_FALSE(make(name, KvRole::key, nullptr)->prefetches_along()) << name;
  cpu_set_level(saved);
}

TEST(PrefetchAlong, AttnDecodeSetsLaterBlocksAndClearsAfter) {
  // Codecs that prefetch along, D blocks ahead (counting non-empty spans, one a batch for codecs
  // that do not fuse spans): block b's scores see V(b + D - 1)'s range, its weighted sum K(b + D)'s,
  // nothing past the last span; the range is cleared after each call. D: the fewest blocks whose K and V bytes reach 8 KiB, at most 3 (f16 rows of
  // head_dim 128: 512 bytes a token for K and V, so 16-token blocks 1, 8-token 2, 4-token 3).
  const int hd = 128, n_q = 2;
  for (auto [bt, D] : {std::pair{16, 1}, std::pair{8, 2}, std::pair{4, 3}}) {
    RecordingCodec kc(KvRole::key, true), vc(KvRole::value, true);
    const std::vector<std::pair<int, int>> t0n = {{bt / 4, bt - bt / 4}, {0, bt}, {0, bt}, {0, 0},
                                                  {0, bt},           {0, bt}, {0, bt / 2}};
    const size_t nb = t0n.size();
    std::mt19937 rng(4);
    std::normal_distribution<float> nd;
    const TestBlocks tb = make_blocks(kc, vc, bt, hd, t0n, rng);
    const std::vector<KvBlockSpan>& spans = tb.spans;
    const auto &kb = tb.k, &vb = tb.v;
    std::vector<float> q(size_t(n_q) * hd), out(q.size()), lead(q.size());
    for (auto& v : q) v = nd(rng);
    AttnParams ap;
    ap.scale = 0.088f;
    AlignedBuf<float> scratch(attn_scratch_floats(kc, vc, n_q, bt));
    attn_decode(kc, vc, 0, q.data(), n_q, spans.data(), int(nb), nullptr, nullptr, 0, 0, ap, out.data(),
                scratch.data());
    EXPECT_EQ(kv_prefetch_along.p, nullptr);
    const size_t row = size_t(hd) * 2;  // f16 rows: a span's range starts at its first row
    std::vector<size_t> filled;  // the non-empty spans: D counts these
    for (size_t b = 0; b < nb; ++b)
      if (t0n[b].second > 0) filled.push_back(b);
    auto at = [&](const std::vector<std::vector<uint8_t>>& bufs, size_t x) -> const uint8_t* {
      return x < filled.size() ? bufs[filled[x]].data() + size_t(t0n[filled[x]].first) * row : nullptr;
    };
    std::vector<const uint8_t*> want_k, want_v;
    for (size_t x = 0; x < filled.size(); ++x) {
      want_k.push_back(at(vb, x + size_t(D) - 1));
      want_v.push_back(at(kb, x + size_t(D)));
    }
    EXPECT_EQ(kc.along_seen, want_k) << "bt " << bt;
    EXPECT_EQ(vc.along_seen, want_v) << "bt " << bt;

    // The same result bit for bit as the burst requests of codecs that do not prefetch along.
    RecordingCodec kl(KvRole::key), vl(KvRole::value);
    attn_decode(kl, vl, 0, q.data(), n_q, spans.data(), int(nb), nullptr, nullptr, 0, 0, ap, lead.data(),
                scratch.data());
    EXPECT_EQ(lead, out) << "bt " << bt;
    for (const uint8_t* p : kl.along_seen) EXPECT_EQ(p, nullptr);
  }
}

TEST(PrefetchAlong, KernelsGiveTheSameResultsWithAndWithoutIt) {
  // The requests change no arithmetic: attn_decode with and without the early requests (which
  // picks the along path for these codecs at SIMD levels) agree bit for bit.
  for (std::string name : {"int4t_g128", "int2t_g64", "q4_0t", "q4_0h", "int8t", "tq4", "f16", "bf16", "fp8_e4m3",
                           "q8_0", "kivi4t", "kivi2t"}) {
    const bool kivi = name.rfind("kivi", 0) == 0;  // kivi's key and value codecs differ
    auto kc = make(kivi ? name + "_k" : name, KvRole::key, nullptr);
    auto vc = make(kivi ? name + "_v" : name, KvRole::value, nullptr);
    const int hd = 128, n_q = 4;
    for (int bt : {kivi ? 32 : 16, 64}) {  // kivi: whole 32-token key groups
      const int nb = 9;
      std::vector<uint8_t> kbuf(size_t(nb) * kc->block_bytes(bt)), vbuf(size_t(nb) * vc->block_bytes(bt));
      std::mt19937 rng(9);
      std::normal_distribution<float> nd;
      std::vector<float> x(size_t(bt) * hd);
      std::vector<KvBlockSpan> spans;
      for (int b = 0; b < nb; ++b) {
        uint8_t* kp = kbuf.data() + size_t(b) * kc->block_bytes(bt);
        uint8_t* vp = vbuf.data() + size_t(b) * vc->block_bytes(bt);
        for (auto& v : x) v = nd(rng);
        kc->encode(0, x.data(), hd, bt, kp, bt, 0, b * bt);
        for (auto& v : x) v = nd(rng);
        vc->encode(0, x.data(), hd, bt, vp, bt, 0, b * bt);
        const int t0 = b == 0 ? 16 % bt : 0, n = b == nb - 1 ? bt / 2 : bt - t0;
        spans.push_back({kp, vp, bt, t0, n, b * bt});
      }
      std::vector<float> q(size_t(n_q) * hd), on(q.size()), off(q.size());
      for (auto& v : q) v = nd(rng);
      AttnParams ap;
      ap.scale = 0.088f;
      AlignedBuf<float> scratch(attn_scratch_floats(*kc, *vc, n_q, bt));
      attn_decode(*kc, *vc, 0, q.data(), n_q, spans.data(), nb, nullptr, nullptr, 0, 0, ap, on.data(), scratch.data());
      EXPECT_EQ(kv_prefetch_along.p, nullptr);
      ap.prefetch_blocks = false;
      attn_decode(*kc, *vc, 0, q.data(), n_q, spans.data(), nb, nullptr, nullptr, 0, 0, ap, off.data(), scratch.data());
      EXPECT_EQ(on, off) << name << " bt " << bt;
    }
  }
}
