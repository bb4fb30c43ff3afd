"""A GGUF file's header (metadata and tensor table) read without trusting it.

Every count, length, type id, dimension and offset is checked against the file and against sane bounds before
anything is built from it, and what llama.cpp's loader refuses is refused here too, as a `CheckpointError` naming
the file and what is wrong: a version other than 2 or 3, a metadata key given twice, a value type out of range, an
array of arrays, a `general.alignment` that is not a power of two, a tensor name longer than llama.cpp's 63 bytes or
given twice, more than 4 dimensions, a row that is not whole blocks, tensor data that is misaligned, overlaps
another tensor's, leaves a gap between them or lies past the end of the file.

Metadata arrays are walked (their lengths checked) but not parsed: `meta` holds a `GGUFArray` (item type, length)
for each; the tokenizer reads its own arrays (tokens, merges) through the gguf package.

Layout (little-endian): "GGUF", version u32, tensor count u64, key count u64; each key: string, type u32, value;
each tensor: name string, n_dims u32, dims u64 × n_dims (innermost first), type u32, offset u64 (from the data
section, which starts at the next multiple of the alignment after the table). A string is a u64 length and bytes.
"""

from __future__ import annotations

import math
import mmap
import os
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.kernels.errors import CheckpointError

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # version 1 had 32-bit counts; llama.cpp reads 2 and 3 only
DEFAULT_ALIGNMENT = 32  # GGUF_DEFAULT_ALIGNMENT
MAX_DIMS = 4  # GGML_MAX_DIMS
NAME_MOST = 63  # bytes in a tensor name (GGML_MAX_NAME is 64, with its terminating zero)
KEY_MOST = 1 << 16  # bytes in a metadata key (real ones are under 100)
STRING_MOST = 64 << 20  # bytes in a metadata string (a chat template is tens of KB)
ARRAY_MOST = 1 << 20  # items in a metadata array (the largest vocabularies and merge lists are under 600 000)
TENSORS_MOST = 1 << 20  # tensors in one file (the largest models hold a few thousand)
KEYS_MOST = 1 << 16  # metadata keys in one file (real ones hold under 100)
PREFIX = 24  # magic, version and the two counts

# GGUFValueType: struct format of each scalar type; 8 is a string, 9 an array
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY, BOOL = 8, 9, 7
FLOAT_TYPES = (6, 12)
U32, U64 = struct.Struct("<I"), struct.Struct("<Q")


@dataclass(frozen=True)
class GGUFArray:
    """A metadata array, walked but not parsed: its item type (GGUFValueType) and length; a short array of numbers
    or booleans (per-layer values: Gemma 4's key/value heads, its sliding layers) with its items."""

    item_type: int
    count: int
    values: tuple[Any, ...] | None = field(default=None, compare=False)


VALUES_MOST = 4096  # items of a numeric array read in full (one per layer, or per rotated pair of dims)


@dataclass(frozen=True)
class TensorEntry:
    """One row of the tensor table, checked: `dims` innermost first (as GGML lists them), `offset` in the file."""

    name: str
    type_id: int
    dims: tuple[int, ...]
    offset: int  # from the start of the file
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    version: int
    alignment: int
    meta: dict[str, Any]  # plain Python values (int, float, bool, str) or a GGUFArray
    tensors: list[TensorEntry]
    data_start: int
    size: int  # bytes in the file


def block_sizes() -> dict[int, tuple[int, int]]:
    """GGML type id -> (values a block, bytes a block), from the gguf package's table."""
    from gguf import GGML_QUANT_SIZES

    return {int(k): v for k, v in GGML_QUANT_SIZES.items()}


def open_regular(path: Path) -> int:
    """A read-only descriptor of `path`, which must be a regular file: opened without waiting (a FIFO would block
    until a writer came), then checked on the descriptor itself (no race with a file swapped in meanwhile)."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # (a device is not even opened: opening some has effects)
            raise CheckpointError(f"{path} is not a regular file (a FIFO, device or folder); pass the GGUF file itself")
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except OSError as e:
        raise CheckpointError(f"cannot open {path}: {e.strerror or e}; check the path and its permissions") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CheckpointError(f"{path} is not a regular file (a FIFO, device or folder); pass the GGUF file itself")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_header(path: Path, copy_on_write: bool = False) -> tuple[GGUFHeader, mmap.mmap]:
    """The checked header of a GGUF file and the file's memory map: read-only, or with `copy_on_write` writable
    views of the tensors as the checkpoint maps them (made only once the header is found sound, from the same
    descriptor; where the system refuses a private map that large, read-only). The caller closes the map."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size < PREFIX:
            raise CheckpointError(f"{path} holds {size} bytes, too few for a GGUF file; re-download it")
        mapped = _map(path, fd, mmap.ACCESS_READ)
        try:
            header = _Parser(path, mapped).header()
        except BaseException:
            mapped.close()
            raise
        if copy_on_write:
            try:
                private = mmap.mmap(fd, 0, access=mmap.ACCESS_COPY)
            except OSError:  # (a private map counts against the commit limit; a shared read-only one does not)
                return header, mapped
            mapped.close()
            return header, private
        return header, mapped
    finally:
        os.close(fd)


