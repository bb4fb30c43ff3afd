"""`tandem bench decode`: decode speed of Tandem and, optionally, transformers on the same checkpoint.

Both run in this process, alternating, with the same prompt ids and greedy decoding; speeds are
reported as medians and as a ratio measured in one run (machines are noisy: compare ratios, not runs).
Decode tokens/s is (N - 1) / (time for N tokens - time for 1 token), measured the same way for both.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from itertools import chain, cycle, repeat
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tandem.kernels.errors import TandemError
from tandem.runtime.cpuinfo import proc_cpuinfo
from tandem.runtime.engine import Engine, GenerationStats
from tandem.runtime.loader import LoadedModel, load
from tandem.runtime.model import MoEModel
from tandem.runtime.sampling import SamplingParams
from tandem.runtime.synth import ASSETS

if TYPE_CHECKING:
    from tandem.kernels.cpu import CpuOptions


def _timed(fn: Callable[[int], None], n: int) -> float:
    start = time.perf_counter()
    fn(n)
    return time.perf_counter() - start


def _decode_rate(fn: Callable[[int], None], new_tokens: int) -> float:
    one = _timed(fn, 1)
    many = _timed(fn, new_tokens)
    return (new_tokens - 1) / max(many - one, 1e-9)


def bench_decode(
    loaded: LoadedModel, prompt_tokens: int = 32, new_tokens: int = 64, repeats: int = 3, peer: str | None = None
) -> dict[str, Any]:
    model_dir = loaded.checkpoint.path
    engine = Engine(loaded.model, ())  # no EOS: always produce exactly the requested count
    text = (ASSETS / "tokenizer_corpus.txt").read_text(encoding="utf-8")
    prompt = (loaded.tokenizer.encode(text) * (1 + prompt_tokens))[:prompt_tokens]

    def tandem(n: int) -> None:
        for _ in engine.generate(prompt, SamplingParams(max_new_tokens=n)):
            pass

    runners: dict[str, Callable[[int], None]] = {"tandem": tandem}
    if peer == "transformers":
        import transformers

        ref = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=loaded.model.dtype).eval()
        ids = torch.tensor([prompt])

        def transformers_run(n: int) -> None:
            with torch.inference_mode():
                ref.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

        runners["transformers"] = transformers_run
    elif peer is not None:
        raise ValueError(f"unknown peer {peer!r}")

    for fn in runners.values():  # warm-up
        fn(2)
    rates: dict[str, list[float]] = {name: [] for name in runners}
    for _ in range(repeats):
        for name, fn in runners.items():  # alternate, so drift hits both alike
            rates[name].append(_decode_rate(fn, new_tokens))
    result: dict[str, Any] = {
        "model": str(model_dir),
        "plan": loaded.model.experts.describe(),
        "family": loaded.checkpoint.config.model_type,
        "dtype": str(loaded.model.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "prompt_tokens": prompt_tokens,
        "new_tokens": new_tokens,
        "decode_tok_s": {name: round(statistics.median(r), 2) for name, r in rates.items()},
        "samples": {name: [round(x, 2) for x in r] for name, r in rates.items()},
    }
    if "transformers" in rates:
        result["ratio"] = round(statistics.median(rates["tandem"]) / statistics.median(rates["transformers"]), 3)
    return result


def bench_offload(
    model_dir: str, expert_fraction: float = 0.25, prompt_tokens: int = 32, new_tokens: int = 64,
    dtype: str = "auto", calibration_tokens: int = 64,
) -> dict[str, Any]:
    """Hit rate of every cache policy and of static popularity placement on one prompt, with the emulated
    accelerator holding `expert_fraction` of all experts; decode speed of each against CPU only."""
    import tempfile

    from tandem.runtime.dispatch import OffloadPolicy, Strategy, budget_for_slots
    from tandem.runtime.expert_cache import Policy

    base = load(model_dir, dtype=dtype, context=prompt_tokens + max(new_tokens, calibration_tokens) + 8)
    cfg = base.model.cfg
    text = (ASSETS / "tokenizer_corpus.txt").read_text(encoding="utf-8")
    ids = base.tokenizer.encode(text)
    prompt = ids[:prompt_tokens]
    calibration = ids[prompt_tokens : prompt_tokens + calibration_tokens] or prompt  # a different text

    def decode(engine: Engine, tokens: list[int], n: int) -> float:
        stats = GenerationStats()
        for _ in engine.generate(tokens, SamplingParams(max_new_tokens=n), stats):
            pass
        return stats.decode_tok_s

    cpu_engine = Engine(base.model, ())
    with tempfile.TemporaryDirectory() as tmp:
        trace = f"{tmp}/calibration.npz"
        decode(cpu_engine, calibration, new_tokens)
        base.model.experts.recorder.save(trace, model=str(model_dir))
        probe = load(model_dir, dtype=dtype, context=base.model.context, accelerator="emulated", vram_gb=1024,
                     policy=OffloadPolicy(cache_ways=0))
        fixed, item = probe.model.accel.used, probe.model.dtype.itemsize
        probe.model.close()
        expert_bytes = 3 * cfg.hidden_size * cfg.moe_intermediate_size * item
        slots = max(1, round(expert_fraction * cfg.num_moe_layers * cfg.num_experts))
        def budget(n: int) -> float:
            return budget_for_slots(fixed, n, expert_bytes) / 1024**3

        setups: dict[str, tuple[OffloadPolicy, str | None, int]] = {
            p.value: (OffloadPolicy(Strategy.CPU, cache_policy=p), None, slots) for p in Policy
        }
        setups["static-popular"] = (OffloadPolicy(Strategy.CPU), trace, slots)
        # every expert on the CPU, but through the accelerator tier: the cost of the orchestration itself
        setups["no-slots"] = (OffloadPolicy(Strategy.CPU), None, 0)
        rows = []
        cpu_rates = []
        for name, (policy, placement, n_slots) in setups.items():
            loaded = load(model_dir, dtype=dtype, context=base.model.context, accelerator="emulated",
                          vram_gb=budget(n_slots), policy=policy, placement=placement)
            rate = decode(Engine(loaded.model, ()), prompt, new_tokens)
            cpu_rates.append(decode(cpu_engine, prompt, new_tokens))  # alternate with the CPU-only run
            stats = loaded.model.experts.request_stats()
            plan = loaded.model.experts.describe()
            loaded.model.close()
            rows.append({"setup": name, "hit_rate": round(stats.hit_rate, 4), "decode_tok_s": round(rate, 2),
                         "cache": plan["cache"], "static_experts": plan["static_experts"],
                         "bytes_h2d": stats.bytes_h2d, "bytes_d2h": stats.bytes_d2h})
    cpu_rate = statistics.median(cpu_rates)
    for row in rows:
        row["speed_vs_cpu_only"] = round(row["decode_tok_s"] / cpu_rate, 3)
    return {
        "model": str(model_dir), "family": cfg.model_type, "dtype": str(base.model.dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(), "expert_slots": slots,
        "experts_total": cfg.num_moe_layers * cfg.num_experts, "prompt_tokens": len(prompt),
        "new_tokens": new_tokens, "cpu_only_decode_tok_s": round(cpu_rate, 2), "rows": rows,
    }


def teacher_forced(model: MoEModel, ids: list[int], sizes: Iterable[int]) -> Iterator[torch.Tensor]:
    """Feed `ids` through the model in chunks of `sizes` tokens (each after the ones before it, from the KV cache),
    yielding each chunk's float32 logits [n, V]: row i predicts the token after the chunk's i-th."""
    pos = 0
    for size in sizes:
        if pos >= len(ids):
            return
        chunk = ids[pos : pos + size]
        yield model.forward(torch.tensor([chunk]), pos, phase="prefill" if pos == 0 else "decode")[0]
        pos += len(chunk)


def bench_quant(model_dir: str, new_tokens: int = 64, prompt_tokens: int = 16, group: int = 64) -> dict[str, Any]:
    """Quality of int8/int4 CPU experts against the unquantized model (same dtype), teacher-forced:
    the unquantized greedy continuation is fed to every variant one token at a time (the decode path),
    and at each step the logits are compared and the greedy choices checked for agreement."""
    from tandem.kernels.cpu import CpuOptions

    variants = {"none": CpuOptions(), "int8": CpuOptions(quant="int8"),
                "int4": CpuOptions(quant="int4", group=group)}
    models = {name: load(model_dir, cpu=opts) for name, opts in variants.items()}
    base = models["none"]
    text = (ASSETS / "tokenizer_corpus.txt").read_text(encoding="utf-8")
    prompt = base.tokenizer.encode(text)[:prompt_tokens]
    tokens = list(Engine(base.model, ()).generate(prompt, SamplingParams(max_new_tokens=new_tokens)))
    sequence = prompt + tokens[:-1]  # the prompt, then each step's token: logits for every new token
    logits = {name: torch.cat(list(teacher_forced(loaded.model, sequence, chain([len(prompt)], repeat(1)))))
              [len(prompt) - 1 :] for name, loaded in models.items()}  # [steps, V]
    ref = logits["none"]
    result: dict[str, Any] = {"model": str(model_dir), "dtype": str(base.model.dtype).removeprefix("torch."),
                              "steps": len(ref), "int4_group": group, "variants": {}}
    for name in ("int8", "int4"):
        got = logits[name]
        drift = (got - ref).abs()
        result["variants"][name] = {
            "max_abs_logit_drift": round(drift.max().item(), 4),
            "mean_abs_logit_drift": round(drift.mean().item(), 4),
            "relative_drift": round((drift.norm() / ref.norm()).item(), 4),
            "greedy_agreement": round((got.argmax(-1) == ref.argmax(-1)).float().mean().item(), 4),
        }
    return result


# Chunks of a teacher-forced pass: decode steps, then every count of tokens a layer kernel call takes (each
# expert gets at most that many), then more than it takes (experts one by one, some above the crossover).
NUMERICS_CHUNKS = (1, 1, 1, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 16, 17)
NUMERICS_MARGIN = 0.01  # every bf16 path agrees with fp32 at least as often as the best one, minus one point


def numerics_paths() -> dict[str, CpuOptions]:
    """The bf16 paths this CPU (as masked) can take: the kernels' own choice and each variant forced (`--kernel-isa`),
    which the contract covers, and torch alone (what runs where the kernels could not be built), which it does
    not: its logits are torch's bf16 results, rounded."""
    from tandem.kernels.cpu import CpuOptions, available_isas

    return {"auto": CpuOptions(), **{f"isa={isa}": CpuOptions(isa=isa) for isa in available_isas()},
            "torch": CpuOptions(use_kernel=False)}


