"""`tandem bench kernels --mixers`: the hybrids' recurrent token mixers (Gated DeltaNet, Mamba-2, short convolutions)
of a published shape, one layer at a time, against the roofline.

One token ("step", the kernel's one call after the input projection; "torch", the same in torch ops): the latency
of the whole mixer (input projection, step, output projection), the GB/s of what it must move (its bf16 weights
once, its float32 state read and written) and that over the streaming read bandwidth measured in the same run.
A prompt ("chunked", T tokens in one pass): the latency a token, and the GFLOP/s of its products (the projections and
the prompt path's block products, counted as runtime/deltanet.py and runtime/mamba2.py compute them) over the
compute peak measured in the same run. Layers are cycled through copies whose weights exceed the caches, as the
experts are in `bench kernels`; implementations take turns and keep their fastest round.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tandem.autotune.bench.shapes import find_shape
from tandem.autotune.microbench import compute_peak, dram_bandwidth, time_per_call
from tandem.kernels.choice import native_bf16
from tandem.kernels.dense import DenseLinear
from tandem.kernels.recur import recur_serves
from tandem.runtime.config import ModelConfig
from tandem.runtime.deltanet import CHUNK, DeltaNetWeights, DeltaState, GatedDeltaNet
from tandem.runtime.deltanet import dims as deltanet_dims
from tandem.runtime.families import family_for
from tandem.runtime.mamba2 import Mamba2, Mamba2State, Mamba2Weights
from tandem.runtime.mamba2 import dims as mamba_dims
from tandem.runtime.shortconv import ShortConv, ShortConvState, ShortConvWeights
from tandem.runtime.state import StateCache

WORKING_SET = 1 << 30  # bytes of mixer weights cycled through: beyond any cache


@dataclass
class _Host:
    """What a mixer's passes read of the model: its config, dense products, state and threads."""

    cfg: ModelConfig
    linear: DenseLinear
    cache: StateCache
    threads: int
    recur_kernel: bool


def _weights(kind: str, cfg: ModelConfig, gen: torch.Generator) -> tuple[Any, int]:
    """One layer's random weights for `kind` (bf16 matrices, float32 rest) and the bytes of its matrices."""
    h, k = cfg.hidden_size, cfg.conv_kernel

    def mat(rows: int, cols: int) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=gen) * cols ** -0.5).to(torch.bfloat16)

    if kind == "deltanet":
        key, value, hv, channels = deltanet_dims(cfg)
        w: Any = DeltaNetWeights(mat(channels + value + 2 * hv, h), torch.randn(channels, k, generator=gen) * 0.3,
                                 -torch.rand(hv, generator=gen), torch.zeros(hv), torch.ones(cfg.linear_value_dim),
                                 mat(h, value))
    elif kind == "mamba2":
        inner, channels, heads = mamba_dims(cfg)
        w = Mamba2Weights(mat(inner + channels + heads, h), torch.randn(channels, k, generator=gen) * 0.3,
                          -torch.rand(heads, generator=gen), torch.zeros(heads), torch.ones(heads), torch.ones(inner),
                          mat(h, inner), torch.zeros(channels))
    else:
        w = ShortConvWeights(mat(3 * h, h), torch.randn(h, k, generator=gen) * 0.3, mat(h, h))
    return w, 2 * (w.proj.numel() + w.out.numel())


def _scan_flops(kind: str, cfg: ModelConfig) -> int:
    """Multiply-adds x 2 a prompt token costs in the prompt path's blocks, beyond the projections."""
    if kind == "deltanet":  # per value head: Q S0, the state's update, and the block's QK^T, system and products
        dk, dv = cfg.linear_key_dim, cfg.linear_value_dim
        return cfg.linear_value_heads * 2 * (3 * dk * dv + CHUNK * (2 * dk + 2 * dv))
    if kind == "mamba2":
        p, n = cfg.ssm_head_dim, cfg.ssm_state
        return cfg.ssm_heads * 2 * (2 * p * n + CHUNK * (n + p))
    return 0


