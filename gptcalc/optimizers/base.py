"""The interface every optimizer answers (`Optimizer`) and the registry of them.

An optimizer is one module of this package defining a subclass of `Optimizer` and calling
`register` on an instance; the package imports every module it holds, so the set-up's
`--optimizer` choices, the states, the step's temporaries and the allocator replay see it at
once. Nothing outside this package tests an optimizer's name. Every function is pure and
never imports torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, ClassVar, Iterable, Protocol

from ..errors import one_of


class Tensor(Protocol):
    """A parameter tensor as the optimizer sees it (`inventory.ParamTensor`)."""

    place: str
    role: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class StepView:
    """What one device's optimizer step sees: the parameter dtype it updates and the tensors
    it steps. The sizes are callables: each is computed only when an optimizer asks."""

    device: str  # "cpu" or "cuda"
    param_bytes: int  # bytes per element of the weights the optimizer updates
    stepped: int  # elements the device's optimizer steps (its ZeRO partition when sharded)
    largest_stepped: Callable[[], int]  # elements of the largest tensor it steps
    largest_param: Callable[[], int]  # elements of the largest parameter tensor the device holds
    tensors: Callable[[], list]  # the device's parameter tensors (`states.stage_tensors`)
    # the (previous, this) elements of consecutive tensors it steps one at a time, in its order
    # (`states.step_order_pairs`); empty: not known
    pairs: Callable[[], Iterable[tuple[int, int]]] = lambda: ()


class Optimizer:
    """One optimizer's memory: its states per parameter and per tensor, its step's
    temporaries, and what an engine may do with it. Defaults are an elementwise optimizer
    whose `per_param_bytes` a subclass gives."""

    name: ClassVar[str]
    help: ClassVar[str]  # the phrase `--optimizer --help` shows
    # state tensors per parameter tensor (AdamW: exp_avg, exp_avg_sq), allocated one by one in
    # the first step (the allocator replay)
    state_tensors: ClassVar[int] = 1
    # 0-d tensors kept per parameter tensor it updates (AdamW's float32 `step`)
    step_counter_bytes: ClassVar[int] = 0
    # states depend on each tensor's size or shape (not a bytes-per-element figure): an engine
    # that flattens parameters changes them (`tensor_state_bytes` of the flat shape)
    shaped: ClassVar[bool] = False
    # an engine may shard its states over data-parallel ranks (ZeRO, FSDP, a distributed
    # optimizer, tp/pp/ep splits); False: it needs whole matrices (one device or DDP)
    shardable: ClassVar[bool] = True
    # the optimizer that steps the tensors this one does not apply to (`applies_to`), if any
    partner: ClassVar[str | None] = None
    # paged states (bitsandbytes' paged optimizers, cudaMallocManaged): on CUDA, the state
    # buffers of tensors of at least this many elements live in unified memory, outside
    # PyTorch's caching allocator; None: every state is device memory
    paged_min_elements: ClassVar[int | None] = None

    def per_param_bytes(self, mode: str) -> int:
        """State bytes per parameter in `mode` (mode mixed's fp32 master copy included)."""
        raise ValueError(f"{self.name}'s states depend on each tensor's shape")

    def tensor_state_bytes(self, shape: tuple[int, ...], mode: str) -> int:
        """State bytes of one parameter tensor of `shape` (its step counters apart)."""
        return self.per_param_bytes(mode) * math.prod(shape)

    def buffer_bytes(self, shape: tuple[int, ...], mode: str) -> int:
        """Of `tensor_state_bytes`, the optimizer's own state buffers (what a paged optimizer
        pages): all of it but mode mixed's master copy, which the training loop keeps."""
        master = 4 * math.prod(shape) if mode == "mixed" else 0
        return self.tensor_state_bytes(shape, mode) - master

    def fixed_bytes(self, sizes: list[int]) -> int:
        """Bytes the optimizer keeps once, whatever its tensors (tensors of `sizes`)."""
        return 0

    def applies_to(self, tensor: Tensor) -> bool:
        """Whether this optimizer steps `tensor` (else its `partner` does)."""
        return True

    def update_temporaries(self, n: int, device: str, param_bytes: int) -> int:
        """Bytes its update of one tensor of `n` elements allocates beside the states (a
        parameter stepping alone: the optimizer in backward). Default: in place, none."""
        return 0

    def step_temporaries(self, step: StepView) -> int:
        """Bytes its step over the device's tensors allocates beside the states. Default: one
        tensor at a time, the largest it steps (`update_temporaries`)."""
        return self.update_temporaries(step.largest_stepped(), step.device, step.param_bytes)


_REGISTRY: dict[str, Optimizer] = {}
_GENERATION = [0]
# the optimizer most training runs use: first among the names, the set-up's default
DEFAULT = "adamw"


def register(optimizer: Optimizer) -> Optimizer:
    """Make `optimizer` known by its name; a name taken twice raises."""
    if optimizer.name in _REGISTRY:
        raise ValueError(f"an optimizer named {optimizer.name!r} is registered already")
    _REGISTRY[optimizer.name] = optimizer
    _GENERATION[0] += 1
    return optimizer


def unregister(name: str) -> None:
    """Forget the optimizer `name` (tests that register one of their own)."""
    _REGISTRY.pop(name, None)
    _GENERATION[0] += 1


def generation() -> int:
    """How many times the registry has changed (caches of optimizer answers key on it)."""
    return _GENERATION[0]


def names() -> tuple[str, ...]:
    """Every registered optimizer's name, the default first, then in registration order."""
    return tuple(sorted(_REGISTRY, key=lambda n: n != DEFAULT))


def describe() -> str:
    """Every optimizer with its `help`, for `--optimizer --help`."""
    return ", ".join(f"{n} ({_REGISTRY[n].help})" for n in names()) + "."


def optimizer_named(name: str) -> Optimizer:
    """The optimizer `name`; an unknown name is ConfigError("optimizer")."""
    return _REGISTRY[one_of("optimizer", name, names())]


__all__ = ["DEFAULT", "Optimizer", "StepView", "Tensor", "describe", "generation",
           "names", "optimizer_named", "register", "unregister"]
