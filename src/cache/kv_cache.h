// The KV cache of one sequence: for every layer, K and V in that layer's codecs, stored in pages
// of `page_tokens` tokens (a page holds every layer's K and V head blocks), plus a full-precision
// tail for grouped codecs (KIVI/KVQuant keys) and their residual window.
//
// A step appends n tokens to every layer (append), runs attention for queries at the new
// positions (attend_head), then commit()s. Which tokens are read packed and which from the tail
// depends only on the query position (kv_quantized_tokens), so a prompt gives the same result
// whether it is processed in one chunk or many, or token by token.
//
// Pages come from one of two places:
//  - private (no pool; `kvq run`, eval, tests): the cache allocates its own zeroed pages as it
//    grows and frees them in clear()/the destructor;
//  - a shared PagePool (serving): the cache keeps a block table (page ids, page i holds tokens
//    [i*P, (i+1)*P)) and takes pages from the pool, so every sequence draws on one budget.
//    Pages can be shared between sequences (prefix cache, fork) with reference counts; a shared
//    page is never written: the first write into it copies it (copy-on-write).
//
// Serving API (pool mode), in the order a scheduler uses it; everything on the scheduler thread:
//   PagePool pool(n, kv_cache_page_bytes(cfg), P) or PagePool::from_bytes (cache.pages_at(tokens,
//   step) pages hold one sequence of that many tokens computed in steps of up to `step`);
//   index = kv_cache_prefix_index(cache); pool.set_evictor(index.get());
//   admit:    m = index.lookup(prompt, n_prompt - 1); admit when
//             cache.admit_pages(m, n_prompt, step) <= pool.n_available() (new pages for the rest
//             of the prompt, plus matched pages that are idle now: adopting them makes them
//             used, so they leave the available count);
//   adopt:    cache.adopt_prefix(index, prompt, n_prompt, n_prompt - 1) -> tokens already
//             computed (a multiple of P); count the query in the index's hit statistics;
//   prefill:  Forward::eval(prompt + done, chunk, cache) in chunks; before each chunk
//             pages_needed(chunk) <= pool.n_available() avoids the exception path;
//   publish:  cache.publish_pages(index, tokens, n_tokens()) after each step caches the newly
//             full pages so later prompts with the same prefix can adopt them;
//   pool full: append (inside Forward::eval) throws KvPoolFull before changing anything: the
//             cache is still at its last committed length; release() a sequence (preempt) and
//             recompute it later;
//   finish:   release() returns every page (unref): pages that are cached stay resident as idle
//             pages (evicted LRU when the pool needs them), the others go back on the free list.
//   metrics:  pool.usage(), cache.tokens_in_pages(pool.n_pages()), index.stats() (query/hit tokens).
//
// Sliding-window layers (Gemma 3: 5 of every 6 layers see the last 512 positions only) keep their
// blocks in page groups of their own, so that the pages behind the window can be freed while the
// full-attention layers' pages stay. A page group is a set of layers with one window (0: full
// attention) and its own block table: page i of group g holds tokens [i*P, (i+1)*P) of g's layers.
// A sliding group's page goes (pool: unref; private: kept for reuse, zeroed) once every one of its
// layers' next query lies past it and no grouped codec will still pack into it, so such a layer
// holds about its window plus one step of tokens instead of the whole sequence (Gemma 3 270M at 4K
// tokens: 3 of 18 layers grow with the context). Reading a freed page is a checked error.
//  - private caches: one group for the full-attention layers, one per window size;
//  - pool caches: every group's page must fit the pool's one page size, so the sliding layers are
//    split into groups whose pages are no larger than the largest of the full-attention group's
//    page and one sliding layer's (Gemma 3 270M: 3 global layers, 15 sliding ones in 5 groups of 3,
//    all pages the same size; vLLM's hybrid KV cache manager does the same). Group 0 holds the
//    full-attention layers and names the prefix-cache chain; a model without a full-attention
//    layer (every layer sliding) keeps one group that is never freed in a pool. A cached prefix
//    holds, besides its group-0 pages, the sliding groups' pages its window still reads
//    (PrefixIndex); the pool's pages are counted per group (pages_at).
//
// Grouped codecs and the prefix cache. A grouped codec with a residual window R > 0 (KIVI
// defaults: G=32, R=128) keeps the newest >= R tokens in full precision outside the pages, so the
// state of a sequence at any length > 0 includes floats that no page holds; a prefix adopted from
// pages alone would read those tokens packed where a sequence computed from scratch reads them
// from its tail, i.e. give different results. kvq therefore shares prefixes only when every
// layer's tail is empty at page boundaries: all codecs per-token, or grouped with R = 0 (G
// divides P, so kv_quantized_tokens(k*P) == k*P). prefix_shareable() says which; for other
// policies adopt_prefix() adopts nothing (the prompt is computed in full, the query counted as a
// miss) and publish_pages() caches nothing.
// Why not share the packed pages and recompute only the tail: the packed pages of a prefix are
// the same in every sequence (the K/V of a token depend only on the tokens before it), but the
// state at a page boundary k*P also holds the floats of tokens [q(k*P), k*P) (q = quantized
// count, R..R+G-1 tokens), and recomputing those floats exactly is not possible from the pages:
// the K/V of token t are computed by attention whose query at t reads tokens [q(t+1), t] from the
// tail in full precision, and q(t+1) < q(k*P) for the first tail tokens (e.g. G=32, R=128,
// k*P=1024: q=896, and the query at 896 reads tokens 768..895 unquantized). Those floats were
// in turn computed from earlier unquantized tails, back to token 0: an exact recompute of the
// tail is a recompute of the whole prefix. Sharing the pages with a tail recomputed from packed
// keys would give results that differ from serving the request alone, which kvq does not allow.
// Storing the boundary's tail floats with each cached page (R+G rows per layer, K and V, f32:
// for SmolLM2-135M ~5.9 MB per boundary against ~0.2 MB for a 64-token kivi2 page) would keep it
// exact but costs ~30x the page it accompanies; not implemented.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "attn/attention.h"
#include "cache/page_pool.h"
#include "cache/prefix_index.h"
#include "core/aligned.h"
#include "kv/policy.h"
#include "kvq/kv_format.h"

