"""FSDP1 (`torch.distributed.fsdp.FullyShardedDataParallel`, one unit per block and the root),
per rank.

How accelerate (its default `fsdp_version` 1) and the Trainer ran FSDP through 2024: each
transformer block is a unit (`transformer_auto_wrap_policy` over the block class) and the root
a unit of what is left (embeddings, final norm, head). A unit flattens its parameters into one
1-D FlatParameter, in the module's order; with `use_orig_params=True` (the Trainer's default,
which frozen parameters and torch.compile need) each parameter starts at a multiple of 16 bytes
of the compute dtype (`aligned_numel`) and the whole is padded to a multiple of the world size
(`FlatParamHandle._init_flat_param_and_metadata`, torch/distributed/fsdp/_flat_param.py,
torch 2.13). Rank r owns elements [r S, (r + 1) S) of it, S = padded / dp: its sharded flat
parameter and sharded gradient are S elements; the optimizer steps the original parameters'
views of the shard (a parameter with no element on the rank has no gradient and no state).

`--zero 3` is ShardingStrategy.FULL_SHARD (a block's unsharded flat parameter is freed after
its forward and all-gathered again in backward), `--zero 2` SHARD_GRAD_OP (kept from the
forward to the end of its backward). The root is never resharded after its forward (FSDP1 keeps
the root's for the backward that follows at once). PyTorch's defaults otherwise:
BackwardPrefetch.BACKWARD_PRE (the next unit's all-gather is issued before the current unit's
backward computes), no forward prefetch, limit_all_gathers.

Mode mixed is `MixedPrecision(param_dtype=bf16, reduce_dtype=fp32)`: fp32 flat parameters are
the master weights, bf16 unsharded parameters and gradients, an fp32 reduce-scatter.

Gradient accumulation (`fsdp1_sync`): by default every micro-batch but the last runs under
`model.no_sync()`, as the Hugging Face Trainer runs FSDP1 through accelerate (transformers 5.24
`Trainer._inner_training_loop` enters `accelerator.no_sync` for every micro-batch but the last
unless accelerate's GradientAccumulationPlugin `sync_each_batch` is set, which defaults False;
accelerate 1.15), the most common way FSDP1 is run with accumulation; each-batch is
`sync_each_batch=True` or a plain loop (torchtitan and plain-PyTorch loops have no FSDP1
default), its sharded gradients accumulating (`fsdp1_no_sync_adjust`).

LoRA is FSDP1 as the Trainer and accelerate run a PEFT model: PEFT's `fsdp_auto_wrap_policy`
adds a unit per lora_A and lora_B beside the blocks, so the blocks' and the root's units hold
frozen weights only (`fsdp1_lora_states`, `fsdp1_lora_adjust`).

Every function here is pure and never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...config import GPTConfig
from ...errors import ConfigError
from ...schedules import Stage
from ...training_setup import TrainingSetup
from ...workload import Workload
from ..ledger import GRADIENTS, GRADIENTS_ACCUMULATING, SAVED, Ledger, Phase, Term
from ..states import stage_tensors
from .base import Engine, Step, register
from .shards import RankStates, coords, first_rank, optimizer_over, step_counters

# FlatParamHandle aligns each original parameter to 16 bytes of its compute dtype
# (`_get_aligned_numel`: ALIGNMENT = 16 bytes, torch/distributed/fsdp/_flat_param.py)
ALIGNMENT_BYTES = 16


def compute_bytes(setup: TrainingSetup) -> int:
    """Bytes of one element of an unsharded flat parameter and of its unsharded gradient:
    MixedPrecision's param_dtype (bf16) in mode mixed, bf16 in mode bf16, else fp32."""
    return 2 if setup.mode in ("mixed", "bf16") else 4


def sharded_bytes(setup: TrainingSetup) -> int:
    """Bytes of one element of a sharded flat parameter or gradient: the dtype the model was
    built in (fp32 unless mode bf16); MixedPrecision keeps the shards fp32."""
    return 2 if setup.mode == "bf16" else 4


def reduce_bytes(setup: TrainingSetup) -> int:
    """Bytes of one element of the reduce-scatter input: reduce_dtype fp32 in mode mixed."""
    return 2 if setup.mode == "bf16" else 4


def aligned_numel(setup: TrainingSetup) -> int:
    """Elements of the compute dtype in `ALIGNMENT_BYTES` (4 in fp32, 8 in bf16)."""
    return ALIGNMENT_BYTES // compute_bytes(setup)


@dataclass(frozen=True)
class FlatUnit:
    """One FSDP1 unit's FlatParameter: where each original parameter starts and how many
    elements it has, and the padded total (a multiple of the world size)."""

    starts: tuple[int, ...]
    numels: tuple[int, ...]
    padded: int

    def shard(self, dp: int) -> int:
        """Elements of one rank's shard."""
        return self.padded // dp

    def owned(self, dp: int, rank: int) -> list[int]:
        """Elements of each original parameter inside rank `rank`'s shard."""
        s = self.shard(dp)
        lo, hi = rank * s, (rank + 1) * s
        return [max(0, min(hi, a + n) - max(lo, a)) for a, n in zip(self.starts, self.numels)]


def flat_unit(numels: list[int], align: int, dp: int) -> FlatUnit:
    """The FlatParameter of parameters of `numels` elements in order: before each, padding to
    a multiple of `align` (none before the first), then the total padded to a multiple of
    `dp` (`_init_flat_param_and_metadata` with use_orig_params=True)."""
    starts, total = [], 0
    for n in numels:
        total += -total % align
        starts.append(total)
        total += n
    return FlatUnit(tuple(starts), tuple(numels), total + -total % dp)


