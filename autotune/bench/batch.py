"""`tandem bench batch`: batch throughput (generated tokens/s over a whole workload of R requests of P prompt
tokens and M new tokens each) at several batch sizes, beside the batch policy's prediction and Tandem's own
single-request decode, all measured in this run; optionally beside transformers' batched `generate` (its best batch
size) and llama.cpp's `llama-batched-bench` on the same GGUF file.

`speedup_vs_single` is the best batch throughput over the single-request decode tokens/s, measured in the same
process minutes apart. `ceiling_vs_single` is what the machine's measured dense compute rate allows at best: every
token of the workload, prompt and answer, costs its multiply-adds, and only the answers count.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import torch

from tandem.autotune.batch_plan import STEP_CHUNKS, BatchMachine, BatchShape, Workload, plan_batch, predict
from tandem.autotune.bench.e2e import peer_fits_beside
from tandem.autotune.bench.llama import run_tool
from tandem.autotune.microbench import dense_gflops, microbench
from tandem.autotune.plan import ModelShape
from tandem.autotune.probe import probe
from tandem.kernels.errors import TandemError
from tandem.runtime.batch import BatchEngine, BatchRequest, DoneEvent
from tandem.runtime.engine import Engine, GenerationStats
from tandem.runtime.gguf import is_gguf
from tandem.runtime.loader import LoadedModel
from tandem.runtime.sampling import SamplingParams
from tandem.runtime.timeline import Timeline

RATE_WINDOWS = 7


def workload_requests(w: Workload, vocab: int, seed: int = 0) -> list[BatchRequest]:
    """R requests of random prompt ids, greedy, each asked for exactly M tokens (no EOS ends one early: the engine
    is given none)."""
    gen = torch.Generator().manual_seed(seed)
    return [BatchRequest(str(i), torch.randint(1, vocab, (w.prompt_tokens,), generator=gen).tolist(),
                         SamplingParams(max_new_tokens=w.new_tokens)) for i in range(w.requests)]


def run_workload(loaded: LoadedModel, w: Workload, batch: int, step_tokens: int, micro_batches: int = 1
                 ) -> dict[str, Any]:
    engine = BatchEngine(loaded.model, (), batch, step_tokens, micro_batches)
    start = time.perf_counter()
    events = engine.run(workload_requests(w, loaded.model.cfg.vocab_size))
    tokens = sum(1 for e in events if not isinstance(e, DoneEvent))
    seconds = time.perf_counter() - start
    return {"tok_s": tokens / seconds, "seconds": seconds, "tokens": tokens, "steps": engine.stats.steps}


def single_decode(loaded: LoadedModel, w: Workload) -> float:
    """One request alone (P prompt tokens, M new), decode tokens/s: (M - 1) over the time after the first token."""
    stats = GenerationStats()
    request = workload_requests(Workload(1, w.prompt_tokens, w.new_tokens), loaded.model.cfg.vocab_size, seed=1)[0]
    for _ in Engine(loaded.model, ()).generate(request.prompt, request.params, stats):
        pass
    return stats.decode_tok_s


def best_step(bs: BatchShape, m: BatchMachine, w: Workload, batch: int) -> int:
    return max((batch + c for c in STEP_CHUNKS), key=lambda s: predict(bs, m, w, batch, s).tok_s)


def transformers_batched(path: Path, dtype: torch.dtype, w: Workload, sizes: list[int], vocab: int
                         ) -> list[dict[str, Any]]:
    """transformers' `generate` on batches of the same requests (all of one length: no padding), greedy, exactly M
    new tokens each: generated tokens/s over the whole workload at each batch size."""
    import transformers

    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    prompts = torch.tensor([r.prompt for r in workload_requests(w, vocab)])  # [R, P]
    rows = []
    for b in sizes:
        start = time.perf_counter()
        with torch.inference_mode():
            for i in range(0, w.requests, b):
                ref.generate(prompts[i : i + b], attention_mask=torch.ones_like(prompts[i : i + b]),
                             max_new_tokens=w.new_tokens, min_new_tokens=w.new_tokens, do_sample=False, pad_token_id=0)
        seconds = time.perf_counter() - start
        rows.append({"batch": b, "tok_s": round(w.requests * w.new_tokens / seconds, 3), "seconds": round(seconds, 3)})
    del ref
    return rows


def llama_batched(binary: Path, model: Path, threads: int, w: Workload) -> dict[str, Any]:
    """`llama-batched-bench` with R parallel sequences of P prompt and M generated tokens: the same total tokens as
    the workload. Its table's last columns are the whole run's time T and speed; the answers' tokens/s is R·M/T."""
    ctx = w.requests * (w.prompt_tokens + w.new_tokens) + 16
    out = run_tool(binary, "llama-batched-bench", ["-m", str(model), "-t", str(threads), "-c", str(ctx), "-b", "2048",
                                                   "-ub", "512", "-npp", str(w.prompt_tokens),
                                                   "-ntg", str(w.new_tokens), "-npl", str(w.requests)])
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 10 and re.fullmatch(r"\d+", cells[0]) and int(cells[2]) == w.requests:
            total_s = float(cells[8])
            return {"tok_s": round(w.requests * w.new_tokens / total_s, 3), "seconds": total_s,
                    "prefill_tok_s": float(cells[5]), "decode_tok_s": float(cells[7])}
    raise TandemError("llama-batched-bench printed no row for the workload; is it llama.cpp's llama-batched-bench?")


