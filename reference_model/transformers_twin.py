"""The memory measurements of `reference_model.memory`, on Hugging Face transformers models.

What people fine-tune is transformers' `LlamaForCausalLM`, `Qwen2ForCausalLM`, `MistralForCausalLM`,
`GPT2LMHeadModel`, `GPTNeoXForCausalLM` and `BloomForCausalLM` with their default attention, not
the reference model.
This module builds those classes from a `GPTConfig` (or a config.json dict), offline and with random
weights, and measures what they hold:

- `measure_saved`: every storage autograd saves in one training forward (`model(input_ids,
  labels=labels)`, the loss computed inside the model as transformers does), through the
  reference model's capture (`reference_model.memory.saved_during`: saved_tensors_hooks),
  deduplicated by storage, parameters and buffers
  (and their views) excluded, each entry with the saving autograd node, dtype, shape and module.
- `measure_step_peak`: the peak live tensor bytes of one steady-state training step
  (zero_grad(set_to_none=True), forward with labels, loss.backward(), optimizer.step()) after a
  warm-up step, from PyTorch's dispatch-mode tracker (MemTracker), with the live bytes at the
  moments a phase model needs: the end of forward, the start of backward (the logits' gradient
  just made) and the peak of each phase.

The training loop measured is the one of transformers' `no_trainer` examples: the model output
(logits, loss and, with the config's default `use_cache=True`, the key/value cache) is held
through backward and dropped before the optimizer step.

torch and transformers are imported here only; transformers is an optional dependency.
"""

from __future__ import annotations

import gc

import weakref
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from gptcalc.config import GPTConfig
from gptcalc.errors import ConfigError
from gptcalc.memory.profile_transformers import transformers_family

from .memory import (SavedReport, SavedTensor, saved_during, tensors_in,
                     track_skipping_frozen)
from .recompute import OpCheckpoint

FAMILIES = ("gpt2", "gpt_neox", "llama", "mistral", "qwen2", "bloom")
_HF_GELU = {"gelu_tanh": "gelu_new", "gelu": "gelu", "relu": "relu"}  # gptcalc mlp -> HF act


def family_of(cfg: GPTConfig) -> str:
    """The transformers model_type implementing `cfg` (gptcalc.memory.profile_transformers decides)."""
    return transformers_family(cfg)


def _require(ok: bool, family: str, what: str) -> None:
    if not ok:
        raise ConfigError("family", f"transformers' {family} cannot express this GPTConfig: {what}")


