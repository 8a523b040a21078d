"""Scaling plots: how parameters, FLOPs and memory grow with the sizes of a GPT.

Every curve is drawn from gptcalc's exact formulas; `--measure` overlays points measured on the
reference PyTorch model. Import this module only inside the commands that draw (it loads
matplotlib with the Agg backend, no display needed).

Each `plot_*` function writes one PNG into `out_dir` and returns a `Plot` naming it; the
`*_series` functions return the numbers a plot draws, so tests can check them without pixels.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402  (the backend is chosen first)
from matplotlib.ticker import (EngFormatter, FixedLocator, FuncFormatter,  # noqa: E402
                               LogLocator, NullFormatter, NullLocator)

from gptcalc.config import GPTConfig  # noqa: E402
from gptcalc.flops import forward_flops  # noqa: E402
from gptcalc.inference import kv_cache_bytes  # noqa: E402
from gptcalc.params import count_params  # noqa: E402
from gptcalc.presets import PRESETS, from_name  # noqa: E402
from gptcalc.units import binary_bytes, si  # noqa: E402

DPI = 110
DENSE_KEYS = ("attention/qkv", "attention/out", "mlp/fc", "mlp/gate", "mlp/proj", "lm_head")
ATTENTION_KEYS = ("attention/scores", "attention/values")
GPT2_PRESETS = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
GPT3_PRESETS = tuple(name for name in PRESETS if name.startswith("gpt3-"))


@dataclass(frozen=True)
class Plot:
    """One PNG written by a plot function."""

    name: str  # file stem, stable (tests and the report refer to it)
    path: Path
    title: str
    caption: str  # one sentence saying what to read off it
    facts: dict = field(default_factory=dict)  # numbers the plot marks (for the report)


# ---------------------------------------------------------------------------------------------
# helpers

def _count_axis(ax, axis: str = "y", unit: str = "") -> None:
    """SI prefixes on a count axis: 100 M rather than 1e8."""
    fmt = EngFormatter(unit=unit, places=0, sep=" ")
    (ax.yaxis if axis == "y" else ax.xaxis).set_major_formatter(fmt)


def _bytes_label(v: float) -> str:
    return binary_bytes(v).replace(".00 ", " ") if v > 0 else "0"


def _bytes_axis(ax, log: bool = True) -> None:
    """Binary units on a bytes axis; on a log axis, ticks at powers of two (1 KiB, 8 KiB, ...)."""
    if log:
        ax.yaxis.set_major_locator(LogLocator(base=2, numticks=12))
        ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: _bytes_label(v)))


def _int_axis(ax, axis: str = "x") -> None:
    fmt = FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 1 else f"{v:g}")
    (ax.xaxis if axis == "x" else ax.yaxis).set_major_formatter(fmt)


def describe_axes(fig) -> list[dict]:
    """What each axes of a figure shows: labels, scales, how many lines and points, legend."""
    out = []
    for ax in fig.axes:
        legend = ax.get_legend()
        out.append({
            "title": ax.get_title(), "xlabel": ax.get_xlabel(), "ylabel": ax.get_ylabel(),
            "xscale": ax.get_xscale(), "yscale": ax.get_yscale(), "lines": len(ax.lines),
            "collections": len(ax.collections), "patches": len(ax.patches),
            "legend": [t.get_text() for t in legend.get_texts()] if legend else [],
        })
    return out


# the axes of every figure saved by this module, by file stem (for tests and for --measure)
SAVED_AXES: dict[str, list[dict]] = {}
# the last figure saved under each file stem, closed but still drawable (tests measure where
# its texts and markers landed)
SAVED_FIGURES: dict[str, object] = {}


def _legend(ax, below: bool = False, **kw) -> None:
    """The legend outside the data area, so that it covers no curve: right of the axes, or
    (below=True, for side-by-side panels) under its tick labels and x label."""
    if not below:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0,
                  **kw)
        return
    from matplotlib.transforms import offset_copy

    fig = ax.figure
    r = fig.canvas.get_renderer()
    # the tick labels and x label hang below the axes by a fixed number of points, whatever
    # size the layout gives the axes: anchor the legend that far under the axes' bottom edge
    under = ax.get_window_extent(r).y0 - ax.get_tightbbox(r).y0
    points = under * 72 / fig.dpi + 4
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, 0.0), borderaxespad=0,
              bbox_transform=offset_copy(ax.transAxes, fig=fig, y=-points, units="points"),
              **kw)


def _save(fig, out_dir: Path, name: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    SAVED_AXES[name] = describe_axes(fig)
    SAVED_FIGURES[name] = fig
    plt.close(fig)
    return path


def _wrap(text: str, width: int) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, width))


def _geom(lo: float, hi: float, n: int = 60) -> list[int]:
    """About n integers spaced evenly on a log axis from lo to hi, both included."""
    pts = {round(lo * (hi / lo) ** (i / (n - 1))) for i in range(n)}
    return sorted(p for p in pts if p >= 1)


def model_label(cfg: GPTConfig, name: str | None = None) -> str:
    head = f"{name}: " if name else ""
    return (f"{head}L={cfg.n_layer} E={cfg.n_embd} H={cfg.n_head} T={cfg.block_size} "
            f"V={cfg.vocab_size}")


# ---------------------------------------------------------------------------------------------
# parameters vs E and vs L

def _gpt_family(n_embd: int, n_layer: int) -> GPTConfig:
    # the GPT-2/GPT-3 architecture (Brown et al. 2020: GPT-3 is GPT-2's with T=2048); heads 64 wide
    # where E allows, else one head (the count does not depend on H)
    heads = n_embd // 64 if n_embd % 64 == 0 else 1
    return from_name("gpt3-small", n_embd=n_embd, n_layer=n_layer, n_head=heads)


def params_series(vary: str, values: Sequence[int], base: Callable[[int], GPTConfig]
                  ) -> list[int]:
    """Exact parameter totals of `base(v)` for each v (v is E or L, as `vary` says)."""
    return [count_params(base(v)).total for v in values]


def widened(cfg: GPTConfig, n_embd: int) -> GPTConfig:
    """`cfg` at width `n_embd` with its head size, its query-per-KV-head grouping and its
    d_ff / E ratio kept (every other switch, V and T unchanged)."""
    group = cfg.n_head // cfg.kv_heads
    heads = n_embd // cfg.head_size
    return cfg.replace(n_embd=n_embd, n_head=heads,
                       n_kv_head=None if cfg.n_kv_head is None else heads // group,
                       d_ff=None if cfg.d_ff is None else round(cfg.d_ff * n_embd / cfg.n_embd))


def own_width_series(cfg: GPTConfig, lo: int = 64, hi: int = 16384) -> list[tuple[int, int]]:
    """(E, parameters) of `widened(cfg, E)` for widths from lo to hi that hold a whole number
    of KV groups of heads, the model's own E among them."""
    from gptcalc.errors import ConfigError

    unit = cfg.head_size * (cfg.n_head // cfg.kv_heads)
    widths = sorted({unit * max(1, round(w / unit)) for w in _geom(lo, hi, 40)} | {cfg.n_embd})
    out = []
    for e in widths:
        try:
            out.append((e, count_params(widened(cfg, e)).total))
        except ConfigError:  # a width this architecture refuses (e.g. an odd rotary size)
            continue
    return out


def plot_params(out_dir: Path, cfg: GPTConfig, name: str | None = None) -> Plot:
    """Parameters vs width E and vs depth L, GPT-2 and GPT-3 presets marked, the model's own
    architecture (its V and T) drawn through its star."""
    fig, (ax_e, ax_l) = plt.subplots(1, 2, figsize=(12, 6.4))
    widths = _geom(64, 16384, 40)
    for L, colour in zip((12, 24, 48, 96), ("C0", "C1", "C2", "C3")):
        ax_e.plot(widths, params_series("E", widths, lambda e, L=L: _gpt_family(e, L)),
                  color=colour, lw=1.2, alpha=0.7, label=f"GPT-2/3 architecture, L={L}")
    depths = list(range(1, 129))
    for E, colour in zip((768, 1600, 4096, 12288), ("C0", "C1", "C2", "C3")):
        ax_l.plot(depths, params_series("L", depths, lambda l, E=E: _gpt_family(E, l)),
                  color=colour, lw=1.2, alpha=0.7, label=f"GPT-2/3 architecture, E={E:,}")
    for names, marker, colour, family in ((GPT2_PRESETS, "o", "black", "GPT-2 presets"),
                                          (GPT3_PRESETS, "s", "tab:purple", "GPT-3 presets")):
        pts = [(from_name(n), n) for n in names]
        for ax, attr in ((ax_e, "n_embd"), (ax_l, "n_layer")):
            xs = [getattr(c, attr) for c, _ in pts]
            ys = [count_params(c).total for c, _ in pts]
            ax.scatter(xs, ys, marker=marker, s=42, zorder=5, facecolor="none",
                       edgecolor=colour, linewidth=1.6, label=family)
            for (_, n), x, y in zip(pts, xs, ys):
                # vs E: GPT-2 names on the left, GPT-3 on the right, with the count; vs L many
                # presets share a depth, so short names only, GPT-3 on the left
                left = (names is GPT2_PRESETS) == (ax is ax_e) or x == max(xs) > 1000
                text = f"{n} ({si(y)})" if ax is ax_e else n
                ax.annotate(text, (x, y), xytext=(-7 if left else 7, 0),
                            textcoords="offset points", fontsize=7, color=colour,
                            ha="right" if left else "left", va="center")
    here = count_params(cfg).total
    own = f"V={cfg.vocab_size:,}, T={cfg.block_size:,}"
    own_e = own_width_series(cfg)
    ax_e.plot([e for e, _ in own_e], [n for _, n in own_e], color="red", lw=1.8,
              label=f"this model's architecture, L={cfg.n_layer}, {own}")
    own_depths = sorted(set(depths) | {cfg.n_layer})
    ax_l.plot(own_depths, params_series("L", own_depths, lambda l: cfg.replace(n_layer=l)),
              color="red", lw=1.8, label=f"this model's architecture, E={cfg.n_embd:,}, {own}")
    for ax, x in ((ax_e, cfg.n_embd), (ax_l, cfg.n_layer)):
        ax.scatter([x], [here], marker="*", s=160, color="red", zorder=6,
                   label=f"this model ({si(here)})")
    ax_e.set(xscale="log", yscale="log", xlabel="embedding width E (d_model)",
             ylabel="parameters (count, tied head counted once)",
             title="Parameters vs width E\n(GPT-2/3 curves: V=50,257, T=2,048)")
    ax_l.set(xscale="log", yscale="log", xlabel="number of blocks L",
             ylabel="parameters (count, tied head counted once)",
             title="Parameters vs depth L\n(GPT-2/3 curves: V=50,257, T=2,048)")
    for ax in (ax_e, ax_l):
        _count_axis(ax)
        _int_axis(ax)
        ax.grid(True, which="major", alpha=0.3)
    fig.suptitle("Exact parameter counts: ~12·L·E² once E is large; the embedding V·E dominates "
                 "small models", fontsize=11)
    fig.tight_layout()
    for ax in (ax_e, ax_l):
        _legend(ax, below=True, ncol=2)
    path = _save(fig, out_dir, "params_scaling")
    return Plot("params_scaling", path, "Parameters vs E and vs L",
                "Exact totals for the GPT-2/GPT-3 architecture; circles and squares are the "
                "published GPT-2 and GPT-3 sizes; the red line is the analysed model's own "
                "architecture (its V and T, one parameter varied) and the red star the model "
                f"({model_label(cfg, name)}).", {"params": here})


# ---------------------------------------------------------------------------------------------
# FLOPs per token vs sequence length

def flops_split_per_token(cfg: GPTConfig, seq_len: int, causal: bool = False) -> tuple[int, int]:
    """(dense, attention) forward matmul FLOPs per token at `seq_len`.

    Dense: the weight matmuls (q/k/v, output, MLP, lm_head), constant per token. Attention: the
    score and value products, q @ k^T and att @ v, which grow linearly with the sequence length.
    """
    fwd = forward_flops(cfg.replace(block_size=max(cfg.block_size, seq_len)), seq_len, causal)
    dense = sum(fwd[k] for k in DENSE_KEYS)
    attn = sum(fwd[k] for k in ATTENTION_KEYS)
    return dense // seq_len, attn // seq_len if attn % seq_len == 0 else attn / seq_len


def attention_crossover(cfg: GPTConfig, causal: bool = False) -> int:
    """The smallest sequence length at which attention's per-token FLOPs reach the rest's.

    Attention per token rises with S, the dense part does not; found by bisection on the exact
    counts (no closed form assumed).
    """
    lo, hi = 1, 2
    while True:
        dense, attn = flops_split_per_token(cfg, hi, causal)
        if attn >= dense:
            break
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        dense, attn = flops_split_per_token(cfg, mid, causal)
        lo, hi = (lo, mid) if attn >= dense else (mid, hi)
    dense, attn = flops_split_per_token(cfg, lo, causal)
    return lo if attn >= dense else hi


def plot_flops_vs_seq_len(out_dir: Path, cfg: GPTConfig, name: str | None = None,
                          measured: Sequence[tuple[int, float]] = ()) -> Plot:
    """Forward FLOPs per token vs S, dense and attention apart, the crossover marked."""
    cross = attention_crossover(cfg)
    s_max = max(4 * cfg.block_size, 4 * cross)
    lengths = _geom(1, s_max, 80)
    split = [flops_split_per_token(cfg, s) for s in lengths]
    dense = [d for d, _ in split]
    attn = [a for _, a in split]
    fig, ax = plt.subplots(figsize=(11, 5))
    ax.plot(lengths, [d + a for d, a in split], color="black", lw=2,
            label="total (forward matmul FLOPs per token)")
    ax.plot(lengths, dense, color="C0", lw=1.5, label="dense: q/k/v, out, MLP, lm_head weights")
    ax.plot(lengths, attn, color="C3", lw=1.5, label="attention: q·kᵀ and att·v (full S×S)")
    d_x, a_x = flops_split_per_token(cfg, cross)
    ax.axvline(cross, color="C3", ls=":", lw=1)
    ax.scatter([cross], [a_x], color="C3", zorder=5)
    ax.annotate(f"attention overtakes the rest\nat S = {cross:,}", (cross, a_x),
                xytext=(-10, 18), textcoords="offset points", ha="right", fontsize=9, color="C3")
    ax.axvline(cfg.block_size, color="grey", ls="--", lw=1)
    ax.text(cfg.block_size, 0.03, f" block size T = {cfg.block_size:,}", color="grey",
            fontsize=8, rotation=90, va="bottom", ha="right", transform=ax.get_xaxis_transform())
    if measured:
        ax.scatter([s for s, _ in measured], [f for _, f in measured], marker="x", s=50,
                   color="black", zorder=6, label="measured (FlopCounterMode, reference model)")
    ax.set(xscale="log", yscale="log", xlabel="sequence length S (tokens)",
           ylabel="forward FLOPs per token (2 per multiply-add)",
           title=f"FLOPs per token vs sequence length\n{model_label(cfg, name)}")
    _count_axis(ax)
    _int_axis(ax)
    ax.grid(True, which="major", alpha=0.3)
    _legend(ax)
    path = _save(fig, out_dir, "flops_vs_seq_len")
    return Plot("flops_vs_seq_len", path, "FLOPs per token vs sequence length",
                "Per token, the weight matmuls cost the same at every length; attention grows "
                f"linearly in S and overtakes them at S = {cross:,} "
                f"(dense {si(d_x)}FLOPs, attention {si(a_x)}FLOPs per token there).",
                {"crossover": cross})


# ---------------------------------------------------------------------------------------------
# KV cache vs context

KV_PRESETS = ("gpt2", "gpt2-xl", "gpt3-175b", "llama2-7b", "llama3-8b")


def plot_kv_cache(out_dir: Path, cfg: GPTConfig, name: str | None = None,
                  presets: Iterable[str] = KV_PRESETS) -> Plot:
    fig, ax = plt.subplots(figsize=(11, 5))
    # a preset that is the model itself is drawn once, as the model
    items = [(n, from_name(n)) for n in presets if n != name and from_name(n) != cfg]
    items.append((name or "this model", cfg))
    for i, (n, c) in enumerate(items):
        ctx = _geom(1, c.block_size, 50)
        style = dict(color="red", lw=2.5) if i == len(items) - 1 else dict(lw=1.5)
        label = f"{n} (L={c.n_layer}, kv width {c.kv_width:,}, up to T={c.block_size:,})"
        # one sequence, bf16 keys and values
        ax.plot(ctx, [kv_cache_bytes(c, 1, t, 2) for t in ctx], label=label, **style)
    ax.set(xscale="log", yscale="log", xlabel="context length (tokens)",
           ylabel="KV cache per sequence (bf16 bytes)",
           title="KV cache vs context: 2 · L · context · n_kv_head · head_dim · 2 bytes")
    _bytes_axis(ax)
    _int_axis(ax)
    ax.grid(True, which="major", alpha=0.3)
    _legend(ax)
    path = _save(fig, out_dir, "kv_cache")
    return Plot("kv_cache", path, "KV cache vs context",
                "Keys and values kept for generation grow linearly with the context; grouped-query "
                "attention (llama3-8b: 8 KV heads for 32 query heads) cuts them by the ratio.")


# ---------------------------------------------------------------------------------------------
# size and cost of a token vs the context length T, measured

def plot_context_claims(out_dir: Path, cfg: GPTConfig, sizes: Sequence, costs: Sequence,
                        name: str | None = None) -> Plot:
    """Measured parameters and FLOPs per token vs T (`reports.claims` points)."""
    from .claims import cost_findings, position_share

    fig, (ax_p, ax_f) = plt.subplots(1, 2, figsize=(12, 6.4))
    Ts = [s.block_size for s in sizes]
    fixed = [s.analytic_params - s.position_params for s in sizes]
    ax_p.plot(Ts, [s.analytic_params for s in sizes], color="C0", lw=1.5,
              label="gptcalc: count_params")
    ax_p.plot(Ts, fixed, color="grey", ls="--", lw=1.2,
              label="the part that does not depend on T")
    ax_p.scatter(Ts, [s.measured_params for s in sizes], marker="x", s=60, color="black",
                 zorder=5, label="measured: reference model numel()")
    first, last = sizes[0], sizes[-1]
    grew = last.measured_params - first.measured_params
    learned = cfg.pos_embedding == "learned"
    if learned:
        note = (f"{grew:+,} parameters from T={first.block_size:,} to T={last.block_size:,}\n"
                f"= {last.block_size - first.block_size:,} × E={cfg.n_embd}; the position "
                f"table is {position_share(sizes):.1f}%\nof the model at T={last.block_size:,}")
        answer = "only the learned position table (T·E) grows"
    else:
        note = (f"{grew:+,} parameters from T={first.block_size:,} to T={last.block_size:,}:\n"
                f"{cfg.pos_embedding} positions have no table")
        answer = f"yes: no learned position table ({cfg.pos_embedding} positions)"
    ax_p.annotate(note, (0.03, 0.80), xycoords="axes fraction", ha="left", fontsize=9)
    # linear axes: the growth is a straight line, T x E
    ax_p.set(xlabel="block size T (tokens)", ylabel="parameters (count)",
             title=f"Is model size independent of T?\n{answer}")
    ax_p.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))
    ax_p.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}"))

    f = cost_findings(costs)
    cT = [p.block_size for p in costs]
    tok = [p.per_token for p in costs]
    att = [p.attention_per_token for p in costs]
    ax_f.scatter(cT, tok, marker="x", s=60, color="black", zorder=5,
                 label="measured: forward FLOPs per token (FlopCounterMode)")
    ax_f.scatter(cT, att, marker="+", s=70, color="C3", zorder=5,
                 label="measured: attention part per token")
    ax_f.scatter(cT, [t - a for t, a in zip(tok, att)], marker="+", s=70, color="C0", zorder=5,
                 label="measured: dense part per token")
    fit = [f.per_token.coefficient * t ** f.per_token.exponent for t in cT]
    ax_f.plot(cT, fit, color="black", ls="--", lw=1,
              label=f"least-squares fit: T^{f.per_token.exponent:.2f} (attention alone: "
                    f"T^{f.attention_per_token.exponent:.2f})")
    cubic = [tok[0] * (t / cT[0]) ** 3 for t in cT]
    ax_f.plot(cT, cubic, color="C1", ls=":", lw=1.5,
              label="a cubic estimate, T³ (from the first point)")
    ax_f.set(xscale="log", yscale="log", xlabel="context length T (tokens)",
             ylabel="forward FLOPs per token (2 per multiply-add)",
             title="How does the cost of one token grow with T?\nconstant + linear, not T³")
    ax_f.set_ylim(min(att) / 2, max(tok) * 30)
    _count_axis(ax_f)
    _int_axis(ax_f)
    fig.suptitle(f"Size and cost vs context, measured on the reference model "
                 f"({model_label(cfg, name)})", fontsize=10)
    fig.tight_layout()
    for ax in (ax_p, ax_f):
        ax.grid(True, which="major", alpha=0.3)
        _legend(ax, below=True, ncol=2 if ax is ax_p else 1)
    path = _save(fig, out_dir, "context_claims")
    return Plot("context_claims", path, "How size and cost grow with context",
                "Measured parameters and FLOPs per token at several T.",
                {"exponent": f.per_token.exponent})


