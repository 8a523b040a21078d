"""`gptcalc report`: one directory holding the whole analysis of a model.

`report.md` and `report.html` carry the same blocks (see `document.py`): the configuration,
parameters and FLOPs by component with the published conventions beside them, the memory
breakdown, the verification table (analytic vs measured on the reference model), how size and
cost grow with the context length (measured), and the scaling plots as PNG files beside the two
pages.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import platform
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from gptcalc import __version__
from gptcalc.config import GPTConfig
from gptcalc.workload import Workload
from gptcalc.flops import NONMATMUL_COST, count_flops, inference_flops, published_estimates
from gptcalc.params import count_params
from gptcalc.training_setup import TrainingSetup
from gptcalc.units import binary_bytes, si

from . import claims
from .document import (Block, Bullets, Contents, Heading, Image, Para, table, to_html,
                       to_markdown)


@dataclass
class Report:
    out_dir: Path
    markdown: Path
    html: Path
    plots: list = field(default_factory=list)  # reports.plots.Plot
    facts: dict[str, Any] = field(default_factory=dict)  # headline numbers, for the CLI summary


def pick_device(device: str) -> str:
    """auto: CUDA when present, else CPU. An explicit cuda without CUDA is an error."""
    import torch

    from gptcalc.errors import ConfigError

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", "CUDA was asked for but torch sees no CUDA device")
    return device


class _Progress:
    """rich progress on stderr: one line per long step, with its own bar when it has parts."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._progress = None

    def __enter__(self) -> "_Progress":
        if self.enabled:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn,
                                       TextColumn, TimeElapsedColumn)

            self._progress = Progress(SpinnerColumn(), TextColumn("{task.description}"),
                                      BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                      console=Console(stderr=True), transient=False)
            self._progress.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._progress is not None:
            self._progress.__exit__(*exc)

    @contextmanager
    def step(self, description: str, total: int = 1) -> Iterator:
        """A task; the body calls the yielded `advance()` once per part (or not at all)."""
        if self._progress is None:
            yield lambda *_: None
            return
        task = self._progress.add_task(description, total=total)
        yield lambda *_: self._progress.advance(task)
        self._progress.update(task, completed=total)


# ---------------------------------------------------------------------------------------------
# sections

def _config_blocks(cfg: GPTConfig, wl: Workload, name: str, device: str,
                   summary: list[Block] = ()) -> list[Block]:
    import torch

    letters = [("L (n_layer)", cfg.n_layer), ("H (n_head)", cfg.n_head),
               ("E (n_embd)", cfg.n_embd), ("T (block_size)", cfg.block_size),
               ("V (vocab_size)", cfg.vocab_size), ("d_ff (F*E unless set)", cfg.ffn_dim),
               ("head_dim", cfg.head_size), ("n_kv_head", cfg.kv_heads),
               ("dropout", cfg.dropout), ("B (batch_size)", wl.batch_size),
               ("S (seq_len of the workload)", wl.seq_len)]
    switches = ", ".join(f"{k}={getattr(cfg, k)}" for k in (
        "qkv_layout", "qkv_bias", "attn_out_bias", "mlp_bias", "lm_head_bias", "tie_embeddings",
        "pos_embedding", "norm", "mlp", "final_norm", "embd_dropout"))
    when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return [
        Heading(1, name),
        Para(f"A gptcalc report. Made by gptcalc {__version__} on {when} with torch "
             f"{torch.__version__} "
             f"(Python {platform.python_version()}); measurements ran on `{device}`. The "
             "parameter, FLOP and memory figures are checked against the reference PyTorch "
             "model (`reference_model/model.py`) in the verification table, which says which "
             "set-up it measured and how."),
        *summary,
        Contents(),
        Heading(2, "Configuration"),
        table(["size", "value"], [(k, v) for k, v in letters]),
        Para(f"Switches: `{switches}`."),
    ]


def _params_blocks(cfg: GPTConfig) -> list[Block]:
    p = count_params(cfg)
    rows = [(k, f"{v:,}", si(v), f"{100 * v / p.total:.2f}%")
            for k, v in p.components.items() if v]
    return [
        Heading(2, "Parameters by component"),
        table(["component", "parameters", "SI", "share"], rows,
              total=("total", f"{p.total:,}", si(p.total), "100.00%"),
              caption=f"Non-embedding (Kaplan et al. 2020: without token and position "
                      f"embeddings): {p.non_embedding:,} ({si(p.non_embedding)}). A tied "
                      "lm_head is counted once, under embedding/token."),
    ]


