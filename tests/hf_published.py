"""Published config.json files of released models (huggingface.co/<repo>/config.json), the
fields that change a count or the attention pattern; golden inputs of the transformers twins."""

PUBLISHED = {
    # mistralai/Mixtral-8x7B-v0.1
    "mixtral-8x7b": dict(
        model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
        max_position_embeddings=32768, num_local_experts=8, num_experts_per_tok=2,
        sliding_window=None, tie_word_embeddings=False, rope_theta=1e6),
    # deepseek-ai/DeepSeek-V3
    "deepseek-v3": dict(
        model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432,
        moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
        num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256,
        num_experts_per_tok=8, first_k_dense_replace=3, kv_lora_rank=512, q_lora_rank=1536,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, vocab_size=129280,
        max_position_embeddings=163840, n_group=8, topk_group=4, tie_word_embeddings=False),
    # deepseek-ai/DeepSeek-V2-Lite (q_lora_rank null: one q_proj; greedy routing)
    "deepseek-v2-lite": dict(
        model_type="deepseek_v2", hidden_size=2048, intermediate_size=10944,
        moe_intermediate_size=1408, num_hidden_layers=27, num_attention_heads=16,
        num_key_value_heads=16, n_shared_experts=2, n_routed_experts=64,
        num_experts_per_tok=6, first_k_dense_replace=1, moe_layer_freq=1, kv_lora_rank=512,
        q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        vocab_size=102400, max_position_embeddings=163840, topk_method="greedy", n_group=1,
        topk_group=1, norm_topk_prob=False, tie_word_embeddings=False),
    # deepseek-ai/DeepSeek-V2
    "deepseek-v2": dict(
        model_type="deepseek_v2", hidden_size=5120, intermediate_size=12288,
        moe_intermediate_size=1536, num_hidden_layers=60, num_attention_heads=128,
        num_key_value_heads=128, n_shared_experts=2, n_routed_experts=160,
        num_experts_per_tok=6, first_k_dense_replace=1, moe_layer_freq=1, kv_lora_rank=512,
        q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        vocab_size=102400, max_position_embeddings=163840, topk_method="group_limited_greedy",
        n_group=8, topk_group=3, norm_topk_prob=False, tie_word_embeddings=False),
    # Qwen/Qwen3-8B
    "qwen3-8b": dict(
        model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, attention_bias=False, tie_word_embeddings=False,
        use_sliding_window=False, sliding_window=None, max_window_layers=36),
    # Qwen/Qwen3-0.6B (tied embeddings)
    "qwen3-0.6b": dict(
        model_type="qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        max_position_embeddings=40960, tie_word_embeddings=True),
    # Qwen/Qwen3-30B-A3B
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
        moe_intermediate_size=768, num_hidden_layers=48, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
        decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936,
        max_position_embeddings=40960, tie_word_embeddings=False),
    # Qwen/Qwen1.5-MoE-A2.7B
    "qwen1.5-moe-a2.7b": dict(
        model_type="qwen2_moe", hidden_size=2048, intermediate_size=5632,
        moe_intermediate_size=1408, shared_expert_intermediate_size=5632, num_hidden_layers=24,
        num_attention_heads=16, num_key_value_heads=16, num_experts=60, num_experts_per_tok=4,
        decoder_sparse_step=1, vocab_size=151936, max_position_embeddings=8192,
        tie_word_embeddings=False),
    # google/gemma-7b
    "gemma-7b": dict(
        model_type="gemma", hidden_size=3072, intermediate_size=24576, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=16, head_dim=256, vocab_size=256000,
        max_position_embeddings=8192, hidden_act="gelu"),
    # google/gemma-2-9b
    "gemma-2-9b": dict(
        model_type="gemma2", hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
        num_attention_heads=16, num_key_value_heads=8, head_dim=256, vocab_size=256000,
        max_position_embeddings=8192, sliding_window=4096, query_pre_attn_scalar=256,
        hidden_activation="gelu_pytorch_tanh"),
    # google/gemma-3-27b-it: the multimodal config; its language model is text_config
    "gemma-3-27b": dict(
        model_type="gemma3", text_config=dict(
            model_type="gemma3_text", hidden_size=5376, intermediate_size=21504,
            num_hidden_layers=62, num_attention_heads=32, num_key_value_heads=16, head_dim=128,
            query_pre_attn_scalar=168, sliding_window=1024)),
    # google/gemma-3-1b-pt (text only)
    "gemma-3-1b": dict(
        model_type="gemma3_text", hidden_size=1152, intermediate_size=6912,
        num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
        vocab_size=262144, sliding_window=512, sliding_window_pattern=6,
        max_position_embeddings=32768),
    # openai/gpt-oss-20b
    "gpt-oss-20b": dict(
        model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
        num_experts_per_tok=4, vocab_size=201088, sliding_window=128,
        max_position_embeddings=131072, attention_bias=True, tie_word_embeddings=False,
        layer_types=["sliding_attention", "full_attention"] * 12),
    # microsoft/phi-2
    "phi-2": dict(
        model_type="phi", hidden_size=2560, intermediate_size=10240, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, vocab_size=51200,
        partial_rotary_factor=0.4, max_position_embeddings=2048, hidden_act="gelu_new",
        qk_layernorm=False, tie_word_embeddings=False),
    # microsoft/Phi-3-mini-4k-instruct
    "phi-3-mini": dict(
        model_type="phi3", hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, vocab_size=32064,
        max_position_embeddings=4096, sliding_window=2047, tie_word_embeddings=False),
    # allenai/OLMo-2-1124-7B
    "olmo2-7b": dict(
        model_type="olmo2", hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, vocab_size=100352,
        max_position_embeddings=4096, attention_bias=False, tie_word_embeddings=False),
    # bigcode/starcoder2-15b
    "starcoder2-15b": dict(
        model_type="starcoder2", hidden_size=6144, intermediate_size=24576,
        num_hidden_layers=40, num_attention_heads=48, num_key_value_heads=4, vocab_size=49152,
        max_position_embeddings=16384, sliding_window=4096, use_bias=True,
        hidden_act="gelu_pytorch_tanh"),
    # bigcode/starcoderbase (GPT-BigCode, multi-query)
    "starcoderbase": dict(
        model_type="gpt_bigcode", n_embd=6144, n_inner=24576, n_layer=40, n_head=48,
        n_positions=8192, vocab_size=49152, multi_query=True,
        activation_function="gelu_pytorch_tanh"),
    # tiiuae/falcon-7b
    "falcon-7b": dict(
        model_type="falcon", hidden_size=4544, num_hidden_layers=32, num_attention_heads=71,
        vocab_size=65024, multi_query=True, parallel_attn=True, bias=False, alibi=False,
        new_decoder_architecture=False),
    # tiiuae/falcon-40b
    "falcon-40b": dict(
        model_type="falcon", hidden_size=8192, num_hidden_layers=60, num_attention_heads=128,
        num_kv_heads=8, vocab_size=65024, new_decoder_architecture=True, parallel_attn=True,
        bias=False, alibi=False),
    # facebook/opt-125m
    "opt-125m": dict(
        model_type="opt", hidden_size=768, ffn_dim=3072, num_hidden_layers=12,
        num_attention_heads=12, vocab_size=50272, max_position_embeddings=2048,
        word_embed_proj_dim=768, do_layer_norm_before=True, enable_bias=True),
    # facebook/opt-350m: project_in/out of 512 and norms after the blocks
    "opt-350m": dict(
        model_type="opt", hidden_size=1024, ffn_dim=4096, num_hidden_layers=24,
        num_attention_heads=16, vocab_size=50272, max_position_embeddings=2048,
        word_embed_proj_dim=512, do_layer_norm_before=False),
    # bigscience/bloom-560m
    "bloom-560m": dict(model_type="bloom", hidden_size=1024, n_layer=24, n_head=16,
                       vocab_size=250880),
    # stabilityai/stablelm-2-1_6b
    "stablelm-2-1.6b": dict(
        model_type="stablelm", hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
        num_attention_heads=32, num_key_value_heads=32, vocab_size=100352,
        partial_rotary_factor=0.25, use_qkv_bias=True, qk_layernorm=False,
        use_parallel_residual=False, max_position_embeddings=4096, tie_word_embeddings=False),
    # stabilityai/stablelm-2-12b: per-head q/k LayerNorms and a parallel block
    "stablelm-2-12b": dict(
        model_type="stablelm", hidden_size=5120, intermediate_size=13824, num_hidden_layers=40,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=100352,
        partial_rotary_factor=0.25, use_qkv_bias=False, qk_layernorm=True,
        use_parallel_residual=True, max_position_embeddings=4096, tie_word_embeddings=False),
    # ibm-granite/granite-3.0-8b-base
    "granite-3.0-8b": dict(
        model_type="granite", hidden_size=4096, intermediate_size=12800, num_hidden_layers=40,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=49155,
        max_position_embeddings=4096, attention_bias=False, mlp_bias=False,
        tie_word_embeddings=True, embedding_multiplier=12.0, residual_multiplier=0.22,
        attention_multiplier=0.0078125, logits_scaling=16.0),
    # CohereForAI/c4ai-command-r-v01
    "command-r": dict(
        model_type="cohere", hidden_size=8192, intermediate_size=22528, num_hidden_layers=40,
        num_attention_heads=64, num_key_value_heads=64, vocab_size=256000,
        max_position_embeddings=8192, use_qk_norm=False, logit_scale=0.0625,
        tie_word_embeddings=True),
    # meta-llama/Llama-3.1-8B
    "llama3.1-8b": dict(
        model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        max_position_embeddings=131072, tie_word_embeddings=False),
    # meta-llama/Llama-3.1-70B
    "llama3.1-70b": dict(
        model_type="llama", hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
        max_position_embeddings=131072, tie_word_embeddings=False),
    # meta-llama/Llama-3.1-405B
    "llama3.1-405b": dict(
        model_type="llama", hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
        num_attention_heads=128, num_key_value_heads=8, vocab_size=128256,
        max_position_embeddings=131072, tie_word_embeddings=False),
    # mistralai/Mistral-7B-v0.1
    "mistral-7b-v0.1": dict(
        model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
        max_position_embeddings=32768, sliding_window=4096, tie_word_embeddings=False),
}
