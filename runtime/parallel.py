"""The feed-forward "parallel" (Gemma 4's MoE layers): a dense MLP and routed experts side by side, each with norms
of its own, as transformers' `Gemma4TextDecoderLayer` computes them:

    dense   = post_feedforward_layernorm_1(mlp(pre_feedforward_layernorm(x)))
    experts = post_feedforward_layernorm_2(experts(pre_feedforward_layernorm_2(x)))  routed by router(x)
    out     = post_feedforward_layernorm(dense + experts)

where x is the residual stream. The router reads x RMSNormed without a weight, times its `scale` and 1/sqrt(H); it
takes the softmax's top-k, normalised, each then times its expert's `per_expert_scale`. The experts run through the
dispatcher (every fast path of routed experts: the CPU kernels, the accelerator's slots), the dense MLP as the model's
other MLPs do (`moe.LinearMLP`).

Letters: n tokens, H hidden size, E routed experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from tandem.runtime.config import ModelConfig
from tandem.runtime.layer_kind import Loaders, Shape
from tandem.runtime.moe import ExpertWeights, MoEBlockWeights, routing_rule
from tandem.runtime.weights import layer_prefix, mlp_tensors, router_name

if TYPE_CHECKING:
    from tandem.runtime.families import FamilySpec
    from tandem.runtime.model import MoEModel

NORMS = ("pre_feedforward_layernorm_2", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
         "post_feedforward_layernorm")  # inside the layer: the experts' input norm, then the three output norms


@dataclass(frozen=True, kw_only=True)
class ParallelBlockWeights(MoEBlockWeights):
    """A MoE block (the dispatcher runs its experts as any other's) with a dense MLP beside it and their norms."""

    mlp: ExpertWeights
    router_scale: torch.Tensor  # [H] float32: the router's `scale` times 1/sqrt(H)
    experts_in_norm: torch.Tensor  # [H] pre_feedforward_layernorm_2
    mlp_out_norm: torch.Tensor  # [H] post_feedforward_layernorm_1
    experts_out_norm: torch.Tensor  # [H] post_feedforward_layernorm_2
    out_norm: torch.Tensor  # [H] post_feedforward_layernorm


def router_module(spec: FamilySpec, i: int) -> str:
    """Layer i's router module, which holds its scales beside its matrix (`router`, whose `proj` is the matrix)."""
    return router_name(spec, i).removesuffix(".weight").rsplit(".", 1)[0]


def parallel_tensors(cfg: ModelConfig, spec: FamilySpec, i: int) -> dict[str, Shape]:
    """Layer i's tensors beyond a MoE block's router and experts: the dense MLP, the router's scales, the norms."""
    h, p, scales = cfg.hidden_size, layer_prefix(i), router_module(spec, i)
    out = mlp_tensors(f"{p}.{spec.dense_mlp}", h, cfg.dense_intermediate_size)
    out |= {f"{p}.{name}.weight": (h,) for name in NORMS}
    return out | {f"{scales}.scale": (h,), f"{scales}.per_expert_scale": (cfg.num_experts,)}


class DenseBesideExperts:
    """The feed-forward "parallel" (runtime/layer_kind.py `FeedForward`): a `ParallelBlockWeights`."""

    name = "parallel"
    routed = True

    def load(self, cfg: ModelConfig, i: int, load: Loaders) -> ParallelBlockWeights:
        spec, p = load.spec, layer_prefix(i)
        scales = router_module(spec, i)
        norms = [load.w(f"{p}.{name}.weight") for name in NORMS]
        return ParallelBlockWeights(
            load.w(router_name(spec, i)), [], routing_rule(cfg),
            expert_scale=load.f32(f"{scales}.per_expert_scale"),
            mlp=load.mlp(f"{p}.{spec.dense_mlp}"),
            router_scale=load.f32(f"{scales}.scale") * cfg.hidden_size ** -0.5,
            experts_in_norm=norms[0], mlp_out_norm=norms[1], experts_out_norm=norms[2], out_norm=norms[3])

    def start(self, model: MoEModel, i: int, w: ParallelBlockWeights, x: torch.Tensor, h: torch.Tensor) -> Any:
        """x [n, H] the residual stream, h [n, H] its pre_feedforward_layernorm: the experts queued, the dense MLP
        run meanwhile."""
        eps = model.cfg.rms_norm_eps
        router_x = (F.rms_norm(x.float(), (x.shape[-1],), None, eps) * w.router_scale).to(h.dtype)  # [n, H]
        pending = model.dispatcher.start(i, model.rms_norm(x, w.experts_in_norm, eps), router_x)
        return pending, w.mlp(h)

    def finish(self, model: MoEModel, w: ParallelBlockWeights, started: Any) -> torch.Tensor:
        pending, dense = started
        experts = model.dispatcher.finish(pending)  # [n, H] float32
        eps, norm = model.cfg.rms_norm_eps, model.rms_norm
        both = norm(dense, w.mlp_out_norm, eps).float() + norm(experts, w.experts_out_norm, eps).float()
        return norm(both, w.out_norm, eps).float()  # [n, H]

    def step_refusal(self, weights: ParallelBlockWeights) -> str | None:
        return "its dense MLP runs beside its experts, each with norms of its own (Gemma 4)"



