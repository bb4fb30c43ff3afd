"""The hybrids' token mixers with a recurrent state (Gated DeltaNet: runtime/deltanet.py, short convolutions:
runtime/shortconv.py, Mamba-2: runtime/mamba2.py) and their state (runtime/state.py): each prompt path against its
reference, whole models against transformers on prompts longer than a block, and everything that keeps a cache row
(prefix reuse and its marks, beams, batch rows, the prefix store, the emulated accelerator) against the same prompt
run whole (fp32, greedy)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from tandem.runtime import mamba2, shortconv
from tandem.runtime.accelerator import cuda_usable
from tandem.runtime.batch import BatchEngine, BatchRequest, DoneEvent
from tandem.runtime.deltanet import chunked, l2_normed, recurrent_reference, step
from tandem.runtime.engine import Engine, GenerationStats
from tandem.runtime.layers import cache_class
from tandem.runtime.loader import load_model
from tandem.runtime.prefix import PrefixStore
from tandem.runtime.sampling import SamplingParams
from tandem.runtime.state import LayerCaches, NoStateError, StateCache

GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)
HYBRIDS = ["qwen3_next", "qwen3_next-dense-bias", "qwen3_5_moe_text", "lfm2_moe", "lfm2_moe-bias-scaled",
           "granitemoehybrid", "granitemoehybrid-rope-bias"]
ONE_OF_EACH = ["qwen3_next", "lfm2_moe", "granitemoehybrid"]  # a model of each mixer
LONG = [(i * 37 + 11) % 500 + 3 for i in range(150)]  # longer than two blocks of the prompt path (64)


def _inputs(B: int, H: int, T: int, dk: int, dv: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q = l2_normed(torch.randn(B, H, T, dk, generator=gen)) * dk ** -0.5
    k = l2_normed(torch.randn(B, H, T, dk, generator=gen))
    v = torch.randn(B, H, T, dv, generator=gen)
    g = -torch.rand(B, H, T, generator=gen) * 2  # decays from 1 down to e^-2
    beta = torch.rand(B, H, T, generator=gen)
    state = torch.randn(B, H, dk, dv, generator=gen) * 0.3
    return q, k, v, g, beta, state


@pytest.mark.parametrize("T, size", [(150, 64), (37, 16), (5, 64), (64, 64)])
def test_the_prompt_path_is_the_rule_token_by_token(T: int, size: int) -> None:
    q, k, v, g, beta, state = _inputs(2, 3, T, 16, 8, seed=T)
    want, want_state = recurrent_reference(q, k, v, g, beta, state)
    got, got_state = chunked(q, k, v, g, beta, state, size)
    assert (got - want).abs().max().item() < 1e-4
    assert (got_state - want_state).abs().max().item() < 1e-4


def test_one_token_updates_the_state_in_place_as_the_rule() -> None:
    q, k, v, g, beta, state = _inputs(2, 3, 1, 16, 8, seed=5)
    want, want_state = recurrent_reference(q, k, v, g, beta, state)
    kept = state.clone()
    got = step(q, k, v, g, beta, kept)
    assert torch.allclose(got, want, atol=1e-6) and torch.allclose(kept, want_state, atol=1e-6)


def _ssm_inputs(B: int, H: int, T: int, P: int, N: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, T, P, generator=gen)
    dt = torch.rand(B, H, T, generator=gen) * 0.5
    A = -torch.rand(H, generator=gen) * 3
    b, c = torch.randn(B, H, T, N, generator=gen), torch.randn(B, H, T, N, generator=gen)
    return x, dt, A, b, c, torch.randn(B, H, P, N, generator=gen) * 0.3


@pytest.mark.parametrize("T, size", [(150, 64), (37, 16), (5, 64), (64, 64)])
def test_mamba2s_prompt_path_is_the_recurrence(T: int, size: int) -> None:
    x, dt, A, b, c, state = _ssm_inputs(2, 3, T, 8, 16, seed=T)
    want, want_state = mamba2.recurrent_reference(x, dt, A, b, c, state)
    got, got_state = mamba2.chunked(x, dt, A, b, c, state, size)
    assert (got - want).abs().max().item() < 1e-4 and (got_state - want_state).abs().max().item() < 1e-4
    one = state.clone()
    first = mamba2.step(x[:, :, :1], dt[:, :, :1], A, b[:, :, :1], c[:, :, :1], one)
    assert torch.allclose(first, want[:, :, :1], atol=1e-5) or T == 0
    _, after_one = mamba2.recurrent_reference(x[:, :, :1], dt[:, :, :1], A, b[:, :, :1], c[:, :, :1], state)
    assert torch.allclose(one, after_one, atol=1e-6)


def test_short_convolutions_carry_their_state_across_passes() -> None:
    gen = torch.Generator().manual_seed(3)
    H, K = 8, 3
    w = shortconv.ShortConvWeights(torch.randn(3 * H, H, generator=gen), torch.randn(H, K, generator=gen),
                                   torch.randn(H, H, generator=gen), torch.randn(3 * H, generator=gen),
                                   torch.randn(H, generator=gen), torch.randn(H, generator=gen))
    x = torch.randn(2, 11, H, generator=gen)
    want = shortconv.reference(x, w)
    conv = torch.zeros(2, H, K - 1)
    parts = []
    for lo, hi in ((0, 4), (4, 5), (5, 11)):  # a prompt in two pieces, one token between
        p = torch.nn.functional.linear(x[:, lo:hi], w.proj, w.proj_bias)
        parts.append(torch.nn.functional.linear(shortconv.scan(w, p, conv), w.out, w.out_bias))
    assert torch.allclose(torch.cat(parts, dim=1), want, rtol=1e-5, atol=1e-4)  # (values of about 100)


@pytest.mark.parametrize("case", HYBRIDS)
def test_long_prompts_match_transformers_in_one_pass_and_in_two(hf_checkpoints: dict[str, Path], case: str) -> None:
    import transformers
    from transformers import DynamicCache

    folder = hf_checkpoints[case]
    ours = load_model(folder, dtype="fp32").model
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.tensor([LONG])
    with torch.no_grad():
        cache = DynamicCache(config=ref.config)
        out = ref(ids, past_key_values=cache, use_cache=True)
        assert (ours.forward(ids, 0) - out.logits).abs().max().item() <= 1e-4
        halves = torch.cat([ours.forward(ids[:, :70], 0), ours.forward(ids[:, 70:], 70)], dim=1)
        assert (halves - out.logits).abs().max().item() <= 1e-4  # (the state carried across passes)
        token, pos = out.logits[:, -1:].argmax(-1), ids.shape[1]
        for _ in range(6):
            out = ref(token, past_key_values=cache, use_cache=True)
            assert (ours.forward(token, pos) - out.logits).abs().max().item() <= 1e-4
            token, pos = out.logits[:, -1:].argmax(-1), pos + 1


@pytest.mark.parametrize("case", ONE_OF_EACH)
def test_a_row_has_no_state_where_no_pass_ended(hf_checkpoints: dict[str, Path], case: str) -> None:
    model = load_model(hf_checkpoints[case], dtype="fp32").model
    assert isinstance(model.cache, LayerCaches) and model.recurrent
    model.forward(torch.tensor([LONG[:20]]), 0)
    model.forward(torch.tensor([LONG[20:21]]), 20)  # (where the last pass ended: fine)
    with pytest.raises(NoStateError, match="position 10"):
        model.forward(torch.tensor([LONG[10:12]]), 10)
    model.forward(torch.tensor([LONG[:5]]), 0)  # (from the start: zeros, always fine)


@pytest.mark.parametrize("case", ONE_OF_EACH)
def test_the_marks_serve_a_retry_and_an_edited_last_message(
        hf_checkpoints: dict[str, Path], case: str) -> None:
    model = load_model(hf_checkpoints[case], dtype="fp32").model
    # (the whole prompt's answers from a model of their own: a pass from the start drops a row's marks)
    reusing, whole = Engine(model, (), reuse=True), Engine(load_model(hf_checkpoints[case], dtype="fp32").model, ())
    stats = GenerationStats()
    first = LONG[:40]
    answer = list(reusing.generate(first, GREEDY, stats))
    follow = first + answer + [9, 8, 7]  # the next turn: the state where the answer stopped
    assert list(reusing.generate(follow, GREEDY, stats)) == list(whole.generate(follow, GREEDY))
    assert stats.cached_tokens == len(first) + len(answer) - 1
    again = list(reusing.generate(follow, GREEDY, stats))  # a retry: the mark before its last token
    assert stats.cached_tokens == len(follow) - 1 and again == list(whole.generate(follow, GREEDY))
    edited = follow[:-1] + [55]  # its last token edited: the same mark
    got = list(reusing.generate(edited, GREEDY, stats))
    assert stats.cached_tokens == len(follow) - 1 and got == list(whole.generate(edited, GREEDY))
    message = follow[:-3] + [66, 66, 66]  # its last message edited: the mark where the turn began
    got = list(reusing.generate(message, GREEDY, stats))
    assert stats.cached_tokens == len(first) + len(answer) - 1 and got == list(whole.generate(message, GREEDY))
    earlier = follow[:30] + [1, 2, 3]  # further back than any mark: prefilled whole
    got = list(reusing.generate(earlier, GREEDY, stats))
    assert stats.cached_tokens == 0 and got == list(whole.generate(earlier, GREEDY))


@pytest.mark.parametrize("case", ONE_OF_EACH)
def test_beams_copy_the_state_with_the_row(hf_checkpoints: dict[str, Path], case: str) -> None:
    loaded = load_model(hf_checkpoints[case], dtype="fp32", batch=3)
    reusing, whole = Engine(loaded.model, (), reuse=True), Engine(loaded.model, ())
    beams = SamplingParams(max_new_tokens=6, beams=3)
    answer = list(reusing.generate(LONG[:30], beams))
    assert answer == list(whole.generate(LONG[:30], beams))
    stats = GenerationStats()
    prompt = LONG[:30] + answer + [9, 9]
    got = list(reusing.generate(prompt, beams, stats))
    assert got == list(whole.generate(prompt, beams))
    # one sequence alone decodes as beams' first row does (the state per row, copied when beams branch)
    ref = load_model(hf_checkpoints[case], dtype="fp32")
    assert list(Engine(ref.model, ()).generate(prompt, GREEDY)) == list(whole.generate(prompt, GREEDY))


@pytest.mark.parametrize("case", ["qwen3_5_moe_text", "lfm2_moe-bias-scaled", "granitemoehybrid"])
def test_batch_rows_each_keep_their_state(hf_checkpoints: dict[str, Path], case: str) -> None:
    """Requests of different lengths in ragged passes (prompts in pieces, decodes beside prefills), reused rows and
    followers of a shared prefix: each answer is the one the engine gives it alone."""
    model = load_model(hf_checkpoints[case], dtype="fp32", batch=3).model
    system = LONG[:40]
    prompts = {"a": system + [1, 2], "b": LONG[60:75], "c": system + [3], "d": LONG[:9]}
    alone = Engine(load_model(hf_checkpoints[case], dtype="fp32").model, ())
    want = {k: list(alone.generate(p, GREEDY)) for k, p in prompts.items()}
    for reuse in (False, True):
        engine = BatchEngine(model, (), 3, step_tokens=16, reuse=reuse)
        done = {e.result.key: e.result.tokens for e in engine.run([BatchRequest(k, p, GREEDY)
                                                                   for k, p in prompts.items()])
                if isinstance(e, DoneEvent)}
        assert done == want, reuse
    follow = prompts["a"] + want["a"] + [6]
    again = [e.result for e in engine.run([BatchRequest("a2", follow, GREEDY)]) if isinstance(e, DoneEvent)][0]
    assert again.tokens == list(alone.generate(follow, GREEDY))


@pytest.mark.parametrize("case", ONE_OF_EACH)
def test_the_store_keeps_a_conversation_with_its_state(hf_checkpoints: dict[str, Path], case: str) -> None:
    """Two conversations on one row: the one overwritten is saved with its state and copied back for its next turn;
    a prompt that leaves such an entry before its end does not take it (its state is that of the end)."""
    model = load_model(hf_checkpoints[case], dtype="fp32", context=256).model
    store = PrefixStore(64 << 20)
    reusing, whole = Engine(model, (), reuse=True, store=store), Engine(model, ())
    a, b = LONG[:40], LONG[50:90]
    answer = list(reusing.generate(a, GREEDY))
    list(reusing.generate(b, GREEDY))
    assert len(store.entries) == 1
    stats = GenerationStats()
    follow = a + answer + [9, 8]
    assert list(reusing.generate(follow, GREEDY, stats)) == list(whole.generate(follow, GREEDY))
    assert stats.cached_tokens == len(a) + len(answer) - 1 and store.restored == stats.cached_tokens
    list(reusing.generate(b, GREEDY))  # (follow's row saved)
    part = follow[:30] + [4, 4]
    assert list(reusing.generate(part, GREEDY, stats)) == list(whole.generate(part, GREEDY))
    assert stats.cached_tokens == 0


@pytest.mark.parametrize("case", ONE_OF_EACH)
def test_the_emulated_accelerator_keeps_the_state_there(hf_checkpoints: dict[str, Path], case: str) -> None:
    folder = hf_checkpoints[case]
    cpu = Engine(load_model(folder, dtype="fp32").model, ())
    model = load_model(folder, dtype="fp32", context=256, accelerator="emulated", vram_gb=0.004).model
    assert model.accel is not None
    reusing = Engine(model, (), reuse=True)
    answer = list(reusing.generate(LONG[:70], GREEDY))
    assert answer == list(cpu.generate(LONG[:70], GREEDY))
    stats = GenerationStats()
    follow = LONG[:70] + answer + [5]
    assert list(reusing.generate(follow, GREEDY, stats)) == list(cpu.generate(follow, GREEDY))
    assert stats.cached_tokens == 70 + len(answer) - 1


@pytest.mark.cuda
@pytest.mark.skipif(not cuda_usable(), reason="no CUDA GPU here")
@pytest.mark.parametrize("case", ONE_OF_EACH)
def test_on_a_gpu_the_state_stays_there_and_the_logits_are_the_cpus(  # pragma: no cover - no GPU on test machines
        hf_checkpoints: dict[str, Path], case: str) -> None:
    """The accelerator tier on a real GPU (scripts/gpu-check.sh runs `pytest -m cuda`): the mixers and their state
    where the model runs, a prompt in two passes and then tokens one by one, against the CPU's float32 logits (a
    GPU's sums fall in another order: a tolerance, not tokens)."""
    folder = hf_checkpoints[case]
    cpu = load_model(folder, dtype="fp32").model
    gpu = load_model(folder, dtype="fp32", context=256, accelerator="cuda").model
    assert gpu.accel is not None
    ids = torch.tensor([LONG[:74]])
    want = cpu.forward(ids, 0)
    got = torch.cat([gpu.forward(ids[:, :40], 0), gpu.forward(ids[:, 40:70], 40)]
                    + [gpu.forward(ids[:, p : p + 1], p) for p in range(70, 74)], dim=1)
    assert (got - want).abs().max().item() <= 1e-3 * max(1.0, want.abs().max().item())


