"""One KV-cache rule for every inference figure: `serve`'s pool, `infer`'s roofline and
`memory`'s KV line count the same bytes per token, with vLLM's sharding of key/value heads
(max(1, n_kv_head // tp) per GPU: vllm/config/model.py, `ModelConfig.get_num_kv_heads`)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from hypothesis import given, settings, strategies as st

from gptcalc import Workload, from_name
from gptcalc.cli import cli
from gptcalc.gpus import gpu
from gptcalc.inference import kv_cache_bytes, kv_heads_per_device, kv_pool, serving
from gptcalc.memory import TrainingSetup, memory_report
from gptcalc.memory import kv_cache_bytes as memory_kv_cache_bytes

from .test_architecture import graph

LLAMA3 = from_name("llama3-8b")  # 32 heads, 8 key/value heads of 128, 32 layers
H100 = gpu("h100-sxm")


def per_token(cfg, tp: int) -> dict[str, int]:
    """KV bytes per token over every layer on one of tp GPUs, bf16, as each command counts."""
    pool = kv_pool(cfg, 80 * 2**30, "vllm", tp)
    prompt, gen = 3, 2
    s = serving(cfg, H100, 1, prompt, gen, tp)
    assert s.kv_cache_bytes % (prompt + gen) == 0
    out = {"serve": pool.bytes_per_block // pool.block_size,
           "infer": s.kv_cache_bytes // (prompt + gen),
           "memory": memory_kv_cache_bytes(cfg, 1, 1, 2, tp=tp)}
    if cfg.kv_heads % tp == 0:  # a training layout: tp must divide the key/value heads
        wl = Workload(1, 4)
        rep = memory_report(cfg, wl, TrainingSetup(mode="bf16", tp=tp, attn_impl="sdpa"))
        out["memory report"] = rep.kv_cache // wl.seq_len
    return out


@settings(max_examples=25, deadline=None)
@given(kv=st.sampled_from([1, 2, 4, 8]), group=st.sampled_from([2, 4]),
       hd=st.sampled_from([64, 128]), L=st.integers(1, 8), which=st.integers(0, 3))
def test_serve_infer_and_memory_count_the_same_kv_bytes_per_token(kv, group, hd, L, which):
    tp = (1, 2, kv, 2 * kv)[which]
    cfg = LLAMA3.replace(n_layer=L, n_head=kv * group, n_kv_head=kv, head_dim=hd,
                         n_embd=kv * group * hd, d_ff=4 * hd, vocab_size=256)
    # each GPU K and V of max(1, kv // tp) heads of hd, 2 bytes, in every layer
    expected = L * 2 * max(1, kv // tp) * hd * 2
    assert set(per_token(cfg, tp).values()) == {expected}


def test_fewer_kv_heads_than_gpus_replicates_one_head():
    # Llama-3-8B at tp 16: each GPU caches one of the 8 heads (vLLM replicates it twice), so
    # 2 x 1 x 128 x 32 layers x 2 bytes = 16,384 bytes per token, not 8,192 (the divided 8/16)
    assert kv_heads_per_device(LLAMA3, 16) == 1
    assert set(per_token(LLAMA3, 16).values()) == {16_384}
    assert set(per_token(LLAMA3, 8).values()) == {16_384}  # tp = n_kv: both rules agree
    assert set(per_token(LLAMA3, 2).values()) == {65_536}


def test_infer_and_serve_run_where_gpus_outnumber_the_kv_heads():
    r = CliRunner().invoke(cli, ["infer", "--preset", "llama3-8b", "--tp", "16",
                                 "--prompt-len", "100", "--gen-len", "28", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["kv_cache_bytes"] == 128 * 16_384
    r = CliRunner().invoke(cli, ["serve", "--preset", "llama3-8b", "--tp", "16", "--json"])
    assert r.exit_code == 0, r.output
    out = json.loads(r.stdout)
    assert out["block_size"] == 16 and "decode_seconds_per_token" in out  # throughput too


def test_tp_must_divide_kv_heads_it_does_not_exceed():
    from gptcalc.errors import ConfigError
    cfg = LLAMA3.replace(n_head=24, n_kv_head=12, n_embd=3072)
    with pytest.raises(ConfigError):
        kv_cache_bytes(cfg, 1, 1, 2, tp=8)  # 12 heads over 8 GPUs: no even split


def test_the_inference_package_never_imports_memory():
    g = graph()
    seen, todo = set(), [m for m in g if m == "inference" or m.startswith("inference.")]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(g[m])
    assert not [m for m in seen if m == "memory" or m.startswith("memory.")]
