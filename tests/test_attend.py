"""The one-token attention kernel (kernels/attend.py) against the decoder's torch attention (`attend_cached`), the
reference: the same cache contents bit for bit, the same output within rounding. Every variant this machine runs;
marked `isa`: run again under every CPU feature mask (tests/run_masks.py)."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.attend import ATTEND_ISAS, attend_isa, attend_one, attend_rows
from tandem.kernels.library import available_isas
from tandem.runtime.attention import attend_cached

pytestmark = [pytest.mark.isa, pytest.mark.skipif(attend_isa() is None, reason="the kernels are not built")]

ISAS = [isa for isa in available_isas() if isa in ATTEND_ISAS]
# of the largest output: float32 sums in another order; under bf16 the torch path also rounds the probabilities to
# bf16 (observed up to 0.0072), the kernel keeps them float32
TOL = {torch.float32: 2e-6, torch.bfloat16: 1.6e-2}
C = 80  # cached positions a row


def rope_rows(rot: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables [C, R] as rope_tables lays them out (each half the same angles)."""
    angles = torch.arange(C)[:, None] * 0.5 ** torch.arange(rot // 2)[None, :]  # [C, R/2]
    angles = torch.cat((angles, angles), dim=-1)  # [C, R]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def run_both(dtype: torch.dtype, batch: int, heads: int, kv_heads: int, dim: int, rot: int, start: int,
             window: int | None, sinks: bool, isa: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(start * 7 + heads)
    width = (heads + 2 * kv_heads) * dim
    qkv = (torch.randn(batch, 1, width, generator=g) * 2).to(dtype)  # [B, 1, (Hq + 2 Hkv) * D]
    q, k, v = qkv.split((heads * dim, kv_heads * dim, kv_heads * dim), dim=-1)  # strided views, as the model's
    cache = [torch.randn(batch + 1, kv_heads, C, dim, generator=g).to(dtype) for _ in range(2)]  # a row to spare
    ref_cache = [c.clone() for c in cache]
    cos, sin = rope_rows(rot, dtype)
    sink = (torch.randn(heads, generator=g) * 3).to(dtype) if sinks else None
    first = max(0, start + 1 - window) if window else 0
    want = attend_cached(q.view(batch, 1, heads, dim), k.view(batch, 1, kv_heads, dim),
                         v.view(batch, 1, kv_heads, dim), cos[start : start + 1], sin[start : start + 1],
                         *ref_cache, start, first, window, sink)  # [B, 1, Hq*D]
    got = attend_one(q.reshape(batch, -1), k.reshape(batch, -1), v.reshape(batch, -1), cos[start], sin[start],
                     *cache, start, first, sink, threads=2, isa=isa)  # [B, Hq*D]
    assert torch.equal(cache[0], ref_cache[0]) and torch.equal(cache[1], ref_cache[1])  # roped key, value, nothing else
    return got, want.view(batch, -1)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("batch", "heads", "kv_heads", "dim", "rot", "start", "window", "sinks"), [
    (1, 4, 4, 64, 64, 0, None, False),  # the first token: itself only
    (1, 8, 2, 64, 64, 37, None, False),  # grouped queries
    (2, 6, 3, 48, 32, 70, None, False),  # partial rotary, a head dim not a multiple of 16, two sequences
    (1, 8, 4, 64, 64, 79, 16, False),  # a sliding window, at the last position
    (2, 4, 2, 64, 64, 66, None, True),  # sink logits (gpt-oss), more keys than one step of the online softmax
    (1, 4, 1, 128, 128, 5, 4, True),
    (1, 4, 2, 40, 32, 70, None, False),  # a head dim of 16s and one 8: the vector dots' 8-wide step
    (2, 4, 2, 36, 32, 20, None, True),  # a head dim of no whole 8s at its end: their scalar tails
    (1, 8, 2, 64, 0, 37, None, False),  # no dims rotated (Llama 4's global layers): tables of no columns
])
def test_one_token_matches_the_torch_attention(isa: str, dtype: torch.dtype, batch: int, heads: int, kv_heads: int,
                                               dim: int, rot: int, start: int, window: int | None,
                                               sinks: bool) -> None:
    got, want = run_both(dtype, batch, heads, kv_heads, dim, rot, start, window, sinks, isa)
    assert got.dtype == dtype and got.shape == want.shape
    err = (got.float() - want.float()).abs().max().item()
    assert err <= TOL[dtype] * want.float().abs().max().item(), err


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("window", "chunk", "rot", "sinks"), [
    (None, 0, 32, False), (16, 0, 32, True),
    (None, 16, 32, False),  # Llama 4's chunks: each reads from its own chunk's start (64, 0 and 16)
    (None, 0, 0, False),  # no dims rotated
])
def test_sequences_at_their_own_rows_and_positions_match_one_call_each(isa: str, dtype: torch.dtype,
                                                                       window: int | None, chunk: int, rot: int,
                                                                       sinks: bool) -> None:
    """attend_rows (continuous batching's decode step: one call for every sequence) gives each sequence what
    attend_one gives it alone at its row and position, bit for bit, and writes the same cache cells, nothing else;
    within rounding of the torch reference too. Rows out of order with one skipped, positions on either side of a
    window's edge, of a chunk's and of a step of the online softmax."""
    heads, kv_heads, dim = 8, 2, 64
    rows, starts = [3, 0, 2], [70, 5, 17]
    g = torch.Generator().manual_seed(11)
    q = (torch.randn(len(rows), heads * dim, generator=g) * 2).to(dtype)
    k, v = ((torch.randn(len(rows), kv_heads * dim, generator=g) * 2).to(dtype) for _ in range(2))
    cache = [torch.randn(4, kv_heads, C, dim, generator=g).to(dtype) for _ in range(2)]
    alone, ref = [c.clone() for c in cache], [c.clone() for c in cache]
    cos, sin = rope_rows(rot, dtype)
    sink = (torch.randn(heads, generator=g) * 3).to(dtype) if sinks else None
    got = attend_rows(q, k, v, cos, sin, *cache, rows, starts, window or 0, sink, threads=2, isa=isa,
                      chunk=chunk)  # [S, Hq*D]
    for b, (r, p) in enumerate(zip(rows, starts, strict=True)):
        first = p - p % chunk if chunk else max(0, p + 1 - window) if window else 0
        one = attend_one(q[b : b + 1], k[b : b + 1], v[b : b + 1], cos[p], sin[p], alone[0][r : r + 1],
                         alone[1][r : r + 1], p, first, sink, threads=2, isa=isa)  # [1, Hq*D]
        assert torch.equal(got[b], one[0])
        want = attend_cached(q[b].view(1, 1, heads, dim), k[b].view(1, 1, kv_heads, dim),
                             v[b].view(1, 1, kv_heads, dim), cos[p : p + 1], sin[p : p + 1], ref[0][r : r + 1],
                             ref[1][r : r + 1], p, first, window, sink, chunk=chunk or None)  # [1, 1, Hq*D]
        err = (got[b].float() - want.view(-1).float()).abs().max().item()
        assert err <= TOL[dtype] * want.float().abs().max().item(), err
    assert torch.equal(cache[0], alone[0]) and torch.equal(cache[1], alone[1])
    assert torch.equal(cache[0], ref[0]) and torch.equal(cache[1], ref[1])


