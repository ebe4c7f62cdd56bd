// `kvq formats`: every registered KV format with its codecs, bits per element (codes + scales +
// zeros + norms, the residual window of grouped codecs amortized at `ctx`), and optionally the
// measured distortion of its codecs on random unit vectors.
#pragma once
#include <cstdio>

namespace kvq {

struct FormatsOptions {
  bool distortion = false;  // also measure MSE and inner-product error per codec (slower)
  int dim = 128;            // head_dim the codecs are built for
  int trials = 1000;        // random unit vectors per codec for distortion
  bool json = false;        // JSON instead of a table
  int ctx = 4096;           // context length at which the residual window is amortized
  int block_tokens = 64;    // page size (head block tokens)
  unsigned seed = 1;        // RNG seed of the distortion vectors
};

// Writes the listing to `out`; returns the process exit code (0). Throws kvq::Error on invalid
// options (dim, trials, ctx, block_tokens out of range).
int formats_command(const FormatsOptions& opt, std::FILE* out);

}  // namespace kvq
