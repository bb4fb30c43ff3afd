"""Multi-head Latent Attention (DeepSeek-V2/V3, Kimi, Moonlight), with its own cache of latents.

MLA compresses each token's keys and values into one latent of `kv_lora_rank` dims (after an RMSNorm) plus one
rotated key of `qk_rope_head_dim` dims that every head shares; `kv_b_proj` expands the latent into each head's
unrotated key (`qk_nope_head_dim`) and value (`v_head_dim`). The cache (`LatentCache`) keeps the latent and the
rotated key, never the expanded keys and values:

    bytes per token per layer, bf16:   latent cache (C + Dr) * 2   vs   full K/V Hq * (Dn + Dr + Dv) * 2
    DeepSeek-V2-Lite, Moonlight-16B    (512 + 64) * 2 = 1,152       vs   16 * (128 + 64 + 128) * 2 = 10,240  (8.9x)
    DeepSeek-V3/R1, Kimi K2            (512 + 64) * 2 = 1,152       vs  128 * (128 + 64 + 128) * 2 = 81,920  (71x)
    (Kimi K2 has 64 heads: 40,960, 36x.)

Attention runs in one of two equivalent ways (`attend`): expand the cached latents into keys and values (as
transformers does; cheaper when many queries share them, i.e. a long prefill), or absorb `kv_b_proj` into the
queries and the output (the keys are then the latents themselves, one "head" shared by all: cheaper for a few
queries, i.e. decode). This module is the layer kind (`LatentAttention`, the mixer "mla", which a config with
`kv_lora_rank` declares for its layers).

Letters: B batch, T new tokens, S cached + new tokens, H hidden size, Hq heads, C kv_lora_rank, Dn qk_nope_head_dim,
Dr qk_rope_head_dim, Dv v_head_dim.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tandem.kernels.errors import UnsupportedModelError
from tandem.runtime.accelerator import Accelerator
from tandem.runtime.config import ModelConfig
from tandem.runtime.layer_kind import Loaders, Shape
from tandem.runtime.prefix import HeldTokens
from tandem.runtime.rope import apply_rope, yarn_mscale

if TYPE_CHECKING:
    from tandem.runtime.families import FamilySpec
    from tandem.runtime.model import MoEModel, Segment

Linear = Callable[..., torch.Tensor]  # MoEModel.linear: (x, weight, bias=None, out_dtype=None) -> x @ weight.T
Norm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]  # MoEModel.rms_norm


@dataclass
class MLAWeights:
    kv_a: torch.Tensor  # kv_a_proj_with_mqa [C + Dr, H]
    kv_a_norm: torch.Tensor  # [C]
    kv_b: torch.Tensor  # [Hq * (Dn + Dv), C], in the compute dtype (the absorbed path multiplies by its slices)
    o: torch.Tensor  # [H, Hq * Dv]
    q: torch.Tensor | None = None  # q_proj [Hq * (Dn + Dr), H], without q_lora_rank; else the three below
    q_a: torch.Tensor | None = None  # [q_lora_rank, H]
    q_a_norm: torch.Tensor | None = None  # [q_lora_rank]
    q_b: torch.Tensor | None = None  # [Hq * (Dn + Dr), q_lora_rank]


def mla_tensors(cfg: ModelConfig, prefix: str) -> dict[str, Shape]:
    """The attention tensors of one layer under `prefix` (`model.layers.N.self_attn`), with their shapes."""
    h, heads, q_dim = cfg.hidden_size, cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    out: dict[str, Shape] = {
        f"{prefix}.kv_a_proj_with_mqa.weight": (cfg.kv_lora_rank + cfg.qk_rope_head_dim, h),
        f"{prefix}.kv_a_layernorm.weight": (cfg.kv_lora_rank,),
        f"{prefix}.kv_b_proj.weight": (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
        f"{prefix}.o_proj.weight": (h, heads * cfg.v_head_dim),
    }
    if cfg.q_lora_rank:
        out |= {f"{prefix}.q_a_proj.weight": (cfg.q_lora_rank, h), f"{prefix}.q_a_layernorm.weight": (cfg.q_lora_rank,),
                f"{prefix}.q_b_proj.weight": (heads * q_dim, cfg.q_lora_rank)}
    else:
        out[f"{prefix}.q_proj.weight"] = (heads * q_dim, h)
    return out


def load_mla(cfg: ModelConfig, prefix: str, w: Callable[[str], torch.Tensor]) -> MLAWeights:
    """One layer's weights, each placed by `w` as the decoder keeps it (kv_b_proj is not among
    `weights.dense_matrices`, so it is kept in the compute dtype)."""
    q = (None, w(f"{prefix}.q_a_proj.weight"), w(f"{prefix}.q_a_layernorm.weight"), w(f"{prefix}.q_b_proj.weight")) \
        if cfg.q_lora_rank else (w(f"{prefix}.q_proj.weight"), None, None, None)
    return MLAWeights(w(f"{prefix}.kv_a_proj_with_mqa.weight"), w(f"{prefix}.kv_a_layernorm.weight"),
                      w(f"{prefix}.kv_b_proj.weight"), w(f"{prefix}.o_proj.weight"), *q)


def softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(Dn + Dr), times mscale(factor, mscale_all_dim)^2 under a scaled RoPE that gives mscale_all_dim (as
    transformers' `yarn_apply_mscale`: the logits of a stretched context are sharpened back)."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    params = dict(cfg.rope_params)
    if cfg.rope_type != "default" and params.get("mscale_all_dim"):
        scale *= yarn_mscale(params["factor"], params["mscale_all_dim"]) ** 2
    return scale


class LatentCache:
    """Each token's latent and shared rotated key, [layers, B, context, C + Dr]: the latent first (after its RMSNorm),
    the rotated key last. Offers what the engine asks of `attention.KVCache` (`batch`, `context`, `copy_rows`,
    `nbytes`)."""

    def __init__(
        self, cfg: ModelConfig, batch: int, context: int, dtype: torch.dtype, accel: Accelerator | None = None,
        layers: Sequence[int] | None = None,
    ) -> None:
        if layers is not None and list(layers) != list(range(cfg.num_layers)):
            raise UnsupportedModelError("this model's layers mix Multi-head Latent Attention with other token "
                                        "mixers; that is not supported yet")
        shape = (cfg.num_layers, batch, context, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        self.latent = torch.empty(shape, dtype=dtype) if accel is None else accel.empty(shape, dtype, "the KV cache")
        self.context = context
        self.batch = batch
        self.held = HeldTokens(batch, context)  # the tokens each row holds (runtime/prefix.py)

    def copy_rows(self, pairs: list[tuple[int, int]], length: int) -> None:
        """Beam search: for each (dst, src), batch row dst takes the first `length` positions of row src (no row may be
        both, as in KVCache.copy_rows)."""
        if {d for d, _ in pairs} & {s for _, s in pairs}:
            raise ValueError("copy_rows: a row cannot be both a source and a destination")
        for d, s in pairs:
            self.latent[:, d, :length].copy_(self.latent[:, s, :length])
        self.held.copy_rows(pairs, length)

    def snapshot(self, row: int, n: int) -> tuple[torch.Tensor]:
        """Row `row`'s first n positions (a view): [layers, n, C + Dr]."""
        return (self.latent[:, row, :n],)

    def restore(self, row: int, parts: tuple[torch.Tensor, ...], n: int) -> None:
        """The first n positions of a `snapshot` back into row `row`."""
        for i in range(parts[0].shape[0]):  # a layer at a time (see KVCache.restore)
            self.latent[i, row, :n].copy_(parts[0][i, :n])

    def row(self, r: int) -> LatentCache:
        """Batch row r alone, as a cache of one row (views, as KVCache.row)."""
        view = copy.copy(self)
        view.latent, view.batch = self.latent[:, r : r + 1], 1
        view.held = self.held.row(r)
        return view

    @staticmethod
    def nbytes(cfg: ModelConfig, batch: int, context: int, dtype: torch.dtype,
               layers: Sequence[int] | None = None) -> int:
        item = torch.empty((), dtype=dtype).element_size()
        count = cfg.num_layers if layers is None else len(layers)
        return count * batch * context * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * item


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., R] with rotary pairs (x0, x1), (x2, x3)... -> [x0, x2, ..., x1, x3, ...], the halves layout apply_rope
    rotates. Queries and keys get the same permutation, so their dot products, all attention sees, are unchanged."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)  # [..., R/2, 2] -> [..., 2, R/2] -> [..., R]