def _flops_blocks(cfg: GPTConfig, wl: Workload) -> list[Block]:
    fc = count_flops(cfg, wl)
    tok, B = fc.per_token, wl.batch_size
    rows = [(k, f"{tok(v):,}", f"{tok(fc.backward[k]):,}", si(B * (v + fc.backward[k])))
            for k, v in fc.forward.items() if v]
    exact = tok(fc.training_total)
    conventions = published_estimates(cfg, wl.seq_len)
    explain = {
        "6N": "6 x all parameters: no attention; the embedding tables count as if matmuls",
        "kaplan": "Kaplan et al. 2020: 6 N_non-embedding + 6 L S E (attention at half the "
                  "full S x S count; a tied lm_head's matmul not counted)",
        "palm": "PaLM / nanoGPT's estimate_mfu: 6N' + 12 L H head_dim S, N' without the "
                "position table (full S x S attention)",
        "6N_active": "mixture of experts: 6 x the parameters one token uses (its routed "
                     "experts, not all of them)",
    }
    conv_rows = [("exact (this model, gptcalc)", f"{exact:,}", si(exact), "1.0000",
                  "sum of the component table")]
    conv_rows += [(k, f"{v:,}", si(v), f"{v / exact:.4f}", explain[k])
                  for k, v in conventions.items()]
    inf = inference_flops(cfg, wl.seq_len, wl.seq_len)
    nm = [(k, f"{v:,}", si(B * v)) for k, v in fc.nonmatmul.items() if v]
    costs = ", ".join(f"{k} {v}" for k, v in NONMATMUL_COST.items())
    return [
        Heading(2, "FLOPs by component"),
        Para("Matmul FLOPs, 2 per multiply-accumulate; attention over the full S x S score "
             "matrix (what the kernels compute and FlopCounterMode counts); backward = 2 x "
             f"forward. Workload: B = {B} sequences of S = {wl.seq_len} tokens."),
        table(["component", "forward / token", "backward / token", "training / step"], rows,
              total=("total", f"{tok(fc.forward_total):,}", f"{tok(fc.backward_total):,}",
                     si(B * fc.training_total)),
              caption=f"Training (forward + backward) per token: {exact:,} FLOPs; "
                      f"per step of {B * wl.seq_len:,} tokens: {si(B * fc.training_total)}FLOPs."),
        Heading(3, "Published conventions compared"),
        table(["rule", "training FLOPs / token", "SI", "rule / exact", "what it counts"],
              conv_rows),
        Heading(3, "Inference"),
        table(["quantity", "FLOPs", "SI"], [
            (f"prefill of {inf.prompt_len} tokens", f"{inf.prefill:,}", si(inf.prefill)),
            (f"one token at context {inf.context}, KV cache", f"{inf.decode_per_token:,}",
             si(inf.decode_per_token)),
            (f"one token at context {inf.context}, no cache (a whole forward)",
             f"{inf.decode_per_token_no_cache:,}", si(inf.decode_per_token_no_cache)),
        ]),
        Heading(3, "Non-matmul forward work"),
        table(["component", "FLOPs / sequence", "per step"], nm,
              caption=f"Not in the totals above. FLOPs per element: {costs}."),
    ]


@dataclass(frozen=True)
class Verified:
    """What the verification table measured: `reference_model.verify`'s plan and checks, and
    the training set-up its memory checks ran."""

    plan: Any  # reference_model.verify.Setup
    checks: list
    training: TrainingSetup

    @property
    def agreeing(self) -> int:
        return sum(1 for c in self.checks if c.ok)


# fields a single-device verification of the reference model cannot take from the report's
# set-up, and the value it runs instead
_ONE_DEVICE = {"impl": "reference", "dp": 1, "zero": 0, "tp": 1, "pp": 1, "sp": False, "ep": 1,
               "engine_settings": (), "lora_rank": 0, "lora_targets": (), "base_dtype": "same",
               "kbit_prepare": False}


