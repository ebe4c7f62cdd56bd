// attn_decode (fused, online softmax) against attn_decode_ref (decode everything, double) for
// every registered format, with several spans, partial spans, GQA groups and an f32 tail.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "attn/attention.h"
#include "attn/softmax.h"
#include "cache/kv_cache.h"
#include "core/aligned.h"
#include "core/cpu.h"
#include "core/error.h"
#include "kv/policy.h"
#include "kv/turboquant.h"
#include "tq_tiled_bound.h"
#include "model/model.h"
#include "core/thread_pool.h"
#include "kv/kv_rows.h"
#include "kv/row_codec.h"
#include "kvq/kv_format.h"
#include "kivi_int_dot_bound.h"
#include "kv_int_dot_bound.h"
#include "int2_tiled_bound.h"
#include "int4_tiled_bound.h"
#include "int8_tiled_bound.h"
#include "kivi_tiled_bound.h"
#include "kv/kvquant.h"

using namespace kvq;

namespace {

struct Case {
  int head_dim = 128;
  int n_q = 4;
  int block_tokens = 64;
  int n_tail = 5;
  float softcap = 0;
};

// Fills blocks with random keys/values (one outlier channel in K, as real keys have), builds
// spans that include a partial first block (t0 > 0) and a partial last block (n < block).
// Row format of a key codec whose scores use the integer-dot kernels (an int8 image of the query
// follows the plain one in the prepared row), recognised by its inner row format's name
// (q4_0, q4_0h, int4_g64, int2_g32, ...); false when the codec scores with the float query.
bool int_dot_format(const KvCodec& kc, KvRowFmt* f, int* row_stride) {
  const int hd = kc.head_dim();
  std::string name = kc.info().name;
  // Centered and scaled codecs (*_c, *_cs, *_s) run the inner codec's kernels; their prepared
  // query holds the inner rows (inner stride), followed when centered by 16 floats of <q, mu>
  // room per row.
  int pqd = kc.prepared_query_dim();
  auto ends = [&](const char* suf) {
    const size_t n = std::strlen(suf);
    return name.size() > n && name.compare(name.size() - n, n, suf) == 0;
  };
  if (ends("_c") || ends("_cs")) {
    name.resize(name.size() - (ends("_c") ? 2 : 3));
    pqd -= 16;
  } else if (ends("_s")) {
    name.resize(name.size() - 2);
  }
  *row_stride = pqd;
  if (pqd == hd) return false;
  if (name.rfind("q4_0", 0) == 0) *f = kv_row_fmt(KvElem::q4_0, hd);
  else if (name.rfind("int4_g", 0) == 0) *f = kv_row_fmt(KvElem::int4g, hd, std::stoi(name.substr(6)));
  else if (name.rfind("int2_g", 0) == 0) *f = kv_row_fmt(KvElem::int2g, hd, std::stoi(name.substr(6)));
  else return false;
  return kv_rows_int_dot_ok(*f) && pqd == hd + kv_rows_query_extra_floats(*f);
}

// Value codecs whose weighted sum runs the integer kernel at AVX-512 (int16 weights,
// kv_int_dot_bound.h; int4_g* / int2_g*, plain or centered): the storage row format (the blocks
// hold its rows unchanged; centered codecs store v - mu).
bool int_accum_format(const KvCodec& vc, KvRowFmt* f) {
  if (cpu_level() != CpuLevel::avx512) return false;
  const int hd = vc.head_dim();
  std::string name = vc.info().name;
  if (name.size() > 2 && name.compare(name.size() - 2, 2, "_c") == 0) name.resize(name.size() - 2);
  if (name.rfind("int4_g", 0) == 0) *f = kv_row_fmt(KvElem::int4g, hd, std::stoi(name.substr(6)));
  else if (name.rfind("int2_g", 0) == 0) *f = kv_row_fmt(KvElem::int2g, hd, std::stoi(name.substr(6)));
  else return false;
  return test::kv_int_accum_active(*f);
}

// TurboQuant's AVX-512 kernels score on an int8 image of the rotated query and codebook and sum
// values in bf16; their per-score and per-channel bounds are derived in kv/turboquant.h and tested
// against them in test_turboquant. Here the deviation of the fused kernels from the decoded
// cache is measured on the case's own blocks (scores: max |fused - <q, decode(k)>|,
// checked to be small, and propagated through the softmax like the bounds above; values: the
// derived bf16 bound below), so that what this test checks is the attention loop around them.
// (TurboQuant's tiles and their wrappers score and sum with integer dots at every level: int4t_tol.)
bool tq_codec(const KvCodec& c) { return c.info().name.rfind("tq", 0) == 0 && !test::tqt_codec(c); }

double measured_score_dev(const KvCodec& kc, int head, const float* q, int n_q, const std::vector<std::vector<uint8_t>>& kb,
                          int bt) {
  const int hd = kc.head_dim();
  std::vector<float> qp(size_t(n_q) * size_t(kc.prepared_query_dim())), sc(size_t(n_q) * size_t(bt)),
      kd(size_t(bt) * size_t(hd));
  kc.prepare_query(head, q, n_q, qp.data());
  double dev = 0, mag = 0;
  for (size_t b = 0; b < kb.size(); ++b) {
    kc.scores(head, qp.data(), n_q, kb[b].data(), bt, 0, bt, int(b) * bt, sc.data(), bt);
    kc.decode(head, kb[b].data(), bt, 0, bt, int(b) * bt, kd.data());
    for (int i = 0; i < n_q; ++i)
      for (int t = 0; t < bt; ++t) {
        double ref = 0;
        for (int d = 0; d < hd; ++d) ref += double(q[size_t(i) * size_t(hd) + size_t(d)]) * kd[size_t(t) * size_t(hd) + size_t(d)];
        dev = std::max(dev, std::fabs(sc[size_t(i) * size_t(bt) + size_t(t)] - ref));
        mag = std::max(mag, std::fabs(ref));
      }
  }
  EXPECT_LT(dev, 0.02 * (1 + mag)) << kc.info().name << ": fused scores far from the decoded keys";
  return dev;
}

// The linear map F that finish_output applies to an accumulator row (the storage basis to the
// model's: a rotation's inverse, then the channel scales of the *_s codecs), read off its images
// of the unit vectors: inf_norm = max_c sum_j |F_cj| bounds |F e|_c by max_j |e_j|; F = S M with
// M orthogonal, so row c's L2 norm is the channel scale s_c (1 for unscaled codecs).
struct OutputMap {
  double inf_norm = 1;
  std::vector<double> s;
};
OutputMap output_map(const KvCodec& vc, int head) {
  const int d = vc.head_dim();
  std::vector<float> eye(size_t(d) * size_t(d), 0.f);
  for (int j = 0; j < d; ++j) eye[size_t(j) * size_t(d) + size_t(j)] = 1.f;
  vc.finish_output(head, eye.data(), d);  // row j: F e_j, column j of F
  OutputMap m;
  m.inf_norm = 0;
  m.s.assign(size_t(d), 0.0);
  for (int c = 0; c < d; ++c) {
    double l1 = 0, l2 = 0;
    for (int j = 0; j < d; ++j) {
      const double f = eye[size_t(j) * size_t(d) + size_t(c)];
      l1 += std::fabs(f);
      l2 += f * f;
    }
    m.inf_norm = std::max(m.inf_norm, l1);
    m.s[size_t(c)] = std::sqrt(l2);
  }
  return m;
}

// Values: the bf16 weighted sum errs per channel of the rotated basis by at most
// kTqAccumBf16Rel * sum_t p_t |v'_t[c]| (v' = R v, turboquant.h); over the channels that is at most
// kTqAccumBf16Rel * sum_t p_t ||v_t|| in L2, which the orthogonal un-rotation keeps, so every output
// channel moves by at most kTqAccumBf16Rel * max_t ||v_t|| per unit of probability mass. With
// channel scales (*_s) the stored vectors are v / s and the output is s times the un-rotated sum:
// max_c s_c * kTqAccumBf16Rel * max_t ||v_t / s||.
double tq_value_bound(const KvCodec& vc, int head, const std::vector<std::vector<uint8_t>>& vb, int bt) {
  const int hd = vc.head_dim();
  const OutputMap om = output_map(vc, head);
  std::vector<float> vd(size_t(bt) * size_t(hd));
  double nmax = 0;
  for (size_t b = 0; b < vb.size(); ++b) {
    vc.decode(head, vb[b].data(), bt, 0, bt, int(b) * bt, vd.data());
    for (int t = 0; t < bt; ++t) {
      double n2 = 0;
      for (int d = 0; d < hd; ++d) n2 += std::pow(vd[size_t(t) * size_t(hd) + size_t(d)] / om.s[size_t(d)], 2);
      nmax = std::max(nmax, std::sqrt(n2));
    }
  }
  return 1.01 * kTqAccumBf16Rel * nmax * *std::max_element(om.s.begin(), om.s.end());
}

// int4t_g* (kv/int4_tiled.h) score with an int8 query image and sum values with int8 weights per
// (query row, group, tile) at every CPU level (the scalar reference runs the same arithmetic).
// Scores: within Delta = scale * (largest int4t_score_bound), propagated through the softmax as
// for the row formats. Values: per call, half a weight step per tile relative to the normalized
// probabilities (int4t_value_bound), those taken exactly from the decoded keys and allowed to be
// e^(2 Delta) larger in the kernel.
double int4t_tol(const KvCodec& kc, const KvCodec& vc, int head, const std::vector<float>& q, int n_q,
                 const std::vector<KvBlockSpan>& spans, const float* tk, const float* tv, size_t ts, int n_tail,
                 const AttnParams& ap) {
  const int hd = kc.head_dim(), vd = vc.head_dim();
  double delta = 0, vmax = 0;
  if (test::int4t_codec(kc)) {
    const Int4TiledLayout L = test::int4t_layout_of(kc);
    // The kernel quantizes the plain part of the prepared row: the query itself, or H q for the
    // rotated int4t_g*h codecs, whose codes are those of H k.
    std::vector<float> qp(size_t(n_q) * size_t(kc.prepared_query_dim()));
    kc.prepare_query(head, q.data(), n_q, qp.data());
    for (const auto& sp : spans)
      for (int t = sp.t0; t < sp.t0 + sp.n; ++t)
        for (int i = 0; i < n_q; ++i)
          delta = std::max(delta, test::int4t_score_bound(L, qp.data() + size_t(i) * size_t(kc.prepared_query_dim()), sp.k, t));
    delta *= double(ap.scale);
  }
  if (test::int2t_codec(kc)) {  // int4t's int8 query image against 2-bit tiles (kv/int2_tiled.h)
    const Int4TiledLayout L = test::int2t_layout_of(kc);
    for (const auto& sp : spans)
      for (int t = sp.t0; t < sp.t0 + sp.n; ++t)
        for (int i = 0; i < n_q; ++i)
          delta = std::max(delta, test::int2t_score_bound(L, q.data() + size_t(i) * size_t(hd), sp.k, t));
    delta *= double(ap.scale);
  }
  if (test::kivi2t_key_codec(kc)) {  // kivi2t_k: kivi4t's fold against 2-bit tiles (kv/kivi_tiled.h)
    for (const auto& sp : spans)
      for (int t = sp.t0; t < sp.t0 + sp.n; ++t)
        for (int i = 0; i < n_q; ++i)
          delta = std::max(delta, test::kivi2t_score_bound(q.data() + size_t(i) * size_t(hd), sp.k, hd,
                                                           kc.info().group_tokens, t));
    delta *= double(ap.scale);
  }
  if (test::int8t_codec(kc)) {  // int8 image of the query per 32-dim block (kv/int8_tiled.h)
    const Int8TiledLayout L = test::int8t_layout_of(kc);
    // The kernel quantizes the plain part of the prepared row: the query, or H q for q8_0h.
    std::vector<float> qp(size_t(n_q) * size_t(kc.prepared_query_dim()));
    kc.prepare_query(head, q.data(), n_q, qp.data());
    for (const auto& sp : spans)
      for (int t = sp.t0; t < sp.t0 + sp.n; ++t)
        for (int i = 0; i < n_q; ++i)
          delta = std::max(delta, test::int8t_score_bound(L, qp.data() + size_t(i) * size_t(kc.prepared_query_dim()),
                                                          sp.k, t));
    delta *= double(ap.scale);
  }
  test::TqtShape kshp;
  if (test::tqt_codec(kc, &kshp)) {  // TurboQuant tiles: the rotated query's int8 image against the codebook's (kv/tq_tiled.h)
    const test::TqtShape& shp = kshp;
    std::vector<float> qp(size_t(n_q) * size_t(kc.prepared_query_dim()));
    kc.prepare_query(head, q.data(), n_q, qp.data());  // rows begin with the rotated (scaled) query
    for (const auto& sp : spans)
      for (int t = sp.t0; t < sp.t0 + sp.n; ++t)
        for (int i = 0; i < n_q; ++i)
          delta = std::max(delta, test::tqt_score_bound(shp, qp.data() + size_t(i) * size_t(kc.prepared_query_dim()),
                                                        sp.k, t));
    delta *= double(ap.scale);
  }
  if (test::kivi4t_key_codec(kc)) {  // kivi4t_k: int8 image of q * scale per key group (kv/kivi_tiled.h)
    for (const auto& sp : spans)
      for (int t = sp.t0; t < sp.t0 + sp.n; ++t)
        for (int i = 0; i < n_q; ++i)
          delta = std::max(delta, test::kivi4t_score_bound(q.data() + size_t(i) * size_t(hd), sp.k, hd,
                                                           kc.info().group_tokens, t));
    delta *= double(ap.scale);
  }
  std::vector<float> buf(size_t(256) * size_t(std::max(hd, vd)));
  for (const auto& sp : spans) {
    vc.decode(head, sp.v, sp.block_tokens, sp.t0, sp.n, sp.pos0, buf.data());
    for (size_t k = 0; k < size_t(sp.n) * size_t(vd); ++k) vmax = std::max(vmax, double(std::fabs(buf[k])));
  }
  for (int t = 0; t < n_tail; ++t)
    for (int d = 0; d < vd; ++d) vmax = std::max(vmax, double(std::fabs(tv[size_t(t) * ts + size_t(d)])));
  double tol = std::expm1(2 * delta) * vmax;
  test::TqtShape vshp;
  const bool tqt_v = test::tqt_codec(vc, &vshp);
  // TurboQuant tiles: what finish_output does to an L2 error bound of the rotated basis (model
  // units): at most the largest channel scale, finish_output's row norms over the image step (cs
  // of the channel's segment: the same ratio for every row).
  double tqt_out_gain = 0;
  if (tqt_v) {
    const OutputMap om = output_map(vc, head);
    double csmin = vshp.L.seg[0].cs;
    for (int g = 1; g < vshp.L.nseg; ++g) csmin = std::min(csmin, double(vshp.L.seg[g].cs));
    tqt_out_gain = *std::max_element(om.s.begin(), om.s.end()) / csmin;
  }
  if (test::int4t_codec(vc) || test::kivi4t_value_codec(vc) || test::int8t_codec(vc) || test::int2t_codec(vc) ||
      test::kivi2t_value_codec(vc) || tqt_v) {
    // kivi4t_v: int4t_g32's value tiles; int2t_g*: int4t's weight steps against 2-bit tiles;
    // kivi2t_v: int2t_g32's value tiles
    const bool i8 = test::int8t_codec(vc), i2 = test::int2t_codec(vc) || test::kivi2t_value_codec(vc);
    const Int4TiledLayout L = i8 || tqt_v ? Int4TiledLayout{}
                              : i2 ? (test::kivi2t_value_codec(vc) ? int2t_layout(vd, 32) : test::int2t_layout_of(vc))
                              : test::kivi4t_value_codec(vc) ? int4t_layout(vd, 32)
                                                              : test::int4t_layout_of(vc);
    double worst = 0;
    for (int i = 0; i < n_q; ++i) {
      const float* qi = q.data() + size_t(i) * size_t(hd);
      std::vector<double> logit;
      auto add = [&](const float* k) {
        double s = 0;
        for (int d = 0; d < hd; ++d) s += double(qi[d]) * k[d];
        s *= double(ap.scale);
        if (ap.softcap > 0) s = double(ap.softcap) * std::tanh(s / double(ap.softcap));
        logit.push_back(s);
      };
      for (const auto& sp : spans) {
        kc.decode(head, sp.k, sp.block_tokens, sp.t0, sp.n, sp.pos0, buf.data());
        for (int t = 0; t < sp.n; ++t) add(buf.data() + size_t(t) * size_t(hd));
      }
      for (int t = 0; t < n_tail; ++t) add(tk + size_t(t) * ts);
      const double mx = *std::max_element(logit.begin(), logit.end());
      double l = 0;
      for (double& v : logit) l += (v = std::exp(v - mx));
      for (double& v : logit) v /= l;
      double e = 0;
      size_t off = 0;
      if (tqt_v) {
        // Per rotated channel (model units), summed over the spans; R^T is orthogonal, so the L2 norm
        // bounds every channel after it (times tqt_out_gain for a scaled codec's channel scales).
        const test::TqtShape& shp = vshp;
        std::vector<double> ch(size_t(vd), 0.0);
        for (const auto& sp : spans) {
          std::vector<double> pw(logit.begin() + std::ptrdiff_t(off), logit.begin() + std::ptrdiff_t(off) + sp.n);
          for (double& w : pw) w *= std::exp(2 * delta);
          const auto b = test::tqt_value_bound(shp, sp.v, sp.t0, sp.n, pw.data());
          for (int d = 0; d < vd; ++d) ch[size_t(d)] += b[size_t(d)];
          off += size_t(sp.n);
        }
        double l2 = 0;
        for (double x : ch) l2 += x * x;
        worst = std::max(worst, std::sqrt(l2) * tqt_out_gain);
        continue;
      }
      for (const auto& sp : spans) {
        e += i8   ? test::int8t_value_bound(test::int8t_layout_of(vc), sp.v, sp.t0, sp.n, logit.data() + off, std::exp(2 * delta))
             : i2 ? test::int2t_value_bound(L, sp.v, sp.t0, sp.n, logit.data() + off, std::exp(2 * delta))
                  : test::int4t_value_bound(L, sp.v, sp.t0, sp.n, logit.data() + off, std::exp(2 * delta));
        off += size_t(sp.n);
      }
      worst = std::max(worst, e);
    }
    // A rotated (or scaled) codec's per-channel bound holds in its storage basis; finish_output's
    // map F takes a per-channel bound e to at most (max_c sum_j |F_cj|) * e (for H^T, orthonormal
    // blocks of B channels with entries +-1/sqrt(B): sqrt(B)).
    if (vc.info().transforms_output && !tqt_v) worst *= output_map(vc, head).inf_norm;
    tol += worst;
  }
  return tol;
}

// Calibration artifacts for every format that needs one at head_dim hd (2 KV heads): static
// scales, different per head; centered formats' per-head channel means (a few large channels, as
// keys have); channel RMS for the scaled ones; KVQuant codebooks and calibrated key ranges.
const nlohmann::json& test_calib(int hd) {
  static std::map<int, nlohmann::json> calibs;
  auto it = calibs.find(hd);
  if (it == calibs.end()) {
    std::vector<std::vector<float>> km(2, std::vector<float>(size_t(hd))), vm = km, kr = km, qr = km, vr = km;
    for (int h = 0; h < 2; ++h)
      for (int d = 0; d < hd; ++d) {
        km[size_t(h)][size_t(d)] = (d % 11 == 3) ? 4.f * float(h + 1) : 0.05f * float(d % 7);
        vm[size_t(h)][size_t(d)] = 0.1f * float((d + h) % 5) - 0.2f;
        // channel RMS (scaled formats): above the means, uneven across channels and heads
        kr[size_t(h)][size_t(d)] = std::fabs(km[size_t(h)][size_t(d)]) + 0.5f + 0.3f * float((d + h) % 4);
        qr[size_t(h)][size_t(d)] = 0.4f + 0.2f * float((3 * d + h) % 5);
        vr[size_t(h)][size_t(d)] = std::fabs(vm[size_t(h)][size_t(d)]) + 0.3f + 0.1f * float(d % 3);
      }
    nlohmann::json layer = {{"k_scale", {0.05, 0.07}}, {"v_scale", {0.03, 0.02}}, {"k_mean", km}, {"v_mean", vm},
                            {"k_rms", kr}, {"q_rms", qr}, {"v_rms", vr}};
    // calibrated KVQuant key ranges: about the channel means, a few RMS wide
    auto kw = kr;
    for (auto& h : kw)
      for (float& w : h) w *= 2.5f;
    for (int b : {2, 3, 4}) {
      layer["kvquant_k" + std::to_string(b)] = {{"codebook", kvquant_default_codebook(b)}};
      layer["kvquant_cal_k" + std::to_string(b)] = kvquant_cal_artifact(km, kw, b);
    }
    it = calibs.emplace(hd, nlohmann::json{{"layers", {layer}}}).first;
  }
  return it->second;
}

// Returns the max error; *tol receives the allowed error: 2e-5 (f32 summation order, polynomial
// exp) plus, when the scores use the int8 query image, the softmax's response to score errors:
// every score within Delta = scale * (largest int_dot_bound over the block rows and query rows,
// taken on the query the kernel quantizes: the plain part of the prepared row, rotated where the
// codec rotates), so every probability ratio p'/p lies in [e^-2Delta, e^2Delta], the
// probabilities move by at most (e^2Delta - 1) in L1, and each output by that times max |v|.
double max_err_vs_ref(const std::string& format, const Case& c, uint64_t seed, double* tol) {
  const KvFormatDesc& f = kv_format_find(format);
  KvCodecParams pk, pv;
  pk.head_dim = pv.head_dim = c.head_dim;
  pk.n_kv_heads = pv.n_kv_heads = 2;
  pk.role = KvRole::key;
  pv.role = KvRole::value;
  pk.calib = pv.calib = &test_calib(c.head_dim);
  std::unique_ptr<KvCodec> kc, vc;
  try {
    kc = kv_codec_create(f.k_codec, pk);
    vc = kv_codec_create(f.v_codec, pv);
  } catch (const Error&) {
    if (c.head_dim == 128) throw;  // every format must support the common head_dim
    return -1;                     // shape not supported by this format (e.g. group > head_dim)
  }
  const int head = 1, bt = c.block_tokens, n_blocks = 4;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<std::vector<uint8_t>> kb(n_blocks), vb(n_blocks);
  std::vector<float> rows(size_t(bt) * size_t(c.head_dim));
  for (int b = 0; b < n_blocks; ++b) {
    kb[b].resize(kc->block_bytes(bt));
    vb[b].resize(vc->block_bytes(bt));
    for (size_t i = 0; i < rows.size(); ++i) rows[i] = nd(rng) * ((i % size_t(c.head_dim)) == 3 ? 8.f : 1.f);
    kc->encode(head, rows.data(), size_t(c.head_dim), bt, kb[b].data(), bt, 0, b * bt);
    for (auto& x : rows) x = nd(rng);
    vc->encode(head, rows.data(), size_t(c.head_dim), bt, vb[b].data(), bt, 0, b * bt);
  }
  std::vector<KvBlockSpan> spans;
  for (int b = 0; b < n_blocks; ++b) {
    KvBlockSpan s;
    s.k = kb[b].data();
    s.v = vb[b].data();
    s.block_tokens = bt;
    s.pos0 = b * bt;
    s.t0 = b == 0 ? 7 : 0;
    s.n = b == n_blocks - 1 ? bt / 2 - 3 : bt - s.t0;
    spans.push_back(s);
  }
  const size_t ts = size_t(c.head_dim) + 8;  // tail rows padded: the stride is honoured
  std::vector<float> tk(size_t(c.n_tail) * ts), tv(size_t(c.n_tail) * ts), q(size_t(c.n_q) * size_t(c.head_dim));
  for (auto& x : tk) x = nd(rng);
  for (auto& x : tv) x = nd(rng);
  for (auto& x : q) x = nd(rng);
  AttnParams ap;
  ap.scale = 1.f / std::sqrt(float(c.head_dim));
  ap.softcap = c.softcap;
  std::vector<float> out(size_t(c.n_q) * size_t(c.head_dim)), ref(out.size());
  AlignedBuf<float> scratch(attn_scratch_floats(*kc, *vc, c.n_q, bt));
  attn_decode(*kc, *vc, head, q.data(), c.n_q, spans.data(), int(spans.size()), tk.data(), tv.data(), ts,
              c.n_tail, ap, out.data(), scratch.data());
  attn_decode_ref(*kc, *vc, head, q.data(), c.n_q, spans.data(), int(spans.size()), tk.data(), tv.data(), ts,
                  c.n_tail, ap, ref.data());
  *tol = 2e-5;
  KvRowFmt rf;
  int pqd = 0;
  const bool kivi_int = test::kivi_int_keys(*kc);  // KIVI keys: int16 query image (kivi_int_dot_bound.h)
  const bool row_int = cpu_level() != CpuLevel::scalar && int_dot_format(*kc, &rf, &pqd);
  if (row_int || kivi_int) {
    std::vector<float> qp(size_t(c.n_q) * size_t(kc->prepared_query_dim()));
    kc->prepare_query(head, q.data(), c.n_q, qp.data());
    double delta = 0, vmax = 0;
    for (int b = 0; b < n_blocks; ++b)
      for (int t = 0; t < bt; ++t)
        for (int i = 0; i < c.n_q; ++i)
          if (kivi_int) {
            if (t == 0 && i == 0) delta = std::max(delta, test::kivi_int_dot_bound(*kc, qp.data(), c.n_q, kb[size_t(b)].data(), bt));
          } else {
            delta = std::max(delta, test::int_dot_bound(rf, qp.data() + size_t(i) * size_t(pqd),
                                                        kb[size_t(b)].data() + size_t(t) * rf.row_bytes));
          }
    std::vector<float> vd(size_t(bt) * size_t(c.head_dim));
    for (int b = 0; b < n_blocks; ++b) {
      vc->decode(head, vb[size_t(b)].data(), bt, 0, bt, b * bt, vd.data());
      for (float v : vd) vmax = std::max(vmax, double(std::fabs(v)));
    }
    for (float v : tv) vmax = std::max(vmax, double(std::fabs(v)));
    *tol += std::expm1(2 * double(ap.scale) * delta) * vmax;
  }
  if (cpu_level() == CpuLevel::avx512 && (tq_codec(*kc) || tq_codec(*vc))) {
    double vmax = 0;
    std::vector<float> vd(size_t(bt) * size_t(c.head_dim));
    for (int b = 0; b < n_blocks; ++b) {
      vc->decode(head, vb[size_t(b)].data(), bt, 0, bt, b * bt, vd.data());
      for (float v : vd) vmax = std::max(vmax, double(std::fabs(v)));
    }
    for (float v : tv) vmax = std::max(vmax, double(std::fabs(v)));
    if (tq_codec(*kc)) *tol += std::expm1(2 * double(ap.scale) * measured_score_dev(*kc, head, q.data(), c.n_q, kb, bt)) * vmax;
    if (tq_codec(*vc)) *tol += tq_value_bound(*vc, head, vb, bt);
  }
  if (test::kivi_int_values(*vc)) {  // int16 weights of the KIVI value sums (kivi_int_dot_bound.h)
    int n_tok = 0;
    for (const auto& sp : spans) n_tok += sp.n;
    double vmax = 0;
    std::vector<float> vd(size_t(bt) * size_t(c.head_dim));
    for (int b = 0; b < n_blocks; ++b) {
      vc->decode(head, vb[size_t(b)].data(), bt, 0, bt, b * bt, vd.data());
      for (float v : vd) vmax = std::max(vmax, double(std::fabs(v)));
    }
    *tol += test::kivi_int_values_attn_bound(n_tok, vmax);
  }
  if (test::int4t_codec(*kc) || test::int4t_codec(*vc) || test::int8t_codec(*kc) || test::int8t_codec(*vc) ||
      test::int2t_codec(*kc) || test::int2t_codec(*vc) || test::kivi2t_key_codec(*kc) ||
      test::kivi2t_value_codec(*vc) ||
      test::kivi4t_key_codec(*kc) ||
      test::kivi4t_value_codec(*vc) || test::tqt_codec(*kc) || test::tqt_codec(*vc))
    *tol += int4t_tol(*kc, *vc, head, q, c.n_q, spans, tk.data(), tv.data(), ts, c.n_tail, ap);
  // bf16 rows on AVX-512 score against the query rounded to bf16 and sum with the probabilities
  // rounded to bf16 (kv_rows.h, kv_rows_bf16_rel): each score within
  // Delta = scale * (2^-8 sum_i |q_i k_i| + 2^-126 sum_i (|q_i| + |k_i|)), propagated as above, and
  // each output channel within 2^-8 max |v| (+ the flush term) for the weights.
  // The fp8 tiles (codecs fp8_e4m3t, fp8_e5m2t and their _static / _dyn kinds, kv/fp8_tiled.h) do
  // so at every CPU level.
  const auto bf16_rows = [](const KvCodec& cd) {
    const std::string& n = cd.info().name;
    if (n.rfind("fp8_e", 0) == 0 && n.size() > 8 && n[8] == 't') return true;
    const auto* rc = dynamic_cast<const KvRowCodec*>(&cd);
    return cpu_level() == CpuLevel::avx512 && rc != nullptr && kv_rows_bf16_dot_active(rc->fmt());
  };
  if (bf16_rows(*kc) || bf16_rows(*vc)) {
    const int hd = c.head_dim;
    std::vector<float> kd(size_t(bt) * size_t(hd)), vd(kd.size());
    double delta = 0, vmax = 0;
    for (int b = 0; b < n_blocks; ++b) {
      kc->decode(head, kb[size_t(b)].data(), bt, 0, bt, b * bt, kd.data());
      vc->decode(head, vb[size_t(b)].data(), bt, 0, bt, b * bt, vd.data());
      for (float v : vd) vmax = std::max(vmax, double(std::fabs(v)));
      for (int t = 0; t < bt; ++t)
        for (int i = 0; i < c.n_q; ++i) {
          double m = 0, fl = 0;
          for (int d = 0; d < hd; ++d) {
            const double qv = q[size_t(i) * size_t(hd) + size_t(d)], kv = kd[size_t(t) * size_t(hd) + size_t(d)];
            m += std::fabs(qv * kv);
            fl += std::fabs(qv) + std::fabs(kv);
          }
          delta = std::max(delta, kv_rows_bf16_rel * m + kv_rows_bf16_flush * fl);
        }
    }
    for (float v : tv) vmax = std::max(vmax, double(std::fabs(v)));
    if (bf16_rows(*kc)) *tol += std::expm1(2 * double(ap.scale) * delta) * vmax;
    if (bf16_rows(*vc)) *tol += (kv_rows_bf16_rel + kv_rows_bf16_flush) * vmax;
  }
  KvRowFmt vf;
  if (int_accum_format(*vc, &vf)) {  // int16 weights of the row formats' value sums
    int n_tok = 0;
    for (const auto& sp : spans) n_tok += sp.n;
    double vmax = 0;  // in the storage basis, as the kernel sees the rows
    std::vector<float> x(size_t(c.head_dim));
    for (int b = 0; b < n_blocks; ++b)
      for (int t = 0; t < bt; ++t) {
        kv_row_decode(vf, 1.f, vb[size_t(b)].data() + size_t(t) * vf.row_bytes, x.data());
        for (float v : x) vmax = std::max(vmax, double(std::fabs(v)));
      }
    *tol += test::kv_int_accum_attn_bound(n_tok, vmax);
  }
  double err = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    if (!std::isfinite(out[i])) return INFINITY;
    err = std::max(err, double(std::fabs(out[i] - ref[i])));
  }
  return err;
}

}  // namespace

