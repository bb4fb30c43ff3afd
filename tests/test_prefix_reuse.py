"""Prefix reuse (runtime/prefix.py): a prompt whose first tokens a KV cache row holds prefills only the rest, and
answers token for token as the same prompt prefilled whole (fp32, greedy), for every family and attention kind the
tests build (sliding windows, sinks, MLA's latent cache, LongRoPE's switch), in single sequences, beams and batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.runtime.batch import BatchEngine, BatchRequest, DoneEvent
from tandem.runtime.engine import Engine, GenerationStats
from tandem.runtime.loader import load_model
from tandem.runtime.prefix import HeldTokens, PrefixStore
from tandem.runtime.sampling import SamplingParams
from tests.conftest import CASES

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)
FIRST = [5, 17, 99, 3, 42, 7, 81, 64, 23, 11, 58, 31, 2]


def turns(first: list[int], answer: list[int], recurrent: bool = False) -> list[tuple[str, list[int], int]]:
    """(what, prompt, positions it may reuse) after `first` was answered with `answer` (whose last token was never
    fed: its keys are not in the cache). `recurrent`: layers with a recurrent state, which reuse stops only where a
    pass ended or the state was marked (before a prompt's last token): an edit that far back is prefilled whole."""
    follow = first + answer + [19, 4, 77, 8, 50]
    edited = follow[:6] + [(follow[6] + 1) % 100] + follow[7:]
    return [("the next turn", follow, len(first) + len(answer) - 1),
            ("a retry", follow, len(follow) - 1),
            ("an edit in the middle", edited, 0 if recurrent else 6),
            ("a shorter prompt", edited[:9], 0 if recurrent else 8),
            ("another prompt", [88] + edited[1:], 0)]


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_reused_prefixes_answer_as_whole_prompts(hf_checkpoints: dict[str, Path], case: str) -> None:
    model = load_model(hf_checkpoints[case], dtype="fp32").model
    reusing, whole = Engine(model, (), reuse=True), Engine(model, ())
    stats = GenerationStats()
    answer = list(reusing.generate(FIRST, GREEDY, stats))
    assert stats.cached_tokens == 0 and len(answer) == GREEDY.max_new_tokens
    for what, prompt, reusable in turns(FIRST, answer, model.recurrent):
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


@pytest.mark.parametrize("case", ["mixtral", "mixtral-sliding", "deepseek_v3", "phimoe-longrope-nobias",
                                  "gemma4_text"])  # (Gemma 4: a KV cache of two head shapes)
def test_requests_sharing_a_prefix_compute_it_once(hf_checkpoints: dict[str, Path], case: str) -> None:
    """Four requests joining together with one system prompt: one computes it, the others copy it from its row once
    it is there (the one whose prompt is the system prompt alone too), and every answer is a fresh engine's."""
    model = load_model(hf_checkpoints[case], dtype="fp32", batch=4).model
    system = FIRST * 3
    prompts = {"a": system + [1, 2], "b": system + [3, 4, 5], "c": system + [6], "d": system}
    engine = BatchEngine(model, (), 4, step_tokens=16, reuse=True)
    done = {e.result.key: e.result for e in engine.run([BatchRequest(k, p, GREEDY) for k, p in prompts.items()])
            if isinstance(e, DoneEvent)}
    # the system prompt once, then what each adds (d: the last token again, its logits being the answer's start)
    assert engine.stats.prompt_tokens == len(prompts["a"]) + 3 + 1 + 1
    assert {k: r.cached for k, r in done.items()} == {"a": 0, "b": len(system), "c": len(system),
                                                      "d": len(system) - 1}
    fresh = BatchEngine(model, (), 4)
    want = {e.result.key: e.result.tokens for e in fresh.run([BatchRequest(k, p, GREEDY) for k, p in prompts.items()])
            if isinstance(e, DoneEvent)}
    assert {k: r.tokens for k, r in done.items()} == want
    assert fresh.stats.prompt_tokens == sum(len(p) for p in prompts.values())


def test_a_follower_whose_leader_stops_early_computes_the_prefix_itself(hf_checkpoints: dict[str, Path]) -> None:
    """The leader stopped before its row holds what they share: the follower prefills it itself, and answers as a
    fresh engine does."""
    model = load_model(hf_checkpoints["mixtral"], dtype="fp32", batch=3).model
    system = FIRST * 3
    engine = BatchEngine(model, (), 3, step_tokens=8, reuse=True)
    requests = [BatchRequest("x", [9, 8, 7], GREEDY), BatchRequest("a", system + [1], GREEDY),
                BatchRequest("b", system + [2], GREEDY)]
    done = {}
    for event in engine.run(requests):
        if isinstance(event, DoneEvent):
            done[event.result.key] = event.result
        elif event.key == "x":  # (after the first step: a has fed 5 of the system prompt's tokens)
            engine.finish("a")
    assert done["a"].finish_reason == "stop" and done["b"].cached == 0
    fresh = BatchEngine(model, (), 1)
    want = next(e.result.tokens for e in fresh.run([BatchRequest("b", system + [2], GREEDY)])
                if isinstance(e, DoneEvent))
    assert done["b"].tokens == want


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


@pytest.mark.parametrize("case", ["mixtral-sliding", "deepseek_v3", "gpt_oss", "phimoe-longrope-nobias"])
def test_a_chat_switched_away_from_and_back_is_copied_back_not_prefilled(hf_checkpoints: dict[str, Path],
                                                                         case: str) -> None:
    """Two conversations on one row: the one a prompt overwrites is kept in the store and copied back when its next
    turn comes, answering as the whole prompt does; a store too small for it keeps nothing."""
    model = load_model(hf_checkpoints[case], dtype="fp32", context=256).model
    store = PrefixStore(64 << 20)
    reusing, whole = Engine(model, (), reuse=True, store=store), Engine(model, ())
    a = [(i * 7 + 3) % 90 + 5 for i in range(40)]
    b = [(i * 11 + 1) % 90 + 5 for i in range(40)]
    answer_a = list(reusing.generate(a, GREEDY))
    list(reusing.generate(b, GREEDY))  # (a's row overwritten: saved first)
    assert len(store.entries) == 1
    stats = GenerationStats()
    follow = a + answer_a + [9, 8, 7]
    got = list(reusing.generate(follow, GREEDY, stats))
    switch = model.rope_switch
    if switch is None or (len(a) > switch) == (len(follow) > switch):
        assert stats.cached_tokens == len(a) + len(answer_a) - 1 and store.restored == stats.cached_tokens
    assert got == list(whole.generate(follow, GREEDY))
    tiny = PrefixStore(1024)
    small = Engine(model, (), reuse=True, store=tiny)
    list(small.generate(a, GREEDY))
    list(small.generate(b, GREEDY))
    assert tiny.entries == [] and tiny.nbytes <= tiny.budget


def test_the_store_keeps_the_recently_used_within_its_budget(hf_checkpoints: dict[str, Path]) -> None:
    model = load_model(hf_checkpoints["qwen3_moe"], dtype="fp32", context=256).model
    prompts = [[(i * k + k) % 90 + 5 for i in range(48)] for k in (3, 5, 7, 11)]
    probe = PrefixStore(1 << 30)
    engine = Engine(model, (), reuse=True, store=probe)
    list(engine.generate(prompts[0], GREEDY))
    list(engine.generate(prompts[1], GREEDY))
    one = probe.nbytes  # (one saved conversation)
    store = PrefixStore(2 * one + one // 2)  # room for two
    engine = Engine(model, (), reuse=True, store=store)
    for p in prompts:
        list(engine.generate(p, GREEDY))
    assert len(store.entries) == 2 and store.nbytes <= store.budget
    kept = [e.tokens[:48].tolist() for e in store.entries]
    assert kept == [prompts[1], prompts[2]]  # (the first dropped; the last still in the row)
    stats = GenerationStats()
    list(engine.generate(prompts[1] + [4], GREEDY, stats))
    assert stats.cached_tokens == 48 and store.entries[-1].tokens[:48].tolist() == prompts[1]


def test_a_server_with_one_row_keeps_each_conversation(hf_checkpoints: dict[str, Path]) -> None:
    """Batch mode with one row: conversations taking turns each find their prefix again (from the store)."""
    model = load_model(hf_checkpoints["mixtral"], dtype="fp32", batch=1, context=256).model
    store = PrefixStore(64 << 20)
    engine = BatchEngine(model, (), 1, reuse=True, store=store)
    a, b = FIRST * 3, [x + 1 for x in FIRST * 3]
    done = {e.result.key: e.result for e in engine.run([BatchRequest("a", a, GREEDY), BatchRequest("b", b, GREEDY)])
            if isinstance(e, DoneEvent)}
    follow = a + done["a"].tokens + [6]
    again = [e.result for e in engine.run([BatchRequest("a2", follow, GREEDY)]) if isinstance(e, DoneEvent)][0]
    assert again.cached == len(follow) - 2 and store.restored == again.cached
    assert again.tokens == list(Engine(model, ()).generate(follow, GREEDY))


def test_reuse_and_the_store_on_the_emulated_accelerator(mixtral_dir: Path) -> None:
    """The KV cache where the accelerator keeps it (played by the CPU here), experts split between its slots and
    the CPU: reused and restored prefixes answer as whole prompts."""
    model = load_model(mixtral_dir, dtype="fp32", context=96, accelerator="emulated", vram_gb=0.002).model
    assert model.accel is not None
    store = PrefixStore(64 << 20)
    reusing, whole = Engine(model, (), reuse=True, store=store), Engine(model, ())
    a, b = FIRST * 3, [x + 2 for x in FIRST * 3]
    answer = list(reusing.generate(a, GREEDY))
    list(reusing.generate(b, GREEDY))
    stats = GenerationStats()
    follow = a + answer + [6, 6]
    got = list(reusing.generate(follow, GREEDY, stats))
    assert stats.cached_tokens == len(a) + len(answer) - 1 and store.restored == stats.cached_tokens
    assert got == list(whole.generate(follow, GREEDY))


def test_a_copy_back_that_fails_halfway_leaves_the_row_claiming_nothing(hf_checkpoints: dict[str, Path],
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """An accelerator out of room while a saved prefix is copied back: the row's record claims nothing (its keys
    are half the old sequence's, half the saved one's), and the prompt is prefilled whole, answering as it should."""
    model = load_model(hf_checkpoints["mixtral"], dtype="fp32", context=128).model
    store = PrefixStore(64 << 20)
    reusing, whole = Engine(model, (), reuse=True, store=store), Engine(model, ())
    a, b = FIRST * 3, [x + 1 for x in FIRST * 3]
    list(reusing.generate(a, GREEDY))
    list(reusing.generate(b, GREEDY))
    cache = model.cache

    def half(row: int, parts: tuple[torch.Tensor, ...], n: int) -> None:
        cache.groups[0][1][:, row, :, :n].copy_(parts[0][:, :, :n])
        raise torch.OutOfMemoryError("no room for the values")

    monkeypatch.setattr(cache, "restore", half)
    stats = GenerationStats()
    got = list(reusing.generate(a + [4], GREEDY, stats))
    assert stats.cached_tokens == 0 and got == list(whole.generate(a + [4], GREEDY))
