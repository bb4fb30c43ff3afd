"""One token of the hybrids' recurrent mixers per sequence in one kernel call each (csrc/recur.c): Gated DeltaNet
(`deltanet_step`), Mamba-2 (`ssm_step`), LFM2's gated short convolution (`shortconv_step`), from the input
projection's output to what goes into the output projection, the convolution's and the recurrent state updated in
place. runtime/deltanet.py, runtime/mamba2.py and runtime/shortconv.py hold the torch paths they are tested against.

Everything is float32 and contiguous: the projections p [B, P], the states [B, ...] (a row of a cache, or its
first B rows), the weights. Letters as in csrc/recur.c.
"""

from __future__ import annotations

import ctypes

import torch

from tandem.kernels.attend import ATTEND_ISAS, attend_isa
from tandem.kernels.errors import KernelError
from tandem.kernels.library import DeltaNetArgs, ShortConvArgs, SSMArgs, library


def recur_serves() -> bool:
    """Whether the recurrent steps run here (the kernels built, with a variant this CPU has)."""
    return library() is not None and attend_isa() is not None


def _ptr(t: torch.Tensor | None) -> int | None:
    if t is None:
        return None
    if t.dtype != torch.float32 or not t.is_contiguous():
        raise ValueError("the recurrent steps take contiguous float32 tensors")
    return t.data_ptr()


def _call(name: str, args: ctypes.Structure) -> None:
    code = getattr(library(), f"tk_{name}_step")(ctypes.byref(args))
    if code:  # (-1: a geometry past the kernel's limits, -2: a variant this CPU lacks)
        raise KernelError(f"the {name} kernel cannot run this layer (code {code}: "
                          f"{'its shape' if code == -1 else 'this CPU'}); run with --kernel-isa base or report it")


def deltanet_args(p: torch.Tensor, conv: torch.Tensor, conv_w: torch.Tensor, A: torch.Tensor, dt_bias: torch.Tensor,
                  norm_w: torch.Tensor, ssm: torch.Tensor, key_heads: int, key_dim: int, eps: float, tiled: bool,
                  threads: int, work: torch.Tensor, out: torch.Tensor) -> DeltaNetArgs:
    """`deltanet_step`'s call, planned (work [B, C] and out [B, Hv Dv] given; every tensor kept alive by the
    caller): the one-call decode step (runtime/decode_step.py) runs it from C."""
    B, hv, _, dv = ssm.shape
    isa = ATTEND_ISAS.index(attend_isa())  # type: ignore[arg-type]
    return DeltaNetArgs(B, key_heads, hv, key_dim, dv, conv_w.shape[1], int(tiled), threads, isa, eps, p.stride(0),
                        _ptr(p), _ptr(conv_w), _ptr(A), _ptr(dt_bias), _ptr(norm_w), _ptr(conv), _ptr(ssm),
                        _ptr(work), _ptr(out))


def deltanet_step(p: torch.Tensor, conv: torch.Tensor, conv_w: torch.Tensor, A: torch.Tensor, dt_bias: torch.Tensor,
                  norm_w: torch.Tensor, ssm: torch.Tensor, key_heads: int, key_dim: int, eps: float, tiled: bool,
                  threads: int) -> torch.Tensor:
    """Gated DeltaNet: p [B, C + Hv Dv + 2 Hv], conv [B, C, K-1], conv_w [C, K], A and dt_bias [Hv], norm_w [Dv],
    ssm [B, Hv, Dk, Dv] -> out [B, Hv Dv]."""
    B, hv, _, dv = ssm.shape
    work, out = torch.empty(B, conv.shape[1]), torch.empty(B, hv * dv)
    _call("deltanet", deltanet_args(p, conv, conv_w, A, dt_bias, norm_w, ssm, key_heads, key_dim, eps, tiled, threads,
                                    work, out))
    return out


def ssm_args(p: torch.Tensor, conv: torch.Tensor, conv_w: torch.Tensor, conv_b: torch.Tensor | None, A: torch.Tensor,
             dt_bias: torch.Tensor, D: torch.Tensor, norm_w: torch.Tensor, ssm: torch.Tensor, groups: int,
             dt_limit: tuple[float, float], eps: float, threads: int, work: torch.Tensor, out: torch.Tensor
             ) -> SSMArgs:
    """`ssm_step`'s call, planned (as `deltanet_args`)."""
    B, heads, head_dim, state = ssm.shape
    return SSMArgs(B, heads, head_dim, state, groups, conv_w.shape[1], threads, ATTEND_ISAS.index(attend_isa()), eps,
                   dt_limit[0], min(dt_limit[1], 3.0e38), p.stride(0), _ptr(p), _ptr(conv_w), _ptr(conv_b), _ptr(A),
                   _ptr(dt_bias), _ptr(D), _ptr(norm_w), _ptr(conv), _ptr(ssm), _ptr(work), _ptr(out))


def ssm_step(p: torch.Tensor, conv: torch.Tensor, conv_w: torch.Tensor, conv_b: torch.Tensor | None, A: torch.Tensor,
             dt_bias: torch.Tensor, D: torch.Tensor, norm_w: torch.Tensor, ssm: torch.Tensor, groups: int,
             dt_limit: tuple[float, float], eps: float, threads: int) -> torch.Tensor:
    """Mamba-2: p [B, I + C + Hm], conv [B, C, K-1], conv_w [C, K], conv_b [C] or None, A, dt_bias and D [Hm], norm_w
    [I], ssm [B, Hm, P, N] -> out [B, I]."""
    B, heads, head_dim, _ = ssm.shape
    work, out = torch.empty(B, conv.shape[1]), torch.empty(B, heads * head_dim)
    _call("ssm", ssm_args(p, conv, conv_w, conv_b, A, dt_bias, D, norm_w, ssm, groups, dt_limit, eps, threads, work,
                          out))
    return out


def shortconv_args(p: torch.Tensor, conv: torch.Tensor, conv_w: torch.Tensor, conv_b: torch.Tensor | None,
                   threads: int, out: torch.Tensor) -> ShortConvArgs:
    """`shortconv_step`'s call, planned (as `deltanet_args`)."""
    return ShortConvArgs(p.shape[0], conv.shape[1], conv_w.shape[1], threads, p.stride(0), _ptr(p), _ptr(conv_w),
                         _ptr(conv_b), _ptr(conv), _ptr(out))


def shortconv_step(p: torch.Tensor, conv: torch.Tensor, conv_w: torch.Tensor, conv_b: torch.Tensor | None,
                   threads: int) -> torch.Tensor:
    """LFM2's short convolution: p [B, 3H], conv [B, H, K-1], conv_w [H, K], conv_b [H] or None -> out [B, H]."""
    out = torch.empty(p.shape[0], conv.shape[1])
    _call("shortconv", shortconv_args(p, conv, conv_w, conv_b, threads, out))
    return out
