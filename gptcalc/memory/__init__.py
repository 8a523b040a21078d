"""Memory of training and inference, per device, in bytes.

- `states`: weights, gradients and optimizer states per precision mode, sharded by ZeRO,
  tensor and pipeline parallelism (exact);
- `activations`: what backward keeps, by implementation profile (`reference`, `transformers`,
  `paper`), sharded as Korthikanti et al. 2022 shard it, with a pipeline stage's micro-batches
  in flight; the logits;
- `ledger`: the moments of a training step (`Phase`) and their named terms;
- `engines`: each training engine's states per rank and terms at each moment, by registry;
- `peak`: the step's account (`StepAccount`: one device's states, saved lines and ledger, built
  once per step) and the step peak, its largest moment;
- `rules`: what a set-up must obey before its memory is counted;
- `summary`: everything `gptcalc memory` prints, and the largest batch / sequence that fit;
- `serving`: a trained model's inference memory and the longest context that fits. The KV cache
  is `gptcalc.inference.kv`'s, re-exported here.

This package never imports torch.
"""

from ..training_setup import (ATTN_IMPLS, AUTOCAST_DTYPES, DEVICES, IMPLS, MODES, OPTIMIZERS,
                              RECOMPUTE, ZERO_STAGES, TrainingSetup)
from .activations import (activations_paper, device_activations, logits_bytes,
                          paper_layer_bytes, saved_activations)
from ..inference.kv import kv_cache_bytes
from .ledger import Phase
from .peak import StepAccount, StepPeak, stage_ledger, step_account, step_peak
from .rules import validate_setup
from .serving import inference_bytes, max_context, serving_dtype_bytes
from .summary import MemoryReport, max_batch, max_seq_len, memory_report
from .states import (STEP_COUNTER_BYTES, StateBytes,
                     autocast_weight_copies, stage_params, zero_bytes_per_param)
from .engines import resident, state_bytes

__all__ = [
    "ATTN_IMPLS", "AUTOCAST_DTYPES", "DEVICES", "IMPLS", "MODES", "OPTIMIZERS",
    "Phase", "RECOMPUTE", "STEP_COUNTER_BYTES", "ZERO_STAGES", "MemoryReport",
    "StateBytes", "StepAccount", "StepPeak", "TrainingSetup", "activations_paper", "autocast_weight_copies",
    "device_activations", "inference_bytes", "kv_cache_bytes", "logits_bytes", "max_batch",
    "max_context", "max_seq_len", "memory_report", "paper_layer_bytes", "saved_activations",
    "resident", "serving_dtype_bytes", "stage_params", "stage_ledger", "state_bytes", "step_account",
    "step_peak",
    "validate_setup", "zero_bytes_per_param",
]
