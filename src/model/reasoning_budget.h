// A bound on how many tokens a reply may spend reasoning (llama.cpp's --reasoning-budget and
// thinking_budget_tokens, vLLM's thinking_token_budget, the Messages API's thinking.budget_tokens):
// the tokens written inside the reply's reasoning block are counted, and once the budget is spent
// (at a character's end: a token that leaves half a UTF-8 character is followed by the rest, for
// up to 4 tokens) the reply is made to write the block's closing text, a token at a time, whatever
// the model's logits say; then it goes on freely, answering. A block the model closes itself in
// time is not touched.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace kvq {

class Tokenizer;

// --reasoning-budget and --reasoning-budget-message (kvq serve and kvq run --chat): the help texts.
inline constexpr const char* kReasoningBudgetHelp =
    "a reasoning model's thinking budget, as llama.cpp's flag: once a reply has reasoned this many tokens, the end "
    "of its reasoning (Qwen3's '</think>', gpt-oss's analysis message's end) is written for it and it answers "
    "(-1: no bound; 0: the reasoning ends as soon as it opens)";
inline constexpr const char* kReasoningBudgetMessageHelp =
    "text written at the end of reasoning cut short by --reasoning-budget, before its closing marker (e.g. \"Time "
    "to answer.\"; default none)";

struct ReasoningBudget {
  int tokens = -1;  // < 0: no bound; 0: closed as soon as it opens
  // What opens the block at the reply's start (past its leading whitespace: Qwen3's "<think>",
  // harmony's "<|channel|>analysis<|message|>"); a reply that starts otherwise is not bounded.
  // Empty: the prompt opened it (QwQ's, Qwen3 Thinking-2507's "<think>\n"), the reply starts in it.
  std::string open = {};
  // What ends it by itself ("</think>"; "<tool_call>", which a Qwen model may write while
  // reasoning and which ends its reasoning too): from there the reply is not bounded.
  std::vector<std::string> close = {};
  // Written when the budget is spent: `message` (text only: a client's words, no marker read in
  // it), then `force` (the block's end, its markers as the model's special tokens: "\n</think>\n\n");
  // the first newline of the two is left out when the reasoning already ends with one.
  std::string message = {};
  std::string force = {};
  // The prompt opened the block (open empty): whether what it wrote ends with a newline ('<think>\n'
  // does; a continued reply's text may not).
  bool prompt_newline = true;
  // A block opened again later in the reply (harmony's next analysis message, `open` anywhere once
  // the first has ended) is bounded by what is left: the tokens count on, so once spent a new
  // block is ended as soon as it opens.
  bool reopen = false;
  bool active() const { return tokens >= 0 && !force.empty(); }
};

// A reply's progress through its ReasoningBudget (which it refers to: b outlives it). force_ids:
// what the budget writes when spent, as tokens; force_ids_nl: the same without its first newline
// (equal to force_ids when it has none).
class ReasoningBudgetState {
 public:
  ReasoningBudgetState(const ReasoningBudget& b, std::vector<int32_t> force_ids, std::vector<int32_t> force_ids_nl);
  // The same tokenized by `tok` as the model writes text (the message as text, the force's markers
  // as their special tokens).
  ReasoningBudgetState(const ReasoningBudget& b, const Tokenizer& tok);
  // The token the reply must take next; -1: the model's choice.
  int32_t forced() const;
  // The reply took `token`: `text` is what it added to the reply's text (whole characters), and
  // mid_char says that the token left part of a character still to come. A token other than the
  // forced one (a grammar held the reply) ends the bound.
  void take(int32_t token, std::string_view text, bool mid_char);
  // The budget ran out and the closing text was (or is being) written.
  bool spent() const { return state_ == State::forcing || spent_; }
  // Reasoning tokens counted so far.
  int counted() const { return count_; }

 private:
  enum class State { start, counting, forcing, done };
  // The block opened: `after` is what the opening token wrote past the marker (reasoning).
  void opened(std::string after, bool mid_char);
  void maybe_force(bool mid_char);
  bool closes();  // text_ holds a closing text: done (text_ cleared)
  const ReasoningBudget* b_ = nullptr;
  std::vector<int32_t> force_ids_, force_ids_nl_;
  const std::vector<int32_t>& forcing() const { return forcing_nl_ ? force_ids_nl_ : force_ids_; }
  bool forcing_nl_ = false;  // forcing: force_ids_nl_, else force_ids_
  size_t pos_ = 0;           // forcing: the next of forcing()
  State state_ = State::start;
  std::string text_;  // start: the reply so far; counting: the end of the reasoning (a closing
                      // text's start)
  int count_ = 0;
  bool newline_ = false;  // the reasoning so far ends with a newline
  bool spent_ = false;
  int waited_ = 0;        // tokens past the budget waited for a character's end
  static constexpr int kMaxWait = 4;  // (then the close comes anyway: a run of stray bytes ends)
};

}  // namespace kvq
