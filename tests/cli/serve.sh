#!/usr/bin/env bash
# kvq serve as a user runs it: start on a free port, talk to it with curl (and, when the `openai`
# Python package can be installed into a venv, with the official OpenAI client), stop it with
# SIGTERM; bad flags are rejected with a one-line error and a non-zero exit.
# The venv lives in $KVQ_OPENAI_VENV (default: $TMPDIR/kvq-openai-venv) and is reused.
set -u
source "$(dirname "$0")/common.bash"
require "$model"
unset KVQ_API_KEY  # the servers below ask for a key only where they say so
pid=
trap '[[ -n $pid ]] && kill $pid 2>/dev/null; rm -rf "$tmp"' EXIT

# bad flags
"$kvq" serve -m "$model" --kv-mem lots >"$tmp/o" 2>"$tmp/e"; rc=$?
check "--kv-mem lots exits 1" "[[ $rc -eq 1 ]] && grep -q 'not a size' $tmp/e"
"$kvq" serve -m "$model" --kv-mem 1GiB --kv-tokens 100 >"$tmp/o" 2>"$tmp/e"; rc=$?
check "--kv-mem with --kv-tokens exits 1" "[[ $rc -eq 1 ]] && grep -q 'not both' $tmp/e"
"$kvq" serve -m "$model" --kv nope >"$tmp/o" 2>"$tmp/e"; rc=$?
check "unknown KV format exits 1" "[[ $rc -eq 1 ]] && grep -q 'error' $tmp/e"
"$kvq" serve -m "$tmp/missing.gguf" >"$tmp/o" 2>"$tmp/e"; rc=$?
check "missing model exits 1" "[[ $rc -eq 1 ]]"
"$kvq" serve -m "$model" --tpot-target-ms -1 >"$tmp/o" 2>"$tmp/e"; rc=$?
check "negative --tpot-target-ms exits non-zero" "[[ $rc -ne 0 ]] && grep -q 'tpot-target-ms' $tmp/e"
"$kvq" serve -m "$model" --kv-offload-size 1MiB >"$tmp/o" 2>"$tmp/e"; rc=$?
check "--kv-offload-size without --kv-offload-dir exits 1" "[[ $rc -eq 1 ]] && grep -q 'needs --kv-offload-dir' $tmp/e"
"$kvq" serve -m "$model" --kv-offload-dir "$tmp" --kv-offload-size 1x >"$tmp/o" 2>"$tmp/e"; rc=$?
check "a bad --kv-offload-size exits 1" "[[ $rc -eq 1 ]] && grep -q 'kv-offload-size' $tmp/e"
"$kvq" serve -m "$model" --kv-offload-direct >"$tmp/o" 2>"$tmp/e"; rc=$?
check "--kv-offload-direct without a tier exits 1" "[[ $rc -eq 1 ]] && grep -q 'kv-offload-direct needs' $tmp/e"

# wait_port LOG: the port a server started with --port 0 reports in its log (empty after 10 s)
wait_port() {
  local p=
  for _ in $(seq 100); do
    p=$(sed -n 's|.*serving .* on http://127.0.0.1:\([0-9]*\).*|\1|p' "$1")
    [[ -n $p ]] && break
    sleep 0.1
  done
  echo "$p"
}

# start on a free port (it prints the port it got)
mkdir -p "$tmp/tier"
"$kvq" serve -m "$model" --port 0 -t 1 -c 256 --kv-tokens 2048 --kv int8 --kv-page-tokens 16 --tpot-target-ms 50 \
  --kv-offload-dir "$tmp/tier" --kv-offload-size 1MiB 2>"$tmp/log" &
pid=$!
port=$(wait_port "$tmp/log")
check "server reports its port" "[[ -n '$port' ]]"
check "... and its step budget and target" "grep -q 'steps of up to 256 tokens, 50 ms per output token targeted' $tmp/log"
url=http://127.0.0.1:$port

check "/health is 200" "[[ \$(curl -s -o /dev/null -w '%{http_code}' $url/health) == 200 ]]"
check "/v1/models names the model" "curl -s $url/v1/models | grep -q '\"id\":\"stories260K\"'"
curl -s $url/v1/completions -H 'Content-Type: application/json' \
  -d '{"prompt": "Once upon a time", "max_tokens": 8, "temperature": 0}' >"$tmp/c.json"
