"""`gptcalc plan` against `gptcalc memory` re-run independently, and the search against brute
force: every plan fits, every layout that fits is found, with the micro-batch the rule picks,
in the order the step time gives."""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path

import pytest
from click.testing import CliRunner

from gptcalc import api
from gptcalc.cli import cli
from gptcalc.config import GPTConfig
from gptcalc.errors import ConfigError
from gptcalc.gpus import gpu
from gptcalc.memory import memory_report
from gptcalc.plan import (DEFAULT_TOKENS_PER_STEP, PLANNED_RECOMPUTE, candidate_layouts,
                          global_batch, search)
from gptcalc.training import resolve_training
from gptcalc.units import binary_bytes
from gptcalc.workload import Workload

H100 = gpu("h100-sxm")
SEQ, BATCH, MAX_GPUS = 128, 8, 16


def run(*args: str):
    return CliRunner().invoke(cli, list(args))


def run_json(*args: str) -> dict:
    r = run(*args, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def rerun_peak(command: str) -> dict:
    """A plan's command through `gptcalc memory --json`."""
    args = shlex.split(command)
    assert args[:2] == ["gptcalc", "memory"]
    return run_json(*args[1:])


def assert_commands_reproduce(out: dict) -> None:
    for plan in out["plans"]:
        mem = rerun_peak(plan["command"])
        assert mem["peak"] == plan["peak"] <= out["budget"]
        assert mem["fit"]["max_batch"] >= plan["micro_batch"]
        assert mem["workload"] == {"batch_size": plan["micro_batch"], "seq_len": out["seq_len"],
                                   "grad_accum": plan["grad_accum"]}
        assert mem["global_batch"] == out["global_batch"]
        assert (mem["setup"]["dp"], mem["setup"]["tp"], mem["setup"]["pp"],
                mem["setup"]["zero"], mem["setup"]["engine"], mem["setup"]["recompute"]) == (
            plan["dp"], plan["tp"], plan["pp"], plan["zero"], plan["engine"], plan["recompute"])
        assert plan["gpus"] == plan["dp"] * plan["tp"] * plan["pp"] * plan["cp"]


# --- the command: each plan's command re-run through `gptcalc memory` ---------------------------


def test_70b_plans_are_reproduced_by_memory():
    out = run_json("plan", "--preset", "llama3-70b", "--gpu", "h100-sxm", "--seq-len", "4096",
                   "--top", "3")
    assert out["global_batch"] == DEFAULT_TOKENS_PER_STEP // 4096 == 1024
    # the H100 SXM's usable memory (torch.cuda.mem_get_info's total: 79.22 GiB as vLLM logs it)
    assert out["budget"] == round(79.22 * 2**30)
    assert len(out["plans"]) == 3
    assert_commands_reproduce(out)
    assert_commands_reproduce({**out, "plans": [out["fewest_gpus"]]})
    # 70B's weights, gradients and AdamW states (16 bytes a parameter) are 1.1 TB: more than
    # 8 GPUs however sharded
    assert out["fewest_gpus"]["gpus"] > 8
    # the pruning evaluates few of the layouts
    assert out["searched"]["step_peaks"] < out["searched"]["layouts"] / 5


def test_small_model_every_plan_reproduced():
    out = run_json("plan", "--preset", "gpt2", "--seq-len", "512", "--gpu-memory", "6GiB",
                   "--global-batch", "16", "--max-gpus", "8", "--top", "25")
    assert len(out["plans"]) == 25
    assert_commands_reproduce(out)
    seconds = [p["step_seconds"] for p in out["plans"]]
    assert seconds == sorted(seconds)
    for p in out["plans"]:
        assert p["tokens_per_second"] == pytest.approx(16 * 512 / p["step_seconds"])


def test_lora_plans_are_data_parallel_and_reproduced():
    out = run_json("plan", "--preset", "llama3-8b", "--seq-len", "2048", "--gpu", "a10g",
                   "--lora-rank", "16", "--lora-targets", "q,v", "--weights-dtype", "int4",
                   "--global-batch", "8", "--max-gpus", "8", "--top", "4")
    assert out["plans"]
    assert all(p["tp"] == p["pp"] == 1 for p in out["plans"])
    assert all("--lora-rank 16" in p["command"] for p in out["plans"])
    assert_commands_reproduce(out)


def test_detail_lists_the_table_the_commands_and_the_fewest():
    r = run("plan", "--preset", "gpt2", "--seq-len", "512", "--gpu-memory", "6GiB",
            "--global-batch", "16", "--max-gpus", "8", "--top", "3", "--detail")
    assert r.exit_code == 0, r.output
    assert "Layouts that fit, fastest first" in r.output
    assert "3: gptcalc memory --preset gpt2 --seq-len 512" in r.output
    assert "Fewest GPUs: 1 " in r.output


SCREENS = [
    ("--preset", "llama3-70b", "--gpu", "h100-sxm", "--seq-len", "4096"),
    ("--preset", "gpt2", "--seq-len", "512", "--gpu-memory", "6GiB", "--global-batch", "16",
     "--max-gpus", "8"),
    ("--preset", "gpt2", "-L", "4", "--seq-len", "128", "--global-batch", "8", "--max-gpus",
     "16", "--gpus", "4", "--mfu", "0.4"),
    ("--preset", "gpt2", "-L", "4", "--seq-len", "128", "--global-batch", "8", "--max-gpus",
     "16", "--tokens", "1e6", "--days", "1"),
    ("--preset", "llama3-8b", "--seq-len", "4096", "--gpu-memory", "20GiB", "--max-gpus", "2",
     "--global-batch", "8"),
]


@pytest.mark.parametrize("args", SCREENS)
def test_the_default_output_is_one_screen_with_the_answer_first(args):
    r = run("plan", *args)
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert len(lines) <= 25 and max(map(len, lines)) <= 80, r.stdout
    out = run_json("plan", *args, "--top", "1")
    first = " ".join(lines).split(" Assuming ")[0]  # the answer, before its assumptions
    if not out["plans"]:
        assert first.startswith("No layout") and "closest:" in first
        return
    best = out["plans"][0]
    assert first.startswith(("Fastest that fits: ", "Fastest on 4 GPUs: ",
                             "Fewest GPUs that finish in time: "))
    held = best["must_hold"]
    seconds = best["step_seconds"]
    shown_seconds = f"{seconds:.2f}" if 1 <= seconds < 100 else f"{seconds:.3g}"
    for figure in (f"{best['gpus']:,} GPUs", f"{shown_seconds} s per step",
                   f"{best['tokens_per_second']:,.0f} tokens/s",
                   f"peak {binary_bytes(best['peak'])} per GPU",
                   f"{binary_bytes(held)} to hold of {binary_bytes(out['budget'])}",
                   f"(margin {binary_bytes(out['budget'] - held)})"):
        assert figure in first, (figure, first)
    # the first row is the answer, and the command under the table reproduces it
    head = next(i for i, x in enumerate(lines) if x.startswith("#") and "GPUs" in x)
    row = lines[head + 1].split()
    assert row[1] == f"{best['gpus']:,}" and row[-1] == shown_seconds
    start = next(i for i, x in enumerate(lines) if x.startswith("#1: "))
    end = next(i for i, x in enumerate(lines) if x.startswith("--detail"))
    shown = " ".join(x.removesuffix("\\").strip() for x in lines[start:end])
    assert all(len(x) <= 80 for x in lines[start:end])
    assert shlex.split(shown.removeprefix("#1: ")) == shlex.split(best["command"])


def test_detail_keeps_the_full_table():
    args = ("plan", "--preset", "gpt2", "--seq-len", "512", "--gpu-memory", "6GiB",
            "--global-batch", "16", "--max-gpus", "8")
    short, full = run(*args).stdout, run(*args, "--detail").stdout
    out = run_json(*args)
    assert len(out["plans"]) == 10 and out["fewest_gpus"] is not None
    for header in ("B x accum", "peak / GPU"):  # the full table's columns
        assert header in full and header not in short
    assert "10: gptcalc memory" in full and "Fewest GPUs:" in full
    assert "equal step times: fewer GPUs" in full
    lines = short.splitlines()
    head = next(i for i, x in enumerate(lines) if x.startswith("#") and "GPUs" in x)
    rows = lines[head + 1:next(i for i, x in enumerate(lines) if x.startswith("#1: "))]
    assert len(rows) == 5  # the default screen's plans, the first five of the full list
    for i, (row, plan) in enumerate(zip(rows, out["plans"]), 1):
        cells = row.split()
        assert cells[:2] == [str(i), f"{plan['gpus']:,}"]
        assert float(cells[-1]) == pytest.approx(plan["step_seconds"], rel=5e-3)


def test_engines_limits_the_engines_planned():
    out = run_json("plan", "--preset", "gpt2", "--seq-len", "512", "--gpu-memory", "6GiB",
                   "--global-batch", "16", "--max-gpus", "8", "--top", "8",
                   "--engines", "fsdp2,megatron")
    assert len(out["plans"]) == 8
    assert {p["engine"] for p in out["plans"]} <= {"fsdp2", "megatron"}
    assert_commands_reproduce(out)


def test_a_config_files_training_tables_reach_every_plan(tmp_path):
    run_toml = tmp_path / "run.toml"
    run_toml.write_text('[model]\npreset = "gpt2"\n[training]\noptimizer = "sgd-momentum"\n'
                        '[parallel]\nsp = true\n')
    out = run_json("plan", "--config", str(run_toml), "--seq-len", "512", "--gpu-memory",
                   "4GiB", "--global-batch", "8", "--max-gpus", "8", "--top", "6")
    assert out["plans"]
    assert all(f"--config {run_toml}" in p["command"] for p in out["plans"])
    assert_commands_reproduce(out)
    mem = rerun_peak(out["plans"][0]["command"])
    assert mem["setup"]["optimizer"] == "sgd-momentum"
    assert mem["setup"]["sp"] == out["plans"][0]["sp"]


def test_nothing_fits_says_so_and_names_the_closest():
    args = ("plan", "--preset", "llama3-8b", "--seq-len", "4096", "--gpu-memory", "20GiB",
            "--max-gpus", "2", "--global-batch", "8")
    r = run(*args)
    assert r.exit_code == 0, r.output
    assert "No layout fits 20.00 GiB per GPU within 2 GPUs; closest:" in r.output
    out = run_json(*args)
    assert out["plans"] == [] and out["fewest_gpus"] is None
    c = out["closest"]
    assert c["peak"] > out["budget"]
    cmd = (f"gptcalc memory --preset llama3-8b --seq-len 4096 -B {c['micro_batch']} "
           f"--grad-accum {c['grad_accum']} --dp {c['dp']} --tp {c['tp']} --pp {c['pp']} "
           f"--zero {c['zero']} --engine {c['engine']} --recompute {c['recompute']}"
           + (" --sp" if c["sp"] else ""))
    assert rerun_peak(cmd)["peak"] == c["peak"]


@pytest.mark.parametrize("args, option", [
    (("-B", "2"), "--batch-size"),
    (("--grad-accum", "2"), "--grad-accum"),
    (("--tokens-per-step", "1000"), "--tokens-per-step"),
    (("--global-batch", "8", "--tokens-per-step", "4096"), "--global-batch"),
    (("--global-batch", "0"), "--global-batch"),
    (("--max-gpus", "0"), "--max-gpus"),
    (("--top", "0"), "--top"),
    (("--mfu", "1.5"), "--mfu"),
    (("--gpu", "nope"), "--gpu"),
    (("--gpu", "cpu"), "--gpu:"),
    (("--lora-targets", "q"), "--lora-targets"),
    (("--engines", "fsdp3"), "--engines"),
    (("--engines", ","), "--engines"),
])
def test_bad_input_is_one_line_naming_the_option(args, option):
    r = run("plan", "--preset", "gpt2", "--seq-len", "512", *args)
    assert r.exit_code == 2, r.output
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and option in lines[0], r.stderr


def test_a_recipes_micro_batch_is_refused_naming_its_key():
    # the planner chooses the micro-batch: a recipe's per-device batch is refused as typed -B is
    recipe = (Path(__file__).parent / "recipes" / "shipped" / "alignment-handbook" / "recipes"
              / "smollm2" / "sft" / "config.yaml")
    r = run("plan", "--recipe", str(recipe), "--gpu", "h100-sxm", "--max-gpus", "8")
    assert r.exit_code == 2 and r.stdout == ""
    assert "per_device_train_batch_size" in r.stderr and "--global-batch" in r.stderr


def test_global_batch_defaults_to_4m_tokens():
    assert global_batch(4096) == 1024
    assert global_batch(8192, tokens_per_step=8192 * 3) == 3
    assert global_batch(2**23) == 1  # at least one sequence
    with pytest.raises(ConfigError):
        global_batch(512, tokens_per_step=1000)


# --- the search against brute force --------------------------------------------------------------


def _model(preset: str, **sizes) -> GPTConfig:
    return api.resolve_setup(preset=preset, seq_len=SEQ, overrides=sizes).config


MODELS = {
    # GPT-2 blocks, 12 heads: tp 1, 2, 4
    "gpt2": _model("gpt2", n_layer=4),
    # Llama blocks with 2 key/value heads: tp 4 and 8 are refused by the model, not the search
    "llama": _model("llama3-8b", n_layer=4, n_embd=256, n_head=8, n_kv_head=2, d_ff=512,
                    vocab_size=1000),
}


def _setup(cfg, layout):
    """The layout's set-up, resolved here as `gptcalc memory` resolves its options."""
    given = {"dp": layout.dp, "tp": layout.tp, "pp": layout.pp, "sp": layout.sp,
             "engine": layout.engine, "zero": layout.zero, "recompute": layout.recompute,
             "cp": layout.cp, "pp_schedule": layout.schedule, "pp_virtual": layout.virtual}
    return resolve_training(cfg, {}, given)[0]


def _brute(cfg) -> dict:
    """Every candidate layout's peak at every micro-batch dividing its share of the batch,
    by memory_report; a layout the model or engine refuses is left out."""
    out = {}
    for layout in candidate_layouts(cfg, SEQ, BATCH, MAX_GPUS):
        try:
            setup = _setup(cfg, layout)
            n = BATCH // layout.dp
            out[layout] = {b: memory_report(cfg, Workload(b, SEQ, n // b), setup).peak.bytes
                           for b in range(1, n + 1) if n % b == 0}
        except ConfigError:
            continue
    return out


@pytest.fixture(scope="module", params=sorted(MODELS))
def brute(request):
    cfg = MODELS[request.param]
    return cfg, _brute(cfg)


def _budgets(peaks: dict) -> list[int]:
    smallest = sorted(min(p.values()) for p in peaks.values())
    return [smallest[len(smallest) * q // 8] for q in (1, 3, 5, 7)] + [smallest[0] - 1]


def _search(cfg, budget, **kw):
    return search(cfg, SEQ, BATCH, budget, H100, max_gpus=MAX_GPUS, **kw)


def test_one_replica_can_need_less_than_two():
    # DDP's gradient buckets exist with more than one replica only: dp = 1 is a group of its own
    cfg = MODELS["gpt2"]
    one, two = (memory_report(cfg, Workload(1, SEQ, BATCH // dp), resolve_training(
        cfg, {}, {"dp": dp, "engine": "ddp", "zero": 0})[0]).peak.bytes for dp in (1, 2))
    assert one < two


def test_memory_is_monotone_where_the_search_prunes(brute):
    cfg, peaks = brute
    for layout, by_b in peaks.items():
        n = BATCH // layout.dp
        below = [by_b[b] for b in sorted(by_b) if b < n]
        # grows with B at a given accumulation; under a pipeline the accumulation is the
        # schedule's micro-batches, whose logits and input gradients the last stage keeps:
        # the search tries every B there
        assert layout.pp > 1 or below == sorted(below), layout
        r = PLANNED_RECOMPUTE.index(layout.recompute)
        if r + 1 < len(PLANNED_RECOMPUTE):
            less = peaks[dataclasses.replace(layout, recompute=PLANNED_RECOMPUTE[r + 1])]
            assert all(less[b] <= by_b[b] for b in by_b), layout
        same = ("tp", "pp", "sp", "cp", "schedule", "virtual", "engine", "zero", "recompute")
        bigger = [other for other in peaks if layout.dp > 1 and other.dp > layout.dp and all(
            getattr(other, k) == getattr(layout, k) for k in same)]
        for other in bigger:  # more replicas: the least peak of a layout does not grow
            assert min(peaks[other].values()) <= min(by_b.values()), (layout, other)


@pytest.mark.parametrize("q", range(5))
def test_search_finds_every_layout_that_fits_and_nothing_else(brute, q):
    cfg, peaks = brute
    budget = _budgets(peaks)[q]
    found = _search(cfg, budget)
    fitting = {layout for layout, by_b in peaks.items() if min(by_b.values()) <= budget}
    assert {p.layout for p in found.plans} == fitting
    assert len(found.plans) == len(fitting)  # each layout once
    for p in found.plans:
        fits = sorted(b for b, peak in peaks[p.layout].items() if peak <= budget)
        # no pipeline: the largest micro-batch that fits; a pipeline: the most micro-batches
        assert p.micro_batch == (fits[-1] if p.layout.pp == 1 else fits[0])
        assert p.peak == peaks[p.layout][p.micro_batch] <= budget
        assert p.grad_accum * p.micro_batch * p.layout.dp == BATCH
    keys = [(p.step_seconds, p.gpus) for p in found.plans]
    assert keys == sorted(keys)
    if not fitting:
        least = min(min(by_b.values()) for by_b in peaks.values())
        assert found.closest is not None and found.closest.peak == least > budget


@pytest.mark.parametrize("q", range(4))
def test_top_is_the_head_of_the_full_ranking(brute, q):
    cfg, peaks = brute
    budget = _budgets(peaks)[q]
    full = _search(cfg, budget).plans
    for top in (1, 3, 10):
        assert _search(cfg, budget, top=top).plans == full[:top]
    fewest = _search(cfg, budget, top=1, order="gpus").plans
    assert fewest[0].gpus == min(p.gpus for p in full)
    assert fewest[0].step_seconds == min(p.step_seconds for p in full
                                         if p.gpus == fewest[0].gpus)


def test_no_plan_with_fewer_gpus_at_the_same_settings_is_missed(brute):
    cfg, peaks = brute
    budget = _budgets(peaks)[2]
    listed = {p.layout for p in _search(cfg, budget).plans}
    for layout in listed:
        for other, by_b in peaks.items():
            if (other.group, other.recompute) == (layout.group, layout.recompute) and (
                    other.dp < layout.dp and min(by_b.values()) <= budget):
                assert other in listed, other


def test_step_time_is_the_time_models():
    # plan and time use one model: each plan's step time is gptcalc.time.step_time's for its
    # set-up, micro-batch and accumulation
    from gptcalc.time import step_time

    cfg = MODELS["gpt2"]
    plans = _search(cfg, 10**12).plans
    assert plans
    for p in plans:
        t = step_time(cfg, p.setup, p.micro_batch, SEQ, p.grad_accum, H100)
        assert p.step_seconds == t.step_seconds
        assert p.tokens_per_second == pytest.approx(BATCH * SEQ / t.step_seconds)


def test_a_given_mfu_is_hardware_flops_over_the_gpus_with_the_bubble():
    from gptcalc.flops import count_flops

    cfg = MODELS["gpt2"]
    for p in _search(cfg, 10**12, mfu=0.4).plans:
        flops = BATCH * count_flops(cfg, Workload(1, SEQ), recompute=p.layout.recompute
                                    ).hardware_total
        bubble = (p.layout.pp - 1) / p.grad_accum
        assert p.step_seconds == pytest.approx(
            flops / (p.gpus * H100.bf16_flops * 0.4) * (1 + bubble))


def test_the_states_bound_never_exceeds_a_peak(brute):
    # the search skips a layout whose states alone overflow: the bound must be below every
    # peak it stands for
    from gptcalc.plan import states_lower_bound

    cfg, peaks = brute
    for layout, by_b in peaks.items():
        assert states_lower_bound(cfg, _setup(cfg, layout)) <= min(by_b.values()), layout


def test_the_fewest_gpus_come_from_the_same_search(brute):
    cfg, peaks = brute
    budget = _budgets(peaks)[1]
    found = _search(cfg, budget, top=3)
    by_gpus = _search(cfg, budget, top=1, order="gpus").plans
    assert (found.fewest is None) == (not by_gpus)
    if by_gpus:
        assert found.fewest == by_gpus[0]


def test_gpus_lists_the_layouts_of_that_count():
    cfg = MODELS["gpt2"]
    found = search(cfg, SEQ, BATCH, 10**12, H100, gpus=4)
    assert found.plans and all(p.gpus == 4 for p in found.plans)
    assert [p.step_seconds for p in found.plans] == sorted(p.step_seconds for p in found.plans)


def test_a_deadline_keeps_the_plans_that_finish_in_time():
    cfg = MODELS["gpt2"]
    every = _search(cfg, 10**12).plans
    limit = sorted(p.step_seconds for p in every)[len(every) // 2]
    found = _search(cfg, 10**12, max_step_seconds=limit, order="gpus")
    assert {p.layout for p in found.plans} == {p.layout for p in every
                                               if p.step_seconds <= limit}
    assert found.fewest.gpus == min(p.gpus for p in every if p.step_seconds <= limit)


def test_a_capped_search_says_so():
    cfg = MODELS["gpt2"]
    found = _search(cfg, 10**12, max_evaluations=3)
    assert found.capped
    out = run("plan", "--preset", "gpt2", "-L", "4", "--seq-len", "128", "--global-batch",
              "8", "--max-gpus", "16", "--max-evaluations", "3")
    assert out.exit_code == 0 and "stopped after" in out.stdout


def test_cli_gpus_and_deadline_and_the_tie_rule():
    base = ("plan", "--preset", "gpt2", "-L", "4", "--seq-len", "128", "--global-batch", "8",
            "--max-gpus", "16")
    out = run_json(*base, "--gpus", "4")
    assert out["plans"] and all(p["gpus"] == 4 for p in out["plans"])
    assert "fewer GPUs" in out["tie_rule"]
    text = run(*base, "--detail").stdout
    assert "equal step times: fewer GPUs" in text
    slow = run_json(*base, "--tokens", "1e6", "--days", "1")
    assert slow["plans"] and slow["fewest_gpus"]["gpus"] == slow["plans"][0]["gpus"]
    fast = run_json(*base, "--tokens", "1e15", "--days", "1e-3")
    assert fast["plans"] == []
    r = run(*base, "--tokens", "1e6")
    assert r.exit_code == 2 and "--days" in r.stderr


def test_the_time_bound_never_exceeds_a_step_time(brute):
    # the search pops layouts by this bound (FLOPs at the best efficiency, the bubble's slots
    # of one sequence): a plan ranks correctly only if it is below every micro-batch's time
    from gptcalc.plan import _lower_bound
    from gptcalc.time import step_time

    cfg, peaks = brute
    bound = _lower_bound(cfg, SEQ, H100, "bf16", False)
    for layout, by_b in peaks.items():
        setup, n = _setup(cfg, layout), BATCH // layout.dp
        for b in by_b:
            s = step_time(cfg, setup, b, SEQ, n // b, H100).step_seconds
            assert bound(layout, BATCH) <= s, (layout, b)


def test_a_ranks_peak_is_at_most_the_step_peak(brute):
    # a pipeline micro-batch is ruled out when its first or last rank alone overflows
    from gptcalc.memory.peak import step_account, step_peak

    cfg, peaks = brute
    for layout in [x for x in peaks if x.pp > 1][::7]:
        setup, n = _setup(cfg, layout), BATCH // layout.dp
        for b in peaks[layout]:
            w = Workload(b, SEQ, n // b)
            whole = step_peak(cfg, w, setup).bytes
            assert whole == peaks[layout][b]
            for stage in ("first", "last"):
                account = step_account(cfg, w, setup, stage)
                assert account.totals[account.peak_phase] <= whole


def test_the_first_ranks_bound_never_exceeds_its_peak(brute):
    # a micro-batch is ruled out when the first rank's weights, optimizer states and saved
    # block inputs alone overflow: the bound must be below that rank's peak at every B
    from gptcalc.memory.peak import step_account
    from gptcalc.plan import activations_lower_bound, states_lower_bound

    cfg, peaks = brute
    for layout, by_b in peaks.items():
        setup, n = _setup(cfg, layout), BATCH // layout.dp
        for b in by_b:
            w = Workload(b, SEQ, n // b)
            account = step_account(cfg, w, setup, "first")
            bound = states_lower_bound(cfg, setup, gradients=False) \
                + activations_lower_bound(cfg, w, setup)
            assert 0 < bound <= account.totals[account.peak_phase], (layout, b)


def test_a_ranks_states_at_its_optimizer_step_are_the_same_at_every_micro_batch(brute):
    # a pipeline set-up whose first or last rank's states overflow at one micro-batch is ruled
    # out at every micro-batch: those bytes must not depend on it, and stay below every peak
    from gptcalc.memory.peak import step_account
    from gptcalc.plan import states_at_step

    cfg, peaks = brute
    for layout in [x for x in peaks if x.pp > 1]:
        setup, n = _setup(cfg, layout), BATCH // layout.dp
        for stage in ("first", "last"):
            states = {states_at_step(step_account(cfg, Workload(b, SEQ, n // b), setup, stage))
                      for b in peaks[layout]}
            assert len(states) == 1, (layout, stage, states)
            assert 0 < states.pop() <= min(peaks[layout].values()), (layout, stage)


def test_without_a_pipeline_the_step_time_does_not_grow_with_the_micro_batch(brute):
    # the search bounds a layout's time by its whole share's (B = n), and a plan the verdict
    # moves to a smaller micro-batch by its time at the larger one: both rest on this
    from gptcalc.time import step_time

    cfg, peaks = brute
    for layout in [x for x in peaks if x.pp == 1][::3]:
        setup, n = _setup(cfg, layout), BATCH // layout.dp
        times = [step_time(cfg, setup, b, SEQ, n // b, H100).step_seconds
                 for b in sorted(peaks[layout])]
        assert times == sorted(times, reverse=True), layout


# the verdict adds the CUDA context (500 MiB) and NCCL's buffers to a peak: budgets a little
# above the smallest peaks, where the verdict moves or refuses the floor's micro-batch
HEADROOM = (600 << 20) + (1 << 30)


@pytest.mark.parametrize("mfu", [None, 0.4])
def test_judged_plans_hold_the_verdict_in_the_ranking_order(brute, mfu):
    # the verdict can move a plan to another micro-batch, and with it its step time and peak:
    # the plans still come by step time, then the tie rule (GPUs, pipeline stages, tensor
    # parallelism, recomputation, peak), and each holds `memory`'s verdict at its micro-batch
    from gptcalc.memory.verdict import verdict

    cfg, peaks = brute
    smallest = sorted(min(p.values()) for p in peaks.values())
    for q in (0, 7, 9, 12):
        budget = smallest[len(smallest) * q // 16] + HEADROOM
        found = _search(cfg, budget, judged=True, mfu=mfu)
        rule = [(p.step_seconds, p.gpus, p.layout.pp, p.layout.tp,
                 PLANNED_RECOMPUTE.index(p.layout.recompute), p.peak) for p in found.plans]
        assert rule == sorted(rule), (q, budget)
        for p in found.plans:
            v = verdict(cfg, Workload(p.micro_batch, SEQ, p.grad_accum), p.setup, budget)
            assert v.fits and v.must_hold == p.must_hold, (p.layout, p.micro_batch)


@pytest.mark.parametrize("q", [0, 2, 3])
def test_the_pruned_search_ranks_as_an_exhaustive_one(brute, q):
    # every layout's peak at every micro-batch (brute force), the plan's micro-batch by the
    # module's rule, its step time, then sorted by the tie rule: the search's whole ranking
    # and its fewest-GPU answer are that list's, step peaks pruned or not
    from gptcalc.time import step_time

    cfg, peaks = brute
    budget = _budgets(peaks)[q]
    rows = []
    for layout, by_b in peaks.items():
        fits = sorted(b for b, peak in by_b.items() if peak <= budget)
        if not fits:
            continue
        b = fits[-1] if layout.pp == 1 else fits[0]
        s = step_time(cfg, _setup(cfg, layout), b, SEQ, BATCH // (layout.dp * b),
                      H100).step_seconds
        ties = (layout.pp, layout.tp, PLANNED_RECOMPUTE.index(layout.recompute), by_b[b],
                layout.cp, layout.schedule, layout.engine, layout.zero, layout.dp)
        rows.append(((s, layout.gpus, *ties), (layout.gpus, s, *ties), layout, b))
    found = _search(cfg, budget)
    assert [(p.layout, p.micro_batch) for p in found.plans] == [
        (x[2], x[3]) for x in sorted(rows, key=lambda x: x[0])]
    fewest = min(rows, key=lambda x: x[1]) if rows else None
    assert (found.fewest.layout, found.fewest.micro_batch) == (fewest[2], fewest[3]) \
        if fewest else found.fewest is None
