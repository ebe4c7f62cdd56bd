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
    newline_ = true;  // (the prompt's opening ends with one: '<think>\n')
    begin_counting();
  }
}

namespace {
std::vector<int32_t> without_first_newline(const std::string& f, const Tokenizer& tok) {
  return tok.encode_continuation(!f.empty() && f[0] == '\n' ? std::string_view(f).substr(1) : std::string_view(f), true);
}
}  // namespace

ReasoningBudgetState::ReasoningBudgetState(const ReasoningBudget& b, const Tokenizer& tok)
    : ReasoningBudgetState(b, tok.encode_continuation(b.force, true), without_first_newline(b.force, tok)) {}

int32_t ReasoningBudgetState::forced() const {
  return state_ == State::forcing && pos_ < forcing().size() ? forcing()[pos_] : -1;
}

void ReasoningBudgetState::begin_counting() {
  state_ = State::counting;
  count_ = 0;
  maybe_force(false);
}

void ReasoningBudgetState::maybe_force(bool mid_char) {
  if (state_ != State::counting || count_ < b_->tokens || mid_char) return;
  forcing_nl_ = newline_;
  pos_ = 0;
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
        std::string after(rest.substr(b_->open.size()));
        text_.clear();
        begin_counting();
        if (state_ == State::counting && !after.empty()) {
          text_ = std::move(after);
          newline_ = text_.back() == '\n';
          for (const std::string& c : b_->close)
            if (text_.find(c) != std::string::npos) state_ = State::done;
        }
      } else if (!std::string_view(b_->open).starts_with(rest)) {
        state_ = State::done;  // a reply that does not reason
        text_.clear();
      }
      return;
    }
    case State::counting: {
      ++count_;
      if (!text.empty()) {
        text_ += text;
        newline_ = text.back() == '\n';
        size_t keep = 0;
        for (const std::string& c : b_->close) {
          if (text_.find(c) != std::string::npos) {
            state_ = State::done;
            text_.clear();
            return;
          }
          keep = std::max(keep, c.size() - 1);
        }
        if (text_.size() > keep) text_.erase(0, text_.size() - keep);
      }
      maybe_force(mid_char);
      return;
    }
    case State::forcing:
      if (token != forcing()[pos_] || ++pos_ >= forcing().size()) state_ = State::done;
      return;
    case State::done:
      return;
  }
}

}  // namespace kvq
