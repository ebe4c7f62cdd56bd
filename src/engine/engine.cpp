#include "engine/engine.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <future>
#include <initializer_list>
#include <limits>
#include <optional>
#include <random>
#include <unordered_map>

#include "core/error.h"
#include "core/timer.h"
#include "model/draft.h"

namespace kvq {

void Histogram::observe(double v) {
  size_t i = 0;
  while (i < bounds.size() && v > bounds[i]) ++i;
  ++counts[i];
  sum += v;
  ++count;
}

struct Engine::Seq {
  uint64_t id = 0;
  GenRequest req;
  std::vector<int32_t> tokens;  // (prompt + generated) what the cache must end up holding
  int n_prompt = 0;
  std::unique_ptr<KvCache> cache;
  std::unique_ptr<Sampler> sampler;
  std::unique_ptr<TokenStreamDecoder> dec;
  std::string text;   // decoded generated text so far
  size_t sent = 0;    // bytes of text handed to on_text
  GenResult res;
  double t_submit = 0, t_last = 0;
  bool preempted = false, done = false;
  // Pages were read back from the offload tier for this admission (restore_offloaded reads once
  // per admission: a head that still waits for pages does not read them again every step if the
  // pool's pressure evicts them meanwhile; a preemption starts a new admission).
  bool restored = false;
  // Group-0 pages read back for this admission (chain position, page): counted as offload hits
  // when the admission adopts them.
  std::vector<std::pair<size_t, KvPageId>> restored_pages;
  // Chain hashes of the full pages of `tokens` (the prefix index's page_hash): two sequences
  // share their first k pages exactly when their first k keys are equal. Compared to find a
  // running sequence that is already computing the pages this one would compute (in-flight
  // prefix); the index still compares token ids before anything is adopted.
  std::vector<KvHash> keys;
  // JSON mode and structured output (GenParams::json_object, GenParams::grammar): the parse state
  // of the text generated so far, and the logits with the tokens that cannot come next masked.
  std::unique_ptr<GrammarState> grammar;
  std::vector<float> masked;
  // GenParams::lazy_grammars: the end of the text generated while none has triggered (the bytes a
  // trigger may have started in; cleared when one does)
  std::string lazy_text;
  bool lazy_settled = false;
  // EngineOptions::draft_max: this step's drafted tokens (appended to `tokens` while the step
  // runs), and how many the next step may draft
  std::vector<int32_t> drafts;
  int draft_len = 0;
  // GenParams::reasoning_budget, when it bounds something
  std::unique_ptr<ReasoningBudgetState> budget;
};

namespace {

// Full pages two sequences have in common (equal leading chain hashes).
size_t common_pages(const std::vector<KvHash>& a, const std::vector<KvHash>& b) {
  const size_t n = std::min(a.size(), b.size());
  size_t i = 0;
  while (i < n && a[i] == b[i]) ++i;
  return i;
}

}  // namespace

void Engine::update_keys(Seq& s) const {
  const size_t P = size_t(kcfg_.page_tokens);
  const size_t full = s.tokens.size() / P;
  while (s.keys.size() < full) {
    const KvHash parent = s.keys.empty() ? index_->root() : s.keys.back();
    s.keys.push_back(index_->page_hash(parent, s.tokens.data() + s.keys.size() * P));
  }
}

size_t Engine::inflight_pages(const Seq& s, size_t limit, size_t before) const {
  // Pages of s's prompt that a running sequence admitted before position `before` holds or is
  // computing (they will be published page by page as its prefill fills them).
  size_t best = 0;
  for (size_t k = 0; k < std::min(before, running_.size()); ++k) {
    const Seq& r = *running_[k];
    if (&r == &s || r.preempted || r.done) continue;
    best = std::max(best, std::min(limit, common_pages(s.keys, r.keys)));
  }
  return best;
}

size_t Engine::outstanding_pages(const std::function<bool(const Seq&)>& skip) const {
  // Pages the running sequences will still allocate for the tokens they hold: pages are taken
  // lazily, chunk by chunk, so admission must subtract what is already promised or it admits
  // every queued request at once. Pages an earlier-admitted sequence holds or is computing for
  // the same prefix are not counted again: they will be adopted, not allocated.
  size_t total = 0;
  for (size_t i = 0; i < running_.size(); ++i) {
    const Seq& r = *running_[i];
    if (r.preempted || r.done || (skip && skip(r))) continue;
    const int n = int(r.tokens.size()), pending = n - r.cache->n_tokens();
    const size_t own = r.cache->pages_at(n, std::min(pending, fwd_->max_batch()));
    const size_t inflight = inflight_pages(r, SIZE_MAX, i);
    const size_t covered =
        std::max(size_t(r.cache->n_pages()), r.cache->prefix_pages_kept(int(inflight), n, fwd_->max_batch()));
    if (own > covered) total += own - covered;
  }
  return total;
}

size_t Engine::active_running() const {
  return size_t(std::count_if(running_.begin(), running_.end(), [](const auto& r) { return !r->preempted && !r->done; }));
}

bool Engine::preempt_for(const Seq& head, size_t need) {
  const auto lower = [&head](const Seq& r) { return r.req.params.priority > head.req.params.priority; };
  // Would preempting every lower-priority sequence make room? The pages only they hold come back
  // (a prefix page another sequence shares stays), and what they were promised is no longer owed.
  std::unordered_map<KvPageId, int> refs;
  size_t victims = 0;
  for (const auto& r : running_)
    if (!r->preempted && !r->done && lower(*r)) {
      for (int g = 0; g < r->cache->n_groups(); ++g)
        for (KvPageId page : r->cache->block_table(g))
          if (page != kv_page_none) ++refs[page];
      ++victims;
    }
  if (victims == 0) return false;
  size_t freed = 0;
  for (const auto& [page, n] : refs) freed += pool_->refcount(page) == n;
  if (need + outstanding_pages(lower) > pool_->n_available() + freed) return false;
  if (active_running() - victims >= size_t(opt_.max_running)) return false;
  // Lowest priority first (running_ is in priority order: the back), until it fits.
  for (size_t j = running_.size(); j-- > 0;) {
    if (need + outstanding_pages() <= pool_->n_available() && active_running() < size_t(opt_.max_running)) break;
    Seq& r = *running_[j];
    if (r.preempted || r.done || !lower(r)) continue;
    preempt(j);
  }
  return need + outstanding_pages() <= pool_->n_available() && active_running() < size_t(opt_.max_running);
}

std::string gguf_fingerprint(const gguf::File& f) {
  // The file's size, its first MiB (the header, metadata and tensor table, and the first
  // tensors), 64 blocks of 4 KiB spread evenly over the rest, and its last 4 KiB: a change of
  // weights, quantization or metadata changes it (an edit that spares every sampled block does
  // not; the fingerprint names a file, it does not authenticate one).
  const uint8_t* p = f.image();
  const size_t n = f.image_size();
  std::vector<uint8_t> buf;
  const auto take = [&](size_t at, size_t len) {
    len = std::min(len, n - std::min(n, at));
    buf.insert(buf.end(), p + at, p + at + len);
  };
  const size_t head = std::min(n, size_t(1) << 20), block = 4096;
  take(0, head);
  if (n > head)
    for (int i = 0; i < 64; ++i) take(head + (n - head) / 64 * size_t(i), block);
  if (n > block) take(n - block, block);
  const uint64_t size = n;
  buf.insert(buf.end(), reinterpret_cast<const uint8_t*>(&size), reinterpret_cast<const uint8_t*>(&size) + 8);
  const KvHash h = kv_hash128(KvHashKey{0x6767756666707231ull, 0x6b76712d6d6f646cull, 3, 4}, buf.data(), buf.size());
  return fmt::format("gguf:{}:{:016x}{:016x}", n, h.hi, h.lo);
}

void Engine::restore_offloaded(Seq& s, int n, size_t outstanding) {
  // The longest prefix of s's first n tokens whose pages are cached in the pool or kept in the
  // offload tier: group 0 for every page, and each sliding group for the pages its window still
  // reads after the prefix (as PrefixIndex::lookup adopts them).
  const int P = kcfg_.page_tokens;
  const std::vector<int>& windows = index_->group_windows();
  const int G = int(windows.size());
  const size_t limit = std::min(s.keys.size(), size_t(std::max(0, n)) / size_t(P));
  const auto have = [&](size_t i, int g) {
    return index_->page_of(s.keys[i], g) != kv_page_none || offload_->contains(s.keys[i], g);
  };
  size_t k = 0;
  while (k < limit && have(k, 0)) ++k;
  const auto first_of = [&](size_t k, int g) { return size_t(kv_window_first_page(int(k) * P, windows[size_t(g)], P)); };
  const auto complete = [&](size_t k) {
    for (int g = 1; g < G; ++g)
      for (size_t i = first_of(k, g); i < k; ++i)
        if (!have(i, g)) return false;
    return true;
  };
  while (k > 0 && !complete(k)) --k;
  // What the prefix needs: pool pages to pin (idle ones would otherwise be evicted by the reads)
  // and pages to read back, in chain order.
  std::vector<std::pair<size_t, int>> missing;
  struct Held {
    size_t i;  // chain position
    int g;     // page group
    KvPageId page;
  };
  std::vector<Held> held;  // the pages in the pool, then those read back
  size_t idle_needed = 0;
  for (size_t i = 0; i < k; ++i)
    for (int g = 0; g < G; ++g) {
      if (g > 0 && i < first_of(k, g)) continue;
      const KvPageId p = index_->page_of(s.keys[i], g);
      if (p == kv_page_none) {
        missing.emplace_back(i, g);
        continue;
      }
      held.push_back({i, g, p});
      if (pool_->is_idle(p)) ++idle_needed;
    }
  if (missing.empty()) return;
  // Only when the request will be admitted with the prefix read back (the admission check that
  // follows: the pages for the rest of its prompt, plus every matched page that is idle, beside
  // what running sequences are promised); otherwise the reads would only evict other prefixes,
  // and the pages read could be evicted again before it is admitted.
  const int n_prompt = int(s.tokens.size()), step = fwd_->max_batch();
  const size_t total = s.cache->pages_at(n_prompt, std::min(step, n_prompt - int(k) * P));
  const size_t kept = s.cache->prefix_pages_kept(int(k), n_prompt, step);
  const size_t need = (total > kept ? total - kept : 0) + idle_needed + missing.size();
  if (need + outstanding > pool_->n_available()) return;
  const double t0 = now_seconds();
  for (const Held& h : held) pool_->ref(h.page);
  s.restored = true;
  for (const auto& [i, g] : missing) offload_->touch(s.keys[i], g);
  for (const auto& [i, g] : missing) {
    const KvHash parent = i == 0 ? index_->root() : s.keys[i - 1];
    const int32_t* toks = s.tokens.data() + i * size_t(P);
    const KvPageId page = pool_->alloc();
    if (page == kv_page_none) break;
    if (!offload_->load(s.keys[i], g, parent, toks, page) || !index_->restore(parent, toks, g, page)) {
      pool_->unref(page);  // not cached: back to the free list
      break;  // the prefix ends here
    }
    held.push_back({i, g, page});
    if (g == 0) s.restored_pages.emplace_back(i, page);
  }
  // Released as a sequence releases its pages (KvCache::release): deepest first, so that parents
  // stay the more recently used, and at each position the sliding groups' pages before group 0's,
  // so that they are evicted first (PrefixIndex: an entry matches only while its group-0 page is
  // cached).
  std::sort(held.begin(), held.end(), [](const Held& a, const Held& b) { return a.i != b.i ? a.i > b.i : a.g > b.g; });
  for (const Held& h : held) pool_->unref(h.page);
  restore_seconds_ += now_seconds() - t0;
}

std::vector<int> prefill_shares(const std::vector<int>& limits, const std::vector<int>& left, int budget,
                                int oldest_tokens) {
  std::vector<int> got(limits.size(), 0);
  if (limits.empty() || budget <= 0) return got;
  got[0] = std::min({limits[0], std::max(0, oldest_tokens), budget});
  budget -= got[0];
  std::vector<size_t> order(limits.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return left[a] - got[a] < left[b] - got[b]; });
  for (size_t i : order) {
    if (budget <= 0) break;
    const int more = std::min(limits[i] - got[i], budget);
    got[i] += more;
    budget -= more;
  }
  return got;
}

