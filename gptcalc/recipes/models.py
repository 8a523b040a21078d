"""Models by the names recipes give them: Hub ids (`base_model`, `model_name_or_path`) and
torchtune's model builders, as gptcalc presets whose sizes are the published config.json's.

A Hub id this table knows answers offline, as its preset; any other goes to --hf-config (the
Hub, or its cache under HF_HUB_OFFLINE=1)."""

from __future__ import annotations

# Hub ids (lower case) -> preset. Fine-tunes and re-uploads keep their base's config.json:
# Zephyr 7B is Mistral 7B v0.1's; NousResearch's and casperhansen's are copies of Meta's.
HUB: dict[str, str] = {
    **dict.fromkeys(("meta-llama/llama-3.2-1b", "meta-llama/llama-3.2-1b-instruct",
                     "nousresearch/llama-3.2-1b", "unsloth/llama-3.2-1b"), "llama3.2-1b"),
    **dict.fromkeys(("meta-llama/llama-3.2-3b", "meta-llama/llama-3.2-3b-instruct",
                     "unsloth/llama-3.2-3b"), "llama3.2-3b"),
    **dict.fromkeys(("meta-llama/meta-llama-3-8b", "meta-llama/meta-llama-3-8b-instruct",
                     "nousresearch/meta-llama-3-8b", "nousresearch/meta-llama-3-8b-instruct"),
                    "llama3-8b"),
    **dict.fromkeys(("meta-llama/llama-3.1-8b", "meta-llama/llama-3.1-8b-instruct",
                     "meta-llama/meta-llama-3.1-8b", "meta-llama/meta-llama-3.1-8b-instruct",
                     "nousresearch/meta-llama-3.1-8b", "nousresearch/meta-llama-3.1-8b-instruct"),
                    "llama3.1-8b"),
    **dict.fromkeys(("meta-llama/meta-llama-3-70b", "meta-llama/meta-llama-3-70b-instruct",
                     "casperhansen/llama-3-70b-fp16"), "llama3-70b"),
    **dict.fromkeys(("meta-llama/llama-3.1-70b", "meta-llama/llama-3.1-70b-instruct",
                     "meta-llama/meta-llama-3.1-70b"), "llama3.1-70b"),
    "meta-llama/llama-3.3-70b-instruct": "llama3.3-70b",
    "meta-llama/llama-3.1-405b": "llama3.1-405b",
    "meta-llama/llama-2-7b-hf": "llama2-7b",
    **dict.fromkeys(("mistralai/mistral-7b-v0.1", "alignment-handbook/zephyr-7b-sft-full",
                     "huggingfaceh4/zephyr-7b-beta"), "mistral-7b-v0.1"),
    "mistralai/mixtral-8x7b-v0.1": "mixtral-8x7b",
    **{f"qwen/qwen2.5-{size}{tail}": f"qwen2.5-{size}" for size in
       ("0.5b", "1.5b", "3b", "7b", "14b", "32b", "72b") for tail in ("", "-instruct")},
    **{f"qwen/qwen3-{size}{tail}": f"qwen3-{size}" for size in
       ("0.6b", "1.7b", "4b", "8b", "14b", "32b") for tail in ("", "-base")},
    # the 2507 updates keep Qwen3-4B's tensors (only max_position_embeddings grows)
    **dict.fromkeys(("qwen/qwen3-4b-instruct-2507", "qwen/qwen3-4b-thinking-2507"), "qwen3-4b"),
    "qwen/qwen3-30b-a3b": "qwen3-30b-a3b",
    **dict.fromkeys(("huggingfacetb/smollm2-1.7b", "huggingfacetb/smollm2-1.7b-instruct"),
                    "smollm2-1.7b"),
    **dict.fromkeys(("google/gemma-3-1b-it", "google/gemma-3-1b-pt"), "gemma-3-1b"),
    **dict.fromkeys(("google/gemma-2-2b", "google/gemma-2-2b-it"), "gemma-2-2b"),
    **dict.fromkeys(("google/gemma-2-9b", "google/gemma-2-9b-it"), "gemma-2-9b"),
    "microsoft/phi-4": "phi-4",
    "microsoft/phi-3-mini-4k-instruct": "phi-3-mini",
    "allenai/olmo-2-1124-7b": "olmo2-7b",
    # BLOOMZ 560M is BLOOM 560M fine-tuned on xP3: the same config.json
    **dict.fromkeys(("bigscience/bloom-560m", "bigscience/bloomz-560m"), "bloom-560m"),
}

