"""The memory measurements of `reference_model.memory`, on litgpt's own model and training loop.

litgpt (Lightning-AI/litgpt) builds its models from one `GPT` class (litgpt/model.py) and
fine-tunes them with litgpt/finetune/full.py. This module builds that `GPT` from a `GPTConfig`
(the Llama family as litgpt writes it: fused `qkv`, RMSNorm, LLaMAMLP, rotary, grouped-query
through `repeat_interleave`), with random weights, and measures what it holds:

- `measure_saved`: every storage autograd saves in one training forward and litgpt's loss,
  `logits = model(input_ids)` then `chunked_cross_entropy(logits[..., :-1, :], targets[...,
  1:])` (litgpt/utils.py, chunk_size 128), through the reference model's capture
  (`reference_model.memory.saved_during`: saved_tensors_hooks, deduplicated by storage,
  parameters and buffers excluded).
- `measure_step_peak`: the peak live tensor bytes of one steady-state iteration of full.py's
  loop after a warm-up iteration (MemTracker, `transformers_twin`'s phase tracker): the
  `logits` and `loss` names of the loop hold the previous iteration's tensors until the new
  ones are bound, through the next forward; `fabric.backward(loss / accum)`; then
  `optimizer.step()` and `optimizer.zero_grad()` (set_to_none), with the logits still bound.

"bf16-true" (litgpt's default precision) is the model in bfloat16: weights, gradients and the
AdamW states bf16, no autocast; "32-true" is fp32.

litgpt is optional and is found as an installed package or in the directory the LITGPT_PATH
environment variable names (one holding the `litgpt` package). Its package `__init__` imports
lightning, which this module does not need: the package is loaded as a namespace (its
`__init__` skipped), the checkpoint converter it imports for legacy state dicts is stubbed,
and `chunked_cross_entropy` is compiled from litgpt/utils.py's own source (that module imports
lightning at its top). `import_litgpt` raises ImportError where litgpt cannot be found.
"""

from __future__ import annotations

import ast
import gc
import importlib.util
import os
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gptcalc.config import GPTConfig
from gptcalc.memory.profile_litgpt import check_litgpt_config

from .memory import SavedReport, saved_during
from .transformers_twin import _phase_tracker_class

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}  # bf16-true, 32-true


@dataclass(frozen=True)
class Litgpt:
    """litgpt's model class, its Config and its loss, as imported by `import_litgpt`."""

    GPT: type
    Config: type
    chunked_cross_entropy: object
    version: str


def _package_dir() -> Path | None:
    roots = [os.environ["LITGPT_PATH"]] if os.environ.get("LITGPT_PATH") else []
    spec = importlib.util.find_spec("litgpt") if "litgpt" not in sys.modules else None
    if spec is not None and spec.submodule_search_locations:
        roots += [str(Path(p).parent) for p in spec.submodule_search_locations]
    for root in roots:
        if (Path(root) / "litgpt" / "model.py").is_file():
            return Path(root) / "litgpt"
    loaded = sys.modules.get("litgpt")
    if loaded is not None and getattr(loaded, "__path__", None):
        return Path(list(loaded.__path__)[0])
    return None


def import_litgpt() -> Litgpt:
    """litgpt's GPT, Config and chunked_cross_entropy without lightning (module docstring)."""
    pkg_dir = _package_dir()
    if pkg_dir is None:
        raise ImportError("litgpt not found (install it or set LITGPT_PATH)")
    if "litgpt" not in sys.modules:
        pkg = types.ModuleType("litgpt")
        pkg.__path__ = [str(pkg_dir)]
        sys.modules["litgpt"] = pkg
    converter = "litgpt.scripts.convert_hf_checkpoint"
    if converter not in sys.modules:  # needed only to load legacy checkpoints
        stub = types.ModuleType(converter)
        stub.qkv_reassemble = None
        sys.modules[converter] = stub
    from litgpt.config import Config
    from litgpt.model import GPT

    source = (pkg_dir / "utils.py").read_text()
    fn = next(n for n in ast.parse(source).body
              if isinstance(n, ast.FunctionDef) and n.name == "chunked_cross_entropy")
    namespace = {"torch": torch}
    exec(compile(ast.Module([fn], []), str(pkg_dir / "utils.py"), "exec"), namespace)
    version = "unknown"
    for info in pkg_dir.parent.glob("litgpt-*.dist-info"):
        version = info.name[len("litgpt-"):-len(".dist-info")]
    return Litgpt(GPT, Config, namespace["chunked_cross_entropy"], version)


