"""Granite MoE with a shared expert (`granitemoeshared`): Granite MoE (granitemoe.py), plus one SwiGLU every token
goes through beside the experts (`shared_mlp`, under the layer; its gate and up rows in one `input_linear`), of
width `shared_intermediate_size`, as transformers' `modeling_granitemoeshared.py` adds it."""

from __future__ import annotations

from typing import Any

from tandem.runtime.config import ModelConfig
from tandem.runtime.families import FamilySpec
from tandem.runtime.families.granitemoe import MUP, granite_fields


def parse(raw: dict[str, Any]) -> ModelConfig:
    shared = int(raw.get("shared_intermediate_size", 0))
    return ModelConfig(**granite_fields(raw), shared_expert_intermediate_size=shared)


SPEC = FamilySpec(
    "granitemoeshared", "Granite MoE (shared expert)", parse,
    tiny={"intermediate_size": 48, "num_local_experts": 8, "num_experts_per_tok": 2, "shared_intermediate_size": 64,
          **MUP},
    moe_prefix="block_sparse_moe", router="router.layer",
    stacked_experts=("input_linear.weight", "output_linear.weight"),
    shared_expert="shared_mlp", shared_expert_gate=None, shared_in_block=False,
    stacked_mlp=("input_linear", "output_linear"),
)
