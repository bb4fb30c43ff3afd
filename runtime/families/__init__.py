"""Model families, registered by `config.json`'s `model_type`.

A family is one module of this package (any name not starting with an underscore) that defines `SPEC`, a
`FamilySpec`: how to parse its config into a `ModelConfig` (with the family's defaults), how its tensors are named
on disk, how llama.cpp's GGUF files of its architecture say its config (`GGUFArch`), its tiny test config and the
published models whose shapes the benchmarks copy. The registry finds the
modules by itself: adding a family is adding its file. Everything else (the decoder, routing, generation) is shared.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tandem.kernels.errors import CheckpointError, UnsupportedModelError
from tandem.runtime.config import ModelConfig, check_config, clean_raw
from tandem.runtime.gguf_meta import Meta


@dataclass(frozen=True)
class BenchShape:
    """A published model's dimensions, for random-weight benchmark checkpoints (`make-bench-model`) and the kernel
    benchmark (`bench kernels`, which runs its hidden size, expert width and top-k)."""

    name: str  # its key on the command line
    model: str  # the published model it copies
    config: dict[str, Any]  # its config.json without `model_type` (the family's), every dimension as published
    aliases: tuple[str, ...] = ()  # other names the command line takes for it


@dataclass(frozen=True)
class GGUFArch:
    """How a family reads llama.cpp's GGUF files: their `general.architecture`, and their metadata as the config.json
    a Hugging Face folder of the model would hold (runtime/gguf_meta.py reads the keys). The tensors need little:
    llama.cpp names most alike for every architecture, and `FamilySpec`'s on-disk names say where each goes;
    `tensors` names the rest."""

    name: str  # general.architecture
    # (metadata, vocabulary size, each tensor's GGML type by its GGUF name) -> config.json's contents
    config: Callable[[Meta, int, dict[str, str]], dict[str, Any]]
    rope_permuted: bool = False  # llama.cpp's converter stored q and k rows in its RoPE order (its `llama` models)
    # (config.json's contents, the file's rope_freqs.weight) -> the contents with them; None: they are the RoPE's
    # frequency factors (Llama 3's scaling, as the converter writes it)
    frequencies: Callable[[dict[str, Any], list[float]], dict[str, Any]] | None = None
    # the tensors of a layer this architecture's files name otherwise: the name inside `model.layers.N.` -> inside
    # `blk.N.` (Gemma's norms around each half of a layer, its layer scalar and router scales)
    tensors: dict[str, str] = field(default_factory=dict)
    # the tensors whose values or rows the converter changed (runtime/gguf_source.py Source: rows picked, values
    # undone), by the config: a name inside a layer (or a whole name) -> its source (its GGUF name inside `blk.N.`,
    # or whole)
    sources: Callable[[ModelConfig], dict[str, Any]] | None = None
    spec: dict[str, Any] = field(default_factory=dict)  # the family's names as its files of this architecture have
    # them, where they differ (FamilySpec's fields: Qwen3-Next's projections as Qwen3.5 names them)


@dataclass(frozen=True)
class FamilySpec:
    model_type: str
    display_name: str
    parse: Callable[[dict[str, Any]], ModelConfig]
    tiny: dict[str, Any]  # a tiny test config's own keys, beside the ones every family shares (runtime.synth)
    shapes: tuple[BenchShape, ...] = ()
    # on-disk names, under `model.layers.N.`
    moe_prefix: str = "mlp"  # the MoE block inside a layer
    dense_mlp: str = "mlp"  # a layer's own SwiGLU, in the layers without experts
    expert_proj: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # an expert's (gate, up, down)
    router: str = "gate"  # the router, inside the MoE block
    qk_norms: tuple[str, str] = ("q_norm", "k_norm")  # the q and k norms, inside `self_attn`
    correction: str | None = None  # the router's correction bias inside the MoE block (None: under the router,
    # `<router>.e_score_correction_bias`) ...
    correction_grouped: bool = False  # ... stored [1, E] (ERNIE's one group of moe_statics) rather than [E]
    shared_expert: str = "shared_expert"  # the shared expert's SwiGLU and ...
    shared_expert_gate: str | None = "shared_expert_gate"  # ... its sigmoid gate, inside the MoE block (None: none)
    # gpt-oss: a layer's experts stored together, as transformers' GptOssExperts holds them: `experts.gate_up_proj`
    # [E, H, 2I] (gate and up columns interleaved), `experts.down_proj` [E, I, H] and their biases `..._bias`
    # (weights.fused_expert_names); the loader takes per-expert views of them
    fused_experts: bool = False
    # a layer's experts as two tensors in the MoE block, under these names: Granite's gate and up rows stacked
    # [E, 2I, H] and down [E, H, I]; or, `stacked_by_input` (Llama 4), as x @ W: gate's columns then up's [E, H, 2I]
    # and down [E, I, H]. The loader takes per-expert views of them (Llama 4's of the rows it copies out once)
    stacked_experts: tuple[str, str] | None = None
    stacked_by_input: bool = False
    shared_in_block: bool = True  # the shared expert inside the MoE block; False: beside it, under the layer
    deltanet_grouped: bool = False  # Gated DeltaNet's projections as Qwen3-Next stores them (in_proj_qkvz,
    # in_proj_ba: rows grouped by key head), not as Qwen3.5 does (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a)
    stacked_mlp: tuple[str, str] | None = None  # the shared SwiGLU's gate and up rows in one tensor [2I, H], and down
    gguf: GGUFArch | None = None  # None: its GGUF files are not read (or another family's reader makes them its own)
    # the published folders that hold this text model inside a larger one (towers for images, audio): their
    # model_type, the key of their config.json holding this model's, and the prefix of its tensors there (in place
    # of `model.`); None: none that Tandem opens
    inside: tuple[str, str, str] | None = None
    # names its files give what every other family names otherwise: (the usual fragment, the family's), each
    # replaced where a name holds it (LFM2's `operator_norm.` for `input_layernorm.`): the files are read under the
    # usual names (`usual_name`) and written under the family's (`stored_name`)
    renames: tuple[tuple[str, str], ...] = ()

    @property
    def correction_name(self) -> str:
        """The router's correction bias, inside the MoE block (`correction`, else under the router)."""
        return self.correction or f"{self.router}.e_score_correction_bias"


