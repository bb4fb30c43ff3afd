"""`--quant q8_0` / `--quant q4_k`: a checkpoint's experts quantized to GGUF's block formats once, kept in a cache
file keyed by the checkpoint and memory-mapped from it on later loads."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tandem.app.cli.main import main
from tandem.runtime.loader import load_model
from tandem.runtime.moe import BlockExpert
from tandem.runtime.quant_cache import cache_path
from tests.conftest import build_hf_checkpoint

IDS = torch.randint(0, 500, (1, 9), generator=torch.Generator().manual_seed(2))


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_hf_checkpoint(tmp_path_factory.mktemp("wide") / "hf", "qwen3_moe", {
        "hidden_size": 256, "moe_intermediate_size": 256, "head_dim": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2})


@pytest.mark.parametrize("quant, drift", [("q8_0", 0.01), ("q4_k", 0.15)])
def test_experts_are_quantized_once_and_read_from_the_cache_after(wide: Path, quant: str, drift: float,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    steps: list[str] = []
    first = load_model(wide, dtype="fp32", quant=quant, progress=lambda m, f: steps.append(m))
    assert any("quantizing the experts" in s for s in steps)
    experts = first.model.layers[0].ffn.experts  # type: ignore[union-attr]
    assert all(isinstance(e, BlockExpert) and e.formats == (quant.upper(),) * 2 for e in experts)
    path = cache_path(first.checkpoint, quant)
    assert path.is_file()
    got = first.model.forward(IDS, 0)
    want = load_model(wide, dtype="fp32").model.forward(IDS, 0)
    assert ((got - want).norm() / want.norm()).item() < drift  # quantization error, not a wrong layout
    import tandem.runtime.quant_cache as quant_cache

    monkeypatch.setattr(quant_cache, "quantize", lambda *a: pytest.fail("quantized again"))
    steps.clear()
    again = load_model(wide, dtype="fp32", quant=quant, progress=lambda m, f: steps.append(m))
    assert torch.equal(again.model.forward(IDS, 0), got) and not any("quantizing" in s for s in steps)


def test_a_changed_checkpoint_gets_a_new_cache_file(wide: Path, tmp_path: Path) -> None:
    from tests.conftest import copy_checkpoint

    folder = copy_checkpoint(wide, tmp_path / "m")
    before = cache_path(load_model(folder, dtype="fp32", quant="q8_0").checkpoint, "q8_0")
    shard = next(folder.glob("*.safetensors"))
    os.utime(shard, ns=(shard.stat().st_atime_ns, shard.stat().st_mtime_ns + 10**9))
    after = cache_path(load_model(folder, dtype="fp32", quant="q8_0").checkpoint, "q8_0")
    assert before != after and before.is_file() and after.is_file()


def test_widths_that_are_not_whole_blocks_are_refused_with_the_format_that_fits(
        mixtral_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", str(mixtral_dir), "--quant", "q4_k", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err
    assert "q4_k takes blocks of 256 values" in err and "--quant" in err


@pytest.mark.parametrize("family", ["granitemoeshared", "llama4_text"])
@pytest.mark.parametrize("quant, drift", [("q8_0", 0.01), ("int8", 0.01)])
def test_experts_stored_stacked_quantize_as_any_others(tmp_path: Path, family: str, quant: str, drift: float) -> None:
    """Granite's experts (gate and up rows stacked) and Llama 4's (stored as x @ W) quantize expert by expert, to the
    cache's blocks or the kernels' int8, as per-expert checkpoints do: within quantization error of the float run."""
    folder = build_hf_checkpoint(tmp_path / "hf", family, {"intermediate_size": 64, "num_hidden_layers": 2})
    model = load_model(folder, dtype="fp32", quant=quant).model
    moe = model.layers[model.cfg.sparse_layers.index(True)].ffn
    if quant == "q8_0":  # blocks of the cache file
        assert all(isinstance(e, BlockExpert) for e in moe.experts)  # type: ignore[union-attr]
    else:  # the kernels' own int8 copies
        assert {e.kind for e in model.dispatcher.cpu_experts[model.cfg.sparse_layers.index(True)]} == {"int8"}
    got = model.forward(IDS, 0)
    want = load_model(folder, dtype="fp32").model.forward(IDS, 0)
    assert 0 < ((got - want).norm() / want.norm()).item() < drift
