#!/usr/bin/env python3
"""Golden references for kvq's forward-pass tests, from an implementation independent of kvq.

The GGUF is loaded with Hugging Face transformers (`gguf_file=`), which dequantizes every weight to
float32 torch tensors and runs its own model code (LlamaForCausalLM / Gemma3ForCausalLM) in float32.
Tokens come from the tokenizer transformers builds from the GGUF's vocabulary.

For each prompt the JSON records:
  - token_ids: prompt tokens, BOS prepended the way llama.cpp does for that model
    (SmolLM2: tokenizer.ggml.add_bos_token=false -> no BOS; Gemma 3: add_bos_token=true -> <bos>=2)
  - positions: the last 4 prompt positions, each with the top-64 (id, logit) pairs, the logsumexp
    over the full vocabulary and the logits of a few fixed ids
  - greedy: 40 tokens of argmax continuation (EOS is not special: a forward-pass test compares every
    step), with each step's top-1 minus top-2 logit margin so that a test can tell a real divergence
    from a near-tie flipped by rounding (quantized engines round activations differently)

Optionally (--llama-cpp-python PY) the same token ids are run through llama.cpp (llama-cpp-python,
in another venv, as a subprocess) to record how far a second engine is from this reference and
whether llama.cpp's tokenizer agrees with transformers' on these prompts. That comparison is
metadata only; the golden values are the transformers ones.

Usage (reference venv with torch (CPU is enough), transformers, gguf, sentencepiece, protobuf):
  /tmp/refvenv/bin/python scripts/make_golden.py --models-dir models \
      [--llama-cpp-python /path/to/venv/bin/python] [--only smollm2|gemma3]
"""

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time

N_LAST_POSITIONS = 4
TOP_K = 64
N_GREEDY = 40

# Prompts are fixed: changing one changes the golden file, and tests compare against it.
PROMPT_SHORT = "The capital of France is"
PROMPT_PARAGRAPH = (
    "The lighthouse stood at the edge of the cliff for more than two hundred years. Every night its "
    "keeper climbed the narrow spiral stairs, trimmed the wick, and polished the great glass lens until "
    "it shone. Ships passing through the strait relied on its steady beam to avoid the rocks hidden "
    "beneath the waves. When the old keeper finally retired, the village worried that nobody would take "
    "his place, but a young woman from the harbor volunteered, and she kept the light burning through "
    "the worst storms anyone could remember."
)
PROMPT_DIGITS = (
    "Invoice #4471-B (2024-03-15): 3 x $19.99 = $59.97; tax 8.25% -> $4.95. "
    "Total: $64.92! Pay by 09:30, or call +1 (555) 010-0042... ok?"
)
CHAT_USER = "What is the boiling point of water at sea level, in Celsius?"
# ChatML as rendered by SmolLM2's own chat template (GGUF tokenizer.chat_template, which adds this
# default system message when none is given); checked against the template below.
PROMPT_CHATML = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\n" + CHAT_USER + "<|im_end|>\n<|im_start|>assistant\n"
)
PROMPT_GEMMA_TURN = (
    "<start_of_turn>user\n" + CHAT_USER + "<end_of_turn>\n<start_of_turn>model\n"
)

MODELS = {
    "smollm2": {
        "name": "SmolLM2-135M-Instruct",
        "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "sha256": "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        "out": "forward_smollm2_135m.json",
        "prompts": [("short", PROMPT_SHORT), ("paragraph", PROMPT_PARAGRAPH),
                    ("digits", PROMPT_DIGITS), ("chatml", PROMPT_CHATML)],
    },
    "gemma3": {
        "name": "gemma-3-270m",
        "file": "gemma-3-270m-q4_k_m.gguf",
        "sha256": "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "out": "forward_gemma3_270m.json",
        "prompts": [("short", PROMPT_SHORT), ("paragraph", PROMPT_PARAGRAPH),
                    ("digits", PROMPT_DIGITS), ("gemma_turn", PROMPT_GEMMA_TURN)],
    },
}


