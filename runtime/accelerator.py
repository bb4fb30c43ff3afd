"""The accelerator tier: where non-expert weights, the KV cache and cached experts live.

All orchestration is written once against `Accelerator`, in CUDA's terms:
- `submit` queues device work on the compute stream, in order, without waiting for it; `after=` makes the
  stream (not the host) wait for weight copies first.
- `download` copies device tensors to host memory behind the queued work; `HostRead.wait` is a host
  synchronisation, and so is `join` where the device runs apart from the caller.
- `copy_async` puts weights on the copy engine: a background copier (post-fetches) and a demand copier (a
  copy a kernel is about to read, never queued behind post-fetches). A copy waits, on the device, for the
  work queued before it (a slot is never overwritten while a kernel reads it). A copier queues a copy
  straight from host memory that is pinned (`pin`), else through a pinned staging ring: it converts the
  weights into a ring buffer, which it may reuse only once the copy that last read it has run; so
  queuing can take as long as the copies before it, and `submit(after=...)` holds the host that long
  (a stream can only wait for an event already recorded).
- `slab` is device memory for many equal pieces at once (the expert slots): one allocation, so that the
  device's allocator rounds it once rather than once a slot (PyTorch's caching allocator reserves 8-20 %
  more than asked for tensors of 1-12 MiB).
Two implementations:
- `CudaAccelerator`: device memory, two side streams fed from pinned staging rings, events; no
  `synchronize()` anywhere but the host reads. The events a copier or the host waits on for long block
  the waiting thread rather than spin on a core the CPU experts need.
- `EmulatedAccelerator`: the CPU plays the GPU with its own memory budget in bytes, and does what CUDA does
  in the same order, so that tests here see what a GPU would: one thread is the compute stream (work runs
  there asynchronously, in order), two play the copy engine's side streams, and two the copiers that
  stage and queue onto them, with threading events for CUDA's. Its caller's own thread plays the default
  stream of the dense layers, so it joins the expert stream with a wait where CUDA would only order two
  streams.
Both count host synchronisations (`syncs`; of them the emulated device's joins, `joins`, which CUDA does not
have) and bytes moved host->device (h2d) and device->host (d2h).
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from tandem.kernels.errors import ResourceError
from tandem.kernels.openmp import openmp

T = TypeVar("T")
GIB = 1024**3
STAGING = 2  # pinned staging buffers per copier: one is filled from RAM while the other's DMA runs


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _single_threaded() -> None:
    """Torch work on this thread (copies, the emulated device's compute) uses one core. Not
    `torch.set_num_threads(1)`: that also sets the default every thread started later takes (the chat app loads
    and answers on new threads). OpenMP's setting is per thread: torch first sets this thread up from the
    default, then its own count is lowered. Without OpenMP the thread keeps the default (slower, not wrong)."""
    torch.get_num_threads()
    omp = openmp()
    if omp is not None:
        omp.omp_set_num_threads(1)


def human(size: float) -> str:
    if size >= GIB / 10:
        return f"{size / GIB:.2f} GiB"
    return f"{size / 1024**2:.1f} MiB" if size >= 1024**2 / 10 else f"{size / 1024:.1f} KiB"


def done(value: T) -> Future[T]:
    fut: Future[T] = Future()
    fut.set_result(value)
    return fut


class Copy:
    """Weights on their way to device buffers. `done()` asks without waiting; `result()` waits on the host (a
    synchronisation, raising the copy's error); `submit(after=...)` makes the device wait instead."""

    def __init__(self, accel: Accelerator, future: Future[Any]) -> None:
        self.accel, self.future = accel, future  # the copier's job; its result is the device event, if any

    def done(self) -> bool:
        if not self.future.done():
            return False
        return self.future.exception() is not None or self.accel._finished(self.future.result())

    def exception(self) -> BaseException | None:
        """The copy's error once it is known: its queuing's, or (emulated device) its own."""
        if not self.future.done():
            return None
        return self.future.exception() or getattr(self.future.result(), "error", None)

    def result(self, timeout: float | None = None) -> None:
        self.accel._synced()
        self.accel._host_wait(self.future.result(timeout))


class HostRead:
    """Device tensors on their way to host memory; `wait()` is the host's synchronisation for them."""

    def __init__(self, accel: Accelerator, future: Future[tuple[torch.Tensor, ...]], event: Any = None) -> None:
        self.accel, self.future, self.event = accel, future, event

    def wait(self) -> tuple[torch.Tensor, ...]:
        self.accel._synced()
        return self.collect()

    def collect(self) -> tuple[torch.Tensor, ...]:
        """The host copies, once a host read after them has waited already (no synchronisation of its own)."""
        out = self.future.result()
        self.accel._host_wait(self.event)
        return out


class StagingRing:
    """Host buffers a copier converts weights into before the device reads them: `STAGING` in turn, each reused
    only after the copy that last read it has finished (`wait` on its event); grown to the largest tensor."""

    def __init__(self, pinned: bool, wait: Callable[[Any], None]) -> None:
        self.pinned, self.wait = pinned, wait
        self.buffers: list[torch.Tensor] = [torch.empty(0, dtype=torch.uint8) for _ in range(STAGING)]
        self.events: list[Any] = [None] * STAGING
        self.turn = 0

    def stage(self, src: torch.Tensor, dtype: torch.dtype) -> tuple[int, torch.Tensor]:
        """src converted to `dtype` in the next buffer; returns (buffer number, the staged tensor)."""
        k, self.turn = self.turn, (self.turn + 1) % STAGING
        self.wait(self.events[k])  # its last copy has read it
        size = src.numel() * dtype.itemsize
        if self.buffers[k].numel() < size:
            self.buffers[k] = torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)
        staged = self.buffers[k][:size].view(dtype).view(src.shape)
        staged.copy_(src)  # RAM (often memory-mapped, pageable) -> staging, converting the dtype
        return k, staged

    def release(self, k: int, event: Any) -> None:
        self.events[k] = event


class Accelerator(ABC):
    name: str
    device: torch.device

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.used = 0
        self.bytes_h2d = 0
        self.bytes_d2h = 0
        self.syncs = 0  # times the host waited for the device (host reads, joins, copies waited on)
        # of them, the emulated device's joins: its host runs the dense layers and waits for its expert stream, where
        # CUDA orders the two streams on the device and the host waits for nothing
        self.joins = 0
        self.allocations = 0  # device allocations made (each one the device's allocator rounds up on its own)
        self._lock = threading.Lock()  # byte counters are touched by the copy threads too
        # post-fetches on one copier; a copy a kernel waits for on the other, never behind them
        self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.name}-copy",
                                          initializer=_single_threaded)
        self._demand = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.name}-demand",
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
        size = dtype.itemsize
        for n in shape:
            size *= n
        return self._allocate(size, what, lambda: torch.empty(tuple(shape), dtype=dtype, device=self.device))

    def place(self, t: torch.Tensor, dtype: torch.dtype, what: str) -> torch.Tensor:
        """A weight that lives on the accelerator for the whole run (copied once, accounted)."""
        out = self._allocate(t.numel() * dtype.itemsize, what, lambda: t.to(device=self.device, dtype=dtype))
        self._count(h2d=nbytes(out))
        return out

    def slab(self, size: int, what: str) -> torch.Tensor:
        """`size` bytes of device memory in one allocation (uint8), for the caller to cut into views."""
        return self._allocate(size, what, lambda: torch.empty(size, dtype=torch.uint8, device=self.device))

    def pin(self, tensors: Sequence[torch.Tensor]) -> int:
        """Pin the host memory these tensors are in (each storage once), so that copies from it go straight to the
        device instead of through a staging ring; returns the bytes pinned (0 where nothing can be: the emulated
        device, memory already pinned or mapped from a file, a refusal)."""
        return 0

    def _allocate(self, size: int, what: str, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Checked against the budget before the device is asked; the device running out anyway (another
        program took its memory) is the same error."""
        self.reserve(size, what)
        self.allocations += 1
        try:
            return make()
        except torch.OutOfMemoryError as e:
            self.used -= size
            raise ResourceError(f"the accelerator ran out of memory for {what} ({human(size)}): another program "
                                "may hold it; lower --vram-gb or use --accelerator none") from e

    # -- activations ----------------------------------------------------------------------------
    def download(self, fn: Callable[[], Sequence[torch.Tensor]]) -> HostRead:
        """Host copies of the device tensors `fn` returns, behind all queued device work; wait() for them."""
        return self._download(fn)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        return self.download(lambda: (t,)).wait()[0]

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor on the device, without the host waiting for the copy."""
        self._count(h2d=nbytes(t))
        return self._to_device(t)

    # -- weight copies (the copy engine) ----------------------------------------------------------
    def copy_async(self, dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], demand: bool = False) -> Copy:
        """Copy host weights into device buffers on the copy engine, after the device work queued so far.
        `demand`: a kernel is about to read them (the demand copier, not queued behind post-fetches)."""
        fence = self._fence()
        copier, ring = (self._demand, self._rings[1]) if demand else (self._copier, self._rings[0])
        return Copy(self, copier.submit(self._copy_job, list(dst), list(src), fence, ring, demand))

    def copy_now(self, dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
        self.copy_async(dst, src, demand=True).result()

    # -- compute --------------------------------------------------------------------------------
    @abstractmethod
    def submit(self, fn: Callable[[], T], after: Sequence[Copy] = ()) -> Future[T]:
        """Queue device work on the compute stream, after `after`'s copies, without the host waiting; the
        future's result is its device value (read it only from later device work, or through `join`)."""

    @abstractmethod
    def join(self, fut: Future[T]) -> T:
        """Submitted work's result for the caller's own device work (the dense layers) to go on with."""

    def close(self) -> None:
        self._copier.shutdown(wait=True)
        self._demand.shutdown(wait=True)

    def _count(self, h2d: int = 0, d2h: int = 0) -> None:
        with self._lock:
            self.bytes_h2d += h2d
            self.bytes_d2h += d2h

    def _synced(self) -> None:
        self.syncs += 1

    _rings: tuple[StagingRing, StagingRing]

    @abstractmethod
    def _download(self, fn: Callable[[], Sequence[torch.Tensor]]) -> HostRead: ...

    @abstractmethod
    def _to_device(self, t: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def _fence(self) -> Any:
        """A marker after all device work queued so far (a copy into a slot waits for it)."""

    @abstractmethod
    def _copy_job(self, dst: list[torch.Tensor], src: list[torch.Tensor], fence: Any, ring: StagingRing,
                  demand: bool) -> Any:
        """On a copier thread: wait (on the device) for the fence, then copy; returns the copy's event, or None."""

    @abstractmethod
    def _finished(self, event: Any) -> bool:
        """Whether the device has passed `event` (without waiting)."""

    @abstractmethod
    def _host_wait(self, event: Any) -> None:
        """The host waits until the device has passed `event` (None: nothing to wait for)."""


class _Arrival(threading.Event):
    """The emulated device's event: set when its stream gets there; `error`, what the work before it raised."""

    error: BaseException | None = None


class EmulatedAccelerator(Accelerator):
    """The CPU standing in for a GPU: separate budget, a compute stream thread, copy threads (see the module)."""

    name = "emulated"
    device = torch.device("cpu")

    def __init__(self, budget: int, copy_delay_s: float = 0.0) -> None:
        super().__init__(budget)
        self.copy_delay_s = copy_delay_s  # tests slow the copy engine down to widen race windows
        # One intra-op thread each: the stand-in device must not fight the CPU experts for the cores.
        self._stream = ThreadPoolExecutor(max_workers=1, thread_name_prefix="emulated-compute",
                                          initializer=_single_threaded)
        self._sides = tuple(ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"emulated-{name}-dma",
                                               initializer=_single_threaded) for name in ("copy", "demand"))
        self._rings = (StagingRing(False, self._host_wait), StagingRing(False, self._host_wait))

    def submit(self, fn: Callable[[], T], after: Sequence[Copy] = ()) -> Future[T]:
        arrivals = [copy.future.result() for copy in after]  # the host waits until each copy is queued (as CUDA)

        def run() -> T:
            for arrival in arrivals:
                self._host_wait(arrival)  # the stream waits for the copy
            return fn()

        return self._stream.submit(run)

    def join(self, fut: Future[T]) -> T:
        self._synced()
        self.joins += 1
        return fut.result()

    def close(self) -> None:
        super().close()
        for side in self._sides:
            side.shutdown(wait=True)
        self._stream.shutdown(wait=True)

    def _download(self, fn: Callable[[], Sequence[torch.Tensor]]) -> HostRead:
        def copy() -> tuple[torch.Tensor, ...]:
            out = tuple(t.clone() for t in fn())
            self._count(d2h=sum(nbytes(t) for t in out))
            return out

        return HostRead(self, self._stream.submit(copy))

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.clone()

    def _fence(self) -> _Arrival:
        reached = _Arrival()
        self._stream.submit(reached.set)  # set when the stream gets past everything queued before it
        return reached

    def _copy_job(self, dst: list[torch.Tensor], src: list[torch.Tensor], fence: _Arrival,
                  ring: StagingRing, demand: bool) -> _Arrival:
        side = self._sides[demand]
        side.submit(self._wait_fence, fence)  # the side stream waits for the fence; this thread goes on
        reads = []
        for d, s in zip(dst, src, strict=True):
            k, staged = ring.stage(s, d.dtype)  # waits for the copy that last read the buffer
            read = _Arrival()
            side.submit(self._dma, d, staged, read)
            ring.release(k, read)
            reads.append(read)
            self._count(h2d=nbytes(d))
        copied = _Arrival()
        side.submit(self._arrive, copied, reads)
        return copied

    @staticmethod
    def _arrive(copied: _Arrival, reads: list[_Arrival]) -> None:
        copied.error = next((r.error for r in reads if r.error is not None), None)
        copied.set()

    def _wait_fence(self, fence: _Arrival) -> None:
        fence.wait()
        if self.copy_delay_s:
            threading.Event().wait(self.copy_delay_s)

    def _dma(self, dst: torch.Tensor, staged: torch.Tensor, read: _Arrival) -> None:
        """The copy engine moving one staged tensor into device memory."""
        try:
            dst.copy_(staged)
        except BaseException as e:  # noqa: BLE001 - kept for whoever waits on the copy (CUDA: an error at the sync)
            read.error = e
        read.set()

    def _finished(self, event: _Arrival) -> bool:
        return event.is_set()

    def _host_wait(self, event: _Arrival | None) -> None:
        if event is not None:
            event.wait()
            if event.error is not None:
                raise event.error


class CudaAccelerator(Accelerator):  # pragma: no cover - no GPU on test machines; mirrored by Emulated
    name = "cuda"

    def __init__(self, budget: int, index: int = 0) -> None:
        self.device = torch.device("cuda", index)
        super().__init__(budget)
        # cuBLAS may reduce a bf16/fp16 product's split-K partial sums in that dtype (PyTorch allows it by default);
        # the CPU's products sum in float32 throughout, and the device must give the CPU's numbers. Process-wide
        # and left so after close: every product Tandem runs on the device is one of the model's.
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
        self._sides = (torch.cuda.Stream(device=self.device), torch.cuda.Stream(device=self.device))
        self._rings = (StagingRing(True, self._host_wait), StagingRing(True, self._host_wait))
        self._pinned: list[torch.UntypedStorage] = []  # registered with CUDA; kept alive until `close` unregisters

    def submit(self, fn: Callable[[], T], after: Sequence[Copy] = ()) -> Future[T]:
        stream = torch.cuda.current_stream(self.device)
        for copy in after:
            stream.wait_event(copy.future.result())  # recorded once the copier has queued the copy
        return done(fn())  # kernels are queued on the current stream

    def join(self, fut: Future[T]) -> T:
        return fut.result()  # the dense layers' kernels queue behind the experts' on the same stream

    def pin(self, tensors: Sequence[torch.Tensor]) -> int:
        cudart = torch.cuda.cudart()
        seen = {s.data_ptr() for s in self._pinned}
        total = 0
        for t in tensors:
            storage = t.untyped_storage()
            ptr, size = storage.data_ptr(), storage.nbytes()
            if t.device.type != "cpu" or size == 0 or ptr in seen or t.is_pinned():
                continue
            seen.add(ptr)
            if int(cudart.cudaHostRegister(ptr, size, 0)) != 0:
                # (the driver refused: a memory lock limit, memory it cannot register; the copies stage instead)
                _clear_last_error(cudart)
                continue
            self._pinned.append(storage)
            total += size
        return total

    def _download(self, fn: Callable[[], Sequence[torch.Tensor]]) -> HostRead:
        out = []
        for t in fn():
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            host.copy_(t, non_blocking=True)
            out.append(host)
        self._count(d2h=sum(nbytes(t) for t in out))
        # Spinning, not blocking: the host read is the layer's critical path, and nothing else waits to run on
        # the host then (the CPU experts start once it returns); a blocking wait would add the wake-up.
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return HostRead(self, done(tuple(out)), event)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory().to(self.device, non_blocking=True)

    def _fence(self) -> torch.cuda.Event:
        event = torch.cuda.Event()  # (waited on by a stream only)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _copy_job(self, dst: list[torch.Tensor], src: list[torch.Tensor], fence: torch.cuda.Event,
                  ring: StagingRing, demand: bool) -> torch.cuda.Event:
        side = self._sides[demand]
        side.wait_event(fence)  # never overwrite a slot that queued kernels still read
        with torch.cuda.device(self.device), torch.cuda.stream(side):  # (this thread's own device may be another)
            for d, s in zip(dst, src, strict=True):
                if s.is_pinned() and s.dtype == d.dtype:
                    d.copy_(s, non_blocking=True)  # straight from pinned RAM
                else:
                    k, staged = ring.stage(s, d.dtype)
                    d.copy_(staged, non_blocking=True)
                    ring.release(k, _blocking_event(side))
                self._count(h2d=nbytes(d))
            return _blocking_event(side)

    def _finished(self, event: torch.cuda.Event) -> bool:
        return event.query()

    def _host_wait(self, event: torch.cuda.Event | None) -> None:
        if event is not None:
            event.synchronize()

    def close(self) -> None:
        super().close()
        # Nothing queued may still write into memory the next model gets (a copy into a slot, a scratch copy)
        torch.cuda.synchronize(self.device)
        cudart = torch.cuda.cudart()
        for storage in self._pinned:
            cudart.cudaHostUnregister(storage.data_ptr())
        self._pinned.clear()
        torch.cuda.empty_cache()  # what was freed goes back (release_device_memory: once a model is gone)


