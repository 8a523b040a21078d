"""CPU seconds of `gptcalc plan` on Llama 3 70B, each run in a fresh process: the default
screen, `--detail` (the fewest-GPU search too) and `--json`.

    python benchmarks/bench_plan.py [--repeat 5]

Goal: the default screen takes under 2 s of user CPU (import included). CPU time, not wall
time: the machine's other load moves wall time more than it moves CPU time. The minimum over
the runs is the figure (what the command costs when nothing else competes for the cores).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys

GOAL_CPU_SECONDS = 2.0
PLAN = ["plan", "--preset", "llama3-70b", "--gpu", "h100-sxm", "--seq-len", "4096"]


def cpu_seconds(cmd: list[str], repeat: int) -> list[float]:
    """User CPU seconds of each of `repeat` runs of `cmd` (children's rusage)."""
    subprocess.run(cmd, capture_output=True, check=True)  # warm the file cache
    out = []
    for _ in range(repeat):
        before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime
        subprocess.run(cmd, capture_output=True, check=True)
        out.append(resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime - before)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()

    gptcalc = [sys.executable, "-m", "gptcalc"]
    cases = {
        "gptcalc " + " ".join(PLAN): [*gptcalc, *PLAN],
        "  ... --detail": [*gptcalc, *PLAN, "--detail"],
        "  ... --json": [*gptcalc, *PLAN, "--json"],
    }
    print(f"user CPU seconds, fresh process each, min and median of {args.repeat} "
          f"(python {sys.version.split()[0]}, {os.cpu_count()} cpus)")
    results = {}
    for name, cmd in cases.items():
        times = cpu_seconds(cmd, args.repeat)
        results[name] = min(times)
        print(f"  {min(times):6.2f}  {statistics.median(times):6.2f}  {name}")
    default = results["gptcalc " + " ".join(PLAN)]
    verdict = "meets" if default < GOAL_CPU_SECONDS else "MISSES"
    print(f"default screen: {default:.2f} s ({verdict} the goal of < {GOAL_CPU_SECONDS:g} s)")


if __name__ == "__main__":
    main()
