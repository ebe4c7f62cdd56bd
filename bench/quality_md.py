#!/usr/bin/env python3
"""Renders kvq eval JSON reports (--json-out) as the markdown tables of bench/QUALITY.md.

    bench/quality_md.py report.json [more.json ...]

ppl buckets: one row per format and context length; needle: accuracy per format and length.
"""
import json
import sys


def main(paths):
    for path in paths:
        with open(path) as f:
            r = json.load(f)
        rows = []
        needle = []
        for fm in r.get("formats", []):
            for b in fm.get("buckets", []):
                rows.append((fm["format"], fm.get("bits_per_element", 0), b))
            if "needle" in fm:
                needle.append((fm["format"], fm["needle"]["grid"]))
        if rows:
            print(f"<!-- {path} -->")
            print("| format | bits/elem | ctx | scored | PPL | f16 PPL | dPPL % | KLD mean | KLD p99 | top-1 |")
            print("|---|---|---|---|---|---|---|---|---|---|")
            for name, bits, b in rows:
                print(f"| {name} | {bits:.2f} | {b['ctx']} | {b.get('n_scored', '')} | {b['ppl']:.4f} | {b['base_ppl']:.4f} | "
                      f"{b['delta_ppl_pct']:+.3f} | {b['kld_mean']:.6f} | {b['kld_p99']:.6f} | {100 * b['top1_agree']:.2f}% |")
            print()
        if needle:
            print(f"<!-- {path} needle (f16 accuracy {r['formats'][0].get('needle_f16')}) -->")
            print("| format | ctx | found at depth % | missed at depth % |")
            print("|---|---|---|---|")
            for name, grid in needle:
                for ctx in sorted({g["ctx"] for g in grid}):
                    cells = [g for g in grid if g["ctx"] == ctx]
                    hit = ", ".join(str(g["depth"]) for g in cells if g["ok"]) or "-"
                    miss = ", ".join(f"{g['depth']} ({g['answer'].strip()[:24]!r})" for g in cells if not g["ok"]) or "-"
                    print(f"| {name} | {ctx} | {hit} | {miss} |")
            print()

if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
