"""The decoder's forward passes, in plain PyTorch: embedding, each layer's norms, token mixer and feed-forward by
the kinds its config declares (runtime/layers.py: attention in runtime/attention.py, MLA in runtime/mla.py, routed
experts through the dispatcher or a dense SwiGLU, runtime/moe.py), final norm, lm_head; the one-call decode step
where it serves (runtime/decode_step.py) and ragged passes of several sequences (`forward_rows`). One class serves
every family; runtime/build.py builds it from a checkpoint.

Letters: B batch, T new tokens, S cached + new tokens, H hidden size, Hq query heads, Hkv key/value heads,
D head dim, V vocabulary.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from tandem.kernels.attend import attend_serves
from tandem.kernels.dense import DenseLinear, lookup_rows, rms_norm_bf16
from tandem.kernels.errors import ResourceError
from tandem.kernels.experts import CpuOptions
from tandem.kernels.library import library
from tandem.kernels.quant import QuantizedMatrix
from tandem.kernels.recur import recur_serves
from tandem.runtime.accelerator import Accelerator
from tandem.runtime.attention import Attention
from tandem.runtime.checkpoint import Checkpoint
from tandem.runtime.config import ModelConfig
from tandem.runtime.decode_step import DecodeStep, why_not
from tandem.runtime.dispatch import Dispatcher, OffloadOptions
from tandem.runtime.layers import cache_class, plan
from tandem.runtime.mla import MLAWeights
from tandem.runtime.moe import ExpertWeights, MoEBlockWeights
from tandem.runtime.rope import long_after, rope_tables
from tandem.runtime.state import StateCache


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in float32 like the reference implementations, into the weight's dtype.
    x in the weight's dtype rounds where transformers rounds; a float32 residual stream under bf16 weights rounds
    once, at the end."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps)  # x * rsqrt(mean(x^2) + eps) in float32
    if x.dtype == torch.float32 and weight.dtype != torch.float32:
        return normed.mul_(weight).to(weight.dtype)  # (the float32 product with the weight, as weight.float())
    return weight * normed.to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm with a bias over the last dim (PhiMoE), computed in float32 like the reference, into the weight's
    dtype (see rms_norm)."""
    return F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps).to(weight.dtype)


@dataclass
class DecoderLayer:
    """One layer's weights: its norms, its token mixer's (`attn`, as its kind loads them: runtime/layers.py) and its
    feed-forward's (routed experts, or a dense layer's single always-on SwiGLU)."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    attn: Attention | MLAWeights | Any
    ffn: MoEBlockWeights | ExpertWeights
    input_norm_bias: torch.Tensor | None = None  # LayerNorm's biases (cfg.norm_type "layer")
    post_norm_bias: torch.Tensor | None = None
    scalar: torch.Tensor | None = None  # [1] float32: the layer's output times it (cfg.layer_scalars)


PREFILL_CHUNK = 512  # tokens per prefill pass on an accelerator: bounds the activations the budget keeps back


def activation_bytes(cfg: ModelConfig, tokens: int, context: int, batch: int, dtype: torch.dtype) -> int:
    """Device memory a pass of `tokens` new tokens for each of `batch` sequences takes at its peak, beyond the
    weights and the KV cache (an upper bound: what is alive at once in the largest layer). The float32 residual
    stream, its update and a norm's output; q, k and v with their roped copies; attention scores as the math
    kernel makes them (every head, every query against the whole context, float32); the MoE layer's router logits
    and output with one expert's (or the dense feed-forward's, the shared expert's) hidden activations over every
    token; the last position's float32 logits."""
    T, h, item = batch * tokens, cfg.hidden_size, dtype.itemsize
    heads = cfg.num_heads + 2 * max(cfg.kv_heads(i) for i in range(cfg.num_layers))
    width = max(cfg.moe_intermediate_size, cfg.dense_intermediate_size, cfg.shared_expert_intermediate_size)
    residual = T * h * (3 * 4 + item)
    attention = 2 * T * heads * max(*cfg.head_sizes(), cfg.qk_rope_head_dim + cfg.v_head_dim) * item \
        + batch * cfg.num_heads * tokens * context * 4
    ffn = T * (cfg.num_experts * 4 + 2 * h * 4 + 3 * width * item)
    # Gated DeltaNet (runtime/deltanet.py): its projection and convolution in the compute dtype, q, k and v and the
    # outputs in float32 (keys repeated per value head), a block's decays and system per value head
    key, value = cfg.linear_key_heads * cfg.linear_key_dim, cfg.linear_value_heads * cfg.linear_value_dim
    repeated = cfg.linear_value_heads * cfg.linear_key_dim
    linear = T * ((4 * key + 4 * value) * item + (2 * repeated + 3 * value) * 4) \
        + batch * cfg.linear_value_heads * 3 * 64 * 64 * 4 if key else 0
    return residual + max(attention, ffn, linear) + batch * cfg.vocab_size * 4


