#!/usr/bin/env python3
"""Writes tests/golden/pretokenize_llama3.json: texts and the pieces the Llama 3 ("llama-bpe") and
Qwen2 ("qwen2") pre-tokenizer regexes cut them into, as computed by the `regex` package (an
independent regex engine with Unicode properties), for tests/test_tokenizer.cpp to compare kvq's
hand-written pre-tokenizer against; and tests/golden/pretokenize_cased.json, the same for the
Tekken ("tekken") and GPT-4o ("gpt-4o", "llama4") patterns, whose letter classes go by case.

Texts: hand-picked cases (contractions in either case, punctuation before letters, digit runs,
newlines inside whitespace runs, combining marks, non-ASCII digits and spaces) and random strings
drawn from a pool of characters of every class the patterns distinguish.

usage: ref_pretokenize.py LLAMA3_OUT.json [CASED_OUT.json]      (pip install regex)
"""
import json
import random
import sys

import regex

# the patterns as llama.cpp and the Hugging Face tokenizer.json files of these models write them
LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# as llama.cpp's comments and the tokenizer.json files of Mistral Nemo and GPT-4o-style models write them
UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
CONTR = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{UPPER}*{LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{UPPER}+{LOWER}*|\p{{N}}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{UPPER}*{LOWER}+{CONTR}|[^\r\n\p{{L}}\p{{N}}]?{UPPER}+{LOWER}*{CONTR}"
         r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

CASES = [
    "Hello world", "don't DON'T I'M we'Ll THEY'VE you'Re it's 'sup", "a  b", "x\n\ny", "end  ",
    "(hello) [world] \"quoted\" 'single'", "...hello", "$100 and 12345678 or 3.14159",
    "x 123 456", "tab\tsep\tword", "line\r\nbreak\r\n\r\n  indented", "  \n  \n  x", "\n\n\n",
    "a\u00a0b\u3000c\u2009d", "cafe\u0301 na\u0308ive", "\u0663\u0664\u0665 \u0968\u0969 \uff11\uff12",
    "\u4f60\u597d\uff0c\u4e16\u754c\uff01", "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440!",
    "emoji \U0001f600\U0001f600 ok!!\n", "mixed123abc456", "C++ and C# are languages.",
    "    def f(x):\n        return x**2\n", "", " ", "'", "''", "'s'", "1'2", "a'", "\r", " \r\n",
    "!!!\n\n\nnext", " !?\n", "x  \ty", "\t\tword", "\n word", ". word", ".\nword", "it'\u017fa 'S 'K",
]

POOL = (list("abcXYZ") + list("0123456789") + [" ", " ", " ", "\t", "\n", "\r", "\u00a0", "\u3000"]
        + list(".,!?'\"()-_;:$%&*+/<=>@[]^`{|}~") + ["\u00e9", "\u00df", "\u4f60", "\u0416", "\u03a9",
        "\u0663", "\u0968", "\uff11", "\u00bd", "\u2163", "\u0301", "\u0308", "\U0001f600", "\u2122",
        "\u20ac", "\u00a9", "S", "T", "L", "V", "E", "M", "D", "R"])


# the cased patterns' own cases: capitals inside words, all-capitals words, title-case and
# modifier letters, marks before and after letters, contractions after capitals, slashes
CASED_CASES = [
    "HelloWorld", "HELLOworld", "helloWORLD", "ABCdef GHI jkl", "iPhone XML HTTPRequest", "I'M DON'T we'Re",
    "\u01c5ungla \u01c4\u01c6", "\u02b0a a\u02b0 \u3005\u4f60", "\u0301a a\u0301 \u0301\u0301 !\u0301 \u0301!",
    "\u0416\u0436\u0416 \u03a9\u03c9", "path/to/file //x\n/\r\n", "x/ /y", "1234567 12a", "\u212a\u017f \u00df\u1e9e",
    "na\u0903x \u0915\u093f\u0924", "A'S a'ſ", " 'sup", "  Hello", "\tWorld", "\u00a0Na\u00efve",
]

CASED_POOL = POOL + ["\u01c5", "\u02b0", "\u3005", "\u0436", "\u03c9", "\u1e9e", "\u212a", "\u017f",
                     "\u0903", "\u093f", "\u0915", "\u20dd", "/", "/", "A", "b", "Q"]


def pieces(pattern, text):
    out = regex.findall(pattern, text)
    assert "".join(out) == text, (pattern, text)
    return out


def write_golden(path, seed, cases, pool, n_random, patterns):
    """cases + n_random random texts over pool, each with its pieces under every pattern."""
    rng = random.Random(seed)
    texts = list(cases)
    for _ in range(n_random):
        n = rng.randint(1, 24)
        texts.append("".join(rng.choice(pool) for _ in range(n)))
    out = [{"text": t, **{k: pieces(p, t) for k, p in patterns.items()}} for t in texts]
    with open(path, "w", encoding="utf-8") as f:
        json.dump({"produced_by": f"scripts/ref_pretokenize.py with regex {regex.__version__}",
                   **{f"{k}_pattern": p for k, p in patterns.items()}, "cases": out}, f, ensure_ascii=True,
                  indent=0)
        f.write("\n")
    print(len(out), "cases in", path)


def main():
    write_golden(sys.argv[1], 20261206, CASES, POOL, 400, {"llama3": LLAMA3, "qwen2": QWEN2})
    if len(sys.argv) > 2:
        write_golden(sys.argv[2], 20261207, CASES + CASED_CASES, CASED_POOL, 600, {"tekken": TEKKEN, "gpt4o": GPT4O})


if __name__ == "__main__":
    main()
