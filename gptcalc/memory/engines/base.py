"""The engine interface and its registry.

A training engine is one module of this package that defines a subclass of `Engine` and
registers one instance with `register`. The package imports every module it holds, so a new
engine is its module and its tests: the step peak (`gptcalc.memory.peak`), the training set-up
and the command line ask the registry (`engine_for`, `names`) and never name an engine.

An engine answers a fixed set of questions about a `TrainingSetup`; the defaults here are a
data-parallel engine that replicates every state (one device, DistributedDataParallel):

- `check`: the set-ups it runs (its ZeRO stages, precisions, optimizers), else ConfigError;
- `label`, `mixed_precision`, `assumptions`: its words on the first line of a command;
- `replicated`, `rank_states`, `peak_rank`: the states one rank holds, and the most loaded rank;
- `finetune_states`, `finetune_resident`: LoRA's states (a frozen base, trainable adapters) on
  the most loaded rank, and what it keeps between steps;
- `resident`: what a rank keeps between optimizer steps;
- `optimizer_sharded`, `master_gradient_bytes`, `largest_optimizer_tensor`,
  `optimizer_step_pairs`,
  `head_gradient_sharded`: how the step's own terms (the optimizer's temporaries, the head's
  gradient) depend on its layout;
- `adjust`: its own terms at each moment of the step peak, added to or replacing the step's
  terms in the ledger (`gptcalc.memory.ledger`).

Every function here is pure and never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar, Mapping

from ...config import GPTConfig
from ...schedules import Stage
from ...errors import ConfigError, one_of
from ...training_setup import TrainingSetup
from ...workload import Workload
from ..ledger import Ledger, Term
from ..states import largest_tensor, step_order_pairs
from .shards import RankStates, first_rank, tp_rank_states


@dataclass(frozen=True)
class Step:
    """What an engine's `adjust` reads of the step on one device of pipeline stage `stage`:
    the logits' and the stage's gradient bytes, and `forward_tensors`, the terms alive when
    the forward's tensors are (weights, optimizer states, overhead, saved activations, logits,
    accumulating gradients) from which an engine's own moment starts."""

    cfg: GPTConfig
    workload: Workload
    setup: TrainingSetup
    stage: Stage
    logits: int
    gradients: int
    forward_tensors: Mapping[Term, int]


