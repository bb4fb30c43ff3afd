"""Which experts the next layers will ask for (MoE-Infinity §5), how often that guess is right, and whether it pays.

Three predictors, each guessing a MoE layer's experts for the current token before its router runs:
- `previous-token`: the experts that layer chose for the previous token (the baseline: decode picks much the same
  experts from one token to the next);
- `stale-gate`: that layer's router applied to the hidden state of a layer before it (the residual stream changes
  little from one layer to the next);
- `eam`: MoE-Infinity's expert activation matrices: the current request's layers × experts counts matched by cosine
  similarity against a bounded collection of earlier requests' (kept per model across requests and restarts), the
  nearest one's busiest experts of each layer ahead.

Layers are counted among the MoE layers only (index m of `moe_layers`): "d ahead" skips dense layers. A prediction
never changes an answer, only where an expert's weights are when its router asks: `Dispatcher` copies predicted
experts into its cache slots ahead of time, and `PrecisionGate` stops that while recent guesses are mostly wrong.
Everything here is numpy on the host; the stale gate's router products are the caller's.
"""

from __future__ import annotations

import os
import zipfile
import zlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from tandem.runtime.choices import PredictorKind
from tandem.runtime.paths import set_aside

MAX_DEPTH = 4  # MoE layers ahead at most: published figures fall a few points per layer, and a copy started four
# layers ahead already waits behind three layers' worth of others
DEFAULT_MIN_PRECISION = 0.3  # below this share of used prefetches (recently), prefetch stops (PrecisionGate)
EAM_CAPACITY = 128  # earlier requests' matrices kept per model (the paper's collection is of this order)
EAM_VERSION = 1


@dataclass(frozen=True)
class PrefetchOptions:
    predictor: PredictorKind = PredictorKind.NONE
    depth: int = 1  # MoE layers ahead whose predicted experts are copied
    min_precision: float = DEFAULT_MIN_PRECISION  # what pays (the planner's figure): below it, prefetch pauses
    collection: Path | None = None  # where the EAM predictor keeps its activation collection across runs
    readahead: bool = False  # CPU only, experts left in their files: each layer's experts read ahead once routed

    @property
    def on(self) -> bool:
        return self.predictor is not PredictorKind.NONE and self.depth > 0


def ranked(ids: np.ndarray, num_experts: int) -> list[int]:
    """The distinct experts of `ids` [T, K] (or [K]), the most chosen first (ties: lower id)."""
    counts = np.bincount(np.asarray(ids).ravel(), minlength=num_experts)
    used = np.flatnonzero(counts)
    return used[np.argsort(-counts[used], kind="stable")].tolist()


class Predictor:
    """Guesses a MoE layer's experts for the current pass. `observe` after each MoE layer routes, in order;
    `predict(m, ahead, hint)` at layer m, for layer m + ahead (`hint`: what the predictor needs of layer m's pass,
    the stale gate's choices)."""

    kind = PredictorKind.NONE

    def __init__(self, num_moe: int, num_experts: int, top_k: int) -> None:
        self.num_moe, self.num_experts, self.top_k = num_moe, num_experts, top_k

    def new_request(self) -> None:
        """A new request begins (its first pass follows)."""

    def observe(self, m: int, ids: np.ndarray) -> None:
        """MoE layer m chose `ids` [T, K] for this pass."""

    def predict(self, m: int, ahead: int, hint: object = None) -> list[int]:
        raise NotImplementedError


class PreviousToken(Predictor):
    kind = PredictorKind.PREVIOUS

    def __init__(self, num_moe: int, num_experts: int, top_k: int) -> None:
        super().__init__(num_moe, num_experts, top_k)
        self.last: list[list[int]] = [[] for _ in range(num_moe)]

    def new_request(self) -> None:
        self.last = [[] for _ in range(self.num_moe)]

    def observe(self, m: int, ids: np.ndarray) -> None:
        self.last[m] = ranked(ids, self.num_experts)

    def predict(self, m: int, ahead: int, hint: object = None) -> list[int]:
        return self.last[m + ahead][: self.top_k]  # (not routed yet in this pass: the previous pass's)


