#include "engine/engine.h"

#include <algorithm>
#include <future>
#include <random>

#include "core/error.h"
#include "core/timer.h"

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
};

Engine::Engine(const EngineOptions& o) : opt_(o) {
  if (o.max_batch < 1) fail("--max-batch must be >= 1 (got {})", o.max_batch);
  if (o.max_running < 1) fail("max running sequences must be >= 1 (got {})", o.max_running);
  if (o.threads < 0) fail("--threads must be >= 1 (got {})", o.threads);
  if (o.ctx < 0) fail("context must be > 0 (got {})", o.ctx);
  model_ = Model::load(o.model_path);
  tok_ = Tokenizer::from_gguf(model_->file());
  const ModelConfig& c = model_->config();
  ctx_ = o.ctx > 0 ? std::min(o.ctx, c.n_ctx_train) : c.n_ctx_train;
  kv_ = kv_flags_resolve(o.kv, c);
  kcfg_ = model_->kv_cache_config(kv_.policy, ctx_, o.kv.page_tokens);
  kcfg_.calib = kv_.calib.get();
  kcfg_.model_id = o.model_path;
  const int threads = o.threads > 0 ? o.threads : int(std::max(1u, std::thread::hardware_concurrency()));
  threads_ = std::make_unique<ThreadPool>(threads);
  fwd_ = std::make_unique<Forward>(*model_, *threads_, o.max_batch);
  const size_t page_bytes = kv_cache_page_bytes(kcfg_);
  const int P = kcfg_.page_tokens;
  if (o.kv_mem > 0) {
    pool_ = PagePool::from_bytes(o.kv_mem, page_bytes, P);
  } else if (o.kv_tokens > 0) {
    pool_ = PagePool::from_tokens(o.kv_tokens, page_bytes, P);
  } else {
    // Default: room for 8 full contexts, at most 2 GiB.
    const size_t pages = (size_t(ctx_) * 8 + size_t(P) - 1) / size_t(P);
    pool_ = PagePool::from_bytes(std::min(pages * page_bytes, size_t(2) << 30), page_bytes, P);
  }
  KvCache probe(kcfg_, pool_.get());
  index_ = std::make_unique<PrefixIndex>(probe.prefix_identity(), P);
  pool_->set_evictor(index_.get());
  metrics_.kv_tokens_capacity = pool_->tokens_capacity();
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
  pool_->evict_idle();
  pool_->set_evictor(nullptr);
}

void Engine::start() {
  std::lock_guard<std::mutex> lk(mu_);
  if (thread_.joinable()) return;
  thread_ = std::thread([this] { loop(); });
}

