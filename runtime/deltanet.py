"""Gated DeltaNet, the layer kind "deltanet" (the linear attention of Qwen3-Next and Qwen3.5/3.6, three layers of
four): its weights (`DeltaNetWeights`), its state (`DeltaState`: a causal convolution's last inputs and a
[Dk, Dv] matrix per value head), its reference (`recurrent_reference`: the rule one token at a time, as
transformers' `torch_recurrent_gated_delta_rule` states it), its prompt path (`chunked`, tested against the
reference) and its one-token step (`step`).

Per token t and value head: q, k, v from a causal depthwise convolution (width K, SiLU) over the projection's q, k
and v; q and k L2-normalised, q times Dk^-1/2; beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias) (the
log of the decay). The state S [Dk, Dv]: S <- exp(g) S; S <- S + k (beta (v - S^T k))^T; the output S^T q, then
RMSNormed per head and times silu(z) (the gate), through out_proj. Query/key heads serve Hv/Hk consecutive value
heads each.

Letters: B batch, T new tokens, N a ragged pass's tokens, H hidden size, Hk/Hv key/value heads, Dk/Dv their
dims, C the convolution's channels (2 Hk Dk + Hv Dv), K its width.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tandem.kernels.quant import QuantizedMatrix
from tandem.kernels.recur import deltanet_args, deltanet_step
from tandem.runtime.attention import Matrix, rows_in
from tandem.runtime.config import ModelConfig
from tandem.runtime.layer_kind import Loaders, Shape
from tandem.runtime.recurrent import RecurrentMixer, own_state
from tandem.runtime.state import StateCache

if TYPE_CHECKING:
    from tandem.runtime.families import FamilySpec
    from tandem.runtime.model import MoEModel

CHUNK = 64  # tokens per block of the prompt path: its triangular solve is CHUNK x CHUNK per head


@dataclass
class DeltaNetWeights:
    proj: Matrix  # [2 Hk Dk + 2 Hv Dv + 2 Hv, H]: q, k, v, z, b, a rows, each over all heads, one product
    conv: torch.Tensor  # [C, K] float32: the depthwise convolution over q, k and v
    decay: torch.Tensor  # [Hv] float32: -exp(A_log)
    dt_bias: torch.Tensor  # [Hv] float32
    norm: torch.Tensor  # [Dv] float32: the output's RMSNorm weight (per head)
    out: torch.Tensor | QuantizedMatrix  # [H, Hv Dv]
    proj_bias: None = None  # (none: as the other recurrent mixers' weights, which may have them)
    out_bias: None = None


def dims(cfg: ModelConfig) -> tuple[int, int, int, int]:
    """(key dims Hk Dk, value dims Hv Dv, value heads Hv, convolution channels C)."""
    key, value = cfg.linear_key_heads * cfg.linear_key_dim, cfg.linear_value_heads * cfg.linear_value_dim
    return key, value, cfg.linear_value_heads, 2 * key + value


class DeltaState(StateCache):
    """Each Gated DeltaNet layer's state per row: the convolution's last K-1 inputs (`conv` [C, K-1]) and the
    recurrent matrix (`ssm` [Hv, Dk, Dv]), both float32 (the kernels' step reads them so)."""

    kind = "deltanet"

    @staticmethod
    def shapes(cfg: ModelConfig, dtype: torch.dtype) -> dict[str, tuple[Shape, torch.dtype]]:
        channels = dims(cfg)[3]
        return {"conv": ((channels, cfg.conv_kernel - 1), torch.float32),
                "ssm": ((cfg.linear_value_heads, cfg.linear_key_dim, cfg.linear_value_dim), torch.float32)}


def grouped_order(cfg: ModelConfig) -> torch.Tensor:
    """Qwen3-Next's in_proj_qkvz and in_proj_ba rows (stacked) are grouped by key head: per key head its q, k, then
    its value heads' v and z, then (in_proj_ba) their b and a. -> the row order that makes them q, k, v, z, b, a over
    all heads."""
    hk, dk, dv = cfg.linear_key_heads, cfg.linear_key_dim, cfg.linear_value_dim
    r = cfg.linear_value_heads // hk
    group = 2 * dk + 2 * r * dv  # one key head's rows of in_proj_qkvz
    at = torch.arange(hk)[:, None] * group
    q = (at + torch.arange(dk)).flatten()
    k = (at + dk + torch.arange(dk)).flatten()
    v = (at + 2 * dk + torch.arange(r * dv)).flatten()
    z = (at + 2 * dk + r * dv + torch.arange(r * dv)).flatten()
    ba = hk * group + torch.arange(hk)[:, None] * 2 * r
    b = (ba + torch.arange(r)).flatten()
    a = (ba + r + torch.arange(r)).flatten()
    return torch.cat([q, k, v, z, b, a])


def l2_normed(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + 1e-6) over the last dim (float32), as FLA and transformers compute it."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def recurrent_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                        state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule one token at a time, in float32: q, k [B, Hv, T, Dk] (normalised and scaled), v
    [B, Hv, T, Dv], g and beta [B, Hv, T], state [B, Hv, Dk, Dv] -> (outputs [B, Hv, T, Dv], the new state)."""
    outs = []
    for t in range(q.shape[2]):
        state = state * g[:, :, t].exp()[..., None, None]
        read = (state * k[:, :, t, :, None]).sum(-2)  # [B, Hv, Dv]: what the state predicts for k
        delta = (v[:, :, t] - read) * beta[:, :, t, None]
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        outs.append((state * q[:, :, t, :, None]).sum(-2))
    return torch.stack(outs, dim=2), state


def chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            state: torch.Tensor, size: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """`recurrent_reference` over blocks of `size` tokens (shapes as there). In a block, with G_t the cumulative
    log decay from its start and S0 the state entering it, the values each token writes, u = beta (v - S_{t-1}^T k)
    once decayed, solve (I + A) U = beta V - (beta exp(G) K) S0, A [t, s] = beta_t exp(G_t - G_s) k_t.k_s for s < t
    (one triangular solve); then the outputs exp(G) Q S0 + (Q K^T * exp(G_t - G_s), s <= t) U and the state
    exp(G_last) S0 + (K exp(G_last - G))^T U."""
    B, Hv, T, Dv = v.shape
    out = torch.empty(B, Hv, T, Dv, dtype=torch.float32, device=v.device)
    for lo in range(0, T, size):
        hi = min(lo + size, T)
        n = hi - lo
        qc, kc, vc, bc = q[:, :, lo:hi], k[:, :, lo:hi], v[:, :, lo:hi], beta[:, :, lo:hi]
        cum = g[:, :, lo:hi].cumsum(-1)  # [B, Hv, n]
        seen = torch.ones(n, n, dtype=torch.bool, device=v.device).tril()  # s <= t
        decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~seen, float("-inf")).exp()  # [B, Hv, n, n]
        system = (kc @ kc.transpose(-1, -2)) * decay * bc[..., :, None]
        system = system.tril(-1) + torch.eye(n, device=v.device)
        rhs = torch.cat([vc * bc[..., None], kc * (bc * cum.exp())[..., None]], dim=-1)  # [B, Hv, n, Dv + Dk]
        solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        written = solved[..., :Dv] - solved[..., Dv:] @ state  # [B, Hv, n, Dv]
        out[:, :, lo:hi] = (qc * cum.exp()[..., None]) @ state + ((qc @ kc.transpose(-1, -2)) * decay) @ written
        last = cum[..., -1:]  # [B, Hv, 1]
        state = last.exp()[..., None] * state + (kc * (last - cum).exp()[..., None]).transpose(-1, -2) @ written
    return out, state


def step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
         state: torch.Tensor) -> torch.Tensor:
    """One token (shapes as `recurrent_reference`'s with T = 1): `state` updated in place -> outputs [B, Hv, 1, Dv]."""
    state.mul_(g[:, :, 0].exp()[..., None, None])
    read = torch.einsum("bhkv,bhk->bhv", state, k[:, :, 0])
    delta = (v[:, :, 0] - read) * beta[:, :, 0, None]
    state.add_(k[:, :, 0, :, None] * delta[:, :, None, :])
    return torch.einsum("bhkv,bhk->bhv", state, q[:, :, 0])[:, :, None]


def scan(model: MoEModel, w: DeltaNetWeights, p: torch.Tensor, conv: torch.Tensor, ssm: torch.Tensor
         ) -> torch.Tensor:
    """One sequence group's projections p [B, T, P] (rows B of `conv` [B, C, K-1] and `ssm` [B, Hv, Dk, Dv], both
    updated in place) -> the heads' gated, normed outputs [B, T, Hv Dv] in the compute dtype."""
    cfg = model.cfg
    key, value, hv, channels = dims(cfg)
    B, T, _ = p.shape
    dk, dv = cfg.linear_key_dim, cfg.linear_value_dim
    if T == 1 and model.recur_kernel:  # one kernel call from here to the gated norm
        out = deltanet_step(p[:, 0].float().contiguous(), conv, w.conv, w.decay, w.dt_bias, w.norm, ssm,
                            cfg.linear_key_heads, dk, cfg.rms_norm_eps, cfg.linear_tiled, model.threads)
        return out.to(p.dtype).view(B, 1, value)
    qkv, z, b, a = p.split((channels, value, hv, hv), dim=-1)
    seq = torch.cat([conv, qkv.float().transpose(1, 2)], dim=-1)  # [B, C, K-1+T] float32
    conv.copy_(seq[..., seq.shape[-1] - conv.shape[-1] :])
    mixed = F.silu(F.conv1d(seq, w.conv[:, None, :], groups=channels)).transpose(1, 2)  # [B, T, C]
    q, k, v = mixed.split((key, key, value), dim=-1)
    r = hv // cfg.linear_key_heads
    heads = [t.float().reshape(B, T, -1, d).transpose(1, 2) for t, d in ((q, dk), (k, dk), (v, dv))]
    q, k, v = heads  # [B, Hk, T, Dk] x 2, [B, Hv, T, Dv]
    if cfg.linear_tiled:  # [B, Hv, T, Dk]: value head j reads key head j % Hk, or j // r
        q, k = (l2_normed(t).repeat(1, r, 1, 1) for t in (q, k))
    else:
        q, k = (l2_normed(t).repeat_interleave(r, dim=1) for t in (q, k))
    q = q * dk ** -0.5
    beta = b.sigmoid().float().transpose(1, 2)  # [B, Hv, T]
    g = (w.decay * F.softplus(a.float() + w.dt_bias)).transpose(1, 2)  # [B, Hv, T]
    if T == 1:
        out = step(q, k, v, g, beta, ssm)
    else:
        out, last = chunked(q, k, v, g, beta, ssm)
        ssm.copy_(last)
    out = out.transpose(1, 2).to(p.dtype)  # [B, T, Hv, Dv], rounded as transformers rounds it
    normed = F.rms_norm(out.float(), (dv,), None, cfg.rms_norm_eps)
    gated = (w.norm * normed.to(p.dtype)) * F.silu(z.reshape(B, T, hv, dv).float())
    return gated.to(p.dtype).reshape(B, T, value)


class GatedDeltaNet(RecurrentMixer):
    """The mixer "deltanet" (runtime/layer_kind.py `Mixer`; its passes runtime/recurrent.py's)."""

    name = "deltanet"
    module = "linear_attn"
    cache = DeltaState

    def tensors(self, cfg: ModelConfig, spec: FamilySpec | None, layer: int, prefix: str) -> dict[str, Shape]:
        h = cfg.hidden_size
        key, value, hv, channels = dims(cfg)
        out: dict[str, Shape] = {
            f"{prefix}.conv1d.weight": (channels, 1, cfg.conv_kernel), f"{prefix}.dt_bias": (hv,),
            f"{prefix}.A_log": (hv,), f"{prefix}.norm.weight": (cfg.linear_value_dim,),
            f"{prefix}.out_proj.weight": (h, value)}
        if spec is not None and spec.deltanet_grouped:
            return out | {f"{prefix}.in_proj_qkvz.weight": (2 * key + 2 * value, h),
                          f"{prefix}.in_proj_ba.weight": (2 * hv, h)}
        return out | {f"{prefix}.in_proj_qkv.weight": (channels, h), f"{prefix}.in_proj_z.weight": (value, h),
                      f"{prefix}.in_proj_b.weight": (hv, h), f"{prefix}.in_proj_a.weight": (hv, h)}

    def load(self, cfg: ModelConfig, layer: int, prefix: str, load: Loaders) -> DeltaNetWeights:
        key, value, hv, channels = dims(cfg)
        if load.spec.deltanet_grouped:
            proj = load.projections([f"{prefix}.in_proj_qkvz.weight", f"{prefix}.in_proj_ba.weight"],
                                    [2 * key + 2 * value, 2 * hv])
            proj = rows_in(proj, grouped_order(cfg))
        else:  # q, k, v and z apart from b and a: a GGUF file keeps the small b and a in F32 beside quantized rest,
            # and the rest stays as stored rather than the four stacked as floats
            names = [f"{prefix}.in_proj_{n}.weight" for n in ("qkv", "z", "b", "a")]
            main, small = load.projections(names[:2], [channels, value]), load.projections(names[2:], [hv, hv])
            both = [main, small]
            if all(isinstance(m, torch.Tensor) for m in both):
                proj: Matrix = torch.cat([main, small.to(main.dtype)])  # type: ignore[union-attr, list-item]
            else:  # (DenseLinear runs each and puts their outputs side by side)
                proj = [m for part in both for m in (part if isinstance(part, list) else [part])]  # type: ignore[misc]
        conv = load.f32(f"{prefix}.conv1d.weight")
        return DeltaNetWeights(proj, conv.reshape(channels, cfg.conv_kernel), -load.f32(f"{prefix}.A_log").exp(),
                               load.f32(f"{prefix}.dt_bias"), load.f32(f"{prefix}.norm.weight"),
                               load.wq(f"{prefix}.out_proj.weight"))

    def step_args(self, model: MoEModel, i: int, w: DeltaNetWeights, p: torch.Tensor, out: torch.Tensor
                  ) -> tuple[ctypes.Structure, list[torch.Tensor]]:
        cfg, state = model.cfg, own_state(model.cache, DeltaState)
        work = torch.empty(1, dims(cfg)[3])
        return deltanet_args(p, state.get("conv", i)[:1], w.conv, w.decay, w.dt_bias, w.norm, state.get("ssm", i)[:1],
                             cfg.linear_key_heads, cfg.linear_key_dim, cfg.rms_norm_eps, cfg.linear_tiled,
                             model.threads, work, out), [work]

    def scan(self, model: MoEModel, i: int, w: DeltaNetWeights, p: torch.Tensor, state: DeltaState,
             rows: int) -> torch.Tensor:
        return scan(model, w, p, state.get("conv", i)[:rows], state.get("ssm", i)[:rows])
