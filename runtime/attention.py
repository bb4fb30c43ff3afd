"""Grouped-query attention, the layer kind (`GroupedQueryAttention`, the mixer "attention"): its weights as a layer
keeps them (`Attention`), its reference in plain PyTorch (`attend_cached`, with gpt-oss's sinks:
`attend_with_sinks`), its cache (`KVCache`: keys and values preallocated for every layer) and its passes, with the
variants families ask for (q/k norms, clipping, biases, sliding windows, sinks, Llama 4's chunks, layers without
RoPE and query temperature). Its fast paths are the kernels'
(kernels/attend.py: one token, ragged rows), tested against `attend_cached`, and the one-call decode step's;
Multi-head Latent Attention is the other kind (runtime/mla.py).

Letters: B batch, T new tokens, S cached + new tokens, H hidden size, Hq query heads, Hkv key/value heads, D head
dim, C context.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tandem.kernels.attend import attend_one, attend_rows
from tandem.kernels.quant import QuantizedMatrix
from tandem.kernels.step import QK_NORMS
from tandem.runtime.accelerator import Accelerator
from tandem.runtime.config import ModelConfig
from tandem.runtime.layer_kind import Loaders, Shape
from tandem.runtime.prefix import HeldTokens
from tandem.runtime.rope import apply_rope

if TYPE_CHECKING:
    from tandem.runtime.families import FamilySpec
    from tandem.runtime.model import MoEModel, Segment

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
    out_norm: torch.Tensor | None = None  # [H] the output's RMSNorm (cfg.sandwich_norms: Gemma's
    # post_attention_layernorm)


SINK_QUERY_BLOCK = 64  # queries per pass of attend_with_sinks: its scores are [B, Hq, queries, S], and a long
# prompt's at once would not fit (gpt-oss-20b: 64 heads x 8k x 8k x 4 bytes = 16 GiB)


def attend_with_sinks(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                      sinks: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Attention in which each head's sink logit (gpt-oss) joins the softmax over the keys and takes its share of
    the mass, adding nothing (its value is zero): as transformers' gpt-oss eager attention, max subtracted first, the
    softmax in float32 whatever the compute dtype. q [B, Hq, T, D], keys and values [B, Hkv, S, D], mask [T, S]
    (True: seen; None: every key), sinks [Hq] -> [B, Hq, T, D]. Letter: G = Hq / Hkv, the query heads sharing one
    key/value head (consecutive heads)."""
    B, Hq, T, D = q.shape
    if T > SINK_QUERY_BLOCK:
        return torch.cat([attend_with_sinks(q[:, :, i : i + SINK_QUERY_BLOCK], keys, values,
                                            None if mask is None else mask[i : i + SINK_QUERY_BLOCK], sinks, scale)
                          for i in range(0, T, SINK_QUERY_BLOCK)], dim=2)  # [B, Hq, T, D]
    Hkv, S = keys.shape[1], keys.shape[2]
    grouped = q.reshape(B, Hkv, Hq // Hkv * T, D)  # [B, Hkv, G*T, D]: no copy of the keys per query head
    scale = D ** -0.5 if scale is None else scale
    scores = (grouped @ keys.transpose(-1, -2)).view(B, Hq, T, S).float() * scale  # [B, Hq, T, S]
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
                  sinks: torch.Tensor | None, scale: float | None = None, chunk: int | None = None) -> torch.Tensor:
    """Attention of T new tokens in plain PyTorch, the reference (kernels/attend.py's one-token kernel is tested
    against it): q [B, T, Hq, D], k and v [B, T, Hkv, D] at positions start..start+T-1, their RoPE tables cos and sin
    [T, R], the layer's caches [B' >= B, Hkv, C, D]. The roped keys and the values go into the caches; each query
    sees the positions from `first` (a sliding window's or a chunk's start, else 0) up to its own, within `window`
    of it and from the start of its own `chunk` -> [B, T, Hq*D] in the compute dtype. `scale`: the scores' (None:
    1/sqrt(D))."""
    B, T, Hq, D = q.shape
    q = apply_rope(q.transpose(1, 2), cos, sin)  # [B, Hq, T, D]
    k = apply_rope(k.transpose(1, 2), cos, sin)  # [B, Hkv, T, D]
    end = start + T
    kcache[:B, :, start:end] = k
    vcache[:B, :, start:end] = v.transpose(1, 2)
    keys, values = kcache[:B, :, first:end], vcache[:B, :, first:end]  # [B, Hkv, S, D]
    mask = None
    slides = (window is not None or chunk is not None) and end - first > 1 and T > 1
    if T > 1 and (start > 0 or slides):  # query t (at start + t) sees keys from start + t - window + 1 on
        q_pos = start + torch.arange(T, device=q.device)[:, None]  # [T, 1]
        k_pos = torch.arange(first, end, device=q.device)[None, :]  # [1, S]
        mask = (k_pos <= q_pos) & (k_pos > q_pos - window) if window else k_pos <= q_pos  # [T, S]
        if chunk:  # ... and none before its chunk's first position
            mask &= k_pos >= q_pos - q_pos % chunk
    if sinks is not None:
        if mask is None and T > 1:  # causal
            q_pos = start + torch.arange(T, device=q.device)[:, None]  # [T, 1]
            mask = torch.arange(first, end, device=q.device)[None, :] <= q_pos  # [T, S]
        out = attend_with_sinks(q, keys, values, mask, sinks, scale)  # [B, Hq, T, D]
    else:
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, is_causal=(T > 1 and mask is None), enable_gqa=True, scale=scale
        )  # [B, Hq, T, D]
    return out.transpose(1, 2).reshape(B, T, Hq * D)  # [B, T, Hq*D]