def fsdp1_units(cfg: GPTConfig, setup: TrainingSetup) -> dict[str, FlatUnit]:
    """The two kinds of unit: `block` (one transformer block, each wrapped on its own; every
    block alike) and `root` (the parameters outside the blocks, in the module's order), each
    parameter tensor in the inventory's order, a tensor of `copies` per block repeated."""
    align, dp = aligned_numel(setup), setup.dp
    root: list[int] = []
    block: list[int] = []
    for t in stage_tensors(cfg, setup, "first"):
        (block if t.place == "block" else root).extend([t.numel] * t.copies)
    return {"root": flat_unit(root, align, dp), "block": flat_unit(block, align, dp)}


def fsdp1_rank_states(cfg: GPTConfig, setup: TrainingSetup, rank: int = 0) -> RankStates:
    """FSDP1's states on `rank`: the sharded flat parameter and its sharded gradient of every
    unit (`FlatUnit.shard`, padding included) in `sharded_bytes`; the optimizer over the
    original parameters' elements in the rank's shard (fp32 AdamW: 8 bytes each, the shards
    are the master weights) and its 0-d step per parameter that has any."""
    _, dp_rank, _ = coords(rank, setup)
    units = fsdp1_units(cfg, setup)
    count = {"root": 1, "block": cfg.n_layer}
    flat = sum(count[k] * u.shard(setup.dp) for k, u in units.items())
    shapes, tensors = [], 0
    for k, u in units.items():
        for own in u.owned(setup.dp, dp_rank):
            if own:
                shapes.append(((own,), count[k]))
                tensors += count[k]
    mode = "fp32" if setup.mode == "mixed" else setup.mode
    opt = optimizer_over(setup, shapes, mode) + step_counters(setup, tensors)
    sb = sharded_bytes(setup)
    return RankStates(sb * flat, sb * flat, opt, step_counters(setup, tensors),
                      "FSDP1: flat parameters per unit, padded to a multiple of dp; optimizer "
                      "over the original parameters' shard views")


def fsdp1_adapter_units(cfg: GPTConfig, setup: TrainingSetup
                        ) -> list[tuple[FlatUnit, int, str]]:
    """LoRA's units under PEFT's wrap policy: every lora_A (m r x in) and lora_B (out x m r)
    of the selected adapters (`lora.selected`) is its own FSDP unit of one parameter, so its
    FlatParameter is the weight padded to a multiple of dp. (unit, count, place): `block` for
    a block Linear's adapters, `root` for the output head's (and other adapters outside the
    blocks), lora_A before lora_B, in the adapters' order."""
    from ...lora import selected

    align, out = aligned_numel(setup), []
    for a in selected(cfg, setup.lora_targets):
        r = setup.lora_rank * a.rank_mult
        place = "root" if a.name == "lm_head" or not a.covers else "block"
        for n in (r * a.in_features, a.out_features * r):
            out.append((flat_unit([n], align, setup.dp), a.count, place))
    return out


def fsdp1_lora_states(cfg: GPTConfig, setup: TrainingSetup, rank: int = 0) -> dict[str, int]:
    """LoRA's states on `rank` under FSDP1 with PEFT's wrap policy, by `finetune.
    finetune_state_bytes`' lines. PEFT's `fsdp_auto_wrap_policy` (peft/utils/other.py,
    PEFT 0.21; the Trainer sets it for a PEFT model, transformers' `update_fsdp_plugin_peft`)
    wraps every leaf module whose weight trains as its own unit beside the blocks: each
    lora_A and lora_B is a unit of its own, and the blocks' and the root's units hold only
    frozen parameters. With use_orig_params a FlatParameter requires grad only when one of
    its original parameters does (`FlatParamHandle._reset_flat_param_grad_info_if_needed`,
    torch 2.13): the frozen units get no gradient, no reduce-scatter and no optimizer state.

    - base/weights: the frozen units' sharded flat parameters (`fsdp1_units`, the same as in
      full training), `sharded_bytes` each element;
    - adapter/weights and adapter/gradients: each adapter unit's shard (`fsdp1_adapter_units`);
    - adapter/optimizer: the optimizer over the adapter elements in the rank's shard
      (`optimizer_mode`: fp32 AdamW, 8 bytes each) and a step counter per adapter with any.
    Measured on 2 gloo ranks (tests/test_fsdp1_lora.py)."""
    _, dp_rank, _ = coords(rank, setup)
    units, dp, sb = fsdp1_units(cfg, setup), setup.dp, sharded_bytes(setup)
    base = units["root"].shard(dp) + cfg.n_layer * units["block"].shard(dp)
    flat = tensors = 0
    shapes = []
    for unit, count, _ in fsdp1_adapter_units(cfg, setup):
        flat += count * unit.shard(dp)
        own = unit.owned(dp, dp_rank)[0]
        if own:
            shapes.append(((own,), count))
            tensors += count
    mode = "fp32" if setup.mode == "mixed" else setup.mode
    return {"base/weights": sb * base, "adapter/weights": sb * flat,
            "adapter/gradients": sb * flat,
            "adapter/optimizer": optimizer_over(setup, shapes, mode)
            + step_counters(setup, tensors)}


