#!/usr/bin/env python3
"""Writes a llama-architecture GGUF again as a Qwen2, Qwen3 or Phi-3 model (or as llama with Llama
3.1-style RoPE frequency factors), or a Gemma 3 GGUF as a Gemma 2 model, for checking kvq's forward
passes, RoPE factors and the Llama 3 / Qwen2 pre-tokenizers against another engine on the same file
(bench/BENCHMARKS.md, "Qwen2 and Qwen3 architectures" and "Gemma 2 and Phi-3 architectures"). No
Qwen, Phi-3 or Gemma 2 GGUF small enough ships on PyPI; this keeps a trained model's weights, so
perplexities stay meaningful (except gemma2's, which loses the q / k norms it was trained with):

- the Q and K projection rows of each head are reordered (2i -> i, 2i+1 -> i + head_dim / 2), so
  that the NeoX-style RoPE of these architectures rotates the same pairs the llama model's RoPE
  rotated: with zero biases (qwen2) the variant computes what the original does;
- qwen2: random biases on q, k and v (normal, standard deviation --bias-std);
- qwen3: random q / k norm weights (uniform in [1 - s, 1 + s], s = --norm-spread) of RMSNorm per head;
- phi3: q, k and v in one attn_qkv matrix (rows q, k, v), gate and up in one ffn_up (gate rows
  first), as Phi-3's files have them; with --longrope ORIG, LongRoPE: short factors 1, long factors
  rising from 1 to --long-factor, rope.scaling.original_context_length ORIG and
  rope.scaling.attn_factor sqrt(1 + ln(context / ORIG) / ln(ORIG)) (Phi-3.5's formula);
- smollm3: the architecture renamed (no RoPE on every 4th layer);
- granite: the architecture renamed, with Granite's multipliers --granite E,R,A,L (embedding_scale,
  residual_scale, attention.scale, logit_scale);
- gemma2 (from a gemma3 file): the metadata renamed (Gemma 2's soft-caps and alternating
  sliding-window layers are its defaults) and the q / k norms, which Gemma 2 does not have, folded
  into the Q / K rows as if each head's RMS were its expected value (rows times norm weight / s,
  s^2 = the mean over the head's rows of sum_i W_ji^2 g_i^2, g the attention norm's weights; the
  folded rows stored F16), which keeps the model close to the original instead of wrecked;
- llama: the architecture kept, no reordering; with --rope-freqs F, a rope_freqs.weight tensor whose
  factors rise linearly from 1 (the fastest pair) to F (the slowest);
- mixtral, qwen2moe, qwen3moe, granitemoe, olmoe: llama (Mixtral's experts), qwen2, qwen3, granite or
  olmoe as above, with each layer's FFN cut into --experts N,K experts (N slices of the hidden channels, their
  gate / up rows kept as they are in the file, their down columns stored F16 times --down-scale,
  default N) and a router (F32) choosing K per token: with --router gate (default) expert e's row is
  the mean of its channels' gate rows, scaled to norm --router-std; with --router random, normal with
  standard deviation --router-std / sqrt(n_embd). qwen2moe keeps the first --shared channels as its
  shared expert behind a random sigmoid gate (its down times 2) and cuts the rest. Such a model is
  worse than the original (a token runs a share of its FFN), but both engines run the same file, so
  their routing has to agree for their perplexities to;
- olmo2: q / k norms over all heads at once (weights uniform in [1 - s, 1 + s], s = --norm-spread),
  NeoX RoPE, and the attention and FFN norms moved after their blocks (post_attention_norm,
  post_ffw_norm with the same weights), as OLMo 2 has them: a different model from the original;
- olmoe: the olmo2 q / k norms with the pre-norms kept, each KV head repeated for its query heads
  (llama.cpp's OLMoE has no grouped-query attention; the same attention), and the FFN cut into
  experts (see the mixture-of-experts modes);
- gpt-oss: OpenAI's gpt-oss layout: NeoX RoPE (rows reordered as for qwen2), random biases on q, k,
  v and the attention output (--bias-std), a random sink logit per query head (normal, standard
  deviation --sink-std), the FFN norm renamed post_attention_norm, and the FFN cut into experts as
  for the mixture-of-experts modes, with a random router bias (--bias-std x 10) and random gate / up
  / down biases (--bias-std) on each expert; gate stored F16 divided by 1.702, up times --up-scale,
  down times 1.702 / --up-scale, so that gpt-oss's SwiGLU, g sigmoid(1.702 g) (up + 1) with its
  clamps at 7, stays near the original's silu(g) up;
  sliding-window layers of --swa W tokens (default 128) alternate with global ones, local first;
- --swa W (olmo2): attention.sliding_window W, so the file is OLMo 3's layout (3 sliding-window layers
  of W tokens, then a global one; the sliding ones' RoPE unscaled);
- --yarn FACTOR,ORIG (any mode): rope.scaling.type yarn with that factor and
  rope.scaling.original_context_length ORIG (the model's context length kept), as OLMo 3's and
  gpt-oss's files say it;
- --pre NAME replaces tokenizer.ggml.pre (e.g. qwen2, llama-bpe), the pre-tokenizer both engines apply.

usage: make_arch_variant.py IN.gguf OUT.gguf {qwen2,qwen3,phi3,smollm3,granite,gemma2,llama,
                            mixtral,qwen2moe,qwen3moe,granitemoe,olmo2,olmoe,gpt-oss} [--pre NAME] [--bias-std 0.02]
                            [--norm-spread 0.2] [--rope-freqs F] [--longrope ORIG] [--long-factor 4]
                            [--granite 1.5,0.9,0.11,1.2] [--experts 8,2] [--shared 768] [--router gate|random]
                            [--router-std 3] [--down-scale N] [--yarn 4,512] [--swa 256]
                            [--sink-std 1] [--up-scale 4] [--seed 1]   (pip install gguf numpy)
"""
import argparse
import math

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize


