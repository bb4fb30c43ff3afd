"""`tandem selftest`: the accelerator tier checked end to end on this machine, with random models written to a
temporary folder (nothing is downloaded). On a GPU (`--gpu`) it is the smoke test of what no CI machine has; on the
emulated device it runs in the test suite, so every check is itself checked, and each check is shown to fail on
code broken the way it guards against (tests/test_selftest.py).

The checks, each with its figures:
- every strategy, cache policy and static placement, and two beams, at a budget of a few expert slots, give the
  CPU-only tokens and logits (a tiny model, fp32);
- bf16, and fp16 with the CPU's experts in float32, on a model with real experts' shapes (Qwen3-30B-A3B's on a GPU,
  smaller on the emulated device), top-8: the device's logits against the CPU's, teacher-forced, both in torch's
  products; its logits not rounded to the compute dtype (float32 sums, as the CPU keeps them); each MoE layer's
  output against the CPU's on the same input (a bf16 sum of the experts shows there, where the logits may hide it);
- the fence: a copy into a slot waits for a kernel still reading it, a kernel made slow on purpose;
- the memory the device takes for the expert slots and a full-context prefill, against the budget (on CUDA what the
  allocator reserves; the slots come from a few slabs, not one allocation a tensor);
- host synchronisations per decode step for each kind of expert weights (bf16, GGUF blocks, MXFP4) and per batched
  pass: one host read per MoE layer and one for the logits (on CUDA the sync debug mode's implicit ones count too;
  the emulated device's joins of its expert stream do not, where CUDA orders two streams on the device);
- load, close, load again: the same budget (what the first load held was given back);
- `--gpu N` is the GPU `tandem probe` numbers N (by PCI bus);
- the process's thread count is what it was.
"""

from __future__ import annotations

import math
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from tandem.kernels.errors import ResourceError
from tandem.kernels.experts import CpuOptions
from tandem.runtime.accelerator import GIB, Accelerator, cuda_devices, make_accelerator, release_device_memory
from tandem.runtime.checkpoint import Checkpoint, open_checkpoint
from tandem.runtime.dispatch import SLAB_BYTES, Dispatcher, OffloadOptions, Pending, Strategy, budget_for_slots
from tandem.runtime.engine import Engine
from tandem.runtime.expert_cache import CachePolicy
from tandem.runtime.memory import accelerator_bytes
from tandem.runtime.model import ModelRun, MoEModel, Segment
from tandem.runtime.sampling import SamplingParams
from tandem.runtime.synth import tiny_config, write_test_model

CONTEXT = 128
SLOTS = 6  # expert slots the budget leaves: fewer than the model's 24 experts, so every path is taken
TOKENS = 8
PROMPT = [11, 42, 7, 99, 23]
TOLERANCE = 1e-3  # fp32 logits, device against CPU (different summation orders)
FENCE_S = 0.2  # how long the slowed kernel reads its slot
BF16_EXACT_MOST = 0.5  # a larger share of logits exactly representable in bf16: they were rounded to it
AGREE_LEAST = 0.85  # teacher-forced top-1 agreement with the CPU in the same dtype, at the least
PLAIN = CpuOptions(resident=True, use_kernel=False)  # the CPU reference of the numerics checks: torch's products
CLOSER = 0.25  # the device's largest logit difference from the CPU, at most this share of bf16's own (on the emulated
# device: 0.0 of it, the same products; the logits rounded to bf16, about 0.8-1.0)
LAYER_ROUNDOFFS = 0.25  # an MoE layer's output on the device against the CPU's on the same input: mean difference
# over mean size, in units of the compute dtype's roundoff (2^-8 for bf16), at most this. The logits alone cannot
# tell a bf16 sum of the experts from other kernels' rounding: the model amplifies both alike, and the bf16 sum
# moved the logits 0.12 of bf16's own on one CPU, 1.0 on another. At the layer it is 1.0 roundoff everywhere, where
# the same products give 0.0 and fp16's device experts against the CPU's float32 ones 0.06.


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    figures: dict[str, float | int | str | None] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class _Run:
    tokens: list[int]
    logits: torch.Tensor


