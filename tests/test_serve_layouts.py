"""`serve`'s layouts across GPUs (pipeline stages, data-parallel replicas, expert parallelism),
CPU offload and the release boundaries of the engine's accounting, each against the engine's
own rule or a model transformers builds."""

from __future__ import annotations

import math

import pytest
from click.testing import CliRunner
from hypothesis import given, settings, strategies as st

from gptcalc import from_name
from gptcalc.cli import cli
from gptcalc.hf import config_from_hf
from gptcalc.inference.pool import cpu_offload_bytes, kv_pool
from gptcalc.inference.vllm import CUDA_CONTEXT, early_v1_accounting
from gptcalc.inference.servers import release
from gptcalc.inference.weights import (device_weight_bytes, pp_partition, stage_weight_bytes,
                                       stage_weight_parts)
from tests.test_serve import run, serve_json

GiB = 2**30
H100 = int(79.22 * GiB)




# vLLM's own test of its partition (tests/distributed/test_pipeline_partition.py,
# `test_uneven_auto_partition`, vllm-project/vllm; SGLang's test_pp_single_node.py holds the
# same table): (layers, pp, rank) -> [start, end)
VLLM_PARTITIONS = [
    (2, 2, 0, (0, 1)), (2, 2, 1, (1, 2)), (3, 2, 0, (0, 2)), (3, 2, 1, (2, 3)),
    (3, 3, 0, (0, 1)), (3, 3, 1, (1, 2)), (3, 3, 2, (2, 3)), (4, 3, 0, (0, 1)),
    (4, 3, 1, (1, 3)), (4, 3, 2, (3, 4)), (5, 3, 0, (0, 2)), (5, 3, 1, (2, 4)),
    (5, 3, 2, (4, 5)),
]


@pytest.mark.parametrize("layers, pp, rank, indices", VLLM_PARTITIONS)
def test_pipeline_partition_is_vllms(layers, pp, rank, indices):
    parts = pp_partition(layers, pp)
    start = sum(parts[:rank])
    assert (start, start + parts[rank]) == indices


def test_more_stages_than_layers_names_the_option():
    r = run("serve", "--preset", "gpt2", "--pp", "13")
    assert r.exit_code == 2 and r.stdout == "" and "--pp" in r.stderr, r.output


# --- stage weights against the modules transformers builds, placed as vLLM places them ----

LLAMA = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688,
         "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 1000,
         "max_position_embeddings": 512, "tie_word_embeddings": False}
QWEN2_TIED = {"model_type": "qwen2", "hidden_size": 128, "intermediate_size": 352,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 777,
              "max_position_embeddings": 512, "tie_word_embeddings": True}
QWEN3_MOE = {"model_type": "qwen3_moe", "hidden_size": 128, "intermediate_size": 384,
             "moe_intermediate_size": 64, "num_experts": 10, "num_experts_per_tok": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
             "vocab_size": 500, "max_position_embeddings": 512, "decoder_sparse_step": 1,
             "mlp_only_layers": [], "norm_topk_prob": True, "tie_word_embeddings": False}


def _meta_model(hf: dict):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(**hf)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def _numel(module) -> int:
    return sum(p.numel() for p in module.parameters())


FAMILIES = {"llama": LLAMA, "qwen2": QWEN2_TIED,
            # MoE every second block and block 0 dense: the stages' blocks differ in kind
            "qwen3_moe": {**QWEN3_MOE, "decoder_sparse_step": 2, "mlp_only_layers": [1]}}


@settings(max_examples=15, deadline=None)
@given(family=st.sampled_from(sorted(FAMILIES)), layers=st.integers(2, 9),
       pp=st.integers(2, 4))
def test_stage_weights_are_the_modules_of_the_stage(family, layers, pp):
    # each stage holds its decoder layers; the first the embedding; the last the final norm and
    # the lm_head, and with tied embeddings its own embedding to tie it to (vLLM's llama.py);
    # bf16, tp 1: 2 bytes a parameter
    hf = {**FAMILIES[family], "num_hidden_layers": layers}
    if pp > layers:
        return
    model, cfg = _meta_model(hf), config_from_hf(hf)
    m = model.model
    parts = pp_partition(layers, pp)
    for rank, n in enumerate(parts):
        start = sum(parts[:rank])
        first, last = rank == 0, rank == pp - 1
        held = sum(_numel(layer) for layer in m.layers[start:start + n])
        if first or (last and hf["tie_word_embeddings"]):
            held += _numel(m.embed_tokens)
        if last:
            held += _numel(m.norm) + (0 if hf["tie_word_embeddings"] else _numel(model.lm_head))
        assert stage_weight_bytes(cfg, "bf16", 1, (start, start + n), pp) == 2 * held