namespace kvq {

struct KvCacheConfig {
  int n_layer = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int page_tokens = 64;
  int max_tokens = 0;                 // capacity (the model's context)
  KvPolicy policy;                    // per-layer codecs
  std::vector<KvRope> rope;           // per layer (for pre-RoPE key codecs)
  // Per layer: the positions a sliding-window layer's queries see (0 or absent: all). Such layers
  // keep their blocks in page groups of their own, freed behind the window (see the header comment).
  std::vector<int> window;
  uint64_t seed = 0x6b7671;
  const nlohmann::json* calib = nullptr;
  int group_tokens = 0;               // grouped codecs: G (0 = codec default)
  int residual_tokens = -1;           // grouped codecs: R (-1 = codec default)
  double outlier_fraction = -1;       // dense-and-sparse key codecs (-1 = codec default)
  int sink_tokens = -1;               // codecs with an exact sink (-1 = codec default)
  std::string model_id;               // names the weights (file, hash): part of prefix_identity()
};

class KvCache {
 public:
  // pool == null: private pages. Otherwise pages come from the pool, whose page_tokens and
  // page_bytes must equal this cache's (kv_cache_page_bytes(cfg)); the pool must outlive the
  // cache. Throws kvq::Error on invalid codecs/params or a mismatched pool.
  explicit KvCache(const KvCacheConfig& cfg, PagePool* pool = nullptr);
  ~KvCache();
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;

  int n_tokens() const { return n_tokens_; }
  int capacity() const { return cfg_.max_tokens; }
  const KvCacheConfig& config() const { return cfg_; }
  const KvCodec& k_codec(int layer) const { return *layers_[size_t(layer)].k; }
  const KvCodec& v_codec(int layer) const { return *layers_[size_t(layer)].v; }

