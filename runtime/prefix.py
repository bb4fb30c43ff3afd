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
Layers with recurrent state (linear attention, state-space and convolution mixers) would need their state at the
reused position: a cache that holds such state must offer it before reuse may cross it (`reusable` is where).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch


class HeldTokens:
    """The token ids each row of a KV cache holds: `ids` [batch, context], the first `length[r]` of row r valid,
    rotated with LongRoPE's long tables where `long[r]`. Rows of a view (`row`) share the record's storage."""

    def __init__(self, batch: int, context: int) -> None:
        self.ids = torch.zeros(batch, context, dtype=torch.long)
        self.length = torch.zeros(batch, dtype=torch.long)
        self.long = torch.zeros(batch, dtype=torch.bool)

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

    def note(self, r: int, start: int, ids: torch.Tensor, long: bool) -> None:
        """A pass wrote `ids` [T] into row r at positions start.. (after `cut(r, start)`). Positions before `start`
        that the record does not hold, or rotated otherwise, make the whole row unknown: each position's keys
        depend on every position before it."""
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
        same = self.ids[r, :n] == want
        return n if bool(same.all()) else int(same.to(torch.int8).argmin())

    def copy_rows(self, pairs: list[tuple[int, int]], length: int) -> None:
        """As the cache's `copy_rows`: row dst takes row src's first `length` positions."""
        for d, s in pairs:
            self.ids[d, :length] = self.ids[s, :length]
            self.length[d] = min(int(self.length[s]), length)
            self.long[d] = self.long[s]
