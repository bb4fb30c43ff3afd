"""gpt-oss beyond the parity cases: config defaults as transformers' GptOssConfig, what is refused (other quantization
methods, MXFP4 tensors without their config, quantizing torch-path experts), and the executor's rule that bf16
experts never reach the C kernels. MXFP4 itself: tests/test_mxfp4.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.kernels.errors import KernelError, UnsupportedModelError
from tandem.kernels.experts import CpuExecutor, CpuOptions
from tandem.runtime.checkpoint import open_checkpoint
from tandem.runtime.families import parse_config
from tandem.runtime.moe import ClampedSwiGLUExpert
from tandem.runtime.synth import tiny_config, write_test_model

BARE = {"model_type": "gpt_oss", "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 8, "num_experts_per_tok": 2,
        "intermediate_size": 48}


def test_absent_keys_take_transformers_defaults() -> None:
    import transformers

    ref = transformers.GptOssConfig(**{k: v for k, v in BARE.items() if k != "model_type"})
    _, cfg = parse_config(dict(BARE), "config.json")
    assert cfg.head_dim == ref.head_dim == 64  # not hidden / heads
    assert cfg.sliding_layers == tuple(t == "sliding_attention" for t in ref.layer_types) == (True, False) * 2
    assert cfg.sliding_window == ref.sliding_window
    assert cfg.rope_theta == ref.rope_parameters["rope_theta"]
    assert cfg.rope_type == ref.rope_parameters["rope_type"] == "yarn"
    assert dict(cfg.rope_params) == {k: v for k, v in ref.rope_parameters.items() if k not in ("rope_type",
                                                                                                "rope_theta")}
    assert cfg.clamped_swiglu == (ref.swiglu_alpha, ref.swiglu_limit)
    assert cfg.qkv_bias and cfg.o_bias and ref.attention_bias
    assert cfg.rms_norm_eps == ref.rms_norm_eps and cfg.max_position_embeddings == ref.max_position_embeddings


def test_hidden_act_is_not_read_for_gpt_oss_only() -> None:
    """transformers' experts compute the clamped SwiGLU whatever hidden_act says; other families still refuse it."""
    _, cfg = parse_config({**BARE, "hidden_act": "gelu"}, "config.json")
    assert cfg.clamped_swiglu is not None
    with pytest.raises(UnsupportedModelError, match="hidden_act"):
        parse_config(tiny_config("mixtral", hidden_act="gelu"), "config.json")


def test_mxfp4_is_read_from_the_quantization_config_and_other_methods_are_refused_by_name() -> None:
    _, cfg = parse_config({**BARE, "intermediate_size": 64, "quantization_config": {"quant_method": "mxfp4"}},
                          "config.json")
    assert cfg.experts_mxfp4 and not parse_config(dict(BARE), "config.json")[1].experts_mxfp4
    with pytest.raises(UnsupportedModelError, match="bitsandbytes quantized experts.*not supported"):
        parse_config({**BARE, "quantization_config": {"quant_method": "bitsandbytes"}}, "config.json")
    with pytest.raises(UnsupportedModelError, match="whole blocks of 32 values, not 64 and 48"):
        parse_config({**BARE, "quantization_config": {"quant_method": "mxfp4"}}, "config.json")