TEST(Attention, FusedMatchesReferenceForEveryFormatAndCpuLevel) {
  const CpuLevel saved = cpu_set_level(CpuLevel::avx512);
  for (CpuLevel lvl : {CpuLevel::scalar, CpuLevel::avx2, CpuLevel::avx512}) {
    cpu_set_level(lvl);
    for (const auto& f : kv_formats()) {
      for (int hd : {64, 128}) {
        for (int nq : {1, 4, 8, 12}) {
          // every n_q at the common head_dim; one n_q at the other; fewer shapes below AVX-512
          // (each level runs the same code paths for every shape)
          if (hd == 64 && nq != 4) continue;
          if (lvl != CpuLevel::avx512 && (hd != 128 || nq == 4 || nq == 8)) continue;
          Case c;
          c.head_dim = hd;
          c.n_q = nq;
          double tol = 0;
          const double e = max_err_vs_ref(f.name, c, 1234 + uint64_t(nq), &tol);
          // Both sides see the same decoded K/V; f32 summation order, the polynomial exp and, for
          // the 4-bit key formats above the scalar level, the int8 query image differ.
          EXPECT_LT(e, tol) << f.name << " hd " << hd << " n_q " << nq << " cpu " << cpu_level_name(lvl);
        }
      }
    }
  }
  cpu_set_level(saved);
}

