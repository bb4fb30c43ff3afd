"""What machine is this: CPU ISA and cores, RAM, NUMA, GPUs with their memory and PCIe links.

Two halves, as everywhere in the auto-tuner: a replaceable data source that returns raw readings
(`LiveSources` asks /proc/cpuinfo or py-cpuinfo, psutil, sysfs, NVML and torch; tests use recorded fixtures), and pure
functions that turn readings into a `HardwareInfo`. Anything that could not be read is `None` and shown
as "unknown" — never a guess — and a missing NVML or driver means "no GPU", never a crash.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tandem.kernels.isa import mask_flags, masked_features, present_features
from tandem.runtime.cpuinfo import proc_cpuinfo

# PCIe payload bandwidth per lane and direction, GB/s, by generation (after line encoding).
PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
ISA_FLAGS = {
    "avx2": ("avx2",),
    "avx512": ("avx512f",),
    "avx512_bf16": ("avx512_bf16",),
    "avx512_vnni": ("avx512_vnni", "avx512vnni"),
    "amx": ("amx_bf16", "amx_tile"),
    "neon": ("neon", "asimd"),
    "sve": ("sve",),
}


@dataclass(frozen=True)
class CpuInfo:
    brand: str | None
    arch: str | None
    flags: tuple[str, ...]
    physical_cores: int | None
    logical_cores: int | None
    masked: tuple[str, ...] = ()  # features this CPU has that TANDEM_CPU_FEATURES hides (absent from `flags`)

    @property
    def isa(self) -> dict[str, bool | None]:
        """Named instruction-set features; None when the flags could not be read at all."""
        if not self.flags:
            return dict.fromkeys(ISA_FLAGS)
        have = set(self.flags)
        return {name: any(f in have for f in names) for name, names in ISA_FLAGS.items()}


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str | None
    memory_total: int | None  # bytes
    memory_free: int | None
    pcie_gen: int | None  # current link generation
    pcie_gen_max: int | None
    pcie_width: int | None  # current lanes
    pcie_width_max: int | None
    driver: str | None
    capability: tuple[int, int] | None  # CUDA compute capability
    pci_bus_id: str | None = None  # "DDDDDDDD:BB:DD.F", as NVML gives it (matches the GPU to torch's numbering)
    # `--gpu`'s number for it: its place by PCI bus among the GPUs this PyTorch can use (CUDA_VISIBLE_DEVICES and MIG
    # hide some from it, which NVML lists all the same); None when this PyTorch cannot use it
    torch_index: int | None = None

    @property
    def pcie_gbps(self) -> float | None:
        """Theoretical host<->device bandwidth of the link at its maximum generation and width."""
        gen, width = self.pcie_gen_max or self.pcie_gen, self.pcie_width_max or self.pcie_width
        if gen is None or width is None or gen not in PCIE_LANE_GBPS:
            return None
        return PCIE_LANE_GBPS[gen] * width


@dataclass(frozen=True)
class HardwareInfo:
    cpu: CpuInfo
    ram_total: int | None
    ram_available: int | None
    numa_nodes: int | None
    gpus: tuple[GpuInfo, ...] = ()
    gpu_status: str = "no GPU"  # "ok", or why there is none
    torch_problem: str | None = None  # why this PyTorch can use none of the GPUs (torch_cuda_problem), if so

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def gpu(self, number: int = 0) -> GpuInfo | None:
        """The GPU `--gpu number` runs on (matched by PCI bus, as `make_accelerator` numbers them): NVML lists GPUs
        that PyTorch does not see (CUDA_VISIBLE_DEVICES, MIG). A reading without PyTorch's numbers (recorded
        before they were kept) counts NVML's order; None where there is no such GPU."""
        if any(g.torch_index is not None for g in self.gpus):
            return next((g for g in self.gpus if g.torch_index == number), None)
        return self.gpus[number] if 0 <= number < len(self.gpus) else None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HardwareInfo:
        cpu = CpuInfo(**{**d["cpu"], "flags": tuple(d["cpu"]["flags"]), "masked": tuple(d["cpu"].get("masked", ()))})
        gpus = tuple(GpuInfo(**{**g, "capability": tuple(g["capability"]) if g.get("capability") else None})
                     for g in d.get("gpus", ()))
        return cls(cpu, d.get("ram_total"), d.get("ram_available"), d.get("numa_nodes"), gpus,
                   d.get("gpu_status", "no GPU" if not gpus else "ok"), d.get("torch_problem"))

    def fingerprint(self) -> dict[str, Any]:
        """What identifies the machine for saved profiles (not what varies from minute to minute)."""
        return {
            "cpu": self.cpu.brand, "cores": self.cpu.physical_cores, "threads": self.cpu.logical_cores,
            "ram_gib": round(self.ram_total / 2**30) if self.ram_total else None,
            "gpus": [g.name for g in self.gpus], "vram": [g.memory_total for g in self.gpus],
            "driver": self.gpus[0].driver if self.gpus else None,
        } | ({"masked": list(self.cpu.masked)} if self.cpu.masked else {})  # a masked CPU is another machine


