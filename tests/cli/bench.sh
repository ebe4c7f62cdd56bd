#!/usr/bin/env bash
# kvq bench end to end on stories260K: the shared-prefix workload under one KV budget (a format
# with smaller tokens keeps every prefix resident where f16 cannot), a JSONL workload, and bad input.
set -u
source "$(dirname "$0")/common.bash"
require "$model" "$text"

# 4 prefixes of 64 tokens (one page each) in turn, 16 requests. 160 KiB holds 4 f16 pages (640
# bytes a token) and 5 int8 pages (480): f16 keeps 3 prefixes besides the running request's new
# page and, cycling, never hits; int8 keeps all 4 and hits on every repeat (12 of 16 requests).
"$kvq" bench -m "$model" --kv f16,int8 --kv-mem 163840 --data "$text" --prefixes 4 --prefix-tokens 64 \
  --question-tokens 8 --concurrency 1,2 --max-tokens 8 -t 1 --json --json-out "$tmp/copy.json" >"$tmp/b.json" 2>"$tmp/e"
check "bench exits 0" "[[ $? -eq 0 ]]"
check "one run per format and concurrency, every request served with exactly max_tokens tokens" \
  "python3 -c \"import json; d=json.load(open('$tmp/b.json')); R=d['runs']; assert [(r['format'],r['concurrency']) for r in R]==[('f16',1),('f16',2),('int8',1),('int8',2)]; assert all(r['tail_bytes_per_sequence_max']==0 for r in R); assert all(r['fits'] and r['ok']==16 and r['errors']==0 and r['completion_tokens']==16*8 for r in R); assert d['workload']['requests']==16 and d['kv_mem_bytes']==[163840] and all(r['kv_mem_bytes']==163840 for r in R); assert d['cpu'] in ('scalar','avx2','avx512')\""
check "timings are consistent (p50 <= p95, TTFT > 0, throughput = tokens / wall)" \
  "python3 -c \"import json; d=json.load(open('$tmp/b.json')); assert all(0<r['ttft_p50_s']<=r['ttft_p95_s']<=r['ttft_p99_s'] and 0<r['tpot_p50_s']<=r['tpot_p95_s']<=r['tpot_p99_s'] and r['ttft_p50_s']<r['e2e_p50_s']<=r['e2e_p95_s']<=r['e2e_p99_s'] and 0<r['ttft_mean_s']<r['e2e_mean_s'] and 0<r['tpot_mean_s'] and abs(r['throughput_tok_s']*r['wall_s']-r['completion_tokens'])<1e-6*r['completion_tokens'] for r in d['runs'])\""
check "under the same budget int8 holds more tokens and every prefix: hit rate 12 x 64 / (16 x 73), f16 none" \
  "python3 -c \"import json; d=json.load(open('$tmp/b.json')); R={(r['format'],r['concurrency']): r for r in d['runs']}; f,i=R[('f16',1)],R[('int8',1)]; assert f['kv_tokens']==256 and i['kv_tokens']==320, (f['kv_tokens'], i['kv_tokens']); assert f['prefix_hit_rate']==0; assert abs(i['prefix_hit_rate']-12*64/(16*73))<1e-9, i['prefix_hit_rate']\""
check "formats with per-token codecs share prefixes" "python3 -c \"import json; assert all(r['prefix_cache'] for r in json.load(open('$tmp/b.json'))['runs'])\""
"$kvq" bench -m "$model" --kv f16,int8 --kv-mem 163840 --data "$text" --prefixes 4 --prefix-tokens 64 \
  --question-tokens 8 --concurrency 1 --max-tokens 8 -t 1 >"$tmp/b.txt" 2>/dev/null
check "table: each format against the first at the same load" \
  "grep -q 'against f16 at the same budget and load' $tmp/b.txt && grep -E -q 'int8 .*1 client  TTFT p50 [0-9.]+x (lower|higher), throughput [0-9.]+x, prefix hit rate 0.66 \(0.00\)' $tmp/b.txt"
"$kvq" bench -m "$model" --kv f16,int8 --kv-mem 163840 --data "$text" --prefixes 4 --prefix-tokens 64 \
  --question-tokens 8 --concurrency 1,2 --rate 50 --max-tokens 8 -t 1 --html "$tmp/b.html" >/dev/null 2>&1
