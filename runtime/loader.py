"""From a model folder to a ready `Engine`: open, check the RAM budget, build the decoder, tokenizer.

The RAM check covers what is *not* memory-mapped: non-expert weights in the compute dtype, the KV
cache for the chosen context, and RoPE tables. Routed experts are read into RAM when they fit with room to
spare (or when asked), else memory-mapped and paged by the OS.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import psutil
import torch

from tandem.kernels.cpu import CpuOptions
from tandem.kernels.errors import ResourceError, SettingsError
from tandem.kernels.isa import mask_flags, masked_features
from tandem.runtime.accelerator import make_accelerator
from tandem.runtime.checkpoint import Checkpoint, open_checkpoint
from tandem.runtime.config import ModelConfig
from tandem.runtime.cpuinfo import proc_cpuinfo
from tandem.runtime.dispatch import OffloadPolicy
from tandem.runtime.engine import Engine
from tandem.runtime.model import KVCache, MoEModel, kept_dtypes
from tandem.runtime.tokenizer import Tokenizer
from tandem.runtime.trace import load_popularity, most_popular
from tandem.runtime.weights import dense_tensors, expert_names

DEFAULT_CONTEXT = 4096
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
GIB = 1024**3


@dataclass
class LoadedModel:
    checkpoint: Checkpoint
    model: MoEModel
    tokenizer: Tokenizer
    engine: Engine


@dataclass(frozen=True)
class MemoryEstimate:
    weights: int
    kv_cache: int
    other: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.other


def default_dtype(cpu_flags: set[str] | None) -> str:
    """bf16 where the CPU computes it natively (AVX512_BF16 or AMX); fp32 elsewhere or when unknown."""
    if cpu_flags and ({"avx512_bf16", "amx_bf16"} & cpu_flags):
        return "bf16"
    return "fp32"


def read_cpu_flags() -> set[str] | None:
    """CPU feature flags from /proc/cpuinfo, less what TANDEM_CPU_FEATURES removes; None where that is not
    available (unknown)."""
    info = proc_cpuinfo()
    return set(mask_flags(info["flags"], masked_features())) if info and info["flags"] else None


def resolve_context(cfg: ModelConfig, requested: int | None) -> int:
    limit = cfg.max_position_embeddings
    if cfg.sliding_window:
        limit = min(limit, cfg.sliding_window)
    if requested is None:
        return min(limit, DEFAULT_CONTEXT)
    if requested < 2:
        raise SettingsError("--context must be at least 2 tokens")
    if requested > limit:
        raise SettingsError(f"--context {requested} exceeds what this model supports ({limit} tokens)")
    return requested


def estimate_memory(
    ckpt: Checkpoint, dtype: torch.dtype, context: int, batch: int = 1, cpu: CpuOptions | None = None
) -> MemoryEstimate:
    cfg = ckpt.config
    item = torch.empty((), dtype=dtype).element_size()
    kept = kept_dtypes(ckpt, dtype, cpu)  # as MoEModel.from_checkpoint keeps them
    weights = sum(math.prod(s) * kept(name).itemsize for name, s in dense_tensors(cfg, ckpt.spec).items())
    kv = KVCache.nbytes(cfg, batch, context, dtype)
    rope = 2 * context * cfg.head_dim * item
    logits = 4 * cfg.vocab_size * 4
    first = next((i for i in range(cfg.num_layers) if cfg.sparse_layers[i]), None)
    if first is not None:  # quantized or resident experts live in RAM, resident ones in the file's dtype
        stored = ckpt.dtype(expert_names(ckpt.spec, first, 0)[0]).itemsize
        in_ram = (cpu or CpuOptions()).expert_bytes(cfg.hidden_size, cfg.moe_intermediate_size, stored)
        weights += in_ram * cfg.num_moe_layers * cfg.num_experts
    return MemoryEstimate(weights, kv, rope + logits)


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


RESIDENT_SHARE = 0.7  # experts are read into RAM by default when everything then takes at most this share of it


def resident_fits(total_with_resident: int, available: int) -> bool:
    """Whether the experts go into RAM when nobody asked: only with room to spare (for the OS, other programs and
    the KV cache growing), since the memory map would otherwise let the OS page them in and out."""
    return total_with_resident <= RESIDENT_SHARE * available


def available_ram() -> int:
    return psutil.virtual_memory().available


def load(
    path: str | Path,
    dtype: str = "auto",
    context: int | None = None,
    force: bool = False,
    accelerator: str = "none",
    vram_gb: float | None = None,
    policy: OffloadPolicy | None = None,
    batch: int = 1,
    placement: str | Path | None = None,
    cpu: CpuOptions | None = None,
    progress: Callable[[str, float], None] | None = None,
) -> LoadedModel:
    """Open, check, and build everything needed to generate. `batch` is the number of sequences the KV
    cache holds (beam search needs one per beam); `accelerator` is auto, none, cuda or emulated;
    `placement` is a recorded trace whose most popular experts are pinned on the accelerator; `progress` hears
    about long steps (message, fraction done)."""
    ckpt = open_checkpoint(path)
    if placement is not None:
        counts = load_popularity(placement, ckpt.config.num_layers, ckpt.config.num_experts)
        policy = replace(policy or OffloadPolicy(), static=tuple(most_popular(counts, counts.size)))
    name = default_dtype(read_cpu_flags()) if dtype == "auto" else dtype
    if name not in DTYPES:
        raise SettingsError(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(DTYPES)}")
    torch_dtype = DTYPES[name]
    ctx = resolve_context(ckpt.config, context)
    cfg = ckpt.config
    widths = (cfg.hidden_size, cfg.moe_intermediate_size)
    if cpu is not None and cpu.quant == "int4" and any(w % cpu.group for w in widths):
        fits = [g for g in (32, 64, 128) if not any(w % g for w in widths)]
        raise SettingsError(
            f"int4 groups of {cpu.group} need the hidden size ({cfg.hidden_size}) and expert width "
            f"({cfg.moe_intermediate_size}) to be multiples of {cpu.group}; "
            + (f"use --quant-group {fits[0]}" if fits else "use --quant int8 for this model")
        )
    cpu = cpu or CpuOptions()
    available = available_ram()
    if cpu.resident is None:  # unquantized experts into RAM when they fit with room to spare
        in_ram = estimate_memory(ckpt, torch_dtype, ctx, batch, replace(cpu, resident=True)).total
        cpu = replace(cpu, resident=cpu.quant is None and resident_fits(in_ram, available))
    check_memory(estimate_memory(ckpt, torch_dtype, ctx, batch, cpu), available, force, cpu.experts_in_ram)
    tokenizer = Tokenizer.from_folder(ckpt.path)
    accel = make_accelerator(accelerator, vram_gb)
    try:
        model = MoEModel.from_checkpoint(ckpt, torch_dtype, ctx, batch, accel, policy, cpu, progress)
    except BaseException:
        if accel is not None:
            accel.close()
        raise
    eos = list(ckpt.eos_token_ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
        eos.append(tokenizer.eos_token_id)
    return LoadedModel(ckpt, model, tokenizer, Engine(model, eos))
