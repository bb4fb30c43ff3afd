"""The accelerator tier as a GPU runs it, checked on the emulated device: the same numbers as the CPU path (float32
sums for the logits, the attention's output and the experts' weighted sum), no host synchronisation hidden in
device-side dequantization or in a batched pass, the expert slots cut from a few allocations, and the host free to
run the CPU's experts while weights are still being copied."""

from __future__ import annotations

import math
import threading
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tandem.kernels.dense import DenseLinear
from tandem.kernels.matmul import linear
from tandem.runtime.accelerator import EmulatedAccelerator
from tandem.runtime.checkpoint import open_checkpoint
from tandem.runtime.dispatch import SLAB_BYTES, Dispatcher, OffloadOptions, Strategy
from tandem.runtime.engine import Engine
from tandem.runtime.expert_cache import ExpertCache
from tandem.runtime.model import ModelRun, MoEModel, Segment
from tandem.runtime.sampling import SamplingParams
from tandem.runtime.synth import tiny_config, write_test_model


def exactly_bf16(t: torch.Tensor) -> float:
    """The share of t's values that bf16 holds exactly."""
    return (t.to(torch.bfloat16).float() == t).float().mean().item()


def test_a_float32_product_of_bf16_inputs_keeps_its_float32_sums() -> None:
    """What a CUDA tensor takes through DenseLinear (torch's product): the result a float32 product of the same bf16
    inputs gives, not that result rounded to bf16."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 256, generator=g).to(torch.bfloat16)
    w = torch.randn(96, 256, generator=g).to(torch.bfloat16)
    bias = torch.randn(96, generator=g).to(torch.bfloat16)
    exact = x.float() @ w.float().t() + bias.float()
    for y in (linear(x, w, bias, torch.float32), DenseLinear(use_kernel=False)(x, w, bias, out_dtype=torch.float32)):
        assert y.dtype == torch.float32
        assert torch.allclose(y, exact, rtol=1e-6, atol=1e-5)
        assert exactly_bf16(y) < 0.2  # (rounded to bf16, every value would be)
    assert linear(x, w, None, torch.bfloat16).dtype == torch.bfloat16  # a bf16 result stays bf16


@pytest.fixture(scope="module")
def olmoe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = tiny_config("olmoe", num_hidden_layers=2, num_experts=16, num_experts_per_tok=8)
    return write_test_model(tmp_path_factory.mktemp("olmoe") / "m", cfg, seed=5, dtype=torch.bfloat16)


def load(folder: Path, accel: EmulatedAccelerator | None, policy: OffloadOptions | None = None,
         batch: int = 1) -> MoEModel:
    return MoEModel.from_checkpoint(open_checkpoint(folder), ModelRun(torch.bfloat16, 64, batch), accel, policy)


def every_expert(folder: Path) -> tuple[tuple[int, int], ...]:
    cfg = open_checkpoint(folder).config
    return tuple((layer, e) for layer in range(cfg.num_layers) for e in range(cfg.num_experts))


def test_bf16_logits_on_the_accelerator_are_not_rounded_to_bf16(olmoe: Path) -> None:
    model = load(olmoe, EmulatedAccelerator(1 << 30), OffloadOptions(static=every_expert(olmoe)))
    try:
        logits = model.forward(torch.tensor([[5, 17, 99, 3]]), 0)
    finally:
        model.close()
    assert logits.dtype == torch.float32 and exactly_bf16(logits) < 0.2


def test_the_accelerators_experts_are_summed_in_float32_with_float32_weights(olmoe: Path) -> None:
    """A top-8 layer's output on the device is the float32 sum of each chosen expert's output times its float32
    routing weight (a bf16 accumulator would round it eight times)."""
    from tandem.runtime.moe import route

    model = load(olmoe, EmulatedAccelerator(1 << 30), OffloadOptions(static=every_expert(olmoe)))
    dispatcher = model.dispatcher
    h = torch.randn(5, model.cfg.hidden_size, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    try:
        with torch.inference_mode():
            dispatcher.begin_step("prefill")
            out = dispatcher(0, h)
            block = dispatcher.blocks[0]
            weights, ids = route(dispatcher.linear(h, block.router, None), block.rule, block.correction)
            expected = torch.zeros(h.shape, dtype=torch.float32)
            for t in range(h.shape[0]):
                for k in range(ids.shape[1]):
                    expert = dispatcher.static[(0, int(ids[t, k]))]
                    expected[t] += expert(h[t : t + 1])[0].float() * weights[t, k]
    finally:
        model.close()
    assert weights.dtype == torch.float32 and ids.shape[1] == 8
    assert out.dtype == torch.float32
    assert torch.allclose(out, expected, rtol=1e-5, atol=1e-6)


def test_device_dequantization_builds_its_tables_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """MXFP4 and Q6_K dequantized on a device: a table made there from a list each call is a host copy the host
    waits for; made once per device, a second call makes none."""
    from tandem.kernels.blocks import FORMATS, dequantize
    from tandem.kernels.quant import quantize_mxfp4

    mx = quantize_mxfp4(torch.randn(32, 64))
    q6 = torch.randint(0, 256, (4, FORMATS["Q6_K"].nbytes), dtype=torch.uint8)
    q6[:, 208:210] = 0  # (a zero scale: finite values whatever the other bytes)
    mxb = torch.randint(0, 256, (4, FORMATS["MXFP4"].nbytes), dtype=torch.uint8)
    mxb[:, 0] = 120
    calls = [mx.dequantize(), dequantize(q6, "Q6_K"), dequantize(mxb, "MXFP4")]  # warm: the tables exist
    made: list[object] = []
    real = torch.tensor

    def counting(*args: object, **kwargs: object) -> torch.Tensor:
        made.append(args[:1])
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "tensor", counting)
    again = [mx.dequantize(), dequantize(q6, "Q6_K"), dequantize(mxb, "MXFP4")]
    assert not made
    assert all(torch.equal(a, b) for a, b in zip(calls, again, strict=True))


def test_a_batched_pass_builds_no_device_tensor_from_host_data(olmoe: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """forward_rows on an accelerator: its index of each segment's last token goes through the accelerator's own
    copy (pinned, without the host waiting), never `torch.tensor(..., device=...)`."""
    model = load(olmoe, EmulatedAccelerator(1 << 30), OffloadOptions(static=every_expert(olmoe)), batch=2)
    on_device: list[object] = []
    real = torch.tensor

    def watching(*args: object, **kwargs: object) -> torch.Tensor:
        if kwargs.get("device") is not None:
            on_device.append(kwargs["device"])
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "tensor", watching)
    try:
        logits = model.forward_rows(torch.tensor([5, 6, 7, 8, 9]), [Segment(0, 0, 3), Segment(1, 0, 2)])
    finally:
        model.close()
    assert logits.shape == (2, model.cfg.vocab_size) and not on_device


def test_the_expert_slots_are_cut_from_a_few_allocations(olmoe: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One allocation per SLAB_BYTES of slots, not one per tensor: the device's allocator rounds each allocation on
    its own (a fifth more than asked for tensors of 5.5 MiB), and the budget counts bytes."""
    cfg = open_checkpoint(olmoe).config
    monkeypatch.setattr("tandem.runtime.dispatch.SLAB_BYTES", 5 * 3 * cfg.hidden_size * cfg.moe_intermediate_size * 2)
    accel = EmulatedAccelerator(1 << 30)
    slabs: list[tuple[int, str]] = []
    real = accel.slab
    monkeypatch.setattr(accel, "slab", lambda size, what: slabs.append((size, what)) or real(size, what))
    model = load(olmoe, accel, OffloadOptions(static=every_expert(olmoe)))
    try:
        slots = model.dispatcher.slot_buffers
        assert len(slots) == 32 and len(model.dispatcher.static) == 32
        assert len(slabs) == 1 + math.ceil(32 / 5)  # the scratch buffer's, then the slots', five a slab
        tensors = [t for w in slots for t in w.tensors()]
        assert len({t.untyped_storage().data_ptr() for t in tensors}) == len(slabs) - 1
        assert all(t.is_contiguous() and t.data_ptr() % 64 == 0 for t in tensors)
        tokens = list(Engine(model, ()).generate([5, 17, 99], SamplingParams(max_new_tokens=4)))
    finally:
        model.close()
    cpu = load(olmoe, None)
    try:
        assert tokens == list(Engine(cpu, ()).generate([5, 17, 99], SamplingParams(max_new_tokens=4)))
    finally:
        cpu.close()
    assert SLAB_BYTES >= 1 << 20  # (the real slabs: large enough that the allocator's rounding is noise)