def verified_training(setup: TrainingSetup, device: str) -> TrainingSetup:
    """`setup` as `reference_model.verify` runs it on `device`: that device's kernels, one
    device, the reference model's own modules, no adapters; precision, optimizer,
    recomputation, attention and loss as `setup` has them."""
    from gptcalc.memory.engines import default_engine

    engine = None if setup.engine is None else default_engine(0).name  # one device's engine
    return dataclasses.replace(setup, device="cuda" if device.startswith("cuda") else "cpu",
                               engine=engine, **_ONE_DEVICE)


def setup_changes(assumed: TrainingSetup, verified: TrainingSetup) -> list[str]:
    """'field assumed -> verified' for every field the verification had to change."""
    return [f"{f.name} {getattr(assumed, f.name)} -> {getattr(verified, f.name)}"
            for f in dataclasses.fields(TrainingSetup)
            if getattr(assumed, f.name) != getattr(verified, f.name)]


def verify_report(cfg: GPTConfig, wl: Workload, device: str,
                  setup: TrainingSetup | None = None) -> Verified:
    """`reference_model.verify` of this workload under the report's set-up (`verified_training`)
    at `verify`'s automatic choice of tensors: real when the step runs in seconds, else
    shape-only (meta device and FakeTensorMode, the memory checks on CPU to the byte of a real
    run)."""
    from reference_model.verify import verify

    training = verified_training(setup or _default_setup(cfg), device)
    plan, checks = verify(cfg, wl, device=device, attn_impl=training.attn_impl,
                          training=training)
    return Verified(plan, checks, training)


def _default_setup(cfg: GPTConfig) -> TrainingSetup:
    from gptcalc.training import default_setup

    return default_setup(cfg)


def _verification_blocks(cfg: GPTConfig, wl: Workload, device: str,
                         setup: TrainingSetup | None = None,
                         verified: Verified | None = None) -> list[Block]:
    """Analytic vs measured (`verify_report`) at the report's own workload and set-up."""
    from gptcalc.memory.engines import describe as describe_setup

    setup = setup or _default_setup(cfg)
    v = verified or verify_report(cfg, wl, device, setup)
    checks = v.checks
    exact = sum(1 for c in checks if c.difference == 0)
    rows = [(c.name, _num(c.analytic), _num(c.measured), f"{c.difference:+,}",
             ("yes" if c.ok else "**NO**") + (f" (within ±{c.tolerance:,})"
                                               if c.tolerance and c.difference else ""),
             c.tool + (f"; {c.note}" if c.note else ""))
            for c in checks]
    # verify's notes name its own --tensors option, which the report does not have
    notes = [Para(n.split("; pass --tensors")[0] + ".") for n in v.plan.notes]
    how = ("real tensors: the model was built and run" if v.plan.tensors == "real" else
           "shape-only tensors: nothing was computed, every op ran on tensors that carry only "
           "shape, dtype and device, which give the counts and byte sizes of a real run (the "
           "test suite compares both on small models)")
    changes = setup_changes(setup, v.training)
    same = ("the set-up the Memory section assumes" if not changes else
            "the Memory section's set-up with what cannot run here changed ("
            + "; ".join(changes) + "; the Memory section shows both side by side)")
    return [
        Heading(2, "Verification: analytic vs measured"),
        Para(f"{v.agreeing} of {len(checks)} checks agree ({exact} exactly; the others within "
             "the tolerance their row states). Measured on the reference model "
             f"({v.plan.attn_impl} attention, on `{device}`) at this report's workload, "
             f"B = {wl.batch_size} and S = {wl.seq_len}, with {how}. The memory checks ran "
             f"{describe_setup(v.training)}: {same}."),
        *notes,
        table(["quantity", "analytic", "measured", "difference", "agrees", "tool"], rows),
    ]