def absorbs(cfg: ModelConfig, tokens: int) -> bool:
    """Whether `tokens` queries attend through the absorbed path: per cached token it costs about 2 C multiply-adds
    per query and head, the expanded path C (Dn + Dv) once per head to expand it (then Dn + Dr + Dv per query)."""
    return 2 * tokens < cfg.qk_nope_head_dim + cfg.v_head_dim


def attend(cfg: ModelConfig, a: MLAWeights, cache: LatentCache, i: int, x: torch.Tensor, start: int,
           cos: torch.Tensor, sin: torch.Tensor, linear: Linear, rms_norm: Norm,
           absorb: bool | None = None) -> torch.Tensor:
    """Layer i's attention: x [B, T, H] at positions start..start+T-1 -> [B, T, H] float32 (into the residual
    stream, unrounded); writes the tokens' latents into the cache. `absorb` forces a path (None: `absorbs`)."""
    B, T, _ = x.shape
    Hq, C, Dn, Dr, Dv = cfg.num_heads, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    eps = cfg.rms_norm_eps
    q = linear(x, a.q) if a.q is not None else linear(rms_norm(linear(x, a.q_a), a.q_a_norm, eps), a.q_b)
    q = q.view(B, T, Hq, Dn + Dr).transpose(1, 2)  # [B, Hq, T, Dn + Dr]
    q_nope, q_rope = q.split((Dn, Dr), dim=-1)  # [B, Hq, T, Dn], [B, Hq, T, Dr]
    latent, k_rope = linear(x, a.kv_a).split((C, Dr), dim=-1)  # [B, T, C], [B, T, Dr]
    if cfg.rope_interleave:
        q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
    q_rope = apply_rope(q_rope, cos, sin)  # [B, Hq, T, Dr]
    k_rope = apply_rope(k_rope.unsqueeze(1), cos, sin).squeeze(1)  # [B, T, Dr]
    end = start + T
    rows = cache.latent[i, :B]  # [B, context, C + Dr]
    rows[:, start:end, :C] = rms_norm(latent, a.kv_a_norm, eps)
    rows[:, start:end, C:] = k_rope
    cached = rows[:, :end]  # [B, S, C + Dr]
    mask = None
    if T > 1 and start > 0:  # a chunk after cached tokens: query t sees keys up to start + t
        mask = torch.arange(end, device=x.device)[None, :] <= (start + torch.arange(T, device=x.device))[:, None]
    causal, scale = T > 1 and start == 0, softmax_scale(cfg)
    kv_b = a.kv_b.view(Hq, Dn + Dv, C)  # [Hq, Dn + Dv, C]
    if absorb if absorb is not None else absorbs(cfg, T):
        # q_nope . (W_uk latent) = (W_uk^T q_nope) . latent: the queries move into the latent space, and the cached
        # rows are every head's keys (one head, shared) and, their first C dims, its values.
        q_latent = torch.einsum("bhtd,hdc->bhtc", q_nope, kv_b[:, :Dn])  # [B, Hq, T, C]
        keys = cached.unsqueeze(1)  # [B, 1, S, C + Dr]
        out = F.scaled_dot_product_attention(
            torch.cat((q_latent, q_rope), dim=-1), keys, keys[..., :C], attn_mask=mask, is_causal=causal,
            scale=scale, enable_gqa=True,
        )  # [B, Hq, T, C]
        out = torch.einsum("bhtc,hdc->bhtd", out, kv_b[:, Dn:])  # [B, Hq, T, Dv]
    else:
        kv = F.linear(cached[..., :C], a.kv_b).view(B, end, Hq, Dn + Dv).transpose(1, 2)  # [B, Hq, S, Dn + Dv]
        k_nope, values = kv.split((Dn, Dv), dim=-1)  # [B, Hq, S, Dn], [B, Hq, S, Dv]
        shared = cached[:, None, :, C:].expand(B, Hq, end, Dr)  # [B, Hq, S, Dr]
        out = F.scaled_dot_product_attention(
            torch.cat((q_nope, q_rope), dim=-1), torch.cat((k_nope, shared), dim=-1), values, attn_mask=mask,
            is_causal=causal, scale=scale,
        )  # [B, Hq, T, Dv]
    out = out.transpose(1, 2).reshape(B, T, Hq * Dv)  # [B, T, Hq*Dv]
    return linear(out, a.o, out_dtype=torch.float32)


