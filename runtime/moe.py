"""The reference MoE expert layer, in plain PyTorch. Every fast path is tested against it. And the two feed-forward
layer kinds (runtime/layer_kind.py `FeedForward`): "routed" (`RoutedExperts`: a router, routed experts, an optional
shared expert; its fast paths are the dispatcher's, runtime/dispatch.py) and "dense" (`DenseFeedForward`: one
SwiGLU every token goes through, an `ExpertWeights`).

Letters: T tokens, H hidden size, E routed experts, K experts per token (top-k), I expert width, n tokens
routed to one expert.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Literal

import torch
import torch.nn.functional as F

from tandem.kernels.blocks import block_matrix
from tandem.kernels.experts import clamped_glu, glu
from tandem.kernels.quant import MX_BLOCK, QuantizedMatrix, nibbles_from_pairs
from tandem.kernels.step import SCORINGS
from tandem.runtime.config import ModelConfig
from tandem.runtime.layer_kind import Loaders
from tandem.runtime.weights import correction_name, layer_prefix, router_bias_name, router_name, shared_expert_names

if TYPE_CHECKING:
    from tandem.runtime.dispatch import Pending
    from tandem.runtime.model import MoEModel

Scoring = Literal["softmax", "sigmoid", "softmax_topk", "sparsemixer"]
GroupScore = Literal["max", "top2"]


@dataclass(frozen=True)
class RoutingRule:
    """How a token picks its experts from the router's logits.

    - `scoring`: "softmax" over all experts (Mixtral, Qwen, OLMoE, DeepSeek-V2), "sigmoid" per expert (DeepSeek-V3,
      GLM-4.5), "softmax_topk": the top-k logits, then a softmax over those alone (gpt-oss), or "sparsemixer"
      (PhiMoE, always two experts): see `_sparsemixer`; `jitter_eps` is its threshold.
    - A layer's correction bias (`MoEBlockWeights.correction`, DeepSeek-V3's `e_score_correction_bias`) is added to
      the scores for choosing only; the weights are the scores themselves.
    - Group-limited choice (`n_group` > 1): the experts form `n_group` equal groups, each scored by its best expert
      ("max", DeepSeek-V2) or its two best ("top2", DeepSeek-V3, GLM); only the `topk_group` best groups compete.
    - `normalize`: the chosen weights are scaled to sum to one; then all are multiplied by `scaling`
      (`routed_scaling_factor`).
    - `scale_input` (Llama 4, one expert a token): the expert takes the token times its weight, and its output is
      added as it is (`routed_input`), where every other rule weights the output.
    """

    top_k: int
    normalize: bool
    scoring: Scoring = "softmax"
    n_group: int = 1
    topk_group: int = 1
    group_score: GroupScore = "max"
    scaling: float = 1.0
    jitter_eps: float = 0.0  # sparsemixer only: PhiMoE's `router_jitter_noise`
    scale_input: bool = False


@dataclass(frozen=True)
class ExpertWeights:
    """One SwiGLU feed-forward network: down(silu(gate x) * up x), or GeGLU's gelu_tanh(gate x) where `act` says
    (kernels/experts.py `glu`). Weights may be memory-mapped views."""

    gate: torch.Tensor  # [I, H]
    up: torch.Tensor  # [I, H]
    down: torch.Tensor  # [H, I]
    act: str = "silu"  # ModelConfig.activation

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, H]
        dt = x.dtype  # weights stored in another dtype are converted per call, never kept converted
        return F.linear(glu(F.linear(x, self.gate.to(dt)), F.linear(x, self.up.to(dt)), self.act), self.down.to(dt))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    # the C kernels compute this expert (plain SwiGLU without biases); else the CPU runs its __call__ in torch
    kernel_ready: ClassVar[bool] = True

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the expert, as copied onto the accelerator (`like` takes copies in this order)."""
        return [self.gate, self.up, self.down]

    def like(self, tensors: Sequence[torch.Tensor]) -> ExpertWeights:
        """The same kind of expert over other tensors shaped as `tensors()` (an accelerator slot)."""
        return ExpertWeights(*tensors, act=self.act)


