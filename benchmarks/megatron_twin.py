"""Saved bytes of Megatron-Core's GPT model with its local modules (no Transformer Engine),
measured on CPU, against `--impl megatron-core --no-megatron-te --device cpu`: one row per
(model, recomputation, dropout, dtype).

    pip install --no-deps --target /tmp/mcore megatron-core==0.16.1
    PYTHONPATH=/tmp/mcore python benchmarks/megatron_twin.py

Measured: every storage autograd saves in one training forward of `GPTModel` built from
`get_gpt_layer_local_spec` (tp = pp = 1, one gloo rank; without Apex its norms are torch's),
parameters excluded, plus pretrain_gpt.py's `loss_func` product with the fp32 loss mask.
Counted are the storages the loss's graph still holds at the end of the forward (a node made
inside a checkpoint's no-grad forward, as bias-dropout-add under enable_grad with a bias, is
freed with its graph). The harness changes three things for a CPU: Megatron's global memory
buffer (the attention scores' baddbmm output) and the rotary table live on the CPU, and its
CUDA RNG tracker and states are not used (which stream dropout draws from does not change what
is saved). The dataloader's attention mask, which the unfused softmax (and the checkpoints)
keep, is printed apart and not compared: gptcalc does not count it. Megatron-LM's training
arguments are followed where they differ from TransformerConfig's defaults:
attention_softmax_in_fp32 off. The fused masked
softmax is a CUDA kernel: torch's softmax runs instead (masked_softmax_fusion off), which saves
the same 16-bit probabilities. Exits 1 if any row is off.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F

from gptcalc import GPTConfig, Workload
from gptcalc.memory import TrainingSetup, saved_activations

warnings.filterwarnings("ignore")


def _start_megatron() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    import megatron.core.utils as mcu
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mrandom

    parallel_state.initialize_model_parallel(1, 1)
    mcu.GlobalMemoryBuffer.get_tensor = (
        lambda self, shape, dtype, name, mem_alloc_context=None: torch.empty(shape, dtype=dtype))
    mrandom.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()
    mrandom.CudaRNGStatesTracker.get_states = lambda self: {}
    mrandom._get_cuda_rng_state = lambda *a, **k: torch.empty(0)
    mrandom._set_cuda_rng_state = lambda *a, **k: None
    # the rotary table moves its frequencies to torch.cuda.current_device(): here the CPU
    torch.cuda.current_device = lambda: "cpu"


def build(cfg: GPTConfig, recompute: str, dtype: torch.dtype):
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    gated = cfg.mlp == "swiglu"
    norm = "RMSNorm" if cfg.norm == "rmsnorm" else "LayerNorm"
    tc = TransformerConfig(
        num_layers=cfg.n_layer, hidden_size=cfg.n_embd, num_attention_heads=cfg.n_head,
        num_query_groups=cfg.kv_heads, ffn_hidden_size=cfg.ffn_dim,
        hidden_dropout=cfg.dropout, attention_dropout=cfg.dropout,
        use_cpu_initialization=True, bf16=dtype == torch.bfloat16, params_dtype=dtype,
        gated_linear_unit=gated, add_bias_linear=cfg.mlp_bias,
        activation_func={"swiglu": F.silu, "relu": F.relu}.get(cfg.mlp, F.gelu),
        bias_activation_fusion=cfg.mlp != "relu" and (cfg.mlp_bias or gated),
        masked_softmax_fusion=False,
        attention_softmax_in_fp32=False, normalization=norm, persist_layer_norm=False,
        gradient_accumulation_fusion=False, apply_rope_fusion=False,
        recompute_granularity=None if recompute == "none" else recompute,
        recompute_method="uniform" if recompute == "full" else None,
        recompute_num_layers=1 if recompute == "full" else None,
        qk_layernorm=cfg.qk_norm == "head")
    pos = "rope" if cfg.pos_embedding == "rotary" else "learned_absolute"
    spec = get_gpt_layer_local_spec(normalization=norm, qk_layernorm=cfg.qk_norm == "head")
    model = GPTModel(tc, spec, cfg.vocab_size, cfg.block_size, position_embedding_type=pos,
                     share_embeddings_and_output_weights=cfg.tie_embeddings).to(dtype)
    return model.train()


def measure(cfg: GPTConfig, wl: Workload, recompute: str, dtype: torch.dtype
            ) -> tuple[int, int]:
    """(bytes saved for backward but the attention mask's, the attention mask's)."""
    model = build(cfg, recompute, dtype)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    b, S, V = wl.batch_size, wl.seq_len, cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (b, S), generator=g)
    labels = torch.randint(0, V, (b, S), generator=g)
    position_ids = torch.arange(S).repeat(b, 1)  # the dataset's, collated: b x S
    mask = torch.ones(1, 1, S, S, dtype=torch.bool).triu(1)
    loss_mask = torch.ones(b, S)
    packed: list[tuple[weakref.ref, int, int]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            packed.append((weakref.ref(t), st.data_ptr(), st.nbytes()))
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(ids, position_ids, mask, labels=labels)
        # pretrain_gpt.py's loss_func
        losses = out.view(-1).float()
        loss = torch.sum(losses * loss_mask.view(-1).float())
    # what the loss's graph still holds: a node inside a checkpoint's no-grad forward that
    # saved a tensor (bias-dropout-add runs under enable_grad) is freed with its graph
    saved = {ptr: n for ref, ptr, n in packed if ref() is not None}
    masked = saved.pop(mask.untyped_storage().data_ptr(), 0)
    del loss
    return sum(saved.values()), masked


MODELS = {  # E 64, H 4, L 2, V 96, T 24
    "gpt (GeLU, LayerNorm, learned)": GPTConfig(
        block_size=24, vocab_size=96, n_layer=2, n_head=4, n_embd=64, mlp="gelu"),
    # LayerNorm: without Apex the local spec's RMSNorm is torch's, whose CPU path saves fp32
    # intermediates Megatron's CUDA norms do not
    "llama-like (SwiGLU, RoPE, GQA 4/2)": GPTConfig(
        block_size=24, vocab_size=96, n_layer=2, n_head=4, n_kv_head=2, n_embd=64, d_ff=96,
        mlp="swiglu", pos_embedding="rotary", mlp_bias=False, qkv_bias=False,
        attn_out_bias=False, tie_embeddings=False),
    "rotary MHA": GPTConfig(block_size=24, vocab_size=96, n_layer=2, n_head=4, n_embd=64,
                            mlp="gelu", pos_embedding="rotary"),
    "GQA 4/1, learned": GPTConfig(block_size=24, vocab_size=96, n_layer=2, n_head=4,
                                  n_kv_head=1, n_embd=64, mlp="gelu"),
    "GQA 4/2, learned, ReLU": GPTConfig(block_size=24, vocab_size=96, n_layer=2, n_head=4,
                                        n_kv_head=2, n_embd=64, mlp="relu"),
}
# Megatron's qk_layernorm: a norm of head_dim on q and on k (gptcalc's qk_norm "head"), for
# each way q and k reach the core (a view of linear_qkv's output or a copy, rotary or not)
MODELS.update({f"{name}, q/k norms": cfg.replace(qk_norm="head")
               for name, cfg in list(MODELS.items())})


def main() -> int:
    _start_megatron()
    wl = Workload(2, 24)
    off = 0
    print("model | recompute | dropout | dtype | measured | gptcalc | mask (not counted)")
    for name, cfg0 in MODELS.items():
        for dropout in (0.0, 0.1):
            cfg = cfg0.replace(dropout=dropout)
            for recompute in ("none", "selective", "full"):
                for dtype, mode in ((torch.bfloat16, "mixed"), (torch.float32, "fp32")):
                    setup = TrainingSetup(mode=mode, device="cpu", impl="megatron-core",
                                          megatron_te=False, recompute=recompute)
                    predicted = sum(saved_activations(cfg, wl, setup).values())
                    measured, masked = measure(cfg, wl, recompute, dtype)
                    off += measured != predicted
                    print(f"{name} | {recompute} | {dropout} | {mode} | {measured:,} | "
                          f"{predicted:,} | {masked:,}")
    return 1 if off else 0


if __name__ == "__main__":
    sys.exit(main())
