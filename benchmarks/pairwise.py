"""Every pair of training options that can meet, as a covering array, run through `gptcalc
memory` and, where a twin exists on this machine, measured.

Each option below has a few levels (its first is the default). `covering_array` draws cells
(one level per option) until every pair of levels of two options is settled: it sits in a
cell gptcalc counts, or a cell was refused naming the two options (no later cell holds that
pair again). Each cell is one of:

- refused: `gptcalc memory` exits 2 with one line on stderr; the line should name both
  options of the pair that cannot meet (`names_both` checks that it names at least two of the
  cell's options);
- measured: the cell's set-up is one the engines' twins run (data parallel engines over the
  reference model with or without LoRA, fp32 or the engine's mixed precision, no recompute,
  compile, float8, offload, tp or pp): 2 gloo ranks step it and the step peak is compared
  with gptcalc's;
- modelled: gptcalc counts it and its options are each twinned elsewhere (compile, float8,
  the transformers profile, tp and pp have their own twins), but not this combination here.

With `--measure` the cells of the twinned levels alone (`twin_cells`: every engine x adapter x
precision the twins run) are added, so each of those pairs is measured, not only counted.

Run: `PYTHONPATH=. python benchmarks/pairwise.py [--measure] [--markdown]` (measuring takes a
few minutes on 2 cores). `--markdown` prints the table docs/combinations.md holds.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass, field

# option -> levels (the first is the default: no flag); each level is its CLI arguments
OPTIONS: dict[str, list[tuple[str, tuple[str, ...]]]] = {
    "engine": [("one device", ()), ("ddp", ("--dp", "2", "--zero", "0")),
               ("fsdp2", ("--dp", "2", "--zero", "3", "--engine", "fsdp2")),
               ("deepspeed", ("--dp", "2", "--zero", "2", "--engine", "deepspeed")),
               ("zero-redundancy", ("--dp", "2", "--zero", "1", "--engine",
                                    "zero-redundancy")),
               ("fsdp1", ("--dp", "2", "--zero", "3", "--engine", "fsdp1"))],
    "adapter": [("none", ()), ("lora", ("--lora-rank", "4", "--lora-targets", "q,v")),
                ("qlora", ("--lora-rank", "4", "--lora-targets", "q,v", "--weights-dtype",
                           "nf4-dq"))],
    "compile": [("none", ()), ("blocks", ("--compile", "blocks"))],
    "float8": [("none", ()), ("tensorwise", ("--float8", "tensorwise"))],
    "loss": [("standard", ()), ("chunked", ("--loss", "chunked"))],
    "offload": [("none", ()), ("optimizer cpu", ("--offload-optimizer", "cpu"))],
    "optimizer": [("adamw", ()), ("adafactor", ("--optimizer", "adafactor"))],
    "recompute": [("none", ()), ("full", ("--recompute", "full"))],
    "precision": [("fp32", ("--mode", "fp32")), ("mixed", ("--mode", "mixed"))],
    "layout": [("none", ()), ("tp 2", ("--tp", "2")), ("pp 2", ("--pp", "2"))],
    "impl": [("reference", ()), ("transformers", ("--impl", "transformers"))],
}
# the flags each option is spelled with, to see which options a refusal names
FLAGS = {"engine": ("--engine", "--zero", "--dp"), "adapter": ("--lora-rank", "--lora-targets",
                                                               "--weights-dtype"),
         "compile": ("--compile",), "float8": ("--float8",), "loss": ("--loss",),
         "offload": ("--offload-optimizer", "--offload-param"), "optimizer": ("--optimizer",),
         "recompute": ("--recompute",), "precision": ("--mode",), "layout": ("--tp", "--pp"),
         "impl": ("--impl",)}
MODEL = ("--preset", "debug", "--arch", "llama", "--set", "n_layer=2", "--set", "n_embd=128",
         "--set", "n_head=4", "--set", "vocab_size=512", "--set", "block_size=32",
         "--seq-len", "32", "--batch-size", "2",
         "--dropout", "0", "--attn", "sdpa", "--device", "cpu")
# the bound a measured cell's step peak is held to (tests/test_lora_engines.py)
PEAK_TOLERANCE = 0.02

Cell = dict[str, int]  # option -> level index


def all_pairs(options=OPTIONS) -> set[tuple[tuple[str, int], tuple[str, int]]]:
    """Every pair of levels of two different options."""
    names = list(options)
    return {((a, i), (b, j)) for a, b in itertools.combinations(names, 2)
            for i in range(len(options[a])) for j in range(len(options[b]))}


def pairs_of(cell: Cell) -> set:
    names = list(cell)
    return {((a, cell[a]), (b, cell[b])) for a, b in itertools.combinations(names, 2)}


def _pair(names: list[str], cell: Cell, other: str, name: str, k: int) -> tuple:
    """The pair of `other`'s level in `cell` and `name`'s level `k`, in option order."""
    a, b = (other, cell[other]), (name, k)
    return (a, b) if names.index(other) < names.index(name) else (b, a)


def fill(seed: tuple, todo: set, forbidden: set, options=OPTIONS) -> Cell:
    """A cell holding the pair `seed`, each other option at the level covering the most pairs
    of `todo` with the options already set (ties: the lowest level, the default first), never a
    level that makes a `forbidden` pair with them."""
    names = list(options)
    (a, i), (b, j) = seed
    cell: Cell = {a: i, b: j}
    for name in names:
        if name in cell:
            continue

        allowed = [k for k in range(len(options[name]))
                   if not any(_pair(names, cell, o, name, k) in forbidden for o in cell)] or [0]
        gain = {k: sum(_pair(names, cell, o, name, k) in todo for o in cell) for k in allowed}
        cell[name] = max(allowed, key=lambda k: (gain[k], -k))
    return {n: cell[n] for n in names}


def covering_array(run, options=OPTIONS) -> list:
    """Cells until every pair of `all_pairs` is settled, each run by `run(cell)` (an Outcome):
    a cell that runs settles all its pairs; a refused one the pairs among the options its
    message names (else its seed pair), which no later cell holds again. Seeds are taken in
    option order, so the array is the same on every run."""
    names = list(options)
    todo, forbidden, outcomes = all_pairs(options), set(), []
    while todo:
        seed = min(todo, key=lambda p: (names.index(p[0][0]), p[0][1], names.index(p[1][0]),
                                        p[1][1]))
        cell = fill(seed, todo, forbidden, options)
        outcome = run(cell)
        if outcome.status == "refused":
            settled = {p for p in pairs_of(cell)
                       if p[0][0] in outcome.named and p[1][0] in outcome.named} or {seed}
            forbidden |= settled
        else:
            settled = pairs_of(cell)
        if not settled & todo:  # a refusal naming a pair settled before: the seed with it
            settled.add(seed)
            forbidden.add(seed)
        todo -= settled
        outcomes.append(outcome)
    return outcomes


def arguments(cell: Cell) -> list[str]:
    return [*MODEL, *(a for name, k in cell.items() for a in OPTIONS[name][k][1])]


def label(cell: Cell) -> str:
    return ", ".join(f"{name} {OPTIONS[name][k][0]}" for name, k in cell.items() if k)


@dataclass
class Outcome:
    cell: Cell
    status: str  # refused | measured | modelled
    message: str = ""
    peak: int = 0
    measured: int = 0
    named: list[str] = field(default_factory=list)

    @property
    def error(self) -> float:
        return (self.peak - self.measured) / self.measured if self.measured else 0.0


def named_options(message: str, cell: Cell) -> list[str]:
    """The cell's options whose flags the refusal names."""
    return [n for n in cell if any(f in message for f in FLAGS[n])]


