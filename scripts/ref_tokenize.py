#!/usr/bin/env python3
"""Golden token ids for kvq's tokenizer tests, from implementations independent of kvq.

  SPM models (tokenizer.ggml.model == "llama"): the `sentencepiece` library, fed a ModelProto
      rebuilt from the GGUF vocabulary (pieces, scores, types; BPE, byte fallback, identity
      normalization, dummy prefix from tokenizer.ggml.add_space_prefix).
  byte-level BPE (tokenizer.ggml.model == "gpt2"): HF `tokenizers` (Rust BPE) built from the GGUF
      vocabulary and merges, with the pre-tokenizer that tokenizer.ggml.pre names.

Special tokens are split out of the text here, before either library sees it, with the rule kvq
uses (and llama.cpp / HF added-tokens use): USER_DEFINED tokens always, CONTROL (and UNKNOWN) tokens
only when parse_special; leftmost-longest match on the raw text.  When llama-cpp-python is importable, every
case is also tokenized by llama.cpp and disagreements are printed (the goldens stay those of the
libraries above).

Usage (from the repository root; needs: pip install gguf sentencepiece protobuf tokenizers):
  python scripts/ref_tokenize.py stories260K /work/shared/models/stories260K.gguf
  python scripts/ref_tokenize.py gemma3_270m ~/.cache/.../gemma-3-270m-q4_k_m.gguf
  python scripts/ref_tokenize.py smollm2_135m .../SmolLM2-135M-Instruct.Q4_1.gguf
writes tests/golden/tokenizer_<name>.json.
"""
import json
import os
import re
import struct
import sys

import gguf

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

TEXTS = [
    "Hello world",
    "Once upon a time, there was a little girl named Lily.",
    " leading space",
    "   three leading spaces",
    "trailing space ",
    "trailing spaces   ",
    "multiple   inner    spaces",
    " ",
    "   ",
    "",
    "line one\nline two\n\nline four\n",
    "\n\nleading newlines",
    "tabs\tand\t\ttabs",
    "mixed \n \n  whitespace\t \n",
    "digits 0123456789 and 3.14159 and 1,000,000",
    "year 2024, 42nd, 1st, x1y2z3",
    "Punctuation!? ... --- (parens) [brackets] {braces} <angle> \"quotes\" 'single' @#$%^&*_+=|\\/~`",
    "don't won't I'm you're we've they'll she'd it's DON'T",
    "emoji: \U0001F600 \U0001F44D\U0001F3FD \U0001F468\u200D\U0001F469\u200D\U0001F467 \u2764\ufe0f",
    "CJK: \u4f60\u597d\uff0c\u4e16\u754c\u3002\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8 \ud55c\uad6d\uc5b4",
    "accented: caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber Stra\u00dfe \u00e0 \u00e7a \u0144 \u0151",
    "RTL: \u05e9\u05dc\u05d5\u05dd \u05e2\u05d5\u05dc\u05dd \u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645",
    "Greek \u0391\u03b8\u03ae\u03bd\u03b1 and Cyrillic \u041c\u043e\u0441\u043a\u0432\u0430",
    "combining e\u0301 and nbsp\u00a0here and zwj\u200bhere",
    "code: def f(x):\n    return x**2  # square\n",
    "URL https://example.com/a?b=c&d=e and email a.b@example.org",
    "<s>not special unless parsed</s>",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<start_of_turn>user\nHello<end_of_turn>\n<start_of_turn>model\n",
    "html <b>bold</b> <table><tr><td>x</td></tr></table>",
    "MiXeD CaSe WORDS and snake_case and camelCase",
    "a\u2581b (literal U+2581) and \u0120x (literal U+0120)",
    "\U0001F680\U0001F680\U0001F680 rockets",
]