class ProbeSources(Protocol):
    """Raw readings. Each method returns plain data; `gpus` raises GpuUnavailable when there are none."""

    def cpu(self) -> dict[str, Any]: ...
    def cores(self) -> tuple[int | None, int | None]: ...
    def memory(self) -> tuple[int | None, int | None]: ...
    def numa_nodes(self) -> int | None: ...
    def gpus(self) -> list[dict[str, Any]]: ...
    def torch_problem(self) -> str | None: ...


class GpuUnavailable(Exception):
    """No usable GPU; the message says why (no NVML library, no driver, no device)."""


@dataclass
class LiveSources:
    """This machine, read through /proc/cpuinfo (py-cpuinfo where there is none), psutil, sysfs, NVML and torch."""

    _cpu: dict[str, Any] | None = field(default=None, repr=False)

    def cpu(self) -> dict[str, Any]:
        """/proc/cpuinfo where there is one (instant); py-cpuinfo elsewhere (about a second)."""
        if self._cpu is None:
            self._cpu = proc_cpuinfo()
        if self._cpu is None:
            import cpuinfo

            self._cpu = dict(cpuinfo.get_cpu_info())
        return self._cpu

    def cores(self) -> tuple[int | None, int | None]:
        import psutil

        return psutil.cpu_count(logical=False), psutil.cpu_count(logical=True)

    def memory(self) -> tuple[int | None, int | None]:
        import psutil

        vm = psutil.virtual_memory()
        return vm.total, vm.available

    def numa_nodes(self) -> int | None:
        nodes = Path("/sys/devices/system/node")
        if not nodes.is_dir():
            return None
        return len([p for p in nodes.iterdir() if p.name.startswith("node") and p.name[4:].isdigit()]) or None

    def gpus(self) -> list[dict[str, Any]]:
        import pynvml

        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as e:
            raise GpuUnavailable(f"NVML unavailable ({e}); no NVIDIA driver?") from None
        try:
            driver = _text(_nvml(pynvml.nvmlSystemGetDriverVersion))
            found = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                mem = _nvml(pynvml.nvmlDeviceGetMemoryInfo, h)
                bus = _text(getattr(_nvml(pynvml.nvmlDeviceGetPciInfo, h), "busId", None))
                found.append({
                    "name": _text(_nvml(pynvml.nvmlDeviceGetName, h)),
                    "memory_total": getattr(mem, "total", None), "memory_free": getattr(mem, "free", None),
                    "pcie_gen": _nvml(pynvml.nvmlDeviceGetCurrPcieLinkGeneration, h),
                    "pcie_gen_max": _nvml(pynvml.nvmlDeviceGetMaxPcieLinkGeneration, h),
                    "pcie_width": _nvml(pynvml.nvmlDeviceGetCurrPcieLinkWidth, h),
                    "pcie_width_max": _nvml(pynvml.nvmlDeviceGetMaxPcieLinkWidth, h),
                    "driver": driver, "capability": _torch_capability(bus), "pci_bus_id": bus,
                    "torch_index": _torch_index(bus),
                })
            return found
        finally:
            pynvml.nvmlShutdown()


    def torch_problem(self) -> str | None:
        return torch_cuda_problem()


