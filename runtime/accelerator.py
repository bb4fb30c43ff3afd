"""The accelerator tier: where non-expert weights, the KV cache and cached experts live.

All orchestration is written once against `Accelerator`. Two implementations:
- `CudaAccelerator`: device memory, a side stream for weight copies fed from pinned staging buffers,
  events to order copies after the compute that last read a slot.
- `EmulatedAccelerator`: the CPU plays the GPU, with its own memory budget in bytes, a background
  thread as the copy engine and another as the compute stream — the same bookkeeping, so tests
  exercise every GPU code path on a machine without one.
Both count bytes moved host->device (h2d) and device->host (d2h).
"""

from __future__ import annotations

import ctypes
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import cache
from typing import Any, TypeVar

import torch

from tandem.kernels.errors import ResourceError

T = TypeVar("T")
GIB = 1024**3


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@cache
def _openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime torch runs on (already loaded: the same library by name), or None without one."""
    try:
        return ctypes.CDLL("libgomp.so.1")
    except OSError:
        return None


def _single_threaded() -> None:
    """Torch work on this thread (copies, the emulated device's compute) uses one core. Not
    `torch.set_num_threads(1)`: that also sets the default every thread started later takes (the chat app loads
    and answers on new threads). OpenMP's setting is per thread: torch first sets this thread up from the
    default, then its own count is lowered. Without OpenMP the thread keeps the default (slower, not wrong)."""
    torch.get_num_threads()
    omp = _openmp()
    if omp is not None:
        omp.omp_set_num_threads(1)


def human(size: float) -> str:
    return f"{size / GIB:.2f} GiB" if size >= GIB / 10 else f"{size / 1024**2:.1f} MiB"


class Accelerator(ABC):
    name: str
    device: torch.device

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.used = 0
        self.bytes_h2d = 0
        self.bytes_d2h = 0
        self._lock = threading.Lock()  # byte counters are touched by the copy thread too
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.name}-copy",
                                          initializer=_single_threaded)

    # -- memory -------------------------------------------------------------------------------
    def reserve(self, size: int, what: str) -> None:
        if self.used + size > self.budget:
            raise ResourceError(
                f"{what} needs {human(size)} of accelerator memory but only "
                f"{human(self.budget - self.used)} of the {human(self.budget)} budget is left; "
                "raise --vram-gb, lower --context, or use --accelerator none"
            )
        self.used += size

    @property
    def free(self) -> int:
        return self.budget - self.used

    def empty(self, shape: Sequence[int], dtype: torch.dtype, what: str) -> torch.Tensor:
        t = torch.empty(tuple(shape), dtype=dtype, device=self.device)
        self.reserve(nbytes(t), what)
        return t

    def place(self, t: torch.Tensor, dtype: torch.dtype, what: str) -> torch.Tensor:
        """A weight that lives on the accelerator for the whole run (copied once, accounted)."""
        out = t.to(device=self.device, dtype=dtype)
        self.reserve(nbytes(out), what)
        self._count(h2d=nbytes(out))
        return out

    # -- activations ----------------------------------------------------------------------------
    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        self._count(d2h=nbytes(t))
        return self._to_host(t)

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        self._count(h2d=nbytes(t))
        return self._to_device(t)

    # -- weight copies (the side stream) --------------------------------------------------------
    def copy_async(self, dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> Future[None]:
        """Copy host weights into device buffers in the background; the future completes after the copy."""
        fence = self._fence()
        return self._copier.submit(self._copy_job, list(dst), list(src), fence)

    def copy_now(self, dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
        self.copy_async(dst, src).result()

    def _copy_job(self, dst: list[torch.Tensor], src: list[torch.Tensor], fence: Any) -> None:
        for d, s in zip(dst, src, strict=True):
            self._copy(d, s, fence)
            self._count(h2d=nbytes(d))

    # -- compute --------------------------------------------------------------------------------
    @abstractmethod
    def submit(self, fn: Callable[[], T]) -> Future[T]:
        """Launch device work without waiting for it; the future's result is the device tensor."""

    def close(self) -> None:
        self._copier.shutdown(wait=True)

    def _count(self, h2d: int = 0, d2h: int = 0) -> None:
        with self._lock:
            self.bytes_h2d += h2d
            self.bytes_d2h += d2h

    @abstractmethod
    def _to_host(self, t: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def _to_device(self, t: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def _fence(self) -> Any:
        """A marker after all device work queued so far (a copy into a slot waits for it)."""

    @abstractmethod
    def _copy(self, dst: torch.Tensor, src: torch.Tensor, fence: Any) -> None: ...


class EmulatedAccelerator(Accelerator):
    """The CPU standing in for a GPU: separate budget, copy thread, compute thread."""

    name = "emulated"
    device = torch.device("cpu")

    def __init__(self, budget: int, copy_delay_s: float = 0.0) -> None:
        super().__init__(budget)
        self.copy_delay_s = copy_delay_s  # tests slow the copy engine down to widen race windows
        # One intra-op thread: the stand-in device must not fight the CPU experts for the cores.
        self._stream = ThreadPoolExecutor(max_workers=1, thread_name_prefix="emulated-compute",
                                          initializer=_single_threaded)

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        return self._stream.submit(fn)

    def close(self) -> None:
        super().close()
        self._stream.shutdown(wait=True)

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        return t.clone()

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.clone()

    def _fence(self) -> None:
        return None  # device work is finished (its future waited on) before a slot is refilled

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, fence: None) -> None:
        if self.copy_delay_s:
            threading.Event().wait(self.copy_delay_s)
        dst.copy_(src)


class CudaAccelerator(Accelerator):  # pragma: no cover - no GPU on test machines; mirrored by Emulated
    name = "cuda"

    def __init__(self, budget: int, index: int = 0) -> None:
        self.device = torch.device("cuda", index)
        super().__init__(budget)
        self._side = torch.cuda.Stream(device=self.device)
        self._staging: dict[tuple[torch.Size, torch.dtype], torch.Tensor] = {}

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        fut: Future[T] = Future()
        fut.set_result(fn())  # kernels are queued on the current stream; reading the result syncs
        return fut

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        return t.to("cpu")

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=True)

    def _fence(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, fence: torch.cuda.Event) -> None:
        key = (dst.shape, dst.dtype)
        if key not in self._staging:
            self._staging[key] = torch.empty(dst.shape, dtype=dst.dtype, pin_memory=True)
        staging = self._staging[key]
        staging.copy_(src)  # mmap'd (pageable) weights -> pinned buffer, converting dtype if needed
        with torch.cuda.stream(self._side):
            self._side.wait_event(fence)  # never overwrite a slot that queued kernels still read
            dst.copy_(staging, non_blocking=True)
        self._side.synchronize()  # staging is reused by the next copy; the future completes after this


def cuda_usable() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def make_accelerator(kind: str, vram_gb: float | None) -> Accelerator | None:
    """`auto` picks CUDA when usable, else none (CPU only). `--vram-gb` sets or caps the budget."""
    if kind == "auto":
        kind = "cuda" if cuda_usable() else "none"
    if kind == "none":
        return None
    if kind == "emulated":
        if vram_gb is None:
            raise ResourceError("--accelerator emulated needs --vram-gb to size the emulated device memory")
        return EmulatedAccelerator(int(vram_gb * GIB))
    if kind == "cuda":
        if not cuda_usable():
            raise ResourceError("--accelerator cuda: no usable CUDA device (driver or GPU missing); use auto or none")
        free, _total = torch.cuda.mem_get_info()  # pragma: no cover
        budget = free if vram_gb is None else min(free, int(vram_gb * GIB))  # pragma: no cover
        return CudaAccelerator(budget)  # pragma: no cover
    raise ResourceError(f"unknown accelerator {kind!r}; choose auto, none, cuda or emulated")