def _blocking_event(stream: torch.cuda.Stream) -> torch.cuda.Event:  # pragma: no cover - no GPU on test machines
    """An event recorded on `stream` that a host thread waits on by sleeping, not spinning: a copier may wait long
    (behind a fence, behind the copies before it) on a core the CPU experts need (a spinning copier slowed a
    16-thread matrix product 3.9-fold on an H200 machine)."""
    event = torch.cuda.Event(blocking=True)
    event.record(stream)
    return event


def _clear_last_error(cudart: Any) -> None:  # pragma: no cover - no GPU on test machines
    """Reset the CUDA runtime's last error after a refused call, or the next kernel launch would report it."""
    get_last = getattr(cudart, "cudaGetLastError", None)
    if get_last is not None:
        get_last()


def release_device_memory() -> None:
    """Memory the device's allocator keeps for reuse goes back to the device (after a model is let go)."""
    if torch.cuda.is_initialized():  # pragma: no cover - no GPU on test machines
        torch.cuda.empty_cache()


@dataclass(frozen=True)
class CudaDevice:
    """A CUDA GPU as torch numbers it (`index`), with where it sits on the PCI bus (domain, bus, device)."""

    index: int
    pci: tuple[int, int, int]
    capability: tuple[int, int] | None


def parse_bus_id(text: str) -> tuple[int, int, int] | None:
    """NVML's and sysfs's "DDDDDDDD:BB:DD.F" (or "DDDD:BB:DD.F"), hexadecimal -> (domain, bus, device); None if
    it is not one."""
    parts = text.strip().lower().replace(".", ":").split(":")
    try:
        domain, bus, device = (int(x, 16) for x in parts[:3])
    except ValueError:
        return None
    return (domain, bus, device) if len(parts) == 4 else None


