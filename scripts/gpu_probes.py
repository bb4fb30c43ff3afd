"""Probes of Tandem's CUDA path, run by scripts/gpu-check.sh: python gpu_probes.py OUT.json [MODEL_DIR] [WORK_DIR].

Each probe measures one thing the emulated device cannot show (numerics of the GPU's kernels, the allocator's real
footprint, host waits, implicit synchronisations, kernel launches a token) and fills its own record in one JSON
file, rewritten after every probe, so a timeout keeps what was measured. PROBES=name,name runs only those. GPU index:
$GPU (default 0). docs/bench/gpu/README.md says what each read on an H200 and what it should read.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import sys
import time
import traceback
import types
import warnings
from pathlib import Path

import torch

OUT = Path(sys.argv[1])
MODEL = Path(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2] and Path(sys.argv[2]).is_dir() else None
WORK = Path(sys.argv[3]) if len(sys.argv) > 3 else Path("/tmp")
ONLY = {p for p in os.environ.get("PROBES", "").split(",") if p}
GPU = int(os.environ.get("GPU", "0"))
DEV = torch.device("cuda", GPU)
GIB = 1 << 30
results: dict[str, dict] = {}


def save() -> None:
    OUT.write_text(json.dumps(results, indent=1, default=str))


def probe(fn):
    """Run fn(record) now (definition order is run order); its error, if any, goes into the record."""
    name = fn.__name__
    if ONLY and name not in ONLY:
        return fn
    rec = results.setdefault(name, {})
    start = time.perf_counter()
    print(f"probe {name} ...", flush=True)
    try:
        fn(rec)
    except BaseException as e:  # noqa: BLE001 - a probe's failure is a finding, the next probe still runs
        rec["error"] = f"{type(e).__name__}: {e}"[:1000]
        rec["trace"] = traceback.format_exc()[-3000:]
        if isinstance(e, KeyboardInterrupt):
            raise
    finally:
        try:
            torch.cuda.set_sync_debug_mode("default")
        except Exception:  # noqa: BLE001
            pass
        rec["seconds"] = round(time.perf_counter() - start, 2)
        save()
        gc.collect()
        torch.cuda.empty_cache()
        print(f"probe {name}: {json.dumps(rec, default=str)[:600]}", flush=True)
    return fn


def count_syncs(fn):
    """fn() under torch.cuda.set_sync_debug_mode('warn'): (its result, implicit syncs warned, other warnings)."""
    torch.cuda.synchronize(DEV)
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            out = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = sum("synchroniz" in str(w.message) for w in seen)
    return out, syncs, len(seen) - syncs


_CPS: list[float] = []


def gpu_sleep(seconds: float) -> None:
    """Queue `seconds` of device time (torch.cuda._sleep, calibrated once) on the current stream."""
    if not _CPS:
        with torch.cuda.device(DEV):
            torch.cuda._sleep(1000)
            torch.cuda.synchronize(DEV)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            torch.cuda._sleep(50_000_000)
            b.record()
            b.synchronize()
            _CPS.append(50_000_000 / (a.elapsed_time(b) / 1e3))
    with torch.cuda.device(DEV):
        torch.cuda._sleep(int(_CPS[0] * seconds))


def idle_fence(self):  # noqa: ANN001 - a CUDA event never recorded: a stream that waits on it does not wait
    return torch.cuda.Event()


def tiny_checkpoint():
    from tandem.runtime.checkpoint import open_checkpoint
    from tandem.runtime.synth import tiny_config, write_test_model

    folder = WORK / "probe-tiny-mixtral"
    if not folder.exists():
        write_test_model(folder, tiny_config("mixtral", num_hidden_layers=3), seed=3)
    return open_checkpoint(folder)


def bench_checkpoint():
    """The bench model gpu-check.sh made, else a small OLMoE-like one written here."""
    from tandem.runtime.checkpoint import open_checkpoint
    from tandem.runtime.synth import tiny_config, write_test_model

    if MODEL is not None:
        return open_checkpoint(MODEL)
    folder = WORK / "probe-olmoe-small"
    if not folder.exists():
        cfg = tiny_config("olmoe", hidden_size=1024, intermediate_size=512, num_experts=32, num_experts_per_tok=8,
                          num_hidden_layers=4, vocab_size=8192, num_attention_heads=8, num_key_value_heads=8,
                          max_position_embeddings=2048)
        write_test_model(folder, cfg, seed=1, dtype=torch.bfloat16, std=0.02)
    return open_checkpoint(folder)


def partial_vram(ckpt, dtype: torch.dtype, context: int, batch: int = 1, share: float = 0.25) -> float:
    """GB for a budget whose slots hold `share` of all experts beside the model's own bytes (as selftest sizes it)."""
    from tandem.runtime.dispatch import budget_for_slots
    from tandem.runtime.memory import accelerator_bytes

    cfg = ckpt.config
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * dtype.itemsize
    fixed = accelerator_bytes(ckpt, dtype, context, batch) + expert
    slots = max(cfg.top_k, int(share * cfg.num_moe_layers * cfg.num_experts))
    return budget_for_slots(fixed, slots, expert) / GIB


