"""The load phase of QLoRA: a 16-bit checkpoint quantised to NF4 on the device as it loads, as
transformers' `from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True))`
does it (the path of axolotl's, TRL's and LLaMA-Factory's QLoRA recipes), replayed on the
caching-allocator model (`allocator`).

The sequence, read from transformers 5.24 and bitsandbytes 0.50.2:

- `caching_allocator_warmup` (modeling_utils): one `torch.empty` of the model's bytes on the
  device, the quantised weights at `Bnb4BitHfQuantizer.quantized_element_size` (0.5 byte per
  element), every other tensor at its element size (2, bf16), tied weights once; freed at once,
  so its segment stays reserved for what follows. Its cap, the card's memory less 1.2 GiB, binds
  only where the weights alone nearly fill the card, and is not applied.
- `convert_and_load_state_dict_in_model` (core_model_loading): with on-the-fly quantisation no
  thread pool, one tensor at a time in `dot_natural_key` order of the state-dict keys
  (`lm_head`, `model.embed_tokens`, `model.layers.0.input_layernorm`, `...mlp.down_proj`, ...,
  `model.norm`); each tensor is copied to the device in the load dtype (`_materialize_copy`).
  A tensor that is not quantised stays: the norms, the embeddings, the lm_head, biases.
- a block Linear's weight (`Bnb4bitQuantize.convert`: `Params4bit(value).to(device)`, that is
  `Params4bit._quantize` and `functional.quantize_4bit`), n elements, B = ceil(n / 64) blocks:
  the kernel's fp32 absmax (4 B bytes), then the packed weights ((n + 1) // 2 bytes;
  backends/cuda/ops.py allocates them in that order); the NF4 code (`get_4bit_type`: 16 fp32,
  normalised by `data.div_(data.abs().max())`, whose two temporaries come and go). Double
  quantisation (`compress_statistics`): the offset `absmax.mean()` (4 bytes, kept), `absmax -
  offset` (4 B bytes), the first time in the process the 8-bit dynamic map (256 fp32, kept in
  `name2qmap`), `quantize_blockwise`'s fp32 absmax of every 256 (kept) and its uint8 output
  (B bytes, kept), the map's copy in the state (1 KiB, kept), then `absmax - offset` and the fp32
  absmax are freed. Without it the fp32 absmax is kept. The 16-bit copy is freed last, when the
  converter's dict of collected tensors is dropped.

What is kept per quantised weight is `lora.nf4_tensor_bytes`'s parts. Not replayed: the CUDA
reduction kernels' own scratch of `mean` and `max` (a few KiB, freed within the kernel's call),
the rotary `inv_freq` buffers, and what the recipes do after `from_pretrained` (peft's
`prepare_model_for_kbit_training` casts the 16-bit tensors that are not quantised to fp32;
`get_peft_model` adds the adapters, which the step's weights count).

Scope: the families whose state-dict keys are Llama's (llama, mistral, qwen2), on CUDA, under
an engine that puts the whole model on each device as it loads (`ddp`, `zero-redundancy`);
None elsewhere. Pure Python; never imports torch.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import lru_cache

from ..config import GPTConfig
from ..errors import ConfigError
from ..inventory import inventory
from ..lora import NF4_BLOCK, ABSMAX_BLOCK, NF4_CODE_BYTES, DYNAMIC_CODE_BYTES
from ..training_setup import TrainingSetup
from .allocator import simulate
from .engines import engine_for
from .profile_transformers import transformers_family

# transformers' families whose modules are named as Llama's (LlamaForCausalLM's state dict)
LOAD_FAMILIES = ("llama", "mistral", "qwen2")
# engines under which each device loads the whole model with from_pretrained (device_map)
LOAD_ENGINES = ("ddp", "zero-redundancy")
# the dtype the checkpoint is loaded in (bf16), bytes per element
LOAD_DTYPE_BYTES = 2
# Bnb4BitHfQuantizer.quantized_element_size: what the warm-up counts per quantised element
WARMUP_QUANTIZED_ELEMENT = 0.5
# the reference model's module names -> transformers' Llama (the `model.` prefix and the layer
# index added by `_hf_key`); a name outside this map leaves the load phase unmodelled
_HF_NAMES = {
    "wte": "model.embed_tokens", "ln_f": "model.norm", "lm_head": "lm_head",
    "ln_1": "input_layernorm", "ln_2": "post_attention_layernorm",
    "attn.q_proj": "self_attn.q_proj", "attn.k_proj": "self_attn.k_proj",
    "attn.v_proj": "self_attn.v_proj", "attn.c_proj": "self_attn.o_proj",
    "mlp.c_fc": "mlp.up_proj", "mlp.c_gate": "mlp.gate_proj", "mlp.c_proj": "mlp.down_proj",
}


@dataclass(frozen=True)
class LoadTensor:
    """One tensor of the checkpoint: its state-dict key, elements, and whether it is quantised
    (a block Linear's weight, which bitsandbytes' Linear4bit holds)."""

    key: str
    numel: int
    quantized: bool


@dataclass(frozen=True)
class LoadPhase:
    """The device after `from_pretrained`: `allocated` (memory_allocated), `peak`
    (max_memory_allocated during the load) and `reserved` (memory_reserved), in bytes;
    `peak_tensor` the key being quantised at the peak."""

    allocated: int
    peak: int
    reserved: int
    peak_tensor: str

    def as_dict(self) -> dict[str, int | str]:
        return {"allocated": self.allocated, "peak": self.peak, "reserved": self.reserved,
                "peak_tensor": self.peak_tensor}


def natural_key(key: str) -> list[tuple]:
    """transformers' `dot_natural_key` (core_model_loading): the order the keys load in; parts
    split on ".", digits numerically before words, a word's trailing digits numerically."""
    parts: list[tuple] = []
    for part in key.split("."):
        if part.isdigit():
            parts.append((0, int(part)))
        else:
            m = re.fullmatch(r"(.*?)(\d*)", part)
            text, digits = m.group(1), m.group(2)
            parts.append((1, text, int(digits)) if digits else (1, text))
    return parts


