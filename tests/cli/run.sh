#!/usr/bin/env bash
# kvq run as a user runs it: output on stdout only, speed/memory on stderr, and bad input
# rejected with a one-line error and a non-zero exit (never a crash).
set -u
source "$(dirname "$0")/common.bash"
require "$model"

# greedy from BOS: stdout is exactly the generated text (known output is a prefix)
"$kvq" run -m "$model" -n 120 --temp 0 -t 1 >"$tmp/out" 2>"$tmp/err"
rc=$?
check "greedy run exits 0" "[[ $rc -eq 0 ]]"
expected=$(head -c 100 "$src/../shared/models/stories260K.greedy.txt")
check "stdout starts with the known greedy text" "[[ \"\$(head -c 100 $tmp/out)\" == \"\$expected\" ]]"
check "stderr reports decode tokens/s" "grep -q 'decode: .* tokens/s' $tmp/err"
check "stderr reports memory" "grep -q 'memory: weights' $tmp/err"
check "stderr names the SIMD level the kernels run" "grep -Eq '\| cpu (scalar|avx2|avx512) \|' $tmp/err"
check "stdout has no log lines" "! grep -q '\[kvq\]' $tmp/out"

# speculative decoding by prompt lookup: the same greedy text, fewer forward passes (the story
# repeats itself, so drafts are kept), with f16 and int8 caches (the grouped formats' rollback is
# checked in KvPaging.HeldStepKeepingFewerEqualsAppendingOnlyThose: this model's head_dim 8 is
# below theirs)
for kvf in f16 int8; do
  "$kvq" run -m "$model" -n 120 --temp 0 -t 1 --draft-max 8 --kv-cache-dtype $kvf >"$tmp/spec_$kvf" 2>"$tmp/specerr"
  check "--draft-max 8 ($kvf): exits 0" "[[ $? -eq 0 ]]"
  check "--draft-max 8 ($kvf): the known greedy text" "[[ \"\$(head -c 100 $tmp/spec_$kvf)\" == \"\$expected\" ]]"
  check "--draft-max 8 ($kvf): drafts were kept" "grep -Eq 'speculative: [0-9]+ verification steps, [1-9][0-9]* of [0-9]+ drafted tokens kept' $tmp/specerr"
  "$kvq" run -m "$model" -n 120 --temp 0 -t 1 --kv-cache-dtype $kvf >"$tmp/nospec" 2>"$tmp/nospecerr"
  check "--draft-max ($kvf): the whole text equals decoding's" "cmp -s $tmp/nospec $tmp/spec_$kvf"
done
# a text that ends at -n on a kept draft (-n 83 and 109 here) leaves the cache as decoding does
for n in 83 109; do
  "$kvq" run -m "$model" -n $n --temp 0 -t 1 --draft-max 8 >/dev/null 2>"$tmp/specerr"
  "$kvq" run -m "$model" -n $n --temp 0 -t 1 >/dev/null 2>"$tmp/nospecerr"
  check "--draft-max, -n $n: as many tokens in the cache as decoding leaves" \
    "[[ \"\$(grep -o 'KV .* tokens)' $tmp/specerr)\" == \"\$(grep -o 'KV .* tokens)' $tmp/nospecerr)\" ]]"
done
"$kvq" run -m "$model" -p "Lily" -n 60 --temp 0.9 --seed 7 --draft-max 6 >"$tmp/ss1" 2>/dev/null
"$kvq" run -m "$model" -p "Lily" -n 60 --temp 0.9 --seed 7 --draft-max 6 >"$tmp/ss2" 2>/dev/null
check "--draft-max with sampling: same seed, same text" "[[ -s $tmp/ss1 ]] && cmp -s $tmp/ss1 $tmp/ss2"

# --echo prints the prompt first
"$kvq" run -m "$model" -p "Once upon a time" -n 5 --temp 0 --echo >"$tmp/echo" 2>/dev/null
check "--echo prints the prompt" "grep -q '^Once upon a time' $tmp/echo"

# seeded sampling is reproducible
"$kvq" run -m "$model" -p "Lily" -n 30 --temp 0.9 --seed 7 >"$tmp/s1" 2>/dev/null
"$kvq" run -m "$model" -p "Lily" -n 30 --temp 0.9 --seed 7 >"$tmp/s2" 2>/dev/null
check "same seed, same text" "cmp -s $tmp/s1 $tmp/s2"

