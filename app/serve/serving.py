"""The engine behind `tandem serve`: one thread runs continuous batching (`BatchEngine`) over a `RequestQueue`;
the HTTP handlers submit requests and read each one's events from its own asyncio queue.

Requests join the batch as rows free up and leave it when they end, when their client stops them (`cancel`: a stop
sequence, a disconnect), or when the engine fails (each one in flight gets the error; the next requests run on a
fresh run of the engine). `ServerMetrics` keeps what `/metrics` reports. Nothing here knows of HTTP.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass, field

from tandem.app.harmony import AnswerView, Deltas, answer_view
from tandem.kernels.errors import GenerationError, TandemError
from tandem.runtime.batch import BatchEngine, BatchRequest, BatchResult, DoneEvent, RequestQueue, TokenEvent
from tandem.runtime.loader import LoadedModel
from tandem.runtime.tokenizer import StreamDecoder, Tokenizer

Event = TokenEvent | DoneEvent
# Waking the event loop's thread costs the experts' threads a moment of a core: a wake a token was 3.8 % of the
# built-in model's decode on 2 cores (docs/bench). At most 50 wakes a second (vLLM's stream_interval does the same);
# a chat repaints 20 times a second
STREAM_INTERVAL_S = 0.02
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)  # seconds: interactive to a long prompt's prefill
# A prompt of more characters than this many a token of the context is tokenized in part first: text averages 1 to
# 5 characters a token, so a part this long that is already the context's tokens refuses the prompt without the
# rest being tokenized (a huge prompt's whole tokens would cost a core for long, and memory for each token)
PART_CHARS_A_TOKEN = 8


class TextStream:
    """A request's tokens -> text deltas; of a chat answer in harmony (gpt-oss), the final channel's alone; of
    Gemma 4's, the answer without its thoughts (`view`: app/harmony.py answer_view; None: the text as it is)."""

    def __init__(self, tokenizer: Tokenizer, view: AnswerView | None) -> None:
        self.decoder = StreamDecoder(tokenizer, keep_special=view is not None and view.keep_special)
        self.final = Deltas(view.shown) if view is not None else None

    def push(self, token: int) -> str:
        return self._view(self.decoder.push(token))

    def flush(self) -> str:
        tail = self._view(self.decoder.flush())
        return tail if self.final is None else tail + self.final.close()

    def _view(self, piece: str) -> str:
        return piece if self.final is None else self.final.push(piece)


@dataclass
class ServerMetrics:
    """Counters since the server started, read by `/metrics` (Prometheus text)."""

    requests: dict[tuple[str, str], int] = field(default_factory=dict)  # (endpoint, outcome) -> count
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt tokens, held by a KV cache row already (prefix reuse)
    completion_tokens: int = 0
    ttft_counts: list[int] = field(default_factory=lambda: [0] * (len(TTFT_BUCKETS) + 1))  # by bucket, +Inf last
    ttft_sum: float = 0.0

    def finished(self, endpoint: str, outcome: str) -> None:
        self.requests[(endpoint, outcome)] = self.requests.get((endpoint, outcome), 0) + 1

    def first_token(self, seconds: float) -> None:
        self.ttft_sum += seconds
        bucket = next((i for i, b in enumerate(TTFT_BUCKETS) if seconds <= b), len(TTFT_BUCKETS))
        self.ttft_counts[bucket] += 1


class Subscription:
    """One request's events, delivered from the engine's thread into the handler's event loop."""

    def __init__(self, key: str, loop: asyncio.AbstractEventLoop) -> None:
        self.key, self.loop = key, loop
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self._held: list[Event] = []
        self._woken: float | None = None  # when the engine's thread last woke the loop for it

    def deliver(self, event: Event) -> None:
        """From the engine's thread: the first token and the end at once; the tokens between at most every
        STREAM_INTERVAL_S, with those held since (each still its own chunk)."""
        self._held.append(event)
        now = time.perf_counter()
        if isinstance(event, DoneEvent) or self._woken is None or now - self._woken >= STREAM_INTERVAL_S:
            held, self._held, self._woken = self._held, [], now
            self.loop.call_soon_threadsafe(self._receive, held)

    def _receive(self, events: list[Event]) -> None:
        for event in events:
            self.events.put_nowait(event)