void StepTimeFit::observe(double d, double p, double seconds) {
  if (!(seconds >= 0) || !std::isfinite(seconds) || !std::isfinite(d) || !std::isfinite(p)) return;
  if (valid_) seconds = std::min(seconds, 3 * std::max(k_[0] + k_[1] * d + k_[2] * p, 1e-6));
  const double x[3] = {1.0, d, p};
  for (int i = 0; i < 3; ++i) {
    for (int j = 0; j < 3; ++j) s_[i][j] = forget_ * s_[i][j] + x[i] * x[j];
    r_[i] = forget_ * r_[i] + x[i] * seconds;
  }
  p_weight_ = forget_ * p_weight_ + (p > 0 ? 1.0 : 0.0);
  if (d + p > 0) {
    price_ = std::max(forget_ * price_, seconds / (d + p));
    fastest_ = fastest_ < 0 ? seconds : std::min(fastest_, seconds);
  }
  if (n_ < kMinSteps) ++n_;
  double k[3];
  if (solve(k)) {
    std::copy(k, k + 3, k_);
    valid_ = true;
  }
}

bool StepTimeFit::solve(double out[3]) const {
  if (n_ < kMinSteps || p_weight_ <= 1e-3) return false;
  // Normal equations over the coefficients in `use` (the others 0), with a weak penalty
  // mu (b - c)^2 that decides only the direction the steps leave open (decode units and prompt
  // units never seen apart).
  const auto fit = [&](std::initializer_list<int> coefficients) {
    const int n = int(coefficients.size());
    const int* use = coefficients.begin();
    double m[3][4] = {};
    for (int i = 0; i < n; ++i) {
      for (int j = 0; j < n; ++j) m[i][j] = s_[use[i]][use[j]];
      m[i][3] = r_[use[i]];
    }
    if (n == 3) {
      const double mu = 1e-6 * std::min(s_[1][1], s_[2][2]) + 1e-12;
      m[1][1] += mu;
      m[2][2] += mu;
      m[1][2] -= mu;
      m[2][1] -= mu;
    }
    double scale = 0;
    for (int i = 0; i < n; ++i) scale = std::max(scale, m[i][i]);
    for (int col = 0; col < n; ++col) {
      int piv = col;
      for (int i = col + 1; i < n; ++i)
        if (std::fabs(m[i][col]) > std::fabs(m[piv][col])) piv = i;
      if (std::fabs(m[piv][col]) <= 1e-12 * scale) return false;
      for (int j = 0; j < 4; ++j) std::swap(m[col][j], m[piv][j]);
      for (int i = 0; i < n; ++i) {
        if (i == col) continue;
        const double f = m[i][col] / m[col][col];
        for (int j = col; j < 4; ++j) m[i][j] -= f * m[col][j];
      }
    }
    out[0] = out[1] = out[2] = 0;
    for (int i = 0; i < n; ++i) out[use[i]] = m[i][3] / m[i][i];
    return true;
  };
  // A decode unit that takes less than none (noise while the decodes' count hardly varied) would
  // make steps with more decodes look cheaper: such a fit leaves decode units out.
  if (!fit({0, 1, 2}) || out[1] < 0) {
    if (!fit({0, 2})) return false;
  }
  if (!std::isfinite(out[0]) || !std::isfinite(out[1]) || !std::isfinite(out[2])) return false;
  // A prompt unit must be worth something next to the fixed cost: the steps' typical prompt
  // units at least a thousandth of it (a c of 1e-16 is the rounding of a direction the steps
  // left open, and would buy any budget).
  const double p_rms = std::sqrt(s_[2][2] / p_weight_);
  return out[2] > 0 && out[2] * p_rms > 1e-3 * std::max(out[0], 0.0);
}

bool StepTimeFit::coefficients(double out[3]) const {
  if (!valid_) return false;
  std::copy(k_, k_ + 3, out);
  return true;
}

double StepTimeFit::prefill_within(double d, double seconds) const {
  if (valid_) return std::max(0.0, (seconds - (k_[0] + k_[1] * d)) / k_[2]);
  if (!(price_ > 0)) return -1;
  return std::max(0.0, (seconds - std::max(fastest_, 0.0)) / price_ - d);
}

void engine_warn_ctx_capped(int ctx, int n_ctx_train) {
  if (ctx > n_ctx_train)
    std::fprintf(stderr, "[kvq] warning: --ctx-size %d is beyond the %d tokens the model was trained on; using %d\n",
                 ctx, n_ctx_train, n_ctx_train);
}

// Weight multiply-adds per token: q, k, v, o and the gated FFN of every layer (with experts, the
// router and the experts a token runs).
static double weight_macs(const ModelConfig& c) {
  return double(c.n_layer) * (double(c.n_embd) * double(c.head_dim) * (2.0 * c.n_head + 2.0 * c.n_head_kv) +
                              3.0 * double(c.n_embd) * double(c.ffn_active_channels()) +
                              double(c.n_embd) * double(c.n_expert));
}

