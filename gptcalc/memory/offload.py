"""Activation offloading (`TrainingSetup.offload_activations`): which saved activations torchtune's
OffloadActivations moves to host memory and which stay on the device.

torchtune (torchtune/training/_activation_offloading.py, `OffloadActivations`, a
`saved_tensors_hooks` around the model's forward; `get_act_offloading_ctx_manager`):

- `pack_tensor` copies a saved tensor to pinned host memory when it is on the accelerator, is
  not a Parameter or Buffer, and holds at least `min_offload_size` bytes (element size x
  elements; default 1,024); smaller ones stay on the device;
- the output head runs under a `NoOpManager` (its saved input, and under autocast its weight's
  16-bit copy, stay on the device), and the loss is computed after the model has returned, outside the context: its saved tensors stay;
- with streams (the default) the last `max_fwd_stash_size` (5) offloaded tensors are kept on
  the device until the copy of a later one starts (`fwd_stash`): they are alive at the
  forward's end; in backward each tensor comes back when its autograd node unpacks it and is
  freed after the node has run.

Scope: dense blocks; a line of the saved-tensor profile (one block's share of a `layer/` line
over the equal tensors it holds, a block's autocast weight copies as its component's largest
matrix, or a line outside the blocks) is taken as its tensors' size at the threshold.
torchtune copies a tensor
each time an op saves it, so a storage two ops save (RMSNorm's input, saved by pow and by
mul) goes to the host twice: the host lines count each storage once, what the host needs at
least. CUDA only: torchtune refuses to offload without an accelerator.
"""

from __future__ import annotations

from ..config import GATED_MLPS, GPTConfig
from ..errors import ConfigError
from ..inventory import inventory
from ..training_setup import TrainingSetup
from .compiled import COMPILED_HIDDEN
from .profile_reference_modern import HIDDEN_SAVED

# torchtune's OffloadActivations(min_offload_size=1024): smaller tensors stay on the device
MIN_OFFLOAD_BYTES = 1024
# torchtune's OffloadActivations(max_fwd_stash_size=5): offloaded tensors kept on the device
# while their copy to the host may still run
FORWARD_STASH = 5
# saved outside the offloading context: the output head's input (NoOpManager) and the loss's
# tensors and the targets it reads (computed after the model returns; Liger's fused loss holds
# the head's gradients); autocast's copy of the lm_head's weight, saved inside the head
_STAY = ("final/lm_head_input", "final/head_input_gradient", "cross_entropy/", "input/targets",
         "weight_copy/lm_head")


def check_offload(setup: TrainingSetup) -> None:
    """ConfigError("offload_activations") where torchtune does not offload."""
    if setup.offload_activations and setup.device != "cuda":
        raise ConfigError("offload_activations", "torchtune offloads activations from an "
                                                 "accelerator to the host: --device cuda")


def _tensors_per_block(cfg: GPTConfig, setup: TrainingSetup, key: str) -> int:
    """Equal tensors one block saves under a line: q, k and v (grouped-query k and v repeated
    to the query heads inside the core; the core's inputs selective recomputation keeps);
    under amp the projections' input, cast by autocast once per matmul that reads it
    (`profile_reference._qk_sources`: 3 separate projections, 3 H per-head ones, MLA's 2;
    a gated MLP's gate and up projections, 2); the
    MLP's hidden tensors (`HIDDEN_SAVED`, compiled
    `COMPILED_HIDDEN`); else one."""
    if key in ("layer/attn/qkv", "layer/attn/core_inputs"):
        return 3
    if key == "layer/attn/qkv_input" and setup.mode == "amp":  # autocast casts it per matmul
        if cfg.mla:
            return 2
        return {"fused": 1, "separate": 3, "per_head": 3 * cfg.n_head}[cfg.qkv_layout]
    if key == "layer/mlp/fc_input" and setup.mode == "amp" and cfg.mlp in GATED_MLPS:
        return 2  # the gate's and the up projection's casts
    if key == "layer/mlp/hidden":
        return (COMPILED_HIDDEN if setup.compile != "none" else HIDDEN_SAVED)[cfg.mlp]
    return 1


