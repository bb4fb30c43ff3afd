"""Does the planner pick well, and does the simulator predict well? Measured on this machine.

CPU only: every thread-count candidate is run for real and simulated. Emulated accelerator holding a
share of the experts: every cache geometry (ways) and eviction policy is run for real and simulated, with
the emulated device's own expert latency and copy time measured first. For each sweep: the planner's pick,
its measured speed against the best measured, the regret, and the simulator's prediction error per row.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from tandem.autotune.measurements import Measurements
from tandem.autotune.microbench import accelerator_measurements, microbench
from tandem.autotune.plan import ModelShape, Plan, evaluate, make_plan
from tandem.autotune.probe import probe
from tandem.autotune.run import record_trace
from tandem.runtime.accelerator import EmulatedAccelerator
from tandem.runtime.checkpoint import open_checkpoint
from tandem.runtime.dispatch import Strategy, budget_for_slots
from tandem.runtime.engine import Engine, GenerationStats
from tandem.runtime.expert_cache import CachePolicy
from tandem.runtime.loader import load_model
from tandem.runtime.options import DTYPES, default_dtype, takes_int8_blocks
from tandem.runtime.sampling import SamplingParams

PROMPT = "Tell me about the history of the printing press and why it mattered."


def measure(model_dir: str | Path, dtype: str, tokens: int, **kwargs: Any) -> float:
    """Real decode ms/token for one configuration, given as load settings (best of two runs)."""
    loaded = load_model(model_dir, dtype=dtype, context=256, **kwargs)
    engine = Engine(loaded.model, ())
    prompt = loaded.tokenizer.encode(PROMPT)
    best = float("inf")
    for _ in range(2):
        stats = GenerationStats()
        for _ in engine.generate(prompt, SamplingParams(max_new_tokens=tokens), stats):
            pass
        best = min(best, 1000.0 / stats.decode_tok_s)
    loaded.model.close()
    return best


def emulated_device(shape: ModelShape, dtype: torch.dtype) -> tuple[float, float]:
    """The emulated accelerator's expert latency and one expert's copy time, in ms, measured as autotune measures a
    GPU: through the accelerator's own stream and copy paths."""
    accel = EmulatedAccelerator(2 * 3 * shape.hidden * shape.inter * dtype.itemsize)
    try:
        measured = accelerator_measurements(accel, shape, dtype, fixed=0)
    finally:
        accel.close()
    return float(measured["gpu_expert_ms"]), float(measured["copy_expert_ms"])  # type: ignore[arg-type]


def _summary(rows: list[dict[str, Any]], chosen: dict[str, Any]) -> dict[str, Any]:
    best = min(rows, key=lambda r: r["measured_ms"])
    picked = next(r for r in rows if r["config"] == chosen)
    errors = [abs(r["predicted_ms"] - r["measured_ms"]) / r["measured_ms"] for r in rows]
    return {"rows": rows, "planned": chosen, "best_measured": best["config"],
            "regret_pct": round(100 * (picked["measured_ms"] / best["measured_ms"] - 1), 1),
            "prediction_error_pct": {"mean": round(100 * float(np.mean(errors)), 1),
                                     "max": round(100 * float(np.max(errors)), 1)}}


def validate(model_dir: str | Path, expert_fraction: float = 0.25, tokens: int = 32, dtype: str = "auto",
             quick: bool = True) -> dict[str, Any]:
    hw = probe()
    ckpt = open_checkpoint(model_dir)
    name = default_dtype(set(hw.cpu.flags) or None, takes_int8_blocks(ckpt, None)) if dtype == "auto" else dtype
    shape = ModelShape.from_checkpoint(ckpt, DTYPES[name].itemsize)
    meas = microbench(shape, hw, DTYPES[name], quick=quick)
    trace, measured_ms, threads = record_trace(model_dir, name, tokens)
    meas.token_overhead_ms = max(0.0, measured_ms - evaluate(Plan(threads), shape, meas, trace).token_ms)

    # CPU only: thread counts
    cpu_rows = []
    for t in sorted(meas.cpu):
        plan = Plan(t)
        predicted = evaluate(plan, shape, meas, trace).token_ms
        measured = measure(model_dir, name, tokens, threads=t)
        cpu_rows.append({"config": {"threads": t}, "predicted_ms": round(predicted, 3),
                         "measured_ms": round(measured, 3)})
    cpu_plan = make_plan(shape, meas, trace).plan

    # Emulated accelerator: ways x policies, at the planner's thread count
    run_ms, copy_ms = emulated_device(shape, DTYPES[name])
    slots = max(1, round(expert_fraction * len(shape.moe_layers) * shape.num_experts))
    emu = Measurements(**{**meas.__dict__, "gpu_expert_ms": run_ms, "copy_expert_ms": copy_ms,
                          "vram_for_experts": slots * shape.expert_bytes, "shared_device": True})
    probe_load = load_model(model_dir, dtype=name, context=256, accelerator="emulated", vram_gb=64, cache_ways=0)
    fixed = probe_load.model.accel.used
    probe_load.model.close()
    def budget(n: int) -> float:
        return budget_for_slots(fixed, n, shape.expert_bytes) / 2**30

    # Calibrate the activation round trip: every expert on the CPU, but through the emulated device.
    no_slots = measure(model_dir, name, tokens, accelerator="emulated", vram_gb=budget(0), strategy=Strategy.CPU,
                       threads=cpu_plan.threads)
    emu.ship_ms = 0.0
    base = evaluate(Plan(cpu_plan.threads, True, Strategy.CPU), shape, emu, trace).token_ms
    emu.ship_ms = max(0.0, no_slots - base) / max(1, len(shape.moe_layers))
    vram_gb = budget(slots)
    emu_rows = []
    ways_options = sorted({w for w in (shape.top_k, 2 * shape.top_k, shape.num_experts) if w <= slots})
    for ways in ways_options:
        indexes = min(len(shape.moe_layers), slots // ways)
        for policy in CachePolicy:
            plan = Plan(cpu_plan.threads, True, Strategy.CPU, indexes, ways, policy)
            ms = measure(model_dir, name, tokens, accelerator="emulated", vram_gb=vram_gb, strategy=Strategy.CPU,
                         cache_ways=ways, cache_policy=policy, threads=cpu_plan.threads)
            emu_rows.append({"config": {"ways": ways, "policy": policy.value},
                             "predicted_ms": round(evaluate(plan, shape, emu, trace).token_ms, 3),
                             "measured_ms": round(ms, 3)})
    emu_choice = min(emu_rows, key=lambda r: r["predicted_ms"])["config"]
    return {
        "model": str(model_dir), "dtype": name, "tokens": tokens, "expert_slots": slots,
        "emulated_device": {"expert_ms": round(run_ms, 3), "copy_ms": round(copy_ms, 3),
                            "ship_ms": round(emu.ship_ms, 4)},
        "cpu_only": _summary(cpu_rows, {"threads": cpu_plan.threads}),
        "emulated": _summary(emu_rows, emu_choice),
    }
