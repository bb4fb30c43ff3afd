"""`tandem bench e2e`: the Fiddler evaluation scenarios, Tandem beside transformers in one process.

Scenarios: decode (input × output lengths: tokens/s end to end, TTFT and inter-token latency), prefill
(TTFT for long inputs; tokens/s there is prompt tokens per second) and beam search (widths; input 32,
output 64). With `--peer transformers` the same prompt ids and settings go through transformers and each
row gets the ratio: in this process, alternating row by row, when both copies of the weights fit in RAM
(Tandem's memory-mapped pages and transformers' own); otherwise transformers runs in a child process after
Tandem's rows, so the two never compete for memory. CPU-only decode rows also report the weight bytes
touched per token and that traffic as a fraction of the DRAM bandwidth measured in the same run (the
roofline).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import torch

from tandem.autotune.bench.inputs import bench_prompt_ids
from tandem.autotune.bench.llama import llama_rows
from tandem.autotune.microbench import PEAK_OF, compute_peak, dram_bandwidth
from tandem.autotune.probe import probe
from tandem.runtime.attention import matrix_bytes
from tandem.runtime.config import ModelConfig
from tandem.runtime.engine import Engine, GenerationStats
from tandem.runtime.gguf import is_gguf
from tandem.runtime.loader import LoadedModel
from tandem.runtime.moe import layer_mlp, mlp_matrices
from tandem.runtime.sampling import SamplingParams
from tandem.runtime.state import StateCache
from tandem.runtime.weights import attention_tensors

FULL = {
    "decode": [(i, o) for i in (32, 64, 128, 256) for o in (64, 128, 256, 512)],
    "prefill": [(n, 1) for n in (512, 1024, 2048, 4096)],
    "beam": [(32, 64, w) for w in (4, 8, 12, 16)],
}
DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
QUICK = {"decode": [(32, 64), (128, 64)], "prefill": [(512, 1), (2048, 1)], "beam": [(32, 32, 4), (32, 32, 8)]}


def _tandem(loaded: LoadedModel, engine_for: Callable[[int], Engine], prompt: list[int], out: int,
            beams: int) -> dict[str, float]:
    engine = engine_for(beams)
    stats = GenerationStats()
    start = time.perf_counter()
    n = sum(1 for _ in engine.generate(prompt, SamplingParams(max_new_tokens=out, beams=beams), stats))
    total = time.perf_counter() - start
    itl = stats.decode_s / max(1, n - 1) if beams == 1 else 0.0
    return {"tok_s": n / total if total else 0.0, "ttft_s": stats.ttft_s, "itl_ms": itl * 1000, "tokens": n}


def _peer(ref: Any, prompt: list[int], out: int, beams: int) -> dict[str, float]:
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        start = time.perf_counter()
        ref(ids)  # the prefill alone, for time to first token
        ttft = time.perf_counter() - start
        start = time.perf_counter()
        ref.generate(ids, max_new_tokens=out, min_new_tokens=out, do_sample=False, num_beams=beams, pad_token_id=0)
        total = time.perf_counter() - start
    return {"tok_s": out / total if total else 0.0, "ttft_s": ttft,
            "itl_ms": max(0.0, total - ttft) / max(1, out - 1) * 1000 if beams == 1 else 0.0}


def _load_peer(path: str | Path, dtype: torch.dtype) -> Any:
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def peer_child() -> None:
    """Child-process side of an out-of-process peer: a JSON job on stdin, one result per point on stdout."""
    job = json.loads(sys.stdin.read())
    torch.set_num_threads(job["threads"])
    ref = _load_peer(job["model"], getattr(torch, job["dtype"]))
    results = [_peer(ref, p["prompt"], p["out"], p["beams"]) for p in job["points"]]
    sys.stdout.write(json.dumps(results))


def _peer_in_child(path: str | Path, dtype: torch.dtype, points: list[dict[str, Any]]) -> list[dict[str, float]]:
    job = {"model": str(path), "dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
           "points": points}
    done = subprocess.run([sys.executable, "-c", "from tandem.autotune.bench.e2e import peer_child; peer_child()"],
                          input=json.dumps(job), capture_output=True, text=True, check=False)
    if done.returncode != 0:
        from tandem.kernels.errors import TandemError

        tail = done.stderr.strip().splitlines()[-1:] or ["no message"]
        raise TandemError(f"the transformers peer failed in its child process: {tail[0]}")
    return json.loads(done.stdout)


def grid_of(quick: bool) -> dict[str, list[tuple[int, ...]]]:
    return QUICK if quick else FULL


def flops_per_token(cfg: ModelConfig) -> float:
    """Multiply-adds x 2 of one prompt token through the model's matrices: attention's projections, the router, the
    top-k routed experts, shared experts and dense layers' MLPs. Attention over the context and lm_head (once a
    prompt) are left out: the figure is what a prefill must compute at the least."""
    h, total = cfg.hidden_size, 0
    for i in range(cfg.num_layers):
        total += sum(rows * cols for rows, cols in (s for s in attention_tensors(cfg, i).values() if len(s) == 2))
        if cfg.sparse_layers[i]:
            total += h * (cfg.num_experts + 3 * (cfg.top_k * cfg.moe_intermediate_size
                                                 + cfg.shared_expert_intermediate_size))
            if cfg.parallel_dense:  # (Gemma 4's MLP beside the experts)
                total += 3 * h * cfg.dense_intermediate_size
        else:
            total += 3 * h * cfg.dense_intermediate_size
    return 2.0 * total


def peer_fits_beside(tandem_bytes: int, peer_bytes: int, total_ram: int | None = None) -> bool:
    """Whether a peer's copy of the weights (transformers' own, or llama.cpp's mapped file) fits in RAM beside
    Tandem's (20% spare)."""
    total = total_ram if total_ram is not None else psutil.virtual_memory().total
    return tandem_bytes + peer_bytes <= 0.8 * total