  // Appends n new tokens (positions n_tokens() .. n_tokens()+n-1) of layer `layer`.
  // k_pre: (n, n_kv_heads, head_dim) keys before RoPE (only read by pre-RoPE codecs; may be null
  // otherwise); k: keys after RoPE; v: values. Rows are contiguous.
  void append(int layer, int n, const float* k_pre, const float* k, const float* v);
  // Attention for one query position `pos` (n_tokens() <= pos < n_tokens() + n appended) and KV
  // head `head`: q (n_q, head_dim) -> out (n_q, head_dim). window > 0: sees the last `window`
  // positions only. scratch: attend_scratch_floats(n_q) floats, private to the calling thread.
  // ap.sinks, when set, holds the layer's sink logits for every query head (n_kv_heads x n_q):
  // head `head`'s n_q from head * n_q on (attend_rows likewise; attend_head_part's states leave
  // them to attn_merge_parts).
  void attend_head(int layer, int head, int pos, const float* q, int n_q, const AttnParams& ap,
                   int window, float* out, float* scratch, std::vector<KvBlockSpan>& spans) const;
  // A part of attend_head's work, for splitting one head's context over threads (the engine's
  // decode, attn_balance_pieces): the online-softmax state (attn_decode_part) over the tokens
  // attend_head reads at offsets [from, to) of its order (packed spans by position, then the f32
  // tail), 0 <= from <= to <= visible_tokens(pos, window). A span belongs to the part that holds
  // its first token and the tail to the part that holds the tail's first token, so parts that
  // tile [0, visible) read every token once; merged (attn_merge_parts, in order) they give
  // attend_head's result up to float rounding. part: attend_part_floats(n_q) floats; scratch as
  // attend_head's.
  void attend_head_part(int layer, int head, int pos, const float* q, int n_q, const AttnParams& ap, int window,
                        int from, int to, float* part, float* scratch, std::vector<KvBlockSpan>& spans) const;
  size_t attend_part_floats(int n_q) const;
  // How many tokens a query at `pos` sees with this window (attend_head's range).
  static int visible_tokens(int pos, int window) { return window > 0 ? std::min(pos + 1, window) : pos + 1; }
  // Attention for n_rows consecutive query positions pos, pos+1, ... of the current step (a
  // prefill chunk) and KV head `head`, rows that see the same packed blocks batched into one
  // attn_prefill call (each block decoded once for all of them): per-token codecs and grouped
  // ones within a group; rows whose window start differs go one by one. q: (n_rows, n_q,
  // head_dim) -> out, same shape. Row r's result is attend_head's for position pos + r.
  // scratch: attend_scratch_floats(n_q * n_rows) floats.
  void attend_rows(int layer, int head, int pos, int n_rows, const float* q, int n_q, const AttnParams& ap,
                   int window, float* out, float* scratch, std::vector<KvBlockSpan>& spans) const;
  size_t attend_scratch_floats(int n_q) const;
  // Ends the step: the n appended tokens become part of the sequence. keep < n (speculative
  // verification: the step ran n drafted tokens and the first `keep` were right) keeps only the
  // first keep: the cache is then as if only they had been appended (the others' slots are written
  // again by the next step; pages the step added past them are given back). A step may keep fewer
  // only when it packed no token group of a grouped codec (step_keeps_any(n) before appending).
  void commit(int n, int keep = -1);
  // True when a step of n tokens may end keeping any number of them (commit(n, keep)): none of the
  // grouped codecs (kivi*, kvquant*) packs a group during it. Per-token codecs always may.
  bool step_keeps_any(int n) const;
  // Drops everything (new sequence). Pool mode: the same as release().
  void clear();

