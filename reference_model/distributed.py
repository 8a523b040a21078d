"""The engines: one training step of a sharded layout under PyTorch's own distributed engines.

`run_layout` launches dp x tp x pp ranks on this machine (torch.multiprocessing, the gloo
backend, a rendezvous on a free 127.0.0.1 port) or, shape-only, runs every rank in this process
on FakeTensorMode tensors with a fake process group (`FakeStore`, as torchtitan's memory
estimator does). Each rank builds the same model (the reference model, or the transformers
model of the same config), applies the layout and trains:

- ZeRO-3: FSDP2 `fully_shard` on every block and at the root; ZeRO-2: the same with
  `reshard_after_forward=False` (parameters stay unsharded from forward to backward);
- plain data parallel (ZeRO 0): `DistributedDataParallel` with PyTorch's defaults (real
  tensors only: its C++ reducer does not run on FakeTensorMode);
- ZeRO-1: `torch.distributed.optim.ZeroRedundancyOptimizer` over AdamW (whole parameters
  assigned greedily by size), gradients all-reduced in place after backward;
- tensor / sequence parallel: DTensor `parallelize_module` with Megatron's layout (column-parallel
  q/k/v and MLP up/gate, row-parallel output projections, vocabulary-parallel embedding and
  head, `SequenceParallel` norms, a vocabulary-parallel cross entropy with `loss_parallel`);
- pipeline: `torch.distributed.pipelining` with the schedule of `pp_schedule` (ScheduleGPipe,
  Schedule1F1B, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble) over pp stages of
  `pp_virtual` model chunks each, split as `gptcalc.schedules.chunk_layers` splits them, and
  its micro-batches (`gptcalc.schedules.micro_batches`; the first chunk holds the embeddings,
  the last the final norm and the head).

Per rank it measures the state bytes (the storages of local parameter shards, gradients and
optimizer states), the peak of live saved-for-backward bytes (saved_tensors_hooks; a tensor is
live until autograd drops it), the step peak (FSDPMemTracker under FSDP2, MemTracker otherwise)
and the FLOPs the rank executes (FlopCounterMode counting DTensor ops on their local shards).

A failed rank, a timeout or Ctrl-C terminates every child in a `finally`; process groups carry
a timeout.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import socket
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch

from gptcalc.config import GPTConfig
from gptcalc.errors import ConfigError
from gptcalc.training_setup import TrainingSetup
from gptcalc.workload import Workload

from .rank import (LiveSaved, _batch, _Engine, _local, _Model, _storage_key, coords_of,
                   storage_bytes)

MAX_RANKS = 8  # ranks a real run may launch on this machine
PG_TIMEOUT_S = 120  # a collective waiting longer than this fails the rank
JOIN_DEADLINE_S = 600  # the whole real run
ENGINES = ("fsdp2", "fsdp1", "zero1", "ddp", "tp", "pipeline", "deepspeed")


@dataclass(frozen=True)
class RankResult:
    """What one rank measured in its tracked step."""

    rank: int
    coords: dict[str, int]  # {"dp": i, "tp": j, "pp": k}
    weights: int
    gradients: int
    optimizer: int
    saved: int  # the peak of live saved-for-backward bytes
    peak: int
    peak_tool: str
    flops: int
    seconds: float
    peak_categories: dict[str, int] = dataclasses.field(default_factory=dict)
    resident: int = -1  # live tensor bytes between steps (-1: not measured, shape-only)
    host: dict[str, int] = dataclasses.field(default_factory=dict)  # offloaded, by line
    moments: dict[str, int] = dataclasses.field(default_factory=dict)  # an engine's own, named

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def check_precision(layout: dict, mode: str, optimizer: str, recompute: str) -> None:
    """The twins train fp32 AdamW without recomputation, or in the mixed precision of the
    engines whose twins run it (FSDP2's MixedPrecisionPolicy, DeepSpeed's bf16)."""
    from gptcalc.memory.engines import default_engine

    engine = layout.get("engine") or default_engine(layout["zero"]).name
    mixed = mode == "mixed" and engine in ("fsdp2", "fsdp1", "deepspeed")
    if (mode, optimizer, recompute) != ("fp32", "adamw", "none") and not (
            mixed and (optimizer, recompute) == ("adamw", "none")):
        raise ConfigError("mode", "the distributed verify trains fp32 AdamW without "
                                  "recomputation (--mode fp32 --optimizer adamw), or FSDP2's "
                                  "MixedPrecisionPolicy (--engine fsdp2 --mode mixed), or "
                                  "DeepSpeed's bf16 (--engine deepspeed --mode mixed)")


def engine_of(setup: TrainingSetup) -> str:
    """The engine a layout runs under; raises ConfigError for a layout not wired up."""
    if setup.pp > 1:
        if setup.tp > 1 or (setup.dp > 1 and setup.engine != "fsdp2"):
            raise ConfigError("pp", "the pipeline engine runs pp alone (dp = tp = 1) or with "
                                    "FSDP2 inside each stage (--engine fsdp2)")
        return "pipeline"
    from gptcalc.memory.engines import engine_for

    engine = engine_for(setup).name
    if engine == "megatron":
        raise ConfigError("engine", "Megatron-LM does not run here (it needs CUDA and Transformer "
                                    "Engine): its figures are its documentation's")
    if setup.dp > 1 and engine == "deepspeed" and setup.zero >= 1:
        if setup.tp > 1:
            raise ConfigError("tp", "the DeepSpeed twin runs data parallel alone (--tp 1)")
        return "deepspeed"
    if setup.dp > 1 and engine in ("fsdp2", "fsdp1"):
        return engine
    if setup.tp > 1:
        if setup.dp > 1:
            raise ConfigError("tp", "tensor parallel with dp > 1 is verified under FSDP2 only "
                                    "(--engine fsdp2 --zero 2 or 3)")
        return "tp"
    if setup.dp > 1 and engine == "zero-redundancy":
        return "zero1"
    if setup.dp > 1:
        return "ddp"
    raise ConfigError("dp", "a distributed verify needs --dp, --tp or --pp above 1")


def check_layout(cfg: GPTConfig, workload: Workload, setup: TrainingSetup, impl: str,
                 tensors: str) -> str:
    """Raise ConfigError (one line, naming the option) when the layout does not divide the
    model or this machine cannot hold the ranks; return the engine."""
    from gptcalc.memory import validate_setup

    validate_setup(cfg, workload, setup)
    engine = engine_of(setup)
    world = setup.dp * setup.tp * setup.pp
    if tensors == "real" and world > MAX_RANKS:
        raise ConfigError("dp", f"{world} ranks: a real run launches at most {MAX_RANKS} on this "
                                f"machine; use --tensors shape-only")
    if tensors == "real" and world > 4 * (os.cpu_count() or 1):
        raise ConfigError("dp", f"{world} ranks on {os.cpu_count()} cores: use --tensors "
                                f"shape-only")
    if engine == "ddp" and tensors == "shape-only":
        raise ConfigError("tensors", "plain data parallel (--zero 0) runs real tensors only: "
                                     "DistributedDataParallel's reducer cannot run on "
                                     "FakeTensorMode; use --max-layers or --zero 1, 2 or 3")
    if cpu_offloaded(setup) and tensors != "shape-only":
        raise ConfigError("tensors", "FSDP2's CPU offload is verified shape-only (its device "
                                     "is a fake accelerator apart from the host)")
    if engine == "deepspeed" and tensors == "shape-only":
        raise ConfigError("tensors", "the DeepSpeed twin runs real tensors only (its engine "
                                     "cannot run on FakeTensorMode); use --max-layers")
    if engine in ("tp", "pipeline") and impl == "transformers":
        raise ConfigError("impl", f"the {engine} engine runs the reference model only; "
                                  "transformers models are verified under ZeRO/FSDP2")
    if setup.lora_rank and (impl == "transformers" or engine in ("tp", "pipeline")):
        raise ConfigError("lora_rank", "the distributed twin adds LoRA to the reference model "
                                       "under data parallel engines only (--impl reference)")
    if engine == "tp" and (cfg.moe or cfg.mla or cfg.qkv_layout == "per_head"):
        raise ConfigError("tp", "tensor parallel is wired for fused or separate q/k/v, dense "
                                "MLPs")
    if engine == "tp" and cfg.dropout > 0:
        raise ConfigError("dropout", "tensor parallel verify needs dropout 0 (ranks would draw "
                                     "different masks from one seed)")
    return engine


def free_port() -> int:
    """A free TCP port on the loopback interface (127.0.0.1 only)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_layout(cfg: GPTConfig, workload: Workload, setup: TrainingSetup, impl: str = "reference",
               tensors: str = "real", ranks: tuple[int, ...] | None = None,
               deadline_s: float = JOIN_DEADLINE_S) -> list[RankResult]:
    """One measured training step of `setup`'s layout, per rank (sorted by rank).

    tensors="real": world size processes over gloo; "shape-only": `ranks` (default all) one
    after another in this process on FakeTensorMode tensors with a fake process group."""
    check_layout(cfg, workload, setup, impl, tensors)
    world = setup.dp * setup.tp * setup.pp
    spec = dict(cfg=cfg, workload=workload, setup=setup, impl=impl)
    if tensors == "shape-only":
        return [_fake_rank(spec, r, world) for r in (ranks or range(world))]
    return _launch([spec], world, deadline_s)[0]


