"""Median wall time of `import gptcalc` and analytic CLI queries, beside llm-analysis.

    python benchmarks/bench_cli.py [--repeat 15] [--llm-analysis-python /path/to/python]

Each query runs in a fresh process (what a user waits for at the shell). llm-analysis (PyPI)
answers the same question -- GPT-2's parameters and training FLOPs at T=1024 -- when its
interpreter is given or `llm_analysis` imports here. Goal: gptcalc takes at most a third of
llm-analysis's time.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

GOAL_RATIO = 1 / 3


def median_seconds(cmd: list[str], repeat: int, env: dict[str, str] | None = None) -> float:
    subprocess.run(cmd, capture_output=True, check=True, env=env)  # warm the file cache
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run(cmd, capture_output=True, check=True, env=env)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def llm_analysis_python(given: str | None) -> str | None:
    if given:
        return given
    probe = subprocess.run([sys.executable, "-c", "import llm_analysis"], capture_output=True)
    return sys.executable if probe.returncode == 0 else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--llm-analysis-python", default=None,
                    help="interpreter that has llm-analysis installed (e.g. a venv's python)")
    args = ap.parse_args()

    py = sys.executable
    gptcalc = [py, "-m", "gptcalc"]
    cases = {
        "python -c 'import gptcalc'": [py, "-c", "import gptcalc"],
        "gptcalc params --preset gpt2 --json": [*gptcalc, "params", "--preset", "gpt2", "--json"],
        "gptcalc flops --preset gpt2 --json": [*gptcalc, "flops", "--preset", "gpt2", "--json"],
        "gptcalc flops --preset gpt2 (rich table)": [*gptcalc, "flops", "--preset", "gpt2"],
    }
    results = {name: median_seconds(cmd, args.repeat) for name, cmd in cases.items()}
    baseline = median_seconds([py, "-c", "pass"], args.repeat)

    other = llm_analysis_python(args.llm_analysis_python)
    if other:
        # the same question: GPT-2 (124M) parameters and training FLOPs of a 1024-token sequence
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        results["llm-analysis train --model_name gpt2"] = median_seconds(
            [other, "-m", "llm_analysis.analysis", "train", "--model_name", "gpt2",
             "--gpu_name", "a100-sxm-80gb", "--batch_size_per_gpu", "1", "--seq_len", "1024",
             "--total_num_tokens", "1024", "--flops_efficiency", "0.5",
             "--hbm_memory_efficiency", "0.9", "--log_level", "ERROR"],
            args.repeat, env=env)

    print(f"median of {args.repeat} runs, fresh process each; bare interpreter: "
          f"{1000 * baseline:.0f} ms  (python {sys.version.split()[0]}, {os.cpu_count()} cpus)")
    for name, secs in results.items():
        print(f"  {1000 * secs:8.1f} ms  {name}")
    if other:
        ours = results["gptcalc flops --preset gpt2 --json"]
        theirs = results["llm-analysis train --model_name gpt2"]
        verdict = "meets" if ours <= GOAL_RATIO * theirs else "MISSES"
        print(f"gptcalc / llm-analysis = {ours / theirs:.2f} ({verdict} the goal of <= 1/3)")
    else:
        print("llm-analysis not found: pass --llm-analysis-python "
              "(pip install llm-analysis in a venv)")
    if shutil.which("gptcalc") is None:
        print("note: gptcalc console script not on PATH; timed `python -m gptcalc`")


if __name__ == "__main__":
    main()
