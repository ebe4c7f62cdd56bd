#!/usr/bin/env bash
# Long-context retrieval as a regression test: a fused-attention fault that only shows at length (a
# batch of blocks dropped or rescaled wrongly, a position wrapped) passes short tests and loses the
# needles, as vLLM's FP8 cache once did at 128K tokens. kvq eval's needle task on SmolLM2-135M
# (scripts/get-models.sh) at 2048 tokens, the length at which the model itself still retrieves
# (bench/QUALITY.md), in the Paul Graham essays of ../shared: f16 finds at least 5 of 6 needles and
# the formats whose needle record equals f16's on 120 trials (the 8-bit ones, kivi4) lose at most
# one of f16's.
set -u
source "$(dirname "$0")/common.bash"
smol=${KVQ_MODELS_DIR:-$src/models}/SmolLM2-135M-Instruct.Q4_1.gguf
[[ -f $smol ]] || smol=$src/models/SmolLM2-135M-Instruct.Q4_1.gguf
essays=$src/../shared/data/paulgraham-essays.txt
require "$smol" "$essays"

"$kvq" eval -m "$smol" --task needle --kv q8_0,int8,fp8_e4m3,kivi4 --ctx 2048 --depths 10,50,90 --needles 2 \
  --data "$essays" --json --no-progress -t 2 >"$tmp/n.json" 2>"$tmp/err"
check "needle eval at 2048 tokens exits 0" "[[ $? -eq 0 ]]"
check "six trials per format, the needles 2048 tokens deep" \
  "python3 -c \"import json; d=json.load(open('$tmp/n.json')); assert all(len(f['needle']['grid'])==6 and all(e['ctx']==2048 for e in f['needle']['grid']) for f in d['formats'])\""
check "f16 finds at least 5 of the 6 needles" \
  "python3 -c \"import json; d=json.load(open('$tmp/n.json')); r=d['formats'][0]['needle_f16_ok']; assert len(r)==6 and sum(r)>=5, r\""
for f in q8_0 int8 fp8_e4m3 kivi4; do
  check "$f loses at most one of f16's needles" \
    "python3 -c \"import json; d=json.load(open('$tmp/n.json')); x=[e for e in d['formats'] if e['format']=='$f'][0]; v=x['needle']['vs_f16']; assert v['lost']<=1, v\""
done
finish needle
