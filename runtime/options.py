"""One typed configuration for a load, resolved once.

`Request` is what the caller asked for (the user's flags; None: not given). `resolve` merges it with a machine's
tuning profile (another `Request`, holding only what the profile decides) and the defaults into `Options`: flags
win over the profile, the profile over the defaults, and some defaults are read off the checkpoint and the
machine (`Machine`). It is a pure function; `Options` is immutable, remembers where each value came from, and
prints itself (`tandem generate --show-config`). The loader takes `Options` and decides nothing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal

import torch

from tandem.kernels.errors import SettingsError
from tandem.kernels.experts import CpuOptions
from tandem.kernels.isa import mask_flags, masked_features
from tandem.kernels.library import Q8_KINDS, available_isas
from tandem.kernels.names import BLOCK_QUANTS, Isa, Quant
from tandem.kernels.quant import GROUPS
from tandem.runtime import memory
from tandem.runtime.accelerator import cuda_devices, cuda_usable
from tandem.runtime.checkpoint import Checkpoint
from tandem.runtime.choices import DTYPE_NAMES, AcceleratorKind, Dtype, PredictorKind
from tandem.runtime.config import ModelConfig
from tandem.runtime.cpuinfo import proc_cpuinfo
from tandem.runtime.dispatch import OffloadOptions, Strategy
from tandem.runtime.expert_cache import DEFAULT_INFLIGHT, CachePolicy, Key
from tandem.runtime.latency import LatencyModel
from tandem.runtime.layers import cache_class
from tandem.runtime.memory import estimate_memory, resident_fits
from tandem.runtime.prefetch import DEFAULT_MIN_PRECISION, MAX_DEPTH, PrefetchOptions

Source = Literal["given", "profile", "default", "machine"]  # where a resolved value came from

DTYPES: dict[str, torch.dtype] = dict(zip(DTYPE_NAMES, (torch.bfloat16, torch.float16, torch.float32), strict=True))
DEFAULT_CONTEXT = 4096
DEFAULT_GROUP = 64  # int4 group size when none is given
# RAM for the prefixes prompts overwrote (a chat switched away from): an eighth of what is available, at most 2 GiB
# (a 4k-token conversation of a 48-layer model with 4 KV heads of 128 takes about 400 MB in bf16)
PREFIX_STORE_MOST = 2 << 30
# requests a server takes at once by default: a local server rarely has more clients at once, and a step of 8
# sequences takes 3.7 times one sequence's (docs/bench, batch mode: 58.3 against 15.9 ms), 2.2 times the tokens/s
SERVE_MOST_BATCH = 8


@dataclass(frozen=True)
class Request:
    """Settings as given. None: not given, so the profile (for the fields it holds) or the default decides."""

    model: str | Path | None = None
    dtype: Dtype | Literal["auto"] | None = None  # None or auto: bf16 where the CPU computes it natively, else fp32
    context: int | None = None  # None: min(the model's limit, DEFAULT_CONTEXT)
    # sequences the KV cache holds (beam search needs one per beam); None: as many as a server should take at once,
    # SERVE_MOST_BATCH or fewer where their KV cache rows would take over half the available RAM
    batch: int | None = 1
    ragged: bool = False  # the sequences run as ragged passes, each prompt's tokens in one row (batch mode, serve)
    force: bool = False  # load even when the RAM estimate says it will not fit
    accelerator: AcceleratorKind | None = None  # None: auto (CUDA when usable, else CPU only)
    vram_gb: float | None = None
    gpu: int | None = None  # which GPU, in PCI bus order (as nvidia-smi and `tandem probe` number them); None: 0
    strategy: Strategy | None = None
    cache_ways: int | None = None
    cache_policy: CachePolicy | None = None
    static: tuple[Key, ...] | None = None  # experts pinned on the accelerator, most popular first
    max_inflight: int | None = None
    cost: LatencyModel | None = None
    prefetch: PredictorKind | None = None  # None: the profile's plan, else none
    prefetch_depth: int | None = None  # MoE layers ahead; None: the plan's, else 1
    prefetch_min_precision: float | None = None  # where prefetch stops paying; None: the plan's, else the default
    prefetch_collection: Path | None = None  # the EAM predictor's saved collection (configure: beside the profiles)
    readahead: bool = False  # CPU only, experts left in their files: read each layer's ahead once routed
    threads: int | None = None
    crossover: int | None = None
    quant: Quant | Literal["none"] | None = None
    quant_group: int | None = None
    kernel_isa: Isa | Literal["auto"] | None = None  # None or auto: the best this CPU supports
    resident: bool | None = None  # None: read the experts into RAM when they fit with room to spare
    use_kernel: bool = True  # False: torch only, no compiled kernels
    prefix_reuse: bool = True  # a prompt that begins as a KV cache row's tokens prefills only the rest
    prefix_store_gb: float | None = None  # RAM for prefixes prompts overwrote; None: an eighth of it, at most 2 GiB
    prefix_disk_gb: float | None = None  # disk for conversations' prefixes across restarts; None or 0: none


@dataclass(frozen=True)
class Machine:
    """The facts about this machine that settle defaults."""

    cpu_flags: frozenset[str] | None  # after TANDEM_CPU_FEATURES; None: unknown
    cpu_threads: int  # the most threads worth asking for
    isas: tuple[str, ...]  # compiled kernel variants this CPU can run
    available_ram: int  # bytes
    cuda: bool  # a usable CUDA device
    gpu_capabilities: tuple[tuple[int, int] | None, ...] = ()  # each CUDA GPU's, in PCI bus order; None: unknown

    @classmethod
    def here(cls, cpu_flags: frozenset[str] | None = None) -> Machine:
        """Read now. `cpu_flags`: already probed (else read from /proc/cpuinfo, less the masked features)."""
        if cpu_flags is None:
            info = proc_cpuinfo()
            if info and info["flags"]:
                cpu_flags = frozenset(mask_flags(info["flags"], masked_features()))
        usable = cuda_usable()
        return cls(cpu_flags or None, os.cpu_count() or 1, tuple(available_isas()), memory.available_ram(), usable,
                   tuple(d.capability for d in cuda_devices()) if usable else ())


@dataclass(frozen=True)
class Options:
    """Everything a load needs, decided. `sources` says where each setting came from."""

    model: Path
    dtype: Dtype
    context: int
    batch: int
    force: bool
    accelerator: Literal["none", "cuda", "emulated"]
    vram_gb: float | None
    offload: OffloadOptions
    cpu: CpuOptions
    sources: tuple[tuple[str, Source], ...] = field(default=(), compare=False)
    gpu: int = 0
    cpu_dtype: Dtype | None = None  # the CPU experts' compute dtype where it is not `dtype` (an fp16 GPU's)
    ragged: bool = False  # batch mode: the `batch` sequences run as ragged passes, each prompt's tokens in one row
    prefix_reuse: bool = True  # runtime/prefix.py: a prompt sharing a cache row's first tokens prefills the rest
    prefix_store: int = 0  # bytes of RAM for prefixes a prompt overwrote (runtime/prefix.py PrefixStore)
    prefix_disk: int = 0  # bytes of disk for prefixes kept across restarts (runtime/prefix_disk.py; 0: none)
    # where this machine chose an accelerator nobody asked for: the options of the same request on the CPU alone
    # (resolve's with --accelerator none), which the loader runs when that accelerator cannot hold the model
    cpu_only: Options | None = field(default=None, compare=False)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def cpu_torch_dtype(self) -> torch.dtype:
        return DTYPES[self.cpu_dtype or self.dtype]

    def source(self, name: str) -> Source:
        return dict(self.sources).get(name, "default")

    def to_dict(self) -> dict[str, Any]:
        """Every setting with its value (JSON types) and where it came from."""
        o, c = self.offload, self.cpu
        values: dict[str, Any] = {
            "model": str(self.model), "dtype": self.dtype, "context": self.context, "batch": self.batch,
            "ragged": self.ragged,
            "force": self.force, "accelerator": self.accelerator, "vram_gb": self.vram_gb, "gpu": self.gpu,
            "strategy": str(o.strategy), "cache_ways": o.cache_ways, "cache_policy": str(o.cache_policy),
            "static": [list(k) for k in o.static], "max_inflight": o.max_inflight,
            "prefetch": str(o.prefetch.predictor), "prefetch_depth": o.prefetch.depth,
            "prefetch_min_precision": o.prefetch.min_precision,
            "prefetch_collection": None if o.prefetch.collection is None else str(o.prefetch.collection),
            "readahead": o.prefetch.readahead,
            "cost": None if o.cost is None else [o.cost.cpu_a_ms, o.cost.cpu_b_ms, o.cost.gpu_ms, o.cost.transfer_ms],
            "threads": c.threads, "crossover": c.crossover, "quant": c.quant or "none", "quant_group": c.group,
            "kernel_isa": c.isa or "auto", "resident": c.resident, "use_kernel": c.use_kernel,
            "prefix_reuse": self.prefix_reuse, "prefix_store_gb": round(self.prefix_store / 2**30, 3),
            "prefix_disk_gb": round(self.prefix_disk / 2**30, 3),
        }
        return {k: {"value": v, "from": self.source(k)} for k, v in values.items()}

    def describe(self) -> list[str]:
        """One line per setting: name, value, and where it came from."""
        shown = {"threads": "default (torch's count)", "crossover": "default (by kernel)", "cache_ways": "default "
                 "(spread over the layers)", "cost": "default (from sizes)", "vram_gb": "default (all free)"}
        lines = []
        for name, item in self.to_dict().items():
            value = item["value"]
            text = shown.get(name, "none") if value is None else f"{len(value)} experts" if name == "static" else value
            lines.append(f"{name:13} {text}  [{item['from']}]")
        return lines


def default_dtype(cpu_flags: set[str] | frozenset[str] | None, int8_blocks: bool = False) -> Dtype:
    """bf16 where the CPU computes it natively (AVX512_BF16 or AMX), and for a model of GGUF blocks the kernels run
    against int8 activations (`int8_blocks`, see takes_int8_blocks) where the CPU has AVX2: bf16 is the compute that
    takes that path (kernels/csrc/q8avx2.c), and the model was quantized anyway. fp32 elsewhere or when unknown."""
    if cpu_flags and ({"avx512_bf16", "amx_bf16"} & cpu_flags):
        return "bf16"
    if cpu_flags and int8_blocks and "avx2" in cpu_flags:
        return "bf16"
    return "fp32"


def gpu_dtype(capability: tuple[int, int] | None) -> Dtype:
    """A GPU's compute dtype: bf16 from Ampere (sm80) on, where its tensor cores compute it; fp16 on older GPUs
    (Turing, Volta: bf16 there is emulated, several times slower); fp32 when the GPU is unknown."""
    if capability is None:
        return "fp32"
    return "bf16" if capability >= (8, 0) else "fp16"


def auto_dtype(machine: Machine, ckpt: Checkpoint, quant: str | None, accelerator: str | None = None,
               gpu: int | None = None) -> Dtype:
    """The dtype a load runs in when none is asked: its GPU's where it runs on one (`accelerator` None or auto: on
    a GPU when the machine has one), else the CPU's."""
    if accelerator in (None, "auto"):
        accelerator = "cuda" if machine.cuda else "none"
    if accelerator == "cuda":
        caps = machine.gpu_capabilities
        return gpu_dtype(caps[gpu or 0] if (gpu or 0) < len(caps) else None)
    return default_dtype(machine.cpu_flags, takes_int8_blocks(ckpt, quant))