def stored_name(spec: FamilySpec, name: str) -> str:
    """A tensor's name as the family's files store it (`FamilySpec.renames`)."""
    for usual, own in spec.renames:
        name = name.replace(usual, own)
    return name


def usual_name(spec: FamilySpec, name: str) -> str:
    """A stored tensor's name as the rest of Tandem knows it (`FamilySpec.renames`, undone)."""
    for usual, own in reversed(spec.renames):
        name = name.replace(own, usual)
    return name


def _registry() -> dict[str, FamilySpec]:
    """Every family module of this package, by model_type. A module that fails to import or defines no FamilySpec
    is an error naming it: a family that silently disappeared would be reported as an unsupported model."""
    found: dict[str, FamilySpec] = {}
    where: dict[str, str] = {}  # model_type -> the module defining it
    for module in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if module.name.startswith("_"):
            continue
        name = f"{__name__}.{module.name}"
        try:
            spec = importlib.import_module(name).SPEC
        except Exception as e:
            raise ImportError(f"model family module {name} is broken: {e!r}") from e
        if not isinstance(spec, FamilySpec):
            raise ImportError(f"model family module {name}: SPEC is a {type(spec).__name__}, not a FamilySpec")
        if spec.model_type in found:
            raise ImportError(f"model family modules {where[spec.model_type]} and {name} both define "
                              f"model_type {spec.model_type!r}")
        found[spec.model_type], where[spec.model_type] = spec, name
    return found


def families() -> list[FamilySpec]:
    """Every family, in the order of their model_type."""
    registry = _registry()
    return [registry[t] for t in sorted(registry)]


def supported_model_types() -> list[str]:
    return sorted(_registry())


# Published folders that hold a family's text model inside a larger one, with what a user can run instead
INSIDE: dict[str, str] = {
    "llama4": "this folder holds Llama 4 with its vision tower (model_type llama4); Tandem runs its text model "
              "(llama4_text): convert the folder with llama.cpp's convert_hf_to_gguf.py (it writes the text model) "
              "and open the .gguf file, or use a GGUF of it from a model hub",
}


def text_model(raw: dict[str, Any]) -> tuple[dict[str, Any], str] | None:
    """A whole model's config.json (`FamilySpec.inside`) -> its text model's config (its family's model_type where it
    leaves it out, the whole model's tied embeddings where it does not say) and the prefix its tensors have in the
    folder; None when `raw` is no such model's."""
    for spec in _registry().values():
        if spec.inside is None or raw.get("model_type") != spec.inside[0]:
            continue
        inner = raw.get(spec.inside[1])
        if not isinstance(inner, dict):
            raise CheckpointError(f"this {raw['model_type']} config.json has no {spec.inside[1]} object holding its "
                                  f"text model's config; re-download it")
        if "tie_word_embeddings" in raw:
            inner = {"tie_word_embeddings": raw["tie_word_embeddings"]} | inner
        return {"model_type": spec.model_type} | inner, spec.inside[2]
    return None


def family_for(model_type: object) -> FamilySpec:
    registry = _registry()
    if isinstance(model_type, str) and model_type in INSIDE:
        raise UnsupportedModelError(INSIDE[model_type])
    if not isinstance(model_type, str) or model_type not in registry:
        raise UnsupportedModelError(
            f"model_type {model_type!r} is not supported; Tandem runs: {', '.join(sorted(registry))}"
        )
    return registry[model_type]


def gguf_architectures() -> dict[str, FamilySpec]:
    """The family that reads each GGUF architecture, by `general.architecture`."""
    return {spec.gguf.name: spec for spec in families() if spec.gguf is not None}


def parse_config(raw: dict[str, Any], where: str) -> tuple[FamilySpec, ModelConfig]:
    """config.json's contents (read from `where`) -> its family and checked `ModelConfig`; CheckpointError names the
    field that is wrong, before anything is sized by it."""
    if not isinstance(raw, dict):
        raise CheckpointError(f"{where} does not hold a JSON object; re-download or fix the file")
    inside = text_model(raw)  # a whole model's config: its text model's
    raw = inside[0] if inside is not None else raw
    spec = family_for(raw.get("model_type"))
    try:
        config = spec.parse(clean_raw(raw, where))
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{where} is not a valid {spec.display_name} config ({e!r}); check the file") from None
    check_config(config, where)
    return spec, config