def load(ckpt, dtype, kind, vram_gb=None, context=256, batch=1, ragged=False, cpu_dtype=None, policy=None):
    from tandem.kernels.experts import CpuOptions
    from tandem.runtime.accelerator import make_accelerator
    from tandem.runtime.model import ModelRun, MoEModel

    accel = None if kind == "none" else make_accelerator(kind, vram_gb, GPU)
    return MoEModel.from_checkpoint(ckpt, ModelRun(dtype, context, batch, cpu_dtype=cpu_dtype, ragged=ragged), accel,
                                    policy, CpuOptions(resident=True), None)


def drop(model) -> None:
    from tandem.runtime.accelerator import release_device_memory

    model.close()
    del model
    gc.collect()
    release_device_memory()


# ---------------------------------------------------------------------------------------------------------------
@probe
def env(rec):
    from tandem.kernels.library import available_isas, library
    from tandem.runtime.accelerator import cuda_devices

    lib = library()
    p = torch.cuda.get_device_properties(DEV)
    free, total = torch.cuda.mem_get_info(DEV)
    rec.update(torch=torch.__version__, cuda=torch.version.cuda, device=p.name, capability=[p.major, p.minor],
               mem_free=free, mem_total=total, cuda_devices=[dataclasses.asdict(d) for d in cuda_devices()],
               kernel_library=getattr(lib, "_name", None), isas=available_isas() if lib is not None else [],
               torch_threads=torch.get_num_threads(),
               allow_tf32=torch.backends.cuda.matmul.allow_tf32,
               bf16_reduced_precision_reduction=torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
               CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES"))
    # two OpenMP runtimes (torch's and the kernels') would make accelerator._single_threaded miss torch's pool
    rec["openmp_libraries_mapped"] = sorted({line.split()[-1] for line in open("/proc/self/maps")
                                             if "gomp" in line or "iomp" in line})
    rec["parallel_info"] = torch.__config__.parallel_info()[:1500]
    try:
        from tandem.autotune.probe import probe as hw_probe

        hw = hw_probe()
        rec["nvml"] = {"status": hw.gpu_status, "gpus": [dataclasses.asdict(g) for g in hw.gpus]}
    except Exception as e:  # noqa: BLE001
        rec["nvml"] = f"{type(e).__name__}: {e}"


@probe
def fence(rec):
    """A copy into a slot behind a kernel that reads it after 0.3 s of device time: 1.0 = the copy waited (the fence
    holds), 2.0 = it overwrote the slot under the kernel. Then the same without a fence (the probe must see it), and
    selftest's own fence check with the fence taken away (does it notice?)."""
    from tandem.runtime.accelerator import CudaAccelerator

    def run(no_fence: bool) -> float:
        accel = CudaAccelerator(GIB, DEV.index)
        if no_fence:
            accel._fence = types.MethodType(idle_fence, accel)
        try:
            slot = accel.empty((4096, 4096), torch.float32, "the slot")
            accel.copy_async([slot], [torch.ones(4096, 4096)]).result()

            def kernel() -> torch.Tensor:
                gpu_sleep(0.3)
                return slot.sum()

            read = accel.submit(kernel)
            copy = accel.copy_async([slot], [torch.full((4096, 4096), 2.0)])
            seen = float(accel.download(lambda: (read.result(),)).wait()[0])
            copy.result()
            return seen / (4096 * 4096)
        finally:
            accel.close()

    rec["strong_probe_with_fence_expect_1"] = run(False)
    save()
    rec["strong_probe_without_fence_expect_2"] = run(True)
    save()
    from tandem.runtime import selftest as st

    device = st._Device("cuda", GPU, tiny_checkpoint())
    original = CudaAccelerator._fence
    CudaAccelerator._fence = idle_fence
    try:
        check = st._fence(device)
    finally:
        CudaAccelerator._fence = original
    rec["selftest_fence_check_without_fence"] = {"ok": check.ok, "detail": check.detail,
                                                 "meaning": "ok=True: the selftest cannot see a missing fence"}
    check = st._fence(device)
    rec["selftest_fence_check_with_fence"] = {"ok": check.ok, "detail": check.detail}


@probe
def hidden_syncs(rec):
    """Implicit host synchronisations (set_sync_debug_mode warnings) of device-side dequantization."""
    from tandem.kernels.blocks import dequantize
    from tandem.kernels.quant import quantize_mxfp4

    q = quantize_mxfp4(torch.randn(256, 256))
    qd = dataclasses.replace(q, data=q.data.to(DEV), scales=q.scales.to(DEV))
    raw6 = torch.randint(0, 256, (64, 210), dtype=torch.uint8, device=DEV)
    raw4 = torch.randint(0, 256, (64, 144), dtype=torch.uint8, device=DEV)
    cases = {
        "control: torch.tensor(list, device=cuda)": lambda: torch.tensor([1, 2], device=DEV),
        "MXFP4 matrix dequantize on the GPU, a second call (gpt-oss experts in GPU slots)":
            lambda: qd.dequantize(torch.bfloat16),
        "GGUF Q6_K dequantize on the GPU, a second call (Q4_K_M's down matrices)":
            lambda: dequantize(raw6, "Q6_K"),
        "control, none expected: GGUF Q4_K dequantize on the GPU": lambda: dequantize(raw4, "Q4_K"),
    }
    for name, fn in cases.items():
        fn()  # (a dequantizer's tables are made once a device: its first call may wait for that copy)
        _, syncs, other = count_syncs(fn)
        rec[name] = {"implicit_syncs": syncs, "other_warnings": other}


@probe
def host_waits(rec):
    """(1) submit(after=demand copy) queued behind 1 s of device work: how long the host is held in submit (the
    emulated device returns at once). (2) A background copy behind 1 s of device work while the host sleeps: the
    process's CPU seconds meanwhile (about 1.0: a copier thread spins in cudaEventSynchronize). (3) CPU matmuls
    alone and while a copier waits that way (an OpenMP team against a spinning thread)."""
    from tandem.runtime.accelerator import CudaAccelerator

    accel = CudaAccelerator(4 * GIB, DEV.index)
    try:
        shape = (4096, 4096)
        slots = [accel.empty(shape, torch.bfloat16, "slot") for _ in range(3)]
        host = [torch.randn(shape).to(torch.bfloat16) for _ in range(3)]  # pageable, as experts in RAM are
        accel.copy_async(slots, host, demand=True).result()
        accel.copy_async(slots, host).result()
        torch.cuda.synchronize(DEV)
        # (1)
        gpu_sleep(1.0)
        w, c = time.perf_counter(), time.process_time()
        copy = accel.copy_async(slots, host, demand=True)
        fut = accel.submit(lambda: slots[2].float().sum(), after=(copy,))
        rec["submit_after_demand_copy_wall_s"] = round(time.perf_counter() - w, 3)
        rec["submit_after_demand_copy_cpu_s"] = round(time.process_time() - c, 3)
        accel.download(lambda: (fut.result(),)).wait()
        rec["until_result_wall_s"] = round(time.perf_counter() - w, 3)
        save()
        # (2)
        torch.cuda.synchronize(DEV)
        gpu_sleep(1.0)
        c = time.process_time()
        background = accel.copy_async(slots, host)
        time.sleep(1.0)
        rec["process_cpu_s_during_1s_host_sleep_while_a_copier_waits"] = round(time.process_time() - c, 3)
        background.result()
        save()
        # (3)
        a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)

        def cpu_work(reps: int = 20) -> float:
            t = time.perf_counter()
            for _ in range(reps):
                a @ b
            return time.perf_counter() - t

        cpu_work(3)
        alone = min(cpu_work() for _ in range(2))
        torch.cuda.synchronize(DEV)
        gpu_sleep(2 * alone + 0.5)
        background = accel.copy_async(slots, host)
        time.sleep(0.05)
        contended = cpu_work()
        background.result()
        rec["cpu_matmuls_alone_s"] = round(alone, 4)
        rec["cpu_matmuls_while_a_copier_waits_s"] = round(contended, 4)
    finally:
        accel.close()