check "--html: self-contained report, charts per load kind, every run in the table" \
  "[[ \$(grep -o '<svg' $tmp/b.html | wc -l) -eq 10 ]] && [[ \$(grep -o '<tr><td>' $tmp/b.html | wc -l) -eq 6 ]] && ! grep -q 'http://\|https://' <(sed 's|http://www.w3.org/2000/svg||g' $tmp/b.html)"
check "--json-out writes the same report" "cmp -s $tmp/b.json <(python3 -c \"import json; print(json.dumps(json.load(open('$tmp/copy.json')), indent=2))\") || python3 -c \"import json; assert json.load(open('$tmp/b.json'))==json.load(open('$tmp/copy.json'))\""

# --kv-offload-size: f16's evicted prefix pages go to the tier and come back: it hits on every
# repeat as int8 does (12 of 16 requests), the pages read back from the file
mkdir -p "$tmp/off"
"$kvq" bench -m "$model" --kv f16 --kv-mem 163840 --data "$text" --prefixes 4 --prefix-tokens 64 \
  --question-tokens 8 --concurrency 1 --max-tokens 8 -t 1 --kv-offload-dir "$tmp/off" --kv-offload-size 1MiB \
  --json >"$tmp/off.json" 2>/dev/null
check "--kv-offload-size: f16 in 160 KiB hits on every repeat, read back from the tier" \
  "[[ $? -eq 0 ]] && python3 -c \"import json; d=json.load(open('$tmp/off.json')); r=d['runs'][0]; assert d['kv_offload_bytes']==[1048576] and r['kv_offload_bytes']==1048576; assert r['ok']==16 and r['completion_tokens']==128, r; assert abs(r['prefix_hit_rate']-12*64/(16*73))<1e-9, r['prefix_hit_rate']; assert 0<r['offload_hit_rate']<=r['prefix_hit_rate'] and r['offload_loaded_pages']>=12 and r['offload_stored_pages']>0, r\""
check "--kv-offload-dir: the tier's file does not outlive the run" "[[ -z \$(ls -A $tmp/off) ]]"
"$kvq" bench -m "$model" --kv f16 --kv-mem 163840 --data "$text" --prefixes 4 --prefix-tokens 64 \
  --question-tokens 8 --concurrency 1 --max-tokens 8 -t 1 --kv-offload-dir "$tmp/off" --kv-offload-size 1MiB \
  >"$tmp/off.txt" 2>/dev/null
check "--kv-offload-size: the table names the tier and what came back from it" \
  "grep -q 'KV offload tier: 1MiB in' $tmp/off.txt && grep -E -q '^  f16 .* 1 client  0\.[0-9]+ of the prompt tokens; [0-9]+ pages read' $tmp/off.txt"
"$kvq" bench -m "$model" --kv f16 --kv-mem 163840 --data "$text" --prefixes 4 --prefix-tokens 64 \
  --question-tokens 8 --concurrency 1 --max-tokens 8 -t 1 --kv-offload-dir "$tmp/off" --kv-offload-size 0,1MiB \
  --html "$tmp/off.html" >"$tmp/offl.txt" 2>/dev/null
check "--kv-offload-size 0,1MiB: a run without and one with the tier, compared" \
  "[[ $? -eq 0 ]] && grep -q '^f16  ' $tmp/offl.txt && grep -q '^f16 +1MiB ' $tmp/offl.txt && grep -q 'against no offload tier at the same format, budget, load and target' $tmp/offl.txt && grep -E -q '^  f16 \+1MiB .* TTFT p50 [0-9.]+x (lower|higher), throughput [0-9.]+x, prefix hit rate 0.66 \(0.00\)' $tmp/offl.txt && grep -q 'f16 +1 MiB tier' $tmp/off.html"

"$kvq" bench -m "$model" --kv f16 --kv-mem 163840 --data "$text" --prefixes 4 --prefix-tokens 64 \
  --question-tokens 8 --concurrency 1 --max-tokens 8 -t 1 --kv-offload-dir "$tmp/off" --kv-offload-size 1MiB \
  --kv-offload-direct --json >"$tmp/offd.json" 2>"$tmp/offd.err"; rc=$?
if [[ $rc -ne 0 ]] && grep -q 'does not take O_DIRECT' "$tmp/offd.err"; then
  echo "skip: $tmp does not take O_DIRECT: --kv-offload-direct check"
