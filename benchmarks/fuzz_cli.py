"""Fuzz the command line in-process (click's CliRunner): every command, the engines, LoRA, Hub
ids and every family's config.json mutated; boundary values (1, 2^63, 10^300 and one past it,
the smallest and largest floats), many options at once, hostile --config and ds_config files
(lists where a scalar belongs, floats where an int does, 5,000-digit integers, NUL, deep
nesting, unknown keys) and special files (/dev/null, /dev/zero, a folder, a binary file, an
overlong or NUL-holding path). Counts, per defect class: internal errors, non-finite figures
printed, calls over 10 s, exit codes other than 0 and 2, refusals that are not one line (or
over 200 characters), and invalid values accepted with exit 0.

    PYTHONPATH=. python benchmarks/fuzz_cli.py --calls 20000 --seed 0

Each call is a command with options drawn at random; an option value drawn from the invalid
pool (zero or negative sizes, NaN, unknown choices) or a config.json whose count fields were
broken (zero, negative, wrong type, heads that do not divide, unknown model_type) marks the
call "must refuse": exit 0 on it is a defect. Missing and null fields and huge values may be
accepted (defaults, a huge model); they must still never traceback. Prints a table per command
and one line per defect class with a reproducer (the first seen).
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import re
import sys
import tempfile
import time
from collections import Counter, defaultdict
from pathlib import Path

from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gptcalc.cli import cli  # noqa: E402
from gptcalc.gpus import GPUS  # noqa: E402
from gptcalc.hf_families import (FAMILIES, HEADS, HIDDEN, KV_HEADS, LAYERS,  # noqa: E402
                                 TEXT_CONFIG_TYPES, VOCAB)
from gptcalc.presets import PRESETS  # noqa: E402
from tests.hf_published import PUBLISHED  # noqa: E402

COMMANDS = ["params", "flops", "memory", "time", "infer", "serve", "gpus"]
SMALL = ["--preset", "debug"]
BAD_INT = ["0", "-1", "-7", "abc", "1.5", "", "nan"]
GOOD_PRESETS = [p for p in PRESETS]

# (option, good values, invalid values): invalid ones must be refused with exit 2
MODEL_OPTS = [
    ("-B", ["1", "2", "8"], BAD_INT), ("--seq-len", ["1", "16", "64"], BAD_INT),
    ("-L", ["1", "2"], BAD_INT), ("-V", ["97", "1000"], BAD_INT),
    ("--grad-accum", ["1", "4"], BAD_INT), ("--dropout", ["0", "0.1"], ["-0.1", "1.5", "nan"]),
]
COMMAND_OPTS = {
    "memory": [
        ("--mode", ["fp32", "amp", "mixed", "bf16"], ["fp64"]),
        ("--optimizer", ["adamw", "sgd", "sgd-momentum", "adamw8bit", "adafactor", "lion",
                         "muon"], ["adam"]),
        ("--recompute", ["none", "selective", "op", "full"], ["half"]),
        ("--attn", ["manual", "sdpa"], ["flash"]),
        ("--impl", ["reference", "transformers", "paper", "megatron-core"], ["jax"]),
        ("--megatron-te", [None], []), ("--no-megatron-te", [None], []),
        ("--cp", ["1", "2", "4"], BAD_INT),
        ("--pp-schedule", ["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"], ["dualpipe"]),
        ("--pp-virtual", ["1", "2"], BAD_INT), ("--grad-accum", ["1", "4", "16"], BAD_INT),
        ("--compile", ["none", "blocks", "model"], ["max-autotune"]),
        ("--float8", ["none", "tensorwise", "rowwise"], ["blockwise"]),
        ("--offload-activations", [None], []),
        ("--allocator", ["default", "expandable"], ["cudaMallocAsync"]),
        ("--loss", ["standard", "chunked", "fused"], ["cce"]),
        ("--keep-logits", [None], []), ("--no-keep-logits", [None], []),
        ("--recipe", ["tests/recipes/torchtitan_llama3_8b.toml",
                      "tests/recipes/torchtune_llama3_1_8b_qlora.yaml",
                      "tests/recipes/megatron_gpt3_175b.args"], ["/nonexistent.toml"]),
        ("--engine", ["deepspeed", "fsdp2", "megatron", "ddp", "zero-redundancy"], ["horovod"]),
        ("--zero", ["0", "1", "2", "3"], ["4", "-1", "x"]),
        ("--dp", ["1", "2", "4", "8"], BAD_INT), ("--tp", ["1", "2"], BAD_INT),
        ("--pp", ["1", "2", "4"], BAD_INT), ("--ep", ["1", "2"], BAD_INT),
        ("--sp", [None], []), ("--no-sp", [None], []),
        ("--distributed-optimizer", [None], []), ("--no-distributed-optimizer", [None], []),
        ("--lora-rank", ["0", "1", "8", "64"], ["-2", "x", "1.5"]),
        ("--lora-targets", ["all", "qkv", "q,v", "o,down"], ["", "nonsense", ",", "q_proj"]),
        ("--weights-dtype", ["bf16", "int4"], ["int3"]),
        ("--autocast-dtype", ["bf16", "fp16"], ["fp8x"]),
        ("--device", ["cpu", "cuda"], ["tpu"]),
        ("--gpu-memory", ["80GiB", "24GB", "1TiB", "24G", "24Gi"], ["-1GiB", "lots", "0", "24"]),
        ("--gpu", list(GPUS)[:4], ["rtx9999"]),
        ("--set", ["qkv_layout=fused", "mlp=swiglu", "mlp=gelu"], ["qkv_layout=x"]),
        ("--overhead", ["0", "1GiB"], ["-5", "x"]),
        ("--context", ["1", "128"], BAD_INT),
    ],
    "time": [
        ("--tokens", ["1e9", "300e9", "1000", "1T", "2.49 G"], ["-1", "0", "x", "nan", "inf", "T"]),
        ("-L", [str(10**150)], []), ("--mfu", ["1e-300", "5e-324"], []),
        ("--gpu", ["h100-sxm", "a100-80gb"] + list(GPUS)[:3], ["rtx9999"]),
        ("--gpus", ["1", "8", "1024"], BAD_INT),
        ("--mfu", ["0.4", "1"], ["0", "1.5", "-0.2", "nan"]),
        ("--precision", ["bf16", "fp8"], ["fp4x"]),
        ("--recompute", ["none", "selective", "op", "full"], ["half"]),
        ("--tokens-per-second", ["1000", "1e6"], ["0", "-3", "nan", "inf"]),
        ("--seconds-per-step", ["0.5", "2"], ["0", "-1", "nan"]),
        ("--tokens-per-step", ["4096", "1e6"], ["0", "-1", "x"]),
    ],
    "infer": [
        ("--gpu", ["h100-sxm"] + list(GPUS)[:3], ["rtx9999"]),
        ("--tp", ["1", "2", "8"], BAD_INT), ("--prompt-len", ["1", "128"], BAD_INT),
        ("--gen-len", ["1", "128"], BAD_INT), ("-L", [str(10**150)], []),
        ("--weights-dtype", ["bf16", "fp16", "fp8", "int8", "int4"], ["int3"]),
        ("--kv-dtype", ["bf16", "fp16", "fp8", "int8"], ["int4"]),
        ("--flops-efficiency", ["0.5", "1"], ["0", "1.5", "nan"]),
        ("--bandwidth-efficiency", ["0.7", "1"], ["0", "2", "-1"]),
    ],
    "serve": [
        ("--engine", ["vllm", "sglang"], ["tgi"]),
        ("--gpu", ["h100-sxm"] + list(GPUS)[:3], ["rtx9999"]),
        ("--gpu-memory", ["80GiB", "24GiB"], ["-1GiB", "x", "0"]),
        ("--tp", ["1", "2"], BAD_INT),
        ("--weights-dtype", ["bf16", "fp8", "int4"], ["int3"]),
        ("--kv-dtype", ["bf16", "fp8"], ["int4"]),
        ("--gpu-memory-utilization", ["0.9", "0.5"], ["0", "1.5", "nan"]),
        ("--max-model-len", ["16", "2048"], BAD_INT),
        ("--max-num-batched-tokens", ["64", "8192"], BAD_INT),
        ("--max-num-seqs", ["1", "256"], BAD_INT),
        ("--kv-block-size", ["16", "32"], BAD_INT),
        ("--context", ["16", "1024"], BAD_INT), ("--gen-len", ["1", "16"], BAD_INT),
        ("--non-torch", ["0", "1GiB"], ["-1", "x"]),
        ("--engine-version", ["0.6.4", "0.8.0", "0.33.0"], ["latest", "1"]),
        ("--enable-lora", [None], []),
        ("--max-loras", ["1", "4"], BAD_INT), ("--max-lora-rank", ["8", "64"], BAD_INT),
    ],
    "flops": [("--recompute", ["none", "selective", "full"], ["half"]),
              ("--prompt-len", ["1", "8"], BAD_INT), ("--context", ["8", "16"], BAD_INT),
              ("--causal", [None], [])],
    "params": [], "gpus": [],
}
# boundary values, drawn for any option that takes a number: valid or refused, never an
# internal error nor a figure that is not finite
BOUNDARY = ["1", "2", str(2**31), str(2**63), str(10**300), str(10**300 + 1), "9" * 400,
            "5e-324", "1e-300", "1e308", "1.7976931348623157e308", "0.999999999999", "1e-9"]
# hostile --config files (gptcalc's own TOML/JSON), each True where it must be refused
CONFIGS = {
    "cfg.toml": ('[model]\npreset = "debug"\n', False),
    "list.toml": ('[model]\npreset = "debug"\nn_layer = [2]\n', True),
    "float.toml": ('[model]\npreset = "debug"\nn_layer = 2.5\n', True),
    "digits.toml": ('[model]\npreset = "debug"\nn_layer = ' + "9" * 18 + "\n", False),
    "super.toml": ('[model]\npreset = "debug"\n[workload]\nbatch_size = "²"\n', True),
    "nul.toml": ('[model]\npreset = "debug\\u0000"\n', True),
    "unknown.toml": ('[model]\npreset = "debug"\n[training]\nmodee = "bf16"\n', True),
    "table.toml": ('[model]\npreset = "debug"\n[training]\nmode = {a = 1}\n', True),
    "zero.toml": ('[model]\npreset = "debug"\n[parallel]\ndp = 0\n', True),
    "deep.json": ('{"model": ' * 3000 + "1" + "}" * 3000, True),
    "digits.json": ('{"model": {"preset": "debug", "n_layer": ' + "9" * 5000 + "}}", True),
    "nan.json": ('{"model": {"preset": "debug", "dropout": NaN}}', True),
    "list.json": ('{"model": {"preset": ["debug"]}}', True),
    "mt.json": ('{"model": {"preset": "debug"}, "workload": {"seq_len": [1, 2]}}', True),
}
# the CONFIGS whose fault is in a table only `memory` (and the training commands) read
TRAINING_TABLE_CONFIGS = ("unknown.toml", "table.toml", "zero.toml")
# hostile ds_config files, each True where it must be refused
HOSTILE_DS = {
    '{"zero_optimization": {"stage": [2]}}': True,
    '{"zero_optimization": {"stage": 2, "reduce_bucket_size": "lots"}}': True,
    '{"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": -1}}': True,
    '{"zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e300}}': False,
    '{"train_micro_batch_size_per_gpu": [1]}': True,
    '{"zero_optimization": ' * 2000 + "1" + "}" * 2000: True,
    '[1, 2, 3]': True,
    '"text"': True,
    '{"bf16": {"enabled": "true"}}': True,
    '{"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}}': True,
}
# files that are not files a reader expects: each must be refused (exit 2), never hang
SPECIAL = ["/dev/null", "/dev/zero", "/", "/proc/self/status", "binary", "empty",
           "x" * 5000, "a\x00b.toml", "/tmp/" + "d" * 300 + "/config.json"]

HUB_IDS = ["meta-llama/Llama-3.1-8B", "org/name", "Qwen/Qwen3-8B", "a/b/c", "org/", "/name",
           "gpt2", "org//name", "org/name@main", "org/name:rev", "ORG/NAME", "-/-", "x/y z",
           "a/b..c", "org/-name", "org/" + "x" * 300, "x" * 300 + "/config.json"]
# ds_config files (memory --deepspeed-config): numbers no setting holds, and good ones
DS_CONFIGS = {
    '{"zero_optimization": {"stage": NaN}}': True,
    '{"train_micro_batch_size_per_gpu": Infinity}': True,
    '{"train_micro_batch_size_per_gpu": 1e400}': True,
    '{"train_micro_batch_size_per_gpu": ' + "9" * 5000 + "}": True,
    '{"bf16": {"enabled": 1}}': True,
    '{"zero_optimization": {"stage": 1.0}}': True,
    '{"bf16": {"enabled": true}, "zero_optimization": {"stage": 2}}': False,
    '{"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 3}}': False,
}


# ------------------------------------------------------------------ config.json mutations

def seeds() -> list[dict]:
    """One published config per family, a minimal one for families with none, and the nested
    multimodal forms."""
    out = [copy.deepcopy(c) for c in PUBLISHED.values()]
    have = {c.get("model_type") for c in out}
    for family in FAMILIES:
        if family not in have:
            out.append({"model_type": family, "hidden_size": 64, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "num_key_value_heads": 2,
                        "intermediate_size": 128, "vocab_size": 1000,
                        "max_position_embeddings": 256})
    for outer, inner in TEXT_CONFIG_TYPES.items():
        text = next((c for c in out if c.get("model_type") == inner), None)
        if text:
            out.append({"model_type": outer, "text_config": copy.deepcopy(text),
                        "tie_word_embeddings": True})
    return out


COUNT_KEYS = HIDDEN + LAYERS + HEADS + VOCAB


def _target(cfg: dict) -> dict:
    return cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg


def _reads(cfg: dict, key: str) -> bool:
    """Whether the family's reader uses `key` (a key it ignores may hold anything)."""
    from gptcalc.hf import hf_fields

    probe = copy.deepcopy(cfg)
    _target(probe).pop(key)
    try:
        return hf_fields(probe) != hf_fields(cfg)
    except Exception:
        return True


