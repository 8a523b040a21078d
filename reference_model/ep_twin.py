"""Expert parallelism as torchtitan 0.3.0 runs it, on gloo ranks of this machine, with every
collective counted: its MoE layer (torchtitan/models/common/moe.py: `MoE`, its
`TokenChoiceTopKRouter`, `GroupedExperts` holding n_expert / ep experts per rank) and its
`AllToAllTokenDispatcher` (torchtitan/models/common/token_dispatcher.py), wired to a 1-D "ep"
mesh as `RoutedExperts.parallelize` wires it, run forward and backward.

Per MoE layer forward the dispatcher issues, all over the ep group: the exchange of the token
counts (`_token_count_exchange`, under no_grad: the n_expert int64 counts of this rank's
tokens), the dispatch of the routed tokens (T x k rows of E, `_dispatch_token_exchange`) and
their combine (the rows this rank received, `_combine_token_exchange`); backward, the autograd
all-to-alls of the two. Under torchtitan's default spmd_types backend they are
`spmd_types.all_to_all` calls; the twin runs the `partial_dtensor` backend, whose calls are
torch's functional `all_to_all_single` with the same split sizes (the same tensors move), so
that a dispatch mode sees each call with its bytes (`collective_log`).

What the twin patches, and why: torchtitan's import needs `tyro` (its command-line config,
unused here) and imports its MinimalAsyncEP dispatcher's Triton kernels (a CUDA-only
dispatcher, unused here): both are replaced by empty modules when absent. Nothing in the MoE
layer or the all-to-all dispatcher is changed. The experts run torch._grouped_mm on CPU.

`count_ep(cases, world)` spawns `world` ranks and returns each case's calls per rank as
(kind, bytes, phase, dtype) with nccl-tests' size (the all-to-all's input)."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import multiprocessing as mp
import socket
import sys
import types
from dataclasses import dataclass

TORCHTITAN_VERSION = "0.3.0"
# what the twin does without (module docstring), each stubbed only when tyro, triton are absent
_STUBBED = ("tyro", "torchtitan.distributed.minimal_async_ep")


@dataclass(frozen=True)
class EPCase:
    """One MoE layer of `n_expert` experts of width `ffn` (k = `top_k` per token) on E =
    `n_embd`, fed `batch` x `seq` tokens per rank in `dtype`; `routing` "balanced"
    (torchtitan's `_debug_force_load_balance`: round-robin, every rank sends and receives
    T x k rows) or "skewed" (the router's own choice with the first rank's experts favoured
    by their load-balancing bias: ranks receive unequal rows); `recompute`: the layer under
    non-reentrant activation checkpointing (torchtitan's full AC)."""

    n_expert: int = 8
    top_k: int = 2
    n_embd: int = 32
    ffn: int = 32
    batch: int = 2
    seq: int = 16
    dtype: str = "fp32"
    routing: str = "balanced"
    recompute: bool = False


def torchtitan_available() -> bool:
    return importlib.util.find_spec("torchtitan") is not None \
        and importlib.util.find_spec("spmd_types") is not None


class _Anything:
    """Stands for any attribute of a stubbed module (decorators pass their function on)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()

    def __call__(self, *args, **kwargs):
        return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else _Anything()

    def __getitem__(self, key):
        return _Anything()

    def __or__(self, other):
        return _Anything()

    __ror__ = __or__


class _Stubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, names):
        self.names = names

    def find_spec(self, name, path, target=None):
        if any(name == n or name.startswith(n + ".") for n in self.names):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__ = []

        def attr(name):
            if name.startswith("__"):
                raise AttributeError(name)
            return _Anything()

        module.__getattr__ = attr
        return module

    def exec_module(self, module):
        pass


def import_torchtitan():
    """torchtitan's MoE classes, the stubs of `_STUBBED` in place where needed."""
    missing = [stub for stub, needs in zip(_STUBBED, ("tyro", "triton"))
               if importlib.util.find_spec(needs) is None]
    if missing and not any(isinstance(f, _Stubs) for f in sys.meta_path):
        sys.meta_path.insert(0, _Stubs(tuple(missing)))
    from torchtitan.distributed import utils
    from torchtitan.models.common.linear import Linear
    from torchtitan.models.common.moe import (MoE, RoutedExperts, GroupedExperts,
                                              TokenChoiceTopKRouter)
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    return types.SimpleNamespace(MoE=MoE, RoutedExperts=RoutedExperts,
                                 GroupedExperts=GroupedExperts, Router=TokenChoiceTopKRouter,
                                 Linear=Linear, Dispatcher=AllToAllTokenDispatcher,
                                 set_spmd_backend=utils.set_spmd_backend)


def collective_log(calls: list, phase: list):
    """A dispatch mode recording each functional collective as (kind, bytes of its input,
    phase[0], its dtype) and each c10d collective likewise (none is expected)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    kinds = {"all_to_all_single": "all-to-all", "all_reduce": "all-reduce",
             "all_gather_into_tensor": "all-gather", "reduce_scatter_tensor": "reduce-scatter",
             "alltoall_base_": "all-to-all", "allreduce_": "all-reduce",
             "allgather_into_tensor_coalesced_": "all-gather",
             "reduce_scatter_tensor_coalesced_": "reduce-scatter", "alltoall_": "all-to-all",
             "allgather_": "all-gather", "_allgather_base_": "all-gather",
             "reduce_scatter_": "reduce-scatter", "broadcast_": "broadcast"}

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = func._overloadpacket.__name__
            if func.namespace in ("_c10d_functional", "c10d") and name in kinds:
                x = args[1] if func.namespace == "c10d" and name == "alltoall_base_" else args[0]
                xs = x if isinstance(x, (list, tuple)) else [x]
                ts = [t for t in xs if isinstance(t, torch.Tensor)]
                calls.append((kinds[name], sum(t.numel() * t.element_size() for t in ts),
                              phase[0], str(ts[0].dtype).removeprefix("torch.")))
            return func(*args, **kwargs)

    return Log()


def _build(tt, case: EPCase, world: int):
    import torch

    n, k = case.n_expert, case.top_k
    cfg = tt.MoE.Config(
        num_experts=n,
        routed_experts=tt.RoutedExperts.Config(
            inner_experts=tt.GroupedExperts.Config(dim=case.n_embd, hidden_dim=case.ffn,
                                                   num_experts=n // world),
            token_dispatcher=tt.Dispatcher.Config(num_experts=n, top_k=k)),
        router=tt.Router.Config(num_experts=n, top_k=k,
                                gate=tt.Linear.Config(in_features=case.n_embd, out_features=n),
                                _debug_force_load_balance=case.routing == "balanced"))
    moe = cfg.build()
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.1)
        moe.expert_bias_E.zero_()
        if case.routing == "skewed":  # favour the first rank's experts
            moe.expert_bias_E[: n // world] = 0.3
    return moe.to(torch.bfloat16 if case.dtype == "bf16" else torch.float32)


def _rank(rank: int, world: int, port: int, cases: list, queue) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.utils.checkpoint import checkpoint

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        tt = import_torchtitan()
        tt.set_spmd_backend("partial_dtensor")
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
        out = []
        for case in cases:
            torch.manual_seed(0)  # the same router and experts' seed on every rank
            moe = _build(tt, case, world)
            moe.routed_experts.token_dispatcher.wire_meshes(ep_mesh=mesh)
            torch.manual_seed(1 + rank)  # each rank its own tokens
            dtype = torch.bfloat16 if case.dtype == "bf16" else torch.float32
            x = torch.randn(case.batch, case.seq, case.n_embd, dtype=dtype, requires_grad=True)
            calls, phase = [], ["forward"]
            with collective_log(calls, phase):
                y = checkpoint(moe, x, use_reentrant=False) if case.recompute else moe(x)
                phase[0] = "backward"
                y.float().square().sum().backward()
            out.append(calls)
        queue.put((rank, out))
    finally:
        dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def count_ep(cases: list[EPCase], world: int = 2) -> list[list[list[tuple]]]:
    """Each case's calls on each rank: result[case][rank] = [(kind, bytes, phase, dtype),
    ...]."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=_rank, args=(r, world, port, cases, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    return [[got[r][i] for r in range(world)] for i in range(len(cases))]


__all__ = ["EPCase", "TORCHTITAN_VERSION", "collective_log", "count_ep", "import_torchtitan",
           "torchtitan_available"]
