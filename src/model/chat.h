// Chat templates for the supported instruct models, chosen from the GGUF's
// tokenizer.chat_template: ChatML (SmolLM2-Instruct and other ChatML models), Gemma's turn format,
// Llama 3's headers, Phi-3's role tags and Mistral's [INST] turns.
#pragma once
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <vector>

namespace kvq {
namespace gguf { class File; }

// An assistant's function call: its name and its arguments' JSON text.
struct ChatToolCall {
  std::string name;
  std::string arguments;
};

struct ChatMessage {
  std::string role;     // "system", "user", "assistant"; harmony also "tool" (a function's result)
  std::string content;
  // Harmony (gpt-oss) writes these in its own syntax; for the other families kvq serve writes
  // calls and results into the content (server/tools.h).
  std::string reasoning = {};                 // an assistant's reasoning (its analysis channel)
  std::vector<ChatToolCall> tool_calls = {};  // an assistant's function calls
  std::string name = {};                      // a tool message's function
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
  // declares them (server/harmony_tools.h: "## functions\n\nnamespace functions {...}"); empty: none.
  std::string tools = {};
};
// Renders messages and the opening of the assistant's turn. The BOS token is not included
// (the tokenizer adds it when the model wants it), except a template's own (bos_prefix). Throws kvq::Error for an unknown role, and for
// continue_final_message with add_generation_prompt or with a last message not the assistant's.
std::string chat_render(const ChatTemplate& t, const std::vector<ChatMessage>& msgs, const ChatRenderOptions& opt = {});
// What the template puts after an assistant reply's text to continue the conversation with a user
// turn: the reply's end, the user's turn, the opening of the next reply.
std::string chat_render_next_turn(const ChatTemplate& t, const std::string& user);

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
class HarmonyReplyStream {
 public:
  struct Delta {
    std::string reasoning, content;
    std::vector<ChatToolCall> calls = {};
  };
  explicit HarmonyReplyStream(bool take_calls = true) : take_calls_(take_calls) {}
  Delta feed(const std::string& text);
  // The end of the reply: what was held back (a marker's start that was text after all).
  Delta finish();
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