def _nvml(fn: Any, *args: Any) -> Any:
    import pynvml

    try:
        return fn(*args)
    except pynvml.NVMLError:
        return None  # this one reading is unknown; the rest still count


def _text(v: Any) -> str | None:
    return v.decode() if isinstance(v, bytes) else v


def _torch_capability(bus_id: str | None) -> list[int] | None:
    """The compute capability torch reports for the GPU at `bus_id` (NVML numbers GPUs by bus, torch by speed:
    the two are matched by bus, never by index); None when torch does not see it."""
    from tandem.runtime.accelerator import cuda_devices, parse_bus_id  # torch: only when there is a GPU

    at = parse_bus_id(bus_id) if bus_id else None
    try:
        device = next((d for d in cuda_devices() if d.pci == at), None)
    except (RuntimeError, AssertionError):
        return None
    return list(device.capability) if device is not None and device.capability is not None else None


def _torch_index(bus_id: str | None) -> int | None:
    """`--gpu`'s number for the GPU at `bus_id`: its place in PCI bus order among the GPUs torch can use (as
    `make_accelerator` counts); None when torch cannot use it."""
    from tandem.runtime.accelerator import cuda_devices, parse_bus_id

    at = parse_bus_id(bus_id) if bus_id else None
    try:
        return next((n for n, d in enumerate(cuda_devices()) if d.pci == at), None)
    except (RuntimeError, AssertionError):
        return None


def torch_cuda_problem() -> str | None:
    """Why this PyTorch cannot use an NVIDIA GPU the driver reports (None: it can, or nothing to say): a CPU build, or
    a CUDA build the driver is too old for, or every GPU hidden by CUDA_VISIBLE_DEVICES."""
    import os

    import torch

    if torch.version.cuda is None:
        return (f"this PyTorch ({torch.__version__}) is a CPU build; install a CUDA build to use the GPU (README: "
                "Installing for an NVIDIA GPU)")
    if os.environ.get("CUDA_VISIBLE_DEVICES") is not None and not torch.cuda.is_available():
        return f"CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']!r} hides every GPU from PyTorch"
    if not torch.cuda.is_available():
        return (f"this PyTorch (CUDA {torch.version.cuda}) cannot use the GPU: the driver may be older than that "
                "CUDA (update the driver, or install a PyTorch built for an older CUDA)")
    return None


@dataclass
class RecordedSources:
    """Readings saved as JSON (tests' fixtures, or `tandem probe --record` for a bug report)."""

    data: dict[str, Any]

    @classmethod
    def load(cls, path: str | Path) -> RecordedSources:
        return cls(json.loads(Path(path).read_text(encoding="utf-8")))

    def cpu(self) -> dict[str, Any]:
        return self.data.get("cpu") or {}

    def cores(self) -> tuple[int | None, int | None]:
        c = self.data.get("cores") or [None, None]
        return c[0], c[1]

    def memory(self) -> tuple[int | None, int | None]:
        m = self.data.get("memory") or [None, None]
        return m[0], m[1]

    def numa_nodes(self) -> int | None:
        return self.data.get("numa_nodes")

    def gpus(self) -> list[dict[str, Any]]:
        if "gpus" not in self.data or self.data["gpus"] is None:
            raise GpuUnavailable(self.data.get("gpu_error", "no GPU"))
        return self.data["gpus"]

    def torch_problem(self) -> str | None:
        problem = self.data.get("torch_problem")
        if problem is not None and not isinstance(problem, str):
            raise TypeError(f"torch_problem is {problem!r}, not text")
        return problem