# --json: the story model writes the start of a JSON object (a whole one when it closes it)
"$kvq" run -m "$model" -p "Once upon a time" -n 40 --temp 0.9 --seed 3 --json >"$tmp/json" 2>"$tmp/jerr"
check "--json: the output starts a JSON object" "[[ \$(tr -d ' \n\t' <$tmp/json | head -c 2) == '{\"' ]]"
check "--json: plain run of the same prompt does not" "[[ \$(tr -d ' \n\t' <$tmp/s1 | head -c 1) != '{' ]]"
check "--json: it ends closed or at the limit" "grep -Eq 'stop: (end of the JSON object|length)' $tmp/jerr"

# --json-schema: a document of the schema, complete (a short array of booleans and nulls)
printf '%s' '{"type": "array", "items": {"type": ["boolean", "null"]}, "minItems": 1, "maxItems": 3}' >"$tmp/schema.json"
"$kvq" run -m "$model" -p "Once upon a time" -n 60 --temp 0.9 --seed 3 --json-schema "$tmp/schema.json" >"$tmp/js" 2>"$tmp/jserr"
check "--json-schema: the output is a document of the schema" \
  "python3 -c 'import json,sys; v=json.load(open(sys.argv[1])); assert isinstance(v, list) and 1 <= len(v) <= 3 and all(x in (True, False, None) for x in v)' $tmp/js"
check "--json-schema: it ends with the document" "grep -q 'stop: end of the document' $tmp/jserr"

# bad input: clear error, non-zero exit, no crash (exit code 1 or CLI11's usage code, not a signal)
bad() {
  local name=$1; shift
  "$kvq" "$@" >"$tmp/bo" 2>"$tmp/be"
  local rc=$?
  check "$name: non-zero exit" "[[ $rc -ne 0 && $rc -lt 128 ]]"
  check "$name: message on stderr" "[[ -s $tmp/be ]]"
}
bad "missing model file" run -m "$tmp/nope.gguf" -p hi
printf 'GGUF\x03\x00\x00\x00garbage' >"$tmp/bad.gguf"
bad "malformed model file" run -m "$tmp/bad.gguf" -p hi
printf '%s' '{"type": "object", "dependentRequired": {"a": ["b"]}}' >"$tmp/bad_schema.json"
bad "--json-schema with an unsupported keyword" run -m "$model" -p hi --json-schema "$tmp/bad_schema.json"
check "... names it" "grep -q \"'dependentRequired' is not supported\" $tmp/be"
bad "--json-schema and --json" run -m "$model" -p hi --json --json-schema "$tmp/schema.json"
bad "--regex and --json" run -m "$model" -p hi --json --regex 'a+'
bad "--regex with a backreference" run -m "$model" -p hi --regex '(a)\1'
check "... names it" "grep -q 'backreferences are not supported' $tmp/be"
bad "--grammar with an undefined rule" run -m "$model" -p hi --grammar 'root ::= x'
check "... names it" "grep -q \"line 1, column 10: rule 'x' is used but not defined\" $tmp/be"
bad "--grammar and --regex" run -m "$model" -p hi --grammar 'root ::= "a"' --regex a
bad "--grammar-file missing" run -m "$model" -p hi --grammar-file "$tmp/nope.gbnf"
"$kvq" run -m "$model" -p hi -n 8 --regex '' >"$tmp/out" 2>"$tmp/err"
check "--regex '' (only the empty text) generates nothing" "[[ \$(cat $tmp/out) == '' ]] && grep -q 'stop: end of the text' $tmp/err"
bad "threads < 1" run -m "$model" -p hi -t -1
bad "unknown flag" run -m "$model" --no-such-flag
bad "unknown KV format" run -m "$model" -p hi --kv-cache-dtype int7
# drafting under a grammar that forbids what the story model wants (capitals): every verified
# row masked by the grammar's state after the drafts kept before it, the text decoding's
for d in 0 8; do
  "$kvq" run -m "$model" -p "Once upon a time" -n 150 --temp 0 -t 1 --regex '( [a-z]+[.,]?){1,200}' --draft-max $d \
    >"$tmp/rx$d" 2>"$tmp/rxe$d"
done
check "--draft-max with --regex: decoding's text" "[[ -s $tmp/rx0 ]] && cmp -s $tmp/rx0 $tmp/rx8"
check "--draft-max with --regex: drafts were kept" "grep -Eq '[1-9][0-9]* of [0-9]+ drafted tokens kept' $tmp/rxe8"

