"""`memory --gpu-memory/--gpu`: one verdict (what the card must hold: reserved + CUDA context +
NCCL buffers, against its usable memory) and, when the step does not fit, the options that
would, each one re-run and found to fit by the same verdict."""

from __future__ import annotations

import json
import tomllib

import pytest
from click.testing import CliRunner

from gptcalc.cli import cli
from gptcalc.cli.fit import dp_sizes
from gptcalc.gpus import GPUS

LORA = ["memory", "--preset", "llama3-8b", "--lora-rank", "16", "--lora-targets", "all",
        "--seq-len", "2048"]


def run_json(args):
    r = CliRunner().invoke(cli, [*args, "--json"])
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def rerun(args, options):
    """The command with an advised change: --gpu NAME replaces --gpu-memory."""
    if options.startswith("--gpu "):
        i = args.index("--gpu-memory")
        args = args[:i] + args[i + 2:]
    return run_json(args + options.split())


@pytest.mark.parametrize("args", [
    LORA + ["--gpu-memory", "24GiB"],
    ["memory", "--preset", "llama3-8b", "--seq-len", "2048", "--gpu-memory", "24GiB"],
])
def test_every_advised_change_fits_when_re_run(args):
    fit = run_json(args)["fit"]
    assert fit["max_batch"] == 0 and fit["advice"] and not fit["verdict"]["fits"]
    for a in fit["advice"]:
        out = rerun(args, a["options"])
        v = out["fit"]["verdict"]
        assert v["fits"] and v["must_hold"] == a["must_hold"] <= out["fit"]["budget"], a
        # what the card holds, summed here from the JSON's own lines
        assert v["must_hold"] == out["nvidia_smi"] == (
            out["reserved"] + v["cuda_context"] + v["nccl_buffers"])
        assert out["peak"] == a["peak"] == v["allocated_peak"] <= v["must_hold"]
        assert out["fit"]["max_batch"] >= 1 and out["fit"]["advice"] == []


# QLoRA Llama 3 70B (all linears, full checkpointing) on an RTX A6000 (47.16 GiB usable)
A6000 = ["memory", "--preset", "llama3-70b", "--lora-rank", "16", "--lora-targets", "all",
         "--weights-dtype", "nf4-dq", "--recompute", "full", "--gpu", "a6000"]


def test_allocated_under_the_card_but_reserved_over_it_does_not_fit():
    # 2,993 tokens: the longest sequence whose allocated peak fits the A6000 (what the fit
    # answered when it compared the allocated peak with the card); its reserved bytes do not
    out = run_json(A6000 + ["--seq-len", "2993"])
    v = out["fit"]["verdict"]
    assert out["peak"] <= out["fit"]["budget"] < out["reserved"]
    assert not v["fits"] and v["margin"] == out["fit"]["budget"] - out["nvidia_smi"] < 0
    assert out["fit"]["max_seq_len"] < 2993
    r = CliRunner().invoke(cli, A6000 + ["--seq-len", "2993"])
    assert r.output.splitlines()[0].startswith("Does not fit a6000 (47.16 GiB usable)")


def test_the_longest_sequence_is_the_verdicts_boundary():
    fit = run_json(A6000)["fit"]
    n = fit["max_seq_len"]
    assert run_json(A6000 + ["--seq-len", str(n)])["fit"]["verdict"]["fits"]
    assert not run_json(A6000 + ["--seq-len", str(n + 1)])["fit"]["verdict"]["fits"]


def test_the_advice_combines_checkpointing_with_a_shorter_sequence():
    args = ["memory", "--preset", "llama3-70b", "--lora-rank", "16", "--weights-dtype",
            "nf4-dq", "--gpu", "a6000", "--seq-len", "8192"]
    fit = run_json(args)["fit"]
    both = [a for a in fit["advice"] if a["options"].startswith("--recompute full --seq-len ")]
    assert both, fit["advice"]
    n = int(both[0]["options"].split()[-1])
    alone = [a for a in fit["advice"] if a["options"].startswith("--seq-len ")]
    assert alone and n > int(alone[0]["options"].split()[-1])
    assert run_json(args + both[0]["options"].split())["fit"]["verdict"]["fits"]
    assert not run_json(args + ["--recompute", "full", "--seq-len", str(n + 1)])[
        "fit"]["verdict"]["fits"]


