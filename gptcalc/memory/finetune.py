"""Fine-tuning with LoRA or QLoRA: a frozen base, trainable rank-r adapters.

LoRA (Hu et al. 2021) as PEFT adds it: a target Linear(in, out) keeps its weight frozen and gains
lora_A = Linear(in, r) and lora_B = Linear(r, out) without bias (`gptcalc.lora`); every other
parameter is frozen. QLoRA (Dettmers et al. 2023) stores the frozen block Linears in NF4
(`gptcalc.lora.qlora_base_bytes`). DoRA (Liu et al. 2024, PEFT's use_dora) adds a trained
magnitude vector per adapted Linear (`dora_magnitude_params`) and what its forward saves
(`dora_saved`).

States: the frozen base in its dtype (the mode's; NF4 with `base_dtype="nf4"`), the adapters in
the mode's weight dtype (fp32 under fp32 and amp: PEFT keeps adapters in fp32), and gradients and
optimizer states for the adapters only.

Saved activations: autograd keeps only what the gradients that are needed use. With a frozen
weight a Linear keeps its weight, not its input, so (measured on the reference model with
PEFT-shaped adapters, CPU, fp32 and bf16; tests/test_memory_finetune.py):
- a projection's input stays saved only where an adapter reads it (lora_A saves it); the MLP's
  down projection input (the activation's output) only when `down` is adapted; the lm_head's
  input never;
- RMSNorm's normalised x * rsqrt (kept for the frozen weight's gradient) is not saved;
  LayerNorm still saves its input and statistics;
- the embeddings' index tensors are not saved;
- an adapted lm_head keeps its input (lora_A saves it); adapted alone, nothing before it needs
  a gradient and only the head and the loss save tensors;
- each adapter adds lora_B's input, N x r in the activation dtype (one per fused Linear);
  a parameter PEFT adapts itself (ParamWrapper: an MoE router's weight, fused experts) instead
  the adapted weight W + B A, which its matmul saves (measured on transformers' Mixtral and
  Qwen3-MoE wrapped by PEFT 0.21, tests/test_lora_peak.py); under full recomputation a
  block's adapters save nothing (the checkpointed block keeps only its input), the head's
  still does;
- before the first adapter of the first block nothing requires a gradient (the embeddings are
  frozen), so the first block saves nothing ahead of it (`_first_block_unsaved`); in a
  parallel block (GPT-NeoX, GPT-J, Phi) the MLP reads the block's input, so the first block's
  MLP saves nothing ahead of the MLP's own first adapter (measured on transformers' GPT-NeoX
  wrapped by PEFT, tests/test_lora_peak.py, and on the reference model);
- a shared parallel norm's output is the input of q, k, v and of the MLP alike: lora_A of an
  adapted up (gate) projection keeps it too;
- with LoRA dropout, and under autocast (mode amp), lora_A keeps a copy of its input of each
  adapter's own instead of the Linear's input, and the dropout's mask and autocast's weight
  copies beside it (`adapter_copies`);
- Liger's kernels (--liger; transformers' Llama with their stand-ins, PEFT-wrapped,
  tests/test_liger_lora.py) save what they save in full training wherever their input needs a
  gradient, the profile's Liger lines; LigerSiLUMul keeps both the gate and up outputs, so
  the first block's MLP adapted at gate or up alone leaves neither unsaved.
"""

from __future__ import annotations

from ..config import GATED_MLPS, GPTConfig
from ..training_setup import TrainingSetup, liger_kernels, matmul4bit_keeps_input
from ..workload import Workload
from ..layers import moe_layers
from ..linears import block_linears
from ..lora import covered, lora_params, qlora_base_bytes, selected

ATTN_INPUT_TARGETS = ("q", "k", "v", "qkv", "q_a", "kv_a")
UP_TARGETS = ("up", "gate")
ATTENTION_TARGETS = frozenset(ATTN_INPUT_TARGETS + ("o", "q_b", "kv_b"))


# transformers families beyond the classic blocks whose PEFT-wrapped training is measured:
# routed experts adapted through parameter targeting (router and fused experts), q/k norms,
# BLOOM's ALiBi and embedding norm (tests/test_bloom_transformers.py)
LORA_TRANSFORMERS_FAMILIES = ("mixtral", "qwen3_moe", "qwen3", "bloom")


