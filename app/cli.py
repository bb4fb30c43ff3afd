"""`tandem` command line. Errors a user can fix print `error: ...` and exit with status 2."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from tandem.app import flags
from tandem.app.output import (
    EXIT_PIPE_CLOSED,
    PipeClosed,
    check_output_file,
    check_output_folder,
    guarded_stdout,
    silence_stdout,
)
from tandem.app.prompt_input import prompt_text
from tandem.autotune.bench.shapes import checkpoint_shapes, real_shapes
from tandem.kernels.errors import OutputError, TandemError, UsageError
from tandem.runtime.families import supported_model_types
from tandem.runtime.paths import read_bounded

EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    parser = flags.ArgumentParser(prog="tandem", description="Run Mixture-of-Experts language models locally.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    gen = sub.add_parser("generate", help="generate text from a prompt, streamed to stdout")
    gen.add_argument("--model", type=flags.path, default=None,
                     help="Hugging Face model folder (config.json + *.safetensors); default: the built-in model")
    gen.add_argument("text", nargs="?", help="the prompt text (or --prompt); - reads it from standard input")
    gen.add_argument("-p", "--prompt", default=None, help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-new-tokens", type=flags.whole(0), default=256)
    gen.add_argument("--temperature", type=flags.real(0), default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=flags.whole(0), default=0, help="0 = off")
    gen.add_argument("--top-p", type=flags.real(0, 1, low_open=True), default=1.0, help="1 = off")
    gen.add_argument("--repetition-penalty", type=flags.real(0, low_open=True), default=1.0, help="1 = off")
    gen.add_argument("--seed", type=flags.seed, default=None)
    gen.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto",
                     help="compute dtype (auto: bf16 where the CPU has native bf16, else fp32)")
    gen.add_argument("--context", type=flags.whole(2), default=None,
                     help="context length to allocate (default: min(model, 4096))")
    gen.add_argument("--force", action="store_true", help="load even if the RAM estimate says it will not fit")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    gen.add_argument("--beams", type=flags.whole(1), default=1, help="beam search width (1 = off)")
    gen.add_argument("--record-trace", type=flags.path, metavar="FILE",
                     help="save the expert activation trace to exactly FILE (numpy .npz format, whatever the name)")
    add_runtime_args(gen)
    gen.set_defaults(func=_generate)

    probe = sub.add_parser("probe", help="show what hardware was found (CPU ISA and cores, RAM, GPUs, PCIe)")
    probe.add_argument("--json", action="store_true", help="print the findings as JSON")
    probe.add_argument("--record", type=flags.path, metavar="FILE",
                       help="also save the raw readings (e.g. for a bug report)")
    probe.add_argument("--from", dest="source", type=flags.path, metavar="FILE",
                       help="read recorded readings instead of this machine")
    probe.set_defaults(func=_probe)

    chat = sub.add_parser("chat", help="the chat app (terminal UI)")
    chat.add_argument("model", nargs="?", type=flags.path, default=None,
                      help="model folder (default: the built-in model)")
    chat.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto")
    chat.add_argument("--context", type=flags.whole(2), default=None)
    chat.add_argument("--force", action="store_true")
    chat.add_argument("--models-dir", action="append", default=[], metavar="DIR",
                      help="a folder of model folders for the picker (Ctrl+O); repeatable (default: ~/models)")
    add_runtime_args(chat)
    chat.set_defaults(func=_chat)

    tune = sub.add_parser("autotune", help="measure this machine on a model and save the best plan as a profile")
    tune.add_argument("--model", type=flags.path, help="model folder to tune for (default: the built-in model)")
    tune.add_argument("--quick", action="store_true", help="fewer measurements (about 15 s)")
    tune.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto")
    tune.add_argument("--json", action="store_true")
    tune.set_defaults(func=_autotune)

    plan = sub.add_parser("plan", help="plan for hardware described in a JSON file, without running anything")
    plan.add_argument("--hardware", type=flags.path, required=True, metavar="HW.json",
                      help="see the README for the schema")
    plan.add_argument("--model", type=flags.path, required=True, help="model folder or its config.json")
    plan.add_argument("--trace", type=flags.path,
                      help="a routing trace recorded with --record-trace (default: synthetic)")
    plan.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    plan.add_argument("--json", action="store_true")
    plan.set_defaults(func=_plan)

    bench = sub.add_parser("bench", help="benchmarks (print JSON)")
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    decode = bench_sub.add_parser("decode", help="decode tokens/s, optionally against transformers")
    decode.add_argument("--model", type=flags.path, default=None, help="default: the built-in model")
    decode.add_argument("--prompt-tokens", type=flags.whole(1), default=32)
    decode.add_argument("--new-tokens", type=flags.whole(1), default=64)
    decode.add_argument("--repeats", type=flags.whole(1), default=3)
    decode.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto")
    decode.add_argument("--context", type=flags.whole(2), default=None)
    decode.add_argument("--force", action="store_true")
    decode.add_argument("--peer", choices=["transformers"], default=None)
    add_runtime_args(decode)
    decode.set_defaults(func=_bench_decode)
    offload = bench_sub.add_parser("offload", help="cache policies and static placement on the emulated accelerator")
    offload.add_argument("--model", type=flags.path, required=True)
    offload.add_argument("--expert-fraction", type=flags.real(0, 1, low_open=True), default=0.25,
                         help="share of all experts that fit")
    offload.add_argument("--prompt-tokens", type=flags.whole(1), default=32)
    offload.add_argument("--new-tokens", type=flags.whole(1), default=64)
    offload.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto")
    offload.set_defaults(func=_bench_offload)

    e2e = bench_sub.add_parser("e2e", help="Fiddler's scenarios end to end, optionally beside transformers")
    e2e.add_argument("--model", type=flags.path, default=None, help="default: the built-in model")
    e2e.add_argument("--scenario", choices=["decode", "prefill", "beam", "all"], default="all")
    e2e.add_argument("--quick", action="store_true", help="a few points per scenario (minutes, not hours)")
    e2e.add_argument("--peer", choices=["transformers"], default=None)
    e2e.add_argument("--peer-process", choices=["auto", "same", "child"], default="auto",
                     help="where the peer runs: beside Tandem, alternating (when both copies fit in RAM), or in a "
                          "child process after Tandem's rows (auto: the first that fits)")
    e2e.add_argument("--json", metavar="FILE", help="write the results as JSON")
    e2e.add_argument("--plot", metavar="FILE.png", help="draw the results (needs matplotlib)")
    e2e.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto")
    e2e.add_argument("--context", type=flags.whole(2), default=None)
    e2e.add_argument("--force", action="store_true")
    add_runtime_args(e2e)
    e2e.set_defaults(func=_bench_e2e)

    val = bench_sub.add_parser("plan", help="the planner and simulator against real runs (regret, prediction error)")
    val.add_argument("--model", type=flags.path, required=True)
    val.add_argument("--expert-fraction", type=flags.real(0, 1, low_open=True), default=0.25)
    val.add_argument("--tokens", type=flags.whole(1), default=32)
    val.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto")
    val.set_defaults(func=_bench_plan)

    kern = bench_sub.add_parser("kernels", help="CPU expert kernels against the DRAM roofline, beside torch")
    shapes = real_shapes()
    kern.add_argument("--shapes", default=",".join(shapes))
    kern.add_argument("--dtypes", default="bf16,fp16,fp32,int8,int4")
    kern.add_argument("--tokens", default="1,2,4,8,16,64,256")
    kern.add_argument("--threads", type=flags.threads, default=None)
    kern.add_argument("--json", action="store_true", help="print the rows as JSON")
    kern.set_defaults(func=_bench_kernels)

    quant = bench_sub.add_parser("quant", help="int8/int4 CPU experts: logits drift and greedy agreement")
    quant.add_argument("--model", type=flags.path, required=True)
    quant.add_argument("--new-tokens", type=flags.whole(1), default=64)
    quant.add_argument("--quant-group", type=int, choices=[32, 64, 128], default=64)
    quant.set_defaults(func=_bench_quant)

    num = bench_sub.add_parser("numerics", help="bf16 paths against fp32: top-1 agreement, teacher-forced")
    num.add_argument("--model", type=flags.path, default=None, help="model folder (default: the built-in model)")
    num.add_argument("--tokens", type=flags.whole(1), default=1024, help="tokens of the bundled texts to feed")
    num.add_argument("--paths", default=None, help="comma list of paths (default: every one this CPU can take)")
    num.add_argument("--masks", action="store_true",
                     help="then every path again as each CPU with fewer features this one can play")
    num.add_argument("--reference", default=None, help=argparse.SUPPRESS)  # fp32 top-1 tokens (JSON), for --masks
    num.set_defaults(func=_bench_numerics)

    mbm = sub.add_parser("make-bench-model", help="write a random-weight checkpoint with a real model's shapes")
    writable = checkpoint_shapes()
    not_yet = [name for name in shapes if name not in writable]
    mbm.add_argument("--shape", required=True, help=f"{', '.join(writable)} ({', '.join(not_yet)}: not yet)")
    mbm.add_argument("--layers", type=flags.whole(1), default=None, help="fewer layers than the real model")
    mbm.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    mbm.add_argument("--out", required=True)
    mbm.set_defaults(func=_make_bench_model)

    synth = sub.add_parser("make-test-model", help="write a small random-weight checkpoint (for trying things out)")
    synth.add_argument("--family", default="mixtral", help=f"model_type: {', '.join(supported_model_types())}")
    synth.add_argument("--out", required=True, help="folder to create")
    synth.add_argument("--seed", type=flags.seed, default=0)
    synth.set_defaults(func=_make_test_model)
    return parser


def add_runtime_args(p: argparse.ArgumentParser) -> None:
    """Where experts run: the accelerator tier, the strategy, the expert cache and static placement."""
    g = p.add_argument_group("accelerator and expert placement")
    g.add_argument("--accelerator", choices=["auto", "none", "cuda", "emulated"], default="auto",
                   help="auto: CUDA when usable, else CPU only; emulated: the CPU plays a GPU (needs --vram-gb)")
    g.add_argument("--vram-gb", type=flags.real(0, flags.MAX_VRAM_GB, low_open=True), default=None,
                   help=f"accelerator memory budget in GB, at most {flags.MAX_VRAM_GB:g} (caps CUDA)")
    g.add_argument("--strategy", choices=["fiddler", "cpu", "fetch"], default=None,
                   help="fiddler: per-expert choice by latency; cpu: never copy weights; fetch: always copy")
    g.add_argument("--cache-ways", type=flags.whole(0), default=None,
                   help="ways per index of the expert cache (0: no cache, only static placement)")
    g.add_argument("--cache-policy", choices=["lru", "fifo", "lfu", "trace"], default=None, help="default: lru")
    g.add_argument("--max-inflight", type=flags.whole(1), default=4, help="background expert copies in flight at most")
    g.add_argument("--placement", type=flags.path, metavar="FILE",
                   help="pin the most popular experts of a recorded trace")
    g.add_argument("--cost", type=flags.cost, metavar="A,B,GPU,T",
                   help="latency model in ms: cpu_lat(s)=A+B*s, gpu_lat, transfer_lat (default: from sizes)")
    c = p.add_argument_group("CPU experts")
    c.add_argument("--threads", type=flags.threads, default=None, help="threads for CPU experts (default: all cores)")
    c.add_argument("--quant", choices=["none", "int8", "int4"], default="none",
                   help="weight-only quantization of CPU experts, done at load (opt-in)")
    c.add_argument("--quant-group", type=int, choices=[32, 64, 128], default=64, help="int4 group size")
    c.add_argument("--kernel-crossover", type=flags.whole(0), default=None,
                   help="up to this many tokens per expert use the compiled kernel; more use torch "
                        "(default: 16 with AMX, else 8)")
    c.add_argument("--resident", action=argparse.BooleanOptionalAction, default=None,
                   help="read the experts into RAM at load instead of streaming them from the memory-mapped files "
                        "(faster decode, a longer load; default: when they fit in 70%% of the available RAM)")
    c.add_argument("--kernel-isa", choices=["auto", "base", "avx2", "avx512", "avx512bf16", "amx"], default="auto",
                   help="force a kernel variant (auto: the best this CPU supports)")
    p.add_argument("--no-profile", action="store_true",
                   help="ignore this machine's tuning profile (flags given explicitly always win over it)")


def resolve_model(path: str | None) -> str:
    """The folder to load: the one given, or the built-in model (built on first use, with progress)."""
    if path is not None:  # an empty name never gets here (flags.path)
        return path
    from tandem.runtime.builtin import builtin_dir, ensure_builtin

    if not (builtin_dir() / "tandem-builtin.json").exists():
        print("building the built-in model (SmolLM2-135M-Instruct as an 8-expert MoE), once…", file=sys.stderr)

    return str(ensure_builtin(_progress))


def _progress(message: str, fraction: float) -> None:
    """A long step's progress on stderr: one updating line on a terminal, only the end in a log."""
    if sys.stderr.isatty():
        print(f"\r  [{fraction:4.0%}] {message:<40}", end="" if fraction < 1 else "\n", file=sys.stderr, flush=True)
    elif fraction >= 1:
        print(f"  {message}: done", file=sys.stderr, flush=True)


