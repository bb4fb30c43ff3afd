"""MXFP4 experts (gpt-oss as published): the format read exactly as GGUF's reference and transformers read it, the
kernels with gpt-oss's biases and clamped SwiGLU against the reference expert on every variant, and checkpoints
that stay 4-bit. Model-level parity with transformers: the gpt_oss-mxfp4 cases of tests/test_reference_parity.py.
Marked `isa`: run again under every CPU feature mask this machine can play (tests/run_masks.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tandem.kernels.experts import CpuExecutor, CpuOptions, Epilogue
from tandem.kernels.library import available_isas, library
from tandem.kernels.quant import (
    E2M1,
    QuantizedMatrix,
    mxfp4_from_pairs,
    mxfp4_to_pairs,
    quantize_mxfp4,
)
from tandem.runtime.moe import ClampedSwiGLUExpert, MXFP4Expert, RoutingRule, reference_moe, route
from tandem.runtime.synth import tiny_config, write_test_model

pytestmark = pytest.mark.isa
ISAS = [isa for isa in available_isas() if isa != "amx"]  # what MXFP4 runs on (AMX machines: AVX-512 and its BF16)
# every variant with float32 activations, and AVX512_BF16 (vdpbf16ps, one token) with the bf16 ones it takes
VARIANTS = [(isa, compute) for isa in ISAS for compute in (torch.float32, torch.bfloat16)
            if isa != "avx512bf16" or compute == torch.bfloat16]
needs_kernels = pytest.mark.skipif(library() is None, reason="the compiled kernels are not built on this machine")
EDGE_SCALES = [0, 1, 2, 3, 100, 126, 127, 128, 200, 253, 254, 255]  # subnormal, the switch at 2, the top


def random_blocks(rows: int, groups: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored blocks [rows, G, 16] of every byte value, and scales [rows, G] with the edge values among them."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (rows, groups, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 256, (rows, groups), generator=g, dtype=torch.uint8)
    scales.view(-1)[: len(EDGE_SCALES)] = torch.tensor(EDGE_SCALES, dtype=torch.uint8)
    return blocks, scales


def test_dequantizing_is_ggufs_reference_bit_for_bit() -> None:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rows, groups = 64, 8
    _, scales = random_blocks(rows, groups, 0)
    codes = torch.randint(0, 256, (rows, groups, 16), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    ours = QuantizedMatrix("mxfp4", codes.reshape(rows, groups * 16), scales, groups * 32, 32).dequantize()
    raw = torch.cat([scales[..., None], codes], dim=-1).numpy()  # GGUF's block: the scale byte, then 16 code bytes
    with np.errstate(over="ignore"):  # the largest scales overflow to infinity, on purpose
        want = torch.from_numpy(dequantize(raw.reshape(rows, groups * 17), GGMLQuantizationType.MXFP4)
                                .astype(np.float32))
    assert torch.equal(ours, want.reshape(rows, groups * 32))
    assert torch.isinf(ours).any() and (ours.abs() < 2.0**-126).logical_and(ours != 0).any()  # the edges ran


def test_stored_blocks_read_as_transformers_dequantizes_them() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = random_blocks(48, 4, 2)  # one expert's [out, G, 16]
    want = convert_moe_packed_tensors(blocks[None], scales[None], dtype=torch.float32)[0].t()  # [out, in]
    assert torch.equal(mxfp4_from_pairs(blocks, scales).dequantize(), want)
    assert all(torch.equal(a, b) for a, b in zip(mxfp4_to_pairs(mxfp4_from_pairs(blocks, scales)),
                                                 (blocks, scales), strict=True))


def test_quantizing_keeps_representable_values_and_rounds_others_to_the_nearest() -> None:
    w = torch.randn(32, 256, generator=torch.Generator().manual_seed(3))
    q = quantize_mxfp4(w)
    assert q.data.dtype == q.scales.dtype == torch.uint8 and q.nbytes == 32 * 256 // 2 + 32 * 256 // 32
    plain = q.dequantize()
    again = quantize_mxfp4(plain)  # values already on the grid come back as they are
    assert torch.equal(again.dequantize(), plain)
    # each value is the nearest of its block's grid (E2M1 times the block's scale), or its end when beyond it
    unit = (2.0 ** (q.scales.long() - 127)).repeat_interleave(32, dim=1)  # [32, 256] each value's scale
    grid = torch.tensor(E2M1 + tuple(-v for v in E2M1[1:]))  # [15]
    nearest = (w[..., None] - grid * unit[..., None]).abs().amin(-1)  # [32, 256]
    torch.testing.assert_close((plain - w).abs(), nearest, rtol=0, atol=1e-6)
    assert ((plain - w).norm() / w.norm()).item() < 0.13
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_mxfp4(torch.randn(4, 48))


def fused_expert(h: int, i: int, seed: int, limit: float) -> tuple[ClampedSwiGLUExpert, MXFP4Expert]:
    """One gpt-oss expert as transformers holds it (the reference, over MXFP4-exact weights) and as stored."""
    g = torch.Generator().manual_seed(seed)
    stored = [mxfp4_to_pairs(quantize_mxfp4(torch.randn(rows, cols, generator=g) * 0.2))
              for rows, cols in ((2 * i, h), (h, i))]  # gate_up [2I, H] rows interleaved, down [H, I]
    gate_up_bias, down_bias = torch.randn(2 * i, generator=g), torch.randn(h, generator=g)
    (gu_blocks, gu_scales), (d_blocks, d_scales) = stored
    gate_up = mxfp4_from_pairs(gu_blocks, gu_scales).dequantize().t()  # [H, 2I]
    down = mxfp4_from_pairs(d_blocks, d_scales).dequantize().t()  # [I, H]
    reference = ClampedSwiGLUExpert.from_fused(gate_up, gate_up_bias, down, down_bias, 1.5, limit)
    quantized = MXFP4Expert.layer(*(t[None] for t in (gu_blocks, gu_scales, gate_up_bias, d_blocks, d_scales,
                                                      down_bias)), 1.5, limit)[0]
    return reference, quantized


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).abs().max() / want.abs().max()).item()


def kernel_expert(executor: CpuExecutor, w: MXFP4Expert):
    return executor.prepare_quantized(*w.matrices(), Epilogue(w.gate_bias, w.up_bias, w.down_bias, (w.alpha, w.limit)))


def test_the_clamp_binds_in_these_tests() -> None:
    ref, _ = fused_expert(128, 64, 0, limit=0.5)
    loose, _ = fused_expert(128, 64, 0, limit=1e9)
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(0))
    assert not torch.allclose(ref(x), loose(x), atol=1e-3)


@needs_kernels
@pytest.mark.parametrize("isa, compute", VARIANTS)
def test_the_kernels_match_the_reference_expert_at_every_token_count(isa: str, compute: torch.dtype) -> None:
    h, i = 128, 96
    ref, w = fused_expert(h, i, 0, limit=0.5)
    executor = CpuExecutor(h, i, compute, CpuOptions(threads=2, isa=isa))
    expert = kernel_expert(executor, w)
    assert expert.nbytes == 3 * h * i // 2 + 3 * h * i // 32  # 4.25 bits a weight, never widened
    tol = 2e-2 if compute == torch.bfloat16 else 1e-5
    for n in (1, 2, 3, 5, 8, 9, 40, 300):  # the kernel, chunks of it, and (300) torch over dequantized weights
        x = torch.randn(n, h, generator=torch.Generator().manual_seed(n)).to(compute)
        want = ref(x.float())
        assert executor.isa_for(expert, min(n, executor.crossover)) == isa
        for got in (expert(x), w(x)):  # the kernel (or its torch path), and the expert's own dequantizing call
            assert rel_err(got, want) < tol, n


@needs_kernels
@pytest.mark.parametrize("isa, compute", VARIANTS)
def test_a_layer_of_mxfp4_experts_in_one_call_matches_the_reference(isa: str, compute: torch.dtype) -> None:
    h, i, n_experts = 160, 96, 6  # 5 and 3 blocks a row: chunks of 4 blocks and a partial one (AVX512_BF16)
    pairs = [fused_expert(h, i, s, limit=0.5) for s in range(n_experts)]  # each its own biases
    executor = CpuExecutor(h, i, compute, CpuOptions(threads=2, isa=isa))
    tol = 2e-2 if compute == torch.bfloat16 else 1e-5
    experts = [kernel_expert(executor, w) for _, w in pairs]
    layer, rule = executor.layer(experts), RoutingRule(2, normalize=False, scoring="softmax_topk")
    for tokens in (1, 4, 8):
        g = torch.Generator().manual_seed(tokens)
        x, logits = torch.randn(tokens, h, generator=g).to(compute), torch.randn(tokens, n_experts, generator=g)
        weights, ids = route(logits, rule)
        want = reference_moe(x.float(), logits, rule, [ref for ref, _ in pairs])
        assert rel_err(executor.run_layer(layer, x, ids, weights), want) < tol, tokens
        got: dict[int, torch.Tensor] = {}
        jobs = [(experts[k], x[: k + 1]) for k in range(n_experts)]
        executor.run_many(jobs, lambda k, y, into=got: into.__setitem__(k, y.clone()))
        for k, (_, xs) in enumerate(jobs):
            assert rel_err(got[k], pairs[k][0](xs.float())) < tol, (tokens, k)


@needs_kernels
@pytest.mark.parametrize("isa", [isa for isa in ("avx2", "avx512", "avx512bf16") if isa in ISAS] or ["avx512"])
@pytest.mark.parametrize(("h", "i", "threads"), [(320, 96, 2), (4096, 64, 3), (96, 4096, 2), (64, 32, 1),
                                                 (2880, 2880, 2)])
def test_one_token_streams_every_row_whatever_the_split(isa: str, h: int, i: int, threads: int) -> None:
    """Rows four at a time from quarters of each thread's run, the rest one at a time (AVX2, AVX-512, and AVX512_BF16
    in chunks of 4 blocks, the last one partial); 2880: gpt-oss-20b's shape."""
    if isa not in ISAS:
        pytest.skip("one token streams rows four at a time on AVX2 and AVX-512")
    compute = torch.bfloat16 if isa == "avx512bf16" else torch.float32
    ref, w = fused_expert(h, i, 1, limit=1.0)
    expert = kernel_expert(CpuExecutor(h, i, compute, CpuOptions(threads=threads, isa=isa)), w)
    x = torch.randn(1, h, generator=torch.Generator().manual_seed(5)).to(compute)
    assert rel_err(expert(x), ref(x.float())) < (2e-2 if isa == "avx512bf16" else 1e-5)


