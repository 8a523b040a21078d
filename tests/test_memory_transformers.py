"""`gptcalc memory --hf-config` against transformers' own models, one fp32 AdamW step on CPU."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from gptcalc.cli import cli

pytest.importorskip("transformers")
tw = pytest.importorskip("reference_model.transformers_twin")

# exact allocator numbers (MemTracker's step peak) and saved-tensor sets of torch 2.13
pytestmark = pytest.mark.requires_torch_213

# The targets; measured with torch 2.13 and transformers 5.23: the peak within 0.02%
# (MemTracker does not see the batch made before it starts; gptcalc counts it) and the saved
# bytes exact (saved_tensors_hooks, deduplicated by storage).
PEAK_TOLERANCE = 0.02
SAVED_TOLERANCE = 0.01

CASES = {
    "gpt2": {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 1000,
             "n_positions": 128},
    "gpt_neox": {"model_type": "gpt_neox", "hidden_size": 64, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "vocab_size": 1000, "intermediate_size": 256,
                 "max_position_embeddings": 128, "rotary_pct": 0.25},
    "llama_gqa": {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
                  "intermediate_size": 160, "max_position_embeddings": 128},
    "llama_mha": {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "vocab_size": 1000, "intermediate_size": 160,
                  "max_position_embeddings": 128},
    "qwen2": {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
              "intermediate_size": 160, "max_position_embeddings": 128},
    # q/k RMSNorm over each head
    "qwen3": {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "vocab_size": 1000, "intermediate_size": 160, "max_position_embeddings": 128},
    # a window shorter than both sequences: an explicit mask, and no enable_gqa with it
    "mistral_window": {"model_type": "mistral", "hidden_size": 64, "num_hidden_layers": 2,
                       "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
                       "intermediate_size": 160, "max_position_embeddings": 128,
                       "sliding_window": 16},
    # Phi-3: fused qkv_proj and gate_up_proj; its rotary cat makes o_proj's input a copy;
    # a window shorter than the sequence as Mistral's
    "phi3_window": {"model_type": "phi3", "hidden_size": 64, "num_hidden_layers": 2,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
                    "intermediate_size": 96, "max_position_embeddings": 128,
                    "sliding_window": 16, "pad_token_id": 0, "bos_token_id": 1,
                    "eos_token_id": 2},
    # Gemma 2: eager (its default), soft-capped scores and logits, sandwich norms, GeGLU,
    # sliding/global layers
    "gemma2": {"model_type": "gemma2", "hidden_size": 64, "num_hidden_layers": 2,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
               "vocab_size": 1000, "intermediate_size": 160, "max_position_embeddings": 128,
               "sliding_window": 16},
    # Gemma 3: SDPA, q/k norms, a local and a global rotary, windowed layers with a mask
    "gemma3_text": {"model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 3,
                    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                    "vocab_size": 1000, "intermediate_size": 160,
                    "max_position_embeddings": 128, "sliding_window": 16,
                    "sliding_window_pattern": 2},
    # MoE on transformers' default grouped_mm experts: router softmax, top-k renormalised,
    # tokens sorted by expert
    "mixtral": {"model_type": "mixtral", "hidden_size": 64, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
                "intermediate_size": 96, "max_position_embeddings": 128,
                "num_local_experts": 4, "num_experts_per_tok": 2},
    # q/k norms, top-3 of 8 without renormalising, a dense layer among the MoE ones
    "qwen3_moe": {"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 3,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                  "vocab_size": 1000, "intermediate_size": 160, "moe_intermediate_size": 48,
                  "max_position_embeddings": 128, "num_experts": 8, "num_experts_per_tok": 3,
                  "mlp_only_layers": [1]},
    # MLA with q LoRA (SDPA's math path: q/k and v heads differ), a dense first layer, then
    # group-limited sigmoid routing and a shared expert
    "deepseek_v3": {"model_type": "deepseek_v3", "hidden_size": 64, "num_hidden_layers": 3,
                    "num_attention_heads": 4, "vocab_size": 1000, "intermediate_size": 160,
                    "moe_intermediate_size": 32, "n_routed_experts": 8,
                    "num_experts_per_tok": 2, "n_shared_experts": 1, "first_k_dense_replace": 1,
                    "n_group": 2, "topk_group": 1, "q_lora_rank": 48, "kv_lora_rank": 32,
                    "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
                    "max_position_embeddings": 128},
}


@pytest.mark.parametrize("B, S", [(4, 64), (1, 32)])
@pytest.mark.parametrize("name", list(CASES))
def test_memory_hf_config_matches_transformers_on_cpu(name, B, S, tmp_path):
    raw = CASES[name]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    r = CliRunner().invoke(cli, ["memory", "--hf-config", str(tmp_path), "-B", str(B),
                                 "--seq-len", str(S), "--mode", "fp32", "--device", "cpu",
                                 "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["training"]["impl"] == "transformers"  # --hf-config's default profile
    model = tw.build(raw)
    idx, labels = tw.make_batch(raw["vocab_size"], B, S)
    saved = sum(t.nbytes for t in tw.measure_saved(model, idx, labels).tensors)
    predicted_saved = sum(out["breakdown"]["activations"].values())  # incl. the index tensors
    assert abs(predicted_saved - saved) <= SAVED_TOLERANCE * saved
    peak = tw.measure_step_peak(model, idx, labels).peak_bytes
    assert abs(out["peak"] - peak) <= PEAK_TOLERANCE * peak, (out["peak"], peak)


@pytest.mark.parametrize("raw", [
    # Qwen2-MoE: a shared expert with a sigmoid gate beside the routed ones
    {"model_type": "qwen2_moe", "hidden_size": 64, "num_hidden_layers": 2,
     "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
     "intermediate_size": 96, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
     "num_experts": 4, "num_experts_per_tok": 2},
    # DeepSeek-V2: V3's blocks, but a softmax router with its own group-limited top-k
    {"model_type": "deepseek_v2", "hidden_size": 64, "num_hidden_layers": 2,
     "num_attention_heads": 4, "vocab_size": 1000, "intermediate_size": 96,
     "moe_intermediate_size": 32, "n_routed_experts": 4, "num_experts_per_tok": 2,
     "first_k_dense_replace": 1, "kv_lora_rank": 16, "q_lora_rank": None,
     "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 8},
    # Gemma 1: GeGLU without Gemma 2's post-norms
    {"model_type": "gemma", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
     "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1000, "intermediate_size": 160}])
def test_unmodelled_families_refuse_impl_transformers(raw, tmp_path):
    # --impl transformers names itself rather than print a wrong number; the default falls
    # back to the reference profile and says so
    (tmp_path / "config.json").write_text(json.dumps(raw))
    base = ["memory", "--hf-config", str(tmp_path), "-B", "2", "--seq-len", "32", "--json"]
    r = CliRunner().invoke(cli, base + ["--impl", "transformers"])
    assert r.exit_code != 0 and "--impl" in r.output and "use --impl reference" in r.output
    r = CliRunner().invoke(cli, base)
    assert r.exit_code == 0, r.output
    assert json.loads(r.output)["training"]["impl"] == "reference"


# litgpt's loop and the `no_trainer` scripts hold the output through backward: --keep-logits
# against the same model stepped with its output kept
@pytest.mark.parametrize("name", ["gpt2", "llama_gqa", "gemma2"])
def test_keep_logits_matches_transformers_stepped_with_its_output_kept(name, tmp_path):
    raw, B, S = CASES[name], 2, 32
    (tmp_path / "config.json").write_text(json.dumps(raw))

    def predicted(*extra):
        r = CliRunner().invoke(cli, ["memory", "--hf-config", str(tmp_path), "-B", str(B),
                                     "--seq-len", str(S), "--mode", "fp32", "--device", "cpu",
                                     "--json", *extra])
        assert r.exit_code == 0, r.output
        return json.loads(r.output)["peak"]
    model = tw.build(raw)
    idx, labels = tw.make_batch(raw["vocab_size"], B, S)
    kept = tw.measure_step_peak(model, idx, labels, keep_logits=True).peak_bytes
    dropped = tw.measure_step_peak(model, idx, labels).peak_bytes
    assert abs(predicted("--keep-logits") - kept) <= PEAK_TOLERANCE * kept
    assert abs(predicted() - dropped) <= PEAK_TOLERANCE * dropped
    assert dropped < kept
