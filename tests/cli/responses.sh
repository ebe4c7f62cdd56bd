#!/usr/bin/env bash
# OpenAI's Responses API on kvq serve with a real chat model (SmolLM2-135M-Instruct,
# scripts/get-models.sh), read by the official `openai` client when it can be installed
# (common.bash's openai_python): a response and its stream (the SDK's accumulator), a conversation
# continued by previous_response_id, function calls and their outputs, structured output parsed
# into a pydantic model, item references, input items, retrieve / delete, and its error classes. Without the client, a plain HTTP
# check of a response and a continued one.
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
        return json.loads(r.read().decode())
q = [{"role": "user", "content": "What is the capital of France?"}]
chat = post("/v1/chat/completions", {"messages": q, "max_tokens": 40, "temperature": 0})
r = post("/v1/responses", {"input": q, "max_output_tokens": 40, "temperature": 0})
text = chat["choices"][0]["message"]["content"]
assert r["output"][0]["content"][0]["text"] == text, (r, text)
r2 = post("/v1/responses", {"previous_response_id": r["id"], "input": "And of Italy?", "max_output_tokens": 40, "temperature": 0})
chat2 = post("/v1/chat/completions", {"messages": q + [{"role": "assistant", "content": text}, {"role": "user", "content": "And of Italy?"}],
                                      "max_tokens": 40, "temperature": 0})
assert r2["output"][0]["content"][0]["text"] == chat2["choices"][0]["message"]["content"], (r2, chat2)
print("responses over http ok")
PY
check "a response and a continued one are the chat endpoint's" "grep -q 'responses over http ok' $tmp/py.out || { cat $tmp/py.out; false; }"

py=$(openai_python)
if [[ -n $py ]]; then
  "$py" - "$url" >"$tmp/oa.out" 2>&1 <<'PY'
import json, sys
import openai
from pydantic import BaseModel
c = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="none")
model = c.models.list().data[0].id
r = c.responses.create(model=model, instructions="Answer in one sentence.", input="What is the capital of France?",
                       max_output_tokens=60, temperature=0)
assert r.status == "completed" and r.output_text, r
with c.responses.stream(model=model, instructions="Answer in one sentence.", input="What is the capital of France?",
                        max_output_tokens=60, temperature=0) as s:
    deltas = "".join(e.delta for e in s if e.type == "response.output_text.delta")
    final = s.get_final_response()
assert deltas == r.output_text and final.output_text == r.output_text, (deltas, r.output_text)
r2 = c.responses.create(model=model, previous_response_id=r.id, input="And of Italy?", max_output_tokens=60, temperature=0)
assert r2.output_text and r2.previous_response_id == r.id, r2
assert c.responses.retrieve(r2.id).output_text == r2.output_text
tools = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}]
t = c.responses.create(model=model, input="What is the weather in Rome?", tools=tools, tool_choice="required",
                       parallel_tool_calls=False, max_output_tokens=120, temperature=0)
call = [o for o in t.output if o.type == "function_call"][0]
assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str), call
with c.responses.stream(model=model, input="What is the weather in Rome?", tools=tools, tool_choice="required",
                        parallel_tool_calls=False, max_output_tokens=120, temperature=0) as s:
    sf = s.get_final_response()
sc = [o for o in sf.output if o.type == "function_call"][0]
assert sc.arguments == call.arguments, (sc, call)
t2 = c.responses.create(model=model, previous_response_id=t.id, tools=tools, max_output_tokens=60, temperature=0,
                        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 C, cloudy"}])
assert t2.status in ("completed", "incomplete"), t2
class City(BaseModel):
    name: str
    country: str
p = c.responses.parse(model=model, input="Paris", text_format=City, max_output_tokens=80, temperature=0)
assert isinstance(p.output_parsed, City), p
c.responses.delete(r.id)
try:
    c.responses.retrieve(r.id)
    raise SystemExit("a deleted response was returned")
except openai.NotFoundError:
    pass
# a hosted tool is not offered (kvq runs none); one forced by tool_choice is refused
h = c.responses.create(model=model, input="Hi", tools=[{"type": "web_search"}], max_output_tokens=4)
assert all(o.type in ("message", "reasoning") for o in h.output), h
try:
    c.responses.create(model=model, input="x", tools=[{"type": "web_search"}], tool_choice={"type": "web_search"})
    raise SystemExit("a hosted tool was forced")
except openai.BadRequestError as e:
    assert "tool_choice" in str(e), e
# an item of a kept response, referred to
ref = c.responses.create(model=model, input=[{"type": "item_reference", "id": r2.output[0].id},
                                             {"role": "user", "content": "Thanks"}], max_output_tokens=8)
assert ref.status in ("completed", "incomplete"), ref
items = c.responses.input_items.list(r2.id)
assert [i.type for i in items.data] == ["message"], items
# background: queued at once, polled until done (the foreground output), cancelled
import time
bg = c.responses.create(model=model, instructions="Answer in one sentence.", input="What is the capital of France?",
                        max_output_tokens=60, temperature=0, background=True)
assert bg.status in ("queued", "in_progress", "completed", "incomplete") and bg.background, bg
for _ in range(600):
    bg = c.responses.retrieve(bg.id)
    if bg.status not in ("queued", "in_progress"):
        break
    time.sleep(0.05)
assert bg.status == "completed" and bg.output_text == r.output_text, (bg.status, bg.output_text, r.output_text)
assert c.responses.cancel(bg.id).status == "completed"
long = c.responses.create(model=model, input="Tell a long story.", max_output_tokens=400, background=True)
assert c.responses.cancel(long.id).status in ("cancelled", "completed", "incomplete")
print("openai responses ok")
PY
  check "official openai client: responses, streams, previous_response_id, function calls, parse, retrieve/delete, background/cancel" \
    "grep -q 'openai responses ok' $tmp/oa.out || { cat $tmp/oa.out; false; }"
else
  echo "note: the openai package could not be installed; its client check is skipped"
fi
finish responses
