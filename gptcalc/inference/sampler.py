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
CPU (reference_model/serve_sampler.py). On CUDA the sort holds more, while it runs
(aten/src/ATen/native/cuda/Sort.cu, `segmented_sort_pairs`, 128 or more rows and fewer than
10^6 columns): int64 source indices (8) and cub's alternate key and value buffers (4 + 8;
cub/device/dispatch/dispatch_radix_sort.cuh, the "3rd keys buffer" and "3rd values buffer" of
a sort that may not overwrite its input), so the peak on CUDA is inside the sort: a + 36 bytes
(38 for bf16). One row, or a vocabulary of 10^6 or more, takes the row-by-row path, whose
temporaries are one row's. Fewer than 128 rows take the full-sort path, counted here as the
segmented one. Checked on CUDA against the activation peak vLLM logs for Llama-3-8B on an H100
(tests/test_serve_sampler.py).

Per request, besides: the sampling parameters (temperature, top-p, top-k as int64, three
penalties) and the greedy token, 36 bytes.
"""

from __future__ import annotations

FLOAT32 = 4
SORTED = 4 + 8  # values (float32) and int64 indices
MASKS = 1 + 1  # top-k and top-p boolean masks
# CUDA sort temporaries: int64 source indices and cub's alternate float32 keys and int64 values
CUDA_SORT_TEMPORARIES = 8 + 4 + 8
LARGE_SEGMENT = 10**6  # PyTorch sorts rows of this many elements or more one by one
# temperature, top-p (float32), top-k (int64), three float32 penalties, the greedy token (int64)
PER_REQUEST = 4 + 4 + 8 + 3 * 4 + 8


def sampler_bytes(seqs: int, vocab_size: int, act_bytes: int = 2, cuda: bool = True
                  ) -> dict[str, int]:
    """The sampler's live bytes at its peak over `seqs` x `vocab_size` logits of `act_bytes`,
    by line (see the module docstring): inside the sort on CUDA, at the scatter on CPU."""
    NV, a = seqs * vocab_size, act_bytes
    held = {"logits": NV * a, "sampler/float32": 0 if a == FLOAT32 else NV * FLOAT32,
            "sampler/sorted": NV * SORTED, "sampler/requests": seqs * PER_REQUEST}
    scatter = {**held, "sampler/masks": NV * MASKS, "sampler/top-p": NV * FLOAT32,
               "sampler/scattered": NV * FLOAT32}
    if not cuda:
        return scatter
    # one row, or rows of 10^6 or more, are sorted one by one: temporaries of one row only
    temps = CUDA_SORT_TEMPORARIES if 1 < seqs and vocab_size < LARGE_SEGMENT else 0
    sort = {**held, "sampler/sort temporaries": NV * temps}
    return max(sort, scatter, key=lambda moment: sum(moment.values()))


__all__ = ["sampler_bytes"]