def _implicit_head_dim(cfg: dict) -> bool:
    """Whether a head's width is E / H (no head_dim, no MLA head dims): then H must divide E."""
    from gptcalc.hf import hf_fields

    try:
        f = hf_fields(cfg)
    except Exception:
        return False
    return f.get("head_dim") is None and not f.get("kv_lora_rank")


def mutate(rng: random.Random, cfg: dict) -> tuple[dict, str, bool]:
    """A mutated copy, the mutation's name, and whether the result is invalid for sure."""
    cfg = copy.deepcopy(cfg)
    t = _target(cfg)
    keys = [k for k in t if k != "model_type"]
    counts = [k for k in t if k in COUNT_KEYS and isinstance(t[k], int)]
    kind = rng.choice(["missing", "null", "wrong type", "zero", "negative", "huge",
                       "inconsistent heads", "unknown model_type", "nested text_config",
                       "none", "float", "kv heads"])
    if kind == "missing" and keys:
        del t[rng.choice(keys)]
        return cfg, kind, False
    if kind == "null" and keys:
        t[rng.choice(keys)] = None
        return cfg, kind, False
    if kind == "wrong type" and counts:
        t[rng.choice(counts)] = rng.choice(["64", [64], {"a": 1}, True, "abc"])
        return cfg, kind, True
    if kind == "float" and counts:
        t[rng.choice(counts)] = rng.choice([1.5, 64.0, float("nan"), float("inf")])
        return cfg, kind, True
    if kind == "zero" and counts:
        t[rng.choice(counts)] = 0
        return cfg, kind, True
    if kind == "negative" and counts:
        t[rng.choice(counts)] = -rng.choice([1, 64, 10**6])
        return cfg, kind, True
    if kind == "huge" and keys:
        t[rng.choice(counts or keys)] = rng.choice([10**12, 10**30, 2**63])
        return cfg, kind, False
    if kind == "inconsistent heads":
        hk = next((k for k in HEADS if k in t), None)
        wk = next((k for k in HIDDEN if k in t), None)
        if hk and wk and isinstance(t[wk], int) and t[wk] > 1 and _implicit_head_dim(cfg):
            t[hk] = t[wk] + 1  # more heads than width: cannot divide
            return cfg, kind, True
    if kind == "kv heads":
        hk = next((k for k in HEADS if k in t), None)
        kk = next((k for k in KV_HEADS if k in t), None)
        if hk and kk and isinstance(t[hk], int) and t[hk] > 1 and _reads(cfg, kk):
            t[kk] = t[hk] + 1  # more key/value heads than heads
            return cfg, kind, True
    if kind == "unknown model_type":
        cfg["model_type"] = rng.choice(["t5", "bert", "", "llama4", 7, None, "LLAMA"])
        return cfg, kind, True
    if kind == "nested text_config":
        outer = rng.choice(list(TEXT_CONFIG_TYPES) + ["llava"])
        inner = rng.choice([t, [], "x", None, {}, {"model_type": "bert"}])
        return {"model_type": outer, "text_config": inner}, kind, False
    return cfg, "none", False