@dataclass(frozen=True, kw_only=True)
class ClampedSwiGLUExpert(ExpertWeights):
    """gpt-oss's expert, as transformers' GptOssExperts computes it: gate_up = x @ gate_up_proj + bias, its even
    columns the gate and odd ones the up projection (interleaved); the gate clamped above at `limit`, the up
    projection to [-limit, limit]; then (up + 1) * gate * sigmoid(alpha * gate), @ down_proj + bias.

    `gate`, `up` and `down` ([I, H], [I, H], [H, I]) are strided views of the on-disk matrices, for whatever reads an
    expert's standard layout; the products use the fused matrices as stored (one contiguous [H, 2I] product, as
    transformers). The C kernels compute none of this (biases, clamps, alpha): `kernel_ready` is False."""

    gate_up: torch.Tensor  # [H, 2I] (gate, up) columns interleaved
    gate_up_bias: torch.Tensor  # [2I], interleaved likewise
    down_bias: torch.Tensor  # [H]
    alpha: float
    limit: float
    kernel_ready: ClassVar[bool] = False

    @classmethod
    def from_fused(cls, gate_up: torch.Tensor, gate_up_bias: torch.Tensor, down: torch.Tensor,
                   down_bias: torch.Tensor, alpha: float, limit: float) -> ClampedSwiGLUExpert:
        """From one expert's slices of the fused tensors: gate_up [H, 2I], its bias [2I], down [I, H], its bias [H]
        (no copies)."""
        return cls(gate_up[:, ::2].t(), gate_up[:, 1::2].t(), down.t(),  # [I, H], [I, H], [H, I] views
                   gate_up=gate_up, gate_up_bias=gate_up_bias, down_bias=down_bias, alpha=alpha, limit=limit)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, H]
        dt = x.dtype  # weights stored in another dtype are converted per call, never kept converted
        gate_up = torch.addmm(self.gate_up_bias.to(dt), x, self.gate_up.to(dt))  # [n, 2I]
        h = clamped_glu(gate_up[:, ::2], gate_up[:, 1::2], self.alpha, self.limit)  # [n, I]
        return F.linear(h, self.down.to(dt), self.down_bias.to(dt))  # down [H, I]: down_proj^T

    def tensors(self) -> list[torch.Tensor]:
        return [self.gate_up, self.gate_up_bias, self.down.t(), self.down_bias]  # down_proj [I, H] as stored

    def like(self, tensors: Sequence[torch.Tensor]) -> ClampedSwiGLUExpert:
        gate_up, gate_up_bias, down, down_bias = tensors
        return ClampedSwiGLUExpert.from_fused(gate_up, gate_up_bias, down, down_bias, self.alpha, self.limit)