# -n 0 generates nothing with drafting too
"$kvq" run -m "$model" -p "Once upon a time" -n 0 --temp 0 -t 1 --draft-max 4 >"$tmp/n0" 2>"$tmp/n0e"
check "--draft-max with -n 0: nothing generated" "grep -q 'decode: 0 tokens' $tmp/n0e && grep -q 'stop: length' $tmp/n0e"

bad "--draft-max out of range" run -m "$model" -p hi --draft-max 65
bad "--draft-ngram-min above --draft-ngram-max" run -m "$model" -p hi --draft-max 4 --draft-ngram-min 5 --draft-ngram-max 3
bad "unknown RoPE scaling" run -m "$model" -p hi --rope-scaling ntk
bad "YaRN without a factor" run -m "$model" -p hi --rope-scaling yarn
bad "--yarn-orig-ctx without YaRN" run -m "$model" -p hi --yarn-orig-ctx 512
head -c 20000 /dev/urandom | base64 >"$tmp/long.txt"
bad "prompt longer than the context" run -m "$model" -f "$tmp/long.txt" -c 256
bad "--chat without a template" run -m "$model" -p hi --chat
bad "K/V split with an unknown half" run -m "$model" -p hi --kv-cache-dtype q4_0/int7
bad "K/V split with an empty half" run -m "$model" -p hi --kv-cache-dtype q4_0/
bad "negative --kv-group-tokens" run -m "$model" -p hi --kv-cache-dtype kivi4 --kv-group-tokens -4
bad "group that does not divide the page" run -m "$model" -p hi --kv-cache-dtype kivi4 --kv-group-tokens 96
bad "--kv-outliers above 1/8" run -m "$model" -p hi --kv-cache-dtype kvquant4 --kv-outliers 0.5
bad "negative --kv-sink-tokens" run -m "$model" -p hi --kv-cache-dtype kvquant4 --kv-sink-tokens -3
bad "--kv-scales qk-norm on a model without QK-norm" run -m "$model" -p hi --kv-cache-dtype int8_c --kv-scales qk-norm
check "... says the model has no QK-norm and how to calibrate" "grep -q 'no QK-norm weights.*kvq calibrate' $tmp/be"
# the KV flags' own errors: the CLI's one-line message (exit 1), naming the flag
kv_err() {  # name, expected message, args...
  local name=$1 msg=$2
  shift 2
  "$kvq" run -m "$model" -p hi -n 2 "$@" >"$tmp/ko" 2>"$tmp/ke"
  local rc=$?
  check "$name" "[[ $rc -eq 1 ]] && grep -q -- \"kvq: error: .*$msg\" $tmp/ke"
}
mkdir "$tmp/adir"
kv_err "--kv-scales naming a directory" "--kv-scales '$tmp/adir' is a directory" --kv int8_static --kv-scales "$tmp/adir"
kv_err "empty -ctk" "--cache-type-k (-ctk): the format name is empty" -ctk ''
kv_err "empty --cache-type-v" "--cache-type-v (-ctv): the format name is empty" --kv int8 --cache-type-v ''
kv_err "empty --kv-cache-dtype" "--kv-cache-dtype: the format name is empty" --kv-cache-dtype ''
kv_err "a layer given twice to --kv-layer" "layer 0 is given twice ('0=int8' and '0=f16')" --kv-layer 0=int8 --kv-layer 0=f16
kv_err "a format that does not fit its --kv-layer" "--kv-layer '3=int4_g128' (layer 3): " --kv-layer 3=int4_g128
kv_err "-ctk with a K/V split" "--cache-type-k (-ctk): 'int8/f16' is a K/V split" -ctk int8/f16

# -ctk / -ctv replace one side of a K/V split
"$kvq" run -m "$model" -p "Lily" -n 8 --temp 0 --kv-cache-dtype int8/bf16 >"$tmp/split_ref" 2>/dev/null
"$kvq" run -m "$model" -p "Lily" -n 8 --temp 0 --kv-cache-dtype int8/f16 -ctv bf16 >"$tmp/split_ctv" 2>"$tmp/split_ctv.err"
check "-ctv replaces the V side of a K/V split" "[[ $? -eq 0 && -s $tmp/split_ctv ]] && cmp -s $tmp/split_ref $tmp/split_ctv"
"$kvq" run -m "$model" -p "Lily" -n 8 --temp 0 --kv-cache-dtype f16/bf16 -ctk int8 >"$tmp/split_ctk" 2>/dev/null
check "-ctk replaces the K side of a K/V split" "[[ $? -eq 0 ]] && cmp -s $tmp/split_ref $tmp/split_ctk"

