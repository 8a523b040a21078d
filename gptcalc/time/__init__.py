"""Training time: a token budget at a given MFU (`budget`), and one step as the engines spend
it (`step`): compute op by op (`compute`), the collectives of each layout and engine on a
two-level network (`comm`), what overlaps and the pipeline bubble."""

from .budget import (CHINCHILLA_TOKENS_PER_PARAM, MAX_COUNT, SECONDS_PER_DAY, TrainingTime,
                     achieved_mfu, check_fraction, check_positive, compute_seconds, parse_count,
                     tokens_per_step, training_time)
from .comm import Collective, collective_seconds, collectives
from .compute import micro_batch_compute
from .step import PARTS, StepTime, step_time

__all__ = ["CHINCHILLA_TOKENS_PER_PARAM", "MAX_COUNT", "PARTS", "SECONDS_PER_DAY", "Collective",
           "StepTime", "TrainingTime", "achieved_mfu", "check_fraction", "check_positive",
           "collective_seconds", "collectives", "compute_seconds", "micro_batch_compute",
           "parse_count", "step_time", "tokens_per_step", "training_time"]