// Long contexts (vLLM's FP8 cache once passed its short tests and lost most of its needle accuracy
// at 128K tokens to a kernel accumulation bug): 16K tokens in 256 blocks at positions from 100000
// on, RoPE on, every format. The short case above runs one batch of blocks; here the fused path runs
// 64 batches, rescales its sums across them, walks the along requests over the whole list and turns
// the pre-RoPE keys through angles of 10^5 radians. Planted needles, one key per query row aligned
// with that row (in the first block, the middle and the last blocks, the tail), take most of each
// row's attention, so a batch dropped, counted twice or rescaled wrongly moves an output by a good
// part of max |v|, far beyond the kernels' per-score and per-tile rounding (within 1% of max |v| in
// the short case's bounds). Checked: fused single pass and split-K (3 parts on 2 threads) against
// the double reference on the decoded blocks within 2% of max |v| at every CPU level this machine
// runs, and split-K against the single pass to float rounding.
struct LongData {
  static constexpr int hd = 128, n_q = 4, bt = 64, n_blocks = 256, n_tail = 5, pos0 = 100000;
  std::vector<float> k, v, q, tk, tv;  // k, v: (n_blocks * bt, hd) pre-RoPE where a codec wants it
  std::vector<int> needle;             // token index of row i's needle (n_blocks * bt + j: tail row j)
};
const LongData& long_data() {
  static const LongData d = [] {
    LongData x;
    const int n = LongData::n_blocks * LongData::bt, hd = LongData::hd;
    std::mt19937_64 rng(4242);
    std::normal_distribution<float> nd;
    x.k.resize(size_t(n) * hd);
    x.v.resize(x.k.size());
    for (size_t i = 0; i < x.k.size(); ++i) x.k[i] = nd(rng) * ((i % size_t(hd)) == 3 ? 8.f : 1.f);
    for (auto& e : x.v) e = nd(rng);
    x.q.resize(size_t(LongData::n_q) * hd);
    for (auto& e : x.q) e = nd(rng);
    x.tk.resize(size_t(LongData::n_tail) * hd);
    x.tv.resize(x.tk.size());
    for (auto& e : x.tk) e = nd(rng);
    for (auto& e : x.tv) e = nd(rng);
    x.needle = {20, n / 2 + 33, n - 40, n + 2};  // first block (after its t0 = 7), middle, last block, tail
    return x;
  }();
  return d;
}