def make_plots(out_dir: Path, cfg: GPTConfig, workload, name: str | None = None,
               measured_flops: Sequence[tuple[int, float]] = (), setup=None) -> list[Plot]:
    """Every analytic scaling plot of this model; `setup` (a TrainingSetup; default the
    family's usual one) is the training the memory plots assume."""
    made = [plot_params(out_dir, cfg, name),
            plot_flops_vs_seq_len(out_dir, cfg, name, measured=measured_flops)]
    made += memory_plots(out_dir, cfg, workload, name, setup)
    made.append(plot_kv_cache(out_dir, cfg, name))
    return made


# ---------------------------------------------------------------------------------------------
# training memory

GPU_BYTES = 80 * 2**30  # an 80 GiB GPU: A100 80GB / H100 80GB (81,920 MiB)
GPU_LABEL = "one 80 GiB GPU (A100 / H100 80GB)"
CATEGORIES = ("weights", "gradients", "optimizer", "activations", "logits")
CATEGORY_COLOURS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3")


def memory_setup(cfg: GPTConfig, device: str | None = None):
    """The training set-up the memory plots assume when none is given: the family's usual one
    (bf16 autocast, SDPA, CUDA kernels; the tutorial and notes families fp32 with their manual
    attention), on one device."""
    from gptcalc.training import default_setup

    return default_setup(cfg, **({"device": device} if device else {}))


