"""Tandem's own `--quant q8_0` / `--quant q4_k`: a checkpoint's routed experts quantized to GGUF's block formats
once, kept in a cache file beside the user's other caches and memory-mapped from there on later loads (as a GGUF
file's blocks are), so only the first load pays for quantizing.

The cache is keyed by the checkpoint (its resolved path, and each shard's size and modification time) and the
format; a changed checkpoint gets a new file. The file is a safetensors file of uint8 rows of blocks, one tensor per
expert matrix (`<layer>.<expert>.gate|up|down`), written atomically. A file there that is not the one this load
would write (not a regular file, unreadable, truncated, another layout or another safetensors file) is set aside
beside it and quantized again, said in the progress message. The file has no checksum: hashing it would read all
of it at every load, which the memory map exists to avoid, so a bit flip in the blocks' data goes unseen (as in a
checkpoint's or a GGUF file's data); one in the header is seen as another layout.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import torch

from tandem.kernels.blocks import FORMATS, quantize
from tandem.kernels.errors import CheckpointError, StoreError
from tandem.runtime.build import float_experts
from tandem.runtime.checkpoint import Checkpoint
from tandem.runtime.moe import BlockExpert
from tandem.runtime.paths import atomic_write_with, cache_dir, ensure_folder, file_kind, set_aside
from tandem.runtime.safetensors_mmap import SafetensorsFile

FORMAT_OF = {"q8_0": "Q8_0", "q4_k": "Q4_K"}  # --quant -> the block format
VERSION = 1  # of the file's layout and the quantizers: a change makes new files


def cache_path(ckpt: Checkpoint, quant: str) -> Path:
    key = json.dumps([VERSION, quant, *ckpt.identity()])
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    return cache_dir() / "quantized" / f"{ckpt.path.name}-{quant}-{digest}.safetensors"


Progress = Callable[[str, float], None]
Layout = dict[str, tuple[tuple[int, int], int]]  # tensor name -> ([rows, bytes a row], offset in the data)


def block_experts(ckpt: Checkpoint, layers: list[int], quant: str,
                  progress: Progress | None = None) -> dict[int, list[BlockExpert]]:
    """Each MoE layer's experts in the block format of `quant`: views of the cache file, made first if needed.

    A file at the cache's path that is not the one this load would write is set aside and made again (the
    progress message says so); raises StoreError when the cache cannot be written (see `_write`)."""
    fmt = FORMAT_OF[quant]
    path = cache_path(ckpt, quant)
    layout, size = _layout(ckpt, layers, fmt)
    file, why = _open(path, layout, size)
    if file is None:
        if why is not None:  # something is there: set aside (not deleted: it may be a folder, or not ours)
            try:
                aside = set_aside(path, "")  # (no suffix: never taken for a safetensors file)
            except OSError as e:
                raise StoreError(f"the quantized experts' cache {path} cannot be used ({why}) nor moved aside "
                                 f"({e.strerror or e}); delete it") from None
            if progress is not None:  # (the loader's one channel to the user; shown as "…: done")
                progress(f"setting aside the quantized experts' cache file, which could not be used ({why}), as "
                         f"{aside.name}", 1.0)
        _write(ckpt, layers, fmt, path, layout, size, progress)
        file, why = _open(path, layout, size)
        if file is None:  # (just written: only another process or a failing disk gets here)
            raise StoreError(f"the quantized experts' cache {path} was written but cannot be read back ({why}); "
                             "check the disk, delete the file and run again")
    out: dict[int, list[BlockExpert]] = {}
    for layer in layers:
        out[layer] = [BlockExpert(*(file.tensor(f"{layer}.{e}.{part}") for part in ("gate", "up", "down")),
                                  ckpt.config.activation, formats=(fmt, fmt)) for e in range(ckpt.config.num_experts)]
    return out


def _layout(ckpt: Checkpoint, layers: list[int], fmt: str) -> tuple[Layout, int]:
    """Every tensor the file holds (in the order it holds them) and the size of its data: what `_write` writes and
    `_open` checks a file against."""
    f = FORMATS[fmt]
    h, i = ckpt.config.hidden_size, ckpt.config.moe_intermediate_size
    shapes = {"gate": (i, h // f.values * f.nbytes), "up": (i, h // f.values * f.nbytes),
              "down": (h, i // f.values * f.nbytes)}
    layout: Layout = {}
    at = 0
    for layer in layers:
        for e in range(ckpt.config.num_experts):
            for part, (rows, nbytes) in shapes.items():
                layout[f"{layer}.{e}.{part}"] = ((rows, nbytes), at)
                at += rows * nbytes
    return layout, at


def _open(path: Path, layout: Layout, size: int) -> tuple[SafetensorsFile | None, str | None]:
    """The cache file mapped, if it is exactly what `_write` makes for `layout`; else None and why not (None when
    there is no file). Only a regular file is opened (a FIFO would block, a link to /dev/zero never end), and its
    table must be this layout's, tensor for tensor, to the byte: another safetensors file (another model's, an
    older layout) is read as these experts' blocks otherwise, or fails on a missing name at the first layer."""
    if not path.parent.is_dir():  # no folder yet, or something else there (a file, a link loop): the writer says so
        return None, None
    try:
        info = os.stat(path)
    except FileNotFoundError:
        if not os.path.lexists(path):
            return None, None
        return None, "it is a link to nothing"
    except OSError as e:  # a link loop, a folder on the way that cannot be searched
        return None, e.strerror or str(e)
    if not stat.S_ISREG(info.st_mode):
        return None, f"it is {file_kind(info.st_mode)}"
    try:
        file = SafetensorsFile(path)
    except CheckpointError as e:  # (its advice is a checkpoint's: only the reason is kept)
        why = str(e).replace(str(path), "it", 1)
        for advice in ("; re-download or re-convert the checkpoint", "; check the file"):
            why = why.removesuffix(advice)
        return None, why
    data = min((t.start for t in file.infos.values()), default=0)  # (the first tensor's offset is 0)
    if set(file.infos) != set(layout) or info.st_size != data + size or any(
            t.dtype != torch.uint8 or t.shape != layout[name][0] or t.start - data != layout[name][1]
            for name, t in file.infos.items()):
        return None, "it holds other tensors than these experts' blocks"
    return file, None