def lora_on_transformers(cfg: GPTConfig, setup: TrainingSetup) -> bool:
    """Whether LoRA on `cfg` is modelled under the transformers profile beyond the classic
    GPT-2 / Llama blocks: the families of LORA_TRANSFORMERS_FAMILIES."""
    from ..errors import ConfigError
    from .profile_transformers import transformers_family

    if setup.impl != "transformers":
        return False
    try:
        return transformers_family(cfg) in LORA_TRANSFORMERS_FAMILIES
    except ConfigError:
        return False


def kbit_prepared(setup: TrainingSetup) -> bool:
    """Whether peft's `prepare_model_for_kbit_training` (peft 0.21.2, peft/utils/other.py) ran
    on the NF4 model and its casts stand: it freezes every parameter, casts every fp16/bf16
    parameter that is not a bitsandbytes Params4bit to fp32 (embeddings, norms, output head,
    biases), and with its default use_gradient_checkpointing=True calls
    `enable_input_require_grads` and `gradient_checkpointing_enable` (`TrainingSetup.
    kbit_prepare`, checked to come with --recompute full).

    What follows from the fp32 parameters, measured on transformers' Llama with bitsandbytes'
    Linear4bit quantised on CPU and PEFT's adapters, bf16 autocast, checkpointed blocks
    (tests/test_kbit_prepare.py): the residual stream is fp32 (the embeddings' output; a
    Linear4bit returns its input's dtype), so each block's checkpointed input and the rotary
    cos/sin are fp32 (the profile's lines under mode amp, `activations.saved_activations`); the
    fp32 head under autocast matmuls a 16-bit copy of its weight, which autograd keeps for the
    gradient of its input (`states.autocast_weight_copies`: only the head's, the blocks being
    checkpointed); the logits stay 16-bit (autocast's matmul), the loss upcasts them as before.

    Who leaves the casts standing (read from their sources):
    - PEFT's QLoRA guide and scripts that call the function themselves: yes.
    - axolotl (axolotl-ai-cloud/axolotl 067b021c, src/axolotl/loaders/model.py,
      `_configure_embedding_dtypes`): calls it for adapter lora/qlora with load_in_4bit/8bit
      unless skipped (Qwen with lora, LoftQ, QLoRA under FSDP, FSDP with cpu_ram_efficient_
      loading, ZeRO-3), then, QLoRA without FSDP, casts every module named "norm" and the
      embed_tokens / lm_head modules back to torch_dtype for flash attention: the parameters
      end 16-bit (biases of 4-bit Linears stay fp32); `embeddings_skip_upcast` patches the
      function to leave embed_tokens and lm_head alone.
    - TRL (huggingface/trl): SFTTrainer before 0.22 called it in `_prepare_peft_model`, 0.22
      to 0.26 its own copy without the fp32 cast (trl/models/utils.py, commit 65d7894b); both
      then, under bf16, `peft_module_casting_to_bf16`: norms to fp32, fp32 embeddings and head
      to bf16. SFTTrainer from 0.27 (commit 20cc2e1d, the functions moved to trl.experimental)
      calls neither: the loaded dtypes stand.
    - LLaMA-Factory (hiyouga/LLaMA-Factory ff6d4d12) does not call it: its own
      `prepare_model_for_training` (model_utils/checkpointing.py) upcasts the norms only with
      upcast_layernorm and the head's output only with upcast_lmhead_output (both off by
      default).
    So the recipe readers leave it off."""
    return setup.kbit_prepare and setup.base_dtype == "nf4"


