"""A Megatron-LM argument file (the `--flag value` list that pretrain_gpt.py takes, as
examples/gpt3/train_gpt3_175b_distributed.sh writes it), or that launch script itself (its
NAME=( ... ) arrays of arguments), as gptcalc's options.

Flags as Megatron-LM spells them (megatron/training/arguments.py, NVIDIA/Megatron-LM core_r0.12):

- the model is a GPT of the flags' sizes: LayerNorm, learned absolute positions, GELU, biases
  and a tied head unless --normalization RMSNorm, --position-embedding-type rope, --swiglu,
  --disable-bias-linear, --untie-embeddings-and-output-weights say otherwise; without
  --ffn-hidden-size d_ff is 4h, or int(8h/3 / 64) * 64 under --swiglu; dropout 0.1 on the hidden
  states and the attention probabilities unless --hidden-dropout / --attention-dropout;
- the vocabulary is padded to a multiple of --make-vocab-size-divisible-by (128) times the
  tensor-parallel size (_vocab_size_with_padding); GPT2BPETokenizer's has 50257 entries;
- --bf16 / --fp16 are Megatron's mixed precision (--mode mixed under --engine megatron) and
  --use-distributed-optimizer its sharded optimizer; the data-parallel size is the world size
  over tp x pp, which the file does not give (--dp);
- --recompute-granularity selective recomputes the attention core (--recompute selective);
  full with --recompute-method uniform and --recompute-num-layers 1 checkpoints every block.
"""

from __future__ import annotations

import math
import re
import shlex
from pathlib import Path
from typing import Any

from .base import Reading, Recipe, shown, TEXT, RecipeFormat, register_format

# flags that change nothing a step holds on the device
IGNORED = (
    "lr", "min-lr", "lr-decay-style", "lr-decay-iters", "lr-decay-samples", "lr-warmup-fraction",
    "lr-warmup-iters", "lr-warmup-samples", "weight-decay", "clip-grad", "adam-beta1",
    "adam-beta2", "adam-eps", "init-method-std", "train-iters", "train-samples", "log-interval",
    "save-interval", "eval-interval", "eval-iters", "save", "load", "data-path", "vocab-file",
    "merge-file", "split", "tensorboard-dir", "distributed-backend", "use-mcore-models", "seed",
    "log-params-norm", "log-num-zeros-in-grad", "log-throughput", "timing-log-level",
    "tokenizer-model", "no-masked-softmax-fusion", "overlap-grad-reduce",
    "overlap-param-gather", "rotary-base", "norm-epsilon", "attention-softmax-in-fp32",
    "accumulate-allreduce-grads-in-fp32", "transformer-impl", "use-flash-attn",
    "attention-backend", "no-position-embedding",
    "data-cache-path", "mock-data", "wandb-project", "wandb-exp-name", "ckpt-format",
    "use-checkpoint-args", "exit-interval", "no-load-optim", "no-load-rng", "finetune",
    "rampup-batch-size", "step-batch-size-schedule",  # the global batch's ramp: the
    # micro-batch stays
)
FLAGS = ("sequence-parallel", "bf16", "fp16", "use-distributed-optimizer", "swiglu",
         "untie-embeddings-and-output-weights", "disable-bias-linear", "add-qkv-bias",
         "group-query-attention", "recompute-activations")
READ = ("num-layers", "hidden-size", "num-attention-heads", "ffn-hidden-size", "kv-channels",
        "num-query-groups", "seq-length", "max-position-embeddings", "micro-batch-size",
        "global-batch-size", "tensor-model-parallel-size", "pipeline-model-parallel-size",
        "recompute-granularity", "recompute-method", "recompute-num-layers", "normalization",
        "position-embedding-type", "vocab-size", "tokenizer-type",
        "make-vocab-size-divisible-by", "hidden-dropout", "attention-dropout", "optimizer",
        "num-experts", *FLAGS)
TOKENIZER_VOCAB = {"GPT2BPETokenizer": 50257}  # GPT-2's BPE vocabulary


ARRAY = re.compile(r"^[ \t]*([A-Za-z_][A-Za-z0-9_]*)=\((.*?)^[ \t]*\)", re.M | re.S)


def script_args(text: str) -> str | None:
    """The training arguments of a launch script written as Megatron-LM's examples write them
    (examples/gpt3/train_gpt3_175b_distributed.sh: bash arrays GPT_MODEL_ARGS=( ... ),
    TRAINING_ARGS=( ... ), ... handed to pretrain_gpt.py), joined; the launcher's own array
    (DISTRIBUTED_ARGS: torchrun's --nproc_per_node, --nnodes) is left out. None when the text
    holds no such array."""
    arrays = [(name, body) for name, body in ARRAY.findall(text)]
    if not arrays:
        return None
    return "\n".join(body for name, body in arrays if "DISTRIBUTED" not in name.upper())


