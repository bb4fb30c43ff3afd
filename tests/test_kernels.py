"""CPU expert kernels against the reference expert: every variant, dtype, quantization, odd shapes, 0/1/many tokens.
Marked `isa`: run again under every CPU feature mask this machine can play (tests/run_masks.py)."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels import choice, experts
from tandem.kernels.dense import DenseLinear, rms_norm_bf16
from tandem.kernels.experts import CpuExecutor, CpuOptions
from tandem.kernels.library import available_isas, library, read_bandwidth_probe
from tandem.kernels.quant import quantize_int4, quantize_int8
from tandem.runtime.moe import ExpertWeights, RoutingRule, combine, reference_moe, route

pytestmark = pytest.mark.isa
ISAS = available_isas()
needs_kernels = pytest.mark.skipif(library() is None, reason="the compiled kernels are not built on this machine")


def weights(h: int, i: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple((torch.randn(shape, generator=g) * 0.05).to(dtype) for shape in ((i, h), (i, h), (h, i)))


def reference(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The reference expert, in float32 on the same (possibly rounded) weights."""
    return ExpertWeights(gate.float(), up.float(), down.float())(x.float())


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).abs().max() / want.abs().max().clamp(min=1e-6)).item()


def test_the_kernels_build_here() -> None:
    # CI machines have gcc: the compiled path must be what runs, not silently the fallback.
    assert library() is not None and "base" in ISAS


# vdpbf16ps and AMX serve bf16 weights with bf16 activations; every other variant serves every weight dtype.
BF16_ONLY = ("avx512bf16", "amx")
VARIANTS = [(isa, w) for isa in ISAS for w in (torch.float32, torch.bfloat16, torch.float16)
            if isa not in BF16_ONLY or w == torch.bfloat16]


@needs_kernels
@pytest.mark.parametrize("isa, wdtype", VARIANTS)
@pytest.mark.parametrize("shape", [(64, 32), (96, 80), (130, 66), (70, 33), (115, 51), (67, 40), (256, 192)])  # odd
@pytest.mark.parametrize("tokens", [1, 2, 3, 5, 8, 12])  # 12: vdpbf16ps rounds the activations (no hi + lo)
def test_every_variant_matches_the_reference(isa: str, wdtype: torch.dtype, shape, tokens: int) -> None:
    h, i = shape
    compute = torch.bfloat16 if isa in BF16_ONLY else torch.float32
    gate, up, down = weights(h, i, wdtype)
    executor = CpuExecutor(h, i, compute, CpuOptions(threads=2, isa=isa, crossover=16))
    expert = executor.prepare(gate, up, down)
    x = torch.randn(tokens, h, generator=torch.Generator().manual_seed(tokens)).to(compute)
    want = reference(x, gate, up, down)
    got = expert(x)
    assert got.shape == (tokens, h) and got.dtype == compute
    assert rel_err(got, want) < (2e-2 if compute == torch.bfloat16 else 1e-5)


# What the automatic choice can take on this CPU (as masked): every weight kind, in both compute dtypes.
AUTO_CASES = [(w, c, None, 64) for w in (torch.float32, torch.bfloat16, torch.float16)
              for c in (torch.float32, torch.bfloat16)] + [
    (torch.float32, c, q, g) for q, g in (("int8", 64), ("int4", 32), ("int4", 64), ("int4", 128), ("mxfp4", 32))
    for c in (torch.float32, torch.bfloat16)]


@needs_kernels
@pytest.mark.parametrize("wdtype, compute, quant, group", AUTO_CASES)
@pytest.mark.parametrize("shape", [(256, 128), (130, 66)])  # whole tiles and blocks, and neither
def test_the_automatic_choice_matches_the_reference_at_every_token_count(wdtype, compute, quant, group, shape
                                                                         ) -> None:
    # From one token to one past the crossover (the kernel, then torch or chunks of the kernel): one expert alone,
    # then the experts of a layer in one call, each on its own number of tokens, then whole layers of a few tokens.
    h, i = shape
    if quant in ("int4", "mxfp4") and (h % group or i % group):
        pytest.skip("int4 and MXFP4 take whole groups")
    executor = CpuExecutor(h, i, compute, CpuOptions(threads=2, quant=quant, group=group))
    experts = [executor.prepare(*weights(h, i, wdtype, seed=s)) for s in range(8)]
    tol = 2e-2 if compute == torch.bfloat16 else 1e-5
    counts = range(1, executor.crossover + 2)
    xs = [torch.randn(n, h, generator=torch.Generator().manual_seed(n)).to(compute) for n in counts]
    for x in xs:
        assert rel_err(experts[0](x), reference(x, *experts[0].dense(torch.float32))) < tol, x.shape[0]
    jobs = [(experts[k % 8], x) for k, x in enumerate(xs)]
    got: dict[int, torch.Tensor] = {}
    executor.run_many(jobs, lambda k, y: got.__setitem__(k, y.clone()))
    for k, (expert, x) in enumerate(jobs):
        assert rel_err(got[k], reference(x, *expert.dense(torch.float32))) < tol, x.shape[0]
    layer, rule = executor.layer(experts), RoutingRule(2, normalize=True)
    reference_experts = [ExpertWeights(*e.dense(torch.float32)) for e in experts]
    for tokens in counts:
        if not executor.serves_layer(layer, tokens):
            continue
        g = torch.Generator().manual_seed(100 + tokens)
        x, logits = torch.randn(tokens, h, generator=g).to(compute), torch.randn(tokens, 8, generator=g)
        weights_, ids = route(logits, rule)
        got_layer = executor.run_layer(layer, x, ids, weights_)
        assert rel_err(got_layer, reference_moe(x.float(), logits, rule, reference_experts)) < tol, tokens


