"""Configure a load the one way every caller does (the CLI, the chat app, benchmarks, the tuner).

Open the checkpoint once, probe the machine once, find this machine's profile for the model, read a placement
trace, then `runtime.options.resolve` merges them: flags over the profile over the defaults. A setting that a command
decides from the resolved ones (a batch policy's size) is resolved again from what `Configured` kept (`again`):
nothing is opened, probed or looked up twice, and nothing patches `Options`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from tandem.autotune.measurements import Measurements
from tandem.autotune.plan import Plan
from tandem.autotune.probe import probe
from tandem.autotune.profile import collection_path, find_profile, model_fingerprint
from tandem.runtime.checkpoint import Checkpoint, open_checkpoint
from tandem.runtime.latency import LatencyModel
from tandem.runtime.options import Machine, Options, Request, auto_dtype, resolve
from tandem.runtime.trace import placement as trace_placement


@dataclass(frozen=True)
class Configured:
    options: Options
    checkpoint: Checkpoint  # options.model, open: the loader reuses it
    request: Request  # what was asked, as resolved (a placement's experts included)
    profile: Request | None  # what this machine's profile decided; None: none used
    machine: Machine
    measurements: Measurements | None = None  # the profile's; None: no profile used

    def again(self, **changes: Any) -> Configured:
        """The same request with `changes` (fields of `Request`) resolved again over the same profile, checkpoint
        and machine: for what a command decides once the first resolution is known."""
        request = replace(self.request, **changes)
        return replace(self, request=request, options=resolve(request, self.profile, self.checkpoint, self.machine))


def configure(request: Request, *, placement: str | None = None, use_profile: bool = True,
              notify: Callable[[str], None] | None = None, checkpoint: Checkpoint | None = None) -> Configured:
    """Resolve `request` for its model on this machine. `placement`: a recorded trace whose most popular experts
    are pinned on the accelerator (given, so it wins over a profile's); `use_profile`: fill what `request` leaves
    open from this machine's profile (its notices go to `notify`); `checkpoint`: already open (the checkpoint must
    be `request.model`'s)."""
    if request.model is None:
        raise ValueError("configure needs request.model (the CLI resolves the built-in model first)")
    ckpt = checkpoint or open_checkpoint(request.model)
    cfg = ckpt.config
    if placement is not None:
        request = replace(request, static=trace_placement(placement, cfg.num_layers, cfg.num_experts))
    if request.prefetch_collection is None:
        request = replace(request, prefetch_collection=collection_path(ckpt.raw_config))
    profile, measured = None, None
    if use_profile:
        hw = probe()
        machine = Machine.here(frozenset(hw.cpu.flags))
        dtype = request.dtype if request.dtype not in (None, "auto") else auto_dtype(
            machine, ckpt, request.quant, request.accelerator, request.gpu)
        found = find_profile(hw.fingerprint(), model_fingerprint(ckpt.raw_config, dtype))
        if found.notice and notify is not None:
            notify(found.notice)
        if found.profile is not None:
            profile = profile_request(found.profile.plan, found.profile.measurements)
            if found.profile.measurements:
                measured = Measurements.from_dict(found.profile.measurements)
    else:
        machine = Machine.here()
    return Configured(resolve(request, profile, ckpt, machine), ckpt, request, profile, machine, measured)


def profile_request(plan: dict[str, Any], measurements: dict[str, Any] | None = None) -> Request:
    """What a saved plan decides, as the settings it fills: kernel and threads always, the accelerator's strategy,
    cache and static experts only when the plan used one, with the cost model Fiddler's choice runs on from the
    `measurements` it was planned with (CPU latencies at its thread count, the accelerator's and the copy's). A
    plan that measured a GPU and chose the CPU alone says so: the accelerator stays off."""
    p = Plan.from_dict(plan)
    tuned = Request(threads=p.threads, crossover=p.crossover or None, kernel_isa=p.kernel_isa)
    meas = Measurements.from_dict(measurements) if measurements else None
    if not p.accelerator:
        return replace(tuned, accelerator="none") if meas is not None and meas.has_gpu else tuned
    static = tuple((int(layer), int(e)) for layer, e in plan.get("static", []))
    tuned = replace(tuned, strategy=p.strategy, cache_policy=p.cache_policy, cache_ways=p.cache_ways or None,
                    static=static)
    if p.prefetch_depth:  # the planner found prefetch pays here
        tuned = replace(tuned, prefetch=p.prefetch, prefetch_depth=p.prefetch_depth,
                        prefetch_min_precision=p.prefetch_min_precision)
    fit = meas.cpu.get(p.threads) if meas is not None else None
    if meas is None or fit is None or meas.gpu_expert_ms is None or meas.copy_expert_ms is None:
        return tuned
    # CpuFit is a + b(s - 1), LatencyModel a + b s
    cost = LatencyModel(max(0.0, fit.a_ms - fit.b_ms), fit.b_ms, meas.gpu_expert_ms, meas.copy_expert_ms)
    return replace(tuned, cost=cost)