  // ---- paging (see the header comment)
  PagePool* pool() const { return pool_; }
  // Page groups: group g's window (0: full attention; group 0 in a pool always is).
  int n_groups() const { return int(groups_.size()); }
  int group_window(int g) const { return groups_[size_t(g)].window; }
  int layer_group(int layer) const { return layers_[size_t(layer)].pgroup; }
  // Block table of group g: page ids, page i holding tokens [i*P, (i+1)*P), kv_page_none for
  // pages freed behind a window (pool mode; empty otherwise).
  const std::vector<KvPageId>& block_table(int g = 0) const { return groups_[size_t(g)].table; }
  // Pages held, all groups (pool mode: referenced; private: allocated and not freed).
  int n_pages() const;
  // Positions (pages of P tokens) a sequence of n tokens spans.
  int pages_for(int n_tokens) const { return (n_tokens + cfg_.page_tokens - 1) / cfg_.page_tokens; }
  // Pages, all groups, a sequence of n tokens references at most: every position's page in
  // full-attention groups, those its windows still read in sliding ones. step > 0: while a step of
  // up to `step` tokens that brings it to n runs (its first queries still read the window before
  // it: a sliding group then holds about window + step tokens); 0: between steps (after
  // publish_pages when the sequence publishes). An upper bound whatever the steps' alignment to
  // pages, and non-decreasing in n.
  size_t pages_at(int n_tokens, int step = 0) const;
  // Of the pages a prefix of k cached positions brings (PrefixIndex::lookup: group 0's k, a
  // sliding group's within its window at k), those the sequence still references when the last
  // step of its n_prompt-token prompt (steps of up to `step` tokens) starts.
  size_t prefix_pages_kept(int k, int n_prompt, int step) const;
  // The most tokens one sequence can hold in `pages` pages, reaching them in steps of at most
  // `step` tokens (the inverse of pages_at; may exceed capacity()).
  int tokens_in_pages(size_t pages, int step = 0) const;
  // Pages the pool must supply to append n more tokens in one step: new pages plus copies of
  // shared pages that the step writes into. 0 in private mode.
  int pages_needed(int n) const;
  // Pages that admitting a prompt of n_prompt tokens with the cached prefix m (PrefixIndex::lookup)
  // takes out of the pool's available pages: those of the prompt's tokens after the prefix, plus
  // the matched pages that are idle now (adopting makes them used). Pool mode.
  // step: the most prompt tokens one step computes (pages_at).
  size_t admit_pages(const KvPrefixMatch& m, int n_prompt, int step = 0) const;
  // Returns every page to the pool (last page first, so that cached pages of a chain are evicted
  // deepest first) and empties the sequence. Private mode: frees the pages.
  void release();
  // Makes this (empty) cache a copy of src at its committed length, sharing src's pages (ref
  // counts; whichever sequence writes a shared partial page first copies it). Both caches must
  // use the same pool (or both none: then pages are copied) and the same prefix_identity().
  void fork_from(const KvCache& src);