PrefillCost PrefillCost::from_model(const ModelConfig& c, double r) {
  PrefillCost pc;
  if (r <= 0) return pc;
  // Attention multiply-adds per visible position (q.k and p.v over every query head) against the
  // weight ones per token.
  const double w = weight_macs(c);
  const double per_layer = r * 2.0 * double(c.n_head) * double(c.head_dim) / std::max(w, 1.0);
  for (int il = 0; il < c.n_layer; ++il) {
    const int win = c.layer_window(il);
    if (win <= 0) {
      pc.full += per_layer;
      continue;
    }
    auto it = std::find_if(pc.windows.begin(), pc.windows.end(), [&](const auto& x) { return x.first == win; });
    if (it == pc.windows.end()) pc.windows.emplace_back(win, per_layer);
    else it->second += per_layer;
  }
  return pc;
}

PrefillCost PrefillCost::scored(const ModelConfig& c) const {
  PrefillCost pc = *this;
  if (active()) pc.per_token += double(c.n_vocab) * double(c.n_embd) / std::max(weight_macs(c), 1.0);
  return pc;
}

int PrefillCost::cost(int start, int n) const { return int(std::min(std::ceil(units(start, n) - 1e-9), 1e9)); }

double PrefillCost::units(int start, int n) const {
  if (n <= 0) return 0;
  // Positions visible to the queries at start .. start + n - 1: q = start + 1 .. start + n.
  const double a = double(start) + 1, b = double(start) + double(n);
  double x = double(n) * (1 + per_token) + full * (a + b) * double(n) / 2;
  for (const auto& [win, k] : windows) {
    const double w = double(win), top = std::min(b, w);  // sum of min(q, w)
    const double below = top >= a ? (a + top) * (top - a + 1) / 2 : 0;
    x += k * (below + w * std::max(0.0, b - std::max(a - 1, w)));
  }
  return x;
}

int PrefillCost::tokens_for(int start, int budget, int limit) const {
  int lo = 0, hi = std::min(limit, budget);  // a token costs at least 1
  while (lo < hi) {
    const int mid = lo + (hi - lo + 1) / 2;
    if (cost(start, mid) <= budget) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

bool Engine::defer_prefill(Seq& s, size_t i) const {
  // s holds only whole cached pages and its next prompt page is one that another running
  // sequence r is computing right now: computing it here too would be redundant, so s skips this
  // step and adopts r's pages as they are published (extend_prefix at the start of each step).
  // s waits only for an r strictly ahead of it in (tokens computed desc, admission asc): a
  // strict order, so waits never form a cycle, and the first sequence of every chain is never
  // deferred and makes progress. Waits are recomputed every step from the running set, so a
  // preempted or finished r releases its waiters at once; and once r has computed the shared
  // pages (r_tok >= shared) s stops waiting even if they could not be adopted.
  if (!s.cache->prefix_extendable() || s.req.params.prompt_logprobs) return false;
  const int P = kcfg_.page_tokens;
  const size_t limit = size_t(int(s.tokens.size()) - 1) / size_t(P);
  const int s_tok = s.cache->n_tokens();
  const size_t have = size_t(s_tok / P);
  for (size_t k = 0; k < running_.size(); ++k) {
    const Seq& r = *running_[k];
    if (k == i || r.preempted || r.done) continue;
    const size_t shared = std::min(limit, common_pages(s.keys, r.keys));
    if (shared <= have) continue;
    const int r_tok = r.cache->n_tokens();
    if (r_tok >= int(shared) * P) continue;
    if (r_tok > s_tok || (r_tok == s_tok && k < i)) return true;
  }
  return false;
}

Engine::Engine(const EngineOptions& o) : opt_(o) {
  if (o.max_batch < 1) fail("--max-batch must be >= 1 (got {})", o.max_batch);
  if (o.max_running < 1) fail("max running sequences must be >= 1 (got {})", o.max_running);
  if (!(o.tpot_target_ms >= 0) || o.tpot_target_ms > 1e9)
    fail("--tpot-target-ms must be between 0 and 1e9 (got {})", o.tpot_target_ms);
  if (o.oldest_prefill_tokens == 0 || o.oldest_prefill_tokens < -1)
    fail("--oldest-prefill-tokens must be >= 1 (got {})", o.oldest_prefill_tokens);
  oldest_prefill_tokens_ = o.oldest_prefill_tokens > 0 ? o.oldest_prefill_tokens : std::max(1, o.max_batch / 4);
  if (o.threads < 0) fail("--threads must be >= 1 (got {})", o.threads);
  if (o.draft_max < 0 || o.draft_max > 64) fail("--draft-max must be between 0 and 64 (got {})", o.draft_max);
  if (o.draft_ngram_min < 1 || o.draft_ngram_min > o.draft_ngram_max)
    fail("--draft-ngram-min {} must be >= 1 and at most --draft-ngram-max {}", o.draft_ngram_min, o.draft_ngram_max);
  if (o.ctx < 0) fail("context must be > 0 (got {})", o.ctx);
  model_ = Model::load(o.model_path, o.kv.rope);
  tok_ = Tokenizer::from_gguf(model_->file());
  const ModelConfig& c = model_->config();
  ctx_ = o.ctx > 0 ? std::min(o.ctx, c.n_ctx_train) : c.n_ctx_train;
  model_->set_context(ctx_);  // the context it runs at, once capped
  if (const std::string note = model_rope_note(c, ctx_); !note.empty()) std::fprintf(stderr, "%s\n", note.c_str());
  if (!(o.prefill_attention_cost >= 0) || o.prefill_attention_cost > 1e6)
    fail("--prefill-attention-cost must be in [0, 1e6] (got {})", o.prefill_attention_cost);
  prefill_cost_ = PrefillCost::from_model(c, o.prefill_attention_cost);
  prefill_cost_scored_ = prefill_cost_.scored(c);
  kv_ = kv_flags_resolve(o.kv, *model_);
  kcfg_ = model_->kv_cache_config(kv_.policy, ctx_, o.kv.page_tokens);
  kv_.apply(kcfg_);
  // A persistent offload tier outlives the path: the model is named by its content.
  kcfg_.model_id = o.kv_offload_persist ? gguf_fingerprint(model_->file()) : o.model_path;
  const int threads = resolve_threads(o.threads);
  threads_ = std::make_unique<ThreadPool>(threads);
  fwd_ = std::make_unique<Forward>(*model_, *threads_, o.max_batch);
  const size_t page_bytes = kv_cache_page_bytes(kcfg_);
  const int P = kcfg_.page_tokens;
  // Sizing counts pages per page group as a pool cache lays them out (a private cache groups the
  // layers differently), so a cache on a one-page pool stands in until the real pool exists.
  {
    PagePool one(1, page_bytes, P);
    const KvCache shape(kcfg_, &one);
    if (o.kv_mem > 0) {
      pool_ = PagePool::from_bytes(o.kv_mem, page_bytes, P);
    } else if (o.kv_tokens > 0) {
      // --kv-tokens: one prompt of that many tokens fits, prefilled in max_batch chunks (every page
      // group's pages for it).
      const int n = int(std::min<size_t>(o.kv_tokens, INT32_MAX / 2));
      pool_ = std::make_unique<PagePool>(std::max<size_t>(1, shape.pages_at(n, std::min(n, o.max_batch))), page_bytes, P);
    } else {
      // Default: room for 8 full contexts, at most 2 GiB.
      const size_t pages = shape.pages_at(ctx_, std::min(ctx_, o.max_batch)) * 8;
      pool_ = PagePool::from_bytes(std::min(pages * page_bytes, size_t(2) << 30), page_bytes, P);
    }
  }
  shape_ = std::make_unique<KvCache>(kcfg_, pool_.get());
  if (o.kv_offload_bytes > 0) {
    if (o.kv_offload_dir.empty()) fail("--kv-offload-size needs --kv-offload-dir (where the tier's file goes)");
    if (!shape_->prefix_shareable()) {
      std::fprintf(stderr,
                   "[kvq] warning: this KV configuration keeps prefixes private (a full-precision window): "
                   "no offload tier (--kv-offload-size) is made, as it would have nothing to keep\n");
    } else {
      KvOffloadOptions to;
      to.dir = o.kv_offload_dir;
      to.capacity_bytes = o.kv_offload_bytes;
      to.direct = o.kv_offload_direct;
      to.persist = o.kv_offload_persist;
      if (to.persist) to.identity = shape_->prefix_identity();
      offload_ = std::make_unique<KvOffload>(to, *pool_);
    }
  } else if (!o.kv_offload_dir.empty()) {
    fail("--kv-offload-dir needs --kv-offload-size (the tier's size, e.g. 4GiB)");
  } else if (o.kv_offload_direct || o.kv_offload_persist) {
    fail("{} needs --kv-offload-dir and --kv-offload-size",
         o.kv_offload_direct ? "--kv-offload-direct" : "--kv-offload-persist");
  }
  // A persistent tier's pages were hashed under its file's key: the index takes the same.
  index_ = kv_cache_prefix_index(*shape_, offload_ && offload_->persistent() ? &offload_->key() : nullptr);
  pool_->set_evictor(index_.get());
  if (offload_) index_->set_spill(offload_.get());
  kv_capacity_ = size_t(shape_->tokens_in_pages(pool_->n_pages(), o.max_batch));
  metrics_.kv_tokens_capacity = kv_capacity_;
  if (offload_) {
    metrics_.offload = true;
    metrics_.offload_stats = offload_->stats();
  }
  if (o.autostart) start();
}

Engine::~Engine() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  // Requests that never ran or were interrupted end as cancelled; then every page goes back
  // before the pool and the index go away.
  for (auto& s : running_) finish(*s, "cancelled");
  for (auto& s : waiting_) finish(*s, "cancelled");
  for (auto& s : incoming_) finish(*s, "cancelled");
  running_.clear();
  waiting_.clear();
  incoming_.clear();
  if (offload_ && offload_->persistent()) {
    // The pool's cached prefixes are the most recent: they go to the tier (least recently used
    // first), which is then saved for the next run. Cut short (a second signal), the file is not
    // trusted by the next run.
    const size_t cached = pool_->n_idle();
    const double t0 = now_seconds();
    pool_->evict_idle();
    if (offload_->save())
      std::fprintf(stderr, "[kvq] KV offload tier saved to %s: %zu pages (%zu from the pool), %.2f s\n",
                   offload_->path().c_str(), offload_->stats().resident_pages, cached, now_seconds() - t0);
  }
  index_->set_spill(nullptr);  // otherwise emptying the pool is no eviction worth keeping
  pool_->evict_idle();
  pool_->set_evictor(nullptr);
}

void Engine::start() {
  std::lock_guard<std::mutex> lk(mu_);
  if (thread_.joinable()) return;
  thread_ = std::thread([this] { loop(); });
}

namespace {
// A constrained request (JSON mode, json_schema) that no token can continue: the mask left only
// the end of generation, or a token its grammar then refused.
constexpr const char* kNoContinuation =
    "JSON mode / json_schema: no token can continue the document (the vocabulary lacks one, or the document "
    "reached the grammar's limits: nesting, or alternatives open at once)";
constexpr int kMaxLogprobs = 20;              // top alternatives per token (OpenAI's limit)
constexpr int kPromptLogprobsChunk = 64;      // prompt tokens per step of a prompt_logprobs request
                                              // (bounds its (tokens, n_vocab) logits rows)
}  // namespace

static const std::string* cut_at_stop(std::string& text, size_t from, size_t added, const std::vector<std::string>& stops,
                                      bool keep_stop);
static std::unique_ptr<GrammarState> lazy_grammar_step(const std::vector<GenParams::LazyGrammar>& lazy, std::string& text,
                                                       bool& settled, std::string_view bytes);

int32_t Engine::forced_token(const Seq& s) const { return s.budget && !s.grammar ? s.budget->forced() : -1; }

bool Engine::take_token(Seq& s, int32_t next, const float* lg, int n_vocab, double tpot) {
  const double now = now_seconds();
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (s.res.tokens.empty() && s.t_last == 0) metrics_.ttft.observe(now - s.t_submit);
    else if (std::isnan(tpot)) metrics_.tpot.observe(now - s.t_last);
    else if (tpot >= 0) metrics_.tpot.observe(tpot);
  }
  if (s.res.ttft_s < 0) s.res.ttft_s = now - s.t_submit;
  else s.res.decode_s = now - s.t_submit - s.res.ttft_s;
  s.t_last = now;
  const std::vector<int32_t>& stop_ids = s.req.params.stop_token_ids;
  if (s.grammar && tok_.is_eog(next) && !s.grammar->accepting()) {  // the mask's last resort
    finish(s, "error", kNoContinuation);
    return false;
  }
  const bool stop_id = std::find(stop_ids.begin(), stop_ids.end(), next) != stop_ids.end();
  const bool eog = tok_.is_eog(next) && (!s.req.params.ignore_eos || s.grammar);
  if (eog || stop_id) {
    if (stop_id && s.req.params.include_stop_str) s.text += s.dec->push(next);  // vLLM's: the stop token's text too
    if (stop_id && !eog) s.res.stop_token = next;  // (vLLM: an end of generation listed there is no stop_reason)
    finish(s, "stop");
    return false;
  }
  s.tokens.push_back(next);
  s.res.tokens.push_back(next);
  if (s.grammar && !s.grammar->feed(grammar_vocab_->bytes(next))) {
    finish(s, "error", kNoContinuation);
    return false;
  }
  if (!s.grammar && !s.lazy_settled && !s.req.params.lazy_grammars.empty()) trigger_lazy_grammar(s, next);
  if (s.req.params.logprobs >= 0) {
    s.res.logprobs.push_back(token_logprob(lg, n_vocab, next, s.req.params.logprobs));
    if (s.req.on_logprob) s.req.on_logprob(s.res.logprobs.back());
  }
  const size_t added = s.text.size();
  s.text += s.dec->push(next);
  if (s.budget) s.budget->take(next, std::string_view(s.text).substr(added), s.dec->pending());
  if (stop_string_ends(s, added)) {
    s.dec.reset();  // pending bytes come after the cut
    finish(s, "stop");
    return false;
  }
  emit_text(s, false);
  if (s.grammar && s.grammar->done()) {  // nothing else can follow
    finish(s, "stop");
    return false;
  }
  if (int(s.res.tokens.size()) >= s.req.params.max_tokens || int(s.tokens.size()) >= ctx_) {
    finish(s, "length");
    return false;
  }
  return true;
}