// The error of one format against the reference (INFINITY for a non-finite output), with vmax =
// max |decoded v| and the split-K deviation from the single pass.
void long_case(const std::string& format, double* err, double* split_dev, double* vmax) {
  const LongData& d = long_data();
  constexpr int hd = LongData::hd, bt = LongData::bt, nb = LongData::n_blocks, n_q = LongData::n_q;
  const KvFormatDesc& f = kv_format_find(format);
  KvCodecParams pk, pv;
  pk.head_dim = pv.head_dim = hd;
  pk.n_kv_heads = pv.n_kv_heads = 2;
  pk.role = KvRole::key;
  pv.role = KvRole::value;
  pk.rope = pv.rope = KvRope{hd, 10000.f, 1.f, false};
  pk.calib = pv.calib = &test_calib(hd);
  auto kc = kv_codec_create(f.k_codec, pk);
  auto vc = kv_codec_create(f.v_codec, pv);
  const int head = 1;
  // The needles: key of row i = 2 * q_i (score 2 |q_i|^2 / sqrt(hd), about 23, against N(0, 1)
  // scores for the other tokens), turned back by RoPE for a pre-RoPE codec so that its decode aligns
  // it with q_i; value = 4 * a fixed random row.
  std::vector<float> k = d.k, v = d.v, tk = d.tk, tv = d.tv;
  for (int i = 0; i < n_q; ++i) {
    const int t = d.needle[size_t(i)];
    const bool tail = t >= nb * bt;
    float* kr = tail ? &tk[size_t(t - nb * bt) * hd] : &k[size_t(t) * hd];
    float* vr = tail ? &tv[size_t(t - nb * bt) * hd] : &v[size_t(t) * hd];
    for (int c = 0; c < hd; ++c) {
      kr[c] = 2.f * d.q[size_t(i) * hd + size_t(c)];
      vr[c] = 4.f * d.v[size_t(c)];
    }
    if (!tail && kc->info().pre_rope) kv_rope_apply(pk.rope, -(LongData::pos0 + t), kr, hd);
  }
  std::vector<std::vector<uint8_t>> kb(nb), vb(nb);
  std::vector<KvBlockSpan> spans;
  for (int b = 0; b < nb; ++b) {
    kb[size_t(b)].resize(kc->block_bytes(bt));
    vb[size_t(b)].resize(vc->block_bytes(bt));
    const int pos = LongData::pos0 + b * bt;
    kc->encode(head, &k[size_t(b) * bt * hd], hd, bt, kb[size_t(b)].data(), bt, 0, pos);
    vc->encode(head, &v[size_t(b) * bt * hd], hd, bt, vb[size_t(b)].data(), bt, 0, pos);
    KvBlockSpan s{kb[size_t(b)].data(), vb[size_t(b)].data(), bt, b == 0 ? 7 : 0, 0, pos};
    s.n = b == nb - 1 ? bt - 9 : bt - s.t0;  // partial first and last blocks (needle 2 stays inside)
    spans.push_back(s);
  }
  AttnParams ap;
  ap.scale = 1.f / std::sqrt(float(hd));
  std::vector<float> out(size_t(n_q) * hd), ref(out.size()), split(out.size());
  AlignedBuf<float> scratch(attn_scratch_floats(*kc, *vc, n_q, bt));
  attn_decode(*kc, *vc, head, d.q.data(), n_q, spans.data(), nb, tk.data(), tv.data(), hd, LongData::n_tail, ap,
              out.data(), scratch.data());
  attn_decode_ref(*kc, *vc, head, d.q.data(), n_q, spans.data(), nb, tk.data(), tv.data(), hd, LongData::n_tail, ap,
                  ref.data());
  ThreadPool pool(2);
  AlignedBuf<float> ss(attn_split_scratch_floats(*kc, *vc, n_q, bt, 3));
  attn_decode_split(*kc, *vc, head, d.q.data(), n_q, spans.data(), nb, tk.data(), tv.data(), hd, LongData::n_tail, ap,
                    split.data(), ss.data(), pool, 3);
  *vmax = 0;
  std::vector<float> vd(size_t(bt) * hd);
  for (int b = 0; b < nb; ++b) {
    vc->decode(head, vb[size_t(b)].data(), bt, 0, bt, LongData::pos0 + b * bt, vd.data());
    for (float x : vd) *vmax = std::max(*vmax, double(std::fabs(x)));
  }
  for (float x : tv) *vmax = std::max(*vmax, double(std::fabs(x)));
  *err = *split_dev = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    if (!std::isfinite(out[i]) || !std::isfinite(split[i])) {
      *err = INFINITY;
      return;
    }
    *err = std::max({*err, double(std::fabs(out[i] - ref[i])), double(std::fabs(split[i] - ref[i]))});
    *split_dev = std::max(*split_dev, double(std::fabs(split[i] - out[i])));
  }
  // The needles do take the attention: each row's reference output is near its needle's decoded value.
  for (int i = 0; i < n_q; ++i) {
    const int t = d.needle[size_t(i)];
    const float* nv = &tv[size_t(t - nb * bt) * hd];
    if (t < nb * bt) {
      vc->decode(head, vb[size_t(t / bt)].data(), bt, t % bt, 1, LongData::pos0 + t / bt * bt, vd.data());
      nv = vd.data();
    }
    double dev = 0;
    for (int c = 0; c < hd; ++c) dev = std::max(dev, std::fabs(double(ref[size_t(i) * hd + size_t(c)]) - nv[c]));
    EXPECT_LT(dev, 0.25 * *vmax) << format << ": row " << i << "'s needle does not dominate the reference";
  }
}