ROOT_PARAMETERS = Term("FSDP1 unsharded root flat parameter")
BLOCKS_KEPT = Term("FSDP1 unsharded blocks (SHARD_GRAD_OP keeps them)")
BLOCK_COMPUTING = Term("FSDP1 unsharded block (computing)")
NEXT_BLOCK = Term("FSDP1 all-gather of the next block (BACKWARD_PRE prefetch)")
ROOT_GRADIENTS = Term("FSDP1 unsharded root gradient (before its reduce-scatter)")
BLOCK_GRADIENT = Term("FSDP1 unsharded flat gradient of the last block")
BLOCK_GRADIENT_PARTS = Term("FSDP1 the last block's parameters' gradients (concatenated into it)")
HEAD_GRADIENT = Term("FSDP1 head's gradient (waits for the root's flat gradient)")
INPUT_GRADIENT = Term("FSDP1 gradient of the last block's input")
REDUCE_OUTPUT = Term("FSDP1 reduce-scatter output shard of the last block")
GLOO_COPY = Term("FSDP1 gloo reduce-scatter's copy of its input (CPU)")
BLOCK_REDUCE = Term("FSDP1 reduce-scatter input of the last block (reduce_dtype)")
ROOT_REDUCE = Term("FSDP1 reduce-scatter of the root (input and output shard)")


def fsdp1_unsharded(cfg: GPTConfig, setup: TrainingSetup) -> dict[str, int]:
    """Bytes of an all-gathered unit, `root` and `block`: its padded flat parameter in
    `compute_bytes`."""
    cb = compute_bytes(setup)
    return {k: cb * u.padded for k, u in fsdp1_units(cfg, setup).items()}


def fsdp1_block_gradient_terms(cfg: GPTConfig, workload: Workload, setup: TrainingSetup
                               ) -> dict[Term, int]:
    """The last block's gradient at the end of its backward, the larger of two moments.

    (a) The flat gradient is made: with use_orig_params the original parameters are views
    split out of the unsharded flat parameter, so autograd makes their gradients one by one
    and, once the last is made, concatenates them (split_with_sizes' backward, padding as
    zeros) into the flat parameter's padded gradient: the parts and the whole are alive
    together, beside the block's unsharded parameters.
    (b) The post-backward hook: the block is resharded first (SHARD_GRAD_OP too), the parts are
    freed; the flat gradient is cast to reduce_dtype where it differs (mode mixed), the
    reduce-scatter's output shard is made in reduce_dtype, and on CPU gloo's reduce-scatter
    copies its whole input (measured: a second reduce_dtype flat gradient).

    Beside either: the root's unsharded parameters, the previous block prefetched
    (FULL_SHARD, BACKWARD_PRE) or the blocks SHARD_GRAD_OP keeps, the head's gradient (the
    root's parts wait for the embedding's, made last), the gradient of the block's input, and
    the activations the blocks before it saved (its own are freed). fp32 peaks at (a), mode
    mixed at (b). Measured with MemTracker on CPU/gloo, torch 2.13 (FSDP1's peak in full
    training)."""
    from ..activations import device_activations, saved_in
    from .fsdp2 import _last_block_saved

    acts = device_activations(cfg, workload, setup, "first")
    layer = _last_block_saved(cfg, workload, setup, acts, cfg.n_layer)
    later = saved_in(acts, "cross_entropy") + saved_in(acts, "final")
    un = fsdp1_unsharded(cfg, setup)
    unit = fsdp1_units(cfg, setup)["block"]
    cb, rb, L = compute_bytes(setup), reduce_bytes(setup), cfg.n_layer
    z3 = setup.zero == 3
    head = sum(t.numel for t in stage_tensors(cfg, setup, "first") if t.place == "head")
    if cfg.tie_embeddings:
        head += cfg.vocab_size * cfg.n_embd
    both = {SAVED: sum(acts.values()) - later - layer,
            ROOT_PARAMETERS: un["root"],
            NEXT_BLOCK: un["block"] if z3 and L > 1 else 0,
            HEAD_GRADIENT: cb * head,
            INPUT_GRADIENT: cb * workload.tokens * cfg.n_embd,
            BLOCK_GRADIENT: cb * unit.padded}
    made = {**both, BLOCK_COMPUTING: un["block"] if z3 else 0,
            BLOCKS_KEPT: 0 if z3 else un["block"] * L,
            BLOCK_GRADIENT_PARTS: cb * sum(unit.numels)}
    hook = {**both, BLOCKS_KEPT: 0 if z3 else un["block"] * (L - 1),
            BLOCK_REDUCE: rb * unit.padded if rb != cb else 0,
            REDUCE_OUTPUT: rb * unit.shard(setup.dp),
            GLOO_COPY: rb * unit.padded if setup.device == "cpu" else 0}
    return max(made, hook, key=lambda terms: sum(terms.values()))


ROOT_GRADIENT_PARTS = Term("FSDP1 the root's parameters' gradients (concatenated into its "
                           "flat gradient)")
NO_SYNC_GRADIENTS = Term("FSDP1 unsharded gradients kept through no_sync (every unit)")


