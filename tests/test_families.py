"""The family registry: a family is one file of runtime/families, found by itself; a broken one is named."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tandem.app.cli.main import build_parser
from tandem.autotune.bench.models import make_bench_model
from tandem.autotune.bench.shapes import ExpertShape, find_shape, real_shapes
from tandem.kernels.errors import UnsupportedModelError
from tandem.runtime import families
from tandem.runtime.checkpoint import open_checkpoint
from tandem.runtime.synth import tiny_config, write_test_model

PACKAGE = Path(families.__file__).parent

# A family as its author would write it, and nothing else: its own names for the MoE block, the experts' projections
# and the router, its defaults, its tiny test config, a benchmark shape and how llama.cpp's files of its architecture
# say its config.
NEW_FAMILY = '''
from typing import Any

from tandem.runtime.config import ModelConfig, decoder_fields, require
from tandem.runtime.families import BenchShape, FamilySpec, GGUFArch
from tandem.runtime.gguf_meta import Meta, common_config, read_int


def parse(raw: dict[str, Any]) -> ModelConfig:
    require(raw, "expert_width", "experts", "experts_per_token")
    return ModelConfig(**decoder_fields(raw, eps=1e-6, theta=5e5, max_pos=2048), num_experts=raw["experts"],
                       top_k=raw["experts_per_token"], moe_intermediate_size=raw["expert_width"],
                       qkv_bias=raw.get("attention_bias", True))


def gguf_config(meta: Meta, vocab: int, types: dict[str, str]) -> dict[str, Any]:
    raw = common_config(meta, "newmoe", vocab)
    return raw | {{"model_type": "{model_type}", "experts": read_int(meta, "newmoe.expert_count"),
                  "experts_per_token": raw["num_experts_per_tok"],
                  "expert_width": read_int(meta, "newmoe.expert_feed_forward_length")}}


SPEC = FamilySpec(
    "{model_type}", "New-MoE", parse,
    tiny={{"expert_width": 40, "experts": 4, "experts_per_token": 2}},
    shapes=(BenchShape("{model_type}-1b", "example/New-MoE-1B", {{
        "vocab_size": 1024, "hidden_size": 256, "expert_width": 128, "num_hidden_layers": 4,
        "num_attention_heads": 4, "experts": 16, "experts_per_token": 4}}, aliases=("{model_type}",)),),
    moe_prefix="moe", expert_proj=("w_gate", "w_up", "w_down"), router="router",
    gguf=GGUFArch("newmoe", gguf_config),
)
'''


@pytest.fixture
def family_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str, str], None]]:
    """`add(name, source)`: a module `name` in a folder the families package also searches, as if it were a file
    beside the shipped families (which stay untouched)."""
    folder = tmp_path / "families"
    folder.mkdir()
    monkeypatch.setattr(families, "__path__", [*families.__path__, str(folder)])
    added: list[str] = []

    def add(name: str, source: str) -> None:
        (folder / f"{name}.py").write_text(source, encoding="utf-8")
        added.append(f"{families.__name__}.{name}")

    yield add
    for module in added:
        sys.modules.pop(module, None)


def test_the_shipped_families_are_the_files_of_the_package() -> None:
    files = sorted(p.stem for p in PACKAGE.glob("*.py") if not p.name.startswith("_"))
    assert files == ["deepseek_v2", "deepseek_v3", "dots1", "ernie4_5_moe", "gemma4_text", "glm4_moe", "glm4_moe_lite",
                     "gpt_oss", "granitemoe", "granitemoehybrid", "granitemoeshared", "hunyuan_v1_moe", "lfm2_moe",
                     "llama4_text", "minimax_m2", "mixtral", "olmoe", "phimoe", "qwen2_moe", "qwen3_5_moe_text",
                     "qwen3_moe", "qwen3_next"]
    assert families.supported_model_types() == files  # here each file is named after its model_type
    for spec in families.families():
        families.parse_config(tiny_config(spec.model_type), "tiny")  # every tiny config is a valid config


def test_a_new_family_is_one_file(family_folder, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = PACKAGE.parent.parent
    before = {p: p.read_bytes() for floor in ("app", "autotune", "runtime", "kernels")
              for p in (root / floor).rglob("*.py")}
    family_folder("new_moe", NEW_FAMILY.format(model_type="new_moe"))

    assert "new_moe" in families.supported_model_types()
    spec, cfg = families.parse_config(tiny_config("new_moe"), "tiny")
    assert (cfg.num_experts, cfg.top_k, cfg.moe_intermediate_size) == (4, 2, 40)
    assert cfg.qkv_bias and not cfg.o_bias and cfg.qk_norm == "none" and cfg.num_moe_layers == 2  # defaults
    path = write_test_model(tmp_path / "m", tiny_config("new_moe"))
    ckpt = open_checkpoint(path)  # every tensor named and shaped as the family says, checked
    assert ckpt.spec == spec
    assert "model.layers.1.moe.experts.3.w_down.weight" in ckpt.where
    assert "model.layers.0.moe.router.weight" in ckpt.where

    assert real_shapes()["new_moe-1b"].expert == ExpertShape(256, 128, 4)  # what `bench kernels` runs
    assert find_shape("new_moe") == real_shapes()["new_moe-1b"]
    bench = open_checkpoint(make_bench_model("new_moe", tmp_path / "bench", layers=2))  # `make-bench-model`
    assert (bench.config.num_layers, bench.config.num_experts, bench.config.hidden_size) == (2, 16, 256)
    assert "new_moe-1b" in build_parser().parse_args(["bench", "kernels"]).shapes.split(",")  # every shape by default
    for command in (["make-test-model"], ["make-bench-model"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args([*command, "--help"])
        assert "new_moe" in capsys.readouterr().out
    assert {p: p.read_bytes() for p in before} == before  # no file of the project touched


def _as_gguf(folder: Path, out: Path) -> Path:
    """The tiny checkpoint as llama.cpp would write a file of architecture `newmoe`: the metadata keys every
    architecture has, the family's own, llama.cpp's tensor names with each layer's experts stacked, its tokenizer."""
    import gguf
    import numpy as np

    from tandem.runtime.gguf import sources
    from tests.ggufs import _tokenizer, write_out

    ckpt = open_checkpoint(folder)
    cfg, spec = ckpt.config, ckpt.spec
    names = sources(list(ckpt.where), spec.moe_prefix, spec.router, spec.expert_proj, None, None, None)
    tensors: dict[str, np.ndarray] = {}
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for name in ckpt.where:
        source, w = names[name], ckpt.tensor(name).float().numpy()
        if source.expert is None:
            tensors[source.name] = w
        else:
            stacks.setdefault(source.name, {})[source.expert] = w
    tensors |= {name: np.stack([e[i] for i in range(len(e))]) for name, e in stacks.items()}
    writer = gguf.GGUFWriter(str(out), "newmoe")
    writer.add_block_count(cfg.num_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_head_count(cfg.num_heads)
    writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_expert_count(cfg.num_experts)
    writer.add_expert_used_count(cfg.top_k)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    _tokenizer(writer, folder, ckpt.raw_config, cfg.vocab_size)
    for name, w in tensors.items():
        writer.add_tensor(name, w)
    write_out(writer)
    return out


def test_a_new_family_reads_its_gguf_files_from_its_one_file(family_folder, tmp_path: Path) -> None:
    """The GGUF reading of a family is its file's too (`FamilySpec.gguf`): a file of its architecture opens as the
    family, every tensor under its own name with the checkpoint's values, and answers as the checkpoint does."""
    from tandem.runtime.engine import GenerationStats
    from tandem.runtime.loader import load_model
    from tandem.runtime.sampling import SamplingParams

    root = PACKAGE.parent.parent
    before = {p: p.read_bytes() for floor in ("app", "autotune", "runtime", "kernels")
              for p in (root / floor).rglob("*.py")}
    family_folder("new_moe", NEW_FAMILY.format(model_type="new_moe"))
    folder = write_test_model(tmp_path / "m", tiny_config("new_moe"))
    path = _as_gguf(folder, tmp_path / "new-moe.gguf")
    hf, file = open_checkpoint(folder), open_checkpoint(path)
    assert file.spec.model_type == "new_moe"
    assert file.config.rms_norm_eps == pytest.approx(hf.config.rms_norm_eps, rel=1e-6)  # (a float32 in the file)
    assert dataclasses.replace(file.config, rms_norm_eps=hf.config.rms_norm_eps) == hf.config
    assert set(file.where) == set(hf.where)
    for name in hf.where:
        assert torch.equal(file.tensor(name).float(), hf.tensor(name).float()), name
    answers = []
    for model in (folder, path):
        loaded = load_model(model, dtype="fp32", threads=1)
        ids = loaded.tokenizer.encode("a new family")
        answers.append(list(loaded.engine.generate(ids, SamplingParams(max_new_tokens=6), GenerationStats())))
        loaded.model.close()
    assert answers[0] == answers[1] and len(answers[0]) == 6
    assert {p: p.read_bytes() for p in before} == before  # no file of the project touched


@pytest.mark.parametrize("source, says", [
    ("raise RuntimeError('half written')", "half written"),
    ("def parse(:\n", "SyntaxError"),
    ("SPEC = None\n", "SPEC is a NoneType, not a FamilySpec"),
    ("", "SPEC"),
])
def test_a_broken_family_module_is_an_error_naming_it(family_folder, source: str, says: str) -> None:
    family_folder("broken_moe", source)
    with pytest.raises(ImportError, match="tandem.runtime.families.broken_moe") as e:
        families.supported_model_types()
    assert says in str(e.value)


def test_two_modules_with_one_model_type_are_refused(family_folder) -> None:
    family_folder("another_mixtral", NEW_FAMILY.format(model_type="mixtral"))
    with pytest.raises(ImportError, match=r"another_mixtral and \S+\.mixtral both define model_type 'mixtral'"):
        families.family_for("mixtral")


def test_a_benchmark_shape_name_used_twice_is_refused(family_folder) -> None:
    source = NEW_FAMILY.format(model_type="new_moe").replace('aliases=("new_moe",)', 'aliases=("qwen3",)')
    family_folder("new_moe", source)
    with pytest.raises(ValueError, match="'qwen3' is given to both example/New-MoE-1B and Qwen/Qwen3-30B-A3B"):
        real_shapes()


def test_a_published_llama4_folder_is_refused_with_what_runs_instead() -> None:
    """Llama 4 as published (its vision tower and text model in one config, `llama4`): refused by name, saying that
    its text model runs from llama.cpp's GGUF file of it."""
    with pytest.raises(UnsupportedModelError, match="llama4_text.*convert_hf_to_gguf"):
        families.parse_config({"model_type": "llama4", "text_config": {"model_type": "llama4_text"}}, "config.json")
