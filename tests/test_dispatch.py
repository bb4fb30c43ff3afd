"""CPU/accelerator orchestration on the emulated accelerator gives the CPU-only results, for every strategy,
cache policy, geometry and placement; statistics add up; the budget is never exceeded."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.runtime.accelerator import EmulatedAccelerator
from tandem.runtime.checkpoint import open_checkpoint
from tandem.runtime.choices import PredictorKind
from tandem.runtime.dispatch import OffloadOptions, Strategy, budget_for_slots
from tandem.runtime.engine import Engine, GenerationStats
from tandem.runtime.expert_cache import CachePolicy
from tandem.runtime.latency import LatencyModel
from tandem.runtime.model import ModelRun, MoEModel
from tandem.runtime.prefetch import PrefetchOptions
from tandem.runtime.sampling import SamplingParams
from tandem.runtime.synth import tiny_config, write_test_model
from tandem.runtime.trace import load_popularity, most_popular

FAMILIES = {
    "mixtral": tiny_config("mixtral", num_hidden_layers=3),
    "qwen2_moe": tiny_config("qwen2_moe", num_hidden_layers=3, decoder_sparse_step=1, mlp_only_layers=[1]),
    "qwen3_moe": tiny_config("qwen3_moe", num_hidden_layers=3),
    "olmoe": tiny_config("olmoe", num_hidden_layers=3),
    "phimoe": tiny_config("phimoe", num_hidden_layers=3),  # sparsemixer routing, LayerNorm, biases
    "deepseek_v2": tiny_config("deepseek_v2", num_hidden_layers=3),
    "deepseek_v3": tiny_config("deepseek_v3", num_hidden_layers=3),
    "glm4_moe": tiny_config("glm4_moe", num_hidden_layers=3, n_group=4, topk_group=2, norm_topk_prob=False,
                            routed_scaling_factor=2.5, use_qk_norm=True),
    # torch-path experts with biases (moe.ClampedSwiGLUExpert): their accelerator slots hold the biases too
    "gpt_oss": tiny_config("gpt_oss", num_hidden_layers=3, swiglu_limit=0.3),
    # MXFP4 experts (moe.MXFP4Expert): 4-bit slots on the accelerator, dequantized on use; the C kernels on the CPU
    "gpt_oss-mxfp4": tiny_config("gpt_oss", num_hidden_layers=3, swiglu_limit=0.3, intermediate_size=64,
                                 quantization_config={"quant_method": "mxfp4"}),
    # one expert a token taking its input scaled by the router, a shared expert taking the token itself; experts
    # stored as x @ W (transposed views in the slots' copies)
    "llama4_text": tiny_config("llama4_text", num_hidden_layers=3, interleave_moe_layer_step=1),
    # GeGLU experts (the kernels' and the slots' tanh GELU), routed by norms of their own beside a dense MLP; global
    # layers of another head size (a KV cache of two shapes on the device)
    "gemma4_text": tiny_config("gemma4_text", num_hidden_layers=3,
                               layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
}
NEW_TOKENS = 8
ALWAYS_FETCH = LatencyModel(cpu_a_ms=100, cpu_b_ms=100, gpu_ms=0, transfer_ms=0)
MULTI_TOKEN_FETCH = LatencyModel(cpu_a_ms=0, cpu_b_ms=1, gpu_ms=0, transfer_ms=1.5)  # fetch when s >= 2


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dispatch")
    return {name: write_test_model(root / name, cfg, seed=3) for name, cfg in FAMILIES.items()}


def build(folder: Path, accel: EmulatedAccelerator | None = None, policy: OffloadOptions | None = None,
          batch: int = 1) -> Engine:
    ckpt = open_checkpoint(folder)
    model = MoEModel.from_checkpoint(ckpt, ModelRun(torch.float32, 128, batch), accel, policy)
    return Engine(model, ())


def expert_bytes(folder: Path) -> int:
    """One accelerator slot in float32: the three matrices (MXFP4: 4-bit codes and a scale byte per 32), plus the
    biases where the experts have them (gpt-oss)."""
    cfg = open_checkpoint(folder).config
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    biases = (2 * i + h) * 4 if cfg.clamped_swiglu else 0
    return (3 * h * i // 2 + 3 * h * i // 32 if cfg.experts_mxfp4 else 3 * h * i * 4) + biases


def budget_for(folder: Path, slots: int, batch: int = 1) -> int:
    """Bytes of emulated device memory that leave room for exactly `slots` expert slots."""
    probe = EmulatedAccelerator(1 << 30)
    engine = build(folder, probe, OffloadOptions(cache_ways=1), batch)
    fixed = probe.used - len(engine.model.dispatcher.slot_buffers) * expert_bytes(folder)
    engine.model.close()
    return int(budget_for_slots(fixed, slots, expert_bytes(folder)))


@pytest.mark.parametrize("slots", [0, 1, 7, 24])
def test_the_budget_for_n_slots_makes_n_slots(checkpoints, slots: int) -> None:
    folder = checkpoints["mixtral"]  # 3 MoE layers of 8 experts: 24 slots at most
    every = tuple((layer, e) for layer in range(3) for e in range(8))
    engine = build(folder, EmulatedAccelerator(budget_for(folder, slots)), OffloadOptions(static=every))
    assert len(engine.model.dispatcher.static) == slots  # static placement takes every slot there is
    engine.model.close()


_reference: dict[tuple[str, int], tuple[torch.Tensor, list[int], int]] = {}


def reference(folder: Path, prompt: list[int]) -> tuple[torch.Tensor, list[int], int]:
    """CPU-only prefill logits, greedy tokens and expert executions (memoised)."""
    key = (str(folder), len(prompt))
    if key not in _reference:
        engine = build(folder)
        logits = engine.model.forward(torch.tensor([prompt]), 0)
        tokens = list(engine.generate(prompt, SamplingParams(max_new_tokens=NEW_TOKENS)))
        stats = engine.model.dispatcher.request_stats()
        _reference[key] = (logits, tokens, int(stats.per_layer.sum()))
    return _reference[key]


def prompt_of(length: int) -> list[int]:
    return torch.randint(3, 500, (length,), generator=torch.Generator().manual_seed(length)).tolist()


@settings(max_examples=48, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    family=st.sampled_from(sorted(FAMILIES)),
    strategy=st.sampled_from(list(Strategy)),
    policy=st.sampled_from(list(CachePolicy)),
    ways=st.sampled_from([None, 1, 2, 3]),
    slots=st.integers(0, 20),  # up to 20 of the 16-24 experts; below 8 is smaller than one layer
    placement=st.booleans(),
    cost=st.sampled_from([None, ALWAYS_FETCH, MULTI_TOKEN_FETCH]),
    prompt_len=st.sampled_from([1, 5, 70]),
    copy_delay=st.sampled_from([0.0, 0.003]),
    inflight=st.sampled_from([1, 4]),
    prefetch=st.sampled_from([PrefetchOptions(), PrefetchOptions(PredictorKind.PREVIOUS, 1),
                              PrefetchOptions(PredictorKind.STALE_GATE, 2), PrefetchOptions(PredictorKind.EAM, 3)]),
)
def test_matches_cpu_only(checkpoints, tmp_path_factory, family, strategy, policy, ways, slots, placement, cost,
                          prompt_len, copy_delay, inflight, prefetch) -> None:
    folder = checkpoints[family]
    prompt = prompt_of(prompt_len)
    ref_logits, ref_tokens, ref_executions = reference(folder, prompt)
    static: tuple[tuple[int, int], ...] = ()
    if placement:
        trace = tmp_path_factory.mktemp("trace") / "t.npz"
        recorder = build(folder)
        list(recorder.generate(prompt, SamplingParams(max_new_tokens=4)))
        recorder.model.dispatcher.recorder.save(trace, model=family)
        cfg = recorder.model.cfg
        static = tuple(most_popular(load_popularity(trace, cfg.num_layers, cfg.num_experts), 100))
    accel = EmulatedAccelerator(budget_for(folder, slots), copy_delay_s=copy_delay)
    engine = build(folder, accel, OffloadOptions(strategy, ways, policy, static, inflight, cost, prefetch))
    model_cost = engine.model.dispatcher.cost
    try:
        logits = engine.model.forward(torch.tensor([prompt]), 0)
        assert (logits - ref_logits).abs().max().item() <= 1e-4
        tokens = list(engine.generate(prompt, SamplingParams(max_new_tokens=NEW_TOKENS)))
        stats = engine.model.dispatcher.request_stats()
    finally:
        engine.model.close()
    assert tokens == ref_tokens
    gpu, cpu, fetched = stats.per_layer.sum(0)
    assert gpu + cpu + fetched == ref_executions == stats.hits + stats.misses
    assert gpu == stats.hits
    assert accel.used <= accel.budget
    if strategy is Strategy.CPU:
        assert fetched == 0
    if strategy is Strategy.FETCH or cost is ALWAYS_FETCH and strategy is Strategy.FIDDLER:
        assert cpu == 0
    if engine.model.dispatcher.cache.slots == 0 and not engine.model.dispatcher.static:
        assert gpu == 0  # nothing is ever resident
    if not static and engine.model.dispatcher.static:
        assert cpu == fetched == 0  # every expert fitted, so each was placed at load and none ever missed
    if strategy is Strategy.FIDDLER and not model_cost.prefer_fetch(prompt_len):
        assert fetched == 0  # no expert saw enough tokens for a copy to pay off


def test_cache_smaller_than_one_layer_still_hits(checkpoints) -> None:
    folder = checkpoints["mixtral"]
    prompt = prompt_of(5)
    accel = EmulatedAccelerator(budget_for(folder, 3))  # 3 slots < 8 experts of one layer
    engine = build(folder, accel, OffloadOptions(Strategy.CPU))
    cache = engine.model.dispatcher.cache
    assert cache.slots == 3
    tokens = list(engine.generate(prompt, SamplingParams(max_new_tokens=24)))
    stats = engine.model.dispatcher.request_stats()
    engine.model.close()
    assert tokens[:NEW_TOKENS] == reference(folder, prompt)[1]
    assert stats.hits > 0 and cache.stats.fills > 0
    assert stats.bytes_h2d >= cache.stats.fills * expert_bytes(folder)


def test_uncovered_layers_run_on_the_cpu(checkpoints) -> None:
    folder = checkpoints["olmoe"]
    accel = EmulatedAccelerator(budget_for(folder, 8))
    engine = build(folder, accel, OffloadOptions(Strategy.CPU, cache_ways=8))
    assert engine.model.dispatcher.cache.layers == [0]  # 8 slots, 8 ways: one index, layer 0
    list(engine.generate(prompt_of(5), SamplingParams(max_new_tokens=6)))
    stats = engine.model.dispatcher.request_stats()
    engine.model.close()
    assert stats.per_layer[1:, 0].sum() == 0 and stats.per_layer[1:, 1].sum() > 0


def test_beam_search_multi_token_experts_take_the_fetch_path(checkpoints) -> None:
    folder = checkpoints["mixtral"]
    prompt = [42]  # one prompt token: every expert sees one token until the beams batch up
    params = SamplingParams(max_new_tokens=6, beams=4)
    cpu_only = list(build(folder, batch=4).generate(prompt, params))

    greedy = build(folder, EmulatedAccelerator(budget_for(folder, 0)), OffloadOptions(cost=MULTI_TOKEN_FETCH))
    list(greedy.generate(prompt, SamplingParams(max_new_tokens=6)))
    assert greedy.model.dispatcher.request_stats().per_layer[:, 2].sum() == 0  # s = 1: CPU is cheaper
    greedy.model.close()

    beam = build(folder, EmulatedAccelerator(budget_for(folder, 0, 4)), OffloadOptions(cost=MULTI_TOKEN_FETCH), batch=4)
    stats = GenerationStats()
    tokens = list(beam.generate(prompt, params, stats))
    fetched = beam.model.dispatcher.request_stats().per_layer[:, 2].sum()
    beam.model.close()
    assert tokens == cpu_only and len(tokens) > 0
    assert fetched > 0


def test_beam_search_needs_the_batch(checkpoints) -> None:
    from tandem.kernels.errors import GenerationError

    with pytest.raises(GenerationError, match="beams"):
        build(checkpoints["mixtral"]).generate([1, 2], SamplingParams(beams=3))


def test_trace_matrices_and_sequence(checkpoints, tmp_path: Path) -> None:
    folder = checkpoints["qwen2_moe"]  # layer 1 is dense
    engine = build(folder)
    prompt = prompt_of(7)
    tokens = list(engine.generate(prompt, SamplingParams(max_new_tokens=5)))
    engine.model.dispatcher.recorder.save(tmp_path / "t.npz", model="q")
    data = np.load(tmp_path / "t.npz")
    k = engine.model.cfg.top_k
    assert data["prefill"][0].sum() == len(prompt) * k and data["prefill"][1].sum() == 0
    assert data["decode"][0].sum() == (len(tokens) - 1) * k
    assert data["sequence"].shape == (len(tokens) - 1, 3, k)
    assert (data["sequence"][:, 1] == -1).all() and (data["sequence"][:, 0] >= 0).all()


def test_static_placement_pins_the_most_popular(checkpoints, tmp_path: Path) -> None:
    counts = np.zeros((3, 8), dtype=np.int64)
    counts[0, 5], counts[2, 1], counts[1, 7] = 9, 7, 3
    assert most_popular(counts, 2) == [(0, 5), (2, 1)]
    folder = checkpoints["mixtral"]
    accel = EmulatedAccelerator(budget_for(folder, 2))
    engine = build(folder, accel, OffloadOptions(static=((0, 5), (2, 1), (1, 7))))
    assert set(engine.model.dispatcher.static) == {(0, 5), (2, 1)}
    assert engine.model.dispatcher.cache.slots == 0
    engine.model.close()


@pytest.mark.parametrize("strategy", list(Strategy))
@pytest.mark.parametrize("family", ["gpt_oss", "gpt_oss-mxfp4"])
def test_gpt_oss_experts_agree_on_every_path(checkpoints, strategy: Strategy, family: str) -> None:
    """gpt-oss's experts (with biases; bf16 ones in torch, MXFP4 ones on the C kernels): static, cached, fetched
    (slots holding the biases too; MXFP4 slots 4-bit, dequantized on use) and CPU-served give the CPU-only logits
    and tokens."""
    folder = checkpoints[family]
    prompt = prompt_of(5)
    ref_logits, ref_tokens, _ = reference(folder, prompt)
    policy = OffloadOptions(strategy, cache_ways=2, static=((0, 1), (2, 3)), cost=MULTI_TOKEN_FETCH)
    engine = build(folder, EmulatedAccelerator(budget_for(folder, 6)), policy)
    slot = engine.model.dispatcher.scratch
    assert slot.gate.dtype == (torch.uint8 if family.endswith("mxfp4") else torch.float32)
    assert sum(t.numel() * t.element_size() for t in slot.tensors()) == expert_bytes(folder)
    try:
        assert (engine.model.forward(torch.tensor([prompt]), 0) - ref_logits).abs().max().item() <= 1e-4
        tokens = list(engine.generate(prompt, SamplingParams(max_new_tokens=NEW_TOKENS)))
        gpu, cpu, fetched = engine.model.dispatcher.request_stats().per_layer.sum(0)
    finally:
        engine.model.close()
    assert tokens == ref_tokens
    if strategy is Strategy.FETCH:
        assert cpu == 0 and fetched > 0
    if strategy is Strategy.CPU:
        assert fetched == 0 and cpu > 0


@pytest.mark.parametrize("strategy", list(Strategy))
def test_decode_reads_to_the_host_once_per_moe_layer(checkpoints, strategy: Strategy) -> None:
    """After the router, one host read of the routing and activations; the emulated device then joins its expert
    stream once (CUDA orders its streams on the device instead: not a host synchronisation there). Plus one read of
    the logits a step."""
    folder = checkpoints["mixtral"]  # 3 MoE layers
    accel = EmulatedAccelerator(budget_for(folder, 6))
    engine = build(folder, accel, OffloadOptions(strategy, cache_ways=2, cost=MULTI_TOKEN_FETCH))
    steps = engine.generate(prompt_of(5), SamplingParams(max_new_tokens=13))
    next(steps)  # the prefill
    before, joined = accel.syncs - accel.joins, accel.joins
    decoded = len(list(steps))
    per_step = (accel.syncs - accel.joins - before) / decoded
    joins = (accel.joins - joined) / decoded
    gpu, cpu, fetched = engine.model.dispatcher.request_stats().per_layer.sum(0)
    engine.model.close()
    assert decoded == 12 and per_step <= 3 + 1 and joins <= 3
    assert gpu > 0 and (cpu > 0 or strategy is Strategy.FETCH)  # both tiers ran (or fetched: no CPU expert)


def test_a_layer_takes_the_longer_of_its_device_and_cpu_work_not_their_sum(checkpoints, monkeypatch) -> None:
    """GPU work d and CPU work c in one MoE layer (sleeps standing in for them): they run at the same time."""
    from tandem.runtime.dispatch import Dispatcher

    folder = checkpoints["mixtral"]
    engine = build(folder, EmulatedAccelerator(budget_for(folder, 6)), OffloadOptions(Strategy.CPU, cache_ways=2))
    dispatcher = engine.model.dispatcher
    list(engine.generate(prompt_of(5), SamplingParams(max_new_tokens=8)))  # some experts cached
    delay = 0.25
    spans: dict[str, list[float]] = {}

    def timed(name: str, fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            threading.Event().wait(delay)
            out = fn(*args, **kwargs)
            spans.setdefault(name, [start, 0.0])[1] = time.perf_counter()
            return out
        return run

    for work in ("_device_expert", "_device_group", "_device_chosen"):  # the device's expert work, however it runs
        monkeypatch.setattr(Dispatcher, work, staticmethod(timed("device", getattr(Dispatcher, work))))
    monkeypatch.setattr(dispatcher.executor, "run_many", timed("cpu", dispatcher.executor.run_many))
    measured = []
    generator = torch.Generator().manual_seed(0)
    for _ in range(30):  # layers whose routing needs exactly one cached expert and the CPU for the other
        spans.clear()
        h = torch.randn(1, engine.model.cfg.hidden_size, generator=generator)
        with torch.inference_mode():
            start = time.perf_counter()
            dispatcher(0, h)
            took = time.perf_counter() - start
        if "cpu" in spans and "device" in spans and spans["device"][1] - spans["device"][0] < 1.5 * delay:
            measured.append((took, spans["cpu"], spans["device"]))
    engine.model.close()
    assert measured, "no layer ran experts on both tiers"
    for took, cpu, device in measured:
        assert cpu[0] < device[1] and device[0] < cpu[1]  # their spans overlap
        assert took < 1.75 * delay  # about max(c, d) = 1 delay; c + d would be 2


def test_the_timeline_records_each_layers_device_and_cpu_experts(checkpoints, monkeypatch) -> None:
    """`bench offload`'s overlap figure: the dispatcher's spans, each layer's device and CPU experts inside its own
    call (sleeps standing in for the work, so the figure is known: the longer is one delay, their sum two)."""
    from tandem.runtime.dispatch import Dispatcher
    from tandem.runtime.timeline import Timeline, layer_overlap

    folder = checkpoints["mixtral"]
    engine = build(folder, EmulatedAccelerator(budget_for(folder, 6)), OffloadOptions(Strategy.CPU, cache_ways=2))
    dispatcher = engine.model.dispatcher
    list(engine.generate(prompt_of(5), SamplingParams(max_new_tokens=8)))  # some experts cached
    delay = 0.1

    def slowed(fn):
        def run(*args, **kwargs):
            threading.Event().wait(delay)
            return fn(*args, **kwargs)
        return run

    for work in ("_device_expert", "_device_group", "_device_chosen"):
        monkeypatch.setattr(Dispatcher, work, staticmethod(slowed(getattr(Dispatcher, work))))
    monkeypatch.setattr(dispatcher.executor, "run_many", slowed(dispatcher.executor.run_many))
    dispatcher.timeline = timeline = Timeline()
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for _ in range(20):
            dispatcher(0, torch.randn(1, engine.model.cfg.hidden_size, generator=generator))
    engine.model.close()
    got = layer_overlap(timeline)
    assert len(timeline.spans["moe"]) == 20 and got["layers"] >= 1, got
    assert got["longer_s"] >= delay * got["layers"]
    assert got["one_after_the_other_s"] >= 2 * delay * got["layers"]
    assert got["layer_s"] >= got["longer_s"] and got["layer_over_longer"] >= 1.0
    assert timeline.overlap("experts", "cpu_experts") > 0  # side by side (one after the other would share nothing)


def _options(folder: Path, vram_gb: float, accelerator_from: str, batch: int = 1):
    from dataclasses import replace

    from tandem.autotune.configure import configure
    from tandem.runtime.options import Request

    options = configure(Request(model=folder, dtype="fp32", accelerator="emulated", vram_gb=vram_gb, batch=batch),
                        use_profile=False).options
    sources = tuple((n, accelerator_from if n == "accelerator" else s) for n, s in options.sources)
    cpu_only = None  # as resolve gives it when the machine chose the accelerator
    if accelerator_from == "machine":
        cpu_only = configure(Request(model=folder, dtype="fp32", accelerator="none", batch=batch),
                             use_profile=False).options
    return replace(options, sources=sources, cpu_only=cpu_only)


def test_an_accelerator_nobody_asked_for_that_cannot_hold_the_model_leaves_it_on_the_cpu(checkpoints) -> None:
    from tandem.kernels.errors import ResourceError
    from tandem.runtime.loader import load

    folder = checkpoints["mixtral"]
    notices: list[str] = []
    loaded = load(_options(folder, 1e-5, "machine"), notify=notices.append)  # 10 KiB: not even the embeddings
    assert loaded.model.accel is None and loaded.options.accelerator == "none"
    assert len(notices) == 1 and "accelerator memory" in notices[0] and "CPU only" in notices[0]
    assert list(loaded.engine.generate([5, 6, 7], SamplingParams(max_new_tokens=4)))
    loaded.model.close()
    with pytest.raises(ResourceError, match="accelerator memory"):  # asked for by name: an error, not a surprise
        load(_options(folder, 1e-5, "given"))


def test_the_activations_of_the_longest_prefill_pass_are_kept_back(checkpoints) -> None:
    from tandem.runtime.attention import KVCache
    from tandem.runtime.model import PREFILL_CHUNK, activation_bytes

    folder = checkpoints["mixtral"]
    accel = EmulatedAccelerator(1 << 30)
    engine = build(folder, accel, OffloadOptions(cache_ways=0))  # no slots: what is used is the model's own
    model = engine.model
    cfg = model.cfg
    assert model.prefill_chunk == min(PREFILL_CHUNK, 128)
    activations = activation_bytes(cfg, model.prefill_chunk, 128, 1, torch.float32)
    assert activations > cfg.num_heads * model.prefill_chunk * 128 * 4  # the attention scores at least
    kv = KVCache.nbytes(cfg, 1, 128, torch.float32)
    assert accel.used >= activations + kv
    engine.model.close()


def test_a_prompt_in_several_passes_gives_the_same_answer(checkpoints) -> None:
    folder = checkpoints["qwen3_moe"]
    prompt = prompt_of(70)
    _, ref_tokens, _ = reference(folder, prompt)
    engine = build(folder, EmulatedAccelerator(budget_for(folder, 6)), OffloadOptions(Strategy.CPU, cache_ways=2))
    engine.model.prefill_chunk = 16  # 70 tokens in 5 passes
    calls: list[tuple[int, int]] = []
    forward = engine.model.forward

    def counted(ids: torch.Tensor, start: int, *args, **kwargs) -> torch.Tensor:
        calls.append((start, ids.shape[1]))
        return forward(ids, start, *args, **kwargs)

    engine.model.forward = counted
    tokens = list(engine.generate(prompt, SamplingParams(max_new_tokens=NEW_TOKENS)))
    engine.model.close()
    assert calls[:5] == [(0, 16), (16, 16), (32, 16), (48, 16), (64, 6)]
    assert tokens == ref_tokens


def test_beam_rows_share_the_kv_cache_the_model_was_loaded_with(checkpoints) -> None:
    from tandem.kernels.errors import ResourceError

    folder = checkpoints["mixtral"]
    accel = EmulatedAccelerator(budget_for(folder, 4, batch=4))
    engine = build(folder, accel, OffloadOptions(Strategy.CPU), batch=4)
    used = accel.used
    wide = engine.model.with_batch(4)
    assert wide.cache is engine.model.cache and accel.used == used  # no second cache
    with pytest.raises(ResourceError, match="the KV cache"):  # more rows than loaded for: beyond the budget
        engine.model.with_batch(64)
    engine.model.close()


def test_an_fp16_device_with_its_cpu_experts_in_the_cpus_dtype(checkpoints) -> None:
    """An fp16 GPU (before Ampere): dense layers and slots in fp16, the CPU experts in fp32 (the CPU computes no
    fp16), their activations converted at the boundary. Close to the fp32 model."""
    folder = checkpoints["qwen3_moe"]
    prompt = prompt_of(5)
    ref_logits, _, _ = reference(folder, prompt)
    accel = EmulatedAccelerator(budget_for(folder, 6))
    model = MoEModel.from_checkpoint(open_checkpoint(folder), ModelRun(torch.float16, 128, 1, cpu_dtype=torch.float32),
                                     accel, OffloadOptions(Strategy.CPU, cache_ways=2))
    try:
        assert model.dispatcher.executor.dtype == torch.float32 and model.dispatcher.scratch.gate.dtype == torch.float16
        logits = model.forward(torch.tensor([prompt]), 0)
        list(Engine(model, ()).generate(prompt, SamplingParams(max_new_tokens=6)))
        gpu, cpu, _ = model.dispatcher.request_stats().per_layer.sum(0)
    finally:
        model.close()
    assert logits.dtype == torch.float32 and (logits - ref_logits).abs().max().item() < 0.05
    assert gpu > 0 and cpu > 0


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "deepseek_v2", "gpt_oss"])
def test_what_the_planner_counts_beside_the_slots_is_what_a_model_takes(checkpoints, family: str) -> None:
    """memory.accelerator_bytes, from which autotune gives the planner its slot budget, against what a load places:
    every non-expert weight, KV cache, RoPE tables and the activation reserve (within a few small float32 tensors:
    the correction biases; the long RoPE tables)."""
    from tandem.runtime.memory import accelerator_bytes

    folder = checkpoints[family]
    accel = EmulatedAccelerator(1 << 30)
    engine = build(folder, accel, OffloadOptions(cache_ways=0))  # no slots: only the scratch expert beside
    scratch = sum(t.numel() * t.element_size() for t in engine.model.dispatcher.scratch.tensors())
    engine.model.close()
    estimate = accelerator_bytes(open_checkpoint(folder), torch.float32, 128)
    assert abs(accel.used - scratch - estimate) <= 0.01 * estimate


def test_the_slot_budget_autotune_measures_is_the_one_a_load_gets(checkpoints) -> None:
    """autotune's accelerator measurements, through the runtime's own copy and stream paths on the emulated
    device, give the planner the slot bytes a load of the same model on the same budget makes its slots of."""
    from tandem.autotune.microbench import accelerator_measurements
    from tandem.autotune.plan import ModelShape
    from tandem.runtime.memory import accelerator_bytes

    folder = checkpoints["mixtral"]
    ckpt = open_checkpoint(folder)
    budget = budget_for(folder, 7)
    accel = EmulatedAccelerator(budget)
    measured = accelerator_measurements(accel, ModelShape.from_config(ckpt.config, 4), torch.float32,
                                        accelerator_bytes(ckpt, torch.float32, 128), min_time=0.01)
    accel.close()
    assert measured["gpu_expert_ms"] > 0 and measured["copy_expert_ms"] > 0 and measured["h2d_gbps"] > 0
    every = tuple((layer, e) for layer in range(3) for e in range(8))
    engine = build(folder, EmulatedAccelerator(budget), OffloadOptions(static=every))  # static takes every slot
    slots = len(engine.model.dispatcher.slot_buffers)
    engine.model.close()
    assert slots == 7 and measured["vram_for_experts"] // expert_bytes(folder) == slots


def test_slots_hold_the_weights_the_cpu_computes_with_under_quant(checkpoints) -> None:
    """--quant int8: an expert copied to the accelerator holds the CPU's quantized weights (dequantized), so where
    it runs does not change the answer beyond rounding."""
    from tandem.kernels.experts import CpuOptions

    folder = checkpoints["qwen3_moe"]
    prompt = prompt_of(5)
    cpu_only = MoEModel.from_checkpoint(open_checkpoint(folder), ModelRun(torch.float32, 128, 1),
                                        cpu=CpuOptions(quant="int8"))
    ref = cpu_only.forward(torch.tensor([prompt]), 0)
    cpu_only.close()
    accel = EmulatedAccelerator(budget_for(folder, 6))
    model = MoEModel.from_checkpoint(open_checkpoint(folder), ModelRun(torch.float32, 128, 1), accel,
                                     OffloadOptions(Strategy.FETCH, cache_ways=2), CpuOptions(quant="int8"))
    try:
        logits = model.forward(torch.tensor([prompt]), 0)
        dispatcher = model.dispatcher
        (layer, e), slot = next((s.key, dispatcher.slot_buffers[s.id]) for ways in dispatcher.cache.sets
                                for s in ways if s.key is not None)
        dispatcher.cache.wait_all()
        expected = dispatcher.cpu_experts[layer][e].dense(torch.float32)
        assert all(torch.equal(a, b) for a, b in zip(slot.tensors(), expected, strict=True))
        assert not torch.equal(slot.gate, model.dispatcher.blocks[layer].experts[e].gate.float())
    finally:
        model.close()
    assert (logits - ref).abs().max().item() < 1e-2


def test_the_device_running_out_of_memory_mid_answer_is_a_resource_error(checkpoints, monkeypatch) -> None:
    from tandem.kernels.errors import ResourceError
    from tandem.runtime.dispatch import Dispatcher

    folder = checkpoints["mixtral"]
    engine = build(folder, EmulatedAccelerator(budget_for(folder, 6)), OffloadOptions(Strategy.CPU, cache_ways=2))

    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")

    monkeypatch.setattr(Dispatcher, "_launch_device", no_memory)
    with pytest.raises(ResourceError, match="ran out of memory during a 5-token pass"):
        list(engine.generate(prompt_of(5), SamplingParams(max_new_tokens=2)))
    engine.model.close()


def test_cpu_experts_outputs_are_summed_into_their_tokens_even_a_token_that_chose_one_twice() -> None:
    """`_cpu_combine` adds each CPU expert's weighted rows into its tokens' rows: several experts into one token,
    and, where a router left only -inf logits and a token took the same expert in both its slots, both shares."""
    from types import SimpleNamespace

    from tandem.runtime.dispatch import Dispatcher, _Job

    T, H = 4, 8
    x = torch.randn(T, H)
    weights = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5], [0.9, 0.1]])  # [T, K]
    ids = torch.tensor([[0, 1], [1, 0], [2, 2], [0, 1]])  # token 2 chose expert 2 in both slots
    scale = {0: 1.0, 1: 2.0, 2: -3.0}  # expert e's output: scale[e] * x

    def run_many(jobs, sink):  # noqa: ANN001, ANN202
        for k, (e, xs) in enumerate(jobs):
            sink(k, scale[e] * xs)

    fake = SimpleNamespace(executor=SimpleNamespace(run_many=run_many))
    jobs = []
    for e in (0, 1, 2):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        jobs.append(_Job(e, tok, slot, None, 0, e))  # the "CPU expert" is its id, which run_many scales by
    got = Dispatcher._cpu_combine(fake, x, weights, jobs)  # type: ignore[arg-type]
    want = torch.zeros(T, H)
    for t in range(T):
        for k in range(2):
            want[t] += weights[t, k] * scale[int(ids[t, k])] * x[t]
    assert torch.allclose(got, want, atol=1e-6)