check "completion has usage" "grep -q '\"completion_tokens\":8' $tmp/c.json"
curl -sN $url/v1/chat/completions -H 'Content-Type: application/json' \
  -d '{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "stream": true}' >"$tmp/s.txt"
check "stream ends with [DONE]" "[[ \$(tail -c 14 $tmp/s.txt) == 'data: [DONE]' ]] || tail -n 2 $tmp/s.txt | grep -q '^data: \[DONE\]'"
code=$(curl -s -o "$tmp/bad.json" -w '%{http_code}' $url/v1/completions -d '{"prompt": 1}')
check "bad prompt is 400 with an error object" "[[ $code == 400 ]] && grep -q invalid_request_error $tmp/bad.json"
check "/metrics has the TTFT histogram" "curl -s $url/metrics | grep -q '^kvq_time_to_first_token_seconds_count 2'"
check "... and the offload tier's size (1 MiB of 8 KiB slots) and counters" \
  "curl -s $url/metrics >$tmp/m.txt && grep -q '^kvq_kv_offload_capacity_pages 128' $tmp/m.txt && grep -q '^kvq_kv_offload_loaded_pages_total 0' $tmp/m.txt"
check "the startup line names the tier" "grep -q 'offload tier 128 pages' $tmp/log"

# the official OpenAI client
py=$(openai_python)
if [[ -n $py ]]; then
  "$py" - "$url" >"$tmp/py.out" 2>&1 <<'PY'
import sys
import openai
c = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="none")
r = c.completions.create(model="stories260K", prompt="Once upon a time", max_tokens=12, temperature=0)
assert r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length", r
text = r.choices[0].text
parts = [ch.choices[0].text for ch in c.completions.create(model="stories260K", prompt="Once upon a time",
                                                             max_tokens=12, temperature=0, stream=True)]
assert "".join(parts) == text, (parts, text)
r = c.chat.completions.create(model="stories260K", messages=[{"role": "user", "content": "Lily"}], max_tokens=10,
                              temperature=0, seed=3)
assert r.choices[0].message.role == "assistant" and r.usage.total_tokens == r.usage.prompt_tokens + 10, r
deltas = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
    model="stories260K", messages=[{"role": "user", "content": "Lily"}], max_tokens=10, temperature=0, stream=True)]
assert "".join(deltas) == r.choices[0].message.content, (deltas, r)
try:
    c.completions.create(model="stories260K", prompt="x", max_tokens=100000)
    raise SystemExit("expected a 400")
except openai.BadRequestError as e:
    assert e.status_code == 400 and "max_tokens" in str(e), e
print("openai client ok")
PY
  check "official openai client: completions, chat, streaming, 400" "grep -q 'openai client ok' $tmp/py.out || { cat $tmp/py.out; false; }"
else
  echo "note: the openai package could not be installed; its client check is skipped"
fi

kill -TERM $pid
wait $pid; rc=$?
pid=
check "SIGTERM stops the server with exit 0" "[[ $rc -eq 0 ]]"

# an API key, from --api-key or $KVQ_API_KEY: 401 without it, served with it, /health open
start_keyed() {  # KVQ_API_KEY's value, then more flags for the server
  local key=$1
  shift
  KVQ_API_KEY=$key "$kvq" serve -m "$model" --port 0 -t 1 -c 256 --kv-tokens 1024 --kv-page-tokens 16 "$@" 2>"$tmp/klog" &
  pid=$!
  url=http://127.0.0.1:$(wait_port "$tmp/klog")
}
for how in flag env; do
  if [[ $how == flag ]]; then start_keyed "" --api-key k3y; else start_keyed k3y; fi
  check "$how: the log says a key is required" "grep -q 'API key required' $tmp/klog"
  code=$(curl -s -o "$tmp/k.json" -w '%{http_code}' $url/v1/models)
  check "$how: no key is 401 invalid_api_key" "[[ $code == 401 ]] && grep -q invalid_api_key $tmp/k.json"
  check "$how: a wrong key is 401" "[[ \$(curl -s -o /dev/null -w '%{http_code}' -H 'Authorization: Bearer nope' $url/v1/models) == 401 ]]"
  check "$how: the key is served" "[[ \$(curl -s -o /dev/null -w '%{http_code}' -H 'Authorization: Bearer k3y' $url/v1/models) == 200 ]]"
  check "$how: /health needs no key" "[[ \$(curl -s -o /dev/null -w '%{http_code}' $url/health) == 200 ]]"
  kill -TERM $pid
  wait $pid
  pid=