def fsdp1_root_end_terms(cfg: GPTConfig, setup: TrainingSetup) -> dict[str, dict[Term, int]]:
    """The end of backward, where the root's flat gradient is made and reduced, as two
    moments (the terms that differ between them; the root's unsharded flat gradient is alive
    at both), as `fsdp1_block_gradient_terms` has them for the last block:

    - `made`: the embedding's gradient closes the backward; autograd concatenates the root's
      parameters' gradients (the head's, made first, the final norm's and the embedding's)
      into the padded flat gradient, the parts and the whole alive together beside the root's
      unsharded parameters;
    - `hook`: its post-backward hook reshards the root (frees its unsharded parameters), casts
      the flat gradient to reduce_dtype where it differs, makes the reduce-scatter's output
      shard, and on CPU gloo copies the input.
    Measured with MemTracker on CPU/gloo, torch 2.13 (tests/test_fsdp1_no_sync.py: a large
    vocabulary, where the end of backward is the step's peak)."""
    units = fsdp1_units(cfg, setup)
    root, cb, rb = units["root"], compute_bytes(setup), reduce_bytes(setup)
    made = {ROOT_PARAMETERS: fsdp1_unsharded(cfg, setup)["root"],
            ROOT_GRADIENT_PARTS: cb * sum(root.numels), ROOT_REDUCE: 0}
    hook = {ROOT_PARAMETERS: 0, ROOT_GRADIENT_PARTS: 0,
            ROOT_REDUCE: (rb * root.padded if rb != cb else 0) + rb * root.shard(setup.dp)
            + (rb * root.padded if setup.device == "cpu" else 0)}
    return {"made": made, "hook": hook}


def fsdp1_no_sync_bytes(cfg: GPTConfig, setup: TrainingSetup) -> int:
    """Bytes of the unsharded flat gradients FSDP1 keeps through `no_sync()`: every unit's
    padded flat gradient in `compute_bytes` (MixedPrecision's param_dtype in mode mixed);
    under LoRA only the adapters' units have gradients (`fsdp1_adapter_units`). Under
    no_sync the post-backward hook reshards the unit but reduces nothing and keeps
    `flat_param.grad` whole (`_post_backward_hook`: `_sync_gradients` False,
    `_use_unsharded_grad_views`; the final callback keeps it, `_finalize_params`; torch 2.13,
    torch/distributed/fsdp/_runtime_utils.py); the next backward accumulates into it in place
    (`FlatParamHandle.prepare_gradient_for_backward` keeps a gradient of the unsharded size).
    In fp32: dp times the sharded gradients. Measured against FSDP1 itself
    (tests/test_fsdp1_no_sync.py)."""
    cb = compute_bytes(setup)
    if setup.lora_rank:
        return cb * sum(count * u.padded for u, count, _ in fsdp1_adapter_units(cfg, setup))
    units = fsdp1_units(cfg, setup)
    return cb * (units["root"].padded + cfg.n_layer * units["block"].padded)


def fsdp1_no_sync_adjust(ledger: Ledger, step: Step) -> None:
    """FSDP1 with grad_accum m > 1 under `no_sync()` (`fsdp1_sync` no-sync), after the moments
    of one micro-batch (`fsdp1_adjust`, `fsdp1_lora_adjust`): the sharded gradients of earlier
    micro-batches (`GRADIENTS_ACCUMULATING`, what each-batch holds) do not exist; instead every
    unit's unsharded flat gradient (`fsdp1_no_sync_bytes`) is alive from the second
    micro-batch's forward to the last one's backward, whose post-backward hooks reduce-scatter
    each unit's accumulated gradient into its sharded one (`_reduce_grad`, `_saved_grad_shard`)
    and free it. The end of backward is the larger of two: a no_sync micro-batch's (every
    unit's gradient kept, the root's new one made beside it and added in place; no sharded
    gradient, no reduce-scatter) and the last one's (the blocks' kept gradients reduced and
    freed, the root's, reduced last as the embedding's gradient closes the backward, still
    alive beside its new one; under LoRA the root is frozen). SHARD_GRAD_OP keeps its units
    gathered through the no_sync backwards (`_should_free_in_backward`), as `fsdp1_adjust`
    keeps them from a forward to its backward; FULL_SHARD re-gathers them as in one
    micro-batch. Before the end of backward every later micro-batch holds the first one's
    moments plus the kept gradients."""
    cfg, setup = step.cfg, step.setup
    held = fsdp1_no_sync_bytes(cfg, setup)
    during = (*ledger.forward_phases(), Phase.BACKWARD_START, Phase.BACKWARD_LAST_BLOCK,
              Phase.REDUCE_SCATTER)
    for phase in during:
        if GRADIENTS_ACCUMULATING in ledger.terms(phase):
            ledger.replace(phase, GRADIENTS_ACCUMULATING, 0)
        ledger.add(phase, NO_SYNC_GRADIENTS, held)
    # before the last block's backward only the head's gradient (full training) is made
    ledger.replace(Phase.BACKWARD_LAST_BLOCK, GRADIENTS, 0 if setup.lora_rank else
                   setup.weight_bytes * cfg.vocab_size * cfg.n_embd)
    if setup.lora_rank:  # the root is frozen: a no_sync backward's end keeps the adapters'
        if held > ledger.get(Phase.BACKWARD_END, GRADIENTS):
            ledger.replace(Phase.BACKWARD_END, GRADIENTS, 0)
            ledger.add(Phase.BACKWARD_END, NO_SYNC_GRADIENTS, held)
        return
    # the end of backward, the largest of three moments: the last micro-batch's root gradient
    # made (its kept one beside the new one and its parts) or reduced (the post-backward hook
    # runs on AccumulateGrad's node, whose input, the new gradient, is alive beside the kept
    # one it was added into), and a no_sync micro-batch's made: the blocks' kept gradients
    # (and from the third micro-batch on the root's), none sharded yet, SHARD_GRAD_OP's blocks
    # still gathered
    end = fsdp1_root_end_terms(cfg, setup)
    rg = compute_bytes(setup) * fsdp1_units(cfg, setup)["root"].padded
    sharded = ledger.get(Phase.BACKWARD_END, GRADIENTS)
    kept = 0 if setup.zero == 3 else cfg.n_layer * fsdp1_unsharded(cfg, setup)["block"]
    quiet = held if step.workload.grad_accum > 2 else held - rg
    moments = [{GRADIENTS: sharded, **end["made"], NO_SYNC_GRADIENTS: rg, BLOCKS_KEPT: 0},
               {GRADIENTS: sharded, **end["hook"], NO_SYNC_GRADIENTS: rg, BLOCKS_KEPT: 0},
               {GRADIENTS: 0, **end["made"], NO_SYNC_GRADIENTS: quiet, BLOCKS_KEPT: kept}]
    terms = ledger.terms(Phase.BACKWARD_END)
    for term, nbytes in max(moments, key=lambda t: sum(t.values())).items():
        (ledger.replace if term in terms else ledger.add)(Phase.BACKWARD_END, term, nbytes)