SHAPES = {
    "qwen3-30b-a3b 768x2048 (3 MiB)": (768, 2048),
    "olmoe 1024x2048 (4 MiB)": (1024, 2048),
    "deepseek-v2-lite / qwen1.5-moe 1408x2048 (5.5 MiB)": (1408, 2048),
    "glm-4.5-air 1408x4096 (11 MiB)": (1408, 4096),
    "mixtral 14336x4096 (112 MiB)": (14336, 4096),
}


@probe
def allocator_overhead(rec):
    """Bytes the caching allocator reserves for ~2 GiB of expert-slot tensors against the bytes the budget counts."""
    from tandem.runtime.accelerator import CudaAccelerator

    for label, shape in SHAPES.items():
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(DEV)
        accel = CudaAccelerator(1 << 45, DEV.index)
        size = shape[0] * shape[1] * 2
        held = [accel.empty(shape, torch.bfloat16, "slot") for _ in range(max(4, 2 * GIB // size))]
        reserved = torch.cuda.memory_reserved(DEV) - before
        rec[label] = {"tensors": len(held), "accounted": accel.used, "reserved": reserved,
                      "overhead": round(reserved / accel.used - 1, 4)}
        del held
        accel.close()
        save()


@probe
def slab_footprint(rec):
    """The same ~2 GiB of expert slots of each shape cut from slabs as the dispatcher cuts them (dispatch.SLAB_BYTES,
    one allocation each): what the allocator reserves against what the budget counts (expected: ~0)."""
    from tandem.runtime.accelerator import CudaAccelerator
    from tandem.runtime.dispatch import SLAB_BYTES

    for label, shape in SHAPES.items():
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(DEV)
        accel = CudaAccelerator(1 << 45, DEV.index)
        expert = 3 * shape[0] * shape[1] * 2
        slots = max(4, 2 * GIB // expert)
        per_slab = max(1, SLAB_BYTES // expert)
        held = [accel.slab(min(per_slab, slots - first) * expert, "slots")
                for first in range(0, slots, per_slab)]
        reserved = torch.cuda.memory_reserved(DEV) - before
        rec[label] = {"slots": slots, "slabs": len(held), "accounted": accel.used, "reserved": reserved,
                      "overhead": round(reserved / accel.used - 1, 4)}
        del held
        accel.close()
        save()


@probe
def budget_exhaustion(rec):
    """With ~1 GiB left free on the device (the rest held), the budget make_accelerator takes without --vram-gb
    (all free memory) filled with expert tensors until something refuses: the budget (accounting holds) or the
    device (the allocator's rounding made the budget a promise the device cannot keep). The dispatcher fills
    1 - 1/RESERVE of it."""
    from tandem.kernels.errors import ResourceError
    from tandem.runtime.accelerator import make_accelerator
    from tandem.runtime.dispatch import RESERVE

    rec["dispatcher_fills_up_to_share"] = round(1 - 1 / RESERVE, 4)
    for label, shape in SHAPES.items():
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(DEV)
        blocker = torch.empty(max(0, free - GIB), dtype=torch.uint8, device=DEV)
        accel = make_accelerator("cuda", None, GPU)
        held, err = [], ""
        try:
            while True:
                held.append(accel.empty(shape, torch.bfloat16, f"expert slot {len(held)}"))
        except ResourceError as e:
            err = str(e)
        rec[label] = {"budget": accel.budget, "accounted_when_refused": accel.used,
                      "share_of_budget": round(accel.used / accel.budget, 4),
                      "refused_by": "the device (out of memory)" if "ran out of memory" in err else "the budget",
                      "message": err[:160]}
        del held, blocker
        accel.close()
        save()


@probe
def numerics(rec):
    """Teacher-forced logits of one random sequence on each path against the CPU in fp32: top-1 agreement, largest
    difference, exact top-2 ties (argmax then takes the lower id), and the share of logits that are exactly bf16
    values (1.0: rounded to bf16, which model.py:552 says must not happen)."""
    from tandem.runtime.dispatch import OffloadOptions

    ckpt = bench_checkpoint()
    cfg = ckpt.config
    ids = torch.randint(3, cfg.vocab_size, (1, 160), generator=torch.Generator().manual_seed(0))
    every = tuple((layer, e) for layer in range(cfg.num_layers) if cfg.sparse_layers[layer]
                  for e in range(cfg.num_experts))

    def logits(dtype, kind, vram=None, cpu_dtype=None, policy=None) -> torch.Tensor:
        m = load(ckpt, dtype, kind, vram, context=256, cpu_dtype=cpu_dtype, policy=policy)
        try:
            return m.forward(ids, 0).float()[0]  # [T, V]
        finally:
            drop(m)

    def stats(lg: torch.Tensor, ref: torch.Tensor | None) -> dict:
        top2 = lg.topk(2, dim=-1).values
        out = {"exact_top2_ties": round((top2[:, 0] == top2[:, 1]).float().mean().item(), 4),
               "logits_exactly_bf16": round((lg == lg.to(torch.bfloat16).float()).float().mean().item(), 4),
               "finite": bool(torch.isfinite(lg).all())}
        if ref is not None:
            out["top1_agrees_with_cpu_fp32"] = round((lg.argmax(-1) == ref.argmax(-1)).float().mean().item(), 4)
            out["max_abs_diff_vs_cpu_fp32"] = round((lg - ref).abs().max().item(), 5)
        return out

    ref = logits(torch.float32, "none")
    rec["cpu fp32 (reference)"] = stats(ref, None)
    save()
    partial = partial_vram(ckpt, torch.bfloat16, 256)
    paths = {
        "cpu bf16": (torch.bfloat16, "none", None, None, None),
        "gpu bf16, every expert static on the GPU": (torch.bfloat16, "cuda", None, None,
                                                     OffloadOptions(static=every)),
        f"gpu bf16, {partial:.2f} GB budget (~1/4 of the experts), fiddler": (torch.bfloat16, "cuda", partial, None,
                                                                               None),
        "gpu fp16 (pre-Ampere dtype), CPU experts fp32": (torch.float16, "cuda", None, torch.float32,
                                                          OffloadOptions(static=every)),
        "gpu fp32, every expert static": (torch.float32, "cuda", None, None, OffloadOptions(static=every)),
    }
    for name, (dtype, kind, vram, cpu_dtype, policy) in paths.items():
        try:
            rec[name] = stats(logits(dtype, kind, vram, cpu_dtype, policy), ref)
        except Exception as e:  # noqa: BLE001
            rec[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
        save()


def _decode_counts(model, tokens: int = 8) -> dict:
    from tandem.runtime.engine import Engine
    from tandem.runtime.sampling import SamplingParams

    steps = Engine(model, ()).generate(list(range(5, 69)), SamplingParams(max_new_tokens=tokens + 1))
    next(steps)  # the prefill
    before = model.accel.syncs
    start = time.perf_counter()
    decoded, syncs, other = count_syncs(lambda: sum(1 for _ in steps))
    took = time.perf_counter() - start
    stats = model.dispatcher.request_stats().as_dict()
    return {"steps": decoded, "host_reads_per_step": round((model.accel.syncs - before) / max(1, decoded), 2),
            "implicit_syncs_per_step": round(syncs / max(1, decoded), 2), "other_warnings": other,
            "moe_layers": model.cfg.num_moe_layers, "tok_s_under_debug_mode": round(decoded / took, 2),
            "experts": stats["experts"], "hit_rate": stats["cache"]["hit_rate"]}


@probe
def decode_syncs(rec):
    """Host synchronisations per decode step on a real-shaped model (selftest only counts them on a tiny fp32 one)."""
    from tandem.runtime.dispatch import OffloadOptions, Strategy

    ckpt = bench_checkpoint()
    vram = partial_vram(ckpt, torch.bfloat16, 256)
    for strategy in (Strategy.FIDDLER, Strategy.CPU, Strategy.FETCH):
        m = load(ckpt, torch.bfloat16, "cuda", vram, context=256, policy=OffloadOptions(strategy))
        try:
            rec[str(strategy)] = _decode_counts(m)
        finally:
            drop(m)
        save()


@probe
def prefill_memory(rec):
    """A prompt of two 512-token passes: the device memory the pass takes above what the load allocated, against the
    activation reserve (model.activation_bytes), and the whole footprint against the budget."""
    from tandem.runtime.accelerator import release_device_memory
    from tandem.runtime.engine import Engine
    from tandem.runtime.model import activation_bytes
    from tandem.runtime.sampling import SamplingParams

    ckpt = bench_checkpoint()
    context = min(1024, ckpt.config.max_position_embeddings)
    release_device_memory()
    base_reserved, base_alloc = torch.cuda.memory_reserved(DEV), torch.cuda.memory_allocated(DEV)
    m = load(ckpt, torch.bfloat16, "cuda", partial_vram(ckpt, torch.bfloat16, context), context=context)
    try:
        accel = m.accel
        reserve = activation_bytes(m.cfg, m.prefill_chunk, context, 1, torch.bfloat16)
        loaded_alloc = torch.cuda.memory_allocated(DEV)
        rec.update(budget=accel.budget, accounted=accel.used, activation_reserve=reserve,
                   allocated_by_load=loaded_alloc - base_alloc, accounted_without_reserve=accel.used - reserve,
                   reserved_after_load=torch.cuda.memory_reserved(DEV) - base_reserved)
        torch.cuda.reset_peak_memory_stats(DEV)
        prompt = torch.randint(3, m.cfg.vocab_size, (context - 24,), generator=torch.Generator().manual_seed(1))
        list(Engine(m, ()).generate(prompt.tolist(), SamplingParams(max_new_tokens=2)))
        peak = torch.cuda.max_memory_allocated(DEV) - loaded_alloc
        rec.update(prefill_peak_above_load=peak, peak_over_activation_reserve=round(peak / reserve, 3),
                   peak_reserved_over_budget=round((torch.cuda.max_memory_reserved(DEV) - base_reserved)
                                                   / accel.budget, 4))
    finally:
        drop(m)


@probe
def batch_pass_syncs(rec):
    """forward_rows (batch, serve) on the GPU: two sequences, two micro-batches (prefetch path), one decode pass."""
    from tandem.runtime.model import Segment

    ckpt = bench_checkpoint()
    m = load(ckpt, torch.bfloat16, "cuda", partial_vram(ckpt, torch.bfloat16, 256, batch=2), context=256, batch=2,
             ragged=True)
    try:
        m.micro_batches = 2
        gen = torch.Generator().manual_seed(2)
        m.forward_rows(torch.randint(3, m.cfg.vocab_size, (40,), generator=gen),
                       [Segment(0, 0, 20), Segment(1, 0, 20)], phase="prefill")
        before = m.accel.syncs
        _, syncs, other = count_syncs(lambda: m.forward_rows(torch.tensor([7, 9]), [Segment(0, 20, 1),
                                                                                    Segment(1, 20, 1)]))
        rec.update(host_reads=m.accel.syncs - before, implicit_syncs=syncs, other_warnings=other,
                   moe_layers=m.cfg.num_moe_layers,
                   note="expected: no implicit sync (every index reaches the device through Accelerator.to_device)")
    finally:
        drop(m)


@probe
def decode_profile(rec):
    """Where a decode token's time goes on the bench model: tokens/s, the host's waits for the device against the
    whole token, and CUDA kernels a token (torch.profiler), for every expert on the GPU and a quarter of them."""
    from torch.profiler import ProfilerActivity, profile

    from tandem.runtime import accelerator as acc
    from tandem.runtime.dispatch import OffloadOptions, Strategy
    from tandem.runtime.engine import Engine
    from tandem.runtime.sampling import SamplingParams

    ckpt = bench_checkpoint()
    cfg = ckpt.config
    waited = [0.0]
    real_wait = acc.HostRead.wait

    def timed_wait(self):  # noqa: ANN001, ANN202
        t = time.perf_counter()
        try:
            return real_wait(self)
        finally:
            waited[0] += time.perf_counter() - t

    quarter = partial_vram(ckpt, torch.bfloat16, 1024)
    rows = {"gpu, every expert": (None, None), "gpu, 1/4 of the experts, fiddler": (quarter, OffloadOptions()),
            "gpu, 1/4 of the experts, fetch": (quarter, OffloadOptions(Strategy.FETCH)), "cpu only": (None, "cpu")}
    acc.HostRead.wait = timed_wait
    try:
        for name, (vram, policy) in rows.items():
            cpu_only = policy == "cpu"
            m = load(ckpt, torch.bfloat16, "none" if cpu_only else "cuda", vram, context=1024,
                     policy=None if cpu_only else policy)
            try:
                engine = Engine(m, ())
                prompt = [(7 * i) % cfg.vocab_size for i in range(10, 138)]

                def run(n: int, engine: Engine = engine, prompt: list[int] = prompt) -> float:
                    t = time.perf_counter()
                    for _ in engine.generate(prompt, SamplingParams(max_new_tokens=n)):
                        pass
                    return time.perf_counter() - t

                run(33)
                one = run(1)
                waited[0] = 0.0
                many = run(33)
                row = {"decode_tok_s": round(32 / (many - one), 1), "prefill_tok_s": round(128 / one, 1),
                       "host_wait_ms_a_token": round(waited[0] / 33 * 1e3, 3),
                       "ms_a_token": round(many / 33 * 1e3, 3), "plan": m.dispatcher.describe()}
                if not cpu_only:
                    with profile(activities=[ProfilerActivity.CUDA]) as prof:
                        run(9)
                    kernels = sum(e.count for e in prof.key_averages()
                                  if e.device_type == torch.autograd.DeviceType.CUDA)
                    row["cuda_kernels_a_token"] = round(kernels / 9, 1)  # (the prompt's pass shared out)
                rec[name] = row
            finally:
                drop(m)
            save()
    finally:
        acc.HostRead.wait = real_wait


print(json.dumps({k: ("error" in v) for k, v in results.items()}), flush=True)
