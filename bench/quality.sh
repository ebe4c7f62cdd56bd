#!/usr/bin/env bash
# KV-format quality on a real model and WikiText-2: kvq eval (perplexity, KL divergence and
# top-1 agreement against the f16 cache, per context length) and, when LLAMA_PERPLEXITY points
# at a llama-perplexity binary, llama.cpp's own f16 / q8_0 / q4_0 KV on the same GGUF and text.
#
#   bench/quality.sh BUILD_DIR MODEL.gguf TEXT OUT_DIR [CTX_LIST] [CHUNKS] [FORMATS]
#
# Writes OUT_DIR/kvq-<model>.json and .html, and OUT_DIR/llamacpp-<model>.txt.
set -euo pipefail
build=$1; model=$2; text=$3; out=$4
ctx=${5:-512,2048}
chunks=${6:-2}
formats=${7:-q8_0,int8,fp8_e4m3,q4_0,int4_g32,kivi4,kivi2,tq4,tq3.5,tq3,tq2.5,tq4_qjl,k8v4}
threads=${THREADS:-2}
mkdir -p "$out"
name=$(basename "$model" .gguf)
"$build/kvq" eval -m "$model" --kv "$formats" --ctx "$ctx" --chunks "$chunks" --data "$text" -t "$threads" \
  --json-out "$out/kvq-$name.json" --html "$out/kvq-$name.html" --no-progress | tee "$out/kvq-$name.txt"
if [[ -n "${LLAMA_PERPLEXITY:-}" ]]; then
  : >"$out/llamacpp-$name.txt"
  for c in ${ctx//,/ }; do
    base="$out/llamacpp-$name-$c-f16.kld"
    "$LLAMA_PERPLEXITY" -m "$model" -f "$text" -c "$c" --chunks "$chunks" -t "$threads" -fa on \
      --kl-divergence-base "$base" 2>&1 | grep -E "Final estimate" | sed "s/^/ctx $c f16: /" >>"$out/llamacpp-$name.txt"
    for kv in q8_0 q4_0; do
      "$LLAMA_PERPLEXITY" -m "$model" -f "$text" -c "$c" --chunks "$chunks" -t "$threads" -fa on -ctk "$kv" -ctv "$kv" \
        --kl-divergence-base "$base" --kl-divergence 2>&1 |
        grep -E "^(Mean PPL\(Q\)|Mean PPL\(base\)|Mean +KLD|99.0% +KLD|Same top p|PPL ratio)" | sed "s/^/ctx $c $kv: /" >>"$out/llamacpp-$name.txt"
    done
  done
  cat "$out/llamacpp-$name.txt"
fi
