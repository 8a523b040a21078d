"""Named models: a family from `ARCHS` plus sizes, each with its source above it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .config import GPTConfig
from .errors import ConfigError
from .families import ARCHS


@dataclass(frozen=True)
class Preset:
    arch: str
    sizes: dict[str, Any]
    batch_size: int = 1  # the batch its source trained with, where it names one (sequences)
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    # the model_type of the released checkpoint's config.json: its module names (and PEFT's
    # rules for them) name the LoRA targets; empty for models with no Hugging Face release
    hub: str = ""


def _gpt3(n_layer: int, n_embd: int, n_head: int, note: str = "") -> Preset:
    # GPT-3 uses the GPT-2 architecture (Brown et al. 2020, sec. 2.1) with a 2048 context.
    return Preset("gpt2", dict(n_layer=n_layer, n_embd=n_embd, n_head=n_head,
                               block_size=2048, vocab_size=50257), note=note)


PRESETS: dict[str, Preset] = {
    # Karpathy, "Let's build GPT" (the video's script): batch 64, block 256, 384 wide, 6 blocks,
    # 6 heads, dropout 0.2, vocabulary = the 65 characters of Tiny Shakespeare.
    "shakespeare-char": Preset("tutorial", dict(
        n_layer=6, n_head=6, n_embd=384, block_size=256, vocab_size=65, dropout=0.2),
        batch_size=64, note="Karpathy's Let's build GPT"),
    # A tiny model for tests and quick checks (not from a paper).
    "debug": Preset("gpt2", dict(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=97),
                    batch_size=2, note="tiny debug model"),
    # GPT-2 (Radford et al. 2019, Table 2; released checkpoints' config.json): V=50257, T=1024.
    "gpt2": Preset("gpt2", dict(n_layer=12, n_head=12, n_embd=768), hub="gpt2"),
    "gpt2-medium": Preset("gpt2", dict(n_layer=24, n_head=16, n_embd=1024), hub="gpt2"),
    "gpt2-large": Preset("gpt2", dict(n_layer=36, n_head=20, n_embd=1280), hub="gpt2"),
    "gpt2-xl": Preset("gpt2", dict(n_layer=48, n_head=25, n_embd=1600), hub="gpt2"),
    # GPT-3 (Brown et al. 2020, Table 2.1: n_layers, d_model, n_heads, d_head; T=2048).
    "gpt3-small": _gpt3(12, 768, 12),
    "gpt3-medium": _gpt3(24, 1024, 16),
    "gpt3-large": _gpt3(24, 1536, 16),
    # Table 2.1 prints d_model 2048 with 24 heads of 128, which cannot all hold (24*128=3072 and
    # 2048/24 is not whole). We keep d_model 2048 (it reproduces the 1.3B / 1320M of Table D.1)
    # and d_head 128, so 16 heads.
    "gpt3-xl": _gpt3(24, 2048, 16, note="Table 2.1 row inconsistent: took E=2048, 16x128 heads"),
    "gpt3-2.7b": _gpt3(32, 2560, 32),
    "gpt3-6.7b": _gpt3(32, 4096, 32),
    # Table 2.1 prints d_model 5140, but 40 heads x 128 = 5120, which reproduces 13.0B (12850M
    # in Table D.1); we take 5120.
    "gpt3-13b": _gpt3(40, 5120, 40, note="Table 2.1 prints 5140; took 40x128 = 5120"),
    "gpt3-175b": _gpt3(96, 12288, 96),
    # BLOOM 560M (bigscience/bloom-560m config.json: n_layer 24, hidden_size 1024, n_head 16,
    # vocab_size 250880, tied head; BigScience 2022, Table 3: sequence length 2048).
    "bloom-560m": Preset("bloom", dict(n_layer=24, n_head=16, n_embd=1024, block_size=2048,
                                        vocab_size=250880), hub="bloom"),
    # Llama 2 7B (Touvron et al. 2023; meta-llama/Llama-2-7b-hf config.json): 4096 context,
    # intermediate_size 11008, 32 heads, vocabulary 32000.
    "llama2-7b": Preset("llama", dict(n_layer=32, n_head=32, n_embd=4096, d_ff=11008,
                                       block_size=4096, vocab_size=32000), hub="llama"),
    # Llama 3 8B (meta-llama/Meta-Llama-3-8B config.json): 8 KV heads, intermediate_size 14336,
    # vocabulary 128256, 8192 context.
    "llama3-8b": Preset("llama", dict(n_layer=32, n_head=32, n_kv_head=8, n_embd=4096,
                                       d_ff=14336, block_size=8192, vocab_size=128256),
                        hub="llama"),
    # Llama 3 70B (meta-llama/Meta-Llama-3-70B config.json): 80 layers, 8192 wide, 64 heads,
    # 8 KV heads, intermediate_size 28672, vocabulary 128256, 8192 context.
    "llama3-70b": Preset("llama", dict(n_layer=80, n_head=64, n_kv_head=8, n_embd=8192,
                                        d_ff=28672, block_size=8192, vocab_size=128256),
                         hub="llama"),
    # Llama 3.1 8B and 70B (meta-llama/Llama-3.1-8B and Llama-3.1-70B config.json): Llama 3's
    # sizes with 131072 positions (rope_scaling llama3, which changes no tensor).
    "llama3.1-8b": Preset("llama", dict(n_layer=32, n_head=32, n_kv_head=8, n_embd=4096,
                                         d_ff=14336, block_size=131072, vocab_size=128256),
                          hub="llama"),
    "llama3.1-70b": Preset("llama", dict(n_layer=80, n_head=64, n_kv_head=8, n_embd=8192,
                                          d_ff=28672, block_size=131072, vocab_size=128256),
                           hub="llama"),
    # Llama 3.1 405B (meta-llama/Llama-3.1-405B config.json): 126 layers, 16384 wide, 128 heads,
    # 8 KV heads, intermediate_size 53248, vocabulary 128256, 131072 context.
    "llama3.1-405b": Preset("llama", dict(n_layer=126, n_head=128, n_kv_head=8, n_embd=16384,
                                           d_ff=53248, block_size=131072, vocab_size=128256),
                            hub="llama"),
    # Mistral 7B v0.1 (mistralai/Mistral-7B-v0.1 config.json; Jiang et al. 2023, Table 1):
    # sliding window 4096 on every layer, 32768 positions.
    "mistral-7b-v0.1": Preset("mistral", dict(
        n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, d_ff=14336, block_size=32768,
        vocab_size=32000, sliding_window=4096), hub="mistral"),
    # Mixtral 8x7B (mistralai/Mixtral-8x7B-v0.1 config.json; Jiang et al. 2024): 8 experts of
    # 14336, top 2, no sliding window.
    "mixtral-8x7b": Preset("mixtral", dict(
        n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, d_ff=14336, block_size=32768,
        vocab_size=32000, n_expert=8, n_expert_active=2), hub="mixtral"),
    # DeepSeek-V3 (deepseek-ai/DeepSeek-V3 config.json; DeepSeek-AI 2024, sec. 4.2): MLA with
    # q_lora 1536, kv_lora 512, rope 64, nope 128, v 128; 3 dense layers of 18432, then 256
    # routed experts of 2048 (top 8) and 1 shared expert. The multi-token-prediction module of
    # the release is not part of the model transformers builds, nor of this preset.
    "deepseek-v3": Preset("deepseek", dict(
        n_layer=61, n_head=128, n_embd=7168, d_ff=18432, block_size=163840, vocab_size=129280,
        kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, n_expert=256, n_expert_active=8, n_shared_expert=1, moe_ffn_dim=2048,
        moe_first_dense=3), hub="deepseek_v3"),
    # DeepSeek-V2-Lite (deepseek-ai/DeepSeek-V2-Lite config.json; model card: 15.7B total,
    # 2.4B activated): MLA without a query compression (q_lora_rank null: one q_proj), kv_lora
    # 512, rope 64, nope 128, v 128; 1 dense layer of 10944, then 64 routed experts of 1408
    # (top 6, greedy) and 2 shared experts.
    "deepseek-v2-lite": Preset("deepseek", dict(
        n_layer=27, n_head=16, n_embd=2048, d_ff=10944, block_size=163840, vocab_size=102400,
        kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, n_expert=64, n_expert_active=6, n_shared_expert=2, moe_ffn_dim=1408,
        moe_first_dense=1), hub="deepseek_v2"),
    # DeepSeek-V2 (deepseek-ai/DeepSeek-V2 config.json; DeepSeek-AI 2024, "DeepSeek-V2", sec. 3.1;
    # model card: 236B total, 21B activated): MLA with q_lora 1536, kv_lora 512, rope 64, nope
    # 128, v 128; 1 dense layer of 12288, then 160 routed experts of 1536 (top 6, within the
    # best 3 of 8 groups) and 2 shared experts.
    "deepseek-v2": Preset("deepseek", dict(
        n_layer=60, n_head=128, n_embd=5120, d_ff=12288, block_size=163840, vocab_size=102400,
        kv_lora_rank=512, q_lora_rank=1536, qk_nope_head_dim=128, qk_rope_head_dim=64,
        v_head_dim=128, n_expert=160, n_expert_active=6, n_shared_expert=2, moe_ffn_dim=1536,
        moe_first_dense=1, router_groups=8, router_topk_groups=3), hub="deepseek_v2"),
    # Qwen3-8B (Qwen/Qwen3-8B config.json): head_dim 128, q/k RMSNorm, untied.
    "qwen3-8b": Preset("qwen3", dict(n_layer=36, n_head=32, n_kv_head=8, n_embd=4096,
                                      head_dim=128, d_ff=12288, block_size=40960,
                                      vocab_size=151936), hub="qwen3"),
    # Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B config.json): 128 experts of 768, top 8, every layer.
    "qwen3-30b-a3b": Preset("qwen3_moe", dict(
        n_layer=48, n_head=32, n_kv_head=4, n_embd=2048, head_dim=128, d_ff=6144,
        block_size=40960, vocab_size=151936, n_expert=128, n_expert_active=8, moe_ffn_dim=768),
                            hub="qwen3_moe"),
    # Gemma 2 9B (google/gemma-2-9b config.json; Gemma Team 2024, Table 1): head_dim 256,
    # sliding window 4096 on every other layer (layer 0 sliding).
    "gemma-2-9b": Preset("gemma2", dict(
        n_layer=42, n_head=16, n_kv_head=8, n_embd=3584, head_dim=256, d_ff=14336,
        block_size=8192, vocab_size=256000, sliding_window=4096, attn_pattern="LG"), hub="gemma2"),
    # Gemma 3 27B, language model (google/gemma-3-27b-it config.json text_config; vocabulary
    # 262208 from Gemma3TextConfig's default; Gemma Team 2025): 5 local layers of window 1024
    # per global one.
    "gemma-3-27b": Preset("gemma3", dict(
        n_layer=62, n_head=32, n_kv_head=16, n_embd=5376, head_dim=128, d_ff=21504,
        block_size=131072, vocab_size=262208, sliding_window=1024, attn_pattern="LLLLLG"),
                          hub="gemma3_text"),
    # gpt-oss-20b (openai/gpt-oss-20b config.json; OpenAI 2025 model card): 32 experts of 2880,
    # top 4, head_dim 64, window 128 on every other layer (layer 0 sliding).
    "gpt-oss-20b": Preset("gpt_oss", dict(
        n_layer=24, n_head=64, n_kv_head=8, n_embd=2880, head_dim=64, d_ff=2880,
        block_size=131072, vocab_size=201088, n_expert=32, n_expert_active=4,
        sliding_window=128, attn_pattern="LG"), hub="gpt_oss"),
    # OLMo 2 7B (allenai/OLMo-2-1124-7B config.json).
    "olmo2-7b": Preset("olmo2", dict(n_layer=32, n_head=32, n_embd=4096, d_ff=11008,
                                      block_size=4096, vocab_size=100352), hub="olmo2"),
    # Phi-3-mini 4k (microsoft/Phi-3-mini-4k-instruct config.json): sliding window 2047.
    "phi-3-mini": Preset("phi3", dict(n_layer=32, n_head=32, n_embd=3072, d_ff=8192,
                                       block_size=4096, vocab_size=32064, sliding_window=2047),
                         hub="phi3"),
    # Llama 3.2 1B and 3B (meta-llama/Llama-3.2-1B and -3B config.json; torchtune's
    # llama3_2_1b/llama3_2_3b builders): tied embeddings, 131072 positions. 1B: 16 layers, 2048
    # wide, 32 heads, 8 KV heads, intermediate_size 8192; 3B: 28 layers, 3072 wide, 24 heads.
    "llama3.2-1b": Preset("llama", dict(n_layer=16, n_head=32, n_kv_head=8, n_embd=2048,
                                         d_ff=8192, block_size=131072, vocab_size=128256,
                                         tie_embeddings=True), hub="llama"),
    "llama3.2-3b": Preset("llama", dict(n_layer=28, n_head=24, n_kv_head=8, n_embd=3072,
                                         d_ff=8192, block_size=131072, vocab_size=128256,
                                         tie_embeddings=True), hub="llama"),
    # Llama 3.3 70B (meta-llama/Llama-3.3-70B-Instruct config.json): Llama 3.1 70B's sizes.
    "llama3.3-70b": Preset("llama", dict(n_layer=80, n_head=64, n_kv_head=8, n_embd=8192,
                                          d_ff=28672, block_size=131072, vocab_size=128256),
                           hub="llama"),
    # Qwen2.5 (Qwen/Qwen2.5-*B config.json; torchtune's qwen2_5_* builders): Llama's layout
    # with biased q/k/v projections (o_proj unbiased). 0.5B-3B tie the embeddings.
    "qwen2.5-0.5b": Preset("llama", dict(n_layer=24, n_head=14, n_kv_head=2, n_embd=896,
                                          d_ff=4864, block_size=32768, vocab_size=151936,
                                          qkv_bias=True, tie_embeddings=True), hub="qwen2"),
    "qwen2.5-1.5b": Preset("llama", dict(n_layer=28, n_head=12, n_kv_head=2, n_embd=1536,
                                          d_ff=8960, block_size=131072, vocab_size=151936,
                                          qkv_bias=True, tie_embeddings=True), hub="qwen2"),
    "qwen2.5-3b": Preset("llama", dict(n_layer=36, n_head=16, n_kv_head=2, n_embd=2048,
                                        d_ff=11008, block_size=32768, vocab_size=151936,
                                        qkv_bias=True, tie_embeddings=True), hub="qwen2"),
    "qwen2.5-7b": Preset("llama", dict(n_layer=28, n_head=28, n_kv_head=4, n_embd=3584,
                                        d_ff=18944, block_size=131072, vocab_size=152064,
                                        qkv_bias=True), hub="qwen2"),
    "qwen2.5-14b": Preset("llama", dict(n_layer=48, n_head=40, n_kv_head=8, n_embd=5120,
                                         d_ff=13824, block_size=131072, vocab_size=152064,
                                         qkv_bias=True), hub="qwen2"),
    "qwen2.5-32b": Preset("llama", dict(n_layer=64, n_head=40, n_kv_head=8, n_embd=5120,
                                         d_ff=27648, block_size=131072, vocab_size=152064,
                                         qkv_bias=True), hub="qwen2"),
    "qwen2.5-72b": Preset("llama", dict(n_layer=80, n_head=64, n_kv_head=8, n_embd=8192,
                                         d_ff=29568, block_size=131072, vocab_size=152064,
                                         qkv_bias=True), hub="qwen2"),
    # Qwen3 dense (Qwen/Qwen3-*B config.json; the same sizes in torchtitan's qwen3_args at
    # e347b1e5): head_dim 128, q/k RMSNorm, 40960 positions; 0.6B-4B tie the embeddings.
    "qwen3-0.6b": Preset("qwen3", dict(n_layer=28, n_head=16, n_kv_head=8, n_embd=1024,
                                        head_dim=128, d_ff=3072, block_size=40960,
                                        vocab_size=151936, tie_embeddings=True), hub="qwen3"),
    "qwen3-1.7b": Preset("qwen3", dict(n_layer=28, n_head=16, n_kv_head=8, n_embd=2048,
                                        head_dim=128, d_ff=6144, block_size=40960,
                                        vocab_size=151936, tie_embeddings=True), hub="qwen3"),
    "qwen3-4b": Preset("qwen3", dict(n_layer=36, n_head=32, n_kv_head=8, n_embd=2560,
                                      head_dim=128, d_ff=9728, block_size=40960,
                                      vocab_size=151936, tie_embeddings=True), hub="qwen3"),
    "qwen3-14b": Preset("qwen3", dict(n_layer=40, n_head=40, n_kv_head=8, n_embd=5120,
                                       head_dim=128, d_ff=17408, block_size=40960,
                                       vocab_size=151936), hub="qwen3"),
    "qwen3-32b": Preset("qwen3", dict(n_layer=64, n_head=64, n_kv_head=8, n_embd=5120,
                                       head_dim=128, d_ff=25600, block_size=40960,
                                       vocab_size=151936), hub="qwen3"),
    # Phi-4 (microsoft/phi-4 config.json; torchtune's phi4_14b builder): Phi-3's fused layout,
    # 40 layers, 5120 wide, 40 heads, 10 KV heads, intermediate_size 17920, vocabulary 100352,
    # 16384 positions, no sliding window.
    "phi-4": Preset("phi3", dict(n_layer=40, n_head=40, n_kv_head=10, n_embd=5120, d_ff=17920,
                                  block_size=16384, vocab_size=100352), hub="phi3"),
    # Gemma 2 2B (google/gemma-2-2b config.json; torchtune's gemma2_2b builder): head_dim 256,
    # window 4096 on every other layer.
    "gemma-2-2b": Preset("gemma2", dict(
        n_layer=26, n_head=8, n_kv_head=4, n_embd=2304, head_dim=256, d_ff=9216,
        block_size=8192, vocab_size=256000, sliding_window=4096, attn_pattern="LG"), hub="gemma2"),
    # Gemma 3 1B (google/gemma-3-1b-it config.json): one KV head of 256, 5 local layers of window
    # 512 per global one, 32768 positions, vocabulary 262144.
    "gemma-3-1b": Preset("gemma3", dict(
        n_layer=26, n_head=4, n_kv_head=1, n_embd=1152, head_dim=256, d_ff=6912,
        block_size=32768, vocab_size=262144, sliding_window=512, attn_pattern="LLLLLG"),
                         hub="gemma3_text"),
    # SmolLM2 1.7B (HuggingFaceTB/SmolLM2-1.7B config.json): Llama's layout, 24 layers, 2048
    # wide, 32 heads (no grouping), intermediate_size 8192, vocabulary 49152, tied, 8192 positions.
    "smollm2-1.7b": Preset("llama", dict(n_layer=24, n_head=32, n_embd=2048, d_ff=8192,
                                          block_size=8192, vocab_size=49152,
                                          tie_embeddings=True), hub="llama"),
    # A tiny DeepSeek-shaped model for tests and `gptcalc verify` (not from a paper): latent
    # attention, a dense first layer, then 4 routed experts (top 2) and a shared expert, and
    # alternating sliding-window / global layers.
    "debug-moe": Preset("deepseek", dict(
        n_layer=3, n_head=2, n_embd=32, d_ff=48, block_size=16, vocab_size=97,
        kv_lora_rank=8, q_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
        n_expert=4, n_expert_active=2, n_shared_expert=1, moe_ffn_dim=16, moe_first_dense=1,
        sliding_window=6, attn_pattern="LG"), batch_size=2, note="tiny MoE + MLA debug model"),
}

DEFAULT_PRESET = "shakespeare-char"


def arch_switches(arch: str) -> dict[str, Any]:
    if arch not in ARCHS:
        raise ConfigError("arch", f"unknown arch {arch!r}; choose from {', '.join(ARCHS)}")
    return dict(ARCHS[arch])


def preset(name: str) -> Preset:
    if name not in PRESETS:
        raise ConfigError("preset", f"unknown preset {name!r}{did_you_mean(name, PRESETS)}; "
                                    f"`gptcalc presets` lists them")
    return PRESETS[name]


def did_you_mean(name: str, known: Any) -> str:
    """"; did you mean X?" for the nearest of `known` to a mistyped `name`, else ""."""
    import difflib

    text = str(name)[:100].lower()
    close = difflib.get_close_matches(text, [str(k).lower() for k in known], n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def preset_fields(p: Preset, arch: str | None = None) -> dict[str, Any]:
    """A preset's sizes, and its released checkpoint's module names (`hf_model_type`) unless
    `arch` swaps its family for another."""
    keep_hub = p.hub and (arch is None or arch == p.arch)
    return {**p.sizes, **({"hf_model_type": p.hub} if keep_hub else {})}


def from_name(name: str = DEFAULT_PRESET, arch: str | None = None, **overrides: Any) -> GPTConfig:
    """A preset's config; `arch` swaps its family of switches (and drops the released
    checkpoint's module names), `overrides` set any field."""
    p = preset(name)
    fields = {**arch_switches(arch or p.arch), **preset_fields(p, arch), **overrides}
    return GPTConfig(**fields)