class KVCache:
    """Preallocated keys and values for every layer (`layers`: those of a hybrid that attend, the others' None):
    [B, Hkv, context, D] each (`k[i]`, `v[i]`), views of one tensor [layers, B, Hkv, context, D] per head geometry
    (most models have one; Gemma 4's global layers have their own head size and key/value heads)."""

    def __init__(
        self, cfg: ModelConfig, batch: int, context: int, dtype: torch.dtype, accel: Accelerator | None = None,
        layers: Sequence[int] | None = None,
    ) -> None:
        self.num_layers = cfg.num_layers
        own = range(cfg.num_layers) if layers is None else layers  # (a hybrid's attention layers: LayerCaches)
        shapes = {i: (cfg.kv_heads(i), cfg.head_size(i)) for i in own}
        self.groups: list[tuple[list[int], torch.Tensor, torch.Tensor]] = []  # (its layers, keys, values)
        for kv_heads, dim in dict.fromkeys(shapes.values()):
            layers = [i for i, s in shapes.items() if s == (kv_heads, dim)]
            shape = (len(layers), batch, kv_heads, context, dim)
            if accel is None:
                k, v = torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype)
            else:
                k, v = accel.empty(shape, dtype, "the KV cache"), accel.empty(shape, dtype, "the KV cache")
            self.groups.append((layers, k, v))
        self._views()
        self.context = context
        self.batch = batch
        self.held = HeldTokens(batch, context)  # the tokens each row holds (runtime/prefix.py)

    def _views(self) -> None:
        """`k` and `v`: each layer's [B, Hkv, context, D], views of its group's tensors."""
        self.k: list[torch.Tensor] = [None] * self.num_layers  # type: ignore[list-item]
        self.v: list[torch.Tensor] = [None] * self.num_layers  # type: ignore[list-item]
        for layers, k, v in self.groups:
            for j, i in enumerate(layers):
                self.k[i], self.v[i] = k[j], v[j]

    def copy_rows(self, pairs: list[tuple[int, int]], length: int) -> None:
        """Beam search: for each (dst, src), batch row dst takes the first `length` positions of row src. No row
        may be both: the copies run one after another, straight from slice to slice (no temporary copy, as a
        gather-and-scatter through an index tensor would make)."""
        if {d for d, _ in pairs} & {s for _, s in pairs}:
            raise ValueError("copy_rows: a row cannot be both a source and a destination")
        for d, s in pairs:
            for _, k, v in self.groups:
                k[:, d, :, :length].copy_(k[:, s, :, :length])
                v[:, d, :, :length].copy_(v[:, s, :, :length])
        self.held.copy_rows(pairs, length)

    def snapshot(self, row: int, n: int) -> tuple[torch.Tensor, ...]:
        """Row `row`'s first n positions (views): each group's keys and values, [layers, Hkv, n, D] each."""
        return tuple(t[:, row, :, :n] for _, k, v in self.groups for t in (k, v))

    def restore(self, row: int, parts: tuple[torch.Tensor, ...], n: int) -> None:
        """The first n positions of a `snapshot` (of this cache's shape) back into row `row`."""
        for (_, k, v), (pk, pv) in zip(self.groups, zip(parts[::2], parts[1::2], strict=True), strict=True):
            for i in range(pk.shape[0]):  # a layer at a time: on an accelerator, a strided copy's temporary is one
                # layer's
                k[i, row, :, :n].copy_(pk[i, :, :n])
                v[i, row, :, :n].copy_(pv[i, :, :n])

    def row(self, r: int) -> KVCache:
        """Batch row r alone, as a cache of one row: views, so what a pass writes into it lands in this cache."""
        view = copy.copy(self)
        view.groups = [(layers, k[:, r : r + 1], v[:, r : r + 1]) for layers, k, v in self.groups]
        view._views()
        view.batch = 1
        view.held = self.held.row(r)
        return view

    @staticmethod
    def nbytes(cfg: ModelConfig, batch: int, context: int, dtype: torch.dtype,
               layers: Sequence[int] | None = None) -> int:
        item = torch.empty((), dtype=dtype).element_size()
        own = range(cfg.num_layers) if layers is None else layers
        return 2 * batch * context * item * sum(cfg.kv_heads(i) * cfg.head_size(i) for i in own)