# Whole files from the project's shared data (encoded without BOS, special tokens not parsed);
# the golden keeps their token count and a hash of the ids.
CORPORA = [
    "/work/shared/data/wikitext-2-test.txt",
    "/work/shared/data/tinyshakespeare.txt",
    "/work/shared/data/paulgraham-essays.txt",
]


def read_vocab(path):
    r = gguf.GGUFReader(path)

    def field(name, default=None):
        f = r.fields.get(name)
        return default if f is None else f.contents()

    v = {
        "model": field("tokenizer.ggml.model"),
        "pre": field("tokenizer.ggml.pre", "default"),
        "tokens": field("tokenizer.ggml.tokens"),
        "scores": field("tokenizer.ggml.scores"),
        "types": field("tokenizer.ggml.token_type"),
        "merges": field("tokenizer.ggml.merges"),
        "add_space_prefix": field("tokenizer.ggml.add_space_prefix"),
        "bos": field("tokenizer.ggml.bos_token_id"),
        "eos": field("tokenizer.ggml.eos_token_id"),
        "unk": field("tokenizer.ggml.unknown_token_id"),
    }
    n = len(v["tokens"])
    if v["types"] is None:
        v["types"] = [NORMAL] * n
    if v["scores"] is None:
        v["scores"] = [0.0] * n
    if v["add_space_prefix"] is None:
        v["add_space_prefix"] = v["model"] == "llama"
    return v


_special_cache = {}


def split_special(text, vocab, parse_special):
    """Leftmost-longest split of `text` into (is_token, str_or_id) fragments."""
    key = (id(vocab), parse_special)
    if key not in _special_cache:
        specials = {}
        for i, (t, ty) in enumerate(zip(vocab["tokens"], vocab["types"])):
            if t and (ty == USER_DEFINED or (parse_special and ty in (CONTROL, UNKNOWN))):
                specials.setdefault(t, i)
        # an alternation tries its branches in order: longest first makes each match the longest
        alts = sorted(specials, key=len, reverse=True)
        pattern = re.compile("|".join(re.escape(a) for a in alts)) if alts else None
        _special_cache[key] = (specials, pattern)
    specials, pattern = _special_cache[key]
    out, pos = [], 0
    if pattern is not None:
        for m in pattern.finditer(text):
            if m.start() > pos:
                out.append((False, text[pos:m.start()]))
            out.append((True, specials[m.group(0)]))
            pos = m.end()
    if pos < len(text):
        out.append((False, text[pos:]))
    return out


def fnv1a64_ids(ids):
    """FNV-1a (64-bit) over the ids as little-endian int32 bytes (the test recomputes it)."""
    h = 0xCBF29CE484222325
    for b in struct.pack(f"<{len(ids)}i", *ids):
        h = ((h ^ b) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


class SpmRef:
    def __init__(self, v):
        import sentencepiece as spm
        from sentencepiece import sentencepiece_model_pb2 as pb

        m = pb.ModelProto()
        for piece, score, ty in zip(v["tokens"], v["scores"], v["types"]):
            p = m.pieces.add()
            p.piece = piece
            p.score = score
            p.type = ty if ty in (NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE) else NORMAL
        m.trainer_spec.model_type = pb.TrainerSpec.BPE
        m.trainer_spec.vocab_size = len(v["tokens"])
        m.trainer_spec.byte_fallback = any(t == BYTE for t in v["types"])
        m.trainer_spec.unk_id = v["unk"] if v["unk"] is not None else 0
        m.trainer_spec.bos_id = v["bos"] if v["bos"] is not None else -1
        m.trainer_spec.eos_id = v["eos"] if v["eos"] is not None else -1
        m.trainer_spec.pad_id = -1
        m.normalizer_spec.name = "identity"
        m.normalizer_spec.add_dummy_prefix = bool(v["add_space_prefix"])
        m.normalizer_spec.remove_extra_whitespaces = False
        m.normalizer_spec.escape_whitespaces = True
        self.sp = spm.SentencePieceProcessor()
        self.sp.LoadFromSerializedProto(m.SerializeToString())
        self.add_space_prefix = bool(v["add_space_prefix"])

    def encode(self, frags):
        # sentencepiece adds the dummy prefix on every call; llama.cpp and kvq add it at the start
        # of the text and after each special token, which is where every raw fragment here starts.
        ids = []
        for is_tok, x in frags:
            ids.extend([x] if is_tok else self.sp.EncodeAsIds(x))
        return ids


class BpeRef:
    def __init__(self, v):
        from tokenizers import Tokenizer, models, pre_tokenizers, decoders

        vocab = {t: i for i, t in enumerate(v["tokens"])}
        merges = [tuple(m.split(" ", 1)) for m in v["merges"]]
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if v["pre"] in ("smollm", "starcoder", "refact"):
            # these models split every digit apart before the GPT-2 regex
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), byte_level])
        elif v["pre"] in ("gpt2", "default"):
            tok.pre_tokenizer = byte_level
        else:
            sys.exit(f"pre-tokenizer {v['pre']!r} not covered by this script")
        tok.decoder = decoders.ByteLevel()
        self.tok = tok

    def encode(self, frags):
        ids = []
        for is_tok, x in frags:
            ids.extend([x] if is_tok else self.tok.encode(x, add_special_tokens=False).ids)
        return ids