def pipeline_overlap(loaded: LoadedModel, w: Workload, batch: int, step_tokens: int) -> list[dict[str, Any]]:
    """On the accelerator tier: the workload with each step whole and in two micro-batches, with the seconds the
    accelerator's expert runs and the host's attention took, and how many of those ran side by side."""
    rows = []
    dispatcher = loaded.model.dispatcher
    for micro in (1, 2):
        dispatcher.timeline = timeline = Timeline()
        try:
            measured = run_workload(loaded, w, batch, step_tokens, micro)
        finally:
            dispatcher.timeline = None
        experts, attention = timeline.total("experts"), timeline.total("attention")
        both = timeline.overlap("experts", "attention")
        rows.append({"micro_batches": micro, "tok_s": round(measured["tok_s"], 3),
                     "device_experts_s": round(experts, 3), "attention_s": round(attention, 3),
                     "overlap_s": round(both, 3),
                     "overlap_of_attention": round(both / attention, 3) if attention else 0.0})
    return rows


def bench_batch(loaded: LoadedModel, w: Workload, sizes: list[int] | None = None, peer: str | None = None,
                binary: Path | None = None) -> dict[str, Any]:
    """Measure the machine, plan, then run the workload at the policy's batch size and the `sizes` given (default:
    a quarter and a half of it), then the single request, then the peer."""
    model, ckpt = loaded.model, loaded.checkpoint
    cpu_dtype = model.dispatcher.executor.dtype
    threads = model.threads
    shape = ModelShape.from_checkpoint(ckpt, model.dtype.itemsize)
    meas = microbench(shape, probe(), cpu_dtype, quick=True)
    meas.cpu = {threads: meas.cpu[threads]} if threads in meas.cpu else meas.cpu
    bs = BatchShape.from_config(ckpt.config, shape, model.dtype.itemsize)
    # the best of several tenth-second windows: on a shared machine one window read anywhere from 0.6 to 1.0 of the
    # best, and the ceiling below is an upper bound
    rate = max(dense_gflops(shape.hidden, model.dtype, threads) for _ in range(RATE_WINDOWS))
    machine = BatchMachine.from_measurements(meas, threads, rate, model.dispatcher.executor.crossover)
    context = w.prompt_tokens + w.new_tokens
    policy = plan_batch(bs, machine, w, kv_budget=1 << 62, context=context)
    chosen = sorted({policy.batch, *(sizes or {max(1, policy.batch // 4), max(1, policy.batch // 2)})})
    run_workload(loaded, Workload(min(w.requests, policy.batch), w.prompt_tokens, 2), policy.batch,
                 policy.step_tokens)  # warm: every expert's pages and the kernels' buffers, before any timing
    rows = []
    for b in chosen:
        step = policy.step_tokens if b == policy.batch else best_step(bs, machine, w, b)
        measured = run_workload(loaded, w, b, step)
        predicted = predict(bs, machine, w, b, step).tok_s
        rows.append({"batch": b, "step_tokens": step, "tok_s": round(measured["tok_s"], 3),
                     "seconds": round(measured["seconds"], 3), "predicted_tok_s": round(predicted, 3),
                     "prediction_error": round(predicted / measured["tok_s"] - 1, 3), "policy": b == policy.batch})
    single = single_decode(loaded, w)
    best = max(r["tok_s"] for r in rows)
    flops_per_token = 2 * (bs.dense_params * shape.num_layers + len(shape.moe_layers) * shape.top_k * 3 * shape.hidden
                           * shape.inter)
    ceiling = machine.dense_gflops * 1e9 / flops_per_token * w.new_tokens / (w.prompt_tokens + w.new_tokens)
    result: dict[str, Any] = {
        "model": str(ckpt.path), "workload": {"requests": w.requests, "in": w.prompt_tokens, "out": w.new_tokens},
        "threads": threads, "machine": {"dram_gbps": round(machine.dram_gbps, 1),
                                        "dense_gflops": round(machine.dense_gflops, 1)},
        "policy": policy.to_dict(), "rows": rows, "single_decode_tok_s": round(single, 3),
        "speedup_vs_single": round(best / single, 3) if single else None,
        "ceiling_vs_single": round(ceiling / single, 3) if single else None, "peer": None,
    }
    if model.accel is not None:
        result["pipeline"] = pipeline_overlap(loaded, w, policy.batch, policy.step_tokens)
    if peer == "transformers":
        theirs = transformers_batched(ckpt.path, model.dtype, w, chosen, model.cfg.vocab_size)
        top = max(theirs, key=lambda r: r["tok_s"])
        result["peer"] = {"name": "transformers", "rows": theirs, "best": top, "ratio": round(best / top["tok_s"], 3)}
    elif peer == "llama.cpp":
        if binary is None:
            result["peer"] = {"name": "llama.cpp", "skipped": "give --llama-batched-bench PATH: a "
                                                              "llama-batched-bench built from llama.cpp's source"}
        elif not is_gguf(ckpt.path):
            result["peer"] = {"name": "llama.cpp", "skipped": "llama-batched-bench reads GGUF files; give the "
                                                              "model as one"}
        else:
            size = ckpt.path.stat().st_size
            if not peer_fits_beside(size, size):  # its mapped file beside Tandem's copies would not fit in RAM
                model.close()
            theirs = llama_batched(binary, ckpt.path, threads, w)
            result["peer"] = {"name": "llama.cpp", **theirs, "ratio": round(best / theirs["tok_s"], 3)}
    return result
