// Function calling on the chat endpoint (OpenAI's `tools`, `tool_choice`, `parallel_tool_calls`),
// for any chat model, through structured output (gpt-oss in its own syntax: harmony_tools.h and
// the server's harmony_chat_tools).
//
// The functions are described to the model in the system turn, and its reply is constrained
// (model/json_schema.h) to one JSON object:
//   {"tool_calls": [{"name": NAME, "arguments": {...}}, ...]}   to call functions, or
//   {"response": TEXT}                                          to answer the user,
// where each call's name is one of the functions and its arguments are a document of that
// function's `parameters` schema. tool_choice "auto" (the default with tools) allows both forms;
// "required" only the calls; a named function ({"type": "function", "function": {"name": ...}})
// exactly one call of it; "none" neither: the tools are not described and the reply is free text.
// parallel_tool_calls false allows one call per reply. With response_format json_schema (or
// json_object), the response is that schema's document instead of a string.
//
// The reply is read back into the API's form: tool calls as message.tool_calls (ids
// "call_" + 24 random letters and digits, arguments as JSON text), finish_reason "tool_calls"
// ("stop" for a call forced by name, as OpenAI's); a response as message.content. A reply cut
// short (max_tokens, a stop string) is not a document: its content is the response's text (or
// document) so far when it had started as one, else the raw text. logprobs and stop strings apply
// to the reply as generated.
// Streamed, a response's text comes as it is generated; tool calls come whole, in one chunk, when
// the reply is complete.
//
// Earlier turns go back to the model in the same form: an assistant message's tool_calls as the
// {"tool_calls": ...} object after its content, and each `tool` message's result as a user turn
// holding {"tool_response": {"name": ..., "content": ...}} (its function's name found by
// tool_call_id among the earlier calls).
#pragma once
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <string_view>
#include <nlohmann/json.hpp>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "model/chat.h"