def _note(text: str) -> None:
    print(f"note: {text}", file=sys.stderr)


def load_from_args(args: argparse.Namespace, batch: int = 1, notify: Callable[[str], None] = _note,
                   progress: Callable[[str, float], None] | None = _progress):
    """Load the model the arguments describe (a profile fills what they leave open). -> LoadedModel"""
    from tandem.kernels.cpu import CpuOptions, available_isas
    from tandem.kernels.errors import TandemError as Err
    from tandem.runtime.cost import CostModel
    from tandem.runtime.dispatch import OffloadPolicy, Strategy
    from tandem.runtime.expert_cache import Policy
    from tandem.runtime.loader import load

    args.model = resolve_model(args.model)
    cost: CostModel | None = args.cost  # read and checked with the flags (flags.cost)
    if not args.no_profile:
        apply_profile(args, notify)
    policy = OffloadPolicy(Strategy(args.strategy or "fiddler"), args.cache_ways, Policy(args.cache_policy or "lru"),
                           static=tuple(tuple(k) for k in getattr(args, "static_experts", ())),
                           max_inflight=args.max_inflight, cost=cost)
    isa = None if args.kernel_isa == "auto" else args.kernel_isa
    if isa is not None and isa not in available_isas():
        raise Err(f"--kernel-isa {isa} is not available on this machine (available: {', '.join(available_isas())})")
    limit = flags.cpu_threads_available()
    if args.threads is not None and not 1 <= args.threads <= limit:  # a profile's count: the flag's own is checked
        raise Err(f"--threads must be between 1 and {limit}, the number of CPU threads this machine has "
                  f"(the profile says {args.threads}; run tandem autotune again)")
    cpu = CpuOptions(args.threads, args.kernel_crossover, None if args.quant == "none" else args.quant,
                     args.quant_group, isa, resident=args.resident)
    return load(args.model, dtype=args.dtype, context=args.context, force=args.force, accelerator=args.accelerator,
                vram_gb=args.vram_gb, policy=policy, batch=batch, placement=args.placement, cpu=cpu,
                progress=progress)


