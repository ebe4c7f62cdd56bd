// Chat templates for the supported instruct models, chosen from the GGUF's
// tokenizer.chat_template: ChatML (SmolLM2-Instruct and other ChatML models; Qwen's reasoning
// blocks and function calls), Gemma's turn format, Llama 3's headers, Phi-3's role tags, Mistral's
// [INST] turns, harmony (gpt-oss); and the splitters that read a reply's reasoning and calls.
#pragma once
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <vector>

#include "model/reasoning_budget.h"

namespace kvq {
namespace gguf { class File; }

// An assistant's function call: its name and its arguments' JSON text.
struct ChatToolCall {
  std::string name;
  std::string arguments;
};

struct ChatMessage {
  std::string role;     // "system", "user", "assistant"; harmony and Qwen's tools also "tool" (a function's result)
  std::string content;
  // Harmony (gpt-oss) writes these in its own syntax; for the other families kvq serve writes
  // calls and results into the content (server/tools.h).
  std::string reasoning = {};                 // an assistant's reasoning (its analysis channel)
  bool reasoning_given = false;               // reasoning was given (reasoning_content, even empty)
  std::vector<ChatToolCall> tool_calls = {};  // an assistant's function calls
  std::string name = {};                      // a tool message's function
  bool tool_result = false;                   // a user turn that holds functions' results (kvq's tool prompt)
};

// mistral_v1: Mistral 7B v0.1 / v0.2 ('[INST] ' and ' [/INST]' as text, the system prompt in the first
// user turn); mistral: v2 / v3 / Tekken ([INST] and [/INST] control tokens, the system prompt in the
// last user turn); mistral_v7: [SYSTEM_PROMPT] turns (Mistral Small 3, Large 2411).
// phi4: '<|im_start|>role<|im_sep|>content<|im_end|>' (Phi-4); phi4_mini: '<|role|>content<|end|>'
// (Phi-4-mini: Phi-3's tags without the newlines).
// granite: '<|start_of_role|>role<|end_of_role|>content<|end_of_text|>\n' (Granite 3.x).
// tulu: '<|role|>\n' + content + '\n' for user and system, the assistant's content + EOS (+ '\n'
// when a turn follows) (OLMo 2, OLMoE: Tülu 3's template).
// harmony: OpenAI's format (gpt-oss): '<|start|>role<|message|>content<|end|>', a system message of
// its own (model identity, knowledge cutoff, date, reasoning effort, channels), the conversation's
// system message as a developer message ('# Instructions', then the functions' '# Tools'), earlier
// replies as their final channel; the reply opens with '<|start|>assistant' and writes its channels
// itself (analysis, then final, or a function call in the commentary channel:
// '<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>{...}<|call|>', its result
// coming back as '<|start|>functions.NAME to=assistant<|channel|>commentary<|message|>"..."<|end|>').
enum class ChatFamily { none, chatml, gemma, llama3, phi3, phi4, phi4_mini, mistral_v1, mistral, mistral_v7, granite, tulu, harmony };

struct ChatTemplate {
  ChatFamily family = ChatFamily::none;
  // Llama 3.1+: the text its system turn opens with (knowledge cutoff and date); empty: none.
  std::string system_prefix;
  // ChatML: the system turn the model's template opens a conversation without one with, read from
  // the template (SmolLM2: "You are a helpful AI assistant named SmolLM, ..."); empty: none.
  std::string default_system;
  // Tülu: the EOS token's text ending an assistant turn, and the BOS token's text when the template
  // writes it and the tokenizer does not add it (OLMo 2's files); empty: none.
  std::string eos_text = "<|endoftext|>";
  std::string bos_prefix;
  // Harmony: the "Current date" of its system message (YYYY-MM-DD); empty: today's (UTC), as the
  // template's strftime_now gives it. reasoning_effort: its "Reasoning: " line (OpenAI's
  // reasoning_effort: low, medium, high; empty: medium), a request's setting.
  std::string date;
  std::string reasoning_effort;
  // ChatML templates of reasoning models, whose replies reason in '<think>\n...\n</think>\n\n'
  // before the answer: the model opens the block itself (Qwen3: its template's enable_thinking
  // false closes an empty one in the prompt), or the generation prompt opens it ('<think>\n':
  // QwQ, Qwen3's Thinking-2507 models).
  enum class Think { none, model_opens, prompt_opens };
  Think think = Think::none;
  // Earlier replies' reasoning shown again in the replies after the last user query (Qwen3's
  // last_query_index: a reply that called tools, before their results, keeps its reasoning); else
  // each earlier reply is its answer alone.
  bool think_after_query = false;
  // The template reads enable_thinking (Qwen3): ChatRenderOptions::thinking false closes the block.
  bool think_switch = false;
  // Qwen's function calling (Qwen2.5, Qwen3, QwQ templates): the tools listed as JSON in the system
  // turn's "# Tools" section, a call written '<tool_call>\n{"name": NAME, "arguments": {...}}\n</tool_call>',
  // results as '<tool_response>' blocks in a user turn (ChatMessage role "tool").
  bool qwen_tools = false;
  // Qwen2.5's and QwQ's tools section always follows the system text and a blank line (their
  // default, QwQ's empty, when there is no system message); Qwen3's only a system message's.
  bool qwen_tools_after_system = false;
  bool known() const { return family != ChatFamily::none; }
};

// A JSON value as Python's json.dumps(ensure_ascii=False) writes it (the Jinja templates' tojson):
// ", " between items, ": " after keys.
std::string json_dumps(const nlohmann::ordered_json& v);

// Detects the template family; family none when the model has no template kvq knows. `text`: a
// template to read instead of the file's (--chat-template-file), with the file's vocabulary.
ChatTemplate chat_template_detect(const gguf::File& f, const std::optional<std::string>& text = std::nullopt);
// The same from the text of a tokenizer.chat_template.
ChatTemplate chat_template_from_text(const std::string& jinja);
const char* chat_template_name(const ChatTemplate& t);
// The families kvq renders, for error messages: "ChatML, Gemma, ...".
const char* chat_supported_families();
// How a conversation's text ends (vLLM's chat parameters of the same names).
struct ChatRenderOptions {
  bool add_generation_prompt = true;    // open the assistant's turn after the messages
  bool continue_final_message = false;  // leave the last message (the assistant's) open, to be
                                        // continued: no end of turn after it, no new turn
  // Harmony: the functions the model may call, as its developer message's "# Tools" section
  // declares them (server/harmony_tools.h: "## functions\n\nnamespace functions {...}"); Qwen's
  // tools (ChatTemplate::qwen_tools): the tools' JSON, one per line, as its template's tojson
  // writes them; empty: none.
  std::string tools = {};
  // A reasoning template (ChatTemplate::think): false closes the reasoning block in the prompt
  // ('<think>\n\n</think>\n\n', as Qwen3's enable_thinking false), so the reply is the answer
  // alone; a template whose prompt opens the block gets it closed too. No effect on other
  // templates (a template that mentions <think> without an enable_thinking switch included).
  bool thinking = true;
};
// Renders messages and the opening of the assistant's turn. The BOS token is not included
// (the tokenizer adds it when the model wants it), except a template's own (bos_prefix). Throws kvq::Error for an unknown role, and for
// continue_final_message with add_generation_prompt or with a last message not the assistant's.
std::string chat_render(const ChatTemplate& t, const std::vector<ChatMessage>& msgs, const ChatRenderOptions& opt = {});
// What the template puts after an assistant reply's text to continue the conversation with a user
// turn: the reply's end, the user's turn, the opening of the next reply.
std::string chat_render_next_turn(const ChatTemplate& t, const std::string& user, const ChatRenderOptions& opt = {});

// llama.cpp's --chat-template-kwargs (and the API's chat_template_kwargs), a JSON object: kvq renders
// the templates itself and reads enable_thinking (ChatRenderOptions::thinking), which it returns
// (nullopt when absent); throws kvq::Error for text that is not such an object and for other keys,
// which would otherwise be lost silently.
std::optional<bool> chat_template_kwargs_thinking(const std::string& json_text);
std::optional<bool> chat_template_kwargs_json_thinking(const nlohmann::json& kwargs);  // (the object itself)
// The --chat-template-kwargs flag of kvq serve, run and eval: enable_thinking (true when the flag
// or the key is absent); fails with the flag named.
bool chat_template_kwargs_flag(const std::string& flag_text);

// The template's replies reason before they answer: harmony's (gpt-oss) and reasoning templates'
// (ChatTemplate::think).
bool chat_reasons(const ChatTemplate& t);
// --reasoning-budget N >= 0 on a template whose replies do not reason: a warning on stderr (the
// budget is ignored, as llama.cpp ignores it).
void chat_warn_budget_unused(const ChatTemplate& t, int reasoning_budget);

// What a reasoning reply is split into as it streams: its reasoning, its answer, and (harmony)
// its function calls.
struct ChatReplyDelta {
  std::string reasoning, content;
  std::vector<ChatToolCall> calls = {};
  std::string cut_call = {};  // Qwen's: a call cut short (or not JSON), as its text from '<tool_call>'
};
// A chat reply split as it streams (HarmonyReplyStream, ThinkReplyStream): feed() takes each piece
// of text and returns what it adds, holding back a piece that may be the start of a marker;
// finish() gives what was held back at the reply's end.
class ChatReplySplitter {
 public:
  using Delta = ChatReplyDelta;
  virtual ~ChatReplySplitter() = default;
  virtual Delta feed(const std::string& text) = 0;
  virtual Delta finish() = 0;
  // A whole reply: `opening` (what the prompt already wrote of the reply) read and dropped, then
  // `text` and the end.
  Delta split_after(const std::string& opening, const std::string& text);
};
// The splitter of a template's replies: harmony's (take_calls: functions were offered), a reasoning
// template's (ChatTemplate::think), or none (nullptr: the reply is all content).
std::unique_ptr<ChatReplySplitter> chat_reply_splitter(const ChatTemplate& t, bool take_calls = false);
// What a rendered chat prompt has already written of the reply: the text after the opening of its
// last assistant turn (a reasoning template's '<think>\n', a continued message's start); empty
// for templates without reasoning.
std::string chat_reply_opening(const ChatTemplate& t, const std::string& prompt);

// A bound of `tokens` (< 0: none) on a reply's reasoning (model/reasoning_budget.h), for a
// reasoning template (ChatTemplate::think) or harmony's (gpt-oss); none for other templates.
// opening: what the prompt wrote of the reply (chat_reply_opening, harmony's opened reply): a
// block it opened is counted from the reply's start, one it closed (enable_thinking false) or a
// reply it opened past the reasoning (harmony's final channel or forced call) is not bounded.
// message: written before the block's end when the budget is spent (llama.cpp's
// --reasoning-budget-message; empty: none), as text. calls: functions were offered (Qwen's: a
// '<tool_call>' ends the reasoning too; harmony: the analysis message is ended and the model
// picks its next channel, a later analysis message bounded by what is left of the budget;
// without functions its final channel is opened).
// ChatML: '...' ('\n' MESSAGE) '\n</think>\n\n'; harmony: '...' ('\n' MESSAGE)
// '<|end|><|start|>assistant' ('<|channel|>final<|message|>').
ReasoningBudget chat_reasoning_budget(const ChatTemplate& t, int tokens, const std::string& message,
                                      const std::string& opening, bool calls);

// A reasoning template's reply (ChatTemplate::think): '<think>' (once the reply's leading
// whitespace is past) opens the reasoning, '</think>' ends it, and the rest is the answer; a reply
// that does not open with '<think>' is all answer. The reasoning loses its leading and trailing
// newlines and the answer its leading ones (as the templates strip them when they show a reply
// again). A reply cut short inside the block is all reasoning. Markers are matched as text (Qwen's
// <think> is a token written as its text).
class ThinkReplyStream : public ChatReplySplitter {
 public:
  // also_ends: text that ends the reasoning too, left to start the answer (Qwen's '<tool_call>',
  // whose grammar, once triggered, lets no '</think>' come)
  explicit ThinkReplyStream(std::string also_ends = {}) : also_ends_(std::move(also_ends)) {}
  Delta feed(const std::string& text) override;
  Delta finish() override;