def fsdp1_accumulation(setup: TrainingSetup, m: int) -> str:
    """What the first line says of how FSDP1 accumulates `m` micro-batches ("; ..."), else
    "" (another engine, one micro-batch, or dp 1)."""
    if setup.engine != "fsdp1" or m == 1 or setup.dp == 1:
        return ""
    if setup.fsdp1_sync == "no-sync":
        return ("; FSDP1 accumulates under no_sync (the Trainer's: every unit's unsharded "
                "gradient kept, reduce-scattered after the last micro-batch; --fsdp1-sync)")
    return "; FSDP1 reduce-scatters every micro-batch (--fsdp1-sync each-batch)"


def no_sync(step: Step) -> bool:
    """Whether the step accumulates micro-batches under FSDP1's `no_sync()`."""
    return step.workload.grad_accum > 1 and step.setup.fsdp1_sync == "no-sync"


def fsdp1_adjust(ledger: Ledger, step: Step) -> None:
    """What FSDP1 holds beyond the sharded states at each moment of the step peak:

    - the root's flat parameter is unsharded from its pre-forward to its post-backward;
    - FULL_SHARD: a block is unsharded while it computes; at backward start the root's
      pre-backward hook prefetches the last block (BACKWARD_PRE); in the last block's backward
      the previous block's all-gather is issued before it computes;
    - SHARD_GRAD_OP: every block stays unsharded from its forward to its backward;
    - at the end of the last block's backward its flat gradient is made, then reduce-scattered
      (phase "backward, last block's reduce-scatter", `fsdp1_block_gradient_terms`);
    - at the end of backward the root's unsharded gradient and the blocks' sharded ones, with
      the larger of the root's gradient made (its parts, beside its parameters) or reduced
      (its reduce-scatter's input and output, `fsdp1_root_end_terms`); with grad_accum > 1
      each-batch, the root's sharded gradient of the earlier micro-batches too, and under
      no_sync `fsdp1_no_sync_adjust`.
    Nothing at dp = 1."""
    cfg, setup = step.cfg, step.setup
    if setup.dp == 1:
        return
    un = fsdp1_unsharded(cfg, setup)
    units = fsdp1_units(cfg, setup)
    root, block = un["root"], un["block"]
    z3 = setup.zero == 3
    kept = cfg.n_layer * block if not z3 else 0
    cb, sb = compute_bytes(setup), sharded_bytes(setup)
    for phase in ledger.forward_phases():
        ledger.add(phase, ROOT_PARAMETERS, root)
        ledger.add(phase, BLOCKS_KEPT, kept)
    ledger.add(Phase.BACKWARD_START, ROOT_PARAMETERS, root)
    ledger.add(Phase.BACKWARD_START, BLOCKS_KEPT, kept)
    ledger.add(Phase.BACKWARD_START, NEXT_BLOCK, block if z3 else 0)
    last = Phase.BACKWARD_LAST_BLOCK
    ledger.add(last, ROOT_PARAMETERS, root)
    ledger.add(last, BLOCKS_KEPT, kept)
    ledger.add(last, BLOCK_COMPUTING, block if z3 else 0)
    ledger.add(last, NEXT_BLOCK, block if z3 and cfg.n_layer > 1 else 0)
    ledger.open(Phase.REDUCE_SCATTER, step.forward_tensors)
    for term, nbytes in fsdp1_block_gradient_terms(cfg, step.workload, setup).items():
        (ledger.replace if term is SAVED else ledger.add)(Phase.REDUCE_SCATTER, term, nbytes)
    ledger.add(Phase.BACKWARD_END, ROOT_GRADIENTS, cb * units["root"].padded)
    ledger.replace(Phase.BACKWARD_END, GRADIENTS,
                   sb * cfg.n_layer * units["block"].shard(setup.dp))
    end = fsdp1_root_end_terms(cfg, setup)
    for term, nbytes in max(end.values(), key=lambda terms: sum(terms.values())).items():
        ledger.add(Phase.BACKWARD_END, term, nbytes)
    if no_sync(step):
        fsdp1_no_sync_adjust(ledger, step)
    elif step.workload.grad_accum > 1:  # each-batch: the root's sharded gradient of the
        # earlier micro-batches (`_saved_grad_shard`), which its reduce-scatter adds into
        ledger.add(Phase.BACKWARD_END, GRADIENTS_ACCUMULATING, sb * units["root"].shard(setup.dp))


