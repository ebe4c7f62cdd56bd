#!/usr/bin/env bash
# kvq eval and kvq plan --measure end to end on stories260K, and eval's bad-input handling.
set -u
source "$(dirname "$0")/common.bash"
require "$model" "$text"

printf '{"prompt": "Once upon a time", "expected": "there", "match": "substring"}\n{"prompt": "Lily", "expected": "xyz"}\n' >"$tmp/own.jsonl"
"$kvq" eval -m "$model" --kv int8,fp8 --ctx 64,128 --task ppl,own --data "$text" --own "$tmp/own.jsonl" \
  --json --html "$tmp/r.html" --no-progress -t 1 >"$tmp/out.json" 2>"$tmp/err"
check "eval exits 0" "[[ $? -eq 0 ]]"
check "eval JSON has one bucket per context per format" \
  "python3 -c \"import json,sys; d=json.load(open('$tmp/out.json')); assert [len(f['buckets']) for f in d['formats']]==[2,2]; assert all(b['ctx'] in (64,128) and b['kld_mean']>=0 and 0<=b['top1_agree']<=1 for f in d['formats'] for b in f['buckets']); assert d['formats'][0]['own']['n']==2; assert d['cpu'] in ('scalar','avx2','avx512'); assert all(abs(b['bits_per_element']-f['bits_per_element'])<1e-9 for f in d['formats'] for b in f['buckets'])\""
check "HTML report is self-contained with SVG plots" "grep -q '<svg' $tmp/r.html && ! grep -q 'http://\|https://' <(sed 's|http://www.w3.org/2000/svg||g' $tmp/r.html)"

# per-layer sensitivity and the static-prefill scale mode
"$kvq" eval -m "$model" --kv int8 --task layers,ppl --ctx 64 --data "$text" --scale-mode static-prefill --json --no-progress -t 1 >"$tmp/l.json" 2>/dev/null
check "layers task: one entry per layer with K and V errors" \
  "python3 -c \"import json; d=json.load(open('$tmp/l.json')); L=d['formats'][0]['layers']['per_layer']; assert len(L)==5 and all(e['k_rel_err']>0 and e['v_rel_err']>0 for e in L); assert d['scale_mode']=='static-prefill' and d['formats'][0]['buckets'][0]['kld_mean']>0\""

# a per-layer policy within a bit budget from the layers task, evaluated by ppl in the same run
"$kvq" eval -m "$model" --kv fp8,int8,bf16 --task layers,ppl --budget-bits 11,14 --ctx 64 --data "$text" --json --html "$tmp/p.html" --no-progress -t 1 >"$tmp/p.json" 2>/dev/null
check "budget policy: within the budget, one --kv-layer per layer from the formats under test, evaluated by ppl" \
  "python3 -c \"import json; d=json.load(open('$tmp/p.json')); assert [q['format'] for q in d['policies']]==['policy@11','policy@14']; assert d['policies'][1]['sum_sq_rel_err']<=d['policies'][0]['sum_sq_rel_err']; p=d['policies'][0]; f={x['format']: x for x in d['formats']}; assert p['format']=='policy@11' and p['format'] in f; assert 8<=p['bits_per_element']<=11+1e-9; assert len(p['layers'])==5 and p['flags'].count('--kv-layer')==5; assert all(l['k'] in ('fp8_e4m3','int8','bf16') and l['v'] in ('fp8_e4m3','int8','bf16') for l in p['layers']); assert len(set(l['k'] for l in p['layers'])|set(l['v'] for l in p['layers']))>1; assert abs(f[p['format']]['bits_per_element']-p['bits_per_element'])<1e-6 and f[p['format']]['buckets'][0]['kld_mean']>=0\""
