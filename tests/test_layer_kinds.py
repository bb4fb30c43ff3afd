"""Layer kinds: the decoder runs the plan its config declares (runtime/layers.py), a new kind is its own class and
its name in the registry, and an unknown one is refused by name."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from tandem.kernels.errors import UnsupportedModelError
from tandem.runtime import layers
from tandem.runtime.attention import GroupedQueryAttention
from tandem.runtime.checkpoint import open_checkpoint
from tandem.runtime.decode_step import why_not
from tandem.runtime.model import ModelRun, MoEModel
from tandem.runtime.synth import tiny_config, write_test_model


class HalvedAttention(GroupedQueryAttention):
    """A kind of the test's own: attention whose output counts half (what halving o_proj computes, exactly)."""

    name = "halved"

    def forward(self, model, i, a, x, start, cos, sin):  # type: ignore[no-untyped-def]
        return super().forward(model, i, a, x, start, cos, sin) * 0.5

    def forward_rows(self, model, i, a, x, segments, rows, spans):  # type: ignore[no-untyped-def]
        return super().forward_rows(model, i, a, x, segments, rows, spans) * 0.5

    def step_refusal(self, cfg):  # type: ignore[no-untyped-def]
        return "the test's own kind"


def test_the_decoder_runs_the_kinds_its_config_declares(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(layers.MIXERS, "halved", HalvedAttention())
    ckpt = open_checkpoint(write_test_model(tmp_path / "m", tiny_config("olmoe")))
    plain = MoEModel.from_checkpoint(ckpt, ModelRun(torch.float32, 32))
    assert [kinds.mixer.name for kinds in plain.plan] == ["attention"] * ckpt.config.num_layers
    assert all(kinds.ffn.routed for kinds in plain.plan)
    ckpt.config = dataclasses.replace(ckpt.config, mixers=("halved", *ckpt.config.mixers[1:]))
    declared = MoEModel.from_checkpoint(ckpt, ModelRun(torch.float32, 32))
    assert declared.plan[0].mixer.name == "halved" and "the test's own kind" in (why_not(declared) or "")
    plain.use_step = False  # the same path for both: the layer loop
    first = plain.layers[0].attn
    plain.layers[0].attn = dataclasses.replace(first, o=first.o * 0.5)  # what the kind computes, done to the weight
    ids = torch.arange(3, 12).view(1, -1)
    logits = [[model.forward(ids, 0, last_only=True), model.forward(torch.tensor([[7]]), 9)]  # a prompt, a token
              for model in (plain, declared)]
    for a, b in zip(*logits, strict=True):
        assert torch.equal(a, b)


def test_an_unknown_mixer_is_refused_by_name() -> None:
    from tandem.runtime.config import ModelConfig

    cfg = ModelConfig("x", 32, 16, 2, 2, 2, 8, 1e-6, 1e4, 64, 4, 2, 8, mixers=("attention", "linear_attention"))
    with pytest.raises(UnsupportedModelError, match="'linear_attention'"):
        layers.plan(cfg)