# AMX serves int8 and int4 (integer tiles against 16-bit fixed-point activations; one token on VNNI);
# vdpbf16ps serves neither; MXFP4 runs on base, AVX2 and AVX-512 (AMX machines take the AVX-512 rows for it).
QUANT_VARIANTS = [(q, g, isa) for q, g in (("int8", 64), ("int4", 32), ("int4", 64), ("int4", 128))
                  for isa in ISAS if isa != "avx512bf16"] + [
    ("mxfp4", 32, isa) for isa in ISAS if isa not in BF16_ONLY]


@needs_kernels
@pytest.mark.parametrize("quant, group, isa", QUANT_VARIANTS)
@pytest.mark.parametrize("tokens", [1, 4, 8, 16])
def test_quantized_kernels_match_dequantized_reference(quant: str, group: int, isa: str, tokens: int) -> None:
    h, i = 256, 128
    gate, up, down = weights(h, i, torch.float32)
    compute = torch.bfloat16 if isa == "amx" else torch.float32
    executor = CpuExecutor(h, i, compute, CpuOptions(threads=2, quant=quant, group=group, isa=isa, crossover=16))
    expert = executor.prepare(gate, up, down)
    assert executor.isa_for(expert, tokens) == isa
    x = torch.randn(tokens, h, generator=torch.Generator().manual_seed(7)).to(compute)
    want = reference(x, *expert.dense(torch.float32))
    assert rel_err(expert(x), want) < (2e-2 if compute == torch.bfloat16 else 1e-5)
    assert rel_err(expert(x), reference(x, gate, up, down)) < (0.05 if quant == "int8" else 0.5)


@pytest.mark.skipif("amx" not in ISAS, reason="this CPU (or kernel) has no AMX tiles")
@pytest.mark.parametrize("quant", ["int8", "int4"])
@pytest.mark.parametrize("tokens", [40, 600])  # chunks of 16 through the kernel; past 32 chunks torch
def test_quantized_amx_experts_serve_long_prompts(quant: str, tokens: int) -> None:
    h, i = 256, 128
    gate, up, down = weights(h, i, torch.float32)
    executor = CpuExecutor(h, i, torch.bfloat16, CpuOptions(threads=2, quant=quant, group=64))
    expert = executor.prepare(gate, up, down)
    assert executor.isa_for(expert, 16) == "amx" and expert.amx_layout  # laid out for AMX
    x = torch.randn(tokens, h, generator=torch.Generator().manual_seed(3)).bfloat16()
    assert rel_err(expert(x), reference(x, *expert.dense(torch.float32))) < 2e-2


BLOCK_SHAPES = [
    (4096, 64, 2),  # rows of 4 KiB and of 64 bytes
    (128, 4096, 2),
    (3072, 64, 2),
    (192, 64, 2),  # one token: 12 down blocks, 6 per thread, in quarters of 2, 2, 2, 0
    (320, 192, 2),  # widths of 64 values that are not whole 128s
    (320, 192, 3),  # 20 down blocks on 3 threads: runs of 6, 7, 7, in halves of 4 and 3 (tiles), quarters (VNNI)
    (4096, 4096, 2),
]


@pytest.mark.skipif("amx" not in ISAS, reason="this CPU (or kernel) has no AMX tiles")
@pytest.mark.parametrize(("h", "i", "threads", "quant", "group"), [
    (h, i, threads, quant, group) for h, i, threads in BLOCK_SHAPES
    for quant, group in (("int8", 64), ("int4", 32), ("int4", 64), ("int4", 128))
    if h % group == i % group == 0 and (h * i < 2**24 or group == 64)])  # the largest: one int4 group size
@pytest.mark.parametrize("tokens", [1, 5, 9, 16])  # 9 and 16: tokens 8-15 in a second pass over each block
def test_quantized_amx_blocks_of_short_and_long_rows_match_the_reference(h: int, i: int, threads: int, quant: str,
                                                                          group: int, tokens: int) -> None:
    gate, up, down = weights(h, i, torch.float32)
    executor = CpuExecutor(h, i, torch.bfloat16, CpuOptions(threads=threads, quant=quant, group=group))
    expert = executor.prepare(gate, up, down)
    assert all(m.blocked for m in (expert.gate, expert.up, expert.down))
    assert expert.amx_layout and executor.isa_for(expert, tokens) == "amx"
    x = torch.randn(tokens, h, generator=torch.Generator().manual_seed(tokens)).bfloat16()
    assert rel_err(expert(x), reference(x, *expert.dense(torch.float32))) < 2e-2