check "budget policy HTML lists both policies with their flags" "grep -q 'policy@11' $tmp/p.html && grep -q 'policy@14' $tmp/p.html && grep -q -- '--kv-layer 4=' $tmp/p.html"
"$kvq" eval -m "$model" --kv fp8,int8 --task ppl --budget-bits 9 --ctx 64 --data "$text" --no-progress -t 1 >/dev/null 2>"$tmp/pe1"
check "budget without the layers task: rejected" "[[ $? -ne 0 ]] && grep -q 'needs --task layers' $tmp/pe1"
"$kvq" eval -m "$model" --kv fp8,int8 --task layers --budget-bits 4 --ctx 64 --data "$text" --no-progress -t 1 >/dev/null 2>"$tmp/pe2"
check "budget below the cheapest choice: rejected with the least achievable" "[[ $? -ne 0 ]] && grep -q 'below the cheapest choice, 8.00 bits' $tmp/pe2"

# calibrate records channel means; the centered formats read them, and refuse to run without them
"$kvq" calibrate -m "$model" --data "$text" -o "$tmp/calib.json" --ctx 64 --chunks 2 -t 1 2>"$tmp/ce"
check "calibrate exits 0 and reports the mean energy" "[[ $? -eq 0 ]] && grep -q 'channel means hold' $tmp/ce"
check "calibrate reports what channel scales would gain" "grep -Eq 'key channel scales .* [0-9]+\\.[0-9]+x' $tmp/ce"
check "calibration has per-head channel RMS of K, V and Q (stories260K: 4 KV heads of 8), positive, at least |mean|" \
  "python3 -c \"import json; d=json.load(open('$tmp/calib.json')); L=d['layers']; assert all(len(l[k])==4 and all(len(h)==8 and all(x>0 for x in h) for h in l[k]) for l in L for k in ('k_rms','v_rms','q_rms')); assert all(r>=abs(m)*(1-1e-5) for l in L for hr,hm in zip(l['k_rms'],l['k_mean']) for r,m in zip(hr,hm))\""
check "calibration has per-head channel means of K and V" \
  "python3 -c \"import json; d=json.load(open('$tmp/calib.json')); L=d['layers']; assert len(L)==5 and all(len(l['k_mean'])==4 and all(len(h)==8 for h in l['k_mean']) and len(l['v_mean'])==4 for l in L); assert any(abs(x)>0 for l in L for h in l['k_mean'] for x in h)\""
"$kvq" eval -m "$model" --kv int8_c,int8 --kv-scales "$tmp/calib.json" --ctx 64 --data "$text" --json --no-progress -t 1 >"$tmp/c.json" 2>/dev/null
check "eval runs a centered format from the calibration" \
  "python3 -c \"import json; d=json.load(open('$tmp/c.json')); f=d['formats']; assert f[0]['format']=='int8_c' and 0<=f[0]['buckets'][0]['kld_mean']<0.05\""
check "eval's JSON names the calibration it ran with (--kv-scales)" \
  "python3 -c \"import json; assert json.load(open('$tmp/c.json'))['kv_scales']=='$tmp/calib.json'\""
# a calibration under YaRN says so; used without it (or it without YaRN), kvq warns
"$kvq" calibrate -m "$model" --data "$text" -o "$tmp/cy.json" --ctx 64 --chunks 1 --kvquant-bits 2 -t 1 \
  --rope-scaling yarn --rope-scale 4 --yarn-orig-ctx 512 2>/dev/null
check "calibrate under YaRN records it" \
  "python3 -c \"import json; assert json.load(open('$tmp/cy.json'))['rope_scaling']=='YaRN RoPE scaling x4 of 512 positions (beta 32 / 1)'\""
"$kvq" eval -m "$model" --kv int8_c --kv-scales "$tmp/cy.json" --ctx 64 --data "$text" --no-progress -t 1 >/dev/null 2>"$tmp/yw"
check "a YaRN calibration on the unscaled model: warned" "grep -q 'was calibrated with YaRN RoPE scaling x4 of 512 positions (beta 32 / 1), the model runs with none' $tmp/yw"
"$kvq" eval -m "$model" --kv int8_c --kv-scales "$tmp/calib.json" --ctx 64 --data "$text" --no-progress -t 1 \
  --rope-scaling yarn --rope-scale 4 --yarn-orig-ctx 512 >/dev/null 2>"$tmp/yw2"
