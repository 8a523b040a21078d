"""PyTorch's CUDA caching allocator, simulated: the bytes `torch.cuda.memory_reserved()` reads
after a sequence of tensor allocations and frees on one or more streams.

The rules are those of `DeviceCachingAllocator` in c10/cuda/CUDACachingAllocator.cpp
(pytorch/pytorch, the torch 2.x allocator; constants and functions named below as there):

- every request is rounded up to a multiple of 512 B (`kMinBlockSize`, `round_size`);
- requests of at most 1 MiB (`kSmallSize`) use the small pool, larger ones the large pool;
- a request takes the smallest free block of its pool that fits it, the lowest address among
  equal sizes (`get_free_block`: `lower_bound` on (stream, size, ptr));
- with none, a new segment is reserved (`alloc_block`, cudaMalloc) of `get_allocation_size`:
  2 MiB (`kSmallBuffer`) for a small request, 20 MiB (`kLargeBuffer`) for a large one under
  10 MiB (`kMinLargeAlloc`), else the request rounded up to 2 MiB (`kRoundLarge`);
- the block is split when what remains is at least 512 B (small pool) or more than 1 MiB (large
  pool; `should_split`), the allocation keeping the lower address (`alloc_found_block`);
- a freed block merges with free neighbours of its segment (`free_block`, `try_merge_blocks`).

Streams: a block belongs to the stream it was allocated on, and a free block is found only
for a request on that stream (`BlockComparatorSize` orders by stream first, and
`get_free_block` rejects a block of another stream), so each stream's cached blocks are a pool
of their own; expandable segments are per stream too (`find_expandable_block`). `simulate`
keeps one `CachingAllocator` per stream; the device reserves their sum.

Defaults assumed: `max_split_size` unlimited, no `garbage_collection_threshold`, no
`roundup_power2_divisions`, no `empty_cache()` and no out-of-memory retry, so segments are
never released and the reserved bytes only grow: their peak is their last value.

`expandable_segments:True` (PYTORCH_CUDA_ALLOC_CONF): each pool has one segment of reserved
address space that is mapped in pages as it grows (`ExpandableSegment`; pages of
`kSmallBuffer`, 2 MiB, in the small pool and `kLargeBuffer`, 20 MiB, in the large pool, as
`find_expandable_block` builds the segment); a request that no free block fits maps the pages
it needs at the segment's end, merged with a free block there (`try_allocate_expandable_block`),
any block splits when at least 512 B remain, and best fit passes over the free block at the end
while another fits (`get_free_block`'s `expandable_size`).

Pure Python; never imports torch.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# c10/cuda/CUDACachingAllocator.cpp
MIN_BLOCK_SIZE = 512  # kMinBlockSize: all sizes are rounded to at least 512 bytes
SMALL_SIZE = 1 << 20  # kSmallSize: the largest "small" allocation, 1 MiB
SMALL_BUFFER = 2 << 20  # kSmallBuffer: small allocations are packed in 2 MiB segments
MIN_LARGE_ALLOC = 10 << 20  # kMinLargeAlloc: requests under 10 MiB take a 20 MiB segment
LARGE_BUFFER = 20 << 20  # kLargeBuffer
ROUND_LARGE = 2 << 20  # kRoundLarge: larger requests are rounded up to 2 MiB


def round_size(nbytes: int) -> int:
    """`round_size`: a request rounded up to a multiple of kMinBlockSize (512 B)."""
    return max(MIN_BLOCK_SIZE, -(-nbytes // MIN_BLOCK_SIZE) * MIN_BLOCK_SIZE)


def allocation_size(nbytes: int) -> int:
    """`get_allocation_size`: the segment reserved for a rounded request no free block fits."""
    if nbytes <= SMALL_SIZE:
        return SMALL_BUFFER
    if nbytes < MIN_LARGE_ALLOC:
        return LARGE_BUFFER
    return -(-nbytes // ROUND_LARGE) * ROUND_LARGE


@dataclass(eq=False, slots=True)
class _Block:
    ptr: int
    size: int
    segment: int
    small: bool
    allocated: bool = False
    prev: _Block | None = None
    next: _Block | None = None


@dataclass
class _Pool:
    small: bool
    free: list[tuple[int, int]] = field(default_factory=list)  # (size, ptr), sorted
    blocks: dict[int, _Block] = field(default_factory=dict)  # free blocks by ptr
    reserved: int = 0
    tail: dict[int, int] = field(default_factory=dict)  # expandable: segment -> mapped end
    page: int = 0  # expandable: the mapping granularity
    last: _Block | None = None  # expandable: the block that ends the mapped pages


class CachingAllocator:
    """The caching allocator's bookkeeping on one device and one stream. `malloc` returns a
    handle that `free` takes back; `reserved` and `allocated` are in bytes, with their peaks.
    """

    def __init__(self, expandable: bool = False) -> None:
        self.expandable = expandable
        self.pools = {True: _Pool(True, page=SMALL_BUFFER), False: _Pool(False, page=LARGE_BUFFER)}
        self._live: dict[int, _Block] = {}
        self._next_handle = 0
        self._next_address = 0
        self.allocated = self.peak_allocated = 0

    @property
    def reserved(self) -> int:
        return sum(p.reserved for p in self.pools.values())

    # -- the allocator's operations --------------------------------------------------------

    def malloc(self, nbytes: int) -> int:
        """Allocate `nbytes` (rounded as `round_size`); returns a handle for `free`. Zero bytes
        allocate nothing (CUDACachingAllocator's `malloc` returns nullptr), handle -1."""
        if nbytes <= 0:
            return -1
        size = round_size(nbytes)
        pool = self.pools[size <= SMALL_SIZE]
        block = self._best_fit(pool, size)
        if block is None:
            block = self._grow(pool, size)
        self._take(pool, block)
        if self.expandable or pool.small:
            split = block.size - size >= MIN_BLOCK_SIZE
        else:
            split = block.size - size > SMALL_SIZE
        if split:
            rest = _Block(block.ptr + size, block.size - size, block.segment, block.small,
                          prev=block, next=block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, size
            if pool.last is block:
                pool.last = rest
            self._give(pool, rest)
        block.allocated = True
        handle = self._next_handle
        self._next_handle += 1
        self._live[handle] = block
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return handle

    def free(self, handle: int) -> None:
        """Return a handle's block to its pool, merged with its free neighbours."""
        if handle == -1:
            return
        block = self._live.pop(handle)
        block.allocated = False
        self.allocated -= block.size
        pool = self.pools[block.small]
        for other in (block.prev, block.next):
            if other is not None and not other.allocated:
                self._take(pool, other)
                if other is block.prev:
                    block.ptr, block.prev = other.ptr, other.prev
                    if other.prev is not None:
                        other.prev.next = block
                else:
                    block.next = other.next
                    if other.next is not None:
                        other.next.prev = block
                    if pool.last is other:
                        pool.last = block
                block.size += other.size
        self._give(pool, block)

    # -- internals --------------------------------------------------------------------------

    def _best_fit(self, pool: _Pool, size: int) -> _Block | None:
        i = bisect.bisect_left(pool.free, (size, -1))
        if i == len(pool.free):
            return None
        if self.expandable:  # pass over the free block at a segment's mapped end if another fits
            for _size, ptr in pool.free[i:]:
                b = pool.blocks[ptr]
                if b.ptr + b.size != pool.tail.get(b.segment):
                    return b
        return pool.blocks[pool.free[i][1]]

    def _grow(self, pool: _Pool, size: int) -> _Block:
        """A new segment (cudaMalloc of `allocation_size`), or, expandable, pages mapped at the
        end of the pool's one segment (merged with the free block that ends it)."""
        if not self.expandable:
            return self._new_segment(pool, allocation_size(size))
        if not pool.tail:
            seg = self._new_segment(pool, 0)
            self._take(pool, seg)
            segment, end, last = seg.segment, seg.ptr, None
        else:
            (segment, end), = pool.tail.items()
            last = pool.last
        have = last.size if last is not None and not last.allocated else 0
        grow = -(-(size - have) // pool.page) * pool.page
        pool.tail[segment] = end + grow
        pool.reserved += grow
        if have:
            self._take(pool, last)
            last.size += grow
            self._give(pool, last)
            return last
        block = _Block(end, grow, segment, pool.small, prev=last)
        if last is not None:
            last.next = block
        pool.last = block
        self._give(pool, block)
        return block

    def _new_segment(self, pool: _Pool, nbytes: int) -> _Block:
        segment = self._next_address
        # segments at increasing, far-apart addresses (ties in best fit go to the older one);
        # a segment of 2^48 bytes or more pushes the next one past its end
        self._next_address += ((nbytes >> 48) + 1) << 48
        pool.reserved += nbytes
        if self.expandable:
            pool.tail[segment] = segment
        block = _Block(segment, nbytes, segment, pool.small)
        self._give(pool, block)
        return block

    @staticmethod
    def _give(pool: _Pool, block: _Block) -> None:
        bisect.insort(pool.free, (block.size, block.ptr))
        pool.blocks[block.ptr] = block

    @staticmethod
    def _take(pool: _Pool, block: _Block) -> None:
        del pool.free[bisect.bisect_left(pool.free, (block.size, block.ptr))]
        del pool.blocks[block.ptr]


# the stream an allocation event names by default: the one the step's compute runs on
COMPUTE_STREAM = "compute"


class DeviceAllocator:
    """The caching allocator of one device across its streams: one `CachingAllocator` per
    stream (a stream's freed blocks serve only that stream's requests); `reserved` is their
    sum, `allocated` too, `peak_allocated` the largest sum seen after an allocation."""

    def __init__(self, expandable: bool = False) -> None:
        self.expandable = expandable
        self.streams: dict[str, CachingAllocator] = {}
        self.allocated = self.peak_allocated = 0

    @property
    def reserved(self) -> int:
        return sum(a.reserved for a in self.streams.values())

    def malloc(self, nbytes: int, stream: str = COMPUTE_STREAM) -> tuple[str, int]:
        alloc = self.streams.get(stream)
        if alloc is None:
            alloc = self.streams[stream] = CachingAllocator(self.expandable)
        before = alloc.allocated
        handle = alloc.malloc(nbytes)
        self.allocated += alloc.allocated - before
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        return stream, handle

    def free(self, handle: tuple[str, int]) -> None:
        stream, h = handle
        alloc = self.streams[stream]
        before = alloc.allocated
        alloc.free(h)
        self.allocated -= before - alloc.allocated


def simulate(events, expandable: bool = False) -> DeviceAllocator:
    """Replay `events`, each `("alloc", key, nbytes)` (on the compute stream),
    `("alloc", key, nbytes, stream)` or `("free", key)`, on a fresh device allocator; keys
    name the tensors; other events (marks) are passed over."""
    alloc = DeviceAllocator(expandable)
    handles: dict[object, tuple[str, int]] = {}
    for event in events:
        if event[0] == "alloc":
            stream = event[3] if len(event) > 3 else COMPUTE_STREAM
            handles[event[1]] = alloc.malloc(event[2], stream)
        elif event[0] == "free":
            alloc.free(handles.pop(event[1]))
    return alloc


__all__ = ["COMPUTE_STREAM", "CachingAllocator", "DeviceAllocator", "LARGE_BUFFER",
           "MIN_BLOCK_SIZE", "MIN_LARGE_ALLOC", "ROUND_LARGE", "SMALL_BUFFER", "SMALL_SIZE", "allocation_size",
           "round_size", "simulate"]
