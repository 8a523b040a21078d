"""DeepSpeed ZeRO 1-3 on its CPU accelerator against gptcalc, per rank: resident bytes between
steps and the step peak, predicted against measured, one row per (stage, mode, buckets, rank).

    DS_ACCELERATOR=cpu python benchmarks/deepspeed_twins.py [reference|transformers]
    DS_ACCELERATOR=cpu python benchmarks/deepspeed_twins.py thresholds
    DS_ACCELERATOR=cpu python benchmarks/deepspeed_twins.py coordinator [CASES_JSON]

"coordinator" runs ZeRO-3 on one rank over a 6-block model, once per case of
tests/test_deepspeed_coordinator.py, and prints as JSON the coordinator's
`__n_available_params` after every `fetch_sub_module` of the third step beside gptcalc's replay
(`stage3_gathered`).

"thresholds" runs ZeRO-3 (mixed, "small" buckets) with the coordinator's thresholds scaled to
the model (tests/test_deepspeed.py's THRESHOLD_CASES) and prints the gathered elements gptcalc
predicts at the forward's end beside the step peak, predicted and measured.

The model is a Llama of E 64, L 2, H 4 (2 KV heads), d_ff 176, V 1,601, at 2 x 32 tokens on
2 gloo ranks. "default" runs DeepSpeed's default buckets, "small" a ds_config that shrinks them
(SMALL). Measured: reference_model.deepspeed_twin (a garbage-collector walk of unique storages
after the step; MemTracker's peak less the model's buffers). Needs deepspeed.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from gptcalc import TrainingSetup, Workload, from_name  # noqa: E402
from gptcalc.memory import step_peak  # noqa: E402
from gptcalc.memory.engines import resident  # noqa: E402

SMALL = (("reduce_bucket_size", 4096), ("allgather_bucket_size", 4096),
         ("stage3_prefetch_bucket_size", 4096), ("stage3_param_persistence_threshold", 512),
         ("stage3_max_live_parameters", 65536))


def thresholds(cfg, wl) -> None:
    from reference_model.distributed import run_layouts
    from tests.test_deepspeed import THRESHOLD_CASES

    from gptcalc.memory.engines.deepspeed import stage3_moments
    from gptcalc.memory.ledger import Phase

    print("| thresholds | rank | gathered at forward end (predicted, elements) "
          "| peak predicted | measured | error | phase |")
    print("|---|---|---|---|---|---|---|")
    setups = [TrainingSetup(dp=2, zero=3, engine="deepspeed", mode="mixed",
                            engine_settings=tuple({**dict(SMALL), **zero}.items()))
              for zero in THRESHOLD_CASES]
    # one spawn of the two ranks for every case (each case in its own forked copy)
    for zero, setup, ranks in zip(THRESHOLD_CASES, setups, run_layouts(cfg, wl, setups)):
        peak = step_peak(cfg, wl, setup, stage="first")
        words = ", ".join(f"{k.replace('stage3_', '')} {v:,}" for k, v in zero.items())
        for r in ranks:
            gathered = stage3_moments(cfg, setup, r.rank)[Phase.FORWARD_END]
            measured = r.peak - r.peak_categories.get("Buffer", 0)
            print(f"| {words} | {r.rank} | {gathered:,} | {peak.bytes:,} | {measured:,} | "
                  f"{(peak.bytes - measured) / measured:+.3%} | {peak.phase} |", flush=True)


COORDINATOR_LAYERS = 6


def coordinator(cases: list[dict]) -> None:
    """For each case (ZeRO-3 settings over persistence 512, mode mixed, one rank, 1 x 16
    tokens): the coordinator's available elements after every fetch_sub_module of the third
    step (the trace was recorded by the second), read by wrapping
    PartitionedParameterCoordinator.fetch_sub_module, and the replay's, as one JSON line."""
    import json

    import deepspeed
    import torch
    from deepspeed.runtime.zero import partitioned_param_coordinator as ppc
    from deepspeed.utils import logger

    from gptcalc.dsconfig import ds_config_dict
    from gptcalc.memory.engines.deepspeed import stage3_gathered, stage3_trace
    from reference_model.rank import _batch, _Model

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                      MASTER_ADDR="127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    logger.setLevel("WARNING")
    cfg = from_name("debug", arch="llama", n_layer=COORDINATOR_LAYERS, n_embd=64, n_head=4,
                    n_kv_head=2, d_ff=176, vocab_size=1601, block_size=32)
    wl, counts = Workload(1, 16), []
    fetch = ppc.PartitionedParameterCoordinator.fetch_sub_module

    def counted(self, module, forward):
        fetch(self, module, forward)
        counts.append(self._PartitionedParameterCoordinator__n_available_params)

    ppc.PartitionedParameterCoordinator.fetch_sub_module = counted
    deepspeed.init_distributed(dist_backend="gloo")
    for zero in cases:
        setup = TrainingSetup(dp=1, zero=3, engine="deepspeed", mode="mixed",
                              engine_settings=(("stage3_param_persistence_threshold", 512),
                                               *zero.items()))
        torch.manual_seed(0)
        model = _Model(cfg, "reference", "sdpa")
        idx, targets = _batch(cfg, wl.batch_size, wl.seq_len, seed=0)
        engine, _, _, _ = deepspeed.initialize(
            model=model.module, optimizer=torch.optim.AdamW(model.module.parameters()),
            config=ds_config_dict(setup, wl))
        model.module = engine
        for _ in range(3):  # the first records the trace, the second completes it
            counts.clear()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, loss = model.loss(idx, targets)
            engine.backward(loss)
            engine.step()
        _, replay = stage3_gathered(stage3_trace(cfg, setup, 0, cfg.n_layer), setup)
        print(json.dumps({"zero": zero, "measured": counts, "replay": replay}), flush=True)


