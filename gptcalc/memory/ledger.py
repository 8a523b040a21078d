"""The ledger of one training step: the moments where live memory can peak (`Phase`), the named
terms each moment sums (`Term`), and `Ledger`, which holds them.

The step's own terms are the constants below. An engine (gptcalc.memory.engines) declares its
own terms as `Term` constants in its module and changes a ledger only through `Ledger.add` (a
term the moment does not hold yet) and `Ledger.replace` (a term it holds): a term replaced
where it does not exist, or added twice, raises `LedgerError` instead of silently becoming a
new line. Terms are compared by identity, so a misspelt label cannot stand in for a constant.
`Ledger.labelled` is the one place display labels are made: they are the text output's rows
and the keys of the JSON's `peak_phases` and `breakdown.peak`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Iterable, Mapping


class LedgerError(Exception):
    """A term added twice to a moment, or replaced or read where it does not exist: a defect
    in an engine's code, never the user's input."""


class Phase(Enum):
    """A moment of one training step where live memory can peak; its value is its label."""

    FORWARD_END = "forward end"
    BACKWARD_START = "backward start"
    BACKWARD_LAST_BLOCK = "backward, last block"
    BACKWARD_END = "backward end"
    OPTIMIZER_STEP = "optimizer step"
    # SDPA's decomposed CPU math path on 16-bit inputs, inside the last block's forward
    ATTENTION_CORE = "forward, attention core"
    # FSDP2's own moments: the root's all-gather before the loss's backward (ZeRO-3), and the
    # last block's reduce-scatter copy-in
    ROOT_REGATHER = "backward start, root all-gather"
    FORWARD_GATHER = "forward, last block's all-gather"
    REDUCE_SCATTER = "backward, last block's reduce-scatter"
    # context parallel: the last block's ring attention, in the forward and in the backward
    RING_FORWARD = "forward, last block's ring attention"
    RING_BACKWARD = "backward, last block's ring attention"

    @property
    def label(self) -> str:
        return self.value

    @property
    def why(self) -> str:
        """What is alive at the moment, in words."""
        return _WHY[self]


_WHY = {
    Phase.FORWARD_END: "the forward's end: every saved activation, the logits and the loss's "
                       "fp32 copy of them",
    Phase.BACKWARD_START: "the start of backward: every saved activation and the logits, while "
                          "the cross entropy makes the logits' gradient",
    Phase.BACKWARD_LAST_BLOCK: "the last block's backward: the saved activations beside that "
                               "block's gradients in flight",
    Phase.BACKWARD_END: "the end of backward: every gradient, with the embedding's gradient "
                        "in flight",
    Phase.FORWARD_GATHER: "the last block's all-gather in the forward: its output and the "
                          "unsharded parameters copied out of it, beside the block before "
                          "it's output, which FSDP2 keeps until this all-gather is issued",
    Phase.OPTIMIZER_STEP: "the optimizer step: weights, gradients and optimizer states with "
                          "the update's temporaries (the activations are gone)",
    Phase.ATTENTION_CORE: "the last block's attention core in the forward: SDPA's CPU math path "
                          "holds fp32 copies of 16-bit q, k, v, its score stacks and its output "
                          "beside the saved activations so far",
    Phase.ROOT_REGATHER: "the start of backward under FSDP2 ZeRO-3: the root's parameters "
                         "all-gathered again before the loss's backward (the all-gather output "
                         "beside the unsharded parameters), every saved activation and the "
                         "logits",
    Phase.REDUCE_SCATTER: "the end of the last block's backward under FSDP2: its unsharded "
                          "gradients copied into the reduce-scatter input",
    Phase.RING_FORWARD: "the last block's ring attention in the forward under context "
                        "parallel: every rank's keys and values all-gathered and the partial "
                        "outputs merged in fp32, beside the saved activations so far",
    Phase.RING_BACKWARD: "the last block's ring attention in the backward under context "
                         "parallel: the keys and values all-gathered again, the fp32 gradients "
                         "of q, k and v and the k and v gradients passed around the ring, "
                         "beside the saved activations",
}


# The reference model's op-by-op replay (reference_model/replay.py) walks the whole backward
# pass op by op: its peak there is anywhere in the pass, one span rather than a moment above
BACKWARD_PASS = "backward"

# the moments every step passes through, in order
STEADY_PHASES = (Phase.FORWARD_END, Phase.BACKWARD_START, Phase.BACKWARD_LAST_BLOCK,
                 Phase.BACKWARD_END, Phase.OPTIMIZER_STEP)


@dataclass(frozen=True, eq=False)
class Term:
    """One named line of a moment. Equal only to itself."""

    label: str

    def __repr__(self) -> str:
        return f"Term({self.label!r})"


# the step's own terms (gptcalc.memory.peak)
WEIGHTS = Term("weights")
OPTIMIZER_STATES = Term("optimizer states")
OVERHEAD = Term("overhead")
SAVED = Term("saved activations")
LOGITS = Term("logits")
LOSS_LOGITS_COPY = Term("loss (fp32 logits copy)")
LOSS_GRADIENT = Term("loss gradient")
GRADIENTS = Term("gradients")
GRADIENTS_ACCUMULATING = Term("gradients (accumulating)")
RECOMPUTED_BLOCK = Term("recomputed block")
BLOCK_GRADIENTS = Term("block gradients in flight")
TIED_EMBEDDING_GRADIENT = Term("tied embedding gradient in flight")
EMBEDDING_INPUTS = Term("embedding and input activations")
OPTIMIZER_TEMPORARIES = Term("optimizer temporaries")
TARGETS = Term("targets")
SAVED_TO_ATTENTION_CORE = Term("saved activations (to the last block's attention core)")
ATTENTION_CORE_TRANSIENTS = Term("attention core transients (SDPA math path, 16-bit)")
RING_FORWARD_BUFFERS = Term("ring attention: gathered k and v, merged outputs")
RING_BACKWARD_BUFFERS = Term("ring attention: gathered k and v, q/k/v gradients in flight")
# activation offloading (gptcalc.memory.offload)
OFFLOAD_STASH = Term("offloaded activations still on the device (forward stash)")
OFFLOADED_BACK = Term("offloaded activations brought back (one block)")


class Ledger:
    """Each moment's terms in bytes, in the order they were opened and added."""

    def __init__(self) -> None:
        self._phases: dict[Phase, dict[Term, int]] = {}
        self._frozen = False

    def freeze(self) -> Ledger:
        """No more changes: a built step's ledger is read by every figure of the step, so an
        `open`, `add` or `replace` after this raises."""
        self._frozen = True
        return self

    def _change(self) -> None:
        if self._frozen:
            raise LedgerError("the step's ledger is built: it is read, not changed")

    def open(self, phase: Phase, terms: Mapping[Term, int]) -> None:
        """A new moment with its first terms; opening one twice raises."""
        self._change()
        if phase in self._phases:
            raise LedgerError(f"phase {phase.label!r} is already open")
        self._phases[phase] = {}
        for term, nbytes in terms.items():
            self.add(phase, term, nbytes)

    def add(self, phase: Phase, term: Term, nbytes: int) -> None:
        """A term the moment does not hold yet."""
        self._change()
        terms = self._terms(phase)
        if term in terms:
            raise LedgerError(f"{term!r} is already in {phase.label!r}: replace it")
        terms[term] = nbytes

    def replace(self, phase: Phase, term: Term, nbytes: int) -> None:
        """A new value for a term the moment holds."""
        self._change()
        terms = self._terms(phase)
        if term not in terms:
            raise LedgerError(f"{term!r} is not in {phase.label!r}: add it")
        terms[term] = nbytes

    def get(self, phase: Phase, term: Term) -> int:
        terms = self._terms(phase)
        if term not in terms:
            raise LedgerError(f"{term!r} is not in {phase.label!r}")
        return terms[term]

    def add_each(self, phases: Iterable[Phase], term: Term, nbytes: int) -> None:
        """`add` the same term to each of `phases`."""
        for phase in phases:
            self.add(phase, term, nbytes)

    def has(self, phase: Phase) -> bool:
        return phase in self._phases

    @property
    def phases(self) -> tuple[Phase, ...]:
        return tuple(self._phases)

    def forward_phases(self) -> tuple[Phase, ...]:
        """The moments inside or at the end of the forward: an engine's forward-end terms hold
        at each (the attention core's moment is open only where it happens)."""
        return tuple(p for p in (Phase.FORWARD_END, Phase.ATTENTION_CORE) if p in self._phases)

    def terms(self, phase: Phase) -> dict[Term, int]:
        return dict(self._terms(phase))

    def total(self, phase: Phase) -> int:
        return sum(self._terms(phase).values())

    def labelled(self) -> dict[str, dict[str, int]]:
        """Every moment's terms by display label (the text and JSON output's keys); two terms
        of one moment with the same label raise."""
        out: dict[str, dict[str, int]] = {}
        for phase, terms in self._phases.items():
            lines = {t.label: v for t, v in terms.items()}
            if len(lines) != len(terms):
                raise LedgerError(f"two terms of {phase.label!r} share a label")
            out[phase.label] = lines
        return out

    def _terms(self, phase: Phase) -> dict[Term, int]:
        if phase not in self._phases:
            raise LedgerError(f"phase {phase.label!r} is not open")
        return self._phases[phase]


__all__ = ["ATTENTION_CORE_TRANSIENTS", "BACKWARD_PASS", "BLOCK_GRADIENTS", "EMBEDDING_INPUTS", "GRADIENTS",
           "GRADIENTS_ACCUMULATING", "LOGITS", "LOSS_GRADIENT", "LOSS_LOGITS_COPY", "Ledger",
           "LedgerError", "OFFLOADED_BACK", "OFFLOAD_STASH", "OPTIMIZER_STATES", "OPTIMIZER_TEMPORARIES", "OVERHEAD", "Phase",
           "RECOMPUTED_BLOCK", "SAVED", "SAVED_TO_ATTENTION_CORE", "STEADY_PHASES",
           "TARGETS", "TIED_EMBEDDING_GRADIENT", "Term", "WEIGHTS"]
