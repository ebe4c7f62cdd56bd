# Sourced by the CLI tests (tests/cli/*.sh, run by ctest as `bash SCRIPT KVQ_BINARY SOURCE_DIR`):
# their arguments, the tiny real model and text from ../shared, a scratch directory removed on
# exit, and the check / skip / finish helpers.
kvq=$1
src=$2
model=$src/../shared/models/stories260K.gguf
text=$src/../shared/data/tinyshakespeare.txt
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fails=0
# check NAME CONDITION: CONDITION (a bash expression) must hold.
check() { if ! eval "$2"; then echo "FAIL: $1"; fails=$((fails + 1)); else echo "ok: $1"; fi; }
# require FILE...: skip the test (exit 77, ctest's SKIP_RETURN_CODE) when a file is absent.
require() { local f; for f; do [[ -f $f ]] || { echo "skip: $f not found"; exit 77; }; done; }
# finish NAME: the exit status: 1 when any check failed.
finish() { [[ $fails -eq 0 ]] || { echo "$fails check(s) failed"; exit 1; }; echo "all $1 checks passed"; }
# anthropic_python: the same for Anthropic's official `anthropic` client ($KVQ_ANTHROPIC_VENV,
# default $TMPDIR/kvq-anthropic-venv).
anthropic_python() {
  local venv=${KVQ_ANTHROPIC_VENV:-${TMPDIR:-/tmp}/kvq-anthropic-venv}
  if [[ ! -x $venv/bin/python ]] || ! "$venv/bin/python" -c 'import anthropic' 2>/dev/null; then
    python3 -m venv "$venv" >/dev/null 2>&1 && "$venv/bin/pip" install -q anthropic >/dev/null 2>&1
  fi
  "$venv/bin/python" -c 'import anthropic' 2>/dev/null && echo "$venv/bin/python"
}
# openai_python: the python of a venv with the official `openai` client ($KVQ_OPENAI_VENV, default
# $TMPDIR/kvq-openai-venv, made once and reused); prints nothing when pip cannot install it.
openai_python() {
  local venv=${KVQ_OPENAI_VENV:-${TMPDIR:-/tmp}/kvq-openai-venv}
  if [[ ! -x $venv/bin/python ]] || ! "$venv/bin/python" -c 'import openai' 2>/dev/null; then
    python3 -m venv "$venv" >/dev/null 2>&1 && "$venv/bin/pip" install -q openai >/dev/null 2>&1
  fi
  "$venv/bin/python" -c 'import openai' 2>/dev/null && echo "$venv/bin/python"
}
# serve_model MODEL [ARGS...]: starts `kvq serve -m MODEL --port 0 ARGS...` in the background (its
# log in $tmp/log, stopped on exit) and waits for it: sets pid, port and url.
serve_model() {
  local m=$1
  shift
  unset KVQ_API_KEY
  "$kvq" serve -m "$m" --port 0 "$@" 2>"$tmp/log" &
  pid=$!
  trap '[[ -n $pid ]] && kill $pid 2>/dev/null; rm -rf "$tmp"' EXIT
  port=
  for _ in $(seq 200); do
    port=$(sed -n 's|.*serving .* on http://127.0.0.1:\([0-9]*\).*|\1|p' "$tmp/log")
    [[ -n $port ]] && break
    sleep 0.1
  done
  check "server reports its port" "[[ -n '$port' ]]"
  url=http://127.0.0.1:$port
}
