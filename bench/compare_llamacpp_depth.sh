#!/usr/bin/env bash
# Decode speed at depth, per KV cache format: kvq vs llama.cpp on the same GGUF, in the same run.
# tg128 after a context of DEPTH tokens (llama-bench -d), tokens/s, for each KV format both
# engines have (llama.cpp with flash attention, which it needs for a quantized V cache), and for
# kvq's own formats on their own (no llama.cpp counterpart). The ratio that matters for choosing a
# format is each engine's quantized format against its own f16 at the same depth; the kvq /
# llama.cpp column compares the engines format by format.
#
#   bench/compare_llamacpp_depth.sh BUILD_DIR LLAMA_BENCH MODEL.gguf [MODEL.gguf ...]
#
# Environment: DEPTHS (default 4096), THREADS (default 1), REPS (default 3), SHARED (formats of
# both engines, default "f16 q8_0 q4_0"), KVQ_ONLY (default "int8 int4 kivi4 int2t_g64"), PP
# (default 0: none; N: also prompt processing of N tokens after the context, llama-bench's
# pp N @ dDEPTH, printed as a second table: a long conversation's next prompt).
# LLAMA_BENCH is a llama-bench binary built separately (llama.cpp is not part of kvq). kvq runs
# each format right before llama.cpp runs the same one, and the load average is printed per
# model: on a shared machine only ratios from the same run mean anything.
set -euo pipefail
build=$1; llama_bench=$2; shift 2
reps=${REPS:-3}
threads=${THREADS:-1}
depths=${DEPTHS:-4096}
shared=${SHARED:-"f16 q8_0 q4_0"}
kvq_only=${KVQ_ONLY:-"int8 int4 kivi4 int2t_g64"}
pp=${PP:-0}
tg=128
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
for model in "$@"; do
  echo "== $(basename "$model")  (load average before: $(cut -d' ' -f1-3 /proc/loadavg))"
  rows=()
  for depth in ${depths//,/ }; do
    for fmt in $shared $kvq_only; do
      k=$("$build/bench/model_speed" "$model" --pp "$pp" --tg $tg --depth "$depth" --threads "$threads" --reps "$reps" --kv "$fmt" --json)
      l="[]"
      if [[ " $shared " == *" $fmt "* ]]; then
        l=$("$llama_bench" -m "$model" -p "$pp" -n $tg -d "$depth" -t "$threads" -r "$reps" -ctk "$fmt" -ctv "$fmt" -fa 1 -o json 2>/dev/null)
      fi
      rows+=("$(python3 -c 'import json,sys; print(json.dumps({"fmt": sys.argv[1], "depth": int(sys.argv[2]), "kvq": [json.loads(x) for x in sys.argv[3].splitlines() if x.strip()], "ll": json.loads(sys.argv[4])}))' "$fmt" "$depth" "$k" "$l")")
    done
  done
  printf '%s\n' "${rows[@]}" > "$tmp"
  python3 - "$tmp" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
def ll_ts(r, nt, test="tg"):
    for x in r["ll"]:
        if x["n_threads"] == nt and (x["n_gen"] > 0 if test == "tg" else x["n_prompt"] > 0 and x["n_gen"] == 0):
            return x["avg_ts"]
    return None
def f(x, w, p=1, suf=""):
    return f"{x:>{w}.{p}f}{suf}" if x else f"{'-':>{w + len(suf)}}"
base = {}
for r in rows:
    for k in r["kvq"]:
        if r["fmt"] == "f16":
            base[(r["depth"], k["threads"])] = (k["tg_tps"], ll_ts(r, k["threads"]))
print(f"{'depth':>6} {'threads':>7} {'KV':>10} {'kvq t/s':>9} {'x kvq f16':>9} {'llama.cpp t/s':>14} "
      f"{'x llama f16':>11} {'kvq/llama':>9}  kvq decode GB/s (% bw)")
for r in rows:
    for k in r["kvq"]:
        nt, d = k["threads"], r["depth"]
        kf, lf = base.get((d, nt), (None, None))
        l = ll_ts(r, nt)
        print(f"{d:>6} {nt:>7} {r['fmt']:>10} {k['tg_tps']:>9.1f} {f(k['tg_tps'] / kf if kf else None, 8, 2, 'x')} "
              f"{f(l, 14)} {f(l / lf if l and lf else None, 10, 2, 'x')} {f(k['tg_tps'] / l if l else None, 8, 2, 'x')}  "
              f"{k['tg_gbs']:.2f} ({100 * k['tg_gbs'] / k['read_bw_gbs']:.0f}%)")
if any(k["pp"] > 0 for r in rows for k in r["kvq"]):
    pbase = {}
    for r in rows:
        for k in r["kvq"]:
            if r["fmt"] == "f16":
                pbase[(r["depth"], k["threads"])] = (k["pp_tps"], ll_ts(r, k["threads"], "pp"))
    print(f"\n{'depth':>6} {'threads':>7} {'KV':>10} {'kvq pp t/s':>10} {'x kvq f16':>9} {'llama.cpp pp t/s':>16} "
          f"{'x llama f16':>11} {'kvq/llama':>9}")
    for r in rows:
        for k in r["kvq"]:
            nt, d = k["threads"], r["depth"]
            kf, lf = pbase.get((d, nt), (None, None))
            l = ll_ts(r, nt, "pp")
            print(f"{d:>6} {nt:>7} {r['fmt']:>10} {k['pp_tps']:>10.1f} {f(k['pp_tps'] / kf if kf else None, 8, 2, 'x')} "
                  f"{f(l, 16)} {f(l / lf if l and lf else None, 10, 2, 'x')} {f(k['pp_tps'] / l if l else None, 8, 2, 'x')}")
PY
  echo "   (load average after: $(cut -d' ' -f1-3 /proc/loadavg))"
done