class GroupedQueryAttention:
    """The mixer "attention" (runtime/layer_kind.py `Mixer`): q, k and v as one product, then the family's q/k norms
    and clipping, RoPE, the cache write and attention (the kernel for decode on the CPU, else `attend_cached`), the
    output projection."""

    name = "attention"
    module = "self_attn"
    cache = KVCache
    host_cache = True

    def tensors(self, cfg: ModelConfig, spec: FamilySpec | None, layer: int, prefix: str) -> dict[str, Shape]:
        h, d = cfg.hidden_size, cfg.head_size(layer)
        q_dim, kv_dim = cfg.num_heads * d, cfg.kv_heads(layer) * d
        qn, kn = qk_norm_names(spec)
        q_rows = 2 * q_dim if cfg.attention_gate else q_dim  # (a gate per query value)
        out: dict[str, Shape] = {
            f"{prefix}.q_proj.weight": (q_rows, h),
            f"{prefix}.k_proj.weight": (kv_dim, h),
            f"{prefix}.v_proj.weight": (kv_dim, h),
            f"{prefix}.o_proj.weight": (h, q_dim),
        }
        if cfg.qkv_bias:
            out |= {f"{prefix}.q_proj.bias": (q_rows,), f"{prefix}.k_proj.bias": (kv_dim,),
                    f"{prefix}.v_proj.bias": (kv_dim,)}
        if keys_are_values(cfg, layer):  # (the values are k_proj's output, its bias included)
            out.pop(f"{prefix}.v_proj.weight")
            out.pop(f"{prefix}.v_proj.bias", None)
        if cfg.o_bias:
            out[f"{prefix}.o_proj.bias"] = (h,)
        if cfg.attention_sinks:
            out[f"{prefix}.sinks"] = (cfg.num_heads,)
        if cfg.qk_norm == "head":
            out |= {f"{prefix}.{qn}.weight": (d,), f"{prefix}.{kn}.weight": (d,)}
        elif cfg.qk_norm == "full":
            out |= {f"{prefix}.{qn}.weight": (q_dim,), f"{prefix}.{kn}.weight": (kv_dim,)}
        if cfg.sandwich_norms:  # (beside self_attn, as Gemma names it)
            out[f"{prefix.rsplit('.', 1)[0]}.post_attention_layernorm.weight"] = (h,)
        return out

    def load(self, cfg: ModelConfig, layer: int, prefix: str, load: Loaders) -> Attention:
        d = cfg.head_size(layer)
        rows = [cfg.num_heads * d * (2 if cfg.attention_gate else 1)] + [cfg.kv_heads(layer) * d] * 2
        names = [f"{prefix}.{n}_proj.weight" for n in "qkv"]
        if keys_are_values(cfg, layer):  # v is k's product: not multiplied twice
            names, rows = names[:2], rows[:2]
        norms = cfg.qk_norm in ("head", "full")  # (Llama 4's "l2" has no weights)
        qn, kn = qk_norm_names(load.spec)
        a = Attention(
            load.projections(names, rows), load.wq(f"{prefix}.o_proj.weight"),
            load.stacked([n.replace(".weight", ".bias") for n in names], rows) if cfg.qkv_bias else None,
            load.opt(f"{prefix}.o_proj.bias") if cfg.o_bias else None,
            load.norm(f"{prefix}.{qn}.weight") if norms else None,
            load.norm(f"{prefix}.{kn}.weight") if norms else None,
            load.w(f"{prefix}.sinks") if cfg.attention_sinks else None,
            load.w(f"{prefix.rsplit('.', 1)[0]}.post_attention_layernorm.weight") if cfg.sandwich_norms else None,
        )
        if cfg.attention_gate:
            a = gates_last(cfg, layer, a)
        return halves_order(cfg, a) if cfg.rope_interleave else a

    def step_refusal(self, cfg: ModelConfig) -> str | None:
        if cfg.clip_qkv is not None or cfg.qk_norm not in QK_NORMS or cfg.qk_norm_after_rope:
            return "its attention clips q, k and v, or norms them in a way the step does not (after RoPE)"
        if cfg.attention_chunk or (any(cfg.nope_layers) and cfg.attention_temperature is not None):
            return "its attention runs in chunks, or some layers rotate nothing and scale their queries (Llama 4)"
        if cfg.global_head_dim or cfg.global_rope or cfg.value_norm or cfg.sandwich_norms:
            return ("its global layers have their own head size and RoPE, its values and attention's output are "
                    "normed (Gemma 4)")
        return None

    def forward(self, model: MoEModel, i: int, a: Attention, x: torch.Tensor, start: int, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        q, k, v, gate = project_qkv(model, i, a, x)
        out = attend_positions(model, i, a, q, k, v, model.cache, start, cos, sin, model.accel is None)  # type: ignore[arg-type]
        return output(model, a, out, gate)

    def forward_rows(self, model: MoEModel, i: int, a: Attention, x: torch.Tensor, segments: list[Segment],
                     rows: list[KVCache], spans: list[int]) -> torch.Tensor:
        """q, k, v and o are one product each over all N tokens; RoPE, the cache write and attention run segment by
        segment (on the CPU where the cache is in RAM beside an accelerator: one host read of q, k and v for all of
        them)."""
        timeline = model.dispatcher.timeline
        with nullcontext() if timeline is None else timeline.span("attention"):
            return attend_segments(model, i, a, x, segments, rows, spans)


def keys_are_values(cfg: ModelConfig, layer: int) -> bool:
    """Whether `layer` has no v_proj, its values the keys' projection (Gemma 4's global layers:
    attention_k_eq_v)."""
    return cfg.values_from_keys and cfg.is_global(layer)


def output(model: MoEModel, a: Attention, out: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
    """Attention's heads [B, T, Hq*D] (times sigmoid(gate) where the layer has one) through o_proj (and the
    output norm where the layer has one) -> [B, T, H] float32, into the residual stream unrounded."""
    if gate is not None:
        out = out * torch.sigmoid(gate)
    y = model.linear(out, a.o, a.o_bias, out_dtype=torch.float32)
    return y if a.out_norm is None else model.rms_norm(y, a.out_norm, model.cfg.rms_norm_eps).float()


def rows_in(m: Matrix, order: torch.Tensor) -> Matrix:
    """A matrix's rows in `order` (GGUF blocks: whole rows of blocks, their scales within them)."""
    if isinstance(m, list):
        raise ValueError("these projections must be of one format to be reordered")
    if isinstance(m, QuantizedMatrix):
        return replace(m, data=m.data[order.to(m.data.device)])
    return m[order.to(m.device)]


def gates_last(cfg: ModelConfig, layer: int, a: Attention) -> Attention:
    """Gated attention's q_proj gives each head its query then its gate (`attention_gate`): the stacked rows (and
    biases) reordered once to every query, k, v, then every gate, so that one split takes each."""
    d, hq, kv = cfg.head_size(layer), cfg.num_heads, cfg.kv_heads(layer) * cfg.head_size(layer)
    head = torch.arange(hq)[:, None] * 2 * d
    queries, gates = (head + torch.arange(d)).flatten(), (head + d + torch.arange(d)).flatten()
    order = torch.cat([queries, torch.arange(2 * hq * d, 2 * hq * d + 2 * kv), gates])
    bias = None if a.qkv_bias is None else a.qkv_bias[order.to(a.qkv_bias.device)]
    if isinstance(a.qkv, list):  # q, k and v of different formats (a GGUF file's mix): q's rows split, gates last
        q, k, v = a.qkv
        return replace(a, qkv=[rows_in(q, queries), k, v, rows_in(q, gates)], qkv_bias=bias)  # type: ignore[list-item]
    return replace(a, qkv=rows_in(a.qkv, order), qkv_bias=bias)


def halves_order(cfg: ModelConfig, a: Attention) -> Attention:
    """Attention whose RoPE turns adjacent pairs of dims (ERNIE's), as attention that turns a head's halves: each
    head's q and k rows (and their biases and norms) reordered once, pair j's two dims to j and j + R/2. Scores are
    the same (q and k reordered alike: their dot products do not change), and every path, kernels and decode step
    included, rotates the halves as it does for every other family."""
    D, Hq, Hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    R = cfg.rotary_dim or D
    head = torch.tensor(list(range(0, R, 2)) + list(range(1, R, 2)) + list(range(R, D)))  # [D]
    q = (torch.arange(Hq)[:, None] * D + head).flatten()  # [Hq*D]
    k = (torch.arange(Hkv)[:, None] * D + head).flatten()  # [Hkv*D]
    qkv = torch.cat([q, Hq * D + k, torch.arange((Hq + Hkv) * D, (Hq + 2 * Hkv) * D)])

    def rows(m: torch.Tensor | QuantizedMatrix | None, order: torch.Tensor) -> torch.Tensor | QuantizedMatrix | None:
        if isinstance(m, QuantizedMatrix):  # GGUF blocks: whole rows of blocks (the scales within them)
            return replace(m, data=m.data[order.to(m.data.device)])
        return None if m is None else m[order.to(m.device)]

    if isinstance(a.qkv, list):  # q, k and v of different formats, side by side
        matrix: Matrix = [rows(a.qkv[0], q), rows(a.qkv[1], k), a.qkv[2]]  # type: ignore[list-item]
    else:
        matrix = rows(a.qkv, qkv)  # type: ignore[assignment]
    norm = head if cfg.qk_norm == "head" else None
    return replace(a, qkv=matrix, qkv_bias=rows(a.qkv_bias, qkv), q_norm=rows(a.q_norm, q if norm is None else norm),
                   k_norm=rows(a.k_norm, k if norm is None else norm))


def qk_norm_names(spec: FamilySpec | None) -> tuple[str, str]:
    """The q and k norms' names inside `self_attn` (FamilySpec.qk_norms; None: the usual ones)."""
    return spec.qk_norms if spec is not None else ("q_norm", "k_norm")


def project_qkv(model: MoEModel, i: int, a: Attention, x: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x [B, T, H] -> layer i's q [B, T, Hq, D], k and v [B, T, Hkv, D] and the output's gate [B, T, Hq*D]
    (`attention_gate`; else None): one product for them all (v left out where the values are the keys'
    projection), then q/k norms and clipping as the family asks, and the values' norm."""
    cfg = model.cfg
    B, T, _ = x.shape
    d, kv_heads = cfg.head_size(i), cfg.kv_heads(i)
    qkv = model.linear(x, a.qkv, a.qkv_bias)  # [B, T, (Hq + 2 Hkv) * D] (+ Hq * D gates)
    kv = kv_heads * d
    gated = cfg.num_heads * d if cfg.attention_gate else 0
    if keys_are_values(cfg, i):
        q, k = qkv.split((cfg.num_heads * d, kv), dim=-1)
        v = k  # (before k's norm and rotation)
    else:
        q, k, v = qkv[..., : qkv.shape[-1] - gated].split((cfg.num_heads * d, kv, kv), dim=-1)  # [B, T, Hq*D],
        # [B, T, Hkv*D] x 2
    gate = qkv[..., qkv.shape[-1] - gated :] if gated else None  # (gates_last put them there)
    if cfg.qk_norm == "full":
        q, k = model.rms_norm(q, a.q_norm, cfg.rms_norm_eps), model.rms_norm(k, a.k_norm, cfg.rms_norm_eps)
    if cfg.clip_qkv is not None:
        q, k, v = (t.clamp(-cfg.clip_qkv, cfg.clip_qkv) for t in (q, k, v))
    q = q.view(B, T, cfg.num_heads, d)  # [B, T, Hq, D]
    k = k.view(B, T, kv_heads, d)  # [B, T, Hkv, D]
    v = v.view(B, T, kv_heads, d)  # [B, T, Hkv, D]
    if cfg.qk_norm == "head" and not cfg.qk_norm_after_rope:
        q, k = model.rms_norm(q, a.q_norm, cfg.rms_norm_eps), model.rms_norm(k, a.k_norm, cfg.rms_norm_eps)
    if cfg.value_norm:  # each head to unit RMS, no weight (Gemma 4's v_norm), in float32 as the reference
        v = F.rms_norm(v.float(), (d,), None, cfg.rms_norm_eps).to(v.dtype)
    return q, k, v, gate


def attend_positions(model: MoEModel, i: int, a: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cache: KVCache, start: int, cos: torch.Tensor, sin: torch.Tensor, on_host: bool) -> torch.Tensor:
    """RoPE, the KV cache write and attention of q [B, T, Hq, D], k and v [B, T, Hkv, D] at positions start..,
    in `cache`'s rows 0..B-1 -> [B, T, Hq*D] in the compute dtype. `on_host`: the CPU computes it (the kernel,
    where it serves), else the accelerator (torch)."""
    B, T = q.shape[:2]
    cfg = model.cfg
    if not cfg.rotates(i):  # tables of no dims: nothing turns
        cos, sin = cos[..., :0], sin[..., :0]
        if (temperature := cfg.temperature(i)) is not None:
            q = with_temperature(q, temperature, torch.arange(start, start + T, device=q.device))
    elif cfg.qk_norm_after_rope:  # rotated here, normed, then attended with tables that rotate nothing
        q, k, cos, sin = rotated_and_normed(model, a, q, k, cos, sin)
    window, chunk = cfg.window(i), cfg.chunk(i)
    # a sliding window or a chunk: no key before the first one the earliest query sees is read at all
    first = start - start % chunk if chunk else max(0, start + 1 - window) if window else 0
    if T == 1 and on_host and model.attend_kernel:  # decode: one kernel call from RoPE to the values' sum
        return attend_one(q.reshape(B, -1), k.reshape(B, -1), v.reshape(B, -1), cos[0], sin[0], cache.k[i],
                          cache.v[i], start, first, a.sinks, model.threads,
                          scale=cfg.attention_scale).view(B, 1, -1)  # [B, T, Hq*D]
    return attend_cached(q, k, v, cos, sin, cache.k[i], cache.v[i], start, first, window, a.sinks,
                         cfg.attention_scale, chunk)


def with_temperature(q: torch.Tensor, temperature: tuple[float, float], positions: torch.Tensor) -> torch.Tensor:
    """q [B, T, Hq, D] of tokens at `positions` [T], scaled by a layer's temperature (floor_scale, attn_scale) at
    each position (Llama 4's layers without RoPE: 1 + attn_scale * ln(1 + floor((p + 1) / floor_scale)), in
    float32, as transformers computes it)."""
    floor_scale, attn_scale = temperature
    scales = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0  # [T]
    return (q * scales.view(1, -1, 1, 1)).to(q.dtype)


def rotated_and_normed(model: MoEModel, a: Attention, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """HunYuan's and Llama 4's order (`qk_norm_after_rope`): q [B, T, Hq, D] and k [B, T, Hkv, D] rotated, then each
    head RMSNorm'ed (Llama 4's "l2": with no weight); with tables of no dims (they rotate nothing), for the attention
    that follows."""
    eps = model.cfg.rms_norm_eps
    q = apply_rope(q.transpose(1, 2), cos, sin).transpose(1, 2).to(q.dtype)
    k = apply_rope(k.transpose(1, 2), cos, sin).transpose(1, 2).to(k.dtype)
    if model.cfg.qk_norm == "l2":
        q, k = (F.rms_norm(t.float(), (t.shape[-1],), None, eps).to(t.dtype) for t in (q, k))
    else:
        q, k = model.rms_norm(q, a.q_norm, eps), model.rms_norm(k, a.k_norm, eps)
    return q.contiguous(), k.contiguous(), cos[..., :0], sin[..., :0]


def attend_segments(model: MoEModel, i: int, a: Attention, x: torch.Tensor, segments: list[Segment],
                    rows: list[KVCache], spans: list[int]) -> torch.Tensor:
    """GroupedQueryAttention.forward_rows without its timeline span."""
    q, k, v, gate = project_qkv(model, i, a, x)  # [1, N, Hq, D], [1, N, Hkv, D] x 2
    accel = model.accel
    host = model.host_cache and accel is not None
    head = a
    if host:  # the accelerator's q, k and v (and the sinks) to the CPU, which holds the cache
        q, k, v, *rest = accel.download(lambda: (q, k, v, *([a.sinks] if a.sinks is not None else []))  # type: ignore[union-attr]
                                        ).wait()
        head = replace(a, sinks=rest[0] if rest else None)
    on_host = host or accel is None
    parts: list[torch.Tensor | None] = [None] * len(segments)  # each segment's [1, n, Hq*D]
    if on_host and model.attend_kernel and not (model.cfg.qk_norm_after_rope and model.cfg.rotates(i)):  # (the rows'
        # tables rotate: q and k normed after RoPE cannot go through them)
        attend_decoding(model, i, head, q, k, v, segments, spans, host, parts)
    out = torch.cat([part if part is not None else
                     attend_positions(model, i, head, q[:, lo:hi], k[:, lo:hi], v[:, lo:hi], row, seg.start,
                                      *model.segment_tables(seg, host, i), on_host)
                     for part, seg, row, lo, hi in zip(parts, segments, rows, spans, spans[1:], strict=False)],
                    dim=1)  # [1, N, Hq*D]
    if host:
        out = accel.to_device(out)  # type: ignore[union-attr]
    return output(model, a, out, gate)


def attend_decoding(model: MoEModel, i: int, a: Attention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    segments: list[Segment], spans: list[int], host: bool, parts: list[torch.Tensor | None]) -> None:
    """The segments of one token (the sequences decoding) through layer i's attention kernel in one call for
    all that share RoPE tables, each at its own cache row and position, into `parts`: a call per sequence cost
    its parallel region's start and end, which in a decode step of 64 sequences took most of attention's time.
    q [1, N, Hq, D], k and v [1, N, Hkv, D] on the host."""
    cache, cfg = model.cache, model.cfg
    for long in (False, True):
        ones = [j for j, seg in enumerate(segments) if seg.length == 1 and seg.long == long]
        if len(ones) < 2:
            continue
        at = torch.tensor([spans[j] for j in ones])  # [S]: their tokens among the N
        starts = [segments[j].start for j in ones]
        cos, sin = model.tables_for(long, host, i)
        queries = q[:, at]  # [1, S, Hq, D]
        if not cfg.rotates(i):
            cos, sin = cos[:, :0], sin[:, :0]
            if (temperature := cfg.temperature(i)) is not None:
                queries = with_temperature(queries, temperature, torch.tensor(starts))
        out = attend_rows(queries[0].flatten(1), k[0, at].flatten(1), v[0, at].flatten(1), cos, sin,
                          cache.k[i], cache.v[i], [segments[j].row for j in ones],  # type: ignore[union-attr]
                          starts, cfg.window(i) or 0, a.sinks, model.threads, scale=cfg.attention_scale,
                          chunk=cfg.chunk(i) or 0)  # [S, Hq*D]
        for n, j in enumerate(ones):
            parts[j] = out[n].view(1, 1, -1)