@dataclass(frozen=True, kw_only=True)
class MXFP4Expert(ExpertWeights):
    """gpt-oss's expert as published: `ClampedSwiGLUExpert`'s computation over MXFP4 weights, kept 4-bit.

    `gate`, `up`, `down` hold the packed codes ([I, H/2], [I, H/2], [H, I/2] uint8, kernels/quant.py's MXFP4
    layout), `*_scales` the E8M0 bytes ([I, H/32], [I, H/32], [H, I/32]); the biases are float32. The C kernels run
    it (`kernel_ready`); called directly (the accelerator, torch), it dequantizes on use."""

    gate_scales: torch.Tensor
    up_scales: torch.Tensor
    down_scales: torch.Tensor
    gate_bias: torch.Tensor  # [I]
    up_bias: torch.Tensor  # [I]
    down_bias: torch.Tensor  # [H]
    alpha: float
    limit: float

    @classmethod
    def layer(cls, gate_up_blocks: torch.Tensor, gate_up_scales: torch.Tensor, gate_up_bias: torch.Tensor,
              down_blocks: torch.Tensor, down_scales: torch.Tensor, down_bias: torch.Tensor, alpha: float,
              limit: float) -> list[MXFP4Expert]:
        """A layer's experts from its stored tensors: gate_up blocks [E, 2I, H/32, 16] and scales [E, 2I, H/32] (rows
        interleaved: even rows gate, odd rows up), bias [E, 2I]; down blocks [E, H, I/32, 16], scales [E, H, I/32],
        bias [E, H]. The 4-bit copies go into one tensor per kind and layer, whose rows each expert views, made one
        expert at a time (per-expert tensors, or four experts' temporaries at once, left the allocator's heap up to
        2.5 times the size of what they kept: gpt-oss-20b did not fit 24 GB)."""
        n, two_i, h = gate_up_blocks.shape[0], gate_up_blocks.shape[1], down_blocks.shape[1]
        i = two_i // 2
        gate, up = (torch.empty(n, i, h // 2, dtype=torch.uint8) for _ in range(2))  # [E, I, H/2]
        down = torch.empty(n, h, i // 2, dtype=torch.uint8)  # [E, H, I/2]
        for e in range(n):  # one expert's temporaries at a time: the heap reuses them
            packed = nibbles_from_pairs(gate_up_blocks[e])  # [2I, H/2]
            gate[e], up[e] = packed[0::2], packed[1::2]
            down[e] = nibbles_from_pairs(down_blocks[e])
        gate_scales, up_scales = gate_up_scales[:, 0::2].contiguous(), gate_up_scales[:, 1::2].contiguous()
        down_scales = down_scales.contiguous()
        gate_bias, up_bias = gate_up_bias[:, 0::2].float().contiguous(), gate_up_bias[:, 1::2].float().contiguous()
        down_bias = down_bias.float().contiguous()
        return [cls(gate[e], up[e], down[e], gate_scales=gate_scales[e], up_scales=up_scales[e],
                    down_scales=down_scales[e], gate_bias=gate_bias[e], up_bias=up_bias[e], down_bias=down_bias[e],
                    alpha=alpha, limit=limit) for e in range(n)]

    def matrices(self) -> tuple[QuantizedMatrix, QuantizedMatrix, QuantizedMatrix]:
        """gate, up and down as the kernels' quantized matrices (views, no copies)."""
        return tuple(QuantizedMatrix("mxfp4", d, s, d.shape[1] * 2, MX_BLOCK)  # type: ignore[return-value]
                     for d, s in ((self.gate, self.gate_scales), (self.up, self.up_scales),
                                  (self.down, self.down_scales)))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, H]
        dt = x.dtype
        gate, up, down = (m.dequantize(dt) for m in self.matrices())
        h = clamped_glu(F.linear(x, gate, self.gate_bias.to(dt)), F.linear(x, up, self.up_bias.to(dt)), self.alpha,
                        self.limit)  # [n, I]
        return F.linear(h, down, self.down_bias.to(dt))

    def tensors(self) -> list[torch.Tensor]:
        return [self.gate, self.up, self.down, self.gate_scales, self.up_scales, self.down_scales, self.gate_bias,
                self.up_bias, self.down_bias]

    def like(self, tensors: Sequence[torch.Tensor]) -> MXFP4Expert:
        gate, up, down, gs, us, ds, gb, ub, db = tensors
        return MXFP4Expert(gate, up, down, gate_scales=gs, up_scales=us, down_scales=ds, gate_bias=gb, up_bias=ub,
                           down_bias=db, alpha=self.alpha, limit=self.limit)


def swiglu_through(linear: Callable[..., torch.Tensor], x: torch.Tensor, gate: object, up: object,
                   down: object, act: str = "silu") -> torch.Tensor:
    """down(silu(gate x) * up x) (or `act`'s gate) with each product through `linear` (DenseLinear), rounded where
    it rounds: the layer loop's own SwiGLUs as the decode step computes them (csrc/step.c swiglu). x [n, H] ->
    [n, H]."""
    return linear(glu(linear(x, gate), linear(x, up), act), down)


@dataclass(frozen=True, kw_only=True)
class BlockExpert(ExpertWeights):
    """A SwiGLU expert whose matrices are GGUF blocks as the file stores them (kernels/blocks.py): `gate`, `up`,
    `down` are their rows of blocks, uint8 [I, bytes a row] / [H, bytes a row], views of the file (or of its RAM
    copy); gate and up share one format, down may have another (Q4_K_M keeps some in Q6_K). The C kernels read
    them as they are (`matrices`); called directly (an accelerator slot, torch), it dequantizes on use."""

    formats: tuple[str, str]  # (gate and up's, down's)
    linear: Callable[..., torch.Tensor] | None = field(default=None, compare=False)  # DenseLinear: x . W^T

    def matrices(self) -> tuple[QuantizedMatrix, QuantizedMatrix, QuantizedMatrix]:
        """gate, up and down as the kernels' matrices (views, no copies)."""
        fmt, down = self.formats
        return block_matrix(self.gate, fmt), block_matrix(self.up, fmt), block_matrix(self.down, down)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, H]
        gate, up, down = self.matrices()
        if self.linear is not None and x.device.type == "cpu":  # a dense layer or shared expert: the kernel
            return swiglu_through(self.linear, x, gate, up, down, self.act)
        dt = x.dtype
        gate_w, up_w, down_w = (m.dequantize(dt) for m in (gate, up, down))  # where the blocks lie
        return F.linear(glu(F.linear(x, gate_w), F.linear(x, up_w), self.act), down_w)

    def like(self, tensors: Sequence[torch.Tensor]) -> BlockExpert:
        gate, up, down = tensors
        return BlockExpert(gate, up, down, self.act, formats=self.formats)


@dataclass(frozen=True, kw_only=True)
class LinearMLP(ExpertWeights):
    """A SwiGLU of float matrices that every token of a layer goes through (a dense layer's, a shared expert),
    multiplied through the model's dense-matrix runner (`linear`: DenseLinear) on the CPU, as GGUF blocks' are
    (`BlockExpert`) and as the one-call decode step multiplies them, so both paths compute it alike; elsewhere (an
    accelerator's tensors) through torch."""

    linear: Callable[..., torch.Tensor] = field(compare=False)  # DenseLinear: x . W^T

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, H]
        if x.device.type != "cpu":
            return super().__call__(x)
        return swiglu_through(self.linear, x, self.gate, self.up, self.down, self.act)

    def like(self, tensors: Sequence[torch.Tensor]) -> LinearMLP:
        gate, up, down = tensors
        return LinearMLP(gate, up, down, self.act, linear=self.linear)