def _memory_blocks(cfg: GPTConfig, wl: Workload, setup: TrainingSetup | None = None,
                   verified: TrainingSetup | None = None) -> list[Block]:
    """`gptcalc.memory.memory_report` of this workload under `setup` (default: the family's
    usual training set-up) and, where the verification ran another (`verified`, e.g. CPU
    kernels for CUDA's), under that one beside it with the terms that differ."""
    from gptcalc.memory import memory_report
    from gptcalc.memory.engines import describe as describe_setup

    setup = setup or _default_setup(cfg)
    r = memory_report(cfg, wl, setup)
    cats = r.categories()
    both = verified is not None and verified != setup
    other = memory_report(cfg, wl, verified) if both else None
    ocats = other.categories() if other else {}
    cols = ["category", "bytes", "binary"]
    if both:
        cols = ["category", "assumed: bytes", "binary", "verified here: bytes", "binary"]

    def cells(k: str, a: int, b: int | None) -> tuple:
        return (k, f"{a:,}", binary_bytes(a)) + ((f"{b:,}", binary_bytes(b)) if both else ())
    rows = [cells(k, v, ocats.get(k)) for k, v in cats.items()]
    total = cells("sum (all at once)", sum(cats.values()), sum(ocats.values()) if both else None)
    acts = r.breakdown["activations"]
    top = sorted(((k, v) for k, v in acts.items() if v), key=lambda kv: -kv[1])[:8]
    peak = r.peak
    blocks: list[Block] = [
        Heading(2, "Memory"),
        Para(f"One training step of a micro-batch of B = {wl.batch_size} sequences of "
             f"S = {wl.seq_len} tokens on one device, assuming {describe_setup(setup)}."),
        table(cols, rows, total=total,
              caption="activations: every tensor saved for backward, the cross entropy's "
                      "log-probabilities and autocast's weight copies included."),
        Para(f"Modelled peak of a step: **{binary_bytes(peak.bytes)}** ({peak.bytes:,} bytes), "
             f"in the {peak.phase} phase: {peak.why}. Korthikanti et al. 2022's published "
             f"activation formula gives {binary_bytes(r.activations_paper)} (16-bit "
             f"activations) against {binary_bytes(r.activations)} saved by this model. KV "
             f"cache for inference at context {wl.seq_len}: {binary_bytes(r.kv_cache)} "
             f"(B = {wl.batch_size}, in the serving dtype)."),
    ]
    if both:
        blocks.append(Para(_why_they_differ(setup, verified, r, other)))
    blocks.append(table(["largest saved tensors (all layers)", "bytes", "binary"],
                        [(k, f"{v:,}", binary_bytes(v)) for k, v in top]))
    return blocks


def _why_they_differ(setup: TrainingSetup, verified: TrainingSetup, r, other) -> str:
    """The sentence under a side-by-side memory table: what was changed and which modelled
    terms move with it."""
    changed = "; ".join(setup_changes(setup, verified))
    diffs = []
    for section in ("activations", "weight_copies", "state"):
        a, b = r.breakdown.get(section, {}), other.breakdown.get(section, {})
        diffs += [f"{section} {k}: {a.get(k, 0):,} -> {b.get(k, 0):,} B"
                  for k in sorted(set(a) | set(b)) if a.get(k, 0) != b.get(k, 0)]
    moved = ("every saved tensor and state is the same under both" if not diffs
             else "these terms differ: " + "; ".join(diffs[:6])
             + (f" and {len(diffs) - 6} more" if len(diffs) > 6 else ""))
    device = ("; where CPU and CUDA kernels can differ: on CUDA AdamW's foreach update makes "
              "temporaries for every parameter at once, on CPU one tensor at a time "
              "(gptcalc.memory.peak.optimizer_temporaries), and "
              "some kernels save other dtypes (gptcalc.memory.profile_reference)"
              if setup.device != verified.device else "")
    peaks = (f"the peak is {binary_bytes(r.peak.bytes)} in the {r.peak.phase} phase assumed, "
             f"{binary_bytes(other.peak.bytes)} in the {other.peak.phase} phase verified")
    return (f"Assumed: the set-up above, which this machine cannot run as it is. Verified here: "
            f"the same with {changed}, what the verification table below measures. "
            f"Between the two, {moved}; {peaks}{device}. The assumed column is gptcalc's model "
            "of that set-up, not measured in this report.")


