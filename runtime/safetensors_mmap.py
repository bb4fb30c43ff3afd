"""Zero-copy, memory-mapped reading of `.safetensors` files.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each tensor's dtype,
shape and byte range, then the raw data. We parse and validate the header ourselves and hand out tensors
that are views of a private (copy-on-write) memory map of the file: opening touches no tensor data, so
a checkpoint far larger than RAM opens in milliseconds, and the OS pages weights in (and out) on use.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.kernels.errors import CheckpointError

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER = 100 * 1024 * 1024  # the format's own limit


@dataclass(frozen=True)
class TensorInfo:
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


class SafetensorsFile:
    """One memory-mapped `.safetensors` file; `tensor(name)` returns a zero-copy view."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.infos = read_header(path)
            size = path.stat().st_size
            with open(path, "rb") as f:
                # ACCESS_COPY: a private mapping, so torch gets a writable buffer without copying the file;
                # pages are only read from disk when a tensor is used.
                self._map = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) if size else None
        except OSError as e:  # a folder of that name, a symlink loop, no permission, a disk error
            raise CheckpointError(f"cannot read {path}: {e.strerror or e}; check the file") from None

    def names(self) -> list[str]:
        return list(self.infos)

    def mapped(self, name: str) -> bool:
        """Whether `tensor(name)` is a view of the file (always, here)."""
        return name in self.infos

    def read_into(self, name: str, out: memoryview) -> None:
        """Copy one tensor's bytes into `out` with plain file reads: no page faults on the memory map, which
        cost more than the copy itself when a whole model is brought into RAM. The file's cached pages for it
        are then dropped: the copy is what is used, and two copies of a large model would fill the RAM."""
        info = self.infos[name]
        done = 0
        try:
            with open(self.path, "rb", buffering=0) as f:
                while done < info.nbytes:
                    got = os.preadv(f.fileno(), [out[done : info.nbytes]], info.start + done)
                    if got <= 0:
                        raise OSError(f"the file ends before tensor {name!r} does")
                    done += got
                os.posix_fadvise(f.fileno(), info.start, info.nbytes, os.POSIX_FADV_DONTNEED)
        except OSError as e:
            raise CheckpointError(f"cannot read {name!r} from {self.path}: {e}; check the file and the disk") from None

    def tensor(self, name: str) -> torch.Tensor:
        info = self.infos[name]
        if info.nbytes == 0 or self._map is None:
            return torch.empty(info.shape, dtype=info.dtype)
        flat = torch.frombuffer(self._map, dtype=info.dtype, count=math.prod(info.shape), offset=info.start)
        return flat.view(info.shape)


def read_header(path: Path) -> dict[str, TensorInfo]:
    """A safetensors file's tensor table, checked against the file's size (its data is not read)."""
    size = path.stat().st_size
    corrupt = f"{path} is not a valid safetensors file"
    fix = "re-download or re-convert the checkpoint"
    if size < 8:
        raise CheckpointError(f"{corrupt} (only {size} bytes; truncated?); {fix}")
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > min(_MAX_HEADER, size - 8):
            raise CheckpointError(f"{corrupt} (header length {header_len} exceeds the file; truncated?); {fix}")
        raw = f.read(header_len)
    try:
        header = json.loads(raw, object_pairs_hook=_unique_keys)
    except ValueError as e:  # not UTF-8, not JSON, or a name twice
        raise CheckpointError(f"{corrupt} (header: {e}); {fix}") from None
    except RecursionError:
        raise CheckpointError(f"{corrupt} (header nested too deeply); {fix}") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{corrupt} (header is not a JSON object); {fix}")
    data_start = 8 + header_len
    data_size = size - data_start
    infos: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = DTYPES[entry["dtype"]]
            shape = tuple(_whole(d) for d in entry["shape"])
            begin, end = (_whole(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{corrupt} (bad entry for tensor {name!r}: {e!r}); {fix}") from None
        itemsize = torch.empty((), dtype=dtype).element_size()
        if any(d < 0 for d in shape) or not 0 <= begin <= end or end - begin != math.prod(shape) * itemsize:
            raise CheckpointError(f"{corrupt} (tensor {name!r} has inconsistent offsets); {fix}")
        if end > data_size:
            raise CheckpointError(
                f"{corrupt}: tensor {name!r} ends at byte {data_start + end} but the file has {size} "
                f"bytes (truncated download?); {fix}"
            )
        infos[name] = TensorInfo(dtype, shape, data_start + begin, end - begin)
    spans = sorted((i.start, i.start + i.nbytes, n) for n, i in infos.items() if i.nbytes)
    for (_, end, first), (start, _, second) in zip(spans, spans[1:], strict=False):
        if start < end:  # two tensors on the same bytes: writing one would change the other
            raise CheckpointError(f"{corrupt} (tensors {first!r} and {second!r} share bytes); {fix}")
    return infos


def _whole(value: object) -> int:
    """A size or offset from the header: a JSON whole number (not 96.9, not true)."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{value!r} is not a whole number")
    return value


def _unique_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"the name {twice!r} appears twice")
    return out
