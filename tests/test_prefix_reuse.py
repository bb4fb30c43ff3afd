"""Prefix reuse (runtime/prefix.py): a prompt whose first tokens a KV cache row holds prefills only the rest, and
answers token for token as the same prompt prefilled whole (fp32, greedy), for every family and attention kind the
tests build (sliding windows, sinks, MLA's latent cache, LongRoPE's switch), in single sequences, beams and batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.autotune.configure import load_model
from tandem.runtime.batch import BatchEngine, BatchRequest, DoneEvent
from tandem.runtime.engine import Engine, GenerationStats
from tandem.runtime.prefix import HeldTokens
from tandem.runtime.sampling import SamplingParams
from tests.conftest import CASES

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)
FIRST = [5, 17, 99, 3, 42, 7, 81, 64, 23, 11, 58, 31, 2]


def turns(first: list[int], answer: list[int]) -> list[tuple[str, list[int], int]]:
    """(what, prompt, positions it may reuse) after `first` was answered with `answer` (whose last token was never
    fed: its keys are not in the cache)."""
    follow = first + answer + [19, 4, 77, 8, 50]
    edited = follow[:6] + [(follow[6] + 1) % 100] + follow[7:]
    return [("the next turn", follow, len(first) + len(answer) - 1),
            ("a retry", follow, len(follow) - 1),
            ("an edit in the middle", edited, 6),
            ("a shorter prompt", edited[:9], 8),
            ("another prompt", [88] + edited[1:], 0)]


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_reused_prefixes_answer_as_whole_prompts(hf_checkpoints: dict[str, Path], case: str) -> None:
    model = load_model(hf_checkpoints[case], dtype="fp32").model
    reusing, whole = Engine(model, (), reuse=True), Engine(model, ())
    stats = GenerationStats()
    answer = list(reusing.generate(FIRST, GREEDY, stats))
    assert stats.cached_tokens == 0 and len(answer) == GREEDY.max_new_tokens
    for what, prompt, reusable in turns(FIRST, answer):
        switch = model.rope_switch  # keys rotated with LongRoPE's other tables are not reused
        if switch is not None and (len(prompt) > switch) != bool(model.cache.held.long[0]):
            reusable = 0
        got = list(reusing.generate(prompt, GREEDY, stats))
        assert stats.cached_tokens == reusable, what
        want = list(whole.generate(prompt, GREEDY))  # (prefilled whole: the cache then holds what it did above)
        assert got == want, f"{case}: {what}"


def test_beams_and_the_decode_step_reuse_too(hf_checkpoints: dict[str, Path]) -> None:
    for dtype in ("fp32", "bf16"):  # (bf16 takes the one-call decode step)
        loaded = load_model(hf_checkpoints["qwen3_moe"], dtype=dtype, batch=3)
        reusing, whole = Engine(loaded.model, (), reuse=True), Engine(loaded.model, ())
        beams = SamplingParams(max_new_tokens=6, beams=3)
        answer = list(reusing.generate(FIRST, beams))
        stats = GenerationStats()
        prompt = FIRST + answer + [9, 9]
        got = list(reusing.generate(prompt, beams, stats))
        assert stats.cached_tokens > len(FIRST) and got == list(whole.generate(prompt, beams)), dtype
        got = list(reusing.generate(prompt, GREEDY, stats))
        assert stats.cached_tokens == len(prompt) - 1 and got == list(whole.generate(prompt, GREEDY)), dtype


def test_batch_requests_take_the_row_holding_their_prefix(hf_checkpoints: dict[str, Path]) -> None:
    """Two requests sharing a long system prompt, then follow-ups of each: every answer is the one a fresh engine
    gives, and a follow-up prefills only what its row does not hold."""
    model = load_model(hf_checkpoints["mixtral"], dtype="fp32", batch=2).model
    system = FIRST * 2

    def run(engine: BatchEngine, prompts: dict[str, list[int]]) -> dict[str, tuple[list[int], int]]:
        requests = [BatchRequest(k, p, GREEDY) for k, p in prompts.items()]
        return {e.result.key: (e.result.tokens, e.result.cached) for e in engine.run(requests)
                if isinstance(e, DoneEvent)}

    reusing = BatchEngine(model, (), 2, reuse=True)
    first = run(reusing, {"a": system + [1, 2], "b": system + [3, 4]})
    follow = {k: (system + [1, 2] if k == "a" else system + [3, 4]) + tokens + [6] for k, (tokens, _) in
              first.items()}
    second = run(reusing, {"b2": follow["b"], "a2": follow["a"]})
    fresh = BatchEngine(model, (), 2)
    for key, prompt in (("a2", follow["a"]), ("b2", follow["b"])):
        assert second[key][0] == run(fresh, {key: prompt})[key][0], key
        assert second[key][1] == len(prompt) - 2, key  # (all but the new token and the answer's unfed last one)
    assert sum(cached for _, cached in first.values()) <= len(system)  # (the second may take the first's row)


def test_the_record_follows_passes_copies_and_failures() -> None:
    held = HeldTokens(2, 16)
    held.cut(0, 0)
    held.note(0, 0, torch.tensor([1, 2, 3, 4]), False)
    assert held.reusable(0, [1, 2, 3, 4, 5], False) == 4 and held.reusable(0, [1, 2, 3, 4], False) == 3
    assert held.reusable(0, [1, 2, 9, 4, 5], False) == 2 and held.reusable(0, [1, 2, 3, 4, 5], True) == 0
    held.cut(0, 2)  # a pass from position 2 that has not ended (or failed): only the first two are known
    assert held.reusable(0, [1, 2, 3, 4, 5], False) == 2
    held.note(0, 2, torch.tensor([7]), False)
    assert held.reusable(0, [1, 2, 7, 5], False) == 3
    held.note(1, 3, torch.tensor([5]), False)  # a pass past what the record holds: the row is unknown
    assert held.held(1) == 0
    held.copy_rows([(1, 0)], 2)
    assert held.held(1) == 2 and held.reusable(1, [1, 2, 3], False) == 2
    held.note(0, 3, torch.tensor([6]), True)  # rotated otherwise than the positions before it
    assert held.held(0) == 0
    view = held.row(1)
    view.cut(0, 1)
    assert held.held(1) == 1  # (a row's view writes the record it came from)
