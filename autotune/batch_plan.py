"""The batch policy (MoE-Lightning's idea, on this runtime): a roofline model of one continuous-batching step, a
simulation of the scheduler over the workload with it, and the batch size and step token budget that maximise the
predicted generated tokens/s within the memory the KV cache may take.

Hierarchy of the model, from the measurements (autotune/measurements.py):
- an expert with m tokens: the measured CPU fit a + b(m - 1) (a: the weights streamed once; b: each further token's
  arithmetic), or on the accelerator its measured run;
- a dense matrix over n tokens: its bytes at the DRAM bandwidth or its multiply-adds at the dense compute rate,
  whichever is longer (the two overlap);
- attention: each sequence's cached keys and values read once, plus a fixed cost per sequence and layer (one kernel
  call, its share of the Python around it);
- a step: the sum of its layers, the lm_head over one row per sequence, and a fixed cost.
Pure functions of (shape, machine, workload); nothing here runs the model.

Letters: R requests, P prompt tokens each, M new tokens each, b sequences in flight, N tokens in a step, E experts,
k experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.autotune.measurements import CpuFit, Measurements
from tandem.autotune.plan import ModelShape
from tandem.runtime.config import ModelConfig

# Fixed costs, from a profile of decode steps of 64 sequences on the development machine (cProfile; docs/bench,
# batch mode): a sequence's in each layer (its attention kernel call and the Python around it), an expert's in each
# step that runs experts one by one (more tokens than one kernel call of the whole layer takes: its token rows
# gathered, its output added), and a step's own (sampling, the scheduler)
SEGMENT_MS = 0.08
JOB_MS = 0.06
STEP_MS = 1.0
LAYER_CALL_TOKENS = 8  # up to this many tokens a MoE layer's experts run in one kernel call (no per-expert cost)
MAX_BATCH = 256  # sequences in flight at most: beyond, every expert already sees many tokens a step
KV_SHARE = 0.5  # of the RAM left free after loading, what the KV cache of a batch may take


@dataclass(frozen=True)
class BatchShape:
    """What a step costs depends on, per layer unless named otherwise."""

    model: ModelShape
    vocab: int
    dense_params: int  # non-expert matrix weights a token multiplies by (attention, router, a dense layer's MLP)
    dense_bytes: int  # their bytes as kept
    head_params: int  # lm_head, once per step
    head_bytes: int
    kv_bytes: int  # one token's keys and values (or latents)
    attn_flops: int  # multiply-adds x 2 of one query against one cached token

    @classmethod
    def from_config(cls, cfg: ModelConfig, shape: ModelShape, dtype_bytes: int = 2) -> BatchShape:
        layers = cfg.num_layers
        h = cfg.hidden_size
        dense_mlp = sum(3 * h * cfg.dense_intermediate_size for s in cfg.sparse_layers if not s or cfg.parallel_dense)
        shared = 3 * h * cfg.shared_expert_intermediate_size * cfg.num_moe_layers
        # ModelShape.dense_layer_bytes: attention and router weights, per layer
        attn_params = shape.dense_layer_bytes // dtype_bytes
        dense = attn_params + (dense_mlp + shared) // layers
        if cfg.kv_lora_rank:
            kv = cfg.kv_lora_rank + cfg.qk_rope_head_dim
            flops = 2 * cfg.num_heads * (2 * cfg.kv_lora_rank + cfg.qk_rope_head_dim)
        else:  # (a layer's on average: Gemma 4's global layers have their own heads, a hybrid's recurrent layers
            # none: their state does not grow with the context)
            attends = [i for i in range(layers) if cfg.mixers[i] == "attention"]
            kv = sum(2 * cfg.kv_heads(i) * cfg.head_size(i) for i in attends) // layers
            flops = sum(4 * cfg.num_heads * cfg.head_size(i) for i in attends) // layers
        head = cfg.vocab_size * h
        return cls(shape, cfg.vocab_size, dense, dense * dtype_bytes, head, head * dtype_bytes, kv * dtype_bytes, flops)

    @property
    def kv_bytes_per_token(self) -> int:
        """A token's KV cache over every layer."""
        return self.kv_bytes * self.model.num_layers


@dataclass(frozen=True)
class ExpertCurve:
    """One expert's CPU time at m tokens: straight lines between measured points (the faster of the kernel and
    torch at each), the fit's slope beyond the last; the fit alone where nothing was sampled. The measured curve is
    not a line: torch's product costs as much at 8 tokens as at 16, which a + b(m - 1) through 1..64 misses by half."""

    fit: CpuFit
    points: tuple[tuple[int, float], ...] = ()  # (tokens, ms), tokens increasing

    def ms(self, m: float) -> float:
        pts = self.points
        if not pts:
            return self.fit.lat(max(1, round(m)))
        if m <= pts[0][0]:
            return pts[0][1]
        for (n0, t0), (n1, t1) in zip(pts, pts[1:], strict=False):
            if m <= n1:
                return t0 + (t1 - t0) * (m - n0) / (n1 - n0)
        return pts[-1][1] + self.fit.b_ms * (m - pts[-1][0])

    @classmethod
    def from_measurements(cls, meas: Measurements, threads: int, crossover: int | None = None) -> ExpertCurve:
        """The kernel's times up to `crossover` tokens and torch's beyond, as the executor runs them (None: the
        faster of the two at each count). torch was timed at the best thread count only."""
        samples = dict(meas.cpu_samples.get(threads, {}))
        torch_ms = (meas.kernel or {}).get("torch_ms") or {}
        if threads == min(meas.cpu, key=lambda t: meas.cpu[t].lat(1)):
            for n, ms in ((int(n), float(ms)) for n, ms in torch_ms.items()):
                if n in samples and (crossover is None and ms < samples[n] or crossover is not None and n > crossover):
                    samples[n] = ms
        return cls(meas.cpu[threads], tuple(sorted(samples.items())))