class StaleGate(Predictor):
    """The layer ahead's router on this layer's router input: the caller computes those choices beside this layer's
    own (on an accelerator, in the same host read) and hands them over as `hint`, one [T, K] array per distance."""

    kind = PredictorKind.STALE_GATE

    def predict(self, m: int, ahead: int, hint: object = None) -> list[int]:
        choices: Sequence[np.ndarray] = hint  # type: ignore[assignment]
        return ranked(choices[ahead - 1], self.num_experts)[: self.top_k]


class EamCollection:
    """Earlier requests' activation matrices [moe layers, experts] (float32 counts), the newest last, at most
    `capacity`. Saved as one .npz beside the machine profile, per model; a file that is damaged, of another shape or
    of another version is left alone and the collection starts empty (it only ever makes a guess)."""

    def __init__(self, num_moe: int, num_experts: int, capacity: int = EAM_CAPACITY) -> None:
        self.shape, self.capacity = (num_moe, num_experts), capacity
        self.matrices: deque[np.ndarray] = deque(maxlen=capacity)

    def add(self, eam: np.ndarray) -> None:
        if eam.shape == self.shape and eam.any():
            self.matrices.append(eam.astype(np.float32, copy=True))

    def nearest(self, eam: np.ndarray) -> np.ndarray | None:
        """The stored matrix of highest cosine similarity with `eam` (the paper's distance, rows flattened);
        None when the collection is empty or `eam` holds no counts yet."""
        if not self.matrices or not eam.any():
            return None
        stack = np.stack(self.matrices).reshape(len(self.matrices), -1)  # [N, M*E]
        v = eam.reshape(-1).astype(np.float32)
        sims = stack @ v / (np.linalg.norm(stack, axis=1) * np.linalg.norm(v) + 1e-12)
        return self.matrices[int(np.argmax(sims))]

    def save(self, path: Path) -> None:
        """Written beside, then renamed over: a reader never sees half a file."""
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        stack = np.stack(self.matrices) if self.matrices else np.zeros((0, *self.shape), np.float32)
        with open(tmp, "wb") as f:
            np.savez(f, version=np.array(EAM_VERSION), eams=stack)
        os.replace(tmp, path)

    def load(self, path: Path) -> str | None:
        """Read a saved collection; returns why it was not used (None: loaded or no file)."""
        if not path.is_file():
            return None
        try:
            with np.load(path, allow_pickle=False) as data:
                version, eams = int(data["version"]), data["eams"]
        except (OSError, ValueError, KeyError, EOFError, TypeError, zipfile.BadZipFile, zlib.error) as e:
            return _aside(path, f"it is damaged ({e or type(e).__name__})")
        if version != EAM_VERSION or eams.ndim != 3 or eams.shape[1:] != self.shape or eams.dtype.kind != "f" \
                or not np.isfinite(eams).all() or (eams < 0).any():
            return _aside(path, "it is not for this model or version")
        for eam in eams[-self.capacity :]:
            self.add(eam)
        return None


def _aside(path: Path, why: str) -> str:
    """A saved collection that cannot be used, moved aside (the next save starts a new one); says so."""
    try:
        aside = set_aside(path, ".npz")
    except OSError:
        return f"the activation collection {path} is unusable ({why}); prefetch starts a new one"
    return f"the activation collection {path.name} was set aside as {aside.name} because {why}"


class EamMatch(Predictor):
    """MoE-Infinity's predictor: once a pass (at its first MoE layer), the collection's matrix nearest the current
    request's; a layer's prediction is that matrix's busiest experts of the layer. With an empty collection, the
    current request's own counts stand in."""

    kind = PredictorKind.EAM

    def __init__(self, num_moe: int, num_experts: int, top_k: int, collection: EamCollection | None = None) -> None:
        super().__init__(num_moe, num_experts, top_k)
        self.collection = collection or EamCollection(num_moe, num_experts)
        self.current = np.zeros((num_moe, num_experts), dtype=np.float32)
        self._order: np.ndarray | None = None  # [M, E] each layer's experts, busiest first, of the matched matrix
        self._last_m = -1  # the MoE layer seen last

    def new_request(self) -> None:
        self.collection.add(self.current)
        self.current = np.zeros_like(self.current)
        self._order, self._last_m = None, -1

    def observe(self, m: int, ids: np.ndarray) -> None:
        if m <= self._last_m:  # a new pass (its first layer seen): match again on everything seen so far
            self._order = None
        self._last_m = m
        self.current[m] += np.bincount(np.asarray(ids).ravel(), minlength=self.num_experts)[: self.num_experts]

    def predict(self, m: int, ahead: int, hint: object = None) -> list[int]:
        if self._order is None:
            matched = self.collection.nearest(self.current)
            table = self.current if matched is None else matched
            self._order = np.argsort(-table, axis=1, kind="stable")
            self._seen = table > 0
        row = self._order[m + ahead][: self.top_k]
        return row[self._seen[m + ahead][row]].tolist()