def test_lora_at_24_gib_is_advised_recomputation_and_qlora():
    fit = run_json(LORA + ["--gpu-memory", "24GiB"])["fit"]
    options = [a["options"] for a in fit["advice"]]
    assert f"--seq-len {fit['max_seq_len']}" in options and fit["max_seq_len"] > 512
    assert any(o.startswith("--recompute ") for o in options)
    assert "--weights-dtype int4" in options
    zero = [o for o in options if o.startswith("--zero 3 --dp ")]
    assert zero  # the fewest ranks: one fewer does not fit
    n = int(zero[0].split()[-1])
    sizes = dp_sizes(n)
    assert sizes[-1] == n
    if n > 2:  # the size people run just below it does not fit
        assert rerun(LORA + ["--gpu-memory", "24GiB"], f"--zero 3 --dp {sizes[-2]}")["fit"][
            "max_batch"] == 0


def test_dp_sizes_are_powers_of_two_then_whole_nodes():
    # 8 GPUs per node: an HGX/DGX H100 board (NVIDIA DGX H100 datasheet: 8x H100 SXM)
    assert dp_sizes(8) == [1, 2, 4, 8]
    assert dp_sizes(15) == [1, 2, 4, 8]  # one below a second node: still one node
    assert dp_sizes(16) == [1, 2, 4, 8, 16]
    assert dp_sizes(24)[-2:] == [16, 24] and 12 not in dp_sizes(64)
    assert dp_sizes(3) == [1, 2]


def test_llama3_8b_on_an_h100_is_advised_whole_nodes_not_11_ranks():
    args = ["memory", "--preset", "llama3-8b", "--gpu", "h100-sxm"]
    fit = run_json(args)["fit"]
    zero = [a["options"] for a in fit["advice"] if a["options"].startswith("--zero 3 --dp ")]
    # 11 ranks is the fewest that fit (the search over every count found it); 16 is two nodes
    assert zero == ["--zero 3 --dp 16"]
    assert run_json(args + ["--zero", "3", "--dp", "16"])["fit"]["verdict"]["fits"]
    assert not run_json(args + ["--zero", "3", "--dp", "8"])["fit"]["verdict"]["fits"]


def test_the_text_names_the_longest_sequence_and_the_changes():
    r = CliRunner().invoke(cli, LORA + ["--gpu-memory", "24GiB"])
    assert r.exit_code == 0
    assert r.output.startswith("Does not fit 24.00 GiB per device: must hold ")
    assert "No micro-batch fits at seq_len 2,048" in r.output
    fit = run_json(LORA + ["--gpu-memory", "24GiB"])["fit"]
    assert f"the longest sequence that fits is {fit['max_seq_len']:,} tokens" in r.output
    assert "--weights-dtype int4" in r.output and "--recompute" in r.output


def test_a_step_that_fits_has_no_advice():
    fit = run_json(["memory", "--preset", "gpt2", "--gpu-memory", "80GiB"])["fit"]
    assert fit["max_batch"] > 0 and fit["advice"] == []


def test_gpu_takes_the_catalogue_memory():
    fit = run_json(["memory", "--preset", "gpt2", "--gpu", "H100-SXM"])["fit"]
    # the memory an engine can use (torch.cuda.mem_get_info's total, 79.22 GiB on an H100 SXM
    # as vLLM logs it), not the datasheet's 80 GiB
    assert fit["budget"] == GPUS["h100-sxm"].usable_memory_bytes < GPUS["h100-sxm"].memory_bytes
    assert fit["gpu"] == "h100-sxm"


@pytest.mark.parametrize("args, option", [
    (["--gpu", "h100-sxm", "--gpu-memory", "80GiB"], "--gpu"),
    (["--gpu", "nope"], "--gpu"),
])
def test_bad_gpu_is_one_line_naming_the_option(args, option):
    r = CliRunner().invoke(cli, ["memory", "--preset", "gpt2", *args])
    assert r.exit_code == 2 and r.output.startswith(f"Error: {option}:")


def test_the_advice_leaves_the_saved_config_alone(tmp_path):
    path = tmp_path / "run.toml"
    r = CliRunner().invoke(cli, LORA + ["--gpu-memory", "24GiB", "--save-config", str(path)])
    assert r.exit_code == 0, r.output
    saved = tomllib.loads(path.read_text())
    assert saved["parallel"]["zero"] == 0 and saved["parallel"]["dp"] == 1
    assert saved["stack"]["recompute"] == "none"
