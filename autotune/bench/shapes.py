"""The one table of published models' shapes the benchmarks copy: `make-bench-model` writes checkpoints of them and
`bench kernels` runs their experts.

Each family declares its models in its own file (`FamilySpec.shapes`, runtime/families); the table reads them
from the registry and derives each expert shape (hidden size, expert width, top-k) by parsing the config as a
checkpoint's would be. Models no family runs yet are listed here with their expert shape alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.runtime.families import families, parse_config


@dataclass(frozen=True)
class ExpertShape:
    hidden: int  # H, the model's hidden size
    width: int  # I, one routed expert's intermediate size
    top_k: int  # experts each token goes through
    clamped: tuple[float, float] | None = None  # gpt-oss's (alpha, limit): biases and the clamped SwiGLU
    act: str = "silu"  # the gate's activation (ModelConfig.activation: Gemma's tanh GELU)


@dataclass(frozen=True)
class RealShape:
    name: str  # the key on the command line
    model: str  # the published model
    expert: ExpertShape
    config: dict[str, Any] | None  # its config.json; None: no family runs it, only its experts are benchmarked
    refused: str = ""  # for a shape without config: why make-bench-model cannot write it
    aliases: tuple[str, ...] = ()  # other names the command line takes for it


# Kernel-only: models without a family yet. `bench kernels` runs their experts' shape; `make-bench-model` refuses
# them, saying why.
KERNEL_ONLY: tuple[RealShape, ...] = ()


def real_shapes() -> dict[str, RealShape]:
    """Every shape by its key: the families' (in the order of their model_type), then the kernel-only ones. A name
    or alias used twice is an error naming both."""
    shapes: list[RealShape] = []
    for spec in families():
        for shape in spec.shapes:
            config = {"model_type": spec.model_type, **shape.config}
            cfg = parse_config(config, f"the {shape.name} shape of {spec.display_name}")[1]
            expert = ExpertShape(cfg.hidden_size, cfg.moe_intermediate_size, cfg.top_k, cfg.clamped_swiglu,
                                 cfg.activation)
            shapes.append(RealShape(shape.name, shape.model, expert, config, aliases=shape.aliases))
    table: dict[str, RealShape] = {}
    owner: dict[str, str] = {}  # every name and alias -> the model it stands for
    for shape in [*shapes, *KERNEL_ONLY]:
        for name in (shape.name, *shape.aliases):
            if name in owner:
                raise ValueError(f"the benchmark shape name {name!r} is given to both {owner[name]} and {shape.model}")
            owner[name] = shape.model
        table[shape.name] = shape
    return table


def shape_names() -> tuple[str, ...]:
    """Every name the command line takes: the keys, then the aliases."""
    table = real_shapes()
    return (*table, *(alias for shape in table.values() for alias in shape.aliases))


def checkpoint_shapes() -> dict[str, dict[str, Any]]:
    """The shapes make-bench-model writes (those with a family), by key: each one's config.json."""
    return {name: shape.config for name, shape in real_shapes().items() if shape.config is not None}


def find_shape(name: str) -> RealShape:
    """The shape `name` (a key or an alias) stands for; KeyError if none."""
    found = next((s for s in real_shapes().values() if name == s.name or name in s.aliases), None)
    if found is None:
        raise KeyError(name)
    return found