check "an unscaled calibration under YaRN: warned" "grep -q 'was calibrated with no RoPE scaling, the model runs with YaRN' $tmp/yw2"
"$kvq" eval -m "$model" --kv int8_c --kv-scales "$tmp/cy.json" --ctx 64 --data "$text" --no-progress -t 1 \
  --rope-scaling yarn --rope-scale 4 --yarn-orig-ctx 512 >/dev/null 2>"$tmp/yw3"
check "the same YaRN: runs, no warning" "[[ $? -eq 0 ]] && ! grep -q 'was calibrated with' $tmp/yw3"
mkdir "$tmp/adir"
"$kvq" eval -m "$model" --kv int8_c --kv-scales "$tmp/adir" --ctx 64 --data "$text" --no-progress -t 1 >/dev/null 2>"$tmp/de"
check "eval: --kv-scales naming a directory is an error, not a crash" "[[ $? -eq 1 ]] && grep -q 'kvq: error: --kv-scales .* is a directory' $tmp/de"

# KVQuant keys refuse a calibration that lacks their codebooks: another model's (stories260K's,
# head_dim 8: none fitted) or one fitted for other bit widths (SmolLM2, when installed)
smol=${KVQ_MODELS_DIR:-$src/models}/SmolLM2-135M-Instruct.Q4_1.gguf
[[ -f $smol ]] || smol=$src/models/SmolLM2-135M-Instruct.Q4_1.gguf
if [[ -f $smol ]]; then
  for f in kvquant4 kvquant3.25; do
    "$kvq" run -m "$smol" -p hi -n 2 -t 1 --kv $f --kv-scales "$tmp/calib.json" >/dev/null 2>"$tmp/kq"
    check "$f refuses stories260K's calibration on SmolLM2" "[[ $? -eq 1 ]] && grep -q 'kvq: error: .*another model.*kvq calibrate' $tmp/kq"
  done
  "$kvq" calibrate -m "$smol" --data "$text" -o "$tmp/smol2.json" --ctx 64 --chunks 1 --kvquant-bits 2 -t 1 2>/dev/null
  "$kvq" run -m "$smol" -p hi -n 2 -t 1 --kv kvquant4 --kv-scales "$tmp/smol2.json" >/dev/null 2>"$tmp/kq"
  check "kvquant4 refuses a calibration fitted with --kvquant-bits 2" \
    "[[ $? -eq 1 ]] && grep -q 'kvq: error: .*kvquant_k4.*--kvquant-bits 4' $tmp/kq"
  "$kvq" run -m "$smol" -p hi -n 2 -t 1 --kv kvquant2 --kv-scales "$tmp/smol2.json" >/dev/null 2>"$tmp/kq"
  check "kvquant2 runs with the 2-bit calibration" "[[ $? -eq 0 ]]"
  python3 -c "import json; d=json.load(open('$tmp/smol2.json')); d['layers'][0]['kvquant_cal_k2']['scale']=[[0.0]*len(h) for h in d['layers'][0]['kvquant_cal_k2']['scale']]; json.dump(d, open('$tmp/smol0.json','w'))"
  "$kvq" run -m "$smol" -p hi -n 2 -t 1 --kv kvquant2_cal --kv-scales "$tmp/smol0.json" >/dev/null 2>"$tmp/kq"
  check "kvquant2_cal refuses all-zero scales" "[[ $? -eq 1 ]] && grep -q 'kvq: error: .*must be positive and finite' $tmp/kq"
else
  echo "skip: SmolLM2-135M-Instruct.Q4_1.gguf not installed (the KVQuant calibration checks on it)"
fi