def test_bf16_stays_as_close_to_fp32_as_transformers_bf16(hf_checkpoints: dict[str, Path]) -> None:
    """Rounding to bf16 moves a random tiny model's logits a lot (its norms multiply by about 2): Tandem's bf16 stays
    within what transformers' own bf16 run moves, and picks fp32's top token about as often."""
    import transformers

    folder = hf_checkpoints["qwen3_5_moe_text"]
    ids = torch.tensor([LONG[:80]])
    fp32 = load_model(folder, dtype="fp32").model.forward(ids, 0)
    bf16 = load_model(folder, dtype="bf16").model.forward(ids, 0)
    with torch.no_grad():
        ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()(ids).logits
    ref = ref.float()
    assert (bf16 - fp32).abs().max().item() <= 1.5 * (ref - fp32).abs().max().item()
    agree = (bf16.argmax(-1) == fp32.argmax(-1)).float().mean().item()
    assert agree >= (ref.argmax(-1) == fp32.argmax(-1)).float().mean().item() - 0.1


@pytest.mark.parametrize("case, attends", [("qwen3_next-dense-bias", [0, 2]), ("lfm2_moe-bias-scaled", [0]),
                                           ("granitemoehybrid", [1])])
def test_the_memory_estimate_is_what_the_caches_hold(hf_checkpoints: dict[str, Path], case: str,
                                                     attends: list[int]) -> None:
    model = load_model(hf_checkpoints[case], dtype="fp32", batch=2, context=96).model
    cache = model.cache
    assert isinstance(cache, LayerCaches)
    held = sum(t.numel() * t.element_size() for part in cache.parts.values() for t in
               (part.tensors.values() if isinstance(part, StateCache) else
                [x for _, k, v in part.groups for x in (k, v)]))
    assert cache_class(model.cfg).nbytes(model.cfg, 2, 96, torch.float32) == held
    assert [i for i, k in enumerate(cache.k) if k is not None] == attends  # (attention's layers only)