def in_bus_order(devices: Sequence[CudaDevice]) -> list[CudaDevice]:
    """The GPUs as nvidia-smi, NVML and `tandem probe` number them: by PCI bus. Torch's own numbering puts the
    fastest first unless CUDA_DEVICE_ORDER=PCI_BUS_ID, so the two differ on machines with unlike GPUs."""
    return sorted(devices, key=lambda d: d.pci)


def cuda_devices() -> list[CudaDevice]:
    """This machine's CUDA GPUs in PCI bus order (empty without one)."""
    if not cuda_usable():
        return []
    found = []  # pragma: no cover - no GPU on test machines
    for i in range(torch.cuda.device_count()):  # pragma: no cover
        props = torch.cuda.get_device_properties(i)
        found.append(CudaDevice(i, (props.pci_domain_id, props.pci_bus_id, props.pci_device_id),
                                (props.major, props.minor)))
    return in_bus_order(found)  # pragma: no cover


def cuda_usable() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def accelerator_budget(kind: str, vram_gb: float | None, gpu: int = 0) -> int | None:
    """The bytes an accelerator `make_accelerator` would make has, without making it; None without one."""
    if kind == "emulated":
        return None if vram_gb is None else int(vram_gb * GIB)
    if kind != "cuda":
        return None
    devices = cuda_devices()  # pragma: no cover - no GPU on test machines
    if not 0 <= gpu < len(devices):  # pragma: no cover
        return None
    free, _total = torch.cuda.mem_get_info(devices[gpu].index)  # pragma: no cover
    return free if vram_gb is None else min(free, int(vram_gb * GIB))  # pragma: no cover