def run_layouts(cfg: GPTConfig, workload: Workload, setups: list[TrainingSetup],
                impl: str = "reference", deadline_s: float = JOIN_DEADLINE_S
                ) -> list[list[RankResult]]:
    """`run_layout` (real tensors) of several set-ups of one world size, one list of per-rank
    results per set-up. Each rank is spawned once and imports torch (and DeepSpeed, where a
    set-up runs it) once; for each set-up it forks a child that joins a fresh process group
    and runs the step, so every set-up starts from the same process image as under
    `run_layout` (nothing one leaves behind reaches the next) while the start-up is paid once
    per world size. `deadline_s` is per set-up."""
    worlds = {s.dp * s.tp * s.pp for s in setups}
    if len(worlds) != 1:
        raise ValueError(f"run_layouts needs one world size, got {sorted(worlds)}")
    for s in setups:
        check_layout(cfg, workload, s, impl, "real")
    specs = [dict(cfg=cfg, workload=workload, setup=s, impl=impl) for s in setups]
    return _launch(specs, worlds.pop(), deadline_s * len(specs))


def run_each(layouts: list[tuple[GPTConfig, Workload, TrainingSetup]],
             deadline_s: float = JOIN_DEADLINE_S) -> list[list[RankResult]]:
    """`run_layouts` of layouts that each bring their own model and workload (one world size,
    the reference model): per layout, its ranks' results sorted by rank."""
    worlds = {s.dp * s.tp * s.pp for _, _, s in layouts}
    if len(worlds) != 1:
        raise ValueError(f"run_each needs one world size, got {sorted(worlds)}")
    for cfg, wl, setup in layouts:
        check_layout(cfg, wl, setup, "reference", "real")
    specs = [dict(cfg=c, workload=w, setup=s, impl="reference") for c, w, s in layouts]
    return _launch(specs, worlds.pop(), deadline_s * len(specs))


