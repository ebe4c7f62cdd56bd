// Function tools described the way gpt-oss's chat template (the harmony format) describes them to
// the model: as a TypeScript namespace in the developer message's "# Tools" section, e.g.
//
//   ## functions
//
//   namespace functions {
//
//   // Weather for a city
//   type get_weather = (_: {
//   // The city's name
//   city: string,
//   unit?: "celsius" | "fahrenheit", // default: celsius,
//   }) => any;
//
//   } // namespace functions
//
// The text is the template's own rendering, character for character, its whitespace quirks
// included (a nested object's properties each on a new line after 16 spaces, a oneOf's branches
// split by " | " and a line break, "// default:" written with or without a comma and as JSON or
// raw text depending on where the schema sits). See harmony_tools.cpp for the cases where the
// template would fail or print a Python value, and what is written instead.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "engine/engine.h"
#include "server/tools.h"

namespace kvq {

// From "## functions\n\nnamespace functions {\n\n" to "} // namespace functions" (no newline
// after it): the developer message's "# Tools\n\n" is followed by this and then "<|end|>".
// One "type NAME = ..." per function, in the given order, its parameters' properties in the
// order they are written.
std::string harmony_functions_namespace(const std::vector<ToolFunction>& fns);

// A call of one of the functions as gpt-oss writes it after 'to=functions.' (in its header's role
// part or its channel part): the function's name, the rest of the header
// ('<|channel|>commentary' when the recipient came first, ' <|constrain|>json' or ' json', as the
// model writes them), '<|message|>' and the arguments, a JSON document of the function's
// parameters. Throws ToolsError naming the function whose parameters kvq cannot generate.
inline constexpr const char* kHarmonyCallTrigger = " to=functions.";
std::shared_ptr<const Grammar> harmony_call_grammar(const std::vector<ToolFunction>& fns);

// The reply's constraint for an active ToolSpec: tool_choice "auto" leaves the reply free until
// it writes kHarmonyCallTrigger, from where the call's grammar holds (params.lazy_grammars); a
// response form already on params (json_object, or a grammar: response_format) then holds from
// the final channel's opening instead of from the reply's start. "required" and a named function
// (its grammar allowing that function only): the call's grammar on the whole reply, which the
// prompt opens with the returned text (kHarmonyCallTrigger; "" for auto). Throws ToolsError
// naming the function whose parameters kvq cannot generate.
std::string harmony_tool_constraint(const ToolSpec& spec, GenParams& params);

}  // namespace kvq
