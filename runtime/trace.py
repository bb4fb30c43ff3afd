"""Expert activation traces (MoE-Infinity §4.1) and popularity-based static placement (Fiddler §3.4).

Per request: an activation matrix (layers × experts, token counts) for prefill and for decode, and the
decode sequence of chosen expert ids `[steps, layers, top_k]` (-1 for dense layers). Saved as `.npz`;
the summed counts are the popularity profile that `--placement` loads.
"""

from __future__ import annotations

import io
import zipfile
import zlib
from pathlib import Path

import numpy as np
import torch

from tandem.kernels.errors import TandemError

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

    def record_token(self, chosen: np.ndarray, routed: np.ndarray) -> np.ndarray:
        """chosen [layers, K]: one token's experts at every layer at once (the decode step's), of which the layers
        `routed` [layers] (bool) have experts: the others' rows are not choices. Returns the routings per layer and
        expert [layers, experts]."""
        L, E = self.num_layers, self.num_experts
        flat = (chosen + E * np.arange(L)[:, None]).ravel()  # [L*K] as layer * E + expert
        counts = np.bincount(flat, minlength=L * E).reshape(L, E)
        counts[~routed] = 0
        (self.decode if self.phase == "decode" else self.prefill)[:] += counts
        if self.phase == "decode" and self._step is not None:
            self._step[routed] = chosen[routed]
        return counts

    def save(self, path: str | Path, model: str) -> None:
        seq = np.stack(self.sequence) if self.sequence else np.zeros((0, self.num_layers, self.top_k), np.int32)
        # built in memory, then written as it is: given a name, numpy would add ".npz" to one without it, and a zip
        # written straight to a device (/dev/null) fails on its seeks
        buffer = io.BytesIO()
        np.savez(buffer, prefill=self.prefill, decode=self.decode, sequence=seq, model=np.array(model))
        Path(path).write_bytes(buffer.getvalue())


MAX_ARRAY_BYTES = 256 * 2**20  # per array of a trace file: far above a real trace (a sequence of 48 layers x
# top-8 x 4 bytes a decode step fills it after 170 000 steps), and a compressed bomb is refused before it is inflated
RECORD_HINT = "record one with --record-trace"


def _read_arrays(path: str | Path, what: str, names: tuple[str, ...], optional: tuple[str, ...] = ()
                 ) -> dict[str, np.ndarray]:
    """The named arrays of a `.npz` trace file (and those of `optional` it holds), or a `TandemError` saying
    what is wrong with the file."""
    p = Path(path)
    if not p.is_file():
        kind = "a folder" if p.is_dir() else "missing" if not p.exists() else "not a regular file"
        raise TandemError(f"{what} {path} is {kind}; {RECORD_HINT}")
    try:
        loaded = np.load(p, allow_pickle=False)  # never unpickle: a trace file may come from anywhere
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise TandemError(f"cannot read {what} {path}: {e or type(e).__name__}; {RECORD_HINT}") from None
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise TandemError(f"{what} {path} is a single array (.npy), not a trace (.npz); {RECORD_HINT}")
    with loaded as data:
        missing = [n for n in names if n not in data.files]
        if missing:
            raise TandemError(f"{what} {path} lacks {', '.join(missing)}: not a trace file; {RECORD_HINT}")
        arrays = {}
        for name in names + tuple(n for n in optional if n in data.files):
            try:
                if data.zip.getinfo(f"{name}.npy").file_size > MAX_ARRAY_BYTES:
                    raise TandemError(f"{what} {path}: {name} is larger than {MAX_ARRAY_BYTES // 2**20} MiB; "
                                      f"not a trace this program wrote; {RECORD_HINT}")
                arrays[name] = data[name]
            except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile, zlib.error) as e:
                raise TandemError(f"cannot read {what} {path}: {name} is damaged or truncated ({e}); {RECORD_HINT}"
                                  ) from None
    for name, array in arrays.items():
        if not isinstance(array, np.ndarray):  # numpy hands over a member without the .npy header as raw bytes
            raise TandemError(f"{what} {path}: {name} is not an array (not .npy data); {RECORD_HINT}")
    return arrays


