"""The planner: search placement policies with the simulator and pick the fastest predicted one.

Pure function of (measurements, model shape, routing trace). On a CPU-only machine it still chooses the
thread count, the kernel variant and crossover (from measurements) and leaves quantization off; with an
accelerator it also chooses the strategy, static placement and the cache's ways, indexes and policy, and then
whether prefetch pays (MoE-Infinity): each predictor whose accuracy was measured, at each depth, simulated on the
best placements; the fastest is kept only if it beats none, with the precision below which it stops paying.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from tandem.autotune.measurements import Measurements
from tandem.autotune.routing import popularity, routing_stats
from tandem.autotune.simulate import Candidate, SimCosts, SimResult, simulate, synthetic_trace
from tandem.kernels.errors import TandemError
from tandem.kernels.names import Isa, Quant
from tandem.runtime.checkpoint import Checkpoint
from tandem.runtime.choices import PredictorKind
from tandem.runtime.config import ModelConfig
from tandem.runtime.dispatch import Strategy
from tandem.runtime.expert_cache import CachePolicy
from tandem.runtime.prefetch import DEFAULT_MIN_PRECISION
from tandem.runtime.trace import most_popular
from tandem.runtime.weights import attention_tensors, expert_names

MAX_EXPERTS = 1 << 16  # per layer; the planner keeps [layers, experts] tables, so the sizes are bounded first
MAX_LAYERS = 1 << 12


def check_config_sizes(cfg: ModelConfig) -> None:
    """Refuse sizes the planner cannot work with before any table is allocated: top-k must be at most the
    number of experts (a synthetic trace could never pick top-k different experts), and every count a whole
    number within bounds (a `num_local_experts: 1e9` would otherwise allocate without end)."""
    sizes = {"number of layers": (cfg.num_layers, MAX_LAYERS), "number of experts": (cfg.num_experts, MAX_EXPERTS),
             "top-k": (cfg.top_k, MAX_EXPERTS), "hidden size": (cfg.hidden_size, 1 << 20),
             "expert intermediate size": (cfg.moe_intermediate_size, 1 << 20)}
    for name, (value, high) in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
            raise TandemError(f"the model's {name} is {value!r}; the planner needs a whole number from 1 to {high} "
                              "(is config.json intact?)")
    if cfg.top_k > cfg.num_experts:
        raise TandemError(f"the model routes each token to {cfg.top_k} experts (top-k) but has only "
                          f"{cfg.num_experts}; config.json is inconsistent")


@dataclass(frozen=True)
class ModelShape:
    num_layers: int
    num_experts: int
    top_k: int
    sparse: tuple[bool, ...]
    hidden: int
    inter: int
    expert_bytes: int
    dense_layer_bytes: int  # non-expert weights read per layer per token (attention, norms, router)
    # how the experts are stored, and measured: "mxfp4" (gpt-oss), GGUF blocks ("Q4_K", or "Q4_K/Q6_K": gate and
    # up's format, then down's), or None (floats of the compute dtype)
    expert_quant: str | None = None
    family: str = ""  # config.json's model_type: its routing statistics (routing.py) when there is no trace

    @classmethod
    def from_config(cls, cfg: ModelConfig, dtype_bytes: int = 2) -> ModelShape:
        check_config_sizes(cfg)
        layers = range(cfg.num_layers)  # (a layer's attention on average: Gemma 4's global layers are larger)
        attn = sum(int(np.prod(s)) for i in layers for s in attention_tensors(cfg, i).values()) // cfg.num_layers
        mlp = 3 * cfg.hidden_size * cfg.dense_intermediate_size if cfg.parallel_dense else 0  # (beside the experts)
        dense = (attn + mlp + cfg.num_experts * cfg.hidden_size) * dtype_bytes
        params = 3 * cfg.hidden_size * cfg.moe_intermediate_size
        # MXFP4: half a byte a weight and a scale byte per 32 (its float32 biases are noise beside them)
        expert_bytes = params // 2 + params // 32 if cfg.experts_mxfp4 else params * dtype_bytes
        return cls(cfg.num_layers, cfg.num_experts, cfg.top_k, cfg.sparse_layers, cfg.hidden_size,
                   cfg.moe_intermediate_size, expert_bytes, dense, "mxfp4" if cfg.experts_mxfp4 else None,
                   cfg.model_type)

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint, dtype_bytes: int = 2) -> ModelShape:
        """As `from_config`, with a GGUF file's experts counted as its blocks (the bytes the kernels and the
        accelerator's slots hold)."""
        shape = cls.from_config(ckpt.config, dtype_bytes)
        first = next((i for i, s in enumerate(shape.sparse) if s), None)
        if first is None or not ckpt.expert_blocks:
            return shape
        mats = [ckpt.blocks(n) for n in expert_names(ckpt.spec, first, 0)]
        gate, down = mats[0].kind, mats[2].kind  # type: ignore[union-attr]
        return replace(shape, expert_bytes=sum(m.nbytes for m in mats),  # type: ignore[union-attr]
                       expert_quant=gate if gate == down else f"{gate}/{down}")

    @property
    def moe_layers(self) -> list[int]:
        return [i for i, s in enumerate(self.sparse) if s]