class _Device:
    """The device under test: `kind` ("cuda" or "emulated") and a budget of SLOTS expert slots for the tiny model."""

    def __init__(self, kind: str, gpu: int, ckpt: Checkpoint) -> None:
        cfg = ckpt.config
        self.kind, self.gpu, self.ckpt = kind, gpu, ckpt
        expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4
        fixed = accelerator_bytes(ckpt, torch.float32, CONTEXT, 2) + expert  # beside the slots: the scratch expert
        self.vram_gb = budget_for_slots(fixed, SLOTS, expert) / GIB

    @property
    def cuda(self) -> bool:
        return self.kind == "cuda"

    @property
    def gpu_index(self) -> int | None:
        """PyTorch's number for the GPU under test (`--gpu` counts by PCI bus); None on the emulated device."""
        return cuda_devices()[self.gpu].index if self.cuda else None

    def accelerator(self, vram_gb: float | None) -> Accelerator:
        """An accelerator of `vram_gb` GB (None: all a GPU has free)."""
        accel = make_accelerator(self.kind, vram_gb, self.gpu)
        assert accel is not None
        return accel

    def model(self, policy: OffloadOptions, batch: int = 1) -> MoEModel:
        return MoEModel.from_checkpoint(self.ckpt, ModelRun(torch.float32, CONTEXT, batch),
                                        self.accelerator(self.vram_gb), policy)


class _Shaped:
    """A model with real experts' shapes (a GPU's allocator and kernels behave by size), bf16, and the budget for
    a quarter of its experts: Qwen3-30B-A3B's expert (2048 x 768, 3 MiB a matrix) on a GPU; a smaller one on the
    emulated device, which the tests run on two cores."""

    def __init__(self, kind: str, workdir: Path) -> None:
        cuda = kind == "cuda"
        cfg = tiny_config("qwen3_moe", num_hidden_layers=2, hidden_size=2048 if cuda else 256,
                          moe_intermediate_size=768 if cuda else 256, num_experts=16, num_experts_per_tok=8,
                          num_attention_heads=16 if cuda else 4, num_key_value_heads=4 if cuda else 2,
                          head_dim=128 if cuda else 64, vocab_size=2048, max_position_embeddings=CONTEXT)
        folder = write_test_model(workdir / "shaped", cfg, seed=4, dtype=torch.bfloat16, std=0.02)
        self.ckpt = open_checkpoint(folder)
        c = self.ckpt.config
        self.expert = 3 * c.hidden_size * c.moe_intermediate_size * 2
        self.slots = c.num_moe_layers * c.num_experts // 4

    def vram_gb(self, batch: int = 1) -> float:
        fixed = accelerator_bytes(self.ckpt, torch.bfloat16, CONTEXT, batch) + self.expert
        return budget_for_slots(fixed, self.slots, self.expert) / GIB

    def prompt(self, n: int, seed: int = 0) -> torch.Tensor:
        return torch.randint(3, self.ckpt.config.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def _run(model: MoEModel, beams: int = 1) -> _Run:
    logits = model.forward(torch.tensor([PROMPT]), 0)[0, -1]
    tokens = list(Engine(model, ()).generate(PROMPT, SamplingParams(max_new_tokens=TOKENS, beams=beams)))
    return _Run(tokens, logits)


def selftest(kind: str, workdir: Path, gpu: int = 0,
             listed: Sequence[tuple[int | None, str | None]] | None = None) -> list[Check]:
    """Every check on `kind` ("cuda": GPU `gpu`; "emulated"), with models written under `workdir`; `listed`: the
    GPUs `tandem probe` reads (each one's `--gpu` number and PCI bus), for the numbering check."""
    threads = torch.get_num_threads()
    folder = write_test_model(workdir / "mixtral", tiny_config("mixtral", num_hidden_layers=3), seed=3)
    ckpt = open_checkpoint(folder)
    device = _Device(kind, gpu, ckpt)
    cpu = MoEModel.from_checkpoint(ckpt, ModelRun(torch.float32, CONTEXT, 2))
    reference, beams = _run(cpu), _run(cpu, beams=2)
    cpu.close()
    shaped = _Shaped(kind, workdir)
    checks = [_matches(device, reference), _beams(device, beams), _numerics(device, shaped, torch.bfloat16),
              _numerics(device, shaped, torch.float16), _fence(device), _slot_memory(device, shaped),
              _synchronisations(device), _synchronisations_by_kind(device, shaped, workdir),
              _batched_synchronisations(device, shaped), _memory(device), _reload(device),
              _numbering(device, listed)]
    now = torch.get_num_threads()
    checks.append(Check("thread count", now == threads, f"{threads} before, {now} after",
                        {"before": threads, "after": now}))
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
                 detail + (f"; differ: {', '.join(wrong)}" if wrong else ""),
                 {"configurations": 3 * len(CachePolicy) * 2, "largest_logit_difference": worst})


