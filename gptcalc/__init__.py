"""gptcalc: exact parameter, FLOP and memory counts for decoder-only transformers.

Import-light by design: nothing here imports torch, fvcore or matplotlib.
"""

from .api import (Setup, Summary, count_flops, inference_flops, load, resolve_setup, save_config,
                  summarize, to_dict)
from .config import GPTConfig
from .errors import ConfigError
from .families import ARCHS
from .training import default_setup
from .training_setup import TrainingSetup
from .workload import Workload
from .flops import FlopCount, InferenceFlops, published_estimates
from .hf import SUPPORTED_MODEL_TYPES, config_from_hf
from .params import ParamCount, count_params
from .presets import PRESETS, from_name
from .training import resolve_training, training_for

__all__ = [
    "ARCHS", "PRESETS", "SUPPORTED_MODEL_TYPES", "ConfigError", "FlopCount", "GPTConfig",
    "InferenceFlops", "ParamCount", "Setup", "Summary", "Workload", "config_from_hf",
    "count_flops", "count_params", "from_name", "inference_flops", "load", "published_estimates",
    "resolve_setup", "save_config", "summarize", "to_dict",
    "MemoryReport", "TrainingSetup", "default_setup", "memory_report", "resolve_training",
    "step_peak", "training_for",
]
__version__ = "0.1.0"

_MEMORY_NAMES = ("MemoryReport", "memory_report", "step_peak")


def __getattr__(name: str):
    # gptcalc.memory is loaded on first use (PEP 562), not at import
    if name in _MEMORY_NAMES:
        from . import memory

        return getattr(memory, name)
    raise AttributeError(f"module 'gptcalc' has no attribute {name!r}")
