#!/usr/bin/env bash
# Serving side by side: `kvq serve` and llama.cpp's `llama-server` on the same GGUF, the same KV
# cache type and the same KV capacity in tokens, driven by the same client (bench/serve_load:
# streamed /v1/completions, greedy, end-of-sequence ignored so that both generate MAX_TOKENS per
# request). Each (type, concurrency) cell runs kvq then llama.cpp back to back, so they share the
# machine's drift.
# usage: bench/compare_llamacpp_serve.sh BUILD /path/to/llama-server MODEL.gguf PREFIX.txt
# env: FORMATS ("f16 q8_0 q4_0": names both engines take for -ctk / -ctv), CONCURRENCY ("1 8"),
#      KV_TOKENS (8192: kvq --kv-tokens, llama-server -c), LLAMA_KVU (0: llama-server's default
#      with -np N, each slot its own KV_TOKENS / N cells; 1: -kvu, one buffer shared by the slots,
#      whose attention then spans every slot's cells), MAX_TOKENS (32), REQ_FACTOR (2: requests = REQ_FACTOR x concurrency), THREADS
#      (2), TIMEOUT (300 s per run), the workload of serve_load: PREFIXES (1: the whole PREFIX.txt
#      is one shared prefix; N > 1: N distinct chunks of PREFIX_BYTES bytes), ORDER (rr), ROUNDS
#      (0: requests = max(REQ_FACTOR x concurrency, ROUNDS x PREFIXES)), LLAMA_ARGS (extra
#      llama-server flags), KVQ_ARGS (extra kvq serve flags).
# llama-server runs with -np = the concurrency (one slot per client), -fa on (a quantized V cache
# needs it), --cache-ram 0 (no host-memory prompt cache beyond the KV budget: both engines
# keep prefixes only in their KV cache) and its other defaults. kvq runs with its defaults.
set -u
[[ $# -eq 4 ]] || { echo "usage: $0 BUILD /path/to/llama-server MODEL.gguf PREFIX.txt" >&2; exit 2; }
build=$1 llama=$2 model=$3 prefix=$4
kvq=$build/kvq load=$build/bench/serve_load
[[ -x $load ]] || load=$build/serve_load
for f in "$kvq" "$load" "$llama"; do [[ -x $f ]] || { echo "error: $f not found or not executable" >&2; exit 2; }; done
[[ -f $model ]] || { echo "error: model $model not found" >&2; exit 2; }
[[ -s $prefix ]] || { echo "error: prefix file $prefix missing or empty" >&2; exit 2; }
command -v curl >/dev/null || { echo "error: curl is needed" >&2; exit 2; }
formats=${FORMATS:-f16 q8_0 q4_0}
concs=${CONCURRENCY:-1 8}
kv_tokens=${KV_TOKENS:-8192}
max_tokens=${MAX_TOKENS:-32}
req_factor=${REQ_FACTOR:-2}
threads=${THREADS:-2}
timeout=${TIMEOUT:-300}
prefixes=${PREFIXES:-1}
prefix_bytes=${PREFIX_BYTES:-0}
order=${ORDER:-rr}
rounds=${ROUNDS:-0}
kvu=-no-kvu
[[ ${LLAMA_KVU:-0} == 1 ]] && kvu=-kvu
tmp=$(mktemp -d)
pid=
trap '[[ -n $pid ]] && kill $pid 2>/dev/null; rm -rf "$tmp"' EXIT

free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# Waits until the server on $1 answers /health with 200 (llama-server: 503 while loading); 1 if it
# exited or took more than 120 s.
wait_ready() {
  for _ in $(seq 1200); do
    [[ $(curl -s -o /dev/null -w '%{http_code}' "http://127.0.0.1:$1/health") == 200 ]] && return 0
    kill -0 $pid 2>/dev/null || return 1
    sleep 0.1
  done
  return 1
}

# run ENGINE FMT CONC N: starts the engine's server, drives it, prints the load generator's --json
# line to $tmp/json.ENGINE (empty on failure, the reason in $tmp/why.ENGINE).
run() {
  local engine=$1 fmt=$2 c=$3 n=$4 port
  port=$(free_port)
  : >"$tmp/json.$engine"
  if [[ $engine == kvq ]]; then
    # shellcheck disable=SC2086
    "$kvq" serve -m "$model" --port "$port" -t "$threads" -ctk "$fmt" -ctv "$fmt" --kv-tokens "$kv_tokens" \
      ${KVQ_ARGS:-} 2>"$tmp/log.$engine" &
  else
    # shellcheck disable=SC2086
    "$llama" -m "$model" --port "$port" -t "$threads" -tb "$threads" -c "$kv_tokens" -np "$c" "$kvu" -fa on \
      -ctk "$fmt" -ctv "$fmt" --cache-ram 0 --no-webui ${LLAMA_ARGS:-} >"$tmp/log.$engine" 2>&1 &
  fi
  pid=$!
  if ! wait_ready "$port"; then
    echo "server did not start: $(tail -n 1 "$tmp/log.$engine")" >"$tmp/why.$engine"
    kill $pid 2>/dev/null; wait $pid 2>/dev/null; pid=
    return
  fi
  local t_run=$SECONDS
  "$load" --port "$port" --concurrency "$c" --requests "$n" --max-tokens "$max_tokens" --ignore-eos \
    --prefix-file "$prefix" --prefixes "$prefixes" --prefix-bytes "$prefix_bytes" --order "$order" \
    --seed 1 --timeout "$timeout" >"$tmp/load.$engine" 2>&1
  echo "# $engine $fmt conc $c: $((SECONDS - t_run)) s, load average $(cut -d' ' -f1-3 /proc/loadavg)" >&2
  grep '^error x' "$tmp/load.$engine" | sed "s/^/  $engine $fmt conc $c: /" >&2
  if ! kill -0 $pid 2>/dev/null; then
    wait $pid; echo "server exited (status $?) during the run: $(tail -n 2 "$tmp/log.$engine" | tr '\n' ' ')" >"$tmp/why.$engine"
    pid=
    return
  fi
  kill -TERM $pid; wait $pid 2>/dev/null; pid=
  sed -n 's/^--json //p' "$tmp/load.$engine" >"$tmp/json.$engine"
  [[ -s $tmp/json.$engine ]] || echo "load generator failed: $(tail -n 1 "$tmp/load.$engine")" >"$tmp/why.$engine"
}

printf '| KV | conc | requests | engine | ok | prompt tokens (mean) | tok/s | TTFT p50 ms | TTFT p95 ms | TPOT p50 ms | TPOT p95 ms |\n'
printf '|---|---|---|---|---|---|---|---|---|---|---|\n'
for fmt in $formats; do
  for c in $concs; do
    n=$((req_factor * c))
    (( rounds * prefixes > n )) && n=$((rounds * prefixes))
    for engine in kvq llama.cpp; do run "$engine" "$fmt" "$c" "$n"; done
    python3 - "$tmp" "$fmt" "$c" "$n" <<'PY'
import json, os, sys
tmp, fmt, c, n = sys.argv[1:]
res = {}
for e in ("kvq", "llama.cpp"):
    p = os.path.join(tmp, "json." + e)
    s = open(p).read().strip() if os.path.exists(p) else ""
    if s:
        res[e] = json.loads(s)
    else:
        why = open(os.path.join(tmp, "why." + e)).read().strip() if os.path.exists(os.path.join(tmp, "why." + e)) else "?"
        print(f"| {fmt} | {c} | {n} | {e} | {why} |")
f = lambda x: "n/a" if x is None else f"{x:.1f}"
for e, j in res.items():
    print(f"| {fmt} | {c} | {n} | {e} | {j['ok']}/{j['requests']} | {f(j.get('prompt_tokens_mean'))} | "
          f"{f(j['throughput_tok_s'])} | {f(j['ttft_ms_p50'])} | {f(j['ttft_ms_p95'])} | {f(j['tpot_ms_p50'])} | {f(j['tpot_ms_p95'])} |")
if len(res) == 2:
    k, l = res["kvq"], res["llama.cpp"]
    r = lambda a, b: "n/a" if not a or not b else f"{a / b:.2f}x"
    # throughput: kvq / llama.cpp; latencies: llama.cpp / kvq (both > 1 where kvq is better)
    print(f"| {fmt} | {c} | {n} | kvq vs llama.cpp | | | {r(k['throughput_tok_s'], l['throughput_tok_s'])} | "
          f"{r(l['ttft_ms_p50'], k['ttft_ms_p50'])} | {r(l['ttft_ms_p95'], k['ttft_ms_p95'])} | "
          f"{r(l['tpot_ms_p50'], k['tpot_ms_p50'])} | {r(l['tpot_ms_p95'], k['tpot_ms_p95'])} |")
PY
    rm -f "$tmp"/json.* "$tmp"/why.*
  done
done
