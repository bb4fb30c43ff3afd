"""`tandem serve`: an OpenAI-compatible HTTP server (Starlette on uvicorn) over `EngineService`.

Endpoints: `POST /v1/chat/completions` and `/v1/completions` (whole answers, or server-sent events with `stream`),
`GET /v1/models`, `GET /health`, `GET /metrics` (Prometheus text). Errors are OpenAI's JSON shape
(`{"error": {"message", "type", "param", "code"}}`) with the HTTP status OpenAI uses. With an API key, every
endpoint but `/health` wants `Authorization: Bearer KEY`. A client that goes away stops its request's generation.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import socket
import sys
import threading
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from tandem.app.serve.openai_api import (
    CHAT,
    COMPLETION,
    Answer,
    BodyError,
    chunk_body,
    completion_body,
    finish_reason,
    parse_body,
    shown,
    usage_of,
)
from tandem.app.serve.serving import (
    TTFT_BUCKETS,
    Busy,
    EngineService,
    PromptTokenizer,
    PromptTooLong,
    Subscription,
    TextStream,
    new_key,
)
from tandem.kernels.errors import GenerationError, TandemError
from tandem.runtime.batch import BatchRequest, DoneEvent
from tandem.runtime.paths import json_items
from tandem.runtime.sampling import SamplingParams

MAX_BODY = 16 * 2**20  # bytes of one request: a long document fits many times over
ENDPOINT_NAMES = {CHAT: "chat", COMPLETION: "completions"}


class ApiError(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        # (a message quoting the request could hold a lone surrogate, which no JSON response can carry)
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        self.status, self.message, self.kind, self.code, self.param = status, message, kind, code, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if self.status == 401 else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


@dataclass(frozen=True)
class Prepared:
    """A completion request read and tokenized, ready to queue."""

    request: BatchRequest
    stops: tuple[str, ...]
    stream: bool
    include_usage: bool


@dataclass
class Reply:
    """One request's answer as its events arrive: the text (cut at a stop sequence), when it started, how it
    ended."""

    service: EngineService
    endpoint: str
    request: BatchRequest
    answer: Answer
    text: TextStream
    submitted: float = field(default_factory=time.perf_counter)
    first: float | None = None
    reason: str = ""
    error: str = ""
    completion_tokens: int = 0
    cached_tokens: int = 0  # of the prompt's, held by a KV cache row already
    recorded: bool = False  # (record: it ended)

    def token(self, token: int) -> None:
        if self.first is None:
            self.first = time.perf_counter()
            self.service.metrics.first_token(self.first - self.submitted)
        if self.answer.add(self.text.push(token)):
            self.service.cancel(self.request.key)  # the rest would be cut anyway

    def done(self, event: DoneEvent) -> None:
        r = event.result
        self.answer.add(self.text.flush(), token=False)
        self.cached_tokens = r.cached
        if r.finish_reason == "error":
            self.error = r.error or "the generation failed"
            return
        self.reason = finish_reason(self.answer, str(r.finish_reason))
        self.completion_tokens = self.answer.tokens if self.answer.stopped else len(r.tokens)

    def usage(self) -> dict[str, int]:
        return usage_of(len(self.request.prompt), self.completion_tokens, self.cached_tokens)

    def record(self, outcome: str) -> None:
        """Counted in the metrics, once the request has ended."""
        self.recorded = True
        m = self.service.metrics
        m.finished(ENDPOINT_NAMES[self.endpoint], outcome)
        m.prompt_tokens += len(self.request.prompt)
        m.cached_tokens += self.cached_tokens
        m.completion_tokens += self.completion_tokens


def make_app(service: EngineService, defaults: SamplingParams, api_key: str | None = None) -> Starlette:
    """The ASGI app over a started `service`; requests sample with `defaults` where they give no setting."""

    def guarded(handler: Callable[[Request], Awaitable[Response]], open_: bool = False
                ) -> Callable[[Request], Awaitable[Response]]:
        async def run(request: Request) -> Response:
            try:
                if api_key and not open_:
                    _check_key(request, api_key)
                return await handler(request)
            except ApiError as e:
                return e.response()
            except Exception:  # a fault of the server's: its log has the traceback, the client an error it can read
                traceback.print_exc(file=sys.stderr)
                return _failed().response()
        return run

    async def health(request: Request) -> Response:
        if not service.alive():
            raise ApiError(503, "the engine has stopped", "server_error", "engine_stopped")
        return JSONResponse({"status": "ok", "model": service.name, "running": service.running,
                             "queued": len(service.queue)})

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [model_card(service)]})

    async def metrics(request: Request) -> Response:
        return PlainTextResponse(metrics_text(service), media_type="text/plain; version=0.0.4")

    async def chat(request: Request) -> Response:
        return await complete(request, CHAT)

    async def completions(request: Request) -> Response:
        return await complete(request, COMPLETION)

    prompts = PromptTokenizer(service.tokenizer, service.context)

    def prepare(endpoint: str, data: bytes) -> Prepared:
        """The body, read, checked and tokenized (on a worker thread: this takes a while for a huge prompt)."""
        _check_items(data, service.context)
        body = _json_of(data)
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise ApiError(400, "body.model must be a text: the name GET /v1/models gives", param="model")
        if model not in (None, service.name):
            raise ApiError(404, f"the model {model[:80]!r} is not served here; this server serves {service.name!r} "
                                "(GET /v1/models)", code="model_not_found", param="model")
        prompt_param = "messages" if endpoint == CHAT else "prompt"
        try:
            parsed = parse_body(endpoint, body, prompts, defaults)
        except PromptTooLong as e:
            raise ApiError(400, str(e), code="context_length_exceeded", param=prompt_param) from None
        except BodyError as e:
            raise ApiError(400, str(e), code=e.code, param=e.param) from None
        except (ValueError, TandemError) as e:  # (a chat template that fails on these messages)
            raise ApiError(400, str(e), param=prompt_param if endpoint == CHAT else None) from None
        req = BatchRequest(new_key("chatcmpl" if endpoint == CHAT else "cmpl"), parsed.ids, parsed.params)
        problem = service.refusal(req)
        if problem:
            code = "context_length_exceeded" if "context" in problem else None
            raise ApiError(400, problem, code=code, param=prompt_param)
        options = body.get("stream_options") or {}
        return Prepared(req, parsed.stops, bool(body.get("stream")), bool(options.get("include_usage")))

    async def complete(request: Request, endpoint: str) -> Response:
        data = await _read_body(request)
        try:
            # off the event loop: a huge prompt's decoding, templating and tokenizing must not hold up /health and
            # the other requests' streams
            ready = await asyncio.to_thread(prepare, endpoint, data)
        except ApiError:
            service.metrics.finished(ENDPOINT_NAMES[endpoint], "refused")
            raise
        req = ready.request
        try:
            sub = service.submit(req)
        except Busy as e:
            raise ApiError(503, str(e), "server_error", "overloaded") from None
        except GenerationError as e:  # stopping: the queue is closed
            raise ApiError(503, str(e), "server_error", "shutting_down") from None
        view = service.view if endpoint == CHAT else None
        reply = Reply(service, endpoint, req, Answer(ready.stops), TextStream(service.tokenizer, view))
        created = int(time.time())
        if ready.stream:
            return _Stream(reply, _events(reply, sub, created, ready.include_usage))
        return await _whole(request, reply, sub, created)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind).response()

    routes = [
        Route("/health", guarded(health, open_=True)),
        Route("/v1/models", guarded(models)),
        Route("/metrics", guarded(metrics)),
        Route(CHAT, guarded(chat), methods=["POST"]),
        Route(COMPLETION, guarded(completions), methods=["POST"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error})
    app.router.redirect_slashes = False  # (a path with a slash too many is an unknown path, said in OpenAI's shape)
    return app


def model_card(service: EngineService) -> dict[str, Any]:
    return {"id": service.name, "object": "model", "created": int(service.started), "owned_by": "tandem",
            "context_length": service.context}


def _check_key(request: Request, key: str) -> None:
    given = request.headers.get("authorization", "")
    scheme, _, token = given.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
        raise ApiError(401, "a valid API key is needed: send the header 'Authorization: Bearer KEY' with the key "
                            "the server was started with (--api-key)", code="invalid_api_key")


def _failed() -> ApiError:
    return ApiError(500, "the server failed on this request; its log says why", "server_error", "internal_error")


def _too_big() -> ApiError:
    return ApiError(413, f"the request body is over {MAX_BODY >> 20} MiB; send a shorter prompt",
                    code="request_too_large")


async def _read_body(request: Request) -> bytes:
    """The body, read as it arrives and refused once it passes MAX_BODY (a stated Content-Length above it: before
    any of it is read), so that a body without a length cannot grow the server's memory past the limit."""
    size = request.headers.get("content-length", "").strip()
    if size.isdigit() and int(size) > MAX_BODY:
        raise _too_big()
    data = bytearray()
    try:
        async for chunk in request.stream():
            data += chunk
            if len(data) > MAX_BODY:
                raise _too_big()
    except ClientDisconnect:
        raise ApiError(400, "the client closed the connection before the whole body arrived") from None
    return bytes(data)


