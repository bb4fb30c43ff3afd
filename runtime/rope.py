"""Rotary position embeddings: the cos/sin tables of a family's RoPE variant, and applying them.

A variant is a `rope_type` of config.json (`rope_parameters` in transformers 5, `rope_scaling` before): each one
is a function below that turns the config's parameters into the rotation frequencies (and, for some, a scale
for cos and sin), registered in `FREQUENCIES`. `ModelConfig.rotary_dim` rotates only the first dims of each head
(partial rotary); the rest pass through. A variant whose tables change with the sequence's length (LongRoPE) also
registers its long tables in `LONG_FREQUENCIES`; `long_after` says from which length on they apply.

The parameters arrive checked (runtime/config.py, before anything is sized by them): each number's type and range
(`ROPE_RULES`), the keys a variant needs, LongRoPE's factors one per rotated pair of dims and an even number of
rotated dims (`rope_problems`). The functions below trust them; a new parameter is added there too.

Letters: B batch, T tokens, D head dim, R rotary dims (R <= D).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from tandem.runtime.config import ModelConfig

# rope_type -> (cfg, R) -> (inverse frequencies [R/2], scale of cos and sin); "default" is plain RoPE
Frequencies = Callable[[ModelConfig, int], tuple[torch.Tensor, float]]


def _default(cfg: ModelConfig, dims: int) -> tuple[torch.Tensor, float]:
    return 1.0 / (cfg.rope_theta ** (torch.arange(0, dims, 2, dtype=torch.float) / dims)), 1.0


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context stretched `scale` times (1 when it is not stretched)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(cfg: ModelConfig, dims: int) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071), as transformers' `_compute_yarn_parameters`: the dims that turn fewer than
    `beta_slow` times over the original context are interpolated (frequency / factor), those turning more than
    `beta_fast` times keep their frequency, a linear ramp blends the dims between; cos and sin are scaled by the
    attention factor (given, or mscale(factor, mscale) / mscale(factor, mscale_all_dim), or mscale(factor))."""
    p = dict(cfg.rope_params)
    original = p.get("original_max_position_embeddings") or cfg.max_position_embeddings
    factor = p.get("factor") or cfg.max_position_embeddings / original
    attention = p.get("attention_factor")
    if attention is None:
        mscale, all_dim = p.get("mscale"), p.get("mscale_all_dim")
        attention = yarn_mscale(factor, mscale) / yarn_mscale(factor, all_dim) if mscale and all_dim \
            else yarn_mscale(factor)
    fast, slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def dim_of(rotations: float) -> float:  # the dim whose frequency turns `rotations` times over `original`
        return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))

    low, high = dim_of(fast), dim_of(slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dims // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [R/2]
    pos_freqs = cfg.rope_theta ** (torch.arange(0, dims, 2, dtype=torch.float) / dims)  # [R/2]
    keep = 1 - ramp  # 1: the dim keeps its frequency (extrapolation), 0: interpolated
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - keep) + 1.0 / pos_freqs * keep
    return inv_freq, float(attention)


def _llama3(cfg: ModelConfig, dims: int) -> tuple[torch.Tensor, float]:
    """Llama 3's scaling (Llama 4 Scout), as transformers' `_compute_llama3_parameters`: dims whose wavelength is
    longer than original / low_freq_factor turn `factor` times slower, those shorter than original /
    high_freq_factor keep their frequency, a smooth blend between; cos and sin unscaled."""
    p = dict(cfg.rope_params)
    inv_freq, _ = _default(cfg, dims)
    factor, low, high = p["factor"], p["low_freq_factor"], p["high_freq_factor"]
    original = p["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq  # [R/2]
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < original / high) * ~(wavelen > original / low)
    return torch.where(medium, blended, scaled), 1.0


def _frequency_factors(cfg: ModelConfig, dims: int) -> tuple[torch.Tensor, float]:
    """Each pair's frequency divided by its own factor (`factors`), as llama.cpp's files carry a scaling such as
    Llama 3's (their rope_freqs tensor); cos and sin unscaled."""
    inv_freq, _ = _default(cfg, dims)
    return inv_freq / torch.tensor(dict(cfg.rope_params)["factors"], dtype=torch.float32), 1.0


