"""Opening a checkpoint memory-maps it (peak RSS far below the file); experts are copied into RAM only when they fit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from tandem.kernels.experts import CpuOptions
from tandem.runtime import memory
from tandem.runtime.checkpoint import open_checkpoint
from tandem.runtime.loader import load_model
from tandem.runtime.memory import RESIDENT_SHARE, estimate_memory, resident_fits
from tandem.runtime.options import resolve_context
from tandem.runtime.synth import tiny_config, write_test_model

_MEASURE = """
import json, resource, sys
from tandem.runtime.loader import load_model
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
loaded = load_model(sys.argv[1], dtype="bf16", resident=False)  # the path for models that do not fit
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"growth_kib": after - before, "file_bytes": loaded.checkpoint.file_bytes}))
"""


def test_peak_rss_during_load_is_far_below_file_size(tmp_path: Path) -> None:
    # ~300 MB of bf16 experts in three shards; the non-expert part is a few MB.
    config = tiny_config("mixtral", hidden_size=512, intermediate_size=1024, num_local_experts=16,
                         num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4, vocab_size=1024)
    folder = write_test_model(tmp_path / "big", config, dtype=torch.bfloat16, shard_bytes=110 * 1024**2)
    assert (folder / "model.safetensors.index.json").exists()
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(folder)], capture_output=True, text=True, timeout=300,
                         check=True)
    result = json.loads(out.stdout)
    assert result["file_bytes"] > 250 * 1024**2
    growth = result["growth_kib"] * 1024
    assert growth < 0.1 * result["file_bytes"], f"RSS grew {growth / 2**20:.0f} MiB while opening"


def test_expert_weights_are_views_of_the_file_unless_they_fit_in_ram(tmp_path: Path, monkeypatch) -> None:
    folder = write_test_model(tmp_path / "m", tiny_config("olmoe"))
    ckpt = open_checkpoint(folder)
    names = [f"model.layers.0.mlp.experts.3.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")]

    def experts_in_map(loaded) -> bool:
        expert = loaded.model.layers[0].ffn.experts[3]
        raw = torch.frombuffer(loaded.checkpoint.shards[0]._map, dtype=torch.uint8)
        lo, hi = raw.data_ptr(), raw.data_ptr() + raw.numel()
        mats = (expert.gate, expert.up, expert.down)
        inside = [lo <= w.data_ptr() < hi for w in mats]
        assert all(torch.equal(w, ckpt.tensor(n)) for w, n in zip(mats, names, strict=True))
        assert all(inside) or not any(inside)
        return all(inside)

    assert experts_in_map(load_model(folder, dtype="fp32", resident=False))  # views: not copies
    copied = load_model(folder, dtype="fp32")  # nobody asked, and a tiny model fits: read into RAM
    assert not experts_in_map(copied) and copied.model.dispatcher.describe()["cpu"]["resident"]
    assert all(w.data_ptr() % 64 == 0 for w in (copied.model.layers[0].ffn.experts[3].gate,))
    # too little RAM to spare: the memory map, although the model alone would fit
    context = resolve_context(ckpt.config, None)
    with_copies = estimate_memory(ckpt, torch.float32, context, cpu=CpuOptions(resident=True)).total
    monkeypatch.setattr(memory, "available_ram", lambda: int(with_copies / RESIDENT_SHARE) - 1)
    assert not resident_fits(with_copies, memory.available_ram())
    assert experts_in_map(load_model(folder, dtype="fp32"))


def test_synthetic_writer_matches_transformers_layout(tmp_path: Path) -> None:
    """A checkpoint written by our writer loads in transformers and gives the same logits as Tandem."""
    import transformers

    folder = write_test_model(tmp_path / "m", tiny_config("qwen2_moe"), shard_bytes=200_000)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    ref = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.arange(1, 11)[None]
    with torch.no_grad():
        expected = ref(ids).logits
    got = load_model(folder, dtype="fp32").model.forward(ids, 0)
    assert (got - expected).abs().max().item() <= 1e-4


def test_open_parses_config_and_sizes(tmp_path: Path) -> None:
    folder = write_test_model(tmp_path / "m", tiny_config("qwen3_moe"))
    ckpt = open_checkpoint(folder)
    assert ckpt.config.num_experts == 8 and ckpt.config.qk_norm == "head"
    assert ckpt.file_bytes == sum(p.stat().st_size for p in folder.glob("*.safetensors"))


def test_experts_stored_as_x_at_w_are_counted_as_the_copies_a_load_makes(tmp_path: Path) -> None:
    """Llama 4's experts ([E, H, 2I], [E, I, H]) are copied once into rows at load, even from the memory map: the RAM
    estimate counts every byte of them, and the experts the model runs are those copies (rows, not file views)."""
    folder = write_test_model(tmp_path / "m", tiny_config("llama4_text", interleave_moe_layer_step=1))
    ckpt = open_checkpoint(folder)
    cfg = ckpt.config
    experts = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4 * cfg.num_experts * cfg.num_moe_layers
    mapped = estimate_memory(ckpt, torch.float32, 64, cpu=CpuOptions(resident=False)).weights
    others = estimate_memory(open_checkpoint(write_test_model(tmp_path / "q", tiny_config(
        "qwen3_moe", moe_intermediate_size=cfg.moe_intermediate_size, num_experts=cfg.num_experts))), torch.float32,
        64, cpu=CpuOptions(resident=False)).weights
    assert mapped >= experts > 0 and others < experts  # (a memory-mapped family's experts count nothing)
    expert = load_model(folder, dtype="fp32", resident=False).model.layers[0].ffn.experts[1]
    assert expert.gate.is_contiguous() and expert.down.is_contiguous()
