"""Decode in one kernel call per token: every decoder layer's work for one new token (norms, projections, attention,
routing, experts) planned once into kernels/library.py's structures (`LayerArgs`), then run by csrc/step.c without
returning to Python between the pieces. `MoEModel.forward` uses it for one token of one sequence when `why_not`
finds nothing against the model; anything else (other variants, several tokens, an accelerator) runs the layer
loop, which stays the reference the step is tested against.

What the step does: RMSNorm, q/k/v as one matrix or three, q/k norms over all heads or per head, attention
(kernels/attend.py: RoPE over all or part of each head or none, sinks, sliding windows), its output gated where the
layer gates it (Qwen3-Next's), or a recurrent token mixer instead (Gated DeltaNet, Mamba-2, LFM2's short
convolution: its projection, its step over row 0's state, kernels/recur.py's, planned by the mixer's `step_args`),
the output projection, a router whose matrix the kernel multiplies, softmax, softmax-over-the-top-k or sigmoid
routing (with a correction bias for choosing), routed experts the kernels run, a shared expert beside them (behind
a sigmoid gate, or not) or a dense layer's SwiGLU (through the dense kernels, as the layer loop's `LinearMLP`
multiplies it), each output times the residual multiplier (muP's); on the CPU, in bf16 (rounding where the layer
loop rounds) or in float32 compute (the default on a CPU without native bf16: its matrices as the kernels keep them,
bf16, fp16, float32 or GGUF blocks, against float32 activations, a float32 KV cache).
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

import torch

from tandem.kernels.attend import ATTEND_ISAS, attend_isa
from tandem.kernels.dense import DenseLinear, rms_norm_bf16
from tandem.kernels.library import XB_EXTRA, AttendArgs, LayerArgs, LinearArgs
from tandem.kernels.quant import QuantizedMatrix
from tandem.kernels.step import (
    FFN_DENSE,
    FFN_ROUTED,
    FFN_SHARED,
    MAX_EXPERTS,
    MAX_TOP_K,
    MIXERS,
    QK_NORMS,
    SCORINGS,
    decode_layers,
)
from tandem.runtime.moe import ExpertWeights, MoEBlockWeights, mlp_matrices
from tandem.runtime.recurrent import RecurrentMixer

if TYPE_CHECKING:
    from tandem.runtime.attention import Attention
    from tandem.runtime.model import MoEModel


STEP_DTYPES = (torch.bfloat16, torch.float32)  # the compute dtypes the step runs (csrc/step.c's f32)


def why_not(model: MoEModel) -> str | None:
    """What keeps this model off the decode step (None: nothing). Each layer's kinds say first whether the step runs
    them (runtime/layers.py: today grouped-query attention, routed experts with or without an ungated shared expert,
    a dense SwiGLU)."""
    cfg = model.cfg
    if not model.attend_kernel:  # (set only where the kernels are built and used)
        return "the kernels are not built, or not used"
    if model.accel is not None or model.dtype not in STEP_DTYPES:
        return "it runs on an accelerator, or in fp16"
    if model.dispatcher.reading_ahead:
        return "its experts are read ahead from their files, a layer at a time"
    if model.dtype == torch.bfloat16 and model.rms_norm is not rms_norm_bf16:
        return "it runs in bf16 without the kernels' RMSNorm"
    if cfg.norm_type != "rms":
        return "its norms are LayerNorm"
    if cfg.activation != "silu" or cfg.layer_scalars or cfg.logit_softcap is not None:
        return "its MLPs' gate is not SiLU, or its layers' outputs or its logits are scaled (Gemma 4)"
    if cfg.num_experts > MAX_EXPERTS or cfg.top_k > MAX_TOP_K:
        return "it has more experts than the step takes"
    executor = model.dispatcher.executor
    for i, (layer, kinds) in enumerate(zip(model.layers, model.plan, strict=True)):
        ffn = layer.ffn
        refusal = kinds.mixer.step_refusal(cfg) or kinds.ffn.step_refusal(ffn)
        if refusal is not None:
            return f"layer {i}: {refusal}"
        recurrent = isinstance(kinds.mixer, RecurrentMixer)
        if recurrent and (not model.recur_kernel or kinds.mixer.name not in MIXERS):
            return f"layer {i}: its {kinds.mixer.name} mixer's step does not run here"
        mixer = layer.attn
        matrices = [mixer.out if recurrent else mixer.o] + parts(mixer.proj if recurrent else mixer.qkv)
        mlp = own_mlp(ffn)
        if mlp is not None:
            matrices += mlp_matrices(mlp)
        if isinstance(ffn, MoEBlockWeights):  # (the kinds the step runs: GQA's Attention, routed experts, dense)
            if not executor.serves_layer(model.dispatcher.cpu_layers[i], 1):
                return f"layer {i}'s experts do not run on the kernels"
            matrices.append(ffn.router)
        if any(model.linear.one_token_call(m, model.dtype) is None for m in matrices):
            return f"layer {i} has a matrix the kernels do not multiply"
        norms = [layer.input_norm, layer.post_norm] + ([layer.attn.q_norm, layer.attn.k_norm]
                                                       if cfg.qk_norm != "none" and not recurrent else [])
        if any(n is None or n.dtype != model.dtype or not n.is_contiguous() for n in norms):
            return f"layer {i} has norms that are not in the compute dtype"
    return None


def parts(m: object) -> list[object]:
    """A projection's matrices: one, or several whose outputs lie side by side (formats that differ)."""
    return list(m) if isinstance(m, list) else [m]


