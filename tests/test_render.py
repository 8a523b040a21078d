"""Tables never cut a number: at any terminal width, piped or not, every number a command's JSON
holds that its text prints appears whole in the text."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from gptcalc.cli import cli
from gptcalc.units import binary_bytes

COMMANDS = {
    "memory": "memory --preset llama3-70b --engine fsdp2 --zero 3 --dp 8 --gpu-memory 80GiB "
              "--detail",
    "memory-short": "memory --preset llama3-70b --engine fsdp2 --zero 3 --dp 8 --gpu h100-sxm",
    "flops": "flops --preset llama3-70b",
    "params": "params --preset llama3-70b --lora-rank 16",
    "serve": "serve --preset llama3-70b --tp 8",
    "infer": "infer --preset llama3-70b --tp 8",
    "time": "time --preset llama3-70b --tokens 15000000000000 --gpus 1024",
    "gpus": "gpus",
}
# how many of the JSON's integers each command's text prints (at least): a floor, so that the
# check below never passes on a text that prints none
PRINTED = {"memory": 20, "memory-short": 8, "flops": 6, "params": 10, "serve": 4, "infer": 4,
           "time": 5, "gpus": 5}


def run(args: str, columns: str | None) -> str:
    r = CliRunner().invoke(cli, args.split(), env={"COLUMNS": columns})
    assert r.exit_code == 0, r.output
    return r.output


def integers(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from integers(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from integers(v)
    elif isinstance(obj, int) and not isinstance(obj, bool) and obj >= 1000:
        yield obj


def shown(value: int, text: str) -> bool:
    return f"{value:,}" in text or binary_bytes(value) in text


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_printed_number_is_whole_at_every_width(name):
    args = COMMANDS[name]
    values = set(integers(json.loads(run(args + " --json", None))))
    wide = run(args, "100000")
    printed = {v for v in values if shown(v, wide)}
    assert len(printed) >= PRINTED[name]
    for columns in ("60", "80", "120", None):  # None: piped, no width given
        text = run(args, columns)
        assert "…" not in text
        missing = sorted(v for v in printed if not shown(v, text))
        assert not missing, f"COLUMNS={columns}: {missing}"


def test_memory_detail_prints_every_line_of_its_json_in_80_columns():
    args = COMMANDS["memory"]
    out = json.loads(run(args + " --json", None))
    text = run(args, "80")
    for key in ("weights", "gradients", "optimizer", "activations", "activations_paper",
                "kv_cache", "resident", "peak"):
        assert f"{out[key]:,}" in text, key


def test_labels_wrap_and_the_table_keeps_to_the_width_it_is_given():
    text = run("memory --preset llama3-8b -B 1 --gpu-memory 80GiB --detail", "80")
    table = [line for line in text.splitlines() if line[:1] in "┏┃┡│├└"]
    assert table and max(map(len, table)) <= 80
    assert any(line.startswith("│ (ddp: weights") or "(ddp:" in line for line in table)


def test_piped_output_is_as_wide_as_its_content():
    text = run("memory --preset gpt2 --zero 1 --detail", None)
    assert "1,493,277,700" in text
    assert "resident between steps (deepspeed: weights, optimizer states, kept gradients and " \
           "buffers)" in text  # not wrapped: no width to keep to


def screen_rows(text: str, columns: int = 80) -> int:
    """The rows `text` takes on a terminal `columns` wide (a longer line wraps)."""
    return sum(max(1, -(-len(line.rstrip()) // columns)) for line in text.splitlines())


# the answer in one screen: a terminal of 80 x 24 holds it
SCREEN_ROWS = 24


@pytest.mark.parametrize("args", [
    "memory --preset llama3-8b --gpu h100-sxm",
    "memory --preset llama3-8b",
    "memory --preset llama3-70b --engine fsdp2 --zero 3 --dp 8 --gpu h100-sxm",
    "memory --preset gpt2 -B 8 --gpu h100-sxm",
])
def test_memory_answers_in_one_screen_verdict_first(args):
    text = run(args, "80")
    assert screen_rows(text) <= SCREEN_ROWS, text
    assert "Korthikanti" not in text and "resident between steps" not in text
    first = text.splitlines()[0]
    if "--gpu" in args:
        out = json.loads(run(args + " --json", None))
        verdict = out["fit"]["verdict"]
        assert first.startswith("Fits " if verdict["fits"] else "Does not fit ")
        assert binary_bytes(verdict["must_hold"]) in first
        assert binary_bytes(abs(verdict["margin"])) in first
        head = text.split("Assuming ")[0]  # the verdict's lines, wrapped at 80 columns
        assert binary_bytes(out["peak"]) in " ".join(head.split())  # the lower bound
    else:
        assert first.startswith("Assuming ")
    detail = run(args + " --detail", None)
    assert "Korthikanti et al. 2022 (for comparison)" in detail
    assert screen_rows(detail) > SCREEN_ROWS


# The one-screen answer of the commands people run most, layouts included: at most SCREEN_ROWS
# lines at COLUMNS=80, none wider than 80 (the long lines are broken at spaces, not by the
# terminal), while --detail still prints every line.
ONE_SCREEN = [
    "memory --preset llama3-8b --gpu h100-sxm --pp 4",
    "memory --preset llama3-8b --gpu h100-sxm --pp 2 --dp 2",
    "memory --preset llama3-70b --gpu h100-sxm --pp 8",
    "memory --preset llama3-70b --gpu h100-sxm --tp 8 --pp 4 --dp 2 --sp",
    "memory --preset llama3-8b --gpu h100-sxm --lora-rank 16",
    "memory --preset llama3-70b --gpu h100-sxm --lora-rank 16 --weights-dtype int4 "
    "--engine fsdp2 --zero 3 --dp 8",
    "memory --preset llama3-8b --gpu h100-sxm --zero 3 --dp 8 --offload-optimizer cpu",
    "memory --preset llama3-8b --gpu h100-sxm --offload-activations",
    "serve --preset llama3-8b --gpu h100-sxm",
    "serve --preset llama3-8b --gpu h100-sxm --tp 2 --pp 2",
    "time --preset llama3-8b --gpu h100-sxm",
    "time --preset llama3-70b --gpu h100-sxm --tp 8 --pp 4 --dp 16 --grad-accum 16",
]
# what only --detail prints, per command: the full ledger
DETAIL_ONLY = {"memory": "Korthikanti et al. 2022 (for comparison)",
               "serve": "activation peak: logits",
               "time": "The same budget by each shorthand"}


@pytest.mark.parametrize("args", ONE_SCREEN)
def test_one_screen_at_80_columns_and_detail_holds_the_rest(args):
    text = run(args, "80")
    lines = text.splitlines()
    assert len(lines) <= SCREEN_ROWS, text
    assert max(len(line.rstrip()) for line in lines) <= 80, text
    only = DETAIL_ONLY[args.split()[0]]
    assert only not in text
    assert only in run(args + " --detail", None)


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f}"


@pytest.mark.parametrize("args", [a for a in ONE_SCREEN if a.startswith("memory") and "--pp" in a])
def test_a_pipeline_is_judged_on_its_worst_rank_and_every_rank_is_on_the_screen(args):
    out = json.loads(run(args + " --json", None))
    stages, verdict = out["stages"], out["fit"]["verdict"]
    assert len(stages) == out["setup"]["pp"] > 1
    # the verdict is the rank that must hold the most, whichever rank allocates the most
    assert verdict["reserved"] == max(s["reserved"] for s in stages)
    assert verdict["allocated_peak"] == max(s["peak"] for s in stages) == out["peak"]
    text = run(args, "80")
    flat = " ".join(text.split())
    worst = max(stages, key=lambda s: s["reserved"])
    assert f"the verdict is rank {worst['rank']}'s" in flat
    # every rank's allocated peak and reserved bytes, rank 0 first, on the compact line
    assert "allocated peak " + " ".join(_gib(s["peak"]) for s in stages) + " GiB" in flat
    assert "reserved " + " ".join(_gib(s["reserved"]) for s in stages) + " GiB" in flat
    # --detail: the per-rank ledger, each rank's peak and reserved whole
    detail = run(args + " --detail", None)
    assert "Pipeline stages" in detail
    for s in stages:
        assert binary_bytes(s["peak"]) in detail and binary_bytes(s["reserved"]) in detail


def test_a_wrapped_line_keeps_numbers_with_their_units_and_options_with_their_values():
    from gptcalc.cli.render import wrap_text

    text = ("To fit, add one of: --seq-len 4288 (78.38 GiB); --recompute op (63.43 GiB); "
            "--zero 3 --dp 2 (72.80 GiB); 8,192 tokens in 1.25 s")
    for width in range(16, 90):  # from the longest glued word up
        lines = wrap_text(text, width)
        assert " ".join(lines) == text
        assert all(len(line) <= width for line in lines)
        for glued in ("78.38 GiB", "--seq-len 4288", "--zero 3", "--dp 2", "8,192 tokens",
                      "1.25 s"):
            assert any(glued in line for line in lines), (width, glued)
    assert wrap_text("  per GPU, budget: 79.22 GiB x 0.9", 20) == [
        "  per GPU, budget:", "  79.22 GiB x 0.9"]


def test_the_screen_lists_five_terms_of_the_peak_and_sums_the_rest_from_the_sixth():
    from gptcalc.cli.memory import _TERMS_SHOWN, _short_terms

    assert _TERMS_SHOWN == 5
    five = {f"t{i}": (i + 1) * 2**30 for i in range(5)}
    assert [row[0] for row in _short_terms(five)] == list(five)  # all five, in order
    rows = _short_terms({"small": 2**20, **five, "zero": 0})
    assert len(rows) == 5 and rows[-1] == ["2 smaller terms (--detail: each)",
                                           binary_bytes(2**20 + 2**30)]
    assert [row[0] for row in rows[:4]] == ["t1", "t2", "t3", "t4"]  # the largest, in order


@pytest.mark.parametrize("pp, listed", [(16, True), (17, False)])
def test_every_rank_is_on_the_line_up_to_sixteen_ranks(pp, listed):
    from types import SimpleNamespace

    from gptcalc.cli.memory import _rank_line
    from gptcalc.memory.summary import StageFigures

    stages = [StageFigures(rank=r, layers=1, held_layers=1, weights=0, gradients=0,
                           optimizer=0, activations=0, peak=(r + 1) * 2**30, peak_phase="x",
                           reserved=(r + 2) * 2**30) for r in range(pp)]
    line = _rank_line(SimpleNamespace(pp_schedule="1f1b"), SimpleNamespace(stages=stages),
                      judged=True)
    assert f"the verdict is rank {pp - 1}'s" in line  # the most reserved
    if listed:
        assert "allocated peak " + " ".join(f"{r + 1}.00" for r in range(pp)) + " GiB" in line
    else:
        assert f"from 1.00 GiB (rank 0) to {pp}.00 GiB (rank {pp - 1})" in line
