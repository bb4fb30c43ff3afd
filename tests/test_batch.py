"""Continuous batching (runtime/batch.py): every batched answer is the one the request gets alone, whatever joins or
leaves beside it; per-request settings; refusals that leave the rest running."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.runtime.batch import BatchEngine, BatchRequest, BatchResult, DoneEvent, TokenEvent
from tandem.runtime.engine import Engine, GenerationStats
from tandem.runtime.loader import LoadedModel, load_model
from tandem.runtime.model import Segment
from tandem.runtime.sampling import SamplingParams


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """n prompts of different lengths (3 to 17 tokens)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (3 + (5 * i) % 15,), generator=gen).tolist() for i in range(n)]


def alone(engine: Engine, request: BatchRequest) -> tuple[list[int], str]:
    stats = GenerationStats()
    tokens = list(engine.generate(request.prompt, request.params, stats))
    return tokens, stats.finish_reason


def run_batch(loaded: LoadedModel, requests: list[BatchRequest], max_batch: int, step_tokens: int
              ) -> tuple[dict[str, BatchResult], dict[str, list[int]]]:
    """Each request's result, and the tokens its TokenEvents carried."""
    batch = BatchEngine(loaded.model, loaded.engine.eos_ids, max_batch, step_tokens)
    results: dict[str, BatchResult] = {}
    streamed: dict[str, list[int]] = {r.key: [] for r in requests}
    for event in batch.run(requests):
        if isinstance(event, TokenEvent):
            streamed[event.key].append(event.token)
        else:
            assert isinstance(event, DoneEvent) and event.result.key not in results
            results[event.result.key] = event.result
    return results, streamed


# attention variants: plain GQA, clipped q/k/v, sliding windows, Multi-head Latent Attention, LongRoPE (whose decode
# crosses the switch at 16 tokens: the sequence runs again from the start), attention sinks
FAMILIES = ["mixtral", "olmoe-clip-norm", "qwen3_moe-sliding", "deepseek_v2", "phimoe-longrope-nobias",
            "gpt_oss-mxfp4",
            # the 2026 families' own: sliding layers and groups; pairwise RoPE reordered; norms after RoPE; muP;
            # chunks (through the kernel where q and k are not normed after RoPE), layers without RoPE and their
            # temperature, experts taking their input scaled
            "dots1-grouped-sliding-bias", "ernie4_5_moe", "hunyuan_v1_moe-alpha-bias", "granitemoeshared",
            "llama4_text", "llama4_text-llama3-lists",
            # global layers of their own head size and RoPE (a KV cache of two shapes), a dense MLP beside the experts
            "gemma4_text", "gemma4_text-vproj-bias",
            # q/k norms over all heads with part of each head rotated; GLM's routing over latent attention
            "minimax_m2", "glm4_moe_lite"]


@pytest.mark.parametrize("case", FAMILIES)
def test_every_batched_answer_is_the_one_the_request_gets_alone(hf_checkpoints: dict[str, Path], case: str) -> None:
    loaded = load_model(hf_checkpoints[case], dtype="fp32", context=48)
    vocab = loaded.model.cfg.vocab_size
    # seven requests through three rows: rows are reused as requests finish; a 9-token step budget splits the longer
    # prompts into chunks beside other sequences' decode tokens
    lengths = [12, 3, 20, 7, 1, 15, 9]
    requests = [BatchRequest(f"r{i}", p, SamplingParams(max_new_tokens=n))
                for i, (p, n) in enumerate(zip(prompts(7, vocab), lengths, strict=True))]
    results, streamed = run_batch(loaded, requests, max_batch=3, step_tokens=9)
    assert set(results) == {r.key for r in requests}
    for r in requests:
        tokens, reason = alone(loaded.engine, r)
        got = results[r.key]
        assert got.tokens == tokens == streamed[r.key], r.key
        assert got.finish_reason == reason and got.prompt_tokens == len(r.prompt) and not got.error


def test_per_request_sampling_settings_and_seeds(mixtral_dir: Path) -> None:
    loaded = load_model(mixtral_dir, dtype="fp32", context=64)
    ps = prompts(4, loaded.model.cfg.vocab_size, seed=1)
    settings = [SamplingParams(max_new_tokens=9, temperature=0.9, seed=7),
                SamplingParams(max_new_tokens=5, temperature=1.3, top_k=5, seed=11),
                SamplingParams(max_new_tokens=12, temperature=0.7, top_p=0.8, repetition_penalty=1.3, seed=3),
                SamplingParams(max_new_tokens=6)]
    requests = [BatchRequest(str(i), p, s) for i, (p, s) in enumerate(zip(ps, settings, strict=True))]
    results, _ = run_batch(loaded, requests, max_batch=4, step_tokens=64)
    for r in requests:
        assert results[r.key].tokens == alone(loaded.engine, r)[0]
    assert len(results["1"].tokens) <= 5 and len(results["0"].tokens) <= 9


