"""Pipeline stages and schedules (`gptcalc.schedules`) against torch.distributed.pipelining's
own schedule order and torchtitan's layer split."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gptcalc import TrainingSetup, Workload, from_name
from gptcalc.errors import ConfigError
from gptcalc.schedules import (check_pipeline, chunk_layers, rank_actions, stage_hold,
                               stage_layers)


def test_an_even_split_is_l_over_chunks():
    assert chunk_layers(32, 8) == (4,) * 8
    assert chunk_layers(5, 1) == (5,)


def test_an_uneven_split_is_torchtitans():
    # torchtitan/distributed/pipeline_parallel.py, generate_llm_fqn_per_model_part (input and
    # output weight 1): 126 layers + 2 over 8 stages = 16 each, the ends one block fewer
    assert chunk_layers(126, 8) == (15, 16, 16, 16, 16, 16, 16, 15)
    # its docstring's case, 3 layers over 2 stages: [tok_embeddings, layers.0, layers.1],
    # [layers.2, norm, output]
    assert chunk_layers(3, 2) == (2, 1)
    assert chunk_layers(126, 16) == (7,) + (8,) * 14 + (7,)
    with pytest.raises(ConfigError) as e:  # 4 effective layers over 5 stages: torchtitan refuses
        chunk_layers(2, 5)
    assert e.value.field == "pp"


def _torchtitan_layers(num_stages: int, num_layers: int) -> list[int]:
    """Blocks per stage as torchtitan's generate_llm_fqn_per_model_part deals out module names
    (input and output weight 1): effective layers per stage, the first and last one fewer,
    layers handed out in order while any remain."""
    effective = num_layers + 2
    per, extra = divmod(effective, num_stages)
    out, current = [], 0
    for i in range(num_stages):
        take = per + (1 if i < extra else 0) - (1 if i in (0, num_stages - 1) else 0)
        got = min(take, num_layers - current)
        out.append(got)
        current += got
    return out


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 200), st.integers(2, 64))
def test_uneven_splits_follow_torchtitan(layers, chunks):
    if layers % chunks == 0 or (layers + 2) // chunks < 1:
        return
    assert list(chunk_layers(layers, chunks)) == _torchtitan_layers(chunks, layers)


def test_interleaved_ranks_hold_their_chunks():
    s = TrainingSetup(pp=8, pp_schedule="interleaved-1f1b", pp_virtual=2)
    cfg = from_name("debug").replace(n_layer=126)
    # rank 0 runs chunks 0 and 8 (7 + 8 blocks), rank 1 chunks 1 and 9 (8 + 8)
    assert [stage_layers(cfg, s, r) for r in (0, 1, 7)] == [15, 16, 15]


torch = pytest.importorskip("torch")


def _torch_order(kind: str, pp: int, v: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    """The compute actions torch 2.13 runs on `rank`, as (kind, local chunk, micro-batch)."""
    from torch.distributed.pipelining import schedules as S

    if kind in ("gpipe", "1f1b"):
        cls = S.ScheduleGPipe if kind == "gpipe" else S.Schedule1F1B
        fake = SimpleNamespace(_num_stages=pp, _n_microbatches=m)
        order = cls._get_pipeline_order(fake)[rank]
    else:
        cls = (S.ScheduleInterleaved1F1B if kind == "interleaved-1f1b"
               else S.ScheduleInterleavedZeroBubble)
        fake = SimpleNamespace(pp_group_size=pp, n_local_stages=v, _n_microbatches=m,
                               number_of_rounds=max(1, m // pp),
                               microbatches_per_round=m // max(1, m // pp))
        order = cls._calculate_single_rank_operations(fake, rank)
    out = []
    for a in order:
        if a is None or a.computation_type.value not in "FBIW":
            continue
        out.append((a.computation_type.value, a.stage_index // pp, a.microbatch_index))
    return out


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(["interleaved-1f1b", "zero-bubble"]), st.integers(2, 6),
       st.integers(1, 3), st.integers(1, 4), st.data())
def test_interleaved_orders_are_torchs(kind, pp, v, rounds, data):
    m = data.draw(st.sampled_from(sorted({pp * rounds, pp, max(1, pp - 1)})))
    rank = data.draw(st.integers(0, pp - 1))
    setup = TrainingSetup(pp=pp, pp_schedule=kind, pp_virtual=v)
    assert rank_actions(setup, m, rank) == _torch_order(kind, pp, v, m, rank)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(["gpipe", "1f1b"]), st.integers(2, 6), st.integers(0, 6), st.data())
def test_single_stage_orders_are_torchs(kind, pp, extra, data):
    m = pp + extra
    rank = data.draw(st.integers(0, pp - 1))
    ours = rank_actions(TrainingSetup(pp=pp, pp_schedule=kind), m, rank)
    theirs = _torch_order(kind, pp, 1, m, rank)
    # Schedule1F1B's pipeline order numbers the last rank's forwards from 1 (its IR, not what
    # _step_microbatches runs): the kinds and their sequence are compared
    assert [a[0] for a in ours] == [a[0] for a in theirs]


def test_what_each_schedule_holds():
    cfg = from_name("debug").replace(n_layer=8)
    w = Workload(1, 16)
    held = lambda **kw: [stage_hold(cfg, w, TrainingSetup(pp=4, **kw), r).held_layers  # noqa: E731
                         for r in range(4)]
    assert held(pp_schedule="gpipe") == [8, 8, 8, 8]  # m = 4 micro-batches of 2 blocks
    assert held() == [8, 6, 4, 2]  # 1F1B: min(m, pp - r) micro-batches
    # interleaved, 2 chunks of 1 block per rank, m = 4: warm-up (v-1) pp + 2 (pp-1-r), plus one
    assert held(pp_schedule="interleaved-1f1b", pp_virtual=2) == [8, 8, 7, 5]


def test_the_schedules_refuse_what_torch_refuses():
    cfg = from_name("debug").replace(n_layer=8)
    with pytest.raises(ConfigError) as e:  # 9 micro-batches in 2 rounds of 4 stages
        check_pipeline(cfg, Workload(1, 16, 9), TrainingSetup(
            pp=4, pp_schedule="interleaved-1f1b", pp_virtual=2))
    assert e.value.field == "grad_accum"
    with pytest.raises(ConfigError) as e:
        TrainingSetup(pp=2, pp_virtual=2)
    assert e.value.field == "pp_virtual"


@pytest.mark.parametrize("engine, zero, merges", [("megatron", 0, False), ("fsdp2", 3, True),
                                                  ("ddp", 0, True)])
def test_the_last_stage_keeps_outputs_only_under_torchs_pipelining(engine, zero, merges):
    """torch.distributed.pipelining's last stage appends every micro-batch's output to
    `output_chunks` to merge them (`save_forward_output`, stage.py, torch 2.13; measured by
    the pipelining twins); Megatron-LM's forward step replaces the last stage's output by
    `loss_func(output_tensor)` (`forward_step_calc_loss`,
    megatron/core/pipeline_parallel/schedules.py, NVIDIA/Megatron-LM commit 00611e6e), so its
    last stage keeps one loss per micro-batch and no logits beyond the current one's."""
    from gptcalc.memory.engines.pipeline import KEPT_LOGITS, merges_outputs
    from gptcalc.memory.ledger import Phase
    from gptcalc.memory.peak import step_account
    from gptcalc.training import resolve_training

    cfg = from_name("gpt2")
    m = 4
    setup = resolve_training(cfg, None, {"pp": 2, "engine": engine, "dp": 2,
                                         "zero": zero})[0]
    workload = Workload(2, 256, m)
    assert merges_outputs(setup) is merges
    ledger = step_account(cfg, workload, setup, "last").ledger
    logits = 2 * 256 * cfg.vocab_size * setup.act_bytes  # one micro-batch's, b S V
    for phase in (Phase.BACKWARD_START, Phase.BACKWARD_END):
        assert ledger.get(phase, KEPT_LOGITS) == ((m - 1) * logits if merges else 0)


