// Chat templates for the supported instruct models, chosen from the GGUF's
// tokenizer.chat_template: ChatML (SmolLM2-Instruct) and Gemma's turn format.
#pragma once
#include <string>
#include <vector>

namespace kvq {
namespace gguf { class File; }

struct ChatMessage {
  std::string role;     // "system", "user", "assistant"
  std::string content;
};

enum class ChatTemplate { none, chatml, gemma };

// Detects the template family; ChatTemplate::none when the model has no template kvq knows.
ChatTemplate chat_template_detect(const gguf::File& f);
const char* chat_template_name(ChatTemplate t);
// Renders messages and the opening of the assistant's turn. The BOS token is not included
// (the tokenizer adds it when the model wants it). Throws kvq::Error for an unknown role.
std::string chat_render(ChatTemplate t, const std::vector<ChatMessage>& msgs);

}  // namespace kvq
