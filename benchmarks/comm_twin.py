"""The collectives of one training step counted on gloo (2 ranks), against
`gptcalc.time.comm`:

- `count_ddp`: DDP's gradient all-reduces on a stack of Linears, seen by a communication hook
  (every bucket DDP all-reduces, with its bytes);
- `count_collectives`: FSDP2 (`fully_shard` per block and at the root, as
  reference_model.distributed builds it), FSDP1 (reference_model.fsdp1_twin, gradient
  accumulation synced each micro-batch or under `no_sync()`), DeepSpeed ZeRO 1-3
  (reference_model.deepspeed_twin, its CPU accelerator) and Megatron-core's distributed
  optimizer (reference_model.megatron_optimizer_twin, CUDA shimmed) on the reference model:
  torch.distributed's collective functions wrapped in each rank (`CollectiveLog`), every call
  recorded with its kind, bytes and group;
  PyTorch's tensor parallel (DTensor's functional collectives, `funcol_log`) and
  torch.distributed.pipelining (its sends) likewise;
- `count_ring`: torch's ring attention (context parallel) on a fake group in this process;
- `ep_rows`: torchtitan's MoE layer and all-to-all dispatcher (expert parallel,
  reference_model.ep_twin) on 2 or 4 gloo ranks.

tests/test_time_twin.py, tests/test_comm_megatron.py and tests/test_comm_ep.py run them;
`python benchmarks/comm_twin.py` prints the tables of docs/time.md (FSDP2, FSDP1, DeepSpeed
1-3, Megatron's distributed optimizer, tensor, pipeline, context and expert parallel)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import socket
import time


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, layers: int, width: int, cap_bytes: int,
            queue) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width, bias=False)
                                  for _ in range(layers)])
    ddp = DDP(model, bucket_cap_mb=cap_bytes / 2**20)
    seen: list[int] = []

    def hook(state, bucket):
        buf = bucket.buffer()
        seen.append(buf.numel() * buf.element_size())
        return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])

    ddp.register_comm_hook(None, hook)
    for _ in range(2):  # the second step runs on the buckets DDP rebuilt after the first
        seen.clear()
        ddp(torch.randn(4, width)).sum().backward()
    queue.put((rank, list(seen)))
    dist.destroy_process_group()


def count_ddp(layers: int, width: int, cap_bytes: int, world: int = 2) -> list[int]:
    """The bytes of each all-reduce DDP issues in one step (rank 0's; every rank's agree)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, layers, width, cap_bytes, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    out = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert all(out[r] == out[0] for r in out), out
    return out[0]




# ------------------------------------------------------------------ FSDP2 and DeepSpeed ZeRO

# torch.distributed's collectives an engine may call, by the kind gptcalc names them; the
# deprecated and coalesced spellings too, so that nothing an engine issues goes uncounted
KINDS = {"all_reduce": "all-reduce", "all_reduce_coalesced": "all-reduce",
         "all_gather": "all-gather", "all_gather_into_tensor": "all-gather",
         "_all_gather_base": "all-gather", "all_gather_single": "all-gather",
         "all_gather_coalesced": "all-gather", "all_gather_object": "all-gather",
         "reduce_scatter": "reduce-scatter", "reduce_scatter_tensor": "reduce-scatter",
         "_reduce_scatter_base": "reduce-scatter", "reduce_scatter_single": "reduce-scatter",
         "reduce": "reduce", "broadcast": "broadcast", "broadcast_object_list": "broadcast",
         "all_to_all": "all-to-all", "all_to_all_single": "all-to-all",
         "send": "send/recv", "recv": "send/recv", "isend": "send/recv", "irecv": "send/recv",
         "batch_isend_irecv": "send/recv", "barrier": "barrier", "monitored_barrier": "barrier"}


