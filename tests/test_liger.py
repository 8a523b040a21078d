"""Liger's RMSNorm, SwiGLU and RoPE kernels under --impl transformers (--liger) against
transformers' Llama, Mistral and Qwen2 with those kernels patched in.

Liger's kernels are Triton programs; Triton's CPU interpreter (TRITON_INTERPRET=1, triton
3.9) cannot run liger-kernel 0.8.5's (its scalar `eps.to(tl.float32)` fails on a Python
float). What a kernel saves for backward is decided by its autograd Function in Python, not
by the Triton program, so the twin patches the model with pure-PyTorch stand-ins of those
Functions that save exactly the tensors Liger's save (liger-kernel 0.8.5):

- LigerRMSNormFunction (liger_kernel/ops/rms_norm.py): `X.view(-1, E)` of the contiguous
  input, the weight and an fp32 RSTD per row (casting mode "llama"): save_for_backward(X, W,
  RSTD); the output Y in X's dtype, X / rms(X) * W;
- LigerSiLUMulFunction (ops/swiglu.py), called by LigerSwiGLUMLP (transformers/swiglu.py) as
  down_proj(SiLUMul(gate_proj(x), up_proj(x))): save_for_backward(a, b), the gate and up
  outputs;
- LigerRopeFunction (ops/rope.py), liger_rotary_pos_emb: q and k rotated in place (their
  (b, S, heads, hd) storage made contiguous, which q_proj's and k_proj's outputs are),
  save_for_backward(cos, sin).

The patching is what `apply_liger_kernel_to_llama(model=...)` does to an instance
(transformers/monkey_patch.py): each decoder layer's input/post-attention norms and the final
norm, each layer's MLP, and the modeling module's `apply_rotary_pos_emb`.
`test_real_liger_functions_save_the_same` runs Liger's own Functions and monkey patch (their
Triton launches replaced by PyTorch) where liger-kernel is installed.

Expected values are measured (saved_tensors_hooks deduplicated by storage, MemTracker); the
profile under test never computes them.
"""

from __future__ import annotations

import json
import types
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from gptcalc.cli import cli  # noqa: E402
from gptcalc.config import GPTConfig  # noqa: E402
from gptcalc.errors import ConfigError  # noqa: E402
from gptcalc.families import ARCHS  # noqa: E402
from gptcalc.memory.profile_transformers import transformers_saved  # noqa: E402
from gptcalc.training_setup import LIGER_KERNELS, TrainingSetup, liger_kernels  # noqa: E402
from reference_model import transformers_twin as tw  # noqa: E402

# tests/test_memory_transformers.py's PEAK_TOLERANCE (the transformers profile's step peak
# against MemTracker: the batch made before the tracker starts is counted by gptcalc only)
PEAK_TOLERANCE = 0.02


# --------------------------------------------------------------------------- the stand-ins


class RMSNormFn(torch.autograd.Function):
    """LigerRMSNormFunction's saved set: (X, W, RSTD), RSTD fp32 per row."""

    @staticmethod
    def forward(ctx, X, W, eps):
        shape = X.shape
        X = X.contiguous().view(-1, shape[-1])
        rstd = torch.rsqrt(X.float().pow(2).mean(-1) + eps)
        Y = ((X.float() * rstd[:, None]).to(X.dtype) * W).to(X.dtype)
        ctx.save_for_backward(X, W, rstd)
        return Y.view(shape)

    @staticmethod
    def backward(ctx, dY):
        X, W, rstd = ctx.saved_tensors
        shape = dY.shape
        dy, x, r = dY.reshape(-1, shape[-1]).float(), X.float(), rstd[:, None]
        xhat = x * r
        dxhat = dy * W.float()
        dX = r * (dxhat - xhat * (dxhat * xhat).mean(-1, keepdim=True))
        dW = (dy * xhat).sum(0)
        return dX.to(X.dtype).view(shape), dW.to(W.dtype), None


class SiLUMulFn(torch.autograd.Function):
    """LigerSiLUMulFunction's saved set: (a, b), the gate and up projections' outputs."""

    @staticmethod
    def forward(ctx, a, b):
        a, b = a.contiguous(), b.contiguous()
        ctx.save_for_backward(a, b)
        return (torch.nn.functional.silu(a.float()) * b.float()).to(a.dtype)

    @staticmethod
    def backward(ctx, dc):
        a, b = ctx.saved_tensors
        af, bf, dcf = a.float(), b.float(), dc.float()
        sig = torch.sigmoid(af)
        silu = af * sig
        da = dcf * bf * (sig * (1 + af * (1 - sig)))
        return da.to(a.dtype), (dcf * silu).to(b.dtype)


