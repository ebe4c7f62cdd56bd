// Anthropic's Messages API on kvq serve: POST /v1/messages and /v1/messages/count_tokens, for
// clients written against Anthropic's (its SDKs, coding agents that speak it).
//
// A request is read into the chat completions request kvq already serves (anthropic_chat_body),
// so the same template, tools, structured output, sampling and limits apply; the reply is written
// back in Anthropic's form: content blocks (`thinking` for a reasoning model's reasoning, `text`,
// `tool_use` with the call's input as an object), stop_reason (end_turn, max_tokens,
// stop_sequence, tool_use) and usage (input_tokens, output_tokens, cache_read_input_tokens: the
// prompt tokens kvq's prefix cache held). Streamed, as Anthropic's server-sent events
// (AnthropicStream). Errors are {"type": "error", "error": {"type", "message"}}.
#pragma once
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>

namespace kvq {

// A request that cannot be served; param names the field.
struct AnthropicError : std::invalid_argument {
  AnthropicError(const std::string& message, std::string p) : std::invalid_argument(message), param(std::move(p)) {}
  std::string param;
};

// The chat completions body of a Messages request (ordered: the tools' and output format's
// schemas keep their properties' written order). Read:
//   model, max_tokens (required unless count_tokens), messages (user / assistant turns; content a
//   string or blocks: text, tool_use and thinking in the assistant's, text and tool_result in the
//   user's; a last assistant message is the reply's start, continued), system (a string or text
//   blocks), stop_sequences, temperature (0-1), top_p, top_k, stream, tools (custom tools: name,
//   description, input_schema), tool_choice (auto, any, tool, none; disable_parallel_tool_use),
//   output_format / output_config.format (a JSON schema for the reply), output_config.effort (a
//   reasoning model's effort: gpt-oss's low, medium, high), thinking (see below); no effect:
//   metadata, service_tier, inference_geo, speed, diagnostics, user_profile_id, workspace_id, and
//   cache_control on the request and its blocks (kvq caches every prefix), a tool's
//   eager_input_streaming; a tool's strict is the chat endpoint's (tools.h); its input_examples
//   are shown to the model after its description.
// thinking: {"type": "enabled", "budget_tokens" >= 1024} or "disabled" /
// "adaptive"; a reasoning model's reasoning (gpt-oss, Qwen3) comes back as thinking blocks, and
// budget_tokens bounds it (the chat endpoint's thinking_token_budget: the reasoning is ended for
// the model once it has taken that many tokens); disabled closes a reasoning template's block in
// the prompt; a model without reasoning writes none.
// Refused with the field named: image, document and other non-text blocks, server and Anthropic-
// defined tools (web search, bash, text editor, computer use, ...), a tool's allowed_callers other
// than ["direct"] and defer_loading, mcp_servers, container, context_management, and any other
// field.
// count_tokens: the count_tokens endpoint's body (max_tokens, stream and the sampling fields are
// not part of it).
nlohmann::ordered_json anthropic_chat_body(const nlohmann::ordered_json& body, bool count_tokens = false);

// An error's text with the chat request's field names as the Messages API names them
// (tools[K].function.parameters: tools[K].input_schema; response_format: output_format;
// reasoning_effort: output_config.effort).
std::string anthropic_names(const std::string& text);

// thinking.display "omitted": the reasoning is not returned (no thinking blocks).
bool anthropic_omits_thinking(const nlohmann::ordered_json& body);

// Anthropic's error object for an HTTP status: invalid_request_error (400), authentication_error
// (401), permission_error (403), not_found_error (404), request_too_large (413), overloaded_error
// (503, 529), api_error (other 5xx).
nlohmann::json anthropic_error_body(const std::string& message, int status);

// A tool_use block's id for a call id ("call_X" -> "toolu_X").
std::string anthropic_tool_id(const std::string& call_id);

// Why a reply ended, as Anthropic says it.
struct AnthropicStop {
  std::string reason;                      // end_turn, max_tokens, stop_sequence, tool_use
  nlohmann::json sequence = nullptr;       // the stop sequence (stop_sequence), else null
};
// finish: the engine's finish reason ("stop", "length"); stop_string: the stop string that ended
// the text (empty: none); called: the reply called tools.
AnthropicStop anthropic_stop(const std::string& finish, const std::string& stop_string, bool called);

// usage: input_tokens are the prompt's tokens kvq computed, cache_read_input_tokens those its
// prefix cache held (their sum is the prompt).
nlohmann::json anthropic_usage(int prompt_tokens, int cached_tokens, int output_tokens);

// A tool_use block of a call (arguments: JSON text of an object; anything else, as a call cut
// short, becomes {}).
nlohmann::json anthropic_tool_use(const std::string& call_id, const std::string& name, const std::string& arguments);

// One message's server-sent events, in Anthropic's order: message_start and a ping, then per
// content block content_block_start, its deltas and content_block_stop (a text or thinking block
// is opened by its first delta and closed when another kind of block starts; a tool_use block
// carries its whole input in one input_json_delta), then message_delta (stop_reason, usage) and
// message_stop. Each method returns the events' text ("event: NAME\ndata: {...}\n\n" each).
class AnthropicStream {
 public:
  AnthropicStream(std::string id, std::string model) : id_(std::move(id)), model_(std::move(model)) {}
  std::string start(int prompt_tokens) const;
  std::string text(const std::string& delta);
  std::string thinking(const std::string& delta);
  std::string tool_use(const std::string& call_id, const std::string& name, const std::string& arguments);
  std::string finish(const AnthropicStop& stop, const nlohmann::json& usage);
  // An error event (the stream ends after it).
  static std::string error(const std::string& message, int status);

 private:
  enum class Block { none, text, thinking };
  std::string open(Block kind, nlohmann::json block);
  std::string close();
  std::string id_, model_;
  Block open_ = Block::none;
  int index_ = -1;  // the last block's index
};

}  // namespace kvq