def memory_categories(cfg: GPTConfig, workload, setup) -> dict[str, int]:
    """`MemoryReport.categories` of this workload: what the stacked plot draws."""
    from gptcalc.memory import memory_report

    return memory_report(cfg, workload, setup).categories()


def _stack(ax, xs, series: list[dict[str, int]], peaks: Sequence[int]) -> None:
    """Stacked categories and the modelled peak, in GiB on linear axes (memory is linear in B
    and quadratic in S: linear axes show that shape as it is)."""
    gib = 2**30
    ys = [[d[c] / gib for d in series] for c in CATEGORIES]
    ax.stackplot(xs, ys, labels=list(CATEGORIES), colors=CATEGORY_COLOURS, alpha=0.85)
    ax.plot(xs, [p / gib for p in peaks], color="black", lw=1.8,
            label="modelled step peak (step_peak)")
    top = max(max(peaks), max(sum(d.values()) for d in series))
    if top >= GPU_BYTES / 4:  # the GPU line only where it is in view
        ax.axhline(GPU_BYTES / gib, color="red", ls="--", lw=1.2, label=GPU_LABEL)
        ax.set_ylim(0, max(top, GPU_BYTES) / gib * 1.1)
    else:
        ax.set_ylim(0, top / gib * 1.1)
        ax.text(0.98, 0.98, f"80 GiB GPU: off scale ({100 * top / GPU_BYTES:.1f}% used at most)",
                transform=ax.transAxes, ha="right", va="top", fontsize=8, color="red")
    # from 0 and a little past the last point: a workload at either end of the sweep (B = 1,
    # S = T) is drawn inside the axes, not on their edge
    ax.set_xlim(0, xs[-1] * 1.04)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:,.0f}" if top > 10 * gib
                                               else f"{v:,.2g}"))
    ax.grid(True, which="major", alpha=0.3)