@dataclass(frozen=True)
class Segment:
    """One sequence's share of a ragged pass (`MoEModel.forward_rows`): `length` new tokens at positions start..,
    in KV cache row `row`, rotated with LongRoPE's long tables or not."""

    row: int
    start: int
    length: int
    long: bool = False


@dataclass(frozen=True)
class ModelRun:
    """What a decoder is built to run: its compute dtype, the tokens and sequences its KV cache holds, the CPU
    experts' compute dtype where it is not `dtype` (an fp16 GPU's), and whether the sequences run as
    `forward_rows`' ragged passes (batch mode: the accelerator then keeps back the activations of one row of a
    pass's tokens, not of `batch` rows)."""

    dtype: torch.dtype
    context: int
    batch: int = 1
    cpu_dtype: torch.dtype | None = None
    ragged: bool = False


@dataclass
class DecoderWeights:
    """The decoder's own weights (the routed experts live in its layers' MoE blocks), as runtime/build.py makes
    them, and the dense matrices' runner they were prepared for (None: the model makes one)."""

    embed: torch.Tensor | QuantizedMatrix
    layers: list[DecoderLayer]
    norm: torch.Tensor
    lm_head: torch.Tensor | QuantizedMatrix
    norm_bias: torch.Tensor | None = None  # LayerNorm's (cfg.norm_type "layer")
    lm_head_bias: torch.Tensor | None = None
    linear: DenseLinear | None = None