TEST(Attention, LongContextEveryFormatMatchesReference) {
  const CpuLevel saved = cpu_level();
  for (CpuLevel lvl : {CpuLevel::scalar, CpuLevel::avx2, CpuLevel::avx512}) {
    cpu_set_level(lvl);
    if (cpu_level() != lvl) continue;  // not on this CPU
    for (const auto& f : kv_formats()) {
      double err = 0, split_dev = 0, vmax = 0;
      long_case(f.name, &err, &split_dev, &vmax);
      EXPECT_LT(err, 0.02 * vmax) << f.name << " cpu " << cpu_level_name(lvl);
      EXPECT_LT(split_dev, 2e-5 * (1 + vmax)) << f.name << " cpu " << cpu_level_name(lvl);
      std::printf("[long] %-16s %-6s err %.3g split-single %.3g max|v| %.3g\n", f.name.c_str(), cpu_level_name(lvl),
                  err, split_dev, vmax);
    }
  }
  cpu_set_level(saved);
}

TEST(Attention, SoftcapAndOddShapes) {
  Case c;
  c.head_dim = 80;  // not a multiple of 32: formats with 32-blocks are skipped
  c.n_q = 3;
  c.block_tokens = 16;
  c.n_tail = 70;  // more than one tail chunk
  c.softcap = 5.f;
  double tol = 0;
  for (const char* f : {"f32", "f16", "bf16"}) EXPECT_LT(max_err_vs_ref(f, c, 7, &tol), tol) << f;
}

TEST(Attention, TailOnlyAndEmpty) {
  KvCodecParams p;
  p.head_dim = 64;
  auto kc = kv_codec_create("f16", p);
  std::vector<float> q(64, 0.1f), tk(3 * 64), tv(3 * 64), out(64), ref(64);
  for (size_t i = 0; i < tk.size(); ++i) {
    tk[i] = float(i % 7) * 0.3f;
    tv[i] = float(i % 5) - 2.f;
  }
  AlignedBuf<float> scratch(attn_scratch_floats(*kc, *kc, 1, 0));
  AttnParams ap;
  attn_decode(*kc, *kc, 0, q.data(), 1, nullptr, 0, tk.data(), tv.data(), 64, 3, ap, out.data(), scratch.data());
  attn_decode_ref(*kc, *kc, 0, q.data(), 1, nullptr, 0, tk.data(), tv.data(), 64, 3, ap, ref.data());
  for (int i = 0; i < 64; ++i) EXPECT_NEAR(out[size_t(i)], ref[size_t(i)], 1e-5);
  // No tokens at all: defined output (zeros), no NaN.
  attn_decode(*kc, *kc, 0, q.data(), 1, nullptr, 0, nullptr, nullptr, 64, 0, ap, out.data(), scratch.data());
  for (float v : out) EXPECT_EQ(v, 0.f);
}

TEST(Attention, ExpKernelsMatchReference) {
  std::vector<float> x;
  for (int i = 0; i < 1000; ++i) x.push_back(-100.f + 0.1001f * float(i));
  x.push_back(0.f);
  x.push_back(-1e-30f);
  x.push_back(-87.f);
  x.push_back(-88.f);
  std::vector<float> a = x, b = x;
  const float sa = attn_exp_sub_ref(a.data(), int(a.size()), 0.f);
  for (CpuLevel lvl : {CpuLevel::avx2, CpuLevel::avx512}) {
    const CpuLevel saved = cpu_set_level(lvl);
    b = x;
    const float sb = attn_exp_sub(b.data(), int(b.size()), 0.f);
    cpu_set_level(saved);
    for (size_t i = 0; i < a.size(); ++i) {
      // flush to zero below e^-87.3 (~1.2e-38 of the max) is allowed.
      EXPECT_NEAR(b[i], a[i], 3e-7f * a[i] + 1.3e-38f) << x[i];
    }
    EXPECT_NEAR(sb, sa, 1e-5f * sa);
  }
}

// The scaling + max pass: the same products (exactly) and the same max in every variant, with
// lengths around the vector widths, NaN entries skipped, -inf entries, and the empty case.
TEST(Attention, ScaleMaxKernelsMatchReference) {
  std::mt19937 rng(5);
  std::normal_distribution<float> nd;
  for (int n : {0, 1, 7, 8, 9, 15, 16, 17, 31, 64, 65}) {
    for (int variant = 0; variant < 3; ++variant) {
      std::vector<float> x(static_cast<size_t>(n));
      for (auto& v : x) v = nd(rng) * 10.f;
      if (n > 3 && variant == 1) x[2] = std::nanf("");
      if (n > 5 && variant == 2) x[size_t(n) - 1] = -INFINITY;
      std::vector<float> a = x;
      const float ma = attn_scale_max_ref(a.data(), n, 0.125f);
      for (CpuLevel lvl : {CpuLevel::avx2, CpuLevel::avx512}) {
        const CpuLevel saved = cpu_set_level(lvl);
        std::vector<float> b = x;
        const float mb = attn_scale_max(b.data(), n, 0.125f);
        cpu_set_level(saved);
        EXPECT_EQ(mb, ma) << n << " " << cpu_level_name(lvl);
        for (int i = 0; i < n; ++i) {
          if (std::isnan(a[size_t(i)])) EXPECT_TRUE(std::isnan(b[size_t(i)]));
          else EXPECT_EQ(b[size_t(i)], a[size_t(i)]) << n << " " << i;
        }
      }
    }
  }
}

