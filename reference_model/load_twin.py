"""QLoRA's load phase, measured: the allocations and frees of transformers' `from_pretrained`
with `BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")` quantising a 16-bit
checkpoint as it loads (the sequence `gptcalc.memory.load` models for CUDA).

bitsandbytes 0.50 quantises on CPU, and transformers 5.24 loads a bitsandbytes model with
`device_map="cpu"`, so the whole Python path runs here: `convert_and_load_state_dict_in_model`,
`Bnb4bitQuantize.convert`, `Params4bit._quantize`, `functional.quantize_4bit` and
`quantize_blockwise`. A dispatch mode records every storage an op makes (an allocation, its
bytes) and its release (a weakref finalizer on the storage), inside the loading loop only.
Where the CPU run differs from the CUDA one, the twin records what the CUDA device sees:

- the checkpoint is saved in fp32 and loaded with dtype=bf16, so `_materialize_copy`'s
  `.to(device, dtype)` makes the bf16 copy here as `.to("cuda")` of a bf16 checkpoint makes it
  on the device; the safetensors read itself (host memory under CUDA) is not recorded;
- bitsandbytes' kernels (`bitsandbytes::quantize_4bit`, `::quantize_blockwise`) are single ops
  to the dispatch mode (their CPU implementations' own temporaries are not seen) and return
  (out, absmax); the CUDA kernels allocate absmax first (bitsandbytes/backends/cuda/ops.py),
  and the twin records them in that order;
- the dynamic map (`create_dynamic_map`) is built on the host and copied to the device: its
  construction is not recorded, its result is, as the device copy.

Not measured: `caching_allocator_warmup` (it skips a CPU device map) and what happens outside
the loading loop (the rotary buffers), which the model leaves out too.
"""

from __future__ import annotations

import tempfile
import weakref
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from gptcalc.config import GPTConfig

from .transformers_twin import hf_config_for

_KERNELS = ("bitsandbytes.quantize_4bit", "bitsandbytes.quantize_blockwise")


class AllocationLog(TorchDispatchMode):
    """("alloc", i, nbytes) for every storage made by an op while `recording`, ("free", i) when
    it is released; i numbers the allocations from 0."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple] = []
        self.recording = False  # allocations are recorded
        self.open = False  # the loading loop runs: releases are recorded
        self._live: dict[int, int] = {}  # data_ptr -> allocation number
        self._next = 0

    def _free(self, ptr: int, i: int) -> None:
        if self._live.get(ptr) == i:
            del self._live[ptr]
            if self.open:
                self.events.append(("free", i))

    def track(self, t: torch.Tensor) -> None:
        """Record `t`'s storage as an allocation (once per storage)."""
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if t.device.type == "meta" or storage.nbytes() == 0 or ptr in self._live:
            return
        i = self._next
        self._next += 1
        self._live[ptr] = i
        self.events.append(("alloc", i, storage.nbytes()))
        weakref.finalize(storage, self._free, ptr, i)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.recording:
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            if str(func.overloadpacket) in _KERNELS:
                outs.reverse()  # the CUDA kernels allocate absmax before out
            for t in outs:
                self.track(t)
        return out


@contextmanager
def _patched(log: AllocationLog):
    """Recording on inside the loading loop; the checkpoint read and the dynamic map's host
    construction off."""
    import bitsandbytes.functional as F
    import transformers.core_model_loading as cml
    import transformers.modeling_utils as mu

    load_loop, materialize, dynamic = (cml.convert_and_load_state_dict_in_model,
                                       cml._materialize_copy, F.create_dynamic_map)

    def loop(*args, **kwargs):
        log.recording = log.open = True
        try:
            return load_loop(*args, **kwargs)
        finally:
            log.recording = log.open = False

    def copy(tensor, device=None, dtype=None):
        log.recording = False
        tensor = tensor[...]  # the read from the checkpoint: host memory under CUDA
        log.recording = True
        return tensor.to(device=device, dtype=dtype) if (dtype or device) is not None else tensor

    def dynamic_map(*args, **kwargs):
        was, log.recording = log.recording, False
        out = dynamic(*args, **kwargs)
        log.recording = was
        if was:
            log.track(out)  # .to(A.device): its device copy
        return out

    saved_qmap = F.name2qmap.pop("dynamic", None)  # the first double-quantised tensor makes it
    cml.convert_and_load_state_dict_in_model, cml._materialize_copy = loop, copy
    mu.convert_and_load_state_dict_in_model = loop
    F.create_dynamic_map = dynamic_map
    try:
        yield
    finally:
        cml.convert_and_load_state_dict_in_model, cml._materialize_copy = load_loop, materialize
        mu.convert_and_load_state_dict_in_model = load_loop
        F.create_dynamic_map = dynamic
        if saved_qmap is not None:
            F.name2qmap["dynamic"] = saved_qmap


def measure_load_events(cfg: GPTConfig, double_quant: bool = True, seed: int = 0
                        ) -> list[tuple]:
    """The allocations and frees of loading `cfg`'s transformers model (random weights, saved
    with save_pretrained in fp32) with NF4 on-the-fly quantisation, dtype bf16, on CPU."""
    from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

    fields = hf_config_for(cfg)
    hf = AutoConfig.for_model(**fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(hf, dtype=torch.float32)
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                               bnb_4bit_use_double_quant=double_quant,
                               bnb_4bit_compute_dtype=torch.bfloat16)
    log = AllocationLog()
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        del model
        with _patched(log), log:
            loaded = AutoModelForCausalLM.from_pretrained(d, quantization_config=quant,
                                                          dtype=torch.bfloat16, device_map="cpu")
    del loaded
    return log.events


def canonical(events: list[tuple]) -> list[tuple]:
    """Events with their keys replaced by the allocation's number (0, 1, ... in allocation
    order), marks dropped: two sequences are the same allocations and frees in the same order
    when their canonical forms are equal."""
    index: dict[object, int] = {}
    out: list[tuple] = []
    for e in events:
        if e[0] == "alloc":
            index[e[1]] = len(index)
            out.append(("alloc", index[e[1]], e[2]))
        elif e[0] == "free":
            out.append(("free", index[e[1]]))
    return out


__all__ = ["AllocationLog", "canonical", "measure_load_events"]