# ------------------------------------------------------------------ calls

def write_ds_configs(folder: Path) -> dict[str, tuple[str, str, bool]]:
    """Each of DS_CONFIGS written to `folder`, keyed as `draw_call` reads them ("ds:" + text)."""
    out = {}
    for i, text in enumerate(DS_CONFIGS):
        p = folder / f"ds{i}.json"
        p.write_text(text)
        out["ds:" + text] = (str(p), "ds_config", DS_CONFIGS[text])
    return out


def write_hostile_files(folder: Path) -> dict[str, tuple[str, str, bool]]:
    """CONFIGS, HOSTILE_DS and the SPECIAL files' stand-ins written to `folder`, keyed as
    `draw_call` reads them ("cfg:", "hds:", "special:")."""
    out = {}
    for name, (text, invalid) in CONFIGS.items():
        p = folder / name
        p.write_text(text)
        out["cfg:" + name] = (str(p), "config " + name, invalid)
    for i, text in enumerate(HOSTILE_DS):
        p = folder / f"hds{i}.json"
        p.write_text(text)
        out["hds:" + str(i)] = (str(p), "ds_config " + text[:30], HOSTILE_DS[text])
    (folder / "binary").write_bytes(bytes(range(256)) * 4)
    (folder / "empty").write_text("")
    for name in SPECIAL:
        path = str(folder / name) if name in ("binary", "empty") else name
        out["special:" + name[:20]] = (path, "special " + name[:20], True)
    return out