// Split-K: parts of the span list on pool threads, merged exactly. Against the double reference
// (float formats) and against the single-pass attn_decode (every listed format, same kernels, so
// only the merge's rounding differs), for several pool sizes and part counts, with and without a
// tail, on random keys and on adversarial ones: a single dominant token in the last part (the
// other parts' weights underflow to 0 after the merge), all-zero keys (uniform weights),
// constant value rows, huge and tiny magnitudes.
TEST(Attention, SplitKMatchesReferenceAndSinglePass) {
  enum class Pat { random, spike, zero_keys, const_values, huge, tiny };
  const int hd = 128, bt = 64, n_blocks = 70, n_q = 4;  // 4480 tokens: up to 4 parts of >= 1024
  for (const char* fmt : {"f32", "f16", "int8", "q8_0", "q4_0", "int2_g32"}) {
    const KvFormatDesc& f = kv_format_find(fmt);
    KvCodecParams pk, pv;
    pk.head_dim = pv.head_dim = hd;
    pk.role = KvRole::key;
    pv.role = KvRole::value;
    auto kc = kv_codec_create(f.k_codec, pk);
    auto vc = kv_codec_create(f.v_codec, pv);
    for (Pat pat : {Pat::random, Pat::spike, Pat::zero_keys, Pat::const_values, Pat::huge, Pat::tiny}) {
      std::mt19937_64 rng(99 + uint64_t(pat));
      std::normal_distribution<float> nd;
      const float mag = pat == Pat::huge ? 3e3f : pat == Pat::tiny ? 1e-4f : 1.f;
      std::vector<float> q(size_t(n_q) * hd);
      for (auto& x : q) x = nd(rng) * (pat == Pat::huge ? 1.f : 0.5f);
      std::vector<std::vector<uint8_t>> kb(n_blocks), vb(n_blocks);
      std::vector<float> kr(size_t(bt) * hd), vr(size_t(bt) * hd);
      for (int b = 0; b < n_blocks; ++b) {
        for (int t = 0; t < bt; ++t)
          for (int d = 0; d < hd; ++d) {
            float k = pat == Pat::zero_keys ? 0.f : nd(rng) * mag;
            // One token late in the sequence aligned with query 0: it dominates every other score.
            if (pat == Pat::spike && b == n_blocks - 3 && t == 11) k = 40.f * q[size_t(d)];
            kr[size_t(t) * hd + size_t(d)] = k;
            vr[size_t(t) * hd + size_t(d)] = pat == Pat::const_values ? 0.25f : nd(rng) * mag;
          }
        kb[size_t(b)].resize(kc->block_bytes(bt));
        vb[size_t(b)].resize(vc->block_bytes(bt));
        kc->encode(0, kr.data(), hd, bt, kb[size_t(b)].data(), bt, 0, b * bt);
        vc->encode(0, vr.data(), hd, bt, vb[size_t(b)].data(), bt, 0, b * bt);
      }
      std::vector<KvBlockSpan> spans;
      for (int b = 0; b < n_blocks; ++b) {
        KvBlockSpan s{kb[size_t(b)].data(), vb[size_t(b)].data(), bt, b == 0 ? 5 : 0, 0, b * bt};
        s.n = b == n_blocks - 1 ? 17 : bt - s.t0;  // partial first and last spans
        spans.push_back(s);
      }
      std::vector<float> tk(3 * hd), tv(3 * hd);
      for (auto& x : tk) x = nd(rng) * mag;
      for (auto& x : tv) x = nd(rng) * mag;
      AttnParams ap;
      ap.scale = 1.f / std::sqrt(float(hd));
      for (int n_tail : {0, 3}) {
        std::vector<float> ref(size_t(n_q) * hd), one(ref.size()), out(ref.size());
        attn_decode_ref(*kc, *vc, 0, q.data(), n_q, spans.data(), n_blocks, tk.data(), tv.data(), hd, n_tail, ap,
                        ref.data());
        AlignedBuf<float> s1(attn_scratch_floats(*kc, *vc, n_q, bt));
        attn_decode(*kc, *vc, 0, q.data(), n_q, spans.data(), n_blocks, tk.data(), tv.data(), hd, n_tail, ap,
                    one.data(), s1.data());
        double vmax = 0;
        for (float v : ref) vmax = std::max(vmax, double(std::fabs(v)));
        const bool float_fmt = std::string(fmt) == "f32" || std::string(fmt) == "f16";
        for (int threads : {1, 2, 3}) {
          ThreadPool pool(threads);
          for (int parts : {1, 2, 3, 4, 7}) {
            AlignedBuf<float> sc(attn_split_scratch_floats(*kc, *vc, n_q, bt, parts));
            std::fill(out.begin(), out.end(), NAN);
            attn_decode_split(*kc, *vc, 0, q.data(), n_q, spans.data(), n_blocks, tk.data(), tv.data(), hd, n_tail,
                              ap, out.data(), sc.data(), pool, parts);
            for (size_t i = 0; i < out.size(); ++i) {
              ASSERT_TRUE(std::isfinite(out[i])) << fmt;
              // Single pass vs split: same kernels, merge rounding only.
              ASSERT_NEAR(out[i], one[i], 2e-5 * (1 + vmax))
                  << fmt << " pattern " << int(pat) << " tail " << n_tail << " threads " << threads << " parts " << parts;
              if (float_fmt) {
                ASSERT_NEAR(out[i], ref[i], 2e-5 * (1 + vmax))
                    << fmt << " pattern " << int(pat) << " tail " << n_tail << " threads " << threads << " parts " << parts;
              }
            }
          }
        }
      }
    }
  }
}

// The engine's decode split: KvCache::attend_head_part over parts that tile the visible tokens,
// merged by attn_merge_parts, gives attend_head's result, over pages, with a sliding window and
// with a grouped format's f32 tail (kivi4 keys: the newest tokens are not yet quantized), for cuts
// at and off page boundaries, an empty part, and a last part that holds nothing (the tail starts
// in the part before it). Values in f16, so that the parts differ by the merge's rounding alone:
// an integer-dot weighted sum also rounds each part's weights to its own steps (the merge of such
// parts is attn_decode_split's, tested above against one pass).
TEST(Attention, KvCacheAttendHeadPartsMatchSinglePass) {
  const int hd = 64, n_q = 2, n_tok = 3000;
  for (const char* fmt : {"f16", "q4_0/f16", "kivi4/f16"}) {
    KvCacheConfig c;
    c.n_layer = 1;
    c.n_kv_heads = 2;
    c.head_dim = hd;
    c.page_tokens = 64;
    c.max_tokens = 4096;
    c.policy = kv_policy_uniform(fmt, c.n_layer);
    c.rope.assign(1, KvRope{hd, 10000.f, 1.f, false});
    c.model_id = "synthetic";
    KvCache cache(c);
    std::mt19937 rng(5);
    std::normal_distribution<float> nd;
    std::vector<float> k(size_t(n_tok) * 2 * hd), v(k.size()), q(size_t(n_q) * hd);
    for (auto& x : k) x = nd(rng);
    for (auto& x : v) x = nd(rng);
    for (auto& x : q) x = nd(rng);
    cache.append(0, n_tok, k.data(), k.data(), v.data());
    cache.commit(n_tok);
    std::vector<float> one(size_t(n_q) * hd), merged(one.size()), scratch(cache.attend_scratch_floats(n_q));
    std::vector<KvBlockSpan> spans;
    AttnParams ap;
    ap.scale = 0.125f;
    for (int window : {0, 2500}) {
      const int vis = KvCache::visible_tokens(n_tok - 1, window);
      ASSERT_EQ(vis, window ? window : n_tok);
      const std::vector<std::vector<int>> cuts = {
          {0, vis}, {0, 1024, vis}, {0, 1000, vis}, {0, 700, 700, 1800, vis}, {0, 1500, vis - 10, vis}};
      for (int h = 0; h < 2; ++h) {
        cache.attend_head(0, h, n_tok - 1, q.data(), n_q, ap, window, one.data(), scratch.data(), spans);
        for (const auto& cut : cuts) {
          const int np = int(cut.size()) - 1;
          std::vector<std::vector<float>> parts(size_t(np), std::vector<float>(cache.attend_part_floats(n_q)));
          std::vector<const float*> ptr;
          for (int p = 0; p < np; ++p) {
            cache.attend_head_part(0, h, n_tok - 1, q.data(), n_q, ap, window, cut[size_t(p)], cut[size_t(p) + 1],
                                   parts[size_t(p)].data(), scratch.data(), spans);
            ptr.push_back(parts[size_t(p)].data());
          }
          attn_merge_parts(ptr.data(), np, n_q, hd, merged.data());
          for (size_t i = 0; i < one.size(); ++i)
            ASSERT_NEAR(merged[i], one[i], 2e-5) << fmt << " window " << window << " head " << h << " parts " << np;
        }
      }
    }
  }
}