else
  check "--kv-offload-direct: the same hits through O_DIRECT" \
    "[[ $rc -eq 0 ]] && python3 -c \"import json; d=json.load(open('$tmp/offd.json')); r=d['runs'][0]; assert d['kv_offload_direct']; assert abs(r['prefix_hit_rate']-12*64/(16*73))<1e-9 and r['offload_loaded_pages']>=12, r\""
fi

# KIVI's residual window keeps prefixes private (exactness); with R = 0 its pages are shared
smol=$src/models/SmolLM2-135M-Instruct.Q4_1.gguf
if [[ -f $smol ]]; then
  "$kvq" bench -m "$smol" --kv kivi4 --kv-mem 64MiB --data "$text" --prefixes 2 --prefix-tokens 64 --question-tokens 8 \
    --requests 4 --max-tokens 2 --concurrency 1 -t 2 >"$tmp/k.txt" 2>/dev/null
  check "kivi4 (R = 128): prefix cache off, said so under the table" \
    "[[ $? -eq 0 ]] && grep -q 'kivi4: no prefix sharing' $tmp/k.txt && grep -q 'kivi4 .* 0.00 ' $tmp/k.txt"
  "$kvq" bench -m "$smol" --kv kivi4 --kv-residual-tokens 0 --kv-mem 64MiB --data "$text" --prefixes 2 --prefix-tokens 64 \
    --question-tokens 8 --requests 4 --max-tokens 2 --concurrency 1 -t 2 --json >"$tmp/k0.json" 2>/dev/null
  check "kivi4 with --kv-residual-tokens 0: prefixes shared (2 of 4 requests hit one page each)" \
    "python3 -c \"import json; r=json.load(open('$tmp/k0.json'))['runs'][0]; assert r['prefix_cache'] and r['prefix_hit_rate']>0.4, r\""
  printf '{"prompt": "Name a fruit.", "max_tokens": 8, "turns": ["And a vegetable?"]}\n' >"$tmp/chat.jsonl"
  "$kvq" bench -m "$smol" --kv f16 --workload "$tmp/chat.jsonl" --chat -t 2 --json >"$tmp/chat.json" 2>/dev/null
  check "--chat conversation: the follow-up turn goes through the chat template" \
    "python3 -c \"import json; r=json.load(open('$tmp/chat.json'))['runs'][0]; assert r['ok']==2 and r['completion_tokens']==16, r\""
else
  echo "skip: $smol not installed (scripts/get-models.sh): residual-window and chat checks"
fi

# --tpot-target-ms: the same requests served, every one to its max_tokens
"$kvq" bench -m "$model" --kv f16 --data "$text" --prefixes 2 --prefix-tokens 64 --question-tokens 8 --requests 8 \
  --concurrency 4 --max-tokens 8 -t 1 --tpot-target-ms 0.5 --json >"$tmp/tp.json" 2>/dev/null
check "--tpot-target-ms: every request served, the setting in the report" \
  "[[ $? -eq 0 ]] && python3 -c \"import json; d=json.load(open('$tmp/tp.json')); r=d['runs'][0]; assert r['ok']==8 and r['errors']==0 and r['completion_tokens']==64, r; assert d['scheduler']=={'max_batch': 256, 'max_running': 64, 'oldest_prefill_tokens': 64, 'prefill_attention_cost': 2.0, 'tpot_target_ms': [0.5], 'threads': 1}, d['scheduler']; assert r['tpot_target_ms']==0.5\""

# --tpot-target-ms as a list: every format runs at each target; the table compares each target with
# the first, and the HTML report has a series per format and target
"$kvq" bench -m "$model" --kv f16,int8 --data "$text" --prefixes 2 --prefix-tokens 64 --question-tokens 8 --requests 8 \
  --concurrency 4 --max-tokens 8 -t 1 --tpot-target-ms 0,0.5 --html "$tmp/tt.html" >"$tmp/tt.txt" 2>/dev/null
check "--tpot-target-ms 0,0.5: a run per format and target, each compared with no target" \
  "[[ $? -eq 0 ]] && grep -q '^f16 @0.5ms ' $tmp/tt.txt && grep -q '^int8 @0.5ms ' $tmp/tt.txt && grep -q '^f16  ' $tmp/tt.txt && grep -q 'against no target at the same format, budget and load' $tmp/tt.txt && grep -E -q '^  int8 @0.5ms .* TPOT p50 [0-9.]+x, TTFT p50 [0-9.]+x, throughput [0-9.]+x' $tmp/tt.txt && grep -q 'int8 @0.5ms' $tmp/tt.html"

