"""DDP's gradient all-reduces counted on gloo (2 ranks, a stack of Linears), against
`gptcalc.time.comm.ddp_buckets`: a communication hook sees every bucket DDP all-reduces, with its
bytes. tests/test_time_twin.py runs it at both sides of a bucket boundary."""

from __future__ import annotations

import multiprocessing as mp
import socket


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


if __name__ == "__main__":
    print(count_ddp(5, 32, 4 * 32 * 32 * 4))