// attn_balance_pieces: every item's pieces tile its tokens in order, threads never go backwards,
// and the cuts fall where the shares say unless a side would be shorter than min_piece.
TEST(Attention, BalancePiecesTileItemsAndBalanceThreads) {
  using P = std::vector<AttnPiece>;
  auto same = [](const P& a, const P& b) {
    if (a.size() != b.size()) return false;
    for (size_t i = 0; i < a.size(); ++i)
      if (a[i].item != b[i].item || a[i].from != b[i].from || a[i].to != b[i].to || a[i].thread != b[i].thread)
        return false;
    return true;
  };
  {  // 3 heads on 2 threads (SmolLM2): the middle head is cut in half
    const int t[] = {8000, 8000, 8000};
    EXPECT_TRUE(same(attn_balance_pieces(t, 3, 2, 1024), P{{0, 0, 8000, 0}, {1, 0, 4000, 0}, {1, 4000, 8000, 1}, {2, 0, 8000, 1}}));
  }
  {  // one head on 2 threads (Gemma 3)
    const int t[] = {3000};
    EXPECT_TRUE(same(attn_balance_pieces(t, 1, 2, 1024), P{{0, 0, 1500, 0}, {0, 1500, 3000, 1}}));
    // on 4 threads the quarter cuts would leave 750 tokens: they move onto the start and the half
    EXPECT_TRUE(same(attn_balance_pieces(t, 1, 4, 1024), P{{0, 0, 1500, 1}, {0, 1500, 3000, 3}}));
    // 5000 tokens on 8 threads: eighths of 625 would be too short; cuts move onto earlier ones
    const int u[] = {5000};
    const P p8 = attn_balance_pieces(u, 1, 8, 1024);
    ASSERT_FALSE(p8.empty());
    for (const AttnPiece& pc : p8) EXPECT_GE(pc.to - pc.from, 1024) << pc.from;
  }
  {  // a half cut would leave 1023 tokens on one side: not cut
    const int t[] = {2047};
    EXPECT_TRUE(same(attn_balance_pieces(t, 1, 2, 1024), P{{0, 0, 2047, 0}}));
  }
  {  // short items: whole, two per thread
    const int t[] = {100, 100, 100, 100};
    EXPECT_TRUE(same(attn_balance_pieces(t, 4, 2, 1024), P{{0, 0, 100, 0}, {1, 0, 100, 0}, {2, 0, 100, 1}, {3, 0, 100, 1}}));
  }
  {  // one long document beside short chats
    const int t[] = {200, 12000, 300};
    EXPECT_TRUE(same(attn_balance_pieces(t, 3, 2, 1024), P{{0, 0, 200, 0}, {1, 0, 6050, 0}, {1, 6050, 12000, 1}, {2, 0, 300, 1}}));
  }
  {  // min_piece beyond any item (batch-invariant decode): whole items only, the cut at the
     // nearer item end (a tie: the earlier one)
    const int t[] = {8000, 8000, 8000}, u[] = {6000, 9000, 8000};
    EXPECT_TRUE(same(attn_balance_pieces(t, 3, 2, std::numeric_limits<int>::max()),
                     P{{0, 0, 8000, 0}, {1, 0, 8000, 1}, {2, 0, 8000, 1}}));
    EXPECT_TRUE(same(attn_balance_pieces(u, 3, 2, std::numeric_limits<int>::max()),
                     P{{0, 0, 6000, 0}, {1, 0, 9000, 0}, {2, 0, 8000, 1}}));
  }
  EXPECT_TRUE(attn_balance_pieces(nullptr, 0, 2, 1024).empty());
  // Random cases: the invariants.
  std::mt19937 rng(9);
  for (int trial = 0; trial < 500; ++trial) {
    const int n_items = 1 + int(rng() % 12), n_threads = 1 + int(rng() % 9), min_piece = int(rng() % 2000);
    std::vector<int> t(static_cast<size_t>(n_items));
    for (auto& x : t) x = rng() % 4 == 0 ? int(rng() % 50) : int(rng() % 20000);
    const P ps = attn_balance_pieces(t.data(), n_items, n_threads, min_piece);
    std::vector<int64_t> load(static_cast<size_t>(n_threads), 0);
    int item = -1, next_from = 0, last_thread = 0;
    for (const AttnPiece& pc : ps) {
      ASSERT_GE(pc.thread, last_thread);
      ASSERT_LT(pc.thread, n_threads);
      last_thread = pc.thread;
      if (pc.item != item) {
        ASSERT_EQ(pc.item, item + 1);
        if (item >= 0) {
          ASSERT_EQ(next_from, t[size_t(item)]);
        }
        item = pc.item;
        next_from = 0;
      }
      ASSERT_EQ(pc.from, next_from);
      ASSERT_TRUE(pc.to > pc.from || (pc.from == 0 && t[size_t(item)] == 0));
      if (pc.from > 0) {  // a cut leaves min_piece on both sides
        ASSERT_GE(pc.from, min_piece);
      }
      if (pc.to < t[size_t(item)]) {
        ASSERT_GE(t[size_t(item)] - pc.to, min_piece);
      }
      if (pc.from > 0 || pc.to < t[size_t(item)]) {  // a part of a cut item: never shorter either
        ASSERT_GE(pc.to - pc.from, min_piece);
      }
      next_from = pc.to;
      load[size_t(pc.thread)] += pc.to - pc.from;
    }
    ASSERT_EQ(item, n_items - 1);
    ASSERT_EQ(next_from, t[size_t(item)]);
    // A snapped cut moves by less than min_piece (the shorter side), so no thread carries more
    // than its share plus min_piece at each of its two ends.
    int64_t total = 0;
    for (int x : t) total += x;
    for (int64_t l : load) ASSERT_LE(l, total / n_threads + 1 + 2 * int64_t(min_piece)) << trial;
  }
}

// End to end: decode steps past 2048 tokens with more threads than (row, KV head) items take the
// split-K path in the engine (stories260K: 4 KV heads, 8 threads); their logits match a
// one-thread run (single pass) to float rounding.
TEST(Attention, EngineSplitKDecodeMatchesOneThread) {
  const std::string path = std::string(KVQ_SOURCE_DIR) + "/../shared/models/stories260K.gguf";
  if (!std::ifstream(path).good()) GTEST_SKIP() << "stories260K.gguf not found at " << path;
  auto m = Model::load(path);
  const int nv = m->config().n_vocab;
  for (const char* fmt : {"f16"}) {
    KvCacheConfig cfg = m->kv_cache_config(kv_policy_uniform(fmt, m->config().n_layer), 2048, 64);
    std::vector<int32_t> toks(2048);
    std::mt19937 rng(3);
    for (auto& t : toks) t = int32_t(3 + rng() % uint32_t(nv - 3));
    ThreadPool one(1), many(8);
    Forward f1(*m, one), f8(*m, many);
    KvCache c1(cfg), c8(cfg);
    f1.eval(toks.data(), 2046, c1);
    f8.eval(toks.data(), 2046, c8);
    for (int s = 2046; s < 2048; ++s) {  // contexts 2047 (one pass everywhere) and 2048 (split)
      const float* l1 = f1.eval(&toks[size_t(s)], 1, c1);
      const std::vector<float> a(l1, l1 + nv);
      const float* l8 = f8.eval(&toks[size_t(s)], 1, c8);
      float amax = 0;
      for (float v : a) amax = std::max(amax, std::fabs(v));
      for (int i = 0; i < nv; ++i) ASSERT_NEAR(l8[i], a[size_t(i)], 1e-4f * (1 + amax)) << fmt << " step " << s;
    }
  }
}

// Prefill: KvCache::attend_rows (rows of one step batched per block, causal limits per row) gives
// each row what attend_head gives it, for every format, with and without a window, with rows
// before and inside the step, grouped codecs' tails included.
TEST(Attention, KvCacheAttendRowsMatchesAttendHead) {
  const CpuLevel saved = cpu_set_level(CpuLevel::avx512);
  for (CpuLevel lvl : {CpuLevel::scalar, CpuLevel::avx2, CpuLevel::avx512}) {
  cpu_set_level(lvl);
  for (const auto& f : kv_formats()) {
    for (int hd : {64, 256}) {
      if (lvl != CpuLevel::avx512 && hd != 64) continue;  // the other levels: one shape
      const int n_q = hd == 64 ? 3 : 4, n_kv = 2, n0 = 203, n1 = 37;
      KvCacheConfig c;
      c.n_layer = 1;
      c.n_kv_heads = n_kv;
      c.head_dim = hd;
      c.page_tokens = 64;
      c.max_tokens = 512;
      c.policy = kv_policy_uniform(f.name, c.n_layer);
      c.rope.assign(1, KvRope{hd, 10000.f, 1.f, false});
      c.model_id = "synthetic";
      std::unique_ptr<KvCache> cache;
      try {
        cache = std::make_unique<KvCache>(c);
      } catch (const Error&) {
        continue;  // a codec that does not take this head_dim
      }
      std::mt19937 rng(11);
      std::normal_distribution<float> nd;
      std::vector<float> k(size_t(n0 + n1) * n_kv * hd), v(k.size()), q(size_t(n1) * n_q * hd);
      for (auto& x : k) x = nd(rng);
      for (auto& x : v) x = nd(rng);
      for (auto& x : q) x = nd(rng);
      const size_t row = size_t(n_kv) * hd;
      cache->append(0, n0, k.data(), k.data(), v.data());
      cache->commit(n0);
      cache->append(0, n1, k.data() + n0 * row, k.data() + n0 * row, v.data() + n0 * row);
      std::vector<float> batched(q.size()), one(size_t(n_q) * hd);
      std::vector<float> sb(cache->attend_scratch_floats(n_q * n1)), s1(cache->attend_scratch_floats(n_q));
      std::vector<KvBlockSpan> spans;
      AttnParams ap;
      ap.scale = 1.f / std::sqrt(float(hd));
      ap.prefetch_blocks = false;
      for (int window : {0, 100}) {
        for (int h = 0; h < n_kv; ++h) {
          cache->attend_rows(0, h, n0, n1, q.data(), n_q, ap, window, batched.data(), sb.data(), spans);
          double worst = 0;
          for (int r = 0; r < n1; ++r) {
            cache->attend_head(0, h, n0 + r, q.data() + size_t(r) * n_q * hd, n_q, ap, window, one.data(), s1.data(), spans);
            for (size_t i = 0; i < one.size(); ++i)
              worst = std::max(worst, double(std::fabs(batched[size_t(r) * n_q * hd + i] - one[i])));
          }
          EXPECT_LE(worst, 0.0) << f.name << " hd " << hd << " window " << window << " head " << h << " cpu "
                                << cpu_level_name(lvl);
        }
      }
    }
  }
  }
  cpu_set_level(saved);
}