mkdir -p "$tmp/adir"
bad "a directory as the prompt file" run -m "$model" -f "$tmp/adir" -n 2
check "... says it is a directory" "grep -q 'directory' $tmp/be"
bad "--system without --chat" run -m "$model" -p hi --system "be brief"
bad "--reasoning-effort on a model without harmony's" run -m "$model" -p hi --reasoning-effort low
check "... says whose setting it is" "grep -q 'harmony' $tmp/be"
bad "--reasoning-effort not low, medium or high" run -m "$model" -p hi --reasoning-effort extreme
bad "--reasoning-format not split or raw" run -m "$model" -p hi --reasoning-format bogus
"$kvq" run -m "$model" -p Lily -n 4 --reasoning-format raw >/dev/null 2>"$tmp/rf_err"
check "--reasoning-format on a model without harmony: runs, and warns that it is ignored" "[[ $? -eq 0 ]] && grep -q 'reasoning-format applies to harmony' $tmp/rf_err"
bad "--interactive without --chat" run -m "$model" -i -n 4 </dev/null
bad "--chat-template-file without --chat" run -m "$model" -p hi --chat-template-file "$tmp/none.jinja"
echo '{{ messages[0].content }}' >"$tmp/plain.jinja"
bad "--chat-template-file of no family kvq renders" run -m "$model" --chat -p hi --chat-template-file "$tmp/plain.jinja"
check "... says which families it renders" "grep -q 'not a chat template kvq renders (supported: ChatML' $tmp/be"
bad "a missing --chat-template-file" run -m "$model" --chat -p hi --chat-template-file "$tmp/none.jinja"
# A harmony conversation (gpt-oss's template given to stories260K): each turn goes on from the last
# reply's start with its answer alone (the template drops a reply's reasoning), so turn 2's cache is
# turn 1's prompt + turn 2's new tokens (the answer re-read, then the user's turn) + its reply, not
# turn 1's whole cache + more (reply 1 is 12 tokens long, as -n allows)
printf '{{- "<|start|>system<|message|>" }}{{- "<|channel|>" }}\n' >"$tmp/harmony.jinja"
printf 'Lily\n\nTom went\n' | "$kvq" run -m "$model" --chat --chat-template-file "$tmp/harmony.jinja" -i -n 12 --temp 0 -t 1 \
  >"$tmp/hconv" 2>"$tmp/hconv.err"
rc=$?
check "harmony conversation: turn 2 goes on from reply 1's start" \
  "[[ $rc -eq 0 ]] && python3 -c \"import re; t=re.findall(r'turn (\\d+): (\\d+) new prompt tokens, (\\d+) in the cache', open('$tmp/hconv.err').read()); assert [x[0] for x in t]==['1','2'], t; p1,c1,n2,c2=int(t[0][1]),int(t[0][2]),int(t[1][1]),int(t[1][2]); assert c1-p1==12 and 0<c2-n2-p1<=12, t\""
# A reasoning template whose prompt opens the block (QwQ's, given to stories260K): the reply is all
# reasoning, on stderr, stdout empty; raw, the reply on stdout; enable_thinking false closes the
# block and the reply is the answer, on stdout. A conversation goes on from before the prompt's
# '<think>\n' with the answer alone (empty here), so turn 2's cache holds fewer than turn 1's
# prompt + 12 reply tokens + turn 2's new tokens.
printf "{{- '<|im_start|>' + message.role + '\\\\n' + message.content + '<|im_end|>\\\\n' }}{%%- if add_generation_prompt %%}{{- '<|im_start|>assistant\\\\n<think>\\\\n' }}{%%- endif %%}\n" >"$tmp/qwq.jinja"
"$kvq" run -m "$model" --chat --chat-template-file "$tmp/qwq.jinja" -p Lily -n 12 --temp 0 -t 1 >"$tmp/think_out" 2>"$tmp/think_err"
check "reasoning template: the reply is reasoning, on stderr" "[[ $? -eq 0 && -z \$(tr -d '\\n' <$tmp/think_out) ]] && grep -q '^\\[reasoning\\] ' $tmp/think_err"
"$kvq" run -m "$model" --chat --chat-template-file "$tmp/qwq.jinja" -p Lily -n 12 --temp 0 -t 1 --reasoning-format raw >"$tmp/think_raw" 2>/dev/null
check "... --reasoning-format raw: the reply on stdout, the reasoning as split" \
  "[[ $? -eq 0 && -s $tmp/think_raw ]] && grep -qF \"\$(head -c 12 $tmp/think_raw | tr -d '\\n')\" $tmp/think_err"
