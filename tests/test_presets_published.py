"""The presets of the models shipped recipes train, against their published config.json: the
parameter count of transformers' model built from that config on the meta device (exact), and
gptcalc's reading of the same config.json (sizes, attention pattern)."""

from __future__ import annotations

import pytest

from gptcalc import config_from_hf, count_params, from_name
from gptcalc.layers import sliding_layers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
transformers.utils.logging.set_verbosity_error()


def _llama(**kw):
    return dict(model_type="llama", hidden_act="silu", rms_norm_eps=1e-5, **kw)


def _qwen2(**kw):
    return dict(model_type="qwen2", hidden_act="silu", rms_norm_eps=1e-6, **kw)


def _qwen3(**kw):
    return dict(model_type="qwen3", head_dim=128, max_position_embeddings=40960,
                vocab_size=151936, rms_norm_eps=1e-6, **kw)


# The fields of each released config.json that change a count or the attention pattern
# (huggingface.co/<repo>/config.json; the Qwen3 dense sizes also in torchtitan's qwen3_args at
# e347b1e5, the Llama 3.2, Qwen2.5, Phi-4 and Gemma 2 2B sizes in torchtune's model builders)
PUBLISHED = {
    # meta-llama/Llama-3.2-1B
    "llama3.2-1b": _llama(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                          num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                          vocab_size=128256, max_position_embeddings=131072,
                          tie_word_embeddings=True),
    # meta-llama/Llama-3.2-3B
    "llama3.2-3b": _llama(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                          num_attention_heads=24, num_key_value_heads=8, head_dim=128,
                          vocab_size=128256, max_position_embeddings=131072,
                          tie_word_embeddings=True),
    # meta-llama/Llama-3.3-70B-Instruct
    "llama3.3-70b": _llama(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                           num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                           max_position_embeddings=131072, tie_word_embeddings=False),
    # Qwen/Qwen2.5-0.5B, -1.5B, -3B, -7B, -14B, -32B, -72B
    "qwen2.5-0.5b": _qwen2(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                           num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                           max_position_embeddings=32768, tie_word_embeddings=True),
    "qwen2.5-1.5b": _qwen2(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                           num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                           max_position_embeddings=131072, tie_word_embeddings=True),
    "qwen2.5-3b": _qwen2(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                         num_attention_heads=16, num_key_value_heads=2, vocab_size=151936,
                         max_position_embeddings=32768, tie_word_embeddings=True),
    "qwen2.5-7b": _qwen2(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                         num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                         max_position_embeddings=131072, tie_word_embeddings=False),
    "qwen2.5-14b": _qwen2(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                          num_attention_heads=40, num_key_value_heads=8, vocab_size=152064,
                          max_position_embeddings=131072, tie_word_embeddings=False),
    "qwen2.5-32b": _qwen2(hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                          num_attention_heads=40, num_key_value_heads=8, vocab_size=152064,
                          max_position_embeddings=131072, tie_word_embeddings=False),
    "qwen2.5-72b": _qwen2(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                          num_attention_heads=64, num_key_value_heads=8, vocab_size=152064,
                          max_position_embeddings=131072, tie_word_embeddings=False),
    # Qwen/Qwen3-0.6B, -1.7B, -4B, -14B, -32B
    "qwen3-0.6b": _qwen3(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                         num_attention_heads=16, num_key_value_heads=8,
                         tie_word_embeddings=True),
    "qwen3-1.7b": _qwen3(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                         num_attention_heads=16, num_key_value_heads=8,
                         tie_word_embeddings=True),
    "qwen3-4b": _qwen3(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                       num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
    "qwen3-14b": _qwen3(hidden_size=5120, intermediate_size=17408, num_hidden_layers=40,
                        num_attention_heads=40, num_key_value_heads=8,
                        tie_word_embeddings=False),
    "qwen3-32b": _qwen3(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
                        num_attention_heads=64, num_key_value_heads=8,
                        tie_word_embeddings=False),
    # microsoft/phi-4
    "phi-4": dict(model_type="phi3", hidden_size=5120, intermediate_size=17920,
                  num_hidden_layers=40, num_attention_heads=40, num_key_value_heads=10,
                  vocab_size=100352, max_position_embeddings=16384, sliding_window=None,
                  tie_word_embeddings=False, pad_token_id=100349),
    # google/gemma-2-2b
    "gemma-2-2b": dict(model_type="gemma2", hidden_size=2304, intermediate_size=9216,
                       num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
                       head_dim=256, vocab_size=256000, max_position_embeddings=8192,
                       sliding_window=4096),
    # google/gemma-3-1b-it
    "gemma-3-1b": dict(model_type="gemma3_text", hidden_size=1152, intermediate_size=6912,
                       num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1,
                       head_dim=256, vocab_size=262144, max_position_embeddings=32768,
                       sliding_window=512, sliding_window_pattern=6),
    # HuggingFaceTB/SmolLM2-1.7B
    "smollm2-1.7b": _llama(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                           num_attention_heads=32, num_key_value_heads=32, vocab_size=49152,
                           max_position_embeddings=8192, tie_word_embeddings=True),
}


def _transformers_count(raw: dict) -> int:
    fields = dict(raw)
    cfg = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    return sum(p.numel() for p in model.parameters())  # a tied weight once


@pytest.mark.parametrize("name", PUBLISHED)
def test_preset_counts_what_transformers_builds_from_the_published_config(name):
    assert count_params(from_name(name)).total == _transformers_count(PUBLISHED[name])


@pytest.mark.parametrize("name", PUBLISHED)
def test_preset_is_its_published_config(name):
    ours, hf = from_name(name), config_from_hf(PUBLISHED[name])
    assert count_params(ours) == count_params(hf)
    assert sliding_layers(ours) == sliding_layers(hf)
    assert (ours.n_layer, ours.n_embd, ours.n_head, ours.n_kv_head, ours.vocab_size) \
        == (hf.n_layer, hf.n_embd, hf.n_head, hf.n_kv_head, hf.vocab_size)


def test_model_cards_round_figures():
    # the sizes the model cards print: Qwen2.5-0.5B "0.49B", Qwen2.5-7B "7.61B", Qwen3-0.6B
    # "0.6B", Llama 3.2 1B "1.23B", Llama 3.2 3B "3.21B"
    for name, billions, digits in [("qwen2.5-0.5b", 0.49, 2), ("qwen2.5-7b", 7.61, 2),
                                   ("qwen3-0.6b", 0.6, 1), ("llama3.2-1b", 1.23, 2),
                                   ("llama3.2-3b", 3.21, 2)]:
        # a card's figure is cut or rounded to its digits: within one unit of the last
        assert abs(count_params(from_name(name)).total / 1e9 - billions) < 10 ** -digits, name