def make_predictor(kind: PredictorKind, num_moe: int, num_experts: int, top_k: int,
                   collection: EamCollection | None = None) -> Predictor | None:
    if kind is PredictorKind.PREVIOUS:
        return PreviousToken(num_moe, num_experts, top_k)
    if kind is PredictorKind.STALE_GATE:
        return StaleGate(num_moe, num_experts, top_k)
    if kind is PredictorKind.EAM:
        return EamMatch(num_moe, num_experts, top_k, collection)
    return None


@dataclass
class Accuracy:
    """Per layer distance d (1..depth): experts predicted, experts routed (where a prediction was made), and both."""

    depth: int
    predicted: np.ndarray = field(init=False)
    routed: np.ndarray = field(init=False)
    both: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.predicted, self.routed, self.both = (np.zeros(self.depth + 1, dtype=np.int64) for _ in range(3))

    def add(self, d: int, guess: Sequence[int], actual: Sequence[int]) -> int:
        hit = len(set(guess) & set(actual))
        self.predicted[d] += len(guess)
        self.routed[d] += len(actual)
        self.both[d] += hit
        return hit

    def recall(self, d: int) -> float:
        """The share of the experts routed that had been predicted."""
        return float(self.both[d] / self.routed[d]) if self.routed[d] else 0.0

    def precision(self, d: int) -> float:
        """The share of the predictions that were routed."""
        return float(self.both[d] / self.predicted[d]) if self.predicted[d] else 0.0

    def as_rows(self) -> list[dict[str, float | int]]:
        return [{"distance": d, "recall": round(self.recall(d), 4), "precision": round(self.precision(d), 4),
                 "predicted": int(self.predicted[d]), "routed": int(self.routed[d])}
                for d in range(1, self.depth + 1)]


class Scorer:
    """Keeps each prediction made for a layer until that layer routes, then scores it (single-token passes only:
    a prompt's pass routes to most experts and says nothing of a guess)."""

    def __init__(self, depth: int) -> None:
        self.accuracy = Accuracy(depth)
        self.pending: dict[tuple[int, int], list[int]] = {}  # (target layer, distance) -> guess

    def guess(self, target: int, d: int, experts: list[int]) -> None:
        self.pending[(target, d)] = experts

    def routed(self, m: int, actual: list[int]) -> tuple[int, int]:
        """Scores every guess for layer m; returns (experts guessed, of them routed)."""
        guessed = hits = 0
        for d in range(1, self.accuracy.depth + 1):
            guess = self.pending.pop((m, d), None)
            if guess is not None:
                hits += self.accuracy.add(d, guess, actual)
                guessed += len(guess)
        return guessed, hits

    def drop(self) -> None:
        self.pending.clear()


class PrecisionGate:
    """Prefetch runs while the share of recent guesses it would copy (experts not on the device yet) that were then
    routed holds at or above `threshold`; below it, it pauses, guesses still scored, until they recover (over the
    last `window` guesses). Until `warmup` guesses are in, it runs."""

    def __init__(self, threshold: float, window: int = 256, warmup: int = 32) -> None:
        self.threshold, self.warmup = threshold, warmup
        self.recent: deque[int] = deque(maxlen=window)  # 1 a used guess, 0 a wasted one
        self.paused_passes = 0

    def add(self, guessed: int, used: int) -> None:
        self.recent.extend([1] * used + [0] * (guessed - used))

    @property
    def precision(self) -> float:
        return sum(self.recent) / len(self.recent) if self.recent else 1.0

    @property
    def open(self) -> bool:
        return len(self.recent) < self.warmup or self.precision >= self.threshold
