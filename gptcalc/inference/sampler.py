"""The sampler pass of vLLM's profile run: the bytes it holds over N sequences x V words.

After the profile forward vLLM samples the last token of each of the N = min(max_num_seqs,
max_num_batched_tokens) dummy sequences with temperature 0.5, top-p 0.9 and top-k V - 1 (V1:
vllm/v1/worker/gpu_model_runner.py, `_dummy_sampler_run`; V0: vllm/worker/model_runner.py,
`profile_run`, top-p 0.99). The sampler (vllm/v1/sample/sampler.py, `Sampler.forward`,
`sample`; vllm/v1/sample/ops/topk_topp_sampler.py, `forward_native` — FlashInfer's sampler is
opt-in — `apply_top_k_top_p`, `random_sample`) holds, per element of the N x V logits:

    logits      a       the head's output, held by the caller throughout
    float32     4       logits.to(float32) (none when the logits are float32 already)
    sorted      4 + 8   logits.sort(): values and int64 indices
    masks       1 + 1   the top-k and top-p boolean masks
    top-p       4       the sorted probabilities (cumsum in place)
    scattered   4       sorted.scatter(): the filtered logits back in vocabulary order

the scatter being the peak of the PyTorch ops: a + 26 bytes (28 for bf16 logits), measured on
CPU (reference_model/serve_sampler.py). On CUDA the sort holds more while it runs, by the
path PyTorch takes for N rows of V (aten/src/ATen/native/cuda/Sort.cu,
`launch_stable_sort_kernel`), so the peak on CUDA is inside the sort:

    128 rows or more   `segmented_sort_pairs`: int64 source indices (8) and cub's alternate
                       key and value buffers (4 + 8; cub/device/dispatch/dispatch_radix_sort.cuh,
                       the "3rd keys buffer" and "3rd values buffer" of a sort that may not
                       overwrite its input): 20, a + 36 in all (38 for bf16)
    2 to 127 rows      `segmented_sort_pairs_by_full_sort`: two arrays of (segment, index)
                       int32 pairs (8 + 8), the sorted keys it discards (4; aten/src/ATen/cuda/
                       cub.cu, `radix_sort_pairs_impl`) and cub's alternate buffers (4 + 8): 32,
                       a + 48 in all (50 for bf16)
    one row, or V of   `segmented_sort_large_segments`: temporaries of one row only; the
    10^6 or more       scatter is the peak

Checked on CUDA against the activation peak vLLM logs for Llama-3-8B on an H100 at 256 rows
(tests/test_serve_sampler.py).

Per request, besides: the sampling parameters (temperature, top-p, top-k as int64, three
penalties) and the greedy token, 36 bytes.

vLLM 0.17.0 and later mask top-k and top-p with a Triton kernel that sorts nothing
(vllm/v1/sample/ops/topk_topp_triton.py, `apply_top_k_top_p_triton`; vllm-project/vllm pull
33538), in place on the float32 logits; then `softmax` and `random_sample` hold

    float32     4       logits.to(float32), masked in place
    probs       4       softmax in float32
    noise       4       the exponential noise q (probs.div_(q) in place, then argmax)
    buffer      min(N, SMs) x V x 4 bytes in all: one float32 row per Triton program, one
                program per streaming multiprocessor at most

a + 12 bytes per logit and the buffer (`sort_free_sampler_bytes`). The activation peaks one
deployment logs for vLLM 0.15.0 to 0.18.0 (Qwen3-14B on an H100, llm-d-incubation/
llm-d-planner, accuracy/results/version-sweep) fall from 5.64 GiB at 0.16.0 to 2.23 GiB at
0.17.0, the release the kernel first shipped in.
"""

from __future__ import annotations

from ..gpus import GPUS

FLOAT32 = 4
SORTED = 4 + 8  # values (float32) and int64 indices
MASKS = 1 + 1  # top-k and top-p boolean masks
# CUDA sort temporaries per element, by path: int64 source indices and cub's alternate float32
# keys and int64 values; two arrays of int32 (segment, index) pairs, the discarded sorted keys
# and cub's alternate keys and pairs
SEGMENTED_TEMPORARIES = 8 + 4 + 8
FULL_SORT_TEMPORARIES = 8 + 8 + 4 + 4 + 8
SEGMENTED_FROM = 128  # PyTorch sorts this many rows or more with cub's segmented sort
LARGE_SEGMENT = 10**6  # PyTorch sorts rows of this many elements or more one by one
# temperature, top-p (float32), top-k (int64), three float32 penalties, the greedy token (int64)
PER_REQUEST = 4 + 4 + 8 + 3 * 4 + 8


TRITON_SAMPLER_SINCE = (0, 17, 0)  # vLLM's first release that masks top-k/top-p without a sort
PROBS = NOISE = 4  # float32 probabilities and exponential noise per logit
# Streaming multiprocessors of the catalogue's GPUs (`gptcalc.gpus`, where each is cited): the
# Triton sampler runs one program per SM at most
SMS = {g.name: g.sms for g in GPUS.values() if g.sms}


