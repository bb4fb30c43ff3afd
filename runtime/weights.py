"""On-disk tensor names and shapes of a family, derived from its `ModelConfig` and `FamilySpec`.

`dense_tensors` and `expert_tensors` list every tensor a checkpoint must hold; `checkpoint.py` validates
against them and the synthetic-checkpoint writer (`synth.py`) writes from them, so the two can never disagree.
"""

from __future__ import annotations

from tandem.runtime.config import ModelConfig
from tandem.runtime.families import FamilySpec
from tandem.runtime.layer_kind import Shape


def layer_prefix(i: int) -> str:
    return f"model.layers.{i}"


def block_prefix(spec: FamilySpec, layer: int) -> str:
    """Where a layer's MoE block's tensors lie: under `moe_prefix` inside the layer, or in the layer itself where
    the family has none (Gemma 4's router and experts)."""
    return f"{layer_prefix(layer)}.{spec.moe_prefix}" if spec.moe_prefix else layer_prefix(layer)


def expert_names(spec: FamilySpec, layer: int, expert: int) -> tuple[str, str, str]:
    """(gate, up, down) tensor names of one routed expert."""
    base = f"{block_prefix(spec, layer)}.experts.{expert}"
    return tuple(f"{base}.{p}.weight" for p in spec.expert_proj)  # type: ignore[return-value]


def router_name(spec: FamilySpec, layer: int) -> str:
    return f"{block_prefix(spec, layer)}.{spec.router}.weight"


def correction_name(spec: FamilySpec, layer: int) -> str:
    """The router's per-expert correction bias (config `router_correction`), beside the router's weight."""
    return f"{block_prefix(spec, layer)}.{spec.correction_name}"


def router_bias_name(spec: FamilySpec, layer: int) -> str:
    """The router's per-expert bias added to its logits (config `router_bias`, gpt-oss)."""
    return f"{block_prefix(spec, layer)}.{spec.router}.bias"


def fused_expert_names(spec: FamilySpec, layer: int) -> tuple[str, str, str, str]:
    """(gate_up, gate_up bias, down, down bias) tensor names of a layer whose experts are stored together
    (`FamilySpec.fused_experts`)."""
    base = f"{block_prefix(spec, layer)}.experts"
    return f"{base}.gate_up_proj", f"{base}.gate_up_proj_bias", f"{base}.down_proj", f"{base}.down_proj_bias"


def mxfp4_expert_names(spec: FamilySpec, layer: int) -> tuple[str, str, str, str, str, str]:
    """(gate_up blocks, gate_up scales, gate_up bias, down blocks, down scales, down bias) of a layer whose fused
    experts are stored as MXFP4 (`ModelConfig.experts_mxfp4`)."""
    gate_up, gate_up_bias, down, down_bias = fused_expert_names(spec, layer)
    return f"{gate_up}_blocks", f"{gate_up}_scales", gate_up_bias, f"{down}_blocks", f"{down}_scales", down_bias


def stacked_expert_names(spec: FamilySpec, layer: int) -> tuple[str, str]:
    """(gate and up stacked, down) of a layer whose experts are stored as two tensors (`FamilySpec.stacked_experts`)."""
    assert spec.stacked_experts is not None
    base = block_prefix(spec, layer)
    return f"{base}.{spec.stacked_experts[0]}", f"{base}.{spec.stacked_experts[1]}"


def layer_expert_names(cfg: ModelConfig, spec: FamilySpec, layer: int) -> list[str]:
    """Every tensor holding one MoE layer's routed experts, as stored: per expert (gate, up, down each), or fused,
    or stacked."""
    if spec.stacked_experts:
        return list(stacked_expert_names(spec, layer))
    if spec.fused_experts and cfg.experts_mxfp4:
        return list(mxfp4_expert_names(spec, layer))
    if spec.fused_experts:
        return list(fused_expert_names(spec, layer))
    return [name for e in range(cfg.num_experts) for name in expert_names(spec, layer, e)]


def shared_expert_names(spec: FamilySpec, layer: int) -> tuple[str, str | None]:
    """(the shared expert's SwiGLU prefix, its gate's tensor name or None when it has no gate) in one MoE layer."""
    base = block_prefix(spec, layer) if spec.shared_in_block else layer_prefix(layer)
    gate = f"{base}.{spec.shared_expert_gate}.weight" if spec.shared_expert_gate else None
    return f"{base}.{spec.shared_expert}", gate


def ffn_norm_name(cfg: ModelConfig) -> str:
    """The norm before a layer's feed-forward, inside the layer: post_attention_layernorm, or, where attention's
    output has a norm of its own of that name (`sandwich_norms`: Gemma), pre_feedforward_layernorm."""
    return "pre_feedforward_layernorm" if cfg.sandwich_norms else "post_attention_layernorm"


def mlp_tensors(prefix: str, hidden: int, inter: int) -> dict[str, Shape]:
    return {
        f"{prefix}.gate_proj.weight": (inter, hidden),
        f"{prefix}.up_proj.weight": (inter, hidden),
        f"{prefix}.down_proj.weight": (hidden, inter),
    }