MAX_CONTAINERS = 1 << 16  # arrays and objects in one body: a chat of as many messages still fits
FIELDS_SLACK = 1 << 16  # list items a body holds beyond a prompt of token ids as long as the context


def _check_items(data: bytes, context: int) -> None:
    """Refuse a body that would make millions of Python objects, before parsing it (`json_items`): parsing holds
    the GIL, so every other client would wait. Its list items can be a prompt of token ids as long as the context,
    and a few more; so can its escaped quotes (each at least a token of a text prompt)."""
    most = max(context, 0) + FIELDS_SLACK
    items = json_items(data, most)
    if items.containers > MAX_CONTAINERS:
        raise ApiError(400, f"the request body holds more than {MAX_CONTAINERS:,} JSON arrays and objects; a "
                            "request holds its messages and a few settings")
    if items.separators > most or items.escaped_quotes > most:
        what = "list items and fields" if items.separators > most else "escaped quotes"
        raise ApiError(400, f"the request body holds more than {most:,} JSON {what}, more than a prompt of the "
                            f"context's {context:,} tokens could", code="context_length_exceeded")


def _constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _json_of(data: bytes) -> dict[str, Any]:
    """The body's JSON object: UTF-8 text (as JSON must be between systems), numbers finite, nested within
    Python's recursion limit."""
    try:
        text = data.decode("utf-8-sig")  # (a byte order mark dropped, as editors on Windows save one)
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the request body is not UTF-8 text (byte {e.start}: {e.reason}); send JSON in UTF-8"
                       ) from None
    try:
        body = json.loads(text, parse_constant=_constant)
    except RecursionError:
        raise ApiError(400, "the request body's JSON is nested too deep to read; a request's JSON nests a few "
                            "levels") from None
    except ValueError as e:
        raise ApiError(400, f"the request body is not JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, not {shown(body)}")
    return body


