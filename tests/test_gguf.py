"""GGUF files as models: every MoE architecture Tandem reads, written as llama.cpp's converter writes them
(tests/ggufs.py), runs exactly as the checkpoint it came from; quantized tensors are read as their dequantized
values; split files open from any part; what cannot be read is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from tandem.app.cli import main
from tandem.autotune.configure import load_model
from tandem.kernels.errors import CheckpointError, UnsupportedModelError
from tandem.runtime.checkpoint import open_checkpoint
from tests.conftest import build_hf_checkpoint
from tests.ggufs import write_gguf

pytestmark = pytest.mark.isa  # F16 and float32 weights run on the kernels: again under every CPU feature mask

READ = ["mixtral", "mixtral-tied", "qwen3_moe", "qwen3_moe-dense-bias", "qwen2_moe-shared", "qwen2_moe-dense-noshared",
        "olmoe"]
IDS = torch.randint(0, 500, (1, 13), generator=torch.Generator().manual_seed(1))


def logits(model: Path) -> torch.Tensor:
    return load_model(model, dtype="fp32").model.forward(IDS, 0)


def generate(model: Path, capsys: pytest.CaptureFixture[str]) -> dict:
    assert main(["generate", "--model", str(model), "--prompt", "The quick brown fox", "--chat", "--max-new-tokens",
                 "8", "--dtype", "fp32", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("case", READ)
def test_a_gguf_file_runs_as_the_checkpoint_it_came_from(hf_checkpoints: dict[str, Path], tmp_path: Path, case: str,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    folder = hf_checkpoints[case]
    file = tmp_path / f"{case}.gguf"
    write_gguf(folder, file)
    assert torch.equal(logits(file), logits(folder))
    # the tokenizer and chat template come from the file's metadata: the same prompt, the same tokens
    ours, theirs = generate(file, capsys), generate(folder, capsys)
    assert ours["prompt_tokens"] == theirs["prompt_tokens"] and ours["tokens"] == theirs["tokens"]


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen3-MoE whose rows are whole K-quant blocks (256 values)."""
    return build_hf_checkpoint(tmp_path_factory.mktemp("wide") / "hf", "qwen3_moe", {
        "hidden_size": 256, "moe_intermediate_size": 256, "head_dim": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2})


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "MXFP4", "F16"])
def test_quantized_tensors_are_read_as_their_dequantized_values(wide: Path, tmp_path: Path, qtype: str) -> None:
    """The same weights as an F32 file: the same logits, bit for bit for the block formats (dequantized to float32,
    they run on the float32 kernels as the F32 file does). F16 experts stay F16 and run on the kernels' F16 path,
    whose sums may be grouped differently (AVX2's compiled loops): equal to float32 rounding."""
    held = write_gguf(wide, tmp_path / "q.gguf", qtype)
    write_gguf(wide, tmp_path / "f.gguf", "F32", given=held)
    kinds = {t.tensor_type.name for t in gguf.GGUFReader(str(tmp_path / "q.gguf")).tensors}
    assert qtype in kinds  # the experts, attention and lm_head are stored so
    got, want = logits(tmp_path / "q.gguf"), logits(tmp_path / "f.gguf")
    if qtype == "F16":
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(got, want)


def test_a_split_model_opens_from_any_part_and_a_missing_part_is_named(mixtral_dir: Path, tmp_path: Path) -> None:
    write_gguf(mixtral_dir, tmp_path / "m.gguf", split_max_tensors=8)
    parts = sorted(tmp_path.glob("m-*-of-*.gguf"))
    assert len(parts) > 2
    assert torch.equal(logits(parts[1]), logits(mixtral_dir))
    parts[-1].unlink()
    with pytest.raises(CheckpointError, match=f"{parts[-1].name} is missing"):
        open_checkpoint(parts[0])


def test_files_tandem_cannot_read_are_refused_by_name(wide: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    write_gguf(wide, tmp_path / "q2.gguf", "Q2_K")
    with pytest.raises(UnsupportedModelError, match="stored as Q2_K, a GGUF type Tandem does not read yet"):
        open_checkpoint(tmp_path / "q2.gguf")
    for arch, experts, says in (("bert", 0, "architecture 'bert' is not one Tandem reads"),
                                ("llama", 0, "dense llama model")):
        path = tmp_path / f"{arch}.gguf"
        writer = gguf.GGUFWriter(str(path), arch)
        writer.add_block_count(1)
        writer.add_expert_count(experts)
        writer.add_tensor("token_embd.weight", np.zeros((32, 8), dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        capsys.readouterr()
        assert main(["generate", "--model", str(path), "--prompt", "hi"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and says in err and "Traceback" not in err


def test_the_memory_estimate_counts_experts_dequantized_at_load(wide: Path, tmp_path: Path) -> None:
    from tandem.runtime.memory import estimate_memory

    write_gguf(wide, tmp_path / "q.gguf", "Q8_0")
    write_gguf(wide, tmp_path / "f.gguf", "F32")
    ram = {kind: estimate_memory(open_checkpoint(tmp_path / f"{kind}.gguf"), torch.float32, 64).weights
           for kind in ("q", "f")}
    cfg = open_checkpoint(tmp_path / "q.gguf").config
    experts = cfg.num_moe_layers * cfg.num_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4
    assert ram["q"] - ram["f"] == experts  # F32 experts stay in the memory map; Q8_0 ones become float32 copies
