"""Every kind of bad input gives `error: <what and how to fix>`, exit status 2, and no traceback."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tandem.app.cli.main import main
from tandem.kernels.errors import CheckpointError, ResourceError
from tandem.runtime import memory
from tandem.runtime.checkpoint import open_checkpoint
from tandem.runtime.loader import load_model
from tandem.runtime.memory import MemoryEstimate, check_memory
from tandem.runtime.safetensors_mmap import SafetensorsFile
from tests.conftest import copy_checkpoint, edit_config


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(["generate", "--prompt", "hi", "--max-new-tokens", "2", *args])
    err = capsys.readouterr().err
    return code, err


def expect_error(capsys: pytest.CaptureFixture[str], folder: Path, *needles: str, extra: tuple[str, ...] = ()) -> str:
    code, err = run_cli(capsys, "--model", str(folder), *extra)
    assert code == 2
    assert err.startswith("error: ")
    assert "Traceback" not in err
    for needle in needles:
        assert needle in err, err
    return err


def test_nonexistent_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    expect_error(capsys, tmp_path / "nope", "does not exist")


def test_folder_without_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    expect_error(capsys, tmp_path, "no config.json")


def test_unsupported_model_type_lists_supported(mixtral_dir: Path, tmp_path: Path, capsys) -> None:
    folder = copy_checkpoint(mixtral_dir, tmp_path / "m")
    edit_config(folder, model_type="llama")
    expect_error(capsys, folder, "'llama' is not supported", "mixtral", "olmoe", "qwen2_moe", "qwen3_moe")


def test_index_naming_missing_shard(mixtral_dir: Path, tmp_path: Path, capsys) -> None:
    folder = copy_checkpoint(mixtral_dir, tmp_path / "m")
    names = SafetensorsFile(folder / "model.safetensors").names()
    index = {"weight_map": {n: ("model.safetensors" if i % 2 else "model-00002-of-00002.safetensors")
                            for i, n in enumerate(names)}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    expect_error(capsys, folder, "model-00002-of-00002.safetensors", "missing")


def test_truncated_safetensors(mixtral_dir: Path, tmp_path: Path, capsys) -> None:
    folder = copy_checkpoint(mixtral_dir, tmp_path / "m")
    shard = folder / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    expect_error(capsys, folder, "truncated", "model.safetensors")


@pytest.mark.parametrize("garbage", [b"", b"\x01\x00", b"\xff" * 64, (12).to_bytes(8, "little") + b"not json!!!!"])
def test_corrupt_safetensors(mixtral_dir: Path, tmp_path: Path, capsys, garbage: bytes) -> None:
    folder = copy_checkpoint(mixtral_dir, tmp_path / "m")
    (folder / "model.safetensors").write_bytes(garbage)
    expect_error(capsys, folder, "not a valid safetensors file")


def test_tensor_shape_disagrees_with_config(mixtral_dir: Path, tmp_path: Path, capsys) -> None:
    folder = copy_checkpoint(mixtral_dir, tmp_path / "m")
    edit_config(folder, intermediate_size=100)
    expect_error(capsys, folder, "shape", "do not belong together")


def test_missing_tensor(mixtral_dir: Path, tmp_path: Path, capsys) -> None:
    folder = copy_checkpoint(mixtral_dir, tmp_path / "m")
    edit_config(folder, num_hidden_layers=3)
    expect_error(capsys, folder, "model.layers.2.", "incomplete")


def test_pickle_only_checkpoint_is_refused(mixtral_dir: Path, tmp_path: Path, capsys) -> None:
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_bytes((mixtral_dir / "config.json").read_bytes())
    canary = tmp_path / "unpickled"
    # A pickle that would create a file if anything ever unpickled it.
    (folder / "pytorch_model.bin").write_bytes(
        b"cos\nsystem\n(S'touch " + str(canary).encode() + b"'\ntR."
    )
    expect_error(capsys, folder, "pickle", "safetensors")
    assert not canary.exists()


# The folder's own code: a module that would leave a file behind if anything imported it.
CANARY_MODULE = "import pathlib\npathlib.Path(__file__).with_name('IMPORTED').touch()\n"


def test_auto_map_of_a_known_model_type_is_ignored(mixtral_dir: Path, tmp_path: Path, capsys) -> None:
    """Changed on purpose (it was refused): like transformers without trust_remote_code, a model_type Tandem runs is
    read as that family whatever auto_map says (Phi-3.5-MoE and DeepSeek-V2-Lite ship one beside their native
    classes), and the folder's code is still never imported."""
    folder = copy_checkpoint(mixtral_dir, tmp_path / "m")
    (folder / "modeling_x.py").write_text(CANARY_MODULE)
    edit_config(folder, auto_map={"AutoModelForCausalLM": "modeling_x.XForCausalLM"}, trust_remote_code=True)
    code, err = run_cli(capsys, "--model", str(folder), "--json")
    assert code == 0, err
    assert not (folder / "IMPORTED").exists()