def _launch(specs: list[dict], world: int, deadline_s: float) -> list[list[RankResult]]:
    """Run every spec on `world` ranks: one spawned process per rank for a single spec, else
    one spawned `_zygote` per rank that forks a child per spec."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = []
    try:
        if len(specs) == 1:
            port = free_port()
            for rank in range(world):
                p = ctx.Process(target=_worker, args=(rank, world, port, specs[0], queue),
                                daemon=True)
                p.start()
                procs.append(p)
        else:
            ports = [free_port() for _ in specs]
            preload = ["deepspeed"] if any(engine_of(s["setup"]) == "deepspeed"
                                           for s in specs) else []
            jobs = list(zip(ports, specs))
            for rank in range(world):
                p = ctx.Process(target=_zygote, args=(rank, world, jobs, queue, preload),
                                daemon=True)
                p.start()
                procs.append(p)
        results: dict[tuple[int, int], RankResult] = {}
        end = time.monotonic() + deadline_s
        while len(results) < world * len(specs):
            if time.monotonic() > end:
                raise RuntimeError(f"distributed step did not finish within {deadline_s:.0f} s")
            if not queue.empty():
                kind, (case, rank), payload = queue.get()
                if kind == "error":
                    raise RuntimeError(f"rank {rank} failed"
                                       + (f" in set-up {case}" if len(specs) > 1 else "")
                                       + f": {payload}")
                results[case, rank] = payload
                continue
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead and queue.empty():
                raise RuntimeError(f"rank {procs.index(dead[0])} exited with code "
                                   f"{dead[0].exitcode}")
            time.sleep(0.02)
        for p in procs:
            p.join(timeout=30)
        return [[results[case, r] for r in range(world)] for case in range(len(specs))]
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def _zygote(rank: int, world: int, jobs: list[tuple[int, dict]], queue,
            preload: list[str]) -> None:
    """One rank's parent process under `run_layouts`: imports once, then forks a `_worker`
    per job (port, spec), one after another, so each set-up runs in a fresh copy of this
    process (no torch op has run in it, no process group exists)."""
    import importlib

    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # as deepspeed_twin sets it before import
    for name in preload:
        importlib.import_module(name)
    for case, (port, spec) in enumerate(jobs):
        pid = os.fork()
        if pid == 0:  # the child: run the set-up, report, and leave without cleanup handlers
            code = 1
            try:
                _worker(rank, world, port, spec, queue, case)
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        if status and os.WIFSIGNALED(status):
            queue.put(("error", (case, rank), f"killed by signal {os.WTERMSIG(status)}"))
            return


def _worker(rank: int, world: int, port: int, spec: dict, queue, case: int = 0) -> None:
    import torch.distributed as dist

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world,
                                timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
        try:
            result = _rank_step(spec, rank, world, fake=False)
        finally:
            dist.destroy_process_group()
        queue.put(("ok", (case, rank), result))
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the run
        root = e
        while root.__cause__ is not None or root.__context__ is not None:
            root = root.__cause__ or root.__context__
        last = traceback.format_exception_only(type(root), root)[-1].strip()
        if os.environ.get("GPTCALC_DEBUG"):
            last += "\n" + traceback.format_exc()
        queue.put(("error", (case, rank), last))
        raise SystemExit(1) from None


def _fake_rank(spec: dict, rank: int, world: int) -> RankResult:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from .measure import fake_mode

    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    try:
        return _rank_step(spec, rank, world, fake=True, mode=fake_mode)
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- one rank


def _flop_counter():
    """FlopCounterMode that counts a DTensor op by its local shards' shapes (what the rank
    computes), with the CPU SDPA kernels registered."""
    from torch.distributed.tensor import DTensor
    from torch.utils._pytree import tree_map_only
    from torch.utils.flop_counter import FlopCounterMode

    from .measure import CPU_SDPA_FLOPS

    class LocalFlopCounter(FlopCounterMode):
        def _count_flops(self, func_packet, out, args, kwargs):
            if func_packet in self.flop_registry:
                loc = lambda t: t._local_tensor  # noqa: E731
                args = tree_map_only(DTensor, loc, args)
                kwargs = tree_map_only(DTensor, loc, kwargs)
                n = self.flop_registry[func_packet](*args, **kwargs,
                                                   out_val=tree_map_only(DTensor, loc, out))
                for par in set(self.mod_tracker.parents):
                    self.flop_counts[par][func_packet] += n
            return out

    return LocalFlopCounter(display=False, custom_mapping=CPU_SDPA_FLOPS)


# FSDP2's CPUOffloadPolicy needs a device apart from the host ("cpu"): shape-only, the ranks
# run on a fake accelerator, PyTorch's PrivateUse1 backend renamed, with a Python device guard
# (which autograd asks for streams; a CPU-only build has no CUDA guard, so fake "cuda" tensors
# cannot enter autograd) and no-op streams and events. FakeTensorMode runs its ops as it runs
# CUDA's (on meta); FSDPMemTracker counts its tensors under their own device, apart from the
# host's.
FAKE_DEVICE = "gpu"


def fake_device() -> str:
    """Register the fake accelerator `FAKE_DEVICE` once per process; return its name. Only
    before the process's first backward: autograd sizes its per-device ready queues then, and
    a later device's backward fails an internal assert (tests run it in a fresh interpreter)."""
    if torch._C._get_privateuse1_backend_name() == FAKE_DEVICE:
        return FAKE_DEVICE
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    class Event:
        def __init__(self, *args, **kwargs) -> None:
            pass

        def record(self, *args, **kwargs):
            return self

        def wait(self, *args, **kwargs) -> None:
            pass

        def synchronize(self) -> None:
            pass

        def query(self) -> bool:
            return True

    class Stream:
        def __init__(self, *args, **kwargs) -> None:
            pass

        def wait_stream(self, *args) -> None:
            pass

        def wait_event(self, *args) -> None:
            pass

        def record_event(self, event=None):
            return event or Event()

        def synchronize(self) -> None:
            pass

    current = Stream()

    class Module:  # the device handle FSDP2 asks (torch.<device>)
        pass

    for name, fn in dict(
            Stream=Stream, Event=Event, current_device=lambda: 0, device_count=lambda: 1024,
            is_available=lambda: True, is_initialized=lambda: True, set_device=lambda *a: None,
            current_stream=lambda *a: current, stream=lambda s: contextlib.nullcontext(),
            synchronize=lambda *a: None, _is_in_bad_fork=lambda: False,
            manual_seed_all=lambda *a: None,
            get_amp_supported_dtype=lambda: [torch.bfloat16, torch.float16]).items():
        setattr(Module, name, staticmethod(fn) if not isinstance(fn, type) else fn)
    _setup_privateuseone_for_python_backend(FAKE_DEVICE, backend_module=Module)
    _AUTOCAST.append(_fake_device_autocast())
    return FAKE_DEVICE


