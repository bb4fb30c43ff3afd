"""`tandem serve`: the model loaded as `generate` loads it (flags over the profile over the defaults), answering
OpenAI-compatible requests over HTTP, several at a time through continuous batching."""

from __future__ import annotations

import argparse
import ipaddress
import os
import signal
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch

from tandem.app.batch_cmd import sampling_defaults
from tandem.autotune.configure import Configured
from tandem.kernels.errors import UsageError
from tandem.runtime.checkpoint import Checkpoint
from tandem.runtime.config import ModelConfig
from tandem.runtime.loader import LoadedModel
from tandem.runtime.model import cache_class
from tandem.runtime.options import Options

# requests in one batch by default: a local server rarely has more clients at once, and a step of 8 sequences takes
# 3.7 times one sequence's (docs/bench, batch mode: 58.3 against 15.9 ms), 2.2 times the tokens per second
MOST_BATCH = 8
STEP_TOKENS = 256  # a step's tokens at most: a new prompt's chunk does not hold the others' next token back long

Note = Callable[[str], None]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def serve_batch(cfg: ModelConfig, context: int, dtype: torch.dtype, free_ram: int) -> int:
    """Requests in flight at most: MOST_BATCH, fewer when their KV cache rows would take over half the free RAM."""
    row = cache_class(cfg).nbytes(cfg, 1, context, dtype)
    return max(1, min(MOST_BATCH, free_ram // 2 // max(1, row)))


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_serve(args: argparse.Namespace, configure: Callable[[argparse.Namespace], Configured],
              load: Callable[[Options, Checkpoint], LoadedModel], say: Note) -> int:
    from tandem.app.server import BackgroundServer, bind, make_app
    from tandem.app.serving import EngineService
    from tandem.runtime.memory import available_ram

    key = args.api_key or os.environ.get("TANDEM_API_KEY") or None
    if not is_loopback(args.host) and not key:
        raise UsageError(f"--host {args.host} can be reached from other machines: give --api-key KEY (or set "
                         "TANDEM_API_KEY) so that only clients with the key are answered")
    sock = bind(args.host, args.port)
    try:
        configured = configure(args)
        options, ckpt = configured.options, configured.checkpoint
        batch = args.batch_size or serve_batch(ckpt.config, options.context, options.torch_dtype,
                                               available_ram())
        loaded = load(replace(options, batch=batch, ragged=True), ckpt)
        service = EngineService(loaded, Path(args.model).name, batch, args.step_tokens or STEP_TOKENS)
        app = make_app(service, sampling_defaults(args), key)
        previous = signal.signal(signal.SIGTERM, _interrupt)  # (a service manager's stop: as Ctrl+C)
        with BackgroundServer(app, args.host, sock=sock) as server:
            say(f"serving {service.name} at {server.url} ({batch} requests at a time, context {service.context}"
                f"{', API key required' if key else ''}); Ctrl+C stops")
            try:
                service.run()  # on this thread, which loaded the model (EngineService.run says why)
            except KeyboardInterrupt:
                service.abandon("the server was stopped")
                say("stopping")
            finally:
                signal.signal(signal.SIGTERM, previous)
        service.stop()
    finally:
        sock.close()
    return 0
