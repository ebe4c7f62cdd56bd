#!/usr/bin/env bash
# Function calling on kvq serve with a real chat model (SmolLM2-135M-Instruct, scripts/get-models.sh):
# sampled tool calls whose arguments Python's jsonschema validates against the function's
# parameters, streamed calls assembled as OpenAI's clients assemble them, a conversation with a
# tool's result, and (when the `openai` package can be installed: common.bash's openai_python)
# the official client reading the calls into its own types.
set -u
source "$(dirname "$0")/common.bash"
smol=${KVQ_MODELS_DIR:-$src/models}/SmolLM2-135M-Instruct.Q4_1.gguf
[[ -f $smol ]] || smol=$src/models/SmolLM2-135M-Instruct.Q4_1.gguf
require "$smol"
python3 -c 'import jsonschema' 2>/dev/null || { echo "skip: python3 jsonschema not installed (scripts/install-deps.sh)"; exit 77; }
serve_model "$smol" -t 2 -c 2048 --kv-tokens 8192

python3 - "$url" >"$tmp/py.out" 2>&1 <<'PY'
import json, sys, urllib.request, urllib.error
import jsonschema
url = sys.argv[1]
tools = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather forecast for a city",
     "parameters": {"type": "object", "properties": {
         "city": {"type": "string", "minLength": 1, "maxLength": 20},
         "days": {"type": "integer", "minimum": 1, "maximum": 7},
         "unit": {"enum": ["celsius", "fahrenheit"]}},
         "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "book_flight", "description": "Books a flight",
     "parameters": {"$defs": {"code": {"type": "string", "pattern": "^[A-Z]{3}$"}},
         "type": "object", "properties": {
         "from": {"$ref": "#/$defs/code"}, "to": {"$ref": "#/$defs/code"},
         "passengers": {"type": "array", "items": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                        "age": {"type": "integer", "minimum": 0, "maximum": 120}}, "required": ["name"]}, "minItems": 1, "maxItems": 3}},
         "required": ["from", "to", "passengers"]}}},
]
params = {t["function"]["name"]: t["function"]["parameters"] for t in tools}

def post(body):
    req = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()

def check_calls(calls):
    ids = set()
    for c in calls:
        assert c["type"] == "function" and c["id"].startswith("call_"), c
        ids.add(c["id"])
        args = json.loads(c["function"]["arguments"])
        jsonschema.Draft202012Validator(params[c["function"]["name"]]).validate(args)
    assert len(ids) == len(calls), calls

questions = ["What's the weather in Paris this week?", "Book me a flight from JFK to LHR for Ann.",
             "Will it rain in Tokyo tomorrow?", "I need two seats from SFO to CDG, for Bob (40) and Eve (38)."]
valid = 0
for i, q in enumerate(questions * 2):
    body = {"messages": [{"role": "user", "content": q}], "tools": tools, "tool_choice": "required",
            "parallel_tool_calls": False, "temperature": 1.0, "seed": i + 1, "max_tokens": 200}
    st, text = post(body)
    assert st == 200, text
    ch = json.loads(text)["choices"][0]
    if ch["finish_reason"] == "length":
        continue
    assert ch["finish_reason"] == "tool_calls", ch
    assert ch["message"]["content"] is None and len(ch["message"]["tool_calls"]) == 1, ch
    check_calls(ch["message"]["tool_calls"])
    valid += 1
assert valid >= 6, valid
print(f"required, one call: {valid} of 8 replies complete and valid")

# auto, greedy: plain and streamed replies agree (calls assembled by index, arguments joined)
for q in questions:
    body = {"messages": [{"role": "user", "content": q}], "tools": tools, "temperature": 0, "max_tokens": 300}
    st, text = post(body)
    assert st == 200, text
    msg = json.loads(text)["choices"][0]["message"]
    if msg.get("tool_calls"):
        check_calls(msg["tool_calls"])
    st, raw = post(dict(body, stream=True))
    assert st == 200, raw
    calls, content, finish = {}, "", None
    for line in raw.split("\n\n"):
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ch = json.loads(line[6:])["choices"][0]
        d = ch["delta"]
        content += d.get("content") or ""
        for tc in d.get("tool_calls") or []:
            slot = calls.setdefault(tc["index"], {"id": "", "name": "", "arguments": ""})
            slot["id"] += tc.get("id") or ""
            slot["name"] += tc["function"].get("name") or ""
            slot["arguments"] += tc["function"].get("arguments") or ""
        finish = ch["finish_reason"] or finish
    plain = [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls") or []]
    assert [(calls[k]["name"], calls[k]["arguments"]) for k in sorted(calls)] == plain, (calls, plain)
    assert content == (msg["content"] or ""), (content, msg)
    assert finish == json.loads(text)["choices"][0]["finish_reason"], finish
print("auto: streamed equals plain")

# a conversation: the call and its result go back, and the model answers or calls again
body = {"messages": [{"role": "user", "content": questions[0]},
                     {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                      "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 7}"}}]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "Sunny all week, 24 C."}],
        "tools": tools, "temperature": 0, "max_tokens": 100}
st, text = post(body)
assert st == 200, text
ch = json.loads(text)["choices"][0]
assert ch["finish_reason"] in ("stop", "tool_calls", "length"), ch
if ch["message"].get("tool_calls"):
    check_calls(ch["message"]["tool_calls"])
print("conversation ok:", ch["finish_reason"])

st, text = post({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {
    "name": "f", "strict": True, "parameters": {"type": "object", "properties": {"x": {"not": {}}}}}}]})
assert st == 400 and json.loads(text)["error"]["param"] == "tools[0].function.parameters", text
print("tools ok")
PY
check "tool calls validated by jsonschema, streamed = plain, conversation, 400" \
  "grep -q 'tools ok' $tmp/py.out || { cat $tmp/py.out; false; }"
grep -E "^(required|auto|conversation)" "$tmp/py.out"

py=$(openai_python)
if [[ -n $py ]]; then
  "$py" - "$url" >"$tmp/oa.out" 2>&1 <<'PY'
import json, sys
import openai
c = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="none")
model = c.models.list().data[0].id
tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
          "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}]
msgs = [{"role": "user", "content": "Weather in Rome?"}]
r = c.chat.completions.create(model=model, messages=msgs, tools=tools, tool_choice="required", temperature=0, max_tokens=120)
m = r.choices[0].message
assert r.choices[0].finish_reason == "tool_calls" and m.tool_calls, r
call = m.tool_calls[0]
assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str), call
# the reply and a result go back as the client builds them
msgs += [m.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "18 C, cloudy"}]
r2 = c.chat.completions.create(model=model, messages=msgs, tools=tools, temperature=0, max_tokens=60)
assert r2.choices[0].finish_reason in ("stop", "tool_calls", "length"), r2
with c.chat.completions.stream(model=model, messages=msgs[:1], tools=tools, tool_choice="required", temperature=0,
                               max_tokens=120) as s:
    final = s.get_final_completion()
fc = final.choices[0].message.tool_calls
assert fc and fc[0].function.name == call.function.name and fc[0].function.arguments == call.function.arguments, final
print("openai client tools ok")
PY
  check "official openai client: tool calls, a conversation, streamed calls" \
    "grep -q 'openai client tools ok' $tmp/oa.out || { cat $tmp/oa.out; false; }"
else
  echo "note: the openai package could not be installed; its client check is skipped"
fi

kill $pid 2>/dev/null
wait $pid 2>/dev/null
pid=
finish tools