def test_mxfp4_expert_tensors_without_their_config_are_refused_by_name(tmp_path: Path) -> None:
    """Experts stored as `*_blocks` + `*_scales` (as published) without a quantization_config say MXFP4."""
    folder = write_test_model(tmp_path / "m", tiny_config("gpt_oss"))
    tensors = load_file(folder / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        rows = tensors.pop(name)
        tensors[f"{name}_blocks"] = torch.zeros(*rows.shape[:2], 2, 16, dtype=torch.uint8)
        tensors[f"{name}_scales"] = torch.zeros(*rows.shape[:2], 2, dtype=torch.uint8)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(UnsupportedModelError, match="stores its experts as MXFP4.*no.*quant_method.*mxfp4"):
        open_checkpoint(folder)


def expert(h: int = 64, i: int = 32, limit: float = 0.2) -> ClampedSwiGLUExpert:
    g = torch.Generator().manual_seed(0)
    return ClampedSwiGLUExpert.from_fused(torch.randn(h, 2 * i, generator=g) * 0.2, torch.randn(2 * i, generator=g),
                                          torch.randn(i, h, generator=g) * 0.2, torch.randn(h, generator=g), 1.3, limit)


def test_the_executor_never_sends_torch_path_experts_to_the_kernel() -> None:
    w = expert()
    ex = CpuExecutor(64, 32, torch.float32, CpuOptions(threads=1))
    cpu = ex.prepare(w.gate, w.up, w.down, reference=w)
    assert cpu.gate.data_ptr() == w.gate.data_ptr()  # views, never copied
    layer = ex.layer([cpu, cpu])
    for tokens in (1, 3, 40):
        x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens))
        assert ex.isa_for(cpu, tokens) is None and not ex.serves_layer(layer, tokens)
        torch.testing.assert_close(ex.run(cpu, x), w(x), rtol=0, atol=0)
        outs: list[tuple[int, torch.Tensor]] = []
        ex.run_many([(cpu, x), (cpu, x[:1])], lambda i, y, into=outs: into.append((i, y.clone())))
        torch.testing.assert_close(dict(outs)[0], w(x), rtol=0, atol=0)


def test_the_clamped_swiglu_clamps_and_is_not_plain_swiglu() -> None:
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(1))
    clamped, loose = expert(limit=0.2), expert(limit=1e9)
    assert not torch.allclose(clamped(x), loose(x))
    gate_up = x @ loose.gate_up + loose.gate_up_bias  # [5, 2I]: gate and up interleaved, as transformers
    gate, up = gate_up[:, ::2], gate_up[:, 1::2]
    want = ((up + 1) * gate * torch.sigmoid(1.3 * gate)) @ loose.down.t() + loose.down_bias
    torch.testing.assert_close(loose(x), want)


def test_quantizing_torch_path_experts_is_refused() -> None:
    w = expert()
    with pytest.raises(KernelError, match="quantization is not supported"):
        CpuExecutor(64, 32, torch.float32, CpuOptions(quant="int8")).prepare(w.gate, w.up, w.down, reference=w)


@pytest.mark.parametrize("tokens", [1, 7, 150])  # 150: in blocks of SINK_QUERY_BLOCK queries
def test_attention_with_sinks_is_transformers_eager_attention(tokens: int) -> None:
    """Grouped heads, a sliding mask and sinks, against transformers' own gpt-oss eager attention."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from tandem.runtime.attention import attend_with_sinks

    g = torch.Generator().manual_seed(tokens)
    B, Hq, Hkv, S, D, window = 2, 8, 2, 160, 16, 40
    q, k, v = torch.randn(B, Hq, tokens, D, generator=g), torch.randn(B, Hkv, S, D, generator=g), \
        torch.randn(B, Hkv, S, D, generator=g)
    sinks = torch.randn(Hq, generator=g)
    q_pos = torch.arange(S - tokens, S)[:, None]  # [T, 1]: the last queries of the sequence
    k_pos = torch.arange(S)[None, :]  # [1, S]
    mask = (k_pos <= q_pos) & (k_pos > q_pos - window)  # [T, S]
    module = SimpleNamespace(num_key_value_groups=Hq // Hkv, sinks=sinks, training=False)
    additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))  # [T, S]
    want, _ = eager_attention_forward(module, q, k, v, additive[None, None], scaling=D ** -0.5)  # [B, T, Hq, D]
    got = attend_with_sinks(q, k, v, mask, sinks)  # [B, Hq, T, D]
    torch.testing.assert_close(got.transpose(1, 2), want, rtol=1e-5, atol=1e-5)


def test_quant_is_refused_before_the_experts_are_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tandem.app.cli.main import main

    folder = write_test_model(tmp_path / "m", tiny_config("gpt_oss"))
    assert main(["generate", "--model", str(folder), "--quant", "int8", "--prompt", "hi", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "int8 quantization is not supported" in err and "reading the experts" not in err