# the table, and a JSONL workload (max_tokens per line, --requests cycling over the lines)
printf '{"prompt": "Once upon a time", "max_tokens": 5}\n\n{"prompt": "Lily and Ben went to the park"}\n' >"$tmp/w.jsonl"
"$kvq" bench -m "$model" --kv fp8 --workload "$tmp/w.jsonl" --requests 3 --max-tokens 4 --concurrency 2 -t 1 >"$tmp/t" 2>"$tmp/e"
check "JSONL workload: table with one row" "[[ $? -eq 0 ]] && grep -q 'fp8 .* 2 clients *3/3' $tmp/t && grep -q 'greedy, end-of-generation ignored' $tmp/t"
"$kvq" bench -m "$model" --kv fp8 --workload "$tmp/w.jsonl" --requests 3 --max-tokens 4 -t 1 --json >"$tmp/w.json" 2>/dev/null
check "JSONL workload: lines' max_tokens honored (5 + 4 + 5 tokens)" \
  "python3 -c \"import json; d=json.load(open('$tmp/w.json')); assert d['workload']['kind']=='jsonl' and d['runs'][0]['completion_tokens']==14\""

# a budget sweep: f16 at 160 KiB (4 pages, no prefix kept) and 320 KiB (8 pages, all kept)
"$kvq" bench -m "$model" --kv f16 --kv-mem 163840,327680 --data "$text" --prefixes 4 --prefix-tokens 64 \
  --question-tokens 8 --concurrency 1 --max-tokens 8 -t 1 --json --html "$tmp/sw.html" >"$tmp/sw.json" 2>/dev/null
check "--kv-mem sweep: one run per budget, the larger one keeps every prefix" \
  "python3 -c \"import json; d=json.load(open('$tmp/sw.json')); R=d['runs']; assert d['kv_mem_bytes']==[163840,327680]; assert [r['kv_mem_bytes'] for r in R]==[163840,327680]; assert R[0]['prefix_hit_rate']==0 and abs(R[1]['prefix_hit_rate']-12*64/(16*73))<1e-9, R\" && grep -q 'f16 @ 160 KiB' $tmp/sw.html && grep -q 'f16 @ 320 KiB' $tmp/sw.html"

# multi-turn: 4 conversations of 3 turns over 2 prefixes; turn k + 1 resends turn k (73, 89, 105
# tokens) and finds its first page cached: hits 2 x 64 (second use of each prefix) + 8 x 64 of
# 4 x (73 + 89 + 105) prompt tokens
"$kvq" bench -m "$model" --kv f16 --kv-mem 1MiB --data "$text" --prefixes 2 --prefix-tokens 64 --question-tokens 8 \
  --turns 3 --requests 4 --max-tokens 8 --concurrency 2 -t 1 --json >"$tmp/mt.json" 2>/dev/null
check "--turns: every turn served, each resending the conversation so far" \
  "python3 -c \"import json; d=json.load(open('$tmp/mt.json')); w=d['workload']; r=d['runs'][0]; assert w['sessions']==4 and w['requests']==12 and w['turns']==3; assert r['ok']==12 and r['completion_tokens']==96 and r['prompt_tokens']==4*(73+89+105), r; assert abs(r['prefix_hit_rate']-640/1068)<1e-9, r['prefix_hit_rate']\""
"$kvq" bench -m "$model" --kv f16 --data "$text" --prefixes 2 --prefix-tokens 64 --turns 40 -c 512 -t 1 >"$tmp/o" 2>"$tmp/e"
check "--turns beyond the context: rejected before any run" "[[ $? -ne 0 ]] && grep -q \"last turn's prompt reaches\" $tmp/e"

# open loop: Poisson arrivals at --rate requests per second (seeded), next to a closed-loop run
"$kvq" bench -m "$model" --kv f16 --kv-mem 1MiB --data "$text" --prefixes 2 --prefix-tokens 64 --question-tokens 8 \
  --requests 6 --max-tokens 4 --concurrency 2 --rate 4,1000 -t 1 --json >"$tmp/r.json" 2>/dev/null