_AUTOCAST: list = []  # the fake accelerator's autocast kernels, kept registered


def _fake_device_autocast():
    """torch.autocast on the fake accelerator as on the CPU for the reference model's ops:
    every op passes through unchanged (its parameters are bf16 already under
    MixedPrecisionPolicy), except the cross entropy, which CPU (and CUDA) autocast runs in
    fp32 (aten::cross_entropy_loss is on both fp32 lists)."""
    key = torch._C.DispatchKey.AutocastPrivateUse1
    everything = torch.library.Library("_", "IMPL")
    everything.fallback(torch.library.fallthrough_kernel, dispatch_key="AutocastPrivateUse1")
    lib = torch.library.Library("aten", "IMPL")

    def cross_entropy(input, target, weight=None, reduction=1, ignore_index=-100,
                      label_smoothing=0.0):
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key)):
            return torch.ops.aten.cross_entropy_loss(
                input.float() if input.is_floating_point() else input, target, weight,
                reduction, ignore_index, label_smoothing)

    lib.impl("cross_entropy_loss", cross_entropy, "AutocastPrivateUse1")
    return everything, lib


def cpu_offloaded(setup: TrainingSetup) -> bool:
    """Whether the layout runs FSDP2's CPUOffloadPolicy (`--offload-param cpu`)."""
    from gptcalc.memory.engines.fsdp2 import cpu_offload

    return setup.engine == "fsdp2" and cpu_offload(setup)


