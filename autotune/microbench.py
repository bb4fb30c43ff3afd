"""Microbenchmarks on the model's own expert shape: DRAM bandwidth, CPU expert latency per token count,
thread count and kernel path, and (with CUDA) accelerator expert latency and copy bandwidth.

Synthetic weights of the real shape, cycled through a working set larger than the caches. A progress
callback reports each step. Budget on a 2-core machine: about a minute, `quick` about 15 seconds.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tandem.autotune.measurements import Measurements, fit_cpu, roofline_cpu
from tandem.autotune.plan import ModelShape
from tandem.autotune.probe import HardwareInfo
from tandem.kernels.blocks import FORMATS, block_matrix
from tandem.kernels.dense import DenseLinear
from tandem.kernels.experts import CpuExecutor, CpuExpert, CpuOptions
from tandem.kernels.library import PROBE_STREAMS, available_isas, library, read_bandwidth_probe
from tandem.kernels.quant import QuantizedMatrix, quantize_mxfp4
from tandem.runtime.accelerator import Accelerator, make_accelerator
from tandem.runtime.dispatch import slot_budget
from tandem.runtime.moe import ExpertWeights

TOKENS = (1, 2, 4, 8, 16, 32, 64, 128)
QUICK_TOKENS = (1, 4, 16, 64)


@dataclass(frozen=True)
class Step:
    name: str
    done: int
    total: int


Progress = Callable[[Step], None]


def thread_candidates(hw: HardwareInfo) -> list[int]:
    cores = hw.cpu.physical_cores or hw.cpu.logical_cores or 1
    return sorted({1, max(1, cores // 2), cores})


def time_per_call(fn: Callable[[int], object], count: int, min_time: float) -> float:
    """Milliseconds per call of fn(k), k cycling through `count` inputs, for at least `min_time` seconds, after
    a warm-up of a quarter of that (one warm-up call is not enough: the first large matrix products still run
    slow after it)."""
    fn(0)
    start = time.perf_counter()
    while time.perf_counter() - start < min_time / 4:
        fn(0)
    calls, start = 0, time.perf_counter()
    while True:
        fn(calls % count)
        calls += 1
        elapsed = time.perf_counter() - start
        if elapsed >= min_time and calls >= min(count, 3):
            return elapsed / calls * 1e3  # ms


def dram_bandwidth(threads: int, size: int = 2 * 2**30) -> float:
    """Streaming read bandwidth in GB/s: the best pass over `size` bytes of three for each stream count a thread
    reads (PROBE_STREAMS). The count the memory serves best differs between machines (docs/bench/kernels.md), and a
    roofline must divide by what the memory can deliver, not by what one way of reading it got."""
    buf = torch.ones(size // 4)
    read_bandwidth_probe(buf, threads)
    best = 0.0
    for streams in PROBE_STREAMS:
        for _ in range(3):
            start = time.perf_counter()
            read_bandwidth_probe(buf, threads, streams)
            best = max(best, size / (time.perf_counter() - start) / 1e9)
    return best


PEAK_PRODUCT = (512, 2048, 2048)  # tokens x inputs x outputs of the product timed for the compute peak: weights
# of 4-16 MB stay in the caches, and 512 tokens fill every unit
PEAK_OF = {"bf16": "bf16", "fp16": "fp32", "fp32": "fp32", "int8": "int8", "int4": "int8", "mxfp4": "int8"}


def compute_peak(min_time: float = 0.2) -> dict[str, float]:
    """The compute peak torch's matrix products (oneDNN) reach at the current thread count, in billions of
    multiply-adds x 2 a second: "fp32", "bf16", and "int8" (int8 x int8 -> int32). What a prefill or a long beam
    search is bound by once the weights are read; `PEAK_OF` says which one a weight dtype's compute counts against.
    Where the kernels have no bf16 arithmetic (no AVX512_BF16: AVX2 alone, or masked) they compute bf16 weights in
    float32, so "bf16" is the float32 peak there, not measured: oneDNN's bf16 product then runs a reference loop
    (0.3 GFLOP/s, 14 s a call on the development machine masked to AVX2)."""
    m, k, n = PEAK_PRODUCT
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
    xb, wb = x.bfloat16(), w.bfloat16()
    xi, wi = (t.clamp(-1, 1).mul(127).to(torch.int8) for t in (x, w))
    products: dict[str, Callable[[int], object]] = {
        "fp32": lambda _k: torch.mm(x, w),
        "bf16": lambda _k: torch.mm(xb, wb),
        "int8": lambda _k: torch._int_mm(xi, wi),
    }
    bf16_in_float32 = library() is not None and "avx512bf16" not in available_isas()
    if bf16_in_float32:
        del products["bf16"]
    peak = {name: 2 * m * k * n / time_per_call(f, 1, min_time) / 1e6 for name, f in products.items()}
    return peak | {"bf16": peak["fp32"]} if bf16_in_float32 else peak


DENSE_TOKENS = 64  # tokens of the dense product timed for a batch step's rate: a decode step of 64 sequences


def dense_gflops(hidden: int, dtype: torch.dtype, threads: int, min_time: float = 0.1) -> float:
    """The rate the model's dense path (DenseLinear: attention projections, lm_head) multiplies DENSE_TOKENS tokens by
    a hidden x 2·hidden matrix in `dtype`, float32 out as the residual stream takes it, in GFLOP/s."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(2 * hidden, hidden, generator=gen).to(dtype)
    x = torch.randn(DENSE_TOKENS, hidden, generator=gen).to(dtype)
    linear = DenseLinear(threads)
    return 2 * w.numel() * DENSE_TOKENS / time_per_call(lambda _k: linear(x, w, out_dtype=torch.float32), 1,
                                                        min_time) / 1e6


