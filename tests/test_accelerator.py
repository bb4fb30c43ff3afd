"""The accelerator abstraction: budget accounting, the copy engine, selection by `--accelerator`."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from tandem.kernels.errors import ResourceError
from tandem.runtime.accelerator import EmulatedAccelerator, make_accelerator, nbytes


def test_budget_is_enforced_and_accounted() -> None:
    accel = EmulatedAccelerator(budget=1000)
    a = accel.empty((100,), torch.float32, "a")  # 400 bytes
    assert accel.used == 400 and a.numel() == 100
    with pytest.raises(ResourceError, match="budget"):
        accel.empty((200,), torch.float32, "too big")  # 800 more would exceed 1000
    assert accel.used == 400
    accel.close()


def test_place_converts_and_counts_bytes() -> None:
    accel = EmulatedAccelerator(budget=10_000)
    w = accel.place(torch.ones(10, 10, dtype=torch.float32), torch.bfloat16, "w")
    assert w.dtype == torch.bfloat16 and accel.used == 200 and accel.bytes_h2d == 200
    accel.close()


def test_copy_engine_runs_in_the_background_and_counts_bytes() -> None:
    accel = EmulatedAccelerator(budget=10**6, copy_delay_s=0.2)
    dst = accel.empty((256,), torch.float32, "slot")
    src = torch.arange(256, dtype=torch.float32)
    fut = accel.copy_async([dst], [src])
    assert not fut.done()  # the caller is not blocked by the copy
    fut.result(timeout=60)
    assert torch.equal(dst, src) and accel.bytes_h2d == nbytes(dst)
    accel.close()


def test_copies_run_on_their_own_thread() -> None:
    accel = EmulatedAccelerator(budget=10**6)
    seen: list[str] = []
    accel.submit(lambda: seen.append(threading.current_thread().name)).result()
    assert seen and seen[0] != threading.current_thread().name
    accel.close()


def test_the_side_threads_use_one_core_and_leave_every_other_thread_alone() -> None:
    def count_on_a_new_thread() -> int:
        seen: list[int] = []
        thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        thread.start()
        thread.join()
        return seen[0]

    cores = torch.get_num_threads()
    assert cores > 1 or (os.cpu_count() or 1) == 1  # more than one, or the test could not tell the counts apart
    accel = EmulatedAccelerator(budget=10**6)
    accel.copy_async([accel.empty((4,), torch.float32, "slot")], [torch.ones(4)]).result(timeout=60)  # copier up
    assert accel.submit(torch.get_num_threads).result() == 1  # the emulated device's stream: one core
    assert accel._copier.submit(torch.get_num_threads).result() == 1  # the copy engine: one core
    assert count_on_a_new_thread() == cores and torch.get_num_threads() == cores  # (the chat app's workers)
    accel.close()


def test_activation_shipping_is_counted() -> None:
    accel = EmulatedAccelerator(budget=10**6)
    x = torch.ones(4, 8)
    accel.to_device(accel.to_host(x))
    assert accel.bytes_d2h == accel.bytes_h2d == nbytes(x)
    accel.close()


def test_selection() -> None:
    assert make_accelerator("none", None) is None
    if not torch.cuda.is_available():
        assert make_accelerator("auto", 8) is None  # auto: CPU only without a usable GPU
        with pytest.raises(ResourceError, match="no usable CUDA device"):
            make_accelerator("cuda", None)
    with pytest.raises(ResourceError, match="--vram-gb"):
        make_accelerator("emulated", None)
    accel = make_accelerator("emulated", 0.5)
    assert isinstance(accel, EmulatedAccelerator) and accel.budget == 512 * 1024**2
    accel.close()


def test_device_work_runs_apart_from_the_host_in_stream_order() -> None:
    accel = EmulatedAccelerator(budget=10**6)
    gate = threading.Event()
    order: list[int] = []
    first = accel.submit(lambda: (gate.wait(60), order.append(1)))
    second = accel.submit(lambda: order.append(2))
    assert not first.done() and not second.done()  # the host was not held up by either
    gate.set()
    accel.join(second)
    assert order == [1, 2] and accel.syncs == 1  # joined once, in the order submitted
    accel.close()


def test_a_host_read_waits_behind_queued_work_and_is_one_synchronisation() -> None:
    accel = EmulatedAccelerator(budget=10**6)
    t = torch.zeros(4)
    accel.submit(lambda: t.add_(1))
    read = accel.download(lambda: (t, t * 2))
    host, doubled = read.wait()
    assert torch.equal(host, torch.ones(4)) and torch.equal(doubled, torch.full((4,), 2.0))
    assert accel.syncs == 1 and accel.bytes_d2h == 2 * nbytes(t)
    accel.close()


def test_the_stream_waits_for_a_copy_and_the_host_does_not() -> None:
    accel = EmulatedAccelerator(budget=10**6, copy_delay_s=0.3)
    slot = accel.empty((64,), torch.float32, "slot")
    copy = accel.copy_async([slot], [torch.arange(64, dtype=torch.float32)], demand=True)
    seen = accel.submit(lambda: slot.clone(), after=(copy,))
    assert not copy.done() and not seen.done()  # the host went on at once
    assert torch.equal(accel.join(seen), torch.arange(64, dtype=torch.float32))  # the kernel saw the copy
    assert accel.syncs == 1
    accel.close()


def test_a_slot_is_not_overwritten_while_queued_work_reads_it() -> None:
    """The fence: a copy into a slot starts only after the device work queued before it, which may still read the
    slot's old expert."""
    accel = EmulatedAccelerator(budget=10**6)
    slot = accel.empty((64,), torch.float32, "slot")
    slot.fill_(1.0)
    reading = threading.Event()
    release = threading.Event()

    def kernel() -> torch.Tensor:  # reads the slot slowly
        reading.set()
        release.wait(60)
        return slot.clone()

    read = accel.submit(kernel)
    assert reading.wait(60)
    copy = accel.copy_async([slot], [torch.full((64,), 2.0)])
    threading.Event().wait(0.2)
    assert not copy.done() and torch.equal(slot, torch.ones(64))  # held back by the kernel still reading
    release.set()
    assert torch.equal(accel.join(read), torch.ones(64))
    copy.result(timeout=60)
    assert torch.equal(slot, torch.full((64,), 2.0))
    accel.close()


