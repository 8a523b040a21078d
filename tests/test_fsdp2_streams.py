"""FSDP2's all-gather buffers (`fsdp2_all_gather_buffers`) against FSDP2 itself: every
all-gather of a step, in-process on a fake process group (hypothesis over shapes, padding,
mode, ZeRO 2/3, dp and rank), allocates the model's cast and output, in that order, on its
group's copy-in stream; and the replay (`reserved.step_events`) puts exactly those buffers on
that stream."""

from __future__ import annotations

import contextlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gptcalc import TrainingSetup, Workload, from_name
from gptcalc.memory.engines.fsdp2 import FSDP2, fsdp2_all_gather_buffers
from gptcalc.memory.reserved import step_events


def _setup(**kw) -> TrainingSetup:
    return TrainingSetup(engine="fsdp2", attn_impl="sdpa", keep_logits=False, **kw)


def _gathers(cfg, setup: TrainingSetup, rank: int, steps: int = 2) -> list[tuple]:
    """FSDP2 itself (`fully_shard` on every block and at the root, as torchtitan wraps) on rank
    `rank` of a fake process group, `steps` training steps: each all-gather as (its group,
    the sizes of the storages it allocates, in order, whether its copy-in stream is the
    groups' `all_gather_copy_in_stream`)."""
    import torch
    import torch.distributed as dist
    import torch.distributed.fsdp._fully_shard._fsdp_collectives as collectives
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as param_group
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils._python_dispatch import TorchDispatchMode

    from reference_model.model import build_model

    class Allocations(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.sizes: list[int] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in (torch.ops.aten.empty, torch.ops.aten.empty_strided):
                self.sizes.append(out.untyped_storage().nbytes())
            return out

    seen: list[tuple] = []
    original = collectives.foreach_all_gather

    def recorded(params, group, async_op, copy_in_stream, *rest):
        mode = Allocations()
        with mode:
            result = original(params, group, async_op, copy_in_stream, *rest)
        seen.append((params[0], tuple(mode.sizes), copy_in_stream))
        return result

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=setup.dp)
    param_group.foreach_all_gather = recorded
    try:
        dtype = torch.bfloat16 if setup.mode == "bf16" else torch.float32
        model = build_model(cfg, "sdpa", dtype=dtype)
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if (
            setup.mode == "mixed") else MixedPrecisionPolicy()
        blocks = list(model.transformer.h)
        for m in [*blocks, model]:
            fully_shard(m, reshard_after_forward=setup.zero == 3, mp_policy=mp)
        group = {id(p): "root" if m is model else "block" for m in [model, *blocks]
                 for p in m._get_fsdp_state()._fsdp_param_group.fsdp_params}
        idx = torch.randint(0, cfg.vocab_size, (2, cfg.block_size))
        opt = torch.optim.AdamW(model.parameters())
        for _ in range(steps):
            with torch.autocast("cpu", dtype=torch.bfloat16) if setup.mode == "mixed" else (
                    contextlib.nullcontext()):
                out = model(idx)
                logits = out[0] if isinstance(out, tuple) else out
                torch.nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                                  idx.flatten()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        copy_in = model._get_fsdp_state()._comm_ctx.all_gather_copy_in_stream
        return [(group[id(p)], sizes, stream is copy_in) for p, sizes, stream in seen]
    finally:
        param_group.foreach_all_gather = original
        dist.destroy_process_group()


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(arch=st.sampled_from(["llama", "gpt2"]), heads=st.integers(1, 3),
       head_dim=st.integers(2, 9), layers=st.integers(1, 2), vocab=st.integers(3, 67),
       mode=st.sampled_from(["fp32", "bf16", "mixed"]), zero=st.sampled_from([2, 3]),
       dp=st.sampled_from([2, 3]), data=st.data())
def test_each_all_gather_allocates_the_models_buffers_on_the_copy_in_stream(
        arch, heads, head_dim, layers, vocab, mode, zero, dp, data):
    pytest.importorskip("torch")
    if arch == "llama":  # rotary positions need an even head_dim
        head_dim += head_dim % 2
    cfg = from_name("debug", arch=arch, n_layer=layers, n_head=heads, n_embd=heads * head_dim,
                    vocab_size=vocab, block_size=8, dropout=0.0)
    setup = _setup(mode=mode, zero=zero, dp=dp)
    rank = data.draw(st.integers(0, dp - 1))
    buffers = fsdp2_all_gather_buffers(cfg, setup)
    gathers = _gathers(cfg, setup, rank)
    for group, sizes, on_copy_in in gathers:
        # the cast (none where param_dtype is the shards'), then the output
        assert sizes == tuple(b for b in buffers[group] if b), group
        assert on_copy_in
    # every group gathered in each forward, and again in each backward under ZeRO-3
    per_step = 2 if zero == 3 else 1
    assert [g for g, _s, _c in gathers].count("root") == 2 * per_step
    assert [g for g, _s, _c in gathers].count("block") == 2 * per_step * layers


