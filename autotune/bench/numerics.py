"""`tandem bench numerics`: how often each bf16 path picks fp32's top-1 token, teacher-forced over the bundled texts,
on this CPU and (`masks`) on each CPU with fewer features it can play."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from itertools import cycle
from pathlib import Path
from typing import Any

import torch

from tandem.autotune.bench.inputs import teacher_forced
from tandem.kernels.errors import TandemError
from tandem.kernels.isa import ENV, masked_features, masks_to_play, present_features
from tandem.kernels.library import available_isas
from tandem.runtime.cpuinfo import proc_cpuinfo
from tandem.runtime.loader import load_model
from tandem.runtime.synth import ASSETS

# Chunks of a teacher-forced pass: decode steps, then every count of tokens a layer kernel call takes (each
# expert gets at most that many), then more than it takes (experts one by one, some above the crossover).
NUMERICS_CHUNKS = (1, 1, 1, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 16, 17)
NUMERICS_MARGIN = 0.01  # every bf16 path agrees with fp32 at least as often as the best one, minus one point


def numerics_paths() -> dict[str, dict[str, Any]]:
    """The bf16 paths this CPU (as masked) can take: the kernels' own choice and each variant forced (`--kernel-isa`),
    which the contract covers, and torch alone (what runs where the kernels could not be built), which it does
    not: its logits are torch's bf16 results, rounded."""
    return {"auto": {}, **{f"isa={isa}": {"kernel_isa": isa} for isa in available_isas()},
            "torch": {"use_kernel": False}}


NUMERICS_OUTSIDE = ("torch",)  # paths measured but not held to the contract (see numerics_paths)


def numerics_top1(model_dir: str | Path, dtype: str, settings: dict[str, Any], tokens: int) -> torch.Tensor:
    """The top-1 token at each of the first `tokens` positions of the bundled texts, teacher-forced in
    NUMERICS_CHUNKS."""
    text = "".join((ASSETS / name).read_text(encoding="utf-8") for name in ("tokenizer_corpus.txt",
                                                                             "bench_prompts.txt"))
    loaded = load_model(model_dir, dtype=dtype, context=tokens + 1, **settings)
    try:
        ids = loaded.tokenizer.encode(text)[:tokens]
        if len(ids) < tokens:
            raise TandemError(f"the bundled texts hold only {len(ids)} tokens of this model; ask for fewer")
        return torch.cat([t.argmax(-1) for t in teacher_forced(loaded.model, ids, cycle(NUMERICS_CHUNKS))])
    finally:
        loaded.model.close()


def bench_numerics(model_dir: str | Path, tokens: int = 1024, paths: list[str] | None = None, masks: bool = False,
                   masked_paths: list[str] | None = None, reference: list[int] | None = None,
                   progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """How often each bf16 path picks the same top-1 token as the fp32 path, teacher-forced over `tokens` tokens
    of the bundled texts fed in NUMERICS_CHUNKS, and whether each is within NUMERICS_MARGIN of the best of all.

    `paths`: this CPU's (default: every one). `masks`: then `masked_paths` (default: every one) again under each
    feature mask this CPU can play (kernels.isa.masks_to_play), each in a child process with torch capped too,
    against the same fp32 tokens. `reference`: those fp32 top-1 tokens, given (how the children get them) instead
    of measured. Result: "cpus" maps the mask of each run ("" for the CPU as the process found it) to its paths."""
    def say(message: str) -> None:
        if progress:
            progress(message)

    options = numerics_paths()
    if reference is None:
        say(f"fp32: {tokens} tokens")
        ref = numerics_top1(model_dir, "fp32", {}, tokens)
    else:
        ref = torch.tensor(reference)
    playing = os.environ.get(ENV, "")
    run: dict[str, float] = {}
    for name in list(options) if paths is None else paths:
        say(f"{name}: {tokens} tokens" + (f" ({ENV}={playing})" if playing else ""))
        run[name] = (numerics_top1(model_dir, "bf16", options[name], tokens) == ref).float().mean().item()
    cpus = {playing: run}
    info = proc_cpuinfo()
    flags = info["flags"] if info else []
    for mask, hidden in masks_to_play(flags) if masks else []:
        if hidden != present_features(flags) & masked_features():  # (the CPU this process plays: measured above)
            cpus[mask] = _numerics_child(model_dir, tokens, ref, mask, masked_paths)
    best = max((a for run in cpus.values() for name, a in run.items() if name not in NUMERICS_OUTSIDE), default=0.0)
    return {"model": str(model_dir), "tokens": tokens, "chunks": list(NUMERICS_CHUNKS), "best": round(best, 4),
            "margin": NUMERICS_MARGIN,
            "cpus": {mask: {name: {"agreement": round(a, 4), "contract": name not in NUMERICS_OUTSIDE,
                                   "within_margin": a >= best - NUMERICS_MARGIN} for name, a in run.items()}
                     for mask, run in cpus.items()}}


def _numerics_child(model_dir: str | Path, tokens: int, ref: torch.Tensor, mask: str, paths: list[str] | None
                    ) -> dict[str, float]:
    """`tandem bench numerics` under a feature mask, in a child process (torch reads its caps at start-up)."""
    with tempfile.TemporaryDirectory() as tmp:
        reference = Path(tmp) / "fp32-top1.json"
        reference.write_text(json.dumps(ref.tolist()), encoding="utf-8")
        command = [sys.executable, "-m", "tandem.app.cli.main", "bench", "numerics", "--model", str(model_dir),
                   "--tokens", str(tokens), "--reference", str(reference)]
        command += ["--paths", ",".join(paths)] if paths else []
        done = subprocess.run(command, env={**os.environ, ENV: mask}, capture_output=True, text=True)
    if done.returncode != 0:
        raise TandemError(f"numerics under {ENV}={mask} failed: {done.stderr.strip()[-500:]}")
    run = json.loads(done.stdout)["cpus"][mask]
    return {name: row["agreement"] for name, row in run.items()}
