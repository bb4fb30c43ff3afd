"""The runtime's choices by name, torch-free: what the command line offers (app/cli/flags.py builds its choice lists
from these) and what runtime/options.py resolves."""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

Dtype = Literal["bf16", "fp16", "fp32"]
DTYPE_NAMES: tuple[Dtype, ...] = ("bf16", "fp16", "fp32")
AcceleratorKind = Literal["auto", "none", "cuda", "emulated"]


class Strategy(StrEnum):
    FIDDLER = "fiddler"  # per-expert choice by the cost model
    CPU = "cpu"  # never copy weights on demand: misses always run on the CPU
    FETCH = "fetch"  # always copy a missing expert and run it on the accelerator (classic offloading)


class PredictorKind(StrEnum):
    """How the experts of the MoE layers ahead are guessed (runtime/prefetch.py)."""

    NONE = "none"
    PREVIOUS = "previous-token"  # the experts each layer chose for the previous token
    STALE_GATE = "stale-gate"  # the layers ahead's routers on this layer's hidden state
    EAM = "eam"  # MoE-Infinity's activation matrices: the nearest earlier request's busiest experts