def test_a_refused_request_gets_its_reason_and_the_others_run(mixtral_dir: Path) -> None:
    loaded = load_model(mixtral_dir, dtype="fp32", context=32)
    vocab = loaded.model.cfg.vocab_size
    good = BatchRequest("good", [5, 6, 7], SamplingParams(max_new_tokens=4))
    bad = [BatchRequest("empty", [], SamplingParams()),
           BatchRequest("long", list(range(1, 40)), SamplingParams()),
           BatchRequest("vocab", [vocab + 3], SamplingParams()),
           BatchRequest("beams", [5], SamplingParams(beams=2)),
           BatchRequest("temperature", [5], SamplingParams(temperature=-1.0))]
    results, _ = run_batch(loaded, [bad[0], good, *bad[1:]], max_batch=2, step_tokens=16)
    assert results["good"].tokens == alone(loaded.engine, good)[0] and not results["good"].error
    for r in bad:
        assert results[r.key].finish_reason == "error" and results[r.key].tokens == []
    assert "empty" in results["empty"].error and "context holds 32" in results["long"].error
    assert "tokenizer" in results["vocab"].error and "beam" in results["beams"].error
    assert "temperature" in results["temperature"].error


def test_eos_the_context_end_and_zero_new_tokens(mixtral_dir: Path) -> None:
    loaded = load_model(mixtral_dir, dtype="fp32", context=24)
    greedy = list(loaded.engine.generate([10, 20, 30], SamplingParams(max_new_tokens=6)))
    stop_at = greedy[3]
    loaded.engine.eos_ids = frozenset({stop_at})
    requests = [BatchRequest("eos", [10, 20, 30], SamplingParams(max_new_tokens=6)),
                BatchRequest("context", list(range(1, 21)), SamplingParams(max_new_tokens=50)),
                BatchRequest("none", [4, 5], SamplingParams(max_new_tokens=0))]
    results, _ = run_batch(loaded, requests, max_batch=2, step_tokens=32)
    assert results["eos"].finish_reason == "eos" and results["eos"].tokens == greedy[: greedy.index(stop_at)]
    assert results["context"].finish_reason in ("context", "eos") and len(results["context"].tokens) <= 4
    assert results["none"].finish_reason == "length" and results["none"].tokens == []


def test_a_ragged_pass_equals_each_sequence_run_alone(mixtral_dir: Path) -> None:
    """forward_rows: three sequences of different lengths, at different positions, in rows 2, 0 and 1 -> each one's
    logits as forward gives them for that sequence alone in row 0."""
    loaded = load_model(mixtral_dir, dtype="fp32", context=32)
    model = loaded.model.with_batch(3)
    seqs = [[3, 4, 5, 6, 7], [8, 9], [10, 11, 12, 13]]
    heads = [2, 1, 3]  # the tokens fed before the ragged pass, one sequence at a time
    for row, (s, n) in enumerate(zip(seqs, heads, strict=True)):
        model.forward_rows(torch.tensor(s[:n]), [Segment(row, 0, n)])
    segments = [Segment(row, n, len(s) - n) for row, (s, n) in enumerate(zip(seqs, heads, strict=True))]
    ids = torch.tensor([t for s, n in zip(seqs, heads, strict=True) for t in s[n:]])
    order = [2, 0, 1]
    got = model.forward_rows(torch.cat([ids[sum(len(s) - n for s, n in zip(seqs[:i], heads[:i], strict=True)):][
        : len(seqs[i]) - heads[i]] for i in order]), [segments[i] for i in order])  # [3, V]
    for k, i in enumerate(order):
        want = loaded.model.forward(torch.tensor([seqs[i]]), 0)[0, -1]
        torch.testing.assert_close(got[k], want, rtol=1e-5, atol=1e-5)


def test_forward_rows_refuses_ids_that_do_not_match_the_segments(mixtral_dir: Path) -> None:
    loaded = load_model(mixtral_dir, dtype="fp32", context=16)
    with pytest.raises(ValueError, match="segments' tokens"):
        loaded.model.forward_rows(torch.tensor([1, 2, 3]), [Segment(0, 0, 2)])