def takes_int8_blocks(ckpt: Checkpoint, quant: str | None) -> bool:
    """Whether this model's experts are GGUF blocks of a format the kernels run against int8 activations: a GGUF
    file's, or Tandem's own `--quant q8_0|q4_k`."""
    return quant in BLOCK_QUANTS or ckpt.expert_block_kind in Q8_KINDS


def resolve_context(cfg: ModelConfig, requested: int | None) -> int:
    limit = cfg.max_position_embeddings  # (a sliding window does not bound it: attention slides past it)
    if requested is None:
        return min(limit, DEFAULT_CONTEXT)
    if requested < 2:
        raise SettingsError("--context must be at least 2 tokens")
    if requested > limit:
        raise SettingsError(f"--context {requested} exceeds what this model supports ({limit} tokens)")
    return requested


def resolve(request: Request, profile: Request | None, ckpt: Checkpoint, machine: Machine) -> Options:
    """The options a load runs with: `request` over `profile` over the defaults (pure; raises SettingsError)."""
    request = replace(request, dtype=None if request.dtype == "auto" else request.dtype,  # the words for "not given"
                      quant=None if request.quant == "none" else request.quant,
                      kernel_isa=None if request.kernel_isa == "auto" else request.kernel_isa)
    profile = profile or Request()
    sources: dict[str, Source] = {}

    def pick(name: str, default: Any = None, source: Source = "default", profiled: bool = True) -> Any:
        """The given value, else the profile's (for the fields it holds), else the default."""
        given, tuned = getattr(request, name), getattr(profile, name) if profiled else None
        value, sources[name] = (given, "given") if given is not None else (
            (tuned, "profile") if tuned is not None else (default, source))
        return value

    if request.model is None:
        raise SettingsError("no model given")
    cfg = ckpt.config
    accelerator = pick("accelerator", "auto")  # (a profile's "none": its plan measured the GPU and chose the CPU)
    if accelerator == "auto":
        accelerator = "cuda" if machine.cuda else "none"
        sources["accelerator"] = "machine"
    gpu = pick("gpu", 0, profiled=False)
    if accelerator == "cuda" and not 0 <= gpu < max(1, len(machine.gpu_capabilities)):
        raise SettingsError(f"--gpu {gpu}: this machine has {len(machine.gpu_capabilities)} CUDA GPUs, numbered from 0 "
                            "in PCI bus order (tandem probe lists them)")
    cpu_default = default_dtype(machine.cpu_flags, takes_int8_blocks(ckpt, request.quant))
    dtype = pick("dtype", auto_dtype(machine, ckpt, request.quant, accelerator, gpu), "machine", profiled=False)
    if dtype not in DTYPES:
        raise SettingsError(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(DTYPES)}")
    if dtype == "fp16" and accelerator == "none":
        raise SettingsError("fp16 is a GPU's compute dtype (one without bf16); on the CPU choose bf16 or fp32")
    # the CPU experts compute in the model's dtype, but an fp16 GPU's CPU experts in the CPU's own
    cpu_dtype: Dtype | None = cpu_default if dtype == "fp16" else None
    context = resolve_context(cfg, pick("context", profiled=False))
    isa = request.kernel_isa
    if isa is not None and isa not in machine.isas:
        raise SettingsError(f"--kernel-isa {isa} is not available on this machine "
                            f"(available: {', '.join(machine.isas) or 'none'})")
    if isa is None and profile.kernel_isa not in machine.isas:  # a profile's variant this CPU cannot run
        profile = replace(profile, kernel_isa=None)
    threads = pick("threads")
    if threads is not None and not 1 <= threads <= machine.cpu_threads:
        raise SettingsError(f"--threads must be between 1 and {machine.cpu_threads}, the number of CPU threads this "
                            f"machine has (the profile says {threads}; run tandem autotune again)")
    quant, group = pick("quant", profiled=False), pick("quant_group", DEFAULT_GROUP, profiled=False)
    _check_group(cfg, quant, group)
    cpu = CpuOptions(threads, pick("crossover"), quant, group, pick("kernel_isa"), request.use_kernel,
                     pick("resident", profiled=False))
    batch = request.batch
    if batch is None:
        batch = serving_batch(cfg, context, DTYPES[dtype], machine.available_ram)
        sources["batch"] = "machine"
    elif batch < 1:
        raise SettingsError(f"a batch of {batch} sequences: give 1 or more")
    if cpu.resident is None:  # unquantized experts into RAM when they fit with room to spare
        in_ram = estimate_memory(ckpt, DTYPES[dtype], context, batch, replace(cpu, resident=True)).total
        cpu = replace(cpu, resident=quant is None and resident_fits(in_ram, machine.available_ram))
        sources["resident"] = "machine"
    static = pick("static", ())
    foreign = [k for k in static if not (0 <= k[0] < cfg.num_layers and 0 <= k[1] < cfg.num_experts)]
    if foreign and sources["static"] == "profile":  # (a damaged profile: its other settings still hold)
        static = tuple(k for k in static if k not in foreign)
    elif foreign:
        raise SettingsError(f"the placement pins expert {foreign[0]} (layer, expert), which this model does not have "
                            f"({cfg.num_layers} layers of {cfg.num_experts} experts); make the placement for it")
    depth = pick("prefetch_depth", 1)
    if not 1 <= depth <= MAX_DEPTH:
        raise SettingsError(f"--prefetch-depth {depth}: give 1 to {MAX_DEPTH} MoE layers ahead")
    kind = PredictorKind(pick("prefetch", PredictorKind.NONE))
    offload = OffloadOptions(pick("strategy", Strategy.FIDDLER), pick("cache_ways"),
                             pick("cache_policy", CachePolicy.LRU), static,
                             pick("max_inflight", DEFAULT_INFLIGHT, profiled=False), pick("cost"),
                             PrefetchOptions(kind, depth, pick("prefetch_min_precision", DEFAULT_MIN_PRECISION),
                                             pick("prefetch_collection", profiled=False)
                                             if kind is PredictorKind.EAM else None, request.readahead))
    for name in ("batch", "ragged", "force", "use_kernel", "prefix_reuse", "readahead"):
        if name not in sources:
            sources[name] = "given" if getattr(request, name) != getattr(Request, name) else "default"
    pick("vram_gb", profiled=False)
    gb = pick("prefix_store_gb", profiled=False)
    if gb is not None and not 0 <= gb <= 1 << 20:
        raise SettingsError(f"--prefix-store-gb {gb}: give 0 (none) or more GiB of RAM")
    store = int(gb * 2**30) if gb is not None else min(PREFIX_STORE_MOST, machine.available_ram // 8)
    disk_gb = pick("prefix_disk_gb", profiled=False)
    if disk_gb is not None and not 0 <= disk_gb <= 1 << 20:
        raise SettingsError(f"--prefix-disk-gb {disk_gb}: give 0 (none) or more GiB of disk")
    disk = int((disk_gb or 0) * 2**30) if request.prefix_reuse else 0
    sources["model"] = "given"
    names = [f.name for f in fields(Request)]
    cpu_only = None
    if sources["accelerator"] == "machine" and accelerator != "none":
        cpu_only = resolve(replace(request, accelerator="none"), profile, ckpt, machine)
    return Options(Path(request.model), dtype, context, batch, request.force, accelerator, request.vram_gb, offload,
                   cpu, tuple((n, sources.get(n, "default")) for n in names), gpu, cpu_dtype,
                   ragged=request.ragged, prefix_reuse=request.prefix_reuse,
                   prefix_store=store if request.prefix_reuse else 0,
                   prefix_disk=disk, cpu_only=cpu_only)


def serving_batch(cfg: ModelConfig, context: int, dtype: torch.dtype, free_ram: int) -> int:
    """Requests a server takes at once: SERVE_MOST_BATCH, fewer when their KV cache rows would take over half of
    `free_ram`."""
    row = cache_class(cfg).nbytes(cfg, 1, context, dtype)
    return max(1, min(SERVE_MOST_BATCH, free_ram // 2 // max(1, row)))


def _check_group(cfg: ModelConfig, quant: str | None, group: int) -> None:
    """int4 groups must divide both widths; say which group size would (or that int8 is the way). MXFP4 takes
    blocks of 32."""
    widths = (cfg.hidden_size, cfg.moe_intermediate_size)
    block = {"q8_0": 32, "q4_k": 256}.get(quant or "", 0)
    if block and any(w % block for w in widths):
        raise SettingsError(
            f"{quant} takes blocks of {block} values: the hidden size ({cfg.hidden_size}) and expert width "
            f"({cfg.moe_intermediate_size}) must be multiples of {block}; use --quant "
            f"{'q8_0' if not any(w % 32 for w in widths) else 'int8'} for this model")
    if quant == "mxfp4" and any(w % 32 for w in widths):
        raise SettingsError(
            f"MXFP4 takes blocks of 32 values: the hidden size ({cfg.hidden_size}) and expert width "
            f"({cfg.moe_intermediate_size}) must be multiples of 32; use --quant int8 for this model")
    if quant == "int4" and any(w % group for w in widths):
        fits = [g for g in GROUPS if not any(w % g for w in widths)]
        raise SettingsError(
            f"int4 groups of {group} need the hidden size ({cfg.hidden_size}) and expert width "
            f"({cfg.moe_intermediate_size}) to be multiples of {group}; "
            + (f"use --quant-group {fits[0]}" if fits else "use --quant int8 for this model")
        )