def draw_call(rng: random.Random, files: dict[str, tuple[str, str, bool]]):
    """(args, must_refuse, label)."""
    if rng.random() < 0.25 and any(k.startswith(("cfg:", "special:", "hds:")) for k in files):
        return _draw_hostile(rng, files)
    command = rng.choice(COMMANDS)
    args, refuse, label = [command], False, []
    if command == "gpus":
        if rng.random() < 0.5:
            args.append("--json")
        return args, False, "gpus"
    source = rng.random()
    if source < 0.45:
        path, kind, invalid = files[rng.choice([k for k in files if not k.startswith(
            ("ds:", "cfg:", "hds:", "special:"))])]
        args += ["--hf-config", path]
        refuse |= invalid
        label.append(f"config:{kind}")
    elif source < 0.55:
        args += ["--hf-config", rng.choice(HUB_IDS)]
        label.append("hub id")
    else:
        args += ["--preset", rng.choice(GOOD_PRESETS if rng.random() < 0.9 else ["gpt5", ""])]
        refuse |= args[-1] not in PRESETS
        label.append("preset")
    pool = MODEL_OPTS + COMMAND_OPTS[command] if not refuse else COMMAND_OPTS[command]
    many = rng.randint(0, 4) if rng.random() < 0.8 else rng.randint(5, 14)  # many at once
    for name, good, bad in rng.sample(pool, k=min(len(pool), many)):
        if name in args:  # an option given twice: the last wins, and may hide a bad value
            continue
        if name == "--recipe" and refuse:  # a recipe's own model sizes replace a broken file's
            continue
        if bad and rng.random() < 0.2:
            args += [name, rng.choice(bad)]
            refuse = True
            label.append(f"bad {name}")
        elif good != [None] and _numeric(good) and rng.random() < 0.15:
            args += [name, rng.choice(BOUNDARY)]  # valid or refused, either way one line
            label.append(f"boundary {name}")
        else:
            v = rng.choice(good)
            args += [name] if v is None else [name, v]
    if command == "memory" and rng.random() < 0.1:
        text = rng.choice(list(DS_CONFIGS))
        args += ["--deepspeed-config", files["ds:" + text][0]]
        refuse |= DS_CONFIGS[text]
        label.append("ds_config")
    if command == "memory" and not refuse and rng.random() < 0.05:  # a later --zero wins
        args += ["--engine", "zero-redundancy", "--zero", "1", "--dp",
                 rng.choice(["1000000", str(10**19)])]
        label.append("huge dp")
    if rng.random() < 0.3:
        args.append("--json")
    return args, refuse, " ".join(label)


