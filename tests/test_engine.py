"""The generator API: stopping rules, context limits, stats, and cached decode = full recompute."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runtime.engine import Engine, GenerationStats
from runtime.errors import GenerationError
from runtime.loader import load
from runtime.sampling import SamplingParams


@pytest.fixture
def engine(mixtral_dir: Path) -> Engine:
    return load(mixtral_dir, dtype="fp32", context=64).engine


def test_stream_is_a_generator_of_ids(engine: Engine) -> None:
    stats = GenerationStats()
    stream = engine.generate([5, 6, 7], SamplingParams(max_new_tokens=5), stats)
    first = next(stream)
    assert isinstance(first, int) and stats.new_tokens == 1 and stats.ttft_s > 0
    rest = list(stream)
    assert stats.new_tokens == 1 + len(rest)
    assert stats.finish_reason in ("length", "eos")


def test_greedy_decode_equals_recomputing_from_scratch(engine: Engine) -> None:
    prompt = [10, 20, 30, 40]
    tokens = list(engine.generate(prompt, SamplingParams(max_new_tokens=10)))
    ids = list(prompt)
    for tok in tokens:
        logits = engine.model.forward(torch.tensor([ids]), 0)[0, -1]
        assert int(logits.argmax()) == tok
        ids.append(tok)


def test_stops_on_eos(mixtral_dir: Path) -> None:
    loaded = load(mixtral_dir, dtype="fp32", context=64)
    greedy = list(loaded.engine.generate([10, 20, 30], SamplingParams(max_new_tokens=6)))
    stop_at = greedy[3]
    engine = Engine(loaded.model, {stop_at})
    stats = GenerationStats()
    out = list(engine.generate([10, 20, 30], SamplingParams(max_new_tokens=6), stats))
    assert out == greedy[: greedy.index(stop_at)]
    assert stats.finish_reason == "eos"


def test_stops_at_the_context_end(engine: Engine) -> None:
    stats = GenerationStats()
    out = list(engine.generate(list(range(1, 61)), SamplingParams(max_new_tokens=100), stats))
    assert len(out) <= 4
    assert stats.finish_reason in ("context", "eos")


def test_refuses_prompt_longer_than_context(engine: Engine) -> None:
    with pytest.raises(GenerationError, match="context holds 64"):
        engine.generate(list(range(1, 65)))


def test_refuses_out_of_vocab_and_empty_prompts(engine: Engine) -> None:
    with pytest.raises(GenerationError, match="empty"):
        engine.generate([])
    with pytest.raises(GenerationError, match="tokenizer does not match"):
        engine.generate([10**6])


def test_seeded_sampling_reproduces(engine: Engine) -> None:
    params = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=123)
    assert list(engine.generate([1, 2, 3], params)) == list(engine.generate([1, 2, 3], params))
