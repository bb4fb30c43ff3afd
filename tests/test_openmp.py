"""A thread done with a load or an answer gives its OpenMP workers back (kernels/openmp.py): libgomp lets waiting
workers spin only while it manages no more threads than there are CPUs, and a thread that loaded a model and stayed
(the chat app's, a server's) would otherwise keep one that slows every other thread's kernels."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch

from tandem.autotune.configure import load_model
from tandem.kernels.openmp import release_thread_pool
from tandem.runtime.sampling import SamplingParams


def _tasks() -> int:
    return len(os.listdir("/proc/self/task"))


def _in_a_thread(fn) -> dict:
    out: dict = {}

    def run() -> None:
        try:
            out.update(fn())
        except BaseException as e:  # (seen by the test's thread)
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out


def _parallel_region() -> None:
    """Torch work that runs a parallel region on this thread (its workers start if it has none)."""
    a = torch.randn(512, 512)
    for _ in range(3):
        a = torch.tanh(a @ a / 512)


needs = pytest.mark.skipif(not Path("/proc/self/task").is_dir() or (os.cpu_count() or 1) < 2,
                           reason="needs Linux's /proc and two CPUs")


@needs
def test_release_gives_a_threads_workers_back() -> None:
    def run() -> dict:
        _parallel_region()
        with_workers = _tasks()
        released = release_thread_pool()
        return {"released": released, "with": with_workers, "without": _tasks()}

    got = _in_a_thread(run)
    if not got["released"]:
        pytest.skip("this OpenMP runtime cannot give its workers back")
    assert got["without"] < got["with"]


@needs
def test_a_thread_that_loaded_or_answered_keeps_no_workers(mixtral_dir: Path) -> None:
    """After a load and after an answer the thread holds no worker: a parallel region run next starts them again
    (more tasks), and giving them back returns to the count the answer left."""
    if not _in_a_thread(lambda: {"ok": release_thread_pool()})["ok"]:
        pytest.skip("this OpenMP runtime cannot give its workers back")

    def run() -> dict:
        loaded = load_model(mixtral_dir, dtype="fp32", threads=2)
        after_load = _tasks()
        _parallel_region()
        load_kept_none = _tasks() > after_load
        release_thread_pool()
        list(loaded.engine.generate([1, 2, 3, 4], SamplingParams(max_new_tokens=4)))
        after_answer = _tasks()
        _parallel_region()
        answer_kept_none = _tasks() > after_answer
        release_thread_pool()
        loaded.model.close()
        return {"load": load_kept_none, "answer": answer_kept_none}

    assert _in_a_thread(run) == {"load": True, "answer": True}