uint64_t Engine::submit(GenRequest r) {
  auto s = std::make_unique<Seq>();
  s->t_submit = now_seconds();
  s->n_prompt = int(r.prompt.size());
  s->res.prompt_tokens = s->n_prompt;
  s->tokens = r.prompt;
  s->req = std::move(r);
  std::string err;
  const int P = kcfg_.page_tokens;
  if (s->tokens.empty()) {
    err = "the prompt is empty";
  } else if (s->n_prompt >= ctx_) {
    err = fmt::format("the prompt is {} tokens, the context is {}", s->n_prompt, ctx_);
  } else if (size_t((s->n_prompt + 1 + P - 1) / P) > pool_->n_pages()) {
    err = fmt::format("the prompt is {} tokens, the KV pool holds {}", s->n_prompt, pool_->tokens_capacity());
  } else {
    for (int32_t t : s->tokens)
      if (t < 0 || t >= tok_.n_vocab()) {
        err = fmt::format("token id {} is outside the vocabulary [0, {})", t, tok_.n_vocab());
        break;
      }
  }
  std::unique_lock<std::mutex> lk(mu_);
  const uint64_t id = next_id_++;
  s->id = id;
  if (!err.empty() || s->req.params.max_tokens <= 0) {
    lk.unlock();
    finish(*s, err.empty() ? "length" : "error", err);
    return id;
  }
  s->sampler = std::make_unique<Sampler>(s->req.params.sampling);
  s->dec = std::make_unique<TokenStreamDecoder>(tok_, false);
  incoming_.push_back(std::move(s));
  metrics_.waiting = int(incoming_.size() + waiting_.size());
  lk.unlock();
  cv_.notify_all();
  return id;
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
    metrics_.kv_tokens_capacity = pool_->tokens_capacity();
    metrics_.prefix_query_tokens = ps.query_tokens;
    metrics_.prefix_hit_tokens = ps.hit_tokens;
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

// Cuts text before the first stop string that starts at or after `from`; true when found.
static bool cut_at_stop(std::string& text, size_t from, const std::vector<std::string>& stops) {
  size_t best = std::string::npos;
  for (const auto& st : stops) {
    if (st.empty()) continue;
    const size_t p = text.find(st, from);
    if (p < best) best = p;
  }
  if (best == std::string::npos) return false;
  text.resize(best);
  return true;
}

void Engine::finish(Seq& s, const char* reason, const std::string& error) {
  if (s.done) return;
  s.done = true;
  if (s.cache) s.cache->release();
  if (s.dec && std::string(reason) != "error" && std::string(reason) != "cancelled") {
    size_t from = s.sent;
    s.text += s.dec->flush();
    if (cut_at_stop(s.text, from, s.req.params.stop)) reason = "stop";
    emit_text(s, true);
  }
  s.res.finish_reason = reason;
  s.res.error = error;
  s.res.text = s.text;
  s.res.completion_tokens = int(s.res.tokens.size());
  {
    std::lock_guard<std::mutex> lk(mu_);
    cancelled_.erase(s.id);
    ++metrics_.requests_finished;
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
  ++s.res.preemptions;
  std::lock_guard<std::mutex> lk(mu_);
  ++metrics_.preemptions;
}

bool Engine::step() {
  // Cancellations.
  std::unordered_set<uint64_t> canc;
  {
    std::lock_guard<std::mutex> lk(mu_);
    canc = cancelled_;
  }
  if (!canc.empty()) {
    for (auto& s : running_)
      if (canc.count(s->id)) finish(*s, "cancelled");
    for (auto& s : waiting_)
      if (canc.count(s->id)) finish(*s, "cancelled");
    std::erase_if(running_, [](const auto& s) { return s->done; });
    std::erase_if(waiting_, [](const auto& s) { return s->done; });
  }

  // FIFO admission: the head waits until the pages of its whole prompt are available.
  while (!waiting_.empty() && running_.size() < size_t(opt_.max_running)) {
    Seq& s = *waiting_.front();
    const int n = int(s.tokens.size());
    if (!s.cache) s.cache = std::make_unique<KvCache>(kcfg_, pool_.get());
    const KvPrefixMatch m = index_->lookup(s.tokens.data(), n - 1);
    const size_t need = kv_admit_pages(*pool_, m, n);
    if (need > pool_->n_available()) {
      if (running_.empty()) {
        // Nothing else holds pages: this sequence cannot fit in the pool at all.
        finish(s, s.res.tokens.empty() ? "error" : "length",
               s.res.tokens.empty() ? "the KV pool is too small for this prompt" : "");
        waiting_.pop_front();
        continue;
      }
      break;
    }
    s.preempted = false;
    s.res.cached_tokens = s.cache->adopt_prefix(*index_, s.tokens.data(), n, n - 1);
    running_.push_back(std::move(waiting_.front()));
    waiting_.pop_front();
  }
  if (running_.empty()) return false;

  // Build the step: decodes first, then prefill chunks, oldest first, within the token budget and
  // the pages the pool can supply (checked here so eval_batch never runs out midway).
  struct Item {
    Seq* s;
    int n;
    bool logits;
  };
  std::vector<Item> items;
  std::vector<char> scheduled(running_.size(), 0);
  int budget = fwd_->max_batch();
  size_t reserved = 0;
  for (int pass = 0; pass < 2; ++pass) {
    for (size_t i = 0; i < running_.size() && budget > 0; ++i) {
      Seq& s = *running_[i];
      if (s.preempted || s.done || scheduled[i]) continue;
      const int pending = int(s.tokens.size()) - s.cache->n_tokens();
      if ((pass == 0) != (pending == 1)) continue;
      const int n = std::min(pending, budget);
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
      budget -= n;
      items.push_back({&s, n, n == pending});
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
      f.logits = it.logits ? ForwardSeq::last : ForwardSeq::none;
      fs.push_back(f);
    }
    const float* logits = nullptr;
    bool ok = false;
    try {
      logits = fwd_->eval_batch(fs.data(), int(fs.size()));
      ok = true;
    } catch (const KvPoolFull&) {
      // Not expected (pages were checked), but a sequence of the batch may be half-appended:
      // every sequence of the batch is recomputed.
      for (const Item& it : items) {
        for (size_t i = 0; i < running_.size(); ++i)
          if (running_[i].get() == it.s) preempt(i);
      }
    } catch (const std::exception& e) {
      for (const Item& it : items) finish(*it.s, "error", e.what());
    }
    if (ok) {
      const int n_vocab = model_->config().n_vocab;
      int row = 0;
      for (const Item& it : items) {
        Seq& s = *it.s;
        s.cache->publish_pages(*index_, s.tokens.data(), s.cache->n_tokens());
        if (!it.logits) continue;
        const float* lg = logits + size_t(row++) * size_t(n_vocab);
        const int32_t next = s.sampler->sample(lg, n_vocab, s.tokens);
        const double now = now_seconds();
        {
          std::lock_guard<std::mutex> lk(mu_);
          if (s.res.tokens.empty() && s.t_last == 0) metrics_.ttft.observe(now - s.t_submit);
          else metrics_.tpot.observe(now - s.t_last);
        }
        s.t_last = now;
        if (tok_.is_eog(next)) {
          finish(s, "stop");
          continue;
        }
        s.tokens.push_back(next);
        s.res.tokens.push_back(next);
        const size_t from = s.sent;
        s.text += s.dec->push(next);
        if (cut_at_stop(s.text, from, s.req.params.stop)) {
          s.dec.reset();  // pending bytes come after the cut
          finish(s, "stop");
          continue;
        }
        emit_text(s, false);
        if (int(s.res.tokens.size()) >= s.req.params.max_tokens || int(s.tokens.size()) >= ctx_) {
          finish(s, "length");
          continue;
        }
      }
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
