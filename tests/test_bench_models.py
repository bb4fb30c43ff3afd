"""Benchmark checkpoints: real shapes, streamed to shards, loadable, with trained-like routing locality."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tandem.app.cli.main import main
from tandem.autotune.bench.models import bench_config, make_bench_model, reuse
from tandem.autotune.bench.shapes import ExpertShape, checkpoint_shapes, find_shape, real_shapes, shape_names
from tandem.kernels.errors import UnsupportedModelError
from tandem.runtime.checkpoint import open_checkpoint


def test_real_shapes() -> None:
    olmoe = bench_config("olmoe")
    assert (olmoe["hidden_size"], olmoe["intermediate_size"], olmoe["num_experts"], olmoe["num_experts_per_tok"],
            olmoe["num_hidden_layers"]) == (2048, 1024, 64, 8, 16)
    qwen = bench_config("qwen3-30b-a3b", layers=4)
    assert (qwen["moe_intermediate_size"], qwen["num_experts"], qwen["num_hidden_layers"]) == (768, 128, 4)
    mixtral = bench_config("mixtral")
    assert (mixtral["hidden_size"], mixtral["intermediate_size"], mixtral["num_local_experts"]) == (4096, 14336, 8)
    deepseek = bench_config("deepseek-v2-lite")
    assert (deepseek["kv_lora_rank"], deepseek["n_routed_experts"], deepseek["moe_intermediate_size"]) == \
        (512, 64, 1408)
    air = bench_config("glm-4.5-air")  # zai-org/GLM-4.5-Air's config.json
    assert (air["hidden_size"], air["num_hidden_layers"], air["n_routed_experts"], air["n_shared_experts"],
            air["num_experts_per_tok"], air["moe_intermediate_size"], air["intermediate_size"],
            air["num_attention_heads"], air["num_key_value_heads"], air["head_dim"], air["partial_rotary_factor"],
            air["first_k_dense_replace"], air["n_group"], air["topk_group"], air["routed_scaling_factor"],
            air["vocab_size"]) == (4096, 46, 128, 1, 8, 1408, 10944, 96, 8, 128, 0.5, 1, 1, 1, 1.0, 151552)
    with pytest.raises(UnsupportedModelError, match="choose one of"):
        bench_config("gpt4")


def test_written_checkpoint_has_the_shapes_and_is_sharded(tmp_path: Path) -> None:
    # the real OLMoE widths, with a small vocabulary and two layers to keep the test quick
    path = make_bench_model("olmoe", tmp_path / "m", layers=2, vocab_size=4096)
    ckpt = open_checkpoint(path)
    assert ckpt.config.num_experts == 64 and ckpt.config.moe_intermediate_size == 1024
    name = "model.layers.1.mlp.experts.63.down_proj.weight"
    expert = ckpt.where[name].infos[name]
    assert expert.shape == (2048, 1024) and str(expert.dtype) == "torch.bfloat16"
    assert json.loads((path / "config.json").read_text())["num_experts_per_tok"] == 8


def test_reuse_metric() -> None:
    seq = np.array([[[0, 1]], [[1, 2]], [[3, 4]]])  # reuse 1/2, then 0
    assert reuse(seq) == pytest.approx(0.25)


def test_cli(tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    from tandem.autotune.bench import shapes

    kernel_only = shapes.RealShape("other", "someone/Other", ExpertShape(2048, 1408, 6), None,
                                   refused="Other (its attention) is not a supported family yet")
    monkeypatch.setattr(shapes, "KERNEL_ONLY", (kernel_only,))
    assert main(["make-bench-model", "--shape", "other", "--out", str(tmp_path / "x")]) == 2
    assert "not a supported family" in capsys.readouterr().err
    assert set(checkpoint_shapes()) == {"mixtral", "qwen3-30b-a3b", "olmoe", "phi-3.5-moe", "deepseek-v2-lite",
                                        "moonlight-16b-a3b", "glm-4.5-air", "glm-4.5", "gpt-oss-20b", "dots-llm1",
                                        "minimax-m2", "glm-4.7-flash", "ernie-4.5-21b-a3b",
                                        "hunyuan-a13b", "granite-3.1-3b-a800m", "llama4-scout", "llama4-maverick",
                                        "gemma4-26b-a4b", "qwen3-next-80b-a3b", "qwen3.5-35b-a3b", "lfm2-8b-a1b",
                                        "granite-4.0-h-small"}


def test_one_table_of_shapes_serves_both_commands() -> None:
    """`bench kernels` derives each expert shape from the config `make-bench-model` writes; the names either command
    took before still work, each standing for one key."""
    experts = {name: shape.expert for name, shape in real_shapes().items()}
    assert experts == {"mixtral": ExpertShape(4096, 14336, 2), "olmoe": ExpertShape(2048, 1024, 8),
                       "qwen3-30b-a3b": ExpertShape(2048, 768, 8), "deepseek-v2-lite": ExpertShape(2048, 1408, 6),
                       "phi-3.5-moe": ExpertShape(4096, 6400, 2), "moonlight-16b-a3b": ExpertShape(2048, 1408, 6),
                       "glm-4.5-air": ExpertShape(4096, 1408, 8), "glm-4.5": ExpertShape(5120, 1536, 8),
                       "gpt-oss-20b": ExpertShape(2880, 2880, 4, clamped=(1.702, 7.0)),
                       "dots-llm1": ExpertShape(4096, 1408, 6), "minimax-m2": ExpertShape(3072, 1536, 8),
                       "glm-4.7-flash": ExpertShape(2048, 1536, 4), "ernie-4.5-21b-a3b": ExpertShape(2560, 1536, 6),
                       "hunyuan-a13b": ExpertShape(4096, 3072, 8), "granite-3.1-3b-a800m": ExpertShape(1536, 512, 8),
                       "llama4-scout": ExpertShape(5120, 8192, 1), "llama4-maverick": ExpertShape(5120, 8192, 1),
                       "gemma4-26b-a4b": ExpertShape(2816, 704, 8, act="gelu_tanh"),
                       "qwen3-next-80b-a3b": ExpertShape(2048, 512, 10), "qwen3.5-35b-a3b": ExpertShape(2048, 512, 8),
                       "lfm2-8b-a1b": ExpertShape(2048, 1792, 4), "granite-4.0-h-small": ExpertShape(4096, 1536, 10)}
    assert {"mixtral", "qwen3", "olmoe", "deepseek", "qwen3-30b-a3b", "deepseek-v2-lite"} <= set(shape_names())
    assert find_shape("qwen3") == find_shape("qwen3-30b-a3b")
    assert find_shape("deepseek") == find_shape("deepseek-v2-lite")
    assert bench_config("qwen3")["model_type"] == "qwen3_moe"
    with pytest.raises(KeyError):
        find_shape("qwen3-30b")


def test_fewer_experts_keep_every_layer_and_the_expert_size() -> None:
    full = bench_config("deepseek-v2-lite")
    scaled = bench_config("deepseek-v2-lite", experts=16)
    assert scaled["n_routed_experts"] == 16 and scaled["num_hidden_layers"] == full["num_hidden_layers"]
    assert scaled["moe_intermediate_size"] == full["moe_intermediate_size"]
    assert bench_config("mixtral", experts=4)["num_local_experts"] == 4
    with pytest.raises(UnsupportedModelError, match="at least 6"):
        bench_config("deepseek-v2-lite", experts=4)


def test_narrower_attention_keeps_the_key_value_heads_and_every_layer() -> None:
    full = bench_config("glm-4.5-air")
    narrow = bench_config("glm-4.5-air", heads=48)
    assert (narrow["num_attention_heads"], narrow["num_key_value_heads"]) == (48, full["num_key_value_heads"])
    assert full["num_key_value_heads"] == 8
    assert narrow["num_hidden_layers"] == full["num_hidden_layers"] and narrow["head_dim"] == full["head_dim"]
    for heads, says in ((44, "multiple of the 8"), (128, "at most the 96")):
        with pytest.raises(UnsupportedModelError, match=says):
            bench_config("glm-4.5-air", heads=heads)


def test_gpt_oss_20b_shape_loads_and_generates(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """openai/gpt-oss-20b's widths (two layers, four experts of the real size, a small vocabulary: 0.4 GB rather than
    3.5): fused expert tensors with biases, attention sinks, alternating sliding layers, YaRN; `generate` runs it
    (experts in torch)."""
    cfg = bench_config("gpt-oss-20b")
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_local_experts"], cfg["num_experts_per_tok"],
            cfg["num_hidden_layers"], cfg["vocab_size"]) == (2880, 2880, 32, 4, 24, 201088)
    assert find_shape("gpt-oss").expert == ExpertShape(2880, 2880, 4, clamped=(1.702, 7.0))
    path = make_bench_model("gpt-oss-20b", tmp_path / "m", layers=2, experts=4, vocab_size=1024)
    ckpt = open_checkpoint(path)
    assert ckpt.config.sliding_layers == (True, False) and ckpt.config.sliding_window == 128
    assert ckpt.config.rope_type == "yarn" and dict(ckpt.config.rope_params)["truncate"] is False
    name = "model.layers.1.mlp.experts.gate_up_proj"
    assert ckpt.where[name].infos[name].shape == (4, 2880, 5760)
    assert main(["generate", "--model", str(path), "--prompt", "Hello", "--max-new-tokens", "4",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["new_tokens"] > 0


def test_gpt_oss_20b_as_published_keeps_its_experts_mxfp4(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """`--dtype mxfp4`: the experts as gpt-oss publishes them (blocks and scales, 4.25 bits a weight), which
    `generate` runs on the kernels; other families are refused. (A small vocabulary: 0.1 GB rather than 2.4.)"""
    from tandem.autotune.bench import models

    real = models.bench_config
    monkeypatch.setattr(models, "bench_config", lambda *a, **k: real(*a, **k) | {"vocab_size": 1024})
    assert main(["make-bench-model", "--shape", "gpt-oss-20b", "--layers", "2", "--experts", "4", "--dtype", "mxfp4",
                 "--out", str(tmp_path / "m")]) == 0
    ckpt = open_checkpoint(tmp_path / "m")
    assert ckpt.config.experts_mxfp4
    name = "model.layers.1.mlp.experts.gate_up_proj_blocks"
    assert ckpt.where[name].infos[name].shape == (4, 5760, 90, 16) and ckpt.dtype(name) == torch.uint8
    capsys.readouterr()
    assert main(["generate", "--model", str(tmp_path / "m"), "--prompt", "Hello", "--max-new-tokens", "4",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["stats"]["new_tokens"] > 0
    assert main(["make-bench-model", "--shape", "olmoe", "--dtype", "mxfp4", "--out", str(tmp_path / "o")]) == 2
    assert "not published with MXFP4 experts" in capsys.readouterr().err
