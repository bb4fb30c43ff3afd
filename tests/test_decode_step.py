"""The decode step (runtime/decode_step.py: one kernel call per token through every layer) against the torch path
of the same model, the reference: one layer's pieces bit for bit where both round the same way, whole models
within bf16's rounding, the same tokens, the same expert trace. Marked `isa`: run again under every CPU feature
mask (tests/run_masks.py)."""

from __future__ import annotations

import ctypes
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from tandem.kernels.attend import attend_isa
from tandem.kernels.library import LayerArgs
from tandem.kernels.step import decode_layers
from tandem.runtime.decode_step import DecodeStep, why_not
from tandem.runtime.loader import load_model
from tandem.runtime.model import MoEModel
from tandem.runtime.moe import route
from tests.conftest import MXFP4, build_hf_checkpoint
from tests.ggufs import write_gguf

pytestmark = [pytest.mark.isa, pytest.mark.skipif(attend_isa() is None, reason="the kernels are not built")]

# Tiny models whose every matrix the kernels multiply (widths in multiples of 32; routers too, or small enough to be
# padded to them: Mixtral's 8 experts): q/k norms over all heads (OLMoE), per head (Qwen3-MoE), a sliding window
# shorter than the test's sequence, softmax weights left unnormalised
SERVED = {
    "mixtral": ("mixtral", {}),
    "olmoe": ("olmoe", {"num_experts": 32, "num_experts_per_tok": 4}),
    "qwen3_moe": ("qwen3_moe", {"num_experts": 32, "num_experts_per_tok": 3, "moe_intermediate_size": 64,
                                "norm_topk_prob": True}),
    "qwen3_moe-sliding": ("qwen3_moe", {"num_experts": 32, "moe_intermediate_size": 64, "use_sliding_window": True,
                                        "sliding_window": 5, "norm_topk_prob": False}),
    # sigmoid routing with a correction bias for choosing (some of it negative), renormalised; q/k norms over all
    # heads, half of each head rotated
    "minimax_m2": ("minimax_m2", {"intermediate_size": 64, "num_local_experts": 32, "num_experts_per_tok": 3}),
    # a dense first layer and an ungated shared expert beside the routed ones (GLM-4.5's: two experts wide, with
    # q/k/v biases, half of each head rotated, sigmoid routing with a correction bias and routed scaling); ERNIE's
    # (softmax routing with a correction bias, two shared experts, pairwise RoPE); a Qwen3-MoE with a dense layer
    # between MoE ones
    "glm4_moe": ("glm4_moe", {"moe_intermediate_size": 64, "n_routed_experts": 32, "num_experts_per_tok": 3,
                              "n_shared_experts": 2, "num_hidden_layers": 3, "routed_scaling_factor": 2.5}),
    "ernie4_5_moe": ("ernie4_5_moe", {"moe_intermediate_size": 64, "moe_num_experts": 32, "num_hidden_layers": 3}),
    "qwen3_moe-dense": ("qwen3_moe", {"num_experts": 32, "moe_intermediate_size": 64, "num_hidden_layers": 3,
                                      "mlp_only_layers": [1], "intermediate_size": 96}),
    # the hybrids: Gated DeltaNet beside gated attention over a quarter of each head, zero-centred norms, a shared
    # expert behind a sigmoid gate and a dense layer (Qwen3-Next; the projection's 200 rows padded to 224); Qwen3.5's
    # four projections; LFM2's short convolutions, sigmoid routing with its expert bias, a dense first layer;
    # Granite 4.0-H's Mamba-2 with the muP multipliers and an ungated shared expert, its attention without RoPE, and
    # with RoPE and every bias
    # Qwen2-MoE's shared expert behind a sigmoid gate, q/k/v biases; Granite's muP multipliers (the residual one
    # in the step), q/k/v/o biases, a shared SwiGLU
    "qwen2_moe": ("qwen2_moe", {"moe_intermediate_size": 64}),
    "granitemoeshared": ("granitemoeshared", {"intermediate_size": 64, "attention_bias": True}),
    "qwen3_next": ("qwen3_next", {"moe_intermediate_size": 64, "num_hidden_layers": 3, "mlp_only_layers": [2],
                                  "layer_types": ["linear_attention", "full_attention", "linear_attention"]}),
    "qwen3_5_moe_text": ("qwen3_5_moe_text", {"moe_intermediate_size": 64}),
    "lfm2_moe": ("lfm2_moe", {"moe_intermediate_size": 64, "num_hidden_layers": 3,
                              "layer_types": ["conv", "full_attention", "conv"]}),
    "granitemoehybrid": ("granitemoehybrid", {"intermediate_size": 64}),
    "granitemoehybrid-rope-bias": ("granitemoehybrid", {
        "intermediate_size": 64, "num_hidden_layers": 3, "position_embedding_type": "rope", "attention_bias": True,
        "mamba_n_groups": 1, "mamba_proj_bias": True, "mamba_d_state": 8,
        "layer_types": ["attention", "mamba", "mamba"]}),
}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("step")
    return {name: build_hf_checkpoint(root / name, family, overrides) for name, (family, overrides) in SERVED.items()}


