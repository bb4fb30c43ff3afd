"""`tandem serve` against hostile requests, in-process (httpx over ASGI, the tiny model): a prompt held in
tokenization does not hold up `/health`, a huge prompt is refused by its token count, a body is refused as it passes
the limit, every failure is OpenAI's JSON error (never a 500 in plain text), every field of the wrong kind or an
option Tandem does not offer is refused by name, and a seeded fuzzer over request bodies finds no 500."""

from __future__ import annotations

import asyncio
import json
import random
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tandem.app.serve.server import MAX_BODY, make_app
from tandem.app.serve.serving import PART_CHARS_A_TOKEN, EngineService
from tandem.runtime.loader import load_model
from tests.test_serve import CONTEXT, DEFAULTS, HELLO

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
WAIT_S = 30.0  # a deadline for what must happen, never a measure of speed


@pytest.fixture
def service(mixtral_dir: Path) -> Iterator[EngineService]:
    loaded = load_model(mixtral_dir, dtype="fp32", threads=1, batch=2, context=CONTEXT)
    running = EngineService(loaded, "tiny", 2, 32)
    running.start()
    try:
        yield running
    finally:
        running.stop()


def client(service: EngineService) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=make_app(service, DEFAULTS))
    return httpx.AsyncClient(transport=transport, base_url="http://tandem", timeout=WAIT_S)


def openai_error(response: httpx.Response, status: int | None = None) -> dict[str, Any]:
    """The error of a response that must be OpenAI's shape: JSON {"error": {message, type, param, code}}."""
    assert response.headers["content-type"].startswith("application/json"), response.text[:200]
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str)
    assert error["message"] and isinstance(error["type"], str) and "Traceback" not in error["message"]
    if status is not None:
        assert response.status_code == status, response.text[:300]
    return error


async def test_health_answers_while_a_prompt_is_held_in_tokenization(service: EngineService) -> None:
    """A stand-in chat template that waits on an event: /health answers while the request is held inside it (on
    the event loop's thread, nothing would answer until the wait ran out)."""
    entered, release = threading.Event(), threading.Event()
    held_out: list[bool] = []
    render = service.tokenizer.render_chat

    def held(messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        entered.set()
        held_out.append(not release.wait(WAIT_S))  # True: nobody released it (the loop was held too)
        return render(messages, add_generation_prompt)

    service.tokenizer.render_chat = held  # type: ignore[method-assign]
    async with client(service) as c:
        chat = asyncio.ensure_future(c.post(CHAT, json={"messages": HELLO, "max_tokens": 2}))
        for _ in range(int(WAIT_S / 0.01)):
            if entered.is_set():
                break
            await asyncio.sleep(0.01)
        health = await c.get("/health")
        release.set()
        answer = await chat
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert held_out == [False], "the request in tokenization held the event loop"
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] >= 1


async def test_a_prompt_over_the_context_is_refused_by_its_token_count(service: EngineService) -> None:
    """Refused with OpenAI's context_length_exceeded, whether it is tokenized whole (a little over the context) or
    in part (far over it: the part alone fills the context, the rest is never tokenized)."""
    seen: list[int] = []
    backend = service.tokenizer.backend

    class Counting:  # the tokenizer's backend, counting the characters it is asked to encode
        def __getattr__(self, name: str) -> Any:
            return getattr(backend, name)

        def encode_batch(self, texts: list[str], **kw: Any) -> Any:
            seen.extend(len(t) for t in texts)
            return backend.encode_batch(texts, **kw)

    service.tokenizer.backend = Counting()  # type: ignore[assignment]
    huge = "word " * 400_000  # 2 MB
    async with client(service) as c:
        for endpoint, body, param in ((COMPLETIONS, {"prompt": "word " * 200}, "prompt"),
                                      (COMPLETIONS, {"prompt": huge}, "prompt"),
                                      (CHAT, {"messages": [{"role": "user", "content": huge}]}, "messages")):
            error = openai_error(await c.post(endpoint, json=body), 400)
            assert error["code"] == "context_length_exceeded" and error["param"] == param
            assert f"holds {CONTEXT}" in error["message"]
        assert max(seen) <= CONTEXT * PART_CHARS_A_TOKEN  # the huge prompts: a part of them only
        assert (await c.post(COMPLETIONS, json={"prompt": "Once upon", "max_tokens": 2})).status_code == 200