def _hf_key(name: str, layer: int | None) -> str | None:
    module, _, leaf = name.rpartition(".")
    hf = _HF_NAMES.get(module)
    if hf is None:
        return None
    return f"{hf}.{leaf}" if layer is None else f"model.layers.{layer}.{hf}.{leaf}"


def applies(cfg: GPTConfig, setup: TrainingSetup) -> bool:
    """Whether the load phase is modelled: QLoRA (an NF4 base) on CUDA with the transformers
    implementation, a family of `LOAD_FAMILIES`, an engine of `LOAD_ENGINES`."""
    if not (setup.base_dtype == "nf4" and setup.lora_rank and setup.device == "cuda"
            and setup.impl == "transformers"):
        return False
    try:
        family = transformers_family(cfg)
    except ConfigError:
        return False
    return family in LOAD_FAMILIES and engine_for(setup).name in LOAD_ENGINES


def load_tensors(cfg: GPTConfig) -> list[LoadTensor] | None:
    """The checkpoint's tensors in the order transformers loads them (`natural_key`); None when
    a tensor has no Llama name. The lm_head tied to the embeddings is not a tensor of its own."""
    out = []
    for t in inventory(cfg):
        layers = range(t.layers) if t.place == "block" else (None,)
        for layer in layers:
            key = _hf_key(t.name, layer)
            if key is None or t.copies != 1:
                return None
            out.append(LoadTensor(key, t.numel, t.place == "block" and t.role == "matrix"))
    return sorted(out, key=lambda t: natural_key(t.key))