def apply_profile(args: argparse.Namespace, notify: Callable[[str], None]) -> None:
    """Fill the settings the user did not give from this machine's profile for this model (if any)."""
    from tandem.autotune.plan import Plan
    from tandem.autotune.probe import probe
    from tandem.autotune.profile import find_profile, model_fingerprint
    from tandem.kernels.cpu import available_isas
    from tandem.runtime.checkpoint import open_checkpoint
    from tandem.runtime.loader import default_dtype, read_cpu_flags

    ckpt = open_checkpoint(args.model)
    dtype = default_dtype(read_cpu_flags()) if args.dtype == "auto" else args.dtype
    found = find_profile(probe().fingerprint(), model_fingerprint(ckpt.raw_config, dtype))
    if found.notice:
        notify(found.notice)
    if found.profile is None:
        return
    plan = Plan.from_dict(found.profile.plan)
    if args.threads is None:
        args.threads = plan.threads
    if args.kernel_crossover is None and plan.crossover:
        args.kernel_crossover = plan.crossover
    if args.kernel_isa == "auto" and plan.kernel_isa in available_isas():
        args.kernel_isa = plan.kernel_isa
    if plan.accelerator:
        args.strategy = args.strategy or plan.strategy
        args.cache_policy = args.cache_policy or plan.cache_policy
        if args.cache_ways is None and plan.cache_ways:
            args.cache_ways = plan.cache_ways
        if args.placement is None:
            args.static_experts = found.profile.plan.get("static", [])


