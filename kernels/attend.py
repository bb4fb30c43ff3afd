"""One new token per sequence through attention in one kernel call (csrc/attend.c): RoPE on its query and key, the
key and value written into the layer's KV cache, each query head's softmax over its cached keys (with gpt-oss's sink
logits if given), the values' weighted sum. runtime/model.py's torch path is the reference.

Letters: B sequences, Hq query heads, Hkv key/value heads, D head dim, R rotated dims, C cached positions a row.
"""

from __future__ import annotations

import ctypes

import torch

from tandem.kernels.library import AttendArgs, available_isas, library

ATTEND_ISAS = ("base", "avx2", "avx512")  # the variants its loops are compiled for (ISA_ numbers 0, 1, 2)
MAX_HEAD_DIM = 512


def attend_isa() -> str | None:
    """The variant attend_one runs by default (the widest this CPU, under its feature mask, has), or None where the
    kernels are not built."""
    isas = [isa for isa in available_isas() if isa in ATTEND_ISAS]
    return isas[-1] if isas else None


def attend_serves(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether attend_one takes a model of this compute dtype and head dim on this machine."""
    return attend_isa() is not None and dtype in (torch.bfloat16, torch.float32) and head_dim <= MAX_HEAD_DIM


def attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               kcache: torch.Tensor, vcache: torch.Tensor, start: int, first: int, sinks: torch.Tensor | None = None,
               threads: int = 1, isa: str | None = None, scale: float | None = None) -> torch.Tensor:
    """q [B, Hq*D], k and v [B, Hkv*D] (rows may be strided views, each row contiguous), this position's RoPE tables
    cos and sin [R], the layer's caches [B' >= B, Hkv, C, D] (contiguous), the token's position `start` and the
    first position its keys start at (a sliding window's) -> [B, Hq*D] in the compute dtype. k (roped) and v are
    written into the caches at `start` first. Everything is bf16, or everything float32. `scale`: the scores'
    (None: 1/sqrt(D))."""
    if cos.dim() != 1:
        raise ValueError("cos and sin must be this position's rows [R]")
    C = kcache.shape[2]
    if not 0 <= first <= start < C:
        raise ValueError(f"positions first {first} and start {start} must satisfy 0 <= first <= start < {C}")
    return _attend(q, k, v, cos, sin, kcache, vcache, sinks, threads, isa, start=start, first=first, scale=scale)


def attend_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                kcache: torch.Tensor, vcache: torch.Tensor, rows: list[int], starts: list[int], window: int = 0,
                sinks: torch.Tensor | None = None, threads: int = 1, isa: str | None = None,
                scale: float | None = None, chunk: int = 0) -> torch.Tensor:
    """attend_one for sequences at positions of their own (continuous batching's decode tokens): sequence b is the
    caches' row rows[b] (distinct) at position starts[b], reading the RoPE tables cos and sin [positions, R] at that
    row and its keys from starts[b] + 1 - window (`window` 0: from the first), or from the start of its chunk of
    `chunk` positions (Llama 4's chunked attention; 0: no chunks)."""
    B, C = q.shape[0], kcache.shape[2]
    if len(rows) != B or len(starts) != B or len(set(rows)) != B:
        raise ValueError("attend_rows needs one distinct cache row and one position per sequence")
    if cos.dim() != 2 or window < 0 or chunk < 0 or (window and chunk):
        raise ValueError("cos and sin must be the tables [positions, R], the window and the chunk at least 0, and "
                         "not both set")
    if any(not 0 <= r < kcache.shape[0] for r in rows) or any(not 0 <= s < min(C, cos.shape[0]) for s in starts):
        raise ValueError(f"rows must lie in the caches' {kcache.shape[0]} and positions in [0, {C}) and in the "
                         f"tables' {cos.shape[0]}")
    placed = torch.tensor([rows, starts], dtype=torch.int32)  # [2, B]
    return _attend(q, k, v, cos, sin, kcache, vcache, sinks, threads, isa, placed=placed, window=window, scale=scale,
                   chunk=chunk)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            kcache: torch.Tensor, vcache: torch.Tensor, sinks: torch.Tensor | None, threads: int, isa: str | None,
            start: int = 0, first: int = 0, placed: torch.Tensor | None = None, window: int = 0,
            scale: float | None = None, chunk: int = 0) -> torch.Tensor:
    lib = library()
    isa = isa or attend_isa()
    if lib is None or isa not in ATTEND_ISAS:
        raise ValueError(f"attend_one needs the compiled kernels and one of {', '.join(ATTEND_ISAS)}, not {isa!r}")
    B, (_, Hkv, C, D) = q.shape[0], kcache.shape
    dtype = q.dtype
    tensors = [q, k, v, cos, sin, kcache, vcache] + ([sinks] if sinks is not None else [])
    if dtype not in (torch.bfloat16, torch.float32) or any(t.dtype != dtype or t.device.type != "cpu"
                                                          for t in tensors):
        raise ValueError("attend_one takes bf16 or float32 CPU tensors, all of one dtype")
    if q.dim() != 2 or q.shape[1] % D or k.shape != (B, Hkv * D) or v.shape != (B, Hkv * D):
        raise ValueError(f"q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} do not fit the cache's "
                         f"{Hkv} heads of {D}")
    if any(t.stride(1) != 1 for t in (q, k, v)) or not (kcache.is_contiguous() and vcache.is_contiguous()):
        raise ValueError("q, k and v need contiguous rows, and the caches must be contiguous")
    if vcache.shape != kcache.shape or (placed is None and kcache.shape[0] < B) or cos.shape != sin.shape \
            or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("the caches or the RoPE tables have mismatched shapes, or the tables are not contiguous")
    Hq = q.shape[1] // D
    if sinks is not None and (sinks.shape != (Hq,) or not sinks.is_contiguous()):
        raise ValueError(f"sinks must be [{Hq}]")
    out = torch.empty(B, Hq * D, dtype=dtype)  # [B, Hq*D]
    a = AttendArgs(
        batch=B, heads=Hq, kv_heads=Hkv, dim=D, rot=cos.shape[-1], bf16=int(dtype == torch.bfloat16), threads=threads,
        isa=ATTEND_ISAS.index(isa), start=start, first=first, ld_q=q.stride(0), ld_k=k.stride(0), ld_v=v.stride(0),
        context=C, q=q.data_ptr(), k=k.data_ptr(), v=v.data_ptr(), cos=cos.data_ptr(), sin=sin.data_ptr(),
        kcache=kcache.data_ptr(), vcache=vcache.data_ptr(),
        sinks=sinks.data_ptr() if sinks is not None else None, scale=D ** -0.5 if scale is None else scale,
        out=out.data_ptr(),
        rows=None if placed is None else placed[0].data_ptr(),
        starts=None if placed is None else placed[1].data_ptr(), window=window, chunk=chunk,
    )
    code = lib.tk_attend_one(ctypes.byref(a))
    if code != 0:
        raise ValueError(f"the attention kernel rejected its arguments (code {code})")
    return out