  // ---- prefix cache
  // Everything that changes the bytes of a page, as one string (the PrefixIndex identity).
  std::string prefix_identity() const;
  // True when a page-aligned prefix leaves nothing outside the pages (no grouped codec with a
  // residual window), i.e. when pages alone can be adopted.
  bool prefix_shareable() const { return shareable_; }
  // The sequence will publish its pages to index (publish_pages after every step): its sliding
  // groups keep their full pages until published, so the cached prefix has them too.
  // adopt_prefix implies it; a sequence that publishes without adopting calls it before its first
  // step.
  void publish_to(const PrefixIndex& index);
  // Adopts the longest cached prefix of tokens (n_prompt,), at most max_tokens tokens (pass
  // n_prompt - 1 so the last prompt token is computed and yields logits): the cached pages are
  // referenced, not copied, and n_tokens() becomes the adopted length (a multiple of P). Counts
  // the query (n_prompt tokens, adopted tokens as hits) in the index. Requires an empty cache in
  // pool mode and index.identity() == prefix_identity(). Returns the adopted token count (0 when
  // nothing matched or !prefix_shareable()). readmission: the sequence was preempted and is admitted
  // again; its query (and extend_prefix's hits) go to the index's re-admission counters.
  int adopt_prefix(PrefixIndex& index, const int32_t* tokens, int n_prompt, int max_tokens, bool readmission = false);
  // Extends the adopted prefix with cached pages published since (by a sequence that was
  // prefilling the same prefix). Only when everything the cache holds is whole cached pages
  // (n_tokens() == page_hashes().size() * P, no partial page, no open step): then the state at
  // n_tokens() is exactly pages, and more matching pages can be referenced as adopt_prefix would
  // have done had they been cached at admission. At most max_tokens tokens in all (n_prompt - 1).
  // Counts the adopted tokens as extra hits of the query adopt_prefix counted. Returns the
  // tokens added (0 when nothing matched, !prefix_shareable(), or the cache holds private tokens).
  int extend_prefix(PrefixIndex& index, const int32_t* tokens, int n_prompt, int max_tokens);
  // True when extend_prefix may add pages: every token held is in whole, cached pages.
  bool prefix_extendable() const;
  // Caches the sequence's full pages that are not cached yet. tokens: (n,) the sequence's token
  // ids, n == n_tokens() (the cache does not see token ids: Forward passes it activations only).
  // Returns the number of pages newly inserted. No-op when !prefix_shareable().
  int publish_pages(PrefixIndex& index, const int32_t* tokens, int n);
  // Chain hashes of the leading full pages this sequence has published or adopted.
  const std::vector<KvHash>& page_hashes() const { return hashes_; }

  // Bytes of one page that belong to layer `layer` (its K and V head blocks, all KV heads).
  size_t layer_page_bytes(int layer) const {
    const Layer& L = layers_[size_t(layer)];
    return (L.k_block + L.v_block) * size_t(cfg_.n_kv_heads);
  }
  // Bytes of every layer's K and V blocks for one page of tokens (codes, scales, norms), in
  // whichever page groups they live.
  size_t page_bytes() const { return page_bytes_; }
  // Page bytes held: pool mode, the pages referenced (shared pages counted in full, at the pool's
  // page size); private mode, every group's pages held (with freed ones kept for reuse).
  size_t bytes_pages() const;
  size_t bytes_tail() const;
  // Bytes of a pool page for this configuration: the largest page group's (kv_cache_page_bytes).
  size_t pool_page_bytes() const { return pool_page_bytes_; }
  // Bytes per token of the packed part, all layers, K and V (from the codecs' block sizes).
  double bytes_per_token() const { return double(page_bytes_) / cfg_.page_tokens; }
  // Bytes per token a sequence of n > 0 tokens costs: each layer's packed tokens at its packed
  // bytes per token, the rest (a full-precision residual window, an unfilled token group) at the
  // f32 tail's (K and V, and the pre-RoPE keys the pre-RoPE codecs keep beside them).
  double bytes_per_token_at(int n) const;
  // Bytes attention reads for one query at position pos, all layers and KV heads, K and V: each
  // layer's visible tokens (its window, KvCacheConfig::window) packed, and the f32 tail rows of
  // grouped codecs. What a decode step's attention streams (model_speed's bandwidth figure).
  double decode_read_bytes(int pos) const;
  // The most f32 tail bytes one sequence holds outside the pages: per layer its residual window and
  // an unfilled token group (G - 1), all KV heads, K and V (and pre-RoPE keys); 0 for per-token
  // formats.
  size_t max_tail_bytes() const;