def _proportional(cfg: ModelConfig, dims: int) -> tuple[torch.Tensor, float]:
    """Gemma 4's global layers, as transformers' `_compute_proportional_rope_parameters`: the first
    partial_rotary_factor of each half's pairs turn at the frequencies plain RoPE gives them over the whole head
    (the exponent's denominator is the head size, not the rotated part's), the rest not at all (frequency 0: cos 1,
    sin 0), each divided by `factor`; cos and sin unscaled."""
    p = dict(cfg.rope_params)
    turning = int(p.get("partial_rotary_factor", 1.0) * dims // 2)
    inv_freq = torch.zeros(dims // 2, dtype=torch.float32)  # [R/2]
    inv_freq[:turning] = 1.0 / (cfg.rope_theta ** (torch.arange(0, 2 * turning, 2, dtype=torch.int64).float() / dims))
    return inv_freq / p.get("factor", 1.0), 1.0


def longrope_original(cfg: ModelConfig) -> int:
    """LongRoPE's pretraining length: its parameters' `original_max_position_embeddings` (a family puts config.json's
    top-level key there, which transformers prefers), else the model's own maximum, as transformers defaults it."""
    return int(dict(cfg.rope_params).get("original_max_position_embeddings", cfg.max_position_embeddings))


def _longrope(cfg: ModelConfig, dims: int, long: bool) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3, PhiMoE; "su" is its older name), as transformers' `_compute_longrope_parameters`: each
    frequency divided by its own factor, `short_factor` up to the pretraining length and `long_factor` past it. The
    scale of cos and sin is `short_mscale` / `long_mscale` when given (PhiMoE), else `attention_factor`, else
    sqrt(1 + ln(factor) / ln(pretraining length)) with factor = `factor` or max_position_embeddings over that
    length (1 when the factor is at most 1)."""
    params, original = dict(cfg.rope_params), longrope_original(cfg)
    factors = torch.tensor(params["long_factor" if long else "short_factor"], dtype=torch.float32)  # [R/2]
    shape = torch.arange(0, dims, 2, dtype=torch.int64).float() / dims  # [R/2]
    inv_freq = 1.0 / (factors * cfg.rope_theta ** shape)  # [R/2]
    mscale = params.get("long_mscale" if long else "short_mscale")
    if mscale is not None:
        return inv_freq, float(mscale)
    scale = params.get("attention_factor")
    if scale is None:
        factor = params.get("factor") or cfg.max_position_embeddings / original
        scale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return inv_freq, float(scale)


def _longrope_short(cfg: ModelConfig, dims: int) -> tuple[torch.Tensor, float]:
    return _longrope(cfg, dims, long=False)


def _longrope_long(cfg: ModelConfig, dims: int) -> tuple[torch.Tensor, float]:
    return _longrope(cfg, dims, long=True)


FREQUENCIES: dict[str, Frequencies] = {
    "default": _default, "llama3": _llama3, "frequency_factors": _frequency_factors, "yarn": _yarn,
    "longrope": _longrope_short, "su": _longrope_short, "proportional": _proportional,
}
# the tables past `long_after` tokens, for the variants that switch by length
LONG_FREQUENCIES: dict[str, Frequencies] = {"longrope": _longrope_long, "su": _longrope_long}


def long_after(cfg: ModelConfig) -> int | None:
    """The sequence length past which a forward pass rotates with the long tables (None: the variant has none).
    Like transformers, the length is the one a pass reaches (its last position + 1): keys cached by earlier passes
    keep the rotation they were given, so generation runs the whole sequence again when it first crosses
    (runtime/engine.py)."""
    return longrope_original(cfg) if cfg.rope_type in LONG_FREQUENCIES else None


def rotary_dims(cfg: ModelConfig) -> int:
    return cfg.rotary_dim or cfg.head_dim


def rope_tables(cfg: ModelConfig, length: int, dtype: torch.dtype, long: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [length, R] for rotate-half RoPE of the model's variant (`long`: its long tables)."""
    dims = rotary_dims(cfg)
    inv_freq, scale = (LONG_FREQUENCIES if long else FREQUENCIES)[cfg.rope_type](cfg, dims)  # [R/2]
    freqs = torch.arange(length, dtype=torch.float)[:, None] * inv_freq[None, :]  # [length, R/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [length, R]
    return (emb.cos() * scale).to(dtype), (emb.sin() * scale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, D], cos/sin [T, R]: the first R dims of each head rotated, the rest kept (R = 0: a layer
    that rotates nothing)."""
    dims = cos.shape[-1]
    if dims == 0:
        return x
    if dims < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :dims], cos, sin), x[..., dims:]), dim=-1)
    half = dims // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # [B, heads, T, R]
    return x * cos + rotated * sin