def hf_config_for(cfg: GPTConfig, family: str | None = None) -> dict[str, Any]:
    """The config.json fields (model_type first) of the transformers class implementing `cfg`.

    gpt2: GPT2LMHeadModel (fused c_attn, biases, learned positions, `gelu_new` for gelu_tanh);
    gpt_neox: GPTNeoXForCausalLM (fused query_key_value, partial rotary, parallel residual);
    bloom: BloomForCausalLM (ALiBi, word_embeddings_layernorm, fused query_key_value, eager
    attention only);
    llama / mistral: no or shared biases, RMSNorm, SwiGLU, separate q/k/v, grouped-query;
    qwen2: q/k/v bias without an output-projection bias. Raises ConfigError for a
    switch the class cannot express (ConfigError, field \"family\") (e.g. a GPT-2 without biases, a NeoX with grouped-query).
    """
    fam = family or family_of(cfg)
    if fam not in FAMILIES:
        raise ConfigError("family", f"family {fam!r} is not one of {', '.join(FAMILIES)}")
    _require(not cfg.lm_head_bias, fam, "no transformers causal LM has an lm_head bias")
    _require(cfg.final_norm, fam, "every family has a final norm")
    p = cfg.dropout
    if fam == "gpt2":
        _require(cfg.pos_embedding == "learned" and cfg.qkv_layout == "fused"
                 and cfg.norm == "layernorm", fam, "needs learned positions, fused q/k/v, LayerNorm")
        _require(cfg.qkv_bias and cfg.attn_out_bias and cfg.mlp_bias, fam, "every Conv1D has a bias")
        _require(cfg.mlp in _HF_GELU and cfg.kv_heads == cfg.n_head and cfg.head_dim in
                 (None, cfg.n_embd // cfg.n_head) and cfg.embd_dropout and not cfg.parallel_residual,
                 fam, "GELU/ReLU MLP, multi-head attention, embedding dropout, sequential residual")
        return dict(model_type="gpt2", n_embd=cfg.n_embd, n_layer=cfg.n_layer, n_head=cfg.n_head,
                    n_positions=cfg.block_size, vocab_size=cfg.vocab_size,
                    n_inner=None if cfg.d_ff is None else cfg.d_ff,
                    activation_function=_HF_GELU[cfg.mlp], resid_pdrop=p, embd_pdrop=p,
                    attn_pdrop=p, tie_word_embeddings=cfg.tie_embeddings)
    if fam == "bloom":
        # BloomAttention and BloomMLP fix what a GPTConfig could vary: head_dim E / H, d_ff 4E,
        # biases everywhere, one dropout rate read by both hidden_dropout and attention_dropout
        _require(cfg.head_dim in (None, cfg.n_embd // cfg.n_head) and cfg.ffn_dim == 4 * cfg.n_embd
                 and cfg.qkv_bias and cfg.attn_out_bias and cfg.mlp_bias
                 and not cfg.embd_dropout, fam,
                 "head_dim E / H, d_ff 4E, biased Linears, no embedding dropout")
        return dict(model_type="bloom", hidden_size=cfg.n_embd, n_layer=cfg.n_layer,
                    n_head=cfg.n_head, vocab_size=cfg.vocab_size, seq_length=cfg.block_size,
                    hidden_dropout=p, attention_dropout=p,
                    tie_word_embeddings=cfg.tie_embeddings)
    if fam == "gpt_neox":
        _require(cfg.pos_embedding == "rotary" and cfg.qkv_layout == "fused"
                 and cfg.norm == "layernorm", fam, "needs rotary, fused q/k/v, LayerNorm")
        _require(cfg.mlp_bias and cfg.qkv_bias == cfg.attn_out_bias, fam,
                 "biased MLP; q/k/v and output biases together (attention_bias)")
        _require(cfg.mlp in _HF_GELU and cfg.kv_heads == cfg.n_head and cfg.head_dim in
                 (None, cfg.n_embd // cfg.n_head) and cfg.embd_dropout, fam,
                 "GELU/ReLU MLP, multi-head attention, embedding dropout")
        return dict(model_type="gpt_neox", hidden_size=cfg.n_embd, num_hidden_layers=cfg.n_layer,
                    num_attention_heads=cfg.n_head, intermediate_size=cfg.ffn_dim,
                    vocab_size=cfg.vocab_size, max_position_embeddings=cfg.block_size,
                    rotary_pct=cfg.rotary_pct, use_parallel_residual=cfg.parallel_residual,
                    hidden_act=_HF_GELU[cfg.mlp], attention_bias=cfg.qkv_bias,
                    hidden_dropout=p, attention_dropout=p,
                    tie_word_embeddings=cfg.tie_embeddings)
    _require(cfg.norm == "rmsnorm" and cfg.mlp == "swiglu" and cfg.qkv_layout == "separate"
             and cfg.pos_embedding == "rotary" and cfg.rotary_pct == 1.0
             and not cfg.parallel_residual and not cfg.embd_dropout, fam,
             "needs RMSNorm, SwiGLU, separate q/k/v, full rotary, sequential residual, "
             "no embedding dropout")
    if fam == "qwen2":
        _require(cfg.qkv_bias and not cfg.attn_out_bias and not cfg.mlp_bias, fam,
                 "q/k/v bias, no output or MLP bias")
    elif fam == "mistral":
        _require(not (cfg.qkv_bias or cfg.attn_out_bias or cfg.mlp_bias), fam, "no biases")
    else:
        _require(cfg.qkv_bias == cfg.attn_out_bias, fam,
                 "q/k/v and output biases together (attention_bias)")
    fields = dict(model_type=fam, hidden_size=cfg.n_embd, num_hidden_layers=cfg.n_layer,
                  num_attention_heads=cfg.n_head, num_key_value_heads=cfg.kv_heads,
                  head_dim=cfg.head_size, intermediate_size=cfg.ffn_dim,
                  vocab_size=cfg.vocab_size, max_position_embeddings=cfg.block_size,
                  hidden_act="silu", attention_dropout=p,
                  tie_word_embeddings=cfg.tie_embeddings)
    if fam == "llama":
        fields.update(attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias)
    if fam in ("mistral", "qwen2"):
        fields["sliding_window"] = None  # full attention, as GPTConfig describes
    return fields


def build(raw_hf_config: Mapping[str, Any], attn_implementation: str | None = None,
          dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.nn.Module:
    """An `AutoModelForCausalLM` with random weights from config.json fields, offline, in
    train mode. attn_implementation None: the class's default ("sdpa"; Gemma 2: "eager").
    Any family transformers knows builds from its fields (the tests build Gemma 2/3, Mixtral and
    Qwen3-MoE this way; MoE experts on transformers' default "grouped_mm" path)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(raw_hf_config)
    model_type = fields.pop("model_type")
    for key in ("architectures", "transformers_version", "torch_dtype", "dtype"):
        fields.pop(key, None)
    hf_cfg = AutoConfig.for_model(model_type, **fields)
    kwargs = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype, **kwargs)
    return model.to(device).train()


def apply_recompute(model: torch.nn.Module, recompute: str) -> torch.nn.Module:
    """Activation checkpointing as transformers runs it, in place: `full` is
    `activation_checkpointing_enable()` with transformers' defaults (the new name of
    `gradient_checkpointing_enable`; non-reentrant torch.utils.checkpoint of every decoder
    layer's forward, the cache off); `op` is the same wrapping with torchtitan's op-level
    policy as the checkpoint's context_fn (reference_model.recompute), recorded as
    `model.op_checkpoint`. transformers has no attention-only checkpointing: `selective`
    raises."""
    if recompute == "none":
        return model
    enable = getattr(model, "activation_checkpointing_enable", None) or \
        model.gradient_checkpointing_enable
    if recompute == "full":
        enable()
    elif recompute == "op":
        model.op_checkpoint = OpCheckpoint()
        enable({"use_reentrant": False, "context_fn": model.op_checkpoint.context_fn})
    else:
        raise ConfigError("recompute", f"transformers checkpoints whole decoder layers: "
                                       f"recompute none, op or full, not {recompute!r}")
    from transformers.modeling_layers import GradientCheckpointingLayer

    held: list[weakref.ref] = []
    model.checkpoint_held = held
    for layer in model.modules():
        if isinstance(layer, GradientCheckpointingLayer) and layer.gradient_checkpointing:
            layer._gradient_checkpointing_func = _holding(layer._gradient_checkpointing_func,
                                                          held)
    return model


def _holding(checkpoint_fn, held: list):
    """`checkpoint_fn` recording (weakly) every tensor a checkpointed layer call holds until
    its backward: the positional inputs (which the checkpoint saves) and the keyword arguments
    transformers binds into the recomputed function (position embeddings, position ids, an
    eager attention mask), which the recomputation keeps alive."""

    def run(fn, *args):
        bound = list(args) + list(getattr(fn, "keywords", {}).values())
        held.extend(weakref.ref(t) for t in tensors_in(bound))
        return checkpoint_fn(fn, *args)
    return run


def make_batch(vocab_size: int, batch_size: int, seq_len: int, device: str = "cpu",
               seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and labels (= the input ids, as causal-LM fine-tuning passes them)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab_size, (batch_size, seq_len), generator=g).to(device)
    return idx, idx.clone()


def peft_lora(model: torch.nn.Module, rank: int, targets, dropout: float = 0.0,
              fp32_adapters: bool = True) -> torch.nn.Module:
    """`model` wrapped by PEFT's get_peft_model with LoRA of rank `rank` (lora_alpha = r,
    lora_dropout `dropout`, PEFT's defaults otherwise) on `targets`: "all-linear", or module
    names as gptcalc.lora.parse_targets returns them, where experts.gate_up_proj /
    experts.down_proj (fused 3-D expert parameters) become PEFT's target_parameters.
    `fp32_adapters`: PEFT's autocast_adapter_dtype (adapters of a 16-bit model in fp32);
    False keeps them in the model's dtype."""
    import peft

    if targets == "all-linear":
        config = peft.LoraConfig(r=rank, lora_alpha=rank, target_modules="all-linear",
                                 lora_dropout=dropout)
    else:
        params = [t.split(".", 1)[1] for t in targets if t.startswith("experts.")]
        modules = [t for t in targets if not t.startswith("experts.")]
        config = peft.LoraConfig(r=rank, lora_alpha=rank, target_modules=modules or None,
                                 target_parameters=params or None, lora_dropout=dropout)
    return peft.get_peft_model(model, config, autocast_adapter_dtype=fp32_adapters)


# --------------------------------------------------------------------------- saved tensors


def _autocast(amp_dtype: torch.dtype | None, device: str):
    import contextlib
    if amp_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device, dtype=amp_dtype)


def measure_saved(model: torch.nn.Module, idx: torch.Tensor, labels: torch.Tensor,
                  amp_dtype: torch.dtype | None = None) -> SavedReport:
    """Saved-activation bytes of one training forward `model(input_ids=idx, labels=labels)`
    (the loss computed by transformers' loss function), optionally under torch.autocast.

    Under autocast the 16-bit weight copies autograd saves are reported like any other tensor
    (their module is the Linear that cast them)."""
    with _autocast(amp_dtype, idx.device.type):
        # reading a checkpointed node's saved tensors would run its recomputation: no names
        report, out = saved_during(
            model, lambda: {"loss": (o := model(input_ids=idx, labels=labels)).loss,
                            "logits": o.logits}, names=not hasattr(model, "checkpoint_held"))
    del out
    return report


# --------------------------------------------------------------------------- step peak


@dataclass(frozen=True)
class StepMoments:
    """Live tensor bytes (MemTracker's total) through one steady-state training step."""

    peak_bytes: int  # the step's peak
    peak_phase: str  # forward | loss_backward | backward | optimizer (the phase holding it)
    baseline: int  # before zero_grad: weights, gradients of the last step, optimizer states
    forward_end: int  # model(...) returned: states + saved tensors + the output (logits, loss)
    backward_start: int  # the logits' gradient just made, before lm_head's backward
    backward_end: int  # loss.backward() returned
    optimizer_start: int  # the model output dropped, before optimizer.step()
    phase_peaks: dict[str, int] = field(default_factory=dict)  # the peak inside each phase
    by_category: dict[str, int] = field(default_factory=dict)  # MemTracker's categories at peak


_PHASE_TRACKER = None  # the MemTracker subclass, made on first use (imports torch.distributed)


def _phase_tracker_class():
    global _PHASE_TRACKER
    if _PHASE_TRACKER is not None:
        return _PHASE_TRACKER
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker

    class PhaseTracker(MemTracker):
        """MemTracker keeping the device-wide peak, and the peak of each phase named by the
        caller (`phase`), instead of the per-module peaks (O(ops x modules))."""

        phase = "setup"

        def _update_peak_stats(self, peak_state) -> None:
            for dev, snap in self._curr_mem_snap.items():
                total = snap[_TOTAL_KEY]
                if self._peak_mem.get(dev, 0) < total:
                    self._peak_mem[dev] = total
                    self._peak_mem_snap[dev] = dict(snap)
                    self.peak_phase = self.phase
                peaks = self.__dict__.setdefault("phase_peaks", {})
                if peaks.get(self.phase, 0) < total:
                    peaks[self.phase] = total

        def live(self) -> int:
            return sum(s[_TOTAL_KEY] for s in self._curr_mem_snap.values())

        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            return track_skipping_frozen(self, super()._track_module_params_and_buffers,
                                         module, install_grad_hooks)

    _PHASE_TRACKER = PhaseTracker
    return PhaseTracker


def make_optimizer(model: torch.nn.Module, optimizer: str = "adamw") -> torch.optim.Optimizer:
    """PyTorch's AdamW (foreach, its default on CPU) or SGD, as reference_model.memory makes,
    over the parameters that train (all of them, or PEFT's adapters)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if optimizer == "adamw":
        return torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1)
    if optimizer == "sgd-momentum":
        return torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    return torch.optim.SGD(params, lr=1e-3)


def train_step(model, opt, idx, labels, amp_dtype=None, tracker=None,
               keep_logits: bool = False) -> None:
    """One step: zero_grad(set_to_none) -> out = model(..., labels) -> loss.backward() ->
    opt.step(). The output (its logits) is dropped before backward, as the Hugging Face
    Trainer's compute_loss returns the loss alone, or with `keep_logits` held through backward
    (the `no_trainer` scripts' `outputs`). With `tracker`, names the phases and records the live
    bytes at the moments of StepMoments into tracker.moments."""
    moments = {} if tracker is None else tracker.__dict__.setdefault("moments", {})

    def mark(name: str, phase: str | None = None) -> None:
        if tracker is not None:
            moments[name] = tracker.live()
            if phase:
                tracker.phase = phase

    mark("baseline", "zero_grad")
    opt.zero_grad(set_to_none=True)
    mark("forward_start", "forward")
    with _autocast(amp_dtype, idx.device.type):
        out = model(input_ids=idx, labels=labels)
    mark("forward_end", "loss_backward")
    if tracker is not None:
        out.logits.register_hook(lambda g: mark("backward_start", "backward"))
    loss = out.loss
    if not keep_logits:
        out = None
    loss.backward()
    mark("backward_end", "drop_output")
    del out, loss
    mark("optimizer_start", "optimizer")
    opt.step()
    mark("optimizer_end", "done")


def measure_step_peak(model: torch.nn.Module, idx: torch.Tensor, labels: torch.Tensor,
                      optimizer: str = "adamw", amp_dtype: torch.dtype | None = None,
                      keep_logits: bool = False) -> StepMoments:
    """Peak live tensor bytes of one steady-state step on CPU (MemTracker), after a warm-up
    step that creates the optimizer states, with the live bytes at the phase boundaries
    (`keep_logits`: as `train_step`)."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY

    opt = make_optimizer(model, optimizer)
    train_step(model, opt, idx, labels, amp_dtype, keep_logits=keep_logits)  # warm-up: states
    tracker = _phase_tracker_class()()
    tracker.track_external(model, opt)
    # a full collection first: the cyclic collector then runs at the same allocations of the
    # step whatever ran before in this process (PEFT's DoRA leaves reference cycles, freed
    # when the collector runs: its peak otherwise moves with what earlier code allocated)
    gc.collect()
    with tracker:
        train_step(model, opt, idx, labels, amp_dtype, tracker, keep_logits)
    snap = next(iter(tracker.get_tracker_snapshot("peak").values()))
    m = tracker.moments
    return StepMoments(
        peak_bytes=snap[_TOTAL_KEY], peak_phase=tracker.peak_phase, baseline=m["baseline"],
        forward_end=m["forward_end"], backward_start=m["backward_start"],
        backward_end=m["backward_end"], optimizer_start=m["optimizer_start"],
        phase_peaks=dict(tracker.phase_peaks),
        by_category={getattr(k, "value", str(k)): v for k, v in snap.items() if k != _TOTAL_KEY})


__all__ = ["FAMILIES", "SavedReport", "SavedTensor", "StepMoments", "apply_recompute",
           "build", "family_of", "hf_config_for", "make_batch", "make_optimizer",
           "measure_saved", "measure_step_peak", "peft_lora", "saved_during", "train_step"]


def quantize_block_linears(model) -> None:
    """Every block Linear of `model` (attention and MLP) replaced by bitsandbytes' Linear4bit
    with its weight quantised to NF4 on the CPU, bf16 compute, and the model marked as loaded
    in 4 bits (so PEFT picks its 4-bit LoRA layer): the QLoRA base the twins measure."""
    import bitsandbytes as bnb

    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for child, linear in list(parent.named_children()):
                if isinstance(linear, torch.nn.Linear):
                    q = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=False,
                                          compute_dtype=torch.bfloat16, quant_type="nf4")
                    q.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False,
                                                 quant_type="nf4")._quantize("cpu")
                    setattr(parent, child, q)
    model.is_loaded_in_4bit = True
