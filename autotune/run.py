"""The whole auto-tune: probe, microbenchmark the model's expert shape, record a short routing trace,
plan, and save the profile. Progress is reported through a callback (the CLI prints it; the TUI shows it)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tandem.autotune.configure import configure
from tandem.autotune.microbench import Step, microbench
from tandem.autotune.plan import ModelShape, Plan, PlanResult, evaluate, make_plan
from tandem.autotune.probe import HardwareInfo, probe
from tandem.autotune.profile import Profile, model_fingerprint, profiles_dir, save_profile
from tandem.runtime.checkpoint import Checkpoint, open_checkpoint
from tandem.runtime.choices import PredictorKind
from tandem.runtime.engine import Engine, GenerationStats
from tandem.runtime.loader import LoadedModel, load
from tandem.runtime.memory import accelerator_bytes
from tandem.runtime.options import (
    DTYPES,
    Dtype,
    Machine,
    Request,
    auto_dtype,
    default_dtype,
    resolve_context,
    takes_int8_blocks,
)
from tandem.runtime.paths import ensure_folder
from tandem.runtime.prefetch import MAX_DEPTH
from tandem.runtime.sampling import SamplingParams
from tandem.runtime.trace import most_popular

CALIBRATION_PROMPT = "Explain, step by step, how a mixture-of-experts language model decides which experts to use."


@dataclass
class Tuned:
    hardware: HardwareInfo
    result: PlanResult
    profile: Profile
    path: Path | None  # where it was saved (None: not saved yet)


def record_trace(model_dir: str | Path, dtype: Dtype, tokens: int = 32, loaded: LoadedModel | None = None,
                 checkpoint: Checkpoint | None = None, recall: dict[str, list[float]] | None = None
                 ) -> tuple[np.ndarray, float, int]:
    """Decode `tokens` tokens CPU-only (default settings): the routing sequence `[steps, layers, top_k]`,
    the measured decode ms per token and the thread count it ran with (to calibrate the simulator).
    `loaded`: this folder already in memory (the chat app's model), decoded with instead of a second copy,
    which might not fit beside it, when it runs CPU-only and unquantized; `checkpoint`: the folder, open.
    `recall`: filled with each expert predictor's recall per MoE layer ahead (`measure_predictors`)."""
    if loaded is None or loaded.model.accel is not None or loaded.model.dispatcher.executor.quant:
        ckpt = checkpoint or open_checkpoint(model_dir)
        request = Request(model=model_dir, dtype=dtype, accelerator="none",
                          context=min(512, ckpt.config.max_position_embeddings))
        configured = configure(request, use_profile=False, checkpoint=ckpt)
        loaded = load(configured.options, ckpt)
    prompt = loaded.tokenizer.encode(CALIBRATION_PROMPT)
    stats = GenerationStats()
    engine = Engine(loaded.model, ())  # no EOS: always the full count
    for _ in engine.generate(prompt, SamplingParams(max_new_tokens=tokens), stats):
        pass
    recorder = loaded.model.dispatcher.recorder
    trace = np.stack(recorder.sequence) if recorder.sequence else np.zeros((0, loaded.model.cfg.num_layers, 1), int)
    ms = 1000.0 / stats.decode_tok_s if stats.decode_tok_s else 0.0
    if recall is not None:
        recall.update(measure_predictors(loaded, prompt, tokens))
    return trace, ms, loaded.model.dispatcher.executor.threads


def measure_predictors(loaded: LoadedModel, prompt: list[int], tokens: int,
                       depth: int = MAX_DEPTH) -> dict[str, list[float]]:
    """Each expert predictor (runtime/prefetch.py) over one answer of `tokens` tokens to `prompt`, through the layer
    loop (the stale gate reads each MoE layer's router input): its recall per MoE layer ahead, 1..depth (fewer where
    the model has fewer MoE layers). The model is left as it was."""
    model = loaded.model
    dispatcher = model.dispatcher
    depth = min(depth, len(dispatcher.moe_layers) - 1)
    if depth < 1:
        return {}
    before = model.use_step, dispatcher.predictor, dispatcher.scorer, dispatcher.prefetching, dispatcher._saved
    out = {}
    try:
        model.use_step = False
        for kind in (PredictorKind.PREVIOUS, PredictorKind.STALE_GATE, PredictorKind.EAM):
            dispatcher.predict(kind, depth)
            for _ in Engine(model, ()).generate(prompt, SamplingParams(max_new_tokens=tokens)):
                pass
            assert dispatcher.scorer is not None
            out[str(kind)] = [round(dispatcher.scorer.accuracy.recall(d), 4) for d in range(1, depth + 1)]
    finally:
        model.use_step, dispatcher.predictor, dispatcher.scorer, dispatcher.prefetching, dispatcher._saved = before
    return out


def autotune(model_dir: str | Path, dtype: str = "auto", quick: bool = False,
             progress: Callable[[Step], None] | None = None, trace: np.ndarray | None = None,
             save: bool = True, hardware: HardwareInfo | None = None, loaded: LoadedModel | None = None) -> Tuned:
    if save:  # the folder the profile goes to must be usable before minutes of measuring, not after
        ensure_folder(profiles_dir())
    hw = hardware or probe()
    ckpt = open_checkpoint(model_dir)
    name = auto_dtype(Machine.here(frozenset(hw.cpu.flags)), ckpt, None) if dtype == "auto" else dtype
    shape = ModelShape.from_checkpoint(ckpt, torch.empty((), dtype=DTYPES[name]).element_size())
    # the CPU experts run in the CPU's dtype where the GPU's is fp16; the GPU's slots are what the runtime leaves
    cpu_name = default_dtype(set(hw.cpu.flags) or None, takes_int8_blocks(ckpt, None)) if name == "fp16" else name
    fixed = accelerator_bytes(ckpt, DTYPES[name], resolve_context(ckpt.config, None)) if hw.gpus else None
    meas = microbench(shape, hw, DTYPES[cpu_name], quick=quick, progress=progress, device_dtype=DTYPES[name],
                      accelerator_fixed=fixed)
    recall: dict[str, list[float]] = {}  # (prefetch needs an accelerator: measured only where there is one)
    recorded, measured_ms, threads = record_trace(model_dir, cpu_name, tokens=16 if quick else 32, loaded=loaded,
                                                  checkpoint=ckpt, recall=recall if meas.has_gpu else None)
    meas.predictor_recall = recall
    if trace is None or len(trace) == 0:
        trace = recorded
    # Calibrate: what one real CPU-only decode took per token beyond what the layer model explains.
    if threads in meas.cpu and len(recorded):
        base = evaluate(Plan(threads), shape, meas, recorded).token_ms
        meas.token_overhead_ms = max(0.0, measured_ms - base)
    if progress:
        progress(Step(f"calibration decode: {measured_ms:.2f} ms/token over a {len(recorded)}-token trace", 1, 1))
    result = make_plan(shape, meas, trace if len(trace) else None)
    plan = result.plan.to_dict()
    if result.plan.static_experts:
        counts = np.zeros((shape.num_layers, shape.num_experts), dtype=np.int64)
        for layer in range(shape.num_layers):
            ids = trace[:, layer].ravel()
            counts[layer] = np.bincount(ids[ids >= 0], minlength=shape.num_experts)
        plan["static"] = [list(k) for k in most_popular(counts, result.plan.static_experts)]
    profile = Profile(hw.fingerprint(), model_fingerprint(ckpt.raw_config, name), meas.to_dict(), plan,
                      {"tok_s": round(result.predicted_tok_s, 2), "hit_rate": round(result.hit_rate, 4),
                       "alternatives": result.alternatives})
    return Tuned(hw, result, profile, save_profile(profile) if save else None)