@pytest.mark.skipif("amx" not in ISAS, reason="this CPU (or kernel) has no AMX tiles")
@pytest.mark.parametrize(("quant", "group"), [("int8", 64), ("int4", 32), ("int4", 128)])
def test_quantized_amx_layer_experts_with_unequal_token_counts(quant: str, group: int) -> None:
    # One region for all: each thread streams two halves of its run of blocks side by side, so one tile pass
    # pairs blocks of experts with different tokens, and past 8 tokens some blocks have a second pass and their
    # partners none.
    h, i, n_experts = 256, 128, 4
    executor = CpuExecutor(h, i, torch.bfloat16, CpuOptions(threads=2, quant=quant, group=group))
    experts = [executor.prepare(*weights(h, i, torch.float32, seed=s)) for s in range(n_experts)]
    g = torch.Generator().manual_seed(11)
    x = torch.randn(16, h, generator=g).bfloat16()
    ids = torch.tensor([[0, 2]] * 11 + [[1, 3]] * 2 + [[0, 1]] * 3)  # [T, K]: tokens per expert 14, 5, 11, 2; each
    # thread's halves pair experts 0 and 1 (14 and 5 tokens), 2 and 3 (11 and 2)
    w = torch.rand(16, 2, generator=g).softmax(dim=1)  # [T, K]
    layer = executor.layer(experts)
    assert executor.serves_layer(layer, 16) and executor.isa_for(experts[0], 16) == "amx"
    got = executor.run_layer(layer, x, ids, w).clone()
    want = combine(x.float(), w, ids, [ExpertWeights(*e.dense(torch.float32)) for e in experts])
    assert rel_err(got, want) < 2e-2


@pytest.mark.skipif("amx" not in ISAS, reason="this CPU (or kernel) has no AMX tiles")
def test_int8_amx_experts_stay_on_amx_for_long_prompts() -> None:
    # laid out for AMX: with a crossover above what one AMX call takes, 40 tokens still go through AMX in chunks
    # of 16 (not torch, which would first convert the layout back)
    h = i = 256
    executor = CpuExecutor(h, i, torch.bfloat16, CpuOptions(threads=2, quant="int8", crossover=32))
    expert = executor.prepare(*weights(h, i, torch.float32))
    assert executor.isa_for(expert, 32) is None and executor.isa_for(expert, 16) == "amx"
    x = torch.randn(40, h, generator=torch.Generator().manual_seed(40)).bfloat16()
    assert rel_err(expert(x), reference(x, *expert.dense(torch.float32))) < 2e-2


@pytest.mark.skipif("amx" not in ISAS, reason="this CPU (or kernel) has no AMX tiles")
def test_int8_amx_keeps_small_activations_beside_an_outlier() -> None:
    # 16-bit fixed point per token: a value 1000x the others sets the token's scale, and the others must still
    # be resolved (to about 1/32 of their size at worst). The outlier meets zero weights, so the expected
    # output is that of the token without it.
    h, i = 128, 64
    gate, up, down = weights(h, i, torch.float32)
    gate[:, 7] = 0.0
    up[:, 7] = 0.0
    executor = CpuExecutor(h, i, torch.bfloat16, CpuOptions(threads=2, quant="int8", isa="amx"))
    expert = executor.prepare(gate, up, down)
    x = torch.randn(2, h, generator=torch.Generator().manual_seed(5)).bfloat16()
    want = reference(x, *expert.dense(torch.float32))
    x[:, 7] = 1000.0
    assert rel_err(expert(x), want) < 2e-2


@needs_kernels
@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantized_experts_forced_off_amx_never_reach_its_kernels(quant: str) -> None:
    # forced onto a variant that cannot serve them, quantized experts stay in the row-major layout, which the AMX
    # kernels cannot read: whatever runs instead must not be AMX
    forced = "avx512bf16" if "avx512bf16" in ISAS else None
    executor = CpuExecutor(256, 128, torch.bfloat16, CpuOptions(threads=2, quant=quant, isa=forced))
    expert = executor.prepare(*weights(256, 128, torch.float32))
    assert not expert.amx_layout and executor.isa_for(expert, 4) != "amx"
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(4)).bfloat16()
    assert rel_err(expert(x), reference(x, *expert.dense(torch.float32))) < 2e-2


def test_int8_amx_needs_widths_of_64() -> None:
    executor = CpuExecutor(96, 64, torch.bfloat16, CpuOptions(threads=2, quant="int8"))
    expert = executor.prepare(*weights(96, 64, torch.float32))
    assert executor.isa_for(expert, 4) != "amx"
    x = torch.randn(4, 96, generator=torch.Generator().manual_seed(1)).bfloat16()
    assert rel_err(expert(x), reference(x, *expert.dense(torch.float32))) < 2e-2


def test_block_layout_round_trips() -> None:
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(2))
    for q in (quantize_int8(w), *(quantize_int4(w, group) for group in (32, 64, 128))):
        b = q.blocked_layout()
        assert b.blocked and not torch.equal(b.data, q.data)
        assert torch.equal(b.dequantize(), q.dequantize()) and torch.equal(b.row_major().data, q.data)
        assert torch.equal(b.row_major().scales, q.scales)
    with pytest.raises(ValueError):
        quantize_int8(w[:40]).blocked_layout()  # 40 rows: not whole blocks


