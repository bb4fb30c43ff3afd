"""The generator API: stopping rules, context limits, stats, and cached decode = full recompute."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.kernels.errors import GenerationError
from tandem.runtime.engine import Engine, GenerationStats
from tandem.runtime.loader import load_model
from tandem.runtime.sampling import SamplingParams


@pytest.fixture
def engine(mixtral_dir: Path) -> Engine:
    return load_model(mixtral_dir, dtype="fp32", context=64).engine


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
    loaded = load_model(mixtral_dir, dtype="fp32", context=64)
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


def test_resident_weights_give_the_same_tokens_and_are_counted(mixtral_dir: Path) -> None:
    from tandem.kernels.experts import CpuOptions
    from tandem.runtime.checkpoint import open_checkpoint
    from tandem.runtime.memory import estimate_memory

    prompt = [5, 9, 13, 2, 7]
    params = SamplingParams(max_new_tokens=12)
    mapped = load_model(mixtral_dir, dtype="bf16", context=64, resident=False)
    resident = load_model(mixtral_dir, dtype="bf16", context=64, resident=True)
    assert list(resident.engine.generate(prompt, params)) == list(mapped.engine.generate(prompt, params))
    expert = resident.model.dispatcher.cpu_experts[0][0]
    source = resident.checkpoint.tensor("model.layers.0.block_sparse_moe.experts.0.w1.weight")
    assert expert.gate.data_ptr() != source.data_ptr() and torch.equal(expert.gate, source)  # a copy in RAM
    assert resident.model.lm_head.data_ptr() != resident.checkpoint.tensor("lm_head.weight").data_ptr()
    ckpt = open_checkpoint(mixtral_dir)
    cfg = ckpt.config
    extra = (estimate_memory(ckpt, torch.bfloat16, 64, cpu=CpuOptions(resident=True)).weights
             - estimate_memory(ckpt, torch.bfloat16, 64).weights)
    stored = ckpt.dtype("model.layers.0.block_sparse_moe.experts.0.w1.weight").itemsize  # copies keep the file's dtype
    assert stored == 4  # the test checkpoint is float32: twice what the bf16 compute dtype would suggest
    assert extra == cfg.num_moe_layers * cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size * stored


def test_a_wider_cache_shares_the_weights(engine: Engine) -> None:
    wide = engine.model.with_batch(3)
    assert wide.cache.k[0].shape[0] == 3 and wide.dispatcher is engine.model.dispatcher
    assert wide.lm_head is engine.model.lm_head
    beams = list(Engine(wide, ()).generate([1, 2, 3], SamplingParams(max_new_tokens=5, beams=3)))
    assert len(beams) == 5


def reference_beam_search(engine: Engine, prompt: list[int], beams: int, steps: int, eos: set[int]) -> list[int]:
    """Beam search by recomputing every hypothesis from scratch (no KV cache rows to reorder)."""
    alive: list[tuple[float, list[int]]] = [(0.0, [])]
    finished: list[tuple[float, list[int]]] = []
    for _ in range(steps):
        candidates = []
        for score, toks in alive:
            logp = torch.log_softmax(engine.model.forward(torch.tensor([prompt + toks]), 0)[0, -1], -1)
            candidates += [(score + float(v), toks, t) for t, v in enumerate(logp.tolist())]
        candidates.sort(key=lambda c: -c[0])
        nxt: list[tuple[float, list[int]]] = []
        for score, toks, t in candidates[: 2 * beams]:
            if t in eos:
                finished.append((score / max(1, len(toks)), toks))
            elif len(nxt) < beams:
                nxt.append((score, toks + [t]))
        if len(finished) >= beams or not nxt:
            break
        alive = nxt
    pool = finished + [(s / len(t), t) for s, t in alive if t]
    return max(pool, key=lambda c: c[0])[1]


@pytest.mark.parametrize("eos", [set(), {7, 11, 23}])
def test_beam_search_equals_recomputing_every_hypothesis(mixtral_dir: Path, eos: set[int]) -> None:
    # Beams move between KV cache rows (a row keeps its first continuation, others are copied in): the result
    # must be what searching without any cache gives.
    loaded = load_model(mixtral_dir, dtype="fp32", context=64, batch=4)
    prompt = [3, 14, 15, 92]
    got = list(Engine(loaded.model, eos).generate(prompt, SamplingParams(max_new_tokens=8, beams=4)))
    assert got == reference_beam_search(loaded.engine, prompt, 4, 8, eos)


def test_float32_compute_keeps_bf16_matrices_as_stored(tmp_path: Path) -> None:
    # The kernels multiply float32 activations by bf16 rows exactly as by a float32 copy: the matrices stay bf16
    # (half the bytes to stream and hold), the rest (norms, dense MLPs) is converted, and the RAM estimate agrees.
    from tandem.kernels.experts import CpuOptions
    from tandem.kernels.library import library
    from tandem.runtime.checkpoint import open_checkpoint
    from tandem.runtime.memory import estimate_memory
    from tandem.runtime.synth import tiny_config, write_test_model

    if library() is None:
        pytest.skip("the compiled kernels are not built on this machine")
    folder = write_test_model(tmp_path / "m", tiny_config("qwen2_moe", hidden_size=64, num_hidden_layers=3,
                                                          decoder_sparse_step=2), dtype=torch.bfloat16)
    kept = load_model(folder, dtype="fp32", context=64)
    converted = load_model(folder, dtype="fp32", context=64, use_kernel=False)
    model = kept.model
    assert model.lm_head.dtype == model.embed.dtype == model.layers[0].attn.qkv.dtype == torch.bfloat16
    assert model.layers[1].ffn.router.dtype == torch.bfloat16 and model.layers[0].input_norm.dtype == torch.float32
    assert model.layers[0].ffn.gate.dtype == torch.float32  # a dense layer's MLP: converted
    assert converted.model.lm_head.dtype == converted.model.layers[0].attn.qkv.dtype == torch.float32
    ids = torch.tensor([[5, 9, 13, 2, 7, 11, 3]])
    want = converted.model.forward(ids, 0)
    assert (model.forward(ids, 0) - want).abs().max() < 1e-4 * want.abs().max()
    ckpt = open_checkpoint(folder)
    saved = (estimate_memory(ckpt, torch.float32, 64, cpu=CpuOptions(use_kernel=False)).weights
             - estimate_memory(ckpt, torch.float32, 64).weights)
    halved = sum(t.numel() * 2 for t in (model.embed, model.lm_head, model.layers[1].ffn.router)) + sum(
        (layer.attn.qkv.numel() + layer.attn.o.numel()) * 2 for layer in model.layers)
    assert saved == halved
