"""The OpenMP runtime that torch and the kernels share (torch's libgomp, loaded once by name), and the rule for a
thread done with its share of the work: give its OpenMP workers back.

libgomp lets a worker that waits for the next parallel region spin only while it manages no more threads than the
process has CPUs; past that it sleeps almost at once, and each region then pays a wake-up. Every thread that has run
a parallel region keeps its workers until it exits. So a thread that loaded a model and stayed (a chat app's, a
server's main thread) held a worker beside the one the answering thread's kernels use: on 2 cores that is one too
many, and the decode step (about 180 regions a token on the built-in model) ran 15 % slower on any thread but the
one that loaded. A thread done with a load or an answer calls `release_thread_pool`; its next region starts them
again (a thread's creation, once).

And how long a waiting worker spins before it sleeps: libgomp's default, unless a policy is chosen, is 300,000 spins
while a thread's pool fits the CPUs. Where another program holds a core (a browser, a build, a shared machine), a
spinning waiter keeps the core its partner needs to finish the region both wait on, and every region pays a time
slice: beside one `yes` on 2 cores, decode of the 4-layer OLMoE Q4_K_M file fell from 44 to 7-18 tokens/s and
prefill from 147 to 31-59. With 10,000 spins (`wait_environment`, set by the command line before torch loads the
runtime) it decoded at 22 and prefilled at 75 there, and on the quiet machine as before (docs/bench/openmp-waits.md)."""

from __future__ import annotations

import ctypes
from collections.abc import Mapping
from functools import cache
from pathlib import Path

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: the runtime may release this thread's resources; state is kept
WAIT_SPINS = 10_000  # GOMP_SPINCOUNT: spins of a waiting worker before it sleeps (the module's docstring says why)


def wait_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The variable that bounds how long OpenMP's waiting workers spin, to set before torch loads the runtime (read
    once, when libgomp loads); nothing where the user chose (OMP_WAIT_POLICY or GOMP_SPINCOUNT set: theirs wins)."""
    if "OMP_WAIT_POLICY" in environ or "GOMP_SPINCOUNT" in environ:
        return {}
    return {"GOMP_SPINCOUNT": str(WAIT_SPINS)}


@cache
def openmp() -> ctypes.CDLL | None:
    """The GNU OpenMP runtime torch runs on, as this process has it loaded (found in /proc/self/maps, so that no
    second copy is loaded beside it), or None: none loaded, another runtime (LLVM's or Intel's, whose calls would
    act differently), or no /proc."""
    import torch  # noqa: F401  (torch loads its runtime first)

    try:
        maps = Path("/proc/self/maps").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    paths = {line.split(None, 5)[5] for line in maps.splitlines() if len(line.split(None, 5)) == 6}
    gomp = sorted(p for p in paths if Path(p).name.startswith("libgomp"))
    if not gomp:
        return None
    try:
        return ctypes.CDLL(gomp[0])
    except OSError:
        return None


def release_thread_pool() -> bool:
    """The calling thread's OpenMP workers given back (OpenMP 5.0's omp_pause_resource_all, soft: libgomp joins and
    frees the calling thread's pool and keeps its settings); False where the runtime has none to give or cannot (no
    libgomp, an older one, inside a parallel region). Called from the thread that did the work: a generator closed
    on another thread releases that thread's workers instead (harmless, and the work's thread keeps its own)."""
    omp = openmp()
    pause = getattr(omp, "omp_pause_resource_all", None) if omp is not None else None
    if pause is None:
        return False
    pause.argtypes = [ctypes.c_int]
    pause.restype = ctypes.c_int
    return pause(OMP_PAUSE_SOFT) == 0