def _chat(args: argparse.Namespace) -> int:
    from tandem.app.backend import RuntimeBackend
    from tandem.app.tui import TandemApp

    if args.model is None:
        resolve_model(None)  # a first-time build of the built-in model shows its progress here, before the UI
    notices: list[str] = []

    def load_backend(path: str | None) -> RuntimeBackend:
        args.model = path
        return RuntimeBackend(load_from_args(args, notify=notices.append, progress=app.loading_progress))

    folders = [Path(p).expanduser() for p in args.models_dir] or [Path.home() / "models"]
    app = TandemApp(load_backend, args.model, models_folders=folders)
    app.run()
    for text in notices:
        print(f"note: {text}", file=sys.stderr)
    return 0


def _autotune(args: argparse.Namespace) -> int:
    from tandem.autotune.microbench import Step
    from tandem.autotune.run import autotune

    args.model = resolve_model(args.model)
    def report(step: Step) -> None:
        print(f"[{step.done}/{step.total}] {step.name}", file=sys.stderr)

    tuned = autotune(args.model, args.dtype, args.quick, progress=None if args.json else report)
    if args.json:
        print(json.dumps(tuned.result.to_dict() | {"profile": str(tuned.path)}, indent=1))
        return 0
    plan, result = tuned.result.plan, tuned.result
    cache = "none"
    if plan.cache_ways:
        cache = f"{plan.cache_indexes} indexes x {plan.cache_ways} ways ({plan.cache_policy})"
    print(f"plan: {plan.threads} CPU threads, kernel {plan.kernel_isa or 'torch'} up to {plan.crossover or 0} tokens, "
          f"{'accelerator: ' + plan.strategy if plan.accelerator else 'CPU only'}, cache {cache}, "
          f"{plan.static_experts} static experts")
    print(f"predicted decode: {result.predicted_tok_s:.1f} tok/s (hit rate {result.hit_rate:.0%})")
    print(f"profile saved to {tuned.path}")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from tandem.autotune.costs import from_hardware_file
    from tandem.autotune.plan import ModelShape, make_plan
    from tandem.runtime.checkpoint import open_checkpoint
    from tandem.runtime.families import parse_config
    from tandem.runtime.trace import load_sequence

    hw = _read_json(args.hardware, "hardware file")
    model = Path(args.model)
    if model.exists() and not model.is_dir():  # a config.json, or a FIFO or device refused as one
        cfg = parse_config(_read_json(args.model, "model config"), str(model))[1]
    else:
        cfg = open_checkpoint(model).config
    item = 4 if args.dtype == "fp32" else 2
    shape = ModelShape.from_config(cfg, item)
    meas = from_hardware_file(hw, shape.expert_bytes, 6 * cfg.hidden_size * cfg.moe_intermediate_size,
                              source=args.hardware)
    trace = load_sequence(args.trace, shape.num_layers, shape.num_experts, shape.top_k) if args.trace else None
    result = make_plan(shape, meas, trace)
    if args.json:
        # allow_nan=False: NaN and Infinity are not JSON; the hardware file's ranges keep every figure finite
        print(json.dumps(result.to_dict(), indent=1, allow_nan=False))
    else:
        p = result.plan
        print(f"threads {p.threads}, {'accelerator, strategy ' + p.strategy if p.accelerator else 'CPU only'}, "
              f"cache {p.cache_indexes} x {p.cache_ways} ({p.cache_policy}), {p.static_experts} static experts: "
              f"{result.predicted_tok_s:.1f} tok/s predicted, hit rate {result.hit_rate:.0%}")
    return 0


