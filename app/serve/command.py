"""`tandem serve`: the model loaded as `generate` loads it (flags over the profile over the defaults), answering
OpenAI-compatible requests over HTTP, several at a time through continuous batching."""

from __future__ import annotations

import argparse
import ipaddress
import os
import signal
from collections.abc import Callable

from tandem.app.cli.batch import sampling_defaults
from tandem.app.cli.from_flags import load_configured
from tandem.kernels.errors import UsageError

STEP_TOKENS = 256  # a step's tokens at most: a new prompt's chunk does not hold the others' next token back long

Note = Callable[[str], None]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_serve(args: argparse.Namespace, say: Note) -> int:
    """The command; `args.configure` resolves its flags for serving (ragged passes, the batch it takes)."""
    from tandem.app.serve.server import BackgroundServer, bind, make_app
    from tandem.app.serve.serving import EngineService

    key = args.api_key or os.environ.get("TANDEM_API_KEY") or None
    if not is_loopback(args.host) and not key:
        raise UsageError(f"--host {args.host} can be reached from other machines: give --api-key KEY (or set "
                         "TANDEM_API_KEY) so that only clients with the key are answered")
    sock = bind(args.host, args.port)
    try:
        configured = args.configure(args)
        loaded = load_configured(configured, notify=say)
        batch = configured.options.batch
        service = EngineService(loaded, configured.options.model.name, batch, args.step_tokens or STEP_TOKENS)
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