def sha256_file(path):
    import hashlib
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def gguf_kv(path):
    """The few metadata values the golden depends on, read with the gguf package."""
    import gguf
    r = gguf.GGUFReader(path)
    out = {}
    for key in ("general.architecture", "tokenizer.ggml.add_bos_token", "tokenizer.ggml.bos_token_id",
                "tokenizer.ggml.eos_token_id", "tokenizer.chat_template"):
        f = r.fields.get(key)
        if f is not None:
            out[key] = f.contents()
    return out


def check_chatml(template):
    """PROMPT_CHATML must be what the model's own chat template renders for one user message."""
    import jinja2
    env = jinja2.Environment()
    rendered = env.from_string(template).render(
        messages=[{"role": "user", "content": CHAT_USER}], add_generation_prompt=True)
    if rendered != PROMPT_CHATML:
        raise SystemExit("chat template renders differently from PROMPT_CHATML:\n%r\n%r"
                         % (rendered, PROMPT_CHATML))


def position_record(logits_row, pos, fixed_ids):
    import torch
    row = logits_row.double()
    vals, ids = torch.topk(row, TOP_K)
    return {
        "pos": pos,
        "top": [[int(i), round(float(v), 5)] for v, i in zip(vals, ids)],
        "logsumexp": round(float(torch.logsumexp(row, 0)), 5),
        "fixed": {str(i): round(float(row[i]), 5) for i in fixed_ids},
    }