def parse_args(text: str, r: Reading) -> dict[str, Any]:
    """`--flag value ...` and `--flag` tokens (shell quoting, # comments and line
    continuations as a shell reads them) as {flag: value, a list of values, or True}."""
    try:
        tokens = shlex.split(text.replace("\\\n", " "), comments=True)
    except ValueError as e:
        raise r.fail(f"not an argument list: {e}") from None
    out: dict[str, Any] = {}
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        if not tok.startswith("--"):
            raise r.fail(f"expected a --flag, got {shown(tok)}")
        name, eq, value = tok[2:].partition("=")
        if eq:
            out[name] = value
        else:
            values = []
            while i + 1 < len(tokens) and not tokens[i + 1].startswith("--"):
                values.append(tokens[i + 1])
                i += 1
            out[name] = True if not values else values[0] if len(values) == 1 else values
        i += 1
    return out


def _int(r: Reading, args: dict[str, Any], flag: str, default: int | None = None) -> int | None:
    if flag not in args:
        return default
    if isinstance(args[flag], str) and args[flag].startswith("$"):
        raise r.fail(f"--{flag}: the shell variable {shown(args[flag])} is set when the script "
                     f"runs; give its value in an argument file")
    try:
        return r.count(f"--{flag}", int(args[flag]))
    except (TypeError, ValueError):
        raise r.fail(f"--{flag} must be a whole number, got {shown(args[flag])}") from None


def read_megatron(text: str, path: Path, given: dict[str, Any]) -> Recipe:
    """A Megatron-LM argument file as options; `given`: the options typed beside it (--dp
    gives the data-parallel size)."""
    r = Reading(path, "Megatron-LM")
    arrays = script_args(text)
    if arrays is not None:
        text = arrays
    elif text.lstrip().startswith("#!"):
        raise r.fail("a shell script without the NAME=( --flag value ... ) arrays Megatron-LM's "
                     "examples hand to pretrain_gpt.py; give its arguments as a file")
    args = parse_args(text, r)
    for flag, value in args.items():
        if flag in IGNORED and flag not in READ:
            r.ignore(f"--{flag}", "data, logging, checkpoints, a hyperparameter or a kernel")
        elif flag not in READ:
            r.unread.append(f"--{flag}")
        elif flag in FLAGS and value is not True:
            raise r.fail(f"--{flag} takes no value, got {shown(value)}")
    if "num-experts" in args:
        r.refuse("--num-experts", args["num-experts"])
    _model(r, args, given)
    _training(r, args, given)
    return r.recipe()