def bench_mixers(shapes: list[str], threads: int, tokens: tuple[int, ...] = (1, 512), min_time: float = 0.4,
                 rounds: int = 2, progress: Callable[[str], None] | None = None,
                 working_set: int = WORKING_SET) -> list[dict[str, Any]]:
    """Rows for each hybrid shape among `shapes` (the others have no recurrent mixer: none) and token count."""
    torch.set_num_threads(threads)
    bw = dram_bandwidth(threads, working_set)
    peak = compute_peak()["bf16"]
    rows: list[dict[str, Any]] = []
    kinds = {"deltanet": (GatedDeltaNet(), DeltaState), "mamba2": (Mamba2(), Mamba2State),
             "shortconv": (ShortConv(), ShortConvState)}
    for shape in shapes:
        found = find_shape(shape)
        if found.config is None:
            continue
        cfg = family_for(found.config["model_type"]).parse(found.config)
        for kind in sorted(set(cfg.mixers) & kinds.keys()):
            mixer, state_class = kinds[kind]
            gen = torch.Generator().manual_seed(1)
            first, nbytes = _weights(kind, cfg, gen)
            copies = max(2, math.ceil(working_set / nbytes))
            layers = [first] + [_weights(kind, cfg, gen)[0] for _ in range(copies - 1)]
            state = state_class(cfg, 1, 1, torch.bfloat16, layers=range(copies))
            moved = nbytes + 2 * state_class.nbytes(cfg, 1, 1, torch.bfloat16, layers=[0])
            # the compute dtype a load picks on this CPU (`--dtype auto`): bf16 where it has native bf16, else float32
            # over the bf16 matrices as the kernels keep them
            compute = torch.bfloat16 if native_bf16() else torch.float32
            for t in tokens:
                x = torch.randn(1, t, cfg.hidden_size, generator=gen).to(compute)
                impls: dict[str, _Host] = {}
                if t == 1:
                    impls = {"step": _Host(cfg, DenseLinear(threads), state, threads, recur_serves()),
                             "torch": _Host(cfg, DenseLinear(threads), state, threads, False)}
                else:
                    impls = {"chunked": _Host(cfg, DenseLinear(threads), state, threads, False)}
                best = dict.fromkeys(impls, float("inf"))
                for r in range(rounds):
                    for impl, host in list(impls.items())[:: -1 if r % 2 else 1]:
                        def call(j: int, host: _Host = host, x: torch.Tensor = x, mixer: Any = mixer,
                                 layers: list[Any] = layers) -> object:
                            return mixer.forward(host, j, layers[j], x, 0, None, None)
                        with torch.inference_mode():
                            best[impl] = min(best[impl], time_per_call(call, copies, min_time / rounds) / 1000)
                for impl, latency in best.items():
                    per_token = latency / t
                    gbps = moved / latency / 1e9
                    flops = (nbytes + _scan_flops(kind, cfg)) * t  # (a bf16 weight: 2 bytes, 2 flops a token)
                    gflops = flops / latency / 1e9
                    rows.append({"shape": shape, "mixer": kind, "tokens": t, "threads": threads, "impl": impl,
                                 "compute": str(compute).removeprefix("torch."),
                                 "latency_ms": round(latency * 1e3, 4), "per_token_ms": round(per_token * 1e3, 4),
                                 "moved_mb": round(moved / 1e6, 2), "gbps": round(gbps, 2), "bw_gbps": round(bw, 2),
                                 "ratio": round(gbps / bw, 3), "gflops": float(f"{gflops:.4g}"),
                                 "peak_gflops": float(f"{peak:.4g}"), "of_peak": float(f"{gflops / peak:.3g}")})
                    if progress:
                        progress(f"{shape} {kind} {t:>4} tokens {impl:>7}: {latency * 1e3:8.3f} ms  "
                                 f"{gbps / bw:5.2f} of DRAM  {gflops / peak:5.2f} of peak")
    return rows