 private:
  struct Layer {
    std::unique_ptr<KvCodec> k, v;
    int pgroup = 0;                   // page group
    size_t k_off = 0, v_off = 0;      // offsets of the layer's K and V head blocks in its group's page
    size_t k_block = 0, v_block = 0;  // bytes of one head block
    int group = 1, residual = 0;      // the layer's rule for which tokens are packed
    bool pre_rope = false;
    int tail_start = 0;               // absolute position of tail row 0
    // full-precision tail per head: (rows, head_dim); k_pre only for pre-RoPE key codecs
    std::vector<std::vector<float>> tail_k, tail_v, tail_k_pre;
    int pending = 0;                  // tokens appended in the current step
  };
  int quantized(const Layer& L, int n) const { return kv_quantized_tokens(n, L.group, L.residual); }
  // One token's f32 tail row: all KV heads, K and V (and the pre-RoPE keys of pre-RoPE codecs).
  size_t tail_row_bytes(const Layer& L) const;
  struct Reads {
    const float* tk = nullptr;  // tail rows (grouped codecs), head_dim floats apart
    const float* tv = nullptr;
    int n_tail = 0;
  };
  Reads reads(const Layer& L, int head, int start, int end, std::vector<KvBlockSpan>& spans) const;
  // Layer L's page `page` (its K and V blocks at L.k_off / L.v_off).
  const uint8_t* layer_page(const Layer& L, int page) const;
  uint8_t* layer_page(const Layer& L, int page) {
    return const_cast<uint8_t*>(static_cast<const KvCache*>(this)->layer_page(L, page));
  }
  struct Group {
    int window = 0;               // 0: full attention (never freed)
    std::vector<int> layers;
    size_t bytes = 0;             // bytes of this group's page: its layers' K and V blocks
    std::vector<KvPageId> table;  // pool mode: page ids (kv_page_none once freed)
    std::vector<AlignedBuf<uint8_t>> pages, spare;  // private mode: pages (empty once freed), freed ones
    int freed = 0;                // pages [0, freed) are freed
  };
  // The first page of group g that a sequence of n tokens still reads (0 for full groups).
  int group_first_page(const Group& G, int n) const;
  // Tokens before a step's first that a sliding group still holds (pages_at).
  int group_keep_tokens(const Group& G) const;
  // Frees the pages of sliding groups that every one of their layers is past.
  void free_window_pages();
  // Pages [first, last) of group g that a step appending n tokens writes into.
  void written_pages(const Group& G, int n, int* first, int* last) const;
  // Pool mode: unrefs every group's pages, last position first, sliding groups before group 0.
  void unref_pages();
  // Takes the prefix match's pages (referenced) as positions [table size, ...).
  void take_match(const KvPrefixMatch& m);
  // Makes sure a step of n tokens has every page it needs, private and writable; throws
  // KvPoolFull without changing anything when the pool cannot supply them.
  void prepare_step(int n);
  void reset_tokens();
  std::string build_identity() const;

  KvCacheConfig cfg_;
  std::vector<Layer> layers_;
  std::vector<Group> groups_;
  size_t page_bytes_ = 0;                   // every layer's blocks of one page
  size_t pool_page_bytes_ = 0;              // the largest group's page under the pool's grouping
  PagePool* pool_ = nullptr;
  std::vector<KvHash> hashes_;              // chain hashes of pages [0, hashes_.size())
  int n_tokens_ = 0;
  int max_block_tokens_ = 0;
  bool step_open_ = false;                  // pages prepared for the current step
  bool shareable_ = false;
  int step_n_ = 0;                          // tokens of the current step
  std::string identity_;                    // prefix_identity(), built once
  bool readmission_ = false;                // the last adopt_prefix counted as a re-admission
  const PrefixIndex* hashed_by_ = nullptr;  // the index whose keys made hashes_
};

// The parameters layer `layer`'s K and V codecs are created with under this configuration (the
// caller sets the role).
KvCodecParams kv_cache_codec_params(const KvCacheConfig& cfg, int layer);

// Bytes of one pool page for this configuration (the largest page group's K and V head blocks):
// what a PagePool for caches of this configuration must be built with. Throws like KvCache's
// constructor.
size_t kv_cache_page_bytes(const KvCacheConfig& cfg);

// A PrefixIndex for the pool caches of this configuration: its identity, page size and page
// groups' windows.
std::unique_ptr<PrefixIndex> kv_cache_prefix_index(const KvCache& pool_cache, const KvHashKey* key = nullptr);

}  // namespace kvq
