"""FSDP2 (`torch.distributed.fsdp.fully_shard` on every block and at the root), per rank.

ZeRO-3 is `reshard_after_forward=True`, ZeRO-2 `reshard_after_forward=False`. Every parameter
tensor (its tensor-parallel shard first) is split on dim 0 across the dp ranks as `torch.chunk`
splits it: each rank owns ceil(rows / dp) rows (the last ranks fewer, possibly none). The
sharded parameter and gradient storages are padded to ceil(rows / dp) rows on every rank;
AdamW's states are made by `zeros_like` of the rank's own (unpadded) rows.

Mixed precision is FSDP2's `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` (mode
`mixed`, as torchtitan trains): the sharded parameters stay fp32 and are the master weights
(no separate master copy), the sharded gradients are fp32, AdamW's states fp32 (8 bytes per
parameter); the all-gather runs in bf16, so the unsharded parameters of the blocks in flight
and their unsharded gradients are bf16, and the reduce-scatter input is fp32 (the bf16
gradients cast to reduce_dtype). No autocast weight copies; the activations are bf16.

CPU offload (`--offload-param cpu`, FSDP2's `CPUOffloadPolicy`: torchtune's
`fsdp_cpu_offload`, torchtitan's `enable_cpu_offload`, accelerate's `fsdp_offload_params`):
the sharded parameters live on the host, and so do their gradients (each reduce-scatter's
output is copied to the host, `foreach_reduce`) and the optimizer's states and step
(`fsdp2_host`); the device keeps none of them, only what is gathered, reduced and saved
(torch 2.13, torch/distributed/fsdp/_fully_shard/_fsdp_param.py, _fsdp_collectives.py).

Every function here is pure and never imports torch.
"""

from __future__ import annotations

from ...config import GPTConfig
from ...errors import ConfigError
from ...schedules import Stage, holds_head, stage_hold, stage_layers
from ...training_setup import TrainingSetup
from ...workload import Workload
from ...inventory import ParamTensor
from ..ledger import GRADIENTS, LOGITS, OPTIMIZER_TEMPORARIES, SAVED, Ledger, Phase, Term
from ..states import optimizer_bytes_per_param, stage_tensors, step_order_pairs
from .base import Engine, Step, register
from .shards import (RankStates, chunk_rows, coords, first_rank, optimizer_over, padded_rows,
                     rows_times_rest, stage_list, step_counters, tp_local_shape)


def sharded_bytes(setup: TrainingSetup) -> int:
    """Bytes of one element of a sharded parameter or gradient: fp32 unless the model itself
    is bf16 (mode bf16); under MixedPrecisionPolicy the shards keep the fp32 dtype they were
    built in."""
    return 2 if setup.mode == "bf16" else 4


def unsharded_bytes(setup: TrainingSetup) -> int:
    """Bytes of one element of an all-gathered (unsharded) parameter and of its unsharded
    gradient: MixedPrecisionPolicy's param_dtype (bf16) in mode mixed, else the shards'."""
    return 2 if setup.mode in ("mixed", "bf16") else 4


def reduce_bytes(setup: TrainingSetup) -> int:
    """Bytes of one element of the reduce-scatter input: reduce_dtype fp32 in mode mixed (the
    bf16 unsharded gradients are copied into an fp32 buffer), else the gradients' dtype."""
    return 2 if setup.mode == "bf16" else 4


def optimizer_mode(setup: TrainingSetup) -> str:
    """The mode the optimizer's states are made in: the fp32 shards are the master weights, so
    mode mixed keeps only the optimizer's fp32 states (AdamW's 8 bytes), as in fp32."""
    return "fp32" if setup.mode == "mixed" else setup.mode


def optimizer_bytes(setup: TrainingSetup) -> int:
    """Optimizer state per element of the rank's own rows, for the elementwise optimizers
    (`optimizer_mode`)."""
    return optimizer_bytes_per_param(setup, optimizer_mode(setup))


def cpu_offload(setup: TrainingSetup) -> bool:
    """Whether the set-up runs FSDP2's CPUOffloadPolicy (`--offload-param cpu`)."""
    return dict(setup.engine_settings).get("offload_param") == "cpu"


def fsdp2_rank_states(cfg: GPTConfig, setup: TrainingSetup, rank: int = 0) -> RankStates:
    """The states `rank`'s device holds under FSDP2 (`fsdp2_sharded_states`); none under CPU
    offload, where they are the host's (`fsdp2_host`)."""
    st = fsdp2_sharded_states(cfg, setup, rank)
    if cpu_offload(setup):
        return RankStates(0, 0, 0, 0, st.rule + "; CPUOffloadPolicy: every state on the host")
    return st