def _nbytes(x) -> int:
    import torch

    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _size(name: str, args: tuple, kwargs: dict) -> int:
    """nccl-tests' size of the call: the all-reduced (broadcast, reduced, sent) tensor, the
    gathered output, the scattered input."""
    def arg(i, *keys):
        for k in keys:
            if k in kwargs:
                return kwargs[k]
        return args[i] if len(args) > i else None

    if name in ("reduce_scatter_tensor", "_reduce_scatter_base", "reduce_scatter_single",
                "reduce_scatter"):
        return _nbytes(arg(1, "input", "input_list"))
    if name in ("all_to_all", "all_to_all_single"):
        return _nbytes(arg(1, "input", "input_tensor_list"))
    if name == "batch_isend_irecv":
        return sum(_nbytes(op.tensor) for op in arg(0, "p2p_op_list"))
    if name in ("barrier", "monitored_barrier", "all_gather_object", "broadcast_object_list"):
        return 0
    return _nbytes(arg(0, "tensor", "output_tensor", "output", "tensor_list", "tensors",
                       "output_tensor_lists"))


class CollectiveLog:
    """Wraps torch.distributed's collective functions in this process: while `on`, each
    outermost call (one that torch.distributed does not issue from inside another) is recorded
    as (kind, nccl-tests bytes, group size). Point-to-point: each send, alone or in a batch
    (`batch_isend_irecv`, what torch.distributed.pipelining issues), is one send/recv; a
    receive is the other rank's send and is not recorded (nccl-tests' one transfer)."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.on, self.calls, self._depth = False, [], 0
        for name in KINDS:
            fn = getattr(dist, name, None)
            if fn is not None:
                wrapped = self._wrap(name, fn, dist)
                setattr(dist, name, wrapped)
                if name in ("isend", "irecv"):  # P2POp accepts only these two functions
                    setattr(dist.distributed_c10d, name, wrapped)

    def _wrap(self, name, fn, dist):
        def call(*args, **kwargs):
            if self.on and self._depth == 0 and name == "batch_isend_irecv":
                for op in (args[0] if args else kwargs["p2p_op_list"]):
                    if op.op is dist.isend:
                        self.calls.append(("send/recv", _nbytes(op.tensor),
                                           dist.get_world_size(op.group)))
            elif self.on and self._depth == 0 and name not in ("recv", "irecv"):
                group = kwargs.get("group")
                self.calls.append((KINDS[name], _size(name, args, kwargs),
                                   dist.get_world_size(group)))
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
        return call


# torch's functional collectives (what DTensor issues), by the kind gptcalc names them
FUNCOL_KINDS = {"all_reduce": "all-reduce", "all_reduce_coalesced": "all-reduce",
                "all_gather_into_tensor": "all-gather",
                "all_gather_into_tensor_coalesced": "all-gather",
                "reduce_scatter_tensor": "reduce-scatter",
                "reduce_scatter_tensor_coalesced": "reduce-scatter",
                "all_to_all_single": "all-to-all", "broadcast": "broadcast"}


def funcol_log():
    """A dispatch mode that records every functional collective (torch.ops._c10d_functional,
    what DTensor's redistributions issue) as (kind, nccl-tests bytes, group size): DTensor
    ops are passed on (NotImplemented) so that they desugar first, as torch's CommDebugMode
    does, whose counts carry no sizes."""
    import torch
    from torch.distributed.distributed_c10d import _resolve_process_group
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    class FuncolLog(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls: list[tuple[str, int, int]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if isinstance(func, torch._ops.HigherOrderOperator):
                return func(*args, **kwargs)
            if any(t is DTensor for t in types):
                return NotImplemented
            name = func._overloadpacket.__name__
            if func.namespace.startswith("_c10d_functional") and name in FUNCOL_KINDS:
                bound = dict(zip([a.name for a in func._schema.arguments], args), **kwargs)
                n = _resolve_process_group(bound["group_name"]).size()
                size = _nbytes(args[0]) * (n if name.startswith("all_gather") else 1)
                self.calls.append((FUNCOL_KINDS[name], size, n))
            return func(*args, **kwargs)

    return FuncolLog()


def _count_job(rank: int, world: int, port: int, spec: dict) -> list[tuple[str, int, int]]:
    import datetime

    import torch
    import torch.distributed as dist

    log = CollectiveLog()  # before any engine is imported or built: DeepSpeed keeps references
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    from reference_model import distributed as rd

    setup = spec["setup"]
    engine = "megatron" if setup.engine == "megatron" else rd.engine_of(setup)
    torch.manual_seed(0)
    meshes = None if engine == "megatron" else rd._meshes(setup)
    if engine == "megatron":  # Megatron-core's DDP and distributed optimizer, CUDA shimmed
        from reference_model.megatron_optimizer_twin import MegatronRank as runner_class
    elif engine == "deepspeed":
        from reference_model.deepspeed_twin import DeepSpeedRank as runner_class
    elif engine == "fsdp1":
        runner_class = _fsdp1_accumulating()
    else:
        runner_class = {"fsdp2": rd._FSDP2, "ddp": rd._DDP, "zero1": rd._Zero1,
                        "tp": rd._TensorParallel, "pipeline": rd._Pipeline}[engine]
    runner = runner_class(spec["cfg"], spec["workload"], setup, "reference", rank, world)
    runner.meshes = meshes
    runner.build()
    # DeepSpeed's runner steps one micro-batch per call and the optimizer at the boundary of
    # gradient_accumulation_steps; the others step the optimizer on every call
    calls = spec["workload"].grad_accum if engine == "deepspeed" else 1
    for _ in range(calls * spec.get("warmup", 1)):  # optimizer states made, buckets rebuilt
        runner.step()
    functional = funcol_log() if engine == "tp" else contextlib.nullcontext()
    log.on = True
    with functional:
        for _ in range(calls):
            runner.step()
    log.on = False
    dist.destroy_process_group()
    return log.calls + getattr(functional, "calls", [])


def _fsdp1_accumulating():
    """FSDP1's runner (reference_model.fsdp1_twin) stepping the optimizer once after the
    workload's grad_accum micro-batches, each synced, or with fsdp1_sync no-sync every one
    but the last under `no_sync()` as the Trainer runs them (accelerate's `accumulate`)."""
    from gptcalc.time.comm import fsdp1_no_sync
    from reference_model.fsdp1_twin import FSDP1Rank

    class FSDP1Accumulating(FSDP1Rank):
        def step(self, live=None, flops=False) -> None:
            m, quiet_ones = self.wl.grad_accum, fsdp1_no_sync(self.setup)
            self.opt.zero_grad(set_to_none=True)
            for i in range(m):
                quiet = self.fsdp.no_sync() if i < m - 1 and quiet_ones \
                    else contextlib.nullcontext()
                with quiet, self.context():
                    _, loss = self.model.loss(self.idx, self.targets)
                    loss.backward()
                del loss
            self.opt.step()

    return FSDP1Accumulating


def _count_rank(rank: int, world: int, jobs: list, queue) -> None:
    """One rank: imports once, forks a child per job so each starts from a clean process."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch  # noqa: F401 - imported once, before the forks

    for case, (port, spec) in enumerate(jobs):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                torch.set_num_threads(1)
                queue.put((case, rank, _count_job(rank, world, port, spec)))
                code = 0
            except BaseException as e:  # noqa: BLE001 - reported to the parent
                queue.put((case, rank, f"{type(e).__name__}: {e}"))
            finally:
                os._exit(code)
        os.waitpid(pid, 0)


def count_collectives(cases, world: int = 2, warmup: int = 1,
                      deadline_s: float = 600) -> list[list[tuple[str, int, int]]]:
    """Every collective one rank issues in one optimizer step (after `warmup` steps) of each
    set-up, as (kind, bytes, group size) in issue order, by `CollectiveLog` (torch's
    CommDebugMode does not run on gloo inside the spawned ranks); every rank's list is checked
    to hold the same collectives. FSDP2 and DDP run one micro-batch; DeepSpeed runs the
    workload's grad_accum micro-batches."""
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()  # written through at once: a forked child leaves by os._exit
    jobs = [(_port(), dict(cfg=cfg, workload=wl, setup=s, warmup=warmup)) for cfg, wl, s in cases]
    procs = [ctx.Process(target=_count_rank, args=(r, world, jobs, queue), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    out: dict[tuple[int, int], list] = {}
    end = time.monotonic() + deadline_s
    try:
        while len(out) < world * len(cases):
            if time.monotonic() > end:
                raise RuntimeError(f"collective count did not finish within {deadline_s} s")
            if queue.empty():
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a rank exited with code {dead[0]}")
                time.sleep(0.05)
                continue
            case, rank, calls = queue.get()
            if isinstance(calls, str):
                raise RuntimeError(f"rank {rank} failed in set-up {case}: {calls}")
            out[case, rank] = calls
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
    result = []
    for case in range(len(cases)):
        ranks = [sorted(out[case, r]) for r in range(world)]
        assert all(r == ranks[0] for r in ranks), (cases[case][2], ranks)
        result.append(out[case, 0])
    return result


def twin_cases():
    """(label, model, workload, set-up) of the table in docs/time.md and of
    tests/test_time_twin.py: a two-block Llama-shaped model on 2 ranks, mode mixed (bf16
    compute; FSDP2 reduces in fp32), FSDP2 at --zero 2 and 3, DeepSpeed at stages 1-3 with its
    default buckets, with reduce_bucket_size exactly the model's gradient elements (one bucket,
    full) and one element fewer (the last gradient, the token embedding's, goes alone), and
    two micro-batches of accumulation; then a three-block GPT-2-shaped model (tied head).
    DeepSpeed ZeRO-3's cases are `stage3_cases`."""
    from gptcalc import TrainingSetup, Workload, from_name

    cfg = from_name("debug", arch="llama", n_embd=64, n_head=4, n_kv_head=2, d_ff=176,
                    vocab_size=1601, block_size=32)
    gpt2 = from_name("debug", arch="gpt2", n_embd=64, n_head=4, vocab_size=1601,
                     block_size=32, n_layer=3)
    one, two = Workload(2, 32), Workload(2, 32, grad_accum=2)
    total = sum(p.numel() for p in _parameter_sizes(cfg))

    def ds(zero, **zero_opt):
        return TrainingSetup(dp=2, zero=zero, mode="mixed", engine="deepspeed",
                             engine_settings=tuple(zero_opt.items()))

    return [
        ("FSDP2 --zero 3", cfg, one, TrainingSetup(dp=2, zero=3, mode="mixed", engine="fsdp2")),
        ("FSDP2 --zero 2", cfg, one, TrainingSetup(dp=2, zero=2, mode="mixed", engine="fsdp2")),
        ("FSDP2 --zero 3, fp32", cfg, one, TrainingSetup(dp=2, zero=3, engine="fsdp2")),
        ("DeepSpeed ZeRO-1", cfg, one, ds(1)),
        ("DeepSpeed ZeRO-2", cfg, one, ds(2)),
        (f"DeepSpeed ZeRO-2, reduce_bucket_size {total:,} (full)", cfg, one,
         ds(2, reduce_bucket_size=total)),
        (f"DeepSpeed ZeRO-2, reduce_bucket_size {total - 1:,} (one over)", cfg, one,
         ds(2, reduce_bucket_size=total - 1)),
        ("DeepSpeed ZeRO-1, 2 micro-batches", cfg, two, ds(1)),
        ("DeepSpeed ZeRO-2, 2 micro-batches", cfg, two, ds(2)),
        # GPT-2-shaped: biases, learned positions, the head tied to the token embedding
        ("GPT-2 shape, FSDP2 --zero 3", gpt2, one,
         TrainingSetup(dp=2, zero=3, mode="mixed", engine="fsdp2")),
        ("GPT-2 shape, DeepSpeed ZeRO-2", gpt2, one, ds(2)),
        ("GPT-2 shape, DeepSpeed ZeRO-1, fp32", gpt2, one,
         TrainingSetup(dp=2, zero=1, engine="deepspeed")),
    ]


# DeepSpeed ZeRO-3 prefetches from the trace its first step records and its second checks:
# its steady state is the third step
STAGE3_WARMUP = 2


def stage3_cases():
    """(label, model, workload, set-up) of DeepSpeed ZeRO-3 on the two-block Llama of
    `twin_cases`, each threshold scaled to it and set on both sides of its boundary:
    stage3_param_persistence_threshold at the MLP matrices' 11,264 elements (persistent) and
    one below (gathered with the embedding and head); no persistence nor reuse, with no
    prefetch (a call per module fetch) and a prefetch bucket of 8,256 elements (a norm and
    q, k, v: the prefetch stops there) and 8,257 (it takes the output projection too);
    reduce_bucket_size at the gradients' 297,408 elements (one bucket) and one below (the
    embedding's alone); two micro-batches; then a three-block GPT-2 shape of E 63 (odd
    sizes: every gather and reduce-scatter padded to a multiple of dp; the head tied)."""
    from gptcalc import TrainingSetup, Workload, from_name

    cfg = from_name("debug", arch="llama", n_embd=64, n_head=4, n_kv_head=2, d_ff=176,
                    vocab_size=1601, block_size=32)
    odd = from_name("debug", arch="gpt2", n_embd=63, n_head=7, vocab_size=1601,
                    block_size=32, n_layer=3)
    one, two = Workload(2, 32), Workload(2, 32, grad_accum=2)
    total = sum(p.numel() for p in _parameter_sizes(cfg))
    mlp = cfg.n_embd * cfg.ffn_dim

    def ds(**zero_opt):
        return TrainingSetup(dp=2, zero=3, mode="mixed", engine="deepspeed",
                             engine_settings=tuple(zero_opt.items()))

    fetch = dict(stage3_param_persistence_threshold=0, stage3_max_reuse_distance=0)
    qkv = cfg.n_embd + cfg.n_embd * (cfg.n_embd + 2 * cfg.kv_heads * cfg.head_size)
    return [
        ("DeepSpeed ZeRO-3", cfg, one, ds()),
        (f"DeepSpeed ZeRO-3, persistence threshold {mlp:,} (MLP matrices whole)", cfg, one,
         ds(stage3_param_persistence_threshold=mlp)),
        (f"DeepSpeed ZeRO-3, persistence threshold {mlp - 1:,} (MLP matrices gathered)", cfg,
         one, ds(stage3_param_persistence_threshold=mlp - 1)),
        ("DeepSpeed ZeRO-3, no persistence, reuse or prefetch", cfg, one,
         ds(stage3_prefetch_bucket_size=0, **fetch)),
        (f"DeepSpeed ZeRO-3, no persistence or reuse, prefetch {qkv:,}", cfg, one,
         ds(stage3_prefetch_bucket_size=qkv, **fetch)),
        (f"DeepSpeed ZeRO-3, no persistence or reuse, prefetch {qkv + 1:,}", cfg, one,
         ds(stage3_prefetch_bucket_size=qkv + 1, **fetch)),
        (f"DeepSpeed ZeRO-3, reduce_bucket_size {total:,} (full)", cfg, one,
         ds(reduce_bucket_size=total)),
        (f"DeepSpeed ZeRO-3, reduce_bucket_size {total - 1:,} (one over)", cfg, one,
         ds(reduce_bucket_size=total - 1)),
        ("DeepSpeed ZeRO-3, 2 micro-batches", cfg, two, ds()),
        ("GPT-2 shape, E 63, DeepSpeed ZeRO-3", odd, one, ds()),
        ("GPT-2 shape, E 63, DeepSpeed ZeRO-3, no persistence, reuse or prefetch", odd, one,
         ds(stage3_prefetch_bucket_size=0, **fetch)),
    ]


def fsdp1_cases():
    """(label, model, workload, set-up) of FSDP1 (reference_model.fsdp1_twin: a unit per block
    and the root, use_orig_params) on 2 ranks: the two-block Llama of `twin_cases` (every
    flat parameter's size even: no padding) at --zero 3 (FULL_SHARD) and 2 (SHARD_GRAD_OP),
    mode mixed (bf16 gathers, fp32 reduce-scatters); two micro-batches, each synced and under
    `no_sync()` (accelerate's default); then a three-block GPT-2 shape of E 63
    (biases, learned positions, head tied; each unit's flat size odd, padded by one element
    to a multiple of 2), mixed and fp32."""
    from gptcalc import TrainingSetup, Workload, from_name

    cfg = from_name("debug", arch="llama", n_embd=64, n_head=4, n_kv_head=2, d_ff=176,
                    vocab_size=1601, block_size=32)
    one, two = Workload(2, 32), Workload(2, 32, grad_accum=2)

    odd = from_name("debug", arch="gpt2", n_embd=63, n_head=7, vocab_size=1601,
                    block_size=32, n_layer=3)

    def fsdp1(zero, mode="mixed", no_sync=0):
        return TrainingSetup(dp=2, zero=zero, mode=mode, engine="fsdp1",
                             fsdp1_sync="no-sync" if no_sync else "each-batch")

    return [("FSDP1 --zero 3", cfg, one, fsdp1(3)),
            ("FSDP1 --zero 2", cfg, one, fsdp1(2)),
            ("FSDP1 --zero 3, 2 micro-batches", cfg, two, fsdp1(3)),
            ("FSDP1 --zero 2, 2 micro-batches", cfg, two, fsdp1(2)),
            ("FSDP1 --zero 3, 2 micro-batches, no_sync", cfg, two, fsdp1(3, no_sync=1)),
            ("FSDP1 --zero 2, 2 micro-batches, no_sync", cfg, two, fsdp1(2, no_sync=1)),
            ("GPT-2 shape, E 63, FSDP1 --zero 3", odd, one, fsdp1(3)),
            ("GPT-2 shape, E 63, FSDP1 --zero 2, fp32", odd, one, fsdp1(2, "fp32"))]


def tp_cases():
    """(label, model, workload, set-up) of PyTorch's tensor parallel (parallelize_module with
    ColwiseParallel and RowwiseParallel, SequenceParallel norms, loss_parallel; as
    reference_model.distributed lays it out) on 2 ranks: the two-block Llama (vocabulary
    1,602, split evenly) without and with sequence parallel (fp32); the GPT-2 shape
    (learned positions, biases, LayerNorms, tied head) with sequence parallel."""
    from gptcalc import TrainingSetup, Workload, from_name

    cfg = from_name("debug", arch="llama", n_embd=64, n_head=4, n_kv_head=2, d_ff=176,
                    vocab_size=1602, block_size=32)
    gpt2 = from_name("debug", arch="gpt2", n_embd=64, n_head=4, vocab_size=1602,
                     block_size=32, n_layer=3)
    one = Workload(2, 32)
    return [("tensor parallel 2", cfg, one, TrainingSetup(tp=2)),
            ("tensor parallel 2, sequence parallel", cfg, one, TrainingSetup(tp=2, sp=True)),
            ("GPT-2 shape, tensor parallel 2, sequence parallel", gpt2, one,
             TrainingSetup(tp=2, sp=True))]


def megatron_cases():
    """Megatron-core's distributed optimizer on the two-block Llama, mixed (bf16 weights, fp32
    gradients) and fp32, with --overlap-grad-reduce (its default buckets hold the whole model)
    and without, with a bucket size of exactly the head's and the final norm's elements and
    one more (the first MLP matrix joins the first bucket); and the GPT-2 shape
    (biases, learned positions, tied head)."""
    from gptcalc import TrainingSetup, Workload, from_name

    cfg = from_name("debug", arch="llama", n_embd=64, n_head=4, n_kv_head=2, d_ff=176,
                    vocab_size=1601, block_size=32)  # twin_cases' models
    gpt2 = from_name("debug", arch="gpt2", n_embd=64, n_head=4, vocab_size=1601,
                     block_size=32, n_layer=3)
    wl = Workload(2, 32)
    mixed = dict(dp=2, engine="megatron", mode="mixed", attn_impl="manual")

    def settings(**kw):
        return TrainingSetup(**mixed, engine_settings=tuple(kw.items()))

    # backward reaches the untied head first, then the final norm: a bucket of exactly both
    last = cfg.vocab_size * cfg.n_embd + cfg.n_embd
    return [("Megatron distributed optimizer, mixed (bf16)", cfg, wl, TrainingSetup(**mixed)),
            ("Megatron distributed optimizer, fp32", cfg, wl,
             TrainingSetup(**dict(mixed, mode="fp32"))),
            ("Megatron distributed optimizer, no --overlap-grad-reduce", cfg, wl,
             settings(overlap_grad_reduce=0)),
            (f"Megatron distributed optimizer, --ddp-bucket-size {last:,} (head and final norm)",
             cfg, wl, settings(bucket_size=last)),
            (f"Megatron distributed optimizer, --ddp-bucket-size {last + 1:,} (one over)", cfg,
             wl, settings(bucket_size=last + 1)),
            ("GPT-2 shape, Megatron distributed optimizer, mixed", gpt2, wl,
             TrainingSetup(**mixed))]


def pp_cases():
    """(label, model, workload, set-up) of torch.distributed.pipelining on 2 ranks (each a
    stage): a four-block Llama, 4 micro-batches, under GPipe, 1F1B, interleaved 1F1B and
    interleaved zero bubble at 2 chunks per rank (every rank then sends both ways)."""
    from gptcalc import TrainingSetup, Workload, from_name

    cfg = from_name("debug", arch="llama", n_embd=64, n_head=4, n_kv_head=2, d_ff=176,
                    vocab_size=1601, block_size=32, n_layer=4)
    four = Workload(2, 32, grad_accum=4)
    return [(f"pipeline 2, {name}{f', {v} chunks per rank' if v > 1 else ''}", cfg, four,
             TrainingSetup(pp=2, pp_schedule=name, pp_virtual=v))
            for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2),
                            ("zero-bubble", 2))]


def count_ring(cfg, workload, setup, rank: int = 0) -> list[tuple[str, int, int]]:
    """The collectives of one block's attention, forward and backward, on context-parallel
    rank `rank`: torch's ring attention (`_templated_ring_attention` and its backward, torch
    2.13, the default rotation and load balancing) called on a fake process group of cp
    ranks in this process (torch's `context_parallel` dispatches only CUDA's SDPA: the ring is
    called as reference_model.ring_attention calls it), with the CPU flash kernel; q, k and v
    of every query head, local tokens, the set-up's activation dtype."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor.experimental._context_parallel import _attention as ring
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dtype = {2: torch.bfloat16, 4: torch.float32}[setup.act_bytes]
    shape = (workload.batch_size, cfg.n_head // setup.tp, workload.seq_len // setup.cp,
             cfg.head_size)
    dist.init_process_group("fake", rank=rank, world_size=setup.cp, store=FakeStore())
    try:
        q, k, v = (torch.randn(shape, dtype=dtype) for _ in range(3))
        forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
        backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
        with funcol_log() as log:
            out, lse = ring._templated_ring_attention(dist.group.WORLD, 2, forward, q, k, v,
                                                      is_causal=True)[:2]
            ring._templated_ring_attention_backward(
                dist.group.WORLD, 2, backward, torch.randn(out.shape, dtype=dtype), "grad_out",
                q, k, v, out, lse, True, dropout_p=0.0)
        return log.calls
    finally:
        dist.destroy_process_group()


def cp_cases():
    """(label, model, workload, set-up) of the ring's twin: one Llama block (E 64, 4 heads of
    16), 2 sequences of 32 tokens, cp 2 and 4, fp32 and bf16."""
    from gptcalc import TrainingSetup, Workload, from_name

    cfg = from_name("debug", arch="llama", n_embd=64, n_head=4, n_kv_head=2, d_ff=176,
                    vocab_size=1601, block_size=32, n_layer=1)
    return [(f"context parallel {cp}{', bf16' if mode == 'bf16' else ''}", cfg,
             Workload(2, 32), TrainingSetup(cp=cp, dp=1, mode=mode))
            for cp in (2, 4) for mode in ("fp32", "bf16")]


def _parameter_sizes(cfg):
    from reference_model.model import build_model

    return list(build_model(cfg, "manual").parameters())


def modelled(cfg, workload, setup) -> list[tuple[str, int, int]]:
    """gptcalc's collectives of the set-up, one (kind, bytes, group) per call."""
    from gptcalc.time.comm import collectives

    return [(c.kind, int(c.size), c.group) for c in collectives(
        cfg, setup, workload.batch_size, workload.seq_len, workload.grad_accum, 8)
        for _ in range(c.count)]


# ------------------------------------------------------------------ expert parallel
EP_CASES = (("balanced routing, fp32", "balanced", "fp32", False),
            ("skewed routing, bf16", "skewed", "bf16", False),
            ("skewed routing, fp32, full recomputation", "skewed", "fp32", True))


def ep_rows(world: int = 2) -> list[tuple[str, str, str, bool]]:
    """torchtitan's MoE layer and all-to-all dispatcher on `world` gloo ranks
    (reference_model.ep_twin), one MoE block of 8 experts, k 2, E 32, 2 x 16 tokens a rank:
    (label, gptcalc's calls, the calls counted on every rank, whether the counts and bytes
    agree: the routed rows on average over the ranks)."""
    from gptcalc import GPTConfig, TrainingSetup
    from gptcalc.time.comm import collectives
    from reference_model.ep_twin import EPCase, count_ep

    cases = [EPCase(routing=r, dtype=d, recompute=rc) for _, r, d, rc in EP_CASES]
    rows = []
    for (label, *_), case, ranks in zip(EP_CASES, cases, count_ep(cases, world)):
        cfg = GPTConfig(block_size=64, vocab_size=64, n_layer=1, n_head=4,
                        n_embd=case.n_embd, n_expert=case.n_expert,
                        n_expert_active=case.top_k, moe_ffn_dim=case.ffn)
        setup = TrainingSetup(mode=case.dtype, recompute="full" if case.recompute else "none",
                              dp=world, ep=world, engine="fsdp2", zero=3)
        model = [("all-to-all", int(c.size), world) for c in collectives(
            cfg, setup, case.batch, case.seq, 1, 8) if c.part == "ep" for _ in range(c.count)]
        counted = [[("all-to-all", size, world) for _, size, _, _ in calls] for calls in ranks]
        mean = sum(size for calls in counted for _, size, _ in calls) / world
        equal = all(len(calls) == len(model) for calls in counted) \
            and mean == sum(size for _, size, _ in model)
        rows.append((f"expert parallel {world}, {label}", summary(model),
                     " / ".join(summary(calls) for calls in counted), equal))
    return rows


def summary(calls: list[tuple[str, int, int]]) -> str:
    """'kind count x bytes' per distinct collective, as the table prints them."""
    from collections import Counter

    return "; ".join(f"{k} {n} x {b:,} B" for (k, b, _), n in sorted(Counter(calls).items()))


if __name__ == "__main__":
    cases = twin_cases() + fsdp1_cases() + tp_cases() + pp_cases() + megatron_cases()
    steady = stage3_cases()
    counted = count_collectives([c[1:] for c in cases]) \
        + count_collectives([c[1:] for c in steady], warmup=STAGE3_WARMUP)
    print("| engine, layout | gptcalc | counted | equal |\n|---|---|---|---|")
    for (label, cfg, wl, setup), calls in zip(cases + steady, counted):
        model = modelled(cfg, wl, setup)
        print(f"| {label} | {summary(model)} | {summary(calls)} | "
              f"{'yes' if sorted(model) == sorted(calls) else 'no'} |")
    from gptcalc.time.comm import collectives

    for label, cfg, wl, setup in cp_cases():  # one block's ring, forward and backward
        model = [(c.kind, int(c.size), c.group) for c in collectives(
            cfg, setup, wl.batch_size, wl.seq_len, 1, 8) if c.part == "cp"
            for _ in range(c.count)]
        calls = count_ring(cfg, wl, setup)
        print(f"| {label} (one block) | {summary(model)} | {summary(calls)} | "
              f"{'yes' if sorted(model) == sorted(calls) else 'no'} |")
    for world in (2, 4):  # torchtitan's expert parallel, one MoE block; ranks 0 / 1 / ...
        for label, model, counted, equal in ep_rows(world):
            print(f"| {label} | {model} | {counted} | {'yes' if equal else 'no'} |")
