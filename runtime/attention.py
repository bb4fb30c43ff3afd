"""Grouped-query attention, the layer kind: its weights as a layer keeps them (`Attention`), its reference in plain
PyTorch (`attend_cached`, with gpt-oss's sinks: `attend_with_sinks`), and its cache (`KVCache`: keys and values
preallocated for every layer). Its fast paths are the kernels' (kernels/attend.py: one token, ragged rows), tested
against `attend_cached`; Multi-head Latent Attention is the other kind (runtime/mla.py).

Letters: B batch, T new tokens, S cached + new tokens, H hidden size, Hq query heads, Hkv key/value heads, D head
dim, C context.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.kernels.quant import QuantizedMatrix
from tandem.runtime.accelerator import Accelerator
from tandem.runtime.config import ModelConfig
from tandem.runtime.prefix import HeldTokens
from tandem.runtime.rope import apply_rope

# A dense matrix as the model keeps it: a tensor, GGUF blocks as stored (DenseLinear runs both), or q, k and v as
# blocks of different formats, side by side
Matrix = torch.Tensor | QuantizedMatrix | list[QuantizedMatrix]


def matrix_bytes(m: Matrix, rows: int | None = None) -> int:
    """The bytes of a matrix as kept (GGUF blocks: as stored), or of its first `rows` rows."""
    if isinstance(m, list):
        return sum(matrix_bytes(part, rows) for part in m)
    if isinstance(m, QuantizedMatrix):
        return m.nbytes if rows is None else m.data[:rows].numel()
    t = m if rows is None else m[:rows]
    return t.numel() * t.element_size()


@dataclass
class Attention:
    qkv: Matrix  # q, k and v projections stacked: [(Hq + 2 Hkv) * D, H], one matrix-vector pass for all three
    o: torch.Tensor | QuantizedMatrix
    qkv_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    sinks: torch.Tensor | None = None  # [Hq] gpt-oss's attention sinks (cfg.attention_sinks)


SINK_QUERY_BLOCK = 64  # queries per pass of attend_with_sinks: its scores are [B, Hq, queries, S], and a long
# prompt's at once would not fit (gpt-oss-20b: 64 heads x 8k x 8k x 4 bytes = 16 GiB)


def attend_with_sinks(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                      sinks: torch.Tensor) -> torch.Tensor:
    """Attention in which each head's sink logit (gpt-oss) joins the softmax over the keys and takes its share of
    the mass, adding nothing (its value is zero): as transformers' gpt-oss eager attention, max subtracted first, the
    softmax in float32 whatever the compute dtype. q [B, Hq, T, D], keys and values [B, Hkv, S, D], mask [T, S]
    (True: seen; None: every key), sinks [Hq] -> [B, Hq, T, D]. Letter: G = Hq / Hkv, the query heads sharing one
    key/value head (consecutive heads)."""
    B, Hq, T, D = q.shape
    if T > SINK_QUERY_BLOCK:
        return torch.cat([attend_with_sinks(q[:, :, i : i + SINK_QUERY_BLOCK], keys, values,
                                            None if mask is None else mask[i : i + SINK_QUERY_BLOCK], sinks)
                          for i in range(0, T, SINK_QUERY_BLOCK)], dim=2)  # [B, Hq, T, D]
    Hkv, S = keys.shape[1], keys.shape[2]
    grouped = q.reshape(B, Hkv, Hq // Hkv * T, D)  # [B, Hkv, G*T, D]: no copy of the keys per query head
    scores = (grouped @ keys.transpose(-1, -2)).view(B, Hq, T, S).float() * D ** -0.5  # [B, Hq, T, S]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.float().view(1, Hq, 1, 1).expand(B, Hq, T, 1)  # [B, Hq, T, 1]
    logits = torch.cat((scores, sink), dim=-1)  # [B, Hq, T, S + 1]
    logits = logits - logits.amax(dim=-1, keepdim=True)
    probs = torch.softmax(logits, dim=-1)[..., :-1].to(values.dtype)  # [B, Hq, T, S]: the sink's share dropped
    out = probs.reshape(B, Hkv, Hq // Hkv * T, S) @ values  # [B, Hkv, G*T, D]
    return out.view(B, Hq, T, D)


def attend_cached(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  kcache: torch.Tensor, vcache: torch.Tensor, start: int, first: int, window: int | None,
                  sinks: torch.Tensor | None) -> torch.Tensor:
    """Attention of T new tokens in plain PyTorch, the reference (kernels/attend.py's one-token kernel is tested
    against it): q [B, T, Hq, D], k and v [B, T, Hkv, D] at positions start..start+T-1, their RoPE tables cos and sin
    [T, R], the layer's caches [B' >= B, Hkv, C, D]. The roped keys and the values go into the caches; each query
    sees the positions from `first` (a sliding window's start, else 0) up to its own, within `window` of it ->
    [B, T, Hq*D] in the compute dtype."""
    B, T, Hq, D = q.shape
    q = apply_rope(q.transpose(1, 2), cos, sin)  # [B, Hq, T, D]
    k = apply_rope(k.transpose(1, 2), cos, sin)  # [B, Hkv, T, D]
    end = start + T
    kcache[:B, :, start:end] = k
    vcache[:B, :, start:end] = v.transpose(1, 2)
    keys, values = kcache[:B, :, first:end], vcache[:B, :, first:end]  # [B, Hkv, S, D]
    mask = None
    slides = window is not None and end - first > 1 and T > 1
    if T > 1 and (start > 0 or slides):  # query t (at start + t) sees keys from start + t - window + 1 on
        q_pos = start + torch.arange(T, device=q.device)[:, None]  # [T, 1]
        k_pos = torch.arange(first, end, device=q.device)[None, :]  # [1, S]
        mask = (k_pos <= q_pos) & (k_pos > q_pos - window) if window else k_pos <= q_pos  # [T, S]
    if sinks is not None:
        if mask is None and T > 1:  # causal
            q_pos = start + torch.arange(T, device=q.device)[:, None]  # [T, 1]
            mask = torch.arange(first, end, device=q.device)[None, :] <= q_pos  # [T, S]
        out = attend_with_sinks(q, keys, values, mask, sinks)  # [B, Hq, T, D]
    else:
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, is_causal=(T > 1 and mask is None), enable_gqa=True
        )  # [B, Hq, T, D]
    return out.transpose(1, 2).reshape(B, T, Hq * D)  # [B, T, Hq*D]


class KVCache:
    """Preallocated keys and values for every layer: [layers, B, Hkv, context, D] each."""

    def __init__(
        self, cfg: ModelConfig, batch: int, context: int, dtype: torch.dtype, accel: Accelerator | None = None
    ) -> None:
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, context, cfg.head_dim)
        if accel is None:
            self.k, self.v = torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)
        else:
            self.k, self.v = accel.empty(shape, dtype, "the KV cache"), accel.empty(shape, dtype, "the KV cache")
        self.context = context
        self.batch = batch
        self.held = HeldTokens(batch, context)  # the tokens each row holds (runtime/prefix.py)

    def copy_rows(self, pairs: list[tuple[int, int]], length: int) -> None:
        """Beam search: for each (dst, src), batch row dst takes the first `length` positions of row src. No row
        may be both: the copies run one after another, straight from slice to slice (no temporary copy, as a
        gather-and-scatter through an index tensor would make)."""
        if {d for d, _ in pairs} & {s for _, s in pairs}:
            raise ValueError("copy_rows: a row cannot be both a source and a destination")
        for d, s in pairs:
            self.k[:, d, :, :length].copy_(self.k[:, s, :, :length])
            self.v[:, d, :, :length].copy_(self.v[:, s, :, :length])
        self.held.copy_rows(pairs, length)

    def snapshot(self, row: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Row `row`'s first n positions (views): its keys and values, [layers, Hkv, n, D] each."""
        return self.k[:, row, :, :n], self.v[:, row, :, :n]

    def restore(self, row: int, parts: tuple[torch.Tensor, ...], n: int) -> None:
        """The first n positions of a `snapshot` (of this cache's shape) back into row `row`."""
        k, v = parts
        for i in range(k.shape[0]):  # a layer at a time: on an accelerator, a strided copy's temporary is one layer's
            self.k[i, row, :, :n].copy_(k[i, :, :n])
            self.v[i, row, :, :n].copy_(v[i, :, :n])

    def row(self, r: int) -> KVCache:
        """Batch row r alone, as a cache of one row: views, so what a pass writes into it lands in this cache."""
        view = copy.copy(self)
        view.k, view.v, view.batch = self.k[:, r : r + 1], self.v[:, r : r + 1], 1
        view.held = self.held.row(r)
        return view

    @staticmethod
    def nbytes(cfg: ModelConfig, batch: int, context: int, dtype: torch.dtype) -> int:
        item = torch.empty((), dtype=dtype).element_size()
        return 2 * cfg.num_layers * batch * cfg.num_kv_heads * context * cfg.head_dim * item
