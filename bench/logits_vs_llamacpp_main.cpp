// kvq's next-token distributions against llama.cpp's on the same GGUF and the same tokens, token by
// token: the file `llama-perplexity -m MODEL -f TEXT -c CTX --chunks N --kl-divergence-base FILE`
// writes (its tokens, and per chunk the log-probabilities of the second half of the window, 16-bit
// quantized over the top 16 nats) is read, kvq runs each window of those tokens (BOS first where
// the model adds one, as llama-perplexity does), and per scored token compares, as
// `llama-perplexity --kl-divergence` computes them from that file:
//   KLD(llama.cpp || kvq) (mean, p99), top-1 agreement, and each engine's perplexity.
// The reference point for "as close as two engines get" is kvq against itself with one change of
// rounding (--self): its logits with an f32 cache, stored as llama.cpp stores its own, against
// the default f16 cache on the same tokens.
//
//   logits_vs_llamacpp MODEL.gguf LLAMA_LOGITS_FILE [--kv f16] [--threads 2] [--self]
//                      [--rope-scaling KIND --rope-scale F --yarn-orig-ctx N]
// (the RoPE flags as given to llama-perplexity, for models run with another RoPE scaling)
//
// llama.cpp is not part of kvq: its llama-perplexity is built separately.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "cache/kv_cache.h"
#include "core/error.h"
#include "model/model.h"
#include "model/tokenizer.h"

using namespace kvq;