def record(sources: ProbeSources) -> dict[str, Any]:
    """The raw readings of `sources` in the form `RecordedSources` reads back (with the features this machine
    was playing without, which the replay hides again)."""
    out: dict[str, Any] = {"cpu": sources.cpu(), "cores": list(sources.cores()), "memory": list(sources.memory()),
                           "numa_nodes": sources.numa_nodes(), "cpu_features_removed": sorted(_removed_by(sources))}
    try:
        out["gpus"] = sources.gpus()
    except GpuUnavailable as e:
        out["gpus"], out["gpu_error"] = None, str(e)
    out["torch_problem"] = sources.torch_problem()
    return out


def _removed_by(sources: ProbeSources) -> frozenset[str]:
    """The features hidden from these readings: TANDEM_CPU_FEATURES for this machine, the recorded ones else."""
    if isinstance(sources, RecordedSources):
        return frozenset(sources.data.get("cpu_features_removed") or ())
    return masked_features()


MAX_COUNT = 1 << 20  # cores, threads, NUMA nodes, PCIe generations and lanes: beyond any machine
MAX_BYTES = 1 << 60  # memory sizes: an exabyte


def _index(value: Any, what: str) -> int | None:
    """A device number as read: a whole number from 0 (a negative one is unknown), or None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} is {value!r}, not a whole number")
    return value if 0 <= value < MAX_COUNT else None


def _amount(value: Any, what: str, high: int = MAX_COUNT) -> int | None:
    """A count or a size as read. A number that is not a whole, finite, positive one within reach (a negative
    count, NaN or infinite memory in a recorded file, a sensor's 0) is unknown: shown as such, never used as a
    fact. Anything but a number is the wrong type for the reading: a TypeError naming it."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{what} is {value!r}, not a number")
    if isinstance(value, float):
        if not math.isfinite(value) or not value.is_integer():
            return None
        value = int(value)
    return value if 0 < value <= high else None


def _name(value: Any, what: str) -> str | None:
    """A name as read (a brand, a driver version): text, or unknown."""
    if value is None or isinstance(value, str):
        return value or None
    raise TypeError(f"{what} is {value!r}, not text")


def parse_cpu(raw: dict[str, Any], cores: tuple[int | None, int | None], removed: frozenset[str] = frozenset()
              ) -> CpuInfo:
    """The CPU as read, less the features in `removed` (TANDEM_CPU_FEATURES)."""
    flags = [str(f).lower() for f in raw.get("flags") or ()]
    arch = raw.get("arch_string_raw") or raw.get("arch")
    logical = _amount(cores[1], "the thread count") or _amount(raw.get("count"), "the CPU count")
    return CpuInfo(_name(raw.get("brand_raw"), "the CPU brand"), arch.lower() if isinstance(arch, str) else None,
                   tuple(sorted(mask_flags(flags, removed))), _amount(cores[0], "the core count"), logical,
                   tuple(sorted(present_features(flags) & removed)))


def parse_gpu(index: int, raw: dict[str, Any]) -> GpuInfo:
    cap = raw.get("capability")
    if cap is not None and not (isinstance(cap, (list, tuple)) and len(cap) == 2
                                and all(isinstance(c, int) and not isinstance(c, bool) for c in cap)):
        raise TypeError(f"GPU {index} capability is {cap!r}, not [major, minor]")
    where = f"GPU {index}"
    return GpuInfo(index, _name(raw.get("name"), f"{where} name"),
                   _amount(raw.get("memory_total"), f"{where} memory_total", MAX_BYTES),
                   _amount(raw.get("memory_free"), f"{where} memory_free", MAX_BYTES),
                   *(_amount(raw.get(k), f"{where} {k}") for k in ("pcie_gen", "pcie_gen_max", "pcie_width",
                                                                   "pcie_width_max")),
                   _name(raw.get("driver"), f"{where} driver"), (cap[0], cap[1]) if cap else None,
                   _name(raw.get("pci_bus_id"), f"{where} pci_bus_id"),
                   _index(raw.get("torch_index"), f"{where} torch_index"))