def _beams(device: _Device, reference: _Run) -> Check:
    model = device.model(OffloadOptions(Strategy.FIDDLER, 2), batch=2)
    try:
        run = _run(model, beams=2)
    finally:
        model.close()
    return Check("two beams match the CPU", run.tokens == reference.tokens, f"{len(run.tokens)} tokens",
                 {"tokens": len(run.tokens)})


def _numerics(device: _Device, shaped: _Shaped, dtype: torch.dtype) -> Check:
    """Teacher-forced logits of a real-shaped model on the device (a quarter of its experts there, the rest on the
    CPU) against the CPU alone, both in torch's plain products on the CPU (what the device computes, in the same
    dtype; the CPU's own kernels are finer on some CPUs, which would move either by the CPU's features): bf16
    against bf16; for fp16 (a GPU before Ampere) the CPU's experts in float32, against the CPU in float32. The device
    may differ from it by a quarter of what bf16 itself moves those logits from float32 at most (a bf16 sum of the
    experts, or logits rounded to bf16, move them about as much as bf16 does), and its logits must keep their
    float32 sums (not rounded to bf16)."""
    name = str(dtype).removeprefix("torch.")
    cpu_dtype = torch.float32 if dtype == torch.float16 else None
    ids = shaped.prompt(48, seed=1)[None]
    accel = device.accelerator(shaped.vram_gb())
    model = MoEModel.from_checkpoint(shaped.ckpt, ModelRun(dtype, CONTEXT, 1, cpu_dtype=cpu_dtype), accel,
                                     OffloadOptions(), PLAIN, None)
    layers = _Recorded(model.dispatcher)
    model.dispatcher = layers  # type: ignore[assignment]
    try:
        ours = model.forward(ids, 0)[0].float()  # [T, V] (its CPU experts in torch's products too: only the device
        # differs from the reference)
        placed = layers.cache.slots + len(layers.static)
    finally:
        model.close()
    on_cpu = {}
    roundoffs = 0.0
    for kind in {torch.float32, cpu_dtype or dtype}:
        cpu = MoEModel.from_checkpoint(shaped.ckpt, ModelRun(kind, CONTEXT, 1), None, None, PLAIN)
        try:
            on_cpu[kind] = cpu.forward(ids, 0)[0].float()
            if kind == (cpu_dtype or dtype):
                roundoffs = layers.roundoffs(cpu.dispatcher, dtype)
        finally:
            cpu.close()
    theirs = on_cpu[cpu_dtype or dtype]
    bf16_moves = 0.0
    if torch.bfloat16 in on_cpu:
        bf16_moves = (on_cpu[torch.bfloat16] - on_cpu[torch.float32]).abs().max().item()
    else:  # (fp16: against float32; bf16's own distance measured all the same)
        cpu = MoEModel.from_checkpoint(shaped.ckpt, ModelRun(torch.bfloat16, CONTEXT, 1), None, None, PLAIN)
        try:
            bf16_moves = (cpu.forward(ids, 0)[0].float() - theirs).abs().max().item()
        finally:
            cpu.close()
    agree = (ours.argmax(-1) == theirs.argmax(-1)).float().mean().item()
    exact = (ours == ours.to(torch.bfloat16).float()).float().mean().item()
    diff = (ours - theirs).abs().max().item()
    finite = bool(torch.isfinite(ours).all())
    ok = (finite and agree >= AGREE_LEAST and exact <= BF16_EXACT_MOST and diff <= CLOSER * bf16_moves
          and roundoffs <= LAYER_ROUNDOFFS)
    return Check(f"{name} on real expert shapes agrees with the CPU", ok,
                 f"top-1 agreement {agree:.3f} over {ids.shape[1]} positions, largest logit difference {diff:.4f} "
                 f"(bf16 moves the CPU's {bf16_moves:.4f}), {exact:.3f} of the logits exactly bf16, MoE layers off "
                 f"by {roundoffs:.3f} {name} roundoffs ({placed} expert slots)",
                 {"top1_agreement": round(agree, 4), "largest_logit_difference": round(diff, 5),
                  "bf16_moves_the_cpu": round(bf16_moves, 5), "logits_exactly_bf16": round(exact, 4),
                  "moe_layer_roundoffs": round(roundoffs, 4), "finite": finite, "slots": placed})


