#!/usr/bin/env bash
# Speculative decoding by prompt lookup (`kvq run --draft-max N`) against plain decoding, same
# model, same prompt, same run: decode tokens/s (medians of REPS runs), the ratio to --draft-max 0,
# the share of drafted tokens kept, and whether the text equals plain decoding's (greedy).
#
#   bench/speculative.sh BUILD_DIR MODEL.gguf PROMPT.txt [PROMPT.txt ...]
#
# Env: DRAFTS (default "0 4 8 16"), REPS (3), N (tokens, 150), THREADS (2), ARGS (more kvq run flags,
# e.g. "--json-schema bench/prompts/contact.schema.json"). Prompts are chat turns (--chat);
# bench/prompts/ has an edit that copies its input (fix_spelling), a rewrite of code
# (add_docstring), free writing (story) and an extraction into JSON (extract_contact, with
# contact.schema.json).
set -euo pipefail
build=$1; model=$2; shift 2
drafts=${DRAFTS:-"0 4 8 16"}
reps=${REPS:-3}
n=${N:-150}
threads=${THREADS:-2}
read -r -a extra <<<"${ARGS:-}"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for prompt in "$@"; do
  echo "== $(basename "$prompt")  (load average: $(cut -d' ' -f1-3 /proc/loadavg))"
  printf '%8s %12s %7s %16s %10s\n' draft "tokens/s" ratio "drafts kept" "same text"
  base=""
  for d in $drafts; do
    speeds=()
    for ((r = 0; r < reps; ++r)); do
      "$build/kvq" run -m "$model" --chat -f "$prompt" -n "$n" --temp 0 -t "$threads" --draft-max "$d" "${extra[@]}" >"$tmp/out_$d" 2>"$tmp/err"
      speeds+=("$(sed -n 's/.*decode: .*(\([0-9.]*\) tokens\/s).*/\1/p' "$tmp/err")")
    done
    med=$(printf '%s\n' "${speeds[@]}" | sort -g | sed -n "$(( (reps + 1) / 2 ))p")
    [[ -z "$base" ]] && base=$med
    kept=$(sed -n 's/.*speculative: .* \([0-9]* of [0-9]*\) drafted tokens kept (\([0-9.]*%\)).*/\1 (\2)/p' "$tmp/err")
    same=$(cmp -s "$tmp/out_$d" "$tmp/out_0" 2>/dev/null && echo yes || echo no)
    printf '%8s %12s %7s %16s %10s\n' "$d" "$med" "$(python3 -c "print(f'{$med/$base:.2f}x')")" "${kept:--}" "$same"
  done
done
