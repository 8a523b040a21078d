"""Expert parallel's all-to-alls (`gptcalc.time.comm.ep_all_to_alls`) against torchtitan 0.3.0's
`AllToAllTokenDispatcher`: a closed form read from its source over drawn shapes, and the
dispatcher itself counted on gloo ranks (reference_model/ep_twin.py)."""

from __future__ import annotations

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from gptcalc import GPTConfig, TrainingSetup
from gptcalc.layers import moe_layers
from gptcalc.time.comm import collectives


def _moe(n_layer=1, n_embd=32, n_expert=8, k=2, **kw) -> GPTConfig:
    return GPTConfig(block_size=64, vocab_size=64, n_layer=n_layer, n_head=4, n_embd=n_embd,
                     n_expert=n_expert, n_expert_active=k, moe_ffn_dim=32, **kw)


def _ep(cfg, setup, batch, seq, m) -> list[tuple[str, float, int, int]]:
    return [(c.kind, c.size, c.group, c.count)
            for c in collectives(cfg, setup, batch, seq, m, 8) if c.part == "ep"]


@settings(max_examples=60)
@given(n_layer=st.integers(1, 6), moe_step=st.integers(1, 2), first_dense=st.integers(0, 2),
       n_embd=st.sampled_from([16, 48, 4096]), local=st.integers(1, 8), k=st.integers(1, 8),
       ep=st.sampled_from([2, 4, 8]), cp=st.sampled_from([1, 2]),
       mode=st.sampled_from(["fp32", "mixed", "bf16"]),
       recompute=st.sampled_from(["none", "selective", "full"]),
       batch=st.integers(1, 4), seq=st.sampled_from([64, 4096]), m=st.integers(1, 4))
def test_ep_all_to_alls_are_torchtitans(n_layer, moe_step, first_dense, n_embd, local, k, ep,
                                        cp, mode, recompute, batch, seq, m):
    """torchtitan 0.3.0, token_dispatcher.py, `AllToAllTokenDispatcher.dispatch`/`combine`,
    per MoE block and forward run: `_token_count_exchange` (under torch.no_grad) sends
    `num_local_tokens_per_expert_E`, n_expert int64 (moe.py: a sum over a bool map);
    `_dispatch_token_exchange` sends `routed_input_ND`, N = T x k rows of E; and
    `_combine_token_exchange` sends the rows received, T x k when balanced. Both are
    differentiable functional all-to-alls: backward sends their gradients (2 more). Full
    recomputation runs the forward again in backward (T = b x s / cp)."""
    n_expert = ep * local
    cfg = _moe(n_layer, n_embd, n_expert, min(k, n_expert), moe_step=moe_step,
               moe_first_dense=first_dense)
    setup = TrainingSetup(mode=mode, recompute=recompute, dp=ep, ep=ep, cp=cp,
                          engine="fsdp2", zero=3)
    blocks = moe_layers(cfg)
    assume(blocks)
    runs = 2 if recompute == "full" else 1
    a = 4 if mode == "fp32" else 2
    T = batch * seq / cp
    expected = [("all-to-all", n_expert * 8, ep, m * blocks * runs),
                ("all-to-all", T * cfg.n_expert_active * n_embd * a, ep,
                 m * blocks * 2 * (runs + 1))]
    assert _ep(cfg, setup, batch, seq, m) == expected


def test_no_all_to_all_without_expert_parallel():
    cfg = _moe()
    assert _ep(cfg, TrainingSetup(dp=2, ep=1, engine="fsdp2", zero=3), 2, 16, 1) == []
    assert len(_ep(cfg, TrainingSetup(dp=2, ep=2, engine="fsdp2", zero=3), 2, 16, 1)) == 2


# the twin's cases at 2 ranks: balanced (round-robin) routing in fp32, skewed routing (every
# rank favours the first rank's experts) in bf16, and skewed under full recomputation
TWIN_CASES = (("balanced", "fp32", False), ("skewed", "bf16", False), ("skewed", "fp32", True))


@pytest.mark.slow
def test_ep_twin_counts_torchtitans_all_to_alls():
    """torchtitan's MoE layer with its all-to-all dispatcher on 2 gloo ranks, forward and
    backward (about 25 s: each rank imports torchtitan): every call's kind and bytes equal the
    model's, the routed rows on average over the ranks where routing is skewed."""
    from reference_model.ep_twin import EPCase, count_ep, torchtitan_available

    if not torchtitan_available():
        pytest.skip("torchtitan 0.3.0 and spmd_types are not installed")
    world, batch, seq = 2, 2, 16
    cases = [EPCase(routing=r, dtype=d, recompute=rc, batch=batch, seq=seq)
             for r, d, rc in TWIN_CASES]
    counted = count_ep(cases, world)
    for case, ranks in zip(cases, counted):
        cfg = _moe(1, case.n_embd, case.n_expert, case.top_k)
        setup = TrainingSetup(mode=case.dtype, recompute="full" if case.recompute else "none",
                              dp=world, ep=world, engine="fsdp2", zero=3)
        (_, counts_size, _, counts_n), (_, routed, _, routed_n) = _ep(cfg, setup, batch, seq, 1)
        for calls in ranks:
            assert {kind for kind, _, _, _ in calls} == {"all-to-all"}
            counts = [size for _, size, _, dtype in calls if dtype == "int64"]
            sizes = [size for _, size, _, dtype in calls if dtype != "int64"]
            assert counts == [counts_size] * counts_n, (case, calls)
            assert len(sizes) == routed_n, (case, calls)
            # the dispatch and its gradient's all-to-all send this rank's T x k rows: exact on
            # every rank; the combine and its gradient's send what the rank received
            assert sizes.count(routed) >= routed_n // 2, (case, calls)
            forward = [size for _, size, phase, _ in calls if phase == "forward"]
            assert len(forward) == 3  # counts, dispatch, combine; recomputed in backward
        received = sum(size for calls in ranks for _, size, _, dtype in calls
                       if dtype != "int64")
        assert received == world * routed * routed_n, case
        skewed = {size for calls in ranks for _, size, _, dtype in calls
                  if dtype != "int64"} - {routed}
        assert bool(skewed) == (case.routing == "skewed"), (case, ranks)