def test_batched_answers_on_the_emulated_accelerator_with_an_expert_cache(mixtral_dir: Path) -> None:
    """On the accelerator tier (some experts in cache slots, the rest on the CPU), batched answers are the lone ones
    too, and a step's CPU experts were run for several tokens at once."""
    loaded = load_model(mixtral_dir, dtype="fp32", context=40, accelerator="emulated", vram_gb=0.002,
                        batch=4)  # 8 slots for 16 experts
    assert loaded.model.dispatcher.cache.slots > 0
    requests = [BatchRequest(str(i), p, SamplingParams(max_new_tokens=8))
                for i, p in enumerate(prompts(6, loaded.model.cfg.vocab_size, seed=2))]
    results, _ = run_batch(loaded, requests, max_batch=4, step_tokens=24)
    stats = loaded.model.dispatcher.request_stats().as_dict()["experts"]
    assert stats["gpu"] > 0 and stats["cpu"] > 0
    for r in requests:
        assert results[r.key].tokens == alone(loaded.engine, r)[0]


def test_a_bf16_ragged_pass_is_close_to_each_sequence_alone(mixtral_dir: Path) -> None:
    """bf16 through the kernels (one-token attention per row, several tokens per expert): within bf16's rounding."""
    loaded = load_model(mixtral_dir, dtype="bf16", context=32)
    model = loaded.model.with_batch(2)
    a, b = [3, 4, 5, 6], [7, 8, 9]
    model.forward_rows(torch.tensor(a[:3] + b[:2]), [Segment(0, 0, 3), Segment(1, 0, 2)])
    got = model.forward_rows(torch.tensor([a[3], b[2]]), [Segment(0, 3, 1), Segment(1, 2, 1)])  # [2, V]
    for k, s in enumerate((a, b)):
        want = loaded.model.forward(torch.tensor([s]), 0)[0, -1]
        torch.testing.assert_close(got[k], want, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("host_cache", [False, True])
def test_pipelined_micro_batches_on_the_accelerator_give_the_lone_answers(mixtral_dir: Path, host_cache: bool
                                                                         ) -> None:
    """Two micro-batches a step (one's attention while the accelerator runs the other's experts; the next layer's
    experts prefetched), with the KV cache on the device or in RAM (attention on the CPU)."""
    loaded = load_model(mixtral_dir, dtype="fp32", context=40, accelerator="emulated", vram_gb=0.002,
                        batch=4)  # 8 slots for 16 experts
    requests = [BatchRequest(str(i), p, SamplingParams(max_new_tokens=7))
                for i, p in enumerate(prompts(7, loaded.model.cfg.vocab_size, seed=3))]
    batch = BatchEngine(loaded.model, loaded.engine.eos_ids, 4, 20, micro_batches=2, host_cache=host_cache)
    assert batch.model.cache.k[0].device.type == "cpu" and batch.model.host_cache == host_cache
    results: dict[str, list[int]] = {}
    for event in batch.run(requests):
        if isinstance(event, DoneEvent):
            results[event.result.key] = event.result.tokens
    for r in requests:
        assert results[r.key] == alone(loaded.engine, r)[0], r.key


def test_micro_batches_split_a_step_by_tokens(mixtral_dir: Path) -> None:
    loaded = load_model(mixtral_dir, dtype="fp32", context=40, accelerator="emulated", vram_gb=0.004)
    model = loaded.model.with_batch(1)
    model.micro_batches = 2
    segs = [Segment(r, 0, n) for r, n in enumerate([5, 1, 1, 1, 6])]
    assert model._micro_batches(segs) == [(0, 3), (3, 5)]
    assert model._micro_batches(segs[:1]) == [(0, 1)]
    model.micro_batches = 3
    assert model._micro_batches([Segment(r, 0, 1) for r in range(6)]) == [(0, 2), (2, 4), (4, 6)]
    cpu = load_model(mixtral_dir, dtype="fp32", context=40).model
    cpu.micro_batches = 2
    assert cpu._micro_batches(segs) == [(0, 5)]  # nothing to overlap without an accelerator


def test_one_micro_batch_s_attention_runs_while_the_accelerator_runs_another_s_experts(mixtral_dir: Path,
                                                                                        monkeypatch) -> None:
    """Sleeps stand in for the accelerator's expert work (on its stream) and the CPU's attention (on the host): in a
    pipelined step, the second micro-batch's attention overlaps the first's experts, and a layer takes about the
    longer of the two, not their sum."""
    import threading
    import time

    from tandem.runtime import attention
    from tandem.runtime.dispatch import Dispatcher, Strategy

    loaded = load_model(mixtral_dir, dtype="fp32", context=40, accelerator="emulated", vram_gb=0.05, batch=2,
                        strategy=Strategy.FETCH)  # every expert on the device
    delay = 0.1
    spans: list[tuple[str, float, float]] = []

    def timed(name: str, fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            threading.Event().wait(delay)
            out = fn(*args, **kwargs)
            spans.append((name, start, time.perf_counter()))
            return out
        return run

    for work in ("_device_expert", "_device_group", "_device_chosen"):  # the device's expert work, however it runs
        monkeypatch.setattr(Dispatcher, work, staticmethod(timed("device", getattr(Dispatcher, work))))
    monkeypatch.setattr(attention, "attend_positions", timed("attention", attention.attend_positions))
    model = loaded.model.with_batch(2)
    model.micro_batches = 2
    model.forward_rows(torch.tensor([4, 5]), [Segment(0, 0, 1), Segment(1, 0, 1)])  # warm
    spans.clear()
    start = time.perf_counter()
    model.forward_rows(torch.tensor([6, 7]), [Segment(0, 1, 1), Segment(1, 1, 1)])
    took = time.perf_counter() - start
    attention = [s for s in spans if s[0] == "attention"]
    experts = [s for s in spans if s[0] == "device"]
    assert len(attention) == 2 * len(model.layers)  # one segment in each micro-batch, each layer
    overlapping = sum(1 for _, a0, a1 in attention for _, d0, d1 in experts if a0 < d1 and d0 < a1)
    assert overlapping >= len(model.layers)  # in every layer: B's attention beside A's experts
    busy = sum(end - begin for _, begin, end in spans)  # what the step would take with nothing side by side
    assert took < 0.85 * busy


def test_prefetch_brings_a_layer_s_busiest_experts_of_its_last_pass_into_its_slots(mixtral_dir: Path) -> None:
    from tandem.runtime.dispatch import OffloadOptions, Strategy

    loaded = load_model(mixtral_dir, dtype="fp32", context=40, accelerator="emulated", vram_gb=0.0013,  # 2x5 slots
                        strategy=Strategy.CPU)  # misses stay on the CPU: only post-fetches and prefetches copy
    dispatcher = loaded.model.dispatcher
    assert isinstance(dispatcher.policy, OffloadOptions) and dispatcher.cache.covers(1)
    model = loaded.model.with_batch(1)
    model.forward_rows(torch.tensor([3, 4, 5, 6, 7, 8]), [Segment(0, 0, 6)])
    dispatcher.cache.wait_all()
    for slot in dispatcher.cache.sets[dispatcher.cache.index_of[1]]:  # layer 1's slots emptied
        slot.key = None
    dispatcher.prefetch(1)
    dispatcher.cache.wait_all()
    wanted = dispatcher.last_chosen[1][: dispatcher.cache.ways]
    assert wanted and set(wanted) <= {e for layer, e in dispatcher.cache.resident() if layer == 1}
    assert not dispatcher.cache.covers(99)
    dispatcher.prefetch(99)  # a layer no cache covers: nothing to do, and no error


@pytest.mark.isa
def test_a_sequence_decoding_alone_takes_the_single_request_path(mixtral_dir: Path) -> None:
    """A sequence alone in the batch (a server's one client), here in cache row 1, decodes as Engine.generate does,
    the bf16 decode step over its own cache row included: the same tokens, exactly."""
    from tandem.runtime.batch import RequestQueue
    from tandem.runtime.decode_step import why_not

    loaded = load_model(mixtral_dir, dtype="bf16", context=64, threads=1)
    assert why_not(loaded.model) is None, "the tiny model should take the decode step"
    first = BatchRequest("first", [5, 6, 7, 8], SamplingParams(max_new_tokens=2))
    second = BatchRequest("second", [9, 10, 11], SamplingParams(max_new_tokens=12))
    wanted = alone(loaded.engine, second)[0]
    engine = BatchEngine(loaded.model, loaded.engine.eos_ids, 2)
    queue = RequestQueue()
    queue.put(first)
    got: dict[str, list[int]] = {}
    for event in engine.run(queue):
        if isinstance(event, DoneEvent):
            got[event.result.key] = event.result.tokens
            if event.result.key == "first":  # row 0 is free again, row 1 first in line: the second goes there
                queue.put(second)
                queue.close()
    assert got["second"] == wanted
    assert engine.model._row_views[1]._step is not None  # row 1 decoded through the decode step