def _numeric(values: list) -> bool:
    """Whether an option's good values are numbers (so boundary values are worth a try)."""
    try:
        return all(v is not None and float(v) == float(v) for v in values)
    except ValueError:
        return False


def _draw_hostile(rng: random.Random, files: dict[str, tuple[str, str, bool]]):
    """A command reading a hostile file: --config, --deepspeed-config, --hf-config or --recipe
    given a hostile or special file."""
    kind = rng.choice(["cfg", "hds", "special"])
    keys = [k for k in files if k.startswith(kind + ":")]
    path, label, invalid = files[rng.choice(keys)]
    if kind == "hds":
        args = ["memory", "--preset", "debug", "--deepspeed-config", path]
    elif kind == "cfg":
        # a bad [training] or [parallel] table: only the commands that read it must refuse
        training = any(t in label for t in TRAINING_TABLE_CONFIGS)
        args = ["memory" if training else rng.choice(
            ["params", "flops", "memory", "time", "infer", "serve"]), "--config", path]
    else:
        option = rng.choice(["--config", "--hf-config", "--recipe", "--deepspeed-config"])
        command = "memory" if option in ("--recipe", "--deepspeed-config") else rng.choice(
            ["params", "memory", "serve"])
        args = [command] + (["--preset", "debug"] if option == "--deepspeed-config" else []) + [
            option, path]
        if option == "--config" and label in ("special empty", "special /dev/null"):
            invalid = False  # an empty config file sets nothing
    if rng.random() < 0.3:
        args.append("--json")
    return args, invalid, label


