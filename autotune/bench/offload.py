"""`tandem bench offload`: every cache policy and static popularity placement on the emulated accelerator holding a
share of the experts, in one run: hit rate and decode speed of each against CPU only; and how well a layer runs its
device and CPU experts side by side (`overlap`)."""

from __future__ import annotations

import os
import statistics
import tempfile
from typing import Any

import torch

from tandem.autotune.bench.prefetch import bench_texts, predictor_accuracy, prefetch_rows
from tandem.runtime.dispatch import Strategy, budget_for_slots
from tandem.runtime.engine import Engine, GenerationStats
from tandem.runtime.expert_cache import CachePolicy
from tandem.runtime.loader import load_model
from tandem.runtime.sampling import SamplingParams
from tandem.runtime.synth import ASSETS
from tandem.runtime.timeline import Timeline, layer_overlap


def bench_offload(
    model_dir: str, expert_fraction: float = 0.25, prompt_tokens: int = 32, new_tokens: int = 64,
    dtype: str = "auto", calibration_tokens: int = 64, prefetch: bool = True, requests: int = 3,
) -> dict[str, Any]:
    """Hit rate of every cache policy and of static popularity placement on one prompt, with the emulated
    accelerator holding `expert_fraction` of all experts; decode speed of each against CPU only."""
    base = load_model(model_dir, dtype=dtype, context=prompt_tokens + max(new_tokens, calibration_tokens) + 8)
    cfg = base.model.cfg
    text = (ASSETS / "tokenizer_corpus.txt").read_text(encoding="utf-8")
    ids = base.tokenizer.encode(text)
    prompt = ids[:prompt_tokens]
    calibration = ids[prompt_tokens : prompt_tokens + calibration_tokens] or prompt  # a different text

    def decode(engine: Engine, tokens: list[int], n: int) -> float:
        stats = GenerationStats()
        for _ in engine.generate(tokens, SamplingParams(max_new_tokens=n), stats):
            pass
        return stats.decode_tok_s

    cpu_engine = Engine(base.model, ())
    with tempfile.TemporaryDirectory() as tmp:
        trace = f"{tmp}/calibration.npz"
        decode(cpu_engine, calibration, new_tokens)
        base.model.dispatcher.recorder.save(trace, model=str(model_dir))
        probe = load_model(model_dir, dtype=dtype, context=base.model.context, accelerator="emulated", vram_gb=1024,
                           cache_ways=0)
        fixed, item = probe.model.accel.used, probe.model.dtype.itemsize
        probe.model.close()
        expert_bytes = 3 * cfg.hidden_size * cfg.moe_intermediate_size * item
        slots = max(1, round(expert_fraction * cfg.num_moe_layers * cfg.num_experts))
        def budget(n: int) -> float:
            return budget_for_slots(fixed, n, expert_bytes) / 1024**3

        setups: dict[str, tuple[dict[str, Any], str | None, int]] = {  # (settings, placement trace, slots)
            p.value: ({"strategy": Strategy.CPU, "cache_policy": p}, None, slots) for p in CachePolicy
        }
        setups["static-popular"] = ({"strategy": Strategy.CPU}, trace, slots)
        # every expert on the CPU, but through the accelerator tier: the cost of the orchestration itself
        setups["no-slots"] = ({"strategy": Strategy.CPU}, None, 0)
        rows = []
        cpu_rates = []
        for name, (settings, placement, n_slots) in setups.items():
            loaded = load_model(model_dir, dtype=dtype, context=base.model.context, accelerator="emulated",
                                vram_gb=budget(n_slots), placement=placement, **settings)
            rate = decode(Engine(loaded.model, ()), prompt, new_tokens)
            cpu_rates.append(decode(cpu_engine, prompt, new_tokens))  # alternate with the CPU-only run
            stats = loaded.model.dispatcher.request_stats()
            plan = loaded.model.dispatcher.describe()
            loaded.model.close()
            rows.append({"setup": name, "hit_rate": round(stats.hit_rate, 4), "decode_tok_s": round(rate, 2),
                         "cache": plan["cache"], "static_experts": plan["static_experts"],
                         "bytes_h2d": stats.bytes_h2d, "bytes_d2h": stats.bytes_d2h})
        overlap = layer_overlap_run(model_dir, dtype, base.model.context, budget(slots), prompt, new_tokens)
    cpu_rate = statistics.median(cpu_rates)
    extra: dict[str, Any] = {}
    if prefetch:  # the best cache policy here, then with each predictor's prefetch; the predictors' accuracy
        best = max((r for r in rows if r["setup"] in set(CachePolicy)), key=lambda r: r["decode_tok_s"])
        prompts = bench_texts(base.tokenizer, requests, prompt_tokens)
        extra["prefetch"] = prefetch_rows(model_dir, dtype, base.model.context, budget(slots), prompts, new_tokens,
                                          CachePolicy(best["setup"]))
        extra["accuracy"] = predictor_accuracy(model_dir, dtype, requests=max(requests, 4),
                                               prompt_tokens=prompt_tokens, new_tokens=new_tokens)
    for row in rows:
        row["speed_vs_cpu_only"] = round(row["decode_tok_s"] / cpu_rate, 3)
    return {
        "model": str(model_dir), "family": cfg.model_type, "dtype": str(base.model.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(), "expert_slots": slots,
        "experts_total": cfg.num_moe_layers * cfg.num_experts, "prompt_tokens": len(prompt),
        "new_tokens": new_tokens, "cpu_only_decode_tok_s": round(cpu_rate, 2), "rows": rows, "overlap": overlap,
        **extra,
    }


def layer_overlap_run(model_dir: str, dtype: str, context: int, vram_gb: float, prompt: list[int],
                      new_tokens: int) -> dict[str, Any]:
    """A prompt and its answer with the device's share of the experts in LRU slots and misses on the CPU, each MoE
    layer's device and CPU expert runs recorded: a layer's seconds against the longer of the two (1.0: fully side by
    side; their sum over the longer: one after the other). The emulated device's stream is a host thread: the CPU
    experts get the other cores (one fewer thread), as a GPU would leave them all."""
    threads = max(1, len(os.sched_getaffinity(0)) - 1)
    loaded = load_model(model_dir, dtype=dtype, context=context, accelerator="emulated", vram_gb=vram_gb,
                        strategy=Strategy.CPU, cache_policy=CachePolicy.LRU, threads=threads)
    dispatcher = loaded.model.dispatcher
    engine = Engine(loaded.model, ())
    try:
        for _ in engine.generate(prompt, SamplingParams(max_new_tokens=4)):  # warm up: kernels, first fills
            pass
        dispatcher.timeline = timeline = Timeline()
        for _ in engine.generate(prompt, SamplingParams(max_new_tokens=new_tokens)):
            pass
    finally:
        dispatcher.timeline = None
        loaded.model.close()
    return {"cpu_threads": threads, **layer_overlap(timeline)}
