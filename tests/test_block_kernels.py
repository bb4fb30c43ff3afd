"""The kernels read GGUF's block formats as stored: dense matrices (DenseLinear) and experts (one, several, a whole
layer) against float64 products over the same matrices dequantized by kernels/blocks.py (which the gguf package's
reference checks bit for bit, tests/test_blocks.py), on every kernel variant this CPU has.

The float paths sum the same values in another order: equal to 1e-5 of the largest result. Every format but GGUF's
MXFP4 runs against int8 activations on the AVX512_BF16 variant (csrc/q8.c), as llama.cpp does. Their reference takes
the inputs as the kernel quantizes them (`int8_inputs`), and an expert's intermediate likewise: within 1e-5 for a
matrix; within 1e-4 for an expert, whose intermediate values the kernel and the reference compute in different
precision, so that a value on a rounding boundary could take the next code (measured: within 1e-5 here too).
Several tokens give each token the bits one token alone gets. (What int8 activations cost against float ones is a
quality question: `tandem bench quant`.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tandem.kernels.blocks import FORMATS, block_matrix
from tandem.kernels.choice import BLOCK_STEP, TILED_BLOCKS
from tandem.kernels.dense import DenseLinear
from tandem.kernels.experts import CpuExecutor, CpuOptions
from tandem.kernels.library import BLOCK_KINDS, Q8_KINDS, available_isas, library
from tandem.kernels.quant import QuantizedMatrix

pytestmark = [pytest.mark.isa, pytest.mark.skipif(library() is None, reason="the kernels are not built")]
ISAS = [i for i in ("base", "avx2", "avx512", "avx512bf16") if i in available_isas()]
FLOAT, INT8 = 1e-5, 1e-4  # tolerances, relative to the largest result (see the module docstring)


def matrix(fmt: str, rows: int, cols: int, seed: int) -> QuantizedMatrix:
    """Random blocks whose scales are small ordinary numbers (f16 d and m; E8M0 near 2^-7)."""
    f = FORMATS[fmt]
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (rows, cols // f.values, f.nbytes), generator=g, dtype=torch.uint8)
    if fmt == "MXFP4":
        raw[..., 0] = torch.randint(118, 124, raw.shape[:-1], generator=g, dtype=torch.uint8)
    else:
        scale = torch.rand(raw.shape[:-1] + (2,), generator=g) * 0.002 + 0.0005  # [rows, blocks, 2]
        bits = scale.half().view(torch.uint8)  # [rows, blocks, 4]: two f16 values
        for k, at in enumerate({"Q6_K": [208]}.get(fmt, [0, 2] if fmt in ("Q4_1", "Q5_1", "Q4_K", "Q5_K") else [0])):
            raw[..., at : at + 2] = bits[..., 2 * k : 2 * k + 2]
    return block_matrix(raw.reshape(rows, -1), fmt)


def close(got: torch.Tensor, want: torch.Tensor, tolerance: float = FLOAT) -> None:
    """Equal within `tolerance` of the largest value (FLOAT: the same values summed in another order)."""
    torch.testing.assert_close(got.double(), want, rtol=0, atol=tolerance * want.abs().max().item())


def int8_inputs(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """x [..., n] as the int8-activation kernels read it (csrc/q8.c q8_inputs), in float64: per block of the format's
    (the K formats: 256 values; the others: 32), d = max|x| / 127 and codes round(x * (127 / max|x|)), all in
    float32."""
    block = 256 if fmt in ("Q4_K", "Q5_K", "Q6_K") else 32
    xs = x.float().reshape(*x.shape[:-1], -1, block)  # [..., n / block, block]
    amax = xs.abs().amax(-1, keepdim=True)  # [..., n / block, 1]
    inv = torch.full_like(amax, 127) / amax  # (a division: torch computes 127 / amax as 127 * (1 / amax))
    codes = torch.round(xs * torch.where(amax > 0, inv, 0))  # (half to even, as the kernel rounds)
    return (codes.double() * (amax / 127).double()).reshape(x.shape)


# The variant bf16 compute takes for Q8_KINDS blocks on this CPU (under its mask): the int8 path of AVX512_BF16
# (csrc/q8.c), else AVX2's (csrc/q8avx2.c)
Q8_ISA = next((i for i in ("avx512bf16", "avx2") if i in available_isas()), None)


def int8_path(fmt: str, isa: str | None, x_bf16: bool) -> bool:
    """Whether this call runs against int8 activations: the variants with an int8 path, for the formats they take
    (every block format but MXFP4)."""
    chosen = isa or (Q8_ISA if x_bf16 else None)
    return chosen in ("avx512bf16", "avx2") and fmt in Q8_KINDS


def width(fmt: str) -> int:
    """A row width that is not a whole number of 256-value chunks where the format allows (9 blocks of 32)."""
    return 512 if FORMATS[fmt].values == 256 else 288


@pytest.mark.parametrize("isa", [None, *ISAS])
@pytest.mark.parametrize("fmt", BLOCK_KINDS)
def test_dense_matrices_of_every_format_match_the_dequantized_product(fmt: str, isa: str | None) -> None:
    cols = width(fmt)
    w = matrix(fmt, 96, cols, seed=1)
    ref = w.dequantize(torch.float64)  # [96, cols]
    linear = DenseLinear(2, isa=isa)
    for tokens in (1, 3, 20, BLOCK_STEP + 8):  # one token (four-row runs), a few, more than one call's BLOCK_STEP
        x = torch.randn(tokens, cols, generator=torch.Generator().manual_seed(tokens))
        close(linear(x, w, out_dtype=torch.float32), x.double() @ ref.T)  # float32 x: the float paths
        xb = x.bfloat16()
        xq = int8_inputs(xb, fmt) if int8_path(fmt, isa, True) else xb.double()
        close(linear(xb, w, out_dtype=torch.float32), xq @ ref.T)
    bias = torch.randn(192)  # two matrices side by side (q, k and v of different formats), one bias for both
    close(linear(x, [w, w], bias, out_dtype=torch.float32), torch.cat([x.double() @ ref.T] * 2, -1) + bias.double())


def tiled(formats: tuple[str, str], isa: str | None, tokens: int) -> bool:
    """Whether a kernel call of `tokens` tokens takes the tiled product (csrc/tiles.c): a whole BLOCK_STEP call, on a
    variant that takes both formats (TILED_BLOCKS)."""
    return tokens >= BLOCK_STEP and all(f in TILED_BLOCKS.get(isa or "", ()) for f in formats)


def reference(x: torch.Tensor, mats: list[QuantizedMatrix], int8: bool = False) -> torch.Tensor:
    """The expert over the dequantized matrices in float64; with `int8`, the inputs of each matrix whose format has
    the int8 path quantized first, as the kernel does."""
    g, u, d = (m.dequantize(torch.float64) for m in mats)

    def inputs(v: torch.Tensor, fmt: str) -> torch.Tensor:
        return int8_inputs(v, fmt) if int8 and fmt in Q8_KINDS else v.double()
    xq = inputs(x, mats[0].kind)
    return F.linear(inputs(F.silu(xq @ g.T) * (xq @ u.T), mats[2].kind), d)


def by_calls(x: torch.Tensor, mats: list[QuantizedMatrix], int8: bool, isa: str | None) -> torch.Tensor:
    """`reference` over the kernel's calls of BLOCK_STEP tokens: a tiled call's inputs are float32, not int8."""
    formats = (mats[0].kind, mats[2].kind)
    return torch.cat([reference(c, mats, int8 and not tiled(formats, isa, c.shape[0])) for c in x.split(BLOCK_STEP)])


@pytest.mark.parametrize("isa", [None, *ISAS])
@pytest.mark.parametrize("formats", [(f, f) for f in BLOCK_KINDS] + [("Q4_K", "Q6_K"), ("Q4_0", "Q8_0")])
def test_experts_of_every_format_match_the_dequantized_reference(formats: tuple[str, str], isa: str | None) -> None:
    """One expert at a time (one token, several in one call, then in calls of BLOCK_STEP tokens), several in one call,
    and a layer's experts through one call from the routing, with gate and up in one format and down in another as
    Q4_K_M has them. A whole call of BLOCK_STEP tokens takes the tiled product where the variant has it for both
    formats (TILED_BLOCKS), against float32 inputs."""
    fmt, down_fmt = formats
    h, i = width(fmt), width(down_fmt)
    ex = CpuExecutor(h, i, torch.float32, CpuOptions(threads=2, isa=isa))
    experts = []
    for e in range(4):
        mats = [matrix(fmt, i, h, 10 * e), matrix(fmt, i, h, 10 * e + 1), matrix(down_fmt, h, i, 10 * e + 2)]
        experts.append((ex.prepare_quantized(*mats), mats))
    assert {(e.kind, e.down_kind) for e, _ in experts} == {formats}
    g = torch.Generator().manual_seed(3)

    int8 = any(int8_path(f, isa, False) for f in formats)
    tolerance = INT8 if int8 else FLOAT
    assert ex._step(experts[0][0]) == BLOCK_STEP
    chosen = ex.isa_for(experts[0][0], BLOCK_STEP)
    for tokens in (1, 3, 20, BLOCK_STEP + 5):
        x = torch.randn(tokens, h, generator=g)
        close(experts[0][0](x), by_calls(x, experts[0][1], int8, chosen), tolerance)
    xs = [torch.randn(n, h, generator=g) for n in (1, 2, 1)]
    got: dict[int, torch.Tensor] = {}
    ex.run_many([(e, x) for (e, _), x in zip(experts, xs, strict=False)], lambda k, y: got.__setitem__(k, y.clone()))
    for k, x in enumerate(xs):
        close(got[k], reference(x, experts[k][1], int8), tolerance)
    layer = ex.layer([e for e, _ in experts])
    x = torch.randn(3, h, generator=g)
    ids = torch.tensor([[0, 2], [1, 2], [3, 0]])
    weights = torch.rand(3, 2, generator=g)
    want = torch.stack([sum(weights[t, k].double() * reference(x[t : t + 1], experts[int(ids[t, k])][1], int8)[0]
                            for k in range(2)) for t in range(3)])
    close(ex.run_layer(layer, x, ids, weights), want, tolerance)
    # a prompt's tokens: each expert's in calls of at most BLOCK_STEP (here two or three each), all in one run_layer
    T = 2 * BLOCK_STEP + 13
    assert ex.serves_layer(layer, T)
    x = torch.randn(T, h, generator=g)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(T)])  # [T, 2] distinct per token
    weights = torch.rand(T, 2, generator=g)
    assert torch.bincount(ids.flatten()).max() > BLOCK_STEP
    want = torch.zeros(T, h, dtype=torch.float64)
    for e in range(4):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        want[tok] += weights[tok, slot, None].double() * by_calls(x[tok], experts[e][1], int8, chosen)
    close(ex.run_layer(layer, x, ids, weights), want, tolerance)


def test_a_down_matrix_of_another_kind_than_blocks_is_refused() -> None:
    ex = CpuExecutor(256, 256, torch.float32, CpuOptions(threads=1))
    gate, up = matrix("Q4_K", 256, 256, 0), matrix("Q4_K", 256, 256, 1)
    with pytest.raises(ValueError, match="down must be a Q4_K matrix"):
        ex.prepare_quantized(gate, up, QuantizedMatrix("int8", torch.zeros(256, 256, dtype=torch.int8),
                                                       torch.ones(256), 256))
    with pytest.raises(ValueError, match="up must be a Q4_K matrix"):
        ex.prepare_quantized(gate, matrix("Q8_0", 256, 256, 2), matrix("Q6_K", 256, 256, 3))


@pytest.mark.skipif(Q8_ISA is None, reason="this CPU has neither AVX512_BF16 nor AVX2")
def test_bf16_compute_takes_int8_activations_and_float32_keeps_the_float_path() -> None:
    """bf16: AVX512_BF16's int8 path, else AVX2's; float32: the float path, on AVX-512, else on the base variant
    (AVX2's blocks are its int8 path)."""
    mats = [matrix("Q4_K", 256, 256, 0), matrix("Q4_K", 256, 256, 1), matrix("Q6_K", 256, 256, 2)]
    float_isa = "avx512" if "avx512" in available_isas() else "base"
    for dtype, isa in ((torch.bfloat16, Q8_ISA), (torch.float32, float_isa)):
        ex = CpuExecutor(256, 256, dtype, CpuOptions(threads=2))
        expert = ex.prepare_quantized(*mats)
        assert ex.isa_for(expert, 1) == ex.isa_for(expert, 4) == isa
        x = torch.randn(4, 256, generator=torch.Generator().manual_seed(0))  # (float32 out: not rounded to bf16)
        int8 = dtype == torch.bfloat16
        close(expert(x), reference(x, mats, int8), INT8 if int8 else FLOAT)


@pytest.mark.skipif(Q8_ISA is None, reason="this CPU has neither AVX512_BF16 nor AVX2")
@pytest.mark.parametrize("formats", [("Q4_K", "Q6_K"), ("Q5_K", "Q5_K"), ("Q8_0", "Q8_0"), ("Q4_0", "Q4_1"),
                                     ("Q5_0", "Q5_1")])
def test_several_tokens_against_int8_activations_give_each_token_its_one_token_result(formats: tuple[str, str]
                                                                                      ) -> None:
    """The several-token kernels unpack each superblock once for up to eight tokens (csrc/q8.c dot; AVX2's too:
    csrc/q8avx2.c Q8A_TOKENS); the one-token kernels stream four rows side by side (rows4; AVX2's: the same dot for
    one). Both take the same steps in the same order: the same bits, for every token count up to a call's 16,
    experts and dense matrices alike."""
    fmt, down_fmt = formats
    h, i = width(fmt), width(down_fmt)
    mats = [matrix(fmt, i, h, 0), matrix(fmt, i, h, 1), matrix(down_fmt, h, i, 2)]
    ex = CpuExecutor(h, i, torch.bfloat16, CpuOptions(threads=2, crossover=16))
    expert = ex.prepare_quantized(*mats)
    linear = DenseLinear(2)
    x = torch.randn(16, h, generator=torch.Generator().manual_seed(5)).bfloat16()
    alone = torch.cat([expert(x[t : t + 1]) for t in range(16)])
    rows = torch.cat([linear(x[t : t + 1], mats[0], out_dtype=torch.float32) for t in range(16)])
    for tokens in (2, 8, 11, 16):
        assert ex.isa_for(expert, tokens) == Q8_ISA
        assert torch.equal(expert(x[:tokens]), alone[:tokens]), tokens
        assert torch.equal(linear(x[:tokens], mats[0], out_dtype=torch.float32), rows[:tokens]), tokens


@pytest.mark.skipif("avx512bf16" not in available_isas(), reason="this CPU has no AVX512_BF16")
def test_several_tokens_of_mxfp4_experts_run_against_int8_activations() -> None:
    """gpt-oss's MXFP4 experts under bf16 compute: one token by vdpbf16ps, several against int8 activations like the
    GGUF formats (csrc/q8.c), in calls of BLOCK_STEP tokens; an odd number of blocks in a row (288 = 9 x 32) too."""
    for h, i in ((256, 288), (288, 256)):
        g = torch.Generator().manual_seed(h)
        ex = CpuExecutor(h, i, torch.bfloat16, CpuOptions(threads=2, quant="mxfp4", group=32))
        expert = ex.prepare(*((torch.randn(shape, generator=g) * 0.05) for shape in ((i, h), (i, h), (h, i))))
        gate, up, down = (w.double() for w in expert.dense(torch.float32))
        assert ex._step(expert) == BLOCK_STEP
        for tokens in (2, 9, BLOCK_STEP + 3):
            x = torch.randn(tokens, h, generator=g)  # (float32 out: not rounded to bf16)
            assert ex.isa_for(expert, tokens) == "avx512bf16"
            xq = int8_inputs(x, "mxfp4")
            want = F.linear(int8_inputs(F.silu(xq @ gate.T) * (xq @ up.T), "mxfp4"), down)
            close(expert(x), want, INT8)


def test_a_long_prompt_stays_on_the_kernel_unless_torch_multiplies_bf16_natively(monkeypatch: pytest.MonkeyPatch
                                                                                   ) -> None:
    """Past QUANT_CHUNKS calls of BLOCK_STEP tokens, bf16 tokens go to torch over the dequantized matrix only where
    torch's bf16 product is native (AVX512_BF16, AMX); without it they stay on the kernel, a call per chunk, each
    token's result the one its chunk alone gives. float32 tokens go to torch there either way."""
    import tandem.kernels.choice as choice
    import tandem.kernels.dense as dense

    def no_torch(*args: object, **kwargs: object) -> None:
        raise AssertionError("torch took the product")

    w = matrix("Q8_0", 96, 288, seed=4)
    linear = DenseLinear(2)
    n = choice.QUANT_CHUNKS * BLOCK_STEP + 8
    x = torch.randn(n, 288, generator=torch.Generator().manual_seed(6)).bfloat16()
    chunks = torch.cat([linear(x[i : i + BLOCK_STEP], w, out_dtype=torch.float32) for i in range(0, n, BLOCK_STEP)])
    monkeypatch.setattr(choice, "native_bf16", lambda: False)
    assert choice.quant_chunks(torch.bfloat16) >= 1 << 30 and choice.quant_chunks(torch.float32) == choice.QUANT_CHUNKS
    monkeypatch.setattr(dense, "torch_linear", no_torch)
    assert torch.equal(linear(x, w, out_dtype=torch.float32), chunks)
    with pytest.raises(AssertionError, match="torch took"):
        linear(x.float(), w, out_dtype=torch.float32)
    monkeypatch.setattr(choice, "native_bf16", lambda: True)
    assert choice.quant_chunks(torch.bfloat16) == choice.QUANT_CHUNKS
    with pytest.raises(AssertionError, match="torch took"):
        linear(x, w, out_dtype=torch.float32)