def test_auto_map_of_an_unknown_model_type_is_refused_by_name(mixtral_dir: Path, tmp_path: Path, capsys) -> None:
    folder = copy_checkpoint(mixtral_dir, tmp_path / "m")
    (folder / "modeling_x.py").write_text(CANARY_MODULE)
    edit_config(folder, model_type="x_moe", auto_map={"AutoModelForCausalLM": "modeling_x.XForCausalLM"})
    expect_error(capsys, folder, "'x_moe'", "never run", "mixtral")
    assert not (folder / "IMPORTED").exists()


def test_not_enough_ram_is_refused_with_numbers(mixtral_dir: Path, monkeypatch, capsys) -> None:
    monkeypatch.setattr(memory, "available_ram", lambda: 1024)
    err = expect_error(capsys, mixtral_dir, "not enough RAM", "GiB", "--force")
    assert "KV cache" in err
    # --force overrides the estimate
    code, _ = run_cli(capsys, "--model", str(mixtral_dir), "--force", "--json")
    assert code == 0


def test_memory_check_is_pure() -> None:
    gib = 1024**3
    est = MemoryEstimate(weights=6 * gib, kv_cache=3 * gib, other=gib)
    check_memory(est, available=10 * gib, force=False)
    check_memory(est, available=gib, force=True)
    with pytest.raises(ResourceError, match=r"about 10.00 GiB .* only 9.00 GiB") as refused:
        check_memory(est, available=9 * gib, force=False)
    assert "memory-mapped" in str(refused.value) and "--no-resident" not in str(refused.value)
    with pytest.raises(ResourceError, match=r"read into RAM .* --no-resident"):  # asked for copies in RAM
        check_memory(est, available=9 * gib, force=False, resident=True)


def test_estimate_counts_kv_cache_for_context(mixtral_dir: Path) -> None:
    ckpt = open_checkpoint(mixtral_dir)
    small = memory.estimate_memory(ckpt, torch.float32, 64)
    large = memory.estimate_memory(ckpt, torch.float32, 512)
    assert large.kv_cache == 8 * small.kv_cache and large.weights == small.weights


def test_prompt_longer_than_context(mixtral_dir: Path, capsys) -> None:
    code = main(["generate", "--model", str(mixtral_dir), "--prompt", "word " * 100, "--context", "16"])
    err = capsys.readouterr().err
    assert code == 2 and "context holds 16" in err and "--context" in err


def test_prompt_given_as_text_option_or_stdin(mixtral_dir: Path, capsys, monkeypatch) -> None:
    import io

    common = ["--model", str(mixtral_dir), "--max-new-tokens", "3", "--dtype", "fp32", "--json"]
    outputs = []
    for args in (["hello there"], ["--prompt", "hello there"], ["-"]):
        monkeypatch.setattr(sys, "stdin", io.StringIO("hello there"))
        assert main(["generate", *args, *common]) == 0
        out = json.loads(capsys.readouterr().out)
        outputs.append((out["prompt_tokens"], out["tokens"]))
    assert len(outputs[0][0]) > 1 and outputs[0] == outputs[1] == outputs[2]  # the same prompt each way
    for args in ([], ["hi", "--prompt", "hi"]):
        assert main(["generate", *args, *common]) == 2
        assert "give the prompt once" in capsys.readouterr().err


def test_context_beyond_model_limit(mixtral_dir: Path, capsys) -> None:
    code = main(["generate", "--model", str(mixtral_dir), "--prompt", "hi", "--context", "100000"])
    assert code == 2 and "exceeds" in capsys.readouterr().err


def test_cli_subprocess_prints_error_without_traceback(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tandem.app.cli.main", "generate", "--model", str(tmp_path / "missing"), "--prompt",
         "x"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr


def test_bad_dtype_weights_rejected(tmp_path: Path, mixtral_dir: Path) -> None:
    folder = copy_checkpoint(mixtral_dir, tmp_path / "m")
    shard = SafetensorsFile(folder / "model.safetensors")
    tensors = {n: shard.tensor(n).clone() for n in shard.names()}
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.int32)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match="floating-point"):
        load_model(folder)