def test_the_published_whole_model_folder_opens_its_text_model(hf_checkpoints: dict[str, Path],
                                                               tmp_path: Path) -> None:
    """Qwen3.5 as published: `qwen3_5_moe` with its text model under `text_config`, tensors under
    `model.language_model.`, each layer's experts stacked in two tensors; it answers as the text model's folder."""
    from safetensors.torch import load_file, save_file

    text = hf_checkpoints["qwen3_5_moe_text"]
    whole = tmp_path / "whole"
    whole.mkdir()
    raw = json.loads((text / "config.json").read_text())
    config = {"model_type": "qwen3_5_moe", "text_config": raw, "tie_word_embeddings": False,
              "vision_config": {"depth": 1}}
    (whole / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (whole / name).write_bytes((text / name).read_bytes())
    tensors = load_file(str(text / "model.safetensors"))
    out = {}
    for name, t in tensors.items():
        if name.startswith("model."):
            name = "model.language_model." + name.removeprefix("model.")
        out[name] = t
    for layer in range(raw["num_hidden_layers"]):
        p = f"model.language_model.layers.{layer}.mlp.experts"
        e = raw["num_experts"]
        gate = [out.pop(f"{p}.{i}.gate_proj.weight") for i in range(e)]
        up = [out.pop(f"{p}.{i}.up_proj.weight") for i in range(e)]
        down = [out.pop(f"{p}.{i}.down_proj.weight") for i in range(e)]
        out[f"{p}.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(gate, up, strict=True)])
        out[f"{p}.down_proj"] = torch.stack(down)
    out["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 4)  # (a tower, never read)
    save_file(out, str(whole / "model.safetensors"))
    ids = torch.tensor([LONG[:20]])
    want = load_model(text, dtype="fp32").model.forward(ids, 0)
    got = load_model(whole, dtype="fp32").model.forward(ids, 0)
    assert torch.equal(got, want)


@pytest.mark.isa
@pytest.mark.parametrize("case", ["qwen3_next", "qwen3_5_moe_text", "lfm2_moe-bias-scaled", "granitemoehybrid",
                                  "granitemoehybrid-rope-bias"])
def test_the_kernels_one_token_step_is_the_torch_step(hf_checkpoints: dict[str, Path], case: str) -> None:
    """kernels/recur.py against the torch step on the same state, token after token, for several rows at once (the
    widest variant this CPU plays under its feature mask: tests/run_masks.py runs the others)."""
    model = load_model(hf_checkpoints[case], dtype="fp32", batch=2).model
    assert model.recur_kernel
    prompt = torch.tensor([LONG[:30], LONG[40:70]])
    model.forward(prompt, 0)
    torch_step = copy.copy(model)
    torch_step.recur_kernel, torch_step.use_step = False, False
    parts = model.cache.parts
    for pos in range(30, 36):
        token = torch.tensor([[LONG[pos]], [LONG[pos + 40]]])
        saved = {kind: {name: t.clone() for name, t in part.tensors.items()} for kind, part in parts.items()
                 if isinstance(part, StateCache)}
        want = torch_step.forward(token, pos)
        for kind, tensors in saved.items():  # (the torch step's state put back for the kernel's)
            for name, t in tensors.items():
                parts[kind].tensors[name].copy_(t)
            parts[kind].at.fill_(pos)
        got = model.forward(token, pos)
        assert (got - want).abs().max().item() <= 1e-4 * max(1.0, want.abs().max().item())


def test_bench_kernels_times_the_mixers_of_the_hybrid_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    """`bench kernels --mixers`' rows: one token through the kernel and through torch, a prompt chunked, each against
    the roofline (the measurements stubbed: a test must not depend on the machine's speed)."""
    from tandem.autotune.bench import mixers

    monkeypatch.setattr(mixers, "dram_bandwidth", lambda threads, size: 10.0)
    monkeypatch.setattr(mixers, "compute_peak", lambda: {"bf16": 100.0})
    monkeypatch.setattr(mixers, "time_per_call", lambda fn, count, min_time: (fn(0), fn(count - 1), 2.0)[2])
    rows = mixers.bench_mixers(["lfm2-8b-a1b", "qwen3-30b-a3b"], 1, (1, 8), working_set=1)
    assert [(r["mixer"], r["tokens"], r["impl"]) for r in rows] == [
        ("shortconv", 1, "step"), ("shortconv", 1, "torch"), ("shortconv", 8, "chunked")]  # (Qwen3: no mixer)
    step = rows[0]
    assert step["latency_ms"] == 2.0 and step["moved_mb"] > 16  # (its two bf16 matrices: 3H x H and H x H)
    assert step["ratio"] == round(step["gbps"] / 10.0, 3) and rows[2]["per_token_ms"] == 0.25


def test_a_server_retry_and_an_edited_last_message_take_up_at_the_mark(hf_checkpoints: dict[str, Path]) -> None:
    """Batch mode (a server's rows) marks each prompt's state before its last token too: the same request again, or
    its last message edited, reuses all but that token, and answers as a fresh engine does."""
    model = load_model(hf_checkpoints["qwen3_next"], dtype="fp32", batch=2).model
    engine = BatchEngine(model, (), 2, step_tokens=16, reuse=True)

    def run(key: str, prompt: list[int]) -> tuple[list[int], int]:
        done = [e.result for e in engine.run([BatchRequest(key, prompt, GREEDY)]) if isinstance(e, DoneEvent)][0]
        return done.tokens, done.cached

    alone = Engine(load_model(hf_checkpoints["qwen3_next"], dtype="fp32").model, ())
    prompt = LONG[:40]
    first = run("a", prompt)
    again = run("b", prompt)
    assert again == (first[0], len(prompt) - 1)
    edited = prompt[:-1] + [7]
    assert run("c", edited) == (list(alone.generate(edited, GREEDY)), len(prompt) - 1)


def test_a_follower_takes_up_at_a_mark_when_its_leaders_state_is_past_the_share(
        hf_checkpoints: dict[str, Path]) -> None:
    """Requests join rows holding marks inside the system prompt they share; the leader's state ends past the share,
    so its copy brings keys and marks but not its state: the follower takes up at a mark both rows' tokens agree on
    and answers as the engine alone does."""
    model = load_model(hf_checkpoints["qwen3_next"], dtype="fp32", batch=2).model
    engine = BatchEngine(model, (), 2, step_tokens=16, reuse=True)
    system = LONG[:40]
    # both rows marked inside the system prompt (at 19 and 20): whichever row the follower joins holds one
    list(engine.run([BatchRequest("x", system[:20], GREEDY), BatchRequest("y", system[:20] + [5], GREEDY)]))
    prompts = {"a": system + [1, 2], "c": system + [3]}
    done = {e.result.key: e.result for e in engine.run([BatchRequest(k, p, GREEDY) for k, p in prompts.items()])
            if isinstance(e, DoneEvent)}
    alone = Engine(load_model(hf_checkpoints["qwen3_next"], dtype="fp32").model, ())
    assert {k: r.tokens for k, r in done.items()} == {k: list(alone.generate(p, GREEDY)) for k, p in prompts.items()}
    assert max(r.cached for r in done.values()) >= 19


def test_a_pass_that_fails_halfway_leaves_the_row_without_a_state(hf_checkpoints: dict[str, Path],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Some layers' state updated, then an error (an accelerator out of memory): the row claims no state, so no
    later pass takes up on the half-updated one, and a prompt from the start runs on zeros."""
    model = load_model(hf_checkpoints["qwen3_next-dense-bias"], dtype="fp32").model
    model.forward(torch.tensor([LONG[:20]]), 0)
    kinds = [k.mixer for k in model.plan]
    mixer = kinds[3]  # (the second DeltaNet layer: the first one's state is updated by then)
    monkeypatch.setattr(type(mixer), "forward", lambda *a, **k: (_ for _ in ()).throw(torch.OutOfMemoryError()))
    with pytest.raises(Exception, match="out of memory"):
        model.forward(torch.tensor([LONG[20:25]]), 20)
    monkeypatch.undo()
    with pytest.raises(NoStateError):
        model.forward(torch.tensor([LONG[20:25]]), 20)
    fresh = load_model(hf_checkpoints["qwen3_next-dense-bias"], dtype="fp32").model
    ids = torch.tensor([LONG[:25]])
    assert torch.equal(model.forward(ids, 0), fresh.forward(ids, 0))


def test_random_checkpoints_of_zero_centred_norms_multiply_by_about_one(tmp_path: Path) -> None:
    """make-bench-model and make-test-model store Qwen3-Next's and Qwen3.5's norms near 0 (they multiply by
    1 + weight), the Gated DeltaNet's own norm near 1 (it multiplies by its weight): as trained ones, not twice."""
    from tandem.runtime.checkpoint import open_checkpoint
    from tandem.runtime.synth import tiny_config, write_test_model

    ckpt = open_checkpoint(write_test_model(tmp_path / "m", tiny_config("qwen3_next")))
    assert abs(ckpt.tensor("model.layers.0.input_layernorm.weight").mean().item()) < 0.1
    assert abs(ckpt.tensor("model.norm.weight").mean().item()) < 0.1
    assert abs(ckpt.tensor("model.layers.1.self_attn.q_norm.weight").mean().item()) < 0.1
    assert abs(ckpt.tensor("model.layers.0.linear_attn.norm.weight").mean().item() - 1) < 0.1