def _map(path: Path, fd: int, access: int) -> mmap.mmap:
    try:
        return mmap.mmap(fd, 0, access=access)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot map {path}: {e}; check that it is a complete file") from None


def header_of(path: Path) -> GGUFHeader:
    """The checked header alone (the map closed)."""
    header, mapped = read_header(path)
    mapped.close()
    return header


class _Parser:
    """Reads the header from the map, every read checked against the file's end."""

    def __init__(self, path: Path, buf: mmap.mmap) -> None:
        self.path, self.buf, self.pos, self.end = path, buf, 0, len(buf)

    def fail(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path} is not a valid GGUF file: {what}; re-download it (or convert it again "
                               "with llama.cpp)")

    def take(self, n: int, what: str) -> int:
        """Advance over n bytes; the offset they start at."""
        at = self.pos
        if n < 0 or at + n > self.end:
            raise self.fail(f"{what} at byte {at} runs past the end of the file ({self.end} bytes): it is truncated "
                            "or the header is corrupt")
        self.pos = at + n
        return at

    def u32(self, what: str) -> int:
        return int(U32.unpack_from(self.buf, self.take(4, what))[0])

    def u64(self, what: str) -> int:
        return int(U64.unpack_from(self.buf, self.take(8, what))[0])

    def string(self, what: str, most: int) -> str:
        n = self.u64(f"the length of {what}")
        if n > most:
            raise self.fail(f"{what} is {n} bytes long, more than the {most} such a string may be")
        at = self.take(n, what)
        try:
            return bytes(self.buf[at : at + n]).decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what} at byte {at} is not UTF-8 text") from None

    def header(self) -> GGUFHeader:
        if self.buf[:4] != MAGIC:
            raise self.fail(f"it starts with {bytes(self.buf[:4])!r}, not {MAGIC!r}")
        self.pos = 4
        version = self.u32("the version")
        if version not in VERSIONS:
            hint = " (a big-endian file: Tandem reads little-endian ones)" if version & 0xFFFF == 0 else ""
            raise self.fail(f"version {version}{hint}; Tandem, as llama.cpp, reads versions 2 and 3")
        n_tensors, n_keys = self.u64("the tensor count"), self.u64("the key count")
        left = self.end - self.pos
        if n_keys > min(KEYS_MOST, left // 13):  # a key is at least a length, a type and one byte
            raise self.fail(f"it claims {n_keys} metadata keys, more than the file ({self.end} bytes) could hold")
        if n_tensors > min(TENSORS_MOST, left // 32):  # a tensor is at least a name, one dimension, type and offset
            raise self.fail(f"it claims {n_tensors} tensors, more than the file ({self.end} bytes) could hold")
        meta = self.metadata(n_keys)
        alignment = meta.get("general.alignment", DEFAULT_ALIGNMENT)
        if isinstance(alignment, GGUFArray) or isinstance(alignment, bool) or not isinstance(alignment, int) \
                or alignment <= 0 or alignment & (alignment - 1) or alignment > 1 << 20:
            raise self.fail(f"general.alignment is {alignment!r}, not a power of two")
        entries = [self.tensor_info(i) for i in range(n_tensors)]
        data_start = -(-self.pos // alignment) * alignment
        tensors = self.place(entries, data_start, alignment)
        return GGUFHeader(self.path, version, alignment, meta, tensors, data_start, self.end)

    def metadata(self, n_keys: int) -> dict[str, Any]:
        meta: dict[str, Any] = {}
        for i in range(n_keys):
            key = self.string(f"metadata key {i}", KEY_MOST)
            if key in meta:
                raise self.fail(f"metadata key {key!r} is given twice")
            kind = self.u32(f"the type of {key}")
            if kind == ARRAY:
                meta[key] = self.array(key)
            elif key == "general.alignment" and kind != 4:
                raise self.fail("general.alignment is not a uint32, as llama.cpp requires")
            else:
                meta[key] = self.scalar(kind, key)
        return meta

    def scalar(self, kind: int, key: str) -> Any:
        if kind == STRING:
            return self.string(f"the value of {key}", STRING_MOST)
        fmt = SCALARS.get(kind)
        if fmt is None:
            raise self.fail(f"{key} has value type {kind}, not one of GGUF's (0-12)")
        (value,) = struct.unpack_from(fmt, self.buf, self.take(struct.calcsize(fmt), f"the value of {key}"))
        if kind == BOOL:
            if value > 1:
                raise self.fail(f"{key} is a boolean of value {value}, not 0 or 1")
            return bool(value)
        return value

    def array(self, key: str) -> GGUFArray:
        """Walk an array without building it: fixed-size items skipped at once, strings one length at a time."""
        item = self.u32(f"the item type of {key}")
        count = self.u64(f"the length of {key}")
        if item == ARRAY:
            raise self.fail(f"{key} is an array of arrays, which GGUF models do not hold")
        if item != STRING and item not in SCALARS:
            raise self.fail(f"{key} is an array of value type {item}, not one of GGUF's (0-12)")
        if count > ARRAY_MOST:
            raise self.fail(f"{key} holds {count} items, more than the {ARRAY_MOST} a model's metadata needs")
        if item != STRING:
            size = struct.calcsize(SCALARS[item])
            at = self.take(count * size, f"the items of {key}")
            values = None
            if count <= VALUES_MOST:
                values = struct.unpack_from(f"<{count}{SCALARS[item][1]}", self.buf, at)
                values = tuple(bool(v) for v in values) if item == BOOL else values
            return GGUFArray(item, count, values)
        buf, pos, end, unpack = self.buf, self.pos, self.end, U64.unpack_from
        for i in range(count):
            if pos + 8 > end:
                self.pos = pos
                self.take(8, f"the length of item {i} of {key}")
            n = unpack(buf, pos)[0]
            pos += 8 + n
            if pos > end or n > STRING_MOST:
                raise self.fail(f"item {i} of {key} ({n} bytes) runs past the end of the file: it is truncated or "
                                "the header is corrupt")
        self.pos = pos
        return GGUFArray(item, count)

    def tensor_info(self, i: int) -> tuple[str, tuple[int, ...], int, int]:
        name = self.string(f"the name of tensor {i}", 1 << 16)
        if not name or len(name.encode()) > NAME_MOST:
            raise self.fail(f"tensor {i}'s name {name[:80]!r} is empty or longer than llama.cpp's {NAME_MOST} bytes")
        n_dims = self.u32(f"the dimension count of {name}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise self.fail(f"tensor {name} has {n_dims} dimensions; GGML tensors have 1 to {MAX_DIMS}")
        dims = tuple(self.u64(f"a dimension of {name}") for _ in range(n_dims))
        # (llama.cpp's limit: the element count fits an int64; and the nonzero dimensions' product, which numpy counts
        # even for an empty array, far below it: a zero dimension must not let the others describe an array no one
        # can make)
        if any(d >= 1 << 62 for d in dims) or math.prod(d for d in dims if d) >= 1 << 59:
            raise self.fail(f"tensor {name} has dimensions {list(dims)}, far past any model's")
        kind = self.u32(f"the type of {name}")
        offset = self.u64(f"the offset of {name}")
        return name, dims, kind, offset

    def place(self, entries: list[tuple[str, tuple[int, ...], int, int]], data_start: int,
              alignment: int) -> list[TensorEntry]:
        """Each tensor's bytes, checked as llama.cpp checks them: its type known and rows whole blocks; its offset
        the one the tensors before it lead to (aligned, no overlap, no gap); its data inside the file."""
        sizes = block_sizes()
        seen: set[str] = set()
        out: list[TensorEntry] = []
        expected = 0
        for name, dims, kind, offset in entries:
            if name in seen:
                raise self.fail(f"tensor {name} is listed twice")
            seen.add(name)
            if kind not in sizes:
                raise self.fail(f"tensor {name} has type id {kind}, not a GGML type this version knows")
            values, nbytes_block = sizes[kind]
            if dims[0] % values:
                raise self.fail(f"tensor {name}'s rows ({dims[0]} values) are not whole blocks of {values}")
            elements = 1
            for d in dims:
                elements *= d
            nbytes = elements // values * nbytes_block
            if offset != expected:
                why = "misaligned" if offset % alignment else "overlapping another tensor or leaving a gap"
                after = f" (where {out[-1].name}, of type {out[-1].type_id}, ends)" if out else ""
                raise self.fail(f"tensor {name} starts at data offset {offset}, expected {expected}{after}: {why}")
            if data_start + offset + nbytes > self.end:
                raise self.fail(f"tensor {name} ({nbytes} bytes at data offset {offset}) runs past the end of the "
                                f"file ({self.end} bytes): it is truncated")
            out.append(TensorEntry(name, kind, dims, data_start + offset, nbytes))
            expected = offset + -(-nbytes // alignment) * alignment
        return out