def run_reference(model, ids, fixed_ids):
    import torch
    with torch.no_grad():
        x = torch.tensor([ids], dtype=torch.long)
        out = model(input_ids=x, use_cache=True)
        logits = out.logits[0].float()  # (n_tok, n_vocab)
        n = len(ids)
        positions = [position_record(logits[p], p, fixed_ids)
                     for p in range(max(0, n - N_LAST_POSITIONS), n)]
        full_last = logits[max(0, n - N_LAST_POSITIONS):].clone()  # for the cross-check

        past = out.past_key_values
        last = logits[-1]
        greedy_ids, margins, top1 = [], [], []
        for _ in range(N_GREEDY):
            v, i = torch.topk(last.double(), 2)
            tok = int(i[0])
            greedy_ids.append(tok)
            margins.append(round(float(v[0] - v[1]), 5))
            top1.append(round(float(v[0]), 5))
            out = model(input_ids=torch.tensor([[tok]]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            last = out.logits[0, -1].float()
    return positions, full_last, greedy_ids, margins, top1


# Runs inside the llama-cpp-python venv: reads a JSON job on stdin, writes logits as .npy files.
LLAMA_CPP_CHILD = r"""
import json, sys, numpy as np, llama_cpp
job = json.load(sys.stdin)
llm = llama_cpp.Llama(model_path=job["model"], n_ctx=1024, n_batch=1024, n_threads=2,
                      logits_all=True, verbose=False)
res = {"llama_cpp_python": llama_cpp.__version__, "prompts": []}
for k, (text, ids) in enumerate(zip(job["texts"], job["ids"])):
    # add_bos=True means add_special: llama.cpp then adds BOS only when the model's metadata asks.
    toks = llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)
    llm.reset()
    llm.eval(ids)
    n = len(ids)
    np.save("%s/logits_%d.npy" % (job["tmp"], k), np.asarray(llm.scores[max(0, n - 4):n], dtype=np.float32))
    greedy = []
    for _ in range(job["n_greedy"]):
        t = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        greedy.append(t)
        llm.eval([t])
    res["prompts"].append({"tokens": [int(t) for t in toks], "greedy": greedy})
json.dump(res, sys.stdout)
"""


def llama_cpp_compare(py, model_path, texts, ids_list, full_lasts, greedy_lists, margins_list):
    import numpy as np
    with tempfile.TemporaryDirectory() as tmp:
        job = {"model": model_path, "texts": texts, "ids": ids_list, "tmp": tmp, "n_greedy": N_GREEDY}
        p = subprocess.run([py, "-c", LLAMA_CPP_CHILD], input=json.dumps(job), capture_output=True,
                           text=True)
        if p.returncode != 0:
            raise SystemExit("llama-cpp-python cross-check failed:\n" + p.stderr[-3000:])
        res = json.loads(p.stdout)
        per_prompt = []
        for k in range(len(texts)):
            lc = np.load("%s/logits_%d.npy" % (tmp, k)).astype(np.float64)
            ref = full_lasts[k].double().numpy()
            diff = np.abs(lc - ref)
            lse_ref = np.log(np.exp(ref - ref.max(1, keepdims=True)).sum(1)) + ref.max(1)
            lse_lc = np.log(np.exp(lc - lc.max(1, keepdims=True)).sum(1)) + lc.max(1)
            p_ref = np.exp(ref - lse_ref[:, None])
            kl = (p_ref * ((ref - lse_ref[:, None]) - (lc - lse_lc[:, None]))).sum(1)
            g_ref, g_lc = greedy_lists[k], res["prompts"][k]["greedy"]
            first_div = next((i for i, (a, b) in enumerate(zip(g_ref, g_lc)) if a != b), None)
            per_prompt.append({
                "tokens_equal": res["prompts"][k]["tokens"] == ids_list[k],
                "llama_cpp_tokens": res["prompts"][k]["tokens"],
                "max_abs_logit_diff_last4": round(float(diff.max()), 4),
                "mean_abs_logit_diff_last4": round(float(diff.mean()), 5),
                "kl_ref_to_llama_cpp_last4": [round(float(x), 6) for x in kl],
                "argmax_equal_last4": [bool(a == b) for a, b in zip(lc.argmax(1), ref.argmax(1))],
                "greedy_first_divergence": first_div,
                "greedy_margin_at_divergence": None if first_div is None else margins_list[k][first_div],
                "llama_cpp_greedy": g_lc,
            })
        return res["llama_cpp_python"], per_prompt


def make_one(key, args):
    import numpy
    import torch
    import transformers
    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = MODELS[key]
    path = os.path.join(args.models_dir, spec["file"])
    if not os.path.exists(path):
        raise SystemExit("%s not found (run scripts/get-models.sh)" % path)
    digest = sha256_file(path)
    if digest != spec["sha256"]:
        raise SystemExit("%s: sha256 %s, expected %s" % (path, digest, spec["sha256"]))

    meta = gguf_kv(path)
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    bos_id = int(meta["tokenizer.ggml.bos_token_id"])
    eos_id = int(meta["tokenizer.ggml.eos_token_id"])
    if key == "smollm2":
        check_chatml(meta["tokenizer.chat_template"])

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    d, f = os.path.split(os.path.abspath(path))
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    model.eval()
    load_s = time.time() - t0
    cfg = model.config
    vocab = int(model.get_output_embeddings().weight.shape[0])
    # Fixed ids cover the special tokens, both ends of the vocabulary and a few ordinary entries.
    fixed_ids = sorted(set([0, 1, 2, 3, bos_id, eos_id, 100, 1000, 10000, vocab // 2, vocab - 1]))

    prompts_out, texts, ids_list, full_lasts, greedy_lists, margins_list = [], [], [], [], [], []
    for name, text in spec["prompts"]:
        # Special-token strings in the chat prompts are parsed as special tokens, as llama.cpp's
        # tools do for prompts; BOS is added by hand from the GGUF flag, not by the HF tokenizer.
        ids = tok(text, add_special_tokens=False)["input_ids"]
        if add_bos:
            ids = [bos_id] + ids
        positions, full_last, g_ids, margins, top1 = run_reference(model, ids, fixed_ids)
        first_eog = next((i for i, t in enumerate(g_ids) if t == eos_id), None)
        prompts_out.append({
            "name": name,
            "text": text,
            "bos_added": add_bos,
            "token_ids": ids,
            "n_tokens": len(ids),
            "positions": positions,
            "greedy": {
                "ids": g_ids,
                "text": tok.decode(g_ids, skip_special_tokens=False),
                "margins": margins,
                "top1_logits": top1,
                "first_eos_index": first_eog,
            },
        })
        texts.append(text)
        ids_list.append(ids)
        full_lasts.append(full_last)
        greedy_lists.append(g_ids)
        margins_list.append(margins)
        print("  %s/%s: %d tokens, greedy: %r" % (key, name, len(ids), prompts_out[-1]["greedy"]["text"]),
              file=sys.stderr)

    doc = {
        "format": "kvq-golden-v1",
        "model": spec["name"],
        "gguf_file": spec["file"],
        "gguf_sha256": digest,
        "architecture": meta.get("general.architecture"),
        "vocab_size": vocab,
        "bos_id": bos_id,
        "eos_id": eos_id,
        "add_bos": add_bos,
        "fixed_ids": fixed_ids,
        "n_last_positions": N_LAST_POSITIONS,
        "top_k": TOP_K,
        "n_greedy": N_GREEDY,
        "produced_by": {
            "script": "scripts/make_golden.py",
            "method": ("transformers AutoModelForCausalLM.from_pretrained(dir, gguf_file=...): GGUF weights "
                       "dequantized to float32 by the gguf package, forward pass by transformers' own model "
                       "code, all float32 on CPU; one full-prompt forward, then greedy steps with the KV cache"),
            "tokenizer": "transformers AutoTokenizer.from_pretrained(dir, gguf_file=...), add_special_tokens=False, "
                         "BOS prepended by hand when tokenizer.ggml.add_bos_token is true",
            "dtype": "float32",
            "model_class": type(model).__name__,
            "attn_implementation": getattr(cfg, "_attn_implementation", None),
            "versions": {
                "python": platform.python_version(),
                "torch": torch.__version__,
                "transformers": transformers.__version__,
                "gguf": getattr(gguf, "__version__", None) or _dist_version("gguf"),
                "numpy": numpy.__version__,
            },
            "config": {k: _jsonable(getattr(cfg, k, None)) for k in (
                "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "intermediate_size", "rms_norm_eps", "rope_theta", "rope_local_base_freq", "rope_parameters",
                "sliding_window", "layer_types", "query_pre_attn_scalar", "tie_word_embeddings",
                "final_logit_softcapping", "attn_logit_softcapping")},
            "load_seconds": round(load_s, 1),
        },
        "prompts": prompts_out,
    }
    if args.llama_cpp_python:
        ver, cmp = llama_cpp_compare(args.llama_cpp_python, path, texts, ids_list, full_lasts,
                                     greedy_lists, margins_list)
        doc["llama_cpp_cross_check"] = {
            "what": ("the same token ids run through llama.cpp via llama-cpp-python (default CPU settings, "
                     "n_threads=2); llama_cpp_tokens is llama.cpp's own tokenization of the text "
                     "(add_special=true, parse_special=true). Metadata only: not the golden values."),
            "llama_cpp_python": ver,
            "prompts": {n: c for (n, _), c in zip(spec["prompts"], cmp)},
        }
        for (n, _), c in zip(spec["prompts"], cmp):
            print("  llama.cpp %s/%s: tokens_equal=%s max|dlogit|=%.3f argmax_equal=%s greedy_div=%s"
                  % (key, n, c["tokens_equal"], c["max_abs_logit_diff_last4"], c["argmax_equal_last4"],
                     c["greedy_first_divergence"]), file=sys.stderr)

    os.makedirs(args.out_dir, exist_ok=True)
    out = os.path.join(args.out_dir, spec["out"])
    with open(out, "w") as fo:
        json.dump(doc, fo, indent=1, ensure_ascii=False)
        fo.write("\n")
    print("wrote %s (%d bytes)" % (out, os.path.getsize(out)), file=sys.stderr)


def _dist_version(name):
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:
        return None


def _jsonable(v):
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    return str(v)


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(here)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models-dir", default=os.path.join(root, "models"))
    ap.add_argument("--out-dir", default=os.path.join(root, "tests", "golden"))
    ap.add_argument("--only", choices=sorted(MODELS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-cpp-python", metavar="PY",
                    help="python of a venv with llama-cpp-python, for the optional cross-check")
    args = ap.parse_args()
    for key in MODELS:
        if args.only and key != args.only:
            continue
        print("%s:" % key, file=sys.stderr)
        make_one(key, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