@pytest.mark.skipif("amx" not in ISAS, reason="this CPU (or kernel) has no AMX tiles")
@pytest.mark.parametrize("shape", [(64, 32), (128, 96), (2048, 768)])
@pytest.mark.parametrize("tokens", [1, 2, 7, 16])
def test_amx_tiles_match_the_reference(shape, tokens: int) -> None:
    h, i = shape
    gate, up, down = weights(h, i, torch.bfloat16)
    executor = CpuExecutor(h, i, torch.bfloat16, CpuOptions(threads=2, isa="amx", crossover=16))
    expert = executor.prepare(gate, up, down)
    assert executor.isa_for(expert, tokens) == "amx"
    x = torch.randn(tokens, h, generator=torch.Generator().manual_seed(tokens)).bfloat16()
    assert rel_err(expert(x), reference(x, gate, up, down)) < 2e-2


def test_quantization_round_trips() -> None:
    w = torch.randn(48, 128, generator=torch.Generator().manual_seed(1))
    q8 = quantize_int8(w)
    assert q8.data.dtype == torch.int8 and (q8.dequantize() - w).abs().max() <= q8.scales.max() / 2 + 1e-6
    for group in (32, 64, 128):
        q4 = quantize_int4(w, group)
        assert q4.data.shape == (48, 64) and q4.scales.shape == (48, 128 // group)
        assert (q4.dequantize() - w).abs().max() <= q4.scales.max() / 2 + 1e-6
        assert q4.scales.dtype == torch.bfloat16 and q4.nbytes == 48 * 64 + 48 * (128 // group) * 2  # 4 bits + bf16
    with pytest.raises(ValueError, match="group"):
        quantize_int4(w, 48)


@pytest.mark.parametrize("use_kernel", [True, False])
def test_token_counts_zero_one_many_and_the_torch_path(use_kernel: bool) -> None:
    h, i = 96, 64
    gate, up, down = weights(h, i, torch.bfloat16)
    executor = CpuOptions(threads=1, crossover=4, use_kernel=use_kernel).executor(h, i, torch.float32)
    expert = executor.prepare(gate, up, down)
    assert expert(torch.empty(0, h)).shape == (0, h)
    for n in (1, 4, 5, 40):  # past the crossover: the tiled kernel (bf16 weights, AVX2 or AVX-512) or torch
        x = torch.randn(n, h, generator=torch.Generator().manual_seed(n))
        assert rel_err(expert(x), reference(x, gate, up, down)) < 1e-5


@needs_kernels
@pytest.mark.parametrize(("wdtype", "tiled"), [
    (torch.bfloat16, True),  # torch would convert the expert each call: the kernel's tiled product instead
    (torch.float16, True),
    (torch.float32, False),  # torch reads them as they are: past one call, torch
])
def test_weights_torch_would_convert_stay_on_the_kernel_in_tiled_calls(wdtype: torch.dtype, tiled: bool,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Float32 compute, past one call of `crossover` tokens: which path runs, and how many calls, just under, at and
    just past the variant's TILED_UP_TO, and between; every result within float32 rounding of the reference."""
    h, i = 96, 64
    gate, up, down = weights(h, i, wdtype)
    executor = CpuExecutor(h, i, torch.float32, CpuOptions(threads=2, crossover=4))
    expert = executor.prepare(gate, up, down)
    isa = executor.isa_for(expert, 4)
    up_to = choice.TILED_UP_TO.get(isa, 0) if tiled else 0  # type: ignore[arg-type]
    paths: list[str] = []
    for name in ("_run_kernel", "_run_torch"):
        real = getattr(executor, name)
        monkeypatch.setattr(executor, name, lambda *a, real=real, name=name: paths.append(name) or real(*a))
    for n in sorted({5, choice.TILED_TOKENS, choice.TILED_CALL + 3, up_to - 1, up_to, up_to + 1} - {-1, 0, 1}):
        paths.clear()
        x = torch.randn(n, h, generator=torch.Generator().manual_seed(n))
        assert rel_err(expert(x), reference(x, gate, up, down)) < 1e-5, n
        want = ["_run_kernel"] * -(-n // choice.TILED_CALL) if n <= up_to else ["_run_torch"]
        assert paths == want, n


@needs_kernels
@pytest.mark.parametrize("isa", [v for v in ("avx2", "avx512") if v in ISAS])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(576, 1536), (130, 66), (40, 26)])  # whole panels of six rows, and not
def test_the_tiled_product_matches_the_reference(isa: str, wdtype: torch.dtype, shape: tuple[int, int]) -> None:
    """Kernel calls of at least TILED_TOKENS tokens (csrc/tiles.c; AVX-512 from twice that), up to a whole
    TILED_CALL and token counts that leave 16-token tiles part empty: alone, as experts of one call (tk_experts),
    with biases and gpt-oss's clamped SwiGLU too."""
    h, i = shape
    gate, up, down = weights(h, i, wdtype)
    executor = CpuExecutor(h, i, torch.float32, CpuOptions(threads=2, crossover=choice.TILED_CALL, isa=isa))
    expert = executor.prepare(gate, up, down)
    xs = [torch.randn(n, h, generator=torch.Generator().manual_seed(n))
          for n in (choice.TILED_TOKENS, 21, 2 * choice.TILED_TOKENS, 45, choice.TILED_CALL)]
    for x in xs:
        assert rel_err(expert(x), reference(x, gate, up, down)) < 1e-5, x.shape[0]
    other = executor.prepare(*weights(h, i, wdtype, seed=1))
    jobs = [(expert if k % 2 else other, x) for k, x in enumerate(xs)]
    got: dict[int, torch.Tensor] = {}
    executor.run_many(jobs, lambda k, y: got.__setitem__(k, y.clone()))
    for k, (e, x) in enumerate(jobs):
        assert rel_err(got[k], reference(x, *e.dense(torch.float32))) < 1e-5, x.shape[0]
    g = torch.Generator().manual_seed(3)
    epilogue = experts.Epilogue(*(torch.randn(d, generator=g) * 0.1 for d in (i, i, h)), clamped=(1.702, 7.0))
    clamped = executor.prepare(gate, up, down, epilogue=epilogue)
    x = torch.randn(37, h, generator=g)
    want = epilogue.run(x, *(w.float() for w in (gate, up, down)))
    assert rel_err(clamped(x), want) < 1e-5


GEGLU_VARIANTS = [(isa, w, q) for isa, w in VARIANTS if w != torch.float16 for q in (None, "int8")
                  if not (q and isa == "avx512bf16")]


@needs_kernels
@pytest.mark.parametrize("isa, wdtype, quant", GEGLU_VARIANTS)
def test_geglu_experts_match_the_reference_on_every_variant(isa: str, wdtype: torch.dtype, quant: str | None
                                                            ) -> None:
    """Gemma's experts (the gate through tanh GELU, `ACT_GELU_TANH`) at one token, a few, a tiled call's and
    torch's counts, alone and as a layer in one kernel call; gates far into both tails (x times 4)."""
    h, i = 130, 66
    compute = torch.bfloat16 if isa in BF16_ONLY else torch.float32
    tol = 2e-2 if compute == torch.bfloat16 else 1e-5
    executor = CpuExecutor(h, i, compute, CpuOptions(threads=2, isa=isa, quant=quant, crossover=16))
    made = [executor.prepare(*weights(h, i, wdtype, seed=s), epilogue=experts.epilogue_for("gelu_tanh"))
            for s in range(4)]
    dense = [ExpertWeights(*e.dense(torch.float32), act="gelu_tanh") for e in made]
    for n in (1, 3, 12, choice.TILED_CALL, 40):
        x = (4 * torch.randn(n, h, generator=torch.Generator().manual_seed(n))).to(compute)
        want = dense[0](x.float())
        got = rel_err(made[0](x), want)
        assert got < tol, n
        # (not SwiGLU's: that is over ten times further off than the kernel, and beyond the tolerance; at bf16 the
        # two differ by 5-8 %, against the kernel's 0.2-0.4 %)
        assert rel_err(ExpertWeights(*made[0].dense(torch.float32))(x.float()), want) > max(tol, 10 * got)
    layer, rule = executor.layer(made), RoutingRule(2, normalize=True)
    for tokens in (1, 4):
        if executor.serves_layer(layer, tokens):
            g = torch.Generator().manual_seed(tokens)
            x, logits = (4 * torch.randn(tokens, h, generator=g)).to(compute), torch.randn(tokens, 4, generator=g)
            weights_, ids = route(logits, rule)
            assert rel_err(executor.run_layer(layer, x, ids, weights_), reference_moe(x.float(), logits, rule, dense)
                           ) < tol, tokens


def test_unquantized_weights_are_used_in_place() -> None:
    gate, up, down = weights(64, 32, torch.bfloat16)
    expert = CpuExecutor(64, 32, torch.bfloat16).prepare(gate, up, down)
    assert expert.gate.data_ptr() == gate.data_ptr() and expert.down.data_ptr() == down.data_ptr()
    assert expert.nbytes == 3 * 64 * 32 * 2


@needs_kernels
def test_forced_fallback_and_unavailable_variant() -> None:
    with pytest.raises(ValueError, match="not available"):
        CpuExecutor(64, 32, torch.float32, CpuOptions(isa="sve"))
    executor = CpuExecutor(64, 32, torch.bfloat16, CpuOptions(isa="avx512bf16" if "avx512bf16" in ISAS else "base"))
    fp32_expert = executor.prepare(*weights(64, 32, torch.float32))
    assert executor.isa_for(fp32_expert) != "avx512bf16"  # bf16 dot products never serve fp32 weights


def test_thread_count_is_explicit() -> None:
    h, i = 128, 64
    gate, up, down = weights(h, i, torch.float32)
    x = torch.randn(3, h)
    outs = [CpuExecutor(h, i, torch.float32, CpuOptions(threads=t)).prepare(gate, up, down)(x).clone() for t in (1, 2)]
    assert torch.allclose(outs[0], outs[1], atol=1e-6)


@needs_kernels
@pytest.mark.parametrize("quant", [None, "int8", "int4", "mxfp4"])
def test_a_layers_experts_in_one_call_match_one_at_a_time(quant: str | None) -> None:
    # run_many: the AMX-able experts of a layer go through one kernel call; others (too many tokens) alone.
    h, i = 256, 128
    executor = CpuExecutor(h, i, torch.bfloat16, CpuOptions(threads=2, quant=quant))
    experts = [executor.prepare(*weights(h, i, torch.float32, seed=s)) for s in range(4)]
    xs = [torch.randn(n, h, generator=torch.Generator().manual_seed(n)).bfloat16() for n in (1, 3, 16, 40)]
    got: dict[int, torch.Tensor] = {}
    executor.run_many(list(zip(experts, xs, strict=True)), lambda k, y: got.__setitem__(k, y.clone()))
    assert sorted(got) == [0, 1, 2, 3]
    for k, (expert, x) in enumerate(zip(experts, xs, strict=True)):
        assert got[k].shape == x.shape
        assert rel_err(got[k], reference(x, *expert.dense(torch.float32))) < 2e-2


@needs_kernels
@pytest.mark.parametrize(("dtype", "quant", "isa"), [(torch.bfloat16, None, None), (torch.bfloat16, "int8", None),
                                                     (torch.bfloat16, "int4", None), (torch.float32, None, "avx2"),
                                                     (torch.float32, None, "avx512"), (torch.float16, None, None)])
@pytest.mark.parametrize("tokens", [1, 3, 16])
def test_a_whole_layer_in_one_call_matches_the_reference_moe(dtype, quant, isa, tokens: int) -> None:
    # run_layer: grouping by expert, the experts, and the weighted sum all in the kernel. 100 experts, top-8:
    # sixteen tokens reach more experts than one region takes (64), so the kernel runs them in two rounds.
    if isa is not None and isa not in ISAS:
        pytest.skip(f"{isa} is not available here")
    h, i, n_experts, k = 256, 128, 100, 8
    executor = CpuExecutor(h, i, dtype, CpuOptions(threads=2, crossover=16, quant=quant, isa=isa))
    experts = [executor.prepare(*weights(h, i, torch.float32, seed=s)) for s in range(n_experts)]
    layer = executor.layer(experts)
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, h, generator=g).to(dtype)
    logits = torch.randn(tokens, n_experts, generator=g)
    rule = RoutingRule(k, normalize=True)
    weights_, ids = route(logits, rule)
    assert executor.serves_layer(layer, tokens)
    got = executor.run_layer(layer, x, ids, weights_).clone()
    reference_experts = [ExpertWeights(*e.dense(torch.float32)) for e in experts]
    want = reference_moe(x.float(), logits, rule, reference_experts)
    assert got.shape == (tokens, h) and got.dtype == torch.float32  # the float32 sum, for the residual stream
    assert rel_err(got, want) < 2e-2
    if dtype == torch.bfloat16:  # read where it lies, or copied first: the same result
        wide = torch.stack([x, x], dim=2).view(tokens, 2 * h)[:, ::2]  # the same x, not contiguous
        assert not wide.is_contiguous() and torch.equal(executor.run_layer(layer, wide, ids, weights_), got)
    if tokens == 16:
        assert len(ids.unique()) > 64  # the two-round case really happened


@needs_kernels
@pytest.mark.parametrize(("dtype", "quant", "isa"), [(torch.float32, "", "avx512"), (torch.float16, "", None),
                                                     (torch.bfloat16, "", None), (torch.bfloat16, "", "amx"),
                                                     (torch.bfloat16, "int4", None), (torch.bfloat16, "int8", None),
                                                     (torch.bfloat16, "int4", "avx512"),
                                                     (torch.bfloat16, "int8", "avx512"),
                                                     (torch.float32, "", "avx2"), (torch.bfloat16, "", "avx2"),
                                                     (torch.float16, "", "avx2"), (torch.bfloat16, "int4", "avx2"),
                                                     (torch.bfloat16, "int8", "avx2")])
def test_one_token_experts_of_a_layer_each_read_their_own_token(dtype, quant: str, isa) -> None:
    # Every expert gets exactly one token and the tokens differ (with one token for all, a mix-up of inputs would
    # go unseen). All experts run in one kernel call: AMX tiles, int4 on VNNI, or AVX-512 or AVX2 rows, where each
    # thread streams four quarters of its run side by side, across the experts' boundaries; one-token int8 on AMX
    # takes 8 experts per activation tile, so 10 make two rounds.
    path = isa or ("amx" if quant else "avx512")  # the path under test
    if path not in ISAS:
        pytest.skip(f"{path} is not available here")
    # AVX-512 and AVX2 rows: 10 x 2 x 131 gate/up rows and 10 x 250 down rows split in two leave quarters of unequal
    # length (rows for the one-row kernel); 131 and 250 values leave values after the last 32-value (AVX2: 16-value)
    # step of each row.
    h, i = (250, 131) if path in ("avx512", "avx2") and quant != "int4" else (256, 128)  # int4: whole groups
    executor = CpuExecutor(h, i, dtype, CpuOptions(threads=2, quant=quant or None, isa=isa))
    stored = torch.float32 if quant else dtype  # weights in the compute dtype, or quantized from float32
    experts = [executor.prepare(*weights(h, i, stored, seed=s)) for s in range(10)]
    assert executor.isa_for(experts[0]) == path
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, h, generator=g).to(dtype)
    ids = torch.arange(10).view(5, 2)  # [T, K]: no expert shared
    w = torch.rand(5, 2, generator=g).softmax(dim=1)  # [T, K]
    got = executor.run_layer(executor.layer(experts), x, ids, w).clone()
    want = combine(x.float(), w, ids, [ExpertWeights(*e.dense(torch.float32)) for e in experts])
    assert rel_err(got, want) < 2e-2