"$kvq" run -m "$model" --chat --chat-template-file "$tmp/qwq.jinja" -p Lily -n 12 --temp 0 -t 1 \
  --chat-template-kwargs '{"enable_thinking": false}' >"$tmp/think_off" 2>"$tmp/think_off_err"
check "... enable_thinking false: the answer on stdout, no reasoning" "[[ $? -eq 0 && -s $tmp/think_off ]] && ! grep -q 'reasoning\\]' $tmp/think_off_err"
# --reasoning-budget 3: the reasoning ends after 3 tokens (the raw reply holds the close, with the
# message before it) and the model answers, on stdout (without a budget stdout is empty, above)
"$kvq" run -m "$model" --chat --chat-template-file "$tmp/qwq.jinja" -p Lily -n 24 --temp 0 -t 1 --reasoning-budget 3 \
  --reasoning-budget-message "Time to answer." --reasoning-format raw >"$tmp/budget_raw" 2>/dev/null
check "--reasoning-budget: the close written after the message" "[[ $? -eq 0 ]] && grep -q '^Time to answer.$' $tmp/budget_raw && grep -q '^</think>$' $tmp/budget_raw"
"$kvq" run -m "$model" --chat --chat-template-file "$tmp/qwq.jinja" -p Lily -n 24 --temp 0 -t 1 --reasoning-budget 3 \
  >"$tmp/budget_out" 2>"$tmp/budget_err"
check "... split: the answer on stdout, the reasoning (3 tokens) on stderr" \
  "[[ $? -eq 0 && -n \$(tr -d '\n' <$tmp/budget_out) ]] && grep -q '^\\[reasoning\\] ' $tmp/budget_err"
bad "--reasoning-budget without --chat" run -m "$model" -p hi --reasoning-budget 3
bad "--reasoning-budget below -1" run -m "$model" --chat -p hi --reasoning-budget -2
bad "--chat-template-kwargs of a key kvq does not read" run -m "$model" --chat --chat-template-file "$tmp/qwq.jinja" -p hi --chat-template-kwargs '{"foo": 1}'
check "... names it" "grep -q \"kwarg 'foo' is not supported\" $tmp/be"
bad "--chat-template-kwargs without --chat" run -m "$model" -p hi --chat-template-kwargs '{"enable_thinking": false}'
printf 'Lily\n\nTom went\n' | "$kvq" run -m "$model" --chat --chat-template-file "$tmp/qwq.jinja" -i -n 12 --temp 0 -t 1 \
  >/dev/null 2>"$tmp/tconv.err"
rc=$?
check "reasoning-template conversation: turn 2 goes on from before reply 1's opening" \
  "[[ $rc -eq 0 ]] && python3 -c \"import re; t=re.findall(r'turn (\\d+): (\\d+) new prompt tokens, (\\d+) in the cache', open('$tmp/tconv.err').read()); assert [x[0] for x in t]==['1','2'], t; p1,c1,n2,c2=int(t[0][1]),int(t[0][2]),int(t[1][1]),int(t[1][2]); assert c1-p1==12 and 0<c2-n2-p1<12, t\""
bad "--top-p above 1" run -m "$model" -p hi --top-p 2
bad "--seed beyond 64 bits" run -m "$model" -p hi --seed 99999999999999999999999
bad "unknown subcommand" bogus -m "$model"
check "... names it and the subcommands" "grep -q \"unknown subcommand 'bogus'.*run\" $tmp/be"
# a report that cannot be written (a full disk) is an error, not a silent success
if [[ -w /dev/full ]]; then
  bad "calibration written to a full disk" calibrate -m "$model" --data "$text" --ctx 64 --chunks 1 -o /dev/full
  check "... says the write failed" "grep -q 'writing .*/dev/full.* failed' $tmp/be"
fi

bad "calibration windows too short for a KVQuant group" calibrate -m "$model" --data "$text" --ctx 32 --chunks 1 -o "$tmp/c.json"
check "... says so before running the model" "grep -q 'need at least 33 tokens' $tmp/be"