class EngineService:
    """The loaded model answering requests `max_batch` at a time, the rest waiting (at most `max_queue`)."""

    def __init__(self, loaded: LoadedModel, name: str, max_batch: int, step_tokens: int, max_queue: int = 1024
                 ) -> None:
        self.loaded, self.name = loaded, name
        self.tokenizer = loaded.tokenizer
        self.view = answer_view(loaded.tokenizer.chat_template)  # how a chat answer is shown
        self.engine = BatchEngine(loaded.model, loaded.engine.eos_ids, max_batch, step_tokens,
                                  reuse=loaded.options.prefix_reuse, store=loaded.engine.store)
        self.max_batch, self.max_queue = max_batch, max_queue
        self.queue = RequestQueue()
        self.metrics = ServerMetrics()
        self._subs: dict[str, Subscription] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._running = False
        self.started = time.time()

    @property
    def context(self) -> int:
        return self.engine.model.context

    @property
    def running(self) -> int:
        """Requests taken into the batch, not yet done."""
        with self._lock:
            return len(self._subs) - len(self.queue)

    def start(self) -> None:
        """The engine on a thread of its own (`run` keeps it on the caller's)."""
        self._running = True  # (alive from now: the thread sets it again)
        self._thread = threading.Thread(target=self.run, name="tandem-engine", daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        return self._running

    def stop(self) -> None:
        """No more requests; the ones queued and running finish first."""
        self.queue.close()
        if self._thread is not None:
            self._thread.join()
        self.loaded.model.dispatcher.close()

    def abandon(self, why: str) -> None:
        """The engine was stopped short (Ctrl+C): every request queued or running ends with `why`."""
        self.queue.close()
        self._fail_all(why)

    def refusal(self, request: BatchRequest) -> str:
        """Why the engine would refuse `request` ("" when it would run it): said before it queues, as a 400."""
        return self.engine.refusal(request)

    def submit(self, request: BatchRequest) -> Subscription:
        """Queue `request` (its key: new_key()); its events arrive on the returned subscription, in the calling
        event loop."""
        sub = Subscription(request.key, asyncio.get_running_loop())
        with self._lock:
            if len(self.queue) >= self.max_queue:
                raise Busy(f"{len(self.queue)} requests are waiting already; try again shortly")
            self._subs[request.key] = sub
        self.queue.put(request)
        return sub

    def cancel(self, key: str) -> None:
        """Stop request `key` (its client went away, or found a stop sequence): it ends with reason "stop"."""
        with self._lock:
            if key not in self._subs:
                return
        self.engine.finish(key)

    def run(self) -> None:
        """The engine, until the queue is closed and empty: one run of the batch engine, and another after a
        failure, which ends every request in flight with the error. On the thread that loaded the model: OpenMP
        keeps a pool of workers per thread that runs parallel work, and two pools on few cores throttle each other's
        barriers (a token of the built-in model took 18 ms on a new thread against 10 ms); the loader now gives its
        workers back (kernels/openmp.py), and the one thread stays the simplest rule."""
        self._running = True
        try:
            while not self.queue.ended:
                try:
                    for event in self.engine.run(self.queue):
                        self._deliver(event)
                    return
                except Exception as e:  # the server goes on: the requests in flight get the error
                    if not isinstance(e, TandemError):
                        traceback.print_exc(file=sys.stderr)
                    self._fail_all(f"the engine failed: {e}")
        finally:
            self._running = False

    def _deliver(self, event: Event) -> None:
        key = event.key if isinstance(event, TokenEvent) else event.result.key
        with self._lock:
            sub = self._subs.get(key)
            if isinstance(event, DoneEvent):
                self._subs.pop(key, None)
        if sub is not None:
            sub.deliver(event)

    def _fail_all(self, message: str) -> None:
        """Every request taken or waiting ends with `message` (those waiting too: the failed run took none of them
        into a row, but their clients would otherwise wait on a run that may fail again the same way)."""
        while self.queue.take(wait=False) is not None:
            pass
        with self._lock:
            subs, self._subs = list(self._subs.values()), {}
        for sub in subs:
            sub.deliver(DoneEvent(BatchResult(sub.key, [], 0, "error", message)))


class PromptTokenizer:
    """A tokenizer's chat template and encoding for a worker thread, bounded by the context.

    Encoding goes through the backend's `encode_batch`, which releases the GIL while the Rust tokenizer works
    (`encode` holds it throughout, so a thread encoding a huge prompt would stall the event loop's thread as well).
    A text over PART_CHARS_A_TOKEN characters a token of the context is tokenized in part first, and refused
    (PromptTooLong) when that part alone fills the context."""

    def __init__(self, tokenizer: Tokenizer, context: int) -> None:
        self.tokenizer, self.context = tokenizer, context

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        return self.tokenizer.render_chat(messages)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        part = self.context * PART_CHARS_A_TOKEN
        if len(text) > part:
            n = self._count(text[:part], add_special_tokens)
            if n >= self.context:
                raise PromptTooLong(f"the prompt's first {part} of {len(text)} characters are already {n} tokens but "
                                    f"the context holds {self.context}; shorten the prompt or raise --context")
        return self.tokenizer.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def _count(self, text: str, add_special_tokens: bool) -> int:
        """Tokens of `text`, without making the list of their ids."""
        return len(self.tokenizer.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0])


class PromptTooLong(GenerationError):
    """A prompt over the context, found from a part of it."""


class Busy(GenerationError):
    """The queue is full: the request is refused, not queued."""


def new_key(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"