# needle with several trials per cell: one grid entry per (ctx, depth, trial), each trial its own
# stretch of the haystack, accuracy over all of them; the HTML cells count trials
"$kvq" eval -m "$model" --kv int8 --task needle --ctx 128 --depths 20,80 --needles 3 --data "$text" \
  --json --html "$tmp/n.html" --no-progress -t 1 >"$tmp/n.json" 2>/dev/null
check "needle: 2 depths x 3 trials per format, distinct haystack offsets, accuracy = hits / trials" \
  "python3 -c \"import json; d=json.load(open('$tmp/n.json')); n=d['formats'][0]['needle']; g=n['grid']; assert len(g)==6 and sorted(set(e['trial'] for e in g))==[0,1,2]; assert len(set(e['haystack_offset'] for e in g))==3; assert abs(n['accuracy']-sum(e['ok'] for e in g)/6)<1e-12\""
check "needle HTML counts trials per cell" "grep -Eq '>[0-3]/3<' $tmp/n.html"
check "needle JSON: kv_scales null without --kv-scales" "python3 -c \"import json; assert json.load(open('$tmp/n.json'))['kv_scales'] is None\""
check "needle: lost / gained against the f16 cache's own trials, and a sign-test p in (0, 1]" \
  "python3 -c \"import json; d=json.load(open('$tmp/n.json')); f=d['formats'][0]; ref=f['needle_f16_ok']; ok=[e['ok'] for e in f['needle']['grid']]; v=f['needle']['vs_f16']; assert len(ref)==len(ok)==6; assert v['lost']==sum(r and not o for r,o in zip(ref,ok)); assert v['gained']==sum(o and not r for r,o in zip(ref,ok)); assert 0<v['p_value']<=1; assert abs(sum(ref)/6-f['needle_f16'])<1e-12\""

# the needle trials written as an own-task eval set and replayed by --task own: the exact tokens,
# so each format's answers are the needle run's, trial by trial
"$kvq" eval -m "$model" --kv int8,fp8 --task needle --ctx 128,160 --depths 20,80 --needles 2 --data "$text" \
  --needle-set-out "$tmp/set.jsonl" --json --no-progress -t 1 >"$tmp/ns.json" 2>/dev/null
check "needle set: one line per (ctx, depth, trial) with the prompt, its BOS-led tokens and the passcode" \
  "python3 -c \"import json; L=[json.loads(x) for x in open('$tmp/set.jsonl')]; assert len(L)==8; assert sorted({(e['ctx'],e['depth'],e['trial']) for e in L})==[(c,d,k) for c in (128,160) for d in (20,80) for k in (0,1)]; assert all(e['prompt_tokens'][0]==1 and len(e['prompt_tokens'])<=e['ctx'] and e['match']=='substring' and e['max_tokens']==10 and 'The secret passcode is '+e['expected'] in e['prompt'] for e in L)\""
"$kvq" eval -m "$model" --kv int8,fp8 --task own --own "$tmp/set.jsonl" --json --html "$tmp/nr.html" --no-progress -t 1 >"$tmp/nr.json" 2>/dev/null
check "needle set replayed by --task own: the same answers per format and trial" \
  "python3 -c \"import json; a=json.load(open('$tmp/ns.json')); b=json.load(open('$tmp/nr.json')); A={f['format']: [e['answer'] for e in f['needle']['grid']] for f in a['formats']}; B={f['format']: [e['output'] for e in f['own']['items']] for f in b['formats']}; assert A==B and len(A['int8'])==8 and all(len(x)>0 for x in A['int8'])\""
check "needle set replayed: the same f16 outcomes and the same lost / gained per format" \
  "python3 -c \"import json; a=json.load(open('$tmp/ns.json')); b=json.load(open('$tmp/nr.json')); assert all(x['needle_f16_ok']==y['own_f16_ok'] and x['needle']['vs_f16']==y['own']['vs_f16'] for x,y in zip(a['formats'],b['formats'])); assert len(b['formats'][0]['own_f16_ok'])==8\""