# (the seeded arrivals at 4 req/s span 0.33 s: the run lasts at least that, however fast it serves)
check "--rate: open-loop runs after the closed-loop one, all served; at 4 req/s the 6 arrivals span a while" \
  "python3 -c \"import json; R=json.load(open('$tmp/r.json'))['runs']; assert [(r['concurrency'],r['rate']) for r in R]==[(2,None),(None,4),(None,1000)], R; assert all(r['ok']==6 for r in R); assert R[1]['wall_s']>0.3, (R[1]['wall_s'],R[2]['wall_s'])\""

# JSONL conversations: "turns" are follow-ups sent with the answers so far
printf '{"prompt": "Once upon a time", "max_tokens": 5, "turns": ["Then Lily said", "The end"]}\n{"prompt": "Ben ran"}\n' >"$tmp/conv.jsonl"
"$kvq" bench -m "$model" --kv f16 --workload "$tmp/conv.jsonl" --max-tokens 4 --concurrency 2 -t 1 --json >"$tmp/c.json" 2>/dev/null
check "JSONL turns: 3 + 1 requests, 3 x 5 + 4 tokens, later turns carry the earlier ones" \
  "python3 -c \"import json; d=json.load(open('$tmp/c.json')); r=d['runs'][0]; assert d['workload']['sessions']==2 and d['workload']['requests']==4; assert r['ok']==4 and r['completion_tokens']==19, r; assert r['prompt_tokens']>3*6, r\""

# a budget no format fits in (2 f16 / 2 int8 pages; a request takes 64 + 32 + 32 tokens: 3 pages)
"$kvq" bench -m "$model" --kv f16,int8 --kv-mem 81920 --data "$text" --prefixes 2 --prefix-tokens 64 -t 1 >"$tmp/o" 2>"$tmp/e"
check "budget below one request: not run, exit 1, says why" "[[ $? -eq 1 ]] && grep -q 'longest request needs' $tmp/e && grep -q 'no format ran a request' $tmp/e"

