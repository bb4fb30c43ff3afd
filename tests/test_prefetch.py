"""Expert prediction and prefetch (runtime/prefetch.py, Dispatcher._prefetch): each predictor guesses what it should,
its accuracy is counted per layer distance, a saved activation collection that cannot be trusted is left alone, and
on the emulated accelerator a prefetch (right or wrong) never changes an answer, never evicts an expert the running
layer or a queued kernel reads, and pauses while its guesses are mostly wrong."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tandem.runtime.accelerator import EmulatedAccelerator, cuda_usable
from tandem.runtime.checkpoint import open_checkpoint
from tandem.runtime.choices import PredictorKind
from tandem.runtime.dispatch import OffloadOptions, Strategy, budget_for_slots
from tandem.runtime.engine import Engine
from tandem.runtime.expert_cache import CachePolicy, ExpertCache
from tandem.runtime.model import ModelRun, MoEModel
from tandem.runtime.prefetch import (
    Accuracy,
    EamCollection,
    EamMatch,
    PrecisionGate,
    Predictor,
    PrefetchOptions,
    PreviousToken,
    Scorer,
    StaleGate,
    ranked,
)
from tandem.runtime.sampling import SamplingParams
from tandem.runtime.synth import tiny_config, write_test_model

NEW_TOKENS = 12


# -- predictors, pure ---------------------------------------------------------------------------------------------
def test_ranked_puts_the_most_chosen_first() -> None:
    assert ranked(np.array([[3, 1], [3, 2], [2, 3]]), 5) == [3, 2, 1]


def test_previous_token_guesses_what_the_layer_chose_last() -> None:
    p = PreviousToken(num_moe=3, num_experts=8, top_k=2)
    assert p.predict(0, 1) == []  # nothing seen yet
    p.observe(1, np.array([[5, 2]]))
    p.observe(2, np.array([[7, 0]]))
    assert p.predict(0, 1) == [2, 5] and p.predict(0, 2) == [0, 7]
    p.new_request()
    assert p.predict(0, 1) == []


def test_the_stale_gate_takes_the_choices_it_is_handed_for_each_distance() -> None:
    p = StaleGate(num_moe=4, num_experts=8, top_k=2)
    assert p.predict(1, 2, [np.array([[1, 2]]), np.array([[6, 4]])]) == [4, 6]


def test_eam_matches_the_nearest_earlier_request() -> None:
    collection = EamCollection(num_moe=2, num_experts=6)
    a = np.zeros((2, 6), np.float32)
    a[0, 0], a[1, 1], a[1, 2] = 5, 4, 1  # request A: layer 0 expert 0, then layer 1 experts 1 (mostly) and 2
    b = np.zeros((2, 6), np.float32)
    b[0, 3], b[1, 4], b[1, 5] = 5, 4, 3  # request B: layer 0 expert 3, then layer 1 experts 4 and 5
    collection.add(a)
    collection.add(b)
    p = EamMatch(num_moe=2, num_experts=6, top_k=2, collection=collection)
    p.observe(0, np.array([[3]]))  # looks like B
    assert p.predict(0, 1) == [4, 5]
    p.new_request()  # this request (layer 0 expert 3 once) joins the collection
    assert len(collection.matrices) == 3
    p.observe(0, np.array([[0]]))  # looks like A
    assert p.predict(0, 1) == [1, 2]


def test_eam_without_a_collection_guesses_from_the_request_itself() -> None:
    p = EamMatch(num_moe=2, num_experts=4, top_k=2)
    for _ in range(3):
        p.observe(0, np.array([[1]]))
        p.observe(1, np.array([[2]]))
    p.observe(0, np.array([[1]]))
    assert p.predict(0, 1) == [2]  # only what it has seen: no guess of an expert never routed


def test_a_saved_collection_comes_back_and_an_untrusted_one_is_left_alone(tmp_path: Path) -> None:
    c = EamCollection(2, 4, capacity=3)
    for k in range(5):
        c.add(np.full((2, 4), k + 1, np.float32))
    assert len(c.matrices) == 3  # the oldest dropped
    path = tmp_path / "eam.npz"
    c.save(path)
    back = EamCollection(2, 4)
    assert back.load(path) is None
    assert [float(m[0, 0]) for m in back.matrices] == [3.0, 4.0, 5.0]
    other = EamCollection(3, 4)  # another model's shape: set aside, never trusted
    assert "not for this model" in (other.load(path) or "") and not other.matrices
    assert not path.exists() and len(list(tmp_path.glob("eam.bad-*.npz"))) == 1
    path.write_bytes(b"PK\x03\x04 not a zip")
    fresh = EamCollection(2, 4)
    assert "damaged" in (fresh.load(path) or "") and not fresh.matrices
    assert not path.exists() and len(list(tmp_path.glob("eam.bad-*.npz"))) == 2
    assert EamCollection(2, 4).load(tmp_path / "missing.npz") is None


def test_accuracy_counts_recall_and_precision_per_distance() -> None:
    s = Scorer(depth=2)
    s.guess(3, 1, [1, 2])
    s.guess(3, 2, [1, 5, 6])
    assert s.routed(3, [1, 2]) == (5, 3)
    a = s.accuracy
    assert a.recall(1) == 1.0 and a.precision(1) == 1.0
    assert a.recall(2) == 0.5 and a.precision(2) == pytest.approx(1 / 3)
    assert s.routed(3, [1, 2]) == (0, 0)  # each guess scored once
    assert Accuracy(1).as_rows() == [{"distance": 1, "recall": 0.0, "precision": 0.0, "predicted": 0, "routed": 0}]


def test_the_gate_pauses_below_its_threshold_and_reopens_when_guesses_recover() -> None:
    gate = PrecisionGate(threshold=0.5, window=20, warmup=10)
    gate.add(8, 0)
    assert gate.open  # too few guesses yet to judge
    gate.add(8, 0)
    assert not gate.open
    gate.add(20, 19)
    assert gate.open and gate.precision == pytest.approx(19 / 20)


# -- on the emulated accelerator ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = tiny_config("mixtral", num_hidden_layers=4)  # 4 MoE layers of 8 experts, top-2
    return write_test_model(tmp_path_factory.mktemp("prefetch") / "mixtral", cfg, seed=5)


def engine_for(folder: Path, accel: EmulatedAccelerator | None = None,
               policy: OffloadOptions | None = None) -> Engine:
    model = MoEModel.from_checkpoint(open_checkpoint(folder), ModelRun(torch.float32, 128, 1), accel, policy)
    model.use_step = False  # the layer loop: the dispatcher sees every layer
    return Engine(model, ())


def quarter_budget(folder: Path, slots: int = 8) -> int:
    """Emulated device memory for `slots` of the 32 experts (float32 slots; default a quarter)."""
    cfg = open_checkpoint(folder).config
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4
    probe = EmulatedAccelerator(1 << 30)
    engine = engine_for(folder, probe, OffloadOptions(cache_ways=1))
    fixed = probe.used - len(engine.model.dispatcher.slot_buffers) * expert
    engine.model.close()
    return int(budget_for_slots(fixed, slots, expert))


PROMPT = [5, 17, 99, 230, 41, 7, 300, 12]


@pytest.fixture(scope="module")
def reference(folder: Path) -> list[int]:
    return list(engine_for(folder).generate(PROMPT, SamplingParams(max_new_tokens=NEW_TOKENS)))


@pytest.mark.parametrize("kind", [PredictorKind.PREVIOUS, PredictorKind.STALE_GATE, PredictorKind.EAM])
@pytest.mark.parametrize("strategy", [Strategy.CPU, Strategy.FETCH])
def test_prefetch_changes_no_answer_and_counts_its_copies(folder, reference, kind, strategy) -> None:
    # 4 ways a layer, top-2: room for guesses beside the experts each layer chose last (never evicted for one)
    policy = OffloadOptions(strategy=strategy, cache_ways=4, prefetch=PrefetchOptions(kind, depth=2))
    accel = EmulatedAccelerator(quarter_budget(folder, 16), copy_delay_s=0.002)
    engine = engine_for(folder, accel, policy)
    d = engine.model.dispatcher
    assert d.prefetching and d.cache.slots == 16
    for _ in range(2):  # the second answer: an EAM collection of one request, the previous-token's memory reset
        assert list(engine.generate(PROMPT, SamplingParams(max_new_tokens=NEW_TOKENS))) == reference
    d.cache.wait_all()
    stats = d.cache.stats
    # a guess is copied unless it is on the device already (the previous token's experts mostly are)
    assert stats.prefetches > 0 if kind is PredictorKind.STALE_GATE else \
        stats.prefetches > 0 or d._fresh.accuracy.predicted.sum() == 0
    assert stats.prefetch_used + stats.prefetch_wasted <= stats.prefetches
    assert d.scorer is not None and d.scorer.accuracy.predicted[1] > 0
    engine.model.close()


class Wrong(Predictor):
    """Always the experts least likely to be routed: the ones a router never picks in this test's model (the layer's
    top-k is computed here, then everything else guessed)."""

    kind = PredictorKind.PREVIOUS

    def predict(self, m: int, ahead: int, hint: object = None) -> list[int]:
        return [e for e in range(self.num_experts) if e not in self.seen.get(m + ahead, ())][: self.top_k]

    seen: dict[int, set[int]] = {}


def test_wrong_guesses_change_no_answer_and_pause_prefetch(folder, reference) -> None:
    # every expert each layer routes in the reference answer, so that the guesses are sure to miss
    probe = engine_for(folder)
    probe.model.dispatcher.predict(PredictorKind.PREVIOUS, 1)
    list(probe.generate(PROMPT, SamplingParams(max_new_tokens=NEW_TOKENS)))
    trace = np.stack(probe.model.dispatcher.recorder.sequence)  # [steps, layers, K]
    Wrong.seen = {m: set(trace[:, m].ravel().tolist()) for m in range(trace.shape[1])}
    policy = OffloadOptions(strategy=Strategy.CPU, cache_ways=2, prefetch=PrefetchOptions(PredictorKind.PREVIOUS))
    engine = engine_for(folder, EmulatedAccelerator(quarter_budget(folder)), policy)
    d = engine.model.dispatcher
    d.predictor = Wrong(len(d.moe_layers), d.cfg.num_experts, d.cfg.top_k)
    d.prefetch_gate.warmup = 4
    assert list(engine.generate(PROMPT, SamplingParams(max_new_tokens=NEW_TOKENS))) == reference
    d.cache.wait_all()
    assert d.prefetch_gate.precision == 0.0 and not d.prefetch_gate.open
    assert d.cache.stats.prefetch_used == 0
    # paused after the warm-up's guesses: a few layers' worth, not one a layer for every token
    assert 0 < d.cache.stats.prefetches <= 8
    engine.model.close()


def test_a_prefetch_never_evicts_what_the_running_layer_or_a_queued_kernel_reads(folder, reference,
                                                                                monkeypatch) -> None:
    seen: list[tuple[frozenset, object]] = []
    victim = ExpertCache.victim

    def watched(self: ExpertCache, layer: int, keep: frozenset = frozenset()):  # type: ignore[no-untyped-def]
        slot = victim(self, layer, keep)
        seen.append((keep, None if slot is None else slot.key))
        return slot

    monkeypatch.setattr(ExpertCache, "victim", watched)
    policy = OffloadOptions(strategy=Strategy.FETCH, cache_ways=4, cache_policy=CachePolicy.LRU,
                            prefetch=PrefetchOptions(PredictorKind.STALE_GATE, depth=3))
    engine = engine_for(folder, EmulatedAccelerator(quarter_budget(folder, 16), copy_delay_s=0.002), policy)
    d = engine.model.dispatcher
    running: list[frozenset] = []
    prefetch = d._prefetch

    def checked(guesses, in_use):  # type: ignore[no-untyped-def]
        running.append(in_use | d._held)
        before = len(seen)
        prefetch(guesses, in_use)
        protect = d.reuse.precision >= d.prefetch_gate.precision  # (the previous token's kept more than guesses)
        last = {(target, e) for target, _ in guesses for e in d.last_chosen.get(target, ())} if protect else set()
        for keep, evicted in seen[before:]:
            assert in_use | d._held <= keep and evicted not in in_use | d._held | last

    monkeypatch.setattr(d, "_prefetch", checked)
    assert list(engine.generate(PROMPT, SamplingParams(max_new_tokens=NEW_TOKENS))) == reference
    assert running and d.cache.stats.prefetches > 0
    engine.model.close()


def test_the_flags_choose_the_predictor_and_depth(folder) -> None:
    from tandem.runtime.options import Machine, Request, resolve

    machine = Machine(frozenset({"avx2"}), 2, (), 8 << 30, False)
    ckpt = open_checkpoint(folder)
    o = resolve(Request(model=folder, prefetch=PredictorKind.EAM, prefetch_depth=3), None, ckpt, machine)
    assert o.offload.prefetch == PrefetchOptions(PredictorKind.EAM, 3)
    assert o.to_dict()["prefetch"] == {"value": "eam", "from": "given"}
    assert resolve(Request(model=folder), None, ckpt, machine).offload.prefetch.on is False
    from tandem.kernels.errors import SettingsError
    with pytest.raises(SettingsError, match="--prefetch-depth 9"):
        resolve(Request(model=folder, prefetch_depth=9), None, ckpt, machine)


def test_the_tuner_measures_each_predictors_recall_and_leaves_the_model_as_it_was(folder) -> None:
    from tandem.autotune.run import measure_predictors
    from tandem.runtime.loader import load_model

    loaded = load_model(folder, dtype="fp32", context=64)
    recall = measure_predictors(loaded, PROMPT, 8)
    assert set(recall) == {"previous-token", "stale-gate", "eam"}
    assert all(len(r) == 3 and all(0 <= x <= 1 for x in r) for r in recall.values())  # 4 MoE layers: 3 ahead
    assert recall["stale-gate"][0] > 0  # the next router on a hidden state one layer old: right some of the time
    d = loaded.model.dispatcher
    assert loaded.model.use_step and d.predictor is None and d.scorer is None
    loaded.model.close()


def test_a_plan_that_finds_prefetch_pays_turns_it_on_through_the_profile(folder) -> None:
    from tandem.autotune.configure import profile_request
    from tandem.autotune.plan import Plan
    from tandem.autotune.profile import check_plan
    from tandem.runtime.options import Machine, Request, resolve

    plan = Plan(2, True, Strategy.FIDDLER, 4, 2, prefetch=PredictorKind.STALE_GATE, prefetch_depth=2,
                prefetch_min_precision=0.4).to_dict()
    check_plan(plan)
    assert Plan.from_dict(plan).prefetch_depth == 2
    tuned = profile_request(plan)
    machine = Machine(frozenset({"avx2"}), 2, (), 8 << 30, False)
    o = resolve(Request(model=folder, accelerator="emulated"), tuned, open_checkpoint(folder), machine)
    assert o.offload.prefetch == PrefetchOptions(PredictorKind.STALE_GATE, 2, 0.4)
    assert o.to_dict()["prefetch"]["from"] == "profile"
    given = resolve(Request(model=folder, accelerator="emulated", prefetch=PredictorKind.NONE), tuned,
                    open_checkpoint(folder), machine)
    assert not given.offload.prefetch.on  # the flag wins
    off = profile_request(Plan(2, True, Strategy.FIDDLER, 4, 2).to_dict())  # a plan without prefetch
    assert off.prefetch is None and off.prefetch_depth is None
    with pytest.raises(ValueError, match="prefetch depth"):
        check_plan({**plan, "prefetch": {"predictor": "eam", "depth": 7}})


def test_the_eam_collection_outlives_the_model_and_a_damaged_one_is_set_aside(folder, tmp_path) -> None:
    saved = tmp_path / "eam.npz"
    policy = OffloadOptions(strategy=Strategy.CPU, cache_ways=2,
                            prefetch=PrefetchOptions(PredictorKind.EAM, 2, collection=saved))
    engine = engine_for(folder, EmulatedAccelerator(quarter_budget(folder)), policy)
    for prompt in (PROMPT, PROMPT[:5]):
        list(engine.generate(prompt, SamplingParams(max_new_tokens=4)))
    engine.model.close()  # both requests saved, the last one with it
    back = EamCollection(4, 8)
    assert back.load(saved) is None and len(back.matrices) == 2
    again = engine_for(folder, EmulatedAccelerator(quarter_budget(folder)), policy)
    d = again.model.dispatcher
    assert isinstance(d.predictor, EamMatch) and len(d.predictor.collection.matrices) == 2 and not d.notices
    again.model.close()
    saved.write_bytes(b"not a collection")
    third = engine_for(folder, EmulatedAccelerator(quarter_budget(folder)), policy)
    assert third.model.dispatcher.notices and "set aside" in third.model.dispatcher.notices[0]
    assert list(third.generate(PROMPT, SamplingParams(max_new_tokens=NEW_TOKENS)))  # and it still answers
    third.model.close()
    assert EamCollection(4, 8).load(saved) is None  # a new one saved in its place


def test_experts_left_in_their_files_are_read_ahead_without_changing_the_answer(folder, reference) -> None:
    from tandem.runtime.decode_step import why_not
    from tandem.runtime.loader import load_model
    from tandem.runtime.readahead import PAGE, spans

    loaded = load_model(folder, dtype="fp32", context=128, resident=False, readahead=True,
                        prefetch=PredictorKind.STALE_GATE, prefetch_depth=2)
    d = loaded.model.dispatcher
    assert d.reading_ahead and not d.prefetching
    assert "read ahead" in (why_not(loaded.model) or "")  # the layer loop: a guess a layer
    tokens = list(Engine(loaded.model, ()).generate(PROMPT, SamplingParams(max_new_tokens=NEW_TOKENS)))
    assert tokens == reference and d.readaheads > 0
    w = d.cpu_experts[1][0]
    for (start, length), t in zip(d._spans.get((1, 0)) or spans([w.gate, w.up, w.down]), (w.gate, w.up, w.down),
                                  strict=True):
        assert start % PAGE == 0 and start <= t.data_ptr() < t.data_ptr() + t.nbytes <= start + length
    loaded.model.close()
    in_ram = load_model(folder, dtype="fp32", context=128, resident=True, readahead=True,
                        prefetch=PredictorKind.STALE_GATE)
    assert not in_ram.model.dispatcher.reading_ahead  # read into RAM already: nothing to read ahead
    assert not in_ram.model.dispatcher.file_backed and in_ram.model.dispatcher.expert_spans() == []
    in_ram.model.close()
    guessing = load_model(folder, dtype="fp32", context=128, resident=False, prefetch=PredictorKind.STALE_GATE)
    assert not guessing.model.dispatcher.reading_ahead  # --prefetch alone reads nothing ahead without a GPU
    guessing.model.close()
    quantized = load_model(folder, dtype="fp32", context=128, resident=False, readahead=True, quant="int8")
    assert not quantized.model.dispatcher.file_backed and not quantized.model.dispatcher.reading_ahead
    quantized.model.close()


def test_the_readahead_benchmark_rows(folder) -> None:
    from tandem.autotune.bench.prefetch import readahead_rows

    out = readahead_rows(str(folder), "fp32", prompt_tokens=8, new_tokens=4, rounds=1)
    assert [r["setup"] for r in out["rows"]] == ["decode step", "layer loop", "read-ahead, each layer's own experts",
                                                 "read-ahead, stale gate 1", "read-ahead, stale gate 2"]
    assert all(r["decode_tok_s"][0] > 0 for r in out["rows"])


def test_read_ahead_of_each_layers_own_experts_alone(folder, reference) -> None:
    from tandem.runtime.decode_step import why_not
    from tandem.runtime.loader import load_model

    loaded = load_model(folder, dtype="fp32", context=128, resident=False, readahead=True)
    d = loaded.model.dispatcher
    assert d.reading_ahead and d.predictor is None and "read ahead" in (why_not(loaded.model) or "")
    assert list(Engine(loaded.model, ()).generate(PROMPT, SamplingParams(max_new_tokens=NEW_TOKENS))) == reference
    assert d.readaheads >= NEW_TOKENS * len(d.moe_layers)  # every layer's experts, every token
    loaded.model.close()
    off = load_model(folder, dtype="fp32", context=128, resident=False)
    assert not off.model.dispatcher.reading_ahead  # asked for only
    off.model.close()


@pytest.mark.cuda
@pytest.mark.skipif(not cuda_usable(), reason="no CUDA GPU here")
@pytest.mark.parametrize("strategy", [Strategy.CPU, Strategy.FETCH])
def test_on_a_gpu_prefetch_copies_guesses_and_the_logits_are_the_cpus(  # pragma: no cover - no GPU on test machines
        folder, strategy: Strategy) -> None:
    """The stale gate's guesses copied ahead on a real GPU's copy engine (scripts/gpu-check.sh runs `pytest -m
    cuda`): half the experts in slots, a prompt and then tokens one by one against the CPU's float32 logits (a GPU's
    sums fall in another order: a tolerance, not tokens), prefetches made and some used."""
    from tandem.runtime.accelerator import CudaAccelerator

    cpu = engine_for(folder).model
    policy = OffloadOptions(strategy=strategy, cache_ways=4, prefetch=PrefetchOptions(PredictorKind.STALE_GATE, 2))
    gpu = engine_for(folder, CudaAccelerator(quarter_budget(folder, 16)), policy).model  # type: ignore[arg-type]
    d = gpu.dispatcher
    assert d.prefetching and d.cache.slots == 16
    ids = torch.tensor([PROMPT * 4])
    want = cpu.forward(ids, 0)
    got = torch.cat([gpu.forward(ids[:, :24], 0)] + [gpu.forward(ids[:, p : p + 1], p) for p in range(24, 32)], dim=1)
    assert (got.cpu() - want[:, : got.shape[1]]).abs().max().item() <= 1e-3 * max(1.0, want.abs().max().item())
    d.cache.wait_all()
    assert d.cache.stats.prefetches > 0 and d.cache.stats.prefetch_used > 0
    gpu.close()