def sm_count(gpu_name: str) -> int:
    """The catalogue card's SMs, 0 for a card without the figure or a name not in it."""
    g = GPUS.get(gpu_name)
    return (g.sms or 0) if g is not None else 0


def sort_free_sampler_bytes(seqs: int, vocab_size: int, act_bytes: int = 2, sms: int = 0
                            ) -> dict[str, int]:
    """The sampler's live bytes over `seqs` x `vocab_size` logits of `act_bytes` in vLLM 0.17.0
    and later (the module docstring): a + 12 bytes per logit, and the Triton kernel's buffer of
    min(seqs, sms) rows of float32 logits (none with sms 0, a GPU whose count is not known)."""
    NV, a = seqs * vocab_size, act_bytes
    return {"logits": NV * a, "sampler/float32": 0 if a == FLOAT32 else NV * FLOAT32,
            "sampler/probs": NV * PROBS, "sampler/noise": NV * NOISE,
            "sampler/top-k top-p buffer": min(seqs, sms) * vocab_size * FLOAT32,
            "sampler/requests": seqs * PER_REQUEST}


def sampler_bytes(seqs: int, vocab_size: int, act_bytes: int = 2, cuda: bool = True
                  ) -> dict[str, int]:
    """The sampler's live bytes at its peak over `seqs` x `vocab_size` logits of `act_bytes`,
    by line (see the module docstring): on CUDA the larger of the sort's and the scatter's
    moments, at the scatter on CPU."""
    NV, a = seqs * vocab_size, act_bytes
    held = {"logits": NV * a, "sampler/float32": 0 if a == FLOAT32 else NV * FLOAT32,
            "sampler/sorted": NV * SORTED, "sampler/requests": seqs * PER_REQUEST}
    scatter = {**held, "sampler/masks": NV * MASKS, "sampler/top-p": NV * FLOAT32,
               "sampler/scattered": NV * FLOAT32}
    if not cuda:
        return scatter
    temps = sort_temporaries(seqs, vocab_size)
    sort = {**held, "sampler/sort temporaries": NV * temps}
    return max(sort, scatter, key=lambda moment: sum(moment.values()))


def sort_temporaries(rows: int, columns: int) -> int:
    """Bytes per element PyTorch's CUDA sort holds beyond its outputs while it sorts `rows`
    rows of `columns` float32 values (the module docstring's table)."""
    if rows == 1 or columns >= LARGE_SEGMENT:
        return 0  # sorted row by row: temporaries of one row
    return SEGMENTED_TEMPORARIES if rows >= SEGMENTED_FROM else FULL_SORT_TEMPORARIES


# The sampler backends of vLLM's V1 `TopKTopPSampler` (vllm/v1/sample/ops/topk_topp_sampler.py):
# sort: `apply_top_k_top_p_pytorch` (every release before 0.17.0, and any without Triton);
# triton: `apply_top_k_top_p_triton` (0.17.0 and later); flashinfer: `forward_cuda` ->
# `flashinfer_sample` (FlashInfer installed and VLLM_USE_FLASHINFER_SAMPLER not 0)
SAMPLERS = ("sort", "triton", "flashinfer")
MASKED = 4  # FlashInfer's top-k-masked float32 logits


def flashinfer_sampler_bytes(seqs: int, vocab_size: int, act_bytes: int = 2) -> dict[str, int]:
    """The sampler's live bytes over `seqs` x `vocab_size` logits of `act_bytes` when vLLM
    samples with FlashInfer (vllm/v1/sample/ops/topk_topp_sampler.py, `flashinfer_sample`, top-k
    and top-p both set as in the profile run: `flashinfer.sampling.
    top_k_top_p_sampling_from_logits`, whose default filter order "top_k_first" runs
    `masked_logits = top_k_mask_logits(logits, top_k)`, `probs = torch.softmax(masked_logits)`,
    then `top_p_sampling_from_probs`, a rejection-sampling kernel that sorts nothing):

        logits      a       the head's output
        float32     4       the sampler's float32 logits (none when already float32)
        masked      4       the top-k-masked logits
        probs       4       their softmax

    a + 12 bytes per logit and no buffer by SM count; the kernels' per-row scratch (a few
    words a row) not counted."""
    NV, a = seqs * vocab_size, act_bytes
    return {"logits": NV * a, "sampler/float32": 0 if a == FLOAT32 else NV * FLOAT32,
            "sampler/masked logits": NV * MASKED, "sampler/probs": NV * PROBS,
            "sampler/requests": seqs * PER_REQUEST}


__all__ = ["SAMPLERS", "SMS", "TRITON_SAMPLER_SINCE", "flashinfer_sampler_bytes",
           "sampler_bytes", "sm_count", "sort_free_sampler_bytes", "sort_temporaries"]