 private:
  enum class State { start, reasoning, answer_start, answer };
  State state_ = State::start;
  std::string also_ends_;
  std::string buf_;             // text held back
  bool reasoning_text_ = false;  // the reasoning's first text (past its leading newlines) came
};

// A reply of Qwen's function calling (ChatTemplate::qwen_tools), after its reasoning (`inner`, a
// reasoning template's splitter, or none): the answer's text up to '<tool_call>' is content (the
// newlines before a call dropped), each '<tool_call>...</tool_call>' whose text is a JSON object
// {"name": string, "arguments": object or string} a call (its arguments as Python's json.dumps
// writes them, as vLLM's Hermes parser returns them), given when it closes; a call that does not
// close, or whose text is not such an object, comes back as cut_call, its text from the newlines
// before '<tool_call>' (as does a start of '<tool_call>' of two bytes or more at the reply's end).
// A '<tool_call>' inside the reasoning ends it (ThinkReplyStream's also_ends).
class QwenToolReplyStream : public ChatReplySplitter {
 public:
  explicit QwenToolReplyStream(std::unique_ptr<ChatReplySplitter> inner = nullptr) : inner_(std::move(inner)) {}
  Delta feed(const std::string& text) override;
  Delta finish() override;
  static constexpr const char* kOpen = "<tool_call>";
  static constexpr const char* kClose = "</tool_call>";