def probe(sources: ProbeSources | None = None, removed: frozenset[str] | None = None) -> HardwareInfo:
    """Read everything; a failure to read one thing makes that thing unknown, not the whole probe fail.
    `removed`: CPU features to hide (default: what TANDEM_CPU_FEATURES removes from this machine; for a recorded
    one, what it was playing without when recorded)."""
    src = sources if sources is not None else LiveSources()
    cpu = parse_cpu(src.cpu(), src.cores(), _removed_by(src) if removed is None else removed)
    total, available = src.memory()
    total, available = _amount(total, "the total RAM", MAX_BYTES), _amount(available, "the available RAM", MAX_BYTES)
    try:
        found = src.gpus()
        if not isinstance(found, list) or not all(isinstance(g, dict) for g in found):
            raise TypeError(f"the GPUs are {found!r}, not a list of objects")
        gpus = tuple(parse_gpu(i, g) for i, g in enumerate(found))
        status = "ok" if gpus else "no GPU (the driver reports no device)"
    except GpuUnavailable as e:
        gpus, status = (), f"no GPU: {e}"
    problem = src.torch_problem() if gpus and all(g.torch_index is None for g in gpus) else None
    return HardwareInfo(cpu, total, available, _amount(src.numa_nodes(), "the NUMA node count"), gpus, status,
                        problem)


def describe(hw: HardwareInfo) -> list[str]:
    """Human-readable lines; unknown values say so."""
    def show(v: object, unit: str = "") -> str:
        return "unknown" if v is None else f"{v}{unit}"

    def gib(v: int | None) -> str:
        return "unknown" if v is None else f"{v / 2**30:.1f} GiB"

    isa = hw.cpu.isa
    lines = [
        f"CPU: {show(hw.cpu.brand)} ({show(hw.cpu.arch)}), {show(hw.cpu.physical_cores)} cores / "
        f"{show(hw.cpu.logical_cores)} threads",
        "  ISA: " + ", ".join(f"{k}={'unknown' if v is None else ('yes' if v else 'no')}" for k, v in isa.items())
        + (f" (as if without {', '.join(hw.cpu.masked)}: TANDEM_CPU_FEATURES)" if hw.cpu.masked else ""),
        f"RAM: {gib(hw.ram_total)} total, {gib(hw.ram_available)} available; NUMA nodes: {show(hw.numa_nodes)}",
    ]
    if not hw.gpus:
        lines.append(f"GPU: {hw.gpu_status}")
    elif all(g.torch_index is None for g in hw.gpus) and hw.torch_problem:
        lines.append(f"PyTorch: {hw.torch_problem}")
    for g in hw.gpus:
        link = "unknown" if g.pcie_gbps is None else f"{g.pcie_gbps:.1f} GB/s"
        lines.append(
            f"GPU {g.index}: {show(g.name)}, {gib(g.memory_total)} ({gib(g.memory_free)} free), "
            f"PCIe gen {show(g.pcie_gen)}/{show(g.pcie_gen_max)} x{show(g.pcie_width)}/{show(g.pcie_width_max)} "
            f"(max link {link}), driver {show(g.driver)}, compute capability "
            f"{'unknown' if g.capability is None else '.'.join(map(str, g.capability))}, PCI bus {show(g.pci_bus_id)}"
            + (f" (--gpu {g.torch_index})" if g.torch_index is not None
               else " (PyTorch here cannot use it)" if hw.torch_problem else " (--gpu unknown)")
        )
    return lines