QUICK_PROBE_BYTES = 256 * 2**20  # the batch policy's probe: a quarter second of reads, past any cache


def quick_measurements(shape: ModelShape, dtype: torch.dtype, threads: int) -> Measurements:
    """What the batch policy needs where this machine has no profile for the model, in about a second: the DRAM
    bandwidth, the dense product rate, and the experts' times as their roofline of the two."""
    bw = dram_bandwidth(threads, QUICK_PROBE_BYTES)
    gflops = dense_gflops(shape.hidden, dtype, threads, min_time=0.05)
    fit = roofline_cpu(shape.expert_bytes, 6 * shape.hidden * shape.inter, bw, gflops)
    return Measurements(cores=threads, expert_bytes=shape.expert_bytes, cpu={threads: fit}, dram_gbps=bw,
                        gflops=gflops)


def choose_variant(variants: dict[str, dict[int, float]]) -> str:
    """"auto", or the variant faster than it at one token and at eight (the fastest at one token of those)."""
    auto = variants["auto"]
    better = [v for v, ms in variants.items() if ms[1] < auto[1] and ms[8] < auto[8]]
    return min(better, key=lambda v: variants[v][1]) if better else "auto"


Weights = tuple[torch.Tensor, torch.Tensor, torch.Tensor] | tuple[QuantizedMatrix, QuantizedMatrix, QuantizedMatrix]