namespace {

struct Stats {
  std::vector<double> kld;
  int agree = 0, n = 0;
  double nll_a = 0, nll_b = 0;
  void print(const char* what) const {
    std::vector<double> k = kld;
    std::sort(k.begin(), k.end());
    double mean = 0;
    for (double x : k) mean += x;
    mean /= double(std::max<size_t>(k.size(), 1));
    const double p99 = k.empty() ? 0 : k[std::min(k.size() - 1, size_t(0.99 * double(k.size())))];
    std::printf("%-34s tokens %6d  KLD mean %.6f p99 %.6f  top-1 agree %6.2f%%  PPL %.4f vs %.4f (ratio %.4f)\n", what, n,
                mean, p99, 100.0 * agree / std::max(n, 1), std::exp(nll_a / n), std::exp(nll_b / n),
                std::exp((nll_b - nll_a) / n));
  }
};

// A row as llama-perplexity --kl-divergence-base stores it: scale and min_log_prob as two floats
// (four uint16), then each token's log-probability over the 16 nats below the top, 16-bit.
void encode_row(const float* l, int nv, std::vector<uint16_t>& row) {
  float mx = l[0], mn = l[0];
  for (int i = 1; i < nv; ++i) {
    mx = std::max(mx, l[i]);
    mn = std::min(mn, l[i]);
  }
  mn = std::max(mn, mx - 16);
  double se = 0;
  for (int i = 0; i < nv; ++i) se += std::exp(l[i] - mx);
  const float lse = float(std::log(se)), min_lp = mn - mx - lse, scale = (mx - mn) / 65535.f;
  row.assign(size_t(2 * ((nv + 1) / 2) + 4), 0);
  std::memcpy(row.data(), &scale, 4);
  std::memcpy(row.data() + 2, &min_lp, 4);
  if (scale > 0)
    for (int i = 0; i < nv; ++i)
      row[size_t(4 + i)] = l[i] > mn ? uint16_t(std::lround((1 / scale) * (l[i] - mn))) : 0;
}

// KLD(reference row || logits), top-1 agreement and both negative log-likelihoods, computed as
// llama-perplexity --kl-divergence computes them from such a row: tokens within 16 nats of the
// top enter the KLD, the reference's log-probabilities are used as stored.
void compare(const uint16_t* row, const float* l, int nv, int next, Stats& st) {
  float scale, min_lp;
  std::memcpy(&scale, row, 4);
  std::memcpy(&min_lp, row + 2, 4);
  const uint16_t* v = row + 4;
  int imax = 0;
  for (int i = 1; i < nv; ++i)
    if (l[i] > l[imax]) imax = i;
  double se = 0;
  for (int i = 0; i < nv; ++i) se += std::exp(double(l[i]) - l[imax]);
  const double lse = double(l[imax]) + std::log(se);
  double kld = 0;
  int ibase = 0;
  for (int i = 0; i < nv; ++i) {
    const double lb = double(scale) * v[i] + min_lp;
    if (lb > double(scale) * v[ibase] + min_lp) ibase = i;
    if (lb > -16) kld += std::exp(lb) * (lb - (double(l[i]) - lse));
  }
  st.kld.push_back(kld);
  st.agree += imax == ibase;
  st.nll_a -= double(scale) * v[next] + min_lp;
  st.nll_b += lse - l[next];
  ++st.n;
}

std::vector<float> run_window(const Model& m, ThreadPool& pool, const std::string& kv, const std::vector<int32_t>& win) {
  KvCache cache(m.kv_cache_config(kv_policy_uniform(kv, m.config().n_layer), int(win.size())));
  Forward f(m, pool, 512);
  const float* l = f.eval(win.data(), int(win.size()), cache, true);
  return std::vector<float>(l, l + win.size() * size_t(m.config().n_vocab));
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc < 3)
      fail("usage: logits_vs_llamacpp MODEL.gguf LLAMA_LOGITS_FILE [--kv f16] [--threads 2] [--self] "
           "[--rope-scaling KIND --rope-scale F --yarn-orig-ctx N]");
    std::string kv = "f16";
    int threads = 2;
    bool self = false;
    RopeOverrides rope;
    for (int i = 3; i < argc; ++i) {
      const std::string a = argv[i];
      if (a == "--kv" && i + 1 < argc) kv = argv[++i];
      else if (a == "--rope-scaling" && i + 1 < argc) rope.scaling = argv[++i];
      else if (a == "--rope-scale" && i + 1 < argc) rope.scale = std::stod(argv[++i]);
      else if (a == "--yarn-orig-ctx" && i + 1 < argc) rope.yarn_orig_ctx = std::stoi(argv[++i]);
      else if (a == "--threads" && i + 1 < argc) threads = std::stoi(argv[++i]);
      else if (a == "--self") self = true;
      else fail("unknown argument '{}'", a);
    }
    std::ifstream in(argv[2], std::ios::binary);
    if (!in) fail("{}: cannot open", argv[2]);
    char magic[8];
    int32_t n_ctx = 0, n_vocab = 0, n_chunk = 0;
    in.read(magic, 8);
    in.read(reinterpret_cast<char*>(&n_ctx), 4);
    in.read(reinterpret_cast<char*>(&n_vocab), 4);
    in.read(reinterpret_cast<char*>(&n_chunk), 4);
    if (!in || std::memcmp(magic, "_logits_", 8) != 0 || n_ctx < 4 || n_vocab < 2 || n_chunk < 1)
      fail("{}: not a llama-perplexity --kl-divergence-base file", argv[2]);
    std::vector<int32_t> tokens(size_t(n_chunk) * size_t(n_ctx));
    in.read(reinterpret_cast<char*>(tokens.data()), std::streamsize(tokens.size() * 4));
    auto model = Model::load(argv[1], rope);
    model->set_context(n_ctx);
    const Tokenizer tok = Tokenizer::from_gguf(model->file());
    if (model->config().n_vocab != n_vocab) fail("vocabulary sizes differ: kvq {}, file {}", model->config().n_vocab, n_vocab);
    ThreadPool pool(threads);
    const int first = n_ctx / 2, nvq = 2 * ((n_vocab + 1) / 2) + 4;
    std::vector<uint16_t> row(static_cast<size_t>(nvq)), self_row;
    Stats vs_llama, vs_self;
    for (int c = 0; c < n_chunk; ++c) {
      std::vector<int32_t> win(tokens.begin() + ptrdiff_t(c) * n_ctx, tokens.begin() + ptrdiff_t(c + 1) * n_ctx);
      if (tok.add_bos()) win[0] = tok.bos();
      const std::vector<float> lg = run_window(*model, pool, kv, win);
      std::vector<float> ref;
      if (self) ref = run_window(*model, pool, "f32", win);
      for (int j = first; j < n_ctx - 1; ++j) {
        in.read(reinterpret_cast<char*>(row.data()), std::streamsize(row.size() * 2));
        if (!in) fail("{}: ends inside chunk {}", argv[2], c);
        const int next = tokens[size_t(c) * size_t(n_ctx) + size_t(j) + 1];
        const float* lk = lg.data() + size_t(j) * size_t(n_vocab);
        compare(row.data(), lk, n_vocab, next, vs_llama);
        if (self) {  // kvq's f32-cache logits stored as llama.cpp stores its own, then read alike
          encode_row(ref.data() + size_t(j) * size_t(n_vocab), n_vocab, self_row);
          compare(self_row.data(), lk, n_vocab, next, vs_self);
        }
      }
      std::fprintf(stderr, "\rchunk %d/%d", c + 1, n_chunk);
    }
    std::fprintf(stderr, "\n");
    vs_llama.print(("kvq " + kv + " vs llama.cpp").c_str());
    if (self) vs_self.print(("kvq " + kv + " vs kvq f32 KV").c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "logits_vs_llamacpp: %s\n", e.what());
    return 1;
  }
}
