"""`tandem bench kernels`: CPU expert latency against the DRAM roofline, Tandem's executor beside plain torch.

For each expert shape, weight dtype and token count: the latency of one expert with the weights cycling
through more experts than the caches hold, the effective GB/s of weight bytes read, and that divided by
the streaming read bandwidth measured at the start of the same run; the GFLOP/s of its products, and that divided
by the compute peak (microbench.compute_peak: oneDNN's fp32, bf16 or int8 products, as the dtype computes) measured
in the same run. gpt-oss's shapes run with its biases and
clamped SwiGLU (the kernels' epilogue); "mxfp4" experts are random codes and scales, as a published gpt-oss
checkpoint stores them (kernels/quant.py). Implementations: "tandem" (one expert per
call), "layer" (the family's top-k experts per call, as a MoE layer runs them in decode; latency per expert)
and "torch". They are timed in turns (reversed every other round), `rounds` times, and each row keeps its fastest
round: on a shared machine one slow moment (another process streaming memory) would otherwise decide a row.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from tandem.autotune.bench.shapes import find_shape
from tandem.autotune.microbench import PEAK_OF, compute_peak, dram_bandwidth, time_per_call
from tandem.kernels.experts import CpuExecutor, CpuExpert, CpuOptions, Epilogue, epilogue_for, glu
from tandem.kernels.quant import QuantizedMatrix

DTYPES = ("bf16", "fp16", "fp32", "int8", "int4", "mxfp4")
TOKENS = (1, 2, 4, 8, 16, 64, 256)
MAX_TOKENS = 4096  # tokens per call at most: 4096 x hidden activations stay small beside the weights
TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
WORKING_SET = 2 * 1024**3  # bytes of expert weights cycled through: beyond any cache


def bench_kernels(
    shapes: list[str], threads: int, dtypes: tuple[str, ...] = DTYPES, tokens: tuple[int, ...] = TOKENS,
    min_time: float = 0.4, progress: Callable[[str], None] | None = None, working_set: int = WORKING_SET,
    rounds: int = 2,
) -> list[dict[str, Any]]:
    torch.set_num_threads(threads)
    bw = dram_bandwidth(threads, working_set)
    peak = compute_peak()
    rows: list[dict[str, Any]] = []
    for shape in shapes:
        expert = find_shape(shape).expert
        h, i, k = expert.hidden, expert.width, expert.top_k
        for dtype in dtypes:
            if progress:
                progress(f"{shape} {dtype}: preparing experts")
            ours, peer = _experts(h, i, dtype, threads, working_set, k, expert.clamped, expert.act)
            executor = ours[0].executor
            layers = [executor.layer(ours[j : j + k]) for j in range(0, len(ours) - k + 1, k)]
            gen = torch.Generator().manual_seed(1)
            for t in tokens:
                x = torch.randn(t, h, generator=gen).to(executor.dtype)
                ids, weights = torch.arange(k).repeat(t, 1), torch.full((t, k), 1 / k)  # [t, k]: all k experts
                impls: dict[str, tuple[Callable[[int], object], int, int]] = {  # (call j, calls to cycle, experts)
                    "tandem": (lambda j, x=x, e=ours: e[j](x), len(ours), 1)}
                if executor.serves_layer(layers[0], t):
                    impls["layer"] = (lambda j, x=x, ids=ids, w=weights, ex=executor, ls=layers:
                                      ex.run_layer(ls[j], x, ids, w), len(layers), k)
                if peer is not None:
                    impls["torch"] = (lambda j, x=x, p=peer: p(j, x), len(ours), 1)
                best = {impl: float("inf") for impl in impls}
                for r in range(rounds):  # implementations take turns, in reverse order every other round so that
                    # none always runs first after the previous row; each keeps its fastest round
                    for impl, (fn, calls, per_call) in list(impls.items())[:: -1 if r % 2 else 1]:
                        best[impl] = min(best[impl], time_per_call(fn, calls, min_time / rounds) / 1000 / per_call)
                for impl, latency in best.items():
                    gbps = ours[0].nbytes / latency / 1e9
                    gflops = 6 * h * i * t / latency / 1e9  # three products of 2·h·i per token
                    top = peak[PEAK_OF[dtype]]
                    rows.append({"shape": shape, "dtype": dtype, "tokens": t, "threads": threads, "impl": impl,
                                 "latency_ms": round(latency * 1e3, 4), "gbps": round(gbps, 2),
                                 "bw_gbps": round(bw, 2), "ratio": round(gbps / bw, 3),
                                 "gflops": float(f"{gflops:.4g}"), "peak_gflops": float(f"{top:.4g}"),
                                 "of_peak": float(f"{gflops / top:.3g}")})
                    if progress:
                        progress(f"{shape} {dtype} {t:>3} tokens {impl:>6}: {latency * 1e3:8.3f} ms  {gbps / bw:5.2f}")
    return rows


Peer = Callable[[int, torch.Tensor], object]


def _experts(h: int, i: int, dtype: str, threads: int, working_set: int, at_least: int = 1,
             clamped: tuple[float, float] | None = None, act: str = "silu") -> tuple[list[CpuExpert], Peer | None]:
    """Enough random experts of this shape and dtype to exceed the caches (and at least `at_least`), and plain
    torch's way to run them:
    F.linear's default path, or torch's int8 weight-only matmul (torch's int4 CPU kernel needs its own
    packing, and torch has no MXFP4 CPU kernel: no torch row for either). `clamped`: gpt-oss's activation, with
    random biases (the kernels' epilogue); `act`: the gate's activation (Gemma's tanh GELU)."""
    stored = TORCH_DTYPES.get(dtype, torch.bfloat16)
    compute = torch.bfloat16 if dtype in ("bf16", "int8", "int4", "mxfp4") else stored
    quant = dtype if dtype in ("int8", "int4") else None
    executor = CpuExecutor(h, i, compute, CpuOptions(threads=threads, quant=quant))
    gen = torch.Generator().manual_seed(0)
    epilogue = epilogue_for(act) if clamped is None else Epilogue(
        *(torch.randn(n, generator=gen) * 0.1 for n in (i, i, h)), clamped=clamped)
    ours: list[CpuExpert] = []
    while len(ours) < at_least or len(ours) * ours[0].nbytes < working_set:
        if dtype == "mxfp4":  # random codes, and scales for weights of about 0.02
            mats = [QuantizedMatrix("mxfp4", torch.randint(0, 256, (r, c // 2), generator=gen, dtype=torch.uint8),
                                    torch.randint(119, 122, (r, c // 32), generator=gen, dtype=torch.uint8), c, 32)
                    for r, c in ((i, h), (i, h), (h, i))]
            ours.append(executor.prepare_quantized(*mats, epilogue=epilogue))
            continue
        ws = [(torch.randn(s, generator=gen) * 0.02).to(stored) for s in ((i, h), (i, h), (h, i))]
        ours.append(executor.prepare(*ws, epilogue=epilogue))  # quantized right away: the bf16 original is dropped
    if dtype in TORCH_DTYPES:
        def dense(k: int, x: torch.Tensor) -> torch.Tensor:
            e = ours[k]
            return F.linear(glu(F.linear(x, e.gate), F.linear(x, e.up), act), e.down)  # type: ignore[arg-type]
        return ours, dense
    if dtype == "int8":
        mm = torch.ops.aten._weight_int8pack_mm

        plain = [[m.row_major() for m in (e.gate, e.up, e.down)] for e in ours]  # type: ignore[union-attr]

        def int8(k: int, x: torch.Tensor) -> torch.Tensor:  # torch's kernel reads the row-major layout
            g, u, d = plain[k]
            a = glu(mm(x, g.data, g.scales.to(x.dtype)), mm(x, u.data, u.scales.to(x.dtype)), act)  # type: ignore
            return mm(a, d.data, d.scales.to(x.dtype))  # type: ignore[union-attr]
        return ours, int8
    return ours, None