void Engine::verify_drafts(Seq& s, int n, const float* rows, int n_vocab) {
  const int d = int(s.drafts.size());
  const size_t base = s.tokens.size() - size_t(d);  // through the step's first token
  s.tokens.resize(base);
  // Row i samples as decoding would after the drafts kept before it (the sampler's history
  // holding them; a constrained request's row masked by its grammar's state after them, a lazy
  // grammar's from the kept draft that completes its trigger on); a draft is kept while the sample
  // equals it.
  std::vector<int32_t> taken;  // the drafts kept, then the row's own sample (unless the text ended)
  int kept = 0;
  std::unique_ptr<GrammarState> state = s.grammar ? std::make_unique<GrammarState>(*s.grammar) : nullptr;
  const bool lazy = !s.grammar && !s.lazy_settled && !s.req.params.lazy_grammars.empty();
  std::string lazy_text = lazy ? s.lazy_text : std::string();
  bool settled = !lazy;
  // (a reasoning budget's forced tokens replace the samples, as in decoding)
  std::unique_ptr<ReasoningBudgetState> budget = s.budget ? std::make_unique<ReasoningBudgetState>(*s.budget) : nullptr;
  std::optional<TokenStreamDecoder> dec;  // (the rows' text, for the budget only)
  if (budget) dec.emplace(*s.dec);
  for (int i = 0;; ++i) {
    const float* row = rows + size_t(i) * size_t(n_vocab);
    if (state) {
      s.masked.assign(row, row + n_vocab);
      grammar_mask(*state, grammar_vocab(), s.req.params.stop_token_ids, s.masked.data(), n_vocab);
      row = s.masked.data();
    }
    int32_t x = budget && !state ? budget->forced() : -1;
    if (x < 0) x = s.sampler->sample(row, n_vocab, s.tokens, size_t(s.n_prompt));
    taken.push_back(x);
    if (i == d || x != s.drafts[size_t(i)]) break;
    s.tokens.push_back(x);
    ++kept;
    if (budget) {
      const std::string t = dec->push(x);
      budget->take(x, t, dec->pending());
    }
    // (a token that completes the document, or that the grammar refuses, ends what decoding runs)
    if (state) {
      if (tok_.is_eog(x) || !state->feed(grammar_vocab().bytes(x)) || state->done()) break;
    } else if (!settled) {
      state = lazy_grammar_step(s.req.params.lazy_grammars, lazy_text, settled, grammar_vocab().bytes(x));
      if (state && state->done()) break;
    }
  }
  s.cache->commit(n, 1 + kept);
  s.cache->publish_pages(*index_, s.tokens.data(), s.cache->n_tokens());
  s.tokens.resize(base);
  s.draft_len = kept == d ? std::min(opt_.draft_max, 2 * std::max(1, s.draft_len)) : kept + 1;
  s.drafts.clear();
  // The step's time per output token is shared by the tokens it gave (a sequence's first token is
  // its TTFT; the others of that step are none's); a token that ends the sequence ends it, the
  // kept ones after it being the cache's only.
  const double tpot = s.t_last > 0 ? (now_seconds() - s.t_last) / double(taken.size()) : -1;
  const size_t before = s.res.tokens.size();
  for (size_t i = 0; i < taken.size(); ++i)
    if (!take_token(s, taken[i], rows + i * size_t(n_vocab), n_vocab, tpot)) break;
  std::lock_guard<std::mutex> lk(mu_);
  metrics_.spec_draft_tokens += uint64_t(d);
  metrics_.spec_accepted_tokens += uint64_t(std::min(kept, int(s.res.tokens.size() - before)));
}