async def test_a_body_is_refused_as_it_passes_the_limit(service: EngineService) -> None:
    """A chunked body without a length is read no further than the limit; a stated length above it is refused
    before any of it is read."""
    chunk = 2**20
    sent: list[int] = []

    async def endless() -> AsyncIterator[bytes]:  # (twice the limit: a bounded stand-in for "never ends")
        yield b'{"prompt": "'
        for _ in range(2 * MAX_BODY // chunk):
            sent.append(chunk)
            yield b"a" * chunk

    async with client(service) as c:
        response = await c.post(COMPLETIONS, content=endless())
        assert "content-length" not in response.request.headers
        assert sum(sent) <= MAX_BODY + chunk, f"{sum(sent) >> 20} MiB were read of a body over the limit"
        assert openai_error(response, 413)["code"] == "request_too_large"

        sent.clear()

        async def stated() -> AsyncIterator[bytes]:
            sent.append(1)
            yield b"{}"

        response = await c.post(COMPLETIONS, content=stated(), headers={"content-length": str(MAX_BODY + 1)})
        assert openai_error(response, 413)["code"] == "request_too_large" and sent == []
        body = {"prompt": "a" * 20, "max_tokens": 1}  # under the limit, chunked: read whole, answered
        response = await c.post(COMPLETIONS, content=_chunks(json.dumps(body).encode(), 7))
        assert response.status_code == 200, response.text


async def test_a_body_that_would_make_millions_of_objects_is_refused_unparsed(
        service: EngineService, monkeypatch: pytest.MonkeyPatch) -> None:
    """Parsing JSON holds the GIL throughout (16 MiB of `[],` held every client for seconds): arrays and objects past
    MAX_CONTAINERS, or more list items than a prompt of token ids as long as the context, are refused before the
    body is parsed. Brackets and commas inside strings are text, not counted."""
    import tandem.app.serve.server as server

    parsed: list[int] = []
    real = server._json_of
    monkeypatch.setattr(server, "_json_of", lambda data: parsed.append(len(data)) or real(data))
    async with client(service) as c:
        lists = b'{"prompt": [' + b"[]," * (2 * server.MAX_CONTAINERS) + b'[]], "max_tokens": 1}'
        error = openai_error(await c.post(COMPLETIONS, content=lists), 400)
        assert "JSON arrays and objects" in error["message"] and parsed == []
        ids = {"prompt": [5] * (CONTEXT + server.FIELDS_SLACK + 1), "max_tokens": 1}
        error = openai_error(await c.post(COMPLETIONS, json=ids), 400)
        assert error["code"] == "context_length_exceeded" and "list items" in error["message"] and parsed == []
        text = "[{,\\" * (3 * server.MAX_CONTAINERS) + '"' * 10  # (escapes too: \\ and \" in the string)
        error = openai_error(await c.post(CHAT, json={"messages": [{"role": "user", "content": text}]}), 400)
        assert error["code"] == "context_length_exceeded" and f"holds {CONTEXT}" in error["message"]
        assert len(parsed) == 1  # parsed, and refused by its tokens
        quotes = json.dumps({"prompt": '"' * (CONTEXT + server.FIELDS_SLACK + 1)}).encode()
        error = openai_error(await c.post(COMPLETIONS, content=quotes), 400)
        assert error["code"] == "context_length_exceeded" and "escaped quotes" in error["message"]
        assert len(parsed) == 1
        response = await c.post(COMPLETIONS, json={"prompt": [5] * 8, "max_tokens": 1})
        assert response.status_code == 200, response.text


def test_json_items_counts_outside_strings_only() -> None:
    from tandem.runtime.paths import json_items

    def counted(data: bytes, most: int = 100) -> tuple[int, int, int]:
        items = json_items(data, most)
        return items.containers, items.separators, items.escaped_quotes

    assert counted(b'{"a": [1, 2, {"b": "x,[{"}], "c": "q\\"[,{"}') == (3, 3, 1)
    assert counted(b'["\\\\", [], {}]') == (3, 2, 0)  # an escaped backslash ends before the quote
    assert counted(b'{"p": "\\\\\\"[,"}') == (1, 0, 1)  # \\ then \": the string goes on
    assert counted(b'"unterminated [,') == (0, 0, 0) and counted(b"") == (0, 0, 0)
    assert counted(b"[" + b'"",' * 1000 + b'""]', 10)[1] == 11  # stops once past the bound
    assert counted(b'"' + b'\\"' * 1000 + b'"', 10)[2] == 11


async def _chunks(data: bytes, size: int) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


async def test_every_failure_is_an_openai_json_error(service: EngineService, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    async with client(service) as c:
        # invalid UTF-8, bodies that are not JSON objects, JSON nested too deep, numbers JSON has not
        for raw, words in ((b'{"prompt": "caf\xe9"}', "not UTF-8"), (b"[1, 2]", "JSON object"),
                           (b'"hello"', "JSON object"), (b"null", "JSON object"), (b"", "not JSON"),
                           (b"[" * 50_000 + b"]" * 50_000, "nested too deep"),
                           (b"[" * 100_000 + b"]" * 100_000, "JSON arrays and objects"),  # (counted, not parsed)
                           (b'{"prompt": "x", "temperature": NaN}', "NaN"),
                           (b'{"prompt": "x", "temperature": 1e999}', "temperature"),
                           (b'{"prompt": "x", "temperature": 1' + b"0" * 400 + b"}", "temperature")):
            error = openai_error(await c.post(COMPLETIONS, content=raw), 400)
            assert words in error["message"], error
        # a byte order mark before the JSON (as some editors save a file sent with curl --data @file): read
        response = await c.post(COMPLETIONS, content=b"\xef\xbb\xbf" + json.dumps({"prompt": "Hi", "max_tokens": 2})
                                .encode())
        assert response.status_code == 200, response.text
        # lone UTF-16 surrogates: refused, naming the field
        for endpoint, body, param in (
                (CHAT, {"messages": [{"role": "user", "content": "a\ud800b"}]}, "messages[0].content"),
                (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
                 "messages[0].content"),
                (CHAT, {"messages": [{"role": "us\udc00er", "content": "x"}]}, "messages[0].role"),
                (COMPLETIONS, {"prompt": "\ud800"}, "prompt"),
                (COMPLETIONS, {"prompt": "x", "stop": ["\ud800"]}, "stop")):
            raw = json.dumps(body).encode()  # (ASCII, with the surrogates as \\u escapes)
            error = openai_error(await c.post(endpoint, content=raw), 400)
            assert error["param"] == param and "surrogate" in error["message"]
        # a fault of the server's own: a 500 in the same shape, the traceback in the server's log only
        def broken(*a: Any) -> None:
            raise RuntimeError("secret internals")

        monkeypatch.setattr(service, "submit", broken)
        response = await c.post(CHAT, json={"messages": HELLO})
        error = openai_error(response, 500)
        assert error["type"] == "server_error" and "secret" not in response.text
        assert "RuntimeError: secret internals" in capsys.readouterr().err


BAD_FIELDS: list[tuple[str, dict[str, Any], str]] = [
    (CHAT, {"logprobs": True}, "logprobs"), (CHAT, {"top_logprobs": 3}, "top_logprobs"),
    (COMPLETIONS, {"logprobs": 2}, "logprobs"), (CHAT, {"n": 0}, "n"), (CHAT, {"n": 2}, "n"),
    (CHAT, {"n": True}, "n"), (COMPLETIONS, {"best_of": 3}, "best_of"), (COMPLETIONS, {"echo": True}, "echo"),
    (COMPLETIONS, {"suffix": "end"}, "suffix"),
    (CHAT, {"stop": 5}, "stop"), (CHAT, {"stop": {}}, "stop"), (CHAT, {"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    (CHAT, {"stop": [""]}, "stop"), (CHAT, {"stop": "x" * 1025}, "stop"), (CHAT, {"stop": [1]}, "stop"),
    (CHAT, {"stop": True}, "stop"),
    (CHAT, {"max_tokens": 0}, "max_tokens"), (CHAT, {"max_tokens": -3}, "max_tokens"),
    (CHAT, {"max_tokens": 1.5}, "max_tokens"), (CHAT, {"max_tokens": "5"}, "max_tokens"),
    (CHAT, {"max_tokens": True}, "max_tokens"), (CHAT, {"max_completion_tokens": 0}, "max_completion_tokens"),
    (CHAT, {"max_completion_tokens": [4]}, "max_completion_tokens"),
    (CHAT, {"temperature": "hot"}, "temperature"), (CHAT, {"temperature": -1}, "temperature"),
    (CHAT, {"temperature": 2.5}, "temperature"), (CHAT, {"temperature": False}, "temperature"),
    (CHAT, {"top_p": 0}, "top_p"), (CHAT, {"top_p": 1.5}, "top_p"), (CHAT, {"top_p": "all"}, "top_p"),
    (CHAT, {"top_k": -1}, "top_k"), (CHAT, {"top_k": 2.5}, "top_k"),
    (CHAT, {"repetition_penalty": 0}, "repetition_penalty"),
    (CHAT, {"stream": "yes"}, "stream"), (CHAT, {"stream": 1}, "stream"),
    (CHAT, {"stream_options": "x"}, "stream_options"),
    (CHAT, {"stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    (CHAT, {"messages": {}}, "messages"), (CHAT, {"messages": []}, "messages"), (CHAT, {"messages": "hi"}, "messages"),
    (CHAT, {"messages": [1]}, "messages[0]"), (CHAT, {"messages": [{"role": 1, "content": "x"}]}, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content"),
    (CHAT, {"seed": 1.5}, "seed"), (CHAT, {"seed": "1"}, "seed"), (CHAT, {"seed": -1}, "seed"),
    (CHAT, {"seed": 2**64}, "seed"),
    (CHAT, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    (CHAT, {"tool_choice": "required"}, "tool_choice"), (CHAT, {"functions": [{"name": "f"}]}, "functions"),
    (CHAT, {"response_format": {"type": "json_object"}}, "response_format"),
    (CHAT, {"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format"),
    (CHAT, {"response_format": "json"}, "response_format"), (CHAT, {"logit_bias": {"5": 10}}, "logit_bias"),
    (CHAT, {"presence_penalty": 0.5}, "presence_penalty"), (CHAT, {"frequency_penalty": "x"}, "frequency_penalty"),
    (CHAT, {"user": 5}, "user"), (CHAT, {"model": 5}, "model"), (CHAT, {"model": ["tiny"]}, "model"),
    (COMPLETIONS, {"prompt": {}}, "prompt"), (COMPLETIONS, {"prompt": ["a", "b"]}, "prompt"),
    (COMPLETIONS, {"prompt": []}, "prompt"),
    # a field neither read nor one of OpenAI's that change nothing: refused by name (a misspelling, a knob of another
    # server), as OpenAI refuses what it does not know
    (CHAT, {"max_token": 5}, "max_token"), (CHAT, {"mirostat": 2}, "mirostat"), (CHAT, {"prompt": "x"}, "prompt"),
    (COMPLETIONS, {"messages": HELLO}, "messages"), (CHAT, {"a\nb": 1}, "a\\nb"),
    # roles a chat template places: no tool results (tools are not offered), nothing made up
    (CHAT, {"messages": [{"role": "tool", "content": "42"}]}, "messages[0].role"),
    (CHAT, {"messages": [{"role": "banana", "content": "x"}]}, "messages[0].role"),
    (CHAT, {"messages": [{"content": "x"}]}, "messages[0].role"),
    # a message's own fields: text role and content, a text name; nothing else (tool calls are not offered)
    (CHAT, {"messages": [{"role": "user", "content": "x", "name": ["a"]}]}, "messages[0].name"),
    (CHAT, {"messages": [{"role": "assistant", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
    (CHAT, {"messages": [{"role": "user", "content": "x", "deep": [[[[[1]]]]]}]}, "messages[0].deep"),
]
GOOD_FIELDS: list[dict[str, Any]] = [
    {"logprobs": False}, {"n": 1}, {"tools": []}, {"tool_choice": "none"}, {"response_format": {"type": "text"}},
    {"stop": "x"}, {"stop": ["a", "b"]}, {"stop": None}, {"presence_penalty": 0}, {"frequency_penalty": 0.0},
    {"seed": 7, "temperature": 0.7, "top_p": 0.9, "top_k": 5}, {"max_completion_tokens": 2, "max_tokens": 50},
    {"stream": False, "user": "u"}, {"model": "tiny"},
    {"metadata": {"k": "v"}, "store": False, "service_tier": "auto", "parallel_tool_calls": True},
    {"messages": [{"role": "developer", "content": "Be brief."}, *HELLO]},
    {"messages": [{"role": "user", "content": "Hi", "name": "ann"}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "!"}]}]},
]


async def test_fields_of_the_wrong_kind_and_options_not_offered_are_refused_by_name(
        service: EngineService) -> None:
    async with client(service) as c:
        for endpoint, fields, param in BAD_FIELDS:
            base = {"messages": HELLO} if endpoint == CHAT else {"prompt": "Once upon"}
            response = await c.post(endpoint, json=base | {"max_tokens": 2} | fields)
            error = openai_error(response, 400)
            assert error["param"] == param, (fields, error)
        for fields in GOOD_FIELDS:  # the values that ask for nothing more are answered
            response = await c.post(CHAT, json={"messages": HELLO, "max_tokens": 2} | fields)
            assert response.status_code == 200, (fields, response.text)


def _random_json(rng: random.Random, depth: int = 0) -> Any:
    """Any JSON value: scalars of every kind (edge numbers, lone surrogates) and, shallowly, containers."""
    kind = rng.randrange(12 if depth < 3 else 9)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice([0, 1, 2, -1, 4, 5, 2**31, 2**63, -(2**64), 10**30])
    if kind == 3:
        return rng.choice([0.0, 0.5, 1.0, 1.5, -0.5, 2.0, 1e308, -1e-300])
    if kind in (4, 5):
        return rng.choice(["", "x", "user", "text", "tiny", "\ud800", "a\udfffb", "é", "Once upon", "json_object"])
    if kind == 6:
        return rng.choice(["system", "user", "assistant", "auto", "none", "required"])
    if kind in (7, 8):
        return rng.randrange(-3, 100)
    if kind in (9, 10):
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(6))]
    keys = ["type", "text", "role", "content", "include_usage", "name", "x"]
    return {rng.choice(keys): _random_json(rng, depth + 1) for _ in range(rng.randrange(4))}


def _random_message(rng: random.Random) -> Any:
    if rng.random() < 0.7:
        content: Any = rng.choice(["Hi", "Hello there", "", [{"type": "text", "text": "Hi"}]])
        return {"role": rng.choice(["user", "system", "assistant"]), "content": content}
    return _random_json(rng, 1)


FIELDS = ["model", "metadata", "mirostat", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "stop", "n", "stream", "stream_options", "seed", "logprobs", "top_logprobs", "tools", "tool_choice",
          "response_format", "user", "repetition_penalty", "presence_penalty", "logit_bias", "echo", "suffix",
          "best_of"]
FUZZ_CASES = 1000


def _random_body(rng: random.Random, endpoint: str) -> Any:
    if rng.random() < 0.03:
        return _random_json(rng)  # a body that is no object, mostly
    body: dict[str, Any] = {}
    if endpoint == CHAT:
        body["messages"] = ([_random_message(rng) for _ in range(rng.randrange(1, 4))] if rng.random() < 0.85
                            else _random_json(rng))
    else:
        body["prompt"] = rng.choice(["Once upon", [5, 6, 7], "\ud800", ""]) if rng.random() < 0.8 else \
            _random_json(rng)
    body["max_tokens"] = rng.randrange(1, 4)  # (answers kept short: the fuzzer's time goes to bodies)
    for name in rng.sample(FIELDS, rng.randrange(4)):
        body[name] = _random_json(rng)
    return body


async def test_fuzzed_bodies_get_an_answer_or_an_openai_error_never_a_500(service: EngineService) -> None:
    rng = random.Random(20240611)
    statuses: dict[int, int] = {}
    async with client(service) as c:
        for case in range(FUZZ_CASES):
            endpoint = rng.choice([CHAT, COMPLETIONS])
            body = _random_body(rng, endpoint)
            raw = json.dumps(body).encode()
            if rng.random() < 0.05:  # a byte cut off or flipped
                at = rng.randrange(max(1, len(raw)))
                raw = raw[:at] + bytes([rng.randrange(256)]) + raw[at + 1 :]
            response = await c.post(endpoint, content=raw)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            if response.status_code == 200:
                assert response.headers["content-type"].startswith(("application/json", "text/event-stream"))
                continue
            assert 400 <= response.status_code < 500, (case, raw[:300], response.status_code, response.text[:300])
            openai_error(response)
        assert (await c.get("/health")).status_code == 200
    assert statuses.get(200, 0) > 10 and sum(v for k, v in statuses.items() if k >= 400) > 100, statuses



def test_a_request_the_http_layer_cannot_parse_gets_an_openai_error(mixtral_dir: Path) -> None:
    """Malformed HTTP (a Content-Length that is no number, or negative; control bytes in a header): refused by the
    HTTP layer before the app sees it, in OpenAI's shape all the same."""
    import socket

    from tandem.app.serve.server import BackgroundServer
    from tests.test_serve import serving

    with serving(mixtral_dir) as (_, server):
        assert isinstance(server, BackgroundServer)
        for head in (b"Content-Length: 99999999999999999999999999\r\n", b"Content-Length: -1\r\n",
                     b"X-Junk: a\x01b\r\n"):
            with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + head + b"\r\n{}")
                raw = b""
                while chunk := sock.recv(65536):
                    raw += chunk
            status, _, body = raw.partition(b"\r\n\r\n")
            assert status.startswith(b"HTTP/1.1 400") and b"application/json" in status.lower(), raw[:200]
            error = json.loads(body)["error"]
            assert error["code"] == "invalid_http_request" and "malformed" in error["message"]