def decode(model: MoEModel, use_step: bool, steps: int = 12) -> tuple[torch.Tensor, list[int], object]:
    """Prefill 9 tokens, then greedy decode: the logits [steps, V], the tokens, and what the trace and statistics
    recorded (decode counts, each decode step's choices, executions per expert, misses)."""
    model.use_step = use_step
    model.dispatcher.begin_request()
    logits = model.forward(torch.arange(3, 12).view(1, -1), 0)
    token, out, tokens = logits[0, -1].argmax().view(1, 1), [], []
    for p in range(steps):
        logits = model.forward(token, 9 + p, last_only=True, phase="decode")
        out.append(logits[0, -1])
        token = logits[0, -1].argmax().view(1, 1)
        tokens.append(int(token))
    recorder, stats = model.dispatcher.recorder, model.dispatcher.stats
    return torch.stack(out), tokens, (recorder.decode.copy(), np.stack(recorder.sequence), stats.per_expert.copy(),
                                      stats.per_layer.copy(), stats.misses)


def step_matches_loop(model: MoEModel) -> None:
    """The model decodes through the step as through the layer loop: the same tokens, logits within bf16's
    rounding of each other."""
    assert why_not(model) is None
    want, want_tokens, _ = decode(model, use_step=False)
    got, tokens, _ = decode(model, use_step=True)
    assert model._step is not None and tokens == want_tokens
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("name", list(SERVED))
def test_the_step_decodes_as_the_torch_path(served: dict[str, Path], name: str, dtype: str) -> None:
    """bf16 compute, and float32 (the default on a CPU without native bf16; these float32 files' matrices as they
    are)."""
    model = load_model(served[name], dtype=dtype).model
    assert why_not(model) is None
    want, want_tokens, want_trace = decode(model, use_step=False)
    assert model._step is None
    got, tokens, trace = decode(model, use_step=True)
    assert model._step is not None  # (it ran)
    assert tokens == want_tokens
    for got_part, want_part in zip(trace, want_trace, strict=True):  # the same experts, recorded alike
        assert np.array_equal(got_part, want_part)
    # the same kernels in the same order: equal here, bit for bit; only the routing weights' exp differs (expf
    # there, torch's softmax here), by a float32 step at most
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()


def test_a_bf16_file_in_float32_compute_decodes_through_the_step(tmp_path: Path) -> None:
    """A bf16 checkpoint under float32 compute (an AVX2 CPU's default): its dense matrices stay bf16 (the kernels
    read them against float32 activations), its norms and KV cache are float32, and the step gives the torch path's
    tokens."""
    from tandem.runtime.synth import tiny_config, write_test_model

    cfg = tiny_config("qwen3_moe", num_experts=32, moe_intermediate_size=64, num_hidden_layers=2)
    model = load_model(write_test_model(tmp_path / "m", cfg, seed=2, dtype=torch.bfloat16), dtype="fp32").model
    assert model.layers[0].attn.o.dtype == torch.bfloat16 and model.layers[0].input_norm.dtype == torch.float32
    assert model.cache.k[0].dtype == torch.float32 and why_not(model) is None
    want, want_tokens, want_trace = decode(model, use_step=False)
    got, tokens, trace = decode(model, use_step=True)
    assert model._step is not None and model._step.f32 and tokens == want_tokens
    for got_part, want_part in zip(trace, want_trace, strict=True):
        assert np.array_equal(got_part, want_part)
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()