@dataclass(frozen=True)
class BatchMachine:
    """The rates a step runs at."""

    dram_gbps: float
    expert: ExpertCurve
    dense_gflops: float  # dense products over many tokens
    threads: int
    gpu_expert_ms: float | None = None  # an expert's run on the accelerator (one token), when there is one
    vram_for_experts: int = 0

    @classmethod
    def from_measurements(cls, meas: Measurements, threads: int | None = None,
                          dense_gflops: float | None = None, crossover: int | None = None) -> BatchMachine:
        """The machine at `threads` (default: the thread count with the fastest expert at many tokens). The dense
        rate: `dense_gflops`, else the measurements' `gflops`, else the experts' own marginal rate (their products
        are the same arithmetic)."""
        t = threads if threads in meas.cpu else min(meas.cpu, key=lambda n: meas.cpu[n].lat(64))
        fit = meas.cpu[t]
        marginal = 3 * meas.expert_bytes / (fit.b_ms * 1e6) if fit.b_ms > 0 else 100.0  # 2 flops a 2-byte weight
        rate = dense_gflops or meas.gflops or marginal
        bw = meas.dram_gbps or meas.expert_bytes / fit.a_ms / 1e6
        return cls(bw, ExpertCurve.from_measurements(meas, t, crossover), rate, t,
                   meas.gpu_expert_ms if meas.has_gpu else None, meas.vram_for_experts)


@dataclass(frozen=True)
class Workload:
    requests: int
    prompt_tokens: int  # each (the mean of a real file)
    new_tokens: int  # each, at most (a request may end sooner)


@dataclass(frozen=True)
class StepCost:
    experts_ms: float
    dense_ms: float
    attention_ms: float
    head_ms: float
    fixed_ms: float

    @property
    def ms(self) -> float:
        return self.experts_ms + self.dense_ms + self.attention_ms + self.head_ms + self.fixed_ms


def step_cost(bs: BatchShape, m: BatchMachine, tokens: int, seqs: int, keys: float) -> StepCost:
    """One step of `tokens` tokens from `seqs` sequences whose queries see `keys` cached tokens on average."""
    s = bs.model
    bw = m.dram_gbps * 1e6  # bytes a millisecond
    flops = m.dense_gflops * 1e6  # a millisecond
    used = s.num_experts * (1 - (1 - s.top_k / s.num_experts) ** tokens)  # distinct experts a layer reads
    per = tokens * s.top_k / used if used else 0.0  # tokens each of them computes
    moe = len(s.moe_layers)
    experts = moe * used * (m.expert.ms(per) + (JOB_MS if tokens > LAYER_CALL_TOKENS else 0.0))
    dense = s.num_layers * max(bs.dense_bytes / bw, 2 * bs.dense_params * tokens / flops)
    attention = s.num_layers * (seqs * SEGMENT_MS + seqs * keys * bs.kv_bytes / bw
                                + tokens * keys * bs.attn_flops / flops)
    head = max(bs.head_bytes / bw, 2 * bs.head_params * seqs / flops)
    return StepCost(experts, dense, attention, head, STEP_MS)


@dataclass
class Prediction:
    tok_s: float  # generated tokens a second over the whole workload
    seconds: float
    steps: int
    prefill_s: float  # of `seconds`, the steps that fed prompt tokens
    breakdown: dict[str, float] = field(default_factory=dict)  # ms over the run, by part

    def to_dict(self) -> dict[str, Any]:
        return {"tok_s": round(self.tok_s, 2), "seconds": round(self.seconds, 3), "steps": self.steps,
                "prefill_s": round(self.prefill_s, 3),
                "breakdown_s": {k: round(v / 1000, 3) for k, v in self.breakdown.items()}}


