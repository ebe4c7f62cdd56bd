#!/usr/bin/env bash
# Anthropic's Messages API on kvq serve with a real chat model (SmolLM2-135M-Instruct,
# scripts/get-models.sh): a reply and its stream over plain HTTP, the same as the chat endpoint's
# (greedy); and, when the `anthropic` package can be installed (common.bash's anthropic_python),
# the official client: messages, streams assembled by its accumulator, tool use with a result
# sent back, count_tokens, and its error classes.
set -u
source "$(dirname "$0")/common.bash"
smol=${KVQ_MODELS_DIR:-$src/models}/SmolLM2-135M-Instruct.Q4_1.gguf
[[ -f $smol ]] || smol=$src/models/SmolLM2-135M-Instruct.Q4_1.gguf
require "$smol"
serve_model "$smol" -t 2 -c 2048 --kv-tokens 8192

python3 - "$url" >"$tmp/py.out" 2>&1 <<'PY'
import json, sys, urllib.request
url = sys.argv[1]
def post(path, body):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req) as r:
        return r.read().decode()
msgs = [{"role": "user", "content": "What is the capital of France?"}]
chat = json.loads(post("/v1/chat/completions", {"messages": [{"role": "system", "content": "Answer in one sentence."}] + msgs,
                                                 "max_tokens": 40, "temperature": 0}))
m = json.loads(post("/v1/messages", {"system": "Answer in one sentence.", "messages": msgs, "max_tokens": 40, "temperature": 0}))
text = chat["choices"][0]["message"]["content"]
assert m["content"] == [{"type": "text", "text": text}], (m, text)
assert m["stop_reason"] == {"stop": "end_turn", "length": "max_tokens"}[chat["choices"][0]["finish_reason"]], m
u = m["usage"]
assert u["input_tokens"] + u["cache_read_input_tokens"] == chat["usage"]["prompt_tokens"] and u["output_tokens"] == chat["usage"]["completion_tokens"], (u, chat["usage"])
raw = post("/v1/messages", {"system": "Answer in one sentence.", "messages": msgs, "max_tokens": 40, "temperature": 0, "stream": True})
events = [e for e in raw.split("\n\n") if e]
names = [e.split("\n")[0][len("event: "):] for e in events]
datas = [json.loads(e.split("\n")[1][len("data: "):]) for e in events]
assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"], names
streamed = "".join(d["delta"]["text"] for d in datas if d["type"] == "content_block_delta")
assert streamed == text, (streamed, text)
print("messages over http ok")
PY
check "a reply and its stream are the chat endpoint's" "grep -q 'messages over http ok' $tmp/py.out || { cat $tmp/py.out; false; }"

py=$(anthropic_python)
if [[ -n $py ]]; then
  "$py" - "$url" >"$tmp/an.out" 2>&1 <<'PY'
import json, sys
import anthropic
c = anthropic.Anthropic(base_url=sys.argv[1], api_key="none")
model = "SmolLM2-135M-Instruct.Q4_1"
greedy = {"temperature": 0}  # (sampling fields travel as extra_body in the newest clients)
m = c.messages.create(model=model, max_tokens=30, messages=[{"role": "user", "content": "Name a colour."}], extra_body=greedy)
assert m.type == "message" and m.role == "assistant" and m.content[0].type == "text", m
with c.messages.stream(model=model, max_tokens=30, messages=[{"role": "user", "content": "Name a colour."}], extra_body=greedy) as s:
    text = "".join(s.text_stream)
    final = s.get_final_message()
assert text == m.content[0].text and final.content[0].text == text and final.stop_reason == m.stop_reason, (text, m, final)
assert final.usage.output_tokens == m.usage.output_tokens, final.usage
tools = [{"name": "get_weather", "description": "The weather in a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}]
msgs = [{"role": "user", "content": "What is the weather in Rome?"}]
r = c.messages.create(model=model, max_tokens=120, messages=msgs, tools=tools,
                      tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body=greedy)
assert r.stop_reason == "tool_use", r
call = [b for b in r.content if b.type == "tool_use"][0]
assert call.name == "get_weather" and isinstance(call.input["city"], str) and call.id.startswith("toolu_"), call
with c.messages.stream(model=model, max_tokens=120, messages=msgs, tools=tools,
                       tool_choice={"type": "any", "disable_parallel_tool_use": True}, extra_body=greedy) as s:
    sf = s.get_final_message()
sc = [b for b in sf.content if b.type == "tool_use"][0]
assert sc.name == call.name and sc.input == call.input, (sc, call)
msgs += [{"role": "assistant", "content": r.content},
         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18 C, cloudy"}]}]
r2 = c.messages.create(model=model, max_tokens=60, messages=msgs, tools=tools, extra_body=greedy)
assert r2.stop_reason in ("end_turn", "tool_use", "max_tokens"), r2
n = c.messages.count_tokens(model=model, messages=msgs, tools=tools)
assert n.input_tokens == r2.usage.input_tokens + r2.usage.cache_read_input_tokens, (n, r2.usage)
try:
    c.messages.create(model="claude-none", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    raise SystemExit("another model was served")
except anthropic.NotFoundError:
    pass
try:
    c.messages.create(model=model, max_tokens=5, messages=[{"role": "user", "content": [{"type": "image", "source":
        {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}}]}])
    raise SystemExit("an image was taken")
except anthropic.BadRequestError as e:
    assert "image" in str(e), e
print("anthropic client ok")
PY
  check "official anthropic client: messages, streams, tool use, count_tokens, errors" \
    "grep -q 'anthropic client ok' $tmp/an.out || { cat $tmp/an.out; false; }"
else
  echo "note: the anthropic package could not be installed; its client check is skipped"
fi
finish anthropic
