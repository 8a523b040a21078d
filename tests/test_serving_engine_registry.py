"""The serving-engine registry: a serving engine is one module registering a `Server`, and the
pool (`kv_pool`), `KVPool` and `gptcalc serve` name none. A toy engine registered from this
file alone gets a `serve` answer; toys declaring what vLLM and SGLang declare, under other
names, answer as they do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from gptcalc.cli import cli
from gptcalc.errors import ConfigError
from gptcalc.inference.kv import kv_bytes_per_token_layer
from gptcalc.inference.pool import DEFAULT_NON_TORCH, kv_pool
from gptcalc.inference.servers import Server, names, register, release, unregister
from gptcalc.inference.sglang import SGLang
from gptcalc.inference.vllm import VLLM
from gptcalc.inference.weights import device_weight_bytes
from gptcalc.presets import from_name

GiB = 2**30
QWEN3_NEXT_80B = Path(__file__).parent / "hybrid" / "qwen3-next-80b-a3b-instruct.json"


class Toy(Server):
    """A toy: 80% of the GPU's memory, pages of 32 tokens, no profile run, fixed scheduler
    defaults; every layout, but no LoRA and no hybrid model (the interface's defaults)."""

    name = "toy-server"
    title = "Toy"
    default_version = "1.2"
    default_fraction = 0.8
    default_block_size = 32
    batch_defaults = (1024, 64)

    def check_layout(self, cfg, pp, dp, cpu_offload) -> None:
        pass


class VLLMAgain(VLLM):
    name = "toy-vllm"


class SGLangAgain(SGLang):
    name = "toy-sglang"


TOYS = (Toy(), VLLMAgain(), SGLangAgain())


@pytest.fixture
def toys():
    for toy in TOYS:
        register(toy)
    yield
    for toy in TOYS:
        unregister(toy.name)


def serve(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(cli, ["serve", *args])
    return result.exit_code, result.output


def test_a_toy_is_an_engine_once_registered(toys):
    assert {"toy-server", "toy-vllm", "toy-sglang"} <= set(names())
    assert names()[:2] == ("vllm", "sglang")  # the default first, then as registered
    assert release("toy-server").label == "toy-server 1.2"  # one generation: not named
    unregister("toy-server")
    with pytest.raises(ConfigError) as e:
        kv_pool(from_name("llama3-8b"), 80 * GiB, engine="toy-server")
    assert e.value.field == "engine"
    code, out = serve("--preset", "llama3-8b", "--engine", "toy-server")
    assert code == 2 and "--engine" in out and "toy-server" in out
    register(Toy())


def test_a_name_twice_raises(toys):
    with pytest.raises(ValueError):
        register(Toy())


def test_serve_answers_with_the_toy(toys):
    cfg = from_name("llama3-8b")
    total = 80 * GiB
    code, out = serve("--preset", "llama3-8b", "--engine", "toy-server", "--gpu-memory", "80GiB",
                      "--json")
    assert code == 0, out
    got = json.loads(out)
    # the toy's own figures, by hand: 80% of 80 GiB less the bf16 weights and vLLM's logged
    # non-torch memory on one GPU; pages of 32 tokens over the 32 layers
    weights = device_weight_bytes(cfg, "bf16", 1)
    pool = int(total * 0.8) - weights - DEFAULT_NON_TORCH
    block = 32 * cfg.n_layer * kv_bytes_per_token_layer(cfg, 1, "bf16")
    assert got["engine"] == "toy-server" and got["engine_version"] == "1.2"
    assert got["utilization"] == 0.8 and got["block_size"] == 32
    assert (got["max_num_batched_tokens"], got["max_num_seqs"]) == (1024, 64)
    assert got["activation_peak"] == 0 and got["custom_all_reduce"] == 0
    assert got["kv_cache"] == pool and got["kv_blocks"] == pool // block
    assert got["assumptions"].startswith("Assuming toy-server 1.2 (default) on 1 x 80.00 GiB")
    assert "mem_fraction_static 0.8 (default)" in got["assumptions"]
    assert "no profile run" in got["assumptions"]
    code, text = serve("--preset", "llama3-8b", "--engine", "toy-server", "--gpu-memory",
                       "80GiB")
    assert code == 0 and text.startswith("Fits: ")


@pytest.mark.parametrize("args", [
    (),
    ("--enable-lora",),
    ("--sampler", "flashinfer"),
    ("--tp", "2", "--detail"),
    ("--max-model-len", "2048", "--context", "1024"),
    ("--engine-version", "0.7.3"),
    ("--engine-version", "0.9.1", "--gpu", "a100-40gb"),
    ("--gpu", "h100-sxm", "--cpu-offload-gb", "4", "--engine-version", "0.6.0"),
    ("--gpu", "h100-sxm", "--pp", "2"),
    ("--gpu", "a100-40gb", "--mem-fraction-static", "0.7"),
    ("--pp", "2",),  # refused under SGLang
    ("--gpu-memory", "1GiB",),  # SGLang's reserve leaves nothing
])
# a dense model, one with sliding-window layers (vLLM admits a chunk beyond the window), an
# MoE with MLA, and a hybrid (Gated DeltaNet beside attention)
@pytest.mark.parametrize("model", [("--preset", "llama3-8b"), ("--preset", "gemma-3-1b"),
                                   ("--preset", "deepseek-v2-lite"),
                                   ("--hf-config", str(QWEN3_NEXT_80B))])
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_toy_declaring_an_engine_answers_as_it(toys, engine, model, args):
    def answer(name: str) -> tuple[int, str]:
        code, out = serve(*model, "--engine", name, "--json", *args)
        return code, out.replace(f"{name} ", "ENGINE ").replace(f'"{name}"', '"ENGINE"')
    assert answer(f"toy-{engine}") == answer(engine)


@pytest.mark.parametrize("kwargs", [{"lora": (1, 8)}, {"pp": 2}, {"engine_version": "x"},
                                    {"utilization": 1.5}, {"cpu_offload": 2**30}])
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_toy_declaring_an_engine_refuses_as_it(toys, engine, kwargs):
    cfg = from_name("llama3-8b")

    def refusal(name):
        try:
            kv_pool(cfg, 80 * GiB, engine=name, **kwargs)
        except ConfigError as e:
            return e.field, str(e).replace(name, "ENGINE")
        return None
    assert refusal(f"toy-{engine}") == refusal(engine)


def test_a_toy_has_no_cuda_graphs_and_sizes_each_stage_by_itself(toys):
    # the interface's defaults: no graphs modelled (a log's estimate refused), every pipeline
    # stage's pool from its own weights, data-parallel replicas in one world
    code, out = serve("--preset", "llama3-8b", "--engine", "toy-server", "--json")
    got = json.loads(out)
    assert code == 0 and got["cuda_graphs"] is None and got["cuda_graph_sizes"] == []
    assert got["cuda_graphs_charged"] == 0
    code, out = serve("--preset", "llama3-8b", "--engine", "toy-server",
                      "--cuda-graph-memory", "1GiB")
    assert code == 2 and "--cuda-graph-memory" in out and "Toy" in out
    cfg = from_name("llama3-8b")
    staged = kv_pool(cfg, 80 * GiB, engine="toy-server", pp=2)
    assert staged.peer_weights == 0
    assert [s["kv_cache"] for s in staged.stages] == [
        int(80 * GiB * 0.8) - s["weights"] - DEFAULT_NON_TORCH for s in staged.stages]