def _rotate(x, cos, sin, sign):
    """x (b, S, heads, hd) rotated by cos/sin (1 or b, S, hd), in place (sign -1: backward)."""
    h = x.shape[-1] // 2
    c, s = cos[:, :, None, :], sign * sin[:, :, None, :]
    rot = torch.cat((-x[..., h:], x[..., :h]), -1)
    x.copy_((x * c + rot * s).to(x.dtype))
    return x


class RopeFn(torch.autograd.Function):
    """LigerRopeFunction's saved set: (cos, sin); q and k rotated in place."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        if cos.ndim == 2:
            cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
        q, k = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        _rotate(q, cos, sin, 1)
        _rotate(k, cos, sin, 1)
        ctx.save_for_backward(cos, sin)
        return q.transpose(1, 2), k.transpose(1, 2)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        dq, dk = dq.transpose(1, 2).contiguous(), dk.transpose(1, 2).contiguous()
        _rotate(dq, cos, sin, -1)
        _rotate(dk, cos, sin, -1)
        return dq.transpose(1, 2), dk.transpose(1, 2), None, None


def _rope(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    return RopeFn.apply(q, k, cos, sin)


def _norm_forward(self, hidden_states):
    return RMSNormFn.apply(hidden_states, self.weight, self.variance_epsilon)


def _mlp_forward(self, x):
    return self.down_proj(SiLUMulFn.apply(self.gate_proj(x), self.up_proj(x)))


def patch(model, kernels, monkeypatch) -> None:
    """The stand-ins patched into `model` as apply_liger_kernel_to_llama(model=model) does."""
    import importlib

    base = model.model
    if "rms_norm" in kernels:
        for norm in [base.norm] + [n for layer in base.layers for n in
                                   (layer.input_layernorm, layer.post_attention_layernorm)]:
            norm.forward = types.MethodType(_norm_forward, norm)
    if "swiglu" in kernels:
        for layer in base.layers:
            layer.mlp.forward = types.MethodType(_mlp_forward, layer.mlp)
    if "rope" in kernels:
        module = importlib.import_module(type(model).__module__)
        monkeypatch.setattr(module, "apply_rotary_pos_emb", _rope)


# --------------------------------------------------------------------------- the twin

MODES = {"fp32": (torch.float32, None, 4), "bf16": (torch.bfloat16, None, 2),
         "amp": (torch.float32, torch.bfloat16, 2)}


def _cfg(family: str, E: int = 32, L: int = 2, H: int = 4, V: int = 100, kv: int | None = 2
         ) -> GPTConfig:
    arch = {**{k: v for k, v in ARCHS["llama"].items() if k != "dropout"},
            "qkv_bias": family == "qwen2"}
    return GPTConfig(**arch, n_layer=L, n_head=H, n_embd=E, vocab_size=V, block_size=128,
                     dropout=0.0, n_kv_head=kv, d_ff=3 * E // 2)


def _setup(attn: str, mode: str, kernels, recompute: str = "none"):
    return SimpleNamespace(mode=mode, attn_impl=attn, device="cpu", recompute=recompute,
                           act_bytes=MODES[mode][2], liger=",".join(kernels))


def _model(family: str, cfg: GPTConfig, attn: str, mode: str, kernels, recompute, monkeypatch):
    model = tw.build(tw.hf_config_for(cfg, family), None if attn == "sdpa" else "eager",
                     dtype=MODES[mode][0])
    patch(model, kernels, monkeypatch)
    return tw.apply_recompute(model, recompute)


def _measured(family, cfg, attn, mode, kernels, recompute, B, S, monkeypatch) -> int:
    model = _model(family, cfg, attn, mode, kernels, recompute, monkeypatch)
    idx, labels = tw.make_batch(cfg.vocab_size, B, S)
    saved = tw.measure_saved(model, idx, labels, amp_dtype=MODES[mode][1]).activation_bytes
    if mode == "amp":  # each Linear's bf16 weight copy, which gptcalc counts as weight_copy/
        # (a checkpointed layer's are made again in its recomputation, not saved)
        saved -= sum(2 * m.weight.numel() for name, m in model.named_modules()
                     if isinstance(m, torch.nn.Linear)
                     and (recompute == "none" or ".layers." not in name))
    return saved


@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(family=st.sampled_from(["llama", "mistral", "qwen2"]),
       kernels=st.sets(st.sampled_from(LIGER_KERNELS), min_size=1),
       mode=st.sampled_from(list(MODES)), recompute=st.sampled_from(["none", "full"]),
       attn=st.sampled_from(["sdpa", "manual"]), E=st.sampled_from([32, 64]),
       H=st.sampled_from([1, 2, 4]), kv_half=st.booleans(), V=st.integers(100, 1000),
       S=st.integers(8, 64), B=st.integers(1, 3))
def test_saved_bytes_exact(family, kernels, mode, recompute, attn, E, H, kv_half, V, S, B,
                           monkeypatch):
    kernels = [k for k in LIGER_KERNELS if k in kernels]
    cfg = _cfg(family, E=E, H=H, V=V, kv=max(1, H // 2) if kv_half else None)
    measured = _measured(family, cfg, attn, mode, kernels, recompute, B, S, monkeypatch)
    setup = _setup(attn, mode, kernels, recompute)
    assert sum(transformers_saved(cfg, B, S, setup).values()) == measured


# each kernel alone, and all three, in every mode (sdpa, B = 2, no recomputation): the lines
# each one changes, apart
@pytest.mark.parametrize("kernels", [("rms_norm",), ("swiglu",), ("rope",), LIGER_KERNELS])
@pytest.mark.parametrize("mode", list(MODES))
def test_saved_bytes_exact_per_kernel(kernels, mode, monkeypatch):
    cfg = _cfg("llama")
    measured = _measured("llama", cfg, "sdpa", mode, kernels, "none", 2, 16, monkeypatch)
    assert sum(transformers_saved(cfg, 2, 16, _setup("sdpa", mode, kernels)).values()) \
        == measured


def test_kernels_change_the_lines_they_replace():
    """LigerRMSNorm drops the fp32 copy and the normalized output of every norm; SwiGLU one of
    four N x Dff tensors; RoPE nothing (bf16, B = 2, S = 16: N = 32 tokens)."""
    cfg = _cfg("llama")  # E 32, L 2, d_ff 48
    N, E, L, Dff = 32, 32, 2, 48
    plain = transformers_saved(cfg, 2, 16, _setup("sdpa", "bf16", ()))
    for kernels, less in ((("rms_norm",), (2 * L + 1) * N * E * 4),
                          (("swiglu",), L * N * Dff * 2), (("rope",), 0)):
        lines = transformers_saved(cfg, 2, 16, _setup("sdpa", "bf16", kernels))
        assert sum(plain.values()) - sum(lines.values()) == less, kernels


# --------------------------------------------------------------------------- the step peak

CASE = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
        "intermediate_size": 160, "max_position_embeddings": 128}


@pytest.mark.parametrize("B,S,recompute", [(4, 64, "none"), (1, 32, "full")])
def test_memory_liger_peak_matches_on_cpu(B, S, recompute, tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps(CASE))
    r = CliRunner().invoke(cli, ["memory", "--hf-config", str(tmp_path), "-B", str(B),
                                 "--seq-len", str(S), "--mode", "fp32", "--device", "cpu",
                                 "--recompute", recompute, "--liger", "all", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.output)
    assert out["training"]["liger"] == "all"
    model = tw.build(CASE)
    patch(model, LIGER_KERNELS, monkeypatch)
    model = tw.apply_recompute(model, recompute)
    idx, labels = tw.make_batch(CASE["vocab_size"], B, S)
    saved = sum(t.nbytes for t in tw.measure_saved(model, idx, labels).tensors)
    assert sum(out["breakdown"]["activations"].values()) == saved
    peak = tw.measure_step_peak(model, idx, labels).peak_bytes
    assert abs(out["peak"] - peak) <= PEAK_TOLERANCE * peak, (out["peak"], peak)


# --------------------------------------------------------------------------- Liger's own code


def _torch_forwards(monkeypatch):
    """Liger's forward helpers with their Triton launches replaced by PyTorch, returning what
    each returns (liger-kernel 0.8.5), so that Liger's own autograd Functions decide what is
    saved."""
    import liger_kernel.ops.rms_norm as rms
    import liger_kernel.ops.rope as rope
    import liger_kernel.ops.swiglu as swiglu

    def rms_norm_forward(X, W, eps, offset, casting_mode, row_mode):
        shape = X.shape
        X = X.view(-1, shape[-1])
        rstd = torch.rsqrt(X.float().pow(2).mean(-1) + eps)
        Y = ((X.float() * rstd[:, None]).to(X.dtype) * (W + offset)).to(X.dtype)
        return Y.view(*shape), X, rstd, 64, 4, casting_mode

    def swiglu_forward(a, b, gate_multiplier=1.0):
        shape = a.shape
        a, b = a.view(-1, shape[-1]), b.view(-1, shape[-1])
        c = (torch.nn.functional.silu(a.float()) * b.float()).to(a.dtype)
        return a, b, c.view(*shape)

    def rope_forward(q, k, cos, sin, position_ids=None, unsqueeze_dim=1, rotary_dim=None):
        if cos.ndim == 2:
            cos, sin = cos.unsqueeze(0), sin.unsqueeze(0)
        q, k = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        _rotate(q, cos, sin, 1)
        _rotate(k, cos, sin, 1)
        return q.transpose(1, 2), k.transpose(1, 2), cos, sin

    monkeypatch.setattr(rms, "rms_norm_forward", rms_norm_forward)
    monkeypatch.setattr(swiglu, "swiglu_forward", swiglu_forward)
    monkeypatch.setattr(rope, "rope_forward", rope_forward)


@pytest.mark.parametrize("mode", ["fp32", "bf16"])
def test_real_liger_functions_save_the_same(mode, monkeypatch):
    """Liger's own Functions and `apply_liger_kernel_to_llama(model=...)` (its loss left off)
    save what the stand-ins save, where liger-kernel and triton are installed."""
    pytest.importorskip("triton")
    monkey = pytest.importorskip("liger_kernel.transformers.monkey_patch")
    from liger_kernel.ops.rope import LigerRopeFunction
    from transformers.models.llama import modeling_llama

    _torch_forwards(monkeypatch)
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", modeling_llama.apply_rotary_pos_emb)
    cfg = _cfg("llama")
    model = tw.build(tw.hf_config_for(cfg, "llama"), dtype=MODES[mode][0])
    monkey.apply_liger_kernel_to_llama(model=model, fused_linear_cross_entropy=False)
    # liger_rotary_pos_emb dispatches by device; the Triton Function is what runs on CUDA
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb",
                        lambda q, k, cos, sin, *a, **kw: LigerRopeFunction.apply(q, k, cos, sin))
    idx, labels = tw.make_batch(cfg.vocab_size, 2, 16)
    measured = tw.measure_saved(model, idx, labels).activation_bytes
    assert sum(transformers_saved(cfg, 2, 16, _setup("sdpa", mode, LIGER_KERNELS)).values()) \
        == measured


# --------------------------------------------------------------------------- the option


def test_liger_kernels_parse():
    assert liger_kernels("none") == liger_kernels("") == ()
    assert liger_kernels("all") == ("rms_norm", "swiglu", "rope")
    assert liger_kernels("rope, rms_norm") == ("rms_norm", "rope")
    with pytest.raises(ConfigError) as e:
        liger_kernels("layer_norm")
    assert e.value.field == "liger"


@pytest.mark.parametrize("args,named", [
    (["--preset", "llama3-8b", "--liger", "all"], "--impl transformers"),  # reference impl
    (["--preset", "gpt2", "--impl", "transformers", "--liger", "rms_norm"], "not gpt2"),
    (["--preset", "llama3-8b", "--impl", "transformers", "--liger", "all", "--recompute",
      "op"], "--recompute op"),
    (["--preset", "llama3-8b", "--impl", "transformers", "--liger", "all", "--compile",
      "blocks"], "--compile"),
    (["--preset", "llama3-8b", "--impl", "transformers", "--liger", "glu"], "unknown"),
])
def test_refused_in_one_line(args, named):
    r = CliRunner().invoke(cli, ["memory", *args])
    assert r.exit_code == 2, r.output
    lines = r.output.strip().splitlines()
    assert len(lines) == 1 and "--liger" in lines[0] and named in lines[0], r.output


def test_setup_rejects_liger_outside_transformers():
    with pytest.raises(ConfigError) as e:
        TrainingSetup(liger="all")
    assert e.value.field == "liger"
    assert TrainingSetup(liger="all", impl="transformers").describe_stack() == \
        ", Liger's rms_norm/swiglu/rope kernels"


# --------------------------------------------------------------------------- recipes

LLAMA = dict(CASE, hidden_size=64, num_hidden_layers=2)  # a local Llama config.json


def _recipe_run(tmp_path, name: str, text: str, *typed: str) -> tuple[dict, dict]:
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    (tmp_path / name).write_text(text.replace("{model}", str(tmp_path)))

    def run(*args):
        r = CliRunner().invoke(cli, ["memory", *args, "--json"])
        assert r.exit_code == 0, r.output
        out = json.loads(r.stdout)
        out.pop("recipe", None)
        return out
    return run("--recipe", str(tmp_path / name)), run(*typed)


AXO = ("base_model: {model}\nsequence_len: 64\nplugins:\n"
       "  - axolotl.integrations.liger.LigerPlugin\n")


@pytest.mark.parametrize("keys,liger,loss", [
    # examples/llama-3/fft-8b-liger-fsdp.yaml's four switches
    ("liger_rope: true\nliger_rms_norm: true\nliger_glu_activation: true\n"
     "liger_fused_linear_cross_entropy: true\n", "rms_norm,swiglu,rope", "fused"),
    ("liger_rms_norm: true\n", "rms_norm", "standard"),
    ("liger_glu_activation: true\nliger_rope: false\n", "swiglu", "standard"),
])
def test_axolotl_liger_switches(keys, liger, loss, tmp_path):
    got, typed = _recipe_run(tmp_path, "axo.yml", AXO + keys, "--hf-config", str(tmp_path),
                             "--seq-len", "64", "-B", "1", "--mode", "fp32", "--liger", liger,
                             "--loss", loss)
    assert got == typed
    assert got["training"]["liger"] == liger and got["training"]["loss"] == loss


def test_axolotl_liger_layer_norm_refused_unless_liger_given(tmp_path):
    path = tmp_path / "axo.yml"
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    path.write_text(AXO.replace("{model}", str(tmp_path)) + "liger_layer_norm: true\n")
    r = CliRunner().invoke(cli, ["memory", "--recipe", str(path)])
    assert r.exit_code == 2 and "liger_layer_norm = True" in r.output, r.output
    r = CliRunner().invoke(cli, ["memory", "--recipe", str(path), "--liger", "none"])
    assert r.exit_code == 0, r.output


HF = '{"model_name_or_path": "{model}", "per_device_train_batch_size": 1, "block_size": 64'


@pytest.mark.parametrize("extra,liger,loss", [
    # the Trainer: _apply_liger_kernel_to_instance(model) with Liger's Llama defaults
    (', "use_liger_kernel": true}', "rms_norm,swiglu,rope", "fused"),
    (', "use_liger_kernel": true, "liger_kernel_config": {"rope": false, '
     '"fused_linear_cross_entropy": false}}', "rms_norm,swiglu", "standard"),
    (', "use_liger_kernel": false, "liger_kernel_config": {"rope": false}}', "none",
     "standard"),
])
def test_trainer_use_liger_kernel(extra, liger, loss, tmp_path):
    got, typed = _recipe_run(tmp_path, "args.json", HF + extra, "--hf-config", str(tmp_path),
                             "--seq-len", "64", "-B", "1", "--mode", "fp32", "--liger", liger,
                             "--loss", loss)
    assert got == typed
    assert got["training"]["liger"] == liger and got["training"]["loss"] == loss


def test_llamafactory_enable_liger_kernel(tmp_path):
    text = ("model_name_or_path: {model}\nstage: sft\nfinetuning_type: full\ncutoff_len: 64\n"
            "per_device_train_batch_size: 1\nenable_liger_kernel: true\n")
    got, typed = _recipe_run(tmp_path, "lf.yaml", text, "--hf-config", str(tmp_path),
                             "--seq-len", "64", "-B", "1", "--mode", "fp32", "--recompute",
                             "full", "--liger", "rms_norm,swiglu,rope", "--loss", "fused")
    assert got == typed
    assert got["training"]["liger"] == "rms_norm,swiglu,rope"