def test_a_demand_copy_is_not_queued_behind_post_fetches() -> None:
    accel = EmulatedAccelerator(budget=10**7, copy_delay_s=0.3)
    slots = [accel.empty((64,), torch.float32, f"slot {i}") for i in range(4)]
    background = [accel.copy_async([s], [torch.ones(64)]) for s in slots[:3]]  # 0.9 s of copies in a row
    demand = accel.copy_async([slots[3]], [torch.ones(64)], demand=True)
    demand.result(timeout=60)
    assert not background[-1].done()  # the demand copy finished first
    for copy in background:
        copy.result(timeout=60)
    accel.close()


def test_running_out_of_device_memory_is_a_resource_error(monkeypatch: pytest.MonkeyPatch) -> None:
    accel = EmulatedAccelerator(budget=10**6)

    def no_memory(*args: object, **kwargs: object) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(torch, "empty", no_memory)
    with pytest.raises(ResourceError, match="ran out of memory for the KV cache"):
        accel.empty((16,), torch.float32, "the KV cache")
    assert accel.used == 0  # nothing held for the failed allocation
    accel.close()


def test_the_budget_is_checked_before_the_device_is_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    accel = EmulatedAccelerator(budget=100)
    asked: list[object] = []
    monkeypatch.setattr(torch, "empty", lambda *a, **k: asked.append(a))
    with pytest.raises(ResourceError, match="budget"):
        accel.empty((1000,), torch.float32, "too big")
    assert not asked
    accel.close()


def test_gpus_are_numbered_by_pci_bus_as_nvidia_smi_does() -> None:
    from tandem.runtime.accelerator import CudaDevice, in_bus_order, parse_bus_id

    assert parse_bus_id("00000000:65:00.0") == (0, 0x65, 0) and parse_bus_id("0001:0a:1f.0") == (1, 10, 31)
    assert parse_bus_id("not a bus") is None and parse_bus_id("0000:01:00") is None
    fastest_first = [CudaDevice(0, (0, 0x41, 0), (8, 9)), CudaDevice(1, (0, 0x01, 0), (7, 5))]  # torch's order
    assert [d.index for d in in_bus_order(fastest_first)] == [1, 0]  # --gpu 0 is the one on bus 01: torch's 1
