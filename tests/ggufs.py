"""Tiny GGUF files for tests, written with the gguf package's writer from a tiny Hugging Face checkpoint the way
llama.cpp's converter (convert_hf_to_gguf.py) writes them: its tensor names and metadata keys, experts stacked per
layer, the q/k rows of `llama` models in its RoPE order, the tokenizer as `gpt2` BPE metadata."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np

from tandem.runtime.checkpoint import open_checkpoint

ARCH = {"mixtral": "llama", "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "olmoe": "olmoe", "glm4_moe": "glm4moe",
        "deepseek_v2": "deepseek2", "deepseek_v3": "deepseek2", "gpt_oss": "gpt-oss", "dots1": "dots1",
        "minimax_m2": "minimax-m2", "glm4_moe_lite": "deepseek2", "ernie4_5_moe": "ernie4_5-moe",
        "hunyuan_v1_moe": "hunyuan-moe", "llama4_text": "llama4", "granitemoe": "granitemoe",
        "granitemoeshared": "granitemoe", "gemma4_text": "gemma4", "qwen3_next": "qwen3next",
        "qwen3_5_moe_text": "qwen35moe", "lfm2_moe": "lfm2moe", "granitemoehybrid": "granitehybrid"}
# the hybrids' zero-centred norms, stored plus one by the converter (Qwen3NextModel), by their GGUF names
PLUS_ONE = ("attn_norm.weight", "post_attention_norm.weight", "attn_q_norm.weight", "attn_k_norm.weight",
            "output_norm.weight")
ATTN = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output", "q_norm": "attn_q_norm",
        "k_norm": "attn_k_norm", "query_layernorm": "attn_q_norm", "key_layernorm": "attn_k_norm",
        "q_a_proj": "attn_q_a", "q_b_proj": "attn_q_b", "q_a_layernorm": "attn_q_a_norm",
        "kv_a_proj_with_mqa": "attn_kv_a_mqa", "kv_a_layernorm": "attn_kv_a_norm", "kv_b_proj": "attn_kv_b"}


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's reordering of q/k rows for its RoPE (convert_hf_to_gguf.py LlamaModel.permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(folder: Path, split_kv_b: bool = True) -> dict[str, np.ndarray]:
    """The checkpoint's tensors under llama.cpp's names, float32 numpy, experts stacked [E, rows, cols]; DeepSeek's
    kv_b_proj split into attn_k_b (each head's k rows, transposed) and attn_v_b as the converter does today
    (`split_kv_b`), or whole as older converters wrote it."""
    ckpt = open_checkpoint(folder)
    cfg, raw = ckpt.config, ckpt.raw_config
    arch = ARCH[raw["model_type"]]
    out: dict[str, np.ndarray] = {}
    stacks: dict[str, dict[int, np.ndarray]] = {}
    for name in ckpt.where:
        w = ckpt.tensor(name).float().numpy()
        if (own := hybrid_tensor(name, w, cfg, arch)) is not None:
            out |= own
        elif name == "model.embed_tokens.weight":
            out["token_embd.weight"] = w
        elif name == "model.norm.weight":
            out["output_norm.weight"] = w
        elif name == "lm_head.weight":
            out["output.weight"] = w
        elif (m := re.match(r"model\.layers\.(\d+)\.(.+)$", name)) is not None:
            blk, rest = f"blk.{m[1]}", m[2]
            if rest == "input_layernorm.weight":
                out[f"{blk}.attn_norm.weight"] = w
            elif arch == "gemma4" and rest in GEMMA4:  # as the converter's Gemma4Model names them
                out[f"{blk}.{GEMMA4[rest]}"] = w
            elif rest == "post_attention_layernorm.weight":
                out[f"{blk}.{'post_attention_norm' if arch == 'gpt-oss' else 'ffn_norm'}.weight"] = w
            elif rest == "self_attn.sinks":
                out[f"{blk}.attn_sinks.weight"] = w
            elif rest == "feed_forward.experts.gate_up_proj":  # Llama 4: [E, H, 2I], gate's columns then up's
                half = w.shape[2] // 2
                out[f"{blk}.ffn_gate_exps.weight"] = np.ascontiguousarray(w[:, :, :half].swapaxes(1, 2))
                out[f"{blk}.ffn_up_exps.weight"] = np.ascontiguousarray(w[:, :, half:].swapaxes(1, 2))
            elif rest == "feed_forward.experts.down_proj":  # [E, I, H]
                out[f"{blk}.ffn_down_exps.weight"] = np.ascontiguousarray(w.swapaxes(1, 2))
            elif rest in ("block_sparse_moe.input_linear.weight", "shared_mlp.input_linear.weight"):  # Granite's
                half = w.shape[-2] // 2  # gate's rows, then up's ([E, 2I, H], or [2I, H] for the shared one)
                kind = "exps" if rest.startswith("block") else "shexp"
                out[f"{blk}.ffn_gate_{kind}.weight"] = np.ascontiguousarray(w[..., :half, :])
                out[f"{blk}.ffn_up_{kind}.weight"] = np.ascontiguousarray(w[..., half:, :])
            elif rest in ("block_sparse_moe.output_linear.weight", "shared_mlp.output_linear.weight"):
                out[f"{blk}.ffn_down_{'exps' if rest.startswith('block') else 'shexp'}.weight"] = w
            elif rest in ("mlp.router.weight", "mlp.router.bias", "feed_forward.router.weight",
                          "block_sparse_moe.router.layer.weight"):
                out[f"{blk}.ffn_gate_inp.{rest.rsplit('.', 1)[1]}"] = w
            elif rest.startswith("mlp.experts.") and arch == "gpt-oss":  # fused, gate and up interleaved
                part = rest.removeprefix("mlp.experts.")
                if part == "gate_up_proj":  # [E, H, 2I]
                    out[f"{blk}.ffn_gate_exps.weight"] = np.ascontiguousarray(w[:, :, 0::2].swapaxes(1, 2))
                    out[f"{blk}.ffn_up_exps.weight"] = np.ascontiguousarray(w[:, :, 1::2].swapaxes(1, 2))
                elif part == "gate_up_proj_bias":
                    out[f"{blk}.ffn_gate_exps.bias"], out[f"{blk}.ffn_up_exps.bias"] = w[:, 0::2], w[:, 1::2]
                elif part == "down_proj":  # [E, I, H]
                    out[f"{blk}.ffn_down_exps.weight"] = np.ascontiguousarray(w.swapaxes(1, 2))
                elif part == "down_proj_bias":
                    out[f"{blk}.ffn_down_exps.bias"] = w
                else:
                    raise KeyError(f"MXFP4 experts ({name}): write the GGUF from a float checkpoint")
            elif rest == "self_attn.kv_b_proj.weight" and split_kv_b:
                kv_b = w.reshape(cfg.num_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, -1)  # [heads, nope + v, rank]
                out[f"{blk}.attn_k_b.weight"] = np.ascontiguousarray(kv_b[:, : cfg.qk_nope_head_dim].swapaxes(1, 2))
                out[f"{blk}.attn_v_b.weight"] = np.ascontiguousarray(kv_b[:, cfg.qk_nope_head_dim :])
            elif (a := re.match(r"self_attn\.(\w+)\.(weight|bias)$", rest)) is not None:
                if arch in ("llama", "granitemoe", "granitehybrid") and a[1] in ("q_proj", "k_proj"):
                    w = permute(w, cfg.num_heads if a[1] == "q_proj" else cfg.num_kv_heads)
                out[f"{blk}.{ATTN[a[1]]}.{a[2]}"] = w
            elif rest in ("block_sparse_moe.gate.weight", "mlp.gate.weight", "mlp.gate.wg.weight"):
                out[f"{blk}.ffn_gate_inp.weight"] = w
            elif rest in ("mlp.gate.e_score_correction_bias", "block_sparse_moe.e_score_correction_bias",
                          "mlp.moe_statics.e_score_correction_bias"):
                out[f"{blk}.exp_probs_b.bias"] = w
            elif (e := re.match(r"(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight$", rest)) is not None:
                kind = {"w1": "gate", "w3": "up", "w2": "down", "gate_proj": "gate", "up_proj": "up",
                        "down_proj": "down"}[e[2]]
                stacks.setdefault(f"{blk}.ffn_{kind}_exps.weight", {})[int(e[1])] = w
            elif (s := re.match(r"(?:mlp|feed_forward)\.shared_(?:experts?|mlp)\.(gate|up|down)_proj\.weight$",
                                rest)) is not None:
                out[f"{blk}.ffn_{s[1]}_shexp.weight"] = w
            elif rest == "mlp.shared_expert_gate.weight":
                out[f"{blk}.ffn_gate_inp_shexp.weight"] = w[0]  # [1, H] -> [H], as llama.cpp stores it
            elif (d := re.match(r"(?:mlp|feed_forward)\.(gate|up|down)_proj\.weight$", rest)) is not None:
                out[f"{blk}.ffn_{d[1]}.weight"] = w
            else:
                raise KeyError(f"no GGUF name for {name}")
        else:
            raise KeyError(f"no GGUF name for {name}")
    for key in [k for k in out if "#" in k]:  # (an expert's matrix, by its index: stacked below)
        name, index = key.split("#")
        stacks.setdefault(name, {})[int(index)] = out.pop(key)
    for name, experts in stacks.items():
        out[name] = np.stack([experts[i] for i in range(len(experts))])
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if arch == "gemma4":  # the global layers' proportional RoPE as frequency factors: 1 turns, 1e30 does not
        half, share = cfg.global_head_dim // 2, rope["full_attention"]["partial_rotary_factor"]
        turning = int(share * cfg.global_head_dim // 2)
        out["rope_freqs.weight"] = np.array([1.0] * turning + [1e30] * (half - turning), dtype=np.float32)
    if rope.get("rope_type") == "llama3":  # as the converter's LlamaModel writes Llama 3's scaling: each pair's factor
        out["rope_freqs.weight"] = llama3_factors(rope, cfg.head_dim)
    return out


def tiled(w: np.ndarray, axis: int, cfg, head: int) -> np.ndarray:  # type: ignore[no-untyped-def]
    """Value heads from grouped by key head to tiled (the converter's _LinearAttentionVReorderBase: Qwen3.5)."""
    hk, r = cfg.linear_key_heads, cfg.linear_value_heads // cfg.linear_key_heads
    w = np.moveaxis(w, axis, 0)
    w = w.reshape(hk, r, head, *w.shape[1:]).swapaxes(0, 1).reshape(w.shape)
    return np.ascontiguousarray(np.moveaxis(w, 0, axis))


def hybrid_tensor(name: str, w: np.ndarray, cfg, arch: str) -> dict[str, np.ndarray] | None:  # type: ignore[no-untyped-def]
    """The hybrids' tensors as llama.cpp's converter writes them (Qwen3NextModel and Qwen3.5's reordering,
    LFM2MoeModel, GraniteHybridModel's Mamba2Model); None for the names it writes as every family's."""
    if arch not in ("qwen3next", "qwen35moe", "lfm2moe", "granitehybrid"):
        return None
    m = re.match(r"model\.layers\.(\d+)\.(.+)$", name)
    blk, rest = (f"blk.{m[1]}", m[2]) if m else ("", name)
    if arch == "lfm2moe":
        own = {"conv.conv.weight": "shortconv.conv.weight", "conv.conv.bias": "shortconv.conv.bias",
               "conv.in_proj.weight": "shortconv.in_proj.weight", "conv.in_proj.bias": "shortconv.in_proj.bias",
               "conv.out_proj.weight": "shortconv.out_proj.weight", "conv.out_proj.bias": "shortconv.out_proj.bias",
               "self_attn.q_layernorm.weight": "attn_q_norm.weight", "self_attn.k_layernorm.weight":
               "attn_k_norm.weight", "feed_forward.expert_bias": "exp_probs_b.bias"}
        if name == "model.norm.weight":
            return {"token_embd_norm.weight": w}
        if rest in own:
            return {f"{blk}.{own[rest]}": w.reshape(w.shape[0], -1) if rest == "conv.conv.weight" else w}
        if rest == "feed_forward.gate.weight":
            return {f"{blk}.ffn_gate_inp.weight": w}
        if (e := re.match(r"feed_forward\.experts\.(\d+)\.(w\d)\.weight$", rest)) is not None:
            return {f"{blk}.ffn_{ {'w1': 'gate', 'w3': 'up', 'w2': 'down'}[e[2]]}_exps.weight#{e[1]}": w}
        if (d := re.match(r"feed_forward\.(gate|up|down)_proj\.weight$", rest)) is not None:
            return {f"{blk}.ffn_{d[1]}.weight": w}
        return None
    if arch == "granitehybrid":
        if not rest.startswith("mamba."):
            return None
        part = rest.removeprefix("mamba.")
        own = {"in_proj.weight": ("ssm_in.weight", w), "in_proj.bias": ("ssm_in.bias", w),
               "conv1d.weight": ("ssm_conv1d.weight", w.reshape(w.shape[0], -1)),
               "conv1d.bias": ("ssm_conv1d.bias", w), "dt_bias": ("ssm_dt.bias", w),
               "A_log": ("ssm_a", -np.exp(w).reshape(-1, 1)), "D": ("ssm_d", w.reshape(-1, 1)),
               "norm.weight": ("ssm_norm.weight", w.reshape(cfg.ssm_groups, -1)),
               "out_proj.weight": ("ssm_out.weight", w), "out_proj.bias": ("ssm_out.bias", w)}
        gguf_name, value = own[part]
        return {f"{blk}.{gguf_name}": value}
    # Qwen3-Next and Qwen3.5
    dk, dv, hk, hv = cfg.linear_key_dim, cfg.linear_value_dim, cfg.linear_key_heads, cfg.linear_value_heads
    key = hk * dk
    if name == "model.norm.weight":
        return {"output_norm.weight": w + 1}
    norms = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight":
             "post_attention_norm.weight", "self_attn.q_norm.weight": "attn_q_norm.weight",
             "self_attn.k_norm.weight": "attn_k_norm.weight"}
    if rest in norms:
        return {f"{blk}.{norms[rest]}": w + 1}
    if not rest.startswith("linear_attn."):
        return None
    part = rest.removeprefix("linear_attn.")
    qwen35 = arch == "qwen35moe" and hk != hv
    if part == "in_proj_qkvz.weight":  # per key head q, k, v, z -> q, k, v of every head, and z apart
        r = hv // hk
        grouped = w.reshape(hk, 2 * dk + 2 * r * dv, -1)
        q, k, v, z = np.split(grouped, [dk, 2 * dk, 2 * dk + r * dv], axis=1)
        qkv = np.concatenate([q.reshape(-1, w.shape[1]), k.reshape(-1, w.shape[1]), v.reshape(-1, w.shape[1])])
        return {f"{blk}.attn_qkv.weight": qkv, f"{blk}.attn_gate.weight": z.reshape(-1, w.shape[1])}
    if part == "in_proj_ba.weight":
        return {f"{blk}.ssm_ba.weight": w}
    if part == "in_proj_qkv.weight":
        v = tiled(w[2 * key :], 0, cfg, dv) if qwen35 else w[2 * key :]
        return {f"{blk}.attn_qkv.weight": np.concatenate([w[: 2 * key], v])}
    if part in ("in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight"):
        head = dv if part.startswith("in_proj_z") else 1
        target = {"in_proj_z.weight": "attn_gate.weight", "in_proj_b.weight": "ssm_beta.weight",
                  "in_proj_a.weight": "ssm_alpha.weight"}[part]
        return {f"{blk}.{target}": tiled(w, 0, cfg, head) if qwen35 else w}
    if part in ("A_log", "dt_bias"):
        value = -np.exp(w) if part == "A_log" else w
        value = tiled(value, 0, cfg, 1) if qwen35 else value
        return {f"{blk}.{'ssm_a' if part == 'A_log' else 'ssm_dt.bias'}": value}
    if part == "conv1d.weight":
        c = w.reshape(w.shape[0], -1)
        if qwen35:
            c = np.concatenate([c[: 2 * key], tiled(c[2 * key :], 0, cfg, dv)])
        return {f"{blk}.ssm_conv1d.weight": c}
    if part == "norm.weight":
        return {f"{blk}.ssm_norm.weight": w}
    if part == "out_proj.weight":
        return {f"{blk}.ssm_out.weight": tiled(w, 1, cfg, dv) if qwen35 else w}
    raise KeyError(f"no GGUF name for {name}")


GEMMA4 = {"post_attention_layernorm.weight": "post_attention_norm.weight",
          "pre_feedforward_layernorm.weight": "ffn_norm.weight", "post_feedforward_layernorm.weight":
          "post_ffw_norm.weight", "pre_feedforward_layernorm_2.weight": "pre_ffw_norm_2.weight",
          "post_feedforward_layernorm_1.weight": "post_ffw_norm_1.weight", "post_feedforward_layernorm_2.weight":
          "post_ffw_norm_2.weight", "layer_scalar": "layer_output_scale.weight", "router.proj.weight":
          "ffn_gate_inp.weight", "router.scale": "ffn_gate_inp.scale", "router.per_expert_scale":
          "ffn_down_exps.scale", "experts.gate_up_proj": "ffn_gate_up_exps.weight",
          "experts.down_proj": "ffn_down_exps.weight"}


def llama3_factors(rope: dict, dim: int) -> np.ndarray:
    """Llama 3's RoPE scaling as llama.cpp's converter stores it (`rope_freqs`): each rotated pair's divisor."""
    base, factor, low, high = rope["rope_theta"], rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    original = rope["original_max_position_embeddings"]
    factors = []
    for freq in 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            factors.append(1)
        elif wavelen > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def random_blocks(name: str, shape: tuple[int, ...], qtype: str, seed: int) -> np.ndarray:
    """Random blocks of a K format (the gguf package cannot quantize to them) with small positive f16 scales, so the
    weights are ordinary numbers: [..., rows, bytes]."""
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    values, nbytes = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed + sum(map(ord, name)))
    raw = rng.integers(0, 256, (*shape[:-1], shape[-1] // values, nbytes), dtype=np.uint8)
    scale_at = {"Q6_K": [208]}.get(qtype, [0, 2])  # d (and dmin) of each block
    for at in scale_at:
        raw[..., at : at + 2] = rng.uniform(0.0005, 0.002, raw.shape[:-1] + (1,)).astype(np.float16).view(np.uint8)
    return raw.reshape(*shape[:-1], -1)


def write_gguf(folder: Path, out: Path, qtype: str = "F32", split_max_tensors: int = 0,
               given: dict[str, np.ndarray] | None = None, mix: dict[str, str] | None = None,
               file_type: str | None = None, split_kv_b: bool = True, omit: tuple[str, ...] = ()
               ) -> dict[str, np.ndarray]:
    """`folder` (a tiny Hugging Face checkpoint with a BPE tokenizer.json) as a GGUF file: 2-D and 3-D weights in
    `qtype` (F32, F16, a block format the gguf package quantizes to, or a K format as random blocks), norms and
    biases in F32, as llama.cpp keeps them; `given` replaces tensors by name; `mix` gives the tensors whose GGUF
    name contains a key that key's type instead (Q4_K_M: {"ffn_down": "Q6_K", "attn_v": "Q6_K"}); `file_type`
    names the whole file's (general.file_type, as llama.cpp's LlamaFileType: "MOSTLY_Q4_K_M"); `omit`: metadata
    keys left out (as older converters did). Returns the float32
    values each tensor holds (dequantized by the gguf package's reference)."""
    import gguf

    default = qtype
    ckpt = open_checkpoint(folder)
    cfg, raw = ckpt.config, ckpt.raw_config
    arch = ARCH[raw["model_type"]]
    writer = gguf.GGUFWriter(str(out), arch, split_max_tensors=split_max_tensors)
    if file_type is not None:
        writer.add_file_type(gguf.LlamaFileType[file_type])
    writer.add_block_count(cfg.num_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_head_count(cfg.num_heads)
    if arch == "gemma4":  # per layer: the global layers' own (the converter writes the array)
        writer.add_head_count_kv([cfg.kv_heads(i) for i in range(cfg.num_layers)])
    elif arch in ("lfm2moe", "granitehybrid"):  # per layer: 0 where it does not attend (its kind)
        writer.add_head_count_kv([cfg.num_kv_heads if m == "attention" else 0 for m in cfg.mixers])
    elif arch != "deepseek2":
        writer.add_head_count_kv(cfg.num_kv_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_expert_count(cfg.num_experts)
    writer.add_expert_used_count(cfg.top_k)
    writer.add_expert_weights_norm(bool(cfg.norm_topk_prob))
    if cfg.clip_qkv:
        writer.add_clamp_kqv(cfg.clip_qkv)
    if raw.get("head_dim") and arch not in ("deepseek2", "gemma4"):
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    if arch == "llama":
        writer.add_feed_forward_length(cfg.moe_intermediate_size)
    elif arch == "llama4":  # as the converter's Llama4Model writes it: the dense layers' width, the experts', the step
        writer.add_feed_forward_length(cfg.dense_intermediate_size)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        writer.add_interleave_moe_layer_step(int(raw["interleave_moe_layer_step"]))
        writer.add_rope_dimension_count(cfg.head_dim)
    else:
        writer.add_feed_forward_length(raw.get("intermediate_size", cfg.moe_intermediate_size))
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if cfg.shared_expert_intermediate_size and arch not in ("glm4moe", "dots1"):
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if arch == "gpt-oss":  # as the converter's GptOssModel writes it
        writer.add_sliding_window(int(raw["sliding_window"]))
        rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
        if rope.get("rope_type", rope.get("type")) == "yarn":
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(rope["factor"])
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            if "beta_fast" in rope:
                writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
                writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    if arch == "deepseek2":  # as the converter's DeepseekV2Model writes it: MLA as one key/value head
        writer.add_head_count_kv(1)
        writer.add_kv_lora_rank(cfg.kv_lora_rank)
        if cfg.q_lora_rank:
            writer.add_q_lora_rank(cfg.q_lora_rank)
        writer.add_key_length(cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        writer.add_value_length(cfg.kv_lora_rank)
        writer.add_key_length_mla(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        writer.add_value_length_mla(cfg.v_head_dim)
        dense = raw.get("first_k_dense_replace", cfg.sparse_layers.index(True))  # (GLM-4.7-Flash's config: its own)
        writer.add_leading_dense_block_count(int(dense))
        writer.add_expert_shared_count(int(raw.get("n_shared_experts", 0)))
        writer.add_expert_weights_scale(float(raw.get("routed_scaling_factor", 1.0)))
        writer.add_rope_dimension_count(cfg.qk_rope_head_dim)
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if cfg.scoring == "sigmoid"
                                      else gguf.ExpertGatingFuncType.SOFTMAX)
        if cfg.n_group > 1:
            writer.add_expert_group_count(cfg.n_group)
            writer.add_expert_group_used_count(cfg.topk_group)
        rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}  # (transformers 5 saves the latter)
        if rope.get("type", rope.get("rope_type")) == "yarn":
            writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            writer.add_rope_scaling_factor(rope["factor"])
            writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
            writer.add_rope_scaling_yarn_beta_fast(rope.get("beta_fast", 32))
            writer.add_rope_scaling_yarn_beta_slow(rope.get("beta_slow", 1))
            writer.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])
    if arch == "glm4moe":  # as the converter's Glm4MoeModel writes it
        writer.add_expert_shared_count(int(raw.get("n_shared_experts", 1)))
        writer.add_leading_dense_block_count(int(raw.get("first_k_dense_replace", 1)))
        writer.add_expert_weights_scale(float(raw.get("routed_scaling_factor", 1.0)))
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        writer.add_rope_dimension_count(cfg.rotary_dim)
        writer.add_nextn_predict_layers(0)
        if cfg.n_group > 1:
            writer.add_expert_group_count(cfg.n_group)
            writer.add_expert_group_used_count(cfg.topk_group)
    if arch == "hunyuan-moe":  # as the converter's HunYuanMoEModel writes it
        writer.add_expert_shared_count(1)
    if arch == "ernie4_5-moe":  # as the converter's Ernie4_5MoeModel writes it
        writer.add_interleave_moe_layer_step(int(raw["moe_layer_interval"]))
        writer.add_leading_dense_block_count(int(raw["moe_layer_start_index"]))
        writer.add_expert_shared_count(int(raw["moe_num_shared_experts"]))
    if arch == "granitemoe":  # as the converter's GraniteMoeModel writes it: the muP multipliers as scales
        writer.add_attention_scale(cfg.attention_scale)
        writer.add_embedding_scale(cfg.embedding_multiplier)
        writer.add_residual_scale(cfg.residual_multiplier)
        writer.add_logit_scale(cfg.logits_scaling)
    if arch == "minimax-m2":  # as the converter's MiniMaxM2Model writes it
        writer.add_rope_dimension_count(cfg.rotary_dim)
    if arch == "gemma4":  # as the converter's Gemma4Model writes it: both kinds of layer's heads and RoPE
        rope = raw["rope_parameters"]
        writer.add_key_length(cfg.global_head_dim)
        writer.add_value_length(cfg.global_head_dim)
        writer.add_key_length_swa(cfg.head_dim)
        writer.add_value_length_swa(cfg.head_dim)
        writer.add_sliding_window(int(raw["sliding_window"]))
        writer.add_sliding_window_pattern(list(cfg.sliding_layers))
        writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        writer.add_rope_dimension_count(cfg.global_head_dim)
        writer.add_rope_dimension_count_swa(cfg.head_dim)
        writer.add_shared_kv_layers(0)
        writer.add_embedding_length_per_layer_input(0)
        if cfg.logit_softcap is not None:
            writer.add_final_logit_softcapping(cfg.logit_softcap)
    if arch == "dots1":  # as the converter's Dots1Model writes it (no groups: it writes none)
        writer.add_leading_dense_block_count(int(raw.get("first_k_dense_replace", 0)))
        writer.add_expert_shared_count(int(raw.get("n_shared_experts", 0)))
        writer.add_expert_weights_scale(float(raw.get("routed_scaling_factor", 1.0)))
    if arch in ("qwen3next", "qwen35moe"):  # as the converter's Qwen3NextModel writes them
        writer.add_ssm_conv_kernel(cfg.conv_kernel)
        writer.add_ssm_state_size(cfg.linear_key_dim)
        writer.add_ssm_group_count(cfg.linear_key_heads)
        writer.add_ssm_time_step_rank(cfg.linear_value_heads)
        writer.add_ssm_inner_size(cfg.linear_value_dim * cfg.linear_value_heads)
        if "recurrent_layers" not in omit:  # (older converters wrote only the interval)
            writer.add_array(f"{arch}.attention.recurrent_layers", [m == "deltanet" for m in cfg.mixers])
        writer.add_full_attention_interval(4)
        writer.add_rope_dimension_count(cfg.rotary_dim)
    if arch == "lfm2moe":  # as the converter's LFM2MoeModel writes it
        writer.add_leading_dense_block_count(cfg.sparse_layers.index(True))
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        writer.add_shortconv_l_cache(cfg.conv_kernel)
        writer.add_vocab_size(cfg.vocab_size)
    if arch == "granitehybrid":  # as the converter's GraniteHybridModel writes it
        writer.add_attention_scale(cfg.attention_scale)
        writer.add_embedding_scale(cfg.embedding_multiplier)
        writer.add_residual_scale(cfg.residual_multiplier)
        writer.add_logit_scale(cfg.logits_scaling)
        writer.add_ssm_conv_kernel(cfg.conv_kernel)
        writer.add_ssm_state_size(cfg.ssm_state)
        writer.add_ssm_group_count(cfg.ssm_groups)
        writer.add_ssm_inner_size(cfg.ssm_heads * cfg.ssm_head_dim)
        writer.add_ssm_time_step_rank(cfg.ssm_heads)
        writer.add_rope_scaling_finetuned(False)
    _tokenizer(writer, folder, raw, cfg.vocab_size)
    held: dict[str, np.ndarray] = {}
    for name, w in (gguf_tensors(folder, split_kv_b) | (given or {})).items():
        qtype = next((t for part, t in (mix or {}).items() if part in name), default)
        kind = gguf.GGMLQuantizationType[qtype]
        if w.ndim == 1 or qtype == "F32" or w.shape[-1] % gguf.GGML_QUANT_SIZES[kind][0] or name in (given or {}):
            writer.add_tensor(name, w.astype(np.float32))
            held[name] = w.astype(np.float32)
            continue
        if qtype == "F16":
            raw = w.astype(np.float16)
            writer.add_tensor(name, raw)
            held[name] = raw.astype(np.float32)
            continue
        raw = random_blocks(name, w.shape, qtype, 0) if qtype.endswith("_K") else gguf.quants.quantize(w, kind)
        writer.add_tensor(name, raw, raw_dtype=kind)
        with np.errstate(all="ignore"):  # random blocks of a type whose scales lie elsewhere (Q2_K) are refused anyway
            held[name] = gguf.quants.dequantize(raw, kind).astype(np.float32)
    write_out(writer)
    return held


def write_out(writer) -> None:  # type: ignore[no-untyped-def]
    """The writer's header, metadata and tensors to its file(s), closed."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _tokenizer(writer, folder: Path, raw: dict, vocab_size: int) -> None:  # type: ignore[no-untyped-def]
    """The folder's BPE tokenizer.json as llama.cpp's `gpt2` tokenizer metadata, with its chat template; a vocabulary
    smaller than the embedding is padded with unused [PAD<i>] tokens, as llama.cpp's converter pads it."""
    data = json.loads((folder / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    for added in data.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    pads = [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
    special = {a["content"] for a in data.get("added_tokens", []) if a.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens + pads)
    writer.add_token_types([3 if t in special else 1 for t in tokens] + [5] * len(pads))  # CONTROL, NORMAL, UNUSED
    writer.add_token_merges(merges)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    if raw.get("eos_token_id") is not None:
        writer.add_eos_token_id(int(raw["eos_token_id"]) if isinstance(raw["eos_token_id"], int)
                                else int(raw["eos_token_id"][0]))
    if raw.get("bos_token_id") is not None:
        writer.add_bos_token_id(int(raw["bos_token_id"]))
    if isinstance(config.get("chat_template"), str):
        writer.add_chat_template(config["chat_template"])


def fake_stores(home: Path, model: Path) -> dict[str, str]:
    """Other apps' stores under `home` (a user's home folder), each holding `model` (a GGUF file) as that app does:
    LM Studio as publisher/repo/file.gguf; Ollama as a manifest naming a content-addressed blob (`qwen3:30b-a3b`,
    and `someone/tiny:latest` in another namespace), beside a manifest whose blob is missing and one that is not
    JSON; the Hugging Face cache as a GGUF repository's snapshot. Returns each app's name for it."""
    import hashlib
    import shutil

    lms = home / ".lmstudio" / "models" / "lmstudio-community" / "Tiny-MoE-GGUF"
    lms.mkdir(parents=True)
    shutil.copy(model, lms / "Tiny-MoE-Q4_K_M.gguf")
    store = home / ".ollama" / "models"
    digest = hashlib.sha256(model.read_bytes()).hexdigest()
    (store / "blobs").mkdir(parents=True)
    shutil.copy(model, store / "blobs" / f"sha256-{digest}")
    layers = [{"mediaType": "application/vnd.ollama.image.template", "digest": "sha256:" + "0" * 64, "size": 10},
              {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}",
               "size": model.stat().st_size}]
    for namespace, name, tag in (("library", "qwen3", "30b-a3b"), ("someone", "tiny", "latest")):
        manifest = store / "manifests" / "registry.ollama.ai" / namespace / name / tag
        manifest.parent.mkdir(parents=True)
        manifest.write_text(json.dumps({"schemaVersion": 2, "layers": layers}))
    gone = store / "manifests" / "registry.ollama.ai" / "library" / "gone" / "latest"
    gone.parent.mkdir(parents=True)
    gone.write_text(json.dumps({"layers": [{"mediaType": "application/vnd.ollama.image.model",
                                            "digest": "sha256:" + "1" * 64}]}))
    broken = store / "manifests" / "registry.ollama.ai" / "library" / "broken" / "latest"
    broken.parent.mkdir(parents=True)
    broken.write_text("{not json")
    hub = home / ".cache" / "huggingface" / "hub" / "models--someone--Tiny-MoE-GGUF" / "snapshots" / "abc123"
    hub.mkdir(parents=True)
    shutil.copy(model, hub / "tiny-moe-q4_k_m.gguf")
    return {"LM Studio": "lmstudio-community/Tiny-MoE-GGUF/Tiny-MoE-Q4_K_M.gguf", "Ollama": "qwen3:30b-a3b",
            "Ollama other": "someone/tiny:latest", "HF cache": "someone/Tiny-MoE-GGUF/tiny-moe-q4_k_m.gguf"}


# ---- hostile files: a valid GGUF rewritten, or patched byte by byte ------------------------------------------------


def rewrite_gguf(src: Path, out: Path, meta: dict[str, tuple[object, object] | None] | None = None,
                 tensors: dict[str, np.ndarray | None] | None = None) -> Path:
    """`src` (a GGUF file of float tensors) written again with metadata keys set to (value, gguf.GGUFValueType) or
    removed (None), and tensors replaced or removed (None); everything else as it was."""
    import gguf

    meta, tensors = meta or {}, tensors or {}
    reader = gguf.GGUFReader(str(src))
    arch = str(reader.fields["general.architecture"].contents())
    writer = gguf.GGUFWriter(str(out), arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in meta or key == "general.architecture":
            continue
        sub = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(key, field.contents(), field.types[0], sub_type=sub)
    for key, given in meta.items():
        if given is not None:
            value, kind = given
            sub = None
            if isinstance(value, list):
                sub = gguf.GGUFValueType.ARRAY if value and isinstance(value[0], list) else \
                    gguf.GGUFValueType.get_type(value[0]) if value else gguf.GGUFValueType.UINT8
            writer.add_key_value(key, value, kind, sub_type=sub)  # type: ignore[arg-type]
    for t in reader.tensors:
        if t.name in tensors:
            continue
        writer.add_tensor(t.name, np.array(t.data))
    for name, w in tensors.items():
        if w is not None:
            writer.add_tensor(name, w)
    write_out(writer)
    return out


def gguf_layout(path: Path) -> dict[str, int]:
    """Where the header's fields lie in a GGUF file (byte offsets), for tests that corrupt them in place:
    "tensor_count", "kv_count"; per key "key:<k>" (its length), "type:<k>", "value:<k>" (a scalar's value; an array's
    item type) and "count:<k>" (an array's length); per tensor "name:<t>" (its name's length), "ndims:<t>",
    "dims:<t>" (the first dimension), "type:<t>", "offset:<t>"; "data" (where tensor data starts)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    base = reader.data.ctypes.data

    def at(part: np.ndarray) -> int:
        return int(part.ctypes.data - base)

    out = {"tensor_count": 8, "kv_count": 16}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        out[f"key:{key}"] = field.offset
        out[f"type:{key}"] = at(field.parts[2])
        out[f"value:{key}"] = at(field.parts[3])
        if field.types and field.types[0] == gguf.GGUFValueType.ARRAY:
            out[f"count:{key}"] = at(field.parts[4])
    for t in reader.tensors:
        name_len, _, n_dims, dims, kind, offset = t.field.parts
        out |= {f"name:{t.name}": at(name_len), f"ndims:{t.name}": at(n_dims), f"dims:{t.name}": at(dims),
                f"type:{t.name}": at(kind), f"offset:{t.name}": at(offset)}
    out["data"] = min(int(t.data_offset) for t in reader.tensors)
    return out


def patched(src: Path, out: Path, edits: list[tuple[int, bytes]], size: int | None = None) -> Path:
    """A copy of `src` with `edits` (offset, bytes) written over it, then cut to `size` bytes when given."""
    data = bytearray(src.read_bytes())
    for offset, raw in edits:
        data[offset : offset + len(raw)] = raw
    out.write_bytes(bytes(data[:size] if size is not None else data))
    return out


def tiny_moe_gguf(root: Path) -> Path:
    """A valid qwen3moe GGUF file of float32 tensors (8 experts a layer, about 1 MB) under `root`, from a tiny
    Hugging Face checkpoint built there."""
    from tests.conftest import build_hf_checkpoint

    hf = build_hf_checkpoint(root / "hf", "qwen3_moe", {})
    write_gguf(hf, root / "tiny.gguf", "F32")
    return root / "tiny.gguf"