async def _events(reply: Reply, sub: Subscription, created: int, include_usage: bool) -> AsyncIterator[str]:
    """The answer as server-sent events: a first chunk (the role, in a chat), one a token, the last with the finish
    reason and the usage, then (asked with stream_options.include_usage) the usage alone, then [DONE]."""
    def sse(payload: dict[str, Any]) -> str:
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    endpoint, key, name = reply.endpoint, reply.request.key, reply.service.name
    try:
        if endpoint == CHAT:
            yield sse(chunk_body(endpoint, key, created, name, "", first=True))
        while True:
            event = await sub.events.get()
            if isinstance(event, DoneEvent):
                break
            reply.token(event.token)
            # a chunk a token, its text empty while it is held back (an unfinished character, a possible stop
            # sequence's start): the client sees the answer's pace
            yield sse(chunk_body(endpoint, key, created, name, reply.answer.unsent()))
        reply.done(event)
    except Exception:  # the headers are sent: the fault ends the stream as an error event, not a cut connection
        traceback.print_exc(file=sys.stderr)
        reply.service.cancel(key)
        reply.error = _failed().message
    if reply.error:
        reply.record("error")
        yield sse(ApiError(500, reply.error, "server_error", "generation_failed").body())
    else:
        reply.record("ok")
        yield sse(chunk_body(endpoint, key, created, name, reply.answer.unsent(final=True), reply.reason,
                             reply.usage()))
        if include_usage:
            yield sse(chunk_body(endpoint, key, created, name, None, usage=reply.usage()))
    yield "data: [DONE]\n\n"


class _Stream(StreamingResponse):
    """A streamed answer whose request stops when the response ends before the answer did: the client went away
    (whether the stream had started or not), or the server is stopping."""

    def __init__(self, reply: Reply, body: AsyncIterator[str]) -> None:
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.reply = reply

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.reply.recorded:
                self.reply.service.cancel(self.reply.request.key)
                self.reply.record("cancelled")


async def _whole(request: Request, reply: Reply, sub: Subscription, created: int) -> Response:
    """The whole answer as one response; the client going away meanwhile stops the request."""
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        while True:
            get = asyncio.ensure_future(sub.events.get())
            done, _ = await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
            if get not in done:
                get.cancel()
                reply.service.cancel(reply.request.key)
                reply.record("cancelled")
                return Response(status_code=499)  # (nobody reads it)
            event = get.result()
            if isinstance(event, DoneEvent):
                break
            reply.token(event.token)
    finally:
        gone.cancel()
    reply.done(event)
    if reply.error:
        reply.record("error")
        raise ApiError(500, reply.error, "server_error", "generation_failed")
    reply.record("ok")
    return JSONResponse(completion_body(reply.endpoint, reply.request.key, created, reply.service.name,
                                        reply.answer.text, reply.reason, reply.usage()))


