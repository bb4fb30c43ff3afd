"""What a load takes in RAM, and whether it fits.

The estimate covers what is *not* memory-mapped: non-expert weights as they are kept, the KV cache for the chosen
context, RoPE tables and logits, and the experts when they are read into RAM or quantized. Experts left in the
memory map are paged by the OS and not counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import psutil
import torch

from tandem.kernels.errors import ResourceError
from tandem.kernels.experts import CpuOptions
from tandem.kernels.library import library
from tandem.runtime.build import kept_dtypes
from tandem.runtime.checkpoint import Checkpoint
from tandem.runtime.layers import cache_class
from tandem.runtime.model import PREFILL_CHUNK, activation_bytes
from tandem.runtime.rope import long_after, rotary_dims
from tandem.runtime.weights import dense_tensors, expert_names, layer_expert_names

GIB = 1024**3
RESIDENT_SHARE = 0.7  # experts are read into RAM by default when everything then takes at most this share of it


@dataclass(frozen=True)
class MemoryEstimate:
    weights: int
    kv_cache: int
    other: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.other


def estimate_memory(
    ckpt: Checkpoint, dtype: torch.dtype, context: int, batch: int = 1, cpu: CpuOptions | None = None
) -> MemoryEstimate:
    cfg = ckpt.config
    item = torch.empty((), dtype=dtype).element_size()
    kept = kept_dtypes(ckpt, dtype, cpu)  # as MoEModel.from_checkpoint keeps them
    blocks_run = library() is not None and (cpu is None or cpu.use_kernel)  # GGUF blocks kept as stored

    def dense(name: str, shape: tuple[int, ...]) -> int:
        m = ckpt.blocks(name) if blocks_run else None
        return m.nbytes if m is not None else math.prod(shape) * kept(name).itemsize
    weights = sum(dense(name, s) for name, s in dense_tensors(cfg, ckpt.spec).items())
    kv = cache_class(cfg).nbytes(cfg, batch, context, dtype)
    rope = 2 * context * (cfg.head_dim + (cfg.global_head_dim if cfg.global_rope else 0)) * item  # (Gemma 4's
    # global layers' own tables too)
    logits = 4 * cfg.vocab_size * 4
    first = next((i for i in range(cfg.num_layers) if cfg.sparse_layers[i]), None)
    if first is not None:  # quantized or resident experts live in RAM, resident ones in the file's dtype
        h, i = cfg.hidden_size, cfg.moe_intermediate_size
        if cfg.experts_mxfp4:  # always 4-bit copies in RAM, with their scales and float32 biases
            in_ram = CpuOptions(quant="mxfp4").expert_bytes(h, i, 1) + (2 * i + h) * 4
        elif ckpt.expert_blocks:  # GGUF blocks as stored: memory-mapped, or a RAM copy of their bytes
            names = expert_names(ckpt.spec, first, 0)
            stored_bytes = sum(ckpt.blocks(n).nbytes for n in names)  # type: ignore[union-attr]
            in_ram = stored_bytes if cpu is not None and cpu.experts_in_ram else 0
        else:
            name = layer_expert_names(cfg, ckpt.spec, first)[0]
            stored = ckpt.dtype(name).itemsize
            in_ram = (cpu or CpuOptions()).expert_bytes(h, i, stored)
            if not ckpt.where[name].mapped(name) or ckpt.spec.stacked_by_input:  # copies made at load: a GGUF's
                # quantized experts as floats, Llama 4's transposed into rows
                in_ram = max(in_ram, 3 * h * i * stored)
        weights += in_ram * cfg.num_moe_layers * cfg.num_experts
    return MemoryEstimate(weights, kv, rope + logits)


def accelerator_bytes(ckpt: Checkpoint, dtype: torch.dtype, context: int, batch: int = 1) -> int:
    """What a model keeps on an accelerator beside its expert slots, as MoEModel places it: every non-expert weight
    in the compute dtype, the KV cache, the RoPE tables and the activations of the longest prefill pass."""
    cfg = ckpt.config
    weights = sum(math.prod(shape) for shape in dense_tensors(cfg, ckpt.spec).values()) * dtype.itemsize
    kv = cache_class(cfg).nbytes(cfg, batch, context, dtype)
    tables = 2 if long_after(cfg) is None else 4  # cos and sin (and LongRoPE's long pair, at most)
    rope = tables * context * rotary_dims(cfg) * dtype.itemsize
    return weights + kv + rope + activation_bytes(cfg, min(PREFILL_CHUNK, context), context, batch, dtype)


def check_memory(estimate: MemoryEstimate, available: int, force: bool, resident: bool = False) -> None:
    if estimate.total <= available or force:
        return
    where = "with its experts read into RAM" if resident else "outside its memory-mapped experts"
    fix = "--no-resident, " if resident else ""
    raise ResourceError(
        f"not enough RAM: this model needs about {estimate.total / GIB:.2f} GiB {where} "
        f"(weights {estimate.weights / GIB:.2f} GiB + KV cache {estimate.kv_cache / GIB:.2f} GiB), but only "
        f"{available / GIB:.2f} GiB is available; close other programs, lower --context, {fix}or pass --force to "
        "try anyway"
    )


def resident_fits(total_with_resident: int, available: int) -> bool:
    """Whether the experts go into RAM when nobody asked: only with room to spare (for the OS, other programs and
    the KV cache growing), since the memory map would otherwise let the OS page them in and out."""
    return total_with_resident <= RESIDENT_SHARE * available


def available_ram() -> int:
    return psutil.virtual_memory().available