check "own HTML: the f16 row and lost / gained per format" "grep -q '<th>lost</th>' $tmp/nr.html && grep -q \"<td style='text-align:left'>f16</td>\" $tmp/nr.html"

bad() {
  local name=$1 pattern=$2; shift 2
  "$kvq" "$@" >"$tmp/bo" 2>"$tmp/be"
  local rc=$?
  check "$name: non-zero exit" "[[ $rc -ne 0 && $rc -lt 128 ]]"
  check "$name: message says '$pattern'" "grep -qi -- '$pattern' $tmp/be"
}
bad "unknown format" "int7" eval -m "$model" --kv int7 --ctx 64 --data "$text"
bad "context beyond the model's" "exceeds" eval -m "$model" --kv int8 --ctx 1M --data "$text"
: >"$tmp/empty.jsonl"
bad "empty JSONL" "empty" eval -m "$model" --kv int8 --task own --own "$tmp/empty.jsonl"
bad "--chat-template-file without --chat" "needs --chat" eval -m "$model" --kv int8 --task own --own "$tmp/own.jsonl" --chat-template-file "$tmp/own.jsonl"
bad "--chat without a template" "no chat template" eval -m "$model" --kv int8 --task own --own "$tmp/own.jsonl" --chat
# a template given to a model without one: its cases wrapped in it (the prompts grow by its system message)
printf '{{- "<|start|>system<|message|>" }}{{- "<|channel|>" }}\n' >"$tmp/harmony.jinja"
"$kvq" eval -m "$model" --kv int8 --task own --own "$tmp/own.jsonl" --chat --chat-template-file "$tmp/harmony.jinja" --json \
  --no-progress -t 1 >"$tmp/tmpl.json" 2>"$tmp/tmpl.err"
check "--chat-template-file: own cases run in the given template" "[[ $? -eq 0 ]] && grep -q '\"format\"' $tmp/tmpl.json"
# a reasoning template whose prompt opens the block (QwQ's): a case is matched on the answer after
# the reasoning (here none: the reply is all reasoning), not on the reasoning; with enable_thinking
# false the block is closed and the reply is the answer
printf "{%%- if add_generation_prompt %%}{{- '<|im_start|>assistant\\\\n<think>\\\\n' }}{%%- endif %%}\n" >"$tmp/qwq.jinja"
for kw in '{}' '{"enable_thinking": false}'; do
  "$kvq" eval -m "$model" --kv int8 --task own --own "$tmp/own.jsonl" --chat --chat-template-file "$tmp/qwq.jinja" \
    --chat-template-kwargs "$kw" --max-tokens 12 --json --no-progress -t 1 >"$tmp/think.json" 2>/dev/null
  check "reasoning template, kwargs $kw: cases matched on the answer" \
    "[[ $? -eq 0 ]] && python3 -c \"import json; it=json.load(open('$tmp/think.json'))['formats'][0]['own']['items']; assert all(i['output'] for i in it); assert all((i['answer']=='') == ('$kw'=='{}') for i in it), it\""
done
# --reasoning-budget 3: each reply's reasoning ends after 3 tokens (its output holds the close) and
# the model answers after it (no longer empty)
"$kvq" eval -m "$model" --kv int8 --task own --own "$tmp/own.jsonl" --chat --chat-template-file "$tmp/qwq.jinja" \
  --reasoning-budget 3 --max-tokens 16 --json --no-progress -t 1 >"$tmp/budget.json" 2>/dev/null
check "--reasoning-budget: own's replies answer after a bounded reasoning" \
  "[[ $? -eq 0 ]] && python3 -c \"import json; it=json.load(open('$tmp/budget.json'))['formats'][0]['own']['items']; assert all('\\n</think>\\n' in i['output'] and i['answer'] for i in it), it\""
