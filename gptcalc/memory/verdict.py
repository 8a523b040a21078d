"""Whether a training step fits a card: one verdict, on what the card must hold.

    must hold = reserved + CUDA context + NCCL buffers
    fits      = must hold <= the card's usable memory (`gpus.usable_memory`, what
                torch.cuda.mem_get_info reports), margin = usable - must hold

- reserved: what `torch.cuda.max_memory_reserved()` reads, the caching allocator's segments
  (`reserved.rank_reserved`, the most loaded pipeline rank); the allocator never gives them back
  within a run (no `empty_cache`), so the card holds them all;
- the CUDA context and NCCL's buffers: outside PyTorch's allocator (`reserved.nvidia_smi_lines`);
- the allocated peak (`torch.cuda.max_memory_allocated()`, `peak.step_peak`) is below reserved:
  the lower bound, printed beside the verdict, never the verdict itself; where the model is
  quantised as it loads (`load.load_phase`), the larger of the load's and the step's (the
  step's reserved bytes already continue from the load's).

Where the reserved bytes are not simulated (a stage of more than `MAX_SIMULATED_BLOCKS` blocks)
the verdict stands on the allocated peak, the lower bound, and says so (`reserved` None). On
`--device cpu` there is no caching allocator, CUDA context nor NCCL: the verdict is the
allocated peak.
"""

from __future__ import annotations

from dataclasses import dataclass
import math

from ..config import GPTConfig
from ..errors import ConfigError
from ..training_setup import TrainingSetup
from ..workload import Workload
from .load import load_phase
from .peak import step_peak
from .reserved import RESERVED_LINE, nvidia_smi_lines, rank_reserved
from .rules import validate_setup
from .serving import largest_fitting


@dataclass(frozen=True)
class Verdict:
    """Bytes per device of the most loaded device against `budget`, the usable memory."""

    budget: int
    allocated: int  # max_memory_allocated, the lower bound: the step's peak or the load's
    reserved: int | None  # max_memory_reserved simulated; None where not simulated or on CPU
    cuda_context: int
    nccl_buffers: int

    @property
    def must_hold(self) -> int:
        """What the card must hold: reserved (else the allocated peak) + context + NCCL."""
        held = self.allocated if self.reserved is None else self.reserved
        return held + self.cuda_context + self.nccl_buffers

    @property
    def fits(self) -> bool:
        return self.must_hold <= self.budget

    @property
    def margin(self) -> int:
        """Usable bytes left (negative: the bytes missing)."""
        return self.budget - self.must_hold

    def as_dict(self) -> dict[str, int | bool | None]:
        return {"fits": self.fits, "must_hold": self.must_hold, "budget": self.budget,
                "margin": self.margin, "allocated_peak": self.allocated,
                "reserved": self.reserved, "cuda_context": self.cuda_context,
                "nccl_buffers": self.nccl_buffers}


def verdict(cfg: GPTConfig, workload: Workload, setup: TrainingSetup, budget: int,
            allocated: int | None = None, reserved: list[int] | None = None) -> Verdict:
    """The `Verdict` of one step against `budget` bytes. `allocated` (the step peak) and
    `reserved` (`rank_reserved`'s list) when the caller has them already."""
    if allocated is None:
        allocated = step_peak(cfg, workload, setup).bytes
    allocated = max(allocated, _load_peak(cfg, setup))
    if setup.device != "cuda":
        return Verdict(budget, allocated, None, 0, 0)
    if reserved is None:
        reserved = rank_reserved(cfg, workload, setup)
    smi = nvidia_smi_lines(max(reserved) if reserved else 0, setup)
    return Verdict(budget, allocated, smi[RESERVED_LINE] if reserved else None,
                   smi["CUDA context"], smi["NCCL buffers"])


