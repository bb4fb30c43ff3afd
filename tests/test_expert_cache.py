"""Set-associative expert cache bookkeeping: indexing, each eviction policy by hand, readiness of fills."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from tandem.runtime.expert_cache import CachePolicy, ExpertCache


def done() -> Future[None]:
    f: Future[None] = Future()
    f.set_result(None)
    return f


def fill(cache: ExpertCache, layer: int, expert: int) -> int:
    slot = cache.begin_fill(layer, expert)
    assert slot is not None
    cache.start(slot, done())
    return slot.id


def test_geometry_and_indexing() -> None:
    cache = ExpertCache(layers=[0, 2, 5], ways=2, first_slot=4)  # layers 1, 3, 4 are not covered
    assert cache.indexes == 3 and cache.slots == 6
    assert [cache.covers(x) for x in range(6)] == [True, False, True, False, False, True]
    assert [s.id for s in cache.sets[1]] == [6, 7]  # layer 2 -> index 1 -> slots 6, 7
    assert fill(cache, 2, 9) in (6, 7)
    assert cache.victim(3) is None and cache.begin_fill(3, 0) is None


def access(cache: ExpertCache, seq: list[int]) -> list[bool]:
    """Replay experts of layer 0: a miss fills (evicting per policy). Returns hit/miss per access."""
    hits = []
    for e in seq:
        cache.observe(0, e, 1)
        hit = cache.lookup(0, e) is not None
        if not hit:
            fill(cache, 0, e)
        hits.append(hit)
    return hits


def resident(cache: ExpertCache) -> set[int]:
    return {e for _, e in cache.resident()}


# Worked by hand, 3 ways, sequence 1 2 3 1 4 1 2 5:
#   LRU : misses 1 2 3; hit 1; 4 evicts 2 (LRU order 2,3,1); hit 1; 2 evicts 3; 5 evicts 4      -> {1, 2, 5}
#   FIFO: misses 1 2 3; hit 1; 4 evicts 1 (oldest); miss 1 evicts 2; miss 2 evicts 3; 5 evicts 4 -> {1, 2, 5}
#   LFU : misses 1 2 3; hit 1 (1 use); 4 evicts 2 (0 uses, older than 3); hit 1; 2 evicts 3 (0 uses, older
#         than 4); 5 evicts 4 (0 uses, older than 2) -> {1, 2, 5}
CASES = {
    CachePolicy.LRU: ([False, False, False, True, False, True, False, False], {1, 2, 5}),
    CachePolicy.FIFO: ([False, False, False, True, False, False, False, False], {1, 2, 5}),
    CachePolicy.LFU: ([False, False, False, True, False, True, False, False], {1, 2, 5}),
}


@pytest.mark.parametrize("policy", list(CASES))
def test_policies_against_hand_worked_sequence(policy: CachePolicy) -> None:
    cache = ExpertCache(layers=[0], ways=3, policy=policy)
    hits, final = CASES[policy]
    assert access(cache, [1, 2, 3, 1, 4, 1, 2, 5]) == hits
    assert resident(cache) == final


def test_lru_and_lfu_differ_where_they_should() -> None:
    # 1 is used three times early, then 2 and 3 recently; a new expert evicts 1 under LRU, not under LFU.
    seq = [1, 1, 1, 2, 3, 4]
    lru, lfu = ExpertCache([0], 3, CachePolicy.LRU), ExpertCache([0], 3, CachePolicy.LFU)
    access(lru, seq)
    access(lfu, seq)
    assert resident(lru) == {2, 3, 4}
    assert resident(lfu) == {1, 3, 4}


def test_trace_policy_keeps_what_this_request_uses_most() -> None:
    cache = ExpertCache([0], 2, CachePolicy.TRACE)
    for e, n in [(7, 50), (8, 1)]:  # the request so far: expert 7 heavily, 8 barely
        cache.observe(0, e, n)
    fill(cache, 0, 7)
    fill(cache, 0, 8)
    cache.lookup(0, 7)
    cache.lookup(0, 8)  # 8 is now most recent, yet the request counts make it the victim
    assert cache.victim(0).key == (0, 8)
    cache.new_request()
    assert cache.request_counts == {}


def test_slot_is_not_a_hit_until_its_copy_completes() -> None:
    cache = ExpertCache([0], 2)
    slot = cache.begin_fill(0, 3)
    pending: Future[None] = Future()
    cache.start(slot, pending)
    assert cache.lookup(0, 3) is None  # in flight: a miss, never the half-copied slot
    assert cache.victim(0) is not slot  # and never evicted while filling
    pending.set_result(None)
    assert cache.lookup(0, 3) is slot


def test_copy_in_flight_does_not_block_resident_hits() -> None:
    cache = ExpertCache([0], 2)
    fill(cache, 0, 1)
    slot = cache.begin_fill(0, 2)
    cache.start(slot, Future())  # never completes
    for _ in range(3):
        assert cache.lookup(0, 1) is not None  # returns at once
    assert cache.inflight == 1


def test_failed_copy_surfaces_on_the_main_thread() -> None:
    cache = ExpertCache([0], 1)
    slot = cache.begin_fill(0, 0)
    bad: Future[None] = Future()
    bad.set_exception(RuntimeError("copy failed"))
    cache.start(slot, bad)
    with pytest.raises(RuntimeError, match="copy failed"):
        cache.lookup(0, 0)
    assert cache.resident() == [] and cache.lookup(0, 0) is None  # the half-written slot is never a hit


def test_keep_protects_experts_in_use() -> None:
    cache = ExpertCache([0], 2, CachePolicy.FIFO)
    fill(cache, 0, 1)
    fill(cache, 0, 2)
    assert cache.victim(0).key == (0, 1)
    assert cache.victim(0, keep=frozenset({(0, 1)})).key == (0, 2)
    assert cache.victim(0, keep=frozenset({(0, 1), (0, 2)})) is None
