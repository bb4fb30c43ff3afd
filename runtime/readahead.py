"""Read-ahead of memory-mapped experts (MoE-Infinity's prefetch on a machine without an accelerator).

Where experts stay in their files (a model larger than RAM: `CpuOptions.experts_in_ram` is off), each expert's first
read after the page cache dropped it waits for the disk, one page fault at a time. The experts predicted for the next
MoE layers (runtime/prefetch.py) are handed to the kernel with `madvise(MADV_WILLNEED)`, which starts reading their
pages in the background: by the time their router asks, they are in memory, or on their way. A wrong guess costs
disk bandwidth and page cache, never an answer. Linux only (elsewhere nothing is advised).
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Iterable

import torch

MADV_WILLNEED = 3  # <sys/mman.h> on Linux
MADV_DONTNEED = 4
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _madvise()


def spans(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    """The page-aligned (address, length) ranges the tensors' bytes lie in (contiguous tensors; others skipped)."""
    out = []
    for t in tensors:
        if not t.is_contiguous() or t.device.type != "cpu" or t.numel() == 0:
            continue
        start = t.data_ptr()
        end = start + t.numel() * t.element_size()
        first = start - start % PAGE
        out.append((first, end - first))
    return out


def in_files(ranges: Iterable[tuple[int, int]]) -> bool:
    """Whether every range lies in a mapping of a file (/proc/self/maps): RAM copies are not, and must never be read
    ahead or dropped as if they were. False where that cannot be read."""
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
            maps = []
            for line in f:
                fields = line.split(maxsplit=5)
                if len(fields) == 6 and fields[5].strip().startswith("/") and fields[4] != "0":  # a file's (inode)
                    low, high = fields[0].split("-")
                    maps.append((int(low, 16), int(high, 16)))
    except OSError:
        return False
    return all(any(low <= start and start + length <= high for low, high in maps) for start, length in ranges)


def will_need(ranges: Iterable[tuple[int, int]]) -> int:
    """Ask the kernel to start reading these ranges' pages; returns how many ranges it took (0 where madvise is not
    available). A range it refuses (not a mapping any more) is let be: advice only."""
    return _advise(ranges, MADV_WILLNEED)


def _advise(ranges: Iterable[tuple[int, int]], advice: int) -> int:
    if _MADVISE is None:
        return 0
    taken = 0
    for address, length in ranges:
        taken += _MADVISE(address, length, advice) == 0
    return taken


def drop(ranges: Iterable[tuple[int, int]], files: Iterable[str]) -> None:
    """For a benchmark of a model larger than RAM: these ranges unmapped from this process's page tables, then the
    files' pages dropped from the page cache (clean pages: nothing is lost), so the next read waits for the disk."""
    _advise(ranges, MADV_DONTNEED)
    for name in files:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