def run_cell(cell: Cell) -> Outcome:
    """`gptcalc memory` on the cell: refused (exit 2, one line) or its step peak."""
    import json

    from click.testing import CliRunner

    from gptcalc.cli import cli

    r = CliRunner().invoke(cli, ["memory", *arguments(cell), "--json"])
    if r.exit_code == 2:
        message = r.stderr.strip()
        return Outcome(cell, "refused", message, named=named_options(message, cell))
    if r.exit_code:
        raise RuntimeError(f"{label(cell)}: exit {r.exit_code}: {r.output[-500:]}")
    return Outcome(cell, "modelled", peak=json.loads(r.stdout)["peak"])


# levels a twin of `reference_model.distributed` runs (the rest at their defaults)
TWINNED = {"engine": {1, 2, 3, 4, 5}, "adapter": {0, 1}, "precision": {0, 1}}


def twinned(cell: Cell) -> bool:
    if any(cell[n] not in TWINNED.get(n, {0}) for n in cell):
        return False
    engine = OPTIONS["engine"][cell["engine"]][0]
    # mixed precision is twinned as FSDP2's MixedPrecisionPolicy, FSDP1's MixedPrecision and
    # DeepSpeed's bf16
    return cell["precision"] == 0 or engine in ("fsdp2", "fsdp1", "deepspeed")