@needs_kernels
def test_run_layer_refuses_what_it_cannot_take() -> None:
    h, i = 64, 32
    executor = CpuExecutor(h, i, torch.float32, CpuOptions(threads=2, crossover=4))
    layer = executor.layer([executor.prepare(*weights(h, i, torch.float32, seed=s)) for s in range(4)])
    assert not executor.serves_layer(layer, 5) and not executor.serves_layer(layer, 0)
    x, w = torch.randn(1, h), torch.ones(1, 2)
    with pytest.raises(ValueError, match="expert ids must be from 0 to 3"):  # expert 4 does not exist
        executor.run_layer(layer, x, torch.tensor([[0, 4]]), w)


@needs_kernels
@pytest.mark.parametrize("tokens", [1, 2, 5, 16, 17])
@pytest.mark.parametrize("shape", [(96, 64), (160, 64), (64, 40)])  # the last is not a whole number of tiles
@pytest.mark.parametrize("threads", [2, 3])  # one token, 160 rows, 3 threads: runs of 53, 53, 54 rows, in quarters
                                             # of 14 rows but the last (11 or 12): rows for the one-row kernel
@pytest.mark.parametrize("isa", [None, *ISAS])  # None: the kernel's own choice by token count
def test_dense_linear_matches_f_linear(tokens: int, shape, threads: int, isa: str | None) -> None:
    out, inp = shape
    g = torch.Generator().manual_seed(tokens)
    w = (torch.randn(out, inp, generator=g) * 0.1).bfloat16()
    bias = torch.randn(out, generator=g).bfloat16()
    x = torch.randn(1, tokens, inp, generator=g).bfloat16()
    linear = DenseLinear(threads=threads, isa=isa)
    for b in (None, bias):
        want = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
        got = linear(x, w, b)
        assert got.shape == (1, tokens, out) and got.dtype == torch.bfloat16
        assert rel_err(got, want) < 2e-2
        kernel = inp % 32 == 0 and tokens <= linear.bf16_most
        assert bool(linear._buffers) == kernel or b is not None  # (more tokens: float32 in chunks, below)
        if kernel and b is None:  # the kernel's own bf16 rounding is torch's
            ys = linear._buffers[(inp, out)][1][:tokens]  # [n, O] float32, as the kernel computed them
            assert torch.equal(got.view(tokens, out), ys.to(torch.bfloat16))
        # float32 sums as they are (logits): bf16 x and w multiply exactly, only the sums round
        exact = linear(x, w, b, out_dtype=torch.float32)
        assert exact.dtype == torch.float32 and rel_err(exact, want) < (1e-5 if inp % 32 == 0 else 1e-2)