# bad input: rejected before any run, with the reason
bad() {  # name, expected message, args...
  local name=$1 msg=$2
  shift 2
  "$kvq" bench -m "$model" -t 1 "$@" >"$tmp/o" 2>"$tmp/e"
  local rc=$?
  check "$name" "[[ $rc -ne 0 ]] && grep -q -- \"$msg\" $tmp/e && ! grep -q '\[bench\] .* requests' $tmp/e"
}
bad "unwritable --html: rejected before any run" "cannot write" --kv f16 --data "$text" --html /nonexistent/dir/r.html
bad "unknown format" "unknown KV format 'nope'" --kv f16,nope --data "$text"
bad "format that does not fit the model's head_dim" "head_dim 8 must be a multiple of 32" --kv f16,q4_0 --data "$text"
bad "no workload" "give a workload" --kv f16
bad "--chat-template-file without --chat" "needs --chat" --kv f16 --data "$text" --chat-template-file "$tmp/x.jinja"
bad "two workloads" "give a workload" --kv f16 --data "$text" --workload "$tmp/w.jsonl"
bad "bad concurrency" "is not a number of clients" --kv f16 --data "$text" --concurrency 2,x
bad "hexadecimal concurrency" "is not a number of clients" --kv f16 --data "$text" --concurrency 0x10
bad "fractional concurrency" "is not a number of clients" --kv f16 --data "$text" --concurrency 1.5
bad "hexadecimal rate" "is not a request rate" --kv f16 --data "$text" --rate 0x1
bad "bad rate" "is not a request rate" --kv f16 --data "$text" --rate 0
bad "a rate too low to finish" "is not a request rate" --kv f16 --data "$text" --rate 1e-9
mkdir -p "$tmp/adir"
bad "a directory as the workload" "directory" --kv f16 --workload "$tmp/adir"
bad "bad budget" "not a size" --kv f16 --data "$text" --kv-mem lots
bad "zero --oldest-prefill-tokens" "oldest-prefill-tokens" --kv f16 --data "$text" --oldest-prefill-tokens 0
bad "negative --prefill-attention-cost" "prefill-attention-cost" --kv f16 --data "$text" --prefill-attention-cost -1
bad "non-numeric --prefill-attention-cost" "prefill-attention-cost" --kv f16 --data "$text" --prefill-attention-cost lots
bad "negative --tpot-target-ms" "tpot-target-ms" --kv f16 --data "$text" --tpot-target-ms -1
bad "--kv-offload-size without a directory" "go together" --kv f16 --data "$text" --kv-offload-size 1MiB
bad "--kv-offload-dir without a size" "go together" --kv f16 --data "$text" --kv-offload-dir "$tmp"
bad "--kv-offload-direct without a tier" "kv-offload-direct needs" --kv f16 --data "$text" --kv-offload-direct
bad "a --kv-offload-size given twice" "given twice" --kv f16 --data "$text" --kv-offload-dir "$tmp" --kv-offload-size 1MiB,1MiB
bad "a bad --kv-offload-size" "kv-offload-size: 'lots' is not a size" --kv f16 --data "$text" --kv-offload-dir "$tmp" --kv-offload-size lots
bad "a --kv-offload-dir that is not a directory" "is not a directory" --kv f16 --data "$text" --kv-offload-dir "$tmp/b.json" --kv-offload-size 1MiB
bad "NaN --tpot-target-ms" "'nan' is not a time" --kv f16 --data "$text" --tpot-target-ms nan
bad "a --tpot-target-ms given twice" "given twice" --kv f16 --data "$text" --tpot-target-ms 5,5
mkdir -p "$tmp/adir"
bad "--kv-scales naming a directory" "is a directory" --kv int8_c --data "$text" --kv-scales "$tmp/adir"
printf '{"prompt": "ok"}\n{"prompt": 3}\n' >"$tmp/bad1.jsonl"
bad "JSONL line without a string prompt" "bad1.jsonl:2: each line needs a string field" --kv f16 --workload "$tmp/bad1.jsonl"
printf '{"prompt": "ok"\n' >"$tmp/bad2.jsonl"
bad "malformed JSONL" "bad2.jsonl:1: malformed JSON" --kv f16 --workload "$tmp/bad2.jsonl"
printf '{"prompt": "ok", "max_tokens": 0}\n' >"$tmp/bad3.jsonl"
bad "max_tokens out of range" "must be an integer in 1.." --kv f16 --workload "$tmp/bad3.jsonl"
: >"$tmp/empty.jsonl"
printf '{"prompt": "ok", "turns": "more"}\n' >"$tmp/bad4.jsonl"
bad "turns not an array" "bad4.jsonl:1: \\\"turns\\\" must be an array of strings" --kv f16 --workload "$tmp/bad4.jsonl"
bad "empty workload" "no requests (empty file)" --kv f16 --workload "$tmp/empty.jsonl"
python3 -c "print('{\"prompt\": \"' + 'a b c ' * 400 + '\"}')" >"$tmp/long.jsonl"
bad "prompt beyond the context" "no room to generate in the context of 64" --kv f16 -c 64 --workload "$tmp/long.jsonl"
bad "--chat on a model without a chat template" "no chat template kvq knows" --kv f16 --chat --workload "$tmp/w.jsonl"
bad "--chat without a JSONL workload" "applies to --workload" --kv f16 --chat --data "$text"
bad "text too short for the prefixes" "fewer than --prefixes" --kv f16 --data "$tmp/w.jsonl" --prefix-tokens 64

# A full-precision window (kivi4 on SmolLM2, when installed) is reserved out of the budget for the
# sequences a load runs at once: 1 client gets a smaller pool than q4_0, 4 clients' windows alone
# exceed 24 MiB and do not fit.
smol=${KVQ_MODELS_DIR:-$src/models}/SmolLM2-135M-Instruct.Q4_1.gguf
[[ -f $smol ]] || smol=$src/models/SmolLM2-135M-Instruct.Q4_1.gguf
if [[ -f $smol ]]; then
  "$kvq" bench -m "$smol" --kv q4_0,kivi4 --kv-mem 24MiB --data "$text" --prefixes 2 --prefix-tokens 40 \
    --question-tokens 16 --max-tokens 4 --requests 4 --concurrency 1,4 -t 1 --json >"$tmp/w.json" 2>/dev/null
  check "kivi4's windows are reserved out of the budget per running sequence" \
    "python3 -c \"import json; R={(r['format'],r['concurrency']): r for r in json.load(open('$tmp/w.json'))['runs']}; q,k1,k4=R[('q4_0',1)],R[('kivi4',1)],R[('kivi4',4)]; t=k1['tail_bytes_per_sequence_max']; assert t>0 and q['window_reserve_bytes']==0; assert k1['window_reserve_bytes']==t and k4['window_reserve_bytes']==4*t; assert k1['fits'] and 0<k1['kv_tokens']*k1['kv_bytes_per_token']<=24*2**20-t; assert not k4['fits']\""
fi

finish bench