def setup_of(cell: Cell):
    """The TrainingSetup `gptcalc memory` builds for a twinned cell."""
    from gptcalc import TrainingSetup

    engine = OPTIONS["engine"][cell["engine"]]
    args = dict(zip(engine[1][::2], engine[1][1::2]))
    lora = dict(lora_rank=4, lora_targets=("q", "v")) if cell["adapter"] else {}
    return TrainingSetup(dp=int(args["--dp"]), zero=int(args["--zero"]),
                         engine=args.get("--engine"), attn_impl="sdpa", keep_logits=False,
                         mode=OPTIONS["precision"][cell["precision"]][0], **lora)


def twin_cells() -> list[Cell]:
    """Every cell of the twinned levels alone (engine x adapter x precision, the rest at
    their defaults), so that each of their pairs is measured and not only counted."""
    names = list(OPTIONS)
    cells = []
    for levels in itertools.product(*(sorted(TWINNED[n]) for n in TWINNED)):
        cell = {n: 0 for n in names} | dict(zip(TWINNED, levels))
        if twinned(cell):
            cells.append(cell)
    return cells


def measure(outcomes: list[Outcome]) -> None:
    """Step every twinned cell on 2 gloo ranks (one launch) and record its measured peak."""
    from gptcalc import Workload, from_name
    from gptcalc.memory import step_peak
    from reference_model.distributed import run_each

    cfg = from_name("debug", arch="llama", n_layer=2, n_embd=128, n_head=4, vocab_size=512,
                    block_size=32, dropout=0.0)  # MODEL's
    wl = Workload(2, 32)
    todo = [o for o in outcomes if o.status == "modelled" and twinned(o.cell)]
    layouts = [(cfg, wl, setup_of(o.cell)) for o in todo]
    for o, (c, w, s), results in zip(todo, layouts, run_each(layouts) if layouts else []):
        r = results[0]
        o.status = "measured"
        o.peak = step_peak(c, w, s).bytes
        o.measured = r.peak - r.peak_categories.get("Buffer", 0)


def markdown(outcomes: list[Outcome]) -> str:
    refused = [o for o in outcomes if o.status == "refused"]
    measured = [o for o in outcomes if o.status == "measured"]
    worst = max((abs(o.error) for o in measured), default=0.0)
    lines = [f"{len(outcomes)} cells settle every pair of the levels above; "
             f"{len(measured)} measured (worst step-peak error {worst:.2%}), "
             f"{len(refused)} refused, "
             f"{len(outcomes) - len(measured) - len(refused)} modelled.", "",
             "| cell (options off their default) | outcome |", "|---|---|"]
    for o in outcomes:
        if o.status == "measured":
            what = f"measured: {o.peak:,} B against {o.measured:,} B ({o.error:+.2%})"
        elif o.status == "refused":
            what = "refused: " + o.message.replace("|", "\\|")
        else:
            what = f"modelled: {o.peak:,} B"
        lines.append(f"| {label(o.cell) or 'every default'} | {what} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    outcomes = covering_array(run_cell)
    if "--measure" in argv:
        seen = [o.cell for o in outcomes]
        outcomes += [run_cell(c) for c in twin_cells() if c not in seen]
        measure(outcomes)
    if "--markdown" in argv:
        print(markdown(outcomes))
        return 0
    for o in outcomes:
        print(f"{o.status:9s} {label(o.cell) or 'every default'}: "
              + (o.message if o.status == "refused" else f"{o.peak:,} B")
              + (f" vs {o.measured:,} B ({o.error:+.2%})" if o.measured else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
