#!/usr/bin/env python3
"""Writes a llama-architecture GGUF again as a Qwen2 or Qwen3 model (or as llama with Llama
3.1-style RoPE frequency factors), for checking kvq's qwen2 / qwen3 forward passes, RoPE factors
and the Llama 3 / Qwen2 pre-tokenizers against another engine on the same file (bench/BENCHMARKS.md, "Qwen2 and Qwen3 architectures"). No Qwen GGUF small enough ships on
PyPI; this keeps a trained model's weights, so perplexities stay meaningful:

- the Q and K projection rows of each head are reordered (2i -> i, 2i+1 -> i + head_dim / 2), so
  that the NeoX-style RoPE of these architectures rotates the same pairs the llama model's RoPE
  rotated: with zero biases (qwen2) the variant computes what the original does;
- qwen2: random biases on q, k and v (normal, standard deviation --bias-std);
- qwen3: random q / k norm weights (uniform in [1 - s, 1 + s], s = --norm-spread) of RMSNorm per head;
- llama: the architecture kept, no reordering; with --rope-freqs F, a rope_freqs.weight tensor whose
  factors rise linearly from 1 (the fastest pair) to F (the slowest);
- --pre NAME replaces tokenizer.ggml.pre (e.g. qwen2, llama-bpe), the pre-tokenizer both engines apply.

usage: make_arch_variant.py IN.gguf OUT.gguf {qwen2,qwen3,llama} [--pre NAME] [--bias-std 0.02]
                            [--norm-spread 0.2] [--rope-freqs F] [--seed 1]   (pip install gguf numpy)
"""
import argparse

import numpy as np
from gguf import GGUFReader, GGUFValueType, GGUFWriter


def field_value(field):
    return field.contents()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("arch", choices=["qwen2", "qwen3", "llama"])
    ap.add_argument("--rope-freqs", type=float, default=None)
    ap.add_argument("--pre", default=None)
    ap.add_argument("--bias-std", type=float, default=0.02)
    ap.add_argument("--norm-spread", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    r = GGUFReader(a.src)
    src_arch = field_value(r.fields["general.architecture"])
    assert src_arch == "llama", f"expects a llama-architecture file, got {src_arch}"
    w = GGUFWriter(a.dst, a.arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        key = a.arch + name[len(src_arch):] if name.startswith(src_arch + ".") else name
        val = field_value(f)
        if name == "tokenizer.ggml.pre" and a.pre:
            val = a.pre
        vtype = f.types[0]
        sub = f.types[-1] if vtype == GGUFValueType.ARRAY else None
        w.add_key_value(key, val, vtype, sub_type=sub)
    n_head = int(field_value(r.fields[f"{src_arch}.attention.head_count"]))
    n_kv = int(field_value(r.fields[f"{src_arch}.attention.head_count_kv"]))
    n_embd = int(field_value(r.fields[f"{src_arch}.embedding_length"]))
    hd = n_embd // n_head
    perm = np.concatenate([np.arange(0, hd, 2), np.arange(1, hd, 2)])
    extra = []
    for t in r.tensors:
        data = np.asarray(t.data)
        if a.arch != "llama" and (t.name.endswith("attn_q.weight") or t.name.endswith("attn_k.weight")):
            heads = n_head if t.name.endswith("attn_q.weight") else n_kv
            rows = data.reshape(heads, hd, -1)[:, perm, :]
            data = rows.reshape(data.shape)
        w.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=t.tensor_type)
        if a.arch != "llama" and t.name.split(".")[-2] in ("attn_q", "attn_k", "attn_v"):
            blk = t.name.rsplit(".", 2)[0]
            kind = t.name.split(".")[-2]
            heads = n_head if kind == "attn_q" else n_kv
            if a.arch == "qwen2":
                extra.append((f"{blk}.{kind}.bias", (rng.standard_normal(heads * hd) * a.bias_std).astype(np.float32)))
            elif kind != "attn_v":
                extra.append((f"{blk}.{kind}_norm.weight",
                              rng.uniform(1 - a.norm_spread, 1 + a.norm_spread, hd).astype(np.float32)))
    if a.rope_freqs:
        extra.append(("rope_freqs.weight", np.linspace(1.0, a.rope_freqs, hd // 2).astype(np.float32)))
    for name, v in extra:
        w.add_tensor(name, v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


if __name__ == "__main__":
    main()
