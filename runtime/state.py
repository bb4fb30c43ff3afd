"""The cache of a recurrent token mixer (Gated DeltaNet, short convolutions, Mamba-2): a fixed-size state per layer
and sequence row, where attention keeps a growing KV cache, and the cache of a model whose layers keep different
kinds (`LayerCaches`: attention's keys and values beside a recurrent state).

A row's state is that of one position: the tokens it has read so far. A pass from position `start` needs the state
at `start`: it is there when the row's last pass ended there, or at a `mark` (a copy taken there), or `start` is 0
(nothing read: zeros). So prefix reuse (runtime/prefix.py) may reuse a row's tokens only up to one of those positions
(`usable`), and the engine marks the position before a prompt's last token, where a retry or an edited last message
takes up again. `HeldTokens` tells the state of every pass through `rewind` (before) and `advance` (after).

Letters: L the mixer's layers, B batch rows.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import ClassVar

import torch

from tandem.kernels.errors import UnsupportedModelError
from tandem.runtime.accelerator import Accelerator
from tandem.runtime.config import ModelConfig
from tandem.runtime.prefix import HeldTokens

Shape = tuple[int, ...]
MARKS = 2  # marks kept per row, the latest: the last prompts' (a retry, an edit of the last message)


class NoStateError(RuntimeError):
    """A pass was asked to start where a row has no state (a caller that did not ask `usable`)."""


class StateCache:
    """Each recurrent layer's state tensors, [L, B, ...] each by name (`tensors`), the position each row's state is
    at (`at`, -1: none), and each row's marks. A mixer kind subclasses it with its `kind` and `shapes`."""

    kind: ClassVar[str] = ""  # its mixer's name (ModelConfig.mixers)

    @staticmethod
    def shapes(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, tuple[Shape, torch.dtype]]:
        """One layer's state of one row: each tensor's shape and dtype."""
        raise NotImplementedError

    def __init__(self, cfg: ModelConfig, batch: int, context: int, dtype: torch.dtype,
                 accel: Accelerator | None = None, layers: Sequence[int] | None = None) -> None:
        layers = list(layers) if layers is not None else [i for i, m in enumerate(cfg.mixers) if m == self.kind]
        self.index = {layer: j for j, layer in enumerate(layers)}  # a model layer -> its place in the tensors
        self.tensors: dict[str, torch.Tensor] = {}
        for name, (shape, kind) in self.shapes(cfg, dtype).items():
            full = (len(layers), batch, *shape)
            self.tensors[name] = torch.zeros(full, dtype=kind) if accel is None else \
                accel.empty(full, kind, "the recurrent state").zero_()
        self.at = torch.full((batch,), -1, dtype=torch.long)
        self.marks: list[dict[int, tuple[torch.Tensor, ...]]] = [{} for _ in range(batch)]
        self.batch, self.context = batch, context
        self.held = HeldTokens(batch, context)
        self.held.state = self

    def get(self, name: str, layer: int) -> torch.Tensor:
        """Layer `layer`'s state tensor `name`, every row: [B, ...] (a view: a pass updates it in place)."""
        return self.tensors[name][self.index[layer]]

    # what HeldTokens asks (runtime/prefix.py `RowState`)
    def usable(self, r: int, n: int) -> int:
        """The most of row r's first n positions a pass can start after: its state's position, a mark, or 0."""
        points = [p for p in (int(self.at[r]), *self.marks[r]) if 0 <= p <= n]
        return max(points, default=0)

    def rewind(self, r: int, start: int) -> None:
        """Row r is about to read positions start..: its state made that of `start` (zeros at 0, a mark's copy),
        the marks past it dropped. The row has no state while the pass runs (`advance` gives it its end): a pass that
        fails halfway, some layers' state updated and some not, leaves none."""
        marks = self.marks[r]
        for p in [p for p in marks if p > start]:
            del marks[p]
        at = int(self.at[r])
        self.at[r] = -1
        if start == 0:
            for t in self.tensors.values():
                t[:, r].zero_()
        elif start in marks and start != at:
            for t, kept in zip(self.tensors.values(), marks[start], strict=True):
                t[:, r].copy_(kept)
        elif start != at:
            raise NoStateError(f"row {r} has no recurrent state at position {start} (it is at {at}); the prompt "
                               "must be read again from the start")

    def advance(self, r: int, end: int) -> None:
        """A pass left row r's state at position `end`."""
        self.at[r] = end

    def holds(self, r: int, n: int) -> bool:
        """Whether row r's state is that of its first n positions."""
        return int(self.at[r]) == n

    def mark(self, r: int, position: int) -> None:
        """A copy of row r's state, where it is that of `position` (else nothing), kept in RAM (on an accelerator
        too: its memory is the weights' and the caches'), the oldest mark dropped past MARKS."""
        at = int(self.at[r])
        if at <= 0 or at != position:
            return
        marks = self.marks[r]
        marks[at] = tuple(t[:, r].to("cpu", copy=True) for t in self.tensors.values())
        while len(marks) > MARKS:
            del marks[min(marks)]

    # what the engine, beams and the prefix store ask of a cache (as of attention.KVCache)
    def copy_rows(self, pairs: list[tuple[int, int]], length: int) -> None:
        """For each (dst, src), row dst takes row src's first `length` positions: its state where `length` is its
        position, and its marks up to `length`; where src's state is elsewhere (a batch leader's chunk ends past
        what a follower shares), dst keeps its own state and marks if its tokens up to there are src's. Then the
        record of the tokens, as every cache's `copy_rows` copies it."""
        if {d for d, _ in pairs} & {s for _, s in pairs}:
            raise ValueError("copy_rows: a row cannot be both a source and a destination")
        held = self.held
        for d, s in pairs:
            theirs = {p: m for p, m in self.marks[s].items() if p <= length}
            if int(self.at[s]) == length:
                for t in self.tensors.values():
                    t[:, d].copy_(t[:, s])
                self.at[d] = length
                self.marks[d].clear()
                self.marks[d].update(theirs)
                continue
            shared = min(length, held.held(d), held.held(s))  # (dst's own positions that src's tokens keep)

            def same(p: int, d: int = d, s: int = s, shared: int = shared) -> bool:
                return 0 <= p <= shared and bool((held.ids[d, :p] == held.ids[s, :p]).all())
            if not same(int(self.at[d])):
                self.at[d] = -1
            kept = {p: m for p, m in self.marks[d].items() if same(p)}
            self.marks[d].clear()
            self.marks[d].update(kept | theirs)
        held.copy_rows(pairs, length)

    def snapshot(self, row: int, n: int) -> tuple[torch.Tensor, ...]:
        """Row `row`'s state (views) as of its first n positions: only where it is."""
        if not self.holds(row, n):
            raise NoStateError(f"row {row}'s recurrent state is at position {int(self.at[row])}, not {n}")
        return tuple(t[:, row] for t in self.tensors.values())

    def restore(self, row: int, parts: tuple[torch.Tensor, ...], n: int) -> None:
        """A `snapshot` taken at position n back into row `row`."""
        self.at[row] = -1
        self.marks[row].clear()
        for t, p in zip(self.tensors.values(), parts, strict=True):
            for i in range(t.shape[0]):  # a layer at a time (see KVCache.restore)
                t[i, row].copy_(p[i])
        self.at[row] = n

    def like(self, row: int) -> tuple[torch.Tensor, ...]:
        """Row `row`'s state tensors as they are (a snapshot's shapes, wherever the state is)."""
        return tuple(t[:, row] for t in self.tensors.values())

    def positioned(self) -> tuple[bool, ...]:
        """Which of a snapshot's tensors hold positions: none of a state's."""
        return (False,) * len(self.tensors)

    def row(self, r: int) -> StateCache:
        """Row r alone (views: what a pass writes lands in this cache; its position and marks shared)."""
        view = copy.copy(self)
        view.tensors = {name: t[:, r : r + 1] for name, t in self.tensors.items()}
        view.at = self.at[r : r + 1]
        view.marks = [self.marks[r]]
        view.batch = 1
        view.held = self.held.row(r)
        view.held.state = view
        return view

    @classmethod
    def nbytes(cls, cfg: ModelConfig, batch: int, context: int, dtype: torch.dtype,
               layers: Sequence[int] | None = None) -> int:
        """Its bytes (whatever the context: the state does not grow), marks aside."""
        count = len(layers) if layers is not None else sum(m == cls.kind for m in cfg.mixers)
        one = sum(torch.Size(shape).numel() * kind.itemsize for shape, kind in cls.shapes(cfg, dtype).values())
        return count * batch * one