async def _disconnected(request: Request) -> None:
    """Returns when the client closes the connection (the body has been read: the next message is that)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def metrics_text(service: EngineService) -> str:
    """Prometheus' text format: requests, tokens, throughput, time to first token, the queue, and where experts
    ran."""
    m, stats = service.metrics, service.engine.stats
    out: list[str] = []

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        out.append(f"# HELP {name} {help_}")
        out.append(f"# TYPE {name} {kind}")
        out.extend(f"{name}{labels} {_num(v)}" for labels, v in samples)

    metric("tandem_requests_total", "counter", "Requests by endpoint and outcome (ok, error, refused, cancelled).",
           [(f'{{endpoint="{e}",outcome="{o}"}}', n) for (e, o), n in sorted(m.requests.items())])
    metric("tandem_prompt_tokens_total", "counter", "Prompt tokens of answered requests.", [("", m.prompt_tokens)])
    metric("tandem_prompt_tokens_cached_total", "counter", "Of those, tokens a KV cache row held already (prefix "
           "reuse: not prefilled again).", [("", m.cached_tokens)])
    metric("tandem_generation_tokens_total", "counter", "Tokens generated for answered requests.",
           [("", m.completion_tokens)])
    metric("tandem_generation_tokens_per_second", "gauge", "Tokens generated per second of the engine's work "
           "since the server started.", [("", stats.tok_s)])
    cumulative, samples = 0, []
    for bound, count in zip([*TTFT_BUCKETS, float("inf")], m.ttft_counts, strict=True):
        cumulative += count
        samples.append((f'_bucket{{le="{"+Inf" if bound == float("inf") else bound}"}}', cumulative))
    samples += [("_sum", m.ttft_sum), ("_count", cumulative)]
    metric("tandem_time_to_first_token_seconds", "histogram", "From a request's arrival to its first token.",
           samples)
    metric("tandem_queue_depth", "gauge", "Requests waiting for a place in the batch.", [("", len(service.queue))])
    metric("tandem_requests_running", "gauge", "Requests in the batch.", [("", service.running)])
    metric("tandem_batch_size_max", "gauge", "Requests the batch holds at most.", [("", service.max_batch)])
    experts = service.loaded.model.dispatcher.request_stats()
    tiers = experts.as_dict()["experts"]
    assert isinstance(tiers, dict)
    metric("tandem_experts_run_total", "counter", "Expert executions by tier: gpu (resident on the accelerator), "
           "cpu, fetched (copied to the accelerator to run).", [(f'{{tier="{t}"}}', n) for t, n in tiers.items()])
    if service.loaded.model.accel is not None:
        metric("tandem_expert_cache_hit_rate", "gauge", "Share of expert lookups found in the accelerator's cache.",
               [("", experts.hit_rate)])
    return "\n".join(out) + "\n"


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound now: a port in use is an error that says so, before the model loads."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise TandemError(f"cannot listen on {host}:{port} ({e.strerror or e}); choose another --port or --host"
                          ) from None
    return sock


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:.6g}"


def _http_protocol() -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol, but a request it cannot even parse (a header of control bytes, a Content-Length that
    is no number) answered in OpenAI's error shape too, as every other failure is, not in plain text."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class OpenAIErrors(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        def send_400_response(self, msg: str) -> None:
            body = json.dumps({"error": {"message": f"the HTTP request is malformed ({msg.rstrip('.')}); send "
                                                   "a well-formed HTTP/1.1 request", "type": "invalid_request_error",
                                         "param": None, "code": "invalid_http_request"}}).encode()
            self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: "
                                 + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n" + body)
            self.transport.close()

    return OpenAIErrors


class BackgroundServer:
    """uvicorn serving `app` in a thread, on a socket bound now (port 0: any free port): `tandem serve` (whose engine
    keeps the main thread), tests and benchmarks. Leaving the `with` block shuts it down."""

    def __init__(self, app: Starlette, host: str = "127.0.0.1", port: int = 0, sock: socket.socket | None = None
                 ) -> None:
        """`sock`: bound already (by `bind`), instead of `host` and `port`."""
        import uvicorn

        self.sock = sock or bind(host, port)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://{'[' + host + ']' if ':' in host else host}:{self.port}/v1"
        # connections still open at shutdown get this long (a stream whose request was ended says so and closes)
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", http=_http_protocol(),
                                                    timeout_graceful_shutdown=5))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> BackgroundServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()
