"""Fit the time model's two efficiencies per card on the fit subset of the published runs
(benchmarks/published_runs.py: the MPT bf16 rows at even positions of each table) and print
the grid's best, with the error on the fit rows and on every held-out row."""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import sys

sys.path.insert(0, "benchmarks")
import published_runs as pr  # noqa: E402
from gptcalc import gpus  # noqa: E402


def fit(card: str, rows: list) -> tuple[float, float, float]:
    best = None
    for mm, at in itertools.product([x / 100 for x in range(40, 86, 2)],
                                    [x / 100 for x in range(8, 66, 2)]):
        gpus.GPUS[card] = dataclasses.replace(gpus.GPUS[card], matmul_efficiency=mm,
                                              attention_efficiency=at)
        med = statistics.median(abs(pr.error(r)) for r in rows)
        if best is None or med < best[2]:
            best = (mm, at, med)
    return best


if __name__ == "__main__":
    for card, table in (("a100-sxm-80gb", pr.MPT_A100), ("h100-sxm", pr.MPT_H100)):
        print(card, fit(card, pr.fit_rows(table)))
