// Function calling in Qwen's own syntax (Qwen2.5, Qwen3, QwQ chat templates, ChatTemplate::qwen_tools):
// the tools listed as JSON in the system turn, a call written as
//
//   <tool_call>
//   {"name": "get_weather", "arguments": {"city": "Paris"}}
//   </tool_call>
//
// several calls a line apart, and results coming back as '<tool_response>' blocks in a user turn
// (chat_render). The reply is read by QwenToolReplyStream (model/chat.h).
#pragma once
#include <nlohmann/json.hpp>
#include <string>

#include "engine/engine.h"
#include "server/tools.h"

namespace kvq {

// The active tools as the template's "<tools>" section lists them: one JSON per line, each tool as
// the request wrote it ({"type": "function", "function": {...}}; a legacy "functions" entry wrapped
// so), as Python's json.dumps writes it (the template's tojson).
std::string qwen_tools_json(const nlohmann::ordered_json& body);

// The reply's constraint for an active ToolSpec. "auto": the reply is free until it writes
// '<tool_call>', from where the calls' grammar holds (params.lazy_grammars): a call of one of the
// functions ('\n{"name": NAME, "arguments": ARGS}\n</tool_call>', ARGS a document of its
// parameters), then more calls a line apart (one with parallel_tool_calls false) or the reply's
// end; with a response form (`response`, a schema; non-null when response_format asked for one) the
// grammar holds from the reply's first byte instead: calls, or a document of that schema.
// "required" and a named function (that function only): calls from the reply's first byte. Throws
// ToolsError naming a strict function whose parameters kvq cannot generate.
void qwen_tool_constraint(const ToolSpec& spec, const nlohmann::ordered_json& response, GenParams& params);

}  // namespace kvq
