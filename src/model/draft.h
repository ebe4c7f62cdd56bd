// Drafts for speculative decoding by prompt lookup (n-gram matching): the tokens that followed the
// latest earlier occurrence of the text's last few tokens. Text that repeats what came before
// (a document quoted or edited, code rewritten, a summary that copies phrases) lets one forward
// pass verify several of them (Forward::eval_held, KvCache::commit(n, keep)). No draft model.
#pragma once
#include <cstdint>
#include <vector>

namespace kvq {

// Up to n_max tokens that followed the most recent earlier occurrence of the last m tokens of
// `tokens`, for m = ngram_max down to ngram_min (the longest suffix that occurred before wins);
// empty when none occurred. An occurrence counts only when at least one token follows it.
std::vector<int32_t> ngram_draft(const std::vector<int32_t>& tokens, int ngram_min, int ngram_max, int n_max);

}  // namespace kvq