def test_one_layer_matches_the_torch_path_piece_by_piece(served: dict[str, Path]) -> None:
    """Layer 0 of one token: the normed input, the attention's output and the KV cache bit for bit (the same
    kernels in the same order), the router's logits and choice exactly, the experts' sum within a float32 step of
    the routing weights (expf here, torch's softmax there)."""
    model = load_model(served["olmoe"], dtype="bf16").model
    model.use_step = False
    with torch.inference_mode():
        model.forward(torch.arange(3, 12).view(1, -1), 0)
        step, start, layer = DecodeStep(model), 9, model.layers[0]
        x = model._embed(torch.tensor([[5]])).contiguous()  # [1, 1, H]
        cos, sin = model.cos[start : start + 1], model.sin[start : start + 1]
        h = model._norm(x, layer.input_norm, None)
        attention = model.plan[0].mixer.forward(model, 0, layer.attn, h, start, cos, sin)  # [1, 1, H]
        key = model.cache.k[0][0, :, start].clone()
        x1 = x + attention
        h1 = model._norm(x1, layer.post_norm, None).view(1, -1)  # [1, H]
        logits = model.linear(h1, layer.ffn.router)  # type: ignore[union-attr]
        weights, ids = route(logits, layer.ffn.rule)  # type: ignore[union-attr]
        moe = model.dispatcher(0, h1)  # [1, H]
        first = ctypes.cast(step.layers, ctypes.POINTER(LayerArgs * 1)).contents
        y = x.clone().view(-1)
        decode_layers(first, y, start, cos[0], sin[0])
    assert torch.equal(model.cache.k[0][0, :, start], key)
    assert torch.equal(step.o_y, attention.view(-1))
    assert torch.equal(step.h, h1.view(-1))
    assert torch.equal(step.logits, logits.view(-1))
    assert step.ids[0].tolist() == ids[0].tolist()  # best first, ties to the lower id (moe.best_first)
    assert torch.allclose(step.weights[0], weights[0], rtol=1e-6, atol=0)
    assert (step.moe_out - moe.view(-1)).abs().max().item() <= 1e-6 * moe.abs().max().item()
    assert (y - (x1 + moe).view(-1)).abs().max().item() <= 1e-6 * x1.abs().max().item()


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_gguf_blocks_decode_through_the_step(served: dict[str, Path], tmp_path: Path, dtype: str) -> None:
    """A GGUF file's blocks as stored (Q8_0, and Q4_K with Q6_K down projections and values: Q4_K_M's mix) decode
    through the step as through the torch path, in bf16 and in float32 compute."""
    for qtype, mix in (("Q8_0", None), ("Q4_K", {"ffn_down": "Q6_K", "attn_v": "Q6_K"})):
        out = tmp_path / f"olmoe-{qtype}.gguf"
        write_gguf(served["olmoe"], out, qtype, mix=mix)
        model = load_model(out, dtype=dtype).model
        assert why_not(model) is None
        want, want_tokens, _ = decode(model, use_step=False)
        got, tokens, _ = decode(model, use_step=True)
        assert tokens == want_tokens
        assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()