NUMERICS_OUTSIDE = ("torch",)  # paths measured but not held to the contract (see numerics_paths)


def numerics_top1(model_dir: str | Path, dtype: str, opts: CpuOptions, tokens: int) -> torch.Tensor:
    """The top-1 token at each of the first `tokens` positions of the bundled texts, teacher-forced in
    NUMERICS_CHUNKS."""
    text = "".join((ASSETS / name).read_text(encoding="utf-8") for name in ("tokenizer_corpus.txt",
                                                                             "bench_prompts.txt"))
    loaded = load(model_dir, dtype=dtype, context=tokens + 1, cpu=opts)
    try:
        ids = loaded.tokenizer.encode(text)[:tokens]
        if len(ids) < tokens:
            raise TandemError(f"the bundled texts hold only {len(ids)} tokens of this model; ask for fewer")
        return torch.cat([t.argmax(-1) for t in teacher_forced(loaded.model, ids, cycle(NUMERICS_CHUNKS))])
    finally:
        loaded.model.close()


def bench_numerics(model_dir: str | Path, tokens: int = 1024, paths: list[str] | None = None, masks: bool = False,
                   masked_paths: list[str] | None = None, reference: list[int] | None = None,
                   progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """How often each bf16 path picks the same top-1 token as the fp32 path, teacher-forced over `tokens` tokens
    of the bundled texts fed in NUMERICS_CHUNKS, and whether each is within NUMERICS_MARGIN of the best of all.

    `paths`: this CPU's (default: every one). `masks`: then `masked_paths` (default: every one) again under each
    feature mask this CPU can play (kernels.isa.masks_to_play), each in a child process with torch capped too,
    against the same fp32 tokens. `reference`: those fp32 top-1 tokens, given (how the children get them) instead
    of measured. Result: "cpus" maps the mask of each run ("" for the CPU as the process found it) to its paths."""
    from tandem.kernels.cpu import CpuOptions
    from tandem.kernels.isa import ENV, masked_features, masks_to_play, present_features

    def say(message: str) -> None:
        if progress:
            progress(message)

    options = numerics_paths()
    if reference is None:
        say(f"fp32: {tokens} tokens")
        ref = numerics_top1(model_dir, "fp32", CpuOptions(), tokens)
    else:
        ref = torch.tensor(reference)
    playing = os.environ.get(ENV, "")
    run: dict[str, float] = {}
    for name in list(options) if paths is None else paths:
        say(f"{name}: {tokens} tokens" + (f" ({ENV}={playing})" if playing else ""))
        run[name] = (numerics_top1(model_dir, "bf16", options[name], tokens) == ref).float().mean().item()
    cpus = {playing: run}
    info = proc_cpuinfo()
    flags = info["flags"] if info else []
    for mask, hidden in masks_to_play(flags) if masks else []:
        if hidden != present_features(flags) & masked_features():  # (the CPU this process plays: measured above)
            cpus[mask] = _numerics_child(model_dir, tokens, ref, mask, masked_paths)
    best = max((a for run in cpus.values() for name, a in run.items() if name not in NUMERICS_OUTSIDE), default=0.0)
    return {"model": str(model_dir), "tokens": tokens, "chunks": list(NUMERICS_CHUNKS), "best": round(best, 4),
            "margin": NUMERICS_MARGIN,
            "cpus": {mask: {name: {"agreement": round(a, 4), "contract": name not in NUMERICS_OUTSIDE,
                                   "within_margin": a >= best - NUMERICS_MARGIN} for name, a in run.items()}
                     for mask, run in cpus.items()}}


def _numerics_child(model_dir: str | Path, tokens: int, ref: torch.Tensor, mask: str, paths: list[str] | None
                    ) -> dict[str, float]:
    """`tandem bench numerics` under a feature mask, in a child process (torch reads its caps at start-up)."""
    from tandem.kernels.isa import ENV

    with tempfile.TemporaryDirectory() as tmp:
        reference = Path(tmp) / "fp32-top1.json"
        reference.write_text(json.dumps(ref.tolist()), encoding="utf-8")
        command = [sys.executable, "-m", "tandem.app.cli", "bench", "numerics", "--model", str(model_dir), "--tokens",
                   str(tokens), "--reference", str(reference)] + (["--paths", ",".join(paths)] if paths else [])
        done = subprocess.run(command, env={**os.environ, ENV: mask}, capture_output=True, text=True)
    if done.returncode != 0:
        raise TandemError(f"numerics under {ENV}={mask} failed: {done.stderr.strip()[-500:]}")
    run = json.loads(done.stdout)["cpus"][mask]
    return {name: row["agreement"] for name, row in run.items()}


def bench_prompt_ids(tokenizer: object, n: int) -> list[int]:
    """`n` prompt tokens from the bundled chat-like texts (repeated as needed)."""
    text = (ASSETS / "bench_prompts.txt").read_text(encoding="utf-8")
    ids = tokenizer.encode(text)  # type: ignore[attr-defined]
    return (ids * (1 + n // max(1, len(ids))))[:n]
