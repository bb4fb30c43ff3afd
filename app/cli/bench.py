"""The benchmark commands (`tandem bench ...`) and the checkpoints they run on (`make-bench-model`,
`make-test-model`): their parsers and bodies. Each body loads through the flags as every command does
(`from_flags`) and prints JSON."""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.app.cli import flags
from tandem.app.cli.flags import read_json
from tandem.app.cli.from_flags import (
    LoadFor,
    add_load_args,
    add_workload_args,
    configure_from_args,
    load_configured,
    resolve_model,
)
from tandem.app.cli.output import check_output_file, check_output_folder, writing
from tandem.autotune.bench.shapes import checkpoint_shapes, real_shapes
from tandem.kernels.errors import OutputError, TandemError, UsageError
from tandem.runtime.families import supported_model_types

if TYPE_CHECKING:
    from tandem.autotune.configure import Configured
    from tandem.runtime.loader import LoadedModel


def add_commands(sub: Any) -> None:
    """`bench`'s subcommands, `make-bench-model` and `make-test-model` on the command parser's subparsers."""
    add = flags.declare
    bench = sub.add_parser("bench", help="benchmarks (print JSON)")
    bench_sub = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    decode = bench_sub.add_parser("decode", help="decode tokens/s, optionally against transformers")
    add(decode, "--model", "--prompt-tokens", "--new-tokens", "--repeats", "--peer")
    add_load_args(decode)
    decode.set_defaults(func=_bench_decode)

    offload = bench_sub.add_parser("offload", help="cache policies, static placement and expert prefetch on the "
                                                   "emulated accelerator")
    add(offload, "--model")
    add(offload, "--expert-fraction", "--prompt-tokens", "--new-tokens", "--dtype")
    offload.add_argument("--requests", type=flags.whole(1), default=3,
                         help="answers one after another in each prefetch row (default 3)")
    offload.add_argument("--no-prefetch", action="store_true", help="leave out the prefetch rows and the "
                                                                    "predictors' accuracy")
    offload.add_argument("--readahead", action="store_true",
                         help="add CPU-only rows with the experts dropped from memory before every token (a model "
                              "larger than RAM): the decode step, the layer loop, and the loop reading ahead")
    add(offload, "--json", action="store", metavar="FILE", help="write the results as JSON")
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
    kern.add_argument("--mixers", action="store_true",
                      help="the hybrids' recurrent token mixers of the shapes (one token and a prompt: --tokens, "
                           "default 1,512) instead of their experts")
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


@contextmanager
def _writing_folder(path: str, flag: str) -> Iterator[None]:
    """A checkpoint folder whose writing fails (a full disk) is removed, half written as it is (this command made
    it: check_output_folder refused an existing one), and the failure is an error naming the flag."""
    try:
        with writing(path, flag):
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

    if args.json:
        check_output_file(args.json, "--json")
    model = str(resolve_model(args.model))
    result = bench_offload(model, args.expert_fraction, args.prompt_tokens, args.new_tokens, args.dtype,
                           prefetch=not args.no_prefetch, requests=args.requests)
    if args.readahead:
        from tandem.autotune.bench.prefetch import readahead_rows

        result["readahead"] = readahead_rows(model, args.dtype, args.prompt_tokens, min(args.new_tokens, 16))
    return _print_result(result, args.json)


def _bench_kernels(args: argparse.Namespace) -> int:
    import torch

    from tandem.autotune.bench.kernels import DTYPES, MAX_TOKENS, bench_kernels
    from tandem.autotune.bench.shapes import shape_names

    # read here, not by argparse: the known dtypes and token counts live beside the benchmark, which imports torch
    shapes = _list_flag("--shapes", flags.names(shape_names(), "shape"), args.shapes)
    dtypes = _list_flag("--dtypes", flags.names(DTYPES, "dtype"), args.dtypes)
    tokens = _list_flag("--tokens", flags.whole_list(1, MAX_TOKENS), args.tokens)
    threads = args.threads or torch.get_num_threads()
    progress = None if args.json else lambda line: print(line, file=sys.stderr)
    if args.mixers:
        return _bench_mixers(args, list(shapes), threads, tokens)
    rows = bench_kernels(list(shapes), threads, dtypes, tokens, progress=progress)
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


def _bench_mixers(args: argparse.Namespace, shapes: list[str], threads: int, tokens: tuple[int, ...]) -> int:
    """`bench kernels --mixers`: autotune/bench/mixers.py's rows, printed or as JSON."""
    from tandem.autotune.bench.mixers import bench_mixers

    given = "--tokens" in sys.argv  # (the experts' default counts are not the mixers')
    rows = bench_mixers(shapes, threads, tokens if given else (1, 512),
                        progress=None if args.json else lambda line: print(line, file=sys.stderr))
    if args.json:
        print(json.dumps(rows))
        return 0
    if not rows:
        print("none of these shapes has a recurrent token mixer (the hybrids': "
              "qwen3-next-80b-a3b, qwen3.5-35b-a3b, lfm2-8b-a1b, granite-4.0-h-small)")
        return 0
    print(f"DRAM {rows[0]['bw_gbps']:.1f} GB/s; bf16 compute peak {rows[0]['peak_gflops']:.0f} GFLOP/s")
    print(f"{'shape':20} {'mixer':9} {'tokens':>6} {'impl':>7} {'ms':>9} {'ms/token':>8} {'MB':>7} {'of DRAM':>7} "
          f"{'of peak':>7}")
    for r in rows:
        print(f"{r['shape']:20} {r['mixer']:9} {r['tokens']:>6} {r['impl']:>7} {r['latency_ms']:>9.3f} "
              f"{r['per_token_ms']:>8.3f} {r['moved_mb']:>7.1f} {r['ratio']:>7.2f} {r['of_peak']:>7.2f}")
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
        reference = read_json(args.reference, "the reference tokens")
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
