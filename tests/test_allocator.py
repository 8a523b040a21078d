"""The caching-allocator simulator (gptcalc.memory.allocator) against the rules of
c10/cuda/CUDACachingAllocator.cpp: each expected value is worked out by hand from those rules,
the reasoning in the comment above it."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gptcalc.memory.allocator import (CachingAllocator, allocation_size, round_size, simulate)

MiB = 1 << 20
KiB = 1 << 10


def reserved(events, expandable=False) -> int:
    return simulate(events, expandable).reserved


def test_sizes_round_to_512_bytes():
    # round_size: at least kMinBlockSize, else up to the next multiple of 512
    assert [round_size(n) for n in (1, 512, 513, 1000, 1024)] == [512, 512, 1024, 1024, 1024]


def test_segment_sizes():
    # get_allocation_size: <= 1 MiB -> 2 MiB; (1 MiB, 10 MiB) -> 20 MiB; else up to 2 MiB
    assert allocation_size(MiB) == 2 * MiB
    assert allocation_size(MiB + 512) == 20 * MiB
    assert allocation_size(10 * MiB - 512) == 20 * MiB
    assert allocation_size(10 * MiB) == 10 * MiB
    assert allocation_size(11 * MiB) == 12 * MiB


def test_one_4_mib_tensor_reserves_a_20_mib_segment():
    # 4 MiB is a large request under kMinLargeAlloc: a kLargeBuffer segment
    assert reserved([("alloc", "a", 4 * MiB)]) == 20 * MiB


def test_two_6_mib_tensors_share_one_20_mib_segment():
    # the first splits the 20 MiB segment (14 MiB remain > 1 MiB); the second fits the rest
    assert reserved([("alloc", "a", 6 * MiB), ("alloc", "b", 6 * MiB)]) == 20 * MiB


def test_11_mib_reserves_12_mib():
    # 11 MiB >= kMinLargeAlloc: its own segment, rounded up to kRoundLarge (2 MiB)
    assert reserved([("alloc", "a", 11 * MiB)]) == 12 * MiB


def test_a_larger_request_after_a_free_takes_a_new_segment():
    # the freed 12 MiB segment is too small for 14 MiB: a second segment of 14 MiB
    events = [("alloc", "a", 12 * MiB), ("free", "a"), ("alloc", "b", 14 * MiB)]
    assert reserved(events) == 26 * MiB
    # a smaller one reuses it: 10 MiB fits the 12 MiB block; 2 MiB remain, > 1 MiB, so it splits
    alloc = simulate([("alloc", "a", 12 * MiB), ("free", "a"), ("alloc", "b", 10 * MiB)])
    assert alloc.reserved == 12 * MiB and alloc.allocated == 10 * MiB


def test_a_large_block_splits_only_above_1_mib():
    # 11.5 MiB in a 12 MiB segment leaves 0.5 MiB, not > kSmallSize: the whole block is taken
    alloc = simulate([("alloc", "a", 11 * MiB + 512 * KiB)])
    assert alloc.allocated == 12 * MiB
    # so a second request cannot use those 0.5 MiB (nor could a small one: other pool)
    assert reserved([("alloc", "a", 11 * MiB + 512 * KiB), ("alloc", "b", 2 * MiB)]) == 32 * MiB


def test_freed_neighbours_coalesce():
    # three 6 MiB blocks split one 20 MiB segment (2 MiB left over); freeing the first two
    # merges them into one 12 MiB block, which a 12 MiB request then fits: no new segment
    events = [("alloc", x, 6 * MiB) for x in "abc"] + [("free", "a"), ("free", "b"),
                                                       ("alloc", "d", 12 * MiB)]
    assert reserved(events) == 20 * MiB
    # without the merge (only "a" freed) 12 MiB fits nowhere: a second segment of 12 MiB
    events = [("alloc", x, 6 * MiB) for x in "abc"] + [("free", "a"), ("alloc", "d", 12 * MiB)]
    assert reserved(events) == 32 * MiB


def test_best_fit_takes_the_smallest_free_block():
    # free blocks of 12 and 16 MiB (separate segments); 11 MiB takes the 12 MiB one, so a
    # following 15 MiB fits the 16 MiB one: nothing new is reserved
    events = [("alloc", "a", 12 * MiB), ("alloc", "b", 16 * MiB), ("free", "a"), ("free", "b"),
              ("alloc", "c", 11 * MiB), ("alloc", "d", 15 * MiB)]
    assert reserved(events) == 28 * MiB


def test_small_requests_pack_into_2_mib_segments():
    # 100 KiB requests (multiples of 512): 20 fit one 2 MiB segment (20.48), the 21st opens a
    # second
    assert reserved([("alloc", i, 100 * KiB) for i in range(20)]) == 2 * MiB
    assert reserved([("alloc", i, 100 * KiB) for i in range(21)]) == 4 * MiB
    # exactly 1 MiB is still small: two fill one 2 MiB segment
    assert reserved([("alloc", i, MiB) for i in range(2)]) == 2 * MiB


def test_small_and_large_pools_are_apart():
    # a free 20 MiB large segment does not serve a 512 KiB (small) request
    events = [("alloc", "a", 4 * MiB), ("free", "a"), ("alloc", "b", 512 * KiB)]
    assert reserved(events) == 22 * MiB


def test_zero_bytes_reserve_nothing():
    assert reserved([("alloc", "a", 0), ("free", "a")]) == 0


def test_expandable_segments_map_20_mib_pages_in_the_large_pool():
    # one 30 MiB tensor: the large pool's segment maps ceil(30 / 20) pages of kLargeBuffer
    assert reserved([("alloc", "a", 30 * MiB)], expandable=True) == 40 * MiB
    # small requests map 2 MiB pages of their own segment
    assert reserved([("alloc", "a", 100)], expandable=True) == 2 * MiB


def test_expandable_segments_grow_the_free_end():
    # 30 MiB freed leaves a free 40 MiB block at the end; 50 MiB maps one more 20 MiB page and
    # merges with it: 60 MiB, where the default allocator would hold 30 + 50 = 80 MiB
    events = [("alloc", "a", 30 * MiB), ("free", "a"), ("alloc", "b", 50 * MiB)]
    assert reserved(events, expandable=True) == 60 * MiB
    assert reserved(events) == 80 * MiB


def test_expandable_best_fit_passes_over_the_end():
    # blocks: a 12 | b 12 | c 12 | free 4 (the end of 40 mapped MiB). Free a: a 12 MiB hole.
    # 3 MiB fits the end's 4 MiB and the hole: best fit passes over the end's block and splits
    # the hole (9 MiB left). A 12 MiB request then fits no free block (9, 4): the end grows by
    # one 20 MiB page, 60 MiB. (Taking the end's block for the 3 MiB would have left the hole
    # for the 12 MiB: 40 MiB.)
    events = [("alloc", x, 12 * MiB) for x in "abc"] + [("free", "a"), ("alloc", "d", 3 * MiB),
                                                       ("alloc", "e", 12 * MiB)]
    assert reserved(events, expandable=True) == 60 * MiB


sizes = st.integers(1, 64 * MiB)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), sizes), min_size=1, max_size=40))
def test_reserved_covers_the_live_bytes_and_a_repeat_reserves_nothing_more(ops):
    """Any sequence: the reserved bytes are never below the allocated ones; freeing everything
    and running the same sequence again reuses the cache (the same addresses are free in the
    same order), so reserved does not grow."""
    for expandable in (False, True):
        alloc = CachingAllocator(expandable)
        live: list[int] = []
        for keep, n in ops:
            live.append(alloc.malloc(n))
            if not keep and live:
                alloc.free(live.pop(0))
            assert alloc.reserved >= alloc.allocated
        for h in live:
            alloc.free(h)
        assert alloc.allocated == 0
        first = alloc.reserved
        assert first >= alloc.peak_allocated
        live = []
        for keep, n in ops:
            live.append(alloc.malloc(n))
            if not keep and live:
                alloc.free(live.pop(0))
        assert alloc.reserved == first


def test_a_freed_block_serves_only_its_own_stream():
    # get_free_block finds blocks of the request's stream only: 12 MiB freed on the compute
    # stream is not reused by a 12 MiB request on another stream, which reserves its own
    # segment; on the same stream it is reused
    other = [("alloc", "a", 12 * MiB), ("free", "a"), ("alloc", "b", 12 * MiB, "reduce-scatter")]
    same = [("alloc", "a", 12 * MiB), ("free", "a"), ("alloc", "b", 12 * MiB, "compute")]
    assert reserved(other) == 24 * MiB and reserved(same) == 12 * MiB
    # each stream's pool grows on its own (expandable too); the device reserves their sum
    assert reserved(other, expandable=True) == 2 * reserved(same, expandable=True)


def test_the_device_allocated_peak_spans_its_streams():
    # 6 MiB on each of two streams alive together: 12 MiB allocated at the peak, each stream
    # reserving one 20 MiB segment (a large request under kMinLargeAlloc)
    alloc = simulate([("alloc", "a", 6 * MiB), ("alloc", "b", 6 * MiB, "all-gather"),
                      ("free", "a"), ("free", "b")])
    assert (alloc.peak_allocated, alloc.allocated, alloc.reserved) == (12 * MiB, 0, 40 * MiB)
