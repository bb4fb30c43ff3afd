"""From resolved `Options` to a ready `Engine`: check the kernels and the RAM, build the decoder and tokenizer.

Nothing is decided here: `runtime.options.resolve` settled every setting before. Routed experts are read into
RAM or left memory-mapped as the options say.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.kernels.choice import check_support
from tandem.kernels.errors import KernelError, ResourceError
from tandem.kernels.openmp import release_thread_pool
from tandem.runtime import memory
from tandem.runtime.accelerator import make_accelerator
from tandem.runtime.checkpoint import Checkpoint, open_checkpoint
from tandem.runtime.engine import Engine
from tandem.runtime.memory import check_memory, estimate_memory
from tandem.runtime.model import ModelRun, MoEModel
from tandem.runtime.options import Machine, Options, Request, resolve
from tandem.runtime.prefix import PrefixStore
from tandem.runtime.prefix_disk import DiskPrefixes, default_folder, disk_key
from tandem.runtime.tokenizer import Tokenizer
from tandem.runtime.trace import placement as trace_placement
from tandem.runtime.weights import layer_expert_names


@dataclass
class LoadedModel:
    checkpoint: Checkpoint
    model: MoEModel
    tokenizer: Tokenizer
    engine: Engine
    options: Options


def load(options: Options, checkpoint: Checkpoint | None = None,
         progress: Callable[[str, float], None] | None = None,
         notify: Callable[[str], None] | None = None, tokenizer: Tokenizer | None = None) -> LoadedModel:
    """Build everything needed to generate. `checkpoint`: `options.model` already open (as `configure` leaves
    it); `tokenizer`: its tokenizer, loaded already; `progress` hears about long steps (message, fraction done);
    `notify` about a change of plan (an accelerator nobody asked for that cannot hold the model: it runs on the CPU
    only)."""
    ckpt = checkpoint or open_checkpoint(options.model)
    cfg, cpu, dtype, cpu_dtype = ckpt.config, options.cpu, options.torch_dtype, options.cpu_torch_dtype
    first = next((i for i in range(cfg.num_layers) if cfg.sparse_layers[i]), None)
    if ckpt.expert_blocks and cpu.quant is not None:  # a GGUF file's blocks: the kernels read them as stored
        raise KernelError(f"{ckpt.path.name} stores its experts quantized already; run it without --quant")
    if cfg.experts_mxfp4:  # already 4-bit: the kernels read it as stored
        if cpu.quant is not None:
            raise KernelError(f"{ckpt.path} stores its experts as MXFP4 already; run it without --quant")
        check_support(cfg.hidden_size, cfg.moe_intermediate_size, cpu_dtype, "mxfp4")
    else:
        stored = None if first is None else ckpt.dtype(layer_expert_names(cfg, ckpt.spec, first)[0])
        check_support(cfg.hidden_size, cfg.moe_intermediate_size, cpu_dtype, cpu.quant, cpu.group, stored,
                      kernel_ready=cfg.clamped_swiglu is None)
    estimate = estimate_memory(ckpt, dtype, options.context, options.batch, cpu)
    check_memory(estimate, memory.available_ram(), options.force, cpu.experts_in_ram)
    tokenizer = tokenizer or Tokenizer.from_model(ckpt.path)
    accel = make_accelerator(options.accelerator, options.vram_gb, options.gpu)
    try:
        run = ModelRun(dtype, options.context, options.batch, cpu_dtype, options.ragged)
        model = MoEModel.from_checkpoint(ckpt, run, accel, options.offload, cpu, progress)
    except ResourceError as e:
        if accel is None:
            raise
        accel.close()
        if options.cpu_only is None:  # asked for: say so rather than run elsewhere
            raise
        if notify is not None:
            notify(f"{e}; the model runs on the CPU only")
        options = options.cpu_only
        run = ModelRun(options.torch_dtype, options.context, options.batch, ragged=options.ragged)
        model = MoEModel.from_checkpoint(ckpt, run, None, options.offload, options.cpu, progress)
    except BaseException:
        if accel is not None:
            accel.close()
        raise
    if notify is not None:
        for notice in model.dispatcher.notices:  # (a saved prefetch collection set aside)
            notify(notice)
    eos = list(ckpt.eos_token_ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
        eos.append(tokenizer.eos_token_id)
    release_thread_pool()  # the loading thread may stay (a chat app's, a server's): kernels/openmp.py
    store = None
    if options.prefix_reuse and (options.prefix_store or options.prefix_disk):
        disk = DiskPrefixes(default_folder(prefix_key(ckpt, options)), options.prefix_disk, notify) \
            if options.prefix_disk else None
        store = PrefixStore(options.prefix_store, disk)
    return LoadedModel(ckpt, model, tokenizer, Engine(model, eos, options.prefix_reuse, store), options)


def prefix_key(ckpt: Checkpoint, options: Options) -> str:
    """The folder of this load's prefixes on disk: its weight files and the settings that change the numbers in its
    KV cache (runtime/prefix_disk.py)."""
    cpu = options.cpu
    settings = {"dtype": options.dtype, "cpu_dtype": options.cpu_dtype, "quant": cpu.quant, "group": cpu.group,
                "isa": cpu.isa, "use_kernel": cpu.use_kernel, "accelerator": options.accelerator}
    return disk_key(ckpt.identity(), ckpt.path.name, settings)


def load_model(model: str | Path, *, placement: str | Path | None = None,
               progress: Callable[[str, float], None] | None = None, **settings: Any) -> LoadedModel:
    """Resolve `settings` (fields of `Request`) and load, for a program that states what it depends on (a
    benchmark, a test): no profile, and CPU only unless it asks for an accelerator. `placement`: a recorded trace
    whose experts, most popular first, are pinned on the accelerator (as --placement)."""
    settings.setdefault("accelerator", "none")
    ckpt = open_checkpoint(model)
    if placement is not None:
        settings["static"] = trace_placement(placement, ckpt.config.num_layers, ckpt.config.num_experts)
    return load(resolve(Request(model=model, **settings), None, ckpt, Machine.here()), ckpt, progress)