def _not_json(text: str):
    raise ValueError(f"{text} is not JSON")


# every option some command has (an error must name one of them)
_OPTIONS = {o for c in cli.commands.values() for p in c.params
            for o in (*p.opts, *p.secondary_opts) if o.startswith("--")}


# a number that is not finite, as Python prints it
_NONFINITE = re.compile(r"(?<![\w./-])-?(inf|nan)(?![\w/-])", re.IGNORECASE)
# seconds a call may take
SLOW_CALL = 10.0
# the longest error line
MAX_ERROR_LINE = 200


def classify(result, refuse: bool, args: list[str], seconds: float = 0.0) -> str | None:
    """The defect class of one result, or None when it behaved."""
    out = result.output
    if seconds > SLOW_CALL:
        return f"over {SLOW_CALL:g} s"
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        return f"traceback: {type(result.exception).__name__}"
    if "Traceback" in out:
        return "traceback in output"
    if result.exit_code == 1 and "internal error" in result.stderr:
        return "internal error: " + result.stderr.split("(", 1)[-1].split(":", 1)[0]
    if result.exit_code not in (0, 2):
        return f"exit {result.exit_code}"
    if result.exit_code == 2:
        if result.stdout or not result.stderr.startswith("Error: ") or (
                result.stderr.count("\n") != 1):
            return "refusal not one line"
        if len(result.stderr.rstrip("\n")) > MAX_ERROR_LINE:
            return f"refusal over {MAX_ERROR_LINE} characters"
        named = result.stderr[len("Error: "):].split(":")[0].split(" ")[0]
        if named.startswith("--") and named not in _OPTIONS:
            return f"error names no option ({named})"
        return None
    if refuse:
        return "invalid accepted (exit 0)"
    if "--json" in args:
        try:
            json.loads(result.stdout, parse_constant=_not_json)
        except ValueError:
            return "invalid JSON"
    if "--json" not in args and _NONFINITE.search(result.stdout):
        return "non-finite figure printed"
    return None