def _check_numbers(what: str, path: str | Path, name: str, array: np.ndarray, kinds: str) -> None:
    """`kinds`: the numpy dtype kinds allowed ("iu": integers, "iuf": real numbers)."""
    if array.dtype.kind not in kinds:
        expected = "whole numbers" if kinds == "iu" else "numbers"
        raise TandemError(f"{what} {path}: {name} holds {array.dtype} values, not {expected}; {RECORD_HINT}")


def _check_counts(what: str, path: str | Path, name: str, counts: np.ndarray, num_layers: int,
                  num_experts: int) -> None:
    """A counts member (prefill, decode): layers × experts of finite counts, none negative."""
    if counts.ndim != 2:
        raise TandemError(f"{what} {path}: {name} has {counts.ndim} dimensions, not 2 (layers × experts); "
                          f"{RECORD_HINT}")
    _check_numbers(what, path, name, counts, "iuf")
    if counts.shape != (num_layers, num_experts):
        raise TandemError(
            f"{what} {path}: {name} is for {counts.shape[0]} layers × {counts.shape[1]} experts, but this "
            f"model has {num_layers} × {num_experts}; record a new one with --record-trace"
        )
    if not np.isfinite(counts).all() or (counts < 0).any():
        raise TandemError(f"{what} {path}: {name} holds negative or non-finite counts; {RECORD_HINT}")


def load_popularity(path: str | Path, num_layers: int, num_experts: int) -> np.ndarray:
    """Counts [layers, experts] from a saved trace (prefill + decode)."""
    what = "placement profile"
    arrays = _read_arrays(path, what, ("prefill", "decode"))
    for name, counts in arrays.items():
        _check_counts(what, path, name, counts, num_layers, num_experts)
    return arrays["prefill"] + arrays["decode"]


def load_sequence(path: str | Path, num_layers: int, num_experts: int, top_k: int) -> np.ndarray:
    """The decode routing [steps, layers, top_k] of a saved trace: expert ids, -1 for dense layers."""
    what = "trace"
    # the counts are not used here, but a file whose counts --placement would refuse is refused here too
    arrays = _read_arrays(path, what, ("sequence",), optional=("prefill", "decode"))
    for name in ("prefill", "decode"):
        if name in arrays:
            _check_counts(what, path, name, arrays[name], num_layers, num_experts)
    seq = arrays["sequence"]
    if seq.ndim != 3:
        raise TandemError(f"{what} {path}: sequence has {seq.ndim} dimensions, not 3 (steps × layers × top-k); "
                          f"{RECORD_HINT}")
    _check_numbers(what, path, "sequence", seq, "iu")
    if seq.shape[1:] != (num_layers, top_k):
        raise TandemError(f"{what} {path} is for {seq.shape[1]} layers × top-{seq.shape[2]}, but this model has "
                          f"{num_layers} × top-{top_k}; record a new one with --record-trace")
    if seq.shape[0] == 0:
        raise TandemError(f"{what} {path} holds no decode steps; record one with --max-new-tokens 2 or more")
    if seq.min() < -1 or seq.max() >= num_experts:
        raise TandemError(f"{what} {path}: expert ids outside -1..{num_experts - 1} (this model has {num_experts} "
                          f"experts); {RECORD_HINT}")
    return seq.astype(np.int64)


def most_popular(counts: np.ndarray, slots: int) -> list[Key]:
    """The `slots` (layer, expert) pairs with the highest counts (ties: lower layer, then lower expert)."""
    order = sorted(np.ndindex(*counts.shape), key=lambda k: (-counts[k], k))
    return [(int(layer), int(e)) for layer, e in order[:slots] if counts[layer, e] > 0]


def placement(path: str | Path, num_layers: int, num_experts: int) -> tuple[Key, ...]:
    """A recorded trace as a placement (--placement): every expert it saw, most popular first."""
    counts = load_popularity(path, num_layers, num_experts)
    return tuple(most_popular(counts, counts.size))