def real_rows(m: object) -> int:
    """A matrix's own rows (GGUF blocks: rows of blocks), before any padding."""
    return m.data.shape[0] if isinstance(m, QuantizedMatrix) else m.shape[0]  # type: ignore[attr-defined]


def own_mlp(ffn: object) -> ExpertWeights | None:
    """A layer's own SwiGLU the step computes: its shared expert's, or the dense layer itself (None: neither)."""
    if isinstance(ffn, MoEBlockWeights):
        return ffn.shared.mlp if ffn.shared is not None else None
    return ffn if isinstance(ffn, ExpertWeights) else None


class DecodeStep:
    """The planned layers of one model (its weights, its KV cache and recurrent state) and the buffers they share."""

    def __init__(self, model: MoEModel) -> None:
        cfg, linear = model.cfg, model.linear
        H, Hq, Hkv, D = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        E, K = cfg.num_experts, cfg.top_k
        self.model, self.cache = model, model.cache
        self.f32 = f32 = model.dtype == torch.float32  # float32 compute: nothing rounded, the results where they go
        act = model.dtype  # q, k, v and attention's output in the compute dtype (the KV cache's)
        mlps = [own_mlp(layer.ffn) for layer in model.layers]
        inter = max([m.gate.shape[0] for m in mlps if m is not None], default=0)  # the widest own SwiGLU's I
        recurrent = [isinstance(kinds.mixer, RecurrentMixer) for kinds in model.plan]
        # what each layer's projection writes (a part padded to whole groups of 32 writes past its rows: _extent),
        # a recurrent mixer's output's width (o's input)
        proj_rows = [self._extent(linear, layer.attn.proj if r else layer.attn.qkv)
                     for layer, r in zip(model.layers, recurrent, strict=True)]
        inner = max([layer.attn.out.shape[-1] if not isinstance(layer.attn.out, QuantizedMatrix) else
                     layer.attn.out.cols for layer, r in zip(model.layers, recurrent, strict=True) if r], default=0)
        qkv_rows = max([(2 * Hq + 2 * Hkv) * D if cfg.attention_gate else (Hq + 2 * Hkv) * D]  # (gates after v)
                       + [n for n, r in zip(proj_rows, recurrent, strict=True) if not r])
        proj_rows = [n if r else 0 for n, r in zip(proj_rows, recurrent, strict=True)]
        widths = [H, Hq * D, inter, inner]
        router_rows = -(-E // 32) * 32  # the router's rows as the kernel reads them (DenseLinear.padded)
        rows = [H, router_rows, qkv_rows, -(-max(inter, H) // 32) * 32, *proj_rows]
        self.h = torch.empty(H, dtype=torch.bfloat16)
        self.hf = torch.empty(H)
        self.qkv_out = torch.empty(qkv_rows, dtype=act)
        self.attend_out = torch.empty(Hq * D, dtype=act)
        self.o_x, self.o_y = (self.attend_out if f32 else torch.empty(Hq * D)), torch.empty(H)
        self.mix_p = torch.empty(max(proj_rows, default=0), dtype=act)  # a recurrent mixer's projection
        self.mix_pf = self.mix_p if f32 else torch.empty(max(proj_rows, default=0))  # (float32: the step reads it)
        self.mix_out = torch.empty(1, inner)  # the mixer's step's output, float32
        self.mix_x = self.mix_out.view(-1) if f32 else torch.empty(inner)  # o's input: the output as torch hands it
        self.y = torch.empty(max(rows))  # the projections' float32 results, before rounding to bf16
        self.xb = torch.empty(32, max(widths) + XB_EXTRA, dtype=torch.int16)  # as DenseLinear's (csrc/common.h xb)
        self.logits = torch.empty(router_rows, dtype=torch.bfloat16)  # the first E: the router's logits (bf16)
        self.ids = torch.zeros(cfg.num_layers, K, dtype=torch.int64)  # [L, K] each layer's choice, this token
        self.weights = torch.zeros(cfg.num_layers, K)  # [L, K]
        self.moe_out = torch.empty(H)
        padded = -(-max(inter, H) // 32) * 32  # (rows a padded copy of a matrix gives: DenseLinear.padded)
        self.mlp_gate, self.mlp_up = (torch.empty(padded, dtype=act) for _ in range(2))  # the SwiGLU's gate and up
        self.mlp_h = torch.empty(inter)  # silu(gate) * up, down's input
        self.mlp_out = torch.empty(padded, dtype=act)
        self.routed = [isinstance(layer.ffn, MoEBlockWeights) for layer in model.layers]  # the layers with experts
        self.biases: list[torch.Tensor] = []  # the biases as the layers add them (below), kept with the plan
        self.recur: list[tuple[ctypes.Structure, list[torch.Tensor]]] = []  # the mixers' planned steps, their buffers
        self.layers = (LayerArgs * cfg.num_layers)()
        executor = model.dispatcher.executor
        for i, (layer, kinds) in enumerate(zip(model.layers, model.plan, strict=True)):
            a, ffn = self.layers[i], layer.ffn
            a.f32 = f32
            a.hidden, a.eps, a.residual = H, cfg.rms_norm_eps, cfg.residual_multiplier
            a.input_norm, a.post_norm = layer.input_norm.data_ptr(), layer.post_norm.data_ptr()
            a.h, a.hf = self.h.data_ptr(), self.hf.data_ptr()
            a.mixer = MIXERS[kinds.mixer.name]
            if recurrent[i]:
                self._mixer(a, model, i, layer.attn, kinds.mixer)
            else:
                self._attention(a, model, i, layer.attn)
            mlp = mlps[i]
            if mlp is not None:
                self._mlp(a, linear, mlp)
            if not isinstance(ffn, MoEBlockWeights):
                a.ffn = FFN_DENSE
                continue
            a.ffn = FFN_ROUTED if mlp is None else FFN_SHARED
            if ffn.shared is not None and ffn.shared.gate is not None:  # (float32: its bf16 values exactly)
                a.shared_gate = self._bias(ffn.shared.gate.reshape(-1), torch.float32)
            a.scoring, a.normalize, a.scaling = SCORINGS[ffn.rule.scoring], ffn.rule.normalize, ffn.rule.scaling
            self._linear(a.router, linear, ffn.router, self.hf)
            a.router.yb = None if f32 else self.logits.data_ptr()  # (float32: its sums, in y)
            # the biases in the dtypes the layer loop adds them in: bf16 for q/k/v and the router, whose outputs are
            # rounded first; float32 for o, added to its sums, and for all of them under float32 compute
            a.router_bias = self._bias(ffn.router_bias, act)
            a.correction = self._bias(ffn.correction, torch.float32)  # (float32, as route adds it)
            executor.moe_args(model.dispatcher.cpu_layers[i], 1, into=a.moe)
            a.moe.tokens, a.moe.top_k = 1, K
            a.moe.ids, a.moe.weights = self.ids[i].data_ptr(), self.weights[i].data_ptr()
            a.moe.out = self.moe_out.data_ptr()
            if f32:
                a.moe.x, a.moe.x_bf16 = self.hf.data_ptr(), None
            else:
                a.moe.x_bf16 = self.h.data_ptr()

    def _attention(self, a: LayerArgs, model: MoEModel, i: int, attn: Attention) -> None:
        """Layer i's attention: q, k, v (and gates) as one product or parts, their biases, q/k norms, the cached
        attention, o."""
        cfg, linear, act = model.cfg, model.linear, model.dtype
        a.qk_norm, a.window = QK_NORMS[cfg.qk_norm], cfg.window(i) or 0
        if cfg.qk_norm != "none":
            a.q_norm, a.k_norm = attn.q_norm.data_ptr(), attn.k_norm.data_ptr()  # type: ignore[union-attr]
        a.qkv_out, a.attend_out = self.qkv_out.data_ptr(), self.attend_out.data_ptr()
        a.attn_gate = int(cfg.attention_gate)
        a.n_qkv = self._side_by_side(a.qkv, linear, attn.qkv, self.qkv_out)
        a.qkv_rows = (2 if cfg.attention_gate else 1) * cfg.num_heads * cfg.head_dim + \
            2 * cfg.num_kv_heads * cfg.head_dim
        self._linear(a.o, linear, attn.o, self.o_x)
        a.o.y, a.o.yb = self.o_y.data_ptr(), None
        a.qkv_bias = self._bias(attn.qkv_bias, act)
        a.o_bias = self._bias(attn.o_bias, torch.float32)
        self._attend(a.attend, model, i)

    def _mixer(self, a: LayerArgs, model: MoEModel, i: int, w: Any, mixer: RecurrentMixer) -> None:
        """Layer i's recurrent mixer: its projection into mix_p (its parts side by side), its bias, its step over
        row 0's state (the mixer's plan), o reading the step's output."""
        linear, act = model.linear, model.dtype
        a.n_proj = self._side_by_side(a.proj, linear, w.proj, self.mix_p)
        a.proj_bias = self._bias(w.proj_bias, act)
        a.proj_rows = rows = sum(real_rows(m) for m in parts(w.proj))  # (P: what the step reads)
        out = self.mix_out[:, : w.out.cols if isinstance(w.out, QuantizedMatrix) else w.out.shape[-1]]
        a.mix_inner = out.shape[-1]
        args, keep = mixer.step_args(model, i, w, self.mix_pf[:rows].view(1, rows), out)
        self.recur.append((args, keep))
        a.recur = ctypes.addressof(args)
        a.mix_p, a.mix_pf, a.mix_out = self.mix_p.data_ptr(), self.mix_pf.data_ptr(), out.data_ptr()
        self._linear(a.o, linear, w.out, self.mix_x)
        a.o.y, a.o.yb = self.o_y.data_ptr(), None
        a.o_bias = self._bias(w.out_bias, torch.float32)

    def _side_by_side(self, calls: ctypes.Array[LinearArgs], linear: DenseLinear, m: object, out: torch.Tensor
                      ) -> int:
        """A projection (one matrix, or parts) of the normed stream into `out`, each part's rows after the last
        part's own rows, as DenseLinear puts them side by side (a part padded to whole groups of 32 writes past its
        rows, and the next part, run after it, writes over that); returns how many calls."""
        at = 0
        for j, part in enumerate(parts(m)):
            self._linear(calls[j], linear, part, self.hf)
            if self.f32:  # the float32 sums where the outputs go
                calls[j].y, calls[j].yb = out.data_ptr() + 4 * at, None
            else:
                calls[j].yb = out.data_ptr() + 2 * at
            at += real_rows(part)
        return len(parts(m))

    def _extent(self, linear: DenseLinear, m: object) -> int:
        """How far `_side_by_side` writes for projection m: each part at its offset, as many rows as the kernels
        write for it (a padded copy's where DenseLinear pads it)."""
        at = end = 0
        for part in parts(m):
            call = linear.one_token_call(part, self.model.dtype)
            assert call is not None  # (why_not checked)
            end, at = max(end, at + call[1]), at + real_rows(part)
        return end

    def _mlp(self, a: LayerArgs, linear: DenseLinear, mlp: ExpertWeights) -> None:
        """The layer's own SwiGLU (a shared expert's, or a dense layer's) as three products: gate and up of the
        normed stream, down of silu(gate) * up; each result rounded where DenseLinear rounds it (bf16), or kept
        (float32 compute)."""
        gate, up, down = mlp_matrices(mlp)
        a.mlp_inter = mlp.gate.shape[0]  # I (the products' rows may be more: a padded copy's)
        self._linear(a.mlp[0], linear, gate, self.hf)
        self._linear(a.mlp[1], linear, up, self.hf)
        self._linear(a.mlp[2], linear, down, self.mlp_h)
        for part, out in zip(a.mlp, (self.mlp_gate, self.mlp_up, self.mlp_out), strict=True):
            if self.f32:
                part.y, part.yb = out.data_ptr(), None
            else:
                part.yb = out.data_ptr()
        a.mlp_gate, a.mlp_up, a.mlp_out = (t.data_ptr() for t in (self.mlp_gate, self.mlp_up, self.mlp_out))
        a.mlp_h = self.mlp_h.data_ptr()

    def _bias(self, bias: torch.Tensor | None, dtype: torch.dtype) -> int | None:
        """The address of `bias` in `dtype` (a copy kept with the plan), or None."""
        if bias is None:
            return None
        self.biases.append(bias.to(dtype).contiguous())
        return self.biases[-1].data_ptr()

    def _linear(self, a: LinearArgs, linear: DenseLinear, m: object, x: torch.Tensor) -> int:
        """One token against matrix m as DenseLinear would call the kernel, reading x (float32); returns its rows."""
        call = linear.one_token_call(m, self.model.dtype)
        assert call is not None  # (why_not checked)
        w, rows, width, kind, isa = call
        a.tokens, a.inp, a.out, a.threads, a.isa, a.kind = 1, width, rows, linear.threads, isa, kind
        a.w, a.x, a.y, a.xb = w, x.data_ptr(), self.y.data_ptr(), self.xb.data_ptr()
        return rows

    def _attend(self, a: AttendArgs, model: MoEModel, i: int) -> None:
        cfg = model.cfg
        nq, nkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        sinks = model.layers[i].attn.sinks  # type: ignore[union-attr]
        a.batch, a.heads, a.kv_heads, a.dim = 1, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        a.rot = model.cos.shape[-1] if cfg.rotates(i) else 0  # (a layer without RoPE: nothing turns)
        a.bf16, a.threads = int(not self.f32), model.threads
        a.isa = ATTEND_ISAS.index(attend_isa())  # type: ignore[arg-type]
        a.ld_q, a.ld_k, a.ld_v, a.context = nq, nkv, nkv, model.context
        q, item = self.qkv_out.data_ptr(), self.qkv_out.element_size()
        a.q, a.k, a.v = q, q + item * nq, q + item * (nq + nkv)
        a.kcache, a.vcache = model.cache.k[i].data_ptr(), model.cache.v[i].data_ptr()  # type: ignore[union-attr]
        a.sinks = sinks.data_ptr() if sinks is not None else None
        a.scale, a.out = cfg.attention_scale, self.attend_out.data_ptr()

    def __call__(self, x: torch.Tensor, start: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """x [H] float32, the residual stream of one token at `start`, through every layer (in place); cos and sin
        [R] are this position's RoPE rows. Each layer's choice of experts goes into the trace and statistics."""
        decode_layers(self.layers, x, start, cos, sin)
        self.model.dispatcher.record_cpu_token(self.ids, self.routed)  # [L, K], of the layers with experts