def test_a_checkpoint_keeps_its_experts_4_bit_and_quant_is_refused(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from tandem.app.cli.main import main
    from tandem.runtime.checkpoint import open_checkpoint
    from tandem.runtime.loader import load_model
    from tandem.runtime.memory import estimate_memory

    cfg = tiny_config("gpt_oss", intermediate_size=64, quantization_config={"quant_method": "mxfp4"})
    folder = write_test_model(tmp_path / "m", cfg)
    model = load_model(folder, dtype="fp32").model
    h, i, layers, n = cfg["hidden_size"], 64, cfg["num_hidden_layers"], cfg["num_local_experts"]
    experts = [w for block in model.dispatcher.blocks.values() for w in block.experts]
    assert len(experts) == layers * n and all(isinstance(w, MXFP4Expert) for w in experts)
    per_expert = 3 * h * i // 2 + 3 * h * i // 32 + (2 * i + h) * 4  # codes, scales, float32 biases
    assert all(w.nbytes == per_expert and w.gate.dtype == torch.uint8 for w in experts)
    assert {e.kind for layer in model.dispatcher.cpu_experts.values() for e in layer} == {"mxfp4"}
    plain = write_test_model(tmp_path / "plain", {k: v for k, v in cfg.items() if k != "quantization_config"})
    weights = [estimate_memory(open_checkpoint(f), torch.float32, 64).weights for f in (folder, plain)]
    assert weights[0] - weights[1] == layers * n * per_expert  # 4-bit copies in RAM; the plain ones stay mapped
    assert main(["generate", "--model", str(folder), "--quant", "int4", "--prompt", "hi", "--max-new-tokens", "2"]) == 2
    assert "error: " in (err := capsys.readouterr().err) and "MXFP4 already; run it without --quant" in err


def test_the_tuner_measures_mxfp4_experts_as_the_model_stores_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    import json

    from tandem.app.cli.main import main
    from tandem.autotune.plan import ModelShape
    from tandem.runtime.checkpoint import open_checkpoint

    cfg = tiny_config("gpt_oss", intermediate_size=64, quantization_config={"quant_method": "mxfp4"})
    folder = write_test_model(tmp_path / "m", cfg)
    shape = ModelShape.from_config(open_checkpoint(folder).config)
    h = cfg["hidden_size"]
    assert shape.expert_quant == "mxfp4" and shape.expert_bytes == 3 * h * 64 // 2 + 3 * h * 64 // 32
    measured: list[str] = []
    prepare = CpuExecutor.prepare_quantized
    monkeypatch.setattr(CpuExecutor, "prepare_quantized",
                        lambda self, *a, **k: measured.append(a[0].kind) or prepare(self, *a, **k))
    assert main(["autotune", "--model", str(folder), "--quick", "--dtype", "fp32", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["predicted_tok_s"] > 0
    assert len(measured) > cfg["num_hidden_layers"] * cfg["num_local_experts"]  # the model's, and the tuner's own


@needs_kernels
@pytest.mark.parametrize("isa, compute", VARIANTS)
def test_the_smallest_scales_are_read_exactly_by_the_kernels(isa: str, compute: torch.dtype) -> None:
    """Blocks scaled by 2^-127 and 2^-126 (E8M0 0 and 1: the first subnormal, a special case in every variant), met
    by inputs of 2^120 so that the products are ordinary numbers again (and a block's sum stays finite)."""
    h, i = 512, 64  # 16 blocks a row: the vector path of the scales too
    _, w = fused_expert(h, i, 2, limit=1e9)
    tiny = torch.randint(0, 2, w.gate_scales.shape, generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    w = MXFP4Expert(w.gate, w.up, w.down, gate_scales=tiny, up_scales=tiny.clone(), down_scales=w.down_scales,
                    gate_bias=torch.zeros(i), up_bias=torch.zeros(i), down_bias=torch.zeros(h), alpha=w.alpha,
                    limit=w.limit)
    x = (torch.randn(1, h, generator=torch.Generator().manual_seed(1)) * 2.0**120).to(compute)
    want = w(x.float())
    assert want.abs().max() > 1e-3  # the gate and up sums are ordinary numbers, not flushed to zero
    got = kernel_expert(CpuExecutor(h, i, compute, CpuOptions(threads=2, isa=isa)), w)(x)
    assert rel_err(got, want) < (2e-2 if compute == torch.bfloat16 else 1e-5)
