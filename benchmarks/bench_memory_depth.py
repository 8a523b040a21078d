"""The memory answer costs O(1) in the number of layers: `gptcalc memory -L 12` against
`-L 100000`, each in a fresh process (median wall time).

    python benchmarks/bench_memory_depth.py [--repeat 9]

Goal: -L 100000 answers in under 0.3 s, as fast as -L 12 within noise.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

GOAL_SECONDS = 0.3


def median_seconds(cmd: list[str], repeat: int) -> float:
    subprocess.run(cmd, capture_output=True, check=True)  # warm the file cache
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run(cmd, capture_output=True, check=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--repeat", type=int, default=9)
    args = ap.parse_args()
    base = [sys.executable, "-m", "gptcalc", "memory", "--preset", "gpt2", "--gpu-memory",
            "80GiB", "--json", "-L"]
    results = {L: median_seconds([*base, str(L)], args.repeat) for L in (12, 100_000)}
    for L, s in results.items():
        print(f"gptcalc memory --preset gpt2 --gpu-memory 80GiB -L {L:<7,} {s:.3f} s")
    ok = results[100_000] < GOAL_SECONDS
    print(f"goal: -L 100,000 under {GOAL_SECONDS} s: {'met' if ok else 'NOT met'}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
