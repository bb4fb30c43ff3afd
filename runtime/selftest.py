"""`tandem selftest`: the accelerator tier checked end to end on this machine, with a tiny random model written to a
temporary folder (nothing is downloaded). On a GPU (`--gpu`) it is the smoke test of what no CI machine has; on the
emulated device it runs in the test suite, so every check is itself checked.

The checks:
- every strategy, cache policy and static placement, and two beams, at a budget of a few expert slots, give the
  CPU-only tokens and logits (fp32);
- the fence: a copy into a slot waits for the kernel that still reads it;
- host synchronisations per decode step (under `torch.cuda.set_sync_debug_mode` on a GPU, whose warnings count
  them; the accelerator's own count on the emulated device): at most two per MoE layer and one for the logits;
- the memory the device reserves at a full-context prefill stays within the budget;
- load, close, load again: the same budget (what the first load held was given back);
- the process's thread count is what it was.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.kernels.errors import ResourceError
from tandem.runtime.accelerator import GIB, Accelerator, make_accelerator, release_device_memory
from tandem.runtime.checkpoint import Checkpoint, open_checkpoint
from tandem.runtime.dispatch import OffloadOptions, Strategy, budget_for_slots
from tandem.runtime.engine import Engine
from tandem.runtime.expert_cache import CachePolicy
from tandem.runtime.memory import accelerator_bytes
from tandem.runtime.model import MoEModel
from tandem.runtime.sampling import SamplingParams
from tandem.runtime.synth import tiny_config, write_test_model

CONTEXT = 128
SLOTS = 6  # expert slots the budget leaves: fewer than the model's 24 experts, so every path is taken
TOKENS = 8
PROMPT = [11, 42, 7, 99, 23]
TOLERANCE = 1e-3  # fp32 logits, device against CPU (different summation orders)


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


@dataclass(frozen=True)
class _Run:
    tokens: list[int]
    logits: torch.Tensor


class _Device:
    """The device under test: `kind` ("cuda" or "emulated") and a budget of SLOTS expert slots for this model."""

    def __init__(self, kind: str, gpu: int, ckpt: Checkpoint) -> None:
        cfg = ckpt.config
        self.kind, self.gpu, self.ckpt = kind, gpu, ckpt
        expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4
        fixed = accelerator_bytes(ckpt, torch.float32, CONTEXT, 2) + expert  # beside the slots: the scratch expert
        self.vram_gb = budget_for_slots(fixed, SLOTS, expert) / GIB

    def accelerator(self, vram_gb: float | None) -> Accelerator:
        """An accelerator of `vram_gb` GB (None: all a GPU has free)."""
        accel = make_accelerator(self.kind, vram_gb, self.gpu)
        assert accel is not None
        return accel

    def model(self, policy: OffloadOptions, batch: int = 1) -> MoEModel:
        return MoEModel.from_checkpoint(self.ckpt, torch.float32, CONTEXT, batch, self.accelerator(self.vram_gb),
                                        policy)


def _run(model: MoEModel, beams: int = 1) -> _Run:
    logits = model.forward(torch.tensor([PROMPT]), 0)[0, -1]
    tokens = list(Engine(model, ()).generate(PROMPT, SamplingParams(max_new_tokens=TOKENS, beams=beams)))
    return _Run(tokens, logits)


def selftest(kind: str, workdir: Path, gpu: int = 0) -> list[Check]:
    """Every check on `kind` ("cuda": GPU `gpu`; "emulated"), with a model written under `workdir`."""
    threads = torch.get_num_threads()
    folder = write_test_model(workdir / "mixtral", tiny_config("mixtral", num_hidden_layers=3), seed=3)
    ckpt = open_checkpoint(folder)
    device = _Device(kind, gpu, ckpt)
    cpu = MoEModel.from_checkpoint(ckpt, torch.float32, CONTEXT, 2)
    reference, beams = _run(cpu), _run(cpu, beams=2)
    cpu.close()
    checks = [_matches(device, reference), _beams(device, beams), _fence(device), _synchronisations(device),
              _memory(device), _reload(device)]
    now = torch.get_num_threads()
    checks.append(Check("thread count", now == threads, f"{threads} before, {now} after"))
    return checks


def _matches(device: _Device, reference: _Run) -> Check:
    worst, wrong = 0.0, []
    every = tuple((layer, e) for layer in range(3) for e in range(8))
    for strategy in Strategy:
        for policy in CachePolicy:
            for static in ((), every[::5]):
                model = device.model(OffloadOptions(strategy, None if static else 2, policy, static))
                try:
                    run = _run(model)
                finally:
                    model.close()
                worst = max(worst, (run.logits - reference.logits).abs().max().item())
                if run.tokens != reference.tokens or worst > TOLERANCE:
                    wrong.append(f"{strategy}/{policy}/{'static' if static else 'cache'}")
    detail = f"{3 * len(CachePolicy) * 2} configurations, largest logit difference {worst:.1e}"
    return Check("every strategy, cache policy and placement matches the CPU", not wrong,
                 detail + (f"; differ: {', '.join(wrong)}" if wrong else ""))


def _beams(device: _Device, reference: _Run) -> Check:
    model = device.model(OffloadOptions(Strategy.FIDDLER, 2), batch=2)
    try:
        run = _run(model, beams=2)
    finally:
        model.close()
    return Check("two beams match the CPU", run.tokens == reference.tokens, f"{len(run.tokens)} tokens")


def _fence(device: _Device, size: int = 1024, reads: int = 1000) -> Check:
    """A kernel reads a slot `reads` times while a copy of other values into it is queued: it must see the old
    values throughout (the copy waits for it)."""
    accel = device.accelerator(vram_gb=2 * size * size * 4 / GIB)  # a budget of its own: the slot, twice
    try:
        slot = accel.empty((size, size), torch.float32, "the fenced slot")
        accel.copy_async([slot], [torch.full((size, size), 1.0 / size)]).result()  # (the copier, warmed up)
        x = accel.to_device(torch.ones(size))

        def kernel() -> torch.Tensor:
            y = x
            for _ in range(reads):
                y = slot @ y  # stays ones while the slot holds 1/size
            return y

        read = accel.submit(kernel)
        accel.copy_async([slot], [torch.full((size, size), 2.0 / size)])
        seen = accel.download(lambda: (read.result(),)).wait()[0]  # (read: earlier work on the stream)
    finally:
        accel.close()
    error = (seen - 1).abs().max().item()
    return Check("a slot is not overwritten while a kernel reads it", error < 1e-3, f"largest change {error:.1e}")


@contextmanager
def _counted_syncs(accel: Accelerator) -> Iterator[Callable[[], int]]:
    """Host synchronisations inside: on CUDA the sync debug mode's warnings (implicit ones) plus the accelerator's
    own host waits, on the emulated device its own count."""
    before = accel.syncs
    if accel.device.type != "cuda":
        yield lambda: accel.syncs - before
        return
    with warnings.catch_warnings(record=True) as seen:  # pragma: no cover - no GPU on test machines
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield lambda: accel.syncs - before + len(seen)
        finally:
            torch.cuda.set_sync_debug_mode("default")


def _synchronisations(device: _Device) -> Check:
    model = device.model(OffloadOptions(Strategy.CPU, 2))
    accel = model.accel
    assert accel is not None
    try:
        steps = Engine(model, ()).generate(PROMPT, SamplingParams(max_new_tokens=TOKENS + 1))
        next(steps)  # the prefill
        with _counted_syncs(accel) as count:
            decoded = sum(1 for _ in steps)
            per_step = count() / max(1, decoded)
    finally:
        model.close()
    moe = model.cfg.num_moe_layers
    return Check("host synchronisations per decode step", per_step <= 2 * moe + 1,
                 f"{per_step:.1f} a step over {decoded} steps ({moe} MoE layers; at most {2 * moe + 1})")


def _memory(device: _Device) -> Check:
    """A prompt as long as the context allows (the longest prefill) within the budget: what the device's
    allocator reserves (CUDA), or what the accelerator accounted (emulated)."""
    cuda = device.kind == "cuda"
    if cuda:  # pragma: no cover - no GPU on test machines
        release_device_memory()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_reserved()
    model = device.model(OffloadOptions(Strategy.FIDDLER, 2))
    accel = model.accel
    assert accel is not None
    budget = accel.budget
    try:
        prompt = [(7 * i) % model.cfg.vocab_size for i in range(CONTEXT - 1)]
        list(Engine(model, ()).generate(prompt, SamplingParams(max_new_tokens=1)))
        peak = torch.cuda.max_memory_reserved() - base if cuda else accel.used
    except ResourceError as e:
        return Check("memory at a full-context prefill", False, str(e))
    finally:
        model.close()
    return Check("memory at a full-context prefill", peak <= budget,
                 f"{peak / 2**20:.1f} MiB of a {budget / 2**20:.1f} MiB budget")


def _reload(device: _Device) -> Check:
    """On a GPU the budget is all its free memory, as without --vram-gb: the second load must find what the first
    held given back (within what the CUDA context itself may take meanwhile)."""
    cuda = device.kind == "cuda"
    budgets = []
    for _ in range(2):
        accel = device.accelerator(None if cuda else device.vram_gb)
        model = MoEModel.from_checkpoint(device.ckpt, torch.float32, CONTEXT, 1, accel, OffloadOptions())
        budgets.append(accel.budget)
        list(Engine(model, ()).generate(PROMPT, SamplingParams(max_new_tokens=2)))
        model.close()
        del model, accel
        release_device_memory()
    slack = 64 * 2**20 if cuda else 0
    return Check("load, close, load again: the same budget", abs(budgets[0] - budgets[1]) <= slack,
                 f"{budgets[0] / 2**20:.1f} then {budgets[1] / 2**20:.1f} MiB")