def _meshes(setup: TrainingSetup) -> dict[str, Any]:
    """The device meshes and process groups of the layout, made before any fake tensor mode
    (a mesh is made of real rank tensors)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if cpu_offloaded(setup):  # data parallel alone, on the fake accelerator
        return {"dp": DeviceMesh(fake_device(), torch.arange(setup.dp), mesh_dim_names=("dp",))}

    if setup.pp > 1 and setup.dp > 1:  # FSDP2 inside each stage: a (pp, dp) mesh
        mesh = init_device_mesh("cpu", (setup.pp, setup.dp), mesh_dim_names=("pp", "dp"))
        return {"pp": mesh["pp"], "dp": mesh["dp"]}
    if setup.pp > 1:
        return {"tied": dist.new_group([0, setup.pp - 1])}
    if setup.dp > 1 and setup.tp > 1:
        mesh = init_device_mesh("cpu", (setup.dp, setup.tp), mesh_dim_names=("dp", "tp"))
        return {"dp": mesh["dp"], "tp": mesh["tp"]}
    if setup.tp > 1:
        return {"tp": init_device_mesh("cpu", (setup.tp,), mesh_dim_names=("tp",))}
    return {"dp": init_device_mesh("cpu", (setup.dp,), mesh_dim_names=("dp",))}


def _rank_step(spec: dict, rank: int, world: int, fake: bool,
               mode=contextlib.nullcontext) -> RankResult:
    start = time.perf_counter()
    setup = spec["setup"]
    engine = engine_of(setup)
    coords = coords_of(rank, setup)
    torch.manual_seed(0)
    meshes = _meshes(setup)
    with mode():
        return _run_rank(spec, rank, world, fake, meshes, engine, coords, start)


def _run_rank(spec, rank, world, fake, meshes, engine, coords, start) -> RankResult:
    cfg, wl, setup, impl = spec["cfg"], spec["workload"], spec["setup"], spec["impl"]
    if engine == "deepspeed":
        from .deepspeed_twin import DeepSpeedRank as runner_class
    elif engine == "fsdp1":
        from .fsdp1_twin import FSDP1Rank as runner_class
    else:
        runner_class = {"fsdp2": _FSDP2, "zero1": _Zero1, "ddp": _DDP, "tp": _TensorParallel,
                        "pipeline": _Pipeline}[engine]
    runner = runner_class(cfg, wl, setup, impl, rank, world)
    runner.meshes = meshes
    runner.build()
    runner.step()  # warm-up: the optimizer states exist after it
    live = LiveSaved(runner.tracked_module)
    tracker = runner.tracker()
    with tracker:
        runner.step(live)
    device = getattr(runner, "device_type", "cpu")  # the host's tensors apart, if offloaded
    snap = next(v for k, v in tracker.get_tracker_snapshot("peak").items()
                if getattr(k, "type", str(k)) == device)
    peak = snap["Total"]
    cats = {getattr(k, "value", str(k)): v for k, v in snap.items() if k != "Total" and v}
    weights, grads, opt = runner.states()
    host = runner.host() if hasattr(runner, "host") else {}
    moments = dict(getattr(runner, "moments", {}))
    runner.opt.zero_grad(set_to_none=True)
    kept = -1
    if not fake:  # a mesh's rank tensor is real: not to be touched under FakeTensorMode
        meshes = [m.mesh for m in runner.meshes.values() if hasattr(m, "mesh")]
        kept = resident_bytes(runner.tracked_module, (runner.idx, runner.targets, *meshes))
    counter = _flop_counter()
    with counter:
        runner.step(flops=True)
    return RankResult(rank=rank, coords=coords, weights=weights, gradients=grads,
                      optimizer=opt, saved=live.peak, peak=peak,
                      peak_tool=type(tracker).__name__ + (" on FakeTensorMode" if fake else ""),
                      flops=counter.get_total_flops(),
                      seconds=round(time.perf_counter() - start, 3), peak_categories=cats,
                      resident=kept, host=host, moments=moments)


def resident_bytes(model: torch.nn.Module, inputs) -> int:
    """Bytes of every tensor storage alive in this process between two steps (after the
    optimizer step and `zero_grad(set_to_none=True)`), found by walking the garbage
    collector's objects; the model's buffers (a causal mask, rotary tables) and `inputs` (the
    batch, the device meshes' rank tensors) are left out: they are the test's, not the
    engine's."""
    import gc

    gc.collect()
    skip = {_storage_key(t) for t in (*model.buffers(), *inputs)}
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and not obj.is_meta:
            loc = _local(obj)
            key = _storage_key(loc)
            if key not in skip:
                seen.setdefault(key, loc.untyped_storage().nbytes())
    return sum(seen.values())


class _FSDP2(_Engine):
    def build(self) -> None:
        from torch.distributed.fsdp import fully_shard

        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

        s = self.setup
        reshard = s.zero == 3
        if s.tp > 1:
            _parallelize(self.model, self.meshes["tp"], s.sp)
        _recompute(self.model, s)
        dp_mesh = self.meshes["dp"]
        # mode mixed: torchtitan's policy, bf16 compute over fp32 shards, fp32 reduction
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if (
            s.mode == "mixed") else MixedPrecisionPolicy()
        kw: dict[str, Any] = {"reshard_after_forward": reshard, "mp_policy": mp}
        if cpu_offloaded(s):
            self._to_fake_device()
            # pin_memory=False: FakeTensorMode has no aten._pin_memory ("NYI", torch 2.13);
            # pinned or not, the host holds the same bytes
            kw["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
        for block in self.model.blocks:
            fully_shard(block, mesh=dp_mesh, **kw)
        fully_shard(self.model.module, mesh=dp_mesh, **kw)
        self.loss_parallel = s.tp > 1
        self.opt = self.optimizer(self.model.module.parameters())

    def context(self):
        stack = contextlib.ExitStack()
        if self.loss_parallel:
            from torch.distributed.tensor.parallel import loss_parallel
            stack.enter_context(loss_parallel())
        if self.setup.mode == "mixed":
            # the cross entropy in fp32 on the bf16 logits, as the reference model's mixed
            # mode and torchtitan's loss compute it; with bf16 parameters autocast casts
            # nothing else
            stack.enter_context(torch.autocast(self.device_type, dtype=torch.bfloat16))
        return stack

    @property
    def device_type(self) -> str:
        """The device the step computes on: the fake accelerator under CPU offload."""
        return FAKE_DEVICE if cpu_offloaded(self.setup) else "cpu"

    def _to_fake_device(self) -> None:
        """The model, its buffers and the batch onto the fake accelerator (a CPU tensor's
        storage cannot be set to another backend's: the module's tensors are replaced)."""
        device = fake_device()
        moved: dict[int, torch.Tensor] = {}  # a tied weight stays one parameter
        for module in self.model.module.modules():
            for table, make in ((module._parameters, lambda t: torch.nn.Parameter(
                    t.detach().to(device), requires_grad=t.requires_grad)),
                                (module._buffers, lambda t: t.to(device))):
                for name, t in table.items():
                    if t is not None:
                        table[name] = moved.setdefault(id(t), make(t))
        self.idx, self.targets = self.idx.to(device), self.targets.to(device)

    def states(self) -> tuple[int, int, int]:
        """The states on the device (under CPU offload none: `host`)."""
        if not cpu_offloaded(self.setup):
            return super().states()
        params = list(self.tracked_module.parameters())

        def device(ts):
            return storage_bytes(t for t in ts if t is not None and _local(t).device.type != "cpu")

        return device(params), device(p.grad for p in params), device(self.opt_state())

    def host(self) -> dict[str, int]:
        """The states on the host under CPU offload, by gptcalc's lines (`gptcalc.memory.
        engines.fsdp2.fsdp2_host`); {} without it."""
        from gptcalc.memory.engines import fsdp2

        if not cpu_offloaded(self.setup):
            return {}
        params = list(self.tracked_module.parameters())

        def host(ts):
            return storage_bytes(t for t in ts if t is not None and _local(t).device.type == "cpu")

        return {fsdp2.HOST_PARAMETERS: host(params),
                fsdp2.HOST_GRADIENTS: host(p.grad for p in params),
                fsdp2.HOST_OPTIMIZER: host(self.opt_state())}

    def tracker(self):
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        t = FSDPMemTracker(self.model.module, self.opt)
        t.track_inputs((self.idx, self.targets))
        return t


class _Zero1(_Engine):
    def build(self) -> None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        trainable = [p for p in self.model.module.parameters() if p.requires_grad]
        self.opt = ZeroRedundancyOptimizer(trainable,
                                           optimizer_class=torch.optim.AdamW, lr=1e-4,
                                           weight_decay=0.1)

    def tracker(self):
        from .memory import _global_peak_tracker

        t = _global_peak_tracker()
        t.track_external(self.tracked_module, self.opt.optim)
        return t

    def after_backward(self) -> None:
        import torch.distributed as dist

        for p in self.model.module.parameters():  # DDP's all-reduce, in place
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(self.world)

    def opt_state(self):
        return [v for s in self.opt.optim.state.values() for v in s.values()]


class _DDP(_Engine):
    """Plain data parallel: DistributedDataParallel with PyTorch's defaults (bucket_cap_mb 25,
    the first bucket 1 MB, gradient_as_bucket_view=False: the reducer's flat bucket buffers are
    allocated at construction and hold a second copy of every gradient beside `.grad`)."""

    def build(self) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.nn.parallel import DistributedDataParallel

        self.buckets: dict[int, torch.Tensor] = {}

        def hook(state, bucket):  # PyTorch's own all-reduce hook, the buffers recorded
            buf = bucket.buffer()
            self.buckets.setdefault(_storage_key(buf), buf)
            return allreduce_hook(state, bucket)

        self.ddp = DistributedDataParallel(self.model.module)
        self.ddp.register_comm_hook(None, hook)
        self.model.module = self.ddp
        self.opt = self.optimizer(self.ddp.parameters())

    def step(self, live: LiveSaved | None = None, flops: bool = False) -> None:
        # DDP rebuilds its buckets once, in the second forward, in the order the first backward
        # made the gradients: the warm-up runs two steps so that the tracked one is steady
        warm_up = not self.buckets and live is None and not flops
        for _ in range(2 if warm_up else 1):
            self.buckets = {}  # the buffers of this step's backward only
            super().step(live, flops)

    def tracker(self):
        # the buckets are made by the reducer before the tracker exists: named so it counts them
        t = super().tracker()
        t.track_external(*self.buckets.values())
        return t


class _TensorParallel(_Engine):
    def build(self) -> None:
        _parallelize(self.model, self.meshes["tp"], self.setup.sp)
        _recompute(self.model, self.setup)
        self.opt = self.optimizer(self.model.module.parameters())

    def context(self):
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()


def _recompute(model: _Model, setup: TrainingSetup) -> None:
    """Full activation checkpointing of every block after tensor parallel and before FSDP2, in
    torchtitan's order (parallelize_llama: apply_tp, apply_ac, apply_fsdp): each block's forward
    under non-reentrant torch.utils.checkpoint (reference_model.memory.apply_recompute)."""
    if setup.recompute == "none":
        return
    if setup.recompute != "full" or model.impl != "reference":
        raise ConfigError("recompute", "the distributed twin recomputes whole blocks of the "
                                       "reference model only (--recompute full)")
    from .memory import apply_recompute

    apply_recompute(model.module, "full")


def _regroup_fused_qkv(linear: torch.nn.Linear, widths: list[int], tp: int) -> None:
    """Reorder a fused q/k/v Linear's output rows so that each of `tp` contiguous row chunks
    holds its own q, k and v heads, as Megatron-LM stores its fused QKV: column-parallel
    sharding then gives every rank [q_r; k_r; v_r]."""
    with torch.no_grad():
        for name in ("weight", "bias"):
            p = getattr(linear, name)
            if p is None:
                continue
            parts = [c.chunk(tp, dim=0) for c in p.split(widths, dim=0)]
            p.copy_(torch.cat([parts[j][r] for r in range(tp) for j in range(3)], dim=0))


def _parallelize(model: _Model, mesh, sp: bool) -> None:
    """Megatron's tensor-parallel layout on the reference model (Shoeybi et al. 2019), with
    sequence parallel norms (Korthikanti et al. 2022) when `sp`."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    gpt, tp = model.module, mesh.size()
    cfg = gpt.config
    seq = Shard(1) if sp else Replicate()
    learned = cfg.pos_embedding == "learned"
    plan: dict[str, Any] = {
        # vocabulary-parallel embedding; with learned positions the sum is scattered to the
        # sequence shards at the first block (Megatron-LM adds positions before its scatter)
        "transformer.wte": RowwiseParallel(input_layouts=Replicate(),
                                           output_layouts=Replicate() if learned else seq),
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1),
                                   use_local_output=False),
    }
    if cfg.final_norm and sp:
        plan["transformer.ln_f"] = SequenceParallel()
    if learned and sp:
        plan["transformer.h.0"] = PrepareModuleInput(input_layouts=(Replicate(), None),
                                                     desired_input_layouts=(seq, None),
                                                     use_local_output=True)
    parallelize_module(gpt, mesh, plan)
    for block in gpt.transformer.h:
        attn = block.attn
        if attn.layout == "fused":
            hd = attn.head_dim
            _regroup_fused_qkv(attn.c_attn, [attn.n_head * hd, attn.n_kv_head * hd,
                                             attn.n_kv_head * hd], tp)
            qkv = {"attn.c_attn": ColwiseParallel()}
        else:
            qkv = {f"attn.{n}_proj": ColwiseParallel() for n in "qkv"}
        layer: dict[str, Any] = {
            **qkv,
            "attn": PrepareModuleInput(input_layouts=(seq, None),
                                       desired_input_layouts=(Replicate(), None)),
            "attn.c_proj": RowwiseParallel(output_layouts=seq),
            "mlp": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "mlp.c_fc": ColwiseParallel(),
            "mlp.c_proj": RowwiseParallel(output_layouts=seq),
        }
        if hasattr(block.mlp, "c_gate"):
            layer["mlp.c_gate"] = ColwiseParallel()
        if sp:
            layer.update({n: SequenceParallel() for n in ("ln_1", "ln_2") if hasattr(block, n)})
        parallelize_module(block, mesh, layer)
        attn.n_head //= tp  # the heads this rank computes (views use the local count)
        attn.n_kv_head //= tp
    if cfg.tie_embeddings:  # both shard V rows (Shard(0)): one parameter again
        gpt.lm_head.weight = gpt.transformer.wte.weight


class _Pipeline(_Engine):
    def build(self) -> None:
        from torch.distributed.pipelining import PipelineStage

        from gptcalc.schedules import chunk_layers, micro_batches, rank_chunks

        s, rank = self.setup, self.coords["pp"]
        self.n_micro = micro_batches(self.wl, s)
        self.idx, self.targets = _batch(self.cfg, self.wl.batch_size * self.n_micro,
                                        self.wl.seq_len, seed=1000)
        # the model's chunks as gptcalc.schedules splits them (torchtitan's split when the
        # chunks do not divide the layers); this rank runs chunks rank, rank + pp, ...
        split = chunk_layers(self.cfg.n_layer, s.pp * s.pp_virtual)
        chunks = [_StageModule(self.model.module, sum(split[:c]), sum(split[:c + 1]),
                               c == 0, c == len(split) - 1) for c in rank_chunks(s, rank)]
        self.stage_module = chunks[0] if len(chunks) == 1 else torch.nn.ModuleList(chunks)
        self.chunks = chunks
        group = None
        if s.dp > 1:  # FSDP2 on every block and on each chunk, over the stage's dp ranks
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
                if s.mode == "mixed" else MixedPrecisionPolicy()
            for m in chunks:
                for block in m.h:
                    fully_shard(block, mesh=self.meshes["dp"], reshard_after_forward=s.zero == 3,
                                mp_policy=mp)
                fully_shard(m, mesh=self.meshes["dp"], reshard_after_forward=s.zero == 3,
                            mp_policy=mp)
            group = self.meshes["pp"].get_group()
        stages = [PipelineStage(m, c, len(split), torch.device("cpu"), group=group)
                  for m, c in zip(chunks, rank_chunks(s, rank))]
        cls = _schedule_class(s.pp_schedule)
        single = s.pp_schedule in ("gpipe", "1f1b")
        self.schedule = cls(stages[0] if single else stages, self.n_micro,
                            loss_fn=_cross_entropy)
        self.opt = self.optimizer(self.stage_module.parameters())
        # a tied head: the last stage holds its own copy of the token embedding and the two
        # stages all-reduce its gradient after backward (Megatron-LM's word-embedding group)
        self.tied_group = self.meshes.get("tied") if self.cfg.tie_embeddings else None
        if self.cfg.tie_embeddings and s.dp > 1:
            raise ConfigError("tie_embeddings", "FSDP2 inside pipeline stages is verified on "
                                                "untied embeddings")

    def after_backward(self) -> None:
        import torch.distributed as dist

        if self.tied_group is not None and self.coords["pp"] in (0, self.setup.pp - 1):
            for m in self.chunks:
                if m.first or m.last:
                    w = m.wte.weight if m.first else m.lm_head.weight
                    dist.all_reduce(w.grad, group=self.tied_group)

    @property
    def tracked_module(self) -> torch.nn.Module:
        return self.stage_module

    def tracker(self):
        from .memory import _global_peak_tracker_class

        class StepPeakTracker(_global_peak_tracker_class()):
            """The device-wide peak only: MemTracker's per-module statistics refuse a module
            called once per micro-batch (its root-module check), and 1F1B interleaves forwards
            with backwards, which its module hooks would read as recomputation."""

            def _pre_fw_hook(self, *args) -> None:
                pass

            _post_fw_hook = _pre_bw_hook = _post_bw_hook = _pre_fw_hook

        t = StepPeakTracker()
        t.track_external(self.stage_module, self.opt)
        return t

    def step(self, live: LiveSaved | None = None, flops: bool = False) -> None:
        stage, last = self.coords["pp"], self.setup.pp - 1
        self.opt.zero_grad(set_to_none=True)
        with live.hooks() if live else contextlib.nullcontext():
            if stage == 0:
                self.schedule.step(self.idx)
            elif stage == last:
                self.schedule.step(target=self.targets)
            else:
                self.schedule.step()
        self.after_backward()
        if not flops:
            self.opt.step()
        else:
            self.opt.zero_grad(set_to_none=True)


def _cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    import torch.nn.functional as F

    return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def _schedule_class(name: str):
    """torch.distributed.pipelining's schedule of `--pp-schedule` NAME."""
    from torch.distributed.pipelining import (Schedule1F1B, ScheduleGPipe,
                                              ScheduleInterleaved1F1B,
                                              ScheduleInterleavedZeroBubble)

    return {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B,
            "interleaved-1f1b": ScheduleInterleaved1F1B,
            "zero-bubble": ScheduleInterleavedZeroBubble}[name]


class _StageModule(torch.nn.Module):
    """Blocks start..stop of the reference model; the first chunk also embeds (as GPT.forward
    does), the last also applies the final norm and the head."""

    def __init__(self, gpt, start: int, stop: int, first: bool, last: bool) -> None:
        super().__init__()
        cfg = gpt.config
        self.cfg, self.first, self.last = cfg, first, last
        self.h = torch.nn.ModuleList(gpt.transformer.h[start:stop])
        if self.first:
            self.wte = gpt.transformer.wte
            self.wpe = getattr(gpt.transformer, "wpe", None)
        if self.last:
            self.ln_f = getattr(gpt.transformer, "ln_f", None)
            self.lm_head = gpt.lm_head
            if cfg.tie_embeddings and not first:  # the last stage's own copy of the embedding
                self.lm_head.weight = torch.nn.Parameter(gpt.transformer.wte.weight.detach()
                                                         .clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from .model import dropout

        cfg = self.cfg
        if self.first:
            S = x.shape[1]
            x = self.wte(x)
            if self.wpe is not None:
                x = x + self.wpe(torch.arange(S, device=x.device) + cfg.pos_offset)
            if cfg.embd_dropout:
                x = dropout(x, cfg.dropout, self.training)
        for block in self.h:
            x = block(x)
        if self.last:
            if self.ln_f is not None:
                x = self.ln_f(x)
            x = self.lm_head(x)
        return x


__all__ = ["ENGINES", "MAX_RANKS", "RankResult", "check_layout", "coords_of", "engine_of",
           "free_port", "run_each", "run_layout", "run_layouts", "storage_bytes"]