@needs_kernels
@pytest.mark.parametrize("tokens", [1, 3, 16, 17, 64, 65])  # 17-64: 16 at a time; 65: torch on a float32 copy
@pytest.mark.parametrize("isa", [None, *[i for i in ISAS if i not in BF16_ONLY]])
def test_dense_linear_takes_float32_x_against_bf16_weights(tokens: int, isa: str | None) -> None:
    # float32 compute keeps bf16 matrices as stored: the result is that of a float32 copy of them
    g = torch.Generator().manual_seed(tokens)
    w = (torch.randn(96, 64, generator=g) * 0.1).bfloat16()
    bias = torch.randn(96, generator=g)
    x = torch.randn(1, tokens, 64, generator=g)
    got = DenseLinear(threads=2, isa=isa)(x, w, bias)
    assert got.dtype == torch.float32 and got.shape == (1, tokens, 96)
    assert rel_err(got, torch.nn.functional.linear(x, w.float(), bias)) < 1e-5
@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("tokens", [1, 3])
def test_a_router_of_eight_rows_runs_as_its_copy_padded_to_32(isa: str, tokens: int) -> None:
    """Rows not in whole groups of 32 (a router of 8 experts): the kernel on a copy with zero rows added, made once,
    whose first rows are the result bit for bit; bias added after; a large such matrix is not copied (below)."""
    from tandem.kernels.dense import PAD_MOST

    g = torch.Generator().manual_seed(3)
    w = (torch.randn(8, 64, generator=g) * 0.1).bfloat16()
    bias = torch.randn(8, generator=g).bfloat16()
    x = torch.randn(1, tokens, 64, generator=g).bfloat16()
    linear = DenseLinear(threads=2, isa=isa)
    padded = linear.padded(w)
    assert padded.shape == (32, 64) and torch.equal(padded[:8], w) and not padded[8:].any()
    assert linear.padded(w) is padded  # made once
    got = linear(x, w, bias)
    assert got.shape == (1, tokens, 8)
    assert torch.equal(got, linear(x, padded)[..., :8] + bias)
    assert linear(x, w).is_contiguous()
    elsewhere = torch.empty(8, 64, dtype=torch.bfloat16, device="meta")  # a matrix on another device: as it is
    assert linear.padded(elsewhere) is elsewhere
    assert rel_err(got.float(), torch.nn.functional.linear(x.float(), w.float(), bias.float())) < 1e-2
    call = linear.one_token_call(w)
    assert call is not None and call[:3] == (padded.data_ptr(), 32, 64)
    big = torch.zeros(PAD_MOST // 2 // 64 + 8, 64, dtype=torch.bfloat16)  # over PAD_MOST, rows not whole groups
    assert linear.padded(big) is big and linear.one_token_call(big) is None


@needs_kernels
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("blocks", [False, True])
def test_a_large_matrix_of_rows_not_in_groups_of_32_runs_its_whole_groups_on_the_kernel(isa: str, blocks: bool) -> None:
    """An lm_head of 49,155 rows (Granite's): too large to pad, its first rows // 32 * 32 run on the kernel, bit for bit
    what the kernel gives for them alone, the last few through torch; bf16 or GGUF blocks alike."""
    from tandem.kernels.blocks import quantize
    from tandem.kernels.dense import PAD_MOST

    g = torch.Generator().manual_seed(5)
    rows = PAD_MOST // 2 // 64 + 35  # 3 rows past whole groups
    w = (torch.randn(rows, 64, generator=g) * 0.1).bfloat16()
    bias = torch.randn(rows, generator=g)
    x = torch.randn(1, 2, 64, generator=g)
    linear = DenseLinear(threads=2, isa=isa)
    k = rows // 32 * 32
    m = quantize(w.float(), "Q8_0") if blocks else w
    got = linear(x, m, bias, out_dtype=torch.float32)
    whole = linear(x, quantize(w.float()[:k], "Q8_0") if blocks else w[:k], out_dtype=torch.float32)
    assert got.shape == (1, 2, rows) and torch.equal(got[..., :k], whole + bias[:k])
    dense = m.dequantize(torch.float32) if blocks else w.float()  # type: ignore[union-attr]
    assert rel_err(got, torch.nn.functional.linear(x, dense, bias)) < 1e-2


@needs_kernels
@pytest.mark.parametrize("n", [0, 5, 1000003])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("streams", [1, 2, 4, 8])
def test_bandwidth_probe_reads_every_value(n: int, threads: int, streams: int) -> None:
    buf = torch.arange(n, dtype=torch.float32) % 7  # small integers: the float sum is exact
    assert read_bandwidth_probe(buf, threads, streams) == float(buf.double().sum())


@needs_kernels
@pytest.mark.parametrize("shape", [(1, 1, 2048), (3, 5, 256), (2, 7, 100), (1, 1, 17)])
def test_rms_norm_kernel_rounds_like_the_reference(shape) -> None:
    from tandem.runtime.model import rms_norm

    g = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(shape, generator=g) * 3).bfloat16()
    w = torch.randn(shape[-1], generator=g).bfloat16()
    assert torch.equal(rms_norm_bf16(x, w, 1e-6), rms_norm(x, w, 1e-6))
    residual = torch.randn(shape, generator=g) * 3  # the float32 residual stream: one rounding, at the end
    assert torch.equal(rms_norm_bf16(residual, w, 1e-6), rms_norm(residual, w, 1e-6))
    assert rms_norm(residual, w, 1e-6).dtype == torch.bfloat16
    qkv = torch.randn(2, 3, 384, generator=g).bfloat16()  # q and k as views into a stacked projection
    q, k, _ = qkv.split((256, 64, 64), -1)
    wq, wk = torch.randn(256, generator=g).bfloat16(), torch.randn(32, generator=g).bfloat16()
    assert torch.equal(rms_norm_bf16(q, wq, 1e-6), rms_norm(q, wq, 1e-6))
    heads = k.reshape(2, 3, 2, 32)  # per-head norm over a non-contiguous view
    assert torch.equal(rms_norm_bf16(heads, wk, 1e-5), rms_norm(heads, wk, 1e-5))
    with pytest.raises(ValueError, match="bf16"):
        rms_norm_bf16(x.half(), w, 1e-6)


@pytest.mark.parametrize("quant,group", [("int8", 64), ("int4", 32), ("int4", 64), ("int4", 128)])
def test_ram_estimate_is_what_a_quantized_expert_takes(quant: str, group: int) -> None:
    # the loader sizes RAM with this estimate before any expert exists
    opts = CpuOptions(threads=1, quant=quant, group=group)
    gen = torch.Generator().manual_seed(3)
    h, i = 256, 128
    gate, up, down = (torch.randn(s, generator=gen).to(torch.bfloat16) for s in ((i, h), (i, h), (h, i)))
    expert = opts.executor(h, i, torch.bfloat16).prepare(gate, up, down)
    assert opts.expert_bytes(h, i, 2) == expert.nbytes
