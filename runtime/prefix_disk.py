"""Prefixes kept on disk across restarts (opt-in: `--prefix-disk-gb`): a conversation's KV cache written when the app
closes or another prompt overwrites its row, and memory-mapped back when a prompt that begins as it comes again (the
chat reopened), so that the first answer after a restart does not prefill the whole history again.

One folder per model and set of options that change the numbers (`disk_key`: the checkpoint's resolved path and
each weight file's size and modification time, the dtypes, the quantization, the kernel variant, the accelerator),
one file per prefix: a header (what it holds, as JSON), its token ids and the cache's tensors, with a CRC-32 of
all of it. A file that is not what its header says, another model's or another layout's, or whose bytes do not add
up to its checksum is removed with a notice and never read into a cache: it is a copy of what a prefill makes, so
nothing is lost. At most `budget` bytes are kept, the least recently used removed first.

Letters: n the prefix's tokens.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from tandem.kernels.errors import StoreError
from tandem.runtime.paths import atomic_write_with, cache_dir, open_regular
from tandem.runtime.prefix import longest_match

MAGIC = b"TANDEMKV"
VERSION = 1  # of the file's layout: a change makes files of the old one foreign
HEADER_MOST = 1 << 16  # bytes of JSON a header may take (a few tensors' shapes)
PREFIX_BYTES = 12  # after the magic: the header's length (8 bytes) and its CRC-32 (4), little-endian
ALIGN = 64  # each tensor starts at a multiple of this: a mapped view of it is aligned for any dtype
SUFFIX = ".kv"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

Notify = Callable[[str], None]


def disk_key(identity: list[Any], name: str, settings: dict[str, Any]) -> str:
    """The name of a model's folder: its name and a digest of its weight files' identity (`Checkpoint.identity`)
    and of the `settings` that change the numbers in its KV cache (dtypes, quantization, kernel variant,
    accelerator)."""
    digest = hashlib.sha256(json.dumps([VERSION, identity, settings], sort_keys=True).encode()).hexdigest()[:24]
    return f"{name}-{digest}"


def default_folder(key: str) -> Path:
    return cache_dir() / "prefixes" / key


@dataclass(eq=False)
class DiskEntry:
    """A prefix file: where it is, its tokens and LongRoPE's flag, its size."""

    path: Path
    tokens: torch.Tensor  # [n]
    long: bool
    nbytes: int


def _pad(n: int) -> int:
    return -n % ALIGN


