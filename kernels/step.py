"""One decode token through a run of planned decoder layers in one kernel call (csrc/step.c). A layer's arguments are
kernels/library.py's `LayerArgs`, planned from a model in runtime/decode_step.py."""

from __future__ import annotations

import ctypes

import torch

from tandem.kernels.library import LayerArgs, library

QK_NORMS = {"none": 0, "full": 1, "head": 2}  # csrc/step.c's QK_NORM_
SCORINGS = {"softmax": 0, "softmax_topk": 1, "sigmoid": 2}  # its SCORE_
MAX_EXPERTS, MAX_TOP_K = 1024, 64
FFN_ROUTED, FFN_SHARED, FFN_DENSE = 0, 1, 2  # its FFN_: routed experts, and a shared SwiGLU, or that SwiGLU alone
MIXERS = {"attention": 0, "deltanet": 1, "mamba2": 2, "shortconv": 3}  # its MIX_: the token mixers it runs


def decode_layers(layers: ctypes.Array[LayerArgs], x: torch.Tensor, start: int, cos: torch.Tensor,
                  sin: torch.Tensor) -> None:
    """x [H] float32 (the residual stream, updated in place) through the planned layers at position `start`, whose
    RoPE tables are cos and sin [R] (contiguous, the layers' dtype)."""
    lib = library()
    if lib is None:
        raise ValueError("decode_layers needs the compiled kernels")
    if x.dtype != torch.float32 or not x.is_contiguous() or x.numel() != layers[0].hidden:
        raise ValueError(f"x must be {layers[0].hidden} contiguous float32 values")
    rot = max(layer.attend.rot for layer in layers)  # (a recurrent mixer's layer, or one without RoPE: 0)
    if not (cos.is_contiguous() and sin.is_contiguous() and cos.numel() == sin.numel() >= rot):
        raise ValueError("cos and sin must be this position's contiguous rows of the RoPE tables")
    code = lib.tk_decode_layers(layers, len(layers), x.data_ptr(), start, cos.data_ptr(), sin.data_ptr())
    if code != 0:
        raise RuntimeError(f"the decode step's kernels rejected their arguments (code {code})")
