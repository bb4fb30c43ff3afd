"""`tandem` command line. Errors a user can fix print `error: ...` and exit with status 2."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.app.cli import flags
from tandem.app.cli.from_flags import (
    LoadFor,
    configure_from_args,
    load_configured,
    load_from_args,
    note,
    resolve_model,
)
from tandem.app.cli.output import (
    EXIT_PIPE_CLOSED,
    PipeClosed,
    check_output_file,
    check_output_folder,
    guarded_stdout,
    silence_stdout,
)
from tandem.app.cli.prompt_input import prompt_text
from tandem.autotune.bench.shapes import checkpoint_shapes, real_shapes
from tandem.kernels.errors import OutputError, TandemError, UsageError
from tandem.runtime.families import supported_model_types
from tandem.runtime.paths import read_bounded

if TYPE_CHECKING:
    from tandem.autotune.configure import Configured
    from tandem.autotune.plan import ModelShape
    from tandem.runtime.config import ModelConfig
    from tandem.runtime.loader import LoadedModel

EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    parser = flags.ArgumentParser(prog="tandem", description="Run Mixture-of-Experts language models locally.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    add = flags.declare  # each flag's type, default and help live once, in flags.FLAGS

    gen = sub.add_parser("generate", help="generate text from a prompt, streamed to stdout")
    add(gen, "--model")
    gen.add_argument("text", nargs="?", help="the prompt text (or --prompt); - reads it from standard input")
    add(gen, "--prompt", "--chat", "--max-new-tokens", "--temperature", "--top-k", "--top-p", "--repetition-penalty",
        "--seed")
    add_load_args(gen)
    add(gen, "--json", help="print one JSON object instead of streaming text")
    add(gen, "--beams", "--record-trace")
    gen.set_defaults(func=_generate, configure=lambda a: configure_from_args(a, LoadFor(batch=a.beams)))

    bat = sub.add_parser("batch", help="answer a file of OpenAI batch requests (JSONL) many at a time; run it again "
                                       "to resume")
    bat.add_argument("input", type=flags.path, metavar="IN.jsonl", help="one request a line (OpenAI batch format)")
    add(bat, "--out", type=flags.path, metavar="OUT.jsonl", help="results, one a line, appended as they finish")
    add(bat, "--model", "--max-new-tokens", "--temperature", "--top-k", "--top-p", "--repetition-penalty", "--seed",
        "--batch-size", "--step-tokens")
    add_load_args(bat)
    bat.set_defaults(func=_batch, configure=_configure_batch)

    probe = sub.add_parser("probe", help="show what hardware was found (CPU ISA and cores, RAM, GPUs, PCIe)")
    add(probe, "--json", help="print the findings as JSON")
    add(probe, "--record", "--from")
    probe.set_defaults(func=_probe)

    check = sub.add_parser("selftest", help="check the accelerator tier end to end on this machine (a tiny random "
                                            "model; the emulated device, or a CUDA GPU with --gpu)")
    add(check, "--gpu", nargs="?", const=0,
        help="on CUDA GPU N (default 0, numbered as tandem probe does); without it: the emulated device")
    add(check, "--json", help="print every check, with its figures, as JSON")
    check.set_defaults(func=_selftest)

    chat = sub.add_parser("chat", help="the chat app (terminal UI)")
    chat.add_argument("model", nargs="?", type=flags.path, default=None,
                      help="model folder (default: the built-in model)")
    add_load_args(chat)
    add(chat, "--models-dir")
    r = chat.add_argument_group("a model on a server instead")
    add(r, "--remote", "--api-key", "--remote-model")
    chat.set_defaults(func=_chat)

    srv = sub.add_parser("serve", help="answer OpenAI-compatible requests over HTTP (/v1/chat/completions, "
                                       "/v1/completions, /v1/models, /health, /metrics)")
    add(srv, "--model", "--host", "--port", "--api-key")
    add(srv, "--batch-size", help="requests answered at once (default: 8, fewer when their KV cache would take over "
                                  "half the free RAM); more wait in a queue")
    add(srv, "--step-tokens", help="tokens a step takes at most, decode tokens and prompt chunks together "
                                   "(default: 256)")
    add(srv, "--max-new-tokens", help="new tokens of a request that gives no max_tokens (default: 256)")
    add(srv, "--temperature", "--top-k", "--top-p", "--repetition-penalty", "--seed")
    add_load_args(srv)
    srv.set_defaults(func=_serve, configure=_configure_serve)

    models = sub.add_parser("models", help="list the models found: --models-dir folders, the Hugging Face cache, "
                                           "LM Studio and Ollama")
    add(models, "--models-dir", "--json")
    models.set_defaults(func=_models)

    tune = sub.add_parser("autotune", help="measure this machine on a model and save the best plan as a profile")
    add(tune, "--model", help="model folder to tune for (default: the built-in model)")
    add(tune, "--quick", help="fewer measurements (about 15 s)")
    add(tune, "--dtype", "--json")
    tune.set_defaults(func=_autotune)

    plan = sub.add_parser("plan", help="plan for hardware described in a JSON file, without running anything")
    add(plan, "--hardware", required=False, help="the machine, described (see the README); with --batch and "
                                                 "without it, this machine, probed for a second")
    add(plan, "--model", required=True, help="model folder or its config.json")
    add(plan, "--trace", "--json")
    add(plan, "--dtype", choices=["bf16", "fp32"], default="bf16")
    plan.add_argument("--batch", action="store_true", help="the batch policy for a workload (batch size, step "
                                                           "tokens, where attention runs) instead of the decode plan")
    add_workload_args(plan)
    plan.set_defaults(func=_plan)

    bench = sub.add_parser("bench", help="benchmarks (print JSON)")
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    decode = bench_sub.add_parser("decode", help="decode tokens/s, optionally against transformers")
    add(decode, "--model", "--prompt-tokens", "--new-tokens", "--repeats", "--peer")
    add_load_args(decode)
    decode.set_defaults(func=_bench_decode)

    offload = bench_sub.add_parser("offload", help="cache policies and static placement on the emulated accelerator")
    add(offload, "--model", required=True)
    add(offload, "--expert-fraction", "--prompt-tokens", "--new-tokens", "--dtype")
    offload.set_defaults(func=_bench_offload)

    e2e = bench_sub.add_parser("e2e", help="Fiddler's scenarios end to end, optionally beside transformers")
    add(e2e, "--model", "--scenario")
    add(e2e, "--quick", help="a few points per scenario (minutes, not hours)")
    add(e2e, "--peer", "--peer-process", "--llama-bench")
    add(e2e, "--json", action="store", metavar="FILE", help="write the results as JSON")
    add(e2e, "--plot")
    add_load_args(e2e)
    e2e.set_defaults(func=_bench_e2e, configure=_configure_e2e)

    bb = bench_sub.add_parser("batch", help="batch throughput against the policy's prediction, single-request "
                                            "decode, and optionally transformers or llama.cpp")
    add(bb, "--model")
    add_workload_args(bb)
    bb.add_argument("--batch-sizes", type=flags.whole_list(1, 4096), default=None, metavar="LIST",
                    help="batch sizes to run beside the policy's (a comma list; default: a quarter and half of it)")
    add(bb, "--peer")
    bb.add_argument("--llama-batched-bench", type=flags.path, default=None, metavar="PATH",
                    help="llama.cpp's llama-batched-bench binary (with --peer llama.cpp and a GGUF --model)")
    add(bb, "--json", action="store", metavar="FILE", help="write the results as JSON")
    add_load_args(bb)
    bb.set_defaults(func=_bench_batch, configure=_configure_bench_batch)

    bs = bench_sub.add_parser("serve", help="the local server under concurrent streamed requests: requests/s, "
                                            "tokens/s, TTFT and ITL percentiles, beside generate's decode")
    add(bs, "--model")
    add_workload_args(bs)
    bs.add_argument("--concurrency", type=flags.whole(1, 1024), default=1, metavar="C",
                    help="requests in flight at once (default: 1)")
    add(bs, "--batch-size", "--step-tokens")
    add(bs, "--peer", choices=["llama.cpp"], help="llama.cpp's llama-server against its llama-bench, the same way "
                                                  "(concurrency 1, a GGUF --model)")
    bs.add_argument("--llama-server", type=flags.path, default=None, metavar="PATH",
                    help="llama.cpp's llama-server binary, for --peer llama.cpp")
    add(bs, "--llama-bench")
    add(bs, "--json", action="store", metavar="FILE", help="write the results as JSON")
    add_load_args(bs)
    bs.set_defaults(func=_bench_serve, configure=_configure_bench_serve)

    bc = bench_sub.add_parser("chat", help="what the chat app costs the engine: its decode tokens/s (the status "
                                           "bar's) over generate's, the app driven headless, alternating; with "
                                           "--turns, a conversation through the server API turn after turn (TTFT "
                                           "and decode per turn, prefix reuse), beside llama-server with --peer")
    add(bc, "--model", "--new-tokens", "--repeats")
    bc.add_argument("--turns", type=flags.whole(1, 1000), default=None, metavar="N",
                    help="a conversation of N turns through the server API, each prompt the whole history")
    bc.add_argument("--words", type=flags.whole(1, 100_000), default=150, metavar="W",
                    help="new words each turn adds (with --turns; default: 150)")
    bc.add_argument("--app", action="store_true",
                    help="with --turns: the conversation typed into the chat app, headless, rather than sent "
                         "to the server API")
    bc.add_argument("--reopen", type=flags.whole(64, 1 << 20), default=None, metavar="TOKENS",
                    help="a conversation of TOKENS tokens kept on disk, then the first answer after a restart "
                         "against the same with its cache dropped (time to first token)")
    add(bc, "--peer", choices=["llama.cpp"], help="with --turns: the same conversation against llama.cpp's "
                                                  "llama-server on the same GGUF --model")
    bc.add_argument("--llama-server", type=flags.path, default=None, metavar="PATH",
                    help="llama.cpp's llama-server binary, for --peer llama.cpp")
    add(bc, "--json", action="store", metavar="FILE", help="write the results as JSON")
    add_load_args(bc)
    bc.set_defaults(func=_bench_chat, new_tokens=128, configure=_configure_bench_chat)

    val = bench_sub.add_parser("plan", help="the planner and simulator against real runs (regret, prediction error)")
    add(val, "--model", required=True)
    add(val, "--expert-fraction", "--dtype")
    add(val, "--tokens", type=flags.whole(1), default=32, help="tokens to decode")
    val.set_defaults(func=_bench_plan)

    kern = bench_sub.add_parser("kernels", help="CPU expert kernels against the DRAM roofline, beside torch")
    shapes = real_shapes()
    add(kern, "--shapes", default=",".join(shapes))
    add(kern, "--dtypes")
    add(kern, "--tokens", type=str, default="1,2,4,8,16,64,256", help="token counts per call (a comma list)")
    add(kern, "--threads")
    add(kern, "--json", help="print the rows as JSON")
    kern.set_defaults(func=_bench_kernels)

    quant = bench_sub.add_parser("quant", help="quantized CPU experts (int8, int4, MXFP4, Q8_0, Q4_K): logits drift, "
                                               "KL divergence and greedy agreement against the unquantized model")
    add(quant, "--model", required=True)
    add(quant, "--new-tokens")
    add(quant, "--quant-group", default=64)
    quant.add_argument("--gguf", action="append", default=[], type=flags.path, metavar="FILE",
                       help="a GGUF file of the same model (another quantizer's, say llama.cpp's) to compare too; "
                            "repeatable")
    quant.set_defaults(func=_bench_quant)

    num = bench_sub.add_parser("numerics", help="bf16 paths against fp32: top-1 agreement, teacher-forced")
    add(num, "--model")
    add(num, "--tokens", type=flags.whole(1), default=1024, help="tokens of the bundled texts to feed")
    add(num, "--paths", "--masks", "--reference")
    num.set_defaults(func=_bench_numerics)

    mbm = sub.add_parser("make-bench-model", help="write a random-weight checkpoint with a real model's shapes")
    writable = checkpoint_shapes()
    not_yet = [name for name in shapes if name not in writable]
    add(mbm, "--shape", help=", ".join(writable) + (f" ({', '.join(not_yet)}: not yet)" if not_yet else ""))
    add(mbm, "--layers", "--experts", "--attention-heads")
    add(mbm, "--dtype", choices=["bf16", "fp32", "mxfp4"], default="bf16",
        help="mxfp4: gpt-oss's experts as published, bf16 elsewhere")
    add(mbm, "--out")
    mbm.set_defaults(func=_make_bench_model)

    synth = sub.add_parser("make-test-model", help="write a small random-weight checkpoint (for trying things out)")
    add(synth, "--family", help=f"model_type: {', '.join(supported_model_types())}")
    add(synth, "--out")
    add(synth, "--seed", default=0)
    synth.set_defaults(func=_make_test_model)
    return parser


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """A batch workload: R requests of N prompt and M new tokens each."""
    p.add_argument("--requests", type=flags.whole(1, 1 << 16), default=64, help="requests in the workload")
    p.add_argument("--in", dest="prompt_len", type=flags.whole(1), default=128, metavar="N",
                   help="prompt tokens of each request")
    p.add_argument("--out", dest="new_len", type=flags.whole(1), default=64, metavar="M",
                   help="new tokens of each request")


def add_load_args(p: argparse.ArgumentParser) -> None:
    """The settings of a model load: the runtime's own, where experts run, and the CPU experts. `configure` (set
    by the command where its workload is not one sequence): the flags resolved for what the command runs, which
    the command and its --show-config both take."""
    p.set_defaults(configure=configure_from_args)
    flags.declare(p, "--dtype", "--context", "--force", "--show-config", "--no-profile", "--no-prefix-reuse",
                  "--prefix-store-gb", "--prefix-disk-gb")
    g = p.add_argument_group("accelerator and expert placement")
    flags.declare(g, "--accelerator", "--vram-gb", "--gpu", "--strategy", "--cache-ways", "--cache-policy",
                  "--max-inflight", "--placement", "--cost")
    c = p.add_argument_group("CPU experts")
    flags.declare(c, "--threads", "--quant", "--quant-group", "--kernel-crossover", "--resident", "--kernel-isa")


def _show_config(args: argparse.Namespace) -> int:
    """--show-config: the settings the command would load with, and where each came from; nothing is loaded."""
    options = args.configure(args).options
    print(json.dumps(options.to_dict(), indent=1) if getattr(args, "json", False) is True else
          "\n".join(options.describe()))
    return 0


def _chat(args: argparse.Namespace) -> int:
    from tandem.app.chat.backend import RuntimeBackend
    from tandem.app.chat.tui import TandemApp

    if args.remote is not None:
        return _chat_remote(args)
    if args.remote_model is not None:
        raise UsageError("--remote-model names a model on a server: give the server with --remote URL")
    if args.model is None:
        resolve_model(None)  # a first-time build of the built-in model shows its progress here, before the UI
    notices: list[str] = []

    def load_backend(path: str | None) -> RuntimeBackend:
        return RuntimeBackend(load_from_args(args, model=path, notify=notices.append, shown=app.loading_progress))

    app = TandemApp(load_backend, args.model, models_folders=_models_folders(args))
    try:
        app.run()
        # its conversation's KV cache kept on disk first, where that is on; not while an answer stopped by the exit
        # may still be writing into the cache and reading the weights
        if app.lifecycle.backend is not None and not app.lifecycle.generating:
            app.lifecycle.backend.close()
    finally:
        for text in notices:
            print(f"note: {text}", file=sys.stderr)
    return 0


def _chat_remote(args: argparse.Namespace) -> int:
    """The chat app on a server's model: checked before the UI opens (a wrong URL or key is an error here)."""
    from tandem.app.chat.remote import RemoteBackend, RemoteServer
    from tandem.app.chat.tui import TandemApp

    if args.model is not None:
        raise UsageError("give either a model folder or --remote URL, not both")
    server = RemoteServer(args.remote, args.api_key or os.environ.get("TANDEM_API_KEY"))
    RemoteBackend(server, args.remote_model)  # the server answers, and serves that model

    def load_backend(name: str | None) -> RemoteBackend:
        return RemoteBackend(server, name)

    app = TandemApp(load_backend, args.remote_model, remote=server)
    try:
        app.run()
    finally:
        server.close()
    return 0