def _weight_copy_bytes(cfg: GPTConfig, setup: TrainingSetup, component: str) -> int:
    """autocast's 16-bit copy of the largest weight matrix of a block's `component` on one
    tensor-parallel rank (`states.autocast_weight_copies`: one copy per matrix)."""
    return max((2 * t.shard(setup.tp) for t in inventory(cfg)
                if t.role == "matrix" and t.place == "block" and t.component == component),
               default=0)


def line_tensor_bytes(cfg: GPTConfig, setup: TrainingSetup, key: str, nbytes: int,
                      held_layers: int | None = None) -> int:
    """The size of one tensor of a saved line on one device: a `layer/` line's share of one
    block (the line sums `held_layers` block-micro-batches, `schedules.stage_hold`; default
    the L blocks of one micro-batch) over the tensors it holds there (`_tensors_per_block`);
    a block's `weight_copy/` line (one copy per weight matrix of every block) its component's
    largest copy (`_weight_copy_bytes`); else the line."""
    if key.startswith("weight_copy/") and key != "weight_copy/lm_head":
        return _weight_copy_bytes(cfg, setup, key.split("/", 1)[1])
    if key.startswith("layer/"):
        blocks = max(1, cfg.n_layer if held_layers is None else held_layers)
        return nbytes // blocks // _tensors_per_block(cfg, setup, key)
    return nbytes


def offload_split(cfg: GPTConfig, setup: TrainingSetup, acts: dict[str, int],
                  held_layers: int | None = None) -> tuple[dict[str, int], dict[str, int]]:
    """`acts` (a device's saved lines) split into the lines the device keeps and those on the
    host. Offloaded: a line outside the head and the loss (`_STAY`) whose tensor
    (`line_tensor_bytes`) holds at least `MIN_OFFLOAD_BYTES`, and that autograd saves: the
    op outputs eager op-level checkpointing keeps (`layer/op/`) live in its selective-
    checkpoint cache, which no saved-tensor hook sees, so they stay (a checkpoint's inputs are
    saved through autograd, `_NoopSaveInputs`, and go; compiled, the kept outputs are the
    graph's saved tensors and go too). Unchanged when offloading is off (every line stays)."""
    if not setup.offload_activations:
        return dict(acts), {}
    stay = _STAY + (("layer/op/",) if setup.compile == "none" else ())
    device, host = {}, {}
    for key, nbytes in acts.items():
        size = line_tensor_bytes(cfg, setup, key, nbytes, held_layers)
        if nbytes and not key.startswith(stay) and size >= MIN_OFFLOAD_BYTES:
            host[key] = nbytes
        else:
            device[key] = nbytes
    return device, host


def forward_stash_bytes(cfg: GPTConfig, setup: TrainingSetup, host: dict[str, int],
                        held_layers: int | None = None) -> int:
    """An upper bound of the offloaded tensors still on the device at the forward's end (the
    last `FORWARD_STASH` offloaded): that many of the largest offloaded tensor."""
    sizes = [line_tensor_bytes(cfg, setup, k, v, held_layers) for k, v in host.items()]
    return FORWARD_STASH * max(sizes, default=0)


def brought_back_bytes(cfg: GPTConfig, setup: TrainingSetup, host: dict[str, int],
                       held_layers: int | None = None) -> int:
    """What one block's backward has brought back from the host, at most: its share of every
    offloaded `layer/` line."""
    return sum(line_tensor_bytes(cfg, setup, k, v, held_layers) for k, v in host.items()
               if k.startswith("layer/"))


__all__ = ["FORWARD_STASH", "MIN_OFFLOAD_BYTES", "brought_back_bytes", "check_offload",
           "forward_stash_bytes", "line_tensor_bytes", "offload_split"]
