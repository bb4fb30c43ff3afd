"""Expert activation traces (MoE-Infinity §4.1) and popularity-based static placement (Fiddler §3.4).

Per request: an activation matrix (layers × experts, token counts) for prefill and for decode, and the
decode sequence of chosen expert ids `[steps, layers, top_k]` (-1 for dense layers). Saved as `.npz`;
the summed counts are the popularity profile that `--placement` loads.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from runtime.errors import TandemError

Key = tuple[int, int]


class TraceRecorder:
    def __init__(self, num_layers: int, num_experts: int, top_k: int) -> None:
        self.num_layers, self.num_experts, self.top_k = num_layers, num_experts, top_k
        self.new_request()

    def new_request(self) -> None:
        self.prefill = np.zeros((self.num_layers, self.num_experts), dtype=np.int64)
        self.decode = np.zeros((self.num_layers, self.num_experts), dtype=np.int64)
        self.sequence: list[np.ndarray] = []  # one [layers, top_k] array per decode step
        self._step: np.ndarray | None = None

    def begin_step(self, phase: str) -> None:
        self.phase = phase
        if phase == "decode":
            self._step = np.full((self.num_layers, self.top_k), -1, dtype=np.int32)
            self.sequence.append(self._step)

    def record(self, layer: int, ids: torch.Tensor) -> np.ndarray:
        """ids [T, K]: the experts chosen for every token of this forward pass at `layer`. Returns the
        routings per expert of this pass [experts]."""
        chosen = ids.cpu().numpy()  # [T, K]
        counts = np.bincount(chosen.ravel(), minlength=self.num_experts)
        (self.decode if self.phase == "decode" else self.prefill)[layer] += counts
        if self.phase == "decode" and self._step is not None:
            self._step[layer] = chosen[0]  # the first sequence (beam 0) in a batch
        return counts

    def save(self, path: str | Path, model: str) -> None:
        seq = np.stack(self.sequence) if self.sequence else np.zeros((0, self.num_layers, self.top_k), np.int32)
        np.savez(path, prefill=self.prefill, decode=self.decode, sequence=seq, model=np.array(model))


def load_popularity(path: str | Path, num_layers: int, num_experts: int) -> np.ndarray:
    """Counts [layers, experts] from a saved trace (prefill + decode)."""
    try:
        with np.load(path) as data:
            counts = data["prefill"] + data["decode"]
    except (OSError, KeyError, ValueError) as e:
        raise TandemError(f"cannot read placement profile {path}: {e}; record one with --record-trace") from None
    if counts.shape != (num_layers, num_experts):
        raise TandemError(
            f"placement profile {path} is for {counts.shape[0]} layers × {counts.shape[1]} experts, but this model "
            f"has {num_layers} × {num_experts}; record a new one with --record-trace"
        )
    return counts


def most_popular(counts: np.ndarray, slots: int) -> list[Key]:
    """The `slots` (layer, expert) pairs with the highest counts (ties: lower layer, then lower expert)."""
    order = sorted(np.ndindex(*counts.shape), key=lambda k: (-counts[k], k))
    return [(int(layer), int(e)) for layer, e in order[:slots] if counts[layer, e] > 0]
