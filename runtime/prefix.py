"""Prefix reuse: which tokens each KV cache row holds, so that a prompt sharing a prefix with them prefills only the
rest (a chat's next turn, a retry, an edit further down, two requests with one system prompt).

A row's keys and values at positions 0..n-1 depend only on the tokens at those positions (attention is causal),
the model and its RoPE tables. So the record is the row's tokens and whether LongRoPE's long tables rotated them;
a pass that writes positions start.. of a row first cuts the record to `start` (what lay beyond is another
sequence's), then, once the pass is done, extends it with the pass's tokens: a pass that fails midway leaves the
row holding no more than its first `start` positions. Every write into a cache goes through `MoEModel.forward` or
`forward_rows`, which keep the record, or `copy_rows`, which copies it: nothing else needs to know.

Sliding windows keep every position (a window only limits what a query reads), attention sinks are weights, and
the latent cache of Multi-head Latent Attention is per position too: the same record serves every attention kind.
Layers with recurrent state (linear attention, state-space and convolution mixers) need their state at the reused
position: their cache (runtime/state.py) holds it at a few positions of a row only, and `reusable` stops at one.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

import torch

if TYPE_CHECKING:
    from tandem.runtime.prefix_disk import DiskPrefixes


class RowState(Protocol):
    """A recurrent mixer's state (runtime/state.py), which holds at one position of a row, not at each: told of
    every pass, and asked where reuse may stop."""

    def rewind(self, r: int, start: int) -> None: ...  # row r is about to read from `start`

    def advance(self, r: int, end: int) -> None: ...  # a pass left row r at `end`

    def usable(self, r: int, n: int) -> int: ...  # the most of row r's first n positions a pass can start after

    def holds(self, r: int, n: int) -> bool: ...  # whether row r's state is that of its first n positions


class HeldTokens:
    """The token ids each row of a KV cache holds: `ids` [batch, context], the first `length[r]` of row r valid,
    rotated with LongRoPE's long tables where `long[r]`. Rows of a view (`row`) share the record's storage; a cache
    with a recurrent state sets `state` (its own, in a view of a row)."""

    def __init__(self, batch: int, context: int) -> None:
        self.ids = torch.zeros(batch, context, dtype=torch.long)
        self.length = torch.zeros(batch, dtype=torch.long)
        self.long = torch.zeros(batch, dtype=torch.bool)
        self.state: RowState | None = None

    def row(self, r: int) -> HeldTokens:
        view = copy.copy(self)
        view.ids, view.length, view.long = self.ids[r : r + 1], self.length[r : r + 1], self.long[r : r + 1]
        return view

    def held(self, r: int) -> int:
        """How many positions row r holds."""
        return int(self.length[r])

    def cut(self, r: int, start: int) -> None:
        """Row r is about to be written from `start`: it holds at most its first `start` positions meanwhile."""
        if int(self.length[r]) > start:
            self.length[r] = start
        if self.state is not None:
            self.state.rewind(r, start)

    def note(self, r: int, start: int, ids: torch.Tensor, long: bool) -> None:
        """A pass wrote `ids` [T] into row r at positions start.. (after `cut(r, start)`). Positions before `start`
        that the record does not hold, or rotated otherwise, make the whole row unknown: each position's keys
        depend on every position before it."""
        if self.state is not None:
            self.state.advance(r, start + ids.numel())
        if start > int(self.length[r]) or (start and bool(self.long[r]) != long):
            self.length[r] = 0
            return
        n = ids.numel()
        self.ids[r, start : start + n] = ids.reshape(-1).to(self.ids.device)
        self.length[r] = start + n
        self.long[r] = long

    def forget(self) -> None:
        """Every row holds nothing reusable (its contents were changed some other way)."""
        self.length.zero_()

    def reusable(self, r: int, prompt: Sequence[int] | torch.Tensor, long: bool) -> int:
        """How many of `prompt`'s first positions row r holds already (rotated as `long` asks), leaving at least the
        last one to run: its logits are the next token's."""
        n = min(int(self.length[r]), len(prompt) - 1)
        if n <= 0 or bool(self.long[r]) != long:
            return 0
        want = prompt[:n] if isinstance(prompt, torch.Tensor) else torch.tensor(list(prompt[:n]), dtype=torch.long)
        n = common_length(self.ids[r, :n], want)
        return n if self.state is None else self.state.usable(r, n)

    def copy_rows(self, pairs: list[tuple[int, int]], length: int) -> None:
        """As the cache's `copy_rows`: row dst takes row src's first `length` positions."""
        for d, s in pairs:
            self.ids[d, :length] = self.ids[s, :length]
            self.length[d] = min(int(self.length[s]), length)
            self.long[d] = self.long[s]


