"""torchao float8 training (`TrainingSetup.float8`): what the blocks' Float8Linear layers save for
backward, eager and compiled.

torchao 0.18 (torchao/float8/float8_linear.py, `matmul_with_hp_or_float8_args.forward`) saves
`input_hp, weight_hp_t`, the Linear's high-precision input and weight, and casts them to float8
again in backward: in eager mode a float8 block saves exactly what a 16-bit block saves. The
casts' absolute maxima are `aten.max` (tensorwise scaling; rowwise takes `aten.amax` over a
dimension), which torchtitan's op-level checkpointing keeps (its save list names
`aten.max.default`): two per Linear (input and weight), one element each in the activations'
dtype. The float8 matmul runs as `aten.mm` on torchao's float8 tensor subclass before it
becomes `_scaled_mm`, so the op-level policy counts and keeps the same matmul outputs.

Compiled (min-cut partitioner, `compiled`): the backward's operands are float8 casts, not the
16-bit Linear inputs, so those inputs are no longer "materialized in backward" and are
recomputed from what the block saves anyway: RMSNorm's outputs (the q/k/v and gate/up inputs)
and the down projection's input (act(gate) * up). The output projection's input is the
attention output, saved for SDPA's backward; its float8 cast (1 byte per element) is saved
beside it. Tensorwise scaling saves each Linear's input maximum (activations' dtype) and
inverse scale (fp32), and one more inverse scale; rowwise, the attention output's per-column
maximum (Dq in the activations' dtype). Under op-level checkpointing the compiled block saves
the maxima the policy keeps and the partitioner's scales instead (`FLOAT8_OP_SCALE_BYTES`).

Scope (measured against torchao's Float8Linear on the reference model, CPU `_scaled_mm`,
tests/test_float8.py): the blocks of the Llama family (RMSNorm, gated MLP, no biases),
modes bf16 and mixed; the output head stays 16-bit (torchtitan's filter). FSDP2's float8
all-gather of the weights is not modelled.
"""

from __future__ import annotations

from ..config import GATED_MLPS, GPTConfig
from ..errors import ConfigError
from ..recompute import block_linears
from ..training_setup import TrainingSetup
from ..workload import Workload


def check_float8(cfg: GPTConfig, setup: TrainingSetup) -> None:
    """ConfigError("float8") for a set-up whose float8 blocks are not modelled."""
    if setup.float8 == "none":
        return
    why = None
    if setup.mode not in ("bf16", "mixed"):
        why = "--mode bf16 or mixed (16-bit Linear inputs cast to float8)"
    elif setup.impl != "reference":
        why = "--impl reference"
    elif setup.recompute == "selective":
        why = "--recompute none, op or full"
    elif setup.lora_rank:
        why = "full training (no --lora-rank)"
    elif cfg.norm != "rmsnorm" or cfg.mlp not in GATED_MLPS or cfg.n_expert or cfg.mla \
            or any(lin.bias for lin in block_linears(cfg)):
        why = "the Llama family's blocks (RMSNorm, a gated MLP, Linears without biases)"
    if why:
        raise ConfigError("float8", f"--float8 {setup.float8} is modelled for {why}")


# bytes of the scales a compiled float8 block saves under op-level checkpointing, per block
# (measured, torch 2.13 CPU, torchao 0.18: tensorwise keeps ten maxima in the activations'
# dtype and six fp32 inverse scales; rowwise two fp32 scales per token row, 2 x N x 4)
FLOAT8_OP_SCALE_BYTES = {"tensorwise": lambda N, a: 10 * a + 6 * 4,
                         "rowwise": lambda N, a: 8 * N}


def float8_lines(cfg: GPTConfig, workload: Workload, setup: TrainingSetup,
                 lines: dict[str, int]) -> dict[str, int]:
    """The saved lines (one micro-batch, unsharded, after `compiled`) with float8 Linears."""
    if setup.float8 == "none":
        return lines
    check_float8(cfg, setup)
    L, N, a = cfg.n_layer, workload.tokens, setup.act_bytes
    n_lin = len(block_linears(cfg))
    out = dict(lines)
    if setup.compile == "none":
        if setup.recompute == "op" and setup.float8 == "tensorwise":
            out["layer/op/float8_amax"] = L * 2 * n_lin * a  # aten.max of input and weight
        return out
    if setup.recompute == "full":
        return out
    if setup.recompute == "op":
        out["layer/float8/scales"] = L * FLOAT8_OP_SCALE_BYTES[setup.float8](N, a)
        return out
    out.pop("layer/attn/qkv_input", None)
    out.pop("layer/mlp/fc_input", None)
    out["layer/mlp/hidden"] = L * 2 * N * cfg.ffn_dim * a  # gate and up; down's input recomputed
    out["layer/float8/out_proj_input"] = L * N * cfg.attn_out_width  # 1 byte per element
    scales = n_lin * (a + 4) + 4 if setup.float8 == "tensorwise" else cfg.attn_out_width * a
    out["layer/float8/scales"] = L * scales
    return out


__all__ = ["FLOAT8_OP_SCALE_BYTES", "check_float8", "float8_lines"]