class Engine:
    """A training engine: what it holds per rank and at each moment of a step. Subclasses set
    the class attributes and override the methods whose default does not hold for them."""

    name: ClassVar[str]
    help: ClassVar[str]  # one phrase for --engine's help
    stages: ClassVar[tuple[int, ...]]  # the ZeRO stages it runs
    default_for: ClassVar[tuple[int, ...]] = ()  # the stages it is the default engine of
    mixed_by_default: ClassVar[bool] = False  # trained in its own mixed precision by default
    # runs torch's context parallel ring with its data-parallel group the dp x cp mesh
    context_parallel: ClassVar[bool] = True
    # its own implementation profile (--impl), the default under it; None: the family's
    default_impl: ClassVar[str | None] = None
    # whether its training loop holds the logits through backward (with its default_impl)
    loop_keeps_logits: ClassVar[bool] = True
    # its pipeline stages are torch.distributed.pipelining's, with their receive buffers
    # (`engines.pipeline.receive_buffers`); False: the engine runs its own schedule
    torch_pipelining: ClassVar[bool] = True
    # the CUDA stream its gradients are allocated on when not the compute stream (their cached
    # blocks are then a pool of their own: `allocator.DeviceAllocator`); None: the compute one
    gradient_stream: ClassVar[str | None] = None
    # the CUDA stream its all-gather buffers are allocated on, and the ledger's terms that are
    # such buffers (`gather_buffers`); None: none of its own
    gather_stream: ClassVar[str | None] = None
    gather_terms: ClassVar[frozenset] = frozenset()

    def gather_buffers(self, cfg: GPTConfig, setup: TrainingSetup, stage: Stage
                       ) -> dict[str, tuple[int, int]]:
        """Per group, the bytes each of its all-gathers allocates on `gather_stream`, in order
        (the copy-in's cast, the output); none when the engine gathers nothing."""
        return {}

    def check(self, setup: TrainingSetup) -> None:
        """Raise ConfigError (naming the option) for a set-up the engine does not run."""
        if setup.zero not in self.stages:
            stages = " or ".join(map(str, self.stages))
            raise ConfigError("zero", f"the {self.name} engine runs ZeRO stage {stages}, not "
                                      f"{setup.zero}")

    def label(self, setup: TrainingSetup) -> str:
        """The engine as the first line names it."""
        return self.name

    def mixed_precision(self, setup: TrainingSetup) -> str:
        """What mode mixed means under the engine, in words."""
        return f"mixed ({setup.autocast_dtype} weights and gradients, fp32 master copy)"

    def assumptions(self, setup: TrainingSetup) -> str:
        """Settings of the engine's own the first line appends (`"; ..."`), or ""."""
        return ""

    def replicated(self, setup: TrainingSetup) -> bool:
        """Whether every state is replicated over dp (the engine's own partitioning decides
        nothing): then a rank holds the inventory's tensor-parallel shards in the mode's
        dtypes (`states.zero_bytes_per_param`)."""
        return True

    def rank_states(self, cfg: GPTConfig, setup: TrainingSetup, rank: int) -> RankStates:
        """The states of `rank`: DTensor's tensor-parallel shards (`shards.tp_rank_states`)."""
        return tp_rank_states(cfg, setup, rank)

    def peak_rank(self, cfg: GPTConfig, setup: TrainingSetup, stage: Stage) -> int:
        """The global rank of `stage` holding the most state bytes: its first (the first dp
        rank owns the most rows of every split)."""
        return first_rank(setup, stage)

    def finetune_states(self, cfg: GPTConfig, setup: TrainingSetup) -> dict[str, int]:
        """LoRA's states on the most loaded rank, by line (base/weights, adapter/weights,
        adapter/gradients, adapter/optimizer): ZeRO's flat partitions by default
        (`finetune.finetune_state_bytes`)."""
        from ..finetune import finetune_state_bytes

        return finetune_state_bytes(cfg, setup)

    def finetune_resident(self, cfg: GPTConfig, setup: TrainingSetup) -> dict[str, int]:
        """What the most loaded rank keeps between optimizer steps under LoRA, by line: the
        frozen base with the adapters, and the adapters' optimizer states."""
        lines = self.finetune_states(cfg, setup)
        return {"weights": lines["base/weights"] + lines["adapter/weights"],
                "optimizer states": lines["adapter/optimizer"]}

    def resident(self, cfg: GPTConfig, setup: TrainingSetup, rank: int) -> dict[str, int]:
        """Bytes `rank` keeps between optimizer steps, by line: weights and optimizer states
        (`zero_grad(set_to_none=True)` frees the gradients)."""
        st = self.rank_states(cfg, setup, rank)
        return {"weights": st.weights, "optimizer states": st.optimizer}

    def host(self, cfg: GPTConfig, setup: TrainingSetup, rank: int) -> dict[str, int]:
        """Bytes the host holds for `rank`, by line (offloaded states); none by default."""
        return {}

    def optimizer_sharded(self, setup: TrainingSetup) -> bool:
        """Whether the optimizer steps a 1/dp partition of the parameters (ZeRO-1 and up)."""
        return setup.zero >= 1

    def master_gradient_bytes(self, setup: TrainingSetup, params: int) -> int:
        """Mode mixed: the fp32 gradients of the fp32 master weights, an fp32 copy of every
        16-bit gradient alive for the whole optimizer step, over the rank's 1/dp partition
        from ZeRO-2 on (ZeRO's accounting, Rajbhandari et al. 2020)."""
        if setup.mode != "mixed":
            return 0
        return 4 * (-(-params // setup.dp) if setup.zero >= 2 else params)

    def largest_optimizer_tensor(self, cfg: GPTConfig, setup: TrainingSetup,
                                 params: int) -> int:
        """Elements of the largest tensor the optimizer steps on a rank holding `params`
        parameters: the largest parameter tensor (`states.largest_tensor`)."""
        return largest_tensor(cfg, setup)

    def optimizer_step_pairs(self, cfg: GPTConfig, setup: TrainingSetup, stage: Stage
                             ) -> set[tuple[int, int]]:
        """The (previous, this) elements of consecutive tensors the rank's optimizer steps
        one at a time: its parameters in the model's order (`states.step_order_pairs`)."""
        return step_order_pairs(cfg, setup, stage)

    def head_gradient_sharded(self, setup: TrainingSetup) -> bool:
        """Whether the lm_head's gradient is reduced to a 1/dp partition as backward makes it
        (ZeRO-2 and up)."""
        return setup.zero >= 2

    def pipeline_accumulation(self, cfg: GPTConfig, setup: TrainingSetup, stage: Stage
                              ) -> dict[Term, int] | None:
        """Under a pipeline, what the engine holds across micro-batches once a stage's first
        backward has run, as terms; None: the stage's gradients, as the engine keeps them
        (`engines.pipeline.pipeline_adjust`)."""
        return None

    def adjust(self, ledger: Ledger, step: Step) -> None:
        """Add or replace the engine's own terms at each moment of the step; none by
        default."""


_REGISTRY: dict[str, Engine] = {}
# bumped whenever the registry changes: a key of the caches that hold an engine's answers
_GENERATION = [0]


def generation() -> int:
    """How many times the registry has changed (caches of engine answers key on it)."""
    return _GENERATION[0]


def register(engine: Engine) -> Engine:
    """Make `engine` known by its name; a name or a default stage taken twice raises."""
    if engine.name in _REGISTRY:
        raise ValueError(f"an engine named {engine.name!r} is registered already")
    for other in _REGISTRY.values():
        both = set(other.default_for) & set(engine.default_for)
        if both:
            raise ValueError(f"{engine.name} and {other.name} are both the default for ZeRO "
                             f"stage {min(both)}")
    _REGISTRY[engine.name] = engine
    _GENERATION[0] += 1
    return engine


def unregister(name: str) -> None:
    """Forget the engine `name` (tests that register one of their own)."""
    _REGISTRY.pop(name, None)
    _GENERATION[0] += 1


def names() -> tuple[str, ...]:
    """Every registered engine's name, defaults first."""
    return tuple(sorted(_REGISTRY, key=lambda n: (not _REGISTRY[n].default_for,
                                                  -len(_REGISTRY[n].stages), n)))


def engine_named(name: str) -> Engine:
    """The engine `name`; an unknown name is ConfigError("engine")."""
    return _REGISTRY[one_of("engine", name, names())]


def default_engine(zero: int) -> Engine:
    """The engine most users run ZeRO stage `zero` with (its `default_for`)."""
    for engine in _REGISTRY.values():
        if zero in engine.default_for:
            return engine
    raise ConfigError("zero", f"ZeRO stage must be 0, 1, 2 or 3, got {zero!r}")


def engine_for(setup: TrainingSetup) -> Engine:
    """The engine of a set-up: `setup.engine` when given, else the default of its ZeRO stage;
    checked against the set-up (`Engine.check`). A set-up is frozen: its engine is looked up
    and checked once per registry state (a refused one raises each time)."""
    return _engine_for(setup, generation())


@lru_cache(maxsize=4096)
def _engine_for(setup: TrainingSetup, _generation: int) -> Engine:
    engine = engine_named(setup.engine) if setup.engine else default_engine(setup.zero)
    engine.check(setup)
    return engine


def describe(setup: TrainingSetup) -> str:
    """One line naming every assumption of the set-up, its engine's first."""
    engine = engine_for(setup)
    merged = engine.torch_pipelining  # as `engines.pipeline.merges_outputs` decides
    return (f"engine {engine.label(setup)}, "
            f"{setup.describe(engine.mixed_precision(setup), merged)}"
            f"{engine.assumptions(setup)}")


__all__ = ["Engine", "Step", "default_engine", "describe", "engine_for", "engine_named", "generation", "names",
           "register", "unregister"]