class LatentAttention:
    """The mixer "mla" (runtime/layer_kind.py `Mixer`): `attend` over a `LatentCache`. The decode step does not run
    it, and its cache stays where the model runs (no attention on the CPU beside an accelerator)."""

    name = "mla"
    module = "self_attn"
    cache = LatentCache
    host_cache = False

    def tensors(self, cfg: ModelConfig, spec: FamilySpec | None, layer: int, prefix: str) -> dict[str, Shape]:
        return mla_tensors(cfg, prefix)

    def load(self, cfg: ModelConfig, layer: int, prefix: str, load: Loaders) -> MLAWeights:
        return load_mla(cfg, prefix, load.w)

    def step_refusal(self, cfg: ModelConfig) -> str | None:
        return "its attention keeps latents (Multi-head Latent Attention)"

    def forward(self, model: MoEModel, i: int, a: MLAWeights, x: torch.Tensor, start: int, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        return attend(model.cfg, a, model.cache, i, x, start, cos, sin, model.linear, model.rms_norm)  # type: ignore[arg-type]

    def forward_rows(self, model: MoEModel, i: int, a: MLAWeights, x: torch.Tensor, segments: list[Segment],
                     rows: list[LatentCache], spans: list[int]) -> torch.Tensor:
        """Segment by segment, the whole attention (it projects from the cache's latents)."""
        return torch.cat([attend(model.cfg, a, row, i, x[:, lo:hi], seg.start, *model.segment_tables(seg),
                                 model.linear, model.rms_norm)
                          for seg, row, lo, hi in zip(segments, rows, spans, spans[1:], strict=False)], dim=1)