@pytest.mark.parametrize("gpus", [1, 2, 3, 4, 10])
def test_expert_parallel_puts_whole_experts_on_each_rank(gpus):
    # vLLM's determine_expert_map: n // ep_size experts a rank, the first n % ep_size ranks one
    # more; everything but the experts whole at tp 1 (dp replicas): the heaviest rank
    hf = {**QWEN3_MOE, "num_hidden_layers": 3}
    model, cfg = _meta_model(hf), config_from_hf(hf)
    experts = sum(_numel(layer.mlp.experts) for layer in model.model.layers)
    rest = _numel(model) - experts
    per_rank = math.ceil(10 / gpus)
    assert stage_weight_bytes(cfg, "bf16", 1, dp=gpus, expert_parallel=True) == \
        2 * (rest + experts * per_rank // 10)
    # without expert parallelism every expert is cut across the tp x dp GPUs
    if 384 % gpus == 0 and 64 % gpus == 0:
        assert stage_weight_bytes(cfg, "bf16", 1, dp=gpus) == 2 * (rest + experts // gpus)


def test_one_gpu_layout_is_the_pinned_weight_figure():
    # the new placement gives what device_weight_bytes gives where both apply (no position
    # table or row-parallel biases, whose placement the older figure splits)
    for name in ("llama3-8b", "qwen3-30b-a3b", "mixtral-8x7b"):
        cfg = from_name(name)
        for tp in (1, 2, 4, 8):
            assert stage_weight_bytes(cfg, "bf16", tp) == device_weight_bytes(cfg, "bf16", tp)


def test_pipeline_stages_hold_their_layers_kv_and_take_the_fewest_blocks():
    cfg = from_name("llama3-8b")
    one = kv_pool(cfg, H100, gpu_name="h100-sxm", non_torch=GiB // 5)
    two = kv_pool(cfg, H100, gpu_name="h100-sxm", non_torch=GiB // 5, pp=2)
    assert len(two.stages) == 2 and [s["layers"] for s in two.stages] == [16, 16]
    # a block holds half the layers, so twice the tokens fit in about the same bytes
    assert two.bytes_per_block * 2 == one.bytes_per_block
    assert two.kv_blocks == min(s["kv_blocks"] for s in two.stages)
    assert two.kv_tokens > 2 * one.kv_tokens
    # only the last stage runs the sampler
    first, last = two.stages
    assert first["activation_peak"] < last["activation_peak"]
    # the stage with the fewest blocks is the one reported
    assert two.layers == ((0, 16) if first["kv_blocks"] <= last["kv_blocks"] else (16, 32))


def test_qwen3_235b_fp8_on_8_l40s_at_tp4_with_expert_parallel():
    # 128 experts over tp 4 x dp 2 = 8 GPUs: 16 whole experts a GPU, attention and the
    # embeddings tensor-parallel over 4 within each replica
    path = "tests/quantized/qwen3-235b-a22b-fp8.json"
    ep = serve_json("--hf-config", path, "--tp", "4", "--dp", "2", "--enable-expert-parallel",
                    "--gpu", "l40s")
    cut = serve_json("--hf-config", path, "--tp", "4", "--dp", "2", "--gpu", "l40s")
    tp4 = serve_json("--hf-config", path, "--tp", "4", "--gpu", "l40s")
    # the experts are 98% of the weights: spread over 8 GPUs, not 4
    assert ep["weights"] < 0.55 * tp4["weights"]
    # whole experts (16 of 128) or each cut 8 ways: the same bytes up to the scales' rounding
    assert abs(ep["weights"] - cut["weights"]) < 2**20
    assert ep["fits"] and not tp4["fits"]
    assert "at most 16 of 128 a GPU" in ep["assumptions"]


# --- CPU offload ------------------------------------------------------------------------------

def test_cpu_offload_gb_is_gib():
    assert cpu_offload_bytes(4) == 4 * 2**30 and cpu_offload_bytes(0.5) == 2**29


@pytest.mark.parametrize("gib", [0, 1, 5])
def test_cpu_offload_moves_that_many_weight_bytes_off_each_gpu(gib):
    a = serve_json("--preset", "llama3-8b", "--tp", "2")
    b = serve_json("--preset", "llama3-8b", "--tp", "2", "--cpu-offload-gb", str(gib))
    assert a["weights"] - b["weights"] == b["cpu_offload"] == gib * 2**30
    assert b["host_memory"] == 2 * gib * 2**30  # pinned, on each GPU's behalf
    assert b["kv_cache"] - a["kv_cache"] == gib * 2**30


def test_cpu_offload_stops_at_the_decoder_layers():
    # the embedding and the head are never offloaded: a figure beyond the layers moves them all
    cfg = from_name("llama3-8b")
    layers = stage_weight_parts(cfg, "bf16", 1)["blocks"]
    over = serve_json("--preset", "llama3-8b", "--cpu-offload-gb", "100")
    assert over["cpu_offload"] == layers
    under = serve_json("--preset", "llama3-8b", "--cpu-offload-gb", str((layers - 1) / 2**30))
    assert under["cpu_offload"] == layers - 1


@pytest.mark.parametrize("version, streamed", [("0.7.3", True), ("0.8.0", False)])
def test_v0_copies_an_offloaded_layer_in_for_its_forward(version, streamed):
    # V0: functional_call on the layer's state moved to the device; V1 reads it over UVA
    out = serve_json("--preset", "llama3-8b", "--cpu-offload-gb", "4", "--engine-version",
                     version, "--max-num-batched-tokens", "32768", "--max-num-seqs", "1")
    assert ("offloaded layer's weights" in out["activation"]) is streamed
    if streamed:  # 4 GiB offloaded from the first layer on: the first layers whole, and the
        # forward of each copies that layer's weights in (Llama's 32 layers are alike)
        layer = math.ceil(stage_weight_parts(from_name("llama3-8b"), "bf16", 1)["blocks"] / 32)
        assert out["activation"]["offloaded layer's weights"] == layer
        small = serve_json("--preset", "llama3-8b", "--cpu-offload-gb", "0.25",
                           "--engine-version", version, "--max-num-batched-tokens", "32768",
                           "--max-num-seqs", "1")
        assert small["activation"]["offloaded layer's weights"] == 2**28  # less than a layer


def test_cpu_offload_prints_the_host_memory():
    r = run("serve", "--preset", "llama3-8b", "--tp", "2", "--cpu-offload-gb", "2")
    assert "Host memory: 2.00 GiB of weights per GPU, 4.00 GiB pinned for the 2 GPUs." in r.stdout


@pytest.mark.parametrize("args, option", [
    (["--cpu-offload-gb", "-1"], "--cpu-offload-gb"),
    (["--cpu-offload-gb", "nan"], "--cpu-offload-gb"),
    (["--dp", "0"], "--dp"),
    (["--pp", "0"], "--pp"),
    (["--enable-expert-parallel"], "--enable-expert-parallel"),
    (["--engine", "sglang", "--dp", "2", "--enable-dp-attention"], "--enable-dp-attention"),
])
def test_bad_layout_options_are_one_line_naming_the_option(args, option):
    r = run("serve", "--preset", "llama3-8b", *args)
    assert r.exit_code == 2 and r.stdout == "" and r.stderr.count("\n") == 1, r.output
    assert option in r.stderr, r.stderr


# --- release boundaries ----------------------------------------------------------------------

@pytest.mark.parametrize("version, counted", [
    ("0.7.3", False),  # V0: memory_profiling from start-up (vllm-project/vllm pull 10511)
    ("0.8.0", True),   # the first V1 default: device-wide in-use memory as non-torch
    ("0.9.1", True),
    ("0.9.2", False),  # pull 19312: V1 uses memory_profiling
])
def test_early_v1_charges_the_cuda_context(version, counted):
    assert early_v1_accounting(release("vllm", version)) is counted
    out = serve_json("--preset", "llama3-8b", "--engine-version", version)
    assert out["device_context"] == (CUDA_CONTEXT if counted else 0)
    assert ("counts everything in use on the device" in out["assumptions"]) is counted


def test_the_cuda_context_comes_out_of_the_pool():
    cfg = from_name("llama3-8b")
    args = dict(gpu_name="h100-sxm", non_torch=GiB // 5, max_num_batched_tokens=8192,
                max_num_seqs=256)
    early = kv_pool(cfg, H100, engine_version="0.9.1", **args)
    later = kv_pool(cfg, H100, engine_version="0.9.2", **args)
    assert later.kv_cache - early.kv_cache == CUDA_CONTEXT


@pytest.mark.parametrize("version, words", [
    ("0.18.1", "CUDA graphs not counted: this release captures them after sizing the pool"),
    ("0.19.1", "CUDA graphs 860.00 MiB (51 sizes, a Llama-3.1-8B log's figures) captured after "
               "the pool, in the 7.92 GiB left"),
    ("0.20.0", "CUDA graphs from the pool (51 sizes, a Llama-3.1-8B log's figures)"),
])
def test_cuda_graphs_are_named_on_either_side_of_0_20(version, words):
    out = serve_json("--preset", "llama3-8b", "--engine-version", version)
    assert words in out["assumptions"]


# --- one screen ------------------------------------------------------------------------------

COLUMNS = 80
SCREEN = 25  # lines of one terminal screen


def _screen_lines(text: str) -> int:
    return sum(max(1, math.ceil(len(line) / COLUMNS)) for line in text.splitlines())


@pytest.mark.parametrize("args", [
    ["--preset", "llama3-8b"], ["--preset", "llama3-8b", "--gpu", "l4"],
    ["--preset", "qwen3-30b-a3b", "--gpu", "a100-sxm-80gb"],
    ["--preset", "llama3-70b", "--tp", "4", "--gpu", "h100-sxm"],
    ["--preset", "deepseek-v2-lite", "--gpu", "h100-sxm"],
    ["--hf-config", "tests/quantized/qwen3-235b-a22b-fp8.json", "--gpu", "l40s", "--tp", "4",
     "--dp", "2", "--enable-expert-parallel"]])
def test_the_verdict_comes_first_on_one_screen(args):
    r = CliRunner().invoke(cli, ["serve", *args], env={"COLUMNS": str(COLUMNS)})
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0].startswith("Fits: ") and lines[1].startswith("Assuming ")
    assert _screen_lines(r.stdout) <= SCREEN, r.stdout
    detail = CliRunner().invoke(cli, ["serve", *args, "--detail"], env={"COLUMNS": "80"})
    assert "activation peak: logits" in detail.stdout and "roofline" in detail.stdout
    assert "activation peak: logits" not in r.stdout
    assert _screen_lines(detail.stdout) > _screen_lines(r.stdout)


def test_the_verdict_says_when_it_does_not_fit():
    r = CliRunner().invoke(cli, ["serve", "--preset", "llama3-70b", "--gpu", "h100-sxm"],
                           env={"COLUMNS": str(COLUMNS)})
    assert r.stdout.startswith("Does NOT fit: the engine refuses to start on h100-sxm")
    assert "It fits with any one of: --tp 4" in " ".join(r.stdout.split())  # lines wrap at 80
    assert _screen_lines(r.stdout) <= SCREEN


# --- the sampler's backend --------------------------------------------------------------------

def test_flashinfer_holds_a_plus_12_bytes_a_logit_and_no_sm_buffer():
    # top_k_top_p_sampling_from_logits, filter order top_k_first: the float32 logits, the
    # top-k-masked logits and their softmax beside the head's bf16 output
    from gptcalc.inference.sampler import flashinfer_sampler_bytes, sort_free_sampler_bytes

    n, v = 1024, 128256
    fi = flashinfer_sampler_bytes(n, v)
    assert sum(fi.values()) == (2 + 12) * n * v + 36 * n
    triton = sort_free_sampler_bytes(n, v, 2, 132)
    assert sum(triton.values()) - sum(fi.values()) == 132 * v * 4  # the Triton kernel's rows
    assert sum(flashinfer_sampler_bytes(n, v, 4).values()) == 12 * n * v + 36 * n


@pytest.mark.parametrize("version, default", [("0.16.0", "sort"), ("0.17.0", "triton"),
                                              ("0.7.3", "sort")])
def test_the_default_sampler_by_release_on_both_sides_of_0_17(version, default):
    out = serve_json("--preset", "llama3-8b", "--engine-version", version)
    assert out["sampler"] == default
    assert ("sampler/sort temporaries" in out["activation"]) is (default == "sort")
    assert ("sampler/top-k top-p buffer" in out["activation"]) is (default == "triton")
    assert "(default)" in out["assumptions"].split("; sampler ")[1]


@pytest.mark.parametrize("version", ["0.16.0", "0.33.0"])
def test_flashinfer_is_taken_when_asked_for(version):
    fi = serve_json("--preset", "llama3-8b", "--engine-version", version, "--sampler",
                    "flashinfer")
    default = serve_json("--preset", "llama3-8b", "--engine-version", version)
    assert fi["sampler"] == "flashinfer" and "sampler/masked logits" in fi["activation"]
    assert fi["activation_peak"] < default["activation_peak"]
    assert fi["kv_cache"] > default["kv_cache"]


def test_the_triton_sampler_before_0_17_names_the_option():
    r = run("serve", "--preset", "llama3-8b", "--engine-version", "0.16.0", "--sampler", "triton")
    assert r.exit_code == 2 and r.stdout == "" and "--sampler" in r.stderr, r.output
    r = run("serve", "--preset", "llama3-8b", "--engine-version", "0.17.0", "--sampler", "triton")
    assert r.exit_code == 0, r.output


@pytest.mark.parametrize("version, seqs", [("0.8.0", 1024), ("0.8.3", 1024), ("0.8.4", 256),
                                           ("0.7.3", 256)])
def test_early_v1_profiles_1024_sequences_on_every_gpu(version, seqs):
    # vllm-project/vllm pull 16158 (after 0.8.3) reverted V1's max_num_seqs to V0's 256 on
    # cards below H100 class; on an H100 it stays 1,024 either side
    assert serve_json("--preset", "llama3-8b", "--gpu", "l40s", "--engine-version",
                      version)["max_num_seqs"] == seqs
    assert serve_json("--preset", "llama3-8b", "--gpu", "h100-sxm", "--engine-version",
                      version)["max_num_seqs"] == (256 if version == "0.7.3" else 1024)


@pytest.mark.parametrize("version, kept", [("0.18.0", False), ("0.19.0", True)])
def test_the_moe_workspace_is_kept_from_0_19(version, kept):
    # from 0.19.0 the modular fused MoE's workspace stays allocated beside the sampler pass
    out = serve_json("--preset", "qwen3-30b-a3b", "--engine-version", version)
    assert ("moe workspace" in out["activation"]) is kept


@pytest.mark.parametrize("version, engine", [("0.7.3", "V0"), ("0.8.0", "V1")])
def test_the_v1_engine_from_0_8(version, engine):
    assert serve_json("--preset", "llama3-8b", "--engine-version",
                      version)["engine_generation"] == engine


def test_host_memory_sums_every_stage_and_replica():
    # 8 GiB asked of each GPU; gpt2's 12 layers over 2 stages hold far less, so each stage
    # offloads its own layers whole, on each of its tp x dp GPUs
    cfg = from_name("gpt2")
    out = serve_json("--preset", "gpt2", "--pp", "2", "--dp", "3", "--cpu-offload-gb", "8")
    per_stage = [stage_weight_parts(cfg, "bf16", 1, (a, a + 6), 2)["blocks"] for a in (0, 6)]
    assert [s["cpu_offload"] for s in out["stages"]] == per_stage
    assert out["host_memory"] == 3 * sum(per_stage)


@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from(["llama3-8b", "qwen3-30b-a3b", "gpt2", "mixtral-8x7b"]),
       tp=st.sampled_from([1, 2, 4]), pp=st.integers(1, 4), dp=st.integers(1, 4),
       ep=st.booleans(), offload_gib=st.sampled_from([0, 0.5, 3]),
       version=st.sampled_from(["0.7.3", "0.8.2", "0.9.1", "0.33.0"]))
def test_every_layout_spends_the_budget_line_by_line(name, tp, pp, dp, ep, offload_gib, version):
    cfg = from_name(name)
    if cfg.n_head % tp or cfg.kv_heads % tp or (ep and not cfg.moe):
        return
    p = kv_pool(cfg, 2 * H100, tp=tp, pp=pp, dp=dp, expert_parallel=ep, gpu_name="h200",
                cpu_offload=cpu_offload_bytes(offload_gib), engine_version=version)
    held = p.weights + p.activation_peak + p.non_torch + p.device_context + p.charged_graphs
    assert p.budget + p.shortfall == held + p.kv_cache
    assert p.kv_blocks == p.kv_cache // p.bytes_per_block
    if pp > 1:
        assert sum(s["layers"] for s in p.stages) == cfg.n_layer
        assert p.kv_blocks == min(s["kv_blocks"] for s in p.stages)


def test_sglang_expert_parallel_puts_whole_experts_over_the_tp_gpus():
    # --enable-ep-moe: ep_size = tp_size (sglang/srt/server_args.py); 10 experts over 4 GPUs:
    # 3 on the heaviest, as vLLM's rule at dp 1
    hf = {**QWEN3_MOE, "num_hidden_layers": 3}
    model, cfg = _meta_model(hf), config_from_hf(hf)
    experts = sum(_numel(layer.mlp.experts) for layer in model.model.layers)
    ep = kv_pool(cfg, H100, engine="sglang", tp=4, expert_parallel=True)
    cut = kv_pool(cfg, H100, engine="sglang", tp=4)
    assert ep.weights - cut.weights == 2 * (experts * 3 // 10 - experts // 4)  # 3 of 10, 1/4
    one = kv_pool(cfg, H100, engine="sglang", tp=1, expert_parallel=True)
    assert one.weights == 2 * _numel(model)
