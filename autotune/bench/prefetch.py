"""The expert predictors measured (MoE-Infinity §5; runtime/prefetch.py): each one's recall and precision per layer
distance over several requests on the CPU alone (the layer loop, so that every MoE layer's router input is seen),
and prefetch on the emulated accelerator against the best cache policy without it (`bench offload`'s rows)."""

from __future__ import annotations

from typing import Any

from tandem.runtime.choices import PredictorKind, Strategy
from tandem.runtime.engine import Engine, GenerationStats
from tandem.runtime.expert_cache import CachePolicy
from tandem.runtime.loader import load_model
from tandem.runtime.prefetch import MAX_DEPTH, EamCollection
from tandem.runtime.sampling import SamplingParams
from tandem.runtime.synth import ASSETS

PREDICTORS = (PredictorKind.PREVIOUS, PredictorKind.STALE_GATE, PredictorKind.EAM)


def bench_texts(tokenizer: Any, count: int, tokens: int) -> list[list[int]]:
    """`count` prompts of `tokens` tokens: the bench prompts' lines, then the corpus in pieces where they run out."""
    lines = [ln for ln in (ASSETS / "bench_prompts.txt").read_text(encoding="utf-8").splitlines() if ln.strip()]
    corpus = tokenizer.encode((ASSETS / "tokenizer_corpus.txt").read_text(encoding="utf-8"))
    prompts = []
    for k in range(count):
        ids = tokenizer.encode(lines[k]) if k < len(lines) else []
        fill = corpus[k * tokens : (k + 1) * tokens] or corpus[:tokens]
        prompts.append((ids + fill)[:tokens])
    return prompts


def predictor_accuracy(model_dir: str, dtype: str = "auto", requests: int = 6, prompt_tokens: int = 32,
                       new_tokens: int = 32, depth: int = MAX_DEPTH) -> dict[str, Any]:
    """Each predictor over `requests` answers in a row (greedy), scored on every decode token: per distance d
    (1..depth MoE layers ahead), the share of the experts routed it had predicted (recall) and the share of its
    predictions routed (precision). The EAM collection starts empty and gathers the requests as they end, so its
    figures include its cold start (the first request matches itself)."""
    loaded = load_model(model_dir, dtype=dtype, context=prompt_tokens + new_tokens + 8)
    model = loaded.model
    model.use_step = False  # the layer loop: the predictors see each MoE layer's router input
    prompts = bench_texts(loaded.tokenizer, requests, prompt_tokens)
    dispatcher = model.dispatcher
    out: dict[str, Any] = {}
    try:
        for kind in PREDICTORS:
            dispatcher.predict(kind, depth, collection=EamCollection(len(dispatcher.moe_layers),
                                                                     model.cfg.num_experts))
            engine = Engine(model, ())
            for prompt in prompts:
                for _ in engine.generate(prompt, SamplingParams(max_new_tokens=new_tokens)):
                    pass
            assert dispatcher.scorer is not None
            out[str(kind)] = dispatcher.scorer.accuracy.as_rows()
        dispatcher.predictor = dispatcher.scorer = None
    finally:
        model.close()
    return {"requests": requests, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
            "moe_layers": len(dispatcher.moe_layers), "top_k": model.cfg.top_k, "predictors": out}


def decode_rate(engine: Engine, prompts: list[list[int]], new_tokens: int) -> float:
    """Decode tokens/s over the prompts' answers, one after another (greedy)."""
    seconds = tokens = 0.0
    for prompt in prompts:
        stats = GenerationStats()
        for _ in engine.generate(prompt, SamplingParams(max_new_tokens=new_tokens), stats):
            pass
        tokens += max(0, stats.new_tokens - 1)
        seconds += stats.decode_s
    return tokens / seconds if seconds else 0.0


