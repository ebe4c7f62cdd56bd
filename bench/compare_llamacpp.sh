#!/usr/bin/env bash
# kvq vs llama.cpp on the same GGUF, in the same run: prompt processing (pp512) and decode
# (tg128) tokens/s at 1 and 2 threads, and the ratio kvq / llama.cpp. Medians of --reps runs
# (llama-bench reports means; its own repetitions are interleaved with kvq's by model).
#
#   bench/compare_llamacpp.sh BUILD_DIR LLAMA_BENCH MODEL.gguf [MODEL.gguf ...]
#
# LLAMA_BENCH is a llama-bench binary built separately (llama.cpp is not part of kvq). The
# machine should be otherwise idle: both engines are memory- and compute-bound. The load average
# is printed before and after each model: on a shared machine only the ratio of the same run
# means anything, and only when the load stayed put.
set -euo pipefail
build=$1; llama_bench=$2; shift 2
reps=${REPS:-3}
threads=${THREADS:-1,2}
for model in "$@"; do
  echo "== $(basename "$model")  (load average before: $(cut -d' ' -f1-3 /proc/loadavg))"
  kvq_json=$("$build/bench/model_speed" "$model" --pp 512 --tg 128 --threads "$threads" --reps "$reps" --json)
  ll_json=$("$llama_bench" -m "$model" -p 512 -n 128 -t "$threads" -r "$reps" -o json 2>/dev/null)
  python3 - "$kvq_json" "$ll_json" <<'PY'
import json, sys
kvq = [json.loads(l) for l in sys.argv[1].splitlines() if l.strip()]
ll = json.loads(sys.argv[2])
def llama(nt, kind):
    for r in ll:
        if r["n_threads"] == nt and ((kind == "pp" and r["n_prompt"] > 0 and r["n_gen"] == 0) or (kind == "tg" and r["n_gen"] > 0 and r["n_prompt"] == 0)):
            return r["avg_ts"]
    return float("nan")
print(f"{'threads':>7} {'test':>6} {'kvq t/s':>10} {'llama.cpp t/s':>14} {'ratio':>7}  decode GB/s (% of measured read bw)")
for k in kvq:
    nt = k["threads"]
    for kind, key in (("pp512", "pp_tps"), ("tg128", "tg_tps")):
        l = llama(nt, kind[:2])
        extra = f"  {k['tg_gbs']:.2f} ({100*k['tg_gbs']/k['read_bw_gbs']:.0f}% of {k['read_bw_gbs']:.1f})" if kind == "tg128" else ""
        print(f"{nt:>7} {kind:>6} {k[key]:>10.1f} {l:>14.1f} {k[key]/l:>6.2f}x{extra}")
PY
  echo "   (load average after: $(cut -d' ' -f1-3 /proc/loadavg))"
done