def test_megatron_last_stage_holds_one_micro_batch_and_its_logits_by_hand():
    """Megatron-LM's 1F1B (megatron-core 0.16.1, pipeline_parallel/schedules.py): the last
    stage warms up with pp - rank - 1 = 0 forwards (`num_warmup_microbatches`), so one
    micro-batch is in flight; its forward step replaces the logits by
    `loss_func(output_tensor)` (`forward_step_calc_loss`) and appends only the reduced loss to
    `forward_data_store`. So at the forward's end the last stage holds the current
    micro-batch's bf16 logits, b S V/tp x 2 B, which the vocab-parallel cross entropy reads
    (its fp32 copy becomes the saved softmax in place), and nothing of the earlier
    micro-batches: the step's peak on that stage does not move with their number."""
    from gptcalc.memory.engines.pipeline import KEPT_LOGITS
    from gptcalc.memory.ledger import LOGITS, Phase
    from gptcalc.memory.peak import step_account, step_peak
    from gptcalc.training import resolve_training

    cfg = from_name("llama3-8b")
    setup = resolve_training(cfg, None, {"pp": 4, "tp": 2, "engine": "megatron"})[0]
    assert setup.mode == "mixed" and setup.impl == "megatron-core"
    b, s = 1, 2048
    logits = b * s * (128256 // 2) * 2  # b S V/tp in bf16: 262,668,288 B
    assert logits == 262_668_288
    peaks = []
    for m in (4, 16):
        workload = Workload(b, s, m)
        ledger = step_account(cfg, workload, setup, "last").ledger
        assert stage_hold(cfg, workload, setup, "last").alive == (1,)
        assert ledger.get(Phase.FORWARD_END, LOGITS) == logits
        for phase in (Phase.FORWARD_END, Phase.BACKWARD_START, Phase.BACKWARD_END):
            assert ledger.get(phase, KEPT_LOGITS) == 0
        peaks.append(step_peak(cfg, workload, setup, stage="last").bytes)
    assert peaks[0] == peaks[1]
