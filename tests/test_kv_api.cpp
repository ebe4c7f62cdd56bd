// The KV format library as an outside program uses it: this file includes only the public header
// (kvq/kv_format.h), so kvq::Error must be catchable from it; a caller's mistakes on any codec's
// entry points (block sizes, token ranges, head indices) throw kvq::Error instead of aborting or
// reading out of bounds.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "kvq/kv_format.h"

namespace {

// Every registered format's K and V codec at head_dim 128, 2 KV heads (those that need a
// calibration are skipped: they refuse to be built without one, which other tests check).
std::vector<std::unique_ptr<kvq::KvCodec>> all_codecs() {
  std::vector<std::unique_ptr<kvq::KvCodec>> out;
  for (const auto& f : kvq::kv_formats())
    for (bool key : {true, false}) {
      kvq::KvCodecParams p;
      p.head_dim = 128;
      p.n_kv_heads = 2;
      p.role = key ? kvq::KvRole::key : kvq::KvRole::value;
      try {
        out.push_back(kvq::kv_codec_create(key ? f.k_codec : f.v_codec, p));
      } catch (const kvq::Error&) {
      }
    }
  return out;
}

}  // namespace

TEST(KvApi, CallerMistakesThrowKvqError) {
  const auto codecs = all_codecs();
  ASSERT_GT(codecs.size(), 100u);
  for (const auto& c : codecs) {
    SCOPED_TRACE(c->info().name);
    EXPECT_THROW(c->block_bytes(0), kvq::Error);
    EXPECT_THROW(c->block_bytes(-16), kvq::Error);
    const int G = std::max(1, c->info().group_tokens), bt = std::max(64, G);
    std::vector<uint8_t> block(c->block_bytes(bt));
    std::vector<float> x(size_t(bt) * 128, 0.5f), y(x.size());
    c->encode(0, x.data(), 128, G, block.data(), bt, 0, 0);  // a valid call first
    EXPECT_THROW(c->decode(0, block.data(), bt, bt - 1, 2, 0, y.data()), kvq::Error);
    EXPECT_THROW(c->decode(0, block.data(), bt, -1, 1, 0, y.data()), kvq::Error);
    EXPECT_THROW(c->encode(0, x.data(), 128, G, block.data(), bt, bt, 0), kvq::Error);
    std::vector<float> qp(size_t(c->prepared_query_dim()) * 2, 0.f), out(size_t(bt) * 2);
    c->prepare_query(0, x.data(), 1, qp.data());
    EXPECT_THROW(c->scores(0, qp.data(), 1, block.data(), bt, 0, bt + 1, 0, out.data(), bt + 1), kvq::Error);
    EXPECT_THROW(c->accumulate(0, out.data(), bt + 1, 1, block.data(), bt, 1, bt, y.data()), kvq::Error);
  }
}

TEST(KvApi, RowCodecsRefuseHeadsOutsideTheirOwn) {
  for (const char* name : {"f16", "f32", "bf16", "fp8_e4m3", "int8_rows", "q8_0_rows", "q4_0_rows"}) {
    SCOPED_TRACE(name);
    const kvq::KvFormatDesc& f = kvq::kv_format_find(name);
    kvq::KvCodecParams p;
    p.head_dim = 128;
    p.n_kv_heads = 2;
    auto c = kvq::kv_codec_create(f.k_codec, p);
    std::vector<uint8_t> block(c->block_bytes(16));
    std::vector<float> x(128, 1.f), y(128);
    c->encode(1, x.data(), 128, 1, block.data(), 16, 0, 0);
    EXPECT_THROW(c->encode(2, x.data(), 128, 1, block.data(), 16, 0, 0), kvq::Error);
    EXPECT_THROW(c->decode(-1, block.data(), 16, 0, 1, 0, y.data()), kvq::Error);
    EXPECT_THROW(c->decode(1000000, block.data(), 16, 0, 1, 0, y.data()), kvq::Error);
  }
}