FIRST_NORM_BACKWARD = Term("FSDP1 the last block's first norm's backward (its input and "
                           "statistics, the gradients in flight)")
GATHER_SHARD = Term("FSDP1 the previous block's shard cast to bf16 for its all-gather "
                    "(MixedPrecision)")
FIRST_BLOCK = Term("FSDP1 unsharded first block (resharded only at the end of backward)")
ADAPTER_PREFETCH = Term("FSDP1 all-gather of the last block's last adapter (BACKWARD_PRE "
                        "prefetch)")


ADAPTER_COPIES = Term("FSDP1 adapters' own 16-bit input copies (PEFT casts the input to the "
                      "sharded fp32 adapter's dtype)")


def fsdp1_adapter_copies(cfg: GPTConfig, workload: Workload, setup: TrainingSetup
                         ) -> dict[str, int]:
    """Saved bytes beyond the step's saved activations in mode mixed: PEFT's `lora.Linear.
    forward` casts the input to `lora_A.weight.dtype` before lora_A's unit is gathered, and
    with use_orig_params a resharded unit's original parameter is its fp32 shard view, so the
    input is cast to fp32 and autocast casts it back to bf16 for lora_A's matmul, which saves
    that copy: each adapter keeps an input of its own, as under mode amp (`finetune.
    adapter_copies`, without amp's weight copies: the gathered adapters are bf16), and the
    Linear's input is kept only where the frozen base needs it. By part: `blocks` (all L),
    `last` (the last block's), `head` (the output head's). Measured: the twin's live saved
    bytes equal these lines (tests/test_fsdp1_lora.py). Zeros outside mode mixed."""
    from dataclasses import replace

    from ..activations import saved_activations
    from ..finetune import finetune_saved

    if setup.mode != "mixed":
        return {"blocks": 0, "last": 0, "head": 0}

    def extra(c: GPTConfig) -> tuple[int, int]:
        normal = saved_activations(c, workload, setup)
        base = saved_activations(c, workload, replace(setup, lora_rank=0, lora_dropout=0))
        own = {k: v for k, v in finetune_saved(c, workload, setup, base, True).items()
               if not k.endswith("/weight_copies")}
        head = sum(own.get(k, 0) - normal.get(k, 0) for k in set(own) | set(normal)
                   if k.startswith(("final/", "lora/lm_head/")))
        return sum(own.values()) - sum(normal.values()) - head, head

    blocks, head = extra(cfg)
    fewer = extra(cfg.replace(n_layer=cfg.n_layer - 1))[0] if cfg.n_layer > 1 else 0
    return {"blocks": blocks, "last": blocks - fewer, "head": head}


def fsdp1_lora_block_end_terms(cfg: GPTConfig, workload: Workload, setup: TrainingSetup
                               ) -> dict[Term, int]:
    """Under LoRA, the end of the last block's backward (its first norm's backward), before
    the block's frozen unit is resharded: FSDP1 reshards a unit whose flat parameter does not
    require grad from a hook on its inputs' gradients (`_register_post_backward_reshard_only_
    hook`, torch 2.13), which fires only once the block's input gradient is made. By then the
    previous block is all-gathered too: BACKWARD_PRE prefetches, at a unit's pre-backward, the
    unit before it in post-forward order, and the unit before the block's first adapter is the
    previous block. Alive: the root's unsharded flat parameter, the block's and the previous
    one's (ZeRO-2: every block's), the activations the blocks before it saved, and the first
    norm's backward: its saved input and statistics (N E in the stream's dtype, N fp32) beside
    its output's gradient, the residual stream's and the backward's temporaries, five more
    N E (an RMSNorm written out, measured: 6 N E in all with the input, fp32 and mixed). Measured
    with MemTracker on CPU/gloo, torch 2.13: the step's peak where the weights outweigh the
    activations, within 0.2% of it in fp32. In mixed precision (ZeRO-3) the previous block's
    all-gather reads a bf16 copy of its fp32 shard (`_use_low_precision_shard`), alive beside
    the gathered block while the first adapter's backward runs: counted here beside the
    block end's activations, which hold at least as much as that moment's (measured within
    1%, `tests/test_fsdp1_lora.py`)."""
    from ..activations import device_activations, saved_in
    from .fsdp2 import _last_block_saved

    acts = device_activations(cfg, workload, setup, "first")
    layer = _last_block_saved(cfg, workload, setup, acts, cfg.n_layer)
    later = saved_in(acts, "cross_entropy") + saved_in(acts, "final")
    un, L, z3 = fsdp1_unsharded(cfg, setup), cfg.n_layer, setup.zero == 3
    unit, cast, sb = fsdp1_units(cfg, setup)["block"], compute_bytes(setup), sharded_bytes(setup)
    return {SAVED: sum(acts.values()) - later - layer,
            ROOT_PARAMETERS: un["root"],
            BLOCK_COMPUTING: un["block"] if z3 else 0,
            BLOCKS_KEPT: 0 if z3 else un["block"] * L,
            NEXT_BLOCK: un["block"] if z3 and L > 1 else 0,
            FIRST_NORM_BACKWARD: 6 * setup.stream_bytes * workload.tokens * cfg.n_embd
            + 4 * workload.tokens,
            GATHER_SHARD: cast * unit.shard(setup.dp) if z3 and L > 1 and cast != sb else 0,
            ADAPTER_COPIES: (lambda c: c["blocks"] - c["last"])(
                fsdp1_adapter_copies(cfg, workload, setup))}


