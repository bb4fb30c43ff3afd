"""Mamba-2, the layer kind "mamba2" (the state-space layers of Granite 4.0-H, most of its layers): its weights
(`Mamba2Weights`), its state (`Mamba2State`: a causal convolution's last K-1 inputs and a [P, N] matrix per head),
its reference (`recurrent_reference`: the recurrence one token at a time, as transformers'
`mamba2_selective_state_update` computes a step), its prompt path (`chunked`, the state-space duality's blocks,
tested against the reference) and its one-token step (`step`).

Per token and head h: in_proj gives the gate z, the convolution's input (x, B and C) and dt; after the causal
depthwise convolution (width K, SiLU), dt = softplus(dt + dt_bias) (clamped to the config's limit), the state
S [P, N] <- exp(dt A) S + dt x B^T (A = -exp(A_log); B and C shared by the heads of a group); the output S C + D x,
times silu(z), RMSNormed per group (norm_before_gate false), through out_proj.

Letters: B batch, T new tokens, N a ragged pass's tokens (in the passes; `Ns` the state size), H hidden size, Hm
heads, P head dim, G groups, I = Hm P, K the convolution's width.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tandem.kernels.quant import QuantizedMatrix
from tandem.kernels.recur import ssm_args, ssm_step
from tandem.runtime.attention import Matrix
from tandem.runtime.config import ModelConfig
from tandem.runtime.layer_kind import Loaders, Shape
from tandem.runtime.recurrent import RecurrentMixer, own_state
from tandem.runtime.state import StateCache

if TYPE_CHECKING:
    from tandem.runtime.families import FamilySpec
    from tandem.runtime.model import MoEModel

CHUNK = 64  # tokens per block of the prompt path


@dataclass
class Mamba2Weights:
    proj: Matrix  # [I + C + Hm, H]: z, then x, B and C (the convolution's C channels), then dt
    conv: torch.Tensor  # [C, K] float32
    A: torch.Tensor  # [Hm] float32: -exp(A_log)
    dt_bias: torch.Tensor  # [Hm] float32
    D: torch.Tensor  # [Hm] float32
    norm: torch.Tensor  # [I] float32: the gated group RMSNorm's weight
    out: torch.Tensor | QuantizedMatrix  # [H, I]
    conv_bias: torch.Tensor | None = None  # [C] float32
    proj_bias: torch.Tensor | None = None  # [I + C + Hm] (cfg.ssm_bias, as out_proj's)
    out_bias: torch.Tensor | None = None


def dims(cfg: ModelConfig) -> tuple[int, int, int]:
    """(I the heads' values, C the convolution's channels, Hm heads)."""
    inner = cfg.ssm_heads * cfg.ssm_head_dim
    return inner, inner + 2 * cfg.ssm_groups * cfg.ssm_state, cfg.ssm_heads


class Mamba2State(StateCache):
    """Each Mamba-2 layer's state per row: the convolution's last K-1 inputs (`conv` [C, K-1]) and the state-space
    matrix (`ssm` [Hm, P, Ns]), both float32 (the kernels' step reads them so)."""

    kind = "mamba2"

    @staticmethod
    def shapes(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, tuple[Shape, torch.dtype]]:
        return {"conv": ((dims(cfg)[1], cfg.conv_kernel - 1), torch.float32),
                "ssm": ((cfg.ssm_heads, cfg.ssm_head_dim, cfg.ssm_state), torch.float32)}


def recurrent_reference(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
                        state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence one token at a time, float32: x [B, Hm, T, P], dt [B, Hm, T] (after softplus), A [Hm], b and
    c [B, Hm, T, Ns] (each head's group's), state [B, Hm, P, Ns] -> (S C per token [B, Hm, T, P], the new state);
    D's skip is the caller's."""
    outs = []
    for t in range(x.shape[2]):
        decay = (dt[:, :, t] * A).exp()[..., None, None]  # [B, Hm, 1, 1]
        state = state * decay + (dt[:, :, t, None] * x[:, :, t])[..., None] * b[:, :, t, None, :]
        outs.append(state @ c[:, :, t, :, None])
    return torch.cat(outs, dim=-1).transpose(-1, -2), state


def chunked(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
            state: torch.Tensor, size: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """`recurrent_reference` over blocks of `size` tokens (shapes as there). In a block, with G_t the cumulative log
    decay (dt A) from its start and S0 the state entering it: the outputs exp(G) C S0^T + (C B^T * exp(G_t - G_s),
    s <= t) (dt x), and the state exp(G_last) S0 + (dt x exp(G_last - G))^T B."""
    B, Hm, T, P = x.shape
    out = torch.empty(B, Hm, T, P, dtype=torch.float32, device=x.device)
    for lo in range(0, T, size):
        hi = min(lo + size, T)
        n = hi - lo
        cum = (dt[:, :, lo:hi] * A[:, None]).cumsum(-1)  # [B, Hm, n]
        seen = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~seen, float("-inf")).exp()  # [B, Hm, n, n]
        bc, cc = b[:, :, lo:hi], c[:, :, lo:hi]
        xdt = x[:, :, lo:hi] * dt[:, :, lo:hi, None]  # [B, Hm, n, P]
        out[:, :, lo:hi] = ((cc @ bc.transpose(-1, -2)) * decay) @ xdt \
            + cum.exp()[..., None] * (cc @ state.transpose(-1, -2))
        last = cum[..., -1:]
        state = last.exp()[..., None] * state + (xdt * (last - cum).exp()[..., None]).transpose(-1, -2) @ bc
    return out, state


def step(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
         state: torch.Tensor) -> torch.Tensor:
    """One token (shapes as `recurrent_reference`'s with T = 1): `state` updated in place -> [B, Hm, 1, P]."""
    state.mul_((dt[:, :, 0] * A).exp()[..., None, None])
    state.add_((dt[:, :, 0, None] * x[:, :, 0])[..., None] * b[:, :, 0, None, :])
    return (state @ c[:, :, 0, :, None]).transpose(-1, -2)


def scan(model: MoEModel, w: Mamba2Weights, p: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor) -> torch.Tensor:
    """One sequence group's projections p [B, T, I + C + Hm] over rows B of `conv` and `ssm` (updated in place) ->
    the gated, normed outputs [B, T, I] in the compute dtype."""
    cfg = model.cfg
    inner, channels, heads = dims(cfg)
    B, T, _ = p.shape
    P, G, Ns = cfg.ssm_head_dim, cfg.ssm_groups, cfg.ssm_state
    if T == 1 and model.recur_kernel:  # one kernel call from here to the gated norm
        out = ssm_step(p[:, 0].float().contiguous(), conv, w.conv, w.conv_bias, w.A, w.dt_bias, w.D, w.norm, ssm, G,
                       cfg.ssm_dt_limit, cfg.rms_norm_eps, model.threads)
        return out.to(p.dtype).view(B, 1, inner)
    z, xbc, dt = p.split((inner, channels, heads), dim=-1)
    seq = torch.cat([conv, xbc.float().transpose(1, 2)], dim=-1)  # [B, C, K-1+T] float32
    conv.copy_(seq[..., seq.shape[-1] - conv.shape[-1] :])
    mixed = F.silu(F.conv1d(seq, w.conv[:, None, :], w.conv_bias, groups=channels)).transpose(1, 2)
    x, b, c = mixed.split((inner, G * Ns, G * Ns), dim=-1)  # [B, T, I], [B, T, G Ns] x 2
    x = x.float().reshape(B, T, heads, P).transpose(1, 2)  # [B, Hm, T, P]
    b, c = (t.float().reshape(B, T, G, Ns).transpose(1, 2).repeat_interleave(heads // G, dim=1) for t in (b, c))
    step_size = F.softplus(dt.float() + w.dt_bias).clamp(*cfg.ssm_dt_limit).transpose(1, 2)  # [B, Hm, T]
    if T == 1:
        y = step(x, step_size, w.A, b, c, ssm)
    else:
        y, last = chunked(x, step_size, w.A, b, c, ssm)
        ssm.copy_(last)
    y = y + w.D[:, None, None] * x  # [B, Hm, T, P]
    y = y.transpose(1, 2).reshape(B, T, inner).to(p.dtype)  # (rounded as transformers' step rounds it)
    gated = y.float() * F.silu(z.float())
    normed = F.rms_norm(gated.view(B, T, G, inner // G), (inner // G,), None, cfg.rms_norm_eps).view(B, T, inner)
    return (w.norm * normed.to(p.dtype)).to(p.dtype)


class Mamba2(RecurrentMixer):
    """The mixer "mamba2" (runtime/layer_kind.py `Mixer`; its passes runtime/recurrent.py's)."""

    name = "mamba2"
    module = "mamba"
    cache = Mamba2State

    def tensors(self, cfg: ModelConfig, spec: FamilySpec | None, layer: int, prefix: str) -> dict[str, Shape]:
        h = cfg.hidden_size
        inner, channels, heads = dims(cfg)
        rows = inner + channels + heads
        out: dict[str, Shape] = {
            f"{prefix}.in_proj.weight": (rows, h), f"{prefix}.conv1d.weight": (channels, 1, cfg.conv_kernel),
            f"{prefix}.dt_bias": (heads,), f"{prefix}.A_log": (heads,), f"{prefix}.D": (heads,),
            f"{prefix}.norm.weight": (inner,), f"{prefix}.out_proj.weight": (h, inner)}
        if cfg.conv_bias:
            out[f"{prefix}.conv1d.bias"] = (channels,)
        if cfg.ssm_bias:
            out |= {f"{prefix}.in_proj.bias": (rows,), f"{prefix}.out_proj.bias": (h,)}
        return out

    def load(self, cfg: ModelConfig, layer: int, prefix: str, load: Loaders) -> Mamba2Weights:
        inner, channels, heads = dims(cfg)
        return Mamba2Weights(
            load.projections([f"{prefix}.in_proj.weight"], [inner + channels + heads]),
            load.f32(f"{prefix}.conv1d.weight").reshape(channels, cfg.conv_kernel),
            -load.f32(f"{prefix}.A_log").exp(), load.f32(f"{prefix}.dt_bias"), load.f32(f"{prefix}.D"),
            load.f32(f"{prefix}.norm.weight"), load.wq(f"{prefix}.out_proj.weight"),
            load.f32(f"{prefix}.conv1d.bias") if cfg.conv_bias else None,
            load.w(f"{prefix}.in_proj.bias") if cfg.ssm_bias else None,
            load.w(f"{prefix}.out_proj.bias") if cfg.ssm_bias else None)

    def step_args(self, model: MoEModel, i: int, w: Mamba2Weights, p: torch.Tensor, out: torch.Tensor
                  ) -> tuple[ctypes.Structure, list[torch.Tensor]]:
        cfg, state = model.cfg, own_state(model.cache, Mamba2State)
        work = torch.empty(1, dims(cfg)[1])
        return ssm_args(p, state.get("conv", i)[:1], w.conv, w.conv_bias, w.A, w.dt_bias, w.D, w.norm,
                        state.get("ssm", i)[:1], cfg.ssm_groups, cfg.ssm_dt_limit, cfg.rms_norm_eps, model.threads,
                        work, out), [work]

    def scan(self, model: MoEModel, i: int, w: Mamba2Weights, p: torch.Tensor, state: Mamba2State,
             rows: int) -> torch.Tensor:
        return scan(model, w, p, state.get("conv", i)[:rows], state.get("ssm", i)[:rows])