@dataclass(frozen=True)
class Plan:
    threads: int
    accelerator: bool = False
    strategy: Strategy = Strategy.CPU
    cache_indexes: int = 0
    cache_ways: int = 0
    cache_policy: CachePolicy = CachePolicy.LRU
    static_experts: int = 0
    kernel_isa: Isa | None = None
    crossover: int | None = None
    quant: Quant | None = None  # off unless the user opts in
    prefetch: PredictorKind = PredictorKind.NONE
    prefetch_depth: int = 0
    prefetch_min_precision: float = DEFAULT_MIN_PRECISION  # where it stops paying (runtime's PrecisionGate)

    def to_dict(self) -> dict[str, Any]:
        return {"threads": self.threads, "accelerator": self.accelerator, "strategy": str(self.strategy),
                "cache": {"indexes": self.cache_indexes, "ways": self.cache_ways, "policy": str(self.cache_policy)},
                "static_experts": self.static_experts, "kernel": {"isa": self.kernel_isa, "crossover": self.crossover},
                "quant": self.quant or "none",
                "prefetch": {"predictor": str(self.prefetch), "depth": self.prefetch_depth,
                             "min_precision": self.prefetch_min_precision}}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        cache, kernel, ahead = d.get("cache") or {}, d.get("kernel") or {}, d.get("prefetch") or {}
        quant = d.get("quant")
        return cls(int(d["threads"]), bool(d.get("accelerator")), Strategy(d.get("strategy", "cpu")),
                   int(cache.get("indexes", 0)), int(cache.get("ways", 0)), CachePolicy(cache.get("policy", "lru")),
                   int(d.get("static_experts", 0)), kernel.get("isa"), kernel.get("crossover"),
                   None if quant in (None, "none") else quant, PredictorKind(ahead.get("predictor", "none")),
                   int(ahead.get("depth", 0)), float(ahead.get("min_precision", DEFAULT_MIN_PRECISION)))


@dataclass
class PlanResult:
    plan: Plan
    predicted_tok_s: float
    hit_rate: float
    alternatives: list[dict[str, Any]] = field(default_factory=list)
    prefetch: dict[str, Any] = field(default_factory=dict)  # what prefetch was predicted to give, and why chosen

    def to_dict(self) -> dict[str, Any]:
        return {"plan": self.plan.to_dict(), "predicted_tok_s": round(self.predicted_tok_s, 2),
                "hit_rate": round(self.hit_rate, 4), "alternatives": self.alternatives, "prefetch": self.prefetch}


# DRAM bytes a copy of an expert moves per byte copied: the runtime reads the (memory-mapped, pageable) weights,
# writes them into a pinned staging buffer, and the DMA reads that (accelerator.StagingRing)
COPY_TRAFFIC = 3


def dram_contention_ms(shape: ModelShape, meas: Measurements, threads: int) -> float:
    """CPU expert time one background copy takes away. Decode streams experts from DRAM at the rate a thread count
    reaches (its one-token latency); a copy moves COPY_TRAFFIC times the expert's bytes through DRAM meanwhile. What
    the DRAM delivers beyond the copy's share still feeds the CPU experts at full speed; the rest of their stream
    waits. The DRAM's peak: the probed bandwidth, else the fastest stream measured. Few threads leave bandwidth
    over and lose nothing; many threads saturate it and lose most of the copy's duration."""
    copy_ms = meas.copy_expert_ms or 0.0
    if not copy_ms:
        return 0.0
    streams = {t: shape.expert_bytes / fit.a_ms / 1e6 for t, fit in meas.cpu.items()}  # GB/s at each count
    peak = max(meas.dram_gbps or 0.0, *streams.values())
    copy_gbps = COPY_TRAFFIC * shape.expert_bytes / copy_ms / 1e6
    return copy_ms * max(0.0, 1.0 - max(0.0, peak - copy_gbps) / streams[threads])


