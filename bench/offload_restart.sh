#!/usr/bin/env bash
# A restart of `kvq serve` with and without a persistent offload tier (--kv-offload-persist).
# DOCS documents (consecutive DOC_BYTES-byte chunks of TEXT) are each asked once, the server is
# stopped with SIGTERM and started again with the same flags, and each document is asked a second
# question: the time to its answer (max_tokens 1: the prefill and one token) is its time to first
# token after the restart. "cold": the tier is the default one (its file goes with the process), so
# the restarted server recomputes every document; "persist": the tier's file is kept, and the
# documents are read back from it. Each KV format runs cold then persist back to back.
# Also printed: the restarted server's start (launch to listening) and the first server's stop
# (SIGTERM to exit: persist writes the pool's cached pages to the tier then).
# usage: bench/offload_restart.sh BUILD MODEL.gguf TEXT
# env: FORMATS ("f16 q4_0"), DOCS (8), DOC_BYTES (4500), KV_MEM (48MiB), OFFLOAD (1GiB),
#      OFFLOAD_DIR (a new directory under $TMPDIR; give one on the device to measure), DIRECT (1:
#      --kv-offload-direct), THREADS (2), KVQ_ARGS (extra kvq serve flags)
set -u
[[ $# -eq 3 ]] || { echo "usage: $0 BUILD MODEL.gguf TEXT" >&2; exit 2; }
build=$1 model=$2 text=$3
kvq=$build/kvq
[[ -x $kvq ]] || { echo "error: $kvq not found or not executable" >&2; exit 2; }
[[ -f $model ]] || { echo "error: model $model not found" >&2; exit 2; }
[[ -s $text ]] || { echo "error: text file $text missing or empty" >&2; exit 2; }
for c in curl python3; do command -v $c >/dev/null || { echo "error: $c is needed" >&2; exit 2; }; done
formats=${FORMATS:-f16 q4_0}
docs=${DOCS:-8}
doc_bytes=${DOC_BYTES:-4500}
kv_mem=${KV_MEM:-48MiB}
offload=${OFFLOAD:-1GiB}
threads=${THREADS:-2}
direct=()
[[ ${DIRECT:-1} == 1 ]] && direct=(--kv-offload-direct)
work=$(mktemp -d)
tierdir=${OFFLOAD_DIR:-$work/tier}
pid=
trap '[[ -n $pid ]] && kill $pid 2>/dev/null; rm -rf "$work"' EXIT
mkdir -p "$tierdir"

# The request bodies: documents with a first and a second question.
python3 - "$text" "$docs" "$doc_bytes" "$work" <<'EOF'
import json, sys
text, n, size, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
data = open(text, encoding="utf-8", errors="replace").read()
if len(data) < n * size:
    sys.exit(f"error: {text} has {len(data)} characters, fewer than DOCS x DOC_BYTES = {n * size}")
for i in range(n):
    doc = data[i * size:(i + 1) * size]
    for q, question in enumerate(["What is the main point of this text?", "Who is the text addressed to?"]):
        body = {"prompt": f"{doc}\n\nQuestion: {question}\nAnswer:", "max_tokens": 1, "temperature": 0}
        with open(f"{out}/doc{i}.q{q}.json", "w") as f:
            json.dump(body, f)
EOF
[[ $? -eq 0 ]] || exit 2

now() { date +%s.%N; }
start() {  # start kvq serve with "$@"; sets pid, url, start_s
  local t0 port=
  t0=$(now)
  "$kvq" serve -m "$model" --port 0 -t "$threads" --kv-mem "$kv_mem" --kv-offload-dir "$tierdir" \
    --kv-offload-size "$offload" "${direct[@]}" ${KVQ_ARGS:-} "$@" 2>"$work/log" &
  pid=$!
  for _ in $(seq 600); do
    port=$(sed -n 's/.*http:\/\/[0-9.]*:\([0-9]*\).*/\1/p' "$work/log" | head -1)
    [[ -n $port ]] && break
    kill -0 $pid 2>/dev/null || { echo "error: kvq serve exited:" >&2; cat "$work/log" >&2; exit 1; }
    sleep 0.05
  done
  [[ -n $port ]] || { echo "error: kvq serve did not start" >&2; exit 1; }
  start_s=$(python3 -c "print(f'{$(now) - $t0:.2f}')")
  url=http://127.0.0.1:$port
}
stop() {  # SIGTERM, wait; sets stop_s
  local t0
  t0=$(now)
  kill -TERM $pid
  wait $pid
  pid=
  stop_s=$(python3 -c "print(f'{$(now) - $t0:.2f}')")
}
ask() {  # request body file -> seconds to the answer
  curl -s -o "$work/answer.json" -w '%{time_total}' "$url/v1/completions" -H 'Content-Type: application/json' \
    -d @"$1"
  grep -q '"choices"' "$work/answer.json" || { echo "error: bad answer: $(head -c 300 "$work/answer.json")" >&2; touch "$work/failed"; }
}
failed() { [[ -f $work/failed ]] && exit 1; }
median() { python3 -c "import statistics, sys; print(f'{statistics.median(float(x) for x in sys.argv[1:]):.3f}')" "$@"; }

printf '# %s, %s docs x %s bytes, KV %s, tier %s in %s%s, %s threads\n' "$(basename "$model")" "$docs" "$doc_bytes" \
  "$kv_mem" "$offload" "$tierdir" "${direct:+ (O_DIRECT)}" "$threads"
printf '%-6s %-8s %10s %10s %10s %10s %s\n' format tier "ttft_p50" "first_p50" "stop_s" "start_s" "ttft after restart (s)"
for fmt in $formats; do
  declare -A p50=()
  for mode in cold persist; do
    rm -rf "${tierdir:?}"/*
    flags=(--kv "$fmt")
    [[ $mode == persist ]] && flags+=(--kv-offload-persist)
    start "${flags[@]}"
    first=()
    for ((i = 0; i < docs; i++)); do first+=("$(ask "$work/doc$i.q0.json")"); done
    failed
    stop
    stopped=$stop_s
    start "${flags[@]}"
    after=()
    for ((i = 0; i < docs; i++)); do after+=("$(ask "$work/doc$i.q1.json")"); done
    failed
    curl -s "$url/metrics" >"$work/metrics"
    stop
    p50[$mode]=$(median "${after[@]}")
    printf '%-6s %-8s %10s %10s %10s %10s %s\n' "$fmt" "$mode" "${p50[$mode]}" "$(median "${first[@]}")" "$stopped" \
      "$start_s" "${after[*]}"
    grep -E '^kvq_kv_offload_(pages_at_start|loaded_pages_total|hit_tokens_total|read_seconds_total) ' "$work/metrics" |
      sed 's/^/    /'
  done
  python3 -c "print(f'{\"$fmt\":<6} ttft after a restart: cold / persist = {${p50[cold]} / ${p50[persist]}:.1f}x')"
  unset p50
done