HOST_PARAMETERS = "sharded parameters (CPUOffloadPolicy)"
HOST_GRADIENTS = "sharded gradients (CPUOffloadPolicy)"
HOST_OPTIMIZER = "optimizer states (CPUOffloadPolicy)"


def fsdp2_host(cfg: GPTConfig, setup: TrainingSetup, rank: int = 0) -> dict[str, int]:
    """Bytes the host holds for `rank` under CPUOffloadPolicy, by line; {} without it: the
    padded sharded parameters and gradients and the optimizer's states and 0-d tensors
    (`fsdp2_sharded_states`), which FSDP2 keeps on the CPU (pinned by default:
    `CPUOffloadPolicy.pin_memory`), the optimizer stepping them there."""
    if not cpu_offload(setup):
        return {}
    st = fsdp2_sharded_states(cfg, setup, rank)
    return {HOST_PARAMETERS: st.weights, HOST_GRADIENTS: st.gradients,
            HOST_OPTIMIZER: st.optimizer}


def fsdp2_sharded_states(cfg: GPTConfig, setup: TrainingSetup, rank: int = 0) -> RankStates:
    """FSDP2's states on `rank`: every tensor (tensor-parallel shard first) split on dim 0 over
    dp; weights and gradients in padded ceil(rows / dp) storages (`sharded_bytes`), optimizer
    states over the rank's own rows (`states.tensor_optimizer_bytes` in `optimizer_mode`), plus
    the optimizer's 0-d tensors per tensor (AdamW's step, Adafactor's RMS). The optimizer is
    modelled as seeing the local shard, (own rows,) + the other dims: Adafactor factors the
    shard (its row factor over the own rows, its column factor whole on every rank, also one
    of no rows), 8-bit AdamW quantizes the shard in blocks of 256 and keeps 32-bit states when
    the shard has fewer than 4096 elements. ZeRO-2 as FSDP2 runs it holds the same at rest (its
    parameters are resharded after backward)."""
    pp_rank, dp_rank, tp_rank = coords(rank, setup)
    padded = tensors = 0
    shapes = []
    for t in stage_list(cfg, setup, pp_rank):
        shape = tp_local_shape(t, setup.tp, tp_rank)
        padded += t.count * rows_times_rest(shape, padded_rows(shape[0], setup.dp))
        rows = chunk_rows(shape[0], setup.dp, dp_rank)
        shapes.append(((rows,) + shape[1:], t.count))
        tensors += t.count
    steps = step_counters(setup, tensors)
    sb = sharded_bytes(setup)
    opt = optimizer_over(setup, shapes, optimizer_mode(setup))
    return RankStates(sb * padded, sb * padded, opt + steps, steps,
                      "FSDP2: dim-0 shards padded to ceil(rows/dp); optimizer over own rows")