def mixer_bytes(a: Any) -> int:
    """A layer's token mixer's matrices as kept: attention's q, k, v and o, or a recurrent mixer's projections."""
    return matrix_bytes(a.qkv) + matrix_bytes(a.o) if hasattr(a, "qkv") else matrix_bytes(a.proj) + matrix_bytes(a.out)


def bench_e2e(loaded: LoadedModel, scenarios: list[str], quick: bool = False, peer: str | None = None,
              grid: dict[str, list[tuple[int, ...]]] | None = None, peer_process: str = "auto",
              llama_bench: Path | None = None) -> dict[str, Any]:
    """Tandem's rows for every point of `grid` (default: QUICK or FULL), beside a peer's: transformers (in this
    process or a child), or llama.cpp's `llama_bench` binary on the same GGUF file, after Tandem's rows."""
    grid = grid or grid_of(quick)
    model, cfg = loaded.model, loaded.model.cfg
    engines: dict[int, Engine] = {}

    def engine_for(beams: int) -> Engine:
        if beams not in engines:
            if beams == 1:
                engines[beams] = Engine(model, ())
            else:  # beam search needs a KV cache row per beam; the weights are shared
                engines[beams] = Engine(model.with_batch(beams), ())
        return engines[beams]

    ref = None
    in_child = False
    if peer == "transformers":
        on_disk = loaded.checkpoint.file_bytes  # transformers holds every weight in the compute dtype
        fits = peer_fits_beside(on_disk, on_disk * max(1, model.dtype.itemsize // 2))
        in_child = peer_process == "child" or (peer_process == "auto" and not fits)
        if not in_child:
            ref = _load_peer(loaded.checkpoint.path, model.dtype)
    layer_experts = next(iter(model.dispatcher.cpu_experts.values()), [])
    # one expert's bytes as the kernels read them: the file's dtype, or quantized (int8, int4 with their scales)
    expert_bytes = layer_experts[0].nbytes if layer_experts else \
        3 * cfg.hidden_size * cfg.moe_intermediate_size * model.dtype.itemsize
    dense_bytes = matrix_bytes(model.embed, 1) + matrix_bytes(model.norm) + matrix_bytes(model.lm_head)
    dense_bytes += sum(mixer_bytes(layer.attn) for layer in model.layers)
    # a hybrid's recurrent state: read and written once a token
    dense_bytes += 2 * sum(kinds.mixer.cache.nbytes(cfg, 1, 1, model.dtype, layers=[i])
                           for i, kinds in enumerate(model.plan) if issubclass(kinds.mixer.cache, StateCache))
    dense_bytes += sum(sum(matrix_bytes(m) for m in mlp_matrices(mlp)) for mlp in  # dense layers', shared experts',
                       (layer_mlp(layer.ffn) for layer in model.layers) if mlp is not None)  # MLPs beside experts
    per_token = dense_bytes + cfg.num_moe_layers * cfg.top_k * expert_bytes  # weights read per decode token
    rows = []
    later: list[dict[str, Any]] = []  # points for a child-process peer, run after Tandem's rows
    _touch_every_expert(loaded)
    _tandem(loaded, engine_for, bench_prompt_ids(loaded.tokenizer, 16), 4, 1)  # warm-up
    # and a long prompt's, as llama-bench warms up each test: the first one pays for pages of the KV cache and the
    # kernels' buffers touched for the first time (measured: a 512-token prefill 15-20 % slower the first time)
    long = [p[0] for p in grid.get("prefill", []) if p[0] + 1 < model.context] if "prefill" in scenarios else []
    if long:
        _tandem(loaded, engine_for, bench_prompt_ids(loaded.tokenizer, min(long)), 1, 1)
    # DRAM bandwidth: probed before Tandem's rows, before each decode row and after them all; the best counts (on a
    # shared machine the probe alone moves by a quarter from one minute to the next, and just after a load while the
    # OS reclaims memory: docs/bench/README.md)
    probes = [dram_bandwidth(torch.get_num_threads(), 2**30)] if model.accel is None else []
    # the compute peak a CPU prefill is bound by, for the model's dtype (none on an accelerator)
    peak = compute_peak()[PEAK_OF[DTYPE_NAMES.get(model.dtype, "fp32")]] if model.accel is None else None
    for scenario in scenarios:
        for point in grid[scenario]:
            n_in, n_out = point[0], point[1]
            beams = point[2] if len(point) > 2 else 1
            if n_in + n_out >= model.context:
                continue
            prompt = bench_prompt_ids(loaded.tokenizer, n_in)
            if scenario == "decode" and probes:
                probes.append(dram_bandwidth(torch.get_num_threads(), 2**30))
            ours = _tandem(loaded, engine_for, prompt, n_out, beams)
            if scenario == "prefill":  # throughput of the prompt itself: input tokens per second of TTFT
                ours["tok_s"] = n_in / ours["ttft_s"] if ours["ttft_s"] else 0.0
            row: dict[str, Any] = {"scenario": scenario, "input": n_in, "output": n_out, "beams": beams,
                                   "tandem_tok_s": round(ours["tok_s"], 3), "ttft_s": round(ours["ttft_s"], 4),
                                   "itl_ms": round(ours["itl_ms"], 3)}
            if scenario == "decode" and probes:
                row["bytes_per_token"] = per_token
            if scenario == "prefill" and peak:  # the prompt's products as a fraction of the machine's peak
                row["compute"] = float(f"{ours['tok_s'] * flops_per_token(cfg) / 1e9 / peak:.3g}")
            if ref is not None:
                _add_peer(row, _peer(ref, prompt, n_out, beams))
            elif in_child:
                later.append({"prompt": prompt, "out": n_out, "beams": beams})
            rows.append(row)
    bw = None
    if probes:
        bw = max(probes + [dram_bandwidth(torch.get_num_threads(), 2**30)])
        for row in rows:
            if "bytes_per_token" in row:  # the weights read per token as a fraction of what DRAM delivers
                # three significant digits: a tiny model's fraction is far below 0.001, and still not zero
                row["roofline"] = float(f"{per_token * 1000 / max(row['itl_ms'], 1e-9) / 1e9 / bw:.3g}")
    plan = model.dispatcher.describe()
    if later:  # Tandem is done: its experts' RAM goes back before the peer loads its own copy
        model.close()
        for row, theirs in zip(rows, _peer_in_child(loaded.checkpoint.path, model.dtype, later), strict=True):
            _add_peer(row, theirs)
    if peer == "llama.cpp":
        threads, file_bytes = model.dispatcher.executor.threads, loaded.checkpoint.file_bytes
        if llama_bench is not None and not peer_fits_beside(file_bytes, file_bytes):
            model.close()  # Tandem's RAM copies go back before llama.cpp maps its own (it would page otherwise)
        peer_mode: str | None = _llama_peer(loaded, rows, llama_bench, threads)
    else:
        peer_mode = None if peer is None else (
            "child process, after Tandem" if in_child else "same process, alternating")
    about = {"path": str(loaded.checkpoint.path), "family": cfg.model_type, "layers": cfg.num_layers,
             "experts": cfg.num_experts, "top_k": cfg.top_k, "dtype": str(model.dtype).removeprefix("torch."),
             "gib": round(loaded.checkpoint.file_bytes / 2**30, 1)}
    return {"machine": probe().to_dict(), "model": about, "plan": plan, "dram_gbps": bw, "peak_gflops": peak,
            "peer": peer_mode, "rows": rows}


def _llama_peer(loaded: LoadedModel, rows: list[dict[str, Any]], binary: Path | None, threads: int) -> str:
    """llama.cpp's rows where it can run them (a binary given, a GGUF file loaded); else why it is skipped."""
    if binary is None:
        return "llama.cpp: skipped (give --llama-bench PATH: a llama-bench built from llama.cpp's source)"
    if not is_gguf(loaded.checkpoint.path):
        return "llama.cpp: skipped (llama-bench reads GGUF files; give the model as one)"
    return llama_rows(rows, binary, loaded.checkpoint.path, threads)


def _touch_every_expert(loaded: LoadedModel) -> None:
    """Run each CPU expert once, so its memory-mapped pages are read and mapped before timing starts: the peer's
    weights are loaded before its rows too, and a first touch costs a page fault per 4 KiB."""
    model = loaded.model
    zero = torch.zeros(1, model.cfg.hidden_size, dtype=model.dtype)
    for experts in model.dispatcher.cpu_experts.values():
        for expert in experts:
            expert(zero)


def _add_peer(row: dict[str, Any], theirs: dict[str, float]) -> None:
    if row["scenario"] == "prefill":  # prompt tokens per second, as for Tandem's row
        theirs["tok_s"] = row["input"] / theirs["ttft_s"] if theirs["ttft_s"] else 0.0
    row |= {"peer_tok_s": round(theirs["tok_s"], 3), "peer_ttft_s": round(theirs["ttft_s"], 4),
            "ratio": round(row["tandem_tok_s"] / theirs["tok_s"], 3) if theirs["tok_s"] else None}
    if row["scenario"] == "prefill":
        row["ttft_ratio"] = round(theirs["ttft_s"] / row["ttft_s"], 3) if row["ttft_s"] else None


def plot(result: dict[str, Any], path: str) -> None:
    """Bars per scenario (Tandem vs peer tokens/s) and the roofline fraction of decode rows, as a PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        from tandem.kernels.errors import TandemError

        raise TandemError("--plot needs matplotlib: pip install 'tandem[plot]' (or matplotlib)") from None
    rows = result["rows"]
    labels = [f"{r['scenario']}\n{r['input']}→{r['output']}" + (f" ×{r['beams']}" if r["beams"] > 1 else "")
              for r in rows]
    fig, (ax0, ax1, ax2) = plt.subplots(3, 1, figsize=(max(6, len(rows) * 1.1), 9))
    x = list(range(len(rows)))
    ratios = [r.get("ratio") or 0 for r in rows]
    ax0.bar(x, ratios, color="tab:green")
    for i, v in enumerate(ratios):
        if v:
            ax0.text(i, v, f"{v:.2f}×", ha="center", va="bottom", fontsize=8)
    ax0.axhline(1.0, color="red", linewidth=0.8)
    ax0.set_ylabel("Tandem ÷ transformers")
    ax0.set_xticks(x, labels, fontsize=7)
    ax1.bar([i - 0.2 for i in x], [r["tandem_tok_s"] for r in rows], width=0.4, label="Tandem")
    if any("peer_tok_s" in r for r in rows):
        ax1.bar([i + 0.2 for i in x], [r.get("peer_tok_s", 0) for r in rows], width=0.4, label="transformers")
    ax1.set_yscale("log")  # prefill (prompt tokens/s) and decode differ by orders of magnitude
    ax1.set_ylabel("tokens/s (prefill: prompt tokens/s)")
    ax1.set_xticks(x, labels, fontsize=7)
    ax1.legend()
    ax2.bar(x, [r.get("roofline", 0) for r in rows], color="gray")
    ax2.axhline(1.0, color="red", linewidth=0.8)
    ax2.set_ylabel("decode: fraction of DRAM bandwidth")
    ax2.set_xticks(x, labels, fontsize=7)
    m = result.get("model")
    if m:
        threads = result.get("plan", {}).get("cpu", {}).get("threads")
        fig.suptitle(f"{m['family']}-shaped, {m['layers']} layers, {m['experts']} experts top-{m['top_k']}, "
                     f"{m['dtype']}, {m['gib']} GiB" + (f"; {threads} CPU threads" if threads else ""), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