# torchtune's model builders (torchtune/models/*/_model_builders.py, pytorch/torchtune at
# bd2a0fc7), less a _base/_instruct tail, -> preset: each builder's sizes are its preset's.
# Positions (max_seq_len) change no tensor. torchtune's mistral_7b has no sliding window,
# which changes no saved activation under SDPA's flash and memory-efficient kernels.
TORCHTUNE: dict[str, str] = {
    "llama2_7b": "llama2-7b", "llama3_8b": "llama3-8b", "llama3_70b": "llama3-70b",
    # Llama 3.1's tensors are Llama 3's (its longer context and rotary scaling change no
    # tensor); its 8192 positions are the length a config without max_seq_len counts
    "llama3_1_8b": "llama3-8b", "llama3_1_70b": "llama3-70b",
    "llama3_1_405b": "llama3.1-405b", "llama3_2_1b": "llama3.2-1b",
    "llama3_2_3b": "llama3.2-3b", "llama3_3_70b": "llama3.3-70b",
    "qwen2_5_0_5b": "qwen2.5-0.5b", "qwen2_5_1_5b": "qwen2.5-1.5b", "qwen2_5_3b": "qwen2.5-3b",
    "qwen2_5_7b": "qwen2.5-7b", "qwen2_5_14b": "qwen2.5-14b", "qwen2_5_32b": "qwen2.5-32b",
    "qwen2_5_72b": "qwen2.5-72b", "qwen3_0_6b": "qwen3-0.6b", "qwen3_1_7b": "qwen3-1.7b",
    "qwen3_4b": "qwen3-4b", "qwen3_8b": "qwen3-8b", "qwen3_14b": "qwen3-14b",
    "qwen3_32b": "qwen3-32b", "mistral_7b": "mistral-7b-v0.1", "phi4_14b": "phi-4",
    "phi3_mini": "phi-3-mini", "gemma2_2b": "gemma-2-2b", "gemma2_9b": "gemma-2-9b",
}


# the released checkpoints' model_types whose modules the transformers profile measures
# (gptcalc.memory.profile_transformers.transformers_family; a test keeps the two equal): a
# recipe run by the Hugging Face Trainer counts their activations as transformers saves them
TRANSFORMERS_MODELLED = frozenset({"gpt2", "llama", "mistral", "mixtral", "qwen2", "qwen3",
                                   "qwen3_moe", "phi3", "gemma2", "gemma3_text",
                                   "deepseek_v3", "bloom"})


def hub_preset(repo_id: str) -> str | None:
    """The preset whose sizes are a Hub model's published config.json, else None."""
    return HUB.get(repo_id.strip().lower())


def hub_hint(repo_id: str) -> str:
    """"; --preset X is <the nearest Hub id this table knows>" for an id it does not know."""
    import difflib

    text = str(repo_id).strip().lower()[:200]
    close = difflib.get_close_matches(text, list(HUB), n=1, cutoff=0.75)
    return f"; --preset {HUB[close[0]]} has the sizes of {close[0]}" if close else ""


def torchtune_preset(builder: str) -> str | None:
    """The preset of a torchtune builder's name (llama3_2_1b, qwen2_5_7b_instruct), else None."""
    name = builder.removesuffix("_base").removesuffix("_instruct")
    return TORCHTUNE.get(name)


__all__ = ["HUB", "TORCHTUNE", "TRANSFORMERS_MODELLED", "hub_hint", "hub_preset",
           "torchtune_preset"]