// Attention sinks (gpt-oss): a logit per query head in the softmax's denominator with no value.
// By hand on one token (score s, value v: out = v e^s / (e^s + e^sink)); against the double
// reference for a float and a packed format over spans and tail, from a sink far below the scores
// (no effect) to one far above (out -> 0); one pass, split-K parts, prefill rows and the KV cache's
// per-head share of the layer's sinks all agree.
TEST(Attention, SinksJoinTheSoftmaxDenominator) {
  {  // one token by hand
    KvCodecParams p;
    p.head_dim = 32;
    auto kc = kv_codec_create("f32", p);
    std::vector<float> q(32, 0.f), tk(32, 0.f), tv(32), out(32);
    q[0] = 2.f;
    tk[0] = 0.75f;  // score 1.5 at scale 1
    for (int d = 0; d < 32; ++d) tv[size_t(d)] = float(d) - 10.f;
    AlignedBuf<float> scratch(attn_scratch_floats(*kc, *kc, 1, 0));
    for (float sink : {-1e30f, -3.f, 0.f, 1.5f, 4.f}) {
      AttnParams ap;
      ap.sinks = &sink;
      attn_decode(*kc, *kc, 0, q.data(), 1, nullptr, 0, tk.data(), tv.data(), 32, 1, ap, out.data(), scratch.data());
      const double w = std::exp(1.5) / (std::exp(1.5) + std::exp(double(sink)));
      for (int d = 0; d < 32; ++d) EXPECT_NEAR(out[size_t(d)], w * tv[size_t(d)], 1e-5 * (1 + std::fabs(tv[size_t(d)]))) << sink;
    }
    // nothing to attend to: zeros, sink or not
    float sink = 1.f;
    AttnParams ap;
    ap.sinks = &sink;
    attn_decode(*kc, *kc, 0, q.data(), 1, nullptr, 0, nullptr, nullptr, 32, 0, ap, out.data(), scratch.data());
    for (float v : out) EXPECT_EQ(v, 0.f);
  }
  const int hd = 64, bt = 64, n_blocks = 40, n_q = 4;  // 2560 tokens: split-K parts of >= 1024
  for (const char* fmt : {"f32", "q4_0", "int8"}) {
    SCOPED_TRACE(fmt);
    const KvFormatDesc& f = kv_format_find(fmt);
    KvCodecParams pk, pv;
    pk.head_dim = pv.head_dim = hd;
    pk.role = KvRole::key;
    pv.role = KvRole::value;
    auto kc = kv_codec_create(f.k_codec, pk);
    auto vc = kv_codec_create(f.v_codec, pv);
    std::mt19937 rng(17);
    std::normal_distribution<float> nd;
    std::vector<float> q(size_t(n_q) * hd);
    for (auto& x : q) x = nd(rng);
    std::vector<std::vector<uint8_t>> kb(n_blocks), vb(n_blocks);
    std::vector<float> kr(size_t(bt) * hd), vr(kr.size());
    std::vector<KvBlockSpan> spans;
    for (int b = 0; b < n_blocks; ++b) {
      for (auto& x : kr) x = nd(rng);
      for (auto& x : vr) x = nd(rng);
      kb[size_t(b)].resize(kc->block_bytes(bt));
      vb[size_t(b)].resize(vc->block_bytes(bt));
      kc->encode(0, kr.data(), hd, bt, kb[size_t(b)].data(), bt, 0, b * bt);
      vc->encode(0, vr.data(), hd, bt, vb[size_t(b)].data(), bt, 0, b * bt);
      spans.push_back({kb[size_t(b)].data(), vb[size_t(b)].data(), bt, 0, bt, b * bt});
    }
    std::vector<float> tk(5 * hd), tv(5 * hd);
    for (auto& x : tk) x = nd(rng);
    for (auto& x : tv) x = nd(rng);
    AttnParams plain;
    plain.scale = 1.f / std::sqrt(float(hd));
    std::vector<float> none(size_t(n_q) * hd), ref(none.size()), one(none.size()), split(none.size());
    AlignedBuf<float> s1(attn_scratch_floats(*kc, *vc, n_q, bt));
    attn_decode(*kc, *vc, 0, q.data(), n_q, spans.data(), n_blocks, tk.data(), tv.data(), hd, 5, plain, none.data(), s1.data());
    for (const std::vector<float>& sinks :
         {std::vector<float>{-1e30f, -1e30f, -1e30f, -1e30f}, std::vector<float>{0.f, 1.f, 2.f, 3.f},
          std::vector<float>{-2.f, 8.f, 0.5f, 5.f}, std::vector<float>{200.f, 200.f, 200.f, 200.f}}) {
      AttnParams ap = plain;
      ap.sinks = sinks.data();
      attn_decode_ref(*kc, *vc, 0, q.data(), n_q, spans.data(), n_blocks, tk.data(), tv.data(), hd, 5, ap, ref.data());
      attn_decode(*kc, *vc, 0, q.data(), n_q, spans.data(), n_blocks, tk.data(), tv.data(), hd, 5, ap, one.data(), s1.data());
      ThreadPool pool(2);
      AlignedBuf<float> sc(attn_split_scratch_floats(*kc, *vc, n_q, bt, 2));
      attn_decode_split(*kc, *vc, 0, q.data(), n_q, spans.data(), n_blocks, tk.data(), tv.data(), hd, 5, ap, split.data(),
                        sc.data(), pool, 2);
      double vmax = 0, changed = 0;
      for (float v : ref) vmax = std::max(vmax, double(std::fabs(v)));
      const double tol = std::string(fmt) == "f32" ? 2e-5 : 0.05;  // packed formats: their own quantization error
      for (size_t i = 0; i < one.size(); ++i) {
        ASSERT_NEAR(one[i], ref[i], tol * (1 + vmax)) << "sinks " << sinks[i / hd];
        ASSERT_NEAR(split[i], one[i], 2e-5 * (1 + vmax)) << "sinks " << sinks[i / hd];
        changed = std::max(changed, double(std::fabs(one[i] - none[i])));
        if (sinks[0] == 200.f) {
          ASSERT_EQ(one[i], 0.f);  // the sink takes all the mass
        }
        if (sinks[0] == -1e30f) {
          ASSERT_EQ(one[i], none[i]);
        }
      }
      if (sinks[0] == 0.f) {
        EXPECT_GT(changed, 1e-4);
      }
    }
  }
  // KvCache: KV head h takes sinks [h n_q, (h + 1) n_q) of the layer's; prefill rows and decode
  // split parts merged with that share agree with attend_head.
  KvCacheConfig c;
  c.n_layer = 1;
  c.n_kv_heads = 2;
  c.head_dim = hd;
  c.page_tokens = 64;
  c.max_tokens = 4096;
  c.policy = kv_policy_uniform("f16", 1);
  c.rope.assign(1, KvRope{hd, 10000.f, 1.f, false});
  c.model_id = "synthetic";
  KvCache cache(c);
  std::mt19937 rng(23);
  std::normal_distribution<float> nd;
  const int n0 = 2500, n1 = 20, nq = 2;
  std::vector<float> k(size_t(n0 + n1) * 2 * hd), v(k.size()), q(size_t(n1) * nq * hd);
  for (auto& x : k) x = nd(rng);
  for (auto& x : v) x = nd(rng);
  for (auto& x : q) x = nd(rng);
  const size_t row = size_t(2) * hd;
  cache.append(0, n0, k.data(), k.data(), v.data());
  cache.commit(n0);
  cache.append(0, n1, k.data() + n0 * row, k.data() + n0 * row, v.data() + n0 * row);
  const std::vector<float> layer_sinks = {0.5f, 2.f, -1.f, 4.f};  // (KV head, query)
  AttnParams ap;
  ap.scale = 0.125f;
  ap.prefetch_blocks = false;
  ap.sinks = layer_sinks.data();
  std::vector<float> rows(q.size()), one(size_t(nq) * hd), own(one.size()), merged(one.size());
  std::vector<float> sb(cache.attend_scratch_floats(nq * n1)), s1(cache.attend_scratch_floats(nq));
  std::vector<KvBlockSpan> sp;
  for (int h = 0; h < 2; ++h) {
    cache.attend_rows(0, h, n0, n1, q.data(), nq, ap, 0, rows.data(), sb.data(), sp);
    for (int r = 0; r < n1; r += 7) {
      const float* qr = q.data() + size_t(r) * nq * hd;
      cache.attend_head(0, h, n0 + r, qr, nq, ap, 0, one.data(), s1.data(), sp);
      for (size_t i = 0; i < one.size(); ++i) ASSERT_EQ(rows[size_t(r) * nq * hd + i], one[i]) << "head " << h << " row " << r;
      // the same head's sinks given directly to attn_decode's level: only head h's share is read
      AttnParams mine = ap;
      std::vector<float> share(layer_sinks.begin() + h * nq, layer_sinks.begin() + (h + 1) * nq);
      std::vector<float> shifted(size_t(2 * nq), -1e30f);
      std::copy(share.begin(), share.end(), shifted.begin() + h * nq);
      mine.sinks = shifted.data();
      cache.attend_head(0, h, n0 + r, qr, nq, mine, 0, own.data(), s1.data(), sp);
      for (size_t i = 0; i < one.size(); ++i) ASSERT_EQ(own[i], one[i]);
      std::vector<std::vector<float>> parts(2, std::vector<float>(cache.attend_part_floats(nq)));
      const int vis = n0 + r + 1;
      cache.attend_head_part(0, h, n0 + r, qr, nq, ap, 0, 0, 1200, parts[0].data(), s1.data(), sp);
      cache.attend_head_part(0, h, n0 + r, qr, nq, ap, 0, 1200, vis, parts[1].data(), s1.data(), sp);
      const float* ptr[2] = {parts[0].data(), parts[1].data()};
      attn_merge_parts(ptr, 2, nq, hd, merged.data(), share.data());
      for (size_t i = 0; i < one.size(); ++i) ASSERT_NEAR(merged[i], one[i], 2e-5) << "head " << h << " row " << r;
    }
  }
}
