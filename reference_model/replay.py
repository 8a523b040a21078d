"""The reference model's CPU memory trace, replayed: a predictor of MemTracker, for verification.

`gptcalc.memory` answers the user's question with a phase model. This module predicts, node by
node, what PyTorch eager on CPU allocates and frees through one training step of the reference
model (reference_model/model.py) on one device, so that `gptcalc verify` can tell a
disagreement of the formulas from one of the allocator: it knows the model's parameter order,
its buffers, CPU AdamW's temporaries and autograd's node order, which the calculator must not.

- `backward_walk`: live bytes through backward, node by node (`_Walk`);
- `forward_end`: the forward's last op;
- `replay_peak`: the largest of the forward's end, the walk and the optimizer step.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from gptcalc.config import GPTConfig
from gptcalc.training_setup import TrainingSetup
from gptcalc.workload import Workload
from gptcalc.memory import autocast_weight_copies, saved_activations, state_bytes
from gptcalc.memory.ledger import BACKWARD_PASS, Phase
from gptcalc.memory.profile_reference import _norm_lines
from gptcalc.memory.peak import (saved_before_attention_core, sdpa_math_output_transients,
                                 sdpa_math_path_16bit, sdpa_math_transients)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _layer_tensors(cfg: GPTConfig) -> int:
    """nn.Parameter objects of one block: per_head q/k/v are one Linear per head and role."""
    qkv_mats = {"fused": 1, "separate": 3, "per_head": 3 * cfg.n_head}[cfg.qkv_layout]
    mlp_mats = 3 if cfg.mlp == "swiglu" else 2
    return (qkv_mats * (2 if cfg.qkv_bias else 1) + (2 if cfg.attn_out_bias else 1)
            + mlp_mats * (2 if cfg.mlp_bias else 1) + 2 * _norm_tensors(cfg))


def _norm_tensors(cfg: GPTConfig) -> int:
    return 2 if cfg.norm == "layernorm" else 1


def _embedding_tensors(cfg: GPTConfig) -> int:
    return 1 + (1 if cfg.pos_embedding == "learned" else 0)


# ---------------------------------------------------------------------------------------------
# Buffers, the step peak, the summary
# ---------------------------------------------------------------------------------------------


def buffer_bytes(cfg: GPTConfig, setup: TrainingSetup) -> int:
    """Non-parameter buffers of the reference model: each block's T x T `tril` mask, rotary
    cos/sin tables (T x rotary_dims each, per block), the sinusoidal table (T x E), in the weights'
    dtype (the model is cast as a whole)."""
    T, L = cfg.block_size, cfg.n_layer // setup.pp
    w = 2 if setup.mode in ("mixed", "bf16") else 4
    # GPT-NeoX's partial rotary keeps tables only for the rotated rotary_dims of each head
    per_block = T * T + (2 * T * cfg.rotary_dims if cfg.pos_embedding == "rotary" else 0)
    return w * (L * per_block + (T * cfg.n_embd if cfg.pos_embedding == "sinusoidal" else 0))


def param_sizes(cfg: GPTConfig) -> list[int]:
    """Elements of each parameter tensor of the reference model, in `model.parameters()` order
    (wte, wpe, per block ln_1, attention, ln_2, MLP, then ln_f and lm_head; a tied head weight
    is wte's tensor and is listed once)."""
    E, V, T, hd, Dff = cfg.n_embd, cfg.vocab_size, cfg.block_size, cfg.head_size, cfg.ffn_dim
    Dq, Dkv = cfg.q_width, cfg.kv_width

    def linear(i: int, o: int, bias: bool) -> list[int]:
        return [i * o] + ([o] if bias else [])

    norm = [E] * _norm_tensors(cfg)
    out = [V * E] + ([T * E] if cfg.pos_embedding == "learned" else [])
    qkv = {"fused": linear(E, Dq + 2 * Dkv, cfg.qkv_bias),
           "separate": linear(E, Dq, cfg.qkv_bias) + 2 * linear(E, Dkv, cfg.qkv_bias),
           "per_head": cfg.n_head * linear(E, hd, cfg.qkv_bias) + cfg.kv_heads * 2
           * linear(E, hd, cfg.qkv_bias)}[cfg.qkv_layout]
    mlp = linear(E, Dff, cfg.mlp_bias) * (2 if cfg.mlp == "swiglu" else 1) + linear(
        Dff, E, cfg.mlp_bias)
    block = norm + qkv + linear(Dq, E, cfg.attn_out_bias) + norm + mlp
    out += cfg.n_layer * block + (norm if cfg.final_norm else [])
    out += ([] if cfg.tie_embeddings else [V * E]) + ([V] if cfg.lm_head_bias else [])
    return out


def adamw_cpu_temps(cfg: GPTConfig) -> int:
    """Elements of the CPU single-tensor AdamW's temporaries at their largest.

    torch.optim.adamw's `_single_tensor_adamw` computes `denom = (exp_avg_sq.sqrt() /
    bias_correction2_sqrt).add_(eps)` per parameter: two tensors of the parameter's size, while
    `denom` of the previous parameter is still bound (Python rebinds it only after the new one
    exists). Peak: max over consecutive parameters of 2 * size_i + size_(i-1).
    """
    sizes = param_sizes(cfg)
    return max(2 * n + (sizes[i - 1] if i else 0) for i, n in enumerate(sizes))


class _Walk:
    """Live bytes through backward, as named lines; remembers the lines at the largest total.

    `alloc` is checked after each allocation (a dispatch-mode tracker measures after every op),
    `free` lowers the total without a check (autograd frees a node's inputs and saved tensors
    after the node returns)."""

    def __init__(self, lines: dict[str, int]) -> None:
        self.lines = dict(lines)
        self.total = sum(lines.values())
        start = Phase.BACKWARD_START.label
        self.peak, self.at, self.peak_lines = self.total, start, dict(lines)
        self.log: list[tuple[str, int]] = [(start, self.total)]  # after each alloc
        self.moments: list[tuple[str, dict[str, int]]] = [(start, dict(lines))]

    def alloc(self, where: str, **nbytes: int) -> None:
        for k, v in nbytes.items():
            self.lines[k] = self.lines.get(k, 0) + v
            self.total += v
            if self.total > self.peak:
                self.peak, self.at, self.peak_lines = self.total, where, dict(self.lines)
            self.moments.append((where, dict(self.lines)))
        self.log.append((where, self.total))

    def free(self, **nbytes: int) -> None:
        for k, v in nbytes.items():
            self.lines[k] -= v
            self.total -= v



# a plain block's saved lines that selective recomputation makes again (the attention core)
_CORE_LINES = ("attn/q", "attn/k_t", "attn/v", "attn/causal_mask", "attn/softmax",
               "attn/dropout_mask", "attn/dropped", "attn/logsumexp")


def _recompute_block(w: _Walk, cfg: GPTConfig, workload: Workload, setup: TrainingSetup,
                     where: str, recomputed: int, to_core: int = 0) -> None:
    """A checkpointed block's forward, run again inside backward: `recomputed` bytes of saved
    tensors (a plain block's, less its input) come back. Early stop ends the recomputation at
    the last tensor saved: the MLP's dropout mask (its input and output then still alive) or,
    without dropout, the down projection's input (saved before the matmul runs). A parallel
    block also holds the attention branch's sum with the input there. SDPA's CPU math path on
    16-bit inputs first peaks inside the recomputed attention core: `to_core` bytes of the
    block (ln_1's, the core's, amp's copy of the q/k/v weight) beside
    `sdpa_math_output_transients`."""
    b, S = workload.batch_size, workload.seq_len
    N, a, E = b * S, setup.act_bytes, cfg.n_embd
    r = 4 if setup.mode in ("fp32", "amp") else a
    extra = (2 * N * E * a if cfg.dropout > 0 else 0) + (N * E * r if cfg.parallel_residual
                                                         else 0)
    plain = dataclasses.replace(setup, recompute="none")
    if sdpa_math_path_16bit(cfg, plain):  # SDPA's math path on 16-bit inputs runs whole
        # inside the recomputation: its transients at its output's cast, beside the `to_core`
        # bytes the recomputation has made by then
        core = sdpa_math_output_transients(cfg, workload, plain)
        w.alloc(f"{where} recompute attention core", saved=to_core, recompute=core)
        w.free(saved=to_core, recompute=core)
    w.alloc(f"{where} recompute", saved=recomputed, recompute=extra)
    w.free(recompute=extra)


class _Backward:
    """One backward pass of the reference model on CPU, onto a `_Walk` (`self.w`): the sizes
    every node reads, set once, then one method per part of the model in the order autograd
    runs them (loss and head, final norm, the blocks from the last, the embeddings)."""

    def __init__(self, cfg: GPTConfig, workload: Workload, setup: TrainingSetup) -> None:
        self.cfg, self.workload, self.setup = cfg, workload, setup
        b, S = workload.batch_size, workload.seq_len
        N, a, g = b * S, setup.act_bytes, setup.weight_bytes
        V, L = cfg.vocab_size, cfg.n_layer
        self.b, self.S, self.N, self.a, self.g = b, S, N, a, g
        self.drop = cfg.dropout > 0
        self.par = cfg.parallel_residual
        acts = saved_activations(cfg, workload, setup)
        rec = setup.recompute
        # what a block saves without recomputation: torch.utils.checkpoint's recomputation
        # makes exactly these tensors again inside backward (full: the whole block, whose input
        # the checkpoint already keeps; selective: the attention core)
        plain = dataclasses.replace(setup, recompute="none")
        self.acts_plain = acts if rec == "none" else saved_activations(cfg, workload, plain)
        self.plain_layer = {k[len("layer/"):]: v // L for k, v in self.acts_plain.items()
                            if k.startswith("layer/")}
        layer_saved = sum(v for k, v in acts.items() if k.startswith("layer/")) // L
        if rec == "full":
            layer_saved = sum(self.plain_layer.values())
        sizes = param_sizes(cfg)
        n_emb = _embedding_tensors(cfg)
        self.layer_grads = g * sum(sizes[n_emb:n_emb + _layer_tensors(cfg)])
        self.lp = acts["cross_entropy/log_probs"] // (N * V)
        self.stats = acts.get("final/ln_f/mean", acts.get("layer/ln_1/mean", 0) // L) // N if (
            cfg.norm != "rmsnorm") else 0
        # amp: fp32 weights under autocast. The residual stream, norms and embeddings are fp32
        # (r bytes); each Linear gets a 16-bit copy of its weight (saved, freed with the
        # Linear's node) and of its input when that is fp32; its backward makes 16-bit
        # gradients, which the casts' backward (ToCopyBackward) turns into fp32: the input's
        # gradient, then the weight's and the bias's (AccumulateGrad keeps those), each freeing
        # its 16-bit source.
        self.amp = setup.mode == "amp"
        self.r = 4 if setup.mode in ("fp32", "amp") else a
        # amp: the fp32 stream's gradient is cast to a block's 16-bit branches
        self.cast = self.r != a
        # full recomputation remakes each block's weight copies with the block
        self.copies = autocast_weight_copies(cfg, plain if rec == "full" else setup)
        layer_saved += sum(v for k, v in self.copies.items() if not k.endswith("lm_head")) // L
        self.layer_saved = layer_saved
        first = state_bytes(cfg, setup, "first")
        self.lossb = self.lp  # the loss is the cross entropy's dtype (fp32 under autocast)
        self.w = _Walk({"weights": first.weights, "optimizer": first.optimizer,
                        "buffers": buffer_bytes(cfg, setup),
                        "saved": sum(v for k, v in acts.items() if k != "input/idx"),
                        "logits": N * V * a, "loss": 2 * self.lossb, "gradients": 0,
                        "grad_flow": 0})

    # --- the steps every part is made of

    def lin_grads(self, n: int) -> dict[str, int]:
        """A Linear's weight and bias gradients as its backward makes them."""
        return {"grad_flow": self.a * n} if self.amp else {"gradients": self.g * n}

    def lin_casts(self, where: str, *ns: int) -> None:
        """amp: the 16-bit weight / bias gradients cast to fp32 and accumulated, in turn."""
        if self.amp:
            for n in ns:
                if n:
                    self.w.alloc(where, gradients=self.g * n)
                    self.w.free(grad_flow=self.a * n)

    def lin(self, where: str, in_grad: int, n: int) -> None:
        """A Linear's backward: its input's gradient (bytes), weight and bias gradients (n)."""
        if self.amp:
            self.w.alloc(where, grad_flow=in_grad + self.a * n)
        else:
            self.w.alloc(where, grad_flow=in_grad, gradients=self.g * n)

    def cp(self, name: str) -> int:
        """amp: one block's 16-bit copy of a weight, saved by its Linear."""
        return self.copies.get(f"weight_copy/{name}", 0) // self.cfg.n_layer

    def input_cast(self, where: str, n: int) -> None:
        """amp: a Linear's input gradient (n elements) cast back to the fp32 stream's dtype."""
        if self.r != self.a:
            self.w.alloc(where, grad_flow=n * self.r)
            self.w.free(grad_flow=n * self.a)

    def input_sum(self, where: str) -> None:
        """Two gradients of one tensor summed out of place, then both freed."""
        N, E, r = self.N, self.cfg.n_embd, self.r
        self.w.alloc(where, grad_flow=N * E * r)
        self.w.free(grad_flow=2 * N * E * r)

    def norm(self, where: str, residual: bool, shared: bool = False) -> None:
        """Backward of a norm whose incoming gradient (N*E) is in grad_flow; leaves its input's
        gradient there, summed with the residual stream's gradient when `residual`. `shared`:
        GPT-NeoX's parallel ln_2, whose input is ln_1's (saved once, freed there) and whose
        residual gradient is also the attention branch's incoming one (kept alive for it)."""
        w, cfg = self.w, self.cfg
        N, E, r, g = self.N, cfg.n_embd, self.r, self.g
        keep = N * E * r if shared else 0
        if cfg.norm == "rmsnorm":
            ne = N * E * r
            # x * rsqrt(mean(x^2) + eps) * w, written out: grad * w and grad * x_hat (summed to
            # the weight's gradient); then grad_x_hat * r, grad_x_hat * x and its row sum
            w.alloc(where, grad_flow=2 * ne)
            w.alloc(where, gradients=g * E)
            w.free(grad_flow=2 * ne, saved=ne)  # grad * x_hat, the incoming gradient; x * r
            w.alloc(where, grad_flow=2 * ne)
            w.alloc(where, grad_flow=N * r)
            w.free(grad_flow=2 * ne)
            if residual:
                w.alloc(where, grad_flow=ne)
                w.free(grad_flow=2 * ne - keep)
            w.alloc(where, grad_flow=3 * N * r)  # rsqrt and mean backward, per row
            w.free(grad_flow=3 * N * r, saved=N * r)  # ... and rsqrt's saved result
            w.alloc(where, grad_flow=ne)  # mean's expand / E
            w.free(grad_flow=N * r)
            w.alloc(where, grad_flow=3 * ne)  # pow's backward: x^1, * 2, * grad
            # the node returns: its two temporaries, its incoming gradient and its saved x go;
            # then its result is summed into x's gradient (out of place) and both summands go
            w.free(grad_flow=3 * ne, saved=ne - keep)
            w.alloc(where, grad_flow=ne)
            w.free(grad_flow=2 * ne)
            return
        w.alloc(where, grad_flow=N * E * r, gradients=g * E * _norm_tensors(cfg))
        w.free(grad_flow=N * E * r, saved=N * E * r - keep + 2 * N * self.stats)
        if residual:
            w.alloc(where, grad_flow=N * E * r)
            w.free(grad_flow=2 * N * E * r - keep)

    # --- the model's parts, in backward's order

    def loss_and_head(self) -> None:
        """The seed gradient, the cross entropy and lm_head."""
        w, cfg = self.w, self.cfg
        N, E, V, a, lp = self.N, cfg.n_embd, cfg.vocab_size, self.a, self.lp
        w.free(loss=self.lossb)  # the seed gradient, moved into the engine and dropped
        w.alloc("cross entropy", grad_flow=N * V * lp)
        w.alloc("cross entropy", grad_flow=N * V * lp)
        w.free(grad_flow=N * V * lp, saved=N * V * lp)  # total_weight stays with the graph
        if lp != a:  # autocast ran the cross entropy on an fp32 copy of the logits
            w.alloc("cross entropy", grad_flow=N * V * a)
            w.free(grad_flow=N * V * lp)
        head_w, head_b = V * E, (V if cfg.lm_head_bias else 0)
        w.alloc("lm_head", **self.lin_grads(head_w + head_b))
        w.alloc("lm_head", grad_flow=N * E * a)
        w.free(grad_flow=N * V * a, saved=N * E * a + self.copies.get("weight_copy/lm_head", 0))
        self.input_cast("lm_head", N * E)
        self.lin_casts("lm_head", head_w, head_b)

    def block(self, layer: int, head_grads: int) -> None:
        """Block `layer` counted from the last: its recomputation (full), the MLP, ln_2, the
        attention, the q/k/v input path and ln_1. `head_grads`: the gradients alive before
        the blocks (lm_head's, the final norm's)."""
        L = self.cfg.n_layer
        where = "last block" if layer == 0 else ("first block" if layer == L - 1 else "block")
        if self.setup.recompute == "full":
            self.recompute_full(where)
        start = self.w.total
        self.mlp(where)
        self.norm(f"{where} ln_2", True, shared=self.par)
        self.attention(where)
        self.qkv_input_path(where, layer, head_grads, start)

    def recompute_full(self, where: str) -> None:
        """Full recomputation: the block's first saving node in backward (the MLP's dropout or
        down projection) unpacks a checkpointed tensor, and the whole block's forward runs
        again (non-reentrant checkpoint, early stop: up to the last tensor it saves), leaving
        every tensor a plain block saves alive beside the input the checkpoint kept."""
        N, E, r = self.N, self.cfg.n_embd, self.r
        # ... less the block's input, which the checkpoint kept
        to_core = sum(v for k, v in self.plain_layer.items() if k.startswith(("ln_1/", "attn/"))
                      and k not in ("attn/out_input", "attn/resid_dropout_mask")
                      ) - N * E * r + sum(
            self.cp(c[len("weight_copy/"):]) for c in self.copies
            if c.startswith("weight_copy/attention/") and c != "weight_copy/attention/out")
        _recompute_block(self.w, self.cfg, self.workload, self.setup, where,
                         self.layer_saved - N * E * r, to_core)

    def mlp(self, where: str) -> None:
        """The MLP: g (N*E) is in grad_flow and stays there (the residual branch holds it).
        amp: the fp32 stream's gradient is cast to the 16-bit branch (ToCopyBackward of the
        branch output's promotion), which the branch's first node then owns."""
        w, cfg = self.w, self.cfg
        N, E, Dff, a, drop, cast = self.N, cfg.n_embd, cfg.ffn_dim, self.a, self.drop, self.cast
        if cast:
            w.alloc(f"{where} mlp output cast", grad_flow=N * E * a)
        if drop:
            w.alloc(f"{where} mlp dropout", grad_flow=N * E * a)
            w.free(saved=N * E, grad_flow=N * E * a if cast else 0)
        hid = N * Dff * a
        nb_e, nb_f = (E, Dff) if cfg.mlp_bias else (0, 0)
        self.lin(f"{where} mlp proj", hid, Dff * E + nb_e)
        w.free(grad_flow=N * E * a if (drop or cast) else 0,
               saved=(0 if cfg.mlp == "relu" else hid) + self.cp("mlp/proj"))
        self.lin_casts(f"{where} mlp proj", Dff * E, nb_e)
        if cfg.mlp == "swiglu":
            w.alloc(f"{where} mlp swiglu", grad_flow=2 * hid)
            w.free(grad_flow=hid, saved=2 * hid)  # up output, silu output
            self.lin(f"{where} mlp up", N * E * a, E * Dff + nb_f)
            # amp: up and gate read their own 16-bit copies of ln_2's output
            w.free(grad_flow=hid, saved=(N * E * a if self.amp else 0) + self.cp("mlp/fc"))
            self.input_cast(f"{where} mlp up", N * E)
            self.lin_casts(f"{where} mlp up", E * Dff, nb_f)
            w.alloc(f"{where} mlp silu", grad_flow=hid)
            w.free(grad_flow=hid, saved=hid)  # the gate's output
            self.lin(f"{where} mlp gate", N * E * a, E * Dff + nb_f)
            w.free(grad_flow=hid, saved=N * E * a + self.cp("mlp/gate"))
            self.input_cast(f"{where} mlp gate", N * E)
            self.lin_casts(f"{where} mlp gate", E * Dff, nb_f)
            self.input_sum(f"{where} mlp input sum")
        else:
            w.alloc(f"{where} mlp activation", grad_flow=hid)
            w.free(grad_flow=hid, saved=hid * (2 if cfg.mlp in ("gelu", "gelu_tanh") else 1)
                   - (hid if cfg.mlp != "relu" else 0))
            self.lin(f"{where} mlp fc", N * E * a, E * Dff + nb_f)
            w.free(grad_flow=hid, saved=N * E * a + self.cp("mlp/fc"))
            self.input_cast(f"{where} mlp fc", N * E)
            self.lin_casts(f"{where} mlp fc", E * Dff, nb_f)

    def attention(self, where: str) -> None:
        """The attention's output side: its dropout and output projection, then the core. In a
        parallel block the stream's gradient is freed by the branch's first node (the
        attention branch holds it last)."""
        w, cfg, setup = self.w, self.cfg, self.setup
        N, E, Dq, a, r, drop = self.N, cfg.n_embd, cfg.q_width, self.a, self.r, self.drop
        if self.cast:
            w.alloc(f"{where} attn output cast", grad_flow=N * E * a)
            w.free(grad_flow=N * E * r if self.par else 0)
        owned = self.cast or self.par
        if drop:
            w.alloc(f"{where} attn dropout", grad_flow=N * E * a)
            w.free(saved=N * E, grad_flow=N * E * a if owned else 0)
        ob = E if cfg.attn_out_bias else 0
        self.lin(f"{where} attn proj", N * Dq * a, Dq * E + ob)
        flash = setup.attn_impl == "sdpa" and not drop
        # SDPA's fused kernel saves its own output for backward: c_proj's input is that very
        # tensor (unless partial rotary made c_proj's input a copy), freed only after the core;
        # selective recomputation makes the kernel's output anew, c_proj keeps the first
        out_shared = (flash and not self.acts_plain.get("layer/attn/sdpa_out", 0)
                      and setup.recompute != "selective")
        # the dropout's gradient; in a parallel block also the block output's gradient, which
        # the attention branch was the last to hold
        w.free(grad_flow=N * E * a if (drop or owned) else 0,
               saved=(0 if out_shared else N * Dq * a) + self.cp("attention/out"))
        self.lin_casts(f"{where} attn proj", Dq * E, ob)
        if flash:
            self.attention_core_flash(where)
        else:
            self.attention_core(where)

    def attention_core(self, where: str) -> None:
        """The core node by node: manual attention, or SDPA's CPU math path (with dropout)."""
        w, cfg, setup, workload = self.w, self.cfg, self.setup, self.workload
        N, Dq, a, drop = self.N, cfg.q_width, self.a, self.drop
        b, S, H = self.b, self.S, cfg.n_head
        att = b * H * S * S
        rec = setup.recompute
        core_saved = sum(v for k, v in self.plain_layer.items() if k in _CORE_LINES)
        math_core_transients = 0
        if rec == "selective" and setup.attn_impl == "sdpa":
            # ... beside the fp32 gradient of the core's output: the math path returns fp32
            # and casts it to 16 bit, whose backward (ToCopyBackward) upcasts the incoming
            # gradient before the recomputation, in place of the 16-bit contiguous copy
            math_core_transients = sdpa_math_transients(cfg, workload, setup) + (
                N * Dq * (4 - a))
        m = a if setup.attn_impl == "manual" else 4
        w.alloc(f"{where} attn core", grad_flow=N * Dq * a)  # contiguous grad for the view
        w.free(grad_flow=N * Dq * a)
        if rec == "selective":  # att @ v's backward unpacks: the core runs again
            w.alloc(f"{where} attn core recompute", saved=core_saved,
                    recompute=math_core_transients)
            w.free(recompute=math_core_transients)
        w.alloc(f"{where} attn core", grad_flow=att * m + N * Dq * m)  # att @ v
        w.free(grad_flow=N * Dq * a, saved=N * Dq * m + (att * m if drop else 0))
        if drop:
            w.alloc(f"{where} attn core", grad_flow=att * m)
            w.free(grad_flow=att * m, saved=att * (1 if setup.attn_impl == "manual" else m))
        w.alloc(f"{where} attn core", grad_flow=att * m)  # softmax
        w.free(grad_flow=att * m, saved=att * m)
        if setup.attn_impl == "manual":
            w.alloc(f"{where} attn core", grad_flow=att * m)  # masked_fill
            w.free(grad_flow=att * m)
            w.alloc(f"{where} attn core", grad_flow=att * m)  # scale
            w.free(grad_flow=att * m, saved=S * S)
        w.alloc(f"{where} attn core", grad_flow=2 * N * Dq * m)  # q @ k^T

    def attention_core_flash(self, where: str) -> None:
        """SDPA flash's single backward kernel: the q, k and v gradients at once."""
        N, Dq, a = self.N, self.cfg.q_width, self.a
        if self.setup.recompute == "selective":  # the kernel's output and logsumexp, made again
            core_saved = sum(v for k, v in self.plain_layer.items() if k in _CORE_LINES)
            self.w.alloc(f"{where} attn core recompute", saved=core_saved + N * Dq * a)
        self.w.alloc(f"{where} attn core", grad_flow=3 * N * Dq * a)

    def qkv_input_path(self, where: str, layer: int, head_grads: int, start: int) -> None:
        """The q/k/v input path (views, rotary, grouped-query sums, the projections' backward
        and the sum of their input gradients) as one step, to the exact level before ln_1's
        backward: every block parameter gradient but ln_1's allocated, ln_1's saved tensors
        alive, its output's gradient and the residual stream's gradient in flight; then ln_1.
        `start`: the live level at the block's start (after a full recomputation)."""
        w, cfg = self.w, self.cfg
        N, E, r, g = self.N, cfg.n_embd, self.r, self.g
        ln_1_grads = g * E * _norm_tensors(cfg)
        ln_1_saved = sum(_norm_lines(cfg, N, r, self.stats).values())
        end = start - self.layer_saved + self.layer_grads
        w.lines.update(gradients=head_grads + (layer + 1) * self.layer_grads - ln_1_grads,
                       grad_flow=2 * N * E * r)
        w.lines["saved"] = (end + ln_1_saved + N * E * r - ln_1_grads
                            - sum(v for k, v in w.lines.items() if k != "saved"))
        w.total = sum(w.lines.values())
        w.log.append((f"{where} q/k/v input path (one step)", w.total))
        w.moments.append((f"{where} q/k/v input path (one step)", dict(w.lines)))
        self.norm(f"{where} ln_1", True)
        assert w.total == end, (w.total, end)

    def embeddings(self) -> None:
        """The stream's gradient goes to wpe's node first (created later), then wte's."""
        w, cfg = self.w, self.cfg
        N, E, V, T, S, r, g = (self.N, cfg.n_embd, cfg.vocab_size, cfg.block_size, self.S,
                               self.r, self.g)
        if self.drop and cfg.embd_dropout:
            w.alloc("embedding dropout", grad_flow=N * E * r)
            w.free(grad_flow=N * E * r, saved=N * E)
        if cfg.pos_embedding == "learned":
            w.alloc("position embedding", grad_flow=S * E * r)  # summed over the batch
            w.alloc("position embedding", gradients=g * T * E)
            w.free(grad_flow=S * E * r, saved=8 * S)
        w.alloc("token embedding", gradients=g * V * E)
        w.free(grad_flow=N * E * r)
        if cfg.tie_embeddings:  # AccumulateGrad adds out of place into lm_head's gradient
            w.alloc("token embedding", gradients=g * V * E)
            w.free(gradients=2 * g * V * E)


def backward_walk(cfg: GPTConfig, workload: Workload, setup: TrainingSetup) -> _Walk:
    """The live bytes of one backward pass of the reference model on CPU, node by node.

    Start: weights, optimizer states and buffers, every saved activation (less the batch's idx,
    which no op returns), the logits the caller holds, the loss and its seed gradient. Each
    autograd node then allocates its outputs (gradients of its inputs, parameter gradients that
    AccumulateGrad keeps) and, after it returns, frees its incoming gradient and the saved tensors
    no later node needs. Modelled node by node: the cross entropy, lm_head, final norm, the MLP,
    the residual sum, the attention output projection and core (manual; SDPA's CPU math path with
    dropout; SDPA flash's single backward kernel), the embeddings. The q/k/v input path (views,
    rotary, per-head projections) is taken as one step to the block's exact end level (its
    saved tensors freed, its parameter gradients allocated): it allocates less than the core
    before it. Blocks repeat with the live level moving by (parameter gradients - saved
    activations) of one block. Recomputation: full recomputes each block's saved tensors at its
    start (`_recompute_block`), selective the attention core's at the core (SDPA's math path
    with its forward's transients, `sdpa_math_transients`); then the plain block's walk runs.
    The forward's end is `forward_end`, from this walk's start.
    """
    p = _Backward(cfg, workload, setup)
    p.loss_and_head()
    if cfg.final_norm:
        p.norm("final norm", False)
    head_grads = p.w.lines["gradients"]
    for layer in range(cfg.n_layer):
        p.block(layer, head_grads)
    p.embeddings()
    return p.w


@dataclass(frozen=True)
class StepPeak:
    """The peak of one steady-state training step (after the first, whose states exist)."""

    bytes: int
    # a moment's label (`gptcalc.memory.ledger`): the forward's end, the attention core, the
    # optimizer step, or the backward pass walked op by op (`BACKWARD_PASS`)
    phase: str
    why: str
    phases: dict[str, int]
    lines: dict[str, int] = field(default_factory=dict)  # what is alive at the peak


def linear_bias_elements(cfg: GPTConfig) -> int:
    """Elements of every Linear bias of the reference model (q/k/v, attention output, MLP,
    lm_head), the tensors autocast casts to 16 bit without any op saving the copy."""
    E, Dq, Dkv, Dff, _H = cfg.n_embd, cfg.q_width, cfg.kv_width, cfg.ffn_dim, cfg.n_head
    qkv = (Dq + 2 * Dkv) if cfg.qkv_bias else 0  # per_head: H Linears of head_dim each role
    mlp = (Dff * (2 if cfg.mlp == "swiglu" else 1) + E) if cfg.mlp_bias else 0
    block = qkv + (E if cfg.attn_out_bias else 0) + mlp
    return cfg.n_layer * block + (cfg.vocab_size if cfg.lm_head_bias else 0)


def forward_end(cfg: GPTConfig, workload: Workload, setup: TrainingSetup, walk: _Walk
                ) -> tuple[int, dict[str, int]]:
    """Live bytes at the forward's last op (the loss made, its seed gradient not yet), from the
    backward walk's start: what the forward still holds that backward does not.

    Autocast (amp, mixed) runs the cross entropy on an fp32 copy of the 16-bit logits (N V 4),
    freed when the forward returns. Under amp torch.autocast also keeps, until the autocast
    region exits, its cached 16-bit casts of the fp32 Linear biases (2 bytes each; no op saves
    them: the addmm's backward needs no bias), and GPT.forward's local `x` (the final norm's or
    last block's fp32 output, N E 4) beside its 16-bit cast that lm_head saved. With full
    recomputation the blocks run inside torch.utils.checkpoint, whose casts are not cached."""
    b, S = workload.batch_size, workload.seq_len
    N, lines = b * S, dict(walk.moments[0][1])
    lines["loss"] -= walk.moments[0][1]["loss"] // 2  # the seed gradient is not made yet
    extra = {}
    if setup.mode in ("amp", "mixed"):
        extra["logits"] = N * cfg.vocab_size * 4
    if setup.mode == "amp":
        biases = linear_bias_elements(cfg)
        if setup.recompute == "full":
            biases = cfg.vocab_size if cfg.lm_head_bias else 0
        extra["autocast_cache"] = 2 * biases
        extra["grad_flow"] = N * cfg.n_embd * 4
    for k, v in extra.items():
        lines[k] = lines.get(k, 0) + v
    return sum(lines.values()), lines


def forward_attention_core(cfg: GPTConfig, workload: Workload, setup: TrainingSetup
                           ) -> tuple[int, dict[str, int]]:
    """Live bytes when SDPA's CPU math path, on 16-bit inputs, casts the last block's attention
    output back to 16 bit (0 outside that path): weights, optimizer states, buffers, the saved
    tensors made so far (`gptcalc.memory.peak.saved_before_attention_core`), the path's
    transients (`sdpa_math_output_transients`) and, under amp, autocast's cached 16-bit casts
    of the biases used so far (every earlier block's, this block's q/k/v projection's)."""
    if not sdpa_math_path_16bit(cfg, setup):
        return 0, {}
    first = state_bytes(cfg, setup, "first")
    lines = {"weights": first.weights, "optimizer": first.optimizer,
             "buffers": buffer_bytes(cfg, setup),
             "saved": saved_before_attention_core(
                 cfg, saved_activations(cfg, workload, setup), setup),
             "attention core transients": sdpa_math_output_transients(cfg, workload, setup)}
    if setup.mode == "amp":
        per_block = (linear_bias_elements(cfg) - (cfg.vocab_size if cfg.lm_head_bias else 0)
                     ) // cfg.n_layer
        qkv = cfg.q_width + 2 * cfg.kv_width if cfg.qkv_bias else 0
        lines["autocast_cache"] = 2 * ((cfg.n_layer - 1) * per_block + qkv)
    return sum(lines.values()), lines


def replay_peak(cfg: GPTConfig, workload: Workload, setup: TrainingSetup) -> StepPeak:
    """Peak bytes of one steady-state step of the reference model on one CPU device, as
    MemTracker sums live tensor storages after every op: the largest of the forward's end
    (`forward_end`), the backward walk (`backward_walk`) and the optimizer step (weights,
    gradients, states, buffers, the caller's targets and CPU AdamW's temporaries,
    `adamw_cpu_temps`; mixed: MasterWeights' fp32 master gradients). One device only: the
    reference model does not run parallel layouts."""
    first = state_bytes(cfg, setup, "first")
    walk = backward_walk(cfg, workload, setup)
    backward, at, walk_lines = walk.peak, walk.at, walk.peak_lines
    # the update runs on fp32 tensors in fp32 and amp, and in mixed on MasterWeights' fp32
    # masters, whose `.grad` is an fp32 copy of every 16-bit gradient for the whole step
    wb = 4 if setup.mode in ("fp32", "amp", "mixed") else 2
    master_grads = 0
    if setup.mode == "mixed":
        master_grads = 4 * _ceil(first.params, setup.dp if setup.zero >= 2 else 1)
    if setup.optimizer != "adamw":
        temps = 0
    elif setup.device == "cuda":
        temps = _ceil(first.params, setup.dp if setup.zero else 1) * wb
    else:
        temps = adamw_cpu_temps(cfg) * wb
    targets = 8 * (workload.batch_size) * workload.seq_len
    opt_lines = {"weights": first.weights, "optimizer": first.optimizer,
                 "buffers": buffer_bytes(cfg, setup), "gradients": first.gradients,
                 "targets": targets, "optimizer/temporaries": temps,
                 "optimizer/master_gradients": master_grads}
    optimizer = sum(opt_lines.values())
    fwd, fwd_lines = forward_end(cfg, workload, setup, walk)
    core, core_lines = forward_attention_core(cfg, workload, setup)
    forward, attention = Phase.FORWARD_END.label, Phase.ATTENTION_CORE.label
    step = Phase.OPTIMIZER_STEP.label
    phases = {BACKWARD_PASS: backward, step: optimizer, forward: fwd, attention: core}
    phase = max(phases, key=phases.get)
    why = {BACKWARD_PASS: f"backward at the {at}: saved activations, logits and gradients in "
                          "flight outweigh the gradients and update temporaries",
           step: "gradients plus the optimizer's temporaries outweigh the activations (small "
                 "batch)",
           forward: "the forward's end: its fp32 copy of the logits and autocast's cached "
                    "casts outweigh the backward's gradients in flight (small vocabulary)",
           attention: "the last block's attention core in the forward: SDPA's CPU math path "
                      "holds fp32 copies of 16-bit q, k, v, its score stacks and its output"}
    lines = {BACKWARD_PASS: walk_lines, step: opt_lines, forward: fwd_lines,
             attention: core_lines}[phase]
    return StepPeak(bytes=phases[phase], phase=phase, why=why[phase], phases=phases,
                    lines=lines)