class _Recorded:
    """A dispatcher that keeps each MoE layer's input and output (on the host), to be run again on another."""

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher
        # (layer, its experts' input, the router's where it reads another, the output)
        self.seen: list[tuple[int, torch.Tensor, torch.Tensor | None, torch.Tensor]] = []
        self._started: dict[int, tuple[int, torch.Tensor, torch.Tensor | None]] = {}

    def __getattr__(self, name: str) -> object:
        return getattr(self.dispatcher, name)

    def start(self, layer: int, x: torch.Tensor, router_x: torch.Tensor | None = None) -> Pending:
        pending = self.dispatcher.start(layer, x, router_x)
        self._started[id(pending)] = (layer, x.cpu(), None if router_x is None else router_x.cpu())
        return pending

    def finish(self, pending: Pending) -> torch.Tensor:
        y = self.dispatcher.finish(pending)
        layer, x, router_x = self._started.pop(id(pending))
        self.seen.append((layer, x, router_x, y.float().cpu()))
        return y

    def roundoffs(self, other: Dispatcher, dtype: torch.dtype) -> float:
        """The worst layer's difference from `other`'s output on the same input, in units of `dtype`'s roundoff:
        each token's mean difference over its output's mean size, the median of the tokens. (The median: a token
        whose router logits sit on a near tie may pick another expert on other kernels, and differ by far more
        than any rounding; a sum rounded to the dtype moves every token.)"""
        if not self.seen:
            raise RuntimeError("no MoE layer passed through the recorded dispatcher")
        other.begin_step("prefill")
        worst = 0.0
        for layer, x, router_x, y in self.seen:
            theirs = other.finish(other.start(layer, x, router_x)).float()  # [T, H]
            per_token = (y - theirs).abs().mean(-1) / theirs.abs().mean(-1).clamp_min(1e-30)  # [T]
            worst = max(worst, per_token.median().item())
        return worst / torch.finfo(dtype).eps * 2  # eps is twice the roundoff


def _stall(accel: Accelerator, seconds: float) -> None:
    """Device work that occupies the stream for `seconds` (call it from submitted work): CUDA's spin kernel, the
    emulated stream's thread asleep."""
    if accel.device.type != "cuda":
        threading.Event().wait(seconds)
        return
    cycles = _cycles_per_second(accel.device)  # pragma: no cover - no GPU on test machines
    torch.cuda._sleep(int(cycles * seconds))  # pragma: no cover


_CYCLES: dict[torch.device, float] = {}


def _cycles_per_second(device: torch.device) -> float:  # pragma: no cover - no GPU on test machines
    """torch.cuda._sleep's cycles a second on this GPU, measured once (its clock rises under load: measured warm)."""
    if device not in _CYCLES:
        with torch.cuda.device(device):
            torch.cuda._sleep(10_000_000)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(50_000_000)
            end.record()
            end.synchronize()
            _CYCLES[device] = 50_000_000 / (start.elapsed_time(end) / 1e3)
    return _CYCLES[device]