@pytest.mark.parametrize(("rows", "starts", "says"), [
    ([0, 0], [3, 4], "distinct"),  # two sequences would write one row
    ([0, 4], [3, 4], "rows must lie"),
    ([0, 1], [3, C], "positions"),
    ([0], [3, 4], "one distinct"),
])
def test_bad_rows_and_positions_are_refused(rows: list[int], starts: list[int], says: str) -> None:
    q, kv = torch.randn(len(rows), 128), torch.randn(len(rows), 128)
    caches = [torch.randn(4, 1, C, 128) for _ in range(2)]
    cos, sin = torch.ones(C, 128), torch.zeros(C, 128)
    with pytest.raises(ValueError, match=says):
        attend_rows(q, kv, kv, cos, sin, *caches, rows, starts)


def test_a_large_sink_takes_the_mass_and_the_output_shrinks() -> None:
    """A sink logit far above every score leaves almost nothing to the values; one far below changes nothing."""
    q, kv = torch.randn(1, 128), torch.randn(1, 128)
    caches = [torch.randn(1, 1, 8, 128) for _ in range(2)]
    cos, sin = torch.ones(128), torch.zeros(128)
    plain = attend_one(q, kv, kv, cos, sin, *[c.clone() for c in caches], 5, 0)
    low = attend_one(q, kv, kv, cos, sin, *[c.clone() for c in caches], 5, 0, sinks=torch.full((1,), -1e4))
    high = attend_one(q, kv, kv, cos, sin, *[c.clone() for c in caches], 5, 0, sinks=torch.full((1,), 1e4))
    assert torch.allclose(low, plain, atol=1e-6)
    assert high.abs().max().item() < 1e-30


@pytest.mark.parametrize(("change", "says"), [
    ({"dtype": torch.float16}, "bf16 or float32"),
    ({"start": C}, "positions"),
    ({"first": 6}, "positions"),
    ({"isa": "amx"}, "one of"),
])
def test_bad_arguments_are_refused(change: dict[str, object], says: str) -> None:
    dtype = change.get("dtype", torch.float32)
    q, kv = torch.randn(1, 128).to(dtype), torch.randn(1, 128).to(dtype)  # type: ignore[arg-type]
    caches = [torch.randn(1, 1, C, 128).to(dtype) for _ in range(2)]  # type: ignore[arg-type]
    cos, sin = torch.ones(128).to(dtype), torch.zeros(128).to(dtype)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=says):
        attend_one(q, kv, kv, cos, sin, *caches, change.get("start", 5), change.get("first", 0),  # type: ignore[arg-type]
                   isa=change.get("isa"))  # type: ignore[arg-type]