def attention_tensors(cfg: ModelConfig, layer: int, spec: FamilySpec | None = None) -> dict[str, Shape]:
    """Layer `layer`'s token mixer's tensors (its kind's `tensors`), named as `spec`'s family names them (None:
    the usual names, for their shapes alone)."""
    from tandem.runtime.layers import MIXERS  # (the kinds import this module's names)

    kind = MIXERS[cfg.mixers[layer]]
    return kind.tensors(cfg, spec, layer, f"{layer_prefix(layer)}.{kind.module}")


def dense_tensors(cfg: ModelConfig, spec: FamilySpec) -> dict[str, Shape]:
    """Every tensor that is not a routed expert: these are loaded into RAM (or onto the accelerator)."""
    h = cfg.hidden_size
    out: dict[str, Shape] = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, h)
    if cfg.norm_type == "layer":
        out["model.norm.bias"] = (h,)
    if cfg.lm_head_bias:
        out["lm_head.bias"] = (cfg.vocab_size,)
    for i in range(cfg.num_layers):
        p = layer_prefix(i)
        out |= {f"{p}.input_layernorm.weight": (h,), f"{p}.{ffn_norm_name(cfg)}.weight": (h,)}
        if cfg.norm_type == "layer":  # LayerNorm: a bias beside each weight
            out |= {f"{p}.input_layernorm.bias": (h,), f"{p}.post_attention_layernorm.bias": (h,)}
        if cfg.layer_scalars:
            out[f"{p}.layer_scalar"] = (1,)
        out |= attention_tensors(cfg, i, spec)
        if not cfg.sparse_layers[i]:
            out |= mlp_tensors(f"{p}.{spec.dense_mlp}", h, cfg.dense_intermediate_size)
            continue
        out[router_name(spec, i)] = (cfg.num_experts, h)
        if cfg.parallel_dense:  # its dense MLP, norms and router scales (runtime/parallel.py)
            from tandem.runtime.parallel import parallel_tensors

            out |= parallel_tensors(cfg, spec, i)
        if cfg.router_correction:
            out[correction_name(spec, i)] = (1, cfg.num_experts) if spec.correction_grouped else (cfg.num_experts,)
        if cfg.router_bias:
            out[router_bias_name(spec, i)] = (cfg.num_experts,)
        if cfg.shared_expert_intermediate_size:
            mlp, gate = shared_expert_names(spec, i)
            width = cfg.shared_expert_intermediate_size
            stacked = spec.stacked_mlp
            out |= mlp_tensors(mlp, h, width) if stacked is None else {
                f"{mlp}.{stacked[0]}.weight": (2 * width, h), f"{mlp}.{stacked[1]}.weight": (h, width)}
            if gate is not None:
                out[gate] = (1, h)
    return out


def dense_matrices(cfg: ModelConfig, spec: FamilySpec) -> set[str]:
    """The dense tensors the decoder multiplies by through `DenseLinear` (or looks rows up in): the embedding,
    lm_head, attention projections and routers."""
    names = {"model.embed_tokens.weight", "lm_head.weight"}
    for i in range(cfg.num_layers):
        # not MLA's kv_b_proj: runtime/mla.py multiplies by slices of it per head, in the compute dtype
        names |= {n for n in attention_tensors(cfg, i, spec) if n.endswith("_proj.weight") and "kv_b_proj" not in n}
        if cfg.sparse_layers[i]:
            names.add(router_name(spec, i))
    return names


def expert_tensors(cfg: ModelConfig, spec: FamilySpec) -> dict[str, Shape]:
    """Every routed expert's weights: kept in the file's dtype (memory-mapped, or read into RAM when they fit)."""
    h, inter = cfg.hidden_size, cfg.moe_intermediate_size
    out: dict[str, Shape] = {}
    for i in range(cfg.num_layers):
        if not cfg.sparse_layers[i]:
            continue
        n = cfg.num_experts
        if spec.fused_experts and cfg.experts_mxfp4:  # rows are output features, in blocks of 32 values (16 bytes)
            gu_blocks, gu_scales, gu_bias, d_blocks, d_scales, d_bias = mxfp4_expert_names(spec, i)
            out |= {gu_blocks: (n, 2 * inter, h // 32, 16), gu_scales: (n, 2 * inter, h // 32), gu_bias: (n, 2 * inter),
                    d_blocks: (n, h, inter // 32, 16), d_scales: (n, h, inter // 32), d_bias: (n, h)}
            continue
        if spec.stacked_experts:  # Granite: gate and up rows of each expert stacked, then down; Llama 4: as x @ W
            gate_up, down = stacked_expert_names(spec, i)
            out |= {gate_up: (n, h, 2 * inter), down: (n, inter, h)} if spec.stacked_by_input else \
                {gate_up: (n, 2 * inter, h), down: (n, h, inter)}
            continue
        if spec.fused_experts:  # transformers' GptOssExperts: x @ gate_up_proj[e], h @ down_proj[e]
            gate_up, gate_up_bias, down, down_bias = fused_expert_names(spec, i)
            out |= {gate_up: (n, h, 2 * inter), gate_up_bias: (n, 2 * inter), down: (n, inter, h), down_bias: (n, h)}
            continue
        for e in range(cfg.num_experts):
            gate, up, down = expert_names(spec, i, e)
            out |= {gate: (inter, h), up: (inter, h), down: (h, inter)}
    return out