def through_linear(mlp: ExpertWeights) -> bool:
    """Whether a layer's own SwiGLU (dense, or a shared expert) runs through the model's DenseLinear on the CPU, as
    the decode step computes it."""
    return isinstance(mlp, LinearMLP) or isinstance(mlp, BlockExpert) and mlp.linear is not None


def layer_mlp(ffn: object) -> ExpertWeights | None:
    """A layer's own MLP every token goes through: a dense layer's, a shared expert's, or the one beside the experts
    (Gemma 4's: runtime/parallel.py `ParallelBlockWeights.mlp`); None: none."""
    if isinstance(ffn, MoEBlockWeights):
        beside = getattr(ffn, "mlp", None)
        return beside if beside is not None else ffn.shared.mlp if ffn.shared is not None else None
    return ffn if isinstance(ffn, ExpertWeights) else None


def mlp_matrices(mlp: ExpertWeights) -> list[object]:
    """Its gate, up and down as DenseLinear takes them (GGUF blocks as their matrices)."""
    return list(mlp.matrices()) if isinstance(mlp, BlockExpert) else [mlp.gate, mlp.up, mlp.down]


@dataclass(frozen=True)
class SharedExpert:
    """An expert every token goes through: scaled by sigmoid(gate · x) (Qwen2-MoE), or added as it is (no gate:
    DeepSeek, GLM)."""

    mlp: ExpertWeights
    gate: torch.Tensor | None  # [1, H]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        if self.gate is None:
            return self.mlp(x)
        return torch.sigmoid(F.linear(x, self.gate)) * self.mlp(x)


@dataclass(frozen=True)
class MoEBlockWeights:
    """One MoE layer: router, routed experts (host: RAM copies or memory-mapped), routing rule, optional shared
    expert."""

    router: torch.Tensor  # [E, H]
    experts: list[ExpertWeights]
    rule: RoutingRule
    shared: SharedExpert | None = None
    correction: torch.Tensor | None = None  # [E] added to the scores for choosing only (see RoutingRule)
    router_bias: torch.Tensor | None = None  # [E] added to the router's logits (gpt-oss)
    expert_scale: torch.Tensor | None = None  # [E] float32: the chosen weights times their experts' (Gemma 4)


def routing_rule(cfg: ModelConfig) -> RoutingRule:
    """Every MoE layer's rule, as the config gives it."""
    return RoutingRule(cfg.top_k, cfg.norm_topk_prob, scoring=cfg.scoring, n_group=cfg.n_group,  # type: ignore[arg-type]
                       topk_group=cfg.topk_group, group_score=cfg.group_score,  # type: ignore[arg-type]
                       scaling=cfg.routed_scaling_factor, jitter_eps=cfg.jitter_eps,
                       scale_input=cfg.scale_expert_input)