def make_accelerator(kind: str, vram_gb: float | None, gpu: int = 0) -> Accelerator | None:
    """`auto` picks CUDA when usable, else none (CPU only). `--vram-gb` sets or caps the budget; `gpu`: which
    CUDA GPU in PCI bus order."""
    if kind == "auto":
        kind = "cuda" if cuda_usable() else "none"
    if kind == "none":
        return None
    if kind == "emulated":
        if vram_gb is None:
            raise ResourceError("--accelerator emulated needs --vram-gb to size the emulated device memory")
        return EmulatedAccelerator(int(vram_gb * GIB))
    if kind == "cuda":
        devices = cuda_devices()
        if not devices:
            raise ResourceError("--accelerator cuda: no usable CUDA device (driver or GPU missing); use auto or none")
        if not 0 <= gpu < len(devices):  # pragma: no cover
            raise ResourceError(f"--gpu {gpu}: this machine has {len(devices)} CUDA GPUs, numbered from 0")
        index = devices[gpu].index  # pragma: no cover
        free, _total = torch.cuda.mem_get_info(index)  # pragma: no cover
        budget = free if vram_gb is None else min(free, int(vram_gb * GIB))  # pragma: no cover
        return CudaAccelerator(budget, index)  # pragma: no cover
    raise ResourceError(f"unknown accelerator {kind!r}; choose auto, none, cuda or emulated")