 private:
  void answer(const std::string& text, Delta& d, bool end);
  std::unique_ptr<ChatReplySplitter> inner_;
  bool in_call_ = false;
  bool after_call_ = false;  // between calls: newlines dropped
  std::string buf_;
  std::string newlines_;     // in a call: the newlines before its opening marker
  size_t searched_ = 0;      // in a call: buf_ holds no closing marker before this
};

// A harmony reply (gpt-oss) as it is generated, its markers rendered as text:
// '<|channel|>analysis<|message|>reasoning<|end|><|start|>assistant<|channel|>final<|message|>answer'.
// Splits it by channel into the reasoning (the analysis channel's messages) and the content (the
// other channels': the final answer, and a commentary preamble meant for the user), for kvq serve's
// reasoning_content and content, while it streams: feed() takes each piece of text and returns what
// it adds to each, holding back a piece that may be the start of a marker until the next one says.
// A message ends at <|end|>, <|return|>, <|call|> or the next <|start|>; other markers inside it are
// its text. Messages of one kind are joined by a newline. A reply that opens without a header (its
// final channel opened by the prompt) is content from the start. A message whose header names a
// function as its recipient ('to=functions.NAME', in the role's part or the channel's) is a call of
// it, its text the arguments; it is returned when it ends (at finish() when the reply stops inside
// it). A message to another recipient is content, and so is a call when calls are not taken (no
// functions were offered: its arguments' text).
class HarmonyReplyStream : public ChatReplySplitter {
 public:
  explicit HarmonyReplyStream(bool take_calls = true) : take_calls_(take_calls) {}
  Delta feed(const std::string& text) override;
  // The end of the reply: what was held back (a marker's start that was text after all).
  Delta finish() override;
  // A whole reply at once (feed, then finish).
  static Delta split(const std::string& text, bool take_calls = true);
  // What a prompt ends with to open the reply's final channel (a constrained answer, no reasoning)
  static constexpr const char* kOpenFinal = "<|channel|>final<|message|>";

 private:
  enum class State { header, analysis, other, call };
  State state_ = State::header;
  std::string buf_;  // text not yet given out
  ChatToolCall call_;  // State::call: the call so far
  bool take_calls_;
  bool reasoning_seen_ = false, content_seen_ = false;  // a message of that kind began
  void emit(Delta& d, const std::string& text) {
    if (state_ == State::call) {
      call_.arguments += text;
      return;
    }
    (state_ == State::analysis ? reasoning_seen_ : content_seen_) = true;
    (state_ == State::analysis ? d.reasoning : d.content) += text;
  }
};

}  // namespace kvq