@pytest.mark.parametrize("family, overrides", [
    ("qwen3_next", {"moe_intermediate_size": 64, "linear_num_value_heads": 16}),  # (ssm_ba: 32 rows)
    ("qwen3_5_moe_text", {"moe_intermediate_size": 64, "linear_num_value_heads": 16}),  # (b and a: 32 rows)
    ("lfm2_moe", {"moe_intermediate_size": 64}),
    ("granitemoehybrid", {"intermediate_size": 64, "mamba_n_heads": 32, "mamba_d_head": 4}),  # (in_proj: 352 rows)
])
def test_hybrid_gguf_blocks_decode_through_the_step(tmp_path: Path, family: str, overrides: dict) -> None:
    """A hybrid's GGUF file as llama.cpp's converter writes it, Q8_0 (its mixers' projections as stored: one matrix,
    or parts of different formats side by side), decodes through the step as through the torch path."""
    out = tmp_path / f"{family}.gguf"
    write_gguf(build_hf_checkpoint(tmp_path / family, family, overrides), out, "Q8_0")
    for dtype in ("bf16", "fp32"):
        model = load_model(out, dtype=dtype).model
        step_matches_loop(model)


def test_a_residual_factor_scales_a_dense_layers_output_as_torch_rounds_it(served: dict[str, Path]) -> None:
    """muP's residual factor on every output, a dense layer's bf16 one included (times the factor in bf16, as the
    layer loop multiplies it), on a model with dense and routed layers."""
    for dtype in ("bf16", "fp32"):
        model = load_model(served["qwen3_moe-dense"], dtype=dtype).model
        model.cfg = replace(model.cfg, residual_multiplier=0.22)  # (as Granite's config would give it)
        step_matches_loop(model)


def test_projections_in_parts_that_are_padded_lie_side_by_side(served: dict[str, Path]) -> None:
    """A projection in parts (formats that differ, in a GGUF file) whose parts are not whole groups of 32 rows: each
    is multiplied as a padded copy, and its outputs lie right after the last part's own rows, as DenseLinear puts
    them side by side (the DeltaNet projection's 200 rows as 184 and 16; attention's q/k/v/gates as 120 and 72)."""
    for dtype in ("bf16", "fp32"):
        model = load_model(served["qwen3_next"], dtype=dtype).model
        for layer in model.layers:
            w = layer.attn
            if hasattr(w, "proj"):
                w.proj = [w.proj[:184].clone(), w.proj[184:].clone()]
            else:
                w.qkv = [w.qkv[:120].clone(), w.qkv[120:].clone()]
        step_matches_loop(model)


def test_gpt_oss_decodes_through_the_step(tmp_path: Path) -> None:
    """gpt-oss as published, with 32 experts: q/k/v, o and router biases (rounded where the torch path rounds them),
    attention sinks, alternating sliding windows shorter than the sequence, MXFP4 experts with their biases and the
    clamped SwiGLU (a limit that clamps)."""
    folder = build_hf_checkpoint(tmp_path / "gpt_oss", "gpt_oss", {
        "num_local_experts": 32, "intermediate_size": 64, "num_hidden_layers": 3, "sliding_window": 4,
        "swiglu_limit": 0.25, "quantization_config": MXFP4})
    model = load_model(folder, dtype="bf16").model
    assert why_not(model) is None
    want, want_tokens, want_trace = decode(model, use_step=False)
    got, tokens, trace = decode(model, use_step=True)
    assert model._step is not None and tokens == want_tokens
    for got_part, want_part in zip(trace, want_trace, strict=True):
        assert np.array_equal(got_part, want_part)
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()


def test_what_the_step_does_not_do_runs_the_torch_path(served: dict[str, Path], tmp_path: Path) -> None:
    """Each reason names itself, and such a model decodes without the step."""
    layer_norms = load_model(build_hf_checkpoint(tmp_path / "phimoe", "phimoe", {}), dtype="fp32").model
    assert "LayerNorm" in (why_not(layer_norms) or "")
    llama4 = load_model(build_hf_checkpoint(tmp_path / "llama4", "llama4_text", {}), dtype="fp32").model
    assert "after RoPE" in (why_not(llama4) or "")  # (its L2 q/k norms)
    narrow = build_hf_checkpoint(tmp_path / "narrow", "olmoe", {"hidden_size": 48, "num_experts": 32})
    odd = load_model(narrow, dtype="bf16").model  # 48 wide: matrices the kernels do not multiply
    assert "matrix" in (why_not(odd) or "")
    decode(odd, use_step=True, steps=2)
    assert odd._step is None