def _serve(args: argparse.Namespace) -> int:
    from tandem.app.serve.command import run_serve

    return run_serve(args, note)


def _configure_serve(args: argparse.Namespace) -> Configured:
    """Ragged passes, --batch-size sequences at once (none given: as many as serving fits)."""
    return configure_from_args(args, LoadFor(batch=args.batch_size, ragged=True))


def _models(args: argparse.Namespace) -> int:
    import psutil

    from tandem.autotune.probe import probe
    from tandem.runtime.discover import discover

    entries = discover(_models_folders(args))
    gpu = probe().gpu(0)  # (the GPU `--gpu 0` runs on)
    vram = gpu.memory_total if gpu else None
    ram = psutil.virtual_memory().total
    rows = [{"name": e.name, "family": e.family, "runs": e.runs, "quant": e.quant, "params": e.params,
             "experts": e.experts, "size_bytes": e.size_bytes, "fits_ram": e.fits(ram), "on_gpu": e.fits_vram(vram),
             "source": e.source, "path": e.path, "problem": e.problem} for e in entries]
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print("no models found; pass --models-dir DIR, or download one (Hugging Face, LM Studio, Ollama)")
        return 0
    head = ("name", "family", "quant", "size", "fits RAM", "on GPU", "from")
    table = [head] + [(r["name"], r["family"] if r["runs"] else f"{r['family']} (not run)", r["quant"],
                       f"{r['size_bytes'] / 2**30:.1f} GiB", "yes" if r["fits_ram"] else "no", r["on_gpu"],
                       r["source"]) for r in rows]
    widths = [max(len(str(row[k])) for row in table) for k in range(len(head))]
    for row in table:
        print("  ".join(str(v).ljust(w) for v, w in zip(row, widths, strict=True)).rstrip())
    for r in rows:  # a damaged file is listed with why, below the table (its message is long)
        if r["problem"]:
            print(f"{r['name']}: {r['problem']}")
    return 0