class DiskPrefixes:
    """The prefix files of one model's folder, at most `budget` bytes of them."""

    def __init__(self, folder: Path, budget: int, notify: Notify | None = None) -> None:
        self.folder, self.budget, self.notify = folder, budget, notify
        self._entries: list[DiskEntry] | None = None  # read on first use
        self._warned = False

    def _say(self, text: str) -> None:
        if self.notify is not None:
            self.notify(text)

    @property
    def entries(self) -> list[DiskEntry]:
        """The folder's readable prefix files, least recently used first (a file whose header cannot be read is
        removed, with a notice)."""
        if self._entries is None:
            found = []
            # (not the temporary files of a write under way, which begin with a dot: runtime/paths.py)
            for path in sorted(self.folder.glob(f"[!.]*{SUFFIX}")) if self.folder.is_dir() else []:
                try:
                    header, tokens = _read_head(path)
                    found.append((path.stat().st_mtime_ns, DiskEntry(path, tokens, bool(header["long"]),
                                                                     path.stat().st_size)))
                except (OSError, ValueError, KeyError, TypeError) as e:
                    self._drop(path, f"a saved conversation cache {path.name} cannot be read ({e}); it was removed")
            self._entries = [e for _, e in sorted(found, key=lambda f: f[0])]
        return self._entries

    def _drop(self, path: Path, why: str) -> None:
        try:
            path.unlink()
        except OSError:
            pass
        if self._entries is not None:
            self._entries = [e for e in self._entries if e.path != path]
        self._say(why)

    def best(self, prompt: torch.Tensor, long: bool, whole: bool = False) -> tuple[DiskEntry | None, int]:
        """The file sharing the longest prefix with `prompt` (its last token left to run), and that length
        (`whole`: only a file the prompt begins with whole, as a recurrent state needs)."""
        return longest_match(self.entries, prompt, long, whole=whole)

    def read(self, entry: DiskEntry, like: tuple[torch.Tensor, ...],
             positioned: tuple[bool, ...] | None = None) -> tuple[torch.Tensor, ...] | None:
        """The entry's tensors, memory-mapped, if they are what a cache snapshot `like` (of any length) is: the
        same dtypes and shapes but the positions' dimension (a recurrent state's, `positioned` False: the same
        shapes), and the checksum holds; else None, the file removed with a notice."""
        positioned = positioned if positioned is not None else (True,) * len(like)
        try:
            header, _ = _read_head(entry.path)
            size = entry.path.stat().st_size
            data = torch.from_file(str(entry.path), shared=False, size=size, dtype=torch.uint8)
            crc = 0
            for piece in torch.split(data[header["data"] :], 1 << 26):
                crc = zlib.crc32(piece.numpy(), crc)
            if crc != header["crc32"]:
                raise ValueError("its checksum does not match its contents")
            parts = []
            for spec, want, positions in zip(header["parts"], like, positioned, strict=True):
                dtype, shape, start = DTYPES[spec["dtype"]], tuple(spec["shape"]), int(spec["offset"])
                if bool(spec.get("positions", True)) != positions:
                    raise ValueError("it holds a recurrent state where this model's cache holds positions, or the "
                                     "reverse")
                same = _but_positions(shape) == _but_positions(tuple(want.shape)) if positions else \
                    shape == tuple(want.shape)
                if dtype != want.dtype or len(shape) != want.dim() or not same:
                    raise ValueError(f"it holds {spec['dtype']} {list(shape)}, not what this model's cache holds")
                if positions and shape[-2] != header["tokens"]:
                    raise ValueError(f"its tensors hold {shape[-2]} positions, not its {header['tokens']} tokens")
                count = 1
                for d in shape:
                    count *= d
                end = start + count * dtype.itemsize
                if start % ALIGN or end > size:
                    raise ValueError("it is shorter than its header says")
                parts.append(data[start:end].view(dtype).reshape(shape))
            return tuple(parts)
        except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
            self._drop(entry.path, f"the saved conversation cache {entry.path.name} was not used and was removed: {e}")
            return None

    def touch(self, entry: DiskEntry) -> None:
        """The entry was used: the most recently used now (its file's time too, which orders them across runs)."""
        try:
            os.utime(entry.path)
        except OSError:
            pass
        entries = self.entries
        if entry in entries:
            entries.remove(entry)
            entries.append(entry)

    def keep(self, tokens: torch.Tensor, long: bool, parts: tuple[torch.Tensor, ...],
             positioned: tuple[bool, ...] | None = None) -> None:
        """`write`, where a folder that cannot be written is said (once) rather than raised: the answer goes on,
        only without its copy on disk."""
        try:
            self.write(tokens, long, parts, positioned)
        except (StoreError, OSError) as e:
            if not self._warned:
                self._warned = True
                self._say(f"the conversation cache could not be saved: {e}")

    def write(self, tokens: torch.Tensor, long: bool, parts: tuple[torch.Tensor, ...],
              positioned: tuple[bool, ...] | None = None) -> None:
        """Keep a prefix (its tokens, LongRoPE's flag and a cache snapshot's tensors, in RAM; `positioned`: which
        hold positions, the others a recurrent state of the prefix's end): a file of its own, written atomically;
        files it makes useless (prefixes of it, where nothing holds a state) go, then the least recently used while
        over the budget. Raises StoreError when the folder cannot be written."""
        n = len(tokens)
        positioned = positioned if positioned is not None else (True,) * len(parts)
        state = not all(positioned)  # (a state is its end's: a longer file does not hold this one)
        if any(e.long == long and (len(e.tokens) == n if state else len(e.tokens) >= n) and
               bool((e.tokens[:n] == tokens).all()) for e in self.entries):
            return  # (held already, whole)
        specs = [{"dtype": str(p.dtype).removeprefix("torch."), "shape": list(p.shape), "positions": flag}
                 for p, flag in zip(parts, positioned, strict=True)]
        ids = tokens.to(torch.int64).contiguous()
        blobs = [ids, *(p.contiguous() for p in parts)]
        # the header, then each blob aligned; the data (and its checksum) from the first blob to the end
        head = 4096
        while True:
            data_start = len(MAGIC) + PREFIX_BYTES + head
            data_start += _pad(data_start)
            offset, layout, crc = data_start, [], 0
            for b in blobs:
                layout.append(offset)
                size = b.numel() * b.element_size()
                crc = zlib.crc32(b"\0" * _pad(offset + size), zlib.crc32(_bytes(b), crc))
                offset += size + _pad(offset + size)
            for spec, start in zip(specs, layout[1:], strict=True):
                spec["offset"] = start
            header = {"version": VERSION, "tokens": n, "long": long, "parts": specs, "data": data_start,
                      "ids": layout[0], "crc32": crc}
            text = json.dumps(header).encode()
            if len(text) <= head:
                break
            head = len(text) + 1024
        if offset > self.budget:
            return
        digest = hashlib.sha256(_bytes(ids)).hexdigest()[:32]
        path = self.folder / f"{digest}{'-long' if long else ''}{SUFFIX}"

        def fill(f: BinaryIO) -> None:
            f.write(MAGIC + struct.pack("<QI", len(text), zlib.crc32(text)) + text)
            f.write(b"\0" * (data_start - f.tell()))
            for b in blobs:
                f.write(_bytes(b))
                f.write(b"\0" * _pad(f.tell()))  # (f.tell() counts from the file's start, as the offsets do)

        atomic_write_with(path, fill)  # (before anything is removed for room: a write that fails loses nothing)
        for e in [e for e in self.entries if not state and e.long == long and len(e.tokens) <= n and e.path != path
                  and bool((tokens[: len(e.tokens)] == e.tokens).all())]:
            self._remove(e)  # (prefixes of this one: it holds them)
        self.entries.append(DiskEntry(path, ids.clone(), long, offset))
        while len(self.entries) > 1 and sum(e.nbytes for e in self.entries) > self.budget:
            self._remove(self.entries[0])  # (the least recently used; never the one just written, the last)

    def _remove(self, entry: DiskEntry) -> None:
        try:
            entry.path.unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            raise StoreError(f"cannot remove {entry.path} ({e.strerror or e}); fix the folder's permissions") from None
        self.entries.remove(entry)