def predict(bs: BatchShape, m: BatchMachine, w: Workload, batch: int, step_tokens: int) -> Prediction:
    """Simulate BatchEngine's scheduler (runtime/batch.py) on `w`: b rows, decode tokens first, prompts in chunks
    within the budget; every request runs to its full `new_tokens`."""
    waiting = w.requests
    active: list[list[int]] = []  # [prompt tokens not yet fed, new tokens still to make]
    total, prefill, steps = 0.0, 0.0, 0
    parts = {"experts": 0.0, "dense": 0.0, "attention": 0.0, "head": 0.0, "fixed": 0.0}
    while waiting or active:
        while waiting and len(active) < batch:
            active.append([w.prompt_tokens, w.new_tokens])
            waiting -= 1
        decoding = [a for a in active if a[0] == 0]
        room = max(step_tokens - len(decoding), 0 if decoding else 1)
        chunks = []
        for a in active:
            if a[0] and room:
                take = min(a[0], room)
                chunks.append((a, take))
                room -= take
        tokens = len(decoding) + sum(t for _, t in chunks)
        keys = (len(decoding) * (w.prompt_tokens + w.new_tokens / 2)
                + sum(t * (w.prompt_tokens - a[0] + t / 2) for a, t in chunks)) / max(1, tokens)
        cost = step_cost(bs, m, tokens, len(decoding) + len(chunks), keys)
        total += cost.ms
        prefill += cost.ms if chunks else 0.0
        for name in parts:
            parts[name] += getattr(cost, f"{name}_ms")
        steps += 1
        for a in decoding:
            a[1] -= 1
        for a, t in chunks:
            a[0] -= t
            if a[0] == 0:
                a[1] -= 1  # the prompt's last pass gives the first new token
        active = [a for a in active if a[1] > 0]
    seconds = total / 1000
    return Prediction(w.requests * w.new_tokens / seconds if seconds else 0.0, seconds, steps, prefill / 1000, parts)


@dataclass
class BatchPolicy:
    batch: int  # sequences in flight
    step_tokens: int  # tokens a step at most
    micro_batches: int  # parts of a step pipelined on the accelerator tier (1: none)
    attention: str  # where attention runs: "cpu", or "accelerator"
    accelerator_weights: str  # what the accelerator keeps: "none", or the dense weights (and experts: see plan)
    predicted: Prediction
    kv_bytes: int  # the KV cache the batch takes
    limit: str  # what bounded the batch size: "requests", "memory" or "gain"
    alternatives: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"batch": self.batch, "step_tokens": self.step_tokens, "micro_batches": self.micro_batches,
                "attention": self.attention,
                "accelerator_weights": self.accelerator_weights, "kv_cache_bytes": self.kv_bytes,
                "limited_by": self.limit, "predicted": self.predicted.to_dict(), "alternatives": self.alternatives}


STEP_CHUNKS = (64, 128, 256, 512)  # prompt tokens a step may add beyond its decode tokens
GAIN = 0.02  # a larger batch must predict at least this much more throughput to be worth its memory and latency


def plan_batch(bs: BatchShape, m: BatchMachine, w: Workload, kv_budget: int, context: int,
               vram_free: int | None = None, host_attention: bool = True, batch: int | None = None) -> BatchPolicy:
    """The policy with the highest predicted throughput: batch sizes (powers of two up to the requests, the memory
    for their KV cache rows of `context` tokens, and MAX_BATCH) by step budgets (STEP_CHUNKS beyond the decode
    tokens); the smallest batch within GAIN of the best. On an accelerator (`vram_free`: the bytes its memory has
    beside the model's weights; None: no accelerator), attention runs there while the batch's KV cache takes at most
    KV_SHARE of that memory (the rest is the experts'), else on the CPU with the cache in RAM (where `host_attention`
    allows: not under Multi-head Latent Attention), each step then in two micro-batches, pipelined. The prediction
    models the CPU running everything: on the accelerator tier it is not the device's figure. `batch`: that batch
    size, whatever the memory (the rest is chosen for it)."""
    row = bs.kv_bytes_per_token * context
    most = min(w.requests, MAX_BATCH, max(1, kv_budget // max(1, row)))
    sizes = [batch] if batch else sorted({min(most, 1 << i) for i in range(MAX_BATCH.bit_length())})
    scored: list[tuple[int, int, Prediction]] = []
    for b in sizes:
        for chunk in STEP_CHUNKS:
            scored.append((b, b + chunk, predict(bs, m, w, b, b + chunk)))
    best_tok_s = max(p.tok_s for _, _, p in scored)
    b, step, pred = min((x for x in scored if x[2].tok_s >= (1 - GAIN) * best_tok_s), key=lambda x: (x[0], -x[2].tok_s))
    if batch:
        limit = "asked"
    elif b == w.requests or b == MAX_BATCH and most == MAX_BATCH:
        limit = "requests"
    elif b == most:
        limit = "memory"
    else:
        limit = "gain"
    kv = row * b
    tier = vram_free is not None
    on_device = tier and (kv <= KV_SHARE * vram_free or not host_attention)  # type: ignore[operator]
    others = sorted(scored, key=lambda x: -x[2].tok_s)[:5]
    # two micro-batches where the CPU runs attention: one's attention while the accelerator runs the other's experts
    # (with attention on the accelerator there is nothing to overlap, and each micro-batch reads its experts again)
    return BatchPolicy(b, step, 2 if tier and not on_device and b > 1 else 1, "accelerator" if on_device else "cpu",
                       "dense" if tier else "none", pred, kv, limit,
                       [{"batch": x, "step_tokens": s, "tok_s": round(p.tok_s, 2)} for x, s, p in others])