def offload_run(engine: Engine, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """The prompts answered one after another on an accelerator-tier engine: decode tokens/s, the hit rate over
    every expert run, bytes copied to the device per generated token, and the prefetches: made, used before being
    evicted, evicted unused, and still unused at the end."""
    dispatcher = engine.model.dispatcher
    seconds = hits = misses = h2d = tokens = 0.0
    for prompt in prompts:
        stats = GenerationStats()
        for _ in engine.generate(prompt, SamplingParams(max_new_tokens=new_tokens), stats):
            pass
        run = dispatcher.request_stats()
        hits, misses, h2d = hits + run.hits, misses + run.misses, h2d + run.bytes_h2d
        tokens += max(0, stats.new_tokens - 1)
        seconds += stats.decode_s
    dispatcher.cache.wait_all()
    cache = dispatcher.cache.stats
    idle = sum(1 for ways in dispatcher.cache.sets for s in ways if s.prefetched and s.uses == 0)
    row: dict[str, Any] = {
        "decode_tok_s": round(tokens / seconds, 2) if seconds else 0.0,
        "hit_rate": round(hits / (hits + misses), 4) if hits + misses else 0.0,
        "bytes_h2d_per_token": int(h2d / max(1.0, tokens + len(prompts))),
    }
    if dispatcher.prefetching:
        row.update({"prefetches": cache.prefetches, "prefetch_used": cache.prefetch_used,
                    "prefetch_wasted": cache.prefetch_wasted, "prefetch_unused_at_end": idle,
                    "gate_precision": round(dispatcher.prefetch_gate.precision, 4),
                    "gate_open": dispatcher.prefetch_gate.open})
    return row


def prefetch_rows(model_dir: str, dtype: str, context: int, vram_gb: float, prompts: list[list[int]],
                  new_tokens: int, policy: CachePolicy, depths: tuple[int, ...] = (1, 2, 3)) -> dict[str, Any]:
    """For misses served on the CPU (`cpu`) and misses waiting for their copy (`fetch`, classic offloading): the
    cache policy `policy` without prefetch (measured before each predictor's rows, their median the baseline), then
    each predictor at each depth, with its speed over the baseline."""
    out: dict[str, Any] = {}
    for strategy in (Strategy.CPU, Strategy.FETCH):
        def run(kind: PredictorKind, depth: int = 1, strategy: Strategy = strategy) -> dict[str, Any]:
            loaded = load_model(model_dir, dtype=dtype, context=context, accelerator="emulated", vram_gb=vram_gb,
                                strategy=strategy, cache_policy=policy, prefetch=kind, prefetch_depth=depth)
            loaded.model.use_step = False
            try:
                return offload_run(Engine(loaded.model, ()), prompts, new_tokens)
            finally:
                loaded.model.close()

        baselines, rows = [], []
        for kind in PREDICTORS:
            baselines.append(run(PredictorKind.NONE))
            rows += [{"predictor": str(kind), "depth": d, **run(kind, d)} for d in depths]
        base = sorted(baselines, key=lambda r: r["decode_tok_s"])[len(baselines) // 2]
        for row in rows:
            row["speed_vs_no_prefetch"] = round(row["decode_tok_s"] / base["decode_tok_s"], 3) \
                if base["decode_tok_s"] else 0.0
        out[str(strategy)] = {"no_prefetch": {**base, "runs_tok_s": [r["decode_tok_s"] for r in baselines]},
                              "rows": rows}
    return {"cache_policy": str(policy), "requests": len(prompts), **out}


def readahead_rows(model_dir: str, dtype: str = "auto", prompt_tokens: int = 32, new_tokens: int = 16,
                   rounds: int = 2) -> dict[str, Any]:
    """A model larger than RAM, played by dropping its experts from memory before every decode token (their pages
    unmapped and the files' pages out of the page cache: every token reads its experts from the disk again), its
    experts left in their files: decode tokens/s of the one-call decode step, of the layer loop, and of the layer
    loop reading ahead (each layer's own experts once routed; then also the stale gate's guesses 1 and 2 MoE layers
    ahead), alternating, `rounds` times."""
    from tandem.runtime.readahead import drop

    setups: dict[str, dict[str, Any]] = {
        "decode step": {}, "layer loop": {},
        "read-ahead, each layer's own experts": {"readahead": True},
        "read-ahead, stale gate 1": {"readahead": True, "prefetch": PredictorKind.STALE_GATE},
        "read-ahead, stale gate 2": {"readahead": True, "prefetch": PredictorKind.STALE_GATE, "prefetch_depth": 2},
    }
    rates: dict[str, list[float]] = {name: [] for name in setups}
    for _ in range(rounds):
        for name, settings in setups.items():
            loaded = load_model(model_dir, dtype=dtype, context=prompt_tokens + new_tokens + 8, resident=False,
                                **settings)
            model = loaded.model
            model.use_step = name == "decode step"
            ranges = model.dispatcher.expert_spans()
            where = loaded.checkpoint.path
            files = [str(f) for f in (sorted(where.rglob("*.safetensors")) if where.is_dir() else [where])]
            prompt = bench_texts(loaded.tokenizer, 1, prompt_tokens)[0]
            stats = GenerationStats()
            try:
                drop(ranges, files)
                for _ in Engine(model, ()).generate(prompt, SamplingParams(max_new_tokens=new_tokens), stats):
                    drop(ranges, files)  # (between tokens: not in the decode time)
            finally:
                model.close()
            rates[name].append(round(stats.decode_tok_s, 3))
    base = sorted(rates["decode step"])[len(rates["decode step"]) // 2]
    return {"rounds": rounds, "new_tokens": new_tokens,
            "rows": [{"setup": name, "decode_tok_s": r, "median_vs_decode_step":
                      round(sorted(r)[len(r) // 2] / base, 3) if base else 0.0} for name, r in rates.items()]}
