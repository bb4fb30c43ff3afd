"""Measured (or estimated) latencies, and the cost model fitted from them.

`Measurements` is what microbenchmarks produce or what a hardware description file (`tandem plan
--hardware`) states; `fit_cpu` fits Fiddler's cpu_lat(s) = a + b·(s - 1) per thread count; `roofline_cpu` fills
in what was not measured from bandwidths and peak FLOPS (MoE-Lightning's hierarchical roofline).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from tandem.kernels.errors import TandemError
from tandem.runtime.choices import PredictorKind
from tandem.runtime.prefetch import MAX_DEPTH


@dataclass(frozen=True)
class CpuFit:
    a_ms: float  # one token
    b_ms: float  # each further token

    def lat(self, tokens: int) -> float:
        return self.a_ms + self.b_ms * max(0, tokens - 1)


@dataclass
class Measurements:
    """Everything the planner needs to know about a machine, for one expert shape and dtype."""

    cores: int
    expert_bytes: int
    cpu: dict[int, CpuFit]  # threads -> fit
    dram_gbps: float | None = None
    cpu_samples: dict[int, dict[int, float]] = field(default_factory=dict)  # threads -> tokens -> ms
    kernel: dict[str, Any] = field(default_factory=dict)  # chosen variant and crossover
    gpu_expert_ms: float | None = None
    copy_expert_ms: float | None = None
    h2d_gbps: float | None = None
    d2h_gbps: float | None = None
    vram_for_experts: int = 0  # bytes the accelerator can give to expert slots
    token_overhead_ms: float = 0.0  # measured decode time per token not explained by the layer model
    ship_ms: float | None = None  # measured cost of sending a layer's activations to the CPU and back
    shared_device: bool = False  # the "accelerator" is the CPU itself (emulated): no real concurrency
    gflops: float | None = None  # dense products over many tokens at the planned threads (the compute peak reached)
    # each expert predictor's recall per MoE layer ahead (1, 2, ...), as measured on the model (runtime/prefetch.py)
    predictor_recall: dict[str, list[float]] = field(default_factory=dict)

    @property
    def has_gpu(self) -> bool:
        return self.vram_for_experts > 0 and self.gpu_expert_ms is not None and self.copy_expert_ms is not None

    def to_dict(self) -> dict[str, Any]:
        return {
            "cores": self.cores, "expert_bytes": self.expert_bytes, "dram_gbps": self.dram_gbps,
            "cpu": {str(t): {"a_ms": f.a_ms, "b_ms": f.b_ms} for t, f in self.cpu.items()},
            "cpu_samples": {str(t): {str(n): ms for n, ms in s.items()} for t, s in self.cpu_samples.items()},
            "kernel": self.kernel, "gpu_expert_ms": self.gpu_expert_ms, "copy_expert_ms": self.copy_expert_ms,
            "h2d_gbps": self.h2d_gbps, "d2h_gbps": self.d2h_gbps, "vram_for_experts": self.vram_for_experts,
            "token_overhead_ms": self.token_overhead_ms, "ship_ms": self.ship_ms,
            "shared_device": self.shared_device, "gflops": self.gflops, "predictor_recall": self.predictor_recall,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Measurements:
        return cls(
            cores=int(d["cores"]), expert_bytes=int(d["expert_bytes"]),
            cpu={int(t): CpuFit(float(f["a_ms"]), float(f["b_ms"])) for t, f in d["cpu"].items()},
            dram_gbps=d.get("dram_gbps"),
            cpu_samples={int(t): {int(n): float(ms) for n, ms in s.items()}
                         for t, s in (d.get("cpu_samples") or {}).items()},
            kernel=d.get("kernel") or {}, gpu_expert_ms=d.get("gpu_expert_ms"),
            copy_expert_ms=d.get("copy_expert_ms"), h2d_gbps=d.get("h2d_gbps"), d2h_gbps=d.get("d2h_gbps"),
            vram_for_experts=int(d.get("vram_for_experts") or 0),
            token_overhead_ms=float(d.get("token_overhead_ms") or 0.0), ship_ms=d.get("ship_ms"),
            shared_device=bool(d.get("shared_device")), gflops=d.get("gflops"),
            predictor_recall={str(k): [float(x) for x in v] for k, v in (d.get("predictor_recall") or {}).items()},
        )


def fit_cpu(samples: dict[int, float]) -> CpuFit:
    """Fiddler's linear CPU model a + b·(s - 1). `a` is the measured one-token latency (decode lives there,
    and a free intercept would be dragged by the kernel/torch switch at larger s); `b` is the least-squares
    slope through that point."""
    a = samples.get(1, min(samples.values()))
    extra = [(s - 1, ms - a) for s, ms in samples.items() if s > 1]
    if not extra:
        return CpuFit(a, 0.0)
    b = sum(x * y for x, y in extra) / sum(x * x for x, _ in extra)
    return CpuFit(max(a, 1e-6), max(b, 0.0))


def roofline_cpu(expert_bytes: int, flops_per_token: float, dram_gbps: float, gflops: float) -> CpuFit:
    """Bandwidth-bound first token, compute-bound further tokens."""
    return CpuFit(expert_bytes / dram_gbps / 1e6, flops_per_token / gflops / 1e6)


MAX_COUNT = 1 << 16  # cores and thread counts: beyond any machine, and small enough to loop over


# Plausible physical ranges of what a hardware file states: a number outside them is a typo or a unit mistake,
# and at the extremes the arithmetic breaks (5e-324 GB/s divides into inf, 1e308 GB/s predicts inf tok/s).
GBPS = (1e-3, 1e5)  # 1 MB/s (a floppy's league) to 100 TB/s (beyond any memory system)
GFLOPS = (1e-3, 1e7)  # up to 10 PFLOPS
MS = (1e-6, 1e7)  # a latency: a nanosecond to almost three hours


class _HardwareFile:
    """Reads the fields of a hardware description, refusing (with the field's name and the range it takes)
    anything but a finite number in a plausible range where one belongs: a zero, negative, NaN, infinite or
    absurd latency or bandwidth would produce plans like "threads -3" or "inf tok/s" instead of an error."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, field: str, value: Any, rule: str) -> TandemError:
        shown = json.dumps(value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        return TandemError(f"{self.source}: {field} must be {rule}, not {shown}; "
                           "see the HW.json schema in the README")

    def section(self, d: Any, field: str) -> dict[str, Any]:
        if d is None:
            return {}
        if not isinstance(d, dict):
            raise self.fail(field, d, "an object ({...})")
        return d

    def number(self, d: dict[str, Any], key: str, bounds: tuple[float, float], where: str = "", *,
               zero: bool = False) -> float:
        """A number in `bounds` (or 0 with `zero`). Compared before any conversion: an integer too large for a
        float (JSON allows 10**400) is simply out of range, and NaN fails every comparison."""
        field, value = where + key, d.get(key)
        low, high = bounds
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                low <= value <= high or (zero and value == 0)):
            raise self.fail(field, value, f"a number from {'0 or ' if zero else ''}{low:g} to {high:g}")
        return float(value)

    def optional(self, d: dict[str, Any], key: str, bounds: tuple[float, float], where: str = "", *,
                 zero: bool = False) -> float | None:
        return None if d.get(key) is None else self.number(d, key, bounds, where, zero=zero)

    def count(self, value: Any, field: str, high: int = MAX_COUNT, *, zero: bool = False, key: bool = False,
              what: str = "") -> int:
        """A whole number (JSON 24 or 24.0; as a key, where JSON allows only strings, "24"), from 1 (or 0) to
        `high` (`what` says what that limit is)."""
        if key and isinstance(value, str) and value.strip().isdigit():
            value = int(value)
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int) or not (0 if zero else 1) <= value <= high:
            raise self.fail(field, value, f"a whole number from {0 if zero else 1} to {high}{what}")
        return value


