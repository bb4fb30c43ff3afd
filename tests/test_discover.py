"""Finding models where people keep them: --models-dir folders (model folders and GGUF files), the Hugging Face cache
(GGUF repositories too), LM Studio's folders and Ollama's store, listed by `tandem models`; an Ollama name runs as a
model."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest

from tandem.app.cli.main import main
from tandem.kernels.errors import CheckpointError
from tandem.runtime.discover import Stores, discover, ollama_models, resolve_ollama_name
from tests.conftest import build_hf_checkpoint, copy_checkpoint
from tests.ggufs import fake_stores, write_gguf


@pytest.fixture(scope="module")
def moe_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("discover")
    hf = build_hf_checkpoint(root / "hf", "qwen3_moe", {
        "hidden_size": 256, "moe_intermediate_size": 256, "head_dim": 64, "num_attention_heads": 4,
        "num_key_value_heads": 2})
    write_gguf(hf, root / "tiny.gguf", "Q4_K", mix={"ffn_down": "Q6_K"}, file_type="MOSTLY_Q4_K_M")
    return root / "tiny.gguf"


def dense_llama(path: Path) -> Path:
    """A dense llama GGUF (no experts): listed, but not one Tandem runs."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_models_lists_every_store(moe_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    names = fake_stores(Path.home(), moe_gguf)  # the tests' HOME: an empty folder of their own
    models = tmp_path / "models"
    copy_checkpoint(moe_gguf.parent / "hf", models / "qwen-folder")
    dense_llama(models / "dense.gguf")
    assert main(["models", "--models-dir", str(models), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    by_name = {r["name"]: r for r in rows}
    assert set(by_name) == {"qwen-folder", "dense", names["LM Studio"], names["Ollama"], names["Ollama other"],
                            names["HF cache"], "gone:latest", "broken:latest"}
    # the Ollama manifests whose blob is missing or that are broken: listed, not run, with why and how to mend it
    gone, broken = by_name["gone:latest"], by_name["broken:latest"]
    assert not gone["runs"] and "is missing" in gone["problem"] and "ollama pull gone:latest" in gone["problem"]
    assert not broken["runs"] and "cannot be read as JSON" in broken["problem"] and broken["family"] == "damaged"
    assert all(by_name[n]["problem"] is None for n in names.values())
    for source in ("LM Studio", "Ollama", "HF cache"):
        row = by_name[names[source]]
        assert row["source"] == source and row["runs"] and row["family"] == "Qwen3-MoE"
        assert row["quant"] == "Q4_K_M" and row["size_bytes"] == moe_gguf.stat().st_size and row["experts"] == 8
        assert row["fits_ram"] and row["on_gpu"] == "no GPU"
    assert by_name[names["Ollama"]]["path"].endswith(f"blobs/{Path(by_name[names['Ollama']]['path']).name}")
    assert by_name["qwen-folder"]["source"] == "folder" and by_name["qwen-folder"]["quant"] in ("fp32", "bf16")
    assert not by_name["dense"]["runs"] and by_name["dense"]["family"] == "llama"
    assert main(["models", "--models-dir", str(models)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["name", "family", "quant"]
    assert any(line.startswith("qwen3:30b-a3b ") and "Ollama" in line for line in table)
    assert any("llama (not run)" in line for line in table)


def test_an_ollama_name_runs_as_the_model(moe_gguf: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fake_stores(Path.home(), moe_gguf)

    def run(model: str) -> dict:
        assert main(["generate", "--model", model, "--prompt", "The quick brown fox", "--chat", "--max-new-tokens",
                     "4", "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    by_file = run(str(moe_gguf))
    assert run("qwen3:30b-a3b")["tokens"] == by_file["tokens"]
    assert run("someone/tiny")["tokens"] == by_file["tokens"]  # no tag: :latest
    assert main(["generate", "--model", "qwen3:235b", "--prompt", "hi"]) == 2
    assert "`tandem models` lists" in capsys.readouterr().err


def test_where_other_apps_keep_models_follows_their_settings(tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / ".lmstudio").mkdir(parents=True)
    (home / ".lmstudio" / "settings.json").write_text(json.dumps({"downloadsFolder": str(tmp_path / "lms")}))
    found = Stores.default(home, {"HF_HOME": str(tmp_path / "hf"), "OLLAMA_MODELS": str(tmp_path / "ollama")})
    assert found.hf_hub == tmp_path / "hf" / "hub" and found.ollama == [tmp_path / "ollama"]
    assert found.lmstudio == [tmp_path / "lms", home / ".lmstudio" / "models", home / ".cache" / "lm-studio" / "models"]
    assert Stores.default(home, {"HF_HUB_CACHE": str(tmp_path / "c"), "HF_HOME": "x"}).hf_hub == tmp_path / "c"
    plain = Stores.default(home, {})
    assert plain.hf_hub == home / ".cache" / "huggingface" / "hub"
    assert plain.ollama[0] == home / ".ollama" / "models"


def test_ollama_names_follow_its_registry_and_namespaces(moe_gguf: Path, tmp_path: Path) -> None:
    fake_stores(tmp_path, moe_gguf)
    store = tmp_path / ".ollama" / "models"
    elsewhere = store / "manifests" / "hf.co" / "someone" / "Tiny-GGUF" / "Q4_K_M"
    elsewhere.parent.mkdir(parents=True)
    elsewhere.write_text((store / "manifests" / "registry.ollama.ai" / "library" / "qwen3" / "30b-a3b").read_text())
    found = ollama_models(store)
    names = [m.name for m in found if m.blob is not None]
    assert names == ["hf.co/someone/Tiny-GGUF:Q4_K_M", "qwen3:30b-a3b", "someone/tiny:latest"]
    assert [m.name for m in found if m.blob is None] == ["broken:latest", "gone:latest"]
    stores = Stores(None, [], [store])
    assert resolve_ollama_name("hf.co/someone/Tiny-GGUF:Q4_K_M", stores) == resolve_ollama_name("qwen3:30b-a3b", stores)
    assert resolve_ollama_name("qwen3", stores) is None  # no qwen3:latest
    with pytest.raises(CheckpointError, match="Ollama model gone:latest: its model blob .* is missing"):
        resolve_ollama_name("gone", stores)  # (a damaged manifest says why, not "not found")
    assert [e.name for e in discover([], None, stores) if e.runs] == names


@pytest.mark.parametrize("family, shown", [("deepseek_v2", "DeepSeek-V2"), ("deepseek_v3", "DeepSeek-V3")])
def test_deepseek_files_are_listed_as_the_family_their_gating_says(tmp_path: Path, family: str, shown: str) -> None:
    """llama.cpp writes V2 and V3 both as `deepseek2`; V3's sigmoid gating (expert_gating_func 2) tells them apart."""
    from tandem.runtime.discover import describe_gguf

    write_gguf(build_hf_checkpoint(tmp_path / "hf", family, {}), tmp_path / "m.gguf")
    entry = describe_gguf(tmp_path / "m.gguf", "models-dir")
    assert entry is not None and entry.runs and entry.family == shown


def test_a_damaged_model_folder_is_listed_with_why(moe_gguf: Path, tmp_path: Path) -> None:
    """A folder whose config.json is damaged, refused by its family or beside no weights is listed, not run, saying
    why; a folder of a family Tandem does not know, or without config.json, is not a model to list."""
    import os

    good = moe_gguf.parent / "hf"
    models = tmp_path / "models"
    copy_checkpoint(good, models / "good")
    config = json.loads((good / "config.json").read_text())
    for name, text in {"not-json": "{not json", "a-list": "[1, 2]", "bad-field": json.dumps(
            {**config, "num_experts_per_tok": 1000}), "bert": json.dumps({"model_type": "bert"})
                       }.items():
        copy_checkpoint(good, models / name)
        (models / name / "config.json").write_text(text)
    (models / "no-weights").mkdir()
    (models / "no-weights" / "config.json").write_text(json.dumps(config))
    (models / "fifo").mkdir()
    os.mkfifo(models / "fifo" / "config.json")
    (models / "notes").mkdir()
    copy_checkpoint(good, models / "index-out")  # an index that names a file outside the folder
    (models / "index-out" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "/etc/passwd"}}))
    copy_checkpoint(good, models / "cut-header")  # a shard whose header claims more than the file holds
    shard = next((models / "cut-header").glob("*.safetensors"))
    shard.write_bytes((1 << 40).to_bytes(8, "little") + shard.read_bytes()[8:])
    entries = {e.name: e for e in discover([models], None, Stores(None, [], []))}
    assert set(entries) == {"good", "not-json", "a-list", "bad-field", "no-weights", "fifo", "index-out",
                            "cut-header"}
    assert entries["good"].runs and entries["good"].problem is None
    whys = {"not-json": "cannot be read as JSON", "a-list": "does not hold a JSON object",
            "bad-field": "picks 1000 experts", "no-weights": "has no *.safetensors weights",
            "fifo": "not a regular file but a FIFO", "index-out": "may only name files beside it",
            "cut-header": "is not a valid safetensors file"}
    for name, why in whys.items():
        e = entries[name]
        assert not e.runs and e.family == "damaged" and why in (e.problem or ""), (name, e.problem)
        assert str(models / name) in (e.problem or "")