MAX_JSON_BYTES = 16 * 2**20  # a hand-written description or config.json; a device or a huge file is refused


def _read_json(path: str, what: str) -> Any:
    """A small JSON file named on the command line: a regular file read up to a bound (`read_bounded`), nested
    no deeper than the parser's recursion allows; a folder or a missing file is named as such."""
    p = Path(path)
    try:
        if not p.is_file():
            kind = "a folder" if p.is_dir() else "missing" if not p.exists() else "not a regular file"
            raise TandemError(f"{what} {path} is {kind}")
        return json.loads(read_bounded(p, MAX_JSON_BYTES).decode("utf-8"))
    except RecursionError:
        raise TandemError(f"cannot read {what} {path}: its JSON is nested too deeply to be a real one") from None
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise TandemError(f"cannot read {what} {path}: {e}") from None


def _generate(args: argparse.Namespace) -> int:
    from tandem.runtime.engine import GenerationStats
    from tandem.runtime.sampling import SamplingParams
    from tandem.runtime.tokenizer import StreamDecoder

    text = prompt_text(args.text, args.prompt)
    if args.record_trace:
        check_output_file(args.record_trace, "--record-trace")
    loaded = load_from_args(args, batch=args.beams)
    tok = loaded.tokenizer
    prompt = tok.encode_chat([{"role": "user", "content": text}]) if args.chat else tok.encode(text)
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        repetition_penalty=args.repetition_penalty, seed=args.seed, beams=args.beams,
    )
    stats = GenerationStats()
    tokens: list[int] = []
    stream = StreamDecoder(tok)
    experts = loaded.model.experts
    try:
        for token in loaded.engine.generate(prompt, params, stats):
            tokens.append(token)
            if not args.json:
                sys.stdout.write(stream.push(token))
                sys.stdout.flush()
    finally:
        experts.close()
    placement = experts.request_stats()
    if args.record_trace:
        with _writing(args.record_trace, "--record-trace"):
            experts.recorder.save(args.record_trace, model=str(args.model))
    if args.json:
        out = {"prompt_tokens": prompt, "tokens": tokens, "text": tok.decode(tokens),
               "stats": stats.as_dict() | placement.as_dict(), "plan": experts.describe()}
        print(json.dumps(out))
    else:
        print(stream.flush())
        where = ""
        if loaded.model.accel is not None:
            e = placement.as_dict()["experts"]
            where = f", experts gpu/cpu/fetched {e['gpu']}/{e['cpu']}/{e['fetched']}, hit rate {placement.hit_rate:.0%}"
        print(
            f"[{stats.prompt_tokens} prompt tokens, {stats.new_tokens} new tokens, "
            f"time to first token {stats.ttft_s * 1000:.0f} ms, decode {stats.decode_tok_s:.1f} tok/s{where}]",
            file=sys.stderr,
        )
    return 0


