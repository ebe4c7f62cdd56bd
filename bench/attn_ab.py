#!/usr/bin/env python3
"""Compare attn_bench binaries (e.g. two builds) on a shared, drifting machine.

Runs each binary in turn, ROUNDS times, with the same --benchmark_filter, so that the machine's
slow and fast stretches fall on all of them alike, and prints per benchmark and binary the minimum
and the median of every repetition's time (us) and the ratio to f16's median of the same binary and
kind (decode/ctx.., kernel/scores, ...).

    bench/attn_ab.py --filter '^kernel/' --reps 5 --rounds 3 OLD/bench/attn_bench NEW/bench/attn_bench
    bench/attn_ab.py --filter '^(decode|decode_t2)/(f16|q8_0)/ctx32768/hd128' OLD/... NEW/...

--pin CPU runs the binaries under taskset (single-thread benchmarks only).

The same binary may be given twice (an A/A run): the gap between its two columns is what the
machine's noise alone makes of a comparison (2026-12-05, another tenant busy: decode int4t_g128
32K 232.3 vs 218.6 us, medians of 6). Odd rounds run the binaries in reverse order.

Each round runs every binary as a new process; a benchmark whose round medians lie more than 15%
apart is listed after the table ("spread"), since a shape can read at two speeds from one process
to the next (bench/BENCHMARKS.md: q5_1 at head_dim 64).
"""
import argparse
import collections
import json
import statistics
import subprocess
import sys


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("binaries", nargs="+")
    ap.add_argument("--filter", required=True)
    ap.add_argument("--reps", type=int, default=3, help="repetitions per run")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each binary, in turn")
    ap.add_argument("--pin", help="CPU list for taskset")
    a = ap.parse_args()
    times = collections.defaultdict(list)  # (name, binary) -> us of every repetition
    per_round = collections.defaultdict(list)  # (name, binary, round) -> us of that run's repetitions
    # Keyed by position, so that one binary given twice is an A/A test of the machine's noise. Odd
    # rounds run the binaries in reverse order: a binary always run first (or right after another)
    # would carry that position's share of the machine's drift.
    for rnd in range(a.rounds):
        order = list(enumerate(a.binaries))
        if rnd % 2:
            order.reverse()
        for b, path in order:
            cmd = ([ "taskset", "-c", a.pin] if a.pin else []) + [
                path, f"--benchmark_filter={a.filter}", "--benchmark_format=json",
                f"--benchmark_repetitions={a.reps}"]
            r = subprocess.run(cmd, capture_output=True, text=True)
            if r.returncode != 0:
                sys.exit(f"{path} failed: {r.stderr.strip()[-500:]}")
            for bm in json.loads(r.stdout)["benchmarks"]:
                if bm.get("run_type") == "aggregate":
                    continue
                name = bm["run_name"].split("/min_time")[0]
                scale = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}[bm["time_unit"]]
                times[(name, b)].append(bm["real_time"] * scale)
                per_round[(name, b, rnd)].append(bm["real_time"] * scale)
    names = sorted({n for n, _ in times})

    def kind(n):  # the benchmark's name with the format taken out
        parts = n.split("/")
        fmt_at = 2 if parts[0] == "kernel" else 1
        return "/".join(parts[:fmt_at] + parts[fmt_at + 1:])

    f16 = {(kind(n), b): statistics.median(times[(n, b)]) for n in names for b in range(len(a.binaries))
           if n.split("/")[2 if n.startswith("kernel/") else 1] == "f16" and times[(n, b)]}
    for i, path in enumerate(a.binaries):
        print(f"[{i}] {path}")
    spread = []
    for n in names:
        cells = []
        for b in range(len(a.binaries)):  # b: the binary's position (keys of times / per_round)
            v = times[(n, b)]
            if not v or max(v) == 0:  # not run, or skipped (a shape the format does not take)
                cells.append(f"[{b}] -")
                continue
            med = statistics.median(v)
            ref = f16.get((kind(n), b))
            x = f" ({ref / med:4.2f}x f16)" if ref else ""
            cells.append(f"[{b}] min {min(v):8.1f} med {med:8.1f}{x}")
            # Runs are separate processes, and a process's buffers land at other addresses each
            # time: some shapes read at two speeds from one process to the next (bench/BENCHMARKS.md,
            # q5_1 at head_dim 64). Round medians more than 15% apart are listed.
            rm = [statistics.median(per_round[(n, b, k)]) for k in range(a.rounds) if per_round[(n, b, k)]]
            if len(rm) > 1 and max(rm) > 1.15 * min(rm):
                spread.append(f"[{b}] {n}: round medians " + " ".join(f"{x:.1f}" for x in rm))
        print(f"{n:44s} " + "  ".join(cells))
    for line in spread:
        print("spread " + line)


if __name__ == "__main__":
    main()
