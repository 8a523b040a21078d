"""The Linear modules of the transformer blocks, by the names LoRA and quantisation use.

A view of the parameter inventory (`gptcalc.inventory`): every block matrix, with the target
name PEFT-style configs use for it. q, k, v, o: attention's query, key, value and output
projections (a fused layout has one `qkv` module instead; multi-head latent attention has
`q_a`, `q_b`, `kv_a`, `kv_b`); up, gate, down: the MLP's input, gate (gated MLPs only) and
output projections, of a dense MLP, of each routed expert and of the shared experts alike;
router: a mixture of experts' gate. Embeddings, the lm_head and norms are not block Linears.
"""

from __future__ import annotations

from dataclasses import dataclass

from .config import GPTConfig
from .inventory import inventory

# the inventory's module names (their last two parts) -> the target name
_TARGETS = {
    "attn.c_attn": "qkv", "attn.q_proj": "q", "attn.k_proj": "k", "attn.v_proj": "v",
    "heads.query": "q", "heads.key": "k", "heads.value": "v", "attn.query": "q",
    "attn.key": "k", "attn.value": "v", "attn.c_proj": "o",
    "attn.q_a_proj": "q_a", "attn.q_b_proj": "q_b", "attn.kv_a_proj": "kv_a",
    "attn.kv_b_proj": "kv_b", "c_fc": "up", "c_gate": "gate", "gate": "gate", "c_proj": "down",
    "router": "router",
}


@dataclass(frozen=True)
class Linear:
    """`count` modules Linear(in_features, out_features) in the whole model."""

    name: str  # the inventory's module path, e.g. "moe.experts.c_fc"
    target: str  # q, k, v, qkv, o, up, gate, down, ...
    in_features: int
    out_features: int
    count: int
    bias: bool = False

    @property
    def weights(self) -> int:
        """Weight elements of the `count` modules (biases apart)."""
        return self.count * self.in_features * self.out_features


def _target(module: str) -> str:
    """The target name of a module path (a trailing index of a per-head module list dropped)."""
    parts = [p for p in module.split(".") if not p.isdigit()]
    for key in (".".join(parts[-2:]), parts[-1]):
        if key in _TARGETS:
            return _TARGETS[key]
    return parts[-1]


def block_linears(cfg: GPTConfig) -> list[Linear]:
    """Every block Linear kind of `cfg` (a test checks their weights and biases against the
    blocks' parameters less their norms)."""
    tensors = [t for t in inventory(cfg) if t.place == "block" and t.role in ("matrix", "bias")]
    biased = {t.name.rsplit(".", 1)[0] for t in tensors if t.role == "bias"}
    out = []
    for t in tensors:
        if t.role != "matrix":
            continue
        module = t.name.rsplit(".", 1)[0]
        out.append(Linear(module, _target(module), t.shape[1], t.shape[0], t.count,
                          module in biased))
    return out


def targets(cfg: GPTConfig) -> tuple[str, ...]:
    """The target names this architecture has, in module order."""
    return tuple(dict.fromkeys(m.target for m in block_linears(cfg)))