def _models_folders(args: argparse.Namespace) -> list[Path]:
    """The folders of model folders to look in: --models-dir, else ~/models."""
    return [Path(p).expanduser() for p in args.models_dir] or [Path.home() / "models"]


def _autotune(args: argparse.Namespace) -> int:
    from tandem.autotune.microbench import Step
    from tandem.autotune.run import autotune

    def report(step: Step) -> None:
        print(f"[{step.done}/{step.total}] {step.name}", file=sys.stderr)

    tuned = autotune(resolve_model(args.model), args.dtype, args.quick, progress=None if args.json else report)
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
    from tandem.autotune.measurements import from_hardware_file
    from tandem.autotune.plan import ModelShape, make_plan
    from tandem.runtime.checkpoint import open_checkpoint
    from tandem.runtime.families import parse_config
    from tandem.runtime.gguf import is_gguf
    from tandem.runtime.trace import load_sequence

    if args.hardware is None and not args.batch:
        raise UsageError("the following arguments are required: --hardware (only --batch can plan for this machine "
                         "without one; see tandem plan --help)")
    model = Path(args.model)
    item = 4 if args.dtype == "fp32" else 2
    if model.exists() and not model.is_dir() and not is_gguf(model):  # a config.json (or a FIFO refused as one)
        cfg = parse_config(_read_json(args.model, "model config"), str(model))[1]
        shape = ModelShape.from_config(cfg, item)
    else:  # a model folder or GGUF file: its experts' bytes as stored
        ckpt = open_checkpoint(model)
        cfg = ckpt.config
        shape = ModelShape.from_checkpoint(ckpt, item)
    if args.batch:
        return _plan_batch(args, cfg, shape)
    hw = _read_json(args.hardware, "hardware file")
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


