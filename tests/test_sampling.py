"""Sampling matches transformers' logits processors; seeds reproduce; greedy is argmax."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tandem.kernels.errors import GenerationError
from tandem.runtime.sampling import SamplingParams, next_token, process_logits


def _hf_process(logits: torch.Tensor, params: SamplingParams, history: torch.Tensor) -> torch.Tensor:
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    procs = LogitsProcessorList()
    if params.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(params.repetition_penalty))
    procs.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k:
        procs.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        procs.append(TopPLogitsWarper(params.top_p))
    return procs(history[None], logits[None].clone())[0]


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    temperature=st.floats(0.1, 2.0),
    top_k=st.sampled_from([0, 1, 5, 40]),
    top_p=st.sampled_from([1.0, 0.95, 0.5, 0.1]),
    penalty=st.sampled_from([1.0, 1.1, 1.5]),
)
def test_processing_matches_transformers(seed: int, temperature: float, top_k: int, top_p: float,
                                         penalty: float) -> None:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(100, generator=g) * 3
    history = torch.randint(0, 100, (12,), generator=g)
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=penalty)
    ours = process_logits(logits, params, history)
    ref = _hf_process(logits, params, history)
    assert torch.equal(torch.isinf(ours), torch.isinf(ref))
    finite = ~torch.isinf(ref)
    assert torch.allclose(ours[finite], ref[finite], atol=1e-5)


def test_greedy_is_argmax_after_repetition_penalty() -> None:
    logits = torch.tensor([1.0, 3.0, 2.9, -1.0])
    gen = torch.Generator()
    assert next_token(logits, SamplingParams(), torch.tensor([0]), gen) == 1
    assert next_token(logits, SamplingParams(repetition_penalty=2.0), torch.tensor([1]), gen) == 2


def test_seed_reproduces_and_samples_vary() -> None:
    logits = torch.zeros(1000)
    params = SamplingParams(temperature=1.0)
    a = [next_token(logits, params, torch.tensor([]).long(), torch.Generator().manual_seed(7)) for _ in range(3)]
    b = [next_token(logits, params, torch.tensor([]).long(), torch.Generator().manual_seed(7)) for _ in range(3)]
    assert a == b
    gen = torch.Generator().manual_seed(7)
    draws = {next_token(logits, params, torch.tensor([]).long(), gen) for _ in range(20)}
    assert len(draws) > 10


def test_top_k_one_is_greedy() -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    picks = {next_token(logits, SamplingParams(temperature=5.0, top_k=1), torch.tensor([]).long(), gen)
             for _ in range(10)}
    assert picks == {int(logits.argmax())}


@pytest.mark.parametrize("bad", [
    {"temperature": -1.0}, {"top_k": -2}, {"top_p": 0.0}, {"top_p": 1.5}, {"repetition_penalty": 0.0},
    {"max_new_tokens": -1},
])
def test_invalid_params_are_explained(bad: dict) -> None:
    with pytest.raises(GenerationError):
        SamplingParams(**bad).check()


# --- extreme settings and damaged models ---------------------------------------------------------------------


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1e-40), SamplingParams(temperature=5e-324), SamplingParams(temperature=1e-30),
    SamplingParams(temperature=1, repetition_penalty=1e-40), SamplingParams(temperature=1, repetition_penalty=5e-324),
    SamplingParams(temperature=1, repetition_penalty=1e300), SamplingParams(temperature=1e-40, top_k=3, top_p=0.5),
    SamplingParams(temperature=5e-324, repetition_penalty=5e-324, top_p=0.9),
    SamplingParams(temperature=1e300), SamplingParams(temperature=1e300, top_p=0.1),
])
def test_every_finite_setting_samples_a_token(params: SamplingParams) -> None:
    # a temperature so small that logits / T overflows acts as greedy; a penalty that overflows a score clamps it
    logits = torch.tensor([1.0, 3.0, 0.0, -2.0, 2.5, -1e30, 1e30])
    history = torch.tensor([0, 2, 3, 6])
    params.check()
    token = next_token(logits, params, history, torch.Generator().manual_seed(0))
    assert 0 <= token < logits.numel()
    if params.temperature < 1e-20 and params.repetition_penalty == 1.0:
        assert token == 6  # the largest score, as greedy would choose


def test_tiny_temperature_is_greedy() -> None:
    logits = torch.tensor([0.5, 2.0, 1.999, -3.0])
    gen = torch.Generator().manual_seed(3)
    assert {next_token(logits, SamplingParams(temperature=1e-40), torch.tensor([]).long(), gen)
            for _ in range(20)} == {1}


@pytest.fixture(scope="module")
def damaged_model(tmp_path_factory: pytest.TempPathFactory):
    """A tiny model whose output layer holds NaN (damaged weights) and one whose output layer overflows to inf."""
    from safetensors.torch import load_file, save_file

    from tandem.runtime.synth import tiny_config, write_test_model

    made = {}
    for kind, value in (("nan", float("nan")), ("inf", float("inf"))):
        folder = write_test_model(tmp_path_factory.mktemp(kind) / "mixtral", tiny_config("mixtral"))
        for shard in folder.glob("*.safetensors"):
            tensors = load_file(shard)
            if "lm_head.weight" in tensors:
                tensors["lm_head.weight"] = torch.full_like(tensors["lm_head.weight"], value)
                save_file(tensors, shard, metadata={"format": "pt"})
        made[kind] = folder
    return made


@pytest.mark.parametrize("kind", ["nan", "inf"])
@pytest.mark.parametrize("how", [[], ["--temperature", "1", "--seed", "1"], ["--beams", "2"],
                                 ["--temperature", "0.7", "--top-p", "0.9", "--repetition-penalty", "1.3"]])
def test_damaged_weights_end_in_an_error(damaged_model, capsys, kind: str, how: list[str]) -> None:
    from tandem.app.cli.main import main

    code = main(["generate", "--model", str(damaged_model[kind]), "--dtype", "fp32", "--max-new-tokens", "3",
                 *how, "hello"])
    captured = capsys.readouterr()
    assert code == 2, captured
    last = captured.err.splitlines()[-1]
    assert last.startswith("error: the model produced NaN or infinite scores at token 1") and "damaged" in last
    assert "Traceback" not in captured.err and captured.out.strip() == ""