def check_kbit_prepare(setup: TrainingSetup) -> None:
    """`kbit_prepared` is modelled where it is measured: a transformers model under autocast
    (mode amp), its blocks checkpointed (the function turns transformers' gradient
    checkpointing on), not sharded (TRL and axolotl skip it under FSDP and ZeRO-3)."""
    from ..errors import ConfigError

    if not setup.kbit_prepare:
        return
    if setup.base_dtype != "nf4":
        raise ConfigError("kbit_prepare", "prepare_model_for_kbit_training casts a 4-bit "
                                          "model: give --weights-dtype nf4 or nf4-dq")
    for ok, what in ((setup.impl == "transformers", "--impl transformers"),
                     (setup.mode == "amp", "--mode amp"),
                     (setup.recompute == "full", "--recompute full (it turns checkpointing on)"),
                     (engine_shards_nothing(setup),
                      "unsharded parameters (sharded QLoRA skips it)")):
        if not ok:
            raise ConfigError("kbit_prepare", f"--kbit-prepare is modelled with {what}")


def engine_shards_nothing(setup: TrainingSetup) -> bool:
    """Whether every rank holds every parameter whole: no FSDP, ZeRO below stage 3."""
    return setup.zero < 3 and setup.engine not in ("fsdp1", "fsdp2")


def adapter_tensors(cfg: GPTConfig, setup: TrainingSetup) -> int:
    """Adapter parameter tensors (lora_A and lora_B per adapted Linear, and DoRA's magnitude):
    AdamW's step counters."""
    return sum((3 if setup.dora else 2) * a.count for a in selected(cfg, setup.lora_targets))


def adapter_sizes(cfg: GPTConfig, setup: TrainingSetup) -> list[int]:
    """Elements of each distinct adapter tensor (lora_A r x in, lora_B out x r; DoRA's
    magnitude, out)."""
    return [n for a in selected(cfg, setup.lora_targets)
            for n in [setup.lora_rank * a.rank_mult * a.in_features,
                      setup.lora_rank * a.rank_mult * a.out_features]
            + ([a.out_features] if setup.dora else [])]


def dora_magnitude_params(cfg: GPTConfig, setup: TrainingSetup) -> int:
    """DoRA's trained magnitudes (Liu et al. 2024, eq. 5; PEFT's `lora_magnitude_vector`, peft/
    tuners/lora/dora.py `DoraLinearLayer.update_layer`): one vector of out_features per
    adapted Linear, the column norms of W + B A; none without DoRA."""
    if not setup.dora:
        return 0
    return sum(a.count * a.out_features for a in selected(cfg, setup.lora_targets))


def dora_saved(cfg: GPTConfig, workload: Workload, setup: TrainingSetup) -> dict[str, int]:
    """What DoRA's forward (PEFT 0.21, peft/tuners/lora/dora.py `DoraLinearLayer.forward`, in
    training: dropout 0, no cache) saves per adapted Linear beyond LoRA's lines, by key
    `lora/<name>/dora`: `mag_norm_scale = magnitude / weight_norm` saves the detached norm
    (out, the weight's dtype) and its output is saved by `mag_norm_scale * lora_result`, with
    `lora_result` (N out); `(mag_norm_scale - 1) * base_result` saves the base Linear's output
    (N out) and, where that output needs a gradient, `mag_norm_scale - 1` (out). In the first
    block an adapted Linear's input needs no gradient unless an adapter sits ahead of it in the
    block (the embeddings and the norms are frozen): q, k, v never; o after q, k or v; the MLP
    after an attention adapter (in a parallel block only after the MLP's own); down after up
    or gate too; the head after any block adapter. The norm's graph (W + s B A, and B A made
    from an identity matrix through lora_A and lora_B) is freed before the forward returns.
    Sizes in the activation dtype; measured on transformers' Llama and Phi-3 wrapped by PEFT
    with use_dora, fp32 (tests/test_lora_peak.py)."""
    if not setup.dora:
        return {}
    N, a, w = workload.tokens, setup.act_bytes, setup.weight_bytes
    out: dict[str, int] = {}
    for ad in selected(cfg, setup.lora_targets):
        o = ad.out_features
        out[f"lora/{ad.name}/dora"] = (ad.count * (2 * N * o * a + o * w + o * 4)
                                       + input_grad_instances(cfg, setup, ad) * o * 4)
    return out