class LayerCaches:
    """The cache of a model whose layers keep different kinds (`Mixer.cache`): one of each kind over its layers
    (`parts`), one record of the tokens each row holds. Attention's keys and values are `k` and `v` here too (None
    in the layers that keep none), as in `attention.KVCache`; a recurrent mixer finds its state with `part`."""

    def __init__(self, cfg: ModelConfig, batch: int, context: int, dtype: torch.dtype,
                 accel: Accelerator | None = None) -> None:
        from tandem.runtime.layers import plan  # (the kinds' modules import this one)

        layers: dict[type, list[int]] = {}
        for i, kinds in enumerate(plan(cfg)):
            layers.setdefault(kinds.mixer.cache, []).append(i)
        states = [kind for kind in layers if issubclass(kind, StateCache)]
        if len(states) > 1:
            raise UnsupportedModelError("this model's layers keep two kinds of recurrent state "
                                        f"({', '.join(sorted(k.kind for k in states))}); that is not supported yet")
        self.parts = {kind: kind(cfg, batch, context, dtype, accel, layers=at) for kind, at in layers.items()}
        self.batch, self.context = batch, context
        self.held = HeldTokens(batch, context)
        self._share()

    def _share(self) -> None:
        """Every part reads and writes this cache's record; the recurrent one hears of each pass."""
        self.state = next((p for p in self.parts.values() if isinstance(p, StateCache)), None)
        self.held.state = self.state
        for p in self.parts.values():
            p.held = self.held
        kv = next((p for p in self.parts.values() if hasattr(p, "k")), None)
        self.k, self.v = (kv.k, kv.v) if kv is not None else ([], [])

    def part(self, kind: type) -> object:
        return self.parts[kind]

    def mark(self, r: int, position: int) -> None:
        if self.state is not None:
            self.state.mark(r, position)

    def copy_rows(self, pairs: list[tuple[int, int]], length: int) -> None:
        """Each part's copy, the recurrent state's first (it reads the record before the others copy it)."""
        for p in sorted(self.parts.values(), key=lambda p: not isinstance(p, StateCache)):
            p.copy_rows(pairs, length)  # (each copies the shared record too: the same copy again)

    def snapshot(self, row: int, n: int) -> tuple[torch.Tensor, ...]:
        return tuple(t for p in self.parts.values() for t in p.snapshot(row, n))

    def restore(self, row: int, parts: tuple[torch.Tensor, ...], n: int) -> None:
        at = 0
        for p in self.parts.values():
            count = len(p.snapshot(row, n)) if not isinstance(p, StateCache) else len(p.tensors)
            p.restore(row, parts[at : at + count], n)
            at += count

    def like(self, row: int) -> tuple[torch.Tensor, ...]:
        """Tensors shaped as a snapshot of row `row` (one position of the keys and values, the whole state)."""
        return tuple(t for p in self.parts.values() for t in (p.like(row) if isinstance(p, StateCache) else
                                                               p.snapshot(row, 1)))

    def positioned(self) -> tuple[bool, ...]:
        """Which of a snapshot's tensors hold positions (the keys and values) and which a recurrent state."""
        return tuple(flag for p in self.parts.values() for flag in
                     (p.positioned() if isinstance(p, StateCache) else (True,) * len(p.snapshot(0, 1))))

    def row(self, r: int) -> LayerCaches:
        view = copy.copy(self)
        view.parts = {kind: p.row(r) for kind, p in self.parts.items()}  # type: ignore[attr-defined]
        view.batch = 1
        view.held = self.held.row(r)
        view._share()
        return view

    @staticmethod
    def nbytes(cfg: ModelConfig, batch: int, context: int, dtype: torch.dtype) -> int:
        from tandem.runtime.layers import plan

        layers: dict[type, list[int]] = {}
        for i, kinds in enumerate(plan(cfg)):
            layers.setdefault(kinds.mixer.cache, []).append(i)
        return sum(kind.nbytes(cfg, batch, context, dtype, layers=at) for kind, at in layers.items())
