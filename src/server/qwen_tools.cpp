#include "server/qwen_tools.h"

#include <fmt/format.h>

#include "model/chat.h"
#include "model/json_schema.h"

namespace kvq {

using ojson = nlohmann::ordered_json;

std::string qwen_tools_json(const ojson& body) {
  std::string out;
  auto add = [&](const ojson& tool) {
    if (!out.empty()) out += '\n';
    out += json_dumps(tool);
  };
  if (body.contains("tools") && body["tools"].is_array())
    for (const ojson& t : body["tools"]) add(t);
  else if (body.contains("functions") && body["functions"].is_array())
    for (const ojson& f : body["functions"]) add(function_tool(f));
  return out;
}

namespace {
// GBNF: the calls of `fns` ("calls"), and the whole grammar's root.
std::shared_ptr<const Grammar> grammar_of(const std::vector<ToolFunction>& fns, bool parallel, const std::string& root,
                                          const ojson& response) {
  std::vector<std::pair<std::string, ojson>> args;
  std::string call = "call ::= \"{\\\"name\\\": \\\"\" (";
  for (size_t k = 0; k < fns.size(); ++k) {
    // (names are letters, digits, '_' and '-': a GBNF literal as they are)
    call += fmt::format("{}\"{}\\\", \\\"arguments\\\": \" args-{}", k ? " | " : "", fns[k].name, k);
    args.emplace_back(fmt::format("args-{}", k), fns[k].parameters);
  }
  call += ") \"}\"\n";
  if (!response.is_null()) args.emplace_back("response", response);
  const std::string more = parallel ? " (\"\\n<tool_call>\\n\" call \"\\n</tool_call>\")*" : "";
  const std::string text = "root ::= " + root + "\n" + call + "calls ::= \"<tool_call>\\n\" call \"\\n</tool_call>\"" + more +
                           "\nlazy ::= \"\\n\" call \"\\n</tool_call>\"" + more + "\n";
  return Grammar::from_gbnf(text, args);
}

std::shared_ptr<const Grammar> grammar_loosened(const std::vector<ToolFunction>& fns, bool parallel, const std::string& root,
                                                const ojson& response) {
  return calls_grammar(fns, [&](const std::vector<ToolFunction>& f) { return grammar_of(f, parallel, root, response); });
}
}  // namespace

void qwen_tool_constraint(const ToolSpec& spec, const ojson& response, GenParams& params) {
  const std::vector<ToolFunction> callable = spec.callable();
  params.json_object = false;
  if (spec.choice != ToolChoice::automatic) {
    params.grammar = grammar_loosened(callable, spec.parallel, "calls", nullptr);
  } else if (!response.is_null()) {
    params.grammar = grammar_loosened(callable, spec.parallel, "calls | response", response);
  } else {
    params.grammar = nullptr;
    params.lazy_grammars.push_back({QwenToolReplyStream::kOpen, grammar_loosened(callable, spec.parallel, "lazy", nullptr)});
  }
}

}  // namespace kvq