const GrammarVocab& Engine::grammar_vocab() {
  if (!json_vocab_) json_vocab_ = std::make_unique<JsonVocab>(tok_);
  if (!grammar_vocab_) grammar_vocab_ = std::make_unique<GrammarVocab>(*json_vocab_);
  return *grammar_vocab_;
}

// GenParams::lazy_grammars after `bytes` more of the reply: `text` is the undecided end of the
// reply, `settled` set once a trigger was seen. Returns the triggered grammar's state, the bytes
// after the trigger read (null: none triggered, or its grammar refused them: the reply stays free).
static std::unique_ptr<GrammarState> lazy_grammar_step(const std::vector<GenParams::LazyGrammar>& lazy, std::string& text,
                                                       bool& settled, std::string_view bytes) {
  const size_t before = text.size();
  text += bytes;
  size_t at = std::string::npos;
  const GenParams::LazyGrammar* hit = nullptr;
  for (const GenParams::LazyGrammar& l : lazy) {
    // an occurrence ending in these bytes (earlier ones were looked for before)
    const size_t from = before >= l.trigger.size() ? before - l.trigger.size() + 1 : 0;
    const size_t p = text.find(l.trigger, from);
    if (p < at) {
      at = p;
      hit = &l;
    }
  }
  if (!hit) {
    // only a trigger's start can be left undecided: keep the bytes the longest one may start in
    size_t longest = 0;
    for (const GenParams::LazyGrammar& l : lazy) longest = std::max(longest, l.trigger.size());
    if (text.size() >= longest) text.erase(0, text.size() - (longest - 1));
    return nullptr;
  }
  auto g = std::make_unique<GrammarState>(hit->grammar);
  if (!g->feed(std::string_view(text).substr(at + hit->trigger.size()))) g.reset();
  settled = true;
  text.clear();
  text.shrink_to_fit();
  return g;
}

void Engine::trigger_lazy_grammar(Seq& s, int32_t token) {
  s.grammar = lazy_grammar_step(s.req.params.lazy_grammars, s.lazy_text, s.lazy_settled, grammar_vocab().bytes(token));
}

uint64_t Engine::submit(GenRequest r) {
  std::vector<GenRequest> one;
  one.push_back(std::move(r));
  return submit_all(std::move(one))[0];
}

std::vector<uint64_t> Engine::submit_all(std::vector<GenRequest> rs) {
  std::vector<std::unique_ptr<Seq>> seqs;
  std::vector<std::string> errs;
  std::vector<char> at_once;  // finishes at once: an error, or nothing to do ("length")
  for (GenRequest& r : rs) {
    auto s = std::make_unique<Seq>();
    s->t_submit = now_seconds();
    s->n_prompt = int(r.prompt.size());
    s->res.prompt_tokens = s->n_prompt;
    s->tokens = r.prompt;
    s->req = std::move(r);
    std::string err;
    if (s->tokens.empty()) {
      err = "the prompt is empty";
    } else if (s->n_prompt >= ctx_) {
      err = fmt::format("the prompt is {} tokens, the context is {}", s->n_prompt, ctx_);
    } else if (shape_->pages_at(s->n_prompt + 1, std::min(s->n_prompt + 1, opt_.max_batch)) > pool_->n_pages()) {
      err = fmt::format("the prompt is {} tokens, the KV pool holds {}", s->n_prompt, kv_tokens_capacity());
    } else if (s->req.params.priority != 0 && !opt_.priority_scheduling) {
      err = "a priority other than 0 needs priority scheduling (kvq serve --scheduling-policy priority)";
    } else if (s->req.params.logprobs > kMaxLogprobs) {
      err = fmt::format("logprobs {} is above the largest supported, {}", s->req.params.logprobs, kMaxLogprobs);
    } else if (s->req.params.json_object && s->req.params.grammar) {
      err = "JSON mode and a json_schema together: give one";
    } else if (!s->req.params.lazy_grammars.empty() && (s->req.params.json_object || s->req.params.grammar)) {
      err = "a grammar from a trigger on and a grammar of the whole reply together: give one";
    } else if (std::any_of(s->req.params.lazy_grammars.begin(), s->req.params.lazy_grammars.end(),
                           [](const GenParams::LazyGrammar& l) { return l.trigger.empty() || !l.grammar; })) {
      err = "a lazy grammar needs a trigger and a grammar";
    } else {
      for (int32_t t : s->tokens)
        if (t < 0 || t >= tok_.n_vocab()) {
          err = fmt::format("token id {} is outside the vocabulary [0, {})", t, tok_.n_vocab());
          break;
        }
    }
    const bool nothing_to_do =
        s->req.params.max_tokens < 0 || (s->req.params.max_tokens == 0 && !s->req.params.prompt_logprobs);
    at_once.push_back(!err.empty() || nothing_to_do);
    if (!at_once.back()) {
      if (s->req.params.prompt_logprobs) {
        s->res.prompt_logprobs.resize(size_t(s->n_prompt));
        s->res.prompt_logprobs[0].token = s->tokens[0];
        s->res.prompt_logprobs[0].logprob = std::numeric_limits<float>::quiet_NaN();
      }
      SamplerParams sp = s->req.params.sampling;
      if (s->req.params.min_tokens > 0) {  // what would end the text before min_tokens
        sp.min_tokens = s->req.params.min_tokens;
        sp.end_tokens = s->req.params.stop_token_ids;
        if (!s->req.params.ignore_eos || s->req.params.grammar || s->req.params.json_object ||
            !s->req.params.lazy_grammars.empty())
          sp.end_tokens.insert(sp.end_tokens.end(), tok_.eog_ids().begin(), tok_.eog_ids().end());
      }
      s->sampler = std::make_unique<Sampler>(sp);
      s->dec = std::make_unique<TokenStreamDecoder>(tok_, false);
      if (s->req.params.json_object) s->grammar = std::make_unique<GrammarState>(Grammar::json_object());
      else if (s->req.params.grammar) s->grammar = std::make_unique<GrammarState>(s->req.params.grammar);
      const ReasoningBudget& rb = s->req.params.reasoning_budget;
      if (rb.active() && !s->grammar) s->budget = std::make_unique<ReasoningBudgetState>(rb, tok_);
    }
    seqs.push_back(std::move(s));
    errs.push_back(std::move(err));
  }
  std::vector<uint64_t> ids(seqs.size());
  {
    std::lock_guard<std::mutex> lk(mu_);
    for (size_t i = 0; i < seqs.size(); ++i) {
      seqs[i]->id = ids[i] = next_id_++;
      if (!abort_reason_.empty() && errs[i].empty()) {  // shutting down: nothing new runs
        errs[i] = abort_reason_;
        at_once[i] = 1;
      }
      if (!at_once[i]) incoming_.push_back(std::move(seqs[i]));
    }
    metrics_.waiting = int(incoming_.size() + waiting_.size());
  }
  for (size_t i = 0; i < seqs.size(); ++i)  // outside the lock (on_done may call back)
    if (at_once[i]) finish(*seqs[i], errs[i].empty() ? "length" : "error", errs[i]);
  cv_.notify_all();
  return ids;
}

void Engine::abort_all(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    abort_reason_ = reason.empty() ? "aborted" : reason;
  }
  cv_.notify_all();
}

bool Engine::aborting() const {
  std::lock_guard<std::mutex> lk(mu_);
  return !abort_reason_.empty();
}

void Engine::cancel(uint64_t id) {
  {
    std::lock_guard<std::mutex> lk(mu_);
    cancelled_.insert(id);
  }
  cv_.notify_all();
}

GenResult Engine::generate(const std::vector<int32_t>& prompt, const GenParams& p) {
  auto pr = std::make_shared<std::promise<GenResult>>();
  auto fut = pr->get_future();
  GenRequest r;
  r.prompt = prompt;
  r.params = p;
  r.on_done = [pr](const GenResult& res) { pr->set_value(res); };
  submit(std::move(r));
  return fut.get();
}

EngineMetrics Engine::metrics() const {
  std::lock_guard<std::mutex> lk(mu_);
  return metrics_;
}

