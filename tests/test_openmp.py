"""A thread done with a load or an answer gives its OpenMP workers back (kernels/openmp.py): libgomp lets waiting
workers spin only while it manages no more threads than there are CPUs, and a thread that loaded a model and stayed
(the chat app's, a server's) would otherwise keep one that slows every other thread's kernels.

Workers are seen as the process's threads (their ids in /proc/self/task): a parallel region that finds none starts
new ones, one that finds them kept starts none."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from tandem.kernels.openmp import WAIT_SPINS, release_thread_pool, wait_environment
from tandem.runtime.loader import load_model
from tandem.runtime.sampling import SamplingParams

PROMPT = [1, 2, 3, 4]


def _threads() -> set[str]:
    return set(os.listdir("/proc/self/task"))


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


def _started_by(region) -> set[str]:
    """The threads that appeared while `region` ran on this thread (its workers, when it had none)."""
    before = _threads()
    region()
    return _threads() - before


needs = pytest.mark.skipif(not Path("/proc/self/task").is_dir() or (os.cpu_count() or 1) < 2
                           or torch.get_num_threads() < 2, reason="needs Linux's /proc and two threads")


@needs
def test_release_gives_a_threads_workers_back() -> None:
    def run() -> dict:
        def region() -> None:
            a = torch.randn(512, 512)
            for _ in range(3):
                a = torch.tanh(a @ a / 512)

        started = _started_by(region)
        released = release_thread_pool()
        return {"released": released, "started": started, "left": started & _threads()}

    got = _in_a_thread(run)
    if not got["released"]:
        pytest.skip("this OpenMP runtime cannot give its workers back")
    assert got["started"] and not got["left"]


@needs
def test_a_thread_that_loaded_or_answered_keeps_no_workers(mixtral_dir: Path) -> None:
    """After a load, and after an answer, the thread's next pass through the model (the same kernels and torch ops,
    2 threads) has to start workers again: none were kept."""
    if not _in_a_thread(lambda: {"ok": release_thread_pool()})["ok"]:
        pytest.skip("this OpenMP runtime cannot give its workers back")

    def run() -> dict:
        loaded = load_model(mixtral_dir, dtype="fp32", threads=2)
        ids = torch.tensor([PROMPT])
        try:
            after_load = _started_by(lambda: loaded.model.forward(ids, 0))
            release_thread_pool()
            list(loaded.engine.generate(PROMPT, SamplingParams(max_new_tokens=4)))
            after_answer = _started_by(lambda: loaded.model.forward(ids, 0))
            kept = _started_by(lambda: loaded.model.forward(ids, 0))  # (the control: workers kept, none started)
            release_thread_pool()
        finally:
            loaded.model.close()
        return {"load": bool(after_load), "answer": bool(after_answer), "control": bool(kept)}

    assert _in_a_thread(run) == {"load": True, "answer": True, "control": False}


def test_waiting_workers_spin_briefly_unless_the_user_chose() -> None:
    assert wait_environment({}) == {"GOMP_SPINCOUNT": str(WAIT_SPINS)}
    assert wait_environment({"OMP_WAIT_POLICY": "active"}) == {}  # the user's policy, as it is
    assert wait_environment({"GOMP_SPINCOUNT": "300000"}) == {}


def test_the_command_line_bounds_the_spin_before_torch_loads_openmp() -> None:
    """libgomp reads its variables once, when torch loads it: the command line sets them before anything imports
    torch (a family's file imported for the flags' choices once did, and the setting came too late)."""
    code = (
        "import os, sys\n"
        "os.environ.pop('OMP_WAIT_POLICY', None); os.environ.pop('GOMP_SPINCOUNT', None)\n"
        "import tandem.app.cli.main as m\n"
        "seen = []\n"
        "def apply(apply=m._apply_cpu_mask):\n"
        "    seen.append('torch' in sys.modules)\n"
        "    apply()\n"
        "m._apply_cpu_mask = apply\n"
        "assert m.main(['probe', '--json']) == 0\n"
        "assert seen == [False], seen\n"
        f"assert os.environ['GOMP_SPINCOUNT'] == '{WAIT_SPINS}'\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env=env, stdout=subprocess.DEVNULL)
