"""Training time from FLOPs, and the model FLOPs utilisation (MFU) a measured run achieved.

    seconds = training FLOPs per token x tokens / (gpus x dense peak FLOP/s x MFU)

MFU is Chowdhery et al. 2022's (PaLM, appendix B): MODEL FLOPs per second over the dense peak.
Model FLOPs are forward + backward (gptcalc.flops, exact matmul count, attention over the full
S x S); recomputed forward work is not model FLOPs, so it does not change the time at a given
MFU: it raises the hardware FLOPs utilisation HFU = MFU x hardware / model FLOPs, which cannot
exceed 1 (an MFU that would need it is refused). The published shorthands (6N, Kaplan, PaLM) are
timed beside the exact count at the same MFU.

Reproducing nanoGPT's sizing notebook (transformer_sizing.ipynb, last cells): GPT-2 124M over
300B tokens on 8 A100s (312 TFLOP/s bf16) at 30% MFU takes 3.46 days. It uses 6ND with its own
N = 124,337,664: GPT-2 without biases (its `bias=False`), position table included. gptcalc's
`gpt2` preset has the released checkpoint's biases (N = 124,439,808), so its 6N row gives 3.462
days against the notebook's 3.459 (+0.08%), both 3.46. The exact count, 854,438,400 FLOPs per
token, equals the notebook's own flops() (874,944,921,600 per 1,024-token sequence) and gives
3.96 days: 6N leaves out attention's q @ k^T and att @ v (12 L E T = 113 MFLOPs per token at
T = 1,024, +15%) and counts parameters that do no matmul (position table, biases, norms). The
notebook's author notes that the model "converged in roughly 4 days".

Scope: a time for compute only; no data loading, communication stalls, checkpointing or restarts
beyond what the MFU absorbs.
"""

from __future__ import annotations

import math

from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from ..config import GPTConfig
from ..errors import ConfigError, fraction, number, positive_int
from ..workload import Workload
from ..flops import count_flops, published_estimates
from ..gpus import GPU, require_peak
from ..params import count_params

SECONDS_PER_DAY = 86_400
CHINCHILLA_TOKENS_PER_PARAM = 20  # Hoffmann et al. 2022: ~20 tokens per parameter is optimal
MAX_COUNT = 10**30  # a bound on typed counts: beyond any real token budget, and finite


# the SI prefixes of a count, as gptcalc.units.si prints them (k, M, G, T, ...)
_SI_SUFFIXES = {p: 1000 ** (i + 1) for i, p in enumerate("kMGTPEZ")} | {"K": 1000}


def parse_count(text: str, field: str) -> int:
    """A positive whole number from '300e9', '3e11', '300000000000', '300_000_000_000', or with
    an SI prefix as gptcalc prints counts: '300G', '1.5T', '2.49 G'.

    Strict: rejects 0, negatives, fractions ('1.5'), inf, nan and anything not a number, with
    ConfigError(field). Decimal keeps '300e9' exact where float would round large values."""
    raw = str(text).strip().replace("_", "")
    scale = 1
    if raw[-1:] in _SI_SUFFIXES:  # as `si` prints a count: "1.00 T"
        raw, scale = raw[:-1].strip(), _SI_SUFFIXES[raw[-1]]
    try:
        value = Decimal(raw) * scale
    except InvalidOperation:
        raise ConfigError(field, f"expected a whole number such as 300e9 or 300G, got "
                                 f"{text!r}") from None
    if not value.is_finite():
        raise ConfigError(field, f"must be a finite whole number, got {text!r}")
    if value != value.to_integral_value():
        raise ConfigError(field, f"must be a whole number, got {text!r}")
    if value <= 0:
        raise ConfigError(field, f"must be positive, got {text!r}")
    if value > MAX_COUNT:
        raise ConfigError(field, f"must be at most 1e30, got {text!r}")
    return int(value)


def check_fraction(value: float, field: str) -> float:
    """A utilisation or efficiency: finite and in (0, 1]."""
    return fraction(field, value)