bool Engine::idle() const {
  std::lock_guard<std::mutex> lk(mu_);
  return incoming_.empty() && !busy_;
}

void Engine::wait_idle() const {
  std::unique_lock<std::mutex> lk(mu_);
  idle_cv_.wait(lk, [&] { return incoming_.empty() && !busy_; });
}

void Engine::loop() {
  for (;;) {
    {
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return stop_ || !incoming_.empty() || !running_.empty() || !waiting_.empty(); });
      if (stop_) return;
      while (!incoming_.empty()) {
        waiting_.push_back(std::move(incoming_.front()));
        incoming_.pop_front();
      }
      busy_ = true;
    }
    step();
    update_gauges();
    std::vector<std::function<void()>> done;
    done.swap(done_);
    for (auto& f : done) f();
  }
}

void Engine::update_gauges() {
  const KvPrefixStats ps = index_->stats();
  {
    std::lock_guard<std::mutex> lk(mu_);
    metrics_.running = int(running_.size());
    metrics_.waiting = int(waiting_.size() + incoming_.size());
    metrics_.kv_usage = pool_->usage();
    metrics_.prefix_query_tokens = ps.query_tokens;
    metrics_.prefix_hit_tokens = ps.hit_tokens;
    metrics_.prefix_readmit_query_tokens = ps.readmit_query_tokens;
    metrics_.prefix_readmit_hit_tokens = ps.readmit_hit_tokens;
    if (offload_) {
      metrics_.offload = true;
      metrics_.offload_stats = offload_->stats();
      metrics_.offload_hit_tokens = offload_hit_tokens_;
    }
    busy_ = !running_.empty() || !waiting_.empty();
  }
  idle_cv_.notify_all();
}

void Engine::emit_text(Seq& s, bool final) {
  size_t end = s.text.size();
  if (!final) {
    // Hold back a tail that may be the start of a stop string.
    size_t hold = 0;
    for (const auto& st : s.req.params.stop) {
      if (st.empty()) continue;
      for (size_t k = std::min(st.size() - 1, end - s.sent); k > hold; --k)
        if (s.text.compare(end - k, k, st, 0, k) == 0) {
          hold = k;
          break;
        }
    }
    end -= hold;
  }
  if (end > s.sent) {
    if (s.req.on_text) s.req.on_text(s.text.substr(s.sent, end - s.sent));
    s.sent = end;
  }
}

// Cuts text before (keep_stop: after) the first stop string that ends in the text added at
// `added` and starts at or after `from` (the longest of those starting there); returns it, or
// null when there is none.
// (Without min_tokens every stop string is looked for as soon as it can be complete, so none
// lies wholly before `added`; with it, those that came before min_tokens are not looked for.)
static const std::string* cut_at_stop(std::string& text, size_t from, size_t added, const std::vector<std::string>& stops,
                                      bool keep_stop) {
  size_t best = std::string::npos;
  const std::string* hit = nullptr;
  for (const auto& st : stops) {
    if (st.empty()) continue;
    const size_t p = text.find(st, std::max(from, added >= st.size() ? added - (st.size() - 1) : 0));
    if (p < best || (p == best && p != std::string::npos && st.size() > hit->size())) {
      best = p;
      hit = &st;
    }
  }
  if (!hit) return nullptr;
  text.resize(keep_stop ? best + hit->size() : best);
  return hit;
}

bool Engine::stop_string_ends(Seq& s, size_t added) {
  if (int(s.res.tokens.size()) <= s.req.params.min_tokens) return false;  // (vLLM's: none looked for until then)
  const std::string* hit = cut_at_stop(s.text, s.sent, added, s.req.params.stop, s.req.params.include_stop_str);
  if (hit) s.res.stop_string = *hit;
  return hit != nullptr;
}

void Engine::finish(Seq& s, const char* reason, const std::string& error) {
  if (s.done) return;
  s.done = true;
  if (s.cache) s.cache->release();
  if (std::string(reason) != "error" && std::string(reason) != "cancelled") {
    if (s.dec) {  // a stop string already cut the text and dropped the decoder's pending bytes
      const size_t added = s.text.size();
      s.text += s.dec->flush();
      if (stop_string_ends(s, added)) reason = "stop";
    }
    emit_text(s, true);  // what was held back (the start of a possible stop string) is output
  }
  s.res.finish_reason = reason;
  s.res.error = error;
  s.res.text = s.text;
  s.res.completion_tokens = int(s.res.tokens.size());
  {
    std::lock_guard<std::mutex> lk(mu_);
    cancelled_.erase(s.id);
    ++metrics_.requests_finished;
    if (reason == std::string("cancelled")) ++metrics_.requests_cancelled;
    if (reason == std::string("stop") || reason == std::string("length")) metrics_.e2e.observe(now_seconds() - s.t_submit);
    metrics_.generation_tokens += uint64_t(s.res.completion_tokens);
    if (reason != std::string("error")) metrics_.prompt_tokens += uint64_t(s.n_prompt);
  }
  if (!s.req.on_done) return;
  if (std::this_thread::get_id() == thread_.get_id()) {
    // Scheduler thread: called after the step's gauges are published, so a client that sees its
    // request finished also sees it gone from the running count.
    done_.push_back([cb = std::move(s.req.on_done), res = s.res] { cb(res); });
  } else {
    s.req.on_done(s.res);
  }
}

void Engine::preempt(size_t i) {
  Seq& s = *running_[i];
  s.cache->release();
  s.preempted = true;
  s.restored = false;
  s.restored_pages.clear();
  ++s.res.preemptions;
  std::lock_guard<std::mutex> lk(mu_);
  ++metrics_.preemptions;
}