def _time_blocks(cfg: GPTConfig, wl: Workload, gpu_name: str, out_dir: Path,
                 name: str) -> tuple[list[Block], Any]:
    """Training time for a Chinchilla budget and the inference roofline on `gpu_name`
    (gptcalc.time, gptcalc.inference.roofline), and the decode of a tiny model of this family
    timed on the CPU with and without a KV cache (reference_model.timing) beside them."""
    from gptcalc.gpus import gpu as find_gpu
    from gptcalc.inference import serving
    from gptcalc.time import CHINCHILLA_TOKENS_PER_PARAM, training_time
    from reference_model.timing import decode_times, timing_config

    from .plots import plot_decode_timing

    g = find_gpu(gpu_name)
    blocks: list[Block] = [Heading(2, "Time and serving")]
    if g.bf16_flops is None:
        blocks.append(Para(f"`{g.name}` has no peak figures: no time or roofline estimate."))
    else:
        t = training_time(cfg, wl, None, g)
        rows = [("exact (gptcalc)", f"{t.flops_per_token:,}", _duration(t.seconds),
                 f"{t.gpu_hours:,.4g}")]
        rows += [(k, f"{v:,}", _duration(t.convention_seconds(k)),
                  f"{t.convention_seconds(k) / 3600:,.4g}") for k, v in t.conventions.items()]
        T = cfg.block_size
        prompt = min(128, max(1, T // 2))
        s = serving(cfg, g, wl.batch_size, prompt, min(128, max(1, T - prompt)))
        b = s.compute_bound_batch
        blocks += [
            Para(f"Training on {CHINCHILLA_TOKENS_PER_PARAM} tokens per parameter (Chinchilla, "
                 f"Hoffmann et al. 2022): {t.tokens:,} tokens of S = {wl.seq_len} on one "
                 f"`{g.name}` ({t.peak_flops / 1e12:,.1f} TFLOP/s dense bf16) at MFU {t.mfu:g}; "
                 "time = model FLOPs / (peak x MFU), GPU-hours scale to any number of GPUs."),
            table(["rule", "training FLOPs / token", "time on one GPU", "GPU-hours"], rows),
            Para(f"Inference on one `{g.name}`, bf16 weights and KV cache, B = {s.batch_size}, "
                 f"prompt {s.prompt_len}, {s.gen_len} generated tokens: roofline = max(FLOPs / "
                 "peak, bytes / bandwidth) per phase; expected = each term at "
                 f"{s.flops_efficiency:g} of peak FLOP/s and {s.bandwidth_efficiency:g} of "
                 "bandwidth (gpt-fast's measured Llama-2-7B on an A100)."),
            table(["quantity", "roofline", "expected"], [
                ("memory: weights + KV cache + prefill activations",
                 binary_bytes(s.total_bytes), "fits" if s.fits else "does NOT fit"),
                (f"prefill ({s.prefill.bound}-bound)", _duration(s.prefill.seconds),
                 _duration(s.expected_prefill_seconds)),
                (f"decode per token ({s.decode.bound}-bound)",
                 _duration(s.decode_seconds_per_token),
                 _duration(s.expected_decode_seconds_per_token)),
                ("tokens/s per sequence", _rate(s.decode_tokens_per_second),
                 _rate(1 / s.expected_decode_seconds_per_token)),
            ], caption=("decode never turns compute-bound at this context: a sequence's KV "
                        "cache takes longer to read than its FLOPs take" if b is None else
                        f"decode turns compute-bound at batch {b:,}.")),
        ]
    tiny = timing_config(cfg)
    timings = decode_times(tiny)
    plot = plot_decode_timing(out_dir, timings, tiny, f"{name}, shrunk")
    blocks += [
        Para(f"Measured twin: the reference model shrunk to L = {tiny.n_layer}, E = "
             f"{tiny.n_embd}, T = {tiny.block_size} (same family), one decoded token timed on "
             "the CPU (one thread, median of 5) with and without a KV cache. With a cache the "
             "time stays nearly flat, as the roofline's weight term does; without one the whole "
             "context is recomputed and the time grows with it."),
        table(["context", "with KV cache (ms)", "without (ms)", "ratio"],
              [(f"{m.context:,}", f"{m.seconds_with_cache * 1e3:.3f}",
                f"{m.seconds_without_cache * 1e3:.3f}",
                f"{m.seconds_without_cache / m.seconds_with_cache:.1f}") for m in timings]),
        Image(plot.path.name, plot.title, plot.caption),
    ]
    return blocks, plot


def _duration(seconds: float) -> str:
    """4 significant figures in the unit that suits: us, ms, s, h or days."""
    for unit, size in (("days", 86400), ("h", 3600), ("s", 1), ("ms", 1e-3)):
        if seconds >= size:
            return f"{seconds / size:,.4g} {unit}"
    return f"{seconds / 1e-6:,.4g} us"


def _rate(per_second: float) -> str:
    return f"{per_second:,.0f}" if per_second >= 100 else f"{per_second:.3g}"


def _num(v: Any) -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:,.6g}"
    return str(v)


def _claims_blocks(cfg: GPTConfig, sizes: list, costs: list, device_used: str,
                   plot_name: str | None) -> list[Block]:
    E = cfg.n_embd
    f = claims.cost_findings(costs)
    first, last = sizes[0], sizes[-1]
    size_rows = [(f"{s.block_size:,}", f"{s.measured_params:,}", f"{s.analytic_params:,}",
                  f"{s.measured_params - first.measured_params:+,}", f"{s.position_params:,}",
                  f"{s.mask_buffer_elements:,}") for s in sizes]
    all_equal = all(s.measured_params == s.analytic_params for s in sizes)
    diffs_are_table = all(s.measured_params - first.measured_params
                          == (s.block_size - first.block_size) * E
                          for s in sizes) if cfg.pos_embedding == "learned" else None
    if cfg.pos_embedding == "learned":
        size_answer = (
            f"**No, not exactly: the size grows by E = {E} parameters per token of context**, "
            "and only through the learned position table (wpe, T x E). From T = "
            f"{first.block_size:,} to T = {last.block_size:,} the measured count goes from "
            f"{first.measured_params:,} to {last.measured_params:,} "
            f"({last.measured_params - first.measured_params:+,} = "
            f"{last.block_size - first.block_size:,} x {E}"
            f"{'' if diffs_are_table else ', NOT matched'}). Every other matrix (Q, K, V, "
            "the MLP, the embeddings' V x E) is indeed independent of T, so "
            "the change is small: the position table is "
            f"{claims.position_share(sizes):.1f}% of the model at "
            f"T = {last.block_size:,}. The T x T causal mask (`tril`, one per block) is a "
            "buffer, not a parameter: it is not trained and not in the count, but it does "
            "cap the context of this implementation; the learned table "
            "caps it too, since positions beyond T have no vector.")
    else:
        size_answer = (f"With `pos_embedding={cfg.pos_embedding}` there is no learned position "
                       "table: the measured count is the same at every T. The T x T mask is a "
                       "buffer, not a parameter.")
    a, b, resid = f.linear
    L, Dq = cfg.n_layer, cfg.q_width
    # gptcalc's per-token forward at the first T, less its attention term 4 L Dq T
    dense_per_token = costs[0].analytic_forward_flops // costs[0].block_size - 4 * L * Dq * \
        costs[0].block_size
    Ts = [p.block_size for p in costs]
    exact_flops = all(p.forward_flops == p.analytic_forward_flops
                      and p.decode_flops == p.analytic_decode_flops for p in costs)
    cost_rows = [(f"{p.block_size:,}", f"{p.forward_flops:,}", f"{p.per_token:,.0f}",
                  f"{p.attention_per_token:,.0f}", f"{p.per_token - p.attention_per_token:,.0f}",
                  f"{p.decode_flops:,}") for p in costs]
    where = ("the meta device (shapes only: FlopCounterMode counts each op from its shapes, "
             "so the counts are what a real device would execute; a real run at these sizes "
             "would not fit the report's time budget)" if device_used == "meta"
             else f"`{device_used}`")
    blocks: list[Block] = [
        Heading(2, "How size and cost grow with context"),
        Para("Two claims about the context length T of this model are tested here: that its "
             "size does not depend on T, and that the time to predict or train one token "
             "grows like T^3. Both are measured on the reference model, rebuilt at each T with "
             "this model's other sizes."),
        Heading(3, "Is model size independent of the context length?"),
        Para("Measured: `sum(p.numel() for p in model.parameters())` of the reference model "
             "built at each block size (tied weights once); the mask buffers counted apart."),
        table(["T", "measured parameters", "gptcalc", "change from the first row",
               "position table T x E", "mask buffer elements (not parameters)"], size_rows,
              caption="measured = gptcalc at every T" if all_equal
              else "measured and gptcalc DIFFER somewhere above"),
        Para(size_answer),
        Heading(3, "How does the cost of one token grow with T?"),
        Para("The claim tested: the time to predict or train one token is "
             "O[T V E + L (T^3 + T^2 H + T E^2)], i.e. cubic in T. Measured: FlopCounterMode "
             f"forward FLOPs of the reference model (manual attention) on {where}, "
             "one sequence of T tokens at each T; the attention part is the batched matmuls "
             "q @ k^T and att @ v (aten.bmm), the rest the weight matmuls; the last column is "
             "one new token at context T with a KV cache."),
        table(["T", "forward FLOPs / sequence", "per token", "attention / token",
               "dense / token", "one token with KV cache"], cost_rows,
              caption=("all measured counts equal gptcalc's forward_flops / matmul_flops"
                       if exact_flops else "measured and gptcalc DIFFER somewhere above")),
        Para(f"Least-squares fits of log FLOPs on log T over T = {Ts[0]:,} .. {Ts[-1]:,} "
             f"(powers of two up to 4 x this model's T = {cfg.block_size:,}):"),
        Bullets((
            f"forward FLOPs per token (training, prefill): exponent **{f.per_token.exponent:.3f}** "
            f"(local slope between the last two points {f.local_exponent:.3f});",
            f"the attention part alone, per token: exponent "
            f"**{f.attention_per_token.exponent:.3f}**, i.e. linear in T;",
            f"one generated token without a KV cache (generation that reruns the whole "
            f"context, = the sequence's forward): exponent **{f.per_sequence.exponent:.3f}**;",
            f"one generated token with a KV cache at context T: exponent "
            f"**{f.decode_with_cache.exponent:.3f}**.",
        )),
        Para(f"A straight line fits the per-token cost exactly: per token = {a:,.0f} + "
             f"{b:,.1f} x T FLOPs (largest relative residual {resid:.1e}); gptcalc's formula is "
             f"dense + 4 L H head_dim T = {dense_per_token:,} "
             f"+ {4 * L * Dq:,} x T. **So the cost of one token is not cubic in T: it is a "
             "constant (the weight matmuls, 2 FLOPs per matrix weight) plus a term linear "
             "in T (attention: 4 L E T, q @ k^T and att @ v).** The fitted power of the whole is "
             "below 1 because the constant dominates at these sizes (attention overtakes it "
             f"only at T = {_crossover(cfg):,}); with more T it tends to 1, never beyond. "
             "Generating one token with a KV cache costs exactly the same as one token of a "
             "T-token forward here (the new query meets T keys; full S x S counting). A whole "
             "sequence, or one token generated without a KV cache, costs "
             "T times the per-token figure: quadratic at most, T^2 from attention, and "
             f"measured here at T^{f.per_sequence.exponent:.2f} because the T-linear weight "
             "matmuls still dominate. No measured quantity grows like T^3: the largest "
             "T-dependent work is the T x T score matrix, whose T^2 entries cost head_dim "
             "multiply-adds per head (E in all), independent of T."),
    ]
    if plot_name:
        blocks.append(Image(plot_name, "Parameters and FLOPs per token vs T",
                            "Left: measured parameters vs T with the T-independent part. "
                            "Right: measured FLOPs per token vs T, the fitted power law, and "
                            "T^3 for contrast."))
    return blocks


def _crossover(cfg: GPTConfig) -> int:
    from .plots import attention_crossover

    return attention_crossover(cfg)


# ---------------------------------------------------------------------------------------------

def build_report(cfg: GPTConfig, wl: Workload, out_dir: Path, device: str = "auto",
                 name: str | None = None, progress: bool = True, gpu: str = "h100-sxm",
                 setup=None) -> Report:
    """The whole report in `out_dir`. `setup` (a TrainingSetup; default the family's usual
    one) is the training the memory section and plots assume; `device` is where the reference
    model is measured."""
    from .output import moved, staged_output

    out_dir = Path(out_dir)
    device = pick_device(device)
    with staged_output(out_dir) as staging:
        report = _build(cfg, wl, staging, device, name or "custom model", progress, gpu, setup)
    return dataclasses.replace(report, out_dir=out_dir, markdown=out_dir / report.markdown.name,
                               html=out_dir / report.html.name,
                               plots=[moved(p, staging, out_dir) for p in report.plots])


def _build(cfg: GPTConfig, wl: Workload, out_dir: Path, device: str, name: str,
           progress: bool, gpu: str, setup) -> Report:
    from . import plots

    setup = setup or _default_setup(cfg)
    made: list = []
    with _Progress(progress) as prog:
        with prog.step("time and serving; decode timed on the CPU"):
            time_blocks, decode_plot = _time_blocks(cfg, wl, gpu, out_dir, name)
        with prog.step("verification on the reference model"):
            verified = verify_report(cfg, wl, device, setup)
        Ts = claims.sweep_block_sizes(cfg)
        with prog.step("context sweep: parameters at each T", len(Ts)):
            sizes = claims.measure_sizes(cfg, Ts)
        cost_device = claims.choose_device(cfg, Ts, device)
        with prog.step(f"context sweep: FLOPs at each T on {cost_device}",
                       len(Ts)) as advance:
            costs = claims.measure_costs(cfg, Ts, cost_device, on_point=advance)
        with prog.step("plots", 5):
            claim_plot = plots.plot_context_claims(out_dir, cfg, sizes, costs, name)
            made.append(claim_plot)
            measured = [(p.block_size, p.per_token) for p in costs]
            made += plots.make_plots(out_dir, cfg, wl, name, measured_flops=measured,
                                     setup=setup)
            made.append(plots.plot_measured(out_dir, cfg, name))
    blocks: list[Block] = _config_blocks(cfg, wl, name, device,
                                         _summary_blocks(cfg, wl, setup, gpu, verified))
    blocks += _params_blocks(cfg)
    blocks += _flops_blocks(cfg, wl)
    blocks += _memory_blocks(cfg, wl, setup, verified.training)
    blocks += time_blocks
    blocks += _verification_blocks(cfg, wl, device, setup, verified)
    blocks += _claims_blocks(cfg, sizes, costs, cost_device, claim_plot.path.name)
    blocks.append(Heading(2, "Plots"))
    for p in made[1:]:
        blocks += [Heading(3, p.title), Image(p.path.name, p.title, p.caption)]
    made.append(decode_plot)  # drawn in its own section above
    md = out_dir / "report.md"
    html = out_dir / "report.html"
    md.write_text(to_markdown(blocks))
    html.write_text(to_html(blocks, name))
    f = claims.cost_findings(costs)
    return Report(out_dir, md, html, made, {
        "params": count_params(cfg).total, "device": device, "flops_device": cost_device,
        "exponent_per_token": f.per_token.exponent,
        "exponent_attention": f.attention_per_token.exponent,
        "exponent_no_cache": f.per_sequence.exponent,
        "checks": len(verified.checks), "checks_agreeing": verified.agreeing,
        "tensors": verified.plan.tensors,
    })


def _summary_blocks(cfg: GPTConfig, wl: Workload, setup: TrainingSetup, gpu_name: str,
                    verified: Verified) -> list[Block]:
    """The answers first: size, cost per token, memory of a step, whether it fits, and how
    much of it the verification table confirms."""
    from gptcalc.gpus import gpu as find_gpu
    from gptcalc.memory import memory_report

    p = count_params(cfg).total
    fc = count_flops(cfg, wl)
    per_token = fc.per_token(fc.training_total)
    peak = memory_report(cfg, wl, setup).peak.bytes
    g = find_gpu(gpu_name)
    if g.usable_memory_bytes is None:
        fits = f"`{g.name}` has no memory figure"
    else:
        fits = (f"**{'yes' if peak <= g.usable_memory_bytes else 'NO'}**: the peak is "
                f"{100 * peak / g.usable_memory_bytes:.1f}% of its "
                f"{binary_bytes(g.usable_memory_bytes)} usable")
    shape_only = verified.plan.tensors != "real"
    how = ("real tensors" if not shape_only else
           "**shape-only** tensors (FakeTensorMode: counts and bytes, nothing computed; a real "
           "step of this model would take too long for a report)")
    rows = [
        ("parameters", f"{p:,} ({si(p)})"),
        ("training FLOPs per token (forward + backward)", f"{per_token:,} ({si(per_token)})"),
        (f"training step peak (B = {wl.batch_size}, S = {wl.seq_len})",
         f"{binary_bytes(peak)} ({peak:,} bytes)"),
        (f"fits on one `{g.name}`", fits),
        ("verified", f"{verified.agreeing} of {len(verified.checks)} checks agree, on "
                     f"`{verified.plan.device}` with {how}"),
    ]
    return [table(["Summary", "answer"], rows)]
