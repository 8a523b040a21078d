"""gptcalc: exact parameter, FLOP and memory counts for decoder-only transformers.

Import-light by design: nothing here imports torch, fvcore or matplotlib.
"""

from .config import ARCHS, ConfigError, GPTConfig, Workload
from .flops import FlopCount, InferenceFlops, count_flops, inference_flops, published_estimates
from .params import ParamCount, count_params
from .presets import PRESETS, from_name

__all__ = [
    "ARCHS", "PRESETS", "ConfigError", "FlopCount", "GPTConfig", "InferenceFlops", "ParamCount",
    "Workload", "count_flops", "count_params", "from_name", "inference_flops",
    "published_estimates",
]
__version__ = "0.1.0"