def _probe(args: argparse.Namespace) -> int:
    from tandem.autotune.probe import LiveSources, RecordedSources, describe, probe, record

    sources: LiveSources | RecordedSources = LiveSources()
    if args.source:
        data = _read_json(args.source, "recorded hardware")
        if not isinstance(data, dict):
            raise TandemError(f"recorded hardware {args.source} is not a JSON object; record one with probe --record")
        sources = RecordedSources(data)
    if args.record:
        check_output_file(args.record, "--record")
    try:
        hw = probe(sources)
    except (TypeError, ValueError, IndexError, KeyError, AttributeError) as e:
        if not args.source:
            raise  # this machine's own readings: a bug, keep the traceback
        # a recorded file is anyone's JSON: a reading of the wrong type is the file's fault, not a crash
        raise TandemError(f"recorded hardware {args.source} holds a reading of the wrong type ({e}); "
                          "record one with tandem probe --record") from None
    if args.record:
        with _writing(args.record, "--record"):
            Path(args.record).write_text(json.dumps(record(sources), indent=1), encoding="utf-8")
    # allow_nan=False: NaN and Infinity are not JSON; readings are whole numbers or null (unknown) by now
    print(json.dumps(hw.to_dict(), indent=1, allow_nan=False) if args.json else "\n".join(describe(hw)))
    return 0


