// Mixed-precision KVQuant keys: fractional bits per element by giving RoPE pairs different code
// widths, the most important pairs of each head the wider codes.
//
// A key's quantization error reaches the score as <q, R(t) dk>; RoPE turns each pair (a, b) of
// channels as a unit, so with independent errors the expected squared score error is
//   sum over pairs of E|q_pair|^2 * E|dk_pair|^2 / 2,   E|dk_pair|^2 ~ (range_a^2 + range_b^2) 4^-bits.
// Pair weights w = E|q_pair|^2 (range_a^2 + range_b^2) are far from uniform on real models (a few
// low-frequency pairs carry most of it), so spending the extra bit where w is largest removes much
// more error than its share of the bits: on SmolLM2-135M, half the pairs at 4 bits and half at 3
// leave 1.35x the squared score error of 4 bits everywhere, where 3 bits everywhere leave 4x.
//
// Format kvquant<X>_k, X = 2.25 .. 3.75 in quarters (not 3): a quarter-multiple share
// f = X - floor(X) of each head's pairs at floor(X) + 1 bits, the rest at floor(X) bits. Each
// width is one KVQuant key part (kvquant.h: per-channel nuq codes before RoPE, the group's f16
// scale and mid per channel, exact sink rows) over its pairs, laid out in NeoX order with the
// pairs' own angle rates; the head block is the parts' blocks one after the other. Scores add
// the parts' fused scores; decode scatters the parts back to channel order. Dense-and-sparse
// outliers (k per token) are kept by the narrowest part, where they save the most.
//
// Which pairs are wide, per head: from the calibration ("kvquant_pair_weight" of `kvq calibrate`,
// the weights above with ranges over groups of 32 tokens), else the lowest-frequency pairs (the
// channels RoPE leaves alone count as pairs of rate 0), which carry most of the weight on the
// models measured (bench/QUALITY.md).
#pragma once
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kvq/kv_format.h"

namespace kvq {

void kv_register_kvquant_mixed();

// The RoPE pairs of a head_dim-channel key: the n_rot / 2 rotated pairs in RoPE's order (adjacent
// or NeoX), then the unrotated channels n_rot.. paired as (n_rot + 2m, n_rot + 2m + 1), rate 0.
struct KvRopePair {
  int a, b;
  double theta;
};
std::vector<KvRopePair> kv_rope_pairs(const KvRope& r, int head_dim);

struct KvquantMixedConfig {
  std::string name = "kvquant3.5_k";
  int head_dim = 128;
  int n_kv_heads = 1;
  KvRope rope;
  // Parts, widest first: bits[i] codes for pairs[i] pairs of each head (pairs sum to head_dim / 2).
  std::vector<int> bits, pairs;
  int group_tokens = 32;
  int residual_tokens = 0;
  int sink_tokens = 1;
  int outliers_per_token = -1;  // -1: ceil(1% of head_dim); kept by the narrowest part (at most its channels / 8)
  std::vector<std::vector<float>> codebooks;  // per part (empty entry: the default for its bits)
  // (n_kv_heads, head_dim / 2) pair weights in kv_rope_pairs order; empty: by rate, lowest first.
  std::vector<std::vector<float>> pair_weight;
};

// Throws kvq::Error on invalid parameters.
std::unique_ptr<KvCodec> kvquant_mixed_key_codec_create(const KvquantMixedConfig& cfg);

// Which pairs of each head go to which part: part_of[h][j] = part index of pair j (kv_rope_pairs
// order), the pairs of largest weight (ties: lower rate, then higher index) to the widest part.
std::vector<std::vector<int>> kvquant_mixed_assign(const KvquantMixedConfig& cfg);

// The pair weights of one layer from calibration data: keys_pre_rope (n_tokens, n_kv_heads,
// head_dim) in consecutive sequences of window_tokens tokens (0: one sequence); q_ms
// (n_kv_heads, head_dim): mean squares of the queries (a KV head's query heads pooled). Per head
// and pair, E|q_pair|^2 times the mean over groups of group_tokens tokens (each sequence's first
// sink_tokens left out) of the squared half-ranges of the pair's two channels. Returns
//   {"kvquant_pair_weight": [[head_dim / 2] x n_kv_heads]}
// Throws kvq::Error on invalid shapes or non-finite input.
nlohmann::json kvquant_pair_weights(const float* keys_pre_rope, int n_tokens, int n_kv_heads, int head_dim,
                                    const KvRope& rope, const std::vector<double>& q_ms, int group_tokens,
                                    int sink_tokens, int window_tokens);

}  // namespace kvq
