"""Torch's matrix product for what the C kernels do not compute (an accelerator's tensors, a CPU without the built
kernels), with the kernels' numerics: half-precision inputs, float32 sums, and a float32 result kept as it is where
one is asked for.

Why: `F.linear` on bf16 inputs sums in float32 (cuBLAS, oneDNN) but rounds the result to bf16 on the way out. For the
logits that is steps of 1/8 around 16-32, where near ties become exact ties that greedy decoding breaks towards the
lowest token id; for the attention's output projection, a rounding the float32 residual stream was kept to avoid.

Letters: n rows (all leading dimensions together), I input width, O output width.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F

HALF = (torch.bfloat16, torch.float16)


@cache
def _mm_float32_on(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch's `mm(..., out_dtype=float32)` (half-precision inputs, the float32 sums kept) runs on this kind
    of device for this dtype: CUDA in recent torch; no CPU build has it (torch 2.13)."""
    a = torch.ones(2, 16, dtype=dtype, device=device_type)
    try:
        return torch.mm(a, a.t(), out_dtype=torch.float32).dtype == torch.float32
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., I] . w [O, I]^T (+ bias) -> [..., O] in `out_dtype` (default: x's). w is taken in x's dtype (a weight
    kept in another is converted per call). A float32 result of half-precision inputs keeps the float32 sums: on a
    device whose torch has it, the product's own float32 output; elsewhere the product of float32 copies of the same
    inputs (exact products, float32 sums: the same numbers up to the order of summation)."""
    out_dtype = out_dtype or x.dtype
    w = w.to(x.dtype)
    if out_dtype != torch.float32 or x.dtype not in HALF:
        return F.linear(x, w, None if bias is None else bias.to(x.dtype)).to(out_dtype)
    flat = x.reshape(-1, x.shape[-1])  # [n, I]
    if _mm_float32_on(x.device.type, x.dtype):
        y = torch.mm(flat, w.t(), out_dtype=torch.float32)  # [n, O]
    else:
        y = flat.float() @ w.float().t()  # [n, O]
    if bias is not None:
        y += bias.float()
    return y.view(*x.shape[:-1], w.shape[0])