@contextmanager
def _writing(path: str, flag: str) -> Iterator[None]:
    """A file output that fails while written (a full disk, a quota) is an error naming the flag: the folder was
    checked before the work, but only the write itself can find the space missing."""
    try:
        yield
    except OSError as e:
        raise OutputError(f"{flag} {path}: could not write it ({e.strerror or e}); free some space or choose "
                          "another place") from None


def _bench_decode(args: argparse.Namespace) -> int:
    from tandem.autotune.bench.decode import bench_decode

    loaded = load_from_args(args)
    try:
        result = bench_decode(loaded, args.prompt_tokens, args.new_tokens, args.repeats, args.peer)
    finally:
        loaded.model.close()
    print(json.dumps(result, indent=1))
    return 0


def _bench_offload(args: argparse.Namespace) -> int:
    from tandem.autotune.bench.offload import bench_offload

    result = bench_offload(args.model, args.expert_fraction, args.prompt_tokens, args.new_tokens, args.dtype)
    print(json.dumps(result, indent=1))
    return 0


def _bench_kernels(args: argparse.Namespace) -> int:
    import torch

    from tandem.autotune.bench.kernels import DTYPES, MAX_TOKENS, bench_kernels
    from tandem.autotune.bench.shapes import shape_names

    # read here, not by argparse: the known dtypes and token counts live beside the benchmark, which imports torch
    shapes = _list_flag("--shapes", flags.names(shape_names(), "shape"), args.shapes)
    dtypes = _list_flag("--dtypes", flags.names(DTYPES, "dtype"), args.dtypes)
    tokens = _list_flag("--tokens", flags.whole_list(1, MAX_TOKENS), args.tokens)
    threads = args.threads or torch.get_num_threads()
    rows = bench_kernels(list(shapes), threads, dtypes, tokens,
                         progress=None if args.json else lambda line: print(line, file=sys.stderr))
    if args.json:
        print(json.dumps(rows))
    else:
        width = max([8, *(len(name) for name in shapes)])  # the shape column: 8 wide, or the longest name
        print(f"{'shape':{width}} {'dtype':5} {'tokens':>6} {'impl':>6} {'ms':>9} {'GB/s':>7} {'of DRAM':>7}")
        for r in rows:
            print(f"{r['shape']:{width}} {r['dtype']:5} {r['tokens']:>6} {r['impl']:>6} {r['latency_ms']:>9.3f} "
                  f"{r['gbps']:>7.1f} {r['ratio']:>7.2f}")
    return 0


def _list_flag(flag: str, parse: Callable[[str], tuple[Any, ...]], text: str) -> tuple[Any, ...]:
    try:
        return parse(text)
    except argparse.ArgumentTypeError as e:
        raise UsageError(f"argument {flag}: {e}") from None