def main() -> None:
    from reference_model.distributed import run_layouts

    impl = sys.argv[1] if len(sys.argv) > 1 else "reference"
    cfg = from_name("debug", arch="llama", n_embd=64, n_head=4, n_kv_head=2, d_ff=176,
                    vocab_size=1601, block_size=32)
    wl = Workload(2, 32)
    if impl == "thresholds":
        return thresholds(cfg, wl)
    if impl == "coordinator":
        import json

        from tests.test_deepspeed_coordinator import CASES
        return coordinator(json.loads(sys.argv[2]) if len(sys.argv) > 2 else CASES)
    print("| ZeRO | mode | buckets | rank | resident predicted | measured | error "
          "| peak predicted | measured | error | phase |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    cases = [(zero, mode, buckets) for zero in (1, 2, 3) for mode in ("mixed", "fp32")
             for buckets in ("default", "small")]
    setups = [TrainingSetup(dp=2, zero=zero, engine="deepspeed", mode=mode, impl=impl,
                            attn_impl="manual" if impl == "reference" else "sdpa",
                            engine_settings=SMALL if buckets == "small" else ())
              for zero, mode, buckets in cases]
    # one spawn of the two ranks for every case (each case in its own forked copy)
    for (zero, mode, buckets), setup, ranks in zip(cases, setups,
                                                   run_layouts(cfg, wl, setups, impl)):
        peak = step_peak(cfg, wl, setup, stage="first")
        for r in ranks:
            kept = sum(resident(cfg, setup, "first", r.rank).values())
            measured = r.peak - r.peak_categories.get("Buffer", 0)
            print(f"| {zero} | {mode} | {buckets} | {r.rank} | {kept:,} | "
                  f"{r.resident:,} | {kept - r.resident:+,} B | {peak.bytes:,} | "
                  f"{measured:,} | {(peak.bytes - measured) / measured:+.3%} | "
                  f"{peak.phase} |", flush=True)


if __name__ == "__main__":
    main()