def from_hardware_file(d: dict[str, Any], expert_bytes: int, flops_per_token: float,
                       source: str = "hardware file") -> Measurements:
    """A machine described by hand (see the README's HW.json schema) -> Measurements. `source` names the file
    in errors."""
    f = _HardwareFile(source)
    if not isinstance(d, dict):
        raise f.fail("the file", d, "a JSON object")
    cores = f.count(d.get("cores"), "cores")
    dram = f.optional(d, "cpu_bandwidth_gbps", GBPS)
    gflops = f.optional(d, "cpu_gflops", GFLOPS)
    cpu: dict[int, CpuFit] = {}
    for t, spec in f.section(d.get("cpu_threads"), "cpu_threads").items():
        where = f"cpu_threads.{t}."
        spec = f.section(spec, where.rstrip("."))
        per_token = 0.0 if spec.get("per_token_ms") is None else f.number(spec, "per_token_ms", MS, where, zero=True)
        # a thread count beyond the cores could never be run: the plan would ask for it all the same
        threads = f.count(t, "a cpu_threads key", cores, key=True, what=" (the cores)")
        cpu[threads] = CpuFit(f.number(spec, "expert_ms", MS, where), per_token)
    if not cpu:  # derive from bandwidth and FLOPS, assuming both scale with threads up to `cores`
        bw, gf = f.number(d, "cpu_bandwidth_gbps", GBPS), f.number(d, "cpu_gflops", GFLOPS)
        for t in sorted({1, max(1, cores // 2), cores}):
            cpu[t] = roofline_cpu(expert_bytes, flops_per_token, bw * min(1.0, 2 * t / cores), gf * t / cores)
    gpu = f.section(d.get("gpu"), "gpu")
    expert_ms = f.optional(gpu, "expert_ms", MS, "gpu.")
    bandwidth = f.optional(gpu, "bandwidth_gbps", GBPS, "gpu.")
    if expert_ms is None and bandwidth is not None:  # roofline: decode reads the expert once
        expert_ms = expert_bytes / bandwidth / 1e6
    copy_ms = f.optional(gpu, "copy_ms", MS, "gpu.")
    h2d = f.optional(gpu, "h2d_gbps", GBPS, "gpu.")
    if copy_ms is None and h2d is not None:
        copy_ms = expert_bytes / h2d / 1e6
    ship_ms = f.optional(gpu, "ship_ms", MS, "gpu.")  # a layer's activations to the CPU and back
    vram = gpu.get("vram_bytes_for_experts")
    vram = 0 if vram is None else f.count(vram, "gpu.vram_bytes_for_experts", 1 << 60, zero=True)
    overhead = d.get("token_overhead_ms")
    recall = {}
    for kind, figures in f.section(d.get("predictors"), "predictors").items():
        if kind not in {str(k) for k in PredictorKind} - {"none"}:
            raise f.fail(f"predictors.{kind}", kind, "one of previous-token, stale-gate, eam")
        if not isinstance(figures, list) or not 1 <= len(figures) <= MAX_DEPTH:
            raise f.fail(f"predictors.{kind}", figures, f"a list of 1 to {MAX_DEPTH} recalls, one per layer ahead")
        recall[kind] = [f.number({"recall": x}, "recall", (0.0, 1.0), f"predictors.{kind}.", zero=True)
                        for x in figures]
    return Measurements(
        cores=cores, expert_bytes=expert_bytes, cpu=cpu, dram_gbps=dram, gpu_expert_ms=expert_ms,
        copy_expert_ms=copy_ms, h2d_gbps=h2d, vram_for_experts=vram, ship_ms=ship_ms,
        token_overhead_ms=0.0 if overhead is None else f.number(d, "token_overhead_ms", MS, zero=True),
        gflops=gflops, predictor_recall=recall,
    )


def free_ram_from_hardware_file(d: dict[str, Any], source: str = "hardware file") -> int | None:
    """The RAM a hardware description says is free for a model's KV cache (`ram_free_gb`), in bytes; None when it
    does not say."""
    f = _HardwareFile(source)
    if not isinstance(d, dict):
        raise f.fail("the file", d, "a JSON object")
    gb = f.optional(d, "ram_free_gb", (1e-3, 1e7))
    return None if gb is None else int(gb * 2**30)
