"""Gated short convolutions, the layer kind "shortconv" (LFM2's token mixer, on most of its layers): its weights
(`ShortConvWeights`), its state (`ShortConvState`: the convolution's last K-1 inputs per row), its reference
(`reference`, as transformers' `Lfm2MoeShortConv` computes it, the whole sequence at once) and its pass, which
carries the state from pass to pass (`scan`, tested against the reference over prompts cut anywhere).

Per token: in_proj gives B, C and x (H each); the causal depthwise convolution (width K, no activation) runs over
B * x; its output times C goes through out_proj.

Letters: B batch (the rows; not the gate), T new tokens, N a ragged pass's tokens, H hidden size, K the width.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tandem.kernels.quant import QuantizedMatrix
from tandem.kernels.recur import shortconv_args, shortconv_step
from tandem.runtime.attention import Matrix
from tandem.runtime.config import ModelConfig
from tandem.runtime.layer_kind import Loaders, Shape
from tandem.runtime.recurrent import RecurrentMixer, own_state
from tandem.runtime.state import StateCache

if TYPE_CHECKING:
    from tandem.runtime.families import FamilySpec
    from tandem.runtime.model import MoEModel


@dataclass
class ShortConvWeights:
    proj: Matrix  # [3H, H]: B, C and x rows
    conv: torch.Tensor  # [H, K] float32
    out: torch.Tensor | QuantizedMatrix  # [H, H]
    proj_bias: torch.Tensor | None = None  # [3H] (cfg.conv_bias, as the conv's and out_proj's)
    conv_bias: torch.Tensor | None = None  # [H] float32
    out_bias: torch.Tensor | None = None  # [H]


class ShortConvState(StateCache):
    """Each short-convolution layer's last K-1 inputs (B * x) per row: `conv` [H, K-1], float32."""

    kind = "shortconv"

    @staticmethod
    def shapes(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, tuple[Shape, torch.dtype]]:
        return {"conv": ((cfg.hidden_size, cfg.conv_kernel - 1), torch.float32)}


def reference(x: torch.Tensor, w: ShortConvWeights) -> torch.Tensor:
    """The mixer over a whole sequence from its start, in plain PyTorch: x [B, T, H] -> [B, T, H] (before out_proj's
    bias is added: with it)."""
    H, K = w.conv.shape
    bcx = F.linear(x, w.proj, w.proj_bias).transpose(1, 2)  # type: ignore[arg-type]  # [B, 3H, T]
    b, c, v = bcx.chunk(3, dim=1)
    conv = F.conv1d(b * v, w.conv[:, None, :], w.conv_bias, padding=K - 1, groups=H)[..., : x.shape[1]]
    return F.linear((c * conv).transpose(1, 2), w.out, w.out_bias)  # type: ignore[arg-type]


def scan(w: ShortConvWeights, p: torch.Tensor, conv: torch.Tensor, threads: int = 0) -> torch.Tensor:
    """One sequence group's projections p [B, T, 3H] over rows B of `conv` [B, H, K-1] (updated in place) -> the
    gated convolution [B, T, H] in the compute dtype. `threads`: one token goes through the kernel (0: torch)."""
    B, T, _ = p.shape
    if T == 1 and threads:
        out = shortconv_step(p[:, 0].float().contiguous(), conv, w.conv, w.conv_bias, threads)
        return out.to(p.dtype).view(B, 1, -1)
    b, c, v = p.float().chunk(3, dim=-1)
    seq = torch.cat([conv, (b * v).transpose(1, 2)], dim=-1)  # [B, H, K-1+T] float32
    conv.copy_(seq[..., seq.shape[-1] - conv.shape[-1] :])
    out = F.conv1d(seq, w.conv[:, None, :], w.conv_bias, groups=w.conv.shape[0])  # [B, H, T]
    return (c * out.transpose(1, 2)).to(p.dtype)


class ShortConv(RecurrentMixer):
    """The mixer "shortconv" (runtime/layer_kind.py `Mixer`; its passes runtime/recurrent.py's)."""

    name = "shortconv"
    module = "conv"
    cache = ShortConvState

    def tensors(self, cfg: ModelConfig, spec: FamilySpec | None, layer: int, prefix: str) -> dict[str, Shape]:
        h = cfg.hidden_size
        out: dict[str, Shape] = {f"{prefix}.conv.weight": (h, 1, cfg.conv_kernel),
                                 f"{prefix}.in_proj.weight": (3 * h, h), f"{prefix}.out_proj.weight": (h, h)}
        if cfg.conv_bias:
            out |= {f"{prefix}.conv.bias": (h,), f"{prefix}.in_proj.bias": (3 * h,), f"{prefix}.out_proj.bias": (h,)}
        return out

    def load(self, cfg: ModelConfig, layer: int, prefix: str, load: Loaders) -> ShortConvWeights:
        h = cfg.hidden_size
        bias = cfg.conv_bias
        return ShortConvWeights(
            load.projections([f"{prefix}.in_proj.weight"], [3 * h]),
            load.f32(f"{prefix}.conv.weight").reshape(h, cfg.conv_kernel), load.wq(f"{prefix}.out_proj.weight"),
            load.w(f"{prefix}.in_proj.bias") if bias else None, load.f32(f"{prefix}.conv.bias") if bias else None,
            load.w(f"{prefix}.out_proj.bias") if bias else None)

    def step_args(self, model: MoEModel, i: int, w: ShortConvWeights, p: torch.Tensor, out: torch.Tensor
                  ) -> tuple[ctypes.Structure, list[torch.Tensor]]:
        state = own_state(model.cache, ShortConvState)
        return shortconv_args(p, state.get("conv", i)[:1], w.conv, w.conv_bias, model.threads, out), []

    def scan(self, model: MoEModel, i: int, w: ShortConvWeights, p: torch.Tensor, state: ShortConvState,
             rows: int) -> torch.Tensor:
        return scan(w, p, state.get("conv", i)[:rows], model.threads if model.recur_kernel else 0)