def fsdp1_lora_adjust(ledger: Ledger, step: Step) -> None:
    """What FSDP1 holds beyond the sharded states under LoRA with PEFT's wrap policy
    (`fsdp1_lora_states`): the frozen units are gathered as in full training (the root from
    its pre-forward to the end of backward; FULL_SHARD a block while it computes, SHARD_GRAD_OP
    every block from its forward to its backward; at backward start the root's pre-backward
    prefetches the last block), but nothing of theirs is reduce-scattered. In the last block's
    backward the unit prefetched beside it is the block's last adapter (the unit before the
    block in post-forward order), not the previous block, which is gathered at the block's
    first adapter and held with it to the block's end (`fsdp1_lora_block_end_terms`, phase
    "backward, last block's reduce-scatter"). The first block's input needs no gradient (the
    embeddings are frozen), so no hook reshards its unit: it stays gathered to the end of
    backward (`_catch_all_reshard` in the final callback). The adapters' units are gathered
    and their gradients reduce-scattered one at a time, a few r x E elements each. Nothing at
    dp = 1."""
    cfg, setup = step.cfg, step.setup
    if setup.dp == 1:
        return
    un = fsdp1_unsharded(cfg, setup)
    root, block = un["root"], un["block"]
    z3 = setup.zero == 3
    kept = cfg.n_layer * block if not z3 else 0
    last = [u for u, _, place in fsdp1_adapter_units(cfg, setup) if place == "block"][-1]
    prefetch = compute_bytes(setup) * last.padded
    copies = fsdp1_adapter_copies(cfg, step.workload, setup)
    for phase in ledger.forward_phases():
        ledger.add(phase, ROOT_PARAMETERS, root)
        ledger.add(phase, BLOCKS_KEPT, kept)
    ledger.add(Phase.FORWARD_END, ADAPTER_COPIES, copies["blocks"] + copies["head"])
    ledger.add(Phase.BACKWARD_START, ROOT_PARAMETERS, root)
    ledger.add(Phase.BACKWARD_START, BLOCKS_KEPT, kept)
    ledger.add(Phase.BACKWARD_START, NEXT_BLOCK, block if z3 else 0)
    ledger.add(Phase.BACKWARD_START, ADAPTER_COPIES, copies["blocks"] + copies["head"])
    ledger.add(Phase.BACKWARD_LAST_BLOCK, ADAPTER_COPIES, copies["blocks"])
    ledger.add(Phase.BACKWARD_LAST_BLOCK, ROOT_PARAMETERS, root)
    ledger.add(Phase.BACKWARD_LAST_BLOCK, BLOCKS_KEPT, kept)
    ledger.add(Phase.BACKWARD_LAST_BLOCK, BLOCK_COMPUTING, block if z3 else 0)
    ledger.add(Phase.BACKWARD_LAST_BLOCK, ADAPTER_PREFETCH,
               prefetch if z3 and cfg.n_layer > 1 else 0)
    ledger.add(Phase.BACKWARD_END, ROOT_PARAMETERS, root)
    ledger.add(Phase.BACKWARD_END, FIRST_BLOCK, block)
    ledger.open(Phase.REDUCE_SCATTER, step.forward_tensors)
    for term, nbytes in fsdp1_lora_block_end_terms(cfg, step.workload, setup).items():
        (ledger.replace if term is SAVED else ledger.add)(Phase.REDUCE_SCATTER, term, nbytes)
    if no_sync(step):
        fsdp1_no_sync_adjust(ledger, step)


def fsdp1_resident(cfg: GPTConfig, setup: TrainingSetup, rank: int = 0) -> dict[str, int]:
    """What `rank` keeps between optimizer steps: its sharded flat parameters, the optimizer
    states and the sharded flat gradients. `zero_grad(set_to_none=True)` drops the original
    parameters' gradients (views of the flat one) but the flat parameter keeps its own until
    the next forward's pre-forward frees it (`_reset_flat_param_grad_info_if_needed`, which
    runs when every original parameter's gradient is None; torch 2.13). Measured between two
    steps on 2 gloo ranks (`gptcalc verify --engine fsdp1`)."""
    st = fsdp1_rank_states(cfg, setup, rank)
    return {"weights (sharded)": st.weights, "optimizer states": st.optimizer,
            "gradients (sharded, freed at the next forward)": st.gradients}