def llama_cpp_ids(path):
    try:
        import llama_cpp
    except ImportError:
        return None
    m = llama_cpp.Llama(path, vocab_only=True, verbose=False)
    return lambda text, special: m.tokenize(text.encode(), add_bos=False, special=special)


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    name, path = sys.argv[1], os.path.expanduser(sys.argv[2])
    v = read_vocab(path)
    if v["model"] == "llama":
        ref = SpmRef(v)
    elif v["model"] == "gpt2":
        ref = BpeRef(v)
    else:
        sys.exit(f"tokenizer model {v['model']!r} not covered")
    lcpp = llama_cpp_ids(path)
    cases, n_diff = [], 0
    for text in TEXTS:
        for parse_special in (False, True):
            frags = split_special(text, v, parse_special)
            if parse_special and frags == split_special(text, v, False):
                continue  # no control token in the text: same as the parse_special=False case
            ids = ref.encode(frags)
            cases.append({"text": text, "parse_special": parse_special, "ids": ids})
            if lcpp is not None:
                other = lcpp(text, parse_special)
                if other != ids:
                    n_diff += 1
                    print(f"llama.cpp differs on {text!r} special={parse_special}:\n  ref {ids}\n  lcp {other}")
    corpora = []
    for path_c in CORPORA:
        if not os.path.exists(path_c):
            print(f"corpus {path_c} absent: not in the golden file")
            continue
        with open(path_c, encoding="utf-8", newline="") as f:
            text = f.read()
        ids = ref.encode(split_special(text, v, False))
        corpora.append({"file": os.path.basename(path_c), "n_tokens": len(ids),
                        "fnv1a64": f"{fnv1a64_ids(ids):016x}", "first": ids[:32], "last": ids[-32:]})
        if lcpp is not None:
            other = lcpp(text, False)
            same = other == ids
            n_diff += not same
            print(f"corpus {os.path.basename(path_c)}: {len(ids)} tokens, llama.cpp "
                  + ("agrees" if same else f"differs ({len(other)} tokens)"))
    out = {
        "model": name,
        "file": os.path.basename(path),
        "tokenizer_model": v["model"],
        "pre": v["pre"],
        "n_vocab": len(v["tokens"]),
        "cases": cases,
        "corpora": corpora,
    }
    dst = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "golden",
                       f"tokenizer_{name}.json")
    with open(dst, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=True, indent=1)
        f.write("\n")
    print(f"{dst}: {len(cases)} cases" + ("" if lcpp is None else f", {n_diff} differ from llama.cpp"))


if __name__ == "__main__":
    main()
