#include "model/chat.h"

#include "core/error.h"
#include "gguf/gguf.h"

namespace kvq {

ChatTemplate chat_template_detect(const gguf::File& f) {
  auto t = f.get_string("tokenizer.chat_template");
  if (!t) return ChatTemplate::none;
  if (t->find("<|im_start|>") != std::string::npos) return ChatTemplate::chatml;
  if (t->find("<start_of_turn>") != std::string::npos) return ChatTemplate::gemma;
  return ChatTemplate::none;
}

const char* chat_template_name(ChatTemplate t) {
  switch (t) {
    case ChatTemplate::chatml: return "chatml";
    case ChatTemplate::gemma: return "gemma";
    default: return "none";
  }
}

std::string chat_render(ChatTemplate t, const std::vector<ChatMessage>& msgs) {
  std::string out;
  for (const auto& m : msgs)
    if (m.role != "system" && m.role != "user" && m.role != "assistant")
      fail("unknown chat role '{}' (valid: system, user, assistant)", m.role);
  if (t == ChatTemplate::chatml) {
    // SmolLM2's template inserts its default system prompt when the conversation has none.
    if (msgs.empty() || msgs[0].role != "system")
      out += "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n";
    for (const auto& m : msgs) out += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
    out += "<|im_start|>assistant\n";
    return out;
  }
  if (t == ChatTemplate::gemma) {
    // Gemma has no system role: the system text is prefixed to the first user turn.
    std::string pending_system;
    for (const auto& m : msgs) {
      if (m.role == "system") {
        pending_system += m.content + "\n\n";
        continue;
      }
      const char* role = m.role == "assistant" ? "model" : "user";
      std::string content = m.role == "user" ? pending_system + m.content : m.content;
      if (m.role == "user") pending_system.clear();
      out += std::string("<start_of_turn>") + role + "\n" + content + "<end_of_turn>\n";
    }
    out += "<start_of_turn>model\n";
    return out;
  }
  fail("this model has no chat template kvq supports (supported: ChatML, Gemma)");
}

}  // namespace kvq
