#include "model/chat.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <string_view>

#include "core/error.h"
#include "gguf/gguf.h"
#include "model/unicode.h"

namespace kvq {

namespace {
// The newlines at a text's start or end removed (Python's lstrip('\n') / rstrip('\n'), as the
// templates strip them)
void lstrip_newlines(std::string& s) { s.erase(0, s.find_first_not_of('\n')); }
void rstrip_newlines(std::string& s) { s.erase(s.find_last_not_of('\n') + 1); }

// Whether a newline (as one, or as the escape \n) comes at t[p], past the quotes, '+' and spaces
// of a string concatenation ("'<|user|>' + '\n'").
bool newline_follows(const std::string& t, size_t p) {
  while (p < t.size() && (t[p] == '\'' || t[p] == '"' || t[p] == '+' || t[p] == ' ')) ++p;
  return t.compare(p, 1, "\n") == 0 || t.compare(p, 2, "\\n") == 0;
}

// Phi-3's turns: a literal '<|user|>' followed by a newline, and '<|end|>'. Phi-4-mini's turns
// have no newline and are not these.
bool phi3_turns(const std::string& t) {
  if (t.find("<|end|>") == std::string::npos || t.find("<|assistant|>") == std::string::npos) return false;
  for (size_t at = t.find("<|user|>"); at != std::string::npos; at = t.find("<|user|>", at + 1))
    if (newline_follows(t, at + 8)) return true;
  return false;
}
// Tülu 3's turns (OLMo 2): '<|user|>' and a newline, the content and a newline after it, the
// assistant's turn ended by eos_token; no '<|end|>' (Phi-3) and no EOS after a user turn (Zephyr).
bool tulu_turns(const std::string& t) {
  if (t.find("<|end|>") != std::string::npos || t.find("<|assistant|>") == std::string::npos ||
      t.find("eos_token") == std::string::npos)
    return false;
  const size_t u = t.find("<|user|>");
  if (u == std::string::npos || !newline_follows(t, u + 8)) return false;
  // "... + message['content'] + '\n'" right after the user tag
  const size_t content = t.find("message['content']", u);
  return content != std::string::npos && newline_follows(t, content + std::string_view("message['content']").size()) &&
         content < t.find("<|assistant|>", u);
}
}  // namespace

ChatTemplate chat_template_from_text(const std::string& t) {
  ChatTemplate c;
  // Phi-4's turns ('<|im_start|>user<|im_sep|>...') are not ChatML's.
  if (t.find("<|im_sep|>") != std::string::npos && t.find("<|im_start|>") != std::string::npos) {
    c.family = ChatFamily::phi4;
  } else if (t.find("<|im_start|>") != std::string::npos) {
    c.family = ChatFamily::chatml;
    // A literal system turn in the template, '<|im_start|>system\nTEXT<|im_end|>', is the default
    // it opens a conversation without a system message with; a system turn built from the
    // messages ('<|im_start|>' + message['role'] ...) is no such literal.
    const std::string open = "<|im_start|>system";
    for (size_t at = t.find(open); at != std::string::npos; at = t.find(open, at + 1)) {
      size_t p = at + open.size();
      if (t.compare(p, 1, "\n") == 0) p += 1;
      else if (t.compare(p, 2, "\\n") == 0) p += 2;
      else continue;
      const size_t end = t.find("<|im_end|>", p);
      if (end == std::string::npos) break;
      const std::string text = t.substr(p, end - p);
      if (text.empty() || text.find_first_of("{}'\"") != std::string::npos) continue;
      std::string unescaped;  // "\n" written as an escape inside the Jinja string literal
      for (size_t i = 0; i < text.size(); ++i) {
        if (text[i] == '\\' && i + 1 < text.size() && text[i + 1] == 'n') {
          unescaped += '\n';
          ++i;
        } else {
          unescaped += text[i];
        }
      }
      c.default_system = unescaped;
      break;
    }
    // Reasoning models: the prompt opens '<think>' right after the assistant's turn opening (one
    // literal, its newlines written as escapes or as they are), or the model writes it.
    if (t.find("<think>") != std::string::npos) {
      // ('<think>\n' as a literal of its own after the opening, as Qwen3.5's templates write it)
      // (in the generation prompt: after the template's last add_generation_prompt, as a template
      // may show earlier replies' blocks with the same literal)
      const size_t gen = t.rfind("add_generation_prompt");
      bool opens = false;
      for (const char* lit : {"<|im_start|>assistant\\n<think>\\n", "<|im_start|>assistant\n<think>\n", "'<think>\\n'",
                              "\"<think>\\n\"", "'<think>\n'", "\"<think>\n\""})
        opens = opens || t.find(lit, gen == std::string::npos ? 0 : gen) != std::string::npos;
      c.think = opens ? ChatTemplate::Think::prompt_opens : ChatTemplate::Think::model_opens;
      c.think_after_query = t.find("last_query_index") != std::string::npos;
      c.think_switch = t.find("enable_thinking") != std::string::npos;
    }
    // (Qwen3-Coder's and Qwen3.5's calls are XML, '<function=NAME><parameter=...>': not these)
    c.qwen_tools = t.find("<tool_call>") != std::string::npos &&
                   t.find("You may call one or more functions to assist with the user query.") != std::string::npos &&
                   t.find("<function=") == std::string::npos;
    c.qwen_tools_after_system = c.qwen_tools && (t.find("\"\\n\\n# Tools") != std::string::npos || t.find("\"\n\n# Tools") != std::string::npos);
  } else if (t.find("<|start|>") != std::string::npos && t.find("<|channel|>") != std::string::npos) {
    c.family = ChatFamily::harmony;
  } else if (t.find("<start_of_turn>") != std::string::npos) {
    c.family = ChatFamily::gemma;
  } else if (t.find("<|start_of_role|>") != std::string::npos && t.find("<|end_of_role|>") != std::string::npos) {
    c.family = ChatFamily::granite;
  } else if (phi3_turns(t)) {
    c.family = ChatFamily::phi3;
  } else if (const size_t rt = t.find("'<|' + message['role'] + '|>'");
             rt != std::string::npos && t.find("<|end|>") != std::string::npos && t.find("<|assistant|>") != std::string::npos) {
    // the role tag built from the role: Phi-4-mini's has no newline after it, Phi-3-small's and
    // Phi-3-vision's do (Phi-3's turns)
    const size_t tag = std::string_view("'<|' + message['role'] + '|>'").size();
    c.family = newline_follows(t, rt + tag) ? ChatFamily::phi3 : ChatFamily::phi4_mini;
  } else if (tulu_turns(t)) {
    c.family = ChatFamily::tulu;
  } else if (t.find("[SYSTEM_PROMPT]") != std::string::npos && t.find("[INST]") != std::string::npos) {
    c.family = ChatFamily::mistral_v7;
  } else if (t.find("[INST]") != std::string::npos && t.find("<<SYS>>") == std::string::npos) {
    // Llama 2's [INST] template (with <<SYS>>) is another format, left unknown. Mistral's first
    // template writes a space before [/INST]; the later ones do not.
    c.family = t.find(" [/INST]") != std::string::npos ? ChatFamily::mistral_v1 : ChatFamily::mistral;
  } else if (t.find("<|start_header_id|>") != std::string::npos) {
    c.family = ChatFamily::llama3;
    // Llama 3.1+: the system turn is always there and opens with the knowledge cutoff and a date
    // (the template's own fallback date, used when the renderer passes none)
    if (t.find("Cutting Knowledge Date") != std::string::npos)
      c.system_prefix = "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n";
  }
  return c;
}

ChatTemplate chat_template_detect(const gguf::File& f, const std::optional<std::string>& text) {
  const std::optional<std::string> t = text ? text : f.get_string("tokenizer.chat_template");
  ChatTemplate c = t ? chat_template_from_text(*t) : ChatTemplate{};
  if (c.family == ChatFamily::mistral_v1 || c.family == ChatFamily::mistral) {
    // Which of Mistral's [INST] renderings: the vocabulary's, not the template's spacing (Mistral
    // 7B v0.3 files carry v1's spaced template with a vocabulary whose [INST] is a control token,
    // where the spaces would become tokens of their own).
    const gguf::Value* toks = f.find("tokenizer.ggml.tokens");
    const gguf::Value* types = f.find("tokenizer.ggml.token_type");
    bool control = false;
    if (toks && toks->type == gguf::ValueType::array && types && types->type == gguf::ValueType::array)
      for (size_t i = 0; i < toks->arr.size() && i < types->arr.size(); ++i)
        if (toks->arr[i].type == gguf::ValueType::string && toks->arr[i].s == "[INST]") {
          control = types->arr[i].as_int() == std::optional<int64_t>(3);  // CONTROL
          break;
        }
    c.family = control ? ChatFamily::mistral : ChatFamily::mistral_v1;
  }
  if (c.family == ChatFamily::tulu) {
    // the vocabulary's EOS and BOS texts; the template's '{{ bos_token }}' written when the
    // tokenizer does not add BOS itself (OLMo 2's files say nothing, so it does not)
    const gguf::Value* toks = f.find("tokenizer.ggml.tokens");
    auto text_of = [&](const char* key) -> std::string {
      const std::optional<int64_t> id = f.get_int(key);
      if (!id || !toks || toks->type != gguf::ValueType::array || *id < 0 || size_t(*id) >= toks->arr.size()) return {};
      return toks->arr[size_t(*id)].s;
    };
    if (std::string eos = text_of("tokenizer.ggml.eos_token_id"); !eos.empty()) c.eos_text = eos;
    const bool tmpl_bos = t && t->find("bos_token") != std::string::npos;
    if (tmpl_bos && !f.get_bool("tokenizer.ggml.add_bos_token").value_or(false)) c.bos_prefix = text_of("tokenizer.ggml.bos_token_id");
  }
  return c;
}

const char* chat_template_name(const ChatTemplate& t) {
  switch (t.family) {
    case ChatFamily::chatml: return "chatml";
    case ChatFamily::gemma: return "gemma";
    case ChatFamily::llama3: return "llama3";
    case ChatFamily::phi3: return "phi3";
    case ChatFamily::phi4: return "phi4";
    case ChatFamily::phi4_mini: return "phi4-mini";
    case ChatFamily::granite: return "granite";
    case ChatFamily::mistral_v1: return "mistral-v1";
    case ChatFamily::mistral: return "mistral";
    case ChatFamily::mistral_v7: return "mistral-v7";
    case ChatFamily::tulu: return "tulu";
    case ChatFamily::harmony: return "harmony";
    default: return "none";
  }
}

const char* chat_supported_families() {
  return "ChatML, Gemma, Llama 3, Phi-3, Phi-4, Mistral, Granite, Tülu (OLMo 2), harmony (gpt-oss)";
}

std::string chat_render_next_turn(const ChatTemplate& t, const std::string& user, const ChatRenderOptions& opt) {
  // Read off a rendered conversation whose earlier turns are markers.
  const std::string full = chat_render(t, {{"user", "\x01"}, {"assistant", "\x02"}, {"user", user}}, opt);
  return full.substr(full.find('\x02') + 1);
}

namespace {
// A string as Python's json.dumps(ensure_ascii=False) writes it (the harmony template's tojson)
std::string json_text(const std::string& s) {
  return nlohmann::json(s).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}
// A call's arguments (JSON text) as the template's tojson writes them; text that is not JSON as it is
std::string python_json_text(const std::string& text) {
  const nlohmann::ordered_json v = nlohmann::ordered_json::parse(text, nullptr, false);
  return v.is_discarded() ? text : json_dumps(v);
}
// A float as Python's repr writes it (json.dumps's floats): the shortest digits that read back as
// the same double, in fixed notation with at least one decimal when its exponent is in [-4, 16),
// else as d.ddde+XX.
std::string python_float(double x) {
  if (std::isnan(x)) return "NaN";
  if (std::isinf(x)) return x > 0 ? "Infinity" : "-Infinity";
  char buf[64];
  const auto r = std::to_chars(buf, buf + sizeof buf, x, std::chars_format::scientific);
  const std::string sci(buf, r.ptr);
  const size_t e = sci.find('e');
  const int exp = std::stoi(sci.substr(e + 1));
  std::string out = x < 0 || std::signbit(x) ? "-" : "";
  std::string digits;
  for (char c : sci.substr(0, e))
    if (c >= '0' && c <= '9') digits += c;
  if (exp >= -4 && exp < 16) {
    if (exp < 0) out += "0." + std::string(size_t(-exp - 1), '0') + digits;
    else if (digits.size() <= size_t(exp) + 1) out += digits + std::string(size_t(exp) + 1 - digits.size(), '0') + ".0";
    else out += digits.substr(0, size_t(exp) + 1) + "." + digits.substr(size_t(exp) + 1);
  } else {
    out += digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    out += fmt::format("e{}{:02d}", exp < 0 ? '-' : '+', std::abs(exp));
  }
  return out;
}

void json_dumps_to(const nlohmann::ordered_json& v, std::string& out) {
  if (v.is_number_float()) {
    out += python_float(v.get<double>());
  } else if (v.is_object()) {
    out += '{';
    bool first = true;
    for (const auto& [k, x] : v.items()) {
      out += first ? "" : ", ";
      first = false;
      out += json_text(k) + ": ";
      json_dumps_to(x, out);
    }
    out += '}';
  } else if (v.is_array()) {
    out += '[';
    for (size_t k = 0; k < v.size(); ++k) {
      if (k) out += ", ";
      json_dumps_to(v[k], out);
    }
    out += ']';
  } else {
    out += v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  }
}
}  // namespace

std::string json_dumps(const nlohmann::ordered_json& v) {
  std::string out;
  json_dumps_to(v, out);
  return out;
}

std::string chat_render(const ChatTemplate& t, const std::vector<ChatMessage>& msgs, const ChatRenderOptions& opt) {
  std::string out;
  const bool harmony = t.family == ChatFamily::harmony;
  const bool native_calls = harmony || (t.family == ChatFamily::chatml && t.qwen_tools);
  for (const auto& m : msgs) {
    if (m.role != "system" && m.role != "user" && m.role != "assistant" && !(native_calls && m.role == "tool"))
      fail("unknown chat role '{}' (valid: system, user, assistant{})", m.role, native_calls ? ", tool" : "");
    if (!native_calls && !m.tool_calls.empty())
      fail("this chat template ({}) has no function calls of its own", chat_template_name(t));
  }
  if (!native_calls && !opt.tools.empty()) fail("this chat template ({}) declares no functions of its own", chat_template_name(t));
  const bool cont = opt.continue_final_message;
  if (cont && opt.add_generation_prompt)
    fail("continue_final_message and add_generation_prompt cannot both be set (set add_generation_prompt to false)");
  if (cont && (msgs.empty() || msgs.back().role != "assistant"))
    fail("continue_final_message needs the last message to be the assistant's");
  if (t.family == ChatFamily::chatml) {
    const bool sys_first = !msgs.empty() && msgs[0].role == "system";
    if (!opt.tools.empty()) {
      // Qwen's: the system turn (the first system message, else the template's default) followed by
      // the tools, one JSON per line
      out += "<|im_start|>system\n";
      if (sys_first) out += msgs[0].content + "\n\n";
      else if (!t.default_system.empty() || t.qwen_tools_after_system) out += t.default_system + "\n\n";
      out += "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with "
             "function signatures within <tools></tools> XML tags:\n<tools>\n" + opt.tools +
             "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
             "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
             "<args-json-object>}\n</tool_call><|im_end|>\n";
    } else if (!t.default_system.empty() && !sys_first) {
      // A template with a default system turn (SmolLM2's) opens a conversation that has none with it.
      out += "<|im_start|>system\n" + t.default_system + "<|im_end|>\n";
    }
    // Reasoning templates (Qwen3): the last user query is the last user message that is not a
    // tool's response ('<tool_response>...</tool_response>'); the replies after it show their
    // reasoning again.
    size_t last_query = msgs.size();
    if (t.think != ChatTemplate::Think::none && t.think_after_query) {
      last_query = msgs.empty() ? 0 : msgs.size() - 1;
      for (size_t i = msgs.size(); i-- > 0;) {
        const std::string& c = msgs[i].content;
        const bool tool_response = (c.starts_with("<tool_response>") && c.ends_with("</tool_response>")) || msgs[i].tool_result;
        if (msgs[i].role == "user" && !tool_response) {
          last_query = i;
          break;
        }
      }
    }
    for (size_t i = 0; i < msgs.size(); ++i) {
      const bool last = i + 1 == msgs.size();
      if (i == 0 && sys_first && !opt.tools.empty()) continue;  // (in the tools' system turn)
      if (msgs[i].role == "tool") {
        // Qwen's: a function's result in a user turn, consecutive results in one
        if (i == 0 || msgs[i - 1].role != "tool") out += "<|im_start|>user";
        out += "\n<tool_response>\n" + msgs[i].content + "\n</tool_response>";
        if (last || msgs[i + 1].role != "tool") out += "<|im_end|>\n";
        continue;
      }
      std::string content = msgs[i].content;
      std::string answer;  // the reply's answer, without the reasoning block shown before it
      if (msgs[i].role == "assistant" && t.think != ChatTemplate::Think::none) {
        // The reply's reasoning: given beside it (reasoning_content), or the text before '</think>'
        // (from after '<think>'), its answer the text after the last '</think>', as Qwen3's
        // template reads them.
        // (QwQ's template shows every reply as the text after its last '</think>'.)
        std::string reasoning = t.think_after_query ? msgs[i].reasoning : std::string();
        const bool given = t.think_after_query && msgs[i].reasoning_given;
        const size_t close = content.find("</think>");
        if (!given && close != std::string::npos) {
          reasoning = content.substr(0, close);
          rstrip_newlines(reasoning);
          if (const size_t open = reasoning.rfind("<think>"); open != std::string::npos) reasoning.erase(0, open + 7);
          lstrip_newlines(reasoning);
          content.erase(0, content.rfind("</think>") + 8);
          lstrip_newlines(content);
        } else if (!t.think_after_query) {
          lstrip_newlines(content);  // (QwQ's lstrip, with or without a block)
        }
        answer = content;
        if (t.think_after_query && i > last_query && (last || !reasoning.empty())) {
          lstrip_newlines(reasoning);
          rstrip_newlines(reasoning);
          lstrip_newlines(content);
          content = "<think>\n" + reasoning + "\n</think>\n\n" + content;
        }
      } else {
        answer = content;
      }
      out += "<|im_start|>" + msgs[i].role + "\n" + content;
      // Qwen's calls: a line apart from the content and from each other
      // (QwQ's template asks whether the message's own content is empty, before its split)
      const bool content_first = t.think != ChatTemplate::Think::none && !t.think_after_query ? !msgs[i].content.empty() : !answer.empty();
      for (size_t k = 0; k < msgs[i].tool_calls.size(); ++k) {
        if (k > 0 || content_first) out += "\n";
        out += "<tool_call>\n{\"name\": \"" + msgs[i].tool_calls[k].name + "\", \"arguments\": " +
               python_json_text(msgs[i].tool_calls[k].arguments) + "}\n</tool_call>";
      }
      if (!(cont && last)) out += "<|im_end|>\n";
    }
    if (opt.add_generation_prompt) {
      out += "<|im_start|>assistant\n";
      const bool closes = !opt.thinking && (t.think == ChatTemplate::Think::prompt_opens || t.think_switch);
      if (closes) out += "<think>\n\n</think>\n\n";
      else if (t.think == ChatTemplate::Think::prompt_opens) out += "<think>\n";
    }
    return out;
  }
  if (t.family == ChatFamily::gemma) {
    // Gemma has no system role: the system text is prefixed to the first user turn.
    std::string pending_system;
    for (const auto& m : msgs) {
      if (m.role == "system") {
        pending_system += m.content + "\n\n";
        continue;
      }
      // A system text no user turn follows (an assistant's turn comes first, or nothing) is a user
      // turn of its own rather than lost.
      if (m.role == "assistant" && !pending_system.empty()) {
        pending_system.resize(pending_system.size() - 2);
        out += "<start_of_turn>user\n" + pending_system + "<end_of_turn>\n";
        pending_system.clear();
      }
      const char* role = m.role == "assistant" ? "model" : "user";
      std::string content = m.role == "user" ? pending_system + m.content : m.content;
      if (m.role == "user") pending_system.clear();
      out += std::string("<start_of_turn>") + role + "\n" + content;
      if (!(cont && &m == &msgs.back())) out += "<end_of_turn>\n";
    }
    if (!pending_system.empty()) {
      pending_system.resize(pending_system.size() - 2);
      out += "<start_of_turn>user\n" + pending_system + "<end_of_turn>\n";
    }
    if (opt.add_generation_prompt) out += "<start_of_turn>model\n";
    return out;
  }
  if (t.family == ChatFamily::llama3) {
    // Llama 3's turns: a header naming the role, the content trimmed as its template does (Unicode
    // whitespace, as Python's str.strip), <|eot_id|>. (The <|begin_of_text|> before them is the
    // tokenizer's BOS.)
    auto trim = [](const std::string& x) {
      size_t b = 0, e = x.size();
      for (uint32_t cp; b < e;) {
        const int n = unicode::utf8_decode(x, b, &cp);
        if (unicode::char_class(cp) != unicode::CharClass::space) break;
        b += size_t(n);
      }
      while (e > b) {
        size_t s = e - 1;
        while (s > b && (static_cast<uint8_t>(x[s]) & 0xC0) == 0x80) --s;  // back to a lead byte
        uint32_t cp;
        unicode::utf8_decode(x, s, &cp);
        if (unicode::char_class(cp) != unicode::CharClass::space) break;
        e = s;
      }
      return x.substr(b, e - b);
    };
    const bool sys_first = !msgs.empty() && msgs[0].role == "system";
    if (!t.system_prefix.empty())  // Llama 3.1+: the system turn, with the first system message if any
      out += "<|start_header_id|>system<|end_header_id|>\n\n" + t.system_prefix +
             (sys_first ? trim(msgs[0].content) : std::string()) + "<|eot_id|>";
    for (size_t i = t.system_prefix.empty() || !sys_first ? 0 : 1; i < msgs.size(); ++i) {
      out += "<|start_header_id|>" + msgs[i].role + "<|end_header_id|>\n\n" + trim(msgs[i].content);
      if (!(cont && i + 1 == msgs.size())) out += "<|eot_id|>";
    }
    if (opt.add_generation_prompt) out += "<|start_header_id|>assistant<|end_header_id|>\n\n";
    return out;
  }
  if (t.family == ChatFamily::granite) {
    // Granite 3.x's turns. (Its template writes a default system turn with today's date when the
    // conversation has none; kvq, as llama.cpp, does not.)
    for (size_t i = 0; i < msgs.size(); ++i) {
      out += "<|start_of_role|>" + msgs[i].role + "<|end_of_role|>" + msgs[i].content;
      if (!(cont && i + 1 == msgs.size())) out += "<|end_of_text|>\n";
    }
    if (opt.add_generation_prompt) out += "<|start_of_role|>assistant<|end_of_role|>";
    return out;
  }
  if (t.family == ChatFamily::phi4 || t.family == ChatFamily::phi4_mini) {
    const bool mini = t.family == ChatFamily::phi4_mini;
    for (size_t i = 0; i < msgs.size(); ++i) {
      out += mini ? "<|" + msgs[i].role + "|>" : "<|im_start|>" + msgs[i].role + "<|im_sep|>";
      out += msgs[i].content;
      if (!(cont && i + 1 == msgs.size())) out += mini ? "<|end|>" : "<|im_end|>";
    }
    if (opt.add_generation_prompt) out += mini ? "<|assistant|>" : "<|im_start|>assistant<|im_sep|>";
    return out;
  }
  if (t.family == ChatFamily::tulu) {
    // Tülu 3 (OLMo 2, OLMoE): user and system turns end with a newline, the assistant's with EOS
    // (and a newline when another message follows).
    out += t.bos_prefix;
    for (size_t i = 0; i < msgs.size(); ++i) {
      const bool last = i + 1 == msgs.size();
      out += "<|" + msgs[i].role + "|>\n" + msgs[i].content;
      if (msgs[i].role != "assistant") out += "\n";
      else if (!(cont && last)) out += t.eos_text + (last ? "" : "\n");
    }
    if (opt.add_generation_prompt && !msgs.empty()) out += "<|assistant|>\n";
    return out;
  }
  if (t.family == ChatFamily::phi3) {
    // Phi-3 / Phi-3.5: '<|role|>\n' + content + '<|end|>\n'; an empty system message is left out,
    // as its template does. (Without a generation prompt the template ends with the EOS token,
    // which kvq leaves out: the text ends after the last turn.)
    for (size_t i = 0; i < msgs.size(); ++i) {
      if (msgs[i].role == "system" && msgs[i].content.empty()) continue;
      out += "<|" + msgs[i].role + "|>\n" + msgs[i].content;
      if (!(cont && i + 1 == msgs.size())) out += "<|end|>\n";
    }
    if (opt.add_generation_prompt) out += "<|assistant|>\n";
    return out;
  }
  if (t.family == ChatFamily::mistral_v1 || t.family == ChatFamily::mistral || t.family == ChatFamily::mistral_v7) {
    // Mistral's turns as mistral_common tokenizes them: the control tokens [INST] and [/INST] with
    // each message right after them, where a SentencePiece vocabulary's dummy prefix (which kvq's
    // tokenizer puts after every special token) supplies the space mistral_common's per-message
    // encoding gives; the first template's [INST] and [/INST] are text, spaced as written. The
    // assistant's reply ends with </s>. Without [SYSTEM_PROMPT] turns, system messages go into a user
    // turn, followed by a blank line: the first one (v1) or the last one (later versions), or a turn
    // of their own when no user turn follows.
    const bool v1 = t.family == ChatFamily::mistral_v1, v7 = t.family == ChatFamily::mistral_v7;
    const std::string inst = v1 ? "[INST] " : "[INST]", end_inst = v1 ? " [/INST]" : "[/INST]";
    std::string system;
    size_t sys_user = msgs.size();  // the user turn that takes the system text
    if (!v7) {
      for (size_t i = 0; i < msgs.size(); ++i)
        if (msgs[i].role == "system") system += (system.empty() ? "" : "\n\n") + msgs[i].content;
        else if (msgs[i].role == "user" && (!v1 || sys_user == msgs.size())) sys_user = i;
    }
    const bool sys_alone = !system.empty() && sys_user == msgs.size();
    if (sys_alone) out += inst + system + end_inst;
    for (size_t i = 0; i < msgs.size(); ++i) {
      const ChatMessage& m = msgs[i];
      const bool last_open = cont && i + 1 == msgs.size();
      if (m.role == "system") {
        if (v7) out += "[SYSTEM_PROMPT]" + m.content + "[/SYSTEM_PROMPT]";
      } else if (m.role == "user") {
        out += inst + (i == sys_user && !system.empty() ? system + "\n\n" : std::string()) + m.content + end_inst;
      } else {
        // trimmed, as its templates do (a reply kvq generated starts with the SentencePiece
        // space, which the rendering gives again)
        std::string content = m.content;
        content.erase(0, content.find_first_not_of(" \t\n"));
        if (!last_open) content.erase(content.find_last_not_of(" \t\n") + 1);
        out += (v1 ? " " : "") + content;
        if (!last_open) out += "</s>";
      }
    }
    return out;  // the last [/INST] opens the reply: no generation prompt of its own
  }
  if (harmony) {
    // gpt-oss's template: its system message, the conversation's first system message as the
    // developer's instructions (later ones are dropped, as there) followed by the functions, user
    // turns, earlier replies as their final channel (their reasoning is not shown again), function
    // calls as commentary messages to the function (the reasoning before a call shown while no
    // final reply follows it), results as the function's messages; an open last reply continues
    // its final channel.
    const std::string effort = t.reasoning_effort.empty() ? std::string("medium") : t.reasoning_effort;
    if (effort != "low" && effort != "medium" && effort != "high")
      fail("reasoning effort '{}' is not one of: low, medium, high", effort);
    std::string date = t.date;
    if (date.empty()) {
      const std::time_t now = std::time(nullptr);
      std::tm tm{};
      gmtime_r(&now, &tm);
      char buf[16];
      std::strftime(buf, sizeof buf, "%Y-%m-%d", &tm);
      date = buf;
    }
    out += "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\nKnowledge cutoff: 2024-06\n"
           "Current date: " + date + "\n\nReasoning: " + effort +
           "\n\n# Valid channels: analysis, commentary, final. Channel must be included for every message." +
           (opt.tools.empty() ? "" : "\nCalls to these tools must go to the commentary channel: 'functions'.") + "<|end|>";
    size_t i = 0;
    std::string developer;
    if (!msgs.empty() && msgs[0].role == "system") {
      developer = msgs[0].content;
      i = 1;
    }
    if (!developer.empty() || !opt.tools.empty())
      out += "<|start|>developer<|message|>" + (developer.empty() ? "" : "# Instructions\n\n" + developer + "\n\n") +
             (opt.tools.empty() ? "" : "# Tools\n\n" + opt.tools) + "<|end|>";
    std::string last_call;  // the function of the last call, for a result that does not name its own
    for (; i < msgs.size(); ++i) {
      const ChatMessage& m = msgs[i];
      const bool last_open = cont && i + 1 == msgs.size();
      if (m.role == "user") {
        out += "<|start|>user<|message|>" + m.content + "<|end|>";
      } else if (m.role == "tool") {
        const std::string& fn = m.name.empty() ? last_call : m.name;
        if (fn.empty()) fail("messages[{}]: a function's result with no function call before it", i);
        out += "<|start|>functions." + fn + " to=assistant<|channel|>commentary<|message|>" + json_text(m.content) + "<|end|>";
      } else if (m.role == "assistant" && !m.tool_calls.empty()) {
        bool final_follows = false;
        for (size_t k = i + 1; k < msgs.size(); ++k) final_follows |= msgs[k].role == "assistant" && msgs[k].tool_calls.empty();
        // the reasoning (or the content, which the template reads as the reasoning when alone),
        // and with both, the content as the preamble the reply wrote for the user before its call
        const std::string& analysis = m.reasoning.empty() ? m.content : m.reasoning;
        if (!analysis.empty() && !final_follows) out += "<|start|>assistant<|channel|>analysis<|message|>" + analysis + "<|end|>";
        if (!m.reasoning.empty() && !m.content.empty())
          out += "<|start|>assistant<|channel|>commentary<|message|>" + m.content + "<|end|>";
        for (const ChatToolCall& c : m.tool_calls) {  // (the template writes the first; each is a message of its own)
          out += "<|start|>assistant to=functions." + c.name + "<|channel|>commentary json<|message|>" +
                 python_json_text(c.arguments) + "<|call|>";
          last_call = c.name;
        }
      } else if (m.role == "assistant") {  // (a closed last reply without a new turn ends as generation does)
        const bool closes = i + 1 == msgs.size() && !opt.add_generation_prompt && !last_open;
        if (closes && !m.reasoning.empty()) out += "<|start|>assistant<|channel|>analysis<|message|>" + m.reasoning + "<|end|>";
        out += std::string("<|start|>assistant") + HarmonyReplyStream::kOpenFinal + m.content +
               (last_open ? "" : closes ? "<|return|>" : "<|end|>");
        last_call.clear();
      }
    }
    if (opt.add_generation_prompt) out += "<|start|>assistant";
    return out;
  }
  fail("this model has no chat template kvq supports (supported: {})", chat_supported_families());
}

namespace {
// The markers that end a harmony message (the text in between is the message's, markers of other
// kinds included), and those a header opens with.
constexpr std::string_view kHarmonyEnds[] = {"<|end|>", "<|return|>", "<|call|>", "<|start|>"};
constexpr std::string_view kHarmonyHeaderOpen[] = {"<|start|>", "<|channel|>", "<|constrain|>", "<|message|>", " to="};
// Whether s (of any length) and m agree on their common start
bool starts_alike(std::string_view s, std::string_view m) {
  const size_t n = std::min(s.size(), m.size());
  return s.substr(0, n) == m.substr(0, n);
}
}  // namespace

HarmonyReplyStream::Delta HarmonyReplyStream::feed(const std::string& text) {
  Delta d;
  buf_ += text;
  for (;;) {
    if (state_ == State::header) {
      // A header: '<|start|>assistant<|channel|>final ...<|message|>' (or its tail after the
      // prompt's '<|start|>assistant'); a reply that does not open with one of its markers is content.
      if (buf_.empty()) break;
      if (std::none_of(std::begin(kHarmonyHeaderOpen), std::end(kHarmonyHeaderOpen),
                       [&](std::string_view m) { return starts_alike(buf_, m); })) {
        state_ = State::other;
        continue;
      }
      const size_t msg = buf_.find("<|message|>");
      if (msg == std::string::npos) break;  // the header is not complete yet
      const size_t ch = buf_.find("<|channel|>");
      std::string channel;
      if (ch != std::string::npos && ch < msg) {
        channel = buf_.substr(ch + 11, msg - ch - 11);
        channel = channel.substr(0, channel.find_first_of(" <"));
      }
      std::string recipient;
      if (const size_t to = buf_.find("to="); to < msg) {
        recipient = buf_.substr(to + 3, msg - to - 3);
        recipient = recipient.substr(0, recipient.find_first_of(" <"));
      }
      state_ = take_calls_ && recipient.starts_with("functions.") ? State::call
               : channel == "analysis"                              ? State::analysis
                                                                    : State::other;
      if (state_ == State::call) {
        call_ = {recipient.substr(10), ""};
      } else if (state_ == State::analysis ? reasoning_seen_ : content_seen_) {
        emit(d, "\n");  // a message after another of its kind starts on a new line
      }
      buf_.erase(0, msg + 11);
      continue;
    }
    // A message's body: up to the marker that ends it
    size_t at = std::string::npos, len = 0;
    for (std::string_view m : kHarmonyEnds)
      if (const size_t p = buf_.find(m); p != std::string::npos && p < at) {
        at = p;
        len = m.size();
      }
    if (at == std::string::npos) {
      // hold back a tail that may be an end marker's beginning
      size_t keep = 0;
      for (std::string_view m : kHarmonyEnds)
        for (size_t k = std::min(m.size() - 1, buf_.size()); k > keep; --k)
          if (buf_.compare(buf_.size() - k, k, m.substr(0, k)) == 0) {
            keep = k;
            break;
          }
      emit(d, buf_.substr(0, buf_.size() - keep));
      buf_.erase(0, buf_.size() - keep);
      break;
    }
    emit(d, buf_.substr(0, at));
    if (state_ == State::call) d.calls.push_back(std::move(call_));
    const bool start = buf_.compare(at, len, "<|start|>") == 0;
    buf_.erase(0, start ? at : at + len);  // a new header's marker stays for the header to read
    state_ = State::header;
  }
  return d;
}

HarmonyReplyStream::Delta HarmonyReplyStream::finish() {
  Delta d;
  if (state_ != State::header) emit(d, buf_);
  if (state_ == State::call) d.calls.push_back(std::move(call_));
  buf_.clear();
  state_ = State::header;
  return d;
}

HarmonyReplyStream::Delta HarmonyReplyStream::split(const std::string& text, bool take_calls) {
  HarmonyReplyStream hs(take_calls);
  return hs.split_after("", text);
}

std::optional<bool> chat_template_kwargs_thinking(const std::string& json_text) {
  const nlohmann::json kw = nlohmann::json::parse(json_text, nullptr, false);
  if (kw.is_discarded()) fail("chat template kwargs must be a JSON object, such as {{\"enable_thinking\": false}}");
  return chat_template_kwargs_json_thinking(kw);
}

std::optional<bool> chat_template_kwargs_json_thinking(const nlohmann::json& kw) {
  if (!kw.is_object()) fail("chat template kwargs must be a JSON object, such as {{\"enable_thinking\": false}}");
  std::optional<bool> thinking;
  for (const auto& [k, v] : kw.items()) {
    if (k != "enable_thinking") fail("chat template kwarg '{}' is not supported (kvq renders the chat templates itself and reads only enable_thinking)", k);
    if (!v.is_boolean()) fail("chat template kwarg enable_thinking must be true or false");
    thinking = v.get<bool>();
  }
  return thinking;
}

bool chat_template_kwargs_flag(const std::string& flag_text) {
  if (flag_text.empty()) return true;
  try {
    return chat_template_kwargs_thinking(flag_text).value_or(true);
  } catch (const Error& e) {
    fail("--chat-template-kwargs: {}", e.what());
  }
}

bool chat_reasons(const ChatTemplate& t) { return t.family == ChatFamily::harmony || t.think != ChatTemplate::Think::none; }

void chat_warn_budget_unused(const ChatTemplate& t, int reasoning_budget) {
  if (reasoning_budget < 0 || chat_reasons(t)) return;
  std::fprintf(stderr, "[kvq] warning: --reasoning-budget bounds harmony replies (gpt-oss) and reasoning templates' "
               "(<think>); this model's template (%s) has no reasoning: ignored\n", chat_template_name(t));
}

ChatReplySplitter::Delta ChatReplySplitter::split_after(const std::string& opening, const std::string& text) {
  (void)feed(opening);
  Delta d = feed(text);
  const Delta rest = finish();
  d.reasoning += rest.reasoning;
  d.content += rest.content;
  d.calls.insert(d.calls.end(), rest.calls.begin(), rest.calls.end());
  d.cut_call += rest.cut_call;
  return d;
}

std::unique_ptr<ChatReplySplitter> chat_reply_splitter(const ChatTemplate& t, bool take_calls) {
  if (t.family == ChatFamily::harmony) return std::make_unique<HarmonyReplyStream>(take_calls);
  std::unique_ptr<ChatReplySplitter> think;
  if (t.think != ChatTemplate::Think::none)
    think = std::make_unique<ThinkReplyStream>(take_calls && t.qwen_tools ? QwenToolReplyStream::kOpen : "");
  if (take_calls && t.qwen_tools) return std::make_unique<QwenToolReplyStream>(std::move(think));
  return think;
}

std::string chat_reply_opening(const ChatTemplate& t, const std::string& prompt) {
  if (t.think == ChatTemplate::Think::none) return {};
  const std::string open = "<|im_start|>assistant\n";
  const size_t at = prompt.rfind(open);
  return at == std::string::npos ? std::string() : prompt.substr(at + open.size());
}

ReasoningBudget chat_reasoning_budget(const ChatTemplate& t, int tokens, const std::string& message,
                                      const std::string& opening, bool calls) {
  ReasoningBudget b;
  if (tokens < 0) return b;
  if (!message.empty()) b.message = "\n" + message;
  if (t.family == ChatFamily::harmony) {
    if (!opening.empty()) return b;  // (its final channel or a call opened by the prompt)
    b.open = "<|channel|>analysis<|message|>";
    b.close = {"<|end|>"};
    b.force = std::string("<|end|><|start|>assistant") + (calls ? "" : HarmonyReplyStream::kOpenFinal);
    b.reopen = calls;  // (the model picks its next channel: another analysis message counts on)
  } else if (t.think != ChatTemplate::Think::none) {
    const size_t open = opening.rfind("<think>");
    if (open != std::string::npos && opening.find("</think>", open) != std::string::npos) return b;  // closed
    if (open == std::string::npos) b.open = "<think>";  // (else the prompt opened it)
    b.prompt_newline = opening.empty() || opening.back() == '\n';
    b.close = {"</think>"};
    if (calls && t.qwen_tools) b.close.push_back(QwenToolReplyStream::kOpen);
    b.force = "\n</think>\n\n";
  } else {
    return b;
  }
  b.tokens = tokens;
  return b;
}

namespace {
// The length of the longest end of `s` that is a proper start of `marker`.
size_t marker_start_at_end(const std::string& s, std::string_view marker) {
  for (size_t k = std::min(s.size(), marker.size() - 1); k > 0; --k)
    if (s.compare(s.size() - k, k, marker.data(), k) == 0) return k;
  return 0;
}
// `at` moved back over the newlines before it in s (held back with a marker's start after them).
size_t before_newlines(const std::string& s, size_t at) {
  while (at > 0 && s[at - 1] == '\n') --at;
  return at;
}
}  // namespace

ThinkReplyStream::Delta ThinkReplyStream::feed(const std::string& text) {
  static constexpr std::string_view kOpen = "<think>", kClose = "</think>";
  Delta d;
  buf_ += text;
  for (;;) {
    switch (state_) {
      case State::start: {
        const size_t b = buf_.find_first_not_of(" \t\r\n");
        if (b == std::string::npos) return d;  // only whitespace so far
        const std::string_view rest = std::string_view(buf_).substr(b);
        if (rest.starts_with(kOpen)) {
          buf_.erase(0, b + kOpen.size());
          state_ = State::reasoning;
        } else if (kOpen.starts_with(rest)) {
          return d;  // may be the marker's start
        } else {
          state_ = State::answer;
        }
        break;
      }
      case State::reasoning: {
        if (!reasoning_text_) {
          lstrip_newlines(buf_);
          if (buf_.empty()) return d;
          reasoning_text_ = true;
        }
        const size_t close = buf_.find(kClose);
        const size_t other = also_ends_.empty() ? std::string::npos : buf_.find(also_ends_);
        if (close != std::string::npos || other != std::string::npos) {
          const bool own = other == std::string::npos || (close != std::string::npos && close < other);
          const size_t at = own ? close : other;
          std::string r = buf_.substr(0, at);
          rstrip_newlines(r);
          d.reasoning += r;
          buf_.erase(0, own ? at + kClose.size() : at);  // (the other marker starts the answer)
          state_ = own ? State::answer_start : State::answer;
          break;
        }
        // held back: a start of a marker at the end, and the newlines before it
        const size_t cut = before_newlines(
            buf_, buf_.size() - std::max(marker_start_at_end(buf_, kClose),
                                         also_ends_.empty() ? size_t(0) : marker_start_at_end(buf_, also_ends_)));
        d.reasoning += buf_.substr(0, cut);
        buf_.erase(0, cut);
        return d;
      }
      case State::answer_start:
        lstrip_newlines(buf_);
        if (buf_.empty()) return d;
        state_ = State::answer;
        break;
      case State::answer:
        d.content += buf_;
        buf_.clear();
        return d;
    }
  }
}

void QwenToolReplyStream::answer(const std::string& text, Delta& d, bool end) {
  static constexpr std::string_view kO = kOpen, kC = kClose;
  buf_ += text;
  for (;;) {
    if (in_call_) {
      // (searched from where the last search stopped: a call's text grows a token at a time)
      const size_t close = buf_.find(kC, searched_);
      if (close == std::string::npos) {
        searched_ = buf_.size() < kC.size() ? 0 : buf_.size() - kC.size() + 1;
        if (end) {  // cut short
          d.cut_call += newlines_ + std::string(kO) + buf_;
          buf_.clear();
          in_call_ = false;
        }
        return;
      }
      searched_ = 0;
      const std::string body = buf_.substr(0, close);
      buf_.erase(0, close + kC.size());
      in_call_ = false;
      after_call_ = true;
      const nlohmann::ordered_json v = nlohmann::ordered_json::parse(body, nullptr, false);
      const bool call = !v.is_discarded() && v.is_object() && v.contains("name") && v["name"].is_string() &&
                        (!v.contains("arguments") || v["arguments"].is_object() || v["arguments"].is_string());
      if (call) {
        const std::string args = !v.contains("arguments")         ? std::string("{}")
                                 : v["arguments"].is_string() ? v["arguments"].get<std::string>()
                                                              : json_dumps(v["arguments"]);
        d.calls.push_back({v["name"].get<std::string>(), args});
      } else {
        d.cut_call += newlines_ + std::string(kO) + body + std::string(kC);
      }
      continue;
    }
    if (after_call_) {  // the newlines between calls
      lstrip_newlines(buf_);
      if (buf_.empty()) return;
      after_call_ = false;
    }
    if (const size_t open = buf_.find(kO); open != std::string::npos) {
      std::string c = buf_.substr(0, open);
      const size_t text_end = c.find_last_not_of('\n') + 1;
      newlines_ = c.substr(text_end);
      c.resize(text_end);
      d.content += c;
      buf_.erase(0, open + kO.size());
      in_call_ = true;
      searched_ = 0;
      continue;
    }
    if (end) {
      // a start of the marker at the reply's end ('<t' or more) is a call cut short there
      const size_t start = marker_start_at_end(buf_, kO);
      if (start >= 2) {
        const size_t from = before_newlines(buf_, buf_.size() - start);
        d.cut_call += buf_.substr(from);
        buf_.resize(from);
      }
      d.content += buf_;
      buf_.clear();
      return;
    }
    // held back: a start of the marker at the end, and the newlines before it
    const size_t cut = before_newlines(buf_, buf_.size() - marker_start_at_end(buf_, kO));
    d.content += buf_.substr(0, cut);
    buf_.erase(0, cut);
    return;
  }
}

QwenToolReplyStream::Delta QwenToolReplyStream::feed(const std::string& text) {
  Delta d;
  if (!inner_) {
    answer(text, d, false);
    return d;
  }
  const Delta in = inner_->feed(text);
  d.reasoning = in.reasoning;
  answer(in.content, d, false);
  return d;
}

QwenToolReplyStream::Delta QwenToolReplyStream::finish() {
  Delta d;
  if (inner_) {
    const Delta in = inner_->finish();
    d.reasoning = in.reasoning;
    answer(in.content, d, true);
  } else {
    answer("", d, true);
  }
  return d;
}

ThinkReplyStream::Delta ThinkReplyStream::finish() {
  Delta d;
  if (state_ == State::start) {
    d.content = buf_;
  } else if (state_ == State::reasoning) {
    d.reasoning = buf_;
    rstrip_newlines(d.reasoning);
  }
  buf_.clear();
  return d;
}

}  // namespace kvq
