#!/usr/bin/env bash
# Serving under a fixed KV budget: for each KV format x client concurrency, start `kvq serve` with
# the same --kv-mem, drive it with serve_load (a shared long prefix + a distinct short question per
# request, streamed), then read the server's own counters from /metrics.
# usage: bench/serve_bench.sh BUILD MODEL.gguf PREFIX.txt
# env: FORMATS ("f16 int8 q4_0"), CONCURRENCY ("1 8 32"), KV_MEM (48MiB), MAX_TOKENS (16),
#      REQ_FACTOR (2: requests = REQ_FACTOR x concurrency), THREADS (2), TIMEOUT (120 s per run)
#      multi-prefix workload: PREFIXES (1: the whole PREFIX.txt is the one shared prefix; N > 1: N
#      distinct chunks of PREFIX_BYTES bytes from evenly spaced offsets of PREFIX.txt), ORDER (rr:
#      request i uses prefix i mod N; random: seeded), ROUNDS (0: requests = max(REQ_FACTOR x
#      concurrency, ROUNDS x PREFIXES), so every prefix recurs ROUNDS times)
# Per-run wall time and the load average go to stderr.
set -u
[[ $# -eq 3 ]] || { echo "usage: $0 BUILD MODEL.gguf PREFIX.txt" >&2; exit 2; }
build=$1 model=$2 prefix=$3
kvq=$build/kvq load=$build/bench/serve_load
[[ -x $load ]] || load=$build/serve_load
for f in "$kvq" "$load"; do [[ -x $f ]] || { echo "error: $f not built" >&2; exit 2; }; done
[[ -f $model ]] || { echo "error: model $model not found" >&2; exit 2; }
[[ -s $prefix ]] || { echo "error: prefix file $prefix missing or empty" >&2; exit 2; }
formats=${FORMATS:-f16 int8 q4_0}
concs=${CONCURRENCY:-1 8 32}
kv_mem=${KV_MEM:-48MiB}
max_tokens=${MAX_TOKENS:-16}
req_factor=${REQ_FACTOR:-2}
threads=${THREADS:-2}
timeout=${TIMEOUT:-120}
prefixes=${PREFIXES:-1}
prefix_bytes=${PREFIX_BYTES:-0}
order=${ORDER:-rr}
rounds=${ROUNDS:-0}
tmp=$(mktemp -d)
pid=
trap '[[ -n $pid ]] && kill $pid 2>/dev/null; rm -rf "$tmp"' EXIT

metric() { awk -v n="$1" '$1 == n { print $2; exit }' "$tmp/metrics"; }

printf '| KV | conc | requests | ok | empty | tok/s | TTFT p50 ms | TTFT p95 ms | TPOT p50 ms | TPOT p95 ms | KV capacity tok | prefix hit rate | preemptions |\n'
printf '|---|---|---|---|---|---|---|---|---|---|---|---|---|\n'
for fmt in $formats; do
  for c in $concs; do
    n=$((req_factor * c))
    (( rounds * prefixes > n )) && n=$((rounds * prefixes))
    "$kvq" serve -m "$model" --port 0 -t "$threads" --kv "$fmt" --kv-mem "$kv_mem" 2>"$tmp/log" &
    pid=$!
    port=
    for _ in $(seq 300); do
      port=$(sed -n 's|.*serving .* on http://127.0.0.1:\([0-9]*\).*|\1|p' "$tmp/log")
      [[ -n $port ]] && break
      kill -0 $pid 2>/dev/null || break
      sleep 0.1
    done
    if [[ -z $port ]]; then
      echo "| $fmt | $c | server did not start: $(tail -n 1 "$tmp/log") |"
      wait $pid 2>/dev/null; pid=
      continue
    fi
    t_run=$SECONDS
    "$load" --port "$port" --concurrency "$c" --requests "$n" --max-tokens "$max_tokens" \
      --prefix-file "$prefix" --prefixes "$prefixes" --prefix-bytes "$prefix_bytes" --order "$order" \
      --seed 1 --timeout "$timeout" >"$tmp/load" 2>&1
    echo "# $fmt conc $c: $((SECONDS - t_run)) s, load average $(cut -d' ' -f1-3 /proc/loadavg)" >&2
    curl -s "http://127.0.0.1:$port/metrics" >"$tmp/metrics"
    if ! kill -0 $pid 2>/dev/null; then
      wait $pid; rc=$?; pid=
      echo "| $fmt | $c | server exited (status $rc) during the run: $(grep -v '^\[kvq\] serving' "$tmp/log" | tail -n 2 | tr '\n' ' ') |"
      continue
    fi
    kill -TERM $pid; wait $pid 2>/dev/null; pid=
    if [[ ! -s $tmp/metrics ]]; then echo "| $fmt | $c | no /metrics from the server |"; continue; fi
    j=$(sed -n 's/^--json //p' "$tmp/load")
    if [[ -z $j ]]; then echo "| $fmt | $c | load generator failed: $(tail -n 1 "$tmp/load") |"; continue; fi
    grep '^error x' "$tmp/load" | sed "s/^/  $fmt conc $c: /" >&2
    q=$(metric kvq_prefix_cache_queries_total) h=$(metric kvq_prefix_cache_hits_total)
    cap=$(metric kvq_kv_cache_tokens_capacity) pre=$(metric kvq_preemptions_total)
    rate=$(awk -v h="${h:-0}" -v q="${q:-0}" 'BEGIN { if (q > 0) printf "%.2f", h / q; else print "n/a" }')
    python3 - "$j" "$fmt" "$c" "$cap" "$rate" "$pre" <<'PY'
import json, sys
j = json.loads(sys.argv[1]); fmt, c, cap, rate, pre = sys.argv[2:]
f = lambda k: "n/a" if j[k] is None else f"{j[k]:.1f}"
print(f"| {fmt} | {c} | {j['requests']} | {j['ok']} | {j['empty']} | {f('throughput_tok_s')} | {f('ttft_ms_p50')} | {f('ttft_ms_p95')} "
      f"| {f('tpot_ms_p50')} | {f('tpot_ms_p95')} | {float(cap):.0f} | {rate} | {float(pre):.0f} |")
PY
  done
done