class RoutedExperts:
    """The feed-forward "routed": a `MoEBlockWeights` whose experts the dispatcher runs."""

    name = "routed"
    routed = True

    def load(self, cfg: ModelConfig, i: int, load: Loaders) -> MoEBlockWeights:
        spec = load.spec
        shared = None
        if cfg.shared_expert_intermediate_size:
            shared_mlp, shared_gate = shared_expert_names(spec, i)
            shared = SharedExpert(load.mlp(shared_mlp), load.w(shared_gate) if shared_gate else None)
        # the correction bias in float32 whatever the compute dtype: it only chooses, and rounding it would change
        # the choice where two experts are close
        correction = load.f32(correction_name(spec, i)).reshape(-1) if cfg.router_correction else None  # [E]
        bias = load.w(router_bias_name(spec, i)) if cfg.router_bias else None
        return MoEBlockWeights(load.w(router_name(spec, i)), [], routing_rule(cfg), shared, correction, bias)

    def start(self, model: MoEModel, i: int, weights: MoEBlockWeights, x: torch.Tensor, h: torch.Tensor) -> Pending:
        return model.dispatcher.start(i, h)

    def finish(self, model: MoEModel, weights: MoEBlockWeights, started: Pending) -> torch.Tensor:
        return model.dispatcher.finish(started)

    def step_refusal(self, weights: MoEBlockWeights) -> str | None:
        if weights.shared is not None and not through_linear(weights.shared.mlp):
            return "its shared expert is not multiplied by the kernels"
        gate = weights.shared.gate if weights.shared is not None else None
        if gate is not None and (gate.device.type != "cpu" or gate.numel() != gate.shape[-1]):
            return "its shared expert's gate is not one row in RAM"
        if weights.rule.n_group > 1 or weights.rule.scoring not in SCORINGS:
            return f"it routes by {weights.rule.scoring} or by groups"
        if weights.rule.scale_input:
            return "its experts take their input scaled by the router (Llama 4)"
        if weights.expert_scale is not None:
            return "each expert's weight is scaled by its own factor (Gemma 4)"
        return None


class DenseFeedForward:
    """The feed-forward "dense": the layer's own SwiGLU (`mlp.gate_proj`, `up_proj`, `down_proj`), as one expert."""

    name = "dense"
    routed = False

    def load(self, cfg: ModelConfig, i: int, load: Loaders) -> ExpertWeights:
        return load.mlp(f"{layer_prefix(i)}.{load.spec.dense_mlp}")

    def start(self, model: MoEModel, i: int, weights: ExpertWeights, x: torch.Tensor, h: torch.Tensor
              ) -> torch.Tensor:
        return weights(h)

    def finish(self, model: MoEModel, weights: ExpertWeights, started: torch.Tensor) -> torch.Tensor:
        return started

    def step_refusal(self, weights: ExpertWeights) -> str | None:
        return None if through_linear(weights) else "its dense SwiGLU does not run through the kernels"


def route(router_logits: torch.Tensor, rule: RoutingRule,
          correction: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] (and the layer's correction bias [E]) -> (weights [T, K] float32, expert ids [T, K]
    int64), by `rule` (see RoutingRule)."""
    logits = router_logits.float()
    if rule.scoring == "sparsemixer":
        weights, ids = _sparsemixer(logits, rule.jitter_eps)
        return weights * rule.scaling, ids
    if rule.scoring == "softmax_topk":
        ids = best_first(logits, rule.top_k)  # [T, K]
        return torch.softmax(logits.gather(-1, ids), dim=-1) * rule.scaling, ids
    scores = torch.softmax(logits, dim=-1) if rule.scoring == "softmax" else torch.sigmoid(logits)  # [T, E]
    # sigmoid's order is the logits' own, but large logits all round to a score of 1.0 in float32: without a
    # correction they choose (Llama 4 takes the top logits), so that such experts do not tie (groups scored by their
    # best two add scores: theirs, not the logits, as DeepSeek-V3 sums them)
    plain = logits if rule.scoring == "sigmoid" and rule.n_group == 1 else scores
    choose = plain if correction is None else scores + correction.float()  # [T, E]
    if rule.n_group > 1:
        choose = _keep_best_groups(choose, rule)
    ids = best_first(choose, rule.top_k)  # [T, K]
    weights = scores.gather(-1, ids)  # [T, K]
    if rule.normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if rule.scoring == "sigmoid" else 0.0))
    return weights * rule.scaling, ids


def routed_input(x: torch.Tensor, weights: torch.Tensor, rule: RoutingRule) -> tuple[torch.Tensor, torch.Tensor]:
    """What the routed experts take and how their outputs are weighted: x [T, H] and the weights [T, K], or, under
    `scale_input` (one expert a token), x times each token's weight and weights of one."""
    if not rule.scale_input:
        return x, weights
    return (x * weights.to(x.dtype)), torch.ones_like(weights)  # [T, H] (K = 1), [T, 1]