class MoEModel:
    """The decoder. Non-expert weights, the KV cache and RoPE tables live on the accelerator when there is
    one (Fiddler §3.3), else in RAM; routed experts stay in host memory and run through the `Dispatcher`."""

    def __init__(self, cfg: ModelConfig, weights: DecoderWeights, run: ModelRun, accel: Accelerator | None = None,
                 policy: OffloadOptions | None = None, cpu: CpuOptions | None = None) -> None:
        embed, layers, linear = weights.embed, weights.layers, weights.linear
        dtype, context, batch = run.dtype, run.context, run.batch
        self.cfg, self.embed, self.layers, self.norm, self.lm_head = cfg, embed, layers, weights.norm, weights.lm_head
        self.plan = plan(cfg)  # each layer's mixer and feed-forward kinds
        self.norm_bias, self.lm_head_bias = weights.norm_bias, weights.lm_head_bias
        self.dtype, self.context, self.accel = dtype, context, accel
        self.device = accel.device if accel is not None else torch.device("cpu")
        self.cache = cache_class(cfg)(cfg, batch, context, dtype, accel)
        cos, sin = rope_tables(cfg, context, dtype)
        self.cos, self.sin = (accel.place(cos, dtype, "RoPE tables"), accel.place(sin, dtype, "RoPE tables")) \
            if accel is not None else (cos, sin)
        # Gemma 4's global layers: tables of their own (their head size, theta and variant)
        self.global_tables: tuple[torch.Tensor, torch.Tensor] | None = None
        if cfg.global_rope is not None:
            theta, kind, params = cfg.global_rope
            own = replace(cfg, head_dim=cfg.global_head_dim or cfg.head_dim, rope_theta=theta, rope_type=kind,
                          rope_params=params, rotary_dim=0)
            tables = rope_tables(own, context, dtype)
            self.global_tables = tables if accel is None else tuple(  # type: ignore[assignment]
                accel.place(t, dtype, "RoPE tables") for t in tables)
        # LongRoPE: a pass that reaches past `rope_switch` tokens rotates with the long tables; None when the
        # context never gets there or the long tables are the short ones (Phi-3.5-MoE's, as transformers 5 runs it)
        self.rope_switch = long_after(cfg)
        if self.rope_switch is not None:
            cos_long, sin_long = rope_tables(cfg, context, dtype, long=True)
            if context <= self.rope_switch or torch.equal(cos_long, cos) and torch.equal(sin_long, sin):
                self.rope_switch = None
            elif accel is not None:
                cos_long, sin_long = accel.place(cos_long, dtype, "RoPE tables"), accel.place(sin_long, dtype,
                                                                                              "RoPE tables")
            self.cos_long, self.sin_long = cos_long, sin_long
        # Dense matrices (attention, routers, lm_head): bf16 ones through the kernel for the token counts it
        # serves (DenseLinear), anything else through torch. Every choice between a kernel and torch below is made
        # by where the model runs, not by where its tensors are: on an accelerator, the emulated one included, the
        # dense layers run as CUDA runs them (torch), so that the emulated device is a faithful stand-in.
        cpu = cpu or CpuOptions()
        kernels = cpu.use_kernel and accel is None
        self.linear = linear or DenseLinear(cpu.threads, kernels, cpu.isa)
        # RMSNorm: one kernel call for bf16 on the CPU (rounded like the reference), else the reference itself.
        fast_norm = kernels and library() is not None and dtype == torch.bfloat16
        self.rms_norm = rms_norm_bf16 if fast_norm else rms_norm
        # Decode attention: one kernel call per layer on the CPU (kernels/attend.py), else `attend_cached`.
        self.threads = self.linear.threads
        # (`attend_kernel`: the kernel serves this model's attention where it runs on the CPU; beside an accelerator
        # that is only a batch's attention over a KV cache in RAM, `host_cache`)
        self.attend_kernel = cpu.use_kernel and all(attend_serves(dtype, d) for d in cfg.head_sizes())
        # One token of a recurrent mixer (Gated DeltaNet, Mamba-2, short convolutions) in one kernel call on the CPU
        # (kernels/recur.py), else the torch step
        self.recur_kernel = kernels and recur_serves()
        # On an accelerator a prompt runs in passes of at most PREFILL_CHUNK tokens, and the memory their
        # activations take at the peak is kept back from the expert slots: a long prompt cannot run out of it.
        self.prefill_chunk: int | None = None
        if accel is not None:
            self.prefill_chunk = min(PREFILL_CHUNK, context)
            rows = 1 if run.ragged else batch
            accel.reserve(activation_bytes(cfg, self.prefill_chunk, context, rows, dtype), "activations")
        self.dispatcher = Dispatcher(cfg, replace(weights, linear=self.linear), run, accel, policy, cpu)
        # One decode token through every layer in one kernel call, where the step serves the model (off: the
        # torch path for every token, as the step's tests compare)
        self.use_step = True
        # Ragged passes on an accelerator: the KV cache in RAM and attention on the CPU (with_batch), and the
        # sequences in this many micro-batches, one's attention running while the accelerator runs another's experts
        self.host_cache = False
        self.micro_batches = 1
        self._host_tables: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self._step: DecodeStep | None = None
        self._step_key: tuple[object, bool] | None = None
        self._row_views: dict[int, MoEModel] = {}  # forward_rows' one-token passes: the model over one cache row

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint, run: ModelRun, accel: Accelerator | None = None,
                        policy: OffloadOptions | None = None, cpu: CpuOptions | None = None,
                        progress: Callable[[str, float], None] | None = None) -> MoEModel:
        """runtime/build.py `build_model`: the decoder built from `ckpt` for `run`."""
        from tandem.runtime.build import build_model

        return build_model(ckpt, run, accel, policy, cpu, progress)

    def with_batch(self, batch: int, host_cache: bool = False) -> MoEModel:
        """The same model (weights, experts, dispatcher shared) for `batch` sequences: its KV cache's first rows
        when it holds that many (the two must then not generate at the same time), else a cache of its own (on an
        accelerator, within what its budget has left: load with the batch to keep room for it). `host_cache`: on
        an accelerator, the cache in RAM and attention on the CPU (MoE-Lightning's: the batch's KV cache would not
        fit beside the weights), which `forward_rows` runs; not under Multi-head Latent Attention."""
        wide = copy.copy(self)
        if host_cache and self.accel is not None:
            refused = sorted({kinds.mixer.name for kinds in self.plan if not kinds.mixer.host_cache})
            if refused:
                raise ValueError(f"attention on the CPU beside an accelerator is not available for the {refused[0]} "
                                 "token mixer")
            wide.cache = cache_class(self.cfg)(self.cfg, batch, self.context, self.dtype)
            wide.host_cache = True
        elif batch > self.cache.batch:
            wide.cache = cache_class(self.cfg)(self.cfg, batch, self.context, self.dtype, self.accel)
        wide._step, wide._step_key, wide._row_views = None, None, {}
        return wide

    @property
    def recurrent(self) -> bool:
        """Whether some layers keep a recurrent state (runtime/state.py): prefix reuse takes it up only where a
        pass ended or a mark was taken."""
        return any(issubclass(kinds.mixer.cache, StateCache) for kinds in self.plan)

    def close(self) -> None:
        self._step, self._step_key = None, None  # its plan points into the experts the dispatcher frees
        self.dispatcher.close()

    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, start: int, last_only: bool = False, phase: str = "prefill",
                long: bool | None = None) -> torch.Tensor:
        """Token ids [B, T] at positions start..start+T-1 -> float32 host logits [B, T, V] (or [B, 1, V]).

        `phase` ("prefill" or "decode") labels the step in the expert activation trace. `long`: LongRoPE's long
        tables or not (None: as this pass's length decides; a prompt in several passes decides once). The device
        running out of memory on the way is a ResourceError (another program took what the budget counted on)."""
        held = self.cache.held
        rows = range(ids.shape[0])
        for r in rows:
            held.cut(r, start)
        if long is None:  # LongRoPE: this pass's length decides
            long = self.rope_switch is not None and start + ids.shape[1] > self.rope_switch
        try:
            logits = self._forward(ids, start, last_only, phase, long)
        except torch.OutOfMemoryError as e:
            raise ResourceError(f"the accelerator ran out of memory during a {ids.shape[1]}-token pass: another "
                                "program may have taken some; lower --vram-gb or --context, or use --accelerator "
                                "none") from e
        for r in rows:
            held.note(r, start, ids[r], long)
        return logits

    def _forward(self, ids: torch.Tensor, start: int, last_only: bool, phase: str, long: bool) -> torch.Tensor:
        B, T = ids.shape
        self.dispatcher.begin_step(phase)
        # The residual stream in float32, whatever the compute dtype (as llama.cpp keeps it): each layer adds to it
        # unrounded, and only the inputs of the matrix products are rounded, so bf16 picks fp32's top-1 token more
        # often (README, bf16 numerics).
        x = self._embed(ids)  # [B, T, H] float32
        cos, sin = (self.cos_long, self.sin_long) if long else (self.cos, self.sin)
        cos, sin = cos[start : start + T], sin[start : start + T]  # [T, D]
        step = self._decode_step() if B == 1 and T == 1 else None
        if step is not None:  # one token: every layer in one kernel call
            x = x.contiguous()
            step(x.view(-1), start, cos[0], sin[0])
        else:
            own = None if self.global_tables is None else tuple(t[start : start + T] for t in self.global_tables)
            timeline = self.dispatcher.timeline
            for i, (layer, kinds) in enumerate(zip(self.layers, self.plan, strict=True)):
                tables = own if own is not None and self.cfg.is_global(i) else (cos, sin)
                h = self._norm(x, layer.input_norm, layer.input_norm_bias)
                x = x + self._scaled(kinds.mixer.forward(self, i, layer.attn, h, start, *tables))
                h = self._norm(x, layer.post_norm, layer.post_norm_bias).view(B * T, -1)  # [B*T, H]
                # (a routed layer's whole time, as this pass waits for it, in the timeline: bench offload)
                with nullcontext() if timeline is None or not kinds.ffn.routed else timeline.span("moe"):
                    y = kinds.ffn.finish(self, layer.ffn, kinds.ffn.start(self, i, layer.ffn, x.view(B * T, -1), h))
                x = x + self._scaled(y.view(B, T, -1))  # [B, T, H]
                if layer.scalar is not None:
                    x = x * layer.scalar
        if last_only:
            x = x[:, -1:]  # [B, 1, H]
        # float32 logits, not rounded to the compute dtype: bf16 steps of 1/8 around 16-32 turn near ties into
        # exact ties, which argmax then breaks by token id
        logits = self.linear(self._norm(x, self.norm, self.norm_bias), self.lm_head, self.lm_head_bias,
                             out_dtype=torch.float32)
        return self._read_logits(logits)

    def _scaled(self, y: torch.Tensor) -> torch.Tensor:
        """A layer's attention or feed-forward output as it joins the residual stream: times Granite's
        residual_multiplier (muP), else as it is."""
        r = self.cfg.residual_multiplier
        return y if r == 1.0 else y * r

    def _read_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The step's logits on the host (on an accelerator, its one host read; divided by Granite's logits_scaling,
        soft-capped by Gemma's cap), then what the dispatcher left to read behind them."""
        if self.cfg.logits_scaling != 1.0:
            logits = logits / self.cfg.logits_scaling
        if (cap := self.cfg.logit_softcap) is not None:
            logits = torch.tanh(logits / cap) * cap
        if self.accel is None:
            return logits
        logits = self.accel.to_host(logits)
        self.dispatcher.end_step()
        return logits

    def _decode_step(self) -> DecodeStep | None:
        """The decode step of this model and its KV cache, planned on first use; None where it does not serve the
        model (runtime/decode_step.py why_not) or `use_step` is off."""
        if self._step_key is None or self._step_key[0] is not self.cache or self._step_key[1] != self.use_step:
            self._step_key = (self.cache, self.use_step)  # planned once per cache and setting
            self._step = DecodeStep(self) if self.use_step and why_not(self) is None else None
        return self._step

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids [B, T] -> their embeddings [B, T, H] float32 (GGUF blocks: only these rows, dequantized)."""
        if isinstance(self.embed, QuantizedMatrix):
            x = lookup_rows(self.embed, ids)  # [B, T, H]
        else:
            ids = ids if self.accel is None else self.accel.to_device(ids)  # [B, T] (no host wait on the copy)
            x = F.embedding(ids, self.embed).float()
        m = self.cfg.embedding_multiplier  # (Granite's muP)
        return x if m == 1.0 else x * m

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The decoder's norm: RMSNorm, or LayerNorm with its bias (cfg.norm_type "layer")."""
        if self.cfg.norm_type == "layer":
            return layer_norm(x, weight, bias, self.cfg.rms_norm_eps)  # type: ignore[arg-type]
        return self.rms_norm(x, weight, self.cfg.rms_norm_eps)

    @torch.inference_mode()
    def forward_rows(self, ids: torch.Tensor, segments: list[Segment], phase: str = "decode") -> torch.Tensor:
        """A ragged pass, as continuous batching runs: token ids [N], the concatenation of `segments`, each one
        sequence's new tokens in its own KV cache row at its own positions -> float32 host logits of each segment's
        last token [len(segments), V]. Every matrix, the experts' above all, is read once for all N tokens; only
        RoPE, the KV cache write and attention run segment by segment (under Multi-head Latent Attention, which
        projects from the cache's latents, the whole attention does)."""
        if ids.dim() != 1 or ids.numel() != sum(s.length for s in segments) or not segments:
            raise ValueError("forward_rows: ids must be the segments' tokens, one after another")
        if len(segments) == 1 and segments[0].length == 1 and not self.host_cache:
            # one sequence decoding alone (a server's one client): the path Engine.generate takes, the decode step's
            # one kernel call included, over that sequence's cache row
            seg = segments[0]
            return self._row_view(seg.row).forward(ids.view(1, 1), seg.start, True, phase, seg.long)[0]  # [1, V]
        held = self.cache.held
        for seg in segments:
            held.cut(seg.row, seg.start)
        try:
            logits = self._forward_rows(ids, segments, phase)
        except torch.OutOfMemoryError as e:
            raise ResourceError(f"the accelerator ran out of memory during a {ids.numel()}-token pass of "
                                f"{len(segments)} sequences: lower the batch size or --vram-gb, or use --accelerator "
                                "none") from e
        at = 0
        for seg in segments:
            held.note(seg.row, seg.start, ids[at : at + seg.length], seg.long)
            at += seg.length
        return logits

    def _row_view(self, row: int) -> MoEModel:
        """This model over KV cache row `row` alone (made once a row: its decode step is planned once)."""
        view = self._row_views.get(row)
        if view is None:
            view = copy.copy(self)
            view.cache = self.cache.row(row)
            view._step, view._step_key, view._row_views = None, None, {}
            self._row_views[row] = view
        return view

    def _forward_rows(self, ids: torch.Tensor, segments: list[Segment], phase: str) -> torch.Tensor:
        self.dispatcher.begin_step(phase)
        x = self._embed(ids[None])  # [1, N, H] float32
        ends = torch.tensor([s.length for s in segments]).cumsum(0).tolist()  # each segment's end among the N
        groups = self._micro_batches(segments)  # [(first segment, end segment)]
        self.dispatcher.micro_batches = len(groups)
        bounds = [(ends[a - 1] if a else 0, ends[b - 1]) for a, b in groups]  # their tokens: [lo, hi) of the N
        xs = [x[:, lo:hi] for lo, hi in bounds]  # [1, n, H] each
        # per micro-batch, once a pass: each segment's cache row (a view) and its span of the micro-batch's tokens
        rows = [[self.cache.row(seg.row) for seg in segments[a:b]] for a, b in groups]
        spans = [torch.tensor([0] + [s.length for s in segments[a:b]]).cumsum(0).tolist() for a, b in groups]
        moe = [i for i, kinds in enumerate(self.plan) if kinds.ffn.routed]
        after = dict(zip(moe, moe[1:], strict=False))  # each MoE layer's next one
        for i, (layer, kinds) in enumerate(zip(self.layers, self.plan, strict=True)):
            pending: list[tuple[int, Any]] = []  # (micro-batch, what its feed-forward started)
            for g, (a, b) in enumerate(groups):
                n = xs[g].shape[1]
                h = self._norm(xs[g], layer.input_norm, layer.input_norm_bias)  # [1, n, H]
                xs[g] = xs[g] + self._scaled(kinds.mixer.forward_rows(self, i, layer.attn, h, segments[a:b], rows[g],
                                                                      spans[g]))
                h = self._norm(xs[g], layer.post_norm, layer.post_norm_bias).view(n, -1)  # [n, H]
                # (routed: the accelerator's experts queued; the host goes on)
                pending.append((g, kinds.ffn.start(self, i, layer.ffn, xs[g].view(n, -1), h)))
            if len(groups) > 1 and i in after:  # the copy engine brings the next MoE layer's experts meanwhile
                self.dispatcher.prefetch(after[i])
            for g, p in pending:
                y = kinds.ffn.finish(self, layer.ffn, p)
                xs[g] = xs[g] + self._scaled(y.view(1, xs[g].shape[1], -1))  # [1, n, H]
                if layer.scalar is not None:
                    xs[g] = xs[g] * layer.scalar
        x = torch.cat(xs, dim=1) if len(xs) > 1 else xs[0]  # [1, N, H]
        last = torch.tensor([e - 1 for e in ends])  # [S]: each segment's last token
        last = last if self.accel is None else self.accel.to_device(last)  # (not built there: a host wait)
        x = x[:, last]  # [1, S, H]
        logits = self.linear(self._norm(x, self.norm, self.norm_bias), self.lm_head, self.lm_head_bias,
                             out_dtype=torch.float32)[0]  # [S, V]
        return self._read_logits(logits)

    def _micro_batches(self, segments: list[Segment]) -> list[tuple[int, int]]:
        """The segments in `micro_batches` runs of about equal tokens (one run without an accelerator: nothing
        would overlap), as [first, end) segment indexes."""
        parts = min(len(segments), self.micro_batches if self.accel is not None else 1)
        total = sum(s.length for s in segments)
        groups, start, acc = [], 0, 0
        for k, seg in enumerate(segments):
            acc += seg.length
            if len(groups) < parts - 1 and acc >= total * (len(groups) + 1) / parts and k + 1 < len(segments):
                groups.append((start, k + 1))
                start = k + 1
        groups.append((start, len(segments)))
        return groups

    def tables_for(self, long: bool, host: bool = False, layer: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The short or the long RoPE tables [positions, R] (layer `layer`'s own where it has them: Gemma 4's global
        layers); host copies for attention on the CPU beside an accelerator (made once)."""
        cos, sin = (self.cos_long, self.sin_long) if long else (self.cos, self.sin)
        own = self.global_tables is not None and layer is not None and self.cfg.is_global(layer)
        if own:
            cos, sin = self.global_tables  # type: ignore[misc]
        if host:
            key = "global" if own else "long" if long else "short"
            kept = self._host_tables.get(key)
            if kept is None:
                kept = self._host_tables[key] = (self.accel.to_host(cos), self.accel.to_host(sin))  # type: ignore[union-attr]
            cos, sin = kept
        return cos, sin

    def segment_tables(self, seg: Segment, host: bool = False, layer: int | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """A segment's RoPE tables [T, R]: its positions of the short or the long ones (`tables_for`)."""
        cos, sin = self.tables_for(seg.long, host, layer)
        end = seg.start + seg.length
        return cos[seg.start : end], sin[seg.start : end]