# --echo prints the prompt file's bytes as they are, NUL bytes included
printf 'a\0b\0c' >"$tmp/nul.txt"
"$kvq" run -m "$model" -f "$tmp/nul.txt" -n 1 --temp 0 --echo >"$tmp/nulout" 2>/dev/null
check "--echo keeps NUL bytes" "[[ \"\$(head -c 5 $tmp/nulout | od -An -c | tr -d ' ')\" == 'a\\0b\\0c' ]]"
# more threads than the machine has: runs, with a warning
"$kvq" run -m "$model" -p hi -n 2 -t $(( $(nproc) + 1 )) >/dev/null 2>"$tmp/terr"
rc=$?
check "more threads than hardware threads runs" "[[ $rc -eq 0 ]]"
check "... with a warning" "grep -q 'warning: .* threads on a machine with' $tmp/terr"
# a context beyond the trained one: runs, with a warning
"$kvq" run -m "$model" -p hi -n 2 -c 100000 >/dev/null 2>"$tmp/cerr"
check "--ctx-size beyond the trained context warns" "grep -q 'beyond the .* tokens the model was trained on' $tmp/cerr"

# --batch-invariant runs (stories260K's float weights give the same greedy text either way)
"$kvq" run -m "$model" -p "Lily" -n 12 --temp 0 -t 1 --batch-invariant >"$tmp/bi" 2>/dev/null
"$kvq" run -m "$model" -p "Lily" -n 12 --temp 0 -t 1 >"$tmp/nbi" 2>/dev/null
check "--batch-invariant runs, same greedy text" "[[ -s $tmp/bi ]] && cmp -s $tmp/bi $tmp/nbi"

# a K/V split name runs (stories260K's head_dim 8 is too small for the 32-wide formats)
"$kvq" run -m "$model" -p "Lily" -n 8 --temp 0 --kv-cache-dtype int8/f16 >"$tmp/split" 2>"$tmp/split.err"
rc=$?
check "K/V split format runs" "[[ $rc -eq 0 && -s $tmp/split ]]"

# --chat -i: a conversation from stdin, each turn continuing the cache (SmolLM2, when installed):
# the first reply equals the one-shot run's, and the second turn computes only its own tokens.
smol=${KVQ_MODELS_DIR:-$src/models}/SmolLM2-135M-Instruct.Q4_1.gguf
[[ -f $smol ]] || smol=$src/models/SmolLM2-135M-Instruct.Q4_1.gguf
if [[ -f $smol ]]; then
  # drafting under a JSON Schema: each row masked by the grammar's state after the kept drafts;
  # the same document, stop and cache as decoding
  printf '%s' '{"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"},"city":{"type":"string"}},"required":["name","age","city"]}' >"$tmp/person.json"
  for d in 0 4; do
    "$kvq" run -m "$smol" --chat -p "Give a JSON object for John Smith, 42, from Boston. John Smith is 42 years old and lives in Boston." \
      -n 80 --temp 0 -t 1 --json-schema "$tmp/person.json" --draft-max $d >"$tmp/js$d" 2>"$tmp/jse$d"
  done
  check "--draft-max with --json-schema: the same document, stop and cache" \
    "[[ -s $tmp/js0 ]] && cmp -s $tmp/js0 $tmp/js4 && grep -q 'stop: end of the document' $tmp/jse4 && [[ \"\$(grep -o 'KV .* tokens)' $tmp/jse0)\" == \"\$(grep -o 'KV .* tokens)' $tmp/jse4)\" ]]"
  check "--draft-max with --json-schema: drafts were kept" "grep -Eq '[1-9][0-9]* of [0-9]+ drafted tokens kept' $tmp/jse4"
  # a conversation with drafting: replies that stop at -n leave the cache as decoding does
  printf 'Name a color.\nContinue what you were saying.\nWhat did you just say?\nSay it again.\n' >"$tmp/turns"
  "$kvq" run -m "$smol" --chat -i -n 3 --temp 0 -t 1 <"$tmp/turns" >"$tmp/i0" 2>"$tmp/ie0"
  "$kvq" run -m "$smol" --chat -i -n 3 --temp 0 -t 1 --draft-max 8 <"$tmp/turns" >"$tmp/i8" 2>"$tmp/ie8"
  check "--draft-max in a conversation: the same replies and cache" \
    "[[ -s $tmp/i0 ]] && cmp -s $tmp/i0 $tmp/i8 && diff <(grep -o 'turn.*in the cache' $tmp/ie0) <(grep -o 'turn.*in the cache' $tmp/ie8) >/dev/null"
  "$kvq" run -m "$smol" --chat -p "What is a cat?" -n 12 --temp 0 -t 1 >"$tmp/one" 2>/dev/null
  printf 'What is a cat?\n\nAnd a dog?\n' | "$kvq" run -m "$smol" --chat -i -n 12 --temp 0 -t 1 >"$tmp/conv" 2>"$tmp/conv.err"
  rc=$?
  check "interactive: exits 0 at the end of stdin, one reply per non-empty line" "[[ $rc -eq 0 && \$(wc -l <$tmp/conv) -eq 2 ]]"
  check "interactive: the first reply is the one-shot reply" "[[ \"\$(head -n 1 $tmp/conv)\" == \"\$(cat $tmp/one)\" ]]"
  check "interactive: turn 2 adds only its own tokens to the cache" \
    "python3 -c \"import re; t=re.findall(r'turn (\\d+): (\\d+) new prompt tokens, (\\d+) in the cache', open('$tmp/conv.err').read()); assert [x[0] for x in t]==['1','2']; n1,c1,n2,c2=int(t[0][1]),int(t[0][2]),int(t[1][1]),int(t[1][2]); assert 0<c1-n1<=12 and 0<n2<c1 and 0<=c2-c1-n2<=12, t\""
  # a line longer than the context left is not sent; the conversation goes on with the next one
  { python3 -c "print('cat ' * 400)"; printf 'What is a cat?\n'; } |
    "$kvq" run -m "$smol" --chat -i -c 256 -n 12 --temp 0 -t 1 >"$tmp/conv2" 2>"$tmp/conv2.err"
  rc=$?
  check "interactive: a turn too long for the context is refused, the next one answered" \
    "[[ $rc -eq 0 ]] && grep -q 'not sent' $tmp/conv2.err && [[ \"\$(head -n 1 $tmp/conv2)\" == \"\$(cat $tmp/one)\" ]]"