def best_first(scores: torch.Tensor, k: int) -> torch.Tensor:
    """The ids of the k best scores [T, E] -> [T, K], best first; equal scores go to the lower id. (torch.topk picks
    among equals arbitrarily, and bf16 router logits tie often enough to matter: the decode step's kernel, csrc/
    step.c, chooses by this rule, so both paths pick the same experts.)"""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def _sparsemixer(logits: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PhiMoE's top-2 routing as transformers computes it in eval mode (`sparsemixer`, training=False): the best
    expert, then the best of the rest; each one's weight is its softmax among the experts whose logit lies within a
    relative 2*eps of its own (the others masked to -inf), so the two weights need not sum to one. The same ops in
    the same order as transformers, so ties and rounding fall the same way. logits [T, E] float32 -> (weights
    [T, 2], ids [T, 2])."""
    top1, id1 = logits.max(dim=-1, keepdim=True)  # [T, 1], [T, 1]
    w1 = _sparsemixer_weight(logits, logits, top1, id1, eps)  # [T, 1]
    rest = torch.scatter(logits, -1, id1, float("-inf"))  # [T, E]: the first expert out
    top2, id2 = rest.max(dim=-1, keepdim=True)  # [T, 1], [T, 1]
    w2 = _sparsemixer_weight(rest, logits, top2, id2, eps)  # [T, 1]
    return torch.cat((w1, w2), dim=-1), torch.cat((id1, id2), dim=-1)


def _sparsemixer_weight(candidates: torch.Tensor, logits: torch.Tensor, best: torch.Tensor, ids: torch.Tensor,
                        eps: float) -> torch.Tensor:
    """The chosen expert's weight: softmax over the candidates [T, E] within 2*eps of `best` [T, 1], relative to
    max(|logit|, best) (transformers measures against the unmasked logits, both times), at `ids` [T, 1]."""
    far = ((best - logits) / logits.abs().clamp(min=best)) > (2 * eps)  # [T, E]
    return torch.softmax(candidates.masked_fill(far, float("-inf")), dim=-1).gather(-1, ids)  # [T, 1]


def _keep_best_groups(choose: torch.Tensor, rule: RoutingRule) -> torch.Tensor:
    """choose [T, E] with every expert outside the `topk_group` best groups set to -inf, as DeepSeek-V3 and GLM do:
    a correction bias can make kept scores negative, and a masked 0 would then beat them (DeepSeek-V2 masks its
    softmax scores with 0, the same choice while top_k <= the experts kept). Letters: G groups, m = E / G."""
    T, E = choose.shape
    grouped = choose.view(T, rule.n_group, E // rule.n_group)  # [T, G, m]
    if rule.group_score == "max":
        group = grouped.max(dim=-1).values  # [T, G]
    else:
        group = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
    best = torch.topk(group, rule.topk_group, dim=-1).indices  # [T, topk_group]
    keep = torch.zeros_like(group).scatter_(1, best, 1.0)  # [T, G]
    return grouped.masked_fill(keep.unsqueeze(-1) == 0, float("-inf")).view(T, E)  # [T, E]


def reference_moe(
    hidden: torch.Tensor,
    router_logits: torch.Tensor,
    rule: RoutingRule,
    experts: Sequence[ExpertWeights],
    shared: SharedExpert | None = None,
    correction: torch.Tensor | None = None,
) -> torch.Tensor:
    """hidden [T, H], router logits [T, E] -> combined expert output [T, H]."""
    weights, ids = route(router_logits, rule, correction)  # [T, K], [T, K]
    routed, weights = routed_input(hidden, weights, rule)
    out = combine(routed, weights, ids, experts)
    return out if shared is None else out + shared(hidden)


def combine(
    hidden: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    experts: Sequence[ExpertWeights],
) -> torch.Tensor:
    """hidden [T, H], routing weights [T, K] and expert ids [T, K] -> sum of weighted expert outputs [T, H]."""
    weights = weights.to(hidden.dtype)
    out = torch.zeros_like(hidden)  # [T, H]
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)  # [n], [n]
        y = experts[e](hidden[tok])  # [n, H]
        out.index_add_(0, tok, y * weights[tok, slot].unsqueeze(-1))
    return out
