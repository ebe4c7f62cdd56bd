#!/usr/bin/env bash
# KV-format quality on a real model and WikiText-2: kvq eval (perplexity, KL divergence and
# top-1 agreement against the f16 cache, per context length) and, when LLAMA_PERPLEXITY points
# at a llama-perplexity binary, llama.cpp's own f16 / q8_0 / q4_0 KV (LLAMA_KV) on the same GGUF and text,
# both with its Hadamard KV rotation (its default for quantized caches) and without it
# (LLAMA_ATTN_ROT_DISABLE=1).
#
#   bench/quality.sh BUILD_DIR MODEL.gguf TEXT OUT_DIR [CTX_LIST] [CHUNKS] [FORMATS]
#
# Environment:
#   THREADS=N        threads for both engines (default 2)
#   F32_WEIGHTS=1    kvq at reference precision (weights dequantized to f32, no 8-bit activation
#                    rounding), which isolates the KV format's own error
#   TASKS=ppl,needle kvq eval tasks (default ppl); needle uses NEEDLE_HAYSTACK (default TEXT)
#   KVQ_ARGS="..."   extra kvq eval flags (e.g. --kv-cache-dtype-skip-layers first:2,last:2)
#   TAG=name         suffix for the output files (several configurations into one OUT_DIR)
#   LLAMA_KV="..."   llama.cpp cache types to run (default "q8_0 q4_0"; any -ctk type, e.g.
#                    "q4_1 q5_0 q5_1 iq4_nl")
#
# Writes OUT_DIR/kvq-<model><TAG>.json/.html/.txt and OUT_DIR/llamacpp-<model>.txt.
set -euo pipefail
build=$1; model=$2; text=$3; out=$4
ctx=${5:-512,2048}
chunks=${6:-2}
formats=${7:-q8_0,q8_0h,int8,fp8_e4m3,q4_0,q4_0h,int4_g32,kivi4,kivi2,tq4,tq4_qjl,tq3.5,tq3,tq2.5,k8v4}
threads=${THREADS:-2}
tasks=${TASKS:-ppl}
tag=${TAG:-}
mkdir -p "$out"
name=$(basename "$model" .gguf)
extra=()
[[ "${F32_WEIGHTS:-0}" == 1 ]] && extra+=(--f32-weights)
[[ -n "${NEEDLE_HAYSTACK:-}" ]] && extra+=(--haystack "$NEEDLE_HAYSTACK")
# shellcheck disable=SC2206
[[ -n "${KVQ_ARGS:-}" ]] && extra+=(${KVQ_ARGS})
"$build/kvq" eval -m "$model" --kv "$formats" --ctx "$ctx" --chunks "$chunks" --data "$text" -t "$threads" \
  --task "$tasks" "${extra[@]}" \
  --json-out "$out/kvq-$name$tag.json" --html "$out/kvq-$name$tag.html" --no-progress | tee "$out/kvq-$name$tag.txt"
if [[ -n "${LLAMA_PERPLEXITY:-}" ]]; then
  : >"$out/llamacpp-$name.txt"
  for c in ${ctx//,/ }; do
    base="$out/llamacpp-$name-$c-f16.kld"
    "$LLAMA_PERPLEXITY" -m "$model" -f "$text" -c "$c" --chunks "$chunks" -t "$threads" -fa on \
      --kl-divergence-base "$base" 2>&1 | grep -E "Final estimate" | sed "s/^/ctx $c f16: /" >>"$out/llamacpp-$name.txt"
    for kv in ${LLAMA_KV:-q8_0 q4_0}; do
      for rot in 1 0; do
        label="$kv"; [[ $rot == 0 ]] && label="$kv-norot"
        LLAMA_ATTN_ROT_DISABLE=$((1 - rot)) "$LLAMA_PERPLEXITY" -m "$model" -f "$text" -c "$c" --chunks "$chunks" \
          -t "$threads" -fa on -ctk "$kv" -ctv "$kv" --kl-divergence-base "$base" --kl-divergence 2>&1 |
          grep -E "^(Mean PPL\(Q\)|Mean PPL\(base\)|Mean +KLD|99.0% +KLD|Same top p|PPL ratio)|attn_rot_k" |
          sed "s/^/ctx $c $label: /" >>"$out/llamacpp-$name.txt"
      done
    done
  done
  cat "$out/llamacpp-$name.txt"
fi
