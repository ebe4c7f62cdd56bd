#include "model/reasoning_budget.h"

#include <algorithm>

#include "model/tokenizer.h"

namespace kvq {

ReasoningBudgetState::ReasoningBudgetState(const ReasoningBudget& b, std::vector<int32_t> force_ids,
                                           std::vector<int32_t> force_ids_nl)
    : b_(&b), force_ids_(std::move(force_ids)), force_ids_nl_(std::move(force_ids_nl)) {
  if (!b.active()) {
    state_ = State::done;
  } else if (b.open.empty()) {
    newline_ = b.prompt_newline;
    opened({}, false);
  }
}

namespace {
// The forced tokens: the message as text, the force with its markers; nl: the first newline left out.
std::vector<int32_t> forced_ids(const ReasoningBudget& b, const Tokenizer& tok, bool nl) {
  std::string_view m = b.message, f = b.force;
  if (nl && !m.empty() && m[0] == '\n') m.remove_prefix(1);
  else if (nl && m.empty() && !f.empty() && f[0] == '\n') f.remove_prefix(1);
  std::vector<int32_t> ids = tok.encode_continuation(m, false);
  const std::vector<int32_t> rest = tok.encode_continuation(f, true);
  ids.insert(ids.end(), rest.begin(), rest.end());
  return ids;
}
}  // namespace

ReasoningBudgetState::ReasoningBudgetState(const ReasoningBudget& b, const Tokenizer& tok)
    : ReasoningBudgetState(b, forced_ids(b, tok, false), forced_ids(b, tok, true)) {}

int32_t ReasoningBudgetState::forced() const {
  return state_ == State::forcing && pos_ < forcing().size() ? forcing()[pos_] : -1;
}

void ReasoningBudgetState::opened(std::string after, bool mid_char) {
  state_ = State::counting;
  text_ = std::move(after);
  if (!text_.empty()) newline_ = text_.back() == '\n';
  if (closes()) return;
  maybe_force(mid_char);
}

bool ReasoningBudgetState::closes() {
  size_t keep = 0;
  for (const std::string& c : b_->close) {
    if (text_.find(c) != std::string::npos) {
      state_ = State::done;
      text_.clear();
      return true;
    }
    keep = std::max(keep, c.size() - 1);
  }
  if (text_.size() > keep) text_.erase(0, text_.size() - keep);
  return false;
}

void ReasoningBudgetState::maybe_force(bool mid_char) {
  if (state_ != State::counting || count_ < b_->tokens) return;
  if (mid_char && waited_ < kMaxWait) {
    ++waited_;
    return;
  }
  forcing_nl_ = newline_;
  pos_ = 0;
  waited_ = 0;
  text_.clear();
  state_ = forcing().empty() ? State::done : State::forcing;
  spent_ = true;
}

void ReasoningBudgetState::take(int32_t token, std::string_view text, bool mid_char) {
  switch (state_) {
    case State::start: {
      text_ += text;
      const size_t b = text_.find_first_not_of(" \t\r\n");
      if (b == std::string::npos) return;
      const std::string_view rest = std::string_view(text_).substr(b);
      if (rest.starts_with(b_->open)) {
        // (what the opening token wrote past the opening is reasoning, but that token is not)
        opened(std::string(rest.substr(b_->open.size())), mid_char);
      } else if (!std::string_view(b_->open).starts_with(rest)) {
        state_ = State::done;  // a reply that does not reason
        text_.clear();
      }
      return;
    }
    case State::counting:
      if (!text.empty()) {
        text_ += text;
        if (closes()) return;  // (the token that ends the block is not reasoning)
        newline_ = text.back() == '\n';
      }
      ++count_;
      maybe_force(mid_char);
      return;
    case State::forcing:
      if (token != forcing()[pos_] || ++pos_ >= forcing().size()) state_ = State::done;
      return;
    case State::done:
      // (b_->reopen: the opening again, anywhere, bounded by what is left)
      if (b_->reopen && !b_->open.empty() && !text.empty()) {
        text_ += text;
        const size_t at = text_.find(b_->open);
        if (at != std::string::npos) {
          newline_ = false;
          opened(text_.substr(at + b_->open.size()), mid_char);
        } else if (text_.size() >= b_->open.size()) {
          text_.erase(0, text_.size() - (b_->open.size() - 1));
        }
      }
      return;
  }
}

}  // namespace kvq