done

# the offload tier over HTTP: a pool of 5 pages holds one prompt; a document evicted by two other
# prompts comes back from the tier for the next question on it
mkdir -p "$tmp/tier2"
"$kvq" serve -m "$model" --port 0 -t 1 -c 256 --kv-tokens 80 --kv int8 --kv-page-tokens 16 \
  --kv-offload-dir "$tmp/tier2" --kv-offload-size 1MiB 2>"$tmp/tlog" &
pid=$!
port=$(wait_port "$tmp/tlog")
url=http://127.0.0.1:$port
doc="Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her friends. One day, she saw a big red ball"
ask() { curl -s $url/v1/completions -H 'Content-Type: application/json' -d "{\"prompt\": \"$1\", \"max_tokens\": 8, \"temperature\": 0}" >/dev/null; }
ask "$doc and"
ask "Tom had a little dog named Max. Max liked to run and jump in the sun and the rain all day long and"
ask "The sun was hot and the sky was blue. Sue and Ben went to the lake to swim with the ducks all day and"
ask "$doc under a tree. She"
curl -s $url/metrics >"$tmp/tm.txt"
check "offload tier: the document's pages were written, read back and adopted" \
  "awk '/^kvq_kv_offload_stored_pages_total/ {s=\$2} /^kvq_kv_offload_loaded_pages_total/ {l=\$2} /^kvq_kv_offload_hit_tokens_total/ {h=\$2} END {exit !(s > 0 && l >= 2 && h >= 32)}' $tmp/tm.txt"
kill -TERM $pid
wait $pid
pid=

# --kv-offload-persist: the document computed before a restart is read back after it; a second
# server on the same tier file is refused while the first runs
"$kvq" serve -m "$model" --kv-offload-persist >"$tmp/o" 2>"$tmp/e"; rc=$?
check "--kv-offload-persist without a tier exits 1" "[[ $rc -eq 1 ]] && grep -q 'kv-offload-persist needs' $tmp/e"
mkdir -p "$tmp/tier3"
persist=(serve -m "$model" --port 0 -t 1 -c 256 --kv-tokens 80 --kv int8 --kv-page-tokens 16
  --kv-offload-dir "$tmp/tier3" --kv-offload-size 1MiB --kv-offload-persist)
"$kvq" "${persist[@]}" 2>"$tmp/plog" &
pid=$!
port=$(wait_port "$tmp/plog")
url=http://127.0.0.1:$port
ask "$doc and"
check "persistent tier: the startup line says so" "grep -q 'kept across runs: 0 pages from the last run' $tmp/plog"
"$kvq" "${persist[@]}" >"$tmp/o" 2>"$tmp/e"; rc=$?
check "persistent tier: a second server on the same file exits 1" "[[ $rc -eq 1 ]] && grep -q 'in use by another process' $tmp/e"
kill -TERM $pid
wait $pid
pid=
check "persistent tier: the file stays after the server stops" "ls $tmp/tier3/kvq-offload-*.kvq >/dev/null"
"$kvq" "${persist[@]}" 2>"$tmp/plog" &
pid=$!
port=$(wait_port "$tmp/plog")
url=http://127.0.0.1:$port
check "persistent tier: the restarted server names the pages kept" \
  "grep -Eq 'kept across runs: [1-9][0-9]* pages from the last run' $tmp/plog"
ask "$doc under a tree. She"
curl -s $url/metrics >"$tmp/pm.txt"
check "persistent tier: the document is read back after the restart, not recomputed" \
  "awk '/^kvq_kv_offload_pages_at_start/ {a=\$2} /^kvq_kv_offload_loaded_pages_total/ {l=\$2} /^kvq_kv_offload_hit_tokens_total/ {h=\$2} END {exit !(a >= 2 && l >= 2 && h >= 32)}' $tmp/pm.txt"