def _load_peak(cfg: GPTConfig, setup: TrainingSetup) -> int:
    """The allocated peak of loading the model where it is quantised as it loads
    (`load.load_phase`), else 0: the card holds it before the first step."""
    load = load_phase(cfg, setup)
    return load.peak if load else 0


def fits(cfg: GPTConfig, workload: Workload, setup: TrainingSetup, budget: int) -> bool:
    """`verdict(...).fits`, without the allocator's replay when the lower bound (the allocated
    peak with the context and NCCL's buffers) is already over; False for a set-up or workload
    the rules refuse (`rules.validate_setup`)."""
    try:
        low = verdict_floor(cfg, workload, setup, budget)
    except ConfigError:
        return False
    if low.must_hold > budget:
        return False
    return verdict(cfg, workload, setup, budget, allocated=low.allocated).fits


def _floor_fits(cfg: GPTConfig, workload: Workload, setup: TrainingSetup, budget: int) -> bool:
    try:
        return verdict_floor(cfg, workload, setup, budget).fits
    except ConfigError:
        return False


def verdict_floor(cfg: GPTConfig, workload: Workload, setup: TrainingSetup,
                  budget: int) -> Verdict:
    """The verdict on the allocated peak (no replay): a lower bound of what the card holds.
    ConfigError for a set-up or workload the rules refuse (`rules.validate_setup`)."""
    validate_setup(cfg, workload, setup)
    allocated = max(step_peak(cfg, workload, setup).bytes, _load_peak(cfg, setup))
    if setup.device != "cuda":
        return Verdict(budget, allocated, None, 0, 0)
    smi = nvidia_smi_lines(0, setup)
    return Verdict(budget, allocated, None, smi["CUDA context"], smi["NCCL buffers"])


def _largest(floor_ok, ok) -> int:
    """The largest n >= 1 with ok(n) (0 if none), for ok monotone and implied by nothing but
    bounded by floor_ok (ok(n) needs floor_ok(n), which costs no replay): the floor's boundary
    first, then down from it, galloping, and bisection; the verdict's boundary is near the
    floor's, so a few replays answer."""
    if not floor_ok(1):
        return 0
    top = largest_fitting(floor_ok, 1)
    if ok(top):
        return top
    hi, step = top, 1  # hi does not fit
    while True:
        n = max(hi - step, 1)
        if ok(n):
            lo = n
            break
        if n == 1:
            return 0
        hi, step = n, step * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def largest_batch(cfg: GPTConfig, workload: Workload, setup: TrainingSetup, budget: int) -> int:
    """The largest micro-batch whose step fits `budget` (`fits`); 0 if none."""
    def at(b: int) -> Workload:
        return Workload(b, workload.seq_len, workload.grad_accum)
    return _largest(lambda b: _floor_fits(cfg, at(b), setup, budget),
                    lambda b: fits(cfg, at(b), setup, budget))


def largest_seq_len(cfg: GPTConfig, workload: Workload, setup: TrainingSetup,
                    budget: int) -> int:
    """The longest training sequence whose step fits `budget` at this micro-batch (0 if none).
    A memory bound: past the block size the model has no positions for it."""
    big = cfg.replace(block_size=max(cfg.block_size, 1 << 62)) if (
        cfg.pos_embedding != "learned") else cfg

    def at(s: int) -> Workload:
        return Workload(workload.batch_size, s, workload.grad_accum)

    def floor_ok(s: int) -> bool:
        return s <= big.block_size and _floor_fits(big, at(s), setup, budget)

    def ok(s: int) -> bool:
        return s <= big.block_size and fits(big, at(s), setup, budget)
    # sequence parallel needs tp | S, context parallel 2 cp | S: search in steps of both
    t = math.lcm(setup.tp if setup.sp else 1, 2 * setup.cp if setup.cp > 1 else 1)
    return t * _largest(lambda k: floor_ok(k * t), lambda k: ok(k * t))


__all__ = ["Verdict", "fits", "largest_batch", "largest_seq_len", "verdict", "verdict_floor"]