def fuzz(calls: int, seed: int = 0, configs: int = 600):
    """`calls` drawn calls: (per-command counters, defect classes by command and class:
    (count, the first call's arguments, its message), seconds)."""
    rng = random.Random(seed)
    tmp = Path(tempfile.mkdtemp(prefix="gptcalc-fuzz-"))
    files: dict[str, tuple[str, str, bool]] = {}
    base = seeds()
    for i in range(configs):
        cfg, kind, invalid = mutate(rng, rng.choice(base))
        p = tmp / f"c{i}.json"
        p.write_text(json.dumps(cfg))
        files[str(p)] = (str(p), kind, invalid)
    files.update(write_ds_configs(tmp))
    files.update(write_hostile_files(tmp))
    # Hub ids are read offline: the fuzz tests gptcalc's refusals, not the network's retries
    runner = CliRunner(env={"HF_HUB_OFFLINE": "1"})
    per_command: dict[str, Counter] = defaultdict(Counter)
    classes: dict[str, tuple[int, list[str], str]] = {}
    t0 = time.time()
    for _ in range(calls):
        args, refuse, label = draw_call(rng, files)
        start = time.perf_counter()
        result = runner.invoke(cli, args)
        seconds = time.perf_counter() - start
        c = per_command[args[0]]
        c["calls"] += 1
        c[f"exit {result.exit_code}"] += 1
        defect = classify(result, refuse, args, seconds)
        if defect:
            c["defects"] += 1
            where = f"{args[0]}: {defect} [{label}]"
            n, first, msg = classes.get(where, (0, args, ""))
            if not msg:
                ex = result.exception
                msg = (repr(ex)[:160] if ex is not None and not isinstance(ex, SystemExit)
                       else (result.stderr or result.stdout)[:160])
                if "config:" in label:
                    src = args[args.index("--hf-config") + 1]
                    try:
                        msg += " | " + Path(src).read_text()[:300]
                    except (OSError, ValueError):
                        pass
            classes[where] = (n + 1, first, msg)
    return per_command, classes, time.time() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--configs", type=int, default=600, help="mutated config.json files")
    opts = ap.parse_args()
    per_command, classes, dt = fuzz(opts.calls, opts.seed, opts.configs)
    total = sum(c["calls"] for c in per_command.values())
    print(f"{total} calls in {dt:.0f} s ({1000 * dt / max(total, 1):.1f} ms per call), "
          f"seed {opts.seed}")
    print(f"{'command':8} {'calls':>6} {'exit 0':>7} {'exit 2':>7} {'other':>6} {'defects':>8}")
    for cmd in COMMANDS:
        c = per_command[cmd]
        other = c["calls"] - c["exit 0"] - c["exit 2"]
        print(f"{cmd:8} {c['calls']:6} {c['exit 0']:7} {c['exit 2']:7} {other:6} "
              f"{c['defects']:8}")
    kinds = Counter()
    for where, (n, _first, _msg) in classes.items():
        kinds[where.split(": ", 1)[1].split(" [")[0].split(":")[0]] += n
    print("defects by class: " + (", ".join(f"{k} {n}" for k, n in kinds.most_common())
                                  or "none"))
    print(f"defect classes: {len(classes)}")
    for where, (n, first, msg) in sorted(classes.items(), key=lambda x: -x[1][0]):
        print(f"- {n:5} x {where}\n    gptcalc {' '.join(first)}\n    {msg!r}")
    return 1 if classes else 0


if __name__ == "__main__":
    sys.exit(main())