bad "--reasoning-budget without --chat" "need --task own with --chat" eval -m "$model" --kv int8 --task own --own "$tmp/own.jsonl" --reasoning-budget 3
printf '{"prompt": "a", "expected": \n' >"$tmp/bad.jsonl"
bad "malformed JSONL" "malformed" eval -m "$model" --kv int8 --task own --own "$tmp/bad.jsonl"
printf '{"prompt": "a"}\n' >"$tmp/missing.jsonl"
bad "JSONL without expected" "expected" eval -m "$model" --kv int8 --task own --own "$tmp/missing.jsonl"
printf '{"prompt": "a", "expected": "b", "prompt_tokens": [1, -3]}\n' >"$tmp/negtok.jsonl"
bad "JSONL with a negative token id" "prompt_tokens" eval -m "$model" --kv int8 --task own --own "$tmp/negtok.jsonl"
printf '{"prompt": "a", "expected": "b", "prompt_tokens": [1, 99999]}\n' >"$tmp/vocab.jsonl"
bad "JSONL with a token outside the vocabulary" "vocabulary" eval -m "$model" --kv int8 --task own --own "$tmp/vocab.jsonl"
printf '{"prompt": "a", "expected": "b", "max_tokens": 0}\n' >"$tmp/maxtok.jsonl"
bad "JSONL with max_tokens 0" "max_tokens" eval -m "$model" --kv int8 --task own --own "$tmp/maxtok.jsonl"
printf '{"prompt": "a", "expected": ""}\n' >"$tmp/emptyexp.jsonl"
bad "JSONL whose expected substring is empty" "could not fail" eval -m "$model" --kv int8 --task own --own "$tmp/emptyexp.jsonl"
mkdir -p "$tmp/adir"
bad "a directory as the eval set" "directory" eval -m "$model" --kv int8 --task own --own "$tmp/adir"
bad "a directory as the text" "directory" eval -m "$model" --kv int8 --ctx 64 --data "$tmp/adir"
bad "--needle-set-out without the needle task" "task needle" eval -m "$model" --kv int8 --ctx 64 --data "$text" --needle-set-out "$tmp/x.jsonl"
bad "unwritable --needle-set-out" "cannot write" eval -m "$model" --kv int8 --task needle --ctx 128 --data "$text" --needle-set-out /nonexistent/dir/s.jsonl
head -c 300 "$text" >"$tmp/short.txt"
bad "haystack shorter than the context" "haystack" eval -m "$model" --kv int8 --task needle --ctx 512 --haystack "$tmp/short.txt"
bad "zero needles per cell" "needles" eval -m "$model" --kv int8 --task needle --ctx 128 --needles 0 --data "$text"
bad "unknown scale mode" "scale-mode" eval -m "$model" --kv int8 --ctx 64 --data "$text" --scale-mode sometimes
bad "centered format without calibration" "kvq calibrate" eval -m "$model" --kv int8_c --ctx 64 --data "$text"
bad "unwritable --html, before any model time" "cannot write" eval -m "$model" --kv int8 --ctx 64 --data "$text" --html /nonexistent/dir/r.html
bad "unknown task" "unknown task" eval -m "$model" --kv int8 --task nope --ctx 64 --data "$text"
bad "an --own match that is not a string" "match" eval -m "$model" --kv int8 --task own --own <(printf '{"prompt": "a", "expected": "b", "match": 5}\n')
bad "--budget-bits nan" "budget-bits" eval -m "$model" --kv fp8,int8 --task layers --budget-bits nan --ctx 64 --data "$text"
bad "a context given twice" "twice" eval -m "$model" --kv int8 --ctx 64,64 --data "$text"
bad "an empty item of --ctx" "empty item" eval -m "$model" --kv int8 --ctx 64,,128 --data "$text"
bad "an empty item of --kv" "empty item" eval -m "$model" --kv=int8, --ctx 64 --data "$text"
bad "an empty --kv" "empty" eval -m "$model" --kv '' --ctx 64 --data "$text"
bad "an empty numeric value" "empty" run -m "$model" -n ''
bad "a typo in --kv-cache-dtype beside -ctk and -ctv" "bogus" run -m "$model" --kv-cache-dtype bogus -ctk f16 -ctv f16 -n 1
bad "a token group of 1" "2..1024" run -m "$model" --kv-cache-dtype kivi4@g1 -n 1
bad "--kv-group-tokens 1" "2..1024" run -m "$model" --kv-cache-dtype kivi4 --kv-group-tokens 1 -n 1
# a needle context the haystack cannot fill: rejected before the ppl task runs, not after it
"$kvq" eval -m "$model" --kv int8 --task ppl,needle --ctx 128,512 --data "$text" --haystack "$tmp/short.txt" --no-progress -t 1 >/dev/null 2>"$tmp/late"
check "a short haystack fails before any task runs" "[[ $? -ne 0 ]] && grep -q 'haystack has' $tmp/late && ! grep -q 'ppl ctx' $tmp/late"