def _bench_e2e(args: argparse.Namespace) -> int:
    from tandem.autotune.bench.e2e import bench_e2e, plot

    if args.json:
        check_output_file(args.json, "--json")
    if args.plot:
        check_output_file(args.plot, "--plot")
        if importlib.util.find_spec("matplotlib") is None:
            raise TandemError("--plot needs matplotlib: pip install 'tandem[plot]' (or matplotlib)")
    if args.context is None:
        args.context = 4096 + 64 if not args.quick else 2048 + 64
    try:
        loaded = load_from_args(args)
    except TandemError:
        args.context = None  # the model's own limit is smaller
        loaded = load_from_args(args)
    scenarios = ["decode", "prefill", "beam"] if args.scenario == "all" else [args.scenario]
    result = bench_e2e(loaded, scenarios, args.quick, args.peer, peer_process=args.peer_process)
    print(f"plan: {json.dumps(result['plan'])}")
    if result["peer"]:
        print(f"peer: transformers, {result['peer']}")
    print(f"{'scenario':8} {'in':>5} {'out':>4} {'beams':>5} {'tok/s':>8} {'TTFT s':>7} {'ITL ms':>7} "
          f"{'peer':>8} {'ratio':>6} {'roofline':>8}")
    for r in result["rows"]:
        print(f"{r['scenario']:8} {r['input']:>5} {r['output']:>4} {r['beams']:>5} {r['tandem_tok_s']:>8.2f} "
              f"{r['ttft_s']:>7.3f} {r['itl_ms']:>7.2f} {r.get('peer_tok_s', float('nan')):>8.2f} "
              f"{r.get('ratio') or float('nan'):>6.2f} {r.get('roofline', float('nan')):>8.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1), encoding="utf-8")
    if args.plot:
        plot(result, args.plot)
    return 0


def _bench_plan(args: argparse.Namespace) -> int:
    from tandem.autotune.bench.plan import validate

    print(json.dumps(validate(args.model, args.expert_fraction, args.tokens, args.dtype), indent=1))
    return 0


def _bench_quant(args: argparse.Namespace) -> int:
    from tandem.autotune.bench.quant import bench_quant

    print(json.dumps(bench_quant(args.model, args.new_tokens, group=args.quant_group), indent=1))
    return 0


def _bench_numerics(args: argparse.Namespace) -> int:
    from tandem.autotune.bench.numerics import bench_numerics, numerics_paths

    known = list(numerics_paths())
    paths = None if args.paths is None else [p.strip() for p in args.paths.split(",") if p.strip()]
    if paths is not None and (not paths or set(paths) - set(known)):
        raise TandemError(f"--paths takes a comma list of {', '.join(known)} (the paths this CPU can take)")

    def step(message: str) -> None:
        print(f"  {message}", file=sys.stderr)

    reference = None
    if args.reference is not None:
        reference = _read_json(args.reference, "the reference tokens")
        if not isinstance(reference, list) or len(reference) != args.tokens:
            raise TandemError(f"{args.reference} does not hold {args.tokens} reference tokens")
    result = bench_numerics(resolve_model(args.model), args.tokens, paths, args.masks, reference=reference,
                            progress=step)
    print(json.dumps(result, indent=1))
    return 0


def _make_bench_model(args: argparse.Namespace) -> int:
    import torch

    from tandem.autotune.bench.models import make_bench_model

    check_output_folder(args.out, "--out")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    path = make_bench_model(args.shape, args.out, args.layers, dtype)
    size = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    print(f"wrote a random-weight {args.shape}-shaped checkpoint ({size / 2**30:.1f} GiB) to {path}")
    return 0


def _make_test_model(args: argparse.Namespace) -> int:
    from tandem.runtime.synth import tiny_config, write_test_model

    check_output_folder(args.out, "--out")
    path = write_test_model(args.out, tiny_config(args.family), seed=args.seed)
    print(f"wrote a random-weight {args.family} checkpoint to {path}")
    return 0


def _apply_cpu_mask() -> None:
    """TANDEM_CPU_FEATURES: refuse a mask that cannot be read, and cap torch's own kernels at the masked CPU (torch
    reads its variables at its first operation, which has not run yet; a value the user set wins)."""
    from tandem.kernels.isa import masked_features, torch_isa_environment

    try:
        removed = masked_features()
    except ValueError as e:
        raise TandemError(str(e)) from None
    for name, value in torch_isa_environment(removed).items():
        os.environ.setdefault(name, value)


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. A problem the user can fix: `error: ...` on stderr and status 2. Standard output closed
    by its reader (`| head`): stop quietly with status 141, as a command killed by SIGPIPE would."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if not getattr(args, "func", None):
            parser.print_help()
            return EXIT_USAGE
        # the chat app owns the terminal (and its own output) while it runs
        with nullcontext() if args.command == "chat" else guarded_stdout():
            _apply_cpu_mask()
            return args.func(args)
    except PipeClosed:
        silence_stdout()
        return EXIT_PIPE_CLOSED
    except TandemError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
