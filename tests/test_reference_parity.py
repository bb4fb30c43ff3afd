"""Tandem's decoder against transformers on tiny random checkpoints of every family (fp32). Marked `isa`: run again
under every CPU feature mask this machine can play (tests/run_masks.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tandem.app.cli.main import main
from tandem.runtime.loader import load_model
from tests.conftest import CASES

pytestmark = pytest.mark.isa
TOL = 1e-4


def _hf(folder: Path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_logits_match_transformers_prefill_and_decode(hf_checkpoints: dict[str, Path], case: str) -> None:
    from transformers import DynamicCache

    folder = hf_checkpoints[case]
    ours = load_model(folder, dtype="fp32").model
    ref = _hf(folder)
    ids = torch.randint(0, ours.cfg.vocab_size, (1, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        cache = DynamicCache(config=ref.config)
        out = ref(ids, past_key_values=cache, use_cache=True)
        got = ours.forward(ids, 0)
        assert got.shape == out.logits.shape
        assert (got - out.logits).abs().max().item() <= TOL
        pos = ids.shape[1]
        token = out.logits[:, -1:].argmax(-1)  # [1, 1]
        for _ in range(16):
            out = ref(token, past_key_values=cache, use_cache=True)
            got = ours.forward(token, pos)
            assert (got - out.logits).abs().max().item() <= TOL
            pos += 1
            token = out.logits[:, -1:].argmax(-1)


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_greedy_generate_cli_matches_transformers(
    hf_checkpoints: dict[str, Path], case: str, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = hf_checkpoints[case]
    code = main(["generate", "--model", str(folder), "--prompt", "The quick brown fox", "--max-new-tokens", "32",
                 "--dtype", "fp32", "--json"])
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    ref = _hf(folder)
    prompt = torch.tensor([result["prompt_tokens"]])
    with torch.no_grad():
        expected = ref.generate(prompt, max_new_tokens=32, do_sample=False, eos_token_id=2, pad_token_id=0)
    expected = expected[0, prompt.shape[1] :].tolist()
    if expected and expected[-1] == 2:  # transformers includes the EOS token; Tandem stops before it
        expected = expected[:-1]
    assert result["tokens"] == expected
    assert result["stats"]["new_tokens"] == len(expected) > 0


def test_chunked_prefill_matches_one_pass(mixtral_dir: Path) -> None:
    """A prompt fed in two chunks (cached prefix + several new tokens) gives the same logits."""
    model = load_model(mixtral_dir, dtype="fp32").model
    ids = torch.randint(0, model.cfg.vocab_size, (1, 20), generator=torch.Generator().manual_seed(3))
    whole = model.forward(ids, 0)
    first = model.forward(ids[:, :12], 0)
    second = model.forward(ids[:, 12:], 12)
    assert torch.allclose(torch.cat([first, second], 1), whole, atol=1e-5)


def test_bf16_runs_close_to_fp32(mixtral_dir: Path) -> None:
    ids = torch.randint(0, 512, (1, 8), generator=torch.Generator().manual_seed(4))
    fp32 = load_model(mixtral_dir, dtype="fp32").model.forward(ids, 0)
    bf16 = load_model(mixtral_dir, dtype="bf16").model.forward(ids, 0)
    assert bf16.dtype == torch.float32
    assert (bf16 - fp32).abs().max().item() < 0.15 * fp32.abs().max().item()


def test_a_whole_gemma4_folder_runs_its_text_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Gemma 4 as published: the whole model (`gemma4`, its text model's config in text_config and its tensors
    under model.language_model.; here without towers) opens as its text model, with transformers' logits, and
    `tandem models` lists it as Gemma 4."""
    import transformers

    from tandem.runtime.synth import tiny_config, write_tokenizer

    raw = tiny_config("gemma4_text", num_hidden_layers=3,
                      layer_types=["sliding_attention", "full_attention", "full_attention"])
    text = transformers.AutoConfig.for_model(**raw)
    torch.manual_seed(0)
    ref = transformers.Gemma4ForConditionalGeneration(transformers.Gemma4Config(text_config=text.to_dict()))
    with torch.no_grad():
        for name, p in ref.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.08 * torch.randn_like(p))
    folder = tmp_path / "models" / "gemma-4-tiny"
    ref.save_pretrained(folder)
    write_tokenizer(folder, raw["vocab_size"])
    ours = load_model(folder, dtype="fp32").model
    ids = torch.randint(0, raw["vocab_size"], (1, 11), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = ref.eval()(input_ids=ids).logits
    assert (ours.forward(ids, 0) - want).abs().max().item() <= TOL
    assert main(["models", "--models-dir", str(tmp_path / "models"), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(m["name"], m["family"]) for m in listed] == [("gemma-4-tiny", "Gemma 4")]