def test_the_cast_is_a_ranks_padded_shard_in_param_dtype():
    # GPT-2, E 64, vocab 67, 8 positions: the root is wte (67 rows, the head tied to it), wpe
    # (8 rows) and ln_f's weight and bias (64 rows each), each padded to a multiple of dp
    # rows (67 -> 68 and 69, 8 -> 8 and 9, 64 -> 64 and 66). Mixed: bf16 outputs (2 bytes),
    # the cast 1/dp of them.
    cfg = from_name("debug", arch="gpt2", n_layer=2, n_embd=64, n_head=4, vocab_size=67,
                    block_size=8, dropout=0.0)
    two = fsdp2_all_gather_buffers(cfg, _setup(mode="mixed", dp=2))
    three = fsdp2_all_gather_buffers(cfg, _setup(mode="mixed", dp=3))
    assert two["root"] == (2 * (68 * 64 + 8 * 64 + 2 * 64) // 2,
                           2 * (68 * 64 + 8 * 64 + 2 * 64))
    assert three["root"][1] == 2 * (69 * 64 + 9 * 64 + 2 * 66)
    assert two["root"][0] * 2 == two["root"][1] and three["block"][0] * 3 == three["block"][1]
    # fp32 and bf16 keep the shards' dtype: no cast; dp 1 gathers nothing
    assert fsdp2_all_gather_buffers(cfg, _setup(mode="fp32", dp=2))["block"][0] == 0
    assert fsdp2_all_gather_buffers(cfg, _setup(mode="bf16", dp=2))["root"][0] == 0
    assert fsdp2_all_gather_buffers(cfg, _setup(mode="mixed", dp=1)) == {}


@settings(max_examples=15, deadline=None)
@given(st.sampled_from(["gpt2", "llama3-8b", "debug-moe"]), st.integers(1, 4),
       st.sampled_from([2, 3]), st.sampled_from(["mixed", "bf16", "fp32"]),
       st.sampled_from([2, 4]))
def test_the_replay_puts_each_all_gather_on_the_copy_in_stream(name, layers, zero, mode, dp):
    """Every allocation the replay makes on the copy-in stream is an all-gather's cast followed
    by its output, as `fsdp2_all_gather_buffers` gives them, and no all-gather output is on
    another stream; the root's forward all-gather is among them."""
    cfg = from_name(name, n_layer=layers)
    setup = _setup(mode=mode, zero=zero, dp=dp, device="cuda")
    buffers = set(fsdp2_all_gather_buffers(cfg, setup).values())
    events = step_events(cfg, Workload(1, 64), setup)
    gathered = [e for e in events
                if e[0] == "alloc" and len(e) > 3 and e[3] == FSDP2.gather_stream]
    casts, outputs = gathered[0::2], gathered[1::2]
    assert len(casts) == len(outputs) and gathered
    assert {(c[2], o[2]) for c, o in zip(casts, outputs)} <= buffers
    assert all(c[1] == ("all-gather cast", o[1]) for c, o in zip(casts, outputs))
    assert ("all-gather cast", "root all-gather output") in [c[1] for c in casts]
    on_others = [e for e in events if e[0] == "alloc" and isinstance(e[1], tuple)
                 and e[1][0] in FSDP2.gather_terms and e not in gathered and e[2]]
    assert not on_others


MiB2 = 2 << 20  # the caching allocator's large segments are multiples of 2 MiB (kRoundLarge)


@pytest.mark.parametrize("dp", [8, 128])
def test_the_copy_in_streams_pool_is_the_roots_buffers_and_one_blocks_output(dp):
    """Llama 3.1 8B (torchtitan's run): the copy-in stream reserves the root's cast and output
    and one block's output: the root's output is alive when the first block's is made (FSDP2
    keeps it to that block's copy-out), every later block's output fits where the root's was,
    every cast where the root's was. By hand: the root is the embedding and the untied head
    (128,256 x 4,096 each) and the final norm (4,096); a block 218,112,000 parameters (q and o
    4,096 x 4,096, k and v 1,024 x 4,096, the MLP 3 x 4,096 x 14,336, two norms); all rows
    divide by 8 and 128; bf16 (MixedPrecisionPolicy), the cast 1/dp of the output."""
    from gptcalc.memory.allocator import simulate

    cfg, wl = from_name("llama3-8b"), Workload(2, 8192)
    setup = _setup(mode="mixed", zero=3, dp=dp, recompute="op", device="cuda")
    root, block = 2 * (2 * 128_256 * 4_096 + 4_096), 2 * 218_112_000
    segments = [root // dp, root, block]
    want = sum(-(-n // MiB2) * MiB2 for n in segments)
    pools = simulate(step_events(cfg, wl, setup)).streams
    assert pools[FSDP2.gather_stream].reserved == want
