"""Bookkeeping of accelerator expert slots: static placement plus an N-index × M-way set-associative cache.

Pure data structures, no tensors: which (layer, expert) sits in which slot, which slot a miss evicts,
and whether a slot's copy has completed. The cache covers the first N MoE layers, one index each
(collaborative-inference §III-B); layers beyond are served from the CPU. A slot being filled is not a
hit until `ready` — it becomes ready only when its copy's future is observed done.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass, field
from enum import StrEnum

Key = tuple[int, int]  # (layer, expert)
DEFAULT_INFLIGHT = 4  # background expert copies in flight at most, unless a load says otherwise
CLAIMED: Future[None] = Future()  # a slot's copy between `begin_fill` and `start`: never done


class CachePolicy(StrEnum):
    LRU = "lru"
    FIFO = "fifo"
    LFU = "lfu"
    TRACE = "trace"  # MoE-Infinity: evict the expert least activated by the current request


@dataclass
class Slot:
    id: int  # index into the accelerator's slot buffers
    key: Key | None = None
    copy: Future[None] | None = None  # in flight while not None
    inserted: int = 0
    last_used: int = 0
    uses: int = 0
    prefetched: bool = False  # filled ahead of its router's asking (runtime/prefetch.py), not for a miss

    @property
    def ready(self) -> bool:
        return self.key is not None and self.copy is None


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    fills: int = 0
    evictions: int = 0
    skipped_fills: int = 0  # misses not post-fetched because the copy cap was reached
    prefetches: int = 0  # fills ahead of a router's asking
    prefetch_used: int = 0  # of them, asked for before they were evicted
    prefetch_wasted: int = 0  # of them, evicted unused


@dataclass
class ExpertCache:
    layers: list[int]  # covered MoE layers; len(layers) = N indexes
    ways: int
    policy: CachePolicy = CachePolicy.LRU
    max_inflight: int = DEFAULT_INFLIGHT
    first_slot: int = 0  # slot ids [first_slot, first_slot + indexes*ways)
    stats: CacheStats = field(default_factory=CacheStats)

    def __post_init__(self) -> None:
        self.index_of = {layer: i for i, layer in enumerate(self.layers)}
        self.sets = [[Slot(self.first_slot + i * self.ways + w) for w in range(self.ways)] for i in range(self.indexes)]
        self.request_counts: Counter[Key] = Counter()
        self._clock = 0
        self._filling: list[Slot] = []  # slots whose copy is in flight

    @property
    def indexes(self) -> int:
        return len(self.layers)

    @property
    def slots(self) -> int:
        return self.indexes * self.ways

    def covers(self, layer: int) -> bool:
        return layer in self.index_of and self.ways > 0

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def new_request(self) -> None:
        self.request_counts.clear()

    def observe(self, layer: int, expert: int, tokens: int) -> None:
        """Activation counts of the current request (drive the TRACE policy)."""
        self.request_counts[(layer, expert)] += tokens

    def find(self, layer: int, expert: int) -> Slot | None:
        if not self.covers(layer):
            return None
        return next((s for s in self.sets[self.index_of[layer]] if s.key == (layer, expert)), None)

    def lookup(self, layer: int, expert: int) -> Slot | None:
        """The slot holding a ready copy of the expert (a hit, recorded), else None (a miss, recorded)."""
        self.poll()
        slot = self.find(layer, expert)
        if slot is not None and slot.ready:
            self._use(slot)
            self.stats.hits += 1
            return slot
        self.stats.misses += 1
        return None

    def _use(self, slot: Slot) -> None:
        if slot.prefetched and slot.uses == 0:
            self.stats.prefetch_used += 1
        slot.last_used = self._tick()
        slot.uses += 1

    def arriving(self, layer: int, expert: int) -> Slot | None:
        """The slot whose copy of the expert is under way (a prefetch or post-fetch not landed yet), taken as used:
        a kernel can wait for that copy rather than make another."""
        slot = self.find(layer, expert)
        if slot is None or slot.copy is None or slot.copy is CLAIMED:
            return None
        self._use(slot)
        return slot

    def poll(self) -> None:
        """Mark slots whose copies have completed as ready."""
        for s in [s for s in self._filling if s.copy is not None and s.copy.done()]:
            self._filling.remove(s)
            copy, s.copy = s.copy, None
            if copy.exception() is not None:
                s.key = None  # the slot holds garbage: empty it, then re-raise on the main thread
                copy.result()

    @property
    def inflight(self) -> int:
        self.poll()
        return len(self._filling)

    def victim(self, layer: int, keep: frozenset[Key] = frozenset()) -> Slot | None:
        """The slot a new expert of `layer` would replace: an empty one first, never one in flight or kept."""
        if not self.covers(layer):
            return None
        self.poll()
        candidates = [s for s in self.sets[self.index_of[layer]] if s.copy is None and s.key not in keep]
        empty = [s for s in candidates if s.key is None]
        if empty:
            return empty[0]
        if not candidates:
            return None
        if self.policy is CachePolicy.FIFO:
            return min(candidates, key=lambda s: s.inserted)
        if self.policy is CachePolicy.LFU:
            return min(candidates, key=lambda s: (s.uses, s.last_used))
        if self.policy is CachePolicy.TRACE:
            return min(candidates, key=lambda s: (self.request_counts[s.key], s.last_used))  # type: ignore[index]
        return min(candidates, key=lambda s: s.last_used)

    def begin_fill(self, layer: int, expert: int, keep: frozenset[Key] = frozenset(),
                   prefetch: bool = False) -> Slot | None:
        """Claim a slot for (layer, expert); the caller starts the copy and hands its future to `start`, or gives the
        slot back with `cancel`. Until then the slot is neither ready (it still holds the evicted expert's weights)
        nor a victim. `prefetch`: filled ahead of its router (counted apart, and whether it was used)."""
        if self.find(layer, expert) is not None:
            return None
        slot = self.victim(layer, keep)
        if slot is None:
            return None
        if slot.key is not None:
            self.stats.evictions += 1
            if slot.prefetched and slot.uses == 0:
                self.stats.prefetch_wasted += 1
        slot.key, slot.copy = (layer, expert), CLAIMED
        slot.inserted = slot.last_used = self._tick()
        slot.uses = 0
        slot.prefetched = prefetch
        self.stats.fills += 1
        self.stats.prefetches += prefetch
        return slot

    def start(self, slot: Slot, copy: Future[None]) -> None:
        slot.copy = copy
        self._filling.append(slot)

    def cancel(self, slot: Slot) -> None:
        """A claimed slot whose copy never started: empty again (its old weights are no expert's now)."""
        if slot.copy is CLAIMED:
            slot.key, slot.copy = None, None

    def resident(self) -> list[Key]:
        self.poll()
        return [s.key for ways in self.sets for s in ways if s.ready]  # type: ignore[misc]

    def wait_all(self) -> None:
        for s in self._filling:
            if s.copy is not None:
                s.copy.result()
        self.poll()
