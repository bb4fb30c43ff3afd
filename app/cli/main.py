"""`tandem` command line. Errors a user can fix print `error: ...` and exit with status 2."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.app.cli import bench, flags
from tandem.app.cli.flags import read_json
from tandem.app.cli.from_flags import (
    LoadFor,
    add_load_args,
    add_workload_args,
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
    guarded_stdout,
    silence_stdout,
    writing,
)
from tandem.app.cli.prompt_input import prompt_text
from tandem.kernels.errors import TandemError, UsageError

if TYPE_CHECKING:
    from tandem.autotune.configure import Configured
    from tandem.autotune.plan import ModelShape
    from tandem.runtime.config import ModelConfig

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

    bench.add_commands(sub)
    return parser


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
        cfg = parse_config(read_json(args.model, "model config"), str(model))[1]
        shape = ModelShape.from_config(cfg, item)
    else:  # a model folder or GGUF file: its experts' bytes as stored
        ckpt = open_checkpoint(model)
        cfg = ckpt.config
        shape = ModelShape.from_checkpoint(ckpt, item)
    if args.batch:
        return _plan_batch(args, cfg, shape)
    hw = read_json(args.hardware, "hardware file")
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
        if p.accelerator:
            print(f"prefetch: {result.prefetch.get('why', 'none')}")
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
        hw = read_json(args.hardware, "hardware file")
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
        with writing(args.record_trace, "--record-trace"):
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
        data = read_json(args.source, "recorded hardware")
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
        with writing(args.record, "--record"):
            Path(args.record).write_text(json.dumps(record(sources), indent=1), encoding="utf-8")
    # allow_nan=False: NaN and Infinity are not JSON; readings are whole numbers or null (unknown) by now
    print(json.dumps(hw.to_dict(), indent=1, allow_nan=False) if args.json else "\n".join(describe(hw)))
    return 0


def _apply_cpu_mask() -> None:
    """TANDEM_CPU_FEATURES: refuse a mask that cannot be read, and cap torch's own kernels at the masked CPU (torch
    reads its variables at its first operation, which has not run yet; a value the user set wins); and OpenMP's
    waiting workers' spin bounded, before torch loads the runtime."""
    from tandem.kernels.isa import masked_features, torch_isa_environment
    from tandem.kernels.openmp import wait_environment

    try:
        removed = masked_features()
    except ValueError as e:
        raise TandemError(str(e)) from None
    for name, value in torch_isa_environment(removed).items():
        os.environ.setdefault(name, value)
    os.environ.update(wait_environment(os.environ))  # (before torch loads OpenMP: kernels/openmp.py)


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