def common_length(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many first ids two equally long id tensors share."""
    same = a == b
    return len(a) if bool(same.all()) else int(same.to(torch.int8).argmin())


class Kept(Protocol):
    """A kept prefix, in RAM or on disk: its ids and LongRoPE's flag."""

    tokens: torch.Tensor
    long: bool


K = TypeVar("K", bound=Kept)


def longest_match(entries: Sequence[K], prompt: torch.Tensor, long: bool, least: int = 1,
                  whole: bool = False) -> tuple[K | None, int]:
    """The entry (rotated as `long` asks) sharing the longest prefix with `prompt`, its last token left to run,
    and that length, if it is at least `least`; else (None, 0). `whole`: only entries the prompt begins with whole
    count (a recurrent state is that of the entry's end)."""
    found, most = None, least - 1
    for e in entries:
        n = min(len(e.tokens), len(prompt) - 1)
        if e.long != long or n <= most or whole and n < len(e.tokens):
            continue
        match = common_length(e.tokens[:n], prompt[:n])
        if match > most and (not whole or match == len(e.tokens)):
            found, most = e, match
    return (found, most) if found is not None else (None, 0)


class PrefixCache(Protocol):
    """What the store asks of a KV cache (`attention.KVCache`, `mla.LatentCache`)."""

    held: HeldTokens

    def snapshot(self, row: int, n: int) -> tuple[torch.Tensor, ...]: ...  # views of row's first n positions

    def restore(self, row: int, parts: tuple[torch.Tensor, ...], n: int) -> None: ...  # parts' first n, back


SAVE_LEAST = 32  # tokens: a shorter prefix is prefilled again faster than it is looked for


@dataclass(eq=False)  # (found by identity: its tensors have no truth value to compare by)
class Saved:
    """A row's first positions, copied out of the cache: their tokens, LongRoPE's flag and the cache's tensors."""

    tokens: torch.Tensor  # [n]
    long: bool
    parts: tuple[torch.Tensor, ...]  # as the cache's `snapshot` gives them
    nbytes: int


class PrefixStore:
    """Rows' prefixes kept in RAM when a prompt is about to overwrite them (a chat switched away from, a server's
    other conversations), up to `budget` bytes, the least recently used dropped first; a later prompt that begins
    as one of them gets it copied back into its row rather than prefilling it again. With `disk`
    (runtime/prefix_disk.py), what it keeps is also written there, and so is a row's prefix when the program is done
    with it (`persist`): a prompt after a restart gets it mapped back from the file."""

    def __init__(self, budget: int, disk: DiskPrefixes | None = None) -> None:
        self.budget, self.disk = budget, disk
        self.entries: list[Saved] = []  # least recently used first
        self.restored = 0  # tokens copied back, since it was made (for tests and benchmarks)
        self.from_disk = 0  # of those, read from disk

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    def save(self, cache: PrefixCache, row: int, keep: int) -> None:
        """Copy row `row`'s prefix out before a pass overwrites it from position `keep` (what it keeps is not
        lost): only when what would be lost is worth keeping, and what a saved entry holds already is not saved
        twice (an entry that is a prefix of this one is replaced by it). With a disk, written there too."""
        n = cache.held.held(row)
        if n - keep < max(SAVE_LEAST, n // 2) or (self.budget <= 0 and self.disk is None):
            return
        state = cache.held.state
        if state is not None and not state.holds(row, n):  # (its recurrent state is elsewhere)
            return
        tokens = cache.held.ids[row, :n].clone()
        long = bool(cache.held.long[row])
        # (an entry holding more holds this too, but a recurrent state only at its own end: then only the same)
        if any(e.long == long and (len(e.tokens) == n if state is not None else len(e.tokens) >= n) and
               bool((e.tokens[:n] == tokens).all()) for e in self.entries):
            return
        parts = tuple(_to_host(p) for p in cache.snapshot(row, n))
        if self.disk is not None:
            self.disk.keep(tokens, long, parts, positioned(cache, parts))
        saved = Saved(tokens, long, parts, sum(p.numel() * p.element_size() for p in parts))
        if saved.nbytes > self.budget:
            return
        if state is None:  # (an entry this one holds is dropped: not one whose end's recurrent state it lacks)
            self.entries = [e for e in self.entries if not (e.long == long and len(e.tokens) <= n and
                                                            bool((tokens[: len(e.tokens)] == e.tokens).all()))]
        self.entries.append(saved)
        while self.nbytes > self.budget:
            self.entries.pop(0)

    def persist(self, cache: PrefixCache, row: int) -> None:
        """Row `row`'s prefix written to the disk (when there is one and it holds enough): the program is done
        with it (a chat app closing)."""
        n = cache.held.held(row)
        state = cache.held.state
        if self.disk is None or n < SAVE_LEAST or (state is not None and not state.holds(row, n)):
            return
        parts = tuple(_to_host(p) for p in cache.snapshot(row, n))
        self.disk.keep(cache.held.ids[row, :n].clone(), bool(cache.held.long[row]), parts, positioned(cache, parts))

    def take(self, cache: PrefixCache, row: int, prompt: torch.Tensor, long: bool, held: int) -> int:
        """Before `prompt` is prefilled into row `row`, which holds its first `held` positions already: the row's
        prefix saved if the prompt would overwrite enough of it, and the saved prefix sharing the most with the
        prompt (in RAM, or on disk) copied in if it shares more. Returns the positions the row now holds of the
        prompt."""
        whole = cache.held.state is not None  # a recurrent state: an entry's end, or nothing
        entry, most = self.best(prompt, long, whole)
        found, deep = self.disk.best(prompt, long, whole) if self.disk is not None else (None, 0)
        parts = None
        if self.disk is not None and found is not None and deep > max(most, held):
            # mapped before the save below, whose room may take the file: the mapping outlives its name
            parts = self.disk.read(found, *shaped_like(cache, row))
            if parts is not None:
                self.disk.touch(found)
        useful = parts is None and entry is not None and most > held
        if useful:  # most recently used first: saving the row's prefix below must not drop it
            self.entries.remove(entry)
            self.entries.append(entry)
        try:
            self.save(cache, row, held)
        except torch.OutOfMemoryError:  # (an accelerator without room for a layer's copy: nothing is saved)
            pass
        if parts is not None and found is not None:
            try:
                self._put(cache, row, found.tokens, found.long, parts, deep)
            except torch.OutOfMemoryError:  # (the record was cut first: the prompt is prefilled whole)
                return 0
            self.from_disk += deep
            return deep
        if not useful:
            return held
        try:
            self.restore(cache, row, entry, most)
        except torch.OutOfMemoryError:  # (the record was cut first: the prompt is prefilled whole)
            return 0
        return most

    def best(self, prompt: torch.Tensor, long: bool, whole: bool = False) -> tuple[Saved | None, int]:
        """The entry sharing the longest prefix with `prompt` (its last token left to run), and that length
        (`whole`: longest_match's)."""
        return longest_match(self.entries, prompt, long, whole=whole)

    def restore(self, cache: PrefixCache, row: int, entry: Saved, n: int) -> None:
        """Entry's first `n` positions back into row `row`, its record with them; the entry becomes the most
        recently used."""
        self._put(cache, row, entry.tokens, entry.long, entry.parts, n)
        if entry in self.entries:  # (else dropped meanwhile for the room a save took: it is in the row now)
            self.entries.remove(entry)
            self.entries.append(entry)

    def _put(self, cache: PrefixCache, row: int, tokens: torch.Tensor, long: bool, parts: tuple[torch.Tensor, ...],
             n: int) -> None:
        """The first `n` positions of `parts` into row `row`, with their record."""
        held = cache.held
        held.cut(row, 0)  # (a copy that fails halfway leaves the row claiming nothing)
        cache.restore(row, parts, n)
        held.ids[row, :n] = tokens[:n].to(held.ids.device)
        held.length[row] = n
        held.long[row] = long
        self.restored += n


def positioned(cache: PrefixCache, parts: tuple[torch.Tensor, ...]) -> tuple[bool, ...]:
    """Which of a snapshot's tensors hold positions (keys, values, latents) and which a recurrent state (the same
    shape however long the prefix)."""
    return cache.positioned() if cache.held.state is not None else (True,) * len(parts)  # type: ignore[attr-defined]


def shaped_like(cache: PrefixCache, row: int) -> tuple[tuple[torch.Tensor, ...], tuple[bool, ...]]:
    """Tensors shaped as a snapshot of row `row` is (a position's, where they hold positions), and which hold
    positions: what a file read back must match."""
    if cache.held.state is None:
        parts = cache.snapshot(row, 1)
        return parts, (True,) * len(parts)
    return cache.like(row), cache.positioned()  # type: ignore[attr-defined]


def _to_host(view: torch.Tensor) -> torch.Tensor:
    """A cache's view [layers, ...] copied into RAM a layer at a time: a strided view on an accelerator is made
    contiguous there before it crosses, and one layer's temporary is small where the whole row's would not be."""
    host = torch.empty(view.shape, dtype=view.dtype)
    for i in range(view.shape[0]):
        host[i].copy_(view[i])
    return host
