"""A decoder built from a checkpoint: every non-expert weight placed (on the accelerator, or in RAM in the dtype it
is kept in: `kept_dtypes`), q, k and v stacked into one matrix, GGUF blocks kept as the file stores them where the
kernels read them, and the routed experts (`routed_experts`) read last, as the longest step.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch

from tandem.kernels.blocks import block_matrix
from tandem.kernels.dense import DenseLinear
from tandem.kernels.errors import CheckpointError
from tandem.kernels.experts import CpuOptions
from tandem.kernels.library import library
from tandem.kernels.names import BLOCK_QUANTS
from tandem.kernels.quant import QuantizedMatrix
from tandem.runtime.accelerator import Accelerator
from tandem.runtime.attention import Matrix
from tandem.runtime.checkpoint import Checkpoint, one_buffer
from tandem.runtime.dispatch import OffloadOptions
from tandem.runtime.layer_kind import Loaders
from tandem.runtime.layers import plan
from tandem.runtime.model import DecoderLayer, DecoderWeights, ModelRun, MoEModel
from tandem.runtime.moe import BlockExpert, ClampedSwiGLUExpert, ExpertWeights, LinearMLP, MXFP4Expert
from tandem.runtime.weights import (
    dense_matrices,
    expert_names,
    ffn_norm_name,
    fused_expert_names,
    layer_prefix,
    mxfp4_expert_names,
    stacked_expert_names,
)


def kept_dtypes(ckpt: Checkpoint, compute: torch.dtype, cpu: CpuOptions | None) -> Callable[[str], torch.dtype]:
    """The dtype each non-expert weight is kept in on the CPU: the compute dtype, but a dense matrix
    (weights.dense_matrices) of a bf16 or fp16 file stays so under float32 compute when the kernels multiply by it
    (they read its rows against float32 activations exactly as a float32 copy would compute, streaming half its
    bytes, and streaming bytes is what decode waits on)."""
    matrices = dense_matrices(ckpt.config, ckpt.spec)
    keep = compute == torch.float32 and library() is not None and (cpu is None or cpu.use_kernel)

    def kept(name: str) -> torch.dtype:
        stored = ckpt.dtype(name) if keep and name in matrices else compute
        return stored if stored in (torch.bfloat16, torch.float16) else compute
    return kept


def float_experts(ckpt: Checkpoint, layer: int, resident: bool = False) -> list[ExpertWeights]:
    """One MoE layer's SwiGLU experts stored as float matrices, in the file's dtype: views of per-expert tensors (of
    the map, or of RAM copies when `resident`), or of the two tensors a layer stacks them in (Granite's rows; Llama
    4's, stored as x @ W, copied into rows once)."""
    n, act = ckpt.config.num_experts, ckpt.config.activation
    if ckpt.spec.stacked_by_input:  # Llama 4: [E, H, 2I] and [E, I, H]; the kernels read rows, so the layer is
        # copied once, transposed, from the file (not read into RAM first: that would hold it twice)
        gate_up, down = (ckpt.tensor(name) for name in stacked_expert_names(ckpt.spec, layer))
        rows = gate_up.transpose(1, 2).contiguous()  # [E, 2I, H]
        down_rows = down.transpose(1, 2).contiguous()  # [E, H, I]
        width = rows.shape[1] // 2
        return [ExpertWeights(rows[e, :width], rows[e, width:], down_rows[e], act) for e in range(n)]
    if ckpt.spec.stacked_experts:  # Granite: each expert's gate, up and down rows views of the two tensors
        names = list(stacked_expert_names(ckpt.spec, layer))
        gate_up, down = ckpt.read_into_ram(names) if resident else [ckpt.tensor(name) for name in names]
        width = gate_up.shape[1] // 2  # rows [E, 2I, H] and [E, H, I]
        return [ExpertWeights(gate_up[e, :width], gate_up[e, width:], down[e], act) for e in range(n)]
    names = [name for e in range(n) for name in expert_names(ckpt.spec, layer, e)]
    tensors = ckpt.read_into_ram(names) if resident else [ckpt.tensor(name) for name in names]
    return [ExpertWeights(*tensors[3 * e : 3 * e + 3], act) for e in range(n)]


def routed_experts(ckpt: Checkpoint, layers: list[int], resident: bool,
                   progress: Callable[[str, float], None] | None = None,
                   quant: str | None = None) -> dict[int, list[ExpertWeights]]:
    """Each MoE layer's routed experts in their on-disk dtype: views of the memory-mapped files, or (resident)
    copies read into RAM, two layers at a time (file reads release the GIL). Experts stream faster from such
    copies than from the file map, and plain reads fill RAM faster than faulting the map in would. MXFP4 experts
    are always copied into RAM, 4-bit, in the order the kernels read (`MXFP4Expert.from_stored`). GGUF blocks stay
    as the file stores them (`BlockExpert`): views of it, or one RAM copy of a layer's bytes."""
    n = ckpt.config.num_experts
    blocks = ckpt.expert_blocks
    if quant in BLOCK_QUANTS:  # quantized to GGUF blocks once, then read from the cache file
        from tandem.runtime.quant_cache import block_experts

        return dict(block_experts(ckpt, layers, quant, progress))  # type: ignore[arg-type]

    def one(layer: int) -> list[ExpertWeights]:
        if blocks:
            mats = [ckpt.blocks(name) for e in range(n) for name in expert_names(ckpt.spec, layer, e)]
            if any(m is None for m in mats):
                raise CheckpointError(f"{ckpt.path}: layer {layer} keeps some experts in a float type and others in "
                                      "blocks; convert the model again")
            data = [m.data for m in mats]  # type: ignore[union-attr]
            if resident:  # one buffer for the layer, each expert's rows a view of it starting on a cache line
                buffer, offsets = one_buffer([d.numel() for d in data])
                data = [buffer[at : at + d.numel()].view(d.shape).copy_(d) for d, at in zip(data, offsets, strict=True)]
            formats = (mats[0].kind, mats[2].kind)  # type: ignore[union-attr]
            return [BlockExpert(*data[3 * e : 3 * e + 3], ckpt.config.activation, formats=formats)
                    for e in range(n)]
        if ckpt.spec.fused_experts and ckpt.config.experts_mxfp4:  # gpt-oss as published: 4-bit copies per expert
            stored = [ckpt.tensor(name) for name in mxfp4_expert_names(ckpt.spec, layer)]
            alpha, limit = ckpt.config.clamped_swiglu or (1.702, 7.0)
            return MXFP4Expert.layer(*stored, alpha, limit)
        if ckpt.spec.fused_experts:  # gpt-oss: each expert a view of its slice of the layer's fused tensors
            fused = fused_expert_names(ckpt.spec, layer)
            gate_up, gate_up_bias, down, down_bias = \
                ckpt.read_into_ram(list(fused)) if resident else [ckpt.tensor(name) for name in fused]
            alpha, limit = ckpt.config.clamped_swiglu or (1.702, 7.0)  # (the family always sets it)
            return [ClampedSwiGLUExpert.from_fused(gate_up[e], gate_up_bias[e], down[e], down_bias[e], alpha, limit)
                    for e in range(n)]
        return float_experts(ckpt, layer, resident)

    if not resident and not ckpt.config.experts_mxfp4 and not blocks and not ckpt.spec.stacked_by_input:
        return {layer: one(layer) for layer in layers}
    out: dict[int, list[ExpertWeights]] = {}
    with ThreadPoolExecutor(2) as pool:
        for k, (layer, experts) in enumerate(zip(layers, pool.map(one, layers), strict=True)):
            out[layer] = experts
            if progress is not None:
                progress("reading the experts into RAM", (k + 1) / len(layers))
    return out


def build_model(ckpt: Checkpoint, run: ModelRun, accel: Accelerator | None = None,
                policy: OffloadOptions | None = None, cpu: CpuOptions | None = None,
                progress: Callable[[str, float], None] | None = None) -> MoEModel:
    """The decoder of `ckpt` for `run`: its weights placed on `accel` or kept in RAM as `cpu` says, its experts
    dispatched by `policy` (`progress` hears about reading them)."""
    dtype = run.dtype
    cfg, spec = ckpt.config, ckpt.spec
    kept = kept_dtypes(ckpt, dtype, cpu) if accel is None else lambda name: dtype

    def w(name: str) -> torch.Tensor:
        """A non-expert weight: on the accelerator, or in RAM (no copy if its dtype is kept)."""
        if accel is not None:
            return accel.place(ckpt.tensor(name), dtype, name)
        return ckpt.tensor(name).to(kept(name), copy=bool(cpu and cpu.resident))

    blocks_run = accel is None and library() is not None and (cpu is None or cpu.use_kernel)

    def wq(name: str) -> Matrix:
        """A dense matrix: GGUF blocks as the file stores them where the kernels read them (a RAM copy if
        resident), else as `w`."""
        m = ckpt.blocks(name) if blocks_run else None
        if m is None:
            return w(name)
        return replace(m, data=m.data.clone()) if cpu and cpu.resident else m

    def opt(name: str) -> torch.Tensor | None:
        return w(name) if name in ckpt.where else None

    def projections(names: list[str], rows: list[int]) -> Matrix:
        """q, k and v as one matrix: GGUF blocks of one format stacked (a copy), of several formats side by
        side (DenseLinear runs each), else `stacked`."""
        parts = [ckpt.blocks(n) if blocks_run else None for n in names]
        if any(p is None for p in parts):
            return stacked(names, rows)
        if len({p.kind for p in parts}) > 1:  # type: ignore[union-attr]
            return [wq(n) for n in names]  # type: ignore[misc]
        data = torch.cat([p.data for p in parts])  # type: ignore[union-attr]
        return block_matrix(data, parts[0].kind)  # type: ignore[union-attr]

    def stacked(names: list[str], rows: list[int]) -> torch.Tensor:
        """Several tensors along dim 0 as one (a missing bias counts as zeros), then placed like `w`."""
        kinds = {kept(n) for n in names if n in ckpt.where}
        into = kinds.pop() if len(kinds) == 1 else dtype
        parts = [ckpt.tensor(n).to(into) if n in ckpt.where else torch.zeros(r, dtype=into)
                 for n, r in zip(names, rows, strict=True)]
        fused = torch.cat(parts)
        return accel.place(fused, dtype, names[0]) if accel is not None else fused

    def f32(name: str) -> torch.Tensor:
        t = ckpt.tensor(name).float()
        return accel.place(t, torch.float32, name) if accel is not None else t

    linear = DenseLinear(cpu.threads if cpu else None, (cpu is None or cpu.use_kernel) and accel is None,
                         cpu.isa if cpu else None)  # (kernels on the CPU only: see __init__)

    def mlp(prefix: str) -> ExpertWeights:
        if spec.stacked_mlp and f"{prefix}.{spec.stacked_mlp[0]}.weight" in ckpt.where:  # gate and up in one
            gate_up, down = (w(f"{prefix}.{name}.weight") for name in spec.stacked_mlp)
            return LinearMLP(gate_up[: gate_up.shape[0] // 2], gate_up[gate_up.shape[0] // 2 :], down, cfg.activation,
                             linear=linear)
        names = [f"{prefix}.{p}_proj.weight" for p in ("gate", "up", "down")]
        mats = [wq(n) for n in names]
        if all(isinstance(q, QuantizedMatrix) for q in mats) and mats[0].kind == mats[1].kind:  # type: ignore[union-attr]
            return BlockExpert(*(q.data for q in mats), cfg.activation,  # type: ignore[union-attr]
                               formats=(mats[0].kind, mats[2].kind), linear=linear)  # type: ignore[union-attr]
        return LinearMLP(*(q.dequantize(dtype) if isinstance(q, QuantizedMatrix) else q for q in mats),
                         cfg.activation, linear=linear)

    def norm(name: str) -> torch.Tensor | None:
        """An RMSNorm's weight as it multiplies: the stored one plus the config's offset (added in float32)."""
        if name not in ckpt.where:
            return None
        if not cfg.norm_offset:
            return w(name)
        t = ckpt.tensor(name).float() + cfg.norm_offset
        return accel.place(t, dtype, name) if accel is not None else t.to(kept(name))

    load = Loaders(spec, w, wq, opt, projections, stacked, f32, mlp, norm)
    layers = []
    for i, kinds in enumerate(plan(cfg)):  # each layer as its kinds load it (a routed layer's experts: below)
        p = layer_prefix(i)
        layers.append(DecoderLayer(norm(f"{p}.input_layernorm.weight"),  # type: ignore[arg-type]
                                   norm(f"{p}.{ffn_norm_name(cfg)}.weight"),  # type: ignore[arg-type]
                                   kinds.mixer.load(cfg, i, f"{p}.{kinds.mixer.module}", load),
                                   kinds.ffn.load(cfg, i, load),
                                   w(f"{p}.input_layernorm.bias") if cfg.norm_type == "layer" else None,
                                   w(f"{p}.post_attention_layernorm.bias") if cfg.norm_type == "layer" else None,
                                   f32(f"{p}.layer_scalar") if cfg.layer_scalars else None))
    embed = wq("model.embed_tokens.weight")
    lm_head = embed if cfg.tie_word_embeddings else wq("lm_head.weight")
    # Last, as the longest step when they are read into RAM: whatever does not fit has failed by now.
    moe = [i for i in range(cfg.num_layers) if cfg.sparse_layers[i]]
    for i, experts in routed_experts(ckpt, moe, bool(cpu and cpu.experts_in_ram), progress,
                                     cpu.quant if cpu else None).items():
        layers[i].ffn.experts.extend(experts)  # type: ignore[union-attr]
    weights = DecoderWeights(embed, layers, norm("model.norm.weight"), lm_head,  # type: ignore[arg-type]
                             w("model.norm.bias") if cfg.norm_type == "layer" else None,
                             w("lm_head.bias") if cfg.lm_head_bias else None, linear)
    return MoEModel(cfg, weights, run, accel, policy, cpu)