def _fence(device: _Device, size: int = 1024) -> Check:
    """A kernel that reads a slot only after FENCE_S of device time, with a copy of other values into the slot
    queued meanwhile: it must see the old values (the copy waits for it), where a copy that did not wait would have
    long landed."""
    accel = device.accelerator(vram_gb=2 * size * size * 4 / GIB)  # a budget of its own: the slot, twice
    try:
        slot = accel.empty((size, size), torch.float32, "the fenced slot")
        accel.copy_async([slot], [torch.full((size, size), 1.0)]).result()  # (the copier, warmed up)

        def kernel() -> torch.Tensor:
            _stall(accel, FENCE_S)
            return slot.mean()

        read = accel.submit(kernel)
        accel.copy_async([slot], [torch.full((size, size), 2.0)])
        seen = accel.download(lambda: (read.result(),)).wait()[0].item()
    finally:
        accel.close()
    return Check("a slot is not overwritten while a kernel reads it", abs(seen - 1.0) < 1e-6,
                 f"the kernel read {seen:.3f} (1: the old weights; 2: the copy did not wait)", {"read": seen})


def _slot_memory(device: _Device, shaped: _Shaped) -> Check:
    """The real-shaped model with a quarter of its experts in slots: the device memory the load takes against the
    budget (CUDA: what the allocator reserves), and how many allocations the slots took."""
    cuda = device.cuda
    if cuda:  # pragma: no cover - no GPU on test machines
        release_device_memory()
        base = torch.cuda.memory_reserved(device.gpu_index)
    accel = device.accelerator(shaped.vram_gb())
    before = accel.allocations
    model = MoEModel.from_checkpoint(shaped.ckpt, ModelRun(torch.bfloat16, CONTEXT, 1), accel, OffloadOptions())
    try:
        dispatcher = model.dispatcher
        slots = len(dispatcher.slot_buffers)
        slab_most = 1 + math.ceil(slots * shaped.expert / SLAB_BYTES)  # (the scratch expert's slab, then the slots')
        taken = torch.cuda.memory_reserved(device.gpu_index) - base if cuda else accel.used
        allocations = accel.allocations - before
        expert_allocations = len({t.untyped_storage().data_ptr() for w in [dispatcher.scratch,
                                  *dispatcher.slot_buffers] for t in w.tensors()})
    finally:
        model.close()
    ok = taken <= accel.budget and expert_allocations <= slab_most
    return Check("the expert slots' memory fits the budget", ok,
                 f"{taken / 2**20:.1f} MiB of a {accel.budget / 2**20:.1f} MiB budget for {slots} slots of "
                 f"{shaped.expert / 2**20:.2f} MiB, in {expert_allocations} allocations ({allocations} in all)",
                 {"taken": taken, "budget": accel.budget, "slots": slots, "expert_bytes": shaped.expert,
                  "slot_allocations": expert_allocations, "allocations": allocations})


@contextmanager
def _counted_syncs(accel: Accelerator) -> Iterator[Callable[[], int]]:
    """Host synchronisations inside, as CUDA has them: on CUDA the sync debug mode's warnings of implicit ones plus
    the accelerator's own host reads; on the emulated device its own count without its joins (where its host plays
    the dense layers' stream and waits, CUDA orders two streams on the device)."""
    before = accel.syncs - accel.joins
    if accel.device.type != "cuda":
        yield lambda: accel.syncs - accel.joins - before
        return
    with warnings.catch_warnings(record=True) as seen:  # pragma: no cover - no GPU on test machines
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield lambda: accel.syncs - before + sum("synchroniz" in str(w.message) for w in seen)
        finally:
            torch.cuda.set_sync_debug_mode("default")


def _sync_bound(moe_layers: int, reads_a_layer: int = 1) -> int:
    """Host synchronisations a decode step may take: its reads a MoE layer and the logits'."""
    return reads_a_layer * moe_layers + 1


def _per_moe_layer(per_step: float, moe_layers: int) -> float:
    """A step's synchronisations beside the logits' read, per MoE layer."""
    return round((per_step - 1) / moe_layers, 3)