def _plan_batch(args: argparse.Namespace, cfg: ModelConfig, shape: ModelShape) -> int:
    """plan --batch: the batch policy for the workload, on the machine the hardware file describes (its
    `ram_free_gb` bounds the KV cache; none: no bound) or, without one, on this one."""
    from tandem.autotune.batch_plan import KV_SHARE, BatchMachine, BatchShape, Workload, plan_batch
    from tandem.autotune.measurements import free_ram_from_hardware_file, from_hardware_file
    from tandem.autotune.microbench import quick_measurements
    from tandem.runtime.memory import available_ram

    context = args.prompt_len + args.new_len
    if args.hardware is not None:
        hw = _read_json(args.hardware, "hardware file")
        meas = from_hardware_file(hw, shape.expert_bytes, 6 * cfg.hidden_size * cfg.moe_intermediate_size,
                                  source=args.hardware)
        free = free_ram_from_hardware_file(hw, args.hardware)
    else:
        import torch

        note("no --hardware: this machine, probed for a second")
        threads = flags.cpu_threads_available()
        meas = quick_measurements(shape, torch.bfloat16 if args.dtype == "bf16" else torch.float32, threads)
        free = available_ram()
    bs = BatchShape.from_config(cfg, shape, 4 if args.dtype == "fp32" else 2)
    budget = 1 << 62 if free is None else int(KV_SHARE * free)
    policy = plan_batch(bs, BatchMachine.from_measurements(meas), Workload(args.requests, args.prompt_len,
                                                                           args.new_len), budget, context)
    if args.json:
        print(json.dumps(policy.to_dict() | {"workload": {"requests": args.requests, "in": args.prompt_len,
                                                          "out": args.new_len}}, indent=1, allow_nan=False))
    else:
        p = policy.predicted
        print(f"batch {policy.batch} sequences, steps of up to {policy.step_tokens} tokens, attention on the "
              f"{'accelerator' if policy.attention == 'accelerator' else 'CPU'}: {p.tok_s:.1f} tok/s predicted "
              f"({args.requests} requests of {args.prompt_len} + {args.new_len} tokens in {p.seconds:.1f} s, "
              f"{p.prefill_s:.1f} s of it prompts; batch limited by {policy.limit})")
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
    loaded = load_configured(args.configure(args))
    tok = loaded.tokenizer
    prompt = tok.encode_chat([{"role": "user", "content": text}]) if args.chat else tok.encode(text)
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        repetition_penalty=args.repetition_penalty, seed=args.seed, beams=args.beams,
    )
    stats = GenerationStats()
    tokens: list[int] = []
    stream = StreamDecoder(tok)
    experts = loaded.model.dispatcher
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
            experts.recorder.save(args.record_trace, model=str(loaded.options.model))
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