def _model(r: Reading, args: dict[str, Any], given: dict[str, Any]) -> None:
    for flag in ("num-layers", "hidden-size", "num-attention-heads"):
        if flag not in args:
            raise r.fail(f"--{flag} is missing")
    h = _int(r, args, "hidden-size")
    swiglu = "swiglu" in args
    r.set("(a GPT)", "preset", "gpt2")
    r.set("--num-layers", "n_layer", _int(r, args, "num-layers"))
    r.set("--hidden-size", "n_embd", h)
    r.set("--num-attention-heads", "n_head", _int(r, args, "num-attention-heads"))
    r.set("--ffn-hidden-size", "d_ff", _int(r, args, "ffn-hidden-size",
                                            int(8 * h / 3 / 64) * 64 if swiglu else 4 * h))
    if "kv-channels" in args:
        r.set("--kv-channels", "head_dim", _int(r, args, "kv-channels"))
    if "group-query-attention" in args:
        r.set("--num-query-groups", "n_kv_head", _int(r, args, "num-query-groups", 1))
    seq = _int(r, args, "seq-length")
    if seq is None:
        raise r.fail("--seq-length is missing")
    r.set("--max-position-embeddings", "block_size", _int(r, args, "max-position-embeddings", seq))
    r.set("--seq-length", "seq_len", seq)
    norm = {"LayerNorm": "layernorm", "RMSNorm": "rmsnorm"}.get(args.get("normalization",
                                                                          "LayerNorm"))
    pos = {"learned_absolute": "learned", "rope": "rotary", "none": "none"}.get(
        args.get("position-embedding-type", "learned_absolute"))
    if norm is None or pos is None:
        raise r.fail("--normalization is LayerNorm or RMSNorm and --position-embedding-type "
                     "learned_absolute, rope or none")
    switches = {"norm": norm, "pos_embedding": pos, "mlp": "swiglu" if swiglu else "gelu",
                "tie_embeddings": "untie-embeddings-and-output-weights" not in args,
                "embd_dropout": True}
    bias = "disable-bias-linear" not in args
    switches.update(qkv_bias=bias or "add-qkv-bias" in args, attn_out_bias=bias, mlp_bias=bias)
    flags = {"norm": "--normalization", "pos_embedding": "--position-embedding-type",
             "mlp": "--swiglu", "tie_embeddings": "--untie-embeddings-and-output-weights",
             "embd_dropout": "(a GPT)", "qkv_bias": "--disable-bias-linear",
             "attn_out_bias": "--disable-bias-linear", "mlp_bias": "--disable-bias-linear"}
    for name, value in switches.items():
        r.set(flags[name], "set", f"{name}={str(value).lower()}")
    hidden = float(args.get("hidden-dropout", 0.1))
    if float(args.get("attention-dropout", 0.1)) != hidden:
        r.refuse("--attention-dropout", args.get("attention-dropout", 0.1),
                 "one dropout probability for every site is modelled", option="dropout")
    r.set("--hidden-dropout", "dropout", hidden)
    tp = _int(r, args, "tensor-model-parallel-size", 1)
    vocab = _int(r, args, "vocab-size", TOKENIZER_VOCAB.get(str(args.get("tokenizer-type"))))
    if vocab is None:
        r.refuse("--tokenizer-type", args.get("tokenizer-type"), "its vocabulary size is not "
                 "in the file", option="vocab_size")
    else:
        multiple = _int(r, args, "make-vocab-size-divisible-by", 128) * tp
        key = "--vocab-size" if "vocab-size" in args else "--tokenizer-type"
        r.set(key, "vocab_size", math.ceil(vocab / multiple) * multiple)


def _training(r: Reading, args: dict[str, Any], given: dict[str, Any]) -> None:
    r.set("(Megatron-LM)", "engine", "megatron")
    r.set("(Megatron-LM)", "attn", "sdpa")
    tp = _int(r, args, "tensor-model-parallel-size", 1)
    r.set("--tensor-model-parallel-size", "tp", tp)
    r.set("--pipeline-model-parallel-size", "pp",
          _int(r, args, "pipeline-model-parallel-size", 1))
    r.set("--sequence-parallel", "sp", "sequence-parallel" in args)
    r.set("--use-distributed-optimizer", "distributed_optimizer",
          "use-distributed-optimizer" in args)
    if "bf16" in args or "fp16" in args:
        r.set("--bf16/--fp16", "mode", "mixed")
        r.set("--bf16/--fp16", "autocast_dtype", "bf16" if "bf16" in args else "fp16")
    else:
        r.set("(no --bf16)", "mode", "fp32")
    micro = _int(r, args, "micro-batch-size", 1)
    r.set("--micro-batch-size", "batch_size", micro)
    total = _int(r, args, "global-batch-size")
    dp = given.get("dp") or 1
    if total is not None:
        if total % (micro * dp):
            raise r.fail(f"--global-batch-size {total} is not a multiple of micro-batch x dp "
                         f"= {micro * dp}")
        r.set("--global-batch-size", "grad_accum", total // (micro * dp))
    opt = args.get("optimizer", "adam")
    if opt in ("adam", "sgd"):
        r.set("--optimizer", "optimizer", "adamw" if opt == "adam" else "sgd-momentum")
    else:
        r.refuse("--optimizer", opt, option="optimizer")
    _recompute(r, args)


def _recompute(r: Reading, args: dict[str, Any]) -> None:
    granularity = args.get("recompute-granularity")
    if "recompute-activations" in args:  # the older spelling of selective
        granularity = "selective"
    if granularity is None:
        r.set("(no --recompute-granularity)", "recompute", "none")
    elif granularity == "selective":
        r.set("--recompute-granularity", "recompute", "selective")
    elif granularity == "full" and args.get("recompute-method") == "uniform" and (
            _int(r, args, "recompute-num-layers", 1) == 1):
        r.set("--recompute-granularity", "recompute", "full")
    else:
        r.refuse("--recompute-granularity", granularity, "full recomputation other than "
                 "every block on its own (--recompute-method uniform, --recompute-num-layers "
                 "1) is not modelled", option="recompute")


__all__ = ["parse_args", "read_megatron"]

register_format(RecipeFormat("Megatron-LM", TEXT, lambda text: True, read_megatron))
