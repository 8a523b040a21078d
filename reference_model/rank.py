"""One rank of a distributed run, before its engine: the model and batch it trains, the base
class an engine's runner extends (`_Engine`: build, step, tracker, states), and the storage
accounting every runner shares (`storage_bytes`, `LiveSaved`).

It sits below `distributed` (which launches the ranks and picks a runner per engine) and
`deepspeed_twin` (the DeepSpeed runner), so that both extend the same base without importing
each other.
"""

from __future__ import annotations

import contextlib
import weakref

import torch

from gptcalc.config import GPTConfig
from gptcalc.training_setup import TrainingSetup


def coords_of(rank: int, setup: TrainingSetup) -> dict[str, int]:
    """A rank's place in the (pp, dp, tp) mesh, tp fastest."""
    return {"pp": rank // (setup.dp * setup.tp), "dp": rank // setup.tp % setup.dp,
            "tp": rank % setup.tp}


class _Model:
    """The model of one implementation: its blocks, embedding and head, and its loss."""

    def __init__(self, cfg: GPTConfig, impl: str, attn: str) -> None:
        self.impl = impl
        if impl == "transformers":
            from .transformers_twin import build, hf_config_for

            self.module = build(hf_config_for(cfg), "eager" if attn == "manual" else "sdpa")
            self.blocks = self.module.model.layers
        else:
            from .model import build_model

            self.module = build_model(cfg, attn).train()
            self.blocks = self.module.transformer.h

    def loss(self, idx: torch.Tensor, targets: torch.Tensor):
        """(output to hold through backward, loss)."""
        if self.impl == "transformers":
            out = self.module(input_ids=idx, labels=targets)
            return out, out.loss
        out = self.module(idx, targets)
        return out, out[1]


def _batch(cfg: GPTConfig, rows: int, seq: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, cfg.vocab_size, (rows, seq), generator=g)
    return idx, torch.randint(0, cfg.vocab_size, (rows, seq), generator=g)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def _storage_key(t: torch.Tensor) -> int:
    return _local(t).untyped_storage()._cdata


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (DTensors: their local shards)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor):
            loc = _local(t)
            seen.setdefault(_storage_key(loc), loc.untyped_storage().nbytes())
    return sum(seen.values())


class LiveSaved:
    """The peak of live saved-for-backward bytes: every tensor autograd saves is held in a
    small box until autograd drops it (after its node's backward); boxes are counted by
    storage, parameters (and FSDP2's unsharded parameters) and buffers excluded."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.live, self.refs, self.peak = model, 0, {}, 0

    def _params(self) -> set[int]:
        return {_storage_key(p) for p in (*self.model.parameters(), *self.model.buffers())}

    def pack(self, t: torch.Tensor):
        box = _Box(t)
        loc = _local(t)
        key = loc.untyped_storage()._cdata
        if loc.untyped_storage().nbytes() and key not in self._params():
            if key not in self.refs:
                self.refs[key] = [0, loc.untyped_storage().nbytes()]
                self.live += self.refs[key][1]
                self.peak = max(self.peak, self.live)
            self.refs[key][0] += 1
            weakref.finalize(box, self._drop, key)
        return box

    def _drop(self, key: int) -> None:
        ref = self.refs[key]
        ref[0] -= 1
        if ref[0] == 0:
            self.live -= ref[1]
            del self.refs[key]

    @staticmethod
    def unpack(box):
        return box.t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class _Box:
    __slots__ = ("t", "__weakref__")

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class _Engine:
    """One rank's model, optimizer and step under an engine."""

    def __init__(self, cfg, wl, setup, impl, rank, world) -> None:
        self.cfg, self.wl, self.setup, self.rank, self.world = cfg, wl, setup, rank, world
        self.coords = coords_of(rank, setup)
        self.model = _Model(cfg, impl, setup.attn_impl)
        if setup.lora_rank:  # PEFT-shaped adapters on a frozen base (reference model)
            from gptcalc.lora import covered

            from .lora import apply_lora

            apply_lora(self.model.module, setup.lora_rank,
                       tuple(covered(cfg, setup.lora_targets)))
        self.idx, self.targets = _batch(cfg, wl.batch_size, wl.seq_len,
                                        seed=1000 + self.coords["dp"])

    @property
    def tracked_module(self) -> torch.nn.Module:
        return self.model.module

    def optimizer(self, params):
        from .memory import _torch_optimizer

        # the parameters that train (all of them, or LoRA's adapters), as trainers pass them
        return _torch_optimizer([p for p in params if p.requires_grad], self.setup)

    def tracker(self):
        from .memory import _global_peak_tracker

        t = _global_peak_tracker()
        t.track_external(self.tracked_module, self.opt)
        return t

    def context(self):
        return contextlib.nullcontext()

    def step(self, live: LiveSaved | None = None, flops: bool = False) -> None:
        self.opt.zero_grad(set_to_none=True)
        with live.hooks() if live else contextlib.nullcontext(), self.context():
            out, loss = self.model.loss(self.idx, self.targets)
            if not self.setup.keep_logits:
                out = None  # the loop drops the logits before backward (the Trainer's)
            loss.backward()
        del out, loss
        self.after_backward()
        if not flops:
            self.opt.step()
        else:
            self.opt.zero_grad(set_to_none=True)

    def after_backward(self) -> None:
        pass

    def opt_state(self):
        return [v for s in self.opt.state.values() for v in s.values()]

    def states(self) -> tuple[int, int, int]:
        params = list(self.tracked_module.parameters())
        return (storage_bytes(params), storage_bytes(p.grad for p in params),
                storage_bytes(self.opt_state()))