def _write(ckpt: Checkpoint, layers: list[int], fmt: str, path: Path, layout: Layout, size: int,
           progress: Progress | None) -> None:
    """Quantize layer by layer straight into the file: the header first (every size is known), then the rows.

    A cache that cannot be written is an error saying how to fix it, before any quantizing where it can be told:
    as every folder Tandem saves to (`ensure_folder`). Quantizing into RAM instead would hold every expert's blocks
    in memory, where the file is mapped and paged by the OS, and pay for the quantizing again at every load."""
    header: dict[str, object] = {"__metadata__": {"format": fmt, "checkpoint": str(ckpt.path)}}
    for name, ((rows, nbytes), at) in layout.items():
        header[name] = {"dtype": "U8", "shape": [rows, nbytes], "data_offsets": [at, at + rows * nbytes]}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)

    def fill(out: BinaryIO) -> None:
        out.write(struct.pack("<Q", len(raw)))
        out.write(raw)
        for k, layer in enumerate(layers):
            for expert in float_experts(ckpt, layer):  # (however the checkpoint stores them)
                for matrix in (expert.gate, expert.up, expert.down):
                    out.write(quantize(matrix, fmt).data.numpy().tobytes())
            if progress is not None:
                progress(f"quantizing the experts to {fmt} (once; kept for later loads)", (k + 1) / len(layers))

    ensure_folder(path.parent)  # (a StoreError saying how to fix it: a file in the way, no permission)
    try:
        atomic_write_with(path, fill)
    except OSError as e:  # no room, no permission in the folder, a read-only file system; the partial file is gone
        need = 8 + len(raw) + size
        raise StoreError(f"cannot write the quantized experts' cache {path} ({e.strerror or e}; it needs "
                         f"{need / 2**20:.1f} MiB): free space there, fix the folder's permissions or set "
                         "TANDEM_HOME to a folder you can write") from None