def _decode_syncs(model: MoEModel, prompt: list[int]) -> tuple[float, int]:
    """Host synchronisations per decode step over TOKENS steps, and the steps."""
    accel = model.accel
    assert accel is not None
    steps = Engine(model, ()).generate(prompt, SamplingParams(max_new_tokens=TOKENS + 1))
    next(steps)  # the prefill
    with _counted_syncs(accel) as count:
        decoded = sum(1 for _ in steps)
        per_step = count() / max(1, decoded)
    return per_step, decoded


def _synchronisations(device: _Device) -> Check:
    model = device.model(OffloadOptions(Strategy.CPU, 2))
    try:
        per_step, decoded = _decode_syncs(model, PROMPT)
        bound = _sync_bound(model.cfg.num_moe_layers)
    finally:
        model.close()
    moe = model.cfg.num_moe_layers
    return Check("host synchronisations per decode step", per_step <= bound,
                 f"{per_step:.1f} a step over {decoded} steps ({moe} MoE layers; at most {bound}: one a MoE layer and "
                 "the logits')", {"per_step": per_step, "per_moe_layer": _per_moe_layer(per_step, moe),
                                  "bound": bound, "moe_layers": moe})


def _synchronisations_by_kind(device: _Device, shaped: _Shaped, workdir: Path) -> Check:
    """Decode steps with each kind of expert weights in the device's slots: bf16 tensors, GGUF blocks (`--quant
    q4_k`, dequantized on the device), MXFP4 (gpt-oss's, dequantized on the device)."""
    from tandem.runtime.quant_cache import cache_path

    mxfp4 = write_test_model(workdir / "gpt_oss-mxfp4", tiny_config(
        "gpt_oss", num_hidden_layers=2, intermediate_size=64, quantization_config={"quant_method": "mxfp4"}), seed=3)
    kinds = {"bf16": (shaped.ckpt, CpuOptions(resident=True), torch.bfloat16),
             "GGUF blocks": (shaped.ckpt, CpuOptions(resident=True, quant="q4_k"), torch.bfloat16),
             "MXFP4": (open_checkpoint(mxfp4), CpuOptions(resident=True), torch.bfloat16)}
    figures: dict[str, float | int | str | None] = {}
    wrong = []
    for name, (ckpt, cpu, dtype) in kinds.items():
        budget = shaped.vram_gb() if ckpt is shaped.ckpt else 1.0
        model = MoEModel.from_checkpoint(ckpt, ModelRun(dtype, CONTEXT, 1), device.accelerator(budget),
                                         OffloadOptions(), cpu)
        try:
            prompt = [(7 * i + 3) % ckpt.config.vocab_size for i in range(12)]
            per_step, _ = _decode_syncs(model, prompt)
            moe = model.cfg.num_moe_layers
            bound = _sync_bound(moe)
        finally:
            model.close()
            if cpu.quant is not None:
                cache_path(ckpt, cpu.quant).unlink(missing_ok=True)  # (the quantized copy: this check's alone)
        figures[name] = per_step
        figures[f"{name} bound"] = bound
        figures[f"{name} per MoE layer"] = _per_moe_layer(per_step, moe)
        if per_step > bound:
            wrong.append(name)
    detail = ", ".join(f"{k} {figures[k]:.1f} (at most {figures[f'{k} bound']})" for k in kinds)
    return Check("host synchronisations per decode step for every kind of expert weights", not wrong,
                 detail + (f"; too many: {', '.join(wrong)}" if wrong else ""), figures)


def _batched_synchronisations(device: _Device, shaped: _Shaped) -> Check:
    """A batched pass (`tandem batch`, `serve`) of two sequences in two micro-batches: one host read per MoE layer
    and micro-batch, and the logits'."""
    accel = device.accelerator(shaped.vram_gb(batch=2))
    model = MoEModel.from_checkpoint(shaped.ckpt, ModelRun(torch.bfloat16, CONTEXT, 2, cpu_dtype=None, ragged=True),
                                     accel, OffloadOptions(), CpuOptions(resident=True), None)
    model.micro_batches = 2
    try:
        model.forward_rows(shaped.prompt(16, seed=2), [Segment(0, 0, 8), Segment(1, 0, 8)], phase="prefill")
        with _counted_syncs(accel) as count:
            model.forward_rows(torch.tensor([7, 9]), [Segment(0, 8, 1), Segment(1, 8, 1)])
            syncs = count()
        bound = _sync_bound(model.cfg.num_moe_layers, reads_a_layer=2)
    finally:
        model.close()
    return Check("host synchronisations per batched pass", syncs <= bound,
                 f"{syncs} for two sequences in two micro-batches (at most {bound})", {"syncs": syncs, "bound": bound})


