"""What Hugging Face transformers' modules save for backward (the `transformers` profile)."""

from __future__ import annotations

from ..config import ConfigError, GPTConfig, TrainingSetup, Workload


def transformers_saved(cfg: GPTConfig, workload: Workload, setup: TrainingSetup
                       ) -> dict[str, int]:
    raise ConfigError("impl", "the transformers profile is not available yet")
