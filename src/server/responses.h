// OpenAI's Responses API on kvq serve: POST /v1/responses, GET and DELETE /v1/responses/{id}, for
// clients written against it (OpenAI's SDKs' client.responses, coding agents).
//
// A request is read into the chat completions request kvq already serves (responses_chat_body),
// so the same template, tools, structured output, sampling and limits apply; the reply is written
// back as output items: `reasoning` (a reasoning model's reasoning, gpt-oss's analysis channel, as
// reasoning_text content; kvq writes no summaries), `message` (output_text), `function_call`
// (call_id, name, arguments) or `custom_tool_call` (input). Streamed, as the API's typed
// server-sent events. Responses are kept in memory (store, the default) so that a later request
// can continue one by previous_response_id or refer to its items; with background, the request is
// answered at once (status "queued") and runs on, read back by GET /v1/responses/{id} and
// cancelled by POST /v1/responses/{id}/cancel; errors are OpenAI's {"error": {...}}.
#pragma once
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "server/tools.h"

namespace kvq {

// A request that cannot be served; param names the field; status 400 unless said.
struct ResponsesError : std::invalid_argument {
  ResponsesError(const std::string& message, std::string p, int s = 400)
      : std::invalid_argument(message), param(std::move(p)), status(s) {}
  std::string param;
  int status;
};

// The request's input as items: a string becomes one user message; each item checked (message
// with input_text / output_text parts, function_call, function_call_output, reasoning).
nlohmann::ordered_json responses_input_items(const nlohmann::ordered_json& body);

// Whether an input item refers to a kept item: type "item_reference", or an id alone (the SDK's
// ItemReference without its optional type).
bool responses_is_reference(const nlohmann::ordered_json& item);

// An input item in the API's form, as input_items lists it: a message with "type", its content as
// parts (input_text, or output_text for the assistant's) and a status; an id when it had none.
nlohmann::ordered_json responses_item_form(const nlohmann::ordered_json& item, std::mt19937_64& rng);

// An error's text with the chat request's tool fields as the request named them: the chat tool K
// is the request's tool of the K-th function or custom tool (hosted ones are left out), a function's
// tools[i].FIELD, a custom tool's parameters its tools[i].format.definition; max_tokens,
// response_format and reasoning_effort as max_output_tokens, text.format and reasoning.effort.
std::string responses_names(const nlohmann::ordered_json& body, const std::string& text);

// The chat completions body of a request; history: the items of the response it continues
// (previous_response_id: that response's input and output items, in order; empty: none), put
// before the input (item references already replaced by the server). Read: model, input,
// instructions (a system message first; not carried over from the previous response, as
// OpenAI's), max_output_tokens, temperature, top_p, stream, tools (functions; custom tools as the
// function {"input": TEXT}, a regex format matched whole; hosted tools left out: kvq runs none),
// tool_choice, parallel_tool_calls, text.format (text, json_object, json_schema), reasoning.effort
// (gpt-oss's low / medium / high), include "message.output_text.logprobs" with top_logprobs (not
// with stream); read by the server, not here: store, background (a boolean); no effect: metadata,
// user, safety_identifier, prompt_cache_key, prompt_cache_retention, service_tier, truncation
// "disabled", reasoning.summary, stream_options, other include values. Refused with the field
// named: a tool_choice naming a hosted tool, Lark grammars, conversation, prompt templates,
// truncation "auto", max_tool_calls, images, files and audio in the input, item references not
// kept, and any other field.
nlohmann::ordered_json responses_chat_body(const nlohmann::ordered_json& body, const nlohmann::ordered_json& history);

// The response object's fields that repeat the request (instructions, max_output_tokens,
// temperature, top_p, tools, tool_choice, parallel_tool_calls, text, reasoning, store, metadata,
// previous_response_id, user, truncation, top_logprobs), with the API's defaults.
nlohmann::json responses_echo(const nlohmann::ordered_json& body);

// Ids as the API writes them: PREFIX + "_" + 24 random letters and digits.
std::string responses_id(const char* prefix, std::mt19937_64& rng);

// A reply's output items. reasoning: the reasoning text (empty: none); content: the answer (a
// string; null: none); calls: the function calls; logprobs: output_text's (null: none);
// complete: the reply ended by itself (not cut by max_output_tokens).
struct ResponsesReply {
  std::string reasoning;
  nlohmann::json content = nullptr;
  std::vector<ToolCall> calls;
  nlohmann::json logprobs = nullptr;
  bool complete = true;
};
// How a response writes its items: the request's custom tools (their calls are custom_tool_call
// items, the input as text) and whether reasoning items carry encrypted_content (include
// "reasoning.encrypted_content": kvq's is the reasoning itself after a mark, which it reads back).
struct ResponsesForm {
  std::set<std::string> custom_tools;
  bool encrypted_reasoning = false;
};
ResponsesForm responses_form(const nlohmann::ordered_json& body);
nlohmann::json responses_output(const ResponsesReply& r, const ResponsesForm& form, std::mt19937_64& rng);

// usage: input_tokens (the prompt), its cached_tokens (held by the prefix cache), output_tokens,
// reasoning_tokens (the reasoning re-tokenized: reasoning_tokens), total_tokens.
nlohmann::json responses_usage(int prompt_tokens, int cached_tokens, int output_tokens, int reasoning_tokens);

std::mt19937_64 responses_rng();

// One response's server-sent events ("event: TYPE\ndata: {...}\n\n", each with its
// sequence_number): response.created and response.in_progress; per output item
// response.output_item.added, its content (a message's content_part.added, output_text.delta...,
// output_text.done, content_part.done; a reasoning item's reasoning_text.delta...,
// reasoning_text.done; a call's function_call_arguments.delta (whole) and .done), then
// response.output_item.done; last response.completed (or response.incomplete; response.failed
// with the items so far, the open one incomplete). A reasoning or message item is opened by its
// first delta and closed when another item starts; a call comes whole (a custom tool's as
// custom_tool_call_input.delta / .done).
class ResponsesStream {
 public:
  // response: the response object as created (status in_progress, output empty)
  ResponsesStream(nlohmann::json response, ResponsesForm form)
      : response_(std::move(response)), form_(std::move(form)), rng_(responses_rng()) {}
  std::string start();
  std::string text(const std::string& delta);
  std::string reasoning(const std::string& delta);
  std::string call(const ToolCall& c);
  // The last events; the final response's usage and status from its arguments; returns the final
  // response object through *final (as GET /v1/responses/{id} returns it).
  std::string finish(const nlohmann::json& usage, bool complete, nlohmann::json* final);
  std::string error(const std::string& message);

 private:
  enum class Item { none, message, reasoning };
  std::string event(const char* type, nlohmann::json data);
  std::string open(Item kind);
  std::string close(const char* status = "completed");
  nlohmann::json response_;
  ResponsesForm form_;
  nlohmann::json output_ = nlohmann::json::array();  // the items done
  Item open_ = Item::none;
  nlohmann::json item_;  // the open item
  std::string text_;     // its text so far
  int seq_ = 0;
  std::mt19937_64 rng_;  // items' ids (seeded from several random_device words)
};

// A generator for ids, seeded from several random_device words (one word would give 2^32 ids).
std::mt19937_64 responses_rng();

}  // namespace kvq