def _weights(h: int, i: int, dtype: torch.dtype, count: int, quant: str | None) -> list[Weights]:
    """`count` experts' weights as the model stores them: floats, MXFP4 (copies of one quantized expert), or GGUF
    blocks ("Q4_K" or "Q4_K/Q6_K": zero bytes, whose scales make every weight 0, an ordinary number)."""
    shapes = ((i, h), (i, h), (h, i))
    if quant is not None and quant != "mxfp4":
        gate, _, down = quant.partition("/")
        fmts = (gate, gate, down or gate)
        def zeros(rows: int, cols: int, f: str) -> QuantizedMatrix:
            return block_matrix(torch.zeros(rows, cols // FORMATS[f].values * FORMATS[f].nbytes, dtype=torch.uint8), f)
        return [tuple(zeros(*s, f) for s, f in zip(shapes, fmts, strict=True))  # type: ignore[misc]
                for _ in range(count)]
    plain = [torch.ones(s, dtype=dtype) * 0.01 for s in shapes]
    if quant != "mxfp4":
        return [tuple(w.clone() for w in plain) for _ in range(count)]  # type: ignore[misc]
    mats = [quantize_mxfp4(w) for w in plain]
    return [tuple(QuantizedMatrix(m.kind, m.data.clone(), m.scales.clone(), m.cols, m.group)  # type: ignore[misc]
                  for m in mats) for _ in range(count)]


def _prepare(executor: CpuExecutor, w: Weights) -> CpuExpert:
    if isinstance(w[0], QuantizedMatrix):
        return executor.prepare_quantized(*w)  # type: ignore[arg-type]
    return executor.prepare(*w)  # type: ignore[arg-type]


def microbench(shape: ModelShape, hw: HardwareInfo, dtype: torch.dtype = torch.bfloat16, quick: bool = False,
               progress: Progress | None = None, device_dtype: torch.dtype | None = None,
               accelerator_fixed: int | None = None) -> Measurements:
    """`dtype`: the CPU experts'; `device_dtype`: the GPU's where it differs (fp16); `accelerator_fixed`: what the
    model keeps on an accelerator beside its slots (memory.accelerator_bytes), to measure one at all."""
    threads = thread_candidates(hw)
    tokens = QUICK_TOKENS if quick else TOKENS
    min_time = 0.04 if quick else 0.12
    available = hw.ram_available or 4 * 2**30
    working_set = int(min(available // 4, (2**30 if quick else 2 * 2**30)))
    total = 1 + len(threads) + 2
    done = 0

    def step(name: str) -> None:
        nonlocal done
        done += 1
        if progress:
            progress(Step(name, done, total))

    bw = dram_bandwidth(max(threads), working_set)
    step(f"DRAM read bandwidth: {bw:.1f} GB/s")
    h, i = shape.hidden, shape.inter
    item = torch.empty((), dtype=dtype).element_size()
    per_expert = shape.expert_bytes if shape.expert_quant else 3 * h * i * item
    count = max(2, min(512, working_set // per_expert))  # small experts: the caches hold them anyway
    weights = _weights(h, i, dtype, count, shape.expert_quant)
    samples: dict[int, dict[int, float]] = {}
    torch_ms: dict[int, float] = {}
    isa = None
    crossover_cap = max(tokens)
    for t in threads:
        executor = CpuExecutor(h, i, dtype, CpuOptions(threads=t, crossover=crossover_cap))
        experts = [_prepare(executor, w) for w in weights]
        isa = executor.isa_for(experts[0], 1)
        samples[t] = {}
        for n in tokens:
            x = torch.ones(n, h, dtype=dtype)
            samples[t][n] = time_per_call(lambda k, x=x, e=experts: e[k](x), count, min_time)
        step(f"CPU experts, {t} thread{'s' if t > 1 else ''}: " +
             ", ".join(f"{n} tok {ms:.2f} ms" for n, ms in samples[t].items()))
    best_t = min(threads, key=lambda t: samples[t][1])
    # the executor's own choice per token count ("auto") and every kernel variant this CPU has for these weights,
    # at the best thread count, at one token and a few. A forced variant replaces "auto" only where it is faster
    # at both: forcing applies at every token count, and the best variant for one token need not be for eight.
    variants: dict[str, dict[int, float]] = {}
    if isa is not None:
        for v in ["auto", *CpuExecutor(h, i, dtype).isas]:
            forced = None if v == "auto" else v
            ex = CpuExecutor(h, i, dtype, CpuOptions(threads=best_t, crossover=crossover_cap, isa=forced))
            experts = [_prepare(ex, w) for w in weights]
            if v != "auto" and ex.isa_for(experts[0], 1) != v:
                continue  # this variant cannot serve these weights
            variants[v] = {}
            for n in (1, 8):
                x = torch.ones(n, h, dtype=dtype)
                variants[v][n] = time_per_call(lambda k, x=x, e=experts: e[k](x), count, min_time)
        isa = choose_variant(variants)
    step("kernel variants: " + ", ".join(f"{v} {ms[1]:.2f}/{ms[8]:.2f} ms" for v, ms in variants.items()) +
         f" (1/8 tokens) -> {isa}")
    torch_exec = CpuExecutor(h, i, dtype, CpuOptions(threads=best_t, use_kernel=False))
    torch_experts = [_prepare(torch_exec, w) for w in weights]
    previous = torch.get_num_threads()
    torch.set_num_threads(best_t)  # torch's own path at the same thread count, then back as it was
    try:
        for n in tokens:
            x = torch.ones(n, h, dtype=dtype)
            torch_ms[n] = time_per_call(lambda k, x=x: torch_experts[k](x), count, min_time)
    finally:
        torch.set_num_threads(previous)
    # crossover: the largest token count up to which the compiled kernel is at least as fast as torch
    crossover = 0
    for n in tokens:
        if samples[best_t][n] <= torch_ms[n]:
            crossover = n
        else:
            break
    fits = {t: fit_cpu({n: min(ms, torch_ms[n]) if t == best_t else ms for n, ms in s.items()})
            for t, s in samples.items()}
    step(f"crossover kernel -> torch after {crossover} tokens")
    return Measurements(
        cores=hw.cpu.physical_cores or hw.cpu.logical_cores or 1, expert_bytes=3 * h * i * item, cpu=fits,
        dram_gbps=bw, cpu_samples=samples,
        kernel={"isa": isa, "crossover": crossover or None, "torch_ms": {str(n): ms for n, ms in torch_ms.items()},
                "variants": {v: {str(n): ms for n, ms in s.items()} for v, s in variants.items()}},
        **_gpu_measurements(shape, hw, device_dtype or dtype, accelerator_fixed),
    )


def accelerator_measurements(accel: Accelerator, shape: ModelShape, dtype: torch.dtype, fixed: int,
                             min_time: float = 0.1) -> dict[str, object]:
    """What the planner needs of an accelerator, measured through the runtime's own paths (so on the emulated device
    as on CUDA): one expert's run on the device's stream, read back by the host; one expert's copy from pageable
    host memory through the staging ring, as the experts in RAM or memory-mapped are copied; and the bytes the
    dispatcher gives the expert slots once the model's own `fixed` bytes (memory.accelerator_bytes) and the
    scratch expert are placed (dispatch.slot_budget)."""
    h, i = shape.hidden, shape.inter
    host = [torch.ones(s, dtype=dtype) for s in ((i, h), (i, h), (h, i))]  # pageable
    slot = [accel.empty(t.shape, dtype, "an expert being measured") for t in host]
    expert = ExpertWeights(*slot)
    x = accel.to_device(torch.ones(1, h, dtype=dtype))
    copy_ms = time_per_call(lambda k: accel.copy_async(slot, host, demand=True).result(), 1, min_time)
    run_ms = time_per_call(lambda k: accel.download(lambda: (expert(x),)).wait(), 1, min_time)
    nbytes = sum(t.numel() * t.element_size() for t in slot)
    return {"gpu_expert_ms": run_ms, "copy_expert_ms": copy_ms, "h2d_gbps": nbytes / copy_ms / 1e6,
            "vram_for_experts": slot_budget(accel.budget, fixed + nbytes)}


def _gpu_measurements(shape: ModelShape, hw: HardwareInfo, dtype: torch.dtype, fixed: int | None
                      ) -> dict[str, object]:
    """The accelerator's measurements on `--gpu 0`, the GPU a plan without --gpu runs on (none without one, or without
    `fixed`)."""
    if hw.gpu(0) is None or not torch.cuda.is_available() or fixed is None:
        return {}
    accel = make_accelerator("cuda", None, 0)  # pragma: no cover - no GPU on test machines
    assert accel is not None  # pragma: no cover
    try:  # pragma: no cover
        return accelerator_measurements(accel, shape, dtype, fixed)
    finally:  # pragma: no cover
        accel.close()
