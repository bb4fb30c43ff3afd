"""Model families, registered by `config.json`'s `model_type`.

A family is a `FamilySpec`: how to parse its config into a `ModelConfig`, and how its tensors are
named on disk. Everything else (the decoder, routing, generation) is shared.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tandem.kernels.errors import CheckpointError, UnsupportedModelError
from tandem.runtime.config import ModelConfig, check_config, clean_raw


@dataclass(frozen=True)
class FamilySpec:
    model_type: str
    display_name: str
    parse: Callable[[dict[str, Any]], ModelConfig]
    moe_prefix: str  # the MoE block inside a layer: "mlp" or "block_sparse_moe"
    expert_proj: tuple[str, str, str]  # on-disk names of an expert's (gate, up, down) projections


def _registry() -> dict[str, FamilySpec]:
    from tandem.runtime.families import mixtral, olmoe, qwen2_moe, qwen3_moe

    return {f.SPEC.model_type: f.SPEC for f in (mixtral, qwen2_moe, qwen3_moe, olmoe)}


def supported_model_types() -> list[str]:
    return sorted(_registry())


def family_for(model_type: object) -> FamilySpec:
    registry = _registry()
    if not isinstance(model_type, str) or model_type not in registry:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; Tandem runs: {', '.join(sorted(registry))}"
        )
    return registry[model_type]


def parse_config(raw: dict[str, Any], where: str) -> tuple[FamilySpec, ModelConfig]:
    """config.json's contents (read from `where`) -> its family and checked `ModelConfig`; CheckpointError names the
    field that is wrong, before anything is sized by it."""
    if not isinstance(raw, dict):
        raise CheckpointError(f"{where} does not hold a JSON object; re-download or fix the file")
    spec = family_for(raw.get("model_type"))
    try:
        config = spec.parse(clean_raw(raw, where))
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{where} is not a valid {spec.display_name} config ({e!r}); check the file") from None
    check_config(config, where)
    return spec, config
