"""Latency model for Fiddler's per-expert choice: cpu_lat(s) = a + b·s, constant gpu_lat and transfer_lat.

Until the auto-tuner measures them, defaults come from rough bandwidths (DRAM for the CPU, device
memory for the GPU, PCIe for copies) and the expert's size; flags override each number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LatencyModel:
    cpu_a_ms: float  # CPU latency of one expert for one token
    cpu_b_ms: float  # extra CPU latency per additional token
    gpu_ms: float  # accelerator latency of one expert (flat over the token counts that matter)
    transfer_ms: float  # copying one expert's weights host -> device

    def cpu_lat(self, tokens: int) -> float:
        return self.cpu_a_ms + self.cpu_b_ms * tokens

    def gpu_lat(self, tokens: int) -> float:
        return self.gpu_ms

    def prefer_fetch(self, tokens: int) -> bool:
        """Fiddler Algorithm 1: copy the weights and run on the accelerator when that is faster."""
        return self.cpu_lat(tokens) > self.gpu_lat(tokens) + self.transfer_ms

    @classmethod
    def from_bandwidths(
        cls, expert_bytes: int, flops_per_token: float, cpu_gbps: float = 20.0, cpu_gflops: float = 200.0,
        gpu_gbps: float = 500.0, pcie_gbps: float = 12.0,
    ) -> LatencyModel:
        return cls(
            cpu_a_ms=expert_bytes / cpu_gbps / 1e6,
            cpu_b_ms=flops_per_token / cpu_gflops / 1e6,
            gpu_ms=expert_bytes / gpu_gbps / 1e6,
            transfer_ms=expert_bytes / pcie_gbps / 1e6,
        )

    @classmethod
    def parse(cls, text: str) -> LatencyModel:
        """`A,B,GPU,TRANSFER` in milliseconds (the --cost flag). Each must be finite and not negative: a NaN
        latency makes every per-expert comparison false and a negative one makes the wrong side look free."""
        usage = "expected four numbers in ms: cpu_a,cpu_b,gpu,transfer (e.g. 2.0,0.5,0.2,4.0)"
        try:
            a, b, g, t = (float(x) for x in text.split(","))
        except ValueError:
            raise ValueError(usage) from None
        if not all(math.isfinite(x) and x >= 0 for x in (a, b, g, t)):
            raise ValueError(f"{usage}, each finite and not negative (got {text})")
        return cls(a, b, g, t)