def embeddings_require_grad(setup: TrainingSetup) -> bool:
    """Whether the frozen embeddings' output requires a gradient all the same: PEFT 0.21 on a
    transformers model with checkpointed blocks (peft_model.py,
    `prepare_model_for_gradient_checkpointing` -> `enable_input_require_grads`), so that the
    checkpointed blocks' recomputation reaches the adapters; everything ahead of the first
    adapter then saves what full training saves (measured on transformers' BLOOM and Llama,
    tests/test_bloom_transformers.py)."""
    return setup.recompute == "full" and setup.impl == "transformers"


def input_grad_instances(cfg: GPTConfig, setup: TrainingSetup, adapter) -> int:
    """How many of an adapted Linear's instances read an input that needs a gradient: all but
    the first block's, unless an adapter sits ahead of it in that block (the embeddings and
    the norms are frozen): q, k, v never; o after q, k or v; the MLP after an attention
    adapter (in a parallel block only after the MLP's own); down after up or gate too; the
    head after any block adapter; every one where the embeddings' output needs a gradient
    (`embeddings_require_grad`)."""
    if embeddings_require_grad(setup):
        return adapter.count
    covered_all = covered(cfg, setup.lora_targets)
    attention = covered_all & set(ATTN_INPUT_TARGETS)
    ahead = {"o": bool(attention),
             "up": False if cfg.parallel_residual else bool(covered_all & ATTENTION_TARGETS),
             "lm_head": bool(covered_all - {"lm_head"})}
    ahead["gate"] = ahead["up"]
    ahead["down"] = ahead["up"] or bool(covered_all & set(UP_TARGETS))
    first = all(ahead.get(c, False) for c in adapter.covers)  # the first block's Linears
    # the head is one Linear; a block Linear has count / L instances in each block (the
    # tutorial's per-head q, k and v: H)
    per_block = 1 if adapter.name == "lm_head" else adapter.count // cfg.n_layer
    return adapter.count - (0 if first else per_block)


def own_input_copies(setup: TrainingSetup, amp: bool = False) -> bool:
    """Whether each adapter's lora_A keeps a copy of its input of its own rather than the
    input the Linear reads: with LoRA dropout (each adapter's own nn.Dropout makes a new
    tensor), and under autocast (mode amp: PEFT casts the input to the fp32 adapters' dtype,
    autocast casts it back to 16 bits for lora_A's matmul, a new tensor per adapter)."""
    return bool(setup.lora_dropout) or amp or setup.mode == "amp"


def adapter_copies(cfg: GPTConfig, workload: Workload, setup: TrainingSetup,
                   amp: bool = False) -> dict[str, int]:
    """What each adapter keeps of its own beside lora_B's input, where it does not share the
    Linear's input (`own_input_copies`), by key `lora/<name>/...`; PEFT 0.21's
    `lora.Linear.forward` (peft/tuners/lora/layer.py): `x = self._cast_input_dtype(x,
    lora_A.weight.dtype)`, then `lora_B(lora_A(dropout(x))) * scaling`, with `nn.Dropout(p)`
    per adapter when lora_dropout > 0, else `nn.Identity()` (torchtune's LoRALinear drops
    likewise, without the cast). Per adapted Linear (N tokens, its in and out widths, rank r):

    - lora_A_input: the tensor lora_A's matmul saves, N x in, in the activation dtype (16 bits
      under amp: autocast's cast of the fp32 input);
    - dropout_mask (lora_dropout > 0), where the input needs a gradient
      (`input_grad_instances`): N x in, 1 byte on CUDA (native_dropout's bool mask); on CPU
      `F.dropout` saves its scaled noise in the input's dtype (fp32 under amp, the adapters'
      dtype);
    - weight_copies (amp): autocast's 16-bit copies of the fp32 adapters, lora_B's (out x r)
      always, lora_A's (r x in) where the input needs a gradient.

    Adapters of a checkpointed block (recompute full) keep nothing; the head's do. Parameters
    PEFT adapts itself (ParamWrapper) take no dropout and keep their lines. Measured on
    transformers' Llama and Phi-3 wrapped by PEFT, modes fp32, amp and bf16, p 0, 0.05 and 0.1
    (tests/test_lora_dropout.py)."""
    if not own_input_copies(setup, amp):
        return {}
    N, amp = workload.tokens, amp or setup.mode == "amp"
    copy = 2 if amp else setup.act_bytes
    mask = 1 if setup.device == "cuda" else (4 if amp else setup.act_bytes)
    out: dict[str, int] = {}
    for ad in selected(cfg, setup.lora_targets):
        if ad.param_target or (setup.recompute == "full" and ad.name != "lm_head"):
            continue
        r, grad = setup.lora_rank * ad.rank_mult, input_grad_instances(cfg, setup, ad)
        out[f"lora/{ad.name}/lora_A_input"] = ad.count * N * ad.in_features * copy
        if setup.lora_dropout:
            out[f"lora/{ad.name}/dropout_mask"] = grad * N * ad.in_features * mask
        if amp:
            out[f"lora/{ad.name}/weight_copies"] = 2 * r * (ad.count * ad.out_features
                                                             + grad * ad.in_features)
    return out


