"""From a command's flags to a configured load: the one road every command that loads a model takes.

The flags become a `Request` (None where a flag was not given: the profile or the default decides), together with
what the command itself decides about its work (`LoadFor`: the sequences it runs at once, ragged passes, the context
it needs when --context is not given), and `autotune.configure` resolves them. Nothing here writes into the
argparse namespace or patches `Options`: a command that decides something from the resolved settings resolves again
(`Configured.again`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.app.cli import flags

if TYPE_CHECKING:
    from tandem.autotune.configure import Configured
    from tandem.runtime.checkpoint import Checkpoint
    from tandem.runtime.loader import LoadedModel
    from tandem.runtime.options import Request
    from tandem.runtime.tokenizer import Tokenizer

Notify = Callable[[str], None]
Progress = Callable[[str, float], None]


@dataclass(frozen=True)
class LoadFor:
    """What a command runs, as the load must be sized for it. `batch` None: as many sequences as a server should
    take at once (runtime/options.py serving_batch); `context`: the command's need when --context is not given
    (None: the model's default)."""

    batch: int | None = 1
    ragged: bool = False
    context: int | None = None
    prefix_reuse: bool = True  # False: off whatever the flags say (a benchmark that must prefill every prompt)


def note(text: str) -> None:
    print(f"note: {text}", file=sys.stderr)


def progress(message: str, fraction: float) -> None:
    """A long step's progress on stderr: one updating line on a terminal, only the end in a log."""
    if sys.stderr.isatty():
        print(f"\r  [{fraction:4.0%}] {message:<40}", end="" if fraction < 1 else "\n", file=sys.stderr, flush=True)
    elif fraction >= 1:
        print(f"  {message}: done", file=sys.stderr, flush=True)


def resolve_model(path: str | None) -> str:
    """The folder to load: the one given, or the built-in model (built on first use, with progress)."""
    if path is not None:  # an empty name never gets here (flags.path)
        return path
    from tandem.runtime.builtin import builtin_dir, ensure_builtin

    if not (builtin_dir() / "tandem-builtin.json").exists():
        print("building the built-in model (SmolLM2-135M-Instruct as an 8-expert MoE), once…", file=sys.stderr)

    return str(ensure_builtin(progress))


def request_from_args(args: argparse.Namespace, model: str | Path | None = None,
                      workload: LoadFor = LoadFor()) -> Request:
    """The load settings the flags give for `workload` (`model`: resolved already; else the flag's)."""
    from tandem.runtime.choices import PredictorKind
    from tandem.runtime.dispatch import Strategy
    from tandem.runtime.expert_cache import CachePolicy
    from tandem.runtime.options import Request

    return Request(
        model=args.model if model is None else model, dtype=args.dtype,
        context=args.context if args.context is not None else workload.context, batch=workload.batch,
        ragged=workload.ragged, force=args.force, accelerator=args.accelerator, vram_gb=args.vram_gb, gpu=args.gpu,
        strategy=None if args.strategy is None else Strategy(args.strategy), cache_ways=args.cache_ways,
        cache_policy=None if args.cache_policy is None else CachePolicy(args.cache_policy),
        max_inflight=args.max_inflight, cost=args.cost,
        prefetch=None if args.prefetch is None else PredictorKind(args.prefetch), prefetch_depth=args.prefetch_depth,
        readahead=getattr(args, "readahead", False),
        threads=args.threads, crossover=args.kernel_crossover,
        quant=args.quant, quant_group=args.quant_group, kernel_isa=args.kernel_isa, resident=args.resident,
        prefix_reuse=getattr(args, "prefix_reuse", True) and workload.prefix_reuse,
        prefix_store_gb=getattr(args, "prefix_store_gb", None), prefix_disk_gb=getattr(args, "prefix_disk_gb", None),
    )


def configure_from_args(args: argparse.Namespace, workload: LoadFor = LoadFor(), *, model: str | None = None,
                        checkpoint: Checkpoint | None = None, notify: Notify = note) -> Configured:
    """Resolve the flags for their model (`model`, else the flag's, else the built-in one) and `workload`: flags
    over this machine's profile over the defaults. `checkpoint`: that model, open already."""
    from tandem.autotune.configure import configure

    request = request_from_args(args, model or resolve_model(args.model), workload)
    return configure(request, placement=args.placement, use_profile=not args.no_profile, notify=notify,
                     checkpoint=checkpoint)


def load_configured(configured: Configured, tokenizer: Tokenizer | None = None, notify: Notify = note,
                    shown: Progress | None = progress) -> LoadedModel:
    """Load what `configured` resolved (`tokenizer`: the model's, loaded already)."""
    from tandem.runtime.loader import load

    return load(configured.options, configured.checkpoint, shown, notify, tokenizer)


def load_from_args(args: argparse.Namespace, workload: LoadFor = LoadFor(), *, model: str | None = None,
                   notify: Notify = note, shown: Progress | None = progress) -> LoadedModel:
    """Load the model the flags describe for `workload` (a profile fills what they leave open)."""
    return load_configured(configure_from_args(args, workload, model=model, notify=notify), notify=notify,
                           shown=shown)


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
                  "--max-inflight", "--prefetch", "--prefetch-depth", "--readahead", "--placement",
                  "--cost")
    c = p.add_argument_group("CPU experts")
    flags.declare(c, "--threads", "--quant", "--quant-group", "--kernel-crossover", "--resident", "--kernel-isa")