def _batch(args: argparse.Namespace) -> int:
    from tandem.app.cli.batch import run_batch

    return run_batch(args, note)


def _configure_batch(args: argparse.Namespace) -> Configured:
    from tandem.app.cli.batch import configure_batch

    return configure_batch(args, note).configured


def _selftest(args: argparse.Namespace) -> int:
    """Every check of runtime/selftest.py, one line each; status 1 when one fails."""
    import tempfile

    from tandem.runtime.accelerator import cuda_devices
    from tandem.runtime.selftest import selftest

    kind = "emulated" if args.gpu is None else "cuda"
    if kind == "cuda" and args.gpu >= len(cuda_devices()):
        raise TandemError(f"--gpu {args.gpu}: this machine has {len(cuda_devices())} usable CUDA GPUs")
    where = "the emulated device" if kind == "emulated" else f"CUDA GPU {args.gpu}"
    if not args.json:
        print(f"selftest on {where}:", flush=True)
    listed = None
    if kind == "cuda":  # the probe's numbering, which `--gpu` must match
        from tandem.autotune.probe import probe

        listed = [(g.torch_index, g.pci_bus_id) for g in probe().gpus]
    with tempfile.TemporaryDirectory(prefix="tandem-selftest-") as folder:
        checks = selftest(kind, Path(folder), args.gpu or 0, listed)
    ok = all(c.ok for c in checks)
    if args.json:
        print(json.dumps({"device": where, "ok": ok, "checks": [c.as_dict() for c in checks]}, indent=1))
    for c in checks if not args.json else ():
        print(f"  {'ok  ' if c.ok else 'FAIL'}  {c.name}: {c.detail}")
    return 0 if ok else 1


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