def finetune_state_bytes(cfg: GPTConfig, setup: TrainingSetup) -> dict[str, int]:
    """Weights, gradients and optimizer bytes of LoRA fine-tuning on one device, by line.

    base/weights: the frozen parameters in the mode's weight dtype, or (base_dtype nf4) the
    block Linears in NF4 with their quantisation constants per tensor (`lora.qlora_base_bytes`,
    double-quantised or not) and the rest 16-bit (fp32 once prepared for k-bit training,
    `kbit_prepared`). adapter/...:
    r (in + out) per adapted Linear in the mode's weight dtype; gradients likewise; the
    optimizer's states of each adapter matrix, lora_A (r, in) and lora_B (out, r)
    (`states.tensor_optimizer_bytes`: AdamW's two moments per adapter parameter; Adafactor
    factors each matrix; 8-bit AdamW keeps 32-bit states for matrices under 4096 elements),
    and its 0-d tensors per adapter tensor (AdamW's step, Adafactor's RMS). ZeRO stages 1-3
    shard the adapters' optimizer states (one flat partition to the optimizer), gradients and
    weights across dp; stage 3 also the base.
    """
    from ..params import count_params
    from .states import (optimizer_of, flat_optimizer_bytes, optimizer_fixed_bytes,
                         step_counter_bytes, tensor_optimizer_bytes)

    n_lora = (sum(lora_params(cfg, setup.lora_rank, setup.lora_targets).values())
              + dora_magnitude_params(cfg, setup))
    n_total = count_params(cfg).total
    d, z = setup.dp, setup.zero

    def shard(n: int, stage: int) -> int:
        return -(-n // d) if z >= stage else n
    w = setup.weight_bytes
    if setup.base_dtype == "nf4":
        n_matrix = sum(m.weights for m in block_linears(cfg))
        rest = 4 if kbit_prepared(setup) else 2  # the parameters left out of NF4
        base = sum(qlora_base_bytes(cfg, setup.double_quant).values()) + rest * (
            n_total - n_matrix)
    else:
        base = (2 if setup.mode == "amp" else w) * n_total  # amp: a 16-bit frozen base
    steps = step_counter_bytes(setup) * adapter_tensors(cfg, setup)
    if optimizer_of(setup).shaped and z == 0:  # each adapter matrix whole
        opt = sum(a.count * (tensor_optimizer_bytes(setup, (r, a.in_features))
                             + tensor_optimizer_bytes(setup, (a.out_features, r)))
                  for a in selected(cfg, setup.lora_targets)
                  for r in [setup.lora_rank * a.rank_mult])
        opt += sum(a.count * tensor_optimizer_bytes(setup, (a.out_features,))
                   for a in selected(cfg, setup.lora_targets) if setup.dora)
        opt += optimizer_fixed_bytes(setup, adapter_sizes(cfg, setup))
    else:  # ZeRO 1-3: one flat partition, as DeepSpeed gives it to the optimizer
        opt = flat_optimizer_bytes(setup, [shard(n_lora, 1)])
    return {
        "base/weights": shard(base, 3),
        "adapter/weights": w * shard(n_lora, 3),
        "adapter/gradients": w * shard(n_lora, 2),
        "adapter/optimizer": opt + steps,
    }


def finetune_saved(cfg: GPTConfig, workload: Workload, setup: TrainingSetup,
                   lines: dict[str, int], amp: bool = False) -> dict[str, int]:
    """A profile's saved-tensor lines (full fine-tuning) as LoRA fine-tuning saves them;
    `amp`: the 16-bit base runs under autocast over fp32 adapters (`setup` is then the
    profile's, mode mixed)."""
    targets = covered(cfg, setup.lora_targets)  # gptcalc.linears' names
    # the Linears whose input lora_A keeps as it is (else a copy of its own, `adapter_copies`)
    reads = targets - ({c for a in selected(cfg, setup.lora_targets) if not a.param_target
                        for c in a.covers} if own_input_copies(setup, amp) else set())
    out = dict(lines)
    # the head alone: nothing ahead of it needs a gradient (unless `embeddings_require_grad`)
    if not targets - {"lm_head"} and not embeddings_require_grad(setup):
        out = {k: v for k, v in out.items()
               if not k.startswith(("layer/", "embedding/", "final/ln_f/"))}
    drop = ["input/idx", "embedding/positions"] + ["final/lm_head_input"] * (
        "lm_head" not in reads)  # lora_A of the head saves the head's input
    # the attention's input; with one norm ahead of both branches (a shared parallel norm)
    # also the MLP's, which lora_A of an adapted up (gate) projection keeps
    readers = set(ATTN_INPUT_TARGETS) | (set(UP_TARGETS) if cfg.shared_norm else set())
    if not reads & readers:
        drop.append("layer/attn/qkv_input")
    if "o" not in reads and (setup.attn_impl == "manual" or setup.impl == "transformers"):
        # o_proj's own input (transformers: its contiguous copy, where there is one); the
        # reference profile's SDPA line is the kernel's output, which the kernel keeps itself
        drop.append("layer/attn/out_input")
    if cfg.norm == "rmsnorm":
        drop += [k for k in out if k.endswith("/normalized")]
    for k in drop:
        out.pop(k, None)
    N = workload.batch_size * workload.seq_len
    for k in ("embedding/dropout_mask",):  # the frozen embeddings' output needs no gradient
        out.pop(k, None)
    if not embeddings_require_grad(setup):  # nor BLOOM's frozen embedding LayerNorm's: it
        for k in [k for k in out if k.startswith("embedding/ln_emb/")]:  # saves nothing
            out.pop(k)
    L, n_moe, a = cfg.n_layer, moe_layers(cfg) if cfg.moe else 0, setup.act_bytes
    if "layer/mlp/fc_input" in out:  # the MLP's input: an MoE layer's router reads it too
        fc = out.pop("layer/mlp/fc_input") // L
        kept = (L - n_moe) * bool(reads & set(UP_TARGETS)) + n_moe * ("router" in reads)
        if kept:
            out["layer/mlp/fc_input"] = kept * fc
    if out.get("layer/mlp/hidden") and "down" not in reads and cfg.mlp != "relu":
        # the down projection's input, unless ReLU saves it as its own output
        out["layer/mlp/hidden"] -= (L - n_moe) * N * cfg.ffn_dim * a
    if n_moe:  # routed experts: grouped_mm keeps its input only for an adapted weight
        Nk = N * cfg.n_expert_active
        if not targets & {"experts.gate", "experts.up"}:
            out.pop("layer/moe/expert_input", None)
        if "experts.down" not in targets and out.get("layer/moe/hidden"):  # none when
            out["layer/moe/hidden"] -= n_moe * Nk * cfg.expert_dim * a  # checkpointed
    if setup.recompute != "full":  # a checkpointed first block keeps its input all the same
        for key, nbytes in _first_block_unsaved(cfg, setup, targets, out, N * cfg.ffn_dim
                                                * setup.act_bytes, reads).items():
            out[key] -= nbytes
    for a in selected(cfg, setup.lora_targets):  # one per adapter (a fused Linear's one)
        if setup.recompute == "full" and a.name != "lm_head":
            continue  # inside a checkpointed block: only the block's input is saved
        if a.param_target:  # PEFT's ParamWrapper: the adapted weight W + B A, saved by its matmul
            key = f"lora/{a.name}/adapted_weight"
            nbytes = a.count * a.matrices * a.in_features * a.out_features * setup.weight_bytes
        else:
            key = f"lora/{a.name}/lora_B_input"
            nbytes = a.count * N * a.rank_mult * setup.lora_rank * setup.act_bytes
        out[key] = out.get(key, 0) + nbytes
    if kbit_prepared(setup):  # autocast's 16-bit copy of the fp32 head (blocks checkpointed)
        from .states import autocast_weight_copies

        out.update(autocast_weight_copies(cfg, setup))
    out.update(adapter_copies(cfg, workload, setup, amp))
    out.update(dora_saved(cfg, workload, setup))
    if matmul4bit_keeps_input(setup):
        out.update(matmul4bit_inputs(cfg, workload, setup))
    return out


def matmul4bit_inputs(cfg: GPTConfig, workload: Workload, setup: TrainingSetup
                      ) -> dict[str, int]:
    """Bytes bitsandbytes before 0.43.2 keeps for backward beyond today's release, by block
    Linear kind: each 4-bit Linear whose input needs a gradient keeps that input, cast to the
    compute dtype, N x in x a (bitsandbytes/nn/modules.py, Linear4bit.forward:
    x = x.to(self.compute_dtype); autograd/_functions.py, MatMul4Bit.forward:
    ctx.tensors = (A, B) when any(ctx.needs_input_grad[:2]); the weight never needs one).
    Every block's Linears keep it but the first block's ahead of and beside its first adapted
    Linear, whose inputs need no gradient (the embeddings are frozen). One copy per Linear: the
    cast makes one whenever the block's activations are not already in the compute dtype
    (a 16-bit model whose norms run in fp32, as peft.prepare_model_for_kbit_training leaves
    them); where they are, the kept tensor is the one the adapters' lora_A shares."""
    N, a, L = workload.batch_size * workload.seq_len, setup.act_bytes, cfg.n_layer
    targets = covered(cfg, setup.lora_targets)
    sites = [t for t, _ in _SITES]
    first = next((i for i, t in enumerate(sites) if targets & set(t)), len(sites))
    out: dict[str, int] = {}
    for m in block_linears(cfg):
        site = next(i for i, t in enumerate(sites) if m.target in t)
        blocks = m.count - (m.count // L) * (site <= first)  # the first block's frozen head
        out[f"qlora/{m.target}/matmul4bit_input"] = blocks * N * m.in_features * a
    return out


def first_block_cache_unsaved(cfg: GPTConfig, workload: Workload, setup: TrainingSetup) -> int:
    """Bytes transformers' DynamicCache holds that no autograd node saves, beyond full
    training's: when no adapter reads the first block's attention input, its attention needs
    no gradient and saves nothing (`_first_block_unsaved`), but the cache still keeps that
    layer's key and value copies, 2 N Dkv a (less what full training already leaves unsaved).
    The reference model has no cache: 0."""
    if setup.impl != "transformers" or covered(cfg, setup.lora_targets) & set(
            ATTN_INPUT_TARGETS):
        return 0
    from .profile_transformers import first_layer_kv_cache

    copies, unsaved = first_layer_kv_cache(cfg, workload.batch_size, workload.seq_len, setup)
    return copies - unsaved


# the first block's Linears in forward order, each with the adapter targets that read it and
# the layer lines saved ahead of it
_SITES = (
    (ATTN_INPUT_TARGETS, ("layer/ln_1/",)),
    (("o",), ("layer/attn/",)),
    (UP_TARGETS, ("layer/ln_2/", "layer/attn/resid_dropout_mask")),
    (("down",), ("layer/mlp/hidden",)),
)


def _first_block_unsaved(cfg: GPTConfig, setup: TrainingSetup, targets: set[str],
                         lines: dict[str, int], hidden_tensor: int, reads: set[str]
                         ) -> dict[str, int]:
    """The first block's share of each layer line that it does not save: what it computes
    ahead of its first adapted Linear reads only frozen inputs and needs no gradient.

    Inputs that an adapter reads as they are (`reads`) stay (lora_A saves them). In a gated MLP whose first adapted
    Linear is gate or up, only the adapted branch needs a gradient: silu(gate) saves its input
    only when gate is adapted, and the product saves the other factor of each branch that needs
    one (up's output for gate, silu's output for up). Likewise a written-out attention whose
    first block adapts only some of q, k, v: q @ k^T keeps q only for k's gradient and k only
    for q's, and v and the mask are kept only when q or k needs a gradient.

    A parallel block (GPT-J, GPT-NeoX: x + attn(ln_1(x)) + mlp(ln_2(x))) has two chains, each
    reading the block's input: the MLP's lines of the first block go unsaved up to the MLP's
    own first adapter, whatever the attention adapts, and likewise the attention's."""
    kept_inputs = {"layer/attn/qkv_input"}
    if "o" in reads:  # o_proj's input: its own copy, or (transformers) SDPA's output itself
        kept_inputs |= {"layer/attn/out_input"} if lines.get("layer/attn/out_input") else {
            "layer/attn/out_input", "layer/attn/sdpa_out"}
    chains = (_SITES[:2], _PARALLEL_MLP_SITES) if cfg.parallel_residual else (_SITES,)
    out: dict[str, int] = {}
    for chain in chains:
        for k, v in _chain_unsaved(cfg, setup, targets, lines, hidden_tensor, chain,
                                   kept_inputs, reads).items():
            out[k] = out.get(k, 0) + v
    return out


# a parallel block's MLP chain: ln_2 reads the block's input, not the attention's output
_PARALLEL_MLP_SITES = ((UP_TARGETS, ("layer/ln_2/",)), (("down",), ("layer/mlp/hidden",)))


def _chain_unsaved(cfg: GPTConfig, setup: TrainingSetup, targets: set[str],
                   lines: dict[str, int], hidden_tensor: int, sites: tuple,
                   kept_inputs: set[str], reads: set[str]) -> dict[str, int]:
    """`_first_block_unsaved` along one chain of sites, up to its first adapted Linear."""
    out: dict[str, int] = {}
    L = cfg.n_layer
    for site_targets, prefixes in sites:
        if targets & set(site_targets) and site_targets == UP_TARGETS and (
                cfg.mlp in GATED_MLPS):
            for k, v in lines.items():
                if k.startswith(prefixes) and k not in kept_inputs:
                    out[k] = v // L
            # a gated MLP's hidden lines without down: gate's input, silu's output, up's output;
            # compiled blocks keep gate's and up's outputs and recompute silu's from gate's
            # (`compiled.compiled_block_lines`): gate adapted, both; up alone, gate's
            saved, kept = 2 * ("gate" in targets) + ("up" in targets), 3
            if setup.compile != "none":
                saved, kept = 2 if "gate" in targets else 1, 2
            if "swiglu" in liger_kernels(setup.liger):
                # LigerSiLUMulFunction saves the gate and up outputs whichever needs a
                # gradient (measured on transformers' Llama wrapped by PEFT with its
                # stand-in, tests/test_liger_lora.py)
                saved, kept = 2, 2
            out["layer/mlp/hidden"] = out.get("layer/mlp/hidden", 0) + (kept - saved) * (
                hidden_tensor)
            break
        for k, v in lines.items():
            if k.startswith(prefixes) and k not in kept_inputs:
                keep = hidden_tensor if k == "layer/mlp/hidden" and "down" in reads else 0
                out[k] = v // L - keep
        if targets & set(site_targets):
            if site_targets == ATTN_INPUT_TARGETS and "qkv" not in targets:
                # a per-head q (k) norm reads a frozen projection's output: nothing to save
                for role in ("q", "k"):
                    for key in lines:
                        if role not in targets and key.startswith(f"layer/attn/{role}_norm/"):
                            out[key] = lines[key] // L
            if site_targets == ATTN_INPUT_TARGETS and setup.attn_impl == "manual" and (
                    "qkv" not in targets):
                q, k = "q" in targets, "k" in targets
                for key, needed in (("layer/attn/q", k), ("layer/attn/k_t", q),
                                    ("layer/attn/v", q or k), ("layer/attn/causal_mask", q or k)):
                    if not needed and lines.get(key):
                        out[key] = lines[key] // L
            break
    return out