def warmup_bytes(tensors: list[LoadTensor]) -> int:
    """`caching_allocator_warmup`'s tensor: torch.empty(int(count // 2), float16) of count =
    0.5 byte per quantised element + 2 per other element."""
    count = sum(t.numel * (WARMUP_QUANTIZED_ELEMENT if t.quantized else LOAD_DTYPE_BYTES)
                for t in tensors)
    return 2 * int(count // 2)


def quantize_events(t: LoadTensor, double_quant: bool, first: bool) -> list[tuple]:
    """The allocations and frees of quantising one weight on the device (`first`: the first
    double-quantised weight of the process, which makes bitsandbytes' dynamic map). Keys are
    (t.key, part); the parts kept are those of `lora.nf4_tensor_bytes`."""
    n, k = t.numel, t.key
    blocks = math.ceil(n / NF4_BLOCK)
    ev: list[tuple] = [
        ("alloc", (k, "16-bit"), LOAD_DTYPE_BYTES * n),  # _materialize_copy: .to(device)
        ("alloc", (k, "absmax fp32"), 4 * blocks),  # quantize_4bit kernel: absmax, then out
        ("alloc", (k, "nf4"), (n + 1) // 2),
        ("alloc", (k, "code"), NF4_CODE_BYTES),  # get_4bit_type: torch.tensor(data, device)
        ("alloc", (k, "code abs"), NF4_CODE_BYTES),  # data.div_(data.abs().max())
        ("alloc", (k, "code max"), 4),
        ("free", (k, "code abs")),
        ("free", (k, "code max")),
    ]
    if double_quant:
        ev += [("alloc", (k, "offset"), 4),  # absmax.mean()
               ("alloc", (k, "absmax centred"), 4 * blocks)]  # absmax - offset
        if first:  # name2qmap["dynamic"] = create_dynamic_map().to(device)
            ev.append(("alloc", "dynamic map", DYNAMIC_CODE_BYTES))
        ev += [("alloc", (k, "absmax scales"), 4 * math.ceil(blocks / ABSMAX_BLOCK)),
               ("alloc", (k, "absmax"), blocks),  # quantize_blockwise's uint8 output
               ("alloc", (k, "dynamic map copy"), DYNAMIC_CODE_BYTES),  # code.to(copy=True)
               ("free", (k, "absmax centred")),
               ("free", (k, "absmax fp32"))]  # del _absmax
    ev.append(("free", (k, "16-bit")))  # the converter's collected tensors dropped
    return ev


def load_events(cfg: GPTConfig, setup: TrainingSetup) -> list[tuple] | None:
    """The allocations and frees of `from_pretrained` with on-the-fly NF4 quantisation on one
    device, as `allocator.simulate` takes them; None where `applies` is False or the
    checkpoint's keys are not modelled. The allocations alive at the end are the model."""
    if not applies(cfg, setup):
        return None
    tensors = load_tensors(cfg)
    if tensors is None:
        return None
    events: list[tuple] = [("alloc", "warm-up", warmup_bytes(tensors)), ("free", "warm-up")]
    first = True
    for t in tensors:
        if t.quantized:
            events += quantize_events(t, setup.double_quant, first and setup.double_quant)
            first = False
        else:
            events.append(("alloc", (t.key, "16-bit"), LOAD_DTYPE_BYTES * t.numel))
    return events


def kept_bytes(events: list[tuple]) -> int:
    """The bytes of the allocations `events` leave alive (unrounded: the tensors' own)."""
    live: dict[object, int] = {}
    for e in events:
        if e[0] == "alloc":
            live[e[1]] = e[2]
        elif e[0] == "free":
            live.pop(e[1])
    return sum(live.values())


def _peak_tensor(events: list[tuple]) -> str:
    """The key of the tensor being loaded when the live bytes (unrounded) are highest."""
    now = best = 0
    where = ""
    live: dict[object, int] = {}
    for e in events:
        if e[0] == "alloc":
            live[e[1]] = e[2]
            now += e[2]
            if now > best:
                best, where = now, e[1][0] if isinstance(e[1], tuple) else e[1]
        elif e[0] == "free":
            now -= live.pop(e[1])
    return where


@lru_cache(maxsize=64)
def load_phase(cfg: GPTConfig, setup: TrainingSetup) -> LoadPhase | None:
    """The device after the load: `load_events` replayed on the caching allocator under the
    set-up's allocator settings; None where the load phase is not modelled."""
    events = load_events(cfg, setup)
    if events is None:
        return None
    alloc = simulate(events, setup.allocator == "expandable")
    return LoadPhase(alloc.allocated, alloc.peak_allocated, alloc.reserved, _peak_tensor(events))


__all__ = ["LOAD_DTYPE_BYTES", "LOAD_ENGINES", "LOAD_FAMILIES", "LoadPhase", "LoadTensor",
           "WARMUP_QUANTIZED_ELEMENT", "applies", "kept_bytes", "load_events", "load_phase",
           "load_tensors", "natural_key", "quantize_events", "warmup_bytes"]