@contextmanager
def _writing_folder(path: str, flag: str) -> Iterator[None]:
    """A checkpoint folder whose writing fails (a full disk) is removed, half written as it is (this command made
    it: check_output_folder refused an existing one), and the failure is an error naming the flag."""
    try:
        with _writing(path, flag):
            yield
    except OutputError:
        shutil.rmtree(path, ignore_errors=True)
        raise


def _bench_decode(args: argparse.Namespace) -> int:
    from tandem.autotune.bench.decode import bench_decode

    loaded = load_configured(args.configure(args))
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
        if rows:
            print(f"DRAM {rows[0]['bw_gbps']:.1f} GB/s; compute peak by dtype (GFLOP/s): " + ", ".join(
                sorted({f"{r['dtype']} {r['peak_gflops']:.0f}" for r in rows})))
        print(f"{'shape':{width}} {'dtype':5} {'tokens':>6} {'impl':>6} {'ms':>9} {'GB/s':>7} {'of DRAM':>7} "
              f"{'GFLOP/s':>8} {'of peak':>7}")
        for r in rows:
            print(f"{r['shape']:{width}} {r['dtype']:5} {r['tokens']:>6} {r['impl']:>6} {r['latency_ms']:>9.3f} "
                  f"{r['gbps']:>7.1f} {r['ratio']:>7.2f} {r['gflops']:>8.1f} {r['of_peak']:>7.2f}")
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
    scenarios = _e2e_scenarios(args)
    loaded = load_configured(args.configure(args))
    result = bench_e2e(loaded, scenarios, args.quick, args.peer, peer_process=args.peer_process,
                       llama_bench=None if args.llama_bench is None else Path(args.llama_bench))
    print(f"plan: {json.dumps(result['plan'])}")
    if result["peer"]:
        print(f"peer: {'transformers, ' if args.peer == 'transformers' else ''}{result['peer']}")
    print(f"{'scenario':8} {'in':>5} {'out':>4} {'beams':>5} {'tok/s':>8} {'TTFT s':>7} {'ITL ms':>7} "
          f"{'peer':>8} {'ratio':>6} {'roofline':>8} {'compute':>7}")
    for r in result["rows"]:  # roofline: decode's share of DRAM bandwidth; compute: prefill's of the compute peak
        print(f"{r['scenario']:8} {r['input']:>5} {r['output']:>4} {r['beams']:>5} {r['tandem_tok_s']:>8.2f} "
              f"{r['ttft_s']:>7.3f} {r['itl_ms']:>7.2f} {r.get('peer_tok_s', float('nan')):>8.2f} "
              f"{r.get('ratio') or float('nan'):>6.2f} {r.get('roofline', float('nan')):>8.2f} "
              f"{r.get('compute', float('nan')):>7.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1), encoding="utf-8")
    if args.plot:
        plot(result, args.plot)
    return 0


def _e2e_scenarios(args: argparse.Namespace) -> list[str]:
    return ["decode", "prefill", "beam"] if args.scenario == "all" else [args.scenario]


def _configure_e2e(args: argparse.Namespace) -> Configured:
    """Loaded for the most beams: every row count shares its KV cache (on an accelerator, counted in the budget
    before the expert slots take the rest); a context for the grid's longest rows, or the model's own when its limit
    is smaller."""
    from tandem.autotune.bench.e2e import grid_of
    from tandem.runtime.checkpoint import open_checkpoint

    model = resolve_model(args.model)
    ckpt = open_checkpoint(model)
    batch = max(beams for *_, beams in grid_of(args.quick)["beam"]) if "beam" in _e2e_scenarios(args) else 1
    need = 4096 + 64 if not args.quick else 2048 + 64
    context = need if need <= ckpt.config.max_position_embeddings else None
    return configure_from_args(args, LoadFor(batch=batch, context=context), model=model, checkpoint=ckpt)


def _configure_bench_batch(args: argparse.Namespace) -> Configured:
    most = max([args.requests, *(args.batch_sizes or [])])
    return configure_from_args(args, LoadFor(batch=most, ragged=True, context=args.prompt_len + args.new_len))


def _bench_batch(args: argparse.Namespace) -> int:
    from tandem.autotune.batch_plan import Workload
    from tandem.autotune.bench.batch import bench_batch

    if args.json:
        check_output_file(args.json, "--json")
    sizes = list(args.batch_sizes) if args.batch_sizes else None
    w = Workload(args.requests, args.prompt_len, args.new_len)
    loaded = load_configured(args.configure(args))
    binary = Path(args.llama_batched_bench) if args.llama_batched_bench else None
    result = bench_batch(loaded, w, sizes, args.peer, binary)
    return _print_result(result, args.json)


def _configure_bench_serve(args: argparse.Namespace) -> Configured:
    """Without prefix reuse: generate's run and the served request before it share their prompt, and the store
    would hand the server's prompts back to generate; each is to prefill its prompt as a new one would."""
    from tandem.runtime.options import SERVE_MOST_BATCH

    batch = args.batch_size or min(args.concurrency, SERVE_MOST_BATCH)  # (as serve: at most what it takes at once)
    return configure_from_args(args, LoadFor(batch=batch, ragged=True,
                                              context=args.prompt_len + args.new_len, prefix_reuse=False))


def _bench_serve(args: argparse.Namespace) -> int:
    from tandem.app.serve.bench import bench_serve

    if args.json:
        check_output_file(args.json, "--json")
    if args.peer and (args.concurrency != 1 or not args.llama_server or not args.llama_bench
                      or not str(args.model or "").endswith(".gguf")):
        raise UsageError("--peer llama.cpp compares one request at a time: give --concurrency 1, a GGUF file as "
                         "--model (llama.cpp serves the same file), --llama-server PATH and --llama-bench PATH")
    configured = args.configure(args)
    loaded = load_configured(configured)
    model = configured.options.model
    result = bench_serve(loaded, model.name, args.requests, args.concurrency, args.prompt_len,
                         args.new_len, configured.options.batch, args.step_tokens or 256)
    if args.peer:
        from tandem.app.serve.bench import llama_server_peer, prompt_ids

        prompts = [prompt_ids(loaded.model.cfg.vocab_size, args.prompt_len, 10 + i) for i in range(args.requests)]
        loaded.model.close()  # (its memory, before llama.cpp loads the same model)
        result["peer"] = llama_server_peer(Path(args.llama_server), Path(args.llama_bench), model,
                                           configured.options.cpu.threads or torch_threads(), prompts, args.new_len)
    return _print_result(result, args.json)


def _bench_chat(args: argparse.Namespace) -> int:
    from tandem.app.chat.bench import bench_chat

    if args.json:
        check_output_file(args.json, "--json")
    if args.turns:
        return _bench_turns(args)
    if args.app:
        raise UsageError("--app types a conversation into the chat app: give --turns N too")
    if args.reopen:
        return _bench_reopen(args)
    if args.peer:
        raise UsageError("--peer compares a conversation through the server API: give --turns N too")
    return _bench_loaded(args, lambda loaded: bench_chat(loaded, args.new_tokens, args.repeats))


def _bench_reopen(args: argparse.Namespace) -> int:
    from tandem.autotune.bench.reopen import bench_reopen

    if args.peer:
        raise UsageError("--peer compares a conversation through the server API: give --turns N, not --reopen")
    def run(loaded: LoadedModel) -> dict[str, Any]:
        try:
            return bench_reopen(loaded, args.reopen, args.repeats or 2)
        except ValueError as e:
            raise UsageError(str(e)) from None

    return _bench_loaded(args, run)


def _bench_app_turns(args: argparse.Namespace) -> int:
    from tandem.app.chat.bench import turns_in_the_app
    from tandem.app.serve.bench_turns import turn_texts

    if args.peer:
        raise UsageError("--peer serves the conversation to llama-server: leave out --app")
    texts = [t.strip() for t in turn_texts(args.turns, args.words)]
    return _bench_loaded(args, lambda loaded: turns_in_the_app(loaded, texts, args.new_tokens))


def _configure_bench_chat(args: argparse.Namespace) -> Configured:
    """A conversation of --turns through the server API (ragged, as `serve` runs), or typed into the app, takes the
    whole conversation with room (a random model's answers are long as text); --reopen its conversation and the
    next question."""
    if args.turns:
        context = args.turns * (4 * args.words + 8 * args.new_tokens + 16) + 64
        return configure_from_args(args, LoadFor(ragged=not args.app, context=context))
    return configure_from_args(args, LoadFor(context=args.reopen + 256 if args.reopen else None))


def _bench_turns(args: argparse.Namespace) -> int:
    from tandem.app.serve.bench_turns import against_new_alone, llama_server_turns, tandem_turns, turn_texts

    if args.app:
        return _bench_app_turns(args)
    if args.peer and (not args.llama_server or not str(args.model or "").endswith(".gguf")):
        raise UsageError("--peer llama.cpp serves the same file: give a GGUF file as --model and --llama-server PATH")
    texts = turn_texts(args.turns, args.words)
    configured = args.configure(args)
    loaded = load_configured(configured)
    name = Path(args.model).name if args.model else "built-in"
    turns = tandem_turns(loaded, name, texts, args.new_tokens)
    loaded.model.close()  # (its memory, before llama.cpp loads the same model)
    result: dict[str, object] = {"model": name, "turns": args.turns, "words": args.words,
                                 "new_tokens": args.new_tokens, "context": loaded.model.context,
                                 "prefix_reuse": configured.options.prefix_reuse, "tandem": turns,
                                 "ttft_vs_new_alone": against_new_alone(turns)}
    if args.peer:
        peer = llama_server_turns(Path(args.llama_server), configured.options.model,
                                  configured.options.cpu.threads or torch_threads(), loaded.model.context, texts,
                                  args.new_tokens)
        result["peer"] = {"name": "llama.cpp", "turns": peer}
        result["ttft_vs_peer"] = [round(a["ttft_s"] / b["ttft_s"], 3) if a["ttft_s"] and b["ttft_s"] else None
                                  for a, b in zip(turns, peer, strict=True)]
    return _print_result(result, args.json)


def _bench_loaded(args: argparse.Namespace, bench: Callable[[LoadedModel], dict[str, Any]]) -> int:
    """A benchmark on the model the flags load: run, the model closed after, the result printed (and written)."""
    loaded = load_configured(args.configure(args))
    try:
        result = bench(loaded)
    finally:
        loaded.model.close()
    return _print_result(result, args.json)


def _print_result(result: dict[str, Any], json_file: str | None) -> int:
    """A benchmark's result as JSON on standard output, and in `json_file` when one is given."""
    text = json.dumps(result, indent=1)
    print(text)
    if json_file:
        Path(json_file).write_text(text, encoding="utf-8")
    return 0


def torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _bench_plan(args: argparse.Namespace) -> int:
    from tandem.autotune.bench.plan import validate

    print(json.dumps(validate(args.model, args.expert_fraction, args.tokens, args.dtype), indent=1))
    return 0


def _bench_quant(args: argparse.Namespace) -> int:
    from tandem.autotune.bench.quant import bench_quant

    print(json.dumps(bench_quant(args.model, args.new_tokens, group=args.quant_group, files=args.gguf), indent=1))
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
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    with _writing_folder(args.out, "--out"):
        path = make_bench_model(args.shape, args.out, args.layers, dtype, experts=args.experts,
                                mxfp4=args.dtype == "mxfp4", heads=args.attention_heads)
    size = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    scaled = (f", {args.experts} experts a layer" if args.experts else "") + \
        (f", {args.attention_heads} attention heads" if args.attention_heads else "")
    print(f"wrote a random-weight {args.shape}-shaped checkpoint ({size / 2**30:.1f} GiB{scaled}) to {path}")
    return 0


def _make_test_model(args: argparse.Namespace) -> int:
    from tandem.runtime.synth import tiny_config, write_test_model

    check_output_folder(args.out, "--out")
    with _writing_folder(args.out, "--out"):
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
        with nullcontext() if args.command == "chat" and not args.show_config else guarded_stdout():
            _apply_cpu_mask()
            return _show_config(args) if getattr(args, "show_config", False) else args.func(args)
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
