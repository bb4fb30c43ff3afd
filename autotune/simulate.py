"""Trace-driven simulation of decode under a placement policy (MoE-Lightning's roofline costs, Fiddler's
per-expert choice, the collaborative-inference cache), with the CPU, the accelerator and the copy engine
as three concurrent resources.

Replays a routing trace `[steps, layers, top_k]` (expert ids, -1 for dense layers) one decode token at a
time. Per layer: the non-expert part runs first (on the accelerator if there is one); then resident experts
queue on the accelerator, copied-on-demand experts queue on the copy engine and then the accelerator, the
rest on the CPU; the layer ends when both sides are done. Misses in cached layers are post-fetched on the
copy engine in the background (at most `max_inflight` at a time) and become hits once their copy has ended.
The cache bookkeeping is the runtime's own `ExpertCache`, so eviction behaves exactly as at run time.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tandem.autotune.routing import popularity
from tandem.runtime.dispatch import Strategy
from tandem.runtime.expert_cache import DEFAULT_INFLIGHT, CachePolicy, ExpertCache, Key


@dataclass(frozen=True)
class SimCosts:
    """Latencies in ms. CPU: `cpu_a + cpu_b * tokens` per expert at the planned thread count."""

    cpu_a: float
    cpu_b: float
    gpu_expert: float = 0.0
    copy_expert: float = 0.0  # one expert's weights host -> device
    dense_layer: float = 0.0  # attention + router etc. of one layer (where the non-expert part runs)
    ship: float = 0.0  # activations to the CPU and back, once per layer that has CPU experts
    token: float = 0.0  # per-token work outside the layers (embedding, lm_head, sampling, interpreter)
    shared: bool = False  # accelerator and copies run on the CPU itself (emulated): one resource, not three
    copy_cpu: float = 0.0  # CPU expert time one copy takes away: both stream from DRAM (plan.dram_contention_ms)


@dataclass(frozen=True)
class Candidate:
    accelerator: bool = False
    strategy: Strategy = Strategy.FIDDLER
    static: tuple[Key, ...] = ()
    cache_layers: tuple[int, ...] = ()  # MoE layers the cache covers (N indexes)
    ways: int = 0
    policy: CachePolicy = CachePolicy.LRU
    max_inflight: int = DEFAULT_INFLIGHT
    # prefetch (runtime/prefetch.py): each MoE layer guesses the next `len(recall)` MoE layers' experts, a guess at
    # distance d holding each expert routed there with probability recall[d - 1] (the rest wrong)
    recall: tuple[float, ...] = ()


@dataclass
class SimResult:
    token_ms: float
    hit_rate: float
    bytes_moved: int
    hits: int = 0
    misses: int = 0
    copies: int = 0
    timeline: list[float] = field(default_factory=list)  # end time of each token, ms
    prefetches: int = 0
    prefetch_used: int = 0

    @property
    def tok_s(self) -> float:
        return 1000.0 / self.token_ms if self.token_ms > 0 else 0.0


class _Copy:
    """A copy in simulated time: done once the simulation clock has passed its end."""

    def __init__(self, clock: list[float], end: float) -> None:
        self.clock, self.end = clock, end

    def done(self) -> bool:
        return self.clock[0] >= self.end

    def exception(self) -> None:
        return None

    def result(self) -> None:
        return None


def guesses(trace: np.ndarray, step: int, targets: list[int], recall: tuple[float, ...], num_experts: int,
            rng: np.random.Generator) -> list[tuple[int, list[int]]]:
    """A predictor of the given recall per distance at one layer of `step`: for each MoE layer ahead (`targets`,
    nearest first), each expert routed there kept with probability recall[d - 1], the guess filled up to top-k
    with experts not routed there."""
    out = []
    for d, target in enumerate(targets, start=1):
        actual = [int(e) for e in trace[step, target] if e >= 0]
        guess = [e for e in actual if rng.random() < recall[d - 1]]
        others = [e for e in range(num_experts) if e not in actual]
        wrong = rng.permutation(others)[: len(actual) - len(guess)] if others else []
        out.append((target, guess + [int(e) for e in wrong]))
    return out


def simulate(trace: np.ndarray, costs: SimCosts, policy: Candidate, expert_bytes: int,
             num_experts: int | None = None) -> SimResult:
    """Predicted per-token decode latency, hit rate and bytes copied for `trace` under `policy`. `num_experts`:
    the experts a layer has (what a wrong guess draws from; default: the largest id in the trace, plus one)."""
    steps = trace.shape[0]
    experts_n = num_experts or int(trace.max()) + 1
    moe = [layer for layer in range(trace.shape[1]) if (trace[:, layer] >= 0).any()]
    ahead = {layer: moe[k + 1 : k + 1 + len(policy.recall)] for k, layer in enumerate(moe)}
    rng = np.random.default_rng(7)
    prefetches = 0
    span = costs.dense_layer + costs.cpu_a  # a layer's time, until one is simulated
    reused = [0, 0]  # experts a token shared with the previous one at the same layer, of all it chose
    clock = [0.0]  # shared with the simulated copies
    cache = ExpertCache(list(policy.cache_layers), policy.ways if policy.cache_layers else 0, policy.policy,
                        policy.max_inflight)
    static = set(policy.static)
    copy_free = 0.0  # when the copy engine is next idle
    hits = misses = copies = 0
    timeline: list[float] = []
    for step in range(steps):
        if policy.policy is CachePolicy.TRACE and step == 0:
            cache.new_request()
        for layer in range(trace.shape[1]):
            experts = [int(e) for e in trace[step, layer] if e >= 0]
            t = clock[0] + costs.dense_layer
            clock[0] = t
            if not experts:
                continue
            if not policy.accelerator:
                clock[0] = t + sum(costs.cpu_a + costs.cpu_b for _ in experts)
                misses += len(experts)
                continue
            for e in experts:
                cache.observe(layer, e, 1)
            if step:  # the previous token's experts this one keeps (against the guesses' recall)
                reused[0] += len(set(experts).intersection(int(g) for g in trace[step - 1, layer]))
                reused[1] += len(experts)
            gpu_end, cpu_end, missed, demanded = t, t, [], 0
            for e in experts:
                key = (layer, e)
                resident = key in static or (cache.covers(layer) and cache.lookup(layer, e) is not None)
                if resident:
                    hits += 1
                    gpu_end += costs.gpu_expert
                    continue
                misses += 1
                fetch = policy.strategy == "fetch" or (
                    policy.strategy == "fiddler" and costs.cpu_a + costs.cpu_b > costs.gpu_expert + costs.copy_expert)
                arriving = cache.arriving(layer, e) if fetch and cache.covers(layer) else None
                if arriving is not None and isinstance(arriving.copy, _Copy):  # its copy under way: wait for it
                    gpu_end = max(gpu_end, arriving.copy.end) + costs.gpu_expert
                    continue
                if fetch:
                    start = max(t, copy_free)
                    copy_free = start + costs.copy_expert
                    copies += 1
                    demanded += 1
                    gpu_end = max(gpu_end, copy_free) + costs.gpu_expert
                    slot = cache.begin_fill(layer, e) if cache.covers(layer) else None
                    if slot is not None:
                        cache.start(slot, _Copy(clock, copy_free))  # type: ignore[arg-type]
                else:
                    cpu_end += costs.cpu_a + costs.cpu_b
                    missed.append(e)
            ahead_copies = 0
            if policy.recall and step:  # guesses for the layers ahead, copied while the bus has a layer's time free
                keep = frozenset((layer, e) for e in experts)
                for target, guess in guesses(trace, step, ahead[layer], policy.recall, experts_n, rng):
                    if not cache.covers(target):
                        continue
                    for e in guess:
                        if copy_free > t + span or cache.inflight >= cache.max_inflight:
                            break
                        if (target, e) in static:
                            continue
                        # (never in place of a guess, nor of what the layer chose for the previous token where
                        # tokens keep more of those than guesses come true)
                        last = {(target, int(g)) for g in trace[step - 1, target] if g >= 0} \
                            if reused[0] >= reused[1] * policy.recall[0] else set()
                        slot = cache.begin_fill(target, e, keep | {(target, g) for g in guess} | last, prefetch=True)
                        if slot is None:
                            continue
                        start = max(t, copy_free)
                        copy_free = start + costs.copy_expert
                        copies += 1
                        prefetches += 1
                        ahead_copies += 1
                        cache.start(slot, _Copy(clock, copy_free))  # type: ignore[arg-type]
            if costs.shared:  # the emulated device's copies take the cores themselves
                cpu_end += ahead_copies * costs.copy_expert
            if missed:  # a copy takes DRAM bandwidth from the CPU experts running meanwhile
                cpu_end += costs.ship + (0.0 if costs.shared else (demanded + ahead_copies) * costs.copy_cpu)
            # three resources in parallel, or one (the emulated device shares the CPU's cores and memory)
            clock[0] = (gpu_end - t) + (cpu_end - t) + t if costs.shared else max(gpu_end, cpu_end)
            span = clock[0] - t  # this layer's time: what the bus has for prefetches during the next
            for e in missed:  # post-fetch in the background for later tokens
                if not cache.covers(layer) or cache.inflight >= cache.max_inflight:
                    continue
                if policy.recall and copy_free > clock[0]:  # with prefetch, only on an idle bus: guesses go first
                    continue
                slot = cache.begin_fill(layer, e)
                if slot is not None:
                    start = max(clock[0], copy_free)
                    copy_free = start + costs.copy_expert
                    copies += 1
                    # the copy takes the same cores and memory bandwidth as the CPU experts (emulated), or a share
                    # of the memory bandwidth they stream at
                    clock[0] += costs.copy_expert if costs.shared else costs.copy_cpu
                    cache.start(slot, _Copy(clock, copy_free))  # type: ignore[arg-type]
        clock[0] += costs.token
        timeline.append(clock[0])
    total = hits + misses
    return SimResult(clock[0] / steps if steps else 0.0, hits / total if total else 0.0, copies * expert_bytes,
                     hits, misses, copies, timeline, prefetches, cache.stats.prefetch_used)


def synthetic_trace(steps: int, layers: int, experts: int, top_k: int, reuse: float = 0.4,
                    skew: float = 1.0, seed: int = 0, sparse: tuple[bool, ...] | None = None,
                    table: np.ndarray | None = None) -> np.ndarray:
    """A routing trace with temporal locality: each token keeps each of the previous token's experts of a
    layer with probability `reuse`, and draws the rest from a Zipf-like popularity (`skew` 0 = uniform), or from
    `table` [layers, experts] (routing.popularity) when given."""
    if not 0 < top_k <= experts:  # top_k distinct experts out of fewer could never be drawn: the loop would not end
        raise ValueError(f"a synthetic trace needs 1 <= top_k <= experts (got top_k {top_k}, {experts} experts)")
    rng = np.random.default_rng([seed, 1])  # (a stream apart from the popularity's)
    if table is None:
        table = popularity(layers, experts, skew, seed)
    trace = np.full((steps, layers, top_k), -1, dtype=np.int32)
    for layer in range(layers):
        if sparse is not None and not sparse[layer]:
            continue
        prev: list[int] = []
        for step in range(steps):
            chosen = [e for e in prev if rng.random() < reuse][:top_k]
            while len(chosen) < top_k:
                e = int(rng.choice(experts, p=table[layer]))
                if e not in chosen:
                    chosen.append(e)
            trace[step, layer] = chosen
            prev = chosen
    return trace