def litgpt_config(cfg: GPTConfig):
    """litgpt's Config for `cfg` (a Llama-family block: `check_litgpt_config`): n_query_groups
    the key/value heads, the vocabulary unpadded (padded_vocab_size = vocab_size)."""
    check_litgpt_config(cfg)
    lit = import_litgpt()
    return lit.Config(
        name="gptcalc-twin", block_size=cfg.block_size, vocab_size=cfg.vocab_size,
        padded_vocab_size=cfg.vocab_size, n_layer=cfg.n_layer, n_embd=cfg.n_embd,
        n_head=cfg.n_head, n_query_groups=cfg.kv_heads, head_size=cfg.head_size,
        intermediate_size=cfg.ffn_dim, rotary_percentage=cfg.rotary_pct,
        parallel_residual=False, bias=cfg.mlp_bias, attn_bias=cfg.qkv_bias,
        norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP", lm_head_bias=cfg.lm_head_bias)


def build(cfg: GPTConfig, dtype: str = "bf16") -> torch.nn.Module:
    """litgpt's GPT for `cfg` with random weights (seed 0) in `dtype` (module docstring), in
    train mode on CPU."""
    lit = import_litgpt()
    torch.manual_seed(0)
    model = lit.GPT(litgpt_config(cfg))
    model.apply(model._init_weights)
    return model.to(DTYPES[dtype]).train()


def make_batch(vocab_size: int, batch_size: int, seq_len: int, seed: int = 0
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and labels, two int64 tensors of (b, S), as litgpt's SFT collate makes."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, vocab_size, (batch_size, seq_len), generator=g)
    return idx, torch.randint(0, vocab_size, (batch_size, seq_len), generator=g)


def measure_saved(model: torch.nn.Module, idx: torch.Tensor, targets: torch.Tensor
                  ) -> SavedReport:
    """Saved-activation bytes of `logits = model(idx)` and litgpt's loss, as full.py runs them."""
    loss_fn = import_litgpt().chunked_cross_entropy

    def run():
        logits = model(idx)
        return {"loss": loss_fn(logits[..., :-1, :], targets[..., 1:]), "logits": logits}

    report, out = saved_during(model, run)
    del out
    return report


@dataclass(frozen=True)
class StepMoments:
    """Live tensor bytes (MemTracker's total) through one iteration of full.py's loop."""

    peak_bytes: int
    peak_phase: str  # forward | loss | backward | optimizer
    phase_peaks: dict[str, int] = field(default_factory=dict)


class FullFinetuneLoop:
    """litgpt/finetune/full.py's iteration on one device (no gradient accumulation unless
    `accum`): the loop's `logits` and `loss` stay bound from one iteration to the next."""

    def __init__(self, model: torch.nn.Module, accum: int = 1) -> None:
        self.model = model
        self.loss_fn = import_litgpt().chunked_cross_entropy
        # litgpt's default optimizer: torch's AdamW (instantiate_torch_optimizer), defaults
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5, weight_decay=0.02)
        self.accum = accum
        self.logits = self.loss = None

    def iteration(self, idx: torch.Tensor, targets: torch.Tensor, tracker=None) -> None:
        def phase(name: str) -> None:
            if tracker is not None:
                tracker.phase = name
        phase("forward")
        self.logits = self.model(idx)
        phase("loss")
        self.loss = self.loss_fn(self.logits[..., :-1, :], targets[..., 1:])
        phase("backward")
        (self.loss / self.accum).backward()  # fabric.backward(loss / accum)
        phase("optimizer")
        self.optimizer.step()
        self.optimizer.zero_grad()
        phase("done")


def measure_step_peak(model: torch.nn.Module, idx: torch.Tensor, targets: torch.Tensor
                      ) -> StepMoments:
    """Peak live tensor bytes of one steady-state iteration of `FullFinetuneLoop` (after a
    warm-up iteration that makes the AdamW states and binds the loop's logits), CPU."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY

    # fit() sets the longest sequence as max_seq_length, which rebuilds the rope cache
    model.max_seq_length = idx.size(1)
    loop = FullFinetuneLoop(model)
    loop.iteration(idx, targets)
    tracker = _phase_tracker_class()()
    tracker.track_external(model, loop.optimizer)
    gc.collect()
    with tracker:
        loop.iteration(idx, targets, tracker)
    snap = next(iter(tracker.get_tracker_snapshot("peak").values()))
    return StepMoments(peak_bytes=snap[_TOTAL_KEY], peak_phase=tracker.peak_phase,
                       phase_peaks=dict(tracker.phase_peaks))


__all__ = ["DTYPES", "FullFinetuneLoop", "Litgpt", "StepMoments", "build", "import_litgpt",
           "litgpt_config", "make_batch", "measure_saved", "measure_step_peak"]
