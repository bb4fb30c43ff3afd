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
    fut.result(timeout=5)
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
    accel.copy_async([accel.empty((4,), torch.float32, "slot")], [torch.ones(4)]).result(timeout=5)  # copier up
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
