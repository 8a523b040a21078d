"""Context parallel (`--cp`): torch's ring attention measured on fake ranks, its head-tail
split, and the memory command's folding of cp into the rank's tokens and the dp x cp mesh."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gptcalc import GPTConfig, TrainingSetup, Workload
from gptcalc.cli import cli
from gptcalc.errors import ConfigError
from gptcalc.memory.context_parallel import (check_context_parallel, local_workload,
                                             ring_backward_bytes, ring_forward_bytes)

CUDA_SDPA = dict(attn_impl="sdpa", device="cuda")


@pytest.mark.slow
@settings(max_examples=8, deadline=None)
@given(cp=st.integers(2, 5), batch=st.integers(1, 2), heads=st.integers(1, 4),
       half=st.integers(1, 6), head_dim=st.sampled_from([4, 8, 16]),
       mode=st.sampled_from(["bf16", "fp32"]))
# both sides of the logsumexp copy: b x H = 1 (its second half is contiguous) and above
@example(cp=2, batch=1, heads=1, half=1, head_dim=4, mode="fp32")
@example(cp=3, batch=2, heads=3, half=2, head_dim=8, mode="fp32")
def test_ring_buffers_are_what_torchs_ring_allocates(cp, batch, heads, half, head_dim, mode):
    # torch 2.13's _templated_ring_attention(_backward) on every rank of a fake process group
    import torch

    from reference_model.ring_attention import ring_peaks

    tokens = 2 * half  # a rank's two chunks
    cfg = GPTConfig(n_head=heads, n_embd=heads * head_dim, block_size=tokens * cp)
    wl = Workload(batch, tokens * cp)
    setup = TrainingSetup(mode=mode, cp=cp, **CUDA_SDPA)
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    measured = ring_peaks(cp, batch, heads, tokens, head_dim, dtype)
    assert (ring_forward_bytes(cfg, wl, setup), ring_backward_bytes(cfg, wl, setup)) == measured


@pytest.mark.parametrize("seq_len,cp", [(16, 4), (24, 4), (12, 3), (16, 3), (8, 2), (10, 2)])
def test_the_split_needs_2cp_chunks_as_torchs_load_balancer(seq_len, cp):
    from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
        _HeadTailLoadBalancer)

    cfg = GPTConfig(block_size=seq_len)
    wl, setup = Workload(1, seq_len), TrainingSetup(cp=cp, **CUDA_SDPA)
    balancer = _HeadTailLoadBalancer(seq_len, cp, "cpu")
    if seq_len % (2 * cp):
        with pytest.raises(AssertionError):
            balancer._generate_indices()
        with pytest.raises(ConfigError) as e:
            check_context_parallel(cfg, wl, setup)
        assert e.value.field == "cp"
        return
    check_context_parallel(cfg, wl, setup)
    order = balancer._generate_indices()[0].tolist()
    shard = seq_len // cp
    chunk = seq_len // (2 * cp)
    for rank in range(cp):  # rank i holds chunks i and 2cp-1-i: T/cp tokens
        mine = order[rank * shard:(rank + 1) * shard]
        assert mine == [*range(rank * chunk, (rank + 1) * chunk),
                        *range((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk)]
        assert len(mine) == local_workload(wl, setup).seq_len


def _memory(*args: str) -> dict:
    r = CliRunner().invoke(cli, ["memory", "--preset", "llama3-8b", "-B", "1", "-T", "131072",
                                 "--seq-len", "131072", "--engine", "fsdp2", "--zero", "3",
                                 "--mode", "mixed", "--json", *args])
    assert r.exit_code == 0, r.output
    return json.loads(r.stdout)


def test_a_rank_holds_its_tokens_and_a_dp_x_cp_shard_of_the_states():
    # torchtitan folds cp into FSDP's mesh (dp_shard x cp): 8 cp ranks shard as 8 dp ranks do;
    # a cp rank's activations and logits are those of its 131072 / 8 tokens
    cp = _memory("--dp", "1", "--cp", "8")
    dp = _memory("--dp", "8", "--seq-len", "16384")
    for key in ("weights", "gradients", "optimizer", "activations", "logits", "resident"):
        assert cp[key] == dp[key], key
    assert cp["training"]["cp"] == 8 and "cp=8" in cp["assumptions"]
    assert cp["global_batch"] == 1  # the cp ranks share one sequence
    ring = {"forward, last block's ring attention", "backward, last block's ring attention"}
    assert ring <= set(cp["peak_phases"]) and not ring & set(dp["peak_phases"])


@pytest.mark.parametrize("args", [
    ["--cp", "0"],
    ["--cp", "3", "--seq-len", "16"],
    ["--cp", "2", "--attn", "manual"],
    ["--cp", "2", "--device", "cpu"],
    ["--cp", "2", "--engine", "deepspeed", "--zero", "3"],
    ["--cp", "2", "--engine", "megatron"],
])
def test_a_set_up_the_ring_does_not_run_is_one_line(args):
    r = CliRunner().invoke(cli, ["memory", "--preset", "llama3-8b", "-B", "1", "--seq-len",
                                 "64", *args])
    assert r.exit_code == 2, r.output
    assert r.stderr.startswith("Error: --cp") and r.stderr.count("\n") == 1, r.stderr