def test_the_host_is_held_by_a_copy_it_queues_work_behind_until_the_copy_is_queued() -> None:
    """CUDA's order, emulated: a stream can wait only for an event already recorded, so `submit(after=copy)` holds
    the host until the copier has queued the copy; with both staging buffers in use, that is until the copy before
    them has run (here: behind a kernel still running)."""
    accel = EmulatedAccelerator(budget=10**6)
    gate = threading.Event()
    slot = accel.empty((3, 64), torch.float32, "slot")
    accel.submit(lambda: gate.wait(60))  # a kernel that runs until the gate opens
    copy = accel.copy_async(list(slot), [torch.full((64,), float(i)) for i in range(3)], demand=True)
    held = threading.Event()
    thread = threading.Thread(target=lambda: (accel.submit(lambda: None, after=(copy,)), held.set()))
    thread.start()
    assert not held.wait(0.3)  # the third tensor waits for a staging buffer, whose copy waits for the kernel
    gate.set()
    assert held.wait(60)
    thread.join()
    copy.result(timeout=60)
    assert torch.equal(slot, torch.arange(3, dtype=torch.float32)[:, None].expand(3, 64))
    accel.close()


def test_the_cpu_experts_run_while_the_fetched_experts_are_still_being_copied(
        olmoe: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer with experts on both tiers and one fetched: its CPU experts start before the fetched expert's copy is
    even queued (the device's share that waits for copies is queued after them). The copy engine is held until the
    CPU experts have started, so the other order would wait out the gate's time-out and fail."""
    gate = threading.Event()
    dma = EmulatedAccelerator._dma

    def held_dma(self: EmulatedAccelerator, *args: object) -> None:
        gate.wait(10)
        dma(self, *args)  # type: ignore[arg-type]

    accel = EmulatedAccelerator(1 << 30)
    cfg = open_checkpoint(olmoe).config
    model = load(olmoe, accel, OffloadOptions(Strategy.FIDDLER, cache_ways=cfg.num_experts))
    dispatcher = model.dispatcher
    seen: list[bool] = []
    run_many = dispatcher.executor.run_many

    def cpu_experts(*args: object, **kwargs: object) -> None:
        seen.append(bool(fetched) and fetched[0].future.done())  # was the fetched copy queued already?
        gate.set()
        run_many(*args, **kwargs)  # type: ignore[arg-type]

    fetched: list[object] = []
    copy_async = accel.copy_async

    def watched_copy(dst: list[torch.Tensor], src: list[torch.Tensor], demand: bool = False) -> object:
        copy = copy_async(dst, src, demand)
        if demand:
            fetched.append(copy)
        return copy

    try:
        h = torch.randn(4, cfg.hidden_size, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
        with torch.inference_mode():
            dispatcher.begin_step("prefill")
            dispatcher(0, h)  # warm: these experts post-fetched into the layer's slots
            dispatcher.cache.wait_all()
            monkeypatch.setattr(EmulatedAccelerator, "_dma", held_dma)
            monkeypatch.setattr(accel, "copy_async", watched_copy)
            monkeypatch.setattr(dispatcher.executor, "run_many", cpu_experts)
            misses = iter(range(100))
            monkeypatch.setattr(dispatcher, "_should_fetch", lambda tokens: next(misses) == 0)  # the first miss
            h2 = torch.randn(4, cfg.hidden_size, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
            out = dispatcher(0, torch.cat([h[:1], h2[1:]]))  # token 0 hits; the others miss
        stats = dispatcher.stats.per_layer[0]
    finally:
        gate.set()
        model.close()
    assert stats[0] > 0 and stats[1] > 0 and stats[2] == 1  # device, CPU and one fetched expert
    assert seen == [False] and out.dtype == torch.float32


def test_a_slot_whose_copy_fails_to_start_is_given_back_empty(olmoe: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A slot is claimed (its key set) before its copy starts: if anything fails in between, the slot must not look
    ready with the evicted expert's weights under the new expert's name."""
    cfg = open_checkpoint(olmoe).config
    accel = EmulatedAccelerator(1 << 30)
    model = load(olmoe, accel, OffloadOptions(Strategy.FETCH, cache_ways=2))
    dispatcher = model.dispatcher
    h = torch.randn(1, cfg.hidden_size, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)

    def refused(*args: object, **kwargs: object) -> None:
        raise MemoryError("no memory for the dequantized copy")

    try:
        with torch.inference_mode():
            dispatcher.begin_step("prefill")
            monkeypatch.setattr(dispatcher, "_source", refused)
            with pytest.raises(MemoryError):
                dispatcher(0, h)
            monkeypatch.undo()
            cache: ExpertCache = dispatcher.cache
            assert all(s.key is None and s.copy is None for s in cache.sets[cache.index_of[0]])
            assert not cache.resident()
    finally:
        model.close()


def test_a_started_layers_copied_experts_keep_their_slots_until_queued(olmoe: Path) -> None:
    """A pipelined pass starts a layer for one micro-batch, then for another, then finishes both: the first's
    fetched expert waits in its slot, queued only at `finish`, and no copy for the second may take that slot."""
    cfg = open_checkpoint(olmoe).config
    accel = EmulatedAccelerator(1 << 30)
    model = load(olmoe, accel, OffloadOptions(Strategy.FETCH, cache_ways=cfg.top_k))
    dispatcher = model.dispatcher
    g = torch.Generator().manual_seed(6)
    try:
        with torch.inference_mode():
            dispatcher.begin_step("prefill")
            a, b = (torch.randn(1, cfg.hidden_size, generator=g).to(torch.bfloat16) for _ in range(2))
            ref_a, ref_b = (load_cpu_layer(olmoe, x) for x in (a, b))
            first = dispatcher.start(0, a)
            assert first.later is not None and dispatcher._held  # its 8 fetched experts fill the layer's 8 slots
            dispatcher.cache.wait_all()  # their copies done: only the hold keeps them from being evicted
            second = dispatcher.start(0, b)  # none of its misses may evict them: through the scratch buffer
            dispatcher.cache.wait_all()  # (a copy into one of them would have landed by now)
            out_a, out_b = dispatcher.finish(first), dispatcher.finish(second)
            assert not dispatcher._held
    finally:
        model.close()
    assert torch.allclose(out_a, ref_a, atol=2e-2, rtol=2e-2) and torch.allclose(out_b, ref_b, atol=2e-2, rtol=2e-2)


def load_cpu_layer(folder: Path, h: torch.Tensor) -> torch.Tensor:
    cpu = load(folder, None)
    try:
        with torch.inference_mode():
            cpu.dispatcher.begin_step("prefill")
            return cpu.dispatcher(0, h)
    finally:
        cpu.close()



def test_when_every_expert_fits_each_is_placed_once_at_load(olmoe: Path) -> None:
    """A budget that holds every expert: all of them placed at load (no cache to warm up, no miss, no copy)."""
    accel = EmulatedAccelerator(1 << 30)
    model = load(olmoe, accel)
    try:
        dispatcher = model.dispatcher
        assert set(dispatcher.static) == set(every_expert(olmoe)) and dispatcher.cache.slots == 0
        copied = accel.bytes_h2d
        list(Engine(model, ()).generate([5, 17, 99], SamplingParams(max_new_tokens=4)))
        gpu, cpu, fetched = dispatcher.request_stats().per_layer.sum(0)
    finally:
        model.close()
    assert gpu > 0 and cpu == fetched == 0
    assert accel.bytes_h2d - copied < 4096  # token ids and index rows only: no weights


def test_when_every_expert_is_on_the_device_a_decode_step_reads_the_host_once(
        olmoe: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every expert static: each layer picks its token's experts on the device (no host read a layer); the step's
    one read is its logits, and the routings reach the trace and the statistics behind it, as on the CPU."""
    from tandem.runtime.accelerator import HostRead

    reads: list[int] = []
    wait = HostRead.wait
    monkeypatch.setattr(HostRead, "wait", lambda self: reads.append(1) or wait(self))  # type: ignore[func-returns-value]
    accel = EmulatedAccelerator(1 << 30)
    model = load(olmoe, accel)
    cpu = load(olmoe, None)
    try:
        assert set(model.dispatcher._stacked) == {0, 1}
        steps = Engine(model, ()).generate([5, 17, 99, 4], SamplingParams(max_new_tokens=7))
        first = [next(steps)]
        reads.clear()
        tokens = first + list(steps)
        per_step = len(reads) / 6
        expected = list(Engine(cpu, ()).generate([5, 17, 99, 4], SamplingParams(max_new_tokens=7)))
        ours, theirs = model.dispatcher, cpu.dispatcher
        stats = ours.request_stats()
        assert per_step == 1
        assert tokens == expected
        assert (ours.recorder.decode == theirs.recorder.decode).all()
        assert (ours.recorder.prefill == theirs.recorder.prefill).all()
        assert [s.tolist() for s in ours.recorder.sequence] == [s.tolist() for s in theirs.recorder.sequence]
        assert stats.hits == stats.per_layer[:, 0].sum() > 0 and stats.misses == 0
    finally:
        model.close()
        cpu.close()


def test_a_few_tokens_run_a_layers_resident_experts_as_one_batched_product(
        olmoe: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two beams (two tokens a pass) with the experts in cache slots: the resident ones run together
    (`_device_group`), not one by one, and the answer is the CPU's."""
    cfg = open_checkpoint(olmoe).config
    one_by_one: list[int] = []
    real = Dispatcher._device_expert
    monkeypatch.setattr(Dispatcher, "_device_expert",
                        staticmethod(lambda *args: one_by_one.append(1) or real(*args)))  # type: ignore[func-returns-value]
    accel = EmulatedAccelerator(1 << 30)
    model = MoEModel.from_checkpoint(open_checkpoint(olmoe), ModelRun(torch.float32, 64, 2), accel,
                                     OffloadOptions(Strategy.FETCH, cache_ways=cfg.num_experts))
    cpu = MoEModel.from_checkpoint(open_checkpoint(olmoe), ModelRun(torch.float32, 64, 2))
    params = SamplingParams(max_new_tokens=6, beams=2)
    try:
        list(Engine(model, ()).generate([5, 17, 99], params))  # the slots fill
        model.dispatcher.cache.wait_all()
        one_by_one.clear()
        tokens = list(Engine(model, ()).generate([5, 17, 99], params))
        assert tokens == list(Engine(cpu, ()).generate([5, 17, 99], params))
    finally:
        model.close()
        cpu.close()
    assert not one_by_one


def test_a_token_that_did_not_choose_an_expert_takes_nothing_from_it_even_if_it_is_not_finite() -> None:
    from tandem.runtime.accelerator import done
    from tandem.runtime.moe import ExpertWeights

    g = torch.Generator().manual_seed(7)
    experts = [ExpertWeights(*(torch.randn(*s, generator=g) * 0.1 for s in ((8, 16), (8, 16), (16, 8))))
               for _ in range(2)]
    x = torch.randn(2, 16, generator=g)
    x[1] = float("inf")  # token 1's products are not finite; it chose neither expert
    share = torch.tensor([[0.7, 0.0], [0.3, 0.0]])
    out = Dispatcher._device_group(done(torch.zeros(2, 16)), experts, x, share)
    expected = 0.7 * experts[0](x[:1]) + 0.3 * experts[1](x[:1])
    assert torch.isfinite(out).all() and torch.equal(out[1], torch.zeros(16))
    assert torch.allclose(out[:1], expected, atol=1e-6)


class _CountOps(TorchDispatchMode):
    """Counts the torch operations that would launch a kernel on a GPU (views and allocations do not)."""

    FREE = frozenset({"empty", "empty_strided", "detach", "alias", "lift_fresh", "_local_scalar_dense"})

    def __init__(self, seen: list[str]) -> None:
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        if not func.is_view and func.overloadpacket.__name__ not in self.FREE:
            self.seen.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_a_decode_token_launches_a_few_dozen_device_operations_a_layer(olmoe: Path) -> None:
    """A GPU decoding is bound by the kernels the host launches (docs/bench/gpu: ~680 a token for a 4-layer top-8
    model, 11-14 us each). Every expert on the device, one token: the operations of a step, on the host and on the
    emulated device's stream, stay within 50 a layer (expert by expert they were 164)."""
    accel = EmulatedAccelerator(1 << 30)
    model = load(olmoe, accel)
    seen: list[str] = []
    modes = [_CountOps(seen), _CountOps(seen)]
    try:
        steps = Engine(model, ()).generate([5, 17, 99, 4], SamplingParams(max_new_tokens=5))
        next(steps)
        accel.submit(modes[1].__enter__).result()  # (a mode is per thread: the stream's own)
        with modes[0]:
            decoded = sum(1 for _ in steps)
        accel.submit(lambda: modes[1].__exit__(None, None, None)).result()
    finally:
        model.close()
    assert decoded == 4 and len(seen) / decoded / model.cfg.num_layers <= 50