namespace kvq {

class Grammar;

// A request's tools or messages that cannot be served; param names the field (OpenAI's error).
struct ToolsError : std::invalid_argument {
  ToolsError(const std::string& message, std::string p) : std::invalid_argument(message), param(std::move(p)) {}
  std::string param;
};

struct ToolFunction {
  std::string name;
  std::string description;            // empty: none
  nlohmann::ordered_json parameters;  // the arguments' JSON Schema
  size_t index = 0;                   // its place in the request's tools
  // "strict": true: the arguments must be documents of the parameters, and parameters kvq cannot
  // generate are refused; otherwise (as the API promises no schema then) such a function's
  // arguments are generated as any JSON object (loosened_functions)
  bool strict = false;
};

// The functions as their calls are generated: a non-strict function whose parameters kvq cannot
// generate (a keyword it does not implement) takes any JSON object as its arguments (the model is
// still shown its parameters); a strict one is refused (ToolsError naming it).
std::vector<ToolFunction> loosened_functions(const std::vector<ToolFunction>& fns);

enum class ToolChoice { none, automatic, required, named };

struct ToolSpec {
  std::vector<ToolFunction> functions;
  ToolChoice choice = ToolChoice::none;
  std::string named;     // ToolChoice::named: the function's name
  bool parallel = true;  // parallel_tool_calls: more than one call per reply
  bool active() const { return choice != ToolChoice::none; }
  // The functions a reply may call: all, or the one tool_choice names.
  std::vector<ToolFunction> callable() const;
};

// The grammar `compile` makes of the functions' calls (a template's own call syntax: harmony's,
// Qwen's); when it cannot (std::invalid_argument), again of them loosened (loosened_functions: a
// strict function kvq cannot generate is refused by name); a second failure is a ToolsError
// ("the functions' calls: ...", param "tools").
std::shared_ptr<const Grammar> calls_grammar(
    const std::vector<ToolFunction>& fns,
    const std::function<std::shared_ptr<const Grammar>(const std::vector<ToolFunction>&)>& compile);

// A chat request's tool of a function ({"type": "function", "function": fn}), and a tool_choice
// naming one ({"type": "function", "function": {"name": name}}): what other APIs' requests become.
nlohmann::ordered_json function_tool(nlohmann::ordered_json fn);
nlohmann::ordered_json function_choice(const nlohmann::ordered_json& name);

// Text (an error's message or field) with each chat request tool field "tools[K].function.FIELD"
// rewritten as rename(K, FIELD) says: how other APIs name their tools' fields.
std::string rename_tool_fields(const std::string& text, const std::function<std::string(size_t, const std::string&)>& rename);

// Text with each field name of `renames` (a whole name: not within a longer word) replaced by its
// other API's name.
std::string rename_fields(std::string text, std::initializer_list<std::pair<std::string_view, std::string_view>> renames);

// Reads tools, tool_choice and parallel_tool_calls from a chat request body (an ordered_json keeps
// the parameters' properties in the order they are written, the order they are generated in).
// Parameters must describe an object; without a type, a schema of an object's keywords (or {})
// is given "type": "object". The schemas are compiled by tool_reply_grammar.
// Throws ToolsError.
ToolSpec parse_tools(const nlohmann::ordered_json& body);

// The schema of the reply's JSON object (above); response_schema: the response's schema, or null
// for a string. The functions' own "$ref"s (pointers into their parameters) are rewritten to point
// into this document.
nlohmann::ordered_json tool_reply_schema(const ToolSpec& spec, const nlohmann::ordered_json& response_schema);
// That schema compiled (with loosened_functions when a function's parameters cannot be generated).
// Throws ToolsError naming a strict function whose parameters cannot be generated
// (tools[i].function.parameters), else the response's schema.
std::shared_ptr<const Grammar> tool_reply_grammar(const ToolSpec& spec, const nlohmann::ordered_json& response_schema);

// What the system turn says about the functions and the reply's form.
std::string tool_system_prompt(const ToolSpec& spec, bool response_is_string);

// The chat request's messages as turns for the template: system / developer, user and assistant
// turns as they are (an assistant's tool_calls written after its content), tool results as user
// turns (consecutive ones in one turn, one line each). `system_extra` (non-empty: the tools'
// prompt) ends the first system turn, or opens one before the first message, after the
// template's default system text when it has one. Harmony (gpt-oss) has a syntax of its own for
// these: an assistant's calls are its messages' tool_calls, its reasoning_content their reasoning,
// and each tool result a "tool" message named by its call (tool_call_id, else its `name`, else the
// last call); system_extra is not used (the functions are declared by ChatRenderOptions::tools).
// Throws ToolsError for bad messages.
std::vector<ChatMessage> tool_chat_messages(const nlohmann::json& messages, const std::string& system_extra,
                                            const ChatTemplate& tpl);

struct ToolCall {
  std::string id;
  std::string name;
  std::string arguments;  // JSON text
};

struct ToolReply {
  bool complete = false;        // the text was a whole reply object
  std::string content;          // the response (complete, or its text so far), or the raw text
  bool has_content = false;     // false: the reply called tools (content is null)
  bool raw = false;             // content is the raw text of a reply cut short before it was a response (a call's start)
  std::vector<ToolCall> calls;
};

// A call's id: "call_" and 24 random letters and digits.
std::string tool_call_id(std::mt19937_64& rng);

// Reads a generated reply. rng makes the calls' ids.
ToolReply parse_tool_reply(const std::string& text, bool response_is_string, std::mt19937_64& rng);

// The response's text as a reply streams in: feed() each piece of generated text; it returns the
// text of the response ({"response": "...) decoded since the last call, or nothing while the
// reply's form is undecided, and always nothing for tool calls (which parse_tool_reply reads
// whole at the end). What it returned is a prefix of parse_tool_reply's content for the same text.
class ToolReplyStream {
 public:
  explicit ToolReplyStream(bool response_is_string) : on_(response_is_string) {}
  std::string feed(const std::string& piece);
  const std::string& streamed() const { return out_; }

 private:
  bool on_;
  std::string text_;                    // the reply so far
  std::string out_;                     // the response text returned so far
  size_t body_ = std::string::npos;     // where the response's string starts in text_ (npos: not yet)
  size_t done_ = 0;                     // the bytes of text_ decoded into out_
  bool closed_ = false;                 // the string's closing quote came
};

}  // namespace kvq
