"""LoRA adapters on the reference model, as PEFT adds them (for measuring fine-tuning memory).

PEFT's LoraLayer (`peft.tuners.lora.layer.Linear`) keeps the base Linear frozen and adds
`lora_B(lora_A(dropout(x))) * scaling` to its output; lora_A = Linear(in, r), lora_B =
Linear(r, out), both without bias; lora_dropout 0 (PEFT's default) is an identity. Every other
parameter of the model is frozen too.
"""

from __future__ import annotations

import torch
from torch import nn

from gptcalc.linears import _target


class LoRALinear(nn.Module):
    """A frozen `base` Linear plus a rank-`r` adapter (PEFT's LoRA, lora_alpha = r)."""

    def __init__(self, base: nn.Linear, rank: int, adapter_dtype: torch.dtype | None = None):
        super().__init__()
        self.base = base
        dtype = adapter_dtype or base.weight.dtype
        kw = dict(bias=False, device=base.weight.device, dtype=dtype)
        self.lora_A = nn.Linear(base.in_features, rank, **kw)
        self.lora_B = nn.Linear(rank, base.out_features, **kw)
        nn.init.zeros_(self.lora_B.weight)  # PEFT starts the adapter at zero
        self.scaling = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # PEFT casts the input to the adapters' dtype (`_cast_input_dtype`): under autocast
        # over fp32 adapters, lora_A's matmul then casts it back, a 16-bit copy of its own
        a = self.lora_A(x.to(self.lora_A.weight.dtype))
        return self.base(x) + self.lora_B(a) * self.scaling


def apply_lora(model: nn.Module, rank: int, targets: tuple[str, ...],
               adapter_dtype: torch.dtype | None = None) -> nn.Module:
    """Freeze every parameter, then wrap each block Linear whose target name is in `targets`
    (q, k, v, qkv, o, up, gate, down; gptcalc.linears' names), and the output head when
    `targets` names lm_head (tied or not: the wrapped Linear keeps its weight), in a LoRALinear,
    in place."""
    for p in model.parameters():
        p.requires_grad_(False)
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if (isinstance(child, nn.Linear) and ".h." in f".{full}"
                    and _target(full) in targets):
                setattr(module, child_name, LoRALinear(child, rank, adapter_dtype))
    if "lm_head" in targets and isinstance(getattr(model, "lm_head", None), nn.Linear):
        model.lm_head = LoRALinear(model.lm_head, rank, adapter_dtype)
    return model