fi

# flags that no layer's format reads are said, not dropped silently
"$kvq" run -m "$model" --kv-cache-dtype f16 --kv-group-tokens 16 --kv-sink-tokens 4 -n 1 -t 1 >/dev/null 2>"$tmp/unused"
check "grouped-format flags on f16: run goes on and warns, naming them" \
  "[[ $? -eq 0 ]] && grep -q 'warning: --kv-group-tokens --kv-sink-tokens: no layer of .f16. reads it' $tmp/unused"
"$kvq" run -m "$model" --kv-cache-dtype f16 -n 1 -t 1 >/dev/null 2>"$tmp/quiet"
check "... and no warning without them" "! grep -q warning $tmp/quiet"
# a serving context beyond the trained one is capped, and said once
"$kvq" bench -m "$model" --kv f16 --kv-mem 4MiB --data "$text" -c 100000 --requests 2 --concurrency 1 --max-tokens 2 \
  --prefixes 1 --prefix-tokens 32 -t 1 >/dev/null 2>"$tmp/ctxw"
check "bench -c beyond the trained context: warned once, capped" \
  "[[ \$(grep -c 'beyond the 2048 tokens the model was trained on; using 2048' $tmp/ctxw) -eq 1 ]]"

# YaRN from the command line (llama.cpp's flags): named on the model line, and the model's context
# becomes the original x the factor (4 x 1024), so -c 4096 is no longer past it
"$kvq" run -m "$model" -p "Lily" -n 5 -t 1 -c 4096 --rope-scaling yarn --rope-scale 4 --yarn-orig-ctx 1024 \
  >/dev/null 2>"$tmp/yarn"
check "YaRN run exits 0" "[[ $? -eq 0 ]]"
check "YaRN: the model line names it" "grep -q 'YaRN RoPE scaling x4 of 1024 positions (beta 32 / 1)' $tmp/yarn"
check "YaRN: -c 4096 is within original x factor" "! grep -q 'beyond the' $tmp/yarn"
"$kvq" run -m "$model" -p "Lily" -n 5 -t 1 -c 4096 >/dev/null 2>"$tmp/noyarn"
check "without it, -c 4096 is past the trained 2048" "grep -q 'beyond the 2048 tokens' $tmp/noyarn"

finish run