class FSDP1(Engine):
    """PyTorch's FullyShardedDataParallel, a unit per block and the root."""

    name = "fsdp1"
    help = ("fsdp1 (FullyShardedDataParallel, flat parameters: --zero 3 = FULL_SHARD, "
            "--zero 2 = SHARD_GRAD_OP)")
    stages = (2, 3)
    mixed_by_default = True
    context_parallel = False

    def check(self, setup: TrainingSetup) -> None:
        super().check(setup)
        for option, value in (("tp", setup.tp), ("pp", setup.pp), ("ep", setup.ep)):
            if value > 1:
                raise ConfigError(option, f"--{option} {value} with --engine fsdp1 is not "
                                          f"modelled: FSDP1 is modelled with data parallelism "
                                          f"alone (use --engine fsdp2)")
        if setup.lora_rank:
            self._check_lora(setup)

    def label(self, setup: TrainingSetup) -> str:
        strategy = "FULL_SHARD" if setup.zero == 3 else "SHARD_GRAD_OP"
        return f"fsdp1 ({strategy})"

    def mixed_precision(self, setup: TrainingSetup) -> str:
        return (f"mixed (MixedPrecision: {setup.autocast_dtype} parameters, fp32 flat "
                f"parameters and reduction)")

    def assumptions(self, setup: TrainingSetup) -> str:
        peft = ", PEFT's wrap policy (a unit per lora_A and lora_B)" if setup.lora_rank else ""
        return ("; FSDP1 units per block and the root" + peft + ", use_orig_params, "
                "BACKWARD_PRE prefetch")

    def replicated(self, setup: TrainingSetup) -> bool:
        return False

    def rank_states(self, cfg: GPTConfig, setup: TrainingSetup, rank: int) -> RankStates:
        self._check_blocks(cfg)
        return fsdp1_rank_states(cfg, setup, rank)

    def resident(self, cfg: GPTConfig, setup: TrainingSetup, rank: int) -> dict[str, int]:
        return fsdp1_resident(cfg, setup, rank)

    def finetune_states(self, cfg: GPTConfig, setup: TrainingSetup) -> dict[str, int]:
        self._check_blocks(cfg)
        return fsdp1_lora_states(cfg, setup, first_rank(setup, "first"))

    def finetune_resident(self, cfg: GPTConfig, setup: TrainingSetup) -> dict[str, int]:
        """The adapters' sharded flat gradients stay until the next forward, as in full
        training (`fsdp1_resident`)."""
        lines = self.finetune_states(cfg, setup)
        return {"weights (sharded)": lines["base/weights"] + lines["adapter/weights"],
                "optimizer states": lines["adapter/optimizer"],
                "gradients (sharded, freed at the next forward)": lines["adapter/gradients"]}

    def master_gradient_bytes(self, setup: TrainingSetup, params: int) -> int:
        """The fp32 flat parameters are the master weights, their gradients the sharded
        ones."""
        return 0

    def largest_optimizer_tensor(self, cfg: GPTConfig, setup: TrainingSetup,
                                 params: int) -> int:
        """The largest original parameter's view in a rank's shard (LoRA: an adapter's)."""
        if setup.lora_rank:
            return max(max(u.owned(setup.dp, r)) for u, _, _ in fsdp1_adapter_units(cfg, setup)
                       for r in range(setup.dp))
        return max(max(u.owned(setup.dp, r), default=0)
                   for u in fsdp1_units(cfg, setup).values() for r in range(setup.dp))

    def optimizer_step_pairs(self, cfg: GPTConfig, setup: TrainingSetup, stage: Stage
                             ) -> set[tuple[int, int]]:
        """LoRA: the adapters' views in the first rank's shards, lora_A then lora_B of each
        adapter (`states.step_order_pairs`' order); full training: the default."""
        if not setup.lora_rank:
            return super().optimizer_step_pairs(cfg, setup, stage)
        from ..states import consecutive_pairs

        units = fsdp1_adapter_units(cfg, setup)
        sizes = [u.owned(setup.dp, 0)[0] for u, _, _ in units]
        return consecutive_pairs(sizes * (2 if any(c > 1 for _, c, _ in units) else 1))

    def head_gradient_sharded(self, setup: TrainingSetup) -> bool:
        """The root's gradient stays unsharded until its post-backward reduce-scatter."""
        return False

    def adjust(self, ledger: Ledger, step: Step) -> None:
        (fsdp1_lora_adjust if step.setup.lora_rank else fsdp1_adjust)(ledger, step)

    @staticmethod
    def _check_lora(setup: TrainingSetup) -> None:
        """LoRA is modelled as PEFT wraps it (`fsdp1_lora_states`): the adapters' units beside
        frozen ones over a 16-bit or fp32 base, with an adapter in the blocks."""
        if setup.base_dtype == "nf4":
            raise ConfigError("weights_dtype", "--weights-dtype nf4 with --engine fsdp1 is not "
                                               "modelled (QLoRA's quantised base in FSDP1's "
                                               "flat parameters): use --engine fsdp2")
        if setup.dora:
            raise ConfigError("dora", "--dora with --engine fsdp1 is not modelled: use "
                                      "--engine fsdp2")
        if set(setup.lora_targets) <= {"lm_head"}:
            raise ConfigError("lora_targets", "--lora-targets lm_head alone with --engine "
                                              "fsdp1 is not modelled (no block runs a "
                                              "backward): adapt a block Linear too")

    @staticmethod
    def _check_blocks(cfg: GPTConfig) -> None:
        if cfg.moe:
            raise ConfigError("engine", "--engine fsdp1 is modelled for dense models (every "
                                        "block one alike unit); use --engine fsdp2")


register(FSDP1())

__all__ = ["ALIGNMENT_BYTES", "FSDP1", "FlatUnit", "NO_SYNC_GRADIENTS", "aligned_numel",
           "compute_bytes", "flat_unit", "fsdp1_accumulation", "fsdp1_adjust",
           "fsdp1_no_sync_adjust", "fsdp1_no_sync_bytes", "fsdp1_rank_states", "fsdp1_resident",
           "fsdp1_root_end_terms",
           "fsdp1_units", "fsdp1_unsharded", "reduce_bytes", "sharded_bytes"]
