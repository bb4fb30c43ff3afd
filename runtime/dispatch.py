"""Where each expert runs: Fiddler's per-expert choice over static placement and a set-associative cache.

After the router of a MoE layer, for each expert with s > 0 tokens:
  1. resident on the accelerator (static placement, or a ready cache slot) -> run there;
  2. else if the strategy says so (`fetch`, or `fiddler` when cpu_lat(s) > gpu_lat(s) + transfer_lat)
     -> copy its weights over (into the cache if the layer is covered, else a scratch buffer), run there;
  3. else ship the activations to the CPU, run it there, ship the result back; if the layer is covered by
     the cache, post-fetch the weights in the background for later tokens (collaborative inference).
On the accelerator a layer synchronises the host once: right after the router, one copy of the routing result
and the activations to host memory. The accelerator experts are then queued, the CPU experts run meanwhile, and
their sum is added on the device behind the accelerator's (the emulated device joins with one more wait).

Letters: T tokens in this pass, H hidden size, E experts, K experts per token, n tokens of one expert.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.nn.functional as F

from tandem.kernels.experts import CpuExpert, CpuOptions, Epilogue, epilogue_for, glu
from tandem.kernels.quant import QuantizedMatrix
from tandem.runtime.accelerator import Accelerator, Copy, HostRead, done
from tandem.runtime.choices import Strategy
from tandem.runtime.config import ModelConfig
from tandem.runtime.expert_cache import DEFAULT_INFLIGHT, CachePolicy, ExpertCache, Key, Slot
from tandem.runtime.latency import LatencyModel
from tandem.runtime.layers import plan
from tandem.runtime.moe import BlockExpert, ExpertWeights, MoEBlockWeights, MXFP4Expert, route, routed_input
from tandem.runtime.prefetch import (
    EamCollection,
    EamMatch,
    PrecisionGate,
    Predictor,
    PredictorKind,
    PrefetchOptions,
    Scorer,
    make_predictor,
)
from tandem.runtime.readahead import in_files, spans, will_need
from tandem.runtime.timeline import Timeline
from tandem.runtime.trace import TraceRecorder

if TYPE_CHECKING:
    from tandem.runtime.model import DecoderWeights, ModelRun

GPU, CPU, FETCHED = 0, 1, 2  # columns of the per-layer statistics
RESERVE = 50  # 1/RESERVE of the accelerator's budget is kept back from the expert slots: activations, allocator slack
SLAB_BYTES = 1 << 30  # expert slots are cut from allocations of at most this size (the allocator rounds each by 2 MiB)
SLOT_ALIGN = 64  # bytes: where each tensor of a slot starts (any dtype's view, the device's vector loads)
# A pass of at most this many tokens runs a layer's resident SwiGLU experts on the accelerator as one batched product
# over all its tokens (each expert's weights stacked: a copy), not expert by expert: a decode token's layer is then
# about a dozen kernels instead of ten an expert, and a GPU decoding a MoE model is bound by how many kernels the host
# launches (11-14 us each on an H200 machine: docs/bench/gpu). The stacked copy costs the experts' bytes again.
GROUPED_TOKENS = 8
SAVE_EVERY_S = 60.0  # the EAM collection is written at most this often between requests (and at close)


@dataclass(frozen=True)
class OffloadOptions:
    strategy: Strategy = Strategy.FIDDLER
    cache_ways: int | None = None  # None: static experts, when given, take the slots (no cache); else the slots
    # spread over as many layers as they cover (default_ways)
    cache_policy: CachePolicy = CachePolicy.LRU
    static: tuple[Key, ...] = ()  # experts pinned on the accelerator, most popular first
    max_inflight: int = DEFAULT_INFLIGHT  # background post-fetch copies in flight at most
    cost: LatencyModel | None = None  # None: LatencyModel.from_bandwidths on the expert's size
    prefetch: PrefetchOptions = PrefetchOptions()  # experts copied ahead of their routers (runtime/prefetch.py)


@dataclass
class DispatchStats:
    num_layers: int
    num_experts: int = 0
    per_layer: np.ndarray = field(init=False)  # [layers, 3] executions on gpu / cpu / fetched
    per_expert: np.ndarray = field(init=False)  # [layers, experts, 3] the same, per expert
    hits: int = 0
    misses: int = 0

    def __post_init__(self) -> None:
        self.per_layer = np.zeros((self.num_layers, 3), dtype=np.int64)
        self.per_expert = np.zeros((self.num_layers, max(1, self.num_experts), 3), dtype=np.int64)

    def count(self, layer: int, expert: int, where: int) -> None:
        self.per_layer[layer, where] += 1
        self.per_expert[layer, expert, where] += 1

    def count_all(self, layer: int, used: np.ndarray, where: int) -> int:
        """One execution at `where` for each expert of `layer` that `used` [experts] marks; returns how many."""
        n = int(np.count_nonzero(used))
        self.per_layer[layer, where] += n
        self.per_expert[layer, :, where] += used
        return n

    def count_layers(self, used: np.ndarray, where: int) -> int:
        """count_all for every layer at once: `used` [layers, experts]; returns how many executions in all."""
        n = np.count_nonzero(used, axis=1)  # [layers]
        self.per_layer[:, where] += n
        self.per_expert[:, :, where] += used
        return int(n.sum())

    bytes_h2d: int = 0  # bytes moved during this request (set by the dispatcher when asked)
    bytes_d2h: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

    def as_dict(self) -> dict[str, object]:
        gpu, cpu, fetched = (int(x) for x in self.per_layer.sum(0))
        return {
            "experts": {"gpu": gpu, "cpu": cpu, "fetched": fetched},
            "cache": {"hits": self.hits, "misses": self.misses, "hit_rate": round(self.hit_rate, 4)},
            "bytes_h2d": self.bytes_h2d,
            "bytes_d2h": self.bytes_d2h,
            "per_layer": {str(i): {"gpu": int(r[GPU]), "cpu": int(r[CPU]), "fetched": int(r[FETCHED])}
                          for i, r in enumerate(self.per_layer) if r.any()},
        }


def stored_tensors(w: CpuExpert) -> list[torch.Tensor]:
    """The tensors a CPU expert's weights are read from (a quantized matrix's codes and scales)."""
    mats = (w.gate, w.up, w.down)
    return [m.data if isinstance(m, QuantizedMatrix) else m for m in mats] + \
        [m.scales for m in mats if isinstance(m, QuantizedMatrix)]


def budget_for_slots(fixed: int, slots: int, expert_bytes: int) -> float:
    """The accelerator budget, in bytes, in which the dispatcher makes exactly `slots` expert slots of
    `expert_bytes` each, beside `fixed` bytes placed before them (non-expert weights, KV cache, scratch buffer):
    what they need, plus half an expert so that rounding the budget down never costs a slot, plus the reserve."""
    return (fixed + slots * expert_bytes + expert_bytes // 2) * RESERVE / (RESERVE - 1)


def slot_budget(budget: int, used: int) -> int:
    """The bytes the expert slots get of an accelerator `budget` once `used` bytes are placed (the model's own and
    the scratch expert): all but the reserve."""
    return max(0, budget - used - budget // RESERVE)


def default_ways(slots: int, layers: int, experts: int, top_k: int) -> int:
    """Ways per index when none is asked for: at least top-k (a token's experts must fit together), enough
    to spread the slots over every layer when they can, and as few slots left unused as possible."""
    if slots <= top_k:
        return slots
    low = min(experts, max(top_k, -(-slots // layers)))
    return max(range(low, min(experts, slots) + 1), key=lambda w: (min(layers, slots // w) * w, -w))


@dataclass
class Pending:
    """A MoE layer between `Dispatcher.start` and `finish`: the accelerator's resident experts queued (`out`, the
    future of their output), the CPU's experts and the accelerator's copied ones (`later`) still to run."""

    layer: int
    out: Future[torch.Tensor]
    x_h: torch.Tensor | None = None  # host activations [T, H] and routing weights [T, K] for the CPU experts
    weights_h: torch.Tensor | None = None
    cpu_jobs: list[_Job] = field(default_factory=list)
    in_use: frozenset[Key] = frozenset()  # the layer's experts on the accelerator: no post-fetch evicts them
    later: _Launch | None = None


@dataclass
class _Launch:
    """The accelerator's experts of a layer that wait for a copy of their weights (into a cache slot, or through the
    scratch buffer), queued only once the CPU's experts have run: queuing work behind a copy holds the host until the
    copy itself is queued (CUDA's stream can only wait for an event already recorded), which can take as long as the
    copies before it, and the CPU's experts would wait that long to start."""

    x: torch.Tensor  # [T, H] and the float32 routing weights [T, K], on the device
    weights: torch.Tensor
    jobs: list[tuple[_Job, torch.Tensor, torch.Tensor]]  # each with its token rows and choice columns on the device
    held: frozenset[Key] = frozenset()  # their cache slots: no copy may replace them before their kernels are queued


@dataclass(frozen=True)
class _Job:
    expert: int
    tok: torch.Tensor  # [n] token rows
    slot: torch.Tensor  # [n] which of the token's K choices
    weights: ExpertWeights | None  # device weights, or None = copy the expert (Dispatcher._source) into scratch first
    layer: int
    cpu: CpuExpert  # how it runs on the CPU
    after: tuple[Copy, ...] = ()  # copies the device waits for before it runs this expert


class Dispatcher:
    """Runs every MoE layer's experts; owns the accelerator's expert slots, the cache and the statistics."""

    def __init__(self, cfg: ModelConfig, weights: DecoderWeights, run: ModelRun, accel: Accelerator | None = None,
                 policy: OffloadOptions | None = None, cpu: CpuOptions | None = None) -> None:
        """`weights`: the model's, whose routed layers (as the config's plan says) it runs, their routers and
        routers' biases through the weights' dense-matrix runner (F.linear without one); `run`: the model's (its
        compute dtype, and the CPU experts' where that differs)."""
        blocks: dict[int, MoEBlockWeights] = {i: layer.ffn for i, (layer, kinds)  # type: ignore[misc]
                                              in enumerate(zip(weights.layers, plan(cfg), strict=True))
                                              if kinds.ffn.routed}
        self.cfg, self.blocks, self.dtype, self.accel = cfg, blocks, run.dtype, accel
        self.linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor] = \
            weights.linear or F.linear
        # Every expert that runs on the CPU runs through the kernels' executor (quantized here if asked), in the
        # run's CPU dtype where the device's dtype is not one the CPU computes (fp16)
        self.executor = (cpu or CpuOptions()).executor(cfg.hidden_size, cfg.moe_intermediate_size,
                                                       run.cpu_dtype or run.dtype)
        self.resident = bool(cpu and cpu.experts_in_ram)  # experts read into RAM (else memory-mapped or quantized)
        # an expert the kernels do not compute (gpt-oss's) runs its own torch code at every token count
        self.cpu_experts: dict[int, list[CpuExpert]] = {
            layer: [self._cpu_expert(w) for w in block.experts] for layer, block in blocks.items()
        }
        self.cpu_layers = {layer: self.executor.layer(experts) for layer, experts in self.cpu_experts.items()}
        self.policy = policy or OffloadOptions()
        self.stats = DispatchStats(cfg.num_layers, cfg.num_experts)
        self.recorder = TraceRecorder(cfg.num_layers, cfg.num_experts, cfg.top_k)
        self.static: dict[Key, ExpertWeights] = {}
        self.slot_buffers: list[ExpertWeights] = []
        self.cache = ExpertCache([], 0, self.policy.cache_policy, self.policy.max_inflight)
        self.cost = self.policy.cost
        self._bytes_base = (0, 0)
        self.last_chosen: dict[int, list[int]] = {}  # each layer's experts at its last pass (for prefetch)
        self._held: frozenset[Key] = frozenset()  # cache slots a started layer's queued-later experts will read
        self.timeline: Timeline | None = None  # set by a benchmark: the device's and the CPU's expert runs and each
        # layer's whole call recorded as spans
        self.pinned_bytes = 0  # host memory of the experts pinned for the accelerator's copies
        # layers whose experts all sit in static slots of one slab, in id order: views [E, ...] of each of their
        # tensors over those slots, so that a pass can pick a token's experts on the device, without a host read
        self._stacked: dict[int, list[torch.Tensor]] = {}
        self._unread: list[tuple[int, HostRead]] = []  # such layers' routings, read once the step's logits are
        # Prediction of the layers ahead (runtime/prefetch.py): MoE layers counted among themselves
        self.moe_layers = sorted(blocks)
        self.moe_index = {layer: m for m, layer in enumerate(self.moe_layers)}
        self.predictor: Predictor | None = None
        self.scorer: Scorer | None = None
        self.prefetch_gate = PrecisionGate(self.policy.prefetch.min_precision)
        self.prefetching = False  # predicted experts copied ahead (accelerator tier), not only predicted
        self._layer_ms = 0.0  # a single-token pass's time from one MoE layer's start to the next's (moving average)
        self._last_start = 0.0
        self._credit = 0.0  # bytes of idle copy-engine time banked for prefetches
        self._saved: Path | None = None  # the EAM collection's file, saved to now and then and at close
        self._saved_at = 0.0
        self.notices: list[str] = []  # what the user should be told (a saved collection set aside)
        self.reading_ahead = False
        self.readaheads = 0  # experts whose pages were advised
        self._spans: dict[Key, list[tuple[int, int]]] = {}  # each expert's page ranges in its file
        self._h2d_seen = self._prefetched = 0  # bytes copied to the device when last looked, prefetched since
        self.slot_bytes = 0  # from one expert slot to the next (set with the slots)
        self.micro_batches = 1  # the current pass's pipelined parts (begin_step)
        self._file_backed: bool | None = None
        if accel is not None:
            self._allocate(accel)
            self._bytes_base = (accel.bytes_h2d, accel.bytes_d2h)
            self._h2d_seen = accel.bytes_h2d  # (the load's copies take nothing from a decode's bus)
        # experts left in their files (CPU only, --readahead): each layer's read ahead once its router has chosen them,
        # in large requests, while the CPU still faults in the first pages (docs/bench/prefetch: 1.7x decode when
        # every token reads its experts from the disk); with --prefetch, its guesses of the layers ahead too
        self.reading_ahead = accel is None and self.policy.prefetch.readahead and self.file_backed
        if self.policy.prefetch.on and (self.cache.slots if accel is not None else self.reading_ahead):
            self.predict(self.policy.prefetch.predictor, self.policy.prefetch.depth, prefetch=True,
                         saved=self.policy.prefetch.collection)

    def predict(self, kind: PredictorKind, depth: int, prefetch: bool = False,
                collection: EamCollection | None = None, saved: Path | None = None) -> None:
        """Predict each single-token pass's experts `depth` MoE layers ahead with `kind`, scoring every guess
        (`scorer.accuracy`); `prefetch`: and copy them into the cache ahead (the accelerator tier). The EAM
        predictor's `collection` (default: a new one), read from and kept in `saved` where given."""
        if kind is PredictorKind.EAM and saved is not None:
            collection = EamCollection(len(self.moe_layers), self.cfg.num_experts)
            notice = collection.load(saved)
            if notice:
                self.notices.append(notice)
        self._saved, self._saved_at = (saved, time.monotonic()) if kind is PredictorKind.EAM else (None, 0.0)
        self.predictor = make_predictor(kind, len(self.moe_layers), self.cfg.num_experts, self.cfg.top_k, collection)
        self.scorer = Scorer(depth) if self.predictor is not None else None
        self._fresh = Scorer(depth)  # the guesses prefetch would copy (not on the device yet)
        self.fresh = PrecisionGate(0.0)  # how often those came true (recently)
        self.reuse = PrecisionGate(0.0)  # how many of a layer's experts the previous token chose too (recently)
        self._last_sets: dict[int, set[int]] = {}
        self.prefetching = prefetch and self.predictor is not None and self.accel is not None

    # -- set-up -------------------------------------------------------------------------------
    def _cpu_expert(self, w: ExpertWeights) -> CpuExpert:
        if isinstance(w, MXFP4Expert):  # 4-bit as stored, biases and clamped SwiGLU in the kernel
            return self.executor.prepare_quantized(
                *w.matrices(), Epilogue(w.gate_bias, w.up_bias, w.down_bias, (w.alpha, w.limit)))
        if isinstance(w, BlockExpert):  # GGUF blocks as the file stores them
            return self.executor.prepare_quantized(*w.matrices(), epilogue_for(w.act))
        return self.executor.prepare(w.gate, w.up, w.down, reference=None if w.kernel_ready else w,
                                     epilogue=epilogue_for(w.act))

    def _source(self, layer: int, e: int) -> ExpertWeights:
        """What an accelerator copy of expert `e` of `layer` is made from: the expert as stored, or, where the CPU
        runs it quantized by `--quant` (int8, int4: the kernels' own formats), its quantized weights dequantized,
        so that it computes the same function on either side whatever the copies' timing decides."""
        stored = self.blocks[layer].experts[e]
        cpu = self.cpu_experts[layer][e]
        if type(stored) is ExpertWeights and isinstance(cpu.gate, QuantizedMatrix):
            return ExpertWeights(*cpu.dense(self.dtype), stored.act)
        return stored

    def _slot_dtype(self, t: torch.Tensor) -> torch.dtype:
        """An accelerator copy of an expert tensor: floats in the compute dtype, packed codes and scales as they are."""
        return self.dtype if t.is_floating_point() else t.dtype
    def _expert_shapes(self) -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
        h, i = self.cfg.hidden_size, self.cfg.moe_intermediate_size
        return (i, h), (i, h), (h, i)

    def _slot_layout(self) -> tuple[list[tuple[tuple[int, ...], torch.dtype, int]], int]:
        """How an accelerator copy of one expert, every tensor of the model's kind of expert (gpt-oss's biases too;
        MXFP4's codes and scales as stored), lies in memory: each tensor's (shape, dtype, offset in bytes), each on a
        SLOT_ALIGN boundary, and the bytes from one slot to the next."""
        template = self._template()
        specs = [(s, self.dtype) for s in self._expert_shapes()] if template is None or type(template) is \
            ExpertWeights else [(tuple(t.shape), self._slot_dtype(t)) for t in template.tensors()]
        layout, at = [], 0
        for shape, dtype in specs:
            layout.append((tuple(shape), dtype, at))
            at += -(-math.prod(shape) * dtype.itemsize // SLOT_ALIGN) * SLOT_ALIGN
        return layout, at

    def _template(self) -> ExpertWeights | None:
        return next((b.experts[0] for b in self.blocks.values() if b.experts), None)

    def _new_buffers(self, accel: Accelerator, count: int, what: str, group: int = 1) -> list[ExpertWeights]:
        """`count` empty experts on the accelerator, of the model's kind of expert, cut from slabs of at most
        SLAB_BYTES (one allocation for many slots: the device's allocator would round each expert's tensors on
        their own, up to a fifth more than they take, where the budget counts their bytes), each slab a whole number
        of `group`s of slots where it holds one (a layer's experts in one slab)."""
        layout, stride = self._slot_layout()
        template = self._template()
        per_slab = max(1, SLAB_BYTES // stride)
        per_slab = per_slab // group * group or per_slab
        out: list[ExpertWeights] = []
        for first in range(0, count, per_slab):
            n = min(per_slab, count - first)
            name = what if count == 1 else f"{what} {first}" + (f"-{first + n - 1}" if n > 1 else "")
            slab = accel.slab(n * stride, name)
            for k in range(n):
                tensors = [slab[k * stride + at : k * stride + at + math.prod(shape) * dtype.itemsize]
                           .view(dtype).view(shape) for shape, dtype, at in layout]
                out.append(ExpertWeights(*tensors, act=self.cfg.activation)
                           if template is None or type(template) is ExpertWeights
                           else template.like(tensors))
        return out

    def _stack_layers(self, static: tuple[Key, ...], stride: int) -> None:
        """For each layer whose experts are all static, in id order in consecutive slots of one slab: views over
        those slots, [E, ...] per tensor of a slot (no copy)."""
        if type(self._template()) is not ExpertWeights:
            return
        E = self.cfg.num_experts
        where = {key: n for n, key in enumerate(static)}
        for layer in self.blocks:
            slots = [where.get((layer, e)) for e in range(E)]
            if any(n is None for n in slots) or slots != list(range(slots[0], slots[0] + E)):  # type: ignore[operator]
                continue
            first = self.slot_buffers[slots[0]].tensors()  # type: ignore[index]
            last = self.slot_buffers[slots[-1]].tensors()  # type: ignore[index]
            if any(a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr() for a, b in zip(first, last,
                                                                                                   strict=True)):
                continue  # (across two slabs)
            self._stacked[layer] = [t.as_strided((E, *t.shape), (stride // t.element_size(), *t.stride()))
                                    for t in first]

    def _allocate(self, accel: Accelerator) -> None:
        """Scratch buffer, then as many expert slots as the remaining budget (minus a reserve) holds."""
        cfg, policy = self.cfg, self.policy
        item = torch.empty((), dtype=self.dtype).element_size()
        # an accelerator copy of one expert: every tensor of the model's kind of expert (gpt-oss's biases included;
        # MXFP4's codes and scales as stored, 4.25 bits a weight)
        template = self._template()
        expert_bytes = sum(t.numel() * self._slot_dtype(t).itemsize for t in template.tensors()) \
            if template is not None else 3 * cfg.hidden_size * cfg.moe_intermediate_size * item
        if self.cost is None:
            self.cost = LatencyModel.from_bandwidths(expert_bytes, 6 * cfg.hidden_size * cfg.moe_intermediate_size)
        self.scratch = self._new_buffers(accel, 1, "the expert scratch buffer")[0]
        self.slot_bytes = self._slot_layout()[1]
        slots = slot_budget(accel.budget, accel.used) // self.slot_bytes
        moe_layers = [i for i in range(cfg.num_layers) if cfg.sparse_layers[i]]
        every = tuple((layer, e) for layer in moe_layers for e in range(cfg.num_experts))
        slots = min(slots, len(every))
        static = policy.static
        if not static and policy.cache_ways is None and slots == len(every):
            static = every  # every expert fits: each placed once at load, never a miss, a copy or a host wait for one
        n_static = min(len(static), slots if policy.cache_ways is None else slots // 2)
        cache_slots = slots - n_static
        ways = policy.cache_ways
        if ways is None:
            ways = 0 if static else default_ways(cache_slots, len(moe_layers), cfg.num_experts, cfg.top_k)
        ways = min(ways, cfg.num_experts, cache_slots)
        indexes = min(len(moe_layers), cache_slots // ways) if ways else 0
        self.cache = ExpertCache(moe_layers[:indexes], ways if indexes else 0, policy.cache_policy,
                                 policy.max_inflight, first_slot=n_static)
        self.slot_buffers = self._new_buffers(accel, n_static + self.cache.slots, "expert slots",
                                              cfg.num_experts if static is every else 1)
        # Experts in RAM pinned: copies go straight from them, not through a copier's memcpy into a staging buffer
        if self.resident:
            self.pinned_bytes = accel.pin([t for b in self.blocks.values() for w in b.experts for t in w.tensors()])
        for n, (layer, e) in enumerate(static[:n_static]):
            accel.copy_now(self._tensors(self.slot_buffers[n]), self._tensors(self._source(layer, e)))
            self.static[(layer, e)] = self.slot_buffers[n]
        self._stack_layers(static[:n_static], self.slot_bytes)

    @staticmethod
    def _tensors(w: ExpertWeights) -> list[torch.Tensor]:
        return w.tensors()

    def describe(self) -> dict[str, object]:
        return {
            "accelerator": self.accel.name if self.accel else "none",
            "strategy": self.policy.strategy.value,
            "static_experts": len(self.static),
            "cache": {"indexes": self.cache.indexes, "ways": self.cache.ways, "policy": self.cache.policy.value},
            "cpu": {"threads": self.executor.threads, "crossover": self.executor.crossover,
                    "quant": self.executor.quant or "none", "best_kernel": (self.executor.isas or ["torch"])[-1],
                    "resident": self.resident},
            "pinned_bytes": self.pinned_bytes,
            "budget_bytes": self.accel.budget if self.accel else 0,
            "used_bytes": self.accel.used if self.accel else 0,
        }

    # -- per request / per step ---------------------------------------------------------------
    def begin_request(self) -> None:
        """Per-request trace, TRACE-policy counts and statistics start afresh."""
        self.recorder.new_request()
        self.cache.new_request()
        if self.accel is not None:  # a prompt's copies are not what a decode's layer leaves the bus
            self._h2d_seen, self._prefetched, self._credit = self.accel.bytes_h2d, 0, 0.0
        if self.predictor is not None and self.scorer is not None:
            self.predictor.new_request()
            self.scorer.drop()
            self._fresh.drop()
            self._last_sets.clear()
            if self._saved is not None and time.monotonic() - self._saved_at > SAVE_EVERY_S:
                self._save_collection()
        self.stats = DispatchStats(self.cfg.num_layers, self.cfg.num_experts)
        self._bytes_base = (self.accel.bytes_h2d, self.accel.bytes_d2h) if self.accel else (0, 0)

    def request_stats(self) -> DispatchStats:
        """This request's statistics, with the bytes moved since it began."""
        if self.accel is not None:
            self.stats.bytes_h2d = self.accel.bytes_h2d - self._bytes_base[0]
            self.stats.bytes_d2h = self.accel.bytes_d2h - self._bytes_base[1]
        return self.stats

    def begin_step(self, phase: str, micro_batches: int = 1) -> None:
        """A forward pass begins; `micro_batches`: the pipelined parts it runs each layer in (guesses are made only
        for a pass of one token in one part: their state is one sequence's)."""
        self.recorder.begin_step(phase)
        self.micro_batches = micro_batches

    def _save_collection(self) -> None:
        """The EAM collection to its file (the request under way joins it when it ends). A failed write costs only
        the guesses of a later run: said once, not raised."""
        assert self._saved is not None and isinstance(self.predictor, EamMatch)
        self._saved_at = time.monotonic()
        try:
            self.predictor.collection.save(self._saved)
        except OSError as e:
            self.notices.append(f"could not save the activation collection {self._saved} ({e.strerror or e}); "
                                "prefetch guesses start afresh next time")
            self._saved = None

    def close(self) -> None:
        """Finish background copies, release the accelerator and the experts' memory (RAM copies included):
        the model cannot generate afterwards. The EAM collection is saved with the request under way."""
        if self._saved is not None and isinstance(self.predictor, EamMatch):
            self.predictor.new_request()
            self._save_collection()
        if self.accel is not None:
            self.cache.wait_all()
            self.accel.close()
        for block in self.blocks.values():
            block.experts.clear()
        self.cpu_experts.clear()
        self.cpu_layers.clear()

    # -- the MoE layer ------------------------------------------------------------------------
    def __call__(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] (on the accelerator if there is one) -> the layer's MoE output [T, H], same device."""
        if self.timeline is None:
            return self.finish(self.start(layer, x))
        with self.timeline.span("moe"):  # the whole layer, as the caller waits for it
            return self.finish(self.start(layer, x))

    def start(self, layer: int, x: torch.Tensor, router_x: torch.Tensor | None = None) -> Pending:
        """The layer's first half: routing, the plan, and the accelerator's experts queued (not waited for). The host
        is free until `finish`: a pipelined pass runs another micro-batch's attention meanwhile. CPU only: the whole
        layer, now. `router_x`: what the router reads where it is not what the experts take (Gemma 4's)."""
        block = self.blocks[layer]
        logits = self.linear(x if router_x is None else router_x, block.router, block.router_bias)  # [T, E]
        weights, ids = route(logits, block.rule, block.correction)  # [T, K], [T, K]
        if block.expert_scale is not None:  # each chosen expert's own factor (Gemma 4's per_expert_scale)
            weights = weights * block.expert_scale[ids]
        routed, weights = routed_input(x, weights, block.rule)  # the shared expert takes x itself
        single = ids.shape[0] == 1 and self.micro_batches == 1 and self.predictor is not None
        ahead = self._stale_gate(layer, x if router_x is None else router_x) if single else []
        if self.accel is None:  # CPU only: every expert through the executor
            guesses = self._predict(layer, ids.numpy(), [a.numpy() for a in ahead], single) \
                if self.predictor is not None else []
            if self.reading_ahead:  # this layer's own experts first (known now, read in large requests)
                self._read_ahead([(layer, np.unique(ids.numpy()).tolist()), *guesses])
            counts = self.record_cpu(layer, ids)  # [E] routings per expert
            table = self.cpu_layers[layer]
            if self.executor.serves_layer(table, x.shape[0]):  # a few tokens: the whole layer in one kernel call
                out = self.executor.run_layer(table, routed, ids, weights)  # [T, H] float32
            else:
                jobs = []
                for e in np.flatnonzero(counts).tolist():  # the experts this pass uses, in id order
                    tok, slot = (ids == e).nonzero(as_tuple=True)  # [n], [n]
                    jobs.append(_Job(e, tok, slot, None, layer, self.cpu_experts[layer][e]))
                out = self._cpu_combine(routed, weights, jobs)
            if block.shared is not None:
                out += block.shared(x)
            return Pending(layer, done(out))
        stacked = self._stacked.get(layer)
        if stacked is not None and ids.numel() <= GROUPED_TOKENS:  # every expert here: chosen on the device
            self._unread.append((layer, self.accel.download(lambda: (ids,))))  # for the trace, read later
            return Pending(layer, self.accel.submit(partial(self._device_chosen, block, stacked, x, routed, ids,
                                                            weights, self.cfg.activation)))
        # the layer's one host read: the routing for the plan, the activations for the CPU experts
        ids_h, weights_h, x_h, *ahead_h = self.accel.download(lambda: (ids, weights, routed, *ahead)).wait()
        # [T, K], [T, K], [T, H], the stale gate's [T, K] per layer ahead
        guesses = self._predict(layer, ids_h.numpy(), [a.numpy() for a in ahead_h], single) \
            if self.predictor is not None else []
        counts = self.recorder.record(layer, ids_h)  # [E] routings per expert
        chosen = np.flatnonzero(counts).tolist()  # the experts this pass uses, in id order
        self.last_chosen[layer] = sorted(chosen, key=lambda e: -counts[e])  # the busiest first
        if self.cache.policy is CachePolicy.TRACE:
            for e in chosen:
                self.cache.observe(layer, e, int(counts[e]))
        gpu_jobs, cpu_jobs = self._plan(layer, ids_h.numpy(), chosen)
        out, later = self._launch_device(x, routed, weights, weights_h, gpu_jobs, block)  # queued: the host goes on
        if guesses and self.prefetching and self.prefetch_gate.open:
            self._prefetch(guesses, frozenset((layer, e) for e in chosen))
        return Pending(layer, out, x_h, weights_h, cpu_jobs, frozenset((layer, j.expert) for j in gpu_jobs), later)

    def _stale_gate(self, layer: int, x: torch.Tensor) -> list[torch.Tensor]:
        """The stale gate's guesses for a single-token pass at `layer`: the routers of the MoE layers ahead (up to
        the predictor's depth) on this layer's router input x [1, H] -> their choices [1, K] each, on x's device
        (read with this layer's routing)."""
        if self.predictor is None or self.predictor.kind is not PredictorKind.STALE_GATE or self.scorer is None:
            return []
        m = self.moe_index[layer]
        out = []
        for target in self.moe_layers[m + 1 : m + 1 + self.scorer.accuracy.depth]:
            block = self.blocks[target]
            out.append(route(self.linear(x, block.router, block.router_bias), block.rule, block.correction)[1])
        return out

    def _predict(self, layer: int, ids: np.ndarray, ahead: list[np.ndarray], single: bool
                 ) -> list[tuple[int, list[int]]]:
        """`layer` routed `ids` [T, K]: score the guesses made for it, let the predictor see it, and (a single-token
        pass) guess the layers ahead -> [(layer ahead, its experts)], nearest first."""
        assert self.predictor is not None and self.scorer is not None
        m = self.moe_index[layer]
        if single:
            now = time.perf_counter()
            if m and self._last_start:  # the time of a layer: what the copy engine has for prefetches meanwhile
                gap = (now - self._last_start) * 1e3
                self._layer_ms = gap if not self._layer_ms else 0.8 * self._layer_ms + 0.2 * gap
            self._last_start = now
            actual = np.unique(ids).tolist()
            self.prefetch_gate.add(*self.scorer.routed(m, actual))  # (as the planner priced it: every guess)
            self.fresh.add(*self._fresh.routed(m, actual))
            last = self._last_sets.get(m)
            if last is not None:
                self.reuse.add(len(actual), len(last.intersection(actual)))
            self._last_sets[m] = set(actual)
        self.predictor.observe(m, ids)
        if not single:
            return []
        out = []
        for d in range(1, min(self.scorer.accuracy.depth, len(self.moe_layers) - 1 - m) + 1):
            guess = self.predictor.predict(m, d, ahead)
            self.scorer.guess(m + d, d, guess)
            target = self.moe_layers[m + d]
            if self.prefetching:
                self._fresh.guess(m + d, d, [e for e in guess if (target, e) not in self.static
                                              and self.cache.find(target, e) is None])
            out.append((target, guess))
        return out

    def _prefetch(self, guesses: list[tuple[int, list[int]]], in_use: frozenset[Key]) -> None:
        """Copy guessed experts of the layers ahead into their cache slots on the background copier, nearest layer
        first, while the copy engine has idle time: each layer adds what the bus moves in the measured layer time
        (from the cost model's copy of one expert) and every byte copied meanwhile (demand copies, post-fetches,
        prefetches) is taken from it; a few layers' worth of guesses can be banked, no more. A guess never evicts
        an expert this layer uses, one a queued kernel will read, another guess of its own layer, or (where the
        previous token's choices are kept more often than guesses come true) one its layer chose at its last pass."""
        assert self.accel is not None
        size = self.slot_bytes
        transfer = self.cost.transfer_ms if self.cost is not None else 0.0
        bus = self._layer_ms / transfer * size if transfer > 0 else float(size)  # bytes the bus moves in a layer
        copied = self.accel.bytes_h2d - self._h2d_seen - self._prefetched  # others' bytes since the last layer
        self._h2d_seen, self._prefetched = self.accel.bytes_h2d, 0
        most = self.cfg.top_k * len(guesses) * size
        self._credit = max(-most, min(most, self._credit + bus - max(0, copied)))  # a few layers' worth either way
        # the experts a layer chose at its last pass stay while the next token keeps more of them than the guesses
        # it would copy turn out right (both measured): a slot holding one is then no low-priority slot
        protect = self.reuse.precision >= self.fresh.precision
        for target, experts in guesses:
            if not self.cache.covers(target):
                continue
            last = self.last_chosen.get(target, ()) if protect else ()
            keep = in_use | self._held | frozenset((target, e) for e in [*experts, *last])
            for e in experts:
                if self._credit < size or self.cache.inflight >= self.cache.max_inflight:
                    return
                if (target, e) in self.static or self.cache.find(target, e) is not None:
                    continue
                slot = self.cache.begin_fill(target, e, keep, prefetch=True)
                if slot is not None:
                    self._fill(slot, target, e, demand=False)
                    self._credit -= size
                    self._prefetched += size

    def _read_ahead(self, guesses: list[tuple[int, list[int]]]) -> None:
        """Start reading the experts' pages from their files (a model left in its files: the page cache may have
        dropped them), in the order given: the running layer's, then the guesses of the layers ahead."""
        for target, experts in guesses:
            for e in experts:
                key = (target, e)
                ranges = self._spans.get(key)
                if ranges is None:
                    ranges = self._spans[key] = spans(stored_tensors(self.cpu_experts[target][e]))
                self.readaheads += will_need(ranges) > 0

    @property
    def file_backed(self) -> bool:
        """Whether the CPU experts are read from their files' memory map (not RAM copies: read into RAM, quantized
        at load, MXFP4's 4-bit copies, or Llama 4's experts transposed at load)."""
        if self._file_backed is None:
            first = next((experts[0] for experts in self.cpu_experts.values() if experts), None)
            self._file_backed = first is not None and not self.resident and in_files(spans(stored_tensors(first)))
        return self._file_backed

    def expert_spans(self) -> list[tuple[int, int]]:
        """Every CPU expert's page ranges where they are read from files, else none (a benchmark drops them from
        memory between tokens: RAM copies must never be)."""
        if not self.file_backed:
            return []
        return [span for experts in self.cpu_experts.values() for w in experts for span in spans(stored_tensors(w))]

    def end_step(self) -> None:
        """After a step's logits are read: the routings of the layers that chose their experts on the device into
        the trace and the statistics (their copies have landed by now: no wait)."""
        for layer, read in self._unread:
            ids_h = read.collect()[0]  # [T, K]
            counts = self.recorder.record(layer, ids_h)
            n = self.stats.count_all(layer, counts > 0, GPU)
            self.stats.hits += n
            self.last_chosen[layer] = sorted(np.flatnonzero(counts).tolist(), key=lambda e: -counts[e])
        self._unread.clear()

    def finish(self, pending: Pending) -> torch.Tensor:
        """The layer's second half: its CPU experts, computed while the accelerator runs its own, added behind them
        on the device; then the post-fetches. Returns the output [T, H] for the caller's device work."""
        if self.accel is None:
            return pending.out.result()
        out = pending.out
        cpu_out = None
        if pending.cpu_jobs:
            x_h = pending.x_h.to(self.executor.dtype)  # type: ignore[union-attr]  # an fp16 device's in the CPU's
            combine = partial(self._cpu_combine, x_h, pending.weights_h, pending.cpu_jobs)
            if self.timeline is not None:
                combine = self.timeline.wrap("cpu_experts", combine)
            cpu_out = self.accel.to_device(combine())  # [T, H]
        if pending.later is not None:  # the copied experts, their copies made while the CPU computed
            out = self._launch_copied(out, pending.later)
        if cpu_out is not None:
            gpu_out = out
            out = self.accel.submit(lambda: gpu_out.result() + cpu_out)
        self._post_fetch(pending.layer, pending.cpu_jobs, keep=pending.in_use)
        return self.accel.join(out)  # [T, H]

    def prefetch(self, layer: int) -> None:
        """Bring `layer`'s experts its last pass chose into its cache slots on the background copier (a pipelined
        pass calls this for the next layer while the current one computes): batch steps choose much the same
        experts from one step to the next. The busiest first, no more than the layer has ways (more would evict each
        other), up to the in-flight cap; nothing without a cache over the layer."""
        if self.accel is None or not self.cache.covers(layer):
            return
        for e in self.last_chosen.get(layer, [])[: self.cache.ways]:
            if (layer, e) in self.static:
                continue
            if self.cache.inflight >= self.cache.max_inflight:
                break
            self._fill_in_background(layer, e, frozenset())

    def record_cpu(self, layer: int, ids: torch.Tensor) -> np.ndarray:
        """A CPU-only pass at `layer` whose tokens chose `ids` [T, K] into the trace and the statistics (each expert
        used ran once on the CPU); returns the routings per expert [E]."""
        counts = self.recorder.record(layer, ids)
        self.stats.misses += self.stats.count_all(layer, counts > 0, CPU)
        return counts

    def record_cpu_token(self, ids: torch.Tensor, routed: list[bool]) -> None:
        """One decode token's choices at every layer, ids [layers, K] (the decode step's, all on the CPU; only the
        `routed` layers' count), into the trace and the statistics, as record_cpu would put them layer by layer."""
        counts = self.recorder.record_token(ids.numpy(), np.array(routed))  # [L, E]
        self.stats.misses += self.stats.count_layers(counts > 0, CPU)

    def _plan(self, layer: int, ids: np.ndarray, chosen: list[int]) -> tuple[list[_Job], list[_Job]]:
        """The layer's experts on the accelerator (resident ones first) and on the CPU, from the host's routing ids
        [T, K] (numpy: a decode token plans several experts a layer, and a torch op costs ten times a numpy one).
        Every hit is known before any miss claims a slot: a miss must not evict an expert this same pass reads."""
        gpu: list[_Job] = []
        cpu: list[_Job] = []
        misses = []
        resident = {e: w for (lay, e), w in self.static.items() if lay == layer}
        for e in chosen:
            tok, slot = (torch.from_numpy(a) for a in np.nonzero(ids == e))  # [n], [n]
            weights = resident.get(e)
            if weights is None and self.cache.covers(layer):
                hit = self.cache.lookup(layer, e)
                weights = self.slot_buffers[hit.id] if hit is not None else None
            if weights is None:
                misses.append((e, tok, slot))
                continue
            self.stats.hits += 1
            self.stats.count(layer, e, GPU)
            gpu.append(_Job(e, tok, slot, weights, layer, self.cpu_experts[layer][e]))
        for e, tok, slot in misses:
            self.stats.misses += 1
            if self._should_fetch(tok.numel()):
                self.stats.count(layer, e, FETCHED)
                in_use = frozenset((layer, j.expert) for j in gpu)
                fetched, after = self._fetch_into_cache(layer, e, in_use)
                gpu.append(_Job(e, tok, slot, fetched, layer, self.cpu_experts[layer][e], after))
            else:
                self.stats.count(layer, e, CPU)
                cpu.append(_Job(e, tok, slot, None, layer, self.cpu_experts[layer][e]))
        return gpu, cpu

    def _should_fetch(self, tokens: int) -> bool:
        strategy = self.policy.strategy
        if strategy is Strategy.FETCH:
            return True
        return strategy is Strategy.FIDDLER and self.cost is not None and self.cost.prefer_fetch(tokens)

    def _fetch_into_cache(
        self, layer: int, e: int, in_use: frozenset[Key]
    ) -> tuple[ExpertWeights | None, tuple[Copy, ...]]:
        """Copy into a cache slot of this layer (it stays resident), on the demand copier; returns the slot's
        buffers and the copy the device waits for. (None, ()): use the scratch buffer."""
        assert self.accel is not None
        if not self.cache.covers(layer):
            return None, ()
        arriving = self.cache.arriving(layer, e)  # prefetched or post-fetched, its copy under way: wait for it
        if arriving is not None:
            return self.slot_buffers[arriving.id], (arriving.copy,)  # type: ignore[arg-type]
        slot = self.cache.begin_fill(layer, e, keep=in_use | self._held)
        if slot is None:
            return None, ()
        copy = self._fill(slot, layer, e, demand=True)
        return self.slot_buffers[slot.id], (copy,)

    def _fill(self, slot: Slot, layer: int, e: int, demand: bool) -> Copy:
        """Start the copy of expert e of `layer` into a slot claimed for it. Anything failing before the copy is
        under way (the weights' source, the copy's start: a dequantization out of memory, Ctrl+C) gives the slot
        back empty: it must never be taken for the expert it was claimed for, holding another's weights."""
        assert self.accel is not None
        try:
            copy = self.accel.copy_async(self._tensors(self.slot_buffers[slot.id]),
                                         self._tensors(self._source(layer, e)), demand=demand)
        except BaseException:
            self.cache.cancel(slot)
            raise
        self.cache.start(slot, copy)
        return copy

    def _launch_device(self, shared_x: torch.Tensor, x: torch.Tensor, weights: torch.Tensor, weights_h: torch.Tensor,
                       jobs: Sequence[_Job], block: MoEBlockWeights) -> tuple[Future[torch.Tensor], _Launch | None]:
        """Queue the accelerator's resident experts of the layer: the shared expert's input `shared_x`, the routed
        experts' x [T, H] (`routed_input`) and float32 routing weights [T, K] on the device -> the future of their
        output [T, H] float32 (the shared expert's, plus each job's weighted expert output), which completes with the
        last of that work; and the jobs that wait for a copy (`_Launch`: queued by `finish`), the first scratch copy
        started. The sum is float32, as the CPU's (`_cpu_combine`): it goes into
        the float32 residual stream, and a bf16 one would round it once per expert."""
        accel = self.accel
        assert accel is not None
        first = accel.submit(lambda: block.shared(shared_x).float() if block.shared is not None
                             else torch.zeros(x.shape, dtype=torch.float32, device=x.device))  # [T, H]
        out = first
        T = x.shape[0]
        group = [j for j in jobs if type(j.weights) is ExpertWeights and not j.after] if T <= GROUPED_TOKENS else []
        if len(group) > 1:  # the resident SwiGLU experts in one batched product
            share = np.zeros((len(group), T), dtype=np.float32)  # [k, T] each token's weight for each expert
            w_h = weights_h.numpy()
            for i, j in enumerate(group):
                share[i, j.tok.numpy()] = w_h[j.tok.numpy(), j.slot.numpy()]
            grouped = accel.to_device(torch.from_numpy(share))
            run = partial(self._device_group, out, [j.weights for j in group], x, grouped)
            out = accel.submit(run if self.timeline is None else self.timeline.wrap("experts", run))
            jobs = [j for j in jobs if not (type(j.weights) is ExpertWeights and not j.after)]
        # every other job's token rows and choice columns in one host->device copy, no synchronisation
        rows = np.concatenate([np.stack((j.tok.numpy(), j.slot.numpy())) for j in jobs], axis=1) if jobs else None
        index = accel.to_device(torch.from_numpy(rows)) if rows is not None else None  # [2, sum n]
        later = _Launch(x, weights, [])
        at = 0
        for job in jobs:
            n = job.tok.numel()
            tok, slot = index[0, at : at + n], index[1, at : at + n]  # type: ignore[index]  # [n], [n]
            at += n
            if job.weights is None or job.after:
                later.jobs.append((job, tok, slot))
            else:
                out = self._queue_expert(out, job.weights, x, weights, tok, slot, ())
        if not later.jobs:
            return out, None
        later.held = frozenset((j.layer, j.expert) for j, _, _ in later.jobs if j.weights is not None)
        self._held |= later.held
        return out, later

    def _launch_copied(self, out: Future[torch.Tensor], later: _Launch) -> Future[torch.Tensor]:
        """Queue a layer's experts that wait for copies behind `out`: into cache slots (copies in flight since the
        plan), or one after another through the scratch buffer, each copy into it after the kernels that read it
        last (so none starts before `finish`: another micro-batch's layer may still have one to queue)."""
        assert self.accel is not None
        for job, tok, slot in later.jobs:
            expert, after = job.weights, job.after
            if expert is None:
                source = self._tensors(self._source(job.layer, job.expert))
                after = (self.accel.copy_async(self._tensors(self.scratch), source, demand=True),)
                expert = self.scratch
            out = self._queue_expert(out, expert, later.x, later.weights, tok, slot, after)
        self._held -= later.held
        return out

    def _queue_expert(self, out: Future[torch.Tensor], expert: ExpertWeights, x: torch.Tensor, weights: torch.Tensor,
                      tok: torch.Tensor, slot: torch.Tensor, after: tuple[Copy, ...]) -> Future[torch.Tensor]:
        assert self.accel is not None
        run = partial(self._device_expert, out, expert, x, weights, tok, slot)
        return self.accel.submit(run if self.timeline is None else self.timeline.wrap("experts", run), after)

    @staticmethod
    def _device_group(out: Future[torch.Tensor], experts: list[ExpertWeights], x: torch.Tensor, share: torch.Tensor
                      ) -> torch.Tensor:
        """Device work: k SwiGLU experts over every token of the pass x [T, H] at once, each token's output weighted
        by `share` [k, T] (float32; 0 where the token did not choose the expert), added into the float32 output
        [T, H] (`out`, finished); returns that output. A product for a token that did not choose an expert counts
        nothing, even if it is not finite (fp16 can overflow where the expert never runs otherwise)."""
        k = len(experts)
        gate_up = torch.stack([w.gate for w in experts] + [w.up for w in experts])  # [2k, I, H]
        h = torch.matmul(x, gate_up.transpose(1, 2))  # [2k, T, I]
        down = torch.stack([w.down for w in experts]).transpose(1, 2)  # [k, I, H]
        y = torch.bmm(glu(h[:k], h[k:], experts[0].act), down)  # [k, T, H]
        if x.shape[0] == 1:  # (one token: it chose them all)
            part = torch.matmul(share.t(), y[:, 0].float())  # [1, H]
        else:
            part = torch.where(share[:, :, None] != 0, y.float() * share[:, :, None], 0.0).sum(0)  # [T, H]
        return out.result().add_(part)

    @staticmethod
    def _device_chosen(block: MoEBlockWeights, stacked: list[torch.Tensor], shared_x: torch.Tensor, x: torch.Tensor,
                       ids: torch.Tensor, weights: torch.Tensor, act: str) -> torch.Tensor:
        """Device work of a layer whose experts are all on the device, chosen there: each token's K experts picked
        from `stacked` (the layer's static slots as [E, I, H], [E, I, H], [E, H, I]) by its ids [T, K] (a copy of
        T*K experts), run as one batched product over x [T, H] and weighted by the float32 `weights` [T, K];
        the shared expert's (of `shared_x`) added -> [T, H] float32."""
        T, K = ids.shape
        flat = ids.reshape(-1)  # [T*K]
        gate, up, down = (s.index_select(0, flat) for s in stacked)  # [T*K, I, H] x 2, [T*K, H, I]
        rows = (x.expand(K, -1) if T == 1 else x.repeat_interleave(K, dim=0)).unsqueeze(1)  # [T*K, 1, H]
        h = glu(torch.bmm(rows, gate.transpose(1, 2)), torch.bmm(rows, up.transpose(1, 2)), act)  # [T*K, 1, I]
        y = torch.bmm(h, down.transpose(1, 2)).view(T, K, -1)  # [T, K, H]
        out = torch.matmul(weights.unsqueeze(1), y.float()).squeeze(1)  # [T, H]
        return out + block.shared(shared_x).float() if block.shared is not None else out

    @staticmethod
    def _device_expert(out: Future[torch.Tensor], expert: ExpertWeights, x: torch.Tensor, weights: torch.Tensor,
                       tok: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """Device work: one expert over its n tokens `tok` [n] (their choice columns `slot` [n]), weighted in float32,
        added into the float32 output [T, H] (`out`, finished: earlier work on the same stream); returns that output."""
        y = expert(x[tok])  # [n, H]
        return out.result().index_add_(0, tok, y.float() * weights[tok, slot].unsqueeze(-1))

    def _cpu_combine(self, x: torch.Tensor, weights: torch.Tensor, jobs: Sequence[_Job]) -> torch.Tensor:
        """Host x [T, H], routing weights [T, K] -> the weighted sum of these CPU experts' outputs [T, H], summed
        in float32 (it goes into the float32 residual stream)."""
        out = torch.zeros(x.shape, dtype=torch.float32)  # [T, H]
        weights = weights.float()  # [T, K]

        def add(i: int, y: torch.Tensor) -> None:  # y [n, H]
            # Gathered, added and written back, not `index_add_`: on the CPU that sorts the index to split its rows
            # among threads (with both cores busy, a quarter of a batch step's time). Writing rows back loses
            # nothing while a job's tokens are distinct; a token that chose the expert twice (a router left only
            # -inf logits to pick from) takes index_add_, which sums both. Its tokens come sorted.
            job = jobs[i]
            part = y.float() * weights[job.tok, job.slot].unsqueeze(-1)  # [n, H]
            if job.tok.numel() > 1 and bool((job.tok[1:] == job.tok[:-1]).any()):
                out.index_add_(0, job.tok, part)
                return
            rows = out.index_select(0, job.tok)  # [n, H]
            rows += part
            out.index_copy_(0, job.tok, rows)

        self.executor.run_many([(job.cpu, x[job.tok]) for job in jobs], add)
        return out

    def _post_fetch(self, layer: int, misses: Sequence[_Job], keep: frozenset[Key]) -> None:
        """Copy CPU-served experts into the cache in the background, up to the in-flight cap. While prefetch runs,
        only with the copy engine's idle time its guesses left (`_credit`): a guess of the layers ahead is worth
        more than an expert that was just used, which the next token may not choose again."""
        if self.accel is None or not self.cache.covers(layer):
            return
        priced = self.prefetching and self.prefetch_gate.open
        size = self.slot_bytes
        for job in misses:
            if self.cache.inflight >= self.cache.max_inflight or priced and self._credit < size:
                self.cache.stats.skipped_fills += 1
                continue
            if self._fill_in_background(layer, job.expert, keep) and priced:
                self._credit -= size
                self._prefetched += size  # (taken from the credit already)

    def _fill_in_background(self, layer: int, e: int, keep: frozenset[Key]) -> bool:
        """Claim a cache slot of `layer` for expert e (none: it is there or on its way, or every slot is kept) and
        copy it there on the background copier; whether a copy started."""
        assert self.accel is not None
        slot = self.cache.begin_fill(layer, e, keep | self._held)
        if slot is not None:
            self._fill(slot, layer, e, demand=False)
        return slot is not None