def _but_positions(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A snapshot's shape without its positions' dimension, second from the end in every cache's (KVCache
    [layers, Hkv, n, D], LatentCache [layers, n, C + Dr])."""
    return shape[:-2] + shape[-1:]


def _bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy()).cast("B")


def _read_head(path: Path) -> tuple[dict[str, Any], torch.Tensor]:
    """A prefix file's header (checked for its kind, version and fields) and its token ids."""
    with open_regular(path) as f:
        start = f.read(len(MAGIC) + PREFIX_BYTES)
        if len(start) < len(MAGIC) + PREFIX_BYTES or start[: len(MAGIC)] != MAGIC:
            raise ValueError("it is not a Tandem conversation cache")
        length, crc = struct.unpack("<QI", start[len(MAGIC) :])
        if length > HEADER_MOST:
            raise ValueError("its header is too long")
        text = f.read(length)
        if len(text) != length or zlib.crc32(text) != crc:
            raise ValueError("its header is damaged")
        try:
            header = json.loads(text)
        except ValueError:  # (UnicodeDecodeError is one)
            raise ValueError("its header is damaged") from None
        if not isinstance(header, dict) or header.get("version") != VERSION:
            raise ValueError("it was written by another version of Tandem")
        n, ids = header["tokens"], header["ids"]
        if not (isinstance(n, int) and isinstance(ids, int) and 0 < n and ids >= len(MAGIC) + PREFIX_BYTES + length):
            raise ValueError("its header is damaged")
        f.seek(ids)
        raw = f.read(8 * n)
        if len(raw) != 8 * n:
            raise ValueError("it is shorter than its header says")
    return header, torch.frombuffer(bytearray(raw), dtype=torch.int64)