def sim_costs(shape: ModelShape, meas: Measurements, threads: int, accelerator: bool) -> SimCosts:
    fit = meas.cpu[threads]
    dram = meas.dram_gbps or 20.0
    if accelerator:
        gpu_gbps = shape.expert_bytes / (meas.gpu_expert_ms or 1.0) / 1e6  # the accelerator's effective bandwidth
        dense = shape.dense_layer_bytes / gpu_gbps / 1e6
        ship = meas.ship_ms if meas.ship_ms is not None else 2 * shape.hidden * 4 / (meas.h2d_gbps or 10.0) / 1e6 + 0.01
        return SimCosts(fit.a_ms, fit.b_ms, meas.gpu_expert_ms or 0.0, meas.copy_expert_ms or 0.0, dense, ship,
                        meas.token_overhead_ms, meas.shared_device, dram_contention_ms(shape, meas, threads))
    return SimCosts(fit.a_ms, fit.b_ms, dense_layer=shape.dense_layer_bytes / dram / 1e6,
                    token=meas.token_overhead_ms)


def candidates(shape: ModelShape, meas: Measurements) -> list[Plan]:
    kernel = {"kernel_isa": meas.kernel.get("isa"), "crossover": meas.kernel.get("crossover")}
    threads = sorted(meas.cpu)
    plans = [Plan(t, **kernel) for t in threads]
    if not meas.has_gpu:
        return plans
    moe = len(shape.moe_layers)
    slots = min(meas.vram_for_experts // shape.expert_bytes, moe * shape.num_experts)
    best_t = min(threads, key=lambda t: meas.cpu[t].lat(1))
    ways_options = sorted({w for w in (shape.top_k, 2 * shape.top_k, 4 * shape.top_k, shape.num_experts)
                           if 0 < w <= shape.num_experts})
    for strategy in Strategy:
        for static in sorted({0, slots // 2, slots}):
            cache_slots = slots - static
            plans.append(Plan(best_t, True, strategy, static_experts=static, **kernel))
            for ways in ways_options:
                indexes = min(moe, cache_slots // ways)
                if indexes == 0:
                    continue
                for policy in CachePolicy:
                    plans.append(Plan(best_t, True, strategy, indexes, ways, policy, static, **kernel))
    return plans


def trace_counts(shape: ModelShape, trace: np.ndarray) -> np.ndarray:
    """[layers, experts] routings in a trace."""
    counts = np.zeros((shape.num_layers, shape.num_experts), dtype=np.int64)
    for layer in range(shape.num_layers):
        ids = trace[:, layer].ravel()
        ids = ids[ids >= 0]
        counts[layer] = np.bincount(ids, minlength=shape.num_experts)
    return counts


def evaluate(plan: Plan, shape: ModelShape, meas: Measurements, trace: np.ndarray,
             popular: np.ndarray | None = None) -> SimResult:
    """`plan` simulated on `trace`; its static experts are the most popular by `popular` [layers, experts] (default:
    the trace's own counts)."""
    counts = trace_counts(shape, trace) if popular is None else popular
    static = tuple(most_popular(counts, plan.static_experts)) if plan.static_experts else ()
    recall = meas.predictor_recall.get(str(plan.prefetch), ())[: plan.prefetch_depth] if plan.prefetch_depth else ()
    policy = Candidate(plan.accelerator, plan.strategy, static, tuple(shape.moe_layers[: plan.cache_indexes]),
                       plan.cache_ways, CachePolicy(plan.cache_policy), recall=tuple(recall))
    return simulate(trace, sim_costs(shape, meas, plan.threads, plan.accelerator), policy, shape.expert_bytes,
                    shape.num_experts)


SYNTHETIC_STEPS = 64  # decode tokens of a synthetic trace


def family_trace(shape: ModelShape, steps: int = SYNTHETIC_STEPS, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A decode trace [steps, layers, top_k] drawn from the family's routing statistics, and the popularity
    [layers, experts] it was drawn from."""
    stats = routing_stats(shape.family)
    table = popularity(shape.num_layers, shape.num_experts, stats.skew, seed)
    trace = synthetic_trace(steps, shape.num_layers, shape.num_experts, shape.top_k, stats.reuse, seed=seed,
                            sparse=shape.sparse, table=table)
    return trace, table


def make_plan(shape: ModelShape, meas: Measurements, trace: np.ndarray | None = None, keep: int = 5) -> PlanResult:
    """The plan with the highest predicted decode tokens/s, and the runners-up. Without a recorded trace, one drawn
    from the family's routing statistics (routing.py), whose static experts are the most popular by the
    statistics themselves: chosen from the trace they are judged on, they would look better than they are."""
    popular = None
    if trace is None:
        trace, popular = family_trace(shape)
    scored = [(plan, evaluate(plan, shape, meas, trace, popular)) for plan in candidates(shape, meas)]
    scored.sort(key=lambda pr: (-pr[1].tok_s, pr[0].threads))
    ahead = plan_prefetch(scored, shape, meas, trace, popular)
    if ahead.get("chosen"):
        chosen = ahead.pop("chosen")
        scored.insert(0, chosen)
    best, result = scored[0]
    alternatives = [{"plan": p.to_dict(), "predicted_tok_s": round(r.tok_s, 2), "hit_rate": round(r.hit_rate, 4)}
                    for p, r in itertools.islice(scored[1:], keep)]
    return PlanResult(best, result.tok_s, result.hit_rate, alternatives, ahead)


PREFETCH_BASES = 3  # the fastest placements with a cache that prefetch is tried on
BREAK_EVEN = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1)  # shares of the measured recall tried for the break-even


def plan_prefetch(scored: list[tuple[Plan, SimResult]], shape: ModelShape, meas: Measurements, trace: np.ndarray,
                  popular: np.ndarray | None) -> dict[str, Any]:
    """Each measured predictor at each depth (1..3) on the fastest placements with a cache: the fastest of them
    (`chosen`: plan and result, when it beats the best plan without prefetch), each one's predicted tokens/s, and
    the precision below which the chosen one stops paying (its recall scaled down until it no longer beats that
    placement without prefetch). Nothing to try (no accelerator, no cache, no predictor measured): says why."""
    if not meas.predictor_recall:
        return {"why": "no predictor accuracy measured (tandem autotune measures it)"}
    # the fastest with a cache, and the fastest of each geometry whose ways hold part of a layer (where guesses can
    # land: a cache holding whole layers never misses there)
    cached = [(p, r) for p, r in scored if p.accelerator and p.cache_indexes]
    bases = cached[:PREFETCH_BASES]
    seen_geometry: set[tuple[int, int, int]] = set()
    for p, r in cached:
        geometry = (p.cache_indexes, p.cache_ways, p.static_experts)
        if p.cache_ways < shape.num_experts and geometry not in seen_geometry and (p, r) not in bases \
                and len(seen_geometry) < PREFETCH_BASES:
            seen_geometry.add(geometry)
            bases.append((p, r))
    if not bases:
        return {"why": "no plan with an expert cache to prefetch into"}
    best_tok_s = scored[0][1].tok_s
    tried = []
    for base, base_result in bases:
        for kind, recall in sorted(meas.predictor_recall.items()):
            for depth in range(1, min(3, len(recall)) + 1):
                plan = replace(base, prefetch=PredictorKind(kind), prefetch_depth=depth)
                tried.append((plan, evaluate(plan, shape, meas, trace, popular), base_result))
    tried.sort(key=lambda t: -t[1].tok_s)
    by_gain = sorted(tried, key=lambda t: -t[1].tok_s / t[2].tok_s if t[2].tok_s else 0.0)
    rows = [{"predictor": str(p.prefetch), "depth": p.prefetch_depth,
             "placement": f"{p.strategy} {p.cache_indexes}x{p.cache_ways} {p.cache_policy}, {p.static_experts} static",
             "predicted_tok_s": round(r.tok_s, 2),
             "hit_rate": round(r.hit_rate, 4), "gain": round(r.tok_s / b.tok_s, 3) if b.tok_s else 0.0,
             "prefetches_per_token": round(r.prefetches / max(1, len(trace)), 2),
             "used": round(r.prefetch_used / r.prefetches, 3) if r.prefetches else 0.0}
            for p, r, b in tried[:6] + [t for t in by_gain[:6] if t not in tried[:6]]]
    plan, result, base = tried[0]
    gain = result.tok_s / best_tok_s if best_tok_s else 0.0
    out: dict[str, Any] = {"tried": rows, "gain_over_best_without": round(gain, 3)}
    if result.tok_s <= best_tok_s:
        top, top_result, top_base = by_gain[0]
        top_gain = top_result.tok_s / top_base.tok_s if top_base.tok_s else 0.0
        out["why"] = (f"none: the fastest plan with it ({plan.prefetch} {plan.prefetch_depth} ahead) is predicted at "
                      f"{gain:.2f}x of the best without; its largest gain, {top.prefetch} {top.prefetch_depth} ahead "
                      f"on {top.cache_indexes}x{top.cache_ways} slots, {top_gain:.2f}x, "
                      f"is over a placement slower than the best ({top_result.tok_s:.1f} against "
                      f"{best_tok_s:.1f} tok/s)")
        return out
    recall = meas.predictor_recall[str(plan.prefetch)]
    floor = recall[0]
    for share in BREAK_EVEN:  # lower accuracy until prefetch no longer beats its placement without it
        weaker = replace(meas, predictor_recall={**meas.predictor_recall,
                                                 str(plan.prefetch): [x * share for x in recall]})
        if evaluate(plan, shape, weaker, trace, popular).tok_s <= base.tok_s:
            break
        floor = recall[0] * share
    plan = replace(plan, prefetch_min_precision=round(floor, 3))
    out.update(chosen=(plan, result), why=f"{plan.prefetch} {plan.prefetch_depth} ahead is predicted at {gain:.2f}x "
               f"of the best plan without prefetch; it pauses while its precision is under {floor:.2f}")
    return out