# outputs: never an input, never left partial or empty, an existing file kept on failure
cp "$model" "$tmp/m.gguf"
sum0=$(sha256sum <"$tmp/m.gguf")
bad "--needle-set-out onto the model" "also the model" eval -m "$tmp/m.gguf" --kv int8 --task needle --ctx 128 --data "$text" --needle-set-out "$tmp/./m.gguf"
bad "calibrate -o onto the model" "also the model" calibrate -m "$tmp/m.gguf" --data "$text" -o "$tmp/m.gguf"
bad "calibrate -o onto the text" "also the text" calibrate -m "$model" --data "$text" -o "$text"
bad "--json-out onto --html" "also --html" eval -m "$model" --kv int8 --ctx 64 --data "$text" --json-out "$tmp/r" --html "$tmp/r"
check "the model file is intact" "[[ \$(sha256sum <$tmp/m.gguf) == '$sum0' ]]"
echo keep >"$tmp/keep.json"
bad "calibrate from a missing text" "cannot read" calibrate -m "$model" --data "$tmp/none.txt" -o "$tmp/keep.json"
check "an existing output is kept when the run fails" "[[ \$(cat $tmp/keep.json) == keep ]]"
echo keep >"$tmp/set.jsonl"
bad "a haystack too short for the needle set" "haystack" eval -m "$model" --kv int8 --task needle --ctx 512 --haystack "$tmp/short.txt" --needle-set-out "$tmp/set.jsonl"
check "... leaves the earlier needle set as it was" "[[ \$(cat $tmp/set.jsonl) == keep ]]"
bad "bench without a workload" "workload" bench -m "$model" --kv f16 --json-out "$tmp/b1.json" --html "$tmp/b1.html"
check "... leaves no empty report files" "[[ ! -e $tmp/b1.json && ! -e $tmp/b1.html ]]"
check "no temporary files left beside the outputs" "! ls $tmp | grep -q kvq-tmp"
# calibration entries out of layer order are refused, not read as other layers' scales
python3 -c "import json; d=json.load(open('$tmp/calib.json')); d['layers'].reverse(); json.dump(d, open('$tmp/rev.json','w'))"
bad "a calibration whose layers are out of order" "layer order" run -m "$model" --kv-cache-dtype int8_static --kv-scales "$tmp/rev.json" -n 1

# plan --measure: measured growth per token next to the prediction
"$kvq" plan --measure -m "$model" --ctx 256,512,1024 --kv f16 >"$tmp/m" 2>&1
check "plan --measure exits 0" "[[ $? -eq 0 ]]"
check "plan --measure reports growth per token vs prediction" "grep -q 'bytes/token measured vs 640 predicted' $tmp/m"
bad "plan --measure without a GGUF" "measure" plan --measure --preset llama-3-70b --ctx 1K,2K

finish eval