def check_positive(value: float, field: str) -> float:
    """A finite number > 0 (a rate, a duration)."""
    return number(field, value, high=None)


def compute_seconds(flops: float, peak_flops: float, gpus: int, mfu: float) -> float:
    """flops / (gpus x peak x MFU): the wall time of `flops` model FLOPs at utilisation `mfu`."""
    seconds = flops / (gpus * peak_flops * mfu)
    if not math.isfinite(seconds):
        raise OverflowError("the training time is not a finite number")
    return seconds


def achieved_mfu(flops_per_token: float, tokens_per_second: float, peak_flops: float,
                 gpus: int) -> float:
    """MFU of a measured run: model FLOPs per second / (gpus x peak) (PaLM's definition; nanoGPT's
    estimate_mfu). Above 1 means the inputs are wrong: no run beats the peak."""
    return flops_per_token * tokens_per_second / (gpus * peak_flops)


def tokens_per_step(workload: Workload, gpus: int) -> int:
    """Tokens of one optimizer step when every GPU is a data-parallel rank holding B sequences
    of seq_len tokens and there is no gradient accumulation: B x seq_len x gpus."""
    return workload.batch_size * workload.seq_len * gpus


@dataclass(frozen=True)
class TrainingTime:
    """The time to train on `tokens` tokens, by the exact count and by each shorthand."""

    tokens: int
    gpu: str
    gpus: int
    precision: str
    peak_flops: float  # dense, per GPU
    mfu: float
    recompute: str
    flops_per_token: int  # model FLOPs: forward + backward, exact matmul count
    hardware_flops_per_token: int  # plus recomputed forward work
    conventions: dict[str, int]  # training FLOPs per token by 6N, kaplan, palm

    @property
    def flops_total(self) -> int:
        return self.flops_per_token * self.tokens

    @property
    def seconds(self) -> float:
        return compute_seconds(self.flops_total, self.peak_flops, self.gpus, self.mfu)

    @property
    def days(self) -> float:
        return self.seconds / SECONDS_PER_DAY

    @property
    def gpu_hours(self) -> float:
        hours = self.seconds * self.gpus / 3600
        if not math.isfinite(hours):
            raise OverflowError("the GPU-hours are not a finite number")
        return hours

    @property
    def hfu(self) -> float:
        """Hardware FLOPs utilisation the MFU implies: MFU x hardware / model FLOPs."""
        return self.mfu * self.hardware_flops_per_token / self.flops_per_token

    def convention_seconds(self, name: str) -> float:
        return compute_seconds(self.conventions[name] * self.tokens, self.peak_flops, self.gpus,
                               self.mfu)


def training_time(cfg: GPTConfig, workload: Workload, tokens: int | None, gpu: GPU,
                  gpus: int = 1, mfu: float = 0.4, precision: str = "bf16",
                  recompute: str = "none") -> TrainingTime:
    """Training time of `tokens` tokens (default 20 per parameter, Chinchilla) of sequences of
    workload.seq_len on `gpus` x `gpu` at `mfu`; see the module docstring for the formula."""
    positive_int("gpus", gpus)
    mfu = check_fraction(mfu, "mfu")
    peak = require_peak(gpu, precision)
    if tokens is None:
        tokens = CHINCHILLA_TOKENS_PER_PARAM * count_params(cfg).total
    fc = count_flops(cfg, workload, recompute=recompute)
    t = TrainingTime(
        tokens=tokens, gpu=gpu.name, gpus=gpus, precision=precision, peak_flops=peak, mfu=mfu,
        recompute=recompute,
        flops_per_token=fc.training_total // workload.seq_len,  # matmul terms are multiples of S
        hardware_flops_per_token=fc.hardware_total // workload.seq_len,
        conventions=published_estimates(cfg, workload.seq_len),
    )
    if t.hfu > 1:
        raise ConfigError("mfu", f"MFU {mfu} with recompute={recompute} needs a hardware "
                                 f"utilisation of {t.hfu:.3f} > 1; no GPU runs above its peak")
    return t