def _memory(device: _Device) -> Check:
    """A prompt as long as the context allows (the longest prefill) within the budget: what the device's
    allocator reserves (CUDA), or what the accelerator accounted (emulated)."""
    cuda = device.cuda
    if cuda:  # pragma: no cover - no GPU on test machines
        release_device_memory()
        torch.cuda.reset_peak_memory_stats(device.gpu_index)
        base = torch.cuda.memory_reserved(device.gpu_index)
    model = device.model(OffloadOptions(Strategy.FIDDLER, 2))
    accel = model.accel
    assert accel is not None
    budget = accel.budget
    try:
        prompt = [(7 * i) % model.cfg.vocab_size for i in range(CONTEXT - 1)]
        list(Engine(model, ()).generate(prompt, SamplingParams(max_new_tokens=1)))
        peak = torch.cuda.max_memory_reserved(device.gpu_index) - base if cuda else accel.used
    except ResourceError as e:
        return Check("memory at a full-context prefill", False, str(e))
    finally:
        model.close()
    return Check("memory at a full-context prefill", peak <= budget,
                 f"{peak / 2**20:.1f} MiB of a {budget / 2**20:.1f} MiB budget", {"peak": peak, "budget": budget})


def _reload(device: _Device) -> Check:
    """On a GPU the budget is all its free memory, as without --vram-gb: the second load must find what the first
    held given back (within what the CUDA context itself may take meanwhile)."""
    cuda = device.cuda
    budgets = []
    for _ in range(2):
        accel = device.accelerator(None if cuda else device.vram_gb)
        model = MoEModel.from_checkpoint(device.ckpt, ModelRun(torch.float32, CONTEXT, 1), accel, OffloadOptions())
        budgets.append(accel.budget)
        list(Engine(model, ()).generate(PROMPT, SamplingParams(max_new_tokens=2)))
        model.close()
        del model, accel
        release_device_memory()
    slack = 64 * 2**20 if cuda else 0
    return Check("load, close, load again: the same budget", abs(budgets[0] - budgets[1]) <= slack,
                 f"{budgets[0] / 2**20:.1f} then {budgets[1] / 2**20:.1f} MiB", {"first": budgets[0],
                                                                                 "second": budgets[1]})


def _numbering(device: _Device, listed: Sequence[tuple[int | None, str | None]] | None) -> Check:
    """`--gpu N` and `tandem probe`'s `--gpu N` are one GPU: `listed` is what the probe reads from NVML (each GPU's
    `--gpu` number and PCI bus, app/cli/main.py passes it; this floor does not import the tuner's)."""
    name = "--gpu numbers the GPUs as tandem probe does"
    if not device.cuda:
        return Check(name, True, "no GPU here: nothing to number")
    if listed is None:  # pragma: no cover - no GPU on test machines
        return Check(name, True, "no probe reading given: not checked")
    from tandem.runtime.accelerator import parse_bus_id  # pragma: no cover

    ours = cuda_devices()[device.gpu]  # pragma: no cover
    bus = next((b for n, b in listed if n == device.gpu), None)  # pragma: no cover
    ok = bus is not None and parse_bus_id(bus) == ours.pci  # pragma: no cover
    seen = "none" if bus is None else f"bus {bus}"  # pragma: no cover
    return Check(name, ok, f"--gpu {device.gpu}: PyTorch's device {ours.index} on bus {ours.pci}; tandem probe: "
                 f"{seen}", {"gpu": device.gpu, "torch_index": ours.index, "probe_bus": bus})  # pragma: no cover