bool Engine::step() {
  // The step as the decoding sequences wait for it: scheduling, the forward pass and the sampling.
  const double t_step = now_seconds();
  restore_seconds_ = 0;
  // Cancellations.
  std::unordered_set<uint64_t> canc;
  std::string abort_reason;
  {
    std::lock_guard<std::mutex> lk(mu_);
    canc = cancelled_;
    abort_reason = abort_reason_;
  }
  if (!abort_reason.empty()) {
    for (auto& s : running_) finish(*s, "error", abort_reason);
    for (auto& s : waiting_) finish(*s, "error", abort_reason);
    running_.clear();
    waiting_.clear();
    return false;
  }
  if (!canc.empty()) {
    std::unordered_set<uint64_t> unmatched = canc;
    for (auto& s : running_)
      if (canc.count(s->id)) {
        unmatched.erase(s->id);
        finish(*s, "cancelled");
      }
    for (auto& s : waiting_)
      if (canc.count(s->id)) {
        unmatched.erase(s->id);
        finish(*s, "cancelled");
      }
    std::erase_if(running_, [](const auto& s) { return s->done; });
    std::erase_if(waiting_, [](const auto& s) { return s->done; });
    // A cancel (of those read above) that matched nothing is of a request that had already ended
    // (a client racing its end): forgotten, unless the request is still on its way in. (A cancel
    // that came since is left for the next step.)
    std::lock_guard<std::mutex> lk(mu_);
    for (uint64_t id : unmatched)
      if (std::none_of(incoming_.begin(), incoming_.end(), [id](const auto& s) { return s->id == id; }))
        cancelled_.erase(id);
  }

  for (auto& s : running_) update_keys(*s);

  // FIFO admission: the head waits until the pages of its whole prompt are available, beyond the
  // pages already promised to running sequences and those it will adopt (cached now, or being
  // computed by a running sequence with the same prefix).
  const size_t P = size_t(kcfg_.page_tokens);
  size_t outstanding = outstanding_pages();
  // (priority scheduling: the queue in priority order, ties in their order: preempted ones first)
  if (opt_.priority_scheduling)
    std::stable_sort(waiting_.begin(), waiting_.end(),
                     [](const auto& a, const auto& b) { return a->req.params.priority < b->req.params.priority; });
  while (!waiting_.empty()) {
    Seq& s = *waiting_.front();
    bool slot = active_running() < size_t(opt_.max_running);
    if (!slot && !opt_.priority_scheduling) break;
    const int n = int(s.tokens.size());
    if (!s.cache) s.cache = std::make_unique<KvCache>(kcfg_, pool_.get());
    update_keys(s);
    // A prompt_logprobs request computes its whole prompt: nothing adopted, nothing awaited.
    const bool adopts = !s.req.params.prompt_logprobs;
    if (offload_ && adopts && !s.restored && s.cache->prefix_shareable()) restore_offloaded(s, n - 1, outstanding);
    const KvPrefixMatch m = adopts ? index_->lookup(s.tokens.data(), n - 1) : KvPrefixMatch{};
    size_t need = s.cache->admit_pages(m, n, fwd_->max_batch());
    const size_t inflight =
        adopts && s.cache->prefix_shareable() ? inflight_pages(s, size_t(n - 1) / P, running_.size()) : 0;
    // In pages of every group: what the matched prefix brings, and what the in-flight one will,
    // that the sequence still holds when its prompt's last step runs.
    const size_t matched = s.cache->prefix_pages_kept(int(m.pages.size()), n, fwd_->max_batch());
    const size_t inflight_held = inflight > m.pages.size() ? s.cache->prefix_pages_kept(int(inflight), n, fwd_->max_batch()) : 0;
    const size_t covered = std::max(matched, inflight_held);
    if (inflight_held > matched) need -= std::min(need, inflight_held - matched);
    const size_t own = s.cache->pages_at(n, std::min(n - m.n_tokens(), fwd_->max_batch()));
    // (priority: a slot and pages made by preempting lower priorities, when that makes both)
    if ((!slot || need + outstanding > pool_->n_available()) && opt_.priority_scheduling && preempt_for(s, need)) {
      outstanding = outstanding_pages();
      slot = true;
    }
    if (!slot) break;
    if (need + outstanding > pool_->n_available()) {
      if (active_running() == 0) {
        // Nothing else holds pages: this sequence cannot fit in the pool at all.
        finish(s, s.res.tokens.empty() ? "error" : "length",
               s.res.tokens.empty() ? "the KV pool is too small for this prompt" : "");
        waiting_.pop_front();
        continue;
      }
      break;
    }
    const bool readmission = s.preempted;
    if (!readmission) {
      std::lock_guard<std::mutex> lk(mu_);
      metrics_.queue.observe(now_seconds() - s.t_submit);
    }
    s.preempted = false;
    s.res.cached_tokens = adopts ? s.cache->adopt_prefix(*index_, s.tokens.data(), n, n - 1, readmission) : 0;
    // Offload hits: the pages read back for this admission that it adopted (as the hit rate,
    // first admissions only).
    for (const auto& [i, page] : s.restored_pages)
      if (!readmission && int(i) < s.res.cached_tokens / int(P) && index_->page_of(s.keys[i], 0) == page)
        offload_hit_tokens_ += P;
    s.restored_pages.clear();
    s.cache->publish_to(*index_);  // every step's pages are published (a prompt_logprobs one adopts none)
    outstanding += own > covered ? own - covered : 0;
    // (priority scheduling: after the running ones of its priority or a higher one)
    auto at = running_.end();
    if (opt_.priority_scheduling)
      at = std::upper_bound(running_.begin(), running_.end(), s.req.params.priority,
                            [](int p, const auto& r) { return p < r->req.params.priority; });
    running_.insert(at, std::move(waiting_.front()));
    waiting_.pop_front();
  }
  if (opt_.priority_scheduling) {  // those an admission preempted: back to the queue, first of their priority
    std::vector<std::unique_ptr<Seq>> back;
    for (auto& r : running_)
      if (r->preempted && !r->done) back.push_back(std::move(r));
    std::erase_if(running_, [](const auto& r) { return !r; });
    for (size_t k = back.size(); k-- > 0;) waiting_.push_front(std::move(back[k]));
  }
  if (running_.empty()) return false;

  // Prefilling sequences that hold only cached pages adopt what was published since (pages other
  // sequences' prefill chunks filled in earlier steps).
  for (auto& sp : running_) {
    Seq& s = *sp;
    const int n = int(s.tokens.size());
    if (s.preempted || s.done || n - s.cache->n_tokens() <= 1 || s.req.params.prompt_logprobs) continue;
    s.res.cached_tokens += s.cache->extend_prefix(*index_, s.tokens.data(), n, n - 1);
  }

  // Build the step: decodes first, then prefill chunks, oldest first, within the token budget and
  // the pages the pool can supply (checked here so eval_batch never runs out midway).
  struct Item {
    Seq* s;
    int n;
    bool logits;      // the last row samples the next token
    bool all;         // every row's logits: prompt token log-probabilities
    int start;        // cache position of the first token
    bool spec = false;  // a decode with drafted tokens: every row's logits, verified (verify_drafts)
  };
  std::vector<Item> items;
  std::vector<char> scheduled(running_.size(), 0);
  int budget = fwd_->max_batch();
  size_t reserved = 0;
  // Prompt log-probabilities need every row of the prompt's logits: in chunks that bound them.
  const auto scores_all = [](const Seq& s) { return s.req.params.prompt_logprobs && s.cache->n_tokens() + 1 < s.n_prompt; };
  // The most prompt tokens a prefill can take this step.
  const auto prefill_limit = [&](const Seq& s, int pending) {
    return scores_all(s) ? std::min(pending, kPromptLogprobsChunk) : pending;
  };
  std::vector<int> share(running_.size(), 0);  // prefills' tokens this step (pass 1)
  // The step's decode and prompt tokens as prefill_cost prices them (StepTimeFit's d and p).
  double decode_units = 0, prompt_units = 0;
  bool decoding = false;  // a sequence that sampled before waits for this step (the target applies)
  // A prefill's pricing: prompt_logprobs chunks also pay for every row's logits.
  const auto cost_of = [&](const Seq& s) -> const PrefillCost& { return scores_all(s) ? prefill_cost_scored_ : prefill_cost_; };
  const auto units = [&](const Seq& s, int n) {
    return prefill_cost_.active() ? cost_of(s).units(s.cache->n_tokens(), n) : double(n);
  };
  // With sequences decoding, the prefills' budget is counted in depth-0 tokens (prefill_cost).
  bool by_cost = false;
  // EngineOptions::draft_max, after pass 0 gave each decode its token: drafts from what is left of
  // the budget, past a floor kept for the prefills waiting (the oldest's sure share), and within the
  // pages the pool has without preempting anyone (a draft may be thrown away); in the order the
  // decodes were scheduled. A draft is within the tokens its sequence may still generate and the
  // context, and makes a step that keeps any number of its tokens.
  const auto add_drafts = [&]() {
    bool prefills = false;
    for (size_t i = 0; i < running_.size(); ++i) {
      const Seq& s = *running_[i];
      prefills |= !s.preempted && !s.done && !scheduled[i] && int(s.tokens.size()) - s.cache->n_tokens() > 1;
    }
    const int floor = prefills ? std::min(budget, oldest_prefill_tokens_) : 0;
    for (Item& it : items) {
      Seq& s = *it.s;
      if (budget - floor <= 0) break;
      if (s.draft_len == 0) s.draft_len = opt_.draft_max;
      const int room = std::min({s.draft_len, s.req.params.max_tokens - int(s.res.tokens.size()) - 1,
                                 ctx_ - int(s.tokens.size()) - 1, budget - floor});
      if (room <= 0) continue;
      std::vector<int32_t> d = ngram_draft(s.tokens, opt_.draft_ngram_min, opt_.draft_ngram_max, room);
      const size_t one = size_t(s.cache->pages_needed(1));
      while (!d.empty() && (!s.cache->step_keeps_any(1 + int(d.size())) ||
                            reserved - one + size_t(s.cache->pages_needed(1 + int(d.size()))) > pool_->n_available()))
        d.pop_back();
      if (d.empty()) continue;
      const int k = int(d.size());
      reserved += size_t(s.cache->pages_needed(1 + k)) - one;
      budget -= k;
      decode_units += units(s, 1 + k) - units(s, 1);
      it.n = 1 + k;
      it.spec = true;
      s.tokens.insert(s.tokens.end(), d.begin(), d.end());  // the rows' input while the step runs
      s.drafts = std::move(d);
    }
  };
  // Pass 0: decodes; pass 1: the prefills' shares; pass 2: what is left of the budget (freed by a
  // preemption in pass 1, or shares' units that bought no whole token) to the prefills not
  // scheduled yet, oldest first.
  for (int pass = 0; pass < 3; ++pass) {
    if (pass == 1) {
      if (opt_.draft_max > 0) add_drafts();
      by_cost = !items.empty() && prefill_cost_.active();
      // --tpot-target-ms: the decoding sequences' next token is this step's end; the prompt units
      // it carries are what the expected step time leaves of the target (StepTimeFit: the fit, or
      // before it a cautious price).
      if (opt_.tpot_target_ms > 0 && decoding) {
        const double within = step_fit_.prefill_within(decode_units, opt_.tpot_target_ms / 1000);
        if (within >= 0) budget = std::min(budget, std::max(kTpotTargetMinPrefill, int(std::min(within, 1e9))));
      }
      // The prefills' shares of what the decodes left; a deferred prefill gets none.
      std::vector<size_t> idx;
      std::vector<int> limits, left;
      for (size_t i = 0; i < running_.size(); ++i) {
        Seq& s = *running_[i];
        if (s.preempted || s.done || scheduled[i]) continue;
        const int pending = int(s.tokens.size()) - s.cache->n_tokens();
        if (pending == 1 || defer_prefill(s, i)) continue;
        const int start = s.cache->n_tokens(), limit = prefill_limit(s, pending);
        idx.push_back(i);
        left.push_back(by_cost ? cost_of(s).cost(start, pending) : pending);
        limits.push_back(by_cost ? cost_of(s).cost(start, limit) : limit);
      }
      const std::vector<int> got = prefill_shares(limits, left, budget, oldest_prefill_tokens_);
      for (size_t k = 0; k < idx.size(); ++k) {
        const Seq& s = *running_[idx[k]];
        const int pending = int(s.tokens.size()) - s.cache->n_tokens();
        if (!by_cost || got[k] == 0) {
          share[idx[k]] = got[k];
          continue;
        }
        // The tokens a share pays for; the oldest prefill gets one even if it costs more than its
        // share, so that it always progresses (another one gets none: its units go to pass 2).
        const int t = cost_of(s).tokens_for(s.cache->n_tokens(), got[k], prefill_limit(s, pending));
        share[idx[k]] = k == 0 ? std::max(1, t) : t;
      }
    }
    // Pass 1's shares were fitted to the budget: each runs even if the oldest's first token
    // cost more than its share and emptied the budget.
    for (size_t i = 0; i < running_.size() && (pass == 1 || budget > 0); ++i) {
      Seq& s = *running_[i];
      if (s.preempted || s.done || scheduled[i]) continue;
      const int pending = int(s.tokens.size()) - s.cache->n_tokens();
      if ((pass == 0) != (pending == 1)) continue;
      if (pass == 1 && share[i] == 0) continue;
      if (pass >= 1 && defer_prefill(s, i)) continue;
      const bool all = scores_all(s);
      const int n = pass == 0   ? 1
                    : pass == 1 ? share[i]
                    : by_cost   ? cost_of(s).tokens_for(s.cache->n_tokens(), budget, prefill_limit(s, pending))
                                : std::min(prefill_limit(s, pending), budget);
      if (n <= 0) continue;
      const size_t need = size_t(s.cache->pages_needed(n));
      bool self_preempted = false;
      while (need + reserved > pool_->n_available()) {
        // Preempt the most recently admitted sequence that is not in this step.
        size_t j = running_.size();
        while (j-- > 0)
          if (!scheduled[j] && !running_[j]->preempted && !running_[j]->done) break;
        if (j == i) {
          bool others = false;
          for (size_t k = 0; k < running_.size(); ++k)
            if (k != i && !running_[k]->preempted && !running_[k]->done) others = true;
          if (!others) {
            // Alone and still no room: the pool cannot hold this sequence.
            finish(s, s.res.tokens.empty() ? "error" : "length",
                   s.res.tokens.empty() ? "the KV pool is too small for this prompt" : "");
          } else {
            preempt(i);
          }
          self_preempted = true;
          break;
        }
        preempt(j);
      }
      if (self_preempted) continue;
      reserved += need;
      scheduled[i] = 1;
      budget -= pass >= 1 && by_cost ? std::min(budget, cost_of(s).cost(s.cache->n_tokens(), n)) : n;
      (pass == 0 ? decode_units : prompt_units) += units(s, n);
      // A sequence that has sampled before waits on this step for its next token (a first token
      // of a prompt found whole in the cache is a decode row too, but no one's time per token).
      if (pass == 0 && s.t_last != 0) decoding = true;
      items.push_back({&s, n, n == pending, all, s.cache->n_tokens()});
    }
  }

  if (!items.empty()) {
    std::vector<ForwardSeq> fs;
    fs.reserve(items.size());
    for (const Item& it : items) {
      ForwardSeq f;
      f.tokens = it.s->tokens.data() + it.s->cache->n_tokens();
      f.n = it.n;
      f.cache = it.s->cache.get();
      f.logits = it.all || it.spec ? ForwardSeq::all : it.logits ? ForwardSeq::last : ForwardSeq::none;
      f.hold = it.spec;  // committed with what the verification keeps
      fs.push_back(f);
    }
    const float* logits = nullptr;
    bool ok = false;
    try {
      logits = fwd_->eval_batch(fs.data(), int(fs.size()));
      ok = true;
    } catch (const KvPoolFull&) {
      // Not expected (pages were checked), but a sequence of the batch may be half-appended:
      // every sequence of the batch is recomputed (without its drafts).
      for (const Item& it : items) {
        it.s->tokens.resize(it.s->tokens.size() - it.s->drafts.size());
        it.s->drafts.clear();
        for (size_t i = 0; i < running_.size(); ++i)
          if (running_[i].get() == it.s) preempt(i);
      }
    } catch (const std::exception& e) {
      for (const Item& it : items) {
        it.s->tokens.resize(it.s->tokens.size() - it.s->drafts.size());
        it.s->drafts.clear();
        finish(*it.s, "error", e.what());
      }
    }
    if (ok) {
      const int n_vocab = model_->config().n_vocab;
      // The constrained sequences' masks (JSON mode, json_schema) first, over the threads when
      // several share the step: each is a walk of the vocabulary (0.1-0.5 ms), which would
      // otherwise run one after another here.
      {
        std::vector<std::pair<Seq*, const float*>> masks;
        int r = 0;
        for (const Item& it : items) {
          if (it.spec) {  // (masked row by row in verify_drafts)
            r += it.n;
            continue;
          }
          if (it.all) r += it.n - 1;
          if (!it.logits) {
            if (it.all) ++r;
            continue;
          }
          const float* lg = logits + size_t(r++) * size_t(n_vocab);
          if (it.s->grammar && it.s->req.params.max_tokens != 0) masks.emplace_back(it.s, lg);
        }
        if (!masks.empty()) {
          const GrammarVocab& gv = grammar_vocab();
          const auto mask = [&](size_t i) {
            Seq& s = *masks[i].first;
            s.masked.assign(masks[i].second, masks[i].second + n_vocab);
            grammar_mask(*s.grammar, gv, s.req.params.stop_token_ids, s.masked.data(), n_vocab);
          };
          if (masks.size() == 1) mask(0);
          else threads_->parallel_for(masks.size(), 1, [&](size_t b, size_t e) {
            for (size_t i = b; i < e; ++i) mask(i);
          });
        }
      }
      int row = 0;
      for (const Item& it : items) {
        Seq& s = *it.s;
        if (it.spec) {
          verify_drafts(s, it.n, logits + size_t(row) * size_t(n_vocab), n_vocab);
          row += it.n;
          continue;
        }
        s.cache->publish_pages(*index_, s.tokens.data(), s.cache->n_tokens());
        if (it.all) {
          // Row j: the distribution of the token at position start + j + 1.
          const int top = std::max({0, s.req.params.logprobs, s.req.params.prompt_logprobs_top});
          auto& pl = s.res.prompt_logprobs;
          for (int j = 0; j < it.n; ++j) {
            const int p = it.start + j + 1;
            if (p < s.n_prompt) pl[size_t(p)] = token_logprob(logits + size_t(row + j) * size_t(n_vocab), n_vocab, s.tokens[size_t(p)], top);
          }
          row += it.n - 1;  // the last row is the sampling row when it.logits
          if (!it.logits) {
            ++row;
            continue;
          }
        } else if (!it.logits) {
          continue;
        }
        const float* lg = logits + size_t(row++) * size_t(n_vocab);
        if (s.req.params.max_tokens == 0) {  // prompt log-probabilities only
          finish(s, "length");
          continue;
        }
        const float* sample_from = s.grammar ? s.masked.data() : lg;  // masked above
        int32_t next = forced_token(s);
        if (next < 0) next = s.sampler->sample(sample_from, n_vocab, s.tokens, size_t(s.n_prompt));
        take_token(s, next, lg, n_vocab);
      }
      const double took = now_seconds() - t_step;
      if (decoding) {
        std::lock_guard<std::mutex> lk(mu_);
        metrics_.decode_step.observe(took);
      }
      // The fit models the step's computation: offload reads (restore_offloaded) are left out.
      const double computed = std::max(0.0, took - restore_seconds_);
      step_fit_.observe(decode_units, prompt_units,
                        opt_.step_seconds ? opt_.step_seconds(decode_units, prompt_units, computed) : computed);
    }
  }

  // Preempted sequences go back to the front of the queue, oldest admission first.
  std::vector<std::unique_ptr<Seq>> back;
  for (auto& s : running_)
    if (s->preempted && !s->done) back.push_back(std::move(s));
  for (size_t k = back.size(); k-- > 0;) waiting_.push_front(std::move(back[k]));
  std::erase_if(running_, [](const auto& s) { return !s || s->done; });
  return true;
}

}  // namespace kvq