def field_value(field):
    return field.contents()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("arch", choices=["qwen2", "qwen3", "phi3", "smollm3", "granite", "gemma2", "llama", "mixtral", "gpt-oss",
                                     "qwen2moe", "qwen3moe", "granitemoe", "olmo2", "olmoe"])
    ap.add_argument("--experts", default="8,2")
    ap.add_argument("--shared", type=int, default=768)
    ap.add_argument("--router-std", type=float, default=3.0)
    ap.add_argument("--router", choices=["gate", "random"], default="gate")
    ap.add_argument("--down-scale", type=float, default=None)
    ap.add_argument("--granite", default="1.5,0.9,0.11,1.2")
    ap.add_argument("--rope-freqs", type=float, default=None)
    ap.add_argument("--longrope", type=int, default=None)
    ap.add_argument("--yarn", default=None)
    ap.add_argument("--swa", type=int, default=None)
    ap.add_argument("--long-factor", type=float, default=4.0)
    ap.add_argument("--pre", default=None)
    ap.add_argument("--bias-std", type=float, default=0.02)
    ap.add_argument("--norm-spread", type=float, default=0.2)
    ap.add_argument("--sink-std", type=float, default=1.0)
    ap.add_argument("--up-scale", type=float, default=4.0)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    r = GGUFReader(a.src)
    src_arch = field_value(r.fields["general.architecture"])
    want = "gemma3" if a.arch == "gemma2" else "llama"
    assert src_arch == want, f"{a.arch} is made from a {want} file, got {src_arch}"
    moe = a.arch in ("mixtral", "qwen2moe", "qwen3moe", "granitemoe", "olmoe", "gpt-oss")
    oss = a.arch == "gpt-oss"
    out_arch = "llama" if a.arch == "mixtral" else a.arch
    olmo = out_arch in ("olmo2", "olmoe")
    a.arch = {"mixtral": "llama", "qwen2moe": "qwen2", "qwen3moe": "qwen3", "granitemoe": "granite"}.get(a.arch, a.arch)
    n_exp, k_exp = (int(x) for x in a.experts.split(","))
    w = GGUFWriter(a.dst, out_arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        if moe and out_arch in ("llama", "granitemoe", "olmoe", "gpt-oss") and name == f"{src_arch}.feed_forward_length":
            continue  # the experts' width, written below
        key = out_arch + name[len(src_arch):] if name.startswith(src_arch + ".") else name
        val = field_value(f)
        if name == "tokenizer.ggml.pre" and a.pre:
            val = a.pre
        if out_arch == "olmoe" and name == f"{src_arch}.attention.head_count_kv":
            val = field_value(r.fields[f"{src_arch}.attention.head_count"])  # KV heads repeated, below
        vtype = f.types[0]
        sub = f.types[-1] if vtype == GGUFValueType.ARRAY else None
        w.add_key_value(key, val, vtype, sub_type=sub)
    n_head = int(field_value(r.fields[f"{src_arch}.attention.head_count"]))
    n_kv = int(field_value(r.fields[f"{src_arch}.attention.head_count_kv"]))
    n_embd = int(field_value(r.fields[f"{src_arch}.embedding_length"]))
    n_ctx = int(field_value(r.fields[f"{src_arch}.context_length"]))
    hd = n_embd // n_head
    n_ff = int(field_value(r.fields[f"{src_arch}.feed_forward_length"]))
    ffn = {}  # MoE: block -> {kind: (data, type)}
    perm = np.concatenate([np.arange(0, hd, 2), np.arange(1, hd, 2)])
    neox = a.arch in ("qwen2", "qwen3", "phi3") or olmo or oss
    extra = []
    fused = {}  # phi3: block -> {kind: data}
    by_name = {t.name: t for t in r.tensors}
    for t in r.tensors:
        data = np.asarray(t.data)
        kind = t.name.split(".")[-2] if t.name.startswith("blk.") else ""
        blk = t.name.rsplit(".", 2)[0]
        if a.arch == "gemma2" and kind in ("attn_q_norm", "attn_k_norm"):
            continue
        if a.arch == "gemma2" and kind in ("attn_q", "attn_k"):
            wt = dequantize(data, t.tensor_type).reshape(-1, int(t.shape[0])).astype(np.float64)
            g_attn = np.asarray(by_name[f"{blk}.attn_norm.weight"].data, dtype=np.float64)
            g_head = np.asarray(by_name[f"{blk}.{kind}_norm.weight"].data, dtype=np.float64)
            hdim = g_head.size
            heads = wt.reshape(-1, hdim, wt.shape[1])
            s = np.sqrt(((heads ** 2) * (g_attn ** 2)).sum(axis=2).mean(axis=1))  # per head
            heads = heads * (g_head[None, :, None] / s[:, None, None])
            folded = heads.reshape(wt.shape).astype(np.float16)
            w.add_tensor(t.name, folded, raw_shape=folded.shape, raw_dtype=GGMLQuantizationType.F16)
            continue
        if neox and kind in ("attn_q", "attn_k"):
            heads = n_head if kind == "attn_q" else n_kv
            rows = data.reshape(heads, hd, -1)[:, perm, :]
            data = rows.reshape(data.shape)
        if out_arch == "olmoe" and kind in ("attn_k", "attn_v") and n_kv < n_head:
            # llama.cpp's OLMoE has no grouped-query attention: each KV head repeated for its query heads
            rows = data.reshape(n_kv, hd, -1)
            data = np.repeat(rows, n_head // n_kv, axis=0).reshape(n_head * hd, -1)
        if out_arch == "olmo2" and kind in ("attn_norm", "ffn_norm"):  # OLMo 2 normalizes outputs instead
            name = "post_attention_norm" if kind == "attn_norm" else "post_ffw_norm"
            extra.append((f"{blk}.{name}.weight", np.asarray(data, dtype=np.float32)))
            continue
        if olmo and kind in ("attn_q", "attn_k"):  # q / k norms over all heads at once
            heads = n_head if kind == "attn_q" or out_arch == "olmoe" else n_kv
            extra.append((f"{blk}.{kind}_norm.weight",
                          rng.uniform(1 - a.norm_spread, 1 + a.norm_spread, heads * hd).astype(np.float32)))
        if oss and kind == "ffn_norm":  # gpt-oss's name for the FFN's norm
            extra.append((f"{blk}.post_attention_norm.weight", np.asarray(data, dtype=np.float32)))
            continue
        if oss and kind in ("attn_q", "attn_k", "attn_v", "attn_output"):
            width = n_embd if kind == "attn_output" else (n_head if kind == "attn_q" else n_kv) * hd
            extra.append((f"{blk}.{kind}.bias", (rng.standard_normal(width) * a.bias_std).astype(np.float32)))
            if kind == "attn_q":
                extra.append((f"{blk}.attn_sinks.weight", (rng.standard_normal(n_head) * a.sink_std).astype(np.float32)))
        if moe and kind in ("ffn_gate", "ffn_up", "ffn_down"):
            ffn.setdefault(blk, {})[kind] = (data, t.tensor_type)
            continue
        if a.arch == "phi3" and kind in ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up"):
            fused.setdefault(blk, {})[kind] = (data, t.tensor_type)
            parts = fused[blk]
            for name, group in (("attn_qkv", ("attn_q", "attn_k", "attn_v")), ("ffn_up", ("ffn_gate", "ffn_up"))):
                if kind in group and all(g in parts for g in group):
                    types = {parts[g][1] for g in group}
                    assert len(types) == 1, f"{blk}: {group} have different types {types}; cannot fuse"
                    cat = np.concatenate([parts[g][0] for g in group], axis=0)
                    w.add_tensor(f"{blk}.{name}.weight", cat, raw_shape=cat.shape, raw_dtype=types.pop())
            continue
        w.add_tensor(t.name, data, raw_shape=data.shape, raw_dtype=t.tensor_type)
        if out_arch in ("qwen2moe", "olmo2", "olmoe", "gpt-oss") and t.name == "token_embd.weight" and "output.weight" not in by_name:
            w.add_tensor("output.weight", data, raw_shape=data.shape, raw_dtype=t.tensor_type)  # llama.cpp needs it
        if a.arch in ("qwen2", "qwen3") and kind in ("attn_q", "attn_k", "attn_v"):
            heads = n_head if kind == "attn_q" else n_kv
            if a.arch == "qwen2":
                extra.append((f"{blk}.{kind}.bias", (rng.standard_normal(heads * hd) * a.bias_std).astype(np.float32)))
            elif kind != "attn_v":
                extra.append((f"{blk}.{kind}_norm.weight",
                              rng.uniform(1 - a.norm_spread, 1 + a.norm_spread, hd).astype(np.float32)))
    if a.arch == "granite":
        e, res, att, logit = (float(x) for x in a.granite.split(","))
        w.add_float32(f"{out_arch}.embedding_scale", e)
        w.add_float32(f"{out_arch}.residual_scale", res)
        w.add_float32(f"{out_arch}.attention.scale", att)
        w.add_float32(f"{out_arch}.logit_scale", logit)
    if moe:
        shared = a.shared if out_arch == "qwen2moe" else 0
        routed = n_ff - shared
        assert routed % n_exp == 0, f"{routed} routed channels do not split into {n_exp} experts"
        fe = routed // n_exp
        if a.down_scale is None:
            a.down_scale = float(n_exp)
        if out_arch in ("llama", "granitemoe", "olmoe"):  # their experts are feed_forward_length wide
            w.add_uint32(f"{out_arch}.feed_forward_length", fe)
        if oss:
            w.add_uint32("gpt-oss.expert_feed_forward_length", fe)
            w.add_uint32("gpt-oss.attention.sliding_window", a.swa or 128)
        w.add_uint32(f"{out_arch}.expert_count", n_exp)
        w.add_uint32(f"{out_arch}.expert_used_count", k_exp)
        if out_arch in ("qwen2moe", "qwen3moe"):
            w.add_uint32(f"{out_arch}.expert_feed_forward_length", fe)
        if shared:
            w.add_uint32(f"{out_arch}.expert_shared_feed_forward_length", shared)
        for blk, parts in ffn.items():
            (g, gt), (u, ut), (d, dt) = parts["ffn_gate"], parts["ffn_up"], parts["ffn_down"]
            down = dequantize(d, dt).reshape(n_embd, n_ff).astype(np.float32)  # rows: outputs, columns: channels
            if oss:  # gate / 1.702 and up x --up-scale (F16), down x 1.702 / --up-scale: gpt-oss's
                # g sigmoid(1.702 g) (up + 1) stays near the original's silu(g) up
                g = (dequantize(g, gt).reshape(n_ff, n_embd) / 1.702).astype(np.float16)
                u = (dequantize(u, ut).reshape(n_ff, n_embd) * a.up_scale).astype(np.float16)
                gt = ut = GGMLQuantizationType.F16
                down = down * 1.702 / a.up_scale
            for kind, rows, typ in (("ffn_gate", g, gt), ("ffn_up", u, ut)):
                if shared:
                    w.add_tensor(f"{blk}.{kind}_shexp.weight", rows[:shared], raw_shape=rows[:shared].shape, raw_dtype=typ)
                ex = rows[shared:].reshape((n_exp, fe) + rows.shape[1:])
                w.add_tensor(f"{blk}.{kind}_exps.weight", ex, raw_shape=ex.shape, raw_dtype=typ)
            if shared:
                sd = (down[:, :shared] * 2).astype(np.float16)
                w.add_tensor(f"{blk}.ffn_down_shexp.weight", sd, raw_shape=sd.shape, raw_dtype=GGMLQuantizationType.F16)
                extra.append((f"{blk}.ffn_gate_inp_shexp.weight",
                              (rng.standard_normal(n_embd) / math.sqrt(n_embd)).astype(np.float32)))
            de = np.stack([down[:, shared + e * fe: shared + (e + 1) * fe] for e in range(n_exp)]) * a.down_scale
            de = de.astype(np.float16)  # (expert, output, channel)
            w.add_tensor(f"{blk}.ffn_down_exps.weight", de, raw_shape=de.shape, raw_dtype=GGMLQuantizationType.F16)
            if a.router == "gate":  # expert e scored by the mean of its channels' gate rows
                gr = dequantize(g, gt).reshape(n_ff, n_embd)[shared:].reshape(n_exp, fe, n_embd).mean(axis=1)
                gr = gr / np.linalg.norm(gr, axis=1, keepdims=True) * a.router_std
            else:
                gr = rng.standard_normal((n_exp, n_embd)) * a.router_std / math.sqrt(n_embd)
            extra.append((f"{blk}.ffn_gate_inp.weight", gr.astype(np.float32)))
            if oss:
                extra.append((f"{blk}.ffn_gate_inp.bias", (rng.standard_normal(n_exp) * a.bias_std * 10).astype(np.float32)))
                for kind, width in (("ffn_gate", fe), ("ffn_up", fe), ("ffn_down", n_embd)):
                    b = (rng.standard_normal((n_exp, width)) * a.bias_std).astype(np.float32)
                    extra.append((f"{blk}.{kind}_exps.bias", b))
    if a.longrope:
        assert a.arch == "phi3", "--longrope is Phi-3's"
        extra.append(("rope_factors_short.weight", np.ones(hd // 2, dtype=np.float32)))
        extra.append(("rope_factors_long.weight", np.linspace(1.0, a.long_factor, hd // 2).astype(np.float32)))
        w.add_uint32("phi3.rope.scaling.original_context_length", a.longrope)
        scale = n_ctx / a.longrope
        w.add_float32("phi3.rope.scaling.attn_factor",
                      math.sqrt(1 + math.log(scale) / math.log(a.longrope)) if scale > 1 else 1.0)
    if a.swa and not oss:
        assert out_arch == "olmo2", "--swa is OLMo 3's (olmo2) or gpt-oss's"
        w.add_uint32("olmo2.attention.sliding_window", a.swa)
    if a.yarn:
        factor, orig = a.yarn.split(",")
        w.add_string(f"{out_arch}.rope.scaling.type", "yarn")
        w.add_float32(f"{out_arch}.rope.scaling.factor", float(factor))
        w.add_uint32(f"{out_arch}.rope.scaling.original_context_length", int(orig))
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
