"""The profile run of a serving engine, measured on a transformers model.

vLLM sizes its KV pool after one forward of max_num_batched_tokens dummy tokens split over
min(max_num_seqs, tokens) sequences, with logits only for the last token of each sequence and
no KV cache yet (vllm/v1/worker/gpu_model_runner.py, `profile_run` and `_dummy_run`). The same
forward here: `model(input_ids, use_cache=False, logits_to_keep=1)` under `torch.no_grad()`, the
model in eval mode with its default attention, `seqs` sequences of `seq_len` tokens.

`measure_profile_peak` reports the peak of live tensor bytes during that forward (PyTorch's
MemTracker, a dispatch mode that sees every allocation and free), less what was live before it
(weights, buffers, the input ids): the activation peak the engine subtracts from its budget.
On CUDA, `measure_profile_peak_cuda` reads the same quantity from the allocator's counters.

torch and transformers are imported here only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch

from .transformers_twin import build


@dataclass(frozen=True)
class ProfilePeak:
    """Live tensor bytes around one profile forward."""

    baseline: int  # before the forward: weights, buffers, input ids
    peak: int  # the forward's peak, baseline included
    seqs: int
    seq_len: int

    @property
    def activation_peak(self) -> int:
        return self.peak - self.baseline


def _inputs(vocab_size: int, seqs: int, seq_len: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (seqs, seq_len), generator=g).to(device)


def _forward(model: torch.nn.Module, idx: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=idx, use_cache=False, logits_to_keep=1).logits


def eval_model(raw_hf_config: Mapping[str, Any], dtype: torch.dtype = torch.bfloat16,
               device: str = "cpu") -> torch.nn.Module:
    """The transformers model of `raw_hf_config` (random weights, offline), eval mode."""
    return build(raw_hf_config, dtype=dtype, device=device).eval()


def measure_profile_peak(model: torch.nn.Module, seqs: int, seq_len: int) -> ProfilePeak:
    """Peak live tensor bytes (MemTracker) of one profile forward on CPU, after a warm-up
    forward (lazily built buffers such as rotary tables exist after it)."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker

    idx = _inputs(model.config.vocab_size, seqs, seq_len, "cpu")
    _forward(model, idx)
    tracker = MemTracker()
    tracker.track_external(model, idx)
    with tracker:
        baseline = sum(s[_TOTAL_KEY] for s in tracker.get_tracker_snapshot().values())
        out = _forward(model, idx)
        del out
    peak = sum(s[_TOTAL_KEY] for s in tracker.get_tracker_snapshot("peak").values())
    return ProfilePeak(baseline, peak, seqs, seq_len)


def measure_profile_peak_cuda(model: torch.nn.Module, seqs: int, seq_len: int) -> ProfilePeak:
    """The same on CUDA, from the caching allocator's unrounded requested bytes."""
    idx = _inputs(model.config.vocab_size, seqs, seq_len, "cuda")
    _forward(model, idx)  # warm-up: cuBLAS workspace and lazily built buffers
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_stats()["requested_bytes.all.current"]
    out = _forward(model, idx)
    torch.cuda.synchronize()
    peak = torch.cuda.memory_stats()["requested_bytes.all.peak"]
    del out
    return ProfilePeak(baseline, peak, seqs, seq_len)


# Small models of each family, built offline from config fields. GPT-2 takes the one-kernel
# tanh GELU (`gelu_pytorch_tanh`, the same function as `gelu_new`), as serving engines run a
# fused GELU: transformers' `gelu_new` is written in Python and holds four F-wide temporaries.
_SMALL = dict(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=32,
              vocab_size=2000, max_position_embeddings=4096)
TWIN_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(model_type="llama", hidden_size=256, intermediate_size=896, **_SMALL),
    "qwen2": dict(model_type="qwen2", hidden_size=256, intermediate_size=896, **_SMALL),
    "mistral": dict(model_type="mistral", hidden_size=256, intermediate_size=768,
                    sliding_window=None, **_SMALL),
    "gemma2": dict(model_type="gemma2", hidden_size=256, intermediate_size=1024,
                   sliding_window=64, **_SMALL),
    "gpt2": dict(model_type="gpt2", n_embd=256, n_layer=2, n_head=8, vocab_size=2000,
                 n_positions=4096, activation_function="gelu_pytorch_tanh"),
}


def twin_row(family: str, tokens: int, seqs: int, device: str = "cpu") -> dict[str, Any]:
    """Predicted (gptcalc.inference.pool.profile_activation_bytes of the config gptcalc reads
    from the same fields) and measured activation peak of one profile forward of `tokens` tokens
    in `seqs` equal sequences, bf16, on `device`."""
    from gptcalc.hf import config_from_hf
    from gptcalc.inference import profile_activation_bytes

    raw = TWIN_CONFIGS[family]
    # the forward alone: the sampler pass has its own twin (reference_model/serve_sampler.py)
    predicted = sum(profile_activation_bytes(config_from_hf(raw), tokens, seqs,
                                             sampler=False).values())
    model = eval_model(raw, device=device)
    measure = measure_profile_peak if device == "cpu" else measure_profile_peak_cuda
    measured = measure(model, seqs, tokens // seqs).activation_peak
    return dict(family=family, tokens=tokens, seqs=seqs, predicted=predicted,
                measured=measured, error=predicted / measured - 1)


def main() -> None:
    """Print the twin table: family, tokens, sequences, predicted, measured, error."""
    import sys

    device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    print(f"{'family':8} {'tokens':>6} {'seqs':>5} {'predicted':>11} {'measured':>11} error")
    for family in TWIN_CONFIGS:
        for tokens, seqs in TWIN_SHAPES:
            r = twin_row(family, tokens, seqs, device)
            print(f"{family:8} {tokens:6} {seqs:5} {r['predicted']:11,} {r['measured']:11,} "
                  f"{r['error']:+.2%}")


# (tokens, sequences) of profile runs: vLLM's default 2,048 tokens of 256 sequences, and 64
TWIN_SHAPES = ((2048, 256), (2048, 64))


__all__ = ["ProfilePeak", "TWIN_CONFIGS", "TWIN_SHAPES", "eval_model", "measure_profile_peak",
           "measure_profile_peak_cuda", "twin_row"]

if __name__ == "__main__":
    main()
