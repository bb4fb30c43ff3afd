"""Spans of work by kind, recorded when a benchmark asks (`Dispatcher.timeline`): the accelerator's expert runs, the
CPU's, each MoE layer's whole call and the host's attention, to measure how much of one work hides behind another
(a pipelined step's attention behind the experts; a layer's CPU experts beside its device experts)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

T = TypeVar("T")


class Timeline:
    def __init__(self) -> None:
        self.spans: dict[str, list[tuple[float, float]]] = {}
        self._lock = threading.Lock()  # the accelerator's stream thread and the host record side by side

    @contextmanager
    def span(self, kind: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            end = time.perf_counter()
            with self._lock:
                self.spans.setdefault(kind, []).append((start, end))

    def wrap(self, kind: str, fn: Callable[[], T]) -> Callable[[], T]:
        """`fn`, recorded as a span of `kind` wherever it runs."""
        def run() -> T:
            with self.span(kind):
                return fn()
        return run

    def total(self, kind: str) -> float:
        return sum(end - start for start, end in _merged(self.spans.get(kind, [])))

    def overlap(self, a: str, b: str) -> float:
        """Seconds during which work of both kinds ran."""
        x, y = _merged(self.spans.get(a, [])), _merged(self.spans.get(b, []))
        i = j = 0
        both = 0.0
        while i < len(x) and j < len(y):
            both += max(0.0, min(x[i][1], y[j][1]) - max(x[i][0], y[j][0]))
            if x[i][1] < y[j][1]:
                i += 1
            else:
                j += 1
        return both


def layer_overlap(timeline: Timeline) -> dict[str, float | int]:
    """How well each MoE layer ran its device and CPU experts side by side, over the layers that ran both: the
    layers' seconds (each "moe" span, routing and host read included) against the longer of their device ("experts")
    and CPU ("cpu_experts") seconds, and what running them one after the other would have taken. The device's spans
    are its stream's work as the emulated device runs it (on CUDA they would time the launches); layers run as
    micro-batches (`start`/`finish` apart) record no "moe" span and are not counted."""
    device, cpu = _merged(timeline.spans.get("experts", [])), _merged(timeline.spans.get("cpu_experts", []))
    layers = wall = longer = serial = 0.0
    for start, end in timeline.spans.get("moe", []):
        d, c = _within(device, start, end), _within(cpu, start, end)
        if d > 0 and c > 0:
            layers += 1
            wall += end - start
            longer += max(d, c)
            serial += d + c
    return {"layers": int(layers), "layer_s": round(wall, 6), "longer_s": round(longer, 6),
            "one_after_the_other_s": round(serial, 6),
            "layer_over_longer": round(wall / longer, 3) if longer else 0.0}


def _within(spans: list[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of `spans` (merged) inside [start, end]."""
    return sum(max(0.0, min(e, end) - max(s, start)) for s, e in spans if s < end and e > start)


def _merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Spans sorted, overlapping ones joined."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out