def plot_training_memory(out_dir: Path, cfg: GPTConfig, workload, name: str | None = None,
                         setup=None) -> Plot:
    """Training memory stacked by category vs batch size and vs sequence length."""
    from gptcalc.workload import Workload
    from gptcalc.memory import step_peak
    from gptcalc.memory.engines import describe as describe_setup

    setup = setup or memory_setup(cfg)
    fig, (ax_b, ax_s) = plt.subplots(1, 2, figsize=(12, 7))
    b_max = max(16, 4 * workload.batch_size)  # around this workload's batch
    batches = sorted({1, *range(max(1, b_max // 64), b_max + 1, max(1, b_max // 64))})
    wls = [Workload(b, workload.seq_len) for b in batches]
    _stack(ax_b, batches, [memory_categories(cfg, w, setup) for w in wls],
           [step_peak(cfg, w, setup).bytes for w in wls])
    here = step_peak(cfg, workload, setup).bytes / 2**30
    for ax in (ax_b, ax_s):
        ax.axvline(workload.batch_size if ax is ax_b else workload.seq_len, color="grey",
                   ls=":", lw=1.5)
        ax.scatter([workload.batch_size if ax is ax_b else workload.seq_len], [here],
                   marker="o", s=40, color="black", zorder=6,
                   label=f"this workload, B = {workload.batch_size}, S = {workload.seq_len:,}")
    ax_b.set(xlabel=f"batch size B (sequences of S = {workload.seq_len:,} tokens)",
             ylabel="memory of one training step (GiB)",
             title=f"Training memory vs batch size (S = {workload.seq_len:,})")
    T = cfg.block_size
    lengths = sorted({1, *range(max(1, T // 64), T + 1, max(1, T // 64)), T})
    wls = [Workload(workload.batch_size, s) for s in lengths]
    _stack(ax_s, lengths, [memory_categories(cfg, w, setup) for w in wls],
           [step_peak(cfg, w, setup).bytes for w in wls])
    ax_s.set(xlabel=f"sequence length S (tokens, up to T = {T:,})",
             ylabel="memory of one training step (GiB)",
             title=f"Training memory vs sequence length (B = {workload.batch_size})")
    fig.suptitle(f"{_wrap(describe_setup(setup), 130)}.\nStacked: every category at once; "
                 f"black: gptcalc's modelled peak of a step\n{model_label(cfg, name)}",
                 fontsize=10)
    fig.tight_layout()
    for ax in (ax_b, ax_s):
        _legend(ax, below=True, ncol=2)
    path = _save(fig, out_dir, "training_memory")
    return Plot("training_memory", path, "Training memory vs batch size and sequence length",
                "Weights, gradients and AdamW's two moments are fixed; saved activations and "
                "logits grow linearly with B and, through attention's S x S scores, "
                "quadratically with S. The stack counts every category at once; the black line "
                "is gptcalc's modelled peak of a step, which also holds buffers and update "
                "temporaries but never all gradients and activations together. Red: an 80 GiB "
                "GPU.")


def plot_zero(out_dir: Path, cfg: GPTConfig, name: str | None = None) -> Plot:
    """Model states per device vs data-parallel size, one line per ZeRO stage."""
    from gptcalc.training_setup import TrainingSetup
    from gptcalc.memory import state_bytes

    fig, ax = plt.subplots(figsize=(11, 5))
    dps = [2**i for i in range(0, 11)]
    for z, colour in zip((0, 1, 2, 3), ("C0", "C1", "C2", "C3")):
        ys = [state_bytes(cfg, TrainingSetup(mode="mixed", dp=d, zero=z)).total for d in dps]
        what = {0: "replicated", 1: "optimizer states sharded", 2: "+ gradients sharded",
                3: "+ weights sharded"}[z]
        ax.plot(dps, ys, marker="o", ms=3, color=colour, label=f"ZeRO stage {z}: {what}")
    ax.axhline(GPU_BYTES, color="red", ls="--", lw=1.2, label=GPU_LABEL)
    ax.set(xscale="log", yscale="log", xlabel="data-parallel size (devices)",
           ylabel="weights + gradients + optimizer per device",
           title=f"Model states per device vs ZeRO stage (mixed precision AdamW, 16 B/param)\n"
                 f"{model_label(cfg, name)}")
    ax.xaxis.set_major_locator(LogLocator(base=2, numticks=12))
    _int_axis(ax)
    _bytes_axis(ax)
    ax.grid(True, which="major", alpha=0.3)
    _legend(ax)
    path = _save(fig, out_dir, "zero_stages")
    return Plot("zero_stages", path, "Memory per device vs ZeRO stage and data-parallel size",
                "Rajbhandari et al. 2020's accounting: 2 + 2 + 12 bytes per parameter (fp16 "
                "weights and gradients, fp32 master weights and Adam moments). Stage 1 shards "
                "the 12, stage 2 also the gradients, stage 3 everything; activations (not shown) "
                "are not sharded by ZeRO.")


def memory_plots(out_dir: Path, cfg: GPTConfig, workload, name: str | None = None,
                 setup=None) -> list[Plot]:
    return [plot_training_memory(out_dir, cfg, workload, name, setup),
            plot_zero(out_dir, cfg, name)]


# ---------------------------------------------------------------------------------------------
# --measure: points measured on the reference model over the analytic curves

def measure_small(cfg: GPTConfig, widths: Sequence[int] = (16, 32, 64, 128),
                  lengths: Sequence[int] = (4, 8, 16, 32, 64)) -> dict:
    """Parameters at small E and forward FLOPs per token at small S, measured on CPU.

    The model keeps this configuration's switches (architecture) with L=2 and V <= 128 so it
    runs in a blink; heads are shrunk to fit each width.
    """
    import torch

    from reference_model.measure import flopcounter_forward
    from reference_model.model import build_model

    from .claims import _split

    def small(E: int, T: int) -> GPTConfig:
        H = 2 if E % 2 == 0 else 1
        return cfg.replace(n_embd=E, n_head=H, n_kv_head=None if cfg.n_kv_head is None else 1,
                           head_dim=None, d_ff=None, n_layer=2, block_size=T,
                           vocab_size=min(cfg.vocab_size, 128))
    params = []
    for E in widths:
        c = small(E, 64)
        params.append((E, sum(p.numel() for p in build_model(c).parameters()),
                       count_params(c).total))
    c = small(64, max(lengths))
    model = build_model(c)
    flops = []
    for S in lengths:
        total, attention = _split(flopcounter_forward(model, torch.zeros((1, S), dtype=torch.long)))
        flops.append((S, total / S, sum(forward_flops(c, S).values()) / S, attention / S,
                      flops_split_per_token(c, S)[1]))
    return {"params": params, "flops": flops, "width_cfg": small, "flops_cfg": c}


def plot_measured(out_dir: Path, cfg: GPTConfig, name: str | None = None) -> Plot:
    data = measure_small(cfg)
    fig, (ax_p, ax_f) = plt.subplots(1, 2, figsize=(12, 6.2))
    widths = sorted({4 * round(w / 4) for w in _geom(8, 256, 40)})  # even head_dim for rotary
    ax_p.plot(widths, [count_params(data["width_cfg"](e, 64)).total for e in widths], color="C0",
              lw=1.5, label="gptcalc: count_params")
    ax_p.scatter([e for e, _, _ in data["params"]], [m for _, m, _ in data["params"]],
                 marker="x", s=70, color="black", zorder=5,
                 label="measured: reference model numel()")
    ax_p.set(xscale="log", yscale="log", xlabel="embedding width E (L=2, T=64)",
             ylabel="parameters (count)", title="Parameters: measured over the formula")
    c = data["flops_cfg"]
    lengths = list(range(1, c.block_size + 1))
    split = [flops_split_per_token(c, s) for s in lengths]
    ax_f.plot(lengths, [d + a for d, a in split], color="black", lw=1.5, label="gptcalc: total")
    ax_f.plot(lengths, [d for d, _ in split], color="C0", lw=1, label="gptcalc: dense part")
    ax_f.plot(lengths, [a for _, a in split], color="C3", lw=1, label="gptcalc: attention part")
    ax_f.scatter([f[0] for f in data["flops"]], [f[1] for f in data["flops"]], marker="x",
                 s=70, color="black", zorder=5, label="measured: FlopCounterMode forward")
    ax_f.scatter([f[0] for f in data["flops"]], [f[3] for f in data["flops"]], marker="+",
                 s=80, color="C3", zorder=5, label="measured: its attention ops (bmm)")
    ax_f.set(xscale="log", yscale="log", xlabel=f"sequence length S (tokens; E={c.n_embd}, L=2)",
             ylabel="forward FLOPs per token (2 per multiply-add)",
             title="FLOPs per token: measured over the formula")
    for ax in (ax_p, ax_f):
        _count_axis(ax)
        _int_axis(ax)
        ax.grid(True, which="major", alpha=0.3)
    fig.suptitle(f"Measured on CPU at small sizes with this model's architecture "
                 f"({model_label(cfg, name)})", fontsize=10)
    fig.tight_layout()
    for ax in (ax_p, ax_f):
        _legend(ax, below=True, ncol=2)
    path = _save(fig, out_dir, "measured")
    exact = all(m == a for _, m, a in data["params"]) and all(
        f[1] == f[2] and f[3] == f[4] for f in data["flops"])
    return Plot("measured", path, "Measured points over the analytic curves",
                "Crosses: parameters (numel) and FlopCounterMode forward FLOPs of the reference "
                "model at small sizes; lines: gptcalc's formulas. "
                + ("Every cross equals the formula exactly." if exact
                   else "Some crosses DIFFER from the formula."), {"exact": exact})


# ---------------------------------------------------------------------------------------------
# decode time per token, measured on CPU, with and without a KV cache

def plot_decode_timing(out_dir: Path, timings: Sequence, cfg: GPTConfig,
                       name: str | None = None) -> Plot:
    """Measured time per decoded token vs context (`reference_model.timing.DecodeTiming`s of the
    tiny model `cfg`): drawing only, the measurement is the caller's."""
    fig, ax = plt.subplots(figsize=(11, 5))
    ctx = [t.context for t in timings]
    ax.plot(ctx, [1e3 * t.seconds_with_cache for t in timings], "o-",
            label="with a KV cache: one query against the cached keys")
    ax.plot(ctx, [1e3 * t.seconds_without_cache for t in timings], "s-",
            label="without a cache: a forward over the whole context")
    ax.set(xscale="log", yscale="log", xlabel="context length (tokens)",
           ylabel="time per decoded token (ms)",
           title=f"Decode on CPU, measured\n{model_label(cfg, name)}")
    # ticks at the measured contexts only: a log axis's minor labels (2x10^1, 3x10^1, ...)
    # run into each other
    ax.xaxis.set_major_locator(FixedLocator(ctx))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_minor_formatter(NullFormatter())
    _int_axis(ax)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.grid(True, which="major", alpha=0.3)
    _legend(ax)
    path = _save(fig, out_dir, "decode_timing")
    return Plot("decode_timing", path, "Decode time per token vs context, measured",
                "With a KV cache the time per token stays nearly flat (the weights dominate, as "
                "the roofline's constant term); without one it grows with the context.",
                facts={"contexts": ctx})
