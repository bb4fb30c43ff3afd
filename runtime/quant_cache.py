"""Tandem's own `--quant q8_0` / `--quant q4_k`: a checkpoint's routed experts quantized to GGUF's block formats
once, kept in a cache file beside the user's other caches and memory-mapped from there on later loads (as a GGUF
file's blocks are), so only the first load pays for quantizing.

The cache is keyed by the checkpoint (its resolved path, and each shard's size and modification time) and the
format; a changed checkpoint gets a new file. The file is a safetensors file of uint8 rows of blocks, one tensor per
expert matrix (`<layer>.<expert>.gate|up|down`), written atomically; an unreadable one is quantized again.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from tandem.kernels.blocks import FORMATS, quantize
from tandem.kernels.errors import CheckpointError
from tandem.runtime.checkpoint import Checkpoint
from tandem.runtime.moe import BlockExpert
from tandem.runtime.paths import atomic_write_with, cache_dir
from tandem.runtime.safetensors_mmap import SafetensorsFile
from tandem.runtime.weights import expert_names

FORMAT_OF = {"q8_0": "Q8_0", "q4_k": "Q4_K"}  # --quant -> the block format
VERSION = 1  # of the file's layout and the quantizers: a change makes new files


def cache_path(ckpt: Checkpoint, quant: str) -> Path:
    files = sorted(ckpt.path.rglob("*.safetensors")) if ckpt.path.is_dir() else [ckpt.path]
    key = json.dumps([VERSION, quant, str(ckpt.path.resolve()),
                      [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]])
    digest = hashlib.sha256(key.encode()).hexdigest()[:24]
    return cache_dir() / "quantized" / f"{ckpt.path.name}-{quant}-{digest}.safetensors"


def block_experts(ckpt: Checkpoint, layers: list[int], quant: str,
                  progress: Callable[[str, float], None] | None = None) -> dict[int, list[BlockExpert]]:
    """Each MoE layer's experts in the block format of `quant`: views of the cache file, made first if needed."""
    path = cache_path(ckpt, quant)
    if not path.is_file():
        _write(ckpt, layers, FORMAT_OF[quant], path, progress)
    try:
        file = SafetensorsFile(path)
    except CheckpointError:  # damaged (a disk error, say): made again
        path.unlink(missing_ok=True)
        _write(ckpt, layers, FORMAT_OF[quant], path, progress)
        file = SafetensorsFile(path)
    fmt = FORMAT_OF[quant]
    out: dict[int, list[BlockExpert]] = {}
    for layer in layers:
        out[layer] = [BlockExpert(*(file.tensor(f"{layer}.{e}.{part}") for part in ("gate", "up", "down")),
                                  formats=(fmt, fmt)) for e in range(ckpt.config.num_experts)]
    return out


def _write(ckpt: Checkpoint, layers: list[int], fmt: str, path: Path,
           progress: Callable[[str, float], None] | None) -> None:
    """Quantize layer by layer straight into the file: the header first (every size is known), then the rows."""
    f = FORMATS[fmt]
    h, i = ckpt.config.hidden_size, ckpt.config.moe_intermediate_size
    shapes = {"gate": (i, h // f.values * f.nbytes), "up": (i, h // f.values * f.nbytes),
              "down": (h, i // f.values * f.nbytes)}
    header: dict[str, object] = {"__metadata__": {"format": fmt, "checkpoint": str(ckpt.path)}}
    at = 0
    for layer in layers:
        for e in range(ckpt.config.num_experts):
            for part, (rows, nbytes) in shapes.items():
                header[f"{layer}.{e}.{part}"] = {"dtype": "U8", "shape": [rows, nbytes],
                                                 "data_offsets": [at, at + rows * nbytes]}
                at += rows * nbytes
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)

    def fill(out: BinaryIO) -> None:
        out.write(struct.pack("<Q", len(raw)))
        out.write(raw)
        for k, layer in enumerate(layers):
            for e in range(ckpt.config.num_experts):
                for name in expert_names(ckpt.spec, layer, e):
                    out.write(quantize(ckpt.tensor(name), fmt).data.numpy().tobytes())
            if progress is not None:
                progress(f"quantizing the experts to {fmt} (once; kept for later loads)", (k + 1) / len(layers))
    atomic_write_with(path, fill)