kill -TERM $pid
wait $pid
pid=

# speculative decoding by prompt lookup: the same greedy text as without, drafts counted in /metrics
"$kvq" serve -m "$model" --draft-max 65 >"$tmp/o" 2>"$tmp/e"; rc=$?
check "--draft-max beyond 64 exits non-zero" "[[ $rc -ne 0 ]] && grep -q 'draft-max' $tmp/e"
"$kvq" serve -m "$model" --draft-ngram-min 5 --draft-ngram-max 3 >"$tmp/o" 2>"$tmp/e"; rc=$?
check "--draft-ngram-min above --draft-ngram-max exits 1" "[[ $rc -eq 1 ]] && grep -q 'exceeds' $tmp/e"
for d in 0 6; do
  "$kvq" serve -m "$model" --port 0 -t 1 -c 256 --draft-max $d 2>"$tmp/slog$d" &
  pid=$!
  port=$(wait_port "$tmp/slog$d")
  url=http://127.0.0.1:$port
  curl -s $url/v1/completions -d '{"prompt": "Lily and Ben. Lily and Ben. Lily and", "max_tokens": 60, "temperature": 0}' >"$tmp/spec$d.json"
  curl -s $url/metrics >"$tmp/specm$d.txt"
  kill -TERM $pid
  wait $pid
  pid=
done
check "--draft-max: the greedy text is the same as without" \
  "python3 -c \"import json; a, b = (json.load(open('$tmp/spec%d.json' % d))['choices'][0]['text'] for d in (0, 6)); assert a == b and len(a) > 20, (a, b)\""
check "--draft-max: /metrics counts drafted and kept tokens" \
  "awk '/^kvq_spec_draft_tokens_total/ {d=\$2} /^kvq_spec_accepted_tokens_total/ {k=\$2} END {exit !(d > 0 && k > 0 && k <= d)}' $tmp/specm6.txt"

# gpt-oss's chat format (harmony) given by --chat-template-file: the prompt in it, and a function
# call in its own syntax, read back as tool_calls
echo '{{ messages }}' >"$tmp/plain.jinja"
"$kvq" serve -m "$model" --chat-template-file "$tmp/plain.jinja" >"$tmp/o" 2>"$tmp/e"; rc=$?
check "--chat-template-file of no family kvq renders exits 1" "[[ $rc -eq 1 ]] && grep -q 'not a chat template kvq renders' $tmp/e"
printf '{{- "<|start|>system<|message|>" }}{{- "<|channel|>" }}\n' >"$tmp/harmony.jinja"
"$kvq" serve -m "$model" --port 0 -t 1 -c 2048 --chat-template-file "$tmp/harmony.jinja" 2>"$tmp/hlog" &
pid=$!
port=$(wait_port "$tmp/hlog")
url=http://127.0.0.1:$port
tools='"tools": [{"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]'
curl -s $url/tokenize -d "{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}], $tools}" >"$tmp/ht.json"
curl -s $url/detokenize -d "{\"tokens\": $(python3 -c "import json; print(json.load(open('$tmp/ht.json'))['tokens'])")}" >"$tmp/hd.json"
check "--chat-template-file harmony: the prompt is harmony's, its functions declared" \
  "grep -q '<|start|>system<|message|>You are ChatGPT' $tmp/hd.json && grep -q 'type add = (_: {' $tmp/hd.json"
curl -s $url/v1/chat/completions -d "{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}], $tools, \"tool_choice\": \"required\", \"max_tokens\": 40, \"temperature\": 0}" >"$tmp/hc.json"
check "... a required call comes back as tool_calls with integer arguments" \
  "python3 -c \"import json; c=json.load(open('$tmp/hc.json'))['choices'][0]; assert c['finish_reason']=='tool_calls', c; f=c['message']['tool_calls'][0]['function']; assert f['name']=='add' and isinstance(json.loads(f['arguments'])['a'], int), c\""
kill -TERM $pid
wait $pid
pid=

finish serve
