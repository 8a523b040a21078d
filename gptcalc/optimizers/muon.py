"""torch.optim.Muon (Jordan et al. 2024, github.com/KellerJordan/Muon, muon.py; torch 2.13
torch/optim/_muon.py) on the blocks' 2-D matrices, AdamW on every other parameter."""

from __future__ import annotations

from typing import ClassVar

from dataclasses import replace

from .base import Optimizer, StepView, Tensor, optimizer_named, register

# `state["momentum_buffer"] = zeros_like(p.grad)` per 2-D hidden matrix, no step counter, so
# one state in the gradient's dtype (mode mixed: beside the fp32 master copy). Every other
# parameter (embeddings, the output head, norms, biases) goes to AdamW, as both tell: "Muon
# should only be used for hidden weight layers".
MUON_BYTES = {"fp32": 4, "amp": 4, "mixed": 8, "bf16": 2}


def muon_update_temporaries(shape: tuple[int, int], param_bytes: int) -> int:
    """Bytes torch.optim.Muon allocates while it updates one m x k matrix (torch 2.13,
    torch/optim/_muon.py, `_single_tensor_muon` and `_zeropower_via_newtonschulz`): the Nesterov
    update `grad.lerp(buf, momentum)`, n x param_bytes, held through the orthogonalisation;
    inside it, from the second Newton-Schulz step on, the bf16 iterate X (2 n), the s x s Gram
    matrices X X^T and its update (2 s^2 each, s = min(m, k)) and the next iterate made by
    addmm (2 n): n x param_bytes + 4 n + 4 s^2. (At the next X X^T, 2 n + 6 s^2 are alive
    beside the update, never more, as s^2 <= n.)"""
    n, s = shape[0] * shape[1], min(shape)
    return n * param_bytes + 4 * n + 4 * s * s


class Muon(Optimizer):
    name = "muon"
    help = ("torch.optim.Muon's momentum on the blocks' 2-D matrices, AdamW on embeddings, "
            "head, norms and biases; one device or DDP")
    # each rank orthogonalises whole matrices: one device or DDP
    shardable: ClassVar[bool] = False
    partner: ClassVar[str | None] = "adamw"

    def per_param_bytes(self, mode: str) -> int:
        return MUON_BYTES[mode]

    def applies_to(self, tensor: Tensor) -> bool:
        """A 2-D weight matrix of a block; AdamW takes the rest."""
        return tensor.place == "block" and tensor.role == "matrix" and len(tensor.shape) == 2

    def step_temporaries(self, step: StepView) -> int:
        """Muon updates one matrix at a time (`muon_update_temporaries` of the costliest), then
        its partner steps the rest (AdamW: on CUDA its foreach path, one tensor per parameter
        it steps; on CPU two tensors the size of its largest), one after the other."""
        tensors, pb = step.tensors(), step.param_bytes
        muon = max((muon_update_temporaries(t.shape, pb) for t in tensors
                    if self.applies_to(t)), default=0)
        rest = [t for t in tensors if not self.applies_to(t)]
        largest = max((t.numel for t in rest), default=0)
        rest_step = replace(step, stepped=sum(t.numel * t.count for t in rest),
                            largest_stepped=lambda: largest, largest_param=lambda: largest,
                            tensors=lambda: rest, pairs=lambda: ())
        return max(muon, optimizer_named(self.partner).step_temporaries(rest_step))


register(Muon())