def fsdp2_lora_states(cfg: GPTConfig, setup: TrainingSetup, rank: int = 0) -> dict[str, int]:
    """LoRA's states on `rank` under FSDP2, by `finetune.finetune_state_bytes`' lines. FSDP2
    shards every parameter, frozen or not, at ZeRO-2 and 3 alike (reshard_after_forward only
    decides when the all-gathered copy is freed), in its own dtypes (`sharded_bytes`: fp32
    shards under MixedPrecisionPolicy):

    - base/weights: the frozen parameters' padded dim-0 shards (`fsdp2_rank_states`), or with
      an NF4 base its quantised block Linears, their constants included (`lora.
      qlora_base_bytes`), split over dp beside the other parameters' shards;
    - adapter/weights and adapter/gradients: lora_A (m r, in) and lora_B (out, m r) of every
      adapter, padded ceil(rows / dp) rows;
    - adapter/optimizer: the optimizer over the rank's own rows of each adapter matrix in
      `optimizer_mode` (AdamW: 8 bytes per element, no master copy), plus its 0-d tensors per
      adapter tensor."""
    from ...linears import block_linears
    from ...lora import qlora_base_bytes, selected

    _, dp_rank, _ = coords(rank, setup)
    sb, dp = sharded_bytes(setup), setup.dp
    base = fsdp2_sharded_states(cfg, setup, rank).weights
    if setup.base_dtype == "nf4":
        dense = sum(m.weights for m in block_linears(cfg))
        nf4 = sum(qlora_base_bytes(cfg, setup.double_quant).values())
        base += -(-nf4 // dp) - sb * (-(-dense // dp))
    padded = tensors = 0
    shapes = []
    for a in selected(cfg, setup.lora_targets):
        r = setup.lora_rank * a.rank_mult
        for shape in ((r, a.in_features), (a.out_features, r)):
            padded += a.count * rows_times_rest(shape, padded_rows(shape[0], dp))
            shapes.append(((chunk_rows(shape[0], dp, dp_rank),) + shape[1:], a.count))
            tensors += a.count
    opt = optimizer_over(setup, shapes, optimizer_mode(setup)) + step_counters(setup, tensors)
    return {"base/weights": base, "adapter/weights": sb * padded,
            "adapter/gradients": sb * padded, "adapter/optimizer": opt}


def _padded_elements(t: ParamTensor, setup: TrainingSetup) -> int:
    """Elements of one tensor of `t` unsharded by FSDP2: the tp shard (rank 0's), dim 0 padded
    to a multiple of dp (the all-gather output is padded)."""
    shape = tp_local_shape(t, setup.tp, 0)
    return rows_times_rest(shape, padded_rows(shape[0], setup.dp) * setup.dp)


def fsdp2_unsharded_elements(cfg: GPTConfig, setup: TrainingSetup, stage: Stage = "first"
                             ) -> dict[str, int]:
    """Elements FSDP2 all-gathers, per group: `root` (everything outside the blocks:
    embeddings, final norm, head; `fully_shard` at the root groups them) and `block` (one
    transformer block, each wrapped on its own), unsharded and padded."""
    root = block = 0
    for t in stage_tensors(cfg, setup, stage):
        n = _padded_elements(t, setup) * t.copies
        if t.place == "block":
            block += n * t.layers // max(1, stage_layers(cfg, setup, stage))
        else:
            root += n
    return {"root": root, "block": block}


def fsdp2_adapter_elements(cfg: GPTConfig, setup: TrainingSetup) -> dict[str, int]:
    """LoRA's adapter elements FSDP2 all-gathers, per group, padded: lora_A (m r, in) and
    lora_B (out, m r) of every selected adapter (`lora.selected`), each split on dim 0 and
    padded to a multiple of dp; `block` per transformer block (a block Linear's adapters live
    in its block's group), `root` the adapters outside the blocks (the lm_head's, OPT's
    project_in/out). Zeros without LoRA."""
    if not setup.lora_rank:
        return {"root": 0, "block": 0}
    from ...lora import selected

    root = block = 0
    for a in selected(cfg, setup.lora_targets):
        r = setup.lora_rank * a.rank_mult
        n = (padded_rows(r, setup.dp) * setup.dp * a.in_features
             + padded_rows(a.out_features, setup.dp) * setup.dp * r)
        if a.name == "lm_head" or not a.covers:
            root += n * a.count
        else:
            block += n * a.count // cfg.n_layer
    return {"root": root, "block": block}


def fsdp2_gradient_elements(cfg: GPTConfig, setup: TrainingSetup, stage: Stage = "first"
                            ) -> dict[str, int]:
    """Elements FSDP2 makes unsharded gradients of (and reduce-scatters), per group: every
    parameter (`fsdp2_unsharded_elements`), or with LoRA the adapters only
    (`fsdp2_adapter_elements`): a frozen parameter gets no `.grad`, and FSDP2's post-backward
    reduce-scatters only the parameters whose unsharded gradient exists
    (`FSDPParamGroup.post_backward`: `if fsdp_param.unsharded_accumulated_grad is not None or
    fsdp_param.unsharded_param.grad is not None`; torch 2.13)."""
    if setup.lora_rank:
        return fsdp2_adapter_elements(cfg, setup)
    return fsdp2_unsharded_elements(cfg, setup, stage)


def fsdp2_unsharded(cfg: GPTConfig, setup: TrainingSetup, stage: Stage = "first"
                    ) -> dict[str, int]:
    """Bytes FSDP2's all-gather makes unsharded, per group: `fsdp2_unsharded_elements` in the
    unsharded parameters' dtype, plus LoRA's adapters (`fsdp2_adapter_elements`). A QLoRA
    base's block Linears are gathered as they are stored, NF4 with their constants
    (torchao's NF4Tensor, which torchtune shards with FSDP2, all-gathers its packed data and
    scalers: `fsdp_pre_all_gather`), one block's share of `lora.qlora_base_bytes`."""
    ub = unsharded_bytes(setup)
    el = fsdp2_unsharded_elements(cfg, setup, stage)
    out = {k: ub * v for k, v in el.items()}
    if setup.lora_rank:
        for k, v in fsdp2_adapter_elements(cfg, setup).items():
            out[k] += ub * v
        if setup.base_dtype == "nf4":
            from ...linears import block_linears
            from ...lora import qlora_base_bytes

            dense = sum(m.weights for m in block_linears(cfg)) // cfg.n_layer
            nf4 = sum(qlora_base_bytes(cfg, setup.double_quant).values()) // cfg.n_layer
            out["block"] += nf4 - ub * dense  # the block's matrices in NF4, not 16-bit
    return out


ROOT_PARAMETERS = Term("FSDP2 unsharded root parameters")
BLOCKS_KEPT = Term("FSDP2 unsharded blocks (ZeRO-2 keeps them)")
BLOCK_COMPUTING = Term("FSDP2 unsharded block (computing)")
NEXT_BLOCK = Term("FSDP2 all-gather of the next block (prefetch)")
LAST_BLOCK_KEPT = Term("FSDP2 all-gather output of the last block (kept to the root's "
                       "post-forward)")
LAST_BLOCK_PREFETCH = Term("FSDP2 all-gather of the last block (the root's pre-backward "
                           "prefetch)")
ROOT_GRADIENTS = Term("FSDP2 unsharded root gradients (before its reduce-scatter)")
FIRST_BLOCK_REDUCE = Term("FSDP2 reduce-scatter input of the first block (kept until the next "
                          "reduce-scatter)")
LAST_BLOCK_GRADIENTS = Term("FSDP2 unsharded gradients of the last block")
LAST_BLOCK_REDUCE = Term("FSDP2 reduce-scatter input of the last block")
REDUCE_CAST = Term("FSDP2 reduce-scatter copy-in's cast (CPU)")
LAST_BLOCK_GATHER = Term("FSDP2 all-gather output of the last block (copied out)")
ROOT_REGATHERED = Term("FSDP2 root all-gather output (re-gathered for backward)")
PIPELINE_GRADIENTS = Term("FSDP2 unsharded gradients accumulating over micro-batches "
                          "(reduce-scatter deferred to the last)")


def fsdp2_all_gather_buffers(cfg: GPTConfig, setup: TrainingSetup, stage: Stage = "first"
                             ) -> dict[str, tuple[int, int]]:
    """Per group (`root`, `block`), the two buffers each of its all-gathers allocates, in
    order, as (cast, output) bytes; both on the all-gather copy-in stream, as every all-gather
    of the forward and of backward's prefetches is issued (torch 2.13,
    torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py `foreach_all_gather`, inside
    `stream(all_gather_copy_in_stream)`; `FSDPCommContext.get_all_gather_streams` for the
    FORWARD and PRE_BACKWARD states):

    - cast = output / dp: `_get_param_all_gather_inputs`' flat copy of the rank's padded
      shards in param_dtype (`torch._foreach_copy_` casts them), made only when
      MixedPrecisionPolicy's param_dtype differs from the shards' (`sharded_bytes` vs
      `unsharded_bytes`; FSDPParam sets an equal param_dtype to None) and freed once copied
      into the output;
    - output = `fsdp2_unsharded` of the group (dp x the padded shard, `all_gather_comm.
      allocate`), which the copy-out then copies into the unsharded parameters (on the compute
      stream); in the forward it is kept until the next group's copy-out
      (`FSDPCommContext.all_gather_state`), in backward freed after its own.

    None at dp = 1 (nothing gathered). A QLoRA base's NF4 tensors gather through their own
    `fsdp_pre_all_gather`, not the foreach copy: a block's cast is then its adapters' only.
    Under CPU offload each shard is copied to the device and cast on its own
    (`FSDPParam.all_gather_inputs`), one parameter at a time: the cast here stands for them.
    Checked against FSDP2 on a fake process group (tests/test_fsdp2_streams.py)."""
    if setup.dp == 1:
        return {}
    un = fsdp2_unsharded(cfg, setup, stage)
    if sharded_bytes(setup) == unsharded_bytes(setup):
        return {g: (0, out) for g, out in un.items()}
    cast = dict(un)
    if setup.lora_rank and setup.base_dtype == "nf4":
        cast["block"] = unsharded_bytes(setup) * fsdp2_adapter_elements(cfg, setup)["block"]
    return {g: (cast[g] // setup.dp, out) for g, out in un.items()}


def fsdp2_pipeline_accumulation(cfg: GPTConfig, setup: TrainingSetup, stage: Stage
                                ) -> dict[Term, int]:
    """What FSDP2 holds across micro-batches under torch.distributed.pipelining once a stage's
    first backward has run. Before each micro-batch's backward the stage calls
    `set_requires_gradient_sync(False)` and `set_reshard_after_backward(False)`
    (`_PipelineStageBase.backward_maybe_with_nosync`), and reduce-scatters and reshards only
    after the last (`perform_reduce_grad`; torch/distributed/pipelining/stage.py, torch 2.13):
    every parameter of the stage keeps an unsharded gradient, accumulated in reduce_dtype when
    it differs from the gradient's (`FSDPParam.to_accumulated_grad_if_needed`), and every
    block stays unsharded (`fsdp2_adjust` counts them as ZeRO-2's `BLOCKS_KEPT`). The padded
    unsharded elements of `fsdp2_unsharded_elements`, the root's included."""
    el = fsdp2_unsharded_elements(cfg, setup, stage)
    blocks = stage_layers(cfg, setup, stage)
    grad = reduce_bytes(setup) if setup.mode == "mixed" else unsharded_bytes(setup)
    return {PIPELINE_GRADIENTS: grad * (el["root"] + el["block"] * blocks)}


def fsdp2_reduce_scatter_terms(cfg: GPTConfig, workload: Workload, setup: TrainingSetup,
                               stage: Stage = "first") -> dict[Term, int]:
    """The moment after the last block's backward, as FSDP2's post-backward hook copies its
    unsharded gradients into the reduce-scatter input (torch.distributed.fsdp's
    `foreach_reduce`): the block's saved activations and parameters are freed, its unsharded
    gradients (`unsharded_bytes`) and the reduce-scatter input (`reduce_bytes`) are alive
    together, beside the head's gradient, the root's unsharded parameters and (ZeRO-3) the
    next block's prefetched all-gather; ZeRO-2 keeps every block unsharded. On CPU, when the
    gradients' dtype differs from reduce_dtype (MixedPrecisionPolicy), the copy-in
    (`torch._chunk_cat`) converts through an intermediate in reduce_dtype the size of the
    input; CUDA's kernel casts in place (measured with FSDPMemTracker on CPU/gloo,
    torch 2.13). Saved activations: those the device keeps (`offload.offload_split`)."""
    from ..activations import device_activations, saved_in
    from ..offload import offload_split

    held = stage_hold(cfg, workload, setup, stage).held_layers
    acts, _ = offload_split(cfg, setup, device_activations(cfg, workload, setup, stage), held)
    blocks = stage_layers(cfg, setup, stage)
    layer = _last_block_saved(cfg, workload, setup, acts, held)
    loss = saved_in(acts, "cross_entropy")
    un = fsdp2_unsharded(cfg, setup, stage)
    grad = fsdp2_gradient_elements(cfg, setup, stage)["block"]
    ub, rb = unsharded_bytes(setup), reduce_bytes(setup)
    head = -(-cfg.vocab_size // setup.tp) * cfg.n_embd if holds_head(setup, stage) else 0
    if setup.lora_rank:  # the frozen head has no gradient; an adapted one its adapter's
        head = fsdp2_adapter_elements(cfg, setup)["root"]
    cast = rb * grad if setup.device == "cpu" and ub != rb else 0
    return {SAVED: sum(acts.values()) - loss - layer,
            GRADIENTS: ub * head,
            ROOT_PARAMETERS: un["root"],
            NEXT_BLOCK: un["block"] if setup.zero == 3 else 0,
            BLOCKS_KEPT: un["block"] * (blocks - 1) if setup.zero == 2 else 0,
            LAST_BLOCK_GRADIENTS: ub * grad,
            LAST_BLOCK_REDUCE: rb * grad,
            REDUCE_CAST: cast}


def _last_block_saved(cfg: GPTConfig, workload: Workload, setup: TrainingSetup,
                      acts: dict[str, int], held: int) -> int:
    """Bytes the last block saves: the layer lines' share of one block, or under LoRA (whose
    first block saves less, `finetune._first_block_unsaved`) what L blocks save beyond L - 1
    (without a pipeline and offloading; otherwise the share)."""
    from ..activations import device_activations, saved_in

    layer = saved_in(acts, "layer")
    if setup.lora_rank and setup.pp == 1 and cfg.n_layer > 1 and not setup.offload_activations:
        fewer = device_activations(cfg.replace(n_layer=cfg.n_layer - 1), workload, setup)
        return layer - saved_in(fewer, "layer")
    return layer // max(1, held)


def fsdp2_forward_gather_terms(cfg: GPTConfig, workload: Workload, setup: TrainingSetup,
                               stage: Stage = "first") -> dict[Term, int]:
    """The moment in the last block's pre-forward when its all-gather has been copied out
    (`foreach_all_gather_copy_out`, torch.distributed.fsdp): the block's all-gather output and
    its unsharded parameters are alive together beside the block before it's all-gather output
    (`LAST_BLOCK_KEPT`: FSDP2 keeps each until the next all-gather is issued), the root's
    unsharded parameters (ZeRO-2: every block's, this one's among them), and every
    activation the earlier blocks saved (the last block, the final norm and the loss have
    saved nothing yet). Measured with FSDPMemTracker on CPU/gloo, torch 2.13 (the step's peak
    where backward holds little, as under LoRA: its `PEAK_FW` of the last block). A stage of
    two blocks or more (with one, the root's all-gather output is the one kept)."""
    from ..activations import device_activations, saved_in
    from ..offload import offload_split

    held = stage_hold(cfg, workload, setup, stage).held_layers
    acts, _ = offload_split(cfg, setup, device_activations(cfg, workload, setup, stage), held)
    blocks = stage_layers(cfg, setup, stage)
    layer = _last_block_saved(cfg, workload, setup, acts, held)
    later = saved_in(acts, "cross_entropy") + saved_in(acts, "final")
    un = fsdp2_unsharded(cfg, setup, stage)
    return {SAVED: sum(acts.values()) - later - layer,
            ROOT_PARAMETERS: un["root"],
            BLOCKS_KEPT: un["block"] * blocks if setup.zero == 2 else 0,
            LAST_BLOCK_KEPT: un["block"],
            LAST_BLOCK_GATHER: un["block"],
            BLOCK_COMPUTING: un["block"] if setup.zero == 3 else 0}


def fsdp2_adjust(ledger: Ledger, step: Step) -> None:
    """What FSDP2 holds beyond the sharded states at each phase of the step peak
    (torch.distributed.fsdp.fully_shard on every block and at the root; measured with
    FSDPMemTracker on CPU/gloo, torch 2.13). Unsharded parameters and gradients are in
    `unsharded_bytes`, the reduce-scatter input in `reduce_bytes`:

    - the root's parameters are all-gathered before the forward and stay unsharded through
      it (ZeRO-2: until the end of backward);
    - ZeRO-3 (reshard_after_forward=True): a block is unsharded while it computes and freed
      after its forward; in backward the block being computed is unsharded and the next one's
      all-gather output (backward prefetch) is alive beside it;
    - ZeRO-2 (reshard_after_forward=False): every block stays unsharded from its forward to its
      backward;
    - FSDP2 keeps each forward all-gather's output until the next all-gather is issued: the
      last block's is still alive when the loss is computed inside the root's forward, and
      freed by the root's post-forward (measured: FSDPMemTracker's root BEF_POST_FW);
    - ZeRO-3: the root's pre-backward hook prefetches the last block: its all-gather output is
      alive while the loss's backward makes the logits' gradient;
    - ZeRO-3: the root is resharded after its forward too, so its pre-backward hook
      all-gathers it again before the loss's backward runs: the all-gather output and the
      unsharded parameters copied out of it are alive together beside every saved activation
      and the logits (phase "backward start, root all-gather");
    - at the end of backward, as the root's post-backward hook starts: its unsharded parameters
      and gradients (LoRA: the adapters' only, `fsdp2_gradient_elements`), the blocks' sharded gradients (the root's shards are its reduce-scatter's
      output, not made yet) and the first block's reduce-scatter input, which FSDP2 keeps
      until the next reduce-scatter is issued (measured: FSDPMemTracker's root BEF_POST_BW);
    - after the last block's backward, its reduce-scatter's copy-in (phase "backward, last
      block's reduce-scatter", `fsdp2_reduce_scatter_terms`);
    - without a pipeline, the last block's forward all-gather beside the previous block's
      output (phase "forward, last block's all-gather", `fsdp2_forward_gather_terms`).
    Nothing at dp = 1.

    Under CPU offload the step's states are the host's (`fsdp2_rank_states` gives none to the
    device, the blocks' sharded gradients at the end of backward included) and the optimizer
    runs there (no temporaries on the device). Each all-gather's host-to-device copies of the
    shards (1/dp of its group, `FSDPParam.all_gather_inputs`) are freed by its copy-in, and
    each reduce-scatter's output (1/dp of its input) is copied to the host inside
    `foreach_reduce`: both are shorter-lived and smaller than the buffers beside them at the
    moments above, none of which they enter (measured with FSDPMemTracker, shape-only, on a
    fake accelerator apart from the host)."""
    cfg, setup, stage = step.cfg, step.setup, step.stage
    if cpu_offload(setup):  # the optimizer steps the host's shards (CPUOffloadPolicy)
        ledger.replace(Phase.OPTIMIZER_STEP, OPTIMIZER_TEMPORARIES, 0)
    if setup.dp == 1:
        return
    un = fsdp2_unsharded(cfg, setup, stage)
    grad = fsdp2_gradient_elements(cfg, setup, stage)
    ub, rb = unsharded_bytes(setup), reduce_bytes(setup)
    root, block = un["root"], un["block"]
    # under a pipeline the blocks stay unsharded from the stage's first backward to the end of
    # the step (`fsdp2_pipeline_accumulation`): ZeRO-3 then holds what ZeRO-2 holds, and a
    # forward all-gathers nothing more (measured: the same peak at ZeRO-2 and ZeRO-3)
    deferred = setup.pp > 1 and stage_hold(cfg, step.workload, setup, stage).backward_done
    z3 = setup.zero == 3 and not deferred
    held = stage_layers(cfg, setup, stage) * block if setup.zero == 2 or deferred else 0
    gathered = 0 if deferred or (setup.pp > 1 and setup.zero == 2) else block
    for phase in ledger.forward_phases():
        ledger.add(phase, ROOT_PARAMETERS, root)
        ledger.add(phase, BLOCKS_KEPT, held)
        ledger.add(phase, LAST_BLOCK_KEPT, gathered)
    ledger.add(Phase.BACKWARD_START, ROOT_PARAMETERS, root)
    ledger.add(Phase.BACKWARD_START, BLOCKS_KEPT, held)
    ledger.add(Phase.BACKWARD_START, LAST_BLOCK_PREFETCH, block if z3 else 0)
    last = Phase.BACKWARD_LAST_BLOCK
    ledger.add(last, ROOT_PARAMETERS, root)
    ledger.add(last, BLOCK_COMPUTING, block if z3 else 0)
    ledger.add(last, NEXT_BLOCK, block if z3 else 0)
    ledger.add(last, BLOCKS_KEPT, held)
    # the blocks' sharded gradients: the root's shards are its reduce-scatter's output
    # (LoRA: the adapters' only, as the set-up's gradients count them)
    sharded = step.gradients if setup.lora_rank else fsdp2_rank_states(
        cfg, setup, first_rank(setup, stage)).gradients
    ledger.add(Phase.BACKWARD_END, ROOT_PARAMETERS, root)
    ledger.add(Phase.BACKWARD_END, ROOT_GRADIENTS, ub * grad["root"])
    ledger.replace(Phase.BACKWARD_END, GRADIENTS,
                   sharded - sharded_bytes(setup) * grad["root"] // setup.dp)
    ledger.add(Phase.BACKWARD_END, FIRST_BLOCK_REDUCE, rb * grad["block"])
    if setup.pp == 1 and stage_layers(cfg, setup, stage) > 1:
        forward = {**step.forward_tensors, LOGITS: 0}
        ledger.open(Phase.FORWARD_GATHER, forward)
        for term, nbytes in fsdp2_forward_gather_terms(cfg, step.workload, setup,
                                                       stage).items():
            (ledger.replace if term is SAVED else ledger.add)(Phase.FORWARD_GATHER, term,
                                                              nbytes)
    ledger.open(Phase.REDUCE_SCATTER, step.forward_tensors)
    for term, nbytes in fsdp2_reduce_scatter_terms(cfg, step.workload, setup, stage).items():
        (ledger.replace if term is SAVED else ledger.add)(Phase.REDUCE_SCATTER, term, nbytes)
    if z3:
        ledger.open(Phase.ROOT_REGATHER, step.forward_tensors)
        ledger.add(Phase.ROOT_REGATHER, ROOT_PARAMETERS, root)
        ledger.add(Phase.ROOT_REGATHER, ROOT_REGATHERED, root)


def fsdp2_resident(cfg: GPTConfig, setup: TrainingSetup, rank: int = 0) -> dict[str, int]:
    """What `rank` keeps between optimizer steps under FSDP2: its sharded parameters and the
    optimizer states; `zero_grad(set_to_none=True)` frees the sharded gradients and every
    parameter is resharded (ZeRO-2 too, after backward)."""
    st = fsdp2_rank_states(cfg, setup, rank)
    return {"weights (sharded)": st.weights, "optimizer states": st.optimizer}


class FSDP2(Engine):
    """PyTorch's `fully_shard` on every block and at the root."""

    name = "fsdp2"
    help = "fsdp2 (FSDP2 fully_shard: --zero 2 or 3 = reshard_after_forward False/True)"
    stages = (2, 3)
    mixed_by_default = True
    # each group's reduce-scatter output, of which its sharded gradients are views (and their
    # cast to the parameters' dtype), is allocated on the reduce-scatter stream: torch 2.13,
    # torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py, `foreach_reduce` ("The RS output
    # is allocated in the RS stream and used in the default stream (for optimizer)")
    gradient_stream = "reduce-scatter"
    # every all-gather's cast and output (`fsdp2_all_gather_buffers`) are allocated on the
    # all-gather copy-in stream, and the terms below are those outputs
    gather_stream = "all-gather copy-in"
    gather_terms = frozenset({LAST_BLOCK_KEPT, LAST_BLOCK_PREFETCH, LAST_BLOCK_GATHER,
                              NEXT_BLOCK, ROOT_REGATHERED})

    def gather_buffers(self, cfg: GPTConfig, setup: TrainingSetup, stage: Stage
                       ) -> dict[str, tuple[int, int]]:
        return fsdp2_all_gather_buffers(cfg, setup, stage)

    def mixed_precision(self, setup: TrainingSetup) -> str:
        return (f"mixed (MixedPrecisionPolicy: {setup.autocast_dtype} parameters, fp32 shards "
                f"and reduction)")

    def replicated(self, setup: TrainingSetup) -> bool:
        return False

    def rank_states(self, cfg: GPTConfig, setup: TrainingSetup, rank: int) -> RankStates:
        return fsdp2_rank_states(cfg, setup, rank)

    def finetune_states(self, cfg: GPTConfig, setup: TrainingSetup) -> dict[str, int]:
        return fsdp2_lora_states(cfg, setup, first_rank(setup, "first"))

    def resident(self, cfg: GPTConfig, setup: TrainingSetup, rank: int) -> dict[str, int]:
        return fsdp2_resident(cfg, setup, rank)

    def host(self, cfg: GPTConfig, setup: TrainingSetup, rank: int) -> dict[str, int]:
        return fsdp2_host(cfg, setup, rank)

    def check(self, setup: TrainingSetup) -> None:
        super().check(setup)
        # at dp 1 the step's gathered copies are the device's only parameters, which the
        # model (nothing of FSDP2's own at dp 1) does not count
        if cpu_offload(setup) and (setup.dp < 2 or setup.pp > 1 or setup.tp > 1
                                   or setup.lora_rank or setup.cp > 1):
            raise ConfigError("offload_param", "--offload-param cpu with --engine fsdp2 is "
                                               "modelled for data parallel alone (--dp 2 or "
                                               "more; no --pp, --tp, --cp or --lora-rank)")

    def assumptions(self, setup: TrainingSetup) -> str:
        return "; CPUOffloadPolicy (states on the host)" if cpu_offload(setup) else ""

    def master_gradient_bytes(self, setup: TrainingSetup, params: int) -> int:
        """The fp32 shards are the master weights and their gradients the sharded ones."""
        return 0

    def largest_optimizer_tensor(self, cfg: GPTConfig, setup: TrainingSetup,
                                 params: int) -> int:
        """The largest local shard: ceil(rows / dp) rows of a tensor's tp shard."""
        if setup.lora_rank:
            return super().largest_optimizer_tensor(cfg, setup, params)
        return max(rows_times_rest(shape, padded_rows(shape[0], setup.dp))
                   for t in stage_list(cfg, setup, 0)
                   for shape in [tp_local_shape(t, setup.tp, 0)])

    def optimizer_step_pairs(self, cfg: GPTConfig, setup: TrainingSetup, stage: Stage
                             ) -> set[tuple[int, int]]:
        """The local shards (ceil(rows / dp) rows of each tensor's tp shard), model order."""
        if setup.lora_rank:
            return super().optimizer_step_pairs(cfg, setup, stage)
        return step_order_pairs(cfg, setup, stage, lambda t: rows_times_rest(
            tp_local_shape(t, setup.tp, 0), padded_rows(tp_local_shape(t, setup.tp, 0)[0],
                                                        setup.dp)))

    def head_gradient_sharded(self, setup: TrainingSetup) -> bool:
        """FSDP2 keeps the root's gradients unsharded until the root's reduce-scatter."""
        return False

    def pipeline_accumulation(self, cfg: GPTConfig, setup: TrainingSetup, stage: Stage
                              ) -> dict[Term, int] | None:
        return fsdp2_pipeline_accumulation(cfg, setup, stage) if setup.dp > 1 else None

    def adjust(self, ledger: Ledger, step: Step) -> None:
        fsdp2_adjust(ledger, step)


register(FSDP2())

__all__ = ["FSDP2", "HOST_GRADIENTS", "HOST_OPTIMIZER", "HOST_PARAMETERS", "cpu_offload",
           "fsdp2_adapter_elements", "fsdp2_all_gather_buffers", "fsdp2_adjust", "fsdp2_forward_gather_terms",
           "fsdp2_host", "fsdp2_sharded_states", "fsdp2_gradient_elements", "fsdp2_lora_states", "fsdp2_pipeline_accumulation", "fsdp2_rank_states", "fsdp2_reduce_scatter_terms",
           "fsdp2_resident", "fsdp2_unsharded", "fsdp2_unsharded_elements", "optimizer_bytes",
           "reduce_bytes", "sharded_bytes", "unsharded_bytes"]
