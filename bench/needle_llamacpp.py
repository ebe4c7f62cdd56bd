#!/usr/bin/env python3
"""Needle in a haystack on llama.cpp, on the very trials kvq eval ran.

kvq eval --task needle --needle-set-out SET.jsonl writes each trial (prompt text, passcode, the
answer length); this script gives every trial's prompt to llama.cpp's llama-completion (greedy,
--temp 0) once per KV cache type and counts a hit when the answer holds the passcode, as kvq
does. Each type is paired against llama.cpp's own f16 cache on the same trials (trials lost /
gained, exact sign test), which is how kvq eval reports its formats against its f16 cache: each
engine against its own reference, since two engines' arithmetic flips marginal trials.

    bench/needle_llamacpp.py --set SET.jsonl --model MODEL.gguf \\
        --llama-completion /path/to/llama-completion [--types f16,q8_0,q4_0,q4_0:norot] \\
        [--kvq-json KVQ_NEEDLE.json] [--threads 2] [--json-out OUT.json]

A type is K or K/V (llama.cpp spellings: f16, q8_0, q4_0, ...); the suffix ":norot" runs it with
LLAMA_ATTN_ROT_DISABLE=1 (llama.cpp rotates quantized caches by default). --kvq-json (the JSON
report of the kvq eval run that wrote the set) adds kvq's rows to the table. llama.cpp
tokenizes the prompt text itself; kvq's token ids are not passed, so a trial may differ from
kvq's by a token at the haystack's splice points.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile


def sign_test_p(a, b):
    """Two-sided exact sign test of a split a / b (kvq's eval_sign_test_p)."""
    n, k = a + b, min(a, b)
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2.0**n
    return min(1.0, 2 * tail)


def paired(ref, test):
    lost = sum(1 for r, t in zip(ref, test) if r and not t)
    gained = sum(1 for r, t in zip(ref, test) if t and not r)
    return lost, gained, sign_test_p(lost, gained)


def load_set(path):
    trials = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                t = json.loads(line)
            except json.JSONDecodeError as e:
                sys.exit(f"{path}:{n}: not JSON ({e})")
            if not isinstance(t, dict) or not isinstance(t.get("prompt"), str) or not isinstance(t.get("expected"), str):
                sys.exit(f"{path}:{n}: needs string fields \"prompt\" and \"expected\" (kvq eval --needle-set-out)")
            trials.append(t)
    if not trials:
        sys.exit(f"{path}: no trials")
    return trials


def run_trial(args, spec, trial, tmpdir):
    kv, _, opt = spec.partition(":")
    if opt not in ("", "norot"):
        sys.exit(f"--types: '{spec}': the only option is ':norot'")
    k, _, v = kv.partition("/")
    v = v or k
    prompt = os.path.join(tmpdir, "prompt.txt")
    with open(prompt, "w", encoding="utf-8") as f:
        f.write(trial["prompt"])
    n_predict = int(trial.get("max_tokens", 10))
    ctx = int(trial.get("ctx", 4096)) + n_predict + 16
    cmd = [args.llama_completion, "-m", args.model, "-f", prompt, "-n", str(n_predict), "--temp", "0",
           "-c", str(ctx), "-ctk", k, "-ctv", v, "-fa", "on", "-no-cnv", "--no-display-prompt",
           "--simple-io", "--no-warmup", "-t", str(args.threads)]
    env = dict(os.environ)
    if opt == "norot":
        env["LLAMA_ATTN_ROT_DISABLE"] = "1"
    else:
        env.pop("LLAMA_ATTN_ROT_DISABLE", None)
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        sys.exit(f"llama-completion failed ({r.returncode}) for type {spec}:\n{r.stderr[-2000:]}")
    return r.stdout


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--set", required=True, help="JSONL written by kvq eval --needle-set-out")
    ap.add_argument("--model", required=True, help="the GGUF kvq ran")
    ap.add_argument("--llama-completion", default=os.environ.get("LLAMA_COMPLETION"),
                    help="llama.cpp's llama-completion binary (or LLAMA_COMPLETION)")
    ap.add_argument("--types", default="f16,q8_0,q4_0,q4_0:norot", help="KV types; f16 is the reference")
    ap.add_argument("--kvq-json", help="kvq eval's JSON report of the run that wrote the set")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json-out", help="write the per-trial outcomes here")
    args = ap.parse_args()
    if not args.llama_completion or not os.access(args.llama_completion, os.X_OK):
        sys.exit("--llama-completion (or LLAMA_COMPLETION) must name an executable llama-completion")
    if not os.path.isfile(args.model):
        sys.exit(f"--model: '{args.model}' not found")
    trials = load_set(args.set)
    types = [t for t in args.types.split(",") if t]
    if "f16" in types:
        types.remove("f16")
    types.insert(0, "f16")

    results = {}
    with tempfile.TemporaryDirectory() as tmpdir:
        for spec in types:
            outs = []
            for i, t in enumerate(trials):
                ans = run_trial(args, spec, t, tmpdir)
                outs.append({"ctx": t.get("ctx"), "depth": t.get("depth"), "trial": t.get("trial"),
                             "answer": ans, "ok": t["expected"] in ans})
                print(f"\r{spec}: {i + 1}/{len(trials)}", end="", file=sys.stderr, flush=True)
            print(file=sys.stderr)
            results[spec] = outs

    ref = [o["ok"] for o in results["f16"]]
    n = len(trials)
    print(f"llama.cpp ({os.path.basename(args.llama_completion)}), {n} trials of {os.path.basename(args.set)}")
    print("| engine | KV | found | lost vs its f16 | gained | sign test p |")
    print("|---|---|---|---|---|---|")
    for spec in types:
        ok = [o["ok"] for o in results[spec]]
        if spec == "f16":
            print(f"| llama.cpp | f16 | {sum(ok)}/{n} | - | - | - |")
        else:
            lost, gained, p = paired(ref, ok)
            print(f"| llama.cpp | {spec} | {sum(ok)}/{n} | {lost} | {gained} | {p:.3g} |")
    if args.kvq_json:
        with open(args.kvq_json, encoding="utf-8") as f:
            rep = json.load(f)
        fmts = [x for x in rep.get("formats", []) if "needle" in x]
        if fmts:
            kref = fmts[0]["needle_f16_ok"]
            print(f"| kvq | f16 | {sum(kref)}/{len(kref)} | - | - | - |")
            for x in fmts:
                ok = [e["ok"] for e in x["needle"]["grid"]]
                v = x["needle"]["vs_f16"]
                print(f"| kvq | {x['format']} | {sum(ok)}/{len(ok)} | {v['lost']} | {v['gained']} | {v['p_value']:.3g} |")
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump({"set": args.set, "model": args.model, "types": results}, f, indent=1)


if __name__ == "__main__":
    main()
